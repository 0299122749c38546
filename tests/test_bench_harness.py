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
import torch

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
    assert result["fp8"] is False and "fp8_skipped" not in result, "FP8 rows are off unless --fp8"
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


# --------------------------------------------------------------------------------------------
# FP8 rows (--fp8 / --preset fp8)
# --------------------------------------------------------------------------------------------


def _fp8_rows(full, kernel, prologue_ms=0.2, gbps=2500.0, template="fp8", **kw):
    """The three FP8 rows of one case as run_case writes them (dtype fp8, inputs in input_dtype)."""
    input_dtype = kw.pop("input_dtype", "bfloat16")
    fp8 = dict(dtype="fp8", input_dtype=input_dtype, **kw)
    return [
        _row("fa3_inductor", full, "fp8", template, what="with prologue", cosine_vs_ref=0.99871, **fp8),
        _row("fa3_inductor", kernel, "fp8", "fp8", what="kernel", cosine_vs_ref=0.99871, **fp8),
        _row("prologue", None, what="quantize", ms=prologue_ms, flops=None, bytes=int(gbps * 1e9 * prologue_ms * 1e-3),
             gbps=gbps, **fp8),
    ]


def test_markdown_fp8_rows():
    """FP8 rows get their own table: dtype column (the inputs'), ratios of fp8 + prologue over cuDNN and over
    fa3 auto, kernel alone over cuDNN, the prologue's GB/s against the copy bandwidth; the main table is
    unchanged by them; the JSON round trip renders the same."""
    bf16 = [_row("fa3_inductor", 600.0, "auto", "hopper"), _row("fa3_inductor", 480.0, "generic", "generic"),
            _row("cudnn", 500.0), _row("fa2", 300.0), _row("flex", 400.0)]
    fp16 = [_row(r["impl"], r["tflops"] * 1.02, r.get("template_requested"), r["template"], dtype="float16")
            for r in bf16]
    rows = bf16 + _fp8_rows(750.0, 900.0) + fp16 + _fp8_rows(612.0, 918.0, input_dtype="float16")
    # a case whose fp8=True call fell back to torch's kernel: shown in bold, out of the +prologue summary
    rows += [_row("fa3_inductor", 610.0, "auto", "hopper", mod="noop", causal=False),
             _row("cudnn", 550.0, mod="noop", causal=False)]
    rows += _fp8_rows(110.0, 1100.0, template="torch", mod="noop", causal=False)
    result = _result(rows)
    result.update(fp8=True, copy_bytes_per_s=3.0e12,
                  fp8_skipped=[dict(direction="fwd+bwd", mod="causal", head_dim=128, seqlen=4096,
                                    reason="FP8 is inference-only: flex(fp8=True) has no backward")])
    table = bench.markdown_table(result)
    # the main table reads the bf16 rows only, as without FP8 rows
    assert _cells(table, "| fwd | causal | 128 | 4096 |")[5:] == [
        "600", "hopper", "480", "generic", "500", "300", "400", "1.20", "1.50", "1.20", "0.96"]
    head = _cells(table, "| mod | D | seqlen | B×H | dtype |")
    assert head == ["mod", "D", "seqlen", "B×H", "dtype", "cuDNN", "fa3 auto", "fp8 + prologue", "template",
                    "fp8 kernel", "prologue ms", "prologue GB/s", "+prologue ÷cuDNN", "+prologue ÷fa3 auto",
                    "kernel ÷cuDNN", "cos vs ref"]
    # 750 / 500, 750 / 600, 900 / 500; 2500 GB/s of a 3 TB/s copy
    assert _cells(table, "| causal | 128 | 4096 | 4×16 | bf16 |")[5:] == [
        "500", "600", "750", "fp8", "900", "0.200", "2500 (83%)", "1.50", "1.25", "1.80", "0.99871"]
    assert _cells(table, "| causal | 128 | 4096 | 4×16 | fp16 |")[5:12] == [
        "510", "612", "612", "fp8", "918", "0.200", "2500 (83%)"]
    assert _cells(table, "| causal | 128 | 4096 | 4×16 | fp16 |")[12:15] == ["1.20", "1.00", "1.80"]
    noop = _cells(table, "| noop | 128 | 4096 | 4×16 | bf16 |")
    assert noop[8] == "**torch**" and noop[12:15] == ["0.20", "0.18", "2.00"]
    assert "1 case(s) asked for fp8=True but ran the template shown in bold" in table
    # summary: geometric means over bf16 and fp16 (sqrt(1.5 * 1.2) = 1.34, sqrt(1.25 * 1.0) = 1.12, 1.80);
    # the torch fallback's +prologue ratios left out, its kernel ratio kept
    assert _cells(table, "| causal | 1.34 (min") == ["causal", "1.34 (min 1.20)", "1.12 (min 1.00)", "1.80 (min 1.80)"]
    assert _cells(table, "| noop | — |") == ["noop", "—", "—", "2.00 (min 2.00)"]
    assert "fwd+bwd cases have no FP8 rows" in table
    assert "- 1 case(s): FP8 is inference-only: flex(fp8=True) has no backward" in table
    assert "failure(s)" not in table


