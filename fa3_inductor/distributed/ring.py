"""Ring attention on our kernels: each rank keeps its queries, K/V shards travel around the ring.

Notation: n ranks, rank r; q (B, H, S, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv) are r's shards of
a sequence of T = n S tokens laid out by a :class:`~.layout.SeqLayout`. Step s (0 ≤ s < n) works
on the K/V shard of rank (r - s) mod n.

Forward: before step s computes, the shard it holds is already on its way to r + 1 and the next
one is coming from r - 1 (one ``batch_isend_irecv``), so the transfer overlaps the attention.
Partial (out, lse) pairs merge in float32 (merge.py). Shards the mask hides are skipped.

Backward, FlashAttention's ring backward: the K/V shards travel the ring again, and each step
calls the backward kernels for (local q, the visiting shard) with the GLOBAL merged output O, LSE
L, dO and dL (shard_attention_backward): P = exp(S - L) is already globally normalised, so the
step's gradients are exactly that shard's share of dq and its dk, dv, and no step's forward runs
again. dq accumulates locally; each K/V shard's dk/dv accumulator (float32) travels with it,
picking up every rank's contribution, and takes one last hop home after step n - 1.

``method="allgather"``: all-gather K/V once (back in global order) and run one attention of the
local queries against the whole sequence; its backward gathers K/V again, runs the same
no-forward backward against the whole sequence and reduce-scatters dk/dv. It sends (n - 1) S
K/V rows per rank like the ring but in one collective, and GQA's smaller K/V make it cheap: the
right choice for short rings. Its memory holds the whole K/V.

FP8 (``fp8=True`` or an ``FP8Recipe``; inference only): every step's shard attention is
``fa3_inductor.flex(..., fp8=recipe, return_lse=True)`` with the step's position-composed mods and
block mask, so the FP8 prologue quantizes (q, visiting K/V shard) per step and the LSE merge is
the bf16 ring's. Per-shard quantization is exact in form: the Hadamard rotation is one fixed
matrix (the recipe's seed) on every rank, and the block scales belong to the blocks of the tensors
each call is given. ``smooth_k`` subtracts each shard's own K mean mu_j: the shard's scores shift
by scale·q·mu_j, a different constant per shard, which the output o_j ignores but its LSE l_j
carries; the FP8 path adds scale·q·mu_j back to l_j (runtime/ops_fp8.serve_fp8), so every l_j is
the LSE of the unshifted scores and the merge weights exp(l_j - L) are those of one softmax over
the whole row. ``rope`` (a RopeSpec over the WHOLE sequence) is applied by each step's prologue at
the shard's global positions (the layout's map; the spec's own positions, if given, are indexed
by global position).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from ..fp8_recipe import FP8Recipe, RopeSpec
from ..runtime import cp_state
from .layout import SeqLayout
from .merge import Merger
from .shard_attention import ShardMods, shard_attention, shard_attention_backward

_METHODS = ("ring", "allgather")
_KERNELS = ("auto", "fa3", "dense")
_MAX_OFFSETS = 256
_OFFSETS: collections.OrderedDict = collections.OrderedDict()
_STATS = {"computed": 0, "skipped": 0}
_POSITIONS: collections.OrderedDict = collections.OrderedDict()


def stats() -> dict[str, int]:
    """How many (query shard, K/V shard) steps this process computed and how many it skipped
    because the mask hides the whole shard (forward and backward steps alike).

    Example::

        >>> stats()["skipped"] >= 0
        True
    """
    return dict(_STATS)


@dataclasses.dataclass(frozen=True)
class _RingCall:
    """Everything a ring call fixes: communication, layout, mods and kernel options."""

    group: object
    rank: int
    world: int
    layout: SeqLayout
    total_q: int
    total_kv: int
    score_mod: Optional[Callable]
    mask_mod: Optional[Callable]
    scale: float
    enable_gqa: bool
    kernel: str
    method: str = "ring"
    fp8: Optional[FP8Recipe] = None
    rope: Optional[RopeSpec] = None

    def mods(self, source: Optional[int], device: torch.device) -> ShardMods:
        """The mods of this rank's queries against rank ``source``'s K/V shard (None: the whole
        sequence in global order, the all-gather variant)."""
        qa, qb, cq = self.layout.affine(self.rank, self.total_q)
        ka, kb, ckv = (0, 0, self.total_kv) if source is None else \
            self.layout.affine(source, self.total_kv)
        return ShardMods(self.score_mod, self.mask_mod, _offsets((qa, qb, ka, kb), device), cq, ckv)

    def shard_rope(self, source: Optional[int], device: torch.device) -> Optional[RopeSpec]:
        """The RopeSpec of this rank's queries against rank ``source``'s K/V shard (None: the
        whole sequence in global order): table rows at the shards' global positions, or the
        spec's own positions (over the whole sequence) read at them."""
        if self.rope is None:
            return None
        rope = self.rope
        qpos = _positions(self.layout, self.rank, self.total_q, device)
        qpos = qpos if rope.q_positions is None else rope.q_positions.index_select(-1, qpos)
        if source is None:   # K/V gathered in global order: row i is position i
            kpos = rope.k_positions
        else:
            kpos = _positions(self.layout, source, self.total_kv, device)
            kpos = kpos if rope.k_positions is None else rope.k_positions.index_select(-1, kpos)
        return RopeSpec(rope.cos, rope.sin, rope.style, qpos, kpos)


