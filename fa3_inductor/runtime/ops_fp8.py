"""``torch.ops.fa3_inductor.flex_fwd_fp8``: the op Inductor's output code calls for an FP8 site
(``options={"fa3.fp8": ...}``, lowering/flex_lowering.py): the FP8 prologue on q, k, v, then the
site's families (templates/registry.py: the fp8 family; torch's dense kernel on the dequantized
operands as the last resort). Inference only: no autograd (the backend refuses training graphs).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Optional

import torch
from torch import Tensor

from ..fp8_recipe import FP8Recipe
from ..templates.family import Call
from ..templates.fp8_prologue.host import quantize
from .spec import SiteSpec

_LIB = torch.library.Library("fa3_inductor", "FRAGMENT")
_LIB.define(
    "flex_fwd_fp8(Tensor q, Tensor k, Tensor v, Tensor? kv_num_blocks, Tensor? kv_indices, "
    "Tensor? full_kv_num_blocks, Tensor? full_kv_indices, Tensor[] score_bufs, "
    "Tensor[] mask_bufs, float scale, int sparse_q_block, int sparse_kv_block, str spec, "
    "str recipe) -> (Tensor, Tensor, Tensor)")


def recipe_text(recipe: FP8Recipe) -> str:
    """The recipe as the op's string argument (the output code carries it as a literal).

    Example::

        >>> recipe_of(recipe_text(FP8Recipe(smooth_k=True))).smooth_k
        True
    """
    return json.dumps(dataclasses.asdict(recipe), sort_keys=True)


@functools.lru_cache(maxsize=64)
def recipe_of(text: str) -> FP8Recipe:
    """The recipe :func:`recipe_text` wrote."""
    return FP8Recipe(**json.loads(text))


def flex_fwd_fp8(q: Tensor, k: Tensor, v: Tensor, kv_num_blocks: Optional[Tensor],
                 kv_indices: Optional[Tensor], full_kv_num_blocks: Optional[Tensor],
                 full_kv_indices: Optional[Tensor], score_bufs: list[Tensor], mask_bufs: list[Tensor],
                 scale: float, sparse_q_block: int, sparse_kv_block: int, spec: str,
                 recipe: str) -> tuple[Tensor, Tensor, Tensor]:
    """(out, lse_log2, max_log2) of FP8 attention, as ``flex_fwd`` returns them (the row max is not
    computed: FP8 sites are planned with needs_max=False, and its buffer is left empty).

    Example::

        >>> out, lse, mx = torch.ops.fa3_inductor.flex_fwd_fp8(q, k, v, None, None, None, None,
        ...     [], [], 0.125, 128, 128, spec, recipe_text(FP8Recipe()))   # doctest: +SKIP
    """
    from .ops import _out_like, record_template, serve

    Z, H, M, _ = q.shape
    out = _out_like(q, v)
    lse = q.new_empty((Z, H, M), dtype=torch.float32)
    max_scores = q.new_empty((Z, H, M), dtype=torch.float32)
    ops = quantize(q, k, v, recipe_of(recipe))
    call = Call(ops.q, ops.k, ops.vt, out, lse, max_scores,
                (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices),
                tuple(score_bufs), tuple(mask_bufs), scale, sparse_q_block, sparse_kv_block,
                needs_max=False, fp8=ops)
    record_template(serve(SiteSpec.from_json(spec), call))
    return out, lse, max_scores


_LIB.impl("flex_fwd_fp8", flex_fwd_fp8, "CUDA")
_LIB.impl("flex_fwd_fp8", flex_fwd_fp8, "CPU")


@torch.library.register_fake("fa3_inductor::flex_fwd_fp8", lib=_LIB)
def _flex_fwd_fp8_fake(q, k, v, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                       score_bufs, mask_bufs, scale, sparse_q_block, sparse_kv_block, spec, recipe):
    from .ops import _out_like

    Z, H, M, _ = q.shape
    return (_out_like(q, v), q.new_empty((Z, H, M), dtype=torch.float32),
            q.new_empty((Z, H, M), dtype=torch.float32))
