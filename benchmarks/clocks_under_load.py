"""SM clock and power while the sm90 forward kernel runs each mod: is a mod slower per clock, or clocked lower?

    python benchmarks/clocks_under_load.py [--seconds 4] [--shape 2x16x8192] [--json PATH]

For each variant (noop, softcap, ALiBi; launched as the product launches them), the kernel runs back to
back for `--seconds` while `nvidia-smi` samples the SM clock, power draw and active clock-event reasons
every 50 ms (read only: nothing about the GPU is changed). Reported per variant: TFLOP/s over the loop
(4·B·H·S²·D / time per launch; each variant's output is first checked against float64 on batch 0,
heads 0-1), the median SM clock and power over the samples taken inside the loop
(the first half second, while the clock settles, is dropped), and TFLOP/s per GHz. Variants run twice,
in the order given and then reversed, to show drift.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fa3_inductor import mods  # noqa: E402
from fa3_inductor.templates.hopper import launch_fwd_sm90  # noqa: E402
from hopper_mods import gen, reference  # noqa: E402  (this script's folder is on sys.path when it runs)

def _reasons_field() -> str:
    """Newer drivers call the active clock limiters 'clocks_event_reasons', older ones 'clocks_throttle_reasons'."""
    for field in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):
        probe = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                               capture_output=True, text=True)
        if probe.returncode == 0:
            return field
    return "clocks.max.sm"


def start_sampling(reasons_field: str) -> subprocess.Popen:
    """nvidia-smi printing SM MHz, watts and the active clock limiters every 50 ms until terminated."""
    query = f"timestamp,clocks.sm,power.draw,{reasons_field}"
    return subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-lms", "50"],
                            stdout=subprocess.PIPE, text=True)


def run_sampled(launch, seconds: float, field: str) -> tuple[int, float, list[tuple[float, float, str]]]:
    """Run launch() back to back for `seconds` (batches of 10, each synchronised) while nvidia-smi samples
    every 50 ms. Returns (launches, elapsed seconds, [(SM MHz, watts, active limiters)] in time order)."""
    smi = start_sampling(field)
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            launch()
        torch.cuda.synchronize()
        n += 10
    dt = time.perf_counter() - t0
    smi.terminate()
    samples = []
    for line in smi.communicate()[0].strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            samples.append((float(parts[1]), float(parts[2]), parts[3] if len(parts) > 3 else ""))
        except (IndexError, ValueError):
            continue
    return n, dt, samples


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--shape", default="2x16x8192", help="BxHxS or BxHxSxD (D 128 by default)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    B, H, S, D = ([int(x) for x in args.shape.split("x")] + [128])[:4]
    name = torch.cuda.get_device_name()
    print(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%MZ}, B{B} H{H} S{S} D{D} bf16", flush=True)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(B, H, S, device="cuda")
    mx = torch.empty(B, H, S, device="cuda")
    py_mods = {"noop": None, "softcap": mods.softcap(30.0), "alibi": mods.alibi(H)}
    variants = {n: fn and gen(fn) for n, fn in py_mods.items()}
    flops = 4 * B * H * S * S * D
    rows = []
    field = _reasons_field()
    for vname in list(variants) + list(variants)[::-1]:
        mod = variants[vname]

        def launch():
            launch_fwd_sm90(q, k, v, out, lse, mx, sm_scale=D ** -0.5, score_mod=mod, max_needed=False)

        out.fill_(float("nan"))
        for _ in range(5):
            launch()
        torch.cuda.synchronize()
        if vname not in {r["variant"] for r in rows}:   # checked against float64 before it is timed
            ref, _ = reference(q, k, v, D ** -0.5, py_mods[vname])
            err = ((out[0, :2].double() - ref).norm() / ref.norm()).item()
            assert err <= 1e-2, f"{vname}: relative error {err:.2e} against float64"
        n, dt, samples = run_sampled(launch, args.seconds, field)
        samples = samples[len(samples) // 8:]   # drop the first eighth (~0.5 s): the clock settles
        mhz = statistics.median(s[0] for s in samples) if samples else float("nan")
        watts = statistics.median(s[1] for s in samples) if samples else float("nan")
        reasons = sorted({s[2] for s in samples})
        tflops = flops * n / dt * 1e-12
        rows.append(dict(variant=vname, tflops=tflops, sm_mhz=mhz, watts=watts, samples=len(samples),
                         reasons=reasons, launches=n, seconds=dt))
        print(f"{vname:8s} {tflops:6.0f} TFLOP/s  SM {mhz:5.0f} MHz  {watts:5.0f} W  "
              f"{tflops / (mhz / 1000):6.0f} TFLOP/s per GHz  ({len(samples)} samples, reasons {reasons})",
              flush=True)
        time.sleep(1.0)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, torch=torch.__version__, triton=triton.__version__,
                           date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           shape=dict(B=B, H=H, S=S, D=D), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
