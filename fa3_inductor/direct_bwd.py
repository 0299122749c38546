"""Our backward families called directly with the (out, LSE) the caller gives: no forward, no autograd.

The lowering reaches the backward families through the ``fa3_inductor::flex_bwd.families`` op with
the forward's own ``out`` and ``lse``. Ring attention (fa3_inductor/distributed/) needs the same
kernels for one K/V shard with the GLOBAL merged output and LSE: then P = exp(S - L) is the
globally normalised probability of this shard's keys, and one call gives exactly this shard's
share of dq and its dk, dv (docs/design/context_parallel.md). This module plans such a call as the
lowering would (mods traced and generated, the score_mod's derivative from torch's joint graph,
families chosen: lowering/flex_backward_lowering.plan_backward_site) and runs the family walk
without the op's last resort: the dense recompute recomputes the softmax from q and k, which for a
shard is the shard's own softmax, not the global one. :func:`backward` returns None when no family
serves (the caller has a dense path that takes L as given).

Plans are cached by what the mods compute (mod_keys.py), as direct.py's are.

Example::

    >>> grads = backward(q, k, v, out, lse, dout, None, None, block_mask, 0.125)   # doctest: +SKIP
    >>> dq, dk, dv = grads if grads is not None else dense_fallback(...)         # doctest: +SKIP
"""

from __future__ import annotations

import math
from typing import Any, Callable, Hashable, Optional

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import noop_mask

from ._log import info_once
from .config import Settings, deterministic_gradients
from .direct import block_mask_tables
from .plan_cache import Plan as _Plan, cached
from .templates.family import BackwardSiteFacts
from .templates.modgen import BufferSpec, UnsupportedMod, trace_mod

_LN2 = math.log(2.0)
_MAX_PLANS = 512
_PLANS: dict[Hashable, Any] = {}


def backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
             dlse: Optional[Tensor], score_mod: Optional[Callable], block_mask: Any, scale: float,
             template: str = "auto") -> Optional[tuple[Tensor, Tensor, Tensor]]:
    """(dq, dk, dv) of attention of ``q`` against ``k``, ``v`` for the given normalisation, from one
    of our backward families; None when none serves (``reason`` of :func:`cached_plan` says why).

    ``out`` (B, H, M, Dv) and ``lse`` (B, H, M, natural log, -inf on rows nothing reaches) are used
    as given: P = exp(scores - lse), dS = P (dO·Vᵀ - rowsum(dO·out) + dlse). ``dlse``: the LSE's
    incoming gradient (natural-log units) or None. Inputs need no gradient; a captured tensor of
    the mods gets none (callers refuse mods whose tensors need one). Gradients come back in the
    inputs' dtypes.

    Example::

        >>> dq, dk, dv = backward(q, k, v, out, lse, dout, None, None, None, 0.125)   # doctest: +SKIP
    """
    mask_mod = block_mask.mask_mod if block_mask is not None else None
    plan = cached_plan(q, k, v, score_mod, mask_mod, block_mask, template)
    if plan.spec is None:
        return None
    from .runtime.ops_bwd import run_backward_families

    tables, sparse_q, sparse_kv = block_mask_tables(block_mask)
    q_tables = (None,) * 4 if block_mask is None else (
        block_mask.q_num_blocks, block_mask.q_indices, block_mask.full_q_num_blocks,
        block_mask.full_q_indices)
    # the kernels' LSE is in log2 units: L2 = L / ln 2, and Σ L·dL = Σ L2·(dL ln 2)
    lse2 = (lse.float() / _LN2).contiguous()
    dlse2 = None if dlse is None else (dlse.float() * _LN2).contiguous()
    served, _ = run_backward_families(
        *(t.contiguous() for t in (q, k, v, out)), lse2, dout.contiguous(), dlse2, tables,
        q_tables, plan.score_bufs, plan.mask_bufs, float(scale), int(sparse_q), int(sparse_kv),
        plan.spec)
    return None if served is None else served[:3]


def cached_plan(q: Tensor, k: Tensor, v: Tensor, score_mod: Optional[Callable],
                mask_mod: Optional[Callable], block_mask: Any, template: str = "auto") -> _Plan:
    """:func:`plan_backward`'s plan, cached by what the mods compute and the site's kind (device,
    dtype, heads, head dims, batch broadcast, block sizes, whether torch asks for deterministic
    algorithms), bound to the tensors these mods capture (plan_cache.py).

    Example::

        >>> cached_plan(q, k, v, None, None, None).spec is not None   # doctest: +SKIP
        True
    """
    site = (template, q.device, q.dtype, q.shape[1], q.shape[3], k.shape[1], v.shape[3],
            q.shape[0] == k.shape[0] or k.shape[0] == 1,
            None if block_mask is None else tuple(block_mask.BLOCK_SIZE), deterministic_gradients())
    return cached(_PLANS, _MAX_PLANS, site, score_mod, mask_mod,
                  lambda: _planned_backward(q, k, v, score_mod, mask_mod, block_mask, template))


