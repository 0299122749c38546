"""Summarise Nsight Compute reports of the sm90 kernels: the headline metrics, then where the warps stall.

    PYTHONPATH=$(ls -d /opt/nvidia/nsight-compute/*/extras/python | head -1) \\
        python benchmarks/ncu_summary.py rep1.ncu-rep [rep2.ncu-rep ...] [--top 25] [--all-metrics FILE] [--roles]

For each report (one kernel launch each, e.g. `ncu --set full -o rep ...`): duration, SM clock, the tensor
and special-function (XU) pipes' activity, issue activity, and the warp-state totals; then what decides a
warp-specialized kernel's next change (issue slots, eligible warps, occupancy, registers, shared-memory wavefronts
and bank conflicts, L2 reductions, stall cycles per issued instruction; "absent" where the report lacks the metric);
with --roles, the stall samples by role (the code between setmaxnreg instructions: consumer warpgroups, producer,
idle warps); then the SASS instructions with the most PC samples (source counters), each with its leading stall
reasons. Reports differ only in the case they profiled, so the tables compare cases line by line.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import re

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

# What decides the next change of a warp-specialized kernel (docs/design/hopper_backward.md, "D = 64's step against
# its bounds"): is issue the limit, do enough warps wait ready, do the P / dS / dQ shared-memory round trips conflict,
# how much of L2's traffic is dQ's reduce-adds. Printed "absent" where the report lacks the name.
DECIDING = [
    ("sm__inst_issued.avg.pct_of_peak_sustained_active", "issue slots busy %"),
    ("smsp__warps_eligible.avg.per_cycle_active", "eligible warps / scheduler"),
    ("smsp__warps_active.avg.per_cycle_active", "active warps / scheduler"),
    ("smsp__average_warp_latency_per_inst_issued.ratio", "warp cycles / issued instruction"),
    ("sm__warps_active.avg.pct_of_peak_sustained_active", "achieved occupancy %"),
    ("launch__registers_per_thread", "registers / thread (at entry)"),
    ("launch__shared_mem_per_block_dynamic", "dynamic shared memory / CTA"),
    ("launch__grid_size", "CTAs"),
    ("launch__waves_per_multiprocessor", "waves / SM"),
    ("l1tex__throughput.avg.pct_of_peak_sustained_active", "L1 / shared throughput %"),
    ("l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed", "shared (LSU) wavefronts %"),
    ("l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum", "shared load wavefronts"),
    ("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum", "shared load bank conflicts"),
    ("l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum", "shared store wavefronts"),
    ("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum", "shared store bank conflicts"),
    ("lts__t_sectors_op_red.sum", "L2 reduction sectors (dQ adds)"),
]
# stall cycles per issued instruction, one metric per reason (the Warp State section's)
PER_ISSUE_STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio")
# a setmaxnreg: each warp-specialized role's code starts with one (its register count last)
SETMAXNREG = re.compile(r"USETMAXREG\S*\s+(?:U?P\w+,\s*)?(0x[0-9a-fA-F]+|\d+)")
SASS_STEP = 16   # bytes an sm90 instruction


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


def kernel_instructions(sass_at, pcs, limit=1 << 16):
    """[(pc, sass)] in address order from the kernel's entry to the highest of ``pcs``: down from the lowest pc
    while ``sass_at(pc)`` names an instruction ("" or an exception past the entry), then up, SASS_STEP bytes an
    instruction, at most ``limit`` of them.

    Example::

        >>> code = {0x100: "S2R R2, SR_TID.X", 0x110: "NOP", 0x120: "EXIT"}
        >>> kernel_instructions(lambda pc: code.get(pc, ""), [0x120, 0x110])
        [(256, 'S2R R2, SR_TID.X'), (272, 'NOP'), (288, 'EXIT')]
    """
    def text(pc):
        try:
            return sass_at(pc) or ""
        except Exception:  # noqa: BLE001
            return ""

    lo, hi = min(pcs), max(pcs)
    while lo - SASS_STEP >= 0 and (hi - lo) // SASS_STEP < limit and text(lo - SASS_STEP):
        lo -= SASS_STEP
    return [(pc, text(pc)) for pc in range(lo, min(hi, lo + limit * SASS_STEP) + 1, SASS_STEP)]


def code_regions(instructions):
    """[(start pc, registers, role)] of a warp-specialized kernel's code, split at each setmaxnreg (USETMAXREG),
    with which each role's code starts (in address order; the code before the first is one region of registers
    None). role: "consumer" where the region issues wgmma (HGMMA), "producer" where it issues TMA loads (UTMALDG)
    and no wgmma, else "other" (the role dispatch, the idle warps of the producer's warpgroup).

    Example::

        >>> code_regions([(0x0, "S2R R2, SR_TID.X"), (0x10, "USETMAXREG.DEALLOC.CTAPOOL 0x18"),
        ...               (0x20, "UTMALDG.4D [UR8], [UR4]"), (0x30, "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0"),
        ...               (0x40, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ")])
        [(0, None, 'other'), (16, 24, 'producer'), (48, 240, 'consumer')]
    """
    regions = []
    for pc, sass in instructions:
        m = SETMAXNREG.search(sass)
        if m or not regions:
            regions.append([pc, int(m.group(1), 0) if m else None, "other"])
        if "HGMMA" in sass:
            regions[-1][2] = "consumer"
        elif "UTMALDG" in sass and regions[-1][2] == "other":
            regions[-1][2] = "producer"
    return [tuple(r) for r in regions]


def samples_by_region(regions, samples):
    """{region index: {reason: samples}} of per-PC stall samples ``samples`` ({reason: {pc: n}}) in ``regions``
    (code_regions' list).

    Example::

        >>> samples_by_region([(0, None, "other"), (0x40, 240, "consumer")], {"barrier": {0x10: 3, 0x50: 5}})
        {0: {'barrier': 3}, 1: {'barrier': 5}}
    """
    starts = [r[0] for r in regions]
    out = collections.defaultdict(collections.Counter)
    for reason, by_pc in samples.items():
        for pc, n in by_pc.items():
            i = bisect.bisect_right(starts, pc) - 1
            if i >= 0 and n:
                out[i][reason] += n
    return {i: dict(c) for i, c in sorted(out.items())}


def print_roles(action, samples, grand):
    """Print the stall samples of each role's code (code_regions) of a report's ``action``, with their leading
    reasons; ``samples`` {reason: {pc: n}}, ``grand`` all samples. Example: ``print_roles(ctx[0][0], samples, 1e5)``
    prints lines like ``consumer  +0x00280  240 regs  31.20%  barrier 55%, long_scoreboard 20%, ...``."""
    pcs = [pc for d in samples.values() for pc in d]
    if not pcs:
        return
    instructions = kernel_instructions(action.sass_by_pc, pcs)
    regions = code_regions(instructions)
    if not any(r[1] for r in regions):
        print("  roles: no setmaxnreg in the code around the samples; not split")
        return
    base = instructions[0][0]
    print(f"  stall samples by role (code from each setmaxnreg, +offset from the kernel's entry; % of all samples,"
          f" leading reasons within):")
    for i, by_reason in samples_by_region(regions, samples).items():
        start, regs, role = regions[i]
        n = sum(by_reason.values())
        lead = sorted(by_reason.items(), key=lambda x: -x[1])[:4]
        why = ", ".join(f"{r} {100 * c / n:.0f}%" for r, c in lead)
        print(f"    {role:9s} +{start - base:#07x} {str(regs or '-'):>4s} regs {100 * n / grand:6.2f}%  {why}")


def summarize(path, top, all_metrics, roles=False):
    import ncu_report  # from Nsight Compute's extras/python

    ctx = ncu_report.load_report(path)
    action = ctx[0][0]
    print(f"\n=== {path}: {action.name()}")
    for name, label in HEADLINE:
        v = value(action, name)
        if v is not None:
            print(f"  {label:32s} {v:14.4g}   ({name})")
    print("  what decides the next change:")
    for name, label in DECIDING:
        v = value(action, name)
        print(f"  {label:32s} " + (f"{v:14.4g}" if v is not None else f"{'absent':>14s}") + f"   ({name})")
    for op in ("ld", "st"):
        conflicts = value(action, f"l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_{op}.sum")
        wavefronts = value(action, f"l1tex__data_pipe_lsu_wavefronts_mem_shared_op_{op}.sum")
        if conflicts is not None and wavefronts:
            print(f"  {'shared ' + op + ' conflicts / wavefront':32s} {conflicts / wavefronts:14.4g}")
    per_issue = {mm.group(1): value(action, n) for n in action.metric_names() if (mm := PER_ISSUE_STALL.fullmatch(n))}
    per_issue = {r: v for r, v in per_issue.items() if v}
    if per_issue:
        print("  stall cycles per issued instruction (warp state; the largest):")
        for r, v in sorted(per_issue.items(), key=lambda x: -x[1])[:8]:
            print(f"    {r:28s} {v:6.2f}")
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
    if roles:
        print_roles(action, samples, grand)
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
    ap.add_argument("--roles", action="store_true",
                    help="split the stall samples by warp-specialized role (the code between setmaxnreg instructions)")
    args = ap.parse_args()
    for p in args.reports:
        try:
            summarize(p, args.top, args.all_metrics, args.roles)
        except Exception as e:  # noqa: BLE001
            print(f"\n=== {p}: could not summarise: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
