#!/usr/bin/env python3
"""FP8 prologue bandwidth: bytes moved per second by the prologue alone, against a device copy of
the same byte count (templates/fp8_prologue/; target: >= 70% of copy, docs/design/fp8_prologue.md).

Shapes: B = 16384 / N, Hq 16, Hkv 16 and 4 (GQA), D 64 and 128, N 4096 and 16384, bf16; recipes:
plain (Hadamard), + RoPE (transformers' "half" style, bf16 tables as transformers builds them),
+ RoPE "interleaved" (Meta's pairs), + RoPE "half" with float32 tables (rope-f32:
RopeSpec.from_theta's; host.tuned_launch takes another launch for them at D128), + smooth_k (K's
mean over a 256-token sample), RoPE + smooth_k. Bytes moved = what the method must move: Q, K, V read once (bf16), Q8, K8, Vᵀ8
and the scales written once; RoPE tables and smooth_k's second read of K are not counted (they are
the cost of the method, not of the bytes; smooth_k's pre-pass reads 256 rows per head). The copy is ``dst.copy_(src)`` of half that many bytes
(read + write = the same total). Times are ``triton.testing.do_bench`` medians (CUDA events, L2
flushed between calls) of the prologue's launches prepared once (``prepare_prologue``) and replayed
as one CUDA graph: no host work is timed. (Launched from Python, smooth_k's three launches took
longer to issue than to run, so its rows measured the host: 0.104 and 0.175 ms in two runs of one
tree, fp8-prologue-bw-nvidia-h200-2026-11-29-1313.)

Options:
- ``--sweep``: also times the candidate launch parameters (``host.PrologueTuning``: warps, pipeline
  stages, persistent or one program per group, register cap) on the Hkv 16 shapes of the last
  ``--seqlens`` entry (plain, RoPE "half" and rope-f32: the main launch is the same kernel with
  smoothing or interleaved pairs; rope-il for the Gluon kernel only), checks each gives the bytes
  of the first candidate (the Triton kernel's table launch), and prints the best per shape
  (``host.tuned_launch``'s table takes the winners). Candidates with ``kernel="gluon"`` time
  gluon_sm90.py's kernel where it serves the shape (the hot case on sm90) and are skipped elsewhere;
  ``same_bytes`` is then its bit-identity with the Triton kernel at full size;
- ``--against PATH``: times the prologue of another tree (``fa3_inductor`` imported from PATH in a
  subprocess running this file) on the same shapes: old vs new in one run. Make the old tree with
  ``git worktree add /tmp/fp8_old HEAD`` (or any commit).

    python benchmarks/fp8_prologue_bw.py --out benchmarks/results [--sweep] [--against /tmp/fp8_old]

Writes ``fp8-prologue-bw-<device>-<date>.json`` and ``.md`` to ``--out`` (device, torch, triton,
date in both).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS, HQ = 16384, 16
RECIPES = ("plain", "rope", "rope-il", "rope-f32", "smooth", "rope+smooth")
SWEPT = ("plain", "rope", "rope-il", "rope-f32", "smooth", "rope+smooth")
# Recipes the sweep times with the Gluon candidates and the Triton table launch only (the Triton
# kernel's other candidates run the same code as for "rope" there; smooth_k on the Gluon kernel
# since 2026-11-29: its rows are the A/B of Gluon against the Triton table launch, bytes included).
GLUON_ONLY = ("rope-il", "smooth", "rope+smooth")


def _import_tree(root: str):
    """fa3_inductor from ``root`` (this repository by default), checked."""
    if root not in sys.path:
        sys.path.insert(0, root)
    import fa3_inductor

    where = os.path.realpath(os.path.dirname(fa3_inductor.__file__))
    if not where.startswith(os.path.realpath(root) + os.sep):
        raise RuntimeError(f"fa3_inductor imported from {where}, not from {root}")
    return fa3_inductor


def _cases(head_dims: list[int], seqlens: list[int], hkvs: list[int]) -> list[dict]:
    return [dict(D=D, N=N, B=TOKENS // N, Hq=HQ, Hkv=hkv, recipe=r)
            for D in head_dims for N in seqlens for hkv in hkvs for r in RECIPES]


def _key(c: dict) -> str:
    return f"D{c['D']} N{c['N']} B{c['B']} Hq{c['Hq']} Hkv{c['Hkv']} {c['recipe']}"


def _bytes_moved(c: dict, block: int = 128) -> int:
    B, Hq, Hkv, N, D = c["B"], c["Hq"], c["Hkv"], c["N"], c["D"]
    n_pad = -(-N // 16) * 16
    read = 2 * (B * Hq * N * D + 2 * B * Hkv * N * D)
    written = B * Hq * N * D + B * Hkv * N * D + B * Hkv * D * n_pad
    scales = 4 * (B * Hq * -(-N // block) + 2 * B * Hkv * -(-N // block) + B * Hkv)
    return read + written + scales


def _inputs(c: dict):
    import torch

    from fa3_inductor.fp8_recipe import FP8Recipe, RopeSpec

    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda h: torch.randn(c["B"], h, c["N"], c["D"], device="cuda", dtype=torch.bfloat16,  # noqa: E731
                               generator=g)
    q, k, v = mk(c["Hq"]), mk(c["Hkv"]), mk(c["Hkv"])
    recipe = FP8Recipe(smooth_k="smooth" in c["recipe"])
    rope = None
    if "rope" in c["recipe"]:
        style = "interleaved" if c["recipe"] == "rope-il" else "half"
        rope = RopeSpec.from_theta(c["D"], c["N"], device="cuda", style=style)
        if c["recipe"] != "rope-f32":
            rope = RopeSpec(rope.cos.to(torch.bfloat16), rope.sin.to(torch.bfloat16), rope.style)
    return q, k, v, recipe, rope


def _launcher(prepared):
    """A callable running the prepared launches (the prologue alone, no host preparation)."""
    launches = [(kernel[grid], args, kwargs) for kernel, args, kwargs, grid in prepared.launches]

    def run():
        for fn, args, kwargs in launches:
            fn(*args, **kwargs)
    return run


def _time(fn, graph: bool = False) -> float:
    """Median ms of ``fn``; ``graph``: of one CUDA graph replaying what ``fn`` launches (its issue cost left out)."""
    import torch
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        recorded = torch.cuda.CUDAGraph()
        with torch.cuda.graph(recorded, stream=stream):
            fn()
        torch.cuda.synchronize()
        fn = recorded.replay
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _prologue_ms(c: dict, tuning=None) -> tuple[float, object]:
    """Median ms of the prologue's launches on case ``c`` (``tuning``: host.PrologueTuning, where
    the tree has it), and the operands it wrote."""
    from fa3_inductor.templates.fp8_prologue import host

    q, k, v, recipe, rope = _inputs(c)
    if hasattr(host, "prepare_prologue"):
        kw = {} if tuning is None else dict(tuning=tuning)
        prepared = host.prepare_prologue(q, k, v, recipe, rope, **kw)
        run = _launcher(prepared)
        ms = _time(run, graph=True)
        return ms, host.finish(prepared.operands)
    ops = host.quantize(q, k, v, recipe, rope)     # a tree without prepare_prologue: host work timed
    return _time(lambda: host.quantize(q, k, v, recipe, rope)), ops


def _served_by(c: dict, tuning) -> str:
    """Which kernel host.prepare_prologue launches for case ``c`` under ``tuning``."""
    from fa3_inductor.templates.fp8_prologue import host

    q, k, v, recipe, rope = _inputs(c)
    return host.kernel_for(q, k, v, recipe, rope, tuning)


def copy_ms(nbytes: int) -> float:
    """Median ms of a device copy moving ``nbytes`` (read + write)."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return _time(lambda: dst.copy_(src))


