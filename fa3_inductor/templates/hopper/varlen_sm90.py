"""Packed variable-length sequences through the Hopper kernel: fwd_sm90.py's VARLEN mode (its docstring, "Packed
sequences"), with the same tiles, pipeline and mods as a dense launch. Checks what it serves, prepares, launches and
compiles (compile-only) one launch. ``fa3_inductor.flex_varlen`` routes here on sm90 GPUs (templates/varlen/host.py,
``pick_varlen_kernel``); the Triton varlen kernel serves every other GPU and the CPU interpreter.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ...runtime.fast_launch import aliasing, launch_cached, tensor_signature
from ..tma import tma_aligned
from .configs import SUPPORTED_DTYPES, served_head_dims_text, serves_head_dims
from .fwd_sm90 import PACKED_BLOCK_M, PackedRows, rows_launch
from .tile_table import tile_table_launch, tile_table_size


def packed_view(t: torch.Tensor) -> torch.Tensor:
    """A packed ``(total, heads, dim)`` tensor as the kernel's ``[1, heads, total, dim]`` (a view, no copy).

    Example::

        >>> packed_view(torch.empty(10, 4, 64)).shape
        torch.Size([1, 4, 10, 64])
    """
    return t.transpose(0, 1).unsqueeze(0)


def packed_tma_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """None when the packed q, k, v (non-empty ones) have TMA's 16-byte aligned strides and addresses as
    :func:`packed_view`s, else what to pass instead (the forward's and the packed backward's refusals).

    Example::

        >>> packed_tma_refusal(*(torch.empty(10, 4, 64) for _ in range(3))) is None
        True
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[0] and not tma_aligned(packed_view(t)):
            return (f"{name} strides {t.stride()} or its address are not 16-byte aligned (TMA); pass "
                    f"{name}.contiguous()")
    return None


def varlen_sm90_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        capability: Optional[tuple[int, int]]) -> Optional[str]:
    """None when the Hopper varlen kernel serves these packed tensors on a GPU of ``capability`` (None: not a
    GPU), else why not, in words. Shapes and dtypes are flex_varlen's, already checked.

    Example::

        >>> q = torch.empty(10, 4, 128, dtype=torch.bfloat16)
        >>> varlen_sm90_refusal(q, q, q, (9, 0)) is None, varlen_sm90_refusal(q, q, q, (8, 0))
        (True, 'the Hopper varlen kernel needs an sm90 GPU, this is sm80')
    """
    if capability != (9, 0):
        where = "not a GPU" if capability is None else f"sm{capability[0]}{capability[1]}"
        return f"the Hopper varlen kernel needs an sm90 GPU, this is {where}"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"the Hopper varlen kernel takes float16 or bfloat16, got {q.dtype}"
    if not serves_head_dims(q.shape[2], v.shape[2]):
        return (f"the Hopper varlen kernel has no tiles for head dims {q.shape[2]} (q, k) / {v.shape[2]} (v); it "
                f"serves {served_head_dims_text()}")
    return packed_tma_refusal(q, k, v)


def prepare_varlen_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, *,
                        sm_scale: float, score_mod: Any = None, mask_mod: Any = None, causal: bool = False,
                        window: int = 0, score_bufs: Sequence[torch.Tensor] = (),
                        mask_bufs: Sequence[torch.Tensor] = (), config: Any = None,
                        tensors: Optional[list] = None) -> tuple[Any, tuple, dict, tuple]:
    """``(kernel, args, kwargs, grid)`` of one launch over packed ``q [TQ, HQ, D]``, ``k [TK, HKV, D]``,
    ``v [TK, HKV, DV]`` writing ``out [TQ, HQ, DV]`` and ``lse [HQ, TQ]`` (float32, log2 units) in place, as
    templates/varlen/host.py's prepare_varlen does for the Triton kernel. ``score_mod`` / ``mask_mod`` are
    generated ``gl`` mods; ``causal`` says the mask_mod is ``q_idx >= kv_idx`` (the KV walk then ends at each
    tile's diagonal), ``window`` > 0 that it is a causal window of that many keys (the walk also starts at the
    window's far edge: modgen.causal_window_of_source); ``config`` overrides the Hopper tile table (configs.py).
    ``max_seqlen_q`` is taken as prepare_varlen takes it; the grid comes from the virtual tiles' table instead.
    Needs TQ, TK > 0. ``tensors``: this call's :func:`launch_tensors` (made here when None): every tensor the
    launch takes is one of them. The launch reads the virtual query tiles' table (``tensors[8]``) that
    tile_table.tile_table_launch writes: run that first (:func:`launch_varlen_sm90` does).

    Example::

        >>> kernel, args, kwargs, grid = prepare_varlen_sm90(q, k, v, out, lse, cu_q, cu_k, 700,
        ...                                                  sm_scale=0.088)   # doctest: +SKIP
        >>> kernel[grid](*args, **kwargs)                                     # doctest: +SKIP
    """
    if (causal or window) and mask_mod is None:
        raise ValueError("prepare_varlen_sm90: causal=True or a window needs the mask_mod itself (the partial tiles "
                         "apply it); pass mask_mod")
    q4, k4, v4, out4, lse4, max4, cu_q, cu_k, table = (tensors or launch_tensors(q, k, v, out, lse, cu_seqlens_q,
                                                                                 cu_seqlens_k))[:9]
    packed = PackedRows(cu_q, cu_k, bool(causal), table, int(window))
    return rows_launch(q4, k4, v4, out4, lse4, max4, sm_scale=sm_scale, score_mod=score_mod, mask_mod=mask_mod,
                       score_bufs=score_bufs, mask_bufs=mask_bufs, config=config, packed=packed)


