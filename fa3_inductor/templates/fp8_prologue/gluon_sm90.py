"""The FP8 prologue's hot case on Hopper (sm90), in Gluon: a TMA ring, RoPE from shared memory, the
Hadamard rotation on wgmma, block quantization, TMA stores. Same operands as kernel.py's
`prologue_kernel`, bit for bit by construction (docs/design/fp8_prologue.md, "The Gluon prologue";
unverified on a GPU until the gpu tests run it).

Notation
--------
    Q: [Z, HQ, M, D], K: [Z, HKV, N, D], V: [Z, HKV, N, D]   bf16 / fp16, TMA-aligned (host checks)
    Q8, K8 [Z, H, L, D] int8 or e4m3, VT8 [Z, HKV, D, N_PAD] e4m3, Q_SCALE / K_SCALE / V_SCALE
    [Z, H, G] float32, V_SCALE_MAX [Z, HKV]: as kernel.py (the same tensors, host.py allocates)
    T = 128         rows of a tile, which is also a scale group (block_m = block_n = 128)
    DQ = D / 4      columns of a chunk: a tile travels as 4 chunks [T, DQ] (TMA boxes, wgmma K steps)
    HADK [D, D]     HAD's rows in the order the Triton kernel contracts them (host): "half" and no
                    RoPE channel order; "interleaved" the even channels, then the odd ones. Chunk c
                    of the contraction is A chunk c times HADK rows [c·DQ, (c+1)·DQ): the same k16
                    steps, in the same order, as kernel.py's dots over the parts (a, b) or r.
    pair chunk j    (j = 0, 1) the pairs i in [j·DQ, (j+1)·DQ): members a_i (channel ia[i]) and b_i
                    (ib[i]); "half" ia = i, ib = i + D/2 (ring chunks j and j + 2); "interleaved"
                    ia = 2i, ib = 2i + 1, both in one int32 word (ring read as int32 [T, DQ] chunks)
    unit            (row block g, batch z, a run of HC consecutive heads, HC dividing H): what a
                    program takes at once; its tiles are its heads, so the RoPE table rows of the
                    block are loaded once (registers) and reused across HC heads. The Q, K and V
                    units are one round-robin over the programs (_first_unit, unit_heads)

Roles (warp_specialize):
    consumer (default partition, 8 warps = 2 warpgroups, rows [64w, 64w + 64) of a tile in the
             wgmma): loads HADK into shared memory once; per unit, the table parts of its rows
             (registers, fp32 where read as words: _table_parts); per Q / K tile: RoPE from the
             ring slot (fp32, rounded to the input dtype) into one of two A buffers, releases the
             slot, 4 chained async wgmma (straight from the ring slot without RoPE), then amax,
             scale, quantize, TMA store. With RoPE pipelined by one tile (_qk_units): tile t's
             wgmma runs under tile t + 1's RoPE; without RoPE tile t + 1's wgmma under tile t's
             staging barrier and store only (two programs an SM at D 64 overlap the rest). V tiles:
             amax, power-of-two scale, e4m3, transposed through shared memory, TMA store. A tile's
             amax: each warp's max into shared memory, one CTA barrier, every thread reads the 8
             (_warp_amax, _cta_amax); that barrier also stands for the tile's wgmma waits,
             ring-slot reads and A-buffer stores before it (docs/design/fp8_prologue.md, "Fewer
             barriers a tile")
    producer (1 warp, its warpgroup at PRODUCER_REGS): the same walk over units and tiles, TMA
             loads into a STAGES-deep ring; ready[s] (TMA transaction count), empty[s] (the
             consumer's one arrive, thread 0 after a partition barrier)

Shared memory: the ring (STAGES x T x D input values), A (two buffers of T x D, RoPE only), HADK
(D x D), the output staging (T x D bytes; Q8 / K8 tiles, and Vᵀ tiles through a reinterpreted view),
the warps' amax partials (8 floats), barriers: D 128 with RoPE 96 + 64 + 32 + 16 KB = 208 KB at 3
stages.

smooth_k: kernel.k_sums_kernel (the sampled partial sums) and kernel.k_mean_kernel (K_MEAN, the
operations the Triton K programs use for their mean) run before this kernel; its K tiles subtract
K_MEAN after the rotation (_smooth), so the Triton and Gluon kernels subtract the same bits.

Compile-time parameters (one bundle, `CFG`, a frozen dataclass `GluonPrologue`): D, STAGES, ROPE,
Q_POS, K_POS, QK_INT8, HAD_SCALE, PRODUCER_REGS, RELEASE_IN_ROPE, SMOOTH, ROPE_WORDS,
HALF_TABLE_WORDS, PDL.
Lengths and unit counts are do_not_specialize.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from . import reference

T_ROWS = 128          # rows of a tile and of a scale group
CONSUMER_WARPS = 8    # two warpgroups: 64 tile rows each in the wgmma
WARPS: gl.constexpr = gl.constexpr(CONSUMER_WARPS)
E4M3_MAX: gl.constexpr = gl.constexpr(448.0)
INT8_MAX: gl.constexpr = gl.constexpr(127.0)
RINT_MAGIC: gl.constexpr = gl.constexpr(12582912.0)   # 1.5 * 2^23 (kernel.py)
FP16_MAX: gl.constexpr = gl.constexpr(reference.FP16_MAX)


@dataclass(frozen=True)
class GluonPrologue:
    """The kernel's compile-time parameters."""
    D: int              # head dim of Q, K and V (64 or 128)
    STAGES: int         # ring depth (tiles of T x D input values in flight per program)
    ROPE: str           # "", "half" or "interleaved" (over all D channels)
    Q_POS: bool         # QPOS given (else the row index)
    K_POS: bool
    QK_INT8: bool       # Q8, K8 int8 (else e4m3)
    HAD_SCALE: float    # 1 / sqrt(b), kernel.py's Rotation.HAD_SCALE
    PRODUCER_REGS: int  # setmaxnreg of the producer warp
    RELEASE_IN_ROPE: bool = False  # RoPE, not DEFER_A: where a tile's ring slot is released (below)
    SMOOTH: bool = False           # smooth_k: K tiles minus K_MEAN (k_mean_kernel's) per head
    ROPE_WORDS: bool = True        # "half": x read from the ring as int32 pair words (_ring_half);
                                   # "interleaved" (x always words): the cos / sin tables read as
                                   # pair words, held as fp32 (_table_parts)
    HALF_TABLE_WORDS: bool = True  # "half": the cos / sin tables read as int32 words and held as
                                   # fp32 (_half_table_fp32); False: 2-byte values (rows not on
                                   # 4 bytes: _half_table_words)
    PDL: bool = False              # SMOOTH, launched programmatically dependent on k_mean_kernel:
                                   # the consumer waits for it (griddepcontrol.wait) before K

    @property
    def DQ(self) -> int:
        return self.D // 4

    @property
    def DEFER_A(self) -> bool:
        """RoPE, the order of a pipelined tile (_qk_next). True (D 64): tile t + 1's A buffer is
        stored after tile t's amax barrier, which orders it after the wgmma issued last (3
        barriers a Q / K tile), and its wgmma issued after tile t's staging barrier. False
        (D 128): the A buffer is stored as the RoPE makes it (the hazard pass puts a barrier
        before: 4 a tile) and fenced, so tile t + 1's wgmma can be issued right after tile t's
        quantization, and tile t's staging fence, barrier and TMA store run under it (off the
        wgmma-to-wgmma chain). At D 128 the deferred store keeps the RoPE output live across the
        wgmma wait beside the tables and the accumulator: the tables spill in the tile loop (24
        LDL / STL a tile at 240 registers) and ptxas hoists the wait above the RoPE (no overlap).
        At D 64 the RoPE outlasts the wgmma (a quarter of D 128's), so a barrier in it costs
        more than the staging barrier on the chain."""
        return self.D <= 64

    @property
    def ROPE_RELEASE(self) -> bool:
        """RoPE without DEFER_A (D 128): tile t + 1's ring slot is released inside its RoPE, after
        its last loads (a barrier, the arrive, and the barrier Triton 3.6 puts after an arrive:
        under tile t's running wgmma, none on the wgmma-to-wgmma chain), rather than after tile
        t's amax barrier (one barrier on the chain, two fewer a tile). RELEASE_IN_ROPE, a
        PrologueTuning field (gluon_rope_release) for the sweep: the better side depends on
        whether the RoPE, its three barriers included, stays shorter than the wgmma (~1024 cycles
        of tensor work at D 128 against ~850 modelled: docs/design/fp8_prologue.md). False by
        default since the H200 sweep of 2026-11-29 (-1.2% at 3 stages, -1.2% at 2, RoPE "half";
        fp8-prologue-bw-nvidia-h200-2026-11-29-1022)."""
        return self.RELEASE_IN_ROPE and bool(self.ROPE) and not self.DEFER_A

    @property
    def HANDOFF(self) -> bool:
        """RoPE: the Q phase's table load after its last unit, which read rows past the last row
        block (every load masked off, ~330 warp instructions at D 128 for nothing), reads the K
        phase's first unit's rows instead, which the K phase then takes as loaded (PRELOADED):
        one table load fewer a program, and the K phase's first tile no longer waits for an L2 /
        DRAM round trip (the load ran under the last Q tile's wgmma). Only where Q and K index
        the tables alike (both with positions or neither: _table_parts' HAS_POS), at D 128
        without SMOOTH: there the tile loops keep their length and stay free of spills (sm90
        SASS); with SMOOTH ("half") the Q loop reloaded 3 values a tile from the stack, at D 64
        a Q or K loop grew by 1-2 instructions: there SKIP_LAST_Q instead (docs/design/
        fp8_prologue.md, "The tables at a phase's end: handed on or skipped")."""
        return (bool(self.ROPE) and self.Q_POS == self.K_POS and not self.DEFER_A
                and not self.SMOOTH)

    @property
    def SKIP_LAST_Q(self) -> bool:
        """RoPE at D 64 or with SMOOTH (no HANDOFF): the Q phase's table load after its last unit
        (masked-off rows, read by nothing) is skipped by a branch. There the tile loops keep their
        SASS; at D 128 without SMOOTH the same branch made ptxas reload the global-memory
        descriptor (ULDC.64 c[0x0][0x208]) in the Q, K and V loops (+1, +1, +3 instructions a
        tile), so that Q phase keeps the load (HANDOFF reads real rows with it)."""
        return bool(self.ROPE) and (self.DEFER_A or self.SMOOTH)

    @property
    def SKIP_LAST_K(self) -> bool:
        """RoPE: the K phase's table load after its last unit (masked-off rows; V has no RoPE) is
        skipped by a branch: every tile loop keeps its SASS (sm90, D 64 and 128, with and without
        SMOOTH; docs/design/fp8_prologue.md, "The tables at a phase's end: handed on or
        skipped")."""
        return bool(self.ROPE)

    @property
    def TILE_BYTES(self) -> int:    # the ready barrier's transaction count per tile
        return T_ROWS * self.D * 2


