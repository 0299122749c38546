"""Tile choices for the varlen template, each with its reason.

Not yet measured on a GPU (docs/design/varlen.md, "What is left"): the sm90 entries were only
checked to compile for sm90 without spills (tests/test_varlen.py, sm90_compile).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class VarlenConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def varlen_config(head_dim: int, capability: tuple[int, int] | None,
                  fp32: bool = False) -> VarlenConfig:
    """Tiles for the varlen kernel at the padded ``head_dim`` (the wider of D and DV).
    ``capability`` None means the CPU interpreter.

    Example::

        >>> varlen_config(128, (9, 0)).block_n
        64
        >>> varlen_config(64, None).block_m
        32
    """
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    if capability is None:
        # Interpreter: cost follows the number of programs and KV steps; 32-row tiles still put
        # several tiles in a short test sequence (bounds and tile boundaries exercised).
        return VarlenConfig(32, 32, 4, 1)
    if fp32:
        # float32 runs on FMA units (a correctness path): small tiles keep spills away.
        return VarlenConfig(32, 32, 8, 1)
    if capability[0] >= 9:
        # Hopper, pointer loads pipelined by Triton (cp.async), checked without spills for bf16
        # noop and softcap + causal (sass_report): 128x128 w8 at D<=64 (180-224 registers;
        # 4 warps spilled 68-82 instructions), 128x64 w8 at D<=128 (182-218; 128x128 w8
        # spilled with softcap), 128x32 w8 s2 at D<=256 (246-254; the generic kernel's 128x64
        # spilled 23 instructions with softcap + causal, 64x64 w4 / w8 spilled too).
        if block_d <= 64:
            return VarlenConfig(128, 128, 8, 3)
        if block_d <= 128:
            return VarlenConfig(128, 64, 8, 3)
        return VarlenConfig(128, 32, 8, 2)
    # Ampere / Ada: the generic kernel's pipelined tiles.
    if block_d <= 128:
        return VarlenConfig(128, 64, 8, 3)
    return VarlenConfig(64, 32, 4, 2)
