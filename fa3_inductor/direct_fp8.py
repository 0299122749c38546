"""`fa3_inductor.flex(..., fp8=...)`: FP8 attention for inference, without torch.compile.

One call runs the FP8 prologue (templates/fp8_prologue/: RoPE, Hadamard rotation, block
quantization, Vᵀ) and then the first kernel family that serves an FP8 site (templates/registry.py:
the ``fp8`` family; torch's dense kernel on the dequantized inputs as the last resort). The site is
planned once per (what the mods compute, shapes' kind, device), as the bf16 direct path does
(direct.py).

FP8 is inference-only: backward through it raises (api.flex checks before coming here).

A repeated call replays (the call memo, as direct.py's for bf16): after a served call, a call
with the same mod, mask and block-mask objects (or mods equal by what they compute: direct.equal_key),
the same scale, GQA flag and recipe, on q, k, v and RoPE tensors of the same signature
(direct.call_signature; RoPE's style and its tensors' layouts, as the prologue's layout key), with
no gradient needed, re-binds the prologue's layout and re-launches the recorded attention launch
(runtime/ops_fp8.bound_fp8_call), skipping the checks, the plan lookup, the Call and the launch key.
``stats()`` counts the replays.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from . import direct
from .direct import block_mask_tables, cached_plan
from .fp8_recipe import FP8Recipe, RopeSpec
from .runtime.fast_launch import aliasing, tensor_signature
from .runtime.ops_fp8 import bound_fp8_call
from .runtime.ops_fp8 import fp8_call as runtime_fp8_call
from .runtime.ops_fp8 import serve_fp8
from .runtime.spec import SiteSpec
from .templates.family import Call

_LN2 = 0.6931471805599453
_FP8 = "fp8"   # a memo key's template slot: (_FP8, recipe)
_stats = {"remembered": 0, "hits": 0, "equal_hits": 0}


class FP8Unserved(RuntimeError):
    """No FP8 kernel can run this call; the message says why and what to do."""


def forward_fp8(q: Tensor, k: Tensor, v: Tensor, score_mod: Optional[Callable], block_mask: Any,
                scale: float, recipe: FP8Recipe, rope: Optional[RopeSpec], want_lse: bool = True,
                memo: Optional[tuple] = None) -> tuple[Tensor, Optional[Tensor]]:
    """(out in q's dtype, lse in natural-log units) of FP8 attention on ``q, k, v`` (bf16/fp16),
    quantized per ``recipe`` after ``rope``. Inputs are validated by the caller (api.flex).
    ``want_lse`` False: the LSE is not converted from the kernel's log2 units (one launch less)
    and None is returned in its place. ``memo``: flex()'s ``(key, score_mod, mask_mod,
    block_mask)`` (key: :func:`memo_key`) to remember this call by for :func:`replay`, or None.

    Example::

        >>> out, lse = forward_fp8(q, k, v, None, None, 0.125, FP8Recipe(), None)   # doctest: +SKIP
        >>> forward_fp8(q, k, v, None, None, 0.125, FP8Recipe(), None, want_lse=False)[1] is None  # doctest: +SKIP
        True
    """
    spec, call = _planned_call(q, k, v, score_mod, block_mask, scale, recipe, rope)
    serve_fp8(spec, call)
    if memo is not None:
        _remember(memo, q, k, v, rope, spec, call)
    return call.out, call.lse.mul_(_LN2) if want_lse else None


def memo_key(score_mod: Optional[Callable], mask_mod: Optional[Callable], block_mask: Any,
             scale: Optional[float], enable_gqa: bool, recipe: FP8Recipe) -> tuple:
    """The memo's key of a flex(fp8=recipe) call: direct.memo_key's, its template slot naming the
    recipe (a frozen dataclass: equal recipes made anew share it). direct.equal_key gives its
    second key.

    Example::

        >>> memo_key(None, None, None, None, False, FP8Recipe())[-1]
        ('fp8', FP8Recipe(hadamard=True, block_m=128, block_n=128, smooth_k=False, two_level=1, seed=0, qk='int8'))
    """
    return direct.memo_key(score_mod, mask_mod, block_mask, scale, enable_gqa, (_FP8, recipe))


def replay(key: tuple, q: Tensor, k: Tensor, v: Tensor, rope: Optional[RopeSpec], return_lse: bool
           ) -> Optional[tuple[Tensor, Optional[Tensor]]]:
    """(out, lse in natural-log units or None) if an earlier served call of ``key`` covers this one
    (the same signature of q, k, v and RoPE's tensors, mods unchanged, no gradient needed: a call
    that needs one takes the full path, which refuses it), else None.

    Example::

        >>> replay(memo_key(None, None, None, None, False, FP8Recipe()), q, k, v, None, False)  # doctest: +SKIP
    """
    if not (type(q) is type(k) is type(v) is Tensor):
        return None
    signature = _signature(q, k, v, rope)
    if signature is None:
        return None
    call = direct.live(key, signature)
    if call is None or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                     or v.requires_grad)):
        return None
    _stats["hits"] += 1
    if direct.is_equal_key(key):
        _stats["equal_hits"] += 1
    out, lse = call.launch(q, k, v, rope, return_lse)
    return out, (lse.mul_(_LN2) if return_lse else None)   # the launch's own LSE buffer


def stats() -> dict[str, int]:
    """The FP8 call memo's counters: calls remembered (full path, then a launch kept), replays
    (``hits``), and those found by direct.equal_key (a mod made anew, equal to a remembered one).
    direct.clear() forgets the calls; :func:`clear` also zeroes these.

    Example::

        >>> stats()["hits"]      # doctest: +SKIP
        0
    """
    return dict(_stats)


def clear() -> None:
    """Forget every plan and remembered call (direct.clear) and zero the FP8 memo's counters."""
    direct.clear()
    _stats.update(remembered=0, hits=0, equal_hits=0)


