"""The compiled FP8 ops' memo (runtime/ops_fp8.compiled_call, issue 18): a repeated call of
``flex_fwd_fp8_rope`` replays its prologue and attention launches without rebuilding anything.

CPU only: the GPU launches are emulated as benchmarks/fp8_compiled_host_cpu.py does (fast_launch's
real recording over a stand-in kernel, serve's CUDA branch taken), so those tests count what a call
builds, not what it computes; ``computing_replays`` swaps the replay's CUDA-only parts for stand-ins that
compute under the interpreter (as test_fp8_memo.py does for flex()'s memo), so a replay is checked bit
for bit against the full path. The GPU test runs the real launches.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


@pytest.fixture
def emulated(monkeypatch, cpu_kernels):
    import fp8_compiled_host_cpu as emulation

    from fa3_inductor.runtime import fast_launch

    fast_launch.clear()
    counts = emulation.emulate_gpu_launches(monkeypatch.setattr)
    yield counts
    fast_launch.clear()


def _site(N: int = 128):
    from torch.nn.attention.flex_attention import create_block_mask

    from fa3_inductor import direct, mods
    from fa3_inductor.fp8_recipe import FP8Recipe
    from fa3_inductor.runtime.ops_fp8 import recipe_text

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, N, 4, 64, generator=g).bfloat16().transpose(1, 2)
    k, v = (torch.randn(1, N, 2, 64, generator=g).bfloat16().transpose(1, 2) for _ in range(2))
    cos, sin = torch.randn(N, 64, generator=g).bfloat16(), torch.randn(N, 64, generator=g).bfloat16()
    bm = create_block_mask(mods.causal, None, None, N, N, device="cpu")
    tables, sq, skv = direct.block_mask_tables(bm)
    spec = direct.cached_plan(q, k, v, None, mods.causal, bm, "auto", fp8=True).spec
    return (q, k, v, cos, sin, "half", *tables, [], [], 64 ** -0.5, sq, skv, spec,
            recipe_text(FP8Recipe()))


def test_repeated_compiled_fp8_calls_replay_without_rebuilding(emulated):
    from fa3_inductor.runtime import fast_launch, ops_fp8
    from fa3_inductor.templates.fp8_prologue import host

    args = _site()
    op = torch.ops.fa3_inductor.flex_fwd_fp8_rope.default
    first = op(*args)
    before, layouts = ops_fp8.stats(), len(host._LAYOUTS)
    prepared, relaunches = emulated["prepared"], fast_launch.stats()["relaunches"]
    for _ in range(3):
        out, lse, row_max = op(*args)
        assert out.shape == first[0].shape and out.stride() == first[0].stride()
        assert lse.shape == first[1].shape and row_max.shape == first[2].shape
        assert out.data_ptr() != lse.data_ptr()
    after = ops_fp8.stats()
    assert after["replayed"] - before["replayed"] == 3
    assert after["full"] == before["full"] and after["bound"] == before["bound"]
    assert emulated["prepared"] == prepared                       # no launch prepared again
    assert len(host._LAYOUTS) == layouts
    # two launches a call: the prologue and the attention kernel
    assert fast_launch.stats()["relaunches"] - relaunches == 2 * 3


def test_a_new_signature_takes_the_full_path_once(emulated):
    from fa3_inductor.runtime import ops_fp8

    op = torch.ops.fa3_inductor.flex_fwd_fp8_rope.default
    args = _site()
    op(*args)
    before = ops_fp8.stats()
    # q contiguous instead of a [B, S, H, D] view: another signature, another entry
    op(args[0].contiguous(), *args[1:])
    op(args[0].contiguous(), *args[1:])
    after = ops_fp8.stats()
    assert after["full"] - before["full"] == 1 and after["replayed"] - before["replayed"] == 1


def test_launch_cache_clear_forgets_the_memo(emulated):
    from fa3_inductor.runtime import fast_launch, ops_fp8

    op = torch.ops.fa3_inductor.flex_fwd_fp8_rope.default
    args = _site()
    op(*args)
    assert ops_fp8._BOUND
    fast_launch.clear()
    assert not ops_fp8._BOUND
    before = ops_fp8.stats()
    op(*args)
    assert ops_fp8.stats()["full"] - before["full"] == 1


def test_a_replay_rewrites_one_operand_set_and_returns_fresh_outputs(emulated):
    """The replay keeps one set of prologue operands per (layout, stream, thread), takes the next
    zeroed v_scale_max slot per call (no fill, no abs: _RING slots reset by one zero_), and
    allocates out / lse / max per call (the op's outputs go to the graph)."""
    from reference import op_names

    from fa3_inductor.runtime import ops_fp8

    args = _site()
    ops_fp8.flex_fwd_fp8_rope(*args)
    outs = [ops_fp8.flex_fwd_fp8_rope(*args) for _ in range(2)]
    assert len(ops_fp8._WORKSPACES) == 1
    workspace, = ops_fp8._WORKSPACES.values()
    assert workspace.next == 2
    taken = [s.v_scale_max for s in workspace.sets[:3]]
    assert all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in taken)
    assert len({t.data_ptr() for t in taken}) == 3
    assert torch.equal(workspace.ring, torch.zeros_like(workspace.ring))   # emulated: nothing wrote
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(*outs))

    with op_names() as seen:
        ops_fp8.flex_fwd_fp8_rope(*args)
    # the three outputs only: no fill, no abs; no views of RoPE's [S, R] tables
    assert seen.names == ["empty_like", "new_empty", "empty_like"], seen.names
    # the slots used up: one zero_ resets them all, the next call takes slot 0
    workspace.next = ops_fp8._RING
    workspace.ring.fill_(5.0)
    with op_names() as seen:
        ops_fp8.flex_fwd_fp8_rope(*args)
    assert seen.names[0] == "zero_" and workspace.next == 1
    assert torch.equal(workspace.ring, torch.zeros_like(workspace.ring))


