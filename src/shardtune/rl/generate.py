"""The `transformers` rollout engine: completions sampled on the training ranks from the model being trained, with
a KV cache, through the training module's own forward (so that FSDP2's hooks, or one process's mixed-precision
casts, run as in training: LoRA, DoRA and QLoRA sample from exactly the weights the trainer holds).

Written here rather than with `model.generate` for three reasons: every rank must run the same number of forwards
(each is a set of FSDP all-gathers), so the ranks stop together when all of their rows have ended; each row samples
from its own seeded generator, so that a completion depends on its prompt and seed only, not on the rank or the
batch it was generated in (2 ranks and 1 process give the same rollouts, and a resumed run the same); and the
log-prob of each sampled token is kept, from the same temperature-scaled distribution the GRPO loss reads.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from shardtune.parallel.fsdp import kept_gathered
from shardtune.parallel.mesh import all_reduce_sum
from shardtune.rl.engine import Completion, SamplingSettings


class TransformersEngine:
    """Generation on the training ranks (rl.engine.RolloutEngine). `gather_once`: keep each block's gathered
    weights for a whole rollout (one all-gather per block, the whole model held in the compute dtype meanwhile)
    instead of gathering per token; `batch_size`: rows per generation batch (None: all of this rank's at once)."""

    name = "transformers"

    def __init__(
        self, model: nn.Module, device: torch.device, *, gather_once: bool = True, batch_size: int | None = None
    ):
        self.model, self.device = model, device
        self.gather_once, self.batch_size = gather_once, batch_size
        self.version = 0

    def sync(self, model: nn.Module, version: int) -> None:
        # The engine is the trainer's own module: nothing to send. The probe still checks its path (the KV cache,
        # left padding, one token at a time) against the training forward.
        self.version = version

    def close(self) -> None:
        """Nothing to release: the engine is the trainer's own module."""

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], seeds: list[int], sampling: SamplingSettings) -> list[Completion]:
        out: list[Completion] = []
        with self._generating():
            for start in range(0, len(prompts), self.batch_size or max(len(prompts), 1)):
                end = start + (self.batch_size or len(prompts))
                out += self._sample(prompts[start:end], seeds[start:end], sampling)
        return out

    @torch.no_grad()
    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        """Teacher-forced through the generation path: the prompt prefilled into the cache, then the completion
        fed one token at a time, each position's log-prob (temperature 1) of the next token read."""
        with self._generating():
            cache, logits, mask, pos = self._prefill(prompts)
            width = max((len(c) for c in completions), default=0)
            tokens = torch.zeros(len(prompts), width, dtype=torch.long, device=self.device)
            for i, c in enumerate(completions):
                tokens[i, : len(c)] = torch.tensor(c, dtype=torch.long)
            logps = []
            for t in range(width):
                logps.append(torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, t : t + 1])[:, 0])
                if t + 1 < width:
                    logits, mask, pos = self._step(cache, tokens[:, t], mask, pos)
        table = torch.stack(logps, 1).tolist() if logps else [[] for _ in prompts]
        return [row[: len(c)] for row, c in zip(table, completions, strict=True)]

    @contextlib.contextmanager
    def _generating(self):
        """Eval mode (no dropout: the policy sampled is the network itself) and, with gather_once, the weights kept
        gathered; the training mode restored after."""
        was_training = self.model.training
        self.model.eval()
        try:
            with kept_gathered(self.model) if self.gather_once else contextlib.nullcontext():
                yield
        finally:
            self.model.train(was_training)

    def _prefill(self, prompts: list[list[int]]):
        """Left-padded prompts through the model into a new KV cache: (cache, last logits, mask, last positions)."""
        from transformers import DynamicCache

        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self.model(ids, pos, cache=cache, attention_mask=mask)
        return cache, logits, mask, pos[:, -1:]

    def _step(self, cache, tokens: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor):
        mask = torch.cat([mask, mask.new_ones(len(mask), 1)], 1)
        pos = pos + 1
        return self.model(tokens[:, None], pos, cache=cache, attention_mask=mask), mask, pos

    def _sample(self, prompts: list[list[int]], seeds: list[int], s: SamplingSettings) -> list[Completion]:
        generators = [torch.Generator(self.device).manual_seed(seed) for seed in seeds]
        eos = torch.tensor(s.eos_token_ids or [-1], device=self.device)
        cache, logits, mask, pos = self._prefill(prompts)
        done = torch.zeros(len(prompts), dtype=torch.bool, device=self.device)
        tokens, logps = [], []
        for t in range(s.max_completion_length):
            token, logp = sample_tokens(logits, generators, s)
            token = torch.where(done, s.pad_token_id, token)
            tokens.append(token)
            logps.append(torch.where(done, 0.0, logp))
            done = done | torch.isin(token, eos)
            # Every rank runs the same forwards (each one FSDP's all-gathers): stop when all ranks' rows have ended.
            if t + 1 == s.max_completion_length or all_reduce_sum([float((~done).sum())], self.device)[0] == 0:
                break
            logits, mask, pos = self._step(cache, token, mask, pos)
        return _completions(torch.stack(tokens, 1), torch.stack(logps, 1), eos, s.max_completion_length)


def sample_tokens(logits: torch.Tensor, generators: list[torch.Generator], s: SamplingSettings):
    """One token per row from softmax(logits / temperature) restricted by top_k and top_p, each row with its own
    generator; and the sampled token's log-prob under the temperature-scaled distribution before that restriction
    (what the trainer computes, TRL's rule)."""
    scaled = logits.float() / s.temperature
    logp_all = torch.log_softmax(scaled, -1)
    kept = filter_top_k_top_p(scaled, s.top_k, s.top_p)
    probs = torch.softmax(kept, -1)
    token = torch.stack([torch.multinomial(p, 1, generator=g)[0] for p, g in zip(probs, generators, strict=True)])
    return token, logp_all.gather(-1, token[:, None])[:, 0]


def filter_top_k_top_p(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits outside the top_k largest (0: all) and outside the smallest set whose probability reaches top_p set to
    -inf, as transformers' TopKLogitsWarper and TopPLogitsWarper (the most likely token always kept)."""
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=False, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cumulative <= 1 - top_p
        remove_sorted[:, -1] = False
        remove = remove_sorted.scatter(1, order, remove_sorted)
        scaled = scaled.masked_fill(remove, float("-inf"))
    return scaled


def _completions(tokens: torch.Tensor, logps: torch.Tensor, eos: torch.Tensor, max_len: int) -> list[Completion]:
    """Each row cut after its first EOS (kept), or whole and truncated when it has none."""
    out = []
    for row, lp in zip(tokens.tolist(), logps.tolist(), strict=True):
        ends = [i for i, tok in enumerate(row) if tok in eos.tolist()]
        n = ends[0] + 1 if ends else len(row)
        out.append(Completion(row[:n], lp[:n], truncated=not ends and n >= max_len))
    return out
