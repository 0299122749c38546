"""The custom graph pass the fa3 backend installs into Inductor's config.

Its presence is what turns our flex_attention lowering on (see ``common.active_pass``),
it carries the backend's Settings into lowering (forward and the lazily compiled backward
alike: compile_fx re-applies config patches there), and its ``uuid()`` covers this package's
sources and settings so Inductor's FX graph cache never serves a graph lowered by other code.

The backend installs it only for graphs with a flex_attention op to lower (backend.py): a graph
it leaves alone compiles with stock Inductor's config, so it shares stock Inductor's cache
entries and code instead of being keyed (and recompiled, re-autotuned) on this package's sources.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..config import Settings

_PACKAGE_ROOT = pathlib.Path(__file__).resolve().parent.parent


@functools.cache
def source_hash() -> str:
    """Hash of every .py file of the package (its kernels, generators and lowerings)."""
    h = hashlib.sha256()
    for path in sorted(_PACKAGE_ROOT.rglob("*.py")):
        h.update(str(path.relative_to(_PACKAGE_ROOT)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


class Fa3PostGradPass(CustomGraphPass):
    """Marker pass of the fa3 backend (post-grad position; the graph is left unchanged).

    Example::

        >>> torch._inductor.config.patch(post_grad_custom_post_pass=Fa3PostGradPass(Settings()))  # doctest: +SKIP
    """

    def __init__(self, settings: Settings):
        self.settings = settings

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        return f"fa3_inductor-{source_hash()}-{self.settings!r}"
