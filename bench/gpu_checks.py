"""The checks of bench/gpu_check.py, each a function of the run's context (a JSON-able dict: device, assets, sizes,
FLOP model, matmul peak) that returns its numbers or raises Skip; bench/gpu_check.py runs each in its own process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import speed
from gpu_numerics import (
    Skip,
    bnb_or_skip,
    build_numerics_model,
    check_attention,
    check_context_parallel,
    check_qlora,
    free_port,
    record,
)

# By value: what only a GPU can show first (the guide's run and its memory against the plan), then the numerics,
# then the resume paths, then what a run on one GPU skips or what needs more than the device budget.
CHECKS = [
    "lora_world1",
    "memory_vs_plan",
    "attention",
    "qlora",
    "kill_resume",
    "bnb_optimizers",
    "context_parallel",
    "lora_world2",
    "offload_loading",
    "reference_stack",
]
# Outside the default run (name them in --only): the offload path has its own 2-rank test on the CPU
# (tests/distributed/test_offload_loading.py) and reloads the 1B model twice through host memory; the reference
# stack is a speed comparison that bench/speed.py makes too. Neither fits the device budget beside the others.
OPT_IN = {"offload_loading", "reference_stack"}
NEEDS_CUDA = {"memory_vs_plan"}
GPUS = {"lora_world2": 2}  # NCCL runs one rank per GPU
SINGLE_PROCESS_ENV = "SHARDTUNE_FSDP_SINGLE_PROCESS"  # shardtune.config.fsdp.SINGLE_PROCESS_ENV
# Planted bugs, for the controls that run on the CPU (tests/e2e/test_gpu_check.py): lora_world1 on the setting named
# here instead of "fsdp" (auto: the plain module, which the check must report as a failure), and the command that
# `memory_vs_plan` traces with (a failing one: the measurements taken before must survive).
LORA_WORLD1_PLANT = "GPU_CHECK_PLANT_SINGLE_PROCESS"
TRACE_CMD_PLANT = "GPU_CHECK_PLANT_TRACE_CMD"


@dataclass
class Size:
    """The model and the run's shape: a ~1B Llama (TinyLlama's widths, 1024-entry vocabulary) or a tiny one."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    inter: int
    seq_len: int
    batch: int  # rows per optimizer step, all ranks together
    warmup: int
    steps: int  # timed steps
    n_train: int


SIZES = {
    "1b": Size(2048, 22, 32, 4, 5632, seq_len=2048, batch=8, warmup=3, steps=8, n_train=6000),
    "tiny": Size(64, 2, 4, 2, 128, seq_len=128, batch=4, warmup=1, steps=4, n_train=400),
}


# --------------------------------------------------------------------------------------------------- assets


def build_assets(workdir: Path, size: Size) -> dict[str, str]:
    """Tokenizer, random bf16 model and chat data, built locally once per size."""
    from shardtune.commands.demo import build_model, build_tokenizer, write_chat_dataset

    model, data = workdir / f"model-{size.hidden}x{size.layers}", workdir / f"data-{size.n_train}"
    if not (model / "config.json").exists():
        tok = build_tokenizer(model, vocab_size=1024)
        build_model(model, vocab_size=len(tok), hidden_size=size.hidden, num_layers=size.layers,
                    num_heads=size.heads, num_kv_heads=size.kv_heads, intermediate_size=size.inter,
                    max_position_embeddings=max(2048, size.seq_len), dtype="bfloat16")  # fmt: skip
    if not (data / "train.jsonl").exists():
        write_chat_dataset(data, n_train=size.n_train, n_test=20)
    numerics = workdir / f"numerics-{size.hidden}"
    if not (numerics / "config.json").exists():
        build_numerics_model(model, numerics)
    return {"model": str(model), "data": str(data), "numerics_model": str(numerics)}


# ------------------------------------------------------------------------------------------ training runs


def _yaml(ctx: dict, world: int, path: str | None = None) -> dict:
    """The accelerate config of a run: the given file (num_processes set to `world`) or the guide's LoRA one."""
    from shardtune.commands.demo import DEMO_FSDP_YAML
    from shardtune.config.accelerate import read_accelerate_yaml

    cfg = read_accelerate_yaml(REPO / path) if path else {**DEMO_FSDP_YAML}
    return {**cfg, "num_processes": world, "use_cpu": ctx["device"] == "cpu", "mixed_precision": "bf16"}


