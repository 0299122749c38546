"""Fill constants of rewritten mods kept inside the range of the dtype flex_attention traces them in.

GPT-Neo computes its scores in float32 (it upcasts bf16 q and k) and masks them with
``torch.where(keep, scores, torch.finfo(torch.float32).min)``. Recognition serves the site on the
bf16 q and k (the upcast is lossless: our kernels compute scores in float32) and writes the mask
into the score_mod as ``torch.where(keep, score, -3.4028e38)``. flex_attention traces a score_mod
with a score of the query's dtype, so AOT autograd spells that fill
``aten.scalar_tensor(-3.4028e38, dtype=torch.bfloat16)``, beyond bfloat16's largest finite value
(3.3895e38), and Inductor's constant folding of the mod's subgraph raises on CUDA ("value cannot
be converted to type c10::BFloat16 without overflow"; a one-element CPU tensor turns it into -inf
silently). :func:`saturate_fills` raises such a fill to the dtype's most negative finite value.

Exact: a fill this negative only masks (recognition counts fills at or below -65504 as masks), and
still does once raised. Our kernels compute the mod in float32 and the softmax in log2 units, where
the float32 fill and bfloat16's -3.3895e38 both overflow to -inf; with float16 queries the fill
becomes -65504, whose weight exp(-65504 - rowmax) is 0 in float32 too (MASK_FILL_MAX's assumption:
scores in a row differ by less than ~65000). Rows the mask leaves with no key are fixed up after the
op from the mask itself, not from the fill (recognition/attention_site.py). In the CPU interpreter
outputs and gradients are bit-identical to the unclamped mods', bf16 and fp16 alike, a row with no
key included. A huge positive fill does not mask: it is left as written.

Example::

    >>> saturate_fills(gm, new_flex_nodes)   # after recognition rewrote the sites   # doctest: +SKIP
    1
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch
import torch.fx

from .. import _compat
from .._log import log
from .fx_ops import buffer_example, example

# Ops whose float operands are fills: converted to the op's result dtype when traced.
_FILL_FUNCTIONS = (torch.where, torch.masked_fill)
_FILL_METHODS = ("where", "masked_fill")


def saturate_fills(gm: torch.fx.GraphModule, flex_nodes: Iterable[torch.fx.Node]) -> int:
    """Clamp the fills of these flex_attention nodes' score_mod and mask_mod graphs to the finite
    range of the dtype each fill takes when flex_attention traces the mod (the query's dtype for
    the score); returns how many fills changed. Edits the mod graphs in place: call it on mods
    recognition made, not on ones shared with the graph Dynamo handed the backend.

    Example::

        >>> saturate_fills(gm, [n for n in flex_nodes(gm) if n.name not in before])  # doctest: +SKIP
        1
    """
    changed = 0
    for node in flex_nodes:
        q, score_mod, block_mask = node.args[0], node.args[3], node.args[4]
        score_bufs, mask_bufs = (list(node.args[i]) if len(node.args) > i else [] for i in (7, 8))
        query = example(q)
        if query is None:
            continue
        mask_mod = block_mask[-1] if isinstance(block_mask, (tuple, list)) and block_mask else None
        for mod_node, leading, buffers in ((score_mod, [query.dtype], score_bufs),
                                           (mask_mod, [], mask_bufs)):
            mod = _submodule(gm, mod_node)
            if mod is not None:
                changed += _saturate_mod(mod, leading, buffers)
    return changed


def _saturate_mod(mod: torch.fx.GraphModule, leading: list[torch.dtype], buffers: list) -> int:
    """Raise the fills below their traced dtype's range in one mod graph to its most negative
    finite value; ``leading``: the score's dtype, or [] for a mask_mod; ``buffers``: the
    captured buffers' nodes."""
    fills = [n for n in mod.graph.nodes if _is_fill(n) and any(_below(a) for a in n.args)]
    if not fills:
        return 0
    dtypes = _result_dtypes(mod, leading, buffers)
    if dtypes is None:
        return 0
    changed = 0
    for n in fills:
        dtype = dtypes.get(n)
        if dtype is None or not dtype.is_floating_point:
            continue
        lowest = torch.finfo(dtype).min
        args = tuple(lowest if _below(a, lowest) else a for a in n.args)
        changed += sum(a is not b for a, b in zip(args, n.args))
        n.args = args
    if changed:
        mod.recompile()
        log.debug("fa3_inductor: clamped %d mod fill(s) to the traced dtype's range", changed)
    return changed


def _is_fill(n: torch.fx.Node) -> bool:
    return ((n.op == "call_function" and n.target in _FILL_FUNCTIONS)
            or (n.op == "call_method" and n.target in _FILL_METHODS))


def _below(a: Any, lowest: float = torch.finfo(torch.float16).min) -> bool:
    """A finite Python float below ``lowest`` (by default float16's, the narrowest range a
    query's dtype has: the cheap first look). Only masking fills are clamped: a value this
    negative masks, before and after; a huge positive one is left to fail as before."""
    return isinstance(a, float) and math.isfinite(a) and a < lowest


def _result_dtypes(mod: torch.fx.GraphModule, leading: list[torch.dtype], buffers: list
                   ) -> Optional[dict[torch.fx.Node, torch.dtype]]:
    """Each node's result dtype when the mod runs as flex_attention traces it (0-d score of the
    query's dtype and int32 indices, buffers of their dtypes, ``buf[i, j]`` as ``aten.index``),
    found on meta tensors (size-1 buffer dims: a shape decides no dtype); None if a buffer's
    dtype is unknown or the mod does not run there."""
    args = [torch.empty((), dtype=d, device="meta") for d in leading]
    args += [torch.empty((), dtype=torch.int32, device="meta") for _ in range(4)]
    for buf in buffers:
        stand_in = _buffer_meta(buf) if isinstance(buf, torch.fx.Node) else buf
        if stand_in is None:
            return None
        args.append(stand_in)
    dtypes: dict[torch.fx.Node, torch.dtype] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                dtypes[n] = out.dtype
            return out

    try:
        with _compat.getitem_as_index():
            Recorder(mod).run(*args)
    except Exception as exc:   # an op without a meta kernel: leave the mod as it is
        log.debug("fa3_inductor: mod fills left as written (%s: %s)", type(exc).__name__, exc)
        return None
    return dtypes


def _buffer_meta(node: torch.fx.Node) -> Optional[torch.Tensor]:
    """A meta tensor of a captured buffer's dtype and rank, size-1 dims (fx_ops.buffer_example);
    None if unknown."""
    made = buffer_example(node)
    return None if made is None else torch.empty((1,) * made.dim(), dtype=made.dtype, device="meta")


def _submodule(gm: torch.fx.GraphModule, node: Any) -> Optional[torch.fx.GraphModule]:
    """The mod graph a ``get_attr`` node names, or None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "get_attr"):
        return None
    mod = getattr(gm, node.target, None)
    return mod if isinstance(mod, torch.fx.GraphModule) else None
