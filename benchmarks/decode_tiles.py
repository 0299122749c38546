"""Decode tile and split A/B on a GPU (issue 20): which launch parameters of the split-KV decode
kernels (templates/decode/configs.py) reach cuDNN SDPA's decode rate, measured on serving.py's
--quick decode rows.

Each row times, in the same interleaved rounds (serving.Clock: L2 flushed before every call, median
of --reps): cuDNN SDPA (native GQA) and our split + combine launches prepared once
(``prepare_decode``) for every variant below, each first checked against the configs.py launch
("auto") to bf16 tolerance. Variants change one thing against configs.py's choice:

  auto         configs.decode_config and choose_num_splits, as flex_decode runs them
  n/2, n*2     BLOCK_N halved / doubled (same stages; doubling at 2 stages too: shared memory)
  st2 .. st6   2 to 6 pipeline stages (auto: 3, or 4 with few programs: configs.FEW_PROGRAMS_STAGES)
  w8           8 warps (4 is configs.py's choice below 64 packed rows)
  s/2, s*2     half / twice the split count (at least 1), auto tiles
  fill         the smallest split count whose programs fill every SM at once (resident x SMs)
  n*2 st4      BLOCK_N doubled at 4 stages (where shared memory takes it)

Until 2026-11-29 the kernels were two launches (split, then combine); the runs of that date before
the merge moved into the split kernel also timed each launch alone ("split only", "combine only").

    python benchmarks/decode_tiles.py --out DIR            # ~1-2 min on an H100 / H200

Writes decode-tiles-<device>-<YYYY-MM-DD-HHMM>.{json,md} into --out and prints the table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serving  # noqa: E402  (benchmarks/serving.py: cases, inputs, the clock)

VARIANTS = ("auto", "n/2", "n*2", "n*2 st2", "n*2 st4", "st2", "st3", "st4", "st5", "st6", "w8", "s/2",
            "s*2", "fill")


def _launches(q, k, v, lens, config, splits):
    """(run, split count) of one prepared decode call."""
    from fa3_inductor.templates.decode import prepare_decode

    out = torch.empty(q.shape[:3] + (v.shape[-1],), device=q.device, dtype=q.dtype)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    launches = prepare_decode(q, k, v, out, lse, sm_scale=q.shape[-1] ** -0.5, seq_lens=lens,
                              config=config, num_splits=splits)

    def run() -> torch.Tensor:
        for kernel, args, kwargs, grid in launches:
            kernel[grid](*args, **kwargs)
        return out
    return run, launches[0][3][0]


def variant_plans(c: serving.DecodeCase, capability: tuple[int, int], sms: int) -> dict[str, tuple]:
    """{variant: (DecodeConfig, num_splits or None)} for one row (configs.py's choice as "auto").

    Example::

        >>> plans = variant_plans(serving._d(8, 1, 8), (9, 0), 132)
        >>> plans["n/2"][0].block_n, plans["n*2"][0].block_n, plans["st2"][0].num_stages, plans["s*2"][1]
        (32, 128, 2, 4)
    """
    import triton

    from fa3_inductor.templates.decode.configs import choose_num_splits, decode_config, few_programs

    rows = max(16, triton.next_power_of_2(c.hq // c.hkv * c.new))
    base = decode_config(c.d, capability, block_m=rows, few_programs=few_programs(c.batch, c.hkv, sms))
    auto = choose_num_splits(c.batch, c.hkv, c.cache, base.block_n, sms, base.resident)
    programs = c.batch * c.hkv
    fill = max(1, -(-base.resident * sms // programs))
    rep = dataclasses.replace
    plans = {"auto": (None, None), "n/2": (rep(base, block_n=base.block_n // 2), auto),
             "n*2": (rep(base, block_n=base.block_n * 2), auto),
             "n*2 st2": (rep(base, block_n=base.block_n * 2, num_stages=2), auto),
             "st2": (rep(base, num_stages=2), auto), "st4": (rep(base, num_stages=4), auto),
             "w8": (rep(base, num_warps=8), auto), "s/2": (base, max(1, auto // 2)),
             "s*2": (base, auto * 2), "fill": (base, min(fill, c.cache // base.block_n)),
             "n*2 st4": (rep(base, block_n=base.block_n * 2, num_stages=4), auto),
             "st3": (rep(base, num_stages=3), auto), "st5": (rep(base, num_stages=5), auto),
             "st6": (rep(base, num_stages=6), auto)}
    return plans


def tiles_row(c: serving.DecodeCase, device: torch.device, clock: serving.Clock, sms: int) -> dict:
    """cuDNN and every variant of one row, same rounds; ms, splits and the check of each."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = torch.bfloat16
    row = serving._case_row("tiles", c, dtype.itemsize)
    q, k, v, lens = serving._decode_inputs(c, device, dtype)
    fns, splits = {}, {}
    for name, (config, n) in variant_plans(c, torch.cuda.get_device_capability(device), sms).items():
        try:
            fns[name], splits[name] = _launches(q, k, v, lens, config, n)
        except Exception as exc:   # a variant the kernel refuses (shared memory): reported
            row.setdefault("errors", {})[name] = serving._error(exc)
    ref = fns["auto"]().clone()
    row["diff"] = {}
    for name, fn in list(fns.items()):
        try:   # the first launch compiles: a variant over the shared memory fails here
            row["diff"][name] = serving._rel(fn(), ref)
        except Exception as exc:
            row.setdefault("errors", {})[name] = serving._error(exc)
            del fns[name]
    gqa = c.hq != c.hkv

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    try:
        row["diff"]["cudnn"] = serving._rel(cudnn(), ref)
        fns["cudnn"] = cudnn
    except Exception as exc:
        row.setdefault("errors", {})["cudnn"] = serving._error(exc)
    timed = clock.times(fns)
    row["ms"] = timed
    row["splits"] = splits
    if "cudnn" in timed:
        row["cudnn_over"] = {name: timed["cudnn"] / ms for name, ms in timed.items() if name != "cudnn"}
    return row


def markdown(meta: dict, rows: list[dict]) -> str:
    names = [n for n in VARIANTS if any(n in r["ms"] for r in rows)]
    lines = [f"# decode tiles on {meta['device']} (bf16)", "",
             f"torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; command: `{meta['command']}`.",
             meta["timing"], "",
             "Each cell: ms (cuDNN's time over it: > 1 is faster than cuDNN), the split count in brackets. "
             "Variants: benchmarks/decode_tiles.py's docstring.", "",
             "| row | cuDNN ms | " + " | ".join(names) + " | worst diff |",
             "|---|---|" + "---|" * len(names) + "---|"]
    for r in rows:
        cells = []
        for n in names:
            if n in r["ms"]:
                ratio = r.get("cudnn_over", {}).get(n)
                cells.append(f"{r['ms'][n]:.3f} ({ratio:.3f}) [{r['splits'][n]}]" if ratio
                             else f"{r['ms'][n]:.3f} [{r['splits'][n]}]")
            else:
                cells.append("-")
        label = serving.DecodeCase(r["B"], r["new"], r["N"], r["HQ"], r["HKV"], r["D"]).label()
        lines.append(f"| {label} | {r['ms'].get('cudnn', float('nan')):.3f} | " + " | ".join(cells)
                     + f" | {max(r['diff'].values()):.1e} |")
    best = {n: sum(1 for r in rows if r.get("cudnn_over", {}).get(n, 0) >= 1.0) for n in names}
    lines += ["", "Rows at or above cuDNN: " + ", ".join(f"{n} {best[n]}/{len(rows)}" for n in names), ""]
    errors = {serving.DecodeCase(r["B"], r["new"], r["N"], r["HQ"], r["HKV"], r["D"]).label(): r["errors"]
              for r in rows if r.get("errors")}
    if errors:
        lines += ["Errors: " + json.dumps(errors), ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(serving.ROOT, "benchmarks", "results"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=240.0, help="no new row after this many seconds")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_tiles needs a CUDA GPU (it times launch parameters)")
    import triton

    device = torch.device("cuda")
    name = torch.cuda.get_device_name()
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = dict(device=name, torch=torch.__version__, triton=triton.__version__, date=f"{now:%Y-%m-%d %H:%M}Z",
                command="python benchmarks/decode_tiles.py " + " ".join(sys.argv[1:]),
                timing=f"CUDA events, {args.warmup} warm-up calls, median of {args.reps}; a "
                       f"{serving.FLUSH_BYTES >> 20} MB scratch write flushes L2 before every timed call.")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    clock = serving.Clock(device, args.reps, args.warmup)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"decode-tiles-{serving._slug(name)}-{now:%Y-%m-%d-%H%M}")
    rows: list[dict] = []
    torch.manual_seed(0)
    for c in serving.QUICK_DECODE:
        if rows and time.time() - serving.STARTED > args.budget_s:
            meta.setdefault("left_out", []).append(c.label())
            continue
        rows.append(tiles_row(c, device, clock, sms))
        print(c.label(), json.dumps({k: round(v, 4) for k, v in rows[-1]["ms"].items()}), flush=True)
        serving._release(device)
        with open(stem + ".json", "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)
    text = markdown(meta, rows)
    with open(stem + ".md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
