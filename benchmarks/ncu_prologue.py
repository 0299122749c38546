"""The FP8 prologue's launch on one fp8_prologue_bw case, launched a few times, for Nsight Compute.

    python benchmarks/ncu_prologue.py --recipe rope [--head-dim 128] [--seqlen 16384] [--hkv 16] [--iters 3]
    ncu --clock-control none --kernel-name regex:prologue_kernel --launch-skip 2 --launch-count 1 --set full \\
        -o rep-rope python benchmarks/ncu_prologue.py --recipe rope
    PYTHONPATH=$(ls -d /opt/nvidia/nsight-compute/*/extras/python | head -1) \\
        python benchmarks/ncu_summary.py rep-plain.ncu-rep rep-rope.ncu-rep --top 30

(docs/design/fp8_prologue.md's profile: cases plain, rope, and rope --warps 4 --stages 1.) The Gluon
kernel (gluon_sm90.py): --kernel gluon [--gluon-stages S], with --kernel-name regex:prologue_sm90_kernel.

The case and its inputs are fp8_prologue_bw.py's (B = 16384 / N, Hq 16, bf16, RoPE tables bf16 unless
rope-f32); the launch is the product's (the tuned table), or --warps/--stages/--maxnreg for another.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    import torch

    from fa3_inductor.templates.fp8_prologue import host
    from fp8_prologue_bw import HQ, RECIPES, TOKENS, _inputs, _launcher

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", choices=RECIPES, default="rope")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--hkv", type=int, default=16)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warps", type=int)
    p.add_argument("--stages", type=int)
    p.add_argument("--maxnreg", type=int)
    p.add_argument("--kernel", choices=("triton", "gluon"))
    p.add_argument("--gluon-stages", type=int)
    p.add_argument("--programs-per-sm", type=int, help="the Gluon kernel's programs an SM")
    a = p.parse_args()
    case = dict(D=a.head_dim, N=a.seqlen, B=TOKENS // a.seqlen, Hq=HQ, Hkv=a.hkv, recipe=a.recipe)
    q, k, v, recipe, rope = _inputs(case)
    kw = {}
    if a.warps or a.stages or a.maxnreg or a.kernel or a.gluon_stages or a.programs_per_sm:
        kw["tuning"] = host.PrologueTuning(num_warps=a.warps, num_stages=a.stages, maxnreg=a.maxnreg,
                                           kernel=a.kernel, gluon_stages=a.gluon_stages,
                                           programs_per_sm=a.programs_per_sm)
    run = _launcher(host.prepare_prologue(q, k, v, recipe, rope, **kw))
    for _ in range(a.iters):
        run()
    torch.cuda.synchronize()
    print(f"ran {a.iters} x {case}")


if __name__ == "__main__":
    main()
