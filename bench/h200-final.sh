#!/usr/bin/env bash
# The last H200 call of a session: every test suite (in parallel), the full
# bench (JSON in $OUT), moecl-tune, and the bench again with the tuned
# configurations in effect.
set -uo pipefail
OUT=${OUT:-/tmp/out}
STEPS="test bench" bash bench/run-h200.sh 2>&1 | grep -vE "^  |^(platform|device|driver|type|vendor|compute|local|max|launch|kernel|moecl 0)"
export OCL_ICD_VENDORS=/tmp/icd MOECL_DEVICE=gpu MOECL_CACHE_DIR=/tmp/moecl-cache
echo "== moecl-tune"
timeout 170 /tmp/b/tools/moecl-tune ${TUNE_ARGS:---quick} 2>/dev/null | tee "$OUT/tune.txt"
echo "== moecl-info after tuning"
/tmp/b/tools/moecl-info | sed -n '/moecl picks/,$p' | tee "$OUT/info-tuned.txt"
echo "== bench, tuned"
/tmp/b/tools/moecl-bench --only topk --json "$OUT/bench-tuned.json" 2>/dev/null | grep -E "^topk|empty" | tee "$OUT/bench-tuned.txt"
