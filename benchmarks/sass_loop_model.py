#!/usr/bin/env python3
"""Cycle budget of the sm90 forward's KV loop from its SASS, on the CPU (docs/design/hopper_fp8.md, "Cycle budget").

Compiles the Hopper kernel for sm90 (templates/aot.py), takes the KV loop (the innermost loop holding GMMA and
MUFU.EX2, one consumer warpgroup's), counts its instructions by class and reads each instruction's control code from
cuobjdump's encoding (stall cycles, scoreboard barriers set and waited on). Then two models of one SM sub-partition,
which holds one warp of each consumer warpgroup:

- ``solo``: one warp alone, its GMMAs on an idle tensor core: cycles per KV tile of the warpgroup's dependency chain
  (softmax, then its GEMMs, then what follows their wait).
- ``pair``: both warps in steady state, sharing the issue port (one instruction per cycle), the MUFU unit (one warp
  instruction per 8 cycles: 16 lanes per SM), the shuffle unit and the tensor core (GMMAs in issue order, a
  64 x N x K wgmma taking 16·N·K / 1024 cycles in 8 bits, / 512 in 16), with the pingpong turn (the last TRYWAIT
  before a warp's GMMAs passes once the other warp has made its turn arrive). Cycles per KV tile of each warpgroup,
  i.e. per pair of tiles of the CTA.

Variable latencies are assumptions (LAT below: MUFU 18 after dispatch, SHFL 24, an L1-hit LDG 40, mbarrier ops 30,
BAR.SYNC 20, wgmma retirement 30 after the tensor core finishes); K / V are assumed landed (the producer keeps up).
The model is for comparing loop bodies, not for absolute times: the bf16 D=128 loop models at 2048 cycles per tile
pair (tensor-bound) where an H200 measured 2724 (ncu, hopper_mods.md: 1.73 GHz, 1.563 ms, tensor pipe 78%).

    python3 benchmarks/sass_loop_model.py     # D=128: FP8 int8 / e4m3, the table entry and its baseline; bf16
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

LAT = dict(MUFU=18, SHFL=24, LDG=40, SYNCS=30, BAR=20, I2F=12, R2UR=6)
DEFAULT_LAT, READ_LAT, GMMA_RETIRE = 20, 6, 30
MUFU_II, SHFL_II = 8, 2
GROUPS = [
    ("GMMA", r"^[HIQ]GMMA"), ("WARPGROUP arrive / wait", r"^WARPGROUP"),
    ("BAR.SYNC / mbarrier (SYNCS)", r"^(BAR|SYNCS)"),
    ("MUFU", r"^MUFU"), ("FFMA / FADD / FMUL / FMNMX / FSEL / FSETP", r"^(FFMA|FADD|FMUL|FMNMX|FSEL|FSETP)"),
    ("F2FP", r"^F2FP"), ("SHFL", r"^SHFL"), ("PRMT / LOP3 / SEL", r"^(PRMT|LOP3|SEL)\b"), ("I2F", r"^I2F"),
    ("integer (IADD3, VIADD, IMAD, ISETP, MOV, ...)", r"^(IADD3|VIADD|IMAD|ISETP|SHF|LEA|MOV|IABS|PLOP3|P2R|R2P)"),
    ("uniform (U...)", r"^U"), ("other (BRA, LDG, R2UR, ...)", r".")]


def parse(sass: str) -> list:
    """[(address, text, control)] of every instruction; control: stall, wbar / rbar (7: none), wait (barrier mask)."""
    out = []
    pat = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*/\*\s*0x([0-9a-f]{16})\s*\*/\s*\n\s*/\*\s*0x([0-9a-f]{16})")
    for m in pat.finditer(sass):
        c = int(m.group(4), 16) >> 41
        out.append((int(m.group(1), 16), m.group(2).rstrip(" ;"),
                    dict(stall=c & 0xF, wbar=(c >> 5) & 7, rbar=(c >> 8) & 7, wait=(c >> 11) & 0x3F)))
    return out


def op_of(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def kv_loop(sass: str) -> list:
    """The first innermost loop with GMMA and MUFU.EX2 (warpgroup 0's KV loop), as parse() gives it."""
    ins = parse(sass)
    back = []
    for a, t, _ in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a:
            back.append((int(m.group(1), 16), a))
    inner = [(lo, hi) for lo, hi in back if not any((x, y) != (lo, hi) and lo <= x and y <= hi for x, y in back)]
    for lo, hi in sorted(inner):
        body = [x for x in ins if lo <= x[0] <= hi]
        text = " ".join(t for _, t, _ in body)
        if "GMMA" in text and "MUFU.EX2" in text:
            return body
    raise ValueError("no KV loop (innermost loop with GMMA and MUFU.EX2) in this SASS")


def classes(body) -> collections.Counter:
    c = collections.Counter()
    for _, t, _ in body:
        op = op_of(t)
        c[next(name for name, pat in GROUPS if re.match(pat, op))] += 1
    return c


def _gmma_cycles(op: str) -> int:
    n, k = (int(x) for x in re.search(r"GMMA\.64x(\d+)x(\d+)\.", op).groups())
    return 16 * n * k // (512 if op.startswith("HGMMA") else 1024)


def model(body, warps: int = 2, iters: int = 40) -> float:
    """Steady-state cycles per loop iteration of each warp (module docstring: ``solo`` with warps=1, ``pair``)."""
    # the mbarrier retry branches out of line (taken only while a barrier is not ready) are left out
    body = [x for x in body if not (op_of(x[1]) == "BRA" and "@!P" in x[1])]
    ops = [op_of(t) for _, t, _ in body]
    gmma = [i for i, o in enumerate(ops) if re.match(r"^[HIQ]GMMA", o)]
    turn_wait = max(i for i, o in enumerate(ops[:gmma[0]]) if "TRYWAIT" in o)
    turn_arrive = min(i for i, o in enumerate(ops) if i > gmma[-1] and "ARRIVE.TRANS64" in o)
    st = [dict(pc=0, it=0, t=0, rel=[0] * 6, groups=[], open=[], turns=0, arrives=[], starts=[0]) for _ in range(warps)]
    mufu_free = shfl_free = tensor_free = cycle = 0
    while min(w["it"] for w in st) < iters:
        cands = []
        for k, w in enumerate(st):
            i = w["pc"]
            _, text, c = body[i]
            op = ops[i]
            ready = max([w["t"]] + [w["rel"][b] for b in range(6) if c["wait"] >> b & 1])
            if i == turn_wait and warps == 2:
                need = w["turns"] if k == 1 else w["turns"] - 1   # warp 0 takes the first turn
                if need >= 0:
                    if len(st[1 - k]["arrives"]) <= need:
                        continue
                    ready = max(ready, st[1 - k]["arrives"][need])
            if op.startswith("WARPGROUP.DEPBAR"):
                n = int(re.search(r"0x(\d+)", text).group(1), 16)
                if len(w["groups"]) > n:
                    ready = max(ready, sorted(w["groups"])[len(w["groups"]) - n - 1] + GMMA_RETIRE)
            if op.startswith("MUFU"):
                ready = max(ready, mufu_free - 4 * MUFU_II)   # four in the queue in front of the unit
            cands.append((max(ready, cycle), k))
        if not cands:
            cycle += 1
            continue
        issue, k = min(cands)
        w = st[k]
        i = w["pc"]
        _, text, c = body[i]
        op = ops[i]
        lat = LAT.get(op.split(".")[0], LAT.get(op[:4], DEFAULT_LAT))
        if op.startswith("MUFU"):
            start = max(issue, mufu_free)
            mufu_free = start + MUFU_II
            lat = start - issue + MUFU_II + LAT["MUFU"]
        elif op.startswith("SHFL"):
            start = max(issue, shfl_free)
            shfl_free = start + SHFL_II
            lat = start - issue + LAT["SHFL"]
        elif re.match(r"^[HIQ]GMMA", op):
            tensor_free = max(issue, tensor_free) + _gmma_cycles(op)
            w["open"].append(tensor_free)
            if "gsb0" in text:
                w["groups"].append(max(w["open"]))
                w["open"] = []
        elif op.startswith("WARPGROUP.DEPBAR"):
            n = int(re.search(r"0x(\d+)", text).group(1), 16)
            w["groups"] = sorted(w["groups"])[len(w["groups"]) - n:] if n else []
        if i == turn_wait:
            w["turns"] += 1
        if i == turn_arrive:
            w["arrives"].append(issue)
        if c["wbar"] != 7:
            w["rel"][c["wbar"]] = issue + lat
        if c["rbar"] != 7:
            w["rel"][c["rbar"]] = max(w["rel"][c["rbar"]], issue + READ_LAT)
        w["t"] = issue + max(1, c["stall"])
        cycle = issue + 1
        w["pc"] += 1
        if w["pc"] == len(body):
            w["pc"] = 0
            w["it"] += 1
            w["starts"].append(w["t"])
    h = iters // 2
    return sum((w["starts"][iters] - w["starts"][h]) / (iters - h) for w in st) / warps


def _compile(D: int, qk: str | None, cfg=None) -> str:
    """SASS of the sm90 launch of one site (B1 H2 M = N = 1024): FP8 with Q / K in `qk`, or bf16 (qk None)."""
    import torch
    from fa3_inductor import FP8Recipe
    from fa3_inductor.templates.aot import compile_launch, sass_report
    from fa3_inductor.templates.fp8_prologue.reference import quantize_reference
    from fa3_inductor.templates.hopper.fwd_sm90 import prepare_fwd_sm90_variants

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 1024, D, generator=g).to(torch.bfloat16) for _ in range(3))
    lse, mx = torch.empty(1, 2, 1024), torch.empty(1, 2, 1024)
    out = torch.empty_like(q)
    opts = dict(sm_scale=D ** -0.5, max_needed=False, config=cfg)
    if qk is not None:
        ops = quantize_reference(q, k, v, FP8Recipe(qk=qk))
        for name in ("q_scale", "k_scale", "v_scale", "v_scale_max"):
            setattr(ops, name, getattr(ops, name).float().contiguous())
        q, k, v, opts["fp8"] = ops.q, ops.k, ops.vt, ops
    (kernel, args, kwargs, _grid), _siblings = prepare_fwd_sm90_variants(q, k, v, out, lse, mx, **opts)
    r = sass_report(compile_launch(kernel, args, kwargs))
    print(f"  compiled {'bf16' if qk is None else qk}: registers {r.registers}, stack {r.stack}, "
          f"{r.spill_instructions} LDL/STL", file=sys.stderr)
    return r.sass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, default=128)
    a = ap.parse_args()
    from fa3_inductor.templates.hopper_fp8.configs import get_fp8_config

    D = a.head_dim
    table = get_fp8_config(D)
    columns = []
    for qk in ("int8", "e4m3"):
        baseline = replace(table, lean_fp8_softmax=False)
        columns.append((f"{qk}, lean_fp8_softmax off", kv_loop(_compile(D, qk, baseline))))
        columns.append((f"{qk}, table entry", kv_loop(_compile(D, qk, table))))
    columns.append(("bf16", kv_loop(_compile(D, None))))
    counts = [classes(body) for _, body in columns]
    print("| per KV tile, one warp | " + " | ".join(name for name, _ in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name, _ in GROUPS:
        print(f"| {name} | " + " | ".join(str(c[name]) for c in counts) + " |")
    print("| instructions | " + " | ".join(str(len(b)) for _, b in columns) + " |")
    stalls = [str(sum(x[2]["stall"] for x in b)) for _, b in columns]
    print("| stall cycles (control codes) | " + " | ".join(stalls) + " |")
    print("| solo chain, cycles per tile | " + " | ".join(f"{model(b, 1):.0f}" for _, b in columns) + " |")
    print("| pair, cycles per tile pair | " + " | ".join(f"{model(b, 2):.0f}" for _, b in columns) + " |")


if __name__ == "__main__":
    main()
