#!/usr/bin/env python3
"""Portability suite: compile every kernel variant the library builds for
Intel GPUs (ocloc) and AMD GPUs (clang, amdgcn) with the exact build
options and defines the runtime would pass on such devices.

tests/portability_variants (a C program linked with the library) writes the
program texts and a manifest of compiles; each distinct compile is made once
per compiler, on one of the targets that build it, the targets taking turns
(--all-targets: every target compiles every variant); this script runs the compilers,
one per CPU at a time (MOECL_PORTABILITY_JOBS=n sets it), target by target,
and fails on any compile failure, printing the variant, its options and the
compiler's output. A compile also fails when its binary does not hold the
kernel the runtime would create, and, for AMD, when the object calls a
function of the kernel source that was not emitted (an un-inlined C99
`inline` function, which the device's link would not resolve).

A missing compiler fails the suite, unless MOECL_PORTABILITY=skip, which
skips the targets of the missing compilers with a message (and the whole
suite, exit 77, when none is left). Compilers: ocloc (Debian
intel-opencl-icd) and clang-15; MOECL_OCLOC and MOECL_CLANG name others.

--inject-error: compile a copy of the kernels with a non-OpenCL-1.2 call
(work_group_reduce_max, OpenCL 2.0) in a rarely compiled branch (one that
only variants with teams of more than 32 work-items compile, as the tree
reductions of cl/common.cl are), for a should_fail test that shows the
suite catches it. Exit 1 then means "failed, and only because of the
injected call, in the variants that compile that branch"; anything else
(nothing failed, or something else did) exits 0, which the should_fail
test reports as an unexpected pass.
"""
import argparse
import concurrent.futures
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

AMD_TRIPLE = 'amdgcn-amd-amdhsa'
# Appended to cl/common.cl, so at file scope whatever the file holds.
INJECT_TEXT = ('\n/* injected by tests/portability.py --inject-error: OpenCL 2.0 only */\n'
               '#if TEAM > 32\n'
               'static inline uint moecl_injected_error(uint v) { return work_group_reduce_max(v); }\n'
               '#endif\n')


def large_team(options):
    """Whether a compile's options name a team of more than 32 work-items."""
    for word in options.split():
        if word.startswith('-DTEAM='):
            return int(word[len('-DTEAM='):]) > 32
    return False


def compiler_path(kind):
    if kind == 'ocloc':
        return shutil.which(os.environ.get('MOECL_OCLOC') or 'ocloc')
    return shutil.which(os.environ.get('MOECL_CLANG') or 'clang-15')


def read_manifest(path):
    rows = []
    with open(path, encoding='utf-8') as f:
        for line in f:
            compiler, arch, config, program, kernel, options, description = line.rstrip('\n').split('\t')
            rows.append(dict(compiler=compiler, arch=arch, config=config, program=program, kernel=kernel,
                             options=options, description=description))
    return rows


