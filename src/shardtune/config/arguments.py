"""The flags of `shardtune train` (named as in the reference training script and transformers' TrainingArguments)
as dataclasses, and `RunConfig`, which holds them with the FSDP settings of the launch and decides the run's
precision. Parsing is shardtune.config.run, the configuration's own checks shardtune.config.validation.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from shardtune.config.fsdp import FSDPSettings
from shardtune.config.precision import Precision, resolve_precision


def _f(default: Any, help: str, aliases: list[str] | None = None, choices: list[str] | None = None):
    meta: dict[str, Any] = {"help": help}
    if aliases:
        meta["aliases"] = aliases
    if choices:
        meta["choices"] = choices
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelArguments:
    model_name_or_path: str | None = _f(None, "Base model: a hub id or a local folder with config.json and weights.")
    tokenizer_name_or_path: str | None = _f(None, "Tokenizer to use if not the model's own.")
    chat_template_format: str = _f(
        "none",
        "chatml or zephyr: add that format's special tokens and template (embeddings resized to a multiple "
        "of 8, new rows trained and saved with the adapter); auto: the tokenizer's own template; none: train on "
        "--dataset_text_field as plain text.",
        choices=["chatml", "zephyr", "auto", "none"],
    )
    use_peft_lora: bool = _f(False, "Train a LoRA adapter (False: full fine-tuning of all weights).")
    lora_r: int = _f(64, "LoRA rank.")
    lora_alpha: float = _f(16, "LoRA alpha (scaling is alpha / r).")
    lora_dropout: float = _f(0.1, "Dropout on the LoRA input.")
    lora_target_modules: str = _f(
        "q_proj,k_proj,v_proj,o_proj,down_proj,up_proj,gate_proj",
        "Module names to adapt (commas or spaces), one regular expression (full-matched against module paths, as "
        "PEFT), or all-linear for every linear layer but the output head.",
    )
    lora_target_parameters: str | None = _f(
        None,
        "Parameters to adapt, as PEFT's target_parameters: a parameter's path or its ending (commas or spaces), "
        "e.g. mlp.experts.gate_up_proj,mlp.experts.down_proj, or the words experts (every fused expert tensor of "
        "a mixture of experts, one LoRA per expert) and routers (every router weight). The linear layers of "
        "--lora_target_modules are adapted as well.",
    )
    lora_target_experts: bool = _f(
        False,
        "Mixtures of experts: also adapt the fused expert tensors (--lora_target_parameters experts); "
        "--lora_dropout then acts on the linear layers' LoRA only.",
    )
    use_dora: bool = _f(False, "Weight-decomposed LoRA (DoRA).")
    dora_dropout: str = _f(
        "lora_path",
        "Where --lora_dropout acts in DoRA layers. lora_path: on the low-rank path's input only, the magnitude "
        "scaling the undropped base output (as torchtune's DoRALinear); no extra work. peft: also on the input of "
        "the base product that the magnitude scales (peft's definition), one more product with the frozen weight "
        "per layer. The same without dropout and at inference.",
        choices=["lora_path", "peft"],
    )
    modules_to_save: str | None = _f(
        None, "Comma-separated modules trained in full and saved with the adapter, e.g. embed_tokens,lm_head."
    )
    adapter_name: str = _f("default", "Name of the adapter being trained.")
    adapter_path: str | None = _f(None, "Continue training an existing PEFT adapter folder.")
    use_nested_quant: bool = _f(False, "Double quantization of the 4-bit quantization constants.")
    bnb_4bit_compute_dtype: str = _f("float16", "Compute dtype of 4-bit layers.")
    bnb_4bit_quant_storage_dtype: str = _f(
        "uint8",
        "Storage dtype of packed 4-bit weights; under FSDP it must "
        "equal the parameter dtype (bfloat16 with --bf16 True).",
    )
    bnb_4bit_quant_type: str = _f("nf4", "4-bit quantization type.", choices=["nf4", "fp4"])
    use_flash_attn: bool = _f(False, "Use flash_attention_2 where installed on CUDA, otherwise SDPA.")
    use_8bit_quantization: bool = _f(
        False, "Refused: 8-bit bitsandbytes layers cannot be sharded by FSDP2; use --use_4bit_quantization (QLoRA)."
    )
    use_4bit_quantization: bool = _f(False, "Load the frozen base in 4-bit (bitsandbytes, QLoRA).")
    frozen_base: str = _f(
        "auto",
        "LoRA, DoRA and QLoRA on several ranks: sharded keeps the frozen base sharded by FSDP (each block's "
        "weights gathered for its forward and again for its backward, every step); replicated holds it whole on "
        "every GPU (bf16 or 4-bit), never gathered, while the adapters, their gradients and optimizer state stay "
        "sharded. auto: replicated where `shardtune plan` finds that it fits the GPU's memory with the run's "
        "activations, sharded otherwise (and on machines without CUDA).",
        choices=["auto", "sharded", "replicated"],
    )
    use_reentrant: bool = _f(False, "Reentrant activation checkpointing.")
    torch_dtype: str | None = _f(
        None,
        "TRL's and transformers' spelling of the training precision: bfloat16 (= --bf16 True), float16 "
        "(= --fp16 True) or float32 (neither).",
        aliases=["--dtype"],
    )
    use_unsloth: bool = _f(False, "Accepted for compatibility with the reference script; not supported.")
    trust_remote_code: bool = _f(False, "Run model code from the hub repository (off by default).")


@dataclass
class DataArguments:
    dataset_name: str | None = _f(
        None,
        "Hub dataset id, a local save_to_disk folder (a DatasetDict or one folder "
        "per split), a folder of data files, or a .jsonl/.json/.parquet/.csv file.",
    )
    splits: str = _f("train,test", "Comma-separated splits: the first is trained on, the second evaluated.")
    dataset_text_field: str = _f("text", "Column with the text when rows have no `messages` column.")
    max_length: int = _f(2048, "Tokens per training row.", aliases=["--max_seq_len", "--max_seq_length"])
    packing: bool = _f(False, "Pack several documents per row; documents never attend to each other.")
    append_concat_token: bool = _f(False, "Append EOS after each document before packing.")
    add_special_tokens: bool = _f(False, "Let the tokenizer add its special tokens (BOS) to each document.")
    assistant_only_loss: bool = _f(False, "Compute the loss on assistant turns only.")
    completion_only_loss: bool | None = _f(
        None,
        "Rows with `prompt` and `completion` columns (TRL's prompt-completion format): compute the loss on the "
        "completion only. Unset: on for such rows, as TRL's SFTTrainer; False: on every token.",
    )
    drop_long_samples: bool = _f(False, "Drop documents longer than max_length instead of truncating them.")
    dataset_cache_dir: str | None = _f(
        None, "Where tokenized data is cached (default: <output_dir>/../.shardtune_cache)."
    )
    max_train_samples: int | None = _f(None, "Use only the first N training rows.")
    max_eval_samples: int | None = _f(None, "Use only the first N evaluation rows.")
    # Corpora larger than memory (docs/data.md).
    streaming: bool = _f(
        False,
        "Read the training split as a stream, --packing_window rows at a time (packed with --packing True) while "
        "training; needs --max_steps. The evaluation split is still prepared into the cache.",
    )
    packing_window: int = _f(
        10_000,
        "With --streaming: rows read and tokenized together, and with --packing packed best-fit together (more: "
        "fuller rows, more memory).",
    )
    dataset_num_proc: int | None = _f(
        None, "Processes that tokenize a split into the cache (default: one per CPU, at most 16)."
    )

    @property
    def packed_rows(self) -> bool:
        """Whether the run's rows hold several documents: --packing, for the cached and the streamed split alike
        (--streaming reads and tokenizes a window at a time, and packs it only with --packing). The one rule the
        data (its rows), the builder (ModelSpec.packing: the layout that keeps documents apart) and the planner
        (PlanInputs.packing) read. Objectives that train on pairs or on generated rows refuse --packing."""
        return self.packing


@dataclass
class TrainArguments:
    output_dir: str = _f("output", "Where the adapter or model, metrics and checkpoints are written.")
    seed: int = _f(42, "Random seed.")
    num_train_epochs: float = _f(1.0, "Epochs to train.")
    max_steps: int = _f(-1, "Optimizer steps to train; overrides --num_train_epochs when > 0.")
    per_device_train_batch_size: int = _f(8, "Rows per process per micro-batch.")
    per_device_eval_batch_size: int = _f(8, "Rows per process per evaluation batch.")
    gradient_accumulation_steps: int = _f(1, "Micro-batches per optimizer step.")
    learning_rate: float = _f(5e-5, "Peak learning rate.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    adam_beta1: float = _f(0.9, "AdamW beta1.")
    adam_beta2: float = _f(0.999, "AdamW beta2.")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon.")
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm (across shards) to this; 0 disables.")
    lr_scheduler_type: str = _f("linear", "Any transformers scheduler: linear, cosine, constant, ...")
    warmup_steps: int = _f(0, "Linear warmup steps.")
    warmup_ratio: float = _f(0.0, "Warmup as a fraction of the total steps (used when --warmup_steps is 0).")
    # The registry's names are added to the help when the parser is built (shardtune.recipe.run_config.flag_help).
    optim: str = _f("adamw_torch", "The optimizer")
    bf16: bool = _f(False, "bf16 weights and compute (the frozen base is held in bf16).")
    fp16: bool = _f(False, "fp16 compute.")
    gradient_checkpointing: bool = _f(False, "Recompute each decoder block's activations in backward.")
    gradient_checkpointing_kwargs: str | None = _f(
        None, "As transformers: JSON such as '{\"use_reentrant\": false}' (its one key sets --use_reentrant)."
    )
    checkpoint_every_n_layers: int = _f(
        1,
        "With --gradient_checkpointing (or fsdp_activation_checkpointing): recompute only every N-th decoder "
        "block; the others keep their activations. Faster, and the memory grows with the blocks not recomputed.",
    )
    enable_activation_offloading: bool = _f(
        False,
        "As torchtune's: with activation checkpointing, what the training forward saves for backward (each decoder "
        "block's input, the loss's) is kept in host memory (pinned) and copied back for the backward "
        "(torch.autograd.graph.save_on_cpu), so the GPU holds one block's input instead of every block's. Costs "
        "host RAM and the copies' time; on a machine without CUDA nothing moves.",
    )
    torch_compile: bool = _f(False, "Compile each decoder block with torch.compile.")
    logging_steps: float = _f(
        10, "Log every N optimizer steps; below 1, a ratio of the total steps (ceil(ratio × steps), as transformers)."
    )
    logging_strategy: str = _f("steps", "steps, epoch or no.", choices=["steps", "epoch", "no"])
    log_level: str = _f("passive", "debug, info, warning, error, critical or passive (= info).")
    eval_strategy: str = _f(
        "no", "no, steps or epoch.", aliases=["--evaluation_strategy"], choices=["no", "steps", "epoch"]
    )
    eval_steps: float | None = _f(
        None, "Evaluate every N steps, or below 1 a ratio of the total steps (default: --logging_steps)."
    )
    save_strategy: str = _f("steps", "no, steps or epoch.", choices=["no", "steps", "epoch"])
    save_steps: float = _f(500, "Save a checkpoint every N steps, or below 1 a ratio of the total steps.")
    save_total_limit: int | None = _f(None, "Keep at most N checkpoints.")
    resume_from_checkpoint: str | None = _f(None, "A checkpoint folder, or `latest`.")
    push_to_hub: bool = _f(False, "Upload the result to the Hugging Face Hub.")
    hub_model_id: str | None = _f(None, "Hub repository (default: the output_dir's name).")
    hub_private_repo: bool | None = _f(None, "Create the hub repository as private.")
    hub_strategy: str = _f(
        "every_save",
        "end, every_save, checkpoint or all_checkpoints.",
        choices=["end", "every_save", "checkpoint", "all_checkpoints"],
    )
    hub_token: str | None = _f(None, "Hub token (default: the logged-in token).")
    report_to: str = _f(
        "none",
        "Experiment trackers, as transformers: none, all (every installed one), or a list (commas or spaces) of "
        "tensorboard, "
        "wandb, mlflow. W&B and MLflow read their usual environment (WANDB_PROJECT, WANDB_MODE, "
        "MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME, ...); see docs/monitoring.md.",
    )
    merge_adapter: bool = _f(False, "Also write the base model with the adapter merged into output_dir/merged.")
    eval_harness_tasks: str | None = _f(
        None,
        "After training, run these lm-evaluation-harness tasks (comma-separated) on the result, as `shardtune eval` "
        "does: results in output_dir/eval_results.json/.md and the model card (docs/eval.md).",
    )
    eval_harness_include_path: str | None = _f(None, "A folder of local lm_eval task YAMLs for --eval_harness_tasks.")
    max_nonfinite_steps: int = _f(3, "Stop after this many skipped steps with a non-finite loss or gradient norm.")
    run_name: str | None = _f(None, "A name for the run in logs.")
    context_parallel_size: int = _f(
        1,
        "Split every row's positions over this many ranks (context parallelism, for long sequences): FSDP shards "
        "over all ranks, each batch is shared by this many; accelerate's parallelism_config_cp_size sets it too "
        "(docs/long_context.md).",
    )
    tensor_parallel_size: int = _f(
        1,
        "Slice each decoder block's linear layers over this many ranks of a machine (tensor parallelism: q/k/v/gate/"
        "up column-parallel, o/down row-parallel, LoRA's factors placed to match); FSDP shards over the rest. "
        "Llama-style families, LoRA, DoRA or full fine-tuning, with --context_parallel_size too; accelerate's "
        "parallelism_config_tp_size sets it too "
        "(docs/parallelism.md).",
    )
    ddp_timeout: int = _f(
        1800,
        "Seconds a collective waits for the other ranks before failing; lower it so that a "
        "hung or lost rank stops the run sooner.",
    )
    # Preference tuning: what is minimised, with TRL's DPOConfig/CPOConfig names for the knobs (docs/preference.md).
    # No argparse choices: objectives registered after import (objectives.loss.register_objective) are valid too;
    # the registry checks the name, and its names are added to the help when the parser is built.
    objective: str = _f("sft", "What a step minimises")
    beta: float = _f(0.1, "Preference objectives: DPO's KL strength (IPO's tau), SimPO's, ORPO's and KTO's beta.")
    loss_type: str = _f(
        "sigmoid",
        "--objective dpo: sigmoid (DPO) or ipo; --objective grpo: grpo, bnpo, dr_grpo or dapo (its default, as TRL's).",
        choices=["sigmoid", "ipo", "grpo", "bnpo", "dr_grpo", "dapo"],
    )
    simpo_gamma: float = _f(0.5, "--objective simpo: the target reward margin.")
    desirable_weight: float = _f(1.0, "--objective kto: the weight of the desirable examples' losses (TRL's name).")
    undesirable_weight: float = _f(1.0, "--objective kto: the weight of the undesirable examples' losses.")
    router_aux_loss_coef: float | None = _f(
        None,
        "Mixtures of experts, every objective: the weight of the router load-balancing loss added to the loss "
        "(default: the config's router_aux_loss_coef, whatever its output_router_logits says); 0 turns it off.",
    )
    precompute_ref_log_probs: bool = _f(
        False,
        "--objective dpo or kto with an adapter: compute the reference log-probs once before training (stored with the "
        "data cache) instead of a forward with the adapter disabled every step. Always on for full fine-tuning "
        "and with --adapter_path.",
    )
    disable_dropout: bool = _f(True, "Preference objectives: turn dropout off in the model, as TRL does.")
    # Online RL (--objective grpo), with TRL's GRPOConfig names (docs/rl.md).
    num_generations: int = _f(8, "--objective grpo: completions sampled per prompt (a group).")
    max_prompt_length: int | None = _f(None, "--objective grpo: keep a prompt's last N tokens (default: all).")
    max_completion_length: int = _f(512, "--objective grpo: the most tokens a completion may have.")
    temperature: float = _f(1.0, "--objective grpo: sampling temperature (> 0).")
    top_p: float = _f(1.0, "--objective grpo: nucleus sampling's probability mass, in (0, 1].")
    top_k: int = _f(0, "--objective grpo: sample among the k likeliest tokens (0: all).")
    epsilon: float = _f(
        0.2, "--objective grpo: the ratio's clipping range below 1 (and above, without --epsilon_high)."
    )
    epsilon_high: float | None = _f(None, "--objective grpo: the clipping range above 1 (DAPO: 0.28).")
    scale_rewards: str = _f(
        "group", "--objective grpo: divide advantages by the std of the group, the batch, or none.",
        choices=["group", "batch", "none"],
    )  # fmt: skip
    num_iterations: int = _f(1, "--objective grpo: passes over each generation batch (mu).")
    steps_per_generation: int | None = _f(
        None,
        "--objective grpo: micro-batches per rank a generation batch feeds (default --gradient_accumulation_steps).",
    )
    mask_truncated_completions: bool = _f(False, "--objective grpo: completions cut at the length limit count nowhere.")
    reward_funcs: str = _f(
        "", "--objective grpo: reward functions: built-in names, module:function or path/file.py:function."
    )
    reward_weights: str | None = _f(None, "--objective grpo: one weight per reward function (default: all 1).")
    reward_timeout: float = _f(120.0, "--objective grpo: seconds a reward function may take per call.")
    rollout_engine: str = _f(
        "transformers", "--objective grpo: what generates: the training ranks' own model, or a vLLM server.",
        choices=["transformers", "vllm"],
    )  # fmt: skip
    vllm_server_base_url: str | None = _f(None, "--rollout_engine vllm: the server's URL (default: host and port).")
    vllm_server_host: str = _f("0.0.0.0", "--rollout_engine vllm: the server's host.")
    vllm_server_port: int = _f(8000, "--rollout_engine vllm: the server's port.")
    vllm_server_timeout: float = _f(240.0, "--rollout_engine vllm: seconds to wait for the server to answer.")
    vllm_importance_sampling_correction: bool = _f(
        True, "--rollout_engine vllm: weight each token by min(pi_trainer / pi_engine, cap) (truncated IS, TRL's)."
    )
    vllm_importance_sampling_clip_max: float = _f(3.0, "--rollout_engine vllm: that cap.")
    sync_probe_tolerance: float | None = _f(
        None, "--objective grpo: trainer/engine probe gap allowed, nats/token (default by dtype: docs/rl.md)."
    )
    gather_for_generation: bool = _f(
        True, "--objective grpo, transformers engine: gather each block once per rollout, not per token."
    )
    # Accepted so that command lines written for transformers' Trainer keep working.
    overwrite_output_dir: bool = _f(
        False,
        "Train into an --output_dir that holds another run: its checkpoints, metrics.jsonl and summary are removed "
        "first (without it such a folder is refused unless the run resumes).",
    )
    dataloader_num_workers: int = _f(0, "Accepted for compatibility; rows are pre-tokenized and packed.")
    remove_unused_columns: bool = _f(True, "Accepted for compatibility.")
    do_train: bool = _f(True, "Accepted for compatibility.")
    do_eval: bool = _f(False, "Accepted for compatibility.")

    @property
    def generation_steps(self) -> int:
        """--objective grpo: the micro-batches per rank one generation batch feeds, --steps_per_generation or else
        --gradient_accumulation_steps (TRL's default); what the rollouts (recipe.rl) and the planner read."""
        return self.steps_per_generation or self.gradient_accumulation_steps


@dataclass
class RunConfig:
    model: ModelArguments
    data: DataArguments
    train: TrainArguments
    fsdp: FSDPSettings

    # Flags given on the command line or keys of the run file (canonical names), as opposed to defaults.
    explicit: frozenset[str] = frozenset()

    def to_dict(self) -> dict[str, Any]:
        return {k: dataclasses.asdict(getattr(self, k)) for k in ("model", "data", "train", "fsdp")}

    @property
    def precision(self) -> Precision:
        """Compute, storage and export dtypes: --bf16/--fp16 or the YAML's mixed_precision, decided here only."""
        t = self.train
        return resolve_precision(
            bf16=t.bf16, fp16=t.fp16, mixed_precision=self.fsdp.mixed_precision, peft=self.model.use_peft_lora
        )

    @property
    def activation_checkpointing(self) -> bool:
        return activation_checkpointing(self.train, self.fsdp.activation_checkpointing)


def activation_checkpointing(train: TrainArguments, fsdp_activation_checkpointing: bool) -> bool:
    """Whether the decoder blocks recompute their activations in the backward: --gradient_checkpointing (the
    reference script's flag) or the accelerate config's fsdp_activation_checkpointing, either turns it on. The one
    rule the builder, the flags' checks and the planner read."""
    return train.gradient_checkpointing or fsdp_activation_checkpointing


# Flags that are a number of steps, or below 1 a ratio of the total steps (transformers' TrainingArguments).
STEP_INTERVALS = ("logging_steps", "eval_steps", "save_steps")


def interval_steps(value: float, total_steps: int) -> int:
    """A --logging_steps/--eval_steps/--save_steps value as steps: below 1, ceil(ratio × total steps) (at least 1),
    as transformers' Trainer; otherwise the whole number it is (validation refuses 2.5)."""
    if value < 1:
        return max(1, math.ceil(value * total_steps))
    return int(value)


# The flag groups, in the order parse_args returns them.
ARG_CLASSES = (ModelArguments, DataArguments, TrainArguments)
# Each flag's default (the names are unique across the classes: one parser takes them all); what a flag "set away
# from its default" is measured against, by the configuration's checks and the objectives'.
FLAG_DEFAULTS = {f.name: f.default for cls in ARG_CLASSES for f in dataclasses.fields(cls)}
