"""Training objectives: the losses, the reference model's log-probs and the router's balance loss."""
