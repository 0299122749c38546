"""Recognition: ``F.scaled_dot_product_attention`` calls become the flex_attention op.

Runs on the graph Dynamo hands the fa3 backend, before AOT autograd, so the rewritten site
is traced like a flex_attention call a user wrote: forward and backward alike. The rewrite is
made only when it is exact and our kernels will serve the site; every other call is left
alone and reported with the reason.

Served now: inference and training graphs (backward: flex_backward_lowering.py), except plain
calls (no attn_mask) on CUDA that SDPA's own kernels serve at least as fast (rewrite_pays.py);
dropout_p == 0, is_causal (top-left aligned, as SDPA defines it), scale, enable_gqa, attn_mask
(bool: keep where True; float: added), static shapes, a value head dim other than the
query's (DeepSeek's MLA: q/k 192, v 128). The causal block mask is built once, at
rewrite time, from the static sequence lengths and travels as extra graph inputs; attn_mask
goes through the mask planner shared with hand-written attention (attention_site.py). The flex
node is built by canonical.py, shared with the other recognition passes.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.fx
import torch.nn.functional as F

from . import canonical
from ..sizes import static_ints
from ..report import RecognizedSite
from .rewrite_pays import sdpa_keeps_plain_call

_SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                  "enable_gqa": False}


def _example(node: Any) -> Optional[torch.Tensor]:
    if isinstance(node, torch.fx.Node):
        val = node.meta.get("example_value")
        return val if isinstance(val, torch.Tensor) else None
    return None


def _why_not(args: dict[str, Any], served: Callable[[torch.Tensor, torch.Tensor], Optional[str]],
             keep_plain: bool = True) -> Optional[str]:
    mask = args["attn_mask"]
    if mask is not None:
        if args["is_causal"] is not False:
            return "attn_mask together with is_causal (SDPA itself rejects the pair)"
        m = _example(mask)
        if m is None:
            return "attn_mask is not a tensor of the graph"
        if m.dtype != torch.bool and not m.is_floating_point():
            return f"attn_mask of dtype {m.dtype} (SDPA takes bool or float masks)"
        if static_ints(m.shape) is None:
            return "attn_mask has a symbolic shape (fa3 recognizes static shapes)"
    if not isinstance(args["dropout_p"], (int, float)) or args["dropout_p"] != 0:
        return f"dropout_p={args['dropout_p']!r} (only 0 is exact)"
    if not isinstance(args["is_causal"], bool):
        return "is_causal is not a constant"
    if args["scale"] is not None and not isinstance(args["scale"], (int, float)):
        return "scale is not a constant"
    q, k, v = (_example(args[n]) for n in ("query", "key", "value"))
    if q is None or k is None or v is None:
        return "query/key/value carry no example value"
    shapes = [static_ints(t.shape) for t in (q, k, v)]
    if any(s is None for s in shapes):
        return "query/key/value have symbolic shapes (fa3 recognizes static shapes)"
    if any(len(s) != 4 for s in shapes):
        # (3-D and 5-D calls whose q, k, v share their batch dims were made 4-D by _as_4d)
        return (f"query/key/value of shapes {shapes[0]}, {shapes[1]}, {shapes[2]} are not 4-D and "
                "do not share their batch dims (fa3 merges batch dims into flex's heads only "
                "where q, k and v all have them)")
    (bq, hq, _, d), (bk, hk, nk, dk), (bv, hv, nv, _) = shapes
    # v's head dim may differ (it is the output's); served() checks it.
    if d != dk or bq != bk or (bk, hk, nk) != (bv, hv, nv):
        return (f"shapes q{shapes[0]} k{shapes[1]} v{shapes[2]} differ in batch, kv heads, kv "
                "length or q/k head dim")
    # One kv head broadcasts over the query heads as SDPA broadcasts any size-1 batch dim (Gemma 3n's
    # vision attention): flex's GQA with a single group computes exactly that
    if hq != hk and hk != 1 and (not args["enable_gqa"] or hq % hk):
        return f"{hq} query heads vs {hk} kv heads without enable_gqa"
    if mask is None and keep_plain:
        kept = sdpa_keeps_plain_call(q.device, shapes[0], shapes[1][2], args["is_causal"],
                                     any(t.requires_grad for t in (q, k, v)))
        if kept is not None:
            return kept
    return served(q, v)



def rewrite_sdpa(gm: torch.fx.GraphModule,
                 served: Callable[[torch.Tensor, torch.Tensor], Optional[str]],
                 keep_plain: bool = True) -> tuple[list[RecognizedSite], list[torch.Tensor]]:
    """Rewrite every exact, servable SDPA call of ``gm`` into the flex_attention op, in place.

    ``served(example_query, example_value)`` returns None if our kernels serve that
    device/dtype/head dims (the value's may differ from the query's), else the reason.
    ``keep_plain``: a plain call (no attn_mask) stays SDPA where that is faster (rewrite_pays.py);
    False rewrites it whatever its size (FP8 on: the user asked for FP8 attention at every site).
    Returns one RecognizedSite per SDPA call seen, and the constant tensors (block-mask tables)
    the rewrite appended to the graph's inputs: the caller passes them after the original
    inputs on every call.

    Example::

        >>> sites, extra_inputs = rewrite_sdpa(gm, lambda q, v: None)     # doctest: +SKIP
        >>> [s.rewritten for s in sites]                               # doctest: +SKIP
        [True]
    """
    sites: list[RecognizedSite] = []
    extra_inputs: list[torch.Tensor] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SDPA_TARGETS:
            continue
        args = dict(_SDPA_DEFAULTS)
        args.update(zip(_SDPA_ARGS, node.args))
        args.update(node.kwargs)
        inserted, out_shape = _as_4d(gm, node, args)
        reason = _why_not(args, served, keep_plain)
        if reason is not None:
            for made in reversed(inserted):   # the 4-D views, unused
                gm.graph.erase_node(made)
            sites.append(RecognizedSite("sdpa", node.name, False, reason))
            continue
        q, k = _example(args["query"]), _example(args["key"])
        if args["attn_mask"] is not None:
            site = _rewrite_masked(gm, node, args, served, extra_inputs, out_shape)
            if not site.rewritten:
                for made in reversed(inserted):
                    gm.graph.erase_node(made)
            sites.append(site)
            continue
        M, N = q.shape[2], k.shape[2]
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            keep = torch.ones(M, N, dtype=torch.bool, device=q.device)
            mask = canonical.dense_block_mask(keep.tril() if args["is_causal"] else None,
                                              1, 1, M, N, q.device)
        _replace_with_flex(gm, node, args, mask, extra_inputs, out_shape)
        score_mods = () if args["scale"] is None else (f"scale {args['scale']:g}",)
        sites.append(RecognizedSite("sdpa", node.name, True, score_mods=score_mods,
                                    mask="causal" if args["is_causal"] else "none",
                                    gqa_groups=q.shape[1] // k.shape[1]))
    if extra_inputs or any(s.rewritten for s in sites):
        gm.graph.lint()
        gm.recompile()
    return sites, extra_inputs


def _as_4d(gm: torch.fx.GraphModule, node: torch.fx.Node, args: dict
           ) -> tuple[list[torch.fx.Node], Optional[tuple]]:
    """SDPA over [BH, M, D] or [B, n1, .., nk, M, D] (timm's SAM, Hiera, NesT, Twins): the leading
    dims are batch dims, so the call is attention over them merged into flex's [B, H] (exact:
    a reshape in C order, undone on the output). When q, k and v share those dims, ``args``'s
    query/key/value (and attn_mask, viewed the same way) become 4-D reshape nodes inserted before
    the call. Returns the inserted nodes (to erase if the call is left alone) and the output
    shape to reshape back to (None: nothing changed)."""
    from .attention_site import flex_rank

    q, k, v = (_example(args[n]) for n in ("query", "key", "value"))
    if q is None or k is None or v is None:
        return [], None
    shapes = [static_ints(t.shape) for t in (q, k, v)]
    if any(s is None for s in shapes) or len({len(s) for s in shapes}) != 1:
        return [], None
    rank = len(shapes[0])
    lead = tuple(shapes[0][:-2])
    if rank == 4 or rank < 3 or any(tuple(s[:-2]) != lead for s in shapes):
        return [], None
    graph, made = gm.graph, []

    def view(x: torch.fx.Node, new_shape: tuple, method: str = "reshape") -> torch.fx.Node:
        with graph.inserting_before(node):
            out = graph.call_method(method, (x, *new_shape))
        out.meta["example_value"] = getattr(_example(x), method)(*new_shape)
        made.append(out)
        return out

    mask = args["attn_mask"]
    if mask is not None:
        m = _example(mask)
        mshape = static_ints(m.shape) if m is not None else None
        if mshape is None or len(mshape) > rank:
            return [], None
        mshape = (1,) * (rank - len(mshape)) + tuple(mshape)
        tail = tuple(mshape[-2:])
        if len(mshape) != m.dim():
            mask = view(mask, mshape)
        mlead = mshape[:-2]
        if rank == 3:
            mask4 = (1, mlead[0]) + tail
        elif all(s == 1 for s in mlead[1:]) or tuple(mlead[1:]) == lead[1:]:
            mask4 = (mlead[0], math.prod(mlead[1:])) + tail
        else:   # broadcast over some of the merged dims only: expand them first
            mask = view(mask, (mlead[0],) + lead[1:] + tail, "expand")
            mask4 = (mlead[0], math.prod(lead[1:])) + tail
        args["attn_mask"] = view(mask, mask4)
    for name, shape in zip(("query", "key", "value"), shapes):
        args[name] = view(args[name], flex_rank(shape))
    return made, tuple(static_ints(_example(node).shape))


def _rewrite_masked(gm: torch.fx.GraphModule, node: torch.fx.Node, args: dict,
                    served: Callable[[torch.Tensor, torch.Tensor], Optional[str]],
                    extra_inputs: list[torch.Tensor],
                    out_shape: Optional[tuple] = None) -> RecognizedSite:
    """An SDPA call with attn_mask: a bool mask keeps where True, a float mask is added.

    The mask goes through the same planner as hand-written attention: built from positions
    only, it becomes a mask_mod with a block mask made now; read from a tensor, the mods read
    it as a captured buffer and the block tables are computed at run time. SDPA gives 0 for
    rows with no key (bool or -inf masks), as flex does.
    """
    from .attention_site import AttentionSite, Refused

    q, k = _example(args["query"]), _example(args["key"])
    mask = args["attn_mask"]
    kind = "fill" if _example(mask).dtype == torch.bool else "add"
    scale = args["scale"] if args["scale"] is not None else q.shape[-1] ** -0.5
    try:
        site = AttentionSite.from_parts(
            gm, node, args["query"], args["key"], args["value"], scale=float(scale),
            gqa=q.shape[1] // k.shape[1], layers=[(kind, mask)], served=served,
            front_door="sdpa", zero_rows=True)
        site.out_shape = out_shape
        return site.rewrite(extra_inputs)
    except Refused as exc:
        return RecognizedSite("sdpa", node.name, False, str(exc))


def _replace_with_flex(gm: torch.fx.GraphModule, node: torch.fx.Node, args: dict,
                       block_mask, extra_inputs: list[torch.Tensor],
                       out_shape: Optional[tuple] = None) -> None:
    q, k, v = (_example(args[n]) for n in ("query", "key", "value"))
    prefix = f"_fa3_{node.name}"
    mask = (canonical.ModGraph(canonical.trace_mod(lambda env, idx: idx[2] >= idx[3], "mask",
                                                   0), [])
            if args["is_causal"] else None)
    scale = args["scale"] if args["scale"] is not None else q.shape[-1] ** -0.5
    with gm.graph.inserting_before(node):
        out = canonical.insert_flex(
            gm, args["query"], args["key"], args["value"], score=None, mask=mask,
            block_mask_entries=lambda attr: canonical.constant_block_mask_entries(
                gm, block_mask, attr, extra_inputs, prefix),
            scale=scale, example_qkv=(q, k, v), prefix=prefix)
        if out_shape is not None:   # back to the call's own batch dims
            out = gm.graph.call_method("reshape", (out, *out_shape))
    out.meta["example_value"] = node.meta.get("example_value")  # later passes read it
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)
