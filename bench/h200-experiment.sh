#!/usr/bin/env bash
# Scratch experiment for one H200 call (see bench/run-h200.sh): the GPU
# test suites, moecl-bench with the default kernels, then top-k at the large
# shapes for each team size (MOECL_TEAM).
set -uo pipefail
STEPS="test bench" TESTS="topk_gating_gpu grounded_router_gpu runtime" bash bench/run-h200.sh
export OCL_ICD_VENDORS=/tmp/icd MOECL_DEVICE=gpu MOECL_CACHE_DIR=/tmp/moecl-cache
for team in 8 16 32 64; do
    echo "== MOECL_TEAM=$team"
    MOECL_TEAM=$team /tmp/b/tools/moecl-bench --only custom --iterations 100 --wall-calls 200 \
        --shape 4083,128,8 --shape 8192,128,8 --shape 8037,256,8 --shape 13526,256,8 2>/dev/null | grep -E "^topk|empty"
    MOECL_TEAM=$team /tmp/b/tools/moecl-bench --only dsv3 --iterations 100 --wall-calls 200 2>/dev/null | grep -E "^topk"
done
