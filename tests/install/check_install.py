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
 - each installed tool answers --help with exit status 0;
 - the README's smallest program (README.md, "Install and link") built
   with moecl.pc's flags prints what the README shows;
 - the CMake package (<libdir>/cmake/moecl): a CMake project outside the
   tree (tests/install/cmake/CMakeLists.txt, CMAKE_PREFIX_PATH at the
   staging tree) finds moecl by version, refuses a version it is not, and
   builds the README's program and the consumer against moecl::moecl and
   moecl::moecl_static; each runs as above, the shared ones loading the
   installed libmoecl.so, the static ones without it. The consumer checks
   the version macros against moecl_version() and VERSION.
Exit 0 when all holds, 1 otherwise, 77 (skip) when all but the CMake checks
hold and there is no cmake (--cmake none)."""
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


def readme_app(path):
    """The README's smallest program and the lines it shows it prints: the
    first ```c block after "The smallest program" in "Install and link",
    and the ```text block after it (the fresh-Debian check reads the same)."""
    text = open(path, encoding='utf-8').read()
    m = re.search(r'^## Install and link[ \t]*\n(.*?)(?=^## |\Z)', text, re.M | re.S)
    if not m:
        raise SystemExit('FAIL: README.md has no section "## Install and link"')
    sec = m.group(1)
    sec = sec[sec.find('The smallest program'):]
    c = re.search(r'^```c[ \t]*\n(.*?)^```', sec, re.M | re.S)
    if not c:
        raise SystemExit('FAIL: README.md: no ```c block after "The smallest program"')
    out = re.search(r'^```text[ \t]*\n(.*?)^```', sec[c.end():], re.M | re.S)
    if not out:
        raise SystemExit('FAIL: README.md: no ```text block after the smallest program')
    return c.group(1), out.group(1)


def ldd(exe, env):
    return run(['ldd', exe], env=env).stdout


def loads_installed(exe, env, libdir, soversion):
    """Whether exe loads libmoecl.so.SOVERSION from libdir."""
    m = re.search(r'libmoecl\.so\.(\S+) => (\S+)', ldd(exe, env))
    return bool(m) and m.group(1) == soversion and os.path.dirname(m.group(2)) == libdir


def check_app(exe, env, expected, what, bad):
    r = run([exe], env=env, check=False)
    if r.returncode != 0:
        bad.append('%s: exit status %d' % (what, r.returncode))
    elif r.stdout != expected:
        bad.append('%s printed %r; the README shows %r' % (what, r.stdout, expected))


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
    ap.add_argument('--readme', required=True)
    ap.add_argument('--cmake-project', required=True, help='the CMake consumer project folder')
    ap.add_argument('--cmake', default='none', help='the cmake program, or none')
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
    expect += [os.path.join(libdir, 'cmake', 'moecl', n) for n in ('moeclConfig.cmake', 'moeclConfigVersion.cmake')]
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
    renv = dict(env, LD_LIBRARY_PATH=libdir + os.pathsep + env.get('LD_LIBRARY_PATH', ''))
    app, app_out = readme_app(a.readme)
    app_c = os.path.join(a.workdir, 'app.c')
    with open(app_c, 'w') as f:
        f.write(app)

    if shared:
        libs = run(pc + ['--libs', 'moecl'], env=env).stdout.split()
        exe = os.path.join(a.workdir, 'consumer')
        run(a.cc + warn + cflags + [a.consumer, '-o', exe] + libs)
        if not loads_installed(exe, renv, libdir, a.soversion):
            bad.append('the consumer does not load libmoecl.so.%s from %s' % (a.soversion, libdir))
        if run([exe, a.version], env=renv, check=False).returncode != 0:
            bad.append('the consumer linked with the installed libmoecl.so failed')
        for t in a.tool:
            r = run([os.path.join(bindir, t), '--help'], env=renv, check=False, quiet=True)
            if r.returncode != 0 or 'usage' not in r.stdout:
                bad.append('installed %s --help: exit status %d' % (t, r.returncode))
        exe = os.path.join(a.workdir, 'app')
        run(a.cc + warn + cflags + [app_c, '-o', exe] + libs)
        check_app(exe, renv, app_out, 'the README\'s program linked with pkg-config', bad)
    if static:
        libs = run(pc + ['--static', '--libs', 'moecl'], env=env).stdout.split()
        libs = [x for x in libs if x != '-lmoecl']
        exe = os.path.join(a.workdir, 'consumer-static')
        run(a.cc + warn + cflags + [a.consumer, os.path.join(libdir, 'libmoecl.a'), '-o', exe] + libs)
        if 'libmoecl' in ldd(exe, env):
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
    if a.cmake == 'none':
        print('no cmake: the CMake package was installed but not tried as a consumer would; skipped')
        return 77
    cbuild = os.path.join(a.workdir, 'cmake-build')
    cmake_env = dict(renv, CC=a.cc[0])
    r = run([a.cmake, '-S', a.cmake_project, '-B', cbuild, '-DCMAKE_PREFIX_PATH=' + root + a.prefix,
             '-DMOECL_VERSION=' + a.version, '-DAPP_C=' + app_c, '-DCONSUMER_C=' + os.path.abspath(a.consumer),
             '-DCMAKE_BUILD_TYPE=Release'], env=cmake_env, check=False)
    if r.returncode != 0:
        bad.append('the CMake project does not configure against the installed package')
    elif run([a.cmake, '--build', cbuild], env=cmake_env, check=False).returncode != 0:
        bad.append('the CMake project does not build against the installed package')
    else:
        targets = (['shared'] if shared else []) + (['static'] if static else [])
        for kind in targets:
            for prog in ('app', 'consumer'):
                exe = os.path.join(cbuild, '%s-%s' % (prog, kind))
                if kind == 'shared' and not loads_installed(exe, renv, libdir, a.soversion):
                    bad.append('%s (CMake, moecl::moecl) does not load libmoecl.so from %s' % (exe, libdir))
                if kind == 'static' and 'libmoecl' in ldd(exe, renv):
                    bad.append('%s (CMake, moecl::moecl_static) loads libmoecl.so' % exe)
            check_app(os.path.join(cbuild, 'app-' + kind), renv, app_out,
                      'the README\'s program built with CMake (%s)' % kind, bad)
            if run([os.path.join(cbuild, 'consumer-' + kind), a.version], env=renv, check=False).returncode != 0:
                bad.append('the consumer built with CMake (%s) failed' % kind)
    if bad:
        print('\n'.join('FAIL: ' + b for b in bad))
        return 1
    print('ok: installed tree complete; pkg-config and CMake consumers (%s) route as expected'
          % ' and '.join((['shared'] if shared else []) + (['static'] if static else [])))
    return 0


if __name__ == '__main__':
    sys.exit(main())