# ---- the quantization and RoPE arithmetic: kernel.py's helpers, the same operations ----------
@gluon.jit
def _qk_scale_of(amax, QK_INT8: gl.constexpr):
    if QK_INT8:
        return gl.where(amax > 0, gl.div_rn(amax, INT8_MAX), 1.0)
    else:
        return gl.where(amax > 0, gl.div_rn(amax, E4M3_MAX), 1.0)


@gluon.jit
def _pow2_scale_of(amax):
    bits = gl.where(amax > 0, gl.div_rn(amax, E4M3_MAX), 1.0).to(gl.int32, bitcast=True)
    up = gl.where((bits & 0x007FFFFF) != 0, (bits & 0x7F800000) + (1 << 23), bits)
    return up.to(gl.float32, bitcast=True)


@gluon.jit
def _pow2_reciprocal(scale):
    """1 / scale for _pow2_scale_of's scales, by exponent arithmetic: exactly div_rn(1, scale)
    (kernel.py's reciprocal). A finite scale is a power of two 2^e, e in [-126, 120] (amax / 448
    rounded up: amax of 2-byte floats is below 2^128 and, when positive, at least 2^-133, so the
    quotient is at least 2^-142 and a subnormal one rounds up to 2^-126), so 1 / scale = 2^-e is a
    normal float whose exponent field is 254 minus the scale's. An infinite V value makes the
    scale +inf, whose reciprocal is 0 (a NaN amax takes scale 1, a normal power of two)."""
    bits = scale.to(gl.int32, bitcast=True)
    inv = (0x7F000000 - bits).to(gl.float32, bitcast=True)
    return gl.where(bits < 0x7F800000, inv, 0.0)


@gluon.jit
def _to_qk(y, scale, inv_scale, QK_INT8: gl.constexpr):
    q = y * inv_scale
    x = gl.fma(gl.fma(q, -scale, y), inv_scale, q)       # kernel._quotient (sm90 branch)
    if QK_INT8:
        return (x + RINT_MAGIC).to(gl.int32, bitcast=True).to(gl.int8)   # kernel._to_int8
    else:
        return x.to(gl.float8e4nv)


@gluon.jit
def _rope_round(x, dtype: gl.constexpr):
    if dtype == gl.float16:
        x = gl.minimum(gl.maximum(x, -FP16_MAX), FP16_MAX)
    return x.to(dtype)


@gluon.jit
def _rope_pair(xa, xb, ca, cb, sa, sb, dtype: gl.constexpr):
    """kernel._load_parts: a = x_a cos_a - x_b sin_a, b = x_b cos_b + x_a sin_b, one product and
    one explicit FMA each in fp32, rounded to the input dtype."""
    a = _rope_round(gl.fma(xa, ca.to(gl.float32), -(xb * sa.to(gl.float32))), dtype)
    b = _rope_round(gl.fma(xb, cb.to(gl.float32), xa * sb.to(gl.float32)), dtype)
    return a, b


