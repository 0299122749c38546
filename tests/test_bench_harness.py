"""The benchmark harness itself (benchmarks/bench.py), checked on CPU.

The smoke preset runs end to end in a subprocess (fa3_inductor is timed twice per case, with
template="auto" and template="generic"; on CPU both run our generic kernel under Triton's
interpreter when TRITON_INTERPRET=1, else torch's path; stock FlexAttention is compiled by
Inductor's CPU backend, the SDPA baselines are skipped), and the result file is validated against
the schema that later tools rely on. The table and FLOP helpers are checked directly on synthetic
rows.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench.py"

IMPLS = {"fa3_inductor", "cudnn", "fa2", "flex"}
TEMPLATES = {"hopper", "generic", "torch"}
CPU_TEMPLATES = {"generic", "torch"}  # interpreter (TRITON_INTERPRET=1) or torch's path
FA3_REQUESTED = {"auto", "generic"}
ROW_TYPES = {
    "impl": str,
    "mod": str,
    "causal": bool,
    "batch": int,
    "heads": int,
    "kv_heads": int,
    "seqlen": int,
    "head_dim": int,
    "dtype": str,
    "direction": str,
}


def _load_bench():
    spec = importlib.util.spec_from_file_location("fa3_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the smoke preset is the CPU harness check, even on a GPU host
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--preset", "smoke", "--out", str(out), "--no-plot"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"bench.py failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return out, proc.stdout


def test_smoke_writes_one_json_and_one_table(smoke_run):
    out, _ = smoke_run
    names = sorted(p.name for p in out.iterdir())
    assert len([n for n in names if n.endswith(".json")]) == 1, names
    assert len([n for n in names if n.endswith(".md")]) == 1, names
    for name in names:
        assert name.startswith("bench-cpu-"), name
        assert all(c.isalnum() or c in "._-" for c in name), f"file name not transferable: {name}"


def test_smoke_json_schema(smoke_run):
    out, _ = smoke_run
    result = json.loads(next(out.glob("*.json")).read_text())
    for key, typ in {"device": str, "torch": str, "triton": str, "date": str, "preset": str, "rows": list}.items():
        assert isinstance(result.get(key), typ), f"top-level key {key!r}: {result.get(key)!r}"
    assert result["preset"] == "smoke"
    assert result["rows"], "no rows"
    for row in result["rows"]:
        for key, typ in ROW_TYPES.items():
            assert isinstance(row.get(key), typ), f"row key {key!r} = {row.get(key)!r} in {row}"
        assert row["impl"] in IMPLS
        assert row["direction"] in ("fwd", "fwd+bwd")
        assert row["mod"] in bench.MODS
        assert row["kv_heads"] <= row["heads"]
        assert "error" not in row, f"{row['impl']} {row['mod']} failed on CPU: {row['error']}"
        assert isinstance(row["ms"], float) and row["ms"] > 0
        assert isinstance(row["tflops"], float) and row["tflops"] > 0
        assert math.isclose(row["tflops"], row["flops"] / (row["ms"] * 1e-3) / 1e12, rel_tol=1e-9)
        if row["impl"] == "fa3_inductor":
            assert row["template"] in TEMPLATES & CPU_TEMPLATES, row
            assert row["template_requested"] in FA3_REQUESTED, row
        else:
            assert row["template"] is None
            assert row["template_requested"] is None
    # On CPU: no SDPA baselines; every smoke mod timed for ours (both templates) and for the reference.
    series_by_mod = {}
    for row in result["rows"]:
        series_by_mod.setdefault(row["mod"], []).append((row["impl"], row["template_requested"]))
    expected = [("flex", None), ("fa3_inductor", "auto"), ("fa3_inductor", "generic")]
    assert series_by_mod == {m: expected for m in {c.mod for c in bench.preset_cases("smoke")}}


def test_smoke_outputs_match_reference(smoke_run):
    out, _ = smoke_run
    rows = json.loads(next(out.glob("*.json")).read_text())["rows"]
    for row in rows:
        assert row["max_abs_diff_vs_ref"] is not None
        # float32 on CPU: fa3_inductor's fallback and compiled flex agree to rounding.
        assert row["max_abs_diff_vs_ref"] < 1e-4, row


def test_smoke_prints_the_table_last(smoke_run):
    out, stdout = smoke_run
    table = next(out.glob("*.md")).read_text()
    assert stdout.endswith(table)
    header = next(x for x in table.splitlines() if x.startswith("| dir | mod | D |"))
    for col in ("fa3 auto", "fa3 generic", "auto ÷cuDNN", "auto ÷flex", "generic ÷flex", "generic ÷cuDNN"):
        assert col in header
    rows = json.loads(next(out.glob("*.json")).read_text())["rows"]
    for row in rows:  # the generic column shows what ran; anything but "generic" is set in bold
        if row["template_requested"] == "generic":
            line = next(x for x in table.splitlines() if x.startswith(f"| fwd | {row['mod']} |"))
            cells = [c.strip() for c in line.strip("|").split("|")]
            assert cells[8] == ("generic" if row["template"] == "generic" else f"**{row['template']}**")


def test_render_existing_json(smoke_run):
    out, _ = smoke_run
    path = next(out.glob("*.json"))
    proc = subprocess.run([sys.executable, str(BENCH), "--render", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == next(out.glob("*.md")).read_text()


def test_presets_follow_the_paper_shapes():
    quick = bench.preset_cases("quick")
    full = bench.preset_cases("full")
    assert len(full) == 2 * 3 * 6 * 6
    for case in full:
        assert case.batch * case.seqlen == 16384
        assert case.heads * case.head_dim == 2048
    assert set(quick) <= set(full)
    assert len(set(quick)) == len(quick)
    # Most important first, so a budget cut loses the least: D=128 fwd noop/causal/softcap, then
    # D=64/256 fwd of those, then fwd+bwd, then the other mods.
    core = {"noop", "causal", "softcap"}
    stage = [0 if (c.head_dim == 128 and c.direction == "fwd" and c.mod in core) else
             1 if (c.direction == "fwd" and c.mod in core) else
             2 if c.direction == "fwd+bwd" else 3 for c in quick]
    assert stage == sorted(stage) and set(stage) == {0, 1, 2, 3}, stage
    fwd128 = {(c.mod, c.seqlen) for c in quick if c.head_dim == 128 and c.direction == "fwd"}
    assert fwd128 == {(m, n) for m in bench.MODS for n in bench.SEQLENS}
    padded = bench.preset_cases("padded")
    assert {c.head_dim for c in padded} == {80, 96, 160, 192} and all(c.heads == 2048 // c.head_dim for c in padded)
    assert {(c.mod, c.seqlen) for c in quick if c.direction == "fwd+bwd"} == {(m, 4096) for m in ("noop", "causal", "softcap")}
    assert {(c.head_dim, c.mod, c.seqlen) for c in quick if c.head_dim != 128} == {
        (d, m, n) for d in (64, 256) for m in ("noop", "causal", "softcap") for n in (4096, 16384)
    }


def test_mla_preset_and_its_flop_rule():
    """The mla preset: q/k 192 with v 128, 16 heads, 16384 tokens; FLOPs 2·B·H·N²·(D + Dv), shown as 192/128."""
    mla = bench.preset_cases("mla")
    assert mla and all((c.head_dim, c.dv, c.heads, c.batch * c.seqlen) == (192, 128, 16, 16384) for c in mla)
    assert "Dv=128" in mla[0].label()
    row = _row("fa3_inductor", 500.0, "auto", "hopper", head_dim=192, value_head_dim=128)
    table = bench.markdown_table(_result([row, _row("flex", 250.0, head_dim=192, value_head_dim=128)]))
    assert _cells(table, "| fwd | causal |")[2] == "192/128"
    assert _cells(bench.markdown_table(_result([_row("flex", 250.0)])), "| fwd | causal |")[2] == "128"


def test_flop_density_rule():
    n = 512
    causal = bench.make_mod("causal", 2, n, "cpu")
    assert bench.mask_density(causal.mask_mod, n, "cpu") == pytest.approx((n + 1) / (2 * n))
    assert bench.mask_density(None, n, "cpu") == 1.0
    window = bench.make_mod("sliding_window", 2, n, "cpu")
    w = bench.WINDOW
    kept = sum(min(q + 1, w) for q in range(n))
    assert bench.mask_density(window.mask_mod, n, "cpu") == pytest.approx(kept / n**2)
    doc_ids = bench.document_ids(4096, "cpu")
    assert doc_ids.shape == (4096,) and bool((doc_ids[1:] >= doc_ids[:-1]).all())
    assert bench.document_ids(4096, "cpu").equal(doc_ids), "document lengths must be reproducible"
    lengths = doc_ids.bincount().tolist()
    assert all(1 <= length <= 2048 for length in lengths)


def test_tile_density_and_window_option():
    """tile_density counts the pairs of the 128 x 128 tiles a block mask visits; --window sets the window."""
    n = 1024
    assert bench.tile_density_of(None) == 1.0
    spec = bench.make_mod("sliding_window", 2, n, "cpu", window=256)
    bm = bench.create_block_mask(spec.mask_mod, None, None, n, n, device="cpu")
    # query block i visits key blocks i-2 .. i (the first two query blocks fewer): 1 + 2 + 3 * 6 of 8 * 8
    assert bench.tile_density_of(bm) == pytest.approx((1 + 2 + 3 * 6) / 64)
    kept = sum(min(q + 1, 256) for q in range(n)) / n**2
    assert kept / bench.tile_density_of(bm) == pytest.approx(2 / 3, abs=2e-3)   # 2/3 of the visited pairs are kept
    wide = bench.make_mod("sliding_window", 2, n, "cpu", window=512)
    assert bench.mask_density(wide.mask_mod, n, "cpu") == pytest.approx(sum(min(q + 1, 512) for q in range(n)) / n**2)
    assert bench.parse_args(["--window", "4096"]).window == 4096
    assert bench.parse_args([]).window == bench.WINDOW


def _row(impl, tflops, requested=None, template=None, **kw):
    base = dict(impl=impl, template=template, template_requested=requested, mod="causal", causal=True,
                batch=4, heads=16, kv_heads=16, seqlen=4096, head_dim=128, dtype="bfloat16", direction="fwd",
                ms=1.0, tflops=tflops)
    base.update(kw)
    if requested is None:
        del base["template_requested"]  # as in result files written before the key existed
    return base


def _result(rows):
    return dict(device="NVIDIA H200", torch="2.11.0", triton="3.6.0", date="2026-11-22", preset="quick", rows=rows)


def _cells(table, prefix):
    line = next(x for x in table.splitlines() if x.startswith(prefix))
    return [c.strip() for c in line.strip("|").split("|")]


def test_markdown_ratios():
    rows = [_row("fa3_inductor", 600.0, "auto", "hopper"), _row("fa3_inductor", 480.0, "generic", "generic"),
            _row("cudnn", 500.0), _row("fa2", 300.0), _row("flex", 400.0),
            _row("flex", None, ms=None, mod="softcap", causal=False, error="boom")]
    table = bench.markdown_table(_result(rows))
    # fa3 auto, template, fa3 generic, template, cuDNN, FA2, flex, auto÷cuDNN, auto÷flex, generic÷flex, generic÷cuDNN
    assert _cells(table, "| fwd | causal |")[5:] == [
        "600", "hopper", "480", "generic", "500", "300", "400", "1.20", "1.50", "1.20", "0.96"]
    assert "err" in "|".join(_cells(table, "| fwd | softcap |"))
    assert "1 failure(s)" in table
    header = _cells(table, "| dir | mod | auto vs cuDNN")
    assert header == ["dir", "mod", "auto vs cuDNN", "auto vs FA2", "auto vs flex",
                      "generic vs cuDNN", "generic vs FA2", "generic vs flex"]
    assert _cells(table, "| fwd | causal | 1.20 (min")[2:] == [
        "1.20 (min 1.20)", "2.00 (min 2.00)", "1.50 (min 1.50)", "0.96 (min 0.96)", "1.60 (min 1.60)", "1.20 (min 1.20)"]


def test_markdown_generic_fallback_is_flagged():
    rows = [_row("fa3_inductor", 600.0, "auto", "hopper"), _row("fa3_inductor", 400.0, "generic", "torch"),
            _row("cudnn", 500.0), _row("flex", 400.0)]
    table = bench.markdown_table(_result(rows))
    cells = _cells(table, "| fwd | causal | 128 |")
    assert cells[7:9] == ["400", "**torch**"]
    assert 'asked for template="generic" but ran' in table
    summary = _cells(table, "| fwd | causal | 1.20 (min")
    assert summary[5:] == ["—", "—", "—"], "a torch fallback must not count as the generic template"


def test_render_old_result_without_template_requested(tmp_path, capsys):
    rows = [_row("fa3_inductor", 600.0, template="hopper"), _row("cudnn", 500.0), _row("flex", 400.0)]
    assert all("template_requested" not in r for r in rows)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(_result(rows)))
    assert bench.main(["--render", str(path)]) == 0
    cells = _cells(capsys.readouterr().out, "| fwd | causal | 128 |")
    assert cells[5:] == ["600", "hopper", "—", "—", "500", "—", "400", "1.20", "1.50", "—", "—"]


def test_device_slug():
    assert bench.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert bench.device_slug("cpu x86_64") == "cpu-x86-64"
