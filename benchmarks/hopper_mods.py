"""Cost of score mods on the sm90 Gluon forward kernel: softcap and ALiBi against our own noop, same run.

    python benchmarks/hopper_mods.py [--json PATH] [--rounds 3] [--shapes 4x16x4096,1x32x4096x64]
                                     [--baseline PATH_TO_OLD_fwd_sm90.py]

Mods are generated the product's way (fa3_inductor.mods -> modgen -> @gluon.jit). For every variant:
first a check against float64 (batch 0, heads 0-1; fresh random inputs, NaN-poisoned outputs; rel. error
of O, abs. error of the log2 LSE), then `triton.testing.do_bench` medians, `rounds` interleaved rounds
over all variants, odd rounds in reverse order (the spread is the noise). TFLOP/s = 4·B·H·N²·D / t
(2·B·H·N²·(D + Dv) / t for a shape BxHxSxDxDv whose V head dim Dv differs).

Variants, launched as the product launches them (max_needed=False); "table" = the config table's choice:
noop; softcap (table: a fixed exponent base, no row max; at D=64 half the exp2 on the FMA pipe), softcap
with the row max asked for ("softcap max"), softcap with the exp2 emulation off / on ("softcap emu=off / on":
Sm90Config.sfu_mod_exp2_emu); ALiBi (table), "alibi folded" (generated as qk + slope/sm_scale * (kv - q)) and
"alibi unfolded", its twin that forms score = qk * sm_scale first (launched for sm_scale <= 0 and at D=64;
what modgen generated before that fold); relative bias.
Variants of switches that left the kernel (last at commit 7bfe679, where this script still runs them): noop
with a quarter / half of the exp2 on the FMA pipe and softcap with a quarter (emu=1 / 2,
hopper-mods-nvidia-h200-2026-11-22-0630), noop / softcap without pingpong, "alibi / relbias affine=off" (the
KV_AFFINE mods per score, hopper-mods-nvidia-h200-2026-11-22-0825, -0827), --lazy-ablation (lazy rescale).
Shapes are BxHxS, BxHxSxD (D 128 by default) or BxHxSxDxDv. With --baseline (a copy of an older fwd_sm90.py, imports made
absolute) the old kernel runs noop / softcap / ALiBi with the old generated mod sources, in the same run.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import math
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fa3_inductor import mods  # noqa: E402
from fa3_inductor.templates.hopper import get_config, launch_fwd_sm90  # noqa: E402
from fa3_inductor.templates.modgen import BufferSpec, generate_mod_source, load_mod, trace_mod, unfolded_of  # noqa: E402

SOFTCAP = 30.0   # as benchmarks/bench.py

# What modgen emitted before the scale folding (commit 3c5978d: mods took the scaled score, no
# OUT_SCALE), for the --baseline kernel of that commit.
OLD_SOFTCAP = f"""@gluon.jit
def score_mod(score, b, h, q_idx, kv_idx, bufs):
    v0 = (score / {SOFTCAP})
    v1 = H.tanh(v0)
    v2 = (v1 * {SOFTCAP})
    return v2
"""


def old_alibi(H):
    return f"""@gluon.jit
def score_mod(score, b, h, q_idx, kv_idx, bufs):
    v1 = h.to(gl.float32)
    v2 = (v1 + 1.0)
    v3 = (v2 * {-8.0 / H!r})
    v4 = gl.exp2(v3)
    v6 = H.index_to_float(kv_idx)
    v7 = H.index_to_float(q_idx)
    v8 = (v6 - v7)
    v9 = (v8 * v4)
    v10 = (score + v9)
    return v10
