#!/usr/bin/env python3
"""Host cost of our two ops as benchmarks/train_small.py's compiled training step calls them, on the CPU
with the H200's launch-cache hits emulated (benchmarks/sm90_emulation.py: the Hopper families chosen,
launches recorded from their real arguments, the C launch stubbed).

The layers' tensors have train_small's layouts and sizes (B8 H8 S2048 D64 bf16: q, k contiguous, v a
view of the fused QKV output, dO (B, S, H, D) storage; a causal block mask at 128x128), and the specs are
planned as on the H200. A step calls ``torch.ops.fa3_inductor.flex_fwd.default`` over ``--layers`` layers,
then ``torch.ops.fa3_inductor.flex_bwd.families`` over them in reverse, as Inductor's generated call()
does; µs a call are the fastest of ``--rounds`` rounds of ``--steps`` steps. Then each op's steps alone
(the dispatch, the allocations, the spec, the key, the relaunch), fast_launch's counters per call and, with
``--profile``, a cProfile of the ops' calls.

    python benchmarks/train_ops_host_cpu.py [--root TREE] [--layers 8] [--profile]

``--root`` imports ``fa3_inductor`` from another tree (before / after a change). Figures are this
machine's CPU, slower than a GPU server's host: compare them with each other.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"


def per_call_us(fn, calls: int, rounds: int, per: int = 1) -> float:
    """Fastest round's µs per call of ``fn`` (``per``: calls of the op inside one ``fn``)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / (calls * per) * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.root))
    sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    import fa3_inductor
    from fa3_inductor import mods
    from fa3_inductor.runtime import fast_launch, ops
    from sm90_emulation import emulated_sm90, train_small_layouts, train_small_specs

    torch.set_num_threads(1)
    B, H, S, D = 8, 8, 2048, 64
    bm = create_block_mask(mods.causal, None, None, S, S, device="cpu")
    tables = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
    q_tables = (bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices)
    fwd, bwd = torch.ops.fa3_inductor.flex_fwd.default, torch.ops.fa3_inductor.flex_bwd.families
    scale = D ** -0.5
    with emulated_sm90(), torch.no_grad():
        layers = [train_small_layouts(B, H, S, D) for _ in range(args.layers)]
        fwd_spec, bwd_spec = train_small_specs(layers[0]["q"])

        def f(t):
            return fwd(t["q"], t["k"], t["v"], *tables, [], [], scale, 128, 128, fwd_spec)

        def b(t, out, lse):
            return bwd(t["q"], t["k"], t["v"], out, lse, t["dout"], None, *tables, *q_tables, [], [],
                       scale, 128, 128, bwd_spec)

        def forward_all():
            return [f(t) for t in layers]

        def backward_all(saved):
            for t, (out, lse, _) in zip(reversed(layers), reversed(saved)):
                b(t, out, lse)

        from fa3_inductor.runtime.ops_bwd import last_backward_family

        first = layers[0]
        o, l, _ = f(first)
        fwd_tag = ops.last_template()
        b(first, o, l)
        bwd_tag = last_backward_family()
        if (fwd_tag, bwd_tag) != ("hopper", "hopper_bwd"):   # anything else computes, for minutes
            sys.exit(f"the emulation did not choose the Hopper families: {fwd_tag}, {bwd_tag}")
        saved = forward_all()
        backward_all(saved)
        before = fast_launch.stats()
        for _ in range(3):
            backward_all(forward_all())
        calls = 3 * 2 * args.layers
        counters = {k: (v - before[k]) / calls for k, v in fast_launch.stats().items()}
        print(f"tree {fa3_inductor.__file__}; torch {torch.__version__}; CPU, launches stubbed (sm90 emulated); "
              f"B{B} H{H} S{S} D{D} bf16, {args.layers} layers; forward {fwd_tag}, backward {bwd_tag}")
        print(f"  fast_launch per op call: {counters}")
        one = layers[0]
        out, lse, _ = saved[0]
        rows = {
            "forward op (torch.ops, a layer each)": per_call_us(forward_all, args.steps, args.rounds, args.layers),
            "backward op (torch.ops, a layer each)": per_call_us(lambda: backward_all(saved), args.steps,
                                                                 args.rounds, args.layers),
            "forward op (torch.ops, one layer repeated)": per_call_us(lambda: f(one), args.steps, args.rounds),
            "backward op (torch.ops, one layer repeated)": per_call_us(lambda: b(one, out, lse), args.steps,
                                                                      args.rounds),
            "forward body (ops.flex_fwd, no dispatch)": per_call_us(
                lambda: ops.flex_fwd(one["q"], one["k"], one["v"], *tables, [], [], scale, 128, 128, fwd_spec),
                args.steps, args.rounds),
        }
        from fa3_inductor.runtime import ops_bwd

        rows["backward body (ops_bwd.flex_bwd_families, no dispatch)"] = per_call_us(
            lambda: ops_bwd.flex_bwd_families(one["q"], one["k"], one["v"], out, lse, one["dout"], None,
                                              *tables, *q_tables, [], [], scale, 128, 128, bwd_spec),
            args.steps, args.rounds)
        rows.update(dispatch_floor(one, out, lse, tables, q_tables, scale, fwd_spec, bwd_spec, args))
        rows.update(stages(one, out, lse, tables, q_tables, scale, fwd_spec, bwd_spec, args))
        for name, us in rows.items():
            print(f"  {name:58s} {us:7.2f} us")
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                backward_all(forward_all())
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def dispatch_floor(one, out, lse, tables, q_tables, scale, fwd_spec, bwd_spec, args) -> dict:
    """µs a call of ops with our two ops' schemas whose Python kernels return at once (outputs made
    beforehand): what ``torch.ops`` costs these arguments before and after our Python runs."""
    import torch

    lib = torch.library.Library("fa3_host_floor", "DEF")
    results = {}
    for name, op in (("flex_fwd", torch.ops.fa3_inductor.flex_fwd.default),
                     ("flex_bwd", torch.ops.fa3_inductor.flex_bwd.families)):
        schema = str(op._schema).split("(", 1)[1]
        lib.define(f"{name}({schema}")
    made_fwd = (torch.empty_like(one["q"]), lse, torch.empty_like(lse))
    made_bwd = (torch.empty_like(one["q"]), torch.empty_like(one["k"]), torch.empty_like(one["v"]), [])
    lib.impl("flex_fwd", lambda *a: made_fwd, "CPU")
    lib.impl("flex_bwd", lambda *a: made_bwd, "CPU")
    fwd, bwd = torch.ops.fa3_host_floor.flex_fwd.default, torch.ops.fa3_host_floor.flex_bwd.default
    results["dispatch alone, forward schema (Python kernel returns)"] = per_call_us(
        lambda: fwd(one["q"], one["k"], one["v"], *tables, [], [], scale, 128, 128, fwd_spec),
        args.steps * 4, args.rounds)
    results["dispatch alone, backward schema (Python kernel returns)"] = per_call_us(
        lambda: bwd(one["q"], one["k"], one["v"], out, lse, one["dout"], None, *tables, *q_tables, [], [],
                    scale, 128, 128, bwd_spec), args.steps * 4, args.rounds)
    return results


