"""Captured tensors that require grad but that the score_mod does not differentiate through.

``s.masked_fill(pad(param) > 0.5, -inf)`` (or a flex score_mod reading ``param[kv] > 0.5``)
captures a float tensor that requires grad, and reaches the score only through a comparison. Its
gradient through the mod is nothing: torch's flex backward returns None for it, while AOT
autograd's backward graph, traced from the op's fake implementation, expects a tensor there, and
Inductor's lowering raised ``'NoneType' object has no attribute 'get_size'`` at the first
backward, outside any fallback. Reading such a buffer through ``detach`` before the
flex_attention node makes its gradient None in the graph too: the same as eager, whose
``param.grad`` stays None.

Which buffers: decided exactly by autograd on one element, the score_mod graph run on a 0-dim
score, 0-dim indices and zero buffers of the captured tensors' shapes.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.fx

from .._log import log
from .fx_ops import buffer_example
from .recognize_flex import flex_nodes

_SCORE_BUFFERS = 7   # flex_attention(q, k, v, score_mod, block_mask, scale, options, score_bufs, ..)


def gradless_buffers(score_mod: torch.fx.GraphModule,
                     examples: Sequence[Optional[torch.Tensor]]) -> set[int]:
    """Indices of the captured tensors that require grad and that ``score_mod`` (a graph
    ``score, b, h, q_idx, kv_idx, *buffers -> score``) does not differentiate through.

    Example::

        >>> import torch.fx
        >>> def mod(score, b, h, q_idx, kv_idx, table):
        ...     return torch.where(table[kv_idx] > 0.5, score, float("-inf"))
        >>> param = torch.rand(8, requires_grad=True)
        >>> gradless_buffers(torch.fx.symbolic_trace(mod), [param])
        {0}
    """
    wants = [i for i, e in enumerate(examples)
             if isinstance(e, torch.Tensor) and e.requires_grad and e.is_floating_point()]
    if not wants or any(e is None for e in examples):   # undecided: gradients kept
        return set()
    with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.enable_grad():
        score = torch.zeros((), requires_grad=True)
        index = [torch.zeros((), dtype=torch.int32) for _ in range(4)]
        bufs = [torch.zeros(e.shape, dtype=e.dtype, requires_grad=i in wants)
                for i, e in enumerate(examples)]
        try:
            value = score_mod.forward(score, *index, *bufs)   # (FX's __call__ prints failures)
        except Exception as exc:  # noqa: BLE001 - undecided: every buffer keeps its gradient
            log.debug("fa3_inductor: score_mod not evaluated for its buffers' gradients: %s", exc)
            return set()
        if isinstance(value, (tuple, list)):
            value = value[0]
        if not isinstance(value, torch.Tensor) or not value.requires_grad:
            return set(wants)
        grads = torch.autograd.grad(value, [bufs[i] for i in wants], allow_unused=True)
    return {i for i, g in zip(wants, grads) if g is None}


def detach_gradless_buffers(gm: torch.fx.GraphModule) -> bool:
    """Read each flex_attention node's gradless captured tensors (:func:`gradless_buffers`)
    through ``detach``. Returns whether the graph changed.

    Example::

        >>> changed = detach_gradless_buffers(gm)   # doctest: +SKIP
    """
    changed = False
    for node in flex_nodes(gm):
        if len(node.args) <= _SCORE_BUFFERS or not node.args[_SCORE_BUFFERS]:
            continue
        mod_node = node.args[3]
        if not (isinstance(mod_node, torch.fx.Node) and mod_node.op == "get_attr"):
            continue
        score_mod = gm.get_submodule(mod_node.target)
        buffers = list(node.args[_SCORE_BUFFERS])
        gone = gradless_buffers(score_mod, [buffer_example(b) for b in buffers])
        if not gone:
            continue
        with gm.graph.inserting_before(node):
            for i in gone:
                detached = gm.graph.call_method("detach", (buffers[i],))
                detached.meta.update({k: v.detach() for k, v in buffers[i].meta.items()
                                      if k in ("example_value", "val")
                                      and isinstance(v, torch.Tensor)})
                buffers[i] = detached
        args = list(node.args)
        args[_SCORE_BUFFERS] = tuple(buffers)
        node.args = tuple(args)
        changed = True
    if changed:
        gm.recompile()
    return changed
