"""Every pointwise op users write in mods, in the three dialects, against torch's semantics.

Each mod is generated for ``tl`` (run on a 16 x 32 grid of positions by Triton's interpreter),
``torch`` (the dense CPU backward's dialect, run on the same grid) and ``gl`` (compiled for sm90
in the ``-m sm90_compile`` session, with the tl one, by a tiny kernel), and compared with the mod
itself run by torch on the same float32 scores and int32 positions. What the generator cannot
express must raise UnsupportedMod with a message, never a compile error or a wrong number.
"""

from __future__ import annotations

import math

import pytest
import torch

from fa3_inductor.templates.modgen import (BufferSpec, UnsupportedMod, generate_mod_source,
                                           kernel_score_mod, load_mod, trace_mod)
from fa3_inductor.templates.modgen_torch import generate_torch_mod_source, load_torch_mod

M, N, H = 16, 32, 3            # grid of positions; the head index the mods see
_TABLE = torch.randn(4, 48)
_BIAS16 = torch.randn(4).to(torch.float16)
_BIAS_BF16 = torch.randn(4).to(torch.bfloat16)
_DOC64 = torch.arange(64, dtype=torch.int64) // 5
_KEEP = torch.rand(64) < 0.5
_SCALAR = torch.tensor(1.25)
_ONE = torch.tensor([0.5])
_PAD = (torch.arange(64) % 5 != 3).long()     # transformers' padding mask: 1 keeps, 0 drops
HEADS = 8

