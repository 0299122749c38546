"""Mask fills beyond the query dtype's range (issue 21: GPT-Neo, recognition/mod_fills.py).

GPT-Neo upcasts bf16 q and k to float32 and masks with ``torch.finfo(torch.float32).min``.
Recognition serves it on the bf16 q/k, so the fill lands in a score_mod that flex_attention
traces in bf16: ``aten.scalar_tensor(-3.4028e38, dtype=bfloat16)``, which Inductor's constant
folding rejects on CUDA ("value cannot be converted to type c10::BFloat16 without overflow") and
the backend fell back to stock Inductor. A one-element CPU tensor takes it silently, so
:func:`_cuda_like_constant_folding` makes the CPU fold check the conversion as CUDA's fill does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fa3_inductor
from fa3_inductor import backend
from reference import TOLERANCE, rel_error

B, H, M, D = 2, 2, 16, 16
F32_MIN = torch.finfo(torch.float32).min


class GptNeoAttention(nn.Module):
    """GPT-Neo's ``_attn``: float32 scores, its mask (an input here: a runtime mask, so the fill
    stays in the score_mod), then an additive padding mask, probabilities cast back to v's dtype."""

    def forward(self, q, k, v, keep, pad):
        s = torch.matmul(q.to(torch.float32), k.to(torch.float32).transpose(-1, -2))
        s = torch.where(keep, s, torch.tensor(torch.finfo(s.dtype).min, dtype=s.dtype))
        p = torch.softmax(s + pad, dim=-1).to(v.dtype)
        return torch.matmul(p, v)


def _inputs(dtype: torch.dtype) -> tuple:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, M, D, dtype=dtype, requires_grad=True) for _ in range(3))
    keep = torch.rand(B, 1, M, M) < 0.6
    keep[..., 0] = True
    pad = torch.zeros(B, 1, 1, M)
    pad[0, ..., -3:] = F32_MIN
    return q, k, v, keep, pad


def _score_mod_fills(gm: torch.fx.GraphModule) -> list[float]:
    """The float constants of the rewritten site's score_mod ``torch.where``."""
    mods = [m for name, m in gm.named_children() if name.endswith("_score_mod")]
    return [a for m in mods for n in m.graph.nodes if n.target is torch.where
            for a in n.args if isinstance(a, float)]


@pytest.mark.parametrize("dtype, fill", [(torch.bfloat16, -torch.finfo(torch.bfloat16).max),
                                         (torch.float16, -torch.finfo(torch.float16).max),
                                         (torch.float32, F32_MIN)])
def test_fill_clamped_to_the_traced_dtype(dtype, fill):
    """Recognition alone (no Inductor): the score_mod's fill is the query dtype's most negative
    finite value where float32's does not fit, and float32's own where it does."""
    seen: list[list[float]] = []

    def recognize_only(gm, example_inputs):
        rewritten, _, _ = backend.recognize(gm, example_inputs)
        seen.append(_score_mod_fills(rewritten))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(GptNeoAttention(), backend=recognize_only, fullgraph=True)(*_inputs(dtype))
    assert seen == [[fill]]


@pytest.fixture
def cuda_like_constant_folding(monkeypatch):
    """Inductor's uniform-value constant folding, first building every ``scalar_tensor`` of the
    graph as a two-element tensor: on the CPU that fill checks the conversion like CUDA's does."""
    from torch._inductor.fx_passes import joint_graph

    fold = joint_graph.constant_fold_uniform_value

    def checked(gm: torch.fx.GraphModule):
        for n in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.scalar_tensor.default):
            with torch.utils._python_dispatch._disable_current_modes():
                torch.full((2,), n.args[0], dtype=n.kwargs.get("dtype"))
        return fold(gm)

    monkeypatch.setattr(joint_graph, "constant_fold_uniform_value", checked)


@pytest.mark.usefixtures("our_kernels", "fresh_compiles", "cuda_like_constant_folding")
def test_gpt_neo_float32_fill_in_bf16_compiles_fused():
    """The whole compile, forward and backward, in bf16: the site stays fused (no fallback to
    stock Inductor) and matches float64 eager within bf16's tolerance."""
    q, k, v, keep, pad = _inputs(torch.bfloat16)
    dout = torch.randn(B, H, M, D, dtype=torch.bfloat16)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.softmax((q64 @ k64.transpose(-1, -2)).masked_fill(~keep, F32_MIN) + pad.double(),
                        dim=-1) @ v64
    ref.backward(dout.double())
    out = torch.compile(GptNeoAttention(), backend="fa3", fullgraph=True)(q, k, v, keep, pad)
    out.backward(dout)
    (site,) = fa3_inductor.recognized_sites()
    assert site["rewritten"], site
    tol = TOLERANCE[torch.bfloat16]
    assert rel_error(out, ref) <= tol
    for t, t64 in ((q, q64), (k, k64), (v, v64)):
        assert rel_error(t.grad, t64.grad) <= tol
