"""A captured tensor that requires grad but reaches the scores only through a comparison (issue 21).

``s.masked_fill(pad(param) > 0.5, -inf)`` captures ``pad(param)``, a float tensor that requires
grad, into the score_mod; its gradient through the mod is nothing. torch's flex backward returned
None for it and Inductor's lowering of that backward raised ``'NoneType' object has no attribute
'get_size'`` at the first backward (outside any fallback). Recognition now reads such a buffer
through ``detach`` (recognition/gradless_buffers.py), for the sites recognition writes and the
flex_attention calls users write alike: the site fuses, its gradients match float64, and
``param.grad`` stays None as in eager. A buffer that also reaches the score differentiably keeps
its gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fa3_inductor
from reference import TOLERANCE, compiled_and_float64, rel_error

pytestmark = pytest.mark.usefixtures("our_kernels", "fresh_compiles")

B, H, M, D = 2, 2, 16, 16


class ParamMask(nn.Module):
    def __init__(self, also_added: bool, four_dim: bool):
        super().__init__()
        self.also_added = also_added
        # [B, 1, 1, M - 2]: the site reads it through a reshape recognition inserts
        self.param = nn.Parameter(torch.rand(B, 1, 1, M - 2) if four_dim else torch.rand(B, M - 2))

    def forward(self, q, k, v):
        s = q @ k.transpose(-2, -1) * D ** -0.5
        table = F.pad(self.param, (1, 1), value=1.0)          # keys 0 and M-1 kept
        if table.dim() == 2:
            table = table[:, None, None, :]
        if self.also_added:
            s = s + table
        s = s.masked_fill(table < 0.3, float("-inf"))
        return s.softmax(dim=-1) @ v


@pytest.mark.parametrize("also_added,four_dim", [(False, False), (False, True), (True, False)],
                         ids=["compared_only", "compared_through_reshape", "also_added"])
def test_buffer_compared_only_fuses_with_right_gradients(also_added, four_dim):
    model = ParamMask(also_added, four_dim)
    q, k, v = (torch.randn(B, H, M, D, requires_grad=True) for _ in range(3))
    out, ref, inputs64, model64 = compiled_and_float64(model, [q, k, v], torch.randn(B, H, M, D))
    sites = [s for s in fa3_inductor.recognized_sites() if s["front_door"] == "matmul-softmax"]
    assert [s["rewritten"] for s in sites] == [True], sites
    tol = TOLERANCE[torch.float32]
    assert rel_error(out, ref) <= tol
    for x, x64 in zip((q, k, v), inputs64):
        assert rel_error(x.grad, x64.grad) <= tol
    if also_added:
        assert rel_error(model.param.grad, model64.param.grad) <= tol
    else:
        assert model.param.grad is None and model64.param.grad is None


def test_flex_score_mod_comparing_a_parameter_trains():
    param = nn.Parameter(torch.rand(M))
    param64 = param.detach().double()

    def keep_some(score, b, h, q_idx, kv_idx):
        return torch.where(param[kv_idx] > 0.3, score, float("-inf"))

    q, k, v = (torch.randn(B, H, M, D, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, H, M, D)
    out = fa3_inductor.flex(q, k, v, score_mod=keep_some)
    out.backward(dout)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    s = (q64 @ k64.transpose(-2, -1)) * D ** -0.5
    s = s.masked_fill(param64 <= 0.3, float("-inf"))
    ref = s.softmax(-1) @ v64
    ref.backward(dout.double())
    tol = TOLERANCE[torch.float32]
    assert rel_error(out, ref) <= tol
    for x, x64 in zip((q, k, v), (q64, k64, v64)):
        assert rel_error(x.grad, x64.grad) <= tol
    assert param.grad is None
