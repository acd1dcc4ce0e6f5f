"""moe_align on NumPy arrays against routing_ref's reference
(docs/routing.md, section 7): integers, so compared exactly."""

from __future__ import annotations

import numpy as np
import pytest

import routing_ref as ref

FIELDS = ("expert_counts", "sorted_token_ids", "block_expert_ids", "num_tokens_post_padded", "slot_positions",
          "num_invalid")


def check_align(res, ids, experts, block, expert_map=None):
    want = ref.moe_align(ids, experts, block, expert_map)
    for name, w in zip(FIELDS, want):
        got = getattr(res, name)
        assert got.dtype == np.int32, name
        np.testing.assert_array_equal(got, w, err_msg=name)
    assert res.event is None


@pytest.mark.parametrize("tokens,k,experts,block", [(1, 1, 1, 1), (37, 8, 64, 16), (300, 6, 160, 64),
                                                    (5, 4, 3, 7), (0, 8, 16, 4)])
def test_random(ctx, rng, tokens, k, experts, block):
    # Ids in [-1, experts]: -1 and experts are invalid, and repeats are allowed.
    ids = rng.integers(-1, experts + 1, (tokens, k)).astype(np.int32)
    check_align(ctx.moe_align(ids, experts, block), ids, experts, block)


def test_optional_outputs_left_out(ctx, rng):
    ids = rng.integers(0, 8, (9, 2)).astype(np.int32)
    res = ctx.moe_align(ids, 8, 4, slot_positions=False, num_invalid=False)
    assert res.slot_positions is None and res.num_invalid is None
    want = ref.moe_align(ids, 8, 4)
    np.testing.assert_array_equal(res.sorted_token_ids, want[1])


def test_routing_round_trip(ctx, rng):
    # moe_align of top-k gating's ids: every slot lands once, gathering by
    # sorted_token_ids and scattering back by slot_positions restores order.
    w, ids = ctx.topk_gating(rng.standard_normal((50, 32)).astype(np.float32), top_k=4)
    res = ctx.moe_align(ids, 32, 8)
    flat = ids.ravel()
    assert (res.sorted_token_ids[res.slot_positions.ravel()] == np.arange(flat.size)).all()
    np.testing.assert_array_equal(res.expert_counts, np.bincount(flat, minlength=32))
    check_align(res, ids, 32, 8)


def test_output_sizes_match_the_library(ctx, rng):
    # The package sizes sorted_token_ids itself (before any C call): as
    # moecl_moe_align_max_padded() does.
    import ctypes

    import moecl
    lib = moecl.library()
    for tokens, k, experts, block in [(3, 2, 5, 4), (0, 1, 4096, 1024), (17, 64, 1, 1)]:
        d = lib.moecl_moe_align_desc_init(tokens, k, experts, block)
        res = ctx.moe_align(np.zeros((tokens, k), np.int32), experts, block)
        assert res.sorted_token_ids.size == lib.moecl_moe_align_max_padded(ctypes.byref(d))
        assert res.block_expert_ids.size == res.sorted_token_ids.size // block


def ep_map(rng, kind, experts, ranks):
    """A rank's global-to-local map: its contiguous block (vLLM's EP), a
    scattered subset in shuffled order, or every expert remote."""
    g = experts * ranks
    m = np.full(g, -1, np.int32)
    if kind == "block":
        r = int(rng.integers(ranks))
        m[r * experts:(r + 1) * experts] = np.arange(experts)
    elif kind == "scattered":
        m[rng.choice(g, experts, replace=False)] = rng.permutation(experts)
    return m


@pytest.mark.parametrize("kind", ["block", "scattered", "remote"])
@pytest.mark.parametrize("tokens,k,experts,ranks,block", [(1, 1, 1, 1, 1), (37, 8, 16, 4, 16), (300, 6, 40, 2, 64),
                                                          (0, 8, 16, 2, 4)])
def test_expert_map(ctx, rng, kind, tokens, k, experts, ranks, block):
    # Global ids in [-1, G]: -1 and G are invalid; the map picks this rank's.
    m = ep_map(rng, kind, experts, ranks)
    ids = rng.integers(-1, len(m) + 1, (tokens, k)).astype(np.int32)
    res = ctx.moe_align(ids, experts, block, expert_map=m)
    check_align(res, ids, experts, block, m)
    outside = int(((ids < 0) | (ids >= len(m))).sum())
    assert res.num_invalid[0] == outside
    if kind == "remote":
        assert res.num_tokens_post_padded[0] == 0 and (res.slot_positions == -1).all()


def test_expert_map_equals_align_of_local_ids(ctx, rng):
    # With every global id in range and on this rank or remote, the map's
    # result is moe_align of the mapped ids, remote slots aside.
    m = ep_map(rng, "block", 8, 4)
    ids = rng.integers(0, 32, (64, 4)).astype(np.int32)
    res = ctx.moe_align(ids, 8, 4, expert_map=m)
    local = m[ids]
    plain = ctx.moe_align(local, 8, 4)
    for name in FIELDS[:4]:
        np.testing.assert_array_equal(getattr(res, name), getattr(plain, name), err_msg=name)
    assert res.num_invalid[0] == 0 and plain.num_invalid[0] == int((local == -1).sum())


def test_expert_map_rejected(ctx, rng):
    ids = np.zeros((4, 2), np.int32)
    with pytest.raises(TypeError):
        ctx.moe_align(ids, 8, 4, expert_map=np.zeros(16, np.int64))
    with pytest.raises(ValueError):
        ctx.moe_align(ids, 8, 4, expert_map=np.zeros((4, 4), np.int32))
    with pytest.raises(ValueError):
        ctx.moe_align(ids, 8, 4, expert_map=np.zeros(0, np.int32))
