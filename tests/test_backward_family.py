"""The backward-family interface wired into training (issue 19): templates/family.py's
BackwardFamily, the registry's backward list, the backward lowering and the op
``fa3_inductor::flex_bwd.families`` (runtime/ops_bwd.py).

CPU under Triton's interpreter (conftest sets it): the generic backward (templates/generic_bwd/)
serves every site it can; gradients through ``fa3_inductor.flex`` and
``torch.compile(backend="fa3")`` match float64 autograd under the tolerance rule
(tests/reference.py); captured tensors' gradients: tests/test_backward_buffers_wired.py. Sites it
cannot serve (a derivative or a captured tensor's gradient the generator cannot write) keep the
dense recompute, with the reason recorded and shown by explain(); a call a family refuses at run
time falls to the dense recompute inside the op.
"""

from __future__ import annotations

import logging
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

import fa3_inductor
from fa3_inductor import lowered_backward_sites, mods
from fa3_inductor.runtime.ops_bwd import last_backward_family
from fa3_inductor.templates import registry
from fa3_inductor.templates.family import BackwardSiteFacts, NotServed
from reference import assert_matches_reference, reference_attention, reference_gradients

pytestmark = pytest.mark.usefixtures("cpu_kernels", "fresh_compiles")


def _inputs(hq: int, hkv: int, m: int, n: int, d: int, dtype: torch.dtype):
    q = torch.randn(1, hq, m, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, hkv, n, d, dtype=dtype, requires_grad=True) for _ in range(2))
    return q, k, v


def _check_gradients(out, q, k, v, dtype, score_mod=None, mask_mod=None, captured=(),
                     make_score_mod=None) -> None:
    """Backward with a fresh random dO; output and gradients against float64 autograd."""
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_out, dq, dk, dv, dcap = reference_gradients(q, k, v, grad_out, score_mod, mask_mod,
                                                    captured=captured, make_score_mod=make_score_mod)
    assert_matches_reference(out, ref_out, dtype, "output")
    for name, t, ref in (("dq", q, dq), ("dk", k, dk), ("dv", v, dv)):
        assert_matches_reference(t.grad, ref, dtype, name)
    for t, ref in zip(captured, dcap):
        assert_matches_reference(t.grad, ref, dtype, "d captured")


def _last_backward() -> dict:
    sites = lowered_backward_sites()
    assert sites, "no backward site was lowered"
    return sites[-1]


def _assert_generic_served() -> None:
    site = _last_backward()
    assert (site["family"], site["kernel"]) == ("generic_bwd", "fa3_inductor.flex_bwd"), site
    assert last_backward_family() == "generic_bwd"   # and the op ran it (no fallback at run time)


# ------------------------------------------------------------------ the generic backward serves

CASES = {   # name: (score_mod, mask_mod, HQ, HKV, M, N, D, dtype)
    "noop": (None, None, 2, 2, 64, 64, 16, torch.float32),
    "causal-bf16": (None, mods.causal, 2, 2, 80, 80, 32, torch.bfloat16),
    "softcap": (mods.softcap(2.0), None, 2, 2, 64, 64, 16, torch.float32),   # small cap: it bites
    "alibi-bf16": (mods.alibi(2), None, 2, 2, 64, 64, 16, torch.bfloat16),   # additive: f' = 1
    "gqa-causal": (None, mods.causal, 2, 1, 64, 64, 32, torch.float32),
    "ragged-softcap-causal": (mods.softcap(2.0), mods.causal, 2, 2, 72, 90, 16, torch.float32),
}


@pytest.mark.parametrize("name", CASES)
def test_flex_gradients(name):
    score_mod, mask_mod, hq, hkv, m, n, d, dtype = CASES[name]
    q, k, v = _inputs(hq, hkv, m, n, d, dtype)
    out = fa3_inductor.flex(q, k, v, score_mod=score_mod, mask_mod=mask_mod, enable_gqa=hq != hkv)
    _check_gradients(out, q, k, v, dtype, score_mod, mask_mod)
    _assert_generic_served()


