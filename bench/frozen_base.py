"""The frozen base sharded or replicated on 2 CPU ranks (tokens/s and bytes per step), and one process with FSDP2
against one without it, on a small CPU model, in one run.

Each round trains the same LoRA run (bf16 or fp32, packed rows, checkpointed blocks), each time in a fresh process:
on 2 ranks (torchrun, gloo) with `--frozen_base sharded` and with `--frozen_base replicated`, then on one process
under SHARDTUNE_FSDP_SINGLE_PROCESS=fsdp and under the default (no FSDP), each pair in alternating order.

Tokens/s. shardtune's train records carry `tokens` (counted from the start of training) and `tokens_per_s`, which
is the average since the start of the first step. So each record's elapsed time is tokens / tokens_per_s, and the
speed after the first step (which builds the caches) is (tokens_n - tokens_1) / (elapsed_n - elapsed_1); the JSON
also has each run's median step. Other jobs on this shared 2-core machine slow whichever run they meet by far more
than the effects measured, so each rank also notes, at each step's entry, the clock, its own CPU time and the
machine's busy time (/proc/stat): a step's `other_cpu_s` is the busy time less the ranks' own. Steps 2..S-1 of all
rounds are then pooled per contender (tokens / seconds), all of them and the quiet ones (other jobs under 10% of
the CPU), and the whole run's `other_cpu_s` is recorded too.

Bytes per step. Every rank runs `shardtune.cli.main(["train", ...])` inside this script (`--_rank`), with the
collectives wrapped to count calls and bytes by kind:

- torch.distributed's functions (in `torch.distributed` and in `distributed_c10d`, whose deprecated functions call
  the new ones through its own globals). FSDP2 calls `dist.all_gather_single` and `dist.reduce_scatter_single`
  through the module attribute at call time (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), so the
  wrapped function is the one it calls. shardtune's own collectives (loss and token sums, the per-step stop check,
  the memory gathered for each log record) go through these too.
- the functional collectives (`torch.distributed._functional_collectives`), which DTensor calls as `funcol.X` when
  it redistributes, e.g. the gradient norm of the sharded adapters' gradients in `clip_grad_norm`.

A call counts only if it called no other counted collective (the innermost call counts), so a deprecated alias
or `all_gather_object` counts once, as the tensor collective that does the work. The bytes of a call are those of
the whole (unsharded) tensor it produces or reduces: an all-gather's output, a reduce-scatter's input, an
all-reduce's or broadcast's tensor. On a ring of N ranks each rank sends and receives (N - 1) / N of that (an
all-reduce twice that), so on 2 ranks the wire traffic per rank is half the counted bytes (all-reduce: equal).

Counting only the training steps: the counters are snapshotted each time `shardtune.training.trainer.train_step` is
entered, so step k's bytes are what was counted from its entry to the next step's entry: its forward and
backward, the gradient-norm all-reduce, the optimizer step, its log record and the stop check. The last step is
left out (its interval runs into the final save), so a run of S steps gives S - 1 complete steps.

Checked against arithmetic: the script also records, when `shard_model` is called, each FSDP unit's parameters
(each decoder block; the root: embeddings, final norm, head, trainable token rows). Under FULL_SHARD every block
but the last reshards after forward (fsdp.shard_model), so a step all-gathers blocks 0..L-2 twice (forward, and
backward, whose gather the checkpointed recompute runs inside: FSDP2 skips its pre-forward unshard during
backward) and the last block and the root once. The expected all-gather bytes per step are the sum over units of
gathers x (frozen + trainable parameters, or trainable only when replicated) x the compute dtype's size; the
expected reduce-scatter bytes are the trainable parameters x 4 (gradients are reduced in fp32, or fp32 anyway).

    python bench/frozen_base.py --rounds 3 --steps 15 --dtype bf16
"""

from __future__ import annotations

import argparse
import functools
import inspect
import itertools
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "broadcast", "scatter", "other", "barrier")
FSDP_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
}
MODEL = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2}
ROWS_PER_STEP = 4  # packed rows per optimizer step, all ranks together

