"""Whether a context-parallel region is active: the one piece of state the compiled graphs read.

``fa3_inductor.distributed.context_parallel`` pushes its region here on entry and pops it on exit;
the fa3 backend's compiled graphs that hold attention sites ask :func:`active` on every call (a
list's truthiness: tens of nanoseconds) and, inside a region, run their ring-attention variant
(backend.py, distributed/graph_sites.py). The state lives down here, below every front door, so
that neither of the two needs to import the other: data flows front doors -> recognition ->
lowering -> kernel families -> runtime, and nothing reaches back up.

A region is any object with ``ring_graph(gm, fp8=None) -> gm`` (the graph with its flex_attention
sites made ring attention; ``fp8``: the graph's FP8 recipe, its ``fa3.fp8`` option, or None); the
backend calls nothing else on it. While ring attention computes its shards
(:func:`suspended`) no region is active: the per-shard attention it runs (``fa3_inductor.flex``,
itself a compiled graph with a flex_attention site) must attend within the shards it is given.

Example::

    >>> active() is None
    True
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

_ACTIVE: list = []   # innermost last; None while a ring computes its shards


def active() -> Optional[Any]:
    """The innermost active context-parallel region, or None (also inside :func:`suspended`).

    Example::

        >>> active() is None
        True
    """
    return _ACTIVE[-1] if _ACTIVE else None


def push(region: Any) -> None:
    """Enter ``region`` (fa3_inductor.distributed.context_parallel does).

    Example::

        >>> push(region); ...; pop()   # doctest: +SKIP
    """
    _ACTIVE.append(region)


def pop() -> None:
    """Leave the innermost region.

    Example::

        >>> push(region); ...; pop()   # doctest: +SKIP
    """
    _ACTIVE.pop()


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Inside, :func:`active` is None: ring attention's own per-shard calls (distributed/ring.py).

    Example::

        >>> with suspended(): active() is None
        True
    """
    _ACTIVE.append(None)
    try:
        yield
    finally:
        _ACTIVE.pop()
