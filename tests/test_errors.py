"""fa3_inductor.flex rejects bad input with an error that names the argument."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

import fa3_inductor
from fa3_inductor import mods


def _qkv(B=1, H=2, S=64, D=32, dtype=torch.float32, Hkv=None):
    q = torch.randn(B, H, S, D, dtype=dtype)
    k = torch.randn(B, Hkv or H, S, D, dtype=dtype)
    return q, k, torch.randn_like(k)


@pytest.mark.parametrize("case, match", [
    (lambda q, k, v: fa3_inductor.flex(q[0], k, v), "q must be 4-D"),
    (lambda q, k, v: fa3_inductor.flex(q, k.half(), v), "share a dtype.*cast them"),
    (lambda q, k, v: fa3_inductor.flex(q, *fa3_inductor.quantize_kv(k, v)[:2]), "FP8 KV cache call .*flex_decode"),
    (lambda q, k, v: fa3_inductor.flex(q.to(torch.int32), k.to(torch.int32), v.to(torch.int32)),
     "dtype torch.int32 is not supported"),
    (lambda q, k, v: fa3_inductor.flex(q, k[..., :16], v[..., :16]), "k head dim 16 differs"),
    (lambda q, k, v: fa3_inductor.flex(q, k, v[:, :, :10]), "must agree in batch, heads and sequence"),
    (lambda q, k, v: fa3_inductor.flex(q, k, v, score_mod=3), "score_mod must be callable"),
    (lambda q, k, v: fa3_inductor.flex(q, k, v, mask_mod="causal"), "mask_mod must be callable"),
    (lambda q, k, v: fa3_inductor.flex(q, k, v, block_mask=torch.ones(2)), "block_mask must be a BlockMask"),
    (lambda q, k, v: fa3_inductor.flex(q, k, v, scale="big"), "scale must be a number"),
    (lambda q, k, v: fa3_inductor.flex(q, k, v, template="fastest"), "template must be one of"),
    (lambda q, k, v: fa3_inductor.flex(q, k, v, mask_mod=mods.causal,
                                       block_mask=create_block_mask(mods.causal, None, None, 64, 64,
                                                                    device="cpu")),
     "give mask_mod or block_mask, not both"),
])
def test_bad_input_names_the_argument(case, match):
    q, k, v = _qkv()
    with pytest.raises((TypeError, ValueError), match=match):
        case(q, k, v)


def test_gqa_needs_enable_gqa_and_divisible_heads():
    q, k, v = _qkv(H=4, Hkv=2)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        fa3_inductor.flex(q, k, v)
    q, k, v = _qkv(H=4, Hkv=3)
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        fa3_inductor.flex(q, k, v, enable_gqa=True)


def test_unsupported_head_dim_is_refused_clearly():
    q, k, v = _qkv(D=36)
    with pytest.raises(ValueError, match="head dim 36"):
        fa3_inductor.flex(q, k, v)


def test_mismatched_devices():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="one device"):
        fa3_inductor.flex(q, k, v.to("meta"))


@pytest.mark.parametrize("factory, arg, match", [
    (mods.sliding_window, 0, "window must be >= 1"),
    (mods.prefix_lm, -1, "prefix_len must be >= 0"),
    (mods.alibi, 0, "num_heads must be >= 1"),
    (mods.softcap, 0.0, "cap must be > 0"),
    (mods.document, torch.randn(8), "1-D integer tensor"),
])
def test_mod_factories_validate(factory, arg, match):
    with pytest.raises(ValueError, match=match):
        factory(arg)


def test_unknown_backend_option():
    with pytest.raises(Exception, match="unknown fa3 option 'fa3.templat'"):
        torch.compile(lambda x: x + 1, backend="fa3", options={"fa3.templat": "generic"})(
            torch.randn(3))


def test_a_mask_capturing_a_learnable_tensor_is_refused_clearly(cpu_kernels):
    """torch's flex autograd refuses a mask_mod whose captured tensors require grad, deep inside a compile; flex()
    says so up front (found by benchmarks/mod_fuzz.py --grad), and the same tensor read detached is served."""
    q, k, v = (t.requires_grad_() for t in _qkv())
    bias = torch.randn(2, requires_grad=True)
    with pytest.raises(ValueError, match=r"mask_mod captures 1 tensor\(s\) that require grad.*detached"):
        fa3_inductor.flex(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h],
                          mask_mod=lambda b, h, qi, ki: bias[h] > 0)
    fixed = bias.detach()
    out = fa3_inductor.flex(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h],
                            mask_mod=lambda b, h, qi, ki: fixed[h] > -10.0)
    assert out.shape == q.shape
