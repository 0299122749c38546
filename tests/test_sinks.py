"""Attention sinks (gpt-oss): ``flex(..., sinks=)`` and the compiled path, forward and backward.

Under Triton's interpreter (conftest) our generic kernel adds the sinks in its epilogue; the backward
is the usual one on the combined (out, LSE) plus the sinks' gradient (runtime/sinks.py). References
are float64: softmax over the scores with the sink as an extra column, the column dropped (gpt-oss's
eager attention), under the README's tolerance rule (tests/reference.py).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import fa3_inductor
from fa3_inductor.integrations.hf_sinks import hf_sinks
from fa3_inductor.report import site_records

from reference import TOLERANCE, assert_lse_matches, assert_matches_reference

EPILOGUE = "attention sinks added in the kernel's epilogue"


def _reference(q, k, v, sinks, keep, cap):
    """float64 (out, natural-log LSE) with the sink as an extra score column per query head."""
    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, 1) for t in (k, v))
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    s = cap * torch.tanh(s / cap)
    s = s.masked_fill(~keep, -math.inf)
    column = sinks.view(1, -1, 1, 1).expand(*s.shape[:3], 1)
    logits = torch.cat([s, column], -1)
    probs = torch.softmax(logits, -1).nan_to_num(0.0)   # no key and a -inf sink: out 0, LSE -inf
    return probs[..., :-1] @ v, torch.logsumexp(logits, -1)


def test_flex_sinks_forward_and_backward_with_gqa_mask_and_softcap(cpu_kernels, fresh_compiles):
    torch.manual_seed(0)
    B, H, Hkv, M, D, cap = 2, 4, 2, 48, 16, 2.0
    q = torch.randn(B, H, M, D, requires_grad=True)
    k, v = (torch.randn(B, Hkv, M, D, requires_grad=True) for _ in range(2))
    sinks = torch.randn(H, requires_grad=True)
    empty_row = 5   # a query row that sees no key: out 0, LSE = its head's sink

    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx != empty_row)

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    out, lse = fa3_inductor.flex(q, k, v, score_mod=softcap, mask_mod=mask, enable_gqa=True,
                                 sinks=sinks, return_lse=True)
    keep = torch.ones(M, M, dtype=torch.bool).tril()
    keep[empty_row] = False
    ref_out, ref_lse = _reference(q, k, v, sinks, keep, cap)
    assert_matches_reference(out, ref_out, torch.float32, "out")
    assert torch.equal(out[:, :, empty_row], torch.zeros_like(out[:, :, empty_row]))
    assert_lse_matches(lse, ref_lse, torch.float32)
    assert torch.allclose(lse[0, :, empty_row], sinks.detach())
    lowered = fa3_inductor.lowered_sites()[-1]
    assert lowered["template"] == "generic" and EPILOGUE in lowered["note"], lowered

    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    ours = torch.autograd.grad((out * grad_out).sum() + (lse * grad_lse).sum(), (q, k, v, sinks))
    refs = torch.autograd.grad((ref_out * grad_out.double()).sum() + (ref_lse * grad_lse.double()).sum(),
                               (q, k, v, sinks))
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), ours, refs):
        assert_matches_reference(g, r, torch.float32, name)
    assert fa3_inductor.lowered_backward_sites()[-1]["family"] == "generic_bwd"


def test_flex_sinks_at_the_extremes(cpu_kernels, fresh_compiles):
    """A -inf sink adds nothing; a sink far above every score (its term past fp32's range in the kernel's
    exponent base) takes all the weight: out 0, LSE the sink; one in between shares the row. With a row that
    sees no key, and the exact correction of torch's own kernel (sink_combine) giving the same."""
    torch.manual_seed(2)
    B, H, M, D = 1, 4, 40, 16
    q, k, v = (torch.randn(B, H, M, D) for _ in range(3))
    sinks = torch.tensor([-math.inf, 0.5, 60.0, 200.0])
    empty_row = 3

    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx != empty_row)

    with torch.no_grad():
        out, lse = fa3_inductor.flex(q, k, v, mask_mod=mask, sinks=sinks, return_lse=True)
        plain, plain_lse = fa3_inductor.flex(q, k, v, mask_mod=mask, return_lse=True)
    keep = torch.ones(M, M, dtype=torch.bool).tril()
    keep[empty_row] = False
    ref_out, ref_lse = _reference(q, k, v, sinks, keep, cap=1e9)
    assert_matches_reference(out, ref_out, torch.float32, "out")
    assert_lse_matches(lse, ref_lse, torch.float32)
    assert torch.equal(out[:, 0], plain[:, 0]) and torch.equal(lse[:, 0], plain_lse[:, 0])
    assert torch.equal(out[:, 3], torch.zeros_like(out[:, 3]))
    assert torch.allclose(lse[:, 3], torch.full_like(lse[:, 3], 200.0))
    assert lse[0, 0, empty_row] == -math.inf and torch.allclose(lse[0, 1:, empty_row], sinks[1:])
    combined, combined_lse = torch.ops.fa3_inductor.sink_combine(plain, plain_lse / math.log(2), sinks)
    torch.testing.assert_close(combined, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(combined_lse * math.log(2), lse, rtol=1e-6, atol=1e-5)


def test_torch_dense_family_adds_the_sinks():
    """The last-resort family (templates/torch_dense, for sites our kernels failed to build) with GQA and sinks
    from -inf to far above the scores."""
    from fa3_inductor.templates.torch_dense.dense import dense_forward

    torch.manual_seed(3)
    q, k, v = torch.randn(2, 4, 20, 16), torch.randn(2, 2, 20, 16), torch.randn(2, 2, 20, 16)
    sinks = torch.tensor([-math.inf, 0.5, 3.0, 200.0])
    out, lse2, _ = dense_forward(q, k, v, (None,) * 4, [], [], 16 ** -0.5, 128, 128, None, None, sinks)
    ref_out, ref_lse = _reference(q, k, v, sinks, torch.ones(20, 20, dtype=torch.bool), cap=1e9)
    assert_matches_reference(out, ref_out, torch.float32, "out")
    assert_lse_matches(lse2 * math.log(2), ref_lse, torch.float32)


def test_sink_combine_is_exact_on_its_own():
    """The correction the compiled path applies after torch's kernel, and its three-op gradient."""
    torch.manual_seed(1)
    out, lse = torch.randn(2, 3, 5, 8, dtype=torch.float64), torch.randn(2, 3, 5, dtype=torch.float64)
    lse[0, 0, 0] = -math.inf   # a row with no key
    sinks = torch.randn(3, dtype=torch.float64, requires_grad=True)
    out.requires_grad_(), lse.requires_grad_()
    out_s, lse_t = torch.ops.fa3_inductor.sink_combine(out, lse, sinks)
    want_lse = torch.logaddexp2(lse, sinks.view(1, 3, 1) / math.log(2))
    want_out = out * torch.exp2(lse - want_lse).unsqueeze(-1)
    assert torch.allclose(lse_t, want_lse, rtol=1e-6) and torch.allclose(out_s, want_out, rtol=1e-6)
    assert out_s[0, 0, 0].abs().max() == 0 and torch.isclose(lse_t[0, 0, 0], sinks[0] / math.log(2))
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
    ours = torch.autograd.grad((out_s * g_out).sum() + (lse_t * g_lse).sum(), (out, lse, sinks))
    refs = torch.autograd.grad((want_out * g_out).sum() + (want_lse * g_lse).sum(), (out, lse, sinks))
    for g, r in zip(ours, refs):
        assert torch.allclose(g.double(), r, rtol=1e-5, atol=1e-6)


def test_flex_sinks_arguments_are_checked():
    """Each wrong input names what was wrong and what to pass instead."""
    q = torch.randn(1, 4, 16, 16)
    k = torch.randn(1, 2, 16, 16)
    with pytest.raises(ValueError, match=r"shape \(4,\), one logit per query head; got shape \(2,\).*not per "
                                         "key/value head"):
        fa3_inductor.flex(q, k, k, enable_gqa=True, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match=r"got shape \(1, 4, 1, 1\) \(pass sinks.reshape\(-1\)\)"):
        fa3_inductor.flex(q, q, q, sinks=torch.zeros(1, 4, 1, 1))
    with pytest.raises(ValueError, match=r"floating-point.*got torch.int64 \(pass sinks.float\(\)\)"):
        fa3_inductor.flex(q, q, q, sinks=torch.zeros(4, dtype=torch.long))
    with pytest.raises(TypeError, match=r"got list \(wrap it: torch.tensor"):
        fa3_inductor.flex(q, q, q, sinks=[0.0] * 4)
    with pytest.raises(ValueError, match="sinks are on meta, q/k/v on cpu; move them"):
        fa3_inductor.flex(q, q, q, sinks=torch.zeros(4, device="meta"))
    with pytest.raises(NotImplementedError, match="FP8 kernels do not add sinks; drop fp8="):
        fa3_inductor.flex(q, q, q, sinks=torch.zeros(4), fp8=True)


def test_hf_sinks_checks_what_transformers_passes():
    q = torch.randn(1, 4, 16, 16)
    assert hf_sinks(q, None) is None
    assert hf_sinks(q, torch.zeros(4)).shape == (4,)
    with pytest.raises(ValueError, match=r"shape \(2,\), expected one logit per query head, shape \(4,\)"):
        hf_sinks(q, torch.zeros(2))
    with pytest.raises(ValueError, match=r"torch.int64; .*\.float\(\)"):
        hf_sinks(q, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="on meta, the query on cpu; move"):
        hf_sinks(q, torch.zeros(4, device="meta"))
    with pytest.raises(NotImplementedError, match="fa3_fp8.*do not add them; use attn_implementation='fa3'"):
        hf_sinks(q, torch.zeros(4), fp8=object())


def _gpt_oss(attn_implementation="eager"):
    """A tiny gpt-oss (2 layers: a sliding-window one and a full one; batched experts, which compile without
    data-dependent shapes) with sinks far from 0, so that a site that dropped them fails: (the float64 eager
    reference, a float32 model with the same weights and ``attn_implementation``)."""
    transformers = pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, GptOssConfig

    transformers.logging.set_verbosity_error()
    cfg = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                       num_experts_per_tok=1, sliding_window=8, max_position_embeddings=64,
                       use_cache=False)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager",
                                           experts_implementation="batched_mm")
    with torch.no_grad():
        for module in ref.modules():
            if hasattr(module, "sinks"):
                module.sinks.normal_(0.0, 2.0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn_implementation,
                                             experts_implementation="batched_mm")
    model.load_state_dict(ref.state_dict())
    return ref.double().eval(), model.eval()


