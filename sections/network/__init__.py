"""The chain of blocks and its loss; a network cut from a Keras model."""
