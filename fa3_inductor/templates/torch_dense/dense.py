"""Attention computed densely with torch ops: the torch family's forward, and the block-mask
semantics the CPU backward (runtime/backward_cpu.py) shares with it."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import Tensor

from ..modgen_torch import load_torch_mod


def _listed(num_blocks: Optional[Tensor], indices: Optional[Tensor], rows: Tensor,
            cols: Tensor) -> Optional[Tensor]:
    """Whether each (q, kv) position lies in a block the tables list: bool [Bm, Hm, M, N]."""
    if num_blocks is None or indices is None:
        return None
    n_cols = max(int(cols.max().item()) + 1 if cols.numel() else 1, indices.shape[-1])
    slot = torch.arange(indices.shape[-1], device=indices.device)
    real = slot < num_blocks.unsqueeze(-1)
    target = torch.where(real, indices.long(), n_cols)  # unused slots go to a spill column
    blocks = torch.zeros((*indices.shape[:-1], n_cols + 1), dtype=torch.bool,
                         device=indices.device)
    blocks.scatter_(-1, target, True)
    rows = rows.clamp(max=blocks.shape[-2] - 1)
    return blocks[..., :n_cols][:, :, rows][..., cols]


def keep_scores(mask_fn: Optional[Callable], mask_bufs: list[Tensor], tables: tuple,
          b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor,
          sparse_q_block: int, sparse_kv_block: int) -> Tensor:
    """Which scores survive the mask, broadcastable to [B, H, M, N] (B, H of the indices)."""
    kv_num_blocks, kv_indices, full_num_blocks, full_indices = tables
    rows = q_idx.view(-1).long() // sparse_q_block
    cols = kv_idx.view(-1).long() // sparse_kv_block
    partial = _listed(kv_num_blocks, kv_indices, rows, cols)
    full = _listed(full_num_blocks, full_indices, rows, cols)
    keep = torch.ones((), dtype=torch.bool, device=q_idx.device)
    if mask_fn is not None:
        keep = torch.as_tensor(mask_fn(b, h, q_idx, kv_idx, mask_bufs), device=q_idx.device)
    if partial is not None:
        keep = keep & _batch_rows(partial, b)
    if full is not None:
        keep = keep | _batch_rows(full, b)
    return keep


def _batch_rows(table: Tensor, b: Tensor) -> Tensor:
    """The rows of a block-mask table for batch entries ``b`` (a table of batch 1 broadcasts)."""
    return table if table.shape[0] == 1 else table[b.view(-1).long()]


def index_tensors(b0: int, H: int, M: int, N: int, device: torch.device
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """b [1,1,1,1], h [1,H,1,1], q_idx [1,1,M,1], kv_idx [1,1,1,N] as int32 (flex's dtype)."""
    def ar(n: int, dim: int, start: int = 0) -> Tensor:
        shape = [1, 1, 1, 1]
        shape[dim] = n
        return torch.arange(start, start + n, dtype=torch.int32, device=device).view(shape)

    return ar(1, 0, b0), ar(H, 1), ar(M, 2), ar(N, 3)


def dense_forward(q: Tensor, k: Tensor, v: Tensor, tables: tuple, score_bufs: list, mask_bufs: list,
                  scale: float, sparse_q_block: int, sparse_kv_block: int, score_source: Optional[str],
                  mask_source: Optional[str], sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(out, lse_log2, max_log2) of one site computed densely with torch ops and the site's
    torch-dialect mods, a batch entry and a slice of heads at a time (scores in float32).
    ``sinks``: [H] per-head logits that join each row's denominator (out and lse include them).

    A correctness path for sites our kernels failed to build, not a fast one: torch's own
    FlexAttention cannot be called from inside the op (it re-enters Dynamo / vmap under the
    compiled graph's dispatch), and the block tables' semantics are ours (runtime/backward_cpu.py).

    Example::

        >>> out, lse, mx = dense_forward(q, k, v, (None,) * 4, [], [], 0.125, 128, 128, None, None)  # doctest: +SKIP
    """
    score_fn = score_source and load_torch_mod(score_source)
    mask_fn = mask_source and load_torch_mod(mask_source)
    B, H, M, _ = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    out = q.new_empty((B, H, M, v.shape[-1]))
    lse = q.new_empty((B, H, M), dtype=torch.float32)
    row_max = torch.empty_like(lse)
    heads = max(1, min(H, _SCORES_PER_CHUNK // max(1, M * N)))
    with torch.no_grad():
        for b0 in range(B):
            kb, vb = (t[0 if t.shape[0] == 1 else b0] for t in (k, v))
            b, h_all, q_idx, kv_idx = index_tensors(b0, H, M, N, q.device)
            for h0 in range(0, H, heads):
                hs = slice(h0, min(H, h0 + heads))
                kv_heads = torch.arange(hs.start, hs.stop, device=q.device) // (H // Hkv)
                h = h_all[:, hs]
                s = (q[b0, hs].float() @ kb[kv_heads].float().transpose(-2, -1) * scale).unsqueeze(0)
                if score_fn:
                    s = torch.broadcast_to(score_fn(s, b, h, q_idx, kv_idx, score_bufs).float(), s.shape)
                keep = keep_scores(mask_fn or None, mask_bufs, tables, b, h, q_idx, kv_idx, sparse_q_block,
                             sparse_kv_block)
                s = s.masked_fill(~keep.expand_as(s), float("-inf"))
                m = s.amax(-1, keepdim=True)
                live = m > float("-inf")
                p = torch.exp(s - torch.where(live, m, 0.0))
                total = p.sum(-1, keepdim=True)
                o = (p / torch.where(live, total, 1.0))[0] @ vb[kv_heads].float()
                row_lse = torch.where(live, m + total.log(), float("-inf"))[0, ..., 0]
                if sinks is not None:
                    with_sink = torch.logaddexp(row_lse, sinks[hs].float().view(-1, 1))
                    o = o * torch.exp(row_lse - with_sink).nan_to_num(0.0).unsqueeze(-1)
                    row_lse = with_sink
                out[b0, hs] = o.to(out.dtype)
                lse[b0, hs] = row_lse / math.log(2.0)
                row_max[b0, hs] = m[0, ..., 0] / math.log(2.0)
    return out, lse, row_max


_SCORES_PER_CHUNK = 1 << 26   # 256 MB of float32 scores per step
