"""Tiles of the FP8 family (the generic kernel with its Quant bundle on), in one table.

Chosen from sm90 compiles on the CPU (triton 3.6, two-level accumulation on, no spills; registers per
thread in brackets), before any GPU timing: the FP8 tile keeps a second fp32 accumulator, so the
bf16 table's 4-warp tiles spill at D >= 128 (128x64 w4: 243 spill instructions at D=128).
  D <= 64    128x128, 8 warps, 3 stages   [128]
  D <= 128   128x128, 8 warps, 2 stages   [178]   (3 stages once gave NaN in a compact Triton FP8
                                                    kernel on an H200: docs/facts.md)
  D <= 256    64x128, 8 warps, 2 stages   [180]   (every 128-row tile spills: 147+)
Other GPUs with e4m3 MMA (sm89) take the same tiles with 2 stages; the interpreter small ones.
"""

from __future__ import annotations

from ..generic.configs import GenericConfig


def fp8_config(head_dim: int, capability: tuple[int, int] | None) -> GenericConfig:
    """The FP8 tile for a padded head dim on a GPU of ``capability`` (None: the interpreter).

    Example::

        >>> fp8_config(128, (9, 0)).block_m
        128
    """
    if capability is None:
        return GenericConfig(64, 64, 4, 1, False)
    if head_dim <= 64:
        cfg = GenericConfig(128, 128, 8, 3, False)
    elif head_dim <= 128:
        cfg = GenericConfig(128, 128, 8, 2, False)
    else:
        cfg = GenericConfig(64, 128, 8, 2, False)
    if capability[0] != 9:
        cfg = GenericConfig(cfg.block_m, cfg.block_n, cfg.num_warps, 2, False)
    return cfg
