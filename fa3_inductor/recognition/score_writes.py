"""Recognition pre-pass: scores written in place before the softmax become out-of-place ops.

Two families write into their scores between the q·kᵀ product and the softmax: timm's MViTv2
adds its decomposed relative-position bias by slice assignment
(``attn[:, :, sp:, sp:] = (attn[:, :, sp:, sp:].view(..) + rel_h + rel_w).view(..)``) and
Flaubert fills its padding mask with ``scores.masked_fill_(mask, min)``. Dynamo's graph keeps
the user's in-place ops (AOT autograd functionalizes only later, after recognition): the
softmax reads the product's node, and the write is a node no data edge passes through, so
recognition, which follows data edges, would not see it. This pass does what functionalization
does, on Dynamo's graph: the write becomes its out-of-place op (``masked_fill``, ``add``, or
``slice_assigned(x, index, value)`` for a slice assignment) and every later read of the tensor
reads that result. It is made only where that is what the graph computes:

- the written tensor is made in the graph by an op that does not alias (not an input, a
  parameter or a view of one): nothing outside the graph sees the write;
- the write is an elementwise in-place op on the tensor itself (``x.masked_fill_(m, v)``,
  ``x += b``), an assignment into it with a constant index of slices and integers
  (``x[:, :, 1:, 1:] = v``), or an in-place op on one such slice (``x[:, :, 1:].add_(b)``);
- no view of it made before the write is read after the write (the view would see the write),
  and what is written does not alias it;
- the out-of-place op keeps the tensor's shape and dtype (an in-place op neither broadcasts its
  target nor changes its dtype).

Writes that fail a rule stay as written, with why in the node's meta; ManualSite then leaves
the site alone with that reason. Only tensors computed from a q·kᵀ product that feed a softmax
are touched.

Example::

    >>> functionalize_score_writes(gm)   # doctest: +SKIP
    1
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx

from .._log import log
from .fx_ops import (_aliases, alias_closure, call_node, example, graph_positions, op_name,
                     slice_assigned, static_shape)

KEPT = "fa3_write_kept"   # node.meta key: why this in-place write was left as written
_PRODUCTS = {"matmul", "bmm", "einsum", "baddbmm"}
_HOPS = 6   # ops from the product to the written tensor, and from it to the softmax
_OUT_OF_PLACE_OPERATORS = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv}
# In-place methods whose out-of-place form (the name without "_") computes the same values.
_ELEMENTWISE_METHODS = {
    "add_", "sub_", "mul_", "div_", "true_divide_", "masked_fill_", "clamp_", "clamp_min_",
    "clamp_max_", "clip_", "neg_", "exp_", "tanh_", "sigmoid_", "relu_", "pow_",
    "nan_to_num_", "abs_", "sqrt_", "rsqrt_", "log_"}


def functionalize_score_writes(gm: torch.fx.GraphModule) -> int:
    """Turn the in-place writes into ``gm``'s attention scores into out-of-place ops where that
    is exact (module docstring); returns how many writes were turned.

    Example::

        >>> functionalize_score_writes(gm)   # doctest: +SKIP
        1
    """
    count = 0
    for node in list(gm.graph.nodes):
        if not _is_written_scores(node):
            continue
        base = node
        while True:
            turned = _turn_first_write(gm.graph, base)
            if turned is None:
                break
            base, count = turned, count + 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _is_written_scores(node: torch.fx.Node) -> bool:
    """A fresh tensor computed from a q·kᵀ product, written in place, that feeds a softmax."""
    src = node.args[0] if node.args else None
    if node.op not in ("call_function", "call_method") or \
            (isinstance(src, torch.fx.Node) and _aliases(src, node)):
        return False   # an input, a view, a cast to its own dtype or an in-place op's result
    if not alias_closure(node)[1]:
        return False
    return _near(node, lambda n: n.all_input_nodes, lambda n: op_name(n) in _PRODUCTS) and \
        _near(node, lambda n: list(n.users), lambda n: op_name(n) in ("softmax", "_softmax"))


def _near(node: torch.fx.Node, step, hit) -> bool:
    """Some node within _HOPS ``step``s of ``node`` (its inputs, or its users) is a ``hit``."""
    frontier, seen = {node}, {node}
    for _ in range(_HOPS):
        if any(hit(n) for n in frontier):
            return True
        frontier = {m for n in frontier for m in step(n)} - seen
        seen |= frontier
    return any(hit(n) for n in frontier)


def _turn_first_write(graph: torch.fx.Graph, base: torch.fx.Node) -> Optional[torch.fx.Node]:
    """Replace the first write into ``base`` by its out-of-place op; returns the new node (the
    tensor's value from there on), or None if there is no write or it stays (meta[KEPT])."""
    aliases, writes = alias_closure(base)
    if not writes:
        return None
    pos = graph_positions(graph)
    write = min(writes, key=pos.__getitem__)
    target = write.args[0]
    reason = _unsafe(write, target, base, aliases, pos)
    if reason is None:
        try:
            with graph.inserting_before(write):
                new = _out_of_place(graph, write, target, base)
        except Exception as exc:   # an analysis bug must not break the user's compile
            log.warning("fa3_inductor: %s left in place (%s: %s)", write.name,
                        type(exc).__name__, exc)
            new = f"analysis failed ({type(exc).__name__}: {exc}); please report it"
        if isinstance(new, str):
            reason = new
    if reason is not None:
        write.meta[KEPT] = reason
        return None
    for user in list(base.users):
        if pos.get(user, -1) > pos[write]:
            user.replace_input_with(base, new)
    write.replace_all_uses_with(new)   # an in-place op returns its target: base, here
    graph.erase_node(write)
    return new


def _unsafe(write: torch.fx.Node, target: torch.fx.Node, base: torch.fx.Node,
            aliases: set[torch.fx.Node], pos: dict) -> Optional[str]:
    """Why rewriting ``write`` out of place would change what the graph computes, or None."""
    if write.kwargs.get("out") is not None:
        return f"{write.name} writes through out="
    if target is not base and not (op_name(target) == "getitem" and target.args[0] is base):
        return f"{write.name} writes into {target.name}, a view of {base.name} other than one slice"
    operands = list(write.args[1:]) + list(write.kwargs.values())
    if any(isinstance(a, torch.fx.Node) and a in aliases for a in operands):
        return f"what {write.name} writes is read from {base.name} itself (overlapping memory)"
    if target is not base and write.users:
        return f"the result of {write.name} (a view of {base.name}) is read"
    for view in aliases - {base}:
        if view is write or pos[view] > pos[write]:
            continue   # made after the write: it reads the new value (its input is rewired)
        late = [u for u in view.users if u is not write and pos[u] > pos[write]]
        if late:
            return (f"{view.name}, a view of {base.name} made before the write {write.name}, "
                    f"is read after it by {late[0].name}")
    return None


def _out_of_place(graph: torch.fx.Graph, write: torch.fx.Node, target: torch.fx.Node,
                  base: torch.fx.Node) -> Any:
    """The out-of-place form of ``write`` as new nodes (the value of ``base`` after it), or
    why there is none (a str)."""
    if write.target is operator.setitem:
        if target is not base:
            return f"{write.name} assigns into a slice of a view of {base.name}"
        index, value = write.args[1], write.args[2]
        if not _basic_index(index):
            return f"{write.name} assigns at an index that is not constant slices and integers"
        return _same_meta(call_node(graph, "call_function", slice_assigned,
                                    (base, index, value)), base, write)
    if write.target in _OUT_OF_PLACE_OPERATORS:
        new = call_node(graph, "call_function", _OUT_OF_PLACE_OPERATORS[write.target],
                        (target, *write.args[1:]), dict(write.kwargs))
    elif write.op == "call_method" and write.target in _ELEMENTWISE_METHODS:
        new = call_node(graph, "call_method", write.target[:-1], (target, *write.args[1:]),
                        dict(write.kwargs))
    else:
        return f"{write.name} ({write.target}) is not an elementwise in-place op fa3 rewrites"
    new = _same_meta(new, target, write)
    if isinstance(new, str) or target is base:
        return new
    index = target.args[1]
    assigned = call_node(graph, "call_function", slice_assigned, (base, index, new)) \
        if _basic_index(index) else None
    kept = f"{write.name} writes into {base.name} at an index that is not constant slices" \
        if assigned is None else _same_meta(assigned, base, write)
    if isinstance(kept, str):
        graph.erase_node(new)
    return kept


def _same_meta(new: torch.fx.Node, like: torch.fx.Node, write: torch.fx.Node) -> Any:
    """``new`` if it has ``like``'s shape and dtype (what the in-place op kept), else why not
    (``new`` is then removed)."""
    a, b = example(new), example(like)
    if a is not None and b is not None and static_shape(new) == static_shape(like) and \
            a.dtype == b.dtype:
        return new
    new.graph.erase_node(new)
    return (f"{write.name} out of place would broadcast or promote {like.name} "
            "(the in-place op keeps its shape and dtype)")


def _basic_index(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is None or p is Ellipsis or (isinstance(p, int) and not isinstance(p, bool))
               or (isinstance(p, slice) and all(v is None or isinstance(v, int)
                                                for v in (p.start, p.stop, p.step)))
               for p in parts)
