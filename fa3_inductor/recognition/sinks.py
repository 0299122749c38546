"""Recognition of attention sinks as models write them (gpt-oss's eager attention).

gpt-oss gives each query head a learnable logit that joins every row's softmax denominator, spelled
as an extra score column that is dropped after the softmax::

    sinks = module.sinks.reshape(1, -1, 1, 1).expand(B, -1, M, -1)     # [B, H, M, 1]
    logits = torch.cat([scores, sinks], dim=-1)                         # [B, H, M, N + 1]
    logits = logits - logits.max(dim=-1, keepdim=True).values           # optional: softmax ignores it
    probs = F.softmax(logits, dim=-1)[..., :-1]                         # the sink's column dropped
    out = probs @ v

That is exactly attention over ``scores`` with ``sinks[h]`` in the denominator: the site becomes
flex_attention followed by ``fa3_inductor::sink_combine`` (runtime/sinks.py), which the lowering
folds into the kernel's epilogue (lowering/sinks_fusion.py). The match is exact only: the column
must be a per-head tensor broadcast over batch and rows (checked by evaluating its view chain on
the head indices), and the slice must drop exactly that column. Rows that see no key get 0 in eager
(the sink takes all the weight) as in the kernel, so masks that leave such rows are served.

The manual recognizer (recognize_manual.py) calls :func:`match_sinks` on a ``getitem`` between the
softmax and the matmul with V; attention_site.py calls :func:`attach_sinks` after building the op.

Example::

    >>> sink = match_sinks(getitem_node)          # doctest: +SKIP
    >>> sink.scores, sink.sinks                   # doctest: +SKIP
    (attn_weights_1, l_..._sinks_)
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional

import torch
import torch.fx

from ..runtime import sinks as _sinks   # noqa: F401  (defines fa3_inductor::sink_combine)
from .fx_ops import arg, example, op_name, static_shape
from .spelled_softmax import row_max_subtracted

_SOFTMAX = ("softmax", "_softmax")
_CAT = ("cat", "concat", "concatenate")
# What may lie between the [H] sinks tensor and the cat's column: views and broadcasts (checked by
# evaluation) and casts (kept: the column's values are the cast ones).
_VIEWS = {"reshape", "view", "expand", "expand_as", "broadcast_to", "unsqueeze", "getitem",
          "contiguous"}
_CASTS = {"to", "float", "half", "bfloat16", "type", "type_as"}


@dataclasses.dataclass
class SinkMatch:
    """An attention site's sinks column, as found between its softmax and its matmul with V."""

    softmax: torch.fx.Node   # the softmax over the scores and the sinks column
    scores: torch.fx.Node    # the attention scores [B, H, M, N] without the column
    sinks: torch.fx.Node     # the [H] tensor the column is read from
    dtype: torch.dtype       # the column's dtype (the sinks are cast to it first, as eager does)


