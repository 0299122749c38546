"""Ring attention on our kernels: each rank keeps its queries, K/V shards travel around the ring.

Notation: n ranks, rank r; q (B, H, S, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv) are r's shards of
a sequence of T = n S tokens laid out by a :class:`~.layout.SeqLayout`. Step s (0 ≤ s < n) works
on the K/V shard of rank (r - s) mod n.

Forward: before step s computes, the shard it holds is already on its way to r + 1 and the next
one is coming from r - 1 (one ``batch_isend_irecv``), so the transfer overlaps the attention.
Partial (out, lse) pairs merge in float32 (merge.py). Shards the mask hides are skipped.

Backward (recomputing each step's attention): dq accumulates locally; each K/V shard's dk/dv
accumulator (float32) travels with it, picking up every rank's contribution, and takes one last
hop home after step n - 1. Each step's gradients are its attention's own for the weighted dO_j and
dl_j of merge.py, so any backward that differentiates (out, lse) serves: our backward families
through ``fa3_inductor.flex``'s autograd, or the dense kernel's autograd.

``method="allgather"``: all-gather K/V once (back in global order) and run one attention of the
local queries against the whole sequence; its backward reduce-scatters dk/dv. It sends (n - 1) S
K/V rows per rank like the ring but in one collective, and GQA's smaller K/V make it cheap: the
right choice for short rings. Its memory holds the whole K/V.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from .layout import SeqLayout
from .merge import Merger, part_grads
from .shard_attention import ShardMods, shard_attention

_METHODS = ("ring", "allgather")
_KERNELS = ("auto", "fa3", "dense")
_MAX_OFFSETS = 256
_OFFSETS: collections.OrderedDict = collections.OrderedDict()
_STATS = {"computed": 0, "skipped": 0}


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

    def mods(self, source: Optional[int], device: torch.device) -> ShardMods:
        """The mods of this rank's queries against rank ``source``'s K/V shard (None: the whole
        sequence in global order, the all-gather variant)."""
        qa, qb, cq = self.layout.affine(self.rank, self.total_q)
        ka, kb, ckv = (0, 0, self.total_kv) if source is None else \
            self.layout.affine(source, self.total_kv)
        return ShardMods(self.score_mod, self.mask_mod, _offsets((qa, qb, ka, kb), device), cq, ckv)


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
                               call.kernel)
        _STATS["skipped" if part is None else "computed"] += 1
        if part is not None:
            merger.add(*part)
        if pending is not None:
            kv = pending.wait()
    return merger.result(q.dtype, q.new_empty((*q.shape[:3], v.shape[-1])), q.shape[:3])


def _step_grads(call: _RingCall, q: Tensor, k: Tensor, v: Tensor, source: int, dout: Tensor,
                dlse: Optional[Tensor], lse: Tensor, delta: Tensor):
    """(dq, dk, dv) of one step (float32), or None when the mask hides the shard."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        part = shard_attention(*leaves, call.mods(source, q.device), call.scale, call.enable_gqa,
                               call.kernel)
        _STATS["skipped" if part is None else "computed"] += 1
        if part is None:
            return None
        out_part, lse_part = part
        d_out, d_lse = part_grads(dout, dlse, lse, out_part.detach(), lse_part.detach(), delta)
        grads = torch.autograd.grad((out_part, lse_part), leaves, (d_out, d_lse))
    return tuple(g.float() if g.dtype != torch.float64 else g for g in grads)


def _ring_backward(call: _RingCall, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   dout: Tensor, dlse: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    delta = (dout.to(work) * out.to(work)).sum(-1)
    lse = lse.to(work)
    dq = torch.zeros(q.shape, dtype=work, device=q.device)
    ring = _Neighbours(call.group, call.rank, call.world) if call.world > 1 else None
    kv = (k.contiguous(), v.contiguous())
    pending_kv = pending_acc = None
    for step in range(call.world):
        if step < call.world - 1:
            pending_kv = ring.shift(kv)
        source = (call.rank - step) % call.world
        grads = _step_grads(call, q, *kv, source, dout, dlse, lse, delta)
        if grads is None:
            gk = torch.zeros(k.shape, dtype=work, device=k.device)
            gv = torch.zeros(v.shape, dtype=work, device=v.device)
        else:
            dq += grads[0]
            gk, gv = grads[1], grads[2]
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


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, call: _RingCall):
        out, lse = _ring_forward(call, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, dlse: Optional[Tensor]):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.call, q, k, v, out, lse, dout, dlse)
        return dq, dk, dv, None


