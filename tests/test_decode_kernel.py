"""The split-KV decode kernels (templates/decode/) against float64: CPU interpreter, tiny shapes.

Ragged cache lengths per batch, GQA packing, split counts (the last split's merge), paged caches through a
shuffled block table, mods with absolute query positions, fully masked rows, lengths changed in
place between re-launches of the same prepared launches; and one compile-only sm90 build
(``pytest -m sm90_compile``).
"""

from __future__ import annotations

import math

import pytest
import torch

from fa3_inductor import mods
from fa3_inductor.templates.decode import decode_attention, decode_scratch, prepare_decode
from fa3_inductor.templates.decode.configs import choose_num_splits
from fa3_inductor.templates.modgen import generate_mod_source, load_mod, trace_mod
from reference import assert_lse_matches, assert_matches_reference, reference_attention

LN2 = math.log(2.0)

CAUSAL_TL = """@triton.jit
def mask_mod(b, h, q_idx, kv_idx, bufs):
    return q_idx >= kv_idx
"""
SOFTCAP_BIAS_TL = """@triton.jit
def score_mod(qk, sm_scale, b, h, q_idx, kv_idx, bufs):
    score = qk * sm_scale
    return 4.0 * H.tanh(score / 4.0) + tl.load(bufs[0] + h)
"""
# Head 1 sees nothing; the others see everything.
HIDE_HEAD1_TL = """@triton.jit
def mask_mod(b, h, q_idx, kv_idx, bufs):
    return (h != 1) & (kv_idx >= 0)
"""


def _inputs(B, HQ, HKV, M_new, N, D, dtype=torch.float32):
    q = torch.randn(B, HQ, M_new, D, dtype=dtype)
    k = torch.randn(B, HKV, N, D, dtype=dtype)
    v = torch.randn(B, HKV, N, D, dtype=dtype)
    return q, k, v


