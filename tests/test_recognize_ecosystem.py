"""Attention spellings of the wider ecosystem (transformers, timm, diffusers) that the coverage
harness (benchmarks/coverage.py, issue 21) found left alone or crashing, now fused, and the ones
that are not one softmax(q·kᵀ)·v left alone with a reason that names their structure.

Each module is written the way the model writes it, compiled with backend="fa3", and checked
against a float64 eager run of the same module, outputs and gradients (tests/reference.py
tolerance rule), with the site reported fused:

- BART / LED / TrOCR / MVP / Table Transformer: ``bmm`` on [B*H, M, D] with q scaled before the
  projection is split, the scores viewed [B, H, M, N] to add the mask and back;
- BLOOM: ``alibi.baddbmm(q, kᵀ, beta=1, alpha=1/√d)`` on [B*H, M, N], viewed [B, H, M, N] for
  the mask, the probabilities viewed back for ``bmm``; GPT-NeoX-Japanese: ``baddbmm(zeros, ..)``;
- diffusers' classic AttnProcessor with a mask: ``baddbmm(mask, q, kᵀ, beta=1, alpha=scale)``
  over merged batch×heads (3-D);
- scores of rank 5, [B, H, windows, M, N] (transformers' Hiera) and LongT5's
  ``einsum("...qhd,...khd->...hqk")`` with a bias over blocks;
- SDPA on 5-D q/k/v (timm's Hiera, NesT, Twins) and on 3-D [B*H, N, D] with a 3-D float mask
  (timm's SAM ViT);
- CPM-Ant: ``masked_fill(softmax(masked_fill(S, ~m, -inf)), ~m, 0)``, rows with no key included;
- a graph with a one-operand ``einsum`` (DiT's unpatchify) next to an SDPA call;
- SAM's decomposed relative positions: a query-computed bias ``reshape_as`` the scores;
- MiMo-V2-Flash's row max subtracted before the softmax.
"""

from __future__ import annotations

import copy
import math
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fa3_inductor
from fa3_inductor.recognition import rewrite_pays
from reference import TOLERANCE, compiled_and_float64, rel_error

pytestmark = pytest.mark.usefixtures("our_kernels", "fresh_compiles")

B, M, H, D = 2, 16, 4, 16
W = 3          # windows / blocks: a batch-like dim between heads and rows


def _causal_float_mask(dtype, device) -> torch.Tensor:
    keep = torch.ones(M, M, dtype=torch.bool, device=device).tril()
    return torch.zeros(B, 1, M, M, dtype=dtype, device=device).masked_fill(
        ~keep, torch.finfo(dtype).min)


