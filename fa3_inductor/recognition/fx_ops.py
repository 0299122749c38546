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
    if target is slice_assigned:
        return "slice_assigned"
    name = getattr(target, "__name__", None)
    if name is None:
        return None
    if any(getattr(ns, name, None) is target for ns in _NAMESPACES):
        return _ALIASES.get(name, name)
    return None


def slice_assigned(x: torch.Tensor, index: Any, value: Any) -> torch.Tensor:
    """``x`` with ``x[index] = value``, out of place: the form score_writes.py gives a slice
    assignment into the scores, so that the softmax's input is reached by data edges.

    Example::

        >>> slice_assigned(torch.zeros(2, 3), (slice(None), slice(1, None)), 1.0).tolist()
        [[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]]
    """
    out = x.clone()
    out[index] = value
    return out


def call_node(graph: torch.fx.Graph, op: str, target: Any, args: tuple,
              kwargs: Optional[dict] = None) -> torch.fx.Node:
    """A new ``call_function`` / ``call_method`` node (``op``) with its example value: the op
    run on its inputs' fake tensors (insert it where its inputs are defined).

    Example::

        >>> call_node(gm.graph, "call_method", "masked_fill", (s, m, -1e9))   # doctest: +SKIP
    """
    kwargs = kwargs or {}
    values, kw = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta.get("example_value"))
    fn = getattr(values[0], target) if op == "call_method" else target
    value = fn(*(values[1:] if op == "call_method" else values), **kw)
    node = graph.create_node(op, target, args, kwargs)
    node.meta["example_value"] = value
    return node


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


def buffer_example(node: Any) -> Optional[torch.Tensor]:
    """A captured buffer node's example: Dynamo's, or, for the nodes recognition puts between a
    buffer and the op (attention_site._buffer_nodes: ``.to(device)``, a ``reshape`` dropping
    size-1 dims), which carry none, a meta tensor of their shape, dtype and requires_grad, found
    through them; None if unknown.

    Example::

        >>> buffer_example(reshape_node).shape    # doctest: +SKIP
        torch.Size([2, 64])
    """
    made = example(node)
    if made is not None or not isinstance(node, torch.fx.Node):
        return made
    view_or_move = node.op == "call_method" and node.target in ("reshape", "to")
    if not view_or_move or not isinstance(node.args[0], torch.fx.Node) or any(
            isinstance(a, torch.dtype) for a in node.args):
        return None
    source = buffer_example(node.args[0])
    if source is None or node.target == "to":
        return source
    sizes = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) \
        else node.args[1:]
    if not all(isinstance(n, int) for n in sizes):
        return None
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        stand_in = torch.empty(tuple(sizes), dtype=source.dtype, device="meta")
    return stand_in.requires_grad_(source.requires_grad)


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


def constant_number(value: Any) -> Optional[float]:
    """A Python number, or a node that makes a 0-d tensor of a constant (``torch.tensor(c)``,
    ``torch.scalar_tensor(c)``, CPM-Ant's mask fills): that number; else None.

    Example::

        >>> constant_number(-1e9), constant_number("x") is None
        (-1000000000.0, True)
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if op_name(value) in ("scalar_tensor", "tensor") and value.args and \
            isinstance(value.args[0], (int, float)) and not isinstance(value.args[0], bool):
        return float(value.args[0])
    return None


# Ops whose result may share memory with their first argument.
_ALIASING = {"view", "reshape", "_unsafe_view", "getitem", "unsqueeze", "squeeze", "transpose",
             "permute", "expand", "expand_as", "narrow", "select", "flatten", "unflatten",
             "contiguous", "t", "view_as", "as_strided", "unfold", "diagonal", "movedim",
             "swapaxes", "split", "chunk", "unbind", "tensor_split", "detach", "alias",
             "broadcast_to", "mT", "T", "real", "imag", "view_as_real", "view_as_complex"}


# Casts that return their input itself when it has the dtype (and device) asked for already.
_CASTS_TO_SELF = {"to", "type", "type_as", "float", "half", "bfloat16", "double", "long", "int",
                  "bool"}

_IN_PLACE_OPERATORS = {
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
    operator.imatmul, operator.ilshift, operator.irshift}


def _is_in_place(user: torch.fx.Node, tensor: torch.fx.Node) -> bool:
    """``user`` writes into ``tensor`` (its first argument): ``x[i] = v``, ``x.add_(..)``,
    ``torch.relu_(x)``, ``out=x``."""
    if user.op not in ("call_function", "call_method"):
        return False
    if user.kwargs.get("out") is tensor:
        return True
    first = user.args[0] if user.args else None
    if first is not tensor:
        return False
    target = user.target
    if target in _IN_PLACE_OPERATORS:
        return True
    if target in _OPERATORS or getattr(target, "__module__", None) in ("_operator", "operator"):
        return False   # operator.and_, operator.or_: not in place despite the underscore
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def _aliases(node: torch.fx.Node, user: torch.fx.Node) -> bool:
    """``user`` is ``node``'s tensor or a view of it (an aliasing op, an in-place op on it, or
    a cast to the dtype and device it has: ``x.float()`` of a float32 x is x)."""
    if not user.args or user.args[0] is not node:
        return False
    name = op_name(user)
    if name in _CASTS_TO_SELF:
        a, b = example(node), example(user)
        return a is None or b is None or (a.dtype == b.dtype and a.device == b.device)
    return name in _ALIASING or (name == "getattr" and user.args[1] in ("mT", "T")) or \
        _is_in_place(user, node)


def alias_writes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The in-place ops that write into ``node``'s tensor: directly, through a view of it, or
    into the tensor it is a view of (``keep[1, :4] = False``, ``m.add_(x)``, ``m += x``).

    Example::

        >>> [w.target for w in alias_writes(keep_node)]   # doctest: +SKIP
        [<built-in function setitem>]
    """
    base = node
    for _ in range(64):   # up to the tensor the views (and in-place results) alias
        src = base.args[0] if base.args else None
        if isinstance(src, torch.fx.Node) and _aliases(src, base):
            base = src
            continue
        break
    return alias_closure(base)[1]


