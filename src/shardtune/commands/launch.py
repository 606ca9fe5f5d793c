"""`shardtune launch`: start `shardtune train` on every process of one or more machines through torchrun.

`accelerate launch --config_file X script.py` turns the YAML into environment variables and starts the script
through torchrun. `shardtune launch --config_file X [train flags]` does the same without accelerate: it reads the
YAML (shardtune.config.accelerate), sets the same variables and starts `python -m shardtune train` through
torchrun (shardtune.parallel.torchrun: `torch.distributed.run`, a stop ending in one line rather than a traceback).
Either way `shardtune train` reads its FSDP settings with shardtune.config.fsdp.fsdp_settings_from_env.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

from shardtune.config.accelerate import accelerate_env, read_accelerate_yaml
from shardtune.config.errors import ConfigError
from shardtune.config.fsdp import fsdp_settings_from_env, parallelism_plan
from shardtune.parallel import torchrun
from shardtune.runtime.parent import child_preexec
from shardtune.runtime.stop import STOPPED_EXIT_CODE, StopHandler, Stopped

_RDZV_BACKENDS = ("static", "c10d")

_LAUNCH_FLAGS = (
    "num_processes",
    "num_machines",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "rdzv_backend",
)

_EPILOG = """\
Every flag not listed above goes to `shardtune train`, e.g.:
  shardtune launch --config_file configs/fsdp_config.yaml --seed 100 --model_name_or_path MODEL ...
Two machines with 8 processes each (run on each machine, with its own --machine_rank):
  shardtune launch --config_file configs/fsdp_config.yaml --num_machines 2 --num_processes 16 \\
      --machine_rank 0 --main_process_ip 10.0.0.1 --main_process_port 29500 [train flags]
The processes see the FSDP_*/ACCELERATE_* variables `accelerate launch --config_file FILE` would set, and
ACCELERATE_USE_CPU from use_cpu.
"""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="shardtune launch",
        allow_abbrev=False,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start `shardtune train` on every process of one or more machines through torchrun, with the "
        "settings of an accelerate FSDP config file. Flags override the file.",
    )

    def add(name: str, **kw: Any) -> None:
        ap.add_argument(f"--{name}", f"--{name.replace('_', '-')}", dest=name, **kw)

    add("config_file", required=True, metavar="FILE", help="accelerate config YAML (distributed_type: FSDP).")
    add("num_processes", type=int, metavar="N", help="Total processes over all machines (accelerate's meaning).")
    add("num_machines", type=int, metavar="M", help="Number of machines.")
    add("machine_rank", type=int, metavar="R", help="This machine's rank, 0..M-1 (static rendezvous).")
    add("main_process_ip", metavar="IP", help="Address of machine 0 (multi-machine runs).")
    add(
        "main_process_port",
        type=int,
        metavar="P",
        help="Port on machine 0 (multi-machine default 29500; one machine: a free port when unset or 0).",
    )
    add(
        "rdzv_backend",
        choices=_RDZV_BACKENDS,
        help="static: ranks from --machine_rank; c10d: torchrun's "
        "dynamic rendezvous at IP:P (machine ranks assigned on arrival).",
    )
    add("nproc_per_node", type=int, metavar="K", help="Processes per machine (default: num_processes / num_machines).")
    add("dry_run", action="store_true", help="Print the torchrun command and environment, start nothing.")
    return ap


@dataclass
class LaunchPlan:
    """What `shardtune launch` runs: the command and the variables it adds to the environment."""

    cmd: list[str]
    env: dict[str, str]
    dry_run: bool = False
    # The variables torchrun gives each process, which the preflight checks the flags against (world size, a
    # machine's processes): --context_parallel_size must divide them.
    process_env: dict[str, str] = field(default_factory=dict)


def _topology(cfg: dict[str, Any], ns: argparse.Namespace, path: str) -> dict[str, Any]:
    """The YAML's launch keys with the flags given on the command line applied; check them together."""
    given = {k for k in _LAUNCH_FLAGS if getattr(ns, k) is not None}
    t = {k: (getattr(ns, k) if k in given else cfg.get(k)) for k in _LAUNCH_FLAGS}
    src = {k: (f"--{k}" if k in given else f"{k} in {path}") for k in _LAUNCH_FLAGS}
    defaults = {"num_machines": 1, "machine_rank": 0, "rdzv_backend": "static"}
    t.update({k: v for k, v in defaults.items() if t[k] is None})
    problems = []
    for k in ("num_processes", "num_machines", "machine_rank", "main_process_port"):
        if t[k] is not None:
            try:
                t[k] = int(t[k])
            except (TypeError, ValueError):
                problems.append(f"{k} {t[k]!r} ({src[k]}) must be a whole number")
    if problems:
        raise ConfigError(problems)
    if ns.nproc_per_node is not None and "num_processes" not in given:
        t["num_processes"] = ns.nproc_per_node * t["num_machines"]
        src["num_processes"] = "--nproc_per_node × num_machines"
    problems = _topology_problems(t, src, ns.nproc_per_node)
    if problems:
        raise ConfigError(problems)
    t["nproc_per_node"] = ns.nproc_per_node or t["num_processes"] // t["num_machines"]
    return t


