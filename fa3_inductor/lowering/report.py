"""What the fa3 backend did at each flex_attention site it lowered in this process."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .._log import log


@dataclasses.dataclass
class LoweredSite:
    """One flex_attention site as the lowering saw it."""

    template: str                 # "hopper" | "generic" | "torch"
    score_mod: str                # generated code summary, "none" if absent
    mask_mod: str
    shape: str                    # "q[B,H,M,D] kv[B,Hkv,N,D] dtype"
    fallback_reason: Optional[str] = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SITES: list[LoweredSite] = []


def record_site(site: LoweredSite) -> None:
    _SITES.append(site)
    if site.fallback_reason:
        log.info("fa3_inductor: flex_attention %s -> torch's kernel: %s", site.shape,
                 site.fallback_reason)
    else:
        log.info("fa3_inductor: flex_attention %s -> %s template (score_mod: %s; mask_mod: %s)",
                 site.shape, site.template, site.score_mod, site.mask_mod)


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


def clear_lowered_sites() -> None:
    """Forget the recorded sites (see :func:`lowered_sites`)."""
    _SITES.clear()
