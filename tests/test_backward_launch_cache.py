"""The backward op's launch cache (runtime/ops_bwd.py over runtime/fast_launch.py).

CPU: the families' ``scratch=`` keywords give what their own allocation gives (the generic backward
under the interpreter, bitwise; the Hopper plan's launches use the given tensors), and the op's plan
logic with a stand-in family whose "kernels" are Python functions (as tests/test_fast_launch.py's
stand-ins): a second call of one signature re-launches without planning, on the new call's tensors
and fresh scratch; launches that cannot be recorded are planned on every call, without new attempts
to record them. GPU (marked ``gpu``): the same through torch.compile(backend="fa3") training, the
first step a miss and the second a hit, for hopper_bwd (D64: noop, causal, softcap) and generic_bwd
(fa3.deterministic_backward).
"""

from __future__ import annotations

import inspect
import math
from typing import Optional

import pytest
import torch

from fa3_inductor.runtime import fast_launch, ops_bwd
from fa3_inductor.runtime.ops_bwd import BackwardSiteSpec, last_backward_family
from fa3_inductor.templates import registry
from fa3_inductor.templates.family import BackwardSiteFacts, NotServed
from reference import assert_matches_reference, reference_attention, reference_gradients

LN2 = math.log(2.0)


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch, request):
    fast_launch.clear()   # the plans go with it (fast_launch.on_clear)
    if request.node.get_closest_marker("gpu") is None:   # the stand-in kernels need no stream
        monkeypatch.setattr(fast_launch, "current_stream", lambda device: 0)
    yield
    fast_launch.clear()


# ---------------------------------------------------------------- CPU: the scratch keywords

def _backward_inputs(Z=1, H=2, M=40, N=48, D=16, dtype=torch.float32):
    q, k, v, dout = (torch.randn(Z, H, L, D).to(dtype) for L in (M, N, N, M))
    out, lse = reference_attention(q, k, v)
    return q, k, v, out.to(dtype), dout, (lse / LN2).float()


def test_generic_scratch_keyword_gives_the_default_result(cpu_kernels):
    from fa3_inductor.templates.generic_bwd.host import generic_backward_scratch, launch_generic_backward

    q, k, v, out, dout, lse = _backward_inputs()
    results = []
    for scratch in (None, generic_backward_scratch(q)):
        grads = tuple(torch.empty_like(t) for t in (q, k, v))
        launch_generic_backward(q, k, v, out, dout, lse, *grads, sm_scale=0.25, scratch=scratch)
        results.append(grads)
    assert all(torch.equal(a, b) for a, b in zip(*results))
    _, *want = reference_gradients(q, k, v, dout, scale=0.25)[:4]
    for got, ref, name in zip(results[1], want, ("dq", "dk", "dv")):
        assert_matches_reference(got, ref, torch.float32, name)


def test_generic_scratch_of_the_wrong_shape_is_refused():
    from fa3_inductor.templates.generic_bwd.host import prepare_generic_backward

    q, k, v, out, dout, lse = _backward_inputs()
    with pytest.raises(ValueError, match="generic_backward_scratch"):
        prepare_generic_backward(q, k, v, out, dout, lse, *(torch.empty_like(t) for t in (q, k, v)),
                                 sm_scale=0.25, scratch=(torch.empty(1, 2, 41),))


def _hopper_launches(scratch, **options):
    from fa3_inductor.templates.hopper_bwd.host import prepare_hopper_backward

    q, k, v, out, dout, lse = _backward_inputs(M=100, N=128, D=64, dtype=torch.bfloat16)
    grads = tuple(torch.empty_like(t) for t in (q, k, v))
    return q, prepare_hopper_backward(q, k, v, out, dout, lse, *grads, sm_scale=0.125, scratch=scratch,
                                      **options)


