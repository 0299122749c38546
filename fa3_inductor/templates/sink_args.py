"""The ``sink_bufs`` argument every kernel that adds attention sinks takes (docs/design/sinks.md).

A kernel with sinks reads one float32 logit per query head; without sinks it gets no parameter at
all, so a site without them compiles exactly as it did before sinks existed.

Example::

    >>> import torch
    >>> sink_bufs(None, torch.zeros(1, 4, 8, 16), None, "fa3 kernel")
    ()
    >>> sink_bufs(torch.zeros(4, dtype=torch.float16), torch.zeros(1, 4, 8, 16), None, "fa3 kernel")[0].dtype
    torch.float32
"""

from __future__ import annotations

from typing import Any, Optional

import torch


def sink_bufs(sinks: Optional[torch.Tensor], q: torch.Tensor, fp8: Any, kernel: str) -> tuple:
    """``(SINKS,)``, a contiguous float32 [HQ] vector (``sinks`` itself when it is one: the launch
    caches key on it), or ``()`` without sinks. Raises ValueError, naming ``kernel`` and the fix, for
    FP8 operands (no FP8 kernel adds sinks) and for sinks that are not one floating-point logit per
    query head on q's device.

    Example::

        >>> sink_bufs(torch.zeros(2), torch.zeros(1, 4, 8, 16), None, "fa3 kernel")   # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: fa3 kernel: sinks must be a floating-point tensor of shape (4,), ...
    """
    if sinks is None:
        return ()
    heads = q.shape[1]
    if fp8 is not None:
        raise ValueError(f"{kernel}: FP8 operands with sinks; the FP8 kernels do not add sinks "
                         "(serve the site in bf16 / fp16)")
    if sinks.shape != (heads,) or not sinks.is_floating_point():
        raise ValueError(f"{kernel}: sinks must be a floating-point tensor of shape ({heads},), one "
                         f"logit per query head; got {sinks.dtype} {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"{kernel}: sinks are on {sinks.device}, q on {q.device}; move them to "
                         "q's device")
    return (sinks.to(torch.float32).contiguous(),)
