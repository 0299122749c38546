"""The sm90 backward for q/k 192 with v 128 on 96-key tiles: three consumer warpgroups of 32 keys, dK and dV
accumulated transposed.

Why (docs/design/hopper_backward.md, "The dQ reductions' rate bounds the wide kernel"): bwd_sm90_wide.py adds a query
row's dQ once per 64-key tile, and at 192 / 128 those fp32 reductions alone take 84-91% of its main kernel's time
(L2 takes them at ~3.8 TB/s at best). A CTA of 96 keys adds 2/3 of them. Triton tensors and shared tiles have
power-of-two shapes, so the 96 keys are three warpgroups of 32 (FA3's hdim-192 tile has two of 48). A warpgroup's dK
and dV rows for its 32 keys would be an M = 32 wgmma (wgmma's M is 64): they are accumulated transposed, dK^T = Q^T dS
and dV^T = dO^T P, with the head dim as M. Same launches, scratch, conventions and mods as bwd_sm90.py (its notation
applies; what differs is below).

Notation (beyond bwd_sm90.py's)
--------
  BLOCK_N = 96               keys of one CTA; warpgroup w owns keys [32w, 32w + 32) (KEYS_WG) for everything but dQ
  BLOCK_M = 64               query rows of one step
  LO, HI = 128, 64           Q and K sit in shared tiles of 128 and 64 columns (192 is no power of two)
  K_w, V_w                   warpgroup w's 32 key rows, each its own shared tile (three TMA boxes a tile)
  dQ columns of w            [64w, 64w + 64): K_lo's halves for w = 0, 1, K_hi for w = 2; one 64 x 64 fp32 chunk a
                             step, summed over all three warpgroups' dS (K = 96 keys as three wgmmas of 32)
  CAUSAL                     an exactly causal mask_mod, no tables: a CTA's query tiles start at the one holding its
                             first key; the tiles that meet its 96 keys' diagonal (two) apply the mask
  DQ_LAG                     step j's dQ issued in step j + 1, after its P and beside its dP and dV (waiting for step
                             j's ds_ready there); a tile's last dQ after its loop, its first step's chunk dropped.
                             The default of softcap without a mask (configs.WIDE_KV96_LAG); with PERSISTENT and
                             DKDV_TMA, of launches without a score_mod or a mask (WIDE_PLAIN_KV96_PERSISTENT)
  PERSISTENT                 min(#SMs, #tiles) CTAs walking host-made lists of (96-key tile, K/V head) tiles,
                             longest first (host._shape_schedule); kv_empty releases K and V between tiles
  DKDV_TMA                   a warpgroup's dK and dV rows go out through its 16 KB dQ staging tile (free after the
                             tile's last reduce-add) as bf16 [32, 128] / [32, 64] boxes, by TMA stores. With PERSISTENT
                             (no DQ_LAG), the default of exactly causal launches without a score_mod (WIDE_CAUSAL_KV96)

Per step (64 query rows x 96 keys), warpgroup w:

  S_w    = Q K_w^T                 [64 q, 32 keys]   P_w = exp2(...) -> its own P tile (shared), dS's factor kept
  dP_w   = dO V_w^T                [64, 32]
  dV_w^T += dO^T P_w               [128 dv, 32 keys]  A = dO^T (the dO tile transposed), B = P_w
  dS_w   = P_w (dP_w - DELTA) f'   -> dS tile (w, step % 2), ds_ready
  dK_w^T += Q^T dS_w               [128, 32] + [64, 32] (Q_lo^T, Q_hi^T)
  dQ[:, 64w:64w+64] = sum_v dS_v K_v[:, 64w:64w+64]   after ds_ready (all three dS), TMA reduce-add (DQ_FRAG order)

Work a warpgroup and step, in 64^3 wgmma units: S 1.5, dP 1, dV 1, dK 1.5, dQ 1.5 = 6.5 (the wide kernel's 6.5 on
64 keys with two warpgroups). Registers a consumer thread (setmaxnreg 160: 3 x 128 x 160 + 128 x 24 <= 64K): dV^T 32,
dK^T 48 across the loop; per step S / dP 16 each, P · f' 16, dQ 32.

Barriers (shared memory):
  kv_ready        (count 1, TMA tx)  K_w, V_w of the three warpgroups landed        producer -> consumers
  qdo_ready[s]    (count 1, TMA tx)  ring stage s holds this step's Q and dO        producer -> consumers
  qdo_empty[s]    (count 3)          the three warpgroups' wgmmas reading stage s retired consumers -> producer
  ds_ready[b]     (count 3)          the three dS tiles of buffer b are written      consumers <-> consumers
  kv_empty        (count 3)          PERSISTENT: every wgmma reading the tile's K, V retired    consumers -> producer
  A warpgroup's P tile is rewritten the next step, after its own dV wgmma retired. A dS tile of buffer b is rewritten
  two steps on, after its warpgroup waited ds_ready of the step between, which the others signal only after their
  dQ wgmmas of this step (the readers of buffer b) retired. With DQ_LAG the same holds a step later: step j's dQ
  retires in step j + 1 before that step's ds_ready arrive, and buffer b is rewritten in step j + 2 after the wait
  for step j + 1's ds_ready.

Compile-time parameters: TILE K96Tile; FLAGS as in bwd_sm90.py. No block-mask tables or packed sequences (those
launches take bwd_sm90_wide.py).
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

from .bwd_sm90 import (DENSE, _acc_layout, _cta_tiles, _ds, _ds_factor, _frag_reduce_add, _lse_rows, _opaque,
                       _persistent_tile, _probabilities)

_DENSE = gl.constexpr(DENSE)   # the rows of a dense launch (_lse_rows)


@dataclass(frozen=True)
class K96Tile:
    """Tiles of the 96-key kernel (module docstring)."""
    NUM_STAGES: int = 2    # depth of the Q / dO ring
    CAUSAL: bool = False   # an exactly causal mask_mod, walked from each tile's diagonal without tables
    DQ_LAG: bool = False   # a step's dQ issued in the next step, under its dP and dV (the warpgroups meet at ds_ready a
                           # step later than they use it)
    PERSISTENT: bool = False   # #SMs CTAs, each walking a host-made list of (KV tile, K/V head) tiles (bwd_sm90_wide's
                               # PERSISTENT): the next tile's K and V load while this one's dK and dV are stored
    DKDV_TMA: bool = False     # dK and dV rows written through the warpgroup's dQ staging tile by TMA stores (else
                               # 2-byte stores from the transposed accumulators, 80 a thread)

    @property
    def BLOCK_M(self) -> int:
        return 64

    @property
    def BLOCK_N(self) -> int:
        return 96

    @property
    def KEYS_WG(self) -> int:
        return 32

    @property
    def HEAD_D(self) -> int:
        return 192

    @property
    def HEAD_DV(self) -> int:
        return 128

    @property
    def LO(self) -> int:
        return 128

    @property
    def HI(self) -> int:
        return 64


@gluon.jit
def _walk(n0, M, TILE: gl.constexpr):
    """(first, partial_end, n_total): this CTA's query tiles are [first, n_total); those below partial_end apply the
    mask_mod. CAUSAL: from the tile holding key n0 on; the tiles whose first row lies before the CTA's last key are
    partial (two)."""
    n_total = gl.cdiv(M, TILE.BLOCK_M)
    if TILE.CAUSAL:
        first = gl.minimum(n0 // TILE.BLOCK_M, n_total)
        partial_end = gl.minimum((n0 + TILE.BLOCK_N - 2) // TILE.BLOCK_M + 1, n_total)
    else:
        first = n_total * 0
        partial_end = n_total * 0
    return first, partial_end, n_total


# ----------------------------------------------------------------------------------------------
# Producer: one warp issuing TMA.
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _producer(descs, bars, smem, sizes, cta, TILE: gl.constexpr, FLAGS: gl.constexpr):
    """The CTA's tile (PERSISTENT: its tiles in turn, each one's K and V once the three warpgroups are done with the
    last one's, kv_empty)."""
    N = sizes[4]
    if TILE.PERSISTENT:
        first, n_my = _cta_tiles(cta)
        cnt = first * 0
        for t in range(n_my):
            kv_tile, kvh = _persistent_tile(cta, first + t, N, TILE)
            mbarrier.wait(cta[1], (t & 1) ^ 1)
            cnt = _producer_tile(kv_tile * TILE.BLOCK_N, kvh, cnt, descs, bars, smem, sizes, TILE, FLAGS)
    else:
        n0 = gl.program_id(0) * TILE.BLOCK_N
        _producer_tile(n0, gl.program_id(1), n0 * 0, descs, bars, smem, sizes, TILE, FLAGS)


