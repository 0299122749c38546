"""Build the canonical form: one ``torch.ops.higher_order.flex_attention`` node in a Dynamo graph.

Every recognition pass (SDPA calls, hand-written attention) ends here, so the op is always
spelled the same way: score_mod and mask_mod as GraphModule attributes of the graph, captured
buffers as graph nodes (AOT autograd then differentiates them like any input), block-mask tables
either as constants (built at rewrite time from a mask that depends on positions only; they
become extra graph inputs) or as graph nodes (computed at run time from a dense mask input).

Example::

    >>> double = ModGraph(trace_mod(lambda env, idx: env.score * 2, "score", 0), [])
    >>> bm = dense_block_mask(None, 1, 1, 64, 64)
    >>> with gm.graph.inserting_before(site):                              # doctest: +SKIP
    ...     out = insert_flex(gm, q, k, v, score=double, mask=None, scale=0.25,
    ...                       block_mask_entries=lambda attr: constant_block_mask_entries(
    ...                           gm, bm, attr, extra_inputs, "_fa3_site"),
    ...                       example_qkv=(qe, ke, ve), prefix="_fa3_site")
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx

from .. import _compat

SPARSE_BLOCK = 128   # block-mask tile (torch's default): the unit of skipped work


@dataclasses.dataclass
class ModGraph:
    """A score_mod or mask_mod graph and the graph nodes of its captured buffers, in order."""

    gm: torch.fx.GraphModule
    buffers: list[torch.fx.Node]


def trace_mod(fn: Callable[[Any, list], Any], kind: str, n_buffers: int
              ) -> torch.fx.GraphModule:
    """An FX mod graph ``(score,) b, h, q_idx, kv_idx, *buffers -> value`` from ``fn(env, idx)``.

    ``fn`` receives an object with ``.score`` and ``.buffers`` and the index list
    ``[b, h, q_idx, kv_idx]``, all ``fx.Proxy``; constants it returns become tensors.

    Example::

        >>> gm = trace_mod(lambda env, idx: idx[2] >= idx[3], "mask", 0)   # doctest: +SKIP
    """
    from .lift import Env

    graph = torch.fx.Graph()
    tracer = torch.fx.proxy.GraphAppendingTracer(graph)
    names = (["score"] if kind == "score" else []) + ["b", "h", "q_idx", "kv_idx"]
    names += [f"buf{i}" for i in range(n_buffers)]
    proxies = [torch.fx.Proxy(graph.placeholder(n), tracer) for n in names]
    offset = 1 if kind == "score" else 0
    env = Env(proxies[0] if kind == "score" else None, proxies[offset + 4:])
    idx = proxies[offset:offset + 4]
    out = fn(env, list(idx))
    if not isinstance(out, torch.fx.Proxy):
        # A constant result (a mask that keeps everything): spell it as a tensor op on b.
        dtype = torch.bool if kind == "mask" else torch.float32
        out = idx[0].new_full((), out, dtype=dtype)
    elif kind == "mask":
        out = out.to(torch.bool)
    graph.output(out.node)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def dense_block_mask(keep: Optional[torch.Tensor], B: int, H: int, M: int, N: int,
                     device: torch.device = torch.device("cpu")):
    """A BlockMask (no mask_mod attached) from a boolean keep mask broadcastable to
    [B', H', M, N] (B', H' are 1 where the mask does not depend on them); ``None`` keeps all.

    Runs on real tensors at rewrite time, or inside the graph (traced by AOT autograd) for a
    mask that is only known at run time.

    Example::

        >>> bm = dense_block_mask(torch.ones(1, 1, 64, 64, dtype=torch.bool).tril(), 1, 1, 64, 64)
        >>> bm.kv_num_blocks.shape
        torch.Size([1, 1, 1])
    """
    from torch.nn.attention import flex_attention as fa

    if keep is None:
        keep = torch.ones(1, 1, M, N, dtype=torch.bool, device=device)
    while keep.dim() < 4:
        keep = keep.unsqueeze(0)
    keep = keep.expand(keep.shape[0], keep.shape[1], M, N)
    partial, full = _block_kinds(keep, SPARSE_BLOCK, SPARSE_BLOCK)
    return fa._create_sparse_block_from_block_mask((partial, full), None, (M, N),
                                                   SPARSE_BLOCK, SPARSE_BLOCK)


def _block_kinds(keep: torch.Tensor, q_block: int, kv_block: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) int8 block tables of a [B, H, M, N] bool keep mask: torch's
    ``_convert_mask_to_block_mask(keep, separate_full_blocks=True)``, counted in int32. Traced
    into a graph, torch's bool version (padded with False, then summed) made Inductor's CPU
    vectorizer emit C++ that does not compile when the padding is a masked load of a bool
    expression (a padding mask over one key, in a training graph); an int32 count is the same
    number.

    Example::

        >>> keep = torch.ones(1, 1, 3, 130, dtype=torch.bool)
        >>> [t.tolist() for t in _block_kinds(keep, 128, 128)]
        [[[[[1, 1]]]], [[[[0, 0]]]]]
    """
    B, H, M, N = keep.shape
    count = torch.nn.functional.pad(keep.to(torch.int32),
                                    (0, -N % kv_block, 0, -M % q_block))
    Mp, Np = count.shape[-2:]
    count = count.view(B, H, Mp // q_block, q_block, Np // kv_block, kv_block)
    count = count.permute(0, 1, 2, 4, 3, 5).sum(dim=[-2, -1])
    whole = q_block * kv_block
    full = count == whole
    partial = (count > 0) & (count < whole)
    return partial.to(torch.int8), full.to(torch.int8)


def runtime_block_tables(keep: torch.Tensor, M: int, N: int) -> tuple:
    """The tensor entries of ``dense_block_mask(keep, ...).as_tuple()``, computed in the graph.

    Example::

        >>> tables = runtime_block_tables(padding_keep, 64, 64)   # doctest: +SKIP
    """
    bm = dense_block_mask(keep, 1, 1, M, N, keep.device)
    return tuple(e for e in bm.as_tuple() if isinstance(e, torch.Tensor))


def noop_mask_graph() -> torch.fx.GraphModule:
    """The mask_mod graph of "no mask" (a constant True, which the kernels skip).

    Example::

        >>> len([n for n in noop_mask_graph().graph.nodes if n.op == "placeholder"])
        4
    """
    return trace_mod(lambda env, idx: True, "mask", 0)


def identity_score_graph() -> torch.fx.GraphModule:
    """The score_mod graph that returns the score unchanged.

    Example::

        >>> identity_score_graph()(1.5, 0, 0, 0, 0)
        1.5
    """
    return trace_mod(lambda env, idx: env.score, "score", 0)


def constant_block_mask_entries(gm: torch.fx.GraphModule, block_mask, mask_gm_node_fn,
                                extra_inputs: list, prefix: str) -> list:
    """Block-mask tuple for the op, its tensors as new graph inputs (appended to
    ``extra_inputs``; the backend passes them after the caller's inputs) and the mask_mod
    entry from ``mask_gm_node_fn()``.

    Example::

        >>> entries = constant_block_mask_entries(gm, bm, attr, extra, "_fa3_x")  # doctest: +SKIP
    """
    graph = gm.graph
    entries = []
    template = block_mask.as_tuple()
    for i, e in enumerate(template):
        if i == len(template) - 1:  # the mask_mod slot
            entries.append(mask_gm_node_fn())
        elif isinstance(e, torch.Tensor):
            # A new graph input (as Dynamo makes a captured BlockMask's tables): AOT autograd
            # fakifies inputs, while tensor constants in a Dynamo graph would reach its fake
            # tracing as real tensors.
            last = list(graph.find_nodes(op="placeholder"))[-1]
            with graph.inserting_after(last):
                ph = graph.placeholder(f"{prefix}_in{len(extra_inputs)}")
            ph._dynamo_source = None  # no user-visible source: AOT accepts None
            ph.meta["example_value"] = e
            extra_inputs.append(e)
            entries.append(ph)
        else:
            entries.append(e)
    return entries


def runtime_block_mask_entries(gm: torch.fx.GraphModule, keep_node: torch.fx.Node,
                               example_keep: torch.Tensor, M: int, N: int,
                               mask_gm_node_fn) -> list:
    """Block-mask tuple whose tables are computed in the graph from ``keep_node``.

    ``example_keep`` is a real tensor of the same shape: it tells which entries are tensors.
    """
    template = dense_block_mask(example_keep, 1, 1, M, N, example_keep.device).as_tuple()
    graph = gm.graph
    tables = graph.call_function(runtime_block_tables, (keep_node, M, N))
    entries, t = [], 0
    for i, e in enumerate(template):
        if isinstance(e, torch.Tensor):
            entries.append(graph.call_function(operator.getitem, (tables, t)))
            t += 1
        elif i == len(template) - 1:
            entries.append(mask_gm_node_fn())
        else:
            entries.append(e)
    return entries


def insert_flex(gm: torch.fx.GraphModule, q: torch.fx.Node, k: torch.fx.Node,
                v: torch.fx.Node, *, score: Optional[ModGraph], mask: Optional[ModGraph],
                block_mask_entries: Callable[[Callable[[], torch.fx.Node]], list],
                scale: float, example_qkv: Sequence[torch.Tensor], prefix: str
                ) -> torch.fx.Node:
    """Insert the flex_attention op at the graph's current insertion point; returns the node
    of its output (``[B, Hq, M, Dv]``).

    ``block_mask_entries(mask_attr)`` builds the block-mask tuple; ``mask_attr()`` makes the
    get_attr node of the mask_mod graph. ``score``/``mask`` None mean identity / no mask.

    Example::

        >>> with gm.graph.inserting_before(site):                                # doctest: +SKIP
        ...     out = insert_flex(gm, q, k, v, score=None, mask=None, scale=0.25,
        ...                       block_mask_entries=lambda attr: entries, ...)
    """
    graph = gm.graph

    def module_attr(name: str, value: torch.nn.Module) -> torch.fx.Node:
        setattr(gm, f"{prefix}_{name}", value)
        return graph.get_attr(f"{prefix}_{name}")

    score_gm = score.gm if score is not None else identity_score_graph()
    mask_gm = mask.gm if mask is not None else noop_mask_graph()
    score_node = module_attr("score_mod", score_gm)
    entries = block_mask_entries(lambda: module_attr("mask_mod", mask_gm))
    options = _compat.flex_kernel_options(*example_qkv)
    flex = graph.call_function(
        torch.ops.higher_order.flex_attention,
        (q, k, v, score_node, tuple(entries), float(scale), options,
         tuple(score.buffers) if score is not None else (),
         tuple(mask.buffers) if mask is not None else ()))
    return graph.call_function(operator.getitem, (flex, 0))
