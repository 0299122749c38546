"""The FP8 prologue's math in torch ops: RoPE (float32, rounded to the inputs' dtype) -> Hadamard
rotation -> [smooth K] -> block quantization (Q and K to int8 or e4m3 per ``FP8Recipe.qk``, V to
e4m3).

Used by the tests and the accuracy benchmark as the reference (float64 by default), and by
:func:`~fa3_inductor.templates.fp8_prologue.host.quantize` as the CPU path when Triton cannot run.
Shapes and conventions are those of ``kernel.py``'s notation and ``fp8_recipe.FP8Operands``; inputs
are assumed valid (``host.quantize`` checks them).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...fp8_recipe import E4M3_MAX, INT8_MAX, FP8Operands, FP8Recipe, RopeSpec
from .hadamard import rotation_matrix

E4M3_MIN_NORMAL_EXP = -6   # smallest normal e4m3 is 2^-6; subnormals are spaced 2^-9
E4M3_MANTISSA_BITS = 3
SMOOTH_SAMPLE = 256        # smooth_k: K's mean is taken over at most this many tokens per head
KNUTH_HASH = 2654435761    # round(2^32 / golden ratio): the offsets of the sampled tokens
FP16_MAX = 65504.0         # largest finite float16: RoPE'd fp16 values saturate there


def smooth_sample(n: int, sample: int = SMOOTH_SAMPLE) -> torch.Tensor:
    """The tokens whose mean ``smooth_k`` subtracts from K: all ``n`` when n <= ``sample``, else one
    per stratum [j·n / s, (j + 1)·n / s) of s = ``sample`` strata, at an offset in it hashed from j
    (the top 32 bits of ((j·KNUTH_HASH) mod 2^32)·width): a stratified sample, so an unbiased
    estimate of the mean over all tokens that no period in K (RoPE's rotations) can alias. Any
    per-head vector subtracted from every key shifts each query's scores by one constant, which
    softmax ignores: the sample changes how well K is centred, never the attention output. The
    kernel (kernel.py, _sample_tokens) does the same integer arithmetic.

    Example::

        >>> smooth_sample(5).tolist()
        [0, 1, 2, 3, 4]
        >>> idx = smooth_sample(4096); len(idx), bool(((idx // 16) == torch.arange(256)).all())
        (256, True)
    """
    s = min(n, sample)
    j = torch.arange(s, dtype=torch.int64)
    lo = j * n // s
    width = (j + 1) * n // s - lo
    h = (j * KNUTH_HASH) & 0xFFFFFFFF
    return lo + ((h * width) >> 32)


def rope_tables(rope: RopeSpec, positions: Optional[torch.Tensor], batch: int, length: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin gathered at ``positions`` (None: 0 .. length-1): [batch or 1, 1, length, R].

    Example::

        >>> cos, sin = rope_tables(RopeSpec.from_theta(8, 16), None, 2, 5, torch.float64)
        >>> tuple(cos.shape)
        (1, 1, 5, 8)
    """
    def gather(table: torch.Tensor) -> torch.Tensor:
        t = table.to(dtype)
        if t.dim() == 2:
            t = t.unsqueeze(0)
        pos = torch.arange(length, device=t.device) if positions is None else positions.long()
        if pos.dim() == 1:
            pos = pos.unsqueeze(0)
        rows = max(t.shape[0], pos.shape[0])
        t = t.expand(rows, *t.shape[1:])
        pos = pos.expand(rows, length)
        return t[torch.arange(rows, device=t.device)[:, None], pos].unsqueeze(1)

    return gather(rope.cos), gather(rope.sin)


def _turned(xr: torch.Tensor, style: str) -> torch.Tensor:
    """The partner each rotated channel is multiplied by sin with: rotate_half(x) = cat(-x2, x1)
    ("half"), or (-x_{2i+1}, x_{2i}) per pair ("interleaved")."""
    r = xr.shape[-1]
    if style == "half":
        return torch.cat([-xr[..., r // 2:], xr[..., : r // 2]], dim=-1)
    even, odd = xr[..., 0::2], xr[..., 1::2]
    return torch.stack([-odd, even], dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """x * cos + rotate(x) * sin on the first R = cos.shape[-1] channels; the rest pass through.

    "half": rotate_half(x) = cat(-x2, x1) (transformers' apply_rotary_pos_emb); "interleaved":
    pairs (2i, 2i+1) rotate as complex numbers (Meta llama's apply_rotary_emb). Each channel takes
    its own table column, so any tables work (the two members of a pair need not share a
    frequency): "half" out[i] = x[i]·cos[i] - x[i+R/2]·sin[i], out[i+R/2] = x[i+R/2]·cos[i+R/2] +
    x[i]·sin[i+R/2]; "interleaved" the same with i+R/2 -> 2i+1.

    Example::

        >>> x = torch.tensor([[1.0, 0.0]]); c, s = torch.zeros(1, 2), torch.ones(1, 2)
        >>> apply_rope(x, c, s, "half").tolist()
        [[0.0, 1.0]]
        >>> x, c, s = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 5.0]]), torch.tensor([[7.0, 11.0]])
        >>> apply_rope(x, c, s, "interleaved").tolist()      # [1·3 - 2·7, 2·5 + 1·11]
        [[-11.0, 21.0]]
    """
    r = cos.shape[-1]
    xr, rest = x[..., :r], x[..., r:]
    return torch.cat([xr * cos + _turned(xr, style) * sin, rest], dim=-1)


def apply_rope_rounded(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       style: str) -> torch.Tensor:
    """The prologue's RoPE, bit for bit (kernel.py, _load_parts): :func:`apply_rope` in float32,
    each rotated channel one product and one fused multiply-add, out = fma(x, cos, RN(turned·sin))
    (turned = rotate(x), the tables rounded to float32), then rounded to x's dtype, ties to even:
    what a bf16 / fp16 model's own RoPE writes (its output is in that dtype; it rounds more often
    on the way, in bf16 arithmetic with bf16 tables). float16 saturates at ±65504 (its range is
    smaller than float32's: RoPE of values near it can pass it), bfloat16 does not (fp32's range).
    The fma is taken in float64 and rounded to float32: the product of two float32 values is exact
    there, and the double rounding (float64, then float32) differs from the GPU's FFMA only when
    the float64 sum lands exactly on a float32 tie, a 2^-29 chance.

    Example::

        >>> x, c, s = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.01, 1.0]]), torch.ones(1, 2)
        >>> apply_rope_rounded(x.bfloat16(), c, s, "half").tolist()     # 1.01 rounded to bf16
        [[1.0078125, 1.0]]
        >>> x, c = torch.full((1, 2), 60000.0, dtype=torch.float16), torch.ones(1, 2)
        >>> apply_rope_rounded(x, c, s, "half").tolist()                # 120000 saturates
        [[0.0, 65504.0]]
    """
    r = cos.shape[-1]
    xr, rest = x[..., :r].float(), x[..., r:]
    product = (_turned(xr, style) * sin.float()).double()
    out = (xr.double() * cos.float().double() + product).float()
    if x.dtype == torch.float16:
        out = out.clamp(-FP16_MAX, FP16_MAX)
    return torch.cat([out.to(x.dtype), rest], dim=-1)


def rotate(q: torch.Tensor, k: torch.Tensor, recipe: FP8Recipe, rope: Optional[RopeSpec] = None,
           dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Q and K after RoPE (:func:`apply_rope_rounded`: float32, rounded to q's and k's dtype) and
    the Hadamard rotation (no smoothing, no quantization), in ``dtype``.

    Example::

        >>> q, k = torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 64)
        >>> qr, kr = rotate(q, k, FP8Recipe())
        >>> torch.allclose(qr @ kr.mT, q.double() @ k.double().mT)
        True
    """
    if rope is not None:
        f32 = torch.float32
        q = apply_rope_rounded(q, *rope_tables(rope, rope.q_positions, q.shape[0], q.shape[2], f32),
                               rope.style)
        k = apply_rope_rounded(k, *rope_tables(rope, rope.k_positions, k.shape[0], k.shape[2], f32),
                               rope.style)
    q, k = q.to(dtype), k.to(dtype)
    if recipe.hadamard:
        h = rotation_matrix(q.shape[-1], recipe.seed).to(device=q.device, dtype=dtype)
        q, k = q @ h, k @ h
    return q, k


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest float8_e4m3fn value (ties to even), saturating at ±448, computed in
    x's own dtype (exact in float64 and float32): no double rounding through float32.

    Example::

        >>> round_e4m3(torch.tensor([0.53125, 17.0, 1000.0, 2.0 ** -10], dtype=torch.float64)).tolist()
        [0.5, 16.0, 448.0, 0.0]
    """
    _, exp = torch.frexp(x.abs())          # |x| = m * 2^exp, m in [0.5, 1)
    exp = torch.clamp(exp - 1, min=E4M3_MIN_NORMAL_EXP)   # floor(log2|x|), subnormals at 2^-6's
    spacing = torch.ldexp(torch.ones_like(x), exp - E4M3_MANTISSA_BITS)
    return torch.clamp(torch.round(x / spacing) * spacing, -E4M3_MAX, E4M3_MAX)


def block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """max |x| [B, H, ceil(S / block)] of x [B, H, S, C] per block of rows over all channels (block
    0: the whole head, last dim 1).

    Example::

        >>> block_amax(torch.tensor([[[[1.0], [-3.0], [2.0]]]]), 2).tolist()
        [[[3.0, 2.0]]]
    """
    B, H, S, C = x.shape
    rows = block or S
    groups = -(-S // rows)
    padded = torch.zeros(B, H, groups * rows, C, dtype=x.dtype, device=x.device)
    padded[:, :, :S] = x
    return padded.abs().view(B, H, groups, rows * C).amax(-1)


def round_int8(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest integer (ties to even) and clamp to [-127, 127], in x's own dtype: the
    prologue's int8 Q and K values (kernel.py, _to_int8).

    Example::

        >>> round_int8(torch.tensor([2.5, 3.5, -0.5, 127.4, -200.0], dtype=torch.float64)).tolist()
        [2.0, 4.0, -0.0, 127.0, -127.0]
    """
    return torch.clamp(torch.round(x), -INT8_MAX, INT8_MAX)


def block_scales(x: torch.Tensor, block: int, pow2: bool = False,
                 top: float = E4M3_MAX) -> torch.Tensor:
    """float32 scales amax / ``top`` (:func:`block_amax`; 448 for e4m3, 127 for int8), 1 for an
    all-zero block; ``pow2``: rounded up to a power of two (V's scales: kernel.py, _pow2_scale_of).

    Example::

        >>> block_scales(torch.full((1, 1, 3, 2), 4.48, dtype=torch.float64), 2).tolist()
        [[[0.009999999776482582, 0.009999999776482582]]]
        >>> block_scales(torch.full((1, 1, 2, 2), 12.7, dtype=torch.float64), 0, top=127.0).tolist()
        [[[0.10000000149011612]]]
    """
    amax = block_amax(x, block)
    scales = torch.where(amax > 0, amax / top, 1.0).float()
    if pow2:
        mantissa, exponent = torch.frexp(scales)   # scales = mantissa * 2^exponent, mantissa in [0.5, 1)
        scales = torch.where(mantissa == 0.5, scales, torch.ldexp(torch.ones_like(scales), exponent))
    return scales


def quantize_blocks(x: torch.Tensor, block: int, pow2: bool = False,
                    fmt: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """(values rounded to ``fmt``'s grid in x's dtype, float32 scales) for x [B, H, S, C] by blocks
    of rows. ``fmt`` "e4m3": scales amax / 448 (``pow2``: :func:`block_scales`'s power-of-two
    scales), :func:`round_e4m3`; "int8": scales amax / 127, :func:`round_int8`. The quotient
    x / scale is taken in x's dtype (float64: exact ties, see docs/design/fp8_prologue.md).

    Example::

        >>> vals, scales = quantize_blocks(torch.randn(1, 1, 5, 16, dtype=torch.float64), 4)
        >>> tuple(scales.shape), bool(vals.abs().max() <= 448)
        ((1, 1, 2), True)
        >>> vals, _ = quantize_blocks(torch.randn(1, 1, 5, 16, dtype=torch.float64), 4, fmt="int8")
        >>> bool(vals.abs().max() == 127 and torch.equal(vals, vals.round()))
        True
    """
    if fmt not in ("e4m3", "int8"):
        raise ValueError(f"quantize_blocks: fmt must be 'e4m3' or 'int8', got {fmt!r}")
    S = x.shape[2]
    scales = block_scales(x, block, pow2, E4M3_MAX if fmt == "e4m3" else INT8_MAX)
    per_row = scales.to(x.dtype).repeat_interleave(block or S, dim=2)[:, :, :S, None]
    rounded = round_e4m3 if fmt == "e4m3" else round_int8
    return rounded(x / per_row), scales


def quantize_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: FP8Recipe,
                       rope: Optional[RopeSpec] = None,
                       dtype: torch.dtype = torch.float64) -> FP8Operands:
    """What ``host.quantize`` computes, in torch ops carried out in ``dtype``.

    Example::

        >>> q = k = v = torch.randn(1, 2, 40, 64, dtype=torch.bfloat16)
        >>> ops = quantize_reference(q, k, v, FP8Recipe(block_m=16, block_n=32))
        >>> tuple(ops.vt.shape), tuple(ops.q_scale.shape), tuple(ops.k_scale.shape)
        ((1, 2, 64, 48), (1, 2, 3), (1, 2, 2))
    """
    qr, kr = rotate(q, k, recipe, rope, dtype)
    k_mean = None
    if recipe.smooth_k:
        mean = kr[:, :, smooth_sample(kr.shape[2]).to(kr.device)].mean(dim=2, keepdim=True)
        kr = kr - mean
        k_mean = mean.squeeze(2).float()
    q8, q_scale = quantize_blocks(qr, recipe.block_m, fmt=recipe.qk)
    k8, k_scale = quantize_blocks(kr, recipe.block_n, fmt=recipe.qk)
    v8, v_scale = quantize_blocks(v.to(dtype), recipe.block_n, pow2=True)
    B, H, N, Dv = v.shape
    n_pad = -(-N // 16) * 16
    vt = torch.zeros(B, H, Dv, n_pad, dtype=dtype, device=v.device)
    vt[..., :N] = v8.transpose(2, 3)
    # Only blocks that are not all zero count: an all-zero block's scale 1 says nothing of V's range.
    nonzero = block_amax(v, recipe.block_n) > 0
    v_scale_max = torch.where(nonzero, v_scale, 0.0).amax(-1)
    v_scale_max = torch.where(v_scale_max > 0, v_scale_max, 1.0)
    fp8 = torch.float8_e4m3fn
    qk_dtype = torch.int8 if recipe.qk == "int8" else fp8
    return FP8Operands(q=q8.to(qk_dtype).contiguous(), k=k8.to(qk_dtype).contiguous(), vt=vt.to(fp8),
                       q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, v_scale_max=v_scale_max,
                       k_mean=k_mean, recipe=recipe, n=N)


def dequantize(ops: FP8Operands) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) float32 from FP8 operands (int8 or e4m3 Q and K, e4m3 Vᵀ), in the rotated basis
    (K with its mean removed when smoothed), V back in [B, H, N, Dv].

    Example::

        >>> q = k = v = torch.randn(1, 1, 16, 32)
        >>> dq, dk, dv = dequantize(quantize_reference(q, k, v, FP8Recipe(hadamard=False)))
        >>> bool((dv - v).abs().max() < 0.1 * v.abs().max())
        True
        >>> bool((dq - q).abs().max() < 0.01 * q.abs().max())     # int8 Q: steps of amax / 127
        True
    """
    def expand(scale: torch.Tensor, block: int, length: int) -> torch.Tensor:
        return scale.repeat_interleave(block or length, dim=2)[:, :, :length, None]

    M, N = ops.q.shape[2], ops.n
    q = ops.q.float() * expand(ops.q_scale, ops.recipe.block_m, M)
    k = ops.k.float() * expand(ops.k_scale, ops.recipe.block_n, N)
    v = ops.vt[..., :N].float().transpose(2, 3) * expand(ops.v_scale, ops.recipe.block_n, N)
    return q, k, v


__all__ = ["apply_rope", "apply_rope_rounded", "block_amax", "block_scales", "dequantize", "quantize_blocks", "quantize_reference",
           "rope_tables", "rotate", "round_e4m3", "round_int8", "smooth_sample"]
