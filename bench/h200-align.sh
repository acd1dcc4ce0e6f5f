set -uo pipefail
OUT=${OUT:-/tmp/out}
STEPS="bench" BENCH_ARGS="--only align" bash bench/run-h200.sh > $OUT/auto.txt 2>&1
grep -A1 -E "^moe_align|empty" $OUT/auto.txt
export OCL_ICD_VENDORS=/tmp/icd MOECL_DEVICE=gpu MOECL_CACHE_DIR=/tmp/moecl-cache
for m in chunked one-group; do echo "== MOECL_ALIGN=$m"; MOECL_ALIGN=$m /tmp/b/tools/moecl-bench --only align --json $OUT/bench-$m.json 2>/dev/null | grep -A1 -E "^moe_align"; done
echo "== probe"
gcc -O2 bench/experiments/align_probe.c -Iinclude -L/tmp/b/src -lmoecl -lOpenCL -o /tmp/probe && for m in auto chunked; do echo "-- $m"; MOECL_ALIGN=$m LD_LIBRARY_PATH=/tmp/b/src /tmp/probe; done
