"""CPU-only: compile the sm90 Gluon forward kernel for GPUTarget("cuda", 90, 32) and inspect the result.

For every shipped (head dim, dtype) config, and for the mod / block-sparse / ablation variants:
  * SASS contains HGMMA (wgmma), with the expected tile shapes;
  * PTX contains setmaxnreg with the configured consumer / producer budgets (Gluon drops setmaxnreg
    silently when the register budget does not fit);
  * no local-memory spills: cuobjdump's resource usage reports LOCAL:0 and STACK:0, and SASS has
    no LDL / STL;
  * shared memory fits in the 227 KB of an sm90 CTA.
Uses the cuobjdump shipped in triton's backends/nvidia/bin; no GPU needed.
"""
from __future__ import annotations


import re

import pytest
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from fa3_inductor.templates.aot import sass_report
from fa3_inductor.templates.hopper import all_configs, compile_sm90, get_config
from fa3_inductor.templates.hopper.configs import (SUPPORTED_HEAD_DIMS, all_pair_configs, split_head_dim,
                                                   tile_head_dim)

pytestmark = pytest.mark.sm90_compile
SMEM_LIMIT = 227 * 1024


@gluon.jit
def causal_mask(b, h, q_idx, kv_idx, bufs):
    return q_idx >= kv_idx


@gluon.jit
def document_mask(b, h, q_idx, kv_idx, bufs):
    return gl.load(bufs[0] + q_idx) == gl.load(bufs[0] + kv_idx)


@gluon.jit
def softcap_mod(qk, sm_scale, b, h, q_idx, kv_idx, bufs):
    score = qk * sm_scale
    t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [score * 0.05], dtype=gl.float32,
                                  is_pure=True, pack=1)
    return 20.0 * t


@gluon.jit
def head_bias_mod(qk, sm_scale, b, h, q_idx, kv_idx, bufs):
    score = qk * sm_scale
    return score + gl.load(bufs[0] + h)


def _inputs(D, dtype, B=2, Hq=4, Hkv=2, M=300, N=500, Dv=None):
    Dv = Dv or D
    q = torch.randn(B, Hq, M, D, dtype=dtype)
    k = torch.randn(B, Hkv, N, D, dtype=dtype)
    v = torch.randn(B, Hkv, N, Dv, dtype=dtype)
    return q, k, v, torch.empty(B, Hq, M, Dv, dtype=dtype), torch.empty(B, Hq, M), torch.empty(B, Hq, M)


def _check(ck, cfg, head_dim, block_n, dtype_tag, max_stack=0, check_pv=True):
    rep = sass_report(ck)
    sass, regs = rep.sass, rep.registers
    assert rep.stack <= max_stack and rep.local == 0, f"local memory / stack in use: {rep.stack}"
    assert regs <= cfg.maxnreg, f"{regs} registers at entry > maxnreg {cfg.maxnreg}"
    if max_stack == 0:
        assert rep.spill_instructions == 0, "local-memory loads/stores (spills) in SASS"
    # SASS spells bf16 wgmma "HGMMA.64xNx16.F32.BF16" and fp16 "HGMMA.64xNx16.F32" (no suffix).
    hgmma = set(re.findall(r"HGMMA\.(\d+x\d+x\d+)\.F32(?:\.(BF16))?\b", sass))
    assert (f"64x{block_n}x16", dtype_tag) in hgmma, f"no QK^T wgmma 64x{block_n}x16: {hgmma}"
    for n in [w for w in split_head_dim(head_dim) if w and check_pv]:   # a padded head dim splits O (96: 64 + 32)
        assert (f"64x{n}x16", dtype_tag) in hgmma, f"no PV wgmma 64x{n}x16: {hgmma}"
    nregs = rep.setmaxnreg
    assert cfg.consumer_regs in nregs and cfg.producer_regs in nregs, f"setmaxnreg missing or dropped: {nregs}"
    assert "USETMAXREG" in sass
    assert rep.shared <= SMEM_LIMIT, f"shared memory {rep.shared} > {SMEM_LIMIT}"
    return regs


@pytest.mark.parametrize("D,dtype,cfg", list(all_configs()), ids=lambda x: str(x).replace("torch.", ""))
def test_shipped_config_compiles(D, dtype, cfg):
    q, k, v, o, lse, mx = _inputs(D, dtype)
    ck = compile_sm90(q, k, v, o, lse, mx, sm_scale=D ** -0.5, config=cfg)
    _check(ck, cfg, D, cfg.block_n, "BF16" if dtype == torch.bfloat16 else "")