def _remember(memo: tuple, q: Tensor, k: Tensor, v: Tensor, rope: Optional[RopeSpec], spec: str,
              call: Call) -> None:
    signature = _signature(q, k, v, rope)
    if signature is not None and direct.remember(memo, signature, False,
                                                 lambda: bound_fp8_call(q, k, v, rope, spec, call)):
        _stats["remembered"] += 1


def _signature(q: Tensor, k: Tensor, v: Tensor, rope: Optional[RopeSpec]) -> Optional[tuple]:
    """direct.call_signature, and with RoPE what the prologue's layout key reads of it (its style,
    its tensors' signatures, which of all the tensors are one); None for a RoPE the memo does not
    take (not a RopeSpec of plain tensors: the full path checks it)."""
    signature = direct.call_signature(q, k, v)
    if rope is None:
        return signature
    if type(rope) is not RopeSpec:
        return None
    tensors = (rope.cos, rope.sin, rope.q_positions, rope.k_positions)
    if not all(t is None or type(t) is Tensor for t in tensors):
        return None
    return (signature, rope.style, tensor_signature(tensors), aliasing((q, k, v, *tensors)))


def fp8_call(q: Tensor, k: Tensor, v: Tensor, score_mod: Optional[Callable], block_mask: Any,
             scale: float, recipe: FP8Recipe, rope: Optional[RopeSpec]) -> tuple[SiteSpec, Call]:
    """The planned FP8 site and its call: the prologue has run (``call.fp8``) and the outputs are
    allocated, not yet computed (``runtime.ops.serve(site, call)`` computes them; benchmarks time
    the kernel alone from here).

    Example::

        >>> site, call = fp8_call(q, k, v, None, None, 0.125, FP8Recipe(), None)   # doctest: +SKIP
        >>> site.families                                                               # doctest: +SKIP
        ('fp8', 'torch')
    """
    spec, call = _planned_call(q, k, v, score_mod, block_mask, scale, recipe, rope)
    return SiteSpec.from_json(spec), call


def _planned_call(q: Tensor, k: Tensor, v: Tensor, score_mod: Optional[Callable], block_mask: Any,
                  scale: float, recipe: FP8Recipe, rope: Optional[RopeSpec]) -> tuple[str, Call]:
    """(the plan's SiteSpec JSON, the call with the prologue run)."""
    mask_mod = block_mask.mask_mod if block_mask is not None else None
    plan = _plan(q, k, v, score_mod, mask_mod, block_mask)
    tables, sparse_q, sparse_kv = block_mask_tables(block_mask)
    call = runtime_fp8_call(q, k, v, tables, plan.score_bufs, plan.mask_bufs, scale, sparse_q,
                            sparse_kv, recipe, rope)
    return plan.spec, call


def _plan(q: Tensor, k: Tensor, v: Tensor, score_mod: Optional[Callable],
          mask_mod: Optional[Callable], block_mask: Any) -> Any:
    """direct.py's cached plan of the site with FP8 on; raises when no FP8 kernel serves it."""
    plan = cached_plan(q, k, v, score_mod, mask_mod, block_mask, "auto", fp8=True)
    if plan.spec is None:
        raise FP8Unserved(f"flex(fp8=...): no FP8 kernel serves this call ({plan.reason}); "
                          "rewrite the mods with supported ops, or drop fp8= to run it in "
                          "bf16/fp16")
    return plan