def test_hopper_launches_use_the_given_scratch():
    """The plan (no launch: CPU tensors) reads and writes the given STATS and DQ_ACC, of the shapes it
    allocates itself; a block mask pads the rows to its blocks."""
    from fa3_inductor.templates.hopper_bwd.host import hopper_backward_scratch

    q, own = _hopper_launches(None)
    stats, dq_acc = hopper_backward_scratch(q, has_mask=False)
    _, given = _hopper_launches((stats, dq_acc))
    (_, pre_own, *_), (_, pre_given, *_) = own[0], given[0]
    assert [tuple(t.shape) for t in pre_own[4:6]] == [tuple(stats.shape), tuple(dq_acc.shape)] == [
        (2, 2, 128), (2, 128, 64)]
    assert pre_given[4] is stats and pre_given[5] is dq_acc                  # preprocess
    assert any(a is stats for a in given[1][1]) and any(a is dq_acc for a in given[1][1])   # main
    assert given[2][1][0] is dq_acc                                          # dQ convert
    padded = hopper_backward_scratch(q, has_mask=True, sparse_q_block=256)
    assert tuple(padded[0].shape) == (2, 2, 256)


def test_hopper_scratch_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="hopper_backward_scratch"):
        _hopper_launches((torch.empty(2, 2, 100), torch.empty(2, 100, 64)))


# ---------------------------------------------------------------- CPU: the op's plans

class _Jit:
    """A stand-in JIT function whose kernel runs a Python function on the launch's arguments."""

    def __init__(self, fn):
        self.fn = fn
        self.params = [_Param(p) for p in inspect.signature(fn).parameters.values()]
        self.launches = 0
        jit = self

        class Kernel:
            function, packed_metadata = "fn", "meta"

            def run(self, g0, g1, g2, stream, function, packed, metadata, enter, exit_, *args):
                jit.launches += 1
                jit.fn(*args)

            def launch_metadata(self, grid, stream, *args):
                return None

        self.kernel = Kernel()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            self.fn(*args, **kwargs)
            return self.kernel
        return launch


class _Param:
    def __init__(self, p):
        self.name, self.default = p.name, p.default
        self.has_default = p.default is not inspect.Parameter.empty


def _delta(out, dout, delta):
    delta.copy_((out * dout).sum(-1))


def _dkdv(k, v, dk, dv, delta, scale):
    dk.copy_(k * scale + delta.sum())
    dv.copy_(v - delta.mean())


def _dq(q, dq, delta, scale):
    dq.copy_(q * delta[..., None] * scale)


def _expected(q, k, v, out, dout, scale=0.5):
    delta = (out * dout).sum(-1)
    return q * delta[..., None] * scale, k * scale + delta.sum(), v - delta.mean()


class _StandIn:
    """A backward family of three stand-in kernels (delta, dK/dV, dQ) over its scratch, DELTA.
    ``own_scratch``: prepare allocates DELTA itself (no hook), so nothing can be recorded."""

    name = "stand_in_bwd"
    dialect = "tl"

    def __init__(self, own_scratch: bool = False, torch_step: bool = False):
        self.jits = [_Jit(_delta), _Jit(_dkdv), _Jit(_dq)]
        self.prepared = self.scratches = 0
        self.torch_step = torch_step
        if own_scratch:
            self.backward_scratch = None

    def serves_backward(self, site: BackwardSiteFacts) -> Optional[str]:
        return None

    def backward_scratch(self, call):
        self.scratches += 1
        return (torch.empty(call.q.shape[:3]),)

    def prepare_backward(self, call):
        from fa3_inductor.templates.generic_bwd.buffer_grad_host import TorchStep

        self.prepared += 1
        (delta,) = call.scratch if call.scratch is not None else (torch.empty(call.q.shape[:3]),)
        pre, dkdv, dq = self.jits
        launches = [(pre, (call.out, call.dout, delta), {}, (1,)),
                    (dkdv, (call.k, call.v, call.dk, call.dv, delta, call.scale), {}, (1,)),
                    (dq, (call.q, call.dq, delta, call.scale), {}, (1,))]
        if self.torch_step:   # as the generic backward's zeroing before the dQ pass
            launches.insert(2, (TorchStep(lambda t: t.zero_()), (call.dq,), {}, None))
        return launches

    def launch_backward(self, call) -> None:
        raise AssertionError("never reached: prepare_backward returns launches")


