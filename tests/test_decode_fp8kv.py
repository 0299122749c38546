"""flex_decode over an FP8 KV cache (templates/decode/fp8_cache.py, kernel.py's CacheLayout.KV_SCALE):
CPU interpreter, tiny shapes, against float64 attention on the dequantized cache (FP8 values x
scales in float64), so the tolerance is q's dtype's (README, "Tolerance rule"): the cache's own
rounding is in the reference.

Contiguous and paged caches (a shuffled table over spare pages of noise; pages of 16, holding whole
16-key interpreter tiles, and of 8 and 24, where tiles span pages), GQA and MHA, ragged lengths with
0 and 1, scales per tensor / kv head / sequence / page, split merges, mods, the gather fallback,
quantize_kv, the errors; one compile-only sm90 build (``pytest -m sm90_compile``).
"""

from __future__ import annotations

import math

import pytest
import torch

import fa3_inductor
from fa3_inductor import flex_decode, mods, quantize_kv
from fa3_inductor.templates.decode import prepare_decode
from reference import assert_lse_matches, assert_matches_reference
from test_decode_api import _NoHostReads, _reference as _api_reference

E4M3 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def needs_the_interpreter(request):
    from triton import knobs

    # the tests' tensors live on the CPU: only the interpreter runs our kernels on them (on a GPU machine
    # without it flex_decode takes torch's path and the family checks fail)
    if "sm90_compile" not in request.keywords and not knobs.runtime.interpret:
        pytest.skip("these CPU-tensor tests need TRITON_INTERPRET=1 (conftest sets it without CUDA)")


