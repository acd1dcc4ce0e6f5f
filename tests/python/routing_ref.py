"""float64 NumPy references of the three ops, written from docs/routing.md
(not from tests/reference.c), and the checks that compare a result with
them as the spec's section 4 allows."""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

U = 2.0**-24          # unit roundoff of fp32
EPS = 2.0**-23
TAU = 2.0**-126       # flushed or subnormal results
F32_UNDERFLOW = 2.0**-150  # below this an fp32 result rounds to 0


def widen(a: np.ndarray, dtype: str) -> np.ndarray:
    """An input array as float64 (bf16 raw uint16: the upper halves of float32s)."""
    if dtype == "bf16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (round to nearest even), as uint16."""
    b = x.astype(np.float32).view(np.uint32)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return (b >> 16).astype(np.uint16)


def spec_order(v: np.ndarray) -> np.ndarray:
    """Indices of v in spec order: descending, NaN last, ties to the lower index."""
    nan = np.isnan(v)
    return np.lexsort((np.arange(v.size), -np.where(nan, 0.0, v), nan))


def softmax_scores(x: np.ndarray) -> np.ndarray:
    """Step 1, softmax, with IEEE propagation; fp32 underflow gives exact 0."""
    with np.errstate(invalid="ignore", over="ignore"):
        finite = x[~np.isnan(x)]
        m = finite.max() if finite.size else np.nan
        e = np.exp(x - m)
        s = e / e.sum()
    return np.where(np.abs(s) < F32_UNDERFLOW, 0.0, s)


def sigmoid_scores(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-x))
    return np.where(np.abs(s) < F32_UNDERFLOW, 0.0, s)


def group_scores(s: np.ndarray, groups: int, how: str) -> np.ndarray:
    out = np.empty(groups)
    for j, g in enumerate(s.reshape(groups, -1)):
        g = np.sort(g[~np.isnan(g)])[::-1]
        if g.size == 0:
            out[j] = np.nan
        elif how == "max" or g.size == 1:
            out[j] = g[0]
        else:
            with np.errstate(invalid="ignore"):
                out[j] = g[0] + g[1]
    return out


def topk_row(x: np.ndarray, k: int, scoring: str = "softmax", bias: Optional[np.ndarray] = None,
             groups: int = 0, topk_group: int = 0, group_score: str = "max", group_fill: str = "neg_inf"):
    """One row's selection: (score for the weights, selection key, eligible mask, ids)."""
    score = softmax_scores(x) if scoring == "softmax" else sigmoid_scores(x)
    with np.errstate(invalid="ignore"):
        s = score + bias if bias is not None else score.copy()
    eligible = np.ones(x.size, bool)
    if groups:
        gs = x.size // groups
        kept = spec_order(group_scores(s, groups, group_score))[:topk_group]
        dropped = np.ones(x.size, bool)
        for j in kept:
            dropped[j * gs:(j + 1) * gs] = False
        if group_fill == "neg_inf":
            eligible = ~dropped
        else:
            s = np.where(dropped, 0.0, s)
            if bias is None:
                score = np.where(dropped, 0.0, score)
    cand = np.flatnonzero(eligible)
    ids = cand[spec_order(s[cand])[:k]]
    return score, np.where(eligible, s, -np.inf), eligible, ids


def topk_weights(score: np.ndarray, ids: np.ndarray, renormalize: bool, floor: float, scale: float,
                 eps: float = 0.0) -> np.ndarray:
    """Step 5 for the given ids (eps > 0: the models' sum + eps, NaN included)."""
    w = score[ids]
    if renormalize:
        total = w.sum()
        if eps > 0:
            w = w / (total + eps)
        elif not np.isnan(total):
            if floor > 0:
                w = w / max(total, floor)
            elif total > 0:
                w = w / total
    return w * scale


