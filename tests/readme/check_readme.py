#!/usr/bin/env python3
"""Runs the README's C and shell examples, so that they cannot drift from
the code. Every ```c block is compiled against the built library and run;
where the next fenced block is a ```text block (the README's "It prints"),
the program's stdout must be exactly that. Every ```sh block runs, each
command in turn in a scratch folder where `build` is the build tree and the
files the examples name exist, except in the sections SKIPPED names (each
says what runs those instead); a skipped section that is gone fails, so a
renamed one is not skipped unseen. The ```python blocks are the Python
package's tests' (python/). With --changelog and --version, the changelog's
first entry must be that version (meson.build's), so a release cannot leave
it behind. Exit 0 when all held, 1 otherwise."""
import argparse
import os
import random
import re
import shutil
import struct
import subprocess
import sys

SKIPPED = {
    'Quick start': 'the fresh-Debian check (.ci/fresh-debian.sh) runs the quick-start script; '
                   'the test command is what CI runs',
    'Building': 'the fresh-Debian check runs these commands',
    'Install and link': 'the fresh-Debian check runs these commands on the smallest program',
    'Tests': 'the test commands themselves',
    'Expert parallelism': 'the mpi suite (examples/meson.build) runs the example on one machine; '
                          'the host-file command needs several machines',
}

FENCE = re.compile(r'^```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)^```[ \t]*$', re.M | re.S)


def blocks(text):
    """(section title, info string, body) of each fenced block, in order."""
    heads = [(m.start(), m.group(1).strip()) for m in re.finditer(r'^## (.*)$', text, re.M)]
    out = []
    for m in FENCE.finditer(text):
        section = ''
        for pos, title in heads:
            if pos < m.start():
                section = title
        out.append((section, m.group(1), m.group(2)))
    return out


def commands(body):
    """One command per line, backslash continuations joined; comments and
    blank lines left out."""
    cmds, cur = [], ''
    for line in body.splitlines():
        cur += line + '\n'
        if not line.rstrip().endswith('\\'):
            if cur.strip() and not cur.lstrip().startswith('#'):
                cmds.append(cur.rstrip('\n'))
            cur = ''
    return cmds


def write_npy(path, descr, shape, fmt, values):
    """A format 1.0 .npy file: magic, version, header length, the header
    padded with spaces to a multiple of 64 bytes with the preamble, data."""
    head = "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }" % (
        descr, ''.join('%d, ' % n for n in shape).rstrip(' ') if len(shape) > 1 else '%d,' % shape[0])
    head += ' ' * (63 - (10 + len(head)) % 64) + '\n'
    with open(path, 'wb') as f:
        f.write(b'\x93NUMPY\x01\x00' + struct.pack('<H', len(head)) + head.encode())
        f.write(struct.pack('<%d%s' % (len(values), fmt), *values))


def shell_inputs(work):
    """The files the shell examples name: logits [64][256] and a bias [256]."""
    rng = random.Random(1234)
    write_npy(os.path.join(work, 'logits.npy'), '<f4', (64, 256), 'f', [rng.gauss(0, 1) for _ in range(64 * 256)])
    write_npy(os.path.join(work, 'bias.npy'), '<f4', (256,), 'f', [rng.uniform(-0.05, 0.05) for _ in range(256)])


def run_c(i, body, expected, a, failures):
    src = os.path.join(a.workdir, 'example-%d.c' % i)
    exe = os.path.join(a.workdir, 'example-%d' % i)
    with open(src, 'w') as f:
        f.write(body)
    libdir = os.path.dirname(os.path.abspath(a.library))
    cmd = a.cc + ['-std=c11', '-Wall', '-Wextra', '-Werror', '-I', a.include, src, a.library,
                  '-lOpenCL', '-lm', '-pthread', '-Wl,-rpath,' + libdir, '-o', exe]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        failures.append('C block %d does not compile: %s\n%s' % (i, ' '.join(cmd), r.stderr))
        return
    r = subprocess.run([exe], capture_output=True, text=True, timeout=300)
    sys.stdout.write(r.stdout)
    if r.returncode != 0:
        failures.append('C block %d exits %d: %s' % (i, r.returncode, r.stderr))
    elif expected is not None and r.stdout != expected:
        failures.append('C block %d printed\n%s\nwhere the README shows\n%s' % (i, r.stdout, expected))
    else:
        print('ok: C block %d%s' % (i, ' prints what the README shows' if expected is not None else ' runs'))


def run_sh(i, section, body, a, failures):
    for c in commands(body):
        print('$ ' + c, flush=True)
        r = subprocess.run(['bash', '-e', '-o', 'pipefail', '-c', c], cwd=a.workdir, timeout=600)
        if r.returncode != 0:
            failures.append('shell block %d ("%s"): exit status %d: %s' % (i, section, r.returncode, c))
            return
    print('ok: shell block %d ("%s")' % (i, section))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--readme', required=True)
    ap.add_argument('--include', required=True, help='the folder holding moecl/moecl.h')
    ap.add_argument('--library', required=True, help='the built libmoecl.so (or .a)')
    ap.add_argument('--build-root', required=True, help='the build tree the shell examples call build/')
    ap.add_argument('--workdir', required=True)
    ap.add_argument('--changelog', help='CHANGELOG.md, whose first "## " entry must be --version')
    ap.add_argument('--version', help="the project's version (meson.build)")
    ap.add_argument('cc', nargs='+', help='the C compiler and its arguments')
    a = ap.parse_args()

    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    os.symlink(os.path.abspath(a.build_root), os.path.join(a.workdir, 'build'))
    shell_inputs(a.workdir)

    text = open(a.readme, encoding='utf-8').read()
    found = blocks(text)
    sections = {s for s, _, _ in found} | set(re.findall(r'^## (.*)$', text, re.M))
    failures = ['README.md has no section "## %s", which this test skips' % s for s in SKIPPED if s not in sections]
    ran_c = 0
    for i, (section, lang, body) in enumerate(found):
        if lang == 'c':
            nxt = found[i + 1] if i + 1 < len(found) else None
            expected = nxt[2] if nxt and nxt[1] == 'text' else None
            run_c(i, body, expected, a, failures)
            ran_c += 1
        elif lang == 'sh':
            if section in SKIPPED:
                print('skipped: shell block %d ("%s"): %s' % (i, section, SKIPPED[section]))
            else:
                run_sh(i, section, body, a, failures)
    if ran_c == 0:
        failures.append('README.md has no ```c block')
    if a.changelog:
        m = re.search(r'^## (\S+)', open(a.changelog, encoding='utf-8').read(), re.M)
        if not m or m.group(1) != a.version:
            failures.append('%s: the first entry is %s, not the version %s' % (a.changelog, m and m.group(1), a.version))
        else:
            print('ok: %s begins with %s' % (a.changelog, a.version))
    for f in failures:
        print('FAIL: ' + f)
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main())