# ---------------------------------------------------------------------------------------------------------------
# Rank side: count the collectives of one `shardtune train` process


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _sum_bytes(ts) -> int:
    """Bytes of a list of tensors, or of a list of lists (all_gather_coalesced)."""
    return sum(_sum_bytes(t) if isinstance(t, list | tuple) else _nbytes(t) for t in ts)


def _funcol_group_size(group) -> int:
    """Ranks in a functional collective's group (a ProcessGroup, a mesh and dimension, a list of ranks...)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    resolved = funcol._resolve_group(group)
    if isinstance(resolved, str):  # a group's name (as DTensor passes it)
        resolved = c10d._resolve_process_group(resolved)
    return dist.get_world_size(resolved)


# (function name, kind, bytes of the call from its bound arguments).
C10D = [
    ("all_gather_single", "all-gather", lambda a: _nbytes(a["output_tensor"])),
    ("all_gather_into_tensor", "all-gather", lambda a: _nbytes(a["output_tensor"])),
    ("_all_gather_base", "all-gather", lambda a: _nbytes(a["output_tensor"])),
    ("all_gather", "all-gather", lambda a: _sum_bytes(a["tensor_list"])),
    ("all_gather_coalesced", "all-gather", lambda a: _sum_bytes(a["output_tensor_lists"])),
    ("reduce_scatter_single", "reduce-scatter", lambda a: _nbytes(a["input"])),
    ("reduce_scatter_tensor", "reduce-scatter", lambda a: _nbytes(a["input"])),
    ("_reduce_scatter_base", "reduce-scatter", lambda a: _nbytes(a["input"])),
    ("reduce_scatter", "reduce-scatter", lambda a: _sum_bytes(a["input_list"])),
    ("all_reduce", "all-reduce", lambda a: _nbytes(a["tensor"])),
    ("all_reduce_coalesced", "all-reduce", lambda a: _sum_bytes(a["tensors"])),
    ("broadcast", "broadcast", lambda a: _nbytes(a["tensor"])),
    ("scatter", "scatter", lambda a: _nbytes(a["tensor"]) * _world()),
    ("all_to_all_single", "other", lambda a: _nbytes(a["input"])),
    ("reduce", "other", lambda a: _nbytes(a["tensor"])),
    ("gather", "other", lambda a: _nbytes(a["tensor"]) * _world()),
    ("barrier", "barrier", lambda a: 0),
]
FUNCOL = [
    ("all_reduce", "all-reduce", lambda a: _nbytes(a["self"])),
    ("all_reduce_coalesced", "all-reduce", lambda a: _sum_bytes(a["self"])),
    ("broadcast", "broadcast", lambda a: _nbytes(a["self"])),
    ("all_to_all_single", "other", lambda a: _nbytes(a["self"])),
]
FUNCOL += [
    (name, "all-gather", lambda a: _nbytes(a["self"]) * _funcol_group_size(a["group"]))
    for name in ("all_gather_single", "all_gather_tensor", "all_gather_single_autograd", "all_gather_tensor_autograd")
]
FUNCOL += [
    (name, "all-gather", lambda a: _sum_bytes(a["self"]) * _funcol_group_size(a["group"]))
    for name in ("all_gather_single_coalesced", "all_gather_into_tensor_coalesced")
]
FUNCOL += [
    (name, "reduce-scatter", lambda a: _nbytes(a["self"]))
    for name in (
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "reduce_scatter_single_autograd",
        "reduce_scatter_tensor_autograd",
    )
]
FUNCOL += [
    (name, "reduce-scatter", lambda a: _sum_bytes(a["inputs"]))
    for name in ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced")
]


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


class Counter:
    """Calls and bytes of each collective function ("dist.all_gather_single", "funcol.all_reduce"...), counted on
    the innermost collective only (see the module docstring); `kind` maps each to its kind."""

    def __init__(self) -> None:
        self.totals: dict[str, dict[str, int]] = {}
        self.kind: dict[str, str] = {}
        self._active = threading.local()

    def wrap(self, fn, label: str, kind: str, size):
        sig = inspect.signature(fn)
        self.totals[label], self.kind[label] = {"calls": 0, "bytes": 0}, kind

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            stack = self._active.__dict__.setdefault("stack", [])
            if stack:
                stack[-1] = True  # the caller is not the innermost collective
            stack.append(False)
            try:
                return fn(*args, **kwargs)
            finally:
                if not stack.pop():
                    self.totals[label]["calls"] += 1
                    self.totals[label]["bytes"] += size(sig.bind(*args, **kwargs).arguments)

        return counted

    def snapshot(self) -> dict:
        return {k: dict(v) for k, v in self.totals.items()}


def install(counter: Counter) -> None:
    """Wrap every collective of the tables where it is looked up: `torch.distributed`, `distributed_c10d` (the
    same function objects, bound twice) and the functional collectives."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    wrapped = {}
    for name, kind, size in C10D:
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        wrapped[name] = counter.wrap(fn, f"dist.{name}", kind, size)
        setattr(c10d, name, wrapped[name])
        if getattr(dist, name, None) is fn:
            setattr(dist, name, wrapped[name])
    for name, kind, size in FUNCOL:
        if (fn := getattr(funcol, name, None)) is not None:
            setattr(funcol, name, counter.wrap(fn, f"funcol.{name}", kind, size))


