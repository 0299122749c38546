"""Decode tile and split A/B on a GPU (issue 20): which launch parameters of the split-KV decode
kernels (templates/decode/configs.py) reach cuDNN SDPA's decode rate, measured on serving.py's
--quick decode rows.

Each row times, in the same interleaved rounds (serving.Clock: L2 flushed before every call, median
of --reps): cuDNN SDPA (native GQA) and our split + combine launches prepared once
(``prepare_decode``) for every variant below, each first checked against the configs.py launch
("auto") to bf16 tolerance. Variants change one thing against configs.py's choice:

  auto         configs.decode_config and choose_num_splits, as flex_decode runs them (with
               configs.tma_tiles' TMA plan where it applies)
  ptr          auto's split count with decode_config's pointer-load tiles (the plan before tma_tiles)
  n/2, n*2     BLOCK_N halved / doubled (same stages; doubling at 2 stages too: shared memory)
  st2 .. st6   2 to 6 pipeline stages (auto: 3, or 4 with few programs: configs.FEW_PROGRAMS_STAGES)
  w8           8 warps (4 is configs.py's choice below 64 packed rows)
  s/2, s*2     half / twice the split count (at least 1), auto tiles
  fill         the smallest split count whose programs fill every SM at once (resident x SMs)
  n*2 st4      BLOCK_N doubled at 4 stages (where shared memory takes it)
  m4096        the last split's merge loads 4096 partial values a step (configs.py: 8192)
  tma          whole K / V tiles by TMA copies (configs.DecodeConfig.tma; the tile holding L by
               pointer loads); "tma st3", "tma st5", "tma n*2" with those changes too

and on PAGED_ROWS (serving.py's quick paged rows and two D64 ones; pages of 64, shuffled table; "contig" is the contiguous cache's
auto launch, and each cell says paged time over it):

  auto, m4096, st4 as above (paged auto: 5 stages, configs.PAGED_PROGRAMS_PER_SM)
  st7          7 stages: where a page holds whole tiles the table entry takes one stage and the tiles
               run three ahead (104 KB at D128, as contiguous's 4 stages; 5 stages: two ahead)
  1/SM         the contiguous cache's split count (configs.PROGRAMS_PER_SM)
  1/SM st7     both
  n/2          BLOCK_N halved (D64: 64-key tiles, one page each)
  s<=16        the split count capped at 16
  n/2 st7      both (D64: 64-key tiles, one page each, three ahead: the bytes in flight of 128-key ones)
  tma, tma st7 as above, for pages holding whole tiles (D128's 64-key tiles on pages of 64)
  tma n/2      TMA with BLOCK_N halved (D64: 64-key tiles, one page each)
  paged rule   the paged split rule and its 5 stages (the plan before configs.short_paged_splits)
  tokmajor     not paged: the contiguous cache stored token-major ([B, N, HKV, D], passed as its
               [B, HKV, N, D] view), the auto launch. Pages lay a head's key rows out the same way (a
               row of D x 2 bytes, the next row HKV x D x 2 bytes on), so this separates what the
               layout costs from what the paging costs.

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

VARIANTS = ("auto", "ptr", "n/2", "n*2", "n*2 st2", "n*2 st4", "st2", "st3", "st4", "st5", "st6", "w8", "s/2",
            "s*2", "fill", "m4096", "tma", "tma st3", "tma st5", "tma n*2")
PAGED_VARIANTS = ("auto", "paged rule", "m4096", "st4", "st7", "1/SM", "1/SM st7", "s<=16", "n/2", "n/2 st7",
                  "tma", "tma st7", "tma n/2", "tokmajor")
PAGE = 64
# serving.py's quick paged rows and two D64 rows whose 128-key tiles span two pages of 64 (each key row
# looks its page up) where the n/2 variant's 64-key tiles lie in one page (one table entry a tile)
PAGED_ROWS = serving.QUICK_PAGED + [serving._d(1, 1, 128, d=64), serving._d(8, 1, 8, d=64),
                                    serving._d(64, 1, 32, d=64), serving._d(64, 1, 8), serving._d(8, 4, 8),
                                    serving._d(1, 1, 4)]


def _launches(q, k, v, lens, config, splits, table=None):
    """(run, split count) of one prepared decode call (``table``: k, v are pages)."""
    from fa3_inductor.templates.decode import prepare_decode

    out = torch.empty(q.shape[:3] + (v.shape[-1],), device=q.device, dtype=q.dtype)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    launches = prepare_decode(q, k, v, out, lse, sm_scale=q.shape[-1] ** -0.5, seq_lens=lens,
                              config=config, num_splits=splits, block_table=table)

    def run() -> torch.Tensor:
        for kernel, args, kwargs, grid in launches:
            kernel[grid](*args, **kwargs)
        return out
    return run, launches[0][3][0]


def variant_plans(c: serving.DecodeCase, capability: tuple[int, int], sms: int,
                  paged: bool = False) -> dict[str, tuple]:
    """{variant: (DecodeConfig, num_splits or None)} for one row (configs.py's choice as "auto").

    Example::

        >>> plans = variant_plans(serving._d(8, 1, 8), (9, 0), 132)
        >>> plans["n/2"][0].block_n, plans["n*2"][0].block_n, plans["st2"][0].num_stages, plans["s*2"][1]
        (32, 128, 2, 4)
        >>> variant_plans(serving._d(1, 1, 8), (9, 0), 132, paged=True)["1/SM"][1]
        16
    """
    import triton

    from fa3_inductor.templates.decode.configs import choose_num_splits, decode_config, few_programs

    rows = max(16, triton.next_power_of_2(c.hq // c.hkv * c.new))
    base = decode_config(c.d, capability, block_m=rows, paged=paged,
                         few_programs=few_programs(c.batch, c.hkv, sms, paged))
    auto = choose_num_splits(c.batch, c.hkv, c.cache, base.block_n, sms, base.resident, paged=paged)
    rep = dataclasses.replace
    contig_splits = choose_num_splits(c.batch, c.hkv, c.cache, base.block_n, sms, base.resident)
    if paged:
        return {"auto": (None, None), "paged rule": (base, auto), "m4096": (rep(base, merge_elements=4096), auto),
                "st4": (rep(base, num_stages=4), auto), "st7": (rep(base, num_stages=7), auto),
                "1/SM": (base, contig_splits), "1/SM st7": (rep(base, num_stages=7), contig_splits),
                "s<=16": (base, min(auto, 16)), "n/2": (rep(base, block_n=base.block_n // 2), auto),
                "n/2 st7": (rep(base, block_n=base.block_n // 2, num_stages=7), auto),
                "tma": (rep(base, tma=True), auto), "tma st7": (rep(base, tma=True, num_stages=7), auto),
                "tma n/2": (rep(base, tma=True, block_n=base.block_n // 2), auto)}
    programs = c.batch * c.hkv
    fill = max(1, -(-base.resident * sms // programs))
    plans = {"auto": (None, None), "ptr": (base, auto), "n/2": (rep(base, block_n=base.block_n // 2), auto),
             "n*2": (rep(base, block_n=base.block_n * 2), auto),
             "n*2 st2": (rep(base, block_n=base.block_n * 2, num_stages=2), auto),
             "st2": (rep(base, num_stages=2), auto), "st4": (rep(base, num_stages=4), auto),
             "w8": (rep(base, num_warps=8), auto), "s/2": (base, max(1, auto // 2)),
             "s*2": (base, auto * 2), "fill": (base, min(fill, c.cache // base.block_n)),
             "n*2 st4": (rep(base, block_n=base.block_n * 2, num_stages=4), auto),
             "st3": (rep(base, num_stages=3), auto), "st5": (rep(base, num_stages=5), auto),
             "st6": (rep(base, num_stages=6), auto), "m4096": (rep(base, merge_elements=4096), auto),
             "tma": (rep(base, tma=True), auto), "tma st3": (rep(base, tma=True, num_stages=3), auto),
             "tma st5": (rep(base, tma=True, num_stages=5), auto),
             "tma n*2": (rep(base, tma=True, block_n=base.block_n * 2), auto)}
    return plans


def tiles_row(c: serving.DecodeCase, device: torch.device, clock: serving.Clock, sms: int,
              paged: bool = False, variants: tuple[str, ...] = VARIANTS + PAGED_VARIANTS) -> dict:
    """cuDNN and each of ``variants`` of one row, same rounds; ms, splits and the check of each
    (``paged``: the variants read pages of PAGE keys, and the contiguous auto launch is timed beside
    them)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = torch.bfloat16
    row = serving._case_row("paged tiles" if paged else "tiles", c, dtype.itemsize)
    q, k, v, lens = serving._decode_inputs(c, device, dtype)
    fns, splits = {}, {}
    kv = (*serving._pages(k, v, PAGE),) if paged else (k, v, None)
    if paged:
        fns["contig"], splits["contig"] = _launches(q, k, v, lens, None, None)
        row["page"] = PAGE
        if "tokmajor" in variants:
            k_tm, v_tm = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
            fns["tokmajor"], splits["tokmajor"] = _launches(q, k_tm, v_tm, lens, None, None)
    for name, (config, n) in variant_plans(c, torch.cuda.get_device_capability(device), sms, paged).items():
        if name not in variants:
            continue
        try:
            fns[name], splits[name] = _launches(q, kv[0], kv[1], lens, config, n, kv[2])
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
    if paged:
        row["over_contig"] = {name: ms / timed["contig"] for name, ms in timed.items() if name != "cudnn"}
    return row


def _label(r: dict) -> str:
    return serving.DecodeCase(r["B"], r["new"], r["N"], r["HQ"], r["HKV"], r["D"]).label()


def _table(rows: list[dict], names: list[str], ratio_key: str, first: str) -> list[str]:
    lines = [f"| row | {first} | " + " | ".join(names) + " | worst diff |",
             "|---|---|" + "---|" * len(names) + "---|"]
    for r in rows:
        cells = []
        for n in names:
            if n in r["ms"]:
                ratio = r.get(ratio_key, {}).get(n)
                cells.append(f"{r['ms'][n]:.3f} ({ratio:.3f}) [{r['splits'][n]}]" if ratio
                             else f"{r['ms'][n]:.3f} [{r['splits'][n]}]")
            else:
                cells.append("-")
        anchor = r["ms"].get("cudnn" if ratio_key == "cudnn_over" else "contig", float("nan"))
        lines.append(f"| {_label(r)} | {anchor:.3f} | " + " | ".join(cells) + f" | {max(r['diff'].values()):.1e} |")
    return lines


def markdown(meta: dict, rows: list[dict]) -> str:
    contiguous = [r for r in rows if r["part"] == "tiles"]
    paged = [r for r in rows if r["part"] != "tiles"]
    names = [n for n in VARIANTS if any(n in r["ms"] for r in contiguous)]
    lines = [f"# decode tiles on {meta['device']} (bf16)", "",
             f"torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; command: `{meta['command']}`.",
             meta["timing"], "", "Variants: benchmarks/decode_tiles.py's docstring.", ""]
    if paged:
        lines += [f"## paged (pages of {PAGE}, shuffled table)", "",
                  "Each cell: ms (its time over the contiguous cache's auto launch), the split count in brackets.", ""]
        lines += _table(paged, [n for n in PAGED_VARIANTS if any(n in r["ms"] for r in paged)], "over_contig",
                        "contig ms")
        within = {n: sum(1 for r in paged if r["over_contig"].get(n, 9) <= 1.05) for n in PAGED_VARIANTS}
        lines += ["", "Rows within 5% of contiguous: " + ", ".join(f"{n} {k}/{len(paged)}" for n, k in within.items()), ""]
    if contiguous:
        lines += ["## contiguous", "",
                  "Each cell: ms (cuDNN's time over it: > 1 is faster than cuDNN), the split count in brackets.", ""]
        lines += _table(contiguous, names, "cudnn_over", "cuDNN ms")
        best = {n: sum(1 for r in contiguous if r.get("cudnn_over", {}).get(n, 0) >= 1.0) for n in names}
        lines += ["", "Rows at or above cuDNN: " + ", ".join(f"{n} {best[n]}/{len(contiguous)}" for n in names), ""]
    errors = {f"{r['part']} {_label(r)}": r["errors"] for r in rows if r.get("errors")}
    if errors:
        lines += ["Errors: " + json.dumps(errors), ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(serving.ROOT, "benchmarks", "results"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=240.0, help="no new row after this many seconds")
    ap.add_argument("--paged-only", action="store_true", help="the paged rows alone")
    ap.add_argument("--variants", default="", help="comma list: only these variants (auto always runs)")
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
    variants = tuple(["auto"] + args.variants.split(",")) if args.variants else VARIANTS + PAGED_VARIANTS
    plan = [(True, c) for c in PAGED_ROWS] + ([] if args.paged_only else [(False, c) for c in serving.QUICK_DECODE])
    for paged, c in plan:
        if rows and time.time() - serving.STARTED > args.budget_s:
            meta.setdefault("left_out", []).append(("paged " if paged else "") + c.label())
            continue
        rows.append(tiles_row(c, device, clock, sms, paged, variants))
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
