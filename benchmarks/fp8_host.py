#!/usr/bin/env python3
"""Host cost of the FP8 path per call: ``fa3_inductor.flex(q, k, v, fp8=True)`` and the prologue alone
(``templates.fp8_prologue.host.quantize``), beside the GPU time of the same call and the kernels it launches.

Shapes (bf16, D 128): B1 H16 N16384 (Hkv 16), B1 H32/8 N4096 (GQA), B8 H32/8 N1024 (GQA). Per shape and
entry point (inference, no mask):

- ``host_b2b_us``: wall time per call of ``--calls`` calls back to back without a sync inside the loop
  (the host's cost while the GPU keeps up or the queue absorbs it), median of ``--repeats`` loops;
- ``host_drained_us``: one call timed alone after ``torch.cuda.synchronize()`` (an empty queue), median;
- ``gpu_us``: CUDA events around one call enqueued behind ``torch.cuda._sleep`` (the host issues every
  launch before the GPU reaches them: the GPU time of the call's kernels and the gaps between them only),
  median;
- ``kernels``: the device kernels one call launches (torch.profiler, after warm-up), with their GPU
  times, and ``cpu_ops``: the aten ops it dispatches (each a tiny launch or allocation on the host);
- ``host_top``: the functions with the most cumulative host time a call (cProfile), and ``uncacheable``:
  the launches runtime/fast_launch.py could not record (each of their calls takes the whole JIT launch path);
- ``memo``: for flex(), the FP8 call memo's counters (direct_fp8.stats(): remembered, hits, equal_hits;
  "absent" in a tree without it): hits near the call count mean the repeated calls replayed.

Run it on a GPU machine; ``--root`` imports ``fa3_inductor`` from another tree (this file need not exist
there), so one script times the tree before and after a change:

    git -C /path/to/repo worktree add /tmp/fp8_old <old commit>
    python benchmarks/fp8_host.py --root /tmp/fp8_old --label old --out benchmarks/results
    python benchmarks/fp8_host.py --label new --out benchmarks/results

Writes ``fp8-host-<label>-<device>-<date>.json`` and ``.md`` to ``--out`` (device, torch, triton, date,
the tree and its git commit in both).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import commit_label  # noqa: E402
SHAPES = ((1, 16, 16, 16384), (1, 32, 8, 4096), (8, 32, 8, 1024))   # (B, Hq, Hkv, N), D 128
D = 128


def _shape_name(B: int, H: int, Hkv: int, N: int) -> str:
    return f"B{B} H{H}" + (f"/{Hkv}" if Hkv != H else "") + f" N{N} D{D}"


def _host_b2b_us(fn, calls: int, repeats: int) -> float:
    import torch

    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def _host_drained_us(fn, n: int) -> float:
    import torch

    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def _gpu_us(fn, n: int) -> float:
    import torch

    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)       # ~1 ms of GPU: the call is fully enqueued before it runs
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _launched(fn) -> tuple[list, list]:
    """(kernels [(name, gpu us)], aten ops) of one call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels, cpu_ops = [], []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append((e.name[:90], round(e.device_time, 2)))
        elif e.name.startswith("aten::"):
            cpu_ops.append(e.name)
    return kernels, cpu_ops