def _offsets(values: tuple, device: torch.device) -> Tensor:
    """One int32 tensor per distinct offsets: mods capturing the same object key alike, so plans,
    compiled kernels and block masks are reused across calls (mod_keys.py keys tensors by id)."""
    key = (values, device)
    hit = _OFFSETS.get(key)
    if hit is None:
        hit = _OFFSETS[key] = torch.tensor(values, dtype=torch.int32, device=device)
        if len(_OFFSETS) > _MAX_OFFSETS:
            _OFFSETS.popitem(last=False)
    return hit


def _positions(layout: SeqLayout, rank: int, total: int, device: torch.device) -> Tensor:
    """``layout.positions`` on ``device``, kept per (layout, rank, total, device) (RoPE rows)."""
    key = (layout, rank, total, device)
    hit = _POSITIONS.get(key)
    if hit is None:
        hit = _POSITIONS[key] = layout.positions(rank, total, device)
        if len(_POSITIONS) > _MAX_OFFSETS:
            _POSITIONS.popitem(last=False)
    return hit


class _Neighbours:
    """Point-to-point shifts around the ring: send to r + 1, receive from r - 1."""

    def __init__(self, group, rank: int, world: int) -> None:
        self.group = group
        self.next = dist.get_global_rank(group, (rank + 1) % world)
        self.prev = dist.get_global_rank(group, (rank - 1) % world)

    def shift(self, tensors: tuple[Tensor, ...]) -> "_Pending":
        received = tuple(torch.empty_like(t) for t in tensors)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        return _Pending(dist.batch_isend_irecv(ops), received)


class _Pending:
    def __init__(self, works: list, received: tuple) -> None:
        self.works, self.received = works, received

    def wait(self) -> tuple[Tensor, ...]:
        for work in self.works:
            work.wait()
        return self.received


