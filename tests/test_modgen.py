"""The mod generator: generated source (snapshots), exactness rules, and refusals."""

from __future__ import annotations

import pytest
import torch

# CI installs expecttest (Makefile); the GPU machines lack it, and this file has no GPU test
assert_expected_inline = pytest.importorskip("expecttest").assert_expected_inline

from fa3_inductor import mods
from fa3_inductor.templates.modgen import (BufferSpec, ModInfo, UnsupportedMod, generate_mod_source,
                                           is_constant_true_mask, is_identity_score, trace_mod)


def _source(fn, kind, dialect="tl"):
    gm, bufs = trace_mod(fn, kind)
    return generate_mod_source(gm, kind, [BufferSpec.of(b) for b in bufs], dialect)


def _shown(src) -> str:
    """A snapshot of generated source: the generator's record (its fields other than the defaults), then the text."""
    fields = [f"{k}={v!r}" for k, v in src.info.to_items() if v != getattr(ModInfo(), k)]
    return f"# {', '.join(fields) or 'defaults'}\n{src}"


def test_softcap_uses_the_tanh_helper():
    assert_expected_inline(_shown(_source(mods.softcap(30.0), "score")), """\
# out_scale=30.0, out_range=(-1.0, 1.0), sfu_ops=1, finite=True
@triton.jit
def score_mod(qk, sm_scale, b, h, q_idx, kv_idx, bufs):
    v0 = sm_scale * 0.03333333333333333
    v1 = (qk * v0)
    v2 = H.tanh(v1)
    return v2
""")


def test_alibi_slopes_are_computed_from_the_head_index():
    # Folded as qk + slope' * (kv - q), slope' = slope(h) / sm_scale computed once: one FFMA per score
    # after the index difference. The unfolded twin (for sm_scale <= 0) keeps score = qk * sm_scale.
    assert_expected_inline(_shown(_source(mods.alibi(8), "score", "gl")), """\
# sm_scaled=True, kv_affine=True
@gluon.jit
def score_mod(qk, sm_scale, b, h, q_idx, kv_idx, bufs):
    v0 = (h + 1)
    v1 = h.to(gl.float32)
    v2 = (v1 + 1.0)
    v3 = (v2 * -1.0)
    v4 = gl.exp2(v3)
    v5 = (kv_idx - q_idx)
    v6 = 1.0 / sm_scale
    v7 = gl.minimum(gl.maximum(v4 * v6, -3.4028234663852886e+38), 3.4028234663852886e+38)
    v8 = H.index_to_float(kv_idx)
    v9 = H.index_to_float(q_idx)
    v10 = (v8 - v9)
    v11 = (v7 * v10)
    v12 = (qk + v11)
    return v12


@gluon.jit
def score_mod_unfolded(qk, sm_scale, b, h, q_idx, kv_idx, bufs):
    score = qk * sm_scale
    v0 = (h + 1)
    v1 = h.to(gl.float32)
    v2 = (v1 + 1.0)
    v3 = (v2 * -1.0)
    v4 = gl.exp2(v3)
    v5 = (kv_idx - q_idx)
    v6 = H.index_to_float(kv_idx)
    v7 = H.index_to_float(q_idx)
    v8 = (v6 - v7)
    v9 = (v8 * v4)
    v10 = (score + v9)
    return v10
""")


def test_document_mask_gathers_from_captured_buffers():
    assert_expected_inline(_shown(_source(mods.document(torch.tensor([0, 0, 1, 1])), "mask")), """\
# mask_and=True, gathers=True
@triton.jit
def mask_mod(b, h, q_idx, kv_idx, bufs):
    v0 = tl.load(bufs[0] + (q_idx))
    v1 = tl.load(bufs[1] + (kv_idx))
    v2 = (v0 == v1)
    v3 = (q_idx >= kv_idx)
    v4 = (v2 & v3)
    return v4
""")


