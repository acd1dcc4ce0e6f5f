"""route_dispatch and grounded_route_dispatch: the routing through to
dispatch in one call, against the two calls it stands for (bit for bit)
and against routing_ref's float64 references (docs/routing.md, sections
2, 3 and 7), on NumPy arrays and on pyopencl arrays."""

from __future__ import annotations

import numpy as np
import pytest

import moecl
import routing_ref as ref
from test_grounded_router import check_grounded, convert
from test_moe_align import FIELDS, check_align
from test_topk_gating import check_topk, make_logits

ROUTE_FIELDS = ("topk_weights", "topk_ids") + FIELDS


def assert_same(res, weights, ids, align):
    """res equals the two calls' outputs exactly."""
    np.testing.assert_array_equal(res.topk_weights, weights, err_msg="topk_weights")
    np.testing.assert_array_equal(res.topk_ids, ids, err_msg="topk_ids")
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(res, name), getattr(align, name), err_msg=name)


# Decode sizes (the one kernel where the device's class runs the team
# kernel), 0 tokens and past the one kernel's 5120 slots (641 x 8).
@pytest.mark.parametrize("tokens", [0, 1, 7, 129, 641])
@pytest.mark.parametrize("case", [dict(), dict(scoring="sigmoid", bias=True, renormalize=True, scale=2.5),
                                  dict(groups=8, topk_group=4, group_score="top2_sum", dtype="bf16")],
                         ids=lambda c: ",".join("%s=%s" % kv for kv in c.items()) or "defaults")
def test_route_dispatch(ctx, rng, tokens, case):
    experts, k, block, dtype = 128, 8, 16, case.get("dtype", "f32")
    a, x = make_logits(rng, tokens, experts, dtype)
    bias = rng.standard_normal(experts).astype(np.float32) * 0.1 if case.get("bias") else None
    opts = dict(scoring=case.get("scoring", "softmax"), bias=bias, groups=case.get("groups"),
                topk_group=case.get("topk_group"), group_score=case.get("group_score", "max"),
                renormalize=case.get("renormalize", False), scale=case.get("scale", 1.0),
                dtype="bf16" if dtype == "bf16" else None)
    res = ctx.route_dispatch(a, top_k=k, block_size=block, **opts)
    assert isinstance(res, moecl.RouteDispatchResult) and res.event is None
    w, ids = ctx.topk_gating(a, top_k=k, **opts)
    assert_same(res, w, ids, ctx.moe_align(ids, experts, block))
    check_topk(res.topk_weights, res.topk_ids, x, k, opts["scoring"],
               None if bias is None else bias.astype(np.float64), opts["groups"] or 0, opts["topk_group"] or 0,
               opts["group_score"], "neg_inf", opts["renormalize"], 0.0, opts["scale"])
    check_align(moecl.MoeAlignResult(*[getattr(res, n) for n in FIELDS], None), res.topk_ids, experts, block)
    assert res.num_invalid[0] == 0


@pytest.mark.parametrize("tokens", [0, 1, 5, 129, 2561])
@pytest.mark.parametrize("dtype,k,alpha", [("f32", 2, 1.0), ("bf16", 4, 0.25), ("f16", 1, -3.0)])
def test_grounded_route_dispatch(ctx, rng, tokens, dtype, k, alpha):
    hidden, experts, block = 128, 16, 64
    h = convert((rng.standard_normal((tokens, hidden)) / np.sqrt(hidden)).astype(np.float32), dtype)
    g = convert(rng.standard_normal((experts, hidden)).astype(np.float32), dtype)
    r = rng.standard_normal((tokens, experts)).astype(np.float32)
    opts = dict(top_k=k, alpha=alpha, dtype="bf16" if dtype == "bf16" else None)
    res = ctx.grounded_route_dispatch(h, r, g, block_size=block, **opts)
    assert res.topk_weights.shape == res.topk_ids.shape == (tokens, k)
    w, ids = ctx.grounded_router(h, r, g, **opts)
    assert_same(res, w, ids, ctx.moe_align(ids, experts, block))
    check_grounded(None, res.topk_weights, res.topk_ids, ref.widen(h, dtype), r.astype(np.float64),
                   ref.widen(g, dtype), alpha, k)
    check_align(moecl.MoeAlignResult(*[getattr(res, n) for n in FIELDS], None), res.topk_ids, experts, block)


def test_optional_outputs_and_out(ctx, rng):
    x = rng.standard_normal((9, 32)).astype(np.float32)
    res = ctx.route_dispatch(x, top_k=4, block_size=8, slot_positions=False, num_invalid=False)
    assert res.slot_positions is None and res.num_invalid is None
    want = ref.moe_align(res.topk_ids, 32, 8)
    np.testing.assert_array_equal(res.sorted_token_ids, want[1])
    ids = np.full((9, 4), -5, np.int32)
    again = ctx.route_dispatch(x, top_k=4, block_size=8, out={"topk_ids": ids})
    assert again.topk_ids is ids
    np.testing.assert_array_equal(ids, res.topk_ids)
    with pytest.raises(ValueError, match="slot_positions"):
        ctx.route_dispatch(x, top_k=4, slot_positions=False, out={"slot_positions": np.zeros((9, 4), np.int32)})


