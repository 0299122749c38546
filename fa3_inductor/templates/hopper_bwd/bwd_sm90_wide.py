"""The sm90 backward for wide head dims (D / DV = 256 / 256 and 192 / 128; 160 and 192 in the 256 tiles, whose columns
past D TMA fills with zeros): dK and dV split along the head dim.

bwd_sm90.py's kernel gives each consumer warpgroup 64 keys and their whole dK, dV rows: D + DV fp32 registers a
thread across the loop over 2 warpgroups, 256 at D = 256, over the 240 a thread has (docs/design/hopper_backward.md,
"Wide head dims"). Here a CTA owns 64 keys, both warpgroups hold all 64 key rows, and the head-dim columns of
dK, dV and the dQ tile are divided between them; the score tile is divided by keys (32 each). Same launches,
scratch, conventions and mods as bwd_sm90.py (its notation applies; what differs is below).

Notation (beyond bwd_sm90.py's)
--------
  BLOCK_N = 64               keys of one CTA; warpgroup w computes S, P, dP, dS for keys [32w, 32w + 32) (KEYS_WG)
  BLOCK_M = 64               query rows of one step
  SPLIT_QK, LO, HI           D = 192: Q and K sit in two shared tiles of LO = 128 and HI = 64 columns (a 192-column
                             tile is no power of two), S = Q_lo K_lo^T + Q_hi K_hi^T. D = 256: one 256-column tile
                             each (LO = HI = 256, the "hi" views are the same tile), sliced at column 128.
                             V and dO are one DV-column tile.
  warpgroup w's columns      dK: [0, 128) at w = 0, [128, D) at w = 1 (Q tile w at 192), dK = dS^T Q[:, those]
                             dV: [w * DV / 2, (w + 1) * DV / 2)
                             dQ: dK's columns at D = 256; the other warpgroup's at 192 (K tile 1 - w: balances
                             the work, below), in 64-column chunks (one [64, 64] fp32 wgmma, staging tile and TMA
                             reduce-add each)
  DQ_BUFS                    fp32 staging tiles a warpgroup, used in turn: with 2, a chunk is staged while the
                             previous chunk's reduce-add still reads its tile (192 / 128: 1.25x the step)
  DQ_FRAG                    a chunk is staged as its fragments (bwd_sm90._dq_fragments: one 16-byte store a
                             thread and n8 block, no bank conflict) and DQ_ACC's 64 x 64 blocks hold that order
  OVERLAP                    _head_overlap: step j + 1's S issued behind step j's dS, its P made under dK and dQ
                             (under a block mask, step j + 1's first row is loaded at the top of step j)
  SPARSE.CAUSAL_WALK         an exactly causal mask_mod: no tables; a 64-key CTA's query tiles from its diagonal on,
                             the 64 x 64 diagonal tile with the mask, the rest without
  SPARSE.WINDOW_WALK         a causal window (packed sequences): a 64-key CTA's query tiles from its diagonal to the
                             window's far edge, those two cut with the mask (bwd_sm90._q_tile_counts)
  SPARSE.CAUSAL_SKIP         another mask_mod that keeps only q >= kv (causal documents, windows) under a block mask of
                             128-row blocks: a 64-key CTA in the second half of its diagonal block would run the
                             block's first query tile with every score masked; the steps start after such a tile
                             (_causal_first)

  PERSISTENT                 one CTA an SM walking a host-made list of (KV tile, K/V head) tiles (bwd_sm90's
                             SCHED.PERSISTENT with one K / V buffer): the next tile's K and V load while this one's dK
                             and dV are stored, and no CTA starts or drains between tiles
  PACK.VARLEN                bwd_sm90's "Packed sequences" over 64-key virtual tiles (the table's BLOCK_N is 64): each
                             warpgroup zeroes its 32 keys past the sequence's end in both K tiles (_clear_keys_past);
                             dQ in the tiled order (sequence starts are no multiple of 64: DQ_FRAG off)

Per step (64 query rows x 64 keys), warpgroup w:

  S_w  = Q K[keys_w]^T                [64 q, 32 keys]  P_w = exp2(...) -> P[:, keys_w] in shared memory, p_ready
  dP_w = dO V[keys_w]^T               [64 q, 32 keys]  issued before waiting p_ready (the other half of P)
  dV_w += P^T dO[:, cols_w]           [64 keys, DV/2]  A = the whole P tile (both warpgroups' halves)
  dS_w = P_w (dP_w - DELTA) f'        -> dS[:, keys_w] in shared memory, ds_ready
  dK_w += dS^T Q[:, dK cols_w]        [64 keys, 128 or D - 128]   (whole dS tile)
  dQ[:, dq cols_w] = dS K[:, dq cols_w]                     (whole dS tile), TMA reduce-add into DQ_ACC

Work per step in 64 x 64 x 64 wgmma units (D = 256: S 4, dP 4, dV 4, dK 4, dQ 4: 10 a warpgroup; 192 / 128:
S 3, dP 2, dV 2, dK 3, dQ 3 = 13, warpgroup 0 dK 2 + dQ 1 + dV 1 + 2.5 = 6.5, warpgroup 1 dK 1 + dQ 2 + dV 1 +
2.5 = 6.5: hence dQ from the other K tile at 192). Registers a consumer thread across the loop: dK + dV =
(128 + 128) / 2 = 128 at D = 256; 64 + 32 = 96 (w = 0) and 32 + 32 = 64 (w = 1) at 192 / 128; per step S / dP
16 and one dQ chunk 32.

Barriers (shared memory):
  kv_ready        (count 1, TMA tx)  K (both tiles) and V landed                    producer -> consumers
  kv_empty        (count 2)          PERSISTENT: every wgmma reading the tile's K, V retired   consumers -> producer
  qdo_ready[s]    (count 1, TMA tx)  ring stage s holds this step's Q and dO        producer -> consumers
  qdo_empty[s]    (count 2)          both warpgroups' wgmmas reading stage s retired consumers -> producer
  p_ready[b]      (count 2)          both halves of P are in P buffer b (step % 2)  consumer <-> consumer
  ds_ready[b]     (count 2)          both halves of dS are in dS buffer b           consumer <-> consumer
  Two P and two dS buffers suffice: a warpgroup writes buffer b at step j + 2 only after waiting p_ready of step
  j + 1, which the other warpgroup signals after its step-j wgmmas (dV, dK, dQ: every reader of P_j and dS_j)
  retired.

Registers (the step loop's wgmma views are rebuilt per step, as bwd_sm90's VIEWS_PER_STEP, and so is the ring
stage's: with one stage its index is a constant, and the Q / dO descriptors of all 16 k-steps of S and dP were
hoisted into ~40 vector registers: D = 256 causal spilled 46 instructions, none now).

Compile-time parameters: TILE WideTile (below); SPARSE, FLAGS, PACK as in bwd_sm90.py. dQ is always added by TMA
reduce-add (bwd_sm90's SCHED.DQ_TMA).
"""
from __future__ import annotations

from dataclasses import dataclass

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .bwd_sm90 import (DENSE, _acc_layout, _cta_tiles, _dq_turn, _ds, _ds_factor, _frag_reduce_add, _ld_acquire,
                       _lse_rows, _next_step, _ordered_coords, _release_turn, _release_turns, _wait_turn,
                       _next_step_at, _opaque, _packed_coords, _persistent_tile, _probabilities, _q_tile_counts,
                       _q_tile_start, _seq_span, _store_dkdv_tma, _tma_reduce_add, _zero_keys_past)


