"""The hopper_fp8 family: FP8 (e4m3) attention in the Gluon Hopper kernel (templates/hopper/fwd_sm90.py with its
Quant bundle on, tiles in templates/hopper_fp8/configs.py).

- CPU: what the family serves and declines, and why.
- CPU: the int32 -> float32 bit trick of int8 Q·K^T (fwd_sm90._s32_to_f32) is exact over every score D <= 256 gives.
- ``sm90_compile`` (no GPU): every FP8 table entry and the mod / block-mask / schedule variants compile for
  sm90 with e4m3 wgmma for both GEMMs (QK^T from shared memory, PV with P in registers), wgmma not serialized,
  setmaxnreg kept, no spills (the mod variants too), the shared
  memory configs.fp8_smem_bytes accounts for, P's fp32 -> e4m3 operand conversion in registers (no shared-memory
  traffic inside the KV loops, one byte permute per A register at most) and, with int8 Q / K, no I2F per score.
- CPU: the lean softmax's biased int8 scores (Quant.LEAN) keep the exp2 argument within its offset's rounding.
- ``gpu`` (an H100 / H200): ``flex(..., fp8=...)`` served by this family against float64 attention on the same
  dequantized operands (test_fp8_forward.py's rule, reference.FP8_TOLERANCE), and against a float64 emulation
  of the kernel's own arithmetic (P rounded to e4m3 per KV tile of the kernel's width).
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

from fa3_inductor import FP8Recipe
from fa3_inductor.templates.family import NotServed, SiteFacts
from fa3_inductor.templates.hopper_fp8.configs import (SUPPORTED_HEAD_DIMS, UNSERVED_TWO_LEVEL, all_fp8_configs,
                                                       fp8_smem_bytes, get_fp8_config, serves_fp8_head_dims)
from fa3_inductor.templates.hopper_fp8.family import HOPPER_FP8

SMEM_LIMIT = 227 * 1024


def _recipe(**fields) -> FP8Recipe:
    """An FP8Recipe with Q and K in e4m3 unless ``qk`` says otherwise (FP8Recipe's default is int8)."""
    fields.setdefault("qk", "e4m3")
    return FP8Recipe(**fields)


# ------------------------------------------------------------------------------------------------ CPU
def _sm90(monkeypatch, capability=(9, 0)):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    return torch.device("cuda", 0)


def test_serves_fp8_sites_on_sm90_only(monkeypatch):
    dev = _sm90(monkeypatch)
    for d in SUPPORTED_HEAD_DIMS:
        assert HOPPER_FP8.serves(SiteFacts(dev, torch.bfloat16, d, d, fp8=True)) is None
        assert HOPPER_FP8.serves(SiteFacts(dev, torch.float16, d, d, fp8=True)) is None
    # not FP8, not sm90, not a GPU: not meant here (no note)
    assert HOPPER_FP8.serves(SiteFacts(dev, torch.bfloat16, 128, 128)) == ""
    assert HOPPER_FP8.serves(SiteFacts(torch.device("cpu"), torch.bfloat16, 128, 128, fp8=True)) == ""
    _sm90(monkeypatch, (8, 9))
    assert HOPPER_FP8.serves(SiteFacts(dev, torch.bfloat16, 128, 128, fp8=True)) == ""


def test_declines_head_dims_without_tiles_with_a_reason(monkeypatch):
    dev = _sm90(monkeypatch)
    for d, dv in ((96, 96), (192, 128), (128, 64)):
        reason = HOPPER_FP8.serves(SiteFacts(dev, torch.bfloat16, d, dv, fp8=True))
        assert reason and "no tiles" in reason and "64, 128, 256" in reason, reason


def test_two_level_at_d256_is_declined_per_call():
    assert serves_fp8_head_dims(256, 256, two_level=False)
    assert not serves_fp8_head_dims(256, 256, two_level=True)
    assert all(serves_fp8_head_dims(d, d) for d in SUPPORTED_HEAD_DIMS if d not in UNSERVED_TWO_LEVEL)
    assert "two_level=0" in HOPPER_FP8.describe(SiteFacts(torch.device("cpu"), torch.bfloat16, 256, 256, fp8=True))


def test_prepare_needs_the_prologue_operands_and_a_gpu():
    from fa3_inductor.templates.family import Call
    from fa3_inductor.templates.fp8_prologue.reference import quantize_reference

    q = k = v = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    lse = torch.empty(1, 2, 64)
    call = Call(q, k, v, torch.empty_like(q), lse, lse.clone(), (None,) * 4, (), (), 0.125, 128, 128)
    with pytest.raises(NotServed, match="prologue"):
        HOPPER_FP8.prepare(call)
    ops = quantize_reference(q, k, v, _recipe())
    call.q, call.k, call.v, call.fp8 = ops.q, ops.k, ops.vt, ops
    with pytest.raises(NotServed, match="sm90 GPU"):
        HOPPER_FP8.prepare(call)
    ops = quantize_reference(q, k, v, FP8Recipe(qk="int8"))   # int8 Q / K reach the same device check
    call.q, call.k, call.v, call.fp8 = ops.q, ops.k, ops.vt, ops
    with pytest.raises(NotServed, match="sm90 GPU"):
        HOPPER_FP8.prepare(call)
    with pytest.raises(NotServed, match="sm90 GPU"):
        HOPPER_FP8.launch(call)


def test_s32_to_f32_bit_trick_is_exact_over_the_score_range():
    """fwd_sm90._s32_to_f32 (int8 Q·K^T's scores to fp32 by an integer add to the bits of 1.5·2^23 and a float
    subtract, instead of I2F), emulated in float32 over every integer the s8 wgmma can produce at D <= 256
    (|Q8·K8| <= 256·128^2 = 2^22, even with -128, which the prologue never writes): equal to the exact conversion,
    and wrong right past the bound, so the bound is the trick's."""
    from fa3_inductor.templates.hopper.fwd_sm90 import S32_MAGIC, S32_MAGIC_BITS

    def convert(x):   # the kernel's two instructions, in float32
        return (x + S32_MAGIC_BITS.value).view(torch.float32) - torch.tensor(S32_MAGIC.value, dtype=torch.float32)

    assert 256 * 127 ** 2 < 2 ** 22 == 256 * 128 ** 2
    x = torch.arange(-2 ** 22, 2 ** 22 + 1, dtype=torch.int32)
    assert torch.equal(convert(x), x.to(torch.float32))
    outside = torch.tensor([2 ** 22 + 1, -2 ** 22 - 1], dtype=torch.int32)
    assert not torch.equal(convert(outside), outside.to(torch.float32))


def test_biased_int8_scores_in_the_exp2_argument():
    """Quant.LEAN keeps int8 scores biased (float S32_MAGIC + qk) and folds the bias into the exp2 FFMA's row
    offset: fl((S32_MAGIC + qk)·c - fl(m + S32_MAGIC·c)) (one rounding: the FFMA's product is exact) against
    the exact qk·c - m. Emulated over scores up to 2^22 (D <= 256) and per-row factors c from 1e-7 to 1e-3 (log2
    units per Q8·K8 unit; 1e-3 already spreads a row's scores over ±4000 log2 units): the error stays within the
    offset's rounding, 2^-24·(S32_MAGIC·c + |m|), plus the result's own rounding, and where P is not flushed to 0
    (argument > -30) under 2^-10 in log2 units: 0.07% of P, against e4m3's rounding of up to 6%."""
    from fa3_inductor.templates.hopper.fwd_sm90 import S32_MAGIC, S32_MAGIC_BITS

    g = torch.Generator().manual_seed(0)
    qk = torch.randint(-2 ** 22, 2 ** 22 + 1, (1 << 16,), generator=g, dtype=torch.int32)
    biased = (qk + S32_MAGIC_BITS.value).view(torch.float32).double()
    assert torch.equal(biased - S32_MAGIC.value, qk.double())   # the bias itself is exact
    for c in (1e-7, 1e-5, 1e-4, 1e-3):
        c32 = torch.tensor(c, dtype=torch.float32).double()
        m = (qk.double() * c32).max()                            # the row max, log2 units
        offset = (m + S32_MAGIC.value * c32).float().double()    # rounded once to fp32, as the kernel's row vector
        x = (biased * c32 - offset).float().double()             # FFMA: exact product, one rounding
        exact = qk.double() * c32 - m
        bound = 2.0 ** -24 * (S32_MAGIC.value * float(c32) + abs(float(m))) + 2.0 ** -24 * exact.abs()
        assert ((x - exact).abs() <= bound + 1e-30).all(), c
        kept = exact > -30
        assert kept.sum() > 0 and ((x - exact)[kept].abs() < 2.0 ** -10).all(), c


def test_config_table_fits_shared_memory_and_scale_blocks():
    for d, cfg in all_fp8_configs():
        assert fp8_smem_bytes(cfg, d, d) <= SMEM_LIMIT - 1024   # barriers take a few more bytes
        assert _recipe().block_n % cfg.block_n == 0           # a KV tile inside one K / V scale block
        assert cfg.block_m == 128
    with pytest.raises(ValueError, match="no tiles for q/k head dim 96"):
        get_fp8_config(96)


# ------------------------------------------------------------------------------------ sm90 compile-only
def _operands(D, recipe, B=2, H=4, HKV=2, M=300, N=500, seed=0):
    """The prologue's operands for random inputs (torch ops on the CPU: templates/fp8_prologue/reference.py),
    in the dtypes the GPU prologue writes, and the outputs."""
    from fa3_inductor.templates.fp8_prologue.reference import quantize_reference

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, M, D, generator=g).to(torch.bfloat16)
    k = torch.randn(B, HKV, N, D, generator=g).to(torch.bfloat16)
    v = torch.randn(B, HKV, N, D, generator=g).to(torch.bfloat16)
    ops = quantize_reference(q, k, v, recipe)
    for name in ("q_scale", "k_scale", "v_scale", "v_scale_max"):
        setattr(ops, name, getattr(ops, name).float().contiguous())
    out = torch.empty(B, H, M, D, dtype=torch.bfloat16)
    return ops, out, torch.empty(B, H, M), torch.empty(B, H, M)


