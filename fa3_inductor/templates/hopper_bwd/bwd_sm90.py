"""FlashAttention-3-structure attention backward for Hopper (sm90): Gluon main kernel, Triton pre/post passes.

Notation
--------
  Q, dQ   [Z, HQ, M, D]      queries and their gradient (z = batch, hq = query head, m = query position)
  K, dK   [KZ, HKV, N, D]    keys; hkv = hq // GQA_GROUP; KZ is Z or 1 (a K/V batch of 1 serves every z)
  V, dV   [KZ, HKV, N, DV]   values (DV = D = 64 or 128 here, or 80 / 96 in 128-column tiles whose columns past D
                             TMA fills with zeros, HEAD_D_IN; D = 256 and 192 / 128: bwd_sm90_wide.py)
  O, dO   [Z, HQ, M, DV]     the forward's output and its incoming gradient
  LSE     [Z, HQ, M] fp32    the forward's logsumexp in log2 units (-inf on fully masked rows)
  STATS   [Z * HQ, 2, M_PAD] fp32   what the main kernel reads (preprocess kernel): LSE_P = LSE with +inf on
                             rows past M and on fully masked rows (so that P = 0 there without a mask), then
                             DELTA_P = rowsum(dO * O) - dLSE * log2(e) (0 past M); padded: no load is masked
  DQ_ACC  [Z * HQ, M_PAD, D] fp32   dQ accumulated in score units; M_PAD = M rounded up to the block-mask query
                             block (BLOCK_M without a mask), so every visited tile lies inside it. Zeroed by the
                             preprocess kernel, added into by every KV tile's CTA (atomics), scaled and converted
                             to dQ's dtype by the convert kernel
  BLOCK_N = 128              keys of one CTA: consumer warpgroup w owns keys [64w, 64w + 64) (HALF_N = 64)
  BLOCK_M = 64               query rows of one step (one 64-row wgmma per warpgroup)

The math, per (KV tile, query tile), in the forward's orientation (rows = queries, columns = keys):

  S   = Q K^T (score units: raw q.k without a mod, the mod's tile with one)   masked where mask_mod says so
  P   = exp2(min(S * qk_scale2 - LSE[row], 0))     (+inf LSE on rows past M and fully masked rows: P = 0)
  dV += P^T dO                  dP = dO V^T
  dS  = P * (dP - DELTA[row]) * f'(S)              (f' = SCORE_GRAD's tile; 1 without a score_mod)
  dK += dS^T Q                  dQ += dS K         (the scale and f's factor, ds_scale, applied once at the end)

Kernel roles (one CTA per (KV tile, kz * HKV + hkv); 3 warpgroups):
  * producer  (1 warp, padded to a warpgroup, PRODUCER_REGS): TMA-loads K and V once, then walks the query
              steps (every z of this K/V batch, every query head of the GQA group, every query tile the
              transposed block mask lists) and loads Q and dO tiles into a ring of NUM_STAGES stages.
  * consumers (2 x 4 warps, CONSUMER_REGS): warpgroup w computes S, P, dP, dS for its 64 keys with wgmma;
              dK, dV accumulate in registers across all steps (GQA and a broadcast K/V batch are sums in
              registers: one store per output tile). P and dS go through shared memory (the A operands of the
              dV / dK wgmmas, transposed views; dS also for dQ). Once both dS halves are there, dQ = dS K over
              all 128 keys is added into DQ_ACC: DQ_SPLIT (D >= 128), each warpgroup D / 2 head-dim columns
              every step; else one warpgroup the whole tile, the two in turn. How it is added and the order of
              the wgmmas are the SCHED bundle (below; defaults: red.v2 atomics, S / P / dP / dV / dS / dK / dQ
              in turn).

Barriers (shared memory):
  kv_ready        (count 1, TMA tx)  K and V landed                                 producer -> consumers
  qdo_ready[s]    (count 1, TMA tx)  ring stage s holds this step's Q and dO        producer -> consumers
  qdo_empty[s]    (count 2)          both warpgroups' wgmmas reading stage s retired consumers -> producer
  ds_ready[b]     (count 2)          both halves of dS are in buffer b (b = step % 2) consumer <-> consumer
  kv_empty[b], kv_full[b]            PERSISTENT, per K / V buffer: both warpgroups are done with its K, V (count 2,
                                     consumers -> producer); its K, V landed (count 1, TMA tx; kv_ready unused)
  (DQ_TMA: no barrier; each warpgroup's dQ staging tile is reused after tma.store_wait(0))
  Two dS buffers suffice: a warpgroup writes buffer b at step j + 2 only after its own step-j dQ wgmma, and
  after waiting on ds_ready of step j + 1 (DQ_SPLIT: always; in turn: it is the reader of step j + 1 when the
  other warpgroup read step j), which the other warpgroup signals only after its step-j dQ wgmma retired.

Deterministic dQ (SCHED.DETERMINISTIC, option fa3.deterministic_backward; cta_args = (DQ_SEMS, DQ_RANK, GROUP)):
  DQ_SEMS [1 + Z * HQ * M_PAD / 64 * 4] int32   one counter per (head, 64-row step, 64 dQ columns; here the column
                             halves use two): 4 (warps) times
                             how many CTAs have added their dQ there (zeroed by the preprocess kernel; slot 0 is a sink,
                             never waited on)
  DQ_RANK [SZ, SH, NUM_Q_BLKS, NUM_KV_BLKS] int32   with a block mask: how many KV blocks before this one list the
                             query block (two launches before the main kernel, from the transposed tables it walks);
                             without one every CTA adds, rank = KV tile
  The adds into a dQ tile are made in ascending KV-tile order: a warpgroup waits (ld.acquire) until its counter reaches
  its CTA's rank, issues the reduce-add, and releases the counter once that add has completed in global memory, which
  it checks at D64 on its next add, at D >= 128 on every second add (two released by one fence), or after its last:
  the fp32 sums are then the same bits on every run. CTAs are launched
  KV-tile major within groups of GROUP (kz, hkv) heads (the group's tile 0 of each head, then tile 1, ...; then the next
  group), so a CTA only waits on CTAs launched before it: no deadlock whatever the occupancy. Wide groups keep few CTAs
  of a head in a wave (short chains of waiters), narrow ones keep the wave's Q, dO and DQ_ACC lines in L2.

Block mask (torch BlockMask, transposed tables: for each KV block, the query blocks that see it):
  Q_NUM_BLKS[SZ, SH, NUM_KV_BLKS], Q_IDX[.., NUM_Q_BLKS]       partial query blocks (mask_mod applied)
  FULL_Q_NUM_BLKS / FULL_Q_IDX                                all-true query blocks (mask_mod skipped)
  SPARSE_Q % BLOCK_M == 0 and SPARSE_KV % BLOCK_N == 0; unlisted blocks are dropped (the forward's semantics).

Packed sequences (PACK.VARLEN; host hopper_bwd/varlen.py, front door flex_varlen's gradients):
  Q, K, V, O, dO, dQ  [1, H, total, D] views of packed (total, H, D) tensors; dK, dV packed (total_k, HKV, D)
  CU_Q, CU_K [B + 1]  pack_args[:2]: sequence b holds query rows CU_Q[b] : CU_Q[b + 1] and keys CU_K[b] : CU_K[b + 1]
  TILES [T]         pack_args[2]: the sequence of each virtual KV tile (hopper/tile_table.py); sequence b's tiles
                    are virtual tiles CU_K[b] // BLOCK_N + b onwards, T = total_k // BLOCK_N + B + 1
  grid              (T, HKV): kz of a CTA is its sequence (the mods' b); a virtual tile past its sequence's last
                    (at most one a sequence) has no step. Query steps are the sequence's own BLOCK_M-row tiles
                    (rows relative to CU_Q[b]): all (no mask_mod), all with the mask (SPARSE.DENSE_MASK), from the
                    KV tile's diagonal (SPARSE.CAUSAL_WALK), or from its diagonal to the last row whose causal window
                    of WINDOW keys (pack_args[3]) reaches the tile (SPARSE.WINDOW_WALK). Rows past the sequence read
                    LSE_P +inf (P = 0: _lse_rows); K rows past it are zeroed in shared memory once landed
                    (_kv_landed), the dense ragged tail's TMA zero fill; STATS and DQ_ACC are [H, ..] over the packed
                    rows plus a tile.

Mods (templates/modgen.py, ``gl`` dialect, called as the forward calls them):
  SCORE_MOD(qk, sm_scale, b, h, q_idx, kv_idx, bufs) -> the score / OUT_SCALE
  SCORE_GRAD(qk, sm_scale, b, h, q_idx, kv_idx, bufs) -> f'(score) / GRAD_SCALE (generic_bwd/score_grad.py's
                                                        graph in the gl dialect: host.score_grad_gl)
  MASK_MOD(b, h, q_idx, kv_idx, bufs) -> bool
  q_idx is a [BLOCK_M, 1] column and kv_idx a [1, HALF_N] row, clamped into [0, M) / [0, N), so a mod
  gathering by position never reads past its buffer.

Compile-time parameters (one frozen-dataclass bundle each, read as TILE.BLOCK_M):
  TILE    BwdTile       HEAD_D, NUM_STAGES (BLOCK_M, BLOCK_N, HALF_N, DQ_SPLIT, DQ_N, VIEWS_PER_STEP derived)
  SPARSE  BwdSparsity   HAS_BLOCK_MASK, HAS_FULL_BLOCKS, Q_TILES_PER_BLK, SPARSE_KV
  FLAGS   BwdFlags      GQA_GROUP, FOLD_SCALE, EVEN_N, CONSUMER_REGS, PRODUCER_REGS, WIDE_SCORES
  SCHED   BwdSchedule   DQ_TMA, OVERLAP, LPT_ORDER, PERSISTENT (configs.BwdSm90Config.dq_tma / overlap / lpt_order /
                        persistent; the last two: which tiles a CTA runs, under a block mask, cta_args)
  PACK    BwdPacking    VARLEN (packed sequences; DENSE leaves the dense launch's code untouched)
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl
from triton.experimental import gluon
from triton._C.libtriton import ir
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E = 1.4426950408889634
# Deterministic dQ: counters a 64-row step (one per 64 dQ columns: bwd_sm90_wide.py's chunks, up to D = 256)
DQ_SEM_SLOTS = 4
_SEM_SLOTS = gl.constexpr(DQ_SEM_SLOTS)


@dataclass(frozen=True)
class BwdTile:
    """Tile sizes of the main kernel. BLOCK_M and BLOCK_N are fixed by the structure: one 64-row wgmma per
    warpgroup and step, two consumer warpgroups of 64 key rows."""
    HEAD_D: int        # the tiles' head dim (= DV), a power of two
    NUM_STAGES: int    # depth of the Q / dO ring
    HEAD_D_IN: int = 0   # the tensors' head dim when it is less (80, 96 in 128-column tiles); 0: HEAD_D

    @property
    def D_MEM(self) -> int:
        """Columns of Q, K, V, dO, dK, dV and DQ_ACC in memory: where the stores stop and the rows' stride."""
        return self.HEAD_D_IN or self.HEAD_D

    @property
    def BLOCK_M(self) -> int:
        return 64

    @property
    def BLOCK_N(self) -> int:
        return 128

    @property
    def HALF_N(self) -> int:
        return 64

    @property
    def DQ_SPLIT(self) -> bool:
        """dQ's head-dim columns split between the warpgroups (D >= 128: halves of whole 64-column swizzle atoms,
        so the K column slice is a plain shared-memory view); at D = 64 each step's dQ goes to one
        warpgroup, the two in turn."""
        return self.HEAD_D >= 128

    @property
    def DQ_N(self) -> int:
        return self.HEAD_D // 2 if self.DQ_SPLIT else self.HEAD_D

    @property
    def VIEWS_PER_STEP(self) -> bool:
        """K, V and P's loop-invariant shared-memory views (the wgmma descriptors of S's, dP's and dQ's B and
        dV's A) are rebuilt every step (_consumer) at D >= 128, where dK and dV leave no registers to hold them.
        D = 64 is spill-free with them hoisted, and rebuilding them there costs 3-12 SASS instructions a step."""
        return self.HEAD_D >= 128


@dataclass(frozen=True)
class BwdSparsity:
    """The transposed block mask (module docstring, "Block mask")."""
    HAS_BLOCK_MASK: bool    # query tiles come from the tables (else every query tile, no mask_mod)
    HAS_FULL_BLOCKS: bool   # the FULL_Q_* tables are given
    Q_TILES_PER_BLK: int    # SPARSE_Q // BLOCK_M
    SPARSE_KV: int          # block-mask KV block (a multiple of BLOCK_N)
    CAUSAL_SKIP: bool = False  # bwd_sm90_wide (192 / 128 and D256): the mask_mod keeps q_idx >= kv_idx pairs only
                               # (modgen.mask_implies_causal), so a first listed query tile wholly above the CTA's
                               # keys is skipped (_causal_first)
    CAUSAL_WALK: bool = False  # no tables; the mask_mod is exactly q_idx >= kv_idx: a KV block's query tiles start
                               # at its diagonal, whose SPARSE_KV // BLOCK_M tiles are partial, the rest full (packed
                               # sequences)
    DENSE_MASK: bool = False   # no tables; mask_mod on every query tile (packed sequences with another mask_mod)
    WINDOW_WALK: bool = False  # no tables; the mask_mod is a causal window of WINDOW keys (q - WINDOW < kv <= q,
                               # table_meta[4]): a KV block's query tiles from its diagonal to the last row that sees
                               # its last key; the diagonal's and the window edge's tiles are partial, the ones between
                               # full (packed sequences: _q_tile_counts)


