"""Recognition pre-pass: attention scores written with ``baddbmm`` become ``bmm`` + scale + bias.

``torch.baddbmm(input, q, kᵀ, beta=β, alpha=α)`` is ``β·input + α·(q @ kᵀ)``, and with β = 0 the
input is not read at all (NaN and inf in it do not propagate; diffusers passes ``torch.empty``).
Two families write their scores this way: diffusers' classic ``AttnProcessor`` (empty input, β 0,
α the scale) and BLOOM/Falcon (the ALiBi bias as input, β 1, α 1/√d). Spelled out as
``bmm`` (the score product recognize_manual.py anchors on), ``* α`` (a constant scale it folds)
and ``+ β·input`` (a bias it lifts into the score_mod), the site is recognized like any other;
the spelling is the same arithmetic, so the rewrite stays exact. Only a ``baddbmm`` whose result
reaches a softmax is spelled out, with constant β and α.

Example::

    >>> canonicalize_baddbmm(gm)   # doctest: +SKIP
    1
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from .fx_ops import arg, call_node, op_name

_HOPS = 6   # ops between the scores and the softmax (views, casts, bias and mask layers)


def canonicalize_baddbmm(gm: torch.fx.GraphModule) -> int:
    """Spell out every ``baddbmm`` of ``gm`` that feeds a softmax; returns how many.

    Example::

        >>> canonicalize_baddbmm(gm)   # doctest: +SKIP
        1
    """
    count = 0
    for node in list(gm.graph.nodes):
        if op_name(node) != "baddbmm" or not _feeds_softmax(node):
            continue
        bias, b1, b2 = arg(node, 0, "input"), arg(node, 1, "batch1"), arg(node, 2, "batch2")
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        if not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in (beta, alpha)) \
                or not all(isinstance(t, torch.fx.Node) for t in (bias, b1, b2)):
            continue
        graph = gm.graph
        with graph.inserting_before(node):
            out = _node(graph, torch.bmm, (b1, b2))
            if alpha != 1:
                out = _node(graph, operator.mul, (out, alpha))
            if beta != 0:
                term = bias if beta == 1 else _node(graph, operator.mul, (bias, beta))
                out = _node(graph, operator.add, (out, term))
        out.meta.update({k: v for k, v in node.meta.items() if k != "example_value"})
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _node(graph: torch.fx.Graph, target: Any, args: tuple) -> torch.fx.Node:
    return call_node(graph, "call_function", target, args)


def _feeds_softmax(node: torch.fx.Node) -> bool:
    frontier = [node]
    for _ in range(_HOPS):
        frontier = [u for n in frontier for u in n.users]
        if any(op_name(u) in ("softmax", "_softmax") for u in frontier):
            return True
    return False
