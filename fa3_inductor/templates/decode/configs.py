"""Tile and split choices for the decode kernels, in one place.

Measured once on an H100 (benchmarks/results/serving-nvidia-h100-80gb-hbm3-2026-11-25-0547.md, the
tiles and split rule below except the tail rule and the 8-warp tiles): decode time fits
bytes / 3.13 TB/s + ~20 µs over 0.13-17 GB whatever the split count, cuDNN's the same; the rows
below SDPA are B=64 x 8 kv heads (512 programs, a partial second wave: the tail rule) and small
caches (the ~20 µs). The sweep in benchmarks/serving.py (part "splits") is there to replace the
constants here with measured ones.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    block_n: int
    num_warps: int
    num_stages: int
    # Programs one sm90 SM holds at once with these tiles (bf16; sass_report of the compiled
    # kernel): 16-32 rows with 4 warps take 127-167 registers and 39-72 KB of shared, so 3 (by
    # shared memory at 72 KB, by registers at 160+); 64-128 rows with 8 warps 98-131 KB, so 1.
    resident: int = 3
    # Partial values the last split loads per step of its merge (kernel.py, _merge_splits): 8192 is
    # 64 a thread at 4 warps, which sm90 builds take without changing residency (bf16 D128: paged
    # 154 -> 168 registers, contiguous 128 -> 161, no spills); 32 splits of 4 rows at D128 then merge
    # in 2 steps instead of 4 (each an L2 round trip on the call's critical path).
    merge_elements: int = 8192
    # Whole K / V tiles by TMA copies (kernel.py, CacheLayout.TMA) where the layout allows it
    # (host._tma_descriptors); else every tile by 16-byte cp.async.
    tma: bool = False


# Split programs per SM the split count aims for when the (batch, kv head) programs are few. A
# contiguous cache: one per SM (the split sweep of benchmarks/results/serving-nvidia-h100-80gb-hbm3-
# 2026-11-27-1943.md had half the splits of two per SM fastest or tied on every swept row: 1 x 8k
# and 1 x 32k GQA 32/8, 16 splits 0.026 / 0.064 ms against 32-33 splits' 0.028 / 0.067). A paged
# cache: two per SM. Its pipeline runs one tile ahead (the page lookup takes a stage), so it needs
# more programs in flight: at one per SM (serving-...-2011) paged ran 1.39-1.53x contiguous's time
# on 8 x 8k and 1 x 128k, against 1.03-1.04x at two per SM (serving-...-1943).
PROGRAMS_PER_SM = 1
PAGED_PROGRAMS_PER_SM = 2
# Pipeline stages of a contiguous cache's split kernel in that regime (few programs, one per SM): the
# program has the SM's shared memory to itself, and a deeper pipeline keeps more of the cache in
# flight. H200, benchmarks/results/decode-tiles-nvidia-h200-2026-11-29-0202 (cuDNN's time over ours,
# 3 stages -> 4): 1 x 128k GQA 0.970 -> 0.991, MHA 0.962 -> 1.000, D64 0.962 -> 0.978; 8 x 8k 0.981 ->
# 0.994; the small caches lose a little (1 x 4k 1.087 -> 1.034, 1 x 8k 1.066 -> 1.035). 5 or 6 stages,
# or 128-key tiles, were no better overall; with many programs 4 stages cost residency.
FEW_PROGRAMS_STAGES = 4
# The tail rule applies while the programs are at most this many waves of resident ones.
TAIL_WAVES = 2
# A split streams at least this many tiles: fewer make the combine's traffic and each program's
# fixed cost (Q load, epilogue) a visible share.
MIN_TILES_PER_SPLIT = 4
# A paged split: at least this many. Its program's start costs more (page lookups before the first
# tile) and its two-per-SM split counts are twice as many partials for the last split to merge: 1 x 8k
# GQA 32/8 ran 1.26x the contiguous time at 32 splits against 1.10x at 16
# (benchmarks/results/decode-tiles-nvidia-h200-2026-11-29-0221, pages of 64). Never fewer splits than a
# contiguous cache gets, though: 1 x 4k fell to 8 splits (64 programs on 132 SMs) and ran 1.43x
# (serving-nvidia-h200-2026-11-29-0229).
PAGED_MIN_TILES_PER_SPLIT = 8
# Pages holding whole tiles (D128's 64-key tiles on pages of 64 or more keys), when the paged split rule would leave
# each split at most SHORT_PAGED_SPLIT tiles: plan as a contiguous cache (its split count: half the splits, twice
# as long) at WHOLE_PAGE_STAGES stages (the table entry takes one, three tiles ahead, 104 KB). H200, paged time over
# contiguous (decode-tiles-nvidia-h200-2026-11-30-0412, `1/SM st7` against the paged rule): 1 x 32k (16 tiles a
# split) 1.142 -> 1.049, 8 x 4 tokens x 8k (32) 1.124 -> 1.083, 1 x 8k (8) 1.065 -> 1.044, 8 x 8k (32) 1.034 ->
# 1.039, 1 x 4k (4) 0.999 -> 1.003. Long splits keep the paged rule: as one program an SM with three tiles ahead
# 1 x 128k (62 tiles a split) ran 1.172 against 1.043 (serving-nvidia-h200-2026-11-30-0430). Only where the paged rule
# splits more than the contiguous one: at the same split count the 7 stages alone cost 1 x 4k (4 tiles a split)
# 3.9% in decode-tiles-nvidia-h200-2026-11-30-1236. So narrowed (-1240, the paged rule's time over this plan's, same
# rounds): 1 x 32k 1.109, 8 x 4 tokens 1.014, 8 x 8k 0.993.
SHORT_PAGED_SPLIT = 32
WHOLE_PAGE_STAGES = 7
# Upper bound on the split count (the scratch is S x rows x DV fp32 per (batch, kv head)).
MAX_SPLITS = 128
# SM count the interpreter plans with: small, so that the default path splits on tiny shapes too.
INTERPRETER_SMS = 2


def decode_config(head_dim: int, capability: tuple[int, int] | None,
                  fp32: bool = False, block_m: int = 16, paged: bool = False,
                  few_programs: bool = False, fp8_cache: bool = False) -> DecodeConfig:
    """Tiles for the split kernel of ``block_m`` packed rows (``paged``: K/V read through a block
    table; ``few_programs``: the split rule's one-program-per-SM regime, :func:`few_programs`;
    ``fp8_cache``: one-byte K / V). ``capability`` None means the CPU interpreter.

    Example::

        >>> decode_config(128, (9, 0)).block_n, decode_config(128, (9, 0), block_m=128).num_warps
        (64, 8)
        >>> decode_config(128, (9, 0), paged=True).num_stages, decode_config(128, (9, 0), few_programs=True).num_stages
        (5, 4)
        >>> decode_config(128, (9, 0), fp8_cache=True).block_n
        128
    """
    cfg = _decode_tiles(head_dim, capability, fp32, block_m, paged, few_programs)
    if fp8_cache and not paged and capability is not None and cfg.block_n < 128:
        # A contiguous FP8 cache takes twice the keys, so that a stage holds the bf16 tile's bytes. H200
        # (serving-nvidia-h200-2026-11-29-0822-fp8kv, GQA 32/8 D128, FP8 time at 64 keys over 128): 8 x 32k
        # 1.36x, 1 x 128k 1.22x, 8 x 8k 1.29x, 64 x 8k 1.03x, 1 x 32k 1.15x. Pages keep the bf16 tiles
        # (a tile of 128 keys over pages of 64 is not measured; 255 registers at D128 on sm90).
        cfg = dataclasses.replace(cfg, block_n=2 * cfg.block_n)
    return cfg


def _decode_tiles(head_dim: int, capability: tuple[int, int] | None, fp32: bool, block_m: int, paged: bool,
                  few_programs: bool) -> DecodeConfig:
    """decode_config's tiles for a two-byte (or fp32) cache."""
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    if capability is None:
        # Interpreter: numpy cost follows the number of steps; 16 keys a step exercises the
        # loop, the partial last tile and the page boundaries on tiny caches.
        return DecodeConfig(16, 4, 1)
    # 64+ packed rows (a speculative draft, or MQA): the rows x DV fp32 accumulator and the P tile
    # need 8 warps; with 4, 128 rows at D128 spill (255 registers, 62 spill instructions on sm90;
    # 8 warps: 187 registers, none). Up to 32 rows 4 warps hold it (<= 167 registers).
    warps, resident = (8, 1) if block_m >= 64 else (4, 3)
    if fp32:
        return DecodeConfig(32, warps, 2, resident)   # FMA path: a correctness path, small tiles
    # Memory-bound: the K and V tiles of a step are the bytes in flight. 64 keys at D128 is
    # 32 KB per stage (bf16); sm90 builds (bf16, 16 rows) take ~128-160 registers and 72 KB of
    # shared with the cache two tiles ahead. A paged loop's page lookup takes a stage of Triton's
    # pipeline, so 3 stages prefetch one tile there (39 KB) and 5 two (72 KB, 148 / 96 registers
    # at D128 / D64, no spills); paged rows ran 1.04-1.20x contiguous's time with 3.
    stages = 5 if paged and block_m < 64 else FEW_PROGRAMS_STAGES if few_programs and block_m < 64 else 3
    if block_d <= 64:
        return DecodeConfig(128, warps, stages, resident)
    if block_d <= 128:
        return DecodeConfig(64, warps, stages, resident)
    return DecodeConfig(32, warps, stages, resident)