def undefined_symbols(path):
    """The undefined symbols of a little-endian ELF64 object (its .symtab)."""
    with open(path, 'rb') as f:
        data = f.read()
    if data[:4] != b'\x7fELF' or data[4] != 2 or data[5] != 1:
        raise ValueError('%s is not a little-endian ELF64 file' % path)
    shoff, = struct.unpack_from('<Q', data, 0x28)
    shentsize, shnum = struct.unpack_from('<HH', data, 0x3a)
    sections = [struct.unpack_from('<IIQQQQIIQQ', data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _, sh_type, _, _, offset, size, link, _, _, entsize in sections:
        if sh_type != 2:  # SHT_SYMTAB
            continue
        strtab = sections[link]
        for at in range(offset + entsize, offset + size, entsize):  # entry 0 is the null symbol
            st_name, _, _, st_shndx = struct.unpack_from('<IBBH', data, at)
            if st_shndx == 0 and st_name:
                start = strtab[4] + st_name
                names.append(data[start:data.index(b'\0', start)].decode())
    return names


def compile_one(job, exe, workdir, outdir):
    """Run one compile in its own folder; returns (job, ok, command, output)."""
    os.makedirs(outdir, exist_ok=True)
    source = os.path.join(workdir, job['program'])
    if job['compiler'] == 'ocloc':
        # The options go to the OpenCL compiler as one string, as
        # clBuildProgram gets them.
        cmd = [exe, 'compile', '-file', source, '-device', job['arch'], '-options', job['options'],
               '-out_dir', outdir, '-output', 'variant']
    else:
        cmd = [exe, '-x', 'cl', '-cl-std=CL1.2', '-target', AMD_TRIPLE, '-nogpulib', '-mcpu=' + job['arch']]
        cmd += job['options'].split()
        cmd += ['-c', source, '-o', os.path.join(outdir, 'variant.o')]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=outdir)
    output = proc.stdout.decode('utf-8', 'replace')
    ok = proc.returncode == 0
    if ok:
        # The binary must hold the kernel the runtime would create: a
        # variant whose #if branches leave no such kernel compiles fine
        # but fails at clCreateKernel.
        # A program with several kernels (moe_align) lists them all,
        # comma-separated; each must be there.
        binaries = [os.path.join(outdir, n) for n in os.listdir(outdir) if n.endswith(('.bin', '.o'))]
        contents = b''
        for b in binaries:
            with open(b, 'rb') as f:
                contents += f.read()
        missing = [k for k in job['kernel'].split(',') if k.encode() not in contents]
        if missing:
            ok = False
            output += '\n[portability] compiled, but no binary holds the kernel %s (files: %s)\n' % (
                ', '.join(missing), ', '.join(os.listdir(outdir)) or 'none')
    if ok and job['compiler'] == 'clang':
        # Built without the ROCm device library, the object calls the
        # OpenCL builtins as undefined symbols, all mangled (overloadable).
        # An unmangled one is a function of the kernel source that was not
        # inlined and has no definition (C99 `inline` without `static`
        # emits none): the device's link or load would fail.
        ours = [n for n in undefined_symbols(os.path.join(outdir, 'variant.o')) if not n.startswith('_Z')]
        if ours:
            ok = False
            output += ('\n[portability] the object calls %s, defined in the kernel source but not emitted '
                       '(an `inline` function that was not inlined: make it `static inline`)\n' % ', '.join(ours))
    if ok:
        shutil.rmtree(outdir, ignore_errors=True)
    return job, ok, cmd, output


def spread(rows, targets):
    """Each distinct compile (program, kernels, options) once per compiler,
    on one of the targets that build it, those targets taking turns: every
    variant still meets an Intel and an AMD compiler, and every target a
    share of every program, in about a third of the compiles of the whole
    matrix (--all-targets), which differs only in the backends' code
    generation of the same source."""
    turn = {}
    chosen = {}
    for r in rows:
        if (r['compiler'], r['arch']) not in targets:
            continue
        key = (r['compiler'], r['program'], r['kernel'], r['options'])
        chosen.setdefault(key, []).append(r)
    kept = []
    for key, candidates in chosen.items():
        archs = sorted({r['arch'] for r in candidates}, key=lambda a: [t[1] for t in targets].index(a))
        n = turn.get((key[0], tuple(archs)), 0)
        turn[(key[0], tuple(archs))] = n + 1
        arch = archs[n % len(archs)]
        kept.append(next(r for r in candidates if r['arch'] == arch))
    return kept


def quote(cmd):
    return ' '.join("'%s'" % c if (' ' in c or not c) else c for c in cmd)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--generator', required=True, help='the portability_variants program')
    ap.add_argument('--workdir', required=True, help='scratch folder (emptied first)')
    ap.add_argument('--cl-dir', help='the source cl/ folder (for --inject-error)')
    ap.add_argument('--targets', help='comma-separated ocloc devices / AMD gfx names to compile for (default all)')
    ap.add_argument('--only', help='compile only the variants whose description contains this text')
    ap.add_argument('--inject-error', action='store_true', help='compile a deliberately broken copy of the kernels')
    ap.add_argument('--all-targets', action='store_true',
                    help='compile every variant for every target (default: each distinct variant once per '
                         'compiler, the targets that build it taking turns)')
    args = ap.parse_args()

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
    jobs = int(os.environ.get('MOECL_PORTABILITY_JOBS') or cpus or 2)
    skip_missing = os.environ.get('MOECL_PORTABILITY', '') == 'skip'

    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    env = dict(os.environ)
    if args.inject_error:
        if not args.cl_dir:
            ap.error('--inject-error needs --cl-dir')
        broken = os.path.join(args.workdir, 'broken-cl')
        shutil.copytree(args.cl_dir, broken)
        path = os.path.join(broken, 'common.cl')
        with open(path, 'a', encoding='utf-8') as f:
            f.write(INJECT_TEXT)
        env['MOECL_KERNEL_DIR'] = broken
        print('[portability] MOECL_KERNEL_DIR=%s: common.cl with a work_group_reduce_max call that only '
              'teams of more than 32 compile' % broken)

    variants_dir = os.path.join(args.workdir, 'variants')
    gen = subprocess.run([args.generator, variants_dir], env=env)
    if gen.returncode != 0:
        print('[portability] %s failed (exit %d)' % (args.generator, gen.returncode))
        return 1
    rows = read_manifest(os.path.join(variants_dir, 'manifest.tsv'))
    if args.only:
        rows = [r for r in rows if args.only in r['description']]
    wanted = set(args.targets.split(',')) if args.targets else None

    # Targets in manifest order.
    targets = []
    for r in rows:
        key = (r['compiler'], r['arch'])
        if key not in targets and (wanted is None or r['arch'] in wanted):
            targets.append(key)
    if wanted is not None and len(targets) != len(wanted):
        print('[portability] unknown targets: %s' % ', '.join(sorted(wanted - {a for _, a in targets})))
        return 1

    exes = {}
    missing = []
    for compiler in sorted({c for c, _ in targets}):
        exes[compiler] = compiler_path(compiler)
        if not exes[compiler]:
            missing.append(compiler)
    for compiler in missing:
        name = (os.environ.get('MOECL_OCLOC') or 'ocloc (Debian: apt-get install intel-opencl-icd)'
                if compiler == 'ocloc' else os.environ.get('MOECL_CLANG') or 'clang-15 (Debian: apt-get install clang-15)')
        skipped = ', '.join(a for c, a in targets if c == compiler)
        if skip_missing:
            print('[portability] SKIPPING %s: %s is not installed (MOECL_PORTABILITY=skip)' % (skipped, name))
        else:
            print('[portability] FAIL: %s is not installed, so %s cannot be compiled for; install it, or set '
                  'MOECL_PORTABILITY=skip to skip these targets' % (name, skipped))
            return 1
    targets = [t for t in targets if t[0] not in missing]
    if not targets:
        print('[portability] nothing to compile: skipped')
        return 77
    if args.inject_error and missing:
        print('[portability] --inject-error needs every compiler: skipped')
        return 77

    if not args.all_targets:
        rows = spread(rows, targets)

    failures = []
    warnings = []
    summary = []
    total_start = time.monotonic()
    for compiler, arch in targets:
        todo = [r for r in rows if r['compiler'] == compiler and r['arch'] == arch]
        start = time.monotonic()
        failed = 0
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(compile_one, job, exes[compiler], variants_dir,
                                   os.path.join(args.workdir, 'out', arch, str(i)))
                       for i, job in enumerate(todo)]
            for fut in concurrent.futures.as_completed(futures):
                job, ok, cmd, output = fut.result()
                if not ok:
                    failed += 1
                    failures.append((job, cmd, output))
                elif 'warning' in output.lower():
                    warnings.append((job, output))
        elapsed = time.monotonic() - start
        kernels = sorted({k for r in todo for k in r['kernel'].split(',')})
        line = '%-8s %-6s %4d variants (%s) %6.1f s  %s' % (
            arch, compiler, len(todo), ', '.join(kernels), elapsed, 'ok' if not failed else '%d FAILED' % failed)
        summary.append(line)
        print('[portability] ' + line, flush=True)

    shown = 0
    for job, cmd, output in failures:
        print()
        print('=' * 78)
        print('FAILED: %s for %s (%s)' % (job['arch'], job['description'], job['config']))
        print('kernel: %s' % job['kernel'])
        print('options: %s' % job['options'])
        print('command: %s' % quote(cmd))
        if shown < 8:
            lines = output.rstrip().splitlines()
            if len(lines) > 60:
                lines = lines[:60] + ['... (%d more lines)' % (len(lines) - 60)]
            print('\n'.join(lines))
            shown += 1
        else:
            print('(compiler output omitted: see the first failures)')

    if warnings:
        # Not failures (register spills and the like), but worth seeing.
        print()
        print('== compiler warnings (the compiles succeeded) ==')
        seen = set()
        for job, output in warnings:
            for w in output.splitlines():
                w = ' '.join(w.split())
                if 'warning' in w.lower() and (job['arch'], w) not in seen:
                    seen.add((job['arch'], w))
                    print('%s: %s -- first in %s' % (job['arch'], w, job['description']))

    print()
    print('== portability summary (%d jobs) ==' % jobs)
    for line in summary:
        print(line)
    print('%d compiles%s, %d failed, %.1f s' % (sum(1 for r in rows if (r['compiler'], r['arch']) in targets),
                                               '' if args.all_targets else ' (each variant once per compiler)',
                                             len(failures), time.monotonic() - total_start))
    if warnings:
        print('%d compiles with warnings (listed above)' % len(warnings))
    if missing:
        print('skipped (compiler missing, MOECL_PORTABILITY=skip): %s' % ', '.join(missing))
    if args.inject_error:
        return check_injected(failures, rows, targets)
    return 1 if failures else 0


def check_injected(failures, rows, targets):
    """For --inject-error: 1 if the suite failed exactly as it should."""
    problems = []
    for compiler, arch in targets:
        expected = {r['options'] for r in rows if (r['compiler'], r['arch']) == (compiler, arch)
                    and large_team(r['options'])}
        failed = {job['options'] for job, _, _ in failures if job['arch'] == arch}
        if not expected:
            problems.append('%s: no variant compiles the branch of teams of more than 32' % arch)
        elif failed != expected:
            problems.append('%s: %d variants compile the broken branch, %d failed, %d of them outside it' % (
                arch, len(expected), len(failed), len(failed - expected)))
    for job, _, output in failures:
        if 'work_group_reduce_max' not in output:
            problems.append('%s failed without naming the injected call: %s' % (job['arch'], job['description']))
    print()
    if problems:
        print('[portability] --inject-error: the suite did not fail as expected:')
        print('\n'.join('  ' + p for p in problems[:20]))
        return 0
    print('[portability] --inject-error: the suite failed as expected: %d compiles failed, all on the injected '
          'work_group_reduce_max of the teams of more than 32, and no other' % len(failures))
    return 1


if __name__ == '__main__':
    sys.exit(main())