SCORE_MODS = {
    # pow: a Python number ** a tensor (ALiBi as users write it), every base sign, 0 ** x
    "alibi_scalar_base": lambda s, b, h, q, kv: s + (kv - q) * (2.0 ** (-(h + 1) * 8.0 / HEADS)),
    "half_pow_score": lambda s, b, h, q, kv: 0.5 ** s,
    "int_base_float_exp": lambda s, b, h, q, kv: 3 ** torch.clamp(s, -3, 2),
    "ten_pow": lambda s, b, h, q, kv: s + 10.0 ** (h * 0.5 - 1),
    "negative_base_int_exp": lambda s, b, h, q, kv: s + (-2.0) ** (kv % 4),
    "negative_base_float_exp": lambda s, b, h, q, kv: (-1.5) ** torch.floor(s),
    "negative_base_fraction": lambda s, b, h, q, kv: (-1.5) ** s,           # nan but at integers
    "zero_base": lambda s, b, h, q, kv: s + 0.0 ** (q % 3),
    "zero_base_score": lambda s, b, h, q, kv: 0.0 ** s,
    "int_pow_int_tensor": lambda s, b, h, q, kv: s + 2 ** (kv % 5),
    # pow: a tensor ** a Python number
    "square": lambda s, b, h, q, kv: s ** 2,
    "cube_negative": lambda s, b, h, q, kv: (s - 1) ** 3,
    "reciprocal": lambda s, b, h, q, kv: s ** -1,
    "inverse_square": lambda s, b, h, q, kv: (s + 3) ** -2,
    "zeroth": lambda s, b, h, q, kv: s + s ** 0,
    "sqrt_pow": lambda s, b, h, q, kv: s ** 0.5,                               # nan below 0
    "rsqrt_pow": lambda s, b, h, q, kv: torch.abs(s) ** -0.5,
    "fractional": lambda s, b, h, q, kv: torch.abs(s) ** 1.7,
    "int_squared": lambda s, b, h, q, kv: s + (q - kv) ** 2,
    "int_cubed": lambda s, b, h, q, kv: s + ((q - kv) ** 3) * 1e-3,
    "int_base_half": lambda s, b, h, q, kv: s + q ** 0.5,
    # pow: tensor ** tensor
    "float_pow_int_tensor": lambda s, b, h, q, kv: s ** (kv % 3),
    "int_pow_bounded_int": lambda s, b, h, q, kv: s + (q - kv) ** (h % 3),
    "abs_pow_score": lambda s, b, h, q, kv: torch.abs(s) ** s,
    "pow_pow": lambda s, b, h, q, kv: torch.pow(s, s),                         # negative bases: nan
    # division, rounding, int / float mixing
    "int_true_division": lambda s, b, h, q, kv: s + q / (kv + 1),
    "int_division_by_zero": lambda s, b, h, q, kv: q / kv,                     # inf and nan at kv == 0
    "floor_div_negative": lambda s, b, h, q, kv: s + (q - kv) // 3 + (q - kv) // -4,
    "remainder_negative": lambda s, b, h, q, kv: s + (q - kv) % 5 + (kv - q) % -3,
    "div_modes": lambda s, b, h, q, kv: s + torch.div(q - kv, 3, rounding_mode="trunc")
    + torch.div(q - kv, 2.5, rounding_mode="floor"),
    "float_floor_div": lambda s, b, h, q, kv: (s * 4) // 1.5 + (s * 4) % 1.5,
    "float_trunc_div": lambda s, b, h, q, kv: torch.div(s * 4, 1.5, rounding_mode="trunc"),
    "fmod": lambda s, b, h, q, kv: s + torch.fmod(q - kv, 3) + torch.fmod(s, 0.75),
    "floor_of_ints": lambda s, b, h, q, kv: s + torch.floor(q - kv) + torch.ceil(kv),
    "floor_ceil_round": lambda s, b, h, q, kv: torch.floor(s * 3) + torch.ceil(s) + torch.round(s * 2),
    "int_plus_float_literal": lambda s, b, h, q, kv: s * 0.5 + (q - kv) + 0.25,
    "bool_arithmetic": lambda s, b, h, q, kv: s + ((q > kv) + (q < kv)) * 1.5 + (q == kv),
    # unary math, clamps, where
    "unary": lambda s, b, h, q, kv: torch.abs(s) + torch.exp(-s.abs()) + torch.exp2(s * 0.5)
    + torch.log(s.abs() + 1) + torch.log2(s.abs() + 2) + torch.tanh(s) + torch.sigmoid(s),
    "unary_of_ints": lambda s, b, h, q, kv: s + torch.exp(-(q - kv).abs() * 1.0) + torch.sigmoid(q - kv)
    + torch.log2(kv + 1) + torch.abs(q - kv),
    "clamps": lambda s, b, h, q, kv: torch.clamp(s, -1, 1.5) + s.clamp_min(0.25) + s.clamp_max(-0.5),
    "clamp_int_float_bounds": lambda s, b, h, q, kv: s + torch.clamp(q - kv, min=0.5, max=7.5),
    "clamp_int": lambda s, b, h, q, kv: s + torch.clamp(q - kv, -3, 4),
    "where_scalars": lambda s, b, h, q, kv: torch.where(q >= kv, s, -1.0) + torch.where(q > kv, 1, 0.5),
    "where_float_compares": lambda s, b, h, q, kv: torch.where((s > 0) & (q > kv) | (s < -1), s, -s),
    # terms of b / h / kv alone (the Hopper kernel's KV_AFFINE split needs a term of q)
    "head_only_term": lambda s, b, h, q, kv: s + torch.sqrt(torch.abs(h * 3.0)) + _SCALAR,
    "kv_only_term": lambda s, b, h, q, kv: s + kv * 0.01,
    "minimum_maximum": lambda s, b, h, q, kv: torch.minimum(s, q * 0.1) + torch.maximum(s, kv * 0.05),
    # gathers from captured tensors
    "table_negative_index": lambda s, b, h, q, kv: s + _TABLE[h, q - kv],
    "table_chained": lambda s, b, h, q, kv: s + _TABLE[h][(q - kv) % 48],
    "table_clamped": lambda s, b, h, q, kv: s + _TABLE[h, torch.clamp(kv - q + 20, 0, 47)],
    "half_buffers": lambda s, b, h, q, kv: s + _BIAS16[h] + _BIAS_BF16[h] * 2,
    "int64_buffer": lambda s, b, h, q, kv: s + _DOC64[q] * 0.5 - _DOC64[kv],
    "bool_buffer": lambda s, b, h, q, kv: torch.where(_KEEP[kv], s, s * 0.5),
    "zero_dim_capture": lambda s, b, h, q, kv: s * _SCALAR,
    "select_capture": lambda s, b, h, q, kv: s + _ONE[0] + _TABLE[1, 5],
    # transformers' additive padding mask: finfo.min over sm_scale overflows to -inf
    "finfo_min_padding": lambda s, b, h, q, kv: s + (1.0 - _PAD[kv].float()) * torch.finfo(torch.float32).min,
}

