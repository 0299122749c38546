"""Generic attention backward kernels: plain Triton, any CUDA GPU and the CPU interpreter.

Notation
--------
    Q, dQ:   [Z, HQ, M, D]      query and its gradient, any strides with the last one 1
    K, dK:   [KZ, HKV, N, D]    key;   HQ % HKV == 0 (GQA: kv head = hq // GQA_GROUP);
                                KZ is Z or 1 (a K/V batch of 1 broadcasts over the query batch)
    V, dV:   [KZ, HKV, N, DV]   value; DV may differ from D
    O, dO:   [Z, HQ, M, DV]     the forward's output and its incoming gradient
    LSE:     [Z, HQ, M] float32, log2 units (the forward's; -inf on fully masked rows)
    DELTA:   [Z, HQ, M] float32, rowsum(dO · O) (minus dLSE · log2(e) when the LSE has a gradient)
    z, hq, hkv, kz          batch, query head, kv head, K/V batch of a program
    m, n                    query rows (q_idx), key columns (kv_idx)
    BLOCK_M, BLOCK_N        query rows / key rows of one tile (TILE; per kernel)
    BLOCK_D, BLOCK_DV       D, DV rounded up to a power of two (masked loads pad with zeros)

The math (c = the factor from the score tile to log2 units, as in the forward; f the score_mod):

    S   = f(Q Kᵀ · scale)   masked (mask_mod on partial blocks, -inf outside [0, N))
    P   = exp2(S · c − LSE)                      (the forward's normalized probabilities)
    dV  = Σ Pᵀ dO           dP = dO Vᵀ
    dS  = P ⊙ (dP − DELTA) ⊙ f'(Q Kᵀ · scale)   (f' = 1 without a score_mod)
    dQ  = dS K · scale      dK = Σ dSᵀ Q · scale

Σ runs over the query heads of a KV head's GQA group and the query batches sharing a K/V batch.

Block mask (torch BlockMask layout, broadcast over batch/head when SZ/SH are 1):
    KV_NUM_BLKS[SZ, SH, NUM_Q_BLKS], KV_IDX[.., NUM_KV_BLKS]   partial KV blocks per query block
    FULL_KV_NUM_BLKS / FULL_KV_IDX                             all-true KV blocks per query block
    Q_NUM_BLKS[SZ, SH, NUM_KV_BLKS], Q_IDX[.., NUM_Q_BLKS]     the transpose: query blocks per KV
    FULL_Q_NUM_BLKS / FULL_Q_IDX                               block (BlockMask.q_num_blocks, ...)
    SPARSE_Q, SPARSE_KV     block sizes; SPARSE_Q % BLOCK_M == 0 and SPARSE_KV % BLOCK_N == 0 (SPARSE)
Listed partial blocks get mask_mod, full blocks are kept whole, unlisted blocks are dropped
(the forward's semantics, runtime/backward_cpu.py).

Mods (templates/modgen.py, ``tl`` dialect, constexpr jit functions, as the forward takes them):
    SCORE_MOD(qk, sm_scale, b, h, q_idx, kv_idx, bufs)  -> the score / OUT_SCALE (qk raw)
    SCORE_GRAD(qk, sm_scale, b, h, q_idx, kv_idx, bufs) -> f'(score) / GRAD_SCALE (score_grad.py)
    MASK_MOD(b, h, q_idx, kv_idx, bufs)                 -> bool, False -> score = -inf
    q_idx and kv_idx are clamped into [0, M) / [0, N) and broadcast to the tile's orientation:
    [BLOCK_M, 1] x [1, BLOCK_N] in the dQ kernel, [1, BLOCK_M] x [BLOCK_N, 1] in the dK/dV kernel
    (generated mods are elementwise, so either works).

Compile-time parameters (the mods, then one frozen-dataclass bundle each, read as TILE.BLOCK_N):
    TILE    BwdTiling       BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, DOT_PRECISION
    SPARSE  BwdSparsity     HAS_BLOCK_MASK, HAS_FULL_BLOCKS, SPARSE_Q, SPARSE_KV
    FLAGS   BwdFlags        GQA_GROUP, FOLD_SCALE
The input dtype is read off the loaded tiles; gradients are stored in Q's / K's / V's dtype
straight from the fp32 accumulators (every output tile has exactly one writer: no fp32 buffers).

Loop orders:
    delta    one program per (query tile, z·HQ + hq)
    dK, dV   one program per (KV tile, kz·HKV + hkv): K, V and the dK, dV accumulators stay in
             registers while the program walks z (query batches of this K/V batch), then hq (the
             GQA group), then the query tiles the transposed block mask lists for this KV tile
    dQ       one program per (query tile, z·HQ + hq): the forward's loop, over the KV tiles its
             row of the block mask lists; a separate pass, so dQ needs no atomics and the
             results are bitwise deterministic (docs/design/backward.md)
"""

