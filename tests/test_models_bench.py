"""benchmarks/models.py --smoke on the CPU: the harness runs, fuses, and writes its files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "models.py"


def test_models_smoke_writes_json_and_table(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("TORCH_LOGS", None)
    run = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--models", "llama",
                          "--impls", "fa3,sdpa", "--layers", "1", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    [json_path] = tmp_path.glob("models-*.json")
    [md_path] = tmp_path.glob("models-*.md")
    result = json.loads(json_path.read_text())
    assert {"device", "torch", "triton", "date", "rows"} <= set(result)
    by_impl = {r["impl"]: r for r in result["rows"]}
    assert set(by_impl) == {"fa3", "sdpa"}
    fa3 = by_impl["fa3"]
    assert fa3["fused"] == 1 and fa3["templates"] == {"generic": 1}, fa3
    assert fa3["rel_err_vs_eager"] < 1e-4 and fa3["ms"] > 0
    table = md_path.read_text()
    assert "| llama | 32 |" in table and "1/1 generic:1" in table
    assert run.stdout.rstrip().endswith(table.rstrip().splitlines()[-1])  # table printed last
