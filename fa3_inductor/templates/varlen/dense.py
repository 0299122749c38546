"""Packed attention in plain torch: one dense per-sequence computation with the mods.

What ``flex_varlen`` runs on CPU tensors without Triton's interpreter, and on CPU tensors that need
gradients (autograd differentiates it). Scores are computed in float32 (float64 inputs stay
float64), the mods called on broadcast index tensors, as the float64 reference does.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor


def dense_varlen(q: Tensor, k: Tensor, v: Tensor, cu_q: list[int], cu_k: list[int],
                 score_mod: Optional[Callable], mask_mod: Optional[Callable],
                 scale: float) -> tuple[Tensor, Tensor]:
    """(out [TQ, HQ, DV] in q's dtype, natural-log lse [HQ, TQ] float32) for packed q, k, v whose
    sequence s holds rows [cu_q[s], cu_q[s + 1]) of q and [cu_k[s], cu_k[s + 1]) of k and v.

    Example::

        >>> q = k = v = torch.randn(5, 2, 16)
        >>> out, lse = dense_varlen(q, k, v, [0, 2, 5], [0, 2, 5], None, None, 0.25)
        >>> out.shape, lse.shape
        (torch.Size([5, 2, 16]), torch.Size([2, 5]))
    """
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    HQ, HKV = q.shape[1], k.shape[1]
    heads = torch.arange(HQ, device=q.device).view(HQ, 1, 1)
    outs, lses = [], []
    for s in range(len(cu_q) - 1):
        qs = q[cu_q[s]:cu_q[s + 1]].to(work).transpose(0, 1)          # [HQ, M, D]
        ks = k[cu_k[s]:cu_k[s + 1]].to(work).transpose(0, 1)          # [HKV, N, D]
        vs = v[cu_k[s]:cu_k[s + 1]].to(work).transpose(0, 1)
        if HKV != HQ:
            ks = ks.repeat_interleave(HQ // HKV, dim=0)
            vs = vs.repeat_interleave(HQ // HKV, dim=0)
        M, N = qs.shape[1], ks.shape[1]
        b = torch.full((1, 1, 1), s, device=q.device)
        q_idx = torch.arange(M, device=q.device).view(1, M, 1)
        kv_idx = torch.arange(N, device=q.device).view(1, 1, N)
        scores = qs @ ks.transpose(-2, -1) * scale
        if score_mod is not None:
            scores = score_mod(scores, b, heads, q_idx, kv_idx).to(work)
        if mask_mod is not None:
            keep = mask_mod(b, heads, q_idx, kv_idx).expand(HQ, M, N)
            scores = scores.masked_fill(~keep, float("-inf"))
        # A row that sees no key: lse -inf, p 0, out 0 (FlexAttention's convention); its
        # logsumexp is taken over zeros instead, so that its gradient stays finite.
        empty = torch.isneginf(scores).all(-1)                           # [HQ, M]
        lse = torch.logsumexp(scores.masked_fill(empty.unsqueeze(-1), 0.0), dim=-1)
        p = torch.exp(scores - lse.unsqueeze(-1))
        outs.append((p @ vs).transpose(0, 1))
        lses.append(lse.masked_fill(empty, float("-inf")))
    out = torch.cat(outs, 0) if outs else q.new_empty(0, HQ, v.shape[2], dtype=work)
    lse = torch.cat(lses, 1) if lses else q.new_empty(HQ, 0, dtype=work)
    return out.to(q.dtype), lse.float()
