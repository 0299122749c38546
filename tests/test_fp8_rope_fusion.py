"""RoPE fused into the FP8 prologue on the compiled path (fa3_inductor/recognition/rope_fusion.py).

With ``options={"fa3.fp8": True}``, a site whose q and k the model rotates right before attention
runs ``fa3_inductor::flex_fwd_fp8_rope`` on q and k before RoPE: the prologue rotates them, and the
model's RoPE over q and k is gone from the generated code. Each model here is checked against a
float64 reference of the model's own arithmetic (FP8 tolerance rule of tests/reference.py), its
explain() line, and its generated code. CPU: the prologue and the FP8 kernel run under Triton's
interpreter (conftest sets TRITON_INTERPRET=1 without a GPU).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fa3_inductor
from fa3_inductor import mods
from reference import FP8_TOLERANCE, reference_attention, rel_error

B, H, S, D = 1, 2, 128, 64
FP8 = {"fa3.fp8": True}
FUSED_OP = "torch.ops.fa3_inductor.flex_fwd_fp8_rope"
UNFUSED_OP = "torch.ops.fa3_inductor.flex_fwd_fp8.default"


# ---------------------------------------------------------------------------------------------
# Models: RoPE spelled as model code spells it, then attention
# ---------------------------------------------------------------------------------------------

def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


class HalfRope(torch.nn.Module):
    """transformers' rotate_half RoPE on [B, H, S, D] q and k, then causal SDPA."""

    def forward(self, q, k, v, cos, sin):
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class InterleavedRope(torch.nn.Module):
    """GPT-J's rotate_every_two, tables [S, D/2] repeated pairwise in the model."""

    def forward(self, q, k, v, cos_half, sin_half):
        cos, sin = (t.repeat_interleave(2, dim=-1) for t in (cos_half, sin_half))
        q = q * cos + rotate_every_two(q) * sin
        k = k * cos + rotate_every_two(k) * sin
        return F.scaled_dot_product_attention(q, k, v)


class ComplexRope(torch.nn.Module):
    """Meta's complex multiply (float32), with q and k kept in attention's [B, H, S, D] layout."""

    def forward(self, q, k, v, freqs_cis):
        def rope(x):
            pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(pairs * freqs_cis).flatten(3).type_as(x)

        return F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)


class PartialRope(torch.nn.Module):
    """Partial rotary (GPT-NeoX, Phi): the first R channels rotated, the rest passed through."""

    def forward(self, q, k, v, cos, sin):
        def rope(x):
            rot, rest = x[..., : cos.shape[-1]], x[..., cos.shape[-1]:]
            return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)

        return F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)


class HalfRopeKeepsK(torch.nn.Module):
    """HalfRope that also returns the rotated k (what a KV cache stores)."""

    def forward(self, q, k, v, cos, sin):
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return F.scaled_dot_product_attention(q, k, v, is_causal=True), k


class RopeThenTranspose(torch.nn.Module):
    """RoPE on [B, S, H, D] (transformers' unsqueeze_dim=2), transposed for attention after it."""

    def forward(self, q, k, v, cos, sin):
        cos, sin = cos[:, None], sin[:, None]
        q = (q * cos + rotate_half(q) * sin).transpose(1, 2)
        k = (k * cos + rotate_half(k) * sin).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


KEY_BIAS = torch.randn(H, S, generator=torch.Generator().manual_seed(8))   # captured by the mod


def softcap_key_bias(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0) + KEY_BIAS[h, kv_idx]


class FlexWithRope(torch.nn.Module):
    """A flex_attention call the user wrote, after RoPE: a score_mod with a captured buffer and a
    block mask passed in."""

    def forward(self, q, k, v, cos, sin, block_mask):
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return flex_attention(q, k, v, score_mod=softcap_key_bias, block_mask=block_mask)


# ---------------------------------------------------------------------------------------------
# Inputs and references
# ---------------------------------------------------------------------------------------------

def qkv(seed, layout="bhsd", device="cpu"):
    g = torch.Generator().manual_seed(seed)
    shape = (B, H, S, D) if layout == "bhsd" else (B, S, H, D)
    q, k = (torch.randn(shape, generator=g) for _ in range(2))
    v = torch.randn(B, H, S, D, generator=g)
    return tuple(t.to(device, torch.bfloat16) for t in (q, k, v))


def angles(width=D):
    inv_freq = 10000.0 ** (-torch.arange(0, width, 2, dtype=torch.float64) / width)
    return torch.arange(S, dtype=torch.float64)[:, None] * inv_freq   # [S, width/2]


def half_tables(device="cpu", width=D):
    emb = torch.cat((angles(width), angles(width)), dim=-1)
    return emb.cos().to(device, torch.bfloat16), emb.sin().to(device, torch.bfloat16)


