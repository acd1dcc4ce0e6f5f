#!/usr/bin/env python3
"""`meson install` puts a usable moecl where a C project expects it.

Installs the build directory into a staging tree (`meson install --destdir
WORKDIR/root --no-rebuild`), then checks:
 - the files: libmoecl.so.VERSION with the libmoecl.so.SOVERSION and
   libmoecl.so links, libmoecl.a, include/moecl/<public headers>,
   pkgconfig/moecl.pc, the tools in bindir; the shared library's SONAME is
   libmoecl.so.SOVERSION and no installed binary has an RPATH/RUNPATH into
   the build directory;
 - moecl.pc: `pkg-config --modversion` is VERSION, and its flags, with
   prefix pointed at the staging tree (--define-variable=prefix=...), build
   tests/install/consumer.c, which runs on the default device with
   LD_LIBRARY_PATH at the installed libdir (ldd confirms that it loads the
   installed libmoecl.so.SOVERSION) and routes its tokens as worked out by
   hand;
 - the same consumer linked with the installed libmoecl.a and
   `pkg-config --static --libs` (Libs.private complete), without libmoecl.so;
 - each installed tool answers --help with exit status 0.
Exit 0 when all holds, 1 otherwise."""
import argparse
import os
import re
import shutil
import subprocess
import sys


