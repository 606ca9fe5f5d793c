"""The rollout engine's interface: what generates a rollout's completions and scores the sync probe, whichever
engine it is (`transformers`: the training ranks' own model, rl.generate; `vllm`: a vLLM OpenAI server,
rl.vllm_server). The rollout (rl.rollout) talks to an engine only through this interface, so that an engine's
sync can be checked against the trainer the same way for all of them (rl.probe)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import nn


@dataclass(frozen=True)
class SamplingSettings:
    """How completions are sampled (TRL's GRPOConfig names)."""

    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filtering
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0


@dataclass
class Completion:
    """One sampled completion: its tokens (an EOS included when one ended it), the engine's log-prob of each under
    the temperature-scaled distribution it was sampled from, and whether it stopped at max_completion_length."""

    token_ids: list[int]
    logps: list[float]
    truncated: bool


class RolloutEngine(Protocol):
    """A rollout engine. Every rank calls each method, in the same order (the `transformers` engine's forwards are
    FSDP collectives; a server engine gathers the adapter on every rank before rank 0 sends it)."""

    name: str

    def sync(self, model: nn.Module, version: int) -> None:
        """Make the engine sample from `model`'s current weights, known from now on as policy `version`."""

    def generate(self, prompts: list[list[int]], seeds: list[int], sampling: SamplingSettings) -> list[Completion]:
        """One completion per prompt (this rank's prompts), each sampled with its own seed so that the same prompt
        and seed give the same completion whatever the rank or the batch it is in."""

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        """The log-prob (temperature 1) of each completion token after its prompt, as the engine computes it: the
        sync probe compares these with the trainer's."""

    def close(self) -> None:
        """Release what the engine holds (a server's adapters; nothing for the `transformers` engine)."""
