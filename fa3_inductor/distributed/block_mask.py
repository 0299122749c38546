"""Block masks of long shards, built in bounded memory and cached.

torch's ``create_block_mask`` (eager) evaluates the mask over the whole M x N grid at once and pads
a copy: 2 M N bytes, 32 GiB for one 128k x 128k ring step and 128 GiB for 128k queries against a
512k all-gathered sequence. Here the mask is evaluated ``rows`` query positions at a time
(``rows`` a multiple of the block size, so each chunk reduces to whole block rows), with torch's
own ``create_mask`` (same vmap semantics as ``create_block_mask``) on a mask_mod shifted by the
chunk's first row, and the per-block counts are turned into the same BlockMask
``create_block_mask`` makes (partial and full blocks, ordered indices, the mask_mod attached).

Masks are cached like ``fa3_inductor.block_masks`` does: per (what the mask computes, with
captured tensors' versions; the batch / head sizes it reads; lengths; device), least recently
used first out.

Example::

    >>> import torch; from fa3_inductor import mods
    >>> q = torch.zeros(1, 2, 256, 16)
    >>> bm = chunked_block_mask(mods.causal, q, q, max_elements=128 * 256)
    >>> bm.kv_num_blocks.tolist(), bm.full_kv_num_blocks.tolist()
    ([[[1, 1]]], [[[0, 1]]])
"""

from __future__ import annotations

import collections
from typing import Callable, Hashable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_mask

from ..block_masks import _reads_batch_or_head
from ..mod_keys import Unkeyable, mod_key

BLOCK = 128                    # torch's default sparse block size, as fa3_inductor.flex uses
MAX_ELEMENTS = 1 << 28         # mask booleans evaluated at once (256 MiB, twice that with the pad)
MAX_MASKS = 64
_MASKS: collections.OrderedDict[Hashable, BlockMask] = collections.OrderedDict()
_STATS = {"built": 0, "reused": 0}


def cached_block_mask(mask_mod: Callable, q: Tensor, k: Tensor) -> BlockMask:
    """:func:`chunked_block_mask` of ``mask_mod`` for ``q`` (B, H, M, D) and ``k`` (.., N, D),
    built once per (mask, sizes it reads, M, N, device).

    Example::

        >>> import torch; from fa3_inductor import mods
        >>> q = torch.zeros(1, 1, 128, 16)
        >>> cached_block_mask(mods.causal, q, q) is cached_block_mask(mods.causal, q, q)
        True
    """
    try:
        what = mod_key(mask_mod, versions=True)
    except Unkeyable:   # its captured state is invisible: a cached mask could go stale
        return chunked_block_mask(mask_mod, q, k)
    reads_b, reads_h = _reads_batch_or_head(mask_mod)
    key = (what, q.shape[0] if reads_b else None, q.shape[1] if reads_h else None, q.shape[2],
           k.shape[2], q.device)
    mask = _MASKS.get(key)
    if mask is not None:
        _MASKS.move_to_end(key)
        _STATS["reused"] += 1
        return mask
    mask = _MASKS[key] = chunked_block_mask(mask_mod, q, k, reads=(reads_b, reads_h))
    if len(_MASKS) > MAX_MASKS:
        _MASKS.popitem(last=False)
    return mask


def stats() -> dict[str, int]:
    """Block masks built and reused by :func:`cached_block_mask` (tests, benchmarks).

    Example::

        >>> stats()["built"] >= 0
        True
    """
    return dict(_STATS, cached=len(_MASKS))


def chunked_block_mask(mask_mod: Callable, q: Tensor, k: Tensor, block: int = BLOCK,
                       max_elements: int = MAX_ELEMENTS, reads: tuple | None = None) -> BlockMask:
    """The BlockMask ``create_block_mask(mask_mod, B?, H?, M, N, device)`` makes, evaluated at most
    about ``max_elements`` mask entries at a time. ``reads``: whether the mask reads (b, h)
    (traced when not given); only then does the block mask get those dimensions.

    Example::

        >>> import torch; from fa3_inductor import mods
        >>> q = torch.zeros(1, 1, 300, 16)                   # edge blocks padded, as torch does
        >>> chunked_block_mask(mods.causal, q, q, max_elements=1).kv_num_blocks.tolist()
        [[[1, 1, 3]]]
    """
    reads_b, reads_h = reads if reads is not None else _reads_batch_or_head(mask_mod)
    B = q.shape[0] if reads_b else 1
    H = q.shape[1] if reads_h else 1
    M, N, device = q.shape[2], k.shape[2], q.device
    q_blocks, kv_blocks = -(-M // block), -(-N // block)
    per_row = B * H * kv_blocks * block
    rows = max(block, (max_elements // per_row) // block * block)
    counts = torch.empty(B, H, q_blocks, kv_blocks, dtype=torch.int32, device=device)
    for start in range(0, M, rows):
        length = min(rows, M - start)
        keep = create_mask(_shifted(mask_mod, start), B if reads_b else None,
                           H if reads_h else None, length, N, device)
        keep = keep.expand(B, H, length, N)
        pad_rows, pad_cols = -length % block, -N % block
        if pad_rows or pad_cols:   # positions past the end are masked, as in torch's padding
            keep = torch.nn.functional.pad(keep, (0, pad_cols, 0, pad_rows))
        first = start // block
        n_rows = keep.shape[2] // block
        counts[:, :, first:first + n_rows] = keep.reshape(B, H, n_rows, block, kv_blocks, block) \
            .sum(dim=(3, 5), dtype=torch.int32)
    _STATS["built"] += 1
    full = counts == block * block
    partial = (counts > 0) & ~full
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(block, block),
                                    mask_mod=mask_mod, seq_lengths=(M, N))


def _shifted(mask_mod: Callable, start: int) -> Callable:
    """``mask_mod`` for query rows counted from ``start``."""
    def shifted(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx + start, kv_idx)
    return shifted


def _ordered(dense: Tensor) -> tuple[Tensor, Tensor]:
    """(blocks per row, their column indices first) of a (B, H, rows, cols) block boolean."""
    as_int = dense.to(torch.int32)
    order = torch.argsort(as_int, dim=-1, descending=True, stable=True)
    return as_int.sum(-1, dtype=torch.int32).contiguous(), order.to(torch.int32).contiguous()
