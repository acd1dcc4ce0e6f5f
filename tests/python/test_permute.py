"""permute and combine on NumPy arrays against NumPy (docs/routing.md,
"Permute and combine"): permute (the gather and, given slot_positions,
the scatter) bit for bit; combine bit for bit with the
documented float32 order, which NumPy's float32 operations follow (each
product and sum rounded, no fused multiply-add)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import moecl
import routing_ref as ref

NP = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}
DTYPES = list(NP)


def grid(test):
    """Every dtype pair at top_k 1 to 64, hidden with and without a tail of the vectors of four."""
    for mark in (pytest.mark.parametrize("out_dtype", DTYPES), pytest.mark.parametrize("in_dtype", DTYPES),
                 pytest.mark.parametrize("k,hidden", [(1, 7), (2, 64), (8, 1), (8, 129), (64, 16)])):
        test = mark(test)
    return test


def routing(rng, tokens, k, experts, block):
    """ids (about one in eight -1) and moe_align's outputs for them."""
    ids = rng.integers(0, experts, (tokens, k)).astype(np.int32)
    ids[rng.random((tokens, k)) < 0.125] = -1
    _, sorted_ids, _, post, positions, _ = ref.moe_align(ids, experts, block)
    return ids, sorted_ids.astype(np.int32), post.astype(np.int32).reshape(1), positions.astype(np.int32)


