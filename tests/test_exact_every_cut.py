"""The sectioned step equals a plain compiled GradientTape step at cuts inside residual blocks, in every stage.

Run in float64: graphs compiled apart round differently in float32 (Grappler fuses ops across what is one graph in
the whole step), and ResNet50 at initialisation amplifies rounding about 1e5-fold (its own eager and compiled
float32 steps differ by 1.9%), so only float64 separates a hand-over error from rounding. The full sweep (six
models, every allowed cut, random partitions with every policy) is ``docs/bench/exactness/sweep.py``; its slow
test is below.
"""

import importlib.util
from pathlib import Path

import keras
import pytest

from sections import Recompute

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("exactness_sweep", ROOT / "docs/bench/exactness/sweep.py")
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)

INSIDE_BLOCKS = {
    # one cut inside a residual block of each stage (the skip connection crosses every one of them)
    "ResNet50": ["conv2_block2_1_relu", "conv3_block2_3_conv", "conv4_block2_2_conv", "conv5_block2_1_relu"],
    "MobileNetV2": ["block_2_depthwise_relu", "block_5_expand_relu", "block_8_project", "block_12_depthwise",
                    "block_15_expand_BN"],
}


pytestmark = pytest.mark.usefixtures("float32_after")  # tests/conftest.py


def exact(check, cuts, policy="recompute"):
    assert all(c in check.net.boundaries for c in cuts)
    error = sweep.relative_error(check.gradients(cuts, policy), check.want)
    assert error <= sweep.THRESHOLD, f"{check.name} at {cuts}, {policy}: relative gradient error {error:.3g}"


class DropSkipGradient(Recompute):
    """A deliberately wrong hand-over: the gradient on the first border tensor (the skip connection) is lost."""

    def backward(self, fns, kept, view, upstream, snapshot, expected=None):
        return super().backward(fns, kept, view, [0 * upstream[0], *upstream[1:]], snapshot, expected)


def test_resnet50_cuts_inside_residual_blocks_in_every_stage():
    check = sweep.Checker("ResNet50", batch_size=8)
    exact(check, INSIDE_BLOCKS["ResNet50"])


@pytest.mark.slow  # ~30 s (a second ResNet50 pair); tests/test_verify.py shows a wrong step failing in the fast set
def test_the_comparison_fails_by_far_on_a_lost_skip_gradient():
    check = sweep.Checker("ResNet50", batch_size=8)
    wrong = check.gradients(["conv2_block2_3_conv"], [DropSkipGradient(), "recompute"])
    assert sweep.relative_error(wrong, check.want) > 1e-3


@pytest.mark.slow  # ~12 s; ResNet50's inside-block cuts stay in the fast set
def test_mobilenetv2_cuts_inside_residual_blocks_in_every_stage_with_every_policy():
    check = sweep.Checker("MobileNetV2", batch_size=8)
    exact(check, INSIDE_BLOCKS["MobileNetV2"], ["store", "recompute", "recreate", "store", "recreate", "recompute"])


@pytest.mark.slow
def test_full_sweep_six_models():
    assert sweep.main(["--random", "3"]) == 0
