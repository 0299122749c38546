"""Every torch/triton version switch of the package lives here.

The GPU machines run torch 2.11 + triton 3.6, CI runs torch 2.13 (FACTS.md, "Torch internals
that move between 2.11 and 2.13"). Code elsewhere calls these helpers instead of testing
versions itself.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple

import torch

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


class FlexBlockMask(NamedTuple):
    """The parts of the flex_attention op's block-mask tuple that the forward kernels read.

    torch 2.11 passes 13 entries, 2.13 passes 17 (backward-only schedules were added); both
    start with (q_len, kv_len, kv_num_blocks, kv_indices, full_kv_num_blocks,
    full_kv_indices) and end with (SPARSE_Q_BLOCK_SIZE, SPARSE_KV_BLOCK_SIZE, mask_graph).
    """

    kv_num_blocks: Any
    kv_indices: Any
    full_kv_num_blocks: Any
    full_kv_indices: Any
    sparse_q_block: Any
    sparse_kv_block: Any
    mask_graph: Any


def unpack_block_mask(block_mask: tuple) -> FlexBlockMask:
    """Read the flex_attention op's block-mask tuple, whatever the torch version.

    Example::

        >>> bm = unpack_block_mask(create_block_mask(causal, 1, 1, 256, 256).as_tuple())  # doctest: +SKIP
    """
    if len(block_mask) not in (13, 17):
        raise RuntimeError(
            f"fa3_inductor: flex_attention block-mask tuple has {len(block_mask)} entries; "
            "this torch version is not supported (expected 13 as in torch 2.11 or 17 as in "
            "2.13). Pin torch 2.11-2.13 or report the version.")
    return FlexBlockMask(*block_mask[2:6], *block_mask[-3:])


@functools.cache
def flex_op_returns_max_scores() -> bool:
    """Whether torch.ops.higher_order.flex_attention returns (out, lse, max_scores)."""
    import importlib

    module = importlib.import_module("torch._higher_order_ops.flex_attention")
    src = inspect.getsource(module.flex_attention_fake_impl)
    return "max_scores" in src


def flex_attention_with_lse(q, k, v, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's flex_attention returning (out, lse) on every supported version."""
    from torch.nn.attention import flex_attention as fa

    if hasattr(fa, "AuxRequest"):
        out, aux = fa.flex_attention(q, k, v, return_aux=fa.AuxRequest(lse=True), **kwargs)
        return out, aux.lse
    return fa.flex_attention(q, k, v, return_lse=True, **kwargs)


def inductor_lowerings() -> dict:
    """Inductor's lowering table, with the flex_attention lowering already registered."""
    import torch._inductor.kernel.flex.flex_attention  # noqa: F401  (registers the lowering)
    from torch._inductor import lowering

    return lowering.lowerings


def fallback_kernel(op) -> Any:
    """A lowering that calls ``op`` as an opaque extern kernel in Inductor's output code."""
    from torch._inductor.lowering import fallback_handler

    return fallback_handler(op, add_to_fallback_set=False)


def current_fx_node():
    """The FX node Inductor is lowering right now (or None)."""
    from torch._inductor.virtualized import V

    try:
        return V.graph.current_node
    except Exception:  # no graph being lowered
        return None


def getitem_as_index():
    """Context in which ``tensor[i]`` with 0-d tensor indices traces as ``aten.index``
    (how FlexAttention traces mods)."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    return TransformGetItemToIndex()


def flex_kernel_options(q, k, v) -> dict:
    """The kernel_options dict torch's flex_attention passes its op (internal keys included)."""
    from torch.nn.attention import flex_attention as fa

    return fa._apply_kernel_options(q, k, v, False, None)