def check_ids(dev_ids: np.ndarray, key: np.ndarray, eligible: np.ndarray, ref_ids: np.ndarray,
              tol: np.ndarray, what: str) -> None:
    """The device's ids of one row are distinct, in range, eligible, and rank
    as the reference's do up to the tolerance of each compared value."""
    n = key.size
    assert len(set(dev_ids.tolist())) == dev_ids.size, "%s: repeated ids %s" % (what, dev_ids)
    assert ((dev_ids >= 0) & (dev_ids < n)).all(), "%s: ids out of range %s" % (what, dev_ids)
    assert eligible[dev_ids].all(), "%s: ids %s of a dropped group" % (what, dev_ids)
    got, want = key[dev_ids], key[ref_ids]
    both_nan = np.isnan(got) & np.isnan(want)
    with np.errstate(invalid="ignore", over="ignore"):
        close = np.abs(got - want) <= tol[dev_ids] + tol[ref_ids]
    close |= both_nan | (got == want)
    assert close.all(), "%s: ids %s, reference %s (values %s vs %s)" % (what, dev_ids, ref_ids, got, want)


def check_weights(got: np.ndarray, want: np.ndarray, atol: float, what: str) -> None:
    assert (np.isnan(got) == np.isnan(want)).all(), "%s: NaN at %s, reference %s" % (what, got, want)
    ok = ~np.isnan(want)
    assert np.allclose(got[ok], want[ok], rtol=0, atol=atol), "%s: weights %s, reference %s" % (what, got, want)


def softmax_tol(x: np.ndarray, score: np.ndarray) -> np.ndarray:
    """Section 4's bound on an fp32 softmax score (plus the row sum's error)."""
    with np.errstate(invalid="ignore"):
        m = np.nanmax(x) if (~np.isnan(x)).any() else np.nan
        d = np.abs(x - m)
    d = np.where(np.isfinite(d), d, 0.0)
    p = (score * (d * U + 4 * EPS)).sum()
    rho = p + (x.size - 1) * U / (1 - (x.size - 1) * U) * (1 + p) + x.size * TAU
    sigma = rho / (1 - rho)
    return np.nan_to_num(score * (d * U + 8 * EPS) + 2 * TAU + sigma * np.abs(score))


def grounded_weights(chosen: np.ndarray) -> np.ndarray:
    """Step 3: the softmax over the chosen g, in the order given."""
    finite = chosen[~np.isnan(chosen)]
    if finite.size < chosen.size or finite.max() == np.inf or (finite == -np.inf).all():
        return np.full(chosen.size, np.nan)
    e = np.exp(chosen - finite.max())
    return e / e.sum()


def grounded_row(h: np.ndarray, r: np.ndarray, w: np.ndarray, alpha: float, k: int):
    """(g, ids, weights, tolerance of g) of one token of the grounded router."""
    with np.errstate(invalid="ignore", over="ignore"):
        g = r + alpha * (w @ h)
        ids = spec_order(g)[:k]
        weights = grounded_weights(g[ids])
        n = h.size + 2
        tol = n * U / (1 - n * U) * abs(alpha) * (np.abs(w * h).sum(axis=1)) + U * np.abs(g) \
            + (2 * h.size * abs(alpha) + 2) * TAU
    return g, ids, weights, np.nan_to_num(tol)