# TMA with twice the keys a tile (256) for GQA-packed D64 caches: H200, time of the pointer plan over this one in
# two runs (benchmarks/results/decode-tiles-nvidia-h200-2026-11-30-1205 and -1211): 8 x 8k 1.019 / 1.022, 1 x 128k
# 1.038 / 1.031, 64 x 32k 1.023 / 1.013. Elsewhere TMA was level or lost up to 3% (few programs at D128, MHA), and
# twice the keys by pointer loads lost 1-3% (-0212, -0221); launches of >= 1024 programs at D128 gained 0.4-2.0% in
# one run and lost 1.1% (64 x 4k MHA) in the other, so they keep the pointer plan.


def tma_tiles(cfg: DecodeConfig, head_dim: int, packed_heads: int, block_m: int,
              capability: tuple[int, int] | None, paged: bool, two_byte: bool) -> DecodeConfig | None:
    """The TMA plan replacing ``cfg`` (whole tiles by TMA, twice the keys a tile), or None where the
    pointer plan stays: sm90, a contiguous two-byte cache, D <= 64, GQA packing, fewer than 64 rows.

    Example::

        >>> tma_tiles(decode_config(64, (9, 0)), 64, 4, 16, (9, 0), False, True).block_n
        256
        >>> tma_tiles(decode_config(128, (9, 0)), 128, 4, 16, (9, 0), False, True) is None
        True
    """
    if capability is None or capability[0] != 9 or paged or not two_byte or block_m >= 64:
        return None
    if head_dim > 64 or packed_heads < 2:
        return None
    # K and V tiles of 32 KB each a stage (256 keys x D64): one program an SM by shared memory
    return dataclasses.replace(cfg, tma=True, block_n=2 * cfg.block_n, resident=1)


