"""The package's version: meson.build's project version, which
meson-python copies into the package metadata when pip builds it."""

from importlib.metadata import PackageNotFoundError, version as _dist_version

try:
    __version__ = _dist_version("moecl")
except PackageNotFoundError:  # imported from a source tree, not installed
    __version__ = "0+unknown"
