"""Gradients of a score_mod's captured tensors (a learnable bias table, ALiBi slopes), generated
from the joint graph flex's backward receives.

In that graph a captured buffer that requires grad gets its gradient as a scatter-add of one value
per score into a zero buffer: ``flex_lib.zeros_and_scatter(shape, [i_0, ...], value)`` in the graph
Inductor hands the lowering, ``index_put(new_zeros(shape), [i_0, ...], value, accumulate=True)`` in
the one ``create_fw_bw_graph`` builds eagerly. Per buffer this module generates two mods with
templates/modgen.py, in either dialect:

- the value, as a ``score_mod``-shaped function ``(qk, sm_scale, b, h, q_idx, kv_idx, bufs)``.
  The value is linear in the incoming gradient dS (the gradient of the modded score, what the
  kernel has as P ⊙ (dP − Δ)), so it is generated with dS = 1 (score_grad.pointwise_joint_graph)
  and the kernel multiplies: value = dS · w. None when value = dS (a bias added to the score).
  The mod's ``out_scale`` (kernel_score_mod's factor) is applied once to the summed gradient.
- the element offset ``index_mod(b, h, q_idx, kv_idx, bufs)`` of ``[i_0, ...]`` in the contiguous
  gradient (modgen.generate_offset_source).

plus which of q_idx and kv_idx the offset reads: what the kernel may sum in registers before it
adds to memory (kernel.py, "Buffer gradients").
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional, Sequence

import torch
import torch.fx

from ..modgen import (BufferSpec, GeneratedSource, UnsupportedMod, generate_mod_source,
                      generate_offset_source)
from .score_grad import _N_INDEX, joint_placeholders, pointwise_joint_graph

aten = torch.ops.aten
_ZEROS = (aten.new_zeros.default, aten.zeros.default)


@dataclasses.dataclass(frozen=True)
class BufferGradSource:
    """One captured buffer's gradient, generated: Σ over scores of dS · w added at ``offset``.

    Example::

        >>> src = buffer_grad_sources(joint_gm, [BufferSpec.of(slopes)])[0]   # doctest: +SKIP
        >>> (src.buffer, src.shape, src.along_q, src.along_kv)                # doctest: +SKIP
        (0, (8,), False, False)
    """

    buffer: int                       # position among the score_mod's captured inputs
    shape: tuple[int, ...]            # the buffer's shape (its gradient's)
    value: Optional[GeneratedSource]  # w as a score_mod-shaped mod; None when w = 1
    offset: GeneratedSource           # index_mod: the element the value is added to
    along_q: bool                     # the offset varies with q_idx
    along_kv: bool                    # the offset varies with kv_idx


def _as_scatter(node: Any) -> Optional[tuple[list[int], list[Any], Any]]:
    """(shape, indices, value) when ``node`` scatter-adds a value into zeros, else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"):
        return None
    if str(node.target) == "flex_lib.zeros_and_scatter.default":
        shape, indices, value = node.args
        return list(shape), list(indices), value
    if node.target in (aten.index_put.default, aten.index_put_.default):
        base, indices, value = node.args[:3]
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate")
        if accumulate and isinstance(base, torch.fx.Node) and base.target in _ZEROS:
            shape = base.args[1] if base.target is aten.new_zeros.default else base.args[0]
            return list(shape), list(indices), value
    return None


def _scatter_parts(node: Any, buffer: int, spec: BufferSpec) -> tuple[list[int], list[Any], Any]:
    """(shape, indices, value) of a buffer's gradient in the joint graph. Chained indexing
    (``table[h][q_idx - kv_idx]``) scatters a scatter: the inner one fills the dimensions the outer
    leaves, so the two are one scatter at the indices of both. A 0-d buffer read as it is (a learnable
    temperature: ``score * temp``) is not scattered: its gradient node is the value itself, one per
    score, summed into the buffer's only element (no indices)."""
    parts = _as_scatter(node)
    if parts is None:
        if not spec.shape and isinstance(node, torch.fx.Node):   # (the incoming gradient itself: w = 1)
            return [], [], node
        raise UnsupportedMod(f"the joint graph's gradient of captured buffer {buffer} is {node!r}, not "
                             "a scatter-add into zeros (zeros_and_scatter); report the torch version")
    shape, indices, value = parts
    inner = _as_scatter(value)
    while inner is not None and len(indices) + len(inner[0]) == len(shape) and \
            list(inner[0]) == list(shape[len(indices):]):
        indices, value = indices + inner[1], inner[2]
        inner = _as_scatter(value)
    return shape, indices, value


