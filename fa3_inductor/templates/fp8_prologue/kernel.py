"""FP8 prologue kernels: RoPE, the random-sign Hadamard rotation and block quantization of Q and K
(int8 or e4m3) and V (e4m3), in one pass over the inputs (plus a small pre-pass over a sample of
K's tokens when K is smoothed).

Notation
--------
    Q: [Z, HQ, M, D], K: [Z, HKV, N, D], V: [Z, HKV, N, DV]   bf16 / fp16, any strides, last one 1
    Q8, K8: [Z, HQ, M, D], [Z, HKV, N, D]   contiguous; int8 in [-127, 127] (QUANT.QK_INT8) or
                                            float8e4nv
    VT8: [Z, HKV, DV, N_PAD]                V quantized and transposed (tokens last); N_PAD = N
                                            rounded up to 16; the pad columns are written as 0
    Q_SCALE [Z, HQ, QG], K_SCALE, V_SCALE [Z, HKV, KG]   float32, one per group (below): Q / K
                             amax / QK_MAX (127 int8, 448 e4m3), V a power of two >= amax / 448
    V_SCALE_MAX [Z, HKV]     float32, set to -1 (below every scale) by the host: atomic max of
                             the scales of the V groups that are not all zero (the host maps a
                             remaining -1 to 1: host.finish)
    HAD [BLOCK_D, BLOCK_D]   diag(s)·blockdiag(H_b): exact ±1 / 0, zero-padded (hadamard.py), in the
                             input dtype; the rotation is x·HAD·HAD_SCALE, HAD_SCALE = 1/sqrt(b)
    COS, SIN [TZ, P, R]      RoPE tables (TZ 1 broadcasts over the batch; any float dtype);
                             QPOS [PZ, M], KPOS [PZ, N] int positions (rows of the tables; clamped
                             into [0, P) for memory safety), or none: the row index
    S                        smooth_k's sample: min(N, 256) tokens per head, one per stratum of
                             N / S tokens (_sample_tokens; reference.smooth_sample)
    K_PART [Z*HKV, SMOOTH_CHUNKS, BLOCK_D] float32 (smooth_k): rotated column sums of RoPE'd K over
                             the sample rows of each chunk (`k_sums_kernel`); K_MEAN [Z, HKV, D]:
                             their total / S, the mean the K programs subtract
    z, h                     batch, head (a query head for Q, a kv head for K and V)
    group                    the rows sharing one scale: BLOCK_M (Q) / BLOCK_N (K, V) rows of a
                             head, or the whole head when the block size is 0
    tile                     the rows a program holds at once (TILE_M / TILE_N). A group is one
                             tile (ONE_TILE), or the program walks its group twice: amax first,
                             then recompute and store (per-head scales, blocks over 128 rows)

Programs (`prologue_kernel`, 1-D persistent grid of as many programs as the SMs hold at once,
host.py): program p quantizes Q groups p, p + n_programs, ..., then K groups, then V groups, the
same way. Group t of a kind is (group = t // (Z * H), z, h): neighbouring programs take the heads
of one row block at the same time, so they read the same RoPE table rows (L2 hits). HAD's rows are
loaded once per program (_had_parts) and stay in shared memory for every group; with num_stages 2
the loops load the next group (cp.async) while the current one is rotated and stored. A Q / K
group: load the block in parts (the rotated pairs a = channels ia, b = channels ib, and the
pass-through rest r; _load_parts), RoPE in fp32 rounded to the input dtype (what the model's own
RoPE writes), Hadamard (input-dtype tensor-core dots part by part, exact products, _hadamard),
[K: subtract the mean], amax -> scale, store int8 or e4m3 (_to_qk). A V group: amax -> scale,
store the e4m3 tile transposed (16-byte vectors along tokens, _v_store).

Compile-time parameters (one named bundle each; frozen dataclasses below, read as `SHAPE.TILE_M`):
    SHAPE  Tiles         D, DV, BLOCK_D, BLOCK_DV, TILE_M, TILE_N, Q_ONE_TILE, KV_ONE_TILE
    ROT    Rotation      HADAMARD, HAD_SCALE, ROPE, ROPE_DIM, HALF_BLOCK, REST_BLOCK, Q_POS, K_POS,
                         INTERPRETED, ROPE_SELECT
    QUANT  Quantization  QK_INT8, SMOOTH_K, SMOOTH_CHUNKS, SMOOTH_ROWS, ROUND_IN_FP32
Lengths and program counts are `do_not_specialize`: one compile per kind of call, not per length.
ROPE_SELECT is a layout choice per launch, not math (the operands are the same either way): RoPE's
rounded parts pass a row-mask select before the Hadamard dots, which keeps RoPE in the blocked
layout (Triton moves the dot-operand layout conversion above elementwise ops, not above a select).
The host turns it on where the launch's registers are short for the tile (host.rope_select: it
removes spills there) and leaves it off elsewhere (it costs up to 12% more instructions); under 64
rows (mma.sync dots, head dims over 128) the kernel applies it at every launch.
"""

from dataclasses import dataclass

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import reference

E4M3_MAX: tl.constexpr = tl.constexpr(448.0)
INT8_MAX: tl.constexpr = tl.constexpr(127.0)
RINT_MAGIC: tl.constexpr = tl.constexpr(12582912.0)   # 1.5 * 2^23: (x + it) - it = rint(x), |x| < 2^22
FP16_MAX: tl.constexpr = tl.constexpr(reference.FP16_MAX)   # RoPE'd fp16 values saturate here
KNUTH_HASH: tl.constexpr = tl.constexpr(reference.KNUTH_HASH)   # smooth_k's sample offsets


