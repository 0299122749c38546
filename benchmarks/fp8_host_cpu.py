#!/usr/bin/env python3
"""Host cost of a repeated ``fa3_inductor.flex(q, k, v, fp8=True)`` on the CPU, by stage, with every
kernel launch stubbed: where the Python of the FP8 path goes (fp8_host.py times the same on a GPU).

Runs under Triton's interpreter (set here) on tiny CPU tensors. The launches a GPU call re-plays from
runtime/fast_launch.py's cache are replaced by what a cache hit costs before the launch itself: the
launch key built and looked up (the prologue's ``launch_cached``; ``runtime.ops.serve``'s CUDA branch,
its 14-tensor key); the memo's attention launch (``runtime.ops_fp8.bound_fp8_launch``, where the tree
has it) by the relaunch's input tuple. Nothing is computed: the figures are host work only, in µs a
call (the fastest of ``--rounds`` rounds of ``--calls`` calls), on this machine's CPU (slower than a GPU
server's host: compare figures with each other, not with fp8_host.py's).

    python benchmarks/fp8_host_cpu.py [--root TREE]

``--root`` imports ``fa3_inductor`` from another tree (before / after a change).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"


def per_call_us(fn, calls: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return min(times)   # the least disturbed round: a shared, loaded host (CI: 2 cores)


def host_cpu_args(doc: str, calls: int, profiled: str, tokens: int = 0) -> argparse.Namespace:
    """This family of scripts' options (``--root``, ``--calls``, ``--rounds``, ``--profile`` of
    ``profiled``, and ``--tokens`` where ``tokens`` gives its default), parsed, with ``--root`` put
    first on ``sys.path`` (import fa3_inductor after)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--root", default=os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
    ap.add_argument("--calls", type=int, default=calls)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profile", action="store_true", help=f"also print a cProfile of {profiled}")
    if tokens:
        ap.add_argument("--tokens", type=int, default=tokens, help="sequence length of q, k, v")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.root))
    return args


def print_stages(stages: dict, args: argparse.Namespace) -> None:
    """Time each stage (a call after a warm-up call), one line each."""
    for name, fn in stages.items():
        fn()
        print(f"  {name:40s} {per_call_us(fn, args.calls, args.rounds):7.2f} us")