def test_block_sparse_mask_with_full_blocks():
    """A block mask of 16-blocks: full blocks (kept whole), partial ones (mask_mod) and dropped ones."""
    q, k, v = _inputs(2, 2, 96, 96, 16, torch.float32)
    window = mods.sliding_window(48)
    bm = create_block_mask(window, None, None, 96, 96, device="cpu", BLOCK_SIZE=16)
    listed = bm.full_kv_num_blocks + bm.kv_num_blocks
    assert bm.full_kv_num_blocks.sum() > 0 and bm.kv_num_blocks.sum() > 0 and listed.min() < 6
    out = fa3_inductor.flex(q, k, v, block_mask=bm)
    _check_gradients(out, q, k, v, torch.float32, mask_mod=window)
    _assert_generic_served()


def test_lse_gradient():
    """return_lse: a loss reading the LSE sends its gradient (log2 units) into the backward."""
    q, k, v = _inputs(2, 2, 64, 64, 16, torch.float32)
    out, lse = fa3_inductor.flex(q, k, v, score_mod=mods.softcap(2.0), mask_mod=mods.causal,
                                 return_lse=True)
    weights = torch.randn(64)
    (out.sum() + (lse * weights).sum()).backward()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_attention(*leaves, mods.softcap(2.0), mods.causal)
    (ref_out.sum() + (ref_lse * weights.double()).sum()).backward()
    for t, ref, name in zip((q, k, v), leaves, ("dq", "dk", "dv")):
        assert_matches_reference(t.grad, ref.grad, torch.float32, name)
    _assert_generic_served()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_sdpa_model(dtype):
    """torch.compile(backend="fa3") of a model calling SDPA: recognition fuses it, the generic
    backward computes its gradients."""
    q, k, v = _inputs(2, 1, 80, 80, 16, dtype)

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * 2.0

    out = torch.compile(attention, backend="fa3")(q, k, v)
    assert fa3_inductor.lowered_sites()[-1]["template"] == "generic"
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_out, dq, dk, dv, _ = reference_gradients(q, k, v, 2.0 * grad_out, mask_mod=mods.causal)
    assert_matches_reference(out, 2.0 * ref_out, dtype, "output")
    for name, t, ref in (("dq", q, dq), ("dk", k, dk), ("dv", v, dv)):
        assert_matches_reference(t.grad, ref, dtype, name)
    _assert_generic_served()


def test_compiled_flex_over_two_lengths():
    """flex() inside a compiled function; a second length recompiles with a symbolic one."""
    compiled = torch.compile(lambda q, k, v: fa3_inductor.flex(
        q, k, v, score_mod=mods.alibi(2), mask_mod=mods.causal), backend="fa3")
    for length in (64, 96):
        q, k, v = _inputs(2, 2, length, length, 16, torch.float32)
        _check_gradients(compiled(q, k, v), q, k, v, torch.float32, mods.alibi(2), mods.causal)
        _assert_generic_served()


# -------------------------------------------------------------- what it does not serve, and why

def test_unsupported_derivative_falls_back_with_its_reason(monkeypatch):
    """A derivative the generator cannot write keeps the site on the dense recompute (CPU)."""
    from fa3_inductor.lowering import flex_backward_lowering
    from fa3_inductor.templates.modgen import UnsupportedMod

    def refuse(joint_gm, n_buffers):
        raise UnsupportedMod("aten.made_up_backward is not supported")

    monkeypatch.setattr(flex_backward_lowering, "score_grad_graph", refuse)
    q, k, v = _inputs(2, 2, 64, 64, 16, torch.float32)
    out = fa3_inductor.flex(q, k, v, score_mod=mods.softcap(2.0), mask_mod=mods.causal)
    _check_gradients(out, q, k, v, torch.float32, mods.softcap(2.0), mods.causal)
    site = _last_backward()
    assert site["family"] == "dense" and site["kernel"] == "fa3_inductor.flex_bwd", site
    assert "mod not lowerable for the backward" in site["reason"]
    assert "made_up_backward" in site["reason"]


