"""Our lowering of the flex_attention_backward op (training through every fused attention).

Installed as a wrapper around Inductor's own lowering in ``lowerings[flex_attention_backward]``,
gated like the forward wrapper (flex_lowering.py): it acts only while the fa3 backend compiles;
under any other backend it calls the original untouched. When it acts:

- CUDA: torch's Triton backward kernel serves the site (it reads our forward's out and LSE,
  which follow the op's conventions); the decision is logged and recorded.
- CPU: Inductor has no flex backward there, so the site becomes one extern call to
  ``torch.ops.fa3_inductor.flex_bwd`` (runtime/backward_cpu.py), a dense float32 recompute
  under autograd. The score_mod / mask_mod travel as torch-dialect source in its spec string
  (templates/modgen_torch.py), so an FX-cache-served graph rebuilds them in a fresh process.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import _compat
from ..runtime.backward_cpu import BackwardSpec
from ..templates.modgen import UnsupportedMod, is_constant_true_mask, is_identity_score
from ..templates.modgen_torch import generate_torch_mod_source, torch_buffer_specs
from ..report import LoweredBackwardSite, record_backward_site as _record
from .common import active_pass, site_shape

_BWD_OP = torch.ops.higher_order.flex_attention_backward
_original_lowering: Optional[Any] = None


def install() -> None:
    """Wrap Inductor's flex_attention_backward lowering (idempotent).

    Example::

        >>> from fa3_inductor.lowering import flex_backward_lowering
        >>> flex_backward_lowering.install()
    """
    global _original_lowering
    replaced = _compat.wrap_lowering(_BWD_OP, _fa3_flex_backward_lowering)
    if replaced is not None:
        _original_lowering = replaced


def _buffer_dtypes(buffers) -> list[Optional[torch.dtype]]:
    from torch._inductor import ir

    return [b.get_dtype() if isinstance(b, ir.IRNode) else None for b in buffers]


def _torch_sources(a: _compat.FlexBackwardArgs, bm: _compat.FlexBlockMask
                   ) -> tuple[Optional[str], Optional[str]]:
    """(score_mod, mask_mod) as torch-dialect source; None for the identity / all-true mod."""
    score_gm = a.fw_graph.graph_module
    mask_gm = bm.mask_graph.graph_module
    score = None if is_identity_score(score_gm) else generate_torch_mod_source(
        score_gm, "score", torch_buffer_specs(_buffer_dtypes(a.score_mod_other_buffers)))
    mask = None if is_constant_true_mask(mask_gm) else generate_torch_mod_source(
        mask_gm, "mask", torch_buffer_specs(_buffer_dtypes(a.mask_mod_other_buffers)))
    return score, mask


def _lower_on_cpu(a: _compat.FlexBackwardArgs, shape: str):
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    bm = _compat.unpack_block_mask(a.block_mask)
    try:
        score_src, mask_src = _torch_sources(a, bm)
    except UnsupportedMod as exc:
        raise NotImplementedError(
            f"fa3_inductor: cannot run flex attention backward on the CPU for {shape}: {exc}. "
            "Rewrite the mod with supported ops (see fa3_inductor/templates/modgen.py), or "
            "train on a CUDA device, where torch's flex backward kernel runs.") from exc
    buffers = list(a.score_mod_other_buffers)
    is_tensor = [isinstance(b, ir.IRNode) for b in buffers]
    needs = _compat.joint_graph_buffer_grads(a.joint_graph.graph_module, len(buffers))
    tensor_grads = tuple(n for n, t in zip(needs, is_tensor) if t)
    spec = BackwardSpec(score_source=score_src, mask_source=mask_src,
                        buffer_grads=tensor_grads, description=shape)

    def realized(x):
        return None if x is None else ir.ExternKernel.realize_input(x)

    score_bufs = [ir.ExternKernel.require_contiguous(b) for b, t in zip(buffers, is_tensor) if t]
    mask_bufs = [ir.ExternKernel.require_contiguous(b) for b in a.mask_mod_other_buffers
                 if isinstance(b, ir.IRNode)]
    sizevars = V.graph.sizevars
    call = _compat.fallback_kernel(torch.ops.fa3_inductor.flex_bwd.default)
    dq, dk, dv, dbufs = call(
        realized(a.query), realized(a.key), realized(a.value), realized(a.grad_out),
        realized(a.grad_logsumexp), bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks,
        bm.full_kv_indices, score_bufs, mask_bufs, float(a.scale),
        sizevars.guard_int(bm.sparse_q_block), sizevars.guard_int(bm.sparse_kv_block),
        spec.to_json())
    grads = iter(dbufs)
    captured = tuple(next(grads) if t and n else None for t, n in zip(is_tensor, needs))
    _record(LoweredBackwardSite("fa3_inductor.flex_bwd", shape, len(dbufs),
                                "CPU: dense float32 recompute (Inductor has no CPU flex "
                                "backward)"))
    return dq, dk, dv, captured


def _fa3_flex_backward_lowering(*args, **kwargs):
    if active_pass() is None:
        return _original_lowering(*args, **kwargs)
    # q, k, v first on every version; the rest is read on the CPU only
    query, key, value = args[0], args[1], args[2]
    shape = site_shape(query, key, value)
    device = query.get_device().type
    if device == "cpu":
        return _lower_on_cpu(_compat.unpack_flex_backward_args(args, kwargs), shape)
    _record(LoweredBackwardSite("torch", shape, None, f"{device}: torch's flex backward kernel "
                                "(reads our forward's out and log2 LSE)"))
    return _original_lowering(*args, **kwargs)


_fa3_flex_backward_lowering._fa3_wrapper = True  # type: ignore[attr-defined]
