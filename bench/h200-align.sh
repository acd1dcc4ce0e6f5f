set -uo pipefail
OUT=${OUT:-/tmp/out}
STEPS="bench" BENCH_ARGS="--only align" bash bench/run-h200.sh > $OUT/auto.txt 2>&1
grep -E "^moe_align|empty" $OUT/auto.txt
export OCL_ICD_VENDORS=/tmp/icd MOECL_DEVICE=gpu MOECL_CACHE_DIR=/tmp/moecl-cache
for m in chunked one-group; do echo "== MOECL_ALIGN=$m"; MOECL_ALIGN=$m /tmp/b/tools/moecl-bench --only align --json $OUT/bench-$m.json 2>/dev/null | grep -E "^moe_align"; done
