"""The flex_attention front door, and the link from recognized sites to their lowering.

A flex_attention call the user wrote needs no rewrite: it is already the canonical form. This
pass records it as a ``RecognizedSite("flex_attention", ...)`` so that explain() and the logs
show it beside the sites other passes rewrote, and tags its node (report.SITE_TAG).

Sites the rewriting passes (SDPA, hand-written matmul-softmax) turn into flex_attention nodes
are tagged by :func:`tag_rewritten`: the k-th rewritten site in program order is the k-th new
flex_attention node in graph order (each rewrite replaces a local pattern by one node placed
where the pattern was, and patterns do not interleave). When the counts disagree nothing is
tagged, and explain() says the template is unknown rather than guess.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx

from .._log import log
from ..report import RecognizedSite, site_tag, tag_site

FLEX_OP = torch.ops.higher_order.flex_attention


def flex_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The flex_attention nodes of ``gm``, in graph order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is FLEX_OP]


def _example(node: object) -> Optional[torch.Tensor]:
    if isinstance(node, torch.fx.Node):
        val = node.meta.get("example_value", node.meta.get("val"))
        return val if isinstance(val, torch.Tensor) else None
    return None


def _submodule(gm: torch.fx.GraphModule, node: object) -> Optional[torch.fx.GraphModule]:
    if isinstance(node, torch.fx.Node) and node.op == "get_attr":
        try:
            mod = gm.get_submodule(node.target)
        except AttributeError:
            return None
        return mod if isinstance(mod, torch.fx.GraphModule) else None
    return None


def _op_names(mod: torch.fx.GraphModule) -> list[str]:
    names: list[str] = []
    for n in mod.graph.nodes:
        if n.op in ("call_function", "call_method"):
            name = n.target if isinstance(n.target, str) else getattr(
                n.target, "__name__", str(n.target))
            if name.split(".")[-1] not in names:
                names.append(name.split(".")[-1])
    return names


def _ops(mod: torch.fx.GraphModule) -> str:
    return ", ".join(_op_names(mod)) or "constant"


def _is_noop_mask(mod: torch.fx.GraphModule) -> bool:
    """FlexAttention's default mask in a Dynamo graph: ``new_ones(size=(), dtype=bool)``."""
    return set(_op_names(mod)) <= {"new_ones", "ones", "ones_like"}


def _describe(gm: torch.fx.GraphModule, node: torch.fx.Node) -> RecognizedSite:
    from ..templates.modgen import is_identity_score

    q, k, v = (_example(a) for a in node.args[:3])
    score = _submodule(gm, node.args[3])
    score_mods: tuple[str, ...] = ()
    if score is not None and not is_identity_score(score):
        score_mods = (f"score_mod ({_ops(score)})",)
    mask = "none"
    block_mask = node.args[4] if len(node.args) > 4 else ()
    mask_mod = _submodule(gm, block_mask[-1]) if isinstance(block_mask, (tuple, list)) \
        and block_mask else None
    if mask_mod is not None and not _is_noop_mask(mask_mod):
        mask = f"mask_mod ({_ops(mask_mod)})"
    groups = q.shape[1] // k.shape[1] if q is not None and k is not None and k.shape[1] else 1
    training = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v))
    return RecognizedSite("flex_attention", node.name, True, score_mods=score_mods, mask=mask,
                          gqa_groups=int(groups), training=training)


def flex_call_sites(gm: torch.fx.GraphModule) -> list[RecognizedSite]:
    """Record-ready sites for the flex_attention calls already in a Dynamo graph, their nodes
    tagged. Nodes tagged by an earlier look (the same graph seen twice) keep their id.

    Example::

        >>> [s.front_door for s in flex_call_sites(gm)]   # doctest: +SKIP
        ['flex_attention']
    """
    sites = []
    for node in flex_nodes(gm):
        site = _describe(gm, node)
        if site_tag(node) is None:
            tag_site(node, site)
        else:
            site.site_id = site_tag(node)
        sites.append(site)
    return sites


def tag_rewritten(gm: torch.fx.GraphModule, before: list[str], positions: dict[str, int],
                  sites: list[RecognizedSite]) -> bool:
    """Tag the flex_attention nodes the rewriting passes added to ``gm``.

    ``before``: names of the flex_attention nodes ``gm`` had before the passes ran;
    ``positions``: node name -> index in the graph before the passes; ``sites``: what the
    passes reported. Returns False (and tags nothing) when the new nodes and the rewritten
    sites do not pair up one to one.

    Example::

        >>> tag_rewritten(gm, before=[], positions=pos, sites=sdpa_sites)   # doctest: +SKIP
        True
    """
    new_nodes = [n for n in flex_nodes(gm) if n.name not in before]
    rewritten = sorted((s for s in sites if s.rewritten), key=lambda s: positions.get(
        s.node, len(positions)))
    if len(new_nodes) != len(rewritten):
        log.debug("fa3_inductor: %d rewritten sites but %d new flex_attention nodes: explain() "
                  "cannot say which template serves them", len(rewritten), len(new_nodes))
        return False
    for node, site in zip(new_nodes, rewritten):
        tag_site(node, site)
    return True
