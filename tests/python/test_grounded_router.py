"""The grounded router on NumPy arrays against routing_ref's float64
reference (docs/routing.md, section 3)."""

from __future__ import annotations

import numpy as np
import pytest

import moecl

import routing_ref as ref
from routing_ref import to_bf16_bits

try:
    import ml_dtypes
except ImportError:  # bf16 checks need it; the rest run without
    ml_dtypes = None


def convert(x, dtype):
    return {"f32": lambda: x, "f16": lambda: x.astype(np.float16), "bf16": lambda: to_bf16_bits(x)}[dtype]()


def check_grounded(pairs, weights, ids, h, r, w, alpha, k):
    for t in range(h.shape[0]):
        g, ref_ids, _, tol = ref.grounded_row(h[t], r[t], w, alpha, k)
        ref.check_ids(ids[t], g, np.ones(g.size, bool), ref_ids, tol, "token %d" % t)
        # The weights depend only on the chosen g: recompute for the device's ids.
        ref.check_weights(weights[t].astype(np.float64), ref.grounded_weights(g[ids[t]]), 1e-5, "token %d" % t)
        if pairs is not None:
            np.testing.assert_array_equal(pairs[t, :, 0], ids[t].astype(np.float32))
            np.testing.assert_array_equal(pairs[t, :, 1], weights[t])


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("k,alpha", [(2, 1.0), (4, 0.25), (1, -3.0)])
def test_random(ctx, rng, dtype, k, alpha):
    tokens, hidden, experts = int(rng.integers(1, 24)), int(rng.integers(1, 200)), 16
    h = convert(rng.standard_normal((tokens, hidden)).astype(np.float32), dtype)
    gr = convert(rng.standard_normal((experts, hidden)).astype(np.float32), dtype)
    r = rng.standard_normal((tokens, experts)).astype(np.float32)
    pairs, weights, ids = ctx.grounded_router(h, r, gr, top_k=k, alpha=alpha,
                                              dtype="bf16" if dtype == "bf16" else None,
                                              outputs=("pairs", "weights", "ids"))
    assert pairs.shape == (tokens, k, 2) and weights.shape == ids.shape == (tokens, k)
    check_grounded(pairs, weights, ids, ref.widen(h, dtype), r.astype(np.float64), ref.widen(gr, dtype), alpha, k)


def test_outputs_subsets(ctx, rng):
    h = rng.standard_normal((5, 32)).astype(np.float32)
    g = rng.standard_normal((8, 32)).astype(np.float32)
    r = rng.standard_normal((5, 8)).astype(np.float32)
    (pairs,) = ctx.grounded_router(h, r, g, outputs=("pairs",))
    weights, ids = ctx.grounded_router(h, r, g)
    np.testing.assert_array_equal(pairs[:, :, 0], ids)
    np.testing.assert_array_equal(pairs[:, :, 1], weights)


def test_ties_nan_and_inf(ctx):
    """Equal g go to the lower index; NaN ranks last (all weights NaN when
    chosen); a chosen +inf makes every weight NaN; a chosen -inf under a
    finite maximum weighs 0."""
    h = np.zeros((4, 4), np.float32)
    g = np.ones((6, 4), np.float32)
    r = np.array([[1, 3, 3, 0, 3, 2],
                  [np.nan, np.nan, np.nan, np.nan, np.nan, 1],
                  [0, np.inf, 1, 2, 3, 4],
                  [-np.inf, -np.inf, 1, -np.inf, -np.inf, -np.inf]], np.float32)
    weights, ids = ctx.grounded_router(h, r, g, top_k=3, alpha=1.0)
    np.testing.assert_array_equal(ids, [[1, 2, 4], [5, 0, 1], [1, 5, 4], [2, 0, 1]])
    np.testing.assert_allclose(weights[0], [1 / 3] * 3, rtol=1e-6)
    assert np.isnan(weights[1]).all() and np.isnan(weights[2]).all()
    np.testing.assert_array_equal(weights[3], [1, 0, 0])
    check_grounded(None, weights, ids, h.astype(np.float64), r.astype(np.float64), g.astype(np.float64), 1.0, 3)


