"""What the lowering tells the runtime about one attention site, as a JSON string.

The spec travels inside Inductor's output code as a plain string argument of the
``fa3_inductor::flex_fwd`` op, so a graph served from Inductor's cache carries everything
needed to rebuild its kernels: the generated mod sources and the template to run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Optional


@dataclasses.dataclass(frozen=True)
class SiteSpec:
    """One attention site: template choice and generated mod code (None = no mod).

    Example::

        >>> SiteSpec.from_json(SiteSpec(template="generic").to_json()).template
        'generic'
    """

    template: str
    score_mod_tl: Optional[str] = None
    mask_mod_tl: Optional[str] = None
    score_mod_gl: Optional[str] = None
    mask_mod_gl: Optional[str] = None
    description: str = ""
    # Whether anything reads the row-max output; if not, a bounded score_mod may skip computing it.
    needs_max: bool = True
    # On an sm90 GPU: the Hopper template's tiles, or why the site got the generic template ("" elsewhere).
    note: str = ""
    # The mods as torch code (templates/modgen_torch.py): torch's own kernel runs the site with them
    # if ours cannot be built (runtime/kernel_failures.py).
    score_mod_torch: Optional[str] = None
    mask_mod_torch: Optional[str] = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @staticmethod
    @functools.lru_cache(maxsize=256)  # parsed once per site, not per call
    def from_json(text: str) -> "SiteSpec":
        return SiteSpec(**json.loads(text))
