"""Recognition: ``F.scaled_dot_product_attention`` calls become the flex_attention op.

Runs on the graph Dynamo hands the fa3 backend, before AOT autograd, so the rewritten site
is traced like a flex_attention call a user wrote: forward and backward alike. The rewrite is
made only when it is exact and our kernels will serve the site; every other call is left
alone and reported with the reason.

Served now: inference graphs; no attn_mask, dropout_p == 0, is_causal (top-left aligned, as
SDPA defines it), scale, enable_gqa; static shapes. The causal block mask is built once, at
rewrite time, from the static sequence lengths and travels as extra graph inputs.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional

import torch
import torch.fx
import torch.nn.functional as F

from .. import _compat
from .flex_lowering import static_ints
from .report import RecognizedSite

_SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                  "enable_gqa": False}


def _identity_score(score, b, h, q_idx, kv_idx):
    return score


def _causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _example(node: Any) -> Optional[torch.Tensor]:
    if isinstance(node, torch.fx.Node):
        val = node.meta.get("example_value")
        return val if isinstance(val, torch.Tensor) else None
    return None


def _why_not(args: dict[str, Any], served: Callable[[torch.Tensor], Optional[str]]
             ) -> Optional[str]:
    if args["attn_mask"] is not None:
        return "attn_mask tensors are not recognized yet"
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
    if any(s is None or len(s) != 4 for s in shapes):
        return "query/key/value are not 4-D with static shapes"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        # Not yet: the rewritten training graph (torch's flex backward after our forward) has
        # not been checked on a GPU, and torch's FlexAttention has no CPU backward at all.
        return "training graphs are not rewritten yet (inference only)"
    (bq, hq, _, d), (bk, hk, _, dk), (_, _, _, dv) = shapes
    if d != dk or d != dv or bq != bk:
        return f"shapes q{shapes[0]} k{shapes[1]} v{shapes[2]} differ in batch or head dim"
    if hq != hk and (not args["enable_gqa"] or hq % hk):
        return f"{hq} query heads vs {hk} kv heads without enable_gqa"
    return served(q)


def rewrite_sdpa(gm: torch.fx.GraphModule,
                 served: Callable[[torch.Tensor], Optional[str]]
                 ) -> tuple[list[RecognizedSite], list[torch.Tensor]]:
    """Rewrite every exact, servable SDPA call of ``gm`` into the flex_attention op, in place.

    ``served(example_query)`` returns None if our kernels serve that device/dtype/head dim,
    else the reason. Returns one RecognizedSite per SDPA call seen, and the constant tensors
    (block-mask tables) the rewrite appended to the graph's inputs: the caller passes them
    after the original inputs on every call.

    Example::

        >>> sites, extra_inputs = rewrite_sdpa(gm, lambda q: None)     # doctest: +SKIP
        >>> [s.rewritten for s in sites]                               # doctest: +SKIP
        [True]
    """
    from torch.nn.attention.flex_attention import create_block_mask

    sites: list[RecognizedSite] = []
    extra_inputs: list[torch.Tensor] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SDPA_TARGETS:
            continue
        args = dict(_SDPA_DEFAULTS)
        args.update(zip(_SDPA_ARGS, node.args))
        args.update(node.kwargs)
        reason = _why_not(args, served)
        if reason is not None:
            sites.append(RecognizedSite("sdpa", node.name, False, reason))
            continue
        q, k = _example(args["query"]), _example(args["key"])
        M, N = q.shape[2], k.shape[2]
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            mask = create_block_mask(_causal_mask if args["is_causal"] else _full_mask, None,
                                     None, M, N, device=q.device)
        _replace_with_flex(gm, node, args, mask, extra_inputs)
        score_mods = () if args["scale"] is None else (f"scale {args['scale']:g}",)
        sites.append(RecognizedSite("sdpa", node.name, True, score_mods=score_mods,
                                    mask="causal" if args["is_causal"] else "none",
                                    gqa_groups=q.shape[1] // k.shape[1]))
    if extra_inputs or any(s.rewritten for s in sites):
        gm.graph.lint()
        gm.recompile()
    return sites, extra_inputs


def _full_mask(b, h, q_idx, kv_idx):
    return q_idx >= 0


def _replace_with_flex(gm: torch.fx.GraphModule, node: torch.fx.Node, args: dict,
                       block_mask, extra_inputs: list[torch.Tensor]) -> None:
    graph = gm.graph
    prefix = f"_fa3_{node.name}"

    def tensor_input(value: torch.Tensor) -> torch.fx.Node:
        # A new graph input (as Dynamo makes a captured BlockMask's tables): AOT autograd
        # fakifies inputs, while tensor constants in a Dynamo graph would reach its fake
        # tracing as real tensors.
        last = list(graph.find_nodes(op="placeholder"))[-1]
        with graph.inserting_after(last):
            ph = graph.placeholder(f"{prefix}_in{len(extra_inputs)}")
        ph._dynamo_source = None  # no user-visible source: AOT accepts None
        ph.meta["example_value"] = value
        extra_inputs.append(value)
        return ph

    def module_attr(name: str, value: torch.nn.Module) -> torch.fx.Node:
        setattr(gm, f"{prefix}_{name}", value)
        return graph.get_attr(f"{prefix}_{name}")

    q, k, v = (_example(args[n]) for n in ("query", "key", "value"))
    tables = [tensor_input(e) if isinstance(e, torch.Tensor) else e
              for e in block_mask.as_tuple()]
    with graph.inserting_before(node):
        score_gm = module_attr("score_mod", torch.fx.symbolic_trace(_identity_score))
        entries = [module_attr("mask_mod", torch.fx.symbolic_trace(e))
                   if callable(e) and not isinstance(e, torch.fx.Node) else e for e in tables]
        scale = args["scale"] if args["scale"] is not None else q.shape[-1] ** -0.5
        options = _compat.flex_kernel_options(q, k, v)
        flex = graph.call_function(
            torch.ops.higher_order.flex_attention,
            (args["query"], args["key"], args["value"], score_gm, tuple(entries), scale,
             options, (), ()))
        out = graph.call_function(operator.getitem, (flex, 0))
    node.replace_all_uses_with(out)
    graph.erase_node(node)