def match_sinks(node: Any) -> Optional[SinkMatch]:
    """The sinks spelling ending at ``node`` (``probs[..., :-1]``, module docstring), or None when
    ``node`` is not such a slice of a softmax over a cat with a per-head column.

    Example::

        >>> match_sinks(scores_node).sinks.name   # doctest: +SKIP
        'l_self_parameters_sinks_'
    """
    if op_name(node) != "getitem" or not isinstance(node.args[0], torch.fx.Node):
        return None
    probs = node.args[0]
    if op_name(probs) not in _SOFTMAX or len(probs.users) != 1:
        return None
    shape = static_shape(probs)
    if shape is None or len(shape) != 4 or not _drops_last_column(node.args[1], shape):
        return None
    dim = arg(probs, 1, "dim")
    if not isinstance(dim, int) or dim % 4 != 3:
        return None
    logits = _without_row_max(arg(probs, 0, "input"))
    if op_name(logits) not in _CAT:
        return None
    parts, cat_dim = arg(logits, 0, "tensors"), arg(logits, 1, "dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or cat_dim % 4 != 3:
        return None
    scores, column = parts
    if static_shape(scores) != (*shape[:3], shape[3] - 1) or static_shape(column) != (*shape[:3], 1):
        return None
    sinks = _per_head_source(column, shape[1])
    if sinks is None:
        return None
    return SinkMatch(probs, scores, sinks, example(column).dtype)


def attach_sinks(graph: torch.fx.Graph, out: torch.fx.Node, match: SinkMatch) -> torch.fx.Node:
    """Insert ``sink_combine`` after the flex_attention op whose output is ``out`` (a getitem of the
    op, at the graph's insertion point); returns the combined output's node.

    Example::

        >>> out = attach_sinks(graph, out, site.sink)   # doctest: +SKIP
    """
    flex = out.args[0]
    lse = graph.call_function(operator.getitem, (flex, 1))
    sinks = match.sinks
    if example(sinks).dtype != match.dtype:
        sinks = graph.call_method("to", (sinks, match.dtype))
    combined = graph.call_function(torch.ops.fa3_inductor.sink_combine.default, (out, lse, sinks))
    return graph.call_function(operator.getitem, (combined, 0))


def _drops_last_column(index: Any, shape: tuple[int, ...]) -> bool:
    """``index`` is ``[..., :-1]`` (or ``[:, :, :, :N]``) on a 4-D tensor whose last dim is N + 1."""
    if not isinstance(index, tuple) or not index:
        return False
    *lead, last = index
    if lead and lead[0] is Ellipsis:
        lead = lead[1:]
    elif len(lead) != 3:
        return False
    if any(not (isinstance(s, slice) and s == slice(None)) for s in lead):
        return False
    n = shape[3]
    return isinstance(last, slice) and last.start in (None, 0) and last.step in (None, 1) and \
        last.stop in (-1, n - 1)


def _without_row_max(x: Any) -> Any:
    """``logits`` for ``logits - logits.max(-1, keepdim=True)`` (softmax ignores a per-row shift,
    so dropping it is exact); else ``x`` itself."""
    found = row_max_subtracted(x, 4)
    return x if found is None else found[0]
    a, b = arg(x, 0, "input"), arg(x, 1, "other")
    name = op_name(b)
    if name == "getitem" and b.args[1] == 0:
        b = b.args[0]
        name = op_name(b)
    elif name == "getattr" and b.args[1] == "values":
        b = b.args[0]
        name = op_name(b)
    if name in ("max", "amax") and arg(b, 0, "input") is a and \
            arg(b, 1, "dim") in (-1, 3) and arg(b, 2, "keepdim", False) is True:
        return a
    return x


def _per_head_source(column: torch.fx.Node, heads: int) -> Optional[torch.fx.Node]:
    """The [heads] tensor ``column`` ([B, heads, M, 1]) broadcasts per head, or None: its view chain
    is replayed on the head indices and must give index h at every [b, h, m, 0]."""
    chain, n = [], column
    while static_shape(n) != (heads,):
        name = op_name(n)
        if name not in _VIEWS and name not in _CASTS:
            return None
        chain.append(n)
        n = n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
        if n is None:
            return None
    base = n
    values = {base: torch.arange(heads, dtype=torch.float64)}
    try:
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            for node in reversed(chain):
                values[node] = _replay(node, values)
            got = values[column]
            want = torch.arange(heads, dtype=torch.float64).view(1, heads, 1, 1).expand(got.shape)
            exact = got.shape == static_shape(column) and torch.equal(got.double(), want)
    except (_NotReplayable, RuntimeError, TypeError, ValueError, IndexError):
        return None
    return base if exact else None


class _NotReplayable(Exception):
    pass


def _replay(node: torch.fx.Node, values: dict) -> torch.Tensor:
    """``node`` evaluated on ``values`` of its tensor inputs; a cast keeps float64 (only the
    positions matter here)."""
    def value(a):
        if isinstance(a, torch.fx.Node):
            if a not in values:
                raise _NotReplayable(a.name)
            return values[a]
        return a

    if op_name(node) in _CASTS:
        return value(node.args[0])
    args = torch.fx.node.map_aggregate(node.args, value)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, value)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)
