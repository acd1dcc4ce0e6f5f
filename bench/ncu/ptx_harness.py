#!/usr/bin/env python3
"""Run moecl's OpenCL kernels through the CUDA driver API, for ncu.

ncu does not see kernels launched through NVIDIA's OpenCL, but NVIDIA's
OpenCL returns PTX as the program binary, and moecl's disk cache holds
that binary with the build options it was made from (src/cache.c: magic |
key length | key | binary length | checksum | binary). This script takes
an entry from a kernel cache directory, patches the PTX so that the CUDA
driver accepts it (see patch_ptx), loads it with cuModuleLoadData, and
launches a kernel of it on PyTorch's CUDA buffers: first once, checked
against a PyTorch reference, then --iters times back to back, timed with
CUDA events. Under `ncu` every launch is one profiled kernel.

    # fill a cache with the variants of a shape (any moecl call does)
    MOECL_CACHE_DIR=/tmp/kc moecl-bench --shape 1,128,8 --only 1x128
    python3 bench/ncu/ptx_harness.py --cache /tmp/kc --list
    ncu --metrics gpu__time_duration.sum python3 bench/ncu/ptx_harness.py \\
        --cache /tmp/kc --kernel topk_gating_team --tokens 1 --iters 5

Kernels it knows how to feed: topk_gating_team and topk_gating_rows
(softmax, no bias, no counts: the arguments are gating, topk_weights,
topk_ids and the layout_topk_args record of cl/layout.h), an empty
kernel written here in PTX, the floor of a CUDA launch, and the grounded
router's GPU kernels grounded_router_mma (cl/router_mma.cl),
grounded_router_tiled and grounded_router_team (cl/grounded_router.cl,
KERNEL 2 and 1, not the ROUTE_DISPATCH variant): their arguments are
OUTPUT_PARAMS' (hidden, logits, ground, bias, pairs, weights, ids, each a
pointer and an element offset, then num_tokens, alpha,
scaling_factor), the grid and work-group size those of
src/grounded_router.c's shapes (from the entry's defines: TM, TN, MT, NT;
MMA_MI, MMA_WM, MMA_WN; TEAM, ROWS), the gating either the seed's (g =
logits + alpha * hidden @ ground^T, top-k of g, softmax over the chosen;
alpha 0.5) or DeepSeek-V3's router (no logits, alpha 1, sigmoid, bias, 8
groups keep 4, renormalised, scale 2.5). Their check is against g in
float64 with the error bound of the entry's precision: ids may differ
from the reference's only where the values they select agree within it
(near ties), weights within it too.

ep_layout_fused (cl/ep_layout.cl) is fed as moecl-bench's layout case:
--tokens x 256 experts, top 8, --ranks ranks, with the first --physical
- 256 experts doubled (a placement table) or, at --physical 256,
contiguous blocks; every output given; the kernel's __local pointer is
patched to the launch's dynamic shared memory (local_param_to_dynamic).
Its check: every output equal to the rule's (ep_reference). Its CUDA
event time back to back (36.8 us a launch at 13526 tokens, 64 ranks,
288 physical experts on the H200) is far above ncu's duration of one
launch (12.8 us) for a reason not found: read ncu's.

    # the profiled cases in one process, each launch once under ncu
    ncu --profile-from-start off --section SpeedOfLight python3 \
        bench/ncu/ptx_harness.py --cache /tmp/kc --profile-range \
        --case "--kernel grounded_router_mma --match IN_DTYPE=2 --tokens 16384" \
        --case "--kernel grounded_router_tiled --tokens 16384"

--case runs several cases in one process (one CUDA context, one ncu
session); --profile-range puts one extra launch of each case, after its
check, between cuProfilerStart and cuProfilerStop, so that ncu with
--profile-from-start off profiles exactly that launch; each case's entry is
renamed <kernel>__<label> (--label, or the case's index) so that ncu's
report names it.
"""
import argparse
import copy
import ctypes
import glob
import math
import os
import re
import shlex
import struct
import sys

MAGIC = b"MOECLBI1"

EMPTY_PTX = b""".version 7.0
.target sm_70
.address_size 64
.visible .entry moecl_empty()
{
    ret;
}
"""


