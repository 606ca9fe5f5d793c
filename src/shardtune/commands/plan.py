"""`shardtune plan`: per-GPU and host memory of a run, from the model's config.json and the run's flags alone.

It takes `shardtune train`'s flags unchanged, plus the accelerate YAML (world size, sharding, offload, mixed
precision) and a memory budget; it prints a table (or JSON) and, when the run does not fit, the smallest change
that does. The arithmetic lives in shardtune.planning; docs/plan.md explains it and how close it comes to
published measurements.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from shardtune.config.accelerate import fsdp_settings_from_yaml, read_accelerate_yaml
from shardtune.config.arguments import DataArguments, ModelArguments, RunConfig, TrainArguments
from shardtune.config.errors import ConfigError
from shardtune.config.fsdp import SINGLE_PROCESS_ENV, FSDPSettings, single_process_setting
from shardtune.config.run import explicit_flags, parse_args, resolve_parallel_sizes
from shardtune.objectives.loss import has_reference, objective_spec
from shardtune.parallel.dims import STRATEGIES, STRATEGY_BY_NUMBER
from shardtune.parallel.tensor import model_problems
from shardtune.planning.estimate import estimate_memory
from shardtune.planning.fit import (
    CHAT_NEW_TOKENS,
    frozen_base_choice,
    launch_from_settings,
    plan_inputs,
    plan_shape,
    warn_if_too_small,  # noqa: F401 - docs/plan.md names shardtune.commands.plan's
)
from shardtune.planning.inputs import PlanInputs
from shardtune.planning.model import load_model_config
from shardtune.planning.recommend import longest_sequences, near_limit_tensor_parallel, recommend
from shardtune.planning.report import Launch, Plan, format_plan, format_trace, trace_json
from shardtune.planning.state import GiB
from shardtune.planning.trace import trace_step
from shardtune.recipe.run_config import complete_run_config, flag_choices
from shardtune.training import optimizers

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}


def _f(default: Any, help: str, aliases: list[str] | None = None) -> Any:
    meta: dict[str, Any] = {"help": help}
    if aliases:
        meta["aliases"] = aliases
    return field(default=default, metadata=meta)


@dataclass
class PlanArguments:
    gpu_memory: str | None = _f(
        None,
        "Memory of one GPU, e.g. 24GiB, 80GB (10^9 bytes) or 81559MiB: says whether "
        "the run fits and, if not, the smallest change that does.",
    )
    host_memory: str | None = _f(None, "RAM of one machine, e.g. 128GiB: checks offloaded state and model loading.")
    json: bool = _f(False, "Print the estimate as JSON instead of a table.")
    config_file: str | None = _f(
        None,
        "accelerate YAML (as given to `accelerate launch --config_file`): "
        "num_processes, num_machines, fsdp_sharding_strategy, fsdp_offload_params and "
        "mixed_precision are read from it.",
    )
    num_processes: int | None = _f(
        None, "GPUs over all machines (overrides the YAML; default 1).", aliases=["--gpu_count"]
    )
    num_machines: int | None = _f(None, "Machines (overrides the YAML; default 1).")
    sharding_strategy: str | None = _f(None, f"{', '.join(STRATEGIES)} (overrides the YAML).")
    offload_params: bool | None = _f(
        None, "CPU offload of parameters, gradients and optimizer states (overrides the YAML)."
    )
    attn_implementation: str | None = _f(
        None,
        "sdpa, flash_attention_2 or eager (default: flash_attention_2 with --use_flash_attn True, otherwise sdpa).",
    )
    loss_chunk_tokens: int | None = _f(
        None,
        "Positions per chunk of shardtune's chunked lm_head + cross-entropy (default: the run's, 2**25 logits' "
        "worth for the model's vocabulary, 64 to 1024: 256 for a 128,256-token vocabulary).",
    )
    longest_seq_len: bool = _f(
        False,
        "With --gpu_memory: the longest --max_seq_len that fits, with this run's --context_parallel_size and "
        "with each cp degree that divides --num_processes.",
    )
    trace: bool = _f(
        False,
        "Also run shardtune's own training step for this config under fake tensors (no weights, nothing "
        "allocated) on rank 0 of a fake process group of the run's world size, and print its traced peak by "
        "category beside the estimate. Takes seconds to minutes of CPU time for large models.",
    )


def parse_bytes(text: str, flag: str = "--gpu_memory") -> int:
    """'24GiB' -> 25769803776; GB/MB are powers of ten, GiB/MiB (and G/M) powers of two; a bare number is GiB."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text or "")
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ConfigError([f"{flag} {text!r}: give a size such as 24GiB, 80GB or 81559MiB."])
    return int(float(m.group(1)) * (_UNITS[unit] if unit else GiB))


