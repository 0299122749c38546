"""Re-launch a compiled kernel without Triton's per-call argument binding.

`JITFunction.run` re-derives the specialization of every argument on every call (~40 arguments
here, tuples and descriptors included), builds a string cache key and checks globals before it
launches. For one attention site all of that is fixed by the inputs' shapes, strides, dtypes
and 16-byte alignment, so we do it once per such signature: the first call launches through
`JITFunction.run` and records a *recipe* of its arguments (which argument is which input tensor,
which is a TMA descriptor over which input, which are constants); later calls with the same
signature substitute the new tensors and call the compiled kernel's launcher directly.

Host TMA descriptors (the Hopper template passes four, eight for a head dim split into two tiles) are
otherwise encoded by triton on every launch. Where triton's C launcher is reachable
(`_compat.tensordesc_launcher`) and no launch hook is active, a hit launches through it directly and
encodes each descriptor once per (argument, address): compiled graphs reuse their buffers' addresses.

The recipe holds no reference to the first call's tensors (they may be large and are the
caller's), only tiny placeholder tensors the kernel never reads. Anything it cannot account
for (a tensor argument that is neither an input nor a placeholder, e.g. a contiguous copy
made while preparing the launch) makes the signature uncacheable: those calls keep taking
the ordinary path.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Optional, Sequence

import torch

from .._compat import launch_hooks_active, tensordesc_launcher

_MAX_ENTRIES = 1024


class _Uncacheable(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class _Launch:
    kernel: Any                  # triton CompiledKernel; None: this key is not cacheable
    grid: tuple[int, int, int]
    constants: tuple             # the argument list with the per-call slots left as None
    slots: tuple                 # (position, step) pairs filled per call, see _step
    tag: Any                     # what the caller launched (returned on every hit)
    # The C launcher, where its host TMA descriptors can be encoded once per address (_compat), and those
    # encodings: (argument position, data_ptr) -> the C arguments. None: launch through kernel.run.
    direct: Any = None
    encoded: Optional[dict] = None
    direct_plan: tuple = ()      # the C launcher's argument list in segments, see _direct_plan


_CACHE: dict[Hashable, _Launch] = {}


def tensor_signature(tensors: Sequence[Optional[torch.Tensor]]) -> tuple:
    """What of each tensor a compiled launch depends on (not its address beyond alignment).

    Example::

        >>> tensor_signature([torch.zeros(2, 3), None])[1]
        >>> tensor_signature([torch.zeros(2, 3)])[0][:2]
        (torch.Size([2, 3]), (3, 1))
    """
    return tuple(None if t is None else
                 (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)
                 for t in tensors)


def launch_cached(key: Hashable, inputs: Sequence[Optional[torch.Tensor]],
                  prepare: Callable[[], tuple[Any, tuple, dict, tuple, Any]]) -> Any:
    """Launch a kernel for ``inputs``; ``key`` must determine everything but their addresses.

    ``prepare()`` returns ``(jit_function, args, kwargs, grid, tag)`` for an ordinary launch;
    it is called only on the first launch of a key (and on every launch of an uncacheable
    key). ``key`` must include :func:`tensor_signature` of ``inputs`` and every non-tensor
    value the launch depends on. Returns ``tag`` (the caller's note of what it launched).

    Example::

        >>> launch_cached(("site", tensor_signature([q, k, v, out])), [q, k, v, out],
        ...               lambda: (kernel, args, kwargs, grid, "generic"))   # doctest: +SKIP
        'generic'
    """
    entry = _CACHE.get(key)
    if entry is not None and entry.kernel is not None:
        _relaunch(entry, inputs)
        return entry.tag
    jit_fn, args, kwargs, grid, tag = prepare()
    kernel = jit_fn[grid](*args, **kwargs)
    if entry is not None or kernel is None or not hasattr(kernel, "run"):
        return tag  # known uncacheable, or the interpreter (no compiled kernel)
    try:
        recipe = _record(jit_fn, args, kwargs, inputs)
    except _Uncacheable:
        _CACHE[key] = _Launch(None, (1, 1, 1), (), (), tag)
        return tag
    if len(_CACHE) >= _MAX_ENTRIES:
        _CACHE.clear()
    grid = tuple(grid) + (1,) * (3 - len(grid))
    constants = tuple(step[1] if step[0] == "const" else None for step in recipe)
    slots = tuple((pos, step) for pos, step in enumerate(recipe) if step[0] != "const")
    direct = tensordesc_launcher(kernel)
    plan = ()
    if direct is not None:
        try:
            plan = _direct_plan(recipe, direct.descriptor_meta)
        except _Uncacheable:
            direct = None
    _CACHE[key] = _Launch(kernel, grid, constants, slots, tag, direct, {} if direct is not None else None, plan)
    return tag


def recorded(key: Hashable) -> Optional[_Launch]:
    """The recorded launch of ``key`` if it can be re-launched without planning, else None.

    Example::

        >>> entry = recorded(key); relaunch(entry, inputs)   # doctest: +SKIP
    """
    entry = _CACHE.get(key)
    return entry if entry is not None and entry.kernel is not None else None


def relaunch(entry: _Launch, inputs: Sequence[Optional[torch.Tensor]]) -> Any:
    """Launch a recorded entry (from :func:`recorded`) on new ``inputs`` of the same signature;
    returns its tag. The caller guarantees the signature (shapes, strides, dtypes, alignment).

    Example::

        >>> relaunch(recorded(key), [q, k, v, out])   # doctest: +SKIP
        'hopper'
    """
    _relaunch(entry, inputs)
    return entry.tag


def clear() -> None:
    """Forget every recorded launch (tests; after changing kernels in-process)."""
    _CACHE.clear()


def _record(jit_fn: Any, args: tuple, kwargs: dict, inputs: Sequence) -> tuple:
    index_of = {id(t): i for i, t in enumerate(inputs) if t is not None}
    values = list(args)
    for param in jit_fn.params[len(args):]:
        if param.name in kwargs:
            values.append(kwargs[param.name])
        elif param.has_default:
            values.append(param.default)
        else:
            raise _Uncacheable()
    return tuple(_step(v, index_of) for v in values)


def _step(value: Any, index_of: dict) -> tuple:
    if isinstance(value, torch.Tensor):
        i = index_of.get(id(value))
        if i is not None:
            return ("input", i)
        if value.numel() <= 1:  # a placeholder for an absent table: never read
            return ("const", value)
        raise _Uncacheable()
    if isinstance(value, tuple):
        return ("tuple", tuple(_step(v, index_of) for v in value))
    base = getattr(value, "base", None)
    if isinstance(base, torch.Tensor) and hasattr(value, "block_shape"):
        i = index_of.get(id(base))
        if i is None:
            raise _Uncacheable()
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)
                  if f.name != "base"}
        return ("descriptor", i, type(value), fields)
    return ("const", value)


# _direct_plan segment kinds
_CONSTS, _INPUT, _DESCRIPTOR, _BUILT = range(4)


def _direct_plan(recipe: tuple, descriptor_meta: dict) -> tuple:
    """The C launcher's argument list as segments, so that a hit touches only what changes per call:
    (_CONSTS, values) runs of constants, (_INPUT, i) an input tensor, (_DESCRIPTOR, position, step, meta)
    a TMA descriptor over an input (encoded per address), (_BUILT, step) anything else built per call."""
    plan, consts = [], []
    for pos, step in enumerate(recipe):
        meta = descriptor_meta.get(pos)
        if meta is None and step[0] == "const":
            consts.append(step[1])
            continue
        if consts:
            plan.append((_CONSTS, tuple(consts)))
            consts = []
        if meta is not None:
            if step[0] != "descriptor":
                raise _Uncacheable()
            plan.append((_DESCRIPTOR, pos, step, meta))
        elif step[0] == "input":
            plan.append((_INPUT, step[1]))
        else:
            plan.append((_BUILT, step))
    if consts:
        plan.append((_CONSTS, tuple(consts)))
    return tuple(plan)


def _build(step: tuple, inputs: Sequence) -> Any:
    kind = step[0]
    if kind == "input":
        return inputs[step[1]]
    if kind == "const":
        return step[1]
    if kind == "tuple":
        return tuple(_build(s, inputs) for s in step[1])
    # A descriptor with the same geometry as the validated first one, over a new base of the
    # same shape, strides, dtype and alignment (all in the key): skip its re-validation.
    _, i, cls, fields = step
    desc = object.__new__(cls)
    desc.__dict__.update(fields)
    desc.base = inputs[i]
    return desc


def _current_stream(device: Optional[int]) -> int:
    from triton.runtime.driver import driver

    return driver.active.get_current_stream(device)


def _relaunch(entry: _Launch, inputs: Sequence) -> None:
    from triton import knobs

    kernel = entry.kernel
    stream = _current_stream(inputs[0].device.index)
    if entry.direct is not None and not launch_hooks_active():
        _launch_direct(entry, stream, inputs)
        return
    args = list(entry.constants)
    for pos, step in entry.slots:
        args[pos] = _build(step, inputs)
    enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    g0, g1, g2 = entry.grid
    metadata = kernel.launch_metadata(entry.grid, stream, *args) if enter is not None else None
    kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, metadata, enter,
               exit_, *args)


_MAX_ENCODED = 64   # encoded descriptors kept per launch entry


def _launch_direct(entry: _Launch, stream: int, inputs: Sequence) -> None:
    """Launch through the C launcher with each TMA descriptor encoded once per (argument, address).

    The entry's key fixes every descriptor's shape, strides, dtype and block, so its encoding (a
    CUtensorMap plus its shape and strides) depends only on the base address: a compiled graph that
    reuses its buffers' addresses skips cuTensorMapEncodeTiled and triton's Python wrapper per call.
    The argument list is assembled from the entry's plan: constants in runs, no descriptor object
    built unless its address is new.
    """
    direct, encoded = entry.direct, entry.encoded
    flat = []
    for seg in entry.direct_plan:
        kind = seg[0]
        if kind == _CONSTS:
            flat.extend(seg[1])
        elif kind == _INPUT:
            flat.append(inputs[seg[1]])
        elif kind == _DESCRIPTOR:
            _, pos, step, meta = seg
            key = (pos, inputs[step[1]].data_ptr())
            enc = encoded.get(key)
            if enc is None:
                if len(encoded) >= _MAX_ENCODED:
                    encoded.clear()
                enc = encoded[key] = direct.expand(_build(step, inputs), meta)
            flat.extend(enc)
        else:
            flat.append(_build(seg[1], inputs))
    kernel = entry.kernel
    g0, g1, g2 = entry.grid
    direct.launch(g0, g1, g2, stream, kernel.function, direct.cooperative, direct.pdl, None, None,
                  kernel.packed_metadata, None, None, None, *flat)