def launch_varlen_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                       **options: Any) -> None:
    """Run the Hopper varlen kernel (``options``: :func:`prepare_varlen_sm90`'s keywords, ``sm_scale`` required);
    ``out`` and ``lse`` are written in place. No keys at all: every row sees none (out 0, lse -inf). The first launch
    of a kind (tensor shapes and strides, the options) is recorded (runtime/fast_launch.py) and later ones
    re-launched without planning: the grid follows the pack's totals (the tile table), not ``max_seqlen_q``, which
    only lets a pack of empty sequences return at once.

    Example::

        >>> launch_varlen_sm90(q, k, v, out, lse, cu_q, cu_k, 700, sm_scale=0.088)   # doctest: +SKIP
    """
    if q.shape[0] == 0 or max_seqlen_q == 0:
        return
    if k.shape[0] == 0:   # a TMA descriptor needs rows
        out.zero_()
        lse.fill_(float("-inf"))
        return
    tensors = launch_tensors(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, options.get("score_bufs", ()),
                             options.get("mask_bufs", ()))
    # what the launch depends on besides the tensors (whose shapes give the grid): the scale, the mods, the config
    key = ("varlen_fwd", tensor_signature(tensors), aliasing(tensors),
           *((name, value) for name, value in sorted(options.items()) if name not in ("score_bufs", "mask_bufs")))
    # each virtual query tile's sequence (tile_table.py), then the kernel: a CTA per real tile (and at most one empty a
    # sequence), not the longest sequence's count of tiles for every sequence (1.02-1.10x, H200 serving-…-1909)
    launch_cached((key, "tiles"), tensors, lambda: (*tile_table_launch(tensors[6], tensors[8], PACKED_BLOCK_M),
                                                    "varlen_tiles"))
    launch_cached(key, tensors, lambda: (*prepare_varlen_sm90(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                              max_seqlen_q, tensors=tensors, **options), "varlen"))


def launch_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   cu_q: torch.Tensor, cu_k: torch.Tensor, score_bufs: Sequence[torch.Tensor] = (),
                   mask_bufs: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
    """Every tensor a packed launch takes, in a fixed order: the [1, H, T, D] views of q, k, v and out, LSE as
    [1, HQ, TQ] and the (unread) row-max buffer beside it, the offsets, the virtual query tiles' table (int32, written
    by :func:`tile_table_launch`), the mods' buffers.

    Example::

        >>> t, cu = torch.empty(10, 4, 64), torch.tensor([0, 3, 10], dtype=torch.int32)
        >>> [tuple(x.shape) for x in launch_tensors(t, t, t, t, torch.empty(4, 10), cu, cu)[4:9]]
        [(1, 4, 10), (1, 4, 10), (3,), (3,), (3,)]
    """
    lse4 = lse.unsqueeze(0)
    table = torch.empty(tile_table_size(q.shape[0], cu_q.shape[0] - 1, PACKED_BLOCK_M), dtype=torch.int32,
                        device=q.device)
    return [packed_view(q), packed_view(k), packed_view(v), packed_view(out), lse4, torch.empty_like(lse4), cu_q, cu_k,
            table, *score_bufs, *mask_bufs]


def compile_varlen_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                        target: Any = None, **options: Any) -> Any:
    """Compile (not run) what :func:`launch_varlen_sm90` launches, for ``target`` (default sm90); tensors may be
    on the CPU. Returns the CompiledKernel (templates/aot.py's sass_report reads it).

    Example::

        >>> ck = compile_varlen_sm90(q, k, v, out, lse, cu_q, cu_k, 700, sm_scale=0.088)   # doctest: +SKIP
    """
    from ..aot import compile_launch

    kernel, args, kwargs, _ = prepare_varlen_sm90(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                  **options)
    return compile_launch(kernel, args, kwargs, target)