def _gpt_oss_inputs(seq=24):
    ids = torch.randint(1, 128, (2, seq), generator=torch.Generator().manual_seed(3))
    weights = torch.randn(2, seq, 128, generator=torch.Generator().manual_seed(4))
    return ids, weights


def _assert_gpt_oss_matches(ref_model, model, logits, ids, weights):
    """Logits and every parameter's gradient (the sinks' included) against the float64 eager model."""
    ref = ref_model(ids).logits
    assert_matches_reference(logits, ref, torch.float32, "logits")
    (ref * weights.double()).sum().backward()
    ours = dict(model.named_parameters())
    for name, p in ref_model.named_parameters():
        if p.grad is not None:
            assert_matches_reference(ours[name].grad, p.grad, torch.float32, f"d {name}")
    for i in range(2):
        sinks = ours[f"model.layers.{i}.self_attn.sinks"].grad
        assert sinks is not None and sinks.abs().sum() > 0


def test_gpt_oss_compiled_with_fa3_fuses_the_sinks_forward_and_backward(cpu_kernels, fresh_compiles):
    ref_model, model = _gpt_oss()
    ids, weights = _gpt_oss_inputs()
    # Inductor's vectorized C++ kernels (torch 2.13, CPU) get this model's batched-experts backward wrong with
    # backend="inductor" alone too (wrong expert gradients or a corrupted heap): scalar kernels here.
    with torch._inductor.config.patch({"cpp.simdlen": 1}):
        out = torch.compile(model, backend="fa3")(ids).logits
        (out * weights).sum().backward()
    _assert_gpt_oss_matches(ref_model, model, out, ids, weights)

    recognized, lowered = site_records()
    assert [(s.rewritten, "attention sinks" in s.score_mods) for s in recognized] == [(True, True)] * 2, \
        [s.as_dict() for s in recognized]
    assert {s.mask for s in recognized} == {"causal", "sliding_window 8"}
    assert [s.template for s in lowered] == ["generic"] * 2 and all(EPILOGUE in s.note for s in lowered)
    assert [s["family"] for s in fa3_inductor.lowered_backward_sites()] == ["generic_bwd"] * 2