def test_markdown_fp8_errors_and_absence(tmp_path, capsys):
    rows = [_row("fa3_inductor", 600.0, "auto", "hopper"), _row("cudnn", 500.0)]
    assert "FP8" not in bench.markdown_table(_result(rows)), "no FP8 section without --fp8 and FP8 rows"
    broken = _fp8_rows(750.0, 900.0)
    broken[1].update(ms=None, tflops=None, error="RuntimeError: boom")
    broken[2].update(ms=None, gbps=None, error="RuntimeError: bang")
    result = _result(rows + broken)
    path = tmp_path / "fp8.json"
    path.write_text(json.dumps(result))
    assert bench.main(["--render", str(path)]) == 0
    table = capsys.readouterr().out
    assert table == bench.markdown_table(result)
    cells = _cells(table, "| causal | 128 | 4096 | 4×16 | bf16 |")
    assert cells[7:12] == ["750", "fp8", "err", "err", "err"]
    assert cells[12:15] == ["1.50", "1.25", "—"]
    assert "- fa3_inductor[fp8] kernel fwd causal D=128 N=4096: RuntimeError: boom" in table
    assert "- prologue quantize fwd causal D=128 N=4096: RuntimeError: bang" in table


def test_fp8_series_and_case_keys():
    full, kernel, prologue = _fp8_rows(750.0, 900.0)
    assert [bench.series_of(r) for r in (full, kernel, prologue)] == [
        ("fa3_inductor", "fp8"), ("fa3_inductor", "fp8 kernel"), ("prologue", None)]
    plain = _row("cudnn", 500.0)
    assert bench._group_key(full) == bench._group_key(kernel) == bench._group_key(plain)
    assert bench._group_key(_fp8_rows(1.0, 1.0, input_dtype="float16")[0]) != bench._group_key(plain)


def test_fp8_option_preset_and_skips():
    assert bench.parse_args([]).fp8 is False
    assert bench.parse_args(["--fp8"]).fp8 is True
    assert bench.parse_args(["--preset", "fp8"]).preset == "fp8"
    cases = bench.preset_cases("fp8")
    quick = bench.preset_cases("quick")
    assert len(cases) == len(set(cases)) == 30 and set(cases) <= set(quick)
    assert {c.direction for c in cases} == {"fwd"} and {c.mod for c in cases} == {"noop", "causal", "softcap"}
    assert {(c.mod, c.seqlen) for c in cases if c.head_dim == 128} == {
        (m, n) for m in ("noop", "causal", "softcap") for n in bench.SEQLENS}
    assert {(c.head_dim, c.seqlen) for c in cases if c.head_dim != 128} == {
        (d, n) for d in (64, 256) for n in (4096, 16384)}
    assert all(c.batch * c.seqlen == 16384 and c.heads * c.head_dim == 2048 for c in cases)
    skip = bench.fp8_skip_reason
    fwd, bwd = bench.Case.paper("causal", 128, 4096, "fwd"), bench.Case.paper("causal", 128, 4096, "fwd+bwd")
    assert "inference-only" in skip(bwd, "cpu", torch.bfloat16, ["fa3_inductor"])
    assert "float32" in skip(fwd, "cpu", torch.float32, ["fa3_inductor"])
    assert "fa3_inductor" in skip(fwd, "cpu", torch.bfloat16, ["cudnn", "flex"])
    from triton import knobs

    cpu = skip(fwd, "cpu", torch.float16, ["fa3_inductor"])
    assert (cpu is None) if knobs.runtime.interpret else ("TRITON_INTERPRET=1" in cpu)


@pytest.fixture(scope="module")
def smoke_fp8_run(tmp_path_factory):
    """One tiny causal case with --fp8 on the CPU: under Triton's interpreter (conftest sets it without
    CUDA) the FP8 rows run our kernel; without it they are skipped with the reason."""
    out = tmp_path_factory.mktemp("bench_fp8")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--preset", "smoke", "--fp8", "--dtype", "bfloat16", "--mods", "causal",
         "--impls", "fa3_inductor,flex", "--fa3-templates", "auto", "--rounds", "1", "--out", str(out), "--no-plot"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"bench.py failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(next(out.glob("*.json")).read_text()), next(out.glob("*.md")).read_text(), env


