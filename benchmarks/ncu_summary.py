"""Summarise Nsight Compute reports of the sm90 kernel: the headline metrics, then where the warps stall.

    PYTHONPATH=$(ls -d /opt/nvidia/nsight-compute/*/extras/python | head -1) \\
        python benchmarks/ncu_summary.py rep1.ncu-rep [rep2.ncu-rep ...] [--top 25] [--all-metrics FILE]

For each report (one kernel launch each, e.g. `ncu --set full -o rep ...`): duration, SM clock, the tensor
and special-function (XU) pipes' activity, issue activity, and the warp-state totals; then the SASS
instructions with the most PC samples (source counters), each with its leading stall reasons. Reports
differ only in the case they profiled, so the tables compare cases line by line.
"""
from __future__ import annotations

import argparse
import collections
import re

import ncu_report  # from Nsight Compute's extras/python

HEADLINE = [
    ("gpu__time_duration.sum", "duration (ns)"),
    ("sm__cycles_elapsed.avg.per_second", "SM clock (Hz)"),
    ("sm__throughput.avg.pct_of_peak_sustained_elapsed", "SM throughput %"),
    ("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active", "tensor (gmma) pipe active %"),
    ("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active", "tensor (hmma) pipe active %"),
    ("sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active", "XU (MUFU) pipe %"),
    ("sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active", "FMA pipe %"),
    ("sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active", "ALU pipe %"),
    ("smsp__issue_active.avg.pct_of_peak_sustained_active", "issue active %"),
    ("smsp__inst_executed.sum", "instructions"),
    ("dram__throughput.avg.pct_of_peak_sustained_elapsed", "DRAM throughput %"),
    ("lts__t_sector_hit_rate.pct", "L2 hit rate %"),
]


def value(action, name):
    try:
        m = action.metric_by_name(name)
    except Exception:  # noqa: BLE001
        return None
    if m is None:
        return None
    try:
        return m.as_double()
    except Exception:  # noqa: BLE001
        return None


def stall_metrics(action):
    """{reason: metric name} of the per-PC stall-sample metrics present in the report."""
    out = {}
    for name in action.metric_names():
        mm = re.fullmatch(r"smsp__pcsamp_warps_issue_stalled_(\w+)", name)
        if mm and not mm.group(1).endswith("_not_issued"):
            out[mm.group(1)] = name
    return out


def per_pc(action, name):
    """{pc: value} of an instanced (per-PC) metric, or {}."""
    m = action.metric_by_name(name)
    if m is None or not m.has_correlation_ids():
        return {}
    ids = m.correlation_ids()
    return {ids.as_uint64(i): m.as_uint64(i) for i in range(m.num_instances())}


def summarize(path, top, all_metrics):
    ctx = ncu_report.load_report(path)
    action = ctx[0][0]
    print(f"\n=== {path}: {action.name()}")
    for name, label in HEADLINE:
        v = value(action, name)
        if v is not None:
            print(f"  {label:32s} {v:14.4g}   ({name})")
    if all_metrics:
        with open(all_metrics, "a") as f:
            f.write(f"=== {path}\n")
            for name in sorted(action.metric_names()):
                v = value(action, name)
                if v is not None:
                    f.write(f"{name} {v:.6g}\n")
    reasons = stall_metrics(action)
    samples = {r: per_pc(action, n) for r, n in reasons.items()}
    total_by_reason = {r: sum(d.values()) for r, d in samples.items()}
    grand = sum(total_by_reason.values()) or 1
    print("  stall samples by reason (% of all samples):")
    for r, n in sorted(total_by_reason.items(), key=lambda x: -x[1])[:12]:
        if n:
            print(f"    {r:28s} {100 * n / grand:6.2f}")
    by_pc = collections.Counter()
    for d in samples.values():
        by_pc.update(d)
    print(f"  top {top} instructions by samples (% of all; leading reasons):")
    for pc, n in by_pc.most_common(top):
        lead = sorted(((samples[r].get(pc, 0), r) for r in samples), reverse=True)[:3]
        why = ", ".join(f"{r} {100 * c / n:.0f}%" for c, r in lead if c)
        try:
            sass = action.sass_by_pc(pc)
        except Exception:  # noqa: BLE001
            sass = "?"
        print(f"    {pc:#07x} {100 * n / grand:5.2f}%  {sass[:70]:70s} {why}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--all-metrics", default=None, help="append every scalar metric of every report to this file")
    args = ap.parse_args()
    for p in args.reports:
        try:
            summarize(p, args.top, args.all_metrics)
        except Exception as e:  # noqa: BLE001
            print(f"\n=== {p}: could not summarise: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
