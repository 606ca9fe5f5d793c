"""The checks of bench/gpu_check.py, each a function of the run's context (a JSON-able dict: device, assets, sizes,
FLOP model, matmul peak) that returns its numbers or raises Skip; bench/gpu_check.py runs each in its own process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import speed

CHECKS = [
    "lora_world1",
    "lora_world2",
    "attention",
    "qlora",
    "offload_loading",
    "bnb_optimizers",
    "kill_resume",
    "memory_vs_plan",
    "reference_stack",
]
NEEDS_CUDA = {"memory_vs_plan"}
# bf16 carries 8 significant bits. Two implementations of the same attention (or the same dequantized weights
# through two matmul paths) round differently by up to ~1 ulp per element; the loss averages such errors over all
# tokens, so its relative difference stays well under 2 ulps of bf16. This is the tolerance for "equal losses".
BF16_LOSS_RTOL = 2.0**-7


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
    "1b": Size(2048, 22, 32, 4, 5632, seq_len=2048, batch=8, warmup=3, steps=8, n_train=24000),
    "tiny": Size(64, 2, 4, 2, 128, seq_len=128, batch=4, warmup=1, steps=4, n_train=400),
}


class Skip(Exception):
    """A check that cannot run here; the message says why."""


# --------------------------------------------------------------------------------------------------- assets


def build_assets(workdir: Path, size: Size) -> dict[str, str]:
    """Tokenizer, random bf16 model and chat data, built locally once per size."""
    from shardtune.demo import build_model, build_tokenizer, write_chat_dataset

    model, data = workdir / f"model-{size.hidden}x{size.layers}", workdir / f"data-{size.n_train}"
    if not (model / "config.json").exists():
        tok = build_tokenizer(model, vocab_size=1024)
        build_model(model, vocab_size=len(tok), hidden_size=size.hidden, num_layers=size.layers,
                    num_heads=size.heads, num_kv_heads=size.kv_heads, intermediate_size=size.inter,
                    max_position_embeddings=max(2048, size.seq_len), dtype="bfloat16")  # fmt: skip
    if not (data / "train.jsonl").exists():
        write_chat_dataset(data, n_train=size.n_train, n_test=20)
    return {"model": str(model), "data": str(data)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------ training runs


def _yaml(ctx: dict, world: int, path: str | None = None) -> dict:
    """The accelerate config of a run: the given file (num_processes set to `world`) or the guide's LoRA one."""
    from shardtune.accelerate_config import read_accelerate_yaml
    from shardtune.demo import DEMO_FSDP_YAML

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
          expect_ok: bool = True, **flags) -> subprocess.CompletedProcess:  # fmt: skip
    """Run `shardtune train` with the FSDP settings of `yaml` as accelerate would: one rank in this process (it has
    imported everything already), 2 ranks under torchrun, a run that is to be killed in a process of its own."""
    from shardtune.accelerate_config import accelerate_env

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
    cmd = [sys.executable, "-m", "shardtune", *args]
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
               "--master_port", str(_free_port()), "-m", "shardtune", *args]  # fmt: skip
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, check=False)
    if expect_ok and proc.returncode != 0:
        raise RuntimeError(f"shardtune train exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc


def _train_here(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`shardtune train` in this process, with `env` added for the run (a fresh 1-rank group each time)."""
    from shardtune.train import main as train_main

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


def resume_check(ctx: dict, name: str, *, kill: bool = False, world: int = 1, **kw) -> dict:
    """4 steps with a checkpoint every 2, against a run that resumes from checkpoint-2 (copied into a fresh output
    folder, or left by a run SIGKILLed after step 3): steps 3 and 4 and the final adapter must be identical."""
    work = Path(ctx["workdir"]) / name
    shutil.rmtree(work, ignore_errors=True)
    full, resumed = work / "full", work / "resumed"
    flags = {"save_strategy": "steps", "save_steps": 2, "max_steps": 4, **kw}
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
    return {
        "losses": [want[k] for k in sorted(want)],
        "resumed_losses": [got[k] for k in sorted(got) if k > 2],
        "resume_equal": [got.get(3), got.get(4)] == [want[3], want[4]] and same_adapter(full, resumed),
        # 0 when exact; a tiny non-zero value with resume_equal false points at non-deterministic kernels rather
        # than at a state the checkpoint missed (which shows as a difference of the size of a training step's).
        "max_rel_diff": max(diffs) if len(diffs) == 2 else None,
    }


# ------------------------------------------------------------------------------------------------- checks


def check_lora(ctx: dict, world: int) -> dict:
    """The guide's LoRA run, timed step by step (bench/speed.py's worker), MFU and HFU against the measured peak."""
    import torch

    if ctx["device"] == "cuda" and torch.cuda.device_count() < world:
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
    if world == 1:  # bench/speed.py's worker, in this process
        os.environ.update({k: v for k, v in speed._env(c, s).items() if k.startswith(("ACCELERATE_", "FSDP_"))})
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
    ordered = [got[k] for k in sorted(got)]
    return {
        "losses": ordered,
        "loss_falls": statistics.fmean(ordered[-2:]) < statistics.fmean(ordered[:2]),
        "tokens_per_s": summary["tokens_per_s"],
        "step_s": summary["step_s"],
        "mfu": summary["mfu"],
        "hfu": summary["hfu"],
        "recompute": summary["recompute"],
        "memory_gb_per_rank": summary["train_peak_gb_per_rank"],
    }


def _packed_batch(ctx: dict, device: str):
    """Rows of whole documents (lengths drawn from 16 to seq_len/4), position ids restarting per document, each
    document's last position without a target: what packing produces."""
    import torch

    size = Size(**ctx["size"])
    gen = torch.Generator().manual_seed(0)
    rows = max(1, size.batch // 2)
    ids = torch.randint(3, ctx["base_vocab"], (rows, size.seq_len), generator=gen)
    pos = torch.empty_like(ids)
    labels = torch.full_like(ids, -100)
    for r in range(rows):
        i = 0
        while i < size.seq_len:
            n = min(int(torch.randint(16, max(17, size.seq_len // 4), (1,), generator=gen)), size.seq_len - i)
            pos[r, i : i + n] = torch.arange(n)
            labels[r, i : i + n - 1] = ids[r, i + 1 : i + n]
            i += n
    return ids.to(device), pos.to(device), labels.to(device)


def _time_loss(model, batch, device: str, reps: int) -> tuple[float, float]:
    """(loss, median seconds of forward + backward)."""

    times, loss = [], None
    for i in range(reps + 1):
        speed._sync(device)
        t0 = time.perf_counter()
        total, n = model(*batch)
        (total / n).backward()
        speed._sync(device)
        if i:  # the first call picks kernels
            times.append(time.perf_counter() - t0)
        loss = float(total.detach() / n)
        model.zero_grad(set_to_none=True)
    return loss, statistics.median(times)


def check_attention(ctx: dict) -> dict:
    import torch

    from shardtune import fastpath, modeling

    device = ctx["device"]
    batch = _packed_batch(ctx, device)
    variants = {"per_document_sdpa": (fastpath.register_attention(), True),
                "sdpa_packed_mask": (fastpath.register_attention(), False)}  # fmt: skip
    skipped = {}
    if device == "cuda" and importlib.util.find_spec("flash_attn"):
        variants["flash_attn_varlen"] = ("flash_attention_2", False)
    else:
        skipped["flash_attn_varlen"] = "needs CUDA" if device != "cuda" else "flash_attn is not installed"
    out = {}
    for name, (impl, per_doc) in variants.items():
        base = modeling.load_base_model(ctx["model"], dtype=torch.bfloat16, attn_impl=impl, trust_remote_code=False)
        base.to(device).requires_grad_(True)
        model = modeling.CausalLMForTraining(base, per_document_attention=per_doc)
        loss, seconds = _time_loss(model, batch, device, reps=3)
        out[name] = {"loss": loss, "seconds": seconds}
        del model, base
    ref = out["sdpa_packed_mask"]["loss"]
    return {
        "variants": out,
        "not_run": skipped,
        "losses_equal": all(abs(v["loss"] - ref) <= BF16_LOSS_RTOL * abs(ref) for v in out.values()),
        "rtol": BF16_LOSS_RTOL,
    }


def _bnb_or_skip():
    if importlib.util.find_spec("bitsandbytes") is None:
        raise Skip("bitsandbytes is not installed (pip install 'shardtune[qlora]')")


def check_qlora(ctx: dict) -> dict:
    """One rank: the sharded 4-bit model's loss on a packed batch against a bf16 model whose linear weights are the
    4-bit weights dequantized (the adapter starts at zero, so both compute the same function)."""
    _bnb_or_skip()
    import bitsandbytes as bnb
    import torch

    from shardtune import modeling, quant
    from shardtune.builder import ModelSpec
    from shardtune.distributed.mesh import init_distributed
    from shardtune.distributed.setup import build_sharded_model

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))  # fmt: skip
    info = init_distributed("FULL_SHARD")
    qcfg = modeling.bnb_config(use_4bit=True, use_8bit=False, quant_type="nf4", compute_dtype_name="bfloat16",
                               nested=True, storage_dtype_name="bfloat16")  # fmt: skip
    attn = modeling.attn_implementation(False, ctx["device"])
    # No new tokens: new embedding rows are initialised at random, differently here and in the reference.
    spec = ModelSpec(model_name_or_path=ctx["model"], dtype=torch.bfloat16, n_tokens=ctx["base_vocab"],
                     param_dtype=torch.bfloat16, attn_impl=attn, quantization_config=qcfg)  # fmt: skip
    if ctx["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = build_sharded_model(spec, info)
    batch = _packed_batch(ctx, ctx["device"])
    total, n = model(*batch)
    (total / n).backward()
    loss = float(total.detach() / n)
    memory = torch.cuda.max_memory_allocated() / 2**30 if ctx["device"] == "cuda" else None
    deq = {}
    for name, layer in quant.linear4bit_modules(model):
        key = name[name.index("layers.") :].removesuffix(".base_layer")
        deq[key] = bnb.functional.dequantize_4bit(layer.weight.full_tensor(), layer.quant_state).to(torch.bfloat16)
    ref = modeling.load_base_model(ctx["model"], dtype=torch.bfloat16, attn_impl=attn, trust_remote_code=False)
    for name, mod in ref.named_modules():
        key = name[name.index("layers.") :] if "layers." in name else None
        if key in deq:
            mod.weight.data.copy_(deq.pop(key).reshape(mod.weight.shape))
    if deq:
        raise RuntimeError(f"4-bit layers without a bf16 counterpart: {sorted(deq)[:3]}")
    with torch.no_grad():
        ref_total, ref_n = modeling.CausalLMForTraining(ref.to(ctx["device"]))(*batch)
    ref_loss = float(ref_total / ref_n)
    return {
        "loss": loss,
        "reference_loss": ref_loss,
        "loss_equal": abs(loss - ref_loss) <= BF16_LOSS_RTOL * abs(ref_loss),
        "rtol": BF16_LOSS_RTOL,
        "packed_mib_per_rank": quant.quantized_bytes(model)["packed_local"] / 2**20,
        "memory_gb_per_rank": memory,
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


def check_bnb_optimizers(ctx: dict) -> dict:
    _bnb_or_skip()
    optims = ("adamw_8bit", "paged_adamw_8bit")
    return {"optimizers": {optim: resume_check(ctx, f"optim-{optim}", optim=optim) for optim in optims}}


def check_kill_resume(ctx: dict) -> dict:
    return resume_check(ctx, "kill_resume", kill=True)


def check_memory_vs_plan(ctx: dict) -> dict:
    """One rank trains in this process; its CUDA peaks against `shardtune plan` on the same flags: allocated and
    reserved in all, and the weights (what is allocated when the first step starts: the frozen base and the
    trainable weights, before the optimizer's states exist) against the plan's weight terms."""
    import contextlib
    import io

    import torch

    if ctx["device"] != "cuda":
        raise Skip("needs CUDA")
    from shardtune import trainer
    from shardtune.accelerate_config import accelerate_env
    from shardtune.plan import main as plan_main
    from shardtune.train import main as train_main

    out = Path(ctx["workdir"]) / "memory_vs_plan"
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
    if train_main(argv[1:]) != 0:
        raise RuntimeError("shardtune train failed")
    measured = {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}
    # The calibration data for the planner's constants that fake tensors cannot give (docs/plan.md, "Where each
    # constant comes from"): the device memory in use outside torch's allocator (CUDA context, cuBLAS/NCCL
    # buffers: CUDA_CONTEXT_BYTES) and this process's peak host RSS (HOST_PROCESS_BYTES, plus the loading).
    free, total = torch.cuda.mem_get_info()
    outside_allocator = total - free - torch.cuda.memory_reserved()
    import resource

    host_peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        if plan_main([*argv[1:], "--json", "True"]) != 0:
            raise RuntimeError("shardtune plan failed")
    plan = json.loads(buf.getvalue())
    weights = plan["device"]["frozen base weights"] + plan["device"]["trainable weights"]
    gib = 2**30
    replay = _replayed(argv[1:])
    return {
        # the caching allocator replayed over the traced history of the same run (planning.allocator), for the
        # setting this process ran with (shardtune.cuda_allocator): the replay's rules against the real allocator
        "replayed_gib": {k: v / gib for k, v in replay.items()},
        "reserved_over_replay": measured["reserved"] / replay["max_memory_reserved"],
        "measured_gib": {**{k: v / gib for k, v in measured.items()}, "weights": at_first_step[0] / gib},
        "plan_gib": {
            "allocated": plan["allocated_bytes"] / gib,
            "reserved": plan["reserved_bytes"] / gib,
            "weights": weights / gib,
        },
        "plan_terms_gib": {k: v / gib for k, v in plan["device"].items()},
        "allocated_over_plan": measured["allocated"] / plan["allocated_bytes"],
        "reserved_over_plan": measured["reserved"] / plan["reserved_bytes"],
        # what ALLOCATOR_OVERHEAD(_EXPANDABLE) stands for, as this run measures it (no published row)
        "reserved_over_allocated": measured["reserved"] / measured["allocated"],
        "expandable_segments": plan["allocator"]["expandable_segments"],
        "outside_allocator_gib": outside_allocator / gib,
        "host_peak_rss_gib": host_peak_rss / gib,
        "weights_over_plan": at_first_step[0] / weights,
    }


def _replayed(train_argv: list[str]) -> dict[str, int]:
    """`shardtune plan --trace` of the same flags, in a fresh process (a trace owns its fake process group):
    the replayed max_memory_allocated/reserved for this process's allocator setting."""
    out = subprocess.run(
        [sys.executable, "-m", "shardtune", "plan", *train_argv, "--json", "True", "--trace", "True"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    plan = json.loads(out)
    setting = "expandable_segments" if plan["allocator"]["expandable_segments"] else "default"
    return plan["trace"]["allocator_replay"][setting]


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
    "qlora": check_qlora,
    "offload_loading": check_offload_loading,
    "bnb_optimizers": check_bnb_optimizers,
    "kill_resume": check_kill_resume,
    "memory_vs_plan": check_memory_vs_plan,
    "reference_stack": check_reference_stack,
}