def test_explain_shows_the_sinks_of_gpt_oss(cpu_kernels, fresh_compiles):
    _, model = _gpt_oss()
    ids, _ = _gpt_oss_inputs(16)
    with torch.no_grad():
        report = fa3_inductor.explain(model, ids)
    assert report.fused_count == 2 and report.served_count == 2 and not report.unfused, str(report)
    assert all("attention sinks" in s.score_mods and EPILOGUE in s.note for s in report.sites), str(report)
    assert "attention sinks" in str(report)


def test_gpt_oss_attn_implementation_fa3_adds_the_sinks(cpu_kernels, fresh_compiles):
    from fa3_inductor.integrations import transformers as fa3_hf

    fa3_hf.register()
    ref_model, model = _gpt_oss("fa3")
    ids, weights = _gpt_oss_inputs()
    out = model(ids).logits
    (out * weights).sum().backward()
    _assert_gpt_oss_matches(ref_model, model, out, ids, weights)
    assert fa3_inductor.last_template() == "generic"


@pytest.mark.gpu
@pytest.mark.parametrize("D,dtype,B", [(64, torch.float16, 2), (128, torch.bfloat16, 2), (128, torch.bfloat16, 4)],
                         ids=["d64-fp16", "d128-bf16", "d128-bf16-persistent"])
