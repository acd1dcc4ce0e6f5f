#!/usr/bin/env python3
"""A public header compiles alone: writes a source file that includes only
HEADER (as <HEADER>), twice, and takes the address of every function the
header declares MOECL_API, and compiles it to an object with the compiler
command and flags after `--`. The language follows --lang (c or c++). With
--nm, the object's undefined symbols must be those functions' plain names:
in C++ that proves the extern "C" block (a C++ declaration would be
mangled, _Z...). Exit 0 when it compiles without a diagnostic and the names
are plain, 1 otherwise (the compiler's output is printed), 77 (skip) when
--lang c++ has no compiler."""
import argparse
import os
import re
import subprocess
import sys
import tempfile


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--lang', choices=['c', 'c++'], required=True)
    ap.add_argument('--header', required=True, help='as included, e.g. moecl/moecl.h')
    ap.add_argument('-I', dest='include', action='append', default=[])
    ap.add_argument('--nm')
    ap.add_argument('command', nargs='+', help='-- compiler and flags')
    a = ap.parse_args()
    if not a.command or a.command[0] == 'none':
        print('no %s compiler: skipped' % a.lang)
        return 77
    ext = '.c' if a.lang == 'c' else '.cpp'
    text = None
    for d in a.include:
        if os.path.exists(os.path.join(d, a.header)):
            with open(os.path.join(d, a.header), encoding='utf-8') as f:
                text = f.read()
            break
    if text is None:
        print('FAIL: %s not found under %s' % (a.header, ' '.join(a.include)))
        return 1
    funcs = sorted(set(re.findall(r'MOECL_API\b[^;(]*?\b(moecl_\w+)\s*\(', text)))
    with tempfile.TemporaryDirectory(prefix='moecl-header-') as tmp:
        src = os.path.join(tmp, 'header_test' + ext)
        with open(src, 'w', encoding='utf-8') as f:
            # Twice: the include guard works. A declaration after it: the
            # header leaves no open extern "C" block or #if behind.
            f.write('#include <%s>\n#include <%s>\n\nint moecl_header_test(void);\n' % (a.header, a.header))
            f.write('typedef void (*moecl_header_test_fn)(void);\n')
            f.write('extern const moecl_header_test_fn moecl_header_test_refs[];\n')
            f.write('const moecl_header_test_fn moecl_header_test_refs[] = {\n')
            for fn in funcs:
                if a.lang == 'c':
                    f.write('    (moecl_header_test_fn)&%s,\n' % fn)
                else:
                    f.write('    reinterpret_cast<moecl_header_test_fn>(&%s),\n' % fn)
            f.write('    0\n};\n')
            if a.lang == 'c':
                f.write('int moecl_header_test(void) { return (int)MOECL_SUCCESS; }\n')
            else:
                f.write('int moecl_header_test(void) { return static_cast<int>(MOECL_SUCCESS); }\n')
        cmd = a.command + ['-I' + d for d in a.include] + ['-c', src, '-o', os.path.join(tmp, 'header_test.o')]
        print(' '.join(cmd))
        r = subprocess.run(cmd, capture_output=True, text=True)
        out = (r.stdout + r.stderr).strip()
        if out:
            print(out)
        if r.returncode != 0 or out:
            print('FAIL: %s does not compile alone as %s' % (a.header, a.lang))
            return 1
        if a.nm:
            und = subprocess.run([a.nm, '-u', os.path.join(tmp, 'header_test.o')], check=True,
                                 capture_output=True, text=True).stdout.split()
            missing = [fn for fn in funcs if fn not in und]
            if missing:
                print('\n'.join(l for l in und if l != 'U'))
                print('FAIL: not referenced by their plain (C) names: %s' % ' '.join(missing))
                return 1
            print('%d MOECL_API functions referenced by their C names' % len(funcs))
    print('%s compiles alone as %s' % (a.header, ' '.join(x for x in a.command if x.startswith('-std=')) or a.lang))
    return 0


if __name__ == '__main__':
    sys.exit(main())