def _generated(fn, kind):
    """A mod generated the product's way (modgen, gl dialect) and its captured buffers."""
    from fa3_inductor.templates.modgen import BufferSpec, generate_mod_source, load_mod, trace_mod

    gm, bufs = trace_mod(fn, kind)
    return load_mod(generate_mod_source(gm, kind, [BufferSpec.of(b) for b in bufs], "gl"), "gl"), tuple(bufs)


def _block_mask_options(fn, M, N, block=128):
    from fa3_inductor.recognition.canonical import dense_block_mask

    mod, bufs = _generated(fn, "mask")
    qi, ki = torch.arange(M)[:, None], torch.arange(N)[None, :]
    bm = dense_block_mask(torch.broadcast_to(fn(0, 0, qi, ki), (M, N)), 1, 1, M, N, "cpu")
    return dict(mask_mod=mod, mask_bufs=bufs, kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices,
                full_kv_num_blocks=bm.full_kv_num_blocks, full_kv_indices=bm.full_kv_indices,
                sparse_q_block=block, sparse_kv_block=block)


def _wgmma_forms(ptx: str) -> set:
    """{(PTX wgmma shape, 'smem' or 'regs')}: how each wgmma takes its A operand (descriptor or registers)."""
    forms = set()
    for m in re.finditer(r"(wgmma\.mma_async\.sync\.aligned\.\S+)\s*\{[^}]*\},\s*(\{|%rd)", ptx):
        forms.add((m.group(1), "regs" if m.group(2) == "{" else "smem"))
    return forms


