"""Attention of a rank's queries against one K/V shard, with mods that see global positions.

Notation: q (B, H, M, D) local queries; k (B, Hkv, N, D), v (B, Hkv, N, Dv) one K/V shard; every
result is (out (B, H, M, Dv), lse (B, H, M) natural log, float32; float64 for float64 inputs). The shard's mods are the user's
mods composed with the layout's position map (layout.py: pos(i) = i + a below c, i + b above), so
``q_idx`` / ``kv_idx`` inside a mod are global positions on every rank and step. The offsets
(a, b) of q and k travel as one captured int32 tensor per (layout, rank, source shard): the
kernel's generated mods read them at run time, so one compiled kernel serves every step.

Two kernels compute a shard:
- ``fa3``: ``fa3_inductor.flex`` (our kernel families; the generic kernel under the CPU interpreter;
  with ``fp8``, its FP8 path: the prologue on (q, this K/V shard), then the FP8 families);
- ``dense``: float32 torch ops, for CPUs without the interpreter (torch's flex has no CPU backward)
  and as the reference the tests hold the ring to.

Backward (:func:`shard_attention_backward`) runs no forward: it takes the GLOBAL merged output O
and LSE L of the query rows, so P = exp(S - L) is already the globally normalised probability of
this shard's keys and dS = P (dO·Vᵀ - rowsum(dO·O) + dL) gives exactly this shard's share of dq and
its dk, dv. ``fa3`` calls our backward families directly (fa3_inductor/direct_bwd.py); where none
serves, and for ``dense``, float32 torch ops compute the same formula. Neither path recomputes a
softmax: the ``flex_bwd.families`` op's own last resort (the dense recompute) would normalise over
this shard's keys alone, so it is never used here.

A shard the mask hides entirely returns None: the ring skips its work (a causal ring's upper
triangle costs nothing), and the kernel skips the hidden tiles of the others through the block mask
(built in bounded memory and cached: fa3_inductor/block_masks.py).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Optional

import torch
from torch import Tensor

from .._log import warn_once
from ..block_masks import cached_block_mask
from ..fp8_recipe import FP8Recipe, RopeSpec

_MAX_EMPTY = 256
_EMPTY: collections.OrderedDict = collections.OrderedDict()   # id(block mask) -> (mask, is empty)


@dataclasses.dataclass(frozen=True)
class ShardMods:
    """The user's mods and the position maps of one (query shard, K/V shard) pair.

    ``offsets``: int32 tensor [q_a, q_b, kv_a, kv_b]; ``cq`` / ``ckv``: piece lengths.

    Example::

        >>> m = ShardMods(None, mods.causal, torch.tensor([0, 4, 2, 2], dtype=torch.int32), 2, 2)
        >>> m.positions(torch.device("cpu"))[0].tolist()   # doctest: +SKIP
    """

    score_mod: Optional[Callable]
    mask_mod: Optional[Callable]
    offsets: Tensor
    cq: int
    ckv: int

    def global_score_mod(self) -> Optional[Callable]:
        if self.score_mod is None:
            return None
        user, off, cq, ckv = self.score_mod, self.offsets, self.cq, self.ckv

        def score_mod(score, b, h, q_idx, kv_idx):
            return user(score, b, h, torch.where(q_idx < cq, q_idx + off[0], q_idx + off[1]),
                        torch.where(kv_idx < ckv, kv_idx + off[2], kv_idx + off[3]))
        return score_mod

    def global_mask_mod(self) -> Optional[Callable]:
        if self.mask_mod is None:
            return None
        user, off, cq, ckv = self.mask_mod, self.offsets, self.cq, self.ckv

        def mask_mod(b, h, q_idx, kv_idx):
            return user(b, h, torch.where(q_idx < cq, q_idx + off[0], q_idx + off[1]),
                        torch.where(kv_idx < ckv, kv_idx + off[2], kv_idx + off[3]))
        return mask_mod

    def positions(self, device: torch.device, m: int, n: int) -> tuple[Tensor, Tensor]:
        """Global positions (int64) of the m query rows and n key rows."""
        off = self.offsets.tolist()
        qi, ki = torch.arange(m, device=device), torch.arange(n, device=device)
        return (torch.where(qi < self.cq, qi + off[0], qi + off[1]),
                torch.where(ki < self.ckv, ki + off[2], ki + off[3]))


def shard_attention(q: Tensor, k: Tensor, v: Tensor, mods: ShardMods, scale: float,
                    enable_gqa: bool, kernel: str, *, fp8: Optional[FP8Recipe] = None,
                    rope: Optional[RopeSpec] = None) -> Optional[tuple[Tensor, Tensor]]:
    """(out, lse) of ``q`` against one K/V shard, differentiable in q, k, v; None when the mask
    hides the whole shard. ``fp8``: FP8 attention (``flex(fp8=)``, inference, ``fa3`` only), with
    ``rope`` applied in its prologue (positions already the shards' global ones: ring.py).

    Example::

        >>> out, lse = shard_attention(q, k, v, mods, 0.125, False, "dense")   # doctest: +SKIP
    """
    if kernel == "dense":
        if fp8 is not None or rope is not None:
            raise ValueError("shard attention: kernel 'dense' has no FP8 form")
        return _dense(q, k, v, mods, scale)
    block_mask = None
    mask_mod = mods.global_mask_mod()
    if mask_mod is not None:
        block_mask = cached_block_mask(mask_mod, q, k)
        if _hides_everything(block_mask):
            return None
    from ..api import flex

    return flex(q, k, v, score_mod=mods.global_score_mod(), block_mask=block_mask, scale=scale,
                enable_gqa=enable_gqa, return_lse=True, fp8=fp8, rope=rope)


def shard_attention_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             dout: Tensor, dlse: Optional[Tensor], mods: ShardMods, scale: float,
                             kernel: str) -> Optional[tuple[Tensor, Tensor, Tensor]]:
    """(dq, dk, dv) of this K/V shard's share of the whole row's attention, without a forward; None
    when the mask hides the whole shard.

    ``out`` / ``lse``: the merged (global) output and natural-log LSE of ``q``'s rows (module
    docstring); ``dout`` / ``dlse``: their incoming gradients (``dlse`` None: the LSE is not in the
    loss). dq is this shard's contribution; dk, dv are complete for the pair. Results come in
    float32 (float64 for float64 inputs), except from our families: the inputs' dtype.

    Example::

        >>> dq, dk, dv = shard_attention_backward(q, k, v, out, lse, dout, None, mods, 0.125,
        ...                                       "dense")   # doctest: +SKIP
    """
    if kernel == "dense":
        return _dense_backward(q, k, v, out, lse, dout, dlse, mods, scale)
    block_mask = None
    mask_mod = mods.global_mask_mod()
    if mask_mod is not None:
        block_mask = cached_block_mask(mask_mod, q, k)   # the forward's, from the cache
        if _hides_everything(block_mask):
            return None
    from ..direct_bwd import backward, cached_plan

    grads = backward(q, k, v, out, lse, dout, dlse, mods.global_score_mod(), block_mask, scale)
    if grads is not None:
        return grads
    reason = cached_plan(q, k, v, mods.global_score_mod(), mask_mod, block_mask).reason
    warn_once(f"fa3_inductor.distributed: no backward family serves ring attention's shards "
              f"({reason}); float32 torch ops compute them (memory: one M x N score tile per "
              "shard)")
    return _dense_backward(q, k, v, out, lse, dout, dlse, mods, scale)


def _hides_everything(block_mask) -> bool:
    """Whether a block mask lists no block at all (answered once per cached mask: a host sync)."""
    hit = _EMPTY.get(id(block_mask))
    if hit is not None and hit[0] is block_mask:
        return hit[1]
    listed = int(block_mask.kv_num_blocks.sum())
    if block_mask.full_kv_num_blocks is not None:
        listed += int(block_mask.full_kv_num_blocks.sum())
    _EMPTY[id(block_mask)] = (block_mask, listed == 0)   # the mask stays alive with its id
    if len(_EMPTY) > _MAX_EMPTY:
        _EMPTY.popitem(last=False)
    return listed == 0


def _dense_grid(q: Tensor, k: Tensor, mods: ShardMods) -> tuple[tuple, Optional[Tensor]]:
    """The mods' index arguments (b, h, q_idx, kv_idx: broadcastable, global positions) and the
    keep mask (B, H, M, N), None without a mask_mod."""
    B, H, M, _ = q.shape
    N = k.shape[2]
    qpos, kpos = mods.positions(q.device, M, N)
    b = torch.arange(B, device=q.device).view(B, 1, 1, 1)
    h = torch.arange(H, device=q.device).view(1, H, 1, 1)
    index = (b, h, qpos.view(1, 1, M, 1), kpos.view(1, 1, 1, N))
    if mods.mask_mod is None:
        return index, None
    return index, torch.as_tensor(mods.mask_mod(*index), device=q.device).expand(B, H, M, N)


def _dense_scores(q: Tensor, k: Tensor, mods: ShardMods, scale: float, index: tuple,
                  work: torch.dtype) -> Tensor:
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (q.to(work) @ k.to(work).transpose(-2, -1)) * scale
    if mods.score_mod is not None:
        s = mods.score_mod(s, *index).to(work)
    return s


def _dense(q: Tensor, k: Tensor, v: Tensor, mods: ShardMods, scale: float
           ) -> Optional[tuple[Tensor, Tensor]]:
    """The dense kernel: scores in float32 (float64 inputs stay float64)."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    index, keep = _dense_grid(q, k, mods)
    if keep is not None and not bool(keep.any()):
        return None
    s = _dense_scores(q, k, mods, scale, index, work)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    if v.shape[1] != q.shape[1]:
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(lse.isinf(), 0.0, lse).unsqueeze(-1))
    return (p @ v.to(work)).to(q.dtype), lse