"""


def config_overrides(words: list[str]) -> dict:
    """["block_n=128", "overlap=off"] -> dict(block_n=128, overlap=False): Sm90Config fields for ablations."""
    out = {}
    for w in words:
        key, _, val = w.partition("=")
        out[key] = {"on": True, "off": False}.get(val, None)
        if out[key] is None:
            out[key] = int(val)
    return out


def gen(fn):
    gm, bufs = trace_mod(fn, "score")
    return load_mod(generate_mod_source(gm, "score", [BufferSpec.of(b) for b in bufs], "gl"), "gl")


def reference(q, k, v, sm_scale, mod, heads=2):
    """float64 O and log2 LSE for batch 0, the first `heads` heads, one head at a time."""
    outs, lses = [], []
    N = k.shape[2]
    M = q.shape[2]
    qi = torch.arange(M, device=q.device)[:, None]
    ki = torch.arange(N, device=q.device)[None, :]
    for h in range(heads):
        s = (q[0, h].double() @ k[0, h].double().T) * sm_scale
        if mod is not None:
            s = mod(s, torch.tensor(0, device=q.device), torch.tensor(h, device=q.device), qi, ki)
        lses.append(torch.logsumexp(s, -1) / math.log(2))
        outs.append(torch.softmax(s, -1) @ v[0, h].double())
        del s
    return torch.stack(outs), torch.stack(lses)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", default=None)
    ap.add_argument("--shapes", default="4x16x4096,1x16x16384")
    ap.add_argument("--no-emu", action="store_true", help="skip the sfu_mod_exp2_emu variants")
    ap.add_argument("--variants", default=None,
                    help="comma-separated variant names to keep (default: all), e.g. 'noop,alibi folded'; a name "
                         "'<noop|softcap|alibi|relbias> field=value ...' adds that mod with Sm90Config overrides, "
                         "e.g. 'noop block_n=128 num_stages=1 overlap=off'")
    ap.add_argument("--persistent-ablation", action="store_true",
                    help="also noop/softcap/alibi with the persistent schedule forced on and off")
    args = ap.parse_args()
    name = torch.cuda.get_device_name()
    print(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%MZ}", flush=True)
    base = None
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_fwd_sm90", args.baseline)
        base = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)
    dtype = torch.bfloat16
    rows = []
    for shape in args.shapes.split(","):
        dims = [int(x) for x in shape.split("x")]
        B, H, S = dims[:3]
        D = dims[3] if len(dims) > 3 else 128
        Dv = dims[4] if len(dims) > 4 else D   # a fifth field: V's head dim where it differs (BxHxSxDxDv)
        label = f"B{B} H{H} S{S} D{D}" + (f"/{Dv}" if Dv != D else "")
        torch.manual_seed(0)
        q, k = (torch.randn(B, H, S, D, device="cuda", dtype=dtype) for _ in range(2))
        v = torch.randn(B, H, S, Dv, device="cuda", dtype=dtype)
        sm_scale = D ** -0.5
        flops = 2 * B * H * S * S * (D + Dv)
        py_mods = {"noop": None, "softcap": mods.softcap(SOFTCAP), "alibi": mods.alibi(H),
                   "relbias": mods.relative_bias}
        g_soft, g_alibi, g_rel = gen(py_mods["softcap"]), gen(py_mods["alibi"]), gen(py_mods["relbias"])
        # launch_fwd_sm90 as the product calls it (max_needed=False: nothing reads the row max), and
        # softcap once more with the row max asked for (no fixed exponent base)
        launch = functools.partial(launch_fwd_sm90, max_needed=False)
        variants = [  # (name, launcher, score_mod, config overrides, reference mod key)
            ("noop", launch, None, {}, "noop"),
            ("softcap", launch, g_soft, {}, "softcap"),
            ("softcap max", launch_fwd_sm90, g_soft, {}, "softcap"),
            ("softcap emu=off", launch, g_soft, dict(sfu_mod_exp2_emu=False), "softcap"),
            ("softcap emu=on", launch, g_soft, dict(sfu_mod_exp2_emu=True), "softcap"),
            ("alibi", launch, g_alibi, {}, "alibi"),
            ("alibi folded", launch, g_alibi, dict(fold_sm_scale=True), "alibi"),
            ("alibi unfolded", launch, unfolded_of(g_alibi), {}, "alibi"),
            ("relbias", launch, g_rel, {}, "relbias"),
        ]
        if args.persistent_ablation:   # use_persistent() decides per launch; force each way
            variants += [(f"{n} persistent={'on' if on else 'off'}", launch, m, dict(persistent=on), r)
                         for on in (True, False)
                         for n, m, r in (("noop", None, "noop"), ("softcap", g_soft, "softcap"),
                                         ("alibi", g_alibi, "alibi"))]
        if base is not None:
            variants += [
                ("OLD noop", base.launch_fwd_sm90, None, {}, "noop"),
                ("OLD softcap", base.launch_fwd_sm90, load_mod(OLD_SOFTCAP, "gl"), {}, "softcap"),
                ("OLD alibi", base.launch_fwd_sm90, load_mod(old_alibi(H), "gl"), {}, "alibi"),
            ]
        if args.no_emu:
            variants = [x for x in variants if "emu=" not in x[0]]
        if args.variants:
            keep = [v.strip() for v in args.variants.split(",")]
            known = {x[0] for x in variants}
            base_of = {"noop": (None, "noop"), "softcap": (g_soft, "softcap"), "alibi": (g_alibi, "alibi"),
                       "relbias": (g_rel, "relbias")}
            # "<mod> field=value ..." names not in the list above: that mod with those Sm90Config overrides
            variants = [x for x in variants if x[0] in keep] + [
                (v, launch, *base_of[v.split()[0]][:1], config_overrides(v.split()[1:]), base_of[v.split()[0]][1])
                for v in keep if v not in known and v.split()[0] in base_of]
        refs = {}
        timed = []
        for vname, launch, smod, over, rkey in variants:
            cfg = get_config(D, dtype, value_head_dim=Dv, **over) if over else None   # None: the table's, as the product
            out = torch.full((B, H, S, Dv), float("nan"), device="cuda", dtype=dtype)
            lse = torch.full((B, H, S), float("nan"), device="cuda")
            mx = torch.empty((B, H, S), device="cuda")
            fn = (lambda launch=launch, out=out, lse=lse, mx=mx, smod=smod, cfg=cfg:  # noqa: E731
                  launch(q, k, v, out, lse, mx, sm_scale=sm_scale, score_mod=smod, config=cfg))
            try:
                fn()
                torch.cuda.synchronize()
                if rkey not in refs:
                    refs[rkey] = reference(q, k, v, sm_scale, py_mods[rkey])
                ref, ref_lse = refs[rkey]
                err = ((out[0, :2].double() - ref).norm() / ref.norm()).item()
                lse_err = (lse[0, :2].double() - ref_lse).abs().max().item()
                nan = bool(torch.isnan(out).any() or torch.isnan(lse).any())
                ok = not nan and err <= 1e-2 and lse_err < 5e-2
                check = f"rel {err:.2e} lse {lse_err:.1e}{' NaN' if nan else ''}{'' if ok else ' FAIL'}"
            except Exception as e:  # noqa: BLE001
                ok, check = False, f"failed: {type(e).__name__}: {str(e)[:300]}"
            print(f"{label:22s} {vname:16s} {check}", flush=True)
            if ok:
                timed.append((vname, fn, check))
            else:
                rows.append(dict(shape=label, variant=vname, ms=None, tflops=None, check=check))
        times = {vn: [] for vn, _, _ in timed}
        for rnd in range(args.rounds):
            # odd rounds in reverse order: a variant's position in the round (the GPU's clock and
            # thermal state after the one before it) moved identical launches by ~5% in one run
            for vn, fn, _ in (timed if rnd % 2 == 0 else timed[::-1]):
                times[vn].append(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
        noop = {}
        for vn, fn, check in timed:
            ts = times[vn]
            ms = sorted(ts)[len(ts) // 2]
            tf = flops / ms * 1e-9
            if vn.split(" lazy=")[0] in ("noop", "OLD noop"):
                noop[(vn.startswith("OLD"), " lazy=" in vn)] = tf
            rows.append(dict(shape=label, variant=vn, ms=ms, tflops=tf, check=check,
                             tflops_rounds=[flops / t * 1e-9 for t in ts]))
        for r in rows:
            if r["shape"] == label and r["tflops"]:
                n = noop.get((r["variant"].startswith("OLD"), " lazy=" in r["variant"]))
                r["vs_noop"] = r["tflops"] / n if n else None
        del q, k, v
        torch.cuda.empty_cache()

    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, torch=torch.__version__, triton=triton.__version__,
                           date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           rows=rows), f, indent=1)
    print(f"\n{name}  bf16 non-causal, TFLOP/s = do_bench median (median of {args.rounds} rounds); "
          "vs noop = same kernel's noop, same run")
    print(f"{'shape':22s} {'variant':16s} {'ms':>7s} {'TFLOP/s':>7s} {'vs noop':>7s} {'rounds':>13s}  check")
    for r in rows:
        ms = f"{r['ms']:.3f}" if r["ms"] else "-"
        tf = f"{r['tflops']:.0f}" if r["tflops"] else "-"
        vs = f"{r['vs_noop']:.3f}" if r.get("vs_noop") else "-"
        rr = "/".join(f"{x:.0f}" for x in r.get("tflops_rounds", []))
        print(f"{r['shape']:22s} {r['variant']:16s} {ms:>7s} {tf:>7s} {vs:>7s} {rr:>13s}  {r['check']}")


if __name__ == "__main__":
    main()
