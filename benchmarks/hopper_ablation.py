"""Ablation benchmark of the sm90 Gluon FA3-structure forward kernel, with cuDNN SDPA in the same run.

    python benchmarks/hopper_ablation.py [--quick] [--sweep] [--schedule] [--rounds N] [--json PATH]

For each shape: checks every kernel variant first (float64 reference on a slice of batch 0 / the
first heads, fresh random inputs, NaN-poisoned outputs), then times it with
triton.testing.do_bench (median). TFLOP/s = 4·B·H·N²·D / t, halved for causal.
Variants: full (pingpong + intra-warpgroup overlap, table stages), no overlap, +-1 stage, persistent; plus
tanh softcap (score_mod) on the full kernel; --schedule: one CTA per tile against persistent.

Ablations whose switch left the production kernel (every shipped config took one value; see
templates/hopper/configs.py) last existed at commit 7bfe679, where this script still runs them:
  * "no pingpong" / "no pingpong, no overlap" (Sm90Config.pingpong): pingpong +1-4% non-causal at D=128 / 256
    on an H200, within the noise for causal and D=64 (hopper-ablation-nvidia-h200-2026-11-22-0715; the H100
    runs in docs/design/hopper_kernel.md, "Pipeline ablations");
  * "persistent, O in Q" (Sm90Config.o_stage=False; --schedule): persistent launches stage O in a buffer of
    their own wherever it fits (hopper-sched-nvidia-h200-2026-11-22-0304);
  * lazy rescale, exp2 emulation outside SFU-bound mods and padded (unsplit) shared tiles: measured by
    benchmarks/hopper_mods.py at 7bfe679 (hopper-mods-nvidia-h200-2026-11-22-0630, -1653-split-d96-d80).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fa3_inductor.templates.hopper import get_config, launch_fwd_sm90  # noqa: E402


@gluon.jit
def causal_mask(b, h, q_idx, kv_idx, bufs):
    return q_idx >= kv_idx


@gluon.jit
def softcap_mod(qk, sm_scale, b, h, q_idx, kv_idx, bufs):
    score = qk * sm_scale
    t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [score * 0.02], dtype=gl.float32,
                                  is_pure=True, pack=1)
    return 50.0 * t


def causal_block_mask(S, qb=128, kvb=128, device="cuda"):
    """BlockMask-format tensors for causal attention with M = N = S (diagonal blocks partial)."""
    nq, nk = triton.cdiv(S, qb), triton.cdiv(S, kvb)
    ar = torch.arange(nk, device=device, dtype=torch.int32)
    qi = torch.arange(nq, device=device, dtype=torch.int32)
    kv_num = torch.ones(1, 1, nq, dtype=torch.int32, device=device)
    kv_idx = torch.zeros(1, 1, nq, nk, dtype=torch.int32, device=device)
    kv_idx[0, 0, :, 0] = qi
    full_num = qi.clone().view(1, 1, nq)
    full_idx = torch.where(ar[None, :] < qi[:, None], ar[None, :], 0).view(1, 1, nq, nk).contiguous()
    return kv_num, kv_idx, full_num.contiguous(), full_idx


def ref_slice(q, k, v, sm_scale, causal, softcap, heads=2):
    qd, kd, vd = q[0, :heads].double(), k[0, :heads].double(), v[0, :heads].double()
    s = qd @ kd.transpose(-1, -2) * sm_scale
    if softcap:
        s = 50.0 * torch.tanh(s / 50.0)
    if causal:
        S = s.shape[-1]
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=s.device).tril().logical_not(), float("-inf"))
    lse = torch.logsumexp(s, -1) / math.log(2)
    return torch.softmax(s, -1) @ vd, lse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds over all variants (spread = noise)")
    ap.add_argument("--sweep", action="store_true", help="also the FA3-paper sweep (16 heads, 16k tokens)")
    ap.add_argument("--schedule", action="store_true",
                    help="only the schedule study: one CTA per tile vs persistent (with / without the O staging "
                         "buffer) on the sweep at S 1k/2k/4k/16k, noop and causal, D=128, and D=64/256 at 2k")
    args = ap.parse_args()
    dev = "cuda"
    name = torch.cuda.get_device_name()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}, {date}", flush=True)
    dtype = torch.bfloat16

    shapes = [  # (label, B, H, S, D, causal)
        ("B4 H32 S4096 D128", 4, 32, 4096, 128, False),
        ("B2 H16 S8192 D128", 2, 16, 8192, 128, False),
        ("B4 H16 S4096 D128 causal", 4, 16, 4096, 128, True),
        ("B4 H32 S4096 D64", 4, 32, 4096, 64, False),
        ("B4 H16 S4096 D256", 4, 16, 4096, 256, False),
    ]
    if args.quick:
        shapes = shapes[:1] + shapes[2:3]
    if args.schedule:
        shapes = [(f"sched S{S} B{16384 // S} H16 D{D}{' causal' if c else ''}", 16384 // S, 16, S, D, c)
                  for D, seqs in ((128, (1024, 2048, 4096, 8192, 16384)), (64, (2048,)), (256, (2048,)))
                  for c in (False, True) for S in seqs]
    for causal in (False, True) if args.sweep else ():
        for S in (1024, 2048, 4096, 8192, 16384):
            shapes.append((f"sweep S{S} B{16384 // S} H16 D128{' causal' if causal else ''}", 16384 // S, 16, S,
                           128, causal))
    rows = []
    for label, B, H, S, D, causal in shapes:
        torch.manual_seed(0)
        q = torch.randn(B, H, S, D, device=dev, dtype=dtype)
        k = torch.randn(B, H, S, D, device=dev, dtype=dtype)
        v = torch.randn(B, H, S, D, device=dev, dtype=dtype)
        sm_scale = D ** -0.5
        flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
        base = get_config(D, dtype)
        variants = [("full", {}, False)]
        sweep = label.startswith("sweep")
        if D != 128 and not sweep:
            variants += [("no overlap", dict(overlap=False), False)]
            if base.num_stages > 2:
                variants += [(f"{base.num_stages - 1} stages", dict(num_stages=base.num_stages - 1), False)]
        if D == 128 and not sweep:
            variants += [("no overlap", dict(overlap=False), False),
                         (f"{base.num_stages + 1} stages", dict(num_stages=base.num_stages + 1), False),
                         ("persistent", dict(persistent=True), False)]
            if not causal:
                variants += [("full + softcap", {}, True)]
        if sweep and S <= 2048:
            variants += [("persistent", dict(persistent=True), False)]
        if label.startswith("sched"):
            # persistent: with the O staging buffer where it fits (not at D=256)
            variants = [("one CTA per tile", dict(persistent=False), False),
                        ("persistent", dict(persistent=True), False)]
        bm = causal_block_mask(S) if causal else None

        def cudnn():
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale)

        timed = [("cuDNN SDPA", cudnn, None)]
        try:
            cudnn()
        except Exception as e:  # noqa: BLE001
            timed = []
            rows.append(dict(shape=label, variant="cuDNN SDPA", ms=None, tflops=None, err=f"failed: {e}"))
        refs = {}
        for vname, over, softcap in variants:
            cfg = get_config(D, dtype, **over)
            if cfg.smem_bytes(D) > 227 * 1024:   # (the O staging buffer is dropped on its own where it does not fit)
                rows.append(dict(shape=label, variant=vname, ms=None, tflops=None, err="smem > 227 KB"))
                continue
            out = torch.full_like(q, float("nan"))
            lse = torch.full((B, H, S), float("nan"), device=dev)
            mx = torch.empty((B, H, S), device=dev)
            kw = dict(sm_scale=sm_scale, config=cfg, score_mod=softcap_mod if softcap else None)
            if causal:
                kw.update(mask_mod=causal_mask, kv_num_blocks=bm[0], kv_indices=bm[1], full_kv_num_blocks=bm[2],
                          full_kv_indices=bm[3])
            fn = lambda out=out, lse=lse, mx=mx, kw=kw: launch_fwd_sm90(q, k, v, out, lse, mx, **kw)  # noqa: E731
            try:
                fn()
                torch.cuda.synchronize()
                if softcap not in refs:
                    refs[softcap] = ref_slice(q, k, v, sm_scale, causal, softcap)
                ref, ref_lse = refs[softcap]
                o_s = out[0, :ref.shape[0]].double()
                err = ((o_s - ref).norm() / ref.norm()).item()
                lse_err = (lse[0, :ref.shape[0]].double() - ref_lse).abs().max().item()
                nan = bool(torch.isnan(out).any() or torch.isnan(lse).any())
                ok = (not nan) and err <= 1e-2 and lse_err < 5e-2
                check = f"rel {err:.2e} lse {lse_err:.1e}{' NaN' if nan else ''}{'' if ok else ' FAIL'}"
                if ok:
                    timed.append((vname, fn, check))
                else:
                    rows.append(dict(shape=label, variant=vname, ms=None, tflops=None, err=check))
            except Exception as e:  # noqa: BLE001
                rows.append(dict(shape=label, variant=vname, ms=None, tflops=None, err=f"failed: {type(e).__name__}: "
                                 f"{str(e)[:200]}"))
        # time every checked callable, `rounds` times over the whole list (interleaved: drift shows as spread)
        times = {v: [] for v, _, _ in timed}
        for _ in range(args.rounds):
            for vname, fn, _ in timed:
                times[vname].append(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
        for vname, fn, check in timed:
            ts = times[vname]
            ms = sorted(ts)[len(ts) // 2]   # median over rounds of do_bench medians
            rows.append(dict(shape=label, variant=vname, ms=ms, tflops=flops / ms * 1e-9, err=check,
                             tflops_rounds=[flops / t * 1e-9 for t in ts]))
            print(rows[-1], flush=True)
        del q, k, v
        torch.cuda.empty_cache()

    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, torch=torch.__version__, triton=triton.__version__, date=date, rows=rows),
                      f, indent=1)
    print(f"\n{name}  (TFLOP/s, do_bench median; check = vs float64 on batch 0, heads 0-1)")
    print(f"{'shape':34s} {'variant':24s} {'ms':>7s} {'TFLOP/s':>7s} {'rounds':>11s}  check")
    for r in rows:
        ms = f"{r['ms']:.3f}" if r["ms"] else "-"
        tf = f"{r['tflops']:.0f}" if r["tflops"] else "-"
        rr = "/".join(f"{x:.0f}" for x in r.get("tflops_rounds", []))
        print(f"{r['shape']:34s} {r['variant']:24s} {ms:>7s} {tf:>7s} {rr:>11s}  {r['err'] or ''}")


if __name__ == "__main__":
    main()
