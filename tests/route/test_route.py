#!/usr/bin/env python3
"""The route suite: moecl-route on .npy files, judged by route-check.

Each case writes random .npy inputs (by hand with struct: the tests need no
NumPy), runs moecl-route, and has route-check compare the outputs with the
float64 reference (tests/reference.c). This script checks the outputs'
headers itself too (an independent reader), and that failures exit 1 with a
message naming the file and leave no output file behind.

    test_route.py --route BUILD/tools/moecl-route --check BUILD/tests/route/route-check --case NAME
    test_route.py --list
"""

import argparse
import ast
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile

# ---- .npy by hand ----


def npy_bytes(descr, shape, payload, version=(1, 0), fortran=False, pad_to=64):
    dims = ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "")
    d = "{'descr': '%s', 'fortran_order': %s, 'shape': (%s), }" % (descr, fortran, dims)
    pre = 10 if version[0] == 1 else 12
    total = -(-(pre + len(d) + 1) // pad_to) * pad_to
    header = (d + " " * (total - pre - len(d) - 1) + "\n").encode("latin1")
    size = struct.pack("<H", len(header)) if version[0] == 1 else struct.pack("<I", len(header))
    return b"\x93NUMPY" + bytes(version) + size + header + payload


def f32_bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def encode(values, dtype):
    """values (floats) as little-endian f32, f16 or bf16 (upper half of f32,
    round to nearest even)."""
    if dtype == "f32":
        return struct.pack("<%df" % len(values), *values)
    if dtype == "f16":
        return struct.pack("<%de" % len(values), *values)
    out = []
    for v in values:
        b = f32_bits(v)
        out.append(((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF)
    return struct.pack("<%dH" % len(out), *out)


DESCR = {"f32": "<f4", "f16": "<f2", "bf16-u2": "<u2", "bf16-v2": "|V2"}


def write_npy(path, values, shape, dtype="f32", **kw):
    enc = "bf16" if dtype.startswith("bf16") else dtype
    with open(path, "wb") as f:
        f.write(npy_bytes(DESCR[dtype], shape, encode(values, enc), **kw))
    return path


def read_npy(path):
    """An independent reader: (descr, shape, fortran, payload bytes)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:6] == b"\x93NUMPY", path + ": bad magic"
    if data[6] == 1:
        (hlen,) = struct.unpack("<H", data[8:10])
        start = 10
    else:
        (hlen,) = struct.unpack("<I", data[8:12])
        start = 12
    header = ast.literal_eval(data[start:start + hlen].decode("latin1"))
    assert (start + hlen) % 64 == 0, path + ": header not padded to 64 bytes"
    return header["descr"], tuple(header["shape"]), header["fortran_order"], data[start + hlen:]


def randn(rng, n, scale=1.0):
    return [rng.gauss(0.0, scale) for _ in range(n)]


def write_ids(path, ids, shape, descr="<i4"):
    with open(path, "wb") as f:
        f.write(npy_bytes(descr, shape, struct.pack("<%d%s" % (len(ids), "i" if descr == "<i4" else "f"), *ids)))
    return path


# The routing's outputs, then moe_align's (the dispatch outputs).
ROUTED = ("weights", "ids", "pairs")
DISPATCH = ("expert-counts", "sorted-token-ids", "block-expert-ids", "slot-positions", "post-padded")


def want_header(out, tokens, k, experts, block):
    """The dtype and shape moecl-route must write for an output."""
    if out in ROUTED:
        return ("<i4" if out == "ids" else "<f4"), ((tokens, k, 2) if out == "pairs" else (tokens, k))
    max_padded = tokens * k + experts * (block - 1)
    return "<i4", {"expert-counts": (experts,), "sorted-token-ids": (max_padded,),
                   "block-expert-ids": (max_padded // block,), "slot-positions": (tokens, k),
                   "post-padded": (1,)}[out]


def option_value(argv, flag, default):
    return int(argv[argv.index(flag) + 1]) if flag in argv else default


# ---- running ----


class Failure(Exception):
    pass


class Ctx:
    def __init__(self, args, work):
        self.route = args.route
        self.check = args.check
        self.work = work
        self.rng = random.Random(args.seed)

    def path(self, name):
        return os.path.join(self.work, name)

    def run(self, exe, argv, want_rc=0, label=""):
        p = subprocess.run([exe] + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        print("$ %s %s  -> %d" % (os.path.basename(exe), " ".join(argv), p.returncode))
        if p.stdout:
            print(p.stdout.rstrip())
        if p.stderr:
            print("[stderr] " + p.stderr.rstrip())
        if p.returncode != want_rc:
            raise Failure("%s: exit status %d, want %d" % (label or os.path.basename(exe), p.returncode, want_rc))
        return p

    def route_and_check(self, argv, k, tokens, outputs=ROUTED, experts=None):
        """Runs moecl-route with argv plus the outputs, checks their headers,
        then route-check. With moe_align (a dispatch output, --block-size or
        --op align; experts then says the expert count), route-check also
        gets the summary's num_tokens_post_padded and num_invalid. Returns
        the output paths and moecl-route's run, with p.summary the
        summary's (num_tokens_post_padded, num_invalid) or None."""
        outs = {}
        extra = []
        tag = "%d" % self.rng.randrange(1 << 30)
        for o in outputs:
            outs[o] = self.path("out-%s-%s.npy" % (o, tag))
            extra += ["--" + o, outs[o]]
        p = self.run(self.route, argv + extra)
        block = option_value(argv, "--block-size", 64)
        for o, path in outs.items():
            descr, shape, fortran, payload = read_npy(path)
            want = want_header(o, tokens, k, experts, block)
            if (descr, shape) != want or fortran:
                raise Failure("%s: header %r %r %r, want %r" % (path, descr, shape, fortran, want))
            n = 1
            for s in shape:
                n *= s
            if len(payload) != 4 * n:
                raise Failure("%s: %d bytes of data, want %d" % (path, len(payload), 4 * n))
        p.summary = dispatch_summary(p.stdout, "--json" in argv)
        dispatch = p.summary is not None
        if dispatch != ("--block-size" in argv or "align" in argv or any(o in DISPATCH for o in outputs)):
            raise Failure("the summary %s moe_align's results" % ("has" if dispatch else "lacks"))
        if dispatch:
            extra += ["--summary-post-padded", str(p.summary[0]), "--summary-invalid", str(p.summary[1])]
            if "post-padded" in outs and struct.unpack("<i", read_npy(outs["post-padded"])[3])[0] != p.summary[0]:
                raise Failure("the summary's num_tokens_post_padded is not the one in %s" % outs["post-padded"])
        self.run(self.check, [a for a in argv if a not in ("--progress", "--json")] + ["--top-k", str(k)] + extra,
                 label="route-check")
        self.no_temporaries()
        return outs, p

    def no_temporaries(self):
        left = [f for f in os.listdir(self.work) if ".tmp-" in f]
        if left:
            raise Failure("temporary files left behind: %s" % left)

    def expect_failure(self, argv, names, rc=1, outputs=True):
        """moecl-route must exit rc, name one of `names` in its message, and
        leave no output (or temporary) file in a fresh output folder.
        outputs: True for the routing's three, else a list of names."""
        outdir = self.path("outs-%d" % self.rng.randrange(1 << 30))
        os.mkdir(outdir)
        outs = []
        for o in (ROUTED if outputs is True else outputs or ()):
            outs += ["--" + o, os.path.join(outdir, o + ".npy")]
        p = self.run(self.route, argv + outs, want_rc=rc)
        if not any(n in p.stderr for n in names):
            raise Failure("the message does not name %s: %r" % (" or ".join(names), p.stderr))
        if os.listdir(outdir):
            raise Failure("files left behind: %s" % os.listdir(outdir))
        return p


def dispatch_summary(stdout, json_summary):
    """(num_tokens_post_padded, num_invalid) from the summary, or None
    when it reports no moe_align."""
    if json_summary:
        s = json.loads(stdout)
        if s["num_tokens_post_padded"] is None:
            return None
        return s["num_tokens_post_padded"], s["num_invalid"]
    m = re.search(r"^dispatch \(moe_align, block size \d+\): num_tokens_post_padded (\d+) of max_padded \d+ "
                  r"\(\d+ of \d+ blocks used\), num_invalid (\d+)$", stdout, re.M)
    return (int(m.group(1)), int(m.group(2))) if m else None


# ---- cases ----


def logits_file(c, name, tokens, experts, dtype="f32", **kw):
    return write_npy(c.path(name), randn(c.rng, tokens * experts), (tokens, experts), dtype, **kw)


def case_topk_grouped(c):
    """DeepSeek-V3 routing: sigmoid, bias, 8 groups keeping 4 by top-2 sum,
    renormalised, scaled; all three outputs."""
    t, e, k = 700, 64, 8
    lg = logits_file(c, "logits.npy", t, e)
    bias = write_npy(c.path("bias.npy"), randn(c.rng, e, 0.05), (e,))
    c.route_and_check([lg, "--bias", bias, "--groups", "8", "--topk-group", "4", "--group-score", "top2sum",
                       "--scoring", "sigmoid", "--renormalize", "--scale", "2.5", "--top-k", str(k)], k, t)


def case_topk_softmax_groups_max(c):
    """Softmax with the seed's max group score, renormalised, a negative scale."""
    t, e, k = 300, 96, 6
    lg = logits_file(c, "logits.npy", t, e)
    bias = write_npy(c.path("bias.npy"), randn(c.rng, e, 0.01), (e,))
    c.route_and_check([lg, "--bias", bias, "--groups", "8", "--topk-group", "3", "--group-score", "max",
                       "--renormalize", "--scale", "-1.5", "--top-k", str(k)], k, t)


def case_topk_conventions(c):
    """The peers' conventions: the seed's zero fill of dropped groups with a
    bias wide enough that kept experts select below 0 (so the fill shows on
    ordinary rows), llama.cpp's renormalisation floor on sigmoid logits
    around -14 (chosen sums on both sides of 2^-14) and LFM2's epsilon
    (1e-6) on the same; --json reports them."""
    t, e, k = 300, 64, 6
    lg = write_npy(c.path("logits.npy"), [x - 14.0 for x in randn(c.rng, t * e)], (t, e))
    bias = write_npy(c.path("bias.npy"), randn(c.rng, e, 0.5), (e,))
    c.route_and_check([lg, "--bias", bias, "--groups", "8", "--topk-group", "3", "--group-fill", "zero",
                       "--scoring", "sigmoid", "--top-k", str(k)], k, t)
    c.route_and_check([lg, "--scoring", "sigmoid", "--renormalize", "--renormalize-floor", "6.103515625e-5",
                       "--top-k", str(k)], k, t)
    outs, p = c.route_and_check([lg, "--groups", "8", "--topk-group", "3", "--group-fill", "zero", "--renormalize",
                                 "--renormalize-floor", "6.103515625e-5", "--top-k", str(k), "--json"], k, t,
                                outputs=("weights", "ids"))
    s = json.loads(p.stdout)
    if s["group_fill"] != "zero" or abs(s["renormalize_floor"] - 6.103515625e-5) > 1e-12:
        raise Failure("JSON summary does not report the fill and the floor: %r" % s)
    _, p = c.route_and_check([lg, "--scoring", "sigmoid", "--renormalize", "--renormalize-eps", "1e-6",
                              "--top-k", str(k), "--json"], k, t)
    s = json.loads(p.stdout)
    if abs(s["renormalize_eps"] - 1e-6) > 1e-12 or s["renormalize_floor"] != 0:
        raise Failure("JSON summary does not report the epsilon: %r" % s)


def case_topk_sigmoid(c):
    t, e, k = 400, 32, 4
    lg = logits_file(c, "logits.npy", t, e)
    c.route_and_check(["--logits", lg, "--scoring", "sigmoid", "--top-k", str(k)], k, t)


def case_topk_f16(c):
    t, e, k = 500, 128, 8
    lg = logits_file(c, "logits.npy", t, e, "f16")
    c.route_and_check([lg, "--top-k", str(k)], k, t)


def case_topk_bf16_u2(c):
    t, e, k = 500, 256, 8
    lg = logits_file(c, "logits.npy", t, e, "bf16-u2")
    bias = write_npy(c.path("bias.npy"), randn(c.rng, e, 0.05), (e,))
    c.route_and_check([lg, "--bf16", "--bias", bias, "--scoring", "sigmoid", "--groups", "8", "--topk-group", "4",
                       "--group-score", "top2sum", "--renormalize", "--scale", "2.5", "--top-k", str(k)], k, t)


def case_topk_bf16_v2_format2(c):
    """bf16 as '|V2' in a format 2.0 file (4-byte header length), and a
    format 1.0 header padded to 16 bytes (older NumPy)."""
    t, e, k = 200, 40, 5
    lg = logits_file(c, "logits.npy", t, e, "bf16-v2", version=(2, 0))
    c.route_and_check([lg, "--bf16", "--top-k", str(k)], k, t)
    lg16 = logits_file(c, "logits16.npy", t, e, "f32", pad_to=16)
    c.route_and_check([lg16, "--top-k", str(k)], k, t, outputs=("pairs",))


def case_topk_default_top_k(c):
    """No --top-k: 8 experts per token (fewer when there are fewer experts);
    weights only; text summary with a bar per expert."""
    t, e = 100, 6
    lg = logits_file(c, "logits.npy", t, e)
    outs, p = c.route_and_check([lg], 6, t, outputs=("weights", "ids"))
    if p.stdout.count("expert ") < e or "tokens routed: 100" not in p.stdout:
        raise Failure("the summary lacks the per-expert histogram or the token count")


def case_grounded(c):
    """The seed's grounded router: f32, hidden 128, 16 experts, top 2, with
    pairs, weights and ids (all three must agree)."""
    t, h, e, k = 512, 128, 16, 2
    hid = write_npy(c.path("hidden.npy"), randn(c.rng, t * h, h ** -0.5), (t, h))
    lg = write_npy(c.path("logits.npy"), randn(c.rng, t * e), (t, e))
    gr = write_npy(c.path("ground.npy"), randn(c.rng, e * h), (e, h))
    c.route_and_check(["--op", "grounded", "--hidden", hid, "--logits", lg, "--ground", gr, "--alpha", "0.5"], k, t)


def case_grounded_narrow(c):
    """f16 and bf16 hidden states and ground rows, top 4, pairs only and
    weights only."""
    t, h, e, k = 300, 64, 24, 4
    lg = write_npy(c.path("logits.npy"), randn(c.rng, t * e), (t, e))
    hv, gv = randn(c.rng, t * h, h ** -0.5), randn(c.rng, e * h)
    for dt, extra in (("f16", []), ("bf16-u2", ["--bf16"]), ("bf16-v2", ["--bf16"])):
        hid = write_npy(c.path("hidden-%s.npy" % dt), hv, (t, h), dt)
        gr = write_npy(c.path("ground-%s.npy" % dt), gv, (e, h), dt)
        for outs in (("pairs",), ("weights",)):
            c.route_and_check(["--op", "grounded", "--hidden", hid, "--logits", lg, "--ground", gr, "--alpha",
                               "1.25", "--top-k", str(k)] + extra, k, t, outputs=outs)


def case_chunks(c):
    """Files larger than a forced small chunk: several chunks, a short last
    one; the outputs must be bit for bit those of a single chunk (rows are
    independent) and agree with the reference. Both ops."""
    t, e, k = 3000, 32, 4
    lg = logits_file(c, "logits.npy", t, e)
    bias = write_npy(c.path("bias.npy"), randn(c.rng, e, 0.05), (e,))
    common = [lg, "--bias", bias, "--scoring", "sigmoid", "--renormalize", "--top-k", str(k)]
    small, p = c.route_and_check(common + ["--chunk-rows", "256"], k, t)
    if "in 12 chunks of up to 256 rows" not in p.stdout:
        raise Failure("expected 12 chunks of 256 rows")
    whole, p = c.route_and_check(common, k, t)
    if "in 1 chunk " not in p.stdout:
        raise Failure("expected one chunk by default")
    for o in small:
        if open(small[o], "rb").read() != open(whole[o], "rb").read():
            raise Failure("%s: chunked output differs from the single-chunk output" % o)

    t, h, e, k = 1000, 48, 12, 3
    hid = write_npy(c.path("hidden.npy"), randn(c.rng, t * h, h ** -0.5), (t, h))
    lg = write_npy(c.path("glogits.npy"), randn(c.rng, t * e), (t, e))
    gr = write_npy(c.path("ground.npy"), randn(c.rng, e * h), (e, h))
    common = ["--op", "grounded", "--hidden", hid, "--logits", lg, "--ground", gr, "--top-k", str(k)]
    small, p = c.route_and_check(common + ["--chunk-rows", "99"], k, t)
    if "in 11 chunks of up to 99 rows" not in p.stdout:
        raise Failure("expected 11 chunks of 99 rows")
    whole, p = c.route_and_check(common, k, t)
    for o in small:
        if open(small[o], "rb").read() != open(whole[o], "rb").read():
            raise Failure("%s: chunked output differs from the single-chunk output" % o)


def case_json(c):
    """--json: one JSON object on stdout whose load matches the ids file."""
    t, e, k = 250, 48, 3
    lg = logits_file(c, "logits.npy", t, e)
    outs, p = c.route_and_check([lg, "--top-k", str(k), "--json", "--chunk-rows", "100"], k, t,
                                outputs=("weights", "ids"))
    s = json.loads(p.stdout)
    ids = struct.unpack("<%di" % (t * k), read_npy(outs["ids"])[3])
    load = [0] * e
    for i in ids:
        load[i] += 1
    if s["load"] != load or s["tokens"] != t or s["experts"] != e or s["top_k"] != k or s["chunks"] != 3:
        raise Failure("JSON summary disagrees with the ids: %r" % s)


def case_empty(c):
    """Zero tokens: valid files of shape (0, k), an empty histogram."""
    e, k = 16, 2
    lg = write_npy(c.path("logits.npy"), [], (0, e))
    c.route_and_check([lg, "--top-k", str(k)], k, 0)


def case_dispatch(c):
    """Top-k routing with every dispatch output at block size 16, in chunks
    of 128 rows (moe_align runs once on the ids gathered from all chunks):
    route-check judges them exactly against the reference of the ids
    written. One chunk gives the same bytes; the default block size is 64;
    --block-size alone puts the padding in the summary, in text and JSON."""
    t, e, k = 1000, 48, 6
    lg = logits_file(c, "logits.npy", t, e)
    bias = write_npy(c.path("bias.npy"), randn(c.rng, e, 0.05), (e,))
    common = [lg, "--bias", bias, "--scoring", "sigmoid", "--renormalize", "--top-k", str(k), "--block-size", "16"]
    everything = ("weights", "ids") + DISPATCH
    small, p = c.route_and_check(common + ["--chunk-rows", "128"], k, t, everything, experts=e)
    if "in 8 chunks of up to 128 rows" not in p.stdout:
        raise Failure("expected 8 chunks of 128 rows")
    whole, p = c.route_and_check(common, k, t, everything, experts=e)
    for o in small:
        if open(small[o], "rb").read() != open(whole[o], "rb").read():
            raise Failure("%s: chunked output differs from the single-chunk output" % o)
    c.route_and_check([lg, "--top-k", str(k), "--chunk-rows", "300"], k, t, ("ids", "pairs", "sorted-token-ids"),
                      experts=e)
    outs, p = c.route_and_check([lg, "--top-k", str(k), "--block-size", "7", "--json"], k, t, ("pairs",),
                                experts=e)
    s = json.loads(p.stdout)
    if s["block_size"] != 7 or s["max_padded"] != t * k + e * 6 or s["num_invalid"] != 0:
        raise Failure("JSON summary: %r" % s)
    outs, p = c.route_and_check([lg, "--top-k", str(k), "--json"], k, t, ("weights", "ids"))
    if json.loads(p.stdout)["num_tokens_post_padded"] is not None:
        raise Failure("no moe_align was asked for, yet the JSON summary reports one")


def case_topk_shared_experts(c):
    """--shared-experts: rows of top_k + S slots (route-check takes --top-k
    as a row's width), counts over experts + S, and the dispatch of every
    slot. --shared-weight alone, and more slots than 64 (before a device
    is opened), are bad usage."""
    t, e, k, s = 300, 64, 6, 2
    lg = logits_file(c, "logits.npy", t, e)
    bias = write_npy(c.path("bias.npy"), randn(c.rng, e, 0.05), (e,))
    c.route_and_check([lg, "--bias", bias, "--scoring", "sigmoid", "--renormalize", "--scale", "2.5", "--top-k",
                       str(k), "--shared-experts", str(s), "--shared-weight", "0.4", "--block-size", "16"], k + s, t,
                      ("weights", "ids") + DISPATCH, experts=e + s)
    c.expect_failure([lg, "--shared-weight", "0.5"], ["--shared-weight"], rc=2)
    c.expect_failure([lg, "--top-k", "60", "--shared-experts", "5", "--device", "no-such-device-moecl-test"],
                     ["num_shared_experts"], rc=2)


def case_grounded_shared_experts(c):
    """The grounded router with --shared-experts: rows of top_k + S slots in
    all three outputs (route-check takes --top-k as a row's width), counts
    over experts + S, in chunks; f16 inputs with the default weight, pairs
    only. The bad combinations are usage errors (2) named before any device
    is opened (a device that does not exist would exit 1)."""
    t, h, e, k, s = 300, 48, 16, 3, 2
    hid = write_npy(c.path("hidden.npy"), randn(c.rng, t * h, h ** -0.5), (t, h))
    lg = write_npy(c.path("logits.npy"), randn(c.rng, t * e), (t, e))
    gr = write_npy(c.path("ground.npy"), randn(c.rng, e * h), (e, h))
    common = ["--op", "grounded", "--hidden", hid, "--logits", lg, "--ground", gr]
    c.route_and_check(common + ["--alpha", "0.5", "--top-k", str(k), "--shared-experts", str(s), "--shared-weight",
                                "-0.75", "--chunk-rows", "77", "--block-size", "8"], k + s, t,
                      ROUTED + DISPATCH, experts=e + s)
    hv, gv = randn(c.rng, t * h, h ** -0.5), randn(c.rng, e * h)
    hid16 = write_npy(c.path("hidden-f16.npy"), hv, (t, h), "f16")
    gr16 = write_npy(c.path("ground-f16.npy"), gv, (e, h), "f16")
    _, p = c.route_and_check(["--op", "grounded", "--hidden", hid16, "--logits", lg, "--ground", gr16,
                              "--shared-experts", "3"], 2 + 3, t, ("pairs",))
    if "shared experts after the routed slots" not in p.stdout:
        raise Failure("the summary does not say the rows hold shared experts")
    emap = write_ids(c.path("map.npy"), list(range(e)), (e,))
    nowhere = ["--device", "no-such-device-moecl-test"]
    c.expect_failure(common + ["--shared-weight", "0.5"] + nowhere, ["--shared-weight needs --shared-experts"], rc=2)
    c.expect_failure(common + ["--top-k", "62", "--shared-experts", "3"] + nowhere, ["num_shared_experts"], rc=2)
    c.expect_failure(common + ["--shared-experts", "63"] + nowhere, ["num_shared_experts"], rc=2)
    c.expect_failure(common + ["--shared-experts", "0"] + nowhere, ["--shared-experts is 1..63"], rc=2)
    c.expect_failure(common + ["--shared-experts", "2", "--expert-map", emap, "--block-size", "8"] + nowhere,
                     ["--expert-map"], rc=2)
    c.expect_failure(common + ["--shared-experts", "2", "--scale", "2"] + nowhere, ["--scale"], rc=2)


def case_dispatch_grounded(c):
    """The grounded router's ids (from the pairs only) through moe_align,
    in chunks of 77 rows, block size 32, and at block size 1."""
    t, h, e, k = 400, 32, 12, 3
    hid = write_npy(c.path("hidden.npy"), randn(c.rng, t * h, h ** -0.5), (t, h))
    lg = write_npy(c.path("logits.npy"), randn(c.rng, t * e), (t, e))
    gr = write_npy(c.path("ground.npy"), randn(c.rng, e * h), (e, h))
    common = ["--op", "grounded", "--hidden", hid, "--logits", lg, "--ground", gr, "--top-k", str(k)]
    c.route_and_check(common + ["--chunk-rows", "77", "--block-size", "32"], k, t, ("pairs",) + DISPATCH,
                      experts=e)
    c.route_and_check(common + ["--block-size", "1", "--json"], k, t, ("ids", "weights") + DISPATCH, experts=e)


def align_ids(c, tokens, k, experts, invalid_share=0.1):
    """Random ids in [0, experts), about invalid_share of them -1 or out of
    range; returns them and how many are invalid."""
    bad = (-1, -1, -7, experts, experts + 5, 2 ** 31 - 1, -2 ** 31)
    ids = [c.rng.choice(bad) if c.rng.random() < invalid_share else c.rng.randrange(experts)
           for _ in range(tokens * k)]
    return ids, sum(1 for i in ids if not 0 <= i < experts)


def case_align_ids(c):
    """--op align on an ids file with -1 and out-of-range ids (skipped and
    counted as num_invalid): block sizes 1 and 64 (the default), read in
    chunks; top_k above the expert count; zero tokens."""
    t, k, e = 600, 5, 20
    ids, invalid = align_ids(c, t, k, e)
    path = write_ids(c.path("ids.npy"), ids, (t, k))
    base = ["--op", "align", "--ids-in", path, "--experts", str(e)]
    for extra in (["--block-size", "1"], ["--chunk-rows", "70"], ["--block-size", "64", "--json"]):
        outs, p = c.route_and_check(base + extra, k, t, DISPATCH, experts=e)
        if p.summary[1] != invalid:
            raise Failure("the summary says num_invalid %d; the file has %d invalid ids" % (p.summary[1], invalid))
        counts = struct.unpack("<%di" % e, read_npy(outs["expert-counts"])[3])
        if sum(counts) != t * k - invalid:
            raise Failure("expert_counts sums to %d, want %d" % (sum(counts), t * k - invalid))
    if "70 rows" not in c.route_and_check(base + ["--chunk-rows", "70"], k, t, (), experts=e)[1].stdout:
        raise Failure("the summary does not say the chunks of 70 rows")
    ids, invalid = align_ids(c, 50, 8, 3, 0.0)
    path = write_ids(c.path("ids-wide.npy"), ids, (50, 8))
    c.route_and_check(["--op", "align", "--ids-in", path, "--experts", "3", "--block-size", "4"], 8, 50,
                      ("sorted-token-ids", "slot-positions"), experts=3)
    path = write_ids(c.path("ids-empty.npy"), [], (0, 4))
    outs, p = c.route_and_check(["--op", "align", "--ids-in", path, "--experts", "9", "--block-size", "3"], 4, 0,
                                DISPATCH, experts=9)
    if p.summary != (0, 0):
        raise Failure("zero tokens: summary %r, want (0, 0)" % (p.summary,))


def align_map_ref(ids, local, block, m):
    """moe_align with an expert map by a serial walk: expert_counts, the
    sorted slots and block experts up to num_tokens_post_padded, and it."""
    runs = [[] for _ in range(local)]
    for slot, g in enumerate(ids):
        if 0 <= g < len(m) and 0 <= m[g] < local:
            runs[m[g]].append(slot)
    sorted_ids, blocks = [], []
    for expert, run in enumerate(runs):
        padded = -(-len(run) // block) * block
        sorted_ids += run + [len(ids)] * (padded - len(run))
        blocks += [expert] * (padded // block)
    return [len(r) for r in runs], sorted_ids, blocks, len(sorted_ids)


def ints(path):
    payload = read_npy(path)[3]
    return list(struct.unpack("<%di" % (len(payload) // 4), payload))


def case_expert_map(c):
    """--expert-map: --op align on global ids (a map with -1 entries, ids
    outside it) against a serial reference; top-k with the map writes the
    dispatch --op align writes for its ids; bad maps exit 1 naming the
    file, a map without moe_align exits 2."""
    t, k, g, local, block = 120, 4, 24, 6, 4
    m = [c.rng.randrange(local) if c.rng.random() < 0.5 else -1 for _ in range(g)]
    m[0] = local - 1  # top-k's local experts are 0..max(map)
    mp = write_ids(c.path("map.npy"), m, (g,))
    ids, _ = align_ids(c, t, k, g)
    ip = write_ids(c.path("ids.npy"), ids, (t, k))
    names = ("expert-counts", "sorted-token-ids", "block-expert-ids", "post-padded")

    def run(argv, tag):
        outs = {o: c.path("%s-%s.npy" % (tag, o)) for o in names}
        c.run(c.route, argv + ["--expert-map", mp, "--block-size", str(block)] +
              [a for o in names for a in ("--" + o, outs[o])])
        return [ints(outs[o]) for o in names]

    counts, sorted_ids, blocks, post = run(["--op", "align", "--ids-in", ip, "--experts", str(local)], "align")
    want = align_map_ref(ids, local, block, m)
    if (counts, sorted_ids[:post[0]], blocks[:post[0] // block], post[0]) != want:
        raise Failure("--op align with the map: %r, want %r" % ((counts, post), (want[0], want[3])))
    lg = logits_file(c, "logits.npy", t, g)
    routed = c.path("routed-ids.npy")
    got = run([lg, "--top-k", str(k), "--ids", routed], "topk")
    if got != run(["--op", "align", "--ids-in", routed, "--experts", str(local)], "again"):
        raise Failure("top-k with the map differs from --op align on its ids with the map")
    c.expect_failure([lg, "--expert-map", mp], ["--expert-map"], rc=2)
    short = write_ids(c.path("map-short.npy"), m[:5], (5,))
    c.expect_failure([lg, "--expert-map", short, "--block-size", "4"], ["map-short.npy"], rc=1)
    f4 = write_ids(c.path("map-f4.npy"), [float(x) for x in m], (g,), "<f4")
    c.expect_failure(["--op", "align", "--ids-in", ip, "--experts", str(local), "--expert-map", f4], ["map-f4.npy"],
                     rc=1, outputs=DISPATCH)


def sparse_npy(path, descr, shape, elem):
    """A header claiming shape, then a hole as long as its data (no disk)."""
    n = elem
    for s in shape:
        n *= s
    with open(path, "wb") as f:
        head = npy_bytes(descr, shape, b"")
        f.write(head)
        f.truncate(len(head) + n)
    return path


def case_align_bad(c):
    """Bad ids files exit 1 naming the file; bad block sizes, options that
    do not belong to the op, and a max_padded above 2^31-1 exit 2; an
    output that cannot be created fails the run. Nothing is left behind."""
    t, k, e = 40, 4, 8
    ids, _ = align_ids(c, t, k, e)
    good = write_ids(c.path("ids.npy"), ids, (t, k))
    lg = logits_file(c, "logits.npy", t, e)
    f4 = write_ids(c.path("ids-f4.npy"), [float(i) for i in ids], (t, k), "<f4")
    flat = write_ids(c.path("ids-flat.npy"), ids, (t * k,))
    wide = write_ids(c.path("ids-wide.npy"), [0] * (t * 65), (t, 65))
    align = ["--op", "align", "--experts", str(e), "--ids-in"]
    failures = []

    def expect(label, argv, names, rc, outputs=DISPATCH, word=None):
        print("--- %s" % label)
        try:
            p = c.expect_failure(argv, names, rc=rc, outputs=outputs)
            if word and word not in p.stderr:
                raise Failure("the message does not say %r" % word)
        except Failure as ex:
            failures.append("%s: %s" % (label, ex))

    expect("'<f4' ids", align + [f4], [f4], 1, word="int32")
    expect("1-D ids", align + [flat], [flat], 1, word="2-D")
    expect("65 ids a token", align + [wide], [wide], 1, word="1..64")
    expect("missing ids file", align + [c.path("no-such.npy")], ["no-such.npy"], 1)
    for bs in ("0", "2000", "x"):
        expect("align --block-size %s" % bs, align + [good, "--block-size", bs], ["--block-size"], 2)
        expect("topk --block-size %s" % bs, [lg, "--block-size", bs], ["--block-size"], 2, ROUTED + DISPATCH)
    for argv, what in ((["--ids-in", good], "--ids-in without --op align"),
                       (["--op", "align", "--ids-in", good], "no --experts"),
                       (["--op", "align", "--experts", "8"], "no --ids-in"),
                       (align + [good, "--experts", "0"], "--experts 0"),
                       (align + [good, "--experts", "4097"], "--experts 4097"),
                       (align + [good, "--top-k", "4"], "--top-k with --op align"),
                       (align + [good, lg], "logits with --op align"),
                       ([lg, "--experts", "8"], "--experts with --op topk")):
        expect(what, argv, ["moecl-route"], 2)
    expect("--weights with --op align", align + [good], ["--weights"], 2, ("weights",) + DISPATCH)
    same = c.path("same.npy")
    expect("two dispatch outputs to one file", align + [good, "--expert-counts", same, "--post-padded", same],
           [same], 2, ())
    # 2^25 tokens x 64 ids (8 GiB, a hole on disk): refused before a row is read.
    big, bigl = c.path("big-ids.npy"), c.path("big-logits.npy")
    try:
        sparse_npy(big, "<i4", (1 << 25, 64), 4)
        expect("max_padded above 2^31-1 (align)", align + [big, "--block-size", "1"], [big], 2, word="2^31-1")
        sparse_npy(bigl, "<f4", (1 << 25, 64), 4)
        expect("max_padded above 2^31-1 (topk)", [bigl, "--top-k", "64", "--block-size", "2"], [bigl], 2,
               ("ids", "sorted-token-ids"), word="2^31-1")
        expect("--block-size alone above 2^31-1", [bigl, "--top-k", "64", "--block-size", "2"], ["2^31-1"], 2, ())
    finally:
        for path in (big, bigl):
            if os.path.exists(path):
                os.unlink(path)
    # A dispatch output in a missing folder, after the others were opened.
    print("--- an output that cannot be created")
    outdir = c.path("outs-missing")
    os.mkdir(outdir)
    missing = os.path.join(c.path("no-such-dir"), "post.npy")
    try:
        p = c.run(c.route, [lg, "--top-k", "2", "--ids", os.path.join(outdir, "i.npy"), "--sorted-token-ids",
                            os.path.join(outdir, "s.npy"), "--post-padded", missing], want_rc=1)
        if missing not in p.stderr or os.listdir(outdir):
            raise Failure("the message does not name %s, or files were left: %s" % (missing, os.listdir(outdir)))
    except Failure as ex:
        failures.append("missing output folder: %s" % ex)
    if failures:
        raise Failure("\n".join(failures))


def case_bad_files(c):
    """Each bad file: exit 1, a message naming the file, nothing written."""
    t, e = 20, 8
    good = logits_file(c, "good.npy", t, e)
    payload = encode(randn(c.rng, t * e), "f32")

    def raw(name, data):
        with open(c.path(name), "wb") as f:
            f.write(data)
        return c.path(name)

    cases = [
        ("wrong magic", raw("magic.npy", b"\x93NUMPX" + npy_bytes("<f4", (t, e), payload)[6:]), [], "magic"),
        ("not npy at all", raw("text.npy", b"hello, world\n" * 20), [], "magic"),
        ("unsupported dtype f8", raw("f8.npy", npy_bytes("<f8", (t, e), payload + payload)), [], "dtype"),
        ("unsupported dtype i4", raw("i4.npy", npy_bytes("<i4", (t, e), payload)), [], "dtype"),
        ("big-endian f4", raw("be.npy", npy_bytes(">f4", (t, e), payload)), [], "dtype"),
        ("u2 without --bf16", write_npy(c.path("u2.npy"), randn(c.rng, t * e), (t, e), "bf16-u2"), [], "--bf16"),
        ("Fortran order", raw("fortran.npy", npy_bytes("<f4", (t, e), payload, fortran=True)), [], "Fortran"),
        ("truncated data", raw("trunc.npy", npy_bytes("<f4", (t, e), payload)[:-5]), [], "truncated"),
        ("truncated header", raw("trunch.npy", npy_bytes("<f4", (t, e), payload)[:40]), [], "truncated"),
        ("bad header syntax", raw("hdr.npy", npy_bytes("<f4", (t, e), payload).replace(b"'shape': (", b"'shape': [")),
         [], "header"),
        ("header without shape", raw("noshape.npy", b"\x93NUMPY\x01\x00" + struct.pack("<H", 54) +
                                     b"{'descr': '<f4', 'fortran_order': False, }".ljust(53) + b"\n" + payload),
         [], "shape"),
        ("format version 4", raw("v4.npy", npy_bytes("<f4", (t, e), payload, version=(4, 0))), [], "version"),
        ("1-D logits", raw("flat.npy", npy_bytes("<f4", (t * e,), payload)), [], "2-D"),
        ("missing file", c.path("no-such-file.npy"), [], "cannot open"),
    ]
    bias_wrong = write_npy(c.path("bias7.npy"), randn(c.rng, e - 1), (e - 1,))
    bias_f16 = write_npy(c.path("bias16.npy"), randn(c.rng, e), (e,), "f16")
    failures = []
    for label, path, extra, word in cases:
        print("--- %s" % label)
        try:
            p = c.expect_failure([path, "--top-k", "2"] + extra, [path])
            if word.lower() not in p.stderr.lower():
                raise Failure("the message does not say %r" % word)
        except Failure as ex:
            failures.append("%s: %s" % (label, ex))
    for label, bias, word in (("bias length != experts", bias_wrong, "bias"), ("f16 bias", bias_f16, "float32")):
        print("--- %s" % label)
        try:
            p = c.expect_failure([good, "--bias", bias, "--top-k", "2"], [bias])
            if word not in p.stderr:
                raise Failure("the message does not say %r" % word)
        except Failure as ex:
            failures.append("%s: %s" % (label, ex))
    if failures:
        raise Failure("\n".join(failures))


def case_bad_grounded_files(c):
    """The grounded router's shape mismatches: hidden rows != logits rows,
    ground rows != experts, hidden size mismatch, mixed dtypes, f16 logits."""
    t, h, e = 30, 16, 8
    hid = write_npy(c.path("hidden.npy"), randn(c.rng, t * h), (t, h))
    hid_short = write_npy(c.path("hidden-short.npy"), randn(c.rng, (t - 1) * h), (t - 1, h))
    hid16 = write_npy(c.path("hidden16.npy"), randn(c.rng, t * h), (t, h), "f16")
    lg = write_npy(c.path("logits.npy"), randn(c.rng, t * e), (t, e))
    lg16 = write_npy(c.path("logits16.npy"), randn(c.rng, t * e), (t, e), "f16")
    gr = write_npy(c.path("ground.npy"), randn(c.rng, e * h), (e, h))
    gr_e = write_npy(c.path("ground-e.npy"), randn(c.rng, (e + 1) * h), (e + 1, h))
    gr_h = write_npy(c.path("ground-h.npy"), randn(c.rng, e * (h + 2)), (e, h + 2))
    cases = [
        ("hidden rows != logits rows", hid_short, lg, gr, [hid_short, lg]),
        ("ground rows != experts", hid, lg, gr_e, [gr_e]),
        ("ground width != hidden", hid, lg, gr_h, [gr_h]),
        ("hidden f16, ground f32", hid16, lg, gr, [gr, hid16]),
        ("f16 router logits", hid, lg16, gr, [lg16]),
    ]
    failures = []
    for label, hh, ll, gg, names in cases:
        print("--- %s" % label)
        try:
            c.expect_failure(["--op", "grounded", "--hidden", hh, "--logits", ll, "--ground", gg], names)
        except Failure as ex:
            failures.append("%s: %s" % (label, ex))
    if failures:
        raise Failure("\n".join(failures))


def case_no_half_written_output(c):
    """An output that cannot be created (its folder is missing) after
    another was opened: exit 1, the first output's temporary file removed,
    and an existing file at an output path left as it was."""
    t, e, k = 50, 8, 2
    lg = logits_file(c, "logits.npy", t, e)
    outdir = c.path("outs")
    os.mkdir(outdir)
    keep = os.path.join(outdir, "w.npy")
    with open(keep, "wb") as f:
        f.write(b"old contents")
    missing = os.path.join(c.path("no-such-dir"), "ids.npy")
    p = c.run(c.route, [lg, "--top-k", str(k), "--weights", keep, "--ids", missing], want_rc=1)
    if missing not in p.stderr:
        raise Failure("the message does not name %s" % missing)
    if sorted(os.listdir(outdir)) != ["w.npy"] or open(keep, "rb").read() != b"old contents":
        raise Failure("the output folder changed: %s" % os.listdir(outdir))


def case_usage(c):
    """Bad usage exits 2: unknown flags, missing inputs, options that do not
    fit the data (top_k above the experts, groups that do not divide them)."""
    t, e = 10, 8
    lg = logits_file(c, "logits.npy", t, e)
    for argv in (["--no-such-flag"], [], [lg, "--top-k", "0"], [lg, "--top-k", "9"],
                 [lg, "--groups", "3", "--topk-group", "1"], [lg, "--groups", "4"],
                 [lg, "--scoring", "relu"], [lg, "--scale", "inf"], [lg, "--op", "grounded"],
                 [lg, "--alpha", "1"], [lg, "--group-fill", "zero"],
                 [lg, "--groups", "4", "--topk-group", "2", "--group-fill", "nan"],
                 [lg, "--renormalize-floor", "1e-3"], [lg, "--renormalize", "--renormalize-floor", "-1"],
                 [lg, "--renormalize", "--renormalize-floor", "1e-40"], [lg, "--renormalize-eps", "1e-20"],
                 [lg, "--renormalize", "--renormalize-eps", "-1"], [lg, "--renormalize", "--renormalize-eps", "1e-40"],
                 [lg, "--renormalize", "--renormalize-eps", "1e-20", "--renormalize-floor", "1e-3"]):
        c.expect_failure(argv, ["moecl-route"], rc=2)
    same = c.path("same.npy")
    c.expect_failure([lg, "--weights", same, "--ids", same], [same], rc=2, outputs=False)
    if os.path.exists(same):
        raise Failure("%s was written" % same)


def case_options_in_full(c):
    """No option is guessed: --topk is --top-k's second spelling, never a
    prefix of --topk-group; an abbreviation exits 2 naming the full names;
    a flag given a value exits 2."""
    t, e = 12, 16
    lg = logits_file(c, "logits.npy", t, e)
    # getopt_long's default took --topk for --topk-group: this routed with
    # top_k 8 and topk_group 2, exit status 0.
    p = c.expect_failure([lg, "--topk", "2", "--groups", "8"], ["--groups and --topk-group"], rc=2)
    ids = c.path("ids.npy")
    p = c.run(c.route, [lg, "--topk", "3", "--json", "--ids", ids])
    if json.loads(p.stdout)["top_k"] != 3 or read_npy(ids)[1] != (t, 3):
        raise Failure("--topk 3 did not route with top_k 3")
    for word, full in (("--topk-g", "--topk-group"), ("--top", "--top-k"), ("--weig", "--weights"),
                       ("--renorm", "--renormalize")):
        argv = [lg, word] if word == "--renorm" else [lg, "--groups", "4", word, "2"]
        if word == "--weig":
            argv = [lg, word, c.path("w.npy")]
        p = c.expect_failure(argv, ["'%s' is not a full option name" % word], rc=2)
        if full not in p.stderr:
            raise Failure("the message does not name %s" % full)
    c.expect_failure([lg, "--json=yes"], ["option '--json' takes no value"], rc=2)


def case_float_options(c):
    """A subnormal value is a number: --scale takes it; --renormalize-floor
    refuses it naming its range (not "not a finite number"); a value that
    rounds to 0 or beyond the float range is refused as such."""
    t, e = 10, 8
    lg = logits_file(c, "logits.npy", t, e)
    _, p = c.route_and_check([lg, "--top-k", "2", "--scale", "1e-40", "--json"], 2, t)
    if json.loads(p.stdout)["scale"] != 1e-40:
        raise Failure("--scale 1e-40 is not in the summary: %r" % json.loads(p.stdout)["scale"])
    p = c.expect_failure([lg, "--renormalize", "--renormalize-floor", "1e-40"], ["2^-126"], rc=2)
    if "finite" in p.stderr or "subnormal" not in p.stderr:
        raise Failure("the message does not call 1e-40 subnormal: %r" % p.stderr)
    c.expect_failure([lg, "--scale", "1e-50"], ["rounds to 0"], rc=2)
    c.expect_failure([lg, "--scale", "1e39"], ["beyond the float range"], rc=2)


def case_align_int64_ids(c):
    """int64 ids (torch.topk's) read as int32: the same outputs as the
    int32 file; an id outside int32 stops the run (exit 1, nothing
    written) with a message naming int32; other dtypes are refused naming
    what ids are read."""
    t, k, e = 300, 4, 16
    ids, invalid = align_ids(c, t, k, e)
    p32 = write_ids(c.path("ids32.npy"), ids, (t, k))
    p64 = c.path("ids64.npy")
    with open(p64, "wb") as f:
        f.write(npy_bytes("<i8", (t, k), struct.pack("<%dq" % len(ids), *ids)))
    base = ["--op", "align", "--experts", str(e), "--block-size", "8", "--chunk-rows", "37", "--ids-in"]
    out32, _ = c.route_and_check(base + [p32], k, t, DISPATCH, experts=e)
    out64, p = c.route_and_check(base + [p64, "--json"], k, t, DISPATCH, experts=e)
    if json.loads(p.stdout)["dtype"] != "i64" or p.summary[1] != invalid:
        raise Failure("the summary says dtype %r, num_invalid %r" % (json.loads(p.stdout)["dtype"], p.summary[1]))
    for o in DISPATCH:
        if read_npy(out32[o]) != read_npy(out64[o]):
            raise Failure("%s differs between the int32 and the int64 ids" % o)
    big = list(ids)
    big[5 * k + 1] = 1 << 40
    pbig = c.path("ids64-big.npy")
    with open(pbig, "wb") as f:
        f.write(npy_bytes("<i8", (t, k), struct.pack("<%dq" % len(big), *big)))
    p = c.expect_failure(base + [pbig], [pbig], rc=1, outputs=DISPATCH)
    if "int32" not in p.stderr or "row 5" not in p.stderr:
        raise Failure("the message does not name the row and int32: %r" % p.stderr)
    pu8 = c.path("ids-u8.npy")
    with open(pu8, "wb") as f:
        f.write(npy_bytes("<u8", (t, k), struct.pack("<%dQ" % len(ids), *[i & 0xFFFF for i in ids])))
    p = c.expect_failure(base + [pu8], [pu8], rc=1, outputs=DISPATCH)
    if "'<i8'" not in p.stderr or "'<i4'" not in p.stderr:
        raise Failure("the message does not say which ids are read: %r" % p.stderr)


def case_folder_target(c):
    """An output path that is a folder is refused before anything is
    written: exit 1, no other output written, a file at another output
    path as it was (a rename into the folder would fail only after the
    weights had been renamed into place)."""
    t, e = 20, 8
    lg = logits_file(c, "logits.npy", t, e)
    outdir = c.path("outs")
    os.mkdir(outdir)
    folder = os.path.join(outdir, "a-folder")
    os.mkdir(folder)
    keep = os.path.join(outdir, "old.npy")
    with open(keep, "wb") as f:
        f.write(b"old contents")
    for argv in ([lg, "--top-k", "2", "--weights", os.path.join(outdir, "w.npy"), "--ids", folder],
                 [lg, "--top-k", "2", "--weights", keep, "--pairs", folder],
                 [lg, "--top-k", "2", "--ids", os.path.join(outdir, "i.npy"), "--sorted-token-ids", folder]):
        p = c.run(c.route, argv, want_rc=1)
        if folder not in p.stderr or "folder" not in p.stderr.replace(folder, ""):
            raise Failure("the message does not name the folder: %r" % p.stderr)
        if sorted(os.listdir(outdir)) != ["a-folder", "old.npy"] or os.listdir(folder):
            raise Failure("files were written: %s" % os.listdir(outdir))
        if open(keep, "rb").read() != b"old contents":
            raise Failure("%s changed" % keep)


def case_demo(c):
    """--demo DIR writes the example logits and bias that the README's
    commands route; a second --demo keeps the files and exits 1; --demo
    takes no other option."""
    d = c.path("demo")
    os.mkdir(d)
    p = c.run(c.route, ["--demo", d])
    lg, bias = os.path.join(d, "logits.npy"), os.path.join(d, "bias.npy")
    for path, shape in ((lg, (4096, 256)), (bias, (256,))):
        descr, got, fortran, payload = read_npy(path)
        if (descr, got, fortran, len(payload)) != ("<f4", shape, False, 4 * shape[0] * (shape[1:] or (1,))[0]):
            raise Failure("%s: %r %r %r, %d bytes" % (path, descr, got, fortran, len(payload)))
        if path not in p.stdout:
            raise Failure("the message does not name %s" % path)
    before = open(lg, "rb").read()
    c.run(c.route, ["--demo", d], want_rc=1)
    if open(lg, "rb").read() != before:
        raise Failure("a second --demo changed %s" % lg)
    c.expect_failure(["--demo", d, "--top-k", "2"], ["--demo"], rc=2)
    c.route_and_check([lg], 8, 4096)
    c.route_and_check([lg, "--top-k", "8", "--scoring", "sigmoid", "--bias", bias, "--groups", "8", "--topk-group",
                       "4", "--group-score", "top2sum", "--renormalize", "--scale", "2.5"], 8, 4096)


CASES = {name[5:].replace("_", "-"): fn for name, fn in sorted(globals().items()) if name.startswith("case_")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--route")
    ap.add_argument("--check")
    ap.add_argument("--case", action="append", help="run this case (repeatable; default all)")
    ap.add_argument("--workdir", default=None, help="parent of the scratch folder (default $TMPDIR)")
    ap.add_argument("--seed", type=int, default=None, help="random inputs (default: printed, fresh each run)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    if args.list:
        print("\n".join(CASES))
        return 0
    if not args.route or not args.check:
        ap.error("--route and --check are required")
    if args.seed is None:
        args.seed = int(os.environ.get("MOECL_TEST_SEED", random.randrange(1 << 31)))
    print("seed %d (MOECL_TEST_SEED=%d repeats it)" % (args.seed, args.seed))
    names = args.case or list(CASES)
    for n in names:
        if n not in CASES:
            ap.error("no case %r (--list)" % n)
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    failed = 0
    for n in names:
        work = tempfile.mkdtemp(prefix="route-%s." % n, dir=args.workdir)
        print("=== %s (%s)" % (n, work))
        try:
            CASES[n](Ctx(args, work))
            print("=== %s: ok" % n)
            if not args.keep:
                shutil.rmtree(work)
        except (Failure, AssertionError, OSError, ValueError, KeyError) as ex:
            print("=== %s: FAILED: %s (files kept in %s)" % (n, ex, work))
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
