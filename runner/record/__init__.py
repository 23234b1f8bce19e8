"""The run folder's record: header, config, metrics, TensorBoard."""
