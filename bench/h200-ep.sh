# The expert-parallel layout on the H200 (issue 17, item 4): the ep_layout
# suites in both launch classes, then moecl-bench's ep_layout cases next to
# the routing of the same shapes (--only x256: top-k softmax and DeepSeek-V3
# routing at 256 experts, and the layout at 1..13526 tokens, 8 and 64 ranks,
# with and without 32 doubled experts). The .debs/ for Check must be carried.
set -uo pipefail
OUT=${OUT:-/tmp/out}
STEPS="test bench" TESTS="ep_layout_gpu ep_layout_cpu" BENCH_ARGS="--only x256" bash bench/run-h200.sh \
    > "$OUT/ep.txt" 2>&1
grep -E "^ *[0-9]+/[0-9]+ |:F:|:E:|^ep_layout|^topk|routing \(|empty kernel" "$OUT/ep.txt"
