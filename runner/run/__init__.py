"""From config to live objects, the training loop and its hooks, batches, checkpoints."""
