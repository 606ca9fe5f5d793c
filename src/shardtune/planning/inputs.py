"""What the planner reads: one `PlanInputs`, the settings of the run it plans. `shardtune plan` and `shardtune train`
build it from the run's configuration in one place (planning.fit.plan_inputs: the model's facts off the spec the run
builds, models.builder.model_facts; the batch, rows and optimizer off the flags); a change to it (a candidate of
planning.recommend, the traced run of planning.report) is `dataclasses.replace` of it. The defaults describe
shardtune itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardtune.planning.activations import CUDA_DROPOUT_MASK_BYTES

# nvidia-smi counts the CUDA context (driver, lazily loaded kernels) and NCCL's buffers besides PyTorch's
# allocations. Calibrated on public GPU measurements, none of them a figure docs/plan.md compares with: 1.06 GB
# outside PyTorch on each of 8 H100s once NCCL is set up (NVIDIA/nccl#1685); on 4 A100s, 544-688 MB per NCCL
# communicator (NVIDIA/nccl#964) beside a bare context of 426 MiB (torch 2.10, CUDA 13; unslothai/unsloth-zoo#1053),
# 0.94-1.07 GiB in all.
CUDA_CONTEXT_BYTES = int(1.0 * 1024**3)


@dataclass(frozen=True)
class PlanInputs:
    """The settings of one planned run; sequences are tuples (a list given is kept as a tuple)."""

    # The launch: ranks over all machines, machines, FSDP's sharding strategy, and CPU offload of the parameters,
    # gradients and optimizer states.
    world_size: int = 1
    num_nodes: int = 1
    sharding_strategy: str = "FULL_SHARD"
    offload: bool = False
    # The compute dtype (neither: fp32), and a quantized frozen base: bitsandbytes' 4-bit (nested: its constants
    # quantized too) or 8-bit, the 4-bit weights packed in quant_storage_dtype.
    bf16: bool = True
    fp16: bool = False
    use_4bit: bool = False
    use_8bit: bool = False
    nested_quant: bool = False
    quant_storage_dtype: str = "bfloat16"
    # LoRA (False: full fine-tuning): its rank, the linear layers it wraps (names or all-linear), the parameters
    # it adapts besides them (PEFT's target_parameters: "experts", "routers" or a parameter's name or ending), the
    # dropout on its input, DoRA, and the modules trained in full beside the adapters.
    use_peft_lora: bool = True
    lora_r: int = 8
    lora_target_modules: str | tuple[str, ...] = "all-linear"
    lora_target_parameters: tuple[str, ...] = ()
    lora_dropout: float = 0.0
    use_dora: bool = False
    modules_to_save: tuple[str, ...] = ()
    # One micro-batch: its examples, the rows each example makes (a preference pair is two), the positions of a
    # row, gradient checkpointing, the attention implementation, packed rows; the optimizer and the micro-batches
    # accumulated per step.
    batch_size: int = 1
    rows_per_example: int = 1
    seq_len: int = 2048
    gradient_checkpointing: bool = True
    # --enable_activation_offloading (with checkpointing): what the forward saves for backward, each block's input
    # and the loss's, is kept in host memory; the GPU holds the input of the block being recomputed
    # (planning.estimate._dynamic, activations.offloaded_tensor_bytes).
    activation_offloading: bool = False
    attn_implementation: str = "sdpa"
    packing: bool = False
    optim: str = "adamw_torch"
    grad_accum: int = 1
    # The loss: shardtune's lm_head + cross-entropy on chunks of loss_chunk_tokens positions ("chunked"), or the
    # whole logits as other trainers compute them.
    loss_impl: str = "chunked"
    # None: the run's rule on the model's vocabulary (models.training_module.loss_chunk_tokens, planning.estimate)
    loss_chunk_tokens: int | None = None
    # Other trainers, which the published comparisons use: base_dtype, a base held in another dtype than the
    # compute dtype (e.g. fp32 with bf16 autocast); adapter_dtype, the adapters' dtype; prefetch, FSDP's
    # all-gather of the next block; sharded_checkpoint, the HF Trainer saving FSDP1 checkpoints with
    # SHARDED_STATE_DICT, which copies every parameter's shard on the GPU.
    base_dtype: str | None = None
    adapter_dtype: str = "float32"
    prefetch: bool = True
    sharded_checkpoint: bool = False
    # LoRA dropout's bytes per masked element (CUDA's bool mask) and the scratch bytes drawing it takes (CPU's
    # FastDropout: planning.report.traced_run_inputs).
    dropout_mask_bytes: int = CUDA_DROPOUT_MASK_BYTES
    dropout_scratch_bytes: int = 0
    # Outside PyTorch's allocations, and the caching allocator: the CUDA context and NCCL's buffers; the
    # fragmentation factor (None: the calibrated one for the allocator setting, planning.estimate); FSDP2's
    # forward all-gathers on a stream of their own (False: FSDP1, one stream in forward and backward); the
    # allocator's expandable segments.
    cuda_context_bytes: int = CUDA_CONTEXT_BYTES
    allocator_overhead: float | None = None
    gather_stream_cache: bool = True
    expandable_segments: bool = True
    # fsdp=False: one process without fully_shard (a single-device trainer; fsdp.without_fsdp). replicate_base:
    # LoRA's frozen base left out of FSDP (`--frozen_base replicated`, fsdp.frozen_parameters): every rank holds all
    # of it, in the compute dtype, and FSDP gathers and reduces the trainable tensors only.
    fsdp: bool = True
    replicate_base: bool = False
    # context_parallel: each row split over this many of the ranks. per_document_attention: SDPA per document
    # where the family allows it; False: over whole rows (torch.compile, the trace).
    context_parallel: int = 1
    # tensor_parallel: each block's linear layers sliced over this many ranks of a machine (shardtune.parallel.tensor),
    # which share one batch; FSDP shards over the world_size / tensor_parallel ranks of each slice.
    tensor_parallel: int = 1
    per_document_attention: bool = True
    # Online RL (--objective grpo; planning.generation), TRL GRPOConfig's names: what generates the completions
    # between optimizer steps (None: the objective generates nothing; "transformers": the training ranks, with a
    # KV cache; "vllm": a server, the training ranks only gather the adapter for its sync); completions sampled per
    # prompt; micro-batches per rank a generation batch feeds (a rank generates batch_size × steps_per_generation
    # rows at once); the longest prompt (None: seq_len less the completion: plan_inputs then plans prompts of
    # --max_length tokens); the most tokens a completion may have; whether every block's weights stay gathered for
    # the whole rollout (False: gathered block by block, as in the forward). Training rows are seq_len long:
    # prompt + completion.
    rollout_engine: str | None = None
    num_generations: int = 1
    steps_per_generation: int = 1
    max_prompt_length: int | None = None
    max_completion_length: int = 0
    gather_for_generation: bool = True

    def __post_init__(self) -> None:
        for name in ("lora_target_parameters", "modules_to_save"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if not isinstance(self.lora_target_modules, str):
            object.__setattr__(self, "lora_target_modules", tuple(self.lora_target_modules))


DEFAULTS = PlanInputs()  # shardtune's own run, every field at its default (frozen: safe as a default argument)

# The fields a run sets (planning.fit.plan_inputs, lora_target_parameters aside), in the order
# `shardtune plan --json` prints them under "run"; the others keep their defaults.
RUN_FIELDS = (
    "world_size",
    "num_nodes",
    "sharding_strategy",
    "expandable_segments",
    "offload",
    "bf16",
    "fp16",
    "use_4bit",
    "use_8bit",
    "nested_quant",
    "quant_storage_dtype",
    "use_peft_lora",
    "lora_r",
    "lora_target_modules",
    "lora_dropout",
    "use_dora",
    "modules_to_save",
    "batch_size",
    "rows_per_example",
    "seq_len",
    "gradient_checkpointing",
    "activation_offloading",
    "attn_implementation",
    "packing",
    "optim",
    "grad_accum",
    "loss_chunk_tokens",
    "replicate_base",
    "context_parallel",
    "tensor_parallel",
    "per_document_attention",
    "fsdp",
    "rollout_engine",
    "num_generations",
    "steps_per_generation",
    "max_prompt_length",
    "max_completion_length",
    "gather_for_generation",
)
# In the JSON, each of lora_target_parameters follows lora_target_modules' names after this mark.
JSON_PARAMETER_MARK = "@"


def as_json(inputs: PlanInputs, keys: Sequence[str] | None = None) -> dict[str, Any]:
    """The inputs (or those of `keys`, in that order) as `shardtune plan --json` prints them: tuples as lists, and
    lora_target_parameters within lora_target_modules, each after JSON_PARAMETER_MARK ("all-linear,@experts")."""
    d = dataclasses.asdict(inputs)
    parameters = d.pop("lora_target_parameters")
    if parameters:
        modules = d["lora_target_modules"]
        names = [modules] if isinstance(modules, str) else list(modules)
        d["lora_target_modules"] = ",".join(names + [JSON_PARAMETER_MARK + p for p in parameters])
    if keys is not None:
        d = {k: d[k] for k in keys}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
