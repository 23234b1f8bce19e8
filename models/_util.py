"""Small helpers shared by the model builders: seeded layer seeds, argument checks, serialisation."""

from __future__ import annotations

from typing import Sequence

import keras
import numpy as np

serializable = keras.saving.register_keras_serializable(package="sectionflow")


class SeedStream:
    """Hands out distinct, reproducible integer seeds for the layers of one network."""

    def __init__(self, seed: int):
        self._rng = np.random.default_rng(check_int("seed", seed, minimum=0))

    def __call__(self) -> int:
        return int(self._rng.integers(0, 2**30))


def check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an integer >= {minimum}.")
    return int(value)


def check_ints(name: str, values, minimum: int = 1) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise ValueError(f"{name}={values!r}: must be a non-empty list of integers >= {minimum}.")
    return [check_int(f"{name}[{i}]", v, minimum) for i, v in enumerate(values)]


def check_rate(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name}={value!r}: must be a number in [0, 1).")
    return float(value)


def check_image_shape(input_shape) -> tuple[int, int, int] | None:
    """``None`` or a (height, width, channels) shape."""
    if input_shape is None:
        return None
    shape = check_ints("input_shape", list(input_shape) if isinstance(input_shape, tuple) else input_shape)
    if len(shape) != 3:
        raise ValueError(f"input_shape={input_shape!r}: must be (height, width, channels).")
    return tuple(shape)


def reject_data_args(model: str, needs: str, **given) -> None:
    """Raise when a data source meant for another kind of model supplied ``given`` arguments."""
    wrong = {k: v for k, v in given.items() if v is not None}
    if wrong:
        raise ValueError(f"{model} needs {needs}; got {wrong} from data meant for another kind of model.")