def _topology_problems(t: dict[str, Any], src: dict[str, str], nproc_per_node: int | None) -> list[str]:
    n, m, r, port = t["num_processes"], t["num_machines"], t["machine_rank"], t["main_process_port"]
    if n is None or n < 1:
        hint = "give the total number of processes over all machines, e.g. --num_processes 8"
        return [f"num_processes {n!r} ({src['num_processes']}): {hint}"]
    p = []
    if m < 1:
        p.append(f"num_machines {m} ({src['num_machines']}) must be >= 1")
    elif n % m:
        p.append(
            f"num_processes {n} ({src['num_processes']}) is not divisible by num_machines {m} "
            f"({src['num_machines']}): num_processes is the total over all machines; use a multiple of {m}, "
            f"e.g. {m * max(1, n // m)}"
        )
    elif nproc_per_node is not None and nproc_per_node * m != n:
        p.append(
            f"--nproc_per_node {nproc_per_node} × num_machines {m} != num_processes {n} "
            f"({src['num_processes']}); drop one of --nproc_per_node/--num_processes"
        )
    if not 0 <= r < max(m, 1):
        p.append(f"machine_rank {r} ({src['machine_rank']}) must be in 0..{m - 1}; give each machine its own rank")
    if m > 1 and not t["main_process_ip"]:
        p.append(
            f"main_process_ip is required with num_machines {m}: pass --main_process_ip with the address of "
            "machine 0 (the same on every machine)"
        )
    if port is not None and not 0 <= port < 65536:
        p.append(f"main_process_port {port} ({src['main_process_port']}) must be a port number (0 = pick a free one)")
    if t["rdzv_backend"] not in _RDZV_BACKENDS:
        p.append(f"rdzv_backend {t['rdzv_backend']!r} ({src['rdzv_backend']}): use static or c10d")
    return p


def torchrun_args(t: Mapping[str, Any]) -> list[str]:
    """torch.distributed.run options for a topology (accelerate's num_processes/num_machines/... keys)."""
    m, port, ip = t["num_machines"], t["main_process_port"], t["main_process_ip"]
    args = ["--nnodes", str(m), "--nproc-per-node", str(t["nproc_per_node"])]
    c10d = t["rdzv_backend"] == "c10d"
    if m > 1:
        port = port or 29500
        if c10d:
            return args + ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ip}:{port}"]
        return args + ["--node-rank", str(t["machine_rank"]), "--master-addr", str(ip), "--master-port", str(port)]
    if not port:  # torchrun picks a free port on one machine (static, no port → c10d on localhost:0)
        return args + (["--standalone"] if c10d else [])
    if c10d:
        return args + ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ip or 'localhost'}:{port}"]
    return args + ["--master-addr", str(ip or "127.0.0.1"), "--master-port", str(port)]


