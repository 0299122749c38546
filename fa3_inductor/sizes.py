"""Sizes of example tensors and IR nodes as Python ints, where they are static: read by recognition and
by the lowering alike (neither imports the other)."""

from __future__ import annotations

from typing import Iterable, Optional


def static_ints(values: Iterable) -> Optional[list[int]]:
    """``values`` (sizes of an example tensor or an IR node) as Python ints, or None if one is symbolic.

    Example::

        >>> static_ints(torch.Size([2, 4, 64, 16]))
        [2, 4, 64, 16]
    """
    out = []
    for v in values:
        try:
            out.append(int(v))
        except (TypeError, ValueError):
            return None
    return out
