#!/usr/bin/env python3
"""A Mixtral/Qwen3-style MoE feed-forward layer with moecl's Python package
and pyopencl, every step on the device, on one in-order queue (moecl's):

    logits = x @ router.T                   grouped_gemm_nt (one group)
    route_dispatch: softmax, top k, renormalise; moe_align's blocks
    permute: each slot's row of x in the experts' order
    h = rows @ W1[e].T per block            grouped_gemm_nt, e = block_expert_ids[block]
    g = SiLU(h[:, :I]) * h[:, I:]           silu_and_mul
    y = g @ W2[e].T per block               grouped_gemm_nt
    combine: out[t] = sum_j weight[t, j] * y[row of slot (t, j)]

The GEMMs are a small OpenCL kernel of this file that reads
block_expert_ids and num_tokens_post_padded on the device, as a runtime's
fused MoE GEMM does (vLLM's Triton kernel): nothing goes back to the host
between the router and the output, so the layer is one stream of commands
with no synchronisation. NumPy on the host between device calls would be
faster on a CPU device (its BLAS) but would read every intermediate back
and hide what a device layer looks like; the C example
(examples/moe_layer.c) runs the same layer with CLBlast's tuned GEMMs. The
kernel is plain (one work-item an output, an f32 sum in order), not tuned:
this example shows the data flow and is checked, it is not a benchmark of
GEMMs.

Run: MOECL_LIBRARY=build/src/libmoecl.so.1 PYTHONPATH=python \
         python3 examples/moe_layer.py [--tokens 64 --hidden 256 ...]
(MOECL_DEVICE=gpu or --device gpu for a GPU.) It prints the output's
checksum and the median wall time of a layer; tests/python/test_moe_layer.py
checks run_layer against the float64 model of
tests/examples/moe_layer_check.py.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any, Dict

import numpy as np
import pyopencl as cl
import pyopencl.array as cla

import moecl

KERNELS = r"""
/* c[p][col] = sum_k a[p][k] * w[e][col][k] for the rows p < *num_rows, with
 * e = group_of[p / group_rows]: every group of group_rows rows is multiplied
 * by its own matrix of w [groups][n][k]. */
__kernel void grouped_gemm_nt(__global const float *a, __global const float *w, __global float *c,
                              __global const int *group_of, __global const int *num_rows,
                              int group_rows, int n, int k)
{
    const int col = get_global_id(0), p = get_global_id(1);
    if (p >= *num_rows || col >= n)
        return;
    const int e = group_of[p / group_rows];
    __global const float *x = a + (size_t)p * k, *y = w + ((size_t)e * n + col) * k;
    float acc = 0.0f;
    for (int i = 0; i < k; i++)
        acc += x[i] * y[i];
    c[(size_t)p * n + col] = acc;
}