def _omp_threads(use_cpu: bool, nproc_per_node: int) -> str:
    """OMP_NUM_THREADS as `accelerate launch` sets it: the caller's value, else the physical cores shared by the
    processes of a CPU run, else 1."""
    if os.environ.get("OMP_NUM_THREADS"):
        return os.environ["OMP_NUM_THREADS"]
    if use_cpu:
        return str(max(1, (psutil.cpu_count(logical=False) or 1) // nproc_per_node))
    return "1"


def build_launch(argv: Sequence[str], entry: Sequence[str] = ("-m", "shardtune", "train")) -> LaunchPlan:
    """Parse `shardtune launch` flags; the rest are appended to `entry` (a module with -m, or a script)."""
    ns, train_args = _split(argv)
    cfg = read_accelerate_yaml(ns.config_file)
    t = _topology(cfg, ns, ns.config_file)
    use_cpu = bool(cfg.get("use_cpu", False))
    env = {**accelerate_env(cfg), "ACCELERATE_USE_CPU": str(use_cpu)}
    # accelerate's parallelism_config, refused here as `shardtune train` refuses it (before any process starts).
    _, problems = parallelism_plan(fsdp_settings_from_env(env), t["num_processes"], t["nproc_per_node"])
    if problems:
        raise ConfigError([f"{ns.config_file}: {p}" for p in problems])
    env["OMP_NUM_THREADS"] = _omp_threads(use_cpu, t["nproc_per_node"])
    cmd = torchrun.command([*torchrun_args(t), *entry, *train_args])
    world = {"WORLD_SIZE": str(t["num_processes"]), "LOCAL_WORLD_SIZE": str(t["nproc_per_node"])}
    return LaunchPlan(cmd=cmd, env=env, dry_run=ns.dry_run, process_env=world)


def _split(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the launch's flags, the train flags). A `--` that separates them, as a user of torchrun or of a script's
    launcher may write (`shardtune launch --config_file f.yaml -- --seed 3`), is not one of train's flags."""
    ns, rest = _parser().parse_known_args(list(argv))
    if "--" in rest:
        rest.remove("--")
    return ns, rest


def _train_problems(train_argv: list[str], env: dict[str, str]) -> list[str]:
    """What `shardtune train` would refuse from its flags and the model's files, said before torchrun starts N
    processes that would each say it. The output folder is left to rank 0 of the run: another machine's launcher
    may already have started writing to it."""
    # Imported here, both: the checks load torch and transformers, which --dry_run and --help do not need.
    from shardtune.models.preflight import model_input_problems
    from shardtune.recipe.run_config import load_run_config  # (start-up time, as the line above)

    try:
        return model_input_problems(load_run_config(train_argv, env=env))
    except ConfigError as e:
        return e.problems


def main(argv: Sequence[str] | None = None, entry: Sequence[str] = ("-m", "shardtune", "train")) -> int:
    """`shardtune launch`: start `entry` with the train flags on N processes per machine through torchrun."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        plan = build_launch(argv, entry)
    except ConfigError as e:
        print(f"shardtune launch: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse: --help or a usage error
        return int(e.code or 0)
    if plan.dry_run:
        print("\n".join(f"{k}={v}" for k, v in sorted(plan.env.items())))
        print(shlex.join(plan.cmd))
        return 0
    stopper = StopHandler().install()  # a stop before torchrun starts: one line, exit 3, nothing started
    try:
        if tuple(entry) == ("-m", "shardtune", "train"):
            stopper.at("checking the flags and the model's files")
            env = {**os.environ, **plan.env, **plan.process_env}
            problems = _train_problems(_split(argv)[1], env)
            if problems:
                print(f"shardtune launch: {ConfigError(problems)}", file=sys.stderr)
                return 2
        stopper.at("starting torchrun")
        return _run_torchrun(plan)
    except Stopped as e:
        print(f"shardtune launch: stopped by {e.signal_name} while {e.stage}; no process was started.", file=sys.stderr)
        return STOPPED_EXIT_CODE
    finally:
        stopper.restore()


def _run_torchrun(plan: LaunchPlan) -> int:
    """Start torchrun and wait for it. A stop signal is then passed on to torchrun, which passes it to every
    worker: they finish the step, save a checkpoint and exit 3, and this process waits for them rather than ending
    first (a scheduler that signals only the job's first process would otherwise clean up the workers while they
    save). A signal sent to the whole process group (Ctrl-C in a terminal, a group kill) reaches torchrun twice,
    which it takes as one stop. A stopped launch exits 3."""
    started: list[subprocess.Popen] = []
    pending: list[int] = []

    def pass_on(signum, _frame) -> None:
        pending.append(signum)
        if started and started[0].poll() is None:
            started[0].send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, pass_on)  # in place of the stopper's; stopper.restore() puts back the caller's
    # torchrun gets SIGTERM if this process dies (kill -9 included), and forwards it to its workers. preexec_fn
    # is safe here: the launcher runs no other thread.
    preexec = child_preexec if os.name == "posix" else None
    started.append(subprocess.Popen(plan.cmd, env={**os.environ, **plan.env}, preexec_fn=preexec))  # noqa: PLW1509
    if pending:  # arrived while torchrun was being started, before it could be passed on
        started[0].send_signal(pending[0])
    code = started[0].wait()
    # Stopped: the workers said how (a checkpoint to resume, or nothing trained yet); torchrun's own code on a
    # signal is 1 (or the signal's), so the launch exits 3 as `shardtune train` does.
    return STOPPED_EXIT_CODE if pending and code != 0 else code
