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
topk_ids and the layout_topk_args record of cl/layout.h), and an empty
kernel written here in PTX, the floor of a CUDA launch.
"""
import argparse
import ctypes
import glob
import os
import re
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
    # The global work offset lives in %envreg registers; moecl launches
    # with none.
    text = re.sub(r"%envreg\d+", "0", text)
    return text.encode() + b"\0", shared


def entry_params(ptx_text, name):
    """The parameter declarations of entry `name` (after patching)."""
    m = re.search(r"\.entry\s+%s\s*\((.*?)\)" % re.escape(name), ptx_text.decode(), re.S)
    return [p.strip() for p in m.group(1).split(",") if p.strip()] if m else None


class Cuda:
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", help="a moecl kernel cache directory (MOECL_CACHE_DIR)")
    ap.add_argument("--list", action="store_true", help="list the entries and their kernels")
    ap.add_argument("--kernel", default="topk_gating_team", help="entry to run, or 'empty'")
    ap.add_argument("--match", action="append", default=[], help="NAME=VALUE a define must have (repeatable)")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--dump", help="write the patched PTX here")
    o = ap.parse_args()
    cuda = None if o.list else Cuda()
    if o.kernel == "empty" and not o.list:
        fn = cuda.function(cuda.load(EMPTY_PTX), "moecl_empty")
        run = lambda: cuda.launch(fn, 1, 1, 0, [])
        check = lambda: (True, "nothing to check")
        label = "empty (hand-written PTX)"
    else:
        # The variants topk_case can feed, unless asked otherwise.
        want = {"HAS_BIAS": "0", "SCORING": "0"}
        if any(m.startswith("HAS_BIAS=1") for m in o.match):
            want = {}
        want.update(dict(m.split("=", 1) for m in o.match))
        chosen = None
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
                    defines.get("HAS_COUNTS", "0") == "0"):
                chosen = (path, defines, patched, shared)
        if o.list:
            return 0
        if not chosen:
            raise SystemExit("no cache entry with kernel %s and %s" % (o.kernel, want))
        path, defines, patched, shared = chosen
        if o.dump:
            open(o.dump, "wb").write(patched.rstrip(b"\0"))
        params = entry_params(patched, o.kernel)
        fn = cuda.function(cuda.load(patched), o.kernel)
        args, grid, block, check = topk_case(cuda, defines, o.kernel, o.tokens, params)
        run = lambda: cuda.launch(fn, grid, block, 0, args)
        label = "%s %s (%s)" % (o.kernel, " ".join("%s=%s" % (n, defines[n]) for n in ("NUM_EXPERTS", "TOPK", "TEAM", "ROWS") if n in defines), os.path.basename(path))
    torch = cuda.torch
    run()
    ok, detail = check()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        run()
    start.record()
    for _ in range(o.iters):
        run()
    end.record()
    torch.cuda.synchronize()
    per = start.elapsed_time(end) * 1000.0 / o.iters
    print("%s, %d tokens: %s (%s); %.2f us per launch, %d back to back (CUDA events)" % (
        label, o.tokens, "ok" if ok else "WRONG", detail, per, o.iters))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
