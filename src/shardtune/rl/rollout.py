"""GRPO's rollouts: the micro-batches an online-RL run trains on, generated from the policy being trained.

Layout (TRL's GRPOTrainer, with its names): a generation batch is per_device_train_batch_size (B) × data-parallel
ranks × steps_per_generation (S) completions: (that / num_generations) prompts of the epoch's order, each sampled
num_generations (G) times, a group's completions consecutive. It is trained on for S × num_iterations micro-batches
per rank, then the next one is generated. Global micro-batch k of a generation holds its rows [k·B·dp, (k+1)·B·dp),
and rank r its B rows from k·B·dp + r·B: so the micro-batches of N ranks with B rows are, row for row, those of one
process with N·B rows, and a step's gradient is the same (the objective normalises over the global step).

Per generation, in order, on every rank:
  1. sync: the engine is given the current policy (version = optimizer steps so far); the probe checks it (rl.probe);
  2. generate this rank's rows, each from a seed of (--seed, epoch, generation, row): the same rollouts whatever the
     number of ranks, and the same after a resume;
  3. rewards of this rank's rows (rl.rewards), gathered: advantages per group over the whole generation batch, so a
     group spread over ranks is normalised as one;
  4. the trainer's log-probs of the completions (the trainer/engine gap is logged; the old log-probs when the
     policy moves within a generation: S > gradient_accumulation_steps or num_iterations > 1), and the reference's
     (the adapter disabled) when beta != 0.
The generation batch is kept whole on every rank (tokens, advantages, log-probs: small beside the model), so that a
checkpoint saved in the middle of it resumes exactly, also on another number of ranks (LoopState.rollout).
"""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from shardtune.data.collate import epoch_order
from shardtune.data.prompts import PromptSplit
from shardtune.objectives.grpo import group_advantages
from shardtune.parallel.adapters import disabled_adapter
from shardtune.parallel.mesh import all_gather_objects
from shardtune.rl import batches
from shardtune.rl.engine import RolloutEngine, SamplingSettings
from shardtune.rl.metrics import rollout_metrics
from shardtune.rl.probe import SyncProbe
from shardtune.rl.rewards import RewardError, RewardFunction, combine_rewards, compute_rewards
from shardtune.runtime.log import warn0


@dataclass(frozen=True)
class RolloutSettings:
    per_device_batch: int  # B: completions per micro-batch and rank
    num_generations: int  # G
    steps_per_generation: int  # S: micro-batches per rank a generation batch is cut into
    num_iterations: int
    seed: int
    sampling: SamplingSettings
    beta: float
    old_logps: bool  # whether the policy moves within a generation (the ratio then needs the old log-probs)
    importance_sampling: bool  # pass the engine's log-probs for the truncated importance-sampling correction
    mask_truncated_completions: bool
    scale_rewards: str
    reward_timeout_s: float
    pad_id: int

    def prompts_per_generation(self, dp: int) -> int:
        return self.per_device_batch * dp * self.steps_per_generation // self.num_generations


@dataclass
class Generation:
    """One generation batch, whole (every rank holds all of it): per global row, its prompt's dataset row, the
    completion and the per-token values, the rewards and the advantage."""

    index: int  # the generation's number in its epoch
    version: int  # the policy it was sampled from (optimizer steps before it)
    rows: list[int]
    completions: list[list[int]]
    truncated: list[bool]
    sampling_logps: list[list[float]]
    advantages: list[float]
    old_logps: list[list[float]] | None = None
    ref_logps: list[list[float]] | None = None
    metrics: dict[str, float] | None = None  # logged with each step trained on it, also after a resume

    def to_record(self) -> str:
        """The generation as one line of text for a checkpoint's meta.json (compressed JSON: thousands of token
        ids would otherwise be a line each there)."""
        return base64.b64encode(zlib.compress(json.dumps(self.__dict__).encode())).decode()

    @classmethod
    def from_record(cls, record: str) -> Generation:
        return cls(**json.loads(zlib.decompress(base64.b64decode(record))))


