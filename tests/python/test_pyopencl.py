"""pyopencl interop: a context adopted from pyopencl's queue, pyopencl
Arrays, Buffers and moecl.BufferViews at byte offsets as inputs and
outputs, calls that wait on their wait_for events and return one, and
the library's errors for bad device tensors."""

from __future__ import annotations

import numpy as np
import pytest

import moecl
import routing_ref as ref
from test_grounded_router import check_grounded
from test_moe_align import check_align
from test_topk_gating import check_topk

cl = pytest.importorskip("pyopencl")
cla = pytest.importorskip("pyopencl.array")

COMPLETE = cl.command_execution_status.COMPLETE


@pytest.fixture(scope="module")
def clq(ctx):
    """A pyopencl context and in-order queue of its own, on moecl's device."""
    c = cl.Context([ctx.queue.device])
    q = cl.CommandQueue(c)
    # Intel's CPU runtime invalidates a context whose last reference is
    # released even while a queue of it lives (pyopencl's queue holds none).
    q.held_context = c
    return q


@pytest.fixture(scope="module")
def adopted(clq):
    with moecl.Context.from_pyopencl(clq) as a:
        yield a


def align_on_host(res):
    """A device MoeAlignResult's arrays read back, as the NumPy path returns them."""
    return res._replace(event=None, **{f: None if getattr(res, f) is None else getattr(res, f).get()
                                       for f in res._fields[:-1]})


def read(queue, buf, shape, dtype, offset=0):
    """A buffer's bytes through queue, whatever else is pending elsewhere."""
    host = np.empty(shape, dtype)
    cl.enqueue_copy(queue, host, buf, src_offset=offset)
    return host


def test_adopted_objects(adopted, clq):
    assert adopted.queue is clq
    assert moecl.library().moecl_context_queue(adopted._ptr()) == clq.int_ptr
    assert moecl.library().moecl_context_cl_context(adopted._ptr()) == clq.context.int_ptr


def test_topk_at_offsets_waits_for_its_events(adopted, clq, rng):
    tokens, experts, k = 21, 64, 6
    x = rng.standard_normal((tokens, experts)).astype(np.float32)
    # Logits after 3 rows of garbage; outputs between poisoned guard rows.
    big = cla.to_device(clq, np.concatenate([np.full((3, experts), np.nan, np.float32), x]))
    wbig = cla.to_device(clq, np.full((tokens + 2, k), -9.0, np.float32))
    ibig = cla.to_device(clq, np.full((tokens + 2, k), -9, np.int32))
    logits, w, ids = big[3:], wbig[1:tokens + 1], ibig[1:tokens + 1]
    assert logits.offset == 3 * experts * 4 and w.offset == k * 4
    clq.finish()
    gate = cl.UserEvent(clq.context)
    rw, rids, ev = adopted.topk_gating(logits, top_k=k, renormalize=True, out={"weights": w, "ids": ids},
                                       queue=clq, wait_for=[gate])
    assert rw is w and rids is ids and isinstance(ev, cl.Event)
    # Held back by the gate: the outputs are still poisoned (read through
    # another queue, which the in-order queue's pending kernel does not block).
    side = cl.CommandQueue(clq.context)
    assert ev.command_execution_status != COMPLETE
    assert (read(side, ibig.base_data, (tokens + 2, k), np.int32) == -9).all()
    gate.set_status(COMPLETE)
    ev.wait()
    check_topk(w.get(), ids.get(), x.astype(np.float64), k, renormalize=True)
    whole = wbig.get()
    assert (whole[0] == -9).all() and (whole[-1] == -9).all() and (ibig.get()[[0, -1]] == -9).all()


