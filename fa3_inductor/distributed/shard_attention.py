"""Attention of a rank's queries against one K/V shard, with mods that see global positions.

Notation: q (B, H, M, D) local queries; k (B, Hkv, N, D), v (B, Hkv, N, Dv) one K/V shard; every
result is (out (B, H, M, Dv), lse (B, H, M) natural log, float32; float64 for float64 inputs). The shard's mods are the user's
mods composed with the layout's position map (layout.py: pos(i) = i + a below c, i + b above), so
``q_idx`` / ``kv_idx`` inside a mod are global positions on every rank and step. The offsets
(a, b) of q and k travel as one captured int32 tensor per (layout, rank, source shard): the
kernel's generated mods read them at run time, so one compiled kernel serves every step.

Two kernels compute a shard:
- ``fa3``: ``fa3_inductor.flex`` (our kernel families; the generic kernel under the CPU interpreter);
- ``dense``: float32 torch ops, for CPUs without the interpreter (torch's flex has no CPU backward)
  and as the reference the tests hold the ring to.

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

from ..block_masks import cached_block_mask

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
                    enable_gqa: bool, kernel: str) -> Optional[tuple[Tensor, Tensor]]:
    """(out, lse) of ``q`` against one K/V shard, differentiable in q, k, v; None when the mask
    hides the whole shard.

    Example::

        >>> out, lse = shard_attention(q, k, v, mods, 0.125, False, "dense")   # doctest: +SKIP
    """
    if kernel == "dense":
        return _dense(q, k, v, mods, scale)
    block_mask = None
    mask_mod = mods.global_mask_mod()
    if mask_mod is not None:
        block_mask = cached_block_mask(mask_mod, q, k)
        if _hides_everything(block_mask):
            return None
    from ..api import flex

    return flex(q, k, v, score_mod=mods.global_score_mod(), block_mask=block_mask, scale=scale,
                enable_gqa=enable_gqa, return_lse=True)


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


def _dense(q: Tensor, k: Tensor, v: Tensor, mods: ShardMods, scale: float
           ) -> Optional[tuple[Tensor, Tensor]]:
    """The dense kernel: scores in float32 (float64 inputs stay float64)."""
    B, H, M, _ = q.shape
    N = k.shape[2]
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    qpos, kpos = mods.positions(q.device, M, N)
    b = torch.arange(B, device=q.device).view(B, 1, 1, 1)
    h = torch.arange(H, device=q.device).view(1, H, 1, 1)
    qi, ki = qpos.view(1, 1, M, 1), kpos.view(1, 1, 1, N)
    keep = None
    if mods.mask_mod is not None:
        keep = torch.as_tensor(mods.mask_mod(b, h, qi, ki), device=q.device).expand(B, H, M, N)
        if not bool(keep.any()):
            return None
    if k.shape[1] != H:
        k = k.repeat_interleave(H // k.shape[1], dim=1)
        v = v.repeat_interleave(H // v.shape[1], dim=1)
    s = (q.to(work) @ k.to(work).transpose(-2, -1)) * scale
    if mods.score_mod is not None:
        s = mods.score_mod(s, b, h, qi, ki).to(work)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(lse.isinf(), 0.0, lse).unsqueeze(-1))
    return (p @ v.to(work)).to(q.dtype), lse
