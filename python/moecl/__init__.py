"""moecl: portable OpenCL kernels for mixture-of-experts routing, from Python.

A ctypes layer over the C library libmoecl.so, which ``pip install``
builds into the package (python/README.md). ::

    import numpy as np
    import moecl

    ctx = moecl.Context()
    logits = np.random.default_rng(0).standard_normal((4, 128), dtype=np.float32)
    weights, ids = ctx.topk_gating(logits, top_k=8, renormalize=True)

The library is loaded on import: from $MOECL_LIBRARY (a path), else the
package's own, else the libdir of ``pkg-config moecl``, else
``ctypes.util.find_library("moecl")``; an OSError lists what was tried.
"""

from ._context import (Context, EpLayoutResult, MoeAlignResult, RouteDispatchResult, library, preset, preset_names,
                       preset_shape, status_string, version)
from ._errors import (BuildError, Error, InvalidArgumentError, NoDeviceError, OpenCLError, OutOfMemoryError,
                      UnsupportedError)
from ._tensors import BufferView
from ._version import __version__

library()

__all__ = [
    "BufferView", "BuildError", "Context", "EpLayoutResult", "Error", "InvalidArgumentError", "MoeAlignResult",
    "NoDeviceError", "OpenCLError", "OutOfMemoryError", "RouteDispatchResult", "UnsupportedError", "__version__",
    "library", "preset", "preset_names", "preset_shape", "status_string", "version",
]
