"""The namespace generated *torch*-dialect mods call as ``T.<name>`` (see modgen_torch.py).

It mirrors what the ``tl``/``gl`` dialects read from ``triton.language`` and from
``mod_helpers``, but over torch tensors that broadcast: ``score`` is a [B, H, M, N] float32
tensor, ``b``/``h``/``q_idx``/``kv_idx`` are int32 index tensors shaped to broadcast against
it. Operands may also be Python numbers (constants folded into the mod), so every helper
accepts them. The functions are differentiable where torch's are: the backward recomputes
scores through them under autograd to get gradients of the score and of captured buffers.

Example::

    >>> import torch
    >>> from fa3_inductor.templates import torch_mod_helpers as T
    >>> T.maximum(torch.tensor([1, 5]), 3).tolist()
    [3, 5]
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx

float32, float16, bfloat16, float64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
int32, int64, int16, int8, uint8 = torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8

abs = torch.abs  # noqa: A001  (a namespace mirroring tl.abs)
exp, exp2, log, log2 = torch.exp, torch.exp2, torch.log, torch.log2
sqrt, rsqrt, sin, cos, erf = torch.sqrt, torch.rsqrt, torch.sin, torch.cos, torch.erf
floor, ceil, tanh, sigmoid = torch.floor, torch.ceil, torch.tanh, torch.sigmoid
sign, log1p, expm1, trunc = torch.sign, torch.log1p, torch.expm1, torch.trunc
round = torch.round  # noqa: A001  (half to even, as the other dialects)
zeros_like = torch.zeros_like


def as_bool(x: Any) -> Any:
    """The ``tl`` dialect's interpreter workaround for float comparisons; here the identity."""
    return x


def index_to_float(x: Any) -> Any:
    """float32 of an int index (the ``tl`` dialect's I2F-free trick; here a plain cast)."""
    return x.to(torch.float32) if _is_tensor(x) else float(x)


def _is_tensor(x: Any) -> bool:
    # fx Proxies count: recognition (recognition/lift.py) evaluates the same helpers while it
    # writes mask computations into a graph.
    return isinstance(x, (torch.Tensor, torch.fx.Proxy))


def _tensor_pair(a: Any, b: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Both operands as tensors (a Python number becomes a 0-d tensor beside the other)."""
    if _is_tensor(a) and _is_tensor(b):
        return a, b
    ref = a if _is_tensor(a) else b
    if not _is_tensor(ref):
        return torch.as_tensor(a), torch.as_tensor(b)
    dtype = torch.result_type(a, b)
    return (torch.as_tensor(a, dtype=dtype, device=ref.device),
            torch.as_tensor(b, dtype=dtype, device=ref.device))


def maximum(a: Any, b: Any) -> Any:
    return torch.maximum(*_tensor_pair(a, b))


def minimum(a: Any, b: Any) -> Any:
    return torch.minimum(*_tensor_pair(a, b))


def where(cond: Any, a: Any, b: Any) -> Any:
    if not _is_tensor(cond):
        return a if cond else b
    return torch.where(cond, a, b)


def floordiv(a: Any, b: Any) -> Any:
    if not (_is_tensor(a) or _is_tensor(b)):
        return a // b
    return torch.div(*_tensor_pair(a, b), rounding_mode="floor")


floordiv_float = floordiv   # torch.div(rounding_mode="floor") is right for floats as is


def truncdiv(a: Any, b: Any) -> Any:
    if not (_is_tensor(a) or _is_tensor(b)):
        return int(a / b)
    return torch.div(*_tensor_pair(a, b), rounding_mode="trunc")


truncdiv_float = truncdiv


def fmod(a: Any, b: Any) -> Any:
    """C's fmod (the sign of a), as Triton's % computes it; Python's % is torch.remainder."""
    if not (_is_tensor(a) or _is_tensor(b)):
        return math.fmod(a, b) if isinstance(a, float) or isinstance(b, float) else int(math.fmod(a, b))
    return torch.fmod(*_tensor_pair(a, b))


def remainder(a: Any, b: Any) -> Any:
    if not (_is_tensor(a) or _is_tensor(b)):
        return a % b
    return torch.remainder(*_tensor_pair(a, b))


def pow(a: Any, b: Any) -> Any:  # noqa: A001
    if not (_is_tensor(a) or _is_tensor(b)):
        return a ** b
    return torch.pow(a, b)


def cast(x: Any, dtype: torch.dtype) -> Any:
    """``x`` converted to ``dtype``; a Python number stays a number of that kind."""
    if _is_tensor(x):
        return x.to(dtype)
    if dtype is torch.bool:
        return bool(x)
    return float(x) if dtype.is_floating_point else int(x)
