"""Read a node of Dynamo's graph as a named torch operation, whatever spelling made it.

Dynamo keeps the user's spelling: ``a + b`` is ``operator.add``, ``torch.add(a, b)`` is
``torch.add`` and ``a.add(b)`` is the method ``"add"``. Recognition wants one name per
operation; this module gives it, for the torch and operator callables only (anything else,
e.g. a user function Dynamo left as a call, has no name and is never matched).

Example::

    >>> op_name(node)                 # doctest: +SKIP
    'matmul'
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx
import torch.nn.functional as F

_OPERATORS = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
    operator.floordiv: "floor_divide", operator.mod: "remainder", operator.neg: "neg",
    operator.invert: "bitwise_not", operator.and_: "bitwise_and", operator.or_: "bitwise_or",
    operator.xor: "bitwise_xor", operator.lt: "lt", operator.le: "le", operator.gt: "gt",
    operator.ge: "ge", operator.eq: "eq", operator.ne: "ne", operator.getitem: "getitem",
    operator.matmul: "matmul", operator.pow: "pow", operator.pos: "positive",
    getattr: "getattr", operator.iadd: "add", operator.imul: "mul", operator.itruediv: "div",
    operator.isub: "sub",
}
# Method and function names that spell the same operation.
_ALIASES = {
    "true_divide": "div", "divide": "div", "multiply": "mul", "subtract": "sub",
    "__and__": "bitwise_and", "__or__": "bitwise_or", "__invert__": "bitwise_not",
    "logical_not": "bitwise_not_bool", "greater_equal": "ge", "greater": "gt",
    "less_equal": "le", "less": "lt", "not_equal": "ne", "__getitem__": "getitem",
    "clip": "clamp", "absolute": "abs", "negative": "neg",
}
_NAMESPACES = (torch, F, torch._C._nn, torch.special, torch.linalg)


def op_name(node: Any) -> Optional[str]:
    """The canonical name of a call node's torch/operator target, else None.

    Example::

        >>> op_name(graph_node_of("a / b"))    # doctest: +SKIP
        'div'
    """
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "call_method":
        return _ALIASES.get(node.target, node.target)
    if node.op != "call_function":
        return None
    target = node.target
    if target in _OPERATORS:
        return _OPERATORS[target]
    name = getattr(target, "__name__", None)
    if name is None:
        return None
    if any(getattr(ns, name, None) is target for ns in _NAMESPACES):
        return _ALIASES.get(name, name)
    return None


def arg(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``index`` (positional) or ``name`` (keyword) of a call node.

    Example::

        >>> arg(softmax_node, 1, "dim")    # doctest: +SKIP
        -1
    """
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def example(node: Any) -> Optional[torch.Tensor]:
    """The example (fake) tensor Dynamo recorded for a node, or None.

    Example::

        >>> example(q_node).shape    # doctest: +SKIP
        torch.Size([2, 4, 64, 16])
    """
    if isinstance(node, torch.fx.Node):
        val = node.meta.get("example_value")
        return val if isinstance(val, torch.Tensor) else None
    return None


def static_shape(node: Any) -> Optional[tuple[int, ...]]:
    """The node's shape as Python ints, or None if it is not a tensor or a size is symbolic.

    Example::

        >>> static_shape(q_node)    # doctest: +SKIP
        (2, 4, 64, 16)
    """
    t = example(node)
    if t is None:
        return None
    out = []
    for s in t.shape:
        if not isinstance(s, int):
            return None
        out.append(s)
    return tuple(out)
