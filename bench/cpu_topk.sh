#!/usr/bin/env bash
# The CPU table of bench/RESULTS.md: top-k softmax f32, top 8, at the seed
# shapes from 1019 tokens up, for each kind of logits (moecl-bench
# --logits), on pocl and on Intel's CPU runtime, beside PyTorch's seed
# reference on the CPU; and the grounded router 16384 x 4096 x 128 f32
# beside PyTorch's five ops and its GEMM alone. Rounds alternate pocl,
# Intel and PyTorch kind by kind, so that a drift of the machine reaches
# all three alike; the table gives the median of the rounds' medians.
#
#   bench/cpu_topk.sh [--rounds N] [--quick] [--out DIR] [--build DIR]
#                     [--kinds "normal uniform10 hot ties"] [--no-grounded]
#
# --quick: 10 calls a case and PyTorch's --quick (a trial of the script,
# not a measurement). Writes into DIR (default bench-cpu-<UTC time>):
# every tool's JSON, meta.json (date, commit, machine, load), table.md and
# summary.json (bench/tables.py --cpu), and prints the table. Environment:
# INTEL_ICD, the folder of Intel's CPU ICD file (default /opt/intel-icd);
# POCL_ICD, pocl's ICD file (default /etc/OpenCL/vendors/pocl.icd);
# PYTHON, a Python with PyTorch (default /usr/bin/python3); THREADS,
# PyTorch's threads (default 2). Exit status 0 when every run and check
# passed, 1 when one failed, 2 on bad usage.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)

rounds=3 quick=0 out="" build=$repo/build kinds="normal uniform10 hot ties" grounded=1
usage() { sed -n '10,11p' "$0" | sed 's/^# *//' >&2; exit 2; }
while [ $# -gt 0 ]; do
    case $1 in
    --rounds) [ $# -ge 2 ] && [[ $2 =~ ^[1-9][0-9]*$ ]] || { echo "cpu_topk.sh: --rounds needs a count" >&2; usage; }
        rounds=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    --out) [ $# -ge 2 ] || usage; out=$2; shift 2 ;;
    --build) [ $# -ge 2 ] || usage; build=$2; shift 2 ;;
    --kinds) [ $# -ge 2 ] || usage; kinds=$2; shift 2 ;;
    --no-grounded) grounded=0; shift ;;
    -h | --help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "cpu_topk.sh: unknown argument '$1'" >&2; usage ;;
    esac
done
for k in $kinds; do
    case $k in normal | uniform10 | hot | ties) ;; *) echo "cpu_topk.sh: --kinds: unknown kind '$k'" >&2; usage ;; esac
done

python=${PYTHON:-/usr/bin/python3} threads=${THREADS:-2}
intel_icd=${INTEL_ICD:-/opt/intel-icd} pocl_icd=${POCL_ICD:-/etc/OpenCL/vendors/pocl.icd}
[ -x "$build/tools/moecl-bench" ] && [ -x "$build/tools/moecl-info" ] ||
    { echo "cpu_topk.sh: no moecl-bench or moecl-info in $build/tools: build first (bench/README.md)" >&2; exit 1; }
[ -f "$pocl_icd" ] || { echo "cpu_topk.sh: no pocl ICD file $pocl_icd (set POCL_ICD)" >&2; exit 1; }
[ -d "$intel_icd" ] || { echo "cpu_topk.sh: no Intel ICD folder $intel_icd (set INTEL_ICD)" >&2; exit 1; }
"$python" -c 'import torch' 2>/dev/null || { echo "cpu_topk.sh: $python has no PyTorch (set PYTHON)" >&2; exit 1; }

