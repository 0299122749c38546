"""Merging partial attention results through their log-sum-exp, and the gradients back.

Notation (per query row): shard j gives o_j = Σ_k∈j p_k v_k / Σ_k∈j p_k and l_j = log Σ_k∈j p_k
(p_k = exp(score_k)). The full row is

    L = log Σ_j exp(l_j),    w_j = exp(l_j - L),    O = Σ_j w_j o_j.

Backward, for incoming dO and dL:

    dO_j = w_j dO,    dl_j = w_j (dO·o_j - dO·O) + w_j dL

(∂w_k/∂l_j = w_k(δ_kj - w_j)), so each shard's gradients are its own attention's gradients for
the weighted dO_j and dl_j: any backward that differentiates (out, lse) serves a ring step.
A shard the mask hides (l_j = -inf) has w_j = 0; a row every shard hides has L = -inf, O = 0.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def weight(lse_part: Tensor, lse: Tensor) -> Tensor:
    """w = exp(l_j - L), 0 where both are -inf (a row nothing reaches).

    Example::

        >>> weight(torch.tensor([0.0, float("-inf")]), torch.tensor([0.0, float("-inf")])).tolist()
        [1.0, 0.0]
    """
    return torch.exp(lse_part - lse).nan_to_num_(0.0)


class Merger:
    """Running merge of (out, lse) pairs in float32 (float64 stays float64).

    Example::

        >>> m = Merger(); m.add(o1, l1); m.add(o2, l2); out, lse = m.result(torch.bfloat16)  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.out: Optional[Tensor] = None
        self.lse: Optional[Tensor] = None

    def add(self, out: Tensor, lse: Tensor) -> None:
        work = torch.float64 if out.dtype == torch.float64 else torch.float32
        out, lse = out.to(work), lse.to(work)
        if self.out is None:
            self.out, self.lse = out.clone(), lse.clone()
            return
        new = torch.logaddexp(self.lse, lse)
        self.out.mul_(weight(self.lse, new).unsqueeze(-1)).add_(out * weight(lse, new).unsqueeze(-1))
        self.lse = new

    def result(self, dtype: torch.dtype, like_out: Tensor, like_lse_shape: tuple
               ) -> tuple[Tensor, Tensor]:
        """(out in ``dtype``, lse float32); zeros / -inf when nothing was added (all hidden)."""
        if self.out is None:
            return (torch.zeros_like(like_out, dtype=dtype),
                    torch.full(like_lse_shape, float("-inf"), device=like_out.device))
        return self.out.to(dtype), self.lse.to(torch.float32 if self.lse.dtype != torch.float64
                                               else torch.float64)


def part_grads(dout: Tensor, dlse: Optional[Tensor], lse: Tensor, out_part: Tensor,
               lse_part: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
    """(dO_j, dl_j) of the module docstring for one shard; ``delta`` = dO·O per row (float32).

    Example::

        >>> d_out_j, d_lse_j = part_grads(dout, None, lse, o_j, l_j, delta)   # doctest: +SKIP
    """
    w = weight(lse_part.to(lse.dtype), lse)
    d_out = (dout.to(w.dtype) * w.unsqueeze(-1)).to(out_part.dtype)
    d_lse = w * ((dout.to(w.dtype) * out_part.to(w.dtype)).sum(-1) - delta)
    if dlse is not None:
        d_lse = d_lse + w * dlse.to(w.dtype)
    return d_out, d_lse.to(lse_part.dtype)