def alias_closure(base: torch.fx.Node) -> tuple[set[torch.fx.Node], list[torch.fx.Node]]:
    """The nodes aliasing ``base``'s tensor from ``base`` on (its views and in-place results,
    ``base`` included) and the in-place ops that write into them.

    Example::

        >>> aliases, writes = alias_closure(attn_node)   # attn[:, :, 1:] = x  # doctest: +SKIP
        >>> [w.target for w in writes]                                       # doctest: +SKIP
        [<built-in function setitem>]
    """
    aliases, writes, stack = set(), [], [base]
    while stack:
        n = stack.pop()
        if n in aliases:
            continue
        aliases.add(n)
        for user in n.users:
            if _is_in_place(user, n):
                writes.append(user)
            if _aliases(n, user):
                stack.append(user)
    return aliases, writes


def graph_positions(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    """Each node's index in the graph's order (program order)."""
    return {n: i for i, n in enumerate(graph.nodes)}


def mutated_in_place(node: torch.fx.Node) -> bool:
    """Whether the graph writes into ``node``'s tensor in place after making it (see
    :func:`alias_writes`): its op then does not tell its value everywhere it is read. An
    in-place op's own write (``y = x.add_(1)``: y) is not one after y.

    Example::

        >>> mutated_in_place(keep_node)   # keep[1, :4] = False later in the graph  # doctest: +SKIP
        True
    """
    writes = alias_writes(node)
    if not writes:
        return False
    pos = graph_positions(node.graph)
    return any(pos[w] > pos[node] for w in writes)


# -- aten-level graphs (AOT autograd, make_fx) and structural equality ----------------------------

def aten_name(node: Any) -> Optional[str]:
    """``"aten.<op>"`` / ``"prims.<op>"`` for a call of an aten or prims operator overload (the
    ops of a graph AOT autograd or make_fx traced), else None. :func:`op_name` names only the
    torch-function spelling Dynamo keeps; the two differ in argument conventions (``x[..., :8]``
    is ``getitem`` there, ``aten.slice(x, dim, start, end)`` here), so they are kept apart.

    Example::

        >>> aten_name(node_of("torch.ops.aten.mul.Tensor(a, b)"))    # doctest: +SKIP
        'aten.mul'
    """
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target.namespace in ("aten", "prims"):
        return f"{target.namespace}.{target.overloadpacket.__name__}"
    return None


def meta_value(node: Any) -> Any:
    """What tracing recorded for a node: Dynamo's ``example_value``, else make_fx's / AOT's
    ``val`` (a fake tensor, or a tuple of them for ops such as ``split``); None if neither.

    Example::

        >>> meta_value(aot_graph_node).shape    # doctest: +SKIP
        torch.Size([2, 4, 8, 16])
    """
    if not isinstance(node, torch.fx.Node):
        return None
    value = node.meta.get("example_value")
    return value if value is not None else node.meta.get("val")


# Ops whose result is not a function of their inputs: two calls never count as the same value.
_RANDOM_PARTS = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial", "poisson",
                 "exponential", "cauchy", "geometric", "seed")


def _is_pure_call(node: torch.fx.Node) -> bool:
    if node.op not in ("call_function", "call_method"):
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return not target._schema.is_mutable and \
            torch.Tag.nondeterministic_seeded not in target.tags
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if name.endswith("_") and not name.endswith("__"):      # in-place: x.mul_(...)
        return False
    return not any(part in name.lower() for part in _RANDOM_PARTS)


def same_value(a: Any, b: Any, _memo: Optional[dict] = None) -> bool:
    """True if ``a`` and ``b`` are provably the same value: the same node, or calls of the same
    pure op on arguments that are the same values (recursively), or equal constants. Graph
    inputs and attributes are the same only as the same node/attribute; random and in-place ops
    never match, nor two reads of a tensor the graph writes into in place, even of one node (the
    write may fall between them: :func:`mutated_in_place`). Used where a model computes one thing
    twice, e.g. ``cos[:, None]`` once for q and once for k, or ``q[..., :R]`` once per use.
    False means "not proven", not "different".

    Example::

        >>> same_value(node_of("t[:, None]"), other_node_of("t[:, None]"))   # doctest: +SKIP
        True
    """
    if isinstance(a, torch.fx.Node) or isinstance(b, torch.fx.Node):
        if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
            return False
        if mutated_in_place(a) or (b is not a and mutated_in_place(b)):
            return False   # written in place between the two reads, maybe
        if a is b:
            return True
        if a.op == "get_attr" and b.op == "get_attr":
            return a.target == b.target
        if a.op != b.op or a.target != b.target or not _is_pure_call(a):
            return False
        memo = {} if _memo is None else _memo
        key = (id(a), id(b))
        if key not in memo:
            memo[key] = False   # a cycle cannot occur in a DAG; this only guards re-entry
            memo[key] = same_value(a.args, b.args, memo) and same_value(a.kwargs, b.kwargs, memo)
        return memo[key]
    if a is b:
        return True
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and \
            all(same_value(x, y, _memo) for x, y in zip(a, b))
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and \
            all(same_value(a[k], b[k], _memo) for k in a)
    if isinstance(a, slice) or isinstance(b, slice):
        return isinstance(a, slice) and isinstance(b, slice) and \
            same_value((a.start, a.stop, a.step), (b.start, b.stop, b.step), _memo)
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:   # a comparison that does not give a bool: not proven equal
        return False
