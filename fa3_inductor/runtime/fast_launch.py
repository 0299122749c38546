"""Re-launch a compiled kernel without Triton's per-call argument binding.

`JITFunction.run` re-derives the specialization of every argument on every call (~40 arguments
here, tuples and descriptors included), builds a string cache key and checks globals before it
launches. For one attention site all of that is fixed by the inputs' shapes, strides, dtypes
and 16-byte alignment, so we do it once per such signature: the first call launches through
`JITFunction.run` and records a *recipe* of its arguments (which argument is which input tensor,
which is a TMA descriptor over which input, which are constants); later calls with the same
signature substitute the new tensors and call the compiled kernel's launcher directly.

Where triton's C launcher is reachable (`_compat.c_launcher`) and no launch hook is active, a hit calls
it directly, skipping triton's Python wrapper, and passes tensors as their addresses (ints), which spares
the launcher a `data_ptr()` call and a `cuPointerGetAttribute` per pointer. Host TMA descriptors (the
Hopper template passes four, eight for a head dim split into two tiles) are encoded once per (argument,
address), and the whole argument tuple is kept per (stream, input addresses): the caching allocator hands
a loop, and a compiled graph, the same addresses call after call, so a repeat costs one key and one call.

The recipe holds no reference to the first call's tensors (they may be large and are the
caller's), only tiny placeholder tensors the kernel never reads and tensors a plan made and
marked as its own (:func:`launch_constant`: the backward's CTA order). Anything it cannot account
for (a tensor argument that is neither an input nor a placeholder, e.g. a contiguous copy
made while preparing the launch) makes the signature uncacheable: those calls keep taking
the ordinary path.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Optional, Sequence

import torch

from .._compat import c_launcher, launch_hooks_active

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
    # The C launcher (_compat.c_launcher) and its host TMA descriptors' encodings: (argument position,
    # data_ptr) -> the C arguments. None: launch through kernel.run.
    direct: Any = None
    encoded: Optional[dict] = None
    args: Optional["_DirectArgs"] = None   # the C launcher's argument list, see _DirectArgs
    device: Optional[int] = None           # the inputs' CUDA device index (part of the key)


_CACHE: dict[Hashable, _Launch] = {}


def tensor_signature(tensors: Sequence[Optional[torch.Tensor]]) -> tuple:
    """What of each tensor a compiled launch depends on (not its address beyond alignment).

    Example::

        >>> tensor_signature([torch.zeros(2, 3), None])[1]
        >>> tensor_signature([torch.zeros(2, 3)])[0][:2]
        (torch.Size([2, 3]), (3, 1))
    """
    # a list comprehension, not a generator: it runs twice on every hit of our ops (one per op call)
    return tuple([None if t is None else
                  (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)
                  for t in tensors])


def aliasing(tensors: Sequence[Optional[torch.Tensor]]) -> Optional[tuple]:
    """None when no tensor object stands at two places of ``tensors`` (the usual case), else which
    place repeats which. A recording finds inputs by identity, so one made where a tensor fills two
    places (``flex(q, q, q)``) is right only for calls that repeat it alike: a key of
    :func:`launch_cached` includes this beside :func:`tensor_signature`.

    Example::

        >>> x, y = torch.zeros(2), torch.zeros(2)
        >>> aliasing([x, y, None]), aliasing([x, x, y])
        (None, (0, 0, 2))
    """
    ids = [id(t) for t in tensors if t is not None]
    if len(set(ids)) == len(ids):
        return None
    first: dict = {}
    return tuple(None if t is None else first.setdefault(id(t), i) for i, t in enumerate(tensors))


def launch_cached(key: Hashable, inputs: Sequence[Optional[torch.Tensor]],
                  prepare: Callable[[], tuple[Any, tuple, dict, tuple, Any]]) -> Any:
    """Launch a kernel for ``inputs``; ``key`` must determine everything but their addresses.

    ``prepare()`` returns ``(jit_function, args, kwargs, grid, tag)`` for an ordinary launch;
    it is called only on the first launch of a key (and on every launch of an uncacheable
    key). ``key`` must include :func:`tensor_signature` and :func:`aliasing` of ``inputs`` and
    every non-tensor value the launch depends on. Returns ``tag`` (the caller's note of what it launched).

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
    direct = c_launcher(kernel)
    direct_args, encoded = None, {}
    if direct is not None:
        try:
            direct_args = _DirectArgs.of(kernel, grid, recipe, direct, inputs, encoded)
        except _Uncacheable:
            direct = None
    _CACHE[key] = _Launch(kernel, grid, constants, slots, tag, direct, encoded if direct is not None else None,
                          direct_args, inputs[0].device.index)
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


def stats() -> dict[str, int]:
    """Counters since the process started: recorded launches re-launched, C-launcher argument lists built
    (a relaunch at input addresses not seen before for its entry, or one with per-call arguments), and TMA
    descriptors encoded for a new base address. Built and encoded staying near zero per step after the
    first steps means the relaunches reuse what they built.

    Example::

        >>> sorted(stats())
        ['argument_lists_built', 'descriptors_encoded', 'relaunches']
    """
    return dict(_STATS)


def clear() -> None:
    """Forget every recorded launch (tests; after changing kernels in-process), and whatever the
    callers registered with :func:`on_clear` holds of them."""
    _CACHE.clear()
    for forget in _ON_CLEAR:
        forget()


_ON_CLEAR: list[Callable[[], None]] = []


def on_clear(forget: Callable[[], None]) -> None:
    """Call ``forget`` on every :func:`clear`: for a caller that keeps recorded entries (from
    :func:`recorded`) of its own, so that they go with the cache's.

    Example::

        >>> on_clear(_PLANS.clear)   # doctest: +SKIP
    """
    if forget not in _ON_CLEAR:
        _ON_CLEAR.append(forget)


def launch_constant(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t``, a small tensor a launch's preparation made and nothing else writes (the sm90 backward's CTA
    order or tile lists), as a constant of the launches that take it: their recipe keeps it, and a relaunch
    passes it again, instead of the launch being uncacheable. Its contents are the plan's: a relaunch does
    not recompute them, so mark only what stays valid for every input of the launch key (the CTA lists are a
    permutation of all tiles, whatever the mask's contents). Returns ``t``.

    Example::

        >>> order = launch_constant(torch.arange(4, dtype=torch.int32))
        >>> rebinding((order,), [])[0][0]
        'const'
    """
    t._fa3_launch_constant = True
    return t


def rebinding(args: Sequence, inputs: Sequence[Optional[torch.Tensor]]) -> Optional[tuple]:
    """A recipe of ``args`` (one step an argument) that :func:`rebound` turns into the arguments
    of new ``inputs`` of the same signature and aliasing: an argument that is one of ``inputs``
    (by identity, in a tuple or a TMA descriptor too) is taken from the new inputs, anything else
    is kept. For launches this cache cannot record (Triton's interpreter compiles nothing); None
    when an argument is a tensor that is no input and no one-element placeholder (made while
    preparing the launch).

    Example::

        >>> x, y = torch.zeros(4), torch.ones(4)
        >>> rebound(rebinding((x, 3, (x,)), [x]), [y])[2][0] is y
        True
    """
    index_of = {id(t): i for i, t in enumerate(inputs) if t is not None}
    try:
        return tuple(_step(v, index_of) for v in args)
    except _Uncacheable:
        return None


def rebound(recipe: tuple, inputs: Sequence[Optional[torch.Tensor]]) -> list:
    """The arguments :func:`rebinding`'s ``recipe`` stands for, for ``inputs``."""
    return [_build(step, inputs) for step in recipe]


def _record(jit_fn: Any, args: tuple, kwargs: dict, inputs: Sequence) -> tuple:
    values = list(args)
    for param in jit_fn.params[len(args):]:
        if param.name in kwargs:
            values.append(kwargs[param.name])
        elif param.has_default:
            values.append(param.default)
        else:
            raise _Uncacheable()
    recipe = rebinding(values, inputs)
    if recipe is None:
        raise _Uncacheable()
    return recipe


def _step(value: Any, index_of: dict) -> tuple:
    if isinstance(value, torch.Tensor):
        i = index_of.get(id(value))
        if i is not None:
            return ("input", i)
        if value.numel() <= 1 or getattr(value, "_fa3_launch_constant", False):
            return ("const", value)   # a placeholder for an absent table (never read), or the plan's own
        raise _Uncacheable()
    if isinstance(value, tuple):
        steps = tuple(_step(v, index_of) for v in value)
        if all(s[0] == "const" for s in steps):
            return ("const", value)
        return ("tuple", steps)
    base = getattr(value, "base", None)
    if isinstance(base, torch.Tensor) and hasattr(value, "block_shape"):
        i = index_of.get(id(base))
        if i is None:
            raise _Uncacheable()
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)
                  if f.name != "base"}
        return ("descriptor", i, type(value), fields)
    return ("const", value)


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


_get_stream = None   # triton's current-stream getter, looked up on the first launch (every hit calls it)


def current_stream(device: Optional[int]) -> int:
    """The current CUDA stream of ``device`` as the launcher takes it (a handle), through triton's driver.

    Example::

        >>> current_stream(0)          # doctest: +SKIP
        0
    """
    global _get_stream
    if _get_stream is None:
        from triton.runtime.driver import driver

        _get_stream = driver.active.get_current_stream
    return _get_stream(device)


def _relaunch(entry: _Launch, inputs: Sequence) -> None:
    _STATS["relaunches"] += 1
    kernel = entry.kernel
    stream = current_stream(entry.device)
    if entry.direct is not None and not launch_hooks_active():
        _launch_direct(entry, stream, inputs)
        return
    from triton import knobs

    args = list(entry.constants)
    for pos, step in entry.slots:
        args[pos] = _build(step, inputs)
    enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    g0, g1, g2 = entry.grid
    metadata = kernel.launch_metadata(entry.grid, stream, *args) if enter is not None else None
    kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, metadata, enter,
               exit_, *args)


