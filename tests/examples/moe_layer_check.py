#!/usr/bin/env python3
"""The MoE layer of examples/moe_layer.c and examples/moe_layer.py against
a float64 NumPy model of the same layer, within a bound derived from the
f32 error of each step (docs/moe-layer.md, "The check").

As a program: runs the C example with --dump into a temporary folder (or
reads a folder it dumped), then checks; exit status 0 when the layer
matches, 1 when it does not (the FAILED line says where), 2 for a failure
to run. With --expect-failure the status is 0 only when the example ran
and the check found the mismatch a --fault run must cause. A --fault list
(--fault offset,silu: one process, one context, a dump folder per fault)
is checked folder by folder; with --expect-failure every fault must be
caught.

As a module: check(x, router, w1, w2, ids, weights, out) returns a Report;
tests/python/test_moe_layer.py uses it for the Python example.

The bound, with u = 2^-24 and gamma_n = n u / (1 - n u) (Higham's bound
of an f32 dot product of n terms in any order, with or without fused
multiply-adds, |fl(a.b) - a.b| <= gamma_n sum |a||b|):

  router    logits = x . router^T: |logits_dev - logits| <= gamma_H sum_k
            |x_k| |r_ek| (+ H 2^-126 for products a device may flush).
  routing   against the device's logits, which the step above bounds: the
            ids must be distinct and in range, and each chosen expert must
            be able to precede every later chosen one and every expert
            left out, with each expert's log-score anywhere in logit_e +-
            d_e, d_e = |l_e - m| u + 16 u, the f32 softmax's error
            (docs/routing.md section 4: score * (|x - m| u + 8 eps),
            eps = 2u). Only near-ties within that bound may differ from
            the logits' order.
  weights   the device's renormalised weights against the float64 softmax
            of its logits over its ids: the f32 scores are within d_j
            relatively, their sum within gamma_{K-1}, the division 3 ulp
            (6u): |w_dev - w| <= w expm1(r / (1 - r)),
            r = d_j + max_S d + gamma_{K-1} + 6u.
  experts   with the device's ids and weights, for every slot:
            h = W1[e] x (f64), |h_dev - h| <= a = gamma_H |W1[e]| |x|;
            g = silu(h_gate) up: the kernel's exp (3 ulp), 1 + (u), its
            division (2.5 ulp) and the multiply (u) give a relative c_act =
            (1 + 7u)(1 + 5u)(1 + u) - 1; silu's slope is at most 1.1, so
            |g_dev - g| <= b = 1.1 a_gate (|up| + a_up) + |silu| a_up
                               + c_act (|silu| + 1.1 a_gate)(|up| + a_up);
            y = W2[e] g: |y_dev - y| <= c = |W2[e]| b + gamma_I |W2[e]| (|g| + b);
            combine (f32 from +0, slot order, each product and sum rounded):
            |out_dev - sum_j w_j y_j| <= sum_j |w_j| c_j
                                         + gamma_K sum_j |w_j| (|y_j| + c_j),
            plus (H + I + K + 4) 2^-126 for products a device may flush.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import List

import numpy as np

U = 2.0 ** -24
TINY = 2.0 ** -126
SILU_SLOPE = 1.1  # max |d silu / dx| = 1.0998... (at x = 2.3994)


def gamma(n: int) -> float:
    return n * U / (1.0 - n * U)


C_ACT = (1 + 7 * U) * (1 + 5 * U) * (1 + U) - 1


@dataclass
class Report:
    ok: bool = True
    lines: List[str] = field(default_factory=list)
    swaps: int = 0           # tokens whose ids differ from float64's where near-ties allow it
    weight_ratio: float = 0  # max |w_dev - w| / bound
    out_ratio: float = 0     # max |out_dev - out| / bound
    max_out_err: float = 0

    def fail(self, what: str) -> None:
        self.ok = False
        self.lines.append("FAILED: " + what)


def silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def check(x: np.ndarray, router: np.ndarray, w1: np.ndarray, w2: np.ndarray, logits: np.ndarray, ids: np.ndarray,
          weights: np.ndarray, out: np.ndarray) -> Report:
    """x [T][H], router [E][H], w1 [E][2I][H], w2 [E][H][I] (f32, as the
    device got them); logits f32 [T][E], ids int32 [T][K], weights f32
    [T][K], out f32 [T][H] (the device's)."""
    r = Report()
    T, H = x.shape
    E = router.shape[0]
    I = w2.shape[2]
    K = ids.shape[1]
    x64, r64 = x.astype(np.float64), router.astype(np.float64)

    # The router GEMM: the device's logits against float64's.
    logits64 = x64 @ r64.T
    eps = gamma(H) * (np.abs(x64) @ np.abs(r64).T) + H * TINY
    lerr = np.abs(logits.astype(np.float64) - logits64)
    if not np.all(lerr <= eps):
        t, e = np.argwhere(~(lerr <= eps))[0]
        r.fail("router GEMM: token %d expert %d: %.9g, float64 %.9g, bound %.3g" % (t, e, logits[t, e],
                                                                                  logits64[t, e], eps[t, e]))
        return r
    r.lines.append("router GEMM: max |logits - logits64| / bound %.3g" % float(np.max(lerr / eps)))

    # Routing: the device's ids against its logits, with the f32 softmax's
    # error alone (the logits were checked above).
    lg = logits.astype(np.float64)
    m = lg.max(axis=1, keepdims=True)
    d = np.abs(lg - m) * U + 16 * U  # a log-score's interval: logit +- d
    lo, hi = lg - d, lg + d
    if ids.min() < 0 or ids.max() >= E:
        r.fail("routing: an id outside [0, %d)" % E)
        return r
    rows = np.arange(T)[:, None]
    if np.any(np.sort(ids, axis=1)[:, 1:] == np.sort(ids, axis=1)[:, :-1]):
        r.fail("routing: a token's ids repeat")
        return r
    chosen = np.zeros((T, E), bool)
    chosen[rows, ids] = True
    hi_chosen = hi[rows, ids]                                     # [T][K]
    left_out_lo = np.where(chosen, -np.inf, lo).max(axis=1)       # best expert left out
    bad = hi_chosen < left_out_lo[:, None]
    for j in range(K - 1):  # each chosen id may precede every later one
        bad[:, j] |= hi_chosen[:, j] < lo[rows, ids[:, j + 1:]].max(axis=1)
    if bad.any():
        t, j = np.argwhere(bad)[0]
        r.fail("routing: token %d slot %d chose expert %d (logit %.9g +- %.3g) over a larger one"
               % (t, j, ids[t, j], lg[t, ids[t, j]], d[t, ids[t, j]]))
        return r
    r.swaps = int(np.sum(np.any(np.argsort(-logits64, axis=1, kind="stable")[:, :K] != ids, axis=1)))
    r.lines.append("routing: ids in the order of the device's logits%s" %
                   ("" if not r.swaps else "; %d tokens differ from float64's order at near-ties" % r.swaps))

    # Weights: the device's against the float64 softmax of its logits over its ids.
    sel = lg[rows, ids]
    w = np.exp(sel - sel.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    d_sel = d[rows, ids]
    rel = (d_sel + d_sel.max(axis=1, keepdims=True) + gamma(max(K - 1, 0)) + 6 * U)
    rel = rel / (1 - rel)
    wbound = w * np.expm1(rel) + 2 * TINY
    werr = np.abs(weights.astype(np.float64) - w)
    r.weight_ratio = float(np.nanmax(werr / wbound)) if werr.size else 0.0
    if not np.all(werr <= wbound):
        t, j = np.argwhere(~(werr <= wbound))[0]
        r.fail("weights: token %d slot %d: %.9g, float64 %.9g, bound %.3g" % (t, j, weights[t, j], w[t, j],
                                                                             wbound[t, j]))
    r.lines.append("weights: max |w - w64| / bound %.3g" % r.weight_ratio)

    # The experts, with the device's ids and weights, slot by slot.
    wd = weights.astype(np.float64)
    ref = np.zeros((T, H))
    bound = np.zeros((T, H))
    mag = np.zeros((T, H))  # sum_j |w_j| (|y_j| + c_j), for the combine's rounding
    for e in range(E):
        t, j = np.nonzero(ids == e)
        if t.size == 0:
            continue
        xe = x64[t]
        a1 = w1[e].astype(np.float64)
        h = xe @ a1.T
        a = gamma(H) * (np.abs(xe) @ np.abs(a1).T)
        hg, hu, ag, au = h[:, :I], h[:, I:], a[:, :I], a[:, I:]
        s = silu(hg)
        g = s * hu
        b = SILU_SLOPE * ag * (np.abs(hu) + au) + np.abs(s) * au + C_ACT * (np.abs(s) + SILU_SLOPE * ag) * (
            np.abs(hu) + au)
        a2 = w2[e].astype(np.float64)
        y = g @ a2.T
        c = np.abs(b) @ np.abs(a2).T + gamma(I) * ((np.abs(g) + b) @ np.abs(a2).T)
        wj = wd[t, j][:, None]
        np.add.at(ref, t, wj * y)
        np.add.at(bound, t, np.abs(wj) * c)
        np.add.at(mag, t, np.abs(wj) * (np.abs(y) + c))
    bound += gamma(K) * mag + (H + I + K + 4) * TINY
    err = np.abs(out.astype(np.float64) - ref)
    r.max_out_err = float(np.nanmax(err))
    r.out_ratio = float(np.nanmax(err / bound))
    if not np.all(err <= bound):  # NaN fails too
        t, h_ = np.argwhere(~(err <= bound))[0]
        r.fail("output: token %d column %d: %.9g, float64 model %.9g, bound %.3g (%d of %d outside)"
               % (t, h_, out[t, h_], ref[t, h_], bound[t, h_], int(np.sum(~(err <= bound))), err.size))
    r.lines.append("output: max |out - out64| %.3g, max |out - out64| / bound %.3g (bound median %.3g)"
                   % (r.max_out_err, r.out_ratio, float(np.median(bound))))
    return r


def load_dump(folder: str):
    """The C example's --dump: (x, router, w1, w2, logits, ids, weights, out)."""
    shape = {}
    with open(os.path.join(folder, "shape.txt")) as f:
        for line in f:
            k, v = line.split()
            shape[k] = int(v)
    T, H, I, E, K = (shape[k] for k in ("tokens", "hidden", "inter", "experts", "top_k"))

    def read(name, dtype, dims):
        return np.fromfile(os.path.join(folder, name), dtype=dtype).reshape(dims)

    return (read("x.f32", "<f4", (T, H)), read("router.f32", "<f4", (E, H)), read("w1.f32", "<f4", (E, 2 * I, H)),
            read("w2.f32", "<f4", (E, H, I)), read("logits.f32", "<f4", (T, E)), read("topk_ids.i32", "<i4", (T, K)),
            read("topk_weights.f32", "<f4", (T, K)), read("out.f32", "<f4", (T, H)))


def fault_list(args: List[str]) -> List[str]:
    """The faults of moe_layer's arguments (its last --fault wins), or []."""
    faults: List[str] = []
    for i, a in enumerate(args[:-1]):
        if a == "--fault":
            faults = args[i + 1].split(",")
    return faults


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", help="a folder moe_layer --dump wrote (instead of --run)")
    p.add_argument("--run", help="the moe_layer program: run it with --dump and the arguments after --")
    p.add_argument("--expect-failure", action="store_true",
                   help="exit 0 only when the example ran and the check failed (a --fault run)")
    p.add_argument("args", nargs="*", help="moe_layer's arguments (after --)")
    o = p.parse_args()
    if bool(o.dir) == bool(o.run):
        p.error("give --dir or --run")
    faults = fault_list(o.args) if o.run else []
    with tempfile.TemporaryDirectory(prefix="moe_layer.") as tmp:
        folder = o.dir
        if o.run:
            folder = os.path.join(tmp, "dump")
            proc = subprocess.run([o.run, "--dump", folder] + o.args)
            if proc.returncode == 77:
                return 77
            if proc.returncode != 0:
                print("moe_layer_check: %s exited with %d" % (o.run, proc.returncode))
                return 2
        # One run, or one folder per fault of a list.
        runs = [(f, os.path.join(folder, f)) for f in faults] if len(faults) > 1 else [("", folder)]
        reports = []
        for name, path in runs:
            if not os.path.isdir(path):
                print("moe_layer_check: %s wrote no dump for fault %s" % (o.run, name))
                return 2
            reports.append((name, check(*load_dump(path))))
    status = 0
    for name, r in reports:
        tag = "fault %s: " % name if name else ""
        for line in r.lines:
            print(tag + line)
        if o.expect_failure:
            print(tag + ("as expected, the check failed" if not r.ok else "FAILED: the check passed a faulty layer"))
        else:
            print(tag + ("ok: the layer matches the float64 model within the derived bound" if r.ok else "FAILED"))
        if r.ok == o.expect_failure:
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