def test_smoke_fp8_rows(smoke_fp8_run):
    result, table, env = smoke_fp8_run
    assert result["fp8"] is True and result["fp8_recipe"]["block_m"] == 128
    fp8 = [r for r in result["rows"] if r["dtype"] == "fp8"]
    plain = [r for r in result["rows"] if r["dtype"] != "fp8"]
    assert {r["dtype"] for r in plain} == {"bfloat16"} and len(plain) == 2
    if env.get("TRITON_INTERPRET", "0") in ("", "0"):
        assert not fp8 and "TRITON_INTERPRET=1" in result["fp8_skipped"][0]["reason"]
        assert "No FP8 rows for:" in table
        return
    assert result["fp8_skipped"] == []
    by_what = {r["what"]: r for r in fp8}
    assert set(by_what) == {"with prologue", "kernel", "quantize"}
    for r in fp8:
        assert "error" not in r, r
        assert r["input_dtype"] == "bfloat16" and r["direction"] == "fwd" and r["mod"] == "causal"
        assert isinstance(r["ms"], float) and r["ms"] > 0
    full, kernel, pro = by_what["with prologue"], by_what["kernel"], by_what["quantize"]
    for r in (full, kernel):
        assert (r["impl"], r["template_requested"], r["template"]) == ("fa3_inductor", "fp8", "fp8")
        assert r["flops"] == plain[0]["flops"], "FP8 rows count the FLOPs of the bf16 rows"
        assert math.isclose(r["tflops"], r["flops"] / (r["ms"] * 1e-3) / 1e12, rel_tol=1e-9)
        assert r["cosine_vs_ref"] > 0.99 and "variants_waited" in r
    # the kernel alone computes what flex(fp8=True) computes: same operands, mods and block mask
    assert kernel["max_abs_diff_vs_ref"] == full["max_abs_diff_vs_ref"]
    assert (pro["impl"], pro["template_requested"], pro["tflops"], pro["flops"]) == ("prologue", None, None, None)
    numel = 1 * 2 * 256 * 64
    assert pro["bytes_read"] == 3 * numel * 2 and pro["bytes_written"] >= 3 * numel
    assert pro["bytes"] == pro["bytes_read"] + pro["bytes_written"]
    assert math.isclose(pro["gbps"], pro["bytes"] / (pro["ms"] * 1e-3) / 1e9, rel_tol=1e-9)
    assert _cells(table, "| causal | 64 | 256 | 1×2 | bf16 |")[8] == "fp8"


def test_result_files_write_one_pair(tmp_path, capsys):
    """benchmarks/result_files.write_result (bwd_kernels.py, reduce_rate.py): <prefix>-<device>-<time>.json holds the
    run's metadata and rows, .md the lines, and the markdown is printed."""
    import datetime

    spec = importlib.util.spec_from_file_location("result_files", ROOT / "benchmarks" / "result_files.py")
    result_files = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(result_files)
    meta = dict(device="NVIDIA H200", torch="2.11", triton="3.6", date="2026-11-30 06:40Z", command="python x.py")
    now = datetime.datetime(2026, 11, 30, 6, 40, tzinfo=datetime.timezone.utc)
    name = result_files.write_result(str(tmp_path / "out"), "reduce-rate", meta, now, [{"ms": 1.5}], ["# t", "| a |"])
    assert name == "reduce-rate-nvidia-h200-2026-11-30-0640"
    assert json.loads((tmp_path / "out" / f"{name}.json").read_text()) == dict(meta, rows=[{"ms": 1.5}])
    assert (tmp_path / "out" / f"{name}.md").read_text() == "# t\n| a |\n"
    assert capsys.readouterr().out.strip().endswith("| a |")


def test_tile_cost_fit_recovers_a_line():
    """benchmarks/bwd_tile_cost.tile_costs: main-kernel times that are exactly F a tile plus s a 64-row step (as SM time
    over the SMs) give back F and s, with no residual; one perturbed time shows as the worst residual."""
    spec = importlib.util.spec_from_file_location("bwd_tile_cost_fit", ROOT / "benchmarks" / "bwd_tile_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tiles, sms, F, s = 2816, 132, 6.1, 2.74   # µs
    seqlens = [512, 1024, 2048, 4096]
    times = [(tiles * (F + s * M / 64)) / sms / 1e3 for M in seqlens]
    r = module.tile_costs(seqlens, times, tiles, sms)
    assert math.isclose(r["tile_fixed_us"], F, rel_tol=1e-9) and math.isclose(r["step_us"], s, rel_tol=1e-9)
    assert r["worst_residual_ms"] < 1e-12
    times[1] += 0.01
    assert module.tile_costs(seqlens, times, tiles, sms)["worst_residual_ms"] > 0.004
