"""examples/generate.py --smoke: the generation example end to end on the CPU (a tiny random Llama,
static cache, "fa3" against "sdpa"), in a subprocess without the interpreter (as a user runs it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_generates_the_same_greedy_tokens(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "generate.py"), "--smoke",
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["batch"] for r in records] == [1, 2]
    [written] = tmp_path.glob("generate-cpu-*.json")
    assert json.loads(written.read_text())["records"] == records
    assert done.stdout.rstrip().splitlines()[-2].startswith("| 2 | 12 |")   # the table, then the path
    for r in records:
        assert r["identical_sequences"] == f"{r['batch']}/{r['batch']}", r
        assert r["fa3"]["decode_tokens_per_s"] > 0 and r["sdpa"]["prefill_ms"] > 0
        # the ratio of the two rates (a tiny CPU decode is at the noise of the prefill it is measured
        # beside, so the rates themselves are not compared)
        rates = r["fa3"]["decode_tokens_per_s"] / r["sdpa"]["decode_tokens_per_s"]
        assert abs(r["fa3_over_sdpa_tokens_per_s"] - rates) <= 1e-3 + 0.02 * rates, r   # rates rounded to 0.1
        assert r["max_logit_diff_before_divergence"] < 1e-3
        for impl in ("sdpa", "fa3"):   # the smoke model is float32: its own reference
            check = r["float32_check"][impl]
            assert check["argmax_agreement"] == 1.0 and check["max_abs_logit_error"] < 1e-3, r


def test_gpu_cases_that_cannot_fit_are_named():
    """The default GPU list ends with 32 x 32k, whose prefill activations exceed an 80 GB card:
    run() skips it with the reason instead of running out of memory."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate_example", ROOT / "examples" / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    sizes = {case: gen.prefill_bytes(*case, 64, 4, gen.REALISTIC) for case in gen.GPU_CASES}
    assert sizes[(32, 32768)] > 80e9 > 40e9 > max(sizes[(1, 4096)], sizes[(32, 4096)], sizes[(1, 32768)])


def test_static_cache_decode_runs_the_decode_family_and_matches_sdpa(monkeypatch):
    """In-process under Triton's interpreter: greedy decode with a static cache reaches the decode
    family through flex(), and its logits equal sdpa's at every step (before the mask snapshot in
    integrations/transformers.py, each step's query saw the unwritten next cache slot)."""
    import importlib.util

    import torch
    from triton import knobs

    import fa3_inductor

    if not knobs.runtime.interpret:
        pytest.skip("runs our kernels on CPU tensors: needs TRITON_INTERPRET=1")
    # transformers' BlockMask builder eagerly (its compiled one dominates a CPU test)
    monkeypatch.setattr("transformers.masking_utils._is_torch_greater_or_equal_than_2_6", False)
    spec = importlib.util.spec_from_file_location("generate_example", ROOT / "examples" / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    models = gen.build_models(1, 24, smoke=True, device="cpu", dtype=torch.float32)
    torch.manual_seed(1)
    ids = torch.randint(1, 96, (2, 9))
    with torch.no_grad():
        outs = {impl: gen._generate(model, ids, 4) for impl, model in models.items()}
    assert fa3_inductor.last_template() == "decode"
    report = gen.compare_tokens(outs["sdpa"], outs["fa3"], ids.shape[1])
    assert report["identical_sequences"] == "2/2", report
    assert report["max_logit_diff_before_divergence"] < 1e-4, report


def test_real_text_prompts_and_the_report_cells():
    """--gguf's prompts (the text repeated, each row ROW_STRIDE tokens further in) and the table's
    divergence and per-phase family cells, without a model (the --gguf run itself loads a 98 MB
    file and takes minutes on a CPU: docs/design/decode.md gives its command)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate_example", ROOT / "examples" / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    ids = gen.text_prompt_ids(list(range(10)), 3, 25)
    assert ids.shape == (3, 25)
    for b in range(3):
        assert ids[b].tolist() == [(b * gen.ROW_STRIDE + i) % 10 for i in range(25)]
    record = {"batch": 1, "prompt": 64, "sdpa": {"decode_tokens_per_s": 2.0, "prefill_ms": 1.0},
              "fa3": {"decode_tokens_per_s": 1.0, "prefill_ms": 2.0}, "fa3_over_sdpa_tokens_per_s": 0.5,
              "identical_sequences": "0/1", "token_match_rate": 0.5,
              "first_divergence": {"sequence": 0, "step": 4, "sdpa_top2_margin": 0.0625},
              "float32_check": {"sdpa": {"max_abs_logit_error": 1.5, "mean_abs_logit_error": 0.1,
                                         "argmax_agreement": 0.99},
                                "fa3": {"max_abs_logit_error": 1.7, "mean_abs_logit_error": 0.09,
                                        "argmax_agreement": 0.98}},
              "fa3_family": {"prefill": "hopper", "decode_lowered": {"q_len 4096": {"hopper": 1},
                                                                     "q_len 1": {"decode": 30}},
                             "after_generate": "hopper"}}
    row = gen.table([record]).splitlines()[-1]
    assert ("| step 4 (row 0), gap 0.0625 | 0.1 / 0.09, 0.99 / 0.98 | hopper / decode x30 (lowered) |"
            in row), row
    record["float32_check"] = {"skipped": "out of memory: x"}
    assert "| out of memory: x | hopper / decode x30 (lowered) |" in gen.table([record]), gen.table([record])
    record["fa3_family"]["decode_lowered"] = {}
    assert gen.table([record]).endswith("| hopper / hopper (run time) |")
    # the first divergence is the earliest step any sequence differs, with that sequence's sdpa gap
    from types import SimpleNamespace

    import torch

    ref_tokens = torch.tensor([[9, 1, 2, 3, 4], [9, 1, 2, 3, 4]])
    ours_tokens = torch.tensor([[9, 1, 2, 7, 7], [9, 1, 5, 3, 4]])   # row 0 at step 2, row 1 at step 1
    logits = [torch.tensor([[0.0, 3.0, 1.0], [0.0, 2.0, 1.75]]) for _ in range(4)]
    ref, ours = (SimpleNamespace(sequences=t, logits=logits) for t in (ref_tokens, ours_tokens))
    report = gen.compare_tokens(ref, ours, 1)
    assert report["first_divergence"] == {"sequence": 1, "step": 1, "sdpa_top2_margin": 0.25}, report
    assert report["identical_sequences"] == "0/2" and report["max_logit_diff_before_divergence"] == 0.0
