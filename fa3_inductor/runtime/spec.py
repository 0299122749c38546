"""What the lowering tells the runtime about one attention site, as a JSON string.

The spec travels inside Inductor's output code as a plain string argument of the
``fa3_inductor::flex_fwd`` op, so a graph served from Inductor's cache carries everything
needed to rebuild its kernels: the candidate kernel families and the generated mods in each
family's dialect, with the generator's record of each mod (templates/modgen.ModInfo).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Optional


@dataclasses.dataclass(frozen=True)
class SiteSpec:
    """One attention site: the kernel families that may serve it, in preference order (the runtime
    takes the first that serves a call: runtime/ops.py), and its mods as source per dialect.

    Example::

        >>> spec = SiteSpec(("generic", "torch"), (("tl", None, None), ("torch", None, None)))
        >>> SiteSpec.from_json(spec.to_json()).template
        'generic'
    """

    families: tuple[str, ...]
    # (dialect, score_mod source, mask_mod source) per dialect the families call; None: no mod
    mods: tuple[tuple[str, Optional[str], Optional[str]], ...] = ()
    # the generator's records of the score_mod and the mask_mod (ModInfo fields), () for none
    score_info: tuple = ()
    mask_info: tuple = ()
    description: str = ""
    # Whether anything reads the row-max output; if not, a bounded score_mod may skip computing it.
    needs_max: bool = True
    # What the first family runs the site with (Hopper tiles), or why a preferred family cannot ("" if neither).
    note: str = ""

    @property
    def template(self) -> str:
        """The family the plan expects to serve the site (the runtime may move down the list)."""
        return self.families[0]

    def sources(self, dialect: str) -> tuple[Optional[str], Optional[str]]:
        """(score_mod source, mask_mod source) in ``dialect``.

        Example::

            >>> SiteSpec(("torch",), (("torch", "def score_mod(...", None),)).sources("torch")[1] is None
            True
        """
        for name, score, mask in self.mods:
            if name == dialect:
                return score, mask
        raise KeyError(f"site has no mods in dialect {dialect!r} (has {[m[0] for m in self.mods]})")

    def planned_sources(self) -> tuple[Optional[str], Optional[str]]:
        """(score_mod source, mask_mod source) in the dialect of the family the plan expects.

        Example::

            >>> SiteSpec(("torch",), (("torch", None, None),)).planned_sources()
            (None, None)
        """
        return self.mods[0][1], self.mods[0][2]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @staticmethod
    @functools.lru_cache(maxsize=256)  # parsed once per site, not per call
    def from_json(text: str) -> "SiteSpec":
        fields = json.loads(text)
        fields["families"] = tuple(fields["families"])
        fields["mods"] = tuple(tuple(m) for m in fields.get("mods", ()))
        for kind in ("score_info", "mask_info"):
            fields[kind] = tuple(tuple(item) for item in fields.get(kind, ()))
        return SiteSpec(**fields)
