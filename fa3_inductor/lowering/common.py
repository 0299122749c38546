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


def buffer_order(sizes) -> Optional[tuple[int, ...]]:
    """The order a captured buffer's dims are laid out in for our kernels, outermost first, or None
    when it has two dynamic dims. The generated mods bake every stride in, so the one dynamic dim
    goes outermost: then each stride is a product of static sizes. A padding mask ``[B, N]`` whose
    length a dynamic recompile made symbolic is laid out ``[N, B]`` (a copy, made once per call).

    Example::

        >>> buffer_order([4, 64]), buffer_order([s0, 64]), buffer_order([4, s1])   # doctest: +SKIP
        ((0, 1), (0, 1), (1, 0))
    """
    dynamic = [i for i, size in enumerate(sizes) if static_ints([size]) is None]
    if len(dynamic) > 1:
        return None
    rest = tuple(i for i in range(len(sizes)) if i not in dynamic)
    return tuple(dynamic) + rest


def realize_buffer(buf):
    """A captured buffer as our kernels read it: contiguous in :func:`buffer_order`'s layout,
    whose strides :func:`buffer_specs` gave the generated mods."""
    from torch._inductor import ir, lowering

    order = buffer_order(buf.get_size())
    if order is not None and order != tuple(range(len(order))):
        buf = lowering.permute(buf, list(order))
    return ir.ExternKernel.require_contiguous(buf)


def buffer_specs(buffers) -> tuple[Optional[list[Optional[BufferSpec]]], Optional[str]]:
    """The captured buffers as the generated mods see them (None for a scalar), or (None, why not).
    Both lowerings use it, so the backward recomputes exactly the forward's scores. The kernels get
    each buffer from :func:`realize_buffer`: the strides here are those of its layout, and a
    dynamic size is -1.

    Example::

        >>> specs, why = buffer_specs(score_mod_other_buffers)   # doctest: +SKIP
    """
    from torch._inductor import ir

    specs = []
    for buf in buffers:
        if not isinstance(buf, ir.IRNode):
            specs.append(None)  # a scalar (a size symbol): the generator checks it is unused
            continue
        dims = list(buf.get_size())
        order = buffer_order(dims)
        if order is None:
            return None, ("a captured buffer has two dynamic dimensions (sizes "
                          f"{[str(d) for d in dims]}); mark all but one static (torch._dynamo.mark_static) "
                          "or compile with dynamic=False")
        sizes = [s if s is not None else -1 for s in (_static_or_none(d) for d in dims)]
        strides, stride = [0] * len(dims), 1
        for i in reversed(order):
            strides[i] = stride
            stride *= max(sizes[i], 1)
        specs.append(BufferSpec(tuple(sizes), tuple(strides), buf.get_dtype()))
    return specs, None


def _static_or_none(size) -> Optional[int]:
    ints = static_ints([size])
    return None if ints is None else ints[0]
