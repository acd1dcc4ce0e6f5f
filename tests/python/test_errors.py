"""Bad input: what the library refuses raises moecl.Error with its message
and changes no output; what only Python can see (a NumPy array's dtype,
shape and layout) is refused before any C call."""

from __future__ import annotations

import numpy as np
import pytest

import moecl


class Recorder:
    """Stands for the loaded library and records every C function called."""

    def __init__(self, lib):
        self.lib, self.calls = lib, []

    def __getattr__(self, name):
        fn = getattr(self.lib, name)

        def call(*args):
            self.calls.append(name)
            return fn(*args)
        return call


@pytest.fixture
def recorded(ctx):
    real = ctx._lib
    ctx._lib = Recorder(real)
    yield ctx._lib
    ctx._lib = real


X = np.zeros((3, 16), np.float32)
H, R, G = np.zeros((2, 4), np.float32), np.zeros((2, 8), np.float32), np.zeros((8, 4), np.float32)
I = np.zeros((2, 2), np.int32)

LIBRARY_REFUSES = [
    (lambda c, o: c.topk_gating(X, top_k=0), "top_k is 0; it must be in 1..16"),
    (lambda c, o: c.topk_gating(X, top_k=17), "top_k is 17"),
    (lambda c, o: c.topk_gating(X, top_k=4, groups=3, topk_group=1, out=o), "num_expert_groups is 3"),
    (lambda c, o: c.topk_gating(X, top_k=4, groups=4, out=o), "topk_group is 0"),
    (lambda c, o: c.topk_gating(X, top_k=4, groups=4, topk_group=5, out=o), "topk_group is 5"),
    (lambda c, o: c.topk_gating(X, top_k=12, groups=4, topk_group=2), "top_k is 12 but the 2 kept groups"),
    (lambda c, o: c.topk_gating(X, top_k=4, scale=float("inf"), out=o), "routed_scaling_factor is inf"),
    (lambda c, o: c.topk_gating(X, top_k=4, scale=float("nan"), out=o), "routed_scaling_factor is nan"),
    (lambda c, o: c.topk_gating(X, top_k=4, renormalize_floor=1e-40, out=o), "renormalize_floor is"),
    (lambda c, o: c.topk_gating(X, top_k=4, renormalize_floor=-1.0, out=o), "renormalize_floor is"),
    (lambda c, o: c.topk_gating(np.zeros((1, 5000), np.float32), top_k=4), "num_experts is 5000"),
    (lambda c, o: c.topk_gating(np.zeros((1, 0), np.float32), top_k=1), "num_experts is 0"),
    (lambda c, o: c.grounded_router(H, R, G, alpha=float("nan")), "alpha is nan"),
    (lambda c, o: c.grounded_router(H, R, G, top_k=9), "top_k is 9"),
    (lambda c, o: c.grounded_router(H, R, G, outputs=()), "at least one output is needed"),
    (lambda c, o: c.grounded_router(np.zeros((2, 0), np.float32), R, np.zeros((8, 0), np.float32)), "hidden_dim is 0"),
    (lambda c, o: c.moe_align(I, 0, 4), "num_experts is 0"),
    (lambda c, o: c.moe_align(I, 4097, 4), "num_experts is 4097"),
    (lambda c, o: c.moe_align(I, 4, 0), "block_size is 0"),
    (lambda c, o: c.moe_align(I, 4, 2000), "block_size is 2000"),
    (lambda c, o: c.moe_align(np.zeros((2, 65), np.int32), 4, 2), "top_k is 65"),
]


@pytest.mark.parametrize("call,message", LIBRARY_REFUSES, ids=[m for _, m in LIBRARY_REFUSES])
def test_library_refuses_with_its_message(ctx, call, message):
    out = {"weights": np.full((3, 4), 7.0, np.float32), "ids": np.full((3, 4), 7, np.int32)}
    try:
        call(ctx, out)
    except moecl.InvalidArgumentError as e:
        err = e
    else:
        pytest.fail("no error")
    assert message in str(err) and message in err.message
    assert err.status == -2000 and err.status_string == "invalid argument"
    assert isinstance(err, ValueError)
    # Nothing was written (the cases of 3 x 4 outputs pass out).
    assert (out["weights"] == 7).all() and (out["ids"] == 7).all()


def test_out_of_range_top_k_is_validated_before_outputs_are_allocated(ctx):
    with pytest.raises(moecl.InvalidArgumentError, match="top_k is 4000000000"):
        ctx.topk_gating(X, top_k=4_000_000_000)


def test_no_device(ctx):
    with pytest.raises(moecl.NoDeviceError, match='no OpenCL device matches the selector "no such device"') as e:
        moecl.Context("no such device")
    assert e.value.status == -2002


def w_ids(t=3, k=4):
    return np.full((t, k), np.nan, np.float32), np.full((t, k), -5, np.int32)