def test_invalid_arguments(ctx, rng):
    x = rng.standard_normal((3, 16)).astype(np.float32)
    with pytest.raises(moecl.InvalidArgumentError, match="block_size"):
        ctx.route_dispatch(x, top_k=2, block_size=0)
    with pytest.raises(moecl.InvalidArgumentError, match="top_k"):
        ctx.route_dispatch(x, top_k=17)
    h = rng.standard_normal((3, 8)).astype(np.float32)
    g = rng.standard_normal((16, 8)).astype(np.float32)
    with pytest.raises(moecl.InvalidArgumentError, match="block_size"):
        ctx.grounded_route_dispatch(h, x, g, block_size=1025)
    with pytest.raises(ValueError, match="ground"):
        ctx.grounded_route_dispatch(h, x, g[:15])
    with pytest.raises(TypeError):
        ctx.grounded_route_dispatch(h, x.astype(np.float64), g)


def test_device_tensors_wait_for(ctx, rng):
    cl = pytest.importorskip("pyopencl")
    cla = pytest.importorskip("pyopencl.array")
    q = ctx.queue
    tokens, hidden, experts = 33, 24, 16
    x = rng.standard_normal((tokens, experts)).astype(np.float32)
    h = rng.standard_normal((tokens, hidden)).astype(np.float32)
    g = rng.standard_normal((experts, hidden)).astype(np.float32)
    res = ctx.route_dispatch(cla.to_device(q, x), top_k=4, block_size=8)
    assert isinstance(res.event, cl.Event) and isinstance(res.sorted_token_ids, cla.Array)
    gres = ctx.grounded_route_dispatch(cla.to_device(q, h), cla.to_device(q, x), cla.to_device(q, g), top_k=2,
                                       alpha=0.5, block_size=4, wait_for=[res.event])
    gres.event.wait()
    host = [getattr(res, n).get() for n in ROUTE_FIELDS]
    assert_same(ctx.route_dispatch(x, top_k=4, block_size=8), host[0], host[1],
                moecl.MoeAlignResult(*host[2:], None))
    ghost = [getattr(gres, n).get() for n in ROUTE_FIELDS]
    assert_same(ctx.grounded_route_dispatch(h, x, g, top_k=2, alpha=0.5, block_size=4), ghost[0], ghost[1],
                moecl.MoeAlignResult(*ghost[2:], None))
    check_grounded(None, ghost[0], ghost[1], h.astype(np.float64), x.astype(np.float64), g.astype(np.float64), 0.5, 2)


@pytest.mark.parametrize("tokens", [7, 641])
def test_route_dispatch_shared_experts(ctx, rng, tokens):
    """Shared experts through to dispatch: top_k + S slots a token aligned
    over experts + S experts, exactly as topk_gating then moe_align."""
    experts, k, block, shared = 128, 8, 16, 2
    a, _ = make_logits(rng, tokens, experts, "f32")
    opts = dict(top_k=k, scoring="sigmoid", renormalize=True, scale=2.5, num_shared_experts=shared,
                shared_expert_weight=0.4)
    res = ctx.route_dispatch(a, block_size=block, **opts)
    w, ids = ctx.topk_gating(a, **opts)
    assert res.topk_ids.shape == (tokens, k + shared)
    assert_same(res, w, ids, ctx.moe_align(ids, experts + shared, block))
    check_align(moecl.MoeAlignResult(*[getattr(res, n) for n in FIELDS], None), res.topk_ids, experts + shared, block)


def local_map(rng, experts, local):
    """A global-to-local map: about half the experts local, the rest -1."""
    m = rng.integers(0, local, experts).astype(np.int32)
    m[rng.random(experts) < 0.5] = -1
    return m


def ex_check(ctx, a, x, k, block, res, n, load0, load, m, local, calls):
    """route_dispatch's ex outputs: the two calls they stand for bit for
    bit, the top-k reference on the n tokens, -1 and 0 past them, the
    alignment reference (with the map), the load added calls times."""
    tokens, experts = x.shape
    nv = np.array([n], np.int32)
    w, ids = ctx.topk_gating(a, top_k=k, num_valid_tokens=nv)
    assert_same(res, w, ids, ctx.moe_align(ids, local if m is not None else experts, block, expert_map=m))
    v = max(0, min(n, tokens))
    if v:
        check_topk(res.topk_weights[:v], res.topk_ids[:v], x[:v], k, "softmax", None, 0, 0, "max", "neg_inf", False,
                   0.0, 1.0)
    assert (res.topk_ids[v:] == -1).all() and (res.topk_weights[v:] == 0).all()
    check_align(moecl.MoeAlignResult(*[getattr(res, name) for name in FIELDS], None), res.topk_ids,
                local if m is not None else experts, block, m)
    routed = res.topk_ids[:v].ravel()
    if m is not None:
        routed = m[routed]
        routed = routed[(routed >= 0) & (routed < local)]
    np.testing.assert_array_equal(load, load0 + calls * np.bincount(routed, minlength=load0.size), err_msg="load")