def _strategy(value: Any, source: str) -> str:
    name = STRATEGY_BY_NUMBER.get(str(value), str(value)).upper()
    if name not in STRATEGIES:
        raise ConfigError([f"{source}: sharding strategy {value!r} is not one of {', '.join(STRATEGIES)}."])
    return name


# What `shardtune plan` leaves out of a run's checks: it reads no dataset and runs no reward function.
NOT_NEEDED = ("--dataset_name", "--objective grpo needs --reward_funcs")


def read_accelerate_config(path: str) -> Launch:
    """World size, machines and FSDP settings of an accelerate YAML, read and checked as `shardtune launch` does."""
    cfg = read_accelerate_yaml(path)
    return launch_from_settings(
        fsdp_settings_from_yaml(path), int(cfg.get("num_processes") or 1), int(cfg.get("num_machines") or 1)
    )


def _fsdp_settings(plan: PlanArguments) -> FSDPSettings:
    """The FSDP settings `shardtune train` would read from the environment `accelerate launch` sets for the YAML (no
    YAML: a start without accelerate's), with this command's --sharding_strategy and --offload_params over them and
    SHARDTUNE_FSDP_SINGLE_PROCESS from this environment: the one structure the run and its launch are built from."""
    fsdp = fsdp_settings_from_yaml(plan.config_file) if plan.config_file else FSDPSettings()
    if plan.sharding_strategy is not None:
        fsdp.sharding_strategy = _strategy(plan.sharding_strategy, "--sharding_strategy")
        fsdp.reshard_after_forward = None  # the strategy named says it
    if plan.offload_params is not None:
        fsdp.offload_params = plan.offload_params
    fsdp.single_process = single_process_setting(os.environ.get(SINGLE_PROCESS_ENV, "auto"))
    return fsdp


def _launch(plan: PlanArguments, fsdp: FSDPSettings) -> Launch:
    """The processes and machines (the YAML's, --num_processes and --num_machines over them) with `fsdp`."""
    yaml_cfg = read_accelerate_yaml(plan.config_file) if plan.config_file else {}
    world = plan.num_processes if plan.num_processes is not None else int(yaml_cfg.get("num_processes") or 1)
    nodes = plan.num_machines if plan.num_machines is not None else int(yaml_cfg.get("num_machines") or 1)
    if world < 1 or nodes < 1 or world % nodes:
        raise ConfigError([f"--num_processes {world} must be a positive multiple of --num_machines {nodes}."])
    return launch_from_settings(fsdp, world, nodes)  # the allocator's settings: the environment the run starts in


def reference_note(objective: str, use_peft_lora: bool, adapter_path: str | None, precompute: bool) -> str:
    """What the preference objective adds beyond its two rows per pair (counted in the activations above); for
    online RL, what its rows are (its rollout is the estimate's generation phase)."""
    if objective_spec(objective).data == "prompts":
        return (
            f"--objective {objective}: each micro-batch holds prompt + completion rows (counted above); the rollout "
            "that samples them is the generation phase; the old and reference log-probs (beta != 0: the adapter "
            "disabled) are no_grad forwards over the same rows, smaller than the step."
        )
    rows = (
        "its completion and a mismatched KL row per example"
        if objective == "kto"
        else "a chosen and a rejected row per pair"
    )
    head = f"--objective {objective}: each micro-batch holds {rows} (counted above)"
    if not has_reference(objective):
        return head + "; no reference model."
    if use_peft_lora and not adapter_path and not precompute:
        return (
            head + "; the reference is the same sharded base with the adapter disabled: one more forward per "
            "micro-batch under no_grad, run before the policy's forward (no model copy, no saved activations)."
        )
    return (
        head + "; the reference log-probs are computed once before training (one no_grad pass over the data) and "
        "stored with the data cache: no second model copy."
    )


