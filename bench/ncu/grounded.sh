#!/usr/bin/env bash
# On an NVIDIA GPU with NVIDIA's OpenCL, ncu, ptxas and PyTorch
# (bench/README.md), a build in build/: ncu
# profiles of the grounded router's GPU kernels through
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
# now) for everything up to ncu's end; FILL_S (90) for the benches, PLAIN_S
# (45) for the plain run. TREES (below): other builds' kernels.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-ncu-out}
mkdir -p "$OUT"
work=$(mktemp -d)
T0=${T0:-$(date +%s)}
left() { local l=$(( ${BUDGET_S:-225} - ($(date +%s) - T0) )); echo $(( l > 5 ? l : 5 )); }
t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
# The cases: moecl-bench's --only that builds the kernel, and the harness's
# options that pick and feed it.
declare -A only=([bf16]="grounded bf16" [f32tiled]="grounded large" [x3tf32]="grounded 3xtf32"
                 [dsv3]="router dsv3" [seed]="grounded seed")
# The output variant is the one moecl-bench times: stacked pairs for the
# grounded router, weights and ids for moecl_router.
pairs="--match HAS_PAIRS=1 --match HAS_WEIGHTS=0 --match HAS_IDS=0"
declare -A opts=(
  [bf16]="--kernel grounded_router_mma --match IN_DTYPE=2 --match HIDDEN_DIM=4096 --tokens 16384 $pairs"
  [f32tiled]="--kernel grounded_router_tiled --match IN_DTYPE=0 --match HIDDEN_DIM=4096 --tokens 16384 $pairs"
  [x3tf32]="--kernel grounded_router_mma --match IN_DTYPE=0 --match PRECISION=2 --tokens 16384 $pairs"
  [dsv3]="--kernel grounded_router_mma --match HIDDEN_DIM=7168 --tokens 4083 --match HAS_PAIRS=0 --match HAS_WEIGHTS=1 --match HAS_IDS=1"
  [seed]="--kernel grounded_router_team --match HIDDEN_DIM=128 --match NUM_EXPERTS=16 --tokens 4096 $pairs")
# TREES: NAME:BUILD_DIR[:CASE,CASE...] a tree (default every case), each
# with its own moecl-bench and kernel cache; the cases of all trees run in
# one harness process, labelled NAME_CASE.
trees=${TREES:-main:build}
mkdir -p $OUT/p
cases=() pids=()
for tr in $trees; do
  IFS=: read -r n b list <<< "$tr"
  kc=$work/cache-$n; rm -rf $kc
  list=${list:-bf16,f32tiled,x3tf32,dsv3,seed}
  for c in ${list//,/ }; do
    [ -n "${opts[$c]:-}" ] || { echo "no case $c"; continue; }
    # One moecl-bench per case, all at once (cache writes are atomic).
    MOECL_CACHE_DIR=$kc timeout ${FILL_S:-90} "$b/tools/moecl-bench" --only "${only[$c]}" --iterations 20 \
      --wall-calls 20 > "$OUT/p/bench-${n}_$c.txt" 2>&1 &
    pids+=($!)
    cases+=("--cache $kc --label ${n}_$c ${opts[$c]} --dump $OUT/p/${n}_$c.ptx")
  done
done
h="python3 bench/ncu/ptx_harness.py"
args=(); for c in "${cases[@]}"; do args+=(--case "$c"); done
# A bench writes its kernel into the cache before its float64 check on the
# host, which takes tens of seconds at these sizes: once every case's entry
# is there (or the benches are done), the benches still running are stopped.
for i in $(seq 1 ${FILL_S:-90}); do
  $h --check-entries "${args[@]}" > /dev/null && break
  running=0; for p in "${pids[@]}"; do kill -0 $p 2>/dev/null && running=1; done
  [ $running = 1 ] || break
  sleep 1
done
$h --check-entries "${args[@]}" | head -3
for p in "${pids[@]}"; do kill $p 2>/dev/null; done
wait; t "caches filled"
grep -HE "^(grounded|router)" $OUT/p/bench-*.txt | sed 's|^.*/bench-||' | cut -c1-170
for kc in $work/cache-*; do
  $h --cache $kc --list | awk '{$1=""; print}' | grep -o "grounded_router_[a-z]*.*" | cut -c1-300 | sort | uniq |
    sed "s|^|$(basename $kc): |" >> $OUT/p/list.txt
done
wc -l < $OUT/p/list.txt
# Plain run first: the checks and CUDA-event times without ncu (PLAIN_S
# seconds at most; 0 skips it).
if [ "${PLAIN_S:-45}" != 0 ]; then timeout ${PLAIN_S:-45} $h "${args[@]}" --iters 20; t "harness rc $?"; fi
for p in $OUT/p/*.ptx; do
  ptxas -arch=sm_90 -v "$p" -o $work/x.cubin 2>&1 | grep -E "Used|spill" | sed "s|^|$(basename $p .ptx): |" | tee -a $OUT/p/ptxas.txt | grep -v "^$" | tail -2
done
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
secs="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats
  --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis"
mets="sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__bytes.sum.per_second"
rm -f $work/prof.ncu-rep
timeout $(left) $ncu --profile-from-start off --clock-control none $secs --metrics $mets -o $work/prof \
  $h --profile-range "${args[@]}" --iters 1 > $OUT/p/ncu-run.txt 2>&1; t "ncu rc $?"
if [ ! -s $work/prof.ncu-rep ] && [ $(left) -gt 30 ]; then
  tail -5 $OUT/p/ncu-run.txt
  timeout $(left) $ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis -o $work/prof \
    $h --profile-range "${args[@]}" --iters 1 > $OUT/p/ncu-run2.txt 2>&1; t "ncu (five sections, no extra metrics) rc $?"
fi
grep -E "WRONG|FAILED|ERROR" $OUT/p/ncu-run*.txt | head -5
$ncu -i $work/prof.ncu-rep --page raw --csv > $OUT/ncu-raw.csv 2>&1
$ncu -i $work/prof.ncu-rep --page details > $OUT/ncu-details.txt 2>&1
python3 bench/ncu/ncu_summary.py $OUT/ncu-raw.csv
grep -vE "^ +(OPT|WRN|INF) |^          " $OUT/ncu-details.txt | grep -E "^  [a-z_]+__|Duration|Throughput|Occupancy|Registers|Shared Memory Config|Waves|Warp Cycles|Eligible|Issued Warp|Hit Rate|Pipe" | cut -c1-120 | head -150
