"""What the fa3 backend saw and did in this process: attention sites recognition looked at, and
flex_attention sites the lowering planned. Recognition and lowering write here; explain() and
the logs read from here."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ._log import log


@dataclasses.dataclass
class LoweredSite:
    """One flex_attention site as the lowering saw it."""

    template: str                 # "hopper" | "generic" | "torch"
    score_mod: str                # generated code summary, "none" if absent
    mask_mod: str
    shape: str                    # "q[B,H,M,D] kv[B,Hkv,N,D] dtype"
    fallback_reason: Optional[str] = None
    site_id: Optional[int] = None  # the RecognizedSite this came from (see SITE_TAG)
    note: str = ""                # on sm90: the Hopper tiles, or why the generic template runs (SiteSpec.note)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SITES: list[LoweredSite] = []


def record_site(site: LoweredSite) -> None:
    _SITES.append(site)
    if site.fallback_reason:
        log.info("fa3_inductor: flex_attention %s -> torch's kernel: %s%s", site.shape,
                 site.fallback_reason, _site_suffix(site.site_id))
    else:
        log.info("fa3_inductor: flex_attention %s -> %s template (score_mod: %s; mask_mod: %s)%s%s",
                 site.shape, site.template, site.score_mod, site.mask_mod,
                 f" [{site.note}]" if site.note else "", _site_suffix(site.site_id))


def _site_suffix(site_id: Optional[int]) -> str:
    """" [site N]": ties a lowering's log line to the recognition line of the same site."""
    return f" [site {site_id}]" if site_id is not None else ""


def lowered_sites() -> list[dict[str, Any]]:
    """The flex_attention sites lowered by the fa3 backend in this process, oldest first.

    Each is a dict with ``template``, ``score_mod``, ``mask_mod``, ``shape`` and
    ``fallback_reason`` (None when our template serves it). A graph that Inductor serves from
    its on-disk cache is not lowered again, so it adds no entry.

    Example::

        >>> fa3_inductor.clear_lowered_sites(); compiled(x)             # doctest: +SKIP
        >>> [s["template"] for s in fa3_inductor.lowered_sites()]      # doctest: +SKIP
        ['generic', 'generic']
    """
    return [s.as_dict() for s in _SITES]


@dataclasses.dataclass
class LoweredBackwardSite:
    """One flex_attention_backward site as the backward lowering saw it."""

    kernel: str          # the op or kernel Inductor's code calls: "fa3_inductor.flex_bwd" | "torch"
    shape: str           # "q[B,H,M,D] kv[B,Hkv,N,D] dtype device"
    buffer_grads: Optional[int]  # captured score_mod buffers given a gradient (None: torch's)
    reason: str          # why this family (for a fallback: why none of our backward families serves it)
    # Who computes it: a backward family ("hopper_bwd", "generic_bwd", first of the planned list; the
    # op may move down it per call), "dense" (the recompute op) or "torch" (torch's flex backward kernel).
    family: str = ""
    site_id: Optional[int] = None   # the RecognizedSite this came from (see SITE_TAG)
    deterministic: bool = False     # fa3.deterministic_backward or torch.use_deterministic_algorithms was on

    @property
    def ours(self) -> bool:
        """Whether one of our backward families (not a last resort) serves it."""
        return self.family not in ("", "dense", "torch")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_BACKWARD: list[LoweredBackwardSite] = []


def record_backward_site(site: LoweredBackwardSite) -> None:
    _BACKWARD.append(site)
    log.info("fa3_inductor: flex_attention_backward %s -> %s via %s (%s)%s", site.shape,
             site.family or site.kernel, site.kernel, site.reason, _site_suffix(site.site_id))


def lowered_backward_sites() -> list[dict[str, Any]]:
    """The flex_attention_backward sites lowered by the fa3 backend in this process, oldest first.

    Each is a dict with ``kernel`` (the op called), ``family`` (who computes it: a backward family
    such as "generic_bwd", "dense" for the recompute op, "torch" for torch's kernel), ``reason``,
    ``shape``, ``buffer_grads``, ``site_id`` and ``deterministic``.

    Example::

        >>> [s["family"] for s in fa3_inductor.lowered_backward_sites()]   # doctest: +SKIP
        ['generic_bwd']
    """
    return [s.as_dict() for s in _BACKWARD]