class Spelled(nn.Module):
    """One attention layer in one of the spellings below; x is [B, M, H*D] ([B, W, M, H*D] for
    the windowed spellings)."""

    def __init__(self, spelling: str):
        super().__init__()
        self.qkv = nn.Linear(H * D, 3 * H * D)
        self.spelling = spelling
        self.bias = nn.Parameter(0.5 * torch.randn(1, 1, H, M, M))   # LongT5's block bias
        self.table = nn.Embedding(8, H)                                # a bucket bias table
        self.rel_pos_h = nn.Parameter(0.1 * torch.randn(4, 4, D))      # SAM's per-axis tables
        self.rel_pos_w = nn.Parameter(0.1 * torch.randn(4, 4, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.spelling)(x)

    def _heads(self, x):
        return self.qkv(x).view(B, M, 3, H, D).permute(2, 0, 3, 1, 4)   # 3 x [B, H, M, D]

    def _merge(self, out):   # [B, H, M, D] -> [B, M, H*D]
        return out.transpose(1, 2).reshape(B, M, H * D)

    def bart(self, x):
        # BART: q scaled before the heads are split; scores on [B*H, M, N], viewed 4-D for the
        # mask and back; bmm with V on [B*H, N, D].
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = q * D ** -0.5
        shape = lambda t: t.view(B, M, H, D).transpose(1, 2).contiguous()   # noqa: E731
        q3, k3, v3 = (shape(t).view(B * H, M, D) for t in (q, k, v))
        w = torch.bmm(q3, k3.transpose(1, 2))
        w = w.view(B, H, M, M) + _causal_float_mask(x.dtype, x.device)
        w = w.view(B * H, M, M)
        w = F.softmax(w, dim=-1)
        out = torch.bmm(F.dropout(w, p=0.0, training=False), v3)
        return self._merge(out.view(B, H, M, D))

    def bloom(self, x):
        q, k, v = self._heads(x)
        q3, v3 = q.reshape(B * H, M, D), v.reshape(B * H, M, D)
        k3t = k.reshape(B * H, M, D).transpose(-1, -2)
        slopes = 2.0 ** (-(torch.arange(H, dtype=x.dtype, device=x.device) + 1))
        pos = torch.arange(M, dtype=x.dtype, device=x.device)
        alibi = (slopes[:, None] * pos[None, :]).repeat(B, 1)[:, None, :]   # [B*H, 1, N]
        s = alibi.baddbmm(batch1=q3, batch2=k3t, beta=1.0, alpha=1 / math.sqrt(D))
        w = s.view(B, H, M, -1) + _causal_float_mask(x.dtype, x.device)
        p = F.softmax(w, dim=-1, dtype=torch.float32).to(x.dtype)
        out = torch.bmm(p.view(B * H, M, -1), v3)
        return self._merge(out.view(B, H, M, D))

    def neox_japanese(self, x):
        q, k, v = self._heads(x)
        q3, k3 = q.reshape(B * H, M, D), k.reshape(B * H, M, D)
        zeros = torch.zeros(B * H, M, M, dtype=q.dtype, device=q.device)
        s = torch.baddbmm(zeros, q3, k3.transpose(1, 2), beta=1.0, alpha=1 / math.sqrt(D))
        s = s.view(B, H, M, -1) + _causal_float_mask(x.dtype, x.device)
        p = F.softmax(s, dim=-1).to(v.dtype)
        return self._merge(torch.matmul(p, v))

    def diffusers_masked(self, x):
        # diffusers' AttnProcessor with an attention mask: baddbmm(mask, q, kᵀ, beta=1, alpha)
        q, k, v = (t.reshape(B * H, M, D) for t in self._heads(x))
        keep = torch.arange(M, device=x.device) < M - 3           # padding: last 3 keys
        mask = torch.zeros(B * H, 1, M, dtype=x.dtype, device=x.device).masked_fill(
            ~keep, -10000.0)
        s = torch.baddbmm(mask, q, k.transpose(-1, -2), beta=1, alpha=D ** -0.5)
        p = s.softmax(dim=-1).to(q.dtype)
        return self._merge(torch.bmm(p, v).view(B, H, M, D))

    def hiera(self, x):
        # transformers' Hiera: [B, H, windows, N, D], scores of rank 5
        qkv = self.qkv(x).reshape(B, M, W, 3, H, D).permute(3, 0, 4, 2, 1, 5)
        q, k, v = qkv.unbind(0)
        attn = (q * D ** -0.5) @ k.transpose(-1, -2)
        attn = attn.softmax(dim=-1)
        out = attn @ v                                            # [B, H, W, M, D]
        return out.transpose(1, 3).reshape(B, -1, H * D)

    def longt5(self, x):
        # LongT5's local attention: [B, blocks, len, H, D] and einsums with an ellipsis
        q, k, v = self.qkv(x).view(B, W, M, 3, H, D).unbind(3)
        scores = torch.einsum("...qhd,...khd->...hqk", q, k)        # [B, W, H, M, N]
        keep = (torch.arange(W * M, device=x.device) % 5 != 4).view(1, W, 1, M)
        mask = torch.where(keep, 0.0, -1e10).unsqueeze(-2)            # [1, W, 1, 1, N]
        bias = self.bias + mask
        scores += bias
        w = F.softmax(scores.float(), dim=-1).type_as(scores)
        w = F.dropout(w, p=0.0, training=False).type(v.dtype)
        out = torch.einsum("...hqk,...khd->...qhd", w, v)           # [B, W, M, H, D]
        return out.reshape(B, W * M, H * D)

    def sdpa_5d(self, x):
        # timm's NesT / Hiera: SDPA on [B, H, windows, N, D]
        qkv = self.qkv(x).reshape(B, W, M, 3, H, D).permute(3, 0, 4, 1, 2, 5)
        q, k, v = qkv.unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        return out.permute(0, 2, 3, 4, 1).reshape(B, W * M, H * D)

    def sdpa_5d_mask(self, x):
        # 5-D SDPA with a bool mask broadcast over batch and heads, varying with the window
        qkv = self.qkv(x).reshape(B, W, M, 3, H, D).permute(3, 0, 4, 1, 2, 5)
        q, k, v = qkv.unbind(0)
        i = torch.arange(M, device=x.device)
        w = torch.arange(W, device=x.device).view(W, 1, 1)
        keep = (i[:, None] >= i[None, :] - w)                     # [W, M, N]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return out.permute(0, 2, 3, 4, 1).reshape(B, W * M, H * D)

    def sdpa_3d_bias(self, x):
        # timm's SAM ViT: q, k, v [B*H, N, D] and a relative-position bias [B*H, N, N]
        qkv = self.qkv(x).view(B, M, 3, H, D).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, B * H, M, D).unbind(0)
        rel = torch.arange(M, device=x.device, dtype=x.dtype)
        bias = -(rel[:, None] - rel[None, :]).abs() * 0.1
        bias = q.mean(-1, keepdim=True) * 0.1 + bias                 # [B*H, M, N], from q
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return out.view(B, H, M, D).transpose(1, 2).reshape(B, M, H * D)

    def cpmant(self, x):
        q, k, v = self._heads(x)
        score = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
        i = torch.arange(M, device=x.device)
        b = torch.arange(B, device=x.device).view(B, 1, 1)
        keep = (i[:, None] >= i[None, :]) & ~((b == 1) & (i[:, None] < 4))   # rows with no key
        masked = keep.view(B, 1, M, M) == torch.tensor(False)
        score = torch.masked_fill(score, masked, torch.scalar_tensor(
            float("-inf"), device=x.device, dtype=score.dtype))
        score = torch.softmax(score, dim=-1)
        score = torch.masked_fill(score, keep.view(B, 1, M, M) == torch.tensor(False),
                                  torch.scalar_tensor(0, device=x.device, dtype=score.dtype))
        return self._merge(torch.matmul(score, v))

    def mutated_mask(self, x):
        # a mask written in place after it is built: its op (tril) no longer tells its value
        q, k, v = self._heads(x)
        keep = torch.ones(B, 1, M, M, dtype=torch.bool, device=x.device).tril()
        keep[1, :, 4:, :2] = False
        s = (q @ k.transpose(-1, -2) * D ** -0.5).masked_fill(~keep, float("-inf"))
        return self._merge(torch.softmax(s, dim=-1) @ v)

    def inplace_bucket(self, x):
        # T5 / CPM-Ant bucket code: ``buckets += where(..)`` writes into the tensor it read;
        # the bias gathered from a learnable table at those buckets
        q, k, v = self._heads(x)
        i = torch.arange(M, device=x.device)
        rel = i[None, :] - i[:, None]
        buckets = (rel > 0).to(torch.long) * 4
        buckets += torch.where(rel.abs() < 2, rel.abs(), 3)
        bias = self.table(buckets).permute(2, 0, 1).unsqueeze(0)     # [1, H, M, N]
        s = q @ k.transpose(-1, -2) * D ** -0.5 + bias
        return self._merge(torch.softmax(s, dim=-1) @ v)

    def sam_rel_pos(self, x):
        # SAM / PP-FormulaNet: a bias computed from the queries (decomposed relative positions over
        # a 4 x 4 grid), shaped like the scores by ``reshape_as(attn_weights)``, on [B*H, M, N]
        q, k, v = (t.reshape(B * H, M, D) for t in self._heads(x))
        s = (q * D ** -0.5) @ k.transpose(-2, -1)
        grid = q.reshape(B * H, 4, 4, D)
        rel_h = torch.einsum("bhwc,hkc->bhwk", grid, self.rel_pos_h)
        rel_w = torch.einsum("bhwc,wkc->bhwk", grid, self.rel_pos_w)
        rel = (rel_h[:, :, :, :, None] + rel_w[:, :, :, None, :]).reshape_as(s)
        out = torch.softmax(s + rel, dim=-1) @ v
        return self._merge(out.view(B, H, M, D))

    def mimo_row_max(self, x):
        # MiMo-V2-Flash: the row max subtracted before the softmax "for BF16/FP16 stability"
        q, k, v = self._heads(x)
        s = q @ k.transpose(-1, -2) * D ** -0.5 + _causal_float_mask(x.dtype, x.device)
        s = s - s.max(dim=-1, keepdim=True).values
        return self._merge(F.softmax(s, dim=-1, dtype=s.dtype) @ v)

    def dit(self, x):
        # DiT: an SDPA call, and a one-operand einsum (unpatchify) in the same graph
        q, k, v = self._heads(x)
        out = self._merge(F.scaled_dot_product_attention(q, k, v))
        return torch.einsum("bmhd->bmhd", out.view(B, M, H, D)).reshape(B, M, H * D)


