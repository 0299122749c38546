"""benchmarks/provenance.py: the label a result file gives its tree."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import provenance  # noqa: E402


def test_a_device_command_names_its_tree(monkeypatch):
    monkeypatch.setenv("FA3_TREE", "1a2b3c4 (the run's note)")
    assert provenance.commit_label() == "1a2b3c4 (the run's note)"


def test_without_it_the_checkout_names_itself(monkeypatch, tmp_path):
    monkeypatch.delenv("FA3_TREE", raising=False)
    assert provenance.commit_label(str(tmp_path)) is None   # not a git checkout
    label = provenance.commit_label()
    assert label is None or len(label.split("+")[0]) >= 7
