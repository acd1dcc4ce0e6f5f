"""Output and bias dtypes of top-k gating and route dispatch: f16 / bf16
weights, int64 ids, f16 / bf16 bias. Each narrow weight is the host's
round-to-nearest-even of the f32 call's weight, bit for bit (a NaN stays a
NaN), the ids are the int32 call's, and the f32 call passes the float64
reference."""

from __future__ import annotations

import numpy as np
import pytest

import moecl

from routing_ref import to_bf16_bits
from test_topk_gating import check_topk, make_logits

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None


def bits_of(w):
    """16-bit weights as their uint16 bits (float16, bfloat16 or uint16 arrays)."""
    return w.view(np.uint16)


def rounded_bits(w32, weights_dtype):
    """The host's rounding of float32 weights to f16 / bf16, as bits."""
    if weights_dtype == "f16":
        with np.errstate(over="ignore"):  # beyond 65504: inf, as the device writes
            return w32.astype(np.float16).view(np.uint16)
    return to_bf16_bits(w32)


def assert_rounding(w, w32, weights_dtype):
    if weights_dtype == "f32":
        np.testing.assert_array_equal(w.view(np.uint32), w32.view(np.uint32))
        return
    got, want = bits_of(w), rounded_bits(w32, weights_dtype)
    nan = np.isnan(w32)
    exp_all = 0x7C00 if weights_dtype == "f16" else 0x7F80
    # A NaN weight is a NaN of the narrow type (its payload is the device's for f16).
    assert np.all((got[nan] & exp_all) == exp_all) and np.all((got[nan] & ~np.uint16(0xFC00 if weights_dtype == "f16"
                                                                                     else 0xFF80)) != 0)
    np.testing.assert_array_equal(got[~nan], want[~nan])


def bias_array(rng, experts, bias_dtype):
    """A bias of bias_dtype (None: no bias), and its float64 values."""
    if bias_dtype is None:
        return None, None
    b = (rng.standard_normal(experts) * 0.3).astype(np.float32)
    if bias_dtype == "f16":
        a = b.astype(np.float16)
        return a, a.astype(np.float64)
    if bias_dtype == "bf16":
        bits = to_bf16_bits(b)
        a = bits.view(ml_dtypes.bfloat16) if ml_dtypes is not None else bits
        return a, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return b, b.astype(np.float64)


@pytest.mark.parametrize("weights_dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("ids_dtype", ["int32", "int64"])
@pytest.mark.parametrize("bias_dtype", [None, "f32", "f16", "bf16"])
def test_topk_gating_dtypes(ctx, rng, weights_dtype, ids_dtype, bias_dtype):
    logits, x = make_logits(rng, 33, 64, "f32")
    bias, bias64 = bias_array(rng, 64, bias_dtype)
    kw = dict(top_k=8, scoring="sigmoid", bias=bias, groups=8, topk_group=4, group_score="top2_sum",
              renormalize=True, scale=2.5)
    # The f32 call on the bias's values: the reference's anchor.
    b32 = None if bias is None else bias64.astype(np.float32)
    w32, ids32 = ctx.topk_gating(logits, **{**kw, "bias": b32})
    check_topk(w32, ids32, x, 8, "sigmoid", bias64, 8, 4, "top2_sum", renormalize=True, scale=2.5)
    bd = "bf16" if bias_dtype == "bf16" and ml_dtypes is None else None
    w, ids = ctx.topk_gating(logits, weights_dtype=weights_dtype, ids_dtype=ids_dtype, bias_dtype=bd, **kw)
    want_w = {"f32": np.float32, "f16": np.float16,
              "bf16": ml_dtypes.bfloat16 if ml_dtypes is not None else np.uint16}[weights_dtype]
    assert w.dtype == np.dtype(want_w) and w.shape == (33, 8)
    assert ids.dtype == np.dtype(ids_dtype) and ids.shape == (33, 8)
    np.testing.assert_array_equal(ids.astype(np.int64), ids32.astype(np.int64))
    assert_rounding(w, w32, weights_dtype)


@pytest.mark.parametrize("weights_dtype", ["f16", "bf16"])
def test_special_values(ctx, weights_dtype):
    """NaN rows keep NaN weights; f16 weights past 65504 are inf, 65504 stays."""
    logits = np.array([[1, 2, 3, 4], [np.nan, 0, 1, 2], [0, 0, 0, 0]], dtype=np.float32)
    for scale in (1e6, -1e6, 65504.0, 65519.0, 65520.0, 1.00390625, 1.00048828125):
        w32, _ = ctx.topk_gating(logits, top_k=1, renormalize=True, scale=scale)
        w, ids = ctx.topk_gating(logits, top_k=1, renormalize=True, scale=scale, weights_dtype=weights_dtype,
                                 ids_dtype="int64")
        assert ids.dtype == np.int64 and list(ids[:, 0]) == [3, 0, 0]
        assert_rounding(w, w32, weights_dtype)
        wide = bits_of(w).astype(np.uint32)
        val = (wide << 16).view(np.float32) if weights_dtype == "bf16" else bits_of(w).view(np.float16)
        assert np.isnan(val[1, 0])
        if weights_dtype == "f16" and abs(scale) >= 65520:
            assert np.isinf(val[0, 0]) and np.sign(val[0, 0]) == np.sign(scale)


def test_counts_and_out(ctx, rng):
    logits, _ = make_logits(rng, 20, 32, "f32")
    w32, ids32, c32 = ctx.topk_gating(logits, top_k=4, counts=True)
    out = {"weights": np.empty((20, 4), np.float16), "ids": np.empty((20, 4), np.int64)}
    w, ids, counts = ctx.topk_gating(logits, top_k=4, counts=True, weights_dtype="f16", ids_dtype="int64", out=out)
    assert w is out["weights"] and ids is out["ids"]
    np.testing.assert_array_equal(counts, c32)
    np.testing.assert_array_equal(ids, ids32)
    assert_rounding(w, w32, "f16")
    with pytest.raises(TypeError):
        ctx.topk_gating(logits, top_k=4, weights_dtype="f16", out={"weights": np.empty((20, 4), np.float32)})


def test_route_dispatch_dtypes(ctx, rng):
    logits, _ = make_logits(rng, 40, 64, "f32")
    bias, _ = bias_array(rng, 64, "f16")
    kw = dict(top_k=8, scoring="sigmoid", bias=bias, renormalize=True, scale=2.5)
    w, ids = ctx.topk_gating(logits, weights_dtype="bf16", **kw)
    r = ctx.route_dispatch(logits, weights_dtype="bf16", block_size=16, **kw)
    np.testing.assert_array_equal(bits_of(r.topk_weights), bits_of(w))
    np.testing.assert_array_equal(r.topk_ids, ids)
    a = ctx.moe_align(ids, 64, 16)
    np.testing.assert_array_equal(r.sorted_token_ids, a.sorted_token_ids)
    with pytest.raises(moecl.InvalidArgumentError, match="ids_dtype"):
        ctx.route_dispatch(logits, ids_dtype="int64", **kw)


def test_invalid_names(ctx, rng):
    logits, _ = make_logits(rng, 2, 8, "f32")
    with pytest.raises(ValueError, match="weights_dtype"):
        ctx.topk_gating(logits, top_k=2, weights_dtype="f64")
    with pytest.raises(ValueError, match="ids_dtype"):
        ctx.topk_gating(logits, top_k=2, ids_dtype="uint32")
    with pytest.raises(TypeError):
        ctx.topk_gating(logits, top_k=2, bias=np.zeros(8, np.float64))
