"""FP8 forward: ``flex(..., fp8=...)`` through the prologue and the fp8 family (the generic kernel with
its Quant bundle), under Triton's interpreter; its sm90 compile; the front door's checks.

Q and K reach the kernel as int8 (FP8Recipe's default, QKᵀ an s8 MMA with int32 sums) or e4m3
(qk="e4m3", FlashAttention-3's form); the tests that look at the arithmetic run both. References are
float64 attention on the *dequantized* operands (exactly what the kernel was given); the kernel adds
one rounding the reference lacks, P to e4m3 (3 mantissa bits), so two rules apply:
- the float64 emulation of the kernel's arithmetic, that rounding included (``_emulated``), must
  match to bf16 output rounding;
- the dequantized reference, below FP8_REL: P's rounding is up to 2^-4 per element (about 3.6%
  RMS), and it does not average out relative to an output that is itself an average over random
  values (measured 3-7% here on N(0,1) inputs; cosine to bf16 0.9985 on the GPU).
"""

from __future__ import annotations

import pytest
import torch

from fa3_inductor import FP8Recipe, flex, last_template, mods
from fa3_inductor.templates.fp8_prologue.host import quantize
from fa3_inductor.templates.fp8_prologue.reference import dequantize, quantize_reference, round_e4m3
from reference import FP8_TOLERANCE as FP8_REL
from reference import reference_attention, rel_error


def _inputs(B, H, HKV, M, N, D, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g).to(dtype)
                 for shape in ((B, H, M, D), (B, HKV, N, D), (B, HKV, N, D)))


def _dequantized_reference(q, k, v, recipe, score_mod=None, mask_mod=None):
    # the operands flex() hands the kernel (the prologue has tests of its own: test_fp8_prologue.py)
    dq, dk, dv = dequantize(quantize(q, k, v, recipe))
    return reference_attention(dq, dk, dv, score_mod, mask_mod, scale=q.shape[-1] ** -0.5)


@pytest.mark.parametrize("qk", ["int8", "e4m3"])
@pytest.mark.parametrize("two_level", [1, 0])
@pytest.mark.parametrize("B,H,HKV,M,N,D", [(1, 2, 2, 100, 130, 64), (2, 4, 2, 64, 200, 32),
                                           (1, 2, 1, 1, 77, 128)])
