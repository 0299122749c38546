"""Split-KV decode kernels (Flash-Decoding): plain Triton, any CUDA GPU and the CPU interpreter.

Notation
--------
    Q: [Z, HQ, M_NEW, D]     the new query tokens (M_NEW small: 1 decode, a few speculative), any
                             strides with the last one 1
    K: [Z, HKV, N, D]        contiguous cache (any strides, last one 1), or paged (CACHE.PAGED):
       [P, PAGE, HKV, D]     P pages of PAGE keys, addressed through BLOCK_TABLE
    V: like K with DV        DV may differ from D
    K_SCALE, V_SCALE: float32 dequantization scales of an FP8 cache (CACHE.KV_SCALE != "none": K, V
                             e4m3 / e5m2, a key's real value = its FP8 value x its scale), flat
                             contiguous: "tensor" [1], "head" [HKV], "seq" [Z, HKV] (contiguous
                             cache), "page" [P, HKV] (paged: the scale of a key's physical page);
                             None with a cache in q's dtype
    BLOCK_TABLE: [Z, MAX_PAGES] int32   page of key block j of batch z (paged only)
    SEQ_LENS: [Z] int32      cache length L of each batch (keys [0, L) are visible); read in the
                             kernel, so a CUDA graph replays with a changed length, no recompile;
                             clamped into [0, N_KEYS], N_KEYS the capacity (N, or MAX_PAGES * PAGE).
                             Without it (SITE.HAS_SEQ_LENS False) L = N_KEYS for every batch
    Q_OFFSET: [Z] int32      position of query row 0 (SITE.Q_POS "offset"); "end": L - M_NEW (the
                             new tokens are the cache's last ones); "start": 0 (FlexAttention's
                             q_idx, what the family serves)
    KV_NUM, KV_IDX, FULL_NUM, FULL_IDX   a BlockMask's tables (torch's layout [TB, TH, QB(, KVB)]
                             int32), read at query block 0 of batch z and the group's first head:
                             the host checks that this is every row's (SPARSE.MODE != "none")
    O: [Z, HQ, M_NEW, DV]    output, input dtype; LSE: [Z, HQ, M_NEW] float32, log2 units
    O_PART: [Z*HQ/HEADS, S, R, DV], LSE_PART: [Z*HQ/HEADS, S, R] float32: each split's normalized
                             output and log2-LSE (-inf: the split saw no key)
    ARRIVALS: [>= Z*HQ/HEADS] int32  splits of program row zk that have written their partials;
                             0 before and after every launch (the last split resets it)
    z, hkv, s                batch, kv head, split of a program (grid: (S, Z * HQ / HEADS))
    r                        packed row: query head hq = hq0 + r // M_NEW (hq0 the program's
                             first of its HEADS heads), new token i = r % M_NEW (GQA packing:
                             HEADS = GQA_GROUP, K/V read once per group)
    BLOCK_M                  R = HEADS * M_NEW rounded up to a power of two >= 16 (tl.dot's minimum)
    BLOCK_N                  keys per step; a tile may span pages (each row looks up its page)
    BLOCK_D, BLOCK_DV        D, DV rounded up to a power of two >= 16 (masked loads pad zeros)

Splits: batch z's keys [0, L) are cut into S chunks of cdiv(cdiv(L, S), BLOCK_N) * BLOCK_N keys,
so every batch spreads over every split whatever its length; a split past L writes LSE -inf.
One launch: with S > 1 each split writes its partials, then counts itself in ARRIVALS[zk] (an
acq_rel atomic after a CTA barrier); the split that arrives last merges the S partials of its
rows (read from L2) into O and LSE and puts ARRIVALS[zk] back to 0. A separate combine kernel cost
5-12 us a call on an H200 (benchmarks/results/decode-tiles-nvidia-h200-2026-11-29-0202: its
launch and its dependent loads), 2-5% of a decode step that cuDNN's is within.
Block-sparse ("blocks"): the program's listed KV blocks, partial ones then full ones, are a flat
list of tiles (KV_BLOCK // BLOCK_N each) cut into S chunks; tiles at or past L are skipped.

Mods (templates/modgen.py, ``tl`` dialect; the generic forward's argument order):
    SCORE_MOD(qk, sm_scale, b, h, q_idx, kv_idx, bufs) -> score / OUT_SCALE (qk raw)
    MASK_MOD(b, h, q_idx, kv_idx, bufs) -> bool, False -> score = -inf
    b the batch (scalar); h the query head, a [BLOCK_M, 1] column (packed rows span the group's
    heads); q_idx [BLOCK_M, 1] the absolute query position, clamped to >= 0; kv_idx [1, BLOCK_N]
    clamped into [0, L). Keys past L are -inf whatever the mods say.

Compile-time parameters (the mods, then one frozen-dataclass bundle each):
    TILE   DecodeTiling   BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, DOT_PRECISION, MERGE_ROWS,
                          MERGE_SPLITS
    CACHE  CacheLayout    PAGED, PAGE_SIZE, KV_SCALE
    SITE   DecodeSite     GQA_GROUP, Q_POS, HAS_SEQ_LENS, FOLD_SCALE, SPLIT (write partials),
                          WIDE_SCORES
    SPARSE BlockSparsity  MODE ("none" / "one_block" / "blocks"), KV_BLOCK, HAS_FULL
K_DESC, V_DESC (CACHE.TMA): host descriptors over K and V whose box is one tile of one kv head ([1, 1,
BLOCK_N, BLOCK_D] of [Z, HKV, N, D], or [1, BLOCK_N, 1, BLOCK_D] of pages holding whole tiles); a split's
tiles below L come through them (sm90: TMA copies, no key bound), the tile holding L by the pointer loads,
which read its rows past L as zeros. None otherwise.
Lengths are never constexprs: they live in SEQ_LENS. MAX_PAGES (the table's row stride) is
do_not_specialize, so a bigger table does not recompile.

FP8 cache (CACHE.KV_SCALE != "none"): each K / V tile is loaded as FP8 (half the bytes) and converted
in registers to the dots' dtype, fp16 (a bf16 q is converted once; fp32 under the interpreter's
float32 copies); no pass dequantizes it. K's scale multiplies the q.k tile
before the mods (a [1, BLOCK_N] row of per-key scales for "page" when a tile spans pages, a scalar
per tile when a page holds whole tiles); a scale constant over the program ("tensor", "head",
"seq") is folded into qk_scale2 instead when FOLD_SCALE. V's scale multiplies P's columns before
P.V for "page", else the program's output once in the epilogue (so partials and the merge are
unchanged). With KV_SCALE "none" the scales are None (constexpr) and none of this is traced.
"""

