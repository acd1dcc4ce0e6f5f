#!/usr/bin/env bash
# Every moecl kernel under oclgrind (docs/testing.md): oclgrind_routes'
# runs (every kernel, both launch classes, every forced path, at small
# shapes, each result checked against the float64 reference) under
#   opt        oclgrind --data-races --check-api, kernels built as drivers
#              build them (the top-k rows kernel's fast path left out:
#              tool_bugs zext_bool_vector makes it compute wrong there);
#   O0-uninit  the same with -cl-opt-disable and --uninitialized, fast
#              path included, leaving out what that plugin cannot run
#              (tool_bugs/README.md);
#   O0         what O0-uninit leaves out, without --uninitialized.
# Fails on a wrong result, a crash, or any line in oclgrind's log (its
# reports go to --log, apart from the program's own output). Then runs the
# tool bugs' reproducers and says which are still present.
#
# Usage: tests/oclgrind/run.sh [BUILD_DIR]     (default: build)
# Environment: OCLGRIND (the oclgrind to run), MOECL_OCLGRIND_JOBS
# (parallel runs, default: the CPUs), MOECL_TEST_SEED (repeat a run's
# inputs), MOECL_KERNEL_DIR (kernels from a folder, to compare a change).
# Logs: BUILD_DIR/oclgrind-logs/<pass>-<run>.{out,oclgrind}.
set -uo pipefail

build=${1:-build}
routes=$build/tests/oclgrind/oclgrind_routes
bugs=$build/tests/oclgrind/oclgrind_tool_bugs
oclgrind=${OCLGRIND:-oclgrind}
for f in "$routes" "$bugs"; do
    [ -x "$f" ] || { echo "oclgrind: $f is missing (build with -Dtests=enabled first)"; exit 1; }
done
if ! command -v "$oclgrind" > /dev/null; then
    echo "oclgrind: '$oclgrind' not found (Debian: apt-get install oclgrind)"
    exit 1
fi

logs=$build/oclgrind-logs
rm -rf "$logs"
mkdir -p "$logs"
# Every kernel is built by oclgrind's compiler, none loaded from a cache
# another device filled.
export MOECL_CACHE_DIR=off
# One seed for every run, so that a failure repeats with the same inputs.
export MOECL_TEST_SEED=${MOECL_TEST_SEED:-$(( $(date +%s) * 1000 + RANDOM % 1000 ))}
export oclgrind routes logs
echo "oclgrind: $("$oclgrind" --version 2>&1 | grep -m1 Oclgrind), seed $MOECL_TEST_SEED, logs in $logs"

# 64 KiB of local memory, as most GPUs have: it admits the grounded
# router's 128-token tile.
job() {
    local pass=$1 run=$2 tool=(--data-races --check-api --local-mem-size 65536) args=()
    case $pass in
        opt) args=(--skip-rows-fast) ;;
        O0) tool+=(--build-options -cl-opt-disable); args=(--uninitialized-left-out) ;;
        O0-uninit) tool+=(--build-options -cl-opt-disable --uninitialized); args=(--uninitialized) ;;
    esac
    local log=$logs/$pass-$run start=$SECONDS
    timeout 600 "$oclgrind" "${tool[@]}" --log "$log.oclgrind" "$routes" "${args[@]}" "$run" > "$log.out" 2>&1
    local rc=$? why=""
    [ $rc -eq 0 ] || why="exit status $rc"
    [ -s "$log.oclgrind" ] && why="${why:+$why, }$(grep -c . < "$log.oclgrind") lines of oclgrind reports"
    local skips
    skips=$(sed -n 's/.* \([0-9]*\) cases skipped$/\1/p' "$log.out")
    if [ -z "$why" ]; then
        echo "ok   $pass $run ($((SECONDS - start)) s${skips:+, $skips cases skipped})"
    else
        echo "FAIL $pass $run ($((SECONDS - start)) s): $why; see $log.out and $log.oclgrind"
        touch "$log.failed"
    fi
}
export -f job

