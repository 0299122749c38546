"""Our lowering of the flex_attention op: the canonical form every front door produces.

Installed as a wrapper around Inductor's own lowering in ``lowerings[flex_attention]``. It
acts while the fa3 backend compiles (its marker pass is in Inductor's config), and under any
other Inductor compile on the ops that ``fa3_inductor.flex()`` traced (their kernel_options say
so: ``common.lowering_settings``); otherwise it calls the original untouched. When it acts it either

- generates the mods (templates/modgen.py), picks a template, and emits one extern call to
  ``torch.ops.fa3_inductor.flex_fwd`` (runtime/ops.py), or
- hands the site to torch's lowering, recording why (unsupported mod, head dim, device...).

Backward: flex_backward_lowering.py (registration.py installs both). It plans each site against
our backward families (the generic Triton backward on any GPU and on the CPU under Triton's
interpreter, learnable tables' gradients included), which read our (out, lse) in the op's
conventions (LSE in log2 units); a site none serves keeps torch's flex backward kernel on CUDA
and our dense-recompute op on the CPU.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch

from .. import _compat
from ..config import Settings
from ..runtime.ops_fp8 import recipe_text  # also defines fa3_inductor::flex_fwd_fp8
from ..runtime.spec import SiteSpec
from ..templates.modgen import ModInfo, UnsupportedMod, describe_mod_source
from ..report import LoweredSite, record_site, site_tag
from . import sinks_fusion
from .common import buffer_specs, lowering_settings, realize_buffers, site_shape, torch_kernel_options
from .site_plan import plan_site, unserved

_FLEX_OP = torch.ops.higher_order.flex_attention
_original_lowering: Optional[Any] = None

def install() -> None:
    """Wrap Inductor's flex_attention lowering (idempotent). The backend installs it together
    with the backward's, from registration.install().

    Example::

        >>> from fa3_inductor.lowering import flex_lowering; flex_lowering.install()
    """
    global _original_lowering
    replaced = _compat.wrap_lowering(_FLEX_OP, _fa3_flex_lowering)
    if replaced is not None:
        _original_lowering = replaced
    sinks_fusion.install()   # a site's attention sinks fold into its kernel (sinks_fusion.py)


def _plan(query, key, value, subgraph, bm: _compat.FlexBlockMask, score_bufs, mask_bufs,
          settings: Settings, needs_max: bool = True, sinks: bool = False
          ) -> tuple[Optional[SiteSpec], Optional[str], str]:
    """Decide how to serve one site: (spec, None, shape) or (None, reason, shape). ``sinks``: the
    kernel is to add the site's attention sinks (sinks_fusion.py)."""
    from torch._inductor.virtualized import V

    sizevars = V.graph.sizevars
    dtype = query.get_dtype()
    device = query.get_device()
    shape = site_shape(query, key, value)
    if settings.template == "torch":
        return None, "option fa3.template='torch'", shape
    # Batch and sequence lengths may stay symbolic (the kernel takes them at run time);
    # head counts, head dims and block-mask block sizes specialize the kernel (torch's
    # lowering guards on the block sizes too).
    hq, hkv, d, dv = (sizevars.guard_int(x) for x in (
        query.get_size()[1], key.get_size()[1], query.get_size()[-1], value.get_size()[-1]))
    reason = unserved(device, dtype, d, dv)
    if reason is not None:
        return None, reason, shape
    bq, bkv = query.get_size()[0], key.get_size()[0]
    batches_match = (sizevars.statically_known_equals(bq, bkv)
                     or sizevars.statically_known_equals(bkv, 1))
    sparse = tuple(sizevars.guard_int(x) for x in (bm.sparse_q_block, bm.sparse_kv_block))
    score_specs, mask_specs = buffer_specs(score_bufs), buffer_specs(mask_bufs)
    try:
        spec, reason = plan_site(
            subgraph.graph_module, bm.mask_graph.graph_module, score_specs, mask_specs,
            device=device, dtype=dtype, q_heads=hq, kv_heads=hkv, head_dim=d,
            value_head_dim=dv, batches_match=batches_match, sparse_blocks=sparse,
            settings=settings, description=shape, needs_max=needs_max and not _fp8(settings, dtype),
            fp8=_fp8(settings, dtype), query_len=_static_len(query.get_size()[2]), sinks=sinks)
    except UnsupportedMod as exc:
        return None, f"mod not lowerable: {exc}", shape
    return spec, reason, shape


def _static_len(size) -> Optional[int]:
    """A length known at compile time, None when symbolic (the decode family needs it)."""
    try:
        return int(size)
    except TypeError:
        return None


def _fp8(settings: Settings, dtype: torch.dtype) -> bool:
    """Whether a site of ``dtype`` runs FP8: option fa3.fp8 on, inputs bf16 or fp16 (the prologue's)."""
    return settings.fp8 is not None and dtype in (torch.float16, torch.bfloat16)


