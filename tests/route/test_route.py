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

    def route_and_check(self, argv, k, tokens, outputs=("weights", "ids", "pairs")):
        """Runs moecl-route with argv plus the outputs, checks their headers,
        then route-check. Returns the output paths and moecl-route's run."""
        outs = {}
        extra = []
        tag = "%d" % self.rng.randrange(1 << 30)
        for o in outputs:
            outs[o] = self.path("out-%s-%s.npy" % (o, tag))
            extra += ["--" + o, outs[o]]
        p = self.run(self.route, argv + extra)
        for o, path in outs.items():
            descr, shape, fortran, payload = read_npy(path)
            want = (tokens, k, 2) if o == "pairs" else (tokens, k)
            if descr != ("<i4" if o == "ids" else "<f4") or shape != want or fortran:
                raise Failure("%s: header %r %r %r, want %r" % (path, descr, shape, fortran, want))
            n = 1
            for s in shape:
                n *= s
            if len(payload) != 4 * n:
                raise Failure("%s: %d bytes of data, want %d" % (path, len(payload), 4 * n))
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
        leave no output (or temporary) file in a fresh output folder."""
        outdir = self.path("outs-%d" % self.rng.randrange(1 << 30))
        os.mkdir(outdir)
        outs = ["--weights", os.path.join(outdir, "w.npy"), "--ids", os.path.join(outdir, "i.npy"),
                "--pairs", os.path.join(outdir, "p.npy")] if outputs else []
        p = self.run(self.route, argv + outs, want_rc=rc)
        if not any(n in p.stderr for n in names):
            raise Failure("the message does not name %s: %r" % (" or ".join(names), p.stderr))
        if os.listdir(outdir):
            raise Failure("files left behind: %s" % os.listdir(outdir))
        return p


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
                 [lg, "--alpha", "1"]):
        c.expect_failure(argv, ["moecl-route"], rc=2)
    same = c.path("same.npy")
    c.expect_failure([lg, "--weights", same, "--ids", same], [same], rc=2, outputs=False)
    if os.path.exists(same):
        raise Failure("%s was written" % same)


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
