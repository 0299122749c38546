"""Lift an elementwise tensor expression over the score matrix into a per-element function.

Hand-written attention modifies the [B, H, M, N] score matrix with elementwise code whose other
operands are built from ``arange``s (positions), constants, tensors gathered at position
expressions (a T5 bucket table), or plain tensors that broadcast to the scores (a padding mask).
FlexAttention wants the same thing as a function of one element: ``score_mod(score, b, h,
q_idx, kv_idx)``. :class:`Lifter` walks the Dynamo graph from a node back to the score node and
returns, for every node, a :class:`Lifted`: its static shape and a Python function that, given
one index per dimension, computes that element. Index bookkeeping is the whole trick:

- broadcasting right-aligns shapes and reads size-1 dimensions at index 0;
- ``arange(n)`` at index ``i`` is ``i`` (start/step applied), so an arange broadcast along the
  query axis *becomes* ``q_idx``;
- views (``[:, None]``, ``unsqueeze``, ``expand``, ``permute``, slicing from a constant start)
  only move indices between dimensions;
- ``tril``/``triu`` compare the last two indices; ``table[idx]`` and ``F.embedding`` load
  from a table at a lifted index;
- any other tensor that does not depend on the score (a graph input, a parameter, the result of
  an op we do not model) becomes a *captured buffer* read at its indices: exact by construction,
  and AOT autograd differentiates the buffer like any input of the flex_attention op.

Lifted functions are plain Python over "tensor-like" values, so the same function is traced into
an FX mod graph (called with ``fx.Proxy`` indices) and evaluated concretely (called with
broadcast ``arange`` tensors) to check a mask at rewrite time.

Example::

    >>> lifter = Lifter(score_node=scaled)                  # doctest: +SKIP
    >>> lifted = lifter.lift(softmax_input)                 # doctest: +SKIP
    >>> lifted.fn(env, [b, h, q_idx, kv_idx])               # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx

from ..templates.torch_mod_helpers import cast, where
from .fx_ops import alias_writes, arg, example, graph_positions, op_name, static_shape


class NotLiftable(Exception):
    """The expression uses something this module cannot re-express per element."""


@dataclasses.dataclass
class Env:
    """Values a lifted function reads besides its indices: the score and captured buffers."""

    score: Any
    buffers: Sequence[Any]


@dataclasses.dataclass
class Lifted:
    """One tensor of the expression: static shape, per-element function, and what it reads."""

    shape: tuple[int, ...]
    fn: Callable[[Env, list], Any]
    uses_score: bool = False
    uses_buffers: bool = False
    dtype: Optional[torch.dtype] = None


@dataclasses.dataclass
class Buffer:
    """A tensor read by the mods: the graph node, and the view the mod indexes."""

    node: torch.fx.Node
    shape: tuple[int, ...]        # the node's shape
    kept_dims: tuple[int, ...]    # dims of size > 1: the mod indexes only these


def _is_tensor(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, torch.fx.Proxy))


def _align(idx: list, in_shape: Sequence[int]) -> list:
    """Indices of a broadcast operand: right-aligned, size-1 dimensions read at 0."""
    r = len(in_shape)
    tail = idx[len(idx) - r:] if r else []
    return [0 if s == 1 else i for s, i in zip(in_shape, tail)]


def is_lead_view(before: Optional[Sequence[int]], after: Optional[Sequence[int]]) -> bool:
    """A view from shape ``before`` to ``after`` that keeps the last two dims (query and key
    rows) and only merges or splits the ones before them.

    Example::

        >>> is_lead_view((8, 16, 32), (2, 4, 16, 32)), is_lead_view((8, 16, 32), (8, 32, 16))
        (True, False)
    """
    return (before is not None and after is not None and len(before) >= 2 and len(after) >= 2
            and tuple(before[-2:]) == tuple(after[-2:]) and math.prod(before) == math.prod(after))


def lead_remap(out_lead: tuple[int, ...], in_lead: tuple[int, ...]) -> Callable[[list], list]:
    """Indices of a view whose leading dims are ``out_lead`` -> indices of its source (leading
    dims ``in_lead``, the same number of elements; the trailing dims are kept): the flat
    C-order position over the leading dims, unravelled again. Indices may be ints, tensors or
    fx proxies; size-1 dims read at 0.

    Example::

        >>> lead_remap((2, 3), (6,))([1, 2, 5, 7])
        [5, 5, 7]
        >>> lead_remap((6,), (2, 3))([5, 4, 9])
        [1, 2, 4, 9]
    """
    out_lead, in_lead = tuple(out_lead), tuple(in_lead)
    if out_lead == in_lead:
        return lambda idx: list(idx)
    n_out = len(out_lead)

    def mapping(idx: list) -> list:
        flat = None
        for i, size in zip(idx[:n_out], out_lead):
            if size == 1:
                continue
            flat = i if flat is None else flat * size + i
        parts = []
        for d, size in reversed(list(enumerate(in_lead))):
            if size == 1 or flat is None:
                parts.append(0)
            elif all(s == 1 for s in in_lead[:d]):
                parts.append(flat)
            else:
                parts.append(flat % size)
                flat = flat // size
        return parts[::-1] + list(idx[n_out:])
    return mapping


def reshape_remap(out_shape: tuple[int, ...], in_shape: tuple[int, ...]
                  ) -> Optional[Callable[[list], list]]:
    """Indices of a reshape to ``out_shape`` -> indices of its source (``in_shape``): the dims
    are matched in groups of equal size (a merge or a split) and each group's flat C-order
    index unravelled again (:func:`lead_remap`), so no index grows past one group's size.
    None if the sizes do not match.

    Example::

        >>> reshape_remap((2, 4, 4), (2, 16))([1, 2, 3])
        [1, 11]
    """
    groups, i, j = [], 0, 0
    try:
        while i < len(out_shape) or j < len(in_shape):
            i0, j0, n_out, n_in = i, j, 1, 1
            if i < len(out_shape):
                n_out, i = out_shape[i], i + 1
            if j < len(in_shape):
                n_in, j = in_shape[j], j + 1
            while n_out != n_in:
                if n_out < n_in:
                    n_out, i = n_out * out_shape[i], i + 1
                else:
                    n_in, j = n_in * in_shape[j], j + 1
            groups.append((i0, i, lead_remap(out_shape[i0:i], in_shape[j0:j])))
    except IndexError:
        return None

    def mapping(idx: list) -> list:
        return [v for i0, i1, remap in groups for v in remap(idx[i0:i1])]
    return mapping


def _index_plan(index: Any, src_shape: Sequence[int]) -> Optional[tuple[list, tuple]]:
    """``src[index]`` for a basic index (ints, slices, None, one Ellipsis) as one entry per
    source dim, ``("const", i)`` or ``("out", out_dim, start, stop, step)``, and the shape it
    selects; None for any other index (tensors, nodes).

    Example::

        >>> _index_plan((slice(None), None, 2), (3, 4))
        ([('out', 0, 0, 3, 1), ('const', 2)], (3, 1))
    """
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, torch.fx.Node) for i in index) or sum(i is Ellipsis for i in index) > 1:
        return None
    used = sum(1 for i in index if i is not None and i is not Ellipsis)
    expanded: list = []
    for i in index:
        expanded.extend([slice(None)] * (len(src_shape) - used) if i is Ellipsis else [i])
    expanded.extend([slice(None)] * (len(src_shape) - sum(1 for i in expanded if i is not None)))
    plan: list[tuple] = []
    out: list[int] = []
    src_dim = 0
    for i in expanded:
        if i is None:
            out.append(1)
            continue
        if src_dim >= len(src_shape):
            return None
        size = src_shape[src_dim]
        if isinstance(i, int) and not isinstance(i, bool):
            plan.append(("const", i % size))
        elif isinstance(i, slice) and all(v is None or isinstance(v, int)
                                          for v in (i.start, i.stop, i.step)):
            start, stop, step = i.indices(size)
            plan.append(("out", len(out), start, stop, step))
            out.append(len(range(start, stop, step)))
        else:
            return None
        src_dim += 1
    return plan, tuple(out)


def _slice_source(v: Any, start: int, step: int) -> Any:
    """The source index of index ``v`` of a slice ``[start::step]``."""
    v = v * step if step != 1 else v
    return v + start if start else v


def _and(a: Any, b: Any) -> Any:
    return b if a is True else a & b


def _broadcast(shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    return tuple(torch.broadcast_shapes(*[torch.Size(s) for s in shapes]))


_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
    "pow": operator.pow, "remainder": operator.mod, "floor_divide": operator.floordiv,
    "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
    "eq": operator.eq, "ne": operator.ne, "bitwise_and": operator.and_,
    "bitwise_or": operator.or_, "bitwise_xor": operator.xor,
    "logical_and": operator.and_, "logical_or": operator.or_,
}
_MATH = {"tanh": math.tanh, "exp": math.exp, "log": math.log, "abs": abs, "sqrt": math.sqrt,
         "sigmoid": lambda x: 1 / (1 + math.exp(-x)), "sin": math.sin, "cos": math.cos,
         "floor": math.floor, "ceil": math.ceil, "log1p": math.log1p, "erf": math.erf,
         "rsqrt": lambda x: 1 / math.sqrt(x), "neg": operator.neg}
_CASTS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16,
          "double": torch.float64, "long": torch.int64, "int": torch.int32, "bool": torch.bool}
_IDENTITY = {"contiguous", "clone", "detach", "positive"}
# Ops a slice assignment's value may apply to the scores (_region_sources): elementwise,
# casts, reshapes.
_REGION_OPS = set(_BINARY) | set(_MATH) | set(_CASTS) | {
    "where", "masked_fill", "minimum", "maximum", "clamp", "to", "type_as", "type",
    "contiguous", "clone", "view", "reshape", "_unsafe_view"}
_FILLS = {"ones": 1, "zeros": 0, "ones_like": 1, "zeros_like": 0, "new_ones": 1,
          "new_zeros": 0}


# Views the lifter reads through an index map (_view_of): each must keep the scores' indices.
_INDEX_VIEWS = {"getitem", "expand", "expand_as", "broadcast_to", "permute", "transpose",
                "getattr", "reshape", "view", "_unsafe_view", "squeeze", "unsqueeze"}


def _moves(node: torch.fx.Node, name: Optional[str], how: str = "") -> str:
    return (f"the scores are read through {node.name} ({name or node.target}), which moves "
            f"their indices{': ' + how if how else ''}; not a per-element function of the "
            "score")


def _unary(name: str) -> Callable[[Any], Any]:
    def fn(x: Any) -> Any:
        if _is_tensor(x):
            return -x if name == "neg" else getattr(torch, name)(x)
        return _MATH[name](x)
    return fn


class Lifter:
    """Lifts nodes of one Dynamo graph relative to one score node (see the module docstring).

    ``score_node``: the [B, H, M, N] node the mods receive as ``score``. Nodes that depend on
    it must be elementwise in it; nodes that do not are lifted or captured as buffers.

    Example::

        >>> lifter = Lifter(score_node); lifted = lifter.lift(node)   # doctest: +SKIP
        >>> [b.node.name for b in lifter.buffers]                      # doctest: +SKIP
    """

    def __init__(self, score_node: torch.fx.Node,
                 score_shape: Optional[tuple[int, ...]] = None,
                 read_at: Optional[torch.fx.Node] = None):
        self.score_node = score_node
        self.score_shape = score_shape  # when the score node is not itself the scores (SDPA)
        self.read_at = read_at          # where the op reads its captured buffers (None: the end)
        self.buffers: list[Buffer] = []
        self.features: list[str] = []   # what the expression does, for the report
        self._memo: dict[torch.fx.Node, Lifted] = {}
        self._depends: dict[torch.fx.Node, bool] = {}
        self._readers: list[torch.fx.Node] = []   # the node whose operands are being lifted
        self._positions: Optional[dict[torch.fx.Node, int]] = None
        self._writes: dict[torch.fx.Node, list[int]] = {}
        self._in_region = 0   # lifting the value of a slice assignment (_op_slice_assigned)
        self._in_place: set[torch.fx.Node] = set()   # checked by _check_reads_in_place

    # -- dependence on the score ---------------------------------------------------------
    def depends_on_score(self, node: Any) -> bool:
        """Whether ``node`` is computed from the score node."""
        if not isinstance(node, torch.fx.Node):
            return False
        # Iterative (score chains and their index graphs can be deep) and each node once (a
        # value computed from the whole network, MViTv2's q-dependent bias, reaches it through
        # every residual path): inputs are finished before the node that reads them.
        stack, seen = [(node, False)], set()
        while stack:
            n, inputs_done = stack.pop()
            if inputs_done:
                self._depends[n] = any(a is self.score_node or self._depends.get(a, False)
                                       for a in n.all_input_nodes)
                continue
            if n in seen or n in self._depends or n is self.score_node:
                continue
            seen.add(n)
            stack.append((n, True))
            stack.extend((a, False) for a in n.all_input_nodes)
        return node is self.score_node or self._depends[node]

    # -- lifting ---------------------------------------------------------------------------
    def lift(self, x: Any) -> Lifted:
        """The per-element form of ``x`` (a node or a Python number)."""
        if isinstance(x, (bool, int, float)):
            return Lifted((), lambda env, idx, v=x: v)
        if not isinstance(x, torch.fx.Node):
            raise NotLiftable(f"operand {x!r} of type {type(x).__name__}")
        if x in self._memo:
            return self._memo[x]
        if x is not self.score_node and self._writes_after(x):
            lifted = self._lift_written(x)   # its value depends on where it is read: no memo
        else:
            lifted = self._lift_node(x)
            self._memo[x] = lifted
        if not self._readers and lifted.uses_score:
            self._check_reads_in_place(x)   # the expression's root: is it in the score's place?
        return lifted

    # -- where the scores are read -----------------------------------------------------------
    def _check_reads_in_place(self, root: torch.fx.Node) -> None:
        """Every read of the scores under ``root`` must be of the element the mods are called
        for: the lifted functions stand the kernel's ``score`` at (b, h, q_idx, kv_idx) in for
        whatever element of the score node an index map reaches (``s.transpose(-1, -2)`` would
        read score[kv, q], ``s[..., :1]`` score[.., 0], yet both would be lifted as ``score``).
        So every node computed from the scores must keep each element's flat (C-order) position
        relative to them: elementwise ops none of whose score-dependent operands is broadcast,
        casts and reshapes (the element count kept: lead views of [B*H, M, N] <-> [B, H, M, N]
        and size-1 dims), and views that neither drop nor reorder elements (a full slice, an
        expand or permute that only moves size-1 dims). A slice assignment's value was proven
        to read ``y[index]`` in place (_region_sources); y must then be read in place itself.
        Raises NotLiftable naming the first node that moves the indices."""
        stack = [root]
        while stack:
            n = stack.pop()
            if not isinstance(n, torch.fx.Node) or n is self.score_node or \
                    n in self._in_place or not self.depends_on_score(n):
                continue
            self._in_place.add(n)
            shape, name = static_shape(n), op_name(n)
            if shape is None:
                continue   # (the lifter refused it already)
            if name == "slice_assigned":
                x, index, value = n.args
                stack.append(x)
                if self.depends_on_score(value):
                    planned = _index_plan(index, shape)
                    ys = None if planned is None else self._region_sources(value, planned,
                                                                           tuple(shape))
                    if ys is None:
                        raise NotLiftable(_moves(n, name, "its value reads the scores other "
                                                 "than at the slice it is assigned to"))
                    stack.extend(ys)
                continue
            size = math.prod(shape)
            if name in _INDEX_VIEWS:
                src = n.args[0]
                if not self.depends_on_score(src):
                    stack.extend(n.all_input_nodes)
                    continue
                src_shape = static_shape(src)
                if src_shape is None or math.prod(src_shape) != size or \
                        not self._keeps_order(n, name, src_shape):
                    raise NotLiftable(_moves(n, name))
                stack.extend(n.all_input_nodes)
                continue
            for a in n.all_input_nodes:
                if self.depends_on_score(a):
                    a_shape = static_shape(a)
                    if a_shape is not None and math.prod(a_shape) != size:
                        raise NotLiftable(_moves(n, name, f"it broadcasts {a.name} "
                                                 f"{list(a_shape)} to {list(shape)}"))
                    stack.append(a)

    def _keeps_order(self, node: torch.fx.Node, name: str, src_shape) -> bool:
        """A view of as many elements as its source keeps each one's flat position: reshapes
        always, basic slices and expands then select/repeat nothing, permutes must keep the
        order of the dims of size > 1."""
        if name == "getitem":
            index = node.args[1]
            if isinstance(index, torch.fx.Node) or (isinstance(index, tuple) and any(
                    isinstance(i, torch.fx.Node) for i in index)):
                return False
            return _index_plan(index, src_shape) is not None
        if name in ("permute", "transpose", "getattr"):
            rank = len(src_shape)
            if name == "getattr":
                if node.args[1] != "mT":
                    return False
                order = list(range(rank - 2)) + [rank - 1, rank - 2]
            elif name == "transpose":
                a, b = (d % rank for d in (arg(node, 1, "dim0"), arg(node, 2, "dim1")))
                order = list(range(rank))
                order[a], order[b] = order[b], order[a]
            else:
                dims = node.args[1:] if len(node.args) > 2 or isinstance(
                    arg(node, 1, "dims"), int) else arg(node, 1, "dims")
                order = [d % rank for d in dims]
            big = [d for d in order if src_shape[d] != 1]
            return big == sorted(big)
        return True   # reshape/view/squeeze/unsqueeze/expand with the element count kept

    # -- tensors written in place ------------------------------------------------------------
    def _position(self, node: torch.fx.Node) -> int:
        if self._positions is None:
            self._positions = graph_positions(node.graph)
        return self._positions[node]

    def _writes_after(self, node: torch.fx.Node) -> list[int]:
        """Positions of the in-place writes into ``node``'s tensor after ``node`` is made."""
        if node not in self._writes:
            writes = alias_writes(node)
            here = self._position(node) if writes else 0
            self._writes[node] = sorted(p for p in (self._position(w) for w in writes)
                                        if p > here)
        return self._writes[node]

    def _lift_written(self, node: torch.fx.Node) -> Lifted:
        """A tensor the graph writes into in place after making it (``keep = ones(..).tril();
        keep[1, :4] = False``; T5-style ``buckets += where(..)``). Its op gives its value only
        where it is read before the first write; a captured buffer gives the value where the
        op reads it (``read_at``), right only if no write falls between the reads and there."""
        writes = self._writes_after(node)
        made = self._position(node)
        if self._readers:
            reads = [self._position(self._readers[-1])]
        else:   # the expression's root: read by its users (those that do not write it)
            from .fx_ops import _is_in_place
            reads = [self._position(u) for u in node.users if not _is_in_place(u, node)]
        end = self._position(self.read_at) if self.read_at is not None else math.inf
        first, last = (min(reads), max(reads)) if reads else (end, end)
        if not any(made < w < last for w in writes):
            return self._lift_node(node)       # every read comes before the first write
        if not any(first <= w < end for w in writes) and not self.depends_on_score(node):
            shape = static_shape(node)
            if shape is None:
                raise NotLiftable(f"{node.name} has no static tensor shape")
            return self._buffer(node, shape)   # written before every read, then left alone
        raise NotLiftable(f"{node.name} is written in place between where it is read and "
                          "where fa3's op would read it")

    def _lift_node(self, node: torch.fx.Node) -> Lifted:
        if node is self.score_node:
            shape = self.score_shape or static_shape(node)
            return Lifted(shape, lambda env, idx: env.score, uses_score=True,
                          dtype=example(node).dtype)
        self._readers.append(node)
        try:
            return self._lift_operation(node)
        finally:
            self._readers.pop()

    def _lift_operation(self, node: torch.fx.Node) -> Lifted:
        shape = static_shape(node)
        if shape is None:
            raise NotLiftable(f"{node.name} has no static tensor shape")
        name = op_name(node)
        handler = getattr(self, f"_op_{name}", None) if name else None
        if name in _BINARY:
            return self._binary(node, name)
        if name in _MATH:
            return self._elementwise(node, [arg(node, 0, "input")], _unary(name))
        if handler is not None:
            lifted = handler(node, shape)
            if lifted is not None:
                return lifted
        if self.depends_on_score(node):
            raise NotLiftable(f"{node.name} ({name or node.target}) is not an elementwise "
                              "operation fa3 can re-express per score element")
        return self._buffer(node, shape)

    def _buffer(self, node: torch.fx.Node, shape: tuple[int, ...]) -> Lifted:
        for i, buf in enumerate(self.buffers):
            if buf.node is node:
                k = i
                break
        else:
            k = len(self.buffers)
            self.buffers.append(Buffer(node, shape, tuple(d for d, s in enumerate(shape)
                                                          if s != 1)))
        kept = self.buffers[k].kept_dims

        def fn(env: Env, idx: list) -> Any:
            picked = [idx[d] for d in kept] or [0]
            return env.buffers[k][tuple(picked)]
        return Lifted(shape, fn, uses_buffers=True, dtype=example(node).dtype)

    def _elementwise(self, node: torch.fx.Node, operands: list, op: Callable) -> Lifted:
        parts = [self.lift(a) for a in operands]
        shape = static_shape(node)
        shapes = [p.shape for p in parts]

        def fn(env: Env, idx: list) -> Any:
            return op(*[p.fn(env, _align(idx, s)) for p, s in zip(parts, shapes)])
        return Lifted(shape, fn, any(p.uses_score for p in parts),
                      any(p.uses_buffers for p in parts), example(node).dtype)

    def _binary(self, node: torch.fx.Node, name: str) -> Lifted:
        a, b = arg(node, 0, "input"), arg(node, 1, "other")
        if name == "div" and node.kwargs.get("rounding_mode"):
            mode = node.kwargs["rounding_mode"]
            if mode != "floor":
                raise NotLiftable(f"division with rounding_mode={mode!r}")
            name = "floor_divide"
        alpha = node.kwargs.get("alpha", 1)
        op = _BINARY[name]
        if alpha != 1:
            return self._elementwise(node, [a, b], lambda x, y: op(x, y * alpha))
        return self._elementwise(node, [a, b], op)

    # -- ops with their own rules (return None to fall back to a captured buffer) ----------
    def _op_where(self, node, shape):
        ops = [arg(node, 0, "condition"), arg(node, 1, "input"), arg(node, 2, "other")]
        if any(o is None for o in ops):
            return None
        return self._elementwise(node, ops, where)

    def _op_masked_fill(self, node, shape):
        x, m, v = arg(node, 0, "input"), arg(node, 1, "mask"), arg(node, 2, "value")
        return self._elementwise(node, [m, v, x], where)

    def _op_bitwise_not(self, node, shape):
        return self._elementwise(node, [arg(node, 0, "input")],
                                 lambda x: ~x if _is_tensor(x) else (not x))

    _op_bitwise_not_bool = _op_bitwise_not

    def _op_minimum(self, node, shape):
        return self._elementwise(node, [arg(node, 0, "input"), arg(node, 1, "other")],
                                 lambda x, y: torch.minimum(x, y) if _is_tensor(x) and
                                 _is_tensor(y) else where(x < y, x, y))

    def _op_maximum(self, node, shape):
        return self._elementwise(node, [arg(node, 0, "input"), arg(node, 1, "other")],
                                 lambda x, y: torch.maximum(x, y) if _is_tensor(x) and
                                 _is_tensor(y) else where(x > y, x, y))

    def _op_min(self, node, shape):
        other = arg(node, 1, "other")
        return self._op_minimum(node, shape) if isinstance(other, torch.fx.Node) else None

    def _op_max(self, node, shape):
        other = arg(node, 1, "other")
        return self._op_maximum(node, shape) if isinstance(other, torch.fx.Node) else None

    def _op_clamp(self, node, shape):
        lo, hi = arg(node, 1, "min"), arg(node, 2, "max")

        def clamp(x, lo=lo, hi=hi):
            if lo is not None:
                x = where(x < lo, lo, x)
            if hi is not None:
                x = where(x > hi, hi, x)
            return x
        if isinstance(lo, torch.fx.Node) or isinstance(hi, torch.fx.Node):
            return None
        return self._elementwise(node, [arg(node, 0, "input")], clamp)

    _op_clip = _op_clamp

    def _op_to(self, node, shape):
        target = next((a for a in list(node.args[1:]) + list(node.kwargs.values())
                       if isinstance(a, torch.dtype)), None)
        if target is None:
            other = next((a for a in node.args[1:] if isinstance(a, torch.fx.Node)), None)
            target = example(other).dtype if other is not None else None
        return self._cast(node, target)

    def _op_type_as(self, node, shape):
        return self._cast(node, example(node.args[1]).dtype)

    def _op_type(self, node, shape):
        dtype = arg(node, 1, "dtype")
        return self._cast(node, dtype) if isinstance(dtype, torch.dtype) else None

    def _cast(self, node: torch.fx.Node, dtype: Optional[torch.dtype]) -> Lifted:
        src = node.args[0]
        if dtype is None or (self.depends_on_score(src) and dtype.is_floating_point):
            # Score values: the kernel computes them in float32, which is at least as
            # precise as the cast; keep the value.
            return self._elementwise(node, [src], lambda x: x)
        return self._elementwise(node, [src], lambda x: cast(x, dtype))

    def _op_arange(self, node, shape):
        nums = [a for a in node.args]
        if len(nums) == 1:
            start, step = 0, 1
        else:
            start, step = nums[0], nums[2] if len(nums) > 2 else node.kwargs.get("step", 1)
        if "start" in node.kwargs:
            start = node.kwargs["start"]
        if not all(isinstance(v, (int, float)) for v in (start, step)):
            return None
        dtype = example(node).dtype
        self.features.append("index")

        def fn(env, idx, start=start, step=step):
            v = idx[0] * step + start if (start, step) != (0, 1) else idx[0]
            return cast(v, dtype) if dtype.is_floating_point else v
        return Lifted(shape, fn, dtype=dtype)

    def _fill(self, node, shape, value):
        dtype = example(node).dtype
        value = bool(value) if dtype is torch.bool else (
            float(value) if dtype.is_floating_point else int(value))
        return Lifted(shape, lambda env, idx, v=value: v, dtype=dtype)

    def _op_full(self, node, shape):
        value = arg(node, 1, "fill_value")
        return self._fill(node, shape, value) if isinstance(value, (int, float, bool)) else None

    def _op_full_like(self, node, shape):
        return self._op_full(node, shape)

    def _op_new_full(self, node, shape):
        value = arg(node, 2, "fill_value")
        return self._fill(node, shape, value) if isinstance(value, (int, float, bool)) else None

    def _op_tril(self, node, shape, upper: bool = False):
        x, k = self.lift(node.args[0]), arg(node, 1, "diagonal", 0)
        if not isinstance(k, int) or len(shape) < 2:
            return None

        zero = False if example(node).dtype is torch.bool else 0

        def fn(env, idx):
            offset = idx[-1] - idx[-2]
            keep = offset >= k if upper else offset <= k
            return where(keep, x.fn(env, idx), zero)
        self.features.append("index")
        return Lifted(shape, fn, x.uses_score, x.uses_buffers, example(node).dtype)

    def _op_triu(self, node, shape):
        return self._op_tril(node, shape, upper=True)

    def _view_of(self, node, src, mapping: Callable[[list], list]) -> Lifted:
        x = self.lift(src)

        def fn(env, idx):
            return x.fn(env, mapping(idx))
        return Lifted(static_shape(node), fn, x.uses_score, x.uses_buffers, example(node).dtype)

    def _op_unsqueeze(self, node, shape):
        d = arg(node, 1, "dim")
        d = d if d >= 0 else d + len(shape)
        return self._view_of(node, node.args[0], lambda idx: idx[:d] + idx[d + 1:])

    def _op_squeeze(self, node, shape):
        src_shape = static_shape(node.args[0])
        dims = [d for d, s in enumerate(src_shape) if s == 1]
        if len(node.args) > 1 or "dim" in node.kwargs:
            d = arg(node, 1, "dim")
            d = [d] if isinstance(d, int) else list(d)
            dims = [x % len(src_shape) for x in d if src_shape[x] == 1]

        def mapping(idx):
            it = iter(idx)
            return [0 if d in dims else next(it) for d in range(len(src_shape))]
        return self._view_of(node, node.args[0], mapping)

    def _op_reshape(self, node, shape):
        if any(isinstance(a, torch.dtype) for a in list(node.args[1:]) + list(
                node.kwargs.values())):
            return None   # x.view(dtype) reinterprets the bits: not an index map
        src_shape = static_shape(node.args[0])
        if src_shape is None:
            return None
        if [s for s in src_shape if s != 1] != [s for s in shape if s != 1]:
            if self.depends_on_score(node.args[0]) and is_lead_view(src_shape, shape):
                # The scores viewed with their batch/head dims merged or split ([B*H, M, N]
                # <-> [B, H, M, N]): the same elements, indexed in C order.
                return self._view_of(node, node.args[0],
                                     lead_remap(tuple(shape[:-2]), tuple(src_shape[:-2])))
            if self._in_region and self.depends_on_score(node.args[0]):
                # MViTv2's (attn[..].view(B, H, qh, qw, kh, kw) + bias).view(B, H, M', N'):
                # reshapes back and forth inside a slice assignment's value, proven to read
                # the scores in place (_region_sources).
                remap = reshape_remap(tuple(shape), tuple(src_shape))
                return None if remap is None else self._view_of(node, node.args[0], remap)
            return None  # a real reshape (merging or splitting sizes): captured as a buffer
        big = [d for d, s in enumerate(shape) if s != 1]
        src_big = [d for d, s in enumerate(src_shape) if s != 1]

        def mapping(idx):
            out = [0] * len(src_shape)
            for d_out, d_in in zip(big, src_big):
                out[d_in] = idx[d_out]
            return out
        return self._view_of(node, node.args[0], mapping)

    _op_view = _op_reshape
    _op__unsafe_view = _op_reshape

    def _op_expand(self, node, shape):
        src_shape = static_shape(node.args[0])
        return self._view_of(node, node.args[0], lambda idx: _align(idx, src_shape))

    _op_expand_as = _op_expand
    _op_broadcast_to = _op_expand

    def _op_permute(self, node, shape):
        dims = node.args[1:] if len(node.args) > 2 or isinstance(
            arg(node, 1, "dims"), int) else arg(node, 1, "dims")
        dims = [d % len(shape) for d in dims]

        def mapping(idx):
            out = [None] * len(shape)
            for pos, d in enumerate(dims):
                out[d] = idx[pos]
            return out
        return self._view_of(node, node.args[0], mapping)

    def _op_transpose(self, node, shape):
        a, b = (d % len(shape) for d in (arg(node, 1, "dim0"), arg(node, 2, "dim1")))

        def mapping(idx):
            out = list(idx)
            out[a], out[b] = out[b], out[a]
            return out
        return self._view_of(node, node.args[0], mapping)

    def _op_getattr(self, node, shape):
        if node.args[1] == "mT":
            return self._view_of(node, node.args[0], lambda idx: idx[:-2] + [idx[-1], idx[-2]])
        return None

    def _identity(self, node, shape):
        return self._view_of(node, node.args[0], lambda idx: idx)

    _op_contiguous = _op_clone = _op_detach = _op_positive = _identity

    def _op_float(self, node, shape):
        return self._cast(node, torch.float32)

    def _op_half(self, node, shape):
        return self._cast(node, torch.float16)

    def _op_bfloat16(self, node, shape):
        return self._cast(node, torch.bfloat16)

    def _op_long(self, node, shape):
        return self._cast(node, torch.int64)

    def _op_int(self, node, shape):
        return self._cast(node, torch.int32)

    def _op_bool(self, node, shape):
        return self._cast(node, torch.bool)

    def _op_getitem(self, node, shape):
        src, index = node.args
        if not isinstance(src, torch.fx.Node) or example(src) is None:
            return None
        if isinstance(index, torch.fx.Node):
            return self._gather(node, src, index)
        index = index if isinstance(index, tuple) else (index,)
        src_shape = static_shape(src)
        if index and all(isinstance(i, torch.fx.Node) for i in index):
            return self._gather_many(node, src, list(index))
        plan = _index_plan(index, src_shape)
        if plan is None:
            return None

        def mapping(idx):
            return [p[1] if p[0] == "const" else _slice_source(idx[p[1]], p[2], p[4])
                    for p in plan[0]]
        return self._view_of(node, src, mapping)

    def _op_slice_assigned(self, node, shape):
        """``x[index] = value`` out of place (score_writes.py): ``value`` inside the region the
        index selects, read at the region's own indices (clamped into it, so that the unused
        branch reads in bounds), ``x`` outside. ``value`` computed from the scores must read
        them as ``y[index]`` (the same index) through elementwise ops and reshapes only: then
        region index r reads y where the region's r sits, the output's own position."""
        x, index, value = node.args
        planned = _index_plan(index, shape)
        if planned is None or any(p[0] == "out" and p[4] < 1 for p in planned[0]):
            return None
        plan, region = planned
        if 0 in region:
            return self._identity(node, shape)   # assigns nothing
        value_shape = static_shape(value) if isinstance(value, torch.fx.Node) else ()
        if value_shape is None or len(value_shape) > len(region):
            return None
        if self.depends_on_score(value) and self._region_sources(value, planned,
                                                                 tuple(shape)) is None:
            raise NotLiftable(f"{node.name} assigns a value computed from the scores other "
                              "than elementwise (or through reshapes) from the same slice of "
                              "them")
        base = self.lift(x)
        self._in_region += 1   # (reshapes of the scores: see _op_reshape)
        try:
            val = self.lift(value)
        finally:
            self._in_region -= 1
        val_shape, dtype = val.shape, example(node).dtype
        # The assignment casts the value to x's dtype; floats stay (the kernel's float32 score
        # is at least as precise), integers and bools are cast as the model casts them.
        exact = dtype.is_floating_point and (val.dtype is None or val.dtype.is_floating_point)

        def fn(env, idx):
            inside, ridx = True, [0] * len(region)
            for p, i, size in zip(plan, idx, shape):
                if p[0] == "const":
                    inside = _and(inside, i == p[1])
                    continue
                _, pos, start, stop, step = p
                if start > 0:
                    inside = _and(inside, i >= start)
                if stop < size:
                    inside = _and(inside, i < stop)
                r = i - start if start else i
                if step != 1:
                    inside = _and(inside, r % step == 0)
                    r = r // step
                if start > 0:
                    r = where(r < 0, 0, r)
                if (size - 1 - start) // step > region[pos] - 1:
                    r = where(r > region[pos] - 1, region[pos] - 1, r)
                ridx[pos] = r
            v = val.fn(env, _align(ridx, val_shape))
            return where(inside, v if exact or val.dtype == dtype else cast(v, dtype),
                         base.fn(env, idx))
        return Lifted(shape, fn, base.uses_score or val.uses_score,
                      base.uses_buffers or val.uses_buffers, dtype)

    def _region_sources(self, value: torch.fx.Node, planned: tuple,
                        shape_of_x: tuple[int, ...]) -> Optional[list[torch.fx.Node]]:
        """The tensors y that ``value`` reads as ``y[index]`` when every path from ``value`` to
        the scores is elementwise ops and reshapes of the region's size down to ``y[index]``, y
        of x's shape and the index the slice assignment's own (``planned``); else None.
        Reshapes keep an element's flat position, and ops whose score operands all have the
        region's size broadcast none of them, so value's element r is computed from y's
        element at r's place in the region (y itself must read the scores in place:
        _check_reads_in_place)."""
        size, stack, seen, sources = math.prod(planned[1]), [value], set(), []
        while stack:
            n = stack.pop()
            if n in seen or not self.depends_on_score(n):
                continue
            seen.add(n)
            shape, name = static_shape(n), op_name(n)
            if shape is None or math.prod(shape) != size:
                return None
            if name == "getitem" and static_shape(n.args[0]) == shape_of_x and \
                    _index_plan(n.args[1], shape_of_x) == planned:
                sources.append(n.args[0])
                continue
            if name not in _REGION_OPS:
                return None
            stack.extend(n.all_input_nodes)
        return sources

    def _gather(self, node, table: torch.fx.Node, index: torch.fx.Node) -> Optional[Lifted]:
        """``table[index]`` along dim 0 with an index tensor computed from positions."""
        ix = self.lift(index)
        if self.depends_on_score(table) or ix.uses_score:
            return None
        tab = self._buffer(table, static_shape(table))
        rank = len(ix.shape)
        self.features.append("gather")

        def fn(env, idx):
            return tab.fn(env, [ix.fn(env, idx[:rank])] + idx[rank:])
        return Lifted(static_shape(node), fn, False, True, example(node).dtype)

    def _gather_many(self, node, table: torch.fx.Node, index: list) -> Optional[Lifted]:
        """``table[i0, i1, ...]``: index tensors (broadcast together) on the leading dims."""
        ixs = [self.lift(i) for i in index]
        if self.depends_on_score(table) or any(i.uses_score for i in ixs):
            return None
        tab = self._buffer(table, static_shape(table))
        rank = len(_broadcast([i.shape for i in ixs]))
        self.features.append("gather")

        def fn(env, idx):
            head = [i.fn(env, _align(idx[:rank], i.shape)) for i in ixs]
            return tab.fn(env, head + idx[rank:])
        return Lifted(static_shape(node), fn, False, True, example(node).dtype)

    def _op_tensor(self, node, shape):
        value = node.args[0] if node.args else None
        if isinstance(value, (bool, int, float)):
            return self._fill(node, shape, value)
        return None

    _op_scalar_tensor = _op_tensor

    def _op_embedding(self, node, shape):
        index, weight = arg(node, 0, "input"), arg(node, 1, "weight")
        padding_idx, max_norm = arg(node, 2, "padding_idx"), arg(node, 3, "max_norm")
        if padding_idx is not None or max_norm is not None:
            return None  # they change the gradient or the table: not a plain gather
        return self._gather(node, weight, index)

    def _op_ones(self, node, shape):
        return self._fill(node, shape, 1)

    def _op_zeros(self, node, shape):
        return self._fill(node, shape, 0)

    _op_ones_like = _op_ones
    _op_new_ones = _op_ones
    _op_zeros_like = _op_zeros
    _op_new_zeros = _op_zeros
