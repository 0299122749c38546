"""Attention sinks in the kernel's epilogue: folding ``sink_combine`` into the flex_attention site.

A site with sinks reaches Inductor as flex_attention's op followed by the exact correction
``fa3_inductor::sink_combine(out, lse, sinks)`` (runtime/sinks.py; docs/design/sinks.md). Two
rewrites make it one kernel, each exact, each skipped when its shape is not there (the correction
then runs as its own op, still exact):

- Training, on AOT's joint graph (:class:`SinksJointPass`, Inductor's ``joint_custom_post_pass``):
  the backward op reads the forward's own (out, lse) and the gradients sink_combine hands them
  (``sink_combine_backward``). With the sink in the denominator the backward is the usual one
  applied to the combined (out_s, lse_t) and their incoming gradients, so the backward op is rewired
  to those and ``sink_combine_backward`` drops out; the sinks' gradient (``sink_grad``) reads only
  combined values. The forward's own (out, lse) are then read by sink_combine alone.
- Forward, in the lowering (:func:`absorbable`, called by lowering/flex_lowering.py): when
  sink_combine is the only reader of the op's out and LSE, the kernel is launched with the sinks
  (runtime/ops.flex_fwd adds them in its epilogue) and sink_combine's own lowering
  (:func:`install`) hands the kernel's outputs on unchanged.

Example::

    >>> install()                                      # sink_combine's lowering (idempotent)
    >>> combine, sinks = absorbable(flex_node)         # doctest: +SKIP
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .. import _compat
from ..runtime import sinks as _sinks   # noqa: F401  (defines the fa3_inductor sink ops)
from .passes import source_hash

COMBINE = torch.ops.fa3_inductor.sink_combine.default
COMBINE_BACKWARD = torch.ops.fa3_inductor.sink_combine_backward.default
_FUSED = "fa3_sinks_fused"   # meta flag on a sink_combine node whose site's kernel added the sinks


def _getitems(node: torch.fx.Node) -> dict[int, torch.fx.Node]:
    """{index: getitem node} over ``node``'s users; {} if any user is not a getitem by index."""
    out = {}
    for user in node.users:
        if user.target is not operator.getitem or not isinstance(user.args[1], int):
            return {}
        out[user.args[1]] = user
    return out


def _only_combine(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The sink_combine reading the flex_attention ``node``'s out and LSE, if it is their only
    reader (and nothing reads the row max), else None."""
    items = _getitems(node)
    out, lse = items.get(0), items.get(1)
    if out is None or lse is None or any(i > 1 and g.users for i, g in items.items()):
        return None
    if len(out.users) != 1 or len(lse.users) != 1:
        return None
    combine = next(iter(out.users))
    if combine.target is not COMBINE or tuple(combine.args[:2]) != (out, lse):
        return None
    return combine


def absorbable(node: Optional[torch.fx.Node]) -> Optional[tuple[torch.fx.Node, torch.fx.Node]]:
    """(the sink_combine node, its sinks node) when the flex_attention ``node`` Inductor is lowering
    can add the sinks in its kernel (module docstring), else None. The sinks must be lowered
    already (they come before the site in the graph).

    Example::

        >>> absorbable(V.graph.current_node)   # doctest: +SKIP
    """
    from torch._inductor.virtualized import V

    if node is None:
        return None
    combine = _only_combine(node)
    if combine is None:
        return None
    sinks = combine.args[2]
    if not isinstance(sinks, torch.fx.Node) or sinks not in V.graph.env:
        return None
    return combine, sinks


def mark_absorbed(combine: torch.fx.Node) -> None:
    """The site's kernel adds the sinks: ``combine``'s lowering passes its inputs on.

    Example::

        >>> mark_absorbed(combine)   # doctest: +SKIP
    """
    combine.meta[_FUSED] = True


def _lower_combine(out, lse, sinks):
    node = _compat.current_fx_node()
    if node is not None and node.meta.get(_FUSED):
        return out, lse   # the kernel's outputs already include the sinks
    return _compat.fallback_kernel(COMBINE)(out, lse, sinks)


_lower_combine._fa3_wrapper = True  # type: ignore[attr-defined]


def install() -> None:
    """Put sink_combine's lowering in Inductor's table (idempotent).

    Example::

        >>> install()
    """
    table = _compat.inductor_lowerings()
    if not getattr(table.get(COMBINE), "_fa3_wrapper", False):
        table[COMBINE] = _lower_combine


class SinksJointPass(CustomGraphPass):
    """Inductor's ``joint_custom_post_pass`` for the fa3 backend: rewires each flex_attention backward
    that reads a sink_combine's inputs to read its outputs (module docstring).

    Example::

        >>> torch._inductor.config.patch(joint_custom_post_pass=SinksJointPass())   # doctest: +SKIP
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.target is COMBINE_BACKWARD:
                _rewire(graph, node)   # the backward left unread is dropped by Inductor

    def uuid(self) -> Any:
        return f"fa3_inductor-sinks-{source_hash()}"


def _rewire(graph: torch.fx.Graph, backward: torch.fx.Node) -> bool:
    """Point the flex_attention backward fed by ``backward`` (a sink_combine_backward) at the
    combined values; True if it did."""
    g_out_s, g_lse_t, out_s, lse, lse_t = backward.args
    items = _getitems(backward)
    g_out, g_lse = items.get(0), items.get(1)
    if g_out is None or g_lse is None or not isinstance(lse, torch.fx.Node):
        return False
    combine = lse_t.args[0] if isinstance(lse_t, torch.fx.Node) and lse_t.args else None
    if not isinstance(combine, torch.fx.Node) or combine.target is not COMBINE:
        return False
    out, lse_in = combine.args[:2]
    rewired = False
    for user in list(g_out.users):
        if user.target is not torch.ops.higher_order.flex_attention_backward:
            continue
        args = list(user.args)
        if args[3] is not out or args[4] is not lse_in or args[5] is not g_out or args[6] is not g_lse:
            continue
        if g_lse_t is None:   # no gradient reaches lse_t: a zero one, as AOT gives unused outputs
            with graph.inserting_before(user):
                g_lse_t = graph.call_function(torch.ops.aten.zeros_like.default, (lse_t,))
            g_lse_t.meta["val"] = torch.zeros_like(lse_t.meta["val"])
        args[3:7] = [out_s, lse_t, g_out_s, g_lse_t]
        user.args = tuple(args)
        rewired = True
    return rewired
