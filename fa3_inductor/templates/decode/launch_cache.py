"""Re-launch a decode call's split kernel without planning it again.

A decode step's kernel time is a few microseconds at short caches, so the host path matters:
``prepare_decode`` checks every tensor and builds the kernel's arguments (tens of microseconds), and
``JITFunction.run`` binds ~45 arguments per launch. For one launch signature all of that is fixed,
so the first call records the launch with runtime/fast_launch.py and later calls substitute their
tensors and call the compiled kernel directly. The split scratch is an input of the recording: a
later call gets fresh partials of the recorded shapes and its stream's arrival counters
(host.arrival_counters), or the caller's scratch.

Keys are the caller's: everything but the tensors' addresses (mods, scale, options) plus
``tensor_signature`` and ``aliasing`` of the inputs.

Under Triton's interpreter there is no compiled kernel to record: :func:`interpreted` re-runs a
call's planned launches with the new call's tensors put in its inputs' places (flex_decode's call
memo replays through it on the CPU, decode_memo.py).
"""

from __future__ import annotations

from typing import Callable, Hashable, Optional, Sequence

import torch

from ...runtime.fast_launch import launch_cached, on_clear, rebinding, rebound, recorded, relaunch
from .host import arrival_counters, split_scratch

_MAX_KEYS = 256
# key -> (the fast_launch keys of the launches, the partials' shapes, the counters needed or 0)
_RECORDED: dict = {}
on_clear(_RECORDED.clear)


def launch_decode(key: Hashable, inputs: Sequence[Optional[torch.Tensor]], plan: Callable[[], list],
                  tag: str, scratch: Optional[tuple] = None) -> None:
    """Run the launches ``plan()`` returns (``prepare_decode``'s list) for ``inputs`` (every tensor
    they read or write but the split scratch), recording them under ``key`` on CUDA; a later call
    with the same key re-launches them. ``scratch``: the caller's (O_PART, LSE_PART, ARRIVALS),
    else fresh partials and the stream's counters.

    Example::

        >>> launch_decode(("site", tensor_signature(inputs)), inputs,
        ...               lambda: prepare_decode(q, k, v, out, lse, sm_scale=0.125), "decode")  # doctest: +SKIP
    """
    again = recorded_decode(key)
    if again is not None:
        again(inputs, scratch)
        return
    launches = plan()
    kernel, split_args, kwargs, grid = launches[0]
    split = grid[0] > 1
    scratch = split_scratch(split_args) if split else ()
    full = (*inputs, *scratch)
    if not inputs[0].is_cuda:
        for kernel, args, kwargs, grid in launches:
            kernel[grid](*args, **kwargs)
        return
    keys = []
    for n, launch in enumerate(launches):
        keys.append((key, n))
        launch_cached(keys[-1], full, lambda launch=launch: (*launch, tag))
    if len(_RECORDED) >= _MAX_KEYS:
        _RECORDED.clear()
    _RECORDED[key] = (tuple(keys), tuple(tuple(t.shape) for t in scratch[:2]), grid[1] if split else 0)


def recorded_decode(key: Hashable) -> Optional[Callable[[Sequence, Optional[tuple]], None]]:
    """The launch :func:`launch_decode` recorded under ``key``, as ``run(inputs, scratch=None)``
    (``inputs`` as launch_decode takes them, of the recorded signature; ``scratch`` the caller's or
    fresh partials and the stream's counters), or None if nothing is recorded.

    Example::

        >>> again = recorded_decode(key); again(inputs)   # doctest: +SKIP
    """
    hit = _RECORDED.get(key)
    if hit is None:
        return None
    entries = [recorded(k) for k in hit[0]]
    if any(e is None for e in entries):
        return None
    shapes, programs = hit[1], hit[2]

    def run(inputs: Sequence, scratch: Optional[tuple] = None) -> None:
        full = (*inputs, *_scratch(inputs[0].device, shapes, programs, scratch))
        for entry in entries:
            relaunch(entry, full)
    return run


def interpreted(launches: list, inputs: Sequence[Optional[torch.Tensor]]
                ) -> Optional[Callable[[Sequence, Optional[tuple]], None]]:
    """Under the interpreter (nothing compiled to record): ``run(inputs, scratch=None)``, as
    :func:`recorded_decode` gives, re-running ``launches`` (``prepare_decode``'s, already run for
    ``inputs``) for new inputs of the same signature and aliasing: an argument that is one of
    ``inputs`` (by identity, in a tuple too) takes the new call's tensor at that place
    (fast_launch.rebinding), the split scratch is the caller's or fresh. None when an argument is a
    tensor made while planning (not an input, not a one-element placeholder): it cannot be re-bound.

    Example::

        >>> launches = prepare_decode(q, k, v, out, lse, sm_scale=0.125)             # doctest: +SKIP
        >>> again = interpreted(launches, (q, k, v, out, lse)); again((q2, k2, v2, out2, lse2))  # doctest: +SKIP
    """
    _, split_args, _, grid = launches[0]
    split = grid[0] > 1
    scratch = split_scratch(split_args) if split else ()
    steps = [(kernel, rebinding(args, (*inputs, *scratch)), kwargs, grid)
             for kernel, args, kwargs, grid in launches]
    if any(step[1] is None for step in steps):
        return None
    shapes, programs = tuple(tuple(t.shape) for t in scratch[:2]), grid[1] if split else 0

    def run(inputs: Sequence, scratch: Optional[tuple] = None) -> None:
        full = (*inputs, *_scratch(inputs[0].device, shapes, programs, scratch))
        for kernel, recipe, kwargs, grid in steps:
            kernel[grid](*rebound(recipe, full), **kwargs)
    return run


def _scratch(device: torch.device, shapes: tuple, programs: int, scratch: Optional[tuple]) -> tuple:
    """A re-launch's split scratch: none for one split, else the caller's, else fresh partials
    of the recorded ``shapes`` and the stream's arrival counters."""
    if not shapes:
        return ()
    if scratch is not None:
        return tuple(scratch)
    return (*(torch.empty(s, dtype=torch.float32, device=device) for s in shapes),
            arrival_counters(device, programs))
