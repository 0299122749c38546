"""CPU (Triton interpreter): the dQ accumulator kept in the wgmma fragments' order (hopper_bwd's dq_frag,
docs/design/hopper_backward.md, "dQ staged in the wgmma fragments' order") is converted back to dQ exactly.

The kernels write each 64 x 64 block of dQ as ``dq.reshape([4, 2, 8, 8, 4, 2]).permute((3, 0, 2, 4, 1, 5))``
(bwd_sm90._dq_fragments, a logical permutation); here torch builds DQ_ACC the same way from a float64 dQ, and
bwd_sm90_dq_convert_frag_kernel must give back dQ * ds_scale in dQ's dtype, rows past M untouched."""
from __future__ import annotations

import pytest
import torch
from reference import assert_matches_reference

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _fragment_order(dq_acc_rows: torch.Tensor) -> torch.Tensor:
    """[ZH, M_PAD, D] fp32 (row-major dQ) -> the same storage size with every 64 x 64 block in fragment order."""
    zh, m_pad, d = dq_acc_rows.shape
    blocks = dq_acc_rows.reshape(zh, m_pad // 64, 64, d // 64, 64).permute(0, 1, 3, 2, 4)   # [zh, mt, cb, 64, 64]
    frag = blocks.reshape(zh, m_pad // 64, d // 64, 4, 2, 8, 8, 4, 2).permute(0, 1, 2, 6, 3, 5, 7, 4, 8)
    return frag.reshape(zh, m_pad, d).contiguous()


@pytest.mark.parametrize("Z, HQ, M, D", [(1, 2, 100, 64), (2, 1, 128, 192), (1, 1, 65, 256)])
def test_fragment_order_convert_matches_reference(Z, HQ, M, D):
    import triton

    from fa3_inductor.templates.hopper_bwd.bwd_sm90 import bwd_sm90_dq_convert_frag_kernel

    m_pad = triton.cdiv(M, 128) * 128
    want = torch.randn(Z * HQ, m_pad, D, dtype=torch.float64)
    dq_acc = _fragment_order(want.float())
    assert not torch.equal(dq_acc, want.float())          # the permutation moves elements
    dq = torch.full((Z, HQ, M, D), float("nan"), dtype=torch.bfloat16)
    scale = 0.37
    grid = (triton.cdiv(M, 64) * (D // 64), Z * HQ)
    bwd_sm90_dq_convert_frag_kernel[grid](dq_acc, dq, (dq.stride(0), dq.stride(1), dq.stride(2)), HQ, M, m_pad,
                                          scale, HEAD_D=D, num_warps=4)
    ref = (want[:, :M] * scale).reshape(Z, HQ, M, D)
    assert_matches_reference(dq, ref, torch.bfloat16, "dq")
    # and element by element within one bf16 step (a misplaced element would be off by O(1)): the interpreter's
    # float32 -> bfloat16 conversion may round toward zero
    torch.testing.assert_close(dq.double(), ref, rtol=2 ** -7, atol=0)


def test_fragment_order_is_the_kernels_permutation():
    """Element (r, c) of a block lands where the convert kernel's formula reads it (the docstring's thread / register
    mapping of the m64nNk16 accumulator)."""
    r = torch.arange(64)[:, None].expand(64, 64)
    c = torch.arange(64)[None, :].expand(64, 64)
    index = (r * 64 + c).float()[None]                       # [1, 64, 64]
    frag = _fragment_order(index).reshape(-1).long()         # position -> row-major index
    f = (c // 8) * 512 + ((r // 16) * 32 + (r % 8) * 4 + (c // 2) % 4) * 4 + ((r // 8) % 2) * 2 + c % 2
    assert torch.equal(frag[f.reshape(-1)], (r * 64 + c).reshape(-1))
