"""Checking the arrays a call is given, before anything runs.

A call's tensors are all NumPy arrays (the blocking _host entry points) or
all device tensors (pyopencl Arrays, pyopencl Buffers as outputs, or
BufferViews; the asynchronous entry points). The C library checks a device
buffer's size and context itself, but it cannot see a host array's size,
so every host array's shape, dtype and layout is checked here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

import numpy as np

HOST = "host"
DEVICE = "device"

F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
I16 = np.dtype(np.int16)
I32 = np.dtype(np.int32)
I64 = np.dtype(np.int64)
U16 = np.dtype(np.uint16)


def bfloat16() -> Optional[np.dtype]:
    """ml_dtypes.bfloat16, or None when ml_dtypes is not installed."""
    try:
        import ml_dtypes  # type: ignore[import-not-found]
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def input_dtypes(dtype: Optional[str]) -> Dict[np.dtype, str]:
    """The NumPy dtypes a routing input may have, each with moecl's name.

    dtype None infers the type from the array (float32, float16, and
    ml_dtypes.bfloat16 where installed); "f32", "f16" or "bf16" names it,
    and "bf16" also takes raw uint16 (the upper halves of float32s).
    """
    bf16 = bfloat16()
    if dtype is None:
        found = {F32: "f32", F16: "f16"}
        if bf16 is not None:
            found[bf16] = "bf16"
        return found
    if dtype == "f32":
        return {F32: "f32"}
    if dtype == "f16":
        return {F16: "f16"}
    if dtype == "bf16":
        return {U16: "bf16", **({bf16: "bf16"} if bf16 is not None else {})}
    raise ValueError('dtype must be None, "f32", "f16" or "bf16", not %r' % (dtype,))


def weights_dtype(name: str, kind: str) -> np.dtype:
    """The NumPy dtype of weights moecl writes as name ("f32", "f16", "bf16").

    bf16 weights are ml_dtypes.bfloat16 arrays on the host where ml_dtypes
    is installed, else (and on the device, where pyopencl has no bfloat16)
    uint16 arrays of their bits, the upper halves of float32s.
    """
    if name == "f32":
        return F32
    if name == "f16":
        return F16
    if name == "bf16":
        bf16 = bfloat16()
        return bf16 if bf16 is not None and kind == HOST else U16
    raise ValueError('weights_dtype must be "f32", "f16" or "bf16", not %r' % (name,))


def ids_dtype(name: str) -> np.dtype:
    """The NumPy dtype of ids moecl writes as name ("int32", "int64")."""
    if name == "int32":
        return I32
    if name == "int64":
        return I64
    raise ValueError('ids_dtype must be "int32" or "int64", not %r' % (name,))


class BufferView:
    """A pyopencl Buffer seen as a row-major tensor at a byte offset.

    pyopencl Arrays carry their shape, dtype and offset; a plain Buffer
    does not, so wrap it in a BufferView to pass it as an input (as an
    output a plain Buffer is taken at offset 0 with the output's shape).
    """

    def __init__(self, buffer: Any, shape: Sequence[int], dtype: Any, offset: int = 0) -> None:
        self.buffer = buffer
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.offset = int(offset)

    def __repr__(self) -> str:
        return "BufferView(%r, shape=%r, dtype=%s, offset=%d)" % (self.buffer, self.shape, self.dtype, self.offset)


@dataclass
class Tensor:
    """One checked tensor of a call."""

    shape: Tuple[int, ...]
    dtype: np.dtype
    obj: Any                          # what the caller passed (or what was allocated)
    host: Optional[np.ndarray] = None  # HOST: the array
    mem: Optional[int] = None          # DEVICE: the cl_mem
    offset: int = 0                    # DEVICE: byte offset


def _is_pyopencl(obj: Any) -> bool:
    mod = type(obj).__module__ or ""
    return mod.startswith("pyopencl")


def kind_of(objs: Iterable[Any]) -> str:
    """HOST or DEVICE for a call's tensors (None entries ignored).

    Raises:
        TypeError: a tensor of neither kind, or the two kinds mixed.
    """
    kinds = set()
    for obj in objs:
        if obj is None:
            continue
        if isinstance(obj, np.ndarray):
            kinds.add(HOST)
        elif isinstance(obj, BufferView) or _is_pyopencl(obj):
            kinds.add(DEVICE)
        else:
            raise TypeError("moecl takes NumPy arrays, or pyopencl Arrays, Buffers and moecl.BufferViews, not %s"
                            % type(obj).__name__)
    if len(kinds) > 1:
        raise TypeError("a call's tensors must be all NumPy arrays (a blocking call) or all device tensors "
                        "(pyopencl Arrays, Buffers, moecl.BufferViews), not a mix")
    return kinds.pop() if kinds else HOST


def _shape_text(shape: Sequence[Optional[int]]) -> str:
    return "(" + ", ".join("*" if n is None else str(n) for n in shape) + ("," if len(shape) == 1 else "") + ")"


def _check_shape(name: str, got: Tuple[int, ...], want: Sequence[Optional[int]]) -> None:
    if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want)):
        raise ValueError("%s: shape %s, expected %s" % (name, got, _shape_text(want)))


def _check_dtype(name: str, got: np.dtype, dtypes: Iterable[np.dtype]) -> None:
    dtypes = list(dtypes)
    if got not in dtypes:
        raise TypeError("%s: dtype %s, expected %s" % (name, got, " or ".join(str(d) for d in dtypes)))


def check(name: str, obj: Any, shape: Sequence[Optional[int]], dtypes: Iterable[np.dtype], kind: str,
          output: bool = False) -> Tensor:
    """Check one tensor: its kind, dtype, shape (None: any size), layout.

    Raises:
        TypeError: wrong kind or dtype; ValueError: wrong shape, not
        C-contiguous, a read-only output, or a negative offset.
    """
    if kind == HOST:
        if not isinstance(obj, np.ndarray):
            raise TypeError("%s: expected a NumPy array, not %s" % (name, type(obj).__name__))
        _check_dtype(name, obj.dtype, dtypes)
        _check_shape(name, obj.shape, shape)
        if not obj.flags.c_contiguous:
            raise ValueError("%s: not C-contiguous (use np.ascontiguousarray)" % name)
        if output and not obj.flags.writeable:
            raise ValueError("%s: read-only" % name)
        return Tensor(obj.shape, obj.dtype, obj, host=obj)
    return _check_device(name, obj, shape, dtypes, output)


def _check_device(name: str, obj: Any, shape: Sequence[Optional[int]], dtypes: Iterable[np.dtype],
                  output: bool) -> Tensor:
    import pyopencl as cl
    import pyopencl.array as cla

    if isinstance(obj, cla.Array):
        _check_dtype(name, obj.dtype, dtypes)
        _check_shape(name, obj.shape, shape)
        if not obj.flags.c_contiguous:
            raise ValueError("%s: the pyopencl Array is not C-contiguous" % name)
        base, offset = obj.base_data, obj.offset
    elif isinstance(obj, BufferView):
        _check_dtype(name, obj.dtype, dtypes)
        _check_shape(name, obj.shape, shape)
        base, offset = obj.buffer, obj.offset
    elif isinstance(obj, cl.Buffer) and output and None not in shape:
        # An output's shape and dtype are the call's; the library checks the size.
        return Tensor(tuple(shape), next(iter(dtypes)), obj, mem=obj.int_ptr)  # type: ignore[arg-type]
    else:
        raise TypeError("%s: expected a pyopencl Array or a moecl.BufferView%s, not %s"
                        % (name, " or a pyopencl Buffer" if output else "", type(obj).__name__))
    if offset < 0:
        raise ValueError("%s: negative offset %d" % (name, offset))
    mem = None if base is None else base.int_ptr
    return Tensor(tuple(obj.shape), np.dtype(obj.dtype), obj, mem=mem, offset=offset)


def outputs(names_shapes: Dict[str, Tuple[Tuple[int, ...], np.dtype]], out: Optional[Dict[str, Any]],
            kind: str) -> Dict[str, Optional[Tensor]]:
    """Check the outputs the caller gave in out (name -> array); None for the rest."""
    out = dict(out or {})
    unknown = set(out) - set(names_shapes)
    if unknown:
        raise ValueError("out: unknown output(s) %s; this call has %s"
                         % (", ".join(sorted(unknown)), ", ".join(names_shapes)))
    return {name: (check("out[%r]" % name, out[name], shape, [dtype], kind, output=True)
                   if out.get(name) is not None else None)
            for name, (shape, dtype) in names_shapes.items()}


def allocate(shape: Tuple[int, ...], dtype: np.dtype, kind: str, queue: Any) -> Tensor:
    """A new output: a NumPy array, or a pyopencl Array on queue."""
    if kind == HOST:
        a = np.empty(shape, dtype)
        return Tensor(shape, dtype, a, host=a)
    import pyopencl.array as cla

    arr = cla.empty(queue, shape, dtype)
    mem = None if arr.base_data is None else arr.base_data.int_ptr
    return Tensor(shape, dtype, arr, mem=mem, offset=arr.offset)