def test_a_window_compares_kv_with_a_row_bound():
    """`q - kv < w` is generated as `kv > q - w`: the difference is taken once per row, not per score."""
    assert_expected_inline(_shown(_source(mods.sliding_window(256), "mask", "gl")), """\
# mask_and=True
@gluon.jit
def mask_mod(b, h, q_idx, kv_idx, bufs):
    v0 = (q_idx >= kv_idx)
    v1 = (kv_idx > (q_idx - 256))
    v2 = (v0 & v1)
    return v2
""")


# Masks whose comparisons the generator rewrites to isolate kv (every operator, kv on either side of a
# sum or difference), one it must leave alone (|q - kv|), and one whose moved bound would leave int32.
_ISOLATED_MASKS = {
    "window": mods.sliding_window(5),
    "band": lambda b, h, q, kv: (kv - q <= 3) & (kv - q >= -2),
    "reversed": lambda b, h, q, kv: 6 > q - kv,
    "sums": lambda b, h, q, kv: (q + kv == 30) | (kv + q < 9) | (7 <= kv - q) | (q - kv != 4),
    "abs": lambda b, h, q, kv: (q - kv).abs() < 3,
    "near_int32": lambda b, h, q, kv: (q - kv < 2) | (q - kv > 2 ** 31 - 3),
    "row_bound": lambda b, h, q, kv: q - kv < q // 3 + h,
}


@pytest.mark.parametrize("name", sorted(_ISOLATED_MASKS))
def test_isolated_comparisons_keep_the_mask(name, cpu_kernels):
    """The generated mask, run by Triton's interpreter on a 64 x 64 grid, equals the mask in torch."""
    import triton
    import triton.language as tl

    from fa3_inductor.templates.modgen import load_mod

    fn = _ISOLATED_MASKS[name]
    mask_mod = load_mod(_source(fn, "mask"), "tl")

    @triton.jit
    def grid_kernel(out_ptr, h, N: tl.constexpr, MASK_MOD: tl.constexpr):
        q = tl.arange(0, N)[:, None]
        kv = tl.arange(0, N)[None, :]
        keep = MASK_MOD(0, h, q, kv, ())
        tl.store(out_ptr + q * N + kv, (keep & (q >= 0)).to(tl.int8))

    n, h = 64, 2
    out = torch.empty(n, n, dtype=torch.int8)
    grid_kernel[(1,)](out, h, N=n, MASK_MOD=mask_mod)
    q, kv = torch.arange(n, dtype=torch.int32)[:, None], torch.arange(n, dtype=torch.int32)[None, :]
    expected = torch.broadcast_to(fn(0, torch.tensor(h, dtype=torch.int32), q, kv), (n, n))
    assert torch.equal(out.bool(), expected)


def test_isolation_stops_where_int32_could_overflow():
    src = _source(lambda b, h, q, kv: q - kv > 2 ** 31 - 3 - 2 ** 23 - 1, "mask")
    assert "(kv_idx < (q_idx - " in src
    src = _source(lambda b, h, q, kv: q - kv < -2 ** 31 + 2 ** 22, "mask")
    assert "(q_idx - kv_idx)" in src, "a bound below int32's range must keep the per-score difference"


def test_learned_table_bakes_in_strides():
    # q - kv + 5 can be negative: such an index counts from the end, as torch's indexing does.
    table = torch.randn(4, 10)
    src = _source(lambda s, b, h, q, kv: s + table[h, q - kv + 5], "score")
    assert_expected_inline(_shown(src), """\
# sm_scaled=True, gathers=True, wide=True
@triton.jit
def score_mod(qk, sm_scale, b, h, q_idx, kv_idx, bufs):
    v0 = (q_idx - kv_idx)
    v1 = (v0 + 5)
    v2 = tl.minimum(v1.to(tl.uint32), (v1 + 10).to(tl.uint32))
    v3 = tl.load(bufs[0] + (h) * 10 + (v2))
    v4 = 1.0 / sm_scale
    v5 = (qk + v3 * v4)
    return v5


@triton.jit
def score_mod_unfolded(qk, sm_scale, b, h, q_idx, kv_idx, bufs):
    score = qk * sm_scale
    v0 = (q_idx - kv_idx)
    v1 = (v0 + 5)
    v2 = tl.minimum(v1.to(tl.uint32), (v1 + 10).to(tl.uint32))
    v3 = tl.load(bufs[0] + (h) * 10 + (v2))
    v4 = (score + v3)
    return v4
""")