def test_hopper_kernel_adds_the_sinks(D, dtype, B):
    """The Hopper epilogue's sink term (one CTA per tile, and B=4: 256 tiles, the persistent schedule), with a -inf
    sink (nothing added) and one far above the scores (out 0, LSE the sink) among random ones."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper template runs on sm90")
    torch.manual_seed(0)
    H, Hkv, M = 8, 2, 1000
    q = torch.randn(B, H, M, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(B, Hkv, M, D, device="cuda", dtype=dtype) for _ in range(2))
    sinks = torch.randn(H, device="cuda") * 3
    sinks[0], sinks[1] = -math.inf, 200.0
    with torch.no_grad():
        out, lse = fa3_inductor.flex(q, k, v, mask_mod=fa3_inductor.mods.causal, enable_gqa=True,
                                     sinks=sinks, return_lse=True)
    assert fa3_inductor.last_template() == "hopper"
    keep = torch.ones(M, M, dtype=torch.bool, device="cuda").tril()
    ref_out, ref_lse = _reference(q, k, v, sinks, keep, cap=1e9)
    assert out.dtype == dtype
    assert_matches_reference(out, ref_out, dtype, "out")
    assert_lse_matches(lse, ref_lse, dtype)
    assert torch.equal(out[:, 1], torch.zeros_like(out[:, 1]))
    assert torch.allclose(lse[:, 1], torch.full_like(lse[:, 1], 200.0))
    assert TOLERANCE[dtype] > 0
