"""Online RL: rollouts (generation, rewards, the sync proof) for --objective grpo."""
