"""The output our op allocates is one the kernels can write, whatever q's layout (issue 21, MViTv2).

The op allocated its output like q (``empty_like``). MViTv2's q comes out of a pooling convolution
and a LayerNorm with the heads innermost (strides (H·M·D, 1, H·D, H)), so the output had a head
dim of stride H: the generic kernel refused it ("out must have a unit last stride"), the refusal
was recorded as a build failure of these mods, every later plan of them went to torch's
FlexAttention, and on the CPU (whose torch lowering is inference-only) a training graph then
failed to compile and was handed whole to stock Inductor. The output now keeps q's stride order
with the head dim innermost (runtime/ops.py ``_out_like``), as torch's flex_attention does.
"""

from __future__ import annotations

import pytest
import torch

import fa3_inductor
from fa3_inductor.runtime import kernel_failures
from fa3_inductor.runtime.ops import _out_like
from reference import TOLERANCE, rel_error

B, H, M, N, D = 2, 2, 64, 16, 16


def _heads_innermost(*shape_bhmd: int, requires_grad: bool = False) -> torch.Tensor:
    b, h, m, d = shape_bhmd
    t = torch.randn(b, m, d, h).permute(0, 3, 1, 2)   # strides (m·d·h, 1, d·h, h)
    return t.requires_grad_(requires_grad)


def _attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) * D ** -0.5, dim=-1) @ v


def test_out_like_moves_the_head_dim_innermost():
    q = _heads_innermost(B, H, M, D)
    out = _out_like(q, q)
    assert out.stride() == (M * H * D, D, H * D, 1)           # q's order, head dim innermost
    assert _out_like(q.contiguous(), q).stride() == q.contiguous().stride()
    single = torch.randn(B, M, D, 1).permute(0, 3, 1, 2)      # one head: its stride 1 is 2 bytes
    assert _out_like(single.bfloat16(), single).stride()[1] % 8 == 0
    bshd = torch.randn(B, M, H, D).transpose(1, 2)            # (B, S, H, D) storage stays so
    assert _out_like(bshd, bshd).stride() == bshd.stride()


@pytest.mark.usefixtures("our_kernels", "fresh_compiles")
def test_heads_innermost_q_runs_our_kernel_forward_and_backward():
    torch.manual_seed(0)
    kernel_failures.clear()
    q = _heads_innermost(B, H, M, D, requires_grad=True)
    k = _heads_innermost(B, H, N, D, requires_grad=True)
    v = torch.randn(B, H, N, D, requires_grad=True)
    dout = torch.randn(B, H, M, D)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _attention(*ref_in)
    ref.backward(dout.double())
    out = torch.compile(_attention, backend="fa3", fullgraph=True)(q, k, v)
    out.backward(dout)
    assert not kernel_failures._FAILED, kernel_failures._FAILED   # no family refused to build
    sites = fa3_inductor.recognized_sites()
    assert [s["rewritten"] for s in sites] == [True], sites      # not handed to stock Inductor
    tol = TOLERANCE[torch.float32]
    assert rel_error(out, ref) <= tol
    for got, want in zip((q, k, v), ref_in):
        assert rel_error(got.grad, want.grad) <= tol


@pytest.mark.usefixtures("our_kernels", "fresh_compiles")
def test_one_head_q_with_an_unaligned_head_stride_is_read_as_is():
    """MViTv2's first stage has one head: q (B, 1, M, D) with strides (M·D, 1, D, 1). torch calls
    it contiguous, so ``.contiguous()`` kept the head stride of 1 element and the descriptor
    build failed ("strides must be 16-byte aligned"); the size-1 dim's stride is now restrided."""
    torch.manual_seed(0)
    kernel_failures.clear()
    q, k = _heads_innermost(B, 1, M, D), _heads_innermost(B, 1, N, D)
    v = torch.randn(B, 1, N, D)
    with torch.no_grad():
        out = torch.compile(_attention, backend="fa3", fullgraph=True)(q, k, v)
    assert not kernel_failures._FAILED, kernel_failures._FAILED
    ref = _attention(q.double(), k.double(), v.double())
    assert rel_error(out, ref) <= TOLERANCE[torch.float32]
