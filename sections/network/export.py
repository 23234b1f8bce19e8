"""A network as one ``keras.Model``, for saving as ``.keras`` and loading with ``keras.models.load_model``."""

from __future__ import annotations

from typing import Any, Mapping

import keras


def to_keras(network, batch: Mapping[str, Any]) -> keras.Model:
    """The trained network as a Keras model sharing its layers (and so its weights).

    A network cut from a Keras model by ``from_keras`` gives that model back. Any other chain whose blocks
    read only the running tensor becomes a Functional model over the same layers, from the input
    ``batch[network.inputs]`` (its shape past the batch axis and dtype) to the last block's output: the logits
    for the project's classifiers. A network whose blocks read other batch fields raises a ValueError.
    """
    source = getattr(network, "source_model", None)
    if source is not None:
        return source
    fielded = [b.name for b in network.blocks if b.fields]
    if fielded:
        raise ValueError(f"blocks {fielded[:3]} read batch fields beside the running tensor; only a plain chain "
                         f"becomes one Keras model.")
    example = batch[network.inputs]
    inputs = keras.Input(shape=tuple(example.shape[1:]), dtype=example.dtype.name, name=network.inputs)
    h = inputs
    for block in network.blocks:
        h = block.layer(h)
    return keras.Model(inputs, h, name=getattr(network, "name", None) or "sectionflow_network")