def read_entry(path):
    """The (key, binary) of a moecl cache entry, or None."""
    data = open(path, "rb").read()
    if len(data) < 32 or data[:8] != MAGIC:
        return None
    (key_len,) = struct.unpack_from("<Q", data, 8)
    key = data[16:16 + key_len].decode("utf-8", "replace")
    (bin_len,) = struct.unpack_from("<Q", data, 16 + key_len)
    binary = data[16 + key_len + 16:]
    if len(binary) != bin_len:
        return None
    return key, binary


def defines_of(key):
    """The -D defines of a cache key's options line, as a dict."""
    opts = next((line[len("options "):] for line in key.splitlines() if line.startswith("options ")), "")
    return dict(re.findall(r"-D([A-Za-z0-9_]+)=(\S+)", opts))


def patch_ptx(ptx):
    """NVIDIA's OpenCL PTX as cuModuleLoadData accepts it. Returns the text
    and, per entry, the indices of its __local (.shared) pointer
    parameters."""
    text = ptx.rstrip(b"\0").decode()
    text = text.replace(", texmode_independent", "")
    text = re.sub(r"(?m)^(\s*)\.entry", r"\1.visible .entry", text)
    shared = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)", text, re.S):
        params = [p for p in m.group(2).split(",") if p.strip()]
        shared[m.group(1)] = [i for i, p in enumerate(params) if ".ptr .shared" in p]
    text = re.sub(r"\.ptr\s+\.(global|shared|const|local)\s+(\.align\s+\d+\s+)?", "", text)
    # NVIDIA's OpenCL passes the launch's shape in %envreg registers:
    # get_num_groups in %envreg6..8 (ep_layout_fused's alone() compares
    # %envreg6 with 1), the others hold offsets that are 0 for moecl's
    # launches (%envreg0 is added to %ctaid.x for get_group_id).
    text = re.sub(r"%envreg([678])\b", lambda m: "%nctaid." + "xyz"[int(m.group(1)) - 6], text)
    text = re.sub(r"%envreg\d+", "0", text)
    return text.encode() + b"\0", shared


def local_param_to_dynamic(ptx, name, index):
    """The PTX with entry `name`'s __local pointer parameter `index`
    replaced by the address of the launch's dynamic shared memory (an
    .extern .shared array): OpenCL passes that address itself, CUDA's
    launch has no such argument."""
    text = ptx.rstrip(b"\0").decode()
    text, n = re.subn(r"ld\.param\.([ub](?:32|64))\s+(%%\w+),\s*\[%s_param_%d\];" % (re.escape(name), index),
                      r"mov.\1 \2, moecl_dynamic_local;", text)
    if n == 0:
        raise SystemExit("%s: parameter %d is never loaded" % (name, index))
    text = re.sub(r"(?m)^(\.address_size \d+)$", r"\1\n.extern .shared .align 16 .b8 moecl_dynamic_local[];", text, 1)
    return text.encode() + b"\0"


def entry_params(ptx_text, name):
    """The parameter declarations of entry `name` (after patching)."""
    m = re.search(r"\.entry\s+%s\s*\((.*?)\)" % re.escape(name), ptx_text.decode(), re.S)
    return [p.strip() for p in m.group(1).split(",") if p.strip()] if m else None


def rename_entry(ptx, name, new):
    """The patched PTX with entry `name` (and its parameters' names) called
    `new`, so that ncu's report tells the cases apart."""
    return re.sub(r"\b%s(?=\b|_param_)" % re.escape(name), new, ptx.decode()).encode()


GROUNDED_KERNELS = ("grounded_router_mma", "grounded_router_tiled", "grounded_router_team")
IN_DTYPES = {"0": "float32", "1": "float16", "2": "bfloat16"}
# OUTPUT_PARAMS and the three inputs before them (cl/grounded_router.cl):
# seven pointers each with an element offset, then num_tokens, alpha and
# scaling_factor.
GROUNDED_PARAM_BITS = [64] * 14 + [32] * 3