from dataclasses import dataclass

import triton
import triton.language as tl

from ..wide_scores import log2_units


@dataclass(frozen=True)
class DecodeTiling:
    """The tile a program computes and how it multiplies."""
    BLOCK_M: int           # packed query rows (GQA_GROUP * M_NEW, padded to a power of two >= 16)
    BLOCK_N: int           # keys per step of the KV loop
    BLOCK_D: int           # D rounded up to a power of two (>= 16)
    BLOCK_DV: int          # DV rounded up to a power of two (>= 16)
    DOT_PRECISION: str     # tl.dot input_precision: "tf32" or "ieee" (fp32 inputs only)
    MERGE_ROWS: int = 16   # R rounded up to a power of two: the rows the last split merges
    MERGE_SPLITS: int = 1  # splits merged per step ([MERGE_SPLITS, MERGE_ROWS, BLOCK_DV] loads)


@dataclass(frozen=True)
class CacheLayout:
    """How a key's row is addressed, and how an FP8 cache's values are scaled."""
    PAGED: bool            # K, V are [P, PAGE, HKV, D] pages through BLOCK_TABLE (else [Z, HKV, N, D])
    PAGE_SIZE: int         # keys per page, any size (a tile may span pages; BLOCK_N when not paged)
    KV_SCALE: str = "none"  # "none": K, V in q's dtype; FP8 K, V with K_SCALE / V_SCALE varying by
                            # "tensor", "head", "seq" ([Z, HKV], contiguous) or "page" ([P, HKV])
    TMA: bool = False      # whole tiles (every key below L) through K_DESC / V_DESC (sm90: TMA copies);
                           # the tile holding L by pointer loads, which zero its rows past L


