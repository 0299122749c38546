"""Scores written in place between the q·kᵀ product and the softmax (issue 21: MViTv2, Flaubert).

timm's MViTv2 adds its decomposed relative-position bias by assigning into a slice of the scores::

    attn = (q * scale) @ k.transpose(-2, -1)
    attn[:, :, sp_idx:, sp_idx:] = (attn[:, :, sp_idx:, sp_idx:].view(...) + rel_h + rel_w).view(...)
    attn = attn.softmax(dim=-1)

and Flaubert fills its padding mask with ``scores.masked_fill_(mask, finfo.min)``. In Dynamo's
graph the softmax reads the product's node itself; the write is an ``operator.setitem`` /
``masked_fill_`` on that node that no data edge leads through. Recognition once walked softmax ->
product and rewrote the site without the write: the bias vanished (the GPU coverage run: mvitv2
output error 9.8e-2, ``rel_pos_h``'s gradient 0); then such sites were left alone. Now
recognition/score_writes.py turns the write out of place where that is exact, and the site is
fused. Each case is checked against float64, forward and backward; the writes that cannot be
turned out of place, or whose value reads the scores elsewhere, leave the site as written with
the reason.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fa3_inductor
from reference import TOLERANCE, compiled_and_float64, rel_error

pytestmark = pytest.mark.usefixtures("our_kernels", "fresh_compiles")

B, H, M, D = 2, 2, 17, 16   # M = 1 class token + 16 spatial tokens (a 4 x 4 grid)
G = 4                       # the grid side


class ScoresWrittenInPlace(nn.Module):
    """Attention whose scores get a learnable bias (or a mask) through an in-place write."""

    def __init__(self, spelling: str):
        super().__init__()
        self.qkv = nn.Linear(H * D, 3 * H * D)
        self.bias = nn.Parameter(torch.randn(H, M - 1, M - 1) * 0.5)
        self.rel_h = nn.Parameter(torch.randn(2 * G - 1, D) * 0.5)   # MViTv2's rel_pos_h / _w
        self.rel_w = nn.Parameter(torch.randn(2 * G - 1, D) * 0.5)
        self.spelling = spelling

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, M, 3, H, D).permute(2, 0, 3, 1, 4)
        attn = (q * D ** -0.5) @ k.transpose(-2, -1)
        full = nn.functional.pad(self.bias, (1, 0, 1, 0))   # [H, M, M], 0 on the class token
        s = self.spelling
        if s == "setitem_slice":      # MViTv2's cal_rel_pos_type (has_cls_token)
            attn[:, :, 1:, 1:] = attn[:, :, 1:, 1:] + self.bias
        elif s == "setitem_whole":    # MViTv2 without a class token (sp_idx = 0)
            attn[:, :, 0:, 0:] = attn[:, :, 0:, 0:] + full
        elif s == "mvitv2":           # the decomposed bias, read through a 6-D view
            attn[:, :, 1:, 1:] = (attn[:, :, 1:, 1:].view(B, H, G, G, G, G)
                                  + self._rel(q).unsqueeze(-1)
                                  + self._rel(q, w=True).unsqueeze(-2)).view(B, H, M - 1, M - 1)
        elif s == "add_":
            attn.add_(full)
        elif s == "iadd":
            attn += full
        elif s == "slice_add_":       # a slice of the scores written in place
            attn[:, :, 1:, 1:].add_(self.bias)
        elif s == "masked_fill_":     # Flaubert: a mask fill, its result not rebound
            attn.masked_fill_(~keep, torch.finfo(attn.dtype).min)
        elif s == "other_slice":      # the value reads the scores one row and column earlier
            attn[:, :, 1:, 1:] = attn[:, :, :-1, :-1] * 1.0 + self.bias
        elif s == "view_read_later":  # a view taken before the write sees the write
            peek = attn[:, :, 1:, 1:]
            attn.add_(full)
            return self._out(attn.softmax(dim=-1) @ v) + peek.mean()
        elif s == "promoting":        # out of place it would be float64: the write casts back
            attn.add_(full.double())
        else:
            raise KeyError(s)
        # Flaubert's upcast, softmax(scores.float()).type_as(scores) (not in the float64 copy)
        scores = attn.float() if attn.dtype == torch.float32 else attn
        return self._out(scores.softmax(dim=-1).type_as(attn) @ v)

    def _rel(self, q: torch.Tensor, w: bool = False) -> torch.Tensor:
        """MViTv2's rel_h (rel_w with w): [B, H, G, G, G], q-dependent."""
        dist = torch.arange(G)[:, None] - torch.arange(G)[None, :] + G - 1
        table = (self.rel_w if w else self.rel_h)[dist]                  # [G, G, D]
        r_q = q[:, :, 1:].reshape(B, H, G, G, D)
        return torch.einsum("byhwc,wkc->byhwk" if w else "byhwc,hkc->byhwk", r_q, table)

    def _out(self, out: torch.Tensor) -> torch.Tensor:
        return out.transpose(1, 2).reshape(B, M, H * D)


def _run(spelling: str):
    """The module compiled with fa3 and a float64 eager copy (outputs, gradients), and the
    matmul-softmax sites fa3 saw."""
    torch.manual_seed(0)
    model = ScoresWrittenInPlace(spelling)
    x = torch.randn(B, M, H * D, requires_grad=True)
    keep = torch.rand(B, 1, 1, M) > 0.3
    keep[..., 0] = True   # every row keeps a key
    out, ref, (x64, _), ref_model = compiled_and_float64(model, [x, keep],
                                                         torch.randn(B, M, H * D))
    sites = [s for s in fa3_inductor.recognized_sites() if s["front_door"] == "matmul-softmax"]
    return model, ref_model, x, x64, out, ref, sites


def _assert_close(model, ref_model, x, x64, out, ref, params=()):
    tol = TOLERANCE[torch.float32]
    err = rel_error(out, ref)
    assert err <= tol, f"output error {err:.2e} > {tol:.0e}: the in-place write was dropped"
    err = rel_error(x.grad, x64.grad)
    assert err <= tol, f"input gradient error {err:.2e} > {tol:.0e}"
    for name in params:
        grad, ref_grad = getattr(model, name).grad, getattr(ref_model, name).grad
        assert grad is not None, f"{name} got no gradient: the write was dropped"
        err = rel_error(grad, ref_grad)
        assert err <= tol, f"{name} gradient error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("spelling, params", [
    ("setitem_slice", ["bias"]), ("setitem_whole", ["bias"]), ("add_", ["bias"]),
    ("iadd", ["bias"]), ("slice_add_", ["bias"]), ("masked_fill_", []),
    ("mvitv2", ["rel_h", "rel_w"]),
])
def test_in_place_score_writes_are_fused_and_exact(spelling, params):
    model, ref_model, x, x64, out, ref, sites = _run(spelling)
    assert [s["rewritten"] for s in sites] == [True], sites
    _assert_close(model, ref_model, x, x64, out, ref, params)


@pytest.mark.parametrize("spelling, reason", [
    ("view_read_later", "made before the write add_, is read after it"),
    ("promoting", "would broadcast or promote"),
    ("other_slice", "other than elementwise (or through reshapes) from the same slice"),
])
def test_writes_not_exact_out_of_place_leave_the_site_alone(spelling, reason):
    model, ref_model, x, x64, out, ref, sites = _run(spelling)
    assert [s["rewritten"] for s in sites] == [False], sites
    assert reason in sites[0]["reason"], sites
    _assert_close(model, ref_model, x, x64, out, ref, ["bias"])
