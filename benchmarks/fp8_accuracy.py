"""FP8 attention accuracy against float64, on the FlashAttention-3 paper's outlier inputs (§4.3, Table 3).

Inputs: every entry of Q, K, V is N(0,1) + N(0,100)·Bernoulli(0.001), cast to bf16 (the kernel's
inputs); B=1, H=8, N=8192, non-causal, seeds 0-7. Reference: float64 attention on exactly those bf16
tensors, computed in query chunks. Metric: RMSE of the output, with cosine similarity, relative L1
(sum|o - ref| / sum|ref|) and max abs. Rows:

    ours              FP8Recipe(): Hadamard, int8 Q and K (QKᵀ an int8 MMA), e4m3 P and V, 128-row
                      block scales, two-level PV accumulation
    ours+smooth_k     FP8Recipe(smooth_k=True)
    e4m3 Q/K (FA3)    FP8Recipe(qk="e4m3"): Q and K in e4m3 as FlashAttention-3 (the ablation of int8)
    no hadamard       FP8Recipe(hadamard=False)
    per-head scales   FP8Recipe(block_m=0, block_n=0)
    no two-level      FP8Recipe(two_level=0)
    baseline          per-tensor e4m3 scales, S and PV in fp32, P rounded to bf16 (torch ops)

per shape: D = 64, 128, 256 at N = 8192 (B1 H8), and a long-context sweep N = 8K ... 128K at D = 128
(rows ours, no two-level, baseline; --long-seeds / --long-heads to make it cheaper).

    python benchmarks/fp8_accuracy.py                                  # CUDA, the FP8 kernel (fa3_inductor.flex(fp8=...))
    python benchmarks/fp8_accuracy.py --impl emulate                   # CUDA or CPU, the torch emulation below
    python benchmarks/fp8_accuracy.py --impl emulate --device cpu --n 1024,2048 --d 64,128 --seeds 0-3 --long none
    python benchmarks/fp8_accuracy.py --budget-s 540 --long 8192,32768,131072 --long-seeds 0-1

``--impl emulate`` runs :func:`emulate_fp8_attention`: the recipe in float32 torch ops with
``torch.float8_e4m3fn`` casts and int8 rounding (rotation, smoothing, block scales, Q and K in int8 or
e4m3 per ``FP8Recipe.qk``, P×2^8 with V's block scale folded in,
online softmax over KV tiles, and a model of the FP8 tensor core's ~22-bit accumulator: after every
``k_step``-wide k-step of PV the accumulator is rounded to ``bits`` mantissa bits, see
:class:`Accumulator`). Other code imports it: ``from fp8_accuracy import emulate_fp8_attention``
(with benchmarks/ on sys.path).

Writes ``fp8-accuracy-<device-slug>-<YYYY-MM-DD-HHMM>.{json,md}`` into ``--out`` (device, versions,
date and command in both) and prints a short table last. ``--budget-s`` skips the cases that would
not finish in time (recorded as skipped), so a run fits one 10-minute device call.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import platform
import re
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fa3_inductor.fp8_recipe import E4M3_MAX, INT8_MAX, FP8Recipe, RopeSpec  # noqa: E402

Tensor = torch.Tensor
LOG2E = 1.4426950408889634
P_SCALE = 256.0          # P = exp2(s - m) in [0, 1] is multiplied by 2^8 before its e4m3 cast
OUTLIER_PROB = 1e-3      # the paper's Bernoulli(0.001)
OUTLIER_STD = 10.0       # N(0, 100): variance 100

ROWS: dict[str, Optional[FP8Recipe]] = {
    "ours": FP8Recipe(),
    "ours+smooth_k": FP8Recipe(smooth_k=True),
    "e4m3 Q/K (FA3)": FP8Recipe(qk="e4m3"),
    "no hadamard": FP8Recipe(hadamard=False),
    "per-head scales": FP8Recipe(block_m=0, block_n=0),
    "no two-level": FP8Recipe(two_level=0),
    "baseline": None,   # per-tensor FP8 in torch ops (baseline_fp8_attention)
}
# Rows that change something FP8Recipe has no field for: always run by the emulation (also under
# --impl kernel), with these keyword arguments of emulate_fp8_attention.
# (Empty today: "ours+pow2 V ratios", V scales whose ratios are powers of two, became the prologue's
# rule after this emulation measured it: 2.20x -> 2.63x at N8192 D128.)
EMULATED_ROWS: dict[str, dict[str, Any]] = {}
LONG_ROWS = ("ours", "no two-level", "baseline")
PROTOCOL = dict(batch=1, heads=8, n=8192, dims=(64, 128, 256), seeds=tuple(range(8)))
LONG_NS = (8192, 16384, 32768, 65536, 131072)


# ----------------------------------------------------------------------------------------- inputs
def protocol_inputs(batch: int, heads: int, n: int, d: int, seed: int, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.bfloat16, outlier_prob: float = OUTLIER_PROB,
                    outlier_std: float = OUTLIER_STD) -> tuple[Tensor, Tensor, Tensor]:
    """Q, K, V of shape (B, H, N, D): every entry N(0,1) + N(0, outlier_std²)·Bernoulli(outlier_prob),
    cast to ``dtype`` (FA3 paper §4.3). Drawn from a generator on ``device`` seeded with ``seed``, so a
    CPU and a CUDA run of one seed draw different numbers.

    Example::

        >>> q, k, v = protocol_inputs(1, 2, 256, 64, seed=0)
        >>> q.shape, q.dtype
        (torch.Size([1, 2, 256, 64]), torch.bfloat16)
    """
    if not 0.0 <= outlier_prob <= 1.0:
        raise ValueError(f"outlier_prob must be in [0, 1], got {outlier_prob}")
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, heads, n, d)
    out = []
    for _ in range(3):
        x = torch.randn(shape, generator=g, device=device)
        hit = torch.rand(shape, generator=g, device=device) < outlier_prob
        x.add_(torch.randn(shape, generator=g, device=device).mul_(outlier_std).mul_(hit))
        out.append(x.to(dtype))
        del hit
    return out[0], out[1], out[2]


# ------------------------------------------------------------------------------------ shared math
def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, style: str = "half",
               positions: Optional[Tensor] = None) -> Tensor:
    """Rotary embedding on the first R channels of ``x`` (B, H, T, D), in ``cos``'s dtype promoted with
    ``x``'s; ``cos``/``sin`` are [P, R] or [B, P, R] tables (RopeSpec's convention), ``positions`` [T]
    or [B, T] picks their rows (None: 0..T-1). Channels past R pass through.

    Example::

        >>> x = torch.randn(1, 2, 4, 8); ang = torch.arange(4.)[:, None] * torch.ones(8)
        >>> apply_rope(x, ang.cos(), ang.sin())[..., 0, :].equal(x[..., 0, :])   # position 0: identity
        True
    """
    if style not in ("half", "interleaved"):
        raise ValueError(f"rope style must be 'half' or 'interleaved', got {style!r}")
    t = x.shape[-2]
    dtype = torch.promote_types(x.dtype, cos.dtype)
    cos, sin = cos.to(x.device, dtype), sin.to(x.device, dtype)
    if positions is not None:
        positions = positions.to(x.device)
        cos = cos[positions] if cos.dim() == 2 else torch.stack([c[p] for c, p in zip(cos, positions)])
        sin = sin[positions] if sin.dim() == 2 else torch.stack([s[p] for s, p in zip(sin, positions)])
    else:
        if cos.shape[-2] < t:
            raise ValueError(f"rope tables have {cos.shape[-2]} positions, the sequence {t}: pass longer tables")
        cos, sin = cos[..., :t, :], sin[..., :t, :]
    if cos.dim() == 3:                       # [B, T, R] -> [B, 1, T, R]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    if r > x.shape[-1] or r % 2:
        raise ValueError(f"rope width {r} must be even and <= the head dim {x.shape[-1]}")
    x = x.to(dtype)
    xr, rest = x[..., :r], x[..., r:]
    if style == "half":
        x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return torch.cat((xr * cos + rotated * sin, rest), dim=-1)


def _rope_of(x: Tensor, rope: Optional[RopeSpec], which: str, dtype: torch.dtype) -> Tensor:
    """x with the RopeSpec applied (q or k positions), in ``dtype``; x cast to dtype when no rope."""
    if rope is None:
        return x.to(dtype)
    pos = rope.q_positions if which == "q" else rope.k_positions
    return apply_rope(x.to(dtype), torch.as_tensor(rope.cos).to(dtype), torch.as_tensor(rope.sin).to(dtype),
                      rope.style, pos)


def _expand_kv(k: Tensor, heads: int) -> Tensor:
    """K or V with its heads repeated to the query's ``heads`` (GQA)."""
    hkv = k.shape[1]
    if hkv == heads:
        return k
    if heads % hkv:
        raise ValueError(f"query heads {heads} is not a multiple of key/value heads {hkv}")
    return k.repeat_interleave(heads // hkv, dim=1)


def _causal_mask(r0: int, r1: int, c0: int, c1: int, device: torch.device) -> Tensor:
    """True where kv_idx > q_idx (hidden by a top-left causal mask), for rows r0:r1, columns c0:c1."""
    qi = torch.arange(r0, r1, device=device).view(-1, 1)
    ki = torch.arange(c0, c1, device=device).view(1, -1)
    return ki > qi


def _row_chunk(batch: int, heads: int, n: int, max_elems: int) -> int:
    return max(1, max_elems // max(1, batch * heads * n))


def reference_fp64(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None, causal: bool = False,
                   rope: Optional[RopeSpec] = None, max_elems: int = 1 << 27) -> Tensor:
    """Float64 attention on exactly these tensors, in query chunks of at most ``max_elems`` scores
    (1 GiB of float64 by default); GQA when K/V have fewer heads; ``rope`` applied in float64 first;
    ``causal`` is top-left (kv_idx <= q_idx). Returns float64 (B, H, M, Dv).

    Example::

        >>> q, k, v = protocol_inputs(1, 2, 128, 64, seed=0)
        >>> reference_fp64(q, k, v, max_elems=4096).shape
        torch.Size([1, 2, 128, 64])
    """
    B, H, M, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    q64 = _rope_of(q, rope, "q", torch.float64)
    k64 = _expand_kv(_rope_of(k, rope, "k", torch.float64), H)
    v64 = _expand_kv(v.to(torch.float64), H)
    N = k64.shape[2]
    out = torch.empty(B, H, M, v.shape[-1], dtype=torch.float64, device=q.device)
    rows = _row_chunk(B, H, N, max_elems)
    kt = k64.transpose(-1, -2)
    for r0 in range(0, M, rows):
        r1 = min(M, r0 + rows)
        s = torch.matmul(q64[:, :, r0:r1], kt).mul_(scale)
        if causal:
            s.masked_fill_(_causal_mask(r0, r1, 0, N, q.device), float("-inf"))
        s = torch.softmax(s, dim=-1)
        out[:, :, r0:r1] = torch.matmul(s, v64)
        del s
    return out


def error_metrics(out: Tensor, ref: Tensor) -> dict[str, float]:
    """RMSE, cosine similarity, relative L1 (sum|out - ref| / sum|ref|) and max abs error of ``out``
    against ``ref``, in float64 over every element.

    Example::

        >>> error_metrics(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))["rmse"]
        1.4142135623730951
    """
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} differs from the reference's {tuple(ref.shape)}")
    o, r = out.to(torch.float64).flatten(), ref.to(torch.float64).flatten()
    if not torch.isfinite(o).all():
        return {"rmse": float("inf"), "cosine": float("nan"), "rel_l1": float("inf"), "max_abs": float("inf")}
    diff = o - r
    denom = (o.norm() * r.norm()).item()
    return {
        "rmse": diff.square().mean().sqrt().item(),
        "cosine": (o @ r).item() / denom if denom > 0 else float("nan"),
        "rel_l1": diff.abs().sum().item() / max(r.abs().sum().item(), 1e-300),
        "max_abs": diff.abs().max().item(),
    }


def to_e4m3(x: Tensor) -> Tensor:
    """``x`` rounded to float8_e4m3fn (nearest, saturating at ±448) and returned in float32.

    Example::

        >>> to_e4m3(torch.tensor([1.06, 500.0])).tolist()
        [1.0, 448.0]
    """
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def to_int8(x: Tensor) -> Tensor:
    """``x`` rounded to the nearest integer (ties to even) in [-127, 127], returned in float32: the
    prologue's int8 Q and K values.

    Example::

        >>> to_int8(torch.tensor([2.5, -3.5, 300.0])).tolist()
        [2.0, -4.0, 127.0]
    """
    return torch.round(x.float()).clamp(-INT8_MAX, INT8_MAX)


# ------------------------------------------------------------------------------- baseline (torch)
def baseline_fp8_attention(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None,
                           causal: bool = False, rope: Optional[RopeSpec] = None, quantize: bool = True,
                           p_dtype: torch.dtype = torch.bfloat16, out_dtype: Optional[torch.dtype] = None,
                           max_elems: int = 1 << 27) -> Tensor:
    """The paper's FP8 baseline in torch ops: one e4m3 scale (amax/448) per tensor for Q, K and V
    (RoPE, if any, applied in fp32 first), S and PV in fp32, softmax in fp32 with P = exp(S - max)
    rounded to ``p_dtype`` (16 bits) before PV and the row sum taken from the fp32 P. ``quantize=False``
    skips the e4m3 casts (with ``p_dtype=torch.float32`` this is plain fp32 attention). Output in
    ``out_dtype`` (None: float32).

    Example::

        >>> q, k, v = protocol_inputs(1, 2, 256, 64, seed=0)
        >>> o = baseline_fp8_attention(q, k, v, out_dtype=torch.bfloat16)
        >>> error_metrics(o, reference_fp64(q, k, v))["cosine"] > 0.99
        True
    """
    B, H, M, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    q32 = _rope_of(q, rope, "q", torch.float32)
    k32 = _rope_of(k, rope, "k", torch.float32)
    v32 = v.float()

    def per_tensor(x: Tensor) -> tuple[Tensor, float]:
        if not quantize:
            return x, 1.0
        amax = x.abs().max().item()
        s = amax / E4M3_MAX if amax > 0 else 1.0
        return to_e4m3(x / s), s

    q8, sq = per_tensor(q32)
    k8, sk = per_tensor(k32)
    v8, sv = per_tensor(v32)
    k8, v8 = _expand_kv(k8, H), _expand_kv(v8, H)
    N = k8.shape[2]
    kt = k8.transpose(-1, -2)
    out = torch.empty(B, H, M, v.shape[-1], dtype=torch.float32, device=q.device)
    rows = _row_chunk(B, H, N, max_elems)
    for r0 in range(0, M, rows):
        r1 = min(M, r0 + rows)
        s = torch.matmul(q8[:, :, r0:r1], kt).mul_(sq * sk * scale)
        if causal:
            s.masked_fill_(_causal_mask(r0, r1, 0, N, q.device), float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        p = torch.exp(s.sub_(m))
        l = p.sum(dim=-1, keepdim=True)
        out[:, :, r0:r1] = torch.matmul(p.to(p_dtype).float(), v8).mul_(sv).div_(l)
        del s, p
    return out if out_dtype is None else out.to(out_dtype)


# --------------------------------------------------------------------------- emulation of ours
@dataclasses.dataclass(frozen=True)
class Accumulator:
    """Model of the FP8 tensor core's PV accumulator (Hopper's FP8 wgmma keeps ~22 bits: sign,
    8 exponent bits, ~13 mantissa bits). After every ``k_step`` products along the key axis (one
    wgmma k-step) the running sum is rounded to ``bits`` mantissa bits: ``rounding`` "rtz"
    (truncation toward zero, the tensor cores' alignment behaviour, the pessimistic model), "rn"
    (to nearest) or "none" (exact fp32). ``k_step`` 32 is the k of an FP8 wgmma (m64nNk32).

    Example::

        >>> Accumulator().round(torch.tensor([1.0 + 2.0 ** -20])).item()
        1.0
    """

    bits: int = 13
    k_step: int = 32
    rounding: str = "rtz"

    def __post_init__(self) -> None:
        if self.rounding not in ("rtz", "rn", "none"):
            raise ValueError(f"Accumulator.rounding must be 'rtz', 'rn' or 'none', got {self.rounding!r}")
        if not 1 <= self.bits <= 23:
            raise ValueError(f"Accumulator.bits must be in 1..23 (fp32 has 23 mantissa bits), got {self.bits}")
        if self.k_step < 1:
            raise ValueError(f"Accumulator.k_step must be >= 1, got {self.k_step}")

    def round(self, x: Tensor) -> Tensor:
        """float32 ``x`` with its mantissa rounded to ``bits`` bits (a new tensor)."""
        if self.rounding == "none" or self.bits == 23:
            return x.clone()
        drop = 23 - self.bits
        i = x.contiguous().view(torch.int32)
        if self.rounding == "rn":
            i = i + (1 << (drop - 1))         # sign-magnitude: adds half an ulp to the magnitude
        return torch.bitwise_and(i, -(1 << drop)).view(torch.float32)


@dataclasses.dataclass
class EmulatedOperands:
    """What the prologue hands the FP8 kernel, as float32 values: int8 or e4m3 values of Q and K
    (``FP8Recipe.qk``), e4m3 values of V, their per-row scales (block scales expanded to rows), V's
    block scales relative to their maximum.

    ``q`` (B, H, M, D), ``q_scale`` (B, H, M, 1); ``k`` (B, Hkv, N, D), ``k_scale`` (B, Hkv, N, 1);
    ``v`` (B, Hkv, N, Dv), ``v_scale`` (B, Hkv, N, 1), ``v_scale_max`` (B, Hkv, 1, 1).
    """

    q: Tensor
    q_scale: Tensor
    k: Tensor
    k_scale: Tensor
    v: Tensor
    v_scale: Tensor
    v_scale_max: Tensor


def hadamard_signs(d: int, seed: int) -> Tensor:
    """The ±1 signs s of the rotation x·diag(s)·H_b/√b: ``torch.randint(0, 2, (d,))`` from
    ``torch.Generator().manual_seed(seed)`` on the CPU, mapped {0, 1} -> {-1, +1}; float64.

    Example::

        >>> hadamard_signs(8, 0).abs().sum().item()
        8.0
    """
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (d,), generator=g).to(torch.float64).mul_(2).sub_(1)


def hadamard_block(d: int) -> int:
    """b: the largest power of two dividing ``d`` (the Hadamard block; block diagonal when b < d).

    Example::

        >>> hadamard_block(128), hadamard_block(80), hadamard_block(96)
        (128, 16, 32)
    """
    if d < 1:
        raise ValueError(f"head dim must be >= 1, got {d}")
    return d & -d


def hadamard_rotation(d: int, seed: int) -> Tensor:
    """The (d, d) orthogonal matrix diag(s)·blockdiag(H_b, ..., H_b)/√b (H_b Sylvester's Hadamard
    matrix, b = hadamard_block(d), s = hadamard_signs(d, seed)), float64: rotate with ``x @ R``.

    Example::

        >>> r = hadamard_rotation(64, seed=0)
        >>> torch.allclose(r @ r.T, torch.eye(64, dtype=torch.float64))
        True
    """
    b = hadamard_block(d)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    blocks = torch.block_diag(*([h / math.sqrt(b)] * (d // b)))
    return hadamard_signs(d, seed).unsqueeze(1) * blocks


def _block_scales(x: Tensor, block: int, zero_scale: float = 1.0, pow2: bool = False,
                  top: float = E4M3_MAX) -> Tensor:
    """Per-row scales amax/``top`` of ``x`` (B, H, T, D) (448: e4m3, 127: int8), one per ``block``
    rows (0: per (B, H)); all-zero blocks get ``zero_scale``; ``pow2``: rounded up to a power of
    two (the prologue's V scales). Returns (B, H, T, 1) float32."""
    B, H, T, _ = x.shape
    a = x.abs().amax(dim=-1)                                  # (B, H, T)
    if block == 0 or block >= T:
        amax = a.amax(dim=-1, keepdim=True).expand(B, H, T)
    else:
        nb = -(-T // block)
        pad = nb * block - T
        if pad:
            a = torch.nn.functional.pad(a, (0, pad))
        amax = a.view(B, H, nb, block).amax(dim=-1).repeat_interleave(block, dim=-1)[..., :T]
    s = amax.float() / top
    if pow2:
        mantissa, exponent = torch.frexp(s)
        s = torch.where((mantissa == 0.5) | (s == 0), s, torch.ldexp(torch.ones_like(s), exponent))
    return torch.where(s > 0, s, torch.full_like(s, zero_scale)).unsqueeze(-1)


def emulate_quantize(q: Tensor, k: Tensor, v: Tensor, recipe: FP8Recipe,
                     rope: Optional[RopeSpec] = None) -> EmulatedOperands:
    """The prologue's job in float32 torch ops: RoPE (if given; the prologue's, in float32 rounded to
    the inputs' dtype: ``reference.apply_rope_rounded``), the Hadamard rotation of Q and K,
    K smoothing (mean over a token sample subtracted after the rotation), then Q and K in int8 (scale
    amax/127, round half to even) or e4m3 (amax/448) per ``recipe.qk``, V in e4m3, with one scale
    per ``block_m`` rows of Q / ``block_n`` rows of K and V (0: per (batch, head)); an all-zero
    block has scale 1 and does not count for ``v_scale_max``. V's scales are rounded up to powers of two,
    as the prologue's, so that the factor folded into P is a power of two and P = 1 stays exact.

    Example::

        >>> q, k, v = protocol_inputs(1, 2, 256, 64, seed=0)
        >>> ops = emulate_quantize(q, k, v, FP8Recipe())
        >>> ops.q_scale.unique().numel()      # 2 heads × 2 blocks of 128 rows
        4
    """
    from fa3_inductor.templates.fp8_prologue.reference import rotate, smooth_sample

    q32, k32 = rotate(q, k, FP8Recipe(hadamard=False), rope, torch.float32)
    if recipe.hadamard:
        r = hadamard_rotation(q.shape[-1], recipe.seed).to(q.device, torch.float32)
        q32, k32 = q32 @ r, k32 @ r
    if recipe.smooth_k:   # the prologue's mean: over its sample of at most 256 tokens
        k32 = k32 - k32[..., smooth_sample(k32.shape[-2]).to(k32.device), :].mean(dim=-2, keepdim=True)
    v32 = v.float()
    qk_top, qk_round = (INT8_MAX, to_int8) if recipe.qk == "int8" else (E4M3_MAX, to_e4m3)
    sq, sk = _block_scales(q32, recipe.block_m, top=qk_top), _block_scales(k32, recipe.block_n, top=qk_top)
    sv = _block_scales(v32, recipe.block_n, pow2=True)
    # v_scale_max: the largest scale among blocks that are not all zero (1 when all are)
    svmax = _block_scales(v32, recipe.block_n, zero_scale=0.0, pow2=True).amax(dim=-2, keepdim=True)
    svmax = torch.where(svmax > 0, svmax, torch.ones_like(svmax))
    return EmulatedOperands(q=qk_round(q32 / sq), q_scale=sq, k=qk_round(k32 / sk), k_scale=sk,
                            v=to_e4m3(v32 / sv), v_scale=sv, v_scale_max=svmax)


def emulate_fp8_forward(ops: EmulatedOperands, scale: float, causal: bool = False, tile_n: int = 128,
                        tile_m: int = 128, two_level: int = 1, acc: Accumulator = Accumulator(),
                        out_dtype: Optional[torch.dtype] = torch.bfloat16,
                        max_elems: int = 1 << 28) -> Tensor:
    """The FP8 kernel's arithmetic on prologue output: per KV tile of ``tile_n`` keys (in order),
    S = (q8·k8ᵀ)·sq·sk in fp32 (q8·k8ᵀ exact for int8 values: integer sums below 2^24, as the
    kernel's int32 ones) and in log2 units (× scale·log2 e), online softmax (running max m,
    P = exp2(S - m), row sum l from the fp32 P), P ×2^8 × v_scale/v_scale_max cast to e4m3, PV
    accumulated per ``acc`` (k-steps rounded to ~22 bits) and added into an fp32 accumulator every
    ``two_level`` tiles (0: never); output = acc · v_scale_max · 2^-8 / l. Causal rows go in chunks
    of ``tile_m`` queries (the kernel's query tile), so each row visits the tiles the kernel visits.

    Example::

        >>> q, k, v = protocol_inputs(1, 2, 256, 64, seed=0)
        >>> emulate_fp8_forward(emulate_quantize(q, k, v, FP8Recipe()), scale=64 ** -0.5).shape
        torch.Size([1, 2, 256, 64])
    """
    B, H, M, D = ops.q.shape
    N, Dv = ops.k.shape[2], ops.v.shape[-1]
    k8, v8 = _expand_kv(ops.k, H), _expand_kv(ops.v, H)
    sk = _expand_kv(ops.k_scale, H).transpose(-1, -2)                          # (B, H, 1, N)
    vf = (_expand_kv(ops.v_scale / ops.v_scale_max, H) * P_SCALE).transpose(-1, -2)
    vmax = _expand_kv(ops.v_scale_max, H)
    ks = acc.k_step
    rows = tile_m if causal else max(1, min(M, max_elems // max(1, B * H * max(tile_n, Dv * -(-tile_n // ks)))))
    out = torch.empty(B, H, M, Dv, dtype=torch.float32, device=ops.q.device)
    for r0 in range(0, M, rows):
        r1 = min(M, r0 + rows)
        qc, fq = ops.q[:, :, r0:r1], ops.q_scale[:, :, r0:r1] * (scale * LOG2E)
        mc = r1 - r0
        m = torch.full((B, H, mc, 1), float("-inf"), device=qc.device)
        l = torch.zeros(B, H, mc, 1, device=qc.device)
        o = torch.zeros(B, H, mc, Dv, device=qc.device)
        part = torch.zeros_like(o)
        n_end = min(N, r1) if causal else N
        for t, j0 in enumerate(range(0, n_end, tile_n)):
            j1 = min(N, j0 + tile_n)
            s = torch.matmul(qc, k8[:, :, j0:j1].transpose(-1, -2)).mul_(fq).mul_(sk[..., j0:j1])
            if causal and j1 - 1 > r0:
                s.masked_fill_(_causal_mask(r0, r1, j0, j1, qc.device), float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp2(m - m_safe)
            p = torch.exp2(s.sub_(m_safe))
            l = l * alpha + p.sum(dim=-1, keepdim=True)
            p8 = to_e4m3(p.mul_(vf[..., j0:j1]))
            m = m_new
            o.mul_(alpha)
            part.mul_(alpha)
            vt = v8[:, :, j0:j1]
            if acc.rounding == "none":
                part.add_(torch.matmul(p8, vt))
            else:
                n = j1 - j0
                ns = -(-n // ks)
                if ns * ks != n:
                    p8 = torch.nn.functional.pad(p8, (0, ns * ks - n))
                    vt = torch.nn.functional.pad(vt, (0, 0, 0, ns * ks - n))
                steps = torch.matmul(p8.view(B, H, mc, ns, ks).transpose(2, 3),  # (B, H, ns, mc, Dv)
                                     vt.reshape(B, H, ns, ks, Dv))
                for i in range(ns):
                    part = acc.round(part.add_(steps[:, :, i]))
            if two_level and (t + 1) % two_level == 0:
                o.add_(part)
                part.zero_()
        o.add_(part)
        out[:, :, r0:r1] = o.mul_(vmax / P_SCALE).div_(l)
    return out if out_dtype is None else out.to(out_dtype)


def emulate_fp8_attention(q: Tensor, k: Tensor, v: Tensor, recipe: FP8Recipe = FP8Recipe(),
                          scale: Optional[float] = None, causal: bool = False,
                          rope: Optional[RopeSpec] = None, acc: Accumulator = Accumulator(),
                          out_dtype: Optional[torch.dtype] = None, max_elems: int = 1 << 28) -> Tensor:
    """Our FP8 attention emulated in torch (CPU or CUDA): :func:`emulate_quantize` (the prologue)
    then :func:`emulate_fp8_forward` (the kernel) with the recipe's tiles (a block size of 0 still
    runs 128-wide tiles) and two-level setting. GQA when K/V have fewer heads; output in
    ``out_dtype`` (None: the input's dtype, as the kernel writes it).

    Example::

        >>> q, k, v = protocol_inputs(1, 4, 1024, 128, seed=0)
        >>> ref = reference_fp64(q, k, v)
        >>> ours = error_metrics(emulate_fp8_attention(q, k, v), ref)["rmse"]
        >>> base = error_metrics(baseline_fp8_attention(q, k, v, out_dtype=q.dtype), ref)["rmse"]
        >>> base / ours > 1.5
        True
    """
    if not isinstance(recipe, FP8Recipe):
        raise TypeError(f"recipe must be an fa3_inductor.fp8_recipe.FP8Recipe, got {type(recipe).__name__}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ops = emulate_quantize(q, k, v, recipe, rope)
    return emulate_fp8_forward(ops, scale, causal=causal, tile_n=recipe.block_n or 128,
                               tile_m=recipe.block_m or 128, two_level=recipe.two_level, acc=acc,
                               out_dtype=q.dtype if out_dtype is None else out_dtype, max_elems=max_elems)


def kernel_fp8_attention(q: Tensor, k: Tensor, v: Tensor, recipe: FP8Recipe, scale: Optional[float] = None,
                         causal: bool = False, rope: Optional[RopeSpec] = None) -> Tensor:
    """Our FP8 kernel: ``fa3_inductor.flex(q, k, v, fp8=recipe, scale=...)`` (causal: mask_mod
    mods.causal; GQA: enable_gqa=True; ``rope`` passed as ``rope=`` when flex takes it, else
    applied here in fp32 and handed over as bf16, and the caller's reference must see the same).

    Example::

        >>> out = kernel_fp8_attention(q, k, v, FP8Recipe())       # doctest: +SKIP
    """
    import inspect

    import fa3_inductor

    params = inspect.signature(fa3_inductor.flex).parameters
    if "fp8" not in params:
        raise RuntimeError("fa3_inductor.flex has no fp8= argument in this checkout (the FP8 kernel is not "
                           "merged yet): run with --impl emulate, or update the checkout")
    kwargs: dict[str, Any] = dict(fp8=recipe, scale=scale)
    if causal:
        kwargs["mask_mod"] = fa3_inductor.mods.causal
    if k.shape[1] != q.shape[1]:
        kwargs["enable_gqa"] = True
    if rope is not None:
        if "rope" in params:
            kwargs["rope"] = rope
        else:
            q, k = (_rope_of(x, rope, w, torch.float32).to(x.dtype) for x, w in ((q, "q"), (k, "k")))
    with torch.no_grad():
        return fa3_inductor.flex(q, k, v, **kwargs)


def kernel_template() -> Optional[str]:
    """The kernel family that served the last ``fa3_inductor.flex`` call (``last_template()``):
    a name of our FP8 family, or "torch" when the call fell back to the dense last resort.

    Example::

        >>> kernel_template()                          # doctest: +SKIP
        'fp8'
    """
    import fa3_inductor

    return fa3_inductor.last_template()


def kernel_takes_rope() -> bool:
    """Whether ``fa3_inductor.flex`` takes ``rope=`` (else RoPE is applied before the call).

    Example::

        >>> isinstance(kernel_takes_rope(), bool)
        True
    """
    import inspect

    import fa3_inductor

    return "rope" in inspect.signature(fa3_inductor.flex).parameters


def run_row(name: str, impl: str, q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None,
            causal: bool = False, rope: Optional[RopeSpec] = None, acc: Accumulator = Accumulator(),
            recipe: Optional[FP8Recipe] = None) -> Tensor:
    """The output of one benchmark row (a name of ROWS, or ``recipe`` given): the baseline in torch
    ops, our recipe through ``impl`` ("emulate" or "kernel").

    Example::

        >>> q, k, v = protocol_inputs(1, 1, 128, 64, seed=0)
        >>> run_row("ours", "emulate", q, k, v).dtype
        torch.bfloat16
    """
    if recipe is None:
        if name not in ROWS:
            raise ValueError(f"unknown row {name!r}: choose from {list(ROWS)}")
        recipe = ROWS[name]
    if recipe is None:
        return baseline_fp8_attention(q, k, v, scale=scale, causal=causal, rope=rope, out_dtype=q.dtype)
    if name in EMULATED_ROWS:
        return emulate_fp8_attention(q, k, v, recipe, scale=scale, causal=causal, rope=rope, acc=acc,
                                     **EMULATED_ROWS[name])
    if impl == "emulate":
        return emulate_fp8_attention(q, k, v, recipe, scale=scale, causal=causal, rope=rope, acc=acc)
    if impl == "kernel":
        return kernel_fp8_attention(q, k, v, recipe, scale=scale, causal=causal, rope=rope)
    raise ValueError(f"impl must be 'emulate' or 'kernel', got {impl!r}")


# --------------------------------------------------------------------------------------- the run
@dataclasses.dataclass
class Case:
    """One input set (shape and seed) and the rows measured on it."""

    batch: int
    heads: int
    n: int
    d: int
    seed: int
    rows: list[str]
    groups: list[str]           # "protocol" and/or "long"

    @property
    def shape(self) -> str:
        return f"B{self.batch} H{self.heads} N{self.n} D{self.d}"

    def cost(self) -> float:
        """Work units (B·H·N²·D per row plus the reference's share) to forecast its time."""
        return self.batch * self.heads * self.n * self.n * self.d * (len(self.rows) + 1.0)


def parse_ints(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8]; 'none' or '' -> [].

    Example::

        >>> parse_ints("0-2,8192,128k")
        [0, 1, 2, 8192, 131072]
    """
    def one(part: str) -> int:
        part = part.strip().lower()
        try:
            return int(part[:-1]) * 1024 if part.endswith("k") else int(part)
        except ValueError:
            raise ValueError(f"{part!r} in {text!r} is not an integer (write e.g. 0-7, 8192 or 8k)") from None

    out: list[int] = []
    if text.strip().lower() in ("", "none"):
        return out
    for part in text.split(","):
        if "-" in part.strip()[1:]:
            a, b = part.strip().split("-", 1)
            out.extend(range(one(a), one(b) + 1))
        else:
            out.append(one(part))
    return out


def build_cases(batch: int, heads: int, ns: Sequence[int], dims: Sequence[int], seeds: Sequence[int],
                rows: Sequence[str], long_ns: Sequence[int], long_heads: int, long_seeds: Sequence[int],
                long_rows: Sequence[str]) -> list[Case]:
    """The protocol cases (every N × D × seed, all ``rows``), then the long-context ones (D 128,
    ``long_rows``), N ascending; a long case equal to a protocol case is measured once.

    Example::

        >>> [c.shape for c in build_cases(1, 8, [8192], [64, 128], [0], ["ours"], [8192, 16384], 8, [0], ["ours"])]
        ['B1 H8 N8192 D64', 'B1 H8 N8192 D128', 'B1 H8 N16384 D128']
    """
    for r in list(rows) + list(long_rows):
        if r not in ROWS:
            raise ValueError(f"unknown row {r!r}: choose from {list(ROWS)}")
    cases: dict[tuple, Case] = {}
    for n in ns:
        for d in dims:
            for s in seeds:
                cases[(batch, heads, n, d, s)] = Case(batch, heads, n, d, s, list(rows), ["protocol"])
    for n in sorted(long_ns):
        for s in long_seeds:
            key = (batch, long_heads, n, 128, s)
            if key in cases:
                c = cases[key]
                c.rows += [r for r in long_rows if r not in c.rows]
                c.groups.append("long")
            else:
                cases[key] = Case(batch, long_heads, n, 128, s, list(long_rows), ["long"])
    return list(cases.values())


def run_case(case: Case, impl: str, device: str, acc: Accumulator = Accumulator()) -> list[dict[str, Any]]:
    """Measure every row of ``case`` against one float64 reference; one result dict per row
    (metrics, seconds, or the error a row raised).

    Example::

        >>> run_case(Case(1, 1, 128, 64, 0, ["ours", "baseline"], ["protocol"]), "emulate", "cpu")[0]["row"]
        'ours'
    """
    q, k, v = protocol_inputs(case.batch, case.heads, case.n, case.d, case.seed, device=device)
    t0 = time.perf_counter()
    ref = reference_fp64(q, k, v)
    _sync(device)
    ref_s = time.perf_counter() - t0
    results = []
    for name in case.rows:
        base = dict(shape=case.shape, batch=case.batch, heads=case.heads, n=case.n, d=case.d,
                    seed=case.seed, row=name, groups=case.groups,
                    impl="torch" if ROWS[name] is None else "emulate" if name in EMULATED_ROWS else impl,
                    recipe=None if ROWS[name] is None else dataclasses.asdict(ROWS[name]),
                    reference_s=round(ref_s, 3))
        t0 = time.perf_counter()
        try:
            out = run_row(name, impl, q, k, v, acc=acc)
            _sync(device)
            base.update(error_metrics(out, ref), seconds=round(time.perf_counter() - t0, 3))
            if base["impl"] == "kernel":   # which family served it: "torch" means the dense last resort
                base["template"] = kernel_template()
            del out
        except Exception as exc:   # noqa: BLE001  a row that fails is recorded, the others still run
            base.update(error=f"{type(exc).__name__}: {exc}"[:500])
        results.append(base)
    return results


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def aggregate(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (shape, row): RMSE mean and std over seeds, mean cosine, mean relative L1, largest max
    abs, and the ratio baseline RMSE / this row's RMSE (means over the seeds both have).

    Example::

        >>> aggregate([dict(shape="s", n=1, d=1, heads=1, row="ours", seed=0, rmse=1.0, cosine=1.0,
        ...                 rel_l1=0.1, max_abs=2.0)])[0]["rmse_mean"]
        1.0
    """
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["shape"], r["row"]), []).append(r)
    rows = []
    for (shape, name), rs in groups.items():
        ok = [r for r in rs if "rmse" in r]
        first = rs[0]
        entry: dict[str, Any] = dict(shape=shape, n=first["n"], d=first["d"], heads=first["heads"], row=name,
                                     seeds=[r["seed"] for r in ok], errors=[r["error"] for r in rs if "error" in r])
        if ok:
            rmse = [r["rmse"] for r in ok]
            entry.update(rmse_mean=statistics.fmean(rmse), rmse_std=statistics.pstdev(rmse) if len(rmse) > 1 else 0.0,
                         cosine=statistics.fmean(r["cosine"] for r in ok),
                         rel_l1=statistics.fmean(r["rel_l1"] for r in ok),
                         max_abs=max(r["max_abs"] for r in ok))
            base = {r["seed"]: r["rmse"] for r in groups.get((shape, "baseline"), []) if "rmse" in r}
            common = [r for r in ok if r["seed"] in base]
            if common:
                entry["ratio"] = (statistics.fmean(base[r["seed"]] for r in common)
                                  / statistics.fmean(r["rmse"] for r in common))
        rows.append(entry)
    return rows


def _fmt(x: Optional[float], spec: str = ".3e") -> str:
    return "—" if x is None else format(x, spec)


def markdown(payload: dict[str, Any]) -> str:
    """The markdown report of a run's payload (header, protocol table, long-context table, skips).

    Example::

        >>> markdown(dict(device="cpu", torch="2", triton="3", date="d", command="c", impl="emulate",
        ...               accumulator={}, table=[], results=[], skipped=[])).splitlines()[0]
        '# FP8 attention accuracy: cpu'
    """
    lines = [f"# FP8 attention accuracy: {payload['device']}", "",
             f"torch {payload['torch']}, triton {payload['triton']}, {payload['date']}; impl `{payload['impl']}`"
             + (f", accumulator model {payload['accumulator']}" if payload["impl"] == "emulate" else ""), "",
             f"Command: `{payload['command']}`", "",
             "Inputs N(0,1) + N(0,100)·Bernoulli(0.001) in bf16, non-causal, reference float64 on the same "
             "bf16 tensors (FA3 paper §4.3). ratio = baseline RMSE / row RMSE (same seeds).", ""]
    table = payload["table"]
    proto = [t for t in table if any("protocol" in r["groups"] for r in payload["results"]
                                     if r["shape"] == t["shape"] and r["row"] == t["row"])]
    if proto:
        lines += ["| shape | row | RMSE mean ± std | cosine | rel L1 | max abs | baseline/row | seeds |",
                  "|---|---|---|---|---|---|---|---|"]
        for t in proto:
            if "rmse_mean" not in t:
                lines.append(f"| {t['shape']} | {t['row']} | error: {t['errors'][0][:120]} | | | | | |")
                continue
            lines.append(f"| {t['shape']} | {t['row']} | {t['rmse_mean']:.3e} ± {t['rmse_std']:.1e} | "
                         f"{t['cosine']:.6f} | {t['rel_l1']:.3e} | {t['max_abs']:.3e} | "
                         f"{_fmt(t.get('ratio'), '.2f')} | {len(t['seeds'])} |")
        lines.append("")
    # the long-context table: only the long cases' seeds, so that every N is compared on the same seeds
    long_rows = payload.get("long_rows") or list(ROWS)
    longs = [t for t in aggregate([r for r in payload["results"] if "long" in r["groups"] and r["row"] in long_rows])
             if "rmse_mean" in t]
    if longs:
        lines += ["## Long context (D 128)", "",
                  "Means over the long-context seeds only (--long-seeds), also at the shortest N.", "",
                  "| N | heads | row | RMSE mean ± std | RMSE / RMSE at the shortest N | cosine | baseline/row | seeds |",
                  "|---|---|---|---|---|---|---|---|"]
        shortest: dict[str, float] = {}
        for t in sorted(longs, key=lambda t: (t["row"], t["n"])):
            shortest.setdefault(t["row"], t["rmse_mean"])
        for t in sorted(longs, key=lambda t: (t["n"], t["row"])):
            lines.append(f"| {t['n']} | {t['heads']} | {t['row']} | {t['rmse_mean']:.3e} ± {t['rmse_std']:.1e} | "
                         f"{t['rmse_mean'] / shortest[t['row']]:.3f} | {t['cosine']:.6f} | "
                         f"{_fmt(t.get('ratio'), '.2f')} | {len(t['seeds'])} |")
        lines.append("")
    if payload["skipped"]:
        lines += [f"Skipped for the time budget ({payload.get('budget_s')} s): "
                  + ", ".join(f"{s['shape']} seed {s['seed']}" for s in payload["skipped"]), ""]
    served = sorted({str(r["template"]) for r in payload["results"] if "template" in r})
    if served:
        lines += ["Kernel families that served the kernel rows (`last_template()`): " + ", ".join(served)
                  + ("  **(torch = the dense fallback on dequantized inputs, not the FP8 kernel)**"
                     if "torch" in served else ""), ""]
    errs = [r for r in payload["results"] if "error" in r]
    if errs:
        lines += ["## Errors", ""] + [f"- {r['shape']} seed {r['seed']} {r['row']}: {r['error']}" for r in errs] + [""]
    return "\n".join(lines)


def short_table(table: list[dict[str, Any]]) -> str:
    """One line per (shape, row): RMSE mean and the baseline ratio.

    Example::

        >>> short_table([dict(shape="s", row="ours", rmse_mean=1e-2, ratio=2.5)]).splitlines()[1].split()
        ['s', 'ours', '1.000e-02', '2.50']
    """
    lines = [f"{'shape':<22} {'row':<16} {'RMSE':>10} {'base/row':>8}"]
    for t in table:
        lines.append(f"{t['shape']:<22} {t['row']:<16} {_fmt(t.get('rmse_mean')):>10} "
                     f"{_fmt(t.get('ratio'), '.2f'):>8}")
    return "\n".join(lines)


def device_name(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' on CUDA, 'cpu <processor>' otherwise."""
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu " + (platform.processor() or platform.machine())


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'; 'cpu x86_64' -> 'cpu-x86-64'.

    Example::

        >>> device_slug("NVIDIA H200")
        'nvidia-h200'
    """
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def command_line(script: str, argv: Optional[Sequence[str]]) -> str:
    """The command a result file records: ``python benchmarks/<script> <args as given>``.

    Example::

        >>> command_line("fp8_accuracy.py", ["--d", "128"])
        'python benchmarks/fp8_accuracy.py --d 128'
    """
    return f"python benchmarks/{script} " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))


def write_result(out_dir: str, stem: str, payload: dict, table: str) -> Path:
    """Write ``<stem>.json`` (``payload``) and ``<stem>.md`` (``table``) into ``out_dir``; returns
    the path of both without their suffix (the FP8 benchmarks' result files).

    Example::

        >>> write_result("/tmp/r", "fp8-accuracy-cpu-2026-01-01-0000", {"rows": []}, "| |")  # doctest: +SKIP
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / stem
    Path(f"{path}.json").write_text(json.dumps(payload, indent=1, default=str))
    Path(f"{path}.md").write_text(table)
    print(f"wrote {path}.json and {path}.md")
    return path


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=("kernel", "emulate"), default="kernel",
                   help="kernel: fa3_inductor.flex(fp8=recipe) on CUDA; emulate: the torch emulation")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--n", default=str(PROTOCOL["n"]), help="sequence lengths of the protocol shapes, e.g. 1024,2048")
    p.add_argument("--d", default=",".join(map(str, PROTOCOL["dims"])), help="head dims, e.g. 64,128,256")
    p.add_argument("--heads", type=int, default=PROTOCOL["heads"])
    p.add_argument("--batch", type=int, default=PROTOCOL["batch"])
    p.add_argument("--seeds", default="0-7", help="seeds of the protocol shapes, e.g. 0-7 or 0,3")
    p.add_argument("--rows", default=",".join(ROWS), help=f"rows of the protocol shapes, from {list(ROWS)}")
    p.add_argument("--long", default=",".join(map(str, LONG_NS)),
                   help="long-context lengths at D 128 ('none' to skip), e.g. 8k,32k,128k")
    p.add_argument("--long-seeds", default="0-1", help="seeds of the long-context cases")
    p.add_argument("--long-heads", type=int, default=PROTOCOL["heads"])
    p.add_argument("--long-rows", default=",".join(LONG_ROWS))
    p.add_argument("--acc-bits", type=int, default=13, help="emulate: accumulator mantissa bits")
    p.add_argument("--acc-k-step", type=int, default=32, help="emulate: keys per rounded k-step")
    p.add_argument("--acc-rounding", choices=("rtz", "rn", "none"), default="rtz")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="skip cases forecast to end past this many seconds from the start")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark; returns 0, 1 if a row raised, 2 on bad arguments.

    Example::

        >>> main(["--impl", "emulate", "--device", "cpu", "--n", "256", "--d", "64", "--seeds", "0",
        ...       "--long", "none", "--out", "/tmp/fp8acc"])      # doctest: +SKIP
        0
    """
    args = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("fp8_accuracy: --device cuda but torch.cuda.is_available() is False: use --device cpu "
              "--impl emulate with small --n", file=sys.stderr)
        return 2
    if args.impl == "kernel" and not device.startswith("cuda"):
        print("fp8_accuracy: the FP8 kernel runs on CUDA only: on this machine use --impl emulate "
              "(with small --n, e.g. --n 1024 --long none)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False          # fp32 matmuls must stay fp32
    torch.backends.cudnn.allow_tf32 = False
    acc = Accumulator(bits=args.acc_bits, k_step=args.acc_k_step, rounding=args.acc_rounding)
    try:
        cases = build_cases(args.batch, args.heads, parse_ints(args.n), parse_ints(args.d), parse_ints(args.seeds),
                            [r.strip() for r in args.rows.split(",") if r.strip()], parse_ints(args.long),
                            args.long_heads, parse_ints(args.long_seeds),
                            [r.strip() for r in args.long_rows.split(",") if r.strip()])
    except ValueError as exc:
        print(f"fp8_accuracy: {exc}", file=sys.stderr)
        return 2
    if not cases:
        print("fp8_accuracy: no case to run (check --n, --d, --seeds, --long)", file=sys.stderr)
        return 2
    import triton

    name = device_name(device)
    started = time.perf_counter()
    rate: Optional[float] = None     # seconds per cost unit, from the cases done
    results: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for i, case in enumerate(cases):
        elapsed = time.perf_counter() - started
        if rate is not None and elapsed + rate * case.cost() > args.budget_s:
            skipped.append(dict(shape=case.shape, seed=case.seed, rows=case.rows,
                                forecast_s=round(rate * case.cost(), 1)))
            print(f"[{elapsed:.0f}s] skip {case.shape} seed {case.seed}: forecast {rate * case.cost():.0f} s "
                  f"would pass --budget-s {args.budget_s:.0f}", flush=True)
            continue
        t0 = time.perf_counter()
        rs = run_case(case, args.impl, device, acc)
        took = time.perf_counter() - t0
        rate = took / case.cost()      # the latest case's rate: the first one pays compiles and warm-up
        results += rs
        print(f"[{time.perf_counter() - started:.0f}s] {case.shape} seed {case.seed} ({took:.1f} s): "
              + ", ".join(f"{r['row']} {r['rmse']:.3e}" if "rmse" in r else f"{r['row']} ERROR" for r in rs),
              flush=True)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    now = datetime.datetime.now()
    payload = dict(device=name, torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                   date=now.strftime("%Y-%m-%d %H:%M"),
                   command=command_line("fp8_accuracy.py", argv),
                   impl=args.impl, accumulator=dataclasses.asdict(acc), budget_s=args.budget_s,
                   long_rows=[r.strip() for r in args.long_rows.split(",") if r.strip()],
                   seconds=round(time.perf_counter() - started, 1),
                   protocol="FA3 paper §4.3: N(0,1) + N(0,100)*Bernoulli(0.001), bf16, non-causal, float64 reference",
                   table=aggregate(results), results=results, skipped=skipped)
    write_result(args.out, f"fp8-accuracy-{device_slug(name)}-{now.strftime('%Y-%m-%d-%H%M')}", payload,
                 markdown(payload) + "\n")
    print(short_table(payload["table"]))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
