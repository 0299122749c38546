"""``flex(..., sinks=)`` off the direct path: flex_attention's op followed by the exact sink correction.

Under torch.compile (flex()'s own compiled call, or the user's) the op is called directly, so its
log2 LSE feeds ``fa3_inductor::sink_combine`` with nothing in between: the shape our lowering folds
into the kernel's epilogue (lowering/sinks_fusion.py), and whose gradient reaches the sinks
(runtime/sinks.py). Run eagerly (torch's own kernel: CPU tensors without the interpreter), torch's
front door computes (out, LSE) and the same correction follows.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from . import _compat
from .runtime import sinks as _sinks   # noqa: F401  (defines fa3_inductor::sink_combine)

_LN2 = math.log(2.0)


def flex_with_sinks(q: Tensor, k: Tensor, v: Tensor, score_mod: Optional[Callable], block_mask: Any,
                    scale: Optional[float], enable_gqa: bool, sinks: Tensor, return_lse: bool,
                    kernel_options: Optional[dict] = None) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Attention whose softmax denominator includes ``sinks[h]`` for query head h: the output, and
    the natural-log LSE (sink included) if ``return_lse``. Inputs are validated by flex();
    ``kernel_options`` go to the flex_attention op.

    Example::

        >>> q = torch.randn(1, 4, 8, 16)
        >>> flex_with_sinks(q, q, q, None, None, None, False, torch.zeros(4), False).shape
        torch.Size([1, 4, 8, 16])
    """
    if torch.compiler.is_compiling():
        out, lse2 = _compat.flex_hop_log2(q, k, v, score_mod, block_mask, scale, kernel_options)
        out, lse2 = torch.ops.fa3_inductor.sink_combine(out, lse2, sinks)
        return (out, lse2 * _LN2) if return_lse else out
    out, lse = _compat.flex_attention_with_lse(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                               scale=scale, enable_gqa=enable_gqa,
                                               kernel_options=kernel_options)
    out, lse = _sinks.combine_natural(out, lse, sinks)
    return (out, lse) if return_lse else out
