"""The run's settings, derived once from its checked configuration (`RunConfig`) and its processes (`DistInfo`) for
the parts of `shardtune train` that come after: the launch the planner plans (`run_launch`), the planner's one pass
at start-up (`start_plan`: where the frozen base lives and whether the run fits its GPU, decided on rank 0 and sent
to every rank), the model's spec (`model_settings`), how FSDP shards it (`sharding`) and the loop's settings
(`loop_settings`). The model's spec holds the model's facts alone; FSDP's decisions and the frozen base's placement
are the parallel settings (parallel.parallelize.ShardingSettings). The planner reads the model's facts off the
same spec (`models.builder.model_facts`, planning.fit.plan_inputs), never off the flags.

Every run decision these read has one home, which `shardtune plan` reads too (tests/unit/test_run_settings.py
fails when a second derivation disagrees): packed rows (`DataArguments.packed_rows`), the parallel sizes
(`config.run.resolve_parallel_sizes`), the precision (`RunConfig.precision`), activation checkpointing
(`RunConfig.activation_checkpointing`), FSDP or the plain module (`config.fsdp.fsdp_reason`), the loss's chunk
(`models.training_module.loss_chunk_tokens`, of the head's rows), the objective's defaults
(`recipe.run_config.complete_run_config`), the launch (`planning.fit.launch_from_settings`, from `RunConfig.fsdp`
as the launcher's environment was read once), an online-RL generation batch's micro-batches
(`TrainArguments.generation_steps`), the model's facts (`models.builder.model_facts`) and how FSDP shards it
(`parallel.parallelize.sharding_settings`).
"""

from __future__ import annotations

import torch

from shardtune.config.arguments import RunConfig, interval_steps
from shardtune.models.builder import ModelSpec, model_spec
from shardtune.parallel.mesh import broadcast_object
from shardtune.parallel.parallelize import ShardingSettings, sharding_settings
from shardtune.planning.fit import RunFit, fit_run, launch_from_settings
from shardtune.planning.report import Launch
from shardtune.runtime.log import print0, warn0
from shardtune.training.trainer import LoopSettings


def run_launch(cfg: RunConfig, info) -> Launch:
    """The launch the planner plans this run on: its FSDP settings as the configuration read them from the
    launcher's environment (the parallelism_config's strategy included), on the processes `info` found."""
    machines = max(1, info.world_size // max(info.local_world_size, 1))
    return launch_from_settings(cfg.fsdp, info.world_size, machines)


def gpu_memory(info) -> int | None:
    """The memory of this rank's GPU, which the start-up plan is made against (None: no GPU, nothing is planned)."""
    if info.device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(info.device).total_memory


def start_plan(cfg: RunConfig, info) -> RunFit:
    """The planner's one pass at start-up (planning.fit.fit_run), before any data is read: on rank 0, which sends
    its answer to every rank (all must place the frozen base alike); the placement's reason and the warning of a
    run too large for its GPU are logged once."""
    fit = fit_run(cfg, run_launch(cfg, info), gpu_memory(info)) if info.is_main else None
    fit = broadcast_object(fit)
    if fit.why:
        print0(fit.why)
    if fit.warning:
        warn0(fit.warning)
    return fit


def model_settings(cfg: RunConfig, info, n_tokens: int, new_token_ids: list[int]) -> ModelSpec:
    """The model's spec (models.builder.model_spec: the one place a run's flags become a ModelSpec) on this
    device, with the embeddings' rows after the tokenizer's `new_token_ids`."""
    return model_spec(cfg, info.device.type, n_tokens, new_token_ids)


def sharding(cfg: RunConfig, fit: RunFit) -> ShardingSettings:
    """How FSDP shards the model (parallel.parallelize.sharding_settings, from the run's FSDP settings), with the
    frozen base where the start-up plan put it."""
    return sharding_settings(cfg.fsdp, fit.frozen_base)


def loop_settings(cfg: RunConfig, total: int, steps_per_epoch: int, pad_id: int) -> LoopSettings:
    """The training loop's settings: the one place a run's flags become LoopSettings."""
    t = cfg.train
    return LoopSettings(
        batch_size=t.per_device_train_batch_size,
        eval_batch_size=t.per_device_eval_batch_size,
        grad_accum=t.gradient_accumulation_steps,
        max_grad_norm=t.max_grad_norm,
        total_steps=total,
        steps_per_epoch=steps_per_epoch,
        seed=t.seed,
        pad_id=pad_id,
        logging_steps=interval_steps(t.logging_steps, total),
        logging_strategy=t.logging_strategy,
        eval_strategy=t.eval_strategy,
        eval_steps=interval_steps(t.eval_steps or t.logging_steps, total),
        save_strategy=t.save_strategy,
        save_steps=interval_steps(t.save_steps, total),
        max_nonfinite_steps=t.max_nonfinite_steps,
        activation_offloading=t.enable_activation_offloading,
    )