def _run_config(
    model: ModelArguments, data: DataArguments, train: TrainArguments, fsdp: FSDPSettings, launch: Launch, explicit
) -> RunConfig:
    """The run `shardtune train` would start on this launch, decided by train's own rules: the parallel sizes
    (config.run.resolve_parallel_sizes), the objective's defaults and every check but the dataset's
    (recipe.run_config.complete_run_config)."""
    local = launch.world_size // launch.num_nodes
    if problems := resolve_parallel_sizes(train, fsdp, launch.world_size, local, explicit):
        raise ConfigError(problems)
    run = RunConfig(model, data, train, fsdp, explicit=explicit)
    return complete_run_config(run, check_paths=False, not_needed=NOT_NEEDED)


def make_plan(argv: list[str]) -> Plan:
    """Parse `shardtune plan`'s flags, read config.json and estimate; raises ConfigError for user mistakes."""
    model, data, train, plan = parse_args(argv, extra=(PlanArguments,), prog="shardtune plan", choices=flag_choices())
    if not model.model_name_or_path:
        raise ConfigError(["--model_name_or_path is required: a hub id, a local model folder or a config.json."])
    fsdp = _fsdp_settings(plan)
    launch = _launch(plan, fsdp)
    run = _run_config(model, data, train, fsdp, launch, explicit_flags(argv))
    if plan.attn_implementation and plan.attn_implementation not in ("sdpa", "flash_attention_2", "eager"):
        raise ConfigError(
            [(f"--attn_implementation {plan.attn_implementation!r}: use sdpa, flash_attention_2 or eager.")]
        )
    if plan.loss_chunk_tokens is not None and plan.loss_chunk_tokens < 1:
        raise ConfigError([f"--loss_chunk_tokens {plan.loss_chunk_tokens}: give a positive number of positions."])
    if plan.trace and train.tensor_parallel_size > 1:
        raise ConfigError([TRACE_TP.format(tp=train.tensor_parallel_size)])
    config = load_model_config(model.model_name_or_path, model.trust_remote_code)
    if train.tensor_parallel_size > 1 and (problems := model_problems(config, train.tensor_parallel_size)):
        raise ConfigError(problems)  # what the run's parallel setup refuses before reading a weight
    shape = plan_shape(config, model.chat_template_format)
    if train.router_aux_loss_coef is not None:  # --router_aux_loss_coef over the config's
        shape = dataclasses.replace(shape, router_aux_loss_coef=train.router_aux_loss_coef)
    inputs = plan_inputs(run, launch, plan.attn_implementation, plan.loss_chunk_tokens)
    gpu_bytes = parse_bytes(plan.gpu_memory) if plan.gpu_memory else None
    inputs, placement_note = _frozen_base_note(run, launch, gpu_bytes, shape, inputs)
    result = Plan(
        model.model_name_or_path,
        shape,
        inputs,
        estimate_memory(shape, inputs),
        launch,
        as_json=bool(plan.json),
        run=run,
        config=config,
    )
    if placement_note:
        result.estimate.notes.append(placement_note)
    if train.objective != "sft":
        result.estimate.notes.append(
            reference_note(train.objective, model.use_peft_lora, model.adapter_path, train.precompute_ref_log_probs)
        )
    if gpu_bytes is not None:
        _against_gpu(result, gpu_bytes, train.gradient_accumulation_steps)
    if plan.longest_seq_len:
        if gpu_bytes is None:
            raise ConfigError(["--longest_seq_len needs --gpu_memory: the memory of one GPU to fit the sequence in."])
        # the cp degrees that divide the ranks of one tp slice
        result.longest = longest_sequences(inputs, gpu_bytes, launch.world_size // inputs.tensor_parallel, shape)
    if plan.host_memory:
        result.host_bytes = parse_bytes(plan.host_memory, "--host_memory")
    if plan.trace:
        if not optimizers.get(train.optim).traceable:
            raise ConfigError(
                [
                    (
                        f"--trace with --optim {train.optim}: bitsandbytes' optimizer cannot run under fake "
                        "tensors; trace with --optim adamw_torch (the estimate counts the 8-bit states either way)."
                    )
                ]
            )
        result.trace = run_trace(result)
    return result


def _against_gpu(result: Plan, gpu_bytes: int, accumulation: int) -> None:
    """The plan against one GPU of `gpu_bytes`: the smallest change that fits when it does not, and, when it fits
    within the planner's error, the tensor-parallel size that leaves that margin (planning.recommend)."""
    result.gpu_bytes = gpu_bytes
    inputs, shape = result.inputs, result.shape
    if not result.estimate.fits(gpu_bytes):
        result.recommendation = recommend(inputs, gpu_bytes, accumulation, model=shape)
    else:
        result.headroom = near_limit_tensor_parallel(inputs, gpu_bytes, accumulation, model=shape)


# --trace builds the run's step on one process of a fake process group, without a tp mesh.
TRACE_TP = (
    "--trace with --tensor_parallel_size {tp}: the traced step runs without tensor parallelism (the estimate models "
    "it); trace with --tensor_parallel_size 1, or drop --trace."
)


def _frozen_base_note(
    run: RunConfig, launch: Launch, gpu_bytes: int | None, shape, inputs: PlanInputs
) -> tuple[PlanInputs, str | None]:
    """What --frozen_base the run would take, as `shardtune train` decides it on a GPU of `gpu_bytes`: the run's
    inputs (the replicated run's where auto replicates) and the note that says so. Without --gpu_memory, auto is
    planned sharded and the note gives the replicated figure beside it."""
    if run.model.frozen_base != "auto" or not run.model.use_peft_lora or launch.world_size == 1:
        return inputs, None
    placement, why = frozen_base_choice(run, launch, gpu_bytes)
    if placement == "replicated":
        return dataclasses.replace(inputs, replicate_base=True), why
    if gpu_bytes is None and not launch.offload and inputs.tensor_parallel == 1:  # tp: sharded, whatever the GPU
        need = estimate_memory(shape, dataclasses.replace(inputs, replicate_base=True)).total
        return inputs, (
            f"--frozen_base auto: planned sharded; `shardtune train` replicates the frozen base on a GPU with room "
            f"for it ({need / GiB:.1f} GiB per GPU replicated, plus a margin: --gpu_memory decides it here)."
        )
    return inputs, why


def run_trace(p: Plan) -> Any:
    """Trace the plan's run under fake tensors (shardtune.planning.trace) on the device type this machine has."""
    import torch

    vocab = int(p.config.vocab_size)
    new = CHAT_NEW_TOKENS if p.run.model.chat_template_format in ("chatml", "zephyr") else 0
    result = trace_step(
        p.run,
        p.config,
        n_tokens=vocab + new,
        new_ids=list(range(vocab, vocab + new)),
        world_size=p.launch.world_size,
        num_nodes=p.launch.num_nodes,
        device="cuda" if torch.cuda.is_available() else "cpu",
        loss_chunk_tokens=p.inputs.loss_chunk_tokens,
        replicate_base=p.inputs.replicate_base,
    )
    if p.launch.offload and result.device == "cpu":
        result.notes.append("CPU offload is not traced: on a machine without CUDA shardtune keeps everything in RAM.")
    if result.device == "cpu" and p.shape.q_dim != p.shape.o_dim:
        # CPU's fused SDPA kernel needs the values' heads as wide as the queries'; CUDA's memory-efficient one does not
        result.notes.append(
            "the attention's value heads are narrower than its query heads: on CPU SDPA runs it on its math kernel, "
            "which keeps every head's score matrix, so the traced step holds more than the estimate (a GPU's "
            "memory-efficient kernel)."
        )
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        plan = make_plan(argv)
    except ValueError as e:  # ConfigError, or a setting the estimate cannot take
        print(f"shardtune plan: {e}", file=sys.stderr)
        return 2
    if plan.as_json:
        out = plan.to_dict()
        if plan.trace is not None:
            out["trace"] = trace_json(plan)
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(plan) + (format_trace(plan) if plan.trace is not None else ""))
    # 1 tells scripts the run does not fit the given --gpu_memory (2 is a configuration mistake).
    return 1 if plan.gpu_bytes is not None and not plan.estimate.fits(plan.gpu_bytes) else 0
