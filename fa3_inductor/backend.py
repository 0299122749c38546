"""The ``fa3`` torch.compile backend: Inductor with our attention lowering switched on.

Registered through the ``torch_dynamo_backends`` entry point, so ``backend="fa3"`` works with
nothing imported first.

Example::

    >>> compiled = torch.compile(model, backend="fa3")                              # doctest: +SKIP
    >>> compiled = torch.compile(model, backend="fa3", mode="max-autotune-no-cudagraphs",
    ...                          options={"fa3.template": "generic"})               # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .config import split_options
from .lowering import flex_lowering
from .lowering.passes import Fa3PostGradPass


def fa3_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], *,
                mode: Optional[str] = None, options: Optional[dict[str, Any]] = None) -> Any:
    """Compile ``gm`` with Inductor, our flex_attention lowering active.

    ``mode`` is any Inductor mode ("default", "reduce-overhead", "max-autotune", ...);
    ``options`` are Inductor config entries plus ``fa3.*`` settings (see fa3_inductor.config).

    Example::

        >>> torch.compile(fn, backend="fa3", options={"fa3.template": "torch"})  # doctest: +SKIP
    """
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    if mode is not None and options:
        raise ValueError("backend 'fa3': give either mode= or options=, not both "
                         "(as for torch.compile's inductor backend)")
    settings, inductor_options = split_options(options)
    patches: dict[str, Any] = dict(list_mode_options(mode)) if mode else {}
    patches.update(inductor_options)
    if "post_grad_custom_post_pass" in patches:
        raise ValueError("backend 'fa3' installs its own post_grad_custom_post_pass; compose "
                         "your pass with backend='inductor' or ask for a hook")
    patches["post_grad_custom_post_pass"] = Fa3PostGradPass(settings)
    flex_lowering.install()
    return compile_fx(gm, example_inputs, config_patches=patches)


def ensure_registered() -> None:
    """Make ``backend="fa3"`` resolve even where the package's entry point is not installed
    (a source checkout on PYTHONPATH). Harmless when the entry point already registered it.

    Example::

        >>> ensure_registered(); torch.compile(fn, backend="fa3")   # doctest: +SKIP
    """
    from torch._dynamo.backends.registry import register_backend

    try:
        register_backend(fa3_backend, name="fa3")
    except AssertionError:  # "duplicate name": already registered
        pass