def test_buffer_views_and_plain_buffers(adopted, clq, rng):
    tokens, experts, k = 9, 32, 4
    x = rng.standard_normal((tokens, experts)).astype(np.float32)
    bias = rng.standard_normal(experts).astype(np.float32)
    mf = cl.mem_flags
    pad = 256  # bytes before each tensor
    raw = cl.Buffer(clq.context, mf.READ_WRITE, pad + x.nbytes + bias.nbytes)
    cl.enqueue_copy(clq, raw, x, dst_offset=pad)
    cl.enqueue_copy(clq, raw, bias, dst_offset=pad + x.nbytes)
    wbuf = cl.Buffer(clq.context, mf.READ_WRITE, tokens * k * 4)
    ibuf = cl.Buffer(clq.context, mf.READ_WRITE, pad + tokens * k * 4)
    out = {"weights": wbuf, "ids": moecl.BufferView(ibuf, (tokens, k), np.int32, offset=pad)}
    _, _, ev = adopted.topk_gating(moecl.BufferView(raw, (tokens, experts), np.float32, offset=pad), top_k=k,
                                   bias=moecl.BufferView(raw, (experts,), np.float32, offset=pad + x.nbytes),
                                   scoring="sigmoid", out=out)
    ev.wait()
    w = read(clq, wbuf, (tokens, k), np.float32)
    ids = read(clq, ibuf, (tokens, k), np.int32, offset=pad)
    check_topk(w, ids, x.astype(np.float64), k, "sigmoid", bias.astype(np.float64))


def test_chained_ops_on_events(adopted, clq, rng):
    """top-k gating (with counts), then moe_align of its ids waiting on its
    event, then the grounded router, all without reading back in between."""
    tokens, experts, k, hidden = 40, 16, 2, 24
    x = rng.standard_normal((tokens, experts)).astype(np.float32)
    w, ids, counts, ev1 = adopted.topk_gating(cla.to_device(clq, x), top_k=k, counts=True)
    res = adopted.moe_align(ids, experts, 4, wait_for=[ev1])
    assert isinstance(res.event, cl.Event) and isinstance(res.sorted_token_ids, cla.Array)
    h = rng.standard_normal((tokens, hidden)).astype(np.float32)
    g = rng.standard_normal((experts, hidden)).astype(np.float32)
    pairs, gw, gids, ev3 = adopted.grounded_router(cla.to_device(clq, h), cla.to_device(clq, x),
                                                   cla.to_device(clq, g), top_k=3, alpha=0.5,
                                                   outputs=("pairs", "weights", "ids"), wait_for=[res.event])
    ev3.wait()
    host_ids = ids.get()
    check_topk(w.get(), host_ids, x.astype(np.float64), k)
    np.testing.assert_array_equal(counts.get(), np.bincount(host_ids.ravel(), minlength=experts))
    check_align(align_on_host(res), host_ids, experts, 4)
    check_grounded(pairs.get(), gw.get(), gids.get(), h.astype(np.float64), x.astype(np.float64),
                   g.astype(np.float64), 0.5, 3)


