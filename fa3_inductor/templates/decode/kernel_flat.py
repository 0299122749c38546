"""The flat decode schedule: every program streams the same number of KV tiles (stream-K over the
cache), plain Triton.

Notation (kernel.py's, plus)
--------
    row zk                   one (batch z, kv head hkv) program row of kernel.py: zk = z * HKV + hkv,
                             its GQA_GROUP * M_NEW packed query rows; n_t(z) = cdiv(L_z, BLOCK_N) tiles
    T = HKV * sum_z n_t(z)   the cache's tiles, rows in zk order, tiles in key order within a row
    P                        programs (grid (P,)); P_T = min(P, T) of them stream tiles: program p
                             takes [lo(p), lo(p + 1)), lo(p) = floor(p * T / P_T), so every program
                             streams T / P_T tiles (+-1) whatever the lengths, the batch and the heads
    segment                  the tiles of one row within one program's range; a program's range
                             crosses rows, so it runs a segment per row it touches (Q load, KV loop,
                             epilogue), about T / (P * n_t) + 1 of them
    O_PART [2P, R, DV], LSE_PART [2P, R]   a program's partials: slot 2p its first segment's (when
                             the row started before lo(p)), slot 2p + 1 its last segment's (when the
                             row goes on past lo(p + 1)); a segment that covers its whole row writes O
                             and LSE directly
    ARRIVALS [Z * HKV]       per row, the programs holding a partial of it that have written it; the
                             last of the row's programs p(first tile) .. p(last tile),
                             p(g) = floor(((g + 1) * P_T - 1) / T), merges them and resets it to 0

Why: with kernel.py's split grid a launch is (splits x rows) programs of whole splits; 1 x 128k at
16 splits over 8 kv heads is 128 programs on 132 SMs, and 64 x 4k GQA (1536 programs, 3.9 waves)
pays a program's start and merge 3.9 times an SM and a partial last wave. Here P is a fixed
number a SM and the tiles are dealt evenly, so no SM idles and a program starts once.

Served: no block mask (SPARSE "none"), two-byte or fp32 caches (no FP8 scales), contiguous or paged,
TMA tiles where CACHE.TMA. Zero-length rows (L_z = 0) have no tile: program p writes O = 0, LSE =
-inf for the rows zk = p, p + P, ... that are empty.
"""

import triton
import triton.language as tl

from .kernel import _kv_step, _merge_splits, _row_query, _store_rows


@triton.jit
def _first_program(g, T, P):
    """The program whose range holds global tile g."""
    return ((g + 1) * P - 1) // T


