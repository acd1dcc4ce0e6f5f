#!/usr/bin/env bash
# CI: follow the README on a fresh Debian 12 as a new user would. In a
# debootstrap'd minbase root, as root: the README's first quick-start
# command; the commands of "## Python" (its packages, then `python3 -m venv
# venv && venv/bin/pip install .`, which builds the C library into the
# package, from PyPI's meson-python) and the README's Python example (its
# first ```python block), which must print the ids' shape and dtype and
# each row's weight sum, before any C library is installed; then the
# "Building" commands, `ldconfig`, then each link command of "Install and
# link" on the README's smallest program, which must run and print two
# "token" lines. The commands, app.c and the example are read from
# README.md, so the README and this check cannot drift apart. Not the test
# command: the rest of CI runs that.
#
# Needs root (debootstrap, mount, chroot) and Debian's mirror. Tests the
# committed tree (git archive HEAD). KEEP=1 keeps the root for a look;
# FRESH_DEBIAN_TMP picks where it goes (default /var/tmp: /tmp may be nodev).
set -euo pipefail
cd "$(dirname "$0")/.."
mirror=http://deb.debian.org/debian
t0=$SECONDS
step="start"

say() { echo "fresh-debian: $*" >&2; }
fail() { say "FAILED: $*"; exit 1; }
begin() { step=$1; say "== $step ($((SECONDS - t0)) s)"; }

[ "$(id -u)" -eq 0 ] || fail "needs root (debootstrap, mount, chroot)"
if ! command -v debootstrap >/dev/null; then
    begin "installing debootstrap on the host"
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends debootstrap
fi

work=$(mktemp -d "${FRESH_DEBIAN_TMP:-/var/tmp}/moecl-fresh-debian.XXXXXX")
work=$(cd "$work" && pwd -P)   # as /proc/PID/root names it
root=$work/root readme=$work/readme
mounts=(proc sys dev)
failures=()

# Processes whose root is the root: a killed run can leave some behind (a
# TERMed apt left dpkg unpacking), holding its mounts and writing into it.
root_pids() {
    local p
    for p in /proc/[0-9]*; do
        [ "$(readlink "$p/root" 2>/dev/null)" = "$root" ] && echo "${p#/proc/}"
    done
}

cleanup() {
    local rc=$? m busy=0 pids i
    set +e
    trap - EXIT INT TERM HUP
    pids=$(root_pids)
    if [ -n "$pids" ]; then
        say "stopping what still runs in the root: ${pids//$'\n'/ }"
        # shellcheck disable=SC2086 # one pid a word
        kill -TERM $pids 2>/dev/null
        for ((i = 0; i < 50; i++)); do [ -z "$(root_pids)" ] && break; sleep 0.1; done
        pids=$(root_pids)
        # shellcheck disable=SC2086
        [ -z "$pids" ] || kill -KILL $pids 2>/dev/null
        for ((i = 0; i < 50; i++)); do [ -z "$(root_pids)" ] && break; sleep 0.1; done
    fi
    # Innermost first; a lazy unmount if something in the root still holds one.
    for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
        m=$root/${mounts[i]}
        mountpoint -q "$m" && { umount -R "$m" || umount -R -l "$m" || busy=1; }
    done
    # Never rm -rf through a bind mount of the host's /dev, /sys or /proc.
    grep -qs " $root/" /proc/self/mounts && busy=1
    if [ $rc -ne 0 ]; then
        say "FAILED at step: $step (exit $rc, after $((SECONDS - t0)) s)"
        for m in "${failures[@]}"; do say "  failed: $m"; done
    fi
    if [ "${KEEP:-0}" = 1 ]; then
        say "kept the root: $root"
    elif [ $busy -eq 0 ]; then
        rm -rf --one-file-system "$work"
    else
        say "something is still mounted under $root: not removing $work"
        rc=1
    fi
    exit $rc
}
trap cleanup EXIT
# Signals become exits, so the trap unmounts on ^C and kills too.
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# Run CMD (a README command, exactly as written) in DIR in the root, in a
# root login shell with nothing inherited from this environment. In the
# background and waited for, so that a signal to this script runs the trap
# at once rather than when the command ends (a timeout's TERM, then KILL,
# would otherwise leave the mounts behind).
in_root() {
    # shellcheck disable=SC2016 # expanded by the root's shell
    chroot "$root" /usr/bin/env -i HOME=/root TERM="${TERM:-dumb}" DEBIAN_FRONTEND=noninteractive \
        /bin/bash -l -c 'cd "$1" && eval "$2"' bash "$1" "$2" &
    wait $!
}