def values(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(NP[dtype])


def same_bits(got, want):
    """Equal bits, or both NaN (a converted NaN's payload is the device's)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.view(np.uint8).reshape(got.shape + (-1,)), want.view(np.uint8).reshape(want.shape + (-1,))
    differ = (g != w).any(axis=-1)
    nan = np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32))
    bad = np.argwhere(differ & ~nan)
    assert bad.size == 0, "first difference at %s: %r, want %r" % (bad[0], got[tuple(bad[0])], want[tuple(bad[0])])


def permute_ref(x, sorted_ids, post, k, out_dtype):
    tokens = x.shape[0]
    out = np.zeros((sorted_ids.size, x.shape[1]), NP[out_dtype])
    n = max(0, min(int(post[0]), sorted_ids.size))
    for p in range(n):
        s = int(sorted_ids[p])
        if 0 <= s < tokens * k:
            # through float32 to the output: NumPy and ml_dtypes round to nearest even
            out[p] = x[s // k] if x.dtype == out.dtype else x[s // k].astype(np.float32).astype(out.dtype)
    return out


def combine_ref(y, w, positions, shared, out_dtype):
    tokens, k = w.shape
    acc = np.zeros((tokens, y.shape[1]), np.float32)
    for j in range(k):
        p = positions[:, j]
        valid = (p >= 0) & (p < y.shape[0])
        rows = y[np.where(valid, p, 0)].astype(np.float32)
        prod = w[:, j:j + 1] * rows
        acc = np.where(valid[:, None], acc + prod, acc)
    if shared is not None:
        acc = acc + shared.astype(np.float32)
    return acc.astype(NP[out_dtype])


@grid
@pytest.mark.parametrize("scatter", [False, True])
def test_permute(ctx, rng, k, hidden, in_dtype, out_dtype, scatter):
    tokens, experts, block = 23, 16, 4
    _, sorted_ids, post, positions = routing(rng, tokens, k, experts, block)
    x = values(rng, (tokens, hidden), in_dtype)
    x.reshape(-1)[:3] = [np.nan, np.inf, -0.0]
    got = ctx.permute(x, sorted_ids, post, k, slot_positions=positions if scatter else None, out_dtype=out_dtype)
    same_bits(got, permute_ref(x, sorted_ids, post, k, out_dtype))


@pytest.mark.parametrize("scatter", [False, True])
def test_permute_keeps_rows_past_post(ctx, rng, scatter):
    _, sorted_ids, post, positions = routing(rng, 9, 2, 8, 8)
    x = values(rng, (9, 12), "f32")
    out = np.full((sorted_ids.size, 12), 7.0, np.float32)
    half = np.array([post[0] // 2], np.int32)
    res = ctx.permute(x, sorted_ids, half, 2, slot_positions=positions if scatter else None, out={"permuted": out})
    assert res is out
    want = permute_ref(x, sorted_ids, half, 2, "f32")
    same_bits(out[:half[0]], want[:half[0]])
    assert (out[half[0]:] == 7.0).all()


@grid
def test_combine(ctx, rng, k, hidden, in_dtype, out_dtype):
    tokens, experts, block = 23, 16, 4
    ids, sorted_ids, post, positions = routing(rng, tokens, k, experts, block)
    y = values(rng, (sorted_ids.size, hidden), in_dtype)
    w = rng.random((tokens, k)).astype(np.float32)
    shared = values(rng, (tokens, hidden), "bf16") if k % 2 == 0 else None
    got = ctx.combine(y, w, positions, shared_out=shared, out_dtype=out_dtype)
    same_bits(got, combine_ref(y, w, positions, shared, out_dtype))


def test_permute_then_combine_restores_rows(ctx, rng):
    ids, sorted_ids, post, positions = routing(rng, 40, 1, 8, 16)
    x = values(rng, (40, 33), "f32")
    rows = ctx.permute(x, sorted_ids, post, 1)
    back = ctx.combine(rows, np.ones((40, 1), np.float32), positions)
    np.testing.assert_array_equal(back, np.where(ids >= 0, x, 0.0))


def test_errors(ctx, rng):
    _, sorted_ids, post, positions = routing(rng, 4, 2, 4, 2)
    x = values(rng, (4, 8), "f32")
    with pytest.raises(moecl.InvalidArgumentError, match="top_k"):
        ctx.permute(x, sorted_ids, post, 0)
    with pytest.raises(ValueError, match="out_dtype"):
        ctx.permute(x, sorted_ids, post, 2, out_dtype="f64")
    with pytest.raises(TypeError, match="slot_positions"):
        ctx.permute(x, sorted_ids, post, 2, slot_positions=positions.astype(np.int64))
    with pytest.raises(ValueError, match="slot_positions"):
        ctx.permute(x, sorted_ids, post, 2, slot_positions=positions[:, :1].copy())
    with pytest.raises(TypeError, match="slot_positions"):
        ctx.combine(values(rng, (sorted_ids.size, 8), "f32"), np.ones((4, 2), np.float32),
                    positions.astype(np.int64))


def test_device_tensors_chained(ctx, rng):
    # moe_align, then permute and combine on pyopencl Arrays, each after the
    # one before's event: the results equal the NumPy path's.
    cla = pytest.importorskip("pyopencl.array")
    q = ctx.queue
    tokens, k, experts, hidden = 30, 4, 8, 20
    ids = rng.integers(0, experts, (tokens, k)).astype(np.int32)
    x = values(rng, (tokens, hidden), "bf16")
    w = rng.random((tokens, k)).astype(np.float32)
    align = ctx.moe_align(cla.to_device(q, ids), experts, 4)
    rows, ev = ctx.permute(cla.to_device(q, x.view(np.uint16)), align.sorted_token_ids, align.num_tokens_post_padded,
                           k, dtype="bf16", out_dtype="f32", wait_for=[align.event])
    out, ev = ctx.combine(rows, cla.to_device(q, w), align.slot_positions, out_dtype="bf16", wait_for=[ev])
    scattered, ev2 = ctx.permute(cla.to_device(q, x.view(np.uint16)), align.sorted_token_ids,
                                 align.num_tokens_post_padded, k, slot_positions=align.slot_positions, dtype="bf16",
                                 out_dtype="f32", wait_for=[align.event])
    ev.wait()
    ev2.wait()
    host = ctx.moe_align(ids, experts, 4)
    want_rows = ctx.permute(x, host.sorted_token_ids, host.num_tokens_post_padded, k, out_dtype="f32")
    n = int(host.num_tokens_post_padded[0])
    np.testing.assert_array_equal(rows.get()[:n], want_rows[:n])
    np.testing.assert_array_equal(scattered.get()[:n].view(np.uint32), want_rows[:n].view(np.uint32))
    want = combine_ref(want_rows, w, host.slot_positions, None, "bf16")
    same_bits(out.get().view(NP["bf16"]), want)