WINDOWED = {"longt5", "sdpa_5d", "sdpa_5d_mask"}
FUSED = ["bart", "bloom", "neox_japanese", "diffusers_masked", "hiera", "longt5", "sdpa_5d",
         "sdpa_5d_mask", "sdpa_3d_bias", "cpmant", "mutated_mask", "inplace_bucket", "dit",
         "sam_rel_pos", "mimo_row_max"]


def _input(spelling: str) -> torch.Tensor:
    if spelling in WINDOWED:
        return torch.randn(B, W * M, H * D)
    if spelling == "hiera":
        return torch.randn(B, M * W, H * D)
    return torch.randn(B, M, H * D)


@pytest.mark.parametrize("spelling", FUSED)
def test_spelling_fuses_and_matches_float64(spelling):
    torch.manual_seed(0)
    model = Spelled(spelling)
    ref_model = copy.deepcopy(model).double()
    x = _input(spelling).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    ref = ref_model(x64)
    dout = torch.randn_like(ref, dtype=torch.float32)
    ref.backward(dout.double())
    out = torch.compile(model, backend="fa3", fullgraph=True)(x)
    out.backward(dout)
    sites = fa3_inductor.recognized_sites()
    assert sites and all(s["rewritten"] for s in sites), sites
    tol = TOLERANCE[torch.float32]
    assert rel_error(out, ref) <= tol, rel_error(out, ref)
    assert rel_error(x.grad, x64.grad) <= tol, rel_error(x.grad, x64.grad)
    for name, p in model.named_parameters():
        ref_grad = dict(ref_model.named_parameters())[name].grad
        if ref_grad is not None and ref_grad.abs().sum() > 0:
            assert rel_error(p.grad, ref_grad) <= tol, (name, rel_error(p.grad, ref_grad))


