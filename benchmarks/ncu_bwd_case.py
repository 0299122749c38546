"""One Hopper backward case (templates/hopper_bwd), launched as the product launches it, for Nsight Compute.

    python benchmarks/ncu_bwd_case.py --case noop --head-dim 64 --seqlen 4096 [--iters 4] [--schedule m128] [--set K=V]
    python benchmarks/ncu_bwd_case.py --case causal --head-dim 64 --dry-run     # CPU: the plan, no GPU
    ncu --clock-control none --kernel-name fa3_bwd_sm90_kernel --launch-skip 2 --launch-count 1 --set full \\
        -o rep python benchmarks/ncu_bwd_case.py --case noop --head-dim 64 --iters 2

Shapes as benchmarks/bwd_speed.py: B * S = 16384 tokens, H 16, bf16, head dims 64 / 128 (256, or 192 with
--value-head-dim 128). Cases are bwd_speed's variants (noop, causal, softcap, alibi, sliding_window, document), with
its mods and block masks (bwd_speed._our_options), so the kernels are the benchmark's. Our Hopper forward makes out and
the LSE; then the three backward launches of host.prepare_hopper_backward (preprocess, main, dQ convert) run once and
dq / dk / dv of (batch 0, head 0) are checked against float64 autograd; then --iters more backwards. The main kernel is
launched 1 + --iters times, so `--launch-skip 2` with --iters 2 profiles the last. Without --schedule / --set the
host picks the config (get_bwd_config by what the launch has); --schedule NAME applies configs.VARIANTS[NAME] over
that row, --set K=V overrides BwdSm90Config fields ("num_stages=3", "overlap=0", "dq_tma=off").

--dry-run plans the case on CPU tensors (no compile, no launch) and prints the main kernel's name, grid and schedule:
benchmarks/ncu_bwd_cases.sh reads the name from it for ncu's exact kernel filter.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch

_BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_BENCHMARKS)
for _path in (_REPO, _BENCHMARKS):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from bwd_speed import VARIANTS as CASES, _mask_mod, _our_options, _score_mod  # noqa: E402

from fa3_inductor.templates.hopper_bwd import get_bwd_config, prepare_hopper_backward  # noqa: E402
from fa3_inductor.templates.hopper_bwd.configs import VARIANTS as SCHEDULES  # noqa: E402
from fa3_inductor.templates.hopper_bwd.host import launch_traits  # noqa: E402

TOKENS = 16384
HEADS = 16
# bf16 against float64 (tests/reference.TOLERANCE)
TOLERANCE = 2e-2


@dataclass
class BwdCase:
    """A planned case: its tensors, the forward launch (None when planned on the CPU) and the backward's three
    launches, each (kernel, args, kwargs, grid)."""
    name: str
    tensors: dict
    forward: tuple | None
    backward: list
    scale: float

    @property
    def main(self) -> tuple:
        return self.backward[1]

    @property
    def main_kernel_name(self) -> str:
        """The main kernel's Python name, which is its name in the cubin (and ncu's --kernel-name)."""
        kernel = self.main[0]
        return getattr(kernel, "__name__", None) or kernel.fn.__name__


def parse_overrides(words: list[str]) -> dict:
    """BwdSm90Config field overrides from "K=V" words: on / off are booleans, the rest integers.

    Example::

        >>> parse_overrides(["num_stages=3", "dq_tma=off"])
        {'num_stages': 3, 'dq_tma': False}
    """
    out = {}
    for word in words:
        key, _, val = word.partition("=")
        out[key] = {"on": True, "off": False}[val] if val in ("on", "off") else int(val)
    return out


def plan_case(case: str, seqlen: int, head_dim: int = 64, value_head_dim: int | None = None, heads: int = HEADS,
              tokens: int = TOKENS, device: str = "cuda", schedule: str | None = None,
              overrides: dict | None = None) -> BwdCase:
    """The case's tensors and launches, prepared as bwd_speed prepares them (nothing is launched). On "cpu" the
    tensors are left uninitialised: the plan (kernels, grids, schedules, CTA lists) is the GPU's, for a dry run.

    Example::

        >>> c = plan_case("noop", 1024, 64, device="cpu", tokens=2048, heads=2)
        >>> c.main_kernel_name, c.main[3]
        ('fa3_bwd_sm90_kernel', (8, 4))
    """
    from fa3_inductor.templates.hopper import prepare_fwd_sm90

    if case not in CASES:
        raise SystemExit(f"unknown case {case!r}: {', '.join(CASES)}")
    dv = value_head_dim or head_dim
    batch = max(1, tokens // seqlen)
    make = torch.randn if device != "cpu" else torch.empty
    qk_shape, v_shape = (batch, heads, seqlen, head_dim), (batch, heads, seqlen, dv)
    t = {n: make(shape, device=device, dtype=torch.bfloat16)
         for n, shape in (("q", qk_shape), ("k", qk_shape), ("v", v_shape), ("dout", v_shape))}
    t.update(out=torch.empty_like(t["v"]), lse=torch.empty(qk_shape[:3], device=device),
             mx=torch.empty(qk_shape[:3], device=device),
             dq=torch.empty_like(t["q"]), dk=torch.empty_like(t["k"]), dv=torch.empty_like(t["v"]))
    scale = head_dim ** -0.5
    fwd_opts, bwd_opts = _our_options(case, heads, seqlen, seqlen, "gl", device=device)
    if schedule or overrides:   # the named schedule / fields over the row the host would pick (as bwd_speed does)
        traits = launch_traits(bwd_opts.get("score_mod"), bwd_opts.get("score_grad_mod"), bwd_opts.get("mask_mod"),
                               "kv_num_blocks" in bwd_opts, seqlen)
        bwd_opts["config"] = get_bwd_config(head_dim, dv, **traits, **SCHEDULES[schedule or "default"],
                                            **(overrides or {}))
    # the forward's plan asks the GPU for its SM count: a dry run plans the backward only
    forward = None if device == "cpu" else prepare_fwd_sm90(t["q"], t["k"], t["v"], t["out"], t["lse"], t["mx"],
                                                            sm_scale=scale, **fwd_opts)
    backward = prepare_hopper_backward(t["q"], t["k"], t["v"], t["out"], t["dout"], t["lse"], t["dq"], t["dk"],
                                       t["dv"], sm_scale=scale, **bwd_opts)
    return BwdCase(case, t, forward, backward, scale)


def run(launches) -> None:
    """Launch (kernel, args, kwargs, grid) tuples in order. Example: ``run(plan_case("noop", 4096).backward)``."""
    for kernel, args, kwargs, grid in launches:
        kernel[grid](*args, **kwargs)


def check(c: BwdCase) -> dict:
    """Relative errors of dq, dk, dv on (batch 0, head 0) against float64 autograd with the case's mods; the
    backward must have run. Example: ``check(c)`` -> ``{'dq': 3.1e-3, 'dk': 2.9e-3, 'dv': 2.2e-3}``."""
    sys.path.insert(0, os.path.join(_REPO, "tests"))
    from reference import reference_gradients, rel_error

    t = c.tensors
    one = {n: t[n][:1, :1] for n in ("q", "k", "v", "dout")}
    seqlen = one["k"].shape[2]
    _, dq, dk, dv, _ = reference_gradients(one["q"], one["k"], one["v"], one["dout"],
                                           _score_mod(c.name, t["q"].shape[1]),
                                           _mask_mod(c.name, seqlen, t["q"].device), c.scale)
    return {n: rel_error(t[n][:1, :1], ref) for n, ref in (("dq", dq), ("dk", dk), ("dv", dv))}


def describe(c: BwdCase) -> str:
    """One line: the main kernel, its grid and its schedule constants (what ncu's report will be of).

    Example::

        >>> describe(plan_case("alibi", 1024, 64, device="cpu", tokens=2048, heads=2))
        'main kernel fa3_bwd_sm90_m128_kernel grid (8, 4) tile M128Tile(HEAD_D=64, NUM_STAGES=2)'
    """
    _, args, kwargs, grid = c.main
    sched = kwargs.get("SCHED")
    return (f"main kernel {c.main_kernel_name} grid {tuple(grid)} tile {kwargs['TILE']}"
            + (f" sched {sched}" if sched is not None else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="noop", choices=CASES)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--value-head-dim", type=int, default=None, help="V's head dim (192 takes 128); default D")
    ap.add_argument("--heads", type=int, default=HEADS)
    ap.add_argument("--tokens", type=int, default=TOKENS, help="B * S")
    ap.add_argument("--iters", type=int, default=4, help="backwards launched after the checked one")
    ap.add_argument("--schedule", default=None, choices=sorted(SCHEDULES), help="a configs.VARIANTS name")
    ap.add_argument("--set", nargs="*", default=[], help="BwdSm90Config overrides, K=V")
    ap.add_argument("--dry-run", action="store_true", help="plan on the CPU and print the main launch; no GPU")
    args = ap.parse_args()
    label = (f"{args.case} S{args.seqlen} D{args.head_dim}"
             + (f"/{args.value_head_dim}" if args.value_head_dim else "")
             + (f" schedule {args.schedule}" if args.schedule else "") + "".join(f" {w}" for w in args.set))
    torch.manual_seed(0)
    c = plan_case(args.case, args.seqlen, args.head_dim, args.value_head_dim, args.heads, args.tokens,
                  "cpu" if args.dry_run else "cuda", args.schedule, parse_overrides(args.set))
    print(f"{label}: {describe(c)}", flush=True)
    if args.dry_run:
        return
    run([c.forward])
    run(c.backward)
    torch.cuda.synchronize()
    errors = check(c)
    torch.cuda.empty_cache()   # the float64 reference's memory: ncu saves and restores what is allocated, each pass
    worst = max(errors.values())
    print(f"{label}: rel. error " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items())
          + ("" if worst <= TOLERANCE else "  FAIL"), flush=True)
    for _ in range(args.iters):
        run(c.backward)
    torch.cuda.synchronize()
    if worst > TOLERANCE:
        sys.exit(1)


if __name__ == "__main__":
    main()