def test_moe_align_outputs_at_offsets(adopted, clq, rng):
    ids = rng.integers(-1, 9, (13, 3)).astype(np.int32)
    want = ref.moe_align(ids, 8, 4)
    sizes = [w.size for w in want]
    # Every output in one buffer, each at its own offset after a guard word.
    offsets = np.cumsum([4] + [4 * (n + 1) for n in sizes[:-1]])
    raw = cla.to_device(clq, np.full(int(offsets[-1]) // 4 + sizes[-1] + 1, -77, np.int32))
    names = ("expert_counts", "sorted_token_ids", "block_expert_ids", "num_tokens_post_padded", "slot_positions",
             "num_invalid")
    shapes = [w.shape for w in want]
    out = {n: moecl.BufferView(raw.base_data, s, np.int32, offset=int(o)) for n, s, o in zip(names, shapes, offsets)}
    src = cla.to_device(clq, np.concatenate([np.zeros((1, 3), np.int32), ids]))[1:]
    res = adopted.moe_align(src, 8, 4, out=out)
    res.event.wait()
    whole = raw.get()
    for name, w, o in zip(names, want, offsets):
        np.testing.assert_array_equal(whole[o // 4:o // 4 + w.size], w.ravel(), err_msg=name)
        assert whole[o // 4 - 1] == -77, "guard before %s" % name


def test_own_context_device_tensors(ctx, rng):
    # moecl's own queue, as a pyopencl queue, for arrays a Context() uses.
    q = ctx.queue
    x = rng.standard_normal((6, 32)).astype(np.float32)
    w, ids, ev = ctx.topk_gating(cla.to_device(q, x), top_k=3)
    ev.wait()
    check_topk(w.get(), ids.get(), x.astype(np.float64), 3)


def test_queue_argument_enqueues_there(ctx, clq, rng):
    # ctx has its own queue and OpenCL context; queue= runs the call on clq,
    # adopted once and kept.
    x = rng.standard_normal((5, 16)).astype(np.float32)
    for _ in range(2):
        w, ids, ev = ctx.topk_gating(cla.to_device(clq, x), top_k=4, queue=clq)
        assert ev.get_info(cl.event_info.COMMAND_QUEUE) == clq
        ev.wait()
        check_topk(w.get(), ids.get(), x.astype(np.float64), 4)
    assert list(ctx._adopted) == [clq.int_ptr]
    res = ctx.moe_align(ids, 16, 4, queue=clq, wait_for=[ev])
    assert res.event.get_info(cl.event_info.COMMAND_QUEUE) == clq
    with pytest.raises(TypeError, match="queue: expected a pyopencl.CommandQueue"):
        ctx.topk_gating(x, top_k=4, queue=clq.context)


def test_out_of_order_queue(ctx, rng):
    """On an out-of-order queue calls order themselves only through
    wait_for: moe_align waits on top-k gating's event."""
    dev = ctx.queue.device
    if not dev.queue_properties & cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE:
        pytest.skip("the device has no out-of-order queues")
    c = cl.Context([dev])
    q = cl.CommandQueue(c, properties=cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE)
    x = rng.standard_normal((300, 64)).astype(np.float32)
    with moecl.Context.from_pyopencl(q) as ooo:
        logits = cla.to_device(q, x)
        q.finish()
        gate = cl.UserEvent(c)
        w, ids, ev = ooo.topk_gating(logits, top_k=8, wait_for=[gate])
        res = ooo.moe_align(ids, 64, 16, wait_for=[ev])
        gate.set_status(COMPLETE)
        res.event.wait()
        host_ids = ids.get()
        check_topk(w.get(), host_ids, x.astype(np.float64), 8)
        check_align(align_on_host(res), host_ids, 64, 16)


def test_library_refuses_bad_device_tensors(adopted, ctx, clq):
    mf = cl.mem_flags
    small = cl.Buffer(clq.context, mf.READ_WRITE, 64)
    w = cla.to_device(clq, np.full((4, 2), 5.0, np.float32))
    ids = cla.to_device(clq, np.full((4, 2), 5, np.int32))
    out = {"weights": w, "ids": ids}
    cases = [
        (moecl.BufferView(small, (4, 8), np.float32), "gating"),           # 128 bytes in 64
        (moecl.BufferView(small, (2, 8), np.float32, offset=2), "offset"),  # misaligned
        (cla.zeros(ctx.queue, (4, 8), np.float32), "context"),             # another cl_context
    ]
    for tensor, word in cases:
        o = out if tensor.shape[0] == 4 else {}
        with pytest.raises(moecl.InvalidArgumentError) as e:
            adopted.topk_gating(tensor, top_k=2, out=o)
        assert word in e.value.message, e.value.message
    assert (w.get() == 5).all() and (ids.get() == 5).all()


def test_mixed_kinds_refused(adopted, clq):
    with pytest.raises(TypeError, match="not a mix"):
        adopted.topk_gating(cla.zeros(clq, (2, 8), np.float32), top_k=2, bias=np.zeros(8, np.float32))


def test_forget_buffers_releases_the_last_calls_buffers(rng, clq):
    """The C library keeps each kernel's last buffers (docs/api.md);
    forget_buffers drops those references, close() too."""
    tokens, experts, k = 5, 32, 4
    x = cla.to_device(clq, rng.standard_normal((tokens, experts)).astype(np.float32))
    refs = lambda a: a.base_data.get_info(cl.mem_info.REFERENCE_COUNT)
    before = refs(x)
    with moecl.Context.from_pyopencl(clq) as own:
        w, ids, ev = own.topk_gating(x, top_k=k)
        ev.wait()
        assert refs(x) == before + 1, "the context holds the gating buffer of its last call"
        own.forget_buffers()
        assert refs(x) == before
        w, ids, ev = own.topk_gating(x, top_k=k)
        ev.wait()
        check_topk(w.get(), ids.get(), x.get().astype(np.float64), k, "softmax", None)
        assert refs(x) == before + 1
    assert refs(x) == before, "close() released it"


def test_moe_align_expert_map_on_device(adopted, clq, rng):
    # Device ids and map (the map at an offset), waiting on an event.
    m = np.full(48, -1, np.int32)
    m[rng.choice(48, 12, replace=False)] = rng.permutation(12)
    ids = rng.integers(-1, 49, (40, 4)).astype(np.int32)
    dmap = cla.to_device(clq, np.concatenate([np.full(3, 5, np.int32), m]))[3:]
    ev = cl.enqueue_marker(clq)
    res = adopted.moe_align(cla.to_device(clq, ids), 12, 8, expert_map=dmap, wait_for=[ev])
    res.event.wait()
    check_align(align_on_host(res), ids, 12, 8, m)


def test_topk_padded_batch_on_device(adopted, clq, rng):
    """One call shape for any batch: num_valid_tokens is a device buffer
    the caller rewrites between calls; expert_load accumulates on the
    device."""
    tokens, experts, k = 16, 32, 4
    x = rng.standard_normal((tokens, experts)).astype(np.float32)
    w0, ids0 = adopted.topk_gating(x, top_k=k)
    g = cla.to_device(clq, x)
    nv = cla.to_device(clq, np.array([0], np.int32))
    load = cla.zeros(clq, experts, np.int32)
    total = np.zeros(experts, np.int64)
    for n in (3, 16, 9):
        nv.set(np.array([n], np.int32))
        w, ids, ev = adopted.topk_gating(g, top_k=k, num_valid_tokens=nv, expert_load=load)
        ev.wait()
        np.testing.assert_array_equal(ids.get()[:n], ids0[:n])
        np.testing.assert_array_equal(w.get()[:n], w0[:n])
        np.testing.assert_array_equal(ids.get()[n:], -1)
        total += np.bincount(ids0[:n].ravel(), minlength=experts)
        np.testing.assert_array_equal(load.get(), total)


def test_topk_capture_and_scale_on_device(adopted, clq, rng):
    """captured_ids (int16, at an offset) and expert_scale as device
    arrays: the ids captured, each weight the plain one times its scale."""
    tokens, experts, k = 16, 32, 4
    x = rng.standard_normal((tokens, experts)).astype(np.float32)
    w0, ids0 = adopted.topk_gating(x, top_k=k, renormalize=True)
    scale = rng.uniform(0.5, 2.0, experts).astype(np.float32)
    cap = cla.to_device(clq, np.full((tokens + 1) * k, 7, np.int16))[k:].reshape(tokens, k)
    w, ids, ev = adopted.topk_gating(cla.to_device(clq, x), top_k=k, renormalize=True, captured_ids=cap,
                                     expert_scale=cla.to_device(clq, scale))
    ev.wait()
    np.testing.assert_array_equal(ids.get(), ids0)
    np.testing.assert_array_equal(cap.get(), ids0)
    np.testing.assert_array_equal(w.get(), w0 * scale[ids0])


def test_topk_capture_with_shared_experts_on_device(adopted, clq, rng):
    """With shared experts the capture is [tokens, top_k], the routed slots
    (an array of exactly that size is taken, and nothing past it is
    written), while the ids' rows are top_k + S wide."""
    tokens, experts, k, shared = 9, 32, 4, 2
    x = rng.standard_normal((tokens, experts)).astype(np.float32)
    _, ids0 = adopted.topk_gating(x, top_k=k, num_shared_experts=shared)
    base = cla.to_device(clq, np.full((tokens + 1) * k, 7, np.int16))
    cap = base[:tokens * k].reshape(tokens, k)
    nv = cla.to_device(clq, np.array([6], np.int32))
    _, ids, ev = adopted.topk_gating(cla.to_device(clq, x), top_k=k, num_shared_experts=shared, captured_ids=cap,
                                     num_valid_tokens=nv)
    ev.wait()
    np.testing.assert_array_equal(ids.get()[:6], ids0[:6])
    np.testing.assert_array_equal(cap.get()[:6], ids0[:6, :k])
    np.testing.assert_array_equal(cap.get()[6:], -1)
    np.testing.assert_array_equal(base.get()[tokens * k:], 7)
