#!/usr/bin/env python3
"""An eager MoE feed-forward layer in NumPy (float32), at examples/moe_layer's
shapes: the CPU figure set beside the example's time (bench/RESULTS.md,
"MoE layer").

    OPENBLAS_NUM_THREADS=2 python3 bench/moe_layer_numpy.py [--model M] [--tokens T] [--runs N]
    OPENBLAS_NUM_THREADS=2 python3 bench/moe_layer_numpy.py --shape T,H,I,E,K

The layer as Hugging Face's Mixtral and Qwen3-MoE write it in eager
PyTorch: router GEMM, softmax, top k, renormalise, then a loop over the
experts that gathers each expert's rows, computes SiLU(x W1g^T) * (x W1u^T)
and W2^T, and adds the weighted rows back. No padding rows (the example's
batched GEMMs compute moe_align's padding too). It prints NumPy's version
and its BLAS (with its threads: set them through the BLAS's variable), then
the median wall time of --runs layers after one warm-up. Standard library
and NumPy only; the inputs are uniform and scaled as the example's.
"""
import argparse
import statistics
import time

import numpy as np

import moe_layer_shapes


def blas_name():
    """NumPy's BLAS as its build configuration names it."""
    try:
        cfg = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return "%s %s" % (cfg.get("name", "?"), cfg.get("version", ""))
    except TypeError:  # NumPy < 1.25 has no mode=
        info = np.__config__.get_info("blas_opt_info")
        return ",".join(info.get("libraries", ["unknown"]))


def moe_layer(x, router, w1, w2, top_k):
    logits = x @ router.T
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :top_k]
    w = np.take_along_axis(p, ids, axis=1)
    w /= w.sum(axis=1, keepdims=True)
    out = np.zeros_like(x)
    inter = w2.shape[2]
    for e in range(router.shape[0]):
        tok, slot = np.nonzero(ids == e)
        if tok.size == 0:
            continue
        h = x[tok] @ w1[e].T
        gate = h[:, :inter]
        y = (gate / (1 + np.exp(-gate)) * h[:, inter:]) @ w2[e].T
        np.add.at(out, tok, y * w[tok, slot, None])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    moe_layer_shapes.add_arguments(ap)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    t, h, i, e, k = moe_layer_shapes.parse(ap, a)
    rng = np.random.default_rng(a.seed)

    def uniform(shape, scale):
        return (scale * rng.uniform(-1, 1, shape)).astype(np.float32)

    x, router = uniform((t, h), 1.0), uniform((e, h), 3 / np.sqrt(h))
    w1, w2 = uniform((e, 2 * i, h), 3 / np.sqrt(h)), uniform((e, h, i), 3 / np.sqrt(i))
    moe_layer(x, router, w1, w2, k)
    times = []
    for _ in range(a.runs):
        t0 = time.perf_counter()
        out = moe_layer(x, router, w1, w2, k)
        times.append(time.perf_counter() - t0)
    print("numpy %s, BLAS %s" % (np.__version__, blas_name()))
    print("shape T=%d H=%d I=%d E=%d K=%d: median %.3f ms of %d runs (min %.3f), checksum %.9e"
          % (t, h, i, e, k, statistics.median(times) * 1e3, a.runs, min(times) * 1e3, float(out.sum())))


if __name__ == "__main__":
    main()
