"""flex_varlen's gradients on an sm90 GPU (the sm90 backward's packed mode, templates/hopper_bwd/varlen.py) against
float64 autograd run on each sequence alone (tests/reference.py's tolerance rule): dq, dk, dv of ragged GQA packs
with empty and one-token sequences, M != N both ways, lengths on and off the tiles, head dims 64 to 256 and 192 / 128
(the wide kernel); no mask, causal (the diagonal
walk), softcap with causal (a score_mod derivative), ALiBi, causal windows (their walk, windows shorter than a tile,
cutting tiles, on tile edges, longer than the sequences), prefix-LM (the mask on every tile); the LSE's gradient;
keys no query reaches get zero gradients; what it does not serve takes the document-mask path, right too.

    pytest -m gpu tests/test_varlen_bwd_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from fa3_inductor import mods
from fa3_inductor.varlen import flex_varlen
from reference import TOLERANCE, assert_matches_reference, reference_attention, reference_gradients
from test_varlen import _cu, _sequence

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the varlen backward needs an sm90 GPU")]

# empty, one token, one row past a tile, exactly a tile, several tiles; keys shorter and longer than queries, none
LENGTHS_Q = [5, 0, 300, 1, 128, 257, 40, 3]
LENGTHS_K = [9, 3, 200, 1, 128, 400, 0, 70]
VARIANTS = {"none": (None, None), "causal": (None, mods.causal), "softcap_causal": (mods.softcap(20.0), mods.causal),
            "alibi": (mods.alibi(4), None), "window": (None, mods.sliding_window(50)),
            "prefix_lm": (None, mods.prefix_lm(70))}


def _leaves(lq, lk, hq, hkv, d, dtype, dv=None):
    return [torch.randn(sum(n), h, dim, device="cuda", dtype=dtype).requires_grad_()
            for n, h, dim in ((lq, hq, d), (lk, hkv, d), (lk, hkv, dv or d))]


def _per_sequence(fn, s):
    """A mod as the reference sees sequence s alone (batch index 0 there, s in the pack)."""
    if fn is None:
        return None
    if fn.__code__.co_argcount == 5:
        return lambda x, b, h, qi, ki: fn(x, b + s, h, qi, ki)
    return lambda b, h, qi, ki: fn(b + s, h, qi, ki)


def _check_grads(q, k, v, dout, lq, lk, score_mod, mask_mod, scale=None):
    """dq, dk, dv against float64 autograd per sequence. The tolerance rule applies to each whole packed gradient, and
    each sequence's error is held to the same bound against that gradient's norm (a short sequence's reference can
    vanish by cancellation: one key gives dS = P (dP - rowsum(dO O)) = 0 in float64, not in bf16). Sequences with no
    query or no key have exactly zero gradients."""
    cu_q, cu_k = _cu(lq), _cu(lk)
    refs = {name: torch.zeros(t.shape, dtype=torch.float64, device=t.device) for name, t in (("dq", q), ("dk", k),
                                                                                              ("dv", v))}
    for s in range(len(lq)):
        got = {"dq": _sequence(q.grad, cu_q, s), "dk": _sequence(k.grad, cu_k, s), "dv": _sequence(v.grad, cu_k, s)}
        if lq[s] == 0 or lk[s] == 0:   # no query sees a key
            for name, g in got.items():
                assert not bool(g.any()), f"sequence {s} {name}: nonzero gradient with no query-key pair"
            continue
        _, dq_r, dk_r, dv_r, _ = reference_gradients(
            _sequence(q, cu_q, s), _sequence(k, cu_k, s), _sequence(v, cu_k, s),
            _sequence(dout, cu_q, s), _per_sequence(score_mod, s), _per_sequence(mask_mod, s), scale)
        for name, ref in (("dq", dq_r), ("dk", dk_r), ("dv", dv_r)):
            _sequence(refs[name], cu_q if name == "dq" else cu_k, s).copy_(ref)
    tol = TOLERANCE[q.dtype]
    for name, t, cu in (("dq", q, cu_q), ("dk", k, cu_k), ("dv", v, cu_k)):
        assert_matches_reference(t.grad, refs[name], q.dtype, what=name)
        norm = refs[name].norm().item() or 1.0   # (a zero reference, a window of one key's dq and dk: absolute)
        for s in range(len(lq)):
            err = (_sequence(t.grad, cu, s).double() - _sequence(refs[name], cu, s)).norm().item() / norm
            assert err <= tol, f"sequence {s} {name}: error {err:.2e} of the gradient's norm > {tol:.0e}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("head_dims", [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)])
def test_ragged_gqa_gradients_against_float64(head_dims, variant):
    score_mod, mask_mod = VARIANTS[variant]
    torch.manual_seed(0)
    q, k, v = _leaves(LENGTHS_Q, LENGTHS_K, 4, 2, head_dims[0], torch.bfloat16, head_dims[1])
    out = flex_varlen(q, k, v, _cu(LENGTHS_Q).cuda(), _cu(LENGTHS_K).cuda(), max(LENGTHS_Q), max(LENGTHS_K),
                      score_mod=score_mod, mask_mod=mask_mod, enable_gqa=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    _check_grads(q, k, v, dout, LENGTHS_Q, LENGTHS_K, score_mod, mask_mod)


def test_fp16_causal_scale_and_long_sequences():
    """fp16, a given scale, sequences of several KV tiles whose last tile holds the next sequence's keys."""
    lq = lk = [1000, 37, 700]
    torch.manual_seed(1)
    q, k, v = _leaves(lq, lk, 8, 8, 128, torch.float16)
    out = flex_varlen(q, k, v, _cu(lq).cuda(), _cu(lk).cuda(), 1000, 1000, mask_mod=mods.causal, scale=0.05)
    dout = torch.randn_like(out)
    out.backward(dout)
    _check_grads(q, k, v, dout, lq, lk, None, mods.causal, scale=0.05)


