"""flex(mask_mod=...) builds each block mask once (fa3_inductor/block_masks.py)."""

from __future__ import annotations

import functools

import pytest
import torch

import fa3_inductor
from fa3_inductor import block_masks, mods
from reference import assert_matches_reference, reference_attention


@pytest.fixture(autouse=True)
def _empty_cache():
    block_masks.clear()
    yield
    block_masks.clear()


def _qkv(B=1, H=2, M=48, N=48, D=16, dtype=torch.float32):
    return (torch.randn(B, H, M, D, dtype=dtype), torch.randn(B, H, N, D, dtype=dtype),
            torch.randn(B, H, N, D, dtype=dtype))


def test_a_fresh_closure_of_the_same_mask_reuses_the_block_mask():
    q, k, _ = _qkv()
    first = block_masks.cached_block_mask(mods.sliding_window(8), q, k)
    again = block_masks.cached_block_mask(mods.sliding_window(8), q, k)
    assert again is first
    assert block_masks.stats()["built"] == 1 and block_masks.stats()["reused"] == 1
    other = block_masks.cached_block_mask(mods.sliding_window(9), q, k)
    assert other is not first and block_masks.stats()["built"] == 2


def test_new_lengths_build_a_new_block_mask():
    q, k, _ = _qkv(M=48, N=48)
    q2, k2, _ = _qkv(M=40, N=56)
    a = block_masks.cached_block_mask(mods.causal, q, k)
    b = block_masks.cached_block_mask(mods.causal, q2, k2)
    assert a.shape[-2:] == (48, 48) and b.shape[-2:] == (40, 56)


def test_only_the_dimensions_a_mask_reads_enter_its_key():
    q, k, _ = _qkv(B=2, H=3)

    def head_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (h == 0)

    assert block_masks.cached_block_mask(mods.causal, q, k).shape[:2] == (1, 1)
    assert block_masks.cached_block_mask(head_mask, q, k).shape[:2] == (1, 3)
    q4, k4, _ = _qkv(B=2, H=4)
    assert block_masks.cached_block_mask(head_mask, q4, k4).shape[:2] == (1, 4)
    # causal ignores b and h: other head counts reuse its mask
    assert block_masks.cached_block_mask(mods.causal, q4, k4) is \
        block_masks.cached_block_mask(mods.causal, q, k)


def test_an_in_place_edit_of_a_captured_tensor_rebuilds_the_mask(cpu_kernels):
    S = 64
    doc_ids = (torch.arange(S) // 40).to(torch.int32)
    q, k, v = _qkv(M=S, N=S)
    out = fa3_inductor.flex(q, k, v, mask_mod=mods.document(doc_ids))
    assert_matches_reference(out, reference_attention(q, k, v, None, mods.document(doc_ids))[0],
                             torch.float32)
    doc_ids[:] = (torch.arange(S) // 16).to(torch.int32)     # new documents, same tensor
    out = fa3_inductor.flex(q, k, v, mask_mod=mods.document(doc_ids))
    assert block_masks.stats()["built"] == 2
    assert_matches_reference(out, reference_attention(q, k, v, None, mods.document(doc_ids))[0],
                             torch.float32)


def test_repeated_flex_calls_build_the_mask_once(cpu_kernels):
    q, k, v = _qkv()
    ref, _ = reference_attention(q, k, v, None, mods.causal)
    for _ in range(3):
        assert_matches_reference(fa3_inductor.flex(q, k, v, mask_mod=mods.causal), ref,
                                 torch.float32)
    assert block_masks.stats()["built"] == 1 and block_masks.stats()["reused"] == 2


def test_an_unkeyable_mask_is_rebuilt_every_call():
    q, k, _ = _qkv()

    def window(b, h, q_idx, kv_idx, w):
        return (q_idx - kv_idx < w) & (kv_idx <= q_idx)

    block_masks.cached_block_mask(functools.partial(window, w=4), q, k)
    block_masks.cached_block_mask(functools.partial(window, w=4), q, k)
    assert block_masks.stats() == {"built": 2, "reused": 0, "cached": 0}


def test_the_cache_is_bounded():
    q, k, _ = _qkv(M=16, N=16)
    for w in range(block_masks.MAX_MASKS + 5):
        block_masks.cached_block_mask(mods.sliding_window(w + 1), q, k)
    assert block_masks.stats()["cached"] == block_masks.MAX_MASKS


def test_masks_larger_than_max_elements_are_built_in_chunks(monkeypatch):
    """Past MAX_ELEMENTS mask entries the mask is evaluated a few block rows at a time (torch's
    eager builder would take 2 bytes per query-key pair) and equals create_block_mask's."""
    from torch.nn.attention.flex_attention import create_block_mask

    monkeypatch.setattr(block_masks, "MAX_ELEMENTS", 128 * 400)
    q, k, _ = _qkv(H=2, M=300, N=400)
    calls = []
    real = block_masks.chunked_block_mask
    monkeypatch.setattr(block_masks, "chunked_block_mask",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    doc = torch.randint(0, 3, (400,)).sort().values
    for mask_mod in (mods.causal, mods.document(doc), mods.sliding_window(100)):
        got = block_masks.cached_block_mask(mask_mod, q, k)
        want = create_block_mask(mask_mod, None, None, 300, 400, device="cpu")
        for name in ("kv_num_blocks", "full_kv_num_blocks"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert torch.equal(got.to_dense(), want.to_dense())
    assert len(calls) == 3
