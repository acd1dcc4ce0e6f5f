"""The routers' gating defaults: a scoring given without a weighting means
what it means for top-k gating, so ctx.router(h, W, scoring=S) weighs as
ctx.topk_gating(h @ W.T, scoring=S) does; without either, the grounded
router's own gating (top-k of g, softmax over the chosen) stays."""

from __future__ import annotations

import numpy as np
import pytest

TOKENS, EXPERTS, K = 5, 16, 4


def exact_inputs(rng):
    """hidden [tokens, experts] and W = I, so that g = hidden @ W.T is exact
    in float32 on any device, and each row's values distinct (no ties):
    the two calls must then choose the same ids."""
    h = np.stack([rng.permutation(EXPERTS) for _ in range(TOKENS)]).astype(np.float32) / 8 - 1
    return h, np.eye(EXPERTS, dtype=np.float32)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus", "raw"])
def test_router_scoring_matches_topk_gating(ctx, rng, scoring):
    h, w = exact_inputs(rng)
    rw, rids = ctx.router(h, w, top_k=K, scoring=scoring)
    tw, tids = ctx.topk_gating(h @ w.T, top_k=K, scoring=scoring)
    np.testing.assert_array_equal(rids, tids)
    np.testing.assert_allclose(rw, tw, rtol=1e-5, atol=1e-7)


def test_grounded_router_scoring_matches_topk_gating(ctx, rng):
    h, w = exact_inputs(rng)
    r = np.zeros((TOKENS, EXPERTS), np.float32)
    gw, gids = ctx.grounded_router(h, r, w, top_k=K, scoring="softmax")
    tw, tids = ctx.topk_gating(h, top_k=K, scoring="softmax")
    np.testing.assert_array_equal(gids, tids)
    np.testing.assert_allclose(gw, tw, rtol=1e-5, atol=1e-7)


def test_router_defaults_and_explicit_weighting(ctx, rng):
    h, w = exact_inputs(rng)
    # No scoring: the grounded router's softmax over the chosen values.
    dw, dids = ctx.router(h, w, top_k=K)
    chosen = np.take_along_axis(h.astype(np.float64), dids, axis=1)
    want = np.exp(chosen - chosen.max(axis=1, keepdims=True))
    np.testing.assert_allclose(dw, want / want.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7)
    # An explicit weighting wins over the scoring's default.
    sw, sids = ctx.router(h, w, top_k=K, scoring="softmax", weighting="softmax_chosen")
    np.testing.assert_array_equal(sids, dids)
    np.testing.assert_allclose(sw, dw, rtol=1e-5, atol=1e-7)
    # The two differ: all experts' softmax at the chosen sums to less than 1.
    tw, _ = ctx.router(h, w, top_k=K, scoring="softmax")
    assert (tw.sum(axis=1) < 0.999).all() and np.allclose(dw.sum(axis=1), 1, atol=1e-5)