def _index_graph(gm: torch.fx.GraphModule, placeholders: list[torch.fx.Node],
                 indices: list[Any], buffer: int) -> torch.fx.GraphModule:
    """``gm`` (a copy of the joint graph) rewritten in place as
    ``(b, h, q_idx, kv_idx, *buffers) -> [i_0, ...]``."""
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = (list(indices),)
    graph.eliminate_dead_code()
    for unused in (placeholders[0], placeholders[1 + _N_INDEX]):   # score, incoming gradient
        if unused.users:
            raise UnsupportedMod(f"captured buffer {buffer} is indexed by a value computed from "
                                 "the score; index captured tensors by b, h, q_idx, kv_idx only")
        graph.erase_node(unused)
    graph.lint()
    gm.recompile()
    return gm


def _reads(nodes: Sequence[Any], leaf: torch.fx.Node) -> bool:
    """Whether any of ``nodes`` depends on ``leaf``."""
    seen: set[torch.fx.Node] = set()
    todo = [n for n in nodes if isinstance(n, torch.fx.Node)]
    while todo:
        node = todo.pop()
        if node is leaf:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(node.all_input_nodes)
    return False


def buffer_grad_sources(joint_gm: torch.fx.GraphModule, buffers: Sequence[Optional[BufferSpec]],
                        dialect: str = "tl") -> list[BufferGradSource]:
    """The generated gradient of every captured buffer the joint graph differentiates (module
    docstring), in buffer order; empty when none needs one.

    ``buffers`` are the score_mod's captured inputs (BufferSpec, None for a captured scalar) in the
    joint graph's order, as for score_grad.score_grad_source. Pass the result with the gradient
    tensors to the backward (host.prepare_generic_backward's ``buffer_grads``). Raises
    :class:`~fa3_inductor.templates.modgen.UnsupportedMod` with the reason when a gradient does not
    generate.

    Example::

        >>> slopes = torch.rand(8, requires_grad=True)
        >>> alibi = lambda s, b, h, q, kv: s + slopes[h] * (kv - q)
        >>> gm, bufs = trace_mod(alibi, "score")                                 # doctest: +SKIP
        >>> _, joint = create_fw_bw_graph(gm, index_values, tuple(bufs))         # doctest: +SKIP
        >>> [s.along_q for s in buffer_grad_sources(joint, [BufferSpec.of(slopes)])]  # doctest: +SKIP
        [False]
    """
    n_buffers = len(buffers)
    output = next(n for n in joint_gm.graph.nodes if n.op == "output")
    results = output.args[0]
    results = list(results) if isinstance(results, (tuple, list)) else [results]
    if len(results) != 1 + _N_INDEX + n_buffers:
        raise UnsupportedMod(f"the flex backward joint graph returns {len(results)} values for "
                             f"{n_buffers} captured buffers; report the torch version")
    sources = []
    for i, result in enumerate(results[1 + _N_INDEX:]):
        if result is None:
            continue
        spec = buffers[i]
        if spec is None:
            raise UnsupportedMod(f"captured input {i} is a scalar with a gradient; capture it as a "
                                 "0-d tensor")

        def pick(results: list, i: int = i) -> Any:
            return _scatter_parts(results[1 + _N_INDEX + i], i, spec)[2]

        value_gm = pointwise_joint_graph(joint_gm, n_buffers, pick, f"gradient of buffer {i}")
        value = None if value_gm is None else generate_mod_source(value_gm, "score", list(buffers),
                                                                  dialect)
        gm = torch.fx.GraphModule(joint_gm, copy.deepcopy(joint_gm.graph))
        placeholders = joint_placeholders(gm, n_buffers)
        copied = next(n for n in gm.graph.nodes if n.op == "output").args[0][1 + _N_INDEX + i]
        shape, indices, _ = _scatter_parts(copied, i, spec)
        if tuple(shape) != tuple(spec.shape):
            raise UnsupportedMod(f"the joint graph scatters the gradient of captured buffer {i} "
                                 f"into shape {shape}, the buffer is {list(spec.shape)}")
        q_idx, kv_idx = placeholders[3], placeholders[4]
        along_q, along_kv = _reads(indices, q_idx), _reads(indices, kv_idx)
        index_gm = _index_graph(gm, placeholders, indices, i)
        offset = generate_offset_source(index_gm, list(buffers), shape, dialect)
        sources.append(BufferGradSource(i, tuple(shape), value, offset, along_q, along_kv))
    return sources
