"""Score mods with huge finite values (LongT5's -1e10 masks): the online softmax stays finite.

A GPU kernel's contracted `s * c - m` FFMA overflowed exp2 once |m| passed ~2^31 (NaN on every row
of LongT5's local attention, measured on an H100); WIDE_SCORES sites round the product first
(fa3_inductor/templates/wide_scores.py). CPU: which mods are wide, and that the sm90 builds round
(PTX mul.rn) only for them. GPU: each family's output against float64.
"""
from __future__ import annotations

import re

import pytest
import torch

from fa3_inductor import mods
from fa3_inductor.templates.modgen import BufferSpec, generate_mod_source, trace_mod
from tests.reference import TOLERANCE, reference_attention, rel_error

MASK_VALUE = -1e10


def _info(fn, dialect="tl"):
    gm, bufs = trace_mod(fn, "score")
    return generate_mod_source(gm, "score", [BufferSpec.of(b) for b in bufs], dialect).info


def _local_visibility(M: int, N: int, device="cpu") -> torch.Tensor:
    """[M, N] bool: even rows see 16 keys in the second 128-key block (their first block is all
    masked, the case that overflowed); odd rows see nothing (eager: uniform weights)."""
    q = torch.arange(M, device=device)[:, None]
    kv = torch.arange(N, device=device)[None, :]
    return (q % 2 == 0) & (kv >= 128 + q % 64) & (kv < 144 + q % 64)


def _masked_bias(visible: torch.Tensor, bias: torch.Tensor):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h] + torch.where(visible[q_idx, kv_idx], 0.0, MASK_VALUE)
    return score_mod


def test_wide_means_unbounded_values_only():
    visible, bias = torch.ones(8, 8, dtype=torch.bool), torch.randn(4)
    table = torch.randn(4, 8, 8)
    assert _info(_masked_bias(visible, bias)).wide                             # -1e10 literal
    assert _info(lambda s, b, h, q, kv: s + table[h, q, kv]).wide               # float buffer
    assert not _info(mods.alibi(4)).wide                                         # index math only
    assert not _info(mods.relative_bias).wide
    assert not _info(mods.softcap(30.0)).wide                                    # bounded by tanh
    assert not _info(lambda s, b, h, q, kv: 20.0 * torch.tanh(s + table[h, q, kv])).wide


def _launch_args(D, M=128, N=384, H=2):
    q, k, v = (torch.randn(1, H, n, D, dtype=torch.bfloat16) for n in (M, N, N))
    return q, k, v, torch.empty_like(q), torch.empty(1, H, M), torch.empty(1, H, M)


@pytest.mark.sm90_compile
def test_generic_sm90_build_rounds_only_wide_mods():
    from fa3_inductor.templates.generic.host import compile_generic
    from fa3_inductor.templates.modgen import load_mod

    visible, bias = _local_visibility(128, 384), torch.randn(2)
    q, k, v, o, lse, mx = _launch_args(16)
    for fn, wide in ((_masked_bias(visible, bias), True), (mods.alibi(2), False)):
        gm, bufs = trace_mod(fn, "score")
        mod = load_mod(generate_mod_source(gm, "score", [BufferSpec.of(b) for b in bufs], "tl"), "tl")
        ptx = compile_generic(q, k, v, o, lse, mx, sm_scale=0.25, score_mod=mod,
                              score_bufs=tuple(bufs)).asm["ptx"]
        assert ("mul.rn.f32" in ptx) == wide, fn


@pytest.mark.sm90_compile
def test_hopper_sm90_build_rounds_wide_mods_without_spills():
    from fa3_inductor.templates.aot import sass_report
    from fa3_inductor.templates.hopper import compile_sm90
    from fa3_inductor.templates.modgen import load_mod

    visible, bias = _local_visibility(128, 384), torch.randn(2)
    q, k, v, o, lse, mx = _launch_args(64)
    gm, bufs = trace_mod(_masked_bias(visible, bias), "score")
    mod = load_mod(generate_mod_source(gm, "score", [BufferSpec.of(b) for b in bufs], "gl"), "gl")
    ck = compile_sm90(q, k, v, o, lse, mx, sm_scale=0.125, score_mod=mod, score_bufs=tuple(bufs))
    rep = sass_report(ck)
    assert len(re.findall(r"mul\.rn\.f32", ck.asm["ptx"])) >= 32
    assert rep.spill_instructions == 0 and rep.local == 0 and "HGMMA" in rep.sass


def test_generic_backward_takes_wide_cuda_sites_from_torch():
    from fa3_inductor.lowering.flex_backward_lowering import _wide_scores, BackwardGraphs
    from fa3_inductor.templates.family import BackwardSiteFacts
    from fa3_inductor.templates.generic_bwd.family import GENERIC_BWD

    cuda = torch.device("cuda")
    assert GENERIC_BWD.serves_backward(BackwardSiteFacts(cuda, torch.bfloat16, 64, 64)) is not None
    assert GENERIC_BWD.serves_backward(BackwardSiteFacts(cuda, torch.bfloat16, 64, 64,
                                                         wide_scores=True)) is None
    visible, bias = _local_visibility(128, 384), torch.randn(2)
    for fn, wide in ((_masked_bias(visible, bias), True), (mods.alibi(2), False)):
        gm, bufs = trace_mod(fn, "score")
        graphs = BackwardGraphs(gm, None, None, [BufferSpec.of(b) for b in bufs], [], (), None, None)
        assert _wide_scores(graphs) == wide


@pytest.mark.gpu
@pytest.mark.parametrize("template,D,M", [("generic", 16, 128), ("hopper", 64, 128),
                                          ("decode", 64, 1), ("auto", 128, 256)])
def test_huge_mask_values_stay_finite_on_the_gpu(template, D, M):
    import fa3_inductor
    from tests.reference import reference_gradients

    if template == "hopper" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper template needs sm90")
    dev, N, H = "cuda", 384, 2
    visible = _local_visibility(max(M, 2), N, dev)[:M]
    if M == 1:
        visible[0, 130:140] = True
    bias = torch.randn(H, device=dev)
    mod = _masked_bias(visible, bias)
    q, k, v = (torch.randn(1, H, n, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
               for n in (M, N, N))
    out = fa3_inductor.flex(q, k, v, score_mod=mod, template=template)
    assert torch.isfinite(out).all(), f"{int((~torch.isfinite(out)).sum())} non-finite outputs"
    seen = visible.any(-1)
    # The backward, with the rows that see no key left out of the loss as LongT5 discards them
    # (their float32 LSE cannot hold log2 of the key count under -1e10: no gradient is asked of them)
    dout = torch.randn_like(out) * seen[None, None, :, None]
    out.backward(dout)
    ref, dq, dk, dv, _ = reference_gradients(q, k, v, dout, score_mod=mod)
    # rows with a visible key against float64; the others are a uniform mix in float32 arithmetic
    # (float64 still resolves q.k under -1e10), so only finiteness is asked of them
    assert rel_error(out[:, :, seen], ref[:, :, seen]) <= TOLERANCE[torch.bfloat16]
    for name, got, want in (("dq", q.grad, dq), ("dk", k.grad, dk), ("dv", v.grad, dv)):
        assert rel_error(got, want) <= TOLERANCE[torch.bfloat16], name