def _fused_and_within_tolerance(module: nn.Module, qkv: tuple, mask: torch.Tensor
                                ) -> torch.Tensor:
    """``module(q, k, v, mask)`` under backend="fa3": one site, rewritten; the output and q/k/v's
    gradients within float32's tolerance of float64 eager. Returns the output."""
    dout = torch.randn(qkv[0].shape)
    out, ref, qkv64, _ = compiled_and_float64(module, [*qkv, mask], dout)
    (site,) = fa3_inductor.recognized_sites()
    assert site["rewritten"], site
    tol = TOLERANCE[torch.float32]
    assert rel_error(out, ref) <= tol
    for t, t64 in zip(qkv, qkv64):
        assert rel_error(t.grad, t64.grad) <= tol
    return out


def test_cpmant_zero_fill_with_an_input_mask():
    """CPM-Ant's spelling with the mask a graph input (the runtime mask plan): rows the mask
    leaves with no key give 0, as eager does once the probabilities are zero-filled."""
    class CpmAnt(nn.Module):
        def forward(self, q, k, v, keep):
            score = (q @ k.transpose(-1, -2)) / math.sqrt(D)
            score = torch.masked_fill(score, keep.view(B, 1, M, M) == torch.tensor(False),
                                      torch.scalar_tensor(float("-inf"), dtype=score.dtype))
            score = torch.softmax(score, dim=-1)
            score = torch.masked_fill(score, keep.view(B, 1, M, M) == torch.tensor(False),
                                      torch.scalar_tensor(0, dtype=score.dtype))
            return score @ v

    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, M, D, requires_grad=True) for _ in range(3))
    keep = torch.rand(B, M, M) < 0.5
    keep[0, 3] = False                                       # a row with no key
    out = _fused_and_within_tolerance(CpmAnt(), (q, k, v), keep)
    assert torch.equal(out[0, :, 3], torch.zeros_like(out[0, :, 3]))