@dataclass(frozen=True)
class Tiles:
    """Head dims and the rows a program holds."""
    D: int              # Q / K head dim (a multiple of 16)
    DV: int             # V head dim
    BLOCK_D: int        # D rounded up to a power of two
    BLOCK_DV: int       # DV rounded up to a power of two
    TILE_M: int         # Q rows per tile
    TILE_N: int         # K / V rows per tile
    Q_ONE_TILE: bool    # a Q group is one tile (else two walks over the group)
    KV_ONE_TILE: bool   # a K / V group is one tile


@dataclass(frozen=True)
class Rotation:
    """What is applied to Q and K before quantization."""
    HADAMARD: bool      # multiply by HAD, then HAD_SCALE
    HAD_SCALE: float    # 1 / sqrt(b)
    ROPE: str           # "" (none), "half" (rotate_half) or "interleaved" (pairs 2i, 2i+1)
    ROPE_DIM: int       # R: the rotated channels [0, R) (0 without RoPE); the rest pass through
    HALF_BLOCK: int     # R / 2 rounded up to a power of two (>= 16): the pair parts' width
    REST_BLOCK: int     # D - R rounded up to a power of two (>= 16), 0 when R = D
    Q_POS: bool         # QPOS given (else positions are the row indices)
    K_POS: bool         # KPOS given
    INTERPRETED: bool   # Triton 3.6's interpreter, three of whose ops are wrong: its bf16 dots (the
                        # input-dtype dots run in fp32, "ieee"), its fma (two roundings: taken in
                        # float64) and its fp32 -> bf16 cast (truncates: rounded in fp32 first)
    ROPE_SELECT: bool   # RoPE's rounded parts pass a row-mask select before the dots at 64 rows
                        # and more too (under 64 always, _qk_tile): host.rope_select's rule


@dataclass(frozen=True)
class Quantization:
    """Q / K's format, K smoothing and how values reach the e4m3 grid."""
    QK_INT8: bool       # Q8, K8 are int8 with scale amax / 127 (else e4m3, amax / 448)
    SMOOTH_K: bool      # subtract K's mean over a sample of its tokens (from K_PART)
    SMOOTH_CHUNKS: int  # rows of K_PART per head (a power of two); chunks past n_chunks unused
    SMOOTH_ROWS: int    # sample rows per k_sums_kernel program (one K_PART row each)
    ROUND_IN_FP32: bool  # round to the e4m3 grid in fp32 before the cast: Triton 3.6's
                         # interpreter truncates in its fp8 cast (sm90's cvt.rn.satfinite rounds)


@triton.jit
def _round_e4m3(x):
    """x rounded to the e4m3 grid (ties to even), still fp32, saturated at ±448: spacing
    2^(floor(log2|x|) - 3), 2^-9 below 2^-6 (subnormals); rint by the 1.5 * 2^23 trick."""
    e = tl.abs(x).to(tl.int32, bitcast=True) & 0x7F800000
    e = tl.maximum(e, (127 - 6) << 23)
    spacing = (e - (3 << 23)).to(tl.float32, bitcast=True)
    inv_spacing = ((254 << 23) - e + (3 << 23)).to(tl.float32, bitcast=True)   # 2^(3 - E + 127)
    r = ((x * inv_spacing + RINT_MAGIC) - RINT_MAGIC) * spacing
    return tl.minimum(tl.maximum(r, -E4M3_MAX), E4M3_MAX)


@triton.jit
def _scale_of(amax):
    """amax / 448 correctly rounded; 1 for an all-zero group."""
    return tl.where(amax > 0, tl.div_rn(amax, E4M3_MAX), 1.0)


@triton.jit
def _qk_scale_of(amax, QUANT: tl.constexpr):
    """A Q / K group's scale: amax / 127 (int8) or amax / 448 (e4m3), correctly rounded; 1 for an
    all-zero group."""
    if QUANT.QK_INT8:
        return tl.where(amax > 0, tl.div_rn(amax, INT8_MAX), 1.0)
    else:
        return _scale_of(amax)


@triton.jit
def _pow2_scale_of(amax):
    """The power of two at or above amax / 448 (1 for an all-zero group): V's block scales, so that
    the ratio of two of them, which the attention kernel folds into P, is a power of two and P's
    largest term (1) stays exact in e4m3. A block then spans [224, 448] or less of e4m3's range:
    relative precision is the same there."""
    bits = _scale_of(amax).to(tl.int32, bitcast=True)
    up = tl.where((bits & 0x007FFFFF) != 0, (bits & 0x7F800000) + (1 << 23), bits)
    return up.to(tl.float32, bitcast=True)


@triton.jit
def _quotient(y, scale, inv_scale, QUANT: tl.constexpr):
    """y / scale in fp32: y * inv_scale plus one FMA correction step, correctly rounded wherever
    the quotient is exactly representable, so bf16 data landing exactly on a tie (common: amax =
    21/16 gives scale 3/1024, whose reciprocal is inexact) rounds to even as a true division
    would. The interpreter (ROUND_IN_FP32) divides: numpy's division is exact."""
    if QUANT.ROUND_IN_FP32:
        return tl.div_rn(y, scale)
    else:
        q = y * inv_scale
        return tl.fma(tl.fma(q, -scale, y), inv_scale, q)   # -scale: one FFMA, not two


