#!/bin/sh
# moecl-tune writes the device's tune file into a fresh cache directory,
# and moecl-info then reports the swept key as "tuned"; a --dry-run of the
# same sweep then writes nothing there. The dry run comes second, with one
# timed call per configuration, so that it loads the kernels the first
# sweep built; what it checks does not depend on the timings.
# Usage: test-tune-store.sh MOECL_TUNE MOECL_INFO
set -eu
tune=$1
info=$2
dir=$(mktemp -d "${TMPDIR:-/tmp}/moecl-tune-test.XXXXXX")
trap 'rm -rf "$dir"' EXIT
export MOECL_CACHE_DIR="$dir"

"$tune" --quick --only "grounded seed"
echo "--- the tune file:"
cat "$dir"/tune-*.txt
"$info" > "$dir/info.txt"
cat "$dir/info.txt"
if ! grep -q "launch grounded e=16 k=2 hidden=128: .* (tuned)" "$dir/info.txt"; then
    echo "FAIL: moecl-info does not report the tuned configuration" >&2
    exit 1
fi

# The tune files' names, inodes (a file written and renamed into place
# gets a new one), times and contents, before and after the dry run.
tune_files() { (cd "$dir" && for f in tune-*; do [ -e "$f" ] && ls -i --full-time "$f" && cksum "$f"; done) || true; }
before=$(tune_files)
"$tune" --quick --dry-run --iterations 1 --only "grounded seed"
if [ "$(tune_files)" != "$before" ]; then
    echo "FAIL: --dry-run wrote a tune file:" >&2
    tune_files >&2
    exit 1
fi
