"""A score_mod's derivative as a ``tl`` mod, generated from the joint graph flex's backward receives.

torch's ``flex_attention_backward`` carries ``joint_graph``, an aten FX graph

    (score, b, h, q_idx, kv_idx, grad, *buffers) -> [d score, None × 4, d buffer for each buffer]

that backpropagates ``grad`` through the score_mod at one score. templates/modgen.py generates
kernel code from graphs of the shape ``(score, b, h, q_idx, kv_idx, *buffers) -> value``; this
module rewrites the joint graph into that shape, then hands it to the generator unchanged:

- ``grad`` becomes the constant 1.0. The joint graph is the chain rule at one scalar, linear in
  ``grad``: ``d score = grad · f'(score)``. With grad = 1 the graph computes ``f'(score)``, and the
  kernel multiplies it into dS itself (one multiply per score, as the graph would have done).
- the ``*_backward`` ops autograd emits become the pointwise ops the generator knows
  (``tanh_backward(g, y) = g·(1 − y²)``, ``sigmoid_backward``, ``threshold_backward``), and
  ``relu`` becomes ``clamp_min``; in-place twins (``logical_and_``) become their functional form
  when nothing else reads the mutated value.
- casts to float16 / bfloat16 are dropped (half-precision casts): autograd rounds each score's
  contribution to a half-precision captured tensor's dtype before its sum; the kernels sum in
  float32 and round once (Triton 3.6's interpreter also computes bfloat16 arithmetic wrongly: a
  bf16 table's gradient came out as 1e37 there).
- only ``d score`` is kept. Gradients of the captured buffers (a learnable bias table) are a
  scatter-add over the score tile into the buffer: buffer_grad.py generates those, through the
  same rewrite (:func:`pointwise_joint_graph`) with another value picked.

The result is a ``score_mod``-shaped source: ``score_mod(qk, sm_scale, b, h, q_idx, kv_idx, bufs)``
returning ``f'(score) / out_scale`` (templates/modgen.kernel_score_mod gives the factor), or None
when ``d score = grad`` (a score_mod that adds a term: ALiBi, biases): then dS passes unchanged.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx

from ..modgen import BufferSpec, GeneratedSource, UnsupportedMod, generate_mod_source

aten = torch.ops.aten

# Index arguments after the score; then the incoming gradient (joint graph only); then buffers.
_N_INDEX = 4
# In-place ops of the joint graph and their functional twins.
_FUNCTIONAL = {
    aten.logical_and_.default: aten.logical_and.default,
    aten.logical_or_.default: aten.logical_or.default,
    aten.logical_not_.default: aten.logical_not.default,
    aten.mul_.Tensor: aten.mul.Tensor,
    aten.add_.Tensor: aten.add.Tensor,
}


def _meta_like(node: torch.fx.Node, like: Any) -> None:
    """Give a new node the dtype record the generator reads (``meta['val'].dtype``)."""
    val = like.meta.get("val") if isinstance(like, torch.fx.Node) else None
    if val is not None:
        node.meta["val"] = val


def _rewrite_backward_op(graph: torch.fx.Graph, node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The pointwise form of one autograd ``*_backward`` op (or relu), inserted before ``node``;
    None for any other node."""
    target = node.target
    with graph.inserting_before(node):
        if target is aten.tanh_backward.default:          # g · (1 − y²), y = tanh(x)
            g, y = node.args
            y2 = graph.call_function(aten.mul.Tensor, (y, y))
            one_minus = graph.call_function(aten.rsub.Scalar, (y2, 1.0))
            out = graph.call_function(aten.mul.Tensor, (g, one_minus))
            parts = (y2, one_minus, out)
        elif target is aten.sigmoid_backward.default:     # g · y · (1 − y), y = sigmoid(x)
            g, y = node.args
            one_minus = graph.call_function(aten.rsub.Scalar, (y, 1.0))
            dy = graph.call_function(aten.mul.Tensor, (y, one_minus))
            out = graph.call_function(aten.mul.Tensor, (g, dy))
            parts = (one_minus, dy, out)
        elif target is aten.threshold_backward.default:   # g where x > t, else 0
            g, x, threshold = node.args
            above = graph.call_function(aten.gt.Scalar, (x, threshold))
            out = graph.call_function(aten.where.ScalarOther, (above, g, 0.0))
            parts = (out,)
        elif target is aten.relu.default:
            out = graph.call_function(aten.clamp_min.default, (node.args[0], 0.0))
            parts = (out,)
        else:
            return None
    for part in parts:
        _meta_like(part, node)
    if target is aten.threshold_backward.default:
        above.meta["val"] = torch.zeros((), dtype=torch.bool)
    return out


