"""An online-RL run's parts (--objective grpo): its rollouts as the loop's training split, and, once the model is
built, the engine that generates them, the reward functions and the sync probe (shardtune.rl)."""

from __future__ import annotations

from pathlib import Path

from shardtune.config.arguments import RunConfig
from shardtune.rl.checks import reward_specs, reward_weights
from shardtune.rl.engine import SamplingSettings
from shardtune.rl.generate import TransformersEngine
from shardtune.rl.probe import TOLERANCE, SyncProbe
from shardtune.rl.rewards import load_reward_functions
from shardtune.rl.rollout import Rollouts, RolloutSettings
from shardtune.rl.vllm_server import VLLMServerEngine, vllm_engine_problems
from shardtune.runtime.log import print0


def eos_ids(tokenizer, model_path: str | None) -> tuple[int, ...]:
    """The tokens that end a completion: the tokenizer's EOS (a chat format's end of turn, data.templates) and the
    model's own stop tokens from its generation_config.json, which transformers' generate stops on too (Llama 3
    Instruct lists <|eot_id|> there)."""
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id} - {None}
    try:
        listed = GenerationConfig.from_pretrained(model_path).eos_token_id if model_path else None
    except (OSError, ValueError):  # no generation_config.json: the tokenizer's EOS alone
        listed = None
    ids.update(listed if isinstance(listed, list) else [] if listed is None else [listed])
    return tuple(sorted(ids))


def rollout_settings(cfg: RunConfig, info, tokenizer) -> RolloutSettings:
    """The rollouts' settings from the flags; ValueError naming the flags when a generation batch is not whole
    groups (TRL's rule)."""
    t = cfg.train
    steps = t.generation_steps
    dp = info.dims.dp_size
    per_generation = t.per_device_train_batch_size * dp * steps
    if per_generation % t.num_generations:
        raise ValueError(
            f"a generation batch of {per_generation} completions (--per_device_train_batch_size "
            f"{t.per_device_train_batch_size} × {dp} data-parallel rank(s) × --steps_per_generation {steps}) is not "
            f"whole groups of --num_generations {t.num_generations}; make it a multiple."
        )
    vllm = t.rollout_engine == "vllm"
    return RolloutSettings(
        per_device_batch=t.per_device_train_batch_size,
        num_generations=t.num_generations,
        steps_per_generation=steps,
        num_iterations=t.num_iterations,
        seed=t.seed,
        sampling=SamplingSettings(
            max_completion_length=t.max_completion_length,
            temperature=t.temperature,
            top_p=t.top_p,
            top_k=t.top_k,
            eos_token_ids=eos_ids(tokenizer, cfg.model.model_name_or_path),
            pad_token_id=tokenizer.pad_token_id,
        ),
        beta=t.beta,
        # TRL's rule: the old log-probs are needed once the policy moves within a generation batch
        old_logps=steps > t.gradient_accumulation_steps or t.num_iterations > 1,
        importance_sampling=vllm and t.vllm_importance_sampling_correction,
        mask_truncated_completions=t.mask_truncated_completions,
        scale_rewards=t.scale_rewards,
        reward_timeout_s=t.reward_timeout,
        pad_id=tokenizer.pad_token_id,
    )


def rollouts(cfg: RunConfig, prompts, tokenizer, info, *, new_token_rows: bool) -> Rollouts:
    """The loop's training split of an RL run: the prompts and how they are rolled out (no model yet). A vLLM
    server is checked here, before the model loads: what it cannot serve, and how it was started."""
    if cfg.train.rollout_engine == "vllm" and (problems := _vllm_problems(cfg, new_token_rows)):
        raise ValueError("; ".join(problems))
    split = Rollouts(prompts, settings=rollout_settings(cfg, info, tokenizer), info=info, tokenizer=tokenizer)
    need = split.s.prompts_per_generation(info.dims.dp_size)
    if len(prompts) < need:
        raise ValueError(
            f"--dataset_name {cfg.data.dataset_name}: {len(prompts)} prompts, fewer than one generation batch's "
            f"{need}; add prompts or lower --per_device_train_batch_size or --steps_per_generation."
        )
    return split


def attach(cfg: RunConfig, split: Rollouts, model, info) -> None:
    """Give the rollouts the model they sample from, the engine, the rewards and the probe."""
    t = cfg.train
    rewards = load_reward_functions(reward_specs(t.reward_funcs), reward_weights(t.reward_weights))
    tolerance = t.sync_probe_tolerance or TOLERANCE[cfg.precision.compute]
    probe = SyncProbe.from_prompts(split.prompts.prompt_ids, tolerance, split.s.pad_id)
    split.attach(model=model, engine=_engine(cfg, model, info, split.tokenizer), rewards=rewards, probe=probe)
    print0(
        f"GRPO: {t.num_generations} completions per prompt, engine {t.rollout_engine}, rewards "
        f"{', '.join(f'{f.name}×{f.weight:g}' for f in rewards)}; the engine is checked against the trainer after "
        f"every sync (tolerance {tolerance:g} nats/token)."
    )


def _engine(cfg: RunConfig, model, info, tokenizer):
    t = cfg.train
    if t.rollout_engine == "transformers":
        return TransformersEngine(model, info.device, gather_once=t.gather_for_generation)
    return VLLMServerEngine(
        _vllm_url(cfg), _adapter_dir(cfg), tokenizer, rank=info.rank, timeout_s=t.vllm_server_timeout
    )


def _vllm_url(cfg: RunConfig) -> str:
    """TRL's rule: --vllm_server_base_url, else http://host:port."""
    t = cfg.train
    return t.vllm_server_base_url or f"http://{t.vllm_server_host}:{t.vllm_server_port}"


def _adapter_dir(cfg: RunConfig) -> Path:
    """Where rank 0 writes each adapter version for the server to load: a path both must read (one machine, or a
    shared filesystem)."""
    return Path(cfg.train.output_dir).resolve() / "vllm_adapters"


def _vllm_problems(cfg: RunConfig, new_token_rows: bool) -> list[str]:
    m, t = cfg.model, cfg.train
    adapter_dir = _adapter_dir(cfg)
    adapter_dir.mkdir(parents=True, exist_ok=True)
    return vllm_engine_problems(
        use_peft_lora=m.use_peft_lora,
        use_dora=m.use_dora,
        new_token_rows=new_token_rows,
        modules_to_save=[x for x in (m.modules_to_save or "").split(",") if x],
        lora_r=m.lora_r,
        server_url=_vllm_url(cfg),
        adapter_dir=adapter_dir,
        timeout_s=min(t.vllm_server_timeout, 10.0),
    )
