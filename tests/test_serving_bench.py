"""benchmarks/serving.py --smoke on the CPU: every part runs end to end under Triton's interpreter
(float32, tiny shapes), every impl that can run on a CPU agrees with ours, and both files are written
with the tables last; plus the row sets and the budget rule."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "serving.py"


def _module():
    """The script as a module (registered first: its dataclasses look their module up)."""
    if "serving_bench" not in sys.modules:
        spec = importlib.util.spec_from_file_location("serving_bench", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["serving_bench"] = module
        spec.loader.exec_module(module)
    return sys.modules["serving_bench"]


def test_smoke_run_writes_every_part(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("TORCH_LOGS", None)
    run = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [json_path] = tmp_path.glob("serving-cpu-*.json")
    [md_path] = tmp_path.glob("serving-cpu-*.md")
    result = json.loads(json_path.read_text())
    assert {"device", "torch", "triton", "date", "command", "timing", "checks", "rows"} <= set(result)
    assert set(result["checks"]) == {"decode", "varlen"} and not result["budget_stops"]
    rows = result["rows"]
    assert [r["part"] for r in rows] == ["decode", "decode", "splits", "paged", "varlen"], rows
    for r in rows:
        assert not {"fa3_flex", "fa3_decode", "fa3_paged", "ours", "row"} & set(r.get("errors", {})), r
        diffs = {k: v for k, v in r.items() if k.endswith("_diff")}
        assert diffs and max(diffs.values()) < 1e-4, diffs   # float32: the impls agree with ours
    decode = rows[0]
    assert {"fa3_flex_ms", "fa3_decode_ms", "fa3_paged_ms", "copy_ms", "sdpa_ms", "torch_flex_ms",
            "fa3_flex_host_us", "fa3_flex_vs_sdpa", "fa3_flex_vs_torch_flex", "fa3_flex_pct_copy",
            "paged_over_contig"} <= set(decode), decode
    assert all(r["fa3_flex_family"] == "decode" for r in rows[:2])   # flex() reached the family
    assert rows[1]["splits"] > 1                                     # the split + combine path ran
    sweep = rows[2]
    assert {"by_splits_ms", "best_splits", "empty_auto_ms", "empty_S1_ms"} <= set(sweep), sweep
    assert set(rows[3]["by_page_ms"]) == {"8", "16", "32"}           # pages below and above a tile
    varlen = rows[4]
    assert sum(varlen["lengths"]) == varlen["tokens"] and len(varlen["lengths"]) == 6
    assert {"ours_ms", "ours_triton_ms", "docmask_ms", "flex_ms", "vs_docmask", "ours_tflops",
            "ours_16x16x4x1_ms"} <= set(varlen), varlen
    assert varlen["ours_kernel"] == "triton"   # the CPU interpreter
    table = md_path.read_text()
    for heading in ("## decode", "## split counts", "## page sizes", "## varlen", "## targets"):
        assert heading in table
    out = run.stdout.rstrip()
    assert "serving summary (cpu)" in out[-3000:] and out.endswith(table.rstrip().splitlines()[-1])


def test_row_sets_and_budget():
    sb = _module()
    default, full, quick = sb.decode_cases(False), sb.decode_cases(True), sb.decode_cases(False, True)
    assert len(set(default)) == len(default) and set(default) <= set(full)
    assert len(set(quick)) == len(quick) and set(quick) <= set(full)
    # --quick spans issue 20's grid: batch 1-64, cache 4k-128k, GQA 32/8 and MHA, D64 and D128
    assert {c.batch for c in quick} == {1, 8, 32, 64} and {c.cache for c in quick} == {4096, 8192, 32768, 131072}
    assert {c.hkv for c in quick} == {8, 32} and {c.d for c in quick} == {64, 128}
    assert all(c.kv_bytes() <= sb.KV_CAP for c in full)
    assert {(c.batch, c.new, c.cache, c.hkv, c.d) for c in full} >= {(64, 4, 128 * 1024, 8, 64)}
    assert (64, 1, 128 * 1024, 8, 128) not in {(c.batch, c.new, c.cache, c.hkv, c.d) for c in full}
    assert all(c.kv_bytes() <= sb.PAGED_KV_CAP for c in sb.paged_cases(True))
    assert set(sb.paged_cases(False, True)) <= set(sb.paged_cases(False)) <= set(sb.paged_cases(True))
    assert set(sb.split_cases(False, True)) <= set(sb.split_cases(True))
    lengths = sb.doc_lengths(sb.VARLEN)
    assert sum(lengths) == 16384 and min(lengths) >= 16384 // 48 and max(lengths) > 2 * min(lengths)
    assert sb.doc_lengths(sb.VARLEN) == lengths                          # seeded
    assert sb.within_budget(100.0, 1.0, 0) and not sb.within_budget(100.0, 1.0, 3)
    assert sb.within_budget(0.5, 1.0, 3)
    assert list(sb.BUDGET_SHARE) == list(sb.PARTS) and sb.BUDGET_SHARE["varlen"] == 1.0


def test_fp8kv_part_on_the_cpu(cpu_kernels):
    """The fp8kv part's check, row and table in process (float32 under the interpreter): the FP8
    kernel equals bf16 flex_decode on the dequantized cache, every impl timed, a table row written;
    the part runs only when asked."""
    sb = _module()
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    check = sb.check_fp8kv(cpu, torch.float32)
    assert set(check["rel_error"]) == {"fp8", "fp8_paged"} and max(check["rel_error"].values()) < 1e-4
    row = sb.fp8kv_row(sb.SMOKE_FP8KV[0], cpu, torch.float32, sb.Clock(cpu, 1, 0))
    assert not row.get("errors"), row
    assert {"bf16_ms", "fp8_ms", "bf16_paged_ms", "fp8_paged_ms", "fp8_bn128_ms", "copy_ms", "fp8_tbps",
            "fp8_over_bf16", "fp8_paged_over_bf16_paged", "bn128_over_fp8"} <= set(row), row
    assert row["fp8_vs_dequant_diff"] < 1e-4 and row["fp8_bn128_vs_dequant_diff"] < 1e-4
    assert 0 < row["fp8_quant_err"] < 0.1   # e4m3's rounding of the cache, not a kernel error
    assert row["kv_gb"] * 4 == row["bf16_kv_gb"]   # float32 here: 4 bytes a value against 1
    row["label"] = "x"
    table = sb._fp8kv_table([row])
    assert table[0].startswith("## FP8 KV cache") and table[-2].count("|") == 21
    assert "fp8kv" in sb.PARTS and "fp8kv" not in sb.DEFAULT_PARTS


def test_window_part_on_the_cpu(cpu_kernels):
    """The window part's row and table in process (float32 under the interpreter): every window agrees with the
    float64 reference and with torch's flex, the paged cache with the contiguous one."""
    sb = _module()
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    row = sb.window_row(sb.SMOKE_WINDOW[0], cpu, torch.float32, sb.Clock(cpu, 1, 0), sb._flex_function(True))
    assert not row.get("errors"), row
    assert {"full_ms", "w8_ms", "w64_ms", "w256_ms", "paged_mid_ms", "torch_flex_ms", "mid_tbps"} <= set(row), row
    assert max(row[k] for k in row if k.endswith("_diff")) < 1e-4, row
    table = sb._window_table([row])
    assert table[0].startswith("## decode under causal sliding windows") and table[-2].count("|") == 14