def record_units(units: list) -> None:
    """Wrap shard_model (as setup.py calls it) to note each FSDP unit's frozen and trainable parameter counts."""
    from shardtune.parallel import setup

    original = setup.shard_model

    def noted(model, *, blocks, **kwargs):
        in_blocks = set()
        for b in blocks:
            ps = list(b.parameters())
            in_blocks.update(id(p) for p in ps)
            units.append(_unit("block", ps))
        units.append(_unit("root", [p for p in model.parameters() if id(p) not in in_blocks]))
        return original(model, blocks=blocks, **kwargs)

    setup.shard_model = noted


def _unit(name: str, params: list) -> dict:
    return {
        "unit": name,
        "frozen": sum(p.numel() for p in params if not p.requires_grad),
        "trainable": sum(p.numel() for p in params if p.requires_grad),
    }


def cpu_clock(children: bool) -> tuple[float, float, float]:
    """(wall clock, CPU seconds of this process or of its finished children, CPU seconds the whole machine was
    busy or stolen): over an interval, busy minus own is what other jobs took from the cores."""
    import resource
    import time

    ru = resource.getrusage(resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF)
    # user nice system idle iowait irq softirq steal (guest time is inside user already); steal is time the
    # hypervisor gave to other machines, so it counts as taken too
    jiffies = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    busy = (sum(jiffies) - jiffies[3] - jiffies[4]) / os.sysconf("SC_CLK_TCK")
    return time.perf_counter(), ru.ru_utime + ru.ru_stime, busy


def rank_main(result: str, argv: list[str]) -> int:
    """One rank: count collectives, snapshot them at each train_step entry, train, write the counts."""
    from shardtune.cli import main as cli_main
    from shardtune.training import trainer

    counter, snapshots, clocks, units = Counter(), [], [], []
    install(counter)
    record_units(units)
    original = trainer.train_step

    def step_start(*args, **kwargs):
        snapshots.append(counter.snapshot())
        clocks.append(cpu_clock(children=False))
        return original(*args, **kwargs)

    trainer.train_step = step_start
    rc = cli_main(argv)
    snapshots.append(counter.snapshot())
    clocks.append(cpu_clock(children=False))
    rank = int(os.environ.get("RANK", "0"))
    out = {"snapshots": snapshots, "clocks": clocks, "kind": counter.kind, "units": units}
    Path(f"{result}.rank{rank}.json").write_text(json.dumps(out))
    return rc