def _op_call(family, M=24, scale=0.5, dout_is_out=False):
    spec = BackwardSiteSpec((family.name,), (("tl", None, None, None), ("torch", None, None, None))).to_json()
    q, k, v, out, dout = (torch.randn(1, 2, M, 8) for _ in range(5))
    if dout_is_out:
        dout = out
    lse = torch.randn(1, 2, M)
    dq, dk, dv, _ = torch.ops.fa3_inductor.flex_bwd.families(q, k, v, out, lse, dout, None, *(None,) * 8,
                                                             [], [], scale, 128, 128, spec)
    for got, want in zip((dq, dk, dv), _expected(q, k, v, out, dout, scale)):
        torch.testing.assert_close(got, want)
    assert last_backward_family() == family.name


@pytest.fixture
def stand_in(monkeypatch):
    """Install a stand-in family and take the op's launch-cache path on CPU tensors."""
    def install(family):
        monkeypatch.setattr(registry, "_loaded_backward", [family])
        monkeypatch.setattr(ops_bwd, "_caches", lambda q: True)
        return family
    return install


def test_second_call_relaunches_without_planning(stand_in):
    family = stand_in(_StandIn())
    _op_call(family)
    _op_call(family)   # new tensors, same signature: the recorded launches, fresh scratch
    assert family.prepared == 1 and family.scratches == 1
    assert [j.launches for j in family.jits] == [2, 2, 2]
    _op_call(family, M=40)   # another signature: planned anew
    assert family.prepared == 2
    assert len(ops_bwd._PLANS) == 2 and all(p.launches is not None for p in ops_bwd._PLANS.values())
    fast_launch.clear()
    assert not ops_bwd._PLANS


def test_a_tensor_passed_twice_keys_its_own_plan(stand_in):
    """A recording made where one tensor fills two places would feed a later call's tensor of the
    second place into both: such calls have plans of their own."""
    family = stand_in(_StandIn())
    _op_call(family, dout_is_out=True)
    _op_call(family)
    _op_call(family, dout_is_out=True)
    _op_call(family)
    assert family.prepared == 2 and len(ops_bwd._PLANS) == 2


@pytest.mark.parametrize("kind", ["own_scratch", "torch_step"])
def test_unrecordable_launches_are_planned_every_call(stand_in, monkeypatch, kind):
    """A tensor made while planning, or a torch step: planned on every call, recorded once at most."""
    family = stand_in(_StandIn(**{kind: True}))
    attempts = []
    record = ops_bwd._record_launches
    monkeypatch.setattr(ops_bwd, "_record_launches", lambda *a: attempts.append(1) or record(*a))
    for _ in range(3):
        _op_call(family)
    assert family.prepared == 3 and len(attempts) == 1
    (plan,) = ops_bwd._PLANS.values()
    assert plan.launches is None and plan.family == family.name


def test_a_refusing_family_leaves_no_plan(stand_in):
    class Refusing(_StandIn):
        def prepare_backward(self, call):
            raise NotServed("stand_in_bwd: refuses every call")

    family = stand_in(Refusing())
    spec = BackwardSiteSpec((family.name,), (("tl", None, None, None), ("torch", None, None, None))).to_json()
    q, k, v, dout = (torch.randn(1, 2, 24, 8) for _ in range(4))
    out, lse = reference_attention(q, k, v, scale=0.5)
    dq, *_ = torch.ops.fa3_inductor.flex_bwd.families(q, k, v, out.float(), (lse / LN2).float(), dout, None,
                                                      *(None,) * 8, [], [], 0.5, 128, 128, spec)
    assert last_backward_family() == "dense" and not ops_bwd._PLANS
    assert_matches_reference(dq, reference_gradients(q, k, v, dout, scale=0.5)[1], torch.float32, "dq")


# ---------------------------------------------------------------- GPU: training steps, miss then hit

def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _count_calls(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or original(*a, **kw))
    return calls