def _planned_backward(q: Tensor, k: Tensor, v: Tensor, score_mod: Optional[Callable],
                      mask_mod: Optional[Callable], block_mask: Any, template: str) -> _Plan:
    plan = plan_backward(q, k, v, score_mod, mask_mod, block_mask, template)
    if plan.reason is not None:
        info_once(f"fa3_inductor: no backward family serves a direct backward call: {plan.reason}")
    return plan


def plan_backward(q: Tensor, k: Tensor, v: Tensor, score_mod: Optional[Callable],
                  mask_mod: Optional[Callable], block_mask: Any, template: str = "auto") -> _Plan:
    """Plan a direct backward call as the backward lowering plans a site (its ``spec`` for
    ``flex_bwd.families``); ``.spec`` is None when no family of ours serves it, with ``.reason``.

    Example::

        >>> plan_backward(q, k, v, None, mods.causal, block_mask).spec is not None   # doctest: +SKIP
        True
    """
    from torch._higher_order_ops.flex_attention import create_fw_bw_graph

    from .lowering.flex_backward_lowering import (BackwardGraphs, derivative_graph,
                                                  plan_backward_site)
    from .lowering.site_plan import unserved

    reason = _unserved(q, k, v, block_mask, unserved)
    if reason is not None:
        return _Plan(None, [], [], reason)
    try:
        score_gm, score_bufs = trace_mod(score_mod or _identity_score, "score")
        mask_gm, mask_bufs = trace_mod(mask_mod or noop_mask, "mask")
        # the score_mod's joint graph, as torch's flex autograd builds it (the derivative's
        # source); grad mode on: a caller inside autograd's backward has it off, and the joint
        # graph would then give the score no gradient at all
        with torch.enable_grad():
            index_values = (torch.zeros((), requires_grad=True),
                            *(torch.zeros((), dtype=torch.int32) for _ in range(4)))
            joint_gm = create_fw_bw_graph(score_gm, index_values, tuple(score_bufs))[1]
    except Exception as exc:   # a mod our tracing cannot follow: the caller's dense path serves it
        return _Plan(None, [], [], f"could not trace the mods here: {exc}")
    grad_gm, grad_error = derivative_graph(score_gm, joint_gm, len(score_bufs))
    facts = BackwardSiteFacts(q.device, q.dtype, q.shape[3], v.shape[3],
                              score_grad=grad_gm is not None or grad_error is not None,
                              deterministic=deterministic_gradients())   # torch.use_deterministic_algorithms
    graphs = BackwardGraphs(score_gm, joint_gm, mask_gm, [BufferSpec.of(b) for b in score_bufs],
                            [BufferSpec.of(b) for b in mask_bufs], (False,) * len(score_bufs),
                            grad_gm, grad_error)
    kv = f"kv{list(k.shape)}" + (f" v{list(v.shape)}" if v.shape[3] != k.shape[3] else "")
    description = (f"q{list(q.shape)} {kv} {str(q.dtype).replace('torch.', '')} {q.device.type} "
                   "(direct backward)")
    try:
        spec, note = plan_backward_site(graphs, facts, Settings(template=template).template,
                                        description)
    except UnsupportedMod as exc:
        return _Plan(None, [], [], f"mod not lowerable for the backward: {exc}")
    if spec is None:
        return _Plan(None, [], [], note)
    return _Plan(spec.to_json(), list(score_bufs), list(mask_bufs), None)


def _unserved(q: Tensor, k: Tensor, v: Tensor, block_mask: Any, unserved: Callable
              ) -> Optional[str]:
    """The lowering's site checks (lowering/flex_backward_lowering._site_facts) on real tensors."""
    reason = unserved(q.device, q.dtype, q.shape[3], v.shape[3])
    if reason is not None:
        return reason
    if q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads"
    if k.shape[0] not in (q.shape[0], 1):
        return "key/value batch differs from the query's (and is not 1)"
    if block_mask is not None:
        sparse = [int(x) for x in block_mask.BLOCK_SIZE]
        if not all(s >= 16 and s & (s - 1) == 0 for s in sparse):
            return f"block-mask block size {sparse[0]}x{sparse[1]} (fa3 serves powers of two >= 16)"
    return None


def clear() -> None:
    """Forget every plan (tests; after redefining mods in place)."""
    _PLANS.clear()


def _identity_score(score, b, h, q_idx, kv_idx):
    return score
