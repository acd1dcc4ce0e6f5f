#!/usr/bin/env bash
# Scratch experiment for one H200 call (see bench/run-h200.sh): the test
# suite and moecl-bench with the default kernels, then the top-k cases
# again with MOECL_TOPK_ROUNDS=1 (the earlier top-k) to compare.
set -uo pipefail
STEPS="test bench" bash bench/run-h200.sh
export OCL_ICD_VENDORS=/tmp/icd MOECL_DEVICE=gpu MOECL_CACHE_DIR=/tmp/moecl-cache
echo "== MOECL_TOPK_ROUNDS=1"
MOECL_TOPK_ROUNDS=1 /tmp/b/tools/moecl-bench --only topk --json "$OUT/bench-rounds.json" 2>/dev/null | tee "$OUT/bench-rounds.txt"
