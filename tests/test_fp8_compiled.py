"""FP8 through the compiled front door: ``torch.compile(model, backend="fa3", options={"fa3.fp8": ...})``
lowers every bf16/fp16 site our kernels serve to ``fa3_inductor::flex_fwd_fp8`` (the prologue, then
the fp8 family), for inference graphs; training graphs are refused. CPU: under Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fa3_inductor
from fa3_inductor import FP8Recipe, mods
from reference import FP8_TOLERANCE, reference_attention, rel_error


class SdpaCausal(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class FlexSoftcap(torch.nn.Module):
    def forward(self, q, k, v, block_mask):
        return flex_attention(q, k, v, score_mod=mods.softcap(20.0), block_mask=block_mask)


def _qkv(seed, M=128, N=128, D=64, H=2):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, H, n, D, generator=g).to(torch.bfloat16) for n in (M, N, N))


def test_sdpa_site_runs_fp8(cpu_kernels, fresh_compiles):
    q, k, v = _qkv(0)
    report = fa3_inductor.explain(SdpaCausal(), q, k, v, compile_options={"fa3.fp8": True})
    assert [s.template for s in report.sites] == ["fp8"], report
    with torch.no_grad():
        out = torch.compile(SdpaCausal(), backend="fa3", options={"fa3.fp8": True})(q, k, v)
    assert fa3_inductor.last_template() in ("fp8", "hopper_fp8")
    ref, _ = reference_attention(q, k, v, mask_mod=mods.causal)
    assert rel_error(out, ref) < FP8_TOLERANCE


def test_flex_site_with_mods_runs_fp8_with_a_recipe(cpu_kernels, fresh_compiles):
    q, k, v = _qkv(1, M=100, N=160)
    block_mask = create_block_mask(mods.causal, None, None, 100, 160, device="cpu")
    model = torch.compile(FlexSoftcap(), backend="fa3",
                          options={"fa3.fp8": FP8Recipe(block_m=64, block_n=64)})
    with torch.no_grad():
        out = model(q, k, v, block_mask)
    assert fa3_inductor.last_template() in ("fp8", "hopper_fp8")
    ref, _ = reference_attention(q, k, v, mods.softcap(20.0), mods.causal)
    assert rel_error(out, ref) < FP8_TOLERANCE


def test_training_graph_is_refused(cpu_kernels, fresh_compiles):
    q, k, v = (t.requires_grad_() for t in _qkv(2))
    model = torch.compile(SdpaCausal(), backend="fa3", options={"fa3.fp8": True})
    with pytest.raises(Exception, match="inference-only"):
        model(q, k, v)


def test_bad_fp8_option_is_refused():
    with pytest.raises(ValueError, match="fa3.fp8"):
        fa3_inductor.config.split_options({"fa3.fp8": "yes"})


class RopeThenSdpa(torch.nn.Module):
    """transformers' spelling: q * cos + rotate_half(q) * sin on q and k, then SDPA."""

    def forward(self, q, k, v, cos, sin):
        def rotate_half(x):
            x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
            return torch.cat((-x2, x1), dim=-1)

        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_explain_names_the_rope_before_an_fp8_site(cpu_kernels, fresh_compiles):
    q, k, v = _qkv(3)
    angles = torch.arange(128.0)[:, None] * (10000.0 ** (-torch.arange(0, 64, 2) / 64))
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    report = fa3_inductor.explain(RopeThenSdpa(), q, k, v, cos, sin, compile_options={"fa3.fp8": True})
    assert [s.template for s in report.sites] == ["fp8"], report
    assert "RoPE (half R=64)" in report.sites[0].note, report
    plain = fa3_inductor.explain(RopeThenSdpa(), q, k, v, cos, sin)
    assert "RoPE" not in plain.sites[0].note   # looked for only with FP8 on


@pytest.mark.gpu
@pytest.mark.parametrize("module", ["sdpa", "flex"])
def test_compiled_fp8_on_gpu(module, fresh_compiles):
    """On an FP8 GPU the compiled site runs the FP8 op (prologue + fp8 family), even a plain SDPA call
    too small for the bf16 rewrite to pay (FP8 was asked for), within the FP8 tolerance rule."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with e4m3 tensor cores (sm89+)")
    q, k, v = (t.cuda() for t in _qkv(3, M=384, N=384, D=128, H=4))
    if module == "sdpa":
        model, args, ref_mods = SdpaCausal(), (q, k, v), (None, mods.causal)
    else:
        block_mask = create_block_mask(mods.causal, None, None, 384, 384, device="cuda")
        model, args, ref_mods = FlexSoftcap(), (q, k, v, block_mask), (mods.softcap(20.0), mods.causal)
    report = fa3_inductor.explain(model, *args, compile_options={"fa3.fp8": True})
    assert [s.template for s in report.sites] in (["fp8"], ["hopper_fp8"]), report
    with torch.no_grad():
        out = torch.compile(model, backend="fa3", options={"fa3.fp8": True})(*args)
    assert fa3_inductor.last_template() in ("fp8", "hopper_fp8")
    ref, _ = reference_attention(q.cpu(), k.cpu(), v.cpu(), *ref_mods)
    assert rel_error(out.cpu(), ref) < FP8_TOLERANCE
