"""flex_decode's call memo: a repeated decode call re-launches its kernel without checks or planning.

A decode step calls ``flex_decode`` once per layer per token, so its host path is per-token latency:
the checks (``decode._check``), the mods' generation, the launch key and its lookup (or, on a key's
first call, ``prepare_decode``'s planning: configs, split count, scratch) cost 42-93 µs a call on
an H200 host (docs/design/decode.md). A call with the same mods (by identity, or equal by what they compute: ``direct.equal_key``), scale
and ``num_splits``, on tensors of the same signature (q, k_cache, v_cache, seq_lens, block_table,
q_offset, k_scale, v_scale and a given ``scratch``: shapes, strides, dtypes, devices, 16-byte
alignment, which of them are one tensor), with no gradient needed, launches the same kernel: the
memo keeps that launch, bound by ``decode._kernel`` (on CUDA the recording of
templates/decode/launch_cache.py, under the interpreter its ``interpreted`` re-run), and replays
it on the new tensors. The signature is part of the key: one entry a signature, so layers of two
shapes (or caches of two dtypes) do not evict each other in turn.

What is not keyed: ``seq_lens``' and the tables' values (the kernel reads them; a CUDA graph
replays with new lengths) and ``return_lse`` (the launch writes the LSE either way; a replay
scales it only when asked). The entries live in direct.py's table, through its ``remember`` /
``live`` / ``ModWatch`` (a rebound closure cell, default or global misses). A mod's captured
tensors are the kernel's buffers, read at run time: an in-place edit keeps the entry (the full
path's mod cache keeps its code too) and the replay reads the new values; a buffer whose shape,
strides or dtype changed in place misses. Anything else (the gather fallback, a mod that cannot be
generated, a tensor subclass, a scale that is no float or int, a num_splits that is no int, a call
inside torch.compile) takes the full path, which keeps every error.

Example::

    >>> from fa3_inductor import decode, flex_decode
    >>> _ = [flex_decode(q, k, v, seq_lens=lens) for _ in range(3)]   # doctest: +SKIP
    >>> decode.memo_stats()["hits"]                                   # doctest: +SKIP
    2
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from . import direct
from .runtime.fast_launch import aliasing, tensor_signature

_LN2 = math.log(2.0)
_DECODE = "flex_decode"   # a memo key's template slot: (_DECODE, num_splits, signature)
# calls remembered, replays, replays of a mod made anew: decode.memo_stats() reads them
counts = {"remembered": 0, "hits": 0, "equal_hits": 0}

# launch(q, k, v, seq_lens, block_table, q_offset, k_scale, v_scale, scratch) -> (out, lse log2),
# or None when the captured buffers' layout changed since it was bound
Launch = Callable[..., Optional[tuple[Tensor, Tensor]]]


def memo_key(score_mod: Optional[Callable], mask_mod: Optional[Callable], scale: object,
             num_splits: object, signature: tuple) -> Optional[tuple]:
    """The memo's identity key of a flex_decode call (direct.memo_key's, its template slot naming
    flex_decode, ``num_splits`` and the tensors' :func:`call_signature`: one entry a signature, so
    layers of two shapes do not take turns evicting each other), or None for a ``scale`` /
    ``num_splits`` the full path must check (``True`` hashes as ``1``).

    Example::

        >>> memo_key(None, None, 0.125, None, ("sig",))[3:]
        (0.125, False, ('flex_decode', None, ('sig',)))
        >>> memo_key(None, None, True, None, ("sig",)) is None
        True
    """
    if (scale is not None and type(scale) is not float and type(scale) is not int) or \
            (num_splits is not None and type(num_splits) is not int):
        return None
    return direct.memo_key(score_mod, mask_mod, None, scale, False, (_DECODE, num_splits, signature))


def call_signature(tensors: Sequence[Optional[Tensor]], scratch: object) -> Optional[tuple]:
    """What of a call's tensors (q, k_cache, v_cache, seq_lens, block_table, q_offset, k_scale,
    v_scale) and its ``scratch`` a remembered launch depends on: their tensor_signature, which are
    one tensor, and torch's float32 matmul precision for float32 inputs (the kernel's dot
    precision); None when one is not a plain tensor (the full path checks it).

    Example::

        >>> q, k, lens = torch.zeros(1, 4, 1, 16), torch.zeros(1, 2, 32, 16), torch.zeros(1, dtype=torch.int32)
        >>> len(call_signature((q, k, k, lens, None, None, None, None), None))
        3
    """
    if scratch is not None:
        if type(scratch) is not tuple and type(scratch) is not list or len(scratch) != 3:
            return None
        tensors = (*tensors, *scratch)
    for t in tensors:
        if t is not None and type(t) is not Tensor:
            return None
    q = tensors[0]
    return (tensor_signature(tensors), aliasing(tensors),
            torch.get_float32_matmul_precision() if q.dtype is torch.float32 else None)


def replay(key: tuple, tensors: tuple, scratch: Optional[tuple], return_lse: bool
           ) -> Optional[tuple[Tensor, Tensor]]:
    """(out, lse in log2 units) of the launch remembered under ``key`` (:func:`memo_key` or its
    direct.equal_key), run on ``tensors`` (and ``scratch``) of the key's signature; None when there
    is none, a mod changed, or a gradient is needed (the full path raises). The LSE is converted
    to natural-log units when ``return_lse``.

    Example::

        >>> replay(memo_key(None, None, None, None, sig), tensors, None, False)   # doctest: +SKIP
    """
    call = direct.live(key, None)   # the signature is in the key
    if call is None:
        return None
    q, k, v = tensors[:3]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    result = call.launch(*tensors, scratch)
    if result is None:
        return None
    counts["hits"] += 1
    if direct.is_equal_key(key):
        counts["equal_hits"] += 1
    return (result[0], result[1].mul_(_LN2)) if return_lse else result


def remember(key: tuple, score_mod: Optional[Callable], mask_mod: Optional[Callable],
             bind: Callable[[], Optional[Launch]]) -> None:
    """Keep the launch ``bind()`` makes (None: nothing to keep) under ``key`` (:func:`memo_key`)
    and the mods' equal key, watching the mods (a mask's captured tensors without their versions:
    the kernel reads them at run time).

    Example::

        >>> remember(memo_key(None, None, None, None, sig), None, None, lambda: launch)  # doctest: +SKIP
    """
    if direct.remember((key, score_mod, mask_mod, None), None, False, bind, mask_versions=False):
        counts["remembered"] += 1


def clear() -> None:
    """Zero :data:`counts` and forget every remembered call and plan: flex()'s too (one table,
    direct.clear)."""
    counts.update(remembered=0, hits=0, equal_hits=0)
    direct.clear()
