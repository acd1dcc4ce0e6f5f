"""Routing replay and hash routing (docs/routing.md, section 11) on NumPy
arrays: bit for bit top-k gating's weights on the ids it chose, a float64
model of the weights of given ids, and DeepSeek-V4's hash layers."""

from __future__ import annotations

import numpy as np
import pytest

import moecl

SCORINGS = ["softmax", "sigmoid", "sqrtsoftplus", "raw"]
WEIGHTINGS = ["score", "softmax_chosen", "sigmoid_chosen"]


def same_bits(a, b):
    return np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(
        a[~np.isnan(a)].view(np.uint32), b[~np.isnan(b)].view(np.uint32))


def scores64(x, scoring):
    """Step 1 in float64."""
    x = x.astype(np.float64)
    if scoring == "softmax":
        e = np.exp(x - x.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)
    if scoring == "sigmoid":
        return 1.0 / (1.0 + np.exp(-x))
    if scoring == "sqrtsoftplus":
        return np.sqrt(np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))))
    return x


def weights64(x, ids, scoring, weighting, renormalize, eps, scale):
    """The weights of given ids (section 11): ids outside the experts weigh 0."""
    s = scores64(x, scoring)
    out = np.zeros(ids.shape)
    for t in range(ids.shape[0]):
        valid = [(j, e) for j, e in enumerate(ids[t]) if 0 <= e < x.shape[1]]
        if not valid:
            continue
        js = [j for j, _ in valid]
        es = np.array([e for _, e in valid])
        xt = x[t, es].astype(np.float64)
        if weighting == "score":
            w = s[t, es]
        elif weighting == "softmax_chosen":
            w = np.exp(xt - xt.max())
            w = w / w.sum()
        else:
            w = 1.0 / (1.0 + np.exp(-xt))
        if renormalize:
            w = w / (w.sum() + eps) if eps else (w / w.sum() if w.sum() > 0 else w)
        out[t, js] = w * scale
    return out


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_bit_exact_on_chosen_ids(ctx, rng, scoring, weighting):
    x = (rng.standard_normal((53, 64)) * 2).astype(np.float32)
    conv = dict(scoring=scoring, weighting=weighting, renormalize=True, scale=2.5)
    w, ids = ctx.topk_gating(x, top_k=6, **conv)
    rw = ctx.topk_weights(x, ids, **conv)
    assert rw.dtype == np.float32 and rw.shape == (53, 6)
    assert same_bits(w, rw)


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v4", "mixtral", "qwen3-moe", "llama4", "gpt-oss"])
def test_presets(ctx, rng, name):
    conv = moecl.preset(name)
    experts, _ = moecl.preset_shape(name)
    x = (rng.standard_normal((19, experts)) * 3).astype(np.float32)
    bias = (rng.standard_normal(experts) * 0.1).astype(np.float32) if conv["scoring"] in ("sigmoid", "sqrtsoftplus") \
        else None
    w, ids = ctx.topk_gating(x, bias=bias, **conv)
    assert same_bits(w, ctx.topk_weights(x, ids, **conv))


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_given_ids(ctx, rng, scoring, weighting):
    x = (rng.standard_normal((31, 40))).astype(np.float32)
    ids = rng.integers(-2, 44, size=(31, 5)).astype(np.int32)
    ids[3] = -1
    for renormalize, eps in ((False, 0.0), (True, 0.0), (True, 1e-6)):
        w = ctx.topk_weights(x, ids, scoring=scoring, weighting=weighting, renormalize=renormalize,
                             renormalize_eps=eps, scale=1.5)
        want = weights64(x, ids, scoring, weighting, renormalize, eps, 1.5)
        bad = (ids < 0) | (ids >= 40)
        assert np.all(w[bad] == 0)
        mag = np.abs(want).max() if scoring in ("raw", "sqrtsoftplus") else 1.0
        np.testing.assert_allclose(w, want, rtol=0, atol=1e-5 * 1.5 * max(1.0, mag) * 4)


def test_hash_routing_deepseek_v4(ctx, rng):
    conv = moecl.preset("deepseek-v4")
    experts, _ = moecl.preset_shape("deepseek-v4")
    vocab, k = 1000, conv["top_k"]
    table = np.stack([rng.permutation(experts)[:k] for _ in range(vocab)]).astype(np.int32)
    tokens = rng.integers(0, vocab, size=77).astype(np.int32)
    tokens[[0, 5]] = [-1, vocab]
    x = rng.standard_normal((77, experts)).astype(np.float32)
    w, ids = ctx.hash_routing(x, tokens, table, **conv)
    assert ids.dtype == np.int32 and ids.shape == (77, k)
    good = (tokens >= 0) & (tokens < vocab)
    assert np.array_equal(ids[good], table[tokens[good]])
    assert np.all(ids[~good] == -1) and np.all(w[~good] == 0)
    # the model's router: sqrt(softplus) gathered, / (sum + 1e-20), * 2.5
    s = scores64(x, "sqrtsoftplus")
    g = np.take_along_axis(s[good], ids[good].astype(np.int64), axis=1)
    want = g / (g.sum(axis=1, keepdims=True) + 1e-20) * 2.5
    np.testing.assert_allclose(w[good], want, rtol=1e-5, atol=0)
    assert same_bits(w, ctx.topk_weights(x, ids, **conv))


def test_errors(ctx):
    x = np.zeros((4, 8), np.float32)
    with pytest.raises(TypeError):
        ctx.topk_weights(x, np.zeros((4, 2), np.int64))
    with pytest.raises(ValueError):
        ctx.topk_weights(x, np.zeros((3, 2), np.int32))
    with pytest.raises(ValueError):
        ctx.hash_routing(x, np.zeros(4, np.int32), np.zeros((5, 2), np.int32), top_k=3)
    with pytest.raises(moecl.InvalidArgumentError):
        ctx.topk_weights(x, np.zeros((4, 9), np.int32))
