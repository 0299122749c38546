"""Tile / stage table of the sm90 (Hopper) FA3-structure forward kernel.

One entry per (head dim, dtype). Every entry is compiled for sm90 by
tests/test_hopper_compile.py (HGMMA present, setmaxnreg present, no spills), and the
reason / measurement for each choice sits beside it. Figures are TFLOP/s, bf16,
`triton.testing.do_bench` medians, same run as cuDNN; see docs/design/hopper_kernel.md for the
full ablation and the device each figure came from.

Register budget (all entries): 3 warpgroups (2 consumer warpgroups + a 1-warp producer padded
to a warpgroup) launch with maxnreg=168 (3*128*168 = 64512 <= 65536 registers), then
setmaxnreg moves them to 240/240/24 (2*128*240 + 128*24 = 64512). If a config does not fit,
Gluon silently drops setmaxnreg: the compile test catches that.

Shared memory (bytes): Q tile BLOCK_M*W*2, plus NUM_STAGES K tiles and V_STAGES V tiles of BLOCK_N*W*2,
plus in persistent mode an O staging tile BLOCK_M*W*2 where it fits (D=64: 128 KB, D=128: 192 KB in all).
W is the head dim: a head dim that is not a power of two sits in two tiles per operand, LO + HI columns.
Limit on sm90: 227 KB per CTA.

Every field below takes more than one value across the shipped entries (or, `persistent`, pins a choice that
shipped launches make both ways); switches that every entry left at one value were removed with their kernel
code (last at commit 7bfe679; the measurements that retired them are noted where the choice is made).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Sm90Config:
    block_m: int = 128          # rows per CTA tile; 2 consumer warpgroups x 64 rows
    block_n: int = 128          # KV rows per pipeline stage
    num_stages: int = 2         # depth of the K/V shared-memory ring
    v_stages: int | None = None  # depth of the V ring where it differs from the K ring's (None: num_stages)
    # Always on, no longer fields (7bfe679): a padded head dim (80, 96, 160, 192) in two shared tiles per
    # operand of exactly D columns, not one padded to a power of two (D=96 split / padded noop S8k 516 / 482,
    # hopper-mods-nvidia-h200-2026-11-22-1653-split-d96-d80; what lets D=160 / 192 hold BLOCK_N 128 tiles);
    # mbarrier pingpong between the two consumer warpgroups (+1-4% non-causal at D=128 / 256 on an H200, noise
    # elsewhere: hopper-ablation-nvidia-h200-2026-11-22-0715).
    overlap: bool = True        # intra-warpgroup overlap: QK^T of tile j+1 before softmax of tile j
    # grid = #SMs, each CTA walks tile pairs (longest + shortest query block of a head); None (every
    # table entry): decided per launch by use_persistent() from the tile count and the KV length. True /
    # False pin the schedule (tests, benchmarks: both are shipped, chosen per launch).
    persistent: bool | None = None
    # use_persistent(): tiles of up to 8192 keys' worth of KV tiles also go persistent while kv_len <= 8192
    # (measured at D=128 and 192 / 128: PERSISTENT_MAX_N_SHORT_KV, PAIR_TABLE)
    persistent_to_8k: bool = False
    # (Persistent launches stage O in a buffer of its own wherever shared memory allows it, D=64 / 128; the
    # `o_stage` field that could turn that off went in 7bfe679: persistent with the O buffer is the schedule
    # measured in hopper-sched-nvidia-h200-2026-11-22-0304, "O in Q" was hopper_ablation.py's variant.)
    consumer_regs: int = 240    # setmaxnreg of the second consumer warpgroup (the default one gets the rest)
    producer_regs: int = 24     # setmaxnreg of the TMA producer warp(group)
    maxnreg: int = 168          # register cap at kernel entry (12 warps)
    # exp2 of the softmax on the FMA pipe (FlashAttention-4's polynomial) for half of the score columns, for
    # score mods that spend the special-function unit per score themselves (SFU_OPS > 0: softcap's tanh).
    # Only D=64 sets it: there the tile's two GEMMs are half as long as at D=128 and MUFU is the bound.
    # H200, bf16, softcap 30, same run, off / quarter / half (TFLOP/s, hopper-mods-nvidia-h200-2026-11-22-0630):
    # B8 H32 S2k 315 / 324 / 334, B4 H32 S4k 320 / 330 / 342, B1 H32 S16k 329 / 352 / 372; at D=128 it loses
    # (B8 H16 S2k 521 / 509 / 497, B2 S8k 534 / 527 / 526; earlier B4 H16 S4096 484 / 453 / 443, -0228), and
    # for every launch without such a mod (noop D=64 S4k 447 / 421 / 382): the quarter split and the emulation
    # outside SFU-bound mods were removed (last at 7bfe679).
    sfu_mod_exp2_emu: bool = False
    # Take a `score + x` mod in its folded form qk + x / sm_scale (modgen SM_SCALED) or the unfolded twin.
    # Measured (H200, bf16, ALiBi, same run, folded / unfolded TFLOP/s, hopper-mods-…-0625, -0630, -0650):
    # D=128 S2k 495 / 471, S4k 524 / 486, S8k 526 / 512 and 532 / 513, S16k 533 / 515 and 523 / 520;
    # D=64 S2k 346 / 358, S4k 349 / 366 (both runs), S16k 364 / 363 (twice). The folded SASS has 240 fewer FMULs at either head dim; why D=64 runs
    # slower with it is not understood: D=64 keeps the unfolded form.
    fold_sm_scale: bool = True
    # FP8 launches only (templates/hopper_fp8/configs.py sets it; 16-bit launches never read it): the FP8 softmax
    # with a shorter per-tile dependency chain, the consumer warpgroup's critical path at FP8 rates
    # (docs/design/hopper_fp8.md, "Cycle budget"): P's per-tile V shift by one lg2.approx against a per-query-tile
    # log2(VS_MAX) (was a division and a libdevice log2, scheduled between the QK^T wgmma issues), int8 scores
    # biased by 1.5·2^23 with the bias folded into the exp2 FFMA's row offset (no float subtract per score, without
    # a score_mod), the row max over two column halves (a 16-long FMNMX chain, not 32), and without mods (and N a
    # multiple of BLOCK_N) the two-level O update moved into the next softmax's idle issue slots. Mods that read captured buffers keep the
    # previous softmax (spills). False: the softmax before 2026-11-28, the A/B baseline of
    # benchmarks/fp8_kernel_ab.py (H200, fp8-kernel-ab-...-0529: the lean one 1.16-1.18x at D128 int8 noop).
    lean_fp8_softmax: bool = False
    # FP8 launches only (templates/hopper_fp8/configs.py, D=128): under a score_mod or mask_mod, with two-level
    # accumulation (its fresh PV accumulator) or a mask gathering ids from a buffer, the kernel holds nothing across
    # the KV loop that the loop does not read (fwd_sm90.Quant.TIGHT): those launches spilled 8-40 bytes of
    # kernel-wide scalars at D=128, none since (docs/design/hopper_fp8.md, "Spills under mods").
    fp8_tight_mods: bool = False
    # No longer fields (7bfe679), on wherever a launch qualifies:
    # - a bounded score_mod (softcap) with MAX not asked for runs against a fixed exponent base (no row max,
    #   no O / l rescale; fixed_base_for; docs/design/hopper_mods.md);
    # - a `score + alpha(b, h)·kv + B(b, h, q)` mod (modgen KV_AFFINE: ALiBi, relative bias) is evaluated as
    #   column / tile / row parts, one FFMA per score: ALiBi D=128 S2k-16k 0.91-0.96 of noop against 0.84-0.85
    #   unfolded per score (hopper-mods-nvidia-h200-2026-11-22-0825, -0827).
    # Removed: FlashAttention-4's lazy rescale (rescale O only when a row max outgrew the base by > 2^8): noop
    # B4 S4096 556 vs 570, B1 S16384 564 vs 600 TFLOP/s on vs off (hopper-mods-nvidia-h200-2026-11-22-0250),
    # still 4-7% slower at D=96 / 192 / 256 (-1405-lazy).

    @property
    def v_ring_stages(self) -> int:
        """Depth of the V ring: v_stages, or the K ring's num_stages where that is None."""
        return self.v_stages or self.num_stages

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2, o_stage: bool = False,
                   value_head_dim: int | None = None) -> int:
        """Shared memory of the Q tile, the K and V rings and (o_stage) the O staging tile, barriers aside."""
        dv = head_dim if value_head_dim is None else value_head_dim
        o_rows = self.block_m if o_stage else 0   # shared tiles hold exactly the head dim's columns
        return elem_bytes * (head_dim * (self.block_m + self.num_stages * self.block_n)
                             + dv * (o_rows + self.v_ring_stages * self.block_n))


