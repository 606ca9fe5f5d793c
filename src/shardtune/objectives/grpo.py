"""GRPO's loss and advantages, as trl 1.16's GRPOTrainer computes them (`_generate_and_score_completions` for the
advantages, `_compute_loss` for the loss and its metrics), with normalisers over the whole global batch.

A micro-batch holds prompt+completion rows (right-padded; position ids restart at 0 on padding) and:
  labels          [B, T] shifted targets: the completion tokens that count, else -100;
  advantages      [B]    each row's advantage (group_advantages over the whole generation batch);
  old_logps       [B, T] optional: the policy's log-probs at generation time (absent: the current ones, detached);
  ref_logps       [B, T] the reference's log-probs (when beta != 0);
  sampling_logps  [B, T] optional: the sampling engine's log-probs, for the truncated importance-sampling correction;
  row_valid       [B]    False for filler rows, which count nowhere.
The per-position tensors are aligned with labels, all log-probs of the logits divided by the temperature
(GRPOObjective.head computes them so).

Per completion token, with r = exp(log π − log π_old) and A the row's advantage:
  loss = −min(r·A, clip(r, 1 − ε, 1 + ε_high)·A) [× the importance-sampling ratio] + β·KL,
  KL   = exp(ref − log π) − (ref − log π) − 1 (k3), times r when use_bias_correction_kl (TRL's default).
Normalised over the global batch (all micro-batches and ranks, Objective's interface): grpo: Σ_rows (Σ_tokens loss /
the row's tokens) / rows; bnpo and dapo: Σ loss / tokens; dr_grpo: Σ loss / (rows × max_completion_length).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from shardtune.objectives.heads import token_logps
from shardtune.objectives.loss import Objective, ObjectiveSpec, register_objective

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
# TRL's aliases of scale_rewards (GRPOConfig.__post_init__): True is "group", False "none".
_SCALE_ALIASES = {"true": "group", "false": "none"}
STD_EPSILON = 1e-4  # added to the std before dividing, as TRL does
IS_RATIO = "sampling/importance_sampling_ratio/mean"
CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """trl.trainer.utils.nanstd: the std with Bessel's correction, NaN (no reward) ignored, NaN for one value."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance * correction)
    return std.reshape(()) if dim is None else std.squeeze(dim)


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N], the std of each row's group [N]) of rewards [N]: the whole global generation batch,
    consecutive rows of one prompt's group. The advantages as TRL computes them (multi_objective_aggregation
    sum_then_normalize): the reward minus its group's mean, divided by (std + 1e-4) with the std of its group
    ('group', also True), of the whole batch ('batch'), or not divided ('none'). A NaN reward (unscorable) is
    left out of the means and stds and gets advantage 0. The group's std is 0 where the group has no signal
    (TRL's frac_reward_zero_std counts those rows; under 'batch' TRL counts the batch std's instead)."""
    scale = _SCALE_ALIASES.get(str(scale_rewards).lower(), str(scale_rewards))
    if scale not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards {scale_rewards!r} is not one of {', '.join(SCALE_REWARDS)}.")
    if num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards are not whole groups of {num_generations} generations.")
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if num_generations > 1:
        group_std = _nanstd(groups, dim=1).repeat_interleave(num_generations)
    else:  # TRL: only in evaluation with one generation
        group_std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale == "group":
        advantages = advantages / (group_std + STD_EPSILON)
    elif scale == "batch":
        std = _nanstd(rewards) if rewards.numel() > 1 else torch.zeros((), dtype=rewards.dtype)
        advantages = advantages / (std + STD_EPSILON)
    return torch.nan_to_num(advantages, nan=0.0), group_std


@dataclass
class TokenTerms:
    """Per completion token ([B, T]; only `mask`'s positions mean anything): the loss and what the metrics read."""

    loss: torch.Tensor
    mask: torch.Tensor
    kl: torch.Tensor | None
    low_clipped: torch.Tensor
    high_clipped: torch.Tensor
    is_ratio: torch.Tensor | None


class GRPOObjective(Objective):
    """GRPO's clipped surrogate on sampled completions (TRL's loss types grpo, bnpo, dr_grpo, dapo), its KL to the
    reference and TRL's truncated importance-sampling correction (vllm_importance_sampling_mode token_truncate,
    clip_max = importance_sampling_cap, no clip_min).

    The normalisers are global (totals: the sums of counts over all micro-batches and ranks), so N ranks × G
    micro-batches give the loss and gradient of one process with the whole batch. For grpo, dr_grpo and dapo that
    is TRL's own (its grpo and dr_grpo mean over equal micro-batches, dapo's num_items_in_batch counts the
    generation batch's tokens); TRL's bnpo divides each micro-batch by its own tokens, which this divides by the
    step's tokens: the same on one micro-batch on one process, a token-weighted mean over several."""

    name = "grpo"

    def __init__(
        self,
        *,
        beta: float,
        loss_type: str,
        epsilon: float,
        epsilon_high: float | None,
        max_completion_length: int,
        temperature: float,
        importance_sampling_cap: float | None = None,
        use_bias_correction_kl: bool = True,
    ):
        if loss_type not in GRPO_LOSS_TYPES:
            raise ValueError(f"GRPO loss_type {loss_type!r} is not one of {', '.join(GRPO_LOSS_TYPES)}.")
        self.beta, self.loss_type, self.temperature = beta, loss_type, temperature
        self.epsilon_low = epsilon
        self.epsilon_high = epsilon if epsilon_high is None else epsilon_high
        self.max_completion_length = max_completion_length
        self.importance_sampling_cap = importance_sampling_cap
        self.use_bias_correction_kl = use_bias_correction_kl  # TRL's default: the KL term times the ratio r
        self.needs_reference = beta != 0

    @property
    def head(self):
        """The head of the policy's (and the reference's, and the old policy's) per-token log-probs: the logits
        divided by the temperature, as every log-prob the loss compares must be."""
        return functools.partial(token_logps, temperature=self.temperature)

    def counts(self, batch: dict[str, torch.Tensor]) -> dict[str, int]:
        valid = batch["row_valid"].bool()
        mask = (batch["labels"] != -100) & valid[:, None]
        return {"sequences": int(valid.sum()), "tokens": int(mask.sum()), "micro_batches": 1}

    def step(self, model: nn.Module, batch: dict, totals: dict[str, int], grad_scale: float):
        valid = batch["row_valid"].bool()
        labels = batch["labels"].masked_fill(~valid[:, None], -100)  # a filler row scores nothing
        rows = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "labels": labels}
        logps, entropy = model(**rows, head=self.head)
        terms = self.token_terms(logps, batch, labels != -100)
        loss = self.normalise(terms.loss, terms.mask, totals)
        return loss * grad_scale, self._sums(loss, terms, entropy)

    def token_terms(self, logps: torch.Tensor, batch: dict, mask: torch.Tensor) -> TokenTerms:
        """TRL's per-token loss (importance_sampling_level token, no delta, no entropy mask) from the policy's
        log-probs [B, T] and the batch's, at `mask`'s positions (0 elsewhere)."""
        old = batch.get("old_logps")
        old = logps.detach() if old is None else torch.where(mask, old.float(), logps.detach())
        advantages = torch.where(batch["row_valid"].bool(), batch["advantages"].float(), 0.0)[:, None]
        ratio = torch.exp(logps - old)
        clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
        loss = -torch.min(ratio * advantages, clipped * advantages)
        is_ratio = None
        if self.importance_sampling_cap is not None:
            sampling = torch.where(mask, batch["sampling_logps"].float(), old)
            diff = torch.nan_to_num(old - sampling, nan=0.0)  # a token the engine could not score: ratio 1
            is_ratio = torch.clamp(torch.exp(diff), max=self.importance_sampling_cap).detach()
            loss = loss * is_ratio
        kl = None
        if self.beta != 0:
            ref = torch.where(mask, batch["ref_logps"].float(), logps.detach())
            kl = torch.exp(ref - logps) - (ref - logps) - 1
            if self.use_bias_correction_kl:
                kl = kl * ratio
            loss = loss + self.beta * kl
        low = (ratio < 1 - self.epsilon_low) & (advantages < 0)
        high = (ratio > 1 + self.epsilon_high) & (advantages > 0)
        return TokenTerms(torch.where(mask, loss, 0.0), mask, kl, low, high, is_ratio)

    def normalise(self, loss: torch.Tensor, mask: torch.Tensor, totals: dict[str, int]) -> torch.Tensor:
        """This micro-batch's share of the global batch's loss, from its per-token losses (0 off the mask)."""
        if self.loss_type == "grpo":
            per_row = loss.sum(-1) / mask.sum(-1).clamp(min=1)
            return per_row.sum() / max(totals["sequences"], 1)
        if self.loss_type == "dr_grpo":
            return loss.sum() / (max(totals["sequences"], 1) * self.max_completion_length)
        return loss.sum() / max(totals["tokens"], 1)  # bnpo, dapo

    def _sums(self, loss: torch.Tensor, terms: TokenTerms, entropy: torch.Tensor) -> dict[str, torch.Tensor]:
        """The step's sums (float64) over this micro-batch's completion tokens; report divides by the tokens."""
        mask = terms.mask

        def total(x: torch.Tensor) -> torch.Tensor:
            return torch.where(mask, x.detach().double(), 0.0).sum()

        low, high = terms.low_clipped, terms.high_clipped
        sums = {"loss": loss.detach().double(), "entropy": total(entropy)}
        sums.update(zip(CLIP_METRICS, (total(low.double()), total(high.double()), total((low | high).double()))))
        if terms.kl is not None:
            sums["kl"] = total(terms.kl)
        if terms.is_ratio is not None:
            sums[IS_RATIO] = total(terms.is_ratio)
        return sums

    def report(self, sums: dict[str, float], totals: dict[str, int]) -> dict[str, float]:
        """TRL's metrics as global token-weighted means over the completion tokens (loss: the step's)."""
        n = max(totals["tokens"], 1)
        return {"loss": sums["loss"], **{k: v / n for k, v in sums.items() if k != "loss"}}


def _build(*, beta, loss_type, epsilon, epsilon_high, max_completion_length, temperature, **knobs) -> GRPOObjective:
    """The objective from the run's knobs (recipe.objective passes every objective's; GRPO reads these)."""
    return GRPOObjective(
        beta=beta,
        loss_type=loss_type,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        max_completion_length=max_completion_length,
        temperature=temperature,
        importance_sampling_cap=knobs.get("importance_sampling_cap"),
    )


# --objective grpo: TRL GRPOConfig's defaults where they differ from the shared knobs' (beta 0: no reference pass;
# loss_type dapo); the other GRPO flags are its own (shardtune.rl.checks). Dropout off, as for the preference
# objectives: the policy that sampled and the one trained are then the same network.
register_objective(
    ObjectiveSpec(
        "grpo",
        _build,
        data="prompts",
        help="online RL on prompts: sampled completions scored by reward functions (TRL's GRPO)",
        drops_dropout=True,
        knobs=("beta", "loss_type"),
        defaults=(("beta", 0.0), ("loss_type", "dapo")),
    )
)
