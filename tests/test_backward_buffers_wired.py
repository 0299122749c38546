"""Gradients of tensors a score_mod captures, wired end to end (issue 19): a learnable
``nn.Parameter`` read by the score_mod (a relative bias table, ALiBi slopes, a per-head bias under
a tanh softcap) trains through the generic backward family: the backward lowering generates the
gradients' sources (templates/generic_bwd/buffer_grad.py), carries them in the op's spec, and
``fa3_inductor::flex_bwd.families`` returns the captured tensors' gradients with dq, dk, dv.

CPU under Triton's interpreter (conftest sets it), tiny shapes, fp32 and bf16 inputs; every
gradient against float64 autograd under the tolerance rule (tests/reference.py). Also: option
fa3.deterministic_backward reaches the host and repeats the gradients bit for bit; a call the
family refuses at run time still gets the captured tensors' gradients from the dense recompute.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import pytest
import torch

import fa3_inductor
from fa3_inductor import lowered_backward_sites, mods
from fa3_inductor.runtime.ops_bwd import last_backward_family
from fa3_inductor.templates import registry
from fa3_inductor.templates.family import BackwardSiteFacts, NotServed
from reference import assert_matches_reference, reference_attention, reference_gradients

pytestmark = pytest.mark.usefixtures("cpu_kernels", "fresh_compiles")


def _relative(n: int) -> Callable:     # [2n - 1], indexed by the q - kv offset
    return lambda t: lambda s, b, h, q, kv: s + t[q - kv + n - 1]


def _alibi(t):                         # learnable per-head slopes [H]
    return lambda s, b, h, q, kv: s + t[h] * (kv - q)


def _softcap_head_bias(t):             # [H] inside a tanh softcap: its gradient reads the score
    return lambda s, b, h, q, kv: 5.0 * torch.tanh((s + t[h]) / 5.0)


@dataclasses.dataclass(frozen=True)
class Case:
    make: Callable                     # make(*tables) -> score_mod
    shapes: tuple                      # the learnable tables' shapes
    hq: int = 2
    hkv: int = 2
    m: int = 64
    n: int = 64
    mask_mod: Optional[Callable] = None


CASES = {
    "relative": Case(_relative(64), ((127,),)),
    "alibi-gqa-causal-ragged": Case(_alibi, ((2,),), hkv=1, m=72, n=80, mask_mod=mods.causal),
    "softcap-head-bias": Case(_softcap_head_bias, ((2,),), n=80),
}


class _Attention(torch.nn.Module):
    """One flex site whose score_mod reads this module's learnable tables."""

    def __init__(self, case: Case):
        super().__init__()
        self.case = case
        self.tables = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(*shape) * 0.5)
                                             for shape in case.shapes)

    def forward(self, q, k, v):
        return fa3_inductor.flex(q, k, v, score_mod=self.case.make(*self.tables),
                                 mask_mod=self.case.mask_mod, enable_gqa=q.shape[1] != k.shape[1])


def _inputs(case: Case, dtype: torch.dtype, d: int = 16):
    q = torch.randn(1, case.hq, case.m, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, case.hkv, case.n, d, dtype=dtype, requires_grad=True) for _ in range(2))
    return q, k, v


def _table_reference(q, k, v, out, grad_out, tables, make, mask_mod) -> list[torch.Tensor]:
    """Float64 autograd gradients of ``tables`` for a backward that reads the forward's ``out``
    (as every flash backward does: Δ = rowsum(dO ⊙ O)). A table's gradient is Σ dS · ∂s/∂t, and
    its terms cancel (Σ_j dS_ij = 0 per row), so the rounding of a bf16 O alone moves an ALiBi
    slope's or a softcapped bias's gradient by up to ~3e-2 relative (measured): here
    Δ' = Δ + ε with ε = rowsum(dO ⊙ (out − O)), which adds −Σ_i ε_i ∂LSE_i/∂t."""
    leaves = [t.detach().double().requires_grad_() for t in tables]
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    ref, lse = reference_attention(q64, k64, v64, make(*leaves), mask_mod)
    eps = (grad_out.double() * (out.detach().double() - ref.detach())).sum(-1)
    lse = torch.where(torch.isfinite(lse), lse, 0.0)   # a fully masked row adds nothing
    loss = (ref * grad_out.double()).sum() - (eps * lse).sum()
    return list(torch.autograd.grad(loss, leaves))


def _check(out, q, k, v, tables, make, mask_mod, dtype) -> None:
    """Backward with a fresh random dO; output, dq, dk, dv against float64 autograd, the tables'
    gradients against float64 autograd given the forward's output (:func:`_table_reference`)."""
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_out, dq, dk, dv, _ = reference_gradients(q, k, v, grad_out, None, mask_mod,
                                                 captured=tuple(tables), make_score_mod=make)
    dtables = _table_reference(q, k, v, out, grad_out, tables, make, mask_mod)
    assert_matches_reference(out, ref_out, dtype, "output")
    for name, t, ref in (("dq", q, dq), ("dk", k, dk), ("dv", v, dv)):
        assert_matches_reference(t.grad, ref, dtype, name)
    for i, (t, ref) in enumerate(zip(tables, dtables)):
        assert t.grad is not None, f"learnable table {i} got no gradient"
        assert_matches_reference(t.grad, ref, dtype, f"d table {i}")