@pytest.mark.parametrize("head_dims,window", [((128, 128), 1), ((128, 128), 64), ((128, 128), 300),
                                              ((128, 128), 2000), ((64, 64), 300), ((64, 64), 129),
                                              ((192, 128), 300), ((256, 256), 100)])
def test_causal_windows_walk_from_the_diagonal_to_their_edge(monkeypatch, head_dims, window):
    """Sequences of many KV tiles under a causal window: the backward is launched with the window (its walk: the
    diagonal and edge tiles masked, the tiles between not) and every gradient matches float64. Windows of one key,
    of a whole number of 64-row steps, cutting steps, and longer than every sequence (causal)."""
    from fa3_inductor import varlen_grad

    seen = []
    launch = varlen_grad.launch_varlen_backward
    monkeypatch.setattr(varlen_grad, "launch_varlen_backward",
                        lambda *args, **kw: seen.append(kw.get("window")) or launch(*args, **kw))
    lq, lk = [1000, 0, 1, 700, 64, 333], [1000, 5, 1, 650, 64, 400]
    torch.manual_seed(2)
    q, k, v = _leaves(lq, lk, 4, 2, head_dims[0], torch.bfloat16, head_dims[1])
    mask = mods.sliding_window(window)
    out = flex_varlen(q, k, v, _cu(lq).cuda(), _cu(lk).cuda(), max(lq), max(lk), mask_mod=mask, enable_gqa=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert seen == [window]
    _check_grads(q, k, v, dout, lq, lk, None, mask)


def test_lse_gradient():
    """A loss on the returned (natural-log) LSE as well as on the output."""
    lq, lk = [130, 7, 64], [100, 7, 200]
    torch.manual_seed(2)
    q, k, v = _leaves(lq, lk, 4, 2, 64, torch.bfloat16)
    out, lse = flex_varlen(q, k, v, _cu(lq).cuda(), _cu(lk).cuda(), 130, 200, mask_mod=mods.causal, enable_gqa=True,
                           return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.autograd.backward((out, lse), (dout, dlse))
    cu_q, cu_k = _cu(lq), _cu(lk)
    for s in range(len(lq)):
        leaves = [_sequence(t, cu, s).detach().double().requires_grad_() for t, cu in ((q, cu_q), (k, cu_k),
                                                                                       (v, cu_k))]
        ref, ref_lse = reference_attention(*leaves, mask_mod=mods.causal)
        rows = slice(int(cu_q[s]), int(cu_q[s + 1]))
        grads = torch.autograd.grad((ref, ref_lse), leaves, (_sequence(dout, cu_q, s).double(),
                                                             dlse[:, rows].unsqueeze(0).double()))
        for name, got, want in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), grads):
            assert_matches_reference(_sequence(got, cu_q if name == "dq" else cu_k, s), want, q.dtype,
                                     what=f"sequence {s} {name}")


