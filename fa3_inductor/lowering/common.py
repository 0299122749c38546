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

import torch

from ..config import Settings
from ..sizes import static_ints
from ..templates.modgen import BufferSpec, RuntimeStride
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


def buffer_order(sizes) -> tuple[int, ...]:
    """The order a captured buffer's dims are laid out in for our kernels, outermost first. The
    generated mods bake strides in, so one dynamic dim goes outermost: then each stride is a product
    of static sizes. A padding mask ``[B, N]`` whose length a dynamic recompile made symbolic is laid
    out ``[N, B]`` (a copy, made once per call). With two or more dynamic dims the buffer keeps its
    order and the strides that are not static are read at run time (:func:`realize_buffers`).

    Example::

        >>> buffer_order([4, 64]), buffer_order([s0, 64]), buffer_order([4, s1])   # doctest: +SKIP
        ((0, 1), (0, 1), (1, 0))
    """
    dynamic = [i for i, size in enumerate(sizes) if static_ints([size]) is None]
    if len(dynamic) != 1:
        return tuple(range(len(sizes)))
    return tuple(dynamic) + tuple(i for i in range(len(sizes)) if i not in dynamic)


def _layouts(buffers) -> list:
    """Per captured buffer (scalars left out): (buffer, order, sizes with -1 for dynamic ones,
    strides as ints or sympy expressions of the sizes)."""
    from torch._inductor import ir

    out = []
    for buf in buffers:
        if not isinstance(buf, ir.IRNode):
            continue
        dims = list(buf.get_size())
        sizes = [_static_or_none(d) for d in dims]
        order = buffer_order(dims)
        strides, stride = [0] * len(dims), 1
        for i in reversed(order):
            static = _static_or_none(stride)
            strides[i] = static if static is not None else stride
            # torch's contiguous strides: an empty dim counts as 1
            stride = stride * (max(sizes[i], 1) if sizes[i] is not None else dims[i])
        out.append((buf, order, [-1 if s is None else s for s in sizes], strides))
    return out


def realize_buffers(buffers) -> list:
    """The captured buffers as our kernels read them (scalars left out): each contiguous in
    :func:`buffer_order`'s layout, then one 0-d int64 tensor per stride known only at run time, in
    the order :func:`buffer_specs` numbered them (the mods load them from those slots)."""
    from torch._inductor import ir, lowering
    from torch._inductor.virtualized import ops

    layouts = _layouts(buffers)
    realized = []
    for buf, order, _, _ in layouts:
        if order != tuple(range(len(order))):
            buf = lowering.permute(buf, list(order))
        realized.append(ir.ExternKernel.require_contiguous(buf))
    for buf, _, _, strides in layouts:
        for stride in strides:
            if not isinstance(stride, int):
                value = ir.Pointwise.create(device=buf.get_device(), dtype=torch.int64, ranges=[],
                                            inner_fn=lambda _, s=stride: ops.index_expr(s, torch.int64))
                realized.append(ir.ExternKernel.realize_input(value))
    return realized


def buffer_specs(buffers) -> list[Optional[BufferSpec]]:
    """The captured buffers as the generated mods see them (None for a scalar). Both lowerings use
    it, so the backward recomputes exactly the forward's scores. The kernels get the buffers from
    :func:`realize_buffers`: the strides here are those of its layouts, a dynamic size is -1, and a
    stride known only at run time is a :class:`RuntimeStride` naming its slot.

    Example::

        >>> specs = buffer_specs(score_mod_other_buffers)   # doctest: +SKIP
    """
    from torch._inductor import ir

    layouts = iter(_layouts(buffers))
    slot = sum(isinstance(b, ir.IRNode) for b in buffers)   # run-time strides follow the tensors
    specs = []
    for buf in buffers:
        if not isinstance(buf, ir.IRNode):
            specs.append(None)  # a scalar (a size symbol): the generator checks it is unused
            continue
        _, order, sizes, strides = next(layouts)
        baked = []
        for stride in strides:
            if isinstance(stride, int):
                baked.append(stride)
            else:
                baked.append(RuntimeStride(slot))
                slot += 1
        specs.append(BufferSpec(tuple(sizes), tuple(baked), buf.get_dtype(),
                                permuted=order != tuple(range(len(order)))))
    return specs


def _static_or_none(size) -> Optional[int]:
    ints = static_ints([size])
    return None if ints is None else ints[0]
