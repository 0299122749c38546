"""bfloat16 under Triton's interpreter: right numbers, never garbage (issue 16).

Triton 3.6's interpreter computes ``tl.dot`` on bfloat16 operands wrongly (relative error ~1e9,
fp16 / fp32 right), so the CPU path runs the kernel on float32 copies (runtime/ops.py).
"""

from __future__ import annotations

import pytest
import torch

import fa3_inductor
from fa3_inductor import mods
from reference import assert_matches_reference, reference_attention


@pytest.mark.parametrize("score_mod,mask_mod", [(None, None), (mods.softcap(5.0), mods.causal),
                                                (mods.alibi(2), mods.sliding_window(20))])
def test_bf16_forward_matches_float64(cpu_kernels, score_mod, mask_mod):
    q, k, v = (torch.randn(1, 2, 72, 32, dtype=torch.bfloat16) for _ in range(3))
    out = fa3_inductor.flex(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    assert fa3_inductor.last_template() == "generic"
    assert out.dtype == torch.bfloat16
    ref, _ = reference_attention(q, k, v, score_mod, mask_mod)
    assert_matches_reference(out, ref, torch.bfloat16)


def test_bf16_gradients_match_float64(cpu_kernels):
    q, k, v = (torch.randn(1, 2, 40, 16, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    fa3_inductor.flex(q, k, v, mask_mod=mods.causal).float().square().sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference_attention(q64, k64, v64, None, mods.causal)[0].square().sum().backward()
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert_matches_reference(got, want, torch.bfloat16, "gradient")