def _two_steps(case: str, options: dict, D: int = 64, torch_switch: bool = False, DV: Optional[int] = None):
    """Gradients of two identical training steps through torch.compile(backend="fa3") at head dim ``D`` (v's ``DV``,
    default D; with ``torch_switch``: under torch.use_deterministic_algorithms(True)), and the float64 reference's."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from fa3_inductor import mods

    score_mod = mods.softcap(2.0) if case == "softcap" else None
    mask_mod = mods.causal if case == "causal" else None
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, 256, 256, device="cuda")
    compiled = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask),
                             backend="fa3", options=options)
    q, k, v = (torch.randn(2, 2, 256, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for d in (D, D, DV or D))
    dout = torch.randn(2, 2, 256, DV or D, device="cuda", dtype=torch.bfloat16)
    steps = []
    torch.use_deterministic_algorithms(torch_switch)
    try:
        for _ in range(2):
            for t in (q, k, v):
                t.grad = None
            compiled(q, k, v).backward(dout)
            steps.append([t.grad.clone() for t in (q, k, v)])
    finally:
        torch.use_deterministic_algorithms(False)
    reference = reference_gradients(q, k, v, dout, score_mod, mask_mod)[1:4]
    return steps, reference


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["noop", "causal", "softcap"])
def test_hopper_backward_hit_matches_miss(case, monkeypatch, fresh_compiles):
    if not _sm90():
        pytest.skip("needs a CUDA device of capability (9, 0) (H100 / H200)")
    from fa3_inductor.templates.hopper_bwd import family as hopper_family

    prepared = _count_calls(monkeypatch, hopper_family, "prepare_hopper_backward")
    (first, second), reference = _two_steps(case, {})
    assert last_backward_family() == "hopper_bwd"
    assert len(prepared) == 1, "the second step planned the backward again instead of re-launching"
    assert any(p.family == "hopper_bwd" and p.launches for p in ops_bwd._PLANS.values())
    # dK, dV: one writer per element; dQ: fp32 atomics, summed in a varying order
    assert torch.equal(first[1], second[1]) and torch.equal(first[2], second[2])
    torch.testing.assert_close(first[0], second[0], rtol=1e-2, atol=1e-2)
    for got, ref, name in zip(second, reference, ("dq", "dk", "dv")):
        assert_matches_reference(got, ref, torch.bfloat16, name)


@pytest.mark.gpu
@pytest.mark.parametrize("D, DV", [(64, 64), (256, 256), (192, 128)])
def test_deterministic_backward_hit_matches_miss(D, DV, monkeypatch, fresh_compiles):
    """fa3.deterministic_backward through causal training steps: the Hopper family's ordered dQ at D64 and (the
    wide kernel) at D256 and 192 / 128; the same bits on both steps."""
    if not _sm90():
        pytest.skip("needs a CUDA device of capability (9, 0) (H100 / H200)")
    from fa3_inductor.templates.hopper_bwd import family as hopper_family

    prepared = _count_calls(monkeypatch, hopper_family, "prepare_hopper_backward")
    (first, second), reference = _two_steps("causal", {"fa3.deterministic_backward": True}, D, DV=DV)
    assert last_backward_family() == "hopper_bwd"
    assert len(prepared) == 1, "the second step planned the backward again instead of re-launching"
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    for got, ref, name in zip(second, reference, ("dq", "dk", "dv")):
        assert_matches_reference(got, ref, torch.bfloat16, name)


@pytest.mark.gpu
def test_torch_deterministic_switch_orders_the_hopper_dq(fresh_compiles):
    """torch.use_deterministic_algorithms(True) without the fa3 option: the backward is planned deterministic (the
    lowering's record), the Hopper family serves it, and two steps give the same bits."""
    if not _sm90():
        pytest.skip("needs a CUDA device of capability (9, 0) (H100 / H200)")
    from fa3_inductor import lowered_backward_sites

    (first, second), reference = _two_steps("causal", {}, 64, torch_switch=True)
    site = lowered_backward_sites()[-1]
    assert site["deterministic"] and last_backward_family() == "hopper_bwd", site
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    for got, ref, name in zip(second, reference, ("dq", "dk", "dv")):
        assert_matches_reference(got, ref, torch.bfloat16, name)
