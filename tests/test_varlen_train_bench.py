"""benchmarks/varlen_train.py's report on the CPU (the timing needs an sm90 GPU): the table's cells, ratios and
host times from a row, and the refusal without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "varlen_train.py"


def _module():
    sys.path.insert(0, str(SCRIPT.parent))
    import varlen_train

    return varlen_train


def test_report_rows():
    bench = _module()
    row = dict(tokens=1024, docs=2, H=2, D=64, lengths=[700, 324], ours_ms=1.0, ours_tflops=300.0, docmask_ms=1.5,
               docmask_tflops=200.0, vs_docmask=1.5, ours_host_us=900.0, docmask_host_us=1000.0, ours_diff=0.0,
               docmask_diff=2e-3, errors={"fa2": "RuntimeError: no kernel"})
    meta = dict(device="NVIDIA H200", tree="main at abc1234", torch="2.11", triton="3.6", date="2026-11-30 01:51Z",
                command="python benchmarks/varlen_train.py", timing="CUDA events.")
    text = bench.markdown(meta, [row])
    line = next(line for line in text.splitlines() if line.startswith("| 1024 "))
    assert "| 300 | 200 | - | - | - |" in line and "| 1.50 | - | - | - |" in line
    assert "1.000 / 1.500 / -" in line and "900 / 1000" in line and "2.0e-03" in line
    assert "Tree: main at abc1234" in text and '"fa2": "RuntimeError: no kernel"' in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_needs_a_gpu():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "needs a CUDA GPU" in run.stderr


@pytest.mark.parametrize("window", [0, 1, 3, 50])
def test_window_pairs_count_the_window_masks_true_entries(window):
    """The FLOPs' pair count against the mask itself, per document (0: causal)."""
    from fa3_inductor import mods

    bench = _module()
    lengths = [int(n) for n in torch.randint(0, 40, (5,))]
    mask = mods.sliding_window(window) if window else mods.causal
    expected = sum(int(mask(0, 0, torch.arange(n)[:, None], torch.arange(n)[None, :]).sum()) for n in lengths)
    assert bench.window_pairs(lengths, window) == expected


def test_report_names_the_window():
    bench = _module()
    meta = dict(device="NVIDIA H200", tree="main at abc1234", torch="2.11", triton="3.6", date="2026-11-30 01:51Z",
                command="python benchmarks/varlen_train.py --window 1024", timing="CUDA events.", window=1024)
    assert "3.5 forwards of the causal window of 1024 keys pairs" in bench.markdown(meta, [])