def _same_operands(a, b) -> bool:
    import torch

    for name in ("q", "k", "vt"):
        if not torch.equal(getattr(a, name).view(torch.uint8), getattr(b, name).view(torch.uint8)):
            return False
    if (a.k_mean is None) != (b.k_mean is None) or (
            a.k_mean is not None and not torch.equal(a.k_mean, b.k_mean)):
        return False
    return all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("q_scale", "k_scale", "v_scale"))


def sweep_candidates() -> list:
    """The launch parameters --sweep times (host.PrologueTuning)."""
    from fa3_inductor.templates.fp8_prologue.host import PrologueTuning

    # First: the Triton kernel's table launch, the bytes every other candidate must reproduce.
    out = [PrologueTuning(kernel="triton")]
    out += [PrologueTuning(num_warps=w, num_stages=s) for w in (4, 8) for s in (1, 2, 3)]
    out += [PrologueTuning(num_warps=4, num_stages=2, programs_per_sm=0),
            PrologueTuning(num_warps=8, num_stages=1, maxnreg=128),
            PrologueTuning(num_warps=4, num_stages=2, maxnreg=168)]   # D64 RoPE: 3 programs an SM
    # D128 RoPE (sm90 SASS, docs/design/fp8_prologue.md, 2026-11-29): host.rope_select puts RoPE's
    # select in w8 s1 maxnreg=128 (spills 48 -> 4 "half", +6% instructions) and in w4 s1 (108 -> 0,
    # 255 registers, two programs an SM); these time them without it, as the earlier sweeps ran.
    # w8 s2 maxnreg=128 prefetches without spills (the select) but holds one program an SM (160 KB
    # of shared memory), as w8 s2 does (186 registers, fewer instructions).
    out += [PrologueTuning(num_warps=8, num_stages=1, maxnreg=128, rope_select=False),
            PrologueTuning(num_warps=4, num_stages=1, rope_select=False),
            PrologueTuning(num_warps=8, num_stages=2, maxnreg=128)]
    # The Gluon kernel (gluon_sm90.py; the hot case on sm90, else the Triton kernel: such rows are
    # skipped): ring depths around gluon_sm90.default_stages (D128 2 with RoPE, 4
    # without; D64 7, or 4 at two programs an SM (the default without RoPE); D128 with RoPE fits 3
    # at most: deeper rings fail to compile, an error row); one and two programs an SM at D64
    # without RoPE (docs/design/fp8_prologue.md, "Where the time goes").
    # Triton candidates name their kernel: D128's default is the Gluon kernel (host.default_kernel).
    out = [dataclasses.replace(t, kernel="triton") for t in out]
    out += [PrologueTuning(kernel="gluon")]
    out += [PrologueTuning(kernel="gluon", gluon_stages=s) for s in (2, 3, 4, 5, 8)]
    out += [PrologueTuning(kernel="gluon", programs_per_sm=1),
            PrologueTuning(kernel="gluon", programs_per_sm=2, gluon_stages=3),
            PrologueTuning(kernel="gluon", programs_per_sm=2, gluon_stages=5)]
    # D128 RoPE: the ring slot released inside the RoPE (two more barriers, under the running
    # wgmma; the default until 2026-11-29's sweep) against after the amax barrier (one barrier on
    # the wgmma-to-wgmma chain; the default since): docs/design/fp8_prologue.md, "Fewer barriers a
    # tile". RoPE "half": Q / K read as bf16 values (words=off) against int32 pair words (the
    # default since 2026-11-29: 32 instructions fewer a warp a tile, "RoPE against plain"); RoPE
    # "interleaved" (rope-il): its tables gathered 2 bytes at a time (words=off, 64 loads a thread
    # a unit) against read as pair words and held as fp32 (the default since branch rope-il: 8
    # 16-byte loads, "Interleaved RoPE's tables as words"). The
    # last row is the kernel as measured at fp8-prologue-bw-nvidia-h200-2026-11-29-1022 (3 stages,
    # release in the RoPE, bf16 reads). The same kernel without RoPE.
    out += [PrologueTuning(kernel="gluon", gluon_rope_release=True),
            PrologueTuning(kernel="gluon", gluon_stages=3, gluon_rope_release=True),
            PrologueTuning(kernel="gluon", gluon_rope_words=False),
            PrologueTuning(kernel="gluon", gluon_stages=3, gluon_rope_release=True,
                           gluon_rope_words=False)]
    # smooth_k: the pre-passes and the Gluon kernel in stream order (pdl=off) against chained by
    # programmatic dependent launch (the default: the Q tiles run under the pre-passes)
    out += [PrologueTuning(kernel="gluon", gluon_pdl=False)]
    return out