def _check_fp8(ck, cfg, D, qk="e4m3"):
    """The checks every FP8 compile must pass (no stack, no LDL / STL anywhere); returns the SASS report. `qk`: Q and
    K's format (FP8Recipe.qk): QK^T is an e4m3 or an s8 wgmma, PV e4m3 either way."""
    from fa3_inductor.templates.aot import sass_report

    r = sass_report(ck)
    assert r.stack == 0 and r.local == 0, f"D={D}: spills (stack {r.stack}, {r.spill_instructions} LDL/STL)"
    assert r.spill_instructions == 0, f"D={D}: {r.spill_instructions} LDL/STL"
    assert r.registers <= cfg.maxnreg
    assert {cfg.consumer_regs, cfg.producer_regs} <= r.setmaxnreg, f"setmaxnreg dropped: {r.setmaxnreg}"
    assert "USETMAXREG" in r.sass
    forms = _wgmma_forms(r.ptx)
    qk_type = "s32.s8.s8" if qk == "int8" else "f32.e4m3.e4m3"
    qk_form = f"wgmma.mma_async.sync.aligned.m64n{cfg.block_n}k32.{qk_type}"
    pv = f"wgmma.mma_async.sync.aligned.m64n{D}k32.f32.e4m3.e4m3"
    assert (qk_form, "smem") in forms, f"no {qk} QK^T wgmma from shared memory: {forms}"
    assert (pv, "regs") in forms, f"no e4m3 PV wgmma with P in registers: {forms}"
    assert all(shape.endswith((qk_type, "e4m3.e4m3")) for shape, _ in forms), f"an unexpected wgmma: {forms}"
    gmma = set(re.findall(r"\b[HQI]GMMA\.\w+\.\w+(?:\.\w+)*", r.sass))
    assert f"QGMMA.64x{D}x32.F32.E4M3.E4M3" in gmma, gmma
    if qk == "e4m3":
        assert f"QGMMA.64x{cfg.block_n}x32.F32.E4M3.E4M3" in gmma, gmma
    assert fp8_smem_bytes(cfg, D, D) <= r.shared < fp8_smem_bytes(cfg, D, D) + 1024 and r.shared <= SMEM_LIMIT
    # P: fp32 accumulator -> e4m3 (F2FP) -> the A operand's layout by shuffles and byte permutes, no shared memory
    loops = [" ".join(body) for body in r.inner_loops() if "QGMMA" in " ".join(body)]
    assert loops, "no KV loop with QGMMA found"
    a_regs = 64 * cfg.block_n // (128 * 4)   # 32-bit A-operand registers of P per thread
    for body in loops:
        assert "F2FP" in body and "MUFU.EX2" in body
        assert not re.search(r"\b(STS|LDS|STSM|LDSM)\b", body), "P's conversion goes through shared memory"
        # P converted in place, not held a byte per register and repacked (what a loop-carried e4m3 P costs)
        assert len(re.findall(r"\bPRMT\b", body)) <= a_regs, "P repacked byte by byte"
        # ptxas serializes wgmma (C7513 / C7514) by waiting after every one: gsb0 on each instead of each group's last
        assert len(re.findall(r"GMMA[^;]*gsb0", body)) <= 2, "wgmma serialized"
        if qk == "int8":   # the s32 scores become fp32 by an integer add, not I2F (a per-tile scalar's may remain)
            assert len(re.findall(r"\bI2FP?\.", body)) <= 2, "int8 scores converted by I2F"
    return r


