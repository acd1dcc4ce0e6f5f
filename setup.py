"""setuptools' part of pyproject.toml: the version from meson.build, and
setuptools' scratch kept out of the tree."""

import atexit
import os
import re
import shutil
import tempfile

from setuptools import setup

here = os.path.dirname(os.path.abspath(__file__))


def meson_version() -> str:
    """project(... version : 'X.Y.Z' ...) of meson.build, the one place the version is set."""
    with open(os.path.join(here, "meson.build"), encoding="utf-8") as f:
        m = re.search(r"^project\(.*?\bversion\s*:\s*'([^']+)'", f.read(), re.S | re.M)
    if not m:
        raise SystemExit("setup.py: no version : '...' in meson.build's project()")
    return m.group(1)


# setuptools writes build/ and <package>.egg-info into the tree by default:
# build/ is where the README has meson build, and a build/lib left from an
# earlier build would ship modules since removed. A fresh directory each
# run, removed at exit (pip runs each build step in its own process).
scratch = tempfile.mkdtemp(prefix="moecl-setuptools-")
atexit.register(shutil.rmtree, scratch, True)
setup(version=meson_version(),
      options={"build": {"build_base": scratch}, "egg_info": {"egg_base": scratch}})
