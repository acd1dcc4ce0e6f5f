#!/usr/bin/env bash
# On an NVIDIA GPU with NVIDIA's OpenCL, ncu and PyTorch (bench/README.md):
# fill a kernel cache with top-k variants through moecl-bench, then time
# them through the CUDA driver API (bench/ncu/ptx_harness.py) with CUDA
# events and under ncu (gpu__time_duration: the kernel alone, without
# OpenCL's launch floor), next to an empty kernel. Prints what it measured.
# BENCH: the moecl-bench to use (default build/tools/moecl-bench);
# NCU_CACHE: the kernel cache it fills (default a fresh temporary folder).
# The grounded router's kernels (grounded_router_mma, _tiled, _team) have
# their own script, bench/ncu/grounded.sh.
set -uo pipefail
cd "$(dirname "$0")/../.."
kc=${NCU_CACHE:-$(mktemp -d)}
rm -rf "$kc"
bench=${BENCH:-build/tools/moecl-bench}
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
    # Clocks as the application would run them (ncu locks them to base
    # by default), the durations of the last 3 of 5 launches.
    "$ncu" --clock-control none --metrics gpu__time_duration.sum,dram__bytes.sum \
        --csv $h $c --iters 5 2>&1 | grep -E "gpu__time_duration|dram__bytes|WRONG" | tail -6 |
        awk -F'","' '{print $5, $(NF-2), $NF}' 
done
[ "${NCU_DETAILS:-1}" = 1 ] || exit 0
echo "== ncu details, 1 token and 13526 tokens"
"$ncu" --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --metrics smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_short_scoreboard,smsp__pcsamp_warps_issue_stalled_membar,smsp__pcsamp_warps_issue_stalled_wait \
    $h --match NUM_EXPERTS=128 --match TEAM=16 --tokens 1 --iters 1 2>&1 | grep -vE "^ +(OPT|WRN|INF) |^          " | tail -75
"$ncu" --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section ComputeWorkloadAnalysis $h --match NUM_EXPERTS=256 --tokens 13526 --iters 1 2>&1 |
    grep -vE "^ +(OPT|WRN|INF) |^          " | tail -75
