STEPS="test bench" bash bench/run-h200.sh 2>&1 | grep -v "^  \|^platform\|^device\|^driver\|^type\|^vendor\|^compute\|^local\|^max\|^launch\|^kernel"
for t in 4 8 16 32; do echo "== MOECL_TEAM=$t"; MOECL_TEAM=$t OCL_ICD_VENDORS=/tmp/icd MOECL_DEVICE=gpu MOECL_CACHE_DIR=/tmp/moecl-cache /tmp/b/tools/moecl-bench --only topk --iterations 100 --wall-calls 200 2>/dev/null | grep "^topk"; done