out=${out:-bench-cpu-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$out"
out=$(cd "$out" && pwd) build=$(cd "$build" && pwd)
bench=$build/tools/moecl-bench info=$build/tools/moecl-info
cd "$repo"
# Each implementation through an ICD folder of its own, so that no other
# CPU platform is picked; kernels from a cache that outlives the run
# (compiling is not timed, but costs minutes on a cold cache).
pocl_dir=$out/icd-pocl
mkdir -p "$pocl_dir" && cp "$pocl_icd" "$pocl_dir/"
export MOECL_CACHE_DIR=${MOECL_CACHE_DIR:-$build/bench-kernel-cache}
# PyTorch's BLAS (OpenBLAS through Debian's libblas.so.3) keeps threads of
# its own: as many as PyTorch's.
export OPENBLAS_NUM_THREADS=$threads OMP_NUM_THREADS=$threads
declare -A icd=([pocl]=$pocl_dir [intel]=$intel_icd)
declare -A platform=([pocl]="Portable Computing Language" [intel]="Intel(R) OpenCL")

if [ $quick = 1 ]; then
    calls=(--iterations 10 --wall-calls 10) gcalls=(--iterations 10 --wall-calls 10) tquick=(--quick)
else
    calls=() gcalls=(--iterations 30 --wall-calls 20) tquick=()
fi
shapes=()
for s in 1019x128 2044x128 4083x128 8192x128 8037x256 13526x256; do shapes+=(--only "topk softmax $s k8"); done

for impl in pocl intel; do
    OCL_ICD_VENDORS=${icd[$impl]} "$info" --device cpu --json > "$out/info-$impl.json"
    picked=$("$python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["picked"]["platform"])' \
        "$out/info-$impl.json")
    [[ $picked == "${platform[$impl]}"* ]] ||
        { echo "cpu_topk.sh: $impl: moecl-info picked platform '$picked'" >&2; exit 1; }
done

load() { cut -d' ' -f1-3 /proc/loadavg; }
"$python" - "$out/meta.json" "$rounds" "$quick" "$threads" "$kinds" "$(load)" <<'EOF'
import json, platform, subprocess, sys, time
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True).stdout.strip()
json.dump(dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), commit=git("rev-parse", "--short", "HEAD"),
               dirty=bool(git("status", "--porcelain", "--untracked-files=no")), cpu=cpu,
               cores=len([l for l in open("/proc/cpuinfo") if l.startswith("processor")]), kernel=platform.release(),
               rounds=int(sys.argv[2]), quick=sys.argv[3] == "1", threads=int(sys.argv[4]), kinds=sys.argv[5].split(),
               load_before=sys.argv[6]), open(sys.argv[1], "w"), indent=1)
EOF

start=$SECONDS
run() { # name, then the command; its output to name.log
    local name=$1; shift
    printf '%4ds  %s\n' $((SECONDS - start)) "$name"
    "$@" > "$out/$name.log" 2>&1 || { echo "cpu_topk.sh: $name failed (status $?): $out/$name.log" >&2; tail -5 "$out/$name.log" >&2; exit 1; }
}
for r in $(seq 1 "$rounds"); do
    first=1
    for k in $kinds; do
        for impl in pocl intel; do
            # The copy kernel's rate once a round and implementation.
            copy=(); [ $first = 1 ] && copy=(--copy-floor)
            run "topk-$impl-$k-r$r" env OCL_ICD_VENDORS="${icd[$impl]}" "$bench" --device cpu "${shapes[@]}" \
                --logits "$k" "${calls[@]}" "${copy[@]}" --json "$out/topk-$impl-$k-r$r.json"
        done
        first=0
        run "torch-topk-$k-r$r" "$python" bench/torch_reference.py --device cpu --threads "$threads" --logits "$k" \
            --only seed_topk "${tquick[@]}" --json "$out/torch-topk-$k-r$r.json"
    done
    [ $grounded = 1 ] || continue
    for impl in pocl intel; do
        run "grounded-$impl-r$r" env OCL_ICD_VENDORS="${icd[$impl]}" "$bench" --device cpu \
            --only 'grounded large 16384x4096x128 k8' "${gcalls[@]}" --json "$out/grounded-$impl-r$r.json"
    done
    run "torch-grounded-r$r" "$python" bench/torch_reference.py --device cpu --threads "$threads" \
        --only grounded_router "${tquick[@]}" --json "$out/torch-grounded-r$r.json"
    run "torch-gemm-r$r" "$python" bench/torch_reference.py --device cpu --threads "$threads" \
        --only gemm_fp32 "${tquick[@]}" --json "$out/torch-gemm-r$r.json"
done
"$python" - "$out/meta.json" "$(load)" $((SECONDS - start)) <<'EOF'
import json, sys
m = json.load(open(sys.argv[1]))
m.update(load_after=sys.argv[2], seconds=int(sys.argv[3]))
json.dump(m, open(sys.argv[1], "w"), indent=1)
EOF
"$python" bench/tables.py --cpu "$out" --summary "$out/summary.json" > "$out/table.md"
cat "$out/table.md"
echo "cpu_topk.sh: $((SECONDS - start)) s; files in $out"
