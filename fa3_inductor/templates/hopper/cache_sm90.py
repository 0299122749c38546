"""Query chunks against a decode cache through the Hopper kernel: fwd_sm90.py's CACHE mode (its docstring, "Decode
caches"), with the tiles, pipeline and mods of a dense launch. The keys come from the cache in place, a contiguous
``[B, HKV, N, D]`` one or pages ``[P, PAGE, HKV, D]`` behind a block table, and each sequence's length and first
query position are read on the device: no gather, no block mask, nothing read on the host. ``flex_decode`` routes
its prefill chunks (more packed rows than the decode kernels take) here on sm90 GPUs.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ...runtime.fast_launch import aliasing, launch_cached, tensor_signature
from ..modgen import MAX_POSITION
from ..tma import tma_aligned
from .configs import SUPPORTED_DTYPES, served_head_dims_text, serves_head_dims
from .fwd_sm90 import CacheRows, rows_launch



def page_served(page: int) -> bool:
    """Whether pages of ``page`` keys tile every KV tile of the kernel's tables (64 or 128 keys) with TMA boxes.

    Example::

        >>> [p for p in (1, 8, 16, 48, 64, 128, 192, 256) if page_served(p)]
        [16, 64, 128, 256]
    """
    # pages of 8 read in place ran 1.41-1.51x the contiguous cache and slower than gathering on long chunks: 16
    # boxes of 2 KB a K or V tile, at the TMA unit's rate (H200, serving-nvidia-h200-2026-11-30-1930-prefill-pages8)
    return page in (16, 32, 64) or (page > 0 and page % 128 == 0)


def cache_view(cache: torch.Tensor, paged: bool) -> torch.Tensor:
    """The cache as the kernel's descriptors read it: pages ``[P, PAGE, HKV, D]`` as ``[P, HKV, PAGE, D]`` (a view,
    no copy), a contiguous ``[B, HKV, N, D]`` cache as it is.

    Example::

        >>> cache_view(torch.empty(10, 16, 2, 64), paged=True).shape
        torch.Size([10, 2, 16, 64])
    """
    return cache.transpose(1, 2) if paged else cache


def cache_sm90_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: Optional[torch.Tensor],
                       capability: Optional[tuple[int, int]]) -> Optional[str]:
    """None when the Hopper kernel serves query chunk ``q`` [B, HQ, M, D] against this cache on a GPU of
    ``capability`` (None: not a GPU), else why not, in words. flex_decode has checked shapes and dtypes.

    Example::

        >>> q = torch.empty(1, 8, 256, 128, dtype=torch.bfloat16)
        >>> pages = torch.empty(4, 64, 2, 128, dtype=torch.bfloat16)
        >>> table = torch.zeros(1, 4, dtype=torch.int32)
        >>> cache_sm90_refusal(q, pages, pages, table, (9, 0)) is None
        True
        >>> cache_sm90_refusal(q, pages[:, :48], pages[:, :48], table, (9, 0))[:39]
        'pages of 48 keys do not tile the kernel'
    """
    if capability != (9, 0):
        where = "not a GPU" if capability is None else f"sm{capability[0]}{capability[1]}"
        return f"the Hopper kernel needs an sm90 GPU, this is {where}"
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"the Hopper kernel takes float16 or bfloat16 for q and the cache, got {q.dtype}, {k.dtype}, {v.dtype}"
    if not serves_head_dims(q.shape[3], v.shape[3]):
        return (f"the Hopper kernel has no tiles for head dims {q.shape[3]} (q, k) / {v.shape[3]} (v); it serves "
                f"{served_head_dims_text()}")
    paged = block_table is not None
    if paged and not page_served(k.shape[1]):
        return (f"pages of {k.shape[1]} keys do not tile the kernel's 64- or 128-key tiles; pages of 16, 32, 64 "
                f"or a multiple of 128 keys do")
    capacity = block_table.shape[1] * k.shape[1] if paged else k.shape[2]
    if q.shape[2] >= MAX_POSITION or capacity >= MAX_POSITION:
        return f"positions reach 2**23 (query rows {q.shape[2]}, cache capacity {capacity}): the mods' float range"
    for name, t in (("q", q), ("k_cache", cache_view(k, paged)), ("v_cache", cache_view(v, paged))):
        if t.numel() and not tma_aligned(t):
            return (f"{name} strides {t.stride()} or its address are not 16-byte aligned (TMA); pass "
                    f"{name}.contiguous()")
    return None


def prepare_cache_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       seq_lens: torch.Tensor, *, block_table: Optional[torch.Tensor] = None,
                       q_offset: Optional[torch.Tensor] = None, sm_scale: float, score_mod: Any = None,
                       mask_mod: Any = None, causal: bool = False, window: int = 0,
                       score_bufs: Sequence[torch.Tensor] = (),
                       mask_bufs: Sequence[torch.Tensor] = (), config: Any = None,
                       tensors: Optional[list] = None) -> tuple[Any, tuple, dict, tuple]:
    """``(kernel, args, kwargs, grid)`` of one launch of query chunk ``q`` [B, HQ, M, D] against the cache ``k``,
    ``v`` (pages [P, PAGE, HKV, D] with ``block_table`` [B, max_pages] int32, or [B, HKV, N, D] without), writing
    ``out`` [B, HQ, M, Dv] and ``lse`` [B, HQ, M] (float32, log2 units) in place. Sequence b has ``seq_lens[b]``
    keys and its row m sits at position ``q_offset[b] + m`` (default ``seq_lens[b] - M + m``), which the mods see.
    ``score_mod`` / ``mask_mod`` are generated ``gl`` mods; ``causal`` says the mask_mod is ``q_idx >= kv_idx``
    (each tile's walk then ends at its diagonal), ``window`` > 0 that it is a causal window of that many keys
    (modgen.causal_window_of_source: the walk also starts at the window's far edge). ``tensors``: this call's
    :func:`launch_tensors`.

    Example::

        >>> kernel, args, kwargs, grid = prepare_cache_sm90(q, pages, pages, out, lse, lens, block_table=table,
        ...                                                 sm_scale=0.088)   # doctest: +SKIP
        >>> kernel[grid](*args, **kwargs)                                      # doctest: +SKIP
    """
    if (causal or window) and mask_mod is None:
        raise ValueError("prepare_cache_sm90: causal=True or a window needs the mask_mod itself (the partial tiles "
                         "apply it); pass mask_mod")
    q_, k_, v_, out_, lse_, max_, lens, first, table = (tensors or launch_tensors(
        q, k, v, out, lse, seq_lens, block_table, q_offset))[:9]
    rows = CacheRows(lens, first, q_offset is None, table, k.shape[1] if table is not None else 0, bool(causal),
                     int(window))
    return rows_launch(q_, k_, v_, out_, lse_, max_, sm_scale=sm_scale, score_mod=score_mod, mask_mod=mask_mod,
                       score_bufs=score_bufs, mask_bufs=mask_bufs, config=config, cache=rows)


def launch_cache_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      seq_lens: torch.Tensor, **options: Any) -> None:
    """Run the Hopper kernel on a query chunk against a decode cache (``options``: :func:`prepare_cache_sm90`'s
    keywords, ``sm_scale`` required); ``out`` and ``lse`` are written in place. The first launch of a kind (shapes,
    strides, the options) is recorded (runtime/fast_launch.py) and later ones re-launched without planning.

    Example::

        >>> launch_cache_sm90(q, pages, pages, out, lse, lens, block_table=table, sm_scale=0.088)   # doctest: +SKIP
    """
    if q.shape[0] == 0 or q.shape[2] == 0:
        return
    if q.shape[1] == 0 or k.numel() == 0:   # no key anywhere (a TMA descriptor needs rows)
        out.zero_()
        lse.fill_(float("-inf"))
        return
    tensors = launch_tensors(q, k, v, out, lse, seq_lens, options.get("block_table"), options.get("q_offset"),
                             options.get("score_bufs", ()), options.get("mask_bufs", ()))
    # what the launch depends on besides the tensors: whether positions come from q_offset, the scale, the mods
    key = ("cache_fwd", tensor_signature(tensors), aliasing(tensors), options.get("q_offset") is None,
           *((name, value) for name, value in sorted(options.items())
             if name not in ("score_bufs", "mask_bufs", "block_table", "q_offset")))
    launch_cached(key, tensors, lambda: (*prepare_cache_sm90(q, k, v, out, lse, seq_lens, tensors=tensors,
                                                             **options), "cache"))


def launch_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   seq_lens: torch.Tensor, block_table: Optional[torch.Tensor], q_offset: Optional[torch.Tensor],
                   score_bufs: Sequence[torch.Tensor] = (), mask_bufs: Sequence[torch.Tensor] = ()) -> list:
    """Every tensor a cache launch takes, in a fixed order: q, the cache's views (:func:`cache_view`), out, LSE and
    the (unread) row-max buffer beside it, the lengths, the first positions (q_offset, or the lengths), the table
    (or None), the mods' buffers.

    Example::

        >>> t = torch.empty(1, 2, 8, 64); pages = torch.empty(3, 16, 2, 64); lens = torch.ones(1, dtype=torch.int32)
        >>> [tuple(x.shape) for x in launch_tensors(t, pages, pages, t, torch.empty(1, 2, 8), lens,
        ...                                         torch.zeros(1, 3, dtype=torch.int32), None)[1:3]]
        [(3, 2, 16, 64), (3, 2, 16, 64)]
    """
    paged = block_table is not None
    return [q, cache_view(k, paged), cache_view(v, paged), out, lse, torch.empty_like(lse), seq_lens,
            q_offset if q_offset is not None else seq_lens, block_table, *score_bufs, *mask_bufs]


def compile_cache_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       seq_lens: torch.Tensor, target: Any = None, **options: Any) -> Any:
    """Compile (not run) what :func:`launch_cache_sm90` launches, for ``target`` (default sm90); tensors may be on
    the CPU. Returns the CompiledKernel (templates/aot.py's sass_report reads it).

    Example::

        >>> ck = compile_cache_sm90(q, pages, pages, out, lse, lens, block_table=table,
        ...                         sm_scale=0.088)   # doctest: +SKIP
    """
    from ..aot import compile_launch

    kernel, args, kwargs, _ = prepare_cache_sm90(q, k, v, out, lse, seq_lens, **options)
    return compile_launch(kernel, args, kwargs, target)
