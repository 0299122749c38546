"""Settings of the fa3 backend, given as ``options={"fa3.<name>": value}`` to torch.compile.

Example::

    >>> torch.compile(model, backend="fa3", options={"fa3.template": "generic"})  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch


@torch.compiler.assume_constant_result  # the registry imports family modules: Dynamo cannot trace that
def templates() -> tuple[str, ...]:
    """What the ``template`` option may name: "auto" and every kernel family (templates/registry.py).

    Example::

        >>> templates()
        ('auto', 'hopper_fp8', 'decode', 'hopper', 'fp8', 'generic', 'torch')
    """
    from .templates.registry import names

    return ("auto", *names())


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the fa3 backend may do.

    template:  "auto" picks the best of ours per site; a family's name ("hopper", "generic") starts
               there (families it cannot serve fall back, in the registry's order, with the reason
               logged); "torch" turns our lowering off (torch's own flex kernels run).
    recognize: rewrite attention written another way (today: SDPA calls) into the
               flex_attention op our lowering serves; False leaves the graph as Dynamo made it.
    fp8:       True or an FP8Recipe: FP8 attention (inference graphs only) for every bf16/fp16 site
               our kernels serve (docs/fp8.md); None / False: off.
    deterministic_backward: bitwise-reproducible attention gradients (also on under
               torch.use_deterministic_algorithms(True): deterministic_gradients): only backward
               families that guarantee it serve (the generic backward always does: its dQ has its own
               pass, no atomics; the Hopper one orders its dQ adds at head dims 64-128); the choice is
               recorded per backward site (docs/design/backward.md).
    """

    template: str = "auto"
    recognize: bool = True
    fp8: Any = None
    deterministic_backward: bool = False

    def __post_init__(self) -> None:
        if self.template not in templates():
            raise ValueError(f"fa3 option 'fa3.template' must be one of {templates()}, "
                             f"got {self.template!r}")
        if not isinstance(self.deterministic_backward, bool):
            raise ValueError("fa3 option 'fa3.deterministic_backward' must be True or False, "
                             f"got {self.deterministic_backward!r}")
        from .fp8_recipe import FP8Recipe

        try:
            object.__setattr__(self, "fp8", FP8Recipe.of(self.fp8))
        except TypeError as exc:
            raise ValueError(f"fa3 option 'fa3.fp8': {exc}") from exc


def deterministic_gradients(settings: Optional[Settings] = None) -> bool:
    """Whether attention gradients planned now must be bitwise reproducible: the fa3 option
    ``fa3.deterministic_backward``, or torch's own switch ``torch.use_deterministic_algorithms(True)``
    (read when the backward is planned, as Inductor reads it for its kernels; Dynamo guards on it, so
    turning it on recompiles).

    Example::

        >>> deterministic_gradients(Settings(deterministic_backward=True))
        True
        >>> deterministic_gradients(Settings()) == torch.are_deterministic_algorithms_enabled()
        True
    """
    return bool(settings is not None and settings.deterministic_backward) or \
        torch.are_deterministic_algorithms_enabled()


def split_options(options: dict[str, Any] | None) -> tuple[Settings, dict[str, Any]]:
    """Split torch.compile ``options`` into our Settings and Inductor config patches.

    Example::

        >>> split_options({"fa3.template": "generic", "max_autotune": True})
        (Settings(template='generic', recognize=True, fp8=None, deterministic_backward=False), {'max_autotune': True})
    """
    ours, inductor = {}, {}
    names = {f.name for f in dataclasses.fields(Settings)}
    for key, value in (options or {}).items():
        if key.startswith("fa3."):
            name = key[4:]
            if name not in names:
                raise ValueError(f"unknown fa3 option {key!r}; known: "
                                 f"{sorted('fa3.' + n for n in names)}")
            ours[name] = value
        else:
            inductor[key] = value
    return Settings(**ours), inductor
