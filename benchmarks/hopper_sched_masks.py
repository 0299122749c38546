"""Schedule A/B for block-sparse masks on the sm90 kernel: persistent tile pairs against one CTA per tile.

    python benchmarks/hopper_sched_masks.py [--rounds 3] [--seqlens 1024,2048,4096,8192,16384] [--json PATH]
                                            [--window 256] [--masks causal,window,document,noop]
                                            [--blocks-only] [--dims 128 | 192/128]

Masks (D=128 unless `--dims` names q/k's and v's head dims, bf16, 16 heads, B*S = 16384, as benchmarks/bench.py): causal; a causal sliding window of
`--window` keys (256 by default, as bench.py); "noop" (no mask, dense) for the ratio to our own noop; documents (lengths uniform in [1, S/2], causal inside each, the ids read from a buffer by the
mask_mod). The kernel is launched directly with the block mask built from the dense mask (128 x 128
blocks as the lowering builds them, full blocks skip the mask_mod), max_needed=False as the product launches it. Every variant is
first checked against float64 (batch 0, head 0: rel. error of O), then timed with triton's do_bench in
`rounds` interleaved rounds (odd rounds reversed), median reported. TFLOP/s counts only the kept
(q, kv) pairs: 2 * B * H * S^2 * (D + Dv) * density.

`--blocks-only` adds, for each block-sparse mask, a "<mask>-blocks" row: the same KV tiles, all of them
run as full blocks (no mask_mod), which computes the block-level mask (checked against float64 as such)
and is counted at its own (block) density. Its time against the masked row's is what evaluating the mask
on the partial blocks costs; its TFLOP/s against noop's is what the short rows themselves cost.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fa3_inductor import mods  # noqa: E402
from fa3_inductor.recognition.canonical import dense_block_mask  # noqa: E402
from fa3_inductor.templates.hopper import get_config, launch_fwd_sm90  # noqa: E402
from fa3_inductor.templates.modgen import BufferSpec, generate_mod_source, load_mod, trace_mod  # noqa: E402


def generated_mask(fn):
    """A mask_mod generated the product's way (fa3_inductor's mod generator), with its captured buffers."""
    gm, bufs = trace_mod(fn, "mask")
    return load_mod(generate_mod_source(gm, "mask", [BufferSpec.of(t) for t in bufs], "gl"), "gl"), tuple(bufs)


def visited_blocks_as_full(keep, bm):
    """(keep, sparse kwargs) that run every 128 x 128 tile `bm` visits as a full block (no mask_mod): the
    block-level mask of `keep` ([S, S] bool), which is what the kernel then computes."""
    nb = (keep.shape[0] + 127) // 128
    blocks = keep.reshape(nb, 128, nb, 128).any(3).any(1)
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    sparse = dict(kv_num_blocks=torch.zeros_like(bm.kv_num_blocks), kv_indices=torch.zeros_like(bm.kv_indices),
                  full_kv_num_blocks=blocks.sum(-1).to(torch.int32).reshape(bm.full_kv_num_blocks.shape),
                  full_kv_indices=order.reshape(bm.full_kv_indices.shape))
    return blocks.repeat_interleave(128, 0).repeat_interleave(128, 1), sparse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--json", default=None)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--masks", default="causal,window,document")
    ap.add_argument("--blocks-only", action="store_true")
    ap.add_argument("--dims", default="128", help="q/k head dim, or q/k/v as 192/128")
    args = ap.parse_args()
    wanted = args.masks.split(",")
    name = torch.cuda.get_device_name()
    date = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%MZ}"
    print(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}, {date}", flush=True)
    dims = [int(x) for x in args.dims.split("/")]   # "128", or q/k and v: "192/128"
    D, DV = dims[0], dims[-1]
    H, dtype = 16, torch.bfloat16
    rows = []
    for S in (int(x) for x in args.seqlens.split(",")):
        B = max(1, 16384 // S)
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, S, d, device="cuda", dtype=dtype) for d in (D, D, DV))
        out = torch.empty_like(v)
        lse = torch.empty(B, H, S, device="cuda")
        mx = torch.empty_like(lse)
        qi = torch.arange(S, device="cuda")[:, None]
        ki = torch.arange(S, device="cuda")[None, :]
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(1, S // 2 + 1, (S,), generator=g)
        doc = torch.repeat_interleave(torch.arange(S), lengths)[:S].to(torch.int32).cuda()
        masks = [("noop", None, torch.ones(S, S, dtype=torch.bool, device="cuda"), ())]
        for mname, fn in (("causal", mods.causal), (f"window{args.window}", mods.sliding_window(args.window)),
                          ("document", mods.document(doc))):
            mask_mod, bufs = generated_mask(fn)
            masks.append((mname, mask_mod, torch.broadcast_to(fn(0, 0, qi, ki), (S, S)), bufs))
        variants = []
        for mname, mask_mod, keep, bufs in masks:
            if mname.rstrip("0123456789") not in wanted:
                continue
            variants.append((mname, mask_mod, keep, bufs, False))
            if args.blocks_only and mask_mod is not None:
                variants.append((f"{mname}-blocks", None, keep, (), True))
        for mname, mask_mod, keep, bufs, blocks_only in variants:
            density = keep.double().mean().item()
            kvn = kvi = fkvn = fkvi = None
            if mask_mod is not None or blocks_only:
                bm = dense_block_mask(keep, 1, 1, S, S, keep.device)
                kvn, kvi, fkvn, fkvi = bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices
            if blocks_only:   # every visited block as a full one: the block-level mask, no mask_mod
                keep, full = visited_blocks_as_full(keep, bm)
                density = keep.double().mean().item()
                kvn, kvi = full["kv_num_blocks"], full["kv_indices"]
                fkvn, fkvi = full["full_kv_num_blocks"], full["full_kv_indices"]
            s_ref = (q[0, 0].double() @ k[0, 0].double().T) * D ** -0.5
            ref = torch.softmax(s_ref.masked_fill(~keep, float("-inf")), -1) @ v[0, 0].double()
            del s_ref
            launches, checks = {}, {}
            for persistent in (True, False):
                cfg = get_config(D, dtype, value_head_dim=DV, persistent=persistent)

                def launch(cfg=cfg, mask_mod=mask_mod, bufs=bufs, kvn=kvn, kvi=kvi, fkvn=fkvn, fkvi=fkvi):
                    launch_fwd_sm90(q, k, v, out, lse, mx, sm_scale=D ** -0.5, mask_mod=mask_mod, mask_bufs=bufs,
                                    kv_num_blocks=kvn, kv_indices=kvi, full_kv_num_blocks=fkvn,
                                    full_kv_indices=fkvi, config=cfg, max_needed=False)
                out.fill_(float("nan"))
                launch()
                torch.cuda.synchronize()
                err = ((out[0, 0].double() - ref).norm() / ref.norm()).item()
                checks[persistent] = f"rel {err:.2e}" + ("" if err <= 1e-2 else " FAIL")
                launches[persistent] = launch
            times = {p: [] for p in launches}
            order = list(launches)
            for r in range(args.rounds):
                for p in (order if r % 2 == 0 else order[::-1]):
                    times[p].append(triton.testing.do_bench(launches[p], warmup=25, rep=100))
            flops = 2 * B * H * S * S * (D + DV) * density
            for p, ts in times.items():
                ms = sorted(ts)[len(ts) // 2]
                rows.append(dict(seqlen=S, batch=B, head_dims=[D, DV], mask=mname, persistent=p, density=density, ms=ms,
                                 tflops=flops / (ms * 1e-3) / 1e12, ms_rounds=ts, check=checks[p]))
            a, b = (next(r for r in rows[-2:] if r["persistent"] is p) for p in (True, False))
            print(f"S{S:6d} {mname:9s} persistent {a['tflops']:6.1f} | one CTA per tile {b['tflops']:6.1f} "
                  f"(rounds {'/'.join(f'{flops / (t * 1e-3) / 1e12:.0f}' for t in a['ms_rounds'])} | "
                  f"{'/'.join(f'{flops / (t * 1e-3) / 1e12:.0f}' for t in b['ms_rounds'])})  "
                  f"{a['check']} / {b['check']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, torch=torch.__version__, triton=triton.__version__, date=date, rows=rows),
                      f, indent=1)


if __name__ == "__main__":
    main()
