"""Which global sequence positions each rank of a context-parallel group holds.

Notation: ``T`` global length, ``n`` ranks, ``S = T / n`` tokens per rank. A rank's shard is two
equal pieces of ``c = S / 2`` tokens; local index ``i`` sits at global position

    pos(i) = i + a          if i < c
           = i + b          otherwise       (b = start of the second piece - c)

- ``head_tail`` (torch's ``_HeadTailLoadBalancer``, the default for causal masks): the sequence is
  cut in ``2n`` chunks and rank ``r`` holds chunks ``r`` and ``2n - 1 - r``, so every rank gets one
  cheap and one expensive chunk of a causal mask;
- contiguous: rank ``r`` holds ``[r S, (r + 1) S)`` (a = b = r S).

Two pieces written as ``(a, b, c)`` keep the position map arithmetic (no gather in the kernel's
mods) and identical in form for both layouts, so one generated mod serves every rank and step.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class SeqLayout:
    """How a sequence of any even-per-rank length is spread over ``world`` ranks.

    Example::

        >>> SeqLayout(2).pieces(0, 8)          # head-tail: chunks 0 and 3 of 4
        ((0, 2), (6, 2))
        >>> SeqLayout(2, head_tail=False).pieces(1, 8)
        ((4, 2), (6, 2))
    """

    world: int
    head_tail: bool = True

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"SeqLayout: world must be >= 1, got {self.world}")

    def check_length(self, total: int) -> None:
        """Raise unless ``total`` splits into ``2 * world`` equal chunks."""
        if total % (2 * self.world) != 0:
            raise ValueError(
                f"context parallel: sequence length {total} must be a multiple of 2 x world size "
                f"({2 * self.world}) so every rank holds two equal pieces; pad the sequence "
                "(and mask the padding) to the next multiple")

    def pieces(self, rank: int, total: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """((start, length), (start, length)) of ``rank``'s two pieces in global positions."""
        self.check_length(total)
        c = total // (2 * self.world)
        if self.head_tail:
            return (rank * c, c), ((2 * self.world - 1 - rank) * c, c)
        return (2 * rank * c, c), ((2 * rank + 1) * c, c)

    def affine(self, rank: int, total: int) -> tuple[int, int, int]:
        """(a, b, c) of the module docstring's position map for ``rank``.

        Example::

            >>> SeqLayout(2).affine(0, 8)      # pos(i) = i for i < 2, i + 4 after
            (0, 4, 2)
        """
        (s0, c), (s1, _) = self.pieces(rank, total)
        return s0, s1 - c, c

    def positions(self, rank: int, total: int, device=None) -> Tensor:
        """The global positions of ``rank``'s tokens, in local order (int64)."""
        (s0, c), (s1, _) = self.pieces(rank, total)
        return torch.cat([torch.arange(s0, s0 + c, device=device),
                          torch.arange(s1, s1 + c, device=device)])

    def order(self, total: int, device=None) -> Tensor:
        """Global positions in rank-major order: ``x.index_select(dim, order)`` lays a full
        sequence out as the ranks hold it (torch's load balancer's rearrange indices).

        Example::

            >>> SeqLayout(2).order(8).tolist()
            [0, 1, 6, 7, 2, 3, 4, 5]
        """
        return torch.cat([self.positions(r, total, device) for r in range(self.world)])

    def shard(self, x: Tensor, dim: int, rank: int) -> Tensor:
        """``rank``'s shard of a full-length ``x`` along ``dim`` (a copy).

        Example::

            >>> SeqLayout(2).shard(torch.arange(8), 0, 1).tolist()
            [2, 3, 4, 5]
        """
        return x.index_select(dim, self.positions(rank, x.shape[dim], x.device))

    def unshard(self, shards: list[Tensor], dim: int) -> Tensor:
        """The full sequence back from every rank's shard (in rank order) along ``dim``.

        Example::

            >>> lay = SeqLayout(2); x = torch.arange(8)
            >>> torch.equal(lay.unshard([lay.shard(x, 0, r) for r in range(2)], 0), x)
            True
        """
        stacked = torch.cat(shards, dim)
        restore = torch.argsort(self.order(stacked.shape[dim], stacked.device))
        return stacked.index_select(dim, restore)
