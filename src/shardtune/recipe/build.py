"""What a run trains, built in the order that fails cheapest first: the data (a bad dataset fails before the model
loads), then the sharded model with its frozen base where the start-up plan put it, the optimizer and its schedule,
the objective and the starting point (a checkpoint's, on resume)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import torch

from shardtune.config.arguments import RunConfig
from shardtune.objectives.loss import objective_spec
from shardtune.parallel import setup
from shardtune.planning.fit import RunFit
from shardtune.recipe import data, objective, rl, settings, state
from shardtune.runtime import hooks
from shardtune.runtime.log import print0
from shardtune.runtime.stop import StopHandler
from shardtune.training.optimizers import build_optimizer
from shardtune.training.trainer import LoopSettings, LoopState, StopFlag


@dataclass
class Built:
    """What a run trains: its data, its sharded model, optimizer and schedule, objective and starting point."""

    tokenizer: object
    train_split: object
    eval_split: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    objective: object
    settings: LoopSettings
    loop_state: LoopState
    stop: StopFlag | None = None  # the loop's signal handler, which stays installed through the final save


def build(cfg: RunConfig, info, fit: RunFit, stop: StopHandler) -> Built:
    """Data first, then the model, optimizer, objective and state; `stop` is told each stage, for the line a signal
    before the loop prints."""

    t = cfg.train
    _seed_everything(t.seed)
    stop.at("preparing the data")
    tokenizer, new_ids = data.load_tokenizer(cfg)
    train_split, eval_split = data.prepare_data(cfg, tokenizer, info)
    if objective_spec(t.objective).data == "prompts":  # online RL: the loop trains on rollouts of the prompts
        train_split = rl.rollouts(cfg, train_split, tokenizer, info, new_token_rows=bool(new_ids))
    if t.resume_from_checkpoint:  # before the model loads: another run's data is refused at no cost
        state.check_resumed_data(cfg, train_split)
    spe = data.steps_per_epoch_for(cfg, train_split, info)
    total = data.total_steps(cfg, spe)
    _seed_everything(t.seed)
    stop.at("loading the model")
    hooks.at("load", step=0, rank=info.rank)
    spec = settings.model_settings(cfg, info, len(tokenizer), new_ids)
    model = setup.build_sharded_model(spec, info, settings.sharding(cfg, fit))
    optimizer, scheduler = optimizer_and_scheduler(cfg, model, total)
    # Before a checkpoint is loaded: a precomputed reference is the run's starting point, also on resume.
    evaluated = eval_split if t.eval_strategy != "no" else None  # no reference pass for a split never evaluated
    goal = objective.setup_objective(cfg, model, [train_split, evaluated], info, tokenizer.pad_token_id)
    if hasattr(train_split, "attach"):
        rl.attach(cfg, train_split, model, info)
    stop.at("loading the checkpoint")
    loop_state = state.resume(cfg, model, optimizer, scheduler, info) if t.resume_from_checkpoint else LoopState()
    loop = settings.loop_settings(cfg, total, spe, tokenizer.pad_token_id)
    global_batch = t.per_device_train_batch_size * info.dims.dp_size * t.gradient_accumulation_steps
    print0(f"Training {total} steps ({spe} per epoch), global batch {global_batch} rows.")
    return Built(tokenizer, train_split, eval_split, model, optimizer, scheduler, goal, loop, loop_state)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def optimizer_and_scheduler(cfg: RunConfig, model, total: int):
    """The optimizer of --optim over the trainable parameters, and the learning-rate schedule over `total` steps."""
    from transformers import get_scheduler

    t = cfg.train
    optimizer = build_optimizer(
        [(n, p) for n, p in model.named_parameters() if p.requires_grad],
        optim=t.optim,
        lr=t.learning_rate,
        weight_decay=t.weight_decay,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_epsilon,
    )
    warmup = t.warmup_steps or math.ceil(t.warmup_ratio * total)
    scheduler = get_scheduler(t.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total)
    return optimizer, scheduler