def run(cmd, env=None, check=True, quiet=False):
    print('$ ' + ' '.join(cmd), flush=True)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    out = (r.stdout + r.stderr).strip()
    if out and not quiet:
        print(out, flush=True)
    if check and r.returncode != 0:
        raise SystemExit('FAIL: exit status %d' % r.returncode)
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--meson', required=True)
    ap.add_argument('--builddir', required=True)
    ap.add_argument('--workdir', required=True)
    ap.add_argument('--prefix', required=True)
    ap.add_argument('--libdir', required=True)
    ap.add_argument('--includedir', required=True)
    ap.add_argument('--bindir', required=True)
    ap.add_argument('--version', required=True)
    ap.add_argument('--soversion', required=True)
    ap.add_argument('--default-library', required=True)
    ap.add_argument('--header', action='append', default=[])
    ap.add_argument('--tool', action='append', default=[])
    ap.add_argument('--consumer', required=True)
    ap.add_argument('--pkg-config', default='pkg-config')
    ap.add_argument('--readelf', default='readelf')
    ap.add_argument('cc', nargs='+', help='-- C compiler command')
    a = ap.parse_args()

    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    root = os.path.join(a.workdir, 'root')
    run(a.meson.split() + ['install', '-C', a.builddir, '--destdir', root, '--no-rebuild', '--quiet'])

    def staged(d):
        return os.path.join(root + a.prefix, d) if not os.path.isabs(d) else root + d

    libdir, incdir, bindir = staged(a.libdir), staged(a.includedir), staged(a.bindir)
    shared = a.default_library in ('shared', 'both')
    static = a.default_library in ('static', 'both')
    bad = []
    expect = [os.path.join(incdir, 'moecl', h) for h in a.header]
    expect.append(os.path.join(libdir, 'pkgconfig', 'moecl.pc'))
    if shared:
        expect += [os.path.join(libdir, n) for n in
                   ('libmoecl.so.' + a.version, 'libmoecl.so.' + a.soversion, 'libmoecl.so')]
    if static:
        expect.append(os.path.join(libdir, 'libmoecl.a'))
    expect += [os.path.join(bindir, t) for t in a.tool]
    for path in expect:
        if not os.path.exists(path):
            bad.append('not installed: ' + os.path.relpath(path, root))
    if shared:
        for link in ('libmoecl.so.' + a.soversion, 'libmoecl.so'):
            p = os.path.join(libdir, link)
            if os.path.exists(p) and not os.path.islink(p):
                bad.append('%s is not a symbolic link' % link)
    print('installed:')
    for dirpath, _, files in sorted(os.walk(root)):
        for f in sorted(files):
            print('  /' + os.path.relpath(os.path.join(dirpath, f), root))
    if bad:
        print('\n'.join('FAIL: ' + b for b in bad))
        return 1

    builddir = os.path.realpath(a.builddir)
    elves = [os.path.join(bindir, t) for t in a.tool]
    if shared:
        lib = os.path.join(libdir, 'libmoecl.so.' + a.version)
        elves.append(lib)
        dyn = run([a.readelf, '-d', lib], quiet=True).stdout
        m = re.search(r'\(SONAME\)\s+Library soname: \[([^\]]+)\]', dyn)
        if not m or m.group(1) != 'libmoecl.so.' + a.soversion:
            bad.append('SONAME of the installed library is %s, expected libmoecl.so.%s'
                       % (m.group(1) if m else 'absent', a.soversion))
    for elf in elves:
        dyn = subprocess.run([a.readelf, '-d', elf], capture_output=True, text=True).stdout
        for m in re.finditer(r'\((?:RPATH|RUNPATH)\)\s+Library r(?:un)?path: \[([^\]]*)\]', dyn):
            if builddir in m.group(1):
                bad.append('%s has a run path into the build directory: %s' % (elf, m.group(1)))

    env = dict(os.environ)
    env['PKG_CONFIG_PATH'] = os.path.join(libdir, 'pkgconfig') + os.pathsep + env.get('PKG_CONFIG_PATH', '')
    env['MOECL_CACHE_DIR'] = os.path.join(a.workdir, 'kernel-cache')
    pc = [a.pkg_config, '--define-variable=prefix=' + root + a.prefix]
    modversion = run(pc + ['--modversion', 'moecl'], env=env).stdout.strip()
    if modversion != a.version:
        bad.append('pkg-config --modversion moecl is %s, expected %s' % (modversion, a.version))
    cflags = run(pc + ['--cflags', 'moecl'], env=env).stdout.split()
    warn = ['-std=c99', '-Wall', '-Wextra', '-Werror']

    if shared:
        libs = run(pc + ['--libs', 'moecl'], env=env).stdout.split()
        exe = os.path.join(a.workdir, 'consumer')
        run(a.cc + warn + cflags + [a.consumer, '-o', exe] + libs)
        renv = dict(env, LD_LIBRARY_PATH=libdir + os.pathsep + env.get('LD_LIBRARY_PATH', ''))
        ldd = run(['ldd', exe], env=renv).stdout
        m = re.search(r'libmoecl\.so\.(\S+) => (\S+)', ldd)
        if not m or m.group(1) != a.soversion or os.path.dirname(m.group(2)) != libdir:
            bad.append('the consumer does not load libmoecl.so.%s from %s' % (a.soversion, libdir))
        if run([exe, a.version], env=renv, check=False).returncode != 0:
            bad.append('the consumer linked with the installed libmoecl.so failed')
        for t in a.tool:
            r = run([os.path.join(bindir, t), '--help'], env=renv, check=False, quiet=True)
            if r.returncode != 0 or 'usage' not in r.stdout:
                bad.append('installed %s --help: exit status %d' % (t, r.returncode))
    if static:
        libs = run(pc + ['--static', '--libs', 'moecl'], env=env).stdout.split()
        libs = [x for x in libs if x != '-lmoecl']
        exe = os.path.join(a.workdir, 'consumer-static')
        run(a.cc + warn + cflags + [a.consumer, os.path.join(libdir, 'libmoecl.a'), '-o', exe] + libs)
        if 'libmoecl' in run(['ldd', exe], env=env).stdout:
            bad.append('the consumer linked with libmoecl.a still loads libmoecl.so')
        if run([exe, a.version], env=env, check=False).returncode != 0:
            bad.append('the consumer linked with the installed libmoecl.a failed')
        if not shared:
            for t in a.tool:
                r = run([os.path.join(bindir, t), '--help'], env=env, check=False, quiet=True)
                if r.returncode != 0 or 'usage' not in r.stdout:
                    bad.append('installed %s --help: exit status %d' % (t, r.returncode))
    if bad:
        print('\n'.join('FAIL: ' + b for b in bad))
        return 1
    print('ok: installed tree complete, pkg-config consumer (shared%s) routes as expected'
          % (' and static' if static else '') if shared else 'ok: installed tree complete, static consumer routes as expected')
    return 0


if __name__ == '__main__':
    sys.exit(main())
