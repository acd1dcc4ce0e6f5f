#!/usr/bin/env bash
# On the H200 (bench/run-h200.sh's environment, a build in /tmp/b): fill a
# kernel cache with top-k variants through moecl-bench, then time them
# through the CUDA driver API (bench/ncu/ptx_harness.py) with CUDA events
# and under ncu (gpu__time_duration: the kernel alone, without OpenCL's
# launch floor), next to an empty kernel. Prints what it measured.
set -uo pipefail
cd "$(dirname "$0")/../.."
kc=${NCU_CACHE:-/tmp/ncu-cache}
rm -rf "$kc"
bench=${BENCH:-/tmp/b/tools/moecl-bench}
MOECL_CACHE_DIR=$kc "$bench" --shape 1,128,8 --shape 8192,128,8 --shape 13526,256,8 --only custom \
    --iterations 20 > /dev/null 2>&1 || echo "moecl-bench failed filling the cache"
for t in ${NCU_TEAMS:-32 64}; do
    MOECL_TEAM=$t MOECL_CACHE_DIR=$kc "$bench" --shape 1,128,8 --only custom --iterations 20 > /dev/null 2>&1 ||
        echo "moecl-bench (MOECL_TEAM=$t) failed filling the cache"
done
h="python3 bench/ncu/ptx_harness.py --cache $kc"
$h --list
cases=("--kernel empty" "--match NUM_EXPERTS=128 --match TEAM=16 --tokens 1"
       "--match NUM_EXPERTS=128 --match TEAM=32 --tokens 1" "--match NUM_EXPERTS=128 --match TEAM=64 --tokens 1"
       "--match NUM_EXPERTS=128 --match TEAM=16 --tokens 129"
       "--match NUM_EXPERTS=128 --match TEAM=16 --tokens 8192" "--match NUM_EXPERTS=256 --tokens 13526")
for c in "${cases[@]}"; do $h $c; done
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for c in "${cases[@]}"; do
    echo "== ncu $c"
    "$ncu" --metrics gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,dram__bytes.sum \
        --csv $h $c --iters 5 2>&1 | grep -E "gpu__time_duration|sm__warps|dram__bytes|WRONG|ok \(" | tail -8
done
echo "== ncu details, 1 token and 13526 tokens"
"$ncu" --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    $h --match NUM_EXPERTS=128 --match TEAM=16 --tokens 1 --iters 1 2>&1 | tail -80
"$ncu" --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    $h --match NUM_EXPERTS=256 --tokens 13526 --iters 1 2>&1 | tail -70
