"""No crash, ever (issue 21): a failure inside our recognition or lowering leaves the graph to stock
Inductor with the reason in explain(), warned once; an error stock Inductor raises too is the
user's and still reaches them. And the model that used to crash the compile: an ALiBi bias whose
slopes raise a Python number to a tensor power (``2.0 ** t``, aten.pow.Scalar).

Shapes are tiny (CPU, Triton's interpreter); references are float64.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import fa3_inductor
from fa3_inductor import backend
from fa3_inductor.lowering import flex_lowering
from fa3_inductor.recognition import attention_site
from reference import TOLERANCE, rel_error

pytestmark = pytest.mark.usefixtures("our_kernels", "fresh_compiles")

B, H, M, D = 2, 4, 16, 16


class Attention(torch.nn.Module):
    """Hand-written attention; ``alibi`` adds slopes ``2.0 ** (-(h + 1) * 8 / H)`` × distance."""

    def __init__(self, alibi: bool = False):
        super().__init__()
        self.qkv = torch.nn.Linear(H * D, 3 * H * D)
        self.alibi = alibi

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, M, 3, H, D).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(D)
        if self.alibi:
            h = torch.arange(H, device=x.device, dtype=x.dtype)
            slopes = 2.0 ** (-(h + 1) * 8.0 / H)            # aten.pow.Scalar
            pos = torch.arange(M, device=x.device)
            s = s + slopes[:, None, None] * (pos[None, :] - pos[:, None]).to(x.dtype)
        return (torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(B, M, H * D)


def _inputs(alibi: bool = False):
    torch.manual_seed(0)
    model = Attention(alibi)
    x = torch.randn(B, M, H * D)
    return model, x, copy.deepcopy(model).double()(x.double()).detach()


def _explained(model, x):
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="bug in fa3_inductor"):
        box = []

        def run(x):
            out = model(x)
            box.append(out)
            return out

        report = fa3_inductor.explain(run, x)
    return report, box[0]


def test_recognition_failure_leaves_the_attention_as_written(monkeypatch):
    model, x, ref = _inputs()

    def broken(self, plan, extra_inputs):
        raise RuntimeError("emit broke")

    monkeypatch.setattr(attention_site.AttentionSite, "emit", broken)
    backend._failures_warned.clear()
    report, out = _explained(model, x)
    assert rel_error(out, ref) <= TOLERANCE[torch.float32]
    assert report.fused_count == 0, str(report)
    reasons = [u.reason for u in report.unfused]
    assert reasons and all("fa3 recognition failed" in r and "emit broke" in r for r in reasons)


def test_lowering_failure_falls_back_to_stock_inductor(monkeypatch):
    model, x, ref = _inputs()

    def broken(*args, **kwargs):
        raise ValueError("planner broke")

    monkeypatch.setattr(flex_lowering, "_plan", broken)
    backend._failures_warned.clear()
    report, out = _explained(model, x)
    assert rel_error(out, ref) <= TOLERANCE[torch.float32]
    assert report.fused_count == 0 and report.unfused, str(report)
    assert all("fa3 compilation failed" in u.reason and "planner broke" in u.reason
               for u in report.unfused), str(report)


def test_an_error_stock_inductor_raises_too_reaches_the_user(monkeypatch):
    model, x, _ = _inputs()
    real = backend._stock_inductor

    def stock_that_fails(mode, options):
        compiler = real(mode, options)

        class Failing:
            config = compiler.config

            def __call__(self, gm, example_inputs):
                raise TypeError("the user's own error")
        return Failing()

    monkeypatch.setattr(backend, "_stock_inductor", stock_that_fails)
    monkeypatch.setattr(flex_lowering, "_plan", lambda *a, **k: (_ for _ in ()).throw(
        ValueError("planner broke")))
    with torch.no_grad(), pytest.raises(Exception, match="the user's own error"):
        torch.compile(model, backend="fa3")(x)


def test_alibi_slopes_from_a_scalar_power_fuse_and_match_float64():
    model, x, _ = _inputs(alibi=True)
    x = x.requires_grad_()
    ref_model = copy.deepcopy(model).double()
    x64 = x.detach().double().requires_grad_()
    dout = torch.randn(B, M, H * D)
    ref = ref_model(x64)
    ref.backward(dout.double())
    compiled = torch.compile(model, backend="fa3")
    fa3_inductor.clear_lowered_sites()
    out = compiled(x)
    out.backward(dout)
    sites = fa3_inductor.recognized_sites()
    assert [s["rewritten"] for s in sites] == [True], sites
    assert "position bias" in sites[0]["score_mods"], sites
    tol = TOLERANCE[torch.float32]
    assert rel_error(out, ref) <= tol
    assert rel_error(x.grad, x64.grad) <= tol
    assert rel_error(model.qkv.weight.grad, ref_model.qkv.weight.grad) <= tol
