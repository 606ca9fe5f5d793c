"""Training objectives: what an optimizer step minimises, how it is normalised over the global batch, and the
metrics it logs. The trainer and the planner take an Objective; `build_objective` makes one from the flags.

An objective is used in three calls per optimizer step (shardtune.training.trainer.train_step):
  counts(batch)                  local normalisers of a micro-batch (target tokens, pairs, ...), summed over all
                                 micro-batches and ranks by the trainer;
  step(model, batch, totals, s)  (tensor to backward, {name: summed value}) for one micro-batch; the tensor is the
                                 micro-batch's share of the global-batch loss times s (the data-parallel size,
                                 since FSDP averages gradients over ranks);
  report(sums, totals)           the step's metrics from the sums over all micro-batches and ranks.
So N ranks with batch B give the gradient and the metrics of one process with batch N·B.

SFT is the chunked cross-entropy summed over target tokens / the global target count (plus a mixture of experts'
router load-balancing loss, see Objective.step). The preference objectives
(DPO with loss_type sigmoid or ipo, SimPO, ORPO) follow trl 1.16's DPOTrainer and the CPO/ORPO trainers of
trl.experimental, formula for formula, and log TRL's metric names (rewards/chosen, rewards/rejected,
rewards/accuracies, rewards/margins, logps/chosen, logps/rejected). A batch of B pairs holds the B chosen rows,
then the B rejected rows (shardtune.data.preference); `pair_index` -1 marks a filler pair, which counts nowhere.
KTO (trl 1.16's KTOTrainer, loss_type kto) takes unpaired examples: B prompt+completion rows, then their B KL rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardtune.models.router_aux import sequence_mask
from shardtune.objectives.heads import sequence_logps, token_loss
from shardtune.parallel.adapters import disabled_adapter
from shardtune.parallel.mesh import all_reduce_sum

DPO_LOSS_TYPES = ("sigmoid", "ipo")
PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


class Objective:
    """The interface (and the SFT objective): sum of token cross-entropies / global target count."""

    name = "sft"
    paired = False  # batches of preference pairs (shardtune.data.preference) rather than token rows
    needs_reference = False  # needs the reference model's log-probs (precomputed, or the adapter disabled)

    def counts(self, batch: dict[str, torch.Tensor]) -> dict[str, int]:
        # micro_batches: one per rank and micro-batch, the mean the router aux loss is averaged over
        return {"targets": int((batch["labels"] != -100).sum()), "micro_batches": 1}

    def step(self, model: nn.Module, batch: dict, totals: dict[str, int], grad_scale: float):
        """The token cross-entropies / the global target count, plus, for a mixture of experts, coef × the
        router load-balancing loss of this forward / the global number of micro-batches (models.router_aux).

        The aux loss is a mean over one forward's positions (transformers adds coef × it to each forward's mean
        cross-entropy), so one micro-batch on one process gives transformers' loss exactly. Over G micro-batches
        on N ranks, each micro-batch's aux is computed on its own rank's tokens and weighted 1/(N·G): the gradient
        is that of mean CE over the global batch's targets + coef × (the mean of the N·G per-micro-batch aux
        losses). It is not the aux loss of the global batch as one forward (its expert fractions are per
        micro-batch), so the runs agree across ranks and accumulation only for the same micro-batches."""
        inputs = {k: batch[k] for k in ("input_ids", "position_ids", "labels")}
        if _aux_coef(model) > 0:
            loss, _, aux = model(**inputs, head=token_loss, router_aux=True)
        else:
            (loss, _), aux = model(**inputs, head=token_loss), None
        sums = {"loss": loss.detach().double()}
        ce = loss / max(totals["targets"], 1)
        return (ce + _aux_term(model, aux, totals, sums)) * grad_scale, sums

    def report(self, sums: dict[str, float], totals: dict[str, int]) -> dict[str, float]:
        return _aux_report({"loss": sums["loss"] / max(totals["targets"], 1)}, sums, totals)


def _aux_coef(model: nn.Module) -> float:
    return getattr(model, "router_aux_loss_coef", 0.0)  # 0 for a dense model (or any other module)


def _aux_term(model: nn.Module, aux: torch.Tensor | None, totals: dict[str, int], sums: dict) -> torch.Tensor | float:
    """coef × this forward's router load-balancing loss / the global number of micro-batches (0 without one), and
    its sums for the report: each objective adds the mean over micro-batches of coef × aux, as transformers'
    Trainer (and TRL's) do with one aux per forward."""
    if aux is None:
        return 0.0
    term = _aux_coef(model) * aux
    sums.update({"aux_loss": aux.detach().double(), "aux_term": term.detach().double()})
    return term / max(totals["micro_batches"], 1)


def _aux_report(out: dict[str, float], sums: dict[str, float], totals: dict[str, int]) -> dict[str, float]:
    if "aux_loss" in sums:  # means over the micro-batches of every rank, like the backward tensor's
        n = max(totals["micro_batches"], 1)
        out["loss"] += sums["aux_term"] / n
        out["aux_loss"] = sums["aux_loss"] / n
    return out


def _policy(model: nn.Module, rows: dict, keep_rows: torch.Tensor):
    """(log-prob, targets, aux or None) per row of one-sequence rows; the router loss over their real tokens."""
    if _aux_coef(model) <= 0:
        return (*model(**rows, head=sequence_logps), None)
    shard = getattr(model, "cp_shard", None)  # with context parallelism: the row positions the rank holds
    mask = sequence_mask(rows["position_ids"], keep_rows, None if shard is None else shard.row_index)
    return model(**rows, head=sequence_logps, router_aux=True, aux_mask=mask)


def _on_rows(model: nn.Module, shard, rows: slice) -> None:
    """With context parallelism (`shard`: the micro-batch's split, or None), point the model's split at some of
    the micro-batch's rows, for a forward on those rows alone."""
    if shard is not None:
        model.cp_shard = shard.select_rows(rows)


@dataclass
class PairScores:
    """Per pair (shape [B]): the loss, the rewards and the log-probs that the metrics report."""

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor


class PreferenceObjective(Objective):
    """DPO, SimPO and ORPO on pairs: per-sequence log-probs from the model's chunked head (forward with
    head=objectives.heads.sequence_logps), the reference's from the batch (`ref_logps`, computed in a first pass) or, for an adapter,
    from the same model with the adapter disabled under no_grad."""

    paired = True

    def __init__(self, name: str, *, beta: float, loss_type: str = "sigmoid", simpo_gamma: float = 0.5):
        self.name, self.beta, self.loss_type, self.simpo_gamma = name, beta, loss_type, simpo_gamma
        self.needs_reference = name == "dpo"

    def counts(self, batch: dict[str, torch.Tensor]) -> dict[str, int]:
        valid = batch["pair_index"] >= 0
        n_pairs = len(valid)
        chosen_targets = int((batch["labels"][:n_pairs] != -100).sum())
        return {"pairs": int(valid.sum()), "chosen_targets": chosen_targets, "micro_batches": 1}

    def step(self, model: nn.Module, batch: dict, totals: dict[str, int], grad_scale: float):
        # The reference first: its no_grad activations are gone before the policy's forward saves its own.
        ref_logps = self._reference(model, batch)
        rows = {k: batch[k] for k in ("input_ids", "position_ids", "labels")}
        logps, n_targets, aux = _policy(model, rows, (batch["pair_index"] >= 0).repeat(2))
        valid = (batch["pair_index"] >= 0).float()
        scores = self.scores(logps, n_targets, ref_logps)
        loss = (scores.loss * valid).sum() / max(totals["pairs"], 1)
        sums = {"loss": loss.detach().double()}
        loss = loss + _aux_term(model, aux, totals, sums)
        if self.name == "orpo":
            # ORPO adds the chosen completions' mean token NLL (over the global batch's chosen targets).
            nll = -logps[: len(valid)].sum() / max(totals["chosen_targets"], 1)
            loss = loss + nll
            sums["loss"] = sums["loss"] + nll.detach().double()
            sums["nll_loss"] = nll.detach().double()
        with torch.no_grad():
            for name, value in self._metric_values(scores).items():
                sums[name] = (value * valid).sum().double()
        return loss * grad_scale, sums

    def report(self, sums: dict[str, float], totals: dict[str, int]) -> dict[str, float]:
        n = max(totals["pairs"], 1)
        out = {"loss": sums["loss"]}
        if "nll_loss" in sums:
            out["nll_loss"] = sums["nll_loss"]
        out.update({k: sums[k] / n for k in PAIR_METRICS})
        return _aux_report(out, sums, totals)

    def scores(self, logps: torch.Tensor, n_targets: torch.Tensor, ref_logps: torch.Tensor | None) -> PairScores:
        """The loss per pair from per-row log-probs and target counts ([2B]: chosen rows, then rejected rows)."""
        chosen, rejected = logps.chunk(2)
        n_chosen, n_rejected = n_targets.clamp(min=1).to(logps.dtype).chunk(2)
        beta = self.beta
        if self.name == "dpo":  # trl DPOTrainer._compute_loss, f_divergence_type reverse_kl
            ref_chosen, ref_rejected = ref_logps.to(logps.dtype).chunk(2)
            chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
            if self.loss_type == "ipo":  # IPO on per-token-averaged log-ratios (TRL's note: as the authors do)
                delta = chosen_ratio / n_chosen - rejected_ratio / n_rejected
                loss = (delta - 1 / (2 * beta)) ** 2
            else:
                loss = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
            return PairScores(loss, beta * chosen_ratio, beta * rejected_ratio, chosen, rejected)
        chosen, rejected = chosen / n_chosen, rejected / n_rejected  # both use average log-probs
        if self.name == "simpo":  # trl.experimental CPOTrainer.cpo_loss, loss_type simpo, label_smoothing 0
            loss = -F.logsigmoid(beta * (chosen - rejected - self.simpo_gamma / beta))
        else:  # orpo: trl.experimental ORPOTrainer.odds_ratio_loss; the NLL term is added in step()
            log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
            loss = -beta * F.logsigmoid(log_odds)
        return PairScores(loss, beta * chosen, beta * rejected, chosen, rejected)

    def _reference(self, model: nn.Module, batch: dict) -> torch.Tensor | None:
        if not self.needs_reference:
            return None
        if "ref_logps" in batch:
            return batch["ref_logps"]

        # The frozen base is the reference: the same sharded weights, no second copy.
        with torch.no_grad(), disabled_adapter(model):
            ref, _ = model(
                input_ids=batch["input_ids"],
                position_ids=batch["position_ids"],
                labels=batch["labels"],
                head=sequence_logps,
            )
        return ref

    @staticmethod
    def _metric_values(s: PairScores) -> dict[str, torch.Tensor]:
        return {
            "rewards/chosen": s.chosen_rewards,
            "rewards/rejected": s.rejected_rewards,
            "rewards/accuracies": (s.chosen_rewards > s.rejected_rewards).float(),
            "rewards/margins": s.chosen_rewards - s.rejected_rewards,
            "logps/chosen": s.chosen_logps,
            "logps/rejected": s.rejected_logps,
        }


class KTOObjective(PreferenceObjective):
    """KTO on unpaired examples, as trl 1.16's KTOTrainer (loss_type kto) computes it per micro-batch:

      z  = max(0, mean over the micro-batch's KL rows of (log π − log ref)), detached: the KL estimate from the
           prompts paired with mismatched completions; the mean runs over the micro-batch of every rank (TRL
           gathers it across processes), so N ranks give the numbers of one process;
      desirable:   λ_D (1 − σ(β(log π − log ref − z)));   undesirable:  λ_U (1 − σ(β(z − (log π − log ref))));
      loss = mean of these over the examples; rewards β(log π − log ref).
    The micro-batch holds B completion rows, then their B KL rows (shardtune.data.preference)."""

    def __init__(self, *, beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0):
        super().__init__("kto", beta=beta)
        self.needs_reference = True
        self.desirable_weight, self.undesirable_weight = desirable_weight, undesirable_weight

    def counts(self, batch: dict[str, torch.Tensor]) -> dict[str, int]:
        valid = batch["pair_index"] >= 0
        desirable = int((batch["desirable"] & valid).sum())
        # micro_batches: one per rank and micro-batch, to average the per-micro-batch KL estimate in report()
        return {"examples": int(valid.sum()), "desirable": desirable, "micro_batches": 1}

    def step(self, model: nn.Module, batch: dict, totals: dict[str, int], grad_scale: float):
        ref = self._reference(model, batch)  # [2B]: completions, then KL rows
        inputs = {k: batch[k] for k in ("input_ids", "position_ids", "labels")}
        n = len(batch["pair_index"])
        whole = getattr(model, "cp_shard", None)
        with torch.no_grad():  # the KL term is detached (TRL): its rows need no graph
            _on_rows(model, whole, slice(n, None))
            kl_logps, _ = model(**{k: v[n:] for k, v in inputs.items()}, head=sequence_logps)
        _on_rows(model, whole, slice(0, n))  # kept through the backward's recomputation
        logps, _, aux = _policy(model, {k: v[:n] for k, v in inputs.items()}, batch["pair_index"] >= 0)
        valid = (batch["pair_index"] >= 0).to(logps.dtype)
        ref = ref.to(logps.dtype)
        kl_sum, kl_count = all_reduce_sum(
            [float(((kl_logps - ref[n:]) * valid).sum()), float(valid.sum())], logps.device
        )
        kl = max(kl_sum / max(kl_count, 1), 0.0)
        desirable = batch["desirable"].to(logps.dtype) * valid
        undesirable = (1 - batch["desirable"].to(logps.dtype)) * valid
        loss, rewards = self.losses(logps, ref[:n], desirable.bool(), kl)
        total = (loss * valid).sum() / max(totals["examples"], 1)
        with torch.no_grad():
            sums = {
                "loss": total.detach().double(),
                "kl": torch.tensor(kl, dtype=torch.float64, device=logps.device),
                "rewards/chosen": (rewards * desirable).sum().double(),
                "rewards/rejected": (rewards * undesirable).sum().double(),
                "logps/chosen": (logps * desirable).sum().double(),
                "logps/rejected": (logps * undesirable).sum().double(),
            }
        total = total + _aux_term(model, aux, totals, sums)
        return total * grad_scale, sums

    def losses(self, logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl: float):
        """Per example: the weighted KTO loss and the reward, given the (detached) KL estimate."""
        ratio = logps - ref_logps
        chosen = self.desirable_weight * (1 - torch.sigmoid(self.beta * (ratio - kl)))
        rejected = self.undesirable_weight * (1 - torch.sigmoid(self.beta * (kl - ratio)))
        return torch.where(desirable, chosen, rejected), self.beta * ratio.detach()

    def report(self, sums: dict[str, float], totals: dict[str, int]) -> dict[str, float]:
        """TRL's KTO metrics: chosen/rejected means over the desirable/undesirable examples, each only when
        there are some; margins when there are both; kl the mean of the micro-batches' estimates."""
        n_chosen = totals["desirable"]
        n_rejected = totals["examples"] - n_chosen
        # every rank adds the same global KL of each micro-batch: divide by ranks × micro-batches
        out = {"loss": sums["loss"], "kl": sums["kl"] / max(totals["micro_batches"], 1)}
        for side, count in (("chosen", n_chosen), ("rejected", n_rejected)):
            if count:
                out[f"rewards/{side}"] = sums[f"rewards/{side}"] / count
                out[f"logps/{side}"] = sums[f"logps/{side}"] / count
        if n_chosen and n_rejected:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return _aux_report(out, sums, totals)


def kto_weight_advice(n_desirable: int, n_undesirable: int, desirable_weight: float, undesirable_weight: float):
    """TRL's advice when desirable and undesirable examples are unbalanced (KTO paper, Eq. 8: λ_D n_D / (λ_U n_U)
    in [1, 4/3]): None when either weight is in its range, else the line that recommends one (TRL's rounding)."""
    n_d, n_u = max(n_desirable, 1), max(n_undesirable, 1)
    if n_d == n_u:
        return None
    d_lo, d_hi = round(n_u * undesirable_weight / n_d, 2), round(n_u * undesirable_weight / n_d * 1.33, 2)
    u_lo, u_hi = round(n_d * desirable_weight / n_u / 1.33, 2), round(n_d * desirable_weight / n_u, 2)
    if d_lo <= desirable_weight <= d_hi or u_lo <= undesirable_weight <= u_hi:
        return None
    return (
        f"KTO: {n_desirable} desirable and {n_undesirable} undesirable training examples; the weights are outside "
        f"the range the KTO paper recommends: set EITHER --desirable_weight in [{d_lo}, {d_hi}] OR "
        f"--undesirable_weight in [{u_lo}, {u_hi}] (not both)."
    )


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends (as trl's ORPO)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def disable_dropout(model: nn.Module) -> None:
    """Dropout off everywhere (TRL's disable_dropout, on by default for its preference trainers): the policy's
    and the reference's log-probs of the same weights agree."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


@dataclass(frozen=True)
class ObjectiveSpec:
    """An --objective: how to build it from the knobs (beta, loss_type, simpo_gamma, desirable_weight,
    undesirable_weight; each objective takes those it uses), and the data it trains on."""

    name: str
    build: Callable[..., Objective]
    # "rows": token rows (SFT data); "pairs": prompt/chosen/rejected; "kto": prompt/completion/label; "prompts": TRL's
    # prompt-only rows, whose completions the run generates (online RL)
    data: str = "rows"
    help: str = ""
    # Whether --disable_dropout (on by default) turns the model's dropout off for this objective, as TRL's preference
    # trainers do: the policy and the reference then see the same network. None: for preference data, not token rows.
    drops_dropout: bool | None = None
    # The knob flags (KNOBS) it reads: a run that sets another is refused, since the flag would change nothing.
    # None: it may read any of them (a plugin that does not say; build() receives them all).
    knobs: tuple[str, ...] | None = None
    # The objective's own defaults of shared knobs, used where the run does not set them (GRPO's beta is TRL
    # GRPOConfig's 0.0, not DPO's 0.1; its loss_type dapo): (flag, value) pairs.
    defaults: tuple[tuple[str, object], ...] = ()

    @property
    def rows_per_example(self) -> int:
        """Rows a micro-batch holds per example of --per_device_train_batch_size: 2 for a pair (chosen, rejected)
        and for a KTO example (its completion and its KL row)."""
        return 2 if self.data in ("pairs", "kto") else 1


OBJECTIVES: dict[str, ObjectiveSpec] = {}


def register_objective(spec: ObjectiveSpec) -> ObjectiveSpec:
    """Make `spec.name` a valid --objective: the trainer, the planner and the data preparation read it from here."""
    OBJECTIVES[spec.name] = spec
    return spec


# The flags an objective may read, beside the data flags: `build(**knobs)` receives the first five by name.
KNOBS = ("beta", "loss_type", "simpo_gamma", "desirable_weight", "undesirable_weight", "precompute_ref_log_probs")


def objective_problems(train, data, defaults: dict) -> list[str]:
    """--objective against the registry, and the flags it leaves unread: a knob set away from its default (in
    `defaults`) that the objective does not read, each with the objectives that do; for preference data, the
    token-row flags that do not apply. `train`, `data`: the run's TrainArguments and DataArguments."""
    t, d = train, data
    if t.objective not in OBJECTIVES:
        return [f"--objective {t.objective!r} is not one of {', '.join(OBJECTIVES)}."]
    spec = OBJECTIVES[t.objective]
    unread: dict[tuple[str, ...], list[str]] = {}
    for knob in KNOBS:
        if spec.knobs is not None and knob not in spec.knobs and getattr(t, knob) != defaults[knob]:
            readers = tuple(n for n, s in OBJECTIVES.items() if s.knobs is None or knob in s.knobs)
            unread.setdefault(readers, []).append(f"--{knob}")
    p = [
        f"{', '.join(flags)} only appl{'ies' if len(flags) == 1 else 'y'} to --objective {_either(readers)}; "
        f"remove {'it' if len(flags) == 1 else 'them'} or set {'it' if len(readers) == 1 else 'one of them'}."
        for readers, flags in unread.items()
    ]
    if spec.data in ("pairs", "kto"):
        p += _preference_data_problems(t, d)
    return p


def apply_objective_defaults(train, explicit: frozenset[str]) -> None:
    """Set the objective's own defaults (ObjectiveSpec.defaults) of the knobs the run did not give (`explicit`: the
    flags given), on `train`, the run's TrainArguments."""
    spec = OBJECTIVES.get(train.objective)
    for flag, value in spec.defaults if spec else ():
        if flag not in explicit:
            setattr(train, flag, value)


def has_reference(objective: str) -> bool:
    """Whether the objective compares with a reference model's log-probs: it reads --precompute_ref_log_probs (a
    plugin that names no knobs is not known to)."""
    knobs = objective_spec(objective).knobs
    return knobs is not None and "precompute_ref_log_probs" in knobs


def objective_settings(train) -> dict:
    """The objective and the knobs it reads, as a run's model card records them (none for SFT); a plugin's that
    names no knobs, all of them. `train`: the run's TrainArguments."""
    spec = objective_spec(train.objective)
    knobs = KNOBS if spec.knobs is None else spec.knobs
    said = {k: getattr(train, k) for k in knobs if k != "precompute_ref_log_probs"}  # how, not what, is trained
    return {} if train.objective == "sft" else {"objective": train.objective, **said}


def _either(names: tuple[str, ...]) -> str:
    """'a', 'a or b', 'a, b or c'."""
    return " or ".join(filter(None, (", ".join(names[:-1]), names[-1])))


def _preference_data_problems(t, d) -> list[str]:
    """Flags of token rows that preference data (pairs, KTO rows) cannot honour, and --beta's range there."""
    p = []
    if t.beta <= 0:
        p.append(f"--beta must be > 0 (got {t.beta}).")
    if d.streaming:
        p.append(f"--streaming True is not supported with --objective {t.objective} yet; set --streaming False.")
    if d.completion_only_loss is False:
        p.append(
            f"--completion_only_loss False does not apply to --objective {t.objective} (only the completions count); "
            "remove it."
        )
    for flag in ("packing", "assistant_only_loss", "append_concat_token"):
        if getattr(d, flag):
            p.append(
                f"--{flag} does not apply to --objective {t.objective} (pairs are rows of their own and only the "
                f"completions count); set --{flag} False."
            )
    return p


def objective_spec(name: str) -> ObjectiveSpec:
    if name not in OBJECTIVES:
        raise ValueError(f"--objective {name!r} is not one of {', '.join(OBJECTIVES)}.")
    return OBJECTIVES[name]


def rows_per_example(objective: str) -> int:
    return objective_spec(objective).rows_per_example


def dropout_off(objective: str, disable_dropout: bool) -> bool:
    """Whether a run of `objective` with --disable_dropout `disable_dropout` trains without dropout: the one rule the
    run (recipe.objective) and the planner (LoRA dropout's masks) read."""
    spec = objective_spec(objective)
    return disable_dropout and (spec.data != "rows" if spec.drops_dropout is None else spec.drops_dropout)


def objectives_help() -> str:
    """'sft: ...; dpo, simpo, orpo: ...; kto: ...' from the registry, names with the same help together (the help
    of --objective, filled when the parser is built, so that a plugin's objective is listed too)."""
    by_help: dict[str, list[str]] = {}
    for name, spec in OBJECTIVES.items():
        by_help.setdefault(spec.help, []).append(name)
    return "; ".join(f"{', '.join(names)}: {text}" for text, names in by_help.items()) + "."


def build_objective(objective: str, **knobs) -> Objective:
    """The objective named by --objective, given the knobs (sft: the chunked cross-entropy)."""
    return objective_spec(objective).build(**knobs)


register_objective(ObjectiveSpec("sft", lambda **_: Objective(), help="cross-entropy on the text", knobs=()))
# Each preference objective's knobs: DPO's loss type and its reference (precomputed or not), SimPO's margin.
_PAIR_KNOBS = {
    "dpo": ("beta", "loss_type", "precompute_ref_log_probs"),
    "simpo": ("beta", "simpo_gamma"),
    "orpo": ("beta",),
}
for _name, _knobs in _PAIR_KNOBS.items():
    register_objective(
        ObjectiveSpec(
            _name,
            lambda _n=_name, *, beta, loss_type="sigmoid", simpo_gamma=0.5, **_: PreferenceObjective(
                _n, beta=beta, loss_type=loss_type, simpo_gamma=simpo_gamma
            ),
            data="pairs",
            help="preference tuning on prompt/chosen/rejected pairs",
            knobs=_knobs,
        )
    )
register_objective(
    ObjectiveSpec(
        "kto",
        lambda *, beta, desirable_weight=1.0, undesirable_weight=1.0, **_: KTOObjective(
            beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight
        ),
        data="kto",
        help="unpaired prompt/completion/label rows",
        knobs=("beta", "desirable_weight", "undesirable_weight", "precompute_ref_log_probs"),
    )
)
