"""flex_varlen: packed variable-length sequences through the varlen kernel (CPU interpreter), the
dense torch path, input checks, and one compile-only sm90 build (``pytest -m sm90_compile``).

Every sequence is checked against the float64 reference run on that sequence alone, with the
README's tolerance rule (tests/reference.py).
"""

from __future__ import annotations

import pytest
import torch

from fa3_inductor import mods
from fa3_inductor.varlen import flex_varlen
from reference import (assert_lse_matches, assert_matches_reference, reference_attention,
                       reference_gradients)

# Ragged: empty, single-token, not multiples of the interpreter's 32-row tile, several tiles.
LENGTHS_Q = [5, 0, 70, 1, 33]
LENGTHS_K = [9, 3, 40, 1, 33]    # M != N per sequence (and a sequence with keys but no queries)


def _cu(lengths):
    return torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)


def _packed(lq, lk, hq, hkv, d, dv, dtype, requires_grad=False):
    q = torch.randn(sum(lq), hq, d, dtype=dtype)
    k = torch.randn(sum(lk), hkv, d, dtype=dtype)
    v = torch.randn(sum(lk), hkv, dv, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _sequence(t, cu, s):
    """Sequence s of a packed (tokens, heads, dim) tensor as (1, heads, len, dim)."""
    return t[int(cu[s]):int(cu[s + 1])].transpose(0, 1).unsqueeze(0)


def _check(out, lse, q, k, v, lq, lk, score_mod=None, mask_mod=None, scale=None):
    cu_q, cu_k = _cu(lq), _cu(lk)
    assert out.shape == (q.shape[0], q.shape[1], v.shape[2]) and out.dtype == q.dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    for s in range(len(lq)):
        if lq[s] == 0:
            continue
        # The mods see b = s: the reference calls them with batch index 0, so shift it.
        sm = score_mod and (lambda x, b, h, qi, ki, s=s: score_mod(x, b + s, h, qi, ki))
        mm = mask_mod and (lambda b, h, qi, ki, s=s: mask_mod(b + s, h, qi, ki))
        ref, ref_lse = reference_attention(_sequence(q, cu_q, s), _sequence(k, cu_k, s),
                                           _sequence(v, cu_k, s), sm, mm, scale)
        assert_matches_reference(_sequence(out, cu_q, s), ref, q.dtype, what=f"sequence {s}")
        assert_lse_matches(lse[:, int(cu_q[s]):int(cu_q[s + 1])].unsqueeze(0), ref_lse, q.dtype)


def _softcap_causal():
    return mods.softcap(5.0), mods.causal


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["none", "causal", "softcap_causal"])
def test_ragged_gqa_against_float64(cpu_kernels, dtype, variant):
    score_mod, mask_mod = {"none": (None, None), "causal": (None, mods.causal),
                           "softcap_causal": _softcap_causal()}[variant]
    q, k, v = _packed(LENGTHS_Q, LENGTHS_K, 4, 2, 32, 48, dtype)   # GQA 2:1, Dv != D
    out, lse = flex_varlen(q, k, v, _cu(LENGTHS_Q), _cu(LENGTHS_K), max(LENGTHS_Q),
                           max(LENGTHS_K), score_mod=score_mod, mask_mod=mask_mod,
                           enable_gqa=True, return_lse=True)
    _check(out, lse, q, k, v, LENGTHS_Q, LENGTHS_K, score_mod, mask_mod)


def test_fully_masked_rows_and_other_masks(cpu_kernels):
    """A strict-causal mask leaves each sequence's row 0 with no key (O 0, LSE -inf); a sliding
    window is a mask that is not causal (every KV tile masked); scale given."""
    lq = lk = [40, 1, 0, 66]
    q, k, v = _packed(lq, lk, 2, 2, 16, 16, torch.float16)
    strict = lambda b, h, q_idx, kv_idx: kv_idx < q_idx   # noqa: E731
    for mask_mod in (strict, mods.sliding_window(7)):
        out, lse = flex_varlen(q, k, v, _cu(lq), _cu(lk), 66, 66, mask_mod=mask_mod, scale=0.3,
                               return_lse=True)
        _check(out, lse, q, k, v, lq, lk, mask_mod=mask_mod, scale=0.3)
    out, lse = flex_varlen(q, k, v, _cu(lq), _cu(lk), 66, 66, mask_mod=strict, return_lse=True)
    starts = _cu(lq)[:-1][torch.tensor(lq) > 0].long()
    assert bool((out[starts] == 0).all()) and bool(lse[:, starts].isneginf().all())


