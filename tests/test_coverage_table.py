"""The coverage harness's table and merge (benchmarks/coverage_table.py), on hand-made rows: the
site exclusions and the expressible share, the not-checked reasons, the merge of shard files
(later rows win, unfinished ones never replace finished ones, families no process finished are
listed as not reached) and what a resumed run reruns. No model is built here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import coverage_table as table  # noqa: E402

META = dict(device="NVIDIA H100 80GB HBM3", dtype="bfloat16", date="-", command="-", torch="-",
            triton="-", python="-")


def _row(family: str, sites: int = 2, fused: int = 2, left: dict | None = None, **kw) -> dict:
    row = dict(family=family, source="transformers", kind="decoder", softmaxes=sites,
               sites=sites, fused=fused, served=fused, templates={"generic": fused},
               backward={"generic_bwd": fused}, crash="", left_alone=left or {},
               out_err=1e-3, out_ok=True, grad_err=1e-3, grad_ok=True, seconds=1.0)
    row.update(kw)
    return row


def test_site_classes_and_the_expressible_share():
    rows = [
        _row("a"),
        _row("b", sites=3, fused=1, left={
            "matmul-softmax: the attention probabilities (softmax_N) are also used elsewhere": 1,
            "matmul-softmax: view_N (view) between softmax and the matmul with V is not a cast": 1}),
        _row("c", sites=1, fused=0, left={"sdpa: head dim 12 (fa3 serves multiples of 8 from "
                                          "16 to 256)": 1}),
        dict(family="d", source="transformers", excluded="no attention: no softmax, SDPA or "
                                                          "flex_attention call in its forward"),
        dict(family="e", source="timm", excluded="no tiny shape builds: x"),
    ]
    s = table.summarize(rows, enumerated=6)
    assert (s["sites"], s["fused"], s["expressible"]) == (6, 3, 4)
    assert s["excluded_sites"] == {"weights returned": 1, "kernel limit": 1}
    assert s["fused_pct_expressible"] == 75.0 and s["fused_pct"] == 50.0
    assert list(s["missed"].values()) == [1]
    assert s["not_checked_by_reason"] == {"no attention": 1, "does not build tiny": 1,
                                          table.NOT_REACHED: 1}
    text = table.markdown(dict(META, enumerated_count=6), rows, [])
    assert "Fused where the math is expressible: 3 of 4 sites (75.0%)" in text
    assert "### no attention (1)" in text and "[weights returned]" in text


def test_crashes_tolerance_and_pass():
    ours = _row("a", crash="RuntimeError: boom")
    stock = _row("b", crash=f"{table.STOCK_FAILS}: RuntimeError: boom")
    bad = _row("c", grad_ok=False)
    guarded = _row("d", left={f"matmul-softmax: fa3 compilation failed ... This is a "
                              f"{table.OUR_BUG}": 2}, fused=0)
    s = table.summarize([ours, stock, bad, guarded, _row("e")])
    assert (s["crashes_ours"], s["crashes_stock"], s["guarded"]) == (1, 1, 1)
    assert s["tolerance_failures"] == ["c"] and s["passed"] == 2   # b (not ours) and e
    assert [table.row_passes(r) for r in (ours, stock, bad, guarded)] == [False, True, False, False]


def test_merge_later_rows_win_and_unfinished_never_replace(tmp_path: Path):
    first = dict(META, enumerated=[["transformers", n] for n in "abcd"],
                 rows=[_row("a", crash="RuntimeError: x"), _row("b")],
                 timing=[dict(family="bert", batch=8, seq=512, error="x")])
    second = dict(META, enumerated=[["transformers", "a"], ["timm", "z"]],
                  rows=[_row("a"), dict(_row("b"), unfinished=True, excluded="timed out: cut")],
                  timing=[dict(family="bert", batch=8, seq=512, fa3_ms=1.0, inductor_ms=2.0,
                               speedup=2.0)])
    files = []
    for i, data in enumerate((first, second)):
        files.append(tmp_path / f"{i}.json")
        files[-1].write_text(json.dumps(data))
    meta, rows, timing = table.merge(files, claimed=[("transformers", "c")])
    by = {r["family"]: r for r in rows}
    assert by["a"]["crash"] == "" and "excluded" not in by["b"]
    assert by["c"]["unfinished"] and by["c"]["excluded"].startswith(table.NOT_REACHED)
    assert meta["not_reached"] == [["transformers", "d"], ["timm", "z"]]
    assert meta["enumerated_count"] == 5 and timing[0]["speedup"] == 2.0
    s = table.summarize(rows, meta["enumerated_count"])
    assert s["not_checked_by_reason"][table.NOT_REACHED] == 3   # c (died) and d, z (never started)
    text = table.markdown(meta, rows, timing)
    assert "Geometric mean of inductor ÷ fa3 over 1 families: 2.00" in text


def test_merge_names_the_newest_run_environment_first(tmp_path: Path):
    """A resumed file comes first, but its commit and versions are not those of the rows run last."""
    files = []
    for i, (commit, diffusers) in enumerate((("e1928da", None), ("b8e927d", "0.42.1"), ("b8e927d", "0.42.1"))):
        files.append(tmp_path / f"{i}.json")
        files[-1].write_text(json.dumps(dict(META, commit=commit, diffusers=diffusers, enumerated=[],
                                             rows=[_row(f"f{i}")])))
    meta, _, _ = table.merge(files)
    assert meta["commit"] == "b8e927d (rows run last); earlier: e1928da"
    assert meta["diffusers"] == "0.42.1 (rows run last); earlier: None"
    assert meta["torch"] == "-"   # one value: kept as it is


def test_settled_rows_are_skipped_on_resume():
    assert table.settled(_row("a"))
    assert table.settled(dict(family="x", source="t", excluded="main input 'states': ..."))
    assert not table.settled(_row("a", out_ok=False))
    assert not table.settled(_row("a", crash="RuntimeError: x"))
    assert not table.settled(dict(family="x", source="t", excluded="timed out: family took"))
    assert not table.settled(dict(family="x", source="t", excluded="harness error: KeyError"))
    assert not table.settled(dict(family="x", source="t", excluded="timed out", unfinished=True))


def test_every_size_switches_the_size_rule_off():
    """The GPU checks rely on it: with the rule on, every site of a tiny model stays as written."""
    from types import SimpleNamespace

    import torch

    import coverage_timing
    from fa3_inductor.recognition import recognize_sdpa, rewrite_pays

    cuda = torch.device("cuda")
    q = SimpleNamespace(device=cuda, shape=(2, 4, 16, 16), requires_grad=True)
    v = SimpleNamespace(device=cuda, shape=(2, 4, 16, 16), requires_grad=True)
    plain = (cuda, [2, 4, 16, 16], 16, False, True)
    assert rewrite_pays.small_site_reason(q, v) and recognize_sdpa.sdpa_keeps_plain_call(*plain)
    with coverage_timing.every_size():
        assert rewrite_pays.small_site_reason(q, v) is None
        assert recognize_sdpa.sdpa_keeps_plain_call(*plain) is None
    assert rewrite_pays.small_site_reason(q, v) and recognize_sdpa.sdpa_keeps_plain_call(*plain)