def train_argv(ctx: dict, out: Path, **flags) -> list[str]:
    """`shardtune train` on the check's model and data: the guide's LoRA settings at the check's size."""
    s = Size(**ctx["size"])
    base = {
        "model_name_or_path": ctx["model"], "dataset_name": ctx["data"], "dataset_cache_dir": ctx["cache"],
        "output_dir": out, "chat_template_format": "chatml", "packing": True, "max_seq_len": s.seq_len,
        "per_device_train_batch_size": s.batch, "bf16": True, "gradient_checkpointing": True,
        "use_reentrant": False, "use_peft_lora": True, "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.1,
        "lora_target_modules": "all-linear", "learning_rate": 1e-3, "logging_steps": 1, "seed": 100,
        "eval_strategy": "no", "save_strategy": "no", "max_steps": 4, "log_level": "warning",
    }  # fmt: skip
    return ["train", *(x for k, v in {**base, **flags}.items() for x in (f"--{k}", str(v)))]


def train(ctx: dict, out: Path, *, world: int = 1, yaml: str | None = None, env: dict | None = None,
          expect_ok: bool = True, deterministic: bool = False, **flags) -> subprocess.CompletedProcess:  # fmt: skip
    """Run `shardtune train` with the FSDP settings of `yaml` as accelerate would: one rank in this process (it has
    imported everything already), 2 ranks under torchrun, a run that is to be killed in a process of its own."""
    from shardtune.config.accelerate import accelerate_env

    cfg = _yaml(ctx, world, yaml)
    if "per_device_train_batch_size" not in flags:
        flags["per_device_train_batch_size"] = max(1, ctx["size"]["batch"] // world)
    full_env = {**os.environ, **accelerate_env(cfg), "OMP_NUM_THREADS": str(max(1, ctx["threads"] // world))}
    full_env.update(TOKENIZERS_PARALLELISM="false", **(env or {}))
    if ctx["device"] == "cuda":
        full_env.pop("ACCELERATE_USE_CPU", None)
    args = train_argv(ctx, out, **flags)
    if world == 1 and expect_ok:
        return _train_here(args, {k: v for k, v in full_env.items() if os.environ.get(k) != v})
    cmd = [sys.executable, *(["-c", DETERMINISTIC_PRELUDE] if deterministic else ["-m", "shardtune"]), *args]
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
               "--master_port", str(free_port()), "-m", "shardtune", *args]  # fmt: skip
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, check=False)
    if expect_ok and proc.returncode != 0:
        raise RuntimeError(f"shardtune train exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc


def _train_here(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`shardtune train` in this process, with `env` added for the run (a fresh 1-rank group each time)."""
    from shardtune.commands.train import main as train_main

    saved = dict(os.environ)
    os.environ.update(env)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    try:
        rc = train_main(args[1:])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if rc != 0:
        raise RuntimeError(f"shardtune train exited {rc}")
    return subprocess.CompletedProcess(args, rc)


def losses(out: Path) -> dict[int, float]:
    """Step → loss of the last record of each step (a resumed run redoes the steps after its checkpoint)."""
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r.get("type") == "train"}


def same_adapter(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    x, y = load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def resume_check(ctx: dict, name: str, *, kill: bool = False, world: int = 1, deterministic: bool = False,
                 **kw) -> dict:  # fmt: skip
    """4 steps with a checkpoint every 2, against a run that resumes from checkpoint-2 (copied into a fresh output
    folder, or left by a run SIGKILLed after step 3): steps 3 and 4 and the final adapter must be identical."""
    work = Path(ctx["workdir"]) / name
    shutil.rmtree(work, ignore_errors=True)
    full, resumed = work / "full", work / "resumed"
    flags = {"save_strategy": "steps", "save_steps": 2, "max_steps": 4, **kw}
    flags["deterministic"] = deterministic  # a run in a process of its own starts on deterministic kernels
    train(ctx, full, world=world, **flags)
    if kill:
        proc = train(ctx, resumed, world=world, env={"SHARDTUNE_FAULT": "step:3:0"}, expect_ok=False, **flags)
        if proc.returncode == 0:
            raise RuntimeError("the run meant to be SIGKILLed after step 3 finished")
    else:
        (resumed / "checkpoints").mkdir(parents=True)
        shutil.copytree(full / "checkpoints" / "checkpoint-2", resumed / "checkpoints" / "checkpoint-2")
    train(ctx, resumed, world=world, resume_from_checkpoint="latest", **flags)
    want, got = losses(full), losses(resumed)
    diffs = [abs(got[k] - want[k]) / abs(want[k]) for k in (3, 4) if k in got]
    record(ctx, f"{name}_losses", {"full": want, "resumed": got})
    return {
        "control": resume_control(full, resumed, got),
        "losses": [want[k] for k in sorted(want)],
        "resumed_losses": [got[k] for k in sorted(got) if k > 2],
        "resume_equal": [got.get(3), got.get(4)] == [want[3], want[4]] and same_adapter(full, resumed),
        # 0 when exact; a tiny non-zero value with resume_equal false points at non-deterministic kernels rather
        # than at a state the checkpoint missed (which shows as a difference of the size of a training step's).
        "max_rel_diff": max(diffs) if len(diffs) == 2 else None,
    }


def resume_control(full: Path, resumed: Path, got: dict) -> dict:
    """The planted control of the resume checks: the resumed run's adapter with one element moved by one bf16 ulp,
    and its step-4 loss by one float32 ulp, must each fail the comparison that passes the real resume (a comparison
    that cannot see one ulp cannot see a state the checkpoint missed)."""
    import torch
    from safetensors.torch import load_file, save_file

    planted = resumed.parent / "planted"
    shutil.rmtree(planted, ignore_errors=True)
    planted.mkdir()
    tensors = load_file(resumed / "adapter_model.safetensors")
    key = min(tensors)
    t = tensors[key].clone()
    flat = t.view(-1)
    flat[0] = torch.nextafter(flat[0].float(), torch.tensor(float("inf"))).to(t.dtype)
    if torch.equal(flat[0:1], tensors[key].view(-1)[0:1]):  # one float32 ulp can round away in bf16
        flat[0] = flat[0] + flat[0].abs().clamp_min(1e-3) * 2**-7
    save_file({**tensors, key: t}, planted / "adapter_model.safetensors")
    adapter_seen = not same_adapter(full, planted)
    loss4 = got.get(4)
    loss_seen = loss4 is not None and float(torch.nextafter(torch.tensor(loss4), torch.tensor(float("inf")))) != loss4
    return {
        "planted": f"{key}[0] moved by one ulp; step 4's loss moved by one ulp",
        "failed": adapter_seen and loss_seen,
    }


# ------------------------------------------------------------------------------------------------- checks


def recording_fsdp(decisions: list) -> None:
    """Record every `use_fsdp` decision of the runs in this process (shardtune.parallel.setup reads it by name):
    (FSDP or the plain module, the one line why), so that a check says which path it ran."""
    from shardtune.parallel import setup

    original = setup.use_fsdp

    def use_fsdp(*a, **kw):
        fsdp, why = original(*a, **kw)
        decisions.append([fsdp, why])
        return fsdp, why

    setup.use_fsdp = use_fsdp


def check_lora(ctx: dict, world: int) -> dict:
    """The guide's LoRA run, timed step by step (bench/speed.py's worker), MFU and HFU against the measured peak."""
    import torch

    if ctx["device"] == "cuda" and torch.cuda.device_count() < world:  # the parent does not start it then
        raise Skip(f"needs {world} GPUs: NCCL runs one rank per GPU ({torch.cuda.device_count()} here)")
    size = Size(**ctx["size"])
    s = speed.Settings(model="gpu_check", seq_len=size.seq_len, batch=size.batch, warmup=size.warmup,
                       steps=size.steps, rounds=1, threads=ctx["threads"], lora_dropout=0.1)  # fmt: skip
    c = speed.Contender(f"lora_world{world}", "shardtune_fsdp" if world > 1 else "shardtune",
                        ["--logging_steps", "1", "--learning_rate", "1e-3", "--log_level", "warning"])  # fmt: skip
    workdir = Path(ctx["workdir"]) / c.name
    workdir.mkdir(parents=True, exist_ok=True)
    spec = speed.worker_spec(c, s, ctx, workdir, ctx["device"], ctx["pad_id"])
    spec["cache_dir"] = ctx["cache"]
    Path(spec["dir"], "spec.json").write_text(json.dumps(spec))
    decisions: list = []
    if world == 1:  # bench/speed.py's worker, in this process, on FSDP2 (one process skips FSDP by default)
        os.environ.update({k: v for k, v in speed._env(c, s).items() if k.startswith(("ACCELERATE_", "FSDP_"))})
        os.environ[SINGLE_PROCESS_ENV] = os.environ.get(LORA_WORLD1_PLANT, "fsdp")
        recording_fsdp(decisions)
        ranks = {0: speed.run_shardtune_worker(spec)}
    else:
        me = [str(REPO / "bench" / "speed.py"), "--_worker", str(Path(spec["dir"], "spec.json"))]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), *me]
        proc = subprocess.run(cmd, env=speed._env(c, s), capture_output=True, text=True, cwd=spec["dir"], check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"exit {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
        ranks = {r: json.loads(Path(f"{spec['result']}.rank{r}.json").read_text()) for r in range(world)}
    fm = speed.FlopModel(**ctx["flop_model"])
    summary = speed.summarize([ranks], s, fm, ctx["peak_flops"], recompute=1.0)
    got = losses(Path(spec["output_dir"]))
    ordered = record(ctx, "losses", [got[k] for k in sorted(got)])
    return {
        "fsdp": all(d[0] for d in decisions) if decisions else world > 1,
        "fsdp_decisions": decisions or [[True, f"FSDP: {world} processes shard the model."]],
        "losses": ordered,
        "loss_falls": statistics.fmean(ordered[-2:]) < statistics.fmean(ordered[:2]),
        "tokens_per_s": summary["tokens_per_s"],
        "step_s": summary["step_s"],
        "mfu": summary["mfu"],
        "hfu": summary["hfu"],
        "recompute": summary["recompute"],
        "memory_gb_per_rank": summary["train_peak_gb_per_rank"],
    }


def check_offload_loading(ctx: dict) -> dict:
    import torch

    world = 2 if ctx["device"] == "cpu" else min(2, torch.cuda.device_count())
    quantized = importlib.util.find_spec("bitsandbytes") is not None
    yaml = "configs/fsdp_config_qlora.yaml" if ctx["device"] == "cuda" else "configs/fsdp_config_qlora_cpu.yaml"
    kw = {"use_4bit_quantization": True, "bnb_4bit_quant_storage_dtype": "bfloat16"} if quantized else {}
    out = resume_check(ctx, "offload_loading", world=world, yaml=yaml, lora_dropout=0.0, **kw)
    notes = [] if quantized else ["bitsandbytes not installed: a bf16 base instead of 4-bit"]
    if world == 1:
        notes.append("1 GPU: efficient loading has no other rank to send to (offload itself runs)")
    return {**out, "world": world, "quantized": quantized, "notes": notes}


def _resume_shape(ctx: dict) -> dict:
    """The resume checks' rows: what they prove does not depend on the step's size, so 4 rows of at most 512
    tokens (the run's time is the processes' start and the checkpoint, not the steps)."""
    return {
        "max_seq_len": min(512, ctx["size"]["seq_len"]),
        "per_device_train_batch_size": min(4, ctx["size"]["batch"]),
    }


def check_bnb_optimizers(ctx: dict) -> dict:
    """paged_adamw_8bit: bitsandbytes' 8-bit AdamW states (adamw_8bit's) in paged memory, saved and resumed."""
    bnb_or_skip()
    optim = "paged_adamw_8bit"
    return {"optimizers": {optim: resume_check(ctx, f"optim-{optim}", optim=optim, **_resume_shape(ctx))}}


# What CUDA needs to compute the same steps bit for bit twice: cuBLAS's fixed workspace (read when cuBLAS starts,
# so set before the check's first CUDA work and inherited by the runs it starts), torch's deterministic kernels
# (warn_only: an op without one warns, and the warnings are reported) and cuDNN without autotuning.
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
DETERMINISTIC_PRELUDE = (
    "import sys, torch; torch.use_deterministic_algorithms(True, warn_only=True); "
    "torch.backends.cudnn.deterministic = True; torch.backends.cudnn.benchmark = False; "
    "from shardtune.cli import main; sys.exit(main(sys.argv[1:]))"
)


def deterministic() -> None:
    """This process's runs, and the ones it starts, on deterministic kernels (see DETERMINISTIC_ENV)."""
    import torch

    os.environ.update(DETERMINISTIC_ENV)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False


def check_kill_resume(ctx: dict) -> dict:
    """Bit for bit on deterministic kernels (see DETERMINISTIC_ENV); on the CPU they are so already."""
    import warnings

    deterministic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = resume_check(ctx, "kill_resume", kill=True, deterministic=True, **_resume_shape(ctx))
    nondeterministic = sorted({str(w.message)[:200] for w in caught if "deterministic" in str(w.message)})
    return {**out, "deterministic": {**DETERMINISTIC_ENV, "use_deterministic_algorithms": True},
            "nondeterministic_ops": nondeterministic}  # fmt: skip


def check_memory_vs_plan(ctx: dict) -> dict:
    """One rank trains in this process; its CUDA peaks against `shardtune plan` on the same flags: allocated and
    reserved in all, and the weights (what is allocated when the first step starts: the frozen base and the
    trainable weights, before the optimizer's states exist) against the plan's weight terms."""

    import torch

    if ctx["device"] != "cuda":
        raise Skip("needs CUDA")
    from shardtune import cli
    from shardtune.config.accelerate import accelerate_env
    from shardtune.training import trainer

    out = Path(ctx["workdir"]) / "memory_vs_plan"
    shutil.rmtree(out, ignore_errors=True)  # a second run on the same machine starts afresh
    os.environ.update(accelerate_env(_yaml(ctx, 1)))
    os.environ.pop("ACCELERATE_USE_CPU", None)
    argv = train_argv(ctx, out, max_steps=3)
    at_first_step: list[int] = []
    original = trainer.train_step

    def recording(*a, **kw):
        if not at_first_step:
            at_first_step.append(torch.cuda.memory_allocated())
        return original(*a, **kw)

    trainer.train_step = recording
    torch.cuda.reset_peak_memory_stats()
    if cli.run_command("train", argv[1:]) != 0:
        raise RuntimeError("shardtune train failed")
    measured = {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}
    record(ctx, "measured_bytes", {**measured, "weights": at_first_step[0]})
    free, total = torch.cuda.mem_get_info()
    outside_allocator = total - free - torch.cuda.memory_reserved() - ctx["parent_device_bytes"]
    import resource

    host_peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return against_plan(ctx, argv, {**measured, "weights": at_first_step[0]}, outside_allocator, host_peak_rss)


def against_plan(ctx: dict, argv: list[str], measured: dict, outside_allocator: int, host_peak_rss: int) -> dict:
    """The measured peaks (recorded first, so that nothing after can lose them) against `shardtune plan` on the same
    flags, then against the allocator replayed over `shardtune plan --trace`: a failed trace is reported
    (`trace_error`, and the check fails) beside the measurements and the plan, never instead of them."""
    import contextlib
    import io

    from shardtune import cli
    from shardtune.config import cuda_allocator

    gib = 2**30
    out = {
        "measured_gib": {k: v / gib for k, v in measured.items()},
        # The calibration data for the planner's constants that fake tensors cannot give (docs/plan.md, "Where each
        # constant comes from"): the device memory in use outside torch's allocator (CUDA context, cuBLAS/NCCL
        # buffers: CUDA_CONTEXT_BYTES; the parent's own context, which measured the matmul peak, left out) and this
        # process's peak host RSS (HOST_PROCESS_BYTES, plus the loading).
        "outside_allocator_gib": outside_allocator / gib,
        "host_peak_rss_gib": host_peak_rss / gib,
        # the plan estimates for the setting this process trained with (shardtune.cli.prepare_process set it)
        "allocator": cuda_allocator.describe(),
        "expandable_segments": cuda_allocator.expandable_segments(),
        # One process trains LoRA without FSDP by default (SHARDTUNE_FSDP_SINGLE_PROCESS=auto), and the plan says
        # so; the replay below is of the FSDP trace (a model without weights is traced under FSDP2's tracker).
        "single_process_setting": os.environ.get(SINGLE_PROCESS_ENV, "auto"),
    }
    for key in ("measured_gib", "outside_allocator_gib", "host_peak_rss_gib"):
        record(ctx, key, out[key])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        if cli.run_command("plan", [*argv[1:], "--json", "True"]) != 0:
            out["plan_error"] = "shardtune plan failed"
            return out
    plan = json.loads(buf.getvalue())
    weights = plan["device"]["frozen base weights"] + plan["device"]["trainable weights"]
    out.update({
        "plan_gib": {"allocated": plan["allocated_bytes"] / gib, "reserved": plan["reserved_bytes"] / gib,
                     "weights": weights / gib},
        "plan_terms_gib": {k: v / gib for k, v in plan["device"].items()},
        "allocated_over_plan": measured["allocated"] / plan["allocated_bytes"],
        "reserved_over_plan": measured["reserved"] / plan["reserved_bytes"],
        # what ALLOCATOR_OVERHEAD(_EXPANDABLE) stands for, as this run measures it (no published row)
        "reserved_over_allocated": measured["reserved"] / measured["allocated"],
        "weights_over_plan": measured["weights"] / weights,
        "plan_expandable_segments": plan["allocator"]["expandable_segments"],
        "plan_fsdp": plan["settings"]["fsdp"],
    })  # fmt: skip
    record(ctx, "plan_gib", out["plan_gib"])
    try:
        replay = _replayed(argv[1:])
    except Exception as e:  # noqa: BLE001 - the trace is the last step: what was measured stays in the result
        tail = getattr(e, "stderr", None) or ""
        out["trace_error"] = f"{type(e).__name__}: {str(e)[:300]} {tail[-1000:]}".strip()
        return out
    # the caching allocator replayed over the traced history of the same run (planning.allocator), for the
    # setting this process ran with (shardtune.config.cuda_allocator): the replay's rules against the real allocator
    out.update({
        "replayed_gib": {k: v / gib for k, v in replay.items() if k != "reserved_by_stream"},
        "replayed_reserved_by_stream_gib": {k: v / gib for k, v in replay["reserved_by_stream"].items()},
        "reserved_over_replay": measured["reserved"] / replay["max_memory_reserved"],
    })  # fmt: skip
    return out


def _replayed(train_argv: list[str]) -> dict[str, int]:
    """`shardtune plan --trace` of the same flags, in a fresh process (a trace owns its fake process group):
    the replayed max_memory_allocated/reserved for this process's allocator setting."""
    cmd = (
        json.loads(os.environ[TRACE_CMD_PLANT])
        if TRACE_CMD_PLANT in os.environ
        else [sys.executable, "-m", "shardtune"]
    )
    out = subprocess.run(
        [*cmd, "plan", *train_argv, "--json", "True", "--trace", "True"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    plan = json.loads(out)
    setting = "expandable_segments" if plan["allocator"]["expandable_segments"] else "default"
    return plan["trace"]["allocator_replay"][setting]


def planted_hang(ctx: dict) -> dict:
    """A planted check for the timeout's test (not in CHECKS): it records a measurement, starts a child that
    sleeps, then sleeps itself; killed at its budget, no process of its tree may be left and the measurement kept."""
    import time

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    record(ctx, "child_pid", child.pid)
    record(ctx, "check_pid", os.getpid())
    record(ctx, "measured", 1.5)
    time.sleep(600)
    return {}


def check_reference_stack(ctx: dict) -> dict:
    if importlib.util.find_spec("trl") is None:
        raise Skip("trl is not installed (pip install 'shardtune[bench]')")
    size = Size(**ctx["size"])
    s = speed.Settings(model="gpu_check", seq_len=size.seq_len, batch=size.batch, warmup=size.warmup,
                       steps=size.steps, rounds=1, threads=ctx["threads"])  # fmt: skip
    c = speed.Contender("reference", "reference")
    workdir = Path(ctx["workdir"]) / "reference"
    workdir.mkdir(parents=True, exist_ok=True)
    ranks = speed.run_contender(c, s, ctx, workdir, ctx["device"], ctx["pad_id"])
    summary = speed.summarize([ranks], s, speed.FlopModel(**ctx["flop_model"]), ctx["peak_flops"], recompute=1.0)
    return {k: summary[k] for k in ("tokens_per_s", "step_s", "mfu", "hfu")}


RUN = {
    "lora_world1": lambda ctx: check_lora(ctx, 1),
    "lora_world2": lambda ctx: check_lora(ctx, 2),
    "attention": check_attention,
    "context_parallel": check_context_parallel,
    "qlora": check_qlora,
    "offload_loading": check_offload_loading,
    "bnb_optimizers": check_bnb_optimizers,
    "kill_resume": check_kill_resume,
    "memory_vs_plan": check_memory_vs_plan,
    "reference_stack": check_reference_stack,
    "_planted_hang": planted_hang,
}
