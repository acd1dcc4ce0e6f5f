"""Top-k gating on NumPy arrays against the float64 reference of
routing_ref (docs/routing.md, section 2)."""

from __future__ import annotations

import numpy as np
import pytest

import moecl

import routing_ref as ref
from routing_ref import to_bf16_bits

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None


def make_logits(rng, tokens, experts, dtype):
    """Random logits in dtype, and the same values as float64."""
    x = (rng.standard_normal((tokens, experts)) * 2).astype(np.float32)
    if dtype == "f16":
        a = x.astype(np.float16)
    elif dtype == "bf16":
        a = to_bf16_bits(x)
    else:
        a = x
    return a, ref.widen(a, dtype)


def check_topk(weights, ids, x, k, scoring="softmax", bias=None, groups=0, topk_group=0, group_score="max",
               group_fill="neg_inf", renormalize=False, floor=0.0, scale=1.0, eps=0.0):
    """Every row of (weights, ids) against the reference, as section 4 allows."""
    assert weights.dtype == np.float32 and ids.dtype == np.int32
    assert weights.shape == ids.shape == (x.shape[0], k)
    for t, row in enumerate(x):
        score, key, eligible, ref_ids = ref.topk_row(row, k, scoring, bias, groups, topk_group, group_score,
                                                     group_fill)
        tol = ref.softmax_tol(row, score) if scoring == "softmax" else 8 * ref.EPS * score + 2 * ref.TAU
        if bias is not None:
            tol = tol + ref.U * np.abs(np.nan_to_num(key, posinf=0, neginf=0)) + ref.TAU
        ref.check_ids(ids[t], key, eligible, ref_ids, tol, "row %d" % t)
        want = ref.topk_weights(score, ids[t], renormalize, floor, scale, eps)
        ref.check_weights(weights[t].astype(np.float64), want, 1e-5 * max(1.0, abs(scale)), "row %d" % t)


CASES = [
    dict(),
    dict(scoring="sigmoid"),
    dict(renormalize=True),
    dict(renormalize=True, floor=6.103515625e-5, scoring="sigmoid"),
    dict(renormalize=True, eps=1e-6, scoring="sigmoid"),
    dict(groups=8, topk_group=4, group_score="top2_sum", bias=True, scoring="sigmoid", renormalize=True, eps=1e-20,
         scale=2.5),
    dict(scale=2.5, bias=True, scoring="sigmoid"),
    dict(groups=8, topk_group=4, group_score="max"),
    dict(groups=8, topk_group=3, group_score="top2_sum", bias=True, scoring="sigmoid", renormalize=True, scale=-1.5),
    dict(groups=16, topk_group=2, group_score="max", group_fill="zero"),
    dict(groups=8, topk_group=4, group_score="top2_sum", group_fill="zero", bias=True, scoring="sigmoid"),
]


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join("%s=%s" % kv for kv in c.items()) or "defaults")
def test_random(ctx, rng, dtype, case):
    tokens, experts, k = int(rng.integers(1, 40)), 128, 8
    a, x = make_logits(rng, tokens, experts, dtype)
    bias = rng.standard_normal(experts).astype(np.float32) * 0.1 if case.get("bias") else None
    opts = dict(scoring=case.get("scoring", "softmax"), groups=case.get("groups"), topk_group=case.get("topk_group"),
                group_score=case.get("group_score", "max"), renormalize=case.get("renormalize", False),
                scale=case.get("scale", 1.0), renormalize_floor=case.get("floor", 0.0),
                renormalize_eps=case.get("eps", 0.0), group_fill=case.get("group_fill", "neg_inf"))
    w, ids = ctx.topk_gating(a, top_k=k, bias=bias, dtype="bf16" if dtype == "bf16" else None, **opts)
    check_topk(w, ids, x, k, opts["scoring"], None if bias is None else bias.astype(np.float64),
               opts["groups"] or 0, opts["topk_group"] or 0, opts["group_score"], opts["group_fill"],
               opts["renormalize"], opts["renormalize_floor"], opts["scale"], opts["renormalize_eps"])


@pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed")
def test_ml_dtypes_bfloat16(ctx, rng):
    x = rng.standard_normal((5, 64)).astype(np.float32)
    w, ids = ctx.topk_gating(x.astype(ml_dtypes.bfloat16), top_k=4)
    w2, ids2 = ctx.topk_gating(to_bf16_bits(x), top_k=4, dtype="bf16")
    np.testing.assert_array_equal(ids, ids2)
    np.testing.assert_array_equal(w, w2)


def test_counts(ctx, rng):
    a, x = make_logits(rng, 33, 64, "f32")
    w, ids, counts = ctx.topk_gating(a, top_k=6, counts=True)
    check_topk(w, ids, x, 6)
    assert counts.dtype == np.int32 and counts.shape == (64,)
    np.testing.assert_array_equal(counts, np.bincount(ids.ravel(), minlength=64))


def test_exact_ties_go_to_the_lower_index(ctx, rng):
    # Equal logits give bit-equal scores on every device: no tolerance.
    experts = 32
    x = np.zeros((4, experts), np.float32)
    x[1, ::2] = 1.0
    x[2] = rng.permutation(np.repeat(np.arange(8, dtype=np.float32), 4))
    x[3, 5] = x[3, 9] = x[3, 30] = 3.0
    for scoring in ("softmax", "sigmoid"):
        w, ids = ctx.topk_gating(x, top_k=6, scoring=scoring)
        for t in range(4):
            _, key, _, want = ref.topk_row(x[t].astype(np.float64), 6, scoring)
            np.testing.assert_array_equal(ids[t], want)
    np.testing.assert_array_equal(ids[0], np.arange(6))


def test_nan_and_inf_rows(ctx):
    """Step 1's edge cases: NaN, +inf and all -inf rows score NaN everywhere
    (ids 0..k-1, NaN weights); a -inf logit under a finite maximum scores 0;
    under sigmoid, +inf scores 1, -inf 0 and NaN ranks last."""
    e, k = 8, 3
    x = np.zeros((5, e), np.float32)
    x[0, 4] = np.nan
    x[1, 6] = np.inf
    x[2] = -np.inf
    x[3] = [0, -np.inf, 1, 2, -np.inf, 0.5, -1, 3]
    x[4] = [np.nan, -np.inf, np.inf, 0, np.nan, 5, -3, 1]
    w, ids = ctx.topk_gating(x, top_k=k)
    for t in range(3):
        np.testing.assert_array_equal(ids[t], [0, 1, 2])
        assert np.isnan(w[t]).all()
    check_topk(w[3:4], ids[3:4], x[3:4].astype(np.float64), k)
    w, ids = ctx.topk_gating(x, top_k=k, scoring="sigmoid")
    np.testing.assert_array_equal(ids[4], [2, 5, 7])
    assert w[4, 0] == 1.0
    check_topk(w, ids, x.astype(np.float64), k, "sigmoid")
    w, ids = ctx.topk_gating(x[4:5], top_k=8, scoring="sigmoid")
    np.testing.assert_array_equal(ids[0], [2, 5, 7, 3, 6, 1, 0, 4])  # NaNs last, by index
    assert w[0, 6] != w[0, 6] and w[0, 5] == 0.0


def test_underflowed_scores_tie(ctx):
    # docs/routing.md's example: logits [0, -300, -200, -250], top 3 -> [0, 1, 2].
    w, ids = ctx.topk_gating(np.array([[0, -300, -200, -250]], np.float32), top_k=3)
    np.testing.assert_array_equal(ids[0], [0, 1, 2])
    np.testing.assert_array_equal(w[0], [1, 0, 0])