@gluon.jit
def _split_words(w, dtype: gl.constexpr):
    """An int32 word holding channels (2i, 2i + 1) -> both as fp32 (exact)."""
    if dtype == gl.bfloat16:
        lo = (w << 16).to(gl.float32, bitcast=True)
        hi = (w & -65536).to(gl.float32, bitcast=True)
    else:
        lo = w.to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
        hi = (w >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
    return lo, hi


# ---- work decomposition, shared by both roles ------------------------------------------------
@gluon.jit
def _first_unit(before, n_prog):
    """This program's first unit of a phase that follows `before` units: the Q, K and V units are
    one round-robin over the programs (unit i of the launch, Q then K then V, goes to program
    i mod n_prog), so that the programs' unit counts differ by one at most over the launch, not
    per phase (a per-phase round-robin gave the same programs every phase's remainder)."""
    return (gl.program_id(0) - before % n_prog + n_prog) % n_prog


@gluon.jit
def _unit(u, Z, H, HC):
    """Unit u -> (z, g, first head, end head): u = ((g·Z + z)·NC + c), NC = ceil(H / HC)."""
    nc = (H + HC - 1) // HC
    c = u % nc
    t = u // nc
    h0 = c * HC
    return t % Z, t // Z, h0, gl.minimum(h0 + HC, H)


@gluon.jit
def _v_walk(cnt, body: gl.constexpr, args, Z, HKV, UQ, UK, HCK, CFG: gl.constexpr):
    """This program's V tiles, `cnt = body(cnt, z, h, g, args, CFG)` each (the producer's loads,
    the consumer's tiles: both walk the same tiles in the same order): the launch's round-robin
    of units."""
    n_prog = gl.num_programs(0)
    for u in range(_first_unit(UQ + UK, n_prog), UK, n_prog):
        z, g, h0, h1 = _unit(u, Z, HKV, HCK)
        for h in range(h0, h1):
            cnt = body(cnt, z, h, g, args, CFG)
    return cnt


# ---- producer --------------------------------------------------------------------------------
@gluon.jit
def _load_tile(desc, ring, ring32, ready, empty, cnt, z, h, row0, WORDS: gl.constexpr,
               CFG: gl.constexpr):
    slot = cnt % CFG.STAGES
    mbarrier.wait(empty.index(slot), ((cnt // CFG.STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(slot), CFG.TILE_BYTES)
    if WORDS:   # int32 view: two chunks of DQ words = 2·DQ channels each
        for j in gl.static_range(2):
            tma.async_copy_global_to_shared(desc, [z, h, row0, j * CFG.DQ], ready.index(slot),
                                            ring32.index(slot * 2 + j))
    else:
        for j in gl.static_range(4):
            tma.async_copy_global_to_shared(desc, [z, h, row0, j * CFG.DQ], ready.index(slot),
                                            ring.index(slot * 4 + j))
    return cnt + 1


@gluon.jit
def _v_load(cnt, z, h, g, args, CFG: gl.constexpr):
    """The producer's V tile (_v_walk's body)."""
    v_desc, ring, ring32, ready, empty = args
    return _load_tile(v_desc, ring, ring32, ready, empty, cnt, z, h, g * 128, False, CFG)


@gluon.jit
def _producer(descs, smem, bars, sizes, outs, tables, CFG: gl.constexpr):
    q_desc, k_desc, v_desc, q8_desc, k8_desc, vt_desc = descs
    ring, ring32, a_stage, had_smem, o_stage, vt_stage, amax_smem = smem
    ready, empty = bars
    Z, HQ, HKV, M, N, P, UQ, UK, HCQ, HCK = sizes
    WORDS: gl.constexpr = CFG.ROPE == "interleaved"
    pid = gl.program_id(0)
    n_prog = gl.num_programs(0)
    cnt = 0
    for u in range(pid, UQ, n_prog):
        z, g, h0, h1 = _unit(u, Z, HQ, HCQ)
        for h in range(h0, h1):
            cnt = _load_tile(q_desc, ring, ring32, ready, empty, cnt, z, h, g * 128, WORDS, CFG)
    for u in range(_first_unit(UQ, n_prog), UK, n_prog):
        z, g, h0, h1 = _unit(u, Z, HKV, HCK)
        for h in range(h0, h1):
            cnt = _load_tile(k_desc, ring, ring32, ready, empty, cnt, z, h, g * 128, WORDS, CFG)
    _v_walk(cnt, _v_load, (v_desc, ring, ring32, ready, empty), Z, HKV, UQ, UK, HCK, CFG)


# ---- consumer --------------------------------------------------------------------------------
@gluon.jit
def _load_had(HADK, had_smem, CFG: gl.constexpr):
    """HADK's four row chunks into shared memory, once per program."""
    D: gl.constexpr = CFG.D
    DQ: gl.constexpr = CFG.DQ
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [8, 1], [1, 0])
    r = gl.arange(0, DQ, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    for j in gl.static_range(4):
        had_smem.index(j).store(gl.load(HADK + (j * DQ + r)[:, None] * D + c[None, :]))


@gluon.jit
def _half_table_fp32(T, t_row, ok, c0, layout: gl.constexpr, DQ: gl.constexpr):
    """Channels [c0, c0 + DQ) of the table rows at `t_row` (c0 even, rows on 4 bytes) as fp32 in
    `layout`: DQ / 2 int32 words (16-byte loads, as the 2-byte values' were), split by a shift and
    a mask a word (_split_words: exact; masked rows read 0 words, two +0.0 values)."""
    wl: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (DQ // 8), DQ // 8], [8, 1], [1, 0])
    iw = (c0 // 2 + gl.arange(0, DQ // 2, layout=gl.SliceLayout(0, wl)))[None, :]
    rows = gl.convert_layout(t_row, wl)
    w = gl.load((T + rows).to(gl.pointer_type(gl.int32), bitcast=True) + iw,
                mask=gl.convert_layout(ok, wl), other=0)
    lo, hi = _split_words(w, T.dtype.element_ty)
    return gl.convert_layout(gl.reshape(gl.join(lo, hi), [128, DQ]), layout)


@gluon.jit
def _table_parts(COS, SIN, POS, stride_pz, stride_tz, stride_tp, P, z, row0, L,
                 HAS_POS: gl.constexpr, CFG: gl.constexpr):
    """The table values of a row block for both pair chunks: (cos_a, cos_b, sin_a, sin_b) per
    chunk j, in the chunk layout: fp32 for tables read as words ("interleaved": ROPE_WORDS, not
    SMOOTH; "half": HALF_TABLE_WORDS), else in the tables' dtype; held across the unit's heads
    either way. Rows past L read 0 (kernel.py masks them the same way; their tile rows are 0 and
    never stored)."""
    DQ: gl.constexpr = CFG.DQ
    # 8 values (16 bytes of input, 32 of words) a thread along a chunk row; 8 warps down the rows
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (DQ // 8), DQ // 8], [8, 1], [1, 0])
    rows = row0 + gl.arange(0, 128, layout=gl.SliceLayout(1, layout))
    row_ok = rows < L
    if HAS_POS:
        pos = gl.load(POS + z.to(gl.int64) * stride_pz + rows, mask=row_ok, other=0)
    else:
        pos = rows
    pos = gl.minimum(gl.maximum(pos, 0), P - 1)
    t_row = (z.to(gl.int64) * stride_tz + pos.to(gl.int64) * stride_tp)[:, None]
    i = gl.arange(0, DQ, layout=gl.SliceLayout(0, layout))
    ok = row_ok[:, None]
    parts = ()
    tdtype: gl.constexpr = COS.dtype.element_ty
    for j in gl.static_range(2):
        if CFG.ROPE == "interleaved" and CFG.ROPE_WORDS:
            # pair i's (cos_a, cos_b) are channels (2i, 2i + 1), one int32 word: read 8 a thread
            # (two 16-byte loads) and split by a shift and a mask (exact, as the ring's words):
            # 8 loads a thread a unit where the 2-byte gathers took 64 (docs/design/
            # fp8_prologue.md, "Interleaved RoPE's tables as words"). launch keeps the row
            # starts 4-byte aligned (even strides) or turns ROPE_WORDS off.
            iw = (j * DQ + i)[None, :]
            cw = gl.load((COS + t_row).to(gl.pointer_type(gl.int32), bitcast=True) + iw,
                         mask=ok, other=0)
            sw = gl.load((SIN + t_row).to(gl.pointer_type(gl.int32), bitcast=True) + iw,
                         mask=ok, other=0)
            ca, cb = _split_words(cw, tdtype)
            sa, sb = _split_words(sw, tdtype)
            if CFG.SMOOTH:   # held as fp32 beside K_MEAN's addresses: a reload in the Q loop
                parts = parts + ((ca.to(tdtype), cb.to(tdtype), sa.to(tdtype), sb.to(tdtype)),)
            else:
                parts = parts + ((ca, cb, sa, sb),)
        elif CFG.ROPE == "half" and CFG.HALF_TABLE_WORDS:
            # held as fp32 across the unit: the 2-byte values were widened and repacked at every
            # unit change, with spills there (472 -> 331 instructions a warp at D 128, smooth_k
            # too: docs/design/fp8_prologue.md, "RoPE 'half' tables held as fp32")
            parts = parts + ((_half_table_fp32(COS, t_row, ok, j * DQ, layout, DQ),
                              _half_table_fp32(COS, t_row, ok, (j + 2) * DQ, layout, DQ),
                              _half_table_fp32(SIN, t_row, ok, j * DQ, layout, DQ),
                              _half_table_fp32(SIN, t_row, ok, (j + 2) * DQ, layout, DQ)),)
        else:
            if CFG.ROPE == "half":
                ia = j * DQ + i
                ib = ia + 2 * DQ
            else:
                ia = 2 * (j * DQ + i)
                ib = ia + 1
            parts = parts + ((gl.load(COS + t_row + ia[None, :], mask=ok, other=0.0),
                              gl.load(COS + t_row + ib[None, :], mask=ok, other=0.0),
                              gl.load(SIN + t_row + ia[None, :], mask=ok, other=0.0),
                              gl.load(SIN + t_row + ib[None, :], mask=ok, other=0.0)),)
    return parts


@gluon.jit
def _hadamard_issue(ops, had_smem, CFG: gl.constexpr):
    """Issue sum_c A chunk c · HADK rows chunk c: 4 chained async wgmma (k16 steps in kernel.py's
    order), fp32; _qk_retire waits and applies HAD_SCALE."""
    D: gl.constexpr = CFG.D
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                         instr_shape=[16, D, 16])
    acc = gl.zeros([128, D], gl.float32, layout=acc_layout)
    acc = warpgroup_mma(ops[0], had_smem.index(0), acc, use_acc=False, is_async=True)
    acc = warpgroup_mma(ops[1], had_smem.index(1), acc, is_async=True)
    acc = warpgroup_mma(ops[2], had_smem.index(2), acc, is_async=True)
    return warpgroup_mma(ops[3], had_smem.index(3), acc, is_async=True)


@gluon.jit
def _ring_half(ring, i, layout: gl.constexpr, CFG: gl.constexpr):
    """Ring chunk i [128, DQ] as fp32 in `layout` (exact). ROPE_WORDS: read as int32 pair words
    and widened by a shift and a mask a word (_v_chunk, as V and "interleaved" read theirs): one
    instruction a value where the generic bf16 widening takes two for every odd channel (PRMT,
    SHF): 32 fewer a warp a Q / K tile at D 128; else loaded in the input dtype and widened."""
    DQ: gl.constexpr = CFG.DQ
    if CFG.ROPE_WORDS:
        w_layout: gl.constexpr = gl.NVMMASharedLayout(ring.layout.swizzle_byte_width, 32)
        words = ring._reinterpret(gl.int32, [CFG.STAGES * 4, 128, DQ // 2], w_layout)
        wl: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (DQ // 8), DQ // 8], [8, 1], [1, 0])
        return gl.convert_layout(_v_chunk(words.index(i).load(wl), ring.dtype), layout)
    else:
        return ring.index(i).reshape([128, DQ]).load(layout).to(gl.float32)


@gluon.jit
def _qk_rope(ring, ring32, a_stage, ready, empty, cnt, tabs, dtype: gl.constexpr,
             STORE: gl.constexpr, RELEASE: gl.constexpr, CFG: gl.constexpr):
    """Tile cnt, RoPE: wait for its ring slot, RoPE in registers: per pair chunk j, the rotated
    members [a_j, b_j] as one [2, 128, DQ] tensor in the input dtype, returned (_store_a writes
    them later) or (STORE) stored into A buffer cnt % 2 as soon as made (not fenced: the caller
    fences), which keeps fewer registers live. RELEASE (GluonPrologue.ROPE_RELEASE): the slot is
    released once the last chunk is loaded, after a CTA barrier (every warp's loads done)."""
    DQ: gl.constexpr = CFG.DQ
    # 8 values (16 bytes of input, 32 of words) a thread along a chunk row; 8 warps down the rows
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (DQ // 8), DQ // 8], [8, 1], [1, 0])
    slot = cnt % CFG.STAGES
    mbarrier.wait(ready.index(slot), (cnt // CFG.STAGES) & 1)
    parts = ()
    for j in gl.static_range(2):
        if CFG.ROPE == "half":
            xa = _ring_half(ring, slot * 4 + j, layout, CFG)
            xb = _ring_half(ring, slot * 4 + j + 2, layout, CFG)
        else:
            w = ring32.index(slot * 2 + j).reshape([128, DQ]).load(layout)
            xa, xb = _split_words(w, dtype)
        if RELEASE:
            if j == 1:
                gl.thread_barrier()            # every warp has read the slot
                mbarrier.arrive(empty.index(slot), count=1)
        ca, cb, sa, sb = tabs[j]
        a, b = _rope_pair(xa, xb, ca, cb, sa, sb, dtype)
        ab = gl.permute(gl.join(a, b), (2, 0, 1))
        if STORE:
            a_stage[j].index(cnt % 2).store(ab)
        parts = parts + (ab,)
    return parts


@gluon.jit
def _store_a(a_stage, cnt, parts):
    """Tile cnt's RoPE output into A buffer cnt % 2 (not fenced: the caller fences)."""
    a_stage[0].index(cnt % 2).store(parts[0])
    a_stage[1].index(cnt % 2).store(parts[1])


@gluon.jit
def _qk_issue(ring, a_stage, had_smem, cnt, CFG: gl.constexpr):
    """Issue tile cnt's rotation: from A buffer cnt % 2 (RoPE) or straight from its ring slot."""
    DQ: gl.constexpr = CFG.DQ
    if CFG.ROPE != "":
        # the A buffers as 8 chunks [128, DQ] in the wgmma operand's (rank-2) layout
        lo, hi = a_stage
        a_layout: gl.constexpr = gl.NVMMASharedLayout(lo.layout.swizzle_byte_width,
                                                      lo.layout.element_bitwidth)
        lo = lo._reinterpret(lo.dtype, [4, 128, DQ], a_layout)
        hi = hi._reinterpret(hi.dtype, [4, 128, DQ], a_layout)
        buf = (cnt % 2) * 2     # contracted a_0, a_1, b_0, b_1 (kernel.py's order)
        return _hadamard_issue((lo.index(buf), hi.index(buf), lo.index(buf + 1),
                                hi.index(buf + 1)), had_smem, CFG)
    else:
        slot = cnt % CFG.STAGES
        return _hadamard_issue((ring.index(slot * 4).reshape([128, DQ]),
                                ring.index(slot * 4 + 1).reshape([128, DQ]),
                                ring.index(slot * 4 + 2).reshape([128, DQ]),
                                ring.index(slot * 4 + 3).reshape([128, DQ])), had_smem, CFG)


@gluon.jit
def _qk_retire(acc, CFG: gl.constexpr, SCALE: gl.constexpr = True):
    """Wait for this warpgroup's part of a tile's rotation (in flight in `acc`). No barrier: the
    other warpgroup's wgmma (and so the A buffer or ring slot both read) is known retired only
    after _qk_finish's barrier, which every warp reaches after its own wait. SCALE: times
    HAD_SCALE (not for smoothed K tiles: _smooth fuses it)."""
    acc = warpgroup_mma_wait(0, deps=[acc])
    if SCALE:
        return acc * CFG.HAD_SCALE
    else:
        return acc


@gluon.jit
def _warp_amax(m, amax_smem):
    """The first half of a tile's amax: `m` [128, C] (|x|) in a layout whose warp w holds rows
    [16w, 16w + 16) (the wgmma accumulator's and the V tile's); each warp's max goes to
    amax_smem[w]: one reduction over the warp's rows and columns (in the thread, then 5
    shuffles; by rows then columns it took 7). The caller's CTA barrier publishes them;
    _cta_amax reads them back (max is exact: the order does not matter)."""
    C: gl.constexpr = m.shape[1]
    amax_smem.store(gl.max(gl.reshape(m, [WARPS, 128 // WARPS * C]), axis=1))


@gluon.jit
def _cta_amax(amax_smem):
    """The 8 warps' partials (after a barrier), every thread reading all of them."""
    layout: gl.constexpr = gl.BlockedLayout([WARPS], [32], [WARPS], [0])
    return gl.max(amax_smem.load(layout), axis=0)


@gluon.jit
def _smooth(acc, smooth, z, h, g, D: gl.constexpr, HAD_SCALE: gl.constexpr):
    """smooth_k (kernel._qk_tile): K tile `acc` (the rotation, HAD_SCALE not applied) times
    HAD_SCALE minus its head's mean, as the Triton kernel compiles it: LLVM contracts its
    `acc * HAD_SCALE` and `- mean` into fma(acc, HAD_SCALE, -mean) (fma.rn.f32 in its PTX, one
    rounding; at D 64 the scale is 1/8 and the product exact either way), so here the same FMA,
    explicit. Rows past the length are 0 (they count in the amax), as the Triton kernel's
    `where`, in the ragged last row block only (a branch a tile, not a select a value).
    `smooth` = (K_MEAN, H, L)."""
    K_MEAN, H, L = smooth
    layout: gl.constexpr = acc.type.layout
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    mean = gl.load(K_MEAN + (z * H + h) * D + cols)
    # -mean as mean * -1 (the sign flip, -0 for +0, as the Triton kernel's contracted fneg;
    # Gluon's unary minus is 0 - mean, +0 for +0)
    m2, acc = gl.broadcast(gl.expand_dims(mean * -1.0, 0), acc)
    y = gl.fma(acc, gl.full(acc.shape, HAD_SCALE, gl.float32, layout), m2)
    if g * 128 + 128 > L:
        rows = g * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, layout))
        ok, y = gl.broadcast(gl.expand_dims(rows < L, 1), y)
        y = gl.where(ok, y, 0.0)
    return y


@gluon.jit
def _qk_finish(y, stage, empty, slot, a_stage, a_cnt, a_parts, RELEASE: gl.constexpr,
               STORE_A: gl.constexpr, CFG: gl.constexpr, smooth=None, at=None,
               SMOOTH: gl.constexpr = False):
    """A rotated tile y (fp32, HAD_SCALE applied): amax, scale, quantized into the staging buffer
    (returns the scale; _qk_publish stores the tile: fence, the second barrier, TMA store). The
    first barrier publishes the warps' amax partials, orders the staging stores after the
    previous tile's TMA store has read o_stage (thread 0's store_wait), and stands for every
    warp's wgmma wait and earlier shared-memory accesses: after it ring slot `slot` is released
    (RELEASE: the slot the wgmma read without RoPE, the one the next tile's RoPE read with it),
    and an A buffer the caller's RoPE filled and fenced may be read by the next wgmma.

    STORE_A (CFG.DEFER_A): the next tile's RoPE output (`a_parts`, tile `a_cnt`) is stored into
    its A buffer right after the first barrier, which orders it after the wgmma issued last (that
    one read the other buffer, but Triton's hazard pass cannot tell: stored before, it costs a
    barrier of its own); _qk_publish's fence and barrier then publish it to the next wgmma."""
    D: gl.constexpr = CFG.D
    o_stage, amax_smem = stage
    if SMOOTH:
        y = _smooth(y, smooth, at[0], at[1], at[2], D, CFG.HAD_SCALE)
    _warp_amax(gl.abs(y), amax_smem)
    tma.store_wait(0)
    gl.thread_barrier()
    if RELEASE:
        # (Triton 3.6's hazard pass puts a CTA barrier after an mbarrier arrive, before the
        # next shared-memory access: one more a tile, wherever the arrive goes)
        mbarrier.arrive(empty.index(slot), count=1)
    if STORE_A:
        _store_a(a_stage, a_cnt, a_parts)
    scale = _qk_scale_of(_cta_amax(amax_smem), CFG.QK_INT8)
    o_stage.reshape([128, D]).store(_to_qk(y, scale, gl.div_rn(1.0, scale), CFG.QK_INT8))
    return scale


@gluon.jit
def _qk_publish(scale, o_stage, out_desc, SCALE, z, h, g, H, G):
    """The staged tile (_qk_finish) out: fence, the second barrier, TMA store, and its scale."""
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(out_desc, [z, h, g * 128, 0], o_stage)
    gl.store(SCALE + (z * H + h) * G + g, scale)


@gluon.jit
def _v_chunk(w, dtype: gl.constexpr):
    """A V chunk read as int32 pair words [128, DQ / 2] -> fp32 [128, DQ] (exact: bf16 by a shift
    and a mask a word, not the generic widening's three instructions a pair)."""
    lo, hi = _split_words(w, dtype)
    return gl.reshape(gl.join(lo, hi), [128, 2 * w.shape[1]])


@gluon.jit
def _v_tile(ring, vt_stage, amax_smem, vt_desc, V_SCALE, V_SCALE_MAX, ready, empty, cnt, z, h, g,
            H, G, CFG: gl.constexpr):
    """One V tile: amax, power-of-two scale, e4m3, stored transposed (VT8 rows are channels). Two
    CTA barriers, as _qk_finish: the first publishes the amax partials, orders the staging stores
    after the previous TMA store's read, and precedes the ring slot's release."""
    DQ: gl.constexpr = CFG.DQ
    # 4 pair words (8 channels, 16 bytes) by VR tokens a thread: the transposed store writes VR
    # tokens at once (VR = 2 where a chunk has 16 values a thread, D 128)
    VR: gl.constexpr = 2 if DQ >= 32 else 1
    layout: gl.constexpr = gl.BlockedLayout([VR, 4], [32 // (DQ // 8), DQ // 8], [8, 1], [1, 0])
    slot = cnt % CFG.STAGES
    mbarrier.wait(ready.index(slot), (cnt // CFG.STAGES) & 1)
    w_layout: gl.constexpr = gl.NVMMASharedLayout(ring.layout.swizzle_byte_width, 32)
    words = ring._reinterpret(gl.int32, [CFG.STAGES * 4, 128, DQ // 2], w_layout)
    dtype: gl.constexpr = ring.dtype
    y0 = _v_chunk(words.index(slot * 4).load(layout), dtype)
    y1 = _v_chunk(words.index(slot * 4 + 1).load(layout), dtype)
    y2 = _v_chunk(words.index(slot * 4 + 2).load(layout), dtype)
    y3 = _v_chunk(words.index(slot * 4 + 3).load(layout), dtype)
    # elementwise first, one reduction (max is exact: the order does not matter)
    m = gl.maximum(gl.maximum(gl.abs(y0), gl.abs(y1)), gl.maximum(gl.abs(y2), gl.abs(y3)))
    _warp_amax(m, amax_smem)
    tma.store_wait(0)
    gl.thread_barrier()
    mbarrier.arrive(empty.index(slot), count=1)
    amax = _cta_amax(amax_smem)
    scale = _pow2_scale_of(amax)
    inv = _pow2_reciprocal(scale)
    # One store of the 4 transposed chunks (joins and permutes relabel registers; 4 stores to one
    # allocation cost 3 hazard barriers, Triton's pass not telling the chunks apart)
    v01 = gl.join((y0 * inv).to(gl.float8e4nv), (y1 * inv).to(gl.float8e4nv))
    v23 = gl.join((y2 * inv).to(gl.float8e4nv), (y3 * inv).to(gl.float8e4nv))
    vt = gl.reshape(gl.permute(gl.join(v01, v23), (3, 2, 1, 0)), [4, DQ, 128])
    vt_layout: gl.constexpr = gl.NVMMASharedLayout(vt_stage.layout.swizzle_byte_width, 8, rank=3)
    vt_stage._reinterpret(gl.float8e4nv, [4, DQ, 128], vt_layout).store(vt)
    fence_async_shared()
    gl.thread_barrier()
    for j in gl.static_range(4):
        tma.async_copy_shared_to_global(vt_desc, [z, h, j * DQ, g * 128], vt_stage.index(j))
    zh = z * H + h
    gl.store(V_SCALE + zh * G + g, scale)
    # An all-zero group's scale (1) says nothing about V's range (kernel._v_group).
    gl.atomic_max(V_SCALE_MAX + zh, scale, mask=amax > 0, sem="relaxed")
    return cnt + 1


@gluon.jit
def _v_store(cnt, z, h, g, args, CFG: gl.constexpr):
    """The consumer's V tile (_v_walk's body)."""
    ring, vt_stage, amax_smem, vt_desc, V_SCALE, V_SCALE_MAX, ready, empty, H, G = args
    return _v_tile(ring, vt_stage, amax_smem, vt_desc, V_SCALE, V_SCALE_MAX, ready, empty, cnt, z,
                   h, g, H, G, CFG)


@gluon.jit
def _qk_next(ring, ring32, a_stage, had_smem, stage, out_desc, SCALE, ready, empty, cnt, acc,
             tabs, prev, H, G, dtype: gl.constexpr, CFG: gl.constexpr, smooth,
             SMOOTH: gl.constexpr):
    """RoPE, pipelined: tile cnt + 1's RoPE under tile cnt's wgmma (`acc`, in flight), then tile
    cnt (at `prev` = (z, h, g)) quantized and stored, and tile cnt + 1's wgmma issued: after
    tile cnt's TMA store (CFG.DEFER_A), or before its staging barrier, which then runs under it."""
    o_stage = stage[0]
    z, h, g = prev
    parts = _qk_rope(ring, ring32, a_stage, ready, empty, cnt + 1, tabs, dtype, not CFG.DEFER_A,
                     CFG.ROPE_RELEASE, CFG)
    if not CFG.DEFER_A:
        fence_async_shared()                   # published by _qk_finish's first barrier
    y = _qk_retire(acc, CFG, not SMOOTH)
    scale = _qk_finish(y, stage, empty, (cnt + 1) % CFG.STAGES, a_stage, cnt + 1, parts,
                       not CFG.ROPE_RELEASE, CFG.DEFER_A, CFG, smooth, prev, SMOOTH)
    if CFG.DEFER_A:
        _qk_publish(scale, o_stage, out_desc, SCALE, z, h, g, H, G)
        acc = _qk_issue(ring, a_stage, had_smem, cnt + 1, CFG)
    else:
        acc = _qk_issue(ring, a_stage, had_smem, cnt + 1, CFG)
        _qk_publish(scale, o_stage, out_desc, SCALE, z, h, g, H, G)
    return cnt + 1, acc


@gluon.jit
def _qk_units(ring, ring32, a_stage, had_smem, stage, out_desc, SCALE, ready, empty, cnt,
              COS, SIN, POS, stride_pz, stride_tz, stride_tp, P, Z, H, L, U, HC, G, u0,
              dtype: gl.constexpr, HAS_POS: gl.constexpr, CFG: gl.constexpr, K_MEAN,
              SMOOTH: gl.constexpr, tabs_first=0, PRELOADED: gl.constexpr = False,
              next_rows=0, HANDOFF: gl.constexpr = False, SKIP_LAST: gl.constexpr = False):
    """This program's Q (or K) units (u0, u0 + n_programs, ...; HC divides H, so every unit has
    HC heads): the table rows of a unit's row block once, then its heads. One flat loop over the
    program's tiles (tile t: unit t // HC, head t % HC of it).

    With RoPE, software-pipelined by one tile: tile t's wgmma runs under tile t + 1's RoPE (two A
    buffers), then tile t is quantized and stored, then tile t + 1's wgmma is issued (one
    accumulator in flight while the tables are held: registers). The first tile is peeled, so
    the accumulator in flight across the back edge is only ever written by wgmma.

    Without RoPE, tile t + 1's wgmma is issued after tile t's quantization, before its staging
    fence, barrier and TMA store, which run under it (the first tile peeled: only wgmma writes
    the accumulator in flight). Issuing it before tile t's quantization (97af8ed), with y live,
    made ptxas serialize the 4 wgmma of every tile (a wait after each, no overlap left), and so did
    97af8ed's nested unit / head loops with a zero-initialised accumulator and `if has_prev`
    branches with RoPE (ptxas C7515: "non wgmma instructions defining accumulator registers").

    HANDOFF (the Q phase under CFG.HANDOFF): the table load after the phase's last unit reads the
    K phase's first unit's rows (`next_rows`: its z, row block, positions, their stride, length)
    and returns them with cnt, for the K phase to take as PRELOADED. SKIP_LAST (CFG.SKIP_LAST_Q /
    SKIP_LAST_K): no table load after the phase's last unit (a branch)."""
    n_prog = gl.num_programs(0)
    n_tiles = (U - u0 + n_prog - 1) // n_prog * HC
    smooth = (K_MEAN, H, L)
    if PRELOADED:
        tabs = tabs_first
    u = u0
    z, g, h, h1 = _unit(u, Z, H, HC)
    if CFG.ROPE == "":
        if n_tiles > 0:
            mbarrier.wait(ready.index(cnt % CFG.STAGES), (cnt // CFG.STAGES) & 1)
            acc = _qk_issue(ring, a_stage, had_smem, cnt, CFG)
            for t in range(1, n_tiles):
                y = _qk_retire(acc, CFG, not SMOOTH)
                scale = _qk_finish(y, stage, empty, cnt % CFG.STAGES, a_stage, 0, 0, True, False,
                                   CFG, smooth, (z, h, g), SMOOTH)
                mbarrier.wait(ready.index((cnt + 1) % CFG.STAGES), ((cnt + 1) // CFG.STAGES) & 1)
                acc = _qk_issue(ring, a_stage, had_smem, cnt + 1, CFG)
                _qk_publish(scale, stage[0], out_desc, SCALE, z, h, g, H, G)
                cnt += 1
                h += 1
                if h == h1:   # the next unit (no division a tile)
                    u += n_prog
                    z, g, h, h1 = _unit(u, Z, H, HC)
            y = _qk_retire(acc, CFG, not SMOOTH)
            scale = _qk_finish(y, stage, empty, cnt % CFG.STAGES, a_stage, 0, 0, True, False, CFG,
                               smooth, (z, h, g), SMOOTH)
            _qk_publish(scale, stage[0], out_desc, SCALE, z, h, g, H, G)
            cnt += 1
    elif n_tiles > 0:
        # The first tile peeled; the tables are loop-invariant in each unit's head loop and the
        # next unit's are loaded after it, under the last tile's wgmma (past the last unit the
        # rows are >= L: every load masked off; HANDOFF: the K phase's first rows instead).
        # Carried through a branch of a flat tile loop, they were repacked every tile (+190
        # instructions at D 128); a peeled copy of the head loop spilled at D 128. PRELOADED: the
        # first unit's tables are the caller's (the Q phase's, loaded before the Hadamard matrix:
        # two L2 / DRAM round trips at the start overlap; the K phase's under HANDOFF, loaded by
        # the Q phase).
        if not PRELOADED:
            tabs = _table_parts(COS, SIN, POS, stride_pz, stride_tz, stride_tp, P, z, g * 128, L,
                                HAS_POS, CFG)
        _qk_rope(ring, ring32, a_stage, ready, empty, cnt, tabs, dtype, True, False, CFG)
        fence_async_shared()
        gl.thread_barrier()                    # every warp's A rows written, the slot read
        mbarrier.arrive(empty.index(cnt % CFG.STAGES), count=1)
        acc = _qk_issue(ring, a_stage, had_smem, cnt, CFG)
        prev = (z, h, g)
        h += 1
        for uu in range(u0, U, n_prog):
            for hh in range(h, h1):
                cnt, acc = _qk_next(ring, ring32, a_stage, had_smem, stage, out_desc, SCALE,
                                    ready, empty, cnt, acc, tabs, prev, H, G, dtype, CFG, smooth,
                                    SMOOTH)
                prev = (z, hh, g)
            z, g, h, h1 = _unit(uu + n_prog, Z, H, HC)
            if HANDOFF:
                # past the phase's last unit: the K phase's first unit's rows, not masked-off
                # ones (only the scalars are chosen; the load runs either way: skipping it by a
                # branch here made ptxas reload the memory descriptor in the tile loops:
                # GluonPrologue.SKIP_LAST_Q)
                tz, tg, tpos, tpz, tl = z, g, POS, gl.to_tensor(stride_pz), L
                if uu + n_prog >= U:
                    tz, tg, tpos, tpz, tl = next_rows
                tabs = _table_parts(COS, SIN, tpos, tpz, stride_tz, stride_tp, P, tz, tg * 128,
                                    tl, HAS_POS, CFG)
            elif SKIP_LAST:   # past the last unit the rows are masked off and read by nothing
                if uu + n_prog < U:
                    tabs = _table_parts(COS, SIN, POS, stride_pz, stride_tz, stride_tp, P, z,
                                        g * 128, L, HAS_POS, CFG)
            else:
                tabs = _table_parts(COS, SIN, POS, stride_pz, stride_tz, stride_tp, P, z,
                                    g * 128, L, HAS_POS, CFG)
        y = _qk_retire(acc, CFG, not SMOOTH)
        scale = _qk_finish(y, stage, empty, 0, a_stage, 0, 0, False, False, CFG, smooth, prev,
                           SMOOTH)
        _qk_publish(scale, stage[0], out_desc, SCALE, prev[0], prev[1], prev[2], H, G)
        cnt += 1
    if HANDOFF:   # without Q tiles, tabs_first: _consumer loaded the K rows for it
        ret = (cnt, tabs)
    else:
        ret = cnt
    return ret


@gluon.jit
def _consumer(descs, smem, bars, sizes, outs, tables, CFG: gl.constexpr):
    q_desc, k_desc, v_desc, q8_desc, k8_desc, vt_desc = descs
    ring, ring32, a_stage, had_smem, o_stage, vt_stage, amax_smem = smem
    ready, empty = bars
    Z, HQ, HKV, M, N, P, UQ, UK, HCQ, HCK = sizes
    Q_SCALE, K_SCALE, V_SCALE, V_SCALE_MAX, HADK, QG, KG, K_MEAN = outs
    COS, SIN, QPOS, KPOS, stride_tz, stride_tp, stride_qpz, stride_kpz = tables
    dtype: gl.constexpr = v_desc.dtype
    pid = gl.program_id(0)
    n_prog = gl.num_programs(0)
    tabs = 0
    # GluonPrologue.HANDOFF, where Q's and K's positions are of one dtype (one pointer to select)
    HANDOFF: gl.constexpr = CFG.HANDOFF and QPOS.dtype == KPOS.dtype
    if CFG.ROPE != "":   # the first Q unit's table rows, in flight while HADK loads
        z, g, h0, h1 = _unit(pid, Z, HQ, HCQ)
        if HANDOFF:
            # the K phase's first unit (the launch's round-robin: program pid's first K unit),
            # whose rows the Q phase loads after its last unit (_qk_units, HANDOFF); a program
            # without Q units (pid >= UQ) loads them here instead
            kz, kg, kh0, kh1 = _unit(_first_unit(UQ, n_prog), Z, HKV, HCK)
            # (strides as tensors: a stride of 1 is a constexpr, which an if cannot merge)
            next_rows = (kz, kg, KPOS, gl.to_tensor(stride_kpz), N)
            t_pos, t_pz, t_len = QPOS, gl.to_tensor(stride_qpz), M
            if pid >= UQ:
                z, g, t_pos, t_pz, t_len = next_rows
            tabs = _table_parts(COS, SIN, t_pos, t_pz, stride_tz, stride_tp, P, z, g * 128,
                                t_len, CFG.Q_POS, CFG)
        else:
            tabs = _table_parts(COS, SIN, QPOS, stride_qpz, stride_tz, stride_tp, P, z, g * 128,
                                M, CFG.Q_POS, CFG)
    _load_had(HADK, had_smem, CFG)
    fence_async_shared()
    gl.thread_barrier()
    cnt = 0
    stage = (o_stage, amax_smem)
    if HANDOFF:
        cnt, tabs = _qk_units(ring, ring32, a_stage, had_smem, stage, q8_desc, Q_SCALE, ready,
                              empty, cnt, COS, SIN, QPOS, stride_qpz, stride_tz, stride_tp, P, Z,
                              HQ, M, UQ, HCQ, QG, pid, dtype, CFG.Q_POS, CFG, K_MEAN, False, tabs,
                              True, next_rows, True)
    else:
        cnt = _qk_units(ring, ring32, a_stage, had_smem, stage, q8_desc, Q_SCALE, ready, empty,
                        cnt, COS, SIN, QPOS, stride_qpz, stride_tz, stride_tp, P, Z, HQ, M, UQ,
                        HCQ, QG, pid, dtype, CFG.Q_POS, CFG, K_MEAN, False, tabs, CFG.ROPE != "",
                        0, False, CFG.SKIP_LAST_Q)
    if CFG.PDL:
        # smooth_k's K_MEAN: this launch started under the pre-passes (programmatic dependent
        # launch); the Q tiles did not need them, the K tiles do (griddepcontrol.wait: the
        # k_mean grid done, which waited for k_sums, and their stores visible)
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
    cnt = _qk_units(ring, ring32, a_stage, had_smem, stage, k8_desc, K_SCALE, ready, empty, cnt,
                    COS, SIN, KPOS, stride_kpz, stride_tz, stride_tp, P, Z, HKV, N, UK, HCK, KG,
                    _first_unit(UQ, n_prog), dtype, CFG.K_POS, CFG, K_MEAN, CFG.SMOOTH, tabs,
                    HANDOFF, 0, False, CFG.SKIP_LAST_K)
    _v_walk(cnt, _v_store, (ring, vt_stage, amax_smem, vt_desc, V_SCALE, V_SCALE_MAX, ready, empty,
                           HKV, KG), Z, HKV, UQ, UK, HCK, CFG)
    tma.store_wait(0)   # the last stores must finish reading shared memory before the CTA exits


_RUNTIME_SIZES = ["M", "N", "P", "Z", "UQ", "UK", "HCQ", "HCK", "QG", "KG"]


@gluon.jit(do_not_specialize=_RUNTIME_SIZES)
def prologue_sm90_kernel(
    q_desc, k_desc, v_desc,          # inputs: [Z, H, L, D] boxes [1, 1, T, DQ] (bf16 / fp16; Q and
                                     # K as int32 words under "interleaved")
    q8_desc, k8_desc, vt_desc,       # outputs: boxes [1, 1, T, D] (Q8, K8), [1, 1, DQ, T] (VT8)
    Q_SCALE, K_SCALE, V_SCALE, V_SCALE_MAX, HADK, K_MEAN,
    COS, SIN, QPOS, KPOS, stride_tz, stride_tp, stride_qpz, stride_kpz,
    Z, HQ, HKV, M, N, P, UQ, UK, HCQ, HCK, QG, KG,
    CFG: gl.constexpr,
):
    """Persistent: program p takes Q units p, p + n_programs, ..., then K units, then V units."""
    D: gl.constexpr = CFG.D
    DQ: gl.constexpr = CFG.DQ
    dtype: gl.constexpr = v_desc.dtype
    ring = gl.allocate_shared_memory(dtype, [CFG.STAGES * 4] + v_desc.block_type.shape,
                                     v_desc.layout)
    if CFG.ROPE == "interleaved":
        ring32 = ring._reinterpret(gl.int32, [CFG.STAGES * 2] + q_desc.block_type.shape,
                                   q_desc.layout)
    else:
        ring32 = ring
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, DQ], dtype)
    if CFG.ROPE != "":   # two A buffers: tile t's wgmma reads one while tile t + 1's RoPE fills the other
        # Two allocations, pair chunk j = 0 / 1, each [buffer, a | b, T, DQ]: every chunk a
        # [128, DQ] wgmma operand (_qk_issue reads them through a rank-2 view of the same bytes:
        # one 64-byte (D 64: 32-byte) swizzled tile after another, either way). One store per
        # allocation a tile (_qk_rope): Triton's shared-memory hazard pass cannot tell dynamic
        # chunk indices apart, so each store into one allocation after another costs a CTA
        # barrier (4 stores into one allocation: 4 barriers a tile; now 1, before the first).
        a_layout3: gl.constexpr = gl.NVMMASharedLayout(a_layout.swizzle_byte_width,
                                                       a_layout.element_bitwidth, rank=3)
        a_stage = (gl.allocate_shared_memory(dtype, [2, 2, 128, DQ], a_layout3),
                   gl.allocate_shared_memory(dtype, [2, 2, 128, DQ], a_layout3))
    else:
        unused = gl.allocate_shared_memory(dtype, [1, 128, DQ], a_layout)
        a_stage = (unused, unused)
    had_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([DQ, D], dtype)
    had_smem = gl.allocate_shared_memory(dtype, [4, DQ, D], had_layout)
    o_stage = gl.allocate_shared_memory(q8_desc.dtype, q8_desc.block_type.shape, q8_desc.layout)
    # Vᵀ's staging is Q8 / K8's (same bytes; V tiles follow every Q / K tile's store_wait)
    vt_stage = o_stage._reinterpret(vt_desc.dtype, [4] + vt_desc.block_type.shape, vt_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [CFG.STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [CFG.STAGES, 1], mbarrier.MBarrierLayout())
    STAGES: gl.constexpr = CFG.STAGES
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)

    descs = (q_desc, k_desc, v_desc, q8_desc, k8_desc, vt_desc)
    # the warps' amax partials (_warp_amax, _cta_amax)
    amax_smem = gl.allocate_shared_memory(gl.float32, [WARPS],
                                          gl.SwizzledSharedLayout(1, 1, 1, [0]))
    smem = (ring, ring32, a_stage, had_smem, o_stage, vt_stage, amax_smem)
    bars = (ready, empty)
    sizes = (Z, HQ, HKV, M, N, P, UQ, UK, HCQ, HCK)
    outs = (Q_SCALE, K_SCALE, V_SCALE, V_SCALE_MAX, HADK, QG, KG, K_MEAN)
    tables = (COS, SIN, QPOS, KPOS, stride_tz, stride_tp, stride_qpz, stride_kpz)
    gl.warp_specialize([
        (_consumer, (descs, smem, bars, sizes, outs, tables, CFG)),
        (_producer, (descs, smem, bars, sizes, outs, tables, CFG)),
    ], [1], [CFG.PRODUCER_REGS])


# ---- host side -------------------------------------------------------------------------------
SMEM_BUDGET = 227 * 1024
DEFAULT_PROGRAMS = 132     # SMs of an H100 / H200 SXM: the grid when compiling without a device


# Two programs an SM (D 64 without RoPE): a register cap of 65536 / (2 · 384 threads), rounded down
# to setmaxnreg's multiple of 8; the consumer warps then get 104 (Triton's split: (80·384 - 24·128)
# / 256), enough for D 64 without RoPE (no spills), not with RoPE (125 / 259 spill instructions).
TWO_PROGRAM_REGS = 80


def default_programs_per_sm(D: int, rope: bool) -> int:
    """Programs an SM: 2 at D 64 without RoPE (two independent tile chains an SM: one program's
    chain of waits and barriers is latency-bound, docs/design/fp8_prologue.md, "Where the time
    goes"), else 1 (the tables or the D 128 accumulators need the register file)."""
    return 2 if D <= 64 and not rope else 1


def program_regs(D: int, rope: bool, per_sm: int):
    """The register cap (maxnreg) that lets `per_sm` programs share an SM, or None (no cap: one
    program; other requests run their extra programs after the resident ones)."""
    return TWO_PROGRAM_REGS if per_sm == 2 and D <= 64 and not rope else None


def default_stages(D: int, rope: bool, per_sm: int = 1) -> int:
    """Ring depth, for about 100 KB of input in flight an SM (one program an SM: 8 consumer warps
    at 240 registers and the producer's warpgroup at 24 take the register file): D 128 with RoPE 2
    stages (64 KB in flight, 176 KB of shared memory with two A buffers; 3 fit and were 1.5-2%
    slower on the H200, fp8-prologue-bw-nvidia-h200-2026-11-29-1022; 4 do not fit), without
    RoPE 4 (128 KB in flight, 176 KB); D 64 7 stages (112 KB in flight, 160 / 128 KB); D 64 at two
    programs an SM 4 each (128 KB in flight an SM, 80 KB of shared memory a program)."""
    if D > 64:
        return 2 if rope else 4
    return 4 if per_sm >= 2 else 7


def serves(q, k, v, recipe, rope) -> bool:
    """The hot case: D = Dv in {64, 128}, bf16 / fp16, Hadamard on, blocks of 128 rows, RoPE none
    or over all D channels with 2-byte tables, TMA-aligned inputs. smooth_k too (since
    2026-11-29): kernel.k_sums_kernel and kernel.k_mean_kernel run first, the K tiles subtract
    K_MEAN (_smooth)."""
    import torch

    from ..tma import tma_aligned

    D, Dv = q.shape[-1], v.shape[-1]
    if D != Dv or D not in (64, 128) or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if not recipe.hadamard or recipe.block_m != T_ROWS or recipe.block_n != T_ROWS:
        return False
    if rope is not None:
        if rope.cos.shape[-1] != D or rope.cos.dtype not in (torch.bfloat16, torch.float16):
            return False
        if rope.sin.dtype != rope.cos.dtype:
            return False
    return all(tma_aligned(t) for t in (q, k, v))


def _desc(t, block_shape):
    """A TMA descriptor of `t` with the default NVMMA (swizzled) shared layout of the box."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.int32: gl.int32,
             torch.int8: gl.int8, torch.float8_e4m3fn: gl.float8e4nv}[t.dtype]
    layout = gl.NVMMASharedLayout.get_default_for(list(block_shape), dtype)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block_shape), layout)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _most_tiles(q_units: int, hcq: int, k_units: int, hck: int, n_programs: int) -> int:
    """The most tiles a program takes in the launch's round-robin over its units (Q units of hcq
    tiles, then K and V units of hck; unit i goes to program i mod n_programs, _first_unit)."""
    def count(units, before, p):          # units of a phase that program p takes
        return units // n_programs + ((p - before) % n_programs < units % n_programs)
    return max(hcq * count(q_units, 0, p) + hck * (count(k_units, q_units, p)
                                                   + count(k_units, q_units + k_units, p))
               for p in range(n_programs))


@functools.lru_cache(maxsize=256)
def unit_heads(q_blocks: int, hq: int, k_blocks: int, hkv: int, n_programs: int,
               rope: bool) -> tuple[int, int]:
    """(HCQ, HCK): heads a Q / K (and V) unit walks. A divisor of the heads (every unit of a kind
    the same size), with the fewest tiles on the busiest program (the launch is as slow as it),
    within 1 / 32 of the best; with RoPE, among those, the fewest units that load table rows (a
    unit's first tile waits on its table loads from L2), without RoPE the best balance in the
    finest grain.

    The Q / K / V tiles of a launch are its units' heads; a program's time is about its tile count
    (one tile at a time, latency-bound: docs/design/fp8_prologue.md, "Where the time goes"). The
    earlier rule (runs of at most rows·H / (2·programs) heads, evened out: 6, 6, 4 at 16 heads)
    with a round-robin per phase gave 132 programs over 128 row blocks x 16 heads 54 tiles at most
    (18 Q + 18 K + 18 V: programs p and p + 132 share p mod 3, so the same programs took the 6-head
    runs in every phase) against 46.5 on average.

    Example::

        >>> unit_heads(128, 16, 128, 16, 132, True)     # B1 N16384 H16, RoPE: whole head sets
        (16, 16)
        >>> unit_heads(128, 16, 128, 16, 132, False)    # no tables to reuse: one head a unit
        (1, 1)
        >>> _most_tiles(128, 16, 128, 16, 132), _most_tiles(2048, 1, 2048, 1, 132)
        (48, 47)
    """
    plans = []
    for hcq in _divisors(hq):
        for hck in _divisors(hkv):
            qu, ku = q_blocks * (hq // hcq), k_blocks * (hkv // hck)
            plans.append((_most_tiles(qu, hcq, ku, hck, n_programs), qu + ku, hcq, hck))
    best = min(p[0] for p in plans)
    ok = [p for p in plans if p[0] <= best + best // 32]
    # without RoPE, ties to the most units (the finest grain: V tiles cost less than Q / K ones)
    most, _, hcq, hck = min(ok, key=(lambda p: (p[1], p[0])) if rope else (lambda p: (p[0], -p[1])))
    return hcq, hck


def grid_and_units(B: int, Hq: int, Hkv: int, qg: int, kg: int, n_programs: int,
                   rope: bool) -> tuple[int, int, int, int, int]:
    """(grid, HCQ, HCK, Q units, K units) of a launch: unit_heads' plan and the persistent grid."""
    hcq, hck = unit_heads(B * qg, Hq, B * kg, Hkv, n_programs, rope)
    uq, uk = B * qg * -(-Hq // hcq), B * kg * -(-Hkv // hck)
    return min(n_programs, uq + 2 * uk), hcq, hck, uq, uk


def interleaved_rows(had):
    """HAD's rows in the order "interleaved" RoPE hands the channels to the wgmma: the even channels,
    then the odd ones (kernel.py's contraction order for pairs).

    Example::

        >>> import torch
        >>> interleaved_rows(torch.arange(4.0).repeat_interleave(4).view(4, 4))[:, 0].tolist()
        [0.0, 2.0, 1.0, 3.0]
    """
    import torch

    D = had.shape[0]
    perm = torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)]).to(had.device)
    return had[perm].contiguous()


def _rows_on_words(cos, sin, stride_tz, stride_tp) -> bool:
    """Every row of the 2-byte cos / sin tables starts on a 4-byte boundary (even strides and
    offsets): they can be read as int32 words."""
    return (stride_tz % 2 == 0 and stride_tp % 2 == 0 and cos.data_ptr() % 4 == 0
            and sin.data_ptr() % 4 == 0)


def _rope_words(rope_words, rope_style, cos, sin, stride_tz, stride_tp) -> bool:
    """GluonPrologue.ROPE_WORDS: the tuning's choice (None: on), off for "interleaved" tables whose
    rows do not start on a 4-byte boundary (an odd stride or offset: no pair words to read)."""
    on = True if rope_words is None else bool(rope_words)
    if on and rope_style == "interleaved":
        on = _rows_on_words(cos, sin, stride_tz, stride_tp)
    return on


def _half_table_words(rope_style, cos, sin, stride_tz, stride_tp) -> bool:
    """GluonPrologue.HALF_TABLE_WORDS: "half" tables read as words and held as fp32, unless a row
    starts off 4 bytes (then the 2-byte values)."""
    return rope_style == "half" and _rows_on_words(cos, sin, stride_tz, stride_tp)


def launch(q, k, v, ops, had, cos, sin, qpos, kpos, stride_tz, stride_tp, stride_qpz, stride_kpz,
           P, rope_style: str, q_pos: bool, k_pos: bool, recipe, stages=None, n_programs=None,
           per_sm=None, words=None, rope_release=None, k_mean=None, rope_words=None, pdl=False):
    """(kernel, args, kwargs, grid) of prologue_sm90_kernel writing `ops` (host.prepare_prologue
    allocates them as for the Triton kernel). `had` is HAD [D, D] in the input dtype. "interleaved"
    RoPE reads Q and K as int32 pair words against HAD's rows in even-then-odd order: `words`, (Q's
    words, K's words, those rows), made by the caller (host.PrologueLayout keeps the rows, so that a
    recorded launch finds every tensor among its inputs), else made here."""
    import torch

    from .hadamard import hadamard_block

    B, Hq, M, D = q.shape
    _, Hkv, N, _ = v.shape
    DQ = D // 4
    per_sm = per_sm or default_programs_per_sm(D, bool(rope_style))
    stages = stages or default_stages(D, bool(rope_style), per_sm)
    if rope_style == "interleaved":
        q_words, k_words, hadk = words or (q.view(torch.int32), k.view(torch.int32), interleaved_rows(had))
        q_in = _desc(q_words, [1, 1, T_ROWS, DQ])
        k_in = _desc(k_words, [1, 1, T_ROWS, DQ])
    else:
        hadk = had.contiguous()
        q_in = _desc(q, [1, 1, T_ROWS, DQ])
        k_in = _desc(k, [1, 1, T_ROWS, DQ])
    v_in = _desc(v, [1, 1, T_ROWS, DQ])
    q8 = _desc(ops.q, [1, 1, T_ROWS, D])
    k8 = _desc(ops.k, [1, 1, T_ROWS, D])
    vt = _desc(ops.vt, [1, 1, DQ, T_ROWS])
    qg, kg = ops.q_scale.shape[-1], ops.k_scale.shape[-1]
    n_programs = n_programs or programs_of(q.device, per_sm)
    grid, hcq, hck, uq, uk = grid_and_units(B, Hq, Hkv, qg, kg, n_programs, bool(rope_style))
    assert Hq % hcq == 0 and Hkv % hck == 0, (Hq, hcq, Hkv, hck)   # _qk_units' tile count
    cfg = GluonPrologue(D=D, STAGES=stages, ROPE=rope_style, Q_POS=q_pos, K_POS=k_pos,
                        QK_INT8=recipe.qk == "int8", HAD_SCALE=hadamard_block(D) ** -0.5,
                        PRODUCER_REGS=40,
                        RELEASE_IN_ROPE=False if rope_release is None else bool(rope_release),
                        SMOOTH=bool(recipe.smooth_k),
                        ROPE_WORDS=_rope_words(rope_words, rope_style, cos, sin, stride_tz,
                                               stride_tp),
                        PDL=bool(pdl and recipe.smooth_k),
                        HALF_TABLE_WORDS=_half_table_words(rope_style, cos, sin, stride_tz,
                                                           stride_tp))
    if recipe.smooth_k:
        assert k_mean is not None, "smooth_k: the Gluon kernel reads K_MEAN (kernel.k_mean_kernel)"
    args = (q_in, k_in, v_in, q8, k8, vt, ops.q_scale, ops.k_scale, ops.v_scale, ops.v_scale_max,
            hadk, hadk if k_mean is None else k_mean,
            cos, sin, qpos, kpos, stride_tz, stride_tp, stride_qpz, stride_kpz,
            B, Hq, Hkv, M, N, max(P, 1), uq, uk, hcq, hck, qg, kg)
    kwargs = dict(CFG=cfg, num_warps=CONSUMER_WARPS)
    if cfg.PDL:
        kwargs["launch_pdl"] = True
    regs = program_regs(D, bool(rope_style), per_sm)
    if regs:
        kwargs["maxnreg"] = regs
    return prologue_sm90_kernel, args, kwargs, (grid,)


def programs_of(device, per_sm: int) -> int:
    """The persistent programs a launch asks for: the device's SMs (DEFAULT_PROGRAMS without one)
    times programs an SM."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count * per_sm
    return DEFAULT_PROGRAMS * per_sm