@dataclass(frozen=True)
class DecodeSite:
    """What the call asks of the score tile and the epilogue."""
    GQA_GROUP: int         # HQ // HKV
    HEADS: int             # query heads per program: GQA_GROUP (packed), or 1 when a block mask
                           # differs per head (each head walks its own table row)
    Q_POS: str             # query row 0's position: "offset" (Q_OFFSET), "end" (L - M_NEW), "start" (0)
    HAS_SEQ_LENS: bool     # L from SEQ_LENS (else N_KEYS for every batch)
    FOLD_SCALE: bool       # no score_mod, sm_scale > 0: raw q.k, the scale folded into qk_scale2
    SPLIT: bool            # S > 1: write O_PART / LSE_PART, the last split merges them (else O,
                           # LSE directly)
    WIDE_SCORES: bool = False  # the score_mod may return huge finite values: exp2's argument from
                               # the rounded product (wide_scores.py)
    PAIRS: bool = False    # a program reads two adjacent kv heads of a paged cache as one row of 2 x D/2
                           # columns ("Head pairs" above): GQA_GROUP = HEADS = both heads' query heads; one
                           # split only (host.py plans no other), so the merge never stores a pair
    WINDOW: bool = False   # the mask_mod is a causal window of WINDOW_KEYS keys: the splits share the keys from
                           # the tile holding row 0's window edge to L, none before it (no row sees them)


@dataclass(frozen=True)
class BlockSparsity:
    """Which keys a BlockMask's tables let the program visit.

    "none": every key below L. "one_block": the mask has one KV block covering the cache, so the
    tables only say whether the row sees it at all (no listed block: nothing) and whether it is
    full (mask_mod skipped); the keys are split by position. "blocks": the listed blocks only."""
    MODE: str
    KV_BLOCK: int          # keys per mask block (a multiple of BLOCK_N); 0 with MODE "none"
    HAS_FULL: bool         # FULL_NUM / FULL_IDX given (blocks whose mask_mod is all true)


@triton.jit
def _tile_ptrs(X, page, z, hkv, start_n, offs_j, offs_d, stride_b, stride_h, stride_n,
               CACHE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pointers [BLOCK_N, BLOCK_D] to key rows `start_n + offs_j`, columns `offs_d`, of kv head
    `hkv` (int64 offsets: caches pass 2**31 elements). Paged: `page` is the tile's page where pages
    hold whole tiles (PAGE_SIZE a multiple of BLOCK_N), else [BLOCK_N], each row's page (a tile may
    span pages: any page size works)."""
    if CACHE.PAGED and CACHE.PAGE_SIZE % BLOCK_N != 0:
        rows = page * stride_b + ((start_n + offs_j) % CACHE.PAGE_SIZE) * stride_n + hkv * stride_h
        ptrs = X + rows[:, None] + offs_d[None, :]
    else:   # consecutive rows from one base: a contiguous cache's, or the tile's one page (a scalar)
        if CACHE.PAGED:
            base = page * stride_b + (start_n % CACHE.PAGE_SIZE) * stride_n + hkv * stride_h
        else:
            base = z.to(tl.int64) * stride_b + start_n.to(tl.int64) * stride_n + hkv * stride_h
        ptrs = (X + base) + offs_j[:, None] * stride_n + offs_d[None, :]
    return ptrs


@triton.jit
def _tma_tile(DESC, page, z, hkv, start_n, CACHE: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS] key rows `start_n ..` of kv head `hkv` through a host descriptor: [Z, HKV, N, D]
    boxes [1, 1, ROWS, COLS], or pages [P, PAGE, HKV, D] boxes [1, ROWS, 1, COLS] (`page` the tile's)."""
    if CACHE.PAGED:
        tile = DESC.load([page, start_n % CACHE.PAGE_SIZE, hkv, 0])
    else:
        tile = DESC.load([z, hkv, start_n, 0])
    return tile.reshape([ROWS, COLS])