def test_gpt_neo_upcast_scores_in_bf16():
    """GPT-Neo: q and k cast up to float32 for the scores, the probabilities cast back to V's
    bf16: fused on the bf16 q/k/v (lossless upcast), within bf16's tolerance of float64."""
    class GptNeo(nn.Module):
        def forward(self, q, k, v):
            s = torch.matmul(q.to(torch.float32), k.to(torch.float32).transpose(-1, -2))
            causal = torch.ones(M, M, dtype=torch.bool, device=q.device).tril()
            s = torch.where(causal, s, torch.tensor(torch.finfo(s.dtype).min, dtype=s.dtype))
            p = F.softmax(s, dim=-1).to(v.dtype)
            return torch.matmul(p, v)

    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, M, D, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(B, H, M, D, dtype=torch.bfloat16)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    causal = torch.ones(M, M, dtype=torch.bool).tril()
    ref = torch.softmax((q64 @ k64.transpose(-1, -2)).masked_fill(~causal, float("-inf")),
                        dim=-1) @ v64
    ref.backward(dout.double())
    out = torch.compile(GptNeo(), backend="fa3", fullgraph=True)(q, k, v)
    out.backward(dout)
    (site,) = fa3_inductor.recognized_sites()
    assert site["rewritten"] and site["mask"] == "causal", site
    assert out.dtype == torch.bfloat16
    tol = TOLERANCE[torch.bfloat16]
    assert rel_error(out, ref) <= tol
    for t, t64 in ((q, q64), (k, k64), (v, v64)):
        assert rel_error(t.grad, t64.grad) <= tol


