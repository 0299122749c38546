"""`fa3_inductor.flex(..., fp8=...)`: FP8 attention for inference, without torch.compile.

One call runs the FP8 prologue (templates/fp8_prologue/: RoPE, Hadamard rotation, block
quantization, Vᵀ) and then the first kernel family that serves an FP8 site (templates/registry.py:
the ``fp8`` family; torch's dense kernel on the dequantized inputs as the last resort). The site is
planned once per (what the mods compute, shapes' kind, device), as the bf16 direct path does
(direct.py).

FP8 is inference-only: backward through it raises (api.flex checks before coming here).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import Tensor

from .direct import block_mask_tables, cached_plan
from .fp8_recipe import FP8Recipe, RopeSpec
from .runtime.ops_fp8 import fp8_call as runtime_fp8_call
from .runtime.ops_fp8 import serve_fp8
from .runtime.spec import SiteSpec
from .templates.family import Call

_LN2 = 0.6931471805599453


class FP8Unserved(RuntimeError):
    """No FP8 kernel can run this call; the message says why and what to do."""


def forward_fp8(q: Tensor, k: Tensor, v: Tensor, score_mod: Optional[Callable], block_mask: Any,
                scale: float, recipe: FP8Recipe, rope: Optional[RopeSpec], want_lse: bool = True
                ) -> tuple[Tensor, Optional[Tensor]]:
    """(out in q's dtype, lse in natural-log units) of FP8 attention on ``q, k, v`` (bf16/fp16),
    quantized per ``recipe`` after ``rope``. Inputs are validated by the caller (api.flex).
    ``want_lse`` False: the LSE is not converted from the kernel's log2 units (one launch less)
    and None is returned in its place.

    Example::

        >>> out, lse = forward_fp8(q, k, v, None, None, 0.125, FP8Recipe(), None)   # doctest: +SKIP
        >>> forward_fp8(q, k, v, None, None, 0.125, FP8Recipe(), None, want_lse=False)[1] is None  # doctest: +SKIP
        True
    """
    spec, call = _planned_call(q, k, v, score_mod, block_mask, scale, recipe, rope)
    serve_fp8(spec, call)
    return call.out, call.lse.mul_(_LN2) if want_lse else None


def fp8_call(q: Tensor, k: Tensor, v: Tensor, score_mod: Optional[Callable], block_mask: Any,
             scale: float, recipe: FP8Recipe, rope: Optional[RopeSpec]) -> tuple[SiteSpec, Call]:
    """The planned FP8 site and its call: the prologue has run (``call.fp8``) and the outputs are
    allocated, not yet computed (``runtime.ops.serve(site, call)`` computes them; benchmarks time
    the kernel alone from here).

    Example::

        >>> site, call = fp8_call(q, k, v, None, None, 0.125, FP8Recipe(), None)   # doctest: +SKIP
        >>> site.families
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
