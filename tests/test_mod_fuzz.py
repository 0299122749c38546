"""The mod fuzzer (benchmarks/mod_fuzz.py) on a small seeded sample, under Triton's interpreter.

Random score_mod / mask_mod pairs over every op the mod generator claims, crossed with ragged
shapes, M = 1, GQA and float32 / float16: each must match the float64 reference or fall back to
torch's kernel with its reason; none may be wrong or crash. With ``grad`` the backward too: dq, dk,
dv and the captured tensors' gradients against float64 autograd. The GPU run of the same module
(``python benchmarks/mod_fuzz.py [--grad] --cases 360 --seed 0 --out DIR``) covers bf16, fp16 and the
Hopper kernels.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import mod_fuzz  # noqa: E402

SAMPLE_SEED, SAMPLE_CASES = 0, 40
GRAD_SEED, GRAD_CASES = 5, 24   # seed 5: two pairs whose score_mod's captures (scal, table) require grad


def test_a_seeded_sample_has_no_wrong_results_and_no_crashes(cpu_kernels):
    results = mod_fuzz.run_cases(SAMPLE_SEED, list(range(SAMPLE_CASES)), "cpu", progress=False)
    counts = mod_fuzz.summarize(results)
    bad = [f"{r['outcome']}: {r.get('detail', '')[:300]}\n  {r['repro']}" for r in results
           if r["outcome"] in ("wrong", "crash")]
    assert not bad, "\n".join(bad)
    assert counts["match"] >= SAMPLE_CASES * 0.9, counts
    assert {r["case"]["dtype"] for r in results} == {"float32", "float16"}
    for r in results:
        if r["outcome"] == "fallback":
            assert "no reason recorded" not in r["detail"], r


def test_cases_are_reproducible_from_seed_and_index():
    a, b = mod_fuzz.build_case(7, 12), mod_fuzz.build_case(7, 12)
    assert a == b and a.repro() == b.repro()
    assert a.repro().startswith("seed=7 case=12 ")
    pair = mod_fuzz.build_case(7, 13)   # 12 and 13 share mods, dtype and head dims
    assert (pair.score_src, pair.mask_src, pair.dtype, pair.head_dim) == \
        (a.score_src, a.mask_src, a.dtype, a.head_dim)


def test_an_unlowerable_mod_falls_back_to_torch_with_its_reason(cpu_kernels, fresh_compiles):
    """atan2 is outside the generator's table: torch's kernel runs it, the reason is recorded
    (lowered_sites()) and the fuzzer reports the case as a fallback with that reason. Compiled fresh:
    a graph served from Inductor's cache is not lowered again and records nothing."""
    import fa3_inductor

    case = mod_fuzz.Case(seed=0, index=0, device="cpu", dtype="float32", batch=1, q_heads=2,
                         kv_heads=1, q_len=17, kv_len=23, head_dim=16, value_head_dim=16,
                         score_src="score + torch.atan2(score, torch.abs(score) + 2.0)",
                         mask_src="(q_idx >= kv_idx)", captures={}, max_len=23)
    fa3_inductor.clear_lowered_sites()
    result = mod_fuzz.run_case(case)
    assert result["outcome"] == "fallback", result
    assert fa3_inductor.last_template() == "torch"
    assert "atan2" in result["detail"], result["detail"]
    reasons = [s["fallback_reason"] for s in fa3_inductor.lowered_sites() if s["fallback_reason"]]
    assert any("mod not lowerable" in r and "atan2" in r for r in reasons), reasons


def test_the_cli_writes_json_and_markdown(cpu_kernels, tmp_path):
    assert mod_fuzz.main(["--cases", "2", "--seed", "3", "--device", "cpu", "--workers", "1",
                          "--out", str(tmp_path)]) == 0
    (js,), (md,) = tmp_path.glob("mod-fuzz-cpu-*.json"), tmp_path.glob("mod-fuzz-cpu-*.md")
    payload = json.loads(js.read_text())
    assert payload["cases"] == 2 and sum(payload["counts"].values()) == 2
    assert {"device", "torch", "triton", "date"} <= payload.keys()
    assert payload["torch"] in md.read_text() and payload["device"] in md.read_text()


def test_a_seeded_sample_with_gradients_has_no_wrong_results_and_no_crashes(cpu_kernels):
    results = mod_fuzz.run_cases(GRAD_SEED, list(range(GRAD_CASES)), "cpu", progress=False, grad=True)
    bad = [f"{r['outcome']}: {r.get('detail', '')[:300]}\n  {r['repro']}" for r in results
           if r["outcome"] in ("wrong", "crash")]
    assert not bad, "\n".join(bad)
    assert mod_fuzz.summarize(results)["match"] >= GRAD_CASES * 0.9
    checked = [name for r in results for name in r.get("errors", {})]
    assert {"dq", "dk", "dv", "dscal", "dtable"} <= set(checked), sorted(set(checked))
    assert {r.get("backward_family") for r in results} == {"generic_bwd"}


def _grad_case(score_src, capture_grads=()):
    return mod_fuzz.Case(seed=0, index=0, device="cpu", dtype="float32", batch=1, q_heads=2, kv_heads=1,
                         q_len=17, kv_len=23, head_dim=16, value_head_dim=16, score_src=score_src, mask_src=None,
                         captures={"bias": "float32"} if "bias" in score_src else {}, max_len=23, grad=True,
                         capture_grads=capture_grads)


def test_a_wrong_gradient_is_reported_as_wrong(cpu_kernels, monkeypatch):
    """The check can fail: flex's output with dv scaled by 1.01 on its way back is 'wrong', naming dv."""
    import torch

    import fa3_inductor

    flex = fa3_inductor.flex

    class ScaledV(torch.autograd.Function):
        @staticmethod
        def forward(ctx, v):
            return v.view_as(v)

        @staticmethod
        def backward(ctx, grad):
            return grad * 1.01

    monkeypatch.setattr(fa3_inductor, "flex", lambda q, k, v, **kw: flex(q, k, ScaledV.apply(v), **kw))
    result = mod_fuzz.run_case(_grad_case("score * 0.5"))
    assert result["outcome"] == "wrong" and "of dv" in result["detail"], result.get("detail")
    assert result["errors"]["dv"] > 5e-3 and result["errors"]["dq"] < 1e-4, result["errors"]


def test_a_gradient_that_cancels_is_measured_against_its_summands(cpu_kernels):
    """``score + bias[h]`` shifts whole softmax rows: bias's exact gradient is 0, so a relative error against it
    is noise over nothing. The fuzzer measures it against the same sum of |dS|: within tolerance, and a wrong
    gradient of that size would still show (the sum of |dS| is not small)."""
    import torch

    case = _grad_case("score + bias[h]", capture_grads=("bias",))
    dout = torch.randn(1, 2, 17, 16, dtype=torch.float64)
    _, grads, scales = mod_fuzz._reference(case, "cpu", dout)
    assert grads["dbias"].abs().max() < 1e-12 and scales["dbias"].abs().min() > 1e-2
    result = mod_fuzz.run_case(case)
    assert result["outcome"] == "match", result.get("detail")
    assert result["errors"]["dbias"] < 1e-4