class _GatherSequence(torch.autograd.Function):
    """All-gather a (B, H, S, D) shard along the sequence into global order; backward sums each
    rank's gradient and hands every rank its shard (reduce-scatter; all-reduce on gloo)."""

    @staticmethod
    def forward(ctx, x: Tensor, call: _RingCall, total: int):
        parts = [torch.empty_like(x) for _ in range(call.world)]
        dist.all_gather(parts, x.contiguous(), group=call.group)
        order = call.layout.order(total, x.device)
        ctx.call, ctx.order = call, order
        return torch.cat(parts, dim=2).index_select(2, torch.argsort(order))

    @staticmethod
    def backward(ctx, grad: Tensor):
        call = ctx.call
        per_rank = grad.index_select(2, ctx.order).contiguous()
        local = per_rank.shape[2] // call.world
        if dist.get_backend(call.group) == "gloo":   # gloo has no reduce-scatter
            dist.all_reduce(per_rank, group=call.group)
            return per_rank.narrow(2, call.rank * local, local).contiguous(), None, None
        out = torch.empty_like(per_rank.narrow(2, 0, local))
        chunks = [c.contiguous() for c in per_rank.split(local, dim=2)]
        dist.reduce_scatter(out, chunks, group=call.group)
        return out, None, None


def _allgather_attention(call: _RingCall, q: Tensor, k: Tensor, v: Tensor
                         ) -> tuple[Tensor, Tensor]:
    k_all = _GatherSequence.apply(k, call, call.total_kv)
    v_all = _GatherSequence.apply(v, call, call.total_kv)
    part = shard_attention(q, k_all, v_all, call.mods(None, q.device), call.scale,
                           call.enable_gqa, call.kernel)
    if part is None:   # every row hidden: keep the gathers in the graph (their backward is collective)
        anchor = (k_all.sum() + v_all.sum()) * 0
        out = q.new_zeros((*q.shape[:3], v.shape[-1])) + anchor
        return out, torch.full(q.shape[:3], float("-inf"), device=q.device) + anchor.float()
    return part


def _default_kernel(q: Tensor) -> str:
    from ..api import _runs_our_kernels

    return "fa3" if _runs_our_kernels(q) else "dense"


@torch.compiler.disable   # collectives and a custom autograd: runs eagerly between compiled graphs
def ring_flex(q: Tensor, k: Tensor, v: Tensor, score_mod: Optional[Callable] = None,
              mask_mod: Optional[Callable] = None, *, group=None, layout: Optional[SeqLayout] = None,
              scale: Optional[float] = None, enable_gqa: bool = False, return_lse: bool = False,
              method: str = "ring", kernel: str = "auto") -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Context-parallel attention: this rank's shards of q, k, v in, this rank's output shard out.

    ``q`` (B, H, S, D), ``k`` (B, Hkv, S_kv, D), ``v`` (B, Hkv, S_kv, Dv) hold the positions
    ``layout`` gives this rank (default: head-tail over ``group``'s ranks, torch's causal load
    balancing; shard full tensors with ``layout.shard``). Mods follow FlexAttention's conventions
    and see GLOBAL positions. ``method``: "ring" (K/V rotate, transfers overlapped) or "allgather"
    (one all-gather of K/V). ``kernel``: "fa3" (``fa3_inductor.flex``), "dense" (torch ops) or
    "auto" (fa3 where our kernels run: CUDA, or the CPU under TRITON_INTERPRET=1). Gradients flow
    to q, k, v (not to tensors the mods capture).

    Example::

        >>> lay = SeqLayout(dist.get_world_size())                       # doctest: +SKIP
        >>> q, k, v = (lay.shard(t, 2, dist.get_rank()) for t in (q_full, k_full, v_full))
        >>> out = ring_flex(q, k, v, mask_mod=mods.causal, layout=lay)   # this rank's rows
        >>> full = lay.unshard(all_gathered_outs, 2)
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
    call = _RingCall(group, rank, world, layout, q.shape[2] * world, k.shape[2] * world,
                     score_mod, mask_mod, scale if scale is not None else q.shape[-1] ** -0.5,
                     enable_gqa, _default_kernel(q) if kernel == "auto" else kernel)
    if method == "allgather":
        out, lse = _allgather_attention(call, q, k, v)
    else:
        out, lse = _RingAttention.apply(q, k, v, call)
    return (out, lse) if return_lse else out


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
