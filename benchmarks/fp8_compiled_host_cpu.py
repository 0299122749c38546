#!/usr/bin/env python3
"""Host cost of one call of the op a compiled FP8 model runs per layer
(``torch.ops.fa3_inductor.flex_fwd_fp8_rope``, recognition/rope_fusion.py) against the bf16 op
(``torch.ops.fa3_inductor.flex_fwd``), on the CPU, with every kernel launch emulated.

Issue 18: SmolLM2-135M compiled with ``options={"fa3.fp8": True}`` took 5-11 ms a forward more host
time than bf16 ``backend="fa3"`` (30 layers). This times the two ops at its shape (q [1, 9, 4096, 64],
k / v [1, 3, 4096, 64] bf16, causal block mask, cos / sin [4096, 64] bf16 as the fused graph passes
them) through the dispatcher, as Inductor's output code calls them.

What is emulated (Triton's interpreter is on, set here; tensors are on the CPU):

- runtime/fast_launch.py's recording is the real one (``_record``, ``_DirectArgs``), over a stand-in
  compiled kernel whose C launcher does nothing: a hit runs the real ``_relaunch`` / ``_launch_direct``
  (argument-list key, per-address tuples, descriptor encodings), only the launch itself is gone;
- ``runtime.ops.serve``'s and ``flex_fwd``'s CUDA branch (launch key, ``recorded``, relaunch) is taken
  on CPU tensors (``_is_cuda`` below), so the attention launch of the second and later calls is a
  recorded relaunch, as on a GPU. The first call prepares the CPU plan's family (the generic kernels:
  the Hopper ones need an sm90 GPU), whose argument list is a little shorter than the Hopper kernel's.

Per call it prints µs (the fastest of ``--rounds`` rounds of ``--calls`` calls), the torch ops a call
runs beside the two launches (on CUDA a ``fill_`` / ``abs_`` / ``zero_`` would be one more launch each;
allocations are not launches; a replay runs one ``zero_`` every ops_fp8._RING calls), and with ``--profile`` a cProfile of the FP8 op. CPU figures: compare the two ops
with each other, not with a GPU server's host.

    python benchmarks/fp8_compiled_host_cpu.py [--root TREE] [--profile]
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fp8_host_cpu import host_cpu_args, print_profile  # noqa: E402


def per_call_us(fn, calls: int, rounds: int) -> float:
    """The median of ``calls * rounds`` single calls, in µs: robust to the preemptions of a loaded
    2-core host (fp8_host_cpu.per_call_us's round means caught 5-13 ms stalls there)."""
    import statistics
    import time

    times = []
    for _ in range(calls * rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


class _FakeKernel:
    """A compiled kernel's stand-in: fast_launch reads ``function`` and ``packed_metadata``."""

    function = 0
    packed_metadata = None
    run = None


class _FakeDirect:
    """_compat.CLauncher's stand-in: every TMA descriptor argument encodes to 1 + 2 x rank ints, and the
    launch does nothing."""

    cooperative = False
    pdl = False

    def __init__(self, descriptor_positions):
        self.descriptor_meta = {pos: {} for pos in descriptor_positions}

    @staticmethod
    def expand(desc, meta):
        return (0,) * (1 + 2 * len(desc.block_shape))

    def launch(self, *args):
        return None


class _Params:
    """An interpreted kernel's parameters as ``JITFunction.params`` lists them (fast_launch._record)."""

    def __init__(self, jit_fn):
        import inspect

        self.params = [_Param(p) for p in inspect.signature(jit_fn.fn).parameters.values()]


class _Param:
    def __init__(self, p):
        import inspect

        self.name, self.has_default, self.default = (p.name, p.default is not inspect.Parameter.empty,
                                                     p.default)


def _with_params(jit_fn):
    return jit_fn if hasattr(jit_fn, "params") else _Params(jit_fn)


def emulate_gpu_launches(setattr_=setattr) -> dict:
    """Make CPU calls of the FP8 and bf16 ops take their CUDA paths with launches emulated (module
    docstring); ``setattr_``: how to patch (pytest's ``monkeypatch.setattr`` in tests). Returns the
    counter of launches prepared (first launches of a key)."""
    from fa3_inductor.runtime import fast_launch, ops, ops_fp8
    from fa3_inductor.templates.fp8_prologue import host

    counts = install_emulation(fast_launch, [ops, host, ops_fp8], setattr_)

    # serve()'s CUDA branch on CPU tensors (the branch reads q.is_cuda): this tree's, copied
    def serve_cuda(site, call, spec):
        key, inputs = ops.serve_key(spec, call)
        entry = fast_launch.recorded(key)
        if entry is not None:
            return fast_launch.relaunch(entry, inputs)
        return ops._relaunched(key, inputs) or ops._serve(site, call, key, inputs)

    setattr_(ops, "serve", serve_cuda)
    setattr_(ops, "_serve", _first_launch(ops, fast_launch))
    if hasattr(ops_fp8, "_records_launches"):   # the compiled ops' memo (issue 18) keys CUDA calls only
        setattr_(ops_fp8, "_records_launches", lambda t: True)
    return counts


def install_emulation(fast_launch, modules, setattr_=setattr) -> dict:
    """Replace ``launch_cached`` in fast_launch and in ``modules`` (which imported it by name) by one
    that records over the stand-in kernel; returns counters of first launches."""
    from fa3_inductor.runtime.fast_launch import _CACHE, _DirectArgs, _Launch, _record, _relaunch, _Uncacheable

    counts = {"prepared": 0}
    setattr_(fast_launch, "_get_stream", lambda device: 0)

    def launch_cached(key, inputs, prepare):
        entry = _CACHE.get(key)
        if entry is not None and entry.kernel is not None:
            _relaunch(entry, inputs)
            return entry.tag
        counts["prepared"] += 1
        jit_fn, args, kwargs, grid, tag = prepare()
        if entry is not None:
            return tag
        try:
            recipe = _record(_with_params(jit_fn), args, kwargs, inputs)
        except _Uncacheable:
            _CACHE[key] = _Launch(None, (1, 1, 1), (), (), tag)
            return tag
        grid = tuple(grid) + (1,) * (3 - len(grid))
        constants = tuple(step[1] if step[0] == "const" else None for step in recipe)
        slots = tuple((pos, step) for pos, step in enumerate(recipe) if step[0] != "const")
        direct = _FakeDirect([pos for pos, step in enumerate(recipe) if step[0] == "descriptor"])
        encoded: dict = {}
        kernel = _FakeKernel()
        direct_args = _DirectArgs.of(kernel, grid, recipe, direct, inputs, encoded)
        _CACHE[key] = _Launch(kernel, grid, constants, slots, tag, direct, encoded, direct_args, 0)
        return tag

    setattr_(fast_launch, "launch_cached", launch_cached)
    for module in modules:
        if hasattr(module, "launch_cached"):
            setattr_(module, "launch_cached", launch_cached)
    return counts


def main() -> None:
    args = host_cpu_args(__doc__, 300, "the FP8 op", tokens=4096)
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    import fa3_inductor
    from fa3_inductor import direct, mods
    from fa3_inductor.fp8_recipe import FP8Recipe
    from fa3_inductor.runtime import fast_launch, ops, ops_fp8
    from fa3_inductor.runtime.spec import SiteSpec
    from fa3_inductor.templates.fp8_prologue import host

    torch.set_num_threads(1)
    counts = emulate_gpu_launches()

    B, H, HKV, N, D = 1, 9, 3, args.tokens, 64
    g = torch.Generator().manual_seed(0)
    # as the output code passes them: views of the projections' [B, S, H, D] outputs
    q = torch.randn(B, N, H, D, generator=g).bfloat16().transpose(1, 2)
    k = torch.randn(B, N, HKV, D, generator=g).bfloat16().transpose(1, 2)
    v = torch.randn(B, N, HKV, D, generator=g).bfloat16().transpose(1, 2)
    angles = torch.arange(N, dtype=torch.float32)[:, None] * torch.rand(D // 2, generator=g)
    angles = torch.cat([angles, angles], -1)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    bm = create_block_mask(mods.causal, None, None, N, N, device="cpu")
    tables, sq, skv = direct.block_mask_tables(bm)
    scale = D ** -0.5
    recipe = ops_fp8.recipe_text(FP8Recipe())
    plan8 = direct.cached_plan(q, k, v, None, mods.causal, bm, "auto", fp8=True)
    plan16 = direct.cached_plan(q, k, v, None, mods.causal, bm, "auto")
    print(f"tree {fa3_inductor.__file__}\nq {tuple(q.shape)} k/v {tuple(k.shape)} bf16 causal, "
          f"cos/sin {tuple(cos.shape)}; CPU, launches emulated (fast_launch recording real)")
    spec8, spec16 = plan8.spec, plan16.spec   # the plan's JSON text, as the output code carries it
    print(f"  FP8 families {SiteSpec.from_json(spec8).families}, "
          f"bf16 families {SiteSpec.from_json(spec16).families}")

    fp8_op = torch.ops.fa3_inductor.flex_fwd_fp8_rope.default
    bf16_op = torch.ops.fa3_inductor.flex_fwd.default

    def fp8_call():
        return fp8_op(q, k, v, cos, sin, "half", *tables, [], [], scale, sq, skv, spec8, recipe)

    def bf16_call():
        return bf16_op(q, k, v, *tables, [], [], scale, sq, skv, spec16)

    # flex_fwd reads q.is_cuda too: time its CUDA branch by the same copy where the tree has no hook
    with torch.no_grad():
        for name, fn in (("fp8 op (flex_fwd_fp8_rope)", fp8_call),):
            for _ in range(3):
                fn()
            before = dict(counts)
            us = per_call_us(fn, args.calls, args.rounds)
            print(f"  {name:34s} {us:7.1f} us a call  (first launches prepared after warm-up: "
                  f"{counts['prepared'] - before['prepared']})")
        bf16 = _bf16_cuda_branch(ops, fast_launch, q, k, v, tables, sq, skv, scale, spec16, plan16)
        for _ in range(3):
            bf16()
        print(f"  {'bf16 op (flex_fwd, CUDA branch)':34s} {per_call_us(bf16, args.calls, args.rounds):7.1f} us a call")
        import gc
        gc.disable()
        print(f"  {'fp8 op, gc disabled':34s} {per_call_us(fp8_call, args.calls, args.rounds):7.1f} us a call")
        print(f"  {'bf16 op, gc disabled':34s} {per_call_us(bf16, args.calls, args.rounds):7.1f} us a call")
        gc.enable()
        direct_fp8_op = (ops_fp8.flex_fwd_fp8_rope, (q, k, v, cos, sin, "half", *tables, [], [], scale, sq,
                                                     skv, spec8, recipe))
        print(f"  torch ops a FP8 call runs: {_torch_ops(lambda: direct_fp8_op[0](*direct_fp8_op[1]))}")
        if hasattr(ops_fp8, "stats"):
            print(f"  compiled-op memo: {ops_fp8.stats()}")
        print(f"  fast_launch stats: {fast_launch.stats()}")
        if args.profile:
            print_profile(fp8_call, args.calls)


def _first_launch(ops, fast_launch):
    """runtime.ops._serve on a launch-cache miss, as on a GPU: the family's launch prepared (the
    generic kernel, FP8 or bf16: on CPU tensors those families compute the call themselves under the
    interpreter, which is not what a GPU does) and recorded, not run."""
    from fa3_inductor.templates.fp8 import family as fp8_family
    from fa3_inductor.templates.generic.host import prepare_generic_variants

    def serve(site, call, key, inputs):
        mine = ops.call_for(site, call, "tl")
        o = call.fp8
        if o is not None:
            launch, _ = prepare_generic_variants(o.q, o.k, o.vt, *mine.outputs(), fp8=o,
                                                 config=fp8_family._config(o), **mine.kernel_options("tl"))
        else:
            launch, _ = prepare_generic_variants(call.q, call.k, call.v, *mine.outputs(),
                                                 **mine.kernel_options("tl"))
        name = "fp8" if o is not None else "generic"
        return fast_launch.launch_cached(key, inputs, lambda: (*launch, name))

    return serve


def _bf16_cuda_branch(ops, fast_launch, q, k, v, tables, sq, skv, scale, spec, plan):
    """flex_fwd's body with its CUDA branch taken (a copy: the op checks q.is_cuda): the bf16 op's
    host work on a launch-cache hit, beside the dispatcher's cost of a Python op (one call of a
    trivial op through the same dispatcher is added: see _dispatch_cost)."""
    import torch

    from fa3_inductor.runtime.spec import SiteSpec
    from fa3_inductor.templates.family import Call

    def body():
        Z, H, M, _ = q.shape
        out = ops._out_like(q, v)
        lse = q.new_empty((Z, H, M), dtype=torch.float32)
        max_scores = q.new_empty((Z, H, M), dtype=torch.float32)
        sparse_q_block = ops._one_block_size(sq, M)
        sparse_kv_block = ops._one_block_size(skv, k.shape[2])
        site = SiteSpec.from_json(spec)
        inputs = (q, k, v, out, lse, max_scores, *tables)
        key = ops._launch_key(spec, scale, sparse_q_block, sparse_kv_block, 0, inputs)
        entry = fast_launch.recorded(key)
        if entry is not None:
            ops.record_template(fast_launch.relaunch(entry, inputs))
            return out, lse, max_scores
        call = Call(q, k, v, out, lse, max_scores, tables, (), (), scale, sparse_q_block, sparse_kv_block,
                    site.needs_max)
        ops.record_template(ops._serve(site, call, key, inputs))
        return out, lse, max_scores

    noop = _dispatch_cost()

    def call():
        noop(q, k, v, *tables, [], [], scale, sq, skv, spec)
        return body()

    return call


_NOOP = None


def _dispatch_cost():
    """A Python op of flex_fwd's schema that returns its q: the dispatcher's share of a call."""
    global _NOOP
    if _NOOP is None:
        import torch

        lib = torch.library.Library("fa3_host_emulation", "DEF")
        lib.define("noop(Tensor q, Tensor k, Tensor v, Tensor? a, Tensor? b, Tensor? c, Tensor? d, "
                   "Tensor[] s, Tensor[] m, float scale, int sq, int skv, str spec) -> Tensor")
        lib.impl("noop", lambda q, *rest: q, "CPU")
        _NOOP = (lib, torch.ops.fa3_host_emulation.noop.default)
    return _NOOP[1]


def _torch_ops(fn) -> list:
    """The aten ops one call of ``fn`` runs (TorchDispatchMode), in order, allocations included."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    with Log():
        fn()
    return seen


if __name__ == "__main__":
    main()
