"""Block masks of ring shards, cached per step shape.

A ring step's mask is the user's mask_mod composed with the shards' position maps; it is built
by ``fa3_inductor.block_masks.chunked_block_mask`` (bounded memory: torch's eager
``create_block_mask`` needs 2 bytes per query-key pair, 32 GiB for one 128k x 128k step) and
cached per (what the mask computes, with captured tensors' versions; the batch / head sizes it
reads; lengths; device), least recently used first out. The cache is separate from flex()'s so a
long ring does not evict a model's masks.

Example::

    >>> import torch; from fa3_inductor import mods
    >>> q = torch.zeros(1, 2, 256, 16)
    >>> cached_block_mask(mods.causal, q, q).kv_num_blocks.tolist()
    [[[1, 1]]]
"""

from __future__ import annotations

import collections
from typing import Callable, Hashable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from ..block_masks import _reads_batch_or_head, chunked_block_mask
from ..mod_keys import Unkeyable, mod_key

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
        _STATS["built"] += 1
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
    _STATS["built"] += 1
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
