"""The trainer: config schema, data, the training loop, checkpoints, metrics and logging."""
