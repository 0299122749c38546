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
        assert r["fa3_over_sdpa_tokens_per_s"] > 0 and r["max_logit_diff_before_divergence"] < 1e-3


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
