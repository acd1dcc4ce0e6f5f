#!/usr/bin/env python3
"""Markdown tables for bench/RESULTS.md from the JSON that moecl-bench
(--json) and bench/torch_reference.py (--json) write.

    python3 bench/tables.py --moecl BENCH.json [--torch TORCH.json] [--vllm]

--vllm adds vLLM's CUDA figures on the H200 (fp32, top_k 8, CUDA graph,
L2-warm; not measured by this harness) and the targets beside the seed
shapes.
"""
import argparse
import json

# vLLM's own CUDA topk_softmax on an H200 (fp32, top_k 8, CUDA graph,
# L2-warm), and its grouped DeepSeek-V3 kernel.
VLLM_US = {(1, 128): 3.6, (4083, 128): 9.0, (8192, 128): 14.8, (8037, 256): 17.6, (13526, 256): 26.9}
VLLM_DSV3_US = {4083: 13.3, 13526: 36.7}


def torch_median(records, op, method, **fields):
    for r in records:
        if r["op"] == op and r["method"] == method and all(r.get(k) == v for k, v in fields.items()):
            return r["median_us"]
    return None


def fmt(v, digits=2):
    return "–" if v is None else f"{v:.{digits}f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moecl", required=True)
    ap.add_argument("--torch")
    ap.add_argument("--vllm", action="store_true")
    a = ap.parse_args()
    m = json.load(open(a.moecl))
    t = json.load(open(a.torch)) if a.torch else []
    empty = m["empty_kernel_us"]
    print(f"Empty kernel: {empty:.2f} µs device time; copy kernel: {m['copy_gbps']:.0f} GB/s; "
          f"context creation {m.get('context_create_ms', 0):.1f} ms.\n")

    print("| shape (T×E, k 8) | device µs | above empty | wall µs/call | GB/s | % copy | T_SOL | T_Prod |"
          + (" vLLM CUDA | target |" if a.vllm else "")
          + (" PyTorch µs |" if t else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|---|" if a.vllm else "") + ("---|" if t else ""))
    for c in m["cases"]:
        if c["op"] != "topk softmax":
            continue
        tokens, experts = (int(x) for x in c["shape"].split()[0].split("x"))
        row = (f"| {tokens}×{experts} | {c['device_us']:.2f} | {c['device_us'] - empty:.2f} | {c['wall_us']:.2f} | "
               f"{c['gbps']:.0f} | {100 * c['copy_ratio']:.1f} | {c['t_sol_us']:.2f} | {c['t_prod_us']:.1f} |")
        if a.vllm:
            vllm = VLLM_US.get((tokens, experts))
            target = f"≤ {vllm / 2:.2f}" if vllm and tokens >= 4083 else f"≤ {empty + 1.5:.2f}"
            row += f" {fmt(vllm, 1)} | {target} |"
        if t:
            graph = torch_median(t, "seed_topk_gating", "cuda-graph", tokens=tokens, experts=experts)
            eager = torch_median(t, "seed_topk_gating", "eager", tokens=tokens, experts=experts)
            cpu = torch_median(t, "seed_topk_gating", "cpu-eager", tokens=tokens, experts=experts)
            row += f" {fmt(graph, 1)} graph / {fmt(eager, 1)} eager |" if graph or eager else f" {fmt(cpu, 0)} |"
        print(row)

    print("\n| case | shape | dtype | device µs | wall µs/call | GB/s |" + (" vLLM CUDA | target |" if a.vllm else "")
          + (" PyTorch µs |" if t else ""))
    print("|---|---|---|---|---|---|" + ("---|---|" if a.vllm else "") + ("---|" if t else ""))
    for c in m["cases"]:
        if c["op"] == "topk softmax":
            continue
        dtype = ["f32", "f16", "bf16", "i32"][c["dtype"]]
        row = f"| {c['op']} | {c['shape']} | {dtype} | {c['device_us']:.2f} | {c['wall_us']:.2f} | {c['gbps']:.0f} |"
        extra_torch = None
        if "dsv3" in c["op"]:
            tokens = int(c["shape"].split("x")[0])
            if a.vllm:
                vllm = VLLM_DSV3_US.get(tokens)
                target = {4083: "≤ 6.6", 13526: "≤ 18"}.get(tokens, f"≤ {empty + 1.5:.2f}")
                row += f" {fmt(vllm, 1)} | {target} |"
            extra_torch = torch_median(t, "deepseek_v3_route", "eager", tokens=tokens) or \
                torch_median(t, "deepseek_v3_route", "cpu-eager", tokens=tokens)
        elif "grounded" in c["op"]:
            tokens, hidden, experts = (int(x) for x in c["shape"].split()[0].split("x"))
            if a.vllm:
                row += " – | " + ("≤ 5" if tokens == 4096 else "≤ 2 × GEMM") + " |"
            for method in ("cuda-graph", "cpu-eager"):
                extra_torch = extra_torch or torch_median(t, "grounded_router", method, tokens=tokens, hidden=hidden,
                                                          experts=experts)
        elif a.vllm:
            row += " – | – |"
        if t:
            row += f" {fmt(extra_torch, 1)} |"
        print(row)

    gemm = [r for r in t if r["op"].startswith("gemm")]
    if gemm:
        print("\nPyTorch GEMM alone at 16384×4096×128 (the yardstick): " + "; ".join(
            f"{r['op']} {r['method']} {r['median_us']:.1f} µs" for r in gemm))


if __name__ == "__main__":
    main()