def _refuse_buffer_grads(monkeypatch) -> None:
    from fa3_inductor.lowering import flex_backward_lowering
    from fa3_inductor.templates.modgen import UnsupportedMod

    def refuse(joint_gm, buffers, dialect="tl"):
        raise UnsupportedMod("aten.made_up_index is not supported")

    monkeypatch.setattr(flex_backward_lowering, "buffer_grad_sources", refuse)


def test_unsupported_buffer_gradient_falls_back_with_its_reason(monkeypatch):
    """A learnable bias table whose gradient the generator cannot write keeps the dense recompute,
    which computes it."""
    _refuse_buffer_grads(monkeypatch)
    table = torch.randn(2, 8, requires_grad=True)

    def make(t):
        return lambda s, b, h, q_idx, kv_idx: s + t[h, torch.clamp((q_idx - kv_idx).abs(), max=7)]

    q, k, v = _inputs(2, 2, 64, 64, 16, torch.float32)
    out = fa3_inductor.flex(q, k, v, score_mod=make(table), mask_mod=mods.causal)
    _check_gradients(out, q, k, v, torch.float32, mask_mod=mods.causal, captured=(table,),
                     make_score_mod=make)
    site = _last_backward()
    assert site["family"] == "dense" and site["buffer_grads"] == 1, site
    assert "captured-tensor gradient not lowerable for the backward" in site["reason"]
    assert "made_up_index" in site["reason"]


class _Refusing:
    """A backward family that plans every site and refuses every call."""

    name = "refusing_bwd"
    dialect = "tl"

    def serves_backward(self, site: BackwardSiteFacts) -> Optional[str]:
        return None

    def prepare_backward(self, call):
        raise NotServed("refusing_bwd: refuses every call")

    def launch_backward(self, call) -> None:
        raise AssertionError("never reached")


def test_a_call_no_family_serves_runs_the_dense_recompute(monkeypatch):
    monkeypatch.setattr(registry, "_loaded_backward", [_Refusing()])
    q, k, v = _inputs(2, 2, 64, 64, 16, torch.float32)
    out = fa3_inductor.flex(q, k, v, score_mod=mods.softcap(2.0), mask_mod=mods.causal)
    _check_gradients(out, q, k, v, torch.float32, mods.softcap(2.0), mods.causal)
    assert _last_backward()["family"] == "refusing_bwd"   # planned ...
    assert last_backward_family() == "dense"              # ... and refused at run time


# ------------------------------------------------------------------------ options, records, registry

def test_deterministic_backward_option():
    """fa3.deterministic_backward: recorded; the generic backward's gradients repeat bit for bit."""
    compiled = torch.compile(lambda q, k, v: fa3_inductor.flex(q, k, v, mask_mod=mods.causal,
                                                               enable_gqa=True),
                             backend="fa3", options={"fa3.deterministic_backward": True})
    q, k, v = _inputs(2, 1, 80, 80, 16, torch.float32)
    grads = []
    for _ in range(2):
        for t in (q, k, v):
            t.grad = None
        compiled(q, k, v).sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v)])
    site = _last_backward()
    assert site["deterministic"] and "deterministic" in site["reason"], site
    _assert_generic_served()
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_torch_deterministic_algorithms_ask_the_same():
    """torch.use_deterministic_algorithms(True) makes our backward sites deterministic as the fa3 option does,
    through torch.compile and through the direct front door's backward plan."""
    import json

    from fa3_inductor.direct_bwd import cached_plan

    compiled = torch.compile(lambda q, k, v: fa3_inductor.flex(q, k, v, mask_mod=mods.causal, enable_gqa=True),
                             backend="fa3")
    q, k, v = _inputs(2, 1, 72, 72, 16, torch.float32)
    torch.use_deterministic_algorithms(True)
    try:
        compiled(q, k, v).sum().backward()
        site = _last_backward()
        plan = cached_plan(q, k, v, None, mods.causal, None)
    finally:
        torch.use_deterministic_algorithms(False)
    assert site["deterministic"] and "use_deterministic_algorithms" in site["reason"], site
    assert json.loads(plan.spec)["deterministic"]
    assert not json.loads(cached_plan(q, k, v, None, mods.causal, None).spec)["deterministic"]


