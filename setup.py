"""setuptools' part of pyproject.toml: the version from meson.build, and
setuptools' scratch kept out of meson's build directories."""

import os
import re

from setuptools import setup

here = os.path.dirname(os.path.abspath(__file__))


def meson_version() -> str:
    """project(... version : 'X.Y.Z' ...) of meson.build, the one place the version is set."""
    with open(os.path.join(here, "meson.build"), encoding="utf-8") as f:
        m = re.search(r"^project\(.*?\bversion\s*:\s*'([^']+)'", f.read(), re.S | re.M)
    if not m:
        raise SystemExit("setup.py: no version : '...' in meson.build's project()")
    return m.group(1)


# setuptools writes build/ and <package>.egg-info by default; build/ is
# where the README has meson build, so both go to build-python/ instead.
scratch = "build-python"
os.makedirs(scratch, exist_ok=True)
setup(version=meson_version(),
      options={"build": {"build_base": scratch}, "egg_info": {"egg_base": scratch}})