@pytest.mark.parametrize("eps", [0.0, 1e-20])
def test_router_deepseek_v3(ctx, rng, eps):
    """moecl_router as DeepSeek-V3's router (hidden @ W_gate.T, no router
    logits): sigmoid, a bias, 8 groups keeping 4 by the top-two sum, top 8,
    renormalised (by the sum, or by sum + 1e-20 as the model's code does),
    factor 2.5; against routing_ref on g in float64."""
    tokens, hidden, experts, k = 9, 48, 64, 8
    h = (rng.standard_normal((tokens, hidden)) / np.sqrt(hidden)).astype(np.float32)  # float32 under NumPy 2 too
    gw = rng.standard_normal((experts, hidden)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(experts)).astype(np.float32)
    weights, ids = ctx.router(h, gw, top_k=k, bias=bias, scoring="sigmoid", weighting="score", groups=8,
                              topk_group=4, group_score="top2_sum", renormalize=True, scale=2.5,
                              renormalize_eps=eps)
    assert weights.shape == ids.shape == (tokens, k)
    for t in range(tokens):
        g, _, _, g_tol = ref.grounded_row(h[t].astype(np.float64), np.zeros(experts), gw.astype(np.float64), 1.0, k)
        score, key, eligible, ref_ids = ref.topk_row(g, k, "sigmoid", bias.astype(np.float64), 8, 4, "top2_sum")
        # sigmoid' <= 1/4: g's bound moves the score by at most a quarter of it.
        tol = 0.25 * g_tol + 8 * ref.EPS * np.abs(score) + 2 * ref.TAU + ref.U * np.abs(key)
        ref.check_ids(ids[t], key, eligible, ref_ids, tol, "token %d" % t)
        # Renormalised by D = sum v: w_j = 2.5 v_j / D moves by at most
        # 2.5 / D (dv_j + v_j sum dv / D), dv the scores' bound (section 4).
        v, dv = score[ids[t]], tol[ids[t]]
        atol = 2.5e-5 + (2.5 / v.sum() * (dv + v * dv.sum() / v.sum())).max()
        ref.check_weights(weights[t].astype(np.float64), ref.topk_weights(score, ids[t], True, 0.0, 2.5, eps), atol,
                          "token %d" % t)


def test_llama4_row(ctx):
    """TensorRT-LLM's Llama 4 routing: top-k on the logits, then their
    sigmoid: ids [1, 6], through top-k gating and the router (alpha 0:
    g is the router logit)."""
    x = np.array([[20, 30, 17, 0, 1, 2, 25, -1]], np.float32)
    want = 1.0 / (1.0 + np.exp(-np.array([30.0, 25.0])))
    w, ids = ctx.topk_gating(x, top_k=2, scoring="raw", weighting="sigmoid_chosen")
    np.testing.assert_array_equal(ids[0], [1, 6])
    np.testing.assert_allclose(w[0], want, atol=1e-6)
    w, ids = ctx.router(np.ones((1, 4), np.float32), np.ones((8, 4), np.float32), top_k=2, alpha=0.0,
                        router_logits=x, scoring="raw", weighting="sigmoid_chosen")
    np.testing.assert_array_equal(ids[0], [1, 6])
    np.testing.assert_allclose(w[0], want, atol=1e-6)
    # The grounded router's gating options, and their validation.
    _, ids = ctx.grounded_router(np.ones((1, 4), np.float32), x, np.ones((8, 4), np.float32), top_k=2,
                                 alpha=0.0, scoring="sqrtsoftplus", weighting="softmax_chosen")
    np.testing.assert_array_equal(ids[0], [1, 6])
    with pytest.raises(ValueError):
        ctx.router(np.ones((1, 4), np.float32), np.ones((8, 4), np.float32), weighting="softmax")
    with pytest.raises(TypeError):
        ctx.router(np.ones((1, 4), np.float32), np.ones((8, 4), np.float32), top_k=2, colour="red")


