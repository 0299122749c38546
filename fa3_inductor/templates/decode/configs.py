"""Tile and split choices for the decode kernels, in one place.

Nothing here is measured yet (the brief's H100 figures are for the prefill kernel used for
decode); each entry says what it assumes, for the GPU session to confirm or replace.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    block_n: int
    num_warps: int
    num_stages: int


# Resident split programs per SM the split count aims for: a decode program is small (4 warps,
# 16-row tiles; K+V stages ~32 KB each at D128, 3 stages), so two fit an SM and keep more loads
# in flight than one.
PROGRAMS_PER_SM = 2
# A split streams at least this many tiles: fewer make the combine's traffic and each program's
# fixed cost (Q load, epilogue) a visible share.
MIN_TILES_PER_SPLIT = 4
# Upper bound on the split count (the scratch is S x rows x DV fp32 per (batch, kv head)).
MAX_SPLITS = 128
# SM count the interpreter plans with: small, so that the default path splits on tiny shapes too.
INTERPRETER_SMS = 2


def decode_config(head_dim: int, capability: tuple[int, int] | None,
                  fp32: bool = False) -> DecodeConfig:
    """Tiles for the split kernel. ``capability`` None means the CPU interpreter.

    Example::

        >>> decode_config(128, (9, 0)).block_n
        64
    """
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    if capability is None:
        # Interpreter: numpy cost follows the number of steps; 16 keys a step exercises the
        # loop, the partial last tile and the page boundaries on tiny caches.
        return DecodeConfig(16, 4, 1)
    if fp32:
        return DecodeConfig(32, 4, 2)   # FMA path: a correctness path, small tiles
    # Memory-bound: the K and V tiles of a step are the bytes in flight. 64 keys at D128 is
    # 32 KB per stage (bf16), three stages 96 KB: two programs per SM on sm90 (228 KB).
    if block_d <= 64:
        return DecodeConfig(128, 4, 3)
    if block_d <= 128:
        return DecodeConfig(64, 4, 3)
    return DecodeConfig(32, 4, 3)


def choose_num_splits(batch: int, kv_heads: int, max_len: int, block_n: int,
                      num_sms: int) -> int:
    """Splits per (batch, kv head) so that the grid fills every SM: ``PROGRAMS_PER_SM`` programs
    per SM, rounded down (a partial second wave would idle most SMs on its tail), each split at
    least ``MIN_TILES_PER_SPLIT`` tiles of the longest cache, at most ``MAX_SPLITS``.

    Example::

        >>> choose_num_splits(8, 8, 8192, 64, 132)      # 64 programs: 4 splits fill 132 SMs x 2
        4
        >>> choose_num_splits(64, 8, 8192, 64, 132)     # 512 programs already fill them
        1
    """
    programs = batch * kv_heads
    by_sms = (PROGRAMS_PER_SM * num_sms) // max(programs, 1)
    by_len = max_len // (MIN_TILES_PER_SPLIT * block_n)
    return max(1, min(by_sms, by_len, MAX_SPLITS))


def sm_count(capability: tuple[int, int] | None, device_index: int | None = None) -> int:
    """SMs to plan splits for: the device's own when on CUDA, a nominal count otherwise
    (132 for a planned sm90, the H100 SXM; INTERPRETER_SMS for the interpreter).

    Example::

        >>> sm_count(None)
        2
    """
    if device_index is not None:
        import torch

        return torch.cuda.get_device_properties(device_index).multi_processor_count
    if capability is None:
        return INTERPRETER_SMS
    return 132 if capability[0] == 9 else 108