@triton.jit
def _to_e4m3(y, scale, inv_scale, QUANT: tl.constexpr):
    """e4m3 of y / scale (sm90: cvt.rn.satfinite; the interpreter rounds in fp32 first, its cast
    being wrong: Quantization.ROUND_IN_FP32)."""
    x = _quotient(y, scale, inv_scale, QUANT)
    if QUANT.ROUND_IN_FP32:
        x = _round_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def _to_int8(y, scale, inv_scale, QUANT: tl.constexpr):
    """int8 of y / scale, rounded half to even by one fp32 add: x + 1.5 * 2^23 has the bits
    0x4B400000 + rint(x), whose low byte is rint(x) in two's complement. No float -> int
    conversion (F2I, a conversion-pipe instruction at a fraction of the FMA rate), the same
    arithmetic on sm90 and in the interpreter. No clamp: |y| <= amax and scale = RN(amax / 127),
    so |y / scale| <= 127 (1 + 2^-23) and the quotient (correctly rounded up to an ulp) rounds to
    at most 127 in magnitude."""
    x = _quotient(y, scale, inv_scale, QUANT)
    return (x + RINT_MAGIC).to(tl.int32, bitcast=True).to(tl.int8)


@triton.jit
def _to_e4m3_pow2(y, inv_scale, QUANT: tl.constexpr):
    """e4m3 of y / scale for a power-of-two scale (V): y * (1 / scale) is exact, no correction."""
    x = y * inv_scale
    if QUANT.ROUND_IN_FP32:
        x = _round_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def _to_qk(y, scale, inv_scale, QUANT: tl.constexpr):
    """Q / K values y / scale in their format (Quantization.QK_INT8)."""
    if QUANT.QK_INT8:
        return _to_int8(y, scale, inv_scale, QUANT)
    else:
        return _to_e4m3(y, scale, inv_scale, QUANT)


@triton.jit
def _pair_columns(ROT: tl.constexpr):
    """Channels of the rotated pairs: a_i = ia[i] turns with b_i = ib[i], i < R / 2 (entries past
    R / 2 pad the power-of-two vector and are masked)."""
    j = tl.arange(0, ROT.HALF_BLOCK)
    if ROT.ROPE == "half":
        return j, j + ROT.ROPE_DIM // 2
    else:
        return 2 * j, 2 * j + 1


