"""Merging partial attention results through their log-sum-exp, and the gradients back.

Notation (per query row): shard j gives o_j = Σ_k∈j p_k v_k / Σ_k∈j p_k and l_j = log Σ_k∈j p_k
(p_k = exp(score_k)). The full row is

    L = log Σ_j exp(l_j),    w_j = exp(l_j - L),    O = Σ_j w_j o_j.

Backward, for incoming dO and dL: with ∂w_k/∂l_j = w_k(δ_kj - w_j),

    dO_j = w_j dO,    dl_j = w_j (dO·o_j - dO·O) + w_j dL.

Shard j's own backward for (dO_j, dl_j) has dS = p_j (dO_j·v - dO_j·o_j + dl_j) with its local
probabilities p_j = exp(s - l_j); since w_j p_j = exp(s - L) = P (the global probability), this is
dS = P (dO·v - dO·O + dL): the ordinary attention backward with the GLOBAL O and L, restricted to
shard j's keys. So a ring step needs no forward and no per-shard (o_j, l_j): our backward kernels
take O, L, dO, dL as given (shard_attention.shard_attention_backward).
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