def rope64(x, cos, sin, style):
    """RoPE in float64 on the given tables (each frequency repeated as the style lays it out) on
    the first R = cos.shape[-1] channels; the rest pass through."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    rot, rest = x[..., : cos.shape[-1]], x[..., cos.shape[-1]:]
    rotated = rotate_half(rot) if style == "half" else rotate_every_two(rot)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


def check_output(out, q, k, v, cos, sin, style="half", mask_mod=mods.causal, score_mod=None):
    ref, _ = reference_attention(rope64(q, cos, sin, style), rope64(k, cos, sin, style),
                                 v.double(), score_mod, mask_mod)
    err = rel_error(out.cpu(), ref.cpu())
    assert err < FP8_TOLERANCE, f"relative error {err:.3e} against the float64 reference"


def compiled_code(model, *args):
    torch._dynamo.reset()
    with torch.no_grad():
        out, code = run_and_get_code(torch.compile(model, backend="fa3", options=FP8), *args)
    return out, "\n".join(code)


def rope_kernels(code: str) -> list[str]:
    """What in the generated code applies a RoPE: pointwise kernels (C++ on the CPU, Triton on the
    GPU) that multiply, and the aten calls a complex RoPE runs as (Inductor does not generate
    complex arithmetic). Preparing the tables (``repeat_interleave``, views) multiplies nothing."""
    import re

    kernels = re.findall(r"\b((?:cpp|triton)_\w*fused\w*)\s*=\s*async_compile", code)
    return [name for name in kernels if "_mul" in name] + re.findall(
        r"torch\.ops\.aten\.(?:mul|view_as_complex)\.\w+", code)


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("style", ["half", "partial", "interleaved", "complex"])
def test_rope_is_fused_into_the_prologue(style, cpu_kernels, fresh_compiles):
    q, k, v = qkv(0)
    width = D // 2 if style == "partial" else D
    if style in ("half", "partial"):
        model, tables, mask = (HalfRope() if style == "half" else PartialRope(),
                               half_tables(width=width), mods.causal)
        cos, sin = tables
    elif style == "interleaved":
        half = angles()
        model, tables, mask = InterleavedRope(), (half.cos().bfloat16(), half.sin().bfloat16()), None
        cos, sin = (t.repeat_interleave(2, dim=-1) for t in tables)
    else:
        freqs = torch.polar(torch.ones(S, D // 2, dtype=torch.float64), angles()).to(torch.complex64)
        model, tables, mask = ComplexRope(), (freqs,), mods.causal
        cos, sin = (t.repeat_interleave(2, dim=-1) for t in (freqs.real, freqs.imag))
    report = fa3_inductor.explain(model, q, k, v, *tables, compile_options=FP8)
    assert [s.template for s in report.sites] == ["fp8"], report
    want = "interleaved" if style in ("interleaved", "complex") else "half"
    assert f"RoPE ({want} R={width}) fused into the FP8 prologue" in report.sites[0].note, report
    out, code = compiled_code(model, q, k, v, *tables)
    assert fa3_inductor.last_template() in ("fp8", "hopper_fp8")
    assert FUSED_OP in code and UNFUSED_OP not in code
    assert rope_kernels(code) == [], f"RoPE still runs as its own kernels: {rope_kernels(code)}"
    check_output(out, q, k, v, cos, sin, want, mask)


def test_rotated_k_read_elsewhere_stays(cpu_kernels, fresh_compiles):
    """k after RoPE is also an output (a KV cache stores it): its RoPE stays in the graph, the
    attention still takes q and k before RoPE, and both outputs are right."""
    q, k, v = qkv(1)
    cos, sin = half_tables()
    (out, k_rotated), code = compiled_code(HalfRopeKeepsK(), q, k, v, cos, sin)
    assert FUSED_OP in code
    assert len(rope_kernels(code)) == 1, "k's RoPE (an output) must stay, q's must go"
    check_output(out, q, k, v, cos, sin)
    # Inductor computes the bfloat16 RoPE in float32 and rounds once: within bfloat16's rounding
    torch.testing.assert_close(k_rotated.double(), rope64(k, cos, sin, "half"), rtol=2 ** -8,
                               atol=1e-5)


def test_tables_that_do_not_repeat_are_applied_by_the_prologue(cpu_kernels, fresh_compiles,
                                                               monkeypatch):
    """A model's arbitrary tables (graph inputs whose two halves differ) go to the prologue as they
    are: it reads both table columns of each rotated pair, so the result is the model's RoPE with
    no check of the tables. q and k come in a transposed storage ([B, S, H, D] viewed as
    [B, H, S, D]), which the output's strides follow."""
    from fa3_inductor.runtime import ops_fp8

    seen = []

    def spy(q, k, v, recipe, rope=None):
        seen.append(rope)
        return quantize(q, k, v, recipe, rope)

    quantize = ops_fp8.quantize
    monkeypatch.setattr(ops_fp8, "quantize", spy)
    v = qkv(6)[2]
    q, k = (t.transpose(1, 2) for t in qkv(6, layout="bshd")[:2])
    g = torch.Generator().manual_seed(7)
    cos, sin = (torch.rand(S, D, generator=g).bfloat16() for _ in range(2))
    assert not torch.equal(cos[:, : D // 2], cos[:, D // 2:])
    out, code = compiled_code(HalfRope(), q, k, v, cos, sin)
    assert FUSED_OP in code and rope_kernels(code) == []
    assert seen and all(r is not None and r.style == "half" for r in seen), seen
    assert torch.equal(seen[-1].cos.reshape(S, D), cos)
    assert torch.equal(seen[-1].sin.reshape(S, D), sin)
    assert out.stride() == q.stride(), "the output does not follow q's strides"
    check_output(out, q, k, v, cos, sin)


def test_user_flex_attention_with_mods_is_fused(cpu_kernels, fresh_compiles):
    """A flex_attention call the user wrote (no rewrite by recognition) with a score_mod that
    captures a tensor and a block mask passed in: the fused op gets its mods, the captured buffer
    and the block-mask tables."""
    q, k, v = qkv(2)
    cos, sin = half_tables()
    block_mask = create_block_mask(mods.causal, None, None, S, S, device="cpu", BLOCK_SIZE=64)
    report = fa3_inductor.explain(FlexWithRope(), q, k, v, cos, sin, block_mask,
                                  compile_options=FP8)
    assert [s.template for s in report.sites] == ["fp8"], report
    assert "RoPE (half R=64) fused into the FP8 prologue" in report.sites[0].note, report
    out, code = compiled_code(FlexWithRope(), q, k, v, cos, sin, block_mask)
    assert FUSED_OP in code
    check_output(out, q, k, v, cos, sin, score_mod=softcap_key_bias)


def test_rope_before_a_transpose_is_left_with_its_reason(cpu_kernels, fresh_compiles):
    q, k, v = qkv(3, layout="bshd")
    cos, sin = half_tables()
    report = fa3_inductor.explain(RopeThenTranspose(), q, k, v, cos, sin, compile_options=FP8)
    assert [s.template for s in report.sites] == ["fp8"], report
    note = report.sites[0].note
    assert "RoPE (half R=64) in the model runs before the FP8 prologue: q goes through " \
           "transpose(1, 2) between RoPE and attention" in note, report
    out, code = compiled_code(RopeThenTranspose(), q, k, v, cos, sin)
    assert UNFUSED_OP in code and FUSED_OP not in code
    check_output(out, q.transpose(1, 2), k.transpose(1, 2), v, cos, sin)


def test_float32_site_is_not_fused(cpu_kernels, fresh_compiles):
    """FP8 serves bfloat16/float16 inputs: a float32 site keeps its RoPE and says why."""
    q, k, v = (t.float() for t in qkv(4))
    cos, sin = (t.float() for t in half_tables())
    report = fa3_inductor.explain(HalfRope(), q, k, v, cos, sin, compile_options=FP8)
    assert "RoPE (half R=64) in the model runs before the FP8 prologue: the site runs in " \
           "torch.float32" in report.sites[0].note, report


def test_transformers_llama_fuses_rope_at_every_layer(cpu_kernels, fresh_compiles):
    """A tiny transformers Llama (eager attention, GQA, RoPE tables computed in the graph from
    position ids, a KV cache on prefill) compiled with fa3.fp8: every layer's RoPE is fused, and
    the logits are within the FP8 rule of eager bf16."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, head_dim=16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    model = model.to(torch.bfloat16).eval()
    ids = torch.randint(1, config.vocab_size, (2, 40))
    with torch.no_grad():
        ref = model(ids).logits.float()
        report = fa3_inductor.explain(model, ids, compile_options=FP8)
        torch._dynamo.reset()
        out = torch.compile(model, backend="fa3", options=FP8)(ids).logits.float()
    assert len(report.sites) == config.num_hidden_layers, report
    for site in report.sites:
        assert site.template == "fp8", report
        assert "RoPE (half R=16) fused into the FP8 prologue" in site.note, report
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < FP8_TOLERANCE, f"logits relative error {err:.3e} against eager bf16"


@pytest.mark.gpu
def test_rope_is_fused_on_gpu(fresh_compiles):
    """On an FP8 GPU the compiled rotate_half model runs the fused op (the prologue's RoPE), with
    no RoPE kernel of its own, within the FP8 tolerance rule."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with e4m3 tensor cores (sm89+)")
    q, k, v = qkv(5, device="cuda")
    cos, sin = half_tables("cuda")
    report = fa3_inductor.explain(HalfRope(), q, k, v, cos, sin, compile_options=FP8)
    assert [s.template for s in report.sites] in (["fp8"], ["hopper_fp8"]), report
    assert "RoPE (half R=64) fused into the FP8 prologue" in report.sites[0].note, report
    out, code = compiled_code(HalfRope(), q, k, v, cos, sin)
    assert fa3_inductor.last_template() in ("fp8", "hopper_fp8")
    assert FUSED_OP in code and rope_kernels(code) == []
    check_output(out, q, k, v, cos, sin)