def print_profile(fn, calls: int) -> None:
    """A cProfile of ``calls`` calls of ``fn``, by cumulative time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


def main() -> None:
    args = host_cpu_args(__doc__, 500, "the whole call")
    import torch

    import fa3_inductor
    from fa3_inductor import api, direct, direct_fp8, mods
    from fa3_inductor.fp8_recipe import FP8Recipe
    from fa3_inductor.runtime import ops, ops_fp8
    from fa3_inductor.runtime.fast_launch import aliasing, tensor_signature
    from fa3_inductor.runtime.spec import SiteSpec
    from fa3_inductor.templates.family import Call
    from fa3_inductor.templates.fp8_prologue import host

    torch.set_num_threads(1)
    hits: dict = {}

    def launch_hit(key, inputs, prepare):           # fast_launch.launch_cached's hit, no launch
        tag = hits.get(key)
        return tag if tag is not None else hits.setdefault(key, "prologue")

    def serve_hit(site, call, spec):                 # runtime.ops.serve's CUDA branch, no launch
        fp8 = call.fp8
        inputs = (call.q, call.k, call.v, call.out, call.lse, call.max_scores, *call.tables,
                  *call.score_bufs, *call.mask_bufs,
                  *(() if fp8 is None else (fp8.q_scale, fp8.k_scale, fp8.v_scale, fp8.v_scale_max)))
        key = (ops._launch_key(spec, call.scale, call.sparse_q_block, call.sparse_kv_block,
                               len(call.score_bufs), inputs),
               None if fp8 is None else fp8.recipe, call.needs_max)
        tag = hits.get(key)
        return tag if tag is not None else hits.setdefault(key, "hopper_fp8")

    def bound_hit(spec, call):                       # the memo's attention launch, no launch
        rest = (*call.tables, *call.score_bufs, *call.mask_bufs)

        def fire(ops8, out, lse, row_max):
            (ops8.q, ops8.k, ops8.vt, out, lse, row_max, *rest, ops8.q_scale, ops8.k_scale,
             ops8.v_scale, ops8.v_scale_max)
            return "hopper_fp8"
        return fire

    host.launch_cached = launch_hit
    ops.serve = serve_hit
    has_memo = hasattr(ops_fp8, "bound_fp8_launch")
    if has_memo:
        ops_fp8.bound_fp8_launch = bound_hit

    B, H, HKV, N, D = 1, 4, 2, 256, 128
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, N, D, generator=g).bfloat16()
    k = torch.randn(B, HKV, N, D, generator=g).bfloat16()
    v = torch.randn(B, HKV, N, D, generator=g).bfloat16()
    recipe = FP8Recipe()
    scale = D ** -0.5
    cases = {
        "plain": dict(fp8=True),
        "causal mask_mod": dict(fp8=True, mask_mod=mods.causal),
        "smooth_k, return_lse": dict(fp8=FP8Recipe(smooth_k=True), return_lse=True),
    }
    print(f"tree {fa3_inductor.__file__}; memo {'present' if has_memo else 'absent'}; "
          f"q {tuple(q.shape)} k/v {tuple(k.shape)} bf16, CPU, launches stubbed")
    with torch.no_grad():
        for name, kw in cases.items():
            fn = lambda kw=kw: fa3_inductor.flex(q, k, v, enable_gqa=True, **kw)   # noqa: E731
            for _ in range(3):
                fn()
            print(f"  flex(fp8=...) {name:24s} {per_call_us(fn, args.calls, args.rounds):7.1f} us a call")
        if has_memo:
            print(f"  memo stats: {direct_fp8.stats()}")

        # the full path's stages, one by one (no mask, FP8Recipe())
        block_mask = None
        plan = direct.cached_plan(q, k, v, None, None, None, "auto", fp8=True)
        layout = host.layout_of(q, k, v, recipe, None)
        ops8, inputs = layout.bind(q, k, v, None)
        tables, sq, skv = direct.block_mask_tables(None)
        call = ops_fp8.fp8_call(q, k, v, tables, plan.score_bufs, plan.mask_bufs, scale, sq, skv, recipe)
        spec = plan.spec
        serve_inputs = (call.q, call.k, call.v, call.out, call.lse, call.max_scores, *call.tables,
                        ops8.q_scale, ops8.k_scale, ops8.v_scale, ops8.v_scale_max)

        def checks():
            api._check_inputs(q, k, v, None, None, None, None, True)
            torch.compiler.is_compiling()
            api._needs_grad(q, k, v)
            recipe.check_score_mod(None, "flex")
            api._triton_interpreting()
            api._check_block_mask_fits(block_mask, q, k)

        def call_object():
            lse = q.new_empty((B, H, N), dtype=torch.float32)
            return Call(ops8.q, ops8.k, ops8.vt, ops._out_like(q, v), lse, torch.empty_like(lse), tables,
                        (), (), scale, sq, skv, needs_max=False, fp8=ops8)

        def serve_key():
            return (ops._launch_key(spec, scale, sq, skv, 0, serve_inputs), recipe, False)

        stages = {
            "front door checks (_flex_fp8)": checks,
            "  of which _check_inputs": lambda: api._check_inputs(q, k, v, None, None, None, None, True),
            "FP8Recipe.of(True)": lambda: FP8Recipe.of(True),
            "torch.no_grad() enter/exit": lambda: torch.no_grad().__enter__() or None,
            "plan lookup (direct.cached_plan)": lambda: direct.cached_plan(q, k, v, None, None, None,
                                                                          "auto", fp8=True),
            "block_mask_tables": lambda: direct.block_mask_tables(None),
            "prologue layout_of (key + lookup)": lambda: host.layout_of(q, k, v, recipe, None),
            "prologue bind (allocations)": lambda: layout.bind(q, k, v, None),
            "prologue launch (key hash, stub)": lambda: layout.launch(inputs, ops8),
            "prologue finish (abs_)": lambda: host.finish(ops8),
            "quantize() whole": lambda: host.quantize(q, k, v, recipe),
            "Call construction (+ out, lse, max)": call_object,
            "SiteSpec.from_json(spec)": lambda: SiteSpec.from_json(spec),
            "serve's launch key (14 tensors)": serve_key,
            "  of which tensor_signature": lambda: tensor_signature(serve_inputs),
            "  of which aliasing": lambda: aliasing(serve_inputs),
            "  hash of the key": lambda: hash(serve_key()),
            "record_template": lambda: ops.record_template("hopper_fp8"),
            "lse.mul_(ln 2)": lambda: call.lse.mul_(0.6931471805599453),
            "smooth_k LSE correction": None,
            "direct._signature(q, k, v)": lambda: direct._signature(q, k, v),
        }
        smooth = ops_fp8.fp8_call(q, k, v, tables, [], [], scale, sq, skv, FP8Recipe(smooth_k=True))
        if hasattr(ops_fp8, "smooth_lse"):
            stages["smooth_k LSE correction"] = lambda: ops_fp8.smooth_lse(smooth.fp8, smooth.lse, scale)
        else:
            stages.pop("smooth_k LSE correction")
        print_stages(stages, args)
        if args.profile:
            print_profile(lambda: fa3_inductor.flex(q, k, v, enable_gqa=True, fp8=True), args.calls)


if __name__ == "__main__":
    main()