def host_top(fn, calls: int, top: int = 12, own: int = 0) -> list:
    """The functions with the most cumulative host time over ``calls`` calls (cProfile): (name,
    µs a call), where a call's host time goes; with ``own`` > 0, a pair: that list and the ``own``
    functions with the most time spent in themselves (callees excluded)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(((cum, f"{os.path.basename(file)}:{line} {name}")
                   for (file, line, name), (_, _, _, cum, _) in stats.items()), reverse=True)
    cumulative = [(name, round(cum / calls * 1e6, 1)) for cum, name in rows[1:top + 1]]
    if not own:
        return cumulative
    selfs = sorted(((tt, f"{os.path.basename(file)}:{line} {name}")
                    for (file, line, name), (_, _, tt, _, _) in stats.items()), reverse=True)
    return cumulative, [(name, round(tt / calls * 1e6, 1)) for tt, name in selfs[:own]]


def _uncacheable_launches() -> list:
    """Tags of the launches runtime/fast_launch could not record (each of their calls takes Triton's or
    Gluon's whole launch path)."""
    from fa3_inductor.runtime import fast_launch

    return sorted({repr(e.tag) for e in fast_launch._CACHE.values() if e.kernel is None})


def _case(B: int, H: int, Hkv: int, N: int, calls: int, repeats: int) -> list[dict]:
    import torch

    import fa3_inductor
    from fa3_inductor.fp8_recipe import FP8Recipe
    from fa3_inductor.templates.fp8_prologue.host import quantize

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    recipe = FP8Recipe()
    entries = (("flex(fp8=True)", lambda: fa3_inductor.flex(q, k, v, fp8=recipe, enable_gqa=H != Hkv)),
               ("quantize()", lambda: quantize(q, k, v, recipe)))
    rows = []
    for name, fn in entries:
        row = dict(shape=_shape_name(B, H, Hkv, N), entry=name)
        try:
            with torch.inference_mode():
                for _ in range(5):   # first calls compile, plan and record their launches
                    fn()
                torch.cuda.synchronize()
                row.update(host_b2b_us=_host_b2b_us(fn, calls, repeats),
                           host_drained_us=_host_drained_us(fn, calls),
                           gpu_us=_gpu_us(fn, calls))
                row["kernels"], row["cpu_ops"] = _launched(fn)
                row["host_top"] = host_top(fn, calls)
                row["uncacheable"] = _uncacheable_launches()
                if name.startswith("flex"):
                    row["template"] = fa3_inductor.last_template()
                    memo = getattr(getattr(fa3_inductor, "direct_fp8", None), "stats", None)
                    row["memo"] = memo() if memo is not None else "absent"   # the FP8 call memo's counters
        except Exception as exc:   # keep the other cases
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        rows.append(row)
        print(f"{row['shape']:>22} {name:>15}: " + (
            f"host {row['host_b2b_us']:.1f} us back to back, {row['host_drained_us']:.1f} us drained; "
            f"GPU {row['gpu_us']:.1f} us; {len(row['kernels'])} kernels"
            + (f"; memo {row['memo']}" if "memo" in row else "") if "error" not in row
            else row["error"]), flush=True)
    return rows


def _commit(root: str) -> str:
    return commit_label(root) or "unknown"


def _markdown(result: dict) -> str:
    lines = [f"# FP8 host cost per call ({result['label']})", "",
             f"{result['device']}, torch {result['torch']}, triton {result['triton']}, {result['date']}; "
             f"tree {result['root']} at {result['commit']}; {result['calls']} calls per loop, "
             f"{result['repeats']} loops.", "",
             "| shape | entry | host µs back to back | host µs drained | GPU µs | kernels | aten ops |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['entry']} | error: {r['error'][:120]} | | | | |")
            continue
        ops: dict = {}
        for op in r["cpu_ops"]:
            ops[op] = ops.get(op, 0) + 1
        lines.append(f"| {r['shape']} | {r['entry']} | {r['host_b2b_us']:.1f} | {r['host_drained_us']:.1f} | "
                     f"{r['gpu_us']:.1f} | {len(r['kernels'])} | "
                     + ", ".join(f"{n.replace('aten::', '')}×{c}" for n, c in ops.items()) + " |")
    lines += ["", "Host time per call by function (cProfile, cumulative µs) and launches fast_launch could not "
              "record:", ""]
    for r in result["rows"]:
        if "host_top" in r:
            lines.append(f"- {r['shape']} {r['entry']}: uncacheable {r['uncacheable'] or 'none'}; "
                         + (f"memo {r['memo']}; " if "memo" in r else "")
                         + "; ".join(f"{n} {t}" for n, t in r["host_top"]))
    lines += ["", "Kernels per call (GPU µs):", ""]
    for r in result["rows"]:
        if "kernels" in r:
            lines.append(f"- {r['shape']} {r['entry']}: "
                         + "; ".join(f"{n} ({t})" for n, t in r["kernels"]))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--root", default=REPO, help="the tree to import fa3_inductor from")
    ap.add_argument("--label", default="", help="a word for the file name (old / new)")
    ap.add_argument("--calls", type=int, default=20, help="calls per back-to-back loop")
    ap.add_argument("--repeats", type=int, default=15, help="back-to-back loops (median)")
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    root = os.path.abspath(args.root)
    sys.path.insert(0, root)
    import torch
    import triton

    import fa3_inductor

    if not torch.cuda.is_available():
        raise SystemExit("fp8_host.py: needs a CUDA GPU (sm89+ for FP8; sm90 for the Hopper FP8 kernel)")
    if not os.path.abspath(fa3_inductor.__file__).startswith(root):
        raise SystemExit(f"fp8_host.py: imported fa3_inductor from {fa3_inductor.__file__}, not from --root "
                         f"{root}; run without another fa3_inductor on PYTHONPATH or installed over it")
    now = _dt.datetime.now(_dt.timezone.utc)
    device = torch.cuda.get_device_name()
    print(f"{device}, torch {torch.__version__}, triton {triton.__version__}, {now:%Y-%m-%d %H:%M} UTC, "
          f"tree {root} ({_commit(root)})", flush=True)
    rows = []
    for B, H, Hkv, N in SHAPES:
        rows += _case(B, H, Hkv, N, args.calls, args.repeats)
    result = dict(label=args.label or "run", device=device, torch=torch.__version__, triton=triton.__version__,
                  date=now.isoformat(), root=root, commit=_commit(root), calls=args.calls,
                  repeats=args.repeats, argv=sys.argv[1:], rows=rows)
    slug = device.lower().replace("nvidia ", "nvidia-").replace(" ", "-")
    stem = os.path.join(args.out, f"fp8-host-{args.label + '-' if args.label else ''}{slug}-{now:%Y-%m-%d-%H%M}")
    os.makedirs(args.out, exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(_markdown(result))
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