def test_mods_see_sequence_index_and_buffers(cpu_kernels):
    """b is the sequence index: a per-sequence, per-head bias gathered from a captured tensor."""
    lq, lk = [3, 50, 17], [20, 50, 2]
    q, k, v = _packed(lq, lk, 2, 1, 16, 16, torch.float32)
    bias = torch.randn(3, 2)
    score_mod = lambda s, b, h, q_idx, kv_idx: s + bias[b, h] * (kv_idx - q_idx)   # noqa: E731
    out, lse = flex_varlen(q, k, v, _cu(lq), _cu(lk), 50, 50, score_mod=score_mod,
                           enable_gqa=True, return_lse=True)
    _check(out, lse, q, k, v, lq, lk, score_mod=score_mod)


def test_lse_optional_one_sequence_strided_qkv(cpu_kernels):
    """One sequence; q, k, v are views of one packed (tokens, 3, heads, dim) projection."""
    qkv = torch.randn(37, 3, 2, 16, dtype=torch.float16)
    q, k, v = qkv.unbind(1)
    out = flex_varlen(q, k, v, _cu([37]), _cu([37]), 37, 37, mask_mod=mods.causal)
    assert isinstance(out, torch.Tensor)
    _, lse = flex_varlen(q, k, v, _cu([37]), _cu([37]), 37, 37, mask_mod=mods.causal,
                         return_lse=True)
    _check(out, lse, q, k, v, [37], [37], mask_mod=mods.causal)


def test_under_torch_compile_the_call_stays_out_of_the_graph(cpu_kernels):
    """flex_varlen is torch.compiler.disable'd: Dynamo leaves the call out of its graphs instead of tracing its host
    logic (the step's graphs hold the `* 2` alone), and the compiled step (backend="fa3") gives the eager step's output
    and gradients."""
    lengths = [30, 0, 17]
    cu = _cu(lengths)
    torch.manual_seed(2)
    q, k, v = (torch.randn(47, h, 64, requires_grad=True) for h in (4, 2, 2))

    def step(q, k, v):
        return flex_varlen(q, k, v, cu, cu, 30, 30, mask_mod=mods.causal, enable_gqa=True) * 2

    explained = torch._dynamo.explain(step)(q, k, v)
    assert explained.op_count == 1, (explained.op_count, explained.graphs)
    compiled = torch.compile(step, backend="fa3")(q, k, v)
    grads = torch.autograd.grad(compiled.sum(), (q, k, v))
    eager = step(q, k, v)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    for got, want in zip(grads, torch.autograd.grad(eager.sum(), (q, k, v))):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_dense_path_matches_kernel_and_gives_gradients(cpu_kernels, monkeypatch):
    """The torch path (CPU without the interpreter) agrees with the kernel, and CPU inputs that
    need gradients get float64-accurate ones from it."""
    import fa3_inductor.varlen as varlen

    lq, lk = [6, 0, 21], [4, 2, 21]
    score_mod, mask_mod = _softcap_causal()
    q, k, v = _packed(lq, lk, 4, 2, 16, 32, torch.float32)
    args = (_cu(lq), _cu(lk), 21, 21)
    kernel_out = flex_varlen(q, k, v, *args, score_mod=score_mod, mask_mod=mask_mod,
                             enable_gqa=True)
    monkeypatch.setattr(varlen, "_runs_kernel", lambda q: False)
    out, lse = flex_varlen(q, k, v, *args, score_mod=score_mod, mask_mod=mask_mod,
                           enable_gqa=True, return_lse=True)
    _check(out, lse, q, k, v, lq, lk, score_mod, mask_mod)
    assert_matches_reference(out, kernel_out.double(), torch.float32, what="dense vs kernel")

    q, k, v = _packed(lq, lk, 4, 2, 16, 32, torch.float32, requires_grad=True)
    out = flex_varlen(q, k, v, *args, score_mod=score_mod, mask_mod=mask_mod, enable_gqa=True)
    grad_out = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
    cu_q, cu_k = _cu(lq), _cu(lk)
    for s in (0, 2):
        _, rdq, rdk, rdv, _ = reference_gradients(
            _sequence(q, cu_q, s), _sequence(k, cu_k, s), _sequence(v, cu_k, s),
            _sequence(grad_out, cu_q, s), score_mod, mask_mod)
        for name, got, ref, cu in (("dq", dq, rdq, cu_q), ("dk", dk, rdk, cu_k), ("dv", dv, rdv, cu_k)):
            assert_matches_reference(_sequence(got, cu, s), ref, torch.float32, what=f"{name} {s}")
    # sequence 1 has no queries: its keys get no gradient
    assert bool((dk[4:6] == 0).all()) and bool((dv[4:6] == 0).all())


