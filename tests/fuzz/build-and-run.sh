#!/usr/bin/env bash
# Build the libFuzzer target (tests/fuzz/fuzz_routing.c) and run it on pocl.
#
#   tests/fuzz/build-and-run.sh [SECONDS] [libFuzzer arguments...]
#
# SECONDS (default 60) is -max_total_time. The library sources, the float64
# reference and the target are compiled with clang directly, all with
# -fsanitize=fuzzer,address,undefined (the meson build may use gcc, which
# has no libFuzzer). Needs clang 14 or newer with its compiler-rt (Debian:
# clang-14 and libclang-rt-14-dev). The build goes to $MOECL_FUZZ_DIR
# (default build-fuzz/); the run starts from the committed seeds in
# tests/fuzz/corpus/ and writes what it finds to build-fuzz/corpus/ and
# crashes to build-fuzz/artifacts/. Exits non-zero on any crash, sanitizer
# report or broken invariant.
#
# Reproduce a crash: build-fuzz/fuzz_routing build-fuzz/artifacts/crash-...
# (with the environment this script sets below).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
seconds=${1:-60}
[ $# -gt 0 ] && shift
out=${MOECL_FUZZ_DIR:-$root/build-fuzz}

cc=${MOECL_FUZZ_CC:-}
if [ -z "$cc" ]; then
    for c in clang-14 clang-15 clang; do
        if command -v "$c" >/dev/null; then cc=$c; break; fi
    done
fi
[ -n "$cc" ] || { echo "build-and-run.sh: no clang found (apt-get install clang-14 libclang-rt-14-dev)" >&2; exit 1; }

mkdir -p "$out/corpus" "$out/artifacts" "$out/kernel-cache"
version=$(sed -n "s/^ *version : '\([0-9.]*\)'.*/\1/p" meson.build | head -n 1)
# moecl/version.h, as include/moecl/meson.build makes it.
mkdir -p "$out/moecl"
IFS=. read -r major minor patch <<<"$version"
sed -e "s/@MAJOR@/$major/" -e "s/@MINOR@/$((10#$minor))/" -e "s/@PATCH@/$((10#$patch))/" -e "s/@VERSION@/$version/" \
    include/moecl/version.h.in > "$out/moecl/version.h"
# Every kernel source, as cl/meson.build embeds them.
python3 cl/embed.py "$out/embedded_kernels.c" cl/layout.h cl/*.cl

flags=(-std=c11 -g -O1 -Wall -Wextra -Werror -fno-omit-frame-pointer
       -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
       -DCL_TARGET_OPENCL_VERSION=120 -D_GNU_SOURCE
       -DMOECL_BUILDING_LIBRARY
       -Iinclude -Isrc -Itests -I"$out")
echo "build-and-run.sh: building $out/fuzz_routing with $cc"
"$cc" "${flags[@]}" -o "$out/fuzz_routing" \
    src/*.c "$out/embedded_kernels.c" tests/reference.c tests/fuzz/fuzz_routing.c \
    -lOpenCL -lm -lpthread

# The sanitizer settings of the meson sanitizer build (tests/meson.build).
supp="$root/tests/sanitizers"
export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:detect_stack_use_after_return=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$supp/ubsan.supp${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
export OCL_ICD_VENDORS=${MOECL_FUZZ_ICD:-pocl.icd}
export MOECL_CACHE_DIR="$out/kernel-cache"

echo "build-and-run.sh: fuzzing for $seconds s"
"$out/fuzz_routing" -max_total_time="$seconds" -timeout=120 -rss_limit_mb=6144 -print_final_stats=1 \
    -artifact_prefix="$out/artifacts/" "$@" "$out/corpus" "$root/tests/fuzz/corpus"