@dataclass(frozen=True)
class BwdPacking:
    """Packed variable-length sequences (module docstring, "Packed sequences")."""
    VARLEN: bool = False


DENSE = BwdPacking()


@dataclass(frozen=True)
class BwdFlags:
    """What the site's shapes and scale ask of the kernel, and the register split."""
    GQA_GROUP: int          # HQ // HKV
    FOLD_SCALE: bool        # no score_mod, sm_scale > 0: raw q.k, the scale folded into qk_scale2
    EVEN_N: bool            # N % BLOCK_N == 0: no KV tile crosses N (no exponent clamp, _probabilities)
    CONSUMER_REGS: int      # setmaxnreg of the consumer warpgroups
    PRODUCER_REGS: int      # setmaxnreg of the TMA producer
    WIDE_SCORES: bool = False   # the score_mod may return huge finite values: the exponent clamp at 0 is on,
                                # since the contracted FFMA can exceed 0 by half an ulp of LSE (wide_scores.py)
    GRAD_FINITE: bool = False   # SCORE_GRAD is finite wherever S is (modgen.ModInfo.finite): P = 0 zeroes dS
                                # without the select that keeps a non-finite f' out of masked scores


@dataclass(frozen=True)
class BwdSchedule:
    """How a step's wgmmas are ordered and how dQ leaves the CTA (docs/design/hopper_backward.md, "Gap")."""
    DQ_TMA: bool        # dQ staged in shared memory (fp32) and added by TMA reduce-add, not per-thread red.v2
    OVERLAP: int = 0    # configs.BwdSm90Config.overlap: 0 the in-order step (_consumer_tile); 1 / 2
                        # _consumer_overlap_tile (either under the LPT_ORDER / PERSISTENT schedules)
    LPT_ORDER: bool = False   # CTAs take their (KV tile, K/V head) from the host's order (cta_args[0]): longest
                              # first inside groups of heads (host._cta_order; docs/design/hopper_backward.md,
                              # "Masks against the tile bound")
    PERSISTENT: bool = False  # #SMs CTAs, each walking its list of (KV tile, K/V head) tiles (cta_args = (offsets,
                              # tiles), host._persistent_schedule); the next tile's K and V load once a K / V buffer
                              # is free (barriers kv_full / kv_empty)
    P_REGS: bool = False      # dS from P kept in fp32 registers, not read back from shared memory (the overlap:
                              # P carried from the step that made it)
    P_CARRY16: bool = False   # P_REGS in the overlap: the carried P (times f') in 16 bits (where fp32 spills)
    STATS_AHEAD: bool = True  # a step's LSE / DELTA rows loaded a step ahead (False: where used; D128 under masks)
    KV_BUFS: int = 1          # PERSISTENT: K / V buffers (2 where shared memory allows, D = 64: the next tile's K, V
                              # load under this tile's last steps; 1: under its dK / dV stores)
    DQ_FRAG: bool = False     # DQ_TMA: dQ staged and added in the wgmma fragments' order (bwd_sm90_wide.py's
                              # WideTile.DQ_FRAG: DQ_ACC's 64 x 64 blocks permuted, 16-byte conflict-free stores)
    DKDV_TMA: bool = False    # DQ_TMA, dense, D_MEM = HEAD_D: dK then dV written through the warpgroup's 16 KB dQ
                              # staging tile and TMA-stored (else gl.store from the accumulators, 4-byte pairs)
    DETERMINISTIC: bool = False   # dQ added in ascending KV-tile order (module docstring, "Deterministic dQ"):
                                  # DQ_TMA, dense, neither LPT_ORDER nor PERSISTENT (the host sees to it)


