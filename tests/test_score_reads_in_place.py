"""The scores read through a view that moves their indices (issue 21: a rewrite only when exact).

The manual-attention recognizer lifts the elementwise code between q·kᵀ and the softmax into a
``score_mod(score, b, h, q_idx, kv_idx)``; the kernel's ``score`` is the element at the mod's
own indices. ``s + s.transpose(-1, -2)`` reads score[kv, q], ``s + s[..., :1]`` score[.., 0]:
the lifter once mapped those indices and then ignored them at the score (it stands for one
element only), so such sites were fused and wrong (max error 3.0 on the transpose). Now every
node computed from the scores must keep each element's position (lift.Lifter.
_check_reads_in_place); otherwise the site is left alone with the reason, and runs as written.
Aliases that keep every index (a view round trip, casts) are still fused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fa3_inductor
from reference import TOLERANCE, compiled_and_float64, rel_error

pytestmark = pytest.mark.usefixtures("our_kernels", "fresh_compiles")

B, H, M, D = 2, 2, 8, 16


class ScoresRead(nn.Module):
    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.bias = nn.Parameter(torch.randn(H, M - 1, M - 1) * 0.5)

    def forward(self, q, k, v):
        s = q @ k.transpose(-2, -1) * D ** -0.5
        sp = self.spelling
        if sp == "transpose":            # score[kv, q]
            s = s + s.transpose(-1, -2)
        elif sp == "mask_transposed":    # a mask computed from score[kv, q]
            s = s.masked_fill(s.transpose(-1, -2) > 0.5, -1e9)
        elif sp == "heads_swapped":      # score of the other head
            s = s + s.transpose(0, 1)
        elif sp == "first_column":       # score[.., 0] broadcast along the keys
            s = s + s[..., :1]
        elif sp == "expanded_slice":
            s = s + s[:, :, :, 1:2].expand(B, H, M, M)
        elif sp == "flip":
            s = s + s.flip(-1)
        elif sp == "roll":
            s = s + s.roll(1, -1)
        elif sp == "slice_write_transposed":   # a slice assigned from the transposed scores
            s[:, :, 1:, 1:] = s.transpose(-1, -2)[:, :, 1:, 1:] * 1.0 + self.bias
        elif sp == "view_round_trip":    # aliases that keep every index: fused
            s = s.view(B * H, M, M).to(s.dtype).contiguous().view(B, H, M, M) * 2.0
        elif sp == "condition_on_alias":  # a score-dependent condition read in place: fused
            s = torch.where(s.view(B * H, M, M).view(B, H, M, M) > 0.5, s, s * 0.5)
        else:
            raise KeyError(sp)
        return s.softmax(dim=-1) @ v


def _run(spelling: str):
    torch.manual_seed(0)
    model = ScoresRead(spelling)
    q, k, v = (torch.randn(B, H, M, D, requires_grad=True) for _ in range(3))
    out, ref, inputs64, _ = compiled_and_float64(model, [q, k, v], torch.randn(B, H, M, D))
    sites = [s for s in fa3_inductor.recognized_sites() if s["front_door"] == "matmul-softmax"]
    tol = TOLERANCE[torch.float32]
    err = rel_error(out, ref)
    assert err <= tol, f"output error {err:.2e} > {tol:.0e}"
    for x, x64 in zip((q, k, v), inputs64):
        err = rel_error(x.grad, x64.grad)
        assert err <= tol, f"input gradient error {err:.2e} > {tol:.0e}"
    return sites


@pytest.mark.parametrize("spelling", [
    "transpose", "mask_transposed", "heads_swapped", "first_column", "expanded_slice",
    "slice_write_transposed",
])
def test_scores_read_at_moved_indices_leave_the_site_alone(spelling):
    sites = _run(spelling)
    assert [s["rewritten"] for s in sites] == [False], sites
    assert "which moves their indices" in sites[0]["reason"], sites


@pytest.mark.parametrize("spelling", ["flip", "roll"])
def test_flip_and_roll_of_the_scores_leave_the_site_alone(spelling):
    sites = _run(spelling)
    assert [s["rewritten"] for s in sites] == [False], sites
    assert spelling in sites[0]["reason"], sites


@pytest.mark.parametrize("spelling", ["view_round_trip", "condition_on_alias"])
def test_index_keeping_aliases_of_the_scores_are_fused_and_exact(spelling):
    sites = _run(spelling)
    assert [s["rewritten"] for s in sites] == [True], sites
