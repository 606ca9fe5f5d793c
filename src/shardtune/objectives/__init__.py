"""Training objectives: the losses, the reference model's log-probs and the router's balance loss."""

from shardtune.objectives import grpo  # noqa: F401  registers --objective grpo beside loss.py's objectives
