"""Spellings of hand-written attention that the coverage harness (benchmarks/coverage.py) found
left alone, now fused (issue 21): each module is written the way the models write it, compiled
with backend="fa3", and checked against a float64 eager run, outputs and gradients (tests/
reference.py tolerance rule).

- a view between the softmax and the matmul with V that merges or splits the batch/head dims
  (BLOOM, Falcon: ``probs.view(B * H, M, N)`` then ``bmm``; or the way back);
- ``baddbmm`` for the scores (diffusers' classic ``AttnProcessor``: an ignored ``empty`` input with
  ``beta=0`` and ``alpha=scale``; BLOOM: an ALiBi bias as the input with ``beta=1``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import fa3_inductor
from reference import TOLERANCE, compiled_and_float64, rel_error

pytestmark = pytest.mark.usefixtures("our_kernels", "fresh_compiles")

B, M, H, D = 2, 16, 4, 16


class Attention(nn.Module):
    """Scores on merged batch×heads or per head, in one of the spellings below."""

    def __init__(self, spelling: str):
        super().__init__()
        self.qkv = nn.Linear(H * D, 3 * H * D)
        self.spelling = spelling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, M, 3, H, D).permute(2, 0, 3, 1, 4)   # [B, H, M, D]
        scale = 1 / math.sqrt(D)
        if self.spelling == "probs_merged":      # 4-D softmax, then bmm on [B*H, M, N]
            probs = torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1)
            out = torch.bmm(probs.view(B * H, M, M), v.reshape(B * H, M, D)).view(B, H, M, D)
        elif self.spelling == "probs_split":     # 3-D softmax, then matmul on [B, H, M, N]
            s = torch.bmm(q.reshape(B * H, M, D), k.reshape(B * H, M, D).transpose(1, 2)) * scale
            out = torch.softmax(s, dim=-1).view(B, H, M, M) @ v
        elif self.spelling == "baddbmm_empty":   # diffusers' AttnProcessor without a mask
            q3, k3, v3 = (t.reshape(B * H, M, D) for t in (q, k, v))
            empty = torch.empty(B * H, M, M, dtype=x.dtype, device=x.device)
            s = torch.baddbmm(empty, q3, k3.transpose(-1, -2), beta=0, alpha=scale)
            out = torch.bmm(s.softmax(dim=-1), v3).view(B, H, M, D)
        elif self.spelling == "baddbmm_bias":    # BLOOM: the ALiBi bias is baddbmm's input
            q3, k3, v3 = (t.reshape(B * H, M, D) for t in (q, k, v))
            slopes = 2.0 ** (-(torch.arange(H, dtype=x.dtype, device=x.device) + 1))
            pos = torch.arange(M, dtype=x.dtype, device=x.device)
            alibi = (slopes[:, None] * pos[None, :]).repeat(B, 1)[:, None, :]   # [B*H, 1, N]
            s = alibi.baddbmm(q3, k3.transpose(-1, -2), beta=1.0, alpha=scale)
            out = torch.bmm(torch.softmax(s, dim=-1), v3).view(B, H, M, D)
        else:
            raise KeyError(self.spelling)
        return out.transpose(1, 2).reshape(B, M, H * D)


@pytest.mark.parametrize("spelling", ["probs_merged", "probs_split", "baddbmm_empty",
                                      "baddbmm_bias"])
def test_spelling_fuses_and_matches_float64(spelling):
    torch.manual_seed(0)
    model = Attention(spelling)
    x = torch.randn(B, M, H * D, requires_grad=True)
    out, ref, (x64,), ref_model = compiled_and_float64(model, [x], torch.randn(B, M, H * D))
    sites = [s for s in fa3_inductor.recognized_sites() if s["front_door"] == "matmul-softmax"]
    assert [s["rewritten"] for s in sites] == [True], sites
    tol = TOLERANCE[torch.float32]
    assert rel_error(out, ref) <= tol
    assert rel_error(x.grad, x64.grad) <= tol
    assert rel_error(model.qkv.weight.grad, ref_model.qkv.weight.grad) <= tol
