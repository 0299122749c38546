"""Launch the generic (plain Triton) forward kernel."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import triton

from ..templates.generic_fwd import attention_fwd_kernel
from .configs import generic_config

_allocator_set = False


def _ensure_allocator() -> None:
    """Device-side tensor descriptors need a scratch allocator (128 bytes per descriptor)."""
    global _allocator_set
    if not _allocator_set:
        def alloc(size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
            device = "cuda" if stream is not None and torch.cuda.is_available() else "cpu"
            return torch.empty(size, dtype=torch.int8, device=device)

        triton.set_allocator(alloc)
        _allocator_set = True


def _capability(t: torch.Tensor) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(t.device) if t.is_cuda else None


def launch_generic(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, max_scores: torch.Tensor, *,
    sm_scale: float, score_mod: Any = None, mask_mod: Any = None,
    score_bufs: Sequence[torch.Tensor] = (), mask_bufs: Sequence[torch.Tensor] = (),
    kv_num_blocks: Optional[torch.Tensor] = None, kv_indices: Optional[torch.Tensor] = None,
    full_kv_num_blocks: Optional[torch.Tensor] = None,
    full_kv_indices: Optional[torch.Tensor] = None,
    sparse_q_block: int = 128, sparse_kv_block: int = 128,
) -> None:
    """Run the generic kernel; ``out``/``lse``/``max_scores`` are written in place.

    Shapes and conventions are those of ``templates/generic_fwd.py``. With
    ``kv_num_blocks=None`` every KV tile is visited and ``mask_mod`` must be None.

    Example::

        >>> launch_generic(q, k, v, out, lse, mx, sm_scale=q.shape[-1] ** -0.5)  # doctest: +SKIP
    """
    _ensure_allocator()
    Z, HQ, M, D = q.shape
    HKV, N = k.shape[1], k.shape[2]
    cfg = generic_config(D, _capability(q))
    block_m = min(cfg.block_m, sparse_q_block)
    block_n = min(cfg.block_n, sparse_kv_block)
    block_d = max(16, triton.next_power_of_2(D))
    has_mask = kv_num_blocks is not None
    if not has_mask and mask_mod is not None:
        raise ValueError("launch_generic: a mask_mod needs block-mask tensors (kv_num_blocks)")
    has_full = has_mask and full_kv_num_blocks is not None
    dummy = q.new_empty(1, dtype=torch.int32)
    kvn = kv_num_blocks if has_mask else dummy
    kvi = kv_indices if has_mask else dummy
    fkvn = full_kv_num_blocks if has_full else dummy
    fkvi = full_kv_indices if has_full else dummy
    if has_mask:
        SZ, SH, num_q_blks = kv_num_blocks.shape
        num_kv_blks = kv_indices.shape[-1]
        # The kernel indexes the tables as dense row-major: make them so (they are small).
        kvn, kvi = kvn.contiguous(), kvi.contiguous()
        if has_full:
            fkvn, fkvi = fkvn.contiguous(), fkvi.contiguous()
    else:
        SZ = SH = num_q_blks = num_kv_blks = 1
    grid = (triton.cdiv(M, block_m), Z * HQ)
    attention_fwd_kernel[grid](
        q, k, v, out, lse, max_scores,
        kvn, kvi, fkvn, fkvi,
        tuple(score_bufs), tuple(mask_bufs),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        HQ, M, N, D,
        SZ, SH, num_q_blks, num_kv_blks,
        sm_scale,
        SCORE_MOD=score_mod, MASK_MOD=mask_mod,
        GQA_GROUP=HQ // HKV,
        HAS_BLOCK_MASK=has_mask, HAS_FULL_BLOCKS=has_full,
        SPARSE_Q=sparse_q_block if has_mask else block_m,
        SPARSE_KV=sparse_kv_block if has_mask else block_n,
        EVEN_N=N % block_n == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        WARP_SPECIALIZE=cfg.warp_specialize,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
