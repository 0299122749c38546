"""Scores written in place between the q·kᵀ product and the softmax (issue 21, MViTv2).

timm's MViTv2 adds its decomposed relative-position bias by assigning into a slice of the scores::

    attn = (q * scale) @ k.transpose(-2, -1)
    attn[:, :, sp_idx:, sp_idx:] = (attn[:, :, sp_idx:, sp_idx:].view(...) + rel_h + rel_w).view(...)
    attn = attn.softmax(dim=-1)

In Dynamo's graph the softmax reads the product's node itself; the write is an ``operator.setitem``
on that node (an in-place ``add_`` / ``masked_fill_`` likewise) that no data edge leads through.
Recognition walked softmax -> product and rewrote the site without the write: the bias vanished
(the GPU coverage run: mvitv2 output error 9.8e-2 against eager's 1.7e-2, ``rel_pos_h``'s gradient
0). A rewrite must be exact: the site is either left as written with the reason, or rewritten with
the write folded in. Each case here is checked against float64, forward and backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from reference import TOLERANCE, compiled_and_float64, rel_error

pytestmark = pytest.mark.usefixtures("our_kernels", "fresh_compiles")

B, H, M, D = 2, 2, 17, 16   # M = 1 class token + 16 spatial tokens (MViTv2 with a class token)


class ScoresWrittenInPlace(nn.Module):
    """Attention whose scores get a learnable bias through an in-place write (``spelling``)."""

    def __init__(self, spelling: str):
        super().__init__()
        self.qkv = nn.Linear(H * D, 3 * H * D)
        self.bias = nn.Parameter(torch.randn(H, M - 1, M - 1) * 0.5)
        self.spelling = spelling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, M, 3, H, D).permute(2, 0, 3, 1, 4)
        attn = (q * D ** -0.5) @ k.transpose(-2, -1)
        full = nn.functional.pad(self.bias, (1, 0, 1, 0))   # [H, M, M], 0 on the class token
        if self.spelling == "setitem_slice":      # MViTv2's cal_rel_pos_type (has_cls_token)
            attn[:, :, 1:, 1:] = attn[:, :, 1:, 1:] + self.bias
        elif self.spelling == "setitem_whole":    # MViTv2 without a class token (sp_idx = 0)
            attn[:, :, 0:, 0:] = attn[:, :, 0:, 0:] + full
        elif self.spelling == "add_":
            attn.add_(full)
        elif self.spelling == "slice_add_":       # a view of the scores written in place
            attn[:, :, 1:, 1:].add_(self.bias)
        elif self.spelling == "masked_fill_":     # an in-place mask fill, result not rebound
            attn.masked_fill_(full > 0.5, float("-inf"))
        else:
            raise KeyError(self.spelling)
        out = attn.softmax(dim=-1) @ v
        return out.transpose(1, 2).reshape(B, M, H * D)


@pytest.mark.parametrize("spelling", ["setitem_slice", "setitem_whole", "add_", "slice_add_",
                                      "masked_fill_"])
def test_in_place_score_writes_are_kept(spelling):
    torch.manual_seed(0)
    model = ScoresWrittenInPlace(spelling)
    x = torch.randn(B, M, H * D, requires_grad=True)
    out, ref, (x64,), ref_model = compiled_and_float64(model, [x], torch.randn(B, M, H * D))
    tol = TOLERANCE[torch.float32]
    err = rel_error(out, ref)
    assert err <= tol, f"output error {err:.2e} > {tol:.0e}: the in-place write was dropped"
    err = rel_error(x.grad, x64.grad)
    assert err <= tol, f"input gradient error {err:.2e} > {tol:.0e}"
    if spelling != "masked_fill_":   # (a fill's bias gets no gradient through the mask)
        assert model.bias.grad is not None, "the bias got no gradient: the write was dropped"
        err = rel_error(model.bias.grad, ref_model.bias.grad)
        assert err <= tol, f"bias gradient error {err:.2e} > {tol:.0e}"
