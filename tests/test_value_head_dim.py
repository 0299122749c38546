"""Attention whose value head dim Dv differs from the query/key head dim D.

DeepSeek-V2/V3's multi-head latent attention trains with q/k 192 (128 + 64 rope columns) and
v 128; the output is (B, Hq, M, Dv). Every front door serves it: ``fa3_inductor.flex``, and
under ``torch.compile(backend="fa3")`` SDPA calls, hand-written ``softmax(q @ kᵀ) @ v`` and
flex_attention calls.

CPU (conftest sets TRITON_INTERPRET=1): the generic kernel under Triton's interpreter, the
backward our generic backward family (the dense recompute where it does not serve). Small dims
stand in for 192 / 128 (the interpreter's time grows with them). GPU (marked ``gpu``): D 192,
Dv 128 in bf16 against float64, forward and backward.
Every numeric check is the tolerance rule of tests/reference.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention, noop_mask

import fa3_inductor
from fa3_inductor import lowered_backward_sites, mods
from fa3_inductor.config import Settings
from fa3_inductor.lowering.site_plan import plan_site
from fa3_inductor.templates.generic.host import launch_generic
from fa3_inductor.templates.modgen import generate_mod_source, load_mod, trace_mod
from reference import (assert_lse_matches, assert_matches_reference, reference_attention,
                       reference_gradients)


def _inputs(b, hq, hkv, m, n, d, dv, dtype, device="cpu", requires_grad=False):
    """Fresh random q (b, hq, m, d), k (b, hkv, n, d), v (b, hkv, n, dv)."""
    q = torch.randn(b, hq, m, d, device=device, dtype=dtype)
    k = torch.randn(b, hkv, n, d, device=device, dtype=dtype)
    v = torch.randn(b, hkv, n, dv, device=device, dtype=dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def _assert_our_backward_ran():
    kernels = [s["kernel"] for s in lowered_backward_sites()]
    assert kernels and kernels[-1] == "fa3_inductor.flex_bwd", kernels


# ------------------------------------------------------- the generic kernel, launched directly

@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("d, dv", [(64, 32), (40, 80)])
@pytest.mark.parametrize("walk", ["dense_host_desc", "dense_kernel_desc", "list", "hull"])
def test_generic_kernel(d, dv, walk):
    """V and O tiles of their own width, with descriptors built on the host (sm90, the
    interpreter) or in the kernel (other GPUs), over every way the kernel walks KV tiles."""
    torch.manual_seed(hash((d, dv, walk)) % 2**31)
    q, k, v = _inputs(2, 4, 2, 100, 77, d, dv, torch.float16)
    out = torch.full((2, 4, 100, dv), float("nan"), dtype=torch.float16)  # all must be written
    lse, mx = (torch.full((2, 4, 100), float("nan")) for _ in range(2))
    blocks, mask_mod = {}, None
    if walk in ("list", "hull"):
        bm = create_block_mask(mods.causal, 1, 1, 100, 77, device="cpu", BLOCK_SIZE=32)
        mask_mod = load_mod(generate_mod_source(trace_mod(mods.causal, "mask")[0], "mask", [],
                                                "tl"), "tl")
        blocks = dict(kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices,
                      full_kv_num_blocks=bm.full_kv_num_blocks,
                      full_kv_indices=bm.full_kv_indices, sparse_q_block=32, sparse_kv_block=32,
                      iterate_hull=walk == "hull")
    launch_generic(q, k, v, out, lse, mx, sm_scale=d ** -0.5, mask_mod=mask_mod,
                   host_descriptors=walk != "dense_kernel_desc", **blocks)
    ref, ref_lse = reference_attention(q, k, v, None, mods.causal if mask_mod else None)
    assert_matches_reference(out, ref, torch.float16)
    assert_lse_matches(lse * math.log(2), ref_lse, torch.float16)


# ------------------------------------------------------------------ flex(): the direct API

@pytest.mark.usefixtures("cpu_kernels", "fresh_compiles")
@pytest.mark.parametrize("d, dv, hq, hkv, m, n, mod, dtype", [
    (64, 32, 4, 2, 100, 77, "softcap+causal", torch.float16),   # GQA, ragged, Dv < D
    (48, 64, 2, 2, 130, 130, "causal", torch.float16),          # Dv > D, padded D (48 -> 64)
    (48, 24, 2, 1, 70, 90, "softcap", torch.float32),           # both padded, cross lengths
    (16, 256, 2, 2, 40, 40, "none", torch.float16),             # the extremes of the range
])
def test_flex_forward(d, dv, hq, hkv, m, n, mod, dtype):
    torch.manual_seed(hash((d, dv, m, n)) % 2**31)
    q, k, v = _inputs(2, hq, hkv, m, n, d, dv, dtype)
    score_mod = mods.softcap(2.0) if "softcap" in mod else None   # small cap: it must bite
    mask_mod = mods.causal if "causal" in mod else None
    out, lse = fa3_inductor.flex(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                 enable_gqa=hq != hkv, return_lse=True)
    assert fa3_inductor.last_template() == "generic"
    assert out.shape == (2, hq, m, dv) and out.dtype == dtype
    ref, ref_lse = reference_attention(q, k, v, mods.softcap(2.0) if score_mod else None,
                                       mods.causal if mask_mod else None)
    assert_matches_reference(out, ref, dtype)
    assert_lse_matches(lse, ref_lse, dtype)


@pytest.mark.usefixtures("cpu_kernels", "fresh_compiles")
def test_flex_output_keeps_the_query_layout():
    """q viewed from a (B, S, H, D) projection: the output is a (B, S, H, Dv) storage seen as
    (B, H, S, Dv), so transposing it back is free (as with equal head dims)."""
    torch.manual_seed(1)
    q = torch.randn(1, 72, 2, 32, dtype=torch.float16).transpose(1, 2)
    k = torch.randn(1, 72, 2, 32, dtype=torch.float16).transpose(1, 2)
    v = torch.randn(1, 72, 2, 16, dtype=torch.float16).transpose(1, 2)
    out = fa3_inductor.flex(q, k, v, mask_mod=mods.causal)
    assert out.shape == (1, 2, 72, 16) and out.transpose(1, 2).is_contiguous(), out.stride()
    assert_matches_reference(out, reference_attention(q, k, v, None, mods.causal)[0], torch.float16)


@pytest.mark.usefixtures("cpu_kernels", "fresh_compiles")
@pytest.mark.parametrize("hkv, mod", [(2, "softcap+causal"), (4, "learned_bias")])
def test_flex_training(hkv, mod):
    """Gradients of q, k, v (and of a learnable bias table) against float64 autograd."""
    torch.manual_seed(2)
    hq, m, n = 4, 80, 80
    q, k, v = _inputs(2, hq, hkv, m, n, 48, 32, torch.float32, requires_grad=True)
    captured, make_ref = (), None
    if mod == "learned_bias":
        table = torch.randn(hq, 2 * n, requires_grad=True)

        def make_ref(t):
            return lambda score, b, h, q_idx, kv_idx: score + t[h, q_idx - kv_idx + n]

        score_mod, mask_mod, captured = make_ref(table), None, (table,)
    else:
        score_mod, mask_mod = mods.softcap(2.0), mods.causal
    out = fa3_inductor.flex(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                            enable_gqa=hq != hkv)
    assert fa3_inductor.last_template() == "generic" and out.shape == (2, hq, m, 32)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_score = None if captured else mods.softcap(2.0)
    ref_out, dq, dk, dv, dcap = reference_gradients(
        q, k, v, grad_out, ref_score, mods.causal if mask_mod else None, None, captured, make_ref)
    assert_matches_reference(out, ref_out, torch.float32, "output")
    for name, t, ref in (("dq", q, dq), ("dk", k, dk), ("dv", v, dv)):
        assert t.grad.shape == t.shape, name
        assert_matches_reference(t.grad, ref, torch.float32, name)
    for t, ref in zip(captured, dcap):
        assert_matches_reference(t.grad, ref, torch.float32, "d table")
    _assert_our_backward_ran()


@pytest.mark.parametrize("dv, what", [(20, "v head dim 20"), (264, "v head dim 264"),
                                      (8, "v head dim 8")])
def test_flex_refuses_an_unsupported_value_head_dim(dv, what):
    q, k, _ = _inputs(1, 2, 2, 32, 32, 64, 64, torch.float32)
    v = torch.randn(1, 2, 32, dv)
    with pytest.raises(ValueError, match=what) as err:
        fa3_inductor.flex(q, k, v)
    assert "multiples of 8 from 16 to 256" in str(err.value)   # what to do, not only what failed


def test_flex_still_refuses_an_unsupported_query_head_dim():
    q, k, v = _inputs(1, 2, 2, 32, 32, 36, 32, torch.float32)
    with pytest.raises(ValueError, match="q/k head dim 36"):
        fa3_inductor.flex(q, k, v)


# ------------------------------------------------------- torch.compile(backend="fa3")

def _fused(front_door: str) -> list[dict]:
    return [s for s in fa3_inductor.recognized_sites() if s["front_door"] == front_door]


@pytest.mark.usefixtures("cpu_kernels", "fresh_compiles")
@pytest.mark.parametrize("is_causal, hkv", [(True, 2), (False, 4)])
def test_compiled_sdpa(is_causal, hkv):
    torch.manual_seed(3)
    q, k, v = _inputs(2, 4, hkv, 96, 96, 48, 32, torch.float16)

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                              enable_gqa=hkv != 4)

    with torch.no_grad():
        out = torch.compile(attention, backend="fa3", fullgraph=True)(q, k, v)
    (site,) = _fused("sdpa")
    assert site["rewritten"], site
    assert site["mask"] == ("causal" if is_causal else "none")
    (lowered,) = fa3_inductor.lowered_sites()
    assert lowered["template"] == "generic", lowered
    assert f" v[2, {hkv}, 96, 32] " in lowered["shape"], lowered["shape"]
    assert out.shape == (2, 4, 96, 32)
    ref, _ = reference_attention(q, k, v, None, mods.causal if is_causal else None)
    assert_matches_reference(out, ref, torch.float16)


@pytest.mark.usefixtures("cpu_kernels", "fresh_compiles")
def test_compiled_sdpa_with_a_float_mask():
    """attn_mask goes through the mask planner shared with hand-written attention."""
    torch.manual_seed(4)
    q, k, v = _inputs(1, 2, 2, 64, 64, 32, 16, torch.float32)
    bias = torch.randn(1, 2, 64, 64)

    def attention(q, k, v, bias):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    with torch.no_grad():
        out = torch.compile(attention, backend="fa3", fullgraph=True)(q, k, v, bias)
    assert [s["rewritten"] for s in _fused("sdpa")] == [True], _fused("sdpa")
    assert [s["template"] for s in fa3_inductor.lowered_sites()] == ["generic"]
    ref, _ = reference_attention(q, k, v, lambda s, b, h, qi, ki: s + bias.double()[b, h, qi, ki])
    assert_matches_reference(out, ref, torch.float32)


@pytest.mark.usefixtures("cpu_kernels", "fresh_compiles")
def test_compiled_sdpa_training():
    torch.manual_seed(5)
    q, k, v = _inputs(2, 4, 2, 64, 64, 32, 48, torch.float32, requires_grad=True)

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    out = torch.compile(attention, backend="fa3")(q, k, v)
    assert [s["rewritten"] for s in _fused("sdpa")] == [True]
    assert fa3_inductor.lowered_sites()[-1]["template"] == "generic"
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_out, dq, dk, dv, _ = reference_gradients(q, k, v, grad_out, mask_mod=mods.causal)
    assert_matches_reference(out, ref_out, torch.float32, "output")
    for name, t, ref in (("dq", q, dq), ("dk", k, dk), ("dv", v, dv)):
        assert_matches_reference(t.grad, ref, torch.float32, name)
    _assert_our_backward_ran()


class LatentAttention(nn.Module):
    """DeepSeek-V2/V3's multi-head latent attention in its training form, written as
    transformers' eager code writes it (small dims): q and k carry NOPE columns plus ROPE
    columns (k's shared over heads), v has DV columns; causal finfo.min mask, float32 softmax."""

    HID, HEADS, NOPE, ROPE, DV = 64, 4, 32, 16, 32

    def __init__(self):
        super().__init__()
        h, d = self.HEADS, self.NOPE + self.ROPE
        self.q_proj = nn.Linear(self.HID, h * d, bias=False)
        self.kv_proj = nn.Linear(self.HID, h * (self.NOPE + self.DV), bias=False)
        self.k_rope = nn.Linear(self.HID, self.ROPE, bias=False)
        self.o_proj = nn.Linear(h * self.DV, self.HID, bias=False)
        self.scaling = d ** -0.5

    def forward(self, x):
        b, s, _ = x.shape
        h = self.HEADS
        q = self.q_proj(x).view(b, s, h, -1).transpose(1, 2)
        kv = self.kv_proj(x).view(b, s, h, -1).transpose(1, 2)
        k_nope, v = torch.split(kv, [self.NOPE, self.DV], dim=-1)
        k_pe = self.k_rope(x).view(b, 1, s, self.ROPE).expand(b, h, s, self.ROPE)
        k = torch.cat([k_nope, k_pe], dim=-1)
        pos = torch.arange(s, device=x.device)
        mask = torch.full((s, s), torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device)
        mask = mask.masked_fill(pos[None, :] <= pos[:, None], 0.0)[None, None]
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling + mask
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(w, v).transpose(1, 2).reshape(b, s, h * self.DV)
        return self.o_proj(o)


@pytest.mark.usefixtures("cpu_kernels", "fresh_compiles")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compiled_hand_written_latent_attention(dtype):
    torch.manual_seed(6)
    module = LatentAttention().eval()
    x = torch.randn(2, 56, LatentAttention.HID)
    with torch.no_grad():
        ref = copy.deepcopy(module).double()(x.double())
        out = torch.compile(module.to(dtype), backend="fa3", fullgraph=True)(x.to(dtype))
    (site,) = _fused("matmul-softmax")
    assert site["rewritten"] and site["mask"] == "causal", site
    (lowered,) = fa3_inductor.lowered_sites()
    assert lowered["template"] == "generic", lowered
    assert lowered["mask_mod"] == "v0 = (q_idx >= kv_idx); return v0", lowered
    assert_matches_reference(out, ref, dtype)


@pytest.mark.usefixtures("cpu_kernels", "fresh_compiles")
def test_compiled_hand_written_softcap_attention():
    torch.manual_seed(7)
    q, k, v = _inputs(2, 2, 2, 64, 64, 48, 16, torch.float16)

    def attention(q, k, v):
        s = q @ k.transpose(-2, -1) * 0.2
        s = 2.0 * torch.tanh(s / 2.0)
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v

    with torch.no_grad():
        out = torch.compile(attention, backend="fa3", fullgraph=True)(q, k, v)
    (site,) = _fused("matmul-softmax")
    assert site["rewritten"] and "softcap" in site["score_mods"], site
    assert [s["template"] for s in fa3_inductor.lowered_sites()] == ["generic"]
    assert out.shape == (2, 2, 64, 16)
    ref, _ = reference_attention(q, k, v, mods.softcap(2.0), None, scale=0.2)
    assert_matches_reference(out, ref, torch.float16)


@pytest.mark.usefixtures("cpu_kernels", "fresh_compiles")
def test_compiled_flex_attention_call():
    torch.manual_seed(8)
    q, k, v = _inputs(1, 4, 2, 96, 96, 64, 32, torch.float16)
    block_mask = create_block_mask(mods.causal, None, None, 96, 96, device="cpu")
    softcap = mods.softcap(2.0)

    def attention(q, k, v):
        return flex_attention(q, k, v, score_mod=softcap, block_mask=block_mask,
                              enable_gqa=True)

    with torch.no_grad():
        out = torch.compile(attention, backend="fa3", fullgraph=True)(q, k, v)
    assert [s["rewritten"] for s in _fused("flex_attention")] == [True]
    assert [s["template"] for s in fa3_inductor.lowered_sites()] == ["generic"]
    ref, _ = reference_attention(q, k, v, mods.softcap(2.0), mods.causal)
    assert_matches_reference(out, ref, torch.float16)


@pytest.mark.usefixtures("cpu_kernels", "fresh_compiles")
def test_compiled_sdpa_with_an_unsupported_value_head_dim_is_left_alone():
    q, k, _ = _inputs(1, 2, 2, 32, 32, 32, 32, torch.float32)
    v = torch.randn(1, 2, 32, 12)
    with torch.no_grad():
        out = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                            backend="fa3")(q, k, v)
    (site,) = _fused("sdpa")
    assert not site["rewritten"] and "value head dim 12" in site["reason"], site
    assert fa3_inductor.lowered_sites() == []
    assert_matches_reference(out, reference_attention(q, k, v)[0], torch.float32)