def _dense_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                    dlse: Optional[Tensor], mods: ShardMods, scale: float
                    ) -> Optional[tuple[Tensor, Tensor, Tensor]]:
    """:func:`shard_attention_backward` in torch ops: P from the GIVEN ``lse`` (never a softmax of
    this shard's scores), dS = P (dO·Vᵀ - rowsum(dO·out) + dlse); autograd carries dS back
    through the score_mod and the GQA repeats."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    index, keep = _dense_grid(q, k, mods)
    if keep is not None and not bool(keep.any()):
        return None
    groups = q.shape[1] // k.shape[1]
    do = dout.to(work)
    lse = lse.to(work)
    reached = lse.isfinite().unsqueeze(-1)   # rows nothing reaches anywhere: P = 0
    delta = (do * out.to(work)).sum(-1, keepdim=True)
    with torch.enable_grad():
        qw, kw, vw = (t.detach().to(work).requires_grad_() for t in (q, k, v))
        s = _dense_scores(qw, kw, mods, scale, index, work)
        finite_lse = torch.where(reached, lse.unsqueeze(-1), 0.0)
        p = torch.where(reached, torch.exp(s.detach() - finite_lse), 0.0)
        if keep is not None:
            p = p.masked_fill(~keep, 0.0)
        v_rep = vw.repeat_interleave(groups, dim=1) if groups > 1 else vw
        dp = do @ v_rep.detach().transpose(-2, -1)
        ds = p * (dp - delta + (0.0 if dlse is None else dlse.to(work).unsqueeze(-1)))
        # dV = Pᵀ dO: the gradient of P·V with P held constant
        grads = torch.autograd.grad((s, p @ v_rep), (qw, kw, vw), (ds, do), allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, (qw, kw, vw)))