def test_group_fill_examples(ctx):
    # docs/routing.md, section 5: 4 groups keeping 2, top 4.
    a = np.array([[0, -200, 0, -200, -1, -1, -1, -1]], np.float32)
    b = np.array([[-1, -1, -1, -1, 0, -200, 0, -200]], np.float32)
    for fill in ("neg_inf", "zero"):
        _, ids = ctx.topk_gating(a, top_k=4, groups=4, topk_group=2, group_fill=fill)
        np.testing.assert_array_equal(ids[0], [0, 2, 1, 3])
    _, ids = ctx.topk_gating(b, top_k=4, groups=4, topk_group=2, group_fill="zero")
    np.testing.assert_array_equal(ids[0], [4, 6, 0, 1])
    _, ids = ctx.topk_gating(b, top_k=4, groups=4, topk_group=2, group_fill="neg_inf")
    np.testing.assert_array_equal(ids[0], [4, 6, 5, 7])


def test_renormalize_zero_sum(ctx):
    # Sigmoid scores that all underflow: the sum is 0 and moecl's rule leaves
    # the weights at 0; a floor divides by the floor.
    x = np.full((1, 16), -200.0, np.float32)
    w, _ = ctx.topk_gating(x, top_k=4, scoring="sigmoid", renormalize=True)
    np.testing.assert_array_equal(w[0], 0)
    x[0, 3] = -10
    w, ids = ctx.topk_gating(x, top_k=2, scoring="sigmoid", renormalize=True, renormalize_floor=0.5)
    assert ids[0, 0] == 3
    np.testing.assert_allclose(w[0, 0], 1 / (1 + np.exp(10.0)) / 0.5, rtol=1e-5)


def test_renormalize_eps(ctx):
    # LFM2's 1e-6 beside a chosen sum near 8e-6: sum + eps, not the sum;
    # a zero sum gives 0 / eps = 0; a NaN sum gives NaN weights.
    x = np.full((2, 16), -200.0, np.float32)
    x[0, 2], x[0, 7] = -12, -13
    w, ids = ctx.topk_gating(x, top_k=2, scoring="sigmoid", renormalize=True, renormalize_eps=1e-6)
    s = 1 / (1 + np.exp([12.0, 13.0]))
    np.testing.assert_array_equal(ids[0], [2, 7])
    np.testing.assert_allclose(w[0], s / (s.sum() + np.float32(1e-6)), rtol=1e-5)
    np.testing.assert_array_equal(w[1], 0)
    w, ids = ctx.topk_gating(np.array([[np.nan, 0]], np.float32), top_k=2, scoring="sigmoid", renormalize=True,
                             renormalize_eps=1e-20)
    np.testing.assert_array_equal(ids[0], [1, 0])
    assert np.isnan(w[0]).all()
    with pytest.raises(moecl.InvalidArgumentError, match="renormalize_eps"):
        ctx.topk_gating(x, top_k=2, renormalize=True, renormalize_eps=1e-20, renormalize_floor=1e-3)


def test_no_tokens(ctx):
    w, ids = ctx.topk_gating(np.zeros((0, 64), np.float32), top_k=8)
    assert w.shape == ids.shape == (0, 8)


def test_out_arrays_are_written(ctx, rng):
    a, x = make_logits(rng, 7, 32, "f32")
    w = np.full((7, 4), np.nan, np.float32)
    ids = np.full((7, 4), -7, np.int32)
    rw, rids = ctx.topk_gating(a, top_k=4, out={"weights": w, "ids": ids})
    assert rw is w and rids is ids
    check_topk(w, ids, x, 4)


def test_nan_and_inf_bias(ctx, rng):
    # Step 2: a NaN bias element makes that s NaN (ranked last), +inf makes
    # it +inf (first) unless the score is NaN; the weights stay unbiased.
    x = rng.standard_normal((6, 16)).astype(np.float32)
    bias = np.zeros(16, np.float32)
    bias[[2, 7]] = np.nan
    bias[11] = np.inf
    bias[4] = -np.inf
    w, ids = ctx.topk_gating(x, top_k=16, bias=bias, scoring="sigmoid")
    assert (ids[:, 0] == 11).all() and (ids[:, -3] == 4).all()
    assert (ids[:, -2] == 2).all() and (ids[:, -1] == 7).all()  # NaNs last, by index
    check_topk(w, ids, x.astype(np.float64), 16, "sigmoid", bias.astype(np.float64))