# ------------------------------------------------------------------------ the site plan

def _plan(monkeypatch, dtype, head_dim, value_head_dim, sm90=True):
    """plan_site for a plain CUDA site (on an sm90 GPU when ``sm90``; the query is patched)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: (9, 0) if sm90 else (8, 0))
    score_gm, _ = trace_mod(lambda score, b, h, q_idx, kv_idx: score, "score")
    mask_gm, _ = trace_mod(noop_mask, "mask")
    return plan_site(score_gm, mask_gm, [], [], device=torch.device("cuda"), dtype=dtype,
                     q_heads=4, kv_heads=4, head_dim=head_dim, value_head_dim=value_head_dim,
                     batches_match=True, sparse_blocks=(128, 128), settings=Settings(),
                     description="test site")


def test_plan_gives_the_hopper_pair_to_the_hopper_template(monkeypatch):
    from fa3_inductor.templates.hopper.configs import serves_head_dims

    assert serves_head_dims(192, 128)
    spec, reason = _plan(monkeypatch, torch.bfloat16, 192, 128)
    assert reason is None and spec.template == "hopper", spec
    assert spec.note.startswith("Hopper template: ") and "v 128" in spec.note, spec.note


@pytest.mark.parametrize("dtype, d, dv, says", [
    (torch.bfloat16, 64, 32, "no tiles for q/k head dim 64 with v head dim 32 (it serves "),
    (torch.float32, 192, 128, "float32 inputs"),
])
def test_plan_says_why_the_generic_template_runs(monkeypatch, dtype, d, dv, says):
    spec, reason = _plan(monkeypatch, dtype, d, dv)
    assert reason is None and spec.template == "generic", spec
    assert says in spec.note and spec.note.endswith("generic runs"), spec.note


def test_plan_off_hopper_is_generic_without_a_note(monkeypatch):
    spec, reason = _plan(monkeypatch, torch.bfloat16, 192, 128, sm90=False)
    assert reason is None and spec.template == "generic" and spec.note == ""


@pytest.mark.parametrize("d, dv, says", [(64, 12, "value head dim 12"),
                                         (64, 512, "value head dim 512"),
                                         (36, 64, "head dim 36")])
def test_plan_refuses_head_dims_out_of_range(monkeypatch, d, dv, says):
    spec, reason = _plan(monkeypatch, torch.bfloat16, d, dv)
    assert spec is None and reason.startswith(says), reason
    assert "multiples of 8 from 16 to 256" in reason


# ------------------------------------------------------------------------------- GPU

def _gpu_case(template: str):
    if template == "hopper" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper template needs an sm90 GPU")
    torch.manual_seed(9)
    # DeepSeek-V2/V3 dims, GQA, ragged lengths (not a multiple of any tile)
    return _inputs(2, 8, 2, 333, 333, 192, 128, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("template", ["hopper", "generic"])
def test_gpu_flex_deepseek_dims(template):
    q, k, v = _gpu_case(template)
    with torch.no_grad():
        out, lse = fa3_inductor.flex(q, k, v, score_mod=mods.softcap(20.0),
                                     mask_mod=mods.causal, enable_gqa=True, return_lse=True,
                                     template=template)
    assert fa3_inductor.last_template() == template
    assert out.shape == (2, 8, 333, 128)
    ref, ref_lse = reference_attention(q, k, v, mods.softcap(20.0), mods.causal)
    assert_matches_reference(out, ref, torch.bfloat16)
    assert_lse_matches(lse, ref_lse, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("template", ["hopper", "generic"])
def test_gpu_flex_deepseek_dims_gradients(template):
    """Forward ours, backward one of our backward families (torch's flex kernel, reading our out
    and LSE, for a site none serves)."""
    q, k, v = (t.requires_grad_() for t in _gpu_case(template))
    out = fa3_inductor.flex(q, k, v, score_mod=mods.softcap(20.0), mask_mod=mods.causal,
                            enable_gqa=True, template=template)
    assert fa3_inductor.last_template() == template
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_out, dq, dk, dv, _ = reference_gradients(q, k, v, grad_out, mods.softcap(20.0), mods.causal)
    assert_matches_reference(out, ref_out, torch.bfloat16, "output")
    for name, t, ref in (("dq", q, dq), ("dk", k, dk), ("dv", v, dv)):
        assert_matches_reference(t.grad, ref, torch.bfloat16, name)
