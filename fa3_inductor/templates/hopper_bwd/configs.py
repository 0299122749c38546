"""Tile table of the sm90 (Hopper) backward, one entry per head dim; each entry says why.

Register budget (every entry): 3 warpgroups (two consumer warpgroups + a 1-warp producer padded to a
warpgroup) start with maxnreg 168 (3 * 128 * 168 = 64512 registers), then setmaxnreg moves them to
240 / 240 / 24. A consumer thread holds dK and dV of its 64 keys (D / 2 fp32 registers each) across the loop,
and per step a [64, 64] fp32 tile (S, then dP: 32) and its part of the dQ tile (32).

Shared memory: K and V of the CTA's 128 keys (2 * 128 * D * 2 bytes), NUM_STAGES stages of Q and dO
(2 * 64 * D * 2 each), P of both warpgroups (2 * 64 * 64 * 2; twice that with a score_mod, whose f' is parked
beside it) and two dS buffers (2 * 64 * 128 * 2); with dq_tma two fp32 dQ staging tiles (2 * 64 * 64 * 4);
227 KB per CTA on sm90.

dq_tma and two schedule orders were the candidates docs/design/hopper_backward.md ("Gap") derived from the
compiled kernel (dP's wgmma beside S's, FA3's order; dQ's wgmma before dK's). Measured on an H100 (benchmarks/results/bwd-ab-nvidia-h100-80gb-hbm3-
2026-11-25-0609, B4 H16 N4096, backward alone against the atomic dQ): dq_tma 1.31x / 1.21x faster at D128
noop / causal, 1.07x / 1.09x at D64; dp_with_s 0.90-0.97x; dq_before_dk 0.84-1.05x; all three 0.96-1.20x.
So dq_tma is on in every entry and the two orders were removed from the kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

SMEM_LIMIT = 227 * 1024


@dataclass(frozen=True)
class BwdSm90Config:
    num_stages: int              # depth of the Q / dO ring
    consumer_regs: int = 240
    producer_regs: int = 24
    maxnreg: int = 168           # register cap at kernel entry (12 warps)
    dq_tma: bool = True          # dQ staged in shared memory, one TMA reduce-add per warpgroup and step (else
                                 # per-thread red.v2 atomics: 32 KB less shared memory, for tiles that need it)
    split_dkv: bool = False      # bwd_sm90_wide: 64-key CTAs, dK / dV / dQ columns split between the warpgroups
    overlap: int = 0             # cross-step overlap (D <= 128; docs/design/hopper_backward.md, "Cross-step
                                 # overlap"): the next step's S is issued before this step's dK / dQ are drained
                                 # and its exponentials run under them (1: under dK and dQ; 2: under dK only,
                                 # dQ issued after them: no dQ registers beside S). 0: off. With kv96, 1 issues
                                 # each step's dQ in the next step (bwd_sm90_k96's DQ_LAG)
    lpt_order: bool = False      # under a block mask, CTAs launched longest first inside groups of heads (host
                                 # _cta_order; bwd_sm90.py only, D <= 128): a shorter tail for irregular masks
    persistent: bool = False     # under a block mask, #SMs CTAs walking host-made tile lists (longest first), the
                                 # next tile's K / V loaded under this one's dK / dV stores (D = 128, the wide pairs)
                                 # or last steps (D = 64: a second K / V buffer, 176 KB) (host._persistent_schedule;
                                 # the wide kernel also without tables, host._shape_schedule)
    persistent_ctas: int = 0     # persistent: CTAs to launch (0: one per SM); tests set a few to give each many tiles
    block_m: int = 64            # query rows a step; 128: bwd_sm90_m128.py (D = 64 only, in-order step)
    p_regs: bool = False         # bwd_sm90.py: dS's P (times f') held in registers, not read back from shared
                                 # memory (the overlap carries it across a step: fp32 or 16 bits, host rule)
    stats_ahead: bool = True     # bwd_sm90.py: a step's LSE / DELTA rows loaded a step ahead, not where used
    dq_bufs: int = 1             # bwd_sm90_wide.py: fp32 dQ staging tiles a warpgroup (2: a chunk is staged while
                                 # the previous reduce-add still reads; the host keeps 1 where 2 do not fit)
    dq_frag: bool = True         # dQ staged and added in the wgmma fragments' order (DQ_ACC's 64 x 64 blocks
                                 # permuted, a convert pass that reads them so): 16-byte stores a thread, no bank
                                 # conflict; the host applies it to 64-row steps of whole 64-column chunks (not 80, 96,
                                 # 160 or m128). Every head dim's default: the backward 1.03-1.09x (H200, bwd-speed-
                                 # nvidia-h200-2026-11-29-1941-wide-frag, -1948-frag-d128; ALiBi 0.98-1.01x)

    kv96: bool = False           # 192 / 128: bwd_sm90_k96.py, 96-key CTAs of three 32-key warpgroups, dK / dV
                                 # transposed (2/3 of the wide kernel's dQ reductions); no block-mask tables
                                 # (an exactly causal mask_mod is walked) or packed sequences
    dkdv_tma: bool = False       # dK / dV stored through the warpgroups' dQ staging tiles by TMA (kv96; bwd_sm90.py at
                                 # D = 64 / 128 with dq_tma, dense), else stored from the accumulators' registers
    det_heads: int = 0           # deterministic dQ: (kz, hkv) heads of a launch-order group (bwd_sm90.py,
                                 # "Deterministic dQ"); 0: the host's rule

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2, value_head_dim: int | None = None) -> int:
        """Shared memory of K, V, the Q / dO ring, P, the two dS buffers and the dQ staging tiles (no score_mod),
        barriers aside."""
        if self.kv96:   # Q / dO ring, K and V of 96 keys, three P and six dS [64, 32] tiles, three fp32 staging tiles
            dv = value_head_dim or head_dim
            return elem_bytes * ((self.num_stages * 64 + 96) * (head_dim + dv) + 9 * 64 * 32) + 3 * 64 * 64 * 4
        if self.split_dkv:   # 64 keys; two P and two dS [64, 64] tiles; two fp32 [64, 64] dQ staging tiles
            dv = value_head_dim or head_dim
            return elem_bytes * (64 * (head_dim + dv) * (1 + self.num_stages) + 4 * 64 * 64) \
                + 2 * self.dq_bufs * 64 * 64 * 4
        kv = 2 * 128 * head_dim                  # K, V of the CTA's 128 keys
        if self.block_m == 128:   # 128-row Q / dO stages, P [128, 64] and dS [128, 128] x 2 (f' in dS), dQ staging
            return elem_bytes * (kv + self.num_stages * 2 * 128 * head_dim + 2 * 128 * 64 + 2 * 128 * 128) \
                + 2 * 64 * head_dim * 4
        ring = self.num_stages * 2 * 64 * head_dim    # Q, dO of 64 query rows per stage
        p_ds = 2 * 64 * 64 + 2 * 64 * 128           # P (one [64, 64] tile per warpgroup), two dS buffers
        dq_stage = 2 * 64 * 64 * 4 if self.dq_tma else 0   # fp32 [64, 64] per consumer warpgroup
        return elem_bytes * (kv + ring + p_ds) + dq_stage


_TABLE: dict[int, BwdSm90Config] = {
    # D=64: 32 KB K/V + 2 x 16 KB ring + 16 KB P + 32 KB dS + 32 KB dQ staging = 144 KB. dS from P (times f') in
    # registers (p_regs): the backward 1.07-1.09x faster on noop and causal, 1.18x on softcap at 4k and 8k (H200,
    # bwd-speed-nvidia-h200-2026-11-29-1603-preg / -1604-preg-8k; the masked rows' persistent schedule inherits it).
    64: BwdSm90Config(num_stages=2, p_regs=True),
    # D=128: 64 KB K/V + 2 x 32 KB ring + 16 KB P + 32 KB dS + 32 KB dQ staging = 208 KB (224 KB with a
    # score_mod). Cross-step overlap under dK (overlap 2): the backward 1.11-1.19x faster on noop, 1.05-1.07x
    # on ALiBi, 0.98-1.02x on causal and softcap (H200, bwd-speed-nvidia-h200-2026-11-29-0803-overlap); at D64
    # it was 0.93-1.04x, so D64 keeps the in-order step. dS's P carried in registers from the step that made it
    # (p_regs): the backward 1.07 / 1.09x on noop, 1.11 / 1.13x causal, 1.09 / 1.09x softcap, 1.06 / 1.10x sliding
    # window, 1.03 / 1.07x documents, 1.03 / 1.00x ALiBi at 4k / 8k (H200, bwd-speed-nvidia-h200-2026-11-29-1734-d128).
    128: BwdSm90Config(num_stages=2, overlap=2, p_regs=True),
}

# Launches whose score_mod has a derivative other than 1 (softcap, not ALiBi) and no mask_mod: a longer P chain per
# step, which the wider overlap (1: exponentials under dK and dQ) hides better. H200, bwd-speed-nvidia-h200-2026-11-29-
# 1020 (B*N = 16k, H16, bf16, softcap 30, no mask): softcap's backward 1.05x / 1.08x faster than overlap 2 at 4k / 8k
# (3.12 vs 3.28 ms, 5.85 vs 6.33; the rule written before the run: >= 3% at both lengths); ALiBi (derivative 1)
# 0.97x / 0.99x, so it keeps overlap 2. Compiled for sm90 (triton 3.6) it spills nothing, block-sparse tables
# included; with a mask_mod it spills in the step loop (softcap + causal 40 spill instructions, 10 in a step loop;
# overlap 2: 37, none in a loop), so masked launches keep overlap 2 (host.prepare_hopper_backward).
_GRAD_MOD_TABLE: dict[int, BwdSm90Config] = {
    128: BwdSm90Config(num_stages=2, overlap=1, p_regs=True),
}

# Head dims below 128 that are not a power of two run the 128 tiles: TMA fills the columns past D with zeros, which
# add nothing to S, dP, dK, dV or dQ, and the stores stop at D (bwd_sm90.BwdTile.HEAD_D_IN). A third of the wgmma
# work at D96 multiplies zeros (D80: 0.6); FlexAttention's backward, which served them before, is slower still.
PADDED_HEAD_DIMS: dict[int, int] = {80: 128, 96: 128}

SUPPORTED_HEAD_DIMS = tuple(sorted([*_TABLE, *PADDED_HEAD_DIMS]))

# Head dims whose launches under a block mask take the persistent schedule (host._persistent_schedule): one CTA an SM
# walking KV tiles longest first, the next tile's K / V loaded under this one's last work. H200, one run with the
# schedules timed in interleaved rounds (bwd-speed-nvidia-h200-2026-11-29-1309-masks2; backward over the hardware's
# launch order at 4k / 8k): D64 causal 1.09 / 1.07, sliding window 1.07 / 1.08, documents 1.07 / 1.09; D128 causal
# 1.04 / 1.04, sliding window 1.09 / 1.15, documents 1.06 / 1.04; noop (the same kernel, an A/A) 0.997-1.024. The rule
# written before the run (>= 3% on sliding window and documents, <= 2% slower on causal, both lengths) held at both.
PERSISTENT_HEAD_DIMS = (64, 128)

# Wide head dims (q/k, v) -> config: bwd_sm90_wide.py, dK and dV split along the head dim between the two
# consumer warpgroups (docs/design/hopper_backward.md, "Wide head dims").
WIDE_TABLE: dict[tuple[int, int], BwdSm90Config] = {
    # 32 KB K + 32 KB V + one 64 KB Q / dO stage + 16 KB P + 16 KB dS + 32 KB dQ staging = 192 KB (+8 KB f'
    # with a score_mod); a second stage would be 256 KB.
    # (p_regs: dS's P in registers, the backward 1.01-1.05x on noop / causal / softcap at both pairs, H200,
    # bwd-speed-nvidia-h200-2026-11-29-1824-wide-preg)
    (256, 256): BwdSm90Config(num_stages=1, split_dkv=True, p_regs=True),
    # 24 + 16 KB K, V + 2 x 40 KB Q / dO + 16 + 16 KB P, dS + 4 x 16 KB dQ staging = 216 KB (224 KB with a score_mod).
    # Two staging tiles a warpgroup (dq_bufs): warpgroup 1 stages its second dQ chunk while the first one's reduce-add
    # still reads, the backward 1.24-1.25x faster on noop and causal at 4k and 8k (H200, bwd-speed-nvidia-h200-2026-11-
    # 29-1921-wide-dq; at (256, 256) 0.96-1.01x: it keeps one, and has no room for two beside a score_mod's f').
    (192, 128): BwdSm90Config(num_stages=2, split_dkv=True, p_regs=True, dq_bufs=2),
}

# Wide pairs whose launches without a score_mod derivative other than 1 (noop, ALiBi, masks) take the cross-step
# overlap (bwd_sm90_wide._head_overlap; two Q / dO stages, so not 256). H200, 192 / 128, backward over the in-order
# step: noop 1.10 / 1.11x, ALiBi 1.08 / 1.09x at 4k / 8k (bwd-speed-nvidia-h200-2026-11-29-1934-wide-overlap2), with
# dQ in fragment order noop 1.09 / 1.11x, ALiBi 0.99 / 0.99x (-1949-wide-overlap3); under block masks, once the next
# step's first row is loaded a step ahead, causal 1.09 / 1.10x, sliding window 1.02x, documents 1.00x (-2153-wide-
# ahead2; documents 1.03x more with that row read by one load, -2239-wide-one-load). softcap (0.90-0.93x) keeps the
# in-order step. Each adopted by a rule written before its run (docs/design/hopper_backward.md).
WIDE_PLAIN_OVERLAP = ((192, 128),)

# Wide pairs whose exactly causal launches (the walk without tables) take persistent CTAs (bwd_sm90_wide's PERSISTENT,
# lists from the shapes). H200 (bwd-speed-nvidia-h200-2026-11-30-0355-wide-persistent; backward over the grid launch
# at 2k / 4k / 8k): 192 / 128 causal 1.014 / 1.037 / 1.021 (fwd+bwd 0.90-0.92x cuDNN as GPU time, -0403-gpu-time-wide);
# D256 causal 1.018 / 1.020 / 0.998, noop 0.98-0.99 at both pairs, sliding window 0.97-0.99, documents 0.84-0.93. The
# rule written before the run (>= 1.02 in geometric mean, no length below 0.99) held for 192 / 128 causal only.
WIDE_CAUSAL_PERSISTENT = ((192, 128),)

# Wide pairs whose dense launches without a mask and either without a score_mod or with one whose derivative is not 1
# take 96-key tiles (bwd_sm90_k96.py) with each step's dQ issued in the next step (VARIANTS["kv96_lag"]). H200, backward
# over the wide kernel at 2k / 4k / 8k: softcap 1.11 / 1.12 / 1.11 with 96-key tiles (bwd-speed-nvidia-h200-2026-11-30-
# 0607-kv96-softcap; -0605-kv96: 1.11 / 1.11 / 1.10), then the late dQ over them 1.04 / 1.05 / 1.06 (-0613-kv96-lag);
# noop 1.08 / 1.09 / 1.06 with the late dQ (-0618-kv96-persistent; -0613: 1.08 / 1.09 / 1.05). Each rule was written
# before its run (docs/design/hopper_backward.md, "96-key tiles at 192 / 128" and the sections after it). Not taken:
# linear score_mods (ALiBi) and masked launches, where the late dQ spills in the step loop (sm90, triton 3.6: ALiBi
# 4 / 4 / 1 spill instructions in the three loops, softcap + causal 7 / 6 / 1) and which were not measured; causal
# (persistent 96-key CTAs 1.017 / 1.020 / 1.022, below the rule's 1.02 mean) and packed sequences (varlen.py).
WIDE_KV96_LAG = ((192, 128),)

# Wide pairs whose exactly causal launches without a score_mod take persistent 96-key CTAs with dK / dV stored by TMA
# (VARIANTS["kv96_persistent_tma"]). H200, backward over the wide kernel's persistent walk at 2k / 4k / 8k: 1.07 /
# 1.06 / 1.05 (bwd-speed-nvidia-h200-2026-11-30-0756-kv96-tma; fwd+bwd 0.95 / 0.96 / 0.94x cuDNN). The rule written
# before the run (>= 1.03 at each length) held. The same epilogue on the no-mask default (kv96_lag) did not: 1.01 /
# 1.00 / 0.99 (docs/design/hopper_backward.md, "What a 96-key CTA costs beside its steps").
WIDE_CAUSAL_KV96 = ((192, 128),)

# Wide pairs whose launches without a score_mod or a mask take the late dQ on persistent 96-key CTAs with dK / dV stored
# by TMA (VARIANTS["kv96_lag_persistent_tma"]). H200, backward over kv96_lag at 2k / 4k / 8k: 1.023 / 1.021 / 1.023
# (bwd-speed-nvidia-h200-2026-11-30-0802-kv96-lag-persistent; the rule written before the run: >= 1.02 at each length).
# Not taken: softcap (3 / 2 / 0 spill instructions in its step loops, unmeasured), causal (0.97 / 1.00 / 1.02 of
# kv96_persistent_tma in the same run).
WIDE_PLAIN_KV96_PERSISTENT = ((192, 128),)

# Wide pairs whose exactly causal launches without a score_mod take the late dQ on persistent 96-key CTAs
# (VARIANTS["kv96_lag_persistent_tma"]) from this query length on: where causal tiles walk many steps, its cheaper step
# outweighs its dearer tile (ten values reloaded a step under causal). H200, backward over kv96_persistent_tma at 4k /
# 8k / 16k: 1.000 / 1.017 / 1.026 (bwd-speed-nvidia-h200-2026-11-30-1006-lag-causal; the rule written before the run:
# from the first length >= 1.02 with every longer one, so 16k).
WIDE_CAUSAL_KV96_LAG_FROM = {(192, 128): 16384}

# Tiles whose launches store dK / dV through the dQ staging tiles by TMA (VARIANTS["dkdv_tma"]; the 96-key schedules set
# it themselves; padded pairs and packed sequences keep their stores). H200, backward over the gl.store epilogue at 4k /
# 8k, each rule written before its run (docs/design/hopper_backward.md, "dK / dV by TMA ..."):
# - D64 (bwd-speed-nvidia-h200-2026-11-30-0814-dkdv-tma-d64): noop 1.03 / 1.02, causal 1.02 / 1.00, softcap 1.02 /
#   1.01, ALiBi 1.01 / 1.01, sliding window 1.07 / 1.07, documents 1.09 / 1.05 (geometric mean 1.032);
# - D256 (-0831-dkdv-tma-wide): noop 1.00 / 1.00, causal 1.04 / 1.02, ALiBi 1.02 / 1.01, sliding window 1.06 / 1.06,
#   documents 1.08 / 1.05 (1.034); 192 / 128's wide-kernel launches: ALiBi 1.08 / 1.08, sliding window 1.05 / 1.05,
#   documents 1.08 / 1.06 (1.068).
# Not D128: its step got 6% slower with it (noop 0.94-0.95, -0812-dkdv-tma).
DKDV_TMA_TILES = ((64, 64), (192, 128), (256, 256))

# 160 and 192 (for q, k and v) run the 256 tiles the same way (the wide kernel; a quarter to 0.375 of its work
# multiplies zeros).
PADDED_WIDE_PAIRS: dict[tuple[int, int], tuple[int, int]] = {(160, 160): (256, 256), (192, 192): (256, 256)}

SUPPORTED_HEAD_DIM_PAIRS = tuple(sorted([(d, d) for d in SUPPORTED_HEAD_DIMS] + list(WIDE_TABLE)
                                        + list(PADDED_WIDE_PAIRS)))


def tile_head_dims(head_dim: int, value_head_dim: int | None = None) -> tuple[int, int]:
    """The (q/k, v) head dims of the kernel tiles that serve ``head_dim`` / ``value_head_dim`` (default the same):
    PADDED_HEAD_DIMS' 128 for 80 and 96, PADDED_WIDE_PAIRS' 256 for 160 and 192 (v's the same), else themselves.

    Example::

        >>> tile_head_dims(96), tile_head_dims(64), tile_head_dims(192), tile_head_dims(192, 128)
        ((128, 128), (64, 64), (256, 256), (192, 128))
    """
    pair = (head_dim, value_head_dim or head_dim)
    if pair in PADDED_WIDE_PAIRS:
        return PADDED_WIDE_PAIRS[pair]
    if pair[0] == pair[1] and head_dim in PADDED_HEAD_DIMS:
        return PADDED_HEAD_DIMS[head_dim], PADDED_HEAD_DIMS[head_dim]
    return pair


# The fields every 96-key schedule sets (bwd_sm90_k96.py: three consumer warpgroups, 16 warps at 128 on entry).
_KV96 = {"kv96": True, "consumer_regs": 160, "maxnreg": 128}

# Named schedules for A/B runs (benchmarks/bwd_speed.py --bwd-variants): field overrides of the table's entry.
VARIANTS: dict[str, dict[str, bool]] = {
    "default": {},
    "atomic_dq": {"dq_tma": False},
    "serial": {"overlap": 0},
    "overlap": {"overlap": 1},
    "overlap_dk": {"overlap": 2},
    # a third Q / dO stage: D64 only (160-176 KB; no spill at noop, causal, softcap, ALiBi, sm90 triton 3.6);
    # at D128 it would be 240 KB
    "stages3": {"num_stages": 3},
    # CTA schedules under block masks (docs/design/hopper_backward.md, "Masks against the tile bound"), on top of the
    # head dim's step (D128: the overlap under dK); the _serial ones with the in-order step (what was measured before
    # D128's default became the overlap; at D64 they are the same kernels as lpt_order / persistent)
    "lpt_order": {"lpt_order": True},
    "persistent": {"persistent": True},
    # the launch as it was before the masked / linear-mod rows of get_bwd_config: the hardware's CTA order, 64 rows
    # (and the wide kernel's grid for 192 / 128 causal)
    "launch_order": {"persistent": False, "lpt_order": False, "block_m": 64},
    "lpt_order_serial": {"lpt_order": True, "overlap": 0},
    "persistent_serial": {"persistent": True, "overlap": 0},
    # 128 query rows a step (bwd_sm90_m128.py, FA3's hdim-64 tile): D64 only, 224 KB
    "m128": {"block_m": 128},
    # LSE / DELTA loaded where they are used (the step's start, after dP's issue), as before stats_ahead: an A/B
    "stats_at_use": {"stats_ahead": False},
    # dS from P (times f') read back from shared memory in 16 bits: both head dims' step before p_regs became their
    # default (D128: the overlap's P not carried across the step)
    "p_smem": {"p_regs": False},
    # the wide kernel's dQ staging (bwd_sm90_wide.py): one or two fp32 tiles a warpgroup
    "dq_bufs1": {"dq_bufs": 1},
    "dq_bufs2": {"dq_bufs": 2},
    # dQ staged as the tiled [64, 64] fp32 chunk (every default before dq_frag; still what 80 / 96 / 160 and m128 run)
    "dq_tiled": {"dq_frag": False},
    # 192 / 128 on 96-key tiles (bwd_sm90_k96.py; docs/design/hopper_backward.md, "96-key tiles at 192 / 128"):
    # three consumer warpgroups at 160 registers (the kernel's entry at 128: 16 warps)
    "kv96": {**_KV96, "overlap": 0, "persistent": False, "dkdv_tma": False},
    # and each step's dQ issued in the next step, under its dP and dV (bwd_sm90_k96's DQ_LAG)
    "kv96_lag": {**_KV96, "overlap": 1, "persistent": False, "dkdv_tma": False},
    # and persistent CTAs walking lists made from the shapes, longest first (the wide kernel's PERSISTENT)
    "kv96_persistent": {**_KV96, "overlap": 0, "persistent": True, "dkdv_tma": False},
    # each with dK / dV stored through the dQ staging tiles by TMA (bwd_sm90_k96's DKDV_TMA)
    "kv96_tma": {**_KV96, "overlap": 0, "persistent": False, "dkdv_tma": True},
    "kv96_lag_tma": {**_KV96, "overlap": 1, "persistent": False, "dkdv_tma": True},
    "kv96_persistent_tma": {**_KV96, "overlap": 0, "persistent": True, "dkdv_tma": True},
    # and the three together (under causal it reloads ten loop-invariant values a step: 10 / 10 / 4 LDL in the loops)
    "kv96_lag_persistent_tma": {**_KV96, "overlap": 1, "persistent": True, "dkdv_tma": True},
    # D64 / D128 (bwd_sm90.py): dK / dV through the dQ staging tiles by TMA
    "dkdv_tma": {"dkdv_tma": True},
}


def get_bwd_config(head_dim: int, value_head_dim: int | None = None, grad_mod: bool = False, masked: bool = False,
                   curved: bool = False, causal: bool = False, packed: bool = False, plain: bool = False,
                   no_score_mod: bool = False, query_len: int = 0, deterministic: bool = False,
                   **overrides) -> BwdSm90Config:
    """The table's tiles for a head dim (q/k ``head_dim``, v ``value_head_dim``, default the same), with optional
    field overrides (tests, sweeps). What the launch has picks the row (host.prepare_hopper_backward says it):
    ``grad_mod``, a score_mod whose derivative is not 1 and no mask_mod; ``masked``, block-mask tables; ``curved``, a
    score_mod whose derivative is not 1, with or without a mask_mod; ``causal``, an exactly causal mask_mod's tables;
    ``packed``, packed sequences (varlen.py); ``plain``, no score_mod and no mask_mod; ``no_score_mod``, no score_mod
    (with or without a mask); ``query_len``, the launch's query rows (0: not known); ``deterministic``, dQ's adds in
    a fixed order (bwd_sm90.py, "Deterministic dQ"): the grid, no persistent CTAs or 96-key tiles.

    Example::

        >>> get_bwd_config(128).num_stages
        2
        >>> get_bwd_config(128).overlap, get_bwd_config(128, grad_mod=True).overlap
        (2, 1)
        >>> get_bwd_config(64, masked=True).persistent, get_bwd_config(128).p_regs
        (True, True)
        >>> get_bwd_config(128, **VARIANTS["atomic_dq"]).dq_tma
        False
        >>> get_bwd_config(192, 128, masked=True).overlap, get_bwd_config(192, 128, masked=True, curved=True).overlap
        (1, 0)
        >>> [get_bwd_config(*pair, masked=True, causal=True).persistent for pair in ((192, 128), (256, 256))]
        [True, False]
        >>> [get_bwd_config(192, 128, **t).kv96 for t in ({}, {"plain": True}, {"curved": True},
        ...                                                 {"curved": True, "masked": True})]
        [False, True, True, False]
        >>> get_bwd_config(192, 128, masked=True, causal=True, no_score_mod=True).dkdv_tma
        True
        >>> [get_bwd_config(192, 128, **t).persistent for t in ({"plain": True}, {"curved": True})]
        [True, False]
        >>> [get_bwd_config(*pair).dkdv_tma for pair in ((64, 64), (128, 128), (256, 256), (192, 128))]
        [True, False, True, True]
        >>> get_bwd_config(192, 128, curved=True).dkdv_tma   # (softcap without a mask: kv96_lag, its own stores)
        False
        >>> [get_bwd_config(192, 128, masked=True, causal=True, no_score_mod=True, query_len=n).overlap
        ...  for n in (8192, 16384)]
        [0, 1]
        >>> cfg = get_bwd_config(192, 128, plain=True, deterministic=True)
        >>> cfg.kv96, cfg.persistent, cfg.overlap
        (False, False, 1)
    """
    pair = (head_dim, value_head_dim or head_dim)
    tiles = tile_head_dims(*pair)   # the row of the tiles that serve the pair (80 / 96: 128; 160 / 192: 256)
    if tiles in WIDE_TABLE:
        cfg = WIDE_TABLE[tiles]
        if not (grad_mod or curved) and tiles in WIDE_PLAIN_OVERLAP:
            cfg = replace(cfg, overlap=1)
        if deterministic:   # the wide kernel on the grid: its ordered dQ adds need the KV-tile-major launch order
            pass
        elif causal and no_score_mod and tiles == pair and tiles in WIDE_CAUSAL_KV96 and not packed:
            long = query_len >= WIDE_CAUSAL_KV96_LAG_FROM.get(tiles, float("inf"))
            cfg = replace(cfg, **VARIANTS["kv96_lag_persistent_tma" if long else "kv96_persistent_tma"])
        elif plain and tiles == pair and tiles in WIDE_PLAIN_KV96_PERSISTENT and not packed:
            cfg = replace(cfg, **VARIANTS["kv96_lag_persistent_tma"])
        elif (grad_mod or curved or plain) and tiles == pair and tiles in WIDE_KV96_LAG and not masked and not packed:
            cfg = replace(cfg, **VARIANTS["kv96_lag"])
        elif causal and tiles in WIDE_CAUSAL_PERSISTENT:
            cfg = replace(cfg, persistent=True)
    elif pair[0] != pair[1] or head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"sm90 backward: head dims {pair[0]}/{pair[1]} are not served (it serves "
                         f"{', '.join(f'{d}/{dv}' for d, dv in SUPPORTED_HEAD_DIM_PAIRS)}); use the generic "
                         "backward (templates/generic_bwd)")
    elif grad_mod and tiles[0] in _GRAD_MOD_TABLE:
        cfg = _GRAD_MOD_TABLE[tiles[0]]    # (its overlap 1 spills with the persistent schedule's state: grid order)
    elif masked and tiles[0] in PERSISTENT_HEAD_DIMS and not deterministic:
        cfg = replace(_TABLE[tiles[0]], persistent=True)
    else:
        cfg = _TABLE[tiles[0]]
    if tiles in DKDV_TMA_TILES and not packed and not cfg.kv96:
        cfg = replace(cfg, dkdv_tma=True)
    return replace(cfg, **overrides) if overrides else cfg
