#!/usr/bin/env python3
"""PyTorch reference timings to set beside moecl's own (bench/RESULTS.md).

    python3 bench/torch_reference.py [--device cuda|cpu] [--threads N] [--json OUT] [--quick] [--only OP]
                                   [--logits normal|uniform10|hot|ties]

Measures, in plain PyTorch (standard library + torch only):
  seed_topk_gating   the seed's Model.forward (softmax, topk k=8, int32 ids), ten seed shapes
  deepseek_v3_route  vLLM-style grouped routing (sigmoid, bias, 8 groups, top-4 groups, top-8, x2.5)
  grounded_router    matmul, add with alpha, topk, softmax, stack -> (n, k, 2) of (index, weight)
  gemm_fp32 / _tf32 / _bf16 / _f16
                     token_hidden @ expert_ground.t() alone at the large grounded shape
  dsv3_router_gemm   DeepSeek-V3's router GEMM alone: hidden @ W^T, bf16 (hidden 7168, 256 experts)
  dsv3_router        that GEMM (fp32 logits) then deepseek_v3_route: the full router, 1/64/4083 tokens
  moe_align_sort     sort-based moe_align_block_size (block 64), ten seed shapes

CUDA: "eager" = one cuda-event pair per call, calls issued back to back (launch gaps count);
"cuda-graph" = the op captured `unroll` times in one CUDA graph, replayed `reps` times
between two events, time divided by unroll*reps (launch overhead removed).  Inputs stay
resident, so small shapes run from a warm L2.  fp32 matmuls run with
torch.backends.cuda.matmul.allow_tf32 = False unless labelled gemm_tf32.
CPU: torch.set_num_threads(N), time.perf_counter per call, "cpu-eager".
--logits: the seed top-k's logits, standard normal (default), uniform on [0, 10) (top values
crowd together), hot (standard normal, experts 0, E/8, 2E/8, ... raised by 3) or ties (levels
0..7 plus 0..3 times 2^-20: exact and near ties at the k-th place), as moecl-bench --logits
draws them (same kinds, not the same numbers).
"""
import argparse
import json
import os
import re
import statistics
import time

import torch

SEED_SHAPES = [(1, 128), (129, 128), (256, 128), (520, 128), (1019, 128),
               (2044, 128), (4083, 128), (8192, 128), (8037, 256), (13526, 256)]
DSV3_TOKENS = [1, 4083, 13526]
DSV3_ROUTER_TOKENS = [1, 64, 4083]
DSV3_HIDDEN = 7168


def blas_info():
    """The BLAS of this PyTorch build (BLAS_INFO of its build configuration),
    which the CPU GEMM figures depend on. A build against the generic
    libblas.so.3 (Debian's) runs whichever BLAS the system's alternatives
    name: then the library this process mapped is named too."""
    m = re.search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show())
    info = m.group(1) if m else "unknown"
    if info != "generic":
        return info
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libblas.so" in line}
    except OSError:
        return info
    return f"{info} ({', '.join(sorted(os.path.realpath(p) for p in paths))})" if paths else info
GROUNDED_SHAPES = [(4096, 128, 16, 2), (16384, 4096, 128, 8)]  # tokens, hidden, experts, top_k
ALPHA = 0.5
SEED = 1234


class Model(torch.nn.Module):
    """Verbatim from the seed (moe_topk_gating_softmax reference.py)."""

    def __init__(self, top_k: int, num_expert_groups: int = 0, topk_group: int = 0) -> None:
        super().__init__()
        self.top_k = top_k
        self.num_expert_groups = num_expert_groups
        self.topk_group = topk_group

    def forward(self, gating_output: torch.Tensor) -> dict[str, torch.Tensor]:
        scores = torch.softmax(gating_output.float(), dim=-1)
        if self.num_expert_groups > 0 and self.topk_group > 0:
            n, ne = scores.shape
            group_size = ne // self.num_expert_groups
            grouped = scores.view(n, self.num_expert_groups, group_size)
            group_scores = grouped.amax(dim=-1)
            _, top_groups = torch.topk(group_scores, k=self.topk_group, dim=-1)
            mask = torch.zeros(n, self.num_expert_groups, dtype=torch.bool, device=scores.device)
            mask.scatter_(1, top_groups, True)
            mask = mask.unsqueeze(-1).expand(-1, -1, group_size).reshape(n, ne)
            scores = scores.masked_fill(~mask, 0.0)
        (topk_weights, topk_ids) = torch.topk(scores, k=self.top_k, dim=-1)
        return {'topk_weights': topk_weights, 'topk_ids': topk_ids.to(torch.int32)}