def _compile_variants(D, recipe, **options):
    """Compile the launch and its siblings (schedule, EVEN_N) the host builds for one FP8 site."""
    from fa3_inductor.templates.aot import compile_launch
    from fa3_inductor.templates.hopper.fwd_sm90 import prepare_fwd_sm90_variants

    M, N = options.pop("M", 300), options.pop("N", 500)
    ops, out, lse, mx = _operands(D, recipe, M=M, N=N, HKV=options.pop("HKV", 2))
    launch, siblings = prepare_fwd_sm90_variants(ops.q, ops.k, ops.vt, out, lse, mx, sm_scale=D ** -0.5, fp8=ops,
                                                 max_needed=False, **options)
    return [(kwargs, compile_launch(kernel, args, kwargs)) for kernel, args, kwargs, _ in [launch, *siblings]]


@pytest.mark.sm90_compile
@pytest.mark.parametrize("D,cfg", list(all_fp8_configs()), ids=lambda x: str(x) if isinstance(x, int) else "")
@pytest.mark.parametrize("qk", ["e4m3", "int8"])
def test_fp8_config_compiles_to_e4m3_wgmma(D, cfg, qk):
    recipe = _recipe(two_level=0 if D in UNSERVED_TWO_LEVEL else 1, qk=qk)
    compiled = _compile_variants(D, recipe)
    schedules = {(kw["SCHED"].PERSISTENT, kw["FLAGS"].EVEN_N) for kw, _ in compiled}
    persistent = (False, True) if cfg.persistent is None else (cfg.persistent,)
    assert schedules == {(p, even_n) for p in persistent for even_n in (False, True)}
    for kwargs, ck in compiled:
        assert kwargs["QUANT"].ON and kwargs["QUANT"].TWO_LEVEL == (recipe.two_level > 0)
        assert kwargs["QUANT"].QK_INT8 == (qk == "int8")
        assert kwargs["QUANT"].LEAN == cfg.lean_fp8_softmax   # no mod buffers here: the table's softmax
        assert kwargs["SCHED"].O_STAGE   # FP8 always stages O apart from the (e4m3) Q tile
        _check_fp8(ck, cfg, D, qk=qk)