from dataclasses import dataclass

import triton
import triton.language as tl


@dataclass(frozen=True)
class BwdTiling:
    """The tile one kernel computes. Each kernel gets its own (dK/dV wants tall KV tiles, dQ tall
    query tiles)."""
    BLOCK_M: int           # query rows per tile
    BLOCK_N: int           # KV rows per tile
    BLOCK_D: int           # D rounded up to a power of two (>= 16)
    BLOCK_DV: int          # DV rounded up to a power of two (>= 16)
    DOT_PRECISION: str     # tl.dot input_precision for fp32 inputs: "tf32" or "ieee"


@dataclass(frozen=True)
class BwdSparsity:
    """The block mask (module docstring, "Block mask")."""
    HAS_BLOCK_MASK: bool   # tiles come from the tables (else every tile, no mask_mod)
    HAS_FULL_BLOCKS: bool  # the FULL_* tables are given (walked without mask_mod)
    SPARSE_Q: int          # block-mask query block (BLOCK_M without a block mask)
    SPARSE_KV: int         # block-mask KV block (BLOCK_N without a block mask)


@dataclass(frozen=True)
class BwdFlags:
    """What the site's shapes and scale ask of the score tile."""
    GQA_GROUP: int         # HQ // HKV
    FOLD_SCALE: bool       # no score_mod, sm_scale > 0: raw q.k, the scale folded into qk_scale2


# ---------------------------------------------------------------------------------------------
# Shared pieces


@triton.jit
def _load_rows(base, rows, n_rows, row_stride, COLS: tl.constexpr, n_cols):
    """[len(rows), COLS] tile of a row-major matrix; rows / columns out of range read as zero."""
    cols = tl.arange(0, COLS)
    ptrs = base + rows[:, None] * row_stride + cols[None, :]
    return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)


@triton.jit
def _store_rows(base, rows, n_rows, row_stride, tile, n_cols):
    """Store a [len(rows), COLS] tile, clipped to the matrix; the twin of _load_rows."""
    cols = tl.arange(0, tile.shape[1])
    ptrs = base + rows[:, None] * row_stride + cols[None, :]
    tl.store(ptrs, tile, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))