def deepseek_v3_route(gating_output, bias, num_groups=8, topk_group=4, top_k=8, scale=2.5):
    """vLLM grouped_topk, scoring_func="sigmoid", with e_score_correction_bias."""
    n, ne = gating_output.shape
    scores = gating_output.sigmoid()
    biased = scores + bias.unsqueeze(0)                 # used for selection only
    group_scores = biased.view(n, num_groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(n, num_groups, ne // num_groups).reshape(n, ne)
    masked = biased.masked_fill(~score_mask.bool(), float("-inf"))
    topk_ids = torch.topk(masked, k=top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_ids)           # unbiased scores
    topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights * scale, topk_ids.to(torch.int32)


def grounded_router(token_hidden, router_logits, expert_ground, alpha, top_k):
    """Seed grounded router: router_logits + alpha * (hidden @ ground^T), top-k, softmax."""
    grounded = torch.add(router_logits, token_hidden @ expert_ground.t(), alpha=alpha)
    top_vals, top_idx = torch.topk(grounded, top_k, dim=-1)
    top_w = torch.softmax(top_vals, dim=-1)
    return torch.stack([top_idx.float(), top_w], dim=-1)   # (n, k, 2): [..., 0] index, [..., 1] weight


def router_gemm_fp32_out(hidden, weight):
    """g = hidden @ W^T from bf16 operands with fp32 logits out, as moecl computes it (and
    vLLM's dsv3_router_gemm); where torch.mm has no out_dtype (CPU), a bf16 result widened.
    The choice is made once, on the first call, so no exception is raised in a graph capture."""
    if FP32_OUT.get(hidden.device.type) is None:
        try:
            torch.mm(hidden[:1], weight.t(), out_dtype=torch.float32)
            FP32_OUT[hidden.device.type] = True
        except (RuntimeError, TypeError, NotImplementedError):
            FP32_OUT[hidden.device.type] = False
    if FP32_OUT[hidden.device.type]:
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    return (hidden @ weight.t()).float()


FP32_OUT = {}


def dsv3_router(hidden, weight, bias):
    """DeepSeek-V3's router as vLLM runs it: the router GEMM (g = hidden @ W^T, no router
    logits), then grouped_topk with the correction bias."""
    return deepseek_v3_route(router_gemm_fp32_out(hidden, weight), bias)


def check_dsv3_router(hidden, weight, bias):
    """Untimed check of dsv3_router's two steps against float64: the logits within the
    rounding of a bf16 result; the routing of those logits the same as float64's for
    nearly every token (a near-tie may flip one), and there the same weights."""
    logits = router_gemm_fp32_out(hidden, weight)
    g64 = hidden.double() @ weight.double().t()
    assert torch.allclose(logits.double(), g64, rtol=2.0 ** -7, atol=1e-3), "router GEMM disagrees"
    w, ids = deepseek_v3_route(logits, bias)
    ref_w, ref_ids = deepseek_v3_route(logits.double(), bias.double())
    order, ref_order = ids.long().sort(dim=-1), ref_ids.long().sort(dim=-1)
    same = (order.values == ref_order.values).all(dim=-1)
    assert same.double().mean() >= 0.99, "router chose different experts"
    w_sorted = w.double().gather(1, order.indices)[same]
    ref_sorted = ref_w.gather(1, ref_order.indices)[same]
    assert torch.allclose(w_sorted, ref_sorted, atol=1e-4), "router weights disagree"


def moe_align_sort(topk_ids, num_experts, block_size=64):
    """Sort-based vLLM-style moe_align_block_size: sorted_token_ids, block expert ids, total."""
    numel = topk_ids.numel()
    flat = topk_ids.flatten().long()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    unpadded_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)            # flattened slots grouped by expert
    sorted_experts = flat[order]
    rank = torch.arange(numel, device=flat.device) - unpadded_start[sorted_experts]
    max_padded = numel + num_experts * (block_size - 1)
    sorted_token_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=flat.device)
    sorted_token_ids[padded_start[sorted_experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_size, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert_ids = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_token_ids, block_expert_ids, padded_end[-1:].to(torch.int32)


def check_align(topk_ids, num_experts, block_size=64):
    """Untimed sanity check of moe_align_sort (every slot once, blocks hold their expert)."""
    ids, blocks, total = moe_align_sort(topk_ids, num_experts, block_size)
    ids, blocks, total, flat = ids.cpu(), blocks.cpu(), int(total), topk_ids.flatten().cpu()
    real = ids[:total][ids[:total] < flat.numel()].long()
    assert torch.equal(real.sort().values, torch.arange(flat.numel())), "slot lost or repeated"
    owner = blocks[(torch.arange(total) // block_size)]
    assert torch.equal(flat[real], owner[ids[:total] < flat.numel()]), "slot in wrong block"


def check_grounded(token_hidden, router_logits, expert_ground, alpha, top_k):
    """Untimed check that torch.add(alpha=) matches the seed's `logits + alpha * (h @ g^T)`."""
    out = grounded_router(token_hidden, router_logits, expert_ground, alpha, top_k)
    g = router_logits.double() + alpha * (token_hidden.double() @ expert_ground.double().t())
    ref = torch.softmax(torch.topk(g, top_k, dim=-1).values, dim=-1)
    assert torch.allclose(out[..., 1].double(), ref, atol=1e-4), "grounded weights disagree"


# ---------------------------------------------------------------- timing
HOT_EXPERTS, HOT_BOOST = 8, 3.0
TIE_LEVELS, TIE_STEPS, TIE_STEP = 8, 4, 2.0 ** -20


def random_logits(kind, t, e, dev):
    """The seed top-k's input, drawn as moecl-bench --logits KIND draws it (the same
    distributions, not the same numbers): randn; uniform on [0, 10); randn with 8 hot
    experts (every e/8-th from 0) raised by 3; levels 0..7 plus 0..3 times 2^-20 (ties)."""
    if kind == "uniform10":
        return 10.0 * torch.rand(t, e, dtype=torch.float32, device=dev)
    if kind == "ties":
        level = torch.randint(0, TIE_LEVELS, (t, e), device=dev).float()
        return level + TIE_STEP * torch.randint(0, TIE_STEPS, (t, e), device=dev).float()
    x = torch.randn(t, e, dtype=torch.float32, device=dev)
    if kind == "hot":
        stride = max(1, e // HOT_EXPERTS)
        x[:, torch.arange(0, min(e, stride * HOT_EXPERTS), stride, device=dev)] += HOT_BOOST
    return x


def summarize(samples_us):
    s = sorted(samples_us)
    q = statistics.quantiles(s, n=10, method="inclusive") if len(s) > 1 else [s[0]] * 9
    return statistics.median(s), q[0], q[8]


def time_cpu(fn, cfg):
    for _ in range(cfg["warmup"]):
        fn()
    samples, t_end = [], time.perf_counter() + cfg["budget_s"]
    while len(samples) < cfg["iters"] or (time.perf_counter() < t_end and len(samples) < 2000):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return samples, len(samples)


def time_cuda_eager(fn, cfg):
    for _ in range(cfg["warmup"]):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(cfg["iters"])]
    for start, end in ev:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in ev], cfg["iters"]


def time_cuda_graph(fn, cfg):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):                      # warm-up off the default stream
        for _ in range(cfg["warmup"]):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(cfg["unroll"]):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(cfg["graph_samples"]):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(cfg["reps"]):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (cfg["unroll"] * cfg["reps"]))
    del graph
    return samples, cfg["graph_samples"] * cfg["unroll"] * cfg["reps"]


# ---------------------------------------------------------------- driver
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"],
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (CPU only)")
    ap.add_argument("--json", metavar="OUT", help="write the records here as a JSON list")
    ap.add_argument("--quick", action="store_true", help="fewer iterations (smoke test)")
    ap.add_argument("--only", metavar="SUBSTRING", default="",
                    help="run only the ops whose name contains SUBSTRING (e.g. moe_align)")
    ap.add_argument("--logits", choices=["normal", "uniform10", "hot", "ties"], default="normal",
                    help="seed top-k logits: standard normal, uniform on [0, 10) (crowded top values), "
                         "normal with 8 hot experts raised by 3, or 8 levels with near-ties (many ties)")
    args = ap.parse_args()
    dev, cuda = args.device, args.device == "cuda"

    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        name = torch.cuda.get_device_name(0)
        cfg = dict(warmup=5, iters=50, unroll=10, reps=5, graph_samples=10) if args.quick else \
            dict(warmup=25, iters=300, unroll=10, reps=10, graph_samples=30)
        methods = [("eager", time_cuda_eager), ("cuda-graph", time_cuda_graph)]
    else:
        torch.set_num_threads(args.threads)
        name = f"cpu ({torch.get_num_threads()} threads)"
        cfg = dict(warmup=2, iters=5, budget_s=0.05) if args.quick else \
            dict(warmup=5, iters=20, budget_s=0.5)
        methods = [("cpu-eager", time_cpu)]
    blas = blas_info()
    print(f"torch {torch.__version__}  BLAS {blas}  device {name}  "
          f"allow_tf32={torch.backends.cuda.matmul.allow_tf32 if cuda else 'n/a'}  "
          f"{'quick' if args.quick else 'full'}  logits {args.logits}", flush=True)

    records = []

    def bench(op, shape, fn, graphable=True, method_list=None, extra=None):
        if args.only not in op:
            return
        for method, timer in (method_list or methods):
            if method == "cuda-graph" and not graphable:
                continue
            samples, iters = timer(fn, cfg)
            med, p10, p90 = summarize(samples)
            rec = dict(op=op, **shape, device=dev, device_name=name, method=method,
                       median_us=round(med, 3), p10_us=round(p10, 3), p90_us=round(p90, 3),
                       iterations=iters, torch=torch.__version__, blas=blas, **(extra or {}))
            records.append(rec)
            print(f"{op:<18} {fmt_shape(shape):<34} {method:<11} {med:>12.2f} {p10:>12.2f} "
                  f"{p90:>12.2f} {iters:>7}", flush=True)

    print(f"{'op':<18} {'shape':<34} {'method':<11} {'median_us':>12} {'p10_us':>12} "
          f"{'p90_us':>12} {'iters':>7}")

    # 1. seed top-k gating (exactly the seed Model.forward)
    model = Model(top_k=8)
    for t, e in SEED_SHAPES:
        torch.manual_seed(SEED)
        x = random_logits(args.logits, t, e, dev)
        bench("seed_topk_gating", dict(tokens=t, experts=e, top_k=8), lambda: model(x),
              extra=dict(logits=args.logits))

    # 2. DeepSeek-V3 grouped routing (eager only: the brief asks graphs for 1 and 3)
    for t in DSV3_TOKENS:
        torch.manual_seed(SEED)
        x = torch.randn(t, 256, dtype=torch.float32, device=dev)
        bias = 0.1 * torch.randn(256, dtype=torch.float32, device=dev)
        bench("deepseek_v3_route", dict(tokens=t, experts=256, top_k=8, groups=8, topk_group=4),
              lambda: deepseek_v3_route(x, bias), method_list=methods[:1])

    # 3. grounded router, five ops, plus the GEMM alone at the large shape
    for t, h, e, k in GROUNDED_SHAPES:
        torch.manual_seed(SEED)
        hid = torch.randn(t, h, dtype=torch.float32, device=dev)
        logits = torch.randn(t, e, dtype=torch.float32, device=dev)
        ground = torch.randn(e, h, dtype=torch.float32, device=dev) / h ** 0.5
        shape = dict(tokens=t, hidden=h, experts=e, top_k=k)
        check_grounded(hid[:64], logits[:64], ground, ALPHA, k)
        bench("grounded_router", shape, lambda: grounded_router(hid, logits, ground, ALPHA, k),
              extra=dict(alpha=ALPHA, tf32=False))
        if h == 4096:
            gshape = dict(tokens=t, hidden=h, experts=e)
            bench("gemm_fp32", gshape, lambda: hid @ ground.t(), extra=dict(tf32=False))
            if cuda:
                torch.backends.cuda.matmul.allow_tf32 = True
                bench("gemm_tf32", gshape, lambda: hid @ ground.t(), extra=dict(tf32=True))
                torch.backends.cuda.matmul.allow_tf32 = False
            for dtype, op in ((torch.bfloat16, "gemm_bf16"), (torch.float16, "gemm_f16")):
                if args.only not in op:
                    continue
                hid16, ground16 = hid.to(dtype), ground.to(dtype)
                bench(op, gshape, lambda: hid16 @ ground16.t(), extra=dict(dtype=str(dtype)[6:]))
                del hid16, ground16
        del hid, logits, ground

    # 4. DeepSeek-V3's router from hidden states: the bf16 GEMM alone, then GEMM + grouped_topk
    for t in DSV3_ROUTER_TOKENS:
        if args.only not in "dsv3_router_gemm":    # neither dsv3 op is asked for
            continue
        torch.manual_seed(SEED)
        hid = torch.randn(t, DSV3_HIDDEN, dtype=torch.float32, device=dev).to(torch.bfloat16)
        weight = (torch.randn(256, DSV3_HIDDEN, dtype=torch.float32, device=dev)
                  / DSV3_HIDDEN ** 0.5).to(torch.bfloat16)
        bias = 0.1 * torch.randn(256, dtype=torch.float32, device=dev)
        check_dsv3_router(hid, weight, bias)
        shape = dict(tokens=t, hidden=DSV3_HIDDEN, experts=256)
        router_gemm_fp32_out(hid[:1], weight)             # decides FP32_OUT for this device
        out = "float32" if FP32_OUT[hid.device.type] else "bfloat16, widened"
        bench("dsv3_router_gemm", shape, lambda: hid @ weight.t(),
              extra=dict(dtype="bfloat16", logits_dtype="bfloat16"))
        bench("dsv3_router", dict(**shape, top_k=8, groups=8, topk_group=4),
              lambda: dsv3_router(hid, weight, bias),
              extra=dict(dtype="bfloat16", logits_dtype=out, scoring="sigmoid", group_score="top2_sum",
                         renormalize=True, scale=2.5))
        del hid, weight, bias

    # 5. sort-based moe_align_block_size (bincount syncs on CUDA: eager only)
    for t, e in SEED_SHAPES:
        gen = torch.Generator(device=dev).manual_seed(SEED)
        ids = torch.randint(0, e, (t, 8), dtype=torch.int32, device=dev, generator=gen)
        check_align(ids, e)
        bench("moe_align_sort", dict(tokens=t, experts=e, top_k=8, block_size=64),
              lambda: moe_align_sort(ids, e, 64), method_list=methods[:1])

    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {len(records)} records to {args.json}")


def fmt_shape(shape):
    short = dict(tokens="T", experts="E", hidden="H", top_k="k", block_size="bs",
                 groups="G", topk_group="tg")
    return " ".join(f"{short.get(k, k)}={v}" for k, v in shape.items())


if __name__ == "__main__":
    main()