@gluon.jit
def _producer_tile(n0, kvh, cnt, descs, bars, smem, sizes, TILE: gl.constexpr, FLAGS: gl.constexpr):
    """The three warpgroups' K and V rows of keys n0.. of K / V head kvh, then every query head's steps' Q and dO (the
    consumers' walk), the Q / dO ring from its step cnt on; returns the next cnt."""
    q_lo_desc, q_hi_desc, do_desc, k_lo_desc, k_hi_desc, v_desc, dq_desc = descs
    kv_ready, qdo_ready, qdo_empty, ds_ready = bars
    q_lo_smem, q_hi_smem, do_smem, k_lo_smem, k_hi_smem, v_smem, p_smem, ds_smem, dq_smem = smem
    Z, HQ, KZ, M, N = sizes
    NUM_STAGES: gl.constexpr = TILE.NUM_STAGES
    HKV = HQ // FLAGS.GQA_GROUP
    kz = kvh // HKV
    hkv = kvh % HKV
    kv_bytes: gl.constexpr = 3 * (k_lo_desc.block_type.nbytes + k_hi_desc.block_type.nbytes + v_desc.block_type.nbytes)
    qdo_bytes: gl.constexpr = q_lo_desc.block_type.nbytes + q_hi_desc.block_type.nbytes + do_desc.block_type.nbytes
    mbarrier.expect(kv_ready, kv_bytes)
    for w in gl.static_range(3):
        row = n0 + w * TILE.KEYS_WG
        tma.async_copy_global_to_shared(k_lo_desc, [kz, hkv, row, 0], kv_ready, k_lo_smem.index(w))
        tma.async_copy_global_to_shared(k_hi_desc, [kz, hkv, row, TILE.LO], kv_ready, k_hi_smem.index(w))
        tma.async_copy_global_to_shared(v_desc, [kz, hkv, row, 0], kv_ready, v_smem.index(w))
    first, partial_end, n_total = _walk(n0, M, TILE)
    for hh in range((Z // KZ) * FLAGS.GQA_GROUP):
        z = kz + (hh // FLAGS.GQA_GROUP) * KZ
        hq = hkv * FLAGS.GQA_GROUP + hh % FLAGS.GQA_GROUP
        for i in range(first, n_total):
            m0 = i * TILE.BLOCK_M
            st = cnt % NUM_STAGES
            mbarrier.wait(qdo_empty.index(st), ((cnt // NUM_STAGES) & 1) ^ 1)
            mbarrier.expect(qdo_ready.index(st), qdo_bytes)
            tma.async_copy_global_to_shared(q_lo_desc, [z, hq, m0, 0], qdo_ready.index(st), q_lo_smem.index(st))
            tma.async_copy_global_to_shared(q_hi_desc, [z, hq, m0, TILE.LO], qdo_ready.index(st), q_hi_smem.index(st))
            tma.async_copy_global_to_shared(do_desc, [z, hq, m0, 0], qdo_ready.index(st), do_smem.index(st))
            cnt += 1
    return cnt


# ----------------------------------------------------------------------------------------------
# Consumers: 32 keys each, dK^T and dV^T of those keys, 64 columns of dQ.
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _consumer(WG: gl.constexpr, descs, bars, smem, sizes, rows, scalars, mod_bufs, cta, SCORE_MOD: gl.constexpr,
              SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr, TILE: gl.constexpr, FLAGS: gl.constexpr):
    """Warpgroup WG: the CTA's tile (PERSISTENT: its tiles in turn)."""
    N = sizes[4]
    if TILE.PERSISTENT:
        first, n_my = _cta_tiles(cta)
        cnt = first * 0
        for t in range(n_my):
            kv_tile, kvh = _persistent_tile(cta, first + t, N, TILE)
            cnt = _consumer_tile(WG, kv_tile * TILE.BLOCK_N, kvh, t & 1, cnt, descs, bars, smem, sizes, rows, scalars,
                                 mod_bufs, cta, SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE, FLAGS)
    else:
        n0 = gl.program_id(0) * TILE.BLOCK_N
        _consumer_tile(WG, n0, gl.program_id(1), 0, n0 * 0, descs, bars, smem, sizes, rows, scalars, mod_bufs, cta,
                       SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE, FLAGS)
    tma.store_wait(0)   # the last reduce-add has read the staging tile before the CTA exits


@gluon.jit
def _consumer_tile(WG: gl.constexpr, n0, kvh, kv_phase, cnt, descs, bars, smem, sizes, rows, scalars, mod_bufs, cta,
                   SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr, TILE: gl.constexpr,
                   FLAGS: gl.constexpr):
    """Every query head's steps over keys n0.. of K / V head kvh (kv_ready's phase kv_phase; cnt: the CTA's steps so
    far, for the ring stage and dS buffer), then this warpgroup's keys' dK and dV rows stored; returns the next cnt."""
    q_lo_desc, q_hi_desc, do_desc, k_lo_desc, k_hi_desc, v_desc, dq_desc = descs
    kv_ready, qdo_ready, qdo_empty, ds_ready = bars
    q_lo_smem, q_hi_smem, do_smem, k_lo_smem, k_hi_smem, v_smem, p_smem, ds_smem, dq_smem = smem
    Z, HQ, KZ, M, N = sizes
    stats_ptr, dk_ptr, dv_ptr, M_PAD, out_descs = rows
    sm_scale, qk_scale2, ds_scale = scalars
    score_bufs, mask_bufs = mod_bufs
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    KEYS_WG: gl.constexpr = TILE.KEYS_WG
    LO: gl.constexpr = TILE.LO
    HI: gl.constexpr = TILE.HI
    NUM_STAGES: gl.constexpr = TILE.NUM_STAGES
    HEAD_DV: gl.constexpr = TILE.HEAD_DV
    dtype: gl.constexpr = q_lo_desc.dtype
    HKV = HQ // FLAGS.GQA_GROUP
    kz = kvh // HKV
    hkv = kvh % HKV
    kv0 = n0 + WG * KEYS_WG   # this warpgroup's first key

    s_layout: gl.constexpr = _acc_layout(KEYS_WG)          # [64, 32]; also dK^T / dV^T ([128 or 64, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dq_layout: gl.constexpr = _acc_layout(64)
    s_zero = gl.zeros([BLOCK_M, KEYS_WG], gl.float32, layout=s_layout)
    dq_zero = gl.zeros([BLOCK_M, 64], gl.float32, layout=dq_layout)
    dv_t = gl.zeros([HEAD_DV, KEYS_WG], gl.float32, layout=s_layout)
    dk_lo = gl.zeros([LO, KEYS_WG], gl.float32, layout=s_layout)
    dk_hi = gl.zeros([HI, KEYS_WG], gl.float32, layout=s_layout)
    rows_ = gl.arange(0, BLOCK_M, layout=row_layout)
    cols_ = gl.arange(0, KEYS_WG, layout=gl.SliceLayout(0, s_layout))

    first, partial_end, n_total = _walk(n0, M, TILE)
    mbarrier.wait(kv_ready, kv_phase)
    cnt0 = cnt
    prev_zh = n0 * 0   # DQ_LAG: the head and first row of the step whose dQ is pending
    prev_m0 = n0 * 0
    for hh in range((Z // KZ) * FLAGS.GQA_GROUP):
        z = kz + (hh // FLAGS.GQA_GROUP) * KZ
        hq = hkv * FLAGS.GQA_GROUP + hh % FLAGS.GQA_GROUP
        zh = z * HQ + hq
        stats_h = stats_ptr + zh.to(gl.int64) * (2 * M_PAD)   # LSE_P of the head; DELTA_P is M_PAD further
        for i in range(first, n_total):
            m0 = i * BLOCK_M
            st = cnt % NUM_STAGES
            buf = cnt % 2
            # the shared tiles as wgmma operands, built per step from a zero LLVM cannot see through (bwd_sm90's
            # VIEWS_PER_STEP: hoisted, their descriptors are held in registers)
            zero = _opaque(0)
            q_lo = q_lo_smem.index(st + zero).reshape([BLOCK_M, LO])
            q_hi = q_hi_smem.index(st + zero).reshape([BLOCK_M, HI])
            do_t = do_smem.index(st + zero).reshape([BLOCK_M, HEAD_DV])
            k_lo_w = k_lo_smem.index(WG + zero).reshape([KEYS_WG, LO])
            k_hi_w = k_hi_smem.index(WG + zero).reshape([KEYS_WG, HI])
            v_w = v_smem.index(WG + zero).reshape([KEYS_WG, HEAD_DV])
            p_w = p_smem.index(WG + zero)
            ds_w = ds_smem.index(buf * 3 + WG + zero)
            lse = _lse_rows(stats_h, m0, rows_, M, _DENSE)
            q_idx = gl.minimum(m0 + rows_, M - 1)[:, None]
            # key positions made per step (through the opaque zero): held across the loop, causal spilled
            kv_idx = gl.minimum(kv0 + zero + cols_, N - 1)[None, :]

            mbarrier.wait(qdo_ready.index(st), (cnt // NUM_STAGES) & 1)
            s_tok = warpgroup_mma(q_lo, k_lo_w.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s_tok = warpgroup_mma(q_hi, k_hi_w.permute((1, 0)), s_tok, is_async=True)
            qk, _ql, _qh, _kl, _kh = warpgroup_mma_wait(0, deps=[s_tok, q_lo, q_hi, k_lo_w, k_hi_w])
            p = _probabilities(qk, lse, z, hq, q_idx, kv_idx, i < partial_end, sm_scale, qk_scale2, score_bufs,
                               mask_bufs, SCORE_MOD, MASK_MOD, FLAGS)
            p_w.store(p.to(dtype))
            p_ds = _ds_factor(p, qk, p_w, sm_scale, z, hq, q_idx, kv_idx, score_bufs, SCORE_GRAD, FLAGS, True)
            fence_async_shared()
            gl.thread_barrier()
            if TILE.DQ_LAG:   # the step before's dQ, under this step's dP and dV (its dS buffer: the other one)
                # step cnt - 1's buffer and phase, from cnt + 1 and cnt + 3 (no negative division; on the CTA's first
                # step that phase counts as completed; on a tile's first step the chunk is dropped)
                prev = cnt + 1
                mbarrier.wait(ds_ready.index(prev % 2), ((cnt + 3) // 2) & 1)
                dq_tok = _dq_issue(prev % 2, zero, k_lo_smem, k_hi_smem, ds_smem, dq_zero, WG, TILE)
            dp_tok = warpgroup_mma(do_t, v_w.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            do_tt = do_t.permute((1, 0))
            dv_tok = warpgroup_mma(do_tt, p_w, dv_t, is_async=True)
            delta = gl.load(stats_h + M_PAD + m0 + rows_)
            if TILE.DQ_LAG:
                dq = warpgroup_mma_wait(2, deps=[dq_tok])
                if cnt > cnt0:   # (the tile's first step: no step before it in this tile)
                    tma.store_wait(0)   # the last reduce-add has read the staging tile
                    _frag_reduce_add(dq, dq_smem.index(WG), dq_desc, prev_zh, prev_m0, WG * 64, TILE.HEAD_D)
            dp, _do, _v = warpgroup_mma_wait(1, deps=[dp_tok, do_t, v_w])
            ds = _ds(dp, delta, p_ds, p_w, p_w, s_layout, SCORE_GRAD is not None, True)
            ds_w.store(ds.to(dtype))
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(ds_ready.index(buf), count=1)
            q_lo_t = q_lo.permute((1, 0))
            q_hi_t = q_hi.permute((1, 0))
            dk_lo_tok = warpgroup_mma(q_lo_t, ds_w, dk_lo, is_async=True)
            dk_hi_tok = warpgroup_mma(q_hi_t, ds_w, dk_hi, is_async=True)
            dv_t, dk_lo, dk_hi, _dt, _pw, _a, _b, _c = warpgroup_mma_wait(
                0, deps=[dv_tok, dk_lo_tok, dk_hi_tok, do_tt, p_w, q_lo_t, q_hi_t, ds_w])
            mbarrier.arrive(qdo_empty.index(st), count=1)
            if TILE.DQ_LAG:
                prev_zh = zh
                prev_m0 = m0
            else:
                mbarrier.wait(ds_ready.index(buf), (cnt // 2) & 1)
                dq = warpgroup_mma_wait(0, deps=[_dq_issue(buf, zero, k_lo_smem, k_hi_smem, ds_smem, dq_zero, WG,
                                                           TILE)])
                tma.store_wait(0)   # the last reduce-add has read the staging tile
                _frag_reduce_add(dq, dq_smem.index(WG), dq_desc, zh, m0, WG * 64, TILE.HEAD_D)
            cnt += 1
    if TILE.DQ_LAG:   # the tile's last step's dQ (K is the tile's: before kv_empty)
        if cnt > cnt0:
            zero = _opaque(0)
            mbarrier.wait(ds_ready.index((cnt + 1) % 2), ((cnt - 1) // 2) & 1)
            dq = warpgroup_mma_wait(0, deps=[_dq_issue((cnt + 1) % 2, zero, k_lo_smem, k_hi_smem, ds_smem, dq_zero,
                                                       WG, TILE)])
            tma.store_wait(0)
            _frag_reduce_add(dq, dq_smem.index(WG), dq_desc, prev_zh, prev_m0, WG * 64, TILE.HEAD_D)
    if TILE.PERSISTENT:   # every wgmma reading this tile's K and V has retired (each step ends on a wait of 0)
        mbarrier.arrive(cta[1], count=1)
    if TILE.DKDV_TMA:
        _store_dk_dv_tma(dk_lo, dk_hi, dv_t, kv0, kz, hkv, out_descs, dq_smem.index(WG), ds_scale, dtype)
    else:
        _store_dk_dv(dk_lo, dk_hi, dv_t, kv0, kz, hkv, HKV, N, dk_ptr, dv_ptr, ds_scale, dtype, s_layout, TILE)
    return cnt


@gluon.jit
def _dq_issue(buf, zero, k_lo_smem, k_hi_smem, ds_smem, dq_zero, WG: gl.constexpr, TILE: gl.constexpr):
    """Issue dQ[:, 64 WG : 64 WG + 64] = sum over the three warpgroups' keys v of dS_v (buffer buf) K_v[:, those
    columns]: three wgmmas into one accumulator; returns its token."""
    KEYS_WG: gl.constexpr = TILE.KEYS_WG
    LO: gl.constexpr = TILE.LO
    HI: gl.constexpr = TILE.HI
    tok = dq_zero
    for v in gl.static_range(3):
        ds_v = ds_smem.index(buf * 3 + v + zero)
        if WG == 2:
            k_cols = k_hi_smem.index(v + zero).reshape([KEYS_WG, HI])
        else:
            k_cols = k_lo_smem.index(v + zero).reshape([KEYS_WG, LO]).slice(WG * 64, 64, dim=1)
        tok = warpgroup_mma(ds_v, k_cols, tok, use_acc=v > 0, is_async=True)
    return tok


@gluon.jit
def _store_dk_dv(dk_lo, dk_hi, dv_t, kv0, kz, hkv, HKV, N, dk_ptr, dv_ptr, ds_scale, dtype: gl.constexpr,
                 layout: gl.constexpr, TILE: gl.constexpr):
    """This warpgroup's 32 keys' dK and dV rows from the transposed accumulators (element (d, key) of dK^T to
    dK[key, d]); keys past N clipped. dK takes the scale and f's factor here. [KZ, HKV, N, D] contiguous."""
    KEYS_WG: gl.constexpr = TILE.KEYS_WG
    LO: gl.constexpr = TILE.LO
    HI: gl.constexpr = TILE.HI
    HEAD_D: gl.constexpr = TILE.HEAD_D
    HEAD_DV: gl.constexpr = TILE.HEAD_DV
    keys = kv0 + gl.arange(0, KEYS_WG, layout=gl.SliceLayout(0, layout))[None, :]
    head = (kz * HKV + hkv).to(gl.int64) * N
    d_lo = gl.arange(0, LO, layout=gl.SliceLayout(1, layout))[:, None]
    d_hi = LO + gl.arange(0, HI, layout=gl.SliceLayout(1, layout))[:, None]
    d_v = gl.arange(0, HEAD_DV, layout=gl.SliceLayout(1, layout))[:, None]
    keep = keys < N
    gl.store(dk_ptr + (head + keys) * HEAD_D + d_lo, (dk_lo * ds_scale).to(dtype), mask=keep)
    gl.store(dk_ptr + (head + keys) * HEAD_D + d_hi, (dk_hi * ds_scale).to(dtype), mask=keep)
    gl.store(dv_ptr + (head + keys) * HEAD_DV + d_v, dv_t.to(dtype), mask=keep)


@gluon.jit
def _store_dk_dv_tma(dk_lo, dk_hi, dv_t, kv0, kz, hkv, out_descs, stage, ds_scale, dtype: gl.constexpr):
    """This warpgroup's 32 keys' dK and dV rows through its fp32 dQ staging tile ``stage`` (16 KB: dK's first 128
    columns and dV, then dK's last 64) and TMA stores (keys past N clipped by the descriptors). dK takes the scale and
    f's factor here."""
    dk_lo_desc, dk_hi_desc, dv_desc = out_descs
    tma.store_wait(0)   # the tile's last reduce-add has read the staging tile
    pair = stage._reinterpret(dtype, [2] + dk_lo_desc.block_type.shape, dk_lo_desc.layout)
    pair.index(0).reshape([32, 128]).store(gl.permute((dk_lo * ds_scale).to(dtype), (1, 0)))
    pair.index(1).reshape([32, 128]).store(gl.permute(dv_t.to(dtype), (1, 0)))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(dk_lo_desc, [kz, hkv, kv0, 0], pair.index(0))
    tma.async_copy_shared_to_global(dv_desc, [kz, hkv, kv0, 0], pair.index(1))
    tma.store_wait(0)
    gl.thread_barrier()
    hi = stage._reinterpret(dtype, dk_hi_desc.block_type.shape, dk_hi_desc.layout)
    hi.reshape([32, 64]).store(gl.permute((dk_hi * ds_scale).to(dtype), (1, 0)))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(dk_hi_desc, [kz, hkv, kv0, 128], hi)


@gluon.jit
def _producer_entry(descs, bars, smem, sizes, rows, scalars, mod_bufs, cta, SCORE_MOD: gl.constexpr,
                    SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr, TILE: gl.constexpr, FLAGS: gl.constexpr):
    _producer(descs, bars, smem, sizes, cta, TILE, FLAGS)


_RUNTIME_SIZES = ["Z", "KZ", "M", "N", "M_PAD"]


@gluon.jit(do_not_specialize=_RUNTIME_SIZES)
def fa3_bwd_sm90_k96_kernel(
    q_lo_desc, q_hi_desc, do_desc, k_lo_desc, k_hi_desc, v_desc, dq_desc,   # K, V by 32-row boxes; dq_desc: DQ_FRAG's
    stats_ptr, dk_ptr, dv_ptr,
    dk_lo_desc, dk_hi_desc, dv_desc,   # TILE.DKDV_TMA: dK by [1, 1, 32, 128] and [1, 1, 32, 64] boxes, dV by [1, 1, 32,
                                       # 128] (top-level arguments: the launcher expands no descriptor in a tuple); None
    score_bufs, mask_bufs,
    Z, HQ, KZ, M, N, M_PAD,
    sm_scale, qk_scale2, ds_scale,
    cta_args,                # TILE.PERSISTENT: (offsets int32 [#CTAs + 1], tiles int32), host._shape_schedule; ()
    SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr,
    TILE: gl.constexpr,      # K96Tile
    FLAGS: gl.constexpr,     # bwd_sm90.BwdFlags
):
    NUM_STAGES: gl.constexpr = TILE.NUM_STAGES
    dtype: gl.constexpr = q_lo_desc.dtype
    q_lo_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + q_lo_desc.block_type.shape, q_lo_desc.layout)
    q_hi_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + q_hi_desc.block_type.shape, q_hi_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_lo_smem = gl.allocate_shared_memory(dtype, [3] + k_lo_desc.block_type.shape, k_lo_desc.layout)
    k_hi_smem = gl.allocate_shared_memory(dtype, [3] + k_hi_desc.block_type.shape, k_hi_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [3] + v_desc.block_type.shape, v_desc.layout)
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    KEYS_WG: gl.constexpr = TILE.KEYS_WG
    pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, KEYS_WG], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [3, BLOCK_M, KEYS_WG], pds_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [6, BLOCK_M, KEYS_WG], pds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [3] + dq_desc.block_type.shape, dq_desc.layout)

    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    qdo_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(qdo_ready.index(s), count=1)
        mbarrier.init(qdo_empty.index(s), count=3)
    for b in gl.static_range(2):
        mbarrier.init(ds_ready.index(b), count=3)
    if TILE.PERSISTENT:   # the three warpgroups are done with the tile's K and V (the next tile's may load)
        kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_empty, count=3)
    else:
        kv_empty = kv_ready   # (unused)

    descs = (q_lo_desc, q_hi_desc, do_desc, k_lo_desc, k_hi_desc, v_desc, dq_desc)
    bars = (kv_ready, qdo_ready, qdo_empty, ds_ready)
    smem = (q_lo_smem, q_hi_smem, do_smem, k_lo_smem, k_hi_smem, v_smem, p_smem, ds_smem, dq_smem)
    sizes = (Z, HQ, KZ, M, N)
    rows = (stats_ptr, dk_ptr, dv_ptr, M_PAD, (dk_lo_desc, dk_hi_desc, dv_desc))
    scalars = (sm_scale, qk_scale2, ds_scale)
    mod_bufs = (score_bufs, mask_bufs)
    cta = (cta_args, kv_empty)
    gl.warp_specialize([
        (_consumer, (0, descs, bars, smem, sizes, rows, scalars, mod_bufs, cta, SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE,
                     FLAGS)),
        (_consumer, (1, descs, bars, smem, sizes, rows, scalars, mod_bufs, cta, SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE,
                     FLAGS)),
        (_consumer, (2, descs, bars, smem, sizes, rows, scalars, mod_bufs, cta, SCORE_MOD, SCORE_GRAD, MASK_MOD, TILE,
                     FLAGS)),
        (_producer_entry, (descs, bars, smem, sizes, rows, scalars, mod_bufs, cta, SCORE_MOD, SCORE_GRAD, MASK_MOD,
                           TILE, FLAGS)),
    ], [4, 4, 1], [FLAGS.CONSUMER_REGS, FLAGS.CONSUMER_REGS, FLAGS.PRODUCER_REGS])
