"""`fa3_inductor.flex` without torch.compile: the inference fast path on CUDA.

A compiled call pays Dynamo's guards, AOT autograd's wrapper and Inductor's graph call on every
invocation (~100 µs on an H200), which is more than the kernel itself at short sequences. When
no gradient is needed, flex() does not need any of that: it plans the site once (generate the
mods, pick the template, exactly as the lowering does) and then calls the
``fa3_inductor::flex_fwd`` op directly.

Plans are cached by what the mods compute, not by the function objects (mod_keys.py): that is
the part of Dynamo's guarding this path needs: redefining ``softcap(30.0)`` on every call hits
the cache, changing a captured number or rebinding a captured tensor re-plans. A mod whose key
cannot be read (a callable object, a functools.partial, an unusual closure value) is cached by
identity.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Hashable, Optional

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import noop_mask

from ._log import info_once
from .config import Settings
from .lowering.site_plan import plan_site
from .mod_keys import Unkeyable, mod_key
from .runtime.kernel_failures import kernel_failure
from .runtime.spec import SiteSpec
from .templates.modgen import BufferSpec, UnsupportedMod, trace_mod

_NO_MASK_BLOCK = 1 << 30   # torch's "no mask" block size
_MAX_PLANS = 512
_PLANS: dict[Hashable, Any] = {}


class _Plan:
    __slots__ = ("spec", "score_bufs", "mask_bufs", "reason")

    def __init__(self, spec: Optional[str], score_bufs: list, mask_bufs: list,
                 reason: Optional[str]):
        self.spec, self.score_bufs, self.mask_bufs, self.reason = (
            spec, score_bufs, mask_bufs, reason)


def forward(q: Tensor, k: Tensor, v: Tensor, score_mod: Optional[Callable], block_mask: Any,
            scale: float, template: str) -> Optional[tuple[Tensor, Tensor]]:
    """(out, lse in natural-log units) from our kernel, or None when it cannot serve the call
    (the caller then takes the compiled path, which records why).

    Inputs are validated by the caller, and q, k, v need no gradient; a captured tensor that
    needs one sends the call to the compiled path too.

    Example::

        >>> out, lse = forward(q, k, v, None, None, 0.125, "auto")   # doctest: +SKIP
    """
    mask_mod = block_mask.mask_mod if block_mask is not None else None
    site = (template, q.device, q.dtype, q.shape[1], q.shape[3], k.shape[1], v.shape[3],
            q.shape[0] == k.shape[0] or k.shape[0] == 1,
            None if block_mask is None else tuple(block_mask.BLOCK_SIZE))
    try:
        key = (mod_key(score_mod), mod_key(mask_mod), site)
    except Unkeyable:
        key = (score_mod, mask_mod, site)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(q, k, v, score_mod, mask_mod, block_mask, template)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    if plan.spec is None or kernel_failure(SiteSpec.from_json(plan.spec)) is not None:
        return None   # the compiled path plans it again and records why torch's kernel runs
    if torch.is_grad_enabled() and any(b.requires_grad for b in (*plan.score_bufs,
                                                                   *plan.mask_bufs)):
        return None  # a learnable captured tensor: the compiled path gives it a gradient
    if block_mask is None:
        tables = (None, None, None, None)
        sparse_q = sparse_kv = _NO_MASK_BLOCK
    else:
        tables = (block_mask.kv_num_blocks, block_mask.kv_indices,
                  block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
        sparse_q, sparse_kv = block_mask.BLOCK_SIZE
    out, lse, _ = torch.ops.fa3_inductor.flex_fwd.default(
        q, k, v, *tables, plan.score_bufs, plan.mask_bufs, float(scale), int(sparse_q),
        int(sparse_kv), plan.spec)
    return out, lse * math.log(2.0)


def clear() -> None:
    """Forget every plan (tests; after redefining mods in place)."""
    _PLANS.clear()


def _plan(q: Tensor, k: Tensor, v: Tensor, score_mod: Optional[Callable],
          mask_mod: Optional[Callable], block_mask: Any, template: str) -> _Plan:
    try:
        score_gm, score_bufs = trace_mod(score_mod or _identity_score, "score")
        mask_gm, mask_bufs = trace_mod(mask_mod or noop_mask, "mask")
    except Exception as exc:  # the compiled path traces it again and reports properly
        return _Plan(None, [], [], f"could not trace the mods here: {exc}")
    sparse = (_NO_MASK_BLOCK, _NO_MASK_BLOCK) if block_mask is None else \
        tuple(int(x) for x in block_mask.BLOCK_SIZE)
    kv = f"kv{list(k.shape)}" + (f" v{list(v.shape)}" if v.shape[3] != k.shape[3] else "")
    try:
        spec, reason = plan_site(
            score_gm, mask_gm, [BufferSpec.of(b) for b in score_bufs],
            [BufferSpec.of(b) for b in mask_bufs], device=q.device, dtype=q.dtype,
            q_heads=q.shape[1], kv_heads=k.shape[1], head_dim=q.shape[3],
            value_head_dim=v.shape[3], batches_match=q.shape[0] == k.shape[0] or k.shape[0] == 1,
            sparse_blocks=sparse, settings=Settings(template=template), needs_max=False,
            description=f"q{list(q.shape)} {kv} "
                        f"{str(q.dtype).replace('torch.', '')} {q.device.type} (flex, direct)")
    except UnsupportedMod as exc:
        return _Plan(None, [], [], f"mod not lowerable: {exc}")
    if spec is None:
        return _Plan(None, [], [], reason)
    if spec.note:
        info_once(f"fa3_inductor: {spec.note} ({spec.description})")
    # Buffers are baked into the generated code with their strides: pass them as traced.
    return _Plan(spec.to_json(), list(score_bufs), list(mask_bufs), None)


def _identity_score(score, b, h, q_idx, kv_idx):
    return score