def test_fp8_matches_dequantized_reference(cpu_kernels, qk, two_level, B, H, HKV, M, N, D):
    q, k, v = _inputs(B, H, HKV, M, N, D)
    recipe = FP8Recipe(block_m=64, block_n=64, two_level=two_level, qk=qk)
    out, lse = flex(q, k, v, fp8=recipe, enable_gqa=H != HKV, return_lse=True)
    assert last_template() in ("fp8", "hopper_fp8")
    assert out.dtype == torch.bfloat16 and out.shape == (B, H, M, D)
    ref, ref_lse = _dequantized_reference(q, k, v, recipe)
    assert rel_error(out, ref) < FP8_REL
    # LSE is computed from the unrounded P: float32 accuracy
    assert torch.allclose(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


def _emulated(q, k, v, recipe):
    """The kernel's arithmetic in float64: the online softmax over KV tiles (the interpreter's 64
    keys, or the recipe's smaller scale block), S from the int8 / e4m3 operands and their scales
    (exact products and sums: the kernel's int32 or fp32 dot is exact on them at these D), each
    tile's P rounded to e4m3 as round(2^8 exp(s - running max) vs / vs_max), the row sum from the
    unrounded P."""
    block_n = min(64, recipe.block_n or 64)
    ops = quantize(q, k, v, recipe)
    dq, dk, _ = (t.double() for t in dequantize(ops))
    group = q.shape[1] // k.shape[1]
    dk = dk.repeat_interleave(group, 1)
    v8 = ops.vt.double()[..., :k.shape[2]].transpose(-1, -2).repeat_interleave(group, 1)
    vs = ops.v_scale.double().repeat_interleave(group, 1)
    vs_max = ops.v_scale_max.double().repeat_interleave(group, 1)[..., None, None]
    s_all = dq @ dk.transpose(-1, -2) * q.shape[-1] ** -0.5
    B, H, M, N = s_all.shape
    acc = torch.zeros(B, H, M, v8.shape[-1], dtype=torch.float64)
    run_max = torch.full((B, H, M, 1), float("-inf"), dtype=torch.float64)
    row_sum = torch.zeros(B, H, M, 1, dtype=torch.float64)
    for start in range(0, N, block_n):
        s = s_all[..., start:start + block_n]
        new_max = torch.maximum(run_max, s.amax(-1, keepdim=True))
        alpha = torch.exp(run_max - new_max)
        e = torch.exp(s - new_max)
        blk = start // recipe.block_n if recipe.block_n else 0
        fold = torch.clamp(256.0 * vs[..., blk, None, None] / vs_max, max=256.0)
        acc = acc * alpha + round_e4m3(e * fold) @ v8[..., start:start + block_n, :]
        row_sum = row_sum * alpha + e.sum(-1, keepdim=True)
        run_max = new_max
    return acc * (vs_max / 256.0) / row_sum


@pytest.mark.parametrize("qk", ["int8", "e4m3"])
@pytest.mark.parametrize("B,H,HKV,M,N,D,block_n", [(1, 2, 2, 40, 64, 64, 64), (1, 2, 1, 70, 200, 64, 64),
                                                   (1, 2, 2, 64, 150, 32, 0), (1, 2, 2, 64, 150, 32, 32)])
def test_fp8_equals_its_float64_emulation(cpu_kernels, qk, B, H, HKV, M, N, D, block_n):
    q, k, v = _inputs(B, H, HKV, M, N, D, seed=3)
    v[:, :, 64:128] *= 30.0   # a V block far above the others: its scale folds into P
    recipe = FP8Recipe(block_m=64, block_n=block_n, qk=qk)
    out = flex(q, k, v, fp8=recipe, enable_gqa=H != HKV)
    emu = _emulated(q, k, v, recipe)
    # bf16 output rounding (2^-9) and rare e4m3 ties that fp32 and float64 round apart
    assert rel_error(out, emu) < 4e-3
    ref, _ = _dequantized_reference(q, k, v, recipe)
    assert rel_error(out, ref) > 3 * rel_error(out, emu)   # the emulation models something real


@pytest.mark.parametrize("qk", ["int8", "e4m3"])
def test_fp8_block_scales_are_applied_per_block(cpu_kernels, qk):
    # One query block and one key block 100x larger than the rest: a wrong scale index (Q rows,
    # K tile, V block folded into P) puts the output off by orders of magnitude.
    q, k, v = _inputs(1, 2, 2, 128, 192, 64, seed=5)
    q[:, :, 64:] *= 100.0
    k[:, :, 64:128] *= 0.01
    v[:, :, 128:] *= 100.0
    recipe = FP8Recipe(block_m=64, block_n=64, qk=qk)
    out = flex(q, k, v, fp8=recipe)
    ref, _ = _dequantized_reference(q, k, v, recipe)
    assert rel_error(out, ref) < FP8_REL


@pytest.mark.parametrize("recipe", [FP8Recipe(block_m=0, block_n=0), FP8Recipe(hadamard=False),
                                    FP8Recipe(smooth_k=True), FP8Recipe(qk="e4m3"),
                                    FP8Recipe(qk="e4m3", smooth_k=True, hadamard=False)])
def test_fp8_recipe_variants(cpu_kernels, recipe):
    q, k, v = _inputs(1, 2, 2, 96, 150, 64, seed=7)
    out = flex(q, k, v, fp8=recipe)
    ref, _ = reference_attention(q, k, v)
    assert rel_error(out, ref) < 0.06   # against the exact inputs: quantization of q, k, v too


@pytest.mark.parametrize("qk", ["int8", "e4m3"])
def test_fp8_smooth_k_returns_the_true_lse(cpu_kernels, qk):
    # K with a large mean: smoothing shifts every row's scores by scale * q.mu (several units here),
    # which the output ignores and the returned LSE must not show (GQA: mu is per KV head).
    q, k, v = _inputs(2, 4, 2, 80, 130, 64, seed=13)
    k = (k.float() + 2.0 * torch.randn(2, 2, 1, 64)).to(k.dtype)
    ref_out, ref_lse = reference_attention(q, k, v, mask_mod=mods.causal)
    lse_error = {}
    for smooth in (True, False):
        out, lse = flex(q, k, v, mask_mod=mods.causal, fp8=FP8Recipe(qk=qk, smooth_k=smooth),
                        return_lse=True, enable_gqa=True)
        assert rel_error(out, ref_out) < 0.07
        lse_error[smooth] = (lse.double() - ref_lse).abs().max().item()
    # as close as without smoothing (e4m3's own LSE error is ~0.2 here, int8's ~0.06); uncorrected, off by units
    assert lse_error[True] < max(0.1, 1.2 * lse_error[False]), lse_error


@pytest.mark.parametrize("qk", ["int8", "e4m3"])
def test_fp8_with_mods_and_block_mask(cpu_kernels, qk):
    # a score_mod reads the dequantized scores (int32 -> fp32 times the scales under int8)
    q, k, v = _inputs(1, 2, 2, 130, 130, 64, seed=11)
    recipe = FP8Recipe(block_m=64, block_n=64, qk=qk)
    score_mod = mods.softcap(20.0)
    out = flex(q, k, v, score_mod=score_mod, mask_mod=mods.causal, fp8=recipe)
    ref, _ = _dequantized_reference(q, k, v, recipe, score_mod, mods.causal)
    assert rel_error(out, ref) < FP8_REL


def test_fp8_accuracy_beats_per_tensor_on_outliers(cpu_kernels):
    # The FlashAttention-3 inputs (N(0,1) + N(0,100)·Bernoulli(0.001)): block scales and the
    # Hadamard rotation must do better than plain per-head e4m3 scales without rotation, and int8
    # Q, K (the default) better than e4m3 ones.
    g = torch.Generator().manual_seed(0)

    def outliers(*shape):
        x = torch.randn(*shape, generator=g)
        return (x + 10 * torch.randn(*shape, generator=g) * (torch.rand(*shape, generator=g) < 0.001))

    q, k, v = (outliers(1, 2, 256, 64).to(torch.bfloat16) for _ in range(3))
    ref, _ = reference_attention(q, k, v)
    ours = rel_error(flex(q, k, v, fp8=FP8Recipe(block_m=64, block_n=64)), ref)
    fa3 = rel_error(flex(q, k, v, fp8=FP8Recipe(block_m=64, block_n=64, qk="e4m3")), ref)
    plain = rel_error(flex(q, k, v, fp8=FP8Recipe(hadamard=False, block_m=0, block_n=0, qk="e4m3")), ref)
    assert ours < fa3 < plain


def test_int8_scores_are_finer_than_e4m3(cpu_kernels):
    """The reason for the default (docs/fp8_accuracy.md, "Error budget on real activations"): on
    rotated Gaussian-like rows, int8 Q and K with amax/127 block scales give scores several times
    closer to the exact ones than e4m3's 3-bit mantissa."""
    q, k, v = _inputs(1, 2, 2, 128, 128, 64, seed=13)
    exact = q.double() @ k.double().mT
    err = {}
    for qk in ("int8", "e4m3"):
        dq, dk, _ = dequantize(quantize(q, k, v, FP8Recipe(block_m=64, block_n=64, qk=qk)))
        err[qk] = ((dq.double() @ dk.double().mT - exact).norm() / exact.norm()).item()
    assert err["int8"] * 2 < err["e4m3"], err


def test_interpreter_int8_dot_is_exact():
    """The kernel's int8 QKᵀ under Triton's interpreter: s8·s8 -> s32 exact up to |sum| = D·127²
    (its bf16 dots are wrong in 3.6, its e4m3 dots right: docs/fp8.md, interpreter quirks). Runs
    in any session: it launches a kernel of its own only under the interpreter."""
    from triton import knobs

    if not knobs.runtime.interpret:
        pytest.skip("checks Triton's interpreter (TRITON_INTERPRET=1)")
    import triton
    import triton.language as tl

    @triton.jit
    def dot_kernel(A, B, C, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        a = tl.load(A + tl.arange(0, M)[:, None] * K + tl.arange(0, K)[None, :])
        b = tl.load(B + tl.arange(0, N)[:, None] * K + tl.arange(0, K)[None, :])
        c = tl.dot(a, tl.trans(b), out_dtype=tl.int32).to(tl.float32)
        tl.store(C + tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :], c)

    g = torch.Generator().manual_seed(0)
    for K in (64, 256):
        a = torch.randint(-127, 128, (32, K), generator=g, dtype=torch.int8)
        b = torch.randint(-127, 128, (16, K), generator=g, dtype=torch.int8)
        a[0], b[0], a[1] = 127, 127, -127              # the extremes: +-K * 127^2
        c = torch.empty(32, 16)
        dot_kernel[(1,)](a, b, c, 32, 16, K)
        assert torch.equal(c.double(), (a.double() @ b.double().T)), K


def test_fp8_errors():
    q, k, v = _inputs(1, 2, 2, 16, 16, 32)
    with pytest.raises(NotImplementedError, match="inference-only"):
        flex(q.requires_grad_(), k, v, fp8=True)
    q = q.detach()
    with pytest.raises(ValueError, match="pass fp8=True"):
        from fa3_inductor import RopeSpec

        flex(q, k, v, rope=RopeSpec(torch.ones(16, 32), torch.zeros(16, 32)))
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        flex(q.float(), k.float(), v.float(), fp8=True)
    with pytest.raises(ValueError, match="smooth_k"):
        flex(q, k, v, score_mod=mods.softcap(5.0), fp8=FP8Recipe(smooth_k=True))
    with pytest.raises(TypeError, match="fp8 must be"):
        flex(q, k, v, fp8="yes")
    with pytest.raises(ValueError, match="FP8Recipe.qk must be"):
        FP8Recipe(qk="int4")
    # the emulation's intervals: no kernel adds PV into fp32 every few tiles, so the front door says so
    with pytest.raises(ValueError, match=r"two_level=3\).*Pass two_level=1 or 0"):
        flex(q, k, v, fp8=FP8Recipe(two_level=3))


def test_fp8_kernel_refuses_operands_of_another_format():
    """Operands quantized for one Q/K format handed to the kernel under the other: a clear error
    before any launch (an int8 tensor read as e4m3 would give wrong scores silently)."""
    from fa3_inductor.templates.generic.host import prepare_generic

    q, k, v = _inputs(1, 2, 2, 64, 64, 64)
    ops = quantize_reference(q, k, v, FP8Recipe(qk="e4m3"))
    ops.recipe = FP8Recipe()
    out, lse, mx = torch.empty_like(q), torch.empty(1, 2, 64), torch.empty(1, 2, 64)
    with pytest.raises(ValueError, match="needs q, k as torch.int8"):
        prepare_generic(ops.q, ops.k, ops.vt, out, lse, mx, sm_scale=0.125, fp8=ops)


@pytest.mark.sm90_compile
@pytest.mark.parametrize("qk", ["int8", "e4m3"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_fp8_kernel_compiles_to_s8_and_e4m3_wgmma_without_spills(D, qk):
    """QKᵀ an s8 wgmma into s32 (qk="int8") or an e4m3 one into f32; PV an e4m3 wgmma either way;
    no spills (sm90, the fp8 family's tiles). Registers per thread (triton 3.6): int8 128 / 208 /
    195 at D 64 / 128 / 256, e4m3 128 / 178 / 180 (the int32 scores and their fp32 copy)."""
    import re

    from fa3_inductor.templates.aot import sass_report
    from fa3_inductor.templates.fp8.configs import fp8_config
    from fa3_inductor.templates.generic.host import compile_generic

    q = torch.randn(2, 4, 512, D, dtype=torch.bfloat16)
    k = v = torch.randn(2, 2, 512, D, dtype=torch.bfloat16)
    ops = quantize_reference(q, k, v, FP8Recipe(qk=qk))
    out, lse, mx = torch.empty_like(q), torch.empty(2, 4, 512), torch.empty(2, 4, 512)
    compiled = compile_generic(ops.q, ops.k, ops.vt, out, lse, mx, sm_scale=D ** -0.5, fp8=ops,
                               config=fp8_config(D, (9, 0)))
    ptx = compiled.asm["ptx"]
    kinds = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.(\w+\.\w+\.\w+)", ptx))
    want = {"s32.s8.s8", "f32.e4m3.e4m3"} if qk == "int8" else {"f32.e4m3.e4m3"}
    assert kinds == want, f"wgmma kinds {sorted(kinds)}, want {sorted(want)}"
    r = sass_report(compiled)
    assert r.stack == 0 and r.spill_instructions == 0, f"D={D}: spills, {r.registers} registers"
    if qk == "int8":   # the KV loop: the s8 wgmma, and one int32 -> fp32 conversion per score
        loop = [" ".join(b) for b in r.inner_loops() if "MUFU.EX2" in " ".join(b)]
        assert loop and all("IGMMA" in b and "I2FP.F32.S32" in b for b in loop)


@pytest.mark.gpu
@pytest.mark.parametrize("qk", ["int8", "e4m3"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("mod", ["noop", "causal", "softcap"])
def test_fp8_on_gpu(D, mod, qk):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with e4m3 tensor cores (sm89+)")
    q, k, v = (t.cuda() for t in _inputs(2, 4, 2, 1000, 1000, D, seed=D))
    score_mod = mods.softcap(30.0) if mod == "softcap" else None
    mask_mod = mods.causal if mod == "causal" else None
    recipe = FP8Recipe(qk=qk)
    with torch.no_grad():
        out = flex(q, k, v, score_mod=score_mod, mask_mod=mask_mod, fp8=recipe, enable_gqa=True)
    assert last_template() in ("fp8", "hopper_fp8")
    ops = quantize(q, k, v, recipe)   # the GPU prologue's operands, as flex() used them
    dq, dk, dv = (t.cpu() for t in dequantize(ops))
    ref, _ = reference_attention(dq, dk, dv, score_mod, mask_mod, scale=D ** -0.5)
    assert rel_error(out.cpu(), ref) < FP8_REL


@pytest.mark.gpu
def test_fp8_repeat_calls_relaunch_on_new_inputs():
    """The second and later FP8 calls of one signature re-launch the recorded kernel (runtime/ops.serve's
    launch cache) on the new call's operands and scales: each output matches its own inputs."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with e4m3 tensor cores (sm89+)")
    from fa3_inductor.runtime import fast_launch

    fast_launch.clear()
    recipe = FP8Recipe()
    for seed in range(3):
        q, k, v = (t.cuda() for t in _inputs(1, 4, 4, 300, 300, 128, seed=seed))
        q = q * (seed + 1)   # new scales per call, not only new addresses
        with torch.no_grad():
            out = flex(q, k, v, mask_mod=mods.causal, fp8=recipe)
        ops = quantize(q, k, v, recipe)
        ref, _ = reference_attention(*(t.cpu() for t in dequantize(ops)), None, mods.causal, scale=128 ** -0.5)
        assert rel_error(out.cpu(), ref) < FP8_REL, f"call {seed}"
    assert any(e.tag in ("fp8", "hopper_fp8") for e in fast_launch._CACHE.values()), "the FP8 launch was never recorded"


def _v_scale_max_zero_or_one(q, k, v, recipe, mask_mod):
    """(out, lse) of one FP8 call served twice on the same operands: a KV head of V all zero,
    its v_scale_max 1 (the full path's) then 0 (where runtime/ops_fp8._Workspace's replays leave it)."""
    from fa3_inductor import direct
    from fa3_inductor.runtime import ops_fp8

    v = v.clone()
    v[:, 0] = 0
    from torch.nn.attention.flex_attention import create_block_mask

    bm = create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], device=q.device)
    tables, sq, skv = direct.block_mask_tables(bm)
    spec = direct.cached_plan(q, k, v, None, mask_mod, bm, "auto", fp8=recipe).spec
    results = []
    for value in (1.0, 0.0):
        call = ops_fp8.fp8_call(q, k, v, tables, [], [], q.shape[-1] ** -0.5, sq, skv, recipe)
        assert (call.fp8.v_scale_max[:, 0] == 1).all() and (call.fp8.v_scale_max[:, 1:] != 1).all()
        call.fp8.v_scale_max[:, 0] = value
        ops_fp8.serve_fp8(spec, call)
        results.append((call.out, call.lse))
    return results


@pytest.mark.parametrize("recipe", [FP8Recipe(), FP8Recipe(block_m=64, block_n=64, two_level=1, qk="e4m3")])
def test_an_all_zero_v_head_gives_the_same_bits_for_v_scale_max_zero_or_one(cpu_kernels, recipe):
    """What lets the replays skip v_scale_max's fill and abs (runtime/ops_fp8._Workspace): P's shift is 8
    either way and O a zero."""
    q, k, v = _inputs(1, 4, 2, 100, 130, 64)
    with torch.no_grad():
        (out1, lse1), (out0, lse0) = _v_scale_max_zero_or_one(q, k, v, recipe, mods.causal)
    assert last_template() in ("fp8", "hopper_fp8")
    assert torch.equal(out1, out0) and torch.equal(lse1, lse0)
    assert (out0[:, :2] == 0).all() and torch.isfinite(out0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("qk", ["int8", "e4m3"])
@pytest.mark.parametrize("D", [64, 128])
def test_an_all_zero_v_head_gives_the_same_bits_for_v_scale_max_zero_or_one_on_gpu(D, qk):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with e4m3 tensor cores (sm89+)")
    q, k, v = (t.cuda() for t in _inputs(2, 4, 2, 1000, 1000, D, seed=D))
    for recipe in (FP8Recipe(qk=qk), FP8Recipe(qk=qk, two_level=1)):
        with torch.no_grad():
            (out1, lse1), (out0, lse0) = _v_scale_max_zero_or_one(q, k, v, recipe, mods.causal)
        assert torch.equal(out1, out0) and torch.equal(lse1, lse0), (recipe, last_template())
        assert (out0[:, :2] == 0).all() and torch.isfinite(out0).all()
