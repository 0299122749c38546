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

Buffer gradients (the score_mod's captured tensors that need one, buffer_grad.py), in the dQ pass:
    G_i[INDEX_i(b, h, q_idx, kv_idx)] += dS · VALUE_i(qk, ...)     per score, dS before f'
    BG_OUT[i]   fp32 accumulator of G_i (atomic mode), or entry values (DETERMINISTIC)
    BG_IDX[i]   int32 entry offsets, -1 for none (DETERMINISTIC; unused otherwise)
    Summed in registers where the offset allows: along the keys when it ignores kv_idx (one value
    per query row, or per program when it ignores q_idx too: ALiBi slopes, per-head biases), along
    the rows of a KV tile when it ignores q_idx; else one value per score (tables indexed by
    q_idx - kv_idx or [q_idx, kv_idx], scores with P = 0 skipped). The atomic mode adds those with
    fp32 atomics, in an order that varies between runs. DETERMINISTIC writes them as (offset, value)
    entries, each program (and KV tile) in its own slot; the host sorts them stably by offset and
    buffer_grad_segment_sum_kernel adds each offset's run in one fixed order.

Compile-time parameters (the mods, then one frozen-dataclass bundle each, read as TILE.BLOCK_N):
    TILE    BwdTiling       BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, DOT_PRECISION
    SPARSE  BwdSparsity     HAS_BLOCK_MASK, HAS_FULL_BLOCKS, SPARSE_Q, SPARSE_KV
    FLAGS   BwdFlags        GQA_GROUP, FOLD_SCALE, WIDE_SCORES
    BGRADS  BwdBufferGrads  GRADS (BwdBufferGrad: VALUE, INDEX, ALONG_Q, ALONG_KV), DETERMINISTIC
The input dtype is read off the loaded tiles; gradients are stored in Q's / K's / V's dtype
straight from the fp32 accumulators (every output tile has exactly one writer: no fp32 buffers;
only buffer gradients use atomics, and not in DETERMINISTIC mode).

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

from ..wide_scores import log2_units


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
    WIDE_SCORES: bool = False  # the score_mod may return huge finite values: exp2's argument from the
                               # rounded product, <= 0 since LSE >= the row max (wide_scores.py)


@dataclass(frozen=True)
class BwdBufferGrad:
    """One captured buffer's gradient (module docstring, "Buffer gradients"; buffer_grad.py)."""
    VALUE: object          # w / factor: a score_mod-shaped jit function; None when w = 1
    INDEX: object          # jit function (b, h, q_idx, kv_idx, bufs) -> element offset
    ALONG_Q: bool          # INDEX varies with q_idx
    ALONG_KV: bool         # INDEX varies with kv_idx


@dataclass(frozen=True)
class BwdBufferGrads:
    """The captured-buffer gradients the dQ kernel accumulates (none: GRADS empty)."""
    GRADS: tuple           # one BwdBufferGrad per buffer that needs a gradient
    DETERMINISTIC: bool    # entries per program (summed later in a fixed order), no atomics


NO_BUFFER_GRADS = BwdBufferGrads(GRADS=(), DETERMINISTIC=False)


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
    return tl.math.exp2(log2_units(s, qk_scale2, FLAGS.WIDE_SCORES) - lse)


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
def _dq_kv_tile(dq, bg_accs, q, do, lse, delta, start_n, offs_m, k_base, v_base, k_strides,
                v_strides, z, hq, M, N, D, DV, sm_scale, qk_scale2, score_bufs, mask_bufs, bg_out,
                bg_idx, bg_slot, SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr,
                MASK_MOD: tl.constexpr, APPLY_MASK: tl.constexpr, TILE: tl.constexpr,
                FLAGS: tl.constexpr, BGRADS: tl.constexpr):
    """One KV tile of the dQ pass, in the forward's orientation ([BLOCK_M, BLOCK_N])."""
    offs_n = start_n + tl.arange(0, TILE.BLOCK_N)
    k = _load_rows(k_base, offs_n, N, k_strides[2], TILE.BLOCK_D, D)
    v = _load_rows(v_base, offs_n, N, v_strides[2], TILE.BLOCK_DV, DV)
    qk = tl.dot(q, tl.trans(k), input_precision=TILE.DOT_PRECISION)
    p = _probabilities(qk, lse[:, None], offs_m[:, None], offs_n[None, :], z, hq, M, N, sm_scale,
                       qk_scale2, score_bufs, mask_bufs, SCORE_MOD, MASK_MOD, APPLY_MASK, FLAGS)
    dp = tl.dot(do, tl.trans(v), input_precision=TILE.DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    # Buffer gradients take dS before f' (the joint graph's incoming gradient).
    bg_accs = _buffer_grads_tile(bg_accs, ds, qk, offs_m, start_n, z, hq, M, N, sm_scale,
                                 score_bufs, bg_out, bg_idx, bg_slot, BGRADS, TILE)
    ds = _score_gradient(ds, p, qk, offs_m[:, None], offs_n[None, :], z, hq, M, N, sm_scale,
                         score_bufs, SCORE_GRAD)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=TILE.DOT_PRECISION), bg_accs


@triton.jit
def _dq_listed_kv_tiles(dq, bg_accs, q, do, lse, delta, NUM_BLKS, IDX, row, NUM_KV_BLKS, offs_m,
                        k_base, v_base, k_strides, v_strides, z, hq, M, N, D, DV, sm_scale,
                        qk_scale2, score_bufs, mask_bufs, bg_out, bg_idx, bg_slot,
                        SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr,
                        APPLY_MASK: tl.constexpr, TILE: tl.constexpr, SPARSE: tl.constexpr,
                        FLAGS: tl.constexpr, BGRADS: tl.constexpr):
    """The KV tiles of the blocks one block-mask list (partial or full) gives this query block."""
    TILES_PER_BLK: tl.constexpr = SPARSE.SPARSE_KV // TILE.BLOCK_N
    n_tiles = tl.load(NUM_BLKS + row) * TILES_PER_BLK
    for t in tl.range(0, n_tiles):
        blk = tl.load(IDX + row * NUM_KV_BLKS + t // TILES_PER_BLK)
        start_n = blk * SPARSE.SPARSE_KV + (t % TILES_PER_BLK) * TILE.BLOCK_N
        dq, bg_accs = _dq_kv_tile(dq, bg_accs, q, do, lse, delta, start_n, offs_m, k_base,
                                  v_base, k_strides, v_strides, z, hq, M, N, D, DV, sm_scale,
                                  qk_scale2, score_bufs, mask_bufs, bg_out, bg_idx, bg_slot,
                                  SCORE_MOD, SCORE_GRAD, MASK_MOD, APPLY_MASK, TILE, FLAGS, BGRADS)
    return dq, bg_accs


_DQ_RUNTIME_SIZES = ["KZ", "M", "N", "NUM_Q_BLKS", "NUM_KV_BLKS"]


@triton.jit(do_not_specialize=_DQ_RUNTIME_SIZES)
def attention_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA,
    KV_NUM_BLKS, KV_IDX, FULL_KV_NUM_BLKS, FULL_KV_IDX,
    score_bufs, mask_bufs,
    q_strides, k_strides, v_strides, do_strides, dq_strides,
    HQ, KZ, M, N, D, DV, SZ, SH, NUM_Q_BLKS, NUM_KV_BLKS,
    sm_scale, qk_scale2, ds_scale, bg_out, bg_idx,
    SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr,
    TILE: tl.constexpr, SPARSE: tl.constexpr, FLAGS: tl.constexpr, BGRADS: tl.constexpr,
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
    # Buffer gradients: a row-sum accumulator per buffer, and this program's entry slot.
    bg_accs = _buffer_grad_accumulators(BGRADS, BLOCK_M)
    bg_slot = off_zh * tl.num_programs(0) + pid_m

    if SPARSE.HAS_BLOCK_MASK:
        row = ((z % SZ) * SH + (hq % SH)) * NUM_Q_BLKS + start_m // SPARSE.SPARSE_Q
        dq, bg_accs = _dq_listed_kv_tiles(
            dq, bg_accs, q, do, lse, delta, KV_NUM_BLKS, KV_IDX, row, NUM_KV_BLKS, offs_m, k_base,
            v_base, k_strides, v_strides, z, hq, M, N, D, DV, sm_scale, qk_scale2, score_bufs,
            mask_bufs, bg_out, bg_idx, bg_slot, SCORE_MOD, SCORE_GRAD, MASK_MOD, APPLY_MASK, TILE,
            SPARSE, FLAGS, BGRADS)
        if SPARSE.HAS_FULL_BLOCKS:
            dq, bg_accs = _dq_listed_kv_tiles(
                dq, bg_accs, q, do, lse, delta, FULL_KV_NUM_BLKS, FULL_KV_IDX, row, NUM_KV_BLKS,
                offs_m, k_base, v_base, k_strides, v_strides, z, hq, M, N, D, DV, sm_scale,
                qk_scale2, score_bufs, mask_bufs, bg_out, bg_idx, bg_slot, SCORE_MOD, SCORE_GRAD,
                MASK_MOD, False, TILE, SPARSE, FLAGS, BGRADS)
    else:
        for t in tl.range(0, tl.cdiv(N, TILE.BLOCK_N)):
            dq, bg_accs = _dq_kv_tile(
                dq, bg_accs, q, do, lse, delta, t * TILE.BLOCK_N, offs_m, k_base, v_base,
                k_strides, v_strides, z, hq, M, N, D, DV, sm_scale, qk_scale2, score_bufs,
                mask_bufs, bg_out, bg_idx, bg_slot, SCORE_MOD, SCORE_GRAD, None, False, TILE,
                FLAGS, BGRADS)

    _flush_buffer_grads(bg_accs, offs_m, z, hq, M, score_bufs, bg_out, bg_idx, bg_slot, BGRADS,
                        TILE)
    _store_rows(DQ + z * dq_strides[0] + hq * dq_strides[1], offs_m, M, dq_strides[2],
                (dq * ds_scale).to(q.dtype), D)


# ---------------------------------------------------------------------------------------------
# Buffer gradients (in the dQ pass; module docstring)


@triton.jit
def _buffer_grad_accumulators(BGRADS: tl.constexpr, BLOCK_M: tl.constexpr):
    """One fp32 row-sum accumulator per buffer gradient (used where INDEX ignores kv_idx)."""
    accs = ()
    for i in tl.static_range(len(BGRADS.GRADS)):
        accs = accs + (tl.zeros([BLOCK_M], dtype=tl.float32),)
    return accs


@triton.jit
def _buffer_grads_tile(accs, ds, qk, offs_m, start_n, z, hq, M, N, sm_scale, score_bufs,
                       bg_out, bg_idx, bg_slot, BGRADS: tl.constexpr, TILE: tl.constexpr):
    """Every buffer gradient's share of one [BLOCK_M, BLOCK_N] tile; returns the accumulators.
    A deterministic entry slot is (program, KV tile): each program visits a KV tile once."""
    offs_n = start_n + tl.arange(0, TILE.BLOCK_N)
    q_idx = tl.minimum(offs_m[:, None], M - 1)
    kv_idx = tl.minimum(offs_n[None, :], N - 1)
    num_kv_tiles = tl.cdiv(N, TILE.BLOCK_N)
    kv_tile = start_n // TILE.BLOCK_N
    updated = ()
    for i in tl.static_range(len(BGRADS.GRADS)):
        updated = updated + (_buffer_grad_tile(
            accs[i], ds, qk, q_idx, kv_idx, offs_n, z, hq, N, sm_scale, score_bufs, bg_out[i],
            bg_idx[i], bg_slot * num_kv_tiles + kv_tile, BGRADS, i, TILE),)
    return updated


@triton.jit
def _buffer_grad_tile(acc, ds, qk, q_idx, kv_idx, offs_n, z, hq, N, sm_scale, score_bufs, out,
                      out_idx, tile_slot, BGRADS: tl.constexpr, I: tl.constexpr,
                      TILE: tl.constexpr):
    """One buffer's values dS · w on a tile: summed into ``acc`` along the keys where the offset
    ignores kv_idx (added at the end, _flush_buffer_grad); else added now, per column or per
    score: by atomics, or (DETERMINISTIC) as entries in this tile's slot."""
    # Indexed here: a bundle taken out of the tuple cannot be passed as an argument.
    G: tl.constexpr = BGRADS.GRADS[I]
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    if G.VALUE is None:
        val = ds   # already 0 wherever P is
    else:
        # Masked scores (dS = P = 0) add nothing even where w is not finite there. (Testing dS,
        # not P, lets P die earlier: fewer registers.)
        w = G.VALUE(qk, sm_scale, z, hq, q_idx, kv_idx, score_bufs)
        val = tl.where(ds != 0.0, ds * w, 0.0)
    if not G.ALONG_KV:
        acc += tl.sum(val, 1)
    else:
        offset = tl.cast(G.INDEX(z, hq, q_idx, kv_idx, score_bufs), tl.int32)
        if G.ALONG_Q:   # one value per score
            offset = tl.broadcast_to(offset, [BLOCK_M, BLOCK_N])
            keep = val != 0.0   # masked scores, padding: adding 0 is skipped
            if BGRADS.DETERMINISTIC:
                rows = tl.arange(0, BLOCK_M)[:, None]
                slots = (tile_slot.to(tl.int64) * (BLOCK_M * BLOCK_N) + rows * BLOCK_N
                         + tl.arange(0, BLOCK_N)[None, :])
                tl.store(out_idx + slots, tl.where(keep, offset, -1))
                tl.store(out + slots, val)
            else:
                tl.atomic_add(out + offset, val, mask=keep, sem="relaxed")
        else:           # one value per key column
            offset = tl.reshape(tl.broadcast_to(offset, [1, BLOCK_N]), [BLOCK_N])
            column = tl.sum(val, 0)
            keep = offs_n < N
            if BGRADS.DETERMINISTIC:
                slots = tile_slot.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
                tl.store(out_idx + slots, tl.where(keep, offset, -1))
                tl.store(out + slots, column)
            else:
                tl.atomic_add(out + offset, column, mask=keep, sem="relaxed")
    return acc


@triton.jit
def _flush_buffer_grads(accs, offs_m, z, hq, M, score_bufs, bg_out, bg_idx, bg_slot,
                        BGRADS: tl.constexpr, TILE: tl.constexpr):
    """Add the accumulated row sums of the buffers whose offset ignores kv_idx."""
    q_idx = tl.minimum(offs_m[:, None], M - 1)
    for i in tl.static_range(len(BGRADS.GRADS)):
        _flush_buffer_grad(accs[i], offs_m, q_idx, z, hq, M, score_bufs, bg_out[i], bg_idx[i],
                           bg_slot, BGRADS, i, TILE)


@triton.jit
def _flush_buffer_grad(acc, offs_m, q_idx, z, hq, M, score_bufs, out, out_idx, slot,
                       BGRADS: tl.constexpr, I: tl.constexpr, TILE: tl.constexpr):
    """One value per query row (offset of q_idx) or per program (offset of b, h only)."""
    G: tl.constexpr = BGRADS.GRADS[I]
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    if not G.ALONG_KV:
        offset = tl.cast(G.INDEX(z, hq, q_idx, 0, score_bufs), tl.int32)
        if G.ALONG_Q:
            offset = tl.reshape(tl.broadcast_to(offset, [BLOCK_M, 1]), [BLOCK_M])
            keep = offs_m < M
            if BGRADS.DETERMINISTIC:
                slots = slot.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
                tl.store(out_idx + slots, tl.where(keep, offset, -1))
                tl.store(out + slots, acc)
            else:
                tl.atomic_add(out + offset, acc, mask=keep, sem="relaxed")
        else:   # ALiBi slopes, per-head biases: one value per program
            total = tl.sum(acc, 0)
            if BGRADS.DETERMINISTIC:
                tl.store(out_idx + slot, offset)
                tl.store(out + slot, total)
            else:
                tl.atomic_add(out + offset, total, sem="relaxed")


@triton.jit(do_not_specialize=["numel"])
def buffer_grad_store_kernel(ACC, OUT, factor, numel, BLOCK: tl.constexpr):
    """OUT = ACC · factor in OUT's dtype (the atomic mode's last step)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.load(ACC + offs, mask=offs < numel, other=0.0)
    tl.store(OUT + offs, (acc * factor).to(OUT.dtype.element_ty), mask=offs < numel)


@triton.jit(do_not_specialize=["numel"])
def buffer_grad_segment_sum_kernel(VALS, STARTS, ENDS, OUT, factor, numel,
                                   BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """OUT[e] = factor · Σ VALS[STARTS[e]:ENDS[e]] (the deterministic mode's last step: VALS are
    the entries sorted stably by offset), always summed in the same order."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < numel
    start = tl.load(STARTS + offs, mask=live, other=0)
    end = tl.load(ENDS + offs, mask=live, other=0)
    partial = tl.zeros([BLOCK, CHUNK], dtype=tl.float32)
    for j in range(0, tl.max(end - start, 0), CHUNK):
        at = start[:, None] + j + tl.arange(0, CHUNK)[None, :]
        partial += tl.load(VALS + at, mask=at < end[:, None], other=0.0)
    tl.store(OUT + offs, (tl.sum(partial, 1) * factor).to(OUT.dtype.element_ty), mask=live)
