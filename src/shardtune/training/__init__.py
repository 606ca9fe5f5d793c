"""The training loop and what it writes: optimizers, metrics, trackers, the output folder, exports and model cards."""
