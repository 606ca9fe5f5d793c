"""The flags of an online-RL run (--objective grpo), checked before any data or model is loaded: their ranges, the
flags that only mean something there, the reward functions (resolved, not run), and what is not supported yet,
each one line naming the flag and the fix (shardtune.recipe.run_config gathers these with the others)."""

from __future__ import annotations

from shardtune.config.arguments import FLAG_DEFAULTS
from shardtune.objectives.grpo import GRPO_LOSS_TYPES
from shardtune.rl.rewards import reward_problems

# The flags only --objective grpo reads: set away from their defaults with another objective, they change nothing.
RL_FLAGS = (
    "num_generations", "max_prompt_length", "max_completion_length", "temperature", "top_p", "top_k", "epsilon",
    "epsilon_high", "scale_rewards", "num_iterations", "steps_per_generation", "mask_truncated_completions",
    "reward_funcs", "reward_weights", "reward_timeout", "rollout_engine", "vllm_server_base_url", "vllm_server_host",
    "vllm_server_port", "vllm_server_timeout", "vllm_importance_sampling_correction",
    "vllm_importance_sampling_clip_max", "sync_probe_tolerance", "gather_for_generation",
)  # fmt: skip
VLLM_FLAGS = tuple(f for f in RL_FLAGS if f.startswith("vllm_"))


def reward_specs(value: str) -> list[str]:
    """--reward_funcs as a list (comma- or space-separated on the command line)."""
    return [s.strip() for s in value.replace(",", " ").split() if s.strip()]


def reward_weights(value: str | None) -> list[float] | None:
    """--reward_weights as floats (None: unset); ValueError naming the flag for a non-number."""
    if value is None or not str(value).strip():
        return None
    try:
        return [float(w) for w in str(value).replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"--reward_weights {value!r}: give numbers, one per reward function (e.g. 1.0,0.5).") from None


def rl_problems(cfg) -> list[str]:
    """Every problem of the RL flags of `cfg` (a RunConfig)."""
    t = cfg.train
    if t.objective != "grpo":
        unread = [f"--{f}" for f in RL_FLAGS if getattr(t, f) != FLAG_DEFAULTS[f]]
        if not unread:
            return []
        one = len(unread) == 1
        line = f"{', '.join(unread)} only appl{'ies' if one else 'y'} to --objective grpo; remove "
        return [line + f"{'it' if one else 'them'} or set --objective grpo."]
    return _range_problems(t) + _unsupported(cfg) + _reward_problems(t)


def _range_problems(t) -> list[str]:
    p = []
    for flag, ok, need in (
        ("num_generations", t.num_generations >= 2, ">= 2 (a group's advantages compare its completions)"),
        ("max_completion_length", t.max_completion_length >= 1, ">= 1"),
        ("temperature", t.temperature > 0, "> 0 (TRL samples; greedy decoding has no log-prob ratio to learn from)"),
        ("top_p", 0 < t.top_p <= 1, "in (0, 1]"),
        ("top_k", t.top_k >= 0, ">= 0 (0: no top-k)"),
        ("epsilon", t.epsilon > 0, "> 0"),
        ("epsilon_high", t.epsilon_high is None or t.epsilon_high > 0, "> 0"),
        ("num_iterations", t.num_iterations >= 1, ">= 1"),
        ("steps_per_generation", t.steps_per_generation is None or t.steps_per_generation >= 1, ">= 1"),
        ("reward_timeout", t.reward_timeout > 0, "> 0 seconds"),
        ("beta", t.beta >= 0, ">= 0 (0: no KL term, TRL's default)"),
        ("max_prompt_length", t.max_prompt_length is None or t.max_prompt_length >= 1, ">= 1"),
        ("sync_probe_tolerance", t.sync_probe_tolerance is None or t.sync_probe_tolerance > 0, "> 0"),
    ):
        if not ok:
            p.append(f"--{flag} must be {need} (got {getattr(t, flag)}).")
    if t.loss_type not in GRPO_LOSS_TYPES:
        p.append(f"--loss_type {t.loss_type} is not a GRPO loss; use one of {', '.join(GRPO_LOSS_TYPES)}.")
    return p


def _unsupported(cfg) -> list[str]:
    """What an RL run cannot do yet, each with the fix."""
    m, d, t = cfg.model, cfg.data, cfg.train
    p = []
    if t.context_parallel_size > 1:
        p.append("--objective grpo does not support context parallelism yet; set --context_parallel_size 1.")
    if d.streaming:
        p.append("--objective grpo reads its prompts whole; set --streaming False.")
    if d.packing:
        p.append("--packing does not apply to --objective grpo (each completion is a row of its own); remove it.")
    if t.eval_strategy != "no":
        p.append(
            f"--eval_strategy {t.eval_strategy}: --objective grpo has no evaluation yet (the rewards of each "
            "generation batch are logged every step); set --eval_strategy no."
        )
    if t.beta > 0 and not m.use_peft_lora:
        p.append(
            "--beta > 0 with full fine-tuning needs a second copy of the model as the reference, which shardtune "
            "does not hold yet; train an adapter (--use_peft_lora True: the reference is the adapter disabled) or "
            "set --beta 0."
        )
    if t.beta > 0 and m.adapter_path:
        p.append(
            "--beta > 0 with --adapter_path: GRPO's reference is the model with its adapter disabled (TRL's rule), "
            "so the KL term would pull the adapter you continue back to the base without it; merge that adapter "
            "into the base first (shardtune merge) and train a new one on the merged model, or set --beta 0."
        )
    if t.rollout_engine != "vllm" and any(getattr(t, f) != FLAG_DEFAULTS[f] for f in VLLM_FLAGS):
        used = [f"--{f}" for f in VLLM_FLAGS if getattr(t, f) != FLAG_DEFAULTS[f]]
        p.append(f"{', '.join(used)} only apply to --rollout_engine vllm; remove them or set --rollout_engine vllm.")
    return p


def _reward_problems(t) -> list[str]:
    specs = reward_specs(t.reward_funcs)
    if not specs:
        need = "built-in names (format, exact_answer, math_answer), module:function or path/to/file.py:function"
        return [f"--objective grpo needs --reward_funcs: {need}."]
    try:
        weights = reward_weights(t.reward_weights)
    except ValueError as e:
        return [str(e)]
    return reward_problems(specs, weights)
