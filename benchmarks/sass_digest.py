"""SASS digest of every shipped sm90 forward configuration, compiled on the CPU (no GPU needed).

For every entry of the Hopper tile table (`configs.all_configs()`: head dims x dtypes, the fixed-base
entries included, and `all_pair_configs()`: a V head dim other than Q's), times a small set of mods
generated the way the product generates them (modgen: trace_mod -> generate_mod_source -> load_mod),
times the launch variants the host builds for one site (`prepare_fwd_sm90_variants`: the launch and its
siblings, i.e. persistent on / off with O_STAGE as the host chooses it, EVEN_N on / off), this compiles
the kernel for sm90 and prints one line per compile:

    <configuration> regs=R stack=S local=L stl=N shared=B instrs=I sha256=<hash of the SASS text>

Mods: none; causal (mask_mod + block mask); softcap 30 (tanh: MUFU per score; bf16 without the row max
takes the fixed exponent base, fp16 and max_needed keep it, D=64 emulates part of the exp2); ALiBi
`score + (kv - q) * slope[h]` (KV_AFFINE: column / tile / row parts); a document mask reading a captured
id tensor (gather), with its block mask.

`--family generic` (or `all`, the default, which takes both) also digests the generic kernel
(templates/generic): head dims 64, 96, 128, 256 and Q 192 / V 128, bf16, fp16 and float32 (float32 under
torch's matmul precision "highest" (IEEE dots) and "high" (TF32), which the host reads), mods none, causal,
softcap, alibi, document (the same generated mods, in the `tl` dialect), each with the launch and its
siblings as `prepare_generic_variants(..., plan_for=(9, 0))` returns them (EVEN_N both ways, the long tiles
of a plain site). Its lines start with `generic `, so they never collide with the Hopper ones:

    generic D=128 Dv=128 bfloat16 mod=none tile=64x64 warps=4 stages=3 even_n=1 host_desc=1 hull=0 dot=ieee | regs=...

Use it to show that a change to the kernel's structure left the code alone: digest the old tree and the
new one and compare.

    git worktree add /tmp/old_tree 7bfe679
    .venv/bin/python benchmarks/sass_digest.py --root /tmp/old_tree --out /tmp/sass-old.txt
    .venv/bin/python benchmarks/sass_digest.py --out /tmp/sass-new.txt --against /tmp/sass-old.txt
    git worktree remove --force /tmp/old_tree

`--against FILE` prints a diff summary (identical / different / only in one file) keyed by the
configuration text. `--jobs N` compiles in N processes (default: the CPU count). `--quick` takes bf16
only. Compiles go through Triton's cache (TRITON_CACHE_DIR), whose key covers the kernel's source and
its callees, so a second run of an unchanged tree is fast and a changed one recompiles.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import multiprocessing
import os
import re
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODS = ("none", "causal", "softcap", "softcap_max", "alibi", "document")
FAMILIES = ("hopper", "generic")
# the generic kernel: (D, Dv) pairs (its table goes by the wider head dim), dtypes, mods (no max_needed option)
GENERIC_DIMS = ((64, 64), (96, 96), (128, 128), (256, 256), (192, 128))
GENERIC_DTYPES = ("bfloat16", "float16", "float32")
GENERIC_MODS = ("none", "causal", "softcap", "alibi", "document")
# one site's shapes: GQA 2, M = N = 1024 (lengths are not in the key; the variants cover EVEN_N and the schedule)
B, HQ, HKV, S = 2, 4, 2, 1024


def _setup(root: str) -> None:
    """Import fa3_inductor from `root` in this process (a worker, or the parent before it enumerates)."""
    os.environ.pop("TRITON_INTERPRET", None)
    if root not in sys.path:
        sys.path.insert(0, root)
    import fa3_inductor
    where = os.path.realpath(os.path.dirname(fa3_inductor.__file__))
    if not where.startswith(os.path.realpath(root) + os.sep):
        raise RuntimeError(f"fa3_inductor imported from {where}, not from {root}")


def _entries(quick: bool) -> list[tuple]:
    """(index, label) of every shipped config, stable across trees (labels name the table and the shapes)."""
    from fa3_inductor.templates.hopper import configs as C
    out = []
    for d, dt, cfg in C.all_configs():
        table = "fixed_base" if C.FIXED_BASE_TABLE.get(d) is cfg and C._TABLE.get(d) is not cfg else "table"
        out.append(("same", d, d, str(dt).replace("torch.", ""), table))
    for d, dv, dt, cfg in C.all_pair_configs():
        out.append(("pair", d, dv, str(dt).replace("torch.", ""), "pair"))
    if quick:
        out = [e for e in out if e[3] == "bfloat16"]
    return [(i, e) for i, e in enumerate(out)]


def _config(kind: str, d: int, dv: int, dtype_name: str, table: str):
    import torch
    from fa3_inductor.templates.hopper import configs as C
    dt = getattr(torch, dtype_name)
    if kind == "pair":
        return next(cfg for dd, vv, t, cfg in C.all_pair_configs() if (dd, vv, t) == (d, dv, dt))
    return C.FIXED_BASE_TABLE[d] if table == "fixed_base" else C._TABLE[d]


def _generic_entries(quick: bool) -> list[tuple]:
    """("generic", D, Dv, dtype, matmul precision) of every generic configuration digested; the
    precision matters to float32 only (DOT_PRECISION), 16-bit entries take "highest"."""
    out = []
    for d, dv in GENERIC_DIMS:
        for dt in GENERIC_DTYPES:
            for prec in (("highest", "high") if dt == "float32" else ("highest",)):
                out.append(("generic", d, dv, dt, prec))
    if quick:
        out = [e for e in out if e[3] == "bfloat16"]
    return out


def _generated(fn, kind, dialect="gl"):
    from fa3_inductor.templates.modgen import BufferSpec, generate_mod_source, load_mod, trace_mod
    gm, bufs = trace_mod(fn, kind)
    return (load_mod(generate_mod_source(gm, kind, [BufferSpec.of(b) for b in bufs], dialect), dialect),
            tuple(bufs))


def _mod_options(name: str, dialect: str = "gl") -> dict:
    """prepare_fwd_sm90 keywords of one mod, generated the product's way (``dialect`` "tl": the
    generic kernel's, prepare_generic keywords; it has no max_needed)."""
    import torch
    from fa3_inductor import mods
    try:
        from fa3_inductor.recognition.canonical import dense_block_mask
    except ImportError:   # before the recognition package
        from fa3_inductor.lowering.canonical import dense_block_mask
    if name == "none":
        return {}
    if name in ("softcap", "softcap_max"):
        mod, bufs = _generated(mods.softcap(30.0), "score", dialect)
        if dialect != "gl":
            return dict(score_mod=mod, score_bufs=bufs)
        return dict(score_mod=mod, score_bufs=bufs, max_needed=name == "softcap_max")
    if name == "alibi":
        mod, bufs = _generated(mods.alibi(HQ), "score", dialect)
        return dict(score_mod=mod, score_bufs=bufs)
    fn = mods.causal if name == "causal" else mods.document(
        torch.arange(S, dtype=torch.int32) // 300)
    mod, bufs = _generated(fn, "mask", dialect)
    qi, ki = torch.arange(S)[:, None], torch.arange(S)[None, :]
    bm = dense_block_mask(torch.broadcast_to(fn(0, 0, qi, ki), (S, S)), 1, 1, S, S, "cpu")
    return dict(mask_mod=mod, mask_bufs=bufs, kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices,
                full_kv_num_blocks=bm.full_kv_num_blocks, full_kv_indices=bm.full_kv_indices)


def _flag(kwargs: dict, name: str):
    """A kernel constexpr by name: a keyword of its own (as at 7bfe679) or a field of a constexpr
    bundle keyword (a frozen dataclass: TILE, SCHED, SPARSE, FLAGS)."""
    if name in kwargs:
        return kwargs[name]
    for v in kwargs.values():
        if name in getattr(v, "__dataclass_fields__", ()):
            return getattr(v, name)
    return None


def _digest(ck) -> str:
    """The line's right-hand side: resources, spill stores, instruction count, hash of the SASS."""
    res, sass = _sass_text(ck)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    body = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", ln)]
    stl = sum(bool(re.search(r"\bSTL\b", ln)) for ln in body)
    return (f"regs={m.group(1)} stack={m.group(2)} local={m.group(4)} stl={stl} "
            f"shared={ck.metadata.shared} instrs={len(body)} "
            f"sha256={hashlib.sha256(sass.encode()).hexdigest()[:32]}")


def _sass_text(ck) -> tuple[str, str]:
    """(resource usage, SASS) of a compiled kernel from the wheel's cuobjdump."""
    import subprocess
    import tempfile

    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(ck.asm["cubin"])
        res = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    return res, sass


def _job(entry: tuple, mod: str) -> list[str]:
    import torch
    from fa3_inductor.templates.aot import compile_launch
    from fa3_inductor.templates.hopper import prepare_fwd_sm90_variants
    kind, d, dv, dtype_name, table = entry
    dt = getattr(torch, dtype_name)
    cfg = _config(*entry)
    q = torch.randn(B, HQ, S, d, dtype=dt)
    k = torch.randn(B, HKV, S, d, dtype=dt)
    v = torch.randn(B, HKV, S, dv, dtype=dt)
    out, lse, mx = torch.empty(B, HQ, S, dv, dtype=dt), torch.empty(B, HQ, S), torch.empty(B, HQ, S)
    launch, siblings = prepare_fwd_sm90_variants(q, k, v, out, lse, mx, sm_scale=d ** -0.5, config=cfg,
                                                 **_mod_options(mod))
    lines = []
    for kernel, args, kwargs, _grid in [launch, *siblings]:
        ck = compile_launch(kernel, args, kwargs)
        label = (f"D={d} Dv={dv} {dtype_name} {table} mod={mod} "
                 f"persistent={int(bool(_flag(kwargs, 'PERSISTENT')))} o_stage={int(bool(_flag(kwargs, 'O_STAGE')))} "
                 f"even_n={int(bool(_flag(kwargs, 'EVEN_N')))} fixed_base={int(bool(_flag(kwargs, 'FIXED_BASE')))} "
                 f"kv_affine={int(bool(_flag(kwargs, 'KV_AFFINE')))} exp2_emu={int(bool(_flag(kwargs, 'EXP2_EMU')))}")
        lines.append(f"{label} | {_digest(ck)}")
    return lines


def _generic_job(entry: tuple, mod: str) -> list[str]:
    """The generic kernel's launch and siblings for one (D, Dv, dtype, precision) and mod, planned
    for sm90 on CPU tensors, compiled for sm90."""
    import torch
    from fa3_inductor.templates.aot import compile_launch
    from fa3_inductor.templates.generic.host import prepare_generic_variants
    _, d, dv, dtype_name, prec = entry
    dt = getattr(torch, dtype_name)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(prec)   # read by _prepare (DOT_PRECISION)
    try:
        q = torch.randn(B, HQ, S, d, dtype=dt)
        k = torch.randn(B, HKV, S, d, dtype=dt)
        v = torch.randn(B, HKV, S, dv, dtype=dt)
        out, lse, mx = torch.empty(B, HQ, S, dv, dtype=dt), torch.empty(B, HQ, S), torch.empty(B, HQ, S)
        launch, siblings = prepare_generic_variants(q, k, v, out, lse, mx, sm_scale=d ** -0.5,
                                                    plan_for=(9, 0), **_mod_options(mod, "tl"))
        lines = []
        for kernel, args, kwargs, _grid in [launch, *siblings]:
            ck = compile_launch(kernel, args, kwargs)
            precision = f" {prec}" if dtype_name == "float32" else ""
            label = (f"generic D={d} Dv={dv} {dtype_name}{precision} mod={mod} "
                     f"tile={_flag(kwargs, 'BLOCK_M')}x{_flag(kwargs, 'BLOCK_N')} "
                     f"warps={kwargs.get('num_warps')} stages={kwargs.get('num_stages')} "
                     f"even_n={int(bool(_flag(kwargs, 'EVEN_N')))} "
                     f"host_desc={int(bool(_flag(kwargs, 'HOST_DESC')))} "
                     f"hull={int(bool(_flag(kwargs, 'ITERATE_HULL')))} dot={_flag(kwargs, 'DOT_PRECISION')}")
            lines.append(f"{label} | {_digest(ck)}")
        return lines
    finally:
        torch.set_float32_matmul_precision(before)


def _worker_init(root: str) -> None:
    _setup(root)


def _read(path: str) -> dict:
    rows = {}
    with open(path) as f:
        for ln in f:
            if " | " in ln and not ln.startswith("#"):
                key, val = ln.rstrip("\n").split(" | ", 1)
                rows[key] = val
    return rows


def compare(new: str, old: str) -> int:
    """Print a diff summary of two digest files; returns the number of configurations that differ."""
    a, b = _read(old), _read(new)
    same = [k for k in a if k in b and a[k] == b[k]]
    diff = [k for k in a if k in b and a[k] != b[k]]
    only_old = [k for k in a if k not in b]
    only_new = [k for k in b if k not in a]
    print(f"compared {old} (old) with {new} (new): {len(a)} / {len(b)} configurations, "
          f"{len(same)} identical, {len(diff)} different, {len(only_old)} only in old, {len(only_new)} only in new")
    for k in diff:
        print(f"  DIFF {k}\n       old {a[k]}\n       new {b[k]}")
    for k in only_old:
        print(f"  ONLY OLD {k}")
    for k in only_new:
        print(f"  ONLY NEW {k}")
    return len(diff) + len(only_old) + len(only_new)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=REPO, help="source tree to import fa3_inductor from (default: this repo)")
    ap.add_argument("--out", default=None, help="digest file (default: /tmp/sass-digest-<root name>.txt)")
    ap.add_argument("--against", default=None, help="an earlier digest file: print a diff summary against it")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quick", action="store_true", help="bf16 entries only")
    ap.add_argument("--family", choices=(*FAMILIES, "all"), default="all",
                    help="kernel family to digest: the Hopper kernel, the generic kernel, or both (default)")
    ap.add_argument("--mods", default=",".join(MODS), help=f"comma-separated subset of {','.join(MODS)}")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    out = args.out or f"/tmp/sass-digest-{os.path.basename(root.rstrip(os.sep))}.txt"
    mods = [m for m in args.mods.split(",") if m]
    unknown = set(mods) - set(MODS) - set(GENERIC_MODS)
    if unknown:
        ap.error(f"unknown mods {sorted(unknown)}")

    _setup(root)
    families = FAMILIES if args.family == "all" else (args.family,)
    jobs = []
    if "hopper" in families:
        jobs += [(e, m) for _, e in _entries(args.quick) for m in mods if m in MODS]
    if "generic" in families:
        jobs += [(e, m) for e in _generic_entries(args.quick) for m in mods if m in GENERIC_MODS]
    t0 = time.time()
    results: dict = {}
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx, initializer=_worker_init,
                                initargs=(root,)) as pool:
        futs = {pool.submit(_generic_job if e[0] == "generic" else _job, e, m): (e, m) for e, m in jobs}
        for n, fut in enumerate(cf.as_completed(futs), 1):
            e, m = futs[fut]
            try:
                results[(e, m)] = fut.result()
            except Exception as exc:   # a failed compile is a line of the digest too
                prefix = "generic " if e[0] == "generic" else ""
                results[(e, m)] = [f"{prefix}{e} mod={m} | ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"]
            print(f"[{n}/{len(jobs)} {time.time() - t0:.0f}s] {e} {m}: {len(results[(e, m)])} compiles",
                  file=sys.stderr, flush=True)
    lines = [ln for e, m in jobs for ln in results[(e, m)]]
    with open(out, "w") as f:
        f.write(f"# sass_digest root={root} compiles={len(lines)} seconds={time.time() - t0:.0f}\n")
        f.write("\n".join(lines) + "\n")
    print(f"{len(lines)} compiles of {len(jobs)} (config, mod) sites in {time.time() - t0:.0f}s -> {out}")
    if args.against:
        return 1 if compare(out, args.against) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