def test_prefill_part_on_the_cpu(cpu_kernels):
    """The prefill part's check, row, table and target in process (float32 under the interpreter): a
    chunk past the decode kernels' 128 packed rows, paged and contiguous, agrees with float64 and with
    torch's flex; the gather is an exact copy; the part runs only when asked."""
    sb = _module()
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    check = sb.check_prefill(cpu, torch.float32)
    assert set(check["rel_error"]) == {"contiguous", "paged"} and max(check["rel_error"].values()) < 1e-4
    case = sb.SMOKE_PREFILL[0]
    assert case.hq // case.hkv * case.new > 128   # flex_decode's gathered path, not the decode kernels
    row = sb.prefill_row(case, cpu, torch.float32, sb.Clock(cpu, 1, 0), sb._flex_function(True))
    assert not row.get("errors"), row
    assert {"paged_ms", "contig_ms", "gather_ms", "paged_qoff_ms", "torch_flex_ms", "paged_tflops",
            "paged_over_contig", "gather_pct_paged", "paged_vs_torch_flex", "paged_mask_builds"} <= set(row), row
    assert row["gather_diff"] == 0 and max(row[k] for k in row if k.endswith("_diff")) < 1e-4
    assert row["paged_qoff_mask_builds"] == row["contig_qoff_mask_builds"] == 0   # kept positions: mask reused
    assert row["flops"] == 4 * 2 * 4 * 16 * (72 * (160 - 72) + 72 * 73 // 2)
    row["label"] = "x"
    table = sb._prefill_table([row])
    assert table[0].startswith("## prefill") and table[-2].count("|") == 35
    assert {"paged8_ms", "paged8_over_contig", "gathered_over_paged8"} <= set(row)
    assert sb.targets([row])[-1].startswith("prefill paged within 5% of contiguous: "
                                            + ("1/1" if row["paged_over_contig"] <= 1.05 else "0/1"))
    quick, default = sb.prefill_cases(False, True), sb.prefill_cases(False)
    assert [(c.batch, c.new, c.cache) for c in quick] == [(1, 512, 8192), (1, 2048, 32768), (4, 1024, 16384),
                                                          (8, 256, 4096)]
    assert set(quick) < set(default) and all((c.hq, c.hkv, c.d, c.page) == (32, 8, 128, 64) for c in default)
    assert "prefill" in sb.PARTS and "prefill" not in sb.DEFAULT_PARTS
