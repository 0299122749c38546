"""``torch.ops.fa3_inductor.flex_fwd_fp8``: the op Inductor's output code calls for an FP8 site
(``options={"fa3.fp8": ...}``, lowering/flex_lowering.py): the FP8 prologue on q, k, v, then the
site's families (templates/registry.py: the fp8 family; torch's dense kernel on the dequantized
operands as the last resort). Inference only: no autograd (the backend refuses training graphs).

``torch.ops.fa3_inductor.flex_fwd_fp8_rope``: the same with the model's RoPE moved into the
prologue: it takes q and k before RoPE and the cos/sin tables (recognition/rope_fusion.py puts it
in the graph in place of a flex_attention node whose q and k the model rotated).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from ..fp8_recipe import FP8Operands, FP8Recipe, RopeSpec
from ..templates.family import Call
from ..templates.fp8_prologue.host import _interpreting, check_positions, finish, layout_of, quantize
from ..templates.placeholder import outside_graph_pools
from . import fast_launch
from .fast_launch import aliasing, on_clear, relaunch, tensor_signature
from .spec import SiteSpec

_LIB = torch.library.Library("fa3_inductor", "FRAGMENT")
_LIB.define(
    "flex_fwd_fp8(Tensor q, Tensor k, Tensor v, Tensor? kv_num_blocks, Tensor? kv_indices, "
    "Tensor? full_kv_num_blocks, Tensor? full_kv_indices, Tensor[] score_bufs, "
    "Tensor[] mask_bufs, float scale, int sparse_q_block, int sparse_kv_block, str spec, "
    "str recipe) -> (Tensor, Tensor, Tensor)")


def recipe_text(recipe: FP8Recipe) -> str:
    """The recipe as the op's string argument (the output code carries it as a literal).

    Example::

        >>> recipe_of(recipe_text(FP8Recipe(smooth_k=True))).smooth_k
        True
    """
    return json.dumps(dataclasses.asdict(recipe), sort_keys=True)


@functools.lru_cache(maxsize=64)
def recipe_of(text: str) -> FP8Recipe:
    """The recipe :func:`recipe_text` wrote."""
    return FP8Recipe(**json.loads(text))


def flex_fwd_fp8(q: Tensor, k: Tensor, v: Tensor, kv_num_blocks: Optional[Tensor],
                 kv_indices: Optional[Tensor], full_kv_num_blocks: Optional[Tensor],
                 full_kv_indices: Optional[Tensor], score_bufs: list[Tensor], mask_bufs: list[Tensor],
                 scale: float, sparse_q_block: int, sparse_kv_block: int, spec: str,
                 recipe: str) -> tuple[Tensor, Tensor, Tensor]:
    """(out, lse_log2, max_log2) of FP8 attention, as ``flex_fwd`` returns them (the row max is not
    computed: FP8 sites are planned with needs_max=False, and its buffer is left empty): the call
    :func:`fp8_call` makes, served by the site's families.

    Example::

        >>> out, lse, mx = torch.ops.fa3_inductor.flex_fwd_fp8(q, k, v, None, None, None, None,
        ...     [], [], 0.125, 128, 128, spec, recipe_text(FP8Recipe()))   # doctest: +SKIP
    """
    return compiled_call(q, k, v, None, (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices),
                         score_bufs, mask_bufs, scale, sparse_q_block, sparse_kv_block, spec, recipe)


_LOG2E = 1.4426950408889634

# The compiled ops' memo (issue 18): op key -> _BoundOp, for the calls of a compiled graph, which repeat
# one signature per site call after call. Cleared with the launch cache (its entries hold recorded launches).
_BOUND: dict = {}
_MAX_BOUND = 256
# (prologue layout, stream, thread) -> the prologue operands the replays re-write (_Workspace)
_WORKSPACES: dict = {}
_MAX_WORKSPACES = 16
# v_scale_max slots per _Workspace, all zeroed by one launch every _RING calls. Small on purpose: the
# slot's address is one of those fast_launch keys a launch's argument tuple by (at most _MAX_CALLS = 1024
# a launch entry), and a model whose L sites share an entry, each on addresses of its own, cycles through
# lcm(L, _RING) <= 8 L of them: the cache keeps them all up to L = 128 (a ring of 128 would rebuild the
# tuples of both launches on every call past L = 8 or so)
_RING = 8
on_clear(_WORKSPACES.clear)
on_clear(_BOUND.clear)
_STATS = {"replayed": 0, "full": 0, "bound": 0}


def stats() -> dict:
    """Counters of the compiled ops (``flex_fwd_fp8``, ``flex_fwd_fp8_rope``) since the process started:
    calls ``replayed`` through the memo, calls that took the ``full`` path (plan lookup, checks, the
    Call, the launch keys), memo entries ``bound``. A compiled model's forward replays every site once
    the first forward has bound them.

    Example::

        >>> sorted(stats())
        ['bound', 'full', 'replayed']
    """
    return dict(_STATS)


class _Workspace:
    """The prologue operands of one (layout, stream, thread), re-written call after call by the
    replays (:meth:`_BoundOp.operands`, :func:`bound_fp8_call`), and _RING v_scale_max slots.

    v_scale_max is the prologue's atomic max of the scales of V's nonzero blocks, so each call needs
    one that starts below every scale. The full path starts it at -1 and maps a -1 left in a head
    whose V is all zero to 1 (``torch.full``, then ``finish``'s ``abs_``: two launches). Here a call
    takes the next of _RING zeroed slots (rows of one tensor, 16-byte aligned) and one ``zero_``
    resets them all when they are used up: 2 + 1/_RING launches a call (prologue, attention). A head
    whose V is all zero then keeps 0 instead of 1; both attention kernels give it the same output,
    bit for bit: all its V blocks have scale 1, and P's shift min(8 + log2(1 / vs_max), 8) is 8 for
    vs_max 1 and for 0 (log2(inf) = inf; hopper's LEAN form 8 - log2(0) + lg2(1) = inf likewise), so
    P, its e4m3 rounding and the row sum (which divides the shift out) are the same, and O's
    accumulator, P8 times an all-zero VT, is a zero that the epilogue's factor vs_max / 256 (a
    positive number or 0) leaves a zero of the same sign (docs/design/fp8_prologue.md, "Host cost of
    the compiled op"). The slots are reused safely for the reasons the operands are: everything that
    touches them runs on that stream in issue order, and the op never returns them. Kept tensors are
    allocated outside any cudagraph tree's pool; under a stream capture the replays are not taken."""

    __slots__ = ("sets", "k_part", "ring", "next")

    def __init__(self, layout) -> None:
        ops, self.k_part = layout.allocate(fill=False)
        shape = layout.scale_max_shape
        n = shape[0] * shape[1]
        width = -(-n // 4) * 4                      # slots 16 bytes apart: aligned as a fresh tensor
        self.ring = torch.zeros((_RING, width), dtype=torch.float32, device=ops.q.device)
        self.sets = [dataclasses.replace(ops, v_scale_max=self.ring[i, :n].view(shape)) for i in range(_RING)]
        self.next = 0

    @classmethod
    def of(cls, layout, device: Optional[int], cuda: bool) -> "_Workspace":
        """The kept workspace of ``layout`` on the current stream of ``device`` (CPU: one) and thread."""
        where = (layout, fast_launch.current_stream(device) if cuda else None, threading.get_ident())
        kept = _WORKSPACES.get(where)
        if kept is None:
            if len(_WORKSPACES) >= _MAX_WORKSPACES:
                _WORKSPACES.clear()
            made: list = []
            if cuda:   # kept across calls: never from a cudagraph tree's pool (placeholder.py)
                outside_graph_pools(lambda: (made.append(cls(layout)), made[0].ring)[1])
            kept = _WORKSPACES[where] = made[0] if made else cls(layout)
        return kept

    def take(self) -> tuple[FP8Operands, Optional[Tensor]]:
        """This call's operands (v_scale_max a zeroed slot no call since the last reset has used)
        and smooth_k's partial sums."""
        i = self.next
        if i == _RING:
            self.ring.zero_()   # after the calls that read the slots: same stream, issue order
            i = 0
        self.next = i + 1
        return self.sets[i], self.k_part


def _capturing(q: Tensor) -> bool:
    """Whether ``q``'s stream is being captured into a CUDA graph (the replays' kept operands and
    their per-call slot would be baked into the graph: the full path runs instead)."""
    return q.is_cuda and torch.cuda.is_current_stream_capturing()


def _records_launches(q: Tensor) -> bool:
    """Whether launches on ``q``'s device are recorded (runtime/fast_launch.py: CUDA); the CPU host
    emulation (benchmarks/fp8_compiled_host_cpu.py) replaces it."""
    return q.is_cuda


def compiled_call(q: Tensor, k: Tensor, v: Tensor, rope: Optional[RopeSpec], tables: tuple,
                  score_bufs: Sequence[Tensor], mask_bufs: Sequence[Tensor], scale: float,
                  sparse_q_block: int, sparse_kv_block: int, spec: str, recipe: str
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """The compiled ops' body: (out, lse_log2, max_log2) of FP8 attention (:func:`fp8_call`, then
    :func:`serve_fp8`). On CUDA a call whose key (``spec``, ``recipe``, RoPE's style, the scale and
    block sizes, the float32 matmul precision, the interpreter flag, and the shapes, strides, dtypes,
    devices, 16-byte alignment and aliasing of every tensor argument) was served before replays it
    (:class:`_BoundOp`): the prologue's kept operands (:meth:`_BoundOp.operands`: a zeroed
    v_scale_max slot, no fill, no ``finish``) and its recorded launches, the outputs, the recorded
    attention launch, smooth_k's LSE correction: two launches a call (the full path's four: fill,
    prologue, abs, attention), plus one ``zero_`` every _RING calls. Not while the stream is captured. Everything the full path
    derives beyond the tensors' addresses is fixed by that key: the prologue layout (whose key reads
    the same signatures), the outputs' layouts (fresh allocations, aligned), and the attention launch
    key (runtime.ops.serve_key: those operands' and the tables' and buffers' signatures). It skips the
    layout and launch-key lookups, the Call, ``SiteSpec.from_json`` and the per-launch key hashing,
    and the six allocations of the operands: 72-84 -> 36 µs a call on this repo's CPU emulation (32
    without the fill and the abs), bf16's flex_fwd 22 (docs/design/fp8_prologue.md, "Host cost of
    the compiled op").

    Example::

        >>> out, lse, _ = compiled_call(q, k, v, None, (None,) * 4, [], [], 0.125, 1 << 30, 1 << 30,
        ...                             spec, recipe_text(FP8Recipe()))   # doctest: +SKIP
    """
    key = None
    if _records_launches(q):
        tensors = (q, k, v, *tables, *score_bufs, *mask_bufs)
        if rope is not None:
            tensors += (rope.cos, rope.sin, rope.q_positions, rope.k_positions)
        key = (spec, recipe, None if rope is None else rope.style, scale, sparse_q_block, sparse_kv_block,
               len(score_bufs), torch.get_float32_matmul_precision(), _interpreting(),
               tensor_signature(tensors), aliasing(tensors))
        bound = _BOUND.get(key)
        if bound is not None and not _capturing(q):
            _STATS["replayed"] += 1
            return bound(q, k, v, rope, (*tables, *score_bufs, *mask_bufs))
    _STATS["full"] += 1
    call = fp8_call(q, k, v, tables, score_bufs, mask_bufs, scale, sparse_q_block, sparse_kv_block,
                    recipe_of(recipe), rope)
    serve_fp8(spec, call)
    if key is not None:
        bound = _BoundOp.of(q, k, v, rope, spec, call)
        if bound is not None:
            if len(_BOUND) >= _MAX_BOUND:
                _BOUND.clear()
            _BOUND[key] = bound
            _STATS["bound"] += 1
    return call.out, call.lse, call.max_scores


class _BoundOp:
    """One compiled-op signature's replay (:func:`compiled_call`): its prologue layout and recorded
    launches, the attention launch's re-launcher and tag, and what the outputs' allocation needs.
    It holds none of the first call's tensors."""

    __slots__ = ("layout", "prologue", "fire", "tag", "plain", "lse_shape", "scale", "device")

    @classmethod
    def of(cls, q: Tensor, k: Tensor, v: Tensor, rope: Optional[RopeSpec], spec: str,
           call: Call) -> Optional["_BoundOp"]:
        """After :func:`serve_fp8` served ``call`` (made by :func:`fp8_call` from these arguments):
        its replay, or None where a launch was not kept (then every call takes the full path)."""
        from .ops import _out_is_empty_like_q, replayer, serve_key

        found = replayer(serve_key(spec, call)[0])
        if found is None:
            return None
        layout = layout_of(q, k, v, call.fp8.recipe, rope)   # found: fp8_call's quantize() just used it
        prologue = layout.recorded_launches()
        if prologue is None:
            return None
        bound = cls()
        bound.layout, bound.prologue, (bound.fire, bound.tag) = layout, prologue, found
        bound.plain = _out_is_empty_like_q(q, v, call.out)
        bound.lse_shape, bound.scale = tuple(call.lse.shape), call.scale
        bound.device = q.device.index
        return bound

    def operands(self) -> tuple[FP8Operands, Optional[Tensor]]:
        """The prologue's operands (and smooth_k's partial sums) of this call: kept per (layout,
        stream, thread) and re-written by every call, v_scale_max a zeroed slot (:class:`_Workspace`).
        Safe to reuse because everything that touches them runs on that stream in issue order (this
        call's prologue and attention launches, smooth_k's LSE correction, then the next call's,
        whatever site it serves); the thread is in the key so that two threads sharing a stream never
        interleave their calls over one set. They never leave the op: it returns fresh out / lse /
        max. At most _MAX_WORKSPACES sets in all, cleared when full: a workload cycling through more
        signatures re-allocates rather than holds their operands."""
        return _Workspace.of(self.layout, self.device, True).take()

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, rope: Optional[RopeSpec], rest: tuple
                 ) -> tuple[Tensor, Tensor, Tensor]:
        from .ops import _out_like, record_template

        check_positions(q, k, rope)
        ops, k_part = self.operands()
        inputs = self.layout.inputs_of(ops, k_part, q, k, v, rope, recorded=True)
        for entry in self.prologue:
            relaunch(entry, inputs)
        out = torch.empty_like(q) if self.plain else _out_like(q, v)
        lse = q.new_empty(self.lse_shape, dtype=torch.float32)
        max_scores = torch.empty_like(lse)
        self.fire((ops.q, ops.k, ops.vt, out, lse, max_scores, *rest, ops.q_scale, ops.k_scale,
                   ops.v_scale, ops.v_scale_max))
        record_template(self.tag)
        smooth_lse(ops, lse, self.scale)
        return out, lse, max_scores


def serve_fp8(spec: str, call: Call) -> None:
    """Compute ``call`` (the site's families, runtime.ops.serve), record the template, and put back
    into the LSE what K smoothing took out of it.

    ``smooth_k`` subtracts one vector mu from every key of a head, which shifts each query row's
    scores by the constant ``scale * q.mu``: softmax, and so the output, ignores it, the LSE does
    not. The shift is added back from the prologue's own operands (the dequantized rotated q, as
    the kernel's scores use it; rotation keeps dot products), in log2 units as ``call.lse`` holds it.

    Example::

        >>> serve_fp8(spec, fp8_call(q, k, v, (None,) * 4, [], [], 0.125, 1 << 30, 1 << 30,
        ...                          FP8Recipe(smooth_k=True)))        # doctest: +SKIP
    """
    from .ops import record_template, serve

    record_template(serve(SiteSpec.from_json(spec), call, spec))
    if call.fp8 is not None:
        smooth_lse(call.fp8, call.lse, call.scale)


def smooth_lse(ops: FP8Operands, lse: Tensor, scale: float) -> None:
    """Add back into ``lse`` (log2 units, [B, Hq, M]) the shift ``scale * q.mu`` that ``smooth_k``
    took out of every score of a row (:func:`serve_fp8`); nothing without smoothing.

    Example::

        >>> smooth_lse(call.fp8, call.lse, call.scale)   # doctest: +SKIP
    """
    if ops.k_mean is None:
        return
    B, Hq, M, _ = ops.q.shape
    mu = ops.k_mean.expand(B, -1, -1).repeat_interleave(Hq // ops.k_mean.shape[1], dim=1)
    block = ops.recipe.block_m or M
    row_scale = ops.q_scale.repeat_interleave(block, dim=-1)[..., :M]
    q_dot_mu = torch.matmul(ops.q.to(torch.float32), mu.unsqueeze(-1)).squeeze(-1)
    lse.add_(q_dot_mu * row_scale * (scale * _LOG2E))


def bound_fp8_launch(spec: str, call: Call) -> Optional[Callable[[FP8Operands, Tensor, Tensor, Tensor], object]]:
    """After :func:`serve_fp8` served ``call`` on CUDA: ``fire(ops, out, lse, max_scores)``, which
    launches the same attention kernel on a later call's prologue operands and outputs (the same
    shapes, strides, dtypes and alignment: the same layout's) with the block-mask tables and captured
    buffers fixed, and returns the family's name; None if the launch was not kept (not CUDA, or a
    launch fast_launch could not record).

    Example::

        >>> fire = bound_fp8_launch(spec, call); fire(ops, out, lse, row_max)   # doctest: +SKIP
        'hopper_fp8'
    """
    if not call.q.is_cuda:
        return None
    from .ops import replayer, serve_key

    found = replayer(serve_key(spec, call)[0])
    return None if found is None else _fire_with(*found, call)


def _fire_with(go: Callable[[tuple], object], tag: object, call: Call
               ) -> Callable[[FP8Operands, Tensor, Tensor, Tensor], object]:
    """bound_fp8_launch's function around ``go`` (inputs in runtime.ops.serve_inputs' order)."""
    rest = (*call.tables, *call.score_bufs, *call.mask_bufs)

    def fire(ops: FP8Operands, out: Tensor, lse: Tensor, max_scores: Tensor) -> object:
        go((ops.q, ops.k, ops.vt, out, lse, max_scores, *rest, ops.q_scale, ops.k_scale, ops.v_scale,
            ops.v_scale_max))
        return tag

    return fire


def bound_fp8_call(q: Tensor, k: Tensor, v: Tensor, rope: Optional[RopeSpec], spec: str, call: Call
                   ) -> Optional[Callable[..., tuple[Tensor, Optional[Tensor]]]]:
    """After :func:`serve_fp8` served ``call`` (made by :func:`fp8_call` from ``q, k, v, rope``): a
    function ``launch(q, k, v, rope, want_lse)`` that computes the same for new inputs of the same
    signature (q, k, v and RoPE's tensors: shapes, strides, dtypes, alignment, which are one tensor),
    returning ``(out, lse in log2 units or None)``: the prologue re-run over kept operands
    (:class:`_Workspace`: no allocation, fill or ``finish``; under a stream capture its layout's
    operands allocated and finished per call) and the attention launch (:func:`bound_fp8_launch`),
    then smooth_k's LSE correction when the LSE is wanted. None if the attention launch was not
    kept. It skips planning, the checks, the Call and the launch key: flex()'s FP8 call memo
    (direct_fp8.py) calls it once it knows nothing else changed. The row max, and the LSE unless
    asked for, go to scratch buffers kept by the function; it holds none of ``call``'s tensors.

    Example::

        >>> launch = bound_fp8_call(q, k, v, None, spec, call)   # doctest: +SKIP
        >>> out, _ = launch(q2, k2, v2, None, False)             # doctest: +SKIP
    """
    from .ops import _out_is_empty_like_q, _out_like, record_template

    fire = bound_fp8_launch(spec, call)
    if fire is None:
        return None
    layout = layout_of(q, k, v, call.fp8.recipe, rope)   # found: fp8_call's quantize() just used it
    scratch_lse, row_max = torch.empty_like(call.lse), torch.empty_like(call.max_scores)
    scale = call.scale
    device, cuda = q.device.index, q.is_cuda
    plain = _out_is_empty_like_q(q, v, call.out)
    del call   # none of its tensors stay with the function

    def launch(q: Tensor, k: Tensor, v: Tensor, rope: Optional[RopeSpec], want_lse: bool
               ) -> tuple[Tensor, Optional[Tensor]]:
        check_positions(q, k, rope)
        if _capturing(q):
            ops, inputs = layout.bind(q, k, v, rope)
            layout.launch(inputs, ops)
            finish(ops)
        else:   # the kept operands (_Workspace): no allocation, no fill, no abs
            ops, k_part = _Workspace.of(layout, device, cuda).take()
            inputs = layout.inputs_of(ops, k_part, q, k, v, rope)
            layout.launch(inputs, ops)
        out = torch.empty_like(q) if plain else _out_like(q, v)
        lse = torch.empty_like(scratch_lse) if want_lse else scratch_lse
        record_template(fire(ops, out, lse, row_max))
        if want_lse:
            smooth_lse(ops, lse, scale)
            return out, lse
        return out, None

    return launch


def fp8_call(q: Tensor, k: Tensor, v: Tensor, tables: tuple, score_bufs: Sequence[Tensor],
             mask_bufs: Sequence[Tensor], scale: float, sparse_q_block: int, sparse_kv_block: int,
             recipe: FP8Recipe, rope: Optional[RopeSpec] = None) -> Call:
    """One FP8 call ready for ``runtime.ops.serve``: the prologue run on q, k, v (``call.fp8``), the
    outputs allocated as ``flex_fwd``'s (the output in q's stride order; the row max is not computed:
    FP8 sites are planned with needs_max=False).

    Example::

        >>> call = fp8_call(q, k, v, (None,) * 4, [], [], 0.125, 1 << 30, 1 << 30, FP8Recipe())  # doctest: +SKIP
    """
    from .ops import _out_like

    Z, H, M, _ = q.shape
    ops = quantize(q, k, v, recipe, rope)
    lse = q.new_empty((Z, H, M), dtype=torch.float32)
    return Call(ops.q, ops.k, ops.vt, _out_like(q, v), lse, torch.empty_like(lse), tables,
                tuple(score_bufs), tuple(mask_bufs), float(scale), sparse_q_block, sparse_kv_block,
                needs_max=False, fp8=ops)


_LIB.define(
    "flex_fwd_fp8_rope(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, str rope_style, "
    "Tensor? kv_num_blocks, Tensor? kv_indices, Tensor? full_kv_num_blocks, "
    "Tensor? full_kv_indices, Tensor[] score_bufs, Tensor[] mask_bufs, float scale, "
    "int sparse_q_block, int sparse_kv_block, str spec, str recipe) -> (Tensor, Tensor, Tensor)")


def flex_fwd_fp8_rope(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, rope_style: str,
                      kv_num_blocks: Optional[Tensor], kv_indices: Optional[Tensor],
                      full_kv_num_blocks: Optional[Tensor], full_kv_indices: Optional[Tensor],
                      score_bufs: list[Tensor], mask_bufs: list[Tensor], scale: float,
                      sparse_q_block: int, sparse_kv_block: int, spec: str,
                      recipe: str) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`flex_fwd_fp8` on q and k *before* RoPE: the prologue rotates them by ``cos`` /
    ``sin`` (RopeSpec's convention: [S, R] or [B, S, R], row i for token i of q and of k, the
    first R channels rotated; ``rope_style`` "half" or "interleaved") before the Hadamard rotation
    and the quantization. RoPE is applied whatever family serves the call: every family reads the
    prologue's (rotated) operands. Captured buffers are made contiguous (the plan bakes in
    contiguous strides, as the lowering's ``require_contiguous`` does for ``flex_fwd_fp8``).
    Any tables are applied exactly as the model applies them (the prologue reads both table columns
    of each rotated pair): no check of the tables, no device sync.

    Example::

        >>> out, lse, _ = torch.ops.fa3_inductor.flex_fwd_fp8_rope(q, k, v, cos, sin, "half",
        ...     None, None, None, None, [], [], 0.125, 1 << 30, 1 << 30, spec,
        ...     recipe_text(FP8Recipe()))                                  # doctest: +SKIP
    """
    return compiled_call(q, k, v, RopeSpec(cos, sin, rope_style),
                         (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices),
                         [b.contiguous() for b in score_bufs], [b.contiguous() for b in mask_bufs],
                         scale, sparse_q_block, sparse_kv_block, spec, recipe)


_LIB.impl("flex_fwd_fp8", flex_fwd_fp8, "CUDA")
_LIB.impl("flex_fwd_fp8", flex_fwd_fp8, "CPU")


@torch.library.register_fake("fa3_inductor::flex_fwd_fp8", lib=_LIB)
def _flex_fwd_fp8_fake(q, k, v, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                       score_bufs, mask_bufs, scale, sparse_q_block, sparse_kv_block, spec, recipe):
    from .ops import _out_like

    Z, H, M, _ = q.shape
    return (_out_like(q, v), q.new_empty((Z, H, M), dtype=torch.float32),
            q.new_empty((Z, H, M), dtype=torch.float32))


_LIB.impl("flex_fwd_fp8_rope", flex_fwd_fp8_rope, "CUDA")
_LIB.impl("flex_fwd_fp8_rope", flex_fwd_fp8_rope, "CPU")


@torch.library.register_fake("fa3_inductor::flex_fwd_fp8_rope", lib=_LIB)
def _flex_fwd_fp8_rope_fake(q, k, v, cos, sin, rope_style, kv_num_blocks, kv_indices,
                            full_kv_num_blocks, full_kv_indices, score_bufs, mask_bufs, scale,
                            sparse_q_block, sparse_kv_block, spec, recipe):
    # RoPE keeps q's shape: the outputs are flex_fwd_fp8's
    return _flex_fwd_fp8_fake(q, k, v, kv_num_blocks, kv_indices, full_kv_num_blocks,
                              full_kv_indices, score_bufs, mask_bufs, scale, sparse_q_block,
                              sparse_kv_block, spec, recipe)
