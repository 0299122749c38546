"""Short rows on the sm90 kernel: where a query tile with few KV tiles loses time.

    python benchmarks/short_rows.py [--seqlen 8192] [--rounds 3] [--configs "table;persistent=off"]
                                    [--cases ...] [--json PATH]

A query tile with only a few KV tiles (a sliding window of 256 keys visits 3) spends a large share of its
time on what every tile pays once: Q and the first K / V arriving from HBM, the pipeline fill, the epilogue.
Cases (D=128, bf16, 16 heads, B*S = 16384, kernel launched as the product launches it, benchmarks/ncu_case.py):

  noop            dense, S keys                                        the reference
  noop-kv384      dense over 384 keys: 3 KV tiles a row, K / V L2-resident (a few hundred KB)
  window-blocks   a 256-key window's KV tiles as full blocks: 3 a row, K / V streamed from HBM
  window          the 256-key causal window, masked
  window1024      a 1024-key window (Gemma 3's), masked: 9 KV tiles a row
  window4096      a 4096-key window (Mistral's, Gemma 2's), masked: 33 KV tiles a row
  document        lengths uniform in [1, S/2], causal inside (as hopper_sched_masks.py)

each under every entry of --configs: "table" (the product's choice) or Sm90Config overrides, e.g.
"persistent=off num_stages=1" (as hopper_mods.py; ';' separates entries). Every variant is first checked against float64 (batch 0, head 0), then timed in --rounds interleaved rounds
(odd rounds reversed), do_bench median. TFLOP/s counts the kept (q, kv) pairs; "blocks" counts every pair of
the visited 128 x 128 tiles (what the kernel computes), "ceiling" is their ratio (the most the kept-pair
rate can be of the visited-tile rate), and "x noop" is the visited-tile rate against the dense noop of the
same run under the same config.

The first run (benchmarks/results/short-rows-nvidia-h200-2026-11-24-0204-l2-prefetch-reverted.*) measured an
L2 prefetch of the next tile's Q and first KV tiles (cp.async.bulk.prefetch from the producer warp, the
patch beside it): slower in every case, by 0.3-9% prefetching one KV tile and 4-22% prefetching three, the
dense noop included (+4.5% / +5.7%), so it was taken out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hopper_mods import config_overrides  # noqa: E402
from ncu_case import case_launch  # noqa: E402

CASES = ("noop", "noop-kv384", "window-blocks", "window", "window1024", "window4096", "document")


def build(case: str, S: int, over: dict):
    if case == "noop-kv384":
        return case_launch("noop", S, overrides=over, kv_len=384)
    if case.startswith("window") and case[6:].isdigit():
        return case_launch("window", S, overrides=over, window=int(case[6:]))
    return case_launch(case, S, overrides=over)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="table")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    name = torch.cuda.get_device_name()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}, {date}", flush=True)
    torch.manual_seed(0)
    variants = []
    for case in args.cases.split(","):
        for cfg in (c.strip() for c in args.configs.split(";")):
            over = {} if cfg == "table" else config_overrides(cfg.split())
            launch, check, flops, block_flops = build(case, args.seqlen, over)
            launch()
            torch.cuda.synchronize()
            err = check()
            ok = err <= 1e-2
            print(f"{case:14s} {cfg}: rel. error {err:.2e}{'' if ok else '  FAIL'}", flush=True)
            variants.append(dict(case=case, config=cfg, launch=launch, flops=flops, block_flops=block_flops,
                                 rel_error=err, ok=ok, ms_rounds=[]))
    timed = [v for v in variants if v["ok"]]
    for r in range(args.rounds):
        for v in (timed if r % 2 == 0 else timed[::-1]):
            v["ms_rounds"].append(triton.testing.do_bench(v["launch"], warmup=25, rep=100))
    rows = []
    for v in variants:
        ts = sorted(v["ms_rounds"])
        ms = ts[len(ts) // 2] if ts else None
        rows.append(dict(case=v["case"], config=v["config"], ms=ms, rel_error=v["rel_error"],
                         tflops=v["flops"] / ms * 1e-9 if ms else None,
                         block_tflops=v["block_flops"] / ms * 1e-9 if ms else None,
                         ceiling=v["flops"] / v["block_flops"], ms_rounds=v["ms_rounds"]))
    noop = {r["config"]: r["block_tflops"] for r in rows if r["case"] == "noop" and r["ms"]}
    for r in rows:
        r["x_noop_blocks"] = r["block_tflops"] / noop[r["config"]] if r["ms"] and r["config"] in noop else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, torch=torch.__version__, triton=triton.__version__, date=date,
                           seqlen=args.seqlen, rows=rows), f, indent=1)
    print(f"\n{name}  S{args.seqlen} D128 bf16 16 heads; TFLOP/s of kept pairs / of visited tiles; "
          "x noop = visited-tile TFLOP/s over the dense noop's, same config")
    print(f"{'case':14s} {'config':>10s} {'ms':>8s} {'TFLOP/s':>8s} {'blocks':>7s} {'ceiling':>7s} {'x noop':>7s}  rounds (ms)")
    for r in rows:
        if not r["ms"]:
            print(f"{r['case']:14s} {r['config']:>10s}  failed its check (rel. error {r['rel_error']:.2e})")
            continue
        xn = f"{r['x_noop_blocks']:7.3f}" if r["x_noop_blocks"] else "      -"
        print(f"{r['case']:14s} {r['config']:>10s} {r['ms']:8.4f} {r['tflops']:8.1f} {r['block_tflops']:7.1f} "
              f"{r['ceiling']:7.3f} {xn}  {'/'.join(f'{t:.4f}' for t in r['ms_rounds'])}")


if __name__ == "__main__":
    main()
