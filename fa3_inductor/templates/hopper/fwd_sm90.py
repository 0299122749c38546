"""FlashAttention-3-structure forward attention for Hopper (sm90), written in Gluon.

Notation
--------
  Q  [z, hq, m, d]   queries   (z = batch index b, hq = query head h, m = query position, d = head dim)
  K  [z, hkv, n, d]  keys      (n = key/value position; hkv = h // (Hq // Hkv): GQA by index, no copies)
  V  [z, hkv, n, dv] values (dv = d, or another head dim where the config table has the pair: PAIR_TABLE)
  O  [z, hq, m, dv]  output, written in place into the caller's tensor (any strides, last dim contiguous)
  M, N, D            query length, key/value length, head dim. M and N are arbitrary (ragged tails are
                     handled by TMA zero-fill on loads, TMA clipping on the O store, and an explicit
                     kv_idx < N mask on the last KV tile). A head dim that is not a power of two (80, 96,
                     160, 192) splits into LO + HI columns, both powers of two (QK_LO + QK_HI = D): Q and K
                     sit in two shared tiles each (SPLIT_QK, two TMA copies per tile) and QK^T is two
                     wgmmas (_qk_mma). V and O follow their own head dim Dv the same way (V_LO + V_HI,
                     SPLIT_V: two V tiles, two O accumulators, _pv_mma). A power of two: LO = D, HI = 0.
  BLOCK_M, BLOCK_N   query rows of a CTA tile (128: two consumer warpgroups of HALF_M = 64 rows each) and KV
                     rows of a ring stage; NUM_STAGES / V_STAGES: depth of the K / V rings.
  LSE[z, hq, m]      log2-domain logsumexp of the (modded, masked) scores: logsumexp_e(s) / ln 2
  MAX[z, hq, m]      log2-domain row max:  max(s) / ln 2.   Fully masked row: O = 0, LSE = MAX = -inf.
  SINKS[hq]          FLAGS.HAS_SINKS (attention sinks, gpt-oss): float32 logits, natural-log units, that join
                     each row's denominator in the epilogue (_with_sink): LSE includes them, O = acc / (l + 2^(sink -
                     m_run)), MAX is unchanged; a fully masked row gets O = 0, LSE = the sink.
  FP8 (QUANT.ON; operands from templates/fp8_prologue, layout in fp8_recipe.FP8Operands):
  Q8, K8             Q, K as float8_e4m3fn, or int8 (QUANT.QK_INT8: an s8 wgmma, exact int32 scores), after the
                     prologue's Hadamard rotation, same shapes
  VT [z, hkv, dv, n_pad]  V quantized and transposed (keys last; FP8 wgmma reads both operands K-major)
  QS [z, hq, ceil(M / Q_BLOCK)], KS / VS [z, hkv, ceil(N / KV_BLOCK)], VS_MAX [z, hkv]   float32 scales
                     (a block size 0: one scale per head). A KV tile lies inside one K / V scale block.
                     S = (Q8 K8^T)·QS[row]·KS[tile]; P = 2^(s·c - m + shift) in e4m3, shift =
                     min(8 + log2(VS[tile] / VS_MAX), 8) (P <= 2^8 < 448 with the tile's V scale folded
                     in); O accumulates P8 VT^T in units of VS_MAX / 2^8 (TWO_LEVEL: each tile's PV in a
                     fresh wgmma accumulator added into the fp32 O); O = acc·VS_MAX / 2^8 / l, 16-bit.
                     The generic kernel's _kv_tile_fp8 is the same arithmetic (templates/generic/kernel.py).
  score_mod(qk, sm_scale, b, h, q_idx, kv_idx, bufs) -> the score (q . k) * sm_scale after the mod,
                     divided by the mod's positive OUT_SCALE (templates/modgen.py); qk is raw q . k
  mask_mod(b, h, q_idx, kv_idx, bufs) -> bool   False means "masked" (-inf)

Block sparsity (torch BlockMask format; the index tensors are int32):
  kv_num_blocks     [Bm, Hm, ceil(M / SPARSE_Q)]               number of *partial* KV blocks per query block
  kv_indices        [Bm, Hm, ceil(M / SPARSE_Q), ceil(N / SPARSE_KV)]  their KV block indices (mask_mod applied)
  full_kv_num_blocks, full_kv_indices  same shapes, blocks where mask_mod is all-true (mask_mod skipped,
                     only kv_idx < N is still masked)
  Bm in {1, B}, Hm in {1, Hq}: broadcast by b % Bm, h % Hm.  SPARSE_Q must be a multiple of BLOCK_M and
  SPARSE_KV a multiple of BLOCK_N (each sparse KV block expands into SPARSE_KV // BLOCK_N kernel tiles).
  kv_num_blocks=None means dense: every KV tile, and mask_mod (if given) applied on every tile.

Packed sequences (PACK.VARLEN; host side templates/hopper/varlen_sm90.py, front door flex_varlen):
  Q, K, V, O         packed (total, heads, D) tensors read and written in place through [1, H, total, D] views
                     (descriptor batch coordinate z = 0, row = token)
  CU_Q, CU_K [B + 1] int32: batch entry b is sequence b, query rows CU_Q[b] : CU_Q[b + 1] and key rows
                     CU_K[b] : CU_K[b + 1]; its M and N (M_seq, N_seq) are read on the device, never on the host
  LSE, MAX           [1, H, total_q]: row CU_Q[b] + q of head h
  mods               b = the sequence, q_idx / kv_idx positions within it (causal is top-left aligned)
  One CTA per tile over each head's virtual query tiles (TQ // BLOCK_M + B + 1 of them, their sequences in
  pack_args' TILES: hopper/tile_table.py; _tile_coords); a tile starting at or past its sequence's end runs nothing.
  A tile's Q rows and a KV tile's rows past the sequence's end are the next sequence's (or TMA's zero fill past the
  pack): kv_idx < N_seq masks them in the score, and an O half reaching past M_seq is stored by masked pointer
  stores (_store_rows), never TMA (which clips only at the pack's end). SPARSE.CAUSAL_WALK (a mask_mod exactly q_idx
  >= kv_idx): a query tile visits its diagonal KV tiles (mask_mod applied) and the tiles below them (no mask), none
  above, with no block-mask tables.

Decode caches (PACK.CACHE; host side templates/hopper/cache_sm90.py, front door flex_decode's chunks past 128 rows):
  Q, O               dense [B, HQ, M, D]: M new query rows of every sequence
  K, V               a contiguous cache [B, HKV, capacity, D] (PAGE = 0), or pages [P, PAGE, HKV, D] read as
                     [P, HKV, PAGE, D] through TABLE [B, max_pages] int32 (TABLE[b, j]: the page of keys j·PAGE ..)
  LENS [B] int32     sequence b's keys: N_seq = clamp(LENS[b], 0, capacity), capacity = N (max_pages · PAGE)
  FIRST [B] int32    query row m of sequence b sits at position FIRST[b] + FIRST_DELTA + m (flex_decode: q_offset,
                     or LENS with FIRST_DELTA = -M); the mods and the causal walk see these positions, a negative
                     one (a chunk longer than its sequence) as 0
  WINDOW             SPARSE.WINDOW: the mask_mod is a causal window of WINDOW keys (row p sees p - WINDOW + 1 .. p),
                     and the walk starts at its far edge (_window_walk)
  A KV tile of a paged cache is BLOCK_N // PAGE_BOX TMA boxes of PAGE_BOX = min(PAGE, BLOCK_N) rows, each at its
  page's row; the tile holding N_seq - 1 has its V rows at or past N_seq zeroed in shared memory by the consumers
  before its PV (an unwritten cache slot may hold NaN, and P = 0 times NaN is NaN); K's are masked by kv_idx < N_seq.
  One CTA per tile, as dense launches; nothing is read on the host, so a CUDA graph replays new lengths.

Kernel roles (one CTA = one BLOCK_M x D output tile at a time; TILE.CONSUMERS + 1 warpgroups):
  * producer   (`_producer`, a 1-warp worker partition, padded to a warpgroup, 24 regs): TMA-loads the two
               64-row halves of Q once per tile and K/V tiles into rings of NUM_STAGES (K) and V_STAGES (V)
               stages guarded by mbarriers.
  * consumers  (`_consumer`, two 4-warp partitions = two warpgroups, 240 regs each; three at 160 regs on 192-row
               tiles, configs.LONG_DENSE_TILE): warpgroup w owns query rows [64w, 64w+64) of the tile.
               S = Q K^T and O += P V with wgmma; online softmax in registers with exp2 (log2 e folded into
               the scale); intra-warpgroup overlap (QK^T of tile j+1 is issued before the softmax of tile j);
               pingpong between the warpgroups (a ring of turns) through mbarriers (Gluon 3.6 has no named
               barriers).
  * epilogue   (`_epilogue`, run by each consumer warpgroup for its own rows: worker partitions cannot
               return tensors): O / l staged in that warpgroup's half of the Q buffer (O_STAGE: of a
               separate O buffer) and TMA-stored; LSE and MAX written with plain masked stores.

Schedules (configs.use_persistent): one CTA per tile, or PERSISTENT: #SMs CTAs walking tile pairs (a head's
longest + shortest query block: balanced under causal masks). With O_STAGE (persistent, D <= 128) a consumer
releases its Q half when its tile's last QK^T retired, so the next tile's Q and K/V load under the epilogue.

Barriers (all in shared memory):
  q_ready[w]  (count 1, TMA tx)   Q half w landed                          producer -> consumer w
  q_empty[w]  (count 1)           consumer w is done with Q half w         consumer w -> producer
                                  (its O staging store has completed; O_STAGE: its last QK^T retired)
  k_ready[s], v_ready[s] (count 1, TMA tx)   stage s of the K / V ring landed
  k_empty[s], v_empty[s] (count CONSUMERS)   every consumer warpgroup retired the wgmma reading stage s
  turn[w]     (count 1)           pingpong: warpgroup w may issue its next GEMMs; w arrives on
                                  turn[(w+1) % CONSUMERS] right after issuing. The last warpgroup pre-arrives turn[0].

Compile-time parameters (kernel constexprs, one named bundle each; frozen dataclasses defined below):
  SCORE_MOD, MASK_MOD  the @gluon.jit mods (or None)
  TILE    TileShape      BLOCK_M, BLOCK_N, QK_LO, QK_HI, V_LO, V_HI, NUM_STAGES, V_STAGES, CONSUMERS (HALF_M, SPLIT_QK,
                         SPLIT_V derived)
  SCHED   Schedule       PERSISTENT, O_STAGE, OVERLAP, CONSUMER_REGS, PRODUCER_REGS
  SPARSE  BlockSparsity  HAS_SPARSE, HAS_FULL, SPARSE_Q_DIV, SPARSE_KV_MULT, CAUSAL_WALK
  FLAGS   ModFlags       HAS_SCORE_MOD, HAS_MASK_MOD, DENSE_MASK, MASK_AND, EVEN_N, KV_AFFINE, FIXED_BASE, EXP2_EMU,
                         HAS_SINKS, WIDE_SCORES
  QUANT   Quant          ON, Q_BLOCK, KV_BLOCK, TWO_LEVEL, QK_INT8, LEAN, TIGHT (FP8 inputs; NO_QUANT for bf16 / fp16,
                         whose code it leaves untouched: the scales travel in a tuple argument that is empty there)
  PACK    Packing        VARLEN (packed sequences; DENSE for [B, H, S, D] launches, whose code it leaves untouched:
                         CU_Q, CU_K and O's strides travel in the tuple argument pack_args, empty there)
Every switch in them takes both of its values in some shipped launch (configs.all_configs() times the host's
per-launch choices); measured-and-dropped ablations (lazy rescale, pingpong off, padded shared tiles, exp2
emulation outside SFU-bound mods) last existed at commit 7bfe679 (benchmarks/hopper_ablation.py lists them).

Mods and captured buffers: `score_mod` / `mask_mod` are `@gluon.jit` functions passed as constexpr
kernel arguments. Captured buffers travel as a *tuple of tensors* kernel argument (`score_bufs`,
`mask_bufs`; tuples, possibly empty, are ordinary Triton/Gluon kernel arguments: each entry becomes a
pointer) and reach the mods as their `bufs` argument, read with `gl.load(bufs[i] + offset)`.
q_idx / kv_idx given to the mods are clamped to [0, M-1] / [0, N-1] so that mods that index buffers by
position never read out of bounds on the padded tail rows/columns (those results are discarded); when
N % BLOCK_N == 0 (EVEN_N) no tile has such columns and kv_idx goes unclamped. Positions must stay below
2^23 (modgen converts index vectors to float exactly in that range).

Specialization (one compile per kind of site, not per length): the integers that follow sequence lengths (M, N,
num_tiles, num_m_tiles, the block-mask tables' strides) are `do_not_specialize` (_RUNTIME_SIZES), so Triton's hints (divisible by 16, equal to 1) never split a site by length;
the descriptors' keys hold their block shapes and layouts, not the tensors' shapes. A length still decides EVEN_N
and PERSISTENT (with O_STAGE following it): prepare_fwd_sm90_variants gives a launch with its three siblings, which
runtime/variants.py compiles ahead.

Per-score cost matters more than anything else in the softmax: the consumer warpgroups are issue-bound
(docs/design/hopper_mods.md), so every instruction a mod or a mask check adds per score shows up.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..exp2_fma import exp2_tile, split_cols
from ..modgen import MAX_POSITION, kernel_score_mod, kv_affine_of, mask_and_of, mod_info, out_range_of, sfu_ops_of
from ..wide_scores import wide_scores
from ..sink_args import sink_bufs as kernel_sink_bufs
from ..tma import tma_aligned
from .configs import (SMEM_LIMIT, Sm90Config, fixed_base_for, get_config, long_dense_config, serves_head_dims,
                      split_head_dim, use_persistent)

LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------
# Constexpr bundles: the kernel's compile-time parameters, by name. Each is a frozen dataclass passed as one
# `gl.constexpr` argument (a Python value: `TILE.BLOCK_N` reads a field, a property computes from the fields at
# compile time). Frozen dataclasses hash and print by their fields, which is what Triton's specialization key
# needs; the mods stay separate constexprs (SCORE_MOD, MASK_MOD) so that Triton keys them by their source.
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TileShape:
    """Tile sizes and shared-memory rings. A head dim splits into LO + HI columns (split_head_dim): HI = 0 for
    a power of two, else Q / K (V / O) sit in two shared tiles per operand, [.., LO] and [.., HI]."""
    BLOCK_M: int       # query rows per CTA tile (CONSUMERS consumer warpgroups x HALF_M)
    BLOCK_N: int       # KV rows per ring stage
    QK_LO: int         # Q / K head-dim columns of the first tile (D itself where D is a power of two)
    QK_HI: int         # Q / K columns of the second tile (0: no second tile)
    V_LO: int          # V / O: the same for V's head dim Dv
    V_HI: int
    NUM_STAGES: int    # depth of the K ring
    V_STAGES: int      # depth of the V ring
    CONSUMERS: int = 2   # consumer warpgroups of HALF_M rows each, taking GEMM turns in a ring (3: 16-bit, dense,
                         # power-of-two head dims, no packed sequences)

    @property
    def HALF_M(self) -> int:
        return self.BLOCK_M // self.CONSUMERS

    @property
    def SPLIT_QK(self) -> bool:
        return self.QK_HI > 0

    @property
    def SPLIT_V(self) -> bool:
        return self.V_HI > 0


@dataclass(frozen=True)
class Schedule:
    """How CTAs walk tiles and how the warpgroups take turns."""
    PERSISTENT: bool    # grid = #SMs CTAs walking tile pairs (else one CTA per tile)
    O_STAGE: bool       # persistent (and every FP8 launch): O staged in its own buffer, Q released after the last QK^T
    OVERLAP: bool       # intra-warpgroup overlap: QK^T of tile j+1 issued before the softmax of tile j
    CONSUMER_REGS: int  # setmaxnreg of the consumer warpgroups
    PRODUCER_REGS: int  # setmaxnreg of the TMA producer


@dataclass(frozen=True)
class BlockSparsity:
    """The block mask's shape (torch BlockMask format; module docstring, "Block sparsity")."""
    HAS_SPARSE: bool      # KV tiles come from kv_num_blocks / kv_indices (else every KV tile)
    HAS_FULL: bool        # full_kv_num_blocks / full_kv_indices given (tiles where the mask_mod is all true)
    SPARSE_Q_DIV: int     # SPARSE_Q // BLOCK_M
    SPARSE_KV_MULT: int   # SPARSE_KV // BLOCK_N: kernel KV tiles per sparse KV block
    CAUSAL_WALK: bool = False   # no tables; the mask_mod is q_idx >= kv_idx (top-left aligned): a query tile walks
                                # its diagonal KV tiles (partial) and then the tiles below them (full), none above
    WINDOW: bool = False        # CAUSAL_WALK under a causal window of W keys (pack_args' WINDOW, CACHE or VARLEN):
                                # the walk starts at the window's far edge (_window_walk), the tiles it cuts partial


@dataclass(frozen=True)
class ModFlags:
    """What the mods and the lengths ask of the score tile and the softmax."""
    HAS_SCORE_MOD: bool
    HAS_MASK_MOD: bool
    DENSE_MASK: bool      # a mask_mod without a block mask: applied on every tile
    MASK_AND: bool        # the mask_mod ANDs conditions (modgen MASK_AND): one opaque select per score
    EVEN_N: bool          # N % BLOCK_N == 0: no KV tile crosses N (no bound mask, no index clamp)
    KV_AFFINE: bool       # `score + alpha(b, h)·kv + B(b, h, q)` evaluated as column / tile / row parts
    FIXED_BASE: bool      # bounded score_mod, MAX not asked for: exp2 against a fixed base, no row max
    EXP2_EMU: bool        # half of the score columns' exp2 on the FMA pipe (exp2_fma.py) instead of MUFU
    HAS_SINKS: bool = False   # sink_bufs holds SINKS: the epilogue adds each head's sink (_with_sink)
    WIDE_SCORES: bool = False  # the score_mod may return huge finite values: exp2's argument is the rounded
                               # score minus the rounded max, not one FFMA (templates/wide_scores.py)


@dataclass(frozen=True)
class Quant:
    """FP8 inputs (module docstring, "FP8"): e4m3 Q, K, VT with float32 block scales. ON=False (NO_QUANT) for
    16-bit inputs. The output dtype is O's descriptor's (bf16 or fp16), so it needs no field here."""
    ON: bool          # Q, K, VT are e4m3 with scales (else every other field is unused)
    Q_BLOCK: int      # query rows per Q scale (0: one per head)
    KV_BLOCK: int     # keys per K / V scale (0: one per head); a multiple of BLOCK_N
    TWO_LEVEL: bool   # each tile's P8 VT^T in a fresh wgmma accumulator, added into the fp32 O (Hopper's FP8
                      # MMA accumulates in about 22 bits: a long row chained in one accumulator loses accuracy)
    QK_INT8: bool = False   # Q and K are int8 (FP8Recipe.qk): S = Q8 K8^T in an s32 wgmma accumulator, exact,
                            # converted to fp32 before the scales (V and P stay e4m3)
    LEAN: bool = False      # Sm90Config.lean_fp8_softmax: the shorter per-tile chain (_fp8_tile_scales, _softmax_step's
                            # biased int8 scores, _row_max_halves, _fp8_overlap_loop's DEFER_O)
    TIGHT: bool = False     # Sm90Config.fp8_tight_mods under mods: their values leave the KV loop no spare register.
                            # Nothing held across the KV loop that the loop does not read: scalars derived from
                            # kernel arguments per tile (_opaque), the epilogue's coordinates and O staging address
                            # after the loop, MAX read off the exponent base, the next tile's K scale carried
                            # instead of QS·KS (docs/design/hopper_fp8.md, "Spills under mods")


