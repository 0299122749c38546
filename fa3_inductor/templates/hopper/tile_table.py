"""Virtual tiles of packed sequences: which sequence each tile of a pack belongs to, made on the device.

Sequence b of a pack (offsets CU[b] : CU[b + 1]) takes the virtual tiles o_b = CU[b] // BLOCK + b onwards, one a
BLOCK rows. o increases strictly and o_{b+1} - o_b >= ceil(L_b / BLOCK), so the sequences' tiles never overlap and
at most one virtual tile a sequence (one past its last) has no rows. A grid of TOTAL // BLOCK + B + 1 CTAs over the
virtual tiles then gives every real tile a CTA, where a grid of B * ceil(max_len / BLOCK) gives every sequence the
longest one's count, most of them empty on uneven packs; the lengths are never read on the host (CUDA graphs).
The sm90 backward's packed mode (hopper_bwd/varlen.py) and the Hopper forward's (varlen_sm90.py) read it.

    >>> table = tile_table(torch.tensor([0, 300, 300, 1000], dtype=torch.int32), 128)   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

_BLOCK = 1024   # virtual tiles a program of the pass


@triton.jit(do_not_specialize=["B", "T", "STEPS"])
def packed_tile_table_kernel(CU, TABLE, B, T, STEPS, BLOCK_N: tl.constexpr, BLOCK: tl.constexpr):
    """For virtual tiles t in [BLOCK * pid, ...) (t < T), the sequence b whose tiles start at or before t: the largest
    b < B with o_b = CU[b] // BLOCK_N + b <= t (o increases strictly, o_0 = 0), by a binary search of
    STEPS >= ceil(log2(B)) + 1 halvings."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.zeros([BLOCK], tl.int32)
    hi = tl.full([BLOCK], B - 1, tl.int32)
    for _ in range(STEPS):
        mid = (lo + hi + 1) // 2
        below = tl.load(CU + mid) // BLOCK_N + mid <= t
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid - 1)
    tl.store(TABLE + t, lo, mask=t < T)


def tile_table_size(total: int, batch: int, block: int) -> int:
    """Virtual tiles of a pack of ``total`` rows in ``batch`` sequences, ``block`` rows a tile.

    Example::

        >>> tile_table_size(1000, 3, 128)
        11
    """
    return total // block + batch + 1


def tile_table_launch(cu: torch.Tensor, table: torch.Tensor, block: int) -> tuple[Any, tuple, dict, tuple]:
    """``(kernel, args, kwargs, grid)`` of the pass writing ``table`` (int32, :func:`tile_table_size` entries) for
    the offsets ``cu`` (int32, B + 1 entries) and tiles of ``block`` rows.

    Example::

        >>> cu = torch.tensor([0, 300, 300, 1000], dtype=torch.int32)
        >>> table = torch.empty(tile_table_size(1000, 3, 128), dtype=torch.int32)
        >>> kernel, args, kwargs, grid = tile_table_launch(cu, table, 128)
        >>> args[2:], grid
        ((3, 11, 3), (1,))
    """
    B = cu.shape[0] - 1
    return (packed_tile_table_kernel, (cu, table, B, table.shape[0], max(1, (B - 1).bit_length()) + 1),
            dict(BLOCK_N=block, BLOCK=_BLOCK, num_warps=4), (triton.cdiv(table.shape[0], _BLOCK),))