def grounded_launch(defines, kernel, tokens):
    """(grid, block) as src/grounded_router.c's shapes launch `kernel`: a
    work-group of `block` work-items per rows_per_group tokens
    (src/plan.c)."""
    d = lambda n: int(defines[n])
    if kernel == "grounded_router_mma":
        block, rows = 32 * d("MMA_WM") * d("MMA_WN"), 16 * d("MMA_MI") * d("MMA_WM")
    elif kernel == "grounded_router_tiled":
        block, rows = (d("TM") // d("MT")) * (d("TN") // d("NT")), d("TM")
    else:
        block, rows = d("TEAM") * d("ROWS"), d("ROWS")
    return (tokens + rows - 1) // rows, block


def grounded_gating(defines):
    """'seed' (top-k of g, softmax over the chosen, router logits read),
    'dsv3' (moecl-bench's 'router dsv3': no logits, sigmoid, bias, 8
    groups keep 4 by their top-2 sums, renormalised), or None."""
    g = lambda n, default="0": defines.get(n, default)
    common = g("RENORM_FLOOR", None) is None and g("ROUTE_DISPATCH") == "0"
    if (common and g("SCORING") == "3" and g("WEIGHTING") == "1" and g("HAS_BIAS") == "0" and
            g("NUM_GROUPS") == "0" and g("RENORMALIZE") == "0" and g("HAS_LOGITS", "1") == "1"):
        return "seed"
    if (common and g("SCORING") == "1" and g("WEIGHTING") == "0" and g("HAS_BIAS") == "1" and
            g("NUM_GROUPS") == "8" and g("TOPK_GROUP") == "4" and g("GROUP_SCORE") == "1" and
            g("GROUP_FILL") == "0" and g("RENORMALIZE") == "1" and g("HAS_LOGITS", "1") == "0"):
        return "dsv3"
    return None


def grounded_rel_bound(defines):
    """docs/routing.md section 4's bound on g's error relative to alpha
    times the sum of the absolute products: gamma_{H+2} (gamma_{3H+2} at
    3xTF32: three products a step), plus r (1 + gamma) for the operands'
    TF32 rounding (r = 2^-10 + 2^-22) or the 3xTF32 split (r = (3 +
    2^-10) 2^-22); f16/bf16 products are exact in fp32 (r = 0)."""
    h, u = int(defines["HIDDEN_DIM"]), 2.0 ** -24
    precision = defines.get("PRECISION", "0") if defines.get("IN_DTYPE") == "0" else "0"
    n = 3 * h + 2 if precision == "2" else h + 2
    gamma = n * u / (1 - n * u)
    r = {"1": 2.0 ** -10 + 2.0 ** -22, "2": (3 + 2.0 ** -10) * 2.0 ** -22}.get(precision, 0.0)
    return gamma + r * (1 + gamma)


def param_bits(params):
    """The width in bits of each PTX parameter declaration."""
    return [int(re.search(r"\.param\s+\.[a-z]+?(\d+)", p).group(1)) for p in params]


def grounded_case(torch, defines, kernel, tokens, params, device="cuda"):
    """Arguments, grid, block and check of a grounded router kernel (the
    seed's gating or DeepSeek-V3's router, grounded_gating). torch: the
    module; device: where the buffers live (cuda for launches; cpu lets
    the argument building and the check be tested without a GPU)."""
    gating = grounded_gating(defines)
    if gating is None:
        raise SystemExit("%s: only the seed's gating and the DeepSeek-V3 router are fed here: %s" % (kernel, defines))
    if params is not None and param_bits(params) != GROUNDED_PARAM_BITS:
        raise SystemExit("%s: parameters %s, expected widths %s" % (kernel, params, GROUNDED_PARAM_BITS))
    h, e, k = int(defines["HIDDEN_DIM"]), int(defines["NUM_EXPERTS"]), int(defines["TOPK"])
    dtype = getattr(torch, IN_DTYPES[defines["IN_DTYPE"]])
    has = lambda n, default="0": defines.get(n, default) != "0"
    gen = torch.Generator(device=device).manual_seed(1)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
    hidden = randn(tokens, h).to(dtype)
    ground = (randn(e, h) / math.sqrt(h)).to(dtype)  # g of order one
    logits = randn(tokens, e) if has("HAS_LOGITS", "1") else None
    bias = randn(e) * 0.1 if has("HAS_BIAS") else None
    nan = lambda *shape: torch.full(shape, float("nan"), device=device)
    pairs = nan(tokens, k, 2) if has("HAS_PAIRS") else None
    weights = nan(tokens, k) if has("HAS_WEIGHTS") else None
    ids = torch.full((tokens, k), -7, device=device, dtype=torch.int32) if has("HAS_IDS") else None
    alpha, scale = (0.5, 1.0) if gating == "seed" else (1.0, 2.5)
    args = []
    for t in (hidden, logits, ground, bias, pairs, weights, ids):
        args += [ctypes.c_uint64(t.data_ptr() if t is not None else 0), ctypes.c_uint64(0)]
    args += [ctypes.c_uint32(tokens), ctypes.c_float(alpha), ctypes.c_float(scale)]
    grid, block = grounded_launch(defines, kernel, tokens)
    buffers = {"hidden": hidden, "ground": ground, "logits": logits, "bias": bias, "pairs": pairs,
               "weights": weights, "ids": ids}

    def check():
        if device == "cuda":
            torch.cuda.synchronize()
        x, w_ = hidden.double(), ground.double()
        g64 = alpha * (x @ w_.T)
        bound = abs(alpha) * grounded_rel_bound(defines) * (x.abs() @ w_.abs().T)
        del x, w_
        if logits is not None:
            g64 += logits.double()
        bound += 2.0 ** -24 * g64.abs() + (2 * h * abs(alpha) + 2) * 2.0 ** -126
        row_bound = bound.max(-1, keepdim=True).values + 1e-30
        del bound
        got_i = ids.long() if ids is not None else pairs[..., 0].round().long()
        got_w = weights if weights is not None else pairs[..., 1]
        if not ((got_i >= 0) & (got_i < e)).all():
            return False, "ids out of range (%d rows)" % int((~((got_i >= 0) & (got_i < e))).any(-1).sum())
        if (got_i.sort(-1).values.diff(dim=-1) == 0).any():
            return False, "an expert chosen twice in a row"
        if pairs is not None and ids is not None and not torch.equal(pairs[..., 0].round().long(), got_i):
            return False, "pairs' ids differ from topk_ids"
        if gating == "seed":
            sel = g64
            want_i = torch.topk(g64, k, dim=-1).indices
            chosen = g64.gather(1, got_i)
            want_w = torch.softmax(chosen, -1)
        else:
            sel = torch.sigmoid(g64) + bias.double()
            want_i = grouped_reference(torch, g64, bias, k, 8, 4, scale)[1]
            s = torch.sigmoid(g64.gather(1, got_i))
            want_w = s / s.sum(-1, keepdim=True) * scale
        # Near ties: a row may choose other experts than the reference's
        # only where the values selected agree within the bound.
        differ = (got_i.sort(-1).values != want_i.sort(-1).values).any(-1)
        gap = (sel.gather(1, got_i).sort(-1).values - sel.gather(1, want_i).sort(-1).values).abs().max(-1).values
        tie_ok = (gap <= row_bound[:, 0]) | ~differ
        w_err = (got_w.double() - want_w).abs()
        w_ok = (w_err <= 2 * scale * row_bound + 4e-6 * scale).all(-1)
        ok = bool(tie_ok.all() and w_ok.all())
        return ok, "%d rows choose other ids than the reference (%d beyond the bound %.3g), weights max error %.3g (%d rows beyond)" % (
            int(differ.sum()), int((~tie_ok).sum()), float(row_bound.max()), float(w_err.max()), int((~w_ok).sum()))

    return args, grid, block, check, buffers


class Cuda:
    device = "cuda"

    def __init__(self):
        import torch

        torch.cuda.init()
        torch.empty(1, device="cuda")  # makes the primary context current
        self.torch = torch
        self.lib = ctypes.CDLL("libcuda.so.1")

    def check(self, err, what):
        if err != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(err, ctypes.byref(msg))
            raise RuntimeError("%s failed: %d %s" % (what, err, msg.value.decode() if msg.value else ""))

    def sync(self):
        self.torch.cuda.synchronize()

    def time_launches(self, run, n):
        """Microseconds per launch of n back to back (CUDA events)."""
        start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            run()
        end.record()
        self.sync()
        return start.elapsed_time(end) * 1000.0 / max(1, n)

    def load(self, ptx):
        mod = ctypes.c_void_p()
        log = ctypes.create_string_buffer(8192)
        # CU_JIT_ERROR_LOG_BUFFER (5), CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES (6)
        opts = (ctypes.c_int * 2)(5, 6)
        vals = (ctypes.c_void_p * 2)(ctypes.cast(log, ctypes.c_void_p), ctypes.c_void_p(8192))
        err = self.lib.cuModuleLoadDataEx(ctypes.byref(mod), ctypes.c_char_p(ptx), 2, opts, vals)
        if err != 0:
            sys.stderr.write(log.value.decode(errors="replace") + "\n")
        self.check(err, "cuModuleLoadDataEx")
        return mod

    def function(self, mod, name):
        fn = ctypes.c_void_p()
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()), "cuModuleGetFunction")
        return fn

    def launch(self, fn, grid, block, shared, args):
        params = (ctypes.c_void_p * max(1, len(args)))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        self.check(self.lib.cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, shared, None, params, None), "cuLaunchKernel")