class Rollouts:
    """The training "split" of an online-RL run: the loop asks it for micro-batches (training.trainer), and it
    generates a new generation batch whenever the previous one has been trained on."""

    def __init__(self, prompts: PromptSplit, *, settings: RolloutSettings, info, tokenizer):
        self.prompts, self.s, self.info, self.tokenizer = prompts, settings, info, tokenizer
        self.digest = prompts.digest
        self.model: nn.Module | None = None
        self.engine: RolloutEngine | None = None
        self.rewards: list[RewardFunction] = []
        self.probe: SyncProbe | None = None
        self.generation: Generation | None = None
        self.last_metrics: dict[str, float] = {}

    def attach(
        self, *, model: nn.Module, engine: RolloutEngine, rewards: list[RewardFunction], probe: SyncProbe | None
    ):
        """The model sampled from and trained, the engine, the reward functions and the sync probe (built after
        the data, which decides how many steps the run has)."""
        self.model, self.engine, self.rewards, self.probe = model, engine, rewards, probe

    def __len__(self) -> int:
        return len(self.prompts)

    def num_batches(self, *, batch_size: int, world_size: int, drop_last: bool = True) -> int:
        """Micro-batches per rank in an epoch: whole generations of the epoch's prompts, each trained on S ×
        num_iterations times."""
        per_generation = self.s.prompts_per_generation(world_size)
        return len(self) // max(per_generation, 1) * self.s.steps_per_generation * self.s.num_iterations

    def close(self) -> None:
        """Release the engine (a server's adapters); the run's end, or its failure. A failure to release is a
        warning: it must neither skip a finished run's final save nor hide the loop's own error."""
        if self.engine is None:
            return
        try:
            self.engine.close()
        except Exception as e:  # noqa: BLE001  (any engine's error: reported, the run's outcome stands)
            warn0(f"the rollout engine '{self.engine.name}' could not release what it holds: {e}")

    def metrics(self) -> dict[str, float]:
        """The last generation's metrics (logged with the step that trained on it)."""
        return dict(self.last_metrics)

    def micro_batches(self, state, per_epoch: int):
        """This rank's micro-batches from the loop's position on (LoopState: epoch, batch_in_epoch, rollout),
        across epochs of `per_epoch` micro-batches (the loop's: whole optimizer steps). A position inside a
        generation batch resumes from the one the checkpoint kept."""
        per_generation = self.s.steps_per_generation * self.s.num_iterations
        epoch, m = state.epoch, state.batch_in_epoch
        if m % per_generation and state.rollout:  # resumed inside a generation batch: the one the checkpoint kept
            self.generation = Generation.from_record(state.rollout)
            self.last_metrics = dict(self.generation.metrics or {})
        while True:
            while m < per_epoch:
                if m % per_generation == 0 or self.generation is None:
                    self.generation = self._generate(epoch, m // per_generation, state.step)
                    state.rollout = self.generation.to_record()
                yield self._micro_batch(m % per_generation % self.s.steps_per_generation)
                m += 1
            epoch, m = epoch + 1, 0

    def _generate(self, epoch: int, index: int, version: int) -> Generation:
        self.engine.sync(self.model, version)
        synced = self.probe.check(self.model, self.engine, version, self.info.device) if self.probe else {}
        rows = self._dataset_rows(epoch, index)
        mine = self._my_rows()
        seeds = [_seed(self.s.seed, epoch, index, j) for j in mine]
        prompt_ids = [self.prompts.prompt_ids[rows[j]] for j in mine]
        done = self.engine.generate(prompt_ids, seeds, self.s.sampling)
        rewards = self._rewards(rows, mine, done)
        gathered = _gather_rows(mine, [(c.token_ids, c.truncated, c.logps, r) for c, r in zip(done, rewards)])
        completions, truncated, sampling, reward_rows = (list(x) for x in zip(*gathered, strict=True))
        table = torch.tensor(reward_rows, dtype=torch.float32).reshape(len(rows), len(self.rewards))
        total = combine_rewards(table, torch.tensor([f.weight for f in self.rewards], dtype=torch.float32))
        advantages, std = group_advantages(total, self.s.num_generations, self.s.scale_rewards)
        advantages = torch.nan_to_num(advantages, nan=0.0)  # TRL: a completion no function could score moves nothing
        g = Generation(index, version, rows, completions, truncated, sampling, advantages.tolist())
        gap = self._trainer_side(g, mine)
        g.metrics = {**synced, **gap, **rollout_metrics(g, table, total, std, self.rewards)}
        self.last_metrics = dict(g.metrics)
        return g

    def _dataset_rows(self, epoch: int, index: int) -> list[int]:
        """The generation batch's rows: each of its prompts' dataset rows repeated num_generations times."""
        order = epoch_order(len(self.prompts), seed=self.s.seed, epoch=epoch, shuffle=True)  # the loop's own rule
        n = self.s.prompts_per_generation(self.info.dims.dp_size)
        picked = order[index * n : (index + 1) * n].tolist()
        return [r for r in picked for _ in range(self.s.num_generations)]

    def _my_rows(self) -> list[int]:
        """This rank's global rows: B from k·B·dp + r·B for each micro-batch k."""
        b, dp, r = self.s.per_device_batch, self.info.dims.dp_size, self.info.dims.dp_rank
        return [k * b * dp + r * b + i for k in range(self.s.steps_per_generation) for i in range(b)]

    def _rewards(self, rows: list[int], mine: list[int], done) -> list[list[float]]:
        """Each of this rank's completions' rewards, one per function (NaN: the function gave None)."""
        data_rows = [rows[j] for j in mine]
        texts = self.tokenizer.batch_decode([c.token_ids for c in done], skip_special_tokens=True)
        prompts = [self.prompts.prompts[r] for r in data_rows]
        completions = [
            [{"role": "assistant", "content": t}] if isinstance(p, list) else t
            for p, t in zip(prompts, texts, strict=True)
        ]
        table, problem = None, None
        try:
            table = compute_rewards(
                self.rewards,
                prompts=prompts,
                completions=completions,
                completion_ids=[c.token_ids for c in done],
                columns=self.prompts.row_columns(data_rows),
                row_ids=data_rows,
                timeout_s=self.s.reward_timeout_s,
            )
        except RewardError as e:
            problem = str(e)
        # Every rank stops on one rank's failure (the others would wait for its rewards in the gather below).
        failed = [p for p in all_gather_objects(problem) if p]
        if failed:
            raise RewardError(failed[0])
        return table.tolist()

    def _trainer_side(self, g: Generation, mine: list[int]) -> dict[str, float]:
        """The trainer's (and with beta the reference's) log-probs of this rank's completions, micro-batch by
        micro-batch, gathered into the generation; the trainer/engine gap of the sampled tokens' log-probs."""
        olds, refs = [], []
        b = self.s.per_device_batch
        for k in range(0, len(mine), b):
            rows = self._rows(g, mine[k : k + b])
            olds += self._logps(rows, mine[k : k + b], g)
            if self.s.beta != 0.0:
                with disabled_adapter(self.model):
                    refs += self._logps(rows, mine[k : k + b], g)
        olds_all = _gather_rows(mine, olds)
        if self.s.old_logps:
            g.old_logps = olds_all
        if refs:
            g.ref_logps = _gather_rows(mine, refs)
        return _gap(olds_all, g.sampling_logps)

    def _rows(self, g: Generation, rows: list[int]) -> dict[str, torch.Tensor]:
        prompts = [self.prompts.prompt_ids[g.rows[j]] for j in rows]
        return batches.completion_rows(prompts, [g.completions[j] for j in rows], self.s.pad_id)

    def _logps(self, rows: dict, which: list[int], g: Generation) -> list[list[float]]:
        prompts = [self.prompts.prompt_ids[g.rows[j]] for j in which]
        table = batches.trainer_logps(self.model, rows, self.s.sampling.temperature, self.info.device)
        return batches.unaligned(table, prompts, [g.completions[j] for j in which])

    def _micro_batch(self, k: int) -> dict[str, torch.Tensor]:
        """Micro-batch k of the current generation batch, this rank's B rows."""
        g, b, dp, r = self.generation, self.s.per_device_batch, self.info.dims.dp_size, self.info.dims.dp_rank
        which = list(range(k * b * dp + r * b, k * b * dp + (r + 1) * b))
        prompts = [self.prompts.prompt_ids[g.rows[j]] for j in which]
        batch = self._rows(g, which)
        if self.s.mask_truncated_completions:  # TRL: a truncated completion counts nowhere in the loss
            cut = torch.tensor([g.truncated[j] for j in which])
            batch["labels"][cut] = batches.IGNORE
        width = batch["labels"].shape[1]
        batch["advantages"] = torch.tensor([g.advantages[j] for j in which], dtype=torch.float32)
        batch["row_valid"] = torch.ones(len(which), dtype=torch.bool)
        for key, values in (("old_logps", g.old_logps), ("ref_logps", g.ref_logps)):
            if values is not None:
                batch[key] = batches.aligned([values[j] for j in which], prompts, width)
        if self.s.importance_sampling:
            batch["sampling_logps"] = batches.aligned([g.sampling_logps[j] for j in which], prompts, width)
        return batch


def _seed(seed: int, epoch: int, generation: int, row: int) -> int:
    """A completion's sampling seed from where it is in the run, not from which rank draws it."""
    digest = hashlib.sha256(f"{seed}/{epoch}/{generation}/{row}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


def _gather_rows(mine: list[int], values: list) -> list:
    """Every rank's (global row, value) pairs, in global row order: the whole generation batch on each rank."""
    pairs = list(zip(mine, values, strict=True))
    everyone = all_gather_objects(pairs)
    return [v for _, v in sorted((p for part in everyone for p in part), key=lambda p: p[0])]


def _gap(trainer: list[list[float]], engine: list[list[float]]) -> dict[str, float]:
    """The trainer/engine log-prob gap over every sampled token of the generation batch (TRL's names)."""
    diffs = [abs(a - b) for ta, tb in zip(trainer, engine, strict=True) for a, b in zip(ta, tb, strict=True)]
    if not diffs:
        return {}
    return {
        "sampling/sampling_logp_difference/mean": sum(diffs) / len(diffs),
        "sampling/sampling_logp_difference/max": max(diffs),
    }