@pytest.mark.parametrize("D,Dv,dtype,cfg", list(all_pair_configs()), ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("variant", ["dense", "softcap_fixed_base", "persistent_sparse_causal"])
def test_value_head_dim_pair_compiles(D, Dv, dtype, cfg, variant):
    """A V head dim other than Q's (PAIR_TABLE, e.g. DeepSeek's q/k 192, v 128): spill-free with setmaxnreg,
    and the wgmma work is exactly QK^T over D columns and PV over Dv per site (sum of the 64xNx16
    instructions' N = sites x BLOCK_N x (D + Dv) / 16: no padding multiplied on either side), within the
    shared memory smem_bytes accounts for."""
    from fa3_inductor import mods
    q, k, v, o, lse, mx = _inputs(D, dtype, Dv=Dv)
    kw = {}
    if variant == "softcap_fixed_base":
        kw = dict(score_mod=_generated_score_mod(mods.softcap(20.0)), max_needed=False)
    elif variant == "persistent_sparse_causal":   # as the product launches causal: with its block mask
        q, k, v, o, lse, mx = _inputs(D, dtype, Dv=Dv, M=500, N=500)
        kvn, kvi, fn, fi = _sparse_tensors(500, 500, 128, 128)
        kw = dict(mask_mod=causal_mask, config=get_config(D, dtype, value_head_dim=Dv, persistent=True),
                  kv_num_blocks=kvn, kv_indices=kvi, full_kv_num_blocks=fn, full_kv_indices=fi)
    ck = compile_sm90(q, k, v, o, lse, mx, sm_scale=D ** -0.5, **{"config": cfg, **kw})
    _check(ck, cfg, D, cfg.block_n, "BF16" if dtype == torch.bfloat16 else "", check_pv=False)
    r = sass_report(ck)
    shapes = [int(n) for n in re.findall(r"HGMMA\.64x(\d+)x16\.F32", r.sass)]
    per_site = cfg.block_n * (D + Dv) // 16
    assert sum(shapes) % per_site == 0 and sum(shapes) >= per_site, (sum(shapes), per_site)
    assert cfg.smem_bytes(D, value_head_dim=Dv) <= r.shared < cfg.smem_bytes(D, value_head_dim=Dv) + 1024


def _sparse_tensors(M, N, qb, kvb):
    nq, nk = -(-M // qb), -(-N // kvb)
    num = torch.ones(1, 1, nq, dtype=torch.int32)
    idx = torch.zeros(1, 1, nq, nk, dtype=torch.int32)
    return num, idx, num.clone(), idx.clone()


@pytest.mark.parametrize("D", [64, 80, 96, 128, 160, 192, 256])
@pytest.mark.parametrize("variant", ["sparse_causal_softcap", "dense_document_headbias"])
def test_mod_and_sparse_variants_compile(D, variant):
    dtype = torch.bfloat16
    cfg = get_config(D, dtype)
    q, k, v, o, lse, mx = _inputs(D, dtype, Hkv=4, M=640, N=640)
    if variant == "sparse_causal_softcap":
        kvn, kvi, fn, fi = _sparse_tensors(640, 640, 128, 128)
        ck = compile_sm90(q, k, v, o, lse, mx, sm_scale=0.1, score_mod=softcap_mod, mask_mod=causal_mask,
                          kv_num_blocks=kvn, kv_indices=kvi, full_kv_num_blocks=fn, full_kv_indices=fi,
                          sparse_q_block=128, sparse_kv_block=128, config=cfg)
    else:
        doc = torch.zeros(640, dtype=torch.int32)
        bias = torch.zeros(4)
        ck = compile_sm90(q, k, v, o, lse, mx, sm_scale=0.1, score_mod=head_bias_mod, mask_mod=document_mask,
                          score_bufs=(bias,), mask_bufs=(doc,), config=cfg)
    # Known cost: a mask_mod that gathers [BLOCK_N] ids per KV tile from a buffer spills a few registers
    # (measured STACK 24-96 bytes, 4-16 LDL/STL; see docs/design/hopper_kernel.md). Bounded here so it cannot grow.
    _check(ck, cfg, D, cfg.block_n, "BF16", max_stack=128)


@pytest.mark.parametrize("over", [dict(overlap=False), dict(num_stages=3), dict(persistent=True),
                                  dict(persistent=None)], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_ablation_variants_compile(over):
    cfg = get_config(128, torch.bfloat16, **over)
    q, k, v, o, lse, mx = _inputs(128, torch.bfloat16)
    ck = compile_sm90(q, k, v, o, lse, mx, sm_scale=0.088, config=cfg)
    _check(ck, cfg, 128, cfg.block_n, "BF16")


def test_every_padded_head_dim_splits_into_powers_of_two():
    """A head dim in the table that is not a power of two must split into LO + HI columns, both powers of
    two with HI at least one wgmma K step (16): the kernel's column slices and accumulators need it."""
    for d in SUPPORTED_HEAD_DIMS:
        lo, hi = split_head_dim(d)
        assert lo + hi == d, d
        assert hi == 0 or (hi >= 16 and hi & (hi - 1) == 0 and lo == tile_head_dim(d) // 2), (d, lo, hi)


@pytest.mark.parametrize("D, fixed_base", [(80, False), (96, False), (160, False), (192, False), (192, True)])
def test_padded_head_dim_skips_the_zero_columns(D, fixed_base):
    """D=80 / 96 / 160 / 192 keep Q, K, V and O in two shared tiles each, LO + HI = D columns (split_smem:
    no padding in shared memory), and neither GEMM multiplies padding: every QK^T site issues D / 16 K
    steps of 64 x BLOCK_N, every PV site BLOCK_N / 16 of 64 x LO and of 64 x HI. So the wgmma work (sum of
    the 64xNx16 instructions' N) is sites x 2 x BLOCK_N x D / 16, with sites counted from the 64 x HI ones
    (64 x LO where HI = BLOCK_N)."""
    cfg = get_config(D, torch.bfloat16, fixed_base=fixed_base)
    q, k, v, o, lse, mx = _inputs(D, torch.bfloat16)
    r = sass_report(compile_sm90(q, k, v, o, lse, mx, sm_scale=D ** -0.5, config=cfg))
    assert r.spill_instructions == 0 and "USETMAXREG" in r.sass
    lo, hi = split_head_dim(D)
    shapes = [int(n) for n in re.findall(r"HGMMA\.64x(\d+)x16\.F32", r.sass)]
    only_pv = hi if hi != cfg.block_n else lo   # a PV width no QK^T shares
    assert only_pv != cfg.block_n
    sites, rest = divmod(shapes.count(only_pv), cfg.block_n // 16)
    assert sites >= 1 and rest == 0, shapes
    assert sum(shapes) == sites * 2 * cfg.block_n * D // 16, (sites, sum(shapes))
    # shared memory: the Q tiles and the K / V rings of exactly D columns, plus the barriers
    assert cfg.smem_bytes(D) <= r.shared < cfg.smem_bytes(D) + 1024, (r.shared, cfg.smem_bytes(D))


@pytest.mark.parametrize("D", [64, 96, 128, 192, 256])
def test_persistent_o_stage_fits(D):
    """Persistent: the separate O staging buffer is allocated where it fits (D=64/128: Q + O + K/V ring
    <= 227 KB) and dropped at D=256 and for split tiles (D=96 / 192); spill-free with setmaxnreg either way."""
    cfg = get_config(D, torch.bfloat16, persistent=True)
    q, k, v, o, lse, mx = _inputs(D, torch.bfloat16, B=4, Hq=16, Hkv=16, M=2048, N=2048)
    ck = compile_sm90(q, k, v, o, lse, mx, sm_scale=D ** -0.5, config=cfg)
    shared = _check(ck, cfg, D, cfg.block_n, "BF16") and sass_report(ck).shared
    # split shared tiles (padded head dims) stage O in the Q tiles
    assert (shared >= cfg.smem_bytes(D, o_stage=True)) == (D in (64, 128)), (D, shared)


def _generated(fn, kind):
    """A score_mod / mask_mod generated the product's way for the Hopper kernel, with its captured buffers."""
    from fa3_inductor.templates.modgen import BufferSpec, generate_mod_source, load_mod, trace_mod
    gm, bufs = trace_mod(fn, kind)
    return load_mod(generate_mod_source(gm, kind, [BufferSpec.of(b) for b in bufs], "gl"), "gl"), tuple(bufs)


def _generated_score_mod(fn):
    return _generated(fn, "score")[0]


def _mix(sass, *names):
    return {n: len(re.findall(rf"\b{n}\b", sass)) for n in names}


@pytest.mark.parametrize("D", [64, 128, 256])
def test_exp2_split_moves_work_off_mufu(D):
    """Half of the softmax exp2 on the FMA pipe (sfu_mod_exp2_emu, for an SFU-bound mod): MUFU.EX2 drops by
    half, the column split and join move no data (no extra shared-memory traffic or shuffles), and nothing
    spills."""
    from fa3_inductor import mods
    dtype = torch.bfloat16
    soft = _generated_score_mod(mods.softcap(30.0))
    q, k, v, o, lse, mx = _inputs(D, dtype)
    cfg0 = get_config(D, dtype, sfu_mod_exp2_emu=False)
    cfg = get_config(D, dtype, sfu_mod_exp2_emu=True)
    r0 = sass_report(compile_sm90(q, k, v, o, lse, mx, sm_scale=0.1, score_mod=soft, config=cfg0))
    ck = compile_sm90(q, k, v, o, lse, mx, sm_scale=0.1, score_mod=soft, config=cfg)
    _check(ck, cfg, D, cfg.block_n, "BF16")
    r = sass_report(ck)
    a, b = _mix(r0.sass, "MUFU.EX2", "STS", "LDS", "SHFL.BFLY"), _mix(r.sass, "MUFU.EX2", "STS", "LDS", "SHFL.BFLY")
    assert b["MUFU.EX2"] < a["MUFU.EX2"] * (1 - 2 / 4 + 0.05), (a, b)
    assert (b["STS"], b["LDS"], b["SHFL.BFLY"]) == (a["STS"], a["LDS"], a["SHFL.BFLY"]), (a, b)


def test_long_plain_launches_take_three_consumer_warpgroups():
    """configs.LONG_DENSE_TILE_FROM: D64 without a score_mod, mask_mod or block mask takes 192-row tiles (three
    consumer warpgroups at 160 registers) from 8192 query and key rows, compiled without spills; shorter launches, a
    score_mod or D128 keep the two-warpgroup tile."""
    from fa3_inductor import mods
    from fa3_inductor.templates.hopper.fwd_sm90 import _prepare

    def tile(D, M, fn=None):
        q, k, v, o, lse, mx = _inputs(D, torch.bfloat16, B=1, Hq=2, Hkv=2, M=M, N=M)
        _, kwargs, _ = _prepare(q, k, v, o, lse, mx, 0.1, fn, None, (), (), None, None, None, None, 128, 128, None,
                                132, False)
        return kwargs["TILE"], kwargs["SCHED"]

    soft = _generated_score_mod(mods.softcap(30.0))
    assert [tile(64, m)[0].CONSUMERS for m in (4096, 8192)] == [2, 3]
    assert tile(64, 8192, soft)[0].CONSUMERS == 2 and tile(128, 16384)[0].CONSUMERS == 2
    three, sched = tile(64, 8192)
    assert (three.BLOCK_M, three.HALF_M, sched.CONSUMER_REGS) == (192, 64, 160)
    q, k, v, o, lse, mx = _inputs(64, torch.bfloat16, B=1, Hq=2, Hkv=2, M=8192, N=8192)
    r = sass_report(compile_sm90(q, k, v, o, lse, mx, sm_scale=0.1, max_needed=False))
    loops = [b for b in r.inner_loops() if any("HGMMA" in t for t in b)]
    print(f"\nD64 192-row tile: {r.spill_instructions} spills, setmaxnreg {sorted(r.setmaxnreg)}, shared {r.shared}, "
          f"loops {[len(b) for b in loops]}")
    assert r.spill_instructions == 0 and r.stack == 0 and 160 in r.setmaxnreg and len(loops) == 3


def test_mods_convert_indices_before_they_broadcast():
    """ALiBi / relative bias: no per-score int->float conversion (I2F) left in the SASS, and no per-score
    MUFU op beyond the softmax's exp2."""
    from fa3_inductor import mods
    q, k, v, o, lse, mx = _inputs(128, torch.bfloat16)
    for fn in (mods.alibi(4), mods.relative_bias):
        mod = _generated_score_mod(fn)
        r = sass_report(compile_sm90(q, k, v, o, lse, mx, sm_scale=0.1, score_mod=mod))
        n = len(re.findall(r"\bI2FP?\.F32\.S32\b", r.sass))
        assert n <= 8, f"{n} I2F conversions: per-score conversions are back"
        plain = sass_report(compile_sm90(q, k, v, o, lse, mx, sm_scale=0.1))
        # ALiBi's slope exp2 is one per head (a scalar per tile), not per score
        assert r.sass.count("MUFU.EX2") <= plain.sass.count("MUFU.EX2") + 4


@pytest.mark.parametrize("D", [64, 128, 256])
def test_bounded_softcap_fixed_base_compiles_without_row_max(D):
    """softcap with nobody reading the row max: the fixed-base path has no running max (FMNMX) and no
    O rescale, stays spill-free with setmaxnreg, and the prologue's qk scale and the final * cap are
    folded (one FMUL per score left, against the max-tracking path's three)."""
    from fa3_inductor import mods
    dtype = torch.bfloat16
    cfg = get_config(D, dtype)
    soft = _generated_score_mod(mods.softcap(30.0))
    q, k, v, o, lse, mx = _inputs(D, dtype)
    table = compile_sm90(q, k, v, o, lse, mx, sm_scale=0.1, score_mod=soft, config=cfg, max_needed=False)
    _check(table, cfg, D, cfg.block_n, "BF16")   # as shipped (D=64: with exp2 on the FMA pipe)
    # the structure, without the exp2 polynomial (its input clamp is an FMNMX too)
    cfg = get_config(D, dtype, sfu_mod_exp2_emu=0)
    fixed = compile_sm90(q, k, v, o, lse, mx, sm_scale=0.1, score_mod=soft, config=cfg, max_needed=False)
    tracked = sass_report(compile_sm90(q, k, v, o, lse, mx, sm_scale=0.1, score_mod=soft, config=cfg))
    a = _mix(tracked.sass, "FMNMX", "FMUL", "MUFU.TANH")
    b = _mix(sass_report(fixed).sass, "FMNMX", "FMUL", "MUFU.TANH")
    assert b["FMNMX"] == 0 < a["FMNMX"], (a, b)
    assert b["MUFU.TANH"] == a["MUFU.TANH"] > 0 and b["FMUL"] < a["FMUL"], (a, b)


@pytest.mark.parametrize("dtype, cap, max_needed, fixed", [
    (torch.bfloat16, 30.0, False, True),
    (torch.bfloat16, 30.0, True, False),     # max_scores is read: the row max is needed
    (torch.bfloat16, 70.0, False, False),    # 2^-202 would underflow P
    (torch.float16, 30.0, False, False),     # fp16 P holds 2^-14..2^15 only
    (torch.float16, 4.0, False, True),
])
def test_fixed_base_is_chosen_only_where_p_keeps_its_range(dtype, cap, max_needed, fixed):
    from fa3_inductor import mods
    from fa3_inductor.templates.hopper.fwd_sm90 import _prepare
    q, k, v, o, lse, mx = _inputs(128, dtype)
    soft = _generated_score_mod(mods.softcap(cap))
    _, kwargs, _ = _prepare(q, k, v, o, lse, mx, 0.1, soft, None, (), (), None, None, None, None, 128, 128,
                            None, 132, max_needed)
    assert kwargs["FLAGS"].FIXED_BASE == fixed


@pytest.mark.parametrize("D, mod, emu, folded", [
    (64, "softcap", True, None),     # tanh per score: MUFU-bound at D=64, half the exp2 on the FMA pipe
    (64, "noop", False, None),
    (128, "softcap", False, None),
    (64, "alibi", False, False),     # measured: D=64 runs `score + x` mods unfolded, D=128 folded
    (128, "alibi", False, True),
])
def test_table_choices_per_head_dim_and_mod(D, mod, emu, folded):
    from fa3_inductor import mods
    from fa3_inductor.templates.hopper.fwd_sm90 import _prepare, fa3_fwd_sm90_kernel
    from fa3_inductor.templates.modgen import unfolded_of
    q, k, v, o, lse, mx = _inputs(D, torch.bfloat16)
    fn = {"softcap": lambda: _generated_score_mod(mods.softcap(30.0)), "noop": lambda: None,
          "alibi": lambda: _generated_score_mod(mods.alibi(4))}[mod]()
    args, kwargs, _ = _prepare(q, k, v, o, lse, mx, 0.1, fn, None, (), (), None, None, None, None, 128, 128,
                               None, 132, False)
    assert kwargs["FLAGS"].EXP2_EMU == emu
    if folded is not None:
        assert kwargs["SCORE_MOD"] is (fn if folded else unfolded_of(fn))
        # the folded form's tile is in units of sm_scale (qk + x / sm_scale), the unfolded twin's is not
        qk_unit = args[fa3_fwd_sm90_kernel.arg_names.index("qk_unit")]
        assert qk_unit == (1.0 if folded else 0.1)


def _band_block_mask(n_blocks, width):
    """Block-mask tensors (Bm = Hm = 1) where query block i visits KV blocks max(0, i - width + 1) .. i."""
    num = torch.tensor([min(i + 1, width) for i in range(n_blocks)], dtype=torch.int32)[None, None]
    idx = torch.zeros(1, 1, n_blocks, n_blocks, dtype=torch.int32)
    for i in range(n_blocks):
        blocks = list(range(max(0, i - width + 1), i + 1))
        idx[0, 0, i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return num, idx


@pytest.mark.parametrize("D, kv_len, longest, persistent", [
    (128, 8192, None, True),     # dense 8k: 64 KV tiles, whole KV <= 8192
    (128, 8192, 64, True),       # causal 8k
    (128, 16384, 33, False),     # a 4096-key window over 16k keys stays one CTA per tile
    (128, 16384, 32, True),
    (128, 16384, None, False),
    (64, 8192, None, False),     # the 8k extension was measured at D=128 only
    (256, 4096, None, True),
])
def test_persistent_cut(D, kv_len, longest, persistent):
    from fa3_inductor.templates.hopper.configs import use_persistent
    assert use_persistent(get_config(D), num_tiles=2048, num_sms=132, kv_len=kv_len,
                          max_kv_tiles=longest) is persistent
    # a KV_AFFINE mod (ALiBi) keeps the 4096-key cut
    assert use_persistent(get_config(D), num_tiles=2048, num_sms=132, kv_len=kv_len, max_kv_tiles=longest,
                          kv_affine=True) is (persistent and (longest or -(-kv_len // get_config(D).block_n))
                                              * get_config(D).block_n <= 4096)


@pytest.mark.parametrize("dv, kv_len, persistent", [(128, 8192, True), (128, 16384, False), (192, 8192, False)])
def test_persistent_cut_at_192(dv, kv_len, persistent):
    """q/k 192 with v 128 goes persistent up to 8192 keys (measured: causal 8k 1.024x); equal 192 keeps 4096."""
    from fa3_inductor.templates.hopper.configs import use_persistent
    assert use_persistent(get_config(192, value_head_dim=dv), num_tiles=2048, num_sms=132,
                          kv_len=kv_len) is persistent


@pytest.mark.parametrize("width, persistent", [(3, True), (32, True), (33, False), (128, False)])
def test_schedule_follows_the_longest_tile_of_a_block_mask(width, persistent):
    # S = 16k: a sliding window's tiles (3 KV tiles for 256 keys) take the persistent pair schedule at any
    # length; a causal mask's longest tile (128 KV tiles) does not, as a dense launch of 16k keys
    from fa3_inductor.templates.hopper.fwd_sm90 import _prepare
    q, k, v, o, lse, mx = _inputs(128, torch.bfloat16, B=1, Hq=16, Hkv=16, M=16384, N=16384)
    num, idx = _band_block_mask(128, width)
    _, kwargs, grid = _prepare(q, k, v, o, lse, mx, 0.1, None, causal_mask, (), (), num, idx, None, None, 128, 128,
                               None, 132, False)
    assert kwargs["SCHED"].PERSISTENT == persistent
    assert grid == ((132,) if persistent else (16 * 128,))


# Known limit: in the persistent schedule at D=128 the overlap keeps S, P and O live together, and a
# generated index mod's values (KV_AFFINE: its column vector) push past 240 registers. ptxas then spills
# per-tile scalars around the KV loop (stored once per query tile), never inside it.
_PERSISTENT_SPILLS = {64: 0, 128: 12, 256: 0}


@pytest.mark.parametrize("D", [64, 128, 256])
def test_generated_index_mods_in_the_persistent_schedule(D):
    """Generated ALiBi / relative-bias / gathered-table mods, compiled as launched for many short tiles
    (persistent): setmaxnreg present, no local-memory access inside the KV loops, and at most the known
    count of spill stores outside them (none at D=64/256)."""
    from fa3_inductor import mods
    dtype = torch.bfloat16
    table = torch.randn(4, 64)
    q, k, v, o, lse, mx = _inputs(D, dtype, B=4, Hq=16, Hkv=16, M=4096, N=4096)
    for fn in (mods.alibi(16), mods.relative_bias,
               lambda s, b, h, qi, ki: s + table[h % 4, torch.clamp((qi - ki).abs(), max=63)]):
        mod, bufs = _generated(fn, "score")
        _, kwargs, _ = _prepare_for(q, k, v, o, lse, mx, mod, bufs)
        assert kwargs["SCHED"].PERSISTENT, "this shape must take the persistent schedule"
        r = sass_report(compile_sm90(q, k, v, o, lse, mx, sm_scale=0.1, score_mod=mod, score_bufs=bufs,
                                     max_needed=False))
        assert "USETMAXREG" in r.sass, "setmaxnreg dropped"
        # a KV loop computes one exp2 per score it holds: 2 rows x BLOCK_N / 4 columns per thread
        per_tile = get_config(D, dtype).block_n // 2
        kv_loops = [body for body in r.inner_loops() if sum("MUFU.EX2" in t for t in body) >= per_tile]
        assert len(kv_loops) >= 2, "the two consumers' KV loops were not found"
        in_loop = [t for body in kv_loops for t in body if re.match(r"(?:@!?U?P\w+\s+)?(?:LDL|STL)\b", t)]
        assert not in_loop, f"D={D}: local-memory access inside the KV loop: {in_loop}"
        spills = len(re.findall(r"\bSTL\b", r.sass))
        assert spills <= _PERSISTENT_SPILLS[D], f"D={D}: {spills} spill stores (known limit {_PERSISTENT_SPILLS[D]})"


def _prepare_for(q, k, v, o, lse, mx, mod, bufs):
    from fa3_inductor.templates.hopper.fwd_sm90 import _prepare
    return _prepare(q, k, v, o, lse, mx, 0.1, mod, None, bufs, (), None, None, None, None, 128, 128, None, 132,
                    False)


@pytest.mark.parametrize("name", ["causal", "window", "document", "document_window"])
def test_a_masked_tile_selects_once_per_score(name):
    """Generated block-sparse masks, N a multiple of BLOCK_N: the masked path of the D=128 KV loop has one
    FSEL per score (ANDed conditions chain into the comparisons' predicates, no bound test, no clamp) and
    no per-score IMAD (the window's `q - kv < w` compares kv with a row bound), and nothing spills."""
    from fa3_inductor import mods
    from fa3_inductor.recognition.canonical import dense_block_mask
    S, D = 1024, 128
    doc = torch.randint(0, 3, (S,), dtype=torch.int32).sort().values
    fn = {"causal": mods.causal, "window": mods.sliding_window(256), "document": mods.document(doc),
          "document_window": mods.and_masks(mods.document(doc), mods.sliding_window(256))}[name]
    mask_mod, bufs = _generated(fn, "mask")
    qi, ki = torch.arange(S)[:, None], torch.arange(S)[None, :]
    bm = dense_block_mask(torch.broadcast_to(fn(0, 0, qi, ki), (S, S)), 1, 1, S, S, "cpu")
    q, k, v, o, lse, mx = _inputs(D, torch.bfloat16, B=2, Hq=16, Hkv=16, M=S, N=S)
    r = sass_report(compile_sm90(q, k, v, o, lse, mx, sm_scale=0.1, mask_mod=mask_mod, mask_bufs=bufs,
                                 kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices,
                                 full_kv_num_blocks=bm.full_kv_num_blocks, full_kv_indices=bm.full_kv_indices,
                                 max_needed=False))
    assert r.spill_instructions == 0 and "USETMAXREG" in r.sass
    scores = 64   # per thread and tile: 2 rows x BLOCK_N / 4 columns
    kv_loops = [body for body in r.inner_loops() if sum("MUFU.EX2" in t for t in body) >= scores]
    assert len(kv_loops) >= 2, "the two consumers' KV loops were not found"
    for body in kv_loops:
        ops = [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body]
        # the softmax itself selects 4 times per tile (row bookkeeping); the mask once per score
        assert ops.count("FSEL") <= scores + 8, f"{name}: {ops.count('FSEL')} FSEL in the KV loop"
        assert ops.count("IMAD") < 16, f"{name}: {ops.count('IMAD')} IMAD in the KV loop (per-score index math)"
