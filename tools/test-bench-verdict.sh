#!/bin/sh
# moecl-bench's verdict when a check fails: the grounded router's kernels
# from a copy of cl/ in which the softmax over the chosen takes exp of 1.5
# times the differences (MOECL_KERNEL_DIR), so its weights are wrong. moecl-bench must mark
# the case FAIL, end with "0/1 checks passed" and exit 1. Usage:
# test-bench-verdict.sh MOECL_BENCH CL_DIR
set -eu
bench=$1
cl=$2
dir=$(mktemp -d "${TMPDIR:-/tmp}/moecl-bench-verdict.XXXXXX")
trap 'rm -rf "$dir"' EXIT
cp "$cl"/*.cl "$cl"/*.h "$dir"/
sed 's/w\[j\] = exp(w\[j\] - m);/w[j] = exp(1.5f * (w[j] - m));/' "$cl/gating.cl" > "$dir/gating.cl"
if cmp -s "$cl/gating.cl" "$dir/gating.cl"; then
    echo "FAIL: gating.cl has no 'w[j] = exp(w[j] - m);' (the softmax over the chosen) to break: update this test" >&2
    exit 1
fi
export MOECL_KERNEL_DIR="$dir" MOECL_CACHE_DIR="$dir/cache"

status=0
"$bench" --quick --only "grounded seed" --iterations 10 --wall-calls 10 > "$dir/out.txt" || status=$?
cat "$dir/out.txt"
[ "$status" -eq 1 ] || { echo "FAIL: exit status $status, expected 1" >&2; exit 1; }
grep -q "^grounded seed .* FAIL$" "$dir/out.txt" || { echo "FAIL: the case is not marked FAIL" >&2; exit 1; }
[ "$(tail -n 1 "$dir/out.txt")" = "0/1 checks passed" ] || { echo "FAIL: the last line is not '0/1 checks passed'" >&2; exit 1; }
echo "ok: a failed check gives the verdict 0/1 and exit status 1"
