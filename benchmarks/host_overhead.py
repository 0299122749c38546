"""Host cost per attention call: where the microseconds go before the GPU sees the kernel.

A tiny problem (B1 H1 S128 D128 bf16: a few µs of GPU work) is called N times back to back with
no synchronisation inside the loop, so the wall time per call is the host's cost. Each layer of
our path is timed on its own, next to torch's compiled FlexAttention and cuDNN SDPA, then
cProfile lists the most expensive functions of the full `fa3_inductor.flex` call. Last, each step of a
repeated call's memo path (direct.replay -> runtime/ops.bound_launch -> runtime/fast_launch) is timed
alone, beside one plain Triton launch and the C launcher with its argument tuple prebuilt: the floor.
The backward op (``flex_bwd.families``) is timed on a launch-cache hit, beside what it costs to plan and
launch the same call through Triton every time (the family's prepare_backward and JITFunction.run).
Last, both ops as a compiled training step calls them (``layer_steps``: 1, 8 and 32 layers of their own
tensors, forward over all, backward over all in reverse) with runtime/fast_launch's counters per call: the
question the H200 training profile left (docs/design/backward.md, "A training step is host-bound").

    python benchmarks/host_overhead.py [--head-dim 96]   # on a GPU machine; prints a table
    python benchmarks/host_overhead.py --cpu-smoke       # no GPU: memo_steps, backward_steps, layer_steps

--cpu-smoke runs the last three parts on the CPU with an H200's launch-cache hits emulated
(benchmarks/sm90_emulation.py: the Hopper families chosen, launches recorded, the C launch stubbed), a
few calls each: a check that they run to the end (tests/test_host_overhead_smoke.py), not a timing.

--head-dim (default 128): D of the tiny problem. A head dim that is not a power of two (80, 96, 160, 192)
launches the Hopper kernel with eight TMA descriptors (two shared tiles per operand) instead of four.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))   # sm90_emulation (--cpu-smoke)

import fa3_inductor  # noqa: E402
from fa3_inductor.runtime.spec import SiteSpec  # noqa: E402
from fa3_inductor.templates import registry  # noqa: E402


SMOKE = False   # --cpu-smoke: the CPU, a few calls per figure
DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def per_call_us(fn, n: int = 300) -> float:
    if SMOKE:
        n = 2
    for _ in range(2 if SMOKE else 20):
        fn()
    _sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    _sync()
    return (time.perf_counter() - t) / n * 1e6


def cpu_smoke(D: int = 64) -> list:
    """memo_steps, backward_steps and layer_steps on the CPU under benchmarks/sm90_emulation.py (a few
    calls each): their rows, the figures meaningless. Catches a crash of the GPU run's last parts on CPU.

    Example::

        >>> len(cpu_smoke()) > 10   # doctest: +SKIP
        True
    """
    global SMOKE, DEVICE
    from sm90_emulation import emulated_sm90

    SMOKE, DEVICE = True, "cpu"
    with emulated_sm90():
        q, k, v = (torch.randn(1, 1, 128, D, dtype=torch.bfloat16) for _ in range(3))
        return [*memo_steps(q, k, v, rounds=1), *backward_steps(q, k, v), *layer_steps(D, layers=(1, 2), steps=2,
                                                                                     device="cpu", warmup=1)]


def main() -> None:
    import argparse

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from fa3_inductor import mods
    from fa3_inductor.runtime import fast_launch
    from fa3_inductor.templates.generic.host import prepare_generic

    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--cpu-smoke", action="store_true", help="the module docstring's CPU check")
    parsed = ap.parse_args()
    D = parsed.head_dim
    if parsed.cpu_smoke:
        for name, us in cpu_smoke(64 if D == 128 else D):
            print(f"  {name:45s} {us:8.1f} us")
        print("cpu smoke: ok")
        return
    import datetime

    import triton

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%MZ}", flush=True)
    dev = "cuda"
    q, k, v = (torch.randn(1, 1, 128, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    bm = create_block_mask(mods.causal, None, None, 128, 128, device=dev)
    flex_c = torch.compile(flex_attention, dynamic=False)
    out = torch.empty_like(q)
    lse = q.new_empty((1, 1, 128), dtype=torch.float32)
    mx = torch.empty_like(lse)
    rows = []

    def add(name, fn):
        rows.append((name, per_call_us(fn)))

    add("cuDNN/FA2 SDPA (eager)", lambda: F.scaled_dot_product_attention(q, k, v))
    add("torch flex (compiled), no mask", lambda: flex_c(q, k, v))
    add("torch flex (compiled), causal", lambda: flex_c(q, k, v, block_mask=bm))
    for template in ("auto", "generic"):
        add(f"fa3 flex() {template}, no mask", lambda t=template: fa3_inductor.flex(q, k, v, template=t))
        add(f"fa3 flex() {template}, causal", lambda t=template: fa3_inductor.flex(q, k, v, block_mask=bm, template=t))
    for template in ("hopper", "generic"):
        families = ("hopper", "generic", "torch") if template == "hopper" else ("generic", "torch")
        spec = SiteSpec(families, tuple((registry.family(f).dialect, None, None) for f in families)).to_json()
        op = torch.ops.fa3_inductor.flex_fwd.default
        add(f"op flex_fwd ({template}), no mask", lambda s=spec: op(q, k, v, None, None, None, None, [], [], D ** -0.5, 128, 128, s))
    from fa3_inductor.templates.hopper import prepare_fwd_sm90

    for name, prep in (("hopper", prepare_fwd_sm90), ("generic", prepare_generic)):
        kernel, args, kwargs, grid = prep(q, k, v, out, lse, mx, sm_scale=D ** -0.5)
        add(f"JITFunction.run ({name}) incl. prepare", lambda p=prep: (lambda r: r[0][r[3]](*r[1], **r[2]))(p(q, k, v, out, lse, mx, sm_scale=D ** -0.5)))
        add(f"JITFunction.run ({name}) only", lambda kernel=kernel, args=args, kwargs=kwargs, grid=grid: kernel[grid](*args, **kwargs))
        key = ("host-overhead", name, fast_launch.tensor_signature([q, k, v, out, lse, mx]))
        fast_launch.launch_cached(key, [q, k, v, out, lse, mx], lambda p=prep: (*p(q, k, v, out, lse, mx, sm_scale=D ** -0.5), name))
        add(f"fast_launch hit ({name})", lambda key=key: fast_launch.launch_cached(key, [q, k, v, out, lse, mx], None))

    print("\ncProfile of 200 fa3_inductor.flex calls (causal, auto):")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        fa3_inductor.flex(q, k, v, block_mask=bm)
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(22)
    print(buf.getvalue())
    rows += memo_steps(q, k, v)
    rows += backward_steps(q, k, v)
    rows += layer_steps(D)
    print(f"host cost per call, {torch.cuda.get_device_name()}, torch {torch.__version__}, B1 H1 S128 D{D} bf16:")
    for name, us in rows:
        print(f"  {name:45s} {us:8.1f} us")


def memo_steps(q, k, v, rounds: int = 7) -> list:
    """(step, median µs over ``rounds`` interleaved rounds) for each step of a repeated flex() call."""
    import statistics

    import triton
    import triton.language as tl

    from fa3_inductor import direct
    from fa3_inductor.runtime import fast_launch

    @triton.jit
    def _copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)

    x, y = torch.randn(4096, device=DEVICE), torch.empty(4096, device=DEVICE)
    fa3_inductor.flex(q, k, v)
    fa3_inductor.flex(q, k, v)
    key = direct.memo_key(None, None, None, None, False, "auto")
    call = direct._CALLS[key]
    bound = direct.memo_launch(key)   # the memo's fast_launch entry (None: a self-launching family)
    entry = None if bound is None else bound.entry
    lse = torch.empty(q.shape[:3], device=q.device)
    inputs = (q, k, v, torch.empty_like(q), lse, torch.empty_like(lse), *(() if bound is None else bound.rest))
    cases = {
        "plain Triton launch (copy kernel)": lambda: _copy_kernel[(4,)](x, y, 4096, BLOCK=1024),
    }
    if SMOKE:   # the interpreter would run it on the CPU tensors: not a launch's cost, nor needed
        cases.clear()
    cases |= {
        "torch.empty_like(q)": lambda: torch.empty_like(q),
        "fa3 flex(), repeated (memo hit)": lambda: fa3_inductor.flex(q, k, v),
        "  direct.replay": lambda: direct.replay(key, q, k, v, False),
        "  direct._signature": lambda: direct._signature(q, k, v),
        "  bound launch (output + relaunch)": lambda: call.launch(q, k, v, False),
    }
    if entry is not None:
        cases["  fast_launch.relaunch"] = lambda: fast_launch.relaunch(entry, inputs)
    if entry is not None and entry.direct is not None:
        stream = fast_launch.current_stream(entry.device)
        args = entry.args.build(entry, stream, inputs)
        cases["  _launch_direct"] = lambda: fast_launch._launch_direct(entry, stream, inputs)
        cases[f"  C launcher alone ({len(args)} arguments prebuilt)"] = lambda: entry.direct.launch(*args)
    for fn in cases.values():
        fn()
    times: dict = {name: [] for name in cases}
    for _ in range(rounds):   # in turn: a slow spell of the host falls on every step
        for name, fn in cases.items():
            times[name].append(per_call_us(fn, n=2000))
    tag = "no memo" if bound is None else bound.tag
    return [(f"{name} [{tag}]" if name.startswith("  ") else name, statistics.median(t))
            for name, t in times.items()]


def backward_steps(q, k, v) -> list:
    """(step, µs per call) of the backward op on a launch-cache hit and of planning the call anew, per
    backward family that takes ``q``'s head dim on this GPU (generic_bwd with fa3.deterministic_backward)."""
    from fa3_inductor.runtime.ops_bwd import BackwardSiteSpec, backward_call_for
    from fa3_inductor.templates.family import BackwardCall
    from fa3_inductor.templates.hopper_bwd.configs import SUPPORTED_HEAD_DIMS

    D = q.shape[-1]
    out, dout = torch.randn_like(q), torch.randn_like(q)
    lse = torch.zeros(q.shape[:3], device=q.device)
    names = ["generic_bwd"]
    if torch.cuda.get_device_capability() == (9, 0) and D in SUPPORTED_HEAD_DIMS:
        names.insert(0, "hopper_bwd")
    op = torch.ops.fa3_inductor.flex_bwd.families
    rows = []
    for name in names:
        family = registry.backward_family(name)
        site = BackwardSiteSpec((name,), ((family.dialect, None, None, None), ("torch", None, None, None)),
                                deterministic=name == "generic_bwd")
        spec = site.to_json()
        rows.append((f"op flex_bwd.families ({name}), hit",
                     per_call_us(lambda s=spec: op(q, k, v, out, lse, dout, None, *(None,) * 8, [], [],
                                                   D ** -0.5, 128, 128, s))))

        def planned(family=family, site=site):
            grads = [torch.empty_like(t) for t in (q, k, v)]
            call = BackwardCall(q, k, v, out, dout, lse, None, *grads, (None,) * 4, (None,) * 4, (), (),
                                D ** -0.5, 128, 128)
            for kernel, args, kwargs, grid in family.prepare_backward(backward_call_for(site, call, family.dialect)):
                kernel[grid](*args, **kwargs)

        if not SMOKE:   # JIT launches: the interpreter would run the kernels
            rows.append((f"  planned every call: prepare + JIT launches ({name})", per_call_us(planned)))
    return rows