begin "reading the README's commands and app.c"
mkdir -p "$readme"
python3 - README.md "$readme" <<'PY'
import os, re, sys
text = open(sys.argv[1]).read()
out = sys.argv[2]

def section(title):
    m = re.search(r'^## ' + re.escape(title) + r'[ \t]*\n(.*?)(?=^## |\Z)', text, re.M | re.S)
    if not m:
        sys.exit('README.md has no section "## %s"' % title)
    return m.group(1)

def block(body, lang, where):
    m = re.search(r'^```' + lang + r'[ \t]*\n(.*?)^```', body, re.M | re.S)
    if not m:
        sys.exit('README.md: no ```%s block %s' % (lang, where))
    return m.group(1)

def commands(body):
    # One command per line, backslash continuations kept as written.
    cmds, cur = [], ''
    for line in body.splitlines(keepends=True):
        cur += line
        if not line.rstrip('\n').endswith('\\'):
            if cur.strip():
                cmds.append(cur.rstrip('\n'))
            cur = ''
    return cmds

def write(name, s):
    with open(os.path.join(out, name), 'w') as f:
        f.write(s if s.endswith('\n') else s + '\n')

write('quickstart.cmd', commands(block(section('Quick start'), 'sh', 'in "Quick start"'))[0])
for i, c in enumerate(commands(block(section('Building'), 'sh', 'in "Building"'))):
    write('build-%02d.cmd' % i, c)
install = section('Install and link')
for i, c in enumerate(commands(block(install, 'sh', 'in "Install and link"'))):
    write('link-%02d.cmd' % i, c)
# The command the prose gives for the loader cache after installing into /usr/local.
m = re.search(r'after\s+installing\s+into\s+`/usr/local`,\s+run\s+`([^`]*ldconfig[^`]*)`', install)
if not m:
    sys.exit('README.md: no "after installing into `/usr/local`, run `...ldconfig...`" in "Install and link"')
write('ldconfig.cmd', m.group(1))
small = install.find('The smallest program')
if small < 0:
    sys.exit('README.md: no "The smallest program" in "Install and link"')
write('app.c', block(install[small:], 'c', 'after "The smallest program"'))
write('example.py', block(text, 'python', 'in README.md'))
for i, c in enumerate(commands(block(section('Python'), 'sh', 'in "Python"'))):
    write('python-%02d.cmd' % i, c)
PY
ls "$readme"/link-*.cmd >/dev/null 2>&1 || fail "no link commands read from README.md"

begin "debootstrap --variant=minbase bookworm $root"
debootstrap --variant=minbase bookworm "$root" "$mirror" >"$work/debootstrap.log" 2>&1 ||
    { tail -n 40 "$work/debootstrap.log" >&2; fail "debootstrap"; }
# apt in the root resolves names as the host does (debootstrap copies the
# file at its start; this is the host's current one).
[ ! -e /etc/resolv.conf ] || cp -L /etc/resolv.conf "$root/etc/resolv.conf"
for m in "${mounts[@]}"; do
    mount --rbind "/$m" "$root/$m"
    # Slave: unmounting the root's copies never propagates to the host's.
    mount --make-rslave "$root/$m"
done

