#!/usr/bin/env python3
"""A/B of the Hopper FP8 kernel's tile configs: the kernel alone (hopper_fp8, templates/hopper/fwd_sm90.py with its
Quant bundle on), launched directly on operands quantized once, against cuDNN SDPA bf16 in the same run.

Variants (VARIANTS: name -> (config, FP8Recipe.two_level)): ``old`` = the D=128 FP8 table entry with fp8_tight_mods
off (mod launches hold kernel-wide scalars across the KV loop), ``new`` = the table entry now
(templates/hopper_fp8/configs.py), both with the default recipe. The runs record what they compared: on 2026-11-28
lean_fp8_softmax off / on, on 2026-11-29 23:48 PV under the next softmax (five variants, since removed:
docs/design/hopper_fp8.md). Cases: D=128, B = 16384 / N, H = 16, N in --seqlens, mods noop / causal (mask_mod with a
128-block causal BlockMask, as the product lowers it) / softcap 30 (generated score_mod), Q and K in int8 and e4m3
(FP8Recipe.qk; V and P e4m3). Every launch is compiled first (in threads: Triton's compile runs
mostly outside the GIL), then checked once against float64 attention on the dequantized operands (batch 0, heads 0-1,
the last 256 query rows, which see every key under the causal mask; the output NaN-poisoned before), then timed:
``triton.testing.do_bench`` medians, --rounds interleaved rounds (every variant and cuDNN once per round, the order
rotated each round). TFLOP/s = 4·B·H·N²·D / t (causal: × (N + 1) / 2N, benchmarks/bench.py's rule).

    python3 benchmarks/fp8_kernel_ab.py --out benchmarks/results            # on an H100 / H200, ~2-3 minutes
    python3 benchmarks/fp8_kernel_ab.py --dry-run                           # CPU: builds the cases and launches

Writes <out>/fp8-kernel-ab-<device>-<date>.json (rows: case, variant, per-round ms, median ms, TFLOP/s, relative
error against float64) and .md (one table row per case: cuDNN, each variant, new ÷ old, new ÷ cuDNN).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as _dt
import os
import sys
import time
from dataclasses import asdict, replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fa3_inductor import FP8Recipe, mods  # noqa: E402
from fa3_inductor.templates.hopper.fwd_sm90 import prepare_fwd_sm90_variants  # noqa: E402
from fa3_inductor.templates.hopper_fp8.configs import get_fp8_config  # noqa: E402
from fp8_accuracy import device_slug, write_result  # noqa: E402
from hopper_ablation import causal_block_mask  # noqa: E402
from provenance import commit_label  # noqa: E402

D, H, TOKENS = 128, 16, 16384
TOLERANCE = 1e-1    # tests/reference.py FP8_TOLERANCE: a wrong scale or tile, not FP8 rounding
VARIANTS = {
    "old": (replace(get_fp8_config(D), fp8_tight_mods=False), FP8Recipe().two_level),
    "new": (get_fp8_config(D), FP8Recipe().two_level),
}
CHECK_HEADS, CHECK_ROWS = 2, 256


def generated(fn, kind: str):
    """A mod as the product lowers it (modgen, gl dialect) and its captured buffers (tests/test_hopper_fp8.py)."""
    from fa3_inductor.templates.modgen import BufferSpec, generate_mod_source, load_mod, trace_mod

    gm, bufs = trace_mod(fn, kind)
    return load_mod(generate_mod_source(gm, kind, [BufferSpec.of(b) for b in bufs], "gl"), "gl"), tuple(bufs)


def mod_options(mod: str, N: int, device) -> dict:
    """prepare_fwd_sm90_variants keywords of a mod (max_needed off, as flex() without return_max)."""
    if mod == "causal":
        mask, bufs = generated(mods.causal, "mask")
        nb, idx, fnb, fidx = causal_block_mask(N, device=device)
        return dict(mask_mod=mask, mask_bufs=bufs, kv_num_blocks=nb, kv_indices=idx, full_kv_num_blocks=fnb,
                    full_kv_indices=fidx, sparse_q_block=128, sparse_kv_block=128)
    if mod == "softcap":
        score, bufs = generated(mods.softcap(30.0), "score")
        return dict(score_mod=score, score_bufs=bufs)
    return {}


def flops(B: int, N: int, mod: str) -> float:
    return 4.0 * B * H * N * N * D * ((N + 1) / (2 * N) if mod == "causal" else 1.0)


def reference_rows(ops, mod: str) -> torch.Tensor:
    """float64 attention on the dequantized operands: batch 0, heads [0, CHECK_HEADS), the last CHECK_ROWS rows."""
    from fa3_inductor.templates.fp8_prologue.reference import dequantize

    dq, dk, dv = (t[0, :CHECK_HEADS].double() for t in dequantize(ops))
    M, N = dq.shape[1], dk.shape[1]
    rows = torch.arange(M - CHECK_ROWS, M, device=dq.device)
    s = dq[:, rows] @ dk.transpose(-1, -2) * D ** -0.5
    if mod == "softcap":
        s = mods.softcap(30.0)(s, 0, 0, 0, 0)
    if mod == "causal":
        s = s.masked_fill(torch.arange(N, device=s.device)[None, :] > rows[:, None], float("-inf"))
    return torch.softmax(s, -1) @ dv


def build_cases(seqlens, mod_names, formats, device, quantize, tokens=TOKENS):
    """Every (N, mod, qk) case: its operands and one prepared launch per variant (kernel, args, kwargs, grid)."""
    cases = []
    for N in seqlens:
        B = max(tokens // N, 1)
        g = torch.Generator(device="cpu").manual_seed(N)
        q, k, v = (torch.randn(B, H, N, D, generator=g).to(device=device, dtype=torch.bfloat16) for _ in range(3))
        for qk in formats:
            ops = quantize(q, k, v, FP8Recipe(qk=qk))
            for mod in mod_names:
                opts = mod_options(mod, N, device)
                case = dict(N=N, B=B, mod=mod, qk=qk, q=q, k=k, v=v, ops=ops, launches={})
                for name, (cfg, two_level) in VARIANTS.items():
                    out = torch.empty(B, H, N, D, device=device, dtype=torch.bfloat16)
                    lse, mx = (torch.empty(B, H, N, device=device) for _ in range(2))
                    ops_v = replace(ops, recipe=replace(ops.recipe, two_level=two_level))
                    launch, _siblings = prepare_fwd_sm90_variants(ops_v.q, ops_v.k, ops_v.vt, out, lse, mx,
                                                                  sm_scale=D ** -0.5, fp8=ops_v, config=cfg,
                                                                  max_needed=False, **opts)
                    case["launches"][name] = (launch, out)
                cases.append(case)
    return cases


def compile_all(cases) -> float:
    """Compile every launch (Triton's JIT warmup) in threads; returns seconds."""
    t0 = time.time()

    def warm(launch):
        kernel, args, kwargs, grid = launch
        try:
            kernel.warmup(*args, grid=grid, **kwargs)
        except Exception as exc:   # the check's first launch compiles it instead
            print(f"warmup failed ({type(exc).__name__}: {exc}); compiling at the first launch", flush=True)

    with cf.ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(warm, [lo for c in cases for lo, _ in c["launches"].values()]))
    return time.time() - t0


