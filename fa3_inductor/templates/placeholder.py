"""One-element tensors that stand for an absent argument (a missing block table, the split
buffers of a one-split decode): the kernels never read them.

They are allocated once per (device, dtype) and kept, and the fast launch path
(runtime/fast_launch.py) keeps them in its recipes. So they must not come from a CUDA graph's
memory pool: cudagraph trees (``mode="reduce-overhead"``, e.g. transformers' generate() with a
static cache) run a graph's first calls with this thread's allocations routed to the graph's pool,
and refuse a pool tensor that outlives the call ("Detected 1 tensor(s) in the cudagraph pool not
tracked as outputs"). The pool routing is per thread (``_cuda_beginAllocateCurrentThreadToPool``),
so the first allocation runs on a short-lived thread of its own. During a stream capture that
thread could not allocate safely; there a per-call tensor is returned (the graph owns it) and
nothing is kept.

Example::

    >>> placeholder(torch.device("cpu"), torch.int32).numel()
    1
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

_KEPT: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def outside_graph_pools(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``make()`` run where a cudagraph tree's pool routing cannot reach it (a short-lived thread
    of its own, then a device synchronize: the thread's stream may have queued a fill), for a CUDA
    tensor kept across calls. Not during a stream capture (the caller allocates per call there).

    Example::

        >>> outside_graph_pools(lambda: torch.zeros(2)).tolist()
        [0.0, 0.0]
    """
    made: list[torch.Tensor] = []

    def run() -> None:
        made.append(make())
        if made[0].is_cuda:
            torch.cuda.synchronize(made[0].device)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    if not made:
        raise RuntimeError("fa3_inductor: allocating a kept tensor failed on its worker thread "
                           "(see the thread's traceback above); check the device's free memory")
    return made[0]


def placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A one-element ``dtype`` tensor on ``device`` that no kernel reads (see the module doc)."""
    key = (torch.device(device), dtype)
    kept = _KEPT.get(key)
    if kept is not None:
        return kept
    if key[0].type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.empty(1, dtype=dtype, device=key[0])
    make = lambda: torch.empty(1, dtype=dtype, device=key[0])   # noqa: E731
    _KEPT[key] = outside_graph_pools(make) if key[0].type == "cuda" else make()
    return _KEPT[key]