def _ring_forward(call: _RingCall, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    merger = Merger()
    ring = _Neighbours(call.group, call.rank, call.world) if call.world > 1 else None
    kv = (k.contiguous(), v.contiguous())
    for step in range(call.world):
        pending = ring.shift(kv) if step < call.world - 1 else None   # overlaps this step
        source = (call.rank - step) % call.world
        part = shard_attention(q, *kv, call.mods(source, q.device), call.scale, call.enable_gqa,
                               call.kernel, fp8=call.fp8, rope=call.shard_rope(source, q.device))
        _STATS["skipped" if part is None else "computed"] += 1
        if part is not None:
            merger.add(*part)
        if pending is not None:
            kv = pending.wait()
    return merger.result(q.dtype, q.new_empty((*q.shape[:3], v.shape[-1])), q.shape[:3])


def _ring_backward(call: _RingCall, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   dout: Tensor, dlse: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=work, device=q.device)
    ring = _Neighbours(call.group, call.rank, call.world) if call.world > 1 else None
    kv = (k.contiguous(), v.contiguous())
    pending_kv = pending_acc = None
    for step in range(call.world):
        if step < call.world - 1:
            pending_kv = ring.shift(kv)
        source = (call.rank - step) % call.world
        grads = shard_attention_backward(q, *kv, out, lse, dout, dlse, call.mods(source, q.device),
                                         call.scale, call.kernel)
        _STATS["skipped" if grads is None else "computed"] += 1
        if grads is None:
            gk = torch.zeros(k.shape, dtype=work, device=k.device)
            gv = torch.zeros(v.shape, dtype=work, device=v.device)
        else:
            dq += grads[0]
            gk, gv = grads[1].to(work), grads[2].to(work)
        if pending_acc is not None:   # this shard's accumulator, from the rank that held it last
            acc_k, acc_v = pending_acc.wait()
            gk, gv = acc_k + gk, acc_v + gv
        if ring is None:
            return dq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype)
        pending_acc = ring.shift((gk.contiguous(), gv.contiguous()))   # the last shift goes home
        if step < call.world - 1:
            kv = pending_kv.wait()
    dk, dv = pending_acc.wait()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _gather(x: Tensor, call: _RingCall, total: int) -> Tensor:
    """All-gather a (B, H, S, D) shard along the sequence into global order."""
    parts = [torch.empty_like(x) for _ in range(call.world)]
    dist.all_gather(parts, x.contiguous(), group=call.group)
    order = call.layout.order(total, x.device)
    return torch.cat(parts, dim=2).index_select(2, torch.argsort(order))


def _sum_to_shards(grad: Tensor, call: _RingCall, total: int) -> Tensor:
    """Sum every rank's gradient of the gathered sequence and hand each rank its shard
    (reduce-scatter; all-reduce on gloo, which has no reduce-scatter)."""
    per_rank = grad.index_select(2, call.layout.order(total, grad.device)).contiguous()
    local = per_rank.shape[2] // call.world
    if dist.get_backend(call.group) == "gloo":
        dist.all_reduce(per_rank, group=call.group)
        return per_rank.narrow(2, call.rank * local, local).contiguous()
    out = torch.empty_like(per_rank.narrow(2, 0, local))
    chunks = [c.contiguous() for c in per_rank.split(local, dim=2)]
    dist.reduce_scatter(out, chunks, group=call.group)
    return out