def stages(one, out, lse, tables, q_tables, scale, fwd_spec, bwd_spec, args) -> dict:
    """Each op's steps alone, µs a call (what they are in the tree at hand: older trees lack some)."""
    import torch

    from fa3_inductor.runtime import fast_launch, ops
    from fa3_inductor.runtime.ops_bwd import BackwardSiteSpec
    from fa3_inductor.runtime.spec import SiteSpec

    q, k, v, dout = one["q"], one["k"], one["v"], one["dout"]
    Z, H, M, _ = q.shape
    outs = (ops._out_like(q, v), q.new_empty((Z, H, M), dtype=torch.float32),
            q.new_empty((Z, H, M), dtype=torch.float32))
    inputs = (q, k, v, *outs, *tables)
    if hasattr(ops, "_op_key"):   # the key over the given tensors only (after host-ops)
        key_of = lambda: ops._op_key(fwd_spec, scale, 128, 128, 0, (q, k, v, *tables))   # noqa: E731
    else:
        key_of = lambda: ops._launch_key(fwd_spec, scale, 128, 128, 0, inputs)   # noqa: E731
    key = key_of()
    entry = next(e for e in fast_launch._CACHE.values() if e.tag == "hopper")
    bwd_tensors = (q, k, v, out, dout, lse, None, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                   *tables, *q_tables)
    fns = {
        "fwd: outputs (_out_like + 2 new_empty)": lambda: (ops._out_like(q, v), q.new_empty((Z, H, M), dtype=torch.float32),
                                                          q.new_empty((Z, H, M), dtype=torch.float32)),
        "fwd: SiteSpec.from_json (cached)": lambda: SiteSpec.from_json(fwd_spec),
        "fwd: launch key": key_of,
        "  tensor_signature of 10 tensors": lambda: fast_launch.tensor_signature(inputs),
        "  aliasing of 10 tensors": lambda: fast_launch.aliasing(inputs),
        "fwd: a dict lookup of the key": lambda: fast_launch._CACHE.get(key),
        "fwd: fast_launch.relaunch (C launch stubbed)": lambda: fast_launch.relaunch(entry, inputs),
        "bwd: outputs (3 torch.empty)": lambda: [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)],
        "bwd: BackwardSiteSpec.from_json (cached)": lambda: BackwardSiteSpec.from_json(bwd_spec),
        "bwd: tensor_signature (18 tensors)": lambda: fast_launch.tensor_signature(bwd_tensors),
        "torch.empty_like(q)": lambda: torch.empty_like(q),
    }
    return {name: per_call_us(fn, args.steps * 4, args.rounds) for name, fn in fns.items()}


if __name__ == "__main__":
    main()