NO_QUANT = Quant(ON=False, Q_BLOCK=0, KV_BLOCK=0, TWO_LEVEL=False)


@dataclass(frozen=True)
class Packing:
    """Where a tile's rows live (module docstring, "Packed sequences" and "Decode caches")."""
    VARLEN: bool   # Q / K / V / O packed (total, heads, D): batch entry b is sequence b of cu_seqlens, its M and N
                   # read on the device; one CTA per virtual query tile (pack_args' TILES: hopper/tile_table.py), a
                   # tile past its sequence's end runs nothing
    CACHE: bool = False   # K / V a decode cache: N and the query rows' first position per sequence, read on the device
    PAGE: int = 0         # CACHE: keys a page of a block-table cache (0: a contiguous [B, HKV, capacity, D] cache)
    PAGE_BOX: int = 0     # PAGE: rows of one TMA box, min(PAGE, BLOCK_N); a KV tile is BLOCK_N // PAGE_BOX boxes


DENSE = Packing(VARLEN=False)
PACKED_BLOCK_M = 128   # query rows of a packed launch's tile (two consumer warpgroups: no 192-row tiles there)


# ----------------------------------------------------------------------------------------------
# Tile scheduling and KV-block enumeration (shared by producer and consumers: both must walk the
# exact same sequence of tiles and KV blocks, or the barrier phases fall out of step).
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _tile_coords(tile_id, num_tiles, num_m_tiles, HQ, PERSISTENT: gl.constexpr, VARLEN: gl.constexpr, pack_args,
                 BLOCK_M: gl.constexpr):
    # Consecutive tiles share one (b, h) so that concurrently running CTAs reuse K/V in L2.
    # One CTA per tile: inside a head the query blocks run last-to-first (longest first for causal /
    # lower-triangular masks; the hardware hands tiles out in launch order).
    # Persistent: inside a head the query blocks alternate last, first, second-to-last, second, ...
    # so that the pair (2u, 2u+1) a CTA takes (_tile_loop) costs the same for every u under a
    # causal mask (nm + 1 KV blocks): a static schedule then stays balanced.
    # VARLEN: heads major (one head's K/V of the whole pack stays in L2), then the head's num_m_tiles virtual tiles
    # last to first (each sequence's last query tiles, the longest causal ones, before its first); sequence b's tile
    # mt is virtual tile CU_Q[b] // BLOCK_M + b + mt, the table (pack_args[6]) gives a virtual tile's b, and the one
    # past a sequence's last exits. (Until 2026-11-30 the grid gave every sequence the longest one's count of tiles,
    # most of them exiting on uneven packs: the table's launch is 1.02-1.10x faster, docs/design/varlen.md.)
    if VARLEN:
        h = tile_id // num_m_tiles
        v = num_m_tiles - 1 - tile_id % num_m_tiles
        b = gl.load(pack_args[6] + v)
        mt = v - (gl.load(pack_args[0] + b) // BLOCK_M + b)
    else:
        bh = tile_id // num_m_tiles
        r = tile_id % num_m_tiles
        if PERSISTENT:
            mt = gl.where(r % 2 == 0, num_m_tiles - 1 - r // 2, r // 2)
        else:
            mt = num_m_tiles - 1 - r
        b = bh // HQ
        h = bh % HQ
    return b, h, mt


@gluon.jit
def _tile_loop(num_tiles, num_m_tiles, HQ, pack_args, TILE: gl.constexpr, PERSISTENT: gl.constexpr,
               PACK: gl.constexpr):
    """(number of tiles this CTA runs, pid, #CTAs). Persistent CTAs take tile pairs (2u, 2u+1),
    u = pid, pid + #CTAs, ... (the grid is min(#pairs, #SMs)). VARLEN (one CTA per tile): none where the
    tile starts at or past its sequence's end."""
    pid = gl.program_id(0)
    if PACK.VARLEN:
        gl.static_assert(not PERSISTENT, "packed sequences run one CTA per tile")
        b, h, mt = _tile_coords(pid, num_tiles, num_m_tiles, HQ, False, True, pack_args, TILE.BLOCK_M)
        _z, _q0, M_seq, _k0, _N_seq, _q_pos = _seq_rows(b, 0, 0, pack_args, PACK)
        nprog = pid * 0 + 1
        n_it = gl.where(mt * TILE.BLOCK_M < M_seq, 1, 0)
    elif PERSISTENT:
        gl.static_assert(not PACK.CACHE, "decode caches run one CTA per tile")
        nprog = gl.num_programs(0)
        n_pairs = (num_tiles + 1) // 2
        my_pairs = (n_pairs - pid + nprog - 1) // nprog
        n_it = 2 * my_pairs
        last_u = pid + (my_pairs - 1) * nprog
        n_it = gl.where((num_tiles % 2 == 1) & (last_u == n_pairs - 1), n_it - 1, n_it)
    else:
        nprog = pid * 0 + 1
        n_it = pid * 0 + 1
    return n_it, pid, nprog


@gluon.jit
def _tile_id(it, pid, nprog, PERSISTENT: gl.constexpr):
    if PERSISTENT:
        tile_id = 2 * (pid + (it // 2) * nprog) + (it % 2)
    else:
        tile_id = pid
    return tile_id


@gluon.jit
def _seq_rows(b, M, N, pack_args, PACK: gl.constexpr):
    """(descriptor batch coordinate, first query row, M, first key row, N, position of query row 0) of batch entry
    b. Dense: b, 0, the launch's M and N, 0. VARLEN: sequence b of the packed rows, whose descriptors are
    [1, H, total, D] views. CACHE: b's keys LENS[b] clamped to [0, N] and its rows' positions FIRST[b] + FIRST_DELTA."""
    q_pos = 0
    if PACK.VARLEN:
        cu_q = pack_args[0]
        cu_k = pack_args[1]
        z = b * 0
        q0 = gl.load(cu_q + b)
        k0 = gl.load(cu_k + b)
        M_seq = gl.load(cu_q + b + 1) - q0
        N_seq = gl.load(cu_k + b + 1) - k0
    elif PACK.CACHE:
        z = b
        q0 = b * 0
        k0 = b * 0
        M_seq = M
        N_seq = gl.minimum(gl.maximum(gl.load(pack_args[0] + b), 0), N)
        q_pos = gl.load(pack_args[1] + b) + pack_args[2]
    else:
        z = b
        q0 = b * 0
        k0 = b * 0
        M_seq = M
        N_seq = N
    return z, q0, M_seq, k0, N_seq, q_pos


@gluon.jit
def _kv_counts(b, h, mt, N, sp_ptrs, sp_meta, TILE: gl.constexpr, SPARSE: gl.constexpr, q_pos=None, window=None):
    """Returns (n_partial, n_total): KV tiles of this query tile; the partial ones come first. q_pos: the position
    of query row 0 (PACK.CACHE; the causal walk's diagonal moves with it); window: SPARSE.WINDOW's W."""
    kvnb_ptr, kvidx_ptr, fnb_ptr, fidx_ptr = sp_ptrs
    BM, HM, nb_sb, nb_sh, idx_sb, idx_sh, idx_sm, fnb_sb, fnb_sh, fidx_sb, fidx_sh, fidx_sm = sp_meta
    if SPARSE.HAS_SPARSE:
        bb = b % BM
        hh = h % HM
        qb = mt // SPARSE.SPARSE_Q_DIV
        n_partial = gl.load(kvnb_ptr + bb * nb_sb + hh * nb_sh + qb) * SPARSE.SPARSE_KV_MULT
        if SPARSE.HAS_FULL:
            n_full = gl.load(fnb_ptr + bb * fnb_sb + hh * fnb_sh + qb) * SPARSE.SPARSE_KV_MULT
        else:
            n_full = n_partial * 0
    elif SPARSE.WINDOW:
        t_lo, f_lo, f_hi, t_hi = _window_walk(mt, q_pos, window, N, TILE)
        n_partial = (f_lo - t_lo) + (t_hi - f_hi)
        n_full = f_hi - f_lo
    elif SPARSE.CAUSAL_WALK:
        # KV tiles up to the tile's last row (or N); those wholly at or below its first row m0 are full
        m0 = _walk_row(mt, q_pos, TILE)
        n_total = gl.cdiv(gl.minimum(N, m0 + TILE.BLOCK_M), TILE.BLOCK_N)
        n_full = gl.minimum((m0 + 1) // TILE.BLOCK_N, n_total)
        n_partial = n_total - n_full
    else:
        n_partial = N * 0
        n_full = gl.cdiv(N, TILE.BLOCK_N)
    return n_partial, n_partial + n_full


@gluon.jit
def _walk_row(mt, q_pos, TILE: gl.constexpr):
    """The causal walk's first row position for query tile mt: mt·BLOCK_M + q_pos (None: 0), held at 0 or more (the
    mods see a negative position as 0; held, the walk's divisions never round a negative number)."""
    if q_pos is None:
        m0 = mt * TILE.BLOCK_M
    else:
        m0 = gl.maximum(mt * TILE.BLOCK_M + q_pos, 0)
    return m0


@gluon.jit
def _window_walk(mt, q_pos, window, N, TILE: gl.constexpr):
    """(t_lo, f_lo, f_hi, t_hi), t_lo <= f_lo <= f_hi <= t_hi: query tile mt (rows at positions p0 .. p1, held at 0
    or more as the mods see them) under a causal window of `window` keys visits KV tiles [t_lo, t_hi), row p seeing
    keys p - window + 1 .. p; those in [f_lo, f_hi) hold only keys every row sees (no mask). The partial ones are
    [t_lo, f_lo), cut by the window's far edge, and [f_hi, t_hi), by the diagonal."""
    BLOCK_N: gl.constexpr = TILE.BLOCK_N
    p0 = gl.maximum(mt * TILE.BLOCK_M + q_pos, 0)
    p1 = gl.maximum(mt * TILE.BLOCK_M + q_pos + (TILE.BLOCK_M - 1), 0)
    t_lo = gl.maximum(p0 - window + 1, 0) // BLOCK_N
    t_hi = gl.maximum(gl.cdiv(gl.minimum(N, p1 + 1), BLOCK_N), t_lo)
    f_lo = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(p1 - window + 1, 0), BLOCK_N), t_lo), t_hi)
    f_hi = gl.minimum(gl.maximum((p0 + 1) // BLOCK_N, f_lo), t_hi)
    return t_lo, f_lo, f_hi, t_hi


@gluon.jit
def _kv_start(i, n_partial, b, h, mt, sp_ptrs, sp_meta, TILE: gl.constexpr, SPARSE: gl.constexpr,
              FLAT: gl.constexpr = False, q_pos=None, window=None, N=None):
    """First KV position of the i-th KV tile of this query tile. FLAT: the table's row offset and the tile index
    summed as 32-bit integers first, so that a loop over i holds that sum (one register) rather than a 64-bit row
    pointer (two). q_pos, window: as _kv_counts; N: the sequence's keys (SPARSE.WINDOW)."""
    kvnb_ptr, kvidx_ptr, fnb_ptr, fidx_ptr = sp_ptrs
    BM, HM, nb_sb, nb_sh, idx_sb, idx_sh, idx_sm, fnb_sb, fnb_sh, fidx_sb, fidx_sh, fidx_sm = sp_meta
    MULT: gl.constexpr = SPARSE.SPARSE_KV_MULT
    if SPARSE.HAS_SPARSE:
        bb = b % BM
        hh = h % HM
        qb = mt // SPARSE.SPARSE_Q_DIV
        if i < n_partial:
            if FLAT:
                blk = gl.load(kvidx_ptr + (bb * idx_sb + hh * idx_sh + qb * idx_sm + i // MULT))
            else:
                blk = gl.load(kvidx_ptr + bb * idx_sb + hh * idx_sh + qb * idx_sm + i // MULT)
            sub = i % MULT
        else:
            j = i - n_partial
            if FLAT:
                blk = gl.load(fidx_ptr + (bb * fidx_sb + hh * fidx_sh + qb * fidx_sm + j // MULT))
            else:
                blk = gl.load(fidx_ptr + bb * fidx_sb + hh * fidx_sh + qb * fidx_sm + j // MULT)
            sub = j % MULT
        start = (blk * MULT + sub) * TILE.BLOCK_N
    elif SPARSE.WINDOW:   # the partial tiles first (the window's edge, then the diagonal), then the full ones
        t_lo, f_lo, f_hi, t_hi = _window_walk(mt, q_pos, window, N, TILE)
        n_edge = f_lo - t_lo
        if i < n_edge:
            start = (t_lo + i) * TILE.BLOCK_N
        elif i < n_partial:
            start = (f_hi + i - n_edge) * TILE.BLOCK_N
        else:
            start = (f_lo + i - n_partial) * TILE.BLOCK_N
    elif SPARSE.CAUSAL_WALK:   # the partial (diagonal) tiles first, then the full ones from key 0
        if i < n_partial:
            start = ((_walk_row(mt, q_pos, TILE) + 1) // TILE.BLOCK_N + i) * TILE.BLOCK_N
        else:
            start = (i - n_partial) * TILE.BLOCK_N
    else:
        start = i * TILE.BLOCK_N
    return start


# ----------------------------------------------------------------------------------------------
# Producer / load partition: 1 warp issuing TMA.
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _producer(descs, bars, smem, sizes, sp_ptrs, sp_meta, pack_args, TILE: gl.constexpr, SCHED: gl.constexpr,
              SPARSE: gl.constexpr, QUANT: gl.constexpr, PACK: gl.constexpr):
    q_desc, k_desc, v_desc, o_desc, q_desc_hi, k_desc_hi, v_desc_hi, o_desc_hi = descs
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn = bars
    q_smem, k_smem, v_smem, o_smem, q_hi, k_hi, v_hi = smem
    num_tiles, num_m_tiles, HQ, GQA, M, N = sizes
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    BLOCK_N: gl.constexpr = TILE.BLOCK_N
    HALF_M: gl.constexpr = TILE.HALF_M
    CONSUMERS: gl.constexpr = TILE.CONSUMERS

    if TILE.SPLIT_QK:
        q_bytes: gl.constexpr = q_desc.block_type.nbytes + q_desc_hi.block_type.nbytes
        k_bytes: gl.constexpr = k_desc.block_type.nbytes + k_desc_hi.block_type.nbytes
    else:
        q_bytes: gl.constexpr = q_desc.block_type.nbytes
        k_bytes: gl.constexpr = k_desc.block_type.nbytes
    if TILE.SPLIT_V:
        v_bytes: gl.constexpr = v_desc.block_type.nbytes + v_desc_hi.block_type.nbytes
    else:
        v_bytes: gl.constexpr = v_desc.block_type.nbytes
    # a paged tile of several page boxes, or of split head dims (four descriptors): K and V box by box, each page
    # read once (_load_page_tiles); pages of whole tiles of one descriptor each: as a contiguous cache, the tile's
    # page as the batch coordinate
    PAGE_BOXES: gl.constexpr = PACK.PAGE > 0 and (PACK.PAGE_BOX < BLOCK_N or TILE.SPLIT_QK or TILE.SPLIT_V)
    if PAGE_BOXES:   # the descriptors' boxes are PAGE_BOX rows, BLOCK_N // PAGE_BOX of them a tile
        k_tile_bytes: gl.constexpr = k_bytes * (BLOCK_N // PACK.PAGE_BOX)
        v_tile_bytes: gl.constexpr = v_bytes * (BLOCK_N // PACK.PAGE_BOX)

    if QUANT.TIGHT:
        num_tiles = _opaque(num_tiles)
    n_it, pid, nprog = _tile_loop(num_tiles, num_m_tiles, HQ, pack_args, TILE, SCHED.PERSISTENT, PACK)
    cnt = 0   # KV tiles loaded so far (global ring counter)
    t_local = 0
    for it in range(n_it):
        tile_id = _tile_id(it, pid, nprog, SCHED.PERSISTENT)
        b, h, mt = _tile_coords(tile_id, num_tiles, num_m_tiles, HQ, SCHED.PERSISTENT, PACK.VARLEN, pack_args,
                                BLOCK_M)
        # z: the descriptors' batch coordinate; q0 / k0: the sequence's first rows (VARLEN, else 0)
        z, q0, M_seq, k0, N_seq, q_pos = _seq_rows(b, M, N, pack_args, PACK)
        # the causal walk's offset and SPARSE.WINDOW's W (pack_args' WINDOW); None leaves other modes' code as it was
        walk_pos = q_pos if PACK.CACHE or SPARSE.WINDOW else None
        walk_win = pack_args[3] if PACK.CACHE else (pack_args[5] if SPARSE.WINDOW else None)
        hkv = h // GQA
        m0 = q0 + mt * BLOCK_M
        # Q halves: wait until the consumer released the half (O_STAGE: its last QK^T retired;
        # otherwise: its O store out of that half completed). In persistent mode with O_STAGE this
        # is early enough for the next tile's Q and first K/V to land under the tail PV and epilogue.
        for w in gl.static_range(CONSUMERS):
            mbarrier.wait(q_empty.index(w), (t_local & 1) ^ 1)
            mbarrier.expect(q_ready.index(w), q_bytes)
            tma.async_copy_global_to_shared(q_desc, [z, h, m0 + w * HALF_M, 0], q_ready.index(w), q_smem.index(w))
            if TILE.SPLIT_QK:
                tma.async_copy_global_to_shared(q_desc_hi, [z, h, m0 + w * HALF_M, TILE.QK_LO], q_ready.index(w),
                                                q_hi.index(w))
        n_partial, n_total = _kv_counts(b, h, mt, N_seq, sp_ptrs, sp_meta, TILE, SPARSE, walk_pos, walk_win)
        if PACK.PAGE > 0:
            table_row = pack_args[4] + b.to(gl.int64) * pack_args[5]
        for i in range(n_total):
            start = k0 + _kv_start(i, n_partial, b, h, mt, sp_ptrs, sp_meta, TILE, SPARSE, False, walk_pos,
                                   walk_win, N_seq)
            if PAGE_BOXES:
                _load_page_tiles(descs, bars, smem, cnt, table_row, pack_args[6], hkv, start, k_tile_bytes,
                                 v_tile_bytes, TILE, PACK)
            else:
                if PACK.PAGE > 0:   # pages of whole tiles: the tile's page in the batch coordinate
                    row = [gl.load(table_row + gl.minimum(start // PACK.PAGE, pack_args[6] - 1)), hkv,
                           start % PACK.PAGE]
                else:
                    row = [z, hkv, start]
                _load_ring_stage(k_desc, k_desc_hi, k_ready, k_empty, k_smem, k_hi, cnt, row, k_bytes,
                                 TILE.NUM_STAGES, TILE.QK_LO, TILE.SPLIT_QK, False)
                # FP8: V comes as VT, the tile's keys along its columns (KEYS_LAST)
                _load_ring_stage(v_desc, v_desc_hi, v_ready, v_empty, v_smem, v_hi, cnt, row, v_bytes,
                                 TILE.V_STAGES, TILE.V_LO, TILE.SPLIT_V, QUANT.ON)
            cnt += 1
        t_local += 1


@gluon.jit
def _load_ring_stage(desc, desc_hi, ready, empty, tiles, tiles_hi, cnt, row, nbytes: gl.constexpr,
                     STAGES: gl.constexpr, LO: gl.constexpr, SPLIT: gl.constexpr, KEYS_LAST: gl.constexpr):
    """TMA-load the rows at `row` ([b, head, first row]) into stage cnt % STAGES of a K or V ring, once both
    consumer warpgroups released it; SPLIT: columns [0, LO) and [LO, D) into the two tiles. KEYS_LAST (FP8's
    VT [b, head, dv, n]): `row` is the first key, a column of the tile."""
    s = cnt % STAGES
    ph = (cnt // STAGES) & 1
    mbarrier.wait(empty.index(s), ph ^ 1)
    mbarrier.expect(ready.index(s), nbytes)
    if KEYS_LAST:
        gl.static_assert(not SPLIT, "VT tiles are not split")
        tma.async_copy_global_to_shared(desc, [row[0], row[1], 0, row[2]], ready.index(s), tiles.index(s))
    else:
        tma.async_copy_global_to_shared(desc, row + [0], ready.index(s), tiles.index(s))
        if SPLIT:
            tma.async_copy_global_to_shared(desc_hi, row + [LO], ready.index(s), tiles_hi.index(s))


@gluon.jit
def _load_page_tiles(descs, bars, smem, cnt, table_row, max_pages, hkv, start, k_bytes: gl.constexpr,
                     v_bytes: gl.constexpr, TILE: gl.constexpr, PACK: gl.constexpr):
    """The K and V tiles of keys start .. start + BLOCK_N from a paged cache (PACK.PAGE) into stage cnt of their
    rings: boxes of PAGE_BOX rows, each from its page (TABLE[b, key // PAGE] at row key % PAGE; `table_row` is
    TABLE's row b). The tile's page indices come in one load issued before the rings' waits, so that its latency
    hides behind them rather than before every box; lane j holds box j's page (one register of the producer's 24),
    taken out by a warp reduction per box. Split head dims (four descriptors) wait for both stages first and issue
    a box's K and V together: kept across V's wait, the indices and descriptors spill there. A table column past
    max_pages is read at the last one: its keys lie past N_seq (masked in S, zeroed in V), and a page index out of
    the cache's range reads zeros (TMA's fill), so no entry past a sequence's length is trusted."""
    k_desc, v_desc, k_desc_hi, v_desc_hi = descs[1], descs[2], descs[5], descs[6]
    k_ready, k_empty, v_ready, v_empty = bars[2], bars[3], bars[4], bars[5]
    k_smem, v_smem, k_hi, v_hi = smem[1], smem[2], smem[5], smem[6]
    BOX: gl.constexpr = PACK.PAGE_BOX
    BOXES: gl.constexpr = TILE.BLOCK_N // BOX
    TOGETHER: gl.constexpr = TILE.SPLIT_QK or TILE.SPLIT_V
    box = gl.arange(0, BOXES, layout=gl.BlockedLayout([1], [32], [1], [0]))
    pages = gl.load(table_row + gl.minimum((start + box * BOX) // PACK.PAGE, max_pages - 1))
    ks = cnt % TILE.NUM_STAGES
    vs = cnt % TILE.V_STAGES
    mbarrier.wait(k_empty.index(ks), ((cnt // TILE.NUM_STAGES) & 1) ^ 1)
    mbarrier.expect(k_ready.index(ks), k_bytes)
    if TOGETHER:
        mbarrier.wait(v_empty.index(vs), ((cnt // TILE.V_STAGES) & 1) ^ 1)
        mbarrier.expect(v_ready.index(vs), v_bytes)
    for j in gl.static_range(BOXES):
        page = gl.sum(gl.where(box == j, pages, 0), axis=0)
        row = (start + j * BOX) % PACK.PAGE
        tma.async_copy_global_to_shared(k_desc, [page, hkv, row, 0], k_ready.index(ks),
                                        k_smem.index(ks).slice(j * BOX, BOX, 2))
        if TILE.SPLIT_QK:
            tma.async_copy_global_to_shared(k_desc_hi, [page, hkv, row, TILE.QK_LO], k_ready.index(ks),
                                            k_hi.index(ks).slice(j * BOX, BOX, 2))
        if TOGETHER:
            _page_box_v(v_desc, v_desc_hi, v_ready, v_smem, v_hi, vs, page, hkv, row, j, BOX, TILE)
    if not TOGETHER:
        mbarrier.wait(v_empty.index(vs), ((cnt // TILE.V_STAGES) & 1) ^ 1)
        mbarrier.expect(v_ready.index(vs), v_bytes)
        for j in gl.static_range(BOXES):
            page = gl.sum(gl.where(box == j, pages, 0), axis=0)
            _page_box_v(v_desc, v_desc_hi, v_ready, v_smem, v_hi, vs, page, hkv, (start + j * BOX) % PACK.PAGE, j,
                        BOX, TILE)


@gluon.jit
def _page_box_v(v_desc, v_desc_hi, v_ready, v_smem, v_hi, vs, page, hkv, row, j: gl.constexpr, BOX: gl.constexpr,
                TILE: gl.constexpr):
    """Box j of a paged V tile (_load_page_tiles): PAGE_BOX rows of `page` from `row`, both halves where split."""
    tma.async_copy_global_to_shared(v_desc, [page, hkv, row, 0], v_ready.index(vs),
                                    v_smem.index(vs).slice(j * BOX, BOX, 2))
    if TILE.SPLIT_V:
        tma.async_copy_global_to_shared(v_desc_hi, [page, hkv, row, TILE.V_LO], v_ready.index(vs),
                                        v_hi.index(vs).slice(j * BOX, BOX, 2))


@gluon.jit
def _zero_keys_past(tiles, tiles_hi, st, n_keep, TILE: gl.constexpr):
    """PACK.CACHE: zero the rows at or past n_keep of stage st of the V ring (both tiles where split) when
    n_keep < BLOCK_N. A cache's slots past its sequence's length may hold NaN, which the zero P there would not
    cancel in the PV wgmma. Both consumer warpgroups write the same values (the rows below n_keep back as they
    were), so neither's wgmma can read anything else; the fence orders the stores before it."""
    if n_keep < TILE.BLOCK_N:
        _zero_rows(tiles.index(st).reshape([TILE.BLOCK_N, TILE.V_LO]), n_keep, TILE.BLOCK_N, TILE.V_LO)
        if TILE.SPLIT_V:
            _zero_rows(tiles_hi.index(st).reshape([TILE.BLOCK_N, TILE.V_HI]), n_keep, TILE.BLOCK_N, TILE.V_HI)
        fence_async_shared()


@gluon.jit
def _zero_rows(tile, n_keep, ROWS: gl.constexpr, COLS: gl.constexpr):
    """Rows [n_keep, ROWS) of a shared [ROWS, COLS] tile set to zero, in chunks of rows a warpgroup covers with
    8 columns a thread; chunks wholly below n_keep are not touched."""
    TPC: gl.constexpr = COLS // 8 if COLS // 8 < 32 else 32                   # threads along a row
    CHUNK: gl.constexpr = 4 * (32 // TPC) if 4 * (32 // TPC) > 16 else 16    # rows a chunk (four warps' rows at least)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPC, TPC], [4, 1], [1, 0])
    for c in gl.static_range(ROWS // CHUNK):
        if (c + 1) * CHUNK > n_keep:
            part = tile.slice(c * CHUNK, CHUNK, 0)
            x = part.load(layout)
            rows = c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))[:, None]
            part.store(gl.where(rows < n_keep, x, gl.zeros_like(x)))


# ----------------------------------------------------------------------------------------------
# Consumer partition: wgmma + online softmax for 64 query rows.
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _score_tile(acc, start, is_partial, b, h, q_idx, q_idx_c, row0, sm_scale, qk_unit, col_bias, N, score_bufs,
                mask_bufs, s_layout: gl.constexpr, SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr,
                TILE: gl.constexpr, FLAGS: gl.constexpr):
    """QK^T accumulator -> (score tile in the kernel's working units, the tile's shift).

    Without score_mod the tile stays in raw q.k units (scale folded into the exp2 FMA later);
    with score_mod it is the mod's tile (the score over its OUT_SCALE; OUT_SCALE·log2 e is folded
    into the exp2 FMA later, as the scale is without a mod: no extra multiply per score).
    KV_AFFINE: the tile is qk·unit + the mod's column part (one FFMA per score); the true tile is that
    plus `shift` (a scalar, handed to the softmax) plus the row part (added to LSE / MAX at the end).
    Otherwise shift is 0.
    """
    BLOCK_N: gl.constexpr = TILE.BLOCK_N
    EVEN_N: gl.constexpr = FLAGS.EVEN_N
    shift = 0.0
    if FLAGS.HAS_SCORE_MOD:
        if FLAGS.KV_AFFINE:
            s = acc * qk_unit + col_bias
            shift = SCORE_MOD(sm_scale * 0.0, sm_scale, b, h, row0, start, score_bufs)
        else:
            kv_idx = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))[None, :]
            if not EVEN_N:
                kv_idx = gl.minimum(kv_idx, N - 1)
            s = SCORE_MOD(acc, sm_scale, b, h, q_idx_c, kv_idx, score_bufs)
    else:
        s = acc
    # EVEN_N (N % BLOCK_N == 0, decided on the host): no tile crosses N, so interior tiles carry no
    # bound-mask code at all. The runtime `if` below is otherwise compiled to predicated FSELs that
    # still take an issue slot per score on every tile.
    if EVEN_N:
        need_mask = False
    else:
        need_mask = (start + BLOCK_N > N)
    if FLAGS.HAS_MASK_MOD:
        if FLAGS.DENSE_MASK:
            need_mask = True
        else:
            need_mask = need_mask | is_partial
    if need_mask:
        kv_idx = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))[None, :]
        if EVEN_N:
            # no tile crosses N: no bound to test, no clamp, and only partial tiles get here (DENSE_MASK:
            # every tile is partial), so the mask alone decides: one select per score after the mask
            if FLAGS.HAS_MASK_MOD:
                keep = MASK_MOD(b, h, q_idx_c, kv_idx, mask_bufs)
                if FLAGS.MASK_AND:
                    s = _keep_or_neg_inf(keep, s)
                else:
                    s = gl.where(keep, s, -float("inf"))
        else:
            valid = kv_idx < N
            if FLAGS.HAS_MASK_MOD:
                kv_idx_c = gl.minimum(kv_idx, N - 1)
                mm = MASK_MOD(b, h, q_idx_c, kv_idx_c, mask_bufs)
                if FLAGS.DENSE_MASK:
                    valid = valid & mm
                else:
                    valid = valid & (mm | (~is_partial))
            s = gl.where(valid, s, -float("inf"))
    return s, shift


@gluon.jit
def _keep_or_neg_inf(keep, s):
    """where(keep, s, -inf) for a mask that ANDs conditions (MASK_AND). LLVM splits a select on `a & b`
    into two selects (two FSELs per score); behind an opaque select, ptxas chains the conditions
    into the comparisons' predicates instead (one FSEL). A lone comparison keeps gl.where: there
    LLVM would turn the int conversion into shifts."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; selp.f32 $0, $1, 0fFF800000, p; }",
        "=r,r,r", [s, keep.to(gl.int32)], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _affine_columns(SCORE_MOD: gl.constexpr, sm_scale, b, h, row0, bufs, s_layout: gl.constexpr,
                    BLOCK_N: gl.constexpr):
    """Column part of a KV_AFFINE mod x = alpha(b, h)·kv + B(b, h, q): x(0, j) - x(0, 0) = alpha·j for the
    tile's column offsets j ([1, BLOCK_N], the same for every KV tile of a head).

    The three parts of x at (q0 + i, n0 + j), q0 = the warpgroup's first row, n0 = the KV tile's start:
    alpha·j (here) + x(q0, n0) (the tile's shift, in _score_tile) + x(q0 + i, q0) - x(q0, q0) (the row
    part, _affine_rows). Each is evaluated by the generated mod itself at in-range indices, with
    magnitudes no larger than the mod's own values near the diagonal."""
    zero = row0 * 0
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))[None, :]
    qk0 = sm_scale * 0.0
    return SCORE_MOD(qk0, sm_scale, b, h, zero, cols, bufs) - SCORE_MOD(qk0, sm_scale, b, h, zero, zero, bufs)


@gluon.jit
def _affine_rows(SCORE_MOD: gl.constexpr, sm_scale, b, h, row0, q_idx_c, bufs):
    """Row part of a KV_AFFINE mod, x(q, q0) - x(q0, q0), as a row vector (see _affine_columns). Softmax
    does not see it; it is added to the row max and the exponent base before LSE / MAX are written."""
    qk0 = sm_scale * 0.0
    r = SCORE_MOD(qk0, sm_scale, b, h, q_idx_c, row0, bufs) - SCORE_MOD(qk0, sm_scale, b, h, row0, row0, bufs)
    return gl.sum(r, axis=1)


@gluon.jit
def _mul_rn(a, b):
    """a * b rounded to fp32 and never contracted into an FMA with a later add (PTX mul.rn)."""
    return gl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _online_softmax(s, shift, m_i, m_run, l_i, qk_scale, p_layout: gl.constexpr, o_layout: gl.constexpr,
                    dtype: gl.constexpr, FLAGS: gl.constexpr):
    """One online-softmax step on a score tile (units: s * qk_scale is log2 units).

    m_i is the true running row max (s units; written out as MAX). m_run is the exponent base in use
    (log2 units; -inf while a row has seen no unmasked score): the row max times qk_scale, so O and l
    are rescaled by alpha = 2^(old base - new base) on every tile. Returns alpha for the caller's O
    update (_rescale_o).

    FIXED_BASE: the score_mod's output is bounded (softcap), and m_run is a constant base chosen
    by the host so that every unmasked p lies within fp32 / P's dtype range (see _prepare): no row
    max, no rescale of O and l (m_i, the MAX output, is not tracked).

    KV_AFFINE: the tile's scores are s + shift (a scalar): the shift enters the row max and the per-row
    exp2 bias, never a per-score instruction.
    """
    if FLAGS.FIXED_BASE:
        p = exp2_tile(s * qk_scale - m_run[:, None], FLAGS.EXP2_EMU)
        l_new = l_i + gl.sum(p, axis=1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        alpha_o = gl.convert_layout(gl.full_like(l_i, 1.0), gl.SliceLayout(1, o_layout))  # unused
        return p_op, m_i, m_run, l_new, alpha_o
    row_max = gl.max(s, axis=1)
    if FLAGS.KV_AFFINE:
        row_max = row_max + shift
    m_new = gl.maximum(m_i, row_max)
    # The exponent base must be the rounded product that is also subtracted below: a contracted
    # `m_run - m_new * qk_scale` (one FFMA, exact product) would make alpha = 2^(rounding error of m_run)
    # instead of 1 on every tile where the max holds, a drift that compounds into l and LSE (O is
    # unaffected: it is rescaled alike). Measured before this: 0.125 log2 units of LSE error after 128
    # KV tiles with the row max in the first one (relative bias, 16k keys).
    m_new2 = _mul_rn(m_new, qk_scale)
    # every row moves to its true max; a row still empty keeps -inf (alpha 1: its O and l are 0)
    alpha = gl.where(m_new2 == -float("inf"), 1.0, gl.exp2(m_run - m_new2))
    m_run = m_new2
    # Empty row: a finite base so that exp2(-inf - base) = 0, never NaN.
    m_base = gl.where(m_run == -float("inf"), 0.0, m_run)
    if FLAGS.KV_AFFINE:
        m_base = m_base - shift * qk_scale
    if FLAGS.WIDE_SCORES:
        p = exp2_tile(_mul_rn(s, qk_scale) - m_base[:, None], FLAGS.EXP2_EMU)
    else:
        p = exp2_tile(s * qk_scale - m_base[:, None], FLAGS.EXP2_EMU)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    # Row vectors of the S and O accumulators hold the same rows in the same threads: a free conversion.
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
    return p_op, m_new, m_run, l_new, alpha_o


@gluon.jit
def _rescale_o(acc, alpha, FIXED_BASE: gl.constexpr):
    if FIXED_BASE:
        return acc
    acc = acc * alpha[:, None]
    return acc


@gluon.jit
def _rescale_o_hi(acc_hi, alpha, FIXED_BASE: gl.constexpr, SPLIT_O: gl.constexpr):
    """_rescale_o for the second O accumulator of a split O (a no-op otherwise)."""
    if SPLIT_O:
        alpha_hi = gl.convert_layout(alpha, gl.SliceLayout(1, acc_hi.type.layout))   # same rows: no data moves
        acc_hi = _rescale_o(acc_hi, alpha_hi, FIXED_BASE)
    return acc_hi


# ----------------------------------------------------------------------------------------------
# FP8 (QUANT.ON): the tile's scales, the softmax on e4m3 scores, the two-level PV accumulation.
# ----------------------------------------------------------------------------------------------
# The bit pattern of 1.5 * 2^23 and its value. Floats in [2^23, 2^24] are exactly the integers there, so adding an
# int32 x with |x| <= 2^22 to the pattern gives the float 1.5 * 2^23 + x (docs/design/hopper_fp8.md, "I2F").
S32_MAGIC_BITS = gl.constexpr(0x4B400000)
S32_MAGIC = gl.constexpr(12582912.0)


@gluon.jit
def _s32_to_f32(x):
    """int32 -> float32, exact for |x| <= 2^22 (|Q8·K8| <= D·127^2 < 2^22 for D <= 256), with an integer add and a
    float subtract (both exact: Sterbenz) instead of I2F, which runs at a quarter of the FP32 rate on sm90 next to
    the softmax's MUFU.EX2 and P's F2FP."""
    return (x + S32_MAGIC_BITS).to(gl.float32, bitcast=True) - S32_MAGIC


@gluon.jit
def _fp8_row_scales(quant_bufs, b, h, row0, HQ, GQA, M, N, row_layout: gl.constexpr, HALF_M: gl.constexpr,
                    QUANT: gl.constexpr):
    """Per query tile: (the rows' Q scales, this head's K / V scale rows, VS_MAX, #K / V scale blocks, and with
    QUANT.LEAN 8 - log2(VS_MAX), the per-tile V shift's constant part)."""
    qs_ptr, ks_ptr, vs_ptr, vs_max_ptr = quant_bufs
    rows = row0 + gl.arange(0, HALF_M, layout=row_layout)
    if QUANT.Q_BLOCK > 0:
        n_q_blocks = gl.cdiv(M, QUANT.Q_BLOCK)
        q_blk = rows // QUANT.Q_BLOCK
    else:
        n_q_blocks = 1
        q_blk = rows * 0
    # rows past M (clipped by the O store) read scale 1: finite scores, never NaN
    q_rows = gl.load(qs_ptr + (b * HQ + h) * n_q_blocks + q_blk, mask=rows < M, other=1.0)
    if QUANT.KV_BLOCK > 0:
        n_kv_blocks = gl.cdiv(N, QUANT.KV_BLOCK)
    else:
        n_kv_blocks = N * 0 + 1
    kv_head = b * (HQ // GQA) + h // GQA
    vs_max = gl.load(vs_max_ptr + kv_head)
    if QUANT.LEAN:
        shift0 = 8.0 - gl.log2(vs_max)
    else:
        shift0 = 0.0
    return q_rows, ks_ptr + kv_head * n_kv_blocks, vs_ptr + kv_head * n_kv_blocks, vs_max, n_kv_blocks, shift0


@gluon.jit
def _opaque(x):
    """x through a register copy LLVM cannot see through (a side-effecting mov; ptxas folds it away). Scalars derived
    from kernel arguments are otherwise hoisted out of every loop, above warp_specialize's dispatch: live through all
    partitions (the producer's 24 registers, the consumers' KV loops), where ptxas spills them. Copied per tile, what
    derives from them is computed where it is used."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=1)


@gluon.jit
def _lg2_approx(x):
    """log2(x) by one MUFU.LG2 (PTX lg2.approx.f32, subnormal inputs kept: a V scale is never flushed to log2 0)."""
    return gl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _row_max_halves(s):
    """Row max of a score tile as max(left half, right half) per element, then the row reduction: each thread's
    dependent FMNMX chain is half as long (a thread holds BLOCK_N / 4 columns of each of its two rows)."""
    lo, hi = split_cols(s)
    return gl.convert_layout(gl.max(gl.maximum(lo, hi), axis=1), gl.SliceLayout(1, s.type.layout))


@gluon.jit
def _fp8_tile_scales(start, fp8_rows, QUANT: gl.constexpr):
    """Per KV tile starting at key `start`: (the rows' dequantization factor QS·KS, P's shift in log2 units).
    Loaded before the tile's barrier waits, so their latency hides under the wgmma."""
    if QUANT.ON:
        q_rows, ks_head, vs_head, vs_max, n_kv_blocks, shift0 = fp8_rows
        if QUANT.KV_BLOCK > 0:
            # a block-mask block may reach past N (its tiles there are all masked): clamp the scale index
            blk = gl.minimum(start // QUANT.KV_BLOCK, n_kv_blocks - 1)
        else:
            blk = start * 0
        ks = gl.load(ks_head + blk)
        # P = 2^(... + shift) <= 2^8 with the tile's V scale folded in; an all-zero V block's scale (1) may
        # exceed VS_MAX, and its P must still fit e4m3
        if QUANT.LEAN:
            # one MUFU.LG2: the division and libdevice's log2 were a ~40-instruction dependent chain that ptxas
            # scheduled between the QK^T wgmma issues. The prologue's V scales are powers of two; any error here
            # scales the tile's P and its row sum alike, i.e. only its weight in O by 2^error.
            v_shift = gl.minimum(_lg2_approx(gl.load(vs_head + blk)) + shift0, 8.0)
        else:
            v_shift = gl.minimum(8.0 + gl.log2(gl.load(vs_head + blk) / vs_max), 8.0)
        if QUANT.TIGHT:   # QS·KS formed after the wgmma wait (_softmax_step): one register across it, not two
            scales = (q_rows, ks, v_shift)
        else:
            scales = (q_rows * ks, 1.0, v_shift)
    else:
        scales = (0.0, 0.0, 0.0)
    return scales


@gluon.jit
def _online_softmax_fp8(s, shift, m_i, m_run, l_i, qk_scale, deq, v_shift, p_layout: gl.constexpr,
                        o_layout: gl.constexpr, FLAGS: gl.constexpr, QUANT: gl.constexpr, BIASED: gl.constexpr):
    """_online_softmax on an FP8 tile. Without a score_mod, s is raw Q8·K8 and deq (per row) takes it to
    dequantized scores inside the row max and the exp2 FMA (no extra multiply per score); after a score_mod s
    is dequantized already. m_i is in dequantized units (MAX), m_run in log2 units. P = 2^(x - m_run + v_shift)
    goes to e4m3 with the tile's V scale folded in; the row sum is the unrounded P's, without the shift.
    BIASED (int8 Q·K^T, no score_mod, QUANT.LEAN): s is S32_MAGIC + raw Q8·K8 (_softmax_step); the bias leaves the
    row max by one subtraction per row and the exp2 argument through its row offset."""
    gl.static_assert(not FLAGS.FIXED_BASE, "FP8: P's range needs the row max (no fixed exponent base)")
    if QUANT.LEAN:
        s_max = _row_max_halves(s)
    else:
        s_max = gl.max(s, axis=1)
    if FLAGS.HAS_SCORE_MOD:
        row_max = s_max
        if FLAGS.KV_AFFINE:
            row_max = row_max + shift
    elif BIASED:
        row_max = (s_max - S32_MAGIC) * deq
    else:
        row_max = s_max * deq
    if QUANT.TIGHT and not FLAGS.KV_AFFINE:
        # MAX is the base itself, m_i is not kept: rounding is monotonic and qk_scale > 0, so
        # max(m_run, rn(row_max·c)) = rn(max(m_i, row_max)·c), the same base, and MAX = rn(m_i·c) as before
        m_new = m_i
        m_new2 = gl.maximum(m_run, _mul_rn(row_max, qk_scale))
    else:
        m_new = gl.maximum(m_i, row_max)
        m_new2 = _mul_rn(m_new, qk_scale)   # as in _online_softmax: the rounded base, also subtracted below
    alpha = gl.where(m_new2 == -float("inf"), 1.0, gl.exp2(m_run - m_new2))
    m_run = m_new2
    m_base = gl.where(m_run == -float("inf"), 0.0, m_run) - v_shift
    if FLAGS.KV_AFFINE:
        m_base = m_base - shift * qk_scale
    if FLAGS.WIDE_SCORES:   # (a score mod's s is dequantized; the argument is then <= v_shift <= 8)
        x = _mul_rn(s, qk_scale) - m_base[:, None]
    elif FLAGS.HAS_SCORE_MOD:
        x = s * qk_scale - m_base[:, None]
    elif BIASED:
        # (S32_MAGIC + qk)·c - (m_base + S32_MAGIC·c): the FFMA's product is exact; the offset's rounding, at most
        # 2^-24 of S32_MAGIC·c + |m_base|, is the error (a fraction of one Q8·K8 unit: well below P's e4m3 step)
        c = deq * qk_scale
        x = s * c[:, None] - (m_base + S32_MAGIC * c)[:, None]
    else:
        x = s * (deq * qk_scale)[:, None] - m_base[:, None]
    p = exp2_tile(x, FLAGS.EXP2_EMU)
    l_new = l_i * alpha + gl.sum(p, axis=1) * gl.exp2(-v_shift)
    p_op = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
    return p_op, m_new, m_run, l_new, alpha_o


@gluon.jit
def _softmax_step(s_acc, start, is_partial, b, h, q_idx, q_idx_c, row0, sm_scale, qk_unit, col_bias, N, score_bufs,
                  mask_bufs, m_i, m_run, l_i, qk_scale, tile_scales, s_layout: gl.constexpr, p_layout: gl.constexpr,
                  o_layout: gl.constexpr, dtype: gl.constexpr, SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr,
                  TILE: gl.constexpr, FLAGS: gl.constexpr, QUANT: gl.constexpr):
    """The QK^T accumulator of one KV tile -> (P as the PV wgmma's A operand, m_i, m_run, l_i, alpha for O):
    _score_tile, then the online softmax. FP8: a score_mod sees the dequantized scores (the per-row factor
    folds into KV_AFFINE's column FFMA)."""
    if QUANT.ON:
        # QUANT.LEAN without a score_mod: the int32 scores biased by S32_MAGIC (one integer add per score; the float
        # subtract of _s32_to_f32 folds into the exp2 FFMA, _online_softmax_fp8); a score_mod sees exact scores
        BIASED: gl.constexpr = QUANT.LEAN and QUANT.QK_INT8 and not FLAGS.HAS_SCORE_MOD
        if BIASED:
            s_acc = (s_acc + S32_MAGIC_BITS).to(gl.float32, bitcast=True)
        elif QUANT.QK_INT8:
            s_acc = _s32_to_f32(s_acc)
        deq, ks, v_shift = tile_scales
        if QUANT.TIGHT:
            deq = deq * ks
        if FLAGS.KV_AFFINE:
            qk_unit = (deq * qk_unit)[:, None]
        elif FLAGS.HAS_SCORE_MOD:
            s_acc = s_acc * deq[:, None]
        s, shift = _score_tile(s_acc, start, is_partial, b, h, q_idx, q_idx_c, row0, sm_scale, qk_unit, col_bias, N,
                               score_bufs, mask_bufs, s_layout, SCORE_MOD, MASK_MOD, TILE, FLAGS)
        out = _online_softmax_fp8(s, shift, m_i, m_run, l_i, qk_scale, deq, v_shift, p_layout, o_layout, FLAGS,
                                  QUANT, BIASED)
    else:
        s, shift = _score_tile(s_acc, start, is_partial, b, h, q_idx, q_idx_c, row0, sm_scale, qk_unit, col_bias, N,
                               score_bufs, mask_bufs, s_layout, SCORE_MOD, MASK_MOD, TILE, FLAGS)
        out = _online_softmax(s, shift, m_i, m_run, l_i, qk_scale, p_layout, o_layout, dtype, FLAGS)
    return out


@gluon.jit
def _pv_issue(p, v, v_hi, acc, acc_hi, o_zero, SPLIT_O: gl.constexpr, QUANT: gl.constexpr):
    """Issue the PV wgmma: O += P V (_pv_mma), or TWO_LEVEL: P V into a fresh accumulator (use_acc=False; o_zero
    gives its shape), added into O by _o_add once retired."""
    if QUANT.TWO_LEVEL:
        tok = warpgroup_mma(p, v, o_zero, use_acc=False, is_async=True)
        toks = (tok, acc_hi, p)
    else:
        toks = _pv_mma(p, v, v_hi, acc, acc_hi, SPLIT_O)
    return toks


@gluon.jit
def _o_add(acc, pv, QUANT: gl.constexpr):
    """O after the last PV wgmma of a row (no rescale follows)."""
    if QUANT.TWO_LEVEL:
        acc = acc + pv
    else:
        acc = pv
    return acc


@gluon.jit
def _pingpong_wait(turn, t, WG: gl.constexpr):
    """Pingpong: wait for this warpgroup's turn to issue its GEMMs (t: turns taken so far)."""
    mbarrier.wait(turn.index(WG), t & 1)
    return t + 1


@gluon.jit
def _pingpong_signal(turn, WG: gl.constexpr, CONSUMERS: gl.constexpr = 2):
    """Pingpong: hand the turn to the next warpgroup of the ring right after issuing."""
    mbarrier.arrive(turn.index((WG + 1) % CONSUMERS), count=1)


@gluon.jit
def _row_lse(m_run, l_safe, empty_row):
    """The row's LSE (log2 units); l is relative to the exponent base m_run, the true max m_i can be above it."""
    return gl.where(empty_row, -float("inf"), m_run + gl.log2(l_safe))


@gluon.jit
def _with_sink(l_i, m_run, sinks_ptr, h):
    """(1 / the row's denominator, its LSE), log2 units, with head h's sink in the denominator: the sink joins l
    relative to the exponent base m_run, d = l + 2^(sink - m_run); O' = acc / d, LSE' = m_run + log2(d)
    (docs/design/sinks.md). Where the sink's term overflows (the sink 128 or more above the base, or a row with no
    key: m_run = -inf) LSE' = the sink and O' = 0, the limits. A -inf sink adds nothing; d = 0 gives O' = 0 and
    LSE' = -inf. Two registers per row at most beside O: no spills, the KV loops untouched (tests/test_sinks_sm90.py)."""
    sink = gl.load(sinks_ptr + h) * 1.4426950408889634   # natural-log logit -> log2 units
    e = gl.exp2(sink - gl.maximum(m_run, -3.0e38))       # m_run = -inf: +inf for a finite sink, not NaN
    d = l_i + e
    none = d == 0.0
    d_safe = gl.where(none, 1.0, d)
    lse = gl.where(e == float("inf"), sink, m_run + gl.log2(d_safe))
    return 1.0 / d_safe, gl.where(none, -float("inf"), lse)


@gluon.jit
def _epilogue(acc, acc_hi, m_i, m_run, l_i, qk_scale, o_half, o_half_hi, o_desc, o_desc_hi, lse_ptr, max_ptr,
              sink_bufs, pack_args, z, h, q0, row0, HQ, M, M_seq, o_layout: gl.constexpr, HALF_M: gl.constexpr,
              dtype: gl.constexpr, O_STAGE: gl.constexpr, SPLIT_O: gl.constexpr, HAS_SINKS: gl.constexpr,
              VARLEN: gl.constexpr, MAX_IS_BASE: gl.constexpr = False):
    """Normalise O, stage it in shared memory, TMA-store it; write LSE / MAX (log2 units).

    O_STAGE: o_half is this warpgroup's own O buffer; the store is left in flight (the next tile's
    epilogue, or the kernel's end, waits for it). Otherwise o_half is the warpgroup's Q half and the
    store is waited for here, before the caller hands the half back to the producer.
    SPLIT_O: O is acc (columns [0, LO)) and acc_hi (the next HI columns), staged in o_half and o_half_hi
    (the Q tiles) and stored by o_desc and o_desc_hi. HAS_SINKS: sink_bufs[0] is SINKS (module docstring).
    Rows: the half's are row0 + [0, HALF_M) of a sequence of M_seq rows that starts at row q0 of rows of M
    (dense: q0 = 0, M_seq = M). VARLEN: a half reaching past its sequence is stored by pointers
    (_store_rows), since TMA clips at the pack's end only and would overwrite the next sequence's rows."""
    empty_row = l_i == 0.0
    l_safe = gl.where(empty_row, 1.0, l_i)
    if HAS_SINKS:   # the sink joins O's normaliser; without sinks the LSE follows O's store (as before sinks)
        inv_l, lse = _with_sink(l_i, m_run, sink_bufs[0], h)
    else:
        inv_l = 1.0 / l_safe
    o = acc * inv_l[:, None]
    if SPLIT_O:
        o_hi = acc_hi * gl.convert_layout(inv_l, gl.SliceLayout(1, acc_hi.type.layout))[:, None]
    else:
        o_hi = o
    if VARLEN:
        if row0 + HALF_M > M_seq:
            _store_rows(o.to(dtype), 0, pack_args, h, q0, row0, M_seq)
            if SPLIT_O:
                _store_rows(o_hi.to(dtype), acc.shape[1], pack_args, h, q0, row0, M_seq)
        else:
            _store_tma(o, o_hi, o_half, o_half_hi, o_desc, o_desc_hi, [z, h, q0 + row0], dtype, O_STAGE, SPLIT_O)
    else:
        _store_tma(o, o_hi, o_half, o_half_hi, o_desc, o_desc_hi, [z, h, q0 + row0], dtype, O_STAGE, SPLIT_O)

    if not HAS_SINKS:
        lse = _row_lse(m_run, l_safe, empty_row)
    if MAX_IS_BASE:   # m_run is MAX already (_online_softmax_fp8 under QUANT.TIGHT)
        mx = gl.where(empty_row, -float("inf"), m_run)
    else:
        mx = gl.where(empty_row, -float("inf"), m_i * qk_scale)
    rows = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, o_layout))
    off = (z * HQ + h).to(gl.int64) * M + q0 + rows
    gl.store(lse_ptr + off, lse, mask=rows < M_seq)
    gl.store(max_ptr + off, mx, mask=rows < M_seq)
    if not O_STAGE:
        tma.store_wait(0)


@gluon.jit
def _store_tma(o, o_hi, o_half, o_half_hi, o_desc, o_desc_hi, row, dtype: gl.constexpr, O_STAGE: gl.constexpr,
               SPLIT_O: gl.constexpr):
    """Stage an O half in shared memory and TMA-store it at `row` ([b, head, first row]); SPLIT_O: o_hi too."""
    if O_STAGE:
        tma.store_wait(0)   # the previous tile's O store has finished reading o_half
    o_half.reshape([o.shape[0], o.shape[1]]).store(o.to(dtype))
    if SPLIT_O:
        o_half_hi.reshape([o_hi.shape[0], o_hi.shape[1]]).store(o_hi.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, row + [0], o_half)
    if SPLIT_O:
        tma.async_copy_shared_to_global(o_desc_hi, row + [o.shape[1]], o_half_hi)


@gluon.jit
def _store_rows(o, col0, pack_args, h, q0, row0, M_seq):
    """Store an O half (rows row0 + [0, HALF_M) of a packed sequence starting at row q0, columns col0 + [0, C)
    of head h) by pointers, leaving the rows at or past M_seq alone: they belong to the next sequence."""
    out_ptr = pack_args[2]
    stride_t = pack_args[3]
    stride_h = pack_args[4]
    layout: gl.constexpr = o.type.layout
    rows = row0 + gl.arange(0, o.shape[0], layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, o.shape[1], layout=gl.SliceLayout(0, layout))
    offs = (q0 + rows).to(gl.int64)[:, None] * stride_t + (h * stride_h + cols)[None, :]
    keep = (rows < M_seq)[:, None] & (cols < col0 + o.shape[1])[None, :]
    gl.store(out_ptr + offs, o, mask=keep)


@gluon.jit
def _qk_mma(q_op, q_hi, k_t, k_hi, s_zero, SPLIT: gl.constexpr):
    """Issue S = Q K^T (async). SPLIT (a head dim of LO + HI columns): Q and K sit in two shared tiles each,
    [.., LO] and [.., HI] (q_hi, k_hi), and QK^T is two wgmmas, one per tile: no padding is multiplied."""
    tok = warpgroup_mma(q_op, k_t, s_zero, use_acc=False, is_async=True)
    if SPLIT:
        tok = warpgroup_mma(q_hi, k_hi, tok, is_async=True)
    return tok


@gluon.jit
def _qk_done(s_tok, q_op, q_hi, k_t, k_hi, SPLIT: gl.constexpr):
    """Wait until the QK^T issued by _qk_mma has retired (nothing else in flight); returns S."""
    if SPLIT:
        s_acc, _q, _qh, _k, _kh = warpgroup_mma_wait(0, deps=[s_tok, q_op, q_hi, k_t, k_hi])
    else:
        s_acc, _q, _k = warpgroup_mma_wait(0, deps=[s_tok, q_op, k_t])
    return s_acc


@gluon.jit
def _ring_operands(tiles, tiles_hi, st, BLOCK_N: gl.constexpr, LO: gl.constexpr, HI: gl.constexpr,
                   TRANSPOSE: gl.constexpr):
    """Stage st of the K or V ring as wgmma B operand(s): (the tile, the same tile) or, HI > 0 (split
    tiles), (lo tile, hi tile). TRANSPOSE: K^T for QK^T (V is used as stored)."""
    if HI > 0:
        op = tiles.index(st).reshape([BLOCK_N, LO])
        op_hi = tiles_hi.index(st).reshape([BLOCK_N, HI])
        if TRANSPOSE:
            op = op.permute((1, 0))
            op_hi = op_hi.permute((1, 0))
    else:
        op = tiles.index(st).reshape([BLOCK_N, LO])
        if TRANSPOSE:
            op = op.permute((1, 0))
        op_hi = op
    return op, op_hi


@gluon.jit
def _v_operands(tiles, tiles_hi, st, BLOCK_N: gl.constexpr, LO: gl.constexpr, HI: gl.constexpr,
                QUANT: gl.constexpr):
    """Stage st of the V ring as the PV wgmma's B operand(s) (_ring_operands). FP8: the stage holds VT
    [Dv, BLOCK_N] (keys contiguous); its transpose view [BLOCK_N, Dv] is the K-major B that e4m3 wgmma needs."""
    if QUANT.ON:
        op = tiles.index(st).reshape([LO, BLOCK_N]).permute((1, 0))
        ops = (op, op)
    else:
        ops = _ring_operands(tiles, tiles_hi, st, BLOCK_N, LO, HI, False)
    return ops


@gluon.jit
def _pv_mma(p, v, v_hi, acc, acc_hi, SPLIT_O: gl.constexpr):
    """Issue O += P V (async). SPLIT_O: O is two accumulators over V's columns [0, LO) and [LO, LO + HI),
    multiplied from the two V tiles v and v_hi. Returns the two O tokens and the P operand of the second
    wgmma, all three to be kept alive through warpgroup_mma_wait (two wgmma groups in flight when split;
    _pv_done waits for them)."""
    if SPLIT_O:
        tok = warpgroup_mma(p, v, acc, is_async=True)
        # P's registers in the operand layout of the second accumulator (the same rows and columns per
        # thread: the conversion moves no data)
        p_hi = gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=acc_hi.type.layout, k_width=2))
        tok_hi = warpgroup_mma(p_hi, v_hi, acc_hi, is_async=True)
    else:
        tok = warpgroup_mma(p, v, acc, is_async=True)
        tok_hi = acc_hi
        p_hi = p
    return tok, tok_hi, p_hi


@gluon.jit
def _pv_done(o_tok, o_tok_hi, p, p_hi, v, v_hi, SPLIT_O: gl.constexpr, P8: gl.constexpr = False):
    """Wait until every wgmma (the PV issued by _pv_mma last) has retired; returns the O accumulators.
    P8 (an e4m3 P): P stays out of the wait's operands, whose lowering takes 16- and 32-bit registers only
    (triton 3.6: "Unexpected bitwidth in WGMMAWaitGroupOp: 8"); ptxas itself keeps a wgmma's register operands
    alive until the wgmma.wait_group that retires it."""
    if P8:
        gl.static_assert(not SPLIT_O, "FP8: O is one accumulator")
        acc, _v = warpgroup_mma_wait(0, deps=[o_tok, v])
        acc_hi = o_tok_hi
    elif SPLIT_O:
        acc, acc_hi, _p, _ph, _v, _vh = warpgroup_mma_wait(0, deps=[o_tok, o_tok_hi, p, p_hi, v, v_hi])
    else:
        acc, _p, _v = warpgroup_mma_wait(0, deps=[o_tok, p, v])
        acc_hi = o_tok_hi
    return acc, acc_hi


@gluon.jit
def _fp8_o_before_pv(acc, alpha, QUANT: gl.constexpr):
    """O before the PV of a tile is issued (_fp8_overlap_loop): a chained accumulator is rescaled to the tile's base
    first (the wgmma adds into it); TWO_LEVEL leaves O alone (_fp8_o_after_pv)."""
    if not QUANT.TWO_LEVEL:
        acc = acc * alpha[:, None]
    return acc


@gluon.jit
def _fp8_o_after_pv(acc, pv, alpha, QUANT: gl.constexpr):
    """O once the PV of a tile retired: TWO_LEVEL: O·alpha + PV, one FFMA per element (a rescale before the wgmma and
    an add after it are not contracted across the wait); else the chained accumulator itself."""
    if QUANT.TWO_LEVEL:
        acc = acc * alpha[:, None] + pv
    else:
        acc = pv
    return acc


@gluon.jit
def _fp8_overlap_loop(q_op, k_smem, v_smem, bars, n_partial, n_total, b, h, mt, sp_ptrs, sp_meta, q_idx, q_idx_c,
                      row0, sm_scale, qk_unit, col_bias, N, score_bufs, mask_bufs, m_i, m_run, l_i, acc, qk_scale,
                      fp8_rows, s_zero, o_zero, cnt, t, s_layout: gl.constexpr, p_layout: gl.constexpr,
                      o_layout: gl.constexpr, SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr, WG: gl.constexpr,
                      TILE: gl.constexpr, SPARSE: gl.constexpr, FLAGS: gl.constexpr, QUANT: gl.constexpr):
    """The KV loop of an FP8 tile (n_total >= 1 KV tiles) with the intra-warpgroup overlap; returns
    (acc, m_i, m_run, l_i, cnt, t). Iteration i: the softmax of S_i, then QK^T of tile i+1 and the PV of tile i
    issued in one pingpong turn, both waited for before the next softmax.

    The 16-bit loop instead issues QK_{i+1} with PV_i at the top of iteration i+1, so P_i crosses the iteration, and
    triton 3.6 holds a loop-carried e4m3 tensor one byte per 32-bit register, repacked before every wgmma (D=128:
    174 PRMT + 64 LOP3 per KV tile and 48 registers more). Its softmax does not run under its own PV either: ptxas
    hoists that PV's wait above the softmax (docs/design/hopper_mods.md), which this loop writes out. Rotating the
    16-bit loop so that PV_i stays in flight across the iteration makes ptxas serialize every wgmma (C7514)."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn = bars
    BLOCK_N: gl.constexpr = TILE.BLOCK_N
    NUM_STAGES: gl.constexpr = TILE.NUM_STAGES
    V_STAGES: gl.constexpr = TILE.V_STAGES
    # ---- prologue: S_0 ----
    st = cnt % NUM_STAGES
    start = _kv_start(0, n_partial, b, h, mt, sp_ptrs, sp_meta, TILE, SPARSE, QUANT.TIGHT)
    tile_scales = _fp8_tile_scales(start, fp8_rows, QUANT)
    k_t, _k = _ring_operands(k_smem, k_smem, st, BLOCK_N, TILE.QK_LO, 0, True)
    mbarrier.wait(k_ready.index(st), (cnt // NUM_STAGES) & 1)
    t = _pingpong_wait(turn, t, WG)
    s_tok = _qk_mma(q_op, q_op, k_t, k_t, s_zero, False)
    _pingpong_signal(turn, WG)
    s_acc = _qk_done(s_tok, q_op, q_op, k_t, k_t, False)
    mbarrier.arrive(k_empty.index(st), count=1)
    if n_total == 1:   # the tile's only QK^T retired: the producer may load the next tile's Q half
        mbarrier.arrive(q_empty.index(WG), count=1)
    # ---- steady state: softmax S_i; issue QK_{i+1} and PV_i ----
    # DEFER_O (QUANT.LEAN, two-level, no mods, EVEN_N): O·alpha_i + PV_i waits for the next softmax and runs in its
    # issue slots (its MUFU-bound stretch leaves half of them idle) instead of between PV_i's retirement and that
    # softmax, on the warpgroup's critical path. Same arithmetic; PV_i's 64 registers per thread stay live through
    # the softmax, as they do at the issue, so the peak (S + O + PV + P) is the same, but anything more in the
    # softmax spills with it (a mod's registers: softcap + causal, ALiBi at D=64 and 128; the last tile's bound
    # mask: 6 LDL / STL at D=128): those launches update O after the wait.
    DEFER_O: gl.constexpr = (QUANT.LEAN and QUANT.TWO_LEVEL and not FLAGS.HAS_SCORE_MOD and not FLAGS.HAS_MASK_MOD
                             and FLAGS.EVEN_N)
    pv_prev = o_zero
    alpha_prev = gl.convert_layout(gl.full_like(l_i, 1.0), gl.SliceLayout(1, o_layout))
    for i in range(n_total - 1):
        p, m_i, m_run, l_i, alpha = _softmax_step(
            s_acc, start, i < n_partial, b, h, q_idx, q_idx_c, row0, sm_scale, qk_unit, col_bias, N, score_bufs,
            mask_bufs, m_i, m_run, l_i, qk_scale, tile_scales, s_layout, p_layout, o_layout, gl.float8e4nv, SCORE_MOD,
            MASK_MOD, TILE, FLAGS, QUANT)
        if DEFER_O:
            acc = _fp8_o_after_pv(acc, pv_prev, alpha_prev, QUANT)
        else:
            acc = _fp8_o_before_pv(acc, alpha, QUANT)
        vst = cnt % V_STAGES
        v_cur, _v = _v_operands(v_smem, v_smem, vst, BLOCK_N, TILE.V_LO, 0, QUANT)
        nxt = cnt + 1
        st = nxt % NUM_STAGES
        start = _kv_start(i + 1, n_partial, b, h, mt, sp_ptrs, sp_meta, TILE, SPARSE, QUANT.TIGHT)
        tile_scales = _fp8_tile_scales(start, fp8_rows, QUANT)
        k_t, _k = _ring_operands(k_smem, k_smem, st, BLOCK_N, TILE.QK_LO, 0, True)
        mbarrier.wait(k_ready.index(st), (nxt // NUM_STAGES) & 1)
        mbarrier.wait(v_ready.index(vst), (cnt // V_STAGES) & 1)
        t = _pingpong_wait(turn, t, WG)
        s_tok = _qk_mma(q_op, q_op, k_t, k_t, s_zero, False)
        pv_tok, _th, _ph = _pv_issue(p, v_cur, v_cur, acc, 0.0, o_zero, False, QUANT)
        _pingpong_signal(turn, WG)
        s_acc, pv, _kw, _vw = warpgroup_mma_wait(0, deps=[s_tok, pv_tok, k_t, v_cur])
        mbarrier.arrive(k_empty.index(st), count=1)
        mbarrier.arrive(v_empty.index(vst), count=1)
        if i == n_total - 2:   # the tile's last QK^T retired: release the Q half (as above)
            mbarrier.arrive(q_empty.index(WG), count=1)
        if DEFER_O:
            pv_prev = pv
            alpha_prev = alpha
        else:
            acc = _fp8_o_after_pv(acc, pv, alpha, QUANT)
        cnt = nxt
    # ---- the last KV tile: its softmax and its PV ----
    p, m_i, m_run, l_i, alpha = _softmax_step(
        s_acc, start, n_total - 1 < n_partial, b, h, q_idx, q_idx_c, row0, sm_scale, qk_unit, col_bias, N, score_bufs,
        mask_bufs, m_i, m_run, l_i, qk_scale, tile_scales, s_layout, p_layout, o_layout, gl.float8e4nv, SCORE_MOD,
        MASK_MOD, TILE, FLAGS, QUANT)
    if DEFER_O:
        acc = _fp8_o_after_pv(acc, pv_prev, alpha_prev, QUANT)
    else:
        acc = _fp8_o_before_pv(acc, alpha, QUANT)
    vst = cnt % V_STAGES
    v_cur, _v = _v_operands(v_smem, v_smem, vst, BLOCK_N, TILE.V_LO, 0, QUANT)
    mbarrier.wait(v_ready.index(vst), (cnt // V_STAGES) & 1)
    t = _pingpong_wait(turn, t, WG)
    pv_tok, _th, _ph = _pv_issue(p, v_cur, v_cur, acc, 0.0, o_zero, False, QUANT)
    _pingpong_signal(turn, WG)
    pv, _v = _pv_done(pv_tok, 0.0, p, p, v_cur, v_cur, False, True)
    acc = _fp8_o_after_pv(acc, pv, alpha, QUANT)
    mbarrier.arrive(v_empty.index(vst), count=1)
    return acc, m_i, m_run, l_i, cnt + 1, t


@gluon.jit
def _consumer(WG: gl.constexpr, descs, bars, smem, sizes, sp_ptrs, sp_meta, outs, scale_args, mod_bufs, quant_bufs,
              pack_args, SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr, TILE: gl.constexpr, SCHED: gl.constexpr,
              SPARSE: gl.constexpr, FLAGS: gl.constexpr, QUANT: gl.constexpr, PACK: gl.constexpr):
    q_desc, k_desc, v_desc, o_desc, q_desc_hi, k_desc_hi, v_desc_hi, o_desc_hi = descs
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn = bars
    q_smem, k_smem, v_smem, o_smem, q_smem_hi, k_smem_hi, v_smem_hi = smem
    num_tiles, num_m_tiles, HQ, GQA, M, N = sizes
    lse_ptr, max_ptr, sink_bufs = outs
    # qk_scale: score tile -> log2 units, folded into the exp2 argument: sm_scale·log2e for raw q.k,
    # the mod's OUT_SCALE·log2e after a score_mod (the host picks; see _prepare).
    sm_scale, qk_scale, fixed_base, qk_unit = scale_args
    score_bufs, mask_bufs = mod_bufs
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    BLOCK_N: gl.constexpr = TILE.BLOCK_N
    HALF_M: gl.constexpr = TILE.HALF_M
    NUM_STAGES: gl.constexpr = TILE.NUM_STAGES
    V_STAGES: gl.constexpr = TILE.V_STAGES
    # QK^T runs over QK_LO + QK_HI head-dim columns, O is accumulated over O_LO + O_HI (two accumulators
    # where O_HI > 0); a second tile / accumulator exists only for a head dim that is not a power of two.
    QK_LO: gl.constexpr = TILE.QK_LO
    QK_HI: gl.constexpr = TILE.QK_HI
    O_LO: gl.constexpr = TILE.V_LO
    O_HI: gl.constexpr = TILE.V_HI
    SPLIT_QK: gl.constexpr = TILE.SPLIT_QK
    SPLIT_O: gl.constexpr = TILE.SPLIT_V
    PERSISTENT: gl.constexpr = SCHED.PERSISTENT
    O_STAGE: gl.constexpr = SCHED.O_STAGE
    FIXED_BASE: gl.constexpr = FLAGS.FIXED_BASE
    KV_AFFINE: gl.constexpr = FLAGS.KV_AFFINE

    dtype: gl.constexpr = q_desc.dtype     # of Q, K, V and P (e4m3 with QUANT.ON)
    o_dtype: gl.constexpr = o_desc.dtype   # of O (bf16 / fp16)
    # wgmma's K step is 32 bytes: 16 elements of a 16-bit type, 32 of e4m3; a register A operand holds
    # k_width consecutive K elements per 32-bit register (2 of 16 bits, 4 of e4m3)
    INSTR_K: gl.constexpr = 32 if QUANT.ON else 16
    K_WIDTH: gl.constexpr = 4 if QUANT.ON else 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, INSTR_K])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, O_LO, INSTR_K])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=K_WIDTH)
    if QUANT.ON:
        gl.static_assert(not SPLIT_QK and not SPLIT_O and O_STAGE, "FP8: power-of-two head dims, O staged apart")
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    q_half = q_smem.index(WG)
    q_op = q_half.reshape([HALF_M, QK_LO])
    if SPLIT_QK:
        q_half_hi = q_smem_hi.index(WG)
        q_op_hi = q_half_hi.reshape([HALF_M, QK_HI])
    else:
        q_half_hi = q_half
        q_op_hi = q_op
    if O_STAGE:
        gl.static_assert(not SPLIT_QK and not SPLIT_O, "split shared tiles reuse the Q tiles for O")
        o_half = o_smem.index(WG)
    else:   # O is staged in the Q tiles: the same shapes (a V head dim other than Q's: V in Q's lo tile)
        gl.static_assert(o_desc.block_type.nbytes == q_desc.block_type.nbytes, "O is staged in the Q tile")
        if SPLIT_O:
            gl.static_assert(SPLIT_QK and O_HI == QK_HI, "O's hi part is staged in Q's hi tile")
        o_half = q_half

    if QUANT.TIGHT:
        num_tiles = _opaque(num_tiles)
    n_it, pid, nprog = _tile_loop(num_tiles, num_m_tiles, HQ, pack_args, TILE, PERSISTENT, PACK)

    if WG == TILE.CONSUMERS - 1:
        mbarrier.arrive(turn.index(0), count=1)   # pingpong: warpgroup 0 takes the first turn

    cnt = 0   # KV tiles consumed so far (global ring counter, same sequence as the producer)
    t = 0     # pingpong turns taken
    t_local = 0
    for it in range(n_it):
        if QUANT.TIGHT:   # M - 1, HQ // GQA, a mod's sm_scale products...: per tile, not kernel-wide registers
            M = _opaque(M)
            HQ = _opaque(HQ)
            GQA = _opaque(GQA)
            num_m_tiles = _opaque(num_m_tiles)
            sm_scale = _opaque(sm_scale)
        tile_id = _tile_id(it, pid, nprog, PERSISTENT)
        b, h, mt = _tile_coords(tile_id, num_tiles, num_m_tiles, HQ, PERSISTENT, PACK.VARLEN, pack_args,
                                BLOCK_M)
        # the tile's sequence (VARLEN; dense: z = b, q0 = 0, M_seq = M, N_seq = N): rows and keys are positions in it
        z, q0, M_seq, k0, N_seq, q_pos = _seq_rows(b, M, N, pack_args, PACK)
        # the causal walk's offset and SPARSE.WINDOW's W (pack_args' WINDOW); None leaves other modes' code as it was
        walk_pos = q_pos if PACK.CACHE or SPARSE.WINDOW else None
        walk_win = pack_args[3] if PACK.CACHE else (pack_args[5] if SPARSE.WINDOW else None)
        row0 = mt * BLOCK_M + WG * HALF_M
        # pos0: the half's first row as the mods see it (CACHE: its position in the sequence; otherwise row0)
        pos0 = q_pos + row0
        q_idx = pos0 + gl.arange(0, HALF_M, layout=row_layout)[:, None]
        q_idx_c = gl.minimum(q_idx, q_pos + M_seq - 1)
        if PACK.CACHE:
            # a row at a negative position (a chunk longer than its sequence) is at 0 for the mods, as in the decode
            # kernels: generated mods take positions in [0, 2^23) (mod_helpers' float rebuild), and the affine parts
            # evaluate the mod at the half's first row
            q_idx_c = gl.maximum(q_idx_c, 0)
            pos0 = gl.maximum(pos0, 0)
        if KV_AFFINE:
            col_bias = _affine_columns(SCORE_MOD, sm_scale, b, h, pos0, score_bufs, s_layout, BLOCK_N)
        else:
            col_bias = 0.0
        n_partial, n_total = _kv_counts(b, h, mt, N_seq, sp_ptrs, sp_meta, TILE, SPARSE, walk_pos, walk_win)
        if QUANT.ON:
            fp8_rows = _fp8_row_scales(quant_bufs, b, h, row0, HQ, GQA, M, N, row_layout, HALF_M, QUANT)
        else:
            fp8_rows = 0.0

        if FIXED_BASE:   # MAX is not tracked: NaN marks it so (rows with no key still get -inf)
            m_i = gl.full([HALF_M], float("nan"), gl.float32, layout=row_layout)
            m_run = gl.full([HALF_M], fixed_base, gl.float32, layout=row_layout)
        else:
            m_i = gl.full([HALF_M], -float("inf"), gl.float32, layout=row_layout)
            m_run = gl.full([HALF_M], -float("inf"), gl.float32, layout=row_layout)
        l_i = gl.full([HALF_M], 0.0, gl.float32, layout=row_layout)
        acc = gl.zeros([HALF_M, O_LO], gl.float32, layout=o_layout)
        if SPLIT_O:
            acc_hi = gl.zeros([HALF_M, O_HI], gl.float32, layout=gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, O_HI, 16]))
        else:
            acc_hi = 0.0
        if QUANT.QK_INT8:   # the QK^T accumulator's type (use_acc=False: its values are never read)
            s_zero = gl.zeros([HALF_M, BLOCK_N], gl.int32, layout=s_layout)
        else:
            s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)
        if QUANT.TWO_LEVEL:   # the fresh PV accumulator's shape (use_acc=False: its values are never read)
            o_zero = gl.zeros([HALF_M, O_LO], gl.float32, layout=o_layout)
        else:
            o_zero = 0.0

        mbarrier.wait(q_ready.index(WG), t_local & 1)

        if SCHED.OVERLAP and QUANT.ON:
            if n_total > 0:
                acc, m_i, m_run, l_i, cnt, t = _fp8_overlap_loop(
                    q_op, k_smem, v_smem, bars, n_partial, n_total, b, h, mt, sp_ptrs, sp_meta, q_idx, q_idx_c, row0,
                    sm_scale, qk_unit, col_bias, N_seq, score_bufs, mask_bufs, m_i, m_run, l_i, acc, qk_scale, fp8_rows,
                    s_zero, o_zero, cnt, t, s_layout, p_layout, o_layout, SCORE_MOD, MASK_MOD, WG, TILE, SPARSE, FLAGS,
                    QUANT)
        elif SCHED.OVERLAP:
            if n_total > 0:
                # ---- prologue: S_0 and its softmax ----
                st = cnt % NUM_STAGES
                ph = (cnt // NUM_STAGES) & 1
                start = _kv_start(0, n_partial, b, h, mt, sp_ptrs, sp_meta, TILE, SPARSE, False, walk_pos,
                                  walk_win, N_seq)
                tile_scales = _fp8_tile_scales(start, fp8_rows, QUANT)
                k_t, k_t_hi = _ring_operands(k_smem, k_smem_hi, st, BLOCK_N, QK_LO, QK_HI, True)
                mbarrier.wait(k_ready.index(st), ph)
                t = _pingpong_wait(turn, t, WG)
                s_tok = _qk_mma(q_op, q_op_hi, k_t, k_t_hi, s_zero, SPLIT_QK)
                _pingpong_signal(turn, WG, TILE.CONSUMERS)
                s_acc = _qk_done(s_tok, q_op, q_op_hi, k_t, k_t_hi, SPLIT_QK)
                mbarrier.arrive(k_empty.index(st), count=1)
                if O_STAGE:
                    if n_total == 1:   # the tile's only QK^T retired: release the Q half (see below)
                        mbarrier.arrive(q_empty.index(WG), count=1)
                p, m_i, m_run, l_i, alpha = _softmax_step(
                    s_acc, start, n_partial > 0, b, h, q_idx, q_idx_c, pos0, sm_scale, qk_unit, col_bias, N_seq,
                    score_bufs, mask_bufs, m_i, m_run, l_i, qk_scale, tile_scales, s_layout, p_layout, o_layout, dtype,
                    SCORE_MOD, MASK_MOD, TILE, FLAGS, QUANT)
                prev_start = start
                prev_vst = cnt % V_STAGES
                prev_vph = (cnt // V_STAGES) & 1
                cnt += 1
                # ---- steady state: issue S_{i} and O += P_{i-1} V_{i-1}, softmax S_i under the PV ----
                for i in range(1, n_total):
                    st = cnt % NUM_STAGES
                    ph = (cnt // NUM_STAGES) & 1
                    start = _kv_start(i, n_partial, b, h, mt, sp_ptrs, sp_meta, TILE, SPARSE, False, walk_pos,
                                      walk_win, N_seq)
                    tile_scales = _fp8_tile_scales(start, fp8_rows, QUANT)
                    k_t, k_t_hi = _ring_operands(k_smem, k_smem_hi, st, BLOCK_N, QK_LO, QK_HI, True)
                    v_prev, v_prev_hi = _v_operands(v_smem, v_smem_hi, prev_vst, BLOCK_N, O_LO, O_HI, QUANT)
                    mbarrier.wait(k_ready.index(st), ph)
                    mbarrier.wait(v_ready.index(prev_vst), prev_vph)
                    if PACK.CACHE:
                        _zero_keys_past(v_smem, v_smem_hi, prev_vst, N_seq - prev_start, TILE)
                    t = _pingpong_wait(turn, t, WG)
                    s_tok = _qk_mma(q_op, q_op_hi, k_t, k_t_hi, s_zero, SPLIT_QK)
                    o_tok, o_tok_hi, p_hi = _pv_issue(p, v_prev, v_prev_hi, acc, acc_hi, o_zero, SPLIT_O, QUANT)
                    _pingpong_signal(turn, WG, TILE.CONSUMERS)
                    if SPLIT_O:   # wgmma groups retire in order: QK^T done, the two PV groups may not be
                        s_acc, o_tok, o_tok_hi = warpgroup_mma_wait(2, deps=[s_tok, o_tok, o_tok_hi])
                    else:
                        s_acc, o_tok = warpgroup_mma_wait(1, deps=[s_tok, o_tok])
                    mbarrier.arrive(k_empty.index(st), count=1)
                    if O_STAGE:
                        if i == n_total - 1:
                            # the tile's last QK^T retired: the producer may load the next tile's Q half
                            # (and then its K/V) under this softmax, the tail PV and the epilogue
                            mbarrier.arrive(q_empty.index(WG), count=1)
                    p_new, m_i, m_run, l_i, alpha = _softmax_step(
                        s_acc, start, i < n_partial, b, h, q_idx, q_idx_c, pos0, sm_scale, qk_unit, col_bias, N_seq,
                        score_bufs, mask_bufs, m_i, m_run, l_i, qk_scale, tile_scales, s_layout, p_layout, o_layout,
                        dtype, SCORE_MOD, MASK_MOD, TILE, FLAGS, QUANT)
                    pv, acc_hi = _pv_done(o_tok, o_tok_hi, p, p_hi, v_prev, v_prev_hi, SPLIT_O)
                    mbarrier.arrive(v_empty.index(prev_vst), count=1)
                    acc = _rescale_o(pv, alpha, FIXED_BASE)
                    acc_hi = _rescale_o_hi(acc_hi, alpha, FIXED_BASE, SPLIT_O)
                    p = p_new
                    prev_start = start
                    prev_vst = cnt % V_STAGES
                    prev_vph = (cnt // V_STAGES) & 1
                    cnt += 1
                # ---- tail: O += P_last V_last ----
                v_prev, v_prev_hi = _v_operands(v_smem, v_smem_hi, prev_vst, BLOCK_N, O_LO, O_HI, QUANT)
                mbarrier.wait(v_ready.index(prev_vst), prev_vph)
                if PACK.CACHE:
                    _zero_keys_past(v_smem, v_smem_hi, prev_vst, N_seq - prev_start, TILE)
                t = _pingpong_wait(turn, t, WG)
                o_tok, o_tok_hi, p_hi = _pv_issue(p, v_prev, v_prev_hi, acc, acc_hi, o_zero, SPLIT_O, QUANT)
                _pingpong_signal(turn, WG, TILE.CONSUMERS)
                pv, acc_hi = _pv_done(o_tok, o_tok_hi, p, p_hi, v_prev, v_prev_hi, SPLIT_O)
                acc = _o_add(acc, pv, QUANT)
                mbarrier.arrive(v_empty.index(prev_vst), count=1)
        else:
            # No intra-warpgroup overlap: S_i, softmax_i, O += P_i V_i strictly in sequence.
            for i in range(n_total):
                st = cnt % NUM_STAGES
                ph = (cnt // NUM_STAGES) & 1
                start = _kv_start(i, n_partial, b, h, mt, sp_ptrs, sp_meta, TILE, SPARSE, False, walk_pos,
                                  walk_win, N_seq)
                tile_scales = _fp8_tile_scales(start, fp8_rows, QUANT)
                k_t, k_t_hi = _ring_operands(k_smem, k_smem_hi, st, BLOCK_N, QK_LO, QK_HI, True)
                mbarrier.wait(k_ready.index(st), ph)
                t = _pingpong_wait(turn, t, WG)
                s_tok = _qk_mma(q_op, q_op_hi, k_t, k_t_hi, s_zero, SPLIT_QK)
                _pingpong_signal(turn, WG, TILE.CONSUMERS)
                s_acc = _qk_done(s_tok, q_op, q_op_hi, k_t, k_t_hi, SPLIT_QK)
                vst = cnt % V_STAGES
                vph = (cnt // V_STAGES) & 1
                v_cur, v_cur_hi = _v_operands(v_smem, v_smem_hi, vst, BLOCK_N, O_LO, O_HI, QUANT)
                mbarrier.arrive(k_empty.index(st), count=1)
                p, m_i, m_run, l_i, alpha = _softmax_step(
                    s_acc, start, i < n_partial, b, h, q_idx, q_idx_c, pos0, sm_scale, qk_unit, col_bias, N_seq,
                    score_bufs, mask_bufs, m_i, m_run, l_i, qk_scale, tile_scales, s_layout, p_layout, o_layout, dtype,
                    SCORE_MOD, MASK_MOD, TILE, FLAGS, QUANT)
                acc = _rescale_o(acc, alpha, FIXED_BASE)
                acc_hi = _rescale_o_hi(acc_hi, alpha, FIXED_BASE, SPLIT_O)
                mbarrier.wait(v_ready.index(vst), vph)
                if PACK.CACHE:
                    _zero_keys_past(v_smem, v_smem_hi, vst, N_seq - start, TILE)
                t = _pingpong_wait(turn, t, WG)
                o_tok, o_tok_hi, p_hi = _pv_issue(p, v_cur, v_cur_hi, acc, acc_hi, o_zero, SPLIT_O, QUANT)
                _pingpong_signal(turn, WG, TILE.CONSUMERS)
                pv, acc_hi = _pv_done(o_tok, o_tok_hi, p, p_hi, v_cur, v_cur_hi, SPLIT_O, QUANT.ON)
                acc = _o_add(acc, pv, QUANT)
                mbarrier.arrive(v_empty.index(vst), count=1)
                cnt += 1
            if O_STAGE:
                mbarrier.arrive(q_empty.index(WG), count=1)

        if O_STAGE:
            if SCHED.OVERLAP:
                if n_total == 0:   # no KV tile: Q was never read
                    mbarrier.arrive(q_empty.index(WG), count=1)

        if QUANT.TIGHT:
            # the epilogue's coordinates and O staging address from the tile id again: kept from the tile's start,
            # they would be registers held across the KV loop
            b, h, mt = _tile_coords(_opaque(tile_id), num_tiles, num_m_tiles, HQ, PERSISTENT, PACK.VARLEN,
                                    pack_args, BLOCK_M)
            z, q0, M_seq, k0, N_seq, q_pos = _seq_rows(b, M, N, pack_args, PACK)
            row0 = mt * BLOCK_M + WG * HALF_M
            pos0 = q_pos + row0
            o_half = o_smem.index(_opaque(row0 * 0 + WG))
        if KV_AFFINE:   # the row part of the mod, left out of the tiles (see _affine_columns)
            r = _affine_rows(SCORE_MOD, sm_scale, b, h, pos0, q_idx_c, score_bufs)
            m_i = m_i + r
            m_run = m_run + r * qk_scale
        m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        r_o = gl.convert_layout(m_run, gl.SliceLayout(1, o_layout))
        if QUANT.ON:   # P carried 2^8 / VS_MAX
            vs_max = fp8_rows[3]
            acc = acc * (vs_max * (1.0 / 256.0))
        _epilogue(acc, acc_hi, m_o, r_o, l_o, qk_scale, o_half, q_half_hi, o_desc, o_desc_hi, lse_ptr, max_ptr,
                  sink_bufs, pack_args, z, h, q0, row0, HQ, M, M_seq, o_layout, HALF_M, o_dtype, O_STAGE, SPLIT_O,
                  FLAGS.HAS_SINKS, PACK.VARLEN, QUANT.TIGHT and not KV_AFFINE)
        if not O_STAGE:
            mbarrier.arrive(q_empty.index(WG), count=1)
        t_local += 1
    if O_STAGE:
        tma.store_wait(0)   # the last O store must finish reading shared memory before the CTA exits


@gluon.jit
def _consumer_wg0(descs, bars, smem, sizes, sp_ptrs, sp_meta, outs, scale_args, mod_bufs, quant_bufs, pack_args,
                  SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr, TILE: gl.constexpr, SCHED: gl.constexpr,
                  SPARSE: gl.constexpr, FLAGS: gl.constexpr, QUANT: gl.constexpr, PACK: gl.constexpr):
    _consumer(0, descs, bars, smem, sizes, sp_ptrs, sp_meta, outs, scale_args, mod_bufs, quant_bufs, pack_args,
              SCORE_MOD, MASK_MOD, TILE, SCHED, SPARSE, FLAGS, QUANT, PACK)


@gluon.jit
def _consumer_wg1(descs, bars, smem, sizes, sp_ptrs, sp_meta, outs, scale_args, mod_bufs, quant_bufs, pack_args,
                  SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr, TILE: gl.constexpr, SCHED: gl.constexpr,
                  SPARSE: gl.constexpr, FLAGS: gl.constexpr, QUANT: gl.constexpr, PACK: gl.constexpr):
    _consumer(1, descs, bars, smem, sizes, sp_ptrs, sp_meta, outs, scale_args, mod_bufs, quant_bufs, pack_args,
              SCORE_MOD, MASK_MOD, TILE, SCHED, SPARSE, FLAGS, QUANT, PACK)


@gluon.jit
def _consumer_wg2(descs, bars, smem, sizes, sp_ptrs, sp_meta, outs, scale_args, mod_bufs, quant_bufs, pack_args,
                  SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr, TILE: gl.constexpr, SCHED: gl.constexpr,
                  SPARSE: gl.constexpr, FLAGS: gl.constexpr, QUANT: gl.constexpr, PACK: gl.constexpr):
    _consumer(2, descs, bars, smem, sizes, sp_ptrs, sp_meta, outs, scale_args, mod_bufs, quant_bufs, pack_args,
              SCORE_MOD, MASK_MOD, TILE, SCHED, SPARSE, FLAGS, QUANT, PACK)


@gluon.jit
def _producer_entry(descs, bars, smem, sizes, sp_ptrs, sp_meta, outs, scale_args, mod_bufs, quant_bufs, pack_args,
                    SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr, TILE: gl.constexpr, SCHED: gl.constexpr,
                    SPARSE: gl.constexpr, FLAGS: gl.constexpr, QUANT: gl.constexpr, PACK: gl.constexpr):
    _producer(descs, bars, smem, sizes, sp_ptrs, sp_meta, pack_args, TILE, SCHED, SPARSE, QUANT, PACK)


# ----------------------------------------------------------------------------------------------
# The kernel: allocate shared memory and barriers, then fork the three roles.
# ----------------------------------------------------------------------------------------------
# Sizes that follow the sequence lengths: no divisibility / equal-to-1 hints (they would make a compile per length
# class). Q / K / V / O go through TMA descriptors; the hints only folded scalar index math (num_tiles % 2 in the
# persistent tile loop, the block-mask table offsets) and the LSE / MAX row offsets, whose stores hold two rows per
# thread and do not vectorize (SASS, D=128 S4096: the KV loops the same length, 8 more instructions outside them).
# BM / HM stay hinted: they are the mask's batch / head broadcast (1 for a mask built with B=None), a site property,
# and b % 1 folding away keeps the masked KV loop as it was.
_RUNTIME_SIZES = ["nb_sb", "nb_sh", "idx_sb", "idx_sh", "idx_sm", "fnb_sb", "fnb_sh", "fidx_sb",
                  "fidx_sh", "fidx_sm", "num_tiles", "num_m_tiles", "M", "N"]




@gluon.jit
def _ring(desc, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, PACK: gl.constexpr):
    """A K or V ring of STAGES stages in desc's layout: a stage is one of desc's boxes, or with pages (PACK.PAGE)
    BLOCK_N rows of them, a KV tile of several page boxes (_load_page_tiles)."""
    if PACK.PAGE > 0:
        ring = gl.allocate_shared_memory(desc.dtype, [STAGES, 1, 1, BLOCK_N, desc.block_type.shape[3]], desc.layout)
    else:
        ring = gl.allocate_shared_memory(desc.dtype, [STAGES] + desc.block_type.shape, desc.layout)
    return ring


@gluon.jit(do_not_specialize=_RUNTIME_SIZES)
def fa3_fwd_sm90_kernel(
    q_desc, k_desc, v_desc, o_desc,
    q_desc_hi, k_desc_hi, v_desc_hi, o_desc_hi,   # TILE.SPLIT_QK / SPLIT_V: the hi tiles' descriptors (else None)
    lse_ptr, max_ptr,
    score_bufs, mask_bufs,
    quant_bufs,     # QUANT.ON: (QS, KS, VS, VS_MAX) scale pointers; () for 16-bit inputs (no kernel parameter)
    sink_bufs,      # FLAGS.HAS_SINKS: (SINKS,); () without sinks (no kernel parameter)
    pack_args,      # PACK.VARLEN: (CU_Q, CU_K, O, O's token and head strides, WINDOW, TILES); PACK.CACHE: (LENS,
                    # FIRST, FIRST_DELTA, WINDOW, and with pages TABLE, its row stride, max_pages); () otherwise
    kvnb_ptr, kvidx_ptr, fnb_ptr, fidx_ptr,
    BM, HM, nb_sb, nb_sh, idx_sb, idx_sh, idx_sm, fnb_sb, fnb_sh, fidx_sb, fidx_sh, fidx_sm,
    sm_scale, qk_scale, fixed_base, qk_unit, num_tiles, num_m_tiles, HQ, GQA, M, N,
    SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr,   # @gluon.jit mods (or None)
    TILE: gl.constexpr,     # TileShape
    SCHED: gl.constexpr,    # Schedule
    SPARSE: gl.constexpr,   # BlockSparsity
    FLAGS: gl.constexpr,    # ModFlags
    QUANT: gl.constexpr,    # Quant
    PACK: gl.constexpr,     # Packing
):
    NUM_STAGES: gl.constexpr = TILE.NUM_STAGES
    V_STAGES: gl.constexpr = TILE.V_STAGES
    CONSUMERS: gl.constexpr = TILE.CONSUMERS
    if PACK.VARLEN or PACK.CACHE:
        gl.static_assert(not QUANT.ON and not SPARSE.HAS_SPARSE and not (PACK.VARLEN and PACK.CACHE),
                         "packed sequences or a decode cache: 16-bit inputs, no block mask")
    if CONSUMERS != 2:
        gl.static_assert(CONSUMERS == 3 and not QUANT.ON and not PACK.VARLEN and not TILE.SPLIT_QK and not TILE.SPLIT_V,
                         "three consumer warpgroups: 16-bit inputs, power-of-two head dims, no packed sequences")
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_smem = _ring(k_desc, NUM_STAGES, TILE.BLOCK_N, PACK)
    v_smem = _ring(v_desc, V_STAGES, TILE.BLOCK_N, PACK)
    # The hi parts of a padded head dim's tiles (the tiles above hold the lo columns); without a split the
    # names alias the lo tiles and descriptors, never read.
    if TILE.SPLIT_QK:
        q_smem_hi = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS] + q_desc_hi.block_type.shape, q_desc_hi.layout)
        k_smem_hi = _ring(k_desc_hi, NUM_STAGES, TILE.BLOCK_N, PACK)
        qh_desc = q_desc_hi
        kh_desc = k_desc_hi
    else:
        q_smem_hi = q_smem
        k_smem_hi = k_smem
        qh_desc = q_desc
        kh_desc = k_desc
    if TILE.SPLIT_V:
        v_smem_hi = _ring(v_desc_hi, V_STAGES, TILE.BLOCK_N, PACK)
        vh_desc = v_desc_hi
        oh_desc = o_desc_hi
    else:
        v_smem_hi = v_smem
        vh_desc = v_desc
        oh_desc = o_desc
    if SCHED.O_STAGE:   # own O staging buffer: Q can be released (and the next Q loaded) before the epilogue
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [CONSUMERS] + o_desc.block_type.shape, o_desc.layout)
    else:
        o_smem = q_smem

    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(w), count=1)
        mbarrier.init(q_empty.index(w), count=1)
        mbarrier.init(turn.index(w), count=1)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=CONSUMERS)
        if s < V_STAGES:
            mbarrier.init(v_ready.index(s), count=1)
            mbarrier.init(v_empty.index(s), count=CONSUMERS)
    for s in gl.static_range(NUM_STAGES, V_STAGES):   # a V ring deeper than the K ring
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(v_empty.index(s), count=CONSUMERS)

    descs = (q_desc, k_desc, v_desc, o_desc, qh_desc, kh_desc, vh_desc, oh_desc)
    bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn)
    smem = (q_smem, k_smem, v_smem, o_smem, q_smem_hi, k_smem_hi, v_smem_hi)
    sizes = (num_tiles, num_m_tiles, HQ, GQA, M, N)
    sp_ptrs = (kvnb_ptr, kvidx_ptr, fnb_ptr, fidx_ptr)
    sp_meta = (BM, HM, nb_sb, nb_sh, idx_sb, idx_sh, idx_sm, fnb_sb, fnb_sh, fidx_sb, fidx_sh, fidx_sm)
    outs = (lse_ptr, max_ptr, sink_bufs)
    scale_args = (sm_scale, qk_scale, fixed_base, qk_unit)
    mod_bufs = (score_bufs, mask_bufs)
    # every role gets the same arguments (the producer's entry drops what it does not read). The partition list is
    # written out per consumer count: Gluon takes it as a literal, and a tuple holding the mods (jit functions) cannot
    # be bound to a name first (triton 3.6: "cannot convert JITFunction ... to tensor")
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_consumer_wg0, (descs, bars, smem, sizes, sp_ptrs, sp_meta, outs, scale_args, mod_bufs, quant_bufs,
                             pack_args, SCORE_MOD, MASK_MOD, TILE, SCHED, SPARSE, FLAGS, QUANT, PACK)),
            (_consumer_wg1, (descs, bars, smem, sizes, sp_ptrs, sp_meta, outs, scale_args, mod_bufs, quant_bufs,
                             pack_args, SCORE_MOD, MASK_MOD, TILE, SCHED, SPARSE, FLAGS, QUANT, PACK)),
            (_consumer_wg2, (descs, bars, smem, sizes, sp_ptrs, sp_meta, outs, scale_args, mod_bufs, quant_bufs,
                             pack_args, SCORE_MOD, MASK_MOD, TILE, SCHED, SPARSE, FLAGS, QUANT, PACK)),
            (_producer_entry, (descs, bars, smem, sizes, sp_ptrs, sp_meta, outs, scale_args, mod_bufs, quant_bufs,
                               pack_args, SCORE_MOD, MASK_MOD, TILE, SCHED, SPARSE, FLAGS, QUANT, PACK)),
        ], [4, 4, 1], [SCHED.CONSUMER_REGS, SCHED.CONSUMER_REGS, SCHED.PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer_wg0, (descs, bars, smem, sizes, sp_ptrs, sp_meta, outs, scale_args, mod_bufs, quant_bufs,
                             pack_args, SCORE_MOD, MASK_MOD, TILE, SCHED, SPARSE, FLAGS, QUANT, PACK)),
            (_consumer_wg1, (descs, bars, smem, sizes, sp_ptrs, sp_meta, outs, scale_args, mod_bufs, quant_bufs,
                             pack_args, SCORE_MOD, MASK_MOD, TILE, SCHED, SPARSE, FLAGS, QUANT, PACK)),
            (_producer_entry, (descs, bars, smem, sizes, sp_ptrs, sp_meta, outs, scale_args, mod_bufs, quant_bufs,
                               pack_args, SCORE_MOD, MASK_MOD, TILE, SCHED, SPARSE, FLAGS, QUANT, PACK)),
        ], [4, 1], [SCHED.CONSUMER_REGS, SCHED.PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------
_NUM_SMS: dict = {}


def _num_sms(device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def _gl_dtype(dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv,
            torch.int8: gl.int8}[dtype]


@functools.lru_cache(maxsize=64)
def _smem_layout(block_shape: tuple, dtype: torch.dtype):
    # Computing the default NVMMA layout dominated the per-call host cost of _prepare.
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), _gl_dtype(dtype))


def _desc(t, block_shape):
    layout = _smem_layout(tuple(block_shape), t.dtype)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block_shape, layout)


def supports_sm90(q, k, v, out=None, *, kv_num_blocks=None, sparse_q_block: int = 128,
                  sparse_kv_block: int = 128, config: Sm90Config | None = None, check_device: bool = True) -> bool:
    """True when launch_fwd_sm90 can serve these inputs (device sm90, dtype, head dims, TMA alignment,
    sparse block sizes). V may have another head dim than Q and K where the config table has the pair
    (configs.serves_head_dims). `check_device=False` skips the device checks (for CPU-side planning).

    Example::

        >>> q = torch.empty(1, 2, 256, 192, dtype=torch.bfloat16); v = torch.empty(1, 2, 256, 128, dtype=torch.bfloat16)
        >>> supports_sm90(q, q, v, check_device=False), supports_sm90(q, q, v[..., :64], check_device=False)
        (True, False)
    """
    try:
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            return False
        if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
            return False
        B, Hq, M, D = q.shape
        Bk, Hkv, N, Dk = k.shape
        Dv = v.shape[-1]
        if tuple(v.shape) != (Bk, Hkv, N, Dv) or Bk != B or Dk != D or Hkv == 0 or Hq % Hkv:
            return False
        if out is not None and tuple(out.shape) != (B, Hq, M, Dv):
            return False
        if M < 1 or N < 1 or max(M, N) >= MAX_POSITION:   # (the generated mods' positions: modgen.MAX_POSITION)
            return False
        if not serves_head_dims(D, Dv):
            return False
        cfg = config or get_config(D, q.dtype, value_head_dim=Dv)
        # 192 rows: three consumer warpgroups, dense launches of power-of-two head dims only (TileShape.CONSUMERS)
        if cfg.block_m != 128 and not (cfg.block_m == 192 and kv_num_blocks is None and D == Dv and not D & (D - 1)):
            return False
        tensors = [q, k, v] + ([out] if out is not None else [])
        if not all(tma_aligned(t) for t in tensors):
            return False
        if kv_num_blocks is not None:
            if sparse_q_block % cfg.block_m or sparse_kv_block % cfg.block_n:
                return False
        if check_device:
            if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
                return False
        return True
    except (ValueError, KeyError):
        return False


_LONGEST_ROW: dict = {}


def _longest_row(kv_num_blocks, full_kv_num_blocks):
    """The most KV blocks any query block of a block mask visits (partial + full), or None where it cannot
    be read without harm (inside CUDA-graph capture). One device sync per mask: remembered for the same
    tensor objects at the same version (weak references, so a new mask at a recycled address is read
    afresh). The product path prepares a launch once per input signature, so it reads its first mask only."""
    tensors = [t for t in (kv_num_blocks, full_kv_num_blocks) if t is not None]
    if any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing():
        return None
    key = tuple(id(t) for t in tensors)
    hit = _LONGEST_ROW.get(key)
    if hit is not None and all(r() is t and v == t._version for (r, v), t in zip(hit[0], tensors)):
        return hit[1]
    total = kv_num_blocks.to(torch.int64)
    if full_kv_num_blocks is not None:
        total = total + full_kv_num_blocks.to(torch.int64)
    longest = int(total.max().item()) if total.numel() else 0
    if len(_LONGEST_ROW) >= 256:
        _LONGEST_ROW.clear()
    _LONGEST_ROW[key] = ([(weakref.ref(t), t._version) for t in tensors], longest)
    return longest


def _prepare(q, k, v, out, lse, max_scores, sm_scale, score_mod, mask_mod, score_bufs, mask_bufs,
             kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, sparse_q_block, sparse_kv_block,
             config, num_sms, max_needed=True, persistent=None, even_n=None, fp8=None, sinks=None):
    """Build (args, kwargs, grid) for fa3_fwd_sm90_kernel; shared by the launcher and compile-only tests.
    `persistent` / `even_n` override the schedule and EVEN_N (siblings compiled ahead: never launched so)."""
    return _site(q, k, v, out, lse, max_scores, sm_scale, score_mod, mask_mod, score_bufs, mask_bufs,
                 kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, sparse_q_block, sparse_kv_block,
                 config, num_sms, max_needed, fp8, sinks).launch(persistent, even_n)


@dataclass
class _Site:
    """One launch site as _site prepared it: the kernel's arguments and its constexpr bundles, built once.
    The choices a length makes (the schedule with its O_STAGE, EVEN_N) are made per launch (`launch`)."""
    args: tuple
    score_mod: object
    mask_mod: object
    tile: TileShape
    sparse: BlockSparsity
    flags: ModFlags           # EVEN_N as this launch's N decides it
    quant: Quant
    cfg: Sm90Config
    schedules: dict           # persistent -> Schedule
    num_tiles: int
    num_sms: int
    persistent: bool          # as use_persistent decides for this launch
    pack: Packing = DENSE

    def launch(self, persistent=None, even_n=None):
        """(args, kwargs, grid) of this site's launch, or of a sibling: the schedule / EVEN_N overridden."""
        persistent = self.persistent if persistent is None else persistent
        flags = self.flags if even_n is None or even_n == self.flags.EVEN_N else replace(self.flags, EVEN_N=even_n)
        # persistent CTAs take tile pairs
        grid = (min((self.num_tiles + 1) // 2, self.num_sms),) if persistent else (self.num_tiles,)
        kwargs = dict(SCORE_MOD=self.score_mod, MASK_MOD=self.mask_mod, TILE=self.tile,
                      SCHED=self.schedules[persistent], SPARSE=self.sparse, FLAGS=flags, QUANT=self.quant,
                      PACK=self.pack, num_warps=4, maxnreg=self.cfg.maxnreg)
        return self.args, kwargs, grid


def _plain(score_mod, mask_mod, kv_num_blocks, packed, sinks, D, Dv) -> bool:
    """A launch without mods, block mask, packing or sinks, one head dim: configs.long_dense_config's launches."""
    return (score_mod is None and mask_mod is None and kv_num_blocks is None and packed is None and sinks is None
            and D == Dv)


def _site(q, k, v, out, lse, max_scores, sm_scale, score_mod, mask_mod, score_bufs, mask_bufs,
          kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, sparse_q_block, sparse_kv_block,
          config, num_sms, max_needed=True, fp8=None, sinks=None, packed=None, cache=None) -> _Site:
    """The site behind _prepare: descriptors, block-mask tables, scales and the constexpr bundles.
    `fp8`: the FP8 prologue's FP8Operands (q, k, v are then its q, k and vt; `out` is bf16 / fp16).
    `sinks`: [Hq] per-head logits joining each row's denominator (module docstring, SINKS), or None.
    `packed`: the packed sequences of a VARLEN launch (PackedRows; q, k, v, out, lse, max_scores are then
    [1, H, total, ...] views of the packed tensors), or None. `cache`: the lengths and positions of a CACHE launch
    (CacheRows; k, v are the cache as [B, HKV, capacity, D] or its pages as [P, HKV, PAGE, D]), or None."""
    if score_mod is None and sm_scale < 0:
        # The no-mod path keeps raw q.k scores and folds the scale into exp2 / the row max, which is
        # only valid for a positive scale: route negative scales through the (exact) score_mod path.
        score_mod = _identity_score_mod
    B, Hq, M, D = q.shape
    _, Hkv, N, _ = k.shape
    if cache is not None:
        N = cache.capacity(k)
    Dv = v.shape[2] if fp8 is not None else v.shape[-1]
    if fp8 is not None:
        cfg = _fp8_site_config(q, k, v, out, fp8, config)
    else:
        cfg = config or get_config(D, q.dtype, value_head_dim=Dv)
        if config is None and _plain(score_mod, mask_mod, kv_num_blocks, packed or cache, sinks, D, Dv):
            cfg = long_dense_config(cfg, D, M, N)   # 192-row tiles for long plain launches (LONG_DENSE_TILE_FROM)
    # score tile -> log2 units (the kernel's qk_scale)
    score_mod, to_score = kernel_score_mod(score_mod, sm_scale, cfg.fold_sm_scale) \
        if score_mod is not None else (None, float(sm_scale))
    to_log2 = to_score * LOG2E
    exp2_emu = cfg.sfu_mod_exp2_emu and bool(sfu_ops_of(score_mod))
    bounds = out_range_of(score_mod) if score_mod is not None and not max_needed else None
    fixed_base = bounds and fixed_base_for(q.dtype, bounds[0] * to_log2, bounds[1] * to_log2)
    if fp8 is not None:   # P's e4m3 range needs the row max (a fixed base would flush rows far below it to 0)
        fixed_base = None
    if fixed_base is not None and config is None:   # the table's tiles for fixed-base launches
        cfg = get_config(D, q.dtype, fixed_base=True, value_head_dim=Dv)
    # `score + alpha(b, h)·kv + B(b, h, q)`: column / tile / row parts instead of per-score index math;
    # the launched form's tile is qk·qk_unit + x (folded: qk + x / sm_scale)
    # a wide mod's exp2 argument is the rounded score minus the rounded max (wide_scores.py); the affine
    # split's per-tile shift would be subtracted unrounded
    wide = wide_scores(score_mod, compiled=True)
    kv_affine = score_mod is not None and kv_affine_of(score_mod) and not fixed_base and not wide
    if fp8 is not None and fp8.recipe.two_level:
        # its [BLOCK_N] column vector next to the fresh PV accumulator spills (D=128: 209 spill instructions);
        # the mod is evaluated per score instead
        kv_affine = False
    qk_unit = 1.0 if score_mod is not None and mod_info(score_mod).sm_scaled else float(sm_scale)
    BLOCK_M, BLOCK_N = cfg.block_m, cfg.block_n
    consumers = 3 if BLOCK_M == 192 else 2   # 64 rows a consumer warpgroup (192: FA3's D64 tile)
    HALF_M = BLOCK_M // consumers
    # a head dim that is a power of two is one tile per operand; any other (80, 96, 160, 192) is two
    # tiles per operand of exactly D columns, LO + HI, each a power of two (Q and K by D, V and O by Dv,
    # which may differ)
    qk_lo, qk_hi = split_head_dim(D)
    v_lo, v_hi = split_head_dim(Dv)
    tile = TileShape(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, QK_LO=qk_lo, QK_HI=qk_hi, V_LO=v_lo, V_HI=v_hi,
                     NUM_STAGES=cfg.num_stages, V_STAGES=cfg.v_ring_stages, CONSUMERS=consumers)
    # a paged cache's boxes are a page's rows where a page is shorter than a KV tile (_load_page_tiles)
    box = cache.page_box(BLOCK_N) if cache is not None and cache.block_table is not None else BLOCK_N
    q_desc = _desc(q, [1, 1, HALF_M, qk_lo])
    o_desc = _desc(out, [1, 1, HALF_M, v_lo])
    k_desc = _desc(k, [1, 1, box, qk_lo])
    v_desc = _desc(v, [1, 1, v_lo, BLOCK_N] if fp8 is not None else [1, 1, box, v_lo])   # FP8: VT
    q_desc_hi = k_desc_hi = v_desc_hi = o_desc_hi = None
    if tile.SPLIT_QK:
        q_desc_hi, k_desc_hi = _desc(q, [1, 1, HALF_M, qk_hi]), _desc(k, [1, 1, box, qk_hi])
    if tile.SPLIT_V:
        v_desc_hi, o_desc_hi = _desc(v, [1, 1, box, v_hi]), _desc(out, [1, 1, HALF_M, v_hi])
    hi_descs = (q_desc_hi, k_desc_hi, v_desc_hi, o_desc_hi)

    has_sparse = kv_num_blocks is not None
    has_full = has_sparse and full_kv_num_blocks is not None
    if has_sparse:
        if sparse_q_block % BLOCK_M or sparse_kv_block % BLOCK_N:
            raise ValueError(f"sparse blocks ({sparse_q_block}, {sparse_kv_block}) must be multiples of "
                             f"({BLOCK_M}, {BLOCK_N})")
        Bm, Hm = kv_num_blocks.shape[0], kv_num_blocks.shape[1]
        assert kv_num_blocks.dtype == torch.int32 and kv_indices.dtype == torch.int32
        assert kv_num_blocks.stride(-1) == 1 and kv_indices.stride(-1) == 1
        nb = kv_num_blocks
        idx = kv_indices
        if has_full:
            assert full_kv_num_blocks.dtype == torch.int32 and full_kv_indices.dtype == torch.int32
            assert full_kv_num_blocks.stride(-1) == 1 and full_kv_indices.stride(-1) == 1
            fnb, fidx = full_kv_num_blocks, full_kv_indices
        else:
            fnb, fidx = nb, idx
        sp_ptrs = (nb, idx, fnb, fidx)
        sp_meta = (Bm, Hm, nb.stride(0), nb.stride(1), idx.stride(0), idx.stride(1), idx.stride(2),
                   fnb.stride(0), fnb.stride(1), fidx.stride(0), fidx.stride(1), fidx.stride(2))
    else:
        sp_ptrs = (lse, lse, lse, lse)   # unused placeholders
        sp_meta = (1,) * 12
    rows = packed or cache
    window = rows is not None and rows.window > 0
    causal_walk = rows is not None and (rows.causal or window)
    sparse = BlockSparsity(HAS_SPARSE=has_sparse, HAS_FULL=has_full,
                           SPARSE_Q_DIV=(sparse_q_block // BLOCK_M) if has_sparse else 1,
                           SPARSE_KV_MULT=(sparse_kv_block // BLOCK_N) if has_sparse else 1, CAUSAL_WALK=causal_walk,
                           WINDOW=window)
    flags = ModFlags(HAS_SCORE_MOD=score_mod is not None, HAS_MASK_MOD=mask_mod is not None,
                     DENSE_MASK=mask_mod is not None and not has_sparse and not causal_walk,
                     MASK_AND=mask_mod is not None and mask_and_of(mask_mod),
                     # packed or a cache: N is per sequence, so any KV tile may cross it
                     EVEN_N=N % BLOCK_N == 0 and packed is None and cache is None, KV_AFFINE=bool(kv_affine),
                     FIXED_BASE=fixed_base is not None, EXP2_EMU=bool(exp2_emu), HAS_SINKS=sinks is not None,
                     WIDE_SCORES=wide)

    if cache is not None:
        num_m_tiles = triton.cdiv(M, BLOCK_M)
        num_tiles = B * Hq * num_m_tiles
        pack, pack_args = cache.packing(box), cache.args(M)
    elif packed is None:
        num_m_tiles = triton.cdiv(M, BLOCK_M)
        num_tiles = B * Hq * num_m_tiles
        pack, pack_args = DENSE, ()
    else:   # each head's virtual query tiles (the table's)
        if BLOCK_M != PACKED_BLOCK_M:
            raise ValueError(f"packed launch: the tile table has tiles of {PACKED_BLOCK_M} rows, the config "
                             f"{BLOCK_M}; pass a config of {PACKED_BLOCK_M}-row tiles")
        num_m_tiles = packed.tile_table.shape[0]
        num_tiles = Hq * num_m_tiles
        pack = Packing(VARLEN=True)
        pack_args = (packed.cu_seqlens_q, packed.cu_seqlens_k, out, out.stride(2), out.stride(1), packed.window,
                     packed.tile_table)
    max_kv_tiles = None
    if has_sparse and cfg.persistent is None:
        longest = _longest_row(kv_num_blocks, full_kv_num_blocks if has_full else None)
        if longest is not None:
            max_kv_tiles = longest * (sparse_kv_block // BLOCK_N)
    persistent = (use_persistent(cfg, num_tiles, num_sms, N, max_kv_tiles, kv_affine) and packed is None
                  and cache is None)
    # persistent: a separate O staging buffer where shared memory allows it (split tiles stage O in Q's).
    # FP8: always (an e4m3 Q tile has half the bytes of a 16-bit O tile; _fp8_site_config checked the room)
    o_stage = (not tile.SPLIT_QK and not tile.SPLIT_V
               and cfg.smem_bytes(D, o_stage=True, value_head_dim=Dv) <= SMEM_LIMIT)
    schedules = {p: Schedule(PERSISTENT=p, O_STAGE=(p and o_stage) or fp8 is not None, OVERLAP=cfg.overlap,
                             CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs)
                 for p in (False, True)}
    if fp8 is None:
        quant, quant_bufs = NO_QUANT, ()
    else:
        # mods that read captured buffers (a document mask's ids) spill inside the KV loop with the lean softmax
        # (D=128: over the 8 LDL / STL the previous one reloads there): they keep the previous one
        lean = cfg.lean_fp8_softmax and not score_bufs and not mask_bufs
        # registers run out under mods where two-level accumulation holds a fresh PV accumulator or a mask gathers ids
        tight = (cfg.fp8_tight_mods and (score_mod is not None or mask_mod is not None)
                 and (fp8.recipe.two_level > 0 or bool(mask_bufs)))
        quant = Quant(ON=True, Q_BLOCK=fp8.recipe.block_m, KV_BLOCK=fp8.recipe.block_n,
                      TWO_LEVEL=fp8.recipe.two_level > 0, QK_INT8=q.dtype == torch.int8, LEAN=lean,
                      TIGHT=tight)
        quant_bufs = (fp8.q_scale, fp8.k_scale, fp8.v_scale, fp8.v_scale_max)
    sink_bufs = kernel_sink_bufs(sinks, q, fp8, "sm90 forward")
    args = (q_desc, k_desc, v_desc, o_desc, *hi_descs, lse, max_scores, tuple(score_bufs), tuple(mask_bufs),
            quant_bufs, sink_bufs, pack_args, *sp_ptrs, *sp_meta, float(sm_scale), to_log2, float(fixed_base or 0.0),
            qk_unit, num_tiles, num_m_tiles, Hq, Hq // Hkv, M, N)
    return _Site(args, score_mod, mask_mod, tile, sparse, flags, quant, cfg, schedules, num_tiles, num_sms, persistent,
                 pack)


def rows_launch(q, k, v, out, lse, max_scores, *, sm_scale: float, score_mod=None, mask_mod=None,
                score_bufs=(), mask_bufs=(), config=None, packed=None, cache=None) -> tuple:
    """(kernel, args, kwargs, grid) of a launch whose rows are packed sequences (``packed``: PackedRows) or a decode
    cache's (``cache``: CacheRows): one CTA a tile, no block mask, MAX not asked for (a bounded score_mod may run
    against a fixed exponent base). varlen_sm90.py and cache_sm90.py prepare their launches through it.

    Example::

        >>> kernel, args, kwargs, grid = rows_launch(q4, k4, v4, out4, lse4, max4, sm_scale=0.088,
        ...                                          packed=rows)   # doctest: +SKIP
    """
    site = _site(q, k, v, out, lse, max_scores, sm_scale, score_mod, mask_mod, tuple(score_bufs), tuple(mask_bufs),
                 None, None, None, None, 128, 128, config, 0, max_needed=False, packed=packed, cache=cache)
    return (fa3_fwd_sm90_kernel, *site.launch())


@dataclass(frozen=True)
class PackedRows:
    """The sequences of a VARLEN launch (module docstring, "Packed sequences"), as _site takes them."""
    cu_seqlens_q: torch.Tensor   # int32 [B + 1]: sequence b holds query rows cu_seqlens_q[b]:cu_seqlens_q[b + 1]
    cu_seqlens_k: torch.Tensor   # likewise its keys
    causal: bool                 # the mask_mod is q_idx >= kv_idx: KV walks end at the diagonal (CAUSAL_WALK)
    tile_table: torch.Tensor     # int32: the sequence of each virtual query tile of PACKED_BLOCK_M rows
                                 # (hopper/tile_table.py, written by an earlier launch): the grid, per head
    window: int = 0              # > 0: the mask_mod is a causal window of this many keys (SPARSE.WINDOW)


@dataclass(frozen=True)
class CacheRows:
    """The decode cache of a CACHE launch (module docstring, "Decode caches"), as _site takes it."""
    seq_lens: torch.Tensor                # int32 [B]: sequence b's keys (clamped to [0, capacity] on the device)
    first: torch.Tensor                   # int32 [B]: query row m of sequence b sits at first[b] + m, or with
    first_from_lens: bool                 # this, first is seq_lens and row m sits at seq_lens[b] - M + m
    block_table: Optional[torch.Tensor]   # int32 [B, max_pages] (k, v as [P, HKV, PAGE, D]), or None ([B, HKV, N, D])
    page: int                             # keys a page (0 without a table)
    causal: bool                          # the mask_mod is q_idx >= kv_idx on these positions (CAUSAL_WALK)
    window: int = 0                       # > 0: the mask_mod is a causal window of this many keys (SPARSE.WINDOW)

    def capacity(self, k: torch.Tensor) -> int:
        """Keys a sequence can hold: max_pages x PAGE, or the contiguous cache's N."""
        return self.block_table.shape[1] * self.page if self.page else k.shape[2]

    def page_box(self, block_n: int) -> int:
        """Rows of a TMA box of a page: BLOCK_N where pages hold whole tiles, else the page (a tile is several)."""
        if self.page % block_n == 0:
            return block_n
        if block_n % self.page == 0 and self.page >= 8:
            return self.page
        raise ValueError(f"sm90 forward: pages of {self.page} keys neither hold whole {block_n}-key tiles nor "
                         f"divide one into boxes of 8 keys or more; use pages of 16, 32, 64 or a multiple of 128")

    def packing(self, box: int) -> Packing:
        return Packing(VARLEN=False, CACHE=True, PAGE=self.page, PAGE_BOX=box if self.page else 0)

    def args(self, M: int) -> tuple:
        """The kernel's pack_args: LENS, FIRST, FIRST_DELTA, WINDOW, and with pages TABLE, its row stride,
        max_pages."""
        delta = -M if self.first_from_lens else 0
        if self.block_table is None:
            return self.seq_lens, self.first, delta, self.window
        table = self.block_table
        return self.seq_lens, self.first, delta, self.window, table, table.stride(0), table.shape[1]


def _fp8_site_config(q, k, vt, out, fp8, config) -> Sm90Config:
    """The tiles of an FP8 launch (templates/hopper_fp8/configs.py unless `config` is given), after checking the
    operands against what the kernel reads: the prologue's layout (fp8_recipe.FP8Operands), 16-bit O, head dims
    the FP8 table has, KV tiles inside one K / V scale block. Raises ValueError saying what does not fit."""
    from ..hopper_fp8.configs import fp8_smem_bytes, get_fp8_config

    B, Hq, M, D = q.shape
    Dv = vt.shape[2]
    e4m3 = torch.float8_e4m3fn
    qk_dtype = torch.int8 if getattr(fp8.recipe, "qk", "e4m3") == "int8" else e4m3
    if q.dtype != qk_dtype or k.dtype != qk_dtype or vt.dtype != e4m3:
        raise ValueError(f"sm90 FP8 forward: q, k must be {qk_dtype} (FP8Recipe.qk) and vt float8_e4m3fn (the FP8 "
                         f"prologue's output), got {q.dtype}, {k.dtype}, {vt.dtype}")
    if out.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"sm90 FP8 forward: out must be bfloat16 or float16, got {out.dtype}")
    if tuple(vt.shape[:2]) != tuple(k.shape[:2]) or vt.shape[3] < k.shape[2] or vt.shape[3] % 16:
        raise ValueError(f"sm90 FP8 forward: vt must be [B, Hkv, Dv, N_pad] with N_pad >= N = {k.shape[2]} a multiple "
                         f"of 16 (the prologue's V transposed), got {tuple(vt.shape)} for k {tuple(k.shape)}")
    cfg = config or get_fp8_config(D, Dv)
    recipe = fp8.recipe
    if recipe.block_n and recipe.block_n % cfg.block_n:
        raise ValueError(f"sm90 FP8 forward: K / V scale blocks of {recipe.block_n} keys are smaller than its "
                         f"{cfg.block_n}-key tiles; use FP8Recipe(block_n={cfg.block_n}) or larger (or 0: per head)")
    for name, t in (("q_scale", fp8.q_scale), ("k_scale", fp8.k_scale), ("v_scale", fp8.v_scale),
                    ("v_scale_max", fp8.v_scale_max)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"sm90 FP8 forward: {name} must be contiguous float32, got {t.dtype} strides {t.stride()}")
    if fp8_smem_bytes(cfg, D, Dv) > SMEM_LIMIT:
        raise ValueError(f"sm90 FP8 forward: tiles {cfg} need {fp8_smem_bytes(cfg, D, Dv)} bytes of shared memory "
                         f"(limit {SMEM_LIMIT})")
    return cfg


@gluon.jit
def _identity_score_mod(qk, sm_scale, b, h, q_idx, kv_idx, bufs):
    return qk * sm_scale


def launch_fwd_sm90(q, k, v, out, lse, max_scores, *, sm_scale: float,
                    score_mod=None, mask_mod=None, score_bufs: tuple = (), mask_bufs: tuple = (),
                    kv_num_blocks=None, kv_indices=None, full_kv_num_blocks=None, full_kv_indices=None,
                    sparse_q_block: int = 128, sparse_kv_block: int = 128, config=None,
                    max_needed: bool = True, sinks=None) -> None:
    """Run the sm90 forward kernel, writing out ([B, Hq, M, Dv]: q's shape with v's head dim), lse and
    max_scores (fp32 [B, Hq, M], contiguous, log2 units) in place. See the module docstring for the conventions. With
    max_needed=False a bounded score_mod may skip the row max: max_scores is then NaN (-inf for rows
    with no key). `sinks`: a [Hq] tensor of attention sinks (module docstring, SINKS), or None."""
    B, Hq, M, D = q.shape
    assert out.shape == (B, Hq, M, v.shape[-1]) and out.dtype == q.dtype
    assert lse.shape == (B, Hq, M) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert max_scores.shape == (B, Hq, M) and max_scores.dtype == torch.float32 and max_scores.is_contiguous()
    kernel, args, kwargs, grid = prepare_fwd_sm90(
        q, k, v, out, lse, max_scores, sm_scale=sm_scale, score_mod=score_mod, mask_mod=mask_mod,
        score_bufs=score_bufs, mask_bufs=mask_bufs, kv_num_blocks=kv_num_blocks, kv_indices=kv_indices,
        full_kv_num_blocks=full_kv_num_blocks, full_kv_indices=full_kv_indices,
        sparse_q_block=sparse_q_block, sparse_kv_block=sparse_kv_block, config=config,
        max_needed=max_needed, sinks=sinks)
    kernel[grid](*args, **kwargs)


def prepare_fwd_sm90(q, k, v, out, lse, max_scores, *, sm_scale: float,
                     score_mod=None, mask_mod=None, score_bufs: tuple = (), mask_bufs: tuple = (),
                     kv_num_blocks=None, kv_indices=None, full_kv_num_blocks=None, full_kv_indices=None,
                     sparse_q_block: int = 128, sparse_kv_block: int = 128, config=None,
                     max_needed: bool = True, sinks=None):
    """(kernel, args, kwargs, grid) of the launch launch_fwd_sm90 makes, for callers that cache launches
    (runtime/fast_launch.py). Same arguments as launch_fwd_sm90."""
    cfg = config or get_config(q.shape[-1], q.dtype, value_head_dim=v.shape[-1])
    num_sms = _num_sms(q.device) if cfg.persistent is not False else 0
    args, kwargs, grid = _prepare(q, k, v, out, lse, max_scores, sm_scale, score_mod, mask_mod, score_bufs,
                                  mask_bufs, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                                  sparse_q_block, sparse_kv_block, config, num_sms, max_needed, sinks=sinks)
    return fa3_fwd_sm90_kernel, args, kwargs, grid


def prepare_fwd_sm90_variants(q, k, v, out, lse, max_scores, **options):
    """(launch, siblings): prepare_fwd_sm90's launch and the same site's launches under the choices other lengths
    make (EVEN_N, and the persistent schedule where the config leaves it to use_persistent), each as
    (kernel, args, kwargs, grid). Every other launch argument is length-independent in Triton's specialization key
    (module docstring, "Specialization"), so a site compiled in these (at most four) variants compiles no more.
    With `fp8=` (the FP8 prologue's FP8Operands) q, k, v are its q, k and vt, and the tiles come from
    templates/hopper_fp8/configs.py; a ValueError says what of the operands the kernel cannot take.

    Example::

        >>> launch, siblings = prepare_fwd_sm90_variants(q, k, v, out, lse, mx, sm_scale=0.088)   # doctest: +SKIP
        >>> sorted((s[2]["SCHED"].PERSISTENT, s[2]["FLAGS"].EVEN_N) for s in siblings)            # doctest: +SKIP
        [(False, True), (True, False), (True, True)]
    """
    if options.get("fp8") is not None:
        from ..hopper_fp8.configs import get_fp8_config
        cfg = options.get("config") or get_fp8_config(q.shape[-1], v.shape[2])
    else:
        cfg = options.get("config") or get_config(q.shape[-1], q.dtype, value_head_dim=v.shape[-1])
    if cfg.persistent is False:
        num_sms = 0
    else:   # CPU tensors (planning, tests): an H100's SM count
        num_sms = _num_sms(q.device) if q.is_cuda else _PLANNING_SMS
    site = _site_of_options(q, k, v, out, lse, max_scores, options, num_sms)   # the bundles, built once
    launch = (fa3_fwd_sm90_kernel, *site.launch())
    # a plain site of a head dim with a 192-row tile for long lengths (configs.LONG_DENSE_TILE_FROM): the other
    # tile's site too, the long one in the grid schedule only (its KV lengths never take the persistent one)
    any_schedule = (True, False) if cfg.persistent is None else (cfg.persistent,)
    long_cfg = long_dense_config(cfg, q.shape[-1], float("inf"), float("inf"))
    is_long = options.get("config") is None and long_cfg is not cfg and site.cfg.block_m == long_cfg.block_m
    sites = [(site, (False,) if is_long else any_schedule)]
    if options.get("config") is None and options.get("fp8") is None and long_cfg is not cfg and _plain(
            options.get("score_mod"), options.get("mask_mod"), options.get("kv_num_blocks"), None,
            options.get("sinks"), q.shape[-1], v.shape[-1]):
        other = _site_of_options(q, k, v, out, lse, max_scores, dict(options, config=cfg if is_long else long_cfg),
                                 num_sms)
        sites.append((other, any_schedule if is_long else (False,)))
    siblings, seen = [], [launch[2]]
    for sib_site, schedules in sites:
        for persistent in schedules:
            for even_n in (True, False):
                sib = (fa3_fwd_sm90_kernel, *sib_site.launch(persistent, even_n))
                if sib[2] not in seen:
                    seen.append(sib[2])
                    siblings.append(sib)
    return launch, siblings


_PLANNING_SMS = 132


def _site_of_options(q, k, v, out, lse, max_scores, options, num_sms) -> _Site:
    o = dict(options)
    site = _site(
        q, k, v, out, lse, max_scores, o.pop("sm_scale"), o.pop("score_mod", None), o.pop("mask_mod", None),
        o.pop("score_bufs", ()), o.pop("mask_bufs", ()), o.pop("kv_num_blocks", None), o.pop("kv_indices", None),
        o.pop("full_kv_num_blocks", None), o.pop("full_kv_indices", None), o.pop("sparse_q_block", 128),
        o.pop("sparse_kv_block", 128), o.pop("config", None), num_sms, o.pop("max_needed", True), o.pop("fp8", None),
        o.pop("sinks", None))
    if o:
        raise TypeError(f"prepare_fwd_sm90_variants: unexpected options {sorted(o)}")
    return site


def compile_sm90(q, k, v, out, lse, max_scores, *, sm_scale: float, score_mod=None, mask_mod=None,
                 score_bufs: tuple = (), mask_bufs: tuple = (), kv_num_blocks=None, kv_indices=None,
                 full_kv_num_blocks=None, full_kv_indices=None, sparse_q_block: int = 128,
                 sparse_kv_block: int = 128, config=None, target=None, max_needed: bool = True, persistent=None,
                 fp8=None, sinks=None):
    """Compile (not run) exactly what launch_fwd_sm90 would launch, for `target` (default sm90).

    Works on a CPU-only machine with CPU tensors: the arguments are specialised the same way the
    JIT specialises them, then handed to triton.compile. Returns the CompiledKernel (asm['ptx'],
    asm['cubin'], ...). `persistent` overrides the schedule; `fp8` the FP8 prologue's operands (q, k, v
    are then its q, k, vt: prepare_fwd_sm90_variants); `sinks` a [Hq] tensor of attention sinks."""
    from ..aot import compile_launch

    args, kwargs, _ = _prepare(q, k, v, out, lse, max_scores, sm_scale, score_mod, mask_mod, score_bufs,
                               mask_bufs, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                               sparse_q_block, sparse_kv_block, config, 132, max_needed, persistent, fp8=fp8,
                               sinks=sinks)
    return compile_launch(fa3_fwd_sm90_kernel, args, kwargs, target)
