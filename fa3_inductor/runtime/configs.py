"""Tile and pipeline choices for the generic template, in one table.

Each entry says why. Figures are from FACTS.md and benchmarks/results (H100/H200, triton 3.6).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GenericConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    warp_specialize: bool


def generic_config(head_dim: int, capability: tuple[int, int] | None,
                   mods_load_buffers: bool = False, fp32: bool = False) -> GenericConfig:
    """Tile choice for the generic kernel. ``capability`` None means the CPU interpreter.

    ``mods_load_buffers``: a mod gathers from a captured buffer. Triton 3.6's warp-specialization
    pass crashes on such loads inside the KV loop ("operation destroyed but still has uses",
    seen compiling a document mask for sm90), so those kernels use the plain pipelined loop.
    ``fp32``: float32 inputs; the same pass fails on fp32 (tf32) dots (ConvertNVGPUToLLVM
    error, H200 2026-11-22), so they take the plain loop too.

    Example::

        >>> generic_config(128, (9, 0)).block_m
        128
    """
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    if capability is None:
        # Interpreter: numpy cost grows with the number of programs, not the tile size.
        return GenericConfig(64, 64, 4, 1, False)
    if fp32:
        # float32 (IEEE by default, like torch) runs on FMA units: small tiles keep the
        # spills small (128x64 spilled 4.4 KB of stack at D=128; 32x32 with 8 warps: none at
        # D<=64, 192 B at D=128, 1.8 KB at D=256: float32 is a correctness path, not a fast one).
        return GenericConfig(32, 32, 8, 1, False)
    if capability[0] == 9 and not mods_load_buffers:
        # Hopper: TMA descriptors + Meta's warp-specialization pass (needs num_warps=4).
        # BLOCK_M is 64: with 128 the pass splits the rows over two consumer groups and, in
        # Triton 3.6, returns garbage for the loop-carried row max (LSE and MAX all NaN) and
        # wrong outputs with masks (H200, 2026-11-22: relative error 0.2 for causal at
        # BLOCK_M 128; 2e-3 and exact LSE at BLOCK_M 64).
        return GenericConfig(64, 128 if block_d <= 128 else 64, 4, 2, True)
    # Ampere/Ada (and Hopper kernels whose mods gather): classic 8-warp pipelined tile.
    if block_d <= 128:
        return GenericConfig(128, 64, 8, 3, False)
    return GenericConfig(64, 32, 4, 2, False)