def moe_align(ids: np.ndarray, num_experts: int, block_size: int, expert_map=None) -> Tuple[np.ndarray, ...]:
    """Section 7: (counts, sorted_token_ids, block_expert_ids, post_padded, slot_positions, num_invalid).
    With expert_map, ids are global: mapped to local ids, -1 entries (remote) skipped and not counted."""
    flat = ids.reshape(-1).astype(np.int64)
    n = flat.size
    max_padded = n + num_experts * (block_size - 1)
    remote = np.zeros(n, bool)
    if expert_map is not None:
        g = len(expert_map)
        inside = (flat >= 0) & (flat < g)
        mapped = np.where(inside, np.asarray(expert_map, np.int64)[np.clip(flat, 0, g - 1)], -1)
        remote = inside & (mapped == -1)
        flat = np.where(inside, mapped, -1)
    valid = (flat >= 0) & (flat < num_experts)
    counts = np.bincount(flat[valid], minlength=num_experts)
    padded = -(-counts // block_size) * block_size
    start = np.concatenate(([0], np.cumsum(padded)))
    sorted_ids = np.full(max_padded, n)
    positions = np.full(n, -1)
    fill = start[:-1].copy()
    for s in range(n):
        if valid[s]:
            e = flat[s]
            sorted_ids[fill[e]] = s
            positions[s] = fill[e]
            fill[e] += 1
    total = int(start[-1])
    blocks = np.full(max_padded // block_size, -1)
    for e in range(num_experts):
        blocks[start[e] // block_size:start[e + 1] // block_size] = e
    invalid = n - valid.sum() - remote.sum()
    return counts, sorted_ids, blocks, np.array([total]), positions.reshape(ids.shape), np.array([invalid])


def ep_layout(ids: np.ndarray, num_experts: int, num_ranks: int, l2p=None, replica_counts=None, p2r=None,
              num_physical=None) -> Tuple[np.ndarray, ...]:
    """The expert-parallel layout (docs/routing.md, section 9), slot by slot."""
    tokens, k = ids.shape
    if num_physical is None:
        num_physical = len(p2r) if p2r is not None else num_experts
    phys = np.full((tokens, k), -1, np.int32)
    rank_of = np.full((tokens, k), -1, np.int64)
    for t in range(tokens):
        for j in range(k):
            e = int(ids[t, j])
            if not 0 <= e < num_experts:
                continue
            p = e
            if l2p is not None:
                c = int(replica_counts[e])
                if not 1 <= c <= l2p.shape[1]:
                    continue
                p = int(l2p[e, ((t * 2654435761) % 2**32) % c])
                if not 0 <= p < num_physical:
                    continue
            r = int(p2r[p]) if p2r is not None else p // (num_physical // num_ranks)
            if not 0 <= r < num_ranks:
                continue
            phys[t, j], rank_of[t, j] = p, r
    flat = rank_of.ravel()
    counts = np.array([(flat == r).sum() for r in range(num_ranks)], np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    send = np.full(tokens * k, -1, np.int32)
    sent = np.concatenate([np.flatnonzero(flat == r) for r in range(num_ranks)]) if num_ranks else []
    send[:len(sent)] = sent
    tir = np.zeros((tokens, num_ranks), np.uint8)
    for t in range(tokens):
        for r in rank_of[t]:
            if r >= 0:
                tir[t, r] = 1
    tpr = tir.sum(axis=0).astype(np.int32)
    ec = np.bincount(phys.ravel()[phys.ravel() >= 0], minlength=num_physical).astype(np.int32)
    return phys, counts, offsets, send, tir, tpr, ec


def shared_slots(hidden: np.ndarray, num_experts: int, num_shared: int, weight: float, scale: float,
                 gate: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, weights, tolerance) of the router's shared slots (docs/routing.md,
    section 3), [tokens, S] each: ids num_experts + j; weights the fp32
    product weight * scale (tolerance 0: exact), or with gate [S, H] (float64)
    sigmoid(hidden[t] . gate[j]), the device's f32 dot product within
    gamma_H of sum |h_i gate_ji| (sigmoid' <= 1/4) and its sigmoid within
    8 eps; an infinite dot product gives exactly 0 or 1 (tolerance 0)."""
    tokens = hidden.shape[0]
    ids = np.tile(np.arange(num_experts, num_experts + num_shared, dtype=np.int64), (tokens, 1))
    if gate is None:
        w = np.float32(weight) * np.float32(scale)
        return ids, np.full((tokens, num_shared), w, np.float64), np.zeros((tokens, num_shared))
    with np.errstate(invalid="ignore", over="ignore"):
        dot = hidden @ gate.T
        mag = np.abs(hidden) @ np.abs(gate).T
        w = 1.0 / (1.0 + np.exp(-dot))
    n = hidden.shape[1]
    tol = np.where(np.isfinite(dot), 0.25 * (n * U / (1 - n * U) * mag + 2 * n * TAU) + 8 * EPS + 2 * TAU, 0.0)
    return ids, w, np.nan_to_num(tol)
