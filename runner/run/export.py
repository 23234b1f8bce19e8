"""The trained model where a Keras user looks for it: `model.keras` and `model.best.keras` in the run folder.

    files = ModelFiles(out, engine, data, first_batch, mode)   # mode: train.save_model (true | final | false)
    files.evaluated(step, results)   # after an evaluation: model.best.keras when the eval metric improved
    files.final(step)                # at the end: model.keras

Both load with `keras.models.load_model` (for the project's own models after `import models`, which registers
their layers). A file is written beside its place and renamed over it, so a kill leaves the previous one whole.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from runner.errors import ConfigError

log = logging.getLogger("runner")
MODES = (True, False, "final")


class ModelFiles:
    def __init__(self, out: Path, engine, data, batch, mode=True):
        if mode not in MODES:
            raise ConfigError("train.save_model", mode, "allowed: true (model.keras and model.best.keras), final "
                              "(model.keras only), false")
        self.out, self.mode, self.model = Path(out), mode, None
        self.metric = data.metric
        self.maximize = data.metric_direction == "maximize"
        if mode is False:
            return
        from sections import to_keras

        try:
            self.model = to_keras(engine.network, batch)
        except ValueError as err:
            log.info(f"model.keras: not written: {err}")
        self._best = _read_best(self.out / "model.best.json")

    def evaluated(self, step: int, results: dict) -> None:
        """Save `model.best.keras` when this evaluation's metric beats the best so far (kept across resume)."""
        if self.model is None or self.mode != True:  # noqa: E712 - "final" is truthy
            return
        key = self.metric if self.metric in results else "loss"
        value = float(results[key])
        maximize = self.maximize and key != "loss"
        best = self._best.get("value") if self._best.get("metric") == key else None
        if not math.isfinite(value) or (best is not None and (value <= best if maximize else value >= best)):
            return
        self._save("model.best.keras")
        self._best = {"metric": key, "value": value, "step": step}
        _write_json(self.out / "model.best.json", self._best)

    def final(self, step: int) -> None:
        if self.model is not None:
            self._save("model.keras")
            log.info(f"model saved: {self.out / 'model.keras'} (step {step}; keras.models.load_model reads it)")

    def _save(self, name: str) -> None:
        target = self.out / name
        partial = self.out / f".{name}.partial.keras"  # Keras wants the .keras suffix
        try:
            self.model.save(partial)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)


def _read_best(path: Path) -> dict:
    try:
        best = json.loads(path.read_text())
        return best if isinstance(best, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_json(path: Path, value: dict) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(value, indent=1))
    os.replace(partial, path)