MASK_MODS = {
    "document_int64": lambda b, h, q, kv: _DOC64[q] == _DOC64[kv],
    "bool_buffer": lambda b, h, q, kv: _KEEP[kv] | (q == kv),
    "floor_div_blocks": lambda b, h, q, kv: (q // 4) == (kv // 4),
    "negative_remainder": lambda b, h, q, kv: ((q - kv) % -3) == -1,
    "bool_sum": lambda b, h, q, kv: (q > kv) + (kv % 3 == 0),
    "bool_product": lambda b, h, q, kv: (q >= kv) * (kv % 2 == 0),
    "head_only": lambda b, h, q, kv: h % 2 == 1,
    "float_compare": lambda b, h, q, kv: q * 0.5 >= kv * 0.25,
    "int_pow_compare": lambda b, h, q, kv: (kv % 4) ** 2 < q,
    # float comparisons combined with & | ~ (Triton's interpreter keeps their data in float)
    "float_compares_combined": lambda b, h, q, kv: ((_BIAS16[h] > 0) & (q >= kv)) | ~(q * 0.5 > kv),
}

# (An int to a negative int literal power, or an int // 0, is refused by torch itself while tracing.)
REFUSED = {
    "int_pow_unbounded_exponent": (lambda s, b, h, q, kv: s + 2 ** (q - kv), "negative integer powers"),
    "infinite_exponent": (lambda s, b, h, q, kv: s ** float("inf"), "finite"),
    "whole_buffer": (lambda s, b, h, q, kv: s + _TABLE[h].sum(), "index every dimension"),
    "whole_buffer_value": (lambda s, b, h, q, kv: s + _TABLE * 1.0, "as a whole"),
    "unknown_op": (lambda s, b, h, q, kv: torch.atan2(s, s + 1), "aten.atan2"),
}


def _positions():
    q = torch.arange(M, dtype=torch.int32)[:, None]
    kv = torch.arange(N, dtype=torch.int32)[None, :]
    return q, kv


def _scores(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(M, N, generator=g) * 2
    s[0, :4] = torch.tensor([0.0, 1.0, -2.0, 3.0])   # integers: the special cases of pow
    return s


def _expected(fn, kind, score):
    q, kv = _positions()
    b, h = torch.tensor(0, dtype=torch.int32), torch.tensor(H, dtype=torch.int32)
    out = fn(score, b, h, q, kv) if kind == "score" else fn(b, h, q, kv)
    return torch.broadcast_to(torch.as_tensor(out), (M, N))


def _compare(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if want.dtype is torch.bool:
        assert torch.equal(got.bool(), want), what
        return
    got, want = got.double(), want.double()
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: nan at {(got.isnan() != want.isnan()).nonzero()[:5].tolist()}"
    assert torch.equal(got.isinf(), want.isinf()), f"{what}: inf at {(got.isinf() != want.isinf()).nonzero()[:5].tolist()}"
    finite = want.isfinite()
    assert torch.equal(got[~finite & ~want.isnan()], want[~finite & ~want.isnan()]), f"{what}: infinities' signs"
    torch.testing.assert_close(got[finite], want[finite], rtol=3e-5, atol=3e-5, msg=lambda m: f"{what}: {m}")


def _generated(fn, kind, dialect):
    gm, bufs = trace_mod(fn, kind)
    return generate_mod_source(gm, kind, [BufferSpec.of(t) for t in bufs], dialect), bufs


def _run_tl(fn, kind, score):
    import triton
    import triton.language as tl

    src, bufs = _generated(fn, kind, "tl")
    mod = load_mod(src, "tl")

    @triton.jit
    def score_grid(out_ptr, qk_ptr, sm_scale, factor, b, h, bufs, M: tl.constexpr, N: tl.constexpr,
                   SCORE_MOD: tl.constexpr):
        q = tl.arange(0, M)[:, None]
        kv = tl.arange(0, N)[None, :]
        qk = tl.load(qk_ptr + q * N + kv)
        tl.store(out_ptr + q * N + kv, SCORE_MOD(qk, sm_scale, b, h, q, kv, bufs) * factor)

    @triton.jit
    def mask_grid(out_ptr, b, h, bufs, M: tl.constexpr, N: tl.constexpr, MASK_MOD: tl.constexpr):
        q = tl.arange(0, M)[:, None]
        kv = tl.arange(0, N)[None, :]
        keep = MASK_MOD(b, h, q, kv, bufs)
        tl.store(out_ptr + q * N + kv, (keep & (q >= 0) & (kv >= 0)).to(tl.int8))

    if kind == "score":
        launched, factor = kernel_score_mod(mod, 1.0)   # sm_scale 1: the tile is the score itself
        out = torch.empty(M, N)
        score_grid[(1,)](out, score.contiguous(), 1.0, factor, 0, H, tuple(bufs), M=M, N=N,
                         SCORE_MOD=launched)
        return out
    out = torch.empty(M, N, dtype=torch.int8)
    mask_grid[(1,)](out, 0, H, tuple(bufs), M=M, N=N, MASK_MOD=mod)
    return out.bool()


def _run_torch(fn, kind, score):
    gm, bufs = trace_mod(fn, kind)
    src = generate_torch_mod_source(gm, kind, [BufferSpec.of(t) for t in bufs])
    mod = load_torch_mod(src)
    q, kv = _positions()
    b, h = torch.tensor(0, dtype=torch.int32), torch.tensor(H, dtype=torch.int32)
    out = mod(score, b, h, q, kv, tuple(bufs)) if kind == "score" else mod(b, h, q, kv, tuple(bufs))
    return torch.broadcast_to(torch.as_tensor(out), (M, N))


@pytest.mark.parametrize("name", list(SCORE_MODS))
def test_score_op_in_tl_matches_torch(name, cpu_kernels):
    score = _scores()
    _compare(_run_tl(SCORE_MODS[name], "score", score), _expected(SCORE_MODS[name], "score", score), name)


@pytest.mark.parametrize("name", list(MASK_MODS))
def test_mask_op_in_tl_matches_torch(name, cpu_kernels):
    _compare(_run_tl(MASK_MODS[name], "mask", None), _expected(MASK_MODS[name], "mask", None), name)


@pytest.mark.parametrize("name", list(SCORE_MODS) + [f"mask:{n}" for n in MASK_MODS])
def test_op_in_torch_dialect_matches_torch(name):
    kind, fn = ("mask", MASK_MODS[name[5:]]) if name.startswith("mask:") else ("score", SCORE_MODS[name])
    score = _scores() if kind == "score" else None
    _compare(_run_torch(fn, kind, score), _expected(fn, kind, score), name)


@pytest.mark.parametrize("name", list(REFUSED))
@pytest.mark.parametrize("dialect", ["tl", "gl", "torch"])
def test_unsupported_forms_are_refused_with_a_reason(name, dialect):
    fn, message = REFUSED[name]
    if dialect == "torch" and name == "whole_buffer_value":
        pytest.skip("the torch dialect is given buffer dtypes only; the kernel dialects refuse "
                    "this mod, so its site never reaches the torch dialect")
    gm, bufs = trace_mod(fn, "score")
    specs = [BufferSpec.of(t) for t in bufs]
    with pytest.raises(UnsupportedMod, match=message):
        if dialect == "torch":
            generate_torch_mod_source(gm, "score", specs)
        else:
            generate_mod_source(gm, "score", specs, dialect)


def test_scalar_base_pow_is_one_exp2_in_every_kernel_dialect():
    # 2.0 ** x is exp2(x); c ** x is exp2(x * log2(c)) with log2(c) folded in; both per head only
    # in ALiBi, which stays KV_AFFINE (the Hopper kernel's column / tile / row split).
    for dialect in ("tl", "gl"):
        src, _ = _generated(SCORE_MODS["alibi_scalar_base"], "score", dialect)
        assert f"{dialect}.exp2(" in src and "H.pow" not in src, src
        assert src.info.kv_affine, src
        ten, _ = _generated(SCORE_MODS["ten_pow"], "score", dialect)
        assert f" * {math.log2(10.0)!r})" in ten, ten
    gm, bufs = trace_mod(SCORE_MODS["alibi_scalar_base"], "score")
    assert "T.pow(2.0, " in generate_torch_mod_source(gm, "score", [BufferSpec.of(t) for t in bufs])


def test_integer_powers_are_exact_products():
    src, _ = _generated(SCORE_MODS["int_squared"], "score", "tl")
    assert "H.pow" not in src and "exp2" not in src and "* v" in src, src


def test_alibi_written_with_a_scalar_base_runs_through_flex(our_kernels):
    """The user's spelling of ALiBi (a Python float ** a tensor) runs on our kernel and matches."""
    import fa3_inductor
    from reference import TOLERANCE, reference_attention, rel_error

    heads = 4

    def alibi(s, b, h, q_idx, kv_idx):
        return s + (kv_idx - q_idx) * (2.0 ** (-(h + 1) * 8.0 / heads))

    q, k, v = (torch.randn(1, heads, 37, 32) for _ in range(3))
    out = fa3_inductor.flex(q, k, v, score_mod=alibi)
    assert fa3_inductor.last_template() in ("generic", "hopper")
    ref, _ = reference_attention(q, k, v, score_mod=alibi)
    assert rel_error(out, ref) <= TOLERANCE[torch.float32]


def test_finfo_min_padding_mask_through_flex_has_no_nan(our_kernels):
    """`(1 - m) * finfo.min` (transformers' padding mask in score_mod form) folded into qk units:
    finfo.min / sm_scale is -inf, and -inf times the kept entries' 0 was NaN on every row."""
    import fa3_inductor
    from reference import TOLERANCE, reference_attention, rel_error

    q, k, v = (torch.randn(2, 4, 16, 16) for _ in range(3))
    keep = torch.ones(2, 16, dtype=torch.long)
    keep[1, 5:] = 0

    def padding(s, b, h, q_idx, kv_idx):
        return s + (1.0 - keep[b, kv_idx].to(torch.float32)) * torch.finfo(torch.float32).min

    out = fa3_inductor.flex(q, k, v, score_mod=padding)
    assert not out.isnan().any()
    ref, _ = reference_attention(q, k, v, score_mod=padding)
    assert rel_error(out, ref) <= TOLERANCE[torch.float32]


# ---- sm90: the same mods compile (not only interpret) in the tl and gl dialects ----

def _compile_grid(fn, dialect):
    """Compile a one-tile kernel calling the generated mod for sm90; returns the PTX."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    import triton
    import triton.language as tl

    from fa3_inductor.templates.aot import compile_launch

    src, bufs = _generated(fn, "score", dialect)
    mod, _ = kernel_score_mod(load_mod(src, dialect), 0.125)
    if dialect == "tl":
        @triton.jit
        def grid(out_ptr, qk_ptr, sm_scale, b, h, bufs, M: tl.constexpr, N: tl.constexpr,
                 SCORE_MOD: tl.constexpr):
            q = tl.arange(0, M)[:, None]
            kv = tl.arange(0, N)[None, :]
            qk = tl.load(qk_ptr + q * N + kv)
            tl.store(out_ptr + q * N + kv, SCORE_MOD(qk, sm_scale, b, h, q, kv, bufs))
    else:
        @gluon.jit
        def grid(out_ptr, qk_ptr, sm_scale, b, h, bufs, M: gl.constexpr, N: gl.constexpr,
                 SCORE_MOD: gl.constexpr):
            layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])
            q = gl.arange(0, M, layout=gl.SliceLayout(1, layout))[:, None]
            kv = gl.arange(0, N, layout=gl.SliceLayout(0, layout))[None, :]
            qk = gl.load(qk_ptr + q * N + kv)
            gl.store(out_ptr + q * N + kv, SCORE_MOD(qk, sm_scale, b, h, q, kv, bufs))

    out, qk = torch.empty(M, N), torch.empty(M, N)
    ck = compile_launch(grid, (out, qk, 0.125, 0, H, tuple(bufs)),
                        dict(M=M, N=N, SCORE_MOD=mod, num_warps=4))
    return ck.asm["ptx"]


_COMPILED = ["alibi_scalar_base", "half_pow_score", "negative_base_int_exp", "negative_base_float_exp",
             "zero_base", "int_pow_int_tensor", "cube_negative", "reciprocal", "zeroth", "sqrt_pow",
             "fractional", "int_squared", "float_pow_int_tensor", "int_pow_bounded_int", "pow_pow",
             "float_floor_div", "float_trunc_div", "floor_of_ints", "bool_arithmetic", "clamp_int_float_bounds",
             "where_scalars", "table_negative_index", "table_chained", "half_buffers", "bool_buffer",
             "zero_dim_capture", "select_capture", "finfo_min_padding"]


@pytest.mark.sm90_compile
@pytest.mark.parametrize("name", _COMPILED)
@pytest.mark.parametrize("dialect", ["tl", "gl"])
def test_generated_ops_compile_for_sm90(name, dialect):
    assert ".entry" in _compile_grid(SCORE_MODS[name], dialect)


@pytest.mark.sm90_compile
@pytest.mark.parametrize("name", ["alibi_scalar_base", "head_only_term", "kv_only_term"])
def test_score_terms_compile_into_the_hopper_kernel(name):
    """ALiBi with a scalar base (failed to compile before), and additive terms that vary along
    neither index or kv only (flagged KV_AFFINE before, which the kernel's row part cannot sum)."""
    from fa3_inductor.templates.aot import sass_report
    from fa3_inductor.templates.hopper import compile_sm90

    src, bufs = _generated(SCORE_MODS[name], "score", "gl")
    q = torch.randn(1, HEADS, 256, 128, dtype=torch.bfloat16)
    k = v = torch.randn(1, HEADS, 256, 128, dtype=torch.bfloat16)
    ck = compile_sm90(q, k, v, torch.empty_like(q), torch.empty(1, HEADS, 256), torch.empty(1, HEADS, 256),
                      sm_scale=0.088, score_mod=load_mod(src, "gl"), score_bufs=tuple(bufs))
    assert sass_report(ck).hgmma > 0