def _softcap_causal(M, N):
    from fa3_inductor import mods

    mod, bufs = _generated(mods.softcap(20.0), "score")
    return dict(score_mod=mod, score_bufs=bufs, **_block_mask_options(mods.causal, M, N))


def _alibi(M, N):
    from fa3_inductor import mods

    mod, bufs = _generated(mods.alibi(4), "score")
    return dict(score_mod=mod, score_bufs=bufs)


def _document_window(M, N):
    from fa3_inductor import mods

    docs = torch.arange(max(M, N), dtype=torch.int32) // 300
    return _block_mask_options(mods.and_masks(mods.document(docs), mods.sliding_window(256)), M, N)


@pytest.mark.sm90_compile
@pytest.mark.parametrize("variant", [_softcap_causal, _alibi, _document_window], ids=lambda f: f.__name__[1:])
@pytest.mark.parametrize("D,two_level", [(64, 1), (128, 1), (128, 0), (256, 0)])
def test_fp8_mod_variants_compile(variant, D, two_level):
    """Mods on the dequantized scores (a bounded score_mod keeps the row max: no fixed base in FP8), KV_AFFINE's
    column FFMA with the dequantization folded in (ALiBi; per score with two-level accumulation, whose second
    accumulator leaves no room for the column vector), block-sparse masks with partial and full blocks."""
    M, N = 640, 640
    cfg = get_fp8_config(D)
    compiled = _compile_variants(D, _recipe(two_level=two_level), M=M, N=N, **variant(M, N))
    for kwargs, ck in compiled:
        assert not kwargs["FLAGS"].FIXED_BASE
        if variant is _alibi:
            assert kwargs["FLAGS"].KV_AFFINE == (two_level == 0)
        # D=128 with two-level accumulation or a gathering mask spilled 8-40 bytes of kernel-wide scalars before
        # Quant.TIGHT (docs/design/hopper_fp8.md, "Spills under mods"); every variant is spill-free now
        assert kwargs["QUANT"].TIGHT == (cfg.fp8_tight_mods and (two_level == 1 or variant is _document_window))
        _check_fp8(ck, cfg, D)


def test_fp8_operand_checks_say_what_is_wrong():
    from fa3_inductor.templates.hopper.fwd_sm90 import prepare_fwd_sm90_variants

    ops, out, lse, mx = _operands(128, _recipe(block_n=64))
    with pytest.raises(ValueError, match=r"FP8Recipe\(block_n=128\)"):
        prepare_fwd_sm90_variants(ops.q, ops.k, ops.vt, out, lse, mx, sm_scale=0.1, fp8=ops)
    ops, out, lse, mx = _operands(128, _recipe())
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        prepare_fwd_sm90_variants(ops.q, ops.k, ops.vt, out.float(), lse, mx, sm_scale=0.1, fp8=ops)


# ------------------------------------------------------------------------------------------------ GPU
def _is_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture
def hopper_fp8_first():
    """flex(fp8=...) with this family ahead of the fp8 family (as the registry line puts it), plans afresh."""
    if not _is_sm90():
        pytest.skip("needs an sm90 (Hopper) GPU")
    from fa3_inductor import direct
    from fa3_inductor.templates import registry

    direct.clear()
    ctx = (contextlib.nullcontext() if "hopper_fp8" in registry.names()
           else registry.registered(HOPPER_FP8, before="fp8"))
    with ctx:
        yield
    direct.clear()


def _gpu_inputs(B, H, HKV, M, N, D, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g).to(torch.bfloat16).cuda()
                 for shape in ((B, H, M, D), (B, HKV, N, D), (B, HKV, N, D)))