def check(case, name) -> float:
    (kernel, args, kwargs, grid), out = case["launches"][name]
    out.fill_(float("nan"))
    kernel[grid](*args, **kwargs)
    torch.cuda.synchronize()
    if "ref" not in case:
        case["ref"] = reference_rows(case["ops"], case["mod"])
    got = out[0, :CHECK_HEADS, -CHECK_ROWS:].double()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - case["ref"]).norm() / case["ref"].norm()).item()


def report(out_dir: str, cases, timings: dict, meta: dict) -> None:
    """Rows (case, variant, per-round ms, median, TFLOP/s, relative error) into <out_dir>/fp8-kernel-ab-*.json, the
    table into .md. `timings`: (N, mod, qk or "bf16", variant or "cudnn bf16") -> ms per round; `meta`: device,
    versions, rounds, seconds."""
    errs = {(c["N"], c["mod"], c["qk"], n): e for c in cases for n, e in c["err"].items()}
    batch = {c["N"]: c["B"] for c in cases}
    rows = []
    for (N, mod, qk, name), ms in sorted(timings.items()):
        med = sorted(ms)[len(ms) // 2]
        rows.append(dict(N=N, B=batch[N], H=H, D=D, mod=mod, qk=qk, variant=name, rounds_ms=ms, ms=med,
                         tflops=flops(batch[N], N, mod) / (med * 1e-3) / 1e12,
                         rel_error=errs.get((N, mod, qk, name))))
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d-%H%M")
    commit = commit_label()
    meta = dict(meta, commit=commit, date=stamp,
                variants={n: dict(asdict(cfg), two_level=k) for n, (cfg, k) in VARIANTS.items()},
                check=dict(heads=CHECK_HEADS, last_rows=CHECK_ROWS, tolerance=TOLERANCE))
    tf = {(r["N"], r["mod"], r["qk"], r["variant"]): r["tflops"] for r in rows}
    lines = [f"# FP8 kernel A/B, {meta['device']}, {stamp} (commit {commit}, {meta['rounds']} interleaved rounds, "
             "do_bench medians, TFLOP/s)", "",
             "| N | mod | Q/K | cuDNN bf16 | " + " | ".join(VARIANTS)
             + " | new ÷ old | new ÷ cuDNN | rel. error new |",
             "|---|---|---|---|" + "---|" * len(VARIANTS) + "---|---|---|"]
    for c in cases:
        key = (c["N"], c["mod"], c["qk"])
        cudnn = tf.get((c["N"], c["mod"], "bf16", "cudnn bf16"))
        new, old = tf[key + ("new",)], tf[key + ("old",)]
        lines.append(f"| {c['N']} | {c['mod']} | {c['qk']} | {f'{cudnn:.0f}' if cudnn else ''} | "
                     + " | ".join(f"{tf[key + (n,)]:.0f}" for n in VARIANTS)
                     + f" | {new / old:.3f} | {f'{new / cudnn:.2f}' if cudnn else ''} | {c['err']['new']:.2e} |")
    print("\n".join(lines))
    write_result(out_dir, f"fp8-kernel-ab-{device_slug(meta['device'])}-{stamp}", dict(meta=meta, rows=rows),
                 "\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="directory for the .json and .md (required unless --dry-run)")
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--mods", default="noop,causal,softcap")
    ap.add_argument("--qk", default="int8,e4m3", help="Q / K formats (FP8Recipe.qk)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU only: quantize with the reference prologue at N=256 and prepare every launch")
    a = ap.parse_args()
    seqlens = [int(x) for x in a.seqlens.split(",")]
    mod_names, formats = a.mods.split(","), a.qk.split(",")
    for name, (cfg, two_level) in VARIANTS.items():
        print(f"{name}: {cfg}, two_level={two_level}")

    if a.dry_run:
        from fa3_inductor.templates.fp8_prologue.reference import quantize_reference

        def quantize_cpu(q, k, v, recipe):
            ops = quantize_reference(q, k, v, recipe)
            for field in ("q_scale", "k_scale", "v_scale", "v_scale_max"):
                setattr(ops, field, getattr(ops, field).float().contiguous())
            return ops

        # N = 256, B = 1: the launches as the benchmark builds them, at a size the CPU reference prologue takes
        cases = build_cases([256], mod_names, formats, "cpu", quantize_cpu, tokens=256)
        for c in cases:
            ref = reference_rows(c["ops"], c["mod"])
            for name, ((kernel, args, kwargs, grid), _out) in c["launches"].items():
                print(f"N{c['N']} {c['mod']:8s} {c['qk']:5s} {name}: grid {grid} {kwargs['QUANT']} "
                      f"{kwargs['SCHED']} EVEN_N={kwargs['FLAGS'].EVEN_N} ref {tuple(ref.shape)}")
        # the report on made-up times (1 ms each), written to a temporary directory: its code runs before a GPU does
        import tempfile
        timings = {}
        for c in cases:
            c["err"] = {name: 0.0 for name in c["launches"]}
            for name in list(c["launches"]) + ["cudnn bf16"]:
                timings[(c["N"], c["mod"], "bf16" if name == "cudnn bf16" else c["qk"], name)] = [1.0] * a.rounds
        with tempfile.TemporaryDirectory() as tmp:
            report(tmp, cases, timings, dict(device="dry run", torch=torch.__version__, rounds=a.rounds))
        print(f"dry run: {len(cases)} cases x {len(VARIANTS)} variants prepared; on a GPU the run compiles "
              f"{len(cases) * len(VARIANTS)} launches")
        return
    if not a.out:
        ap.error("--out is required (or --dry-run)")

    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from fa3_inductor.templates.fp8_prologue.host import quantize

    dev = torch.device("cuda")
    t_start = time.time()
    cases = build_cases(seqlens, mod_names, formats, dev, quantize)
    compile_s = compile_all(cases)
    print(f"compiled {sum(len(c['launches']) for c in cases)} launches in {compile_s:.0f} s", flush=True)

    for c in cases:
        label = f"N{c['N']} {c['mod']} {c['qk']}"
        c["err"] = {name: check(c, name) for name in c["launches"]}
        print(f"{label}: relative error vs float64 " +
              ", ".join(f"{n} {e:.2e}" for n, e in c["err"].items()), flush=True)
        bad = {n: e for n, e in c["err"].items() if not e < TOLERANCE}
        if bad:
            raise SystemExit(f"{label}: {bad} over the tolerance {TOLERANCE}: not timing a wrong kernel")
        c.pop("ref", None)

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    timings = {}   # (N, mod, qk, variant) -> [ms per round]
    for r in range(a.rounds):
        for c in cases:
            fns = {name: (lambda lo=lo: lo[0][lo[3]](*lo[1], **lo[2])) for name, (lo, _) in c["launches"].items()}
            if c["mod"] != "softcap" and c["qk"] == formats[0]:
                q, k, v, causal = c["q"], c["k"], c["v"], c["mod"] == "causal"

                def sdpa(q=q, k=k, v=v, causal=causal):
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                fns["cudnn bf16"] = sdpa
            names = list(fns)
            names = names[r % len(names):] + names[:r % len(names)]   # rotate the order each round
            for name in names:
                key = (c["N"], c["mod"], c["qk"] if name != "cudnn bf16" else "bf16", name)
                timings.setdefault(key, []).append(bench(fns[name]))
        print(f"round {r + 1}/{a.rounds} done ({time.time() - t_start:.0f} s)", flush=True)

    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                rounds=a.rounds, compile_s=compile_s, total_s=time.time() - t_start)
    report(a.out, cases, timings, meta)

if __name__ == "__main__":
    main()
