"""benchmarks/fp8_model.py's metrics against hand-computed values (CPU, no model, no weights)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import fp8_model  # noqa: E402


def test_compare_hand_computed():
    r = fp8_model.compare(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0], dtype=torch.float64))
    assert r["cosine"] == pytest.approx(1 / math.sqrt(2), rel=1e-12)
    assert r["rel_err"] == pytest.approx(1 / math.sqrt(2), rel=1e-12)
    same = fp8_model.compare(torch.tensor([[3.0, 4.0]], dtype=torch.bfloat16), torch.tensor([[3.0, 4.0]]))
    assert same == {"cosine": pytest.approx(1.0), "rel_err": 0.0}
    # scaled output: cosine 1, relative error |s - 1|
    r = fp8_model.compare(2 * torch.arange(1.0, 5.0), torch.arange(1.0, 5.0))
    assert r["cosine"] == pytest.approx(1.0) and r["rel_err"] == pytest.approx(1.0)


def test_top1_agreement_over_positions():
    ref = torch.tensor([[[0.0, 2.0, 1.0], [5.0, 0.0, 0.0], [0.0, 0.0, 1.0], [1.0, 3.0, 2.0]]])
    ours = torch.tensor([[[0.0, 1.0, 0.5], [0.0, 5.0, 0.0], [0.0, 0.0, 9.0], [1.0, 0.0, 2.0]]])
    assert fp8_model.top1_agreement(ours, ref) == 0.5
    assert fp8_model.top1_agreement(ref, ref) == 1.0
