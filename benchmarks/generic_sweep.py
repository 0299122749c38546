"""Tile sweep of the generic (plain Triton) template against FlexAttention, kernel time only.

Each candidate tile config is checked against a float32 reference first (output and LSE; a
config that is wrong is reported and not timed), then timed under a CUDA graph
(`triton.testing.do_bench_cudagraph`), so host overhead does not enter the comparison. Torch's
FlexAttention (compiled) is timed the same way on the same inputs and block mask.

    python benchmarks/generic_sweep.py --out $OUT            # on an H100/H200
    python benchmarks/generic_sweep.py --head-dims 128 --mods noop,causal --seqlens 4096

Writes generic-sweep-<device>-<date>.json (one object: device, torch, triton, date, rows) and
prints a table: TFLOP/s per config and its ratio to FlexAttention.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fa3_inductor import mods  # noqa: E402
from fa3_inductor.templates.generic.configs import GenericConfig, generic_config  # noqa: E402
from fa3_inductor.templates.generic.host import launch_generic  # noqa: E402
from fa3_inductor.templates.modgen import BufferSpec, generate_mod_source, load_mod, trace_mod  # noqa: E402

CANDIDATES = {
    # name: (block_m, block_n, num_warps, num_stages, warp_specialize); None = the shipped table
    "table": None,
    "ws64x128": (64, 128, 4, 2, True),
    "128x64w8s3": (128, 64, 8, 3, False),
    "128x128w8s3": (128, 128, 8, 3, False),
    "128x128w4s3": (128, 128, 4, 3, False),
    "64x64w4s3": (64, 64, 4, 3, False),
    "64x64w4s4": (64, 64, 4, 4, False),
    "64x128w4s3": (64, 128, 4, 3, False),
    "64x32w4s2": (64, 32, 4, 2, False),
    "64x64w4s2": (64, 64, 4, 2, False),
    "128x64w8s2": (128, 64, 8, 2, False),
    "128x32w8s3": (128, 32, 8, 3, False),
}


def _jit_mod(fn, kind):
    gm, bufs = trace_mod(fn, kind)
    src = generate_mod_source(gm, kind, [BufferSpec.of(b) for b in bufs], "tl")
    return load_mod(src, "tl"), bufs


def _case(mod: str, D: int, S: int, device):
    tokens = 16384
    H = 2048 // D
    B = max(1, tokens // S)
    q, k, v = (torch.randn(B, H, S, D, device=device, dtype=torch.bfloat16) for _ in range(3))
    score = mods.softcap(30.0) if mod == "softcap" else None
    mask = mods.causal if mod == "causal" else None
    return q, k, v, score, mask


def _flops(B, H, S, D, causal):
    return 4 * B * H * S * S * D * ((S + 1) / (2 * S) if causal else 1.0)


def _reference(q, k, v, score, mask, scale):
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if score is not None:
        s = 30.0 * torch.tanh(s / 30.0)
    if mask is not None:
        S = q.shape[2]
        s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v.float(), lse


def main() -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from triton.testing import do_bench_cudagraph

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--mods", default="noop,causal,softcap")
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--other-seqlens", default="4096", help="seqlens for head dims other than 128")
    ap.add_argument("--configs", default=",".join(CANDIDATES))
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    device = torch.device("cuda")
    cap = torch.cuda.get_device_capability()
    torch._dynamo.config.cache_size_limit = 1024  # one compile per case, never eager
    rows, t0 = [], time.time()
    for D in map(int, args.head_dims.split(",")):
        for S in map(int, (args.seqlens if D == 128 else args.other_seqlens).split(",")):
            for mod in args.mods.split(","):
                if time.time() - t0 > args.budget_s:
                    print(f"budget of {args.budget_s}s spent; stopping", flush=True)
                    break
                q, k, v, score, mask = _case(mod, D, S, device)
                B, H = q.shape[:2]
                scale = D ** -0.5
                bm = create_block_mask(mask, None, None, S, S, device=device) if mask else None
                ref, ref_lse = _reference(q, k, v, score, mask, scale)
                fl = _flops(B, H, S, D, mod == "causal")
                tl_score, sbufs = _jit_mod(score, "score") if score else (None, [])
                tl_mask, mbufs = _jit_mod(lambda b, h, qi, ki: mask(b, h, qi, ki), "mask") if mask else (None, [])
                flex = torch.compile(flex_attention, dynamic=False)

                def run_flex():
                    return flex(q, k, v, score_mod=score, block_mask=bm, scale=scale)
                run_flex()  # compile outside the CUDA-graph capture
                torch.cuda.synchronize()
                flex_ms = do_bench_cudagraph(run_flex)
                row_base = dict(mod=mod, head_dim=D, seqlen=S, batch=B, heads=H, dtype="bfloat16")
                rows.append(dict(row_base, impl="flex", config=None, ms=flex_ms, tflops=fl / flex_ms / 1e9))
                for name in args.configs.split(","):
                    spec = CANDIDATES[name]
                    cfg = (generic_config(D, cap) if spec is None else GenericConfig(*spec))
                    if D > 128 and cfg.block_n > 64:
                        continue  # no register room for 128-wide KV tiles at D=256
                    out = torch.empty_like(q)
                    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
                    mx = torch.empty_like(lse)
                    blocks = {}
                    if bm is not None:
                        blocks = dict(kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices,
                                      full_kv_num_blocks=bm.full_kv_num_blocks,
                                      full_kv_indices=bm.full_kv_indices,
                                      sparse_q_block=bm.BLOCK_SIZE[0], sparse_kv_block=bm.BLOCK_SIZE[1])

                    def run():
                        launch_generic(q, k, v, out, lse, mx, sm_scale=scale, score_mod=tl_score,
                                       mask_mod=tl_mask, score_bufs=sbufs, mask_bufs=mbufs,
                                       config=cfg, **blocks)
                    try:
                        run()
                        torch.cuda.synchronize()
                        err = (out.float() - ref).abs().max().item()
                        lse_err = (lse * 0.6931471805599453 - ref_lse).abs().max().item()
                        ok = err < 3e-2 and lse_err < 1e-2
                        ms = do_bench_cudagraph(run) if ok else float("nan")
                        status = "ok" if ok else f"WRONG (max err {err:.3g}, lse err {lse_err:.3g})"
                    except Exception as exc:  # a config that does not compile is a finding, not a crash
                        ms, status = float("nan"), f"failed: {type(exc).__name__}: {str(exc)[:120]}"
                    rows.append(dict(row_base, impl="generic", config=name, cfg=list(cfg.__dict__.values()),
                                     ms=ms, tflops=fl / ms / 1e9 if ms == ms else None, status=status,
                                     vs_flex=flex_ms / ms if ms == ms else None))
                    print(f"D{D} S{S} {mod:8s} {name:12s} {status:4s} "
                          f"{(fl / ms / 1e9) if ms == ms else float('nan'):6.0f} TFLOP/s  "
                          f"flex {fl / flex_ms / 1e9:5.0f}  ratio {flex_ms / ms if ms == ms else float('nan'):.2f}",
                          flush=True)
    name = torch.cuda.get_device_name().replace(" ", "-").lower()
    stamp = dt.datetime.now(dt.timezone.utc)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"generic-sweep-{name}-{stamp:%Y-%m-%d-%H%M}.json")
    import triton
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, date=stamp.isoformat(), rows=rows), f, indent=1)
    print(f"wrote {path}")
    print("\nbest generic config per case (ratio to flex, kernel time under CUDA graphs):")
    cases = sorted({(r["head_dim"], r["seqlen"], r["mod"]) for r in rows})
    for c in cases:
        gen = [r for r in rows if (r["head_dim"], r["seqlen"], r["mod"]) == c and r["impl"] == "generic"
               and r.get("vs_flex")]
        if gen:
            best = max(gen, key=lambda r: r["vs_flex"])
            table = next((r for r in gen if r["config"] == "table"), None)
            print(f"  D{c[0]:<4} S{c[1]:<6} {c[2]:8s} best {best['config']:12s} {best['vs_flex']:.2f}x   "
                  f"table {table['vs_flex'] if table else float('nan'):.2f}x")


if __name__ == "__main__":
    main()
