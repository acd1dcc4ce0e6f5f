#!/usr/bin/env bash
# On the H200 (bench/run-h200.sh's environment, a build in /tmp/b): ncu
# profiles of the grounded router's GPU kernels (issue 15) through
# bench/ncu/ptx_harness.py. Fills a kernel cache through moecl-bench (one
# process a case, all at once: their float64 checks on the host are the
# slow part, and cache writes are atomic; their device times print beside
# the profiles), runs the harness's cases once plainly (checks, CUDA-event
# times), ptxas -v on their PTX, then once under ncu, one profiled launch a
# case (--profile-range), and prints bench/ncu/ncu_summary.py's table.
#   bf16      grounded_router_mma, 16384 x 4096 x 128 top 8 (moecl-bench "grounded bf16")
#   f32tiled  grounded_router_tiled, the same shape in f32 ("grounded large")
#   x3tf32    grounded_router_mma, the same in f32 with PRECISION 3xTF32 ("grounded 3xtf32")
#   dsv3      grounded_router_mma, DeepSeek-V3's router 4083 x 7168 x 256 bf16 ("router dsv3")
#   seed      grounded_router_team, 4096 x 128 x 16 top 2 ("grounded seed")
# Writes under $OUT: ncu-raw.csv (ncu's raw page), ncu-details.txt, and in
# $OUT/p the benches' output, the cache list, the PTX and ptxas -v. Limits:
# BUDGET_S (default 225) seconds from T0 (the caller's start, default
# now) for everything up to ncu's end. EXTRA_BENCH: one more moecl-bench
# --only; EXTRA_CASES: a file of more harness cases, one a line.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T0=${T0:-$(date +%s)}
left() { local l=$(( ${BUDGET_S:-225} - ($(date +%s) - T0) )); echo $(( l > 5 ? l : 5 )); }
t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
bench=${BENCH:-/tmp/b/tools/moecl-bench}
kc=/tmp/prof-cache; rm -rf $kc; mkdir -p $OUT/p
# One moecl-bench per case, all at once (their host float64 checks are the
# slow part; the cache writes are atomic): device times beside the ncu ones.
for c in "grounded bf16" "grounded large" "grounded 3xtf32" "router dsv3" "grounded seed" ${EXTRA_BENCH:+"$EXTRA_BENCH"}; do
  (MOECL_CACHE_DIR=$kc timeout 60 "$bench" --only "$c" --iterations 20 --wall-calls 20 \
     > "$OUT/p/bench-${c// /_}.txt" 2>&1) &
done
wait; t "cache filled"
grep -hE "^(grounded|router)" $OUT/p/bench-*.txt | cut -c1-160
h="python3 bench/ncu/ptx_harness.py --cache $kc"
$h --list | awk '{$1=""; print}' | grep -o "grounded_router_[a-z]*.*" | cut -c1-300 | sort | uniq > $OUT/p/list.txt
wc -l < $OUT/p/list.txt
cases=(
  "--label bf16 --kernel grounded_router_mma --match IN_DTYPE=2 --match HIDDEN_DIM=4096 --tokens 16384 --dump $OUT/p/bf16.ptx"
  "--label f32tiled --kernel grounded_router_tiled --match IN_DTYPE=0 --match HIDDEN_DIM=4096 --tokens 16384 --dump $OUT/p/f32tiled.ptx"
  "--label x3tf32 --kernel grounded_router_mma --match IN_DTYPE=0 --match PRECISION=2 --tokens 16384 --dump $OUT/p/x3tf32.ptx"
  "--label dsv3 --kernel grounded_router_mma --match HIDDEN_DIM=7168 --tokens 4083 --dump $OUT/p/dsv3.ptx"
  "--label seed --kernel grounded_router_team --match HIDDEN_DIM=128 --match NUM_EXPERTS=16 --tokens 4096 --dump $OUT/p/seed.ptx"
)
# More cases, one harness option line each (a kernel of another tree's
# cache, say), from the file EXTRA_CASES.
[ -n "${EXTRA_CASES:-}" ] && while read -r c; do [ -n "$c" ] && cases+=("$c"); done < "$EXTRA_CASES"
args=(); for c in "${cases[@]}"; do args+=(--case "$c"); done
# Plain run first: the checks and CUDA-event times without ncu.
timeout 45 $h "${args[@]}" --iters 20; t "harness rc $?"
for p in $OUT/p/*.ptx; do
  ptxas -arch=sm_90 -v "$p" -o /tmp/x.cubin 2>&1 | grep -E "Used|spill" | sed "s|^|$(basename $p .ptx): |" | tee -a $OUT/p/ptxas.txt | grep -v "^$" | tail -2
done
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
secs="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats
  --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis"
mets="sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__bytes.sum.per_second"
rm -f /tmp/prof.ncu-rep
timeout $(left) $ncu --profile-from-start off --clock-control none $secs --metrics $mets -o /tmp/prof \
  $h --profile-range "${args[@]}" --iters 1 > $OUT/p/ncu-run.txt 2>&1; t "ncu rc $?"
if [ ! -s /tmp/prof.ncu-rep ] && [ $(left) -gt 30 ]; then
  tail -5 $OUT/p/ncu-run.txt
  timeout $(left) $ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis -o /tmp/prof \
    $h --profile-range "${args[@]}" --iters 1 > $OUT/p/ncu-run2.txt 2>&1; t "ncu (five sections, no extra metrics) rc $?"
fi
grep -E "WRONG|FAILED|ERROR" $OUT/p/ncu-run*.txt | head -5
$ncu -i /tmp/prof.ncu-rep --page raw --csv > $OUT/ncu-raw.csv 2>&1
$ncu -i /tmp/prof.ncu-rep --page details > $OUT/ncu-details.txt 2>&1
python3 bench/ncu/ncu_summary.py $OUT/ncu-raw.csv
grep -vE "^ +(OPT|WRN|INF) |^          " $OUT/ncu-details.txt | grep -E "^  [a-z_]+__|Duration|Throughput|Occupancy|Registers|Shared Memory Config|Waves|Warp Cycles|Eligible|Issued Warp|Hit Rate|Pipe" | cut -c1-120 | head -150
