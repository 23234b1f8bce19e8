"""docs/FIT.md's "The result", as measured by docs/bench/fit/rounding.py: SectionedModel.fit's loss history equals
plain fit's to float32 rounding; with SGD its weights do too; with Adam a convolution's bias before batch norm (a
true gradient of zero) follows rounding noise, and every other variable stays close."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def rounding():
    spec = importlib.util.spec_from_file_location("rounding", ROOT / "docs" / "bench" / "fit" / "rounding.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # 4 fits, ~15 s quiet (90 s beside a sweep); fast: test_sectioned_model.py's SGD equality of weights
def test_what_fit_md_says_of_the_weights_holds():
    measure = rounding().measure
    update, rest, loss = measure(use_bias=True, lean=True, optimizer="adam")
    assert loss <= 1e-6 and rest <= 1e-4 < update, (update, rest, loss)  # the biases: noise turned into steps
    update, rest, loss = measure(use_bias=True, lean=True, optimizer="sgd")
    assert update <= 1e-5 and loss <= 1e-6, (update, loss)
    text = " ".join((ROOT / "docs" / "FIT.md").read_text().split())
    assert "loss history and weights equal plain `model.fit` of the same model to float32 rounding" not in text
    assert re.search(r"The update then differs by [\d.e-]+ with lean gradients", text)
