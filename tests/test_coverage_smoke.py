"""The coverage harness (benchmarks/coverage.py), CI subset: the enumeration walks transformers'
auto mappings, the shrinker makes tiny configs, and one family (GPT-2: causal mask, Conv1D
projections) goes through the whole check: explain() under backend="fa3", outputs and gradients
against the float64 uncompiled model, one table row. The full run is `python3
benchmarks/coverage.py` (docs/coverage.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import coverage  # noqa: E402
import coverage_hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("our_kernels", "fresh_compiles")


def test_enumeration_walks_the_auto_mappings():
    names = coverage_hf.hf_families()
    assert len(names) > 400 and {"bert", "gpt2", "t5", "llama", "whisper", "vit"} <= set(names)


def test_shrinker_makes_tiny_consistent_configs():
    cfg = coverage_hf.hf_config("mistral")   # 32 heads, 8 KV heads: GQA kept
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.num_hidden_layers) == (64, 4, 2, 2)
    assert len(coverage_hf.hf_config("qwen2").layer_types) == 2   # per-layer lists follow the layer count
    assert all(v is None or v < cfg.vocab_size for v in (cfg.bos_token_id, cfg.eos_token_id))
    t5 = coverage_hf.hf_config("t5")
    assert (t5.d_model, t5.num_heads, t5.d_kv, t5.num_layers) == (64, 4, 16, 2)


def test_one_family_end_to_end():
    fam = next(f for f in coverage.families(["transformers"]) if f.name == "gpt2")
    row = coverage.check_family(fam, torch.device("cpu"), torch.float32)
    assert "excluded" not in row and row["crash"] == "", row
    assert (row["sites"], row["fused"]) == (2, 2), row
    assert row["out_ok"] and row["grad_ok"], row
    table = coverage.markdown(dict(device="cpu", dtype="float32", date="-", command="-",
                                   torch="-", triton="-", python="-"), [row], [])
    assert "| gpt2 | transformers | decoder |" in table
    assert coverage.summarize([row])["fused_pct"] == 100.0