@pytest.mark.parametrize("bad, message", [
    (lambda cu: cu.long(), "int32"),
    (lambda cu: cu.view(1, -1), "1-D"),
    (lambda cu: cu + 1, "run from 0"),
    (lambda cu: torch.tensor([0, 11, 10], dtype=torch.int32), "non-decreasing"),
    (lambda cu: torch.tensor([0, 10, 10], dtype=torch.int32), "max_seqlen_q"),
    (lambda cu: torch.tensor([0, 10], dtype=torch.int32)[:1], "B \\+ 1 >= 2"),
])
def test_bad_cu_seqlens_q(bad, message):
    q, k, v = _packed([4, 6], [4, 6], 2, 2, 16, 16, torch.float16)
    with pytest.raises(ValueError, match=message):
        flex_varlen(q, k, v, bad(_cu([4, 6])), _cu([4, 6]), 6, 6)


def test_bad_inputs():
    q, k, v = _packed([4, 6], [4, 6], 2, 1, 16, 16, torch.float16)
    cu = _cu([4, 6])
    with pytest.raises(ValueError, match="enable_gqa=True"):
        flex_varlen(q, k, v, cu, cu, 6, 6)
    with pytest.raises(ValueError, match="both are B \\+ 1"):
        flex_varlen(q, k, v, cu, _cu([4, 3, 3]), 6, 6, enable_gqa=True)
    with pytest.raises(ValueError, match="packed 3-D"):
        flex_varlen(q.unsqueeze(0), k, v, cu, cu, 6, 6, enable_gqa=True)
    with pytest.raises(ValueError, match="max_seqlen_k must be a Python int"):
        flex_varlen(q, k, v, cu, cu, 6, torch.tensor(6), enable_gqa=True)
    with pytest.raises(ValueError, match="head dim 12"):
        flex_varlen(q[..., :12], k[..., :12], v, cu, cu, 6, 6, enable_gqa=True)


@pytest.mark.sm90_compile
def test_sm90_compile_no_spills():
    """The sm90 build at D 64 (plain: the most registers there) and D 128 (softcap + causal)
    compiles with wgmma and without spills."""
    from fa3_inductor.templates.aot import sass_report
    from fa3_inductor.templates.modgen import BufferSpec, generate_mod_source, load_mod, trace_mod
    from fa3_inductor.templates.varlen.host import compile_varlen

    def tl_mod(fn, kind):
        gm, bufs = trace_mod(fn, kind)
        return load_mod(generate_mod_source(gm, kind, [BufferSpec.of(b) for b in bufs])), tuple(bufs)

    cu = torch.tensor([0, 300, 1024], dtype=torch.int32)
    reports = []
    for D, modded in ((64, False), (128, True)):
        q = torch.randn(1024, 4, D, dtype=torch.bfloat16)
        k = v = torch.randn(1024, 2, D, dtype=torch.bfloat16)
        options = {}
        if modded:
            options["score_mod"], options["score_bufs"] = tl_mod(mods.softcap(30.0), "score")
            options["mask_mod"], options["mask_bufs"] = tl_mod(mods.causal, "mask")
            options["causal"] = True
        ck = compile_varlen(q, k, v, torch.empty_like(q), torch.empty(4, 1024), cu, cu, 724,
                            sm_scale=D ** -0.5, **options)
        r = sass_report(ck)
        reports.append(f"D{D} {'softcap+causal' if modded else 'plain'}: {r.registers} registers, "
                       f"{r.hgmma} HGMMA, {r.spill_instructions} spills")
        assert r.stack == 0 and r.local == 0 and r.spill_instructions == 0, reports[-1]
        assert r.hgmma > 0, f"{reports[-1]}: no wgmma"
    print("\n".join(reports))
