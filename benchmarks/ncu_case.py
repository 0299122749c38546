"""One sm90 kernel case, launched a few times, for Nsight Compute (or a quick look at one variant).

    python benchmarks/ncu_case.py --case window --seqlen 8192 [--window 256] [--iters 4] [--set K=V ...]
    ncu --clock-control none --kernel-name regex:fa3_fwd --launch-skip 2 --launch-count 1 --set full \\
        -o rep python benchmarks/ncu_case.py --case softcap

Cases (D=128 by default, bf16, 16 heads, B*S = 16384 as bench.py): noop, softcap (30), causal, window
(a causal window of --window keys), window-blocks (the same KV tiles as full blocks, no mask_mod),
document (lengths uniform in [1, S/2], causal inside, ids read by the mask_mod: as hopper_sched_masks.py). The kernel is launched as the product launches it (max_needed=False),
first checked against float64 on batch 0, head 0 (rel. error printed), then launched --iters more times.
--set K=V overrides Sm90Config fields (as hopper_mods.py: "persistent=off", "num_stages=3").
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fa3_inductor import mods  # noqa: E402
from fa3_inductor.recognition.canonical import dense_block_mask  # noqa: E402
from fa3_inductor.templates.hopper import get_config, launch_fwd_sm90  # noqa: E402

from hopper_mods import config_overrides, gen  # noqa: E402
from hopper_sched_masks import generated_mask, visited_blocks_as_full  # noqa: E402


def case_launch(case: str, S: int, D: int = 128, H: int = 16, window: int = 256, overrides: dict | None = None,
                kv_len: int | None = None):
    """(launch, check, flops, block_flops) for one case: launch() runs the kernel; check() returns O's rel. error
    on (b 0, h 0); flops counts the kept (q, kv) pairs, block_flops every pair of the KV tiles visited.
    kv_len: keys and values of another length than the S queries (no mask then)."""
    B = max(1, 16384 // S)
    N = kv_len or S
    dtype = torch.bfloat16
    q = torch.randn(B, H, S, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(2))
    out = torch.full_like(q, float("nan"))
    lse = torch.empty(B, H, S, device="cuda")
    mx = torch.empty_like(lse)
    qi = torch.arange(S, device="cuda")[:, None]
    ki = torch.arange(N, device="cuda")[None, :]
    score_mod = mask_mod = None
    score_ref = None
    mask_bufs = ()
    keep = None
    if case == "softcap":
        score_ref = mods.softcap(30.0)
        score_mod = gen(score_ref)
    elif case in ("causal", "window", "window-blocks", "document"):
        assert N == S, "masked cases take keys of the queries' length"
        if case == "causal":
            fn = mods.causal
        elif case == "document":
            g = torch.Generator().manual_seed(0)
            lengths = torch.randint(1, S // 2 + 1, (S,), generator=g)
            doc = torch.repeat_interleave(torch.arange(S), lengths)[:S].to(torch.int32).cuda()
            fn = mods.document(doc)
        else:
            fn = mods.sliding_window(window)
        keep = torch.broadcast_to(fn(0, 0, qi, ki), (S, S))
        if case != "window-blocks":
            mask_mod, mask_bufs = generated_mask(fn)
    elif case != "noop":
        raise SystemExit(f"unknown case {case!r}: noop, softcap, causal, window, window-blocks, document")
    sparse = {}
    if keep is not None:
        bm = dense_block_mask(keep, 1, 1, S, S, keep.device)
        sparse = dict(kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices,
                      full_kv_num_blocks=bm.full_kv_num_blocks, full_kv_indices=bm.full_kv_indices)
        if case == "window-blocks":   # every visited tile as a full one
            keep, sparse = visited_blocks_as_full(keep, bm)
    cfg = get_config(D, dtype, **overrides) if overrides else None

    def launch():
        launch_fwd_sm90(q, k, v, out, lse, mx, sm_scale=D ** -0.5, score_mod=score_mod, mask_mod=mask_mod,
                        mask_bufs=mask_bufs, config=cfg, max_needed=False, **sparse)

    def check() -> float:
        s = (q[0, 0].double() @ k[0, 0].double().T) * D ** -0.5
        if score_ref is not None:
            s = score_ref(s, 0, 0, qi, ki)
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        ref = torch.softmax(s, -1) @ v[0, 0].double()
        return ((out[0, 0].double() - ref).norm() / ref.norm()).item()

    pairs = 4 * B * H * S * N * D
    flops = pairs * (keep.double().mean().item() if keep is not None else 1.0)
    block_flops = pairs * (visited_blocks_as_full(keep, bm)[0].double().mean().item() if keep is not None else 1.0)
    return launch, check, flops, block_flops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="noop")
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--kv-len", type=int, default=None, help="keys / values of another length (no mask)")
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--set", nargs="*", default=[])
    args = ap.parse_args()
    torch.manual_seed(0)
    launch, check, _, _ = case_launch(args.case, args.seqlen, args.head_dim, window=args.window,
                                      overrides=config_overrides(args.set), kv_len=args.kv_len)
    launch()
    torch.cuda.synchronize()
    err = check()
    print(f"{args.case} S{args.seqlen} D{args.head_dim} {' '.join(args.set)}: rel. error {err:.2e}"
          + ("" if err <= 1e-2 else "  FAIL"), flush=True)
    for _ in range(args.iters):
        launch()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
