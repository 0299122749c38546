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


def _applied(bm, mask_mod, B, M, N):
    """What a kernel computes from ``bm``: full blocks kept whole, partial ones through mask_mod, the rest dropped;
    (B, M, N) booleans."""
    block = bm.BLOCK_SIZE[0]
    dense = torch.zeros(B, -(-M // block) * block, -(-N // block) * block, dtype=torch.bool)
    b, q, kv = torch.meshgrid(torch.arange(B), torch.arange(M), torch.arange(N), indexing="ij")
    wanted = mask_mod(b, 0, q, kv)
    for z in range(B):
        for i in range(dense.shape[1] // block):
            rows = slice(i * block, (i + 1) * block)
            for num, idx, full in ((bm.kv_num_blocks, bm.kv_indices, False),
                                   (bm.full_kv_num_blocks, bm.full_kv_indices, True)):
                for j in idx[z, 0, i, :num[z, 0, i]].tolist():
                    cols = slice(j * block, (j + 1) * block)
                    dense[z, rows, cols] = True if full else \
                        torch.nn.functional.pad(wanted[z], (0, dense.shape[2] - N, 0, dense.shape[1] - M))[rows, cols]
    return dense[:, :M, :N], wanted


@pytest.mark.parametrize("causal", [False, True])
def test_length_block_mask_applies_exactly_its_mask(causal):
    """length_block_mask (flex_decode's prefill chunks): its full blocks hold only kept pairs, its partial ones all
    the rest that are kept, for lengths of 0, shorter than the chunk and past a block edge, positions given (one
    negative) or at the end of each sequence, and a key count that is no multiple of the block."""
    M, N, block = 150, 300, 64
    lens = torch.tensor([0, 100, 300, 257], dtype=torch.int32)
    for first in (lens - M, torch.tensor([5, -40, 120, 107], dtype=torch.int32)):
        def keep(b, h, q_idx, kv_idx, first=first):
            kept = kv_idx < lens[b]
            return kept & ((q_idx + first[b]).clamp_min(0) >= kv_idx) if causal else kept

        bm = block_masks.length_block_mask(lens, first, M, N, causal, keep, block=block)
        applied, wanted = _applied(bm, keep, len(lens), M, N)
        assert torch.equal(applied, wanted)
        assert block_masks.stats()["built"] == 0   # nothing evaluated the mask to make it


def test_fresh_tensors_of_the_same_mask_are_not_traced_again(monkeypatch):
    """Whether a mask reads b / h follows from its code: a mask over new tensors each call (new ids, so a new block
    mask) reuses the first trace's answer."""
    traced = []
    real = block_masks._mask_facts
    monkeypatch.setattr(block_masks, "_mask_facts", lambda fn: traced.append(fn) or real(fn))
    q, k, _ = _qkv(M=32, N=32)
    for _ in range(3):
        block_masks.cached_block_mask(mods.document(torch.randint(0, 3, (32,)).sort().values), q, k)
    assert block_masks.stats()["built"] == 3 and len(traced) == 1


def test_elementwise_masks_are_built_on_broadcast_indices_as_torch_builds_them(monkeypatch):
    """A mask modgen generates is evaluated once on broadcast index tensors (no vmap; create_mask is never called),
    and its block mask equals create_block_mask's: masks reading b and h, captured tensors, ragged lengths."""
    from torch.nn.attention.flex_attention import create_block_mask

    monkeypatch.setattr(block_masks, "create_mask", lambda *a, **kw: pytest.fail("vmap evaluation used"))
    lens = torch.tensor([300, 170])
    doc = torch.randint(0, 4, (300,)).sort().values

    def per_batch(b, h, q_idx, kv_idx):
        return (kv_idx < lens[b]) & (q_idx >= kv_idx)

    def per_head(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx < 64 * (h + 1)) & (q_idx >= kv_idx)

    for mask_mod in (mods.causal, mods.sliding_window(100), mods.document(doc), mods.prefix_lm(50), per_batch,
                     per_head):
        q, k, _ = _qkv(B=2, H=3, M=300, N=300)
        facts = block_masks._mask_facts(mask_mod)
        assert facts[2], mask_mod
        got = block_masks.build_block_mask(mask_mod, q, k)
        B, H = (2 if facts[0] else None), (3 if facts[1] else None)
        want = create_block_mask(mask_mod, B, H, 300, 300, device="cpu")
        for name in ("kv_num_blocks", "full_kv_num_blocks"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (mask_mod, name)
        assert torch.equal(got.to_dense(), want.to_dense()), mask_mod


def test_a_mask_modgen_cannot_generate_is_built_by_vmap():
    """A mask with data-dependent Python is no elementwise mod: torch's vmap evaluates it."""
    def data_dependent(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx if bool(q_idx.sum() >= 0) else q_idx < kv_idx

    assert not block_masks._mask_facts(data_dependent)[2]


def test_a_cached_mask_over_tensors_under_graph_capture_warns(monkeypatch, caplog):
    """Under CUDA graph capture a cached block mask of a mask_mod that reads tensors would not be rebuilt by replays
    that change them: the log says so once and what to do. A mask without tensors says nothing."""
    import logging

    q, k, _ = _qkv(M=32, N=32)
    ids = torch.randint(0, 3, (32,)).sort().values
    block_masks.cached_block_mask(mods.document(ids), q, k)
    block_masks.cached_block_mask(mods.causal, q, k)
    monkeypatch.setattr(block_masks, "_capturing", lambda: True)
    with caplog.at_level(logging.WARNING):
        block_masks.cached_block_mask(mods.causal, q, k)
        assert "CUDA graph" not in caplog.text
        block_masks.cached_block_mask(mods.document(ids), q, k)
    assert "CUDA graph is capturing" in caplog.text and "block_mask=" in caplog.text
