"""examples/moe_layer.py, the MoE layer with the Python package and
pyopencl, against the float64 model and its derived bound
(tests/examples/moe_layer_check.py), and the check failing on a faulty
layer."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytest.importorskip("pyopencl")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "examples"), os.path.join(ROOT, "tests", "examples")]
import moe_layer  # noqa: E402
import moe_layer_check  # noqa: E402


def run_and_check(ctx, inputs, top_k, block, w1_on_device=None):
    dev_inputs = dict(inputs)
    if w1_on_device is not None:
        dev_inputs["w1"] = w1_on_device
    res = moe_layer.run_layer(ctx, dev_inputs, top_k, block)
    r = moe_layer_check.check(inputs["x"], inputs["router"], inputs["w1"], inputs["w2"], res["logits"],
                              res["topk_ids"], res["topk_weights"], res["out"])
    print("\n".join(r.lines))
    return r


# (tokens, hidden, intermediate, experts, top k, block): Mixtral's routing
# and Qwen3's (many experts, some empty, top 8) at small sizes.
@pytest.mark.parametrize("shape", [(64, 256, 512, 8, 2, 16), (24, 128, 64, 64, 8, 4)], ids=["mixtral", "qwen3"])
def test_layer_matches_float64_model(ctx, rng, shape):
    tokens, hidden, inter, experts, k, block = shape
    inputs = moe_layer.make_inputs(tokens, hidden, inter, experts, int(rng.integers(1 << 31)))
    r = run_and_check(ctx, inputs, k, block)
    assert r.ok, r.lines
    assert 0 < r.out_ratio <= 1


def test_check_catches_a_wrong_expert(ctx, rng):
    """The device gets expert e+1's W1 for expert e: the check must fail."""
    inputs = moe_layer.make_inputs(32, 64, 64, 8, int(rng.integers(1 << 31)))
    r = run_and_check(ctx, inputs, 2, 8, w1_on_device=np.roll(inputs["w1"], -1, axis=0))
    assert not r.ok
    assert any(line.startswith("FAILED: output") for line in r.lines)
