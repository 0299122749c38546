"""The sm90 backward at head dim 64 with 128 query rows a step (configs.VARIANTS["m128"], ``block_m=128``).

bwd_sm90.py's kernel walks 64 query rows a step; at D = 64 each step's GEMMs are half of D = 128's while its fixed
costs (named barriers, mbarrier hand-offs, wgmma drains, the dQ hand-off that alternates between the warpgroups)
are the same. Here a step is 128 query rows x the CTA's 128 keys, FlashAttention-3's hdim-64 tile
(hopper/flash_bwd_launch_template.h: kBlockM = kBlockN = 128; FA3 computes S transposed, this kernel keeps the
forward's orientation, docs/design/hopper_backward.md, "128 query rows a step at D = 64"). Same launches, scratch
(rows padded to 128), conventions, mods and block-mask walk as bwd_sm90.py (its notation applies; what differs is
below). D = 64 only: at D = 128 the Q / dO ring alone would be 128 KB and dK + dV 128 registers a thread.

Notation (beyond bwd_sm90.py's)
--------
  BLOCK_M = 128              query rows of one step: two halves h of 64 rows (HALF_M), each one 64-row wgmma
  BLOCK_N = 128              keys of one CTA: consumer warpgroup w owns keys [64w, 64w + 64) (HALF_N)

Per step, warpgroup w (keys_w = its 64 keys):

  S_h  = Q[h] K[keys_w]^T          [64 q, 64 keys] x 2 halves, both issued at once; P_0 is made while S_1 runs
  P    -> P_w [128 q, 64 keys] in shared memory (f' of a score_mod: parked in this step's dS buffer, keys_w)
  dP_h = dO[h] V[keys_w]^T         both halves issued, then dV += P_w^T dO (K = 128 query rows)
  dS_h = P_h (dP_h - DELTA) f'     dS_0 made while dP_1 runs -> dS[buf][:, keys_w]; ds_ready
  dK  += dS[:, keys_w]^T Q         (K = 128 query rows)
  dQ[rows_w] = dS[buf][rows_w, :] K     rows_w = [64w, 64w + 64) of the step, all 128 keys: both warpgroups add
                                        a [64, 64] fp32 tile every step (TMA reduce-add), after ds_ready
  dK and dQ are waited together (one drain); then the stage is released and dQ staged and added.

Registers a consumer thread: dK + dV 64 across the loop; S_0 + S_1 (or dP_0 + dP_1) 64; dQ 32.
Shared memory (bf16): K 16 + V 16 + 2 stages x (Q 16 + dO 16) + P 2 x 16 + dS 2 x 32 + dQ staging 2 x 16 (fp32)
= 224 KB; f' adds nothing (it sits in the dS half this warpgroup writes next).

Barriers (as bwd_sm90.py's, every step both warpgroups wait ds_ready):
  kv_ready, qdo_ready[s], qdo_empty[s] (count 2), ds_ready[b] (count 2, b = step % 2)
  Two dS buffers suffice: warpgroup w writes buffer b (f', then dS) at step j + 2 only after its dK_j and dQ_j
  retired (waited at the end of step j) and after it waited ds_ready of step j + 1, which the other warpgroup
  signals only after its step-j dQ retired (waited at the end of its step j). P_w is read only by warpgroup w
  (dV_j retired at the end of step j; the P loads for dS_j precede the named barrier before ds_ready).
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

from .bwd_sm90 import (BwdSchedule, _acc_layout, _ds_factor, _opaque, _probabilities, _producer_entry,
                       _q_tile_counts, _q_tile_start, _tma_reduce_add)

# bwd_sm90's producer walks the grid's (KV tile, K/V head), one K / V buffer: no CTA schedule here (the host's
# schedules are for the 64-row step)
GRID_ORDER = gl.constexpr(BwdSchedule(DQ_TMA=True))


@dataclass(frozen=True)
class M128Tile:
    """Tiles of the 128-row kernel (module docstring). _producer / _q_tile_* read BLOCK_M, BLOCK_N, NUM_STAGES."""
    HEAD_D: int        # 64
    NUM_STAGES: int    # depth of the Q / dO ring (128-row stages)

    @property
    def BLOCK_M(self) -> int:
        return 128

    @property
    def HALF_M(self) -> int:
        return 64

    @property
    def BLOCK_N(self) -> int:
        return 128

    @property
    def HALF_N(self) -> int:
        return 64

    @property
    def DQ_N(self) -> int:
        return self.HEAD_D


@gluon.jit
def _p_half(qk, lse, m0, is_partial, z, hq, n0, M, N, p_dst, f_dst, sm_scale, qk_scale2, score_bufs, mask_bufs,
            WG: gl.constexpr, SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr,
            FLAGS: gl.constexpr, HALF_M: gl.constexpr, HALF_N: gl.constexpr):
    """P (and f') of one 64-row half whose S = ``qk`` (rows m0.., this warpgroup's keys) into ``p_dst`` (and
    ``f_dst``), in 16 bits."""
    s_layout: gl.constexpr = qk.type.layout
    rows_ = gl.arange(0, HALF_M, layout=gl.SliceLayout(1, s_layout))
    q_idx = gl.minimum(m0 + rows_, M - 1)[:, None]
    kv0 = n0 + WG * HALF_N
    # a column vector is HALF_N / 4 registers a thread: made per step, not held across the loop
    kv_idx = gl.minimum(kv0 + _opaque(gl.arange(0, HALF_N, layout=gl.SliceLayout(0, s_layout))), N - 1)[None, :]
    p = _probabilities(qk, lse, z, hq, q_idx, kv_idx, is_partial, sm_scale, qk_scale2, score_bufs, mask_bufs,
                       SCORE_MOD, MASK_MOD, FLAGS)
    dtype: gl.constexpr = p_dst.dtype
    p_dst.store(p.to(dtype))
    _ds_factor(p, qk, f_dst, sm_scale, z, hq, q_idx, kv_idx, score_bufs, SCORE_GRAD, FLAGS, False)   # f' to f_dst


@gluon.jit
def _ds_half(dp, delta, p_src, ds_dst, s_layout: gl.constexpr, HAS_GRAD: gl.constexpr):
    """dS = P (dP - DELTA) f' of one 64-row half into ``ds_dst`` (16 bits); f' is read from ``ds_dst`` itself (the
    same thread reads and then writes each element)."""
    ds = p_src.load(s_layout).to(gl.float32) * (dp - delta[:, None])
    if HAS_GRAD:
        ds = ds * ds_dst.load(s_layout).to(gl.float32)
    ds_dst.store(ds.to(ds_dst.dtype))


@gluon.jit
def _consumer(WG: gl.constexpr, descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs,
              SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr, TILE: gl.constexpr,
              SPARSE: gl.constexpr, FLAGS: gl.constexpr):
    q_desc, do_desc, k_desc, v_desc, dq_desc = descs
    kv_ready, qdo_ready, qdo_empty, ds_ready = bars
    q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, dq_smem = smem
    Z, HQ, KZ, M, N = sizes
    stats_ptr, dq_acc_ptr, dk_ptr, dv_ptr, M_PAD = rows
    sm_scale, qk_scale2, ds_scale = scalars
    score_bufs, mask_bufs = mod_bufs
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    HALF_M: gl.constexpr = TILE.HALF_M
    BLOCK_N: gl.constexpr = TILE.BLOCK_N
    HALF_N: gl.constexpr = TILE.HALF_N
    D: gl.constexpr = TILE.HEAD_D
    NUM_STAGES: gl.constexpr = TILE.NUM_STAGES
    dtype: gl.constexpr = q_desc.dtype
    HAS_GRAD: gl.constexpr = SCORE_GRAD is not None

    s_layout: gl.constexpr = _acc_layout(HALF_N)
    d_layout: gl.constexpr = _acc_layout(D)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    n0 = gl.program_id(0) * BLOCK_N
    kvh = gl.program_id(1)
    HKV = HQ // FLAGS.GQA_GROUP
    kz = kvh // HKV
    hkv = kvh % HKV
    kv_blk = n0 // SPARSE.SPARSE_KV

    dk = gl.zeros([HALF_N, D], gl.float32, layout=d_layout)
    dv = gl.zeros([HALF_N, D], gl.float32, layout=d_layout)
    s_zero = gl.zeros([HALF_M, HALF_N], gl.float32, layout=s_layout)
    dq_zero = gl.zeros([HALF_M, D], gl.float32, layout=d_layout)

    mbarrier.wait(kv_ready, 0)
    cnt = 0
    for hh in range((Z // KZ) * FLAGS.GQA_GROUP):
        z = kz + (hh // FLAGS.GQA_GROUP) * KZ
        hq = hkv * FLAGS.GQA_GROUP + hh % FLAGS.GQA_GROUP
        zh = z * HQ + hq
        n_partial, n_total = _q_tile_counts(z, hq, kv_blk, M, tables, table_meta, TILE, SPARSE)
        for i in range(n_total):
            m0 = _q_tile_start(i, n_partial, z, hq, kv_blk, tables, table_meta, TILE, SPARSE)
            # K, V and P as wgmma operands, indexed by a zero LLVM cannot see through (bwd_sm90.BwdTile.VIEWS_PER_STEP):
            # built before the loop, their descriptors are hoisted and held in vector registers (spills with a mask
            # and a mod)
            zero = _opaque(0)
            p_mine = p_smem.index(WG + zero)                             # [BLOCK_M, HALF_N]
            p_0 = p_mine.slice(0, HALF_M, dim=0)
            p_1 = p_mine.slice(HALF_M, HALF_M, dim=0)
            k_rows = k_smem.index(zero).reshape([BLOCK_N, D])
            v_rows = v_smem.index(zero).reshape([BLOCK_N, D])
            k_t = k_rows.slice(WG * HALF_N, HALF_N, dim=0).permute((1, 0))   # B of S = Q K^T (this warpgroup's keys)
            v_t = v_rows.slice(WG * HALF_N, HALF_N, dim=0).permute((1, 0))   # B of dP = dO V^T
            p_t = p_mine.permute((1, 0))                                     # A of dV += P^T dO  [HALF_N, BLOCK_M]
            st = cnt % NUM_STAGES
            buf = cnt % 2
            is_partial = i < n_partial
            stats = stats_ptr + (zh.to(gl.int64) * (2 * M_PAD) + m0)   # LSE_P of row m0; DELTA_P is M_PAD further
            rows_ = gl.arange(0, HALF_M, layout=row_layout)
            lse_0 = gl.load(stats + rows_)
            lse_1 = gl.load(stats + HALF_M + rows_)
            q_t = q_smem.index(st).reshape([BLOCK_M, D])
            do_t = do_smem.index(st).reshape([BLOCK_M, D])
            ds_tile = ds_smem.index(buf)                                 # [BLOCK_M, BLOCK_N]
            ds_mine = ds_tile.slice(WG * HALF_N, HALF_N, dim=1)          # [BLOCK_M, HALF_N]: this warpgroup's keys
            ds_0 = ds_mine.slice(0, HALF_M, dim=0)
            ds_1 = ds_mine.slice(HALF_M, HALF_M, dim=0)
            mbarrier.wait(qdo_ready.index(st), (cnt // NUM_STAGES) & 1)
            q_0 = q_t.slice(0, HALF_M, dim=0)
            q_1 = q_t.slice(HALF_M, HALF_M, dim=0)
            s0_tok = warpgroup_mma(q_0, k_t, s_zero, use_acc=False, is_async=True)
            s1_tok = warpgroup_mma(q_1, k_t, s_zero, use_acc=False, is_async=True)
            qk0, _q0, _k0 = warpgroup_mma_wait(1, deps=[s0_tok, q_0, k_t])
            # P of the first half while the second half's S runs
            _p_half(qk0, lse_0, m0, is_partial, z, hq, n0, M, N, p_0, ds_0, sm_scale, qk_scale2, score_bufs,
                    mask_bufs, WG, SCORE_MOD, SCORE_GRAD, MASK_MOD, FLAGS, HALF_M, HALF_N)
            qk1, _q1, _k1 = warpgroup_mma_wait(0, deps=[s1_tok, q_1, k_t])
            _p_half(qk1, lse_1, m0 + HALF_M, is_partial, z, hq, n0, M, N, p_1, ds_1, sm_scale, qk_scale2,
                    score_bufs, mask_bufs, WG, SCORE_MOD, SCORE_GRAD, MASK_MOD, FLAGS, HALF_M, HALF_N)
            fence_async_shared()
            gl.thread_barrier()        # every thread's part of P is in shared memory before the wgmma reads it
            do_0 = do_t.slice(0, HALF_M, dim=0)
            do_1 = do_t.slice(HALF_M, HALF_M, dim=0)
            dp0_tok = warpgroup_mma(do_0, v_t, s_zero, use_acc=False, is_async=True)
            dp1_tok = warpgroup_mma(do_1, v_t, s_zero, use_acc=False, is_async=True)
            dv_tok = warpgroup_mma(p_t, do_t, dv, is_async=True)
            delta_0 = gl.load(stats + M_PAD + rows_)
            delta_1 = gl.load(stats + M_PAD + HALF_M + rows_)
            dp0, _do0, _v0 = warpgroup_mma_wait(2, deps=[dp0_tok, do_0, v_t])
            # dS of the first half while the second half's dP (and dV) run
            _ds_half(dp0, delta_0, p_0, ds_0, s_layout, HAS_GRAD)
            dp1, _do1, _v1 = warpgroup_mma_wait(1, deps=[dp1_tok, do_1, v_t])
            _ds_half(dp1, delta_1, p_1, ds_1, s_layout, HAS_GRAD)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(ds_ready.index(buf), count=1)
            dk_tok = warpgroup_mma(ds_mine.permute((1, 0)), q_t, dk, is_async=True)
            # dQ of this warpgroup's 64 query rows over all 128 keys: both halves of dS
            ds_rows = ds_tile.slice(WG * HALF_M, HALF_M, dim=0)         # [HALF_M, BLOCK_N]
            mbarrier.wait(ds_ready.index(buf), (cnt // 2) & 1)
            dq_tok = warpgroup_mma(ds_rows, k_rows, dq_zero, use_acc=False, is_async=True)
            dv, dk, dq, _p, _ds, _do, _q, _dr, _kr = warpgroup_mma_wait(
                0, deps=[dv_tok, dk_tok, dq_tok, p_t, ds_mine, do_t, q_t, ds_rows, k_rows])
            mbarrier.arrive(qdo_empty.index(st), count=1)
            stage = dq_smem.index(WG)                    # [1, HALF_M, D]
            tma.store_wait(0)                            # the previous reduce has read this warpgroup's tile
            stage.reshape([HALF_M, D]).store(dq)
            fence_async_shared()
            _tma_reduce_add(dq_desc, [zh, m0 + WG * HALF_M, 0], stage)
            cnt += 1

    # dK, dV: one store per output tile (rows past N clipped); dK takes the scale and f's factor here.
    out_rows = n0 + WG * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, d_layout))[:, None]
    out_cols = gl.arange(0, D, layout=gl.SliceLayout(0, d_layout))[None, :]
    keep = (out_rows < N) & (out_cols < D)
    head = (kz * HKV + hkv).to(gl.int64) * N * D     # dK, dV are contiguous (the host sees to it)
    gl.store(dk_ptr + head + out_rows * D + out_cols, (dk * ds_scale).to(dtype), mask=keep)
    gl.store(dv_ptr + head + out_rows * D + out_cols, dv.to(dtype), mask=keep)
    tma.store_wait(0)   # the last dQ reduce has read the staging tile before the CTA exits


@gluon.jit
def _consumer_wg0(descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs,
                  SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr, TILE: gl.constexpr,
                  SPARSE: gl.constexpr, FLAGS: gl.constexpr):
    _consumer(0, descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, SCORE_MOD, SCORE_GRAD,
              MASK_MOD, TILE, SPARSE, FLAGS)


@gluon.jit
def _consumer_wg1(descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs,
                  SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr, TILE: gl.constexpr,
                  SPARSE: gl.constexpr, FLAGS: gl.constexpr):
    _consumer(1, descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, SCORE_MOD, SCORE_GRAD,
              MASK_MOD, TILE, SPARSE, FLAGS)


@gluon.jit(do_not_specialize=["Z", "KZ", "M", "N", "M_PAD", "NUM_KV_BLKS", "NUM_Q_BLKS"])
def fa3_bwd_sm90_m128_kernel(
    q_desc, do_desc, k_desc, v_desc, dq_desc,       # Q, dO by [1, 1, 128, D]; K, V by [1, 1, 128, D];
    stats_ptr, dq_acc_ptr, dk_ptr, dv_ptr,          # dq_desc: DQ_ACC [Z * HQ, M_PAD, D] by [1, 64, D]
    qnb_ptr, qidx_ptr, fqnb_ptr, fqidx_ptr,
    score_bufs, mask_bufs,
    Z, HQ, KZ, M, N, M_PAD, SZ, SH, NUM_KV_BLKS, NUM_Q_BLKS,
    sm_scale, qk_scale2, ds_scale,
    SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr,   # @gluon.jit mods or None
    TILE: gl.constexpr,      # M128Tile
    SPARSE: gl.constexpr,    # bwd_sm90.BwdSparsity (Q_TILES_PER_BLK = SPARSE_Q // 128)
    FLAGS: gl.constexpr,     # bwd_sm90.BwdFlags
):
    NUM_STAGES: gl.constexpr = TILE.NUM_STAGES
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    BLOCK_N: gl.constexpr = TILE.BLOCK_N
    HALF_N: gl.constexpr = TILE.HALF_N
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [1] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1] + v_desc.block_type.shape, v_desc.layout)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF_N], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HALF_N], p_layout)        # P of each warpgroup
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)

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

    descs = (q_desc, do_desc, k_desc, v_desc, dq_desc)
    bars = (kv_ready, qdo_ready, qdo_empty, ds_ready)
    smem = (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, dq_smem)
    sizes = (Z, HQ, KZ, M, N)
    tables = (qnb_ptr, qidx_ptr, fqnb_ptr, fqidx_ptr)
    table_meta = (SZ, SH, NUM_KV_BLKS, NUM_Q_BLKS, 0)   # (no SPARSE.WINDOW_WALK: dense launches only)
    rows = (stats_ptr, dq_acc_ptr, dk_ptr, dv_ptr, M_PAD)
    scalars = (sm_scale, qk_scale2, ds_scale)
    mod_bufs = (score_bufs, mask_bufs)
    gl.warp_specialize([
        (_consumer_wg0, (descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs,
                         SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE, SPARSE, FLAGS)),
        (_consumer_wg1, (descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs,
                         SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE, SPARSE, FLAGS)),
        (_producer_entry, (descs, bars, smem, sizes, tables, table_meta, rows, scalars, mod_bufs, (),
                           SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE, SPARSE, FLAGS, GRID_ORDER)),   # bwd_sm90's
    ], [4, 1], [FLAGS.CONSUMER_REGS, FLAGS.PRODUCER_REGS])
