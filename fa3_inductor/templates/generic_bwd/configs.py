"""Tile choices for the generic backward, in one table; each entry says why.

Not yet measured on a GPU (the kernels are not wired into the lowering): the sm90 entries are
the ones that compile without spills (tests/test_generic_backward.py, ``sm90_compile``), to be
swept once the backward family runs there (docs/design/backward.md).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Tiles of the two main kernels. dK/dV keeps a KV tile ([dkdv_block_n, D] of K, V, dK, dV)
    and walks query tiles of dkdv_block_m rows; dQ keeps a query tile and walks KV tiles."""
    dkdv_block_m: int
    dkdv_block_n: int
    dkdv_warps: int
    dq_block_m: int
    dq_block_n: int
    dq_warps: int
    num_stages: int


# delta = rowsum(dO · O): a streaming pass, rows per program.
PREPROCESS_BLOCK_M = 64


def backward_config(head_dim: int, capability: tuple[int, int] | None,
                    fp32: bool = False) -> BackwardConfig:
    """Tiles for the generic backward. ``capability`` None means the CPU interpreter;
    ``head_dim`` is the wider of D and DV.

    Example::

        >>> backward_config(128, None).dq_block_m
        64
    """
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    if capability is None:
        # Interpreter: numpy cost grows with the number of programs and loop steps, not the tile.
        return BackwardConfig(64, 64, 4, 64, 64, 4, 1)
    if fp32:
        # float32 runs on FMA units (IEEE by default): small tiles, as the forward's fp32 entry.
        return BackwardConfig(32, 32, 4, 32, 32, 4, 1)
    if capability[0] >= 9:
        # Hopper: the MMA's M is BLOCK_N in dK/dV (Kᵀ-side products) and BLOCK_M in dQ, 64 rows
        # per warpgroup. dK/dV holds two fp32 [BLOCK_N, D] accumulators plus K and V, so its
        # query step is short (32 rows). Compiled for sm90, bf16 (sm90_compile test):
        #   D<=128  dK/dV 32x128 w8: 201 (D64) / 243 (D128) registers, no spills; 64x128 w8 used
        #           255 and spilled at D128 (54 spill instructions), 64x64 w8 spilled too (23)
        #           dQ 128x64 w8: 127 / 158-174 registers, no spills
        #   D=256   dK/dV spills at every tile tried (32x64 w8: 68 spill instructions; 16x64 w8:
        #           138; w4: 600+): two [64, 256] fp32 accumulators are 128 registers a thread
        #           on 8 warps before anything else. dQ 64x32 w4: no spills.
        if block_d <= 128:
            return BackwardConfig(32, 128, 8, 128, 64, 8, 2)
        return BackwardConfig(32, 64, 8, 64, 32, 4, 1)
    # Ampere/Ada: 4 warps, two stages of the streamed operands (not measured yet).
    if block_d <= 128:
        return BackwardConfig(32, 64, 4, 64, 64, 4, 2)
    return BackwardConfig(32, 64, 4, 64, 32, 4, 1)
