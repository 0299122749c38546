"""Host side of the captured-buffer gradients (kernel.py, "Buffer gradients"): the dQ kernel's
BGRADS bundle and scratch, and the launch-list steps around the dQ pass.

Atomic mode: fp32 accumulators zeroed before the dQ pass, then buffer_grad_store_kernel scales
(the value mod's out_scale) and casts into the caller's gradient. Deterministic mode: entry slots
(offsets preset to -1, "no entry"), then a stable sort of the entries by offset and
buffer_grad_segment_sum_kernel, which sums each offset's run in one order. Zeroing and sorting are
torch ops, run as :class:`TorchStep` entries of the launch list.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import triton

from ..placeholder import placeholder
from ..modgen import kernel_score_mod, load_mod
from .buffer_grad import BufferGradSource
from .kernel import (NO_BUFFER_GRADS, BwdBufferGrad, BwdBufferGrads,
                     buffer_grad_segment_sum_kernel, buffer_grad_store_kernel)

Launch = tuple   # (kernel, args, kwargs, grid), as host.py's


class TorchStep:
    """A launch-list entry made of torch ops (zeroing, sorting): ``step[grid](*args, **kwargs)``
    calls ``fn(*args, **kwargs)``, so a launcher runs it as it runs a kernel;
    :func:`compile_generic_backward` skips it.

    Example::

        >>> TorchStep(torch.Tensor.zero_)[None](torch.ones(2)).tolist()
        [0.0, 0.0]
    """

    def __init__(self, fn: Any):
        self.fn = fn

    def __getitem__(self, grid: Any) -> Any:
        return self.fn

    def __repr__(self) -> str:
        return f"TorchStep({self.fn.__name__})"


def _zero(*tensors: torch.Tensor) -> None:
    for t in tensors:
        t.zero_()


def _no_entries(*offsets: torch.Tensor) -> None:
    for t in offsets:   # slots of KV tiles a program does not visit stay "no entry"
        t.fill_(-1)


def _sort_entries(*jobs: tuple) -> None:
    """Per buffer: the entries' values sorted stably by offset (a fixed order: by slot within an
    offset), and each offset's run [start, end) in them."""
    for offsets, values, sorted_values, starts, ends in jobs:
        order = torch.argsort(offsets, stable=True)
        sorted_offsets = offsets[order]
        torch.index_select(values, 0, order, out=sorted_values)
        wanted = torch.arange(starts.numel(), device=offsets.device, dtype=offsets.dtype)
        torch.searchsorted(sorted_offsets, wanted, out=starts)
        torch.searchsorted(sorted_offsets, wanted, right=True, out=ends)


_FINAL_BLOCK = 1024       # buffer-gradient elements per program of the last step
_SEGMENT_BLOCK, _SEGMENT_CHUNK = 64, 16


def buffer_grad_launches(buffer_grads: Sequence[tuple[BufferGradSource, torch.Tensor]],
                          deterministic: bool, sm_scale: float, programs: int, kv_tiles: int,
                          block_m: int, block_n: int, device: torch.device
                          ) -> tuple[BwdBufferGrads, tuple, tuple, list[Launch], list[Launch]]:
    """(the dQ kernel's BGRADS, its bg_out and bg_idx, the launches before the dQ pass, the
    launches after it) for ``buffer_grads``, (source, gradient) pairs (module docstring).
    ``programs`` counts the dQ kernel's programs, ``kv_tiles`` its KV tiles per program.

    Example::

        >>> bgrads, bg_out, bg_idx, before, after = buffer_grad_launches(
        ...     [(source, dslopes)], False, 0.125, 8, 4, 64, 64, q.device)    # doctest: +SKIP
        >>> [type(k).__name__ for k, *_ in before + after]                   # doctest: +SKIP
        ['TorchStep', 'JITFunction']
    """
    if not buffer_grads:
        return NO_BUFFER_GRADS, (), (), [], []
    bundles, outs, offsets, finals, sorts = [], [], [], [], []
    no_offsets = placeholder(device, torch.int32)   # bg_idx of the atomic mode
    for item in buffer_grads:
        source, grad = item if isinstance(item, (tuple, list)) and len(item) == 2 else (None, None)
        if not isinstance(source, BufferGradSource) or not isinstance(grad, torch.Tensor):
            raise ValueError("generic backward: buffer_grads takes (BufferGradSource, gradient "
                             f"tensor) pairs, got {item!r}; build the sources with "
                             "generic_bwd.buffer_grad_sources")
        if tuple(grad.shape) != source.shape or not grad.is_contiguous() or \
                grad.device != device or not grad.is_floating_point():
            raise ValueError(f"generic backward: the gradient of captured buffer {source.buffer} "
                             f"must be a contiguous floating tensor of shape {source.shape} on "
                             f"{device}, got {grad.dtype} {tuple(grad.shape)} on {grad.device} "
                             f"(contiguous: {grad.is_contiguous()}); allocate it with torch.empty")
        value, factor = (None, 1.0) if source.value is None else \
            kernel_score_mod(load_mod(source.value), sm_scale)
        bundles.append(BwdBufferGrad(VALUE=value, INDEX=load_mod(source.offset),
                                     ALONG_Q=source.along_q, ALONG_KV=source.along_kv))
        numel = grad.numel()
        if not deterministic:
            outs.append(torch.empty(numel, dtype=torch.float32, device=device))
            offsets.append(no_offsets)
            finals.append((buffer_grad_store_kernel, (outs[-1], grad, factor, numel),
                           dict(BLOCK=_FINAL_BLOCK), (triton.cdiv(numel, _FINAL_BLOCK),)))
            continue
        # Entry slots (kernel.py): per program, times the KV tiles where the offset reads kv_idx,
        # times the rows where it reads q_idx.
        slots = programs * (kv_tiles * block_n if source.along_kv else 1) * \
            (block_m if source.along_q else 1)
        outs.append(torch.empty(slots, dtype=torch.float32, device=device))
        offsets.append(torch.empty(slots, dtype=torch.int32, device=device))
        job = (offsets[-1], outs[-1], torch.empty_like(outs[-1]),
               torch.empty(numel, dtype=torch.int64, device=device),
               torch.empty(numel, dtype=torch.int64, device=device))
        sorts.append(job)
        finals.append((buffer_grad_segment_sum_kernel, (*job[2:], grad, factor, numel),
                       dict(BLOCK=_SEGMENT_BLOCK, CHUNK=_SEGMENT_CHUNK),
                       (triton.cdiv(numel, _SEGMENT_BLOCK),)))
    bgrads = BwdBufferGrads(GRADS=tuple(bundles), DETERMINISTIC=deterministic)
    if deterministic:
        before = [(TorchStep(_no_entries), tuple(offsets), {}, None)]
        after = [(TorchStep(_sort_entries), tuple(sorts), {}, None)] + finals
    else:
        before, after = [(TorchStep(_zero), tuple(outs), {}, None)], finals
    return bgrads, tuple(outs), tuple(offsets), before, after