def unserved_reason(example_query: torch.Tensor,
                    example_value: Optional[torch.Tensor] = None) -> Optional[str]:
    """Why our kernels would not serve attention on this (example) query and value, or None.
    The value's head dim (the output's) may differ from the query's; without an example value
    it is taken to be the query's.

    Recognition asks before rewriting: a site our lowering would hand back to torch's flex
    kernel is better left as the user wrote it.

    Example::

        >>> unserved_reason(torch.empty(1, 2, 64, 192), torch.empty(1, 2, 64, 12))  # doctest: +SKIP
        'value head dim 12 (fa3 serves multiples of 8 from 16 to 256)'
    """
    q = example_query
    dv = None if example_value is None else int(example_value.shape[-1])
    return unserved(q.device, q.dtype, int(q.shape[-1]), dv)


def _fresh_4d_buffer(x):
    """Copy into its own 4-D buffer. torch 2.13's CPU flex lowering reads the layout of the
    buffer under a view: q/k/v made by ``linear(x).view(B, S, H, D).transpose(1, 2)`` crash it
    ("not enough values to unpack (expected 4, got 2)"), under backend="inductor" too."""
    from torch._inductor import lowering

    x = lowering.clone(x)
    x.realize()
    return x


def _fa3_flex_lowering(query, key, value, subgraph, block_mask, scale, kernel_options,
                       score_mod_other_buffers, mask_mod_other_buffers):
    settings = lowering_settings(kernel_options)
    kernel_options = torch_kernel_options(kernel_options)
    if settings is None:
        return _original_lowering(query, key, value, subgraph, block_mask, scale,
                                  kernel_options, score_mod_other_buffers,
                                  mask_mod_other_buffers)
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    bm = _compat.unpack_block_mask(block_mask)
    node = getattr(V.graph, "current_node", None)
    tag = site_tag(node)  # links to a RecognizedSite
    # attention sinks right after the op: added in the kernel's epilogue (not by the FP8 kernels)
    absorbed = None if _fp8(settings, query.get_dtype()) else sinks_fusion.absorbable(node)
    spec, reason, shape = _plan(query, key, value, subgraph, bm, score_mod_other_buffers,
                                mask_mod_other_buffers, settings, _max_scores_read(node),
                                sinks=absorbed is not None)
    if spec is None:
        record_site(LoweredSite("torch", "?", "?", shape, reason, site_id=tag))
        if query.get_device().type == "cpu":
            query, key, value = (_fresh_4d_buffer(x) for x in (query, key, value))
        return _original_lowering(query, key, value, subgraph, block_mask, scale,
                                  kernel_options, score_mod_other_buffers,
                                  mask_mod_other_buffers)
    score_source, mask_source = spec.planned_sources()
    record_site(LoweredSite(spec.template, describe_mod_source(score_source, ModInfo.from_items(spec.score_info)),
                            describe_mod_source(mask_source, ModInfo.from_items(spec.mask_info)), shape,
                            site_id=tag, note="; ".join(filter(None, (
                                spec.note, absorbed and "attention sinks added in the kernel's epilogue")))))
    q, k, v = (ir.ExternKernel.require_stride1(ir.ExternKernel.realize_input(x))
               for x in (query, key, value))
    score_bufs = realize_buffers(score_mod_other_buffers)
    mask_bufs = realize_buffers(mask_mod_other_buffers)
    sizevars = V.graph.sizevars
    sparse_q, sparse_kv = (sizevars.guard_int(bm.sparse_q_block),
                           sizevars.guard_int(bm.sparse_kv_block))
    tables = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
    if _is_no_mask(spec, sparse_q, sparse_kv):
        # torch's "no mask" (one block of 2**30 covering everything, mask_mod always true):
        # the kernel's dense path is the same attention, and the tables' in-graph
        # construction (a few tiny kernels per call) is then dead code Inductor removes.
        tables = (None, None, None, None)
    if _fp8(settings, query.get_dtype()):   # planned FP8: the prologue runs inside the op
        call = _compat.fallback_kernel(torch.ops.fa3_inductor.flex_fwd_fp8.default)
        out, lse, max_scores = call(
            q, k, v, *tables, score_bufs, mask_bufs, float(scale), sparse_q, sparse_kv,
            spec.to_json(), recipe_text(settings.fp8))
    else:
        sinks = None
        if absorbed is not None:
            sinks = ir.ExternKernel.require_contiguous(V.graph.env[absorbed[1]])
            sinks_fusion.mark_absorbed(absorbed[0])
        call = _compat.fallback_kernel(torch.ops.fa3_inductor.flex_fwd.default)
        out, lse, max_scores = call(
            q, k, v, *tables, score_bufs, mask_bufs, float(scale), sparse_q, sparse_kv,
            spec.to_json(), sinks)
    if _compat.flex_op_returns_max_scores():
        return out, lse, max_scores
    return out, lse


def _max_scores_read(node) -> bool:
    """Whether the graph reads the op's max_scores output (index 2); True when unsure."""
    if not _compat.flex_op_returns_max_scores():
        return False
    if node is None:
        return True
    for user in node.users:
        if user.target is not operator.getitem:
            return True  # used whole: assume read
        if user.args[1] == 2 and user.users:
            return True
    return False


def _is_no_mask(spec: SiteSpec, sparse_q: int, sparse_kv: int) -> bool:
    """torch's "no mask": an always-true mask_mod over blocks of 2**30 (one block covers any
    sequence; torch lists it, so every key is visible)."""
    return spec.planned_sources()[1] is None and sparse_q >= (1 << 30) and sparse_kv >= (1 << 30)


_fa3_flex_lowering._fa3_wrapper = True  # type: ignore[attr-defined]
