#!/usr/bin/env python3
"""Markdown tables for bench/RESULTS.md from the JSON that moecl-bench
(--json) and bench/torch_reference.py (--json) write.

    python3 bench/tables.py --moecl BENCH.json [--torch TORCH.json] [--vllm]
    python3 bench/tables.py --cpu DIR [--summary OUT.json]

--vllm adds vLLM's CUDA figures on the H200 (fp32, top_k 8, CUDA graph,
L2-warm; not measured by this harness) and the targets beside the seed
shapes. --cpu reads the folder bench/cpu_topk.sh writes and prints its
CPU tables (medians of the rounds' medians); --summary writes their rows
as JSON.
"""
import argparse
import glob
import json
import os
import re
import statistics

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


CPU_IMPLS = ("pocl", "intel")
CPU_NAMES = {"pocl": "pocl", "intel": "Intel"}


def round_files(folder, stem):
    """stem-r1.json, stem-r2.json, ... in round order."""
    files = glob.glob(os.path.join(folder, glob.escape(stem) + "-r*.json"))
    return sorted(files, key=lambda f: int(re.search(r"-r(\d+)\.json$", f).group(1)))


def median_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def moecl_rounds(folder, stem, shape):
    """Each round's (device_us, wall_us) of one moecl-bench case."""
    out = []
    for f in round_files(folder, stem):
        for c in json.load(open(f))["cases"]:
            if c["shape"] == shape:
                out.append((c["device_us"], c["wall_us"]))
    return out


def torch_rounds(folder, stem, op, **fields):
    return [torch_median(json.load(open(f)), op, "cpu-eager", **fields) for f in round_files(folder, stem)]


def ratio(a, b, digits=1):
    return fmt(a / b, digits) if a is not None and b else "–"


def cpu_main(folder, summary_path):
    meta = json.load(open(os.path.join(folder, "meta.json")))
    info = {i: json.load(open(os.path.join(folder, f"info-{i}.json")))["picked"] for i in CPU_IMPLS}
    torch_files = glob.glob(os.path.join(folder, "torch-*.json"))
    any_torch = next((r for f in torch_files for r in json.load(open(f))), {})
    # The copy kernel's rate (read + write), from the runs with --copy-floor.
    copy = {i: median_or_none([json.load(open(f)).get("copy_gbps")
                               for f in glob.glob(os.path.join(folder, f"topk-{i}-*-r*.json"))]) for i in CPU_IMPLS}
    summary = dict(meta=meta, devices=info, copy_gbps=copy, topk=[], grounded=[])

    print(f"{meta['cpu']}, {meta['cores']} cores. " + "; ".join(
        f"{CPU_NAMES[i]}: {info[i]['platform']} {info[i]['driver']} ({info[i]['device']})" for i in CPU_IMPLS)
        + f". PyTorch {any_torch.get('torch', '?')}, BLAS {any_torch.get('blas', '?')}, {meta['threads']} threads "
        f"(cpu-eager). {meta['date']}, commit {meta['commit']}{' (uncommitted changes)' if meta['dirty'] else ''}, "
        f"`bench/cpu_topk.sh`: " + (f"{meta['rounds']} rounds alternated, medians of the rounds' medians"
                                     if meta["rounds"] > 1 else "one round") + "; load "
        f"{meta['load_before']} before, {meta.get('load_after', '?')} after"
        + (". **--quick: a trial of the script, not a measurement**" if meta["quick"] else "") + ".\n")
    print("Copy kernel (1 GiB each way, read + write): " + ", ".join(
        f"{CPU_NAMES[i]} {fmt(copy[i], 1)} GB/s" for i in CPU_IMPLS)
        + ". *read*: the logits' bytes at that rate; device ÷ read is the moonshot's measure (≤ 2). µs.\n")

    print("| shape | logits | pocl device | pocl wall | Intel device | Intel wall | PyTorch | PyTorch ÷ pocl wall "
          "| PyTorch ÷ Intel wall | device ÷ read, pocl / Intel |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind in meta["kinds"]:
        for tokens, experts in ((1019, 128), (2044, 128), (4083, 128), (8192, 128), (8037, 256), (13526, 256)):
            shape = f"{tokens}x{experts} k8"
            dev, wall, read = {}, {}, {}
            for i in CPU_IMPLS:
                rounds = moecl_rounds(folder, f"topk-{i}-{kind}", shape)
                dev[i] = median_or_none([d for d, _ in rounds])
                wall[i] = median_or_none([w for _, w in rounds])
                read[i] = tokens * experts * 4 / (copy[i] * 1e3) if copy[i] else None
            pt = median_or_none(torch_rounds(folder, f"torch-topk-{kind}", "seed_topk_gating", tokens=tokens,
                                             experts=experts))
            if all(dev[i] is None for i in CPU_IMPLS) and pt is None:
                continue
            summary["topk"].append(dict(tokens=tokens, experts=experts, logits=kind, device_us=dev, wall_us=wall,
                                        read_us=read, torch_us=pt))
            print(f"| {tokens}×{experts} | {kind} | {fmt(dev['pocl'], 1)} | {fmt(wall['pocl'], 1)} | "
                  f"{fmt(dev['intel'], 1)} | {fmt(wall['intel'], 1)} | {fmt(pt, 0)} | {ratio(pt, wall['pocl'])} | "
                  f"{ratio(pt, wall['intel'])} | {ratio(dev['pocl'], read['pocl'], 2)} / "
                  f"{ratio(dev['intel'], read['intel'], 2)} |")

    shape = "16384x4096x128 k8"
    pt = median_or_none(torch_rounds(folder, "torch-grounded", "grounded_router", tokens=16384, hidden=4096,
                                     experts=128))
    gemm = median_or_none(torch_rounds(folder, "torch-gemm", "gemm_fp32"))
    rows = []
    for i in CPU_IMPLS:
        rounds = moecl_rounds(folder, f"grounded-{i}", shape)
        if rounds:
            rows.append((i, median_or_none([d for d, _ in rounds]), median_or_none([w for _, w in rounds])))
    if rows or pt:
        summary["grounded"] = [dict(impl=i, device_us=d, wall_us=w, torch_us=pt, torch_gemm_us=gemm)
                               for i, d, w in rows]
        print("\nGrounded router 16384 × 4096 × 128, top 8, f32 (`grounded large`), ms. PyTorch: its five ops "
              f"(matmul, add, topk, softmax, stack) {fmt(pt and pt / 1e3, 1)}; the fp32 GEMM alone "
              f"{fmt(gemm and gemm / 1e3, 1)}.\n")
        print("| implementation | device | wall | PyTorch ÷ wall |")
        print("|---|---:|---:|---:|")
        for i, d, w in rows:
            print(f"| {CPU_NAMES[i]} | {fmt(d and d / 1e3, 1)} | {fmt(w and w / 1e3, 1)} | {ratio(pt, w, 2)} |")
    if summary_path:
        with open(summary_path, "w") as f:
            json.dump(summary, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--moecl")
    group.add_argument("--cpu", metavar="DIR", help="the folder bench/cpu_topk.sh wrote")
    ap.add_argument("--summary", metavar="OUT", help="with --cpu: the tables' rows as JSON")
    ap.add_argument("--torch")
    ap.add_argument("--vllm", action="store_true")
    a = ap.parse_args()
    if a.cpu:
        cpu_main(a.cpu, a.summary)
        return
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
