"""Finding libmoecl.so and declaring its C API for ctypes.

The declarations mirror include/moecl/moecl.h for the ABI named by
``ABI_VERSION`` (meson.build's ``moecl_soversion``); a test checks that the
two agree, and the loader prefers ``libmoecl.so.<ABI_VERSION>`` so that an
installed library of another ABI is not loaded by accident.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import subprocess
from typing import List, Optional, Tuple

#: The soname number (libmoecl.so.N) these declarations are written for.
ABI_VERSION = 1

_SONAMES = ("libmoecl.so.%d" % ABI_VERSION, "libmoecl.so")

#: The libmoecl.so that `pip install .` builds into the package.
BUNDLED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libmoecl.so")

c_uint32 = ctypes.c_uint32
c_int = ctypes.c_int
c_void_p = ctypes.c_void_p
c_size_t = ctypes.c_size_t
# OpenCL's handles are pointers; cl_uint is 32 bits.
cl_handle = ctypes.c_void_p
cl_uint = ctypes.c_uint32


class Buffer(ctypes.Structure):
    """moecl_buffer: a cl_mem and a byte offset (mem NULL: absent)."""

    _fields_ = [("mem", cl_handle), ("offset", c_size_t)]


class TopkGatingDesc(ctypes.Structure):
    """moecl_topk_gating_desc."""

    _fields_ = [
        ("num_tokens", c_uint32),
        ("num_experts", c_uint32),
        ("top_k", c_uint32),
        ("num_expert_groups", c_uint32),
        ("topk_group", c_uint32),
        ("gating_dtype", c_int),
        ("scoring", c_int),
        ("group_score", c_int),
        ("renormalize", ctypes.c_bool),
        ("routed_scaling_factor", ctypes.c_float),
        ("renormalize_floor", ctypes.c_float),
        ("group_fill", c_int),
        ("weighting", c_int),
        ("renormalize_eps", ctypes.c_float),
        ("weights_dtype", c_int),
        ("ids_dtype", c_int),
        ("bias_dtype", c_int),
        ("num_shared_experts", c_uint32),
        ("shared_expert_weight", ctypes.c_float),
    ]


class Gating(ctypes.Structure):
    """moecl_gating."""

    _fields_ = [
        ("scoring", c_int),
        ("weighting", c_int),
        ("num_expert_groups", c_uint32),
        ("topk_group", c_uint32),
        ("group_score", c_int),
        ("group_fill", c_int),
        ("renormalize", ctypes.c_bool),
        ("renormalize_floor", ctypes.c_float),
        ("routed_scaling_factor", ctypes.c_float),
        ("renormalize_eps", ctypes.c_float),
    ]


class GroundedRouterDesc(ctypes.Structure):
    """moecl_grounded_router_desc."""

    _fields_ = [
        ("num_tokens", c_uint32),
        ("hidden_dim", c_uint32),
        ("num_experts", c_uint32),
        ("top_k", c_uint32),
        ("alpha", ctypes.c_float),
        ("hidden_dtype", c_int),
        ("precision", c_int),
        ("gating", Gating),
        ("logits_dtype", c_int),
        ("logit_softcap", ctypes.c_float),
        ("router_logits_row", ctypes.c_bool),
        ("weights_dtype", c_int),
        ("ids_dtype", c_int),
        ("bias_dtype", c_int),
        ("num_shared_experts", c_uint32),
        ("shared_expert_weight", ctypes.c_float),
    ]


class EpLayoutDesc(ctypes.Structure):
    """moecl_ep_layout_desc."""

    _fields_ = [
        ("num_tokens", c_uint32),
        ("top_k", c_uint32),
        ("num_experts", c_uint32),
        ("num_physical", c_uint32),
        ("num_ranks", c_uint32),
        ("max_replicas", c_uint32),
    ]


class MoeAlignDesc(ctypes.Structure):
    """moecl_moe_align_desc."""

    _fields_ = [
        ("num_tokens", c_uint32),
        ("top_k", c_uint32),
        ("num_experts", c_uint32),
        ("block_size", c_uint32),
        ("num_global_experts", c_uint32),
    ]


# The sizes moecl_permute_desc and moecl_combine_desc start with.
_ROW_SIZES = [("num_tokens", c_uint32), ("top_k", c_uint32), ("hidden", c_uint32), ("num_padded", c_uint32)]


class PermuteDesc(ctypes.Structure):
    """moecl_permute_desc."""

    _fields_ = _ROW_SIZES + [("in_dtype", c_int), ("out_dtype", c_int)]


class CombineDesc(ctypes.Structure):
    """moecl_combine_desc."""

    _fields_ = _ROW_SIZES + [("in_dtype", c_int), ("out_dtype", c_int), ("shared_dtype", c_int)]


# The buffers of moecl_moe_align_ex, by name, in the struct's order.
MOE_ALIGN_TENSORS = ("topk_ids", "expert_counts", "sorted_token_ids", "block_expert_ids", "num_tokens_post_padded",
                     "slot_positions", "num_invalid", "expert_map")


class MoeAlignTensors(ctypes.Structure):
    """moecl_moe_align_tensors."""

    _fields_ = [("struct_size", c_size_t)] + [(n, Buffer) for n in MOE_ALIGN_TENSORS]


class MoeAlignHostTensors(ctypes.Structure):
    """moecl_moe_align_host_tensors."""

    _fields_ = [("struct_size", c_size_t)] + [(n, c_void_p) for n in MOE_ALIGN_TENSORS]


# The buffers of moecl_topk_gating_ex, by name, in the struct's order.
TOPK_GATING_TENSORS = ("gating", "bias", "topk_weights", "topk_ids", "expert_counts", "expert_load",
                       "num_valid_tokens")


class TopkGatingTensors(ctypes.Structure):
    """moecl_topk_gating_tensors."""

    _fields_ = ([("struct_size", c_size_t)] + [(n, Buffer) for n in TOPK_GATING_TENSORS]
                + [("captured_ids", Buffer), ("captured_ids_dtype", c_int), ("expert_scale", Buffer)])


class TopkGatingHostTensors(ctypes.Structure):
    """moecl_topk_gating_host_tensors."""

    _fields_ = ([("struct_size", c_size_t)] + [(n, c_void_p) for n in TOPK_GATING_TENSORS]
                + [("captured_ids", c_void_p), ("captured_ids_dtype", c_int), ("expert_scale", c_void_p)])


# The buffers of moecl_route_dispatch_ex, by name, in the struct's order; the
# struct ends with num_local_experts.
ROUTE_DISPATCH_TENSORS = ("gating", "bias", "topk_weights", "topk_ids", "expert_counts", "sorted_token_ids",
                          "block_expert_ids", "num_tokens_post_padded", "slot_positions", "num_invalid",
                          "expert_load", "num_valid_tokens", "expert_map")


class RouteDispatchTensors(ctypes.Structure):
    """moecl_route_dispatch_tensors."""

    _fields_ = ([("struct_size", c_size_t)] + [(n, Buffer) for n in ROUTE_DISPATCH_TENSORS] +
                [("num_local_experts", c_uint32)])


class RouteDispatchHostTensors(ctypes.Structure):
    """moecl_route_dispatch_host_tensors."""

    _fields_ = ([("struct_size", c_size_t)] + [(n, c_void_p) for n in ROUTE_DISPATCH_TENSORS] +
                [("num_local_experts", c_uint32)])


# The enums of moecl.h, by the names the Python API uses.
# The buffers of moecl_router_ex, by name, in the struct's order; the
# capture's type (an enum) sits between captured_ids and expert_scale.
ROUTER_TENSORS = ("token_hidden", "router_logits", "expert_ground", "bias", "topk_weights", "topk_ids",
                  "expert_counts", "expert_load", "num_valid_tokens", "captured_ids")


class RouterTensors(ctypes.Structure):
    """moecl_router_tensors."""

    _fields_ = ([("struct_size", c_size_t)] + [(n, Buffer) for n in ROUTER_TENSORS] +
                [("captured_ids_dtype", c_int), ("expert_scale", Buffer), ("shared_expert_gate", Buffer)])


class RouterHostTensors(ctypes.Structure):
    """moecl_router_host_tensors."""

    _fields_ = ([("struct_size", c_size_t)] + [(n, c_void_p) for n in ROUTER_TENSORS] +
                [("captured_ids_dtype", c_int), ("expert_scale", c_void_p), ("shared_expert_gate", c_void_p)])


DTYPES = {"f32": 0, "f16": 1, "bf16": 2}
INDEX_DTYPES = {"int32": 0, "int64": 1}
# moecl_index_dtype of a captured_ids array, by its NumPy dtype's name.
CAPTURED_DTYPES = {"int32": 0, "int64": 1, "int16": 2}
SCORINGS = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2, "raw": 3}
WEIGHTINGS = {"score": 0, "softmax_chosen": 1, "sigmoid_chosen": 2}
PRECISIONS = {"fp32": 0, "tf32": 1, "3xtf32": 2}
GROUP_SCORES = {"max": 0, "top2_sum": 1}
GROUP_FILLS = {"neg_inf": 0, "zero": 1}

_P = ctypes.POINTER
_ctx = c_void_p
_events = _P(cl_handle)
_event_out = _P(cl_handle)

# name: (restype, argtypes)
_SIGNATURES = {
    "moecl_status_string": (ctypes.c_char_p, [c_int]),
    "moecl_version": (ctypes.c_char_p, []),
    "moecl_context_create": (c_int, [ctypes.c_char_p, _P(_ctx)]),
    "moecl_context_create_from_cl": (c_int, [cl_handle, cl_handle, cl_handle, _P(_ctx)]),
    "moecl_context_destroy": (None, [_ctx]),
    "moecl_context_forget_buffers": (None, [_ctx]),
    "moecl_context_error": (ctypes.c_char_p, [_ctx]),
    "moecl_context_cl_context": (cl_handle, [_ctx]),
    "moecl_context_device": (cl_handle, [_ctx]),
    "moecl_context_queue": (cl_handle, [_ctx]),
    "moecl_context_describe": (c_size_t, [_ctx, ctypes.c_char_p, c_size_t]),
    "moecl_topk_gating_desc_init": (TopkGatingDesc, [c_uint32, c_uint32, c_uint32]),
    "moecl_topk_gating": (c_int, [_ctx, _P(TopkGatingDesc), Buffer, Buffer, Buffer, Buffer,
                                  cl_uint, _events, _event_out]),
    "moecl_topk_gating_host": (c_int, [_ctx, _P(TopkGatingDesc), c_void_p, c_void_p, c_void_p, c_void_p]),
    "moecl_topk_gating_prepare": (c_int, [_ctx, _P(TopkGatingDesc)]),
    "moecl_topk_gating_with_counts": (c_int, [_ctx, _P(TopkGatingDesc), Buffer, Buffer, Buffer, Buffer,
                                              Buffer, cl_uint, _events, _event_out]),
    "moecl_topk_gating_with_counts_host": (c_int, [_ctx, _P(TopkGatingDesc), c_void_p, c_void_p, c_void_p,
                                                   c_void_p, c_void_p]),
    "moecl_topk_weights": (c_int, [_ctx, _P(TopkGatingDesc), Buffer, Buffer, Buffer, cl_uint, _events, _event_out]),
    "moecl_topk_weights_host": (c_int, [_ctx, _P(TopkGatingDesc), c_void_p, c_void_p, c_void_p]),
    "moecl_hash_routing": (c_int, [_ctx, _P(TopkGatingDesc), Buffer, Buffer, Buffer, c_uint32, Buffer, Buffer,
                                   cl_uint, _events, _event_out]),
    "moecl_hash_routing_host": (c_int, [_ctx, _P(TopkGatingDesc), c_void_p, c_void_p, c_void_p, c_uint32,
                                        c_void_p, c_void_p]),
    "moecl_grounded_router_desc_init": (GroundedRouterDesc, [c_uint32, c_uint32, c_uint32, ctypes.c_float]),
    "moecl_grounded_router_prepare": (c_int, [_ctx, _P(GroundedRouterDesc)]),
    "moecl_grounded_router": (c_int, [_ctx, _P(GroundedRouterDesc), Buffer, Buffer, Buffer, Buffer, Buffer,
                                      Buffer, cl_uint, _events, _event_out]),
    "moecl_grounded_router_host": (c_int, [_ctx, _P(GroundedRouterDesc), c_void_p, c_void_p, c_void_p,
                                           c_void_p, c_void_p, c_void_p]),
    "moecl_router": (c_int, [_ctx, _P(GroundedRouterDesc), Buffer, Buffer, Buffer, Buffer, Buffer, Buffer,
                             cl_uint, _events, _event_out]),
    "moecl_router_host": (c_int, [_ctx, _P(GroundedRouterDesc), c_void_p, c_void_p, c_void_p, c_void_p,
                                  c_void_p, c_void_p]),
    "moecl_moe_align_desc_init": (MoeAlignDesc, [c_uint32, c_uint32, c_uint32, c_uint32]),
    "moecl_moe_align_max_padded": (ctypes.c_uint64, [_P(MoeAlignDesc)]),
    "moecl_moe_align_prepare": (c_int, [_ctx, _P(MoeAlignDesc)]),
    "moecl_moe_align": (c_int, [_ctx, _P(MoeAlignDesc), Buffer, Buffer, Buffer, Buffer, Buffer, Buffer,
                                Buffer, cl_uint, _events, _event_out]),
    "moecl_moe_align_host": (c_int, [_ctx, _P(MoeAlignDesc), c_void_p, c_void_p, c_void_p, c_void_p,
                                     c_void_p, c_void_p, c_void_p]),
    "moecl_topk_gating_ex": (c_int, [_ctx, _P(TopkGatingDesc), _P(TopkGatingTensors), cl_uint, _events,
                                     _event_out]),
    "moecl_topk_gating_ex_host": (c_int, [_ctx, _P(TopkGatingDesc), _P(TopkGatingHostTensors)]),
    "moecl_router_ex": (c_int, [_ctx, _P(GroundedRouterDesc), _P(RouterTensors), cl_uint, _events, _event_out]),
    "moecl_router_ex_host": (c_int, [_ctx, _P(GroundedRouterDesc), _P(RouterHostTensors)]),
    "moecl_moe_align_ex": (c_int, [_ctx, _P(MoeAlignDesc), _P(MoeAlignTensors), cl_uint, _events, _event_out]),
    "moecl_moe_align_ex_host": (c_int, [_ctx, _P(MoeAlignDesc), _P(MoeAlignHostTensors)]),
    "moecl_ep_layout_desc_init": (EpLayoutDesc, [c_uint32, c_uint32, c_uint32, c_uint32]),
    "moecl_ep_layout_prepare": (c_int, [_ctx, _P(EpLayoutDesc)]),
    "moecl_ep_layout": (c_int, [_ctx, _P(EpLayoutDesc)] + [Buffer] * 11 + [cl_uint, _events, _event_out]),
    "moecl_ep_layout_host": (c_int, [_ctx, _P(EpLayoutDesc)] + [c_void_p] * 11),
    "moecl_route_dispatch": (c_int, [_ctx, _P(TopkGatingDesc), c_uint32] + [Buffer] * 10 +
                             [cl_uint, _events, _event_out]),
    "moecl_route_dispatch_host": (c_int, [_ctx, _P(TopkGatingDesc), c_uint32] + [c_void_p] * 10),
    "moecl_route_dispatch_ex": (c_int, [_ctx, _P(TopkGatingDesc), c_uint32, _P(RouteDispatchTensors), cl_uint,
                                        _events, _event_out]),
    "moecl_route_dispatch_ex_host": (c_int, [_ctx, _P(TopkGatingDesc), c_uint32, _P(RouteDispatchHostTensors)]),
    "moecl_grounded_route_dispatch": (c_int, [_ctx, _P(GroundedRouterDesc), c_uint32] + [Buffer] * 11 +
                                      [cl_uint, _events, _event_out]),
    "moecl_grounded_route_dispatch_host": (c_int, [_ctx, _P(GroundedRouterDesc), c_uint32] + [c_void_p] * 11),
    "moecl_topk_gating_desc_preset": (c_int, [ctypes.c_char_p, c_uint32, _P(TopkGatingDesc)]),
    "moecl_grounded_router_desc_preset": (c_int, [ctypes.c_char_p, c_uint32, _P(GroundedRouterDesc)]),
    "moecl_preset_name": (ctypes.c_char_p, [c_size_t]),
    "moecl_permute_desc_init": (PermuteDesc, [c_uint32, c_uint32, c_uint32, c_uint32]),
    "moecl_permute": (c_int, [_ctx, _P(PermuteDesc)] + [Buffer] * 4 + [cl_uint, _events, _event_out]),
    "moecl_permute_host": (c_int, [_ctx, _P(PermuteDesc)] + [c_void_p] * 4),
    "moecl_permute_scatter": (c_int, [_ctx, _P(PermuteDesc)] + [Buffer] * 5 + [cl_uint, _events, _event_out]),
    "moecl_permute_scatter_host": (c_int, [_ctx, _P(PermuteDesc)] + [c_void_p] * 5),
    "moecl_combine_desc_init": (CombineDesc, [c_uint32, c_uint32, c_uint32, c_uint32]),
    "moecl_combine": (c_int, [_ctx, _P(CombineDesc)] + [Buffer] * 5 + [cl_uint, _events, _event_out]),
    "moecl_combine_host": (c_int, [_ctx, _P(CombineDesc)] + [c_void_p] * 5),
}


def _pkg_config_libdir() -> Tuple[Optional[str], str]:
    """libdir of pkg-config's moecl, and what was tried (for the message)."""
    exe = shutil.which("pkg-config")
    if exe is None:
        return None, "pkg-config: not installed"
    try:
        r = subprocess.run([exe, "--variable=libdir", "moecl"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return None, "pkg-config --variable=libdir moecl: %s" % e
    libdir = r.stdout.strip()
    if r.returncode != 0 or not libdir:
        return None, "pkg-config --variable=libdir moecl: %s" % (r.stderr.strip() or "no libdir")
    return libdir, "pkg-config --variable=libdir moecl: %s" % libdir


def _candidates() -> Tuple[List[str], List[str]]:
    """Library paths or names to try, in order, and notes on lookups that gave none."""
    paths: List[str] = []
    notes: List[str] = []
    env = os.environ.get("MOECL_LIBRARY")
    if env:
        return [env], notes  # an explicit path is the only one tried
    notes.append("MOECL_LIBRARY: unset")
    # The library pip built into the package (meson.build's python option):
    # the one these declarations were built with.
    if os.path.exists(BUNDLED):
        paths.append(BUNDLED)
    else:
        notes.append("%s: not there (the package was not installed with pip)" % BUNDLED)
    libdir, note = _pkg_config_libdir()
    if libdir is None:
        notes.append(note)
    else:
        paths.extend(os.path.join(libdir, name) for name in _SONAMES)
    found = ctypes.util.find_library("moecl")
    if found:
        paths.append(found)
    else:
        notes.append('ctypes.util.find_library("moecl"): not found')
    return paths, notes


def load() -> ctypes.CDLL:
    """Load libmoecl and declare its functions.

    Tries, in order: the path in $MOECL_LIBRARY (alone, when set), the
    library inside the package (``BUNDLED``, which pip builds), the library
    in ``pkg-config --variable=libdir moecl``, then
    ``ctypes.util.find_library("moecl")``.

    Raises:
        OSError: none of them loads; the message lists what was tried.
    """
    paths, notes = _candidates()
    failures = list(notes)
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            failures.append("%s: %s" % (path, e))
            continue
        try:
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype = restype
                fn.argtypes = argtypes
        except AttributeError as e:
            failures.append("%s: not moecl's ABI %d (%s)" % (path, ABI_VERSION, e))
            continue
        return lib
    raise OSError(
        "moecl: cannot load the C library libmoecl.so (install the package with pip, which builds it "
        "into the package, or build and install it with meson as the README says, or set MOECL_LIBRARY "
        "to its path). Tried:\n  " + "\n  ".join(failures)
    )