start=$SECONDS
mapfile -t runs < <("$routes" --list)
# The O0-uninit pass, the slowest by far, leaves out forced variants whose
# code another run of it covers at other sizes (the opt and O0 passes run
# them all): teams of 128 and 256 (the tree reductions of the team of 64),
# and the grounded router's tuned tiles but one of each parameter value
# that changes the code (vector width 1 and 2, no double buffer, the wide
# column split of 16x4 and of a 128 tile). MOECL_OCLGRIND_ALL=1: every run.
uninit_left_out='^(topk-team(128|256)-rows2|grounded-tile(64-128x(8|16|32)-8x8-v4-db1|64-128x16-(8x4|4x8)-v4-db1|32-128x16-(4x8|8x4)-v4-db1|64-64x16-8x8-v4-db1|128-64x16-8x8-v4-db0|64-128x16-8x(4|8)-v4-db1-wc(4|8)))$'
[ "${MOECL_OCLGRIND_ALL:-0}" = 1 ] && uninit_left_out='^$'
jobs=()
# The slowest pass first, so that the last jobs are short.
for pass in O0-uninit opt O0; do
    for run in "${runs[@]}"; do
        [ "$pass" = O0-uninit ] && [[ $run =~ $uninit_left_out ]] && continue
        jobs+=("$pass $run")
    done
done
printf '%s\n' "${jobs[@]}" | xargs -P "${MOECL_OCLGRIND_JOBS:-$(nproc)}" -L 1 bash -c 'job "$@"' _
failed=$(find "$logs" -name '*.failed' | wc -l)
total=${#jobs[@]}

# The tool bugs: each reproducer must be right on the real device (when
# there is one) and, where the run relies on a workaround, right under it.
echo "oclgrind tool bugs (tests/oclgrind/tool_bugs/README.md):"
bug_failed=0
while read -r name; do
    native=$("$bugs" "$name" 2>&1)
    rc=$?
    if [ $rc -eq 1 ]; then
        echo "FAIL $name: wrong on the real device too, so not oclgrind's bug: $native"
        bug_failed=1
    fi
    log=$logs/bug-$name
    case $name in
        zext_bool_vector)
            "$oclgrind" --log "$log.oclgrind" "$bugs" "$name" > "$log.out" 2>&1
            [ $? -eq 1 ]
            present=$?
            if ! "$oclgrind" --build-options -cl-opt-disable "$bugs" "$name" > /dev/null 2>&1; then
                echo "FAIL $name: wrong with -cl-opt-disable too (the O0 pass relies on it)"
                bug_failed=1
            fi ;;
        freeze_unsupported)
            "$oclgrind" --uninitialized --log "$log.oclgrind" "$bugs" "$name" > "$log.out" 2>&1
            grep -q "Unsupported instruction: freeze" "$log.oclgrind"
            present=$?
            "$oclgrind" --uninitialized --build-options -cl-opt-disable --log "$log-O0.oclgrind" "$bugs" "$name" \
                > /dev/null 2>&1
            if [ $? -ne 0 ] || [ -s "$log-O0.oclgrind" ]; then
                echo "FAIL $name: fails with -cl-opt-disable too (the O0-uninit pass relies on it)"
                bug_failed=1
            fi ;;
        shuffle_undef_crash)
            # In a subshell of its own, whose "Segmentation fault" goes to
            # the log too.
            ("$oclgrind" --uninitialized --log "$log.oclgrind" "$bugs" "$name"; exit $?) > "$log.out" 2>&1
            [ $? -ge 128 ]
            present=$? ;;
        *)
            "$oclgrind" --uninitialized --log "$log.oclgrind" "$bugs" "$name" > "$log.out" 2>&1
            grep -q "Uninitialized value" "$log.oclgrind"
            present=$? ;;
    esac
    if [ $present -eq 0 ]; then
        echo "  $name: present"
    else
        echo "  $name: absent (this oclgrind is fixed: the workaround in tool_bugs/README.md can go)"
    fi
done < <("$bugs" --list)

echo "oclgrind: $((total - failed)) of $total runs passed in $((SECONDS - start)) s"
[ "$failed" -eq 0 ] && [ $bug_failed -eq 0 ]
