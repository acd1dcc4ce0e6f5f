STEPS="bench" BENCH_ARGS="--only grounded --iterations 50 --wall-calls 100" bash bench/run-h200.sh 2>&1 | grep -E "^grounded|empty"
export OCL_ICD_VENDORS=/tmp/icd MOECL_DEVICE=gpu MOECL_CACHE_DIR=/tmp/moecl-cache
B="/tmp/b/tools/moecl-bench --only custom --iterations 100 --wall-calls 200"
S="--shape 13526,256,1 --shape 13526,256,2 --shape 13526,256,4 --shape 13526,256,8 --shape 4083,128,1 --shape 4083,128,8 --shape 13526,128,8 --shape 13526,64,8 --shape 100000,256,1 --shape 100000,256,8"
$B $S 2>/dev/null | grep -E "^topk|empty"