SMEM_LIMIT = 227 * 1024   # bytes of shared memory a CTA may use on sm90 (barriers need a few more)

# Persistent (tile pairs + O staging buffer) vs one CTA per tile, H200, bf16, 16 heads, B*S = 16384,
# kernel launched directly, same run as cuDNN, median of 3 interleaved do_bench rounds, TFLOP/s
# (benchmarks/results/hopper-sched-nvidia-h200-2026-11-22-0304.*):
#   D=128 noop    S 1k / 2k / 4k / 16k: one CTA per tile 519 / 578 / 609 / 617, persistent 572 / 601 / 607 / 608,
#                                       cuDNN 553 / 587 / 596 / 605
#   D=128 causal  S 1k / 2k / 4k / 16k: one CTA per tile 351 / 443 / 505 / 595, persistent 410 / 487 / 534 / 569,
#                                       cuDNN 407 / 484 / 501 / 559
#   S 2k, D=64 noop / causal: 398 / 299 -> 437 / 356 (cuDNN 441 / 371); D=256: 629 / 481 -> 628 / 511 (623 / 540)
# With few KV blocks per tile the per-tile fixed costs (Q load, pipeline fill, epilogue) dominate and the
# persistent CTA hides them under the previous tile; at 16k tokens a tile is 128 KV blocks long, nothing is
# left to hide, and the coarse pair granularity / static order costs 1.5% (noop) to 4% (causal).
# With no more tiles than SMs, pairs would leave half of the SMs idle.
# Block-sparse masks, same setup, persistent / one CTA per tile (hopper-sched-masks-nvidia-h200-2026-11-22-0848):
#   causal           S 1k / 2k / 4k / 8k / 16k: 416 / 514 / 549 / 572 / 587 against 357 / 448 / 509 / 553 / 598
#   document (ids read by the mask_mod, causal inside): 73 / 164 / 283 / 404 / 361 against 82 / 189 / 298 / 384 / 421
#   sliding window 256: 205 / 128 / 182 / 223 / 225 against 186 / 151 / 184 / 198 / 199 (2k rounds 123-146: noisy;
#     an earlier run had 8k / 16k the other way round, 184 / 186 against 191 / 199)
# Document masks (tile costs follow the data) went either way: with this script's documents one CTA per
# tile was 5-16% faster up to 4k, but through the product path with benchmarks/bench.py's documents it was
# 5-7% slower at 2k / 4k (bench-nvidia-h200-2026-11-22-0854 against -0731: 222 / 271 against 234 / 290,
# rounds within 1%). No rule for masks that read buffers is kept.
# What decides is the longest tile, not kv_len: sliding windows, persistent / one CTA per tile, S 4k / 8k /
# 16k (hopper-window-nvidia-h200-2026-11-22-0929, rounds within 2%): 256 keys (3 KV tiles) 228 / 219 / 210
# against 197 / 196 / 197; 1024 keys (9 tiles) 433 / 431 / 434 against 407 / 406 / 411; 4096 keys (33
# tiles) 541 (4k) / 523 / 497 against 506 / 526 / 537. So the limit applies to the longest tile's KV
# tiles under a block mask (max_kv_tiles): the same cut as kv_len <= 4096 for dense and causal launches.
# Up to 8192 keys of KV (Sm90Config.persistent_to_8k, D=128): persistent / one CTA per tile, kernel launched
# directly, same run, 5 rounds (hopper-sched-masks-nvidia-h200-2026-11-22-1108): S 8k causal 567 / 547 (and
# 572 / 553, 567 / 549, 562 / 542 in -0848, -1021-evenn, -1040), noop 621 / 617; a 4096-key window (33 tiles)
# 529 / 533 at 8k but 503 / 536 at 16k (as in -0929), causal 16k 581 / 584. So tiles of up to 64 KV tiles
# go persistent only while the whole KV length is at most 8192. Dense S 8k, same run, 5 rounds
# (hopper-mods-nvidia-h200-2026-11-22-1121): noop 605 / 594, softcap 540 / 532, but ALiBi (KV_AFFINE, whose
# column vector spills a little in the persistent schedule) 549 / 576: KV_AFFINE launches keep the 4096 cut.
PERSISTENT_MAX_N = 4096
PERSISTENT_MAX_N_SHORT_KV = 8192


