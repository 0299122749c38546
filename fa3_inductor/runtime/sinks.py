"""Attention sinks as an exact correction of flex_attention's (out, LSE): the ops every path shares.

Notation (log2 units, as flex_attention's op returns its LSE)
------------------------------------------------------------
    out  [B, H, M, Dv]   attention output without the sink;  lse [B, H, M] float32, log2 units
    sinks [H]            one logit per query head (natural-log units, as gpt-oss stores them)
    s2 = sinks · log2(e)                     the sink in log2 units
    lse_t = log2(2^lse + 2^s2)               the LSE with the sink in the denominator
    r = 2^(lse - lse_t),  p = 2^(s2 - lse_t) = 1 - r      the rows' and the sink's shares
    out_s = out · r                           the output with the sink (Σ_j exp(s_j - LSE_t) v_j)

A fully masked row (lse = -inf) gets out_s = 0 and lse_t = s2.

``fa3_inductor::sink_combine(out, lse, sinks) -> (out_s, lse_t)`` computes it; its gradient is
two more ops, so that graphs can be rewritten around them (lowering/sinks_fusion.py):

    sink_combine_backward(g_out_s, g_lse_t, out_s, lse, lse_t) -> (g_out, g_lse)
        g_out = g_out_s · r,   g_lse = ln2 · (1 - r) · Δ + r · g_lse_t,   Δ = rowsum(g_out_s · out_s)
    sink_grad(g_out_s, g_lse_t, out_s, lse_t, sinks) -> g_sinks [H]
        g_sinks[h] = Σ_{b,m} p · (log2e · g_lse_t - Δ)        (= -Σ p Δ without an LSE gradient)

Why this form (docs/design/sinks.md): flex_attention's op has no sinks argument; the op followed by
this correction is exact under every backend and every kernel (torch's included), and our lowering
folds the correction into the kernel's epilogue where nothing else reads the op's own (out, LSE).
The gradient of q, k, v then follows from the usual formulas applied to (out_s, lse_t): the sink
only joins the denominator.

Example::

    >>> out, lse = torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3)
    >>> out_s, lse_t = torch.ops.fa3_inductor.sink_combine(out, lse, torch.zeros(2))
    >>> float(lse_t[0, 0, 0])    # log2(2^0 + 2^0)
    1.0
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


def _sink2(sinks: Tensor) -> Tensor:
    """The sinks in log2 units, shaped [1, H, 1] to broadcast over an LSE [B, H, M]."""
    return (sinks.float() * LOG2E).view(1, -1, 1)


def _share(num: Tensor, lse_t: Tensor) -> Tensor:
    """2^(num - lse_t), 0 where lse_t is -inf (a -inf sink on a row with no key)."""
    return torch.where(lse_t == float("-inf"), 0.0, torch.exp2(num - lse_t))


def check_sinks(sinks: Tensor, heads: int, where: str, device: Optional[torch.device] = None) -> None:
    """Raise TypeError / ValueError, saying what to change, unless ``sinks`` is a floating-point
    tensor of shape (heads,): one logit per query head (on ``device``, the inputs', when given).

    Example::

        >>> check_sinks(torch.zeros(4), 4, "flex")
        >>> check_sinks(torch.zeros(2), 4, "flex")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: flex: sinks must have shape (4,), one logit per query head; got shape (2,) ...
    """
    if not isinstance(sinks, Tensor):
        raise TypeError(f"{where}: sinks must be a torch.Tensor of shape ({heads},), one logit per "
                        f"query head; got {type(sinks).__name__} (wrap it: torch.tensor(...))")
    if sinks.numel() != heads:
        raise ValueError(f"{where}: sinks must have shape ({heads},), one logit per query head; got "
                         f"shape {tuple(sinks.shape)} (with grouped-query attention: one per query "
                         "head, not per key/value head)")
    if sinks.shape != (heads,):
        raise ValueError(f"{where}: sinks must have shape ({heads},); got shape {tuple(sinks.shape)} "
                         "(pass sinks.reshape(-1))")
    if not sinks.is_floating_point():
        raise ValueError(f"{where}: sinks must be a floating-point tensor (natural-log logits); got "
                         f"{sinks.dtype} (pass sinks.float())")
    if device is not None and sinks.device != device:
        raise ValueError(f"{where}: sinks are on {sinks.device}, q/k/v on {device}; move them to the "
                         "inputs' device")


@torch.library.custom_op("fa3_inductor::sink_combine", mutates_args=())
def sink_combine(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """(out_s, lse_t): ``out`` and its log2 ``lse`` with each head's sink in the denominator
    (module docstring).

    Example::

        >>> out_s, lse_t = sink_combine(out, lse, sinks)   # doctest: +SKIP
    """
    lse_t = torch.logaddexp2(lse.float(), _sink2(sinks))
    r = _share(lse.float(), lse_t)
    return (out.float() * r.unsqueeze(-1)).to(out.dtype), lse_t.to(lse.dtype)


@sink_combine.register_fake
def _sink_combine_fake(out, lse, sinks):
    return torch.empty_like(out), torch.empty_like(lse)


@torch.library.custom_op("fa3_inductor::sink_combine_backward", mutates_args=())
def sink_combine_backward(g_out_s: Tensor, g_lse_t: Optional[Tensor], out_s: Tensor, lse: Tensor,
                          lse_t: Tensor) -> tuple[Tensor, Tensor]:
    """(g_out, g_lse): the gradients sink_combine hands flex_attention's (out, lse).

    Example::

        >>> g_out, g_lse = sink_combine_backward(g, None, out_s, lse, lse_t)   # doctest: +SKIP
    """
    r = _share(lse.float(), lse_t)
    delta = (g_out_s.float() * out_s.float()).sum(-1)
    g_lse = LN2 * (1.0 - r) * delta
    if g_lse_t is not None:
        g_lse = g_lse + r * g_lse_t.float()
    return (g_out_s.float() * r.unsqueeze(-1)).to(g_out_s.dtype), g_lse.to(lse.dtype)


@sink_combine_backward.register_fake
def _sink_combine_backward_fake(g_out_s, g_lse_t, out_s, lse, lse_t):
    return torch.empty_like(g_out_s), torch.empty_like(lse)


@torch.library.custom_op("fa3_inductor::sink_grad", mutates_args=())
def sink_grad(g_out_s: Tensor, g_lse_t: Optional[Tensor], out_s: Tensor, lse_t: Tensor,
              sinks: Tensor) -> Tensor:
    """The sinks' gradient [H] from the combined output and LSE alone (module docstring); per
    query head, so grouped-query attention needs nothing more.

    Example::

        >>> g_sinks = sink_grad(g, None, out_s, lse_t, sinks)   # doctest: +SKIP
    """
    p = _share(_sink2(sinks), lse_t)
    delta = (g_out_s.float() * out_s.float()).sum(-1)
    term = -delta if g_lse_t is None else g_lse_t.float() * LOG2E - delta
    return (p * term).sum((0, 2)).to(sinks.dtype)


@sink_grad.register_fake
def _sink_grad_fake(g_out_s, g_lse_t, out_s, lse_t, sinks):
    return torch.empty_like(sinks)


def _setup(ctx, inputs, output) -> None:
    out, lse, sinks = inputs
    out_s, lse_t = output
    ctx.save_for_backward(out_s, lse, lse_t, sinks)
    ctx.sinks_need_grad = sinks.requires_grad


def _backward(ctx, g_out_s, g_lse_t):
    out_s, lse, lse_t, sinks = ctx.saved_tensors
    if g_out_s is None:
        g_out_s = torch.zeros_like(out_s)
    g_out, g_lse = sink_combine_backward(g_out_s, g_lse_t, out_s, lse, lse_t)
    g_sinks = sink_grad(g_out_s, g_lse_t, out_s, lse_t, sinks) if ctx.sinks_need_grad else None
    return g_out, g_lse, g_sinks


sink_combine.register_autograd(_backward, setup_context=_setup)


def combine_natural(out: Tensor, lse_nat: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`sink_combine` for an LSE in natural-log units (torch's flex_attention front door):
    returns (out_s, lse_t in natural-log units).

    Example::

        >>> out_s, lse_t = combine_natural(out, lse, sinks)   # doctest: +SKIP
    """
    out_s, lse_t = torch.ops.fa3_inductor.sink_combine(out, lse_nat * LOG2E, sinks)
    return out_s, lse_t * LN2
