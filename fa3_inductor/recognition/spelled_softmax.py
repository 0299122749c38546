"""Recognition: a softmax written out by hand becomes ``torch.softmax`` before the anchor match.

The spelling models use when they avoid ``softmax`` (for a custom mask fill, or copied from a
paper)::

    m = s.amax(-1, keepdim=True)          # or s.max(-1, keepdim=True).values / [0], torch.amax
    e = torch.exp(s - m)                  # or (s - m).exp(); m may be .detach()-ed
    p = e / e.sum(-1, keepdim=True)       # or torch.sum(e, dim=-1, keepdim=True)

is the same computation as ``torch.softmax(s, -1)`` (the max is subtracted the same way), so it
is replaced by one call, in place, and recognize_manual then sees an ordinary softmax. Only the
max-subtracted form is rewritten: ``exp(s) / sum`` overflows in eager where softmax does not, and
a rewrite must not change results. Intermediates used elsewhere (e.g. ``e`` returned) leave the
spelling alone.

Example::

    >>> rewritten = canonicalize_spelled_softmax(gm)    # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx

from .fx_ops import arg, example, op_name


def canonicalize_spelled_softmax(gm: torch.fx.GraphModule) -> int:
    """Replace every written-out last-dim softmax of ``gm`` by ``torch.softmax``; returns how
    many were replaced (the graph is recompiled if any).

    Example::

        >>> canonicalize_spelled_softmax(gm)    # doctest: +SKIP
        1
    """
    count = 0
    for node in list(gm.graph.nodes):
        match = _match(node)
        if match is None:
            continue
        scores, dead = match
        with gm.graph.inserting_before(node):
            softmax = gm.graph.call_function(torch.softmax, (scores, -1))
        softmax.meta.update(node.meta)
        node.replace_all_uses_with(softmax)
        _erase_unused(gm, [node] + dead)
        count += 1
    return _finished(gm, count)


def drop_row_max_shift(gm: torch.fx.GraphModule) -> int:
    """``softmax(s - s.max(-1, keepdim=True).values, -1)`` becomes ``softmax(s, -1)``; returns how
    many. Softmax ignores a per-row shift (it subtracts the row max itself), so dropping it is
    exact in the math; eager rounds ``s - max`` to the scores' dtype first, the kernel does not.
    MiMo-V2-Flash writes it before every softmax "for BF16/FP16 numerical stability"; its layers
    without attention sinks were left alone ("getitem ... is not an elementwise operation").

    Example::

        >>> drop_row_max_shift(gm)    # doctest: +SKIP
        1
    """
    count = 0
    for node in list(gm.graph.nodes):
        t = example(node)
        if op_name(node) not in ("softmax", "_softmax") or t is None or t.dim() == 0:
            continue
        dim = arg(node, 1, "dim")
        if not isinstance(dim, int) or dim % t.dim() != t.dim() - 1:
            continue
        shifted = arg(node, 0, "input")
        found = _row_max_shifted(shifted, node, t.dim())
        if found is None:
            continue
        scores, dead = found
        node.replace_input_with(shifted, scores)
        _erase_unused(gm, dead)
        count += 1
    return _finished(gm, count)


def _erase_unused(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> None:
    for n in nodes:   # consumers first, so each is unused when erased
        if not n.users:
            gm.graph.erase_node(n)


def _finished(gm: torch.fx.GraphModule, count: int) -> int:
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _last_dim(node: torch.fx.Node, index: int, rank: int) -> bool:
    dim = arg(node, index, "dim")
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return isinstance(dim, int) and dim % rank == rank - 1 and arg(node, index + 1, "keepdim") is True


def _only_users(node: Any, users: set) -> bool:
    return isinstance(node, torch.fx.Node) and set(node.users) <= users


def _match(div: torch.fx.Node) -> Optional[tuple[torch.fx.Node, list[torch.fx.Node]]]:
    """(s, nodes to drop) if ``div`` is ``exp(s - max(s)) / sum(exp(s - max(s)))`` over dim -1."""
    if op_name(div) != "div" or len(div.args) != 2 or div.kwargs:
        return None
    e, total = div.args
    t = example(div)
    if op_name(e) != "exp" or op_name(total) != "sum" or t is None or t.dim() == 0:
        return None
    rank = t.dim()
    if arg(total, 0, "input") is not e or not _last_dim(total, 1, rank) or \
            not _only_users(e, {div, total}) or not _only_users(total, {div}):
        return None
    found = _row_max_shifted(arg(e, 0, "input"), e, rank)
    return None if found is None else (found[0], [total, e] + found[1])


def _row_max_shifted(shifted: Any, user: torch.fx.Node, rank: int
                     ) -> Optional[tuple[torch.fx.Node, list[torch.fx.Node]]]:
    """(s, nodes to drop) if ``shifted``, read by ``user`` only, is ``s - max(s)`` over dim -1 and
    each node of the max is read only by the next one towards ``user``."""
    found = row_max_subtracted(shifted, rank)
    if found is None or not all(_only_users(n, {reader}) for n, reader in
                                zip(found[1], [user] + found[1])):
        return None
    return found


def row_max_subtracted(x: Any, rank: int) -> Optional[tuple[torch.fx.Node, list[torch.fx.Node]]]:
    """(s, [x and the nodes of the max, consumers first]) if ``x`` (of ``rank`` dims) is
    ``s - max(s)`` over the last dim (``amax``, ``max(..).values`` / ``[0]``, the max possibly
    detached), else None. Who else reads those nodes is not looked at.

    Example::

        >>> row_max_subtracted(sub_node, 4)   # doctest: +SKIP
        (s, [sub, getitem, max])
    """
    if op_name(x) != "sub" or len(x.args) != 2 or x.kwargs:
        return None
    s, row_max = x.args
    chain = [x]
    if op_name(row_max) == "detach":
        chain.append(row_max)
        row_max = row_max.args[0]
    chain.append(row_max)
    if op_name(row_max) in ("getitem", "getattr"):  # max(...).values / max(...)[0]
        which = row_max.args[1] if len(row_max.args) > 1 else None
        if which not in (0, "values"):
            return None
        row_max = row_max.args[0]
        if op_name(row_max) != "max":
            return None
        chain.append(row_max)
    elif op_name(row_max) != "amax":
        return None
    if arg(row_max, 0, "input") is not s or not _last_dim(row_max, 1, rank):
        return None
    return s, chain