@triton.jit
def _kv_step(acc, l_i, m_i, q, K, V, K_DESC, V_DESC, z, hkv, h, q_idx, start_n, L, bt_row,
             stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
             D, DV, sm_scale, qk_scale2, score_bufs, mask_bufs, full_tile, K_SCALE, V_SCALE, HKV,
             k_scale, SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, TILE: tl.constexpr,
             CACHE: tl.constexpr, SITE: tl.constexpr, WHOLE: tl.constexpr = False):
    """One KV tile of the online softmax: S = QK^T, mods, key bound, rescale, O += PV.
    ``full_tile``: a block mask says mask_mod is all true here (FlexAttention skips it). FP8 cache:
    ``k_scale`` the program's K scale (unused for "page", and when folded into qk_scale2).
    ``WHOLE`` (with CACHE.TMA): every key of the tile is below L, so K and V come by TMA and no key
    bound applies."""
    offs_j = tl.arange(0, TILE.BLOCK_N)
    offs_n = start_n + offs_j
    key_ok = offs_n < L
    offs_d = tl.arange(0, TILE.BLOCK_D)
    BY_TMA: tl.constexpr = WHOLE and CACHE.TMA
    if BY_TMA and CACHE.PAGED:
        page = tl.load(bt_row + start_n // CACHE.PAGE_SIZE)   # a descriptor coordinate: int32
    elif CACHE.PAGED and CACHE.PAGE_SIZE % TILE.BLOCK_N == 0:
        # the tile lies in one page (tiles start at multiples of BLOCK_N, start_n < L): one table
        # entry, and the tile's rows are consecutive within it, addressed as a contiguous cache's
        page = tl.load(bt_row + start_n // CACHE.PAGE_SIZE).to(tl.int64)
    elif CACHE.PAGED:
        # each row's page (rows past L read no table entry: the table may end there), a
        # [BLOCK_N] vector load that Triton's pipeliner issues a stage ahead of the K/V loads
        page = tl.load(bt_row + offs_n // CACHE.PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
    else:
        page = 0
    if BY_TMA:
        k = _tma_tile(K_DESC, page, z, hkv, start_n, CACHE, TILE.BLOCK_N, TILE.BLOCK_D)
    else:
        k = tl.load(_tile_ptrs(K, page, z, hkv, start_n, offs_j, offs_d, stride_kb, stride_kh,
                               stride_kn, CACHE, TILE.BLOCK_N),
                    mask=key_ok[:, None] & (offs_d < D)[None, :], other=0.0)
    if CACHE.KV_SCALE != "none":
        k = k.to(q.dtype)   # e4m3 / e5m2 values are exact in fp16 and fp32
    qk = tl.dot(q, tl.trans(k), input_precision=TILE.DOT_PRECISION)
    if CACHE.KV_SCALE == "page":
        # the scale of each key's page: a scalar when the tile lies in one page, else [BLOCK_N]
        page_at = page.to(tl.int64) * HKV + hkv
        k_page = tl.load(K_SCALE + page_at)
        qk = qk * (k_page if CACHE.PAGE_SIZE % TILE.BLOCK_N == 0 else k_page[None, :])
    elif CACHE.KV_SCALE != "none" and not SITE.FOLD_SCALE:
        qk = qk * k_scale   # the real q.k, which the mods (or sm_scale) take

    kv_idx = (offs_n if BY_TMA else tl.minimum(offs_n, L - 1))[None, :]
    if SCORE_MOD is not None:
        s = SCORE_MOD(qk, sm_scale, z, h, q_idx, kv_idx, score_bufs)
    elif SITE.FOLD_SCALE:
        s = qk   # raw q.k; the positive scale is in qk_scale2
    else:
        s = qk * sm_scale
    if MASK_MOD is not None:
        s = tl.where(MASK_MOD(z, h, q_idx, kv_idx, mask_bufs) | full_tile, s, float("-inf"))
    if not BY_TMA:
        s = tl.where(key_ok[None, :], s, float("-inf"))

    # Row max in log2 units; qk_scale2 carries the tile to them inside the exp2 FMA.
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale2)
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)   # nothing visible yet: no NaN
    p = tl.math.exp2(log2_units(s, qk_scale2, SITE.WIDE_SCORES) - m_base[:, None])
    alpha = tl.math.exp2(m_i - m_base)
    l_i = l_i * alpha + tl.sum(p, 1)
    offs_dv = tl.arange(0, TILE.BLOCK_DV)
    if BY_TMA:
        v = _tma_tile(V_DESC, page, z, hkv, start_n, CACHE, TILE.BLOCK_N, TILE.BLOCK_DV)
    else:   # rows past L read as 0: an unwritten cache slot may hold NaN, and 0 x NaN is NaN
        v = tl.load(_tile_ptrs(V, page, z, hkv, start_n, offs_j, offs_dv, stride_vb, stride_vh,
                               stride_vn, CACHE, TILE.BLOCK_N),
                    mask=key_ok[:, None] & (offs_dv < DV)[None, :], other=0.0)
    p_v = p
    if CACHE.KV_SCALE != "none":
        v = v.to(q.dtype)
        if CACHE.KV_SCALE == "page":   # V's scale on P's columns (each key's page); l_i keeps p
            v_page = tl.load(V_SCALE + page_at)
            p_v = p * (v_page if CACHE.PAGE_SIZE % TILE.BLOCK_N == 0 else v_page[None, :])
    acc = tl.dot(p_v.to(v.dtype), v, acc * alpha[:, None], input_precision=TILE.DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _pair_half(r, M_NEW, SITE: tl.constexpr):
    """Which kv head of its pair packed row r belongs to (0 or 1): its query head's place in the pair's
    2 x GQA_GROUP / 2 heads (SITE.PAIRS)."""
    return (r // M_NEW) // (SITE.GQA_GROUP // 2)


@triton.jit
def _table_row(NUM, IDX, z, h0, s_nb, s_nh, s_ib, s_ih):
    """(block count, pointer to the block list) of the mask row of batch z, head h0, query
    block 0."""
    n = tl.load(NUM + z.to(tl.int64) * s_nb + h0 * s_nh)
    return n, IDX + z.to(tl.int64) * s_ib + h0 * s_ih


@triton.jit(do_not_specialize=["MAX_PAGES", "N_KEYS", "WINDOW_KEYS"])
def decode_split_kernel(
    Q, K, V, K_DESC, V_DESC, O, LSE, O_PART, LSE_PART, ARRIVALS,
    SEQ_LENS, Q_OFFSET, BLOCK_TABLE, K_SCALE, V_SCALE,
    KV_NUM, KV_IDX, FULL_NUM, FULL_IDX,
    score_bufs, mask_bufs,
    stride_qz, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_oz, stride_oh, stride_om,
    stride_knb, stride_knh, stride_kib, stride_kih,
    stride_fnb, stride_fnh, stride_fib, stride_fih,
    MAX_PAGES, N_KEYS, HKV, M_NEW, D, DV,
    sm_scale, qk_scale2, WINDOW_KEYS,
    SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr,
    TILE: tl.constexpr, CACHE: tl.constexpr, SITE: tl.constexpr, SPARSE: tl.constexpr,
):
    tl.static_assert(not (SITE.PAIRS and SITE.SPLIT), "head pairs are planned for one-split launches only")
    split = tl.program_id(0)
    num_splits = tl.num_programs(0)
    zk = tl.program_id(1)
    n_hp = HKV * (SITE.GQA_GROUP // SITE.HEADS)   # programs per batch along the heads
    z = zk // n_hp
    hq0 = (zk % n_hp) * SITE.HEADS                 # the program's first query head
    hkv = hq0 // SITE.GQA_GROUP
    if SITE.HAS_SEQ_LENS:
        # clamped into [0, capacity]: a bad length reads no key outside the cache or the table
        L = tl.minimum(tl.maximum(tl.load(SEQ_LENS + z), 0), N_KEYS)
    else:
        L = N_KEYS + 0 * z   # a tensor like the loaded length

    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    BLOCK_DV: tl.constexpr = TILE.BLOCK_DV
    n_rows = SITE.HEADS * M_NEW
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    # Padding rows repeat the last real row (in-range indices for the mods); never stored.
    r = tl.minimum(rows, n_rows - 1)
    i = r % M_NEW
    hq = hq0 + r // M_NEW
    offs_d = tl.arange(0, TILE.BLOCK_D)
    if SITE.PAIRS:   # a row's query fills its kv head's half of the pair's columns, zeros the other half
        q_col = offs_d[None, :] - _pair_half(r, M_NEW, SITE)[:, None] * (D // 2)
        q = tl.load(Q + z.to(tl.int64) * stride_qz + hq[:, None] * stride_qh + i[:, None] * stride_qm + q_col,
                    mask=row_ok[:, None] & (q_col >= 0) & (q_col < D // 2), other=0.0)
    else:
        q = tl.load(Q + z.to(tl.int64) * stride_qz + hq[:, None] * stride_qh + i[:, None] * stride_qm
                    + offs_d[None, :], mask=row_ok[:, None] & (offs_d < D)[None, :], other=0.0)
    if CACHE.KV_SCALE != "none" and q.dtype == tl.bfloat16:
        # FP8 K / V convert to fp16 in one instruction per pair (sm90: F2FP.F16.E4M3.UNPACK_B), to
        # bf16 in three; fp16 holds every e4m3 / e5m2 value, P in [0, 1] more finely than bf16, and
        # a bf16 q exactly within fp16's range (|q| <= 65504). The dots run in fp16, O stays bf16.
        q = q.to(tl.float16)
    if SITE.Q_POS == "offset":
        q_first = tl.load(Q_OFFSET + z)
    elif SITE.Q_POS == "end":
        q_first = L - M_NEW
    else:
        q_first = 0 * L
    q_idx = tl.maximum(q_first + i, 0)[:, None]
    h = hq[:, None]
    bt_row = BLOCK_TABLE + z.to(tl.int64) * MAX_PAGES
    k_scale = 1.0
    v_scale = 1.0
    if CACHE.KV_SCALE == "tensor" or CACHE.KV_SCALE == "head" or CACHE.KV_SCALE == "seq":
        # one K and one V scale for the whole program: K's folded into the score scale when it is
        # a plain factor, V's applied to the output (_kv_step otherwise)
        at = 0 if CACHE.KV_SCALE == "tensor" else (hkv if CACHE.KV_SCALE == "head" else z * HKV + hkv)
        k_scale = tl.load(K_SCALE + at)
        v_scale = tl.load(V_SCALE + at)
        if SITE.FOLD_SCALE:
            qk_scale2 = qk_scale2 * k_scale

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if SPARSE.MODE == "blocks":
        n_part, part_row = _table_row(KV_NUM, KV_IDX, z, hq0, stride_knb, stride_knh,
                                      stride_kib, stride_kih)
        if SPARSE.HAS_FULL:
            n_full, full_row = _table_row(FULL_NUM, FULL_IDX, z, hq0, stride_fnb, stride_fnh,
                                          stride_fib, stride_fih)
        else:
            n_full, full_row = 0 * n_part, part_row
        TPB: tl.constexpr = SPARSE.KV_BLOCK // BLOCK_N   # tiles per mask block
        n_work = (n_part + n_full) * TPB
        chunk = tl.cdiv(n_work, num_splits)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, n_work)
        part_end = n_part * TPB
        # partial blocks: mask_mod applies
        for w in tl.range(lo, tl.minimum(hi, part_end)):
            start_n = tl.load(part_row + w // TPB) * SPARSE.KV_BLOCK + (w % TPB) * BLOCK_N
            if start_n < L:
                acc, l_i, m_i = _kv_step(
                    acc, l_i, m_i, q, K, V, K_DESC, V_DESC, z, hkv, h, q_idx, start_n, L, bt_row,
                    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                    D, DV, sm_scale, qk_scale2, score_bufs, mask_bufs, False, K_SCALE, V_SCALE,
                    HKV, k_scale, SCORE_MOD, MASK_MOD, TILE, CACHE, SITE)
        # full blocks: mask_mod is all true there
        for w in tl.range(tl.maximum(lo, part_end), hi):
            start_n = (tl.load(full_row + (w - part_end) // TPB) * SPARSE.KV_BLOCK
                       + ((w - part_end) % TPB) * BLOCK_N)
            if start_n < L:
                acc, l_i, m_i = _kv_step(
                    acc, l_i, m_i, q, K, V, K_DESC, V_DESC, z, hkv, h, q_idx, start_n, L, bt_row,
                    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                    D, DV, sm_scale, qk_scale2, score_bufs, mask_bufs, True, K_SCALE, V_SCALE,
                    HKV, k_scale, SCORE_MOD, MASK_MOD, TILE, CACHE, SITE)
    else:
        full_tile = False
        visible = L
        if SPARSE.MODE == "one_block":
            # one mask block holds every key: the tables say whether the row sees it, and whether
            # mask_mod is all true on it
            n_part, _ = _table_row(KV_NUM, KV_IDX, z, hq0, stride_knb, stride_knh,
                                   stride_kib, stride_kih)
            n_full = 0 * n_part
            if SPARSE.HAS_FULL:
                n_full, _ = _table_row(FULL_NUM, FULL_IDX, z, hq0, stride_fnb, stride_fnh,
                                       stride_fib, stride_fih)
            full_tile = n_full > 0
            visible = tl.where(n_part + n_full > 0, L, 0)
        # This split's keys: chunks of whole tiles, so only the tile holding L is partial.
        if SITE.WINDOW:   # from the tile holding row 0's window edge (later rows' edges are later)
            base = tl.maximum(tl.maximum(q_first, 0) - WINDOW_KEYS + 1, 0) // BLOCK_N * BLOCK_N
            chunk = tl.cdiv(tl.cdiv(tl.maximum(visible - base, 0), num_splits), BLOCK_N) * BLOCK_N
            lo = base + split * chunk
        else:
            chunk = tl.cdiv(tl.cdiv(visible, num_splits), BLOCK_N) * BLOCK_N
            lo = split * chunk
        span = tl.maximum(tl.minimum(lo + chunk, visible) - lo, 0)
        if CACHE.TMA:
            n_whole = span // BLOCK_N   # tiles with every key below L: TMA, no key bound
            for t in tl.range(0, n_whole):
                acc, l_i, m_i = _kv_step(
                    acc, l_i, m_i, q, K, V, K_DESC, V_DESC, z, hkv, h, q_idx, lo + t * BLOCK_N, L, bt_row,
                    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                    D, DV, sm_scale, qk_scale2, score_bufs, mask_bufs, full_tile, K_SCALE, V_SCALE,
                    HKV, k_scale, SCORE_MOD, MASK_MOD, TILE, CACHE, SITE, WHOLE=True)
            if span % BLOCK_N != 0:   # the tile holding L, by pointer loads
                acc, l_i, m_i = _kv_step(
                    acc, l_i, m_i, q, K, V, K_DESC, V_DESC, z, hkv, h, q_idx, lo + n_whole * BLOCK_N, L,
                    bt_row, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                    D, DV, sm_scale, qk_scale2, score_bufs, mask_bufs, full_tile, K_SCALE, V_SCALE,
                    HKV, k_scale, SCORE_MOD, MASK_MOD, TILE, CACHE, SITE)
        else:
            n_tiles = tl.cdiv(span, BLOCK_N)
            for t in tl.range(0, n_tiles):
                acc, l_i, m_i = _kv_step(
                    acc, l_i, m_i, q, K, V, K_DESC, V_DESC, z, hkv, h, q_idx, lo + t * BLOCK_N, L, bt_row,
                    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                    D, DV, sm_scale, qk_scale2, score_bufs, mask_bufs, full_tile, K_SCALE, V_SCALE,
                    HKV, k_scale, SCORE_MOD, MASK_MOD, TILE, CACHE, SITE)

    # Rows that saw no key: O = 0, LSE = -inf (the forward's convention; the combine gives them
    # weight 0).
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    if CACHE.KV_SCALE != "none" and CACHE.KV_SCALE != "page":
        o = o * v_scale   # V's program-constant scale, before the partials: the merge is unchanged
    lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    if SITE.SPLIT:
        part = (zk * num_splits + split) * n_rows + rows
        tl.store(O_PART + part[:, None] * DV + offs_dv[None, :], o,
                 mask=row_ok[:, None] & dv_ok[None, :])
        tl.store(LSE_PART + part, lse, mask=row_ok)
        tl.debug_barrier()   # every thread's partials are written before the release below
        arrived = tl.atomic_add(ARRIVALS + zk, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:   # the last split of this program row: merge them all
            _merge_splits(O_PART, LSE_PART, O, LSE, zk * num_splits, num_splits, n_rows, z, hq0,
                          stride_oz, stride_oh, stride_om, HKV, M_NEW, DV, TILE, SITE)
            tl.store(ARRIVALS + zk, 0)   # ready for the next launch
    else:
        o_ptr = O + z.to(tl.int64) * stride_oz + hq[:, None] * stride_oh + i[:, None] * stride_om
        if SITE.PAIRS:
            o_col = offs_dv[None, :] - _pair_half(r, M_NEW, SITE)[:, None] * (DV // 2)
            tl.store(o_ptr + o_col, o.to(O.dtype.element_ty), mask=row_ok[:, None] & (o_col >= 0) & (o_col < DV // 2))
        else:
            tl.store(o_ptr + offs_dv[None, :], o.to(O.dtype.element_ty),
                     mask=row_ok[:, None] & dv_ok[None, :])
        tl.store(LSE + (z * (HKV * SITE.GQA_GROUP) + hq) * M_NEW + i, lse, mask=row_ok)


@triton.jit
def _merge_splits(O_PART, LSE_PART, O, LSE, first, num_splits, n_rows, z, hq0,
                  stride_oz, stride_oh, stride_om, HKV, M_NEW, DV,
                  TILE: tl.constexpr, SITE: tl.constexpr):
    """O = sum_s w_s O_s / sum_s w_s, w_s = exp2(LSE_s - max LSE), LSE = log2 sum of the splits',
    for the R rows of one program row (its splits at O_PART / LSE_PART rows first .. first + S).
    Partials of other programs are read at L2 (.cg: never a stale L1 line); MERGE_SPLITS of them
    per step, so the reads of a step are in flight together."""
    MR: tl.constexpr = TILE.MERGE_ROWS
    MS: tl.constexpr = TILE.MERGE_SPLITS
    BLOCK_DV: tl.constexpr = TILE.BLOCK_DV
    r = tl.arange(0, MR)
    r_ok = r < n_rows
    offs_s = tl.arange(0, MS)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    m = tl.full([MR], float("-inf"), dtype=tl.float32)
    acc = tl.zeros([MR, BLOCK_DV], dtype=tl.float32)
    w_sum = tl.zeros([MR], dtype=tl.float32)
    for s0 in range(0, num_splits, MS):
        s = s0 + offs_s
        ok = (s < num_splits)[:, None] & r_ok[None, :]                       # [MS, MR]
        part = (first + s)[:, None] * n_rows + r[None, :]
        lse_s = tl.load(LSE_PART + part, mask=ok, other=float("-inf"), cache_modifier=".cg")
        o_s = tl.load(O_PART + part[:, :, None] * DV + offs_dv[None, None, :],
                      mask=ok[:, :, None] & dv_ok[None, None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse_s, 0))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)   # nothing seen yet: no NaN
        alpha = tl.math.exp2(m - base)
        w = tl.math.exp2(lse_s - base[None, :])
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o_s, 0)
        w_sum = w_sum * alpha + tl.sum(w, 0)
        m = m_new
    seen = w_sum > 0.0
    total = tl.where(seen, w_sum, 1.0)
    o = acc / total[:, None]
    lse = tl.where(seen, m + tl.math.log2(total), float("-inf"))
    i = r % M_NEW
    hq = hq0 + r // M_NEW
    o_ptr = O + z.to(tl.int64) * stride_oz + hq[:, None] * stride_oh + i[:, None] * stride_om
    tl.store(o_ptr + offs_dv[None, :], o.to(O.dtype.element_ty), mask=r_ok[:, None] & dv_ok[None, :])
    tl.store(LSE + (z * (HKV * SITE.GQA_GROUP) + hq) * M_NEW + i, lse, mask=r_ok)