def _tuning_text(t) -> str:
    if getattr(t, "kernel", None) == "gluon":
        release = getattr(t, "gluon_rope_release", None)
        words = getattr(t, "gluon_rope_words", None)
        pdl = getattr(t, "gluon_pdl", None)
        return (f"gluon stages={t.gluon_stages or 'default'}"
                + (f" per_sm={t.programs_per_sm}" if t.programs_per_sm else "")
                + ("" if release is None else f" rope_release={'rope' if release else 'amax'}")
                + ("" if words is None else f" words={'on' if words else 'off'}")
                + ("" if pdl is None else f" pdl={'on' if pdl else 'off'}"))
    if getattr(t, "kernel", None) == "triton" and t == type(t)(kernel="triton"):
        return "triton table launch"
    per_sm = {None: "fit", 0: "grid"}.get(t.programs_per_sm, str(t.programs_per_sm))
    select = getattr(t, "rope_select", None)
    return (f"w{t.num_warps} s{t.num_stages} per_sm={per_sm}"
            + (f" maxnreg={t.maxnreg}" if t.maxnreg else "")
            + ("" if select is None else f" select={'on' if select else 'off'}"))


def run_worker(root: str, cases: list[dict], out_json: str) -> None:
    """--worker: time the prologue of the tree at ``root`` on ``cases``; rows to ``out_json``."""
    _import_tree(root)
    rows = []
    for c in cases:
        try:
            ms, _ = _prologue_ms(c)
            rows.append(dict(c, key=_key(c), ms=ms))
        except Exception as exc:   # keep the other shapes
            rows.append(dict(c, key=_key(c), error=f"{type(exc).__name__}: {exc}"[:500]))
        print(f"[{root}] {_key(c)}: {rows[-1].get('ms', rows[-1].get('error'))}", flush=True)
    with open(out_json, "w") as f:
        json.dump(rows, f)