@gluon.jit
def _ordered_coords(group):
    """(KV tile, kz * HKV + hkv) of this CTA in the deterministic dQ's launch order: KV tile major within groups of
    ``group`` (kz, hkv) heads, the grid (#KV tiles, KZ * HKV) read in launch order (program_id(0) fastest). A CTA waits
    only on CTAs launched before it (module docstring, "Deterministic dQ"); bwd_sm90_wide.py's grid too."""
    n_kv_tiles = gl.num_programs(0)
    launched = gl.program_id(1) * n_kv_tiles + gl.program_id(0)
    per_group = group * n_kv_tiles
    first = (launched // per_group) * group                     # the group's first head
    width = gl.minimum(group, gl.num_programs(1) - first)       # (the last group may be narrower)
    within = launched % per_group
    return within // width, first + within % width


@gluon.jit
def _cta_coords(cta_args, SCHED: gl.constexpr):
    """(KV tile, kz * HKV + hkv) of this CTA: the grid's coordinates, or with SCHED.LPT_ORDER the entry of the host's
    order (kvh * #KV tiles + KV tile, int32) at the CTA's launch index (the hardware hands CTAs out in launch order,
    program_id(0) fastest); with SCHED.DETERMINISTIC the launch index itself, KV tile major within groups of
    cta_args[2] (kz, hkv) heads (module docstring, "Deterministic dQ")."""
    if SCHED.DETERMINISTIC:
        kv_tile, kvh = _ordered_coords(cta_args[2])
    elif SCHED.LPT_ORDER:
        n_kv_tiles = gl.num_programs(0)
        idx = gl.load(cta_args[0] + gl.program_id(1) * n_kv_tiles + gl.program_id(0))
        kv_tile = idx % n_kv_tiles
        kvh = idx // n_kv_tiles
    else:
        kv_tile = gl.program_id(0)
        kvh = gl.program_id(1)
    return kv_tile, kvh


@gluon.jit
def _cta_tiles(cta):
    """SCHED.PERSISTENT: (index of this CTA's first tile in the host's tile list, its number of tiles)."""
    offsets = cta[0][0]
    pid = gl.program_id(0)
    first = gl.load(offsets + pid)
    return first, gl.load(offsets + pid + 1) - first


@gluon.jit
def _persistent_tile(cta, j, N, TILE: gl.constexpr):
    """SCHED.PERSISTENT: (KV tile, kz * HKV + hkv) of entry j of the host's tile list (kvh * #KV tiles + KV tile)."""
    n_kv_tiles = gl.cdiv(N, TILE.BLOCK_N)
    idx = gl.load(cta[0][1] + j)
    return idx % n_kv_tiles, idx // n_kv_tiles


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """cp.reduce.async.bulk.tensor (add) of the shared tile ``src`` into ``tensor_desc`` at ``coord``: the
    builder op exists in triton 3.6, the Gluon wrapper does not. Completes like a TMA store (tma.store_wait)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


# ----------------------------------------------------------------------------------------------
# The query steps of one CTA: producer and consumers walk the same sequence (or the ring's phases
# fall out of step): z of this K/V batch, then the GQA group's heads, then the listed query tiles.
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _q_tile_counts(z, hq, kv_blk, M, tables, table_meta, TILE: gl.constexpr, SPARSE: gl.constexpr):
    """(partial, total) query tiles of head (z, hq) for this CTA's KV block; the partial ones come first."""
    qnb, qidx, fqnb, fqidx = tables
    SZ, SH, NUM_KV_BLKS, NUM_Q_BLKS, WINDOW = table_meta
    if SPARSE.HAS_BLOCK_MASK:
        row = ((z % SZ) * SH + (hq % SH)) * NUM_KV_BLKS + kv_blk
        n_partial = gl.load(qnb + row) * SPARSE.Q_TILES_PER_BLK
        if SPARSE.HAS_FULL_BLOCKS:
            n_full = gl.load(fqnb + row) * SPARSE.Q_TILES_PER_BLK
        else:
            n_full = n_partial * 0
    elif SPARSE.CAUSAL_WALK:
        DIAG: gl.constexpr = SPARSE.SPARSE_KV // TILE.BLOCK_M
        n_total = gl.maximum(gl.cdiv(M, TILE.BLOCK_M) - kv_blk * DIAG, 0)
        n_partial = gl.minimum(n_total, DIAG)
        n_full = n_total - n_partial
    elif SPARSE.WINDOW_WALK:
        # KV block [n0, n0 + SPARSE_KV): rows n0 .. n0 + SPARSE_KV + WINDOW - 2 see some of its keys, rows
        # n0 + SPARSE_KV - 1 .. n0 + WINDOW - 1 all of them. Walked as: the DIAG diagonal tiles, the tail (tiles from
        # t0 + max(DIAG, WINDOW // BLOCK_M) on, which the window's edge cuts), then the full tiles between
        DIAG: gl.constexpr = SPARSE.SPARSE_KV // TILE.BLOCK_M
        t0 = kv_blk * DIAG
        n_tiles = gl.cdiv(M, TILE.BLOCK_M)
        w_tiles = gl.to_tensor(WINDOW) // TILE.BLOCK_M
        n_diag = gl.minimum(gl.maximum(n_tiles - t0, 0), DIAG)
        n_full = gl.maximum(gl.minimum(t0 + w_tiles, n_tiles) - t0 - DIAG, 0)
        tail_end = gl.minimum((kv_blk * SPARSE.SPARSE_KV + SPARSE.SPARSE_KV + WINDOW - 2) // TILE.BLOCK_M + 1, n_tiles)
        n_partial = n_diag + gl.maximum(tail_end - t0 - gl.maximum(w_tiles, DIAG), 0)
    elif SPARSE.DENSE_MASK:
        n_partial = gl.cdiv(M, TILE.BLOCK_M)
        n_full = n_partial * 0
    else:
        n_partial = M * 0
        n_full = gl.cdiv(M, TILE.BLOCK_M)
    return n_partial, n_partial + n_full


@gluon.jit
def _q_tile_start(i, n_partial, z, hq, kv_blk, tables, table_meta, TILE: gl.constexpr,
                  SPARSE: gl.constexpr, ONE_LOAD: gl.constexpr = False):
    """First query row of the i-th query tile of head (z, hq). The partial or the full table is read behind a branch
    (two predicated loads) or, ONE_LOAD, chosen by address (one load): two loads into one register carried across a
    step wait on each other (bwd_sm90_wide's overlap loads the row a step ahead)."""
    qnb, qidx, fqnb, fqidx = tables
    SZ, SH, NUM_KV_BLKS, NUM_Q_BLKS, WINDOW = table_meta
    PER: gl.constexpr = SPARSE.Q_TILES_PER_BLK
    if SPARSE.HAS_BLOCK_MASK:
        row = ((z % SZ) * SH + (hq % SH)) * NUM_KV_BLKS + kv_blk
        if ONE_LOAD:
            partial = i < n_partial
            j = gl.where(partial, i, i - n_partial)
            blk = gl.load(gl.where(partial, qidx, fqidx) + row * NUM_Q_BLKS + j // PER)
            sub = j % PER
        elif i < n_partial:
            blk = gl.load(qidx + row * NUM_Q_BLKS + i // PER)
            sub = i % PER
        else:
            j = i - n_partial
            blk = gl.load(fqidx + row * NUM_Q_BLKS + j // PER)
            sub = j % PER
        start = (blk * PER + sub) * TILE.BLOCK_M
    elif SPARSE.CAUSAL_WALK:
        start = (kv_blk * (SPARSE.SPARSE_KV // TILE.BLOCK_M) + i) * TILE.BLOCK_M
    elif SPARSE.WINDOW_WALK:   # (_q_tile_counts' order: diagonal, tail, full; a tail only when all DIAG are there)
        DIAG: gl.constexpr = SPARSE.SPARSE_KV // TILE.BLOCK_M
        w_tiles = gl.to_tensor(WINDOW) // TILE.BLOCK_M
        t = gl.where(i < n_partial, gl.where(i < DIAG, i, gl.maximum(w_tiles, DIAG) + i - DIAG), DIAG + i - n_partial)
        start = (kv_blk * DIAG + t) * TILE.BLOCK_M
    else:
        start = i * TILE.BLOCK_M
    return start


@gluon.constexpr_function
def _acc_layout(n):
    """The accumulator layout of a warpgroup's wgmma with ``n`` columns (64 rows: 4 warps, 16 rows each)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


# ----------------------------------------------------------------------------------------------
# Producer: one warp issuing TMA.
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _producer(descs, bars, smem, sizes, tables, table_meta, cta, pack, TILE: gl.constexpr, SPARSE: gl.constexpr,
              FLAGS: gl.constexpr, SCHED: gl.constexpr, PACK: gl.constexpr):
    if SCHED.PERSISTENT:
        first, n_my = _cta_tiles(cta)
        cnt = 0
        for t in range(n_my):
            kv_tile, kvh = _persistent_tile(cta, first + t, sizes[4], TILE)
            b = t % SCHED.KV_BUFS
            # kv_empty[b]: both consumers are done with the K and V of the tile that last used buffer b
            mbarrier.wait(cta[1].index(b), ((t // SCHED.KV_BUFS) & 1) ^ 1)
            cnt = _producer_tile(kv_tile, kvh, cnt, cta[2].index(b), b, descs, bars, smem, sizes, tables,
                                 table_meta, TILE, SPARSE, FLAGS)
    elif PACK.VARLEN:
        kv_tile, kvh = _packed_coords(pack, sizes[1] // FLAGS.GQA_GROUP, TILE)
        q_row0, M, k_row0, N = _seq_span(pack, kvh // (sizes[1] // FLAGS.GQA_GROUP))
        if kv_tile * TILE.BLOCK_N < N:   # a tile at or past the sequence's keys loads nothing (its consumers wait
            # for nothing); batch 1 as constants (the packed launch's Z = KZ = 1: one flat loop over the GQA group)
            _producer_tile(kv_tile, kvh, 0, bars[0], 0, descs, bars, smem, (1, sizes[1], 1, M, N), tables,
                           table_meta, TILE, SPARSE, FLAGS, PACKED=True, q_row0=q_row0, k_row0=k_row0)
    else:
        kv_tile, kvh = _cta_coords(cta, SCHED)
        _producer_tile(kv_tile, kvh, 0, bars[0], 0, descs, bars, smem, sizes, tables, table_meta, TILE, SPARSE,
                       FLAGS)


@gluon.jit
def _producer_tile(kv_tile, kvh, cnt, kv_bar, kv_buf, descs, bars, smem, sizes, tables, table_meta,
                   TILE: gl.constexpr, SPARSE: gl.constexpr, FLAGS: gl.constexpr, PACKED: gl.constexpr = False,
                   q_row0=0, k_row0=0):
    """K and V of one (KV tile, K/V head) into K / V buffer kv_buf (barrier kv_bar), then its Q / dO steps from ring
    step cnt on; returns the next cnt. PACKED (PACK.VARLEN, kvh = sequence * HKV + hkv): the tensors' batch is 0, rows
    from the sequence's first query / key row q_row0 / k_row0, ``sizes``' M and N its lengths."""
    q_desc, do_desc, k_desc, v_desc, dq_desc = descs
    kv_ready, qdo_ready, qdo_empty, ds_ready = bars
    q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, dq_smem = smem
    Z, HQ, KZ, M, N = sizes
    NUM_STAGES: gl.constexpr = TILE.NUM_STAGES
    n0 = kv_tile * TILE.BLOCK_N
    HKV = HQ // FLAGS.GQA_GROUP
    kz = kvh // HKV
    hkv = kvh % HKV
    kv_blk = n0 // SPARSE.SPARSE_KV
    kz_t = 0 if PACKED else kz   # the tensors' K / V batch

    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [kz_t, hkv, k_row0 + n0, 0], kv_bar, k_smem.index(kv_buf))
    tma.async_copy_global_to_shared(v_desc, [kz_t, hkv, k_row0 + n0, 0], kv_bar, v_smem.index(kv_buf))

    cnt = gl.to_tensor(cnt)   # a loop-carried value (the default launch passes a literal 0)
    # every query batch that reads this K/V batch (all of them when KZ = 1), every head of the GQA
    # group: one flat loop (a nested one holds more loop state in registers)
    for hh in range((Z // KZ) * FLAGS.GQA_GROUP):
        z = kz + (hh // FLAGS.GQA_GROUP) * KZ
        hq = hkv * FLAGS.GQA_GROUP + hh % FLAGS.GQA_GROUP
        n_partial, n_total = _q_tile_counts(z, hq, kv_blk, M, tables, table_meta, TILE, SPARSE)
        for i in range(n_total):
            m0 = _q_tile_start(i, n_partial, z, hq, kv_blk, tables, table_meta, TILE, SPARSE)
            _load_q_do(cnt, 0 if PACKED else z, hq, q_row0 + m0, descs, bars, smem, NUM_STAGES)
            cnt += 1
    return cnt


@gluon.jit
def _load_q_do(cnt, z, hq, row, descs, bars, smem, NUM_STAGES: gl.constexpr):
    """Ring step cnt: wait for its stage to be free, then TMA-load Q and dO rows [row, row + BLOCK_M) of (z, hq)."""
    q_desc, do_desc, k_desc, v_desc, dq_desc = descs
    kv_ready, qdo_ready, qdo_empty, ds_ready = bars
    q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, dq_smem = smem
    st = cnt % NUM_STAGES
    mbarrier.wait(qdo_empty.index(st), ((cnt // NUM_STAGES) & 1) ^ 1)
    mbarrier.expect(qdo_ready.index(st), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [z, hq, row, 0], qdo_ready.index(st), q_smem.index(st))
    tma.async_copy_global_to_shared(do_desc, [z, hq, row, 0], qdo_ready.index(st), do_smem.index(st))


@gluon.jit
def _seq_span(pack, seq):
    """PACK.VARLEN: (first query row, query length, first key row, key length) of packed sequence ``seq``."""
    cu_q = pack[0]
    cu_k = pack[1]
    q_row0 = gl.load(cu_q + seq)
    k_row0 = gl.load(cu_k + seq)
    return q_row0, gl.load(cu_q + seq + 1) - q_row0, k_row0, gl.load(cu_k + seq + 1) - k_row0


@gluon.jit
def _packed_coords(pack, HKV, TILE: gl.constexpr):
    """PACK.VARLEN: (KV tile within its sequence, sequence * HKV + hkv) of this CTA. program_id(0) is a virtual tile,
    whose sequence b the table (pack[2]) gives; b's tiles start at virtual tile CU_K[b] // BLOCK_N + b (one past its
    last: an empty CTA)."""
    t = gl.program_id(0)
    seq = gl.load(pack[2] + t)
    kv_tile = t - (gl.load(pack[1] + seq) // TILE.BLOCK_N + seq)
    return kv_tile, seq * HKV + gl.program_id(1)


# ----------------------------------------------------------------------------------------------
# Consumers: 64 key rows each.
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _probabilities(qk, lse, z, hq, q_idx, kv_idx, is_partial, sm_scale, qk_scale2, score_bufs, mask_bufs,
                   SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr, FLAGS: gl.constexpr):
    """P of one step: the forward's score (same mods, units and index clamping) against the saved LSE.

    Keys past N (the last KV tile, not EVEN_N) get no mask: their K and V rows read as zero, so they add nothing
    to dQ (dS * 0) and their own dK, dV rows are never stored, provided P stays finite. P <= 1 holds for every
    real key (the LSE counts it), so clamping the exponent at 0 keeps the padded ones finite: one FMNMX a score
    instead of a bound test that would hold a column vector of key positions."""
    if SCORE_MOD is not None:
        s = SCORE_MOD(qk, sm_scale, z, hq, q_idx, kv_idx, score_bufs)
    elif FLAGS.FOLD_SCALE:
        s = qk
    else:
        s = qk * sm_scale
    if MASK_MOD is not None:
        if is_partial:
            s = gl.where(MASK_MOD(z, hq, q_idx, kv_idx, mask_bufs), s, -float("inf"))
    x = s * qk_scale2 - lse[:, None]
    if not FLAGS.EVEN_N or FLAGS.WIDE_SCORES:
        x = gl.minimum(x, 0.0)
    return gl.exp2(x)


@gluon.jit
def _lse_rows(stats_h, m0, rows_, M, PACK: gl.constexpr):
    """LSE_P of query rows m0 + rows_. Packed, rows at or past the sequence's end M are the next sequence's: +inf there
    makes their P 0, so they add nothing to dV, dK or dQ."""
    lse = gl.load(stats_h + m0 + rows_)
    if PACK.VARLEN:
        lse = gl.where(m0 + rows_ < M, lse, float("inf"))
    return lse


@gluon.jit
def _kv_landed(kv_bar, kv_phase, k_smem, kv_buf, n0, N, WG: gl.constexpr, TILE: gl.constexpr, PACK: gl.constexpr):
    """Wait for the tile's K and V. Packed, a tile at or past the sequence's keys waits for nothing (it has no step),
    and this warpgroup's K rows past the sequence's end (the next sequence's keys) are set to zero, as TMA's zero
    fill leaves a dense launch's tail: their S is 0, P finite (FLAGS.EVEN_N off: exponent clamp), and their dQ share
    dS * 0. The other warpgroup's dQ wgmma reads these rows only after this warpgroup's first ds_ready arrival,
    which follows the fence here."""
    if PACK.VARLEN:
        if n0 < N:
            mbarrier.wait(kv_bar, kv_phase)
            first = n0 + WG * TILE.HALF_N
            if first + TILE.HALF_N > N:
                _zero_keys_past(k_smem.index(kv_buf).reshape([TILE.BLOCK_N, TILE.HEAD_D]).slice(
                    WG * TILE.HALF_N, TILE.HALF_N, dim=0), first, N)
                fence_async_shared()
                gl.thread_barrier()
    else:
        mbarrier.wait(kv_bar, kv_phase)


@gluon.jit
def _zero_keys_past(keys, first, N):
    """Rows of the shared K view ``keys`` (a warpgroup's, rows = keys first, first + 1, ...) at or past N set to zero
    (the caller fences before a wgmma reads them)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows: gl.constexpr = keys.shape[0]
    held = keys.load(layout)
    r = gl.arange(0, rows, layout=gl.SliceLayout(1, layout))[:, None]
    keys.store(gl.where(first + r < N, held, gl.zeros_like(held)))


@gluon.jit
def _store_dkdv(dk, dv, out_rows, out_cols, dk_ptr, dv_ptr, kz, hkv, HKV, N, k_row0, ds_scale, TILE: gl.constexpr,
                PACK: gl.constexpr):
    """dK (times ds_scale) and dV of this warpgroup's keys, rows past N clipped: [KZ, HKV, N, D] contiguous, or
    packed (total keys, HKV, D) from key row k_row0."""
    dtype: gl.constexpr = dk_ptr.dtype.element_ty
    keep = (out_rows < N) & (out_cols < TILE.D_MEM)
    if PACK.VARLEN:
        offs = (k_row0 + out_rows).to(gl.int64) * (HKV * TILE.D_MEM) + hkv * TILE.D_MEM + out_cols
        gl.store(dk_ptr + offs, (dk * ds_scale).to(dtype), mask=keep)
        gl.store(dv_ptr + offs, dv.to(dtype), mask=keep)
    else:
        head = (kz * HKV + hkv).to(gl.int64) * N * TILE.D_MEM     # dK, dV are contiguous (the host sees to it)
        gl.store(dk_ptr + head + out_rows * TILE.D_MEM + out_cols, (dk * ds_scale).to(dtype), mask=keep)
        gl.store(dv_ptr + head + out_rows * TILE.D_MEM + out_cols, dv.to(dtype), mask=keep)


@gluon.jit
def _store_dkdv_tma(dk, dv, stage, dk_desc, dv_desc, kz, hkv, row0, dk_col, dv_col, ds_scale):
    """dK (times ds_scale), then dV, of this warpgroup's keys row0.. (columns from dk_col, dv_col) through its fp32 dQ
    staging tile ``stage`` (16 KB, free once its last reduce-add has read it: one bf16 box at a time, each up to
    [64, 128]) and TMA stores; rows past N are clipped by the descriptors ([KZ, HKV, N, D] by [1, 1, rows, cols]
    boxes). bwd_sm90_wide.py stores its warpgroups' columns with it too."""
    dtype: gl.constexpr = dv_desc.dtype
    tma.store_wait(0)   # the last dQ reduce-add has read the staging tile
    k_tile = stage._reinterpret(dtype, dk_desc.block_type.shape, dk_desc.layout)
    k_tile.reshape(dk_desc.block_type.shape[2:]).store((dk * ds_scale).to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(dk_desc, [kz, hkv, row0, dk_col], k_tile)
    tma.store_wait(0)
    gl.thread_barrier()
    v_tile = stage._reinterpret(dtype, dv_desc.block_type.shape, dv_desc.layout)
    v_tile.reshape(dv_desc.block_type.shape[2:]).store(dv.to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(dv_desc, [kz, hkv, row0, dv_col], v_tile)


@gluon.jit
def _opaque(x):
    """x, through an asm LLVM cannot see into or move out of the loop: what is derived from it is computed where
    it is used instead of hoisted and held in registers across the loop (ptxas sees a plain mov, so the derived
    values may still be rematerialized or held as ptxas sees fit). The dQ atomics' row offsets: hoisted, they
    became 64-bit addresses of every atomic, kept live (and spilled) across the loop; made per step, they are two
    row addresses a thread plus the columns as immediate offsets. The per-step shared-memory views: _consumer."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _lane_id():
    """The thread's %laneid, read where it is called: LLVM can neither hoist it nor merge it with the thread index
    it read at the kernel's entry (_consumer_overlap's dK / dV store). (%tid.x read this way made ptxas lose the
    uniform datapath in the step loops: 1100 instructions instead of 838, sm90 triton 3.6.)"""
    return gl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [0], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _consumer(WG: gl.constexpr, descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, cta,
              SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr, TILE: gl.constexpr,
              SPARSE: gl.constexpr, FLAGS: gl.constexpr, SCHED: gl.constexpr, PACK: gl.constexpr):
    if SCHED.PERSISTENT:
        first, n_my = _cta_tiles(cta)
        cnt = 0
        for t in range(n_my):
            kv_tile, kvh = _persistent_tile(cta, first + t, sizes[4], TILE)
            b = t % SCHED.KV_BUFS
            cnt = _consumer_run_tile(WG, kv_tile, kvh, cta[2].index(b), (t // SCHED.KV_BUFS) & 1, b, cnt, cta,
                                     descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs,
                                     SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE, SPARSE, FLAGS, SCHED, PACK)
    else:
        if PACK.VARLEN:
            kv_tile, kvh = _packed_coords(rows[5], sizes[1] // FLAGS.GQA_GROUP, TILE)
        else:
            kv_tile, kvh = _cta_coords(cta, SCHED)
        _consumer_run_tile(WG, kv_tile, kvh, bars[0], 0, 0, 0, cta, descs, bars, smem, sizes, tables, table_meta,
                           rows, scalars, mod_bufs, SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE, SPARSE, FLAGS, SCHED, PACK)
    if SCHED.DQ_TMA:
        tma.store_wait(0)   # the last dQ reduce has read the staging tile before the CTA exits


@gluon.jit
def _consumer_run_tile(WG: gl.constexpr, kv_tile, kvh, kv_bar, kv_phase, kv_buf, cnt, cta, descs, bars, smem, sizes,
                       tables, table_meta, rows, scalars, mod_bufs, SCORE_MOD: gl.constexpr,
                       SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr, TILE: gl.constexpr, SPARSE: gl.constexpr,
                       FLAGS: gl.constexpr, SCHED: gl.constexpr, PACK: gl.constexpr):
    """One tile with the step SCHED.OVERLAP picks: _consumer_overlap_tile (1 / 2) or _consumer_tile (0)."""
    if SCHED.OVERLAP:
        cnt = _consumer_overlap_tile(WG, kv_tile, kvh, kv_bar, kv_phase, kv_buf, cnt, cta, descs, bars, smem, sizes,
                                     tables, table_meta, rows, scalars, mod_bufs, SCORE_MOD, SCORE_GRAD, MASK_MOD,
                                     TILE, SPARSE, FLAGS, SCHED, PACK)
    else:
        cnt = _consumer_tile(WG, kv_tile, kvh, kv_bar, kv_phase, kv_buf, cnt, cta, descs, bars, smem, sizes, tables,
                             table_meta, rows, scalars, mod_bufs, SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE, SPARSE,
                             FLAGS, SCHED, PACK)
    return cnt


@gluon.jit
def _consumer_tile(WG: gl.constexpr, kv_tile, kvh, kv_bar, kv_phase, kv_buf, cnt, cta, descs, bars, smem, sizes,
                   tables, table_meta, rows, scalars, mod_bufs, SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr,
                   MASK_MOD: gl.constexpr, TILE: gl.constexpr, SPARSE: gl.constexpr, FLAGS: gl.constexpr,
                   SCHED: gl.constexpr, PACK: gl.constexpr):
    """One (KV tile, K/V head), its K and V in buffer kv_buf (landed: kv_bar's phase kv_phase): its query steps from
    ring step cnt on, then the dK, dV stores; returns the next cnt."""
    q_desc, do_desc, k_desc, v_desc, dq_desc = descs
    kv_ready, qdo_ready, qdo_empty, ds_ready = bars
    q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, dq_smem = smem
    Z, HQ, KZ, M, N = sizes
    stats_ptr, dq_acc_ptr, dk_ptr, dv_ptr, M_PAD, pack, out_descs = rows   # STATS, DQ_ACC, dK, dV, PACK.VARLEN's
                                                                            # offsets, DKDV_TMA's descriptors
    sm_scale, qk_scale2, ds_scale = scalars
    score_bufs, mask_bufs = mod_bufs
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    BLOCK_N: gl.constexpr = TILE.BLOCK_N
    HALF_N: gl.constexpr = TILE.HALF_N
    D: gl.constexpr = TILE.HEAD_D
    NUM_STAGES: gl.constexpr = TILE.NUM_STAGES
    DQ_N: gl.constexpr = TILE.DQ_N
    dtype: gl.constexpr = q_desc.dtype

    # Accumulator layouts of the wgmmas (64 rows per warpgroup).
    s_layout: gl.constexpr = _acc_layout(HALF_N)
    d_layout: gl.constexpr = _acc_layout(D)
    dq_layout: gl.constexpr = _acc_layout(DQ_N)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    n0 = kv_tile * BLOCK_N
    HKV = HQ // FLAGS.GQA_GROUP
    kz = kvh // HKV
    hkv = kvh % HKV
    kv_blk = n0 // SPARSE.SPARSE_KV
    q_row0 = 0   # the first query / key row of a packed sequence (kz), else 0
    k_row0 = 0
    if PACK.VARLEN:
        q_row0, M, k_row0, N = _seq_span(pack, kz)
        M = gl.where(n0 < N, M, 0)   # a tile past the sequence's keys: no step

    p_mine = p_smem.index(WG)                                        # [BLOCK_M, HALF_N]

    dk = gl.zeros([HALF_N, D], gl.float32, layout=d_layout)
    dv = gl.zeros([HALF_N, D], gl.float32, layout=d_layout)
    s_zero = gl.zeros([BLOCK_M, HALF_N], gl.float32, layout=s_layout)
    dq_zero = gl.zeros([BLOCK_M, DQ_N], gl.float32, layout=dq_layout)
    DQ_COL0: gl.constexpr = WG * DQ_N if TILE.DQ_SPLIT else 0

    _kv_landed(kv_bar, kv_phase, k_smem, kv_buf, n0, N, WG, TILE, PACK)
    cnt = gl.to_tensor(cnt)   # a loop-carried value (the default launch passes a literal 0)
    if SCHED.DETERMINISTIC:
        older = cta[0]   # the counters of this warpgroup's adds not released yet (DQ_SEMS' sink: none)
        newer = cta[0]
    # every query batch that reads this K/V batch (all of them when KZ = 1), every head of the GQA
    # group: one flat loop (a nested one holds more loop state in registers)
    for hh in range((Z // KZ) * FLAGS.GQA_GROUP):
        z = kz + (hh // FLAGS.GQA_GROUP) * KZ
        hq = hkv * FLAGS.GQA_GROUP + hh % FLAGS.GQA_GROUP
        zh = hq if PACK.VARLEN else z * HQ + hq   # (packed: z is the sequence, the tensors' batch is 1)
        n_partial, n_total = _q_tile_counts(z, hq, kv_blk, M, tables, table_meta, TILE, SPARSE)
        stats_h = stats_ptr + zh.to(gl.int64) * (2 * M_PAD) + q_row0   # LSE_P of the head; DELTA_P is M_PAD further
        rows_ = gl.arange(0, BLOCK_M, layout=row_layout)
        m0 = n_total * 0
        if SCHED.STATS_AHEAD:
            # a step's LSE and DELTA rows are loaded a step ahead (the head's first here), so that their latency
            # runs under the previous step's dK and dQ: loaded where they are used, the first FADD of each waited
            # on its load (Nsight Compute, D = 64 noop: long_scoreboard 30% of the consumers' samples)
            if n_total > 0:
                m0 = _q_tile_start(0, n_partial, z, hq, kv_blk, tables, table_meta, TILE, SPARSE)
            lse = _lse_rows(stats_h, m0, rows_, M, PACK)
            delta = gl.load(stats_h + M_PAD + m0 + rows_)
        for i in range(n_total):
            if not SCHED.STATS_AHEAD:
                m0 = _q_tile_start(i, n_partial, z, hq, kv_blk, tables, table_meta, TILE, SPARSE)
            st = cnt % NUM_STAGES
            buf = cnt % 2
            # K, V and P^T as wgmma operands, indexed by a zero LLVM cannot see through (VIEWS_PER_STEP). Built
            # once before the loop, their 28 descriptors (64-bit each, at D = 128) were hoisted by LLVM and, with a
            # mask or a mod, kept by ptxas in up to 24 vector registers across the loop: causal spilled 56
            # instructions (11 in the loop), ALiBi 57. Built here, ptxas makes them per step in uniform registers.
            if TILE.VIEWS_PER_STEP or SCHED.PERSISTENT:   # (persistent: a tile loop more, D = 64 spilled)
                zero = _opaque(0)
            else:
                zero = 0
            if SCHED.PERSISTENT:
                kv_idx_buf = zero + kv_buf
            else:
                kv_idx_buf = zero
            k_rows = k_smem.index(kv_idx_buf).reshape([BLOCK_N, D])
            v_rows = v_smem.index(kv_idx_buf).reshape([BLOCK_N, D])
            k_t = k_rows.slice(WG * HALF_N, HALF_N, dim=0).permute((1, 0))   # B of S = Q K^T (this warpgroup's keys)
            v_t = v_rows.slice(WG * HALF_N, HALF_N, dim=0).permute((1, 0))   # B of dP = dO V^T
            p_t = p_smem.index(WG + zero).permute((1, 0))                    # A of dV += P^T dO
            k_dq = k_rows.slice(DQ_COL0, DQ_N, dim=1)   # B of dQ[:, this warpgroup's columns] = dS K[:, columns]
            row_off = zh.to(gl.int64) * M_PAD + q_row0 + m0        # of DQ_ACC (rows of D)
            if not SCHED.STATS_AHEAD:
                lse = _lse_rows(stats_h, m0, rows_, M, PACK)
            q_t = q_smem.index(st).reshape([BLOCK_M, D])
            do_t = do_smem.index(st).reshape([BLOCK_M, D])
            mbarrier.wait(qdo_ready.index(st), (cnt // NUM_STAGES) & 1)
            # dP is issued once P is made: S and dP in flight beside P spill at D = 128 with a mod (issuing dP
            # beside S, FA3's order, measured 0.90-0.97x on an H100: configs.py). dS's P (times f') is held in
            # registers across the dP wgmma with SCHED.P_REGS (D = 64), else P and f' are read back from shared
            # memory in 16 bits.
            s_tok = warpgroup_mma(q_t, k_t, s_zero, use_acc=False, is_async=True)
            qk, _q, _k = warpgroup_mma_wait(0, deps=[s_tok, q_t, k_t])
            q_idx = gl.minimum(m0 + rows_, M - 1)[:, None]
            kv0 = n0 + WG * HALF_N
            # a column vector is HALF_N / 4 registers a thread: made per step, not held across the loop
            kv_idx = gl.minimum(kv0 + _opaque(gl.arange(0, HALF_N, layout=col_layout)), N - 1)[None, :]
            p = _probabilities(qk, lse, z, hq, q_idx, kv_idx, i < n_partial, sm_scale, qk_scale2, score_bufs,
                               mask_bufs, SCORE_MOD, MASK_MOD, FLAGS)
            p_mine.store(p.to(dtype))
            # SCHED.P_REGS: dS's P (times f') in fp32 registers across the dP wgmma
            p_ds = _ds_factor(p, qk, p_smem.index(2 + WG), sm_scale, z, hq, q_idx, kv_idx, score_bufs, SCORE_GRAD,
                              FLAGS, SCHED.P_REGS)
            fence_async_shared()
            gl.thread_barrier()        # every thread's part of P is in shared memory before the wgmma reads it
            dp_tok = warpgroup_mma(do_t, v_t, s_zero, use_acc=False, is_async=True)
            dv_tok = warpgroup_mma(p_t, do_t, dv, is_async=True)
            if not SCHED.STATS_AHEAD:
                delta = gl.load(stats_h + M_PAD + m0 + rows_)
            dp, _do, _v = warpgroup_mma_wait(1, deps=[dp_tok, do_t, v_t])
            ds = _ds(dp, delta, p_ds, p_mine, p_smem.index(2 + WG), s_layout, SCORE_GRAD is not None, SCHED.P_REGS)
            # dS to shared memory: this warpgroup's dK wgmma reads its half, the dQ wgmma both halves.
            ds_tile = ds_smem.index(buf)                              # [BLOCK_M, BLOCK_N]
            ds_mine = ds_tile.slice(WG * HALF_N, HALF_N, dim=1)
            ds_mine.store(ds.to(dtype))
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(ds_ready.index(buf), count=1)
            m_cur = m0
            if SCHED.STATS_AHEAD:
                # the next step's rows (this step's again on the head's last: loaded, not used)
                m0 = _q_tile_start(gl.minimum(i + 1, n_total - 1), n_partial, z, hq, kv_blk, tables, table_meta,
                                   TILE, SPARSE)
                lse_next = _lse_rows(stats_h, m0, rows_, M, PACK)
                delta_next = gl.load(stats_h + M_PAD + m0 + rows_)
            # dQ = dS K over all 128 keys (both warpgroups' dS): DQ_SPLIT, each warpgroup D / 2 columns every
            # step; else (D = 64) all columns every other step.
            if TILE.DQ_SPLIT:
                mine = True
            else:
                mine = cnt % 2 == WG
            # dK, then dQ (dQ before dK measured 0.84-1.05x: configs.py)
            dk_tok = warpgroup_mma(ds_mine.permute((1, 0)), q_t, dk, is_async=True)
            if SCHED.DETERMINISTIC:   # earlier adds released and this one's counter loaded, under dV and dK
                flush = cnt % 2 == 1   # D >= 128: every second add (D64 releases each: _turn_ahead)
                sem, target, seen = newer, 0, 0
                if mine:
                    sem, target, seen = _turn_ahead(older, newer, flush, cta, zh, m_cur, kv_tile, kv_blk, z, hq, M_PAD,
                                                    table_meta, WG, TILE, SPARSE)
            dv, dk, _p, _ds, _do2, _q2 = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, p_t, ds_mine, do_t, q_t])
            mbarrier.arrive(qdo_empty.index(st), count=1)
            if mine:
                mbarrier.wait(ds_ready.index(buf), (cnt // 2) & 1)
                dq_tok = warpgroup_mma(ds_tile, k_dq, dq_zero, use_acc=False, is_async=True)
                dq, _a, _b = warpgroup_mma_wait(0, deps=[dq_tok, ds_tile, k_dq])
                if SCHED.DETERMINISTIC:
                    added = _add_dq_in_turn(dq, dq_desc, dq_smem, zh, m_cur, sem, target, seen, WG, TILE, SCHED)
                    older, newer = _held_turns(older, newer, added, flush, cta, TILE)
                else:
                    _add_dq(dq, dq_acc_ptr, dq_desc, dq_smem, zh, q_row0 + m_cur, row_off, WG, TILE, SCHED)
            if SCHED.STATS_AHEAD:
                lse = lse_next
                delta = delta_next
            cnt += 1
    if SCHED.DETERMINISTIC:
        _last_release(older, newer, TILE)
    if SCHED.PERSISTENT:
        mbarrier.arrive(cta[1].index(kv_buf), count=1)   # kv_empty: this warpgroup's wgmmas reading K, V retired

    # dK, dV: one store per output tile (rows past N clipped); dK takes the scale and f's factor here.
    out_rows = n0 + WG * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, d_layout))[:, None]
    out_cols = gl.arange(0, D, layout=gl.SliceLayout(0, d_layout))[None, :]
    if SCHED.DKDV_TMA:
        _store_dkdv_tma(dk, dv, dq_smem.index(WG), out_descs[0], out_descs[1], kz, hkv, n0 + WG * HALF_N, 0, 0,
                        ds_scale)
    else:
        _store_dkdv(dk, dv, out_rows, out_cols, dk_ptr, dv_ptr, kz, hkv, HKV, N, k_row0, ds_scale, TILE, PACK)
    return cnt


@gluon.jit
def _dq_fragments(dq):
    """A [64, 64] fp32 wgmma accumulator as the [16, 256] floats of its fragments: element (r, c) at (c // 8) * 512
    + thread(r, c) * 4 + ((r // 8) % 2) * 2 + c % 2, thread(r, c) = (r // 16) * 32 + (r % 8) * 4 + (c // 2) % 4. A
    logical permutation that leaves every register in its thread: stored to an unswizzled tile, each thread's four
    values of an n8 block are one 16-byte store and a warp's 32 of them 512 contiguous bytes (no bank conflict; the
    128-byte-swizzled [64, 64] tile took 8-byte stores two-way conflicted in each half-warp). DQ_ACC keeps its 64 x 64
    blocks in this order; bwd_sm90_dq_convert_frag_kernel reads them back."""
    return dq.reshape([4, 2, 8, 8, 4, 2]).permute((3, 0, 2, 4, 1, 5)).reshape([16, 256])


@gluon.jit
def _frag_reduce_add(dq, stage, dq_desc, zh, m0, col, D_MEM: gl.constexpr):
    """The [64, 64] dQ chunk at (rows m0.., columns col..) of head zh into the staging tile ``stage`` ([1, 16, 256],
    free: the caller waited) in fragment order, then its TMA reduce-add into DQ_ACC's block (m0 // 64, col // 64) of
    D_MEM // 64 a row of blocks (the descriptor: DQ_ACC as rows of 256 floats, 16 a block)."""
    stage.reshape([16, 256]).store(_dq_fragments(dq))
    fence_async_shared()
    blk = (m0 // 64) * (D_MEM // 64) + col // 64
    _tma_reduce_add(dq_desc, [zh, blk * 16, 0], stage)


@gluon.jit
def _add_dq(dq, dq_acc_ptr, dq_desc, dq_smem, zh, m0, row_off, WG: gl.constexpr, TILE: gl.constexpr,
            SCHED: gl.constexpr):
    """Add this warpgroup's dQ tile [BLOCK_M, DQ_N] (wgmma layout, fp32) into DQ_ACC rows [m0, m0 + BLOCK_M) of
    head zh. SCHED.DQ_TMA: staged in the warpgroup's shared tile and added by one TMA reduce-add (whole 128-byte
    lines at L2; the tile is reused once the previous reduce has read it). Else red.global.add.v2.f32, 16 a
    thread (a thread's fragment holds 2 adjacent columns per 8: v2 is the widest without a shuffle)."""
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    DQ_N: gl.constexpr = TILE.DQ_N
    D: gl.constexpr = TILE.HEAD_D
    DQ_COL0: gl.constexpr = WG * DQ_N if TILE.DQ_SPLIT else 0
    if SCHED.DQ_FRAG or SCHED.DQ_TMA:   # (WAIT: the previous reduce has read this warpgroup's tile)
        _stage_reduce_add(dq, dq_desc, dq_smem, zh, m0, WG, TILE, SCHED, WAIT=True)
    else:
        dq_layout: gl.constexpr = dq.type.layout
        dq_rows = _opaque(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout)))
        # the column offset goes with the rows: columns from 0 become the atomics' immediates
        dq_cols = gl.arange(0, DQ_N, layout=gl.SliceLayout(0, dq_layout))
        dq_ptrs = dq_acc_ptr + ((row_off + dq_rows) * D + DQ_COL0)[:, None] + dq_cols[None, :]
        gl.atomic_add(dq_ptrs, dq, sem="relaxed")


@gluon.jit
def _stage_reduce_add(dq, dq_desc, dq_smem, zh, m0, WG: gl.constexpr, TILE: gl.constexpr, SCHED: gl.constexpr,
                      WAIT: gl.constexpr):
    """This warpgroup's dQ tile into its shared staging tile, in the fragments' order (SCHED.DQ_FRAG) or as the
    [BLOCK_M, DQ_N] tile, then its TMA reduce-add into DQ_ACC rows m0.. of head zh. WAIT: first wait until the
    previous reduce-add has read the tile (tma.store_wait); else the caller knows it free."""
    DQ_COL0: gl.constexpr = WG * TILE.DQ_N if TILE.DQ_SPLIT else 0
    if SCHED.DQ_FRAG:
        if WAIT:
            tma.store_wait(0)
        _frag_reduce_add(dq, dq_smem.index(WG), dq_desc, zh, m0, DQ_COL0, TILE.D_MEM)
    else:
        stage = dq_smem.index(WG)                    # [1, BLOCK_M, DQ_N]
        if WAIT:
            tma.store_wait(0)
        stage.reshape([TILE.BLOCK_M, TILE.DQ_N]).store(dq)
        fence_async_shared()
        _tma_reduce_add(dq_desc, [zh, m0, DQ_COL0], stage)


# ----------------------------------------------------------------------------------------------
# Deterministic dQ (SCHED.DETERMINISTIC): each dQ tile's adds in ascending KV-tile order.
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _ld_acquire(ptr):
    """The int32 at ``ptr``, loaded with acquire semantics at GPU scope (a counter other CTAs release)."""
    return gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _wait_turn(sem, target, seen):
    """Spin until the counter at ``sem`` reaches ``target`` (every CTA before this one in the order has added);
    ``seen``: a value of it loaded earlier (acquire), enough when it already reached the target. The reduce-add issued
    after it is ordered behind the acquire (fence.proxy.async: the async proxy's write after the generic proxy's
    read)."""
    while seen < target:
        seen = _ld_acquire(sem)
    gl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r,r", [seen], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _adds_complete():
    """Wait until this warpgroup's reduce-adds have completed in global memory (cp.async.bulk.wait_group without
    .read, which tma.store_wait is: that one only waits until the staging tile has been read), then the warpgroup's
    barrier. Returns a value for the release's asm to depend on. Leaves the staging tiles free."""
    done = gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.u32 $0, 0;",
                                     "=r,r", [0], dtype=gl.int32, is_pure=False, pack=1)
    gl.thread_barrier()
    return done


@gluon.jit
def _release_turn(sem):
    """Once this warpgroup's reduce-adds have completed (_adds_complete), lane 0 of each of its 4 warps adds 1 to the
    counter at ``sem`` with release semantics at GPU scope (a warpgroup's add counts 4: one thread of the warpgroup
    would need %tid.x, whose read in an asm made ptxas spill the step loops, as _lane_id says)."""
    done = _adds_complete()
    gl.inline_asm_elementwise(
        "{ .reg .pred first; .reg .b32 lane; mov.u32 lane, %laneid; setp.eq.u32 first, lane, 0; "
        "@first red.release.gpu.global.add.s32 [$1], 1; mov.u32 $0, $2; }",
        "=r,l,r", [sem, done], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _release_turns(first, second):
    """_release_turn of two counters behind one fence (fence.acq_rel.gpu, then two relaxed adds: a release of both),
    for bwd_sm90_wide.py's two dQ chunks of a step and for two successive adds at D >= 128 here (_turn_ahead)."""
    done = _adds_complete()
    gl.inline_asm_elementwise(
        "{ .reg .pred lead; .reg .b32 lane; mov.u32 lane, %laneid; setp.eq.u32 lead, lane, 0; "
        "@lead fence.acq_rel.gpu; @lead red.relaxed.gpu.global.add.s32 [$1], 1; "
        "@lead red.relaxed.gpu.global.add.s32 [$2], 1; mov.u32 $0, $3; }",
        "=r,l,l,r", [first, second, done], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _dq_turn(cta, zh, m0, slot, kv_tile, kv_blk, z, hq, M_PAD, table_meta, TILE: gl.constexpr, SPARSE: gl.constexpr):
    """(counter, target) of a dQ add into rows m0.. of head zh, columns [64 slot, 64 slot + 64) or (bwd_sm90's
    halves) the warpgroup's half: DQ_SEMS' counter (_SEM_SLOTS a 64-row step) and the count it waits for: 4 (warps,
    _release_turn) times the number of CTAs that add there before this one."""
    sems = cta[0]
    ranks = cta[1]
    sem = sems + 1 + ((zh.to(gl.int64) * (M_PAD // 64) + m0 // 64) * _SEM_SLOTS + slot)
    if SPARSE.HAS_BLOCK_MASK:
        SZ, SH, NUM_KV_BLKS, NUM_Q_BLKS, WINDOW = table_meta
        PER_KV: gl.constexpr = SPARSE.SPARSE_KV // TILE.BLOCK_N   # CTAs of a mask block: all add where it is listed
        q_blk = m0 // (SPARSE.Q_TILES_PER_BLK * TILE.BLOCK_M)
        row = ((z % SZ) * SH + (hq % SH)) * NUM_Q_BLKS + q_blk
        rank = gl.load(ranks + row * NUM_KV_BLKS + kv_blk) * PER_KV + kv_tile % PER_KV
    else:
        rank = kv_tile   # every KV tile adds into every query tile
    return sem, rank * 4


@gluon.jit
def _turn_ahead(older, newer, flush, cta, zh, m0, kv_tile, kv_blk, z, hq, M_PAD, table_meta, WG: gl.constexpr,
                TILE: gl.constexpr, SPARSE: gl.constexpr):
    """SCHED.DETERMINISTIC, mid-step (under the step's in-flight wgmmas): release the adds this warpgroup holds (D64:
    its previous one, ``newer``; D >= 128, where it adds every step: on every second add (``flush``) its two held,
    ``older`` and ``newer``, behind one fence, which costs the consumer ~0.7 us), then issue the acquire load of this
    step's counter, whose value is looked at only when the add is due (_add_dq_in_turn): (counter, target, value seen).
    Waited where they were issued, the release's fence and the load's round trip cost the backward 0.59-0.70x (H200,
    hopper_backward.md, "Deterministic dQ")."""
    if TILE.DQ_SPLIT:
        if flush:
            _release_turns(older, newer)
    else:
        _release_turn(newer)
    sem, target = _dq_turn(cta, zh, m0, WG if TILE.DQ_SPLIT else 0, kv_tile, kv_blk, z, hq, M_PAD, table_meta, TILE,
                           SPARSE)
    return sem, target, _ld_acquire(sem)


@gluon.jit
def _add_dq_in_turn(dq, dq_desc, dq_smem, zh, m0, sem, target, seen, WG: gl.constexpr, TILE: gl.constexpr,
                    SCHED: gl.constexpr):
    """SCHED.DETERMINISTIC's _add_dq: once the counter at ``sem`` has reached ``target`` (``seen``: its value loaded
    at _turn_ahead; spin only if that was short), stage and reduce-add as _add_dq does (at D64 the staging tile is
    free: the release at _turn_ahead waited for the last reduce-add to complete; at D >= 128 an add after one not
    released yet waits for its read). Returns ``sem``, to release at a later add's _turn_ahead or after the last add
    (_last_release)."""
    _wait_turn(sem, target, seen)
    _stage_reduce_add(dq, dq_desc, dq_smem, zh, m0, WG, TILE, SCHED, WAIT=TILE.DQ_SPLIT)
    return sem


@gluon.jit
def _held_turns(older, newer, added, flush, cta, TILE: gl.constexpr):
    """The counters a warpgroup holds after its add ``added``: at D >= 128 that one alone when this add's _turn_ahead
    released the two held before (``flush``), else the last one held and this one; at D64 ``added`` (``older`` stays
    the sink)."""
    if TILE.DQ_SPLIT:
        if flush:
            older = cta[0]   # DQ_SEMS' sink: nothing
        else:
            older = newer
    return older, added


@gluon.jit
def _last_release(older, newer, TILE: gl.constexpr):
    """After a warpgroup's last add: release what it holds (two counters at D >= 128, one at D64)."""
    if TILE.DQ_SPLIT:
        _release_turns(older, newer)
    else:
        _release_turn(newer)

# ----------------------------------------------------------------------------------------------
# Consumers with cross-step overlap (SCHED.OVERLAP; docs/design/hopper_backward.md, "Cross-step overlap").
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _ds_factor(p, qk, f_dst, sm_scale, z, hq, q_idx, kv_idx, score_bufs, SCORE_GRAD: gl.constexpr,
               FLAGS: gl.constexpr, P_REGS: gl.constexpr):
    """dS's factor from a step's P (fp32) and S = ``qk``: without a score_mod P itself; with one, f' (0 where P = 0
    unless FLAGS.GRAD_FINITE) either multiplied in (P_REGS: P · f' held in registers across dP) or stored to
    ``f_dst`` in its 16 bits for dS to read back (P returned). Every kernel of this family makes it so."""
    p_ds = p
    if SCORE_GRAD is not None:
        grad = SCORE_GRAD(qk, sm_scale, z, hq, q_idx, kv_idx, score_bufs)
        if not FLAGS.GRAD_FINITE:
            # masked scores (P = 0) take no gradient, even where f' is not finite there
            grad = gl.where(p > 0.0, grad, 0.0)
        if P_REGS:
            p_ds = p * grad
        else:
            f_dst.store(grad.to(f_dst.dtype))
    return p_ds


@gluon.jit
def _ds(dp, delta, p_ds, p_src, f_src, s_layout: gl.constexpr, HAS_GRAD: gl.constexpr, P_REGS: gl.constexpr):
    """dS = P (dP - DELTA) f' in fp32 from _ds_factor's result ``p_ds`` (P_REGS: P, or P · f', in registers, fp32 or
    16 bits), else from P and f' read back from ``p_src`` / ``f_src`` in 16 bits (held in registers across the dP
    wgmma they spilled at D = 128 with a mod)."""
    if P_REGS:
        ds = p_ds.to(gl.float32) * (dp - delta[:, None])
    else:
        ds = p_src.load(s_layout).to(gl.float32) * (dp - delta[:, None])
        if HAS_GRAD:
            ds = ds * f_src.load(s_layout).to(gl.float32)
    return ds


@gluon.jit
def _next_step(i, n_total, n_partial, cnt, z, hq, kv_blk, stats_h, rows_, tables, table_meta, TILE: gl.constexpr,
               SPARSE: gl.constexpr, M=0, PACK: gl.constexpr = gl.constexpr(DENSE)):
    """What the overlap's step i needs of step i + 1 before issuing its S: (has_next, its first query row, its LSE
    rows, its Q / dO stage). On a head's last step: this step's query tile (clamped) and this step's stage, whose S is
    read and dropped (nothing is waited for it)."""
    has_next = i + 1 < n_total
    m0_next = _q_tile_start(gl.minimum(i + 1, n_total - 1), n_partial, z, hq, kv_blk, tables, table_meta, TILE, SPARSE)
    lse_next = _lse_rows(stats_h, m0_next, rows_, M, PACK)
    st_next = (cnt + has_next.to(gl.int32)) % TILE.NUM_STAGES
    return has_next, m0_next, lse_next, st_next


@gluon.jit
def _next_step_at(i, n_total, cnt, m0_next, stats_h, rows_, TILE: gl.constexpr):
    """_next_step with the next step's first row ``m0_next`` already loaded (bwd_sm90_wide's overlap loads it a step
    ahead under a block mask): (has_next, its LSE rows, its stage)."""
    has_next = i + 1 < n_total
    lse_next = gl.load(stats_h + m0_next + rows_)
    st_next = (cnt + has_next.to(gl.int32)) % TILE.NUM_STAGES
    return has_next, lse_next, st_next


@gluon.jit
def _make_p(qk, lse, m0, is_partial, z, hq, n0, M, N, p_smem, sm_scale, qk_scale2, score_bufs, mask_bufs, slot,
            WG: gl.constexpr, SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr,
            FLAGS: gl.constexpr, BLOCK_M: gl.constexpr, HALF_N: gl.constexpr, P_REGS: gl.constexpr = False,
            CARRY16: gl.constexpr = False):
    """P (and f' with a score_mod) of the step whose S = ``qk`` (rows m0.., this warpgroup's keys) into P slot
    ``slot`` of p_smem (and f' into slot 2 + ``slot``), in 16 bits: what the dV wgmma and the dS of that step read.
    ``slot`` is the warpgroup, or (OVERLAP 1, the head's prologue) the warpgroup plus an opaque zero. Returns dS's
    factor for SCHED.P_REGS, held in registers until the step's dP is done: P, or P · f' (f' then not stored), in
    fp32, or in 16 bits with CARRY16."""
    s_layout: gl.constexpr = qk.type.layout
    rows_ = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    q_idx = gl.minimum(m0 + rows_, M - 1)[:, None]
    kv0 = n0 + WG * HALF_N
    kv_idx = gl.minimum(kv0 + _opaque(gl.arange(0, HALF_N, layout=gl.SliceLayout(0, s_layout))), N - 1)[None, :]
    p = _probabilities(qk, lse, z, hq, q_idx, kv_idx, is_partial, sm_scale, qk_scale2, score_bufs, mask_bufs,
                       SCORE_MOD, MASK_MOD, FLAGS)
    dtype: gl.constexpr = p_smem.dtype
    p_smem.index(slot).store(p.to(dtype))
    p_ds = _ds_factor(p, qk, p_smem.index(2 + slot), sm_scale, z, hq, q_idx, kv_idx, score_bufs, SCORE_GRAD, FLAGS,
                      P_REGS)
    if CARRY16:
        p_ds = p_ds.to(dtype)
    return p_ds


@gluon.jit
def _consumer_overlap_tile(WG: gl.constexpr, kv_tile, kvh, kv_bar, kv_phase, kv_buf, cnt, cta, descs, bars, smem,
                           sizes, tables, table_meta, rows, scalars, mod_bufs, SCORE_MOD: gl.constexpr,
                           SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr, TILE: gl.constexpr,
                           SPARSE: gl.constexpr, FLAGS: gl.constexpr, SCHED: gl.constexpr, PACK: gl.constexpr):
    """_consumer_tile's math (one (KV tile, K/V head), same arguments and result), software-pipelined over the steps of
    a query head: step j + 1's S = Q K^T is issued right behind step j's dS (its Q / dO stage waited then), ahead of
    step j's dK and dQ, and its P is made while they run (OVERLAP 1: under dK and dQ, with dQ's accumulator in
    flight beside S; OVERLAP 2, and D = 64 where dQ alternates between the warpgroups: under dK only, dQ issued
    after). A step begins with its P in shared memory and f' beside it, or with SCHED.P_REGS dS's factor (P, or P ·
    f') in registers, carried from the step that made it: the head's first step makes them in a prologue. On a head's
    last step the early S reads the step's own Q stage (nothing is waited for it, its result is dropped): one wasted S
    a head."""
    q_desc, do_desc, k_desc, v_desc, dq_desc = descs
    kv_ready, qdo_ready, qdo_empty, ds_ready = bars
    q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, dq_smem = smem
    Z, HQ, KZ, M, N = sizes
    stats_ptr, dq_acc_ptr, dk_ptr, dv_ptr, M_PAD, pack, out_descs = rows
    sm_scale, qk_scale2, ds_scale = scalars
    score_bufs, mask_bufs = mod_bufs
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    BLOCK_N: gl.constexpr = TILE.BLOCK_N
    HALF_N: gl.constexpr = TILE.HALF_N
    D: gl.constexpr = TILE.HEAD_D
    NUM_STAGES: gl.constexpr = TILE.NUM_STAGES
    DQ_N: gl.constexpr = TILE.DQ_N
    dtype: gl.constexpr = q_desc.dtype
    # dQ's wgmma beside the next step's S (OVERLAP 1) needs dQ every step (DQ_SPLIT)
    DQ_UNDER: gl.constexpr = SCHED.OVERLAP == 1 and TILE.DQ_SPLIT

    s_layout: gl.constexpr = _acc_layout(HALF_N)
    d_layout: gl.constexpr = _acc_layout(D)
    dq_layout: gl.constexpr = _acc_layout(DQ_N)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    n0 = kv_tile * BLOCK_N
    HKV = HQ // FLAGS.GQA_GROUP
    kz = kvh // HKV
    hkv = kvh % HKV
    kv_blk = n0 // SPARSE.SPARSE_KV
    q_row0 = 0   # as in _consumer_tile
    k_row0 = 0
    if PACK.VARLEN:
        q_row0, M, k_row0, N = _seq_span(pack, kz)
        M = gl.where(n0 < N, M, 0)

    p_mine = p_smem.index(WG)
    dk = gl.zeros([HALF_N, D], gl.float32, layout=d_layout)
    dv = gl.zeros([HALF_N, D], gl.float32, layout=d_layout)
    s_zero = gl.zeros([BLOCK_M, HALF_N], gl.float32, layout=s_layout)
    dq_zero = gl.zeros([BLOCK_M, DQ_N], gl.float32, layout=dq_layout)
    DQ_COL0: gl.constexpr = WG * DQ_N if TILE.DQ_SPLIT else 0

    _kv_landed(kv_bar, kv_phase, k_smem, kv_buf, n0, N, WG, TILE, PACK)
    cnt = gl.to_tensor(cnt)   # a loop-carried value (the default launch passes a literal 0)
    if SCHED.DETERMINISTIC:
        older = cta[0]   # as in _consumer_tile
        newer = cta[0]
    for hh in range((Z // KZ) * FLAGS.GQA_GROUP):
        z = kz + (hh // FLAGS.GQA_GROUP) * KZ
        hq = hkv * FLAGS.GQA_GROUP + hh % FLAGS.GQA_GROUP
        zh = hq if PACK.VARLEN else z * HQ + hq   # (as in _consumer_tile)
        if DQ_UNDER and SPARSE.HAS_BLOCK_MASK and MASK_MOD is None:
            # the tables' row of this KV block by an opaque zero: hoisted, qnb + 4 * kv_blk and fqnb + 4 * kv_blk
            # (64-bit) were kept on the stack across the step loop (softcap with block-sparse tables: 4 spill
            # instructions; with a mask_mod it moves causal's 4 to 6)
            n_partial, n_total = _q_tile_counts(z, hq, kv_blk + _opaque(0), M, tables, table_meta, TILE, SPARSE)
        else:
            n_partial, n_total = _q_tile_counts(z, hq, kv_blk, M, tables, table_meta, TILE, SPARSE)
        stats_h = stats_ptr + zh.to(gl.int64) * (2 * M_PAD) + q_row0   # LSE_P of the head; DELTA_P is M_PAD further
        m0 = n_total * 0
        if SCHED.P_REGS:
            p_keep = gl.zeros([BLOCK_M, HALF_N], dtype if SCHED.P_CARRY16 else gl.float32, layout=s_layout)
        if n_total > 0:
            # prologue: the head's first S, waited at once, and its P (the tables are read only for a listed tile:
            # with no full blocks their table is a placeholder)
            m0 = _q_tile_start(0, n_partial, z, hq, kv_blk, tables, table_meta, TILE, SPARSE)
            zero0 = _opaque(0) if TILE.VIEWS_PER_STEP or SCHED.PERSISTENT else 0
            k_rows0 = k_smem.index(zero0 + kv_buf if SCHED.PERSISTENT else zero0).reshape([BLOCK_N, D])
            k_t0 = k_rows0.slice(WG * HALF_N, HALF_N, dim=0).permute((1, 0))
            st0 = cnt % NUM_STAGES
            lse0 = _lse_rows(stats_h, m0, gl.arange(0, BLOCK_M, layout=row_layout), M, PACK)
            q_t0 = q_smem.index(st0).reshape([BLOCK_M, D])
            mbarrier.wait(qdo_ready.index(st0), (cnt // NUM_STAGES) & 1)
            s_tok = warpgroup_mma(q_t0, k_t0, s_zero, use_acc=False, is_async=True)
            qk0, _q0, _k0 = warpgroup_mma_wait(0, deps=[s_tok, q_t0, k_t0])
            # OVERLAP 1: P's slot by an opaque zero, so that its stmatrix addresses are the step loop's (held
            # there anyway) plus a per-head offset; indexed by the warpgroup alone, LLVM hoisted a second set of
            # them (4 a slot, warpgroup 0) that ptxas kept on the stack across the step loop
            p0 = _make_p(qk0, lse0, m0, 0 < n_partial, z, hq, n0, M, N, p_smem, sm_scale, qk_scale2, score_bufs,
                         mask_bufs, WG + zero0 if DQ_UNDER else WG, WG, SCORE_MOD, SCORE_GRAD, MASK_MOD, FLAGS,
                         BLOCK_M, HALF_N, SCHED.P_REGS, SCHED.P_CARRY16)
            if SCHED.P_REGS:
                p_keep = p0
        if SCHED.STATS_AHEAD:
            delta = gl.load(stats_h + M_PAD + m0 + gl.arange(0, BLOCK_M, layout=row_layout))   # (m0 0 if no step)
        for i in range(n_total):
            st = cnt % NUM_STAGES
            buf = cnt % 2
            if TILE.VIEWS_PER_STEP or SCHED.PERSISTENT:
                zero = _opaque(0)
            else:
                zero = 0
            kv_idx_buf = zero + kv_buf if SCHED.PERSISTENT else zero
            k_rows = k_smem.index(kv_idx_buf).reshape([BLOCK_N, D])
            v_rows = v_smem.index(kv_idx_buf).reshape([BLOCK_N, D])
            k_t = k_rows.slice(WG * HALF_N, HALF_N, dim=0).permute((1, 0))
            v_t = v_rows.slice(WG * HALF_N, HALF_N, dim=0).permute((1, 0))
            p_t = p_smem.index(WG + zero).permute((1, 0))
            k_dq = k_rows.slice(DQ_COL0, DQ_N, dim=1)
            row_off = zh.to(gl.int64) * M_PAD + q_row0 + m0
            rows_ = gl.arange(0, BLOCK_M, layout=row_layout)
            q_t = q_smem.index(st).reshape([BLOCK_M, D])
            do_t = do_smem.index(st).reshape([BLOCK_M, D])
            fence_async_shared()
            gl.thread_barrier()        # every thread's part of P is in shared memory before the wgmma reads it
            dp_tok = warpgroup_mma(do_t, v_t, s_zero, use_acc=False, is_async=True)
            dv_tok = warpgroup_mma(p_t, do_t, dv, is_async=True)
            if not SCHED.STATS_AHEAD:
                delta = gl.load(stats_h + M_PAD + m0 + rows_)
            dp, _do, _v = warpgroup_mma_wait(1, deps=[dp_tok, do_t, v_t])
            # P_REGS: P (times f'), made a step early, carried in registers
            ds = _ds(dp, delta, p_keep if SCHED.P_REGS else None, p_mine, p_smem.index(2 + WG), s_layout,
                     SCORE_GRAD is not None, SCHED.P_REGS)
            # OVERLAP 1: the dS buffer by buf + an opaque zero: by buf alone, LLVM made warpgroup 0's four dS
            # stmatrix addresses induction variables (+0x4000 a step), whose start ptxas reloaded every head
            ds_tile = ds_smem.index(buf + zero if DQ_UNDER else buf)
            ds_mine = ds_tile.slice(WG * HALF_N, HALF_N, dim=1)
            ds_mine.store(ds.to(dtype))
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(ds_ready.index(buf), count=1)
            # the next step: its query tile, LSE and Q stage, its S issued there (_next_step)
            has_next, m0_next, lse_next, st_next = _next_step(i, n_total, n_partial, cnt, z, hq, kv_blk, stats_h,
                                                              rows_, tables, table_meta, TILE, SPARSE, M, PACK)
            if SCHED.STATS_AHEAD:   # (as in _consumer_tile: its latency under this step's dK and dQ)
                delta_next = gl.load(stats_h + M_PAD + m0_next + rows_)
            q_next = q_smem.index(st_next).reshape([BLOCK_M, D])
            if has_next:
                mbarrier.wait(qdo_ready.index(st_next), ((cnt + 1) // NUM_STAGES) & 1)
            s_tok = warpgroup_mma(q_next, k_t, s_zero, use_acc=False, is_async=True)
            dk_tok = warpgroup_mma(ds_mine.permute((1, 0)), q_t, dk, is_async=True)
            if SCHED.DETERMINISTIC:   # earlier adds released and this one's counter loaded, under S and dK
                adds = True if TILE.DQ_SPLIT else cnt % 2 == WG
                flush = cnt % 2 == 1   # D >= 128: every second add (D64 releases each: _turn_ahead)
                sem, target, seen = newer, 0, 0
                if adds:
                    sem, target, seen = _turn_ahead(older, newer, flush, cta, zh, m0, kv_tile, kv_blk, z, hq, M_PAD,
                                                    table_meta, WG, TILE, SPARSE)
            if DQ_UNDER:
                mbarrier.wait(ds_ready.index(buf), (cnt // 2) & 1)
                dq_tok = warpgroup_mma(ds_tile, k_dq, dq_zero, use_acc=False, is_async=True)
                qk, dv, _p, _qn, _kt = warpgroup_mma_wait(2, deps=[s_tok, dv_tok, p_t, q_next, k_t])
            else:
                qk, dv, _p, _qn, _kt = warpgroup_mma_wait(1, deps=[s_tok, dv_tok, p_t, q_next, k_t])
            if has_next:
                p_next = _make_p(qk, lse_next, m0_next, i + 1 < n_partial, z, hq, n0, M, N, p_smem, sm_scale,
                                 qk_scale2, score_bufs, mask_bufs, WG, WG, SCORE_MOD, SCORE_GRAD, MASK_MOD, FLAGS,
                                 BLOCK_M, HALF_N, SCHED.P_REGS, SCHED.P_CARRY16)
                if SCHED.P_REGS:
                    p_keep = p_next
            if DQ_UNDER:
                dk, dq, _ds, _q2, _a, _b = warpgroup_mma_wait(0, deps=[dk_tok, dq_tok, ds_mine, q_t, ds_tile,
                                                                       k_dq])
                mbarrier.arrive(qdo_empty.index(st), count=1)
                if SCHED.DETERMINISTIC:
                    added = _add_dq_in_turn(dq, dq_desc, dq_smem, zh, m0, sem, target, seen, WG, TILE, SCHED)
                    older, newer = _held_turns(older, newer, added, flush, cta, TILE)
                else:
                    _add_dq(dq, dq_acc_ptr, dq_desc, dq_smem, zh, q_row0 + m0, row_off, WG, TILE, SCHED)
            else:
                dk, _ds, _q2 = warpgroup_mma_wait(0, deps=[dk_tok, ds_mine, q_t])
                mbarrier.arrive(qdo_empty.index(st), count=1)
                if TILE.DQ_SPLIT:
                    mine = True
                else:
                    mine = cnt % 2 == WG
                if mine:
                    mbarrier.wait(ds_ready.index(buf), (cnt // 2) & 1)
                    dq_tok = warpgroup_mma(ds_tile, k_dq, dq_zero, use_acc=False, is_async=True)
                    dq, _a, _b = warpgroup_mma_wait(0, deps=[dq_tok, ds_tile, k_dq])
                    if SCHED.DETERMINISTIC:
                        added = _add_dq_in_turn(dq, dq_desc, dq_smem, zh, m0, sem, target, seen, WG, TILE, SCHED)
                        older, newer = _held_turns(older, newer, added, flush, cta, TILE)
                    else:
                        _add_dq(dq, dq_acc_ptr, dq_desc, dq_smem, zh, q_row0 + m0, row_off, WG, TILE, SCHED)
            m0 = m0_next
            if SCHED.STATS_AHEAD:
                delta = delta_next
            cnt += 1
    if SCHED.DETERMINISTIC:
        _last_release(older, newer, TILE)
    if SCHED.PERSISTENT:
        # kv_empty: every wgmma reading K and V retired (the head's last, wasted S too: waited in its step)
        mbarrier.arrive(cta[1].index(kv_buf), count=1)

    if DQ_UNDER:
        # the rows and columns of the dK / dV store made here from a fresh %laneid (the arange's thread bits
        # replaced; its register bits fold to constants): from the aranges alone, LLVM reused the loops' key
        # columns and LSE rows (9 values), computed at the entry, which ptxas kept on the stack across the loops
        lane = _lane_id()
        rows_e = (gl.arange(0, HALF_N, layout=gl.SliceLayout(1, d_layout)) & ~7) | ((lane >> 2) & 7)
        cols_e = (gl.arange(0, D, layout=gl.SliceLayout(0, d_layout)) & ~6) | ((lane * 2) & 6)
        out_rows = n0 + WG * HALF_N + rows_e[:, None]
        out_cols = cols_e[None, :]
    else:
        out_rows = n0 + WG * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, d_layout))[:, None]
        out_cols = gl.arange(0, D, layout=gl.SliceLayout(0, d_layout))[None, :]
    if SCHED.DKDV_TMA:
        _store_dkdv_tma(dk, dv, dq_smem.index(WG), out_descs[0], out_descs[1], kz, hkv, n0 + WG * HALF_N, 0, 0,
                        ds_scale)
    else:
        _store_dkdv(dk, dv, out_rows, out_cols, dk_ptr, dv_ptr, kz, hkv, HKV, N, k_row0, ds_scale, TILE, PACK)
    return cnt


@gluon.jit
def _consumer_wg0(descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, cta,
                  SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr, TILE: gl.constexpr,
                  SPARSE: gl.constexpr, FLAGS: gl.constexpr, SCHED: gl.constexpr, PACK: gl.constexpr):
    _consumer(0, descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, cta, SCORE_MOD, SCORE_GRAD,
              MASK_MOD, TILE, SPARSE, FLAGS, SCHED, PACK)


@gluon.jit
def _consumer_wg1(descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, cta,
                  SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr, TILE: gl.constexpr,
                  SPARSE: gl.constexpr, FLAGS: gl.constexpr, SCHED: gl.constexpr, PACK: gl.constexpr):
    _consumer(1, descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, cta, SCORE_MOD, SCORE_GRAD,
              MASK_MOD, TILE, SPARSE, FLAGS, SCHED, PACK)


@gluon.jit
def _producer_entry(descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, cta,
                    SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr,
                    TILE: gl.constexpr, SPARSE: gl.constexpr, FLAGS: gl.constexpr, SCHED: gl.constexpr,
                    PACK: gl.constexpr = gl.constexpr(DENSE)):
    # (bwd_sm90_m128 enters here too, dense: its rows bundle has no packed offsets)
    _producer(descs, bars, smem, sizes, tables, table_meta, cta, rows[5] if PACK.VARLEN else (), TILE, SPARSE, FLAGS,
              SCHED, PACK)


# Sizes that follow the sequence lengths: no divisibility / equal-to-1 specialization (one compile per site).
_RUNTIME_SIZES = ["Z", "KZ", "M", "N", "M_PAD", "NUM_KV_BLKS", "NUM_Q_BLKS"]


@gluon.jit(do_not_specialize=_RUNTIME_SIZES)
def fa3_bwd_sm90_kernel(
    q_desc, do_desc, k_desc, v_desc, dq_desc,       # dq_desc: DQ_ACC [Z * HQ, M_PAD, D] with SCHED.DQ_TMA, else None
    stats_ptr, dq_acc_ptr, dk_ptr, dv_ptr,
    dk_desc, dv_desc,        # SCHED.DKDV_TMA: dK, dV [KZ, HKV, N, D] by [1, 1, 64, D] boxes; else None
    qnb_ptr, qidx_ptr, fqnb_ptr, fqidx_ptr,
    score_bufs, mask_bufs,
    Z, HQ, KZ, M, N, M_PAD, SZ, SH, NUM_KV_BLKS, NUM_Q_BLKS,
    sm_scale, qk_scale2, ds_scale,
    cta_args,                # SCHED.LPT_ORDER: (the CTA order, int32 [#KV tiles * KZ * HKV],); SCHED.PERSISTENT:
                             # (tile offsets [#CTAs + 1], tiles), int32; () otherwise (no kernel parameter)
    pack_args,               # PACK.VARLEN: (CU_Q, CU_K, TILES) int32, and WINDOW (int) with SPARSE.WINDOW_WALK;
                             # () otherwise (no kernel parameter)
    SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr,   # @gluon.jit mods or None
    TILE: gl.constexpr,      # BwdTile
    SPARSE: gl.constexpr,    # BwdSparsity
    FLAGS: gl.constexpr,     # BwdFlags
    SCHED: gl.constexpr,     # BwdSchedule
    PACK: gl.constexpr = DENSE,   # BwdPacking
):
    NUM_STAGES: gl.constexpr = TILE.NUM_STAGES
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    BLOCK_N: gl.constexpr = TILE.BLOCK_N
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NUM_STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [NUM_STAGES] + do_desc.block_type.shape, do_desc.layout)
    # K and V as one-element arrays: the consumers index them (VIEWS_PER_STEP)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [SCHED.KV_BUFS] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [SCHED.KV_BUFS] + v_desc.block_type.shape, v_desc.layout)
    HALF_N: gl.constexpr = TILE.HALF_N
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF_N], q_desc.dtype)
    # P of each warpgroup; with a score_mod also f' (both parked in shared memory across the dP wgmma)
    P_SLOTS: gl.constexpr = 4 if SCORE_GRAD is not None else 2
    p_smem = gl.allocate_shared_memory(q_desc.dtype, [P_SLOTS, BLOCK_M, HALF_N], p_layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], q_desc.dtype)
    ds_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_M, BLOCK_N], ds_layout)
    if SCHED.DQ_TMA:   # one fp32 dQ staging tile per consumer warpgroup
        dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
        dq_tma_desc = dq_desc
    else:              # placeholders (never read): a role's argument tuple holds no None
        dq_smem = ds_smem
        dq_tma_desc = q_desc

    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    qdo_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(qdo_ready.index(s), count=1)
        mbarrier.init(qdo_empty.index(s), count=2)
    for b in gl.static_range(2):
        mbarrier.init(ds_ready.index(b), count=2)
    if SCHED.PERSISTENT:   # per K / V buffer: kv_empty (count 2: both consumer warpgroups are done with its K and
        # V), kv_full (count 1, TMA tx: they landed; kv_ready is unused)
        kv_empty = gl.allocate_shared_memory(gl.int64, [SCHED.KV_BUFS, 1], mbarrier.MBarrierLayout())
        kv_full = gl.allocate_shared_memory(gl.int64, [SCHED.KV_BUFS, 1], mbarrier.MBarrierLayout())
        KV_BUFS: gl.constexpr = SCHED.KV_BUFS
        for b in gl.static_range(KV_BUFS):
            mbarrier.init(kv_empty.index(b), count=2)
            mbarrier.init(kv_full.index(b), count=1)
        cta = (cta_args, kv_empty, kv_full)
    else:
        cta = cta_args

    descs = (q_desc, do_desc, k_desc, v_desc, dq_tma_desc)
    bars = (kv_ready, qdo_ready, qdo_empty, ds_ready)
    smem = (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, dq_smem)
    sizes = (Z, HQ, KZ, M, N)
    tables = (qnb_ptr, qidx_ptr, fqnb_ptr, fqidx_ptr)
    table_meta = (SZ, SH, NUM_KV_BLKS, NUM_Q_BLKS, pack_args[3] if SPARSE.WINDOW_WALK else 0)
    rows = (stats_ptr, dq_acc_ptr, dk_ptr, dv_ptr, M_PAD, pack_args, (dk_desc, dv_desc))
    scalars = (sm_scale, qk_scale2, ds_scale)
    mod_bufs = (score_bufs, mask_bufs)
    # every role gets the same arguments (the producer's entry drops what it does not read)
    gl.warp_specialize([
        (_consumer_wg0, (descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, cta,
                         SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE, SPARSE, FLAGS, SCHED, PACK)),
        (_consumer_wg1, (descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, cta,
                         SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE, SPARSE, FLAGS, SCHED, PACK)),
        (_producer_entry, (descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, cta,
                           SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE, SPARSE, FLAGS, SCHED, PACK)),
    ], [4, 1], [FLAGS.CONSUMER_REGS, FLAGS.PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# Memory-bound passes (plain Triton): DELTA and the zeroed dQ accumulator before, dQ after.
# ----------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["M", "M_PAD"])
def bwd_sm90_preprocess_kernel(O, DO, LSE, DLSE, STATS, DQ_ACC, o_strides, do_strides, HQ, M, M_PAD,
                               HAS_DLSE: tl.constexpr, BLOCK: tl.constexpr, HEAD_D: tl.constexpr,
                               HEAD_DV: tl.constexpr = None, HEAD_D_POW2: tl.constexpr = None, DQ_SEMS=None):
    """STATS (LSE_P, DELTA_P) for rows [BLOCK * pid, ...) of head z * HQ + hq (up to M_PAD), and zeros into the
    same rows of DQ_ACC. HEAD_DV: O's and dO's columns (default HEAD_D); HEAD_D_POW2: HEAD_D rounded up to a
    power of two (DQ_ACC's columns, and O's without HEAD_DV, are masked to HEAD_D), when HEAD_D is not one (80, 96,
    192). DQ_SEMS (deterministic dQ; BLOCK the main kernel's 64-row step): the rows' counters zeroed."""
    pid = tl.program_id(0)
    zh = tl.program_id(1)
    z = zh // HQ
    hq = zh % HQ
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    in_rows = rows < M
    if HEAD_DV is not None:
        cols = tl.arange(0, HEAD_DV)
        in_o = in_rows[:, None]
    elif HEAD_D_POW2 is not None:   # O's columns are Q's, not a power of two (80, 96)
        cols = tl.arange(0, HEAD_D_POW2)
        in_o = in_rows[:, None] & (cols < HEAD_D)[None, :]
    else:
        cols = tl.arange(0, HEAD_D)
        in_o = in_rows[:, None]
    o = tl.load(O + z * o_strides[0] + hq * o_strides[1] + rows[:, None] * o_strides[2] + cols[None, :],
                mask=in_o, other=0.0)
    do = tl.load(DO + z * do_strides[0] + hq * do_strides[1] + rows[:, None] * do_strides[2] + cols[None, :],
                 mask=in_o, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        # sum LSE2 * dLSE2 adds dLSE2 * log2(e) * P to dS: the same as lowering DELTA by dLSE2 * log2(e)
        delta -= tl.load(DLSE + zh * M + rows, mask=in_rows, other=0.0) * 1.4426950408889634
    lse = tl.load(LSE + zh * M + rows, mask=in_rows, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)   # a fully masked row: P = 0, no gradient
    padded = zh.to(tl.int64) * M_PAD + rows
    in_pad = rows < M_PAD
    tl.store(STATS + padded + zh * M_PAD, lse, mask=in_pad)
    tl.store(STATS + padded + (zh + 1) * M_PAD, delta, mask=in_pad)
    if HEAD_D_POW2 is None:
        tl.store(DQ_ACC + padded[:, None] * HEAD_D + cols[None, :], tl.zeros([BLOCK, HEAD_D], tl.float32),
                 mask=in_pad[:, None])
    else:
        dcols = tl.arange(0, HEAD_D_POW2)
        tl.store(DQ_ACC + padded[:, None] * HEAD_D + dcols[None, :], tl.zeros([BLOCK, HEAD_D_POW2], tl.float32),
                 mask=in_pad[:, None] & (dcols < HEAD_D)[None, :])
    if DQ_SEMS is not None:
        tl.store(DQ_SEMS + 1 + (zh.to(tl.int64) * (M_PAD // BLOCK) + pid) * _SEM_SLOTS + tl.arange(0, _SEM_SLOTS),
                 tl.zeros([_SEM_SLOTS], tl.int32))


@triton.jit(do_not_specialize=["NUM_Q_BLKS", "NUM_KV_BLKS", "IDX_COLS"])
def bwd_sm90_dq_listed_kernel(Q_NUM, Q_IDX, FULL_Q_NUM, FULL_Q_IDX, DQ_RANK, NUM_Q_BLKS, NUM_KV_BLKS, IDX_COLS,
                              HAS_FULL: tl.constexpr, Q_BLKS_POW2: tl.constexpr):
    """DQ_RANK's column of one KV block (program: ((sz * SH + sh) * NUM_KV_BLKS + KV block)) set to 1 where the
    transposed tables the main kernel walks list the query block for it (partial or full), 0 elsewhere: the first of
    the two launches that make the deterministic dQ's order. Q_NUM [.., NUM_KV_BLKS] and Q_IDX [.., NUM_KV_BLKS,
    IDX_COLS] (and the full ones) int32 contiguous; DQ_RANK [.., NUM_Q_BLKS, NUM_KV_BLKS]."""
    col = tl.program_id(0)
    head = col // NUM_KV_BLKS
    kv_blk = col % NUM_KV_BLKS
    q_blks = tl.arange(0, Q_BLKS_POW2)
    column = DQ_RANK + (head.to(tl.int64) * NUM_Q_BLKS + q_blks) * NUM_KV_BLKS + kv_blk
    tl.store(column, tl.zeros([Q_BLKS_POW2], tl.int32), mask=q_blks < NUM_Q_BLKS)
    tl.debug_barrier()   # the zeros before the ones (other threads of this program may write the same entries)
    _mark_listed(Q_NUM, Q_IDX, col, DQ_RANK, head, kv_blk, q_blks, NUM_Q_BLKS, NUM_KV_BLKS, IDX_COLS)
    if HAS_FULL:
        _mark_listed(FULL_Q_NUM, FULL_Q_IDX, col, DQ_RANK, head, kv_blk, q_blks, NUM_Q_BLKS, NUM_KV_BLKS, IDX_COLS)


@triton.jit
def _mark_listed(NUM, IDX, col, DQ_RANK, head, kv_blk, q_blks, NUM_Q_BLKS, NUM_KV_BLKS, IDX_COLS):
    """1 into DQ_RANK's column of (head, kv_blk) at each query block that the table row ``col`` of NUM / IDX lists
    (bwd_sm90_dq_listed_kernel: its partial, then its full blocks)."""
    n = tl.load(NUM + col)
    listed = tl.load(IDX + col.to(tl.int64) * IDX_COLS + q_blks, mask=q_blks < n, other=0)
    tl.store(DQ_RANK + (head.to(tl.int64) * NUM_Q_BLKS + listed) * NUM_KV_BLKS + kv_blk,
             tl.full(q_blks.shape, 1, tl.int32), mask=q_blks < n)


@triton.jit(do_not_specialize=["NUM_KV_BLKS"])
def bwd_sm90_dq_rank_kernel(DQ_RANK, NUM_KV_BLKS, KV_BLKS_POW2: tl.constexpr):
    """DQ_RANK's row of one query block (program: (sz * SH + sh) * NUM_Q_BLKS + query block), the 0 / 1 marks of
    bwd_sm90_dq_listed_kernel, turned into their exclusive running count: for each KV block, how many KV blocks before
    it add into the query block, the order of the deterministic dQ adds."""
    row = DQ_RANK + tl.program_id(0).to(tl.int64) * NUM_KV_BLKS
    kv_blks = tl.arange(0, KV_BLKS_POW2)
    listed = tl.load(row + kv_blks, mask=kv_blks < NUM_KV_BLKS, other=0)
    tl.store(row + kv_blks, tl.cumsum(listed, 0) - listed, mask=kv_blks < NUM_KV_BLKS)


@triton.jit(do_not_specialize=["M", "M_PAD"])
def bwd_sm90_dq_convert_kernel(DQ_ACC, DQ, dq_strides, HQ, M, M_PAD, ds_scale,
                               BLOCK: tl.constexpr, HEAD_D: tl.constexpr, HEAD_D_POW2: tl.constexpr = None):
    """dQ = DQ_ACC * ds_scale in dQ's dtype, rows [BLOCK * pid, ...) of head z * HQ + hq (HEAD_D_POW2: as in
    the preprocess kernel)."""
    pid = tl.program_id(0)
    zh = tl.program_id(1)
    z = zh // HQ
    hq = zh % HQ
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    if HEAD_D_POW2 is None:
        cols = tl.arange(0, HEAD_D)
        in_rows = (rows < M)[:, None]
    else:
        cols = tl.arange(0, HEAD_D_POW2)
        in_rows = (rows < M)[:, None] & (cols < HEAD_D)[None, :]
    acc = tl.load(DQ_ACC + (zh.to(tl.int64) * M_PAD + rows)[:, None] * HEAD_D + cols[None, :], mask=in_rows)
    ptrs = DQ + z * dq_strides[0] + hq * dq_strides[1] + rows[:, None] * dq_strides[2] + cols[None, :]
    tl.store(ptrs, (acc * ds_scale).to(DQ.dtype.element_ty), mask=in_rows)


@triton.jit(do_not_specialize=["M", "M_PAD"])
def bwd_sm90_dq_convert_frag_kernel(DQ_ACC, DQ, dq_strides, HQ, M, M_PAD, ds_scale, HEAD_D: tl.constexpr):
    """dQ = DQ_ACC * ds_scale in dQ's dtype for one 64 x 64 block (program (query tile * chunks + chunk, z * HQ + hq))
    of a DQ_ACC kept in the wgmma fragments' order (BwdSchedule.DQ_FRAG, WideTile.DQ_FRAG: _dq_fragments): element
    (r, c) of the block sits at (c // 8) * 512 + thread(r, c) * 4 + ((r // 8) % 2) * 2 + c % 2, thread(r, c) =
    (r // 16) * 32 + (r % 8) * 4 + (c // 2) % 4 (warp, then the lane of the m64nNk16 accumulator); the block's 4096
    floats are contiguous."""
    NCB: tl.constexpr = HEAD_D // 64
    pid = tl.program_id(0)
    zh = tl.program_id(1)
    z = zh // HQ
    hq = zh % HQ
    mt = pid // NCB
    cb = pid % NCB
    r = tl.arange(0, 64)[:, None]
    c = tl.arange(0, 64)[None, :]
    frag = (c // 8) * 512 + ((r // 16) * 32 + (r % 8) * 4 + (c // 2) % 4) * 4 + ((r // 8) % 2) * 2 + c % 2
    block = (zh.to(tl.int64) * M_PAD * HEAD_D) + (mt * NCB + cb) * 4096
    acc = tl.load(DQ_ACC + block + frag)
    rows = mt * 64 + r
    ptrs = DQ + z * dq_strides[0] + hq * dq_strides[1] + rows * dq_strides[2] + cb * 64 + c
    tl.store(ptrs, (acc * ds_scale).to(DQ.dtype.element_ty), mask=rows < M)

