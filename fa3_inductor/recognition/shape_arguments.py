"""Recognition pre-pass: ``x.reshape_as(y)`` / ``x.view_as(y)`` become ``x.reshape(*shape)`` / ``x.view(*shape)``.

``y`` gives only its shape. When ``y`` is the attention scores, the lifter (lift.py) otherwise sees a
node computed from the scores that is no elementwise operation, and refuses the site: SAM's and
PP-FormulaNet's ``decomposed_rel_pos.reshape_as(attn_weights)`` (a bias computed from the queries,
shaped like the scores) left 6 sites of the GPU coverage table alone. Spelled with the static shape,
the bias is one more captured tensor. Only static shapes are spelled out (Dynamo's graphs here are
static-shape ones); the value is the same tensor, so the rewrite is exact.

Example::

    >>> canonicalize_shape_arguments(gm)   # doctest: +SKIP
    1
"""

from __future__ import annotations

import torch
import torch.fx

from .fx_ops import op_name, static_shape

_SPELLED = {"reshape_as": "reshape", "view_as": "view"}


def canonicalize_shape_arguments(gm: torch.fx.GraphModule) -> int:
    """Spell every ``reshape_as`` / ``view_as`` of ``gm`` whose shape is static as ``reshape`` /
    ``view``; returns how many.

    Example::

        >>> canonicalize_shape_arguments(gm)   # doctest: +SKIP
        1
    """
    count = 0
    for node in gm.graph.nodes:
        name = op_name(node)
        if name not in _SPELLED or len(node.args) != 2 or node.kwargs:
            continue
        source, other = node.args
        shape = static_shape(other)
        if not isinstance(source, torch.fx.Node) or shape is None:
            continue
        node.op, node.target, node.args = "call_method", _SPELLED[name], (source, *shape)
        count += 1
    if count:
        gm.recompile()
    return count
