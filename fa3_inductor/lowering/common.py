"""What the forward and backward flex_attention lowerings share, so that neither imports the other.

``active_pass``: whether the current compile belongs to the fa3 backend (its marker pass is in
Inductor's config). ``lowering_settings``: the Settings a site is lowered with: the fa3 backend's,
or, under any other Inductor compile, those ``fa3_inductor.flex()`` wrote into the op's
kernel_options (``front_door_options``); None leaves the site to torch's lowering
(``torch_kernel_options`` removes our key first). ``site_shape``: how a site's shape is written
in the records and logs.

Example::

    >>> if active_pass() is None: ...        # another backend compiles: hand over   # doctest: +SKIP
    >>> site_shape(query, key, value)        # doctest: +SKIP
    'q[2, 4, 64, 16] kv[2, 4, 64, 16] float16 cpu'
"""

from __future__ import annotations

from typing import Optional

from ..config import Settings
from ..sizes import static_ints
from ..templates.modgen import BufferSpec
from .passes import Fa3PostGradPass, source_hash

# kernel_options key by which a flex_attention op traced from fa3_inductor.flex() asks for our
# lowering under any Inductor compile (transformers' generate() compiles the decode step with
# backend="inductor"). Its value names the template and this package's sources, so Inductor's
# FX graph cache, which keys on the graph's constants, never serves code lowered by other sources.
FRONT_DOOR_OPTION = "fa3_inductor_front_door"


def active_pass() -> Optional[Fa3PostGradPass]:
    """The fa3 backend's marker pass if the current compile belongs to the fa3 backend."""
    from torch._inductor import config

    p = config.post_grad_custom_post_pass
    return p if isinstance(p, Fa3PostGradPass) else None


def front_door_tag(template: str) -> str:
    """The value fa3_inductor.flex() gives :data:`FRONT_DOOR_OPTION` in the op's kernel_options.

    Example::

        >>> front_door_tag("auto")                                   # doctest: +SKIP
        'auto:3f2a...'
    """
    return f"{template}:{source_hash()[:16]}"


def lowering_settings(kernel_options: Optional[dict]) -> Optional[Settings]:
    """Settings for lowering a flex_attention site, or None to leave it to torch's lowering."""
    marker = active_pass()
    if marker is not None:
        return marker.settings
    tag = (kernel_options or {}).get(FRONT_DOOR_OPTION)
    if not isinstance(tag, str):
        return None
    return Settings(template=tag.split(":", 1)[0])


def torch_kernel_options(kernel_options: Optional[dict]) -> Optional[dict]:
    """kernel_options without our key: torch's templates turn every entry into a constexpr."""
    if not kernel_options or FRONT_DOOR_OPTION not in kernel_options:
        return kernel_options
    return {k: v for k, v in kernel_options.items() if k != FRONT_DOOR_OPTION}


def site_shape(query, key, value=None) -> str:
    """"q[B,H,M,D] kv[B,Hkv,N,D] dtype device" of a site's IR nodes, for records and logs;
    "... kv[B,Hkv,N,D] v[B,Hkv,N,Dv] ..." when the value's head dim differs."""
    kv = f"kv{list(key.get_size())}"
    if value is not None and str(value.get_size()[-1]) != str(key.get_size()[-1]):
        kv += f" v{list(value.get_size())}"
    return (f"q{list(query.get_size())} {kv} "
            f"{str(query.get_dtype()).replace('torch.', '')} {query.get_device().type}")


def buffer_specs(buffers) -> tuple[Optional[list[Optional[BufferSpec]]], Optional[str]]:
    """The captured buffers as the generated mods see them (None for a scalar), or (None, why not).
    Both lowerings use it, so the backward recomputes exactly the forward's scores.

    Example::

        >>> specs, why = buffer_specs(score_mod_other_buffers)   # doctest: +SKIP
    """
    from torch._inductor import ir

    specs = []
    for buf in buffers:
        if not isinstance(buf, ir.IRNode):
            specs.append(None)  # a scalar (a size symbol): the generator checks it is unused
            continue
        # Buffers are made contiguous before the call, so only their strides are baked into
        # the mod: a leading dimension may stay symbolic (a document-id vector whose length
        # follows a dynamic sequence length), the inner ones must be static.
        dims = list(buf.get_size())
        inner = static_ints(dims[1:])
        if inner is None:
            return None, "a captured buffer has a dynamic inner dimension"
        lead = static_ints(dims[:1])
        size = (lead if lead is not None else [-1]) + inner if dims else []
        strides, stride = [], 1
        for s in reversed(inner):
            strides.append(stride)
            stride *= max(s, 1)
        if dims:
            strides.append(stride)
        specs.append(BufferSpec(tuple(size), tuple(reversed(strides)), buf.get_dtype()))
    return specs, None