def _cache(B, HKV, N, D, page):
    """(k, v): a float cache whose kv heads differ in magnitude (per-head scales matter), [B, HKV,
    N, D], or its pages in a shuffled pool [P, page, HKV, D] with a table (page > 0)."""
    spread = torch.tensor([0.5, 4.0, 1.0, 2.0])[:HKV].view(1, HKV, 1, 1)
    k, v = torch.randn(B, HKV, N, D) * spread, torch.randn(B, HKV, N, D) * spread.flip(1)
    if not page:
        return k, v, None
    per = -(-N // page)
    pool = B * per + 3
    order = torch.randperm(pool)[:B * per]

    def scatter(t):
        t = torch.cat([t, torch.randn(B, HKV, per * page - N, D)], dim=2)
        pages = torch.randn(pool, page, HKV, D) * 8   # spare pages: loud noise, never read
        pages[order] = t.view(B, HKV, per, page, D).permute(0, 2, 3, 1, 4).reshape(-1, page, HKV, D)
        return pages

    return scatter(k), scatter(v), order.view(B, per).to(torch.int32)


def _values(cache8, scale, paged):
    """The FP8 cache's real values in float64, in its own layout."""
    s = scale.double()
    if s.dim() == 1 and s.numel() > 1:                 # [HKV]
        s = s.view(1, 1, -1, 1) if paged else s.view(1, -1, 1, 1)
    elif s.dim() == 2:                                 # [pages or B, HKV]
        s = s.view(s.shape[0], 1, -1, 1) if paged else s.view(s.shape[0], -1, 1, 1)
    return cache8.double() * s


def _real(cache8, scale, table, N):
    """The FP8 cache's values in float64 as [B, HKV, N, D] (pages gathered through the table)."""
    real = _values(cache8, scale, table is not None)
    if table is None:
        return real
    rows = real[table.long()]                      # [B, per, page, HKV, D]
    return rows.reshape(table.shape[0], -1, *real.shape[2:]).transpose(1, 2)[:, :, :N]


def _reference(q, k, v, lens, score_mod=None, mask_mod=None):
    """Float64 per batch over its first lens[b] keys, new tokens at lens[b] - M_new + i."""
    return _api_reference(q, k, v, lens, lens - q.shape[2], score_mod, mask_mod)


def _run_and_check(q, page, granularity, HKV=2, N=40, splits=3, score_mod=None, mask_mod=None,
                   fp8_dtype=E4M3, lens=(0, 1, 37)):
    B, _, _, D = q.shape
    k, v, table = _cache(B, HKV, N, D, page)
    k8, v8, ks, vs = quantize_kv(k, v, granularity, paged=table is not None, fp8_dtype=fp8_dtype)
    assert k8.dtype == fp8_dtype
    lens = torch.tensor(lens, dtype=torch.int32)
    out, lse = flex_decode(q, k8, v8, seq_lens=lens, block_table=table, k_scale=ks, v_scale=vs,
                           num_splits=splits, score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
    assert fa3_inductor.last_template() == "decode" and out.dtype == q.dtype
    ref, ref_lse = _reference(q, _real(k8, ks, table, N), _real(v8, vs, table, N), lens,
                              score_mod, mask_mod)
    assert_matches_reference(out, ref, q.dtype)
    assert_lse_matches(lse, ref_lse, q.dtype)
    assert torch.all(out[0] == 0) and torch.all(lse[0].isneginf())   # the empty cache
    return out


@pytest.mark.parametrize("page, granularity, HQ, dtype", [
    (0, "tensor", 8, torch.bfloat16),     # contiguous, GQA 4:1, one scale: folded into qk_scale2
    (0, "head", 2, torch.float16),        # MHA, per kv head
    (0, "page", 8, torch.bfloat16),       # [B, HKV]: per sequence and head
    (16, "head", 8, torch.bfloat16),      # pages holding whole tiles
    (16, "page", 8, torch.float16),       # a scale per tile (its page)
    (8, "page", 2, torch.bfloat16),       # MHA, tiles span two pages: per-key scale rows
    (24, "tensor", 8, torch.float32),     # pages of 24: tiles straddle page ends
])
def test_fp8_cache_matches_float64(page, granularity, HQ, dtype):
    q = torch.randn(3, HQ, 1, 16, dtype=dtype)
    _run_and_check(q, page, granularity)


@pytest.mark.parametrize("page, granularity", [(0, "head"), (8, "page")])
def test_fp8_cache_with_mods_and_speculative_tokens(page, granularity):
    """softcap reads the real q.k (K's scale applied before the mod, not folded), causal masks the
    speculative tokens by absolute position; one split and several."""
    q = torch.randn(3, 8, 2, 16, dtype=torch.bfloat16)
    for splits in (1, 4):
        _run_and_check(q, page, granularity, splits=splits, score_mod=mods.softcap(3.0),
                       mask_mod=mods.causal, lens=(0, 2, 40))


def test_e5m2_cache():
    q = torch.randn(3, 8, 1, 16, dtype=torch.float16)
    _run_and_check(q, 16, "page", fp8_dtype=torch.float8_e5m2)


def test_decode_attention_takes_an_fp8_cache():
    """The kernel-level entry (templates.decode.decode_attention) with a bf16 q on the interpreter:
    q on a float32 copy, the FP8 cache as it is; the same result as flex_decode."""
    from fa3_inductor.templates.decode import decode_attention

    k, v, table = _cache(2, 2, 32, 16, 8)
    k8, v8, ks, vs = quantize_kv(k, v, "page", paged=True)
    q = torch.randn(2, 4, 1, 16, dtype=torch.bfloat16)
    lens = torch.tensor([32, 9], dtype=torch.int32)
    out, _ = decode_attention(q, k8, v8, seq_lens=lens, block_table=table, k_scale=ks, v_scale=vs,
                              num_splits=2)
    want = flex_decode(q, k8, v8, seq_lens=lens, block_table=table, k_scale=ks, v_scale=vs, num_splits=2)
    torch.testing.assert_close(out, want, atol=0, rtol=0)


def test_long_query_gathers_a_dequantized_cache():
    """160 packed rows (8 heads x 20 tokens on one kv head): the gather fallback, which reads the
    cache's real values (dequantized in float32, then q's dtype)."""
    k, v, table = _cache(2, 1, 64, 16, 16)
    k8, v8, ks, vs = quantize_kv(k, v, "page", paged=True)
    q = torch.randn(2, 8, 20, 16)
    lens = torch.tensor([64, 40], dtype=torch.int32)
    out = flex_decode(q, k8, v8, seq_lens=lens, block_table=table, k_scale=ks, v_scale=vs,
                      mask_mod=mods.causal)
    assert fa3_inductor.last_template() != "decode"
    ref, _ = _reference(q, _real(k8, ks, table, 64), _real(v8, vs, table, 64), lens,
                        mask_mod=mods.causal)
    assert_matches_reference(out, ref, torch.float32)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("granularity", ["tensor", "head", "page"])
def test_quantize_kv_scales_and_round_trip(paged, granularity):
    shape = (6, 8, 2, 16) if paged else (2, 2, 24, 16)
    k, v = torch.randn(shape) * 3, torch.randn(shape)
    k[0] = 0   # an all-zero page / sequence: scale 1 under "page", nothing divided by 0
    k8, v8, ks, vs = quantize_kv(k, v, granularity, paged=paged)
    want = {"tensor": (), "head": (2,), "page": (6, 2) if paged else (2, 2)}[granularity]
    assert tuple(ks.shape) == tuple(vs.shape) == want and ks.dtype == torch.float32
    assert torch.isfinite(k8.float()).all() and torch.isfinite(v8.float()).all()
    if granularity == "page":
        assert torch.all(ks[0] == 1)
    for t, t8, s in ((k, k8, ks), (v, v8, vs)):
        back = _values(t8, s, paged)
        # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 on the normal range
        assert (back - t.double()).norm() <= 2 ** -4 * t.double().norm()
    # given scales (a cache's fixed ones): reused, their granularity read from their shape
    k8b, _, ksb, _ = quantize_kv(k, v, "tensor", paged=paged, k_scale=ks, v_scale=vs)
    assert ksb is ks and torch.equal(k8b.view(torch.uint8), k8.view(torch.uint8))


def test_host_path_reads_no_scale():
    """Planning an FP8 call reads no device value (the scales, like the lengths, are the kernel's)."""
    k, v, table = _cache(2, 2, 32, 16, 16)
    k8, v8, ks, vs = quantize_kv(k, v, "page", paged=True)
    q = torch.randn(2, 4, 1, 16)
    out, lse = torch.empty_like(q), torch.empty(2, 4, 1)
    lens = torch.tensor([32, 5], dtype=torch.int32)
    with _NoHostReads():
        prepare_decode(q, k8, v8, out, lse, sm_scale=0.25, seq_lens=lens, block_table=table,
                       k_scale=ks, v_scale=vs)


def test_errors_say_what_to_do():
    k, v, table = _cache(1, 2, 32, 16, 16)
    k8, v8, ks, vs = quantize_kv(k, v, "head", paged=True)
    q = torch.randn(1, 4, 1, 16, dtype=torch.bfloat16)
    lens = torch.tensor([32], dtype=torch.int32)
    paged = dict(seq_lens=lens, block_table=table)
    bf = k.bfloat16()
    contiguous = torch.zeros(1, 2, 32, 16).to(E4M3)
    cases = [
        (ValueError, "needs both k_scale and v_scale", lambda: flex_decode(q, k8, v8, **paged)),
        (ValueError, "needs both k_scale and v_scale", lambda: flex_decode(q, k8, v8, k_scale=ks, **paged)),
        (ValueError, "were given with a torch.bfloat16 cache", lambda: flex_decode(
            q, bf, bf, k_scale=ks, v_scale=vs, **paged)),
        (ValueError, "but v_cache is torch.bfloat16", lambda: flex_decode(
            q, k8, bf, k_scale=ks, v_scale=vs, **paged)),
        (ValueError, "one FP8 dtype", lambda: flex_decode(
            q, k8, v8.to(torch.float8_e5m2), k_scale=ks, v_scale=vs, **paged)),
        (ValueError, r"shape \(3,\).*\[HKV=2\] \(per kv head\) or \[num_pages=5, HKV=2\] per page",
         lambda: flex_decode(q, k8, v8, k_scale=torch.ones(3), v_scale=vs, **paged)),
        (ValueError, r"\[B=1, HKV=2\] per sequence", lambda: flex_decode(
            q, contiguous, contiguous, seq_lens=lens, k_scale=torch.ones(5, 2), v_scale=torch.ones(5, 2))),
        (ValueError, "torch.float16 on cpu.*dtype=torch.float32", lambda: flex_decode(
            q, k8, v8, k_scale=ks.half(), v_scale=vs, **paged)),
        (ValueError, "on meta", lambda: flex_decode(
            q, k8, v8, k_scale=ks, v_scale=torch.ones(2, device="meta"), **paged)),
        (ValueError, "per head but v_scale per tensor", lambda: flex_decode(
            q, k8, v8, k_scale=ks, v_scale=torch.tensor(1.0), **paged)),
        (ValueError, "not contiguous", lambda: flex_decode(
            q, k8, v8, k_scale=torch.ones(2, 5).t(), v_scale=torch.ones(2, 5).t(), **paged)),
        (TypeError, "k_scale must be a float32 torch.Tensor", lambda: flex_decode(
            q, k8, v8, k_scale=1.0, v_scale=vs, **paged)),
        (ValueError, "fa3 decode kernel: .*needs both", lambda: prepare_decode(
            q.float(), k8, v8, q.float(), torch.empty(1, 4, 1), sm_scale=0.25, **paged)),
        (ValueError, "granularity='row'", lambda: quantize_kv(k, v, "row")),
        (ValueError, "fp8_dtype", lambda: quantize_kv(k, v, fp8_dtype=torch.int8)),
        (ValueError, "pass both, or neither", lambda: quantize_kv(k, v, k_scale=ks)),
        (ValueError, "quantize_kv: k_scale has shape", lambda: quantize_kv(
            k, v, paged=True, k_scale=torch.ones(3), v_scale=torch.ones(3))),
    ]
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()


@pytest.mark.sm90_compile
def test_sm90_compile_fp8_cache_no_spills():
    """The FP8 variant compiles for sm90 without spills, its tiles read by 16-byte cp.async and
    converted from e4m3 by F2FP.F16.E4M3.UNPACK_B (two values an instruction, to fp16, the dots'
    dtype; no F2F per value); the bf16 build beside it has no e4m3 conversion."""
    import re

    from fa3_inductor.templates.aot import sass_report
    from fa3_inductor.templates.decode import compile_decode

    reports = []
    lens = torch.tensor([2048, 1000], dtype=torch.int32)
    for D, page, granularity, fp8 in ((128, 0, "head", True), (128, 64, "page", True),
                                      (128, 16, "page", True), (64, 64, "tensor", True),
                                      (128, 0, "head", False)):
        q = torch.randn(2, 8, 1, D, dtype=torch.bfloat16)
        k = torch.randn(4096 // page, page, 2, D) if page else torch.randn(2, 2, 2048, D)
        extra = dict(block_table=torch.arange(4096 // page, dtype=torch.int32).view(2, -1)) if page else {}
        if fp8:
            k8, _, ks, _ = quantize_kv(k, k, granularity, paged=page > 0)
            extra.update(k_scale=ks, v_scale=ks)
        [ck] = compile_decode(q, k8 if fp8 else k.bfloat16(), k8 if fp8 else k.bfloat16(), torch.empty_like(q),
                              torch.empty(q.shape[:3]), sm_scale=D ** -0.5, seq_lens=lens, num_splits=8, **extra)
        r = sass_report(ck)
        unpack = len(re.findall(r"F2FP\.F16\.E4M3\.UNPACK_B", r.sass))
        loop = max(len(b) for b in r.inner_loops() if any("MMA" in t for t in b))
        reports.append(f"{'fp8 ' + granularity if fp8 else 'bf16'} D{D} {f'pages of {page}' if page else 'contiguous'}: "
                       f"{r.registers} registers, {r.spill_instructions} spills, {r.shared} B shared, "
                       f"{unpack} F2FP.F16.E4M3.UNPACK_B, KV loop {loop} instructions")
        assert r.stack == 0 and r.local == 0 and r.spill_instructions == 0, reports[-1]
        assert "LDGSTS.E.BYPASS.128" in r.sass, reports[-1]
        assert (unpack > 0) == fp8 and not re.search(r"F2F\.BF16\.F16", r.sass), reports[-1]
    print("\n".join(reports))