@pytest.mark.parametrize("valid", [-2, 0, 5, 13, 40])
def test_padded_batch_and_load(ctx, rng, valid):
    """num_valid_tokens: the rows past it are padding (ids -1, weights 0),
    the rows before it what the plain call gives; expert_load: every
    call adds the routed slots' histogram to it, in place."""
    tokens, experts, k = 13, 64, 6
    a, x = make_logits(rng, tokens, experts, "f32")
    w0, ids0, counts0 = ctx.topk_gating(a, top_k=k, counts=True)
    load = rng.integers(0, 100, experts).astype(np.int32)
    start = load.copy()
    n = max(0, min(valid, tokens))
    for call in (1, 2):
        w, ids, counts = ctx.topk_gating(a, top_k=k, counts=True, num_valid_tokens=np.array([valid], np.int32),
                                         expert_load=load)
        np.testing.assert_array_equal(ids[:n], ids0[:n])
        np.testing.assert_array_equal(w[:n], w0[:n])
        np.testing.assert_array_equal(ids[n:], -1)
        np.testing.assert_array_equal(w[n:], 0)
        hist = np.bincount(ids0[:n].ravel(), minlength=experts)
        np.testing.assert_array_equal(counts, hist)
        np.testing.assert_array_equal(load, start + call * hist)


@pytest.mark.parametrize("cap_dtype", [np.int16, np.int32, np.int64])
@pytest.mark.parametrize("valid", [None, 0, 7])
def test_captured_ids_and_expert_scale(ctx, rng, cap_dtype, valid):
    """captured_ids: the ids a second time, in the array's dtype, padding
    rows -1; expert_scale: each weight the plain call's times its expert's
    scale in f32 (Gemma 4's per_expert_scale, after the renormalisation),
    padding rows 0; the ids unchanged."""
    tokens, experts, k = 13, 64, 6
    a, x = make_logits(rng, tokens, experts, "f32")
    w0, ids0 = ctx.topk_gating(a, top_k=k, renormalize=True)
    check_topk(w0, ids0, x, k, renormalize=True)
    scale = rng.uniform(-1.0, 3.0, experts).astype(np.float32)
    scale[::9] = 0.0
    cap = np.full((tokens, k), 0x5A5A, cap_dtype)
    nv = None if valid is None else np.array([valid], np.int32)
    w, ids = ctx.topk_gating(a, top_k=k, renormalize=True, captured_ids=cap, expert_scale=scale, num_valid_tokens=nv)
    n = tokens if valid is None else valid
    np.testing.assert_array_equal(ids[:n], ids0[:n])
    np.testing.assert_array_equal(cap[:n], ids0[:n])
    np.testing.assert_array_equal(w[:n], w0[:n] * scale[ids0[:n]])
    np.testing.assert_array_equal(ids[n:], -1)
    np.testing.assert_array_equal(cap[n:], -1)
    np.testing.assert_array_equal(w[n:], 0)


def test_captured_ids_alone_and_bad_arrays(ctx, rng):
    """captured_ids without a scale leaves the weights the plain call's;
    a capture or scale of the wrong dtype or shape is refused before any
    call."""
    a, _ = make_logits(rng, 5, 16, "f32")
    w0, ids0 = ctx.topk_gating(a, top_k=2)
    cap = np.zeros((5, 2), np.int16)
    w, ids = ctx.topk_gating(a, top_k=2, captured_ids=cap)
    np.testing.assert_array_equal(w, w0)
    np.testing.assert_array_equal(cap, ids0)
    with pytest.raises(TypeError, match="captured_ids"):
        ctx.topk_gating(a, top_k=2, captured_ids=np.zeros((5, 2), np.float32))
    with pytest.raises(TypeError, match="captured_ids"):
        ctx.topk_gating(a, top_k=2, captured_ids=np.zeros((5, 2), np.uint16))
    with pytest.raises(ValueError, match="captured_ids"):
        ctx.topk_gating(a, top_k=2, captured_ids=np.zeros((5, 3), np.int32))
    with pytest.raises(TypeError, match="expert_scale"):
        ctx.topk_gating(a, top_k=2, expert_scale=np.ones(16, np.float64))
    with pytest.raises(ValueError, match="expert_scale"):
        ctx.topk_gating(a, top_k=2, expert_scale=np.ones(15, np.float32))