/* g[p][i] = SiLU(h[p][i]) * h[p][inter + i] for the rows p < *num_rows. */
__kernel void silu_and_mul(__global const float *h, __global float *g, __global const int *num_rows, int inter)
{
    const int i = get_global_id(0), p = get_global_id(1);
    if (p >= *num_rows)
        return;
    const float gate = h[(size_t)p * 2 * inter + i], up = h[(size_t)p * 2 * inter + inter + i];
    g[(size_t)p * inter + i] = gate / (1.0f + exp(-gate)) * up;
}
"""


def make_inputs(tokens: int, hidden: int, inter: int, experts: int, seed: int) -> Dict[str, np.ndarray]:
    """x [T][H], router [E][H], w1 [E][2I][H] (gate rows, then up rows),
    w2 [E][H][I]; uniform, scaled so that the logits and every GEMM's
    output have a variance near 1 (a uniform in [-s, s) has s^2 / 3)."""
    rng = np.random.default_rng(seed)

    def uniform(shape, scale):
        return (scale * rng.uniform(-1.0, 1.0, shape)).astype(np.float32)

    return {"x": uniform((tokens, hidden), 1.0),
            "router": uniform((experts, hidden), 3.0 / np.sqrt(hidden)),
            "w1": uniform((experts, 2 * inter, hidden), 3.0 / np.sqrt(hidden)),
            "w2": uniform((experts, hidden, inter), 3.0 / np.sqrt(inter))}


class MoeLayer:
    """The layer's weights on the device and its kernels; __call__ runs it."""

    def __init__(self, ctx: moecl.Context, router: np.ndarray, w1: np.ndarray, w2: np.ndarray, top_k: int,
                 block_size: int) -> None:
        self.ctx, self.queue = ctx, ctx.queue
        self.experts, self.hidden = router.shape
        self.inter = w2.shape[2]
        self.top_k, self.block = top_k, block_size
        self.router = cla.to_device(self.queue, router)
        self.w1 = cla.to_device(self.queue, w1)
        self.w2 = cla.to_device(self.queue, w2)
        with warnings.catch_warnings():  # a build log that only says "done" (Intel's CPU runtime)
            warnings.simplefilter("ignore", cl.CompilerWarning)
            prg = cl.Program(self.queue.context, KERNELS).build()
        self.gemm = prg.grouped_gemm_nt
        self.act = prg.silu_and_mul
        self.zero = cla.zeros(self.queue, 1, np.int32)  # the router GEMM's one group
        self.num_tokens: Dict[int, Any] = {}  # T as a device int32 [1], per batch size

    def _gemm(self, a: Any, w: Any, c: Any, group_of: Any, num_rows: Any, group_rows: int, rows: int, n: int,
              k: int, wait: Any) -> Any:
        return self.gemm(self.queue, (n, rows), None, a.data, w.data, c.data, group_of.data, num_rows.data,
                         np.int32(group_rows), np.int32(n), np.int32(k), wait_for=wait)

    def __call__(self, x: Any) -> Dict[str, Any]:
        """x: a pyopencl float32 Array [T][H]. Returns the device arrays
        (out, topk_ids, topk_weights, logits) once the layer is enqueued;
        their events are chained, the last is result["event"]."""
        q, T, H, I, E = self.queue, x.shape[0], self.hidden, self.inter, self.experts
        if T not in self.num_tokens:
            self.num_tokens[T] = cla.to_device(q, np.array([T], np.int32))
        tokens = self.num_tokens[T]
        logits = cla.empty(q, (T, E), np.float32)
        ev = self._gemm(x, self.router, logits, self.zero, tokens, max(T, 1), T, E, H, None)
        r = self.ctx.route_dispatch(logits, top_k=self.top_k, renormalize=True, block_size=self.block,
                                    num_invalid=False, wait_for=[ev])
        P = r.sorted_token_ids.shape[0]
        xs, ev = self.ctx.permute(x, r.sorted_token_ids, r.num_tokens_post_padded, self.top_k, wait_for=[r.event])
        # Rows past num_tokens_post_padded are not computed (the kernels
        # read it): P bounds them, the host never learns the count.
        post, blocks = r.num_tokens_post_padded, r.block_expert_ids
        h = cla.empty(q, (P, 2 * I), np.float32)
        ev = self._gemm(xs, self.w1, h, blocks, post, self.block, P, 2 * I, H, [ev])
        g = cla.empty(q, (P, I), np.float32)
        ev = self.act(q, (I, P), None, h.data, g.data, post.data, np.int32(I), wait_for=[ev])
        y = cla.empty(q, (P, H), np.float32)
        ev = self._gemm(g, self.w2, y, blocks, post, self.block, P, H, I, [ev])
        out, ev = self.ctx.combine(y, r.topk_weights, r.slot_positions, wait_for=[ev])
        return {"out": out, "topk_ids": r.topk_ids, "topk_weights": r.topk_weights, "logits": logits, "event": ev}


def run_layer(ctx: moecl.Context, inputs: Dict[str, np.ndarray], top_k: int, block_size: int) -> Dict[str, np.ndarray]:
    """One layer on inputs (make_inputs'); the outputs read back."""
    layer = MoeLayer(ctx, inputs["router"], inputs["w1"], inputs["w2"], top_k, block_size)
    res = layer(cla.to_device(ctx.queue, inputs["x"]))
    res["event"].wait()
    return {k: v.get() for k, v in res.items() if k != "event"}


def main() -> None:
    p = argparse.ArgumentParser(description="A MoE layer with moecl's routing, permute and combine.")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=3584)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default=None,
                   help="moecl's selector (default: MOECL_DEVICE, else the first GPU, else a CPU)")
    o = p.parse_args()
    inputs = make_inputs(o.tokens, o.hidden, o.inter, o.experts, o.seed)
    with moecl.Context(o.device) as ctx:
        dev = ctx.queue.device
        print("moe_layer.py: moecl %s on %s (driver %s)" % (moecl.version(), dev.name.strip(), dev.driver_version))
        print("  tokens %d, hidden %d, intermediate %d, experts %d, top %d, block %d, seed %d"
              % (o.tokens, o.hidden, o.inter, o.experts, o.top_k, o.block, o.seed))
        layer = MoeLayer(ctx, inputs["router"], inputs["w1"], inputs["w2"], o.top_k, o.block)
        x = cla.to_device(ctx.queue, inputs["x"])
        times = []
        for i in range(o.warmup + o.runs):
            t0 = time.perf_counter()
            res = layer(x)
            res["event"].wait()
            if i >= o.warmup:
                times.append(time.perf_counter() - t0)
        out = res["out"].get().astype(np.float64)
        print("output checksum: sum %.9e, sum of |out| %.9e" % (out.sum(), np.abs(out).sum()))
        print("layer time: median %.3f ms of %d runs after %d warm-up (wall)"
              % (statistics.median(times) * 1e3, o.runs, o.warmup))


if __name__ == "__main__":
    main()