def _against(root: str, cases: list[dict]) -> dict:
    """Rows of the tree at ``root`` by key, timed in a subprocess (its own imports and caches)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rows.json")
        env = dict(os.environ)
        env.pop("TRITON_INTERPRET", None)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--root",
                        os.path.abspath(root), "--cases-json", json.dumps(cases), "--worker-out",
                        path], check=True, env=env, cwd=os.path.abspath(root))
        with open(path) as f:
            return {r["key"]: r for r in json.load(f)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--hkv", default="16,4")
    ap.add_argument("--sweep", action="store_true", help="time the candidate launch parameters")
    ap.add_argument("--against", metavar="PATH", help="another tree to time on the same shapes")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", default=REPO, help=argparse.SUPPRESS)
    ap.add_argument("--cases-json", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    if args.worker:
        run_worker(args.root, json.loads(args.cases_json), args.worker_out)
        return

    _import_tree(REPO)
    import torch
    import triton

    ints = lambda s: [int(x) for x in s.split(",")]   # noqa: E731
    cases = _cases(ints(args.head_dims), ints(args.seqlens), ints(args.hkv))
    now = _dt.datetime.now(_dt.timezone.utc)
    device = torch.cuda.get_device_name()
    head = (f"{device}, torch {torch.__version__}, triton {triton.__version__}, "
            f"{now:%Y-%m-%d %H:%M} UTC")
    print(head, flush=True)
    old = _against(args.against, cases) if args.against else {}

    rows = []
    for c in cases:
        row = dict(c, key=_key(c), bytes=_bytes_moved(c))
        try:
            row["copy_ms"] = copy_ms(row["bytes"])
            row["ms"], _ = _prologue_ms(c)
        except Exception as exc:   # keep the other shapes
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        for tag, src in (("", row), ("old_", old.get(row["key"], {}))):
            if "ms" in src and "copy_ms" in row:
                row[tag + "gbps"] = row["bytes"] / (src["ms"] * 1e-3) / 1e9
                row[tag + "of_copy"] = row["copy_ms"] / src["ms"]
            if tag and "ms" in src:
                row["old_ms"] = src["ms"]
            if tag and "error" in src:
                row["old_error"] = src["error"]
        rows.append(row)
        print(f"{row['key']}: {row.get('ms', row.get('error'))} ms"
              + (f", {row['gbps']:.0f} GB/s ({100 * row['of_copy']:.0f}% of copy)"
                 if "gbps" in row else ""), flush=True)

    sweep = []
    if args.sweep:
        for c in cases:
            if (c["Hkv"] != HQ or c["recipe"] not in SWEPT
                    or c["N"] != cases[-1]["N"]):
                continue      # the same kernel with smoothing or interleaved pairs; GQA: fewer K/V groups
            base = None
            nbytes = _bytes_moved(c)
            for t in sweep_candidates():
                if t.rope_select is not None and "rope" not in c["recipe"]:
                    continue      # the select is RoPE's: the same launch as without it
                if (getattr(t, "gluon_rope_words", None) is not None
                        and c["recipe"] not in ("rope", "rope-il", "rope+smooth")):
                    continue      # words: RoPE's ("half": Q / K; "interleaved": the tables)
                if getattr(t, "gluon_pdl", None) is not None and "smooth" not in c["recipe"]:
                    continue      # pdl: smooth_k's pre-passes only
                gluon = getattr(t, "kernel", None) == "gluon"
                if c["recipe"] in GLUON_ONLY and not gluon and t != sweep_candidates()[0]:
                    continue
                if gluon and _served_by(c, t) != "gluon":
                    continue      # not the hot case (e.g. float32 tables): the Triton kernel
                entry = dict(key=_key(c), tuning=dataclasses.asdict(t), tuning_text=_tuning_text(t))
                try:
                    ms, ops = _prologue_ms(c, t)
                    if base is None:
                        base = ops
                    entry.update(ms=ms, gbps=nbytes / (ms * 1e-3) / 1e9,
                                 same_bytes=_same_operands(ops, base))
                except Exception as exc:
                    entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
                sweep.append(entry)
                print(f"  sweep {entry['key']} {entry['tuning_text']}: "
                      f"{entry.get('ms', entry.get('error'))}", flush=True)

    slug = device.lower().replace("nvidia ", "nvidia-").replace(" ", "-")
    stem = os.path.join(args.out, f"fp8-prologue-bw-{slug}-{now:%Y-%m-%d-%H%M}")
    os.makedirs(args.out, exist_ok=True)
    result = dict(device=device, torch=torch.__version__, triton=triton.__version__,
                  date=now.isoformat(), argv=sys.argv[1:], against=args.against,
                  bytes_rule="2*(B*Hq*N*D + 2*B*Hkv*N*D) read + B*Hq*N*D + B*Hkv*N*D + "
                             "B*Hkv*D*N_pad written + scales", rows=rows, sweep=sweep)
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# FP8 prologue bandwidth: {device}", "", head + "; bytes moved = inputs read once + "
             "outputs written once; copy = `copy_` of the same byte count", ""]
    cols = "| D | N | B | Hkv | recipe | MB moved | ms | GB/s | % of copy | copy GB/s |"
    sep = "|---|---|---|---|---|---|---|---|---|---|"
    if args.against:
        cols += " old ms | old GB/s | old % of copy | speedup |"
        sep += "---|---|---|---|"
    lines += [cols, sep]
    for r in rows:
        copy_gbps = r["bytes"] / (r["copy_ms"] * 1e-3) / 1e9 if "copy_ms" in r else None
        line = (f"| {r['D']} | {r['N']} | {r['B']} | {r['Hkv']} | {r['recipe']} | "
                f"{r['bytes'] / 1e6:.0f} | " + (f"{r['ms']:.4f} | {r['gbps']:.0f} | "
                                                f"{100 * r['of_copy']:.0f}% | {copy_gbps:.0f} |"
                                                if "gbps" in r else f"{r.get('error', '')} | | | |"))
        if args.against:
            line += (f" {r['old_ms']:.4f} | {r['old_gbps']:.0f} | {100 * r['old_of_copy']:.0f}% | "
                     f"{r['old_ms'] / r['ms']:.2f}x |" if "old_gbps" in r and "ms" in r
                     else f" {r.get('old_error', '')} | | | |")
        lines.append(line)
    if sweep:
        lines += ["", "## Launch parameters (--sweep)", "",
                  "| shape | tuning | ms | GB/s | same bytes |", "|---|---|---|---|---|"]
        for e in sweep:
            lines.append(f"| {e['key']} | {e['tuning_text']} | " + (
                f"{e['ms']:.4f} | {e['gbps']:.0f} | {e['same_bytes']} |" if "ms" in e
                else f"{e['error']} | | |"))
        lines += ["", "Best per shape:", ""]
        for key in dict.fromkeys(e["key"] for e in sweep):
            ok = [e for e in sweep if e["key"] == key and "ms" in e and e["same_bytes"]]
            if ok:
                best = min(ok, key=lambda e: e["ms"])
                lines.append(f"- {key}: {best['tuning_text']} {best['ms']:.4f} ms "
                             f"({best['gbps']:.0f} GB/s)")
    with open(stem + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
