"""Does the sm90 kernel's speed depend on how its inputs were made? The same launch on input sets that differ
only in how they were generated and where they sit in memory, with SM clock and power sampled meanwhile.

    python benchmarks/input_sensitivity.py [--shape 2x12x8192x160] [--seconds 2] [--rounds 2] [--json PATH]

Why: the same noop launch (D=160, B2 H12 S8k) read 454 TFLOP/s in benchmarks/hopper_mods.py and 534-549
in benchmarks/bench.py, each stable within its own run. The two scripts make q, k, v differently
(torch.randn on the GPU; a seeded CPU generator in float32, then bf16 on the GPU).

Input sets (all standard normal, bf16, (B, H, S, D) contiguous unless said):
  gpu-randn    torch.randn on the GPU (hopper_mods.py, clocks_under_load.py)
  cpu-randn    a CPU generator in float32, converted to bf16 on the GPU (bench.py)
  gpu-clone    gpu-randn copied into fresh allocations after a 3 MiB spacer (other addresses, same values)
  cpu-clone    cpu-randn the same way
  gpu-bshd     gpu-randn's values in (B, S, H, D) storage viewed as (B, H, S, D)
Each set is checked against float64 (batch 0, heads 0-1) first; then, for `rounds` rounds (odd rounds in
reverse order), the kernel runs back to back for `seconds` while nvidia-smi samples the SM clock and board
power every 50 ms (read only). Reported: TFLOP/s over the loop, median clock and power (first 0.5 s
dropped), TFLOP/s per GHz, and the low address bits of q / k / v.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fa3_inductor.templates.hopper import launch_fwd_sm90  # noqa: E402
from clocks_under_load import _reasons_field, run_sampled  # noqa: E402  (this folder is on sys.path)
from hopper_mods import reference  # noqa: E402


def input_sets(B: int, H: int, S: int, D: int) -> dict:
    shape = (B, H, S, D)
    torch.manual_seed(0)
    gpu = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    gen = torch.Generator(device="cpu").manual_seed(1234)
    cpu = [torch.randn(shape, generator=gen, dtype=torch.float32).to(device="cuda", dtype=torch.bfloat16)
           for _ in range(3)]
    spacer = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")   # moves the clones' addresses
    sets = {"gpu-randn": gpu, "cpu-randn": cpu,
            "gpu-clone": [t.clone() for t in gpu], "cpu-clone": [t.clone() for t in cpu],
            "gpu-bshd": [t.transpose(1, 2).contiguous().transpose(1, 2) for t in gpu]}
    del spacer   # the clones are placed; its memory may go
    return sets


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2x12x8192x160", help="BxHxSxD")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    B, H, S, D = (int(x) for x in args.shape.split("x"))
    name = torch.cuda.get_device_name()
    print(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%MZ}, B{B} H{H} S{S} D{D} bf16 noop", flush=True)
    sets = input_sets(B, H, S, D)
    flops = 4 * B * H * S * S * D
    sm_scale = D ** -0.5
    fns = {}
    for label, (q, k, v) in sets.items():
        out = torch.full_like(q, float("nan"))
        lse = torch.empty((B, H, S), device="cuda")
        mx = torch.empty((B, H, S), device="cuda")
        fn = (lambda q=q, k=k, v=v, out=out, lse=lse, mx=mx:  # noqa: E731
              launch_fwd_sm90(q, k, v, out, lse, mx, sm_scale=sm_scale, max_needed=False))
        fn()
        torch.cuda.synchronize()
        ref, _ = reference(q, k, v, sm_scale, None)
        err = ((out[0, :2].double() - ref).norm() / ref.norm()).item()
        bits = " ".join(f"{t.data_ptr() % (1 << 21):#08x}" for t in (q, k, v))
        print(f"{label:10s} rel err {err:.2e}  addresses mod 2 MiB: {bits}", flush=True)
        if err > 1e-2:
            raise SystemExit(f"{label}: wrong result (rel err {err:.2e})")
        fns[label] = fn
    field = _reasons_field()
    rows = []
    order = list(fns)
    for rnd in range(args.rounds):
        for label in (order if rnd % 2 == 0 else order[::-1]):
            t_start = time.time()
            n, dt, samples = run_sampled(fns[label], args.seconds, field)
            samples = samples[11:]   # the first 0.5 s (50 ms apart): the clock settles
            clocks = [c for c, _, _ in samples]
            watts = [w for _, w, _ in samples]
            tf = flops * n / dt * 1e-12
            mhz = statistics.median(clocks) if clocks else float("nan")
            w = statistics.median(watts) if watts else float("nan")
            rows.append(dict(round=rnd, inputs=label, tflops=tf, sm_mhz=mhz, watts=w, launches=n,
                             started=t_start))
            print(f"round {rnd} {label:10s} {tf:6.0f} TFLOP/s  {mhz:5.0f} MHz  {w:5.0f} W  "
                  f"{tf / (mhz / 1000):6.0f} TFLOP/s per GHz", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, torch=torch.__version__, triton=triton.__version__,
                           date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           shape=args.shape, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