def use_persistent(cfg: Sm90Config, num_tiles: int, num_sms: int, kv_len: int,
                   max_kv_tiles: int | None = None, kv_affine: bool = False) -> bool:
    """Persistent grid or one CTA per tile, for num_tiles 128-row query tiles over kv_len keys on num_sms SMs.

    The persistent schedule pays where tiles are short (their fixed costs then hide under the previous
    tile): at most PERSISTENT_MAX_N keys' worth of KV tiles (PERSISTENT_MAX_N_SHORT_KV while kv_len is no
    longer than that, for configs with persistent_to_8k, unless the launch evaluates a KV_AFFINE mod, whose
    column vector spills in the persistent schedule at D=128). max_kv_tiles, where known, is the longest
    tile's KV tile count under a block mask (a sliding window's tiles stay short at any kv_len);
    otherwise every tile is taken to span kv_len.

    Example::

        >>> use_persistent(get_config(128), num_tiles=2048, num_sms=132, kv_len=16384, max_kv_tiles=3)
        True
    """
    if cfg.persistent is not None:
        return cfg.persistent
    tiles = -(-kv_len // cfg.block_n) if max_kv_tiles is None else max_kv_tiles
    longer = cfg.persistent_to_8k and not kv_affine and kv_len <= PERSISTENT_MAX_N_SHORT_KV
    limit = PERSISTENT_MAX_N_SHORT_KV if longer else PERSISTENT_MAX_N
    return num_sms > 0 and num_tiles > num_sms and tiles * cfg.block_n <= limit


# key: (head_dim, dtype) -> config. bf16 and fp16 share tiles (same wgmma shapes, same bytes). fp16, same
# run as cuDNN (bench-nvidia-h200-2026-11-22-1504-fp16): noop D=128 from 2k 1.01-1.08x, causal 1.05-1.18x,
# D=64 0.98x, D=256 1.07 / 1.15x; within the bf16 figures' spread, so no separate fp16 entries.
_TABLE: dict[int, Sm90Config] = {
    # D=64: 128x128 tiles, 3 stages (96 KB of K/V ring + 16 KB Q): tiles are cheap to hold and
    # short to compute, so a deeper ring could hide more TMA latency. S=64 regs, O=32 regs/thread.
    # H100, B4 H32 S4096: 3 stages 415, 2 stages 416 TFLOP/s (a tie), cuDNN 454 in the same run.
    64: Sm90Config(block_m=128, block_n=128, num_stages=3, sfu_mod_exp2_emu=True, fold_sm_scale=False),
    # D=128: the prototype structure of docs/facts.md: 128x128, 2 stages (164 KB), pingpong + overlap.
    # H100 (this kernel, 3 rounds): B4 H32 S4096 583-585 vs cuDNN 573-591; B2 H16 S8192 599 vs 581;
    # 3 stages is slower in every run (565 / 577), as in the H200 prototype (585 / 600 vs 594 / 608).
    # Pingpong on vs off is inside the run-to-run noise on H100 (see docs/design/hopper_kernel.md); kept on, as on H200.
    128: Sm90Config(block_m=128, block_n=128, num_stages=2, persistent_to_8k=True),
    # D=96: the D=128 tiles, QK^T stopping at 96 and O as 64 + 32 columns, so no wgmma multiplies padding;
    # Q / K / V / O as two shared tiles each, 64 + 32 columns (split tiles). H200, product path, same run as
    # cuDNN (bench-nvidia-h200-2026-11-22-1402, 21 heads, one 128-wide padded tile per operand then): noop
    # S2k / 8k 484 / 509 against cuDNN 458 / 437, causal 413 / 460 against 378 / 413; with O padded to 128
    # columns 470 / 498 (-1354-pv-padded). Split against padded shared tiles, kernel launched directly, same
    # run (hopper-mods-nvidia-h200-2026-11-22-1653-split-d96-d80): noop S8k 516 / 482, S2k 487 / 485; softcap and
    # ALiBi within 3% either way; 3 stages 514 / 487 (no gain).
    96: Sm90Config(block_m=128, block_n=128, num_stages=2, persistent_to_8k=True),
    # D=80 (Phi-2, Pythia): the same, 64 + 16 columns. Same run as cuDNN (bench-…-1421, 25 heads, padded
    # tiles): noop S2k / 8k 436 / 440 against 380 / 371, causal 357 / 407 against 321 / 338. Split against
    # padded (-1653-split-d96-d80): noop S8k 465 / 427, S2k 439 / 431; softcap 385 / 378 and 363 / 369.
    80: Sm90Config(block_m=128, block_n=128, num_stages=2, persistent_to_8k=True),
    # D=256: O alone is 128 fp32 regs/thread, so BLOCK_N 64 (S 32 regs, P 16); 2 stages:
    # 64 KB Q + 128 KB K/V = 192 KB (3 stages would be 256 KB > 227 KB).
    # H100, B4 H16 S4096: 647 TFLOP/s vs cuDNN 637 in the same run. No room for the persistent mode's
    # O staging buffer (64 KB Q + 64 KB O + 128 KB K/V > 227 KB): persistent reuses the Q buffer for O.
    256: Sm90Config(block_m=128, block_n=64, num_stages=2),
    # D=192: split shared tiles (128 + 64 columns: 48 KB per 128-row operand instead of 64 KB padded) make
    # room for BLOCK_N 128 with one K and two V stages (48 + 48 + 96 = 192 KB). Without the intra-warpgroup
    # overlap: with it, S of two tiles + O (96) need more than 240 registers (58 spill instructions).
    # Kernel launched directly, same run, B2 H10 S8k / B8 H10 S2k (hopper-mods-nvidia-h200-2026-11-22-1651-split-d192):
    # padded BLOCK_N 64 tiles (the previous entry) 566 / 549, split BLOCK_N 64 600 / 566, split 128 with
    # K 2 + V 1 stages 609 / 574, K 1 + V 2 622 / 584 (this entry). A fixed-base softcap (no row max, no O
    # rescale) loses with it, 613 -> 544 and 562 -> 541: bounded launches take FIXED_BASE_TABLE's entry.
    # Product path, same run as cuDNN (bench-nvidia-h200-2026-11-22-1703, 10 heads): noop S2k / 8k 580 / 618
    # against 601 / 617, causal 499 / 562 against 501 / 565 (the previous entry: 0.92-0.93x and 0.88-0.91x).
    192: Sm90Config(block_m=128, block_n=128, num_stages=1, v_stages=2, overlap=False),
    # D=160: split shared tiles (128 + 32 columns) fit BLOCK_N 128 with two K/V stages (40 + 160 = 200 KB),
    # and S of two tiles + O (80 registers) fit 240 with the overlap. Same kind of run (-1652-split-d160), B2 H12 S8k / B8 H12
    # S2k: padded BLOCK_N 64 tiles (the previous entry) noop 457 / 435, softcap 454 / 438; split BLOCK_N 64
    # with 3 stages 542 / 532; split 128 noop 634 / 587 (without the overlap 568 / 523), softcap 604 / 571.
    # Product path, same run as cuDNN (bench-…-1703, 12 heads): noop S2k / 8k 608 / 631 against 502 / 538,
    # causal 496 / 583 against 429 / 487.
    160: Sm90Config(block_m=128, block_n=128, num_stages=2),
}


def tile_head_dim(head_dim: int) -> int:
    """The head dim rounded up to a power of two (Gluon tensors and descriptor blocks have power-of-two
    shapes): split_head_dim's LO is half of it for a head dim that is not a power of two.

    Example::

        >>> tile_head_dim(96), tile_head_dim(128)
        (128, 128)
    """
    return 1 << (head_dim - 1).bit_length()


def split_head_dim(head_dim: int) -> tuple[int, int]:
    """(LO, HI): the column widths the kernel's GEMMs cover for a head dim, LO + HI = head_dim, both
    powers of two (HI = 0 for a power-of-two head dim). The table offers a padded head dim only where
    HI is a power of two >= 16 (the wgmma K step): 80 = 64 + 16, 96 = 64 + 32, 160 = 128 + 32, 192 = 128 + 64.

    Example::

        >>> split_head_dim(96), split_head_dim(128)
        ((64, 32), (128, 0))
    """
    tile = tile_head_dim(head_dim)
    return (tile, 0) if tile == head_dim else (tile // 2, head_dim - tile // 2)


# Launches whose score_mod runs against a fixed exponent base (fixed_base_for: softcap; no row max, no O
# rescale) where that wants other tiles than the table's: at D=192 the rescale the BLOCK_N 128 entry saves
# is not there to save, and the overlap it gives up is worth more (see the 192 entry).
FIXED_BASE_TABLE: dict[int, Sm90Config] = {
    192: Sm90Config(block_m=128, block_n=64, num_stages=2),
}

# V (and O) with a head dim other than Q's and K's: (q/k head dim, v head dim) -> config. DeepSeek-V2/V3's
# multi-head latent attention in its training form (q/k 128 + 64 rope columns, v 128). Q and K sit in
# split shared tiles of 128 + 64 columns, V and O in one 128-column tile: 48 KB per K stage, 32 KB per V
# stage, so two stages of each fit (48 + 2 * (48 + 32) = 208 KB), and O is the D=128 accumulator (64
# registers), so the intra-warpgroup overlap fits too. Persistent up to 8192 keys: H200, kernel launched directly,
# persistent / one CTA per tile, 5 rounds (hopper-sched-masks-nvidia-h200-2026-12-01-0046-192-128; the rule written
# before the run, docs/design/hopper_kernel.md): causal 8k 611 / 597 TFLOP/s (1.024x), noop 8k 674 / 680 (0.990x).
PAIR_TABLE: dict[tuple[int, int], Sm90Config] = {
    (192, 128): Sm90Config(block_m=128, block_n=128, num_stages=2, persistent_to_8k=True),
}

SUPPORTED_HEAD_DIMS = tuple(sorted(_TABLE))
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def get_config(head_dim: int, dtype: torch.dtype = torch.bfloat16, fixed_base: bool = False,
               value_head_dim: int | None = None, **overrides) -> Sm90Config:
    """The table's config for (head_dim, dtype), with optional field overrides (for ablations).
    fixed_base: for a launch whose scores run against a fixed exponent base (FIXED_BASE_TABLE).
    value_head_dim: V's (and O's) head dim where it differs from Q's and K's (PAIR_TABLE).

    Example::

        >>> get_config(192).block_n, get_config(192, fixed_base=True).block_n
        (128, 64)
        >>> get_config(192, value_head_dim=128).num_stages
        2
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"sm90 forward: unsupported dtype {dtype}")
    dv = head_dim if value_head_dim is None else value_head_dim
    if not serves_head_dims(head_dim, dv):
        raise ValueError(f"sm90 forward: unsupported head dims {head_dim} (q, k) / {dv} (v); it serves "
                         f"{served_head_dims_text()}")
    if dv != head_dim:
        cfg = PAIR_TABLE[(head_dim, dv)]
    else:
        cfg = FIXED_BASE_TABLE.get(head_dim, _TABLE[head_dim]) if fixed_base else _TABLE[head_dim]
    return replace(cfg, **overrides) if overrides else cfg


# Launches without a score_mod, a mask_mod or a block mask (16-bit, not packed, no sinks) whose query and key lengths
# are both at least this (the measured shapes; such KV never takes the persistent schedule) take the head dim's 192-row
# tile: three consumer warpgroups of 64 rows (fwd_sm90.TileShape.CONSUMERS), 160 registers each. D64: the softmax
# outlasts a tile's GEMMs there, and a third warpgroup keeps the tensor cores busier.
# H200, bf16, noop, 192- over 128-row tile (hopper-mods-nvidia-h200-2026-11-30-1048-m192, -1049-m192-len; the rule
# written before the run: from the length where it is >= 1.03 there and at every longer one): B4 H16 S4096 1.00 /
# 1.01, B2 S8192 1.12, B1 S16384 1.12 / 1.14. Softcap ran 0.92 / 0.96 with it (its tanh and exp2 crowd the MUFU).
LONG_DENSE_TILE_FROM = {64: 8192}
LONG_DENSE_TILE = dict(block_m=192, consumer_regs=160, maxnreg=128)


def long_dense_config(cfg: Sm90Config, head_dim: int, query_len: float, kv_len: float) -> Sm90Config:
    """The config of a launch without a score_mod, a mask_mod or a block mask (16-bit, not packed, no sinks) whose
    table config is ``cfg``: the 192-row tile where both lengths reach LONG_DENSE_TILE_FROM's, else ``cfg``.

    Example::

        >>> [long_dense_config(get_config(64), 64, n, 8192).block_m for n in (4096, 8192)]
        [128, 192]
        >>> long_dense_config(get_config(64), 64, 8192, 2048).block_m, long_dense_config(get_config(128), 128, 16384,
        ...                                                                              16384).block_m
        (128, 128)
    """
    if min(query_len, kv_len) >= LONG_DENSE_TILE_FROM.get(head_dim, float("inf")):
        return replace(cfg, **LONG_DENSE_TILE)
    return cfg


def serves_head_dims(head_dim: int, value_head_dim: int | None = None) -> bool:
    """Whether the table has tiles for Q / K of head_dim and V / O of value_head_dim (default: the same).

    Example::

        >>> serves_head_dims(128), serves_head_dims(112), serves_head_dims(192, 128), serves_head_dims(128, 64)
        (True, False, True, False)
    """
    dv = head_dim if value_head_dim is None else value_head_dim
    return head_dim in _TABLE if dv == head_dim else (head_dim, dv) in PAIR_TABLE


def served_head_dims_text() -> str:
    """The head dims the table serves, in words for messages.

    Example::

        >>> served_head_dims_text()
        '64, 80, 96, 128, 160, 192, 256, and q/k 192 with v 128'
    """
    same = ", ".join(map(str, SUPPORTED_HEAD_DIMS))
    pairs = " or ".join(f"q/k {d} with v {dv}" for d, dv in sorted(PAIR_TABLE))
    return f"{same}, and {pairs}" if pairs else same


def describe(head_dim: int, dtype: torch.dtype = torch.bfloat16, value_head_dim: int | None = None) -> str:
    """The table's tiles for (head_dim, dtype[, value_head_dim]) in words, for logs and explain(); the
    schedule (one CTA per tile or persistent) is chosen per launch.

    Example::

        >>> describe(192)
        'tiles 128x128, 1 K + 2 V stages, shared tiles of 128 + 64 columns, pingpong, no overlap; fixed-base score mods: tiles 128x64, 2 K/V stages, shared tiles of 128 + 64 columns, pingpong, overlap'
        >>> describe(192, value_head_dim=128)
        'tiles 128x128, 2 K/V stages, shared tiles of 128 + 64 columns, v 128 columns, pingpong, overlap'
    """
    def words(cfg: Sm90Config) -> str:
        stages = (f"{cfg.num_stages} K/V stages" if cfg.v_ring_stages == cfg.num_stages
                  else f"{cfg.num_stages} K + {cfg.v_ring_stages} V stages")
        parts = [f"tiles {cfg.block_m}x{cfg.block_n}", stages]
        lo, hi = split_head_dim(head_dim)
        if hi:
            parts.append(f"shared tiles of {lo} + {hi} columns")
        if dv != head_dim:
            vlo, vhi = split_head_dim(dv)
            parts.append(f"v {vlo} + {vhi} columns" if vhi else f"v {dv} columns")
        parts.append("pingpong")
        parts.append("overlap" if cfg.overlap else "no overlap")
        return ", ".join(parts)

    dv = head_dim if value_head_dim is None else value_head_dim
    cfg = get_config(head_dim, dtype, value_head_dim=dv)
    text = words(cfg)
    bounded = get_config(head_dim, dtype, fixed_base=True, value_head_dim=dv)
    if bounded != cfg:
        text += f"; fixed-base score mods: {words(bounded)}"
    return text


def all_configs():
    """Every shipped (head_dim, dtype, config) triple (the compile test iterates this), the fixed-base
    entries included."""
    for table in (_TABLE, FIXED_BASE_TABLE):
        for d, cfg in table.items():
            for dt in SUPPORTED_DTYPES:
                yield d, dt, cfg


def all_pair_configs():
    """Every shipped (head_dim, value_head_dim, dtype, config) of PAIR_TABLE (V's head dim differs)."""
    for (d, dv), cfg in PAIR_TABLE.items():
        for dt in SUPPORTED_DTYPES:
            yield d, dv, dt, cfg


# Fixed exponent base (the kernel's FIXED_BASE): p = 2^(t - base) for t within a bounded range of width
# W (log2 units). The base sits HEADROOM below the top, so p <= 2^HEADROOM (P, l and O stay finite) and
# p >= 2^(HEADROOM - W), which must stay a normal number of P's dtype (bf16: 2^-126, fp16: 2^-14).
_FIXED_BASE_RANGE = {torch.bfloat16: (64.0, 180.0), torch.float16: (15.0, 28.0)}   # (HEADROOM, max W)


def fixed_base_for(dtype: torch.dtype, lo: float, hi: float) -> float | None:
    """The exponent base (log2 units) for scores bounded to [lo, hi] (log2 units), or None when the
    range is too wide for P's dtype.

    Example::

        >>> fixed_base_for(torch.bfloat16, -43.3, 43.3)   # softcap 30, in log2 units
        -20.700000000000003
    """
    headroom, widest = _FIXED_BASE_RANGE.get(dtype, (0.0, -1.0))
    return hi - headroom if 0.0 <= hi - lo <= widest else None
