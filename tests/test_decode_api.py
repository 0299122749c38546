"""fa3_inductor.flex_decode: the paged serving layout, device lengths, prefill against a paged
cache (gathered), torch's experimental PagedAttention interop, and a host path that never reads a
device value. CPU interpreter, tiny shapes, float64 references."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask
from torch.utils._python_dispatch import TorchDispatchMode

import fa3_inductor
from fa3_inductor import flex_decode, mods
from fa3_inductor.decode import paged_attention_layout
from reference import assert_lse_matches, assert_matches_reference, reference_attention


@pytest.fixture(autouse=True)
def needs_the_interpreter():
    from triton import knobs

    if not knobs.runtime.interpret:   # the tensors here are CPU ones: without it torch's flex runs them
        pytest.skip("these CPU-tensor tests run our kernels under TRITON_INTERPRET=1 only")


def _paged_cache(B, HKV, N, D, page, spare=2, dtype=torch.float32):
    """A contiguous cache [B, HKV, N, D] and the same keys in a shuffled page pool."""
    k, v = (torch.randn(B, HKV, N, D, dtype=dtype) for _ in range(2))
    per = N // page
    order = torch.randperm(B * per + spare)[:B * per]
    pools = []
    for t in (k, v):
        pool = torch.randn(B * per + spare, page, HKV, D, dtype=dtype)
        pool[order] = t.view(B, HKV, per, page, D).permute(0, 2, 3, 1, 4).reshape(-1, page, HKV, D)
        pools.append(pool)
    return k, v, pools[0], pools[1], order.view(B, per).to(torch.int32)


def _reference(q, k, v, lens, first, score_mod=None, mask_mod=None):
    """Float64, batch by batch over its first lens[b] keys, queries at first[b] + i."""
    outs, lses = [], []
    for b, (L, f) in enumerate(zip(lens.tolist(), first.tolist())):
        sm = score_mod and (lambda s, bb, h, qi, ki, f=f: score_mod(s, bb, h, (qi + f).clamp_min(0), ki))
        mm = mask_mod and (lambda bb, h, qi, ki, f=f: mask_mod(bb, h, (qi + f).clamp_min(0), ki))
        out, lse = reference_attention(q[b:b + 1], k[b:b + 1, :, :L], v[b:b + 1, :, :L], sm, mm)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("M_new, dtype", [(1, torch.float32), (3, torch.bfloat16)])
def test_paged_decode_matches_float64(M_new, dtype):
    k, v, kp, vp, table = _paged_cache(2, 2, 64, 16, 16, dtype=dtype)
    q = torch.randn(2, 8, M_new, 16, dtype=dtype)
    lens = torch.tensor([64, 21], dtype=torch.int32)
    out, lse = flex_decode(q, kp, vp, seq_lens=lens, block_table=table, mask_mod=mods.causal,
                           score_mod=mods.softcap(5.0), return_lse=True)
    assert fa3_inductor.last_template() == "decode"
    ref, ref_lse = _reference(q, k, v, lens, lens - M_new, mods.softcap(5.0), mods.causal)
    assert_matches_reference(out, ref, dtype)
    assert_lse_matches(lse, ref_lse, dtype)
    # the contiguous layout gives the same
    out_c = flex_decode(q, k, v, seq_lens=lens, mask_mod=mods.causal, score_mod=mods.softcap(5.0))
    torch.testing.assert_close(out_c, out, atol=1e-5, rtol=1e-5)


def test_prefill_chunk_against_a_paged_cache_is_gathered():
    """A query too long for the decode kernel (8 heads x 20 tokens = 160 rows) at an explicit
    offset: flex over the gathered pages, lengths and positions in the mods."""
    k, v, kp, vp, table = _paged_cache(2, 1, 64, 16, 16)
    q = torch.randn(2, 8, 20, 16)
    lens = torch.tensor([64, 40], dtype=torch.int32)
    first = torch.tensor([44, 20], dtype=torch.int32)
    out = flex_decode(q, kp, vp, seq_lens=lens, block_table=table, q_offset=first,
                      mask_mod=mods.causal)
    assert fa3_inductor.last_template() != "decode"
    ref, _ = _reference(q, k, v, lens, first, mask_mod=mods.causal)
    assert_matches_reference(out, ref, torch.float32)


@pytest.mark.parametrize("paged", [True, False])
def test_a_causal_window_reads_only_its_keys(paged):
    """flex_decode under a causal sliding window (mods.sliding_window): the decode kernel's splits share the keys
    from the window's edge on. Keys well before the window hold NaN, so a read of them would show (a masked key's
    zero probability times NaN is NaN); the output matches float64, with several splits and 3 new tokens."""
    k, v, kp, vp, table = _paged_cache(2, 2, 512, 16, 16)
    lens = torch.tensor([500, 300], dtype=torch.int32)
    W = 64
    for b, L in enumerate(lens.tolist()):
        stale = max(L - 3 - W - 128, 0)   # below the tile holding row 0's window edge, whatever the tile size
        k[b, :, :stale] = v[b, :, :stale] = float("nan")
        for j in range(stale // 16):
            kp[table[b, j]] = vp[table[b, j]] = float("nan")
    q = torch.randn(2, 8, 3, 16)
    cache = (kp, vp) if paged else (k, v)
    out = flex_decode(q, *cache, seq_lens=lens, block_table=table if paged else None,
                      mask_mod=mods.sliding_window(W), num_splits=4)
    assert fa3_inductor.last_template() == "decode"
    ref, _ = _reference(q, k.nan_to_num(), v.nan_to_num(), lens, lens - 3, mask_mod=mods.sliding_window(W))
    assert not out.isnan().any()
    assert_matches_reference(out, ref, torch.float32)


@pytest.mark.parametrize("paged", [True, False])
def test_prefill_chunk_ignores_nan_in_unwritten_slots(paged):
    """Cache slots at or past a sequence's length were never written and may hold NaN (torch.empty): a gathered
    prefill chunk reads them as zeros (a masked key's zero probability times NaN would be NaN)."""
    k, v, kp, vp, table = _paged_cache(2, 1, 64, 16, 16)
    lens = torch.tensor([40, 17], dtype=torch.int32)
    for b, L in enumerate(lens.tolist()):
        k[b, :, L:] = v[b, :, L:] = float("nan")
        for j in range(64 // 16):
            kp[table[b, j], max(L - 16 * j, 0):] = vp[table[b, j], max(L - 16 * j, 0):] = float("nan")
    q = torch.randn(2, 8, 20, 16)
    cache = (kp, vp) if paged else (k, v)
    out = flex_decode(q, *cache, seq_lens=lens, block_table=table if paged else None, q_offset=lens * 0)
    assert fa3_inductor.last_template() != "decode"
    ref, _ = _reference(q, k, v, lens, lens * 0)
    assert not out.isnan().any()
    assert_matches_reference(out, ref, torch.float32)


@pytest.mark.parametrize("mask_mod, built", [(None, 0), (mods.causal, 0), (mods.sliding_window(12), 1)])
def test_prefill_chunk_block_mask_comes_from_the_lengths(mask_mod, built):
    """A prefill chunk at the end of each sequence (default positions; one sequence shorter than the chunk): without
    a mask_mod or with an exactly causal one the block mask is made from the lengths (block_masks.length_block_mask),
    no mask evaluated for it; another mask_mod is built from the mask. Both against float64."""
    from fa3_inductor import block_masks

    k, v, kp, vp, table = _paged_cache(3, 1, 64, 16, 16)
    q = torch.randn(3, 8, 20, 16)
    lens = torch.tensor([64, 13, 37], dtype=torch.int32)
    block_masks.clear()
    out = flex_decode(q, kp, vp, seq_lens=lens, block_table=table, mask_mod=mask_mod)
    assert block_masks.stats()["built"] == built
    ref, _ = _reference(q, k, v, lens, lens - 20, mask_mod=mask_mod)
    # rows at negative positions (sequence 1 is shorter than the chunk) are at position 0 for the mods
    assert_matches_reference(out, torch.nan_to_num(ref), torch.float32)


@pytest.mark.parametrize("offsets", [False, True])
def test_prefill_chunk_reads_lengths_rewritten_without_a_version_bump(offsets):
    """A CUDA graph or a kernel that rewrites seq_lens (and q_offset) in place moves no version counter (here: a
    write through .data): the next prefill chunk still sees the new values, its block mask made from them."""
    k, v, kp, vp, table = _paged_cache(2, 1, 512, 16, 64)   # 128-key blocks: the lengths move whole blocks
    q = torch.randn(2, 8, 20, 16)
    lens = torch.tensor([512, 200], dtype=torch.int32)
    first = (lens - 20) if offsets else None
    flex_decode(q, kp, vp, seq_lens=lens, block_table=table, q_offset=first, mask_mod=mods.causal)
    versions = lens._version, (first._version if offsets else None)
    lens.data.copy_(torch.tensor([150, 400], dtype=torch.int32))
    if offsets:
        first.data.copy_(lens - 20)
    assert (lens._version, first._version if offsets else None) == versions
    out = flex_decode(q, kp, vp, seq_lens=lens, block_table=table, q_offset=first, mask_mod=mods.causal)
    ref, _ = _reference(q, k, v, lens, lens - 20, mask_mod=mods.causal)
    assert_matches_reference(out, ref, torch.float32)


def test_causal_check_traces_no_mask_that_captures_a_tensor(monkeypatch):
    """The gathered path asks whether a mask is exactly causal: a mask over a captured tensor (new ids each call) is
    answered without generating it; causal itself is."""
    from fa3_inductor import decode

    generated = []
    real = decode.generated_mod
    monkeypatch.setattr(decode, "generated_mod", lambda fn, kind: generated.append(fn) or real(fn, kind))
    assert not decode._exactly_causal(mods.document(torch.zeros(8, dtype=torch.int32)))
    assert generated == []
    assert decode._exactly_causal(mods.causal) and generated == [mods.causal]


def test_torch_paged_attention_interop():
    """torch's experimental PagedAttention fills the cache; flex_decode reads its storage in place
    (paged_attention_layout), and flex() takes its converted BlockMask over the physical cache."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention

    B, H, D, page, n_pages = 2, 2, 16, 32, 8
    paged = PagedAttention(n_pages, page, B, device="cpu")
    k_cache, v_cache = torch.zeros(1, H, n_pages * page, D), torch.zeros(1, H, n_pages * page, D)
    lens = torch.tensor([70, 33], dtype=torch.int32)
    batch = torch.arange(B)
    paged.reserve(batch[:1], torch.tensor([96]))
    paged.reserve(batch[1:], torch.tensor([64]))
    k, v = torch.randn(B, H, 96, D), torch.randn(B, H, 96, D)
    pos = torch.arange(96).expand(B, 96)
    paged.assign(batch[:1], pos[:1], k[:1], v[:1], k_cache, v_cache)
    paged.assign(batch[1:], pos[1:, :64], k[1:, :, :64], v[1:, :, :64], k_cache, v_cache)
    q = torch.randn(B, H, 1, D)
    ref, _ = _reference(q, k, v, lens, lens - 1)

    k_pages, v_pages, table = paged_attention_layout(paged, k_cache, v_cache)
    out = flex_decode(q, k_pages, v_pages, seq_lens=lens, block_table=table)
    assert_matches_reference(out, ref, torch.float32)

    def logical(b, h, q_idx, kv_idx):
        return kv_idx < lens[b]

    bm = create_block_mask(logical, B, None, 1, 96, device="cpu", BLOCK_SIZE=(page, page))
    physical = paged.convert_logical_block_mask(bm)
    out = fa3_inductor.flex(q, k_cache, v_cache, block_mask=physical)
    assert_matches_reference(out, ref, torch.float32)


class _NoHostReads(TorchDispatchMode):
    """Fails on a device-to-host read (what .item(), bool(t), int(t), .tolist() dispatch to)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default):
            raise AssertionError(f"host read of a tensor: {func}")
        return func(*args, **(kwargs or {}))


def test_host_path_reads_no_length():
    """Planning a decode call (both front doors' host code) reads no device value: a CUDA graph
    captures it and replays with new lengths (the replay itself: tests/test_decode_gpu.py)."""
    from fa3_inductor.templates.decode import prepare_decode

    k, v, kp, vp, table = _paged_cache(2, 2, 64, 16, 16)
    q = torch.randn(2, 4, 1, 16)
    lens = torch.tensor([64, 21], dtype=torch.int32)
    out, lse = torch.empty_like(q), torch.empty(2, 4, 1)
    with _NoHostReads():
        prepare_decode(q, kp, vp, out, lse, sm_scale=0.25, seq_lens=lens, block_table=table)
        prepare_decode(q, k, v, out, lse, sm_scale=0.25, q_start_zero=True)


def test_errors_say_what_to_do():
    """Bad shapes, dtypes, tables, lengths and options: a message naming the argument, what it got
    and what to pass (checked before any kernel or gather runs)."""
    k, v, kp, vp, table = _paged_cache(1, 1, 32, 16, 16)
    q = torch.randn(1, 2, 1, 16)
    lens = torch.tensor([32], dtype=torch.int32)
    paged = dict(seq_lens=lens, block_table=table)
    cases = [
        (ValueError, "4-D", lambda: flex_decode(q[0], kp, vp, **paged)),
        (ValueError, "int32 tensor", lambda: flex_decode(q, kp, vp, seq_lens=lens.long(), block_table=table)),
        (ValueError, r"\[B=1\] int32", lambda: flex_decode(q, kp, vp, seq_lens=lens.repeat(2), block_table=table)),
        (TypeError, "torch.full", lambda: flex_decode(q, kp, vp, q_offset=3, **paged)),
        (ValueError, r"block_table must be a \[B=1, max_pages\] int32",
         lambda: flex_decode(q, kp, vp, seq_lens=lens, block_table=table.long())),
        (ValueError, "block_table must be", lambda: flex_decode(q, kp, vp, seq_lens=lens, block_table=table[0])),
        (ValueError, "multiple of the 2 kv heads", lambda: flex_decode(
            torch.randn(1, 3, 1, 16), torch.randn(2, 16, 2, 16), torch.randn(2, 16, 2, 16), **paged)),
        (ValueError, "head dim 32 differs", lambda: flex_decode(torch.randn(1, 2, 1, 32), kp, vp, **paged)),
        (ValueError, "float16, bfloat16", lambda: flex_decode(q.half(), kp, vp, **paged)),
        (ValueError, "differ outside the head dim", lambda: flex_decode(q, kp, vp[:1], **paged)),
        (ValueError, "batch is not q's", lambda: flex_decode(torch.randn(2, 2, 1, 16), k, v,
                                                            seq_lens=lens.repeat(2))),
        (ValueError, "last dim is not contiguous", lambda: flex_decode(
            q, kp, torch.randn(*vp.shape[:-1], 32)[..., ::2], **paged)),
        (ValueError, "num_splits=0", lambda: flex_decode(q, kp, vp, num_splits=0, **paged)),
        (ValueError, "scratch must be", lambda: flex_decode(q, kp, vp, scratch=torch.empty(3), **paged)),
        (TypeError, "mask_mod must be callable", lambda: flex_decode(q, kp, vp, mask_mod=1, **paged)),
        (TypeError, "seq_lens must be a torch.Tensor", lambda: flex_decode(q, kp, vp, seq_lens=[32])),
    ]
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()
    with pytest.raises(ValueError, match="decode_scratch"):
        flex_decode(q, kp, vp, num_splits=2, scratch=(torch.empty(1), torch.empty(1)), **paged)  # no counters
    with pytest.raises(ValueError, match="decode_scratch"):
        flex_decode(q, kp, vp, num_splits=2, scratch=(torch.empty(1), torch.empty(1), torch.zeros(1, dtype=torch.int32)),
                    **paged)
    with pytest.raises(NotImplementedError, match="inference-only"):
        flex_decode(q.requires_grad_(), kp, vp, seq_lens=lens, block_table=table)