@pytest.mark.gpu
def test_compiled_fp8_replays_compute_what_the_full_path_computes(fresh_compiles):
    """On an FP8 GPU: a compiled rotate_half model's later calls replay (ops_fp8.stats) and give,
    bit for bit, what the same calls give through the full path (the memo and the launch cache
    cleared before each), on new inputs each call, V's heads all zero in one of them (v_scale_max's
    fill and abs between calls on one operand set)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with e4m3 tensor cores (sm89+)")
    from test_fp8_rope_fusion import FP8, HalfRope, half_tables, qkv

    from fa3_inductor.runtime import fast_launch, ops_fp8

    torch._dynamo.reset()
    model = torch.compile(HalfRope(), backend="fa3", options=FP8)
    cos, sin = half_tables("cuda")
    inputs = [qkv(seed, device="cuda") for seed in (1, 2, 3)]
    inputs[1][2][:, 0].zero_()   # one KV head of V all zero
    with torch.no_grad():
        model(*inputs[0], cos, sin)
        before = ops_fp8.stats()
        replayed = [model(*x, cos, sin).clone() for x in inputs]
        assert ops_fp8.stats()["replayed"] - before["replayed"] == len(inputs)
        for x, out in zip(inputs, replayed):
            fast_launch.clear()                       # forgets the memo too: the full path
            fresh = model(*x, cos, sin)
            assert torch.equal(out, fresh)
            assert torch.isfinite(out).all()


@pytest.fixture
def computing_replays(monkeypatch, cpu_kernels):
    """The replay's CUDA-only parts as stand-ins that compute under the interpreter (as
    test_fp8_memo.py does for flex()'s memo): the prologue's recorded launches run its Triton launches
    on the replay's inputs, the attention's re-launcher serves a Call of the replay's tensors."""
    from fa3_inductor.fp8_recipe import FP8Operands
    from fa3_inductor.runtime import fast_launch, ops, ops_fp8
    from fa3_inductor.runtime.spec import SiteSpec
    from fa3_inductor.templates.family import Call
    from fa3_inductor.templates.fp8_prologue.host import PrologueLayout

    def recorded_launches(layout):
        def run(inputs):
            for i, (kernel, kwargs) in enumerate(layout.kernels):
                kernel[layout.grid(i, inputs)](*layout.args(i, inputs), **kwargs)
        return (run,)

    def replayer(key):
        (spec, scale, sq, skv, n_score, *_), recipe, needs_max = key
        site = SiteSpec.from_json(spec)

        def fire(inputs):
            q8, k8, vt, out, lse, max_scores, *rest = inputs
            tables, bufs, scales = rest[:4], rest[4:-4], rest[-4:]
            fp8 = FP8Operands(q8, k8, vt, *scales, k_mean=None, recipe=recipe, n=k8.shape[2])
            call = Call(q8, k8, vt, out, lse, max_scores, tuple(tables), tuple(bufs[:n_score]),
                        tuple(bufs[n_score:]), scale, sq, skv, needs_max=needs_max, fp8=fp8)
            return ops._serve(site, call, None, None)
        return fire, "fp8"

    fast_launch.clear()
    monkeypatch.setattr(ops_fp8, "_records_launches", lambda t: True)
    monkeypatch.setattr(ops_fp8, "relaunch", lambda entry, inputs: entry(inputs))
    monkeypatch.setattr(fast_launch, "_get_stream", lambda device: 0)   # no CUDA driver here
    monkeypatch.setattr(ops, "replayer", replayer)
    monkeypatch.setattr(PrologueLayout, "recorded_launches", recorded_launches)
    yield
    fast_launch.clear()


def test_replays_compute_what_the_full_path_computes(computing_replays, monkeypatch):
    """Replays on one kept operand set, new inputs each call (two with a KV head of V all zero:
    its v_scale_max stays at the slot's 0 where the full path maps it to 1), bit for bit the full
    path's out and LSE; two v_scale_max slots, so the slots are reset (one zero_) between calls
    that wrote them."""
    from fa3_inductor.runtime import ops_fp8

    monkeypatch.setattr(ops_fp8, "_RING", 2)
    args = list(_site())
    op = ops_fp8.flex_fwd_fp8_rope
    g = torch.Generator().manual_seed(1)
    calls = []
    for i in range(5):
        q, k, v = (torch.randn(t.shape[0], t.shape[2], t.shape[1], t.shape[3], generator=g)
                   .bfloat16().transpose(1, 2) for t in args[:3])
        if i in (1, 4):
            v[:, 0].zero_()
        if i == 3:
            v.mul_(1e-3)   # smaller scales than the calls before: a slot not reset would keep theirs
        calls.append((q, k, v, *args[3:]))
    op(*calls[0])   # binds
    before = ops_fp8.stats()
    replayed = []
    for c in calls:
        replayed.append(tuple(t.clone() for t in op(*c)[:2]))
        workspace, = ops_fp8._WORKSPACES.values()
        vs_max = workspace.sets[workspace.next - 1].v_scale_max
        assert (vs_max[:, 0] == 0).all() == (c[2][:, 0] == 0).all()   # 0 left for an all-zero head
    assert ops_fp8.stats()["replayed"] - before["replayed"] == len(calls)
    for c, (out, lse) in zip(calls, replayed):
        ops_fp8._BOUND.clear()
        full_out, full_lse, _ = op(*c)
        assert torch.equal(out, full_out) and torch.equal(lse, full_lse)
        assert torch.isfinite(out).all()
