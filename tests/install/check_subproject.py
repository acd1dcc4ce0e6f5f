#!/usr/bin/env python3
"""moecl works as a meson subproject.

Creates WORKDIR/consumer, a throwaway meson project whose meson.build is

    project('consumer', 'c', default_options : ['warning_level=2', 'werror=true'])
    moecl_dep = dependency('moecl', fallback : ['moecl', 'moecl_dep'],
      default_options : ['tests=disabled', 'tools=false'])
    executable('consumer', 'consumer.c', dependencies : moecl_dep)

(docs/install.md's snippet), with subprojects/moecl a copy of the source tree
(without .git and build directories), configures it with --force-fallback-for=moecl (so an installed
moecl is not picked instead) and -Dmoecl:tests=disabled -Dmoecl:tools=false
-Dmoecl:docs=disabled, builds it, and runs the consumer
(tests/install/consumer.c) on the default device: it must route its tokens
as worked out by hand. Also checks that the subproject's library is the one
linked. Exit 0 when all holds, 1 otherwise."""
import argparse
import os
import shutil
import subprocess
import sys

MESON_BUILD = """project('consumer', 'c', default_options : ['warning_level=2', 'werror=true'])
moecl_dep = dependency('moecl', fallback : ['moecl', 'moecl_dep'],
  default_options : ['tests=disabled', 'tools=false'])
executable('consumer', 'consumer.c', dependencies : moecl_dep)
"""


def ignore(src):
    def skip(directory, names):
        out = {'.git', '__pycache__', 'subprojects'} & set(names)
        for n in names:
            p = os.path.join(directory, n)
            # A build directory: meson's or anything with a build.ninja.
            if os.path.isdir(p) and (os.path.exists(os.path.join(p, 'meson-private'))
                                     or os.path.exists(os.path.join(p, 'build.ninja'))):
                out.add(n)
        return out
    return skip


def run(cmd, env=None, cwd=None):
    print('$ ' + ' '.join(cmd), flush=True)
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    out = (r.stdout + r.stderr).strip()
    if out:
        print(out, flush=True)
    if r.returncode != 0:
        raise SystemExit('FAIL: exit status %d' % r.returncode)
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--meson', required=True)
    ap.add_argument('--source', required=True)
    ap.add_argument('--workdir', required=True)
    ap.add_argument('--consumer', required=True)
    ap.add_argument('--version', required=True)
    a = ap.parse_args()
    meson = a.meson.split()
    shutil.rmtree(a.workdir, ignore_errors=True)
    proj = os.path.join(a.workdir, 'consumer')
    os.makedirs(os.path.join(proj, 'subprojects'))
    with open(os.path.join(proj, 'meson.build'), 'w', encoding='utf-8') as f:
        f.write(MESON_BUILD)
    shutil.copy(a.consumer, os.path.join(proj, 'consumer.c'))
    src = os.path.realpath(a.source)
    shutil.copytree(src, os.path.join(proj, 'subprojects', 'moecl'), ignore=ignore(src), symlinks=True)
    build = os.path.join(proj, 'build')
    run(meson + ['setup', build, proj, '--wrap-mode=nodownload', '--force-fallback-for=moecl',
                 '-Dmoecl:tests=disabled', '-Dmoecl:tools=false', '-Dmoecl:docs=disabled'])
    run(meson + ['compile', '-C', build])
    env = dict(os.environ, MOECL_CACHE_DIR=os.path.join(a.workdir, 'kernel-cache'))
    exe = os.path.join(build, 'consumer')
    ldd = run(['ldd', exe], env=env).stdout
    want = os.path.join(build, 'subprojects', 'moecl')
    if 'libmoecl' in ldd and want not in ldd:
        print('FAIL: the consumer does not load the subproject\'s libmoecl (%s)' % want)
        return 1
    run([exe, a.version], env=env)
    print('ok: moecl as a subproject builds and routes as expected')
    return 0


if __name__ == '__main__':
    sys.exit(main())
