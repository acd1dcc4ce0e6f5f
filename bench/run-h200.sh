#!/usr/bin/env bash
# One call on the H200 machine (see bench/RESULTS.md): register NVIDIA's
# OpenCL with the ICD loader, unpack Check from the carried .debs/, build,
# run the test suite, moecl-info, moecl-bench and the PyTorch comparison.
# Everything it prints also lands in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/icd
echo /usr/lib/libnvidia-opencl.so.1 > /tmp/icd/nvidia.icd
export OCL_ICD_VENDORS=/tmp/icd PATH=/opt/torch/.venv/bin:$PATH MOECL_DEVICE=${MOECL_DEVICE:-gpu}
export MOECL_CACHE_DIR=/tmp/moecl-cache
steps=${STEPS:-"test bench torch"}

tests_opt=-Dtests=disabled
# The carried .debs/ (Check for the suites, cJSON for the tools) are
# unpacked into /tmp/debs; meson finds them through PKG_CONFIG_PATH once
# their .pc files' prefix points there.
if [ -d .debs ]; then
    mkdir -p /tmp/debs
    for d in .debs/*.deb; do dpkg -x "$d" /tmp/debs; done
    for pc in $(find /tmp/debs -name "*.pc"); do sed -i -e "s|^prefix=.*|prefix=/tmp/debs/usr|" -e "s|=/usr/|=/tmp/debs/usr/|" "$pc"; done
    lib=/tmp/debs/usr/lib/x86_64-linux-gnu
    export PKG_CONFIG_PATH=$lib/pkgconfig LIBRARY_PATH=$lib LD_LIBRARY_PATH=$lib C_INCLUDE_PATH=/tmp/debs/usr/include
    [[ " $steps " == *" test "* ]] && tests_opt=-Dtests=enabled
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
meson setup /tmp/b $tests_opt -Dbuildtype=release > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
ninja -C /tmp/b > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
/tmp/b/tools/moecl-info | tee "$OUT/info.txt"
if [[ " $steps " == *" test "* ]]; then
    # The suites are not parallel-safe on a 2-core CI machine (is_parallel:
    # false), but this machine has 16 cores and one GPU: run each suite as
    # its own meson test, all at once, with separate logs. No ocloc or
    # clang-15 here: the portability suite skips its targets.
    export MOECL_PORTABILITY=skip
    names=${TESTS:-$(meson test -C /tmp/b --list 2>/dev/null | sed 's/^.* \/ //')}
    for t in $names; do
        meson test -C /tmp/b --print-errorlogs --logbase "log-$t" "$t" > "$OUT/test-$t.log" 2>&1 &
    done
    wait
    cat "$OUT"/test-*.log > "$OUT/test.log"
    grep -hE "^ *[0-9]+/[0-9]+ |^\.\./|:F:|:E:" "$OUT"/test-*.log
fi
if [[ " $steps " == *" bench "* ]]; then
    /tmp/b/tools/moecl-bench --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>/dev/null | tee "$OUT/bench.txt"
fi
if [[ " $steps " == *" torch "* ]] && [ -f bench/torch_reference.py ]; then
    python3 bench/torch_reference.py --device cuda --json "$OUT/torch.json" ${TORCH_ARGS:-} 2>&1 | tee "$OUT/torch.txt"
fi