def pointwise_joint_graph(joint_gm: torch.fx.GraphModule, n_buffers: int,
                          pick: Callable[[list], Any], what: str = "score gradient"
                          ) -> Optional[torch.fx.GraphModule]:
    """One value of the joint graph as ``(score, b, h, q_idx, kv_idx, *buffers) -> value`` with
    the incoming gradient set to 1.0 (module docstring), or None when the value is the incoming
    gradient itself. ``pick`` chooses the value from the copied graph's results (d score, None × 4,
    d buffer...); ``what`` names it in errors. The joint graph is not modified.

    Example::

        >>> gm = pointwise_joint_graph(joint_gm, 0, lambda results: results[0])   # doctest: +SKIP
    """
    gm = torch.fx.GraphModule(joint_gm, copy.deepcopy(joint_gm.graph))
    graph = gm.graph
    placeholders = joint_placeholders(gm, n_buffers)
    output = next(n for n in graph.nodes if n.op == "output")
    results = output.args[0]
    value = pick(list(results) if isinstance(results, (tuple, list)) else [results])
    grad = placeholders[1 + _N_INDEX]
    if value is grad:
        return None
    if value is None:   # nothing differentiable reads the score (a mod that replaces it): its derivative is 0
        with graph.inserting_before(output):
            value = graph.call_function(aten.scalar_tensor.default, (0.0,), {"dtype": torch.float32})
        value.meta["val"] = torch.zeros((), dtype=torch.float32)
    if not isinstance(value, torch.fx.Node):
        raise UnsupportedMod(f"the joint graph's {what} is the constant {value!r}")
    # Only this value is generated: drop the others before anything else reads the graph.
    output.args = (value,)
    for node in list(graph.nodes):
        if _narrowing_cast(node):   # kept in float32 (module docstring: "Half-precision casts")
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _FUNCTIONAL:
            mutated = node.args[0]
            if isinstance(mutated, torch.fx.Node) and list(mutated.users) != [node]:
                raise UnsupportedMod(f"the joint graph mutates {mutated.name} in place ({node.target}) "
                                     "and reads it elsewhere; the mod generator needs a pure graph")
            node.target = _FUNCTIONAL[node.target]
            continue
        out = _rewrite_backward_op(graph, node)
        if out is not None:
            node.replace_all_uses_with(out)
            graph.erase_node(node)
    # grad -> 1.0: the graph is linear in it (module docstring).
    with graph.inserting_after(placeholders[-1]):
        one = graph.call_function(aten.scalar_tensor.default, (1.0,), {"dtype": torch.float32})
    one.meta["val"] = torch.ones((), dtype=torch.float32)
    grad.replace_all_uses_with(one)
    graph.erase_node(grad)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return gm


_CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def _narrowing_cast(node: torch.fx.Node) -> bool:
    """A cast to float16 / bfloat16 in the joint graph: autograd rounds each score's contribution to a
    half-precision captured tensor's dtype before summing; the kernels sum in float32 and round once."""
    if node.op != "call_function" or node.target not in _CASTS:
        return False
    dtype = node.kwargs.get("dtype") if node.target is aten._to_copy.default else node.args[1]
    return dtype in (torch.float16, torch.bfloat16)


def joint_placeholders(gm: torch.fx.GraphModule, n_buffers: int) -> list[torch.fx.Node]:
    """The joint graph's inputs (score, 4 indices, the incoming gradient, buffers), checked.

    Example::

        >>> [n.name for n in joint_placeholders(joint_gm, 0)][:2]   # doctest: +SKIP
        ['arg0_1', 'arg1_1']
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1 + _N_INDEX + 1 + n_buffers:
        raise UnsupportedMod(
            f"the flex backward joint graph has {len(placeholders)} inputs; expected score, 4 "
            f"indices, the incoming gradient and {n_buffers} captured buffers (torch 2.11-2.13's "
            "create_fw_bw_graph); report the torch version")
    return placeholders


def score_grad_graph(joint_gm: torch.fx.GraphModule, n_buffers: int) -> Optional[torch.fx.GraphModule]:
    """The joint graph rewritten as ``(score, b, h, q_idx, kv_idx, *buffers) -> f'(score)`` (module
    docstring), or None when the score's gradient is the incoming one unchanged.

    Example::

        >>> from torch._higher_order_ops.flex_attention import create_fw_bw_graph   # doctest: +SKIP
        >>> _, joint = create_fw_bw_graph(softcap, index_values, ())              # doctest: +SKIP
        >>> print(score_grad_graph(joint, 0).code)                                 # doctest: +SKIP
    """
    return pointwise_joint_graph(joint_gm, n_buffers, lambda results: results[0])


def score_grad_source(joint_gm: torch.fx.GraphModule,
                      buffers: Sequence[Optional[BufferSpec]]) -> Optional[GeneratedSource]:
    """``tl`` source of the score_mod's derivative (module docstring), None when it is 1.

    ``buffers`` are the score_mod's captured buffers (BufferSpec, None for a captured scalar), in
    the joint graph's order, which is the forward score_mod's. Load the source with
    ``templates.modgen.load_mod`` and pass it to the backward as ``score_grad_mod``. Raises
    :class:`~fa3_inductor.templates.modgen.UnsupportedMod` with the reason when the generator
    cannot express the derivative.

    Example::

        >>> src = score_grad_source(joint_gm, [])                       # doctest: +SKIP
        >>> grad_mod = load_mod(src) if src is not None else None       # doctest: +SKIP
    """
    gm = score_grad_graph(joint_gm, len(buffers))
    if gm is None:
        return None
    return generate_mod_source(gm, "score", list(buffers), "tl")
