#!/usr/bin/env python3
"""Runs a tool and checks what scripts rely on: its exit status (--status,
default 0), that stdout contains each --contains text and none of the
--stdout-lacks texts, that stderr contains each --stderr-contains text
and none of the --stderr-lacks texts,
and with --json that stdout (or --json-file) is valid UTF-8 and one valid
JSON object (what `python3 -m json.tool` accepts) holding each --key (a
dotted path; `a.0.b` indexes a list). Usage: check-tool.py [options] --
TOOL [ARGS...]. Exit 0 when all holds, 1 otherwise."""
import argparse
import json
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--status', type=int, default=0)
    ap.add_argument('--contains', action='append', default=[])
    ap.add_argument('--stdout-lacks', action='append', default=[])
    ap.add_argument('--stderr-contains', action='append', default=[])
    ap.add_argument('--stderr-lacks', action='append', default=[])
    ap.add_argument('--json', action='store_true')
    ap.add_argument('--json-file')
    ap.add_argument('--key', action='append', default=[])
    ap.add_argument('command', nargs='+')
    a = ap.parse_args()
    r = subprocess.run(a.command, capture_output=True)
    bad = []
    # Decoded strictly: a byte that is not UTF-8 is a failure, not a crash.
    try:
        stdout = r.stdout.decode('utf-8')
    except UnicodeDecodeError as e:
        bad.append('stdout is not valid UTF-8: %s' % e)
        stdout = r.stdout.decode('utf-8', 'replace')
    stderr = r.stderr.decode('utf-8', 'replace')
    sys.stdout.write(stdout)
    sys.stdout.write(stderr)
    if r.returncode != a.status:
        bad.append('exit status %d, expected %d' % (r.returncode, a.status))
    bad += ['stdout lacks %r' % c for c in a.contains if c not in stdout]
    bad += ['stdout has %r' % c for c in a.stdout_lacks if c in stdout]
    bad += ['stderr lacks %r' % c for c in a.stderr_contains if c not in stderr]
    bad += ['stderr has %r' % c for c in a.stderr_lacks if c in stderr]
    if a.json or a.json_file:
        try:
            if a.json_file:
                with open(a.json_file, encoding='utf-8', errors='strict') as f:
                    doc = json.load(f)
            else:
                doc = json.loads(stdout)
        except (OSError, ValueError) as e:
            bad.append('not valid JSON: %s' % e)
            doc = None
        if doc is not None and not isinstance(doc, dict):
            bad.append('the JSON is not an object')
        for key in a.key if isinstance(doc, dict) else []:
            node = doc
            for part in key.split('.'):
                try:
                    node = node[int(part)] if isinstance(node, list) else node[part]
                except (KeyError, IndexError, ValueError, TypeError):
                    bad.append('the JSON lacks %s' % key)
                    break
    for b in bad:
        print('FAIL: ' + b)
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
