"""benchmarks/bwd_ab_rounds.py's summary (CPU, no runs): per-row medians over rounds and their ratios."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bwd_ab_rounds import summarize  # noqa: E402


def _run(**ms):
    return {"rows": [{"N": 2048, "D": 128, "Dv": 128, "variant": v, "t": t} for v, t in ms.items()]}


def test_medians_of_rounds_decide_not_one_noisy_round():
    """One round where the new tree reads slow (0.5) does not move the row's median ratio (1.25)."""
    old = [_run(causal=1.0, window=2.0), _run(causal=1.0, window=2.0), _run(causal=1.0, window=2.0)]
    new = [_run(causal=0.8, window=2.0), _run(causal=2.0, window=2.0), _run(causal=0.8, window=1.0)]
    rows, lines = summarize({"old": old, "new": new}, "t")
    by = {r["variant"]: r for r in rows}
    assert by["causal"]["ratio_median"] == pytest.approx(1.25) and by["window"]["ratio_median"] == pytest.approx(1.0)
    assert by["causal"]["new_median"] == pytest.approx(0.8)
    assert "geometric mean of the medians 1.118" in lines[0] and "lowest 1.000" in lines[0]


def test_rows_missing_from_a_round_are_left_out():
    old = [_run(causal=1.0, window=2.0)]
    new = [_run(causal=0.5)]
    rows, _ = summarize({"old": old, "new": new}, "t")
    assert [r["variant"] for r in rows] == ["causal"]
