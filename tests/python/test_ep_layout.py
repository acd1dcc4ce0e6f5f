"""The expert-parallel layout on NumPy arrays against
routing_ref's reference (docs/routing.md, section 9): integers, compared
exactly."""

from __future__ import annotations

import numpy as np
import pytest

import routing_ref as ref

FIELDS = ("physical_ids", "rank_counts", "rank_offsets", "send_slots", "token_in_rank", "tokens_per_rank",
          "expert_counts")


def replicas(rng, experts, max_replicas, hot):
    """Hot experts with 1..max_replicas replicas after the logical ones."""
    l2p = np.full((experts, max_replicas), -1, np.int32)
    l2p[:, 0] = np.arange(experts)
    counts = np.ones(experts, np.int32)
    for e in range(hot):
        counts[e] = rng.integers(1, max_replicas + 1)
        for i in range(1, max_replicas):
            l2p[e, i] = experts + (i - 1) * hot + e
    return l2p, counts, experts + hot * (max_replicas - 1)


def check(res, want):
    for name, w in zip(FIELDS, want):
        got = getattr(res, name)
        if hasattr(got, "get"):
            got = got.get()
        np.testing.assert_array_equal(got, w, err_msg=name)


@pytest.mark.parametrize("tokens,k,experts,ranks", [(0, 8, 16, 4), (1, 1, 1, 1), (37, 8, 64, 8),
                                                    (200, 6, 160, 64), (9, 4, 8, 2)])
def test_identity(ctx, rng, tokens, k, experts, ranks):
    # Contiguous blocks where they divide, else a table; -1 and experts are not sent.
    ids = rng.integers(-1, experts + 1, (tokens, k)).astype(np.int32)
    p2r = None if experts % ranks == 0 else rng.integers(0, ranks, experts).astype(np.int32)
    res = ctx.ep_layout(ids, experts, ranks, physical_to_rank=p2r)
    assert res.event is None and res.token_in_rank.dtype == np.uint8
    check(res, ref.ep_layout(ids, experts, ranks, p2r=p2r))


@pytest.mark.parametrize("tokens,ranks,max_replicas", [(129, 8, 2), (300, 64, 3), (50, 3, 4)])
def test_replicas(ctx, rng, tokens, ranks, max_replicas):
    ids = rng.integers(0, 32, (tokens, 8)).astype(np.int32)
    l2p, counts, physical = replicas(rng, 32, max_replicas, 8)
    counts[3] = max_replicas + 1  # out of range: those slots are not sent
    p2r = rng.integers(-1, ranks, physical).astype(np.int32)  # -1: not sent
    res = ctx.ep_layout(ids, 32, ranks, logical_to_physical=l2p, replica_counts=counts, physical_to_rank=p2r)
    check(res, ref.ep_layout(ids, 32, ranks, l2p, counts, p2r))


def test_optional_outputs_left_out(ctx, rng):
    ids = rng.integers(0, 16, (20, 2)).astype(np.int32)
    res = ctx.ep_layout(ids, 16, 4, token_in_rank=False, tokens_per_rank=False, expert_counts=False)
    assert res.token_in_rank is None and res.tokens_per_rank is None and res.expert_counts is None
    np.testing.assert_array_equal(res.send_slots, ref.ep_layout(ids, 16, 4)[3])


def test_bad_input(ctx, rng):
    import moecl
    ids = np.zeros((4, 2), np.int32)
    with pytest.raises(moecl.InvalidArgumentError, match="multiple of num_ranks"):
        ctx.ep_layout(ids, 10, 4)
    l2p, counts, physical = replicas(rng, 8, 2, 2)
    with pytest.raises(moecl.InvalidArgumentError, match="replica_counts"):
        ctx.ep_layout(ids, 8, 2, logical_to_physical=l2p, num_physical=physical)