def layer_steps(D: int, layers: tuple = (1, 8, 32), steps: int = 50, device: str = "cuda", warmup: int = 5) -> list:
    """(step, µs per op call) of the compiled path's two ops as a training step calls them: ``L`` layers,
    each with its own q, k, v, dO (a causal block mask shared), the forward op over every layer, then the
    backward op over every layer in reverse, outputs fresh each call; ``steps`` such steps back to back, one
    sync at the end. Beside each, runtime/fast_launch's counters per call: a recorded launch should be
    re-launched with nothing built or encoded once the layers' addresses have been seen."""
    from torch.nn.attention.flex_attention import create_block_mask

    from fa3_inductor import mods
    from fa3_inductor.runtime import fast_launch
    from fa3_inductor.runtime.ops_bwd import BackwardSiteSpec

    S = 128
    bm = create_block_mask(mods.causal, None, None, S, S, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    tables = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
    q_tables = (bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices)
    families = ("hopper", "generic", "torch")
    fwd_spec = SiteSpec(families, tuple((registry.family(f).dialect, None, None) for f in families)).to_json()
    bwd_names = ("hopper_bwd", "generic_bwd")
    bwd_spec = BackwardSiteSpec(bwd_names, tuple((registry.backward_family(f).dialect, None, None, None)
                                                 for f in bwd_names) + (("torch", None, None, None),)).to_json()
    fwd, bwd = torch.ops.fa3_inductor.flex_fwd.default, torch.ops.fa3_inductor.flex_bwd.families
    rows = []
    for L in layers:
        sets = [tuple(torch.randn(4, 4, S, D, device=device, dtype=torch.bfloat16) for _ in range(4))
                for _ in range(L)]

        def step():
            saved = [fwd(q, k, v, *tables, [], [], D ** -0.5, 128, 128, fwd_spec) for q, k, v, _ in sets]
            for (q, k, v, dout), (out, lse, _) in zip(reversed(sets), reversed(saved)):
                bwd(q, k, v, out, lse, dout, None, *tables, *q_tables, [], [], D ** -0.5, 128, 128, bwd_spec)

        for _ in range(warmup):
            step()
        sync()
        before = fast_launch.stats()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        calls = 2 * L * steps
        per = {k: (v - before[k]) / calls for k, v in fast_launch.stats().items()}
        rows.append((f"ops as a training step: {L} layer(s), fwd + bwd, causal (per op call; relaunches "
                     f"{per['relaunches']:.2f}, lists built {per['argument_lists_built']:.2f}, descriptors "
                     f"encoded {per['descriptors_encoded']:.2f} a call)", (time.perf_counter() - t) / calls * 1e6))
    return rows


if __name__ == "__main__":
    main()
