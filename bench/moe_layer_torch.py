#!/usr/bin/env python3
"""PyTorch's eager MoE block at examples/moe_layer's shapes and inputs: the
figure set beside the example's layer time (bench/RESULTS.md, "MoE layer").

    python3 bench/moe_layer_torch.py --device cuda --model mixtral --tokens 4096
    python3 bench/moe_layer_torch.py --device cpu --threads 2 --shape T,H,I,E,K

The block as Hugging Face's Mixtral and Qwen3-MoE write it in eager
PyTorch, in float32: the router GEMM, softmax, top k, renormalisation; the
slots sorted by expert, then for each expert with tokens an index_select
of its rows, the gate_up GEMM with W1 [2I][H] (gate rows, then up),
SiLU(gate) * up, the down GEMM with W2 [H][I], and index_add_ of the rows
times their weights into the output. One host synchronisation a layer
(the experts' token counts, which slice the sorted slots), as in the
eager models, which also read which experts have tokens. No padding rows
(the example's batched GEMMs compute moe_align's padding too).

The inputs are the example's, bit for bit: its splitmix64 stream from
--seed, uniform and scaled as examples/moe_layer.c's random_tensor, so the
checksum printed is comparable with the example's `output checksum` line
(up to float32 rounding: the GEMMs sum in another order). GEMMs in full
float32: TF32 is off unless --tf32 (the setting is printed).

Timing: CUDA, CUDA events around each layer after --warmup layers, the
median of --runs; CPU, perf_counter. No CUDA graph: the per-expert loop
slices by counts read on the host, which graph capture does not allow.
"""
import argparse
import statistics
import time

import torch

import moe_layer_shapes

SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
SPLITMIX_M1 = 0xBF58476D1CE4E5B9
SPLITMIX_M2 = 0x94D049BB133111EB


def signed64(v):
    """A uint64 constant as the int64 with its bits (torch has no uint64
    arithmetic; int64's multiplication wraps the same)."""
    return v - (1 << 64) if v >= 1 << 63 else v


def shr(z, n):
    """Logical right shift of int64 bits."""
    return (z >> n) & ((1 << (64 - n)) - 1)


class Splitmix:
    """examples/moe_layer.c's inputs: one splitmix64 stream from the seed,
    each tensor taking the next values, uniform in [-scale, scale)."""

    def __init__(self, seed, device):
        self.state = seed
        self.device = device

    def tensor(self, shape, scale, chunk=1 << 26):
        n = 1
        for d in shape:
            n *= d
        out = torch.empty(n, dtype=torch.float32, device=self.device)
        # float32 as the C code computes it: 3.0f / sqrtf((float)n).
        scale_f = torch.tensor(scale, dtype=torch.float32, device=self.device)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            j = torch.arange(lo + 1, hi + 1, dtype=torch.int64, device=self.device)
            z = signed64(self.state % (1 << 64)) + j * signed64(SPLITMIX_GAMMA)
            z = (z ^ shr(z, 30)) * signed64(SPLITMIX_M1)
            z = (z ^ shr(z, 27)) * signed64(SPLITMIX_M2)
            z = z ^ shr(z, 31)
            u = shr(z, 40).to(torch.float32)  # below 2^24: exact
            out[lo:hi] = scale_f * (u * 2.0 ** -23 - 1.0)
        self.state = (self.state + n * SPLITMIX_GAMMA) % (1 << 64)
        return out.view(shape)


def c_scale(n):
    """3.0f / sqrtf((float)n) in float32."""
    return (torch.tensor(3.0, dtype=torch.float32) / torch.sqrt(torch.tensor(float(n), dtype=torch.float32))).item()


def moe_block(x, router, w1, w2, top_k):
    """The eager block; returns the output [T][H]."""
    num_experts, inter = router.shape[0], w2.shape[2]
    logits = x @ router.T
    probs = torch.softmax(logits, dim=1)
    weights, ids = torch.topk(probs, top_k, dim=1)
    weights = weights / weights.sum(dim=1, keepdim=True)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    tokens = order // top_k
    slot_weights = weights.flatten()[order]
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # the host synchronisation
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = tokens[start:start + n]
        h = x.index_select(0, tok) @ w1[e].T
        g = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        y = g @ w2[e].T
        out.index_add_(0, tok, y * slot_weights[start:start + n, None])
        start += n
    return out


def time_layers(fn, device, warmup, runs):
    """Milliseconds of each of `runs` layers after `warmup`."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(runs):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
    else:
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", required=True, help="cuda, cuda:N or cpu")
    moe_layer_shapes.add_arguments(ap)
    ap.add_argument("--seed", type=int, default=1, help="the example's --seed (default 1)")
    ap.add_argument("--runs", type=int, default=20, help="timed layers (default 20)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed layers before them (default 2)")
    ap.add_argument("--threads", type=int, help="CPU: torch.set_num_threads")
    ap.add_argument("--tf32", action="store_true", help="CUDA: let float32 GEMMs use TF32")
    a = ap.parse_args()
    t, h, i, e, k = moe_layer_shapes.parse(ap, a)
    if a.runs < 1 or a.warmup < 0 or a.seed < 0:
        ap.error("--runs must be positive, --warmup and --seed not negative")
    try:
        device = torch.device(a.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cuda", "cpu"):
        ap.error("--device takes cuda, cuda:N or cpu, not %r" % a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device %s: this PyTorch has no CUDA device" % a.device)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    torch.backends.cuda.matmul.allow_tf32 = a.tf32
    torch.backends.cudnn.allow_tf32 = a.tf32

    # The example's order: x, router, w1, w2.
    rng = Splitmix(a.seed, device)
    x = rng.tensor((t, h), 1.0)
    router = rng.tensor((e, h), c_scale(h))
    w1 = rng.tensor((e, 2 * i, h), c_scale(h))
    w2 = rng.tensor((e, h, i), c_scale(i))

    with torch.inference_mode():
        times = time_layers(lambda: moe_block(x, router, w1, w2, k), device, a.warmup, a.runs)
        out = moe_block(x, router, w1, w2, k).double()
    if device.type == "cuda":
        name = "%s (CUDA %s)" % (torch.cuda.get_device_name(device), torch.version.cuda)
        method = "CUDA events"
        gemm = "TF32" if a.tf32 else "float32 (TF32 off)"
    else:
        name = "CPU, %d threads" % torch.get_num_threads()
        method = "perf_counter"
        gemm = "float32"
    print("moe_layer_torch: torch %s on %s, GEMMs in %s" % (torch.__version__, name, gemm))
    print("  tokens %d, hidden %d, intermediate %d, experts %d, top %d, seed %d (the example's inputs)"
          % (t, h, i, e, k, a.seed))
    print("output checksum: sum %.9e, sum of |out| %.9e" % (out.sum().item(), out.abs().sum().item()))
    print("layer time: median %.3f ms of %d runs after %d warm-up (%s; min %.3f, max %.3f)"
          % (statistics.median(times), a.runs, a.warmup, method, min(times), max(times)))


if __name__ == "__main__":
    main()