def _emulated(ops, scale, tile, score_mod=None, mask_mod=None):
    """The kernel's arithmetic in float64 on its operands: the online softmax over KV tiles of the kernel's
    width, each tile's P = 2^8·exp(s - running max)·VS / VS_MAX rounded to e4m3, the row sum from the unrounded
    P (test_fp8_forward._emulated, with the tile width and mods as parameters)."""
    from fa3_inductor.templates.fp8_prologue.reference import dequantize, round_e4m3

    dq, dk, _ = (t.double() for t in dequantize(ops))
    B, H, M, _ = dq.shape
    HKV, N = dk.shape[1], dk.shape[2]
    group = H // HKV
    dk = dk.repeat_interleave(group, 1)
    v8 = ops.vt.double()[..., :N].transpose(-1, -2).repeat_interleave(group, 1)
    vs = ops.v_scale.double().repeat_interleave(group, 1)
    vs_max = ops.v_scale_max.double().repeat_interleave(group, 1)[..., None, None]
    s_all = dq @ dk.transpose(-1, -2) * scale
    dev = dq.device
    b, h = torch.arange(B, device=dev)[:, None, None, None], torch.arange(H, device=dev)[None, :, None, None]
    qi, ki = torch.arange(M, device=dev)[None, None, :, None], torch.arange(N, device=dev)[None, None, None, :]
    if score_mod is not None:
        s_all = score_mod(s_all, b, h, qi, ki)
    if mask_mod is not None:
        s_all = s_all.masked_fill(~torch.broadcast_to(mask_mod(b, h, qi, ki), s_all.shape), float("-inf"))
    acc = torch.zeros(B, H, M, v8.shape[-1], dtype=torch.float64, device=dev)
    run_max = torch.full((B, H, M, 1), float("-inf"), dtype=torch.float64, device=dev)
    row_sum = torch.zeros(B, H, M, 1, dtype=torch.float64, device=dev)
    block_n = ops.recipe.block_n
    for start in range(0, N, tile):
        s = s_all[..., start:start + tile]
        new_max = torch.maximum(run_max, s.amax(-1, keepdim=True))
        base = torch.where(new_max == float("-inf"), 0.0, new_max)
        alpha = torch.exp(run_max - base)
        e = torch.exp(s - base)
        blk = start // block_n if block_n else 0
        fold = torch.clamp(256.0 * vs[..., blk, None, None] / vs_max, max=256.0)
        acc = acc * alpha + round_e4m3(e * fold) @ v8[..., start:start + tile, :]
        row_sum = row_sum * alpha + e.sum(-1, keepdim=True)
        run_max = new_max
    return acc * (vs_max / 256.0) / torch.where(row_sum == 0, 1.0, row_sum)


def _check_gpu(q, k, v, recipe, score_mod=None, mask_mod=None, enable_gqa=False):
    from fa3_inductor import flex, last_template
    from fa3_inductor.templates.fp8_prologue.host import quantize
    from fa3_inductor.templates.fp8_prologue.reference import dequantize
    from reference import FP8_TOLERANCE, reference_attention, rel_error

    D = q.shape[-1]
    with torch.no_grad():
        out, lse = flex(q, k, v, score_mod=score_mod, mask_mod=mask_mod, fp8=recipe, enable_gqa=enable_gqa,
                        return_lse=True)
    torch.cuda.synchronize()
    assert last_template() == "hopper_fp8"
    assert out.dtype == q.dtype and out.shape == q.shape[:3] + (v.shape[-1],)
    assert torch.isfinite(out).all()
    ops = quantize(q, k, v, recipe)   # the GPU prologue is deterministic: the operands flex() used
    # float64 on the GPU: the mods' captured tensors live there
    ref, ref_lse = reference_attention(*dequantize(ops), score_mod, mask_mod, scale=D ** -0.5)
    err = rel_error(out, ref)
    assert err < FP8_TOLERANCE, f"relative error {err:.3g} against the dequantized reference"
    # LSE from the unrounded P (fp32, log units): -inf exactly on rows without keys
    lse, ref_lse = lse.double(), ref_lse.double()
    empty = ref_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), empty)
    assert torch.allclose(lse[~empty], ref_lse[~empty], atol=2e-3, rtol=1e-4)
    if mask_mod is not None:
        # a block mask's tiles run partial blocks first, then full ones: P's rounding follows that order's
        # running max, which the in-order emulation does not model
        return
    emu = _emulated(ops, D ** -0.5, get_fp8_config(D).block_n, score_mod)
    emu_err = rel_error(out, emu)
    # bf16 output rounding and e4m3 ties that fp32 and float64 round apart (the generic kernel: 4e-3,
    # test_fp8_forward); a generated score_mod's tanh is tanh.approx.f32 (relative error 2^-11). This
    # kernel measured 5.0e-3 to 8.8e-3 without a mod on an H100 (2026-11-25): more than the generic
    # kernel's, cause not yet found (docs/fp8.md, "Not yet"); 1e-2 still catches a wrong scale or tile.
    limit = 1e-2
    assert emu_err < limit, f"relative error {emu_err:.3g} against the emulation of the kernel's arithmetic"


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("mod", ["noop", "causal", "softcap"])
@pytest.mark.parametrize("qk", ["int8", "e4m3"])
def test_hopper_fp8_matches_reference(hopper_fp8_first, D, mod, qk):
    from fa3_inductor import mods

    q, k, v = _gpu_inputs(2, 4, 4, 1000, 1000, D, seed=D)   # ragged: 1000 = 7 x 128 + 104
    score_mod = mods.softcap(30.0) if mod == "softcap" else None
    mask_mod = mods.causal if mod == "causal" else None
    _check_gpu(q, k, v, _recipe(two_level=0 if D in UNSERVED_TWO_LEVEL else 1, qk=qk), score_mod, mask_mod)