# Valid counts mid-batch, 0, all and past the batch; with and without a
# map over 16 local experts; 0 tokens (the load unchanged), 7 and 129
# (the one kernel without a map where the class runs the team kernel) and
# 700 (past it).
@pytest.mark.parametrize("tokens", [0, 7, 129, 700])
@pytest.mark.parametrize("valid", ["mid", 0, "all", "past"])
@pytest.mark.parametrize("mapped", [False, True], ids=["no map", "map"])
def test_route_dispatch_ex(ctx, rng, tokens, valid, mapped):
    experts, k, block, local = 64, 8, 16, 16
    n = {"mid": tokens // 2 + 1, "all": tokens, "past": tokens + 3}.get(valid, valid)
    a, x = make_logits(rng, tokens, experts, "f32")
    m = local_map(rng, experts, local) if mapped else None
    load0 = rng.integers(0, 100, local if mapped else experts).astype(np.int32)
    load = load0.copy()
    opts = dict(top_k=k, block_size=block, num_valid_tokens=np.array([n], np.int32), expert_load=load,
                expert_map=m, num_local_experts=local if mapped else None)
    res = ctx.route_dispatch(a, **opts)
    assert res.expert_counts.shape == (local if mapped else experts,)
    ex_check(ctx, a, x, k, block, res, n, load0, load, m, local, 1)
    again = ctx.route_dispatch(a, **opts)
    ex_check(ctx, a, x, k, block, again, n, load0, load, m, local, 2)


def test_route_dispatch_ex_device(ctx, rng):
    cla = pytest.importorskip("pyopencl.array")
    q = ctx.queue
    tokens, experts, k, block, local = 40, 32, 4, 8, 8
    a, x = make_logits(rng, tokens, experts, "f32")
    m = local_map(rng, experts, local)
    for mapped in (False, True):
        load0 = rng.integers(0, 100, local if mapped else experts).astype(np.int32)
        dload = cla.to_device(q, load0)
        res = ctx.route_dispatch(cla.to_device(q, a), top_k=k, block_size=block,
                                 num_valid_tokens=cla.to_device(q, np.array([25], np.int32)), expert_load=dload,
                                 expert_map=cla.to_device(q, m) if mapped else None,
                                 num_local_experts=local if mapped else None)
        res.event.wait()
        host = moecl.RouteDispatchResult(*[getattr(res, name).get() for name in ROUTE_FIELDS], None)
        ex_check(ctx, a, x, k, block, host, 25, load0, dload.get(), m if mapped else None, local, 1)


def test_route_dispatch_ex_invalid(ctx, rng):
    x = rng.standard_normal((6, 16)).astype(np.float32)
    m = local_map(rng, 16, 4)
    with pytest.raises(ValueError, match="num_local_experts"):
        ctx.route_dispatch(x, top_k=2, expert_map=m)
    with pytest.raises(ValueError, match="num_local_experts"):
        ctx.route_dispatch(x, top_k=2, num_local_experts=4)
    with pytest.raises(ValueError, match="expert_map"):
        ctx.route_dispatch(x, top_k=2, expert_map=m[:8], num_local_experts=4)
    with pytest.raises(ValueError, match="expert_load"):
        ctx.route_dispatch(x, top_k=2, expert_map=m, num_local_experts=4, expert_load=np.zeros(16, np.int32))
    with pytest.raises(ValueError, match="num_valid_tokens"):
        ctx.route_dispatch(x, top_k=2, num_valid_tokens=np.zeros(2, np.int32))
    with pytest.raises(moecl.InvalidArgumentError, match="num_local_experts"):
        ctx.route_dispatch(x, top_k=2, expert_map=m, num_local_experts=4097)
    with pytest.raises(moecl.InvalidArgumentError, match="num_local_experts"):
        ctx.route_dispatch(x, top_k=2, expert_map=m, num_local_experts=0)


def test_route_dispatch_map_refuses_shared_experts(ctx, rng):
    """An expert map covers the routed experts: with shared experts the
    call is refused by name."""
    x = rng.standard_normal((6, 16)).astype(np.float32)
    m = local_map(rng, 16, 4)
    with pytest.raises(moecl.InvalidArgumentError, match="num_shared_experts"):
        ctx.route_dispatch(x, top_k=2, expert_map=m, num_local_experts=4, num_shared_experts=1)