@pytest.mark.parametrize("logits_dtype", ["f32", "bf16", "f16"])
def test_router_rounds_g(ctx, logits_dtype):
    """g = 1 + j 2^-16 for expert j (a gate bias row over a zero GEMM): fp32
    keeps them apart and chooses the last experts; bf16 and f16 round
    every one to 1.0 (their spacing at 1 is 2^-7 and 2^-10), which ties
    them: the lowest ids, equal weights. The bias row as [experts] gives
    what the same row given to every token gives."""
    tokens, hidden, experts, k = 3, 8, 16, 4
    h = np.ones((tokens, hidden), np.float32)
    w_gate = np.zeros((experts, hidden), np.float32)
    row = (1 + np.arange(experts) * 2.0 ** -16).astype(np.float32)
    w, ids = ctx.router(h, w_gate, top_k=k, router_logits=row, scoring="softmax", weighting="softmax_chosen",
                        logits_dtype=logits_dtype)
    w2, ids2 = ctx.router(h, w_gate, top_k=k, router_logits=np.tile(row, (tokens, 1)), scoring="softmax",
                          weighting="softmax_chosen", logits_dtype=logits_dtype)
    np.testing.assert_array_equal(ids, ids2)
    np.testing.assert_array_equal(w, w2)
    if ml_dtypes is not None and logits_dtype == "bf16":
        np.testing.assert_array_equal(row.astype(ml_dtypes.bfloat16).astype(np.float32), 1.0)
    want = np.arange(k) if logits_dtype != "f32" else np.arange(experts - 1, experts - 1 - k, -1)
    for t in range(tokens):
        np.testing.assert_array_equal(ids[t], want)
    if logits_dtype != "f32":
        np.testing.assert_array_equal(w, 1.0 / k)


def test_router_softcap(ctx, rng):
    """logit_softcap c: the gating sees c tanh(g / c); against float64."""
    tokens, hidden, experts, k, c = 6, 24, 32, 4, 5.0
    h = rng.standard_normal((tokens, hidden)).astype(np.float32)
    w_gate = (3 * rng.standard_normal((experts, hidden))).astype(np.float32)
    w, ids = ctx.router(h, w_gate, top_k=k, scoring="sigmoid", renormalize=True, logit_softcap=c)
    g = c * np.tanh(h.astype(np.float64) @ w_gate.T.astype(np.float64) / c)
    s = 1 / (1 + np.exp(-g))
    for t in range(tokens):
        chosen = s[t, ids[t]]
        np.testing.assert_allclose(w[t], chosen / chosen.sum(), atol=1e-5)
        # every chosen expert ranks at least as high as every other, within fp32
        assert s[t, ids[t]].min() >= np.delete(s[t], ids[t]).max() - 1e-5
    with pytest.raises(moecl.InvalidArgumentError, match="logit_softcap"):
        ctx.router(h, w_gate, top_k=k, logit_softcap=-1.0)
    with pytest.raises(TypeError, match="_logits_row|router_logits_row"):
        ctx.router(h, w_gate, top_k=k, router_logits_row=True)


@pytest.mark.parametrize("weights_dtype,ids_dtype,bias_dtype,capture", [
    ("f32", "int32", "f32", np.int16), ("bf16", "int64", "bf16", np.int32), ("f16", "int32", "f16", np.int64)])
