#!/bin/sh
# moecl-tune writes the device's tune file into a fresh cache directory
# (--dry-run first, which must write nothing), and moecl-info then reports
# the swept key as "tuned". Usage: test-tune-store.sh MOECL_TUNE MOECL_INFO
set -eu
tune=$1
info=$2
dir=$(mktemp -d "${TMPDIR:-/tmp}/moecl-tune-test.XXXXXX")
trap 'rm -rf "$dir"' EXIT
export MOECL_CACHE_DIR="$dir"

"$tune" --quick --dry-run --only "grounded seed"
if ls "$dir"/tune-*.txt >/dev/null 2>&1; then
    echo "FAIL: --dry-run wrote a tune file" >&2
    exit 1
fi

"$tune" --quick --only "grounded seed"
echo "--- the tune file:"
cat "$dir"/tune-*.txt
"$info" > "$dir/info.txt"
cat "$dir/info.txt"
if ! grep -q "launch grounded e=16 k=2 hidden=128: .* (tuned)" "$dir/info.txt"; then
    echo "FAIL: moecl-info does not report the tuned configuration" >&2
    exit 1
fi
