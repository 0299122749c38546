"""flex(block_mask=<a BlockMask the user built>) against flex(mask_mod=...): same launch, right answers.

A user who builds ``create_block_mask(mods.causal, None, None, n, n)`` and passes ``block_mask=`` gets
exactly the launch ``mask_mod=mods.causal`` gets: one plan (cached by what the mask_mod computes and the
block size), the same tables (torch's builder, same arguments), hence one launch key (runtime/ops.py):
on CUDA the same launch-cache entry, the same compiled kernel, grid and schedule. A BlockMask sparser
than its mask_mod, or with another block size, or cut to other lengths, keeps its own tables: the
kernel attends where the mask_mod allows AND the block is listed.

Runs our kernels on CPU tensors under the interpreter, through flex()'s direct path (CUDA's inference
path: api.DIRECT_ON_CPU) and, for the causal mask, its compiled path too.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

import fa3_inductor
from fa3_inductor import api, block_masks, direct, mods
from fa3_inductor.block_masks import _ordered   # (blocks per row, their indices) of a block boolean
from fa3_inductor.runtime.fast_launch import tensor_signature
from fa3_inductor.runtime.ops import _launch_key
from reference import assert_matches_reference, reference_attention

S, D = 384, 16     # three 128-blocks each way


@pytest.fixture
def direct_path(monkeypatch, cpu_kernels):
    monkeypatch.setattr(api, "DIRECT_ON_CPU", True)
    direct.clear()
    block_masks.clear()
    yield
    direct.clear()
    block_masks.clear()


def _qkv(M=S, N=S, dtype=torch.float16):
    torch.manual_seed(0)
    return (torch.randn(1, 2, M, D, dtype=dtype), torch.randn(1, 2, N, D, dtype=dtype),
            torch.randn(1, 2, N, D, dtype=dtype))


def _members(bm: BlockMask, M: int, N: int) -> torch.Tensor:
    """[M, N] bool: the positions whose block the BlockMask lists (partial or full)."""
    dense = bm.to_dense()[0, 0].bool()
    bq, bkv = bm.BLOCK_SIZE
    return dense.repeat_interleave(bq, 0)[:M].repeat_interleave(bkv, 1)[:, :N]


def _mask_and_blocks(mask_mod, bm: BlockMask, M: int, N: int):
    member = _members(bm, M, N)

    def keep(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx, kv_idx) & member[q_idx, kv_idx]
    return keep


def _launches(monkeypatch) -> list:
    """Record (plan, tables, sparse_q, sparse_kv) of every direct-path launch."""
    seen: list = []
    plan_of, tables_of = direct.cached_plan, direct.block_mask_tables

    def cached_plan(*args, **kwargs):
        seen.append([plan_of(*args, **kwargs)])
        return seen[-1][0]

    def block_mask_tables(block_mask):
        out = tables_of(block_mask)
        seen[-1].extend(out)
        return out

    monkeypatch.setattr(direct, "cached_plan", cached_plan)
    monkeypatch.setattr(direct, "block_mask_tables", block_mask_tables)
    return seen


def test_a_create_block_mask_causal_mask_launches_what_mask_mod_launches(direct_path, monkeypatch):
    q, k, v = _qkv()
    seen = _launches(monkeypatch)
    by_mod = fa3_inductor.flex(q, k, v, mask_mod=mods.causal)
    bm = create_block_mask(mods.causal, None, None, S, S, device="cpu")
    by_mask = fa3_inductor.flex(q, k, v, block_mask=bm)
    (plan_a, tables_a, sq_a, skv_a), (plan_b, tables_b, sq_b, skv_b) = seen
    assert len(direct._PLANS) == 1           # planned once: the second call found the first's plan
    assert plan_a.spec is not None and plan_a.spec == plan_b.spec
    assert (sq_a, skv_a) == (sq_b, skv_b) == (128, 128)
    assert tensor_signature(tables_a) == tensor_signature(tables_b)
    assert all(torch.equal(a, b) for a, b in zip(tables_a, tables_b))

    def key(tables, sq, skv):
        lse = torch.empty(1, 2, S)
        return _launch_key(plan_a.spec, D ** -0.5, sq, skv, 0, (q, k, v, torch.empty_like(q), lse,
                                                                  lse, *tables))
    # CUDA: one launch-cache entry serves both (same kernel, grid, schedule)
    assert key(tables_a, sq_a, skv_a) == key(tables_b, sq_b, skv_b)
    assert torch.equal(by_mod, by_mask)
    assert_matches_reference(by_mask, reference_attention(q, k, v, None, mods.causal)[0],
                             torch.float16)


def test_a_create_block_mask_causal_mask_on_the_compiled_path(cpu_kernels):
    q, k, v = _qkv(dtype=torch.float32)
    bm = create_block_mask(mods.causal, None, None, S, S, device="cpu")
    out = fa3_inductor.flex(q, k, v, block_mask=bm)
    assert_matches_reference(out, reference_attention(q, k, v, None, mods.causal)[0], torch.float32)


def _sparser_than_causal() -> BlockMask:
    """causal at 128 x 128 blocks with the full block (2, 0) and the diagonal block (1, 1) dropped."""
    full = torch.tensor([[0, 0, 0], [1, 0, 0], [0, 1, 0]], dtype=torch.bool).view(1, 1, 3, 3)
    partial = torch.tensor([[1, 0, 0], [0, 0, 0], [0, 0, 1]], dtype=torch.bool).view(1, 1, 3, 3)
    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=(128, 128),
                                    mask_mod=mods.causal, seq_lengths=(S, S))


def test_blocks_absent_from_the_block_mask_are_skipped(direct_path, monkeypatch):
    q, k, v = _qkv()
    seen = _launches(monkeypatch)
    causal = fa3_inductor.flex(q, k, v, mask_mod=mods.causal)
    bm = _sparser_than_causal()
    out = fa3_inductor.flex(q, k, v, block_mask=bm)
    assert fa3_inductor.last_template() == "generic"
    assert len(direct._PLANS) == 1 and seen[0][0].spec == seen[1][0].spec   # one plan: the kernel
    assert not torch.equal(seen[0][1][0], seen[1][1][0])   # reads each call's tables: the sparser's
    ref = reference_attention(q, k, v, None, _mask_and_blocks(mods.causal, bm, S, S))[0]
    assert_matches_reference(out, ref, torch.float16)
    assert (out[:, :, 128:].float() - causal[:, :, 128:].float()).abs().max() > 0.1
    # a later mask_mod call is not served the sparser mask's launch, nor the other way round
    assert torch.equal(fa3_inductor.flex(q, k, v, mask_mod=mods.causal), causal)
    assert torch.equal(fa3_inductor.flex(q, k, v, block_mask=bm), out)


@pytest.mark.parametrize("block", [(256, 128), (128, 256)])
def test_another_block_size_is_kept(direct_path, block):
    q, k, v = _qkv(M=512, N=512)
    bm = create_block_mask(mods.sliding_window(100), None, None, 512, 512, device="cpu",
                           BLOCK_SIZE=block)
    out = fa3_inductor.flex(q, k, v, block_mask=bm)
    assert fa3_inductor.last_template() == "generic"
    ref = reference_attention(q, k, v, None, mods.sliding_window(100))[0]
    assert_matches_reference(out, ref, torch.float16)


def test_a_block_mask_for_other_lengths_is_refused_or_adjusted(direct_path):
    q, k, v = _qkv()
    longer = create_block_mask(mods.causal, None, None, 512, 512, device="cpu")
    with pytest.raises(ValueError, match="q_len=512"):
        fa3_inductor.flex(q, k, v, block_mask=longer)
    out = fa3_inductor.flex(q, k, v, block_mask=longer._adjust(S, S))
    assert_matches_reference(out, reference_attention(q, k, v, None, mods.causal)[0], torch.float16)