def short_paged_splits(head_dim: int, page_size: int, block_m: int, two_byte: bool, batch: int, kv_heads: int,
                       max_len: int, block_n: int, num_sms: int, resident: int) -> bool:
    """Whether a paged cache plans as a contiguous one (SHORT_PAGED_SPLIT): its pages hold D128's 64-key tiles
    whole (64 < D <= 128, pages a multiple of 64, two-byte K / V, fewer than 64 rows) and the paged split rule
    would give more splits than the contiguous one, of at most SHORT_PAGED_SPLIT tiles.

    Example::

        >>> short_paged_splits(128, 64, 16, True, 1, 8, 32768, 64, 132, 3)     # 33 splits of 16 tiles
        True
        >>> short_paged_splits(128, 64, 16, True, 1, 8, 131072, 64, 132, 3)    # 33 splits of 62 tiles
        False
    """
    if not (64 < head_dim <= 128 and page_size > 0 and page_size % 64 == 0 and block_m < 64 and two_byte):
        return False
    splits = choose_num_splits(batch, kv_heads, max_len, block_n, num_sms, resident, paged=True)
    fewer = choose_num_splits(batch, kv_heads, max_len, block_n, num_sms, resident) < splits
    return fewer and -(-max_len // block_n) <= SHORT_PAGED_SPLIT * splits


def few_programs(batch: int, kv_heads: int, num_sms: int, paged: bool = False) -> bool:
    """Whether the (batch, kv head) programs are fewer than the split rule's programs per SM times
    the SMs: :func:`choose_num_splits` then splits them to about that many per SM.

    Example::

        >>> few_programs(8, 8, 132), few_programs(64, 8, 132)
        (True, False)
    """
    per_sm = PAGED_PROGRAMS_PER_SM if paged else PROGRAMS_PER_SM
    return max(batch * kv_heads, 1) < per_sm * num_sms


def choose_num_splits(batch: int, kv_heads: int, max_len: int, block_n: int,
                      num_sms: int, resident: int = 3, paged: bool = False) -> int:
    """Splits per (batch, kv head) program.

    Few programs (fewer than ``PROGRAMS_PER_SM`` per SM, ``PAGED_PROGRAMS_PER_SM`` for a paged
    cache): split so that the grid holds that many per SM, rounded down, each split at least
    ``MIN_TILES_PER_SPLIT`` tiles of the longest cache (``PAGED_MIN_TILES_PER_SPLIT`` paged), at most
    ``MAX_SPLITS``. More programs than
    the SMs hold at once (``resident`` per SM) but fewer than ``TAIL_WAVES`` waves of them (the tail
    rule): the split count of 1 to 4 whose last wave is fullest, so that the second wave is not a
    tail of a few programs on idle SMs (B=64 x 8 kv heads: 512 programs over 396 resident, 1.3
    waves, ran 0.82-0.95x cuDNN's time at one split; three splits make 3.9 waves). Otherwise 1.

    Example::

        >>> choose_num_splits(8, 8, 8192, 64, 132)      # 64 programs: 2 splits fill 132 SMs
        2
        >>> choose_num_splits(8, 8, 8192, 64, 132, paged=True)   # paged: 2 programs per SM
        4
        >>> choose_num_splits(64, 8, 4096, 64, 132)     # 512 programs: 1.3 waves; 3 splits 3.9
        3
        >>> choose_num_splits(64, 32, 4096, 64, 132)    # 2048 programs: 5.2 waves already
        1
    """
    programs = max(batch * kv_heads, 1)
    by_len = max(1, max_len // ((PAGED_MIN_TILES_PER_SPLIT if paged else MIN_TILES_PER_SPLIT) * block_n))
    slots = resident * num_sms
    per_sm = PAGED_PROGRAMS_PER_SM if paged else PROGRAMS_PER_SM
    if few_programs(batch, kv_heads, num_sms, paged):
        splits = max(1, min((per_sm * num_sms) // programs, by_len, MAX_SPLITS))
        if paged:   # at least the contiguous cache's count
            splits = max(splits, choose_num_splits(batch, kv_heads, max_len, block_n, num_sms, resident))
        return splits
    if slots < programs < TAIL_WAVES * slots:
        def fullness(s: int) -> float:   # the last wave's share of busy slots
            waves = programs * s / slots
            return waves / -(-programs * s // slots)
        return max(range(1, min(4, by_len) + 1), key=lambda s: (round(fullness(s), 2), -s))
    return 1


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