def _allgather_forward(call: _RingCall, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    k_all, v_all = _gather(k, call, call.total_kv), _gather(v, call, call.total_kv)
    part = shard_attention(q, k_all, v_all, call.mods(None, q.device), call.scale,
                           call.enable_gqa, call.kernel, fp8=call.fp8,
                           rope=call.shard_rope(None, q.device))
    if part is None:   # every row hidden
        return (q.new_zeros((*q.shape[:3], v.shape[-1])),
                torch.full(q.shape[:3], float("-inf"), device=q.device))
    return part


def _allgather_backward(call: _RingCall, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                        lse: Tensor, dout: Tensor, dlse: Optional[Tensor]
                        ) -> tuple[Tensor, Tensor, Tensor]:
    # K/V gathered again rather than kept from the forward: the whole sequence's K/V would
    # otherwise stay in memory from every layer's forward to its backward
    k_all, v_all = _gather(k, call, call.total_kv), _gather(v, call, call.total_kv)
    grads = shard_attention_backward(q, k_all, v_all, out, lse, dout, dlse,
                                     call.mods(None, q.device), call.scale, call.kernel)
    if grads is None:   # every row hidden; the reduce-scatters still run: they are collective
        grads = (torch.zeros_like(q), torch.zeros_like(k_all), torch.zeros_like(v_all))
    dq, dk_all, dv_all = grads
    dk = _sum_to_shards(dk_all, call, call.total_kv)
    dv = _sum_to_shards(dv_all, call, call.total_kv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _Attention(torch.autograd.Function):
    """Ring or all-gather attention; its backward runs no forward (module docstring)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, call: _RingCall):
        out, lse = attention_forward(call, q, k, v)
        ctx.set_materialize_grads(False)   # an LSE outside the loss sends no dL term
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        return out, lse

    @staticmethod
    def backward(ctx, dout: Optional[Tensor], dlse: Optional[Tensor]):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = attention_backward(ctx.call, q, k, v, out, lse, dout, dlse)
        return dq, dk, dv, None


def _default_kernel(q: Tensor) -> str:
    from ..api import _runs_our_kernels

    return "fa3" if _runs_our_kernels(q) else "dense"


@torch.compiler.disable   # collectives and a custom autograd: runs eagerly between compiled graphs
def ring_flex(q: Tensor, k: Tensor, v: Tensor, score_mod: Optional[Callable] = None,
              mask_mod: Optional[Callable] = None, *, group=None, layout: Optional[SeqLayout] = None,
              scale: Optional[float] = None, enable_gqa: bool = False, return_lse: bool = False,
              method: str = "ring", kernel: str = "auto",
              fp8: Union[bool, FP8Recipe, None] = None, rope: Optional[RopeSpec] = None
              ) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Context-parallel attention: this rank's shards of q, k, v in, this rank's output shard out.

    ``q`` (B, H, S, D), ``k`` (B, Hkv, S_kv, D), ``v`` (B, Hkv, S_kv, Dv) hold the positions
    ``layout`` gives this rank (default: head-tail over ``group``'s ranks, torch's causal load
    balancing; shard full tensors with ``layout.shard``). Mods follow FlexAttention's conventions
    and see GLOBAL positions. ``method``: "ring" (K/V rotate, transfers overlapped) or "allgather"
    (one all-gather of K/V). ``kernel``: "fa3" (``fa3_inductor.flex``), "dense" (torch ops) or
    "auto" (fa3 where our kernels run: CUDA, or the CPU under TRITON_INTERPRET=1). Gradients flow
    to q, k, v (not to tensors the mods capture).

    ``fp8=True`` (or an :class:`~fa3_inductor.FP8Recipe`): FP8 attention for inference, each
    step's shard through ``fa3_inductor.flex(..., fp8=)`` (docs/fp8.md), the LSE merge unchanged;
    ``smooth_k`` is exact (each shard's LSE gets its own shift back: module docstring). Inputs
    that need gradients raise, as flex(fp8=) does. ``rope`` (a :class:`~fa3_inductor.RopeSpec`,
    with ``fp8``): q and k given before RoPE, rotated in each step's prologue at their GLOBAL
    positions; its tables cover the whole sequence (rows 0 .. T-1, or the rows its
    ``q_positions`` / ``k_positions`` name: those are [T] or [B, T] over the whole sequence in
    global order, and each shard reads its entries).

    Example::

        >>> lay = SeqLayout(dist.get_world_size())                       # doctest: +SKIP
        >>> q, k, v = (lay.shard(t, 2, dist.get_rank()) for t in (q_full, k_full, v_full))   # doctest: +SKIP
        >>> out = ring_flex(q, k, v, mask_mod=mods.causal, layout=lay)   # this rank's rows   # doctest: +SKIP
        >>> full = lay.unshard(all_gathered_outs, 2)                     # doctest: +SKIP
        >>> with torch.no_grad():                             # FP8, inference  # doctest: +SKIP
        ...     out = ring_flex(q, k, v, mask_mod=mods.causal, layout=lay, fp8=True)
    """
    call = ring_call(q, k, v, score_mod, mask_mod, group=group, layout=layout, scale=scale,
                     enable_gqa=enable_gqa, method=method, kernel=kernel, fp8=fp8, rope=rope)
    if call.fp8 is not None:   # inference only (ring_call refused gradients): no autograd node
        out, lse = attention_forward(call, q, k, v)
    else:
        out, lse = _Attention.apply(q, k, v, call)
    return (out, lse) if return_lse else out


def ring_call(q: Tensor, k: Tensor, v: Tensor, score_mod: Optional[Callable] = None,
              mask_mod: Optional[Callable] = None, *, group=None,
              layout: Optional[SeqLayout] = None, scale: Optional[float] = None,
              enable_gqa: bool = False, method: str = "ring", kernel: str = "auto",
              fp8: Union[bool, FP8Recipe, None] = None, rope: Optional[RopeSpec] = None
              ) -> _RingCall:
    """Everything one :func:`ring_flex` call fixes, checked (its arguments' meaning): what
    :func:`attention_forward` and :func:`attention_backward` take. For callers that keep the
    forward and the backward apart themselves (the ring sites of compiled graphs: graph_sites.py).

    Example::

        >>> call = ring_call(q, k, v, mask_mod=mods.causal)           # doctest: +SKIP
        >>> out, lse = attention_forward(call, q, k, v)               # doctest: +SKIP
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_flex: torch.distributed is not initialized; call "
                           "dist.init_process_group (nccl on GPUs, gloo on CPUs) first")
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = layout if layout is not None else SeqLayout(world)
    if layout.world != world:
        raise ValueError(f"ring_flex: layout is for {layout.world} ranks, the group has {world}; "
                         f"pass SeqLayout({world}, ...)")
    if method not in _METHODS:
        raise ValueError(f"ring_flex: method must be one of {_METHODS}, got {method!r}")
    if kernel not in _KERNELS:
        raise ValueError(f"ring_flex: kernel must be one of {_KERNELS}, got {kernel!r}")
    _check_shapes(q, k, v, enable_gqa)
    layout.check_length(q.shape[2] * world)
    layout.check_length(k.shape[2] * world)
    resolved = _default_kernel(q) if kernel == "auto" else kernel
    recipe = FP8Recipe.of(fp8)
    if rope is not None and recipe is None:
        raise ValueError("ring_flex: rope= is applied by the FP8 prologue; pass fp8=True with it, "
                         "or apply RoPE to q and k yourself")
    if recipe is not None:
        check_fp8_inference(q, k, v, "fa3_inductor.distributed.ring_flex(fp8=...)")
        _check_fp8(q, score_mod, recipe, kernel, resolved)
        if rope is not None:
            _check_rope(rope, q.shape[2] * world, k.shape[2] * world)
    return _RingCall(group, rank, world, layout, q.shape[2] * world, k.shape[2] * world,
                     score_mod, mask_mod, scale if scale is not None else q.shape[-1] ** -0.5,
                     enable_gqa, resolved, method, recipe, rope)


def check_fp8_inference(q: Tensor, k: Tensor, v: Tensor, option: str) -> None:
    """Raise, naming ``option``, when FP8 attention is asked of inputs that need gradients (FP8
    is inference-only, as ``flex(fp8=)``).

    Example::

        >>> check_fp8_inference(q, k, v, "ring_flex(fp8=...)")   # doctest: +SKIP
    """
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise NotImplementedError(
            f"{option} is inference-only: backward through an FP8 forward is not supported. Call "
            "it under torch.no_grad() / torch.inference_mode() with inputs that need no gradient, "
            "or drop fp8= to train (the bf16/fp16 kernels have a backward)")


def _check_fp8(q: Tensor, score_mod: Optional[Callable], recipe: FP8Recipe, kernel: str,
               resolved: str) -> None:
    """What flex(fp8=) would refuse, refused before any rank communicates."""
    if kernel == "dense":
        raise ValueError("ring_flex(fp8=...): kernel='dense' has no FP8 form (FP8 runs on our "
                         "kernels); use kernel='auto' or 'fa3'")
    if resolved != "fa3":
        raise NotImplementedError(f"ring_flex(fp8=...): {q.device.type} tensors; FP8 runs on "
                                  "CUDA GPUs with e4m3 tensor cores (sm89+), or on the CPU under "
                                  "TRITON_INTERPRET=1")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"ring_flex(fp8=...): inputs must be bfloat16 or float16 (got {q.dtype}); "
                         "the prologue quantizes them to FP8")
    recipe.check_score_mod(score_mod, "ring_flex")


def _check_rope(rope: RopeSpec, total_q: int, total_kv: int) -> None:
    """A RopeSpec of the whole sequence: positions [T] / [B, T] in global order, or tables with
    a row per global position (the prologue checks the rest per step)."""
    if not isinstance(rope, RopeSpec):
        raise TypeError(f"ring_flex: rope must be an fa3_inductor RopeSpec, got "
                        f"{type(rope).__name__}")
    rows = rope.cos.shape[-2] if isinstance(rope.cos, Tensor) and rope.cos.dim() >= 2 else None
    for name, pos, total in (("q_positions", rope.q_positions, total_q),
                             ("k_positions", rope.k_positions, total_kv)):
        if pos is None:
            if rows is not None and rows < total:
                raise ValueError(
                    f"ring_flex(rope=...): the RoPE tables have {rows} rows, the whole sequence "
                    f"{total} tokens; ring_flex rotates each shard at its global positions, so the "
                    f"tables need a row per global position (or give RopeSpec.{name})")
            continue
        if not isinstance(pos, Tensor) or pos.dim() not in (1, 2) or pos.shape[-1] != total:
            shape = tuple(pos.shape) if isinstance(pos, Tensor) else type(pos).__name__
            raise ValueError(
                f"ring_flex(rope=...): RopeSpec.{name} must cover the whole sequence, [{total}] "
                f"or [B, {total}] in global order (each shard reads the entries of its global "
                f"positions), got {shape}; this rank's shard positions are not what it takes")


def attention_forward(call: _RingCall, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """(out, natural-log lse) of this rank's queries over the whole sequence, no autograd.

    Example::

        >>> out, lse = attention_forward(ring_call(q, k, v), q, k, v)   # doctest: +SKIP
    """
    forward = _allgather_forward if call.method == "allgather" else _ring_forward
    # suspended: the shards' own attention calls (flex(), SDPA / flex_attention patched by
    # context_parallel) attend within the shards they are given, not as ring sites again
    with torch.no_grad(), cp_state.suspended():
        return forward(call, q, k, v)


def attention_backward(call: _RingCall, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                       lse: Tensor, dout: Tensor, dlse: Optional[Tensor]
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's shards from the forward's ``out`` / ``lse`` and their incoming
    gradients (``dlse`` None: the LSE is not in the loss); runs no forward (module docstring).

    Example::

        >>> dq, dk, dv = attention_backward(call, q, k, v, out, lse, dout, None)   # doctest: +SKIP
    """
    if call.fp8 is not None:
        raise NotImplementedError("ring attention with fp8= is inference-only: no backward "
                                  "through an FP8 forward; drop fp8= to train")
    backward = _allgather_backward if call.method == "allgather" else _ring_backward
    with torch.no_grad(), cp_state.suspended():
        return backward(call, q, k, v, out, lse, dout, dlse)


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"ring_flex: {name} must be 4-D (batch, heads, seq shard, head_dim), "
                             f"got shape {tuple(t.shape)}")
    if k.shape[:3] != v.shape[:3] or k.shape[-1] != q.shape[-1] or k.shape[0] != q.shape[0]:
        raise ValueError(f"ring_flex: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "must share batch, k/v their heads and length, q/k their head dim")
    if q.shape[1] != k.shape[1] and not (enable_gqa and q.shape[1] % k.shape[1] == 0):
        raise ValueError(f"ring_flex: q has {q.shape[1]} heads, k/v {k.shape[1]}; pass "
                         "enable_gqa=True with q heads a multiple of k/v heads")
