#!/usr/bin/env python3
"""The library exports moecl_* only.

--shared LIB: every symbol LIB defines in its dynamic symbol table
(`nm -D --defined-only`) is named moecl_*, every function of the public
headers (MOECL_API) is among them, and the SONAME is libmoecl.so.SOVERSION.
--static LIB: every global symbol the archive's objects define
(`nm -g --defined-only`) is named moecl_*, internal ones included, so that
linking libmoecl.a into a program cannot collide with its names.
Exit 0 when all holds, 1 otherwise (each offending symbol is listed)."""
import argparse
import re
import subprocess
import sys


def nm(tool, args):
    return subprocess.run([tool] + args, check=True, capture_output=True, text=True).stdout


def defined(output):
    """(type, name) of each defined symbol line of nm's output."""
    out = []
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] not in ('U', 'w', 'v'):
            out.append((parts[1], parts[2]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--nm', default='nm')
    ap.add_argument('--readelf', default='readelf')
    ap.add_argument('--shared')
    ap.add_argument('--static')
    ap.add_argument('--soversion')
    ap.add_argument('--header', action='append', default=[], help='public header: its MOECL_API functions must be exported')
    a = ap.parse_args()
    bad = 0
    if a.shared:
        syms = defined(nm(a.nm, ['-D', '--defined-only', a.shared]))
        names = {n for _, n in syms}
        others = sorted(n for n in names if not n.startswith('moecl_'))
        for n in others:
            print('%s exports %s, which is not moecl_*' % (a.shared, n))
        bad += len(others)
        api = set()
        for h in a.header:
            with open(h, encoding='utf-8') as f:
                api |= set(re.findall(r'MOECL_API\b[^;(]*?\b(moecl_\w+)\s*\(', f.read()))
        missing = sorted(api - names)
        for n in missing:
            print('%s does not export %s (declared MOECL_API)' % (a.shared, n))
        bad += len(missing)
        print('%s: %d dynamic symbols defined, all moecl_*: %s; %d MOECL_API functions, all exported: %s'
              % (a.shared, len(names), 'yes' if not others else 'no', len(api), 'yes' if not missing else 'no'))
        if a.soversion is not None:
            dyn = subprocess.run([a.readelf, '-d', a.shared], check=True, capture_output=True, text=True).stdout
            m = re.search(r'\(SONAME\)\s+Library soname: \[([^\]]+)\]', dyn)
            want = 'libmoecl.so.%s' % a.soversion
            if not m or m.group(1) != want:
                print('%s: SONAME is %s, expected %s' % (a.shared, m.group(1) if m else 'absent', want))
                bad += 1
            else:
                print('%s: SONAME %s' % (a.shared, want))
    if a.static:
        syms = defined(nm(a.nm, ['-g', '--defined-only', a.static]))
        others = sorted({n for _, n in syms if not n.startswith('moecl_')})
        for n in others:
            print('%s defines the global symbol %s, which is not moecl_*' % (a.static, n))
        bad += len(others)
        print('%s: %d global symbols defined, all moecl_*: %s' % (a.static, len(syms), 'yes' if not others else 'no'))
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
