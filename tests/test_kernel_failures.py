"""A kernel that cannot be built never reaches the user as a compiler error (runtime/kernel_failures.py).

The generated mod source is made unbuildable on purpose (a call Triton does not have): the call
must still return the right numbers, computed by torch's kernel, and the reason must show in the
planner's answer for the same mods (what explain() and the log report).
"""

from __future__ import annotations

import pytest
import torch

import fa3_inductor
from fa3_inductor import mods
from fa3_inductor.lowering import site_plan
from fa3_inductor.runtime import kernel_failures
from fa3_inductor.templates.modgen import GeneratedSource
from reference import assert_matches_reference, reference_attention


@pytest.fixture
def unbuildable_score_mods(monkeypatch):
    real = site_plan.generate_in_dialect

    def broken(gm, kind, specs, dialect):
        source = real(gm, kind, specs, dialect)
        if kind != "score" or dialect == "torch":
            return source
        return GeneratedSource(source.replace("    return ", "    qk = tl.no_such_function(qk)\n    return ", 1),
                               source.info)

    monkeypatch.setattr(site_plan, "generate_in_dialect", broken)
    kernel_failures.clear()
    yield
    kernel_failures.clear()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.usefixtures("fresh_compiles")
def test_a_kernel_that_fails_to_build_falls_back_to_torch_with_its_reason(unbuildable_score_mods, device,
                                                                           request):
    from fa3_inductor import direct

    if device == "cpu":
        request.getfixturevalue("cpu_kernels")   # our kernel runs on the CPU only under the interpreter
    direct.clear()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = (torch.randn(1, 2, 200, 64, device=device, dtype=dtype) for _ in range(3))
    score = mods.softcap(4.0)
    with torch.no_grad():
        out = fa3_inductor.flex(q, k, v, score_mod=score, mask_mod=mods.causal)
    assert fa3_inductor.last_template() == "torch"
    assert_matches_reference(out, reference_attention(q, k, v, score, mods.causal)[0], dtype)
    # the next plan of the same mods knows, and explain() says why
    with torch.no_grad():
        report = fa3_inductor.explain(
            lambda q, k, v: fa3_inductor.flex(q, k, v, score_mod=score, mask_mod=mods.causal), q, k, v)
    (site,) = report.sites
    assert site.template == "torch", site
    assert "failed to build" in site.fallback_reason and "torch's kernel runs" in site.fallback_reason
