"""The package itself: its version is meson.build's, its declarations are
for meson.build's soname, and a library it cannot load is reported with
what was tried."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import moecl
from moecl import _lib

ROOT = Path(__file__).resolve().parents[2]
MESON = (ROOT / "meson.build").read_text()


def test_version_is_meson_builds():
    want = re.search(r"^project\(.*?\bversion\s*:\s*'([^']+)'", MESON, re.S | re.M).group(1)
    assert moecl.__version__ == want, "the installed package's version (pip install . again?)"
    assert moecl.version() == want, "the loaded libmoecl's version"


def test_abi_is_meson_builds_soversion():
    assert "moecl_soversion = '%d'" % _lib.ABI_VERSION in MESON


def test_status_strings():
    assert moecl.status_string(0) == "success"
    assert moecl.status_string(-2000) == "invalid argument"
    assert issubclass(moecl.InvalidArgumentError, moecl.Error)


def test_describe(ctx):
    text = ctx.describe()
    assert "device:" in text and "launch class:" in text


def run_import(env):
    return subprocess.run([sys.executable, "-c", "import moecl"], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_unloadable_library_is_reported():
    r = run_import({"MOECL_LIBRARY": "/nonexistent/libmoecl.so.1"})
    assert r.returncode != 0
    assert "OSError: moecl: cannot load the C library libmoecl.so" in r.stderr
    assert "/nonexistent/libmoecl.so.1" in r.stderr and "MOECL_LIBRARY" in r.stderr


def test_search_order_is_reported(tmp_path):
    # No MOECL_LIBRARY, a pkg-config that finds nothing, no loader cache hit:
    # the package's own library (pip builds it in), else the message names
    # each place tried.
    env = {"MOECL_LIBRARY": "", "PKG_CONFIG_PATH": str(tmp_path), "PKG_CONFIG_LIBDIR": str(tmp_path),
           "LD_LIBRARY_PATH": "", "PATH": os.environ.get("PATH", "")}
    r = run_import(env)
    if os.path.exists(_lib.BUNDLED):
        assert r.returncode == 0, r.stderr
        r = subprocess.run([sys.executable, "-c", "import moecl; print(moecl.library()._name)"], capture_output=True,
                           text=True, env={**os.environ, **env}, timeout=120)
        assert r.stdout.strip() == _lib.BUNDLED, r.stdout + r.stderr
        return
    if r.returncode == 0:
        import ctypes.util
        assert ctypes.util.find_library("moecl"), "imported with no MOECL_LIBRARY, pkg-config or loader cache entry"
        return  # installed system-wide: the loader cache has it
    assert "MOECL_LIBRARY: unset" in r.stderr and _lib.BUNDLED in r.stderr
    assert "pkg-config" in r.stderr and 'find_library("moecl")' in r.stderr


def test_moecl_library_wins(tmp_path):
    # MOECL_LIBRARY, when set, is the library loaded, the package's own or not:
    # a copy of the library in use, under another name, is the one loaded.
    import shutil
    path = str(tmp_path / "libmoecl-mine.so")
    shutil.copy(os.environ.get("MOECL_LIBRARY") or _lib.BUNDLED, path)
    r = subprocess.run([sys.executable, "-c", "import moecl; print(moecl.library()._name)"], capture_output=True,
                       text=True, env={**os.environ, "MOECL_LIBRARY": path}, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == path, r.stdout + r.stderr


def moecl_platform_names():
    """The platforms' names in the order of moecl's "P:D": the OpenCL loader
    that libmoecl links. A pyopencl wheel brings a loader of its own, whose
    order may differ (on a machine with pocl and NVIDIA's OpenCL it did)."""
    ocl = ctypes.CDLL("libOpenCL.so.1")  # the one libmoecl loaded, by its soname
    ocl.clGetPlatformIDs.argtypes = [ctypes.c_uint, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint)]
    ocl.clGetPlatformInfo.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p,
                                      ctypes.c_void_p]
    n = ctypes.c_uint(0)
    assert ocl.clGetPlatformIDs(0, None, ctypes.byref(n)) == 0
    ids = (ctypes.c_void_p * n.value)()
    assert ocl.clGetPlatformIDs(n.value, ids, None) == 0
    names = []
    for p in ids:
        buf = ctypes.create_string_buffer(256)
        assert ocl.clGetPlatformInfo(p, 0x0902, 256, buf, None) == 0  # CL_PLATFORM_NAME
        names.append(buf.value.decode(errors="replace"))
    return names


def test_device_selectors(ctx):
    # The C API's selectors, as MOECL_DEVICE takes them: "P:D" and a name part.
    pytest.importorskip("pyopencl")  # ctx.queue is a pyopencl queue
    platform = ctx.queue.device.platform
    names = moecl_platform_names()
    assert names.count(platform.name) == 1, names
    index = names.index(platform.name)
    dev = platform.get_devices().index(ctx.queue.device)
    with moecl.Context("%d:%d" % (index, dev)) as c:
        assert c.queue.device == ctx.queue.device
    with moecl.Context(ctx.queue.device.name[:6]) as c:
        assert c.queue.device.name.startswith(ctx.queue.device.name[:6])