@triton.jit
def _locate(g, bs, b_ok, starts, n_ts, lens, HKV):
    """(z, hkv, row_start, n_t, L) of the row holding global tile g."""
    z = tl.sum((b_ok & (starts <= g)).to(tl.int32), 0) - 1   # the last batch starting at or before g
    at_z = bs == z
    z_start = tl.sum(tl.where(at_z, starts, 0), 0)
    n_t = tl.sum(tl.where(at_z, n_ts, 0), 0)
    hkv = ((g - z_start) // n_t).to(tl.int32)
    return z, hkv, z_start + hkv * n_t, n_t, tl.sum(tl.where(at_z, lens, 0), 0)


@triton.jit
def _merge_row(O_PART, LSE_PART, O, LSE, g, T, P_T, bs, b_ok, starts, n_ts, lens, n_rows,
               stride_oz, stride_oh, stride_om, HKV, M_NEW, DV, TILE: tl.constexpr, SITE: tl.constexpr):
    """Merge the parts of the row holding global tile g into O and LSE; its counter back to 0."""
    z, hkv, row_start, n_t, L = _locate(g, bs, b_ok, starts, n_ts, lens, HKV)
    p_first = _first_program(row_start, T, P_T)
    n_parts = _first_program(row_start + n_t - 1, T, P_T) - p_first + 1
    # the first part sits in p_first's slot 1 unless the row starts that program's range
    first_slot = (row_start != p_first * T // P_T).to(tl.int32)
    _merge_splits(O_PART, LSE_PART, O, LSE, p_first, first_slot, n_parts, n_rows, z, hkv * SITE.GQA_GROUP,
                  stride_oz, stride_oh, stride_om, HKV, M_NEW, DV, TILE, SITE, 2)


@triton.jit
def _segment(acc, l_i, m_i, q, K, V, K_DESC, V_DESC, z, hkv, h, q_idx, i0, i1, n_t, L, bt_row,
             stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, D, DV, sm_scale, qk_scale2,
             score_bufs, mask_bufs, HKV, SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, TILE: tl.constexpr,
             CACHE: tl.constexpr, SITE: tl.constexpr):
    """Tiles i0 .. i1 of row (z, hkv): those below L whole (TMA when CACHE.TMA), the row's last
    tile by pointer loads when L is not a multiple of BLOCK_N and the segment reaches it."""
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    n_whole = tl.minimum(i1, L // BLOCK_N)
    for t in tl.range(i0, n_whole):
        acc, l_i, m_i = _kv_step(
            acc, l_i, m_i, q, K, V, K_DESC, V_DESC, z, hkv, h, q_idx, 0 * i0 + t * BLOCK_N, L, bt_row,
            stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
            D, DV, sm_scale, qk_scale2, score_bufs, mask_bufs, False, None, None,
            HKV, 1.0, SCORE_MOD, MASK_MOD, TILE, CACHE, SITE, WHOLE=True)
    if i1 == n_t and L % BLOCK_N != 0:
        acc, l_i, m_i = _kv_step(
            acc, l_i, m_i, q, K, V, K_DESC, V_DESC, z, hkv, h, q_idx, (n_t - 1) * BLOCK_N, L, bt_row,
            stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
            D, DV, sm_scale, qk_scale2, score_bufs, mask_bufs, False, None, None,
            HKV, 1.0, SCORE_MOD, MASK_MOD, TILE, CACHE, SITE)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["MAX_PAGES", "N_KEYS", "BATCH"])
def decode_flat_kernel(
    Q, K, V, K_DESC, V_DESC, O, LSE, O_PART, LSE_PART, ARRIVALS,
    SEQ_LENS, Q_OFFSET, BLOCK_TABLE,
    score_bufs, mask_bufs,
    stride_qz, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_oz, stride_oh, stride_om,
    MAX_PAGES, N_KEYS, BATCH, HKV, M_NEW, D, DV,
    sm_scale, qk_scale2,
    SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr,
    TILE: tl.constexpr, CACHE: tl.constexpr, SITE: tl.constexpr, BLOCK_B: tl.constexpr,
):
    p = tl.program_id(0)
    P = tl.num_programs(0)
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    BLOCK_DV: tl.constexpr = TILE.BLOCK_DV
    # every batch's length and tiles; rows of batch z start at global tile starts[z]
    bs = tl.arange(0, BLOCK_B)
    b_ok = bs < BATCH
    if SITE.HAS_SEQ_LENS:
        lens = tl.minimum(tl.maximum(tl.load(SEQ_LENS + bs, mask=b_ok, other=0), 0), N_KEYS)
    else:
        lens = tl.where(b_ok, N_KEYS, 0)
    n_ts = tl.cdiv(lens, BLOCK_N)
    starts = ((tl.cumsum(n_ts, 0) - n_ts) * HKV).to(tl.int64)
    T = tl.sum(n_ts.to(tl.int64), 0) * HKV
    # at most T programs take tiles, so each of them takes at least one (a row's parts are then
    # exactly the programs p(first tile) .. p(last tile))
    P_T = tl.maximum(tl.minimum(P, T), 1)
    lo = tl.where(p < P_T, p * T // P_T, T)
    hi = tl.where(p < P_T, (p + 1) * T // P_T, T)

    n_rows = SITE.GQA_GROUP * M_NEW
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    offs_dv = tl.arange(0, BLOCK_DV)
    merge_first = False   # this program arrived last on its first / last segment's row: it merges it
    merge_last = False
    t = lo
    while t < hi:
        z, hkv, row_start, n_t, L = _locate(t, bs, b_ok, starts, n_ts, lens, HKV)
        seg_end = tl.minimum(hi, row_start + n_t)
        i0 = (t - row_start).to(tl.int32)
        i1 = (seg_end - row_start).to(tl.int32)
        q, q_idx, h, hq, i = _row_query(Q, Q_OFFSET, z, hkv * SITE.GQA_GROUP, L, rows, stride_qz, stride_qh,
                                        stride_qm, M_NEW, D, TILE, CACHE, SITE)
        bt_row = BLOCK_TABLE + z.to(tl.int64) * MAX_PAGES
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        acc, l_i, m_i = _segment(acc, l_i, m_i, q, K, V, K_DESC, V_DESC, z, hkv, h, q_idx, i0, i1, n_t, L, bt_row,
                                 stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, D, DV, sm_scale,
                                 qk_scale2, score_bufs, mask_bufs, HKV, SCORE_MOD, MASK_MOD, TILE, CACHE, SITE)
        # every row here saw at least one key (L > 0): l_i > 0
        o = acc / l_i[:, None]
        lse = m_i + tl.math.log2(l_i)
        if i0 == 0 and i1 == n_t:   # the whole row in this program
            _store_rows(O, LSE, o, lse, z, hq, i, row_ok, stride_oz, stride_oh, stride_om, HKV, M_NEW, DV,
                        TILE, SITE)
        else:
            part = (2 * p + (t != lo).to(tl.int64)) * n_rows + rows
            tl.store(O_PART + part[:, None] * DV + offs_dv[None, :], o,
                     mask=row_ok[:, None] & (offs_dv < DV)[None, :])
            tl.store(LSE_PART + part, lse, mask=row_ok)
            tl.debug_barrier()   # every thread's partials are written before the release below
            arrived = tl.atomic_add(ARRIVALS + z * HKV + hkv, 1, sem="acq_rel", scope="gpu")
            n_parts = _first_program(row_start + n_t - 1, T, P_T) - _first_program(row_start, T, P_T) + 1
            if t == lo:
                merge_first = arrived == n_parts - 1
            else:
                merge_last = arrived == n_parts - 1
        t = seg_end

    # the merges after the loop: their loads do not share the KV loop's registers
    if merge_first:
        _merge_row(O_PART, LSE_PART, O, LSE, lo, T, P_T, bs, b_ok, starts, n_ts, lens, n_rows,
                   stride_oz, stride_oh, stride_om, HKV, M_NEW, DV, TILE, SITE)
    if merge_last:
        _merge_row(O_PART, LSE_PART, O, LSE, hi - 1, T, P_T, bs, b_ok, starts, n_ts, lens, n_rows,
                   stride_oz, stride_oh, stride_om, HKV, M_NEW, DV, TILE, SITE)
    if merge_first or merge_last:
        tl.debug_barrier()   # every thread has read the counters' rows' partials
    if merge_first:
        z, hkv, row_start, n_t, L = _locate(lo, bs, b_ok, starts, n_ts, lens, HKV)
        tl.store(ARRIVALS + z * HKV + hkv, 0)   # ready for the next launch
    if merge_last:
        z, hkv, row_start, n_t, L = _locate(hi - 1, bs, b_ok, starts, n_ts, lens, HKV)
        tl.store(ARRIVALS + z * HKV + hkv, 0)

    # rows of empty batches: no tile, so no segment; O = 0, LSE = -inf
    for zk in range(p, BATCH * HKV, P):
        z = zk // HKV + 0 * p   # a tensor under the interpreter too
        if tl.sum(tl.where(bs == z, n_ts, 0), 0) == 0:
            hq = (zk % HKV) * SITE.GQA_GROUP + rows // M_NEW
            _store_rows(O, LSE, tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32),
                        tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), z, hq, rows % M_NEW, row_ok,
                        stride_oz, stride_oh, stride_om, HKV, M_NEW, DV, TILE, SITE)