def grouped_reference(torch, x, bias, k, groups, keep, scale):
    """DeepSeek-V3's routing in float64: sigmoid, biased selection, groups
    scored by their two largest, the kept groups' top-k, the unbiased
    scores renormalised and scaled."""
    score = torch.sigmoid(x.double())
    s = score + bias.double()
    t, e = s.shape
    group_score = s.view(t, groups, e // groups).topk(2, dim=-1).values.sum(-1)
    kept = group_score.topk(keep, dim=-1).indices
    mask = torch.zeros(t, groups, dtype=torch.bool, device=x.device).scatter_(1, kept, True)
    s = s.masked_fill(~mask.repeat_interleave(e // groups, dim=1), float("-inf"))
    ids = s.topk(k, dim=-1).indices
    w = score.gather(1, ids)
    return w / w.sum(-1, keepdim=True) * scale, ids


def topk_case(cuda, defines, kernel, tokens, params):
    """Arguments, grid and check of a top-k kernel without counts: softmax
    without bias, or DeepSeek-V3's grouped sigmoid with bias (the bench's
    'topk dsv3 grouped': 8 groups keep 4, renormalised, scale 2.5)."""
    torch = cuda.torch
    e, k = int(defines["NUM_EXPERTS"]), int(defines["TOPK"])
    grouped = (defines.get("HAS_BIAS") == "1" and defines.get("SCORING") == "1" and defines.get("NUM_GROUPS") == "8"
               and defines.get("TOPK_GROUP") == "4")
    if defines.get("HAS_COUNTS", "0") != "0" or not (grouped or (defines.get("HAS_BIAS", "0") == "0" and
                                                                 defines.get("SCORING") == "0")):
        raise SystemExit("only softmax variants without bias, or the DeepSeek-V3 grouped one, are fed here")
    if len(params) != 4 + grouped:
        raise SystemExit("%s: %d parameters, expected %d: %s" % (kernel, len(params), 4 + grouped, params))
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, e, device="cuda", generator=g, dtype=torch.float32)
    bias = torch.randn(e, device="cuda", generator=g, dtype=torch.float32) * 0.1
    w = torch.full((tokens, k), float("nan"), device="cuda")
    ids = torch.full((tokens, k), -7, device="cuda", dtype=torch.int32)
    scale = 2.5 if grouped else 1.0
    record = (ctypes.c_ubyte * 48).from_buffer_copy(struct.pack("<5QIf", 0, 0, 0, 0, 0, tokens, scale))
    args = ([ctypes.c_uint64(x.data_ptr())] + ([ctypes.c_uint64(bias.data_ptr())] if grouped else []) +
            [ctypes.c_uint64(w.data_ptr()), ctypes.c_uint64(ids.data_ptr()), record])
    if kernel == "topk_gating_team":
        team, rows = int(defines["TEAM"]), int(defines["ROWS"])
        block, grid = team * rows, (tokens + rows - 1) // rows
    else:
        block = 64
        grid = (tokens + block - 1) // block

    def check():
        torch.cuda.synchronize()
        if grouped:
            want_w, want_i = grouped_reference(torch, x, bias, k, 8, 4, scale)
        else:
            want_w, want_i = torch.topk(torch.softmax(x.double(), -1), k, dim=-1)
        ok = torch.equal(ids.long(), want_i) and torch.allclose(w.double(), want_w, rtol=1e-5, atol=1e-7)
        return ok, "ids %s, weights max error %.3g" % (
            "equal" if torch.equal(ids.long(), want_i) else "DIFFER", (w.double() - want_w).abs().max().item())

    return args, grid, block, check


EP_FLAGS = {"map": 1, "table": 2, "tir": 4, "tpr": 8, "counts": 16, "may_wait": 32}


def ep_reference(torch, ids, ranks, physical, l2p, replicas, p2r):
    """Each slot's physical expert and rank by docs/routing.md section 9's
    rule (the replica by the token's multiplicative hash), R where not
    sent: for the check of ep_layout_fused's outputs."""
    t = torch.arange(ids.shape[0], dtype=torch.int64, device=ids.device)[:, None].expand_as(ids)
    h = (t * 2654435761) % 2 ** 32
    e = ids.long()
    c = replicas.long()[e]
    p = l2p.view(-1, 2).long()[e, h % c]
    return p, p2r.long()[p]


def ep_case(torch, tokens, ranks, physical, params, device="cuda"):
    """Arguments, grid, block, dynamic local bytes and check of
    ep_layout_fused (cl/ep_layout.cl) at tokens x 256 experts, top 8, on
    `ranks` ranks, with moecl-bench's replicas where physical > 256 (the
    first physical - 256 experts doubled, each replica half the ranks
    away, a placement table), every output given and the grid-wide wait
    allowed; chunks of 128 tokens (106 work-groups at 13526 tokens).
    The __local pointer's argument is 0: local_param_to_dynamic makes the
    kernel ignore it. The check: rank_counts, rank_offsets, tokens_per_rank and
    expert_counts against the rule's, send_slots grouped by rank and
    stable, physical_ids equal."""
    k, e, wg, rows, chunk = 8, 256, 256, 4, 128
    if params is not None and len(params) != 17:
        raise SystemExit("ep_layout_fused: %d parameters, expected 17: %s" % (len(params), params))
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.rand(tokens, e, generator=gen, device=device).topk(k, dim=-1).indices.int().contiguous()
    hot = physical - e
    per = e // ranks if e // ranks else 1
    x = torch.arange(e, device=device)
    replicas = torch.where(x < hot, 2, 1).int()
    l2p = torch.stack([x, torch.where(x < hot, e + x, -1)], 1).int().contiguous()
    p2r = torch.cat([(x // per) % ranks, (x[:hot] // per + ranks // 2) % ranks]).int()
    flags = sum(EP_FLAGS.values()) - (0 if hot else EP_FLAGS["map"] + EP_FLAGS["table"])
    if not hot:
        replicas, l2p = torch.ones(e, dtype=torch.int32, device=device), x.int()[:, None].repeat(1, 2).contiguous()
        p2r = (x // (physical // ranks)).int()
    groups = (tokens + chunk - 1) // chunk
    cols = 2 * ranks + 1 + physical
    mw = (ranks + 31) // 32
    lm_words = cols + rows * (wg // 32) * (ranks + 1) + 2 * (ranks + 1) + chunk * k + rows * (wg // k) * mw
    i32 = lambda n, v=-7: torch.full((n,), v, dtype=torch.int32, device=device)
    phys, send = i32(tokens * k), i32(tokens * k)
    tir = torch.full((tokens * ranks,), 7, dtype=torch.uint8, device=device)
    rank_counts, rank_offsets, tpr, counts = i32(ranks), i32(ranks + 1), i32(ranks), i32(physical)
    scratch = torch.zeros(1 + groups * cols, dtype=torch.int32, device=device)
    ptr = lambda t: ctypes.c_uint64(t.data_ptr())
    vec4 = lambda *v: (ctypes.c_uint64 * 4)(*v)
    dims = (ctypes.c_uint32 * 8)(tokens, k, e, physical, ranks, 2 if hot else 1, flags | rows << 8, chunk)
    args = [ptr(ids), ctypes.c_uint64(l2p.data_ptr() if hot else 0), ctypes.c_uint64(replicas.data_ptr() if hot else 0),
            ctypes.c_uint64(p2r.data_ptr() if hot else 0), vec4(0, 0, 0, 0), dims, ptr(phys), ptr(tir),
            ptr(rank_counts), ptr(rank_offsets), vec4(0, 0, 0, 0), ptr(send), ptr(tpr), ptr(counts), vec4(0, 0, 0, 0),
            ptr(scratch), ctypes.c_uint64(0)]

    def check():
        if device == "cuda":
            torch.cuda.synchronize()
        p, r = ep_reference(torch, ids, ranks, physical, l2p, replicas, p2r)
        if not hot:
            p, r = ids.long(), ids.long() // (physical // ranks)
        r = r.flatten()
        want_counts = torch.bincount(r, minlength=ranks)[:ranks]
        want_off = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), want_counts.cumsum(0)])
        order = torch.sort(r, stable=True).indices
        trr = torch.zeros(tokens, ranks, dtype=torch.bool, device=device)
        trr[torch.arange(tokens, device=device).repeat_interleave(k), r] = True
        bad = [n for n, ok in (
            ("physical_ids", torch.equal(phys.long(), p.flatten())),
            ("rank_counts", torch.equal(rank_counts.long(), want_counts)),
            ("rank_offsets", torch.equal(rank_offsets.long(), want_off)),
            ("send_slots", torch.equal(send.long(), order)),
            ("token_in_rank", torch.equal(tir.view(tokens, ranks).bool(), trr) and int(tir.max()) <= 1),
            ("tokens_per_rank", torch.equal(tpr.long(), trr.sum(0))),
            ("expert_counts", torch.equal(counts.long(), torch.bincount(p.flatten(), minlength=physical))),
            ("tickets", int(scratch[0]) == 0)) if not ok]
        return not bad, "every output as the rule's" if not bad else "DIFFER: " + ", ".join(bad)

    keep = {"t": (ids, l2p, replicas, p2r, phys, send, tir, rank_counts, rank_offsets, tpr, counts, scratch)}
    return args, groups, wg, lm_words * 4, check, keep


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", help="a moecl kernel cache directory (MOECL_CACHE_DIR)")
    ap.add_argument("--list", action="store_true", help="list the entries and their kernels")
    ap.add_argument("--kernel", default="topk_gating_team", help="entry to run, or 'empty'")
    ap.add_argument("--match", action="append", default=[], help="NAME=VALUE a define must have (repeatable)")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--ranks", type=int, default=64, help="ep_layout_fused: the ranks")
    ap.add_argument("--physical", type=int, default=288,
                    help="ep_layout_fused: physical experts (256: none doubled, contiguous blocks)")
    ap.add_argument("--dump", help="write the patched PTX here")
    ap.add_argument("--label", help="the case's name in the report (the entry becomes <kernel>__<label>)")
    ap.add_argument("--case", action="append", default=[],
                    help="the options of one case (--kernel, --match, --tokens, --iters, --dump, --label) as one "
                         "string; repeatable: the cases run one after the other in this process")
    ap.add_argument("--check-entries", action="store_true",
                    help="only say (exit status 0) whether every case has its cache entry; no CUDA")
    ap.add_argument("--profile-range", action="store_true",
                    help="after each case's check, one launch between cuProfilerStart and cuProfilerStop "
                         "(for ncu --profile-from-start off)")
    return ap


def select_entry(o):
    """The cache entry case o runs: (path, defines, patched PTX), the last
    in name order of those with its kernel and defines; with --list, prints
    every entry and returns None."""
    grounded = o.kernel in GROUNDED_KERNELS
    # The variants the case builders can feed, unless asked otherwise.
    want = {} if grounded or o.kernel == "ep_layout_fused" else {"HAS_BIAS": "0", "SCORING": "0"}
    if any(m.startswith("HAS_BIAS=1") for m in o.match):
        want = {}
    want.update(dict(m.split("=", 1) for m in o.match))
    chosen = []
    for path in sorted(glob.glob(os.path.join(o.cache, "*.bin"))):
        ent = read_entry(path)
        if not ent:
            continue
        key, binary = ent
        if not binary.lstrip().startswith(b"//"):
            continue  # not PTX (another vendor's binary)
        defines = defines_of(key)
        patched, shared = patch_ptx(binary)
        if o.list:
            print(os.path.basename(path), " ".join(shared), " ".join("%s=%s" % kv for kv in sorted(defines.items())))
            continue
        if (o.kernel in shared and all(defines.get(n) == v for n, v in want.items()) and
                defines.get("HAS_COUNTS", "0") == "0" and (not grounded or grounded_gating(defines))):
            chosen.append((path, defines, patched))
    if o.list:
        return None
    if not chosen:
        raise SystemExit("no cache entry with kernel %s and %s" % (o.kernel, want))
    if len(chosen) > 1 and not o.check_entries:
        print("note: %d entries match %s %s; running %s" % (len(chosen), o.kernel, want,
                                                         os.path.basename(chosen[-1][0])))
    return chosen[-1]


def prepare(cuda, o, index):
    """(run, check, label) of case o."""
    if o.kernel == "empty":
        fn = cuda.function(cuda.load(EMPTY_PTX), "moecl_empty")
        return (lambda: cuda.launch(fn, 1, 1, 0, [])), (lambda: (True, "nothing to check")), "empty (hand-written PTX)", {}
    path, defines, patched = select_entry(o)
    name = "%s__%s" % (o.kernel, re.sub(r"\W", "_", o.label or "case%d" % index))
    patched = rename_entry(patched, o.kernel, name)
    if o.kernel == "ep_layout_fused":
        patched = local_param_to_dynamic(patched, name, 16)
    if o.dump:
        open(o.dump, "wb").write(patched.rstrip(b"\0"))
    params = entry_params(patched, name)
    fn = cuda.function(cuda.load(patched), name)
    keep, shared = {}, 0
    if o.kernel in GROUNDED_KERNELS:
        args, grid, block, check, keep = grounded_case(cuda.torch, defines, o.kernel, o.tokens, params, cuda.device)
        shown = ("HIDDEN_DIM", "NUM_EXPERTS", "TOPK", "IN_DTYPE", "PRECISION", "TM", "TN", "TK", "MT", "NT", "VEC",
                 "DB", "MMA_MI", "MMA_NT", "MMA_WM", "MMA_WN", "MMA_KW", "TEAM", "ROWS")
        if o.kernel != "grounded_router_tiled":
            shown = tuple(n for n in shown if n not in ("TM", "TN", "TK", "MT", "NT", "VEC", "DB"))
    elif o.kernel == "ep_layout_fused":
        args, grid, block, shared, check, keep = ep_case(cuda.torch, o.tokens, o.ranks, o.physical, params)
        shown = ("FWG", "WARP_MATCH")
    else:
        args, grid, block, check = topk_case(cuda, defines, o.kernel, o.tokens, params)
        shown = ("NUM_EXPERTS", "TOPK", "TEAM", "ROWS")
    keep["args"] = args
    run = lambda: cuda.launch(fn, grid, block, shared, args)
    label = "%s %s grid %d block %d (%s)" % (name, " ".join("%s=%s" % (n, defines[n]) for n in shown if n in defines),
                                             grid, block, os.path.basename(path))
    return run, check, label, keep


def run_case(cuda, o, index, profile_range):
    """Runs case o: a checked launch, the profiled one, then --iters timed
    with CUDA events. Returns whether the check passed."""
    run, check, label, keep = prepare(cuda, o, index)
    run()
    ok, detail = check()
    if profile_range:
        # What the check left in PyTorch's cache need not be saved and
        # restored by ncu's replays.
        cuda.torch.cuda.empty_cache()
        cuda.sync()
        cuda.check(cuda.lib.cuProfilerStart(), "cuProfilerStart")
        run()
        cuda.sync()
        cuda.check(cuda.lib.cuProfilerStop(), "cuProfilerStop")
    for _ in range(min(10, o.iters)):
        run()
    per = cuda.time_launches(run, o.iters)
    print("%s, %d tokens: %s (%s); %.2f us per launch, %d back to back (CUDA events)" % (
        label, o.tokens, "ok" if ok else "WRONG", detail, per, o.iters), flush=True)
    del keep
    return ok


def main(argv=None):
    ap = parser()
    top = ap.parse_args(argv)
    cases = []
    for c in top.case or [None]:
        if c is None:
            cases.append(top)
            continue
        ns = copy.deepcopy(top)
        ns.case, ns.label, ns.dump = [], None, None
        cases.append(ap.parse_args(shlex.split(c), namespace=ns))
    if top.list:
        select_entry(top)
        return 0
    if top.check_entries:
        for o in cases:
            try:
                if o.kernel != "empty":
                    select_entry(o)
            except SystemExit as err:
                print(err)
                return 1
        return 0
    cuda = Cuda()
    failed = 0
    for i, o in enumerate(cases):
        try:
            failed += not run_case(cuda, o, i, top.profile_range)
        except (RuntimeError, SystemExit, KeyError, ValueError) as err:
            print("case %d (%s %s, %d tokens): FAILED: %s" % (i, o.kernel, " ".join(o.match), o.tokens, err), flush=True)
            failed += 1
        cuda.torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