def test_deterministic_backward_option_must_be_a_bool():
    from fa3_inductor.config import Settings

    with pytest.raises(ValueError, match="deterministic_backward"):
        Settings(deterministic_backward="yes")


def test_explain_shows_the_backward_family(monkeypatch):
    _refuse_buffer_grads(monkeypatch)   # the second site keeps the dense recompute
    table = torch.randn(2, 8, requires_grad=True)

    def two_sites(q, k, v):
        a = fa3_inductor.flex(q, k, v, mask_mod=mods.causal)
        return fa3_inductor.flex(a, k, v, score_mod=lambda s, b, h, q_idx, kv_idx:
                                 s + table[h, torch.clamp(q_idx - kv_idx, 0, 7)])

    report = fa3_inductor.explain(two_sites, *_inputs(2, 2, 64, 64, 16, torch.float32))
    first, second = report.sites
    assert first.backward == "generic_bwd" and first.training
    assert second.backward == "dense" and "made_up_index" in second.backward_reason
    text = str(report)
    assert "generic_bwd" in text and "backward: captured-tensor gradient not lowerable" in text


def test_registry_order_and_last_resorts(monkeypatch, caplog):
    names = [f.name for f in registry.backward_families()]
    assert "generic_bwd" in names
    assert names == [f for f in registry.BACKWARD_FOLDERS if f in names]   # the folders' order
    cpu = BackwardSiteFacts(torch.device("cpu"), torch.float32, 64, 64)
    fams, _ = registry.backward_candidates(cpu)
    assert [f.name for f in fams] == ["generic_bwd"]
    fams, _ = registry.backward_candidates(BackwardSiteFacts(   # it computes captured tensors' too
        torch.device("cpu"), torch.float32, 64, 64, buffer_grads=True, deterministic=True))
    assert [f.name for f in fams] == ["generic_bwd"]
    assert registry.backward_last_resort(torch.device("cpu")) == "dense"
    assert registry.backward_last_resort(torch.device("cuda")) == "torch"
    # A folder without a family module (one being written) is skipped without a warning.
    monkeypatch.setattr(registry, "BACKWARD_FOLDERS", ("not_written_yet_bwd", "generic_bwd"))
    monkeypatch.setattr(registry, "_loaded_backward", None)
    with caplog.at_level(logging.WARNING, logger="fa3_inductor"):
        assert [f.name for f in registry.backward_families()] == ["generic_bwd"]
    assert "not_written_yet_bwd" not in caplog.text


def test_the_generic_backward_serves_cuda_sites_torch_cannot_lower():
    """On CUDA the generic backward leaves plain sites to torch's faster kernel, but not the ones torch's
    lowering fails on (BackwardSiteFacts.torch_refuses, set by the lowering: tests/test_training.py's GPU
    cases)."""
    from fa3_inductor.templates.generic_bwd.family import GENERIC_BWD

    cuda = BackwardSiteFacts(torch.device("cuda"), torch.bfloat16, 16, 16)
    assert "torch's flex backward kernel is faster" in GENERIC_BWD.serves_backward(cuda)
    assert GENERIC_BWD.serves_backward(BackwardSiteFacts(torch.device("cuda"), torch.bfloat16, 16, 16,
                                                         torch_refuses=True)) is None


def test_a_score_mod_that_replaces_the_score_is_seen_as_gradless():
    """The joint graph of a score_mod that ignores the score gives it no gradient: the lowering marks such a
    site as one torch's lowering cannot take (it asserts there), and ours serve it with dS·0."""
    from torch._higher_order_ops.flex_attention import create_fw_bw_graph

    from fa3_inductor.lowering.flex_backward_lowering import _score_gradless
    from fa3_inductor.templates.modgen import trace_mod

    def joint(fn):
        gm, bufs = trace_mod(fn, "score")
        index_values = (torch.zeros((), requires_grad=True), *(torch.zeros((), dtype=torch.int32) for _ in range(4)))
        return create_fw_bw_graph(gm, index_values, tuple(bufs))[1]

    assert _score_gradless(joint(lambda s, b, h, q, kv: torch.tanh((q - kv) * 0.05)))
    assert not _score_gradless(joint(mods.softcap(2.0)))