def test_torch_rounding_semantics_are_kept():
    # torch's // and % round toward -inf; Triton's truncate: the generator must use helpers.
    src = _source(lambda b, h, q, kv: (q // 3) % 2 == (kv // 3) % 2, "mask")
    assert "H.floordiv" in src and "H.remainder" in src and "//" not in src.split("\n", 2)[2]


def test_true_division_of_integers_stays_true_division():
    src = _source(lambda s, b, h, q, kv: s + (q - kv) / 7, "score")
    # (q - kv) is rebuilt in float from the converted index vectors, then truly divided.
    assert "v3 = (v1 - v2)\n    v4 = (v3 / 7.0)" in src
    assert "//" not in src.split("\n", 2)[2]


def test_index_differences_convert_before_they_broadcast():
    # An int difference of indices meeting a float is rebuilt from float index vectors (an I2F
    # per score costs like a MUFU op on sm90); out-of-range constants stop the rebuild.
    src = _source(mods.relative_bias, "score", "gl")
    assert "H.index_to_float(q_idx)" in src and "H.index_to_float(kv_idx)" in src
    assert ".to(gl.float32)" not in src
    far = _source(lambda s, b, h, q, kv: s + (q - kv + 2 ** 25), "score", "gl")
    assert "index_to_float" not in far and ".to(gl.float32)" in far


def test_noop_mask_and_identity_score_are_recognized():
    gm, _ = trace_mod(lambda b, h, q, kv: q.new_ones((), dtype=torch.bool), "mask")
    assert is_constant_true_mask(gm)
    gm, _ = trace_mod(mods.causal, "mask")
    assert not is_constant_true_mask(gm)
    gm, _ = trace_mod(lambda s, b, h, q, kv: s, "score")
    assert is_identity_score(gm)


@pytest.mark.parametrize("dialect", ["tl", "gl"])
def test_causal_masks_are_recognized(dialect):
    """Exactly causal (both spellings) for the kernels' arithmetic walks; implying causal (a conjunction with q >= kv)
    for the wide backward's skip of tiles above the diagonal; neither for masks that keep some q < kv pair."""
    from fa3_inductor.templates.modgen import (is_causal_mask_mod, is_causal_mask_source, load_mod,
                                               mask_implies_causal, mask_implies_causal_source)

    docs = (torch.arange(512) // 100).to(torch.int32)
    cases = {"causal": (mods.causal, True, True),
             "causal, kv <= q": (lambda b, h, q, kv: kv <= q, True, True),
             "window": (mods.sliding_window(64), False, True),
             "causal documents": (mods.document(docs), False, True),
             "documents and window": (mods.and_masks(mods.document(docs), mods.sliding_window(64)), False, True),
             "documents": (mods.document(docs, causal=False), False, False),
             "causal or prefix": (lambda b, h, q, kv: (q >= kv) | (kv < 8), False, False),
             "anti-causal": (lambda b, h, q, kv: q <= kv, False, False)}
    for name, (fn, exact, implied) in cases.items():
        gm, bufs = trace_mod(fn, "mask")
        src = generate_mod_source(gm, "mask", [BufferSpec.of(b) for b in bufs], dialect)
        assert (is_causal_mask_source(src), mask_implies_causal_source(src)) == (exact, implied), (name, src)
        loaded = load_mod(src, dialect)
        assert (is_causal_mask_mod(loaded), mask_implies_causal(loaded)) == (exact, implied), name


@pytest.mark.parametrize("dialect", ["tl", "gl"])
def test_causal_windows_are_recognized(dialect):
    """A causal sliding window of W keys, however spelled, gives W (the Hopper cache mode's window walk); a window
    with a third term, a window without causal, documents and causal alone give None."""
    from fa3_inductor.templates.modgen import causal_window_of_source

    docs = (torch.arange(512) // 100).to(torch.int32)
    cases = {"mods.sliding_window": (mods.sliding_window(300), 300),
             "q - kv < W, operands swapped": (lambda b, h, q, kv: (q - kv < 300) & (q >= kv), 300),
             "kv > q - W": (lambda b, h, q, kv: (kv <= q) & (kv > q - 300), 300),
             "q - kv <= W - 1": (lambda b, h, q, kv: (q - kv <= 299) & (q - kv >= 0), 300),
             "one key": (mods.sliding_window(1), 1),
             "causal": (mods.causal, None),
             "window, not causal": (lambda b, h, q, kv: q - kv < 300, None),
             "window and a third term": (lambda b, h, q, kv: (q >= kv) & (q - kv < 300) & (kv > 5), None),
             "documents and window": (mods.and_masks(mods.document(docs), mods.sliding_window(64)), None)}
    for name, (fn, window) in cases.items():
        gm, bufs = trace_mod(fn, "mask")
        src = generate_mod_source(gm, "mask", [BufferSpec.of(b) for b in bufs], dialect)
        assert causal_window_of_source(src) == window, (name, src)


def test_unsupported_op_is_refused_with_its_name():
    with pytest.raises(UnsupportedMod, match="aten.cumsum"):
        _source(lambda s, b, h, q, kv: s + torch.cumsum(q.unsqueeze(0), 0).squeeze(0), "score")


def test_indexing_a_buffer_with_too_few_indices_is_refused():
    table = torch.randn(4, 10)
    with pytest.raises(UnsupportedMod, match="index every dimension"):
        _source(lambda s, b, h, q, kv: s + table[h].sum(), "score")


@pytest.mark.parametrize("fn, out_scale, reads_score", [
    (lambda s, b, h, q, kv: s * 2, 2.0, True),                        # the score itself, scaled
    (lambda s, b, h, q, kv: 0.5 * (s * s), 0.5, True),                # score read unscaled
    (lambda s, b, h, q, kv: torch.tanh(s / 20) * -3.0, 1.0, False),   # negative: kept in the mod
    (lambda s, b, h, q, kv: (s / 4 + s) / 8, 0.125, True),            # one use folded, one not
    (lambda s, b, h, q, kv: s + 1.0, 1.0, True),
])
def test_constant_multiplies_at_the_ends_fold(fn, out_scale, reads_score):
    src = _source(fn, "score")
    assert src.info.out_scale == out_scale, src
    assert ("score = qk * sm_scale" in src) == reads_score, src


def test_mods_that_differ_in_a_folded_factor_load_as_two_functions():
    """score * 0.5 and score * 2.0 generate the same text (the factor folds out, into out_scale): loaded by text
    alone, the second got the first's function and so its factor (flex returned a 0.72 relative error)."""
    from fa3_inductor.templates.modgen import load_mod, out_scale_of

    half, double = _source(lambda s, b, h, q, kv: s * 0.5, "score"), _source(lambda s, b, h, q, kv: s * 2.0, "score")
    assert str(half) == str(double) and half.info != double.info
    fn_half, fn_double = load_mod(half), load_mod(double)
    assert fn_half is not fn_double
    assert (out_scale_of(fn_half), out_scale_of(fn_double)) == (0.5, 2.0)
    assert load_mod(double) is fn_double   # still cached


def test_flex_with_two_folded_factors_in_one_process(cpu_kernels):
    """The same two mods through flex(), one after the other, each against float64."""
    import fa3_inductor
    from reference import assert_matches_reference, reference_attention

    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 17, 16, generator=g) for _ in range(3))
    for c in (0.5, 2.0):
        score_mod = eval(f"lambda score, b, h, q_idx, kv_idx: score * {c}")   # a new code object each
        out = fa3_inductor.flex(q, k, v, score_mod=score_mod)
        assert_matches_reference(out, reference_attention(q, k, v, score_mod=score_mod)[0], torch.float32)


def test_a_folded_input_multiply_scales_qk_once():
    assert_expected_inline(_shown(_source(lambda s, b, h, q, kv: (s / 4 + s) / 8, "score")), """\
# out_scale=0.125, finite=True
@triton.jit
def score_mod(qk, sm_scale, b, h, q_idx, kv_idx, bufs):
    score = qk * sm_scale
    v0 = sm_scale * 0.25
    v1 = (qk * v0)
    v2 = (v1 + score)
    return v2
""")


@pytest.mark.parametrize("fn, sm_scaled", [
    (lambda s, b, h, q, kv: s + (q - kv), True),                  # relative bias
    (lambda s, b, h, q, kv: (q - kv) * 0.5 + s, True),            # score on the right
    (lambda s, b, h, q, kv: (s - (q - kv)) * 2.0, True),          # minus, then a final multiply
    (lambda s, b, h, q, kv: (q - kv) - s, False),                 # -score: not a positive scale
    (lambda s, b, h, q, kv: s + s * 0.5, False),                  # the term reads the score
    (lambda s, b, h, q, kv: s * 2.0 + (q - kv), False),           # score read through a multiply
    (lambda s, b, h, q, kv: torch.tanh(s + (q - kv)), False),     # the sum is not the result
])
def test_a_score_plus_term_is_folded_into_qk_units(fn, sm_scaled):
    src = _source(fn, "score")
    assert src.info.sm_scaled == sm_scaled, src
    assert ("def score_mod_unfolded(" in src) == sm_scaled, src
    if sm_scaled:   # the folded mod never forms qk * sm_scale; its twin does
        folded, twin = src.split("def score_mod_unfolded(")
        assert "sm_scale *" not in folded and "1.0 / sm_scale" in folded, src
        assert "score = qk * sm_scale" in twin, src



def test_the_report_line_names_the_folded_factors_and_not_the_twin():
    from fa3_inductor.templates.modgen import describe_mod_source
    soft = describe_mod_source(_source(mods.softcap(30.0), "score"))
    assert soft.endswith("return v2 (x 30.0, folded into the kernel)"), soft
    bias = describe_mod_source(_source(lambda s, b, h, q, kv: (s + (q - kv)) * 2.0, "score"))
    assert bias.endswith("(x 2.0 x sm_scale, folded into the kernel)"), bias
    assert "score = qk * sm_scale" not in bias and bias.count("return") == 1, bias
    assert describe_mod_source(_source(mods.causal, "mask")) == "v0 = (q_idx >= kv_idx); return v0"


_HEAD = torch.randn(4)
_TABLE = torch.randn(4, 10)
# (mod, whether the generator may split `score + x` into column / tile / row parts: KV_AFFINE)
_AFFINE = {
    "alibi": (mods.alibi(8), True),
    "relative_bias": (mods.relative_bias, True),
    "nonlinear_row": (lambda s, b, h, q, kv: s + (torch.sin(q * 0.1) - kv / ((h + 1) * 20)), True),
    "kv_times_q": (lambda s, b, h, q, kv: s + (kv * q) * 1e-3, False),
    "kv_squared": (lambda s, b, h, q, kv: s + (kv * kv) * 1e-3, False),
    "table_by_distance": (lambda s, b, h, q, kv: s + _TABLE[h, torch.clamp((q - kv).abs(), max=9)], False),
    "floor_division": (lambda s, b, h, q, kv: s + kv // 3, False),
    "softcap": (mods.softcap(30.0), False),
}


# Affine, but not varying along q: not flagged (the kernel's row part needs a term of q; on an H100
# such mods failed to build, "invalid axis 1", found by benchmarks/mod_fuzz.py).
_NOT_ALONG_Q = {"head_bias": (lambda s, b, h, q, kv: s + _HEAD[h]), "kv_only": (lambda s, b, h, q, kv: s + kv * 0.01)}


@pytest.mark.parametrize("name", list(_AFFINE) + list(_NOT_ALONG_Q))
def test_kv_affine_flag(name):
    fn, affine = _AFFINE[name] if name in _AFFINE else (_NOT_ALONG_Q[name], False)
    src = _source(fn, "score", "gl")
    assert src.info.kv_affine == affine, src


def _x(fn, q, kv, h=3):
    """The mod's additive term at integer positions, in float64."""
    return fn(torch.zeros((), dtype=torch.float64), torch.tensor(0), torch.tensor(h), q, kv).double()


@pytest.mark.parametrize("name", [n for n in _AFFINE if n != "softcap"])   # softcap: not `score + x`
def test_kv_affine_parts_rebuild_the_mod(name):
    # The identity the Hopper kernel relies on for a KV_AFFINE mod, with q0 a query tile's first row and
    # n0 a KV tile's start: x(q0 + i, n0 + j) = [x(0, j) - x(0, 0)] + x(q0, n0) + [x(q0 + i, q0) - x(q0, q0)].
    # It must hold for every flagged mod and fail for the others (here: where they are not affine).
    fn, affine = _AFFINE[name]
    g = torch.Generator().manual_seed(0)
    q0, n0 = (int(x) for x in torch.randint(0, 5000, (2,), generator=g))
    i = torch.randint(0, 64, (64, 1), generator=g)
    j = torch.randint(0, 128, (1, 128), generator=g)
    zero = torch.tensor(0)
    full = _x(fn, q0 + i, n0 + j)
    parts = (_x(fn, zero, j) - _x(fn, zero, zero)) + _x(fn, torch.tensor(q0), torch.tensor(n0)) \
        + (_x(fn, q0 + i, torch.tensor(q0)) - _x(fn, torch.tensor(q0), torch.tensor(q0)))
    close = torch.allclose(parts, full.expand_as(parts), rtol=1e-6, atol=1e-6)
    assert close == affine, (name, (parts - full).abs().max())


def _grad_info(fn):
    """ModInfo of the gl source of fn's derivative (hopper_bwd.score_grad_gl), None for a derivative of 1."""
    from torch._higher_order_ops.flex_attention import create_fw_bw_graph

    from fa3_inductor.templates.hopper_bwd import score_grad_gl

    gm, bufs = trace_mod(fn, "score")
    index_values = (torch.zeros((), requires_grad=True), *(torch.zeros((), dtype=torch.int32) for _ in range(4)))
    src = score_grad_gl(create_fw_bw_graph(gm, index_values, tuple(bufs))[1], [BufferSpec.of(b) for b in bufs])
    return None if src is None else src.info


@pytest.mark.parametrize("name, fn, finite", [
    ("softcap", mods.softcap(30.0), True),                                  # 30 (1 - tanh^2) / 30: bounded
    ("square", lambda s, b, h, q, kv: s * s * 0.01, True),                  # products and literals only
    ("distance", lambda s, b, h, q, kv: s / (1.0 + (q - kv).abs()), False),  # a division by a tensor
    ("exp", lambda s, b, h, q, kv: s * torch.exp(s * 0.01), False),         # overflows for a large S
    ("float-table", lambda s, b, h, q, kv: s * _FLOAT_TABLE[q % 4, kv % 4], False),  # a buffer may hold inf
])
def test_a_score_grads_finiteness_is_recorded(name, fn, finite):
    """ModInfo.finite: the kernels drop the select that keeps a non-finite f' out of masked scores only where
    the derivative is finite wherever S is (its ops, its literals, no float buffer)."""
    assert _grad_info(fn).finite is finite, name


_FLOAT_TABLE = torch.randn(4, 4)
