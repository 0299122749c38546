"""The decode family (templates/decode/family.py) through both front doors: flex() with a short
query and torch.compile(backend="fa3") of a decode step; the plan's choice and its reasons.
CPU interpreter, tiny shapes, float64 references with FlexAttention's semantics (q_idx from 0)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fa3_inductor
from fa3_inductor import mods
from fa3_inductor.templates.decode.family import DECODE
from fa3_inductor.templates.family import NOT_MEANT_HERE, SiteFacts
from fa3_inductor.templates.registry import candidates
from reference import assert_lse_matches, assert_matches_reference, reference_attention


@pytest.fixture(autouse=True)
def needs_the_interpreter():
    from triton import knobs

    if not knobs.runtime.interpret and not torch.cuda.is_available():
        pytest.skip("our kernels need CUDA or TRITON_INTERPRET=1")


def _qkv(B, HQ, HKV, M, N, D, dtype=torch.float32):
    return (torch.randn(B, HQ, M, D, dtype=dtype), torch.randn(B, HKV, N, D, dtype=dtype),
            torch.randn(B, HKV, N, D, dtype=dtype))


def _site(query_len, q_heads=32, kv_heads=8, **kw):
    return SiteFacts(torch.device("cpu"), torch.float16, 128, 128, query_len=query_len,
                     q_heads=q_heads, kv_heads=kv_heads, needs_max=kw.pop("needs_max", False), **kw)


def test_serves_short_queries_only_with_reasons():
    assert DECODE.serves(_site(1)) is None
    assert DECODE.serves(_site(4)) is None                    # 4 tokens x group 4 = 16 rows
    assert DECODE.serves(_site(4096)) == NOT_MEANT_HERE       # prefill: no note
    assert DECODE.serves(_site(None)) == NOT_MEANT_HERE       # a dynamic length
    assert "256 packed rows" in DECODE.serves(_site(4, q_heads=64, kv_heads=1))
    assert "max_scores" in DECODE.serves(_site(1, needs_max=True))
    assert DECODE.serves(_site(1, fp8=True)) == NOT_MEANT_HERE
    fams, _ = candidates(_site(1))
    assert fams[0].name == "decode"
    fams, notes = candidates(_site(2048))
    assert "decode" not in [f.name for f in fams] and not notes


@pytest.mark.parametrize("HQ, HKV, M, dtype", [
    (8, 2, 1, torch.float32),    # GQA 4
    (4, 4, 3, torch.bfloat16),   # MHA, speculative tokens
    (4, 1, 2, torch.float16),    # MQA
])
def test_flex_short_query_runs_decode(HQ, HKV, M, dtype):
    q, k, v = _qkv(2, HQ, HKV, M, 80, 16, dtype)
    out, lse = fa3_inductor.flex(q, k, v, score_mod=mods.softcap(5.0), enable_gqa=HQ != HKV,
                                 return_lse=True)
    assert fa3_inductor.last_template() == "decode"
    ref, ref_lse = reference_attention(q, k, v, mods.softcap(5.0))
    assert_matches_reference(out, ref, dtype)
    assert_lse_matches(lse, ref_lse, dtype)


def test_masks_one_block_and_block_sparse():
    """mask_mod on a cache that one mask block covers, then a block-sparse sliding window whose
    tables skip KV blocks (blocks of 32 keys over 160), with fully masked rows (head 1)."""
    q, k, v = _qkv(2, 4, 2, 2, 160, 16)
    pos = torch.tensor([150, 40])   # each batch's query position: a window behind it

    def window(b, h, q_idx, kv_idx):
        p = pos[b] + q_idx
        return (kv_idx <= p) & (p - kv_idx < 48) & (h != 1)

    out = fa3_inductor.flex(q, k, v, mask_mod=window, enable_gqa=True)
    assert fa3_inductor.last_template() == "decode"
    ref, _ = reference_attention(q, k, v, mask_mod=window)
    assert_matches_reference(out, ref, torch.float32)
    assert torch.all(out[:, 1] == 0)

    bm = create_block_mask(window, 2, None, 2, 160, device="cpu", BLOCK_SIZE=(32, 32))
    out = fa3_inductor.flex(q, k, v, block_mask=bm, enable_gqa=True)
    assert fa3_inductor.last_template() == "decode"
    assert_matches_reference(out, ref, torch.float32)


def test_shared_batch_one_cache_and_a_wider_value_head():
    q = torch.randn(3, 4, 1, 16)
    k, v = torch.randn(1, 2, 48, 16), torch.randn(1, 2, 48, 32)
    def first_40(b, h, q_idx, kv_idx):   # flex broadcasts a batch-1 cache only under a mask
        return kv_idx < 40

    bm = create_block_mask(first_40, 3, None, 1, 48, device="cpu")
    out = fa3_inductor.flex(q, k, v, block_mask=bm, enable_gqa=True)
    assert fa3_inductor.last_template() == "decode" and out.shape == (3, 4, 1, 32)
    ref, _ = reference_attention(q, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1),
                                 mask_mod=first_40)
    assert_matches_reference(out, ref, torch.float32)


def test_compiled_decode_step_and_explain(fresh_compiles):
    """torch.compile(backend="fa3") of a step calling flex_attention with one new token."""
    q, k, v = _qkv(2, 8, 2, 1, 64, 16)
    scale = 1 / math.sqrt(16)

    def step(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + 0.01 * ki,
                              enable_gqa=True, scale=scale)

    with torch.no_grad():
        report = fa3_inductor.explain(step, q, k, v)
        assert [s.template for s in report.sites] == ["decode"]
        out = torch.compile(step, backend="fa3")(q, k, v)
    assert fa3_inductor.last_template() == "decode"
    ref, _ = reference_attention(q, k, v, lambda s, b, h, qi, ki: s + 0.01 * ki, scale=scale)
    assert_matches_reference(out, ref, torch.float32)


def test_describe_names_the_tma_plan_on_sm90(monkeypatch):
    """explain()'s note for a decode site says when K / V come by TMA (configs.tma_tiles: GQA D64 on sm90)."""
    from fa3_inductor.templates.decode import family as decode_family
    from fa3_inductor.templates.family import SiteFacts

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))   # SiteFacts.capability

    def note(D, q_heads):
        return decode_family.FAMILY.describe(SiteFacts(torch.device("cuda"), torch.bfloat16, D, D, query_len=1,
                                                       q_heads=q_heads, kv_heads=8, needs_max=False))

    assert "TMA in 256-key tiles" in note(64, 32)
    assert "TMA" not in note(128, 32) and "TMA" not in note(64, 8)