def clear_lowered_sites() -> None:
    """Forget the recorded sites (see :func:`lowered_sites` and :func:`recognized_sites`).

    Example::

        >>> fa3_inductor.clear_lowered_sites()   # doctest: +SKIP
    """
    _SITES.clear()
    _RECOGNIZED.clear()
    _BACKWARD.clear()


@dataclasses.dataclass
class RecognizedSite:
    """One attention site a recognition pass looked at (rewritten or left alone)."""

    front_door: str               # "sdpa" | "matmul-softmax" | "flex_attention"
    node: str                     # the FX node name of the site in Dynamo's graph
    rewritten: bool
    reason: Optional[str] = None  # why it was left alone (None when rewritten)
    score_mods: tuple[str, ...] = ()   # recognized score modifications, e.g. ("softcap 30",)
    mask: str = "none"            # recognized mask, e.g. "causal", "dense bool [B,1,M,N]"
    gqa_groups: int = 1           # query heads per kv head
    training: bool = False        # the graph needs gradients through this site
    site_id: Optional[int] = None  # set when the site's flex_attention node is tagged (SITE_TAG)
    rope: Optional[str] = None    # RoPE found on q and k right before it (FP8 only), e.g. "half R=64"
    rope_fused: bool = False      # that RoPE now runs in the FP8 prologue (recognition/rope_fusion.py)
    rope_reason: Optional[str] = None  # why it was not fused (None when fused or no RoPE)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_RECOGNIZED: list[RecognizedSite] = []


def record_recognized(site: RecognizedSite) -> None:
    _RECOGNIZED.append(site)
    if site.rewritten:
        log.info("fa3_inductor: %s %s -> flex_attention (mods: %s; mask: %s; GQA groups %d)%s",
                 site.front_door, site.node, ", ".join(site.score_mods) or "none", site.mask,
                 site.gqa_groups, _site_suffix(site.site_id))
    else:
        log.info("fa3_inductor: %s %s left alone: %s", site.front_door, site.node, site.reason)


def recognized_sites() -> list[dict[str, Any]]:
    """The attention sites recognition looked at in this process, oldest first.

    Example::

        >>> fa3_inductor.clear_lowered_sites(); compiled(x)               # doctest: +SKIP
        >>> [(s["front_door"], s["rewritten"]) for s in recognized_sites()]  # doctest: +SKIP
        [('sdpa', True)]
    """
    return [s.as_dict() for s in _RECOGNIZED]


# Linking a recognized site to the lowering of its flex_attention node. Recognition writes a
# process-unique id into the node's ``meta["custom"]``: AOT autograd copies that field onto the
# nodes it traces (forward and backward alike), so the lowering finds it on
# ``V.graph.current_node``. Nothing reaches the op's arguments (kernel_options stay torch's).
SITE_TAG = "fa3_site"
_NEXT_ID = [0]


def tag_site(node: Any, site: RecognizedSite) -> None:
    """Give ``site`` a fresh id and write it on its flex_attention FX ``node``."""
    _NEXT_ID[0] += 1
    site.site_id = _NEXT_ID[0]
    custom = dict(node.meta.get("custom") or {})
    custom[SITE_TAG] = site.site_id
    node.meta["custom"] = custom


def site_tag(node: Any) -> Optional[int]:
    """The site id written on an FX node by :func:`tag_site`, or None."""
    if node is None:
        return None
    custom = node.meta.get("custom") or {}
    return custom.get(SITE_TAG) if isinstance(custom, dict) else None


def site_records() -> tuple[list[RecognizedSite], list[LoweredSite]]:
    """The recorded sites as objects (copies of the lists), oldest first: for explain()."""
    return list(_RECOGNIZED), list(_SITES)


def backward_records() -> list[LoweredBackwardSite]:
    """The recorded backward sites as objects (a copy of the list), oldest first: for explain()."""
    return list(_BACKWARD)
