"""Throughput of the per-score instructions of an FP8 attention tile, measured on this GPU.

An FP8 forward at head dim D spends 4·D tensor-core FLOPs per score and, per score, one exp2
(MUFU.EX2), half a conversion of P to e4m3 (one F2FP packs two) and, with int8 Q·Kᵀ, one
int32 → fp32 conversion unless it is done with integer arithmetic. This script measures how
many of each the device retires per second, alone and mixed, so that the kernel's bound is
a measured figure (docs/fp8.md, "Speed: what the hardware allows"):

    bound (FLOP/s) = scores per second the non-tensor pipes sustain × 4·D

Each kernel runs a loop-carried chain of one instruction (inline PTX) over a register vector,
enough programs for every SM, and is timed with CUDA events. FFMA is timed too: at 128 per
clock per SM it gives the clock the other rates are divided by.

Example::

    python benchmarks/pipe_rates.py --out results/pipe-rates.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

_ASM = {
    "ffma": ("fma.rn.f32 $0, $1, $1, $1;", "=r,r", 1),
    "ex2": ("ex2.approx.ftz.f32 $0, $1;", "=r,r", 1),
    "i2f": ("cvt.rn.f32.s32 $0, $1;", "=r,r", 1),
    # one F2FP packs two fp32 into two e4m3 bytes; widened back so the chain stays 32-bit
    "f2fp": ("{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $1, $1; cvt.u32.u16 $0, t; }", "=r,r", 2),
    "iadd": ("add.s32 $0, $1, 1262485504;", "=r,r", 1),
}
_MIXES = {   # name: instructions per loop step, and the scores one step stands for
    "ex2": (("ex2",), 1),
    "i2f": (("i2f",), 1),
    "f2fp": (("f2fp",), 2),
    "ffma": (("ffma",), 1),
    "ex2+f2fp/2": (("ex2", "ex2", "f2fp"), 2),
    "ex2+i2f+f2fp/2": (("ex2", "ex2", "i2f", "i2f", "f2fp"), 2),
    "ex2+iadd+f2fp/2": (("ex2", "ex2", "iadd", "iadd", "f2fp"), 2),
}


def _kernel_for(ops: tuple[str, ...]):
    """A Triton kernel that applies `ops` (one step) ITERS times to a loop-carried int32 vector."""
    lines = []
    for i, op in enumerate(ops):
        src = "x" if i % 2 == 0 or len(ops) == 1 else "y"
        lines.append(f"        {src} = tl.inline_asm_elementwise({_ASM[op][0]!r}, '=r,r', [{src}], "
                     "dtype=tl.int32, is_pure=True, pack=1)")
    body = "\n".join(lines)
    code = f"""
@triton.jit
def k(out_ptr, ITERS, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = (offs + tl.program_id(0)).to(tl.int32) | 0x3f000000
    y = x ^ 0x00100000
    for _ in range(ITERS):
{body}
    tl.store(out_ptr + tl.program_id(0) * BLOCK + offs, x ^ y)
"""
    ns: dict = {"triton": triton, "tl": tl}
    path = f"<pipe_rates {'+'.join(ops)}>"
    import linecache
    linecache.cache[path] = (len(code), None, code.splitlines(True), path)
    exec(compile(code, path, "exec"), ns)
    return ns["k"]


def measure(mix: str, iters: int = 4096, block: int = 2048, waves: int = 16) -> dict:
    """Scores per second for one mix (see _MIXES), on the current CUDA device."""
    ops, scores_per_step = _MIXES[mix]
    kern = _kernel_for(ops)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = sms * waves
    out = torch.empty(grid * block, dtype=torch.int32, device="cuda")
    kern[(grid,)](out, 16, BLOCK=block, num_warps=8)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kern[(grid,)](out, iters, BLOCK=block, num_warps=8)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e-3)
    # per loop step every one of the BLOCK lanes runs each instruction of `ops` once
    instr = grid * block * iters * len(ops)
    scores = grid * block * iters * scores_per_step
    return {"mix": mix, "ops": list(ops), "seconds": best, "instructions_per_s": instr / best,
            "scores_per_s": scores / best, "sms": sms}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("pipe_rates: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = [measure(m) for m in _MIXES]
    ffma = next(r for r in rows if r["mix"] == "ffma")
    sms = ffma["sms"]
    clock = ffma["instructions_per_s"] / (128 * sms)   # FFMA: 128 per clock per SM
    flop_per_score = 4 * args.head_dim
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs, clock implied by FFMA {clock / 1e9:.3f} GHz")
    print(f"| mix | instr/clk/SM | scores/clk/SM | bound at D={args.head_dim} (TFLOP/s) |")
    print("|---|---|---|---|")
    for r in rows:
        r["instr_per_clk_sm"] = r["instructions_per_s"] / clock / sms
        r["scores_per_clk_sm"] = r["scores_per_s"] / clock / sms
        r["bound_tflops"] = r["scores_per_s"] * flop_per_score / 1e12
        print(f"| {r['mix']} | {r['instr_per_clk_sm']:.1f} | {r['scores_per_clk_sm']:.1f} | "
              f"{r['bound_tflops']:.0f} |")
    if args.out:
        meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                "triton": triton.__version__, "clock_hz_from_ffma": clock, "head_dim": args.head_dim}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