# ---------------------------------------------------------------------------------------------------------------
# Parent side: assets, runs, summary


def _assets(root: Path) -> dict[str, Path]:
    from shardtune.commands.demo import build_model, build_tokenizer, write_chat_dataset

    tok = build_tokenizer(root / "model", vocab_size=600)
    build_model(root / "model", vocab_size=len(tok), **MODEL)
    write_chat_dataset(root / "data", n_train=600, n_test=8, seed=3)
    return {"model": root / "model", "data": root / "data", "cache": root / "cache"}


def _train_args(assets, out: Path, steps: int, dtype: str, world: int, extra: list[str]) -> list[str]:
    args = ["--model_name_or_path", assets["model"], "--dataset_name", assets["data"], "--chat_template_format"]
    args += ["chatml", "--packing", "True", "--max_seq_len", "256"]
    args += ["--per_device_train_batch_size", ROWS_PER_STEP // world, "--dataset_cache_dir", assets["cache"]]
    args += ["--max_steps", steps, "--logging_steps", "1", "--save_strategy", "no", "--gradient_checkpointing"]
    args += ["True", "--use_peft_lora", "True", "--lora_r", "8", "--lora_target_modules", "all-linear"]
    args += ["--bf16", str(dtype == "bf16"), "--output_dir", out, *extra]
    return ["train", *map(str, args)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(assets, out: Path, steps: int, dtype: str, world: int, extra: list[str], env: dict) -> dict:
    """Train once in fresh process(es) (torchrun for 2 ranks); tokens/s and each rank's counts."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **env}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(k, None)
    me = [str(Path(__file__).resolve()), "--_rank", str(out / "counts"), "--"]
    me += _train_args(assets, out, steps, dtype, world, extra)
    launch = [sys.executable]
    if world > 1:
        launch += ["-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", str(_free_port())]
    before = cpu_clock(children=True)
    proc = subprocess.run([*launch, *me], env=full_env, capture_output=True, text=True, check=False)
    after = cpu_clock(children=True)
    if proc.returncode != 0:
        raise RuntimeError(f"run {out.name} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    ranks = [json.loads((out / f"counts.rank{r}.json").read_text()) for r in range(world)]
    wall, own, busy = (b - a for a, b in zip(before, after, strict=True))
    load = {"wall_s": wall, "own_cpu_s": own, "other_cpu_s": max(busy - own, 0.0)}
    return {**speed_after_first_step(out), "steps": _timed_steps(out, ranks), "load": load, **_per_step(ranks)}


def speed_after_first_step(out: Path) -> dict[str, float]:
    """Tokens/s from the end of the first step to the end of the last, and of the median step (module docstring)."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    train = [r for r in map(json.loads, lines) if r.get("type") == "train"]
    ends = [(r["tokens"], r["tokens"] / r["tokens_per_s"]) for r in train]  # (tokens, seconds) at each step's end
    steps = sorted(((t1 - t0) / (s1 - s0) for (t0, s0), (t1, s1) in itertools.pairwise(ends)))
    mean = (ends[-1][0] - ends[0][0]) / (ends[-1][1] - ends[0][1])
    return {"tokens_per_s": mean, "tokens_per_s_median_step": statistics.median(steps)}


def _timed_steps(out: Path, ranks: list[dict]) -> list[dict]:
    """Steps 2..S-1 of a run: tokens, seconds (rank 0's train_step entry to the next) and the CPU seconds other
    jobs took meanwhile (the machine's busy time less every rank's own). The steps are in lockstep (each waits
    for the other rank's collectives), so the ranks' intervals cover the same time."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    tokens = [0] + [r["tokens"] for r in map(json.loads, lines) if r.get("type") == "train"]
    clocks = [r["clocks"] for r in ranks]
    steps = []
    for k in range(1, len(clocks[0]) - 2):  # step k + 1 runs from entry k to entry k + 1
        wall = clocks[0][k + 1][0] - clocks[0][k][0]
        own = sum(c[k + 1][1] - c[k][1] for c in clocks)
        other = clocks[0][k + 1][2] - clocks[0][k][2] - own
        steps.append({"tokens": tokens[k + 1] - tokens[k], "seconds": wall, "other_cpu_s": max(other, 0.0)})
    return steps


def _step_deltas(snapshots: list[dict]) -> list[dict]:
    """Calls and bytes of each function in each complete step: from one step's entry to the next's. The last
    snapshot (end of the run) is dropped: the last step's interval runs into the final save."""
    snaps = snapshots[:-1]
    return [{f: {x: b[f][x] - a[f][x] for x in ("calls", "bytes")} for f in a} for a, b in itertools.pairwise(snaps)]


def _rank_per_step(rank: dict) -> dict:
    """One rank's per-step counts: by kind (the median over steps, the lower of the middle two, and the bytes'
    min and max) and by function (the median; functions not called during the steps left out)."""
    steps = _step_deltas(rank["snapshots"])
    kind_of = rank["kind"]
    sums = [{k: [sum(s[f][x] for f in s if kind_of[f] == k) for x in ("calls", "bytes")] for k in KINDS} for s in steps]
    by_kind = {
        k: {
            "calls": statistics.median_low(s[k][0] for s in sums),
            "bytes": statistics.median_low(s[k][1] for s in sums),
            "bytes_min": min(s[k][1] for s in sums),
            "bytes_max": max(s[k][1] for s in sums),
        }
        for k in KINDS
    }
    by_function = {
        f: {x: statistics.median_low(s[f][x] for s in steps) for x in ("calls", "bytes")}
        for f in steps[0]
        if any(s[f]["calls"] for s in steps)
    }
    return {"by_kind": by_kind, "by_function": by_function}


def _per_step(ranks: list[dict]) -> dict:
    steps = len(_step_deltas(ranks[0]["snapshots"]))
    return {"per_step": [_rank_per_step(r) for r in ranks], "steps_counted": steps, "units": ranks[0]["units"]}


def _expected(units: list[dict], dtype: str, replicated: bool) -> dict[str, int]:
    """All-gather and reduce-scatter bytes per step from the units' parameter counts (module docstring)."""
    size = 2 if dtype == "bf16" else 4
    n_blocks = sum(u["unit"] == "block" for u in units)  # the blocks come first, in order, then the root
    gathers = [2] * (n_blocks - 1) + [1] * (len(units) - n_blocks + 1)  # the last block and the root: once
    gathered = [u["trainable"] + (0 if replicated else u["frozen"]) for u in units]
    return {
        "all-gather": sum(g * n * size for g, n in zip(gathers, gathered, strict=True)),
        "reduce-scatter": sum(u["trainable"] for u in units) * 4,
    }


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else the machine type."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(x.split(":", 1)[1].strip() for x in lines if x.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


RUNS = {  # name: (world size, extra train flags, environment)
    "sharded": (2, ["--frozen_base", "sharded"], FSDP_ENV),
    "replicated": (2, ["--frozen_base", "replicated"], FSDP_ENV),
    "fsdp": (1, [], {"SHARDTUNE_FSDP_SINGLE_PROCESS": "fsdp"}),
    "no_fsdp": (1, [], {"SHARDTUNE_FSDP_SINGLE_PROCESS": "auto"}),
}


def _rounds(assets, tmp: Path, rounds: int, steps: int, dtype: str) -> dict[str, list[dict]]:
    """Each pair of contenders in turn, the order within a pair alternating from round to round: the machine's
    load shifts over minutes, and the ratio within a round is what is compared."""
    got: dict[str, list[dict]] = {name: [] for name in RUNS}
    for r in range(rounds):
        for pair in (("sharded", "replicated"), ("fsdp", "no_fsdp")):
            for name in pair if r % 2 == 0 else pair[::-1]:
                world, extra, env = RUNS[name]
                got[name].append(_run(assets, tmp / f"{name}{r}", steps, dtype, world, extra, env))
    return got


def _bytes(n: float) -> str:
    return f"{n:,.0f} B"


# The function FSDP2 issues each collective of its units with (_fsdp_collectives.py), for the arithmetic check.
FSDP_CALL = {"all-gather": "dist.all_gather_single", "reduce-scatter": "dist.reduce_scatter_single"}


def _check(got: dict[str, list[dict]], dtype: str) -> None:
    """Print expected against counted bytes per step for FSDP's all-gathers and reduce-scatters, per rank."""
    units, size = got["sharded"][0]["units"], 2 if dtype == "bf16" else 4
    blocks = [u for u in units if u["unit"] == "block"]
    print(
        f"check: expected all-gather per step = 2 x blocks 0..{len(blocks) - 2} + 1 x block {len(blocks) - 1} + "
        f"1 x root, each (frozen + trainable parameters; trainable only when replicated) x {size} B; "
        f"reduce-scatter = trainable parameters x 4 B; a block {blocks[0]['frozen']:,} frozen + "
        f"{blocks[0]['trainable']:,} trainable, the root {units[-1]['frozen']:,} + {units[-1]['trainable']:,}"
    )
    for name in ("sharded", "replicated"):
        run = got[name][0]
        exp = _expected(run["units"], dtype, name == "replicated")
        for rank, counts in enumerate(run["per_step"]):
            for kind, fn in FSDP_CALL.items():
                fsdp = counts["by_function"].get(fn, {"calls": 0, "bytes": 0})
                total = counts["by_kind"][kind]
                rest = total["bytes"] - fsdp["bytes"]
                same = "the same" if total["bytes_min"] == total["bytes_max"] else "NOT the same"
                print(
                    f"check {name} rank {rank} {kind} per step: expected {exp[kind]:,} B, counted {fsdp['bytes']:,} B "
                    f"in {fn} ({fsdp['calls']:g} calls; counted/expected {fsdp['bytes'] / exp[kind]:.6f}), "
                    f"+ {rest:,} B in other {kind} calls; {same} in each of {run['steps_counted']} steps"
                )


# A step is quiet when other jobs took less than this share of the machine's CPU time while it ran.
QUIET = 0.1


def _pooled(steps: list[dict]) -> dict:
    """Tokens/s over all timed steps of all rounds, and over the quiet ones only (other jobs only ever slow a step
    down, so the quiet steps are the closest to what the contender does on an idle machine)."""
    cores = os.cpu_count() or 1
    quiet = [st for st in steps if st["other_cpu_s"] < QUIET * cores * st["seconds"]]

    def rate(sts: list[dict]) -> dict:
        seconds = sum(st["seconds"] for st in sts)
        return {"tokens_per_s": sum(st["tokens"] for st in sts) / seconds if sts else float("nan"), "steps": len(sts)}

    return {"all": rate(steps), "quiet": rate(quiet)}


def _summary(got: dict[str, list[dict]]) -> dict:
    """Per round tokens/s, the ratios, and rank 0's median bytes per step by kind (asserted equal on every rank
    and in every round)."""

    def ratios(a: str, b: str, key: str = "tokens_per_s") -> list[float]:
        return [x[key] / y[key] for x, y in zip(got[a], got[b], strict=True)]

    out = {"tokens_per_s": {n: [x["tokens_per_s"] for x in runs] for n, runs in got.items()}}
    out["ratio replicated/sharded"] = ratios("replicated", "sharded")
    out["ratio no_fsdp/fsdp"] = ratios("no_fsdp", "fsdp")
    out["tokens_per_s_median_step"] = {n: [x["tokens_per_s_median_step"] for x in runs] for n, runs in got.items()}
    out["median step ratio replicated/sharded"] = ratios("replicated", "sharded", "tokens_per_s_median_step")
    out["median step ratio no_fsdp/fsdp"] = ratios("no_fsdp", "fsdp", "tokens_per_s_median_step")
    out["other_cpu_s"] = {n: [round(x["load"]["other_cpu_s"], 1) for x in runs] for n, runs in got.items()}
    out["pooled_steps"] = {n: _pooled([st for x in runs for st in x["steps"]]) for n, runs in got.items()}
    for a, b in (("replicated", "sharded"), ("no_fsdp", "fsdp")):
        pa, pb = out["pooled_steps"][a], out["pooled_steps"][b]
        out[f"pooled ratio {a}/{b}"] = {k: pa[k]["tokens_per_s"] / pb[k]["tokens_per_s"] for k in ("all", "quiet")}
    out["bytes_per_step_rank0"] = {}
    for name in ("sharded", "replicated"):
        per_rank = [{k: v["bytes"] for k, v in c["by_kind"].items()} for x in got[name] for c in x["per_step"]]
        assert all(p == per_rank[0] for p in per_rank), f"{name}: bytes per step differ between ranks or rounds"
        out["bytes_per_step_rank0"][name] = per_rank[0]
    return out


def _ratios(rounds: list[float], median_steps: list[float]) -> str:
    return (
        f"x{statistics.median(rounds):.3f} (rounds {', '.join(f'{x:.3f}' for x in rounds)}; median steps "
        f"{', '.join(f'{x:.3f}' for x in median_steps)})"
    )


def _print_summary(s: dict, dtype: str, cpu: str) -> None:
    b, rep, one = s["bytes_per_step_rank0"], s["ratio replicated/sharded"], s["ratio no_fsdp/fsdp"]
    rep_med, one_med = s["median step ratio replicated/sharded"], s["median step ratio no_fsdp/fsdp"]
    by_kind = ", ".join(
        f"{k} {_bytes(b['sharded'][k])} -> {_bytes(b['replicated'][k])}"
        + (f" (x{b['replicated'][k] / b['sharded'][k]:.4f})" if b["sharded"][k] else "")
        for k in ("all-gather", "reduce-scatter", "all-reduce", "broadcast")
    )
    print(
        f"2 ranks, {dtype}, {cpu}: replicated/sharded tokens/s {_ratios(rep, rep_med)}; per rank per step, "
        f"sharded -> replicated: {by_kind}; 1 process: without/with FSDP tokens/s {_ratios(one, one_med)}"
    )
    print(f"other jobs' CPU seconds during each run (round by round): {s['other_cpu_s']}")
    for a, b in (("replicated", "sharded"), ("no_fsdp", "fsdp")):
        pa, pb, r = s["pooled_steps"][a], s["pooled_steps"][b], s[f"pooled ratio {a}/{b}"]
        print(
            f"pooled steps 2..S-1 of all rounds, {a} vs {b}: all {pa['all']['tokens_per_s']:.0f} vs "
            f"{pb['all']['tokens_per_s']:.0f} tokens/s (x{r['all']:.3f}); quiet (other jobs < {QUIET:.0%} of the "
            f"CPU) {pa['quiet']['tokens_per_s']:.0f} vs {pb['quiet']['tokens_per_s']:.0f} (x{r['quiet']:.3f}; "
            f"{pa['quiet']['steps']} and {pb['quiet']['steps']} of {pa['all']['steps']} steps)"
        )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--_rank":
        sys.exit(rank_main(sys.argv[2], sys.argv[4:]))  # --_rank RESULT -- train ...
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    a = ap.parse_args()
    cpu, load_before = cpu_name(), os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        assets = _assets(Path(tmp))
        got = _rounds(assets, Path(tmp), a.rounds, a.steps, a.dtype)
    summary = _summary(got)
    record = {"cpu": cpu, "dtype": a.dtype, "rounds": a.rounds, "steps": a.steps, "model": MODEL}
    record["load_average_1_5_15"] = {"before": load_before, "after": os.getloadavg()}  # other jobs slow rounds
    print(json.dumps({**record, "summary": summary, "runs": got}))
    _check(got, a.dtype)
    _print_summary(summary, a.dtype, cpu)


if __name__ == "__main__":
    main()