@pytest.mark.parametrize("n_keys", [1, 5])
def test_detr_cross_attention_padding_mask_few_keys(n_keys):
    """Table Transformer / DETR: BART-style bmm with a padding mask from an input, over few keys
    (one encoder token for a tiny image). The run-time block tables were counted on a bool mask
    padded to the 128 block, which Inductor's CPU vectorizer compiled to C++ that does not
    build in a training graph with one key."""
    class Detr(nn.Module):
        def forward(self, q, k, v, pad):
            q3, k3, v3 = (t.reshape(B * H, -1, D) for t in (q, k, v))
            w = torch.bmm(q3 * D ** -0.5, k3.transpose(1, 2))
            # transformers' _prepare_4d_attention_mask
            inverted = 1.0 - pad[:, None, None, :].expand(B, 1, M, n_keys).to(q.dtype)
            mask = inverted.masked_fill(inverted.to(torch.bool), torch.finfo(q.dtype).min)
            w = w.view(B, H, M, n_keys) + mask
            w = w.view(B * H, M, n_keys).softmax(-1)
            return torch.bmm(w, v3).view(B, H, M, D)

    torch.manual_seed(0)
    q = torch.randn(B, H, M, D, requires_grad=True)
    k, v = (torch.randn(B, H, n_keys, D, requires_grad=True) for _ in range(2))
    pad = torch.ones(B, n_keys, dtype=torch.long)
    pad[1, n_keys // 2:] = 0 if n_keys > 1 else 1
    _fused_and_within_tolerance(Detr(), (q, k, v), pad)


def test_explain_reports_rank5_site_fused():
    torch.manual_seed(0)
    with torch.no_grad():
        report = fa3_inductor.explain(Spelled("hiera"), _input("hiera"))
    assert report.fused_count == 1, str(report)


# -- left alone, with a reason that names the structure --------------------------------------


class NotAttention(nn.Module):
    """Softmax-then-matmul layers that are not one softmax(q·kᵀ)·v per head."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.qkv = nn.Linear(H * D, 3 * H * D)
        self.heads = nn.Linear(H, H)                       # CaiT's proj_w
        self.conv = nn.Conv2d(H, H, 1)                     # EfficientFormerV2's talking head
        self.weights = nn.Linear(H * D, H * M)             # VOLO's outlook weights

    def forward(self, x):
        q, k, v = self.qkv(x).view(B, M, 3, H, D).permute(2, 0, 3, 1, 4)
        if self.spelling == "factorized":                  # CoaT: softmax over tokens of k
            ctx = k.softmax(dim=2).transpose(-1, -2) @ v
            return q @ ctx
        if self.spelling in ("talking_linear", "talking_conv"):
            attn = (q @ k.transpose(-2, -1)).softmax(dim=-1)
            if self.spelling == "talking_linear":
                attn = self.heads(attn.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            else:
                attn = self.conv(attn)
            return attn @ v
        if self.spelling == "outlook":                     # weights from a linear layer
            attn = self.weights(x).view(B, M, H, M).permute(0, 2, 1, 3) * 0.25
            return attn.softmax(dim=-1) @ v
        if self.spelling == "split_keys":                  # PEGASUS-X: slices with two V's
            s = torch.cat([q @ k[:, :, :4].transpose(-1, -2), q @ k.transpose(-1, -2)], -1)
            p = s.softmax(dim=-1)
            return p[:, :, :, :4] @ v[:, :, :4] + p[:, :, :, 4:] @ v
        raise KeyError(self.spelling)


@pytest.mark.parametrize("spelling,pattern", [
    ("factorized", r"transposes the softmax output.*linear / factorized attention.*not "
                   r"attention-shaped"),
    ("talking_linear", r"\(linear\) mixes the attention probabilities across heads.*talking-heads"
                       r".*not attention-shaped"),
    ("talking_conv", r"\(conv2d\) mixes the attention probabilities across heads.*talking-heads"),
    ("outlook", r"found 0 score products.*computed by .*linear.*not attention-shaped"),
    ("split_keys", r"slices the attention probabilities along the keys.*several score "
                   r"products.*not attention-shaped"),
])
def test_not_attention_is_left_alone_with_a_precise_reason(spelling, pattern):
    import re

    torch.manual_seed(0)
    model = NotAttention(spelling)
    x = torch.randn(B, M, H * D)
    with torch.no_grad():
        ref = model(x)
        out = torch.compile(model, backend="fa3", fullgraph=True)(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    sites = fa3_inductor.recognized_sites()
    assert sites and not any(s["rewritten"] for s in sites), sites
    assert any(re.search(pattern, s["reason"]) for s in sites), [s["reason"] for s in sites]


def test_cpmant_zero_fill_with_another_mask_is_left_alone():
    """The zero fill of the probabilities is exact only with the scores' own -inf mask."""
    class Other(nn.Module):
        def forward(self, q, k, v, m1, m2):
            s = (q @ k.transpose(-1, -2)).masked_fill(m1, float("-inf"))
            return torch.softmax(s, dim=-1).masked_fill(m2, 0.0) @ v

    q, k, v = (torch.randn(B, H, M, D) for _ in range(3))
    m1 = torch.rand(B, 1, M, M) < 0.2
    m2 = torch.rand(B, 1, M, M) < 0.2
    with torch.no_grad():
        torch.compile(Other(), backend="fa3", fullgraph=True)(q, k, v, m1, m2)
    (site,) = fa3_inductor.recognized_sites()
    assert not site["rewritten"] and "zeroes attention probabilities" in site["reason"], site


# -- the size rule on CUDA reads any rank ------------------------------------------------------


def test_attention_work_of_merged_batch_heads():
    assert rewrite_pays.attention_work((8, 128, 64), 128) == \
        rewrite_pays.attention_work((2, 4, 128, 64), 128)
    assert rewrite_pays.attention_work((2, 4, 3, 128, 64), 128) == 2 * 4 * 3 * 128 * 128 * 64


def test_small_site_reason_takes_3d_queries():
    """The GPU run crashed here ("not enough values to unpack") on every 3-D site."""
    fake = types.SimpleNamespace(device=torch.device("cuda"), shape=(8, 16, 16),
                                 requires_grad=False)
    why = rewrite_pays.small_site_reason(fake, fake)
    assert why is not None and why.startswith("small attention")
