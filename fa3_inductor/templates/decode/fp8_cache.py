"""FP8 KV caches for the decode kernels: the scales' granularity (checked), a cache's dequantized
copy (the gather fallback), and :func:`quantize_kv`, which fills such a cache.

A key's (value's) real value is its e4m3 (or e5m2) value times its float32 scale. The scale's shape
says how it varies (kernel.py, ``CacheLayout.KV_SCALE``):

    0-d or [1]        "tensor"  one scale for the cache (vLLM's k_scale / v_scale)
    [HKV]             "head"    one per kv head
    [B, HKV]          "seq"     one per sequence and kv head (a contiguous [B, HKV, N, D] cache)
    [num_pages, HKV]  "page"    one per physical page and kv head (a paged cache)
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
GRANULARITIES = ("tensor", "head", "page")


def _fail(who: str, what: str, fix: str) -> ValueError:
    return ValueError(f"{who}: {what}; {fix}")


def kv_scale_mode(k: Tensor, v: Tensor, k_scale: Optional[Tensor], v_scale: Optional[Tensor],
                  paged: bool, who: str = "flex_decode") -> str:
    """The kernel's ``KV_SCALE`` for caches ``k``, ``v`` ([B, HKV, N, D], or pages [num_pages,
    page_size, HKV, D] when ``paged``) and their scales: "none" for a cache in q's dtype without
    scales, else "tensor" / "head" / "seq" / "page" by the scales' shape (module docstring).
    Raises TypeError / ValueError, prefixed ``who``, saying what was wrong and what to pass.

    Example::

        >>> k = torch.zeros(2, 4, 16, 64).to(torch.float8_e4m3fn)
        >>> kv_scale_mode(k, k, torch.ones(4), torch.ones(4), paged=False)
        'head'
    """
    fp8 = k.dtype in FP8_DTYPES, v.dtype in FP8_DTYPES
    if fp8[0] != fp8[1] or (all(fp8) and k.dtype != v.dtype):
        raise _fail(who, f"k_cache is {k.dtype} but v_cache is {v.dtype}",
                    "store both caches in one FP8 dtype (quantize_kv returns both), or neither")
    given = k_scale is not None, v_scale is not None
    if not fp8[0]:
        if any(given):
            raise _fail(who, f"k_scale / v_scale were given with a {k.dtype} cache",
                        "drop them (scales dequantize an FP8 cache), or pass the cache as FP8")
        return "none"
    if not all(given):
        raise _fail(who, f"an {k.dtype} cache needs both k_scale and v_scale (got "
                    f"{'k_scale' if given[0] else 'no k_scale'}, {'v_scale' if given[1] else 'no v_scale'})",
                    "pass the float32 dequantization scales the cache was quantized with "
                    "(quantize_kv returns them)")
    hkv = k.shape[2] if paged else k.shape[1]
    rows = k.shape[0]   # pages, or sequences
    shapes = {(): "tensor", (1,): "tensor", (hkv,): "head",
              (rows, hkv): "page" if paged else "seq"}
    modes = []
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(s, Tensor):
            raise TypeError(f"{who}: {name} must be a float32 torch.Tensor on the cache's device, got "
                            f"{type(s).__name__}; for one number pass torch.tensor(x, device=...)")
        if s.dtype != torch.float32 or s.device != k.device:
            raise _fail(who, f"{name} is {s.dtype} on {s.device}",
                        f"pass {name}.to(device={str(k.device)!r}, dtype=torch.float32)")
        mode = shapes.get(tuple(s.shape))
        if mode is None:
            per = (f"[num_pages={rows}, HKV={hkv}] per page" if paged
                   else f"[B={rows}, HKV={hkv}] per sequence")
            raise _fail(who, f"{name} has shape {tuple(s.shape)}",
                        f"pass a 0-d tensor (per tensor), [HKV={hkv}] (per kv head) or {per} and head")
        if not s.is_contiguous():
            raise _fail(who, f"{name} is not contiguous (strides {s.stride()})",
                        f"pass {name}.contiguous()")
        modes.append(mode)
    if modes[0] != modes[1]:
        raise _fail(who, f"k_scale is per {modes[0]} but v_scale per {modes[1]}",
                    "pass both scales with one granularity (shape)")
    return modes[0]


def _scale_view(scale: Tensor, mode: str, paged: bool) -> Tensor:
    """``scale`` shaped to broadcast against its cache ([B, HKV, N, D] or pages [P, page, HKV, D])."""
    if mode == "tensor":
        return scale.reshape(())
    if mode == "head":
        return scale.view(1, 1, -1, 1) if paged else scale.view(1, -1, 1, 1)
    return scale.view(scale.shape[0], 1, -1, 1) if paged else scale.view(scale.shape[0], -1, 1, 1)


def dequantize(cache: Tensor, scale: Tensor, mode: str, paged: bool, dtype: torch.dtype) -> Tensor:
    """``cache`` x ``scale`` (computed in float32) as ``dtype``: an FP8 cache's real values, for the
    paths that read a cache in q's dtype (flex_decode's gather). ``mode`` from :func:`kv_scale_mode`.

    Example::

        >>> k8, _, ks, _ = quantize_kv(torch.randn(2, 4, 16, 64), torch.randn(2, 4, 16, 64))
        >>> dequantize(k8, ks, "head", False, torch.float32).shape
        torch.Size([2, 4, 16, 64])
    """
    return (cache.float() * _scale_view(scale, mode, paged)).to(dtype)


def quantize_kv(k: Tensor, v: Tensor, granularity: str = "head", *, paged: bool = False,
                fp8_dtype: torch.dtype = torch.float8_e4m3fn, k_scale: Optional[Tensor] = None,
                v_scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """An FP8 KV cache for :func:`fa3_inductor.flex_decode`: ``(k_fp8, v_fp8, k_scale, v_scale)``.

    ``k``, ``v``: the cache in any float dtype, [B, HKV, N, D] or, with ``paged``, pages [num_pages,
    page_size, HKV, D]. ``granularity``: "tensor" (0-d scales), "head" ([HKV]) or "page" ([num_pages,
    HKV] paged; [B, HKV], one per sequence, for a contiguous cache). Each scale is its slice's
    largest magnitude over the FP8 dtype's largest finite value (1 where the slice is all zero), so
    nothing saturates. Given ``k_scale`` / ``v_scale`` (float32, a shape above), those are used
    instead and values past the FP8 range saturate: how a serving loop quantizes the new tokens it
    appends to a cache whose scales are fixed.

    Example::

        >>> import torch
        >>> from fa3_inductor import flex_decode, quantize_kv
        >>> k, v = torch.randn(2, 2, 40, 64), torch.randn(2, 2, 40, 64)
        >>> k8, v8, ks, vs = quantize_kv(k, v, "head")
        >>> k8.dtype, tuple(ks.shape)
        (torch.float8_e4m3fn, (2,))
        >>> q = torch.randn(2, 8, 1, 64)
        >>> lens = torch.tensor([40, 17], dtype=torch.int32)
        >>> flex_decode(q, k8, v8, seq_lens=lens, k_scale=ks, v_scale=vs).shape
        torch.Size([2, 8, 1, 64])
    """
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"quantize_kv: fp8_dtype={fp8_dtype}; pass torch.float8_e4m3fn or torch.float8_e5m2")
    if granularity not in GRANULARITIES:
        raise ValueError(f"quantize_kv: granularity={granularity!r}; pass one of {', '.join(GRANULARITIES)}")
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4 or not t.is_floating_point():
            raise ValueError(f"quantize_kv: {name} must be a 4-D float tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}; "
                             "pass [B, HKV, N, D], or pages [num_pages, page_size, HKV, D] with paged=True")
    mode = "tensor" if granularity == "tensor" else "head" if granularity == "head" else (
        "page" if paged else "seq")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("quantize_kv: one of k_scale / v_scale was given; pass both, or neither "
                         "(then they are computed)")
    if k_scale is not None:   # the given scales must fit the cache (a stand-in FP8 view, no copy)
        stand_in = torch.empty((), dtype=fp8_dtype, device=k.device).expand(k.shape)
        mode = kv_scale_mode(stand_in, stand_in, k_scale, v_scale, paged, who="quantize_kv")
    fp8_max = torch.finfo(fp8_dtype).max
    # the dims a scale spans: all but its own ([pages|B], HKV) ones
    keep = {"tensor": (), "head": (2,) if paged else (1,), "seq": (0, 1), "page": (0, 2)}[mode]
    out = []
    for t, given in ((k.detach(), k_scale), (v.detach(), v_scale)):
        if given is None:
            amax = t.abs().float().amax(dim=tuple(d for d in range(4) if d not in keep))
            scale = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))
        else:
            scale = given
        q8 = (t.float() / _scale_view(scale, mode, paged)).clamp(-fp8_max, fp8_max).to(fp8_dtype)
        out.append((q8, scale))
    return out[0][0], out[1][0], out[0][1], out[1][1]