# Per launch entry, cleared when full. One entry serves every layer of a model whose attention sites share
# a signature, so these count layers × descriptors (or layers): at 64, a 32-layer model's 4-5 descriptors a
# call (distinct bases per layer) would have cleared the table before any layer came round again.
_MAX_ENCODED = 4096   # encoded descriptors kept per launch entry, one per (argument, base address)
_MAX_CALLS = 1024     # whole argument tuples kept per launch entry, one per (stream, input addresses)
_STATS = {"relaunches": 0, "argument_lists_built": 0, "descriptors_encoded": 0}
_HEAD = 13          # the C launcher's arguments before the kernel's: grid, stream, function, flags, metadata, hooks


class _DirectArgs:
    """The C launcher's whole argument list for one entry, with the per-call places marked.

    A call's list is the launch head, the constants, and in the marked places the stream, the input
    tensors' addresses, the few arguments built per call, and each TMA descriptor's encoding (a CUtensorMap
    plus its shape and strides). The entry's key fixes every descriptor's shape, strides, dtype and block,
    so its encoding depends only on the base address, and the whole list only on the stream and the inputs'
    addresses: ``calls`` keeps it under those (unless an argument is built per call, e.g. a tuple of
    tensors), so a repeat at the same addresses builds nothing.
    """

    __slots__ = ("template", "inputs", "built", "descriptors", "used", "calls")

    def __init__(self, template: list, inputs: tuple, built: tuple, descriptors: tuple):
        self.template = template        # [grid x/y/z, None (stream), function, ..., kernel arguments]
        self.inputs = inputs            # (index in the list, input index)
        self.built = built              # (index in the list, recipe step) built per call
        self.descriptors = descriptors  # (index in the list, length, argument position, input index, step, meta)
        self.used = tuple(sorted({i for _, i in inputs} | {d[3] for d in descriptors}))  # inputs read per call
        self.calls: Optional[dict] = None if built else {}   # (stream, *addresses) -> the argument tuple

    @staticmethod
    def of(kernel: Any, grid: tuple, recipe: tuple, direct: Any, inputs: Sequence,
           seed: dict) -> "_DirectArgs":
        """The argument list of ``recipe``; ``seed`` receives the encodings of ``inputs``' descriptors."""
        template = [*grid, None, kernel.function, direct.cooperative, direct.pdl, None, None,
                    kernel.packed_metadata, None, None, None]
        assert len(template) == _HEAD
        at_input, at_built, at_desc = [], [], []
        for pos, step in enumerate(recipe):
            meta = direct.descriptor_meta.get(pos)
            if meta is not None:
                if step[0] != "descriptor":
                    raise _Uncacheable()
                # the first call's encoding: its width (1 + 2 x rank) is fixed per step, and it is kept
                enc = seed[(pos, inputs[step[1]].data_ptr())] = direct.expand(_build(step, inputs), meta)
                width = len(enc)
                at_desc.append((len(template), width, pos, step[1], step, meta))
                template.extend([None] * width)
            elif step[0] == "const":
                value = step[1]
                # a placeholder tensor as its address (the entry's constants keep it alive)
                template.append(value.data_ptr() if isinstance(value, torch.Tensor) and value.is_cuda
                                else value)
            elif step[0] == "input":
                at_input.append((len(template), step[1]))
                template.append(None)
            else:
                at_built.append((len(template), step))
                template.append(None)
        return _DirectArgs(template, tuple(at_input), tuple(at_built), tuple(at_desc))

    def build(self, entry: _Launch, stream: int, inputs: Sequence) -> list:
        """The argument list of one call (descriptors from the entry's per-address encodings)."""
        encoded = entry.encoded
        args = self.template.copy()
        args[3] = stream
        for at, i in self.inputs:
            args[at] = inputs[i].data_ptr()
        for at, step in self.built:
            args[at] = _build(step, inputs)
        for at, width, pos, i, step, meta in self.descriptors:
            key = (pos, inputs[i].data_ptr())
            enc = encoded.get(key)
            if enc is None:
                if len(encoded) >= _MAX_ENCODED:
                    encoded.clear()
                enc = encoded[key] = entry.direct.expand(_build(step, inputs), meta)
                _STATS["descriptors_encoded"] += 1
            args[at:at + width] = enc
        return args


def _launch_direct(entry: _Launch, stream: int, inputs: Sequence) -> None:
    """Launch through the C launcher: the argument tuple of these addresses, built on their first call."""
    plan = entry.args
    calls = plan.calls
    if calls is None:
        _STATS["argument_lists_built"] += 1
        entry.direct.launch(*plan.build(entry, stream, inputs))
        return
    key = (stream, *[inputs[i].data_ptr() for i in plan.used])
    args = calls.get(key)
    if args is None:
        if len(calls) >= _MAX_CALLS:
            calls.clear()
        _STATS["argument_lists_built"] += 1
        args = calls[key] = tuple(plan.build(entry, stream, inputs))
    entry.direct.launch(*args)
