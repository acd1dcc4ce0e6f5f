# The last H200 call of a session: tests, the full bench (JSON in $OUT), and
# tuning probes (register cap for the team kernels, the wide grounded tile).
STEPS="test bench" bash bench/run-h200.sh 2>&1 | grep -E "^ *[0-9]/[0-9]|Ok:|Fail:|^\.\./|^topk|^grounded|empty"
export OCL_ICD_VENDORS=/tmp/icd MOECL_DEVICE=gpu
B="/tmp/b/tools/moecl-bench --iterations 100 --wall-calls 200"
S="--shape 13526,256,8 --shape 4083,128,8"
for r in 32 48 64 96; do echo "== maxrregcount $r"; MOECL_CACHE_DIR=/tmp/c$r MOECL_BUILD_OPTIONS="-cl-nv-maxrregcount=$r" $B --only custom $S 2>/dev/null | grep -E "^topk"; done
echo "== wide grounded tile"; MOECL_CACHE_DIR=/tmp/cw MOECL_GROUNDED_TILE=128 $B --only large 2>/dev/null | grep -E "^grounded"