@triton.jit
def _row_stats(LSE, DELTA, row0, offs_m, M):
    """(LSE, DELTA) of rows ``offs_m``. Rows past M and fully masked rows (LSE -inf) get LSE +inf,
    so that P = exp2(S·c − LSE) is 0 there without a separate row mask."""
    in_rows = offs_m < M
    lse = tl.load(LSE + row0 + offs_m, mask=in_rows, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(DELTA + row0 + offs_m, mask=in_rows, other=0.0)
    return lse, delta


@triton.jit
def _probabilities(qk, lse, q_pos, kv_pos, z, hq, M, N, sm_scale, qk_scale2, score_bufs,
                   mask_bufs, SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr,
                   APPLY_MASK: tl.constexpr, FLAGS: tl.constexpr):
    """P of one tile in either orientation: the forward's score (same mods, same index clamping,
    same units), exponentiated against the saved LSE. ``q_pos``, ``kv_pos`` and ``lse`` arrive
    shaped to broadcast against ``qk``."""
    # Mods see indices clamped into range, as in the forward: a gather by position must not
    # read past its buffer on the padded tail (those scores are masked below anyway).
    q_idx = tl.minimum(q_pos, M - 1)
    kv_idx = tl.minimum(kv_pos, N - 1)
    if SCORE_MOD is not None:
        s = SCORE_MOD(qk, sm_scale, z, hq, q_idx, kv_idx, score_bufs)
    elif FLAGS.FOLD_SCALE:
        s = qk  # raw q.k; qk_scale2 carries the (positive) scale
    else:
        s = qk * sm_scale
    if APPLY_MASK:
        s = tl.where(MASK_MOD(z, hq, q_idx, kv_idx, mask_bufs), s, float("-inf"))
    # Key columns past N read K as zero; their score must not count (the LSE did not count it).
    s = tl.where(kv_pos < N, s, float("-inf"))
    return tl.math.exp2(s * qk_scale2 - lse)


@triton.jit
def _score_gradient(ds, p, qk, q_pos, kv_pos, z, hq, M, N, sm_scale, score_bufs,
                    SCORE_GRAD: tl.constexpr):
    """dS times the score_mod's derivative (to GRAD_SCALE, applied with the scale at the end)."""
    if SCORE_GRAD is not None:
        grad = SCORE_GRAD(qk, sm_scale, z, hq, tl.minimum(q_pos, M - 1),
                          tl.minimum(kv_pos, N - 1), score_bufs)
        # Masked scores (P = 0) contribute nothing even where f' is not finite there.
        ds = tl.where(p > 0.0, ds * grad, 0.0)
    return ds


# ---------------------------------------------------------------------------------------------
# delta = rowsum(dO · O)


@triton.jit(do_not_specialize=["M"])
def attention_bwd_preprocess_kernel(
    O, DO, DLSE, DELTA, o_strides, do_strides, HQ, M, DV,
    HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    off_zh = tl.program_id(1)
    off_z = off_zh // HQ
    off_h = off_zh % HQ
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o = _load_rows(O + off_z * o_strides[0] + off_h * o_strides[1], offs_m, M, o_strides[2],
                   BLOCK_DV, DV)
    do = _load_rows(DO + off_z * do_strides[0] + off_h * do_strides[1], offs_m, M,
                    do_strides[2], BLOCK_DV, DV)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        # Σ LSE₂·dLSE₂ adds dLSE₂·log2(e)·P to dS: the same as lowering DELTA by dLSE₂·log2(e).
        dlse = tl.load(DLSE + off_zh * M + offs_m, mask=offs_m < M, other=0.0)
        delta = delta - dlse.to(tl.float32) * 1.4426950408889634
    tl.store(DELTA + off_zh * M + offs_m, delta, mask=offs_m < M)


# ---------------------------------------------------------------------------------------------
# dK, dV: KV-major


@triton.jit
def _dkdv_q_tile(dk, dv, k, v, start_m, offs_n, q_base, do_base, q_strides, do_strides, row0,
                 LSE, DELTA, z, hq, M, N, D, DV, sm_scale, qk_scale2, score_bufs, mask_bufs,
                 SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr,
                 APPLY_MASK: tl.constexpr, TILE: tl.constexpr, FLAGS: tl.constexpr):
    """One query tile against this program's KV tile, in the transposed orientation
    ([BLOCK_N, BLOCK_M]): every MMA operand is a loaded tile or the fp32 tile just computed."""
    offs_m = start_m + tl.arange(0, TILE.BLOCK_M)
    q = _load_rows(q_base, offs_m, M, q_strides[2], TILE.BLOCK_D, D)
    do = _load_rows(do_base, offs_m, M, do_strides[2], TILE.BLOCK_DV, DV)
    lse, delta = _row_stats(LSE, DELTA, row0, offs_m, M)
    qk_t = tl.dot(k, tl.trans(q), input_precision=TILE.DOT_PRECISION)
    p_t = _probabilities(qk_t, lse[None, :], offs_m[None, :], offs_n[:, None], z, hq, M, N,
                         sm_scale, qk_scale2, score_bufs, mask_bufs, SCORE_MOD, MASK_MOD,
                         APPLY_MASK, FLAGS)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=TILE.DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=TILE.DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    ds_t = _score_gradient(ds_t, p_t, qk_t, offs_m[None, :], offs_n[:, None], z, hq, M, N,
                           sm_scale, score_bufs, SCORE_GRAD)
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=TILE.DOT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_listed_q_tiles(dk, dv, k, v, NUM_BLKS, IDX, row, NUM_Q_BLKS, offs_n, q_base, do_base,
                         q_strides, do_strides, row0, LSE, DELTA, z, hq, M, N, D, DV, sm_scale,
                         qk_scale2, score_bufs, mask_bufs, SCORE_MOD: tl.constexpr,
                         SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr,
                         APPLY_MASK: tl.constexpr, TILE: tl.constexpr, SPARSE: tl.constexpr,
                         FLAGS: tl.constexpr):
    """The query tiles of the blocks one transposed list (partial or full) gives this KV block."""
    TILES_PER_BLK: tl.constexpr = SPARSE.SPARSE_Q // TILE.BLOCK_M
    n_tiles = tl.load(NUM_BLKS + row) * TILES_PER_BLK
    for t in tl.range(0, n_tiles):
        blk = tl.load(IDX + row * NUM_Q_BLKS + t // TILES_PER_BLK)
        start_m = blk * SPARSE.SPARSE_Q + (t % TILES_PER_BLK) * TILE.BLOCK_M
        dk, dv = _dkdv_q_tile(dk, dv, k, v, start_m, offs_n, q_base, do_base, q_strides,
                              do_strides, row0, LSE, DELTA, z, hq, M, N, D, DV, sm_scale,
                              qk_scale2, score_bufs, mask_bufs, SCORE_MOD, SCORE_GRAD, MASK_MOD,
                              APPLY_MASK, TILE, FLAGS)
    return dk, dv


_DKDV_RUNTIME_SIZES = ["Z", "KZ", "M", "N", "NUM_Q_BLKS", "NUM_KV_BLKS"]


@triton.jit(do_not_specialize=_DKDV_RUNTIME_SIZES)
def attention_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV_OUT, LSE, DELTA,
    Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX,
    score_bufs, mask_bufs,
    q_strides, k_strides, v_strides, do_strides, dk_strides, dv_strides,
    Z, HQ, KZ, M, N, D, DV, SZ, SH, NUM_Q_BLKS, NUM_KV_BLKS,
    sm_scale, qk_scale2, ds_scale,
    SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr,
    TILE: tl.constexpr, SPARSE: tl.constexpr, FLAGS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    off_kvh = tl.program_id(1)
    HKV = HQ // FLAGS.GQA_GROUP
    off_kz = off_kvh // HKV
    off_hkv = off_kvh % HKV
    # Shapes in list literals need constexprs (a bundle's field reads as a plain int).
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    BLOCK_D: tl.constexpr = TILE.BLOCK_D
    BLOCK_DV: tl.constexpr = TILE.BLOCK_DV
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)

    k = _load_rows(K + off_kz * k_strides[0] + off_hkv * k_strides[1], offs_n, N, k_strides[2],
                   TILE.BLOCK_D, D)
    v = _load_rows(V + off_kz * v_strides[0] + off_hkv * v_strides[1], offs_n, N, v_strides[2],
                   TILE.BLOCK_DV, DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    APPLY_MASK: tl.constexpr = MASK_MOD is not None
    kv_blk = start_n // SPARSE.SPARSE_KV

    # Every query batch that reads this K/V batch (all of them when KZ is 1), every query head of
    # the GQA group: the sums GQA and batch broadcast ask for, in registers.
    for zi in range(0, Z // KZ):
        z = off_kz + zi * KZ
        for g in range(0, FLAGS.GQA_GROUP):
            hq = off_hkv * FLAGS.GQA_GROUP + g
            q_base = Q + z * q_strides[0] + hq * q_strides[1]
            do_base = DO + z * do_strides[0] + hq * do_strides[1]
            row0 = (z * HQ + hq) * M
            if SPARSE.HAS_BLOCK_MASK:
                row = ((z % SZ) * SH + (hq % SH)) * NUM_KV_BLKS + kv_blk
                dk, dv = _dkdv_listed_q_tiles(
                    dk, dv, k, v, Q_NUM_BLKS, Q_IDX, row, NUM_Q_BLKS, offs_n, q_base, do_base,
                    q_strides, do_strides, row0, LSE, DELTA, z, hq, M, N, D, DV, sm_scale,
                    qk_scale2, score_bufs, mask_bufs, SCORE_MOD, SCORE_GRAD, MASK_MOD,
                    APPLY_MASK, TILE, SPARSE, FLAGS)
                if SPARSE.HAS_FULL_BLOCKS:
                    dk, dv = _dkdv_listed_q_tiles(
                        dk, dv, k, v, FULL_Q_NUM_BLKS, FULL_Q_IDX, row, NUM_Q_BLKS, offs_n,
                        q_base, do_base, q_strides, do_strides, row0, LSE, DELTA, z, hq, M, N, D,
                        DV, sm_scale, qk_scale2, score_bufs, mask_bufs, SCORE_MOD, SCORE_GRAD,
                        MASK_MOD, False, TILE, SPARSE, FLAGS)
            else:
                for t in tl.range(0, tl.cdiv(M, TILE.BLOCK_M)):
                    dk, dv = _dkdv_q_tile(
                        dk, dv, k, v, t * TILE.BLOCK_M, offs_n, q_base, do_base, q_strides,
                        do_strides, row0, LSE, DELTA, z, hq, M, N, D, DV, sm_scale, qk_scale2,
                        score_bufs, mask_bufs, SCORE_MOD, SCORE_GRAD, None, False, TILE, FLAGS)

    _store_rows(DK + off_kz * dk_strides[0] + off_hkv * dk_strides[1], offs_n, N, dk_strides[2],
                (dk * ds_scale).to(k.dtype), D)
    _store_rows(DV_OUT + off_kz * dv_strides[0] + off_hkv * dv_strides[1], offs_n, N,
                dv_strides[2], dv.to(v.dtype), DV)


# ---------------------------------------------------------------------------------------------
# dQ: query-major


@triton.jit
def _dq_kv_tile(dq, q, do, lse, delta, start_n, offs_m, k_base, v_base, k_strides, v_strides,
                z, hq, M, N, D, DV, sm_scale, qk_scale2, score_bufs, mask_bufs,
                SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr,
                APPLY_MASK: tl.constexpr, TILE: tl.constexpr, FLAGS: tl.constexpr):
    """One KV tile of the dQ pass, in the forward's orientation ([BLOCK_M, BLOCK_N])."""
    offs_n = start_n + tl.arange(0, TILE.BLOCK_N)
    k = _load_rows(k_base, offs_n, N, k_strides[2], TILE.BLOCK_D, D)
    v = _load_rows(v_base, offs_n, N, v_strides[2], TILE.BLOCK_DV, DV)
    qk = tl.dot(q, tl.trans(k), input_precision=TILE.DOT_PRECISION)
    p = _probabilities(qk, lse[:, None], offs_m[:, None], offs_n[None, :], z, hq, M, N, sm_scale,
                       qk_scale2, score_bufs, mask_bufs, SCORE_MOD, MASK_MOD, APPLY_MASK, FLAGS)
    dp = tl.dot(do, tl.trans(v), input_precision=TILE.DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    ds = _score_gradient(ds, p, qk, offs_m[:, None], offs_n[None, :], z, hq, M, N, sm_scale,
                         score_bufs, SCORE_GRAD)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=TILE.DOT_PRECISION)


@triton.jit
def _dq_listed_kv_tiles(dq, q, do, lse, delta, NUM_BLKS, IDX, row, NUM_KV_BLKS, offs_m, k_base,
                        v_base, k_strides, v_strides, z, hq, M, N, D, DV, sm_scale, qk_scale2,
                        score_bufs, mask_bufs, SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr,
                        MASK_MOD: tl.constexpr, APPLY_MASK: tl.constexpr, TILE: tl.constexpr,
                        SPARSE: tl.constexpr, FLAGS: tl.constexpr):
    """The KV tiles of the blocks one block-mask list (partial or full) gives this query block."""
    TILES_PER_BLK: tl.constexpr = SPARSE.SPARSE_KV // TILE.BLOCK_N
    n_tiles = tl.load(NUM_BLKS + row) * TILES_PER_BLK
    for t in tl.range(0, n_tiles):
        blk = tl.load(IDX + row * NUM_KV_BLKS + t // TILES_PER_BLK)
        start_n = blk * SPARSE.SPARSE_KV + (t % TILES_PER_BLK) * TILE.BLOCK_N
        dq = _dq_kv_tile(dq, q, do, lse, delta, start_n, offs_m, k_base, v_base, k_strides,
                         v_strides, z, hq, M, N, D, DV, sm_scale, qk_scale2, score_bufs,
                         mask_bufs, SCORE_MOD, SCORE_GRAD, MASK_MOD, APPLY_MASK, TILE, FLAGS)
    return dq


_DQ_RUNTIME_SIZES = ["KZ", "M", "N", "NUM_Q_BLKS", "NUM_KV_BLKS"]


@triton.jit(do_not_specialize=_DQ_RUNTIME_SIZES)
def attention_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA,
    KV_NUM_BLKS, KV_IDX, FULL_KV_NUM_BLKS, FULL_KV_IDX,
    score_bufs, mask_bufs,
    q_strides, k_strides, v_strides, do_strides, dq_strides,
    HQ, KZ, M, N, D, DV, SZ, SH, NUM_Q_BLKS, NUM_KV_BLKS,
    sm_scale, qk_scale2, ds_scale,
    SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr,
    TILE: tl.constexpr, SPARSE: tl.constexpr, FLAGS: tl.constexpr,
):
    # Last query tile first, as in the forward: under a causal mask it has the most KV tiles.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    off_zh = tl.program_id(1)
    z = off_zh // HQ
    hq = off_zh % HQ
    off_kz = z % KZ
    off_hkv = hq // FLAGS.GQA_GROUP
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_D: tl.constexpr = TILE.BLOCK_D
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)

    q = _load_rows(Q + z * q_strides[0] + hq * q_strides[1], offs_m, M, q_strides[2],
                   TILE.BLOCK_D, D)
    do = _load_rows(DO + z * do_strides[0] + hq * do_strides[1], offs_m, M, do_strides[2],
                    TILE.BLOCK_DV, DV)
    lse, delta = _row_stats(LSE, DELTA, off_zh * M, offs_m, M)
    k_base = K + off_kz * k_strides[0] + off_hkv * k_strides[1]
    v_base = V + off_kz * v_strides[0] + off_hkv * v_strides[1]
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    APPLY_MASK: tl.constexpr = MASK_MOD is not None

    if SPARSE.HAS_BLOCK_MASK:
        row = ((z % SZ) * SH + (hq % SH)) * NUM_Q_BLKS + start_m // SPARSE.SPARSE_Q
        dq = _dq_listed_kv_tiles(dq, q, do, lse, delta, KV_NUM_BLKS, KV_IDX, row, NUM_KV_BLKS,
                                 offs_m, k_base, v_base, k_strides, v_strides, z, hq, M, N, D,
                                 DV, sm_scale, qk_scale2, score_bufs, mask_bufs, SCORE_MOD,
                                 SCORE_GRAD, MASK_MOD, APPLY_MASK, TILE, SPARSE, FLAGS)
        if SPARSE.HAS_FULL_BLOCKS:
            dq = _dq_listed_kv_tiles(dq, q, do, lse, delta, FULL_KV_NUM_BLKS, FULL_KV_IDX, row,
                                     NUM_KV_BLKS, offs_m, k_base, v_base, k_strides, v_strides,
                                     z, hq, M, N, D, DV, sm_scale, qk_scale2, score_bufs,
                                     mask_bufs, SCORE_MOD, SCORE_GRAD, MASK_MOD, False, TILE,
                                     SPARSE, FLAGS)
    else:
        for t in tl.range(0, tl.cdiv(N, TILE.BLOCK_N)):
            dq = _dq_kv_tile(dq, q, do, lse, delta, t * TILE.BLOCK_N, offs_m, k_base, v_base,
                             k_strides, v_strides, z, hq, M, N, D, DV, sm_scale, qk_scale2,
                             score_bufs, mask_bufs, SCORE_MOD, SCORE_GRAD, None, False, TILE,
                             FLAGS)

    _store_rows(DQ + z * dq_strides[0] + hq * dq_strides[1], offs_m, M, dq_strides[2],
                (dq * ds_scale).to(q.dtype), D)