@pytest.mark.gpu
@pytest.mark.parametrize("two_level", [1, 0])
@pytest.mark.parametrize("M,N", [(1000, 1000), (1, 333), (257, 4096), (384, 128)])
def test_hopper_fp8_gqa_and_ragged_lengths(hopper_fp8_first, two_level, M, N):
    q, k, v = _gpu_inputs(2, 8, 2, M, N, 128, seed=M + N)
    v[:, :, 128:256] *= 30.0   # a V block far above the others: its scale folds into P's shift
    _check_gpu(q, k, v, _recipe(two_level=two_level), enable_gqa=True)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_hopper_fp8_block_sparse_mask_mod(hopper_fp8_first, D):
    """A mask_mod with a block mask of partial and full blocks (document ids read from a captured tensor, inside
    a sliding window), with GQA."""
    from fa3_inductor import mods

    N = 1500
    docs = (torch.arange(N, device="cuda") // 400).to(torch.int32)
    mask_mod = mods.and_masks(mods.document(docs), mods.sliding_window(512))
    q, k, v = _gpu_inputs(1, 4, 2, N, N, D, seed=7)
    _check_gpu(q, k, v, _recipe(), mask_mod=mask_mod, enable_gqa=True)


@pytest.mark.gpu
def test_hopper_fp8_kv_affine_score_mod(hopper_fp8_first):
    """ALiBi runs as column / tile / row parts (KV_AFFINE), the dequantization folded into the column FFMA."""
    from fa3_inductor import mods

    q, k, v = _gpu_inputs(2, 4, 4, 700, 900, 128, seed=3)
    _check_gpu(q, k, v, _recipe(), score_mod=mods.alibi(4), mask_mod=mods.causal)


@pytest.mark.gpu
@pytest.mark.parametrize("D,N", [(128, 200), (128, 1000), (256, 300)])
def test_hopper_fp8_int8_scores_at_the_range_ends(hopper_fp8_first, D, N):
    """int8 Q / K whose every entry is +-127 (no rotation, rows of +-1): Q8·K8 = +-D·127^2, the ends of the range
    that fwd_sm90._s32_to_f32 converts (2^22 bounds it for D <= 256); two KV tiles, several, and D=256."""
    g = torch.Generator().manual_seed(D + N)
    sign = lambda n: (torch.randint(0, 2, (n, 1), generator=g) * 2 - 1).float()   # noqa: E731
    q = (sign(2 * 4 * 333).view(2, 4, 333, 1) * torch.ones(D)).to(torch.bfloat16).cuda()
    k = (sign(2 * 4 * N).view(2, 4, N, 1) * torch.ones(D)).to(torch.bfloat16).cuda()
    v = torch.randn(2, 4, N, D, generator=g).to(torch.bfloat16).cuda()
    recipe = FP8Recipe(qk="int8", hadamard=False, two_level=0 if D in UNSERVED_TWO_LEVEL else 1)
    _check_gpu(q, k, v, recipe)


@pytest.mark.gpu
def test_hopper_fp8_per_head_scales(hopper_fp8_first):
    q, k, v = _gpu_inputs(1, 2, 2, 640, 640, 128, seed=11)
    _check_gpu(q, k, v, _recipe(block_m=0, block_n=0))


@pytest.mark.gpu
def test_hopper_fp8_d256_two_level_falls_through_to_fp8(hopper_fp8_first):
    from fa3_inductor import flex, last_template

    q, k, v = _gpu_inputs(1, 2, 2, 256, 256, 256, seed=1)
    with torch.no_grad():
        flex(q, k, v, fp8=_recipe(two_level=1))
    assert last_template() == "fp8"