@pytest.mark.parametrize("valid", [0, 13, 40])
def test_router_options(ctx, rng, weights_dtype, ids_dtype, bias_dtype, capture, valid):
    """moecl_router_ex's options against the plain call's routing: the
    typed outputs, the padding rows past num_valid_tokens (ids -1, weights
    0, counted nowhere), the counts and the load counter, the captured ids,
    and Gemma 4's per_expert_scale: each final weight times its expert's
    scale in float32, then rounded once to weights_dtype, bit for bit."""
    if "bf16" in (weights_dtype, bias_dtype) and ml_dtypes is None:
        pytest.skip("bf16 arrays need ml_dtypes")
    tokens, hidden, experts, k = 37, 48, 32, 8
    h = (rng.standard_normal((tokens, hidden)) / np.sqrt(hidden)).astype(np.float32)
    gw = rng.standard_normal((experts, hidden)).astype(np.float32)
    b32 = (rng.standard_normal(experts) * 0.1).astype(np.float32)
    bias = {"f32": lambda: b32, "f16": lambda: b32.astype(np.float16),
            "bf16": lambda: to_bf16_bits(b32).view(ml_dtypes.bfloat16)}[bias_dtype]()
    scale = ((0.375 + 0.25 * (np.arange(experts) % 7)) * np.where(np.arange(experts) % 5 == 3, -1, 1)).astype(
        np.float32)
    gating = dict(scoring="softmax", renormalize=True)
    w_plain, ids_plain = ctx.router(h, gw, top_k=k, bias=bias.astype(np.float32), **gating)
    load = np.arange(experts, dtype=np.int32) - 5
    load_before = load.copy()
    captured = np.full((tokens, k), 77, capture)
    w, ids, counts = ctx.router(h, gw, top_k=k, bias=bias, weights_dtype=weights_dtype, ids_dtype=ids_dtype,
                                counts=True, num_valid_tokens=np.array([valid], np.int32), expert_load=load,
                                captured_ids=captured, expert_scale=scale, **gating)
    assert ids.dtype == (np.int64 if ids_dtype == "int64" else np.int32)
    np.testing.assert_array_equal(ids[:valid], ids_plain[:valid])
    np.testing.assert_array_equal(ids[valid:], -1)
    scaled = (w_plain * scale[ids_plain]).astype(np.float32)
    scaled[valid:] = 0.0
    got = w.view(np.uint16) if weights_dtype != "f32" else w.view(np.uint32)
    want = {"f32": lambda: scaled.view(np.uint32), "f16": lambda: scaled.astype(np.float16).view(np.uint16),
            "bf16": lambda: to_bf16_bits(scaled)}[weights_dtype]()
    np.testing.assert_array_equal(got, want)
    hist = np.bincount(ids_plain[:valid].ravel(), minlength=experts).astype(np.int32)
    np.testing.assert_array_equal(counts, hist)
    np.testing.assert_array_equal(load, load_before + hist)
    np.testing.assert_array_equal(captured.astype(np.int64), ids.astype(np.int64))


def test_router_options_refused(ctx):
    h, gw = np.ones((2, 4), np.float32), np.ones((8, 4), np.float32)
    with pytest.raises(TypeError):
        ctx.router(h, gw, top_k=2, captured_ids=np.zeros((2, 2), np.uint8))
    with pytest.raises(ValueError):
        ctx.router(h, gw, top_k=2, expert_scale=np.ones(7, np.float32))
    with pytest.raises(ValueError):
        ctx.router(h, gw, top_k=2, ids_dtype="int16")
    with pytest.raises(ValueError):
        ctx.router(h, gw, top_k=2, out={"counts": np.zeros(8, np.int32)})


@pytest.mark.parametrize("gated", [False, True])
def test_router_shared(ctx, rng, gated):
    """Shared experts after the routed slots (docs/routing.md, section 3):
    the routed slots as without them, bit for bit; ids experts + j; the
    constant weight 0.4 * 2.5 in fp32, or Qwen2-MoE's gate sigmoid(h .
    w_shared) (NaN where h has a NaN, 0 or 1 where its dot product is
    infinite); padding rows -1 / 0 in every slot; counts and the load
    over experts + S; the capture the routed ids; the scale on routed slots only."""
    tokens, hidden, experts, k, s, valid = 11, 40, 16, 4, 2, 9
    h = (rng.standard_normal((tokens, hidden)) / np.sqrt(hidden)).astype(np.float32)
    h[1, 5] = np.nan
    h[2, 0] = np.inf
    gw = rng.standard_normal((experts, hidden)).astype(np.float32)
    gate = rng.standard_normal((s, hidden)).astype(np.float32) if gated else None
    scale = (0.5 + 0.25 * (np.arange(experts) % 3)).astype(np.float32)
    gating = dict(scoring="sigmoid", renormalize=True, scale=2.5)
    nv = np.array([valid], np.int32)
    w0, ids0 = ctx.router(h, gw, top_k=k, num_valid_tokens=nv, expert_scale=scale, **gating)
    load = np.arange(experts + s, dtype=np.int32) - 3
    load_before = load.copy()
    captured = np.full((tokens, k), 99, np.int16)
    w, ids, counts = ctx.router(h, gw, top_k=k, num_valid_tokens=nv, expert_scale=scale, counts=True,
                                expert_load=load, captured_ids=captured, num_shared_experts=s,
                                shared_expert_weight=0.4, shared_expert_gate=gate, **gating)
    assert w.shape == ids.shape == (tokens, k + s) and counts.shape == (experts + s,)
    np.testing.assert_array_equal(ids[:, :k], ids0)
    np.testing.assert_array_equal(w[:, :k].view(np.uint32), w0.view(np.uint32))
    want_ids, want_w, tol = ref.shared_slots(h[:valid].astype(np.float64), experts, s, 0.4, 2.5,
                                             None if gate is None else gate.astype(np.float64))
    np.testing.assert_array_equal(ids[:valid, k:], want_ids)
    np.testing.assert_array_equal(ids[valid:], -1)
    np.testing.assert_array_equal(w[valid:], 0.0)
    if gated:
        assert np.isnan(w[1, k:]).all() and np.isin(w[2, k:], [0.0, 1.0]).all()
        got = w[:valid, k:].astype(np.float64)
        assert (np.isnan(got) == np.isnan(want_w)).all(), (got, want_w)
        ok = ~np.isnan(want_w)
        assert (np.abs(got[ok] - want_w[ok]) <= tol[ok]).all(), (got, want_w, tol)
    else:
        np.testing.assert_array_equal(w[:valid, k:], np.float32(0.4) * np.float32(2.5))
    hist = np.bincount(ids[:valid].ravel(), minlength=experts + s).astype(np.int32)
    np.testing.assert_array_equal(counts, hist)
    np.testing.assert_array_equal(load, load_before + hist)
    np.testing.assert_array_equal(captured, ids[:, :k])


