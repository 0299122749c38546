"""What a backward CTA costs beside its steps: the main kernel alone (noop) at a fixed key count over several query
lengths, fitted as T(M) = a + b M. With the KV tiles fixed, a is what every tile pays once (K / V loads, the pipeline's
fill and drain, the dK / dV epilogue, the CTA's start), b the steps; both are read as SM time a tile and a 64-row
step:  F = a x SMs / tiles,  s = b x 64 x SMs / tiles.

    python benchmarks/bwd_tile_cost.py --schedules default kv96_lag kv96_persistent --out DIR

Why (docs/design/hopper_backward.md, "What a 96-key CTA costs beside its steps"): a causal backward has half the steps
of a dense one over the same tiles, so a tile's fixed cost weighs twice as much there.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bwd_speed  # noqa: E402  (the shapes, the options, the timing)
import result_files  # noqa: E402


def _main_launch(q, k, v, dout, schedule: str):
    """The main kernel's (kernel, args, kwargs, grid) of our noop backward under ``schedule`` (a configs.VARIANTS
    name, or "default"), and its tile's key count."""
    from fa3_inductor.templates.hopper import prepare_fwd_sm90
    from fa3_inductor.templates.hopper_bwd import get_bwd_config, prepare_hopper_backward
    from fa3_inductor.templates.hopper_bwd.configs import VARIANTS

    B, H, M, D = q.shape
    DV = v.shape[-1]
    out = torch.empty_like(dout)
    lse, mx = (torch.empty(B, H, M, device="cuda") for _ in range(2))
    fwd = prepare_fwd_sm90(q, k, v, out, lse, mx, sm_scale=D ** -0.5)
    fwd[0][fwd[3]](*fwd[1], **fwd[2])
    if schedule == "default":   # the host's pick
        opts = {}
    elif schedule in ("wide", "wide_persistent"):   # 192 / 128's 64-key kernel, in the grid's order or persistent
        opts = {"config": get_bwd_config(D, DV, persistent=schedule == "wide_persistent")}
    else:
        opts = {"config": get_bwd_config(D, DV, plain=True, **VARIANTS[schedule])}
    pre, main, _ = prepare_hopper_backward(q, k, v, out, dout, lse, torch.empty_like(q), torch.empty_like(k),
                                           torch.empty_like(v), sm_scale=D ** -0.5, **opts)
    pre[0][pre[3]](*pre[1], **pre[2])
    return main, main[2]["TILE"].BLOCK_N


def tile_costs(seqlens: list[int], times_ms: list[float], tiles: int, sms: int) -> dict:
    """Least-squares T(M) = a + b M over the query lengths, read as SM time: the fixed cost a tile (F, µs) and the cost
    of a 64-row step (s, µs), with the worst residual (ms).

    Example::

        >>> r = tile_costs([512, 1024], [0.3, 0.5], tiles=132, sms=132)
        >>> round(r["tile_fixed_us"], 6), round(r["step_us"], 6)
        (100.0, 25.0)
    """
    n = len(seqlens)
    mean_m, mean_t = sum(seqlens) / n, sum(times_ms) / n
    b = sum((m - mean_m) * (t - mean_t) for m, t in zip(seqlens, times_ms)) / sum((m - mean_m) ** 2 for m in seqlens)
    a = mean_t - b * mean_m
    return dict(intercept_ms=a, ms_per_row=b, tile_fixed_us=a * 1e3 * sms / tiles, step_us=b * 64 * 1e3 * sms / tiles,
                worst_residual_ms=max(abs(t - a - b * m) for m, t in zip(seqlens, times_ms)))


def fit(schedule: str, D: int, DV: int, N: int, seqlens: list[int], heads: int, reps: int, sms: int) -> dict:
    """Main-kernel ms at each query length, and the fitted fixed cost a tile and cost a step (µs of one SM)."""
    torch.manual_seed(0)
    times, block_n = [], None
    for M in seqlens:
        q = torch.randn(1, heads, M, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, heads, N, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, heads, N, DV, device="cuda", dtype=torch.bfloat16)
        dout = torch.randn(1, heads, M, DV, device="cuda", dtype=torch.bfloat16)
        (kernel, args, kwargs, grid), block_n = _main_launch(q, k, v, dout, schedule)
        times.append(bwd_speed._time_interleaved({"main": lambda: kernel[grid](*args, **kwargs)}, reps, 2, 2.0)["main"])
    tiles = -(-N // block_n) * heads
    return dict(schedule=schedule, D=D, Dv=DV, N=N, heads=heads, block_n=block_n, tiles=tiles, seqlens=seqlens,
                main_ms=times, **tile_costs(seqlens, times, tiles, sms))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory: writes bwd-tile-cost-<device>-<date>.{json,md}")
    ap.add_argument("--schedules", nargs="+", default=["default"],
                    help="configs.VARIANTS names, default (the host's pick), wide or wide_persistent")
    ap.add_argument("--head-dims", type=int, nargs=2, default=[192, 128], metavar=("D", "DV"))
    ap.add_argument("--keys", type=int, default=2048, help="N, fixed")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096], help="query lengths M")
    ap.add_argument("--heads", type=int, default=128, help="batch x heads (one batch)")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    D, DV = args.head_dims
    rows = [fit(s, D, DV, args.keys, args.seqlens, args.heads, args.reps, sms) for s in args.schedules]
    meta, now = result_files.run_meta("benchmarks/bwd_tile_cost.py")
    lines = [f"# A backward tile's fixed cost on {meta['device']} (bf16, noop, main kernel alone)", "",
             f"torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; command: `{meta['command']}`. "
             f"{args.heads} heads of {args.keys} keys; each length timed alone behind a 2 ms GPU sleep, median of "
             f"{args.reps}; T(M) = a + b M fitted by least squares; F = a x {sms} SMs / tiles, s = b x 64 x {sms} "
             f"SMs / tiles.", "",
             "| schedule | keys a tile | tiles | " + " | ".join(f"M={m} ms" for m in args.seqlens) +
             " | a ms | worst residual ms | F µs a tile | s µs a step | F / s |",
             "|---|---|---|" + "---|" * len(args.seqlens) + "---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['schedule']} | {r['block_n']} | {r['tiles']} | " +
                     " | ".join(f"{t:.3f}" for t in r["main_ms"]) +
                     f" | {r['intercept_ms']:.3f} | {r['worst_residual_ms']:.3f} | {r['tile_fixed_us']:.1f} | "
                     f"{r['step_us']:.2f} | {r['tile_fixed_us'] / r['step_us']:.1f} |")
    result_files.write_result(args.out, "bwd-tile-cost", meta, now, rows, lines)


if __name__ == "__main__":
    main()
