"""GPU time of each launch of our fwd+bwd (the forward, the backward's preprocess, main kernel and dQ convert), on an
H100 / H200, and the memory-bound passes' rate: where a backward's time goes, beside bwd_speed.py's totals.

    python benchmarks/bwd_kernels.py --seqlens 4096 --head-dims 128 192 --variants causal document --out DIR

Shapes and options are bwd_speed.py's (B * N = 16k tokens, H 16; 192 is q/k 192 with v 128). Each launch is timed with
CUDA events around it alone, behind a GPU sleep (the host's launch outside the events), the median of --reps. The
passes' bytes are (4 DV + 10 D + 12) a query row (O and dO read, LSE and STATS, the fp32 dQ accumulator zeroed and read
back, dQ written; docs/design/hopper_backward.md, "The O(N) passes bound the masks' ratio").
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bwd_speed  # noqa: E402  (the shapes, the options, the head start)
import result_files  # noqa: E402


def row(N: int, D: int, DV: int, variant: str, reps: int, head_start_ms: float, tokens: int, heads: int) -> dict:
    """ms of each launch of one (N, D / DV, variant), and the passes' TB/s."""
    from fa3_inductor.templates.hopper import prepare_fwd_sm90
    from fa3_inductor.templates.hopper_bwd import prepare_hopper_backward

    B = max(1, tokens // N)
    torch.manual_seed(0)
    q = torch.randn(B, heads, N, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, heads, N, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, heads, N, DV, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(B, heads, N, DV, device="cuda", dtype=torch.bfloat16)
    fwd_opts, bwd_opts = bwd_speed._our_options(variant, heads, N, N)
    out = torch.empty_like(dout)
    lse, mx = (torch.empty(B, heads, N, device="cuda") for _ in range(2))
    fwd = prepare_fwd_sm90(q, k, v, out, lse, mx, sm_scale=D ** -0.5, **fwd_opts)
    fwd[0][fwd[3]](*fwd[1], **fwd[2])
    launches = prepare_hopper_backward(q, k, v, out, dout, lse, torch.empty_like(q), torch.empty_like(k),
                                       torch.empty_like(v), sm_scale=D ** -0.5, **bwd_opts)
    result = dict(N=N, D=D, Dv=DV, variant=variant, B=B, H=heads)
    for name, (kernel, args, kwargs, grid) in zip(("forward", "preprocess", "main", "convert"), [fwd, *launches]):
        result[f"{name}_ms"] = bwd_speed._time_interleaved({name: lambda: kernel[grid](*args, **kwargs)}, reps, 2,
                                                            head_start_ms)[name]
    rows = B * heads * N
    result["passes_mb"] = rows * (4 * DV + 10 * D + 12) / 1e6
    result["passes_tbps"] = result["passes_mb"] / 1e6 / ((result["preprocess_ms"] + result["convert_ms"]) / 1e3)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory: writes bwd-kernels-<device>-<date>.{json,md}")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[128, 192], help="192 is q/k 192 with v 128")
    ap.add_argument("--variants", nargs="+", default=["noop", "causal", "document"], choices=bwd_speed.VARIANTS)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--head-start-ms", type=float, default=2.0)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    args = ap.parse_args()

    rows = [row(N, D, 128 if D == 192 else D, variant, args.reps, args.head_start_ms, args.tokens, args.heads)
            for N in args.seqlens for D in args.head_dims for variant in args.variants]
    meta, now = result_files.run_meta("benchmarks/bwd_kernels.py")
    lines = [f"# Our fwd+bwd launches on {meta['device']} (bf16)", "",
             f"torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; command: `{meta['command']}`. Each "
             f"launch alone, behind a {args.head_start_ms:g} ms GPU sleep, median of {args.reps}.", "",
             "| N | D | variant | forward ms | preprocess ms | main ms | convert ms | passes MB | passes TB/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = f"{r['D']}" if r["D"] == r["Dv"] else f"{r['D']}/{r['Dv']}"
        lines.append(f"| {r['N']} | {d} | {r['variant']} | {r['forward_ms']:.3f} | {r['preprocess_ms']:.3f} | "
                     f"{r['main_ms']:.3f} | {r['convert_ms']:.3f} | {r['passes_mb']:.0f} | {r['passes_tbps']:.2f} |")
    result_files.write_result(args.out, "bwd-kernels", meta, now, rows, lines)


if __name__ == "__main__":
    main()