def _assert_generic_served(buffer_grads: int) -> None:
    site = lowered_backward_sites()[-1]
    assert (site["family"], site["kernel"], site["buffer_grads"]) == (
        "generic_bwd", "fa3_inductor.flex_bwd", buffer_grads), site
    assert "captured tensor" in site["reason"], site
    assert last_backward_family() == "generic_bwd"   # the op ran it: no fallback at run time


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", CASES)
def test_compiled_module_parameter_gradients(name, dtype):
    """torch.compile(backend="fa3") of a module whose score_mod reads its nn.Parameter (fp32, as
    a model's parameters are, under bf16 activations too)."""
    case = CASES[name]
    module = _Attention(case)
    q, k, v = _inputs(case, dtype)
    out = torch.compile(module, backend="fa3")(q, k, v)
    _check(out, q, k, v, list(module.tables), case.make, case.mask_mod, dtype)
    _assert_generic_served(len(case.shapes))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flex_two_parameters_and_a_frozen_buffer(dtype):
    """fa3_inductor.flex: slopes and a per-head relative table learn, a frozen bias between them
    does not; the op's gradient list maps back to the right buffers."""
    n = 64
    slopes = torch.nn.Parameter(torch.rand(2))
    frozen = torch.randn(2)
    rel = torch.nn.Parameter(torch.randn(2, 2 * n - 1) * 0.5)

    def make(slopes, rel, frozen=frozen):
        return lambda s, b, h, q, kv: (s + slopes[h] * (kv - q) + frozen[h].to(s.dtype)
                                       + rel[h, q - kv + n - 1])

    q, k, v = _inputs(Case(make, ()), dtype)
    out = fa3_inductor.flex(q, k, v, score_mod=make(slopes, rel), mask_mod=mods.causal)
    _check(out, q, k, v, [slopes, rel], make, mods.causal, dtype)
    _assert_generic_served(2)
    assert frozen.grad is None


def test_deterministic_option_repeats_bit_for_bit(monkeypatch):
    """fa3.deterministic_backward reaches the host as deterministic=True (no atomics for the
    table's gradient) and two backward passes give identical gradients."""
    from fa3_inductor.templates.generic_bwd import family as generic_family

    seen = []
    launch = generic_family.launch_generic_backward

    def spy(*args, **options):
        seen.append((options["deterministic"], len(options.get("buffer_grads", ()))))
        return launch(*args, **options)

    monkeypatch.setattr(generic_family, "launch_generic_backward", spy)
    case = CASES["relative"]
    module = _Attention(case)
    compiled = torch.compile(module, backend="fa3", options={"fa3.deterministic_backward": True})
    q, k, v = _inputs(case, torch.float32)
    grads = []
    for _ in range(2):
        for t in (q, k, v, *module.tables):
            t.grad = None
        torch.manual_seed(7)   # the same dO both times
        _check(compiled(q, k, v), q, k, v, list(module.tables), case.make, None, torch.float32)
        grads.append([t.grad.clone() for t in (q, k, v, *module.tables)])
    assert seen == [(True, 1), (True, 1)]
    assert lowered_backward_sites()[-1]["deterministic"]
    _assert_generic_served(1)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


class _Refusing:
    """A backward family that plans every site (captured-tensor gradients too) and refuses every
    call."""

    name = "refusing_bwd"
    dialect = "tl"

    def serves_backward(self, site: BackwardSiteFacts) -> Optional[str]:
        return None

    def prepare_backward(self, call):
        assert len(call.dbufs) == len(call.buffer_grad_sources) == 1, call
        raise NotServed("refusing_bwd: refuses every call")

    def launch_backward(self, call) -> None:
        raise AssertionError("never reached")


def test_refused_call_gets_buffer_gradients_from_the_dense_recompute(monkeypatch):
    monkeypatch.setattr(registry, "_loaded_backward", [_Refusing()])
    case = CASES["softcap-head-bias"]
    module = _Attention(case)
    q, k, v = _inputs(case, torch.float32)
    _check(module(q, k, v), q, k, v, list(module.tables), case.make, None, torch.float32)
    assert lowered_backward_sites()[-1]["family"] == "refusing_bwd"   # planned ...
    assert last_backward_family() == "dense"                          # ... refused at run time


def test_spec_carries_the_sources_through_json():
    """What an FX-cache-served graph rebuilds: the sources, their records and reduction classes."""
    from torch._higher_order_ops.flex_attention import create_fw_bw_graph

    from fa3_inductor.runtime.ops_bwd import BackwardSiteSpec, buffer_grad_items
    from fa3_inductor.templates.generic_bwd import buffer_grad_sources
    from fa3_inductor.templates.modgen import BufferSpec, trace_mod

    table, slopes = torch.randn(127, requires_grad=True), torch.randn(2, requires_grad=True)
    gm, bufs = trace_mod(lambda s, b, h, q, kv: torch.exp2(slopes[h]) * s + table[q - kv + 63],
                         "score")
    index_values = (torch.zeros((), requires_grad=True),
                    *(torch.zeros((), dtype=torch.int32) for _ in range(4)))
    joint = create_fw_bw_graph(gm, index_values, tuple(bufs))[1]
    sources = buffer_grad_sources(joint, [BufferSpec.of(b) for b in bufs])
    spec = BackwardSiteSpec(("generic_bwd",), buffer_grads=(True, True), buffer_grad_mods=(
        ("tl", tuple(buffer_grad_items(s) for s in sources)),))
    parsed = BackwardSiteSpec.from_json(spec.to_json())
    assert parsed == spec and hash(parsed.build_key()) == hash(spec.build_key())
    back = parsed.buffer_grad_sources("tl")
    assert back == tuple(sources)
    for mine, theirs in zip(back, sources):
        assert mine.offset.info == theirs.offset.info
        assert (mine.value is None) == (theirs.value is None)
        if mine.value is not None:
            assert mine.value.info == theirs.value.info
    assert BackwardSiteSpec(("generic_bwd",)).buffer_grad_sources("tl") == ()