@pytest.mark.parametrize("shared,weight", [(1, 0.4), (2, 0.75)])
def test_shared_experts(ctx, rng, shared, weight):
    """num_shared_experts: the routed slots as without them (and as the
    reference), then ids experts + j with the weight float32(weight *
    scale); counts and the load over experts + S entries; padding rows -1
    / 0 in every slot."""
    tokens, experts, k, scale = 13, 64, 6, 2.5
    a, x = make_logits(rng, tokens, experts, "f32")
    opts = dict(top_k=k, scoring="sigmoid", renormalize=True, scale=scale)
    w0, ids0 = ctx.topk_gating(a, **opts)
    w, ids, counts = ctx.topk_gating(a, counts=True, num_shared_experts=shared, shared_expert_weight=weight, **opts)
    assert w.shape == ids.shape == (tokens, k + shared) and counts.shape == (experts + shared,)
    np.testing.assert_array_equal(w[:, :k], w0)
    np.testing.assert_array_equal(ids[:, :k], ids0)
    check_topk(w[:, :k].copy(), ids[:, :k].copy(), x, k, "sigmoid", renormalize=True, scale=scale)
    np.testing.assert_array_equal(ids[:, k:], np.broadcast_to(np.arange(experts, experts + shared), (tokens, shared)))
    np.testing.assert_array_equal(w[:, k:], np.float32(np.float64(np.float32(weight)) * scale))
    np.testing.assert_array_equal(counts, np.bincount(ids.ravel(), minlength=experts + shared))
    load = np.zeros(experts + shared, np.int32)
    w, ids = ctx.topk_gating(a, num_valid_tokens=np.array([5], np.int32), expert_load=load,
                             num_shared_experts=shared, shared_expert_weight=weight, **opts)
    np.testing.assert_array_equal(ids[5:], -1)
    np.testing.assert_array_equal(w[5:], 0)
    np.testing.assert_array_equal(load, np.bincount(ids[:5].ravel(), minlength=experts + shared))
    with pytest.raises(moecl.InvalidArgumentError, match="num_shared_experts"):
        ctx.topk_gating(a, top_k=k, num_shared_experts=64 - k + 1)


def test_shared_experts_with_capture_and_scale(ctx, rng):
    """Shared slots beside captured_ids and expert_scale: the capture holds
    the routed slots only (padding rows -1), the scale multiplies the
    routed weights only, the shared slots keep their weight."""
    tokens, experts, k, shared, valid = 11, 32, 4, 2, 8
    a, _ = make_logits(rng, tokens, experts, "f32")
    opts = dict(top_k=k, renormalize=True, scale=2.0, num_shared_experts=shared, shared_expert_weight=0.5)
    w0, ids0 = ctx.topk_gating(a, num_valid_tokens=np.array([valid], np.int32), **opts)
    scale = rng.uniform(0.5, 2.0, experts).astype(np.float32)
    cap = np.full((tokens, k), 0x5A5A, np.int16)
    w, ids = ctx.topk_gating(a, num_valid_tokens=np.array([valid], np.int32), captured_ids=cap, expert_scale=scale,
                             **opts)
    np.testing.assert_array_equal(ids, ids0)
    np.testing.assert_array_equal(cap[:valid], ids0[:valid, :k])
    np.testing.assert_array_equal(cap[valid:], -1)
    np.testing.assert_array_equal(w[:valid, :k], w0[:valid, :k] * scale[ids0[:valid, :k]])
    np.testing.assert_array_equal(w[:valid, k:], np.float32(1.0))
    np.testing.assert_array_equal(w[valid:], 0)
