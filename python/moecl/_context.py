"""moecl.Context: one OpenCL device and queue, and the three ops on it."""

from __future__ import annotations

import ctypes

from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from . import _lib
from . import _tensors as T
from ._errors import error_class

_lib_handle: Optional[ctypes.CDLL] = None


def library() -> ctypes.CDLL:
    """The loaded libmoecl (loaded on first use; see moecl._lib.load)."""
    global _lib_handle
    if _lib_handle is None:
        _lib_handle = _lib.load()
    return _lib_handle


def _same_width(name: str, width: int, top_k: Optional[int]) -> None:
    """top_k, where given, is the width of the ids' tensor."""
    if top_k is not None and top_k != width:
        raise ValueError("top_k is %d but %s has %d columns" % (top_k, name, width))


def _uint(name: str, v: Any) -> int:
    """An int for a uint32_t field; the C library checks its range."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError("%s must be an int, not %s" % (name, type(v).__name__))
    if not 0 <= int(v) < 2**32:
        raise ValueError("%s must be in [0, 2**32), not %d" % (name, v))
    return int(v)


def _enum(name: str, v: Any, names: Dict[str, int]) -> int:
    if v not in names:
        raise ValueError("%s must be one of %s, not %r" % (name, ", ".join(repr(n) for n in names), v))
    return names[v]


class EpLayoutResult(NamedTuple):
    """The expert-parallel dispatch layout (docs/routing.md, section 9).

    token_in_rank is uint8, the rest int32; token_in_rank, tokens_per_rank
    and expert_counts are None when not asked for; event as MoeAlignResult's.
    """

    physical_ids: Any     #: [num_tokens, top_k], -1 for a slot not sent
    rank_counts: Any      #: [num_ranks]
    rank_offsets: Any     #: [num_ranks + 1]
    send_slots: Any       #: [num_tokens * top_k], -1 past rank_offsets[-1]
    token_in_rank: Any    #: [num_tokens, num_ranks], or None
    tokens_per_rank: Any  #: [num_ranks], or None
    expert_counts: Any    #: [num_physical], or None
    event: Any


class MoeAlignResult(NamedTuple):
    """moe_align's outputs (docs/routing.md, section 7); all int32.

    slot_positions and num_invalid are None when not asked for; event is
    the call's pyopencl.Event on the device path, None on the NumPy path.
    """

    expert_counts: Any           #: [num_experts]
    sorted_token_ids: Any        #: [max_padded]
    block_expert_ids: Any        #: [max_padded // block_size]
    num_tokens_post_padded: Any  #: [1]
    slot_positions: Any          #: [num_tokens, top_k], or None
    num_invalid: Any             #: [1], or None
    event: Any                   #: pyopencl.Event, or None


class RouteDispatchResult(NamedTuple):
    """route_dispatch's and grounded_route_dispatch's outputs: the routing's
    (docs/routing.md, sections 2 and 3), then moe_align's (section 7).

    slot_positions and num_invalid are None when not asked for; event is
    the call's pyopencl.Event on the device path, None on the NumPy path.
    """

    topk_weights: Any            #: float32 (or weights_dtype) [num_tokens, top_k]
    topk_ids: Any                #: int32 [num_tokens, top_k]
    expert_counts: Any           #: int32 [num_experts]
    sorted_token_ids: Any        #: int32 [max_padded]
    block_expert_ids: Any        #: int32 [max_padded // block_size]
    num_tokens_post_padded: Any  #: int32 [1]
    slot_positions: Any          #: int32 [num_tokens, top_k], or None
    num_invalid: Any             #: int32 [1], or None
    event: Any                   #: pyopencl.Event, or None


class Context:
    """An OpenCL device, its command queue and the kernels built for it.

    Args:
        device: the device selector of moecl_context_create(): None (the
            environment variable MOECL_DEVICE, else the first GPU or
            accelerator, else the first CPU), "gpu", "cpu", "P:D"
            (platform P, device D, as moecl-info lists them) or text
            contained in "platform name / device name" (ignoring case).

    Raises:
        moecl.NoDeviceError: no OpenCL device, or none matches.
        moecl.Error: another failure of moecl_context_create().

    The ops take NumPy arrays (and block until the results are copied
    back) or device tensors (pyopencl Arrays and Buffers, moecl.BufferView),
    which enqueue on the context's queue and return a pyopencl.Event. Use
    ``with Context() as ctx:`` or close() to release it early.
    """

    def __init__(self, device: Optional[str] = None) -> None:
        self._lib = library()
        self._handle: Optional[int] = None
        self._pyopencl_queue: Any = None
        self._adopted: Dict[int, "Context"] = {}
        if device is not None and not isinstance(device, str):
            raise TypeError("device must be a str or None, not %s" % type(device).__name__)
        h = ctypes.c_void_p()
        self._check(self._lib.moecl_context_create(device.encode() if device is not None else None,
                                                   ctypes.byref(h)), None)
        self._handle = h.value

    @classmethod
    def from_pyopencl(cls, queue: Any) -> "Context":
        """Adopt a pyopencl CommandQueue (its context, device and the queue).

        The ops then enqueue on that queue, in-order or out-of-order (an
        out-of-order queue orders calls only through wait_for). The OpenCL
        objects are retained until the Context is closed.
        """
        import pyopencl as cl

        if not isinstance(queue, cl.CommandQueue):
            raise TypeError("from_pyopencl takes a pyopencl.CommandQueue, not %s" % type(queue).__name__)
        self = cls.__new__(cls)
        self._lib = library()
        self._handle = None
        self._pyopencl_queue = queue
        self._adopted = {}
        h = ctypes.c_void_p()
        self._check(self._lib.moecl_context_create_from_cl(queue.context.int_ptr, queue.device.int_ptr,
                                                           queue.int_ptr, ctypes.byref(h)), None)
        self._handle = h.value
        return self

    def close(self) -> None:
        """Release the context (moecl_context_destroy). Finish pending work first."""
        for other in self._adopted.values():
            other.close()
        self._adopted = {}
        if self._handle is not None:
            self._lib.moecl_context_destroy(self._handle)
            self._handle = None

    def forget_buffers(self) -> None:
        """Drop the references the context keeps to the device buffers of
        earlier calls (moecl_context_forget_buffers): the C library holds
        each kernel's last buffers so that repeating a call costs no
        argument setting, which keeps a released pyopencl buffer's memory
        until the kernel runs with another, this call or close(). Not while
        another thread calls into the context. Adopted queues' contexts
        forget theirs too."""
        for other in self._adopted.values():
            other.forget_buffers()
        self._lib.moecl_context_forget_buffers(self._ptr())

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_handle", None) is not None:
            self.close()

    def _ptr(self) -> int:
        if self._handle is None:
            raise ValueError("the moecl.Context is closed")
        return self._handle

    def _check(self, status: int, ctx: Optional[int]) -> None:
        if status != 0:
            text = self._lib.moecl_status_string(status).decode()
            message = self._lib.moecl_context_error(ctx).decode(errors="replace")
            raise error_class(status)(status, text, message)

    def describe(self) -> str:
        """moecl_context_describe(): the device and what moecl chose for it."""
        n = self._lib.moecl_context_describe(self._ptr(), None, 0)
        buf = ctypes.create_string_buffer(n + 1)
        self._lib.moecl_context_describe(self._ptr(), buf, n + 1)
        return buf.value.decode(errors="replace")

    @property
    def queue(self) -> Any:
        """The context's queue as a pyopencl.CommandQueue (the adopted one, or moecl's own)."""
        if self._pyopencl_queue is None:
            import pyopencl as cl

            self._pyopencl_queue = cl.CommandQueue.from_int_ptr(self._lib.moecl_context_queue(self._ptr()),
                                                                retain=True)
        return self._pyopencl_queue

    # ------------------------------------------------------------------
    # The calls' common steps
    # ------------------------------------------------------------------

    def _on(self, queue: Any) -> "Context":
        """The context a call runs on: this one for queue None or its own
        queue, else one adopting queue (made on first use and kept, with
        its kernels, until this context is closed)."""
        ctx = self._ptr()
        if queue is None:
            return self
        import pyopencl as cl

        if not isinstance(queue, cl.CommandQueue):
            raise TypeError("queue: expected a pyopencl.CommandQueue, not %s" % type(queue).__name__)
        if queue.int_ptr == self._lib.moecl_context_queue(ctx):
            return self
        # The adopted context retains the queue, so no other queue can take its address.
        if queue.int_ptr not in self._adopted:
            self._adopted[queue.int_ptr] = Context.from_pyopencl(queue)
        return self._adopted[queue.int_ptr]

    def _prepare(self, name: str, desc: ctypes.Structure) -> None:
        """moecl_<name>_prepare: the library validates desc (its messages) and builds the kernel."""
        ctx = self._ptr()
        self._check(getattr(self._lib, "moecl_%s_prepare" % name)(ctx, ctypes.byref(desc)), ctx)

    def _run(self, name: str, desc: ctypes.Structure, tensors: Sequence[Optional[T.Tensor]], kind: str,
             wait_for: Optional[Sequence[Any]], scalars: Sequence[int] = (), scalars_at: int = 0) -> Any:
        """Call moecl_<name>_host (HOST) or moecl_<name> (DEVICE), with the
        scalars after desc and the first scalars_at tensors; the event, or None."""
        ctx = self._ptr()
        if kind == T.HOST:
            fn = getattr(self._lib, "moecl_%s_host" % name)
            ptrs = [None if t is None else t.host.ctypes.data for t in tensors]
            self._check(fn(ctx, ctypes.byref(desc), *ptrs[:scalars_at], *scalars, *ptrs[scalars_at:]), ctx)
            return None
        import pyopencl as cl

        events = list(wait_for or [])
        wait = (_lib.cl_handle * len(events))(*[e.int_ptr for e in events]) if events else None
        bufs = [_lib.Buffer(None, 0) if t is None else _lib.Buffer(t.mem, t.offset) for t in tensors]
        done = _lib.cl_handle()
        fn = getattr(self._lib, "moecl_%s" % name)
        self._check(fn(ctx, ctypes.byref(desc), *bufs[:scalars_at], *scalars, *bufs[scalars_at:], len(events), wait,
                       ctypes.byref(done)), ctx)
        return cl.Event.from_int_ptr(done.value, retain=False)

    def _run_ex(self, name: str, desc: ctypes.Structure, structs: Tuple[Any, Any],
                tensors: Sequence[Optional[T.Tensor]], kind: str, wait_for: Optional[Sequence[Any]],
                fields: Optional[Dict[str, int]] = None, scalars: Sequence[int] = ()) -> Any:
        """Call moecl_<name>_ex_host (HOST) or moecl_<name>_ex (DEVICE) with
        the scalars after desc, then the tensors in the struct of structs
        (device, host), in the order of its tensor fields, and its other
        fields from fields, by name; the event, or None."""
        ctx = self._ptr()
        device_struct, host_struct = structs
        if kind == T.HOST:
            t = host_struct(ctypes.sizeof(host_struct), **self._ex_fields(
                host_struct, ctypes.c_void_p, [None if x is None else x.host.ctypes.data for x in tensors], fields))
            self._check(getattr(self._lib, "moecl_%s_ex_host" % name)(ctx, ctypes.byref(desc), *scalars,
                                                                      ctypes.byref(t)), ctx)
            return None
        import pyopencl as cl

        events = list(wait_for or [])
        wait = (_lib.cl_handle * len(events))(*[e.int_ptr for e in events]) if events else None
        bufs = [_lib.Buffer(None, 0) if x is None else _lib.Buffer(x.mem, x.offset) for x in tensors]
        t = device_struct(ctypes.sizeof(device_struct), **self._ex_fields(device_struct, _lib.Buffer, bufs, fields))
        done = _lib.cl_handle()
        fn = getattr(self._lib, "moecl_%s_ex" % name)
        self._check(fn(ctx, ctypes.byref(desc), *scalars, ctypes.byref(t), len(events), wait, ctypes.byref(done)),
                    ctx)
        return cl.Event.from_int_ptr(done.value, retain=False)

    @staticmethod
    def _ex_fields(struct: Any, tensor_type: Any, values: Sequence[Any],
                   scalars: Optional[Dict[str, int]]) -> Dict[str, Any]:
        """A tensors record's fields by name: values for its tensor_type
        fields in order, then scalars."""
        names = [n for n, t in struct._fields_[1:] if t is tensor_type]
        fields = dict(zip(names, values))
        fields.update(scalars or {})
        return fields

    @staticmethod
    def _check_wait(kind: str, wait_for: Optional[Sequence[Any]]) -> None:
        """wait_for is for device calls only, and holds pyopencl.Events."""
        if not wait_for:
            return
        if kind == T.HOST:
            raise ValueError("wait_for: NumPy calls block and wait for nothing; pass device tensors")
        import pyopencl as cl

        for e in wait_for:
            if not isinstance(e, cl.Event):
                raise TypeError("wait_for: expected pyopencl.Event, not %s" % type(e).__name__)

    def _outputs(self, specs: Dict[str, Tuple[Tuple[int, ...], np.dtype]], given: Dict[str, Optional[T.Tensor]],
                 wanted: Sequence[str], kind: str, queue: Any) -> Dict[str, Optional[T.Tensor]]:
        """The given outputs, and new ones for the wanted names not given."""
        return {name: given[name] if given[name] is not None
                else (T.allocate(specs[name][0], specs[name][1], kind, queue) if name in wanted else None)
                for name in specs}

    # ------------------------------------------------------------------
    # Expert-parallel dispatch layout
    # ------------------------------------------------------------------

    def ep_layout(self, topk_ids: Any, num_experts: int, num_ranks: int, *, logical_to_physical: Any = None,
                  replica_counts: Any = None, physical_to_rank: Any = None, num_physical: Optional[int] = None,
                  token_in_rank: bool = True, tokens_per_rank: bool = True, expert_counts: bool = True,
                  out: Optional[Dict[str, Any]] = None, queue: Any = None,
                  wait_for: Optional[Sequence[Any]] = None) -> EpLayoutResult:
        """The layout of an expert-parallel all-to-all (docs/routing.md, section 9).

        Args:
            topk_ids: int32 [tokens, top_k], logical ids; those outside [0, num_experts) are not sent.
            num_experts: logical experts.
            num_ranks: destination ranks.
            logical_to_physical: int32 [num_experts, max_replicas] replicas, or None (the identity).
            replica_counts: int32 [num_experts], 1..max_replicas; given iff logical_to_physical is.
            physical_to_rank: int32 [num_physical], or None: contiguous blocks of num_physical / num_ranks.
            num_physical: physical experts; by default physical_to_rank's length, else num_experts.
            token_in_rank, tokens_per_rank, expert_counts: compute these optional outputs.
            out, queue, wait_for: as for topk_gating (names as EpLayoutResult's fields).

        Returns:
            An EpLayoutResult.
        """
        out = dict(out or {})
        tables = {"logical_to_physical": logical_to_physical, "replica_counts": replica_counts,
                  "physical_to_rank": physical_to_rank}
        kind = T.kind_of([topk_ids, *[t for t in tables.values() if t is not None], *out.values()])
        ids = T.check("topk_ids", topk_ids, (None, None), [T.I32], kind)
        tokens, k = ids.shape
        self._check_wait(kind, wait_for)
        e, r = _uint("num_experts", num_experts), _uint("num_ranks", num_ranks)
        l2p = None if logical_to_physical is None else T.check("logical_to_physical", logical_to_physical,
                                                                 (e, None), [T.I32], kind)
        counts = None if replica_counts is None else T.check("replica_counts", replica_counts, (e,), [T.I32], kind)
        if num_physical is None:
            num_physical = physical_to_rank.shape[0] if physical_to_rank is not None else e
        p = _uint("num_physical", num_physical)
        p2r = None if physical_to_rank is None else T.check("physical_to_rank", physical_to_rank, (p,), [T.I32],
                                                             kind)
        specs = {"physical_ids": ((tokens, k), T.I32), "rank_counts": ((r,), T.I32),
                 "rank_offsets": ((r + 1,), T.I32), "send_slots": ((tokens * k,), T.I32),
                 "token_in_rank": ((tokens, r), np.dtype(np.uint8)), "tokens_per_rank": ((r,), T.I32),
                 "expert_counts": ((p,), T.I32)}
        flags = {"token_in_rank": token_in_rank, "tokens_per_rank": tokens_per_rank, "expert_counts": expert_counts}
        given = T.outputs(specs, out, kind)
        for name, flag in flags.items():
            if given[name] is not None and not flag:
                raise ValueError("out[%r] given with %s=False" % (name, name))
        on = self._on(queue)
        desc = self._lib.moecl_ep_layout_desc_init(tokens, k, e, r)
        desc.num_physical = p
        desc.max_replicas = l2p.shape[1] if l2p is not None else 1
        on._prepare("ep_layout", desc)
        q = on.queue if kind == T.DEVICE else None
        wanted = [n for n in specs if flags.get(n, True)]
        o = self._outputs(specs, given, wanted, kind, q)
        event = on._run("ep_layout", desc, [ids, l2p, counts, p2r] + [o[n] for n in specs], kind, wait_for)
        return EpLayoutResult(*[None if o[n] is None else o[n].obj for n in specs], event)  # type: ignore[union-attr]

    # ------------------------------------------------------------------
    # Top-k gating
    # ------------------------------------------------------------------

    @staticmethod
    def _topk_inputs(logits: Any, bias: Any, top_k: int, dtype: Optional[str], kind: str,
                     bias_dtype: Optional[str] = None) -> Tuple[T.Tensor, Optional[T.Tensor], int, int, int]:
        """Top-k gating's inputs checked: logits, bias, tokens, experts, top_k."""
        g = T.check("logits", logits, (None, None), T.input_dtypes(dtype), kind)
        tokens, experts = g.shape
        b = None if bias is None else T.check("bias", bias, (experts,), T.input_dtypes(bias_dtype), kind)
        return g, b, tokens, experts, _uint("top_k", top_k)

    @staticmethod
    def _topk_out_specs(tokens: int, k: int, weights_dtype: str, ids_dtype: str,
                        kind: str) -> Tuple[Tuple[Tuple[int, int], np.dtype], Tuple[Tuple[int, int], np.dtype]]:
        """The weights' and ids' (shape, dtype) for the names weights_dtype and ids_dtype."""
        return ((tokens, k), T.weights_dtype(weights_dtype, kind)), ((tokens, k), T.ids_dtype(ids_dtype))

    def _topk_desc(self, g: T.Tensor, tokens: int, experts: int, k: int, dtype: Optional[str],
                   groups: Optional[int], topk_group: Optional[int], scoring: str, group_score: str,
                   group_fill: str, renormalize: bool, scale: float, renormalize_floor: float,
                   weighting: str = "score", renormalize_eps: float = 0.0, b: Optional[T.Tensor] = None,
                   bias_dtype: Optional[str] = None, weights_dtype: str = "f32", ids_dtype: str = "int32",
                   prepare: bool = True, shared: Tuple[int, float] = (0, 1.0)) -> ctypes.Structure:
        """moecl_topk_gating_desc of a call, validated by the library (and its kernel built);
        shared: (num_shared_experts, shared_expert_weight)."""
        fields = dict(weights_dtype=_enum("weights_dtype", weights_dtype, _lib.DTYPES),
                      num_shared_experts=shared[0], shared_expert_weight=float(shared[1]),
                      ids_dtype=_enum("ids_dtype", ids_dtype, _lib.INDEX_DTYPES),
                      bias_dtype=_lib.DTYPES[T.input_dtypes(bias_dtype)[b.dtype]] if b is not None else 0,
                      num_expert_groups=_uint("groups", 0 if groups is None else groups),
                      topk_group=_uint("topk_group", 0 if topk_group is None else topk_group),
                      gating_dtype=_lib.DTYPES[T.input_dtypes(dtype)[g.dtype]],
                      scoring=_enum("scoring", scoring, _lib.SCORINGS),
                      group_score=_enum("group_score", group_score, _lib.GROUP_SCORES),
                      group_fill=_enum("group_fill", group_fill, _lib.GROUP_FILLS),
                      renormalize=bool(renormalize), routed_scaling_factor=float(scale),
                      renormalize_floor=float(renormalize_floor), renormalize_eps=float(renormalize_eps),
                      weighting=_enum("weighting", weighting, _lib.WEIGHTINGS))
        # desc_init first: fields a later moecl adds keep their defaults.
        desc = self._lib.moecl_topk_gating_desc_init(tokens, experts, k)
        for name, value in fields.items():
            setattr(desc, name, value)
        if prepare:
            self._prepare("topk_gating", desc)
        return desc

    def topk_gating(self, logits: Any, top_k: int = 8, scoring: str = "softmax", bias: Any = None,
                    groups: Optional[int] = None, topk_group: Optional[int] = None, group_score: str = "max",
                    renormalize: bool = False, scale: float = 1.0, *, renormalize_floor: float = 0.0,
                    renormalize_eps: float = 0.0, group_fill: str = "neg_inf", weighting: str = "score",
                    dtype: Optional[str] = None, bias_dtype: Optional[str] = None, weights_dtype: str = "f32",
                    ids_dtype: str = "int32", counts: bool = False, num_valid_tokens: Any = None,
                    expert_load: Any = None, captured_ids: Any = None, expert_scale: Any = None,
                    num_shared_experts: int = 0, shared_expert_weight: float = 1.0,
                    out: Optional[Dict[str, Any]] = None, queue: Any = None,
                    wait_for: Optional[Sequence[Any]] = None) -> Tuple[Any, ...]:
        """Top-k gating (docs/routing.md, section 2) of logits [tokens, experts].

        Args:
            logits: float32, float16 or bfloat16 [tokens, experts] (see dtype).
            top_k: experts chosen per token.
            scoring: "softmax", "sigmoid", "sqrtsoftplus" or "raw" (the logit itself).
            bias: [experts] added to the scores for selection only, or None:
                float32, float16 or bfloat16 (see bias_dtype).
            groups, topk_group: group-limited selection (num_expert_groups
                and topk_group), or None for none.
            group_score: "max" or "top2_sum".
            renormalize: divide the k weights by their sum.
            scale: routed_scaling_factor, applied to the weights last.
            renormalize_floor: with renormalize, the smallest divisor (0: moecl's rule).
            renormalize_eps: with renormalize, divide by sum + eps instead
                (DeepSeek-V3: 1e-20; 0: the floor's rule); exclusive with
                renormalize_floor.
            group_fill: what dropped groups' experts become, "neg_inf" or "zero".
            weighting: what the chosen weigh: "score" (their unbiased score),
                "softmax_chosen" (a softmax over their logits) or
                "sigmoid_chosen" (the sigmoid of their logits, Llama 4).
            dtype: None (from the array), "f32", "f16", or "bf16" (for
                ml_dtypes.bfloat16 or raw uint16 arrays).
            bias_dtype: the bias's type, as dtype is the logits'.
            weights_dtype: "f32", "f16" (float16) or "bf16" (FlashInfer's):
                the weights rounded to nearest even once, as they are
                stored; bf16 arrays are ml_dtypes.bfloat16 on the host
                where ml_dtypes is installed, else (and on the device)
                uint16 arrays of the bits.
            ids_dtype: "int32" or "int64" (PyTorch's topk, DeepEP).
            counts: also return expert_counts int32 [experts], the number
                of slots routed to each expert.
            num_valid_tokens: int32 [1], or None: the rows that are tokens,
                read when the kernel runs; the rows past it are padding (ids
                -1, weights 0, counted nowhere): one enqueued call for any
                batch up to the logits' rows (moecl_topk_gating_ex).
            expert_load: int32 [experts], or None: a load counter the call
                adds its routed slots to, in place (never zeroed).
            captured_ids: int16, int32 or int64 [tokens, top_k], or None:
                routing capture, written in place with the ids a second
                time in its own dtype (padding rows -1): a per-layer
                capture buffer, as vLLM's and SGLang's routed-experts
                capture keeps (moecl_topk_gating_ex).
            expert_scale: float32 [experts], or None: each chosen expert's
                final weight times its scale, after renormalize and scale
                (Gemma 4's per_expert_scale).
            num_shared_experts: S shared experts appended to every row
                after the top_k routed slots (SGLang's
                num_fused_shared_experts): ids experts + j, weight
                shared_expert_weight * scale. The outputs are then
                [tokens, top_k + S], counts and expert_load [experts + S].
            shared_expert_weight: a shared slot's weight before scale
                (SGLang's: 1 / scale).
            out: output arrays to write, by name ("weights", "ids", "counts").
            queue: a pyopencl.CommandQueue to enqueue on instead of the
                context's own (adopted with from_pyopencl on first use, and
                kept until the context is closed); the tensors must belong
                to its OpenCL context.
            wait_for: device tensors only: pyopencl.Events to wait on.

        Returns:
            (weights [tokens, top_k] of weights_dtype, ids [tokens, top_k]
            of ids_dtype), then counts if asked for, then, for device
            tensors, the call's pyopencl.Event.

        Raises:
            TypeError, ValueError: a tensor of the wrong kind, dtype, shape
                or layout (nothing was called).
            moecl.InvalidArgumentError: a field the library refuses; its
                message names the field. moecl.Error: another failure.
        """
        out = dict(out or {})
        kind = T.kind_of([logits, bias, num_valid_tokens, expert_load, captured_ids, expert_scale, *out.values()])
        g, b, tokens, experts, k = self._topk_inputs(logits, bias, top_k, dtype, kind, bias_dtype)
        s = _uint("num_shared_experts", num_shared_experts)
        nv = None if num_valid_tokens is None else T.check("num_valid_tokens", num_valid_tokens, (1,), [T.I32], kind)
        load = None if expert_load is None else T.check("expert_load", expert_load, (experts + s,), [T.I32], kind,
                                                        output=True)
        cap = None if captured_ids is None else T.check("captured_ids", captured_ids, (tokens, k),
                                                        [np.dtype(n) for n in _lib.CAPTURED_DTYPES], kind,
                                                        output=True)
        es = None if expert_scale is None else T.check("expert_scale", expert_scale, (experts,), [T.F32], kind)
        w_spec, ids_spec = self._topk_out_specs(tokens, k + s, weights_dtype, ids_dtype, kind)
        specs = {"weights": w_spec, "ids": ids_spec, "counts": ((experts + s,), T.I32)}
        given = T.outputs(specs, out, kind)
        if given["counts"] is not None and not counts:
            raise ValueError('out["counts"] given without counts=True')

        self._check_wait(kind, wait_for)
        on = self._on(queue)
        desc = on._topk_desc(g, tokens, experts, k, dtype, groups, topk_group, scoring, group_score, group_fill,
                             renormalize, scale, renormalize_floor, weighting, renormalize_eps, b, bias_dtype,
                             weights_dtype, ids_dtype, shared=(s, shared_expert_weight))

        q = on.queue if kind == T.DEVICE else None
        wanted = ("weights", "ids", "counts") if counts else ("weights", "ids")
        o = self._outputs(specs, given, wanted, kind, q)
        tensors = [g, b, o["weights"], o["ids"]] + ([o["counts"]] if counts else [])
        if nv is None and load is None and cap is None and es is None:
            event = on._run("topk_gating_with_counts" if counts else "topk_gating", desc, tensors, kind, wait_for)
        else:
            cap_dtype = _lib.CAPTURED_DTYPES[cap.dtype.name] if cap is not None else 0
            event = on._run_ex("topk_gating", desc, (_lib.TopkGatingTensors, _lib.TopkGatingHostTensors),
                               [g, b, o["weights"], o["ids"], o["counts"], load, nv, cap, es], kind, wait_for,
                               {"captured_ids_dtype": cap_dtype})
        result = tuple(o[n].obj for n in wanted)  # type: ignore[union-attr]
        return result + (event,) if kind == T.DEVICE else result

    # ------------------------------------------------------------------
    # Routing replay and hash routing
    # ------------------------------------------------------------------

    def topk_weights(self, logits: Any, ids: Any, scoring: str = "softmax", renormalize: bool = False,
                     scale: float = 1.0, *, groups: Optional[int] = None, topk_group: Optional[int] = None,
                     group_score: str = "max", renormalize_floor: float = 0.0, renormalize_eps: float = 0.0,
                     group_fill: str = "neg_inf", weighting: str = "score", dtype: Optional[str] = None,
                     top_k: Optional[int] = None, out: Optional[Dict[str, Any]] = None, queue: Any = None,
                     wait_for: Optional[Sequence[Any]] = None) -> Any:
        """Routing replay (docs/routing.md, section 11): the weights the
        convention gives ids chosen elsewhere.

        Args:
            logits: float32, float16 or bfloat16 [tokens, experts].
            ids: int32 [tokens, top_k]; an id outside [0, experts) (-1 of a
                padding slot) weighs 0 and is left out of the renormalisation.
            scoring, renormalize, scale, renormalize_floor, renormalize_eps,
                weighting, dtype: as for topk_gating.
            groups, topk_group, group_score, group_fill: accepted (so that
                moecl.preset()'s keywords pass) and validated; they steer
                selection only, and replay selects nothing.
            top_k: None, or the ids' width (moecl.preset()'s keyword).
            out: {"weights": array} to write; queue, wait_for: as for topk_gating.

        Returns:
            weights float32 [tokens, top_k] (bit for bit topk_gating's for
            the ids it chose, section 11 says where not), then, for device
            tensors, the call's pyopencl.Event.
        """
        out = dict(out or {})
        kind = T.kind_of([logits, ids, *out.values()])
        g = T.check("logits", logits, (None, None), T.input_dtypes(dtype), kind)
        tokens, experts = g.shape
        i = T.check("ids", ids, (tokens, None), [T.I32], kind)
        k = i.shape[1]
        _same_width("ids", k, top_k)
        specs = {"weights": ((tokens, k), T.F32)}
        given = T.outputs(specs, out, kind)
        self._check_wait(kind, wait_for)
        on = self._on(queue)
        desc = on._topk_desc(g, tokens, experts, k, dtype, groups, topk_group, scoring, group_score, group_fill,
                             renormalize, scale, renormalize_floor, weighting, renormalize_eps, prepare=False)
        o = self._outputs(specs, given, ("weights",), kind, on.queue if kind == T.DEVICE else None)
        event = on._run("topk_weights", desc, [g, i, o["weights"]], kind, wait_for)
        weights = o["weights"].obj  # type: ignore[union-attr]
        return (weights, event) if kind == T.DEVICE else weights

    def hash_routing(self, logits: Any, input_ids: Any, tid2eid: Any, scoring: str = "sqrtsoftplus",
                     renormalize: bool = True, scale: float = 1.0, *, groups: Optional[int] = None,
                     topk_group: Optional[int] = None, group_score: str = "max", renormalize_floor: float = 0.0,
                     renormalize_eps: float = 0.0, group_fill: str = "neg_inf", weighting: str = "score",
                     dtype: Optional[str] = None, top_k: Optional[int] = None, out: Optional[Dict[str, Any]] = None,
                     queue: Any = None, wait_for: Optional[Sequence[Any]] = None) -> Tuple[Any, ...]:
        """Hash routing (DeepSeek-V4's hash layers, docs/routing.md section
        11): the experts of token t are tid2eid[input_ids[t]], weighted as
        topk_weights weighs them. DeepSeek-V4: **moecl.preset("deepseek-v4")
        (top_k, if given, must be the table's width).

        Args:
            logits: float32, float16 or bfloat16 [tokens, experts].
            input_ids: int32 [tokens]; an id outside [0, vocab) gives ids -1
                and weights 0 for its token.
            tid2eid: int32 [vocab, top_k], the table (transformers keeps it
                as int64: convert with .astype(np.int32)).
            the other keywords: as for topk_weights.

        Returns:
            (weights float32 [tokens, top_k], ids int32 [tokens, top_k]),
            then, for device tensors, the call's pyopencl.Event.
        """
        out = dict(out or {})
        kind = T.kind_of([logits, input_ids, tid2eid, *out.values()])
        g = T.check("logits", logits, (None, None), T.input_dtypes(dtype), kind)
        tokens, experts = g.shape
        n = T.check("input_ids", input_ids, (tokens,), [T.I32], kind)
        table = T.check("tid2eid", tid2eid, (None, None), [T.I32], kind)
        vocab, k = table.shape
        _same_width("tid2eid", k, top_k)
        specs = {"weights": ((tokens, k), T.F32), "ids": ((tokens, k), T.I32)}
        given = T.outputs(specs, out, kind)
        self._check_wait(kind, wait_for)
        on = self._on(queue)
        desc = on._topk_desc(g, tokens, experts, k, dtype, groups, topk_group, scoring, group_score, group_fill,
                             renormalize, scale, renormalize_floor, weighting, renormalize_eps, prepare=False)
        o = self._outputs(specs, given, ("weights", "ids"), kind, on.queue if kind == T.DEVICE else None)
        event = on._run("hash_routing", desc, [g, n, table, o["weights"], o["ids"]], kind, wait_for,
                        scalars=[_uint("vocab", vocab)], scalars_at=3)
        result = (o["weights"].obj, o["ids"].obj)  # type: ignore[union-attr]
        return result + (event,) if kind == T.DEVICE else result

    # ------------------------------------------------------------------
    # Grounded router
    # ------------------------------------------------------------------

    @staticmethod
    def _grounded_inputs(hidden: Any, router_logits: Any, ground: Any, top_k: int, dtype: Optional[str],
                         kind: str) -> Tuple[T.Tensor, T.Tensor, T.Tensor, int, int, int]:
        """The grounded router's inputs checked: hidden, router_logits, ground, tokens, experts, top_k."""
        h = T.check("hidden", hidden, (None, None), T.input_dtypes(dtype), kind)
        tokens, hidden_dim = h.shape
        r = Context._router_logits(router_logits, tokens, None, kind)
        experts = r.shape[-1]
        w = T.check("ground", ground, (experts, hidden_dim), [h.dtype], kind)
        return h, r, w, tokens, experts, _uint("top_k", top_k)

    @staticmethod
    def _router_logits(router_logits: Any, tokens: int, experts: Optional[int], kind: str) -> T.Tensor:
        """router_logits checked: float32 [tokens, experts], or [experts], one
        row added to every token's g (a gate's bias)."""
        row = len(getattr(router_logits, "shape", ())) == 1
        return T.check("router_logits", router_logits, (experts,) if row else (tokens, experts), [T.F32], kind)

    def _grounded_desc(self, h: T.Tensor, experts: int, k: int, alpha: float, dtype: Optional[str],
                       gating: Optional[Dict[str, Any]] = None,
                       out_dtypes: Tuple[int, int, int] = (0, 0, 0),
                       shared: Tuple[int, float] = (0, 1.0)) -> ctypes.Structure:
        """moecl_grounded_router_desc of a call, validated by the library (and its kernels built).

        gating: the gating options by their Python names (scoring,
        weighting, groups, topk_group, group_score, group_fill,
        renormalize, scale, renormalize_floor, renormalize_eps, precision,
        logits_dtype, logit_softcap; _logits_row, router_logits' being one
        row, from its shape); out_dtypes: weights_dtype, ids_dtype and
        bias_dtype as the library's enums; shared: (num_shared_experts,
        shared_expert_weight); absent ones keep
        desc_init's defaults (the seed's gating: scoring "raw", weighting
        "softmax_chosen"), except that a scoring given without a weighting
        weighs the chosen by their score, as topk_gating does, so that
        scoring="softmax" means the same here as there."""
        tokens, hidden_dim = h.shape
        desc = self._lib.moecl_grounded_router_desc_init(tokens, hidden_dim, experts, float(alpha))
        desc.top_k = k
        desc.hidden_dtype = _lib.DTYPES[T.input_dtypes(dtype)[h.dtype]]
        desc.weights_dtype, desc.ids_dtype, desc.bias_dtype = out_dtypes
        desc.num_shared_experts, desc.shared_expert_weight = shared[0], float(shared[1])
        g = dict(gating or {})
        if "scoring" in g and "weighting" not in g:
            g["weighting"] = "score"
        convert = {
            "scoring": lambda v: ("scoring", _enum("scoring", v, _lib.SCORINGS)),
            "weighting": lambda v: ("weighting", _enum("weighting", v, _lib.WEIGHTINGS)),
            "groups": lambda v: ("num_expert_groups", _uint("groups", 0 if v is None else v)),
            "topk_group": lambda v: ("topk_group", _uint("topk_group", 0 if v is None else v)),
            "group_score": lambda v: ("group_score", _enum("group_score", v, _lib.GROUP_SCORES)),
            "group_fill": lambda v: ("group_fill", _enum("group_fill", v, _lib.GROUP_FILLS)),
            "renormalize": lambda v: ("renormalize", bool(v)),
            "scale": lambda v: ("routed_scaling_factor", float(v)),
            "renormalize_floor": lambda v: ("renormalize_floor", float(v)),
            "renormalize_eps": lambda v: ("renormalize_eps", float(v)),
        }
        if "precision" in g:
            desc.precision = _enum("precision", g.pop("precision"), _lib.PRECISIONS)
        if "logits_dtype" in g:
            desc.logits_dtype = _enum("logits_dtype", g.pop("logits_dtype"), _lib.DTYPES)
        if "logit_softcap" in g:
            desc.logit_softcap = float(g.pop("logit_softcap"))
        # From router_logits' shape, never a keyword of the caller's.
        desc.router_logits_row = bool(g.pop("_logits_row", False))
        for name, value in g.items():
            if name not in convert:
                raise TypeError("unknown gating option %r" % (name,))
            field, converted = convert[name](value)
            setattr(desc.gating, field, converted)
        self._prepare("grounded_router", desc)
        return desc

    def grounded_router(self, hidden: Any, router_logits: Any, ground: Any, top_k: int = 2, alpha: float = 1.0,
                        *, dtype: Optional[str] = None, outputs: Sequence[str] = ("weights", "ids"),
                        num_shared_experts: int = 0, shared_expert_weight: float = 1.0,
                        out: Optional[Dict[str, Any]] = None, queue: Any = None,
                        wait_for: Optional[Sequence[Any]] = None, **gating: Any) -> Tuple[Any, ...]:
        """The grounded router (docs/routing.md, section 3).

        g = router_logits + alpha * hidden @ ground.T; by default its top_k
        largest per token and a softmax over the chosen values; gating
        options (keywords: scoring, weighting, groups, topk_group,
        group_score, group_fill, renormalize, scale, renormalize_floor,
        renormalize_eps, as for topk_gating; precision "fp32", "tf32" or
        "3xtf32"; logits_dtype "bf16" or "f16" rounds g to that type first,
        as a bf16 or f16 checkpoint's gate GEMM writes it; logit_softcap c
        > 0 makes it c * tanh(g / c)) route g as top-k gating routes its
        logits. A scoring given without a weighting
        takes topk_gating's weighting="score": scoring="softmax" gives the
        weights topk_gating(g, scoring="softmax") gives. Without a scoring,
        the seed's gating stays (scoring="raw", weighting="softmax_chosen").

        Args:
            hidden: [tokens, hidden_dim], float32, float16 or bfloat16 (see dtype).
            router_logits: float32 [tokens, experts], or [experts]: one row
                added to every token's g (a gate's bias, GPT-OSS).
            ground: [experts, hidden_dim], of hidden's dtype.
            top_k: experts chosen per token.
            alpha: weight of the hidden @ ground.T term.
            dtype: as for topk_gating, for hidden and ground.
            outputs: which outputs to compute and return, in this order:
                any of "weights" (float32 [tokens, top_k]), "ids" (int32
                [tokens, top_k]) and "pairs" (float32 [tokens, top_k, 2],
                (id, weight) interleaved, the seed's layout).
            num_shared_experts, shared_expert_weight: as for topk_gating:
                S shared slots after the routed ones in every output (ids
                experts + j, weight shared_expert_weight * scale); the
                outputs are then top_k + S slots a row.
            out, queue, wait_for: as for topk_gating.

        Returns:
            The outputs named in outputs, then for device tensors the pyopencl.Event.
        """
        out = dict(out or {})
        outputs = tuple(outputs)
        for name in outputs:
            if name not in ("pairs", "weights", "ids"):
                raise ValueError('outputs: %r is none of "pairs", "weights", "ids"' % (name,))
        kind = T.kind_of([hidden, router_logits, ground, *out.values()])
        h, r, w, tokens, experts, k = self._grounded_inputs(hidden, router_logits, ground, top_k, dtype, kind)
        s = _uint("num_shared_experts", num_shared_experts)
        specs = {"pairs": ((tokens, k + s, 2), T.F32), "weights": ((tokens, k + s), T.F32),
                 "ids": ((tokens, k + s), T.I32)}
        given = T.outputs(specs, out, kind)
        extra = [n for n in specs if given[n] is not None and n not in outputs]
        if extra:
            raise ValueError("out: %s given but not in outputs" % ", ".join(extra))

        self._check_wait(kind, wait_for)
        on = self._on(queue)
        desc = on._grounded_desc(h, experts, k, alpha, dtype, dict(gating, _logits_row=len(r.shape) == 1),
                                 shared=(s, shared_expert_weight))

        q = on.queue if kind == T.DEVICE else None
        o = self._outputs(specs, given, outputs, kind, q)
        event = on._run("grounded_router", desc, [h, r, w, o["pairs"], o["weights"], o["ids"]], kind, wait_for)
        result = tuple(o[n].obj for n in outputs)  # type: ignore[union-attr]
        return result + (event,) if kind == T.DEVICE else result

    def router(self, hidden: Any, ground: Any, top_k: int = 8, alpha: float = 1.0, *, router_logits: Any = None,
               bias: Any = None, dtype: Optional[str] = None, bias_dtype: Optional[str] = None,
               weights_dtype: str = "f32", ids_dtype: str = "int32", counts: bool = False,
               num_valid_tokens: Any = None, expert_load: Any = None, captured_ids: Any = None,
               expert_scale: Any = None, num_shared_experts: int = 0, shared_expert_weight: float = 1.0,
               shared_expert_gate: Any = None, out: Optional[Dict[str, Any]] = None, queue: Any = None,
               wait_for: Optional[Sequence[Any]] = None, **gating: Any) -> Tuple[Any, ...]:
        """A model's router in one launch, moecl_router (docs/routing.md, section 3).

        g = alpha * hidden @ ground.T (+ router_logits when given) routed by
        the gating options (keywords as for grounded_router) with an
        optional correction bias: DeepSeek-V3 is scoring="sigmoid",
        weighting="score", bias=e_score_correction_bias, groups=8,
        topk_group=4, group_score="top2_sum", renormalize=True,
        renormalize_eps=1e-20, scale=2.5, top_k=8. Without scoring and weighting, the grounded router's
        gating: top-k of g, then a softmax over the chosen values
        (scoring="raw", weighting="softmax_chosen"). A scoring given without
        a weighting weighs the chosen by their score, as topk_gating does:
        router(h, W, top_k=4, scoring="softmax") gives the weights of
        topk_gating(h @ W.T, top_k=4, scoring="softmax") (all experts'
        softmax at the chosen ones); pass weighting="softmax_chosen" for a
        softmax over the chosen only (Mixtral, Qwen).

        Args:
            hidden: [tokens, hidden_dim], float32, float16 or bfloat16 (see dtype).
            ground: [experts, hidden_dim] of hidden's dtype (the gate's weight).
            router_logits: float32 [tokens, experts] added to g, or
                [experts] added to every token's (a gate's bias), or None.
            bias: [experts] for selection only, or None: float32, float16
                or bfloat16 (see bias_dtype).
            bias_dtype: the bias's type, as dtype is hidden's.
            weights_dtype, ids_dtype: the outputs' types, as for topk_gating.
            counts: also return expert_counts int32 [experts].
            num_valid_tokens: int32 [1], or None: the rows that are tokens,
                read when the kernel runs; the rows past it are padding (ids
                -1, weights 0, counted nowhere), as for topk_gating.
            expert_load: int32 [experts], or None: a load counter the call
                adds its routed slots to, in place (never zeroed).
            captured_ids: int16, int32 or int64 [tokens, top_k], or None: a
                copy of the ids written in place (routing capture for
                replay; -1 for padding rows); its dtype is the capture's.
            expert_scale: float32 [experts], or None: each chosen expert's
                final weight times its entry (Gemma 4's per_expert_scale),
                after the renormalisation and scale.
            num_shared_experts, shared_expert_weight: as for topk_gating:
                S shared slots after the routed ones (ids experts + j,
                weight shared_expert_weight * scale); weights and ids are
                then [tokens, top_k + S], counts and expert_load
                [experts + S], captured_ids stays [tokens, top_k] (the
                routed ids); expert_scale leaves the shared slots.
            shared_expert_gate: [num_shared_experts, hidden_dim] of
                hidden's dtype, or None: Qwen2-MoE's per-token gate of its
                shared expert; shared slot j then weighs
                sigmoid(hidden[t] . shared_expert_gate[j]) (f32, ascending
                hidden index), neither scaled nor shared_expert_weight.
            out, queue, wait_for, dtype: as for topk_gating ("weights",
                "ids", "counts").

        Returns:
            (weights [tokens, top_k] of weights_dtype, ids [tokens, top_k]
            of ids_dtype), then counts if asked for, then for device
            tensors the pyopencl.Event.
        """
        out = dict(out or {})
        kind = T.kind_of([hidden, ground, router_logits, bias, num_valid_tokens, expert_load, captured_ids,
                          expert_scale, *out.values()])
        h = T.check("hidden", hidden, (None, None), T.input_dtypes(dtype), kind)
        tokens, hidden_dim = h.shape
        w = T.check("ground", ground, (None, hidden_dim), [h.dtype], kind)
        experts = w.shape[0]
        r = None if router_logits is None else self._router_logits(router_logits, tokens, experts, kind)
        b = None if bias is None else T.check("bias", bias, (experts,), T.input_dtypes(bias_dtype), kind)
        k = _uint("top_k", top_k)
        s = _uint("num_shared_experts", num_shared_experts)
        nv = None if num_valid_tokens is None else T.check("num_valid_tokens", num_valid_tokens, (1,), [T.I32], kind)
        load = None if expert_load is None else T.check("expert_load", expert_load, (experts + s,), [T.I32], kind,
                                                        output=True)
        cap = None if captured_ids is None else T.check("captured_ids", captured_ids, (tokens, k),
                                                        [T.I16, T.I32, T.I64], kind, output=True)
        sc = None if expert_scale is None else T.check("expert_scale", expert_scale, (experts,), [T.F32], kind)
        sg = None if shared_expert_gate is None else T.check("shared_expert_gate", shared_expert_gate,
                                                             (s, hidden_dim), [h.dtype], kind)
        w_spec, ids_spec = self._topk_out_specs(tokens, k + s, weights_dtype, ids_dtype, kind)
        specs = {"weights": w_spec, "ids": ids_spec, "counts": ((experts + s,), T.I32)}
        given = T.outputs(specs, out, kind)
        if given["counts"] is not None and not counts:
            raise ValueError('out["counts"] given without counts=True')

        self._check_wait(kind, wait_for)
        on = self._on(queue)
        out_dtypes = (_enum("weights_dtype", weights_dtype, _lib.DTYPES),
                      _enum("ids_dtype", ids_dtype, _lib.INDEX_DTYPES),
                      _lib.DTYPES[T.input_dtypes(bias_dtype)[b.dtype]] if b is not None else 0)
        desc = on._grounded_desc(h, experts, k, alpha, dtype,
                                 dict(gating, _logits_row=r is not None and len(r.shape) == 1), out_dtypes,
                                 (s, shared_expert_weight))

        q = on.queue if kind == T.DEVICE else None
        wanted = ("weights", "ids", "counts") if counts else ("weights", "ids")
        o = self._outputs(specs, given, wanted, kind, q)
        cap_dtype = 0 if cap is None else _lib.CAPTURED_DTYPES[{T.I16: "int16", T.I32: "int32",
                                                                 T.I64: "int64"}[cap.dtype]]
        event = on._run_ex("router", desc, (_lib.RouterTensors, _lib.RouterHostTensors),
                           [h, r, w, b, o["weights"], o["ids"], o["counts"], load, nv, cap, sc, sg], kind, wait_for,
                           {"captured_ids_dtype": cap_dtype})
        result = tuple(o[n].obj for n in wanted)  # type: ignore[union-attr]
        return result + (event,) if kind == T.DEVICE else result

    # ------------------------------------------------------------------
    # moe_align
    # ------------------------------------------------------------------

    @staticmethod
    def _align_specs(tokens: int, k: int, e: int, block: int) -> Dict[str, Tuple[Tuple[int, ...], np.dtype]]:
        """moe_align's outputs' shapes, by MoeAlignResult's names."""
        # moecl_moe_align_max_padded()'s formula, here so that the outputs
        # are checked before any C call; block_size 0 is the library's to refuse.
        max_padded = tokens * k + e * max(block - 1, 0)
        bs = max(block, 1)
        return {"expert_counts": ((e,), T.I32), "sorted_token_ids": ((max_padded,), T.I32),
                "block_expert_ids": ((max_padded // bs,), T.I32), "num_tokens_post_padded": ((1,), T.I32),
                "slot_positions": ((tokens, k), T.I32), "num_invalid": ((1,), T.I32)}

    @staticmethod
    def _align_wanted(specs: Dict[str, Any], given: Dict[str, Optional[T.Tensor]], slot_positions: bool,
                      num_invalid: bool) -> list:
        """The moe_align outputs a call writes; an output given in out must be one."""
        for name, flag in (("slot_positions", slot_positions), ("num_invalid", num_invalid)):
            if given[name] is not None and not flag:
                raise ValueError("out[%r] given with %s=False" % (name, name))
        return [n for n in specs if (n != "slot_positions" or slot_positions) and (n != "num_invalid" or num_invalid)]

    def _align_desc(self, tokens: int, k: int, e: int, block: int, num_global: int = 0) -> ctypes.Structure:
        """moecl_moe_align_desc of a call, validated by the library (and its kernels built)."""
        desc = self._lib.moecl_moe_align_desc_init(tokens, k, e, block)
        desc.num_global_experts = num_global
        self._prepare("moe_align", desc)
        return desc

    def moe_align(self, topk_ids: Any, num_experts: int, block_size: int, *, expert_map: Any = None,
                  slot_positions: bool = True, num_invalid: bool = True, out: Optional[Dict[str, Any]] = None,
                  queue: Any = None, wait_for: Optional[Sequence[Any]] = None) -> MoeAlignResult:
        """Sort a routing's slots by expert for grouped GEMMs (docs/routing.md, section 7).

        Args:
            topk_ids: int32 [tokens, top_k]; ids outside [0, num_experts) are skipped
                (with expert_map: global ids, outside [0, len(expert_map)) skipped).
            num_experts: experts routed to (with expert_map: this rank's local experts).
            block_size: each expert's run is padded to a multiple of this.
            expert_map: int32 [num_global_experts], or None: expert parallelism (vLLM's
                expert_map). Global expert g is local expert expert_map[g], or -1 where it
                is on another rank: its slots are skipped and not counted in num_invalid.
                The outputs are then in local ids.
            slot_positions, num_invalid: compute these optional outputs.
            out, queue, wait_for: as for topk_gating (names as MoeAlignResult's fields).

        Returns:
            A MoeAlignResult.
        """
        out = dict(out or {})
        kind = T.kind_of([topk_ids, expert_map, *out.values()])
        ids = T.check("topk_ids", topk_ids, (None, None), [T.I32], kind)
        emap = None if expert_map is None else T.check("expert_map", expert_map, (None,), [T.I32], kind)
        if emap is not None and emap.shape[0] == 0:
            raise ValueError("expert_map: expected at least one entry")
        tokens, k = ids.shape
        self._check_wait(kind, wait_for)
        e, block = _uint("num_experts", num_experts), _uint("block_size", block_size)
        specs = self._align_specs(tokens, k, e, block)
        given = T.outputs(specs, out, kind)
        wanted = self._align_wanted(specs, given, slot_positions, num_invalid)
        on = self._on(queue)
        desc = on._align_desc(tokens, k, e, block, 0 if emap is None else emap.shape[0])

        q = on.queue if kind == T.DEVICE else None
        o = self._outputs(specs, given, wanted, kind, q)
        if emap is None:
            event = on._run("moe_align", desc, [ids] + [o[n] for n in specs], kind, wait_for)
        else:
            event = on._run_ex("moe_align", desc, (_lib.MoeAlignTensors, _lib.MoeAlignHostTensors),
                               [ids] + [o[n] for n in specs] + [emap], kind, wait_for)
        return MoeAlignResult(*[None if o[n] is None else o[n].obj for n in specs], event)  # type: ignore[union-attr]

    # ------------------------------------------------------------------
    # Routing through to dispatch
    # ------------------------------------------------------------------

    def _dispatch(self, name: str, desc_of: Any, inputs: Sequence[Optional[T.Tensor]], tokens: int, k: int,
                  experts: int, block_size: int, slot_positions: bool, num_invalid: bool,
                  out: Dict[str, Any], kind: str, queue: Any, wait_for: Optional[Sequence[Any]],
                  weights_dtype: str = "f32", ids_dtype: str = "int32",
                  ex: Optional[Tuple[Optional[T.Tensor], Optional[T.Tensor], Optional[T.Tensor], int]] = None
                  ) -> RouteDispatchResult:
        """The two route dispatch calls' common steps: the outputs checked,
        desc_of(context) building the routing's descriptor, the call; ex:
        moecl_route_dispatch_ex's num_valid_tokens, expert_load, expert_map
        and num_local_experts (the alignment's experts with a map)."""
        block = _uint("block_size", block_size)
        emap = ex[2] if ex else None
        align_experts = ex[3] if emap is not None else experts  # type: ignore[index]
        w_spec, ids_spec = self._topk_out_specs(tokens, k, weights_dtype, ids_dtype, kind)
        specs = {"topk_weights": w_spec, "topk_ids": ids_spec,
                 **self._align_specs(tokens, k, align_experts, block)}
        given = T.outputs(specs, out, kind)
        wanted = ["topk_weights", "topk_ids"] + self._align_wanted(specs, given, slot_positions, num_invalid)
        self._check_wait(kind, wait_for)
        on = self._on(queue)
        desc = desc_of(on)
        if emap is None:  # with a map, the call's own checks name num_local_experts
            on._align_desc(tokens, k, experts, block)

        q = on.queue if kind == T.DEVICE else None
        o = self._outputs(specs, given, wanted, kind, q)
        tensors = list(inputs) + [o[n] for n in specs]
        if ex is None or all(x is None for x in ex[:3]):
            event = on._run(name, desc, tensors, kind, wait_for, scalars=[block])
        else:
            event = on._run_ex(name, desc, (_lib.RouteDispatchTensors, _lib.RouteDispatchHostTensors),
                               tensors + [ex[1], ex[0], emap], kind, wait_for, {"num_local_experts": ex[3]}, [block])
        return RouteDispatchResult(*[None if o[n] is None else o[n].obj for n in specs], event)  # type: ignore[union-attr]

    def route_dispatch(self, logits: Any, top_k: int = 8, scoring: str = "softmax", bias: Any = None,
                       groups: Optional[int] = None, topk_group: Optional[int] = None, group_score: str = "max",
                       renormalize: bool = False, scale: float = 1.0, *, block_size: int = 64,
                       renormalize_floor: float = 0.0, renormalize_eps: float = 0.0, group_fill: str = "neg_inf",
                       weighting: str = "score", dtype: Optional[str] = None, bias_dtype: Optional[str] = None,
                       weights_dtype: str = "f32", ids_dtype: str = "int32", slot_positions: bool = True,
                       num_invalid: bool = True, num_shared_experts: int = 0, shared_expert_weight: float = 1.0,
                       num_valid_tokens: Any = None, expert_load: Any = None,
                       expert_map: Any = None, num_local_experts: Optional[int] = None,
                       out: Optional[Dict[str, Any]] = None,
                       queue: Any = None, wait_for: Optional[Sequence[Any]] = None) -> RouteDispatchResult:
        """Top-k gating through to dispatch in one call (moecl_route_dispatch,
        moecl_route_dispatch_ex; docs/routing.md, "Routing through to
        dispatch"): exactly what topk_gating(num_valid_tokens=,
        expert_load=) followed by moe_align(ids, experts, block_size,
        expert_map=) returns, in one launch for decode-sized batches where
        the device allows.

        Args:
            logits, top_k, scoring, bias, groups, topk_group, group_score,
            renormalize, scale, renormalize_floor, renormalize_eps, group_fill, weighting, dtype,
            bias_dtype, weights_dtype: as for topk_gating.
            ids_dtype: "int32" only (moe_align reads int32 ids); "int64"
                raises moecl.InvalidArgumentError.
            block_size: as for moe_align.
            slot_positions, num_invalid: compute these optional outputs.
            num_shared_experts, shared_expert_weight: as for topk_gating; the
                dispatch then aligns top_k + S slots over experts + S experts.
            num_valid_tokens: int32 [1], or None: as for topk_gating; the
                padding rows' slots (id -1) are skipped by the alignment and
                counted in num_invalid, as moe_align counts -1 ids.
            expert_load: int32 [experts] (int32 [num_local_experts] with
                expert_map), or None: a load counter the call adds its
                routed slots to, in place (by local expert with a map,
                counting only this rank's slots).
            expert_map: int32 [experts], or None: expert parallelism as for
                moe_align (vLLM's expert_map): the ids stay global, the
                alignment is over num_local_experts local experts.
            num_local_experts: this rank's experts; required with expert_map,
                None without.
            out, queue, wait_for: as for topk_gating (names as RouteDispatchResult's fields).

        Returns:
            A RouteDispatchResult (expert_counts has num_local_experts
            entries with expert_map).
        """
        out = dict(out or {})
        kind = T.kind_of([logits, bias, num_valid_tokens, expert_load, expert_map, *out.values()])
        g, b, tokens, experts, k = self._topk_inputs(logits, bias, top_k, dtype, kind, bias_dtype)
        s = _uint("num_shared_experts", num_shared_experts)
        if (expert_map is None) != (num_local_experts is None):
            raise ValueError("expert_map and num_local_experts go together: give both or neither")
        local = 0 if num_local_experts is None else _uint("num_local_experts", num_local_experts)
        nv = None if num_valid_tokens is None else T.check("num_valid_tokens", num_valid_tokens, (1,), [T.I32], kind)
        emap = None if expert_map is None else T.check("expert_map", expert_map, (experts,), [T.I32], kind)
        load = None if expert_load is None else T.check("expert_load", expert_load,
                                                        (local if emap is not None else experts + s,), [T.I32], kind,
                                                        output=True)
        return self._dispatch(
            "route_dispatch",
            lambda on: on._topk_desc(g, tokens, experts, k, dtype, groups, topk_group, scoring, group_score,
                                     group_fill, renormalize, scale, renormalize_floor, weighting,
                                     renormalize_eps, b, bias_dtype, weights_dtype, ids_dtype,
                                     shared=(s, shared_expert_weight)),
            [g, b], tokens, k + s, experts + s, block_size, slot_positions, num_invalid, out, kind, queue, wait_for,
            weights_dtype, ids_dtype, (nv, load, emap, local))

    def grounded_route_dispatch(self, hidden: Any, router_logits: Any, ground: Any, top_k: int = 2,
                                alpha: float = 1.0, *, block_size: int = 64, dtype: Optional[str] = None,
                                slot_positions: bool = True, num_invalid: bool = True,
                                num_shared_experts: int = 0, shared_expert_weight: float = 1.0,
                                out: Optional[Dict[str, Any]] = None, queue: Any = None,
                                wait_for: Optional[Sequence[Any]] = None) -> RouteDispatchResult:
        """The grounded router through to dispatch in one call
        (moecl_grounded_route_dispatch): exactly what grounded_router (weights
        and ids) followed by moe_align(ids, experts, block_size) returns, in
        one launch for decode-sized batches where the device allows.

        Args:
            hidden, router_logits, ground, top_k, alpha, dtype: as for grounded_router.
            block_size, slot_positions, num_invalid, out, queue, wait_for: as for route_dispatch.
            num_shared_experts, shared_expert_weight: as for grounded_router;
                the dispatch then aligns top_k + S slots over experts + S
                experts.

        Returns:
            A RouteDispatchResult.
        """
        out = dict(out or {})
        kind = T.kind_of([hidden, router_logits, ground, *out.values()])
        h, r, w, tokens, experts, k = self._grounded_inputs(hidden, router_logits, ground, top_k, dtype, kind)
        s = _uint("num_shared_experts", num_shared_experts)
        row = {"_logits_row": len(r.shape) == 1}
        return self._dispatch("grounded_route_dispatch",
                              lambda on: on._grounded_desc(h, experts, k, alpha, dtype, row,
                                                           shared=(s, shared_expert_weight)),
                              [h, r, w], tokens, k + s, experts + s, block_size, slot_positions, num_invalid, out,
                              kind, queue, wait_for)

    # ------------------------------------------------------------------
    # Permute and combine around the expert GEMMs
    # ------------------------------------------------------------------

    def permute(self, hidden_states: Any, sorted_token_ids: Any, num_tokens_post_padded: Any, top_k: int, *,
                slot_positions: Any = None, dtype: Optional[str] = None, out_dtype: Optional[str] = None,
                out: Optional[Dict[str, Any]] = None, queue: Any = None,
                wait_for: Optional[Sequence[Any]] = None) -> Any:
        """Gather each slot's hidden row into moe_align's order (moecl_permute;
        docs/routing.md, "Permute and combine"): row p of the result is
        hidden_states[sorted_token_ids[p] // top_k], or 0 where the entry is
        padding (moe_align's sentinel tokens * top_k, or any value outside
        [0, tokens * top_k)), for p < num_tokens_post_padded[0]. With
        slot_positions, the same rows token-major (moecl_permute_scatter): each
        hidden row read once and written to its top_k positions, which pays
        where hidden_states exceeds the device's last-level cache.

        Args:
            hidden_states: float32, float16 or bfloat16 [tokens, hidden].
            sorted_token_ids: int32 [num_padded] (moe_align's).
            num_tokens_post_padded: int32 [1] (moe_align's): the rows written.
            top_k: the routing's slots per token.
            slot_positions: None (the gather), or int32 [tokens, top_k]: moe_align's
                of the same call, the inverse of sorted_token_ids. Positions
                outside [0, num_tokens_post_padded[0]) are skipped; with
                inconsistent ones the rows below it are unspecified.
            dtype: as for topk_gating (the input's type; "bf16" also takes uint16).
            out_dtype: "f32", "f16" or "bf16" (to nearest even); None: the input's.
            out: {"permuted": array [num_padded, hidden] of out_dtype} to write; rows
                past num_tokens_post_padded keep their values. A new NumPy result
                has 0 there, a new device array whatever it held.
            queue, wait_for: as for topk_gating.

        Returns:
            the permuted rows, then, for device tensors, the call's pyopencl.Event.
        """
        out = dict(out or {})
        kind = T.kind_of([hidden_states, sorted_token_ids, num_tokens_post_padded, *out.values()] +
                         ([] if slot_positions is None else [slot_positions]))
        x = T.check("hidden_states", hidden_states, (None, None), T.input_dtypes(dtype), kind)
        tokens, hidden = x.shape
        k = _uint("top_k", top_k)
        pos = None if slot_positions is None else T.check("slot_positions", slot_positions, (tokens, k), [T.I32],
                                                          kind)
        ids = T.check("sorted_token_ids", sorted_token_ids, (None,), [T.I32], kind)
        post = T.check("num_tokens_post_padded", num_tokens_post_padded, (1,), [T.I32], kind)
        padded = ids.shape[0]
        in_name = T.input_dtypes(dtype)[x.dtype]
        name = in_name if out_dtype is None else out_dtype
        out_enum = _enum("out_dtype", name, _lib.DTYPES)
        specs = {"permuted": ((padded, hidden), T.weights_dtype(name, kind))}
        given = T.outputs(specs, out, kind)
        self._check_wait(kind, wait_for)
        on = self._on(queue)
        desc = self._lib.moecl_permute_desc_init(tokens, k, hidden, padded)
        desc.in_dtype = _lib.DTYPES[in_name]
        desc.out_dtype = out_enum
        o = self._outputs(specs, given, ("permuted",), kind, on.queue if kind == T.DEVICE else None)
        if kind == T.HOST and given["permuted"] is None:
            o["permuted"].host[...] = 0  # type: ignore[union-attr]
        if pos is None:
            event = on._run("permute", desc, [x, ids, post, o["permuted"]], kind, wait_for)
        else:
            event = on._run("permute_scatter", desc, [x, ids, post, pos, o["permuted"]], kind, wait_for)
        result = o["permuted"].obj  # type: ignore[union-attr]
        return (result, event) if kind == T.DEVICE else result

    def combine(self, expert_out: Any, topk_weights: Any, slot_positions: Any, *, shared_out: Any = None,
                dtype: Optional[str] = None, shared_dtype: Optional[str] = None, out_dtype: str = "f32",
                out: Optional[Dict[str, Any]] = None, queue: Any = None,
                wait_for: Optional[Sequence[Any]] = None) -> Any:
        """The weighted sum of each token's expert rows (moecl_combine;
        docs/routing.md, "Permute and combine"): for token t, in float32 from
        +0 and j ascending, each product and sum rounded,
        out[t] = sum_j topk_weights[t, j] * expert_out[slot_positions[t, j]]
        over the j whose position is in [0, num_padded), then + shared_out[t].

        Args:
            expert_out: float32, float16 or bfloat16 [num_padded, hidden], in
                moe_align's order (what the expert GEMMs wrote for permute's rows).
            topk_weights: float32 [tokens, top_k].
            slot_positions: int32 [tokens, top_k] (moe_align's; -1: nothing).
            shared_out: None, or a shared expert's rows [tokens, hidden], added last.
            dtype, shared_dtype: the inputs' types, as for topk_gating's dtype.
            out_dtype: "f32", "f16" or "bf16" (to nearest even).
            out: {"combined": array [tokens, hidden] of out_dtype} to write; queue,
                wait_for: as for topk_gating.

        Returns:
            the combined rows, then, for device tensors, the call's pyopencl.Event.
        """
        out = dict(out or {})
        kind = T.kind_of([expert_out, topk_weights, slot_positions, shared_out, *out.values()])
        y = T.check("expert_out", expert_out, (None, None), T.input_dtypes(dtype), kind)
        padded, hidden = y.shape
        w = T.check("topk_weights", topk_weights, (None, None), [T.F32], kind)
        tokens, k = w.shape
        pos = T.check("slot_positions", slot_positions, (tokens, k), [T.I32], kind)
        sh = None if shared_out is None else T.check("shared_out", shared_out, (tokens, hidden),
                                                     T.input_dtypes(shared_dtype), kind)
        out_enum = _enum("out_dtype", out_dtype, _lib.DTYPES)
        specs = {"combined": ((tokens, hidden), T.weights_dtype(out_dtype, kind))}
        given = T.outputs(specs, out, kind)
        self._check_wait(kind, wait_for)
        on = self._on(queue)
        desc = self._lib.moecl_combine_desc_init(tokens, k, hidden, padded)
        desc.in_dtype = _lib.DTYPES[T.input_dtypes(dtype)[y.dtype]]
        desc.out_dtype = out_enum
        if sh is not None:
            desc.shared_dtype = _lib.DTYPES[T.input_dtypes(shared_dtype)[sh.dtype]]
        o = self._outputs(specs, given, ("combined",), kind, on.queue if kind == T.DEVICE else None)
        event = on._run("combine", desc, [y, w, pos, sh, o["combined"]], kind, wait_for)
        result = o["combined"].obj  # type: ignore[union-attr]
        return (result, event) if kind == T.DEVICE else result


def _key(names: Dict[str, int], value: int) -> str:
    """The Python name of an enum value of moecl.h."""
    return next(n for n, v in names.items() if v == value)


def preset_names() -> Tuple[str, ...]:
    """The names of the presets (moecl_preset_name()), in the C table's order."""
    lib = library()
    names = []
    while True:
        name = lib.moecl_preset_name(len(names))
        if name is None:
            return tuple(names)
        names.append(name.decode())


def _preset_desc(name: str, which: str) -> ctypes.Structure:
    """The C library's descriptor of preset name: "topk_gating" or "grounded_router"."""
    if not isinstance(name, str):
        raise TypeError("preset name must be a str, not %s" % type(name).__name__)
    lib = library()
    desc = _lib.TopkGatingDesc() if which == "topk_gating" else _lib.GroundedRouterDesc()
    status = getattr(lib, "moecl_%s_desc_preset" % which)(name.encode(), 0, ctypes.byref(desc))
    if status != 0:
        raise error_class(status)(status, lib.moecl_status_string(status).decode(),
                                  lib.moecl_context_error(None).decode(errors="replace"))
    return desc


def preset(name: str) -> Dict[str, Any]:
    """The routing convention of a model family's flagship checkpoint, as
    the keyword arguments of Context.topk_gating (docs/routing.md, section 10).

    From the C library's table (moecl_topk_gating_desc_preset()): top_k,
    scoring, weighting, groups, topk_group, group_score, group_fill,
    renormalize, renormalize_floor, renormalize_eps and scale. The same keywords serve
    Context.router, grounded_router and route_dispatch::

        w, ids = ctx.topk_gating(logits, bias=correction_bias, **moecl.preset("deepseek-v3"))

    The logits must have the family's expert count (preset_shape()); a
    family that selects with a correction bias takes it as bias.

    Raises:
        TypeError: name is not a str.
        moecl.InvalidArgumentError: name is no preset; the message lists them.
    """
    d = _preset_desc(name, "topk_gating")
    return dict(top_k=d.top_k, scoring=_key(_lib.SCORINGS, d.scoring), weighting=_key(_lib.WEIGHTINGS, d.weighting),
                groups=d.num_expert_groups or None, topk_group=d.topk_group or None,
                group_score=_key(_lib.GROUP_SCORES, d.group_score), group_fill=_key(_lib.GROUP_FILLS, d.group_fill),
                renormalize=bool(d.renormalize), renormalize_floor=float(d.renormalize_floor),
                renormalize_eps=float(d.renormalize_eps), scale=float(d.routed_scaling_factor))


def preset_shape(name: str) -> Tuple[int, int]:
    """(num_experts, hidden_size) of a preset's checkpoint
    (moecl_grounded_router_desc_preset()): the logits' width, and the
    hidden states' width for Context.router. Raises as preset()."""
    d = _preset_desc(name, "grounded_router")
    return d.num_experts, d.hidden_dim


def version() -> str:
    """moecl_version() of the loaded C library."""
    return library().moecl_version().decode()


def status_string(status: int) -> str:
    """moecl_status_string(status)."""
    return library().moecl_status_string(status).decode()


