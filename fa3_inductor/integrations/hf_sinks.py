"""The attention sinks a transformers attention call carries, as ``flex(..., sinks=)`` takes them.

gpt-oss passes its per-head sinks to the attention function as ``s_aux=self.sinks``: a [H] parameter,
H the query heads, natural-log logits that join every row's softmax denominator (docs/design/sinks.md).
``attn_implementation="fa3"`` hands them to ``flex(..., sinks=)``, whose kernels add them in their
epilogue; the FP8 kernels do not add them, so ``"fa3_fp8"`` refuses a model with sinks.

Example::

    >>> sinks = hf_sinks(query, kwargs.get("s_aux"))                 # doctest: +SKIP
    >>> out = flex(query, key, value, ..., sinks=sinks)              # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Optional

import torch


def hf_sinks(query: torch.Tensor, s_aux: Optional[torch.Tensor], fp8: Any = None) -> Optional[torch.Tensor]:
    """``s_aux`` as flex()'s ``sinks=``: a [H] view, H = ``query.shape[1]`` (the query heads), or None
    when the call has no sinks. Raises NotImplementedError with ``fp8`` (the FP8 kernels do not add
    sinks) and TypeError / ValueError for a value that is not one floating-point logit per query head
    on the query's device, saying what to change.

    Example::

        >>> hf_sinks(torch.zeros(1, 4, 8, 16), torch.zeros(4)).shape
        torch.Size([4])
        >>> hf_sinks(torch.zeros(1, 4, 8, 16), None) is None
        True
    """
    if s_aux is None:
        return None
    where = "attn_implementation='fa3'"
    if fp8 is not None:
        raise NotImplementedError(
            "attn_implementation='fa3_fp8': this model passes attention sinks (s_aux) and the FP8 kernels "
            "do not add them; use attn_implementation='fa3' (bf16 / fp16 kernels, sinks in their epilogue)")
    if not isinstance(s_aux, torch.Tensor):
        raise TypeError(f"{where}: the attention sinks (s_aux) must be a tensor of one logit per query head, "
                        f"shape ({query.shape[1]},); got {type(s_aux).__name__}")
    heads = query.shape[1]
    if s_aux.numel() != heads:
        raise ValueError(f"{where}: the attention sinks (s_aux) have shape {tuple(s_aux.shape)}, expected one "
                         f"logit per query head, shape ({heads},) (with grouped-query attention: per query "
                         "head, not per key/value head)")
    if not s_aux.is_floating_point():
        raise ValueError(f"{where}: the attention sinks (s_aux) are {s_aux.dtype}; they must be a floating-point "
                         "tensor (convert them with .float())")
    if s_aux.device != query.device:
        raise ValueError(f"{where}: the attention sinks (s_aux) are on {s_aux.device}, the query on "
                         f"{query.device}; move the model's sinks to the query's device")
    return s_aux.reshape(heads)