@triton.jit
def _pair_tile(base, rows_off, row_ok, ROT: tl.constexpr):
    """The rotated channels [0, R) of a row set as its pair parts (members ia, members ib), fp32:
    "half" two contiguous column blocks, "interleaved" one contiguous [T, R] load split into even
    and odd channels in registers (16-byte loads; a stride-2 gather was one 2-byte load each)."""
    if ROT.ROPE == "half":
        j = tl.arange(0, ROT.HALF_BLOCK)
        ok = row_ok[:, None] & _pairs_ok(ROT)[None, :]
        xa = tl.load(base + rows_off + j[None, :], mask=ok, other=0.0)
        xb = tl.load(base + rows_off + (j + ROT.ROPE_DIM // 2)[None, :], mask=ok, other=0.0)
    else:
        c = tl.arange(0, 2 * ROT.HALF_BLOCK)
        x = tl.load(base + rows_off + c[None, :], mask=row_ok[:, None] & (c < ROT.ROPE_DIM)[None, :],
                    other=0.0)
        xa, xb = tl.split(tl.reshape(x, [x.shape[0], ROT.HALF_BLOCK, 2]))
    return xa.to(tl.float32), xb.to(tl.float32)


@triton.jit
def _fma(x, y, z, ROT: tl.constexpr):
    """x·y + z rounded once (fp32). The interpreter's tl.fma rounds the product first: there it is
    taken in float64 (the product of two fp32 values is exact) and rounded to fp32."""
    if ROT.INTERPRETED:
        return (x.to(tl.float64) * y.to(tl.float64) + z.to(tl.float64)).to(tl.float32)
    else:
        return tl.fma(x, y, z)


@triton.jit
def _rope_round(x, dtype: tl.constexpr, ROT: tl.constexpr):
    """RoPE'd fp32 values rounded to the input dtype (ties to even), the model's RoPE output dtype.
    fp16 saturates at ±65504 (RoPE of fp16 values near the top of the range can pass it: rounding
    to inf would make the block's scale inf); bf16 shares fp32's range. Under the interpreter,
    whose fp32 -> bf16 cast truncates, bf16 is rounded in fp32 first (the bits' low half rounded
    to even) and the cast is then exact."""
    if dtype == tl.float16:
        x = tl.minimum(tl.maximum(x, -FP16_MAX), FP16_MAX)
    elif ROT.INTERPRETED:
        u = x.to(tl.int32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & -65536
        x = u.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _load_parts(Xh, stride_x, rows, L, z, POS, stride_pz, COS, SIN, stride_tz, stride_tp, P,
                HAS_POS: tl.constexpr, ROT: tl.constexpr, SHAPE: tl.constexpr):
    """Rows `rows` of one head after RoPE, in parts, all in the input dtype: (a, b) [T, HALF_BLOCK]
    the rotated pairs (a_i = x_ia·cos_ia - x_ib·sin_ia, b_i = x_ib·cos_ib + x_ia·sin_ib, in fp32:
    one product, one FMA, then rounded, _rope_round), and r [T, REST_BLOCK] the channels [R, D)
    passed through; 0 outside the head; an absent part is 0.0.

    Loading the pairs as two column sets (not a tile and its rotate_half partner) reads each input
    byte and each table value once. Both members' table columns are read, so any table is applied
    as the model applies it (no check that it repeats its frequencies, RopeSpec); the table rows
    are small and shared by the heads that neighbouring programs take (L2 hits)."""
    row_ok = rows < L
    ptrs = Xh + rows[:, None].to(tl.int64) * stride_x
    a = 0.0
    b = 0.0
    r = 0.0
    if ROT.ROPE != "":
        xa, xb = _pair_tile(ptrs, 0, row_ok, ROT)
        if HAS_POS:
            pos = tl.load(POS + z.to(tl.int64) * stride_pz + rows, mask=row_ok, other=0)
        else:
            pos = rows
        pos = tl.minimum(tl.maximum(pos, 0), P - 1)
        t_row = z.to(tl.int64) * stride_tz + pos[:, None].to(tl.int64) * stride_tp
        # Each channel by its own table column: a pair's two columns may differ (RopeSpec).
        cos_a, cos_b = _pair_tile(COS, t_row, row_ok, ROT)
        sin_a, sin_b = _pair_tile(SIN, t_row, row_ok, ROT)
        # Explicit FMAs: which product the compiler would fuse is not ours to guess, and the
        # reference (reference.apply_rope_rounded) must round as this does, bit for bit.
        a = _rope_round(_fma(xa, cos_a, -(xb * sin_a), ROT), Xh.dtype.element_ty, ROT)
        b = _rope_round(_fma(xb, cos_b, xa * sin_b, ROT), Xh.dtype.element_ty, ROT)
    if ROT.REST_BLOCK > 0:
        ir = ROT.ROPE_DIM + tl.arange(0, ROT.REST_BLOCK)
        r = tl.load(ptrs + ir[None, :], mask=row_ok[:, None] & (ir < SHAPE.D)[None, :], other=0.0)
    return a, b, r


@triton.jit
def _had_rows(HAD, idx, ok, BLOCK_D: tl.constexpr):
    """Rows idx (where ok) of HAD, [len(idx), BLOCK_D] fp16; the rest 0."""
    cols = tl.arange(0, BLOCK_D)
    return tl.load(HAD + idx[:, None] * BLOCK_D + cols[None, :], mask=ok[:, None], other=0.0)


@triton.jit
def _pairs_ok(ROT: tl.constexpr):
    """Which entries of the pair parts are real pairs (i < R / 2)."""
    return tl.arange(0, ROT.HALF_BLOCK) < ROT.ROPE_DIM // 2


@triton.jit
def _had_parts(HAD, ROT: tl.constexpr, SHAPE: tl.constexpr):
    """HAD's rows matching the parts of _load_parts: (rows ia, rows ib, rows [R, D)); an absent
    part is 0.0. Loaded once per program: the persistent loops reuse them for every tile."""
    ha = 0.0
    hb = 0.0
    hr = 0.0
    if ROT.HADAMARD:
        if ROT.ROPE != "":
            ia, ib = _pair_columns(ROT)
            ha = _had_rows(HAD, ia, _pairs_ok(ROT), SHAPE.BLOCK_D)
            hb = _had_rows(HAD, ib, _pairs_ok(ROT), SHAPE.BLOCK_D)
        if ROT.REST_BLOCK > 0:
            ir = ROT.ROPE_DIM + tl.arange(0, ROT.REST_BLOCK)
            hr = _had_rows(HAD, ir, ir < SHAPE.D, SHAPE.BLOCK_D)
    return ha, hb, hr


@triton.jit
def _input_dot(x, had, acc, ROT: tl.constexpr):
    """acc + x·had for x in the input dtype (bf16 / fp16) and had the ±1 matrix in the same dtype:
    exact products summed in fp32, so no scaling and no fp32 copy of the tile (without RoPE the
    loaded tile is only the dot's operand)."""
    if ROT.INTERPRETED:
        return tl.dot(x.to(tl.float32), had.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(x, had, acc)


@triton.jit
def _hadamard(a, b, r, had, T: tl.constexpr, ROT: tl.constexpr, SHAPE: tl.constexpr):
    """(a, b, r)·HAD·HAD_SCALE, [T, BLOCK_D] fp32: input-dtype dots part by part against `had`
    (_had_parts), so the parts are never reassembled into a tile.

    Every part is input values (RoPE's pairs rounded to the input dtype, _load_parts): their
    products with ±1 are exact and the tensor cores sum them in fp32, D multiply-adds per element
    and output channel: fewer instructions than a log2(b)-stage butterfly of register shuffles.
    (Before 2026-11-29 RoPE's pairs stayed fp32: a per-row power-of-two scaling and fp16 hi + lo
    dots, twice the tensor work; docs/design/fp8_prologue.md.)"""
    BLOCK_D: tl.constexpr = SHAPE.BLOCK_D   # shapes in list literals need constexprs
    acc = tl.zeros([T, BLOCK_D], dtype=tl.float32)
    if ROT.ROPE != "":
        acc = _input_dot(a, had[0], acc, ROT)
        acc = _input_dot(b, had[1], acc, ROT)
    if ROT.REST_BLOCK > 0:
        acc = _input_dot(r, had[2], acc, ROT)
    return acc * ROT.HAD_SCALE


@triton.jit
def _qk_tile(Xh, stride_x, rows, L, z, POS, stride_pz, COS, SIN, stride_tz, stride_tp, P, had,
             mean, HAS_POS: tl.constexpr, SMOOTH: tl.constexpr, T: tl.constexpr,
             ROT: tl.constexpr, SHAPE: tl.constexpr):
    """Rows `rows` of a Q / K head, rotated by `had` (_had_parts) and smoothed; 0 outside the
    head. With the Hadamard rotation a [T, BLOCK_D] tile (then 0.0, 0.0), else the parts (a, b, r)
    of _load_parts; `mean` is laid out the same way."""
    a, b, r = _load_parts(Xh, stride_x, rows, L, z, POS, stride_pz, COS, SIN, stride_tz,
                          stride_tp, P, HAS_POS, ROT, SHAPE)
    row_ok = (rows < L)[:, None]
    if ROT.HADAMARD:
        if ROT.ROPE != "" and (T < 64 or ROT.ROPE_SELECT):
            # Triton moves the conversion to the dots' A layout above elementwise ops (all of
            # RoPE), not above a select: these keep RoPE in the blocked layout. Under 64 rows (head
            # dims over 128, mma.sync) always: that A layout holds each row on every warp (RoPE
            # done once per warp). At 64 rows and more (wgmma) where the launch's registers are
            # short (ROT.ROPE_SELECT, host.rope_select): RoPE in the A layout spills there.
            a = tl.where(row_ok, a, 0.0)
            b = tl.where(row_ok, b, 0.0)
        y = _hadamard(a, b, r, had, T, ROT, SHAPE)
        if SMOOTH:
            y = tl.where(row_ok, y - mean[0][None, :], 0.0)
        return y, 0.0, 0.0
    else:
        if ROT.ROPE != "":
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if ROT.REST_BLOCK > 0:
            r = r.to(tl.float32)
        if SMOOTH:
            if ROT.ROPE != "":
                a = tl.where(row_ok, a - mean[0][None, :], 0.0)
                b = tl.where(row_ok, b - mean[1][None, :], 0.0)
            if ROT.REST_BLOCK > 0:
                r = tl.where(row_ok, r - mean[2][None, :], 0.0)
        return a, b, r


@triton.jit
def _tile_amax(parts, ROT: tl.constexpr):
    """max |value| over a _qk_tile result."""
    if ROT.HADAMARD:
        return tl.max(tl.max(tl.abs(parts[0]), axis=1), axis=0)
    else:
        m = tl.zeros([], dtype=tl.float32)
        if ROT.ROPE != "":
            m = tl.maximum(tl.max(tl.max(tl.abs(parts[0]), axis=1), axis=0),
                           tl.max(tl.max(tl.abs(parts[1]), axis=1), axis=0))
        if ROT.REST_BLOCK > 0:
            m = tl.maximum(m, tl.max(tl.max(tl.abs(parts[2]), axis=1), axis=0))
        return m


@triton.jit
def _qk_store(Oh, parts, rows, stop, scale, inv_scale, ROT: tl.constexpr, SHAPE: tl.constexpr,
              QUANT: tl.constexpr):
    """Store a _qk_tile result as int8 or e4m3 (_to_qk) into rows `rows` (< stop) of the contiguous
    output head."""
    row_ok = (rows < stop)[:, None]
    optrs = Oh + rows[:, None].to(tl.int64) * SHAPE.D
    if ROT.HADAMARD:
        cols = tl.arange(0, SHAPE.BLOCK_D)
        tl.store(optrs + cols[None, :], _to_qk(parts[0], scale, inv_scale, QUANT),
                 mask=row_ok & (cols < SHAPE.D)[None, :])
    else:
        if ROT.ROPE != "":
            ia, ib = _pair_columns(ROT)
            ok = row_ok & _pairs_ok(ROT)[None, :]
            tl.store(optrs + ia[None, :], _to_qk(parts[0], scale, inv_scale, QUANT), mask=ok)
            tl.store(optrs + ib[None, :], _to_qk(parts[1], scale, inv_scale, QUANT), mask=ok)
        if ROT.REST_BLOCK > 0:
            ir = ROT.ROPE_DIM + tl.arange(0, ROT.REST_BLOCK)
            tl.store(optrs + ir[None, :], _to_qk(parts[2], scale, inv_scale, QUANT),
                     mask=row_ok & (ir < SHAPE.D)[None, :])


@triton.jit
def _qk_group(X, stride_xz, stride_xh, stride_x, OUT, SCALE, z, h, H, g, L, n_groups, group_rows,
              POS, stride_pz, COS, SIN, stride_tz, stride_tp, P, had, mean,
              HAS_POS: tl.constexpr, SMOOTH: tl.constexpr, T: tl.constexpr,
              ONE_TILE: tl.constexpr, ROT: tl.constexpr, SHAPE: tl.constexpr,
              QUANT: tl.constexpr):
    """Quantize group g of Q or K head (z, h): rows [g * group_rows, ...) of L."""
    zh = z * H + h
    Xh = X + z.to(tl.int64) * stride_xz + h.to(tl.int64) * stride_xh
    Oh = OUT + zh.to(tl.int64) * L * SHAPE.D
    start = g * group_rows
    if ONE_TILE:
        rows = start + tl.arange(0, T)
        parts = _qk_tile(Xh, stride_x, rows, L, z, POS, stride_pz, COS, SIN, stride_tz,
                         stride_tp, P, had, mean, HAS_POS, SMOOTH, T, ROT, SHAPE)
        scale = _qk_scale_of(_tile_amax(parts, ROT), QUANT)
        _qk_store(Oh, parts, rows, L, scale, tl.div_rn(1.0, scale), ROT, SHAPE, QUANT)
    else:
        stop = tl.minimum(start + group_rows, L)
        amax = tl.zeros([], dtype=tl.float32)
        for r0 in range(start, stop, T):
            parts = _qk_tile(Xh, stride_x, r0 + tl.arange(0, T), L, z, POS, stride_pz, COS, SIN,
                             stride_tz, stride_tp, P, had, mean, HAS_POS, SMOOTH, T, ROT, SHAPE)
            amax = tl.maximum(amax, _tile_amax(parts, ROT))
        scale = _qk_scale_of(amax, QUANT)
        inv_scale = tl.div_rn(1.0, scale)
        for r0 in range(start, stop, T):
            rows = r0 + tl.arange(0, T)
            parts = _qk_tile(Xh, stride_x, rows, L, z, POS, stride_pz, COS, SIN, stride_tz,
                             stride_tp, P, had, mean, HAS_POS, SMOOTH, T, ROT, SHAPE)
            _qk_store(Oh, parts, rows, stop, scale, inv_scale, ROT, SHAPE, QUANT)
    tl.store(SCALE + zh * n_groups + g, scale)


@triton.jit
def _v_tile(Vh, stride_vn, r0, N, T: tl.constexpr, SHAPE: tl.constexpr):
    rows = r0 + tl.arange(0, T)
    cols = tl.arange(0, SHAPE.BLOCK_DV)
    ok = (rows < N)[:, None] & (cols < SHAPE.DV)[None, :]
    return tl.load(Vh + rows[:, None].to(tl.int64) * stride_vn + cols[None, :], mask=ok,
                   other=0.0).to(tl.float32)


@triton.jit
def _v_store(VTh, y, inv_scale, r0, stop, N_PAD, T: tl.constexpr, SHAPE: tl.constexpr,
             QUANT: tl.constexpr):
    """Store the e4m3 tile transposed: VT8 rows are channels, columns tokens. Columns in
    [N, N_PAD) hold zeros (the tile read them as 0).

    N_PAD, r0 and stop are multiples of 16 that the compiler knows as such (N_PAD and
    kv_group_rows are specialized, not do_not_specialize): that is what lets the store go out as
    16 tokens per thread (st.global.v4, after a layout conversion through shared memory) rather
    than one byte per thread and instruction (64 st.global.b8 per thread for a 128 x 128 tile)."""
    rows = r0 + tl.arange(0, T)
    cols = tl.arange(0, SHAPE.BLOCK_DV)
    yt = tl.trans(_to_e4m3_pow2(y, inv_scale, QUANT))
    ok = (cols < SHAPE.DV)[:, None] & (rows < stop)[None, :]
    tl.store(VTh + cols[:, None].to(tl.int64) * N_PAD + rows[None, :], yt, mask=ok)


@triton.jit
def _v_group(V, stride_vz, stride_vh, stride_vn, VT, SCALE, SCALE_MAX, z, h, H, g, N, N_PAD,
             n_groups, group_rows, T: tl.constexpr, ONE_TILE: tl.constexpr,
             SHAPE: tl.constexpr, QUANT: tl.constexpr):
    """Quantize group g of V head (z, h) into VT8's columns [g * group_rows, ...)."""
    zh = z * H + h
    Vh = V + z.to(tl.int64) * stride_vz + h.to(tl.int64) * stride_vh
    VTh = VT + zh.to(tl.int64) * SHAPE.DV * N_PAD
    start = g * group_rows
    if ONE_TILE:
        y = _v_tile(Vh, stride_vn, start, N, T, SHAPE)
        amax = tl.max(tl.max(tl.abs(y), axis=1), axis=0)
        scale = _pow2_scale_of(amax)
        _v_store(VTh, y, tl.div_rn(1.0, scale), start, N_PAD, N_PAD, T, SHAPE, QUANT)
    else:
        # The last group's pad columns [N, N_PAD) are written too (a tile of T >= 16 rows covers them).
        stop = tl.minimum(start + group_rows, N_PAD)
        amax = tl.zeros([], dtype=tl.float32)
        for r0 in range(start, stop, T):
            y = _v_tile(Vh, stride_vn, r0, N, T, SHAPE)
            amax = tl.maximum(amax, tl.max(tl.max(tl.abs(y), axis=1), axis=0))
        scale = _pow2_scale_of(amax)
        inv_scale = tl.div_rn(1.0, scale)
        for r0 in range(start, stop, T):
            y = _v_tile(Vh, stride_vn, r0, N, T, SHAPE)
            _v_store(VTh, y, inv_scale, r0, stop, N_PAD, T, SHAPE, QUANT)
    tl.store(SCALE + zh * n_groups + g, scale)
    # An all-zero group's scale (1) says nothing about V's range: only the others count.
    tl.atomic_max(SCALE_MAX + zh, scale, mask=amax > 0, sem="relaxed")


@triton.jit
def _k_mean(K_PART, zh, cols, n, n_chunks, N, QUANT: tl.constexpr, BLOCK_D: tl.constexpr):
    """K's mean over its N sampled tokens at channels `cols` (those < n; the rest 0): the chunk
    sums of K_PART added one after another, chunk 0 first (((p0 + p1) + p2) + ...: elementwise,
    so the same bits in any layout; chunks past n_chunks add +0), then divided by N.
    k_mean_kernel computes the same for the Gluon kernel, which reads K_MEAN (tl.sum over the
    chunk axis grouped the adds by the layout Triton chose, which another kernel cannot follow)."""
    CHUNKS: tl.constexpr = QUANT.SMOOTH_CHUNKS
    s = tl.zeros(cols.shape, dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        part = tl.load(K_PART + (zh * CHUNKS + c).to(tl.int64) * BLOCK_D + cols,
                       mask=(c < n_chunks) & (cols < n), other=0.0)
        if c == 0:
            s = part
        else:
            s = s + part
    return tl.div_rn(s, N.to(tl.float32))


@triton.jit
def _k_means(K_PART, zh, n_chunks, N, ROT: tl.constexpr, QUANT: tl.constexpr,
             SHAPE: tl.constexpr):
    """The mean laid out as _qk_tile's result: the rotated channels, or the parts (a, b, r)."""
    if ROT.HADAMARD:
        return (_k_mean(K_PART, zh, tl.arange(0, SHAPE.BLOCK_D), SHAPE.D, n_chunks, N, QUANT,
                        SHAPE.BLOCK_D), 0.0, 0.0)
    else:
        ma = 0.0
        mb = 0.0
        mr = 0.0
        if ROT.ROPE != "":
            ia, ib = _pair_columns(ROT)
            ma = _k_mean(K_PART, zh, ia, ROT.ROPE_DIM, n_chunks, N, QUANT, SHAPE.BLOCK_D)
            mb = _k_mean(K_PART, zh, ib, ROT.ROPE_DIM, n_chunks, N, QUANT, SHAPE.BLOCK_D)
        if ROT.REST_BLOCK > 0:
            ir = ROT.ROPE_DIM + tl.arange(0, ROT.REST_BLOCK)
            mr = _k_mean(K_PART, zh, ir, SHAPE.D, n_chunks, N, QUANT, SHAPE.BLOCK_D)
        return ma, mb, mr


# Sizes that follow the lengths or the batch: no specialization on them (one compile per kind).
# kv_group_rows (a power of two >= 16, or N_PAD) and N_PAD stay specialized: their divisibility
# by 16 is what vectorizes the Vᵀ store (_v_store).
_RUNTIME_SIZES = ["M", "N", "P", "Z", "NQ", "NK", "QG", "KG", "q_group_rows", "n_chunks",
                  "n_sample"]


@triton.jit(do_not_specialize=_RUNTIME_SIZES)
def prologue_kernel(
    Q, K, V, Q8, K8, VT8, Q_SCALE, K_SCALE, V_SCALE, V_SCALE_MAX, K_PART, K_MEAN,
    HAD, COS, SIN, QPOS, KPOS,
    stride_qz, stride_qh, stride_qm,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn,
    stride_tz, stride_tp, stride_qpz, stride_kpz,
    Z, HQ, HKV, M, N, N_PAD, P, NQ, NK, QG, KG, q_group_rows, kv_group_rows, n_chunks, n_sample,
    SHAPE: tl.constexpr, ROT: tl.constexpr, QUANT: tl.constexpr,
):
    """Persistent: program p takes Q groups p, p + n_programs, ..., then the K groups, then the V
    groups the same way. HAD's rows are loaded once per program, not once per group; a loop of
    groups lets the compiler keep the next group's loads in flight (num_stages > 1)."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    had = _had_parts(HAD, ROT, SHAPE)
    for t in tl.range(pid, NQ, n_programs):
        zh = t % (Z * HQ)
        _qk_group(Q, stride_qz, stride_qh, stride_qm, Q8, Q_SCALE, zh // HQ, zh % HQ, HQ,
                  t // (Z * HQ), M, QG, q_group_rows, QPOS, stride_qpz, COS, SIN, stride_tz,
                  stride_tp, P, had, (0.0, 0.0, 0.0), ROT.Q_POS, False, SHAPE.TILE_M,
                  SHAPE.Q_ONE_TILE, ROT, SHAPE, QUANT)
    for t in tl.range(pid, NK, n_programs):
        zh = t % (Z * HKV)
        g = t // (Z * HKV)
        mean = (0.0, 0.0, 0.0)
        if QUANT.SMOOTH_K:
            mean = _k_means(K_PART, zh, n_chunks, n_sample, ROT, QUANT, SHAPE)
            if g == 0:
                d = tl.arange(0, SHAPE.BLOCK_D)
                tl.store(K_MEAN + zh * SHAPE.D + d,
                         _k_mean(K_PART, zh, d, SHAPE.D, n_chunks, n_sample, QUANT, SHAPE.BLOCK_D),
                         mask=d < SHAPE.D)
        _qk_group(K, stride_kz, stride_kh, stride_kn, K8, K_SCALE, zh // HKV, zh % HKV, HKV,
                  g, N, KG, kv_group_rows, KPOS, stride_kpz, COS, SIN, stride_tz, stride_tp,
                  P, had, mean, ROT.K_POS, QUANT.SMOOTH_K, SHAPE.TILE_N, SHAPE.KV_ONE_TILE,
                  ROT, SHAPE, QUANT)
    for t in tl.range(pid, NK, n_programs):
        zh = t % (Z * HKV)
        _v_group(V, stride_vz, stride_vh, stride_vn, VT8, V_SCALE, V_SCALE_MAX, zh // HKV,
                 zh % HKV, HKV, t // (Z * HKV), N, N_PAD, KG, kv_group_rows, SHAPE.TILE_N,
                 SHAPE.KV_ONE_TILE, SHAPE, QUANT)


@triton.jit(do_not_specialize=["n_chunks", "N"])
def k_mean_kernel(K_PART, K_MEAN, n_chunks, N, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  QUANT: tl.constexpr, PDL: tl.constexpr = False):
    """smooth_k for the Gluon kernel (gluon_sm90.py), between k_sums_kernel and it: head zh's mean
    K_MEAN[zh, :D] from its K_PART rows, _k_mean's operations (the Triton prologue computes the
    same values in its K programs), so that the Gluon kernel reads the bits the Triton kernel
    subtracts. One program a head. PDL (launched programmatically dependent on k_sums_kernel):
    lets the Gluon kernel start at once (it waits for this grid before its K tiles), then waits
    for k_sums_kernel's stores."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    zh = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    tl.store(K_MEAN + zh * D + d, _k_mean(K_PART, zh, d, D, n_chunks, N, QUANT, BLOCK_D),
             mask=d < D)


@triton.jit
def _sample_tokens(j, N, S):
    """Token of smooth_k's sample entry j (< S) in a head of N tokens: one token per stratum
    [j·N / S, (j + 1)·N / S), at an offset in it hashed from j (Knuth's multiplicative hash, the
    top 32 bits of hash · width); every token when S = N (reference.smooth_sample, the same
    integer arithmetic)."""
    j64 = j.to(tl.int64)
    lo = j64 * N // S
    width = (j64 + 1) * N // S - lo
    h = (j64 * KNUTH_HASH) & 0xFFFFFFFF
    return lo + ((h * width) >> 32)


@triton.jit(do_not_specialize=["N", "S", "P"])
def k_sums_kernel(
    K, K_PART, HAD, COS, SIN, KPOS,
    stride_kz, stride_kh, stride_kn, stride_tz, stride_tp, stride_kpz,
    HKV, N, S, P,
    SHAPE: tl.constexpr, ROT: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr = False,
):
    """smooth_k's pre-pass over a sample of S tokens of K (_sample_tokens): program (zh, c) sums
    the RoPE'd sample rows [c·SMOOTH_ROWS, (c + 1)·SMOOTH_ROWS) of head zh, rotates the sum (the
    rotation is linear: rotating the D-vector is cheaper than the tiles) and writes it to
    K_PART[zh, c]. PDL (the Gluon kernel's smooth_k, sm90): lets the next launch (k_mean_kernel,
    launched programmatically dependent) start at once; it waits for this grid's stores."""
    if PDL:
        gdc_launch_dependents()
    zh = tl.program_id(0)
    c = tl.program_id(1)
    z = zh // HKV
    h = zh % HKV
    BLOCK_D: tl.constexpr = SHAPE.BLOCK_D   # shapes in list literals need constexprs
    REST: tl.constexpr = ROT.REST_BLOCK
    Kh = K + z.to(tl.int64) * stride_kz + h.to(tl.int64) * stride_kh
    j = c * QUANT.SMOOTH_ROWS + tl.arange(0, QUANT.SMOOTH_ROWS)
    rows = tl.where(j < S, _sample_tokens(j, N, S), N)      # past the sample: row N, masked
    a, b, r = _load_parts(Kh, stride_kn, rows, N, z, KPOS, stride_kpz, COS, SIN, stride_tz,
                          stride_tp, P, ROT.K_POS, ROT, SHAPE)
    if ROT.ROPE != "":
        sa = tl.sum(a.to(tl.float32), axis=0)
        sb = tl.sum(b.to(tl.float32), axis=0)
    if REST > 0:
        sr = tl.sum(r.to(tl.float32), axis=0)
    out = K_PART + (zh * QUANT.SMOOTH_CHUNKS + c).to(tl.int64) * BLOCK_D
    ia, ib = _pair_columns(ROT)
    ir = ROT.ROPE_DIM + tl.arange(0, REST if REST > 0 else 16)
    if ROT.HADAMARD:
        # Exact ±1 products, fp32 sums: sum_i s[i] * HAD[channel_i, j], part by part.
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        if ROT.ROPE != "":
            acc += tl.sum(sa[:, None] * _had_rows(HAD, ia, _pairs_ok(ROT), BLOCK_D).to(tl.float32), 0)
            acc += tl.sum(sb[:, None] * _had_rows(HAD, ib, _pairs_ok(ROT), BLOCK_D).to(tl.float32), 0)
        if REST > 0:
            acc += tl.sum(sr[:, None] * _had_rows(HAD, ir, ir < SHAPE.D, BLOCK_D).to(tl.float32), 0)
        tl.store(out + tl.arange(0, BLOCK_D), acc * ROT.HAD_SCALE)
    else:
        if ROT.ROPE != "":
            tl.store(out + ia, sa, mask=_pairs_ok(ROT))
            tl.store(out + ib, sb, mask=_pairs_ok(ROT))
        if REST > 0:
            tl.store(out + ir, sr, mask=ir < SHAPE.D)