@pytest.mark.parametrize("case", ["head_dim_112", "bias_that_learns"])
def test_what_the_packed_backward_does_not_serve_takes_the_document_mask(case):
    """A head dim without backward tiles and a mod's captured tensor that needs a gradient: flex() over the pack with a
    document mask gives the gradients (q, k, v, and the bias's), against the dense path in float64 on the CPU."""
    from fa3_inductor.varlen import _dense

    lengths = [10, 1, 130]
    d = 112 if case == "head_dim_112" else 64
    torch.manual_seed(4)
    q, k, v = _leaves(lengths, lengths, 4, 2, d, torch.bfloat16)
    bias = torch.randn(4, device="cuda", requires_grad=case == "bias_that_learns")
    cu = _cu(lengths)
    out = flex_varlen(q, k, v, cu.cuda(), cu.cuda(), 130, 130, mask_mod=mods.causal, enable_gqa=True,
                      score_mod=lambda s, b, h, qi, ki: s + bias[h] * (ki - qi) / 64)
    dout = torch.randn_like(out)
    out.backward(dout)
    leaves64 = [t.detach().cpu().double().requires_grad_() for t in (q, k, v, bias)]
    ref, _ = _dense(*leaves64[:3], cu, cu, lambda s, b, h, qi, ki: s + leaves64[3][h] * (ki - qi) / 64, mods.causal,
                    d ** -0.5, True)
    ref.backward(dout.cpu().double())
    for name, got, want in zip(("dq", "dk", "dv", "dbias"), (q.grad, k.grad, v.grad, bias.grad), leaves64):
        if name == "dbias" and case != "bias_that_learns":
            continue
        assert_matches_reference(got.cpu(), want.grad, q.dtype, what=name)


@pytest.mark.parametrize("window", [None, 96])
def test_transformers_packed_training_takes_the_varlen_backward(monkeypatch, window):
    """attn_implementation="fa3"'s packed path with gradients on CUDA, causal and sliding-window layers (Mistral's):
    flex_varlen's kernels (flex() with a document mask is not called), the same gradients as each sequence alone in
    float64."""
    from fa3_inductor.integrations import transformers as integration

    monkeypatch.setattr(integration, "flex", lambda *a, **kw: pytest.fail("the document-mask path ran"))

    lengths = [100, 1, 250, 37]
    torch.manual_seed(3)
    query, key, value = (torch.randn(1, h, sum(lengths), 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
                         for h in (4, 2, 2))
    cu = _cu(lengths).cuda()
    out = integration._packed_attention(query, key, value, (cu, cu, max(lengths), max(lengths)), None, None,
                                        window=window)
    dout = torch.randn_like(out)
    out.backward(dout)
    q, k, v = (t.detach()[0].transpose(0, 1).requires_grad_() for t in (query, key, value))
    for leaf, t in zip((q, k, v), (query, key, value)):
        leaf.grad = t.grad[0].transpose(0, 1)
    _check_grads(q, k, v, dout[0], lengths, lengths, None, mods.sliding_window(window) if window else mods.causal)


def test_a_repeated_call_relaunches_on_new_lengths_and_tensors():
    """The second call of a kind re-launches the first one's recorded launches (no planning): right for new tensors
    and new sequence lengths of the same shapes (the lengths are read on the device)."""
    from fa3_inductor.runtime import fast_launch

    first, second = [100, 156, 0, 44], [1, 255, 44, 0]
    for lengths in (first, second):
        torch.manual_seed(len(lengths) + lengths[0])
        q, k, v = _leaves(lengths, lengths, 4, 2, 128, torch.bfloat16)
        hits = fast_launch.stats()["relaunches"]
        out = flex_varlen(q, k, v, _cu(lengths).cuda(), _cu(lengths).cuda(), 256, 256, mask_mod=mods.causal,
                          enable_gqa=True)
        dout = torch.randn_like(out)
        out.backward(dout)
        _check_grads(q, k, v, dout, lengths, lengths, None, mods.causal)
    assert fast_launch.stats()["relaunches"] >= hits + 4   # the forward and the backward's three launches


def test_packed_training_under_torch_compile(monkeypatch):
    """A step calling flex_varlen compiled with backend="fa3" (torch.compiler.disable: the call stays out of its
    graphs): its gradients are right against float64, as in eager mode, and the packed kernels ran (the document-mask
    fallback did not)."""
    from fa3_inductor import varlen

    monkeypatch.setattr(varlen, "through_document_mask", lambda *a, **kw: pytest.fail("the document-mask path ran"))
    lengths = [300, 0, 129, 64]
    torch.manual_seed(4)
    q, k, v = _leaves(lengths, lengths, 4, 2, 128, torch.bfloat16)
    cu = _cu(lengths).cuda()

    def attend(q, k, v):
        return flex_varlen(q, k, v, cu, cu, max(lengths), max(lengths), mask_mod=mods.causal, enable_gqa=True)

    out = torch.compile(attend, backend="fa3")(q, k, v)
    dout = torch.randn_like(out)
    out.backward(dout)
    _check_grads(q, k, v, dout, lengths, lengths, None, mods.causal)
