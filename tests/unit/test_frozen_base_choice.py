"""--frozen_base: which placement a run takes and why (planning.fit.frozen_base_choice), what the planner plans for
each (PlanInputs(replicate_base=...)), the flags refused with it, and the one cast the replicated base gets
(parallel.fsdp.frozen_parameters)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from shardtune.config.errors import ConfigError
from shardtune.parallel.fsdp import frozen_parameters
from shardtune.planning import PlanInputs, estimate_memory, model_state_bytes_per_rank
from shardtune.planning.fit import AUTO_REPLICATE_MARGIN, frozen_base_choice, plan_inputs, plan_shape
from shardtune.planning.known_configs import KNOWN_CONFIGS
from shardtune.planning.model import load_model_config
from shardtune.planning.report import Launch
from shardtune.planning.state import GiB
from shardtune.recipe.run_config import load_run_config

MODEL = "meta-llama/Llama-3.1-8B"  # a config shardtune knows without the hub


def _cfg(tmp_path, *flags, env=None):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    argv = ["--model_name_or_path", MODEL, "--dataset_name", str(data), "--bf16", "True", "--max_seq_len", "2048"]
    return load_run_config([*argv, *flags], env={"ACCELERATE_USE_FSDP": "true", **(env or {})})


LORA = ("--use_peft_lora", "True", "--lora_r", "8", "--lora_target_modules", "all-linear")


def _need(cfg, world: int) -> int:
    shape = plan_shape(load_model_config(MODEL, False), cfg.model.chat_template_format)
    inputs = replace(plan_inputs(cfg, Launch(world_size=world)), replicate_base=True)
    return estimate_memory(shape, inputs).total


def test_auto_replicates_where_the_plan_fits_with_its_margin(tmp_path):
    cfg = _cfg(tmp_path, *LORA)
    need = _need(cfg, 4)
    fits = int(need * (1 + AUTO_REPLICATE_MARGIN)) + 1
    placement, why = frozen_base_choice(cfg, Launch(world_size=4), fits)
    assert placement == "replicated" and f"{need / GiB:.1f} GiB per GPU" in why
    placement, why = frozen_base_choice(cfg, Launch(world_size=4), int(need * (1 + AUTO_REPLICATE_MARGIN)) - 2**20)
    assert placement == "sharded" and f"would need {need / GiB:.1f} GiB" in why


def test_auto_keeps_the_base_sharded_without_a_gpu_or_with_offload(tmp_path):
    cfg = _cfg(tmp_path, *LORA)
    placement, why = frozen_base_choice(cfg, Launch(world_size=2), None)
    assert placement == "sharded" and "no GPU memory" in why and "--frozen_base replicated" in why
    placement, why = frozen_base_choice(cfg, Launch(world_size=2, offload=True), 1000 * GiB)
    assert placement == "sharded" and "fsdp_offload_params" in why


def test_what_the_user_asked_is_taken_and_one_process_needs_nothing(tmp_path):
    rep = _cfg(tmp_path, *LORA, "--frozen_base", "replicated")
    assert frozen_base_choice(rep, Launch(world_size=2), 1 * GiB)[0] == "replicated"  # even where it will not fit
    shd = _cfg(tmp_path, *LORA, "--frozen_base", "sharded")
    assert frozen_base_choice(shd, Launch(world_size=2), 1000 * GiB)[0] == "sharded"
    assert frozen_base_choice(_cfg(tmp_path, *LORA), Launch(world_size=1), 1000 * GiB) == ("sharded", None)
    assert frozen_base_choice(_cfg(tmp_path), Launch(world_size=8), 1000 * GiB) == ("sharded", None)  # full FT


def test_frozen_base_with_nothing_frozen_or_offloaded_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--frozen_base set an adapter, but --use_peft_lora is False"):
        _cfg(tmp_path, "--frozen_base", "replicated")
    with pytest.raises(ConfigError, match=r"--frozen_base replicated .* host RAM: choose one"):
        _cfg(tmp_path, *LORA, "--frozen_base", "replicated", env={"FSDP_OFFLOAD_PARAMS": "true"})
    with pytest.raises(SystemExit):
        _cfg(tmp_path, *LORA, "--frozen_base", "everywhere")


def test_the_planner_holds_the_whole_base_and_gathers_only_the_adapters():
    """Per rank, the replicated plan holds the world-size-1 frozen bytes and the sharded plan's trainable ones; its
    all-gather buffers are the adapters' alone (a block's LoRA matrices in bf16, well under 1% of the base's)."""
    config = KNOWN_CONFIGS[MODEL]
    one = model_state_bytes_per_rank(config, PlanInputs(world_size=1))
    four = model_state_bytes_per_rank(config, PlanInputs(world_size=4))
    sharded = estimate_memory(config, PlanInputs(world_size=4, seq_len=2048, batch_size=2))
    replicated = estimate_memory(config, PlanInputs(world_size=4, seq_len=2048, batch_size=2, replicate_base=True))
    assert replicated.device["frozen base weights"] == one["frozen"]
    assert sharded.device["frozen base weights"] == four["frozen"]
    assert replicated.device["trainable weights"] == sharded.device["trainable weights"] == four["trainable"]
    gathered = replicated.device["FSDP all-gather buffers"]
    assert 0 < gathered < 0.01 * sharded.device["FSDP all-gather buffers"]
    with pytest.raises(ValueError, match="replicate_base"):
        estimate_memory(config, PlanInputs(world_size=4, offload=True, replicate_base=True))


def test_frozen_parameters_are_cast_once_to_the_compute_dtype():
    """What FSDP's all-gather would cast at every step is cast once; the trainable parameters keep their fp32."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].requires_grad_(False)
    frozen = frozen_parameters(model, torch.bfloat16)
    assert frozen == set(model[0].parameters())
    assert all(p.dtype == torch.bfloat16 for p in model[0].parameters())
    assert all(p.dtype == torch.float32 for p in model[1].parameters())
    assert frozen_parameters(model, None) == frozen  # fp32 compute: nothing to cast