@dataclass(frozen=True)
class WideTile:
    """Tiles of the wide-head-dim kernel (module docstring)."""
    HEAD_D: int        # D of q, k: 256 or 192
    HEAD_DV: int       # DV of v: 256 or 128
    NUM_STAGES: int    # depth of the Q / dO ring
    HEAD_D_IN: int = 0   # the tensors' D = DV when less (160, 192 in the 256 tiles, TMA zero-filled); 0: HEAD_D
    P_REGS: bool = False   # dS from P (times f') held in fp32 registers across dP, not read back from shared memory
    DQ_BUFS: int = 1       # dQ staging tiles a warpgroup: 2 lets a chunk be staged while the last reduce-add reads
    OVERLAP: bool = False  # step j + 1's S issued behind step j's dS, its P made while dK and dQ run (P_REGS, 2 stages)
    DQ_FRAG: bool = False  # dQ chunks staged and added in the wgmma fragments' order (DQ_ACC's 64 x 64 blocks permuted)
    PERSISTENT: bool = False   # #SMs CTAs, each walking its list of (KV tile, K/V head) tiles (cta = (offsets, tiles),
                               # host._persistent_schedule / _shape_schedule); the next tile's K / V load under this
                               # one's dK / dV stores
    DKDV_TMA: bool = False     # dense, unpadded: a warpgroup's dK, then dV columns written through its first dQ
                               # staging tile (16 KB) and TMA-stored (else gl.store from the accumulators)
    DETERMINISTIC: bool = False   # dQ's adds in KV-tile order (bwd_sm90.py, "Deterministic dQ"): the grid read in
                                  # its launch order (cta_args = (DQ_SEMS, DQ_RANK, GROUP)), a counter per 64-column
                                  # chunk; not with PERSISTENT, packed sequences or the causal skip

    @property
    def D_MEM(self) -> int:
        """Columns of Q, K, dK and DQ_ACC in memory: where the stores and dQ chunks stop, and the rows' stride."""
        return self.HEAD_D_IN or self.HEAD_D

    @property
    def DV_MEM(self) -> int:
        """Columns of V, dO and dV in memory."""
        return self.HEAD_D_IN or self.HEAD_DV

    @property
    def BLOCK_M(self) -> int:
        return 64

    @property
    def BLOCK_N(self) -> int:
        return 64

    @property
    def KEYS_WG(self) -> int:
        return 32

    @property
    def SPLIT_QK(self) -> bool:
        """Q and K in two shared tiles of 128 + (D - 128) columns (D = 192 is no power of two); at D = 256 one
        tile each, sliced at column 128 (fewer shared-memory bases to keep in the step loop)."""
        return self.HEAD_D != 256

    @property
    def LO(self) -> int:
        return 128 if self.SPLIT_QK else self.HEAD_D

    @property
    def HI(self) -> int:
        return self.HEAD_D - 128 if self.SPLIT_QK else self.LO

    @property
    def DV_WG(self) -> int:
        return self.HEAD_DV // 2

    @property
    def DQ_SWAP(self) -> bool:
        """dQ columns from the other warpgroup's K tile (192 / 128: balances the work, module docstring)."""
        return self.HEAD_D != 256

    @property
    def DQ_N(self) -> int:
        """Columns of one dQ chunk (wgmma, staging tile, TMA reduce-add box)."""
        return 64

    @property
    def DK_COLS(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(first column, columns) of dK of warpgroup 0 and 1: Q tile w's columns."""
        return (0, 128), (128, self.HEAD_D - 128)

    @property
    def DQ_COLS(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(first column, columns) of dQ of warpgroup 0 and 1: dK's, or the other warpgroup's (DQ_SWAP)."""
        return self.DK_COLS[::-1] if self.DQ_SWAP else self.DK_COLS

    @property
    def DQ_CHUNKS(self) -> tuple[int, int]:
        """dQ chunks of warpgroup 0 and 1 (its columns' 64-column chunks that start before D_MEM: a chunk wholly
        in the zero columns of a padded D is skipped)."""
        return tuple(sum(c0 + c * self.DQ_N < self.D_MEM for c in range(w // self.DQ_N)) for c0, w in self.DQ_COLS)


@gluon.jit
def _causal_first(n_partial, z, hq, kv_blk, n0, tables, table_meta, TILE: gl.constexpr, SPARSE: gl.constexpr):
    """The head's first step: 1 if SPARSE.CAUSAL_SKIP and the first listed query tile lies wholly above this CTA's
    keys (every score q < kv: masked, nothing to add), else 0. Producer and consumers start their walks there."""
    first = n_partial * 0
    if SPARSE.CAUSAL_SKIP:
        if n_partial > 0:
            m0 = _q_tile_start(0, n_partial, z, hq, kv_blk, tables, table_meta, TILE, SPARSE)
            first = (m0 + TILE.BLOCK_M <= n0).to(gl.int32)
    return first


# ----------------------------------------------------------------------------------------------
# Producer: one warp issuing TMA (the query steps as bwd_sm90._producer walks them).
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _grid_tile(cta, TILE: gl.constexpr):
    """(KV tile, kz * HKV + hkv) of a grid CTA: its coordinates, or TILE.DETERMINISTIC's launch order."""
    if TILE.DETERMINISTIC:
        kv_tile, kvh = _ordered_coords(cta[0][2])
    else:
        kv_tile = gl.program_id(0)
        kvh = gl.program_id(1)
    return kv_tile, kvh


@gluon.jit
def _producer(descs, bars, smem, sizes, tables, table_meta, pack, cta, TILE: gl.constexpr, SPARSE: gl.constexpr,
              FLAGS: gl.constexpr, PACK: gl.constexpr):
    """K and V of this CTA's keys, then its query steps' Q and dO. PACK.VARLEN (bwd_sm90's "Packed sequences"): the
    tile table's KV tile of one sequence, rows from its offsets, nothing for a tile past its keys. TILE.PERSISTENT:
    the CTA's tiles in turn, each tile's K / V once both warpgroups are done with the last one's (kv_empty)."""
    Z, HQ, KZ, M, N = sizes
    HKV = HQ // FLAGS.GQA_GROUP
    if TILE.PERSISTENT:
        first, n_my = _cta_tiles(cta)
        cnt = 0
        for t in range(n_my):
            kv_tile, kvh = _persistent_tile(cta, first + t, N, TILE)
            mbarrier.wait(cta[1], (t & 1) ^ 1)
            cnt = _producer_tile(kv_tile * TILE.BLOCK_N, kvh, kvh // HKV, 0, 0, M, cnt, descs, bars, smem, sizes,
                                 tables, table_meta, TILE, SPARSE, FLAGS)
    elif PACK.VARLEN:
        kv_tile, kvh = _packed_coords(pack, HKV, TILE)
        n0 = kv_tile * TILE.BLOCK_N
        q_row0, M, k_row0, N = _seq_span(pack, kvh // HKV)
        if n0 < N:
            _producer_tile(n0, kvh, 0, q_row0, k_row0, M, n0 * 0, descs, bars, smem, sizes, tables, table_meta, TILE,
                           SPARSE, FLAGS)
    else:
        kv_tile, kvh = _grid_tile(cta, TILE)
        n0 = kv_tile * TILE.BLOCK_N
        _producer_tile(n0, kvh, kvh // HKV, 0, 0, M, n0 * 0, descs, bars, smem, sizes, tables, table_meta, TILE,
                       SPARSE, FLAGS)


@gluon.jit
def _producer_tile(n0, kvh, kz_t, q_row0, k_row0, M, cnt, descs, bars, smem, sizes, tables, table_meta,
                   TILE: gl.constexpr, SPARSE: gl.constexpr, FLAGS: gl.constexpr):
    """The producer's loads for keys n0.. of K / V head kvh: the tensors' batch kz_t, rows from q_row0 / k_row0 (packed
    sequences; 0 and the grid's batch for a dense launch), M query rows, the Q / dO ring from its step cnt on; returns
    the next cnt."""
    q_lo_desc, q_hi_desc, do_desc, k_lo_desc, k_hi_desc, v_desc, dq_desc = descs
    kv_ready, qdo_ready, qdo_empty, p_ready, ds_ready = bars
    q_lo_smem, q_hi_smem, do_smem, k_lo_smem, k_hi_smem, v_smem, p_smem, ds_smem, f_smem, dq_smem = smem
    Z, HQ, KZ = sizes[0], sizes[1], sizes[2]
    NUM_STAGES: gl.constexpr = TILE.NUM_STAGES
    LO: gl.constexpr = TILE.LO
    HKV = HQ // FLAGS.GQA_GROUP
    kz = kvh // HKV
    hkv = kvh % HKV
    kv_blk = n0 // SPARSE.SPARSE_KV

    if TILE.SPLIT_QK:
        kv_bytes: gl.constexpr = k_lo_desc.block_type.nbytes + k_hi_desc.block_type.nbytes + v_desc.block_type.nbytes
        qdo_bytes: gl.constexpr = (q_lo_desc.block_type.nbytes + q_hi_desc.block_type.nbytes
                                   + do_desc.block_type.nbytes)
    else:
        kv_bytes: gl.constexpr = k_lo_desc.block_type.nbytes + v_desc.block_type.nbytes
        qdo_bytes: gl.constexpr = q_lo_desc.block_type.nbytes + do_desc.block_type.nbytes
    mbarrier.expect(kv_ready, kv_bytes)
    tma.async_copy_global_to_shared(k_lo_desc, [kz_t, hkv, k_row0 + n0, 0], kv_ready, k_lo_smem.index(0))
    if TILE.SPLIT_QK:
        tma.async_copy_global_to_shared(k_hi_desc, [kz_t, hkv, k_row0 + n0, LO], kv_ready, k_hi_smem.index(0))
    tma.async_copy_global_to_shared(v_desc, [kz_t, hkv, k_row0 + n0, 0], kv_ready, v_smem.index(0))

    for hh in range((Z // KZ) * FLAGS.GQA_GROUP):
        z = kz + (hh // FLAGS.GQA_GROUP) * KZ
        hq = hkv * FLAGS.GQA_GROUP + hh % FLAGS.GQA_GROUP
        n_partial, n_total = _q_tile_counts(z, hq, kv_blk, M, tables, table_meta, TILE, SPARSE)
        first = _causal_first(n_partial, z, hq, kv_blk, n0, tables, table_meta, TILE, SPARSE)
        for i in range(first, n_total):
            m0 = _q_tile_start(i, n_partial, z, hq, kv_blk, tables, table_meta, TILE, SPARSE)
            st = cnt % NUM_STAGES
            mbarrier.wait(qdo_empty.index(st), ((cnt // NUM_STAGES) & 1) ^ 1)
            mbarrier.expect(qdo_ready.index(st), qdo_bytes)
            z_t = z - kz + kz_t   # the tensors' batch (packed: 0)
            tma.async_copy_global_to_shared(q_lo_desc, [z_t, hq, q_row0 + m0, 0], qdo_ready.index(st),
                                            q_lo_smem.index(st))
            if TILE.SPLIT_QK:
                tma.async_copy_global_to_shared(q_hi_desc, [z_t, hq, q_row0 + m0, LO], qdo_ready.index(st),
                                                q_hi_smem.index(st))
            tma.async_copy_global_to_shared(do_desc, [z_t, hq, q_row0 + m0, 0], qdo_ready.index(st),
                                            do_smem.index(st))
            cnt += 1
    return cnt


# ----------------------------------------------------------------------------------------------
# Consumers: 32 keys of S / dP each, all 64 keys of their dK, dV, dQ columns.
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _consumer(WG: gl.constexpr, descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, cta,
              SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr, TILE: gl.constexpr,
              SPARSE: gl.constexpr, FLAGS: gl.constexpr, PACK: gl.constexpr):
    """A consumer warpgroup: the CTA's tile (TILE.PERSISTENT: its tiles in turn, K / V released after each one's last
    step). PACK.VARLEN: one sequence's KV tile (its lengths replace M and N in ``sizes``), rows from its offsets."""
    Z, HQ, KZ, M, N = sizes
    HKV = HQ // FLAGS.GQA_GROUP
    if TILE.PERSISTENT:
        first, n_my = _cta_tiles(cta)
        cnt = 0
        for t in range(n_my):
            kv_tile, kvh = _persistent_tile(cta, first + t, N, TILE)
            cnt = _consumer_tile(WG, kv_tile * TILE.BLOCK_N, kvh, 0, 0, t & 1, cnt, cta, descs, bars, smem, sizes,
                                 tables, table_meta, rows, scalars, mod_bufs, SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE,
                                 SPARSE, FLAGS, PACK)
    elif PACK.VARLEN:
        kv_tile, kvh = _packed_coords(rows[5], HKV, TILE)
        n0 = kv_tile * TILE.BLOCK_N
        q_row0, M, k_row0, N = _seq_span(rows[5], kvh // HKV)
        M = gl.where(n0 < N, M, 0)   # a tile past the sequence's keys: no step
        _consumer_tile(WG, n0, kvh, q_row0, k_row0, 0, n0 * 0, cta, descs, bars, smem, (Z, HQ, KZ, M, N), tables,
                       table_meta, rows, scalars, mod_bufs, SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE, SPARSE, FLAGS, PACK)
    else:
        kv_tile, kvh = _grid_tile(cta, TILE)
        n0 = kv_tile * TILE.BLOCK_N
        _consumer_tile(WG, n0, kvh, 0, 0, 0, n0 * 0, cta, descs, bars, smem, sizes, tables, table_meta, rows, scalars,
                       mod_bufs, SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE, SPARSE, FLAGS, PACK)
    tma.store_wait(0)   # the last dQ reduce has read the staging tile before the CTA exits


@gluon.jit
def _consumer_tile(WG: gl.constexpr, n0, kvh, q_row0, k_row0, kv_phase, cnt, cta, descs, bars, smem, sizes, tables,
                   table_meta, rows, scalars, mod_bufs, SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr,
                   MASK_MOD: gl.constexpr, TILE: gl.constexpr, SPARSE: gl.constexpr, FLAGS: gl.constexpr,
                   PACK: gl.constexpr):
    """Keys n0.. of K / V head kvh over every query head of its group (GQA, K / V batch 1), each head's steps in order
    or overlapped (TILE.OVERLAP), then this warpgroup's dK, dV columns stored. q_row0 / k_row0: a packed sequence's
    first query / key row (0 for a dense launch); kv_phase: kv_ready's phase; cnt: the CTA's steps so far (ring stage,
    P / dS buffer, dQ staging tile). Returns the next cnt."""
    kv_ready = bars[0]
    Z, HQ, KZ, M, N = sizes
    dk_ptr, dv_ptr = rows[2], rows[3]
    ds_scale = scalars[2]
    # this warpgroup's dK columns (Q tile WG); its dQ columns: TILE.DQ_COLS (K tile WG, or the other one: DQ_SWAP)
    DK0: gl.constexpr = TILE.DK_COLS[WG][0]
    DK_N: gl.constexpr = TILE.DK_COLS[WG][1]
    DV_WG: gl.constexpr = TILE.DV_WG
    DV0: gl.constexpr = WG * DV_WG
    BLOCK_N: gl.constexpr = TILE.BLOCK_N

    HKV = HQ // FLAGS.GQA_GROUP
    kz = kvh // HKV
    hkv = kvh % HKV
    kv_blk = n0 // SPARSE.SPARSE_KV

    dk_layout: gl.constexpr = _acc_layout(DK_N)
    dv_layout: gl.constexpr = _acc_layout(DV_WG)
    dk = gl.zeros([BLOCK_N, DK_N], gl.float32, layout=dk_layout)
    dv = gl.zeros([BLOCK_N, DV_WG], gl.float32, layout=dv_layout)
    if TILE.OVERLAP:   # a step's query rows (S's row layout), made once (the in-order step makes them per step)
        row_layout: gl.constexpr = gl.SliceLayout(1, _acc_layout(TILE.KEYS_WG))
        rows_ = gl.arange(0, TILE.BLOCK_M, layout=row_layout)

    if PACK.VARLEN:
        if n0 < N:
            mbarrier.wait(kv_ready, 0)
            _clear_keys_past(smem, n0, N, WG, TILE)
    else:
        mbarrier.wait(kv_ready, kv_phase)
    if TILE.DETERMINISTIC:   # the counters of this warpgroup's last step's dQ chunks, not released yet (the sink: none)
        held = (cta[0][0], cta[0][0])
    else:
        held = (0, 0)
    for hh in range((Z // KZ) * FLAGS.GQA_GROUP):
        z = kz + (hh // FLAGS.GQA_GROUP) * KZ
        hq = hkv * FLAGS.GQA_GROUP + hh % FLAGS.GQA_GROUP
        zh = hq if PACK.VARLEN else z * HQ + hq   # (packed: z is the sequence, the tensors' batch is 1)
        n_partial, n_total = _q_tile_counts(z, hq, kv_blk, M, tables, table_meta, TILE, SPARSE)
        first = _causal_first(n_partial, z, hq, kv_blk, n0, tables, table_meta, TILE, SPARSE)
        turns = (cta[0], n0 // BLOCK_N, held)
        if TILE.OVERLAP:
            dk, dv, cnt, held = _head_overlap(WG, z, hq, zh, first, n_partial, n_total, n0, kv_blk, rows_, dk, dv,
                                              cnt, q_row0, turns, descs, bars, smem, sizes, tables, table_meta, rows,
                                              scalars, mod_bufs, SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE, SPARSE, FLAGS,
                                              PACK)
        else:
            dk, dv, cnt, held = _head_in_order(WG, z, hq, zh, first, n_partial, n_total, n0, kv_blk, dk, dv, cnt,
                                               q_row0, turns, descs, bars, smem, sizes, tables, table_meta, rows,
                                               scalars, mod_bufs, SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE, SPARSE,
                                               FLAGS, PACK)
    if TILE.DETERMINISTIC:
        _release_held(held, TILE.DQ_CHUNKS[WG])
    if TILE.PERSISTENT:   # every wgmma reading this tile's K and V has retired (each step ends on a wait of 0)
        mbarrier.arrive(cta[1], count=1)
    if TILE.DKDV_TMA:
        dk_descs = (rows[6][0], rows[6][1])   # warpgroup 0's dK columns, warpgroup 1's (their box widths differ at 192)
        _store_dkdv_tma(dk, dv, smem[9].index(WG * TILE.DQ_BUFS), dk_descs[WG], rows[6][2], kz, hkv, n0, DK0, DV0,
                        ds_scale)
    else:
        _store_dk_dv(dk, dv, n0, kz, hkv, HKV, N, k_row0, dk_ptr, dv_ptr, ds_scale, descs[0].dtype, DK0, DK_N, DV0,
                     TILE, PACK)
    return cnt


@gluon.jit
def _clear_keys_past(smem, n0, N, WG: gl.constexpr, TILE: gl.constexpr):
    """PACK.VARLEN: this warpgroup's K rows (its 32 keys of S, in both K tiles) at or past the sequence's end N zeroed
    in shared memory, as bwd_sm90._kv_landed does (why there); the other warpgroup's dQ reads them after this one's
    first ds_ready, which follows the fence here."""
    first = n0 + WG * TILE.KEYS_WG
    if first + TILE.KEYS_WG > N:
        _zero_keys_past(smem[3].index(0).reshape([TILE.BLOCK_N, TILE.LO]).slice(WG * TILE.KEYS_WG, TILE.KEYS_WG, dim=0),
                        first, N)
        if TILE.SPLIT_QK:
            _zero_keys_past(smem[4].index(0).reshape([TILE.BLOCK_N, TILE.HI]).slice(WG * TILE.KEYS_WG, TILE.KEYS_WG,
                                                                                    dim=0), first, N)
        fence_async_shared()
        gl.thread_barrier()


@gluon.jit
def _head_in_order(WG: gl.constexpr, z, hq, zh, first, n_partial, n_total, n0, kv_blk, dk, dv, cnt, q_row0, turns,
                   descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, SCORE_MOD: gl.constexpr,
                   SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr, TILE: gl.constexpr, SPARSE: gl.constexpr,
                   FLAGS: gl.constexpr, PACK: gl.constexpr):
    """The steps first .. n_total - 1 of one query head (z, hq) for this CTA's keys, in order (module docstring's
    step): dK, dV accumulated, dQ added; returns (dk, dv, cnt, held), cnt counting the steps of the CTA (ring stage and
    P / dS buffer). q_row0: a packed sequence's first row in STATS and DQ_ACC (0 for a dense launch). ``turns``
    (TILE.DETERMINISTIC): (the order's CTA arguments, this CTA's KV tile, ``held``: the counters of the last step's
    dQ chunks, released under the next step's dK; the new ``held`` is returned)."""
    q_lo_desc, q_hi_desc, do_desc, k_lo_desc, k_hi_desc, v_desc, dq_desc = descs
    kv_ready, qdo_ready, qdo_empty, p_ready, ds_ready = bars
    q_lo_smem, q_hi_smem, do_smem, k_lo_smem, k_hi_smem, v_smem, p_smem, ds_smem, f_smem, dq_smem = smem
    Z, HQ, KZ, M, N = sizes
    stats_ptr, dq_acc_ptr, dk_ptr, dv_ptr, M_PAD = rows[0], rows[1], rows[2], rows[3], rows[4]
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    KEYS_WG: gl.constexpr = TILE.KEYS_WG
    DV_WG: gl.constexpr = TILE.DV_WG
    DQ_N: gl.constexpr = TILE.DQ_N
    NUM_STAGES: gl.constexpr = TILE.NUM_STAGES
    dtype: gl.constexpr = q_lo_desc.dtype
    DQ0: gl.constexpr = TILE.DQ_COLS[WG][0]
    DV0: gl.constexpr = WG * DV_WG
    NQ: gl.constexpr = TILE.DQ_CHUNKS[WG]   # dQ chunks a step (1 or 2)
    s_layout: gl.constexpr = _acc_layout(KEYS_WG)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dq_layout: gl.constexpr = _acc_layout(DQ_N)
    s_zero = gl.zeros([BLOCK_M, KEYS_WG], gl.float32, layout=s_layout)
    dq_zero = gl.zeros([BLOCK_M, DQ_N], gl.float32, layout=dq_layout)
    held = turns[2]
    for i in range(first, n_total):
        m0 = _q_tile_start(i, n_partial, z, hq, kv_blk, tables, table_meta, TILE, SPARSE)
        st = cnt % NUM_STAGES
        buf = cnt % 2
        # K, V and the P / dS tiles as wgmma operands, built per step from a zero LLVM cannot see through
        # (bwd_sm90.BwdTile.VIEWS_PER_STEP: hoisted, their descriptors are held in vector registers)
        zero = _opaque(0)
        k_lo, k_hi, v_rows, p_tile, ds_tile, q_lo, q_hi, do_t, q_dk, k_dq = _step_views(st, buf, zero, smem, WG,
                                                                                        TILE)
        p_mine = p_tile.slice(WG * KEYS_WG, KEYS_WG, dim=1)       # [BLOCK_M, KEYS_WG]
        ds_mine = ds_tile.slice(WG * KEYS_WG, KEYS_WG, dim=1)
        row_off = zh.to(gl.int64) * M_PAD + q_row0 + m0
        stats = stats_ptr + (row_off + zh.to(gl.int64) * M_PAD)   # LSE_P; DELTA_P is M_PAD further
        rows_ = gl.arange(0, BLOCK_M, layout=row_layout)
        lse = _lse_rows(stats, 0, rows_, M - m0, PACK)
        k_lo_t = k_lo.slice(WG * KEYS_WG, KEYS_WG, dim=0).permute((1, 0))
        k_hi_t = k_hi.slice(WG * KEYS_WG, KEYS_WG, dim=0).permute((1, 0))
        mbarrier.wait(qdo_ready.index(st), (cnt // NUM_STAGES) & 1)
        s_tok = warpgroup_mma(q_lo, k_lo_t, s_zero, use_acc=False, is_async=True)
        if TILE.SPLIT_QK:
            s_tok = warpgroup_mma(q_hi, k_hi_t, s_tok, is_async=True)
        qk, _ql, _qh, _kl, _kh = warpgroup_mma_wait(0, deps=[s_tok, q_lo, q_hi, k_lo_t, k_hi_t])
        p_ds = _make_p(qk, lse, m0, i < n_partial, z, hq, n0, M, N, p_mine,
                       f_smem.index(WG), scalars, mod_bufs, WG, SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE, FLAGS)
        mbarrier.arrive(p_ready.index(buf), count=1)
        # dP needs only this warpgroup's keys: it runs while the other half of P is awaited
        v_t = v_rows.slice(WG * KEYS_WG, KEYS_WG, dim=0).permute((1, 0))
        dp_tok = warpgroup_mma(do_t, v_t, s_zero, use_acc=False, is_async=True)
        delta = gl.load(stats + M_PAD + rows_)
        mbarrier.wait(p_ready.index(buf), (cnt // 2) & 1)
        p_t = p_tile.permute((1, 0))                             # [keys, queries]: A of dV
        do_cols = do_t.slice(DV0, DV_WG, dim=1)
        dv_tok = warpgroup_mma(p_t, do_cols, dv, is_async=True)
        dp, _do, _v = warpgroup_mma_wait(1, deps=[dp_tok, do_t, v_t])
        ds = _ds(dp, delta, p_ds, p_mine, f_smem.index(WG), s_layout, SCORE_GRAD is not None, TILE.P_REGS)
        ds_mine.store(ds.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ds_ready.index(buf), count=1)
        mbarrier.wait(ds_ready.index(buf), (cnt // 2) & 1)
        dq_at = (zh, q_row0 + m0, DQ0)
        dk_tok = warpgroup_mma(ds_tile.permute((1, 0)), q_dk, dk, is_async=True)
        if TILE.DETERMINISTIC:   # the last step's chunks released and this step's counters loaded, under dK
            turn0, turn1, held = _step_turns(turns[0], turns[1], held, zh, m0, kv_blk, z, hq, M_PAD, table_meta, DQ0, NQ,
                                             TILE, SPARSE)
        dv, dk, _p, _ds, _dc, _qd = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, p_t, ds_tile, do_cols, q_dk])
        mbarrier.arrive(qdo_empty.index(st), count=1)
        for c in gl.static_range(NQ):
            k_cols = k_dq.slice(c * DQ_N, DQ_N, dim=1)
            dq_tok = warpgroup_mma(ds_tile, k_cols, dq_zero, use_acc=False, is_async=True)
            dq, _a, _b = warpgroup_mma_wait(0, deps=[dq_tok, ds_tile, k_cols])
            if TILE.DETERMINISTIC:
                _wait_chunk_turn(turn0 if c == 0 else turn1)
            _stage_dq(dq, dq_smem, dq_desc, dq_at, c, cnt * NQ + c, WG, TILE)
        cnt += 1
    return dk, dv, cnt, held


@gluon.jit
def _head_overlap(WG: gl.constexpr, z, hq, zh, first, n_partial, n_total, n0, kv_blk, rows_, dk, dv, cnt, q_row0,
                  turns, descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, SCORE_MOD: gl.constexpr,
                  SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr, TILE: gl.constexpr, SPARSE: gl.constexpr,
                  FLAGS: gl.constexpr, PACK: gl.constexpr):
    """_head_in_order's steps (TILE.OVERLAP), software-pipelined: step j + 1's S is issued right
    behind step j's dS (its Q / dO stage waited then), ahead of step j's dK and dQ chunks, and its P is made while
    they run. A step begins with its P in the P buffer (p_ready signalled) and dS's factor in registers (P_REGS),
    made by the step before or, for a head's first step, by a prologue. On a head's last step the early S reads the
    step's own Q stage and is dropped. The P / dS buffers' reuse argument is the in-order step's: P of step j + 1 is
    written after waiting p_ready of step j, which the other warpgroup signals after its step j - 1's dV retired."""
    q_lo_desc, q_hi_desc, do_desc, k_lo_desc, k_hi_desc, v_desc, dq_desc = descs
    kv_ready, qdo_ready, qdo_empty, p_ready, ds_ready = bars
    q_lo_smem, q_hi_smem, do_smem, k_lo_smem, k_hi_smem, v_smem, p_smem, ds_smem, f_smem, dq_smem = smem
    Z, HQ, KZ, M, N = sizes
    stats_ptr, dq_acc_ptr, dk_ptr, dv_ptr, M_PAD = rows[0], rows[1], rows[2], rows[3], rows[4]
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    BLOCK_N: gl.constexpr = TILE.BLOCK_N
    KEYS_WG: gl.constexpr = TILE.KEYS_WG
    DV_WG: gl.constexpr = TILE.DV_WG
    DQ_N: gl.constexpr = TILE.DQ_N
    LO: gl.constexpr = TILE.LO
    HI: gl.constexpr = TILE.HI
    NUM_STAGES: gl.constexpr = TILE.NUM_STAGES
    dtype: gl.constexpr = q_lo_desc.dtype
    DQ0: gl.constexpr = TILE.DQ_COLS[WG][0]
    DV0: gl.constexpr = WG * DV_WG
    NQ: gl.constexpr = TILE.DQ_CHUNKS[WG]   # dQ chunks a step (1 or 2)
    s_layout: gl.constexpr = _acc_layout(KEYS_WG)
    dq_layout: gl.constexpr = _acc_layout(DQ_N)
    s_zero = gl.zeros([BLOCK_M, KEYS_WG], gl.float32, layout=s_layout)
    dq_zero = gl.zeros([BLOCK_M, DQ_N], gl.float32, layout=dq_layout)
    stats_h = stats_ptr + zh.to(gl.int64) * (2 * M_PAD) + q_row0   # LSE_P of the head; DELTA_P is M_PAD further
    m0 = n_total * 0
    held = turns[2]
    p_keep = gl.zeros([BLOCK_M, KEYS_WG], gl.float32, layout=s_layout)
    # Under a block mask the next step's first row is a table load with its LSE's load behind it, in front of the next
    # P: the row is loaded a step ahead, at the top of the step before (causal 1.09-1.10x, documents 1.03x with one
    # load; the LSE ahead too cost documents 3%: docs/design/hopper_backward.md). Without one it is arithmetic.
    AHEAD: gl.constexpr = SPARSE.HAS_BLOCK_MASK
    m0_ahead = m0
    if n_total > first:
        # prologue: the head's first S, waited at once, and its P
        m0 = _q_tile_start(first, n_partial, z, hq, kv_blk, tables, table_meta, TILE, SPARSE)
        if AHEAD:
            m0_ahead = _q_tile_start(gl.minimum(first + 1, n_total - 1), n_partial, z, hq, kv_blk, tables, table_meta,
                                     TILE, SPARSE)
        zero0 = _opaque(0)
        st0 = cnt % NUM_STAGES
        k_lo0 = k_lo_smem.index(zero0).reshape([BLOCK_N, LO]).slice(WG * KEYS_WG, KEYS_WG, dim=0)
        k_hi0 = k_hi_smem.index(zero0).reshape([BLOCK_N, HI]).slice(WG * KEYS_WG, KEYS_WG, dim=0)
        q_lo0 = q_lo_smem.index(st0 + zero0).reshape([BLOCK_M, LO])
        q_hi0 = q_hi_smem.index(st0 + zero0).reshape([BLOCK_M, HI])
        lse0 = _lse_rows(stats_h, m0, rows_, M, PACK)
        mbarrier.wait(qdo_ready.index(st0), (cnt // NUM_STAGES) & 1)
        s_tok = warpgroup_mma(q_lo0, k_lo0.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if TILE.SPLIT_QK:
            s_tok = warpgroup_mma(q_hi0, k_hi0.permute((1, 0)), s_tok, is_async=True)
        qk0, _a, _b, _c, _d = warpgroup_mma_wait(0, deps=[s_tok, q_lo0, q_hi0, k_lo0, k_hi0])
        p_mine0 = p_smem.index(cnt % 2 + zero0).slice(WG * KEYS_WG, KEYS_WG, dim=1)
        p_keep = _make_p(qk0, lse0, m0, first < n_partial, z, hq, n0, M, N,
                         p_mine0, f_smem.index(WG), scalars, mod_bufs, WG, SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE, FLAGS)
        mbarrier.arrive(p_ready.index(cnt % 2), count=1)
    for i in range(first, n_total):
        st = cnt % NUM_STAGES
        buf = cnt % 2
        zero = _opaque(0)
        # (this step's Q tiles, _ql / _qh: its S was issued by the step before)
        k_lo, k_hi, v_rows, p_tile, ds_tile, _ql, _qh, do_t, q_dk, k_dq = _step_views(st, buf, zero, smem, WG,
                                                                                      TILE)
        ds_mine = ds_tile.slice(WG * KEYS_WG, KEYS_WG, dim=1)
        k_lo_t = k_lo.slice(WG * KEYS_WG, KEYS_WG, dim=0).permute((1, 0))
        k_hi_t = k_hi.slice(WG * KEYS_WG, KEYS_WG, dim=0).permute((1, 0))
        v_t = v_rows.slice(WG * KEYS_WG, KEYS_WG, dim=0).permute((1, 0))
        delta = gl.load(stats_h + M_PAD + m0 + rows_)
        if AHEAD:   # (one load: two predicated ones into the carried register waited on each other)
            m0_after = _q_tile_start(gl.minimum(i + 2, n_total - 1), n_partial, z, hq, kv_blk, tables, table_meta,
                                     TILE, SPARSE, ONE_LOAD=True)
        dp_tok = warpgroup_mma(do_t, v_t, s_zero, use_acc=False, is_async=True)
        mbarrier.wait(p_ready.index(buf), (cnt // 2) & 1)
        p_t = p_tile.permute((1, 0))                             # [keys, queries]: A of dV
        do_cols = do_t.slice(DV0, DV_WG, dim=1)
        dv_tok = warpgroup_mma(p_t, do_cols, dv, is_async=True)
        dp, _do, _v = warpgroup_mma_wait(1, deps=[dp_tok, do_t, v_t])
        ds = _ds(dp, delta, p_keep, None, None, s_layout, SCORE_GRAD is not None, True)
        ds_mine.store(ds.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ds_ready.index(buf), count=1)
        # the next step: its query tile, LSE and Q stage, its S issued there (bwd_sm90._next_step)
        if AHEAD:
            m0_next = m0_ahead
            has_next, lse_next, st_next = _next_step_at(i, n_total, cnt, m0_next, stats_h, rows_, TILE)
            m0_ahead = m0_after
        else:
            has_next, m0_next, lse_next, st_next = _next_step(i, n_total, n_partial, cnt, z, hq, kv_blk, stats_h,
                                                              rows_, tables, table_meta, TILE, SPARSE, M, PACK)
        q_lo_n = q_lo_smem.index(st_next + zero).reshape([BLOCK_M, LO])
        q_hi_n = q_hi_smem.index(st_next + zero).reshape([BLOCK_M, HI])
        if has_next:
            mbarrier.wait(qdo_ready.index(st_next), ((cnt + 1) // NUM_STAGES) & 1)
        s_tok = warpgroup_mma(q_lo_n, k_lo_t, s_zero, use_acc=False, is_async=True)
        if TILE.SPLIT_QK:
            s_tok = warpgroup_mma(q_hi_n, k_hi_t, s_tok, is_async=True)
        mbarrier.wait(ds_ready.index(buf), (cnt // 2) & 1)
        dk_tok = warpgroup_mma(ds_tile.permute((1, 0)), q_dk, dk, is_async=True)
        if TILE.DETERMINISTIC:   # the last step's chunks released and this step's counters loaded, under dK
            turn0, turn1, held = _step_turns(turns[0], turns[1], held, zh, m0, kv_blk, z, hq, M_PAD, table_meta, DQ0, NQ,
                                             TILE, SPARSE)
        k_c0 = k_dq.slice(0, DQ_N, dim=1)
        dq0_tok = warpgroup_mma(ds_tile, k_c0, dq_zero, use_acc=False, is_async=True)
        if NQ == 2:
            k_c1 = k_dq.slice(DQ_N, DQ_N, dim=1)
            dq1_tok = warpgroup_mma(ds_tile, k_c1, dq_zero, use_acc=False, is_async=True)
            qk, dv, _p, _dc, _ql, _qh = warpgroup_mma_wait(3, deps=[s_tok, dv_tok, p_t, do_cols, q_lo_n, q_hi_n])
        else:
            qk, dv, _p, _dc, _ql, _qh = warpgroup_mma_wait(2, deps=[s_tok, dv_tok, p_t, do_cols, q_lo_n, q_hi_n])
        if has_next:   # P of the next step while dK and dQ run
            p_next = p_smem.index(1 - buf + zero).slice(WG * KEYS_WG, KEYS_WG, dim=1)
            p_keep = _make_p(qk, lse_next, m0_next, i + 1 < n_partial, z, hq,
                             n0, M, N, p_next, f_smem.index(WG), scalars, mod_bufs, WG, SCORE_MOD, SCORE_GRAD,
                             MASK_MOD, TILE, FLAGS)
            mbarrier.arrive(p_ready.index(1 - buf), count=1)
        dq_at = (zh, q_row0 + m0, DQ0)
        if NQ == 2:
            dk, _qd = warpgroup_mma_wait(2, deps=[dk_tok, q_dk])
            mbarrier.arrive(qdo_empty.index(st), count=1)
            dq, _k0 = warpgroup_mma_wait(1, deps=[dq0_tok, k_c0])
            if TILE.DETERMINISTIC:
                _wait_chunk_turn(turn0)
            _stage_dq(dq, dq_smem, dq_desc, dq_at, 0, cnt * NQ, WG, TILE)
            dq, _ds, _k1 = warpgroup_mma_wait(0, deps=[dq1_tok, ds_tile, k_c1])
            if TILE.DETERMINISTIC:
                _wait_chunk_turn(turn1)
            _stage_dq(dq, dq_smem, dq_desc, dq_at, 1, cnt * NQ + 1, WG, TILE)
        else:
            dk, _qd = warpgroup_mma_wait(1, deps=[dk_tok, q_dk])
            mbarrier.arrive(qdo_empty.index(st), count=1)
            dq, _ds, _k0 = warpgroup_mma_wait(0, deps=[dq0_tok, ds_tile, k_c0])
            if TILE.DETERMINISTIC:
                _wait_chunk_turn(turn0)
            _stage_dq(dq, dq_smem, dq_desc, dq_at, 0, cnt * NQ, WG, TILE)
        m0 = m0_next
        cnt += 1
    return dk, dv, cnt, held


@gluon.jit
def _store_dk_dv(dk, dv, n0, kz, hkv, HKV, N, k_row0, dk_ptr, dv_ptr, ds_scale, dtype: gl.constexpr, DK0: gl.constexpr,
                 DK_N: gl.constexpr, DV0: gl.constexpr, TILE: gl.constexpr, PACK: gl.constexpr):
    """dK, dV of this warpgroup's columns: one store per output tile (rows past N clipped); dK takes the scale and
    f's factor here. [KZ, HKV, N, D] contiguous, or packed (total keys, HKV, D) from key row k_row0."""
    dk_layout: gl.constexpr = _acc_layout(DK_N)
    dv_layout: gl.constexpr = _acc_layout(TILE.DV_WG)
    rows_k = n0 + gl.arange(0, TILE.BLOCK_N, layout=gl.SliceLayout(1, dk_layout))[:, None]
    cols_k = DK0 + gl.arange(0, DK_N, layout=gl.SliceLayout(0, dk_layout))[None, :]
    rows_v = n0 + gl.arange(0, TILE.BLOCK_N, layout=gl.SliceLayout(1, dv_layout))[:, None]
    cols_v = DV0 + gl.arange(0, TILE.DV_WG, layout=gl.SliceLayout(0, dv_layout))[None, :]
    D_MEM: gl.constexpr = TILE.D_MEM
    DV_MEM: gl.constexpr = TILE.DV_MEM
    if PACK.VARLEN:
        dk_at = dk_ptr + (k_row0 + rows_k).to(gl.int64) * (HKV * D_MEM) + hkv * D_MEM + cols_k
        dv_at = dv_ptr + (k_row0 + rows_v).to(gl.int64) * (HKV * DV_MEM) + hkv * DV_MEM + cols_v
    else:
        head = (kz * HKV + hkv).to(gl.int64) * N
        dk_at = dk_ptr + head * D_MEM + rows_k * D_MEM + cols_k
        dv_at = dv_ptr + head * DV_MEM + rows_v * DV_MEM + cols_v
    gl.store(dk_at, (dk * ds_scale).to(dtype), mask=(rows_k < N) & (cols_k < D_MEM))
    gl.store(dv_at, dv.to(dtype), mask=(rows_v < N) & (cols_v < DV_MEM))


@gluon.jit
def _step_views(st, buf, zero, smem, WG: gl.constexpr, TILE: gl.constexpr):
    """The shared tiles of a step as wgmma operands, built per step through ``zero`` (an _opaque 0; bwd_sm90.BwdTile.
    VIEWS_PER_STEP: hoisted, their descriptors were held in vector registers; the ring stage too: with one stage it is
    a constant, and the Q / dO descriptors of all 16 k-steps of S and dP were hoisted into ~40 vector registers, D = 256
    causal: 46 spills): K (lo, hi: the same tile without SPLIT_QK), V, the P and dS tiles of buffer ``buf``, Q (lo,
    hi) and dO of ring stage ``st``, and B of dK (Q's columns DK_COLS[WG]) and of dQ (K's columns DQ_COLS[WG]): a
    whole tile with SPLIT_QK, else a slice."""
    q_lo_smem, q_hi_smem, do_smem, k_lo_smem, k_hi_smem, v_smem, p_smem, ds_smem, f_smem, dq_smem = smem
    k_lo = k_lo_smem.index(zero).reshape([TILE.BLOCK_N, TILE.LO])
    k_hi = k_hi_smem.index(zero).reshape([TILE.BLOCK_N, TILE.HI])
    v_rows = v_smem.index(zero).reshape([TILE.BLOCK_N, TILE.HEAD_DV])
    p_tile = p_smem.index(buf + zero)                       # [BLOCK_M, BLOCK_N]
    ds_tile = ds_smem.index(buf + zero)
    q_lo = q_lo_smem.index(st + zero).reshape([TILE.BLOCK_M, TILE.LO])
    q_hi = q_hi_smem.index(st + zero).reshape([TILE.BLOCK_M, TILE.HI])
    do_t = do_smem.index(st + zero).reshape([TILE.BLOCK_M, TILE.HEAD_DV])
    if not TILE.SPLIT_QK:
        q_dk = q_lo.slice(TILE.DK_COLS[WG][0], TILE.DK_COLS[WG][1], dim=1)
        k_dq = k_lo.slice(TILE.DQ_COLS[WG][0], TILE.DQ_COLS[WG][1], dim=1)
    elif WG == 0:
        q_dk = q_lo
        k_dq = k_hi
    else:
        q_dk = q_hi
        k_dq = k_lo
    return k_lo, k_hi, v_rows, p_tile, ds_tile, q_lo, q_hi, do_t, q_dk, k_dq


@gluon.jit
def _make_p(qk, lse, m0, is_partial, z, hq, n0, M, N, p_mine, f_dst, scalars, mod_bufs, WG: gl.constexpr,
            SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr, TILE: gl.constexpr,
            FLAGS: gl.constexpr):
    """P of this warpgroup's keys from S = ``qk`` into its half of the P tile (every thread's part written and
    fenced: the caller signals p_ready), and dS's factor (P or P · f' with P_REGS; else f' to ``f_dst``)."""
    sm_scale, qk_scale2, ds_scale = scalars
    score_bufs, mask_bufs = mod_bufs
    s_layout: gl.constexpr = _acc_layout(TILE.KEYS_WG)
    q_idx = gl.minimum(m0 + gl.arange(0, TILE.BLOCK_M, layout=gl.SliceLayout(1, s_layout)), M - 1)[:, None]
    kv0 = n0 + WG * TILE.KEYS_WG
    kv_idx = gl.minimum(kv0 + gl.arange(0, TILE.KEYS_WG, layout=gl.SliceLayout(0, s_layout)), N - 1)[None, :]
    p = _probabilities(qk, lse, z, hq, q_idx, kv_idx, is_partial, sm_scale, qk_scale2, score_bufs, mask_bufs,
                       SCORE_MOD, MASK_MOD, FLAGS)
    p_mine.store(p.to(p_mine.dtype))
    p_ds = _ds_factor(p, qk, f_dst, sm_scale, z, hq, q_idx, kv_idx, score_bufs, SCORE_GRAD, FLAGS, TILE.P_REGS)
    fence_async_shared()
    gl.thread_barrier()
    return p_ds


@gluon.jit
def _step_turns(order, kv_tile, held, zh, m0, kv_blk, z, hq, M_PAD, table_meta, DQ0: gl.constexpr, NQ: gl.constexpr,
                TILE: gl.constexpr, SPARSE: gl.constexpr):
    """TILE.DETERMINISTIC, mid-step: release the counters ``held`` of this warpgroup's last step (_release_held: one
    fence), then issue the acquire loads of this step's chunks' counters (one per 64 dQ columns from DQ0). Returns
    ((counter, target, value seen) of chunk 0, of chunk 1 (chunk 0's again with one chunk), the counters to hold:
    this step's, chunk 0's twice with one chunk)."""
    _release_held(held, NQ)
    sem0, target0 = _dq_turn(order, zh, m0, DQ0 // 64, kv_tile, kv_blk, z, hq, M_PAD, table_meta, TILE, SPARSE)
    turn0 = (sem0, target0, _ld_acquire(sem0))
    if NQ == 2:
        sem1, target1 = _dq_turn(order, zh, m0, DQ0 // 64 + 1, kv_tile, kv_blk, z, hq, M_PAD, table_meta, TILE,
                                 SPARSE)
        turn1 = (sem1, target1, _ld_acquire(sem1))
        now = (sem0, sem1)
    else:
        turn1 = turn0
        now = (sem0, sem0)
    return turn0, turn1, now


@gluon.jit
def _release_held(held, NQ: gl.constexpr):
    """Release the counters of a warpgroup's last step: its two chunks' behind one fence (bwd_sm90._release_turns), or
    its one chunk's alone (bwd_sm90._release_turn). A second counter of DQ_SEMS' sink would make every such release an
    atomic add on one word that every CTA adds to (it cost D64 0.63x in the first pairing, hopper_backward.md)."""
    if NQ == 2:
        _release_turns(held[0], held[1])
    else:
        _release_turn(held[0])


@gluon.jit
def _wait_chunk_turn(turn):
    """Spin until a chunk's counter (``turn``: counter, target, value seen at _step_turns) reaches its target."""
    _wait_turn(turn[0], turn[1], turn[2])


@gluon.jit
def _stage_dq(dq, dq_smem, dq_desc, dq_at, c: gl.constexpr, nth, WG: gl.constexpr, TILE: gl.constexpr):
    """dQ chunk c of a step (this warpgroup's nth chunk) into a staging tile, then its TMA reduce-add into DQ_ACC at
    (zh, m0, first column + c * DQ_N). With DQ_BUFS tiles the reduce-add before last may still be reading."""
    zh, m0, col0 = dq_at
    tma.store_wait(TILE.DQ_BUFS - 1)      # the reduce-add that last read this staging tile is done with it
    stage = dq_smem.index(WG * TILE.DQ_BUFS + nth % TILE.DQ_BUFS)
    if TILE.DQ_FRAG:
        _frag_reduce_add(dq, stage, dq_desc, zh, m0, col0 + c * TILE.DQ_N, TILE.D_MEM)
    else:
        stage.reshape([TILE.BLOCK_M, TILE.DQ_N]).store(dq)         # [1, BLOCK_M, DQ_N] fp32, 128-byte swizzle
        fence_async_shared()
        _tma_reduce_add(dq_desc, [zh, m0, col0 + c * TILE.DQ_N], stage)


@gluon.jit
def _consumer_wg0(descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, cta,
                  SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr, TILE: gl.constexpr,
                  SPARSE: gl.constexpr, FLAGS: gl.constexpr, PACK: gl.constexpr):
    _consumer(0, descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, cta, SCORE_MOD, SCORE_GRAD,
              MASK_MOD, TILE, SPARSE, FLAGS, PACK)


@gluon.jit
def _consumer_wg1(descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, cta,
                  SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr, TILE: gl.constexpr,
                  SPARSE: gl.constexpr, FLAGS: gl.constexpr, PACK: gl.constexpr):
    _consumer(1, descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, cta, SCORE_MOD, SCORE_GRAD,
              MASK_MOD, TILE, SPARSE, FLAGS, PACK)


@gluon.jit
def _producer_entry(descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, cta,
                    SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr,
                    TILE: gl.constexpr, SPARSE: gl.constexpr, FLAGS: gl.constexpr, PACK: gl.constexpr):
    _producer(descs, bars, smem, sizes, tables, table_meta, rows[5], cta, TILE, SPARSE, FLAGS, PACK)


_RUNTIME_SIZES = ["Z", "KZ", "M", "N", "M_PAD", "NUM_KV_BLKS", "NUM_Q_BLKS"]


@gluon.jit(do_not_specialize=_RUNTIME_SIZES)
def fa3_bwd_sm90_wide_kernel(
    q_lo_desc, q_hi_desc, do_desc, k_lo_desc, k_hi_desc, v_desc, dq_desc,   # dq_desc: DQ_ACC by [1, 64, 64]
    stats_ptr, dq_acc_ptr, dk_ptr, dv_ptr,
    dk0_desc, dk1_desc, dv_desc,   # TILE.DKDV_TMA: dK by [1, 1, 64, DK_COLS[w][1]] boxes (warpgroup w), dV by [1, 1,
                                   # 64, DV_WG]; else None
    qnb_ptr, qidx_ptr, fqnb_ptr, fqidx_ptr,
    score_bufs, mask_bufs,
    Z, HQ, KZ, M, N, M_PAD, SZ, SH, NUM_KV_BLKS, NUM_Q_BLKS,
    sm_scale, qk_scale2, ds_scale,
    cta_args,                # TILE.PERSISTENT: (offsets int32 [#CTAs + 1], tiles int32), host._persistent_schedule /
                             # _shape_schedule; () otherwise
    pack_args,               # PACK.VARLEN: (CU_Q, CU_K, TILES) int32 and SPARSE.WINDOW_WALK's WINDOW (bwd_sm90's
                             # "Packed sequences"); () otherwise
    SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr,
    TILE: gl.constexpr,      # WideTile
    SPARSE: gl.constexpr,    # bwd_sm90.BwdSparsity
    FLAGS: gl.constexpr,     # bwd_sm90.BwdFlags
    PACK: gl.constexpr = DENSE,   # bwd_sm90.BwdPacking
):
    NUM_STAGES: gl.constexpr = TILE.NUM_STAGES
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    BLOCK_N: gl.constexpr = TILE.BLOCK_N
    dtype: gl.constexpr = q_lo_desc.dtype
    q_lo_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + q_lo_desc.block_type.shape, q_lo_desc.layout)
    if TILE.SPLIT_QK:
        q_hi_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + q_hi_desc.block_type.shape, q_hi_desc.layout)
    else:
        q_hi_smem = q_lo_smem
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_lo_smem = gl.allocate_shared_memory(dtype, [1] + k_lo_desc.block_type.shape, k_lo_desc.layout)
    if TILE.SPLIT_QK:
        k_hi_smem = gl.allocate_shared_memory(dtype, [1] + k_hi_desc.block_type.shape, k_hi_desc.layout)
    else:
        k_hi_smem = k_lo_smem
    v_smem = gl.allocate_shared_memory(dtype, [1] + v_desc.block_type.shape, v_desc.layout)
    # P and dS [64 queries, 64 keys], each warpgroup writing 32 key columns: a 64-byte swizzle makes each half
    # whole swizzle atoms
    pds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], pds_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], pds_layout)
    # f' of each warpgroup's half (a score_mod), parked across the dP wgmma
    f_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, TILE.KEYS_WG], dtype)
    F_SLOTS: gl.constexpr = 2 if SCORE_GRAD is not None else 1
    f_smem = gl.allocate_shared_memory(dtype, [F_SLOTS, BLOCK_M, TILE.KEYS_WG], f_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2 * TILE.DQ_BUFS] + dq_desc.block_type.shape, dq_desc.layout)

    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    qdo_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    if TILE.PERSISTENT:   # both warpgroups are done with the tile's K and V (the next tile's may load)
        kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_empty, count=2)
    else:
        kv_empty = kv_ready   # (unused)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(qdo_ready.index(s), count=1)
        mbarrier.init(qdo_empty.index(s), count=2)
    for b in gl.static_range(2):
        mbarrier.init(p_ready.index(b), count=2)
        mbarrier.init(ds_ready.index(b), count=2)

    descs = (q_lo_desc, q_hi_desc, do_desc, k_lo_desc, k_hi_desc, v_desc, dq_desc)
    bars = (kv_ready, qdo_ready, qdo_empty, p_ready, ds_ready)
    smem = (q_lo_smem, q_hi_smem, do_smem, k_lo_smem, k_hi_smem, v_smem, p_smem, ds_smem, f_smem, dq_smem)
    sizes = (Z, HQ, KZ, M, N)
    tables = (qnb_ptr, qidx_ptr, fqnb_ptr, fqidx_ptr)
    table_meta = (SZ, SH, NUM_KV_BLKS, NUM_Q_BLKS, pack_args[3] if SPARSE.WINDOW_WALK else 0)
    rows = (stats_ptr, dq_acc_ptr, dk_ptr, dv_ptr, M_PAD, pack_args, (dk0_desc, dk1_desc, dv_desc))
    scalars = (sm_scale, qk_scale2, ds_scale)
    mod_bufs = (score_bufs, mask_bufs)
    cta = (cta_args, kv_empty)
    gl.warp_specialize([
        (_consumer_wg0, (descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, cta,
                         SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE, SPARSE, FLAGS, PACK)),
        (_consumer_wg1, (descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, cta,
                         SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE, SPARSE, FLAGS, PACK)),
        (_producer_entry, (descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, cta,
                           SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE, SPARSE, FLAGS, PACK)),
    ], [4, 1], [FLAGS.CONSUMER_REGS, FLAGS.PRODUCER_REGS])
