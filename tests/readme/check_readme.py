#!/usr/bin/env python3
"""Runs the README's C, Python and shell examples, so that they cannot
drift from the code. Every ```c block is compiled against the built library
and run; where the next fenced block is a ```text block (the README's "It
prints"), the program's stdout must be exactly that. A ```python block
followed by a ```text block runs the same way, with the package from the
source tree over the built library (the Python package's tests run every
```python block too). The quick start's sample output (the fenced block
after its commands) must be what moecl-info and moecl-bench --quick print
today: its verdict line and table header exactly, each table row's case
(op, shape, dtype) present and "ok", and each other "key: value" line's key
printed; "..." stands for lines left out, and values that depend on the
device or the run (times, names) are not compared. Every ```sh block runs,
each command in turn in a scratch folder where `build` is the build tree
and the files the examples name exist, except in the sections SKIPPED names
(each says what runs those instead); a skipped section that is gone fails,
so a renamed one is not skipped unseen. With --changelog and --version, the
changelog's first entry must be that version (meson.build's), so a release
cannot leave it behind. Exit 0 when all held, 1 otherwise."""
import argparse
import os
import random
import re
import shutil
import struct
import subprocess
import sys

SKIPPED = {
    'Getting it': 'the clone needs the repository\'s address; the fresh-Debian check copies the tree',
    'Quick start': 'the fresh-Debian check (.ci/fresh-debian.sh) runs the quick-start script; '
                   'the test command is what CI runs',
    'Building': 'the fresh-Debian check runs these commands',
    'Python': 'the fresh-Debian check runs these commands (they install packages and build a venv)',
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
    cmd = a.cc + ['-std=c11', '-Wall', '-Wextra', '-Werror'] + ['-I' + d for d in a.include] + [src, a.library,
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


def python_with_numpy():
    """An interpreter that imports numpy: this one, else Debian's."""
    for exe in (sys.executable, '/usr/bin/python3'):
        if exe and os.path.exists(exe) and subprocess.run([exe, '-c', 'import numpy'],
                                                          capture_output=True).returncode == 0:
            return exe
    return None


def run_python(i, body, expected, a, failures):
    if a.static_only:
        # The package loads the shared library with ctypes.
        print('skipped: Python block %d: this build has no shared library (default_library=static)' % i)
        return
    exe = python_with_numpy()
    if exe is None:
        failures.append('Python block %d: no Python with numpy to run it (Debian: python3-numpy, '
                        'which tools/quickstart.sh --test-deps installs)' % i)
        return
    env = dict(os.environ, PYTHONPATH=os.path.abspath(a.python_package),
               MOECL_LIBRARY=os.path.abspath(a.library))
    r = subprocess.run([exe, '-c', body], cwd=a.workdir, env=env, capture_output=True, text=True, timeout=300)
    sys.stdout.write(r.stdout)
    if r.returncode != 0:
        failures.append('Python block %d exits %d: %s' % (i, r.returncode, r.stderr))
    elif r.stdout != expected:
        failures.append('Python block %d printed\n%s\nwhere the README shows\n%s' % (i, r.stdout, expected))
    else:
        print('ok: Python block %d prints what the README shows' % i)


ROW_KEY = re.compile(r'^(.*?)\s+-?\d+\.\d+\s')


def row_key(line):
    """A table row's case, "op shape dtype" with single spaces: what comes
    before its first figure."""
    m = ROW_KEY.match(line)
    if not m or line[:1].isspace() or ':' in m.group(1):
        return None  # an indented note under a row, or a "key: value" line
    return ' '.join(m.group(1).split())


def masked(line):
    """A line with its figures replaced by #."""
    return re.sub(r'\d+(\.\d+)?', '#', line)


def check_quickstart_output(shown, a, failures):
    """The quick start's sample output against moecl-info and a short
    moecl-bench --quick (few calls: the figures are not compared)."""
    tools = os.path.join(a.build_root, 'tools')
    out = ''
    for cmd in ([os.path.join(tools, 'moecl-info')],
                [os.path.join(tools, 'moecl-bench'), '--quick', '--iterations', '10', '--wall-calls', '10']):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        out += r.stdout
        if r.returncode != 0:
            failures.append('quick start: %s exits %d:\n%s%s' % (' '.join(cmd), r.returncode, r.stdout, r.stderr))
            return
    got = out.splitlines()
    lines = [ln for ln in shown.splitlines() if ln.strip() and ln.strip() != '...']
    header = [ln for ln in got if ln.startswith('op ')]
    rows = {row_key(ln): ln for ln in got if row_key(ln)}
    bad = []
    if not lines or lines[-1] != got[-1]:
        bad.append('the verdict: the README shows "%s", moecl-bench prints "%s"' % (lines and lines[-1], got[-1]))
    for ln in lines[:-1]:
        if ln.startswith('op '):
            if ln not in header:
                bad.append('the table header differs:\n  README: %s\n  now:    %s' % (ln, header and header[0]))
        elif row_key(ln):
            now = rows.get(row_key(ln))
            if now is None:
                bad.append('no case "%s" in the output' % row_key(ln))
            elif not now.endswith(' ok'):
                bad.append('case "%s" is not ok: %s' % (row_key(ln), now))
        elif ':' in ln:
            key = ln.split(':', 1)[0]
            if not any(g.startswith(key + ':') for g in got):
                bad.append('no line "%s: ..." in the output' % key)
        elif masked(ln) not in {masked(g) for g in got}:
            bad.append('no line "%s" in the output (its figures aside)' % ln)
    if bad:
        failures.append('the quick start\'s sample output is not what the tools print now:\n  ' + '\n  '.join(bad) +
                        '\nThey printed:\n' + out)
    else:
        print('ok: the quick start\'s sample output (%d lines, the verdict "%s") is what the tools print' %
              (len(lines), got[-1]))


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
    ap.add_argument('--include', required=True, action='append',
                    help='a folder holding moecl/moecl.h or moecl/version.h (given once for each)')
    ap.add_argument('--library', required=True, help='the built libmoecl.so (or .a, with --static-only)')
    ap.add_argument('--static-only', action='store_true',
                    help='the build has no shared library: --library is libmoecl.a, and the Python blocks, '
                    'whose package loads the shared one, are skipped')
    ap.add_argument('--build-root', required=True, help='the build tree the shell examples call build/')
    ap.add_argument('--python-package', required=True, help='the folder holding the Python package moecl')
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
    ran_c = ran_py = 0
    quick_sample = None
    for i, (section, lang, body) in enumerate(found):
        nxt = found[i + 1] if i + 1 < len(found) else None
        expected = nxt[2] if nxt and nxt[1] == 'text' else None
        if lang == 'c':
            run_c(i, body, expected, a, failures)
            ran_c += 1
        elif lang == 'python' and expected is not None:
            run_python(i, body, expected, a, failures)
            ran_py += 1
        elif section == 'Quick start' and lang in ('', 'text') and quick_sample is None:
            quick_sample = body
        if lang == 'sh':
            if section in SKIPPED:
                print('skipped: shell block %d ("%s"): %s' % (i, section, SKIPPED[section]))
            else:
                run_sh(i, section, body, a, failures)
    if ran_c == 0:
        failures.append('README.md has no ```c block')
    if ran_py == 0:
        failures.append('README.md has no ```python block followed by the ```text it prints')
    if quick_sample is None:
        failures.append('README.md: no sample output (a ``` or ```text block) in "Quick start"')
    else:
        check_quickstart_output(quick_sample, a, failures)
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