def _reference(q, k, v, lens, q_first=None, score_mod=None, mask_mod=None, scale=None):
    """Float64 (out, natural LSE), batch by batch over each cache's first lens[z] keys; the mods
    see absolute query positions q_first[z] + i (default lens[z] - M_new)."""
    M_new = q.shape[2]
    outs, lses = [], []
    for z, L in enumerate(lens.tolist()):
        first = L - M_new if q_first is None else int(q_first[z])

        def shift_score(s, b, h, qi, ki, first=first):
            return score_mod(s, b, h, qi + first, ki)

        def shift_mask(b, h, qi, ki, first=first):
            return mask_mod(b, h, qi + first, ki)

        out, lse = reference_attention(q[z:z + 1], k[z:z + 1, :, :L], v[z:z + 1, :, :L],
                                       shift_score if score_mod else None,
                                       shift_mask if mask_mod else None, scale=scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _check(out, lse, ref, ref_lse, dtype):
    assert_matches_reference(out, ref, dtype)
    assert_lse_matches(lse * LN2, ref_lse, dtype)


def _paged(k, v, page, spare=3):
    """The contiguous cache's pages in a shuffled page pool (plus unused pages of noise):
    (k_pages, v_pages, block_table)."""
    B, HKV, N, D = k.shape
    per_batch = -(-N // page)   # the last page partly filled (with noise) when page does not divide N
    pool = B * per_batch + spare
    order = torch.randperm(pool)[:B * per_batch]
    pad = per_batch * page - N

    def scatter(t):
        pages = torch.randn(pool, page, HKV, t.shape[-1], dtype=t.dtype)
        t = torch.cat([t, torch.randn(B, HKV, pad, t.shape[-1], dtype=t.dtype)], dim=2)
        pages[order] = t.view(B, HKV, per_batch, page, -1).permute(0, 2, 3, 1, 4).reshape(
            -1, page, HKV, t.shape[-1])
        return pages

    return scatter(k), scatter(v), order.view(B, per_batch).to(torch.int32)


@pytest.mark.parametrize("M_new, HQ, HKV, D, dtype, splits", [
    (1, 8, 2, 16, torch.float32, 1),     # GQA 4:1, one split: O and LSE written directly
    (3, 8, 2, 32, torch.bfloat16, 3),    # speculative tokens x GQA packed into one tile
    (3, 2, 2, 16, torch.bfloat16, 1),    # MHA
    (1, 2, 2, 32, torch.float32, 2),
    (2, 4, 1, 16, torch.float16, 2),     # MQA
])
def test_ragged_lengths_match_float64(cpu_kernels, M_new, HQ, HKV, D, dtype, splits):
    q, k, v = _inputs(3, HQ, HKV, M_new, 48, D, dtype)
    lens = torch.tensor([1, 37, 48], dtype=torch.int32)   # 37: a partial last tile
    out, lse = decode_attention(q, k, v, seq_lens=lens, num_splits=splits)
    assert out.dtype == dtype
    ref, ref_lse = _reference(q, k, v, lens)
    _check(out, lse, ref, ref_lse, dtype)


def test_split_counts_agree_through_the_combine(cpu_kernels):
    q, k, v = _inputs(2, 4, 1, 1, 80, 16)
    lens = torch.tensor([80, 19], dtype=torch.int32)   # 19 keys over 5 splits: most splits empty
    results = [decode_attention(q, k, v, seq_lens=lens, num_splits=s) for s in (1, 2, 5)]
    ref, ref_lse = _reference(q, k, v, lens)
    for out, lse in results:
        _check(out, lse, ref, ref_lse, torch.float32)
        torch.testing.assert_close(out, results[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, results[0][1], atol=1e-5, rtol=1e-5)


def test_merge_over_many_steps_and_counters_left_at_zero(cpu_kernels):
    """40 splits of 16 packed rows merged 8 at a time (5 merge steps, most splits empty), then 3
    and 1 split, through one scratch: each launch leaves every arrival counter at 0, so the next
    launch's last split is found again."""
    q, k, v = _inputs(2, 8, 2, 4, 90, 64)   # GQA 4 x 4 new tokens = 16 packed rows
    lens = torch.tensor([90, 33], dtype=torch.int32)
    ref, ref_lse = _reference(q, k, v, lens)
    scratch = decode_scratch(q, 2, 64, 40)
    for splits in (40, 3, 40, 1):
        out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
        launches = prepare_decode(q, k, v, out, lse, sm_scale=64 ** -0.5, seq_lens=lens,
                                  num_splits=splits, scratch=scratch)
        assert len(launches) == 1
        if splits == 40:
            assert launches[0][2]["TILE"].MERGE_SPLITS == 8
        for kernel, args, kwargs, grid in launches:
            kernel[grid](*args, **kwargs)
        _check(out, lse, ref, ref_lse, torch.float32)
        assert scratch[2].abs().sum() == 0


def test_strided_cache_views_and_a_wider_value_head(cpu_kernels):
    """[B, N, HKV, D] storage read through [B, HKV, N, D] views (no copy); DV != D."""
    B, HKV, N = 2, 2, 40
    q = torch.randn(B, 4, 1, 16)
    k = torch.randn(B, N, HKV, 16).transpose(1, 2)
    v = torch.randn(B, N, HKV, 32).transpose(1, 2)
    lens = torch.tensor([40, 23], dtype=torch.int32)
    out, lse = decode_attention(q, k, v, seq_lens=lens, num_splits=2)
    assert out.shape == (B, 4, 1, 32)
    ref, ref_lse = _reference(q, k, v, lens)
    _check(out, lse, ref, ref_lse, torch.float32)


@pytest.mark.parametrize("dtype, page", [
    (torch.float32, 16), (torch.bfloat16, 32),
    (torch.float32, 8),     # a 16-key tile spans two pages
    (torch.float16, 24),    # a page size that is no power of two: tiles straddle page ends
    (torch.float32, 1),     # one key per page
])
def test_paged_shuffled_table_equals_contiguous(cpu_kernels, dtype, page):
    q, k, v = _inputs(2, 4, 2, 2, 64, 16, dtype)
    lens = torch.tensor([64, 21], dtype=torch.int32)
    k_pages, v_pages, table = _paged(k, v, page)
    out_c, lse_c = decode_attention(q, k, v, seq_lens=lens, num_splits=2)
    out_p, lse_p = decode_attention(q, k_pages, v_pages, seq_lens=lens, block_table=table,
                                    page_size=page, num_splits=2)
    torch.testing.assert_close(out_p, out_c, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse_p, lse_c, atol=1e-6, rtol=1e-6)
    ref, ref_lse = _reference(q, k, v, lens)
    _check(out_p, lse_p, ref, ref_lse, dtype)


def test_tma_tiles_match_float64_and_ignore_unwritten_slots(cpu_kernels):
    """Whole tiles through K / V descriptors (DecodeConfig.tma), the tile holding L by pointer loads:
    ragged lengths (0, a partial last tile, whole tiles only) over 1-3 splits, the slots past each
    length holding NaN (an unwritten cache), and pages of one tile through a shuffled table."""
    from fa3_inductor.templates.decode.configs import DecodeConfig

    cfg = DecodeConfig(16, 4, 1, tma=True)
    q, k, v = _inputs(3, 8, 2, 2, 64, 32)
    lens = torch.tensor([0, 37, 48], dtype=torch.int32)
    ref, ref_lse = _reference(q, k, v, lens)
    kp, vp, table = _paged(k, v, 16)
    for z, L in enumerate(lens.tolist()):
        k[z, :, L:] = float("nan")
        v[z, :, L:] = float("nan")
    launch = prepare_decode(q, k, v, torch.empty_like(q), torch.empty(q.shape[:3]), sm_scale=0.1,
                            seq_lens=lens, config=cfg)
    assert launch[0][2]["CACHE"].TMA
    for splits in (1, 2, 3):
        out, lse = decode_attention(q, k, v, seq_lens=lens, num_splits=splits, config=cfg)
        _check(out[1:], lse[1:], ref[1:], ref_lse[1:], torch.float32)
        assert (out[0] == 0).all() and (lse[0] == -math.inf).all()
    out, lse = decode_attention(q, kp, vp, seq_lens=lens, block_table=table, page_size=16, num_splits=2,
                                config=cfg)
    _check(out[1:], lse[1:], ref[1:], ref_lse[1:], torch.float32)


def test_tma_only_where_a_descriptor_addresses_the_cache():
    """Pages that split a tile, a broadcast (stride 0) batch, and a block mask's walk keep pointer loads."""
    from fa3_inductor.templates.decode.configs import DecodeConfig

    cfg = DecodeConfig(16, 4, 1, tma=True)
    q, k, v = _inputs(2, 4, 2, 1, 64, 16)
    lens = torch.tensor([64, 21], dtype=torch.int32)

    def tma(k, v, **extra):
        launch = prepare_decode(q, k, v, torch.empty_like(q), torch.empty(q.shape[:3]), sm_scale=0.25,
                                seq_lens=lens, config=cfg, **extra)
        return launch[0][2]["CACHE"].TMA

    assert tma(k, v)
    kp, vp, table = _paged(k, v, 8)
    assert not tma(kp, vp, block_table=table, page_size=8)
    assert not tma(k[:1].expand(2, -1, -1, -1), v[:1].expand(2, -1, -1, -1))


def test_sm90_plans_tma_for_gqa_d64_contiguous_caches():
    """configs.tma_tiles on a planned sm90 launch: GQA D64 contiguous caches take 256-key tiles by TMA;
    MHA D64, D128 and pages keep the pointer plan."""
    def plan(HQ, HKV, D, paged=False):
        q = torch.randn(2, HQ, 1, D, dtype=torch.float16)
        k = torch.randn(2, HKV, 1024, D, dtype=torch.float16)
        extra = {}
        if paged:
            k = torch.randn(32, 64, HKV, D, dtype=torch.float16)
            extra = dict(block_table=torch.arange(32, dtype=torch.int32).view(2, 16))
        [(_, _, kwargs, _)] = prepare_decode(q, k, k, torch.empty_like(q), torch.empty(q.shape[:3]),
                                             sm_scale=0.1, seq_lens=torch.tensor([1024, 77], dtype=torch.int32),
                                             plan_for=(9, 0), **extra)
        return kwargs["CACHE"].TMA, kwargs["TILE"].BLOCK_N

    assert plan(8, 2, 64) == (True, 256)
    assert plan(8, 8, 64) == (False, 128)
    assert plan(8, 2, 128) == (False, 64)
    assert plan(8, 2, 64, paged=True) == (False, 128)


def test_sm90_plans_short_paged_splits_as_contiguous():
    """configs.short_paged_splits: pages of 64 holding D128's 64-key tiles whose paged splits would be short
    (1 x 32k: 33 of 16 tiles) take the contiguous split count at 7 stages; long ones (1 x 128k) keep the paged
    rule (33 splits, 5 stages)."""
    def plan(N):
        q = torch.randn(1, 32, 1, 128, dtype=torch.float16)
        pages = torch.empty(N // 64, 64, 8, 128, dtype=torch.float16)
        [(_, _, kwargs, grid)] = prepare_decode(q, pages, pages, torch.empty_like(q), torch.empty(q.shape[:3]),
                                                sm_scale=0.1, seq_lens=torch.tensor([N], dtype=torch.int32),
                                                block_table=torch.arange(N // 64, dtype=torch.int32).view(1, -1),
                                                plan_for=(9, 0))
        return grid[0], kwargs["num_stages"]

    assert plan(32768) == (16, 7)
    assert plan(131072) == (33, 5)


@pytest.mark.parametrize("M_new, HQ, HKV", [(1, 8, 2), (2, 8, 4), (1, 4, 4)])
def test_paged_d64_head_pairs_match_float64(cpu_kernels, M_new, HQ, HKV):
    """SITE.PAIRS (planned for sm90, run here under the interpreter): a paged D64 cache read two kv heads at a
    time, each row's query in its head's half of the pair and its output taken from that half; GQA and MHA, one
    split (the only launch pairs take: a split count of 3 keeps single heads), ragged lengths, ALiBi (per query
    head)."""
    from fa3_inductor.templates.modgen import generate_mod_source, load_mod, trace_mod

    gm, _ = trace_mod(mods.alibi(HQ), "score")
    alibi = load_mod(generate_mod_source(gm, "score", []))
    q, k, v = _inputs(2, HQ, HKV, M_new, 256, 64, torch.float16)
    lens = torch.tensor([256, 100], dtype=torch.int32)
    kp, vp, table = _paged(k, v, 64)
    for mod, ref_mod in ((None, None), (alibi, mods.alibi(HQ))):
        out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
        launches = prepare_decode(q, kp, vp, out, lse, sm_scale=0.125, seq_lens=lens, block_table=table,
                                  plan_for=(9, 0), score_mod=mod, num_splits=1)
        assert launches[0][2]["SITE"].PAIRS and launches[0][2]["TILE"].BLOCK_D == 128
        assert not prepare_decode(q, kp, vp, out, lse, sm_scale=0.125, seq_lens=lens, block_table=table,
                                  plan_for=(9, 0), num_splits=3)[0][2]["SITE"].PAIRS
        for kernel, args, kwargs, grid in launches:
            kernel[grid](*args, **kwargs)
        ref, ref_lse = _reference(q.double(), k.double(), v.double(), lens, score_mod=ref_mod, scale=0.125)
        _check(out, lse, ref, ref_lse, torch.float16)


@pytest.mark.parametrize("explicit_offset", [False, True], ids=["last_tokens", "q_offset"])
def test_causal_mask_mod_sees_absolute_positions(cpu_kernels, explicit_offset):
    q, k, v = _inputs(2, 4, 2, 3, 40, 16)
    lens = torch.tensor([40, 30], dtype=torch.int32)
    # explicit: the new tokens sit before the end (a chunk whose later keys are already cached)
    first = torch.tensor([20, 3], dtype=torch.int32) if explicit_offset else None
    out, lse = decode_attention(q, k, v, seq_lens=lens, q_offset=first, num_splits=2,
                                mask_mod=load_mod(CAUSAL_TL))
    ref, ref_lse = _reference(q, k, v, lens, first, mask_mod=mods.causal)
    _check(out, lse, ref, ref_lse, torch.float32)


def test_score_mods_with_per_row_heads(cpu_kernels):
    """Packed rows span the GQA group's heads: a mod reading h must see each row's own head."""
    q, k, v = _inputs(1, 4, 1, 2, 40, 16)
    lens = torch.tensor([33], dtype=torch.int32)
    bias = torch.randn(4)
    out, lse = decode_attention(q, k, v, seq_lens=lens, num_splits=2,
                                score_mod=load_mod(SOFTCAP_BIAS_TL), score_bufs=(bias,))
    ref, ref_lse = _reference(q, k, v, lens, score_mod=lambda s, b, h, qi, ki:
                              4.0 * torch.tanh(s / 4.0) + bias.double()[h])
    _check(out, lse, ref, ref_lse, torch.float32)

    gm, _ = trace_mod(mods.alibi(4), "score")   # generated, sm_scaled: folded into qk_scale2
    out, lse = decode_attention(q, k, v, seq_lens=lens, num_splits=1,
                                score_mod=load_mod(generate_mod_source(gm, "score", [])))
    ref, ref_lse = _reference(q, k, v, lens, score_mod=mods.alibi(4))
    _check(out, lse, ref, ref_lse, torch.float32)


@pytest.mark.parametrize("splits", [1, 3])
def test_fully_masked_rows_give_zero_and_neg_inf(cpu_kernels, splits):
    lens = torch.tensor([32, 5, 0], dtype=torch.int32)   # an empty cache: every row masked
    q, k, v = _inputs(3, 4, 2, 1, 32, 16)
    out, lse = decode_attention(q, k, v, seq_lens=lens, num_splits=splits,
                                mask_mod=load_mod(HIDE_HEAD1_TL))
    assert torch.all(out[:, 1] == 0) and torch.all(lse[:, 1].isneginf())
    assert torch.all(out[2] == 0) and torch.all(lse[2].isneginf())
    ref, ref_lse = _reference(q, k, v, lens, mask_mod=lambda b, h, qi, ki: (h != 1) & (ki >= 0))
    _check(out, lse, ref, ref_lse, torch.float32)


def test_prepared_launches_read_lengths_at_run_time(cpu_kernels):
    """What a CUDA graph replay relies on: the same launches, lengths changed in place."""
    q, k, v = _inputs(2, 2, 1, 1, 48, 16)
    k_pages, v_pages, table = _paged(k, v, 16)
    lens = torch.tensor([48, 10], dtype=torch.int32)
    out, lse = torch.empty_like(q), torch.empty(2, 2, 1)
    launches = prepare_decode(q, k_pages, v_pages, out, lse, sm_scale=0.25, seq_lens=lens,
                              block_table=table, num_splits=2)
    for new_lens in ([48, 10], [17, 33]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        for kernel, args, kwargs, grid in launches:
            kernel[grid](*args, **kwargs)
        ref, ref_lse = _reference(q, k, v, lens, scale=0.25)
        _check(out, lse, ref, ref_lse, torch.float32)


@pytest.mark.parametrize("paged", [False, True])
def test_lengths_outside_the_cache_are_clamped(cpu_kernels, paged):
    """A length past the capacity (or negative) reads no key outside the cache or the table: it
    counts as the capacity (or 0). The host never sees the lengths, so the kernel clamps them."""
    q, k, v = _inputs(2, 2, 1, 1, 32, 16)
    cache = _paged(k, v, 16, spare=0) if paged else (k, v, None)
    out, lse = decode_attention(q, cache[0], cache[1], block_table=cache[2], num_splits=2,
                                seq_lens=torch.tensor([1000, -3], dtype=torch.int32))
    ref, ref_lse = _reference(q, k, v, torch.tensor([32, 0]))
    _check(out, lse, ref, ref_lse, torch.float32)


def test_split_count_fills_the_sms_and_keeps_splits_long():
    assert choose_num_splits(8, 8, 8192, 64, 132) == 2          # 64 programs -> 128
    assert choose_num_splits(1, 8, 131072, 64, 132) == 16        # 1x1x128k: 128 programs
    assert choose_num_splits(1, 8, 131072, 64, 132, paged=True) == 33   # paged: 264 programs
    assert choose_num_splits(64, 8, 8192, 64, 132) == 3          # 512 programs: 1.3 waves -> 3.9
    assert choose_num_splits(64, 32, 8192, 64, 132) == 1         # 2048: 5.2 waves, tail small
    assert choose_num_splits(32, 8, 8192, 64, 132) == 1          # 256: all resident at once
    assert choose_num_splits(64, 8, 8192, 64, 132, resident=1) == 1   # 512 over 132: 3.9 waves
    assert choose_num_splits(1, 1, 300, 64, 132) == 1            # too short to split
    assert choose_num_splits(1, 1, 1 << 22, 64, 132) == 128      # capped


def test_unsupported_inputs_say_what_to_do(cpu_kernels):
    q, k, v = _inputs(1, 2, 1, 1, 32, 16)
    out, lse = torch.empty_like(q), torch.empty(1, 2, 1)
    lens = torch.tensor([32], dtype=torch.int32)
    table = torch.zeros(1, 2, dtype=torch.int32)
    pages = torch.randn(4, 16, 1, 16)
    with pytest.raises(ValueError, match=r"block_table must be a \[B=1, max_pages\] int32"):
        prepare_decode(q, pages, pages, out, lse, sm_scale=1.0, seq_lens=lens,
                       block_table=table.long())
    with pytest.raises(ValueError, match="differ in"):
        prepare_decode(q, pages, pages[:, :8], out, lse, sm_scale=1.0, seq_lens=lens,
                       block_table=table)
    with pytest.raises(ValueError, match="needs seq_lens"):
        prepare_decode(q, pages, pages, out, lse, sm_scale=1.0, block_table=table)
    with pytest.raises(ValueError, match="int32"):
        prepare_decode(q, k, v, out, lse, sm_scale=1.0, seq_lens=lens.long())
    with pytest.raises(ValueError, match="decode_attention"):
        prepare_decode(q.bfloat16(), k.bfloat16(), v.bfloat16(), out.bfloat16(), lse, sm_scale=1.0)


def _sm90_cache(D, page):
    """(k, the paged keywords) of the compile tests' bf16 cache, 2 x 2048 keys over 2 kv heads: contiguous
    (page 0) or pages of ``page`` keys in table order."""
    if not page:
        return torch.randn(2, 2, 2048, D, dtype=torch.bfloat16), {}
    return (torch.randn(4096 // page, page, 2, D, dtype=torch.bfloat16),
            dict(block_table=torch.arange(4096 // page, dtype=torch.int32).view(2, -1), page_size=page))


@pytest.mark.sm90_compile
def test_sm90_compile_no_spills():
    """The split kernel (its merge included) compiles for sm90 without spills, K/V read by 16-byte cp.async
    (LDGSTS.128): D 64 / 128 paged (pages of 64: D128's 64-key tile is one page, one table entry a tile;
    D64's 128-key tile spans two; pages of 16: four a tile), D128 contiguous, and 128 packed rows (GQA 32 x
    4 tokens, 8 warps); registers and shared memory reported."""
    import re

    from fa3_inductor.templates.aot import sass_report
    from fa3_inductor.templates.decode import compile_decode

    reports, kv_loops = [], {}
    for D, group, M_new, page in ((64, 4, 1, 64), (128, 4, 1, 64), (128, 4, 1, 16), (128, 4, 1, 0),
                                  (128, 32, 4, 0)):
        q = torch.randn(2, 2 * group, M_new, D, dtype=torch.bfloat16)
        lens = torch.tensor([2048, 1000], dtype=torch.int32)
        paged = page > 0
        k, extra = _sm90_cache(D, page)
        kernels = compile_decode(q, k, k, torch.empty_like(q), torch.empty(q.shape[:3]),
                                 sm_scale=D ** -0.5, seq_lens=lens, num_splits=8, **extra)
        assert len(kernels) == 1
        for name, ck in zip(("split",), kernels):
            r = sass_report(ck)
            wide = len(re.findall(r"LDGSTS\.E\.BYPASS\.128", r.sass))
            reports.append(f"D{D} {group * M_new} rows {f'pages of {page}' if paged else 'contiguous'} {name}: "
                           f"{r.registers} registers, {r.spill_instructions} spills, {r.shared} B "
                           f"shared, {wide} LDGSTS.128")
            assert r.stack == 0 and r.local == 0 and r.spill_instructions == 0, reports[-1]
            assert wide > 0 and "ATOM" in r.sass, reports[-1]   # the arrival count
            kv_loops[D, group * M_new, page] = max(len(b) for b in r.inner_loops() if any("MMA" in t for t in b))
    # TMA builds (DecodeConfig.tma): whole tiles by UTMALDG, no cp.async of K / V tiles
    import dataclasses

    from fa3_inductor.templates.decode.configs import decode_config
    for D, page in ((128, 0), (128, 64), (64, 0)):
        q = torch.randn(2, 8, 1, D, dtype=torch.bfloat16)
        k, extra = _sm90_cache(D, page)
        cfg = dataclasses.replace(decode_config(D, (9, 0), paged=page > 0), tma=True)
        [ck] = compile_decode(q, k, k, torch.empty_like(q), torch.empty(q.shape[:3]), sm_scale=D ** -0.5,
                              seq_lens=torch.tensor([2048, 1000], dtype=torch.int32), num_splits=8, config=cfg,
                              **extra)
        r = sass_report(ck)
        reports.append(f"D{D} TMA {f'pages of {page}' if page else 'contiguous'}: {r.registers} registers, "
                       f"{r.spill_instructions} spills, {r.shared} B shared, {r.sass.count('UTMALDG')} UTMALDG")
        assert r.stack == 0 and r.local == 0 and r.spill_instructions == 0, reports[-1]
        [loop] = [b for b in r.inner_loops() if any("MMA" in t for t in b)]
        assert any("UTMALDG" in t for t in loop) and not any("LDGSTS.E.BYPASS.128" in t for t in loop), reports[-1]
    # A page holding whole tiles is read as a contiguous cache's tile (one table entry a step): D128's
    # KV step within 10% of the contiguous one's instructions (422 / 403 on Triton 3.6, 2 x 1000 keys; pages of
    # 16, a table entry a row: 729)
    assert kv_loops[128, 4, 64] <= 1.1 * kv_loops[128, 4, 0] < kv_loops[128, 4, 16], kv_loops
    print("\n".join(reports))