begin "copying the tree of $(git rev-parse --short HEAD) to /root/moecl"
git diff --quiet HEAD -- || say "note: uncommitted changes are not tested (git archive HEAD)"
git archive --prefix=moecl/ HEAD | tar -x -C "$root/root"

# How many packages the root has installed (the README gives the quick start's count).
packages() { in_root /root 'dpkg-query -W -f "\${Status}\n" | grep -c "install ok installed"' || true; }
before=$(packages)
quick_t0=$SECONDS
begin "quick start: $(cat "$readme/quickstart.cmd")"
in_root /root/moecl "$(cat "$readme/quickstart.cmd")" || fail "the README's quick-start command"
say "the quick start installed $(($(packages) - before)) packages in $((SECONDS - quick_t0)) s"

# The Python package as the README installs it, before the C library is
# installed: the section's commands in the checkout (its packages, then
# pip fetching meson-python, meson and numpy from PyPI), then the example.
# Once ca-certificates is installed, the fresh root trusts the certificate
# authorities this machine trusts: CI's network intercepts TLS with one of
# its own, which Debian's bundle lacks.
mkdir -p "$root/root/app"
for f in "$readme"/python-*.cmd; do
    c=$(cat "$f")
    begin "Python: $c"
    if [ -f /etc/ssl/certs/ca-certificates.crt ] && [ -f "$root/etc/ssl/certs/ca-certificates.crt" ]; then
        cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt" || fail "copying the CA bundle"
    fi
    in_root /root/moecl "$c" || fail "the README's Python command: $c"
done
cp "$readme/example.py" "$root/root/app/example.py"
out=$(in_root /root/app '/root/moecl/venv/bin/python example.py') || { printf '%s\n' "$out" >&2; fail "the README's Python example"; }
printf '%s\n' "$out"
grep -q '^(4, 8) int32 \[' <<<"$out" || fail "the README's Python example did not print \"(4, 8) int32 [...]\""
in_root /root 'ldconfig -p | grep -q libmoecl' && fail "a libmoecl was installed before the Python example: it proves nothing"

for f in "$readme"/build-*.cmd; do
    c=$(cat "$f")
    begin "building: $c"
    in_root /root/moecl "$c" || fail "the README's \"Building\" command: $c"
done

# The loader cache command, and what a new user would trip over next, all
# reported at once: a failure here says more with the others beside it.
c=$(cat "$readme/ldconfig.cmd")
begin "after installing into /usr/local: $c"
record() { say "FAILED: $1"; failures+=("$1"); }
in_root /root "$c" || record "the README's \"$c\" as root"
in_root /root 'pkg-config --exists moecl' || record "pkg-config does not find moecl"
# The soname's number is meson.build's moecl_soversion (the README's ABI).
sover=$(sed -n "s/^moecl_soversion = '\([0-9]*\)'.*/\1/p" meson.build)
in_root /root "ldconfig -p | grep -q 'libmoecl\\.so\\.$sover '" ||
    record "the loader cache (ldconfig -p) has no libmoecl.so.$sover"
if [ ${#failures[@]} -gt 0 ]; then
    say "where meson installed the library:"
    in_root /root 'find /usr/local -name "libmoecl.so*" -o -name moecl.pc' >&2 || true
    fail "the README's install commands, as written"
fi

cp "$readme/app.c" "$root/root/app/app.c"
for f in "$readme"/link-*.cmd; do
    c=$(cat "$f")
    begin "linking: $c"
    rm -f "$root/root/app/app"
    in_root /root/app "$c" || fail "the README's link command: $c"
    out=$(in_root /root/app ./app) || { printf '%s\n' "$out" >&2; fail "./app (linked by: $c)"; }
    printf '%s\n' "$out"
    [ "$(grep -c '^token ' <<<"$out" || true)" -eq 2 ] || fail "./app did not print two \"token\" lines"
done

step="done"
say "passed in $((SECONDS - t0)) s"