PYTHON_REFUSES = [
    (lambda c, w, i: c.topk_gating(X.astype(np.float64), top_k=4, out={"weights": w, "ids": i}),
     TypeError, "logits: dtype float64, expected float32 or float16"),
    (lambda c, w, i: c.topk_gating(X.astype(np.int32), top_k=4, out={"weights": w, "ids": i}),
     TypeError, "logits: dtype int32"),
    (lambda c, w, i: c.topk_gating(X.astype(np.uint16), top_k=4, out={"weights": w, "ids": i}),
     TypeError, "logits: dtype uint16"),
    (lambda c, w, i: c.topk_gating(X, top_k=4, dtype="f16", out={"weights": w, "ids": i}),
     TypeError, "expected float16"),
    (lambda c, w, i: c.topk_gating(X[0], top_k=4, out={"weights": w, "ids": i}), ValueError, "logits: shape (16,)"),
    (lambda c, w, i: c.topk_gating(X[None], top_k=4, out={"weights": w, "ids": i}), ValueError, "logits: shape"),
    (lambda c, w, i: c.topk_gating(np.zeros((16, 3), np.float32).T, top_k=4, out={"weights": w, "ids": i}),
     ValueError, "logits: not C-contiguous"),
    (lambda c, w, i: c.topk_gating(X, top_k=4, bias=np.zeros(15, np.float32), out={"weights": w, "ids": i}),
     ValueError, "bias: shape (15,), expected (16,)"),
    (lambda c, w, i: c.topk_gating(X, top_k=4, bias=np.zeros(16, np.float64), out={"weights": w, "ids": i}),
     TypeError, "bias: dtype float64"),
    (lambda c, w, i: c.topk_gating(X, top_k=4, bias=np.zeros(16, np.float16), bias_dtype="f32",
                                   out={"weights": w, "ids": i}), TypeError, "bias: dtype float16"),
    (lambda c, w, i: c.topk_gating(X, top_k=4, weights_dtype="bf16", out={"weights": w, "ids": i}), TypeError,
     "out['weights']: dtype float32"),
    (lambda c, w, i: c.topk_gating(X, top_k=4, out={"weights": w[:2], "ids": i}), ValueError,
     "out['weights']: shape (2, 4), expected (3, 4)"),
    (lambda c, w, i: c.topk_gating(X, top_k=4, out={"weights": w, "ids": i.astype(np.int64)}), TypeError,
     "out['ids']: dtype int64"),
    (lambda c, w, i: c.topk_gating(X.tolist(), top_k=4, out={"weights": w, "ids": i}), TypeError,
     "not list"),
    (lambda c, w, i: c.topk_gating(X, top_k=-1, out={"weights": w, "ids": i}), ValueError, "top_k must be in"),
    (lambda c, w, i: c.topk_gating(X, top_k=4.0, out={"weights": w, "ids": i}), TypeError, "top_k must be an int"),
    (lambda c, w, i: c.topk_gating(X, top_k=4, scoring="softmx", out={"weights": w, "ids": i}), ValueError,
     "scoring must be one of"),
    (lambda c, w, i: c.topk_gating(X, top_k=4, group_fill="0", out={"weights": w, "ids": i}), ValueError,
     "group_fill must be one of"),
    (lambda c, w, i: c.topk_gating(X, top_k=4, out={"weights": w, "ids": i, "count": i}), ValueError,
     "unknown output"),
    (lambda c, w, i: c.grounded_router(H, R, G.astype(np.float16), out={"weights": w[:2, :2]}), TypeError,
     "ground: dtype float16, expected float32"),
    (lambda c, w, i: c.grounded_router(H, np.zeros((2, 7), np.float32), G, out={"weights": w[:2, :2]}), ValueError,
     "ground: shape (8, 4), expected (7, 4)"),
    (lambda c, w, i: c.grounded_router(H, R[:1], G, out={"weights": w[:2, :2]}), ValueError,
     "router_logits: shape (1, 8), expected (2, *)"),
    (lambda c, w, i: c.grounded_router(H, R, G, outputs=("pair",)), ValueError, "outputs: 'pair'"),
    (lambda c, w, i: c.moe_align(I.astype(np.int64), 4, 2), TypeError, "topk_ids: dtype int64"),
    (lambda c, w, i: c.moe_align(I.ravel(), 4, 2), ValueError, "topk_ids: shape (4,)"),
    (lambda c, w, i: c.moe_align(I, 4, 2, out={"sorted_token_ids": np.zeros(9, np.int32)}), ValueError,
     "out['sorted_token_ids']: shape (9,), expected (8,)"),
    (lambda c, w, i: c.topk_gating(X, top_k=4, wait_for=[object()], out={"weights": w, "ids": i}), ValueError,
     "wait_for: NumPy calls block"),
]


@pytest.mark.parametrize("call,exc,message", PYTHON_REFUSES, ids=[m for _, _, m in PYTHON_REFUSES])
def test_refused_before_anything_runs(ctx, recorded, call, exc, message):
    w, i = w_ids()
    with pytest.raises(exc) as e:
        call(ctx, w, i)
    assert message in str(e.value)
    assert recorded.calls == []
    assert np.isnan(w).all() and (i == -5).all()


def test_read_only_output_refused(ctx, recorded):
    w, i = w_ids()
    w.flags.writeable = False
    with pytest.raises(ValueError, match=r"out\['weights'\]: read-only"):
        ctx.topk_gating(X, top_k=4, out={"weights": w, "ids": i})
    assert recorded.calls == [] and (i == -5).all()


def test_closed_context(ctx):
    c = moecl.Context()
    c.close()
    with pytest.raises(ValueError, match="closed"):
        c.topk_gating(X, top_k=4)