def test_grounded_shared(ctx, rng):
    """The grounded router's outputs (pairs too) and its route dispatch
    with shared experts: top_k + S slots, aligned over experts + S."""
    tokens, hidden, experts, k, s = 7, 24, 16, 2, 1
    h = rng.standard_normal((tokens, hidden)).astype(np.float32)
    gw = rng.standard_normal((experts, hidden)).astype(np.float32)
    r = rng.standard_normal((tokens, experts)).astype(np.float32)
    pairs, weights, ids = ctx.grounded_router(h, r, gw, top_k=k, outputs=("pairs", "weights", "ids"),
                                              num_shared_experts=s, shared_expert_weight=0.5)
    assert pairs.shape == (tokens, k + s, 2)
    np.testing.assert_array_equal(pairs[:, :, 0], ids.astype(np.float32))
    np.testing.assert_array_equal(pairs[:, :, 1], weights)
    np.testing.assert_array_equal(ids[:, k:], experts)
    np.testing.assert_array_equal(weights[:, k:], 0.5)
    check_grounded(None, weights[:, :k], ids[:, :k], h.astype(np.float64), r.astype(np.float64),
                   gw.astype(np.float64), 1.0, k)
    d = ctx.grounded_route_dispatch(h, r, gw, top_k=k, block_size=4, num_shared_experts=s,
                                    shared_expert_weight=0.5)
    np.testing.assert_array_equal(d.topk_ids, ids)
    np.testing.assert_array_equal(d.topk_weights, weights)
    a = ctx.moe_align(ids, experts + s, 4)
    np.testing.assert_array_equal(d.expert_counts, a.expert_counts)
    np.testing.assert_array_equal(d.sorted_token_ids, a.sorted_token_ids)


def test_router_shared_refused(ctx):
    """top_k + S past 64, a weight NaN or infinite, a gate without shared
    experts or of the wrong shape: named."""
    h, gw = np.ones((2, 4), np.float32), np.ones((8, 4), np.float32)
    with pytest.raises(moecl.InvalidArgumentError, match="num_shared_experts"):
        ctx.router(h, gw, top_k=2, num_shared_experts=63)
    for bad in (np.nan, np.inf):
        with pytest.raises(moecl.InvalidArgumentError, match="shared_expert_weight"):
            ctx.router(h, gw, top_k=2, num_shared_experts=1, shared_expert_weight=bad)
    with pytest.raises(ValueError, match="shared_expert_gate"):
        ctx.router(h, gw, top_k=2, shared_expert_gate=np.ones((1, 4), np.float32))
    with pytest.raises(ValueError, match="shared_expert_gate"):
        ctx.router(h, gw, top_k=2, num_shared_experts=1, shared_expert_gate=np.ones((1, 5), np.float32))
