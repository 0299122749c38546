"""The *torch* dialect of the mod generator: a score_mod / mask_mod FX graph as torch code.

modgen.py turns a mod graph into a ``tl``/``gl`` jit function over one tile; this module turns
the same graph into a plain Python function over broadcasting torch tensors, for code that
recomputes attention densely on any device (the CPU backward, runtime/backward_cpu.py). It
reuses modgen's emitter, so both dialects accept exactly the same ops, and binds the emitted
names to ``torch_mod_helpers`` (``T``). The source travels in the op's spec string, so a graph
served from Inductor's FX cache in a fresh process rebuilds the mod from text.

Generated code (for ``score + bias[h]``)::

    def score_mod(score, b, h, q_idx, kv_idx, bufs):
        v0 = bufs[0][h]
        v1 = (score + v0)
        return (v1 + T.zeros_like(score)).to(T.float32)

Example::

    >>> gm, bufs = trace_mod(lambda s, b, h, q, kv: s + (q - kv), "score")   # doctest: +SKIP
    >>> fn = load_torch_mod(generate_torch_mod_source(gm, "score", len(bufs)))  # doctest: +SKIP
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx

from .modgen import _BINARY, BufferSpec, UnsupportedMod, _Emitter, aten

_HEADER = "from fa3_inductor.templates import torch_mod_helpers as T\nH = T\n\n\n"


class _TorchEmitter(_Emitter):
    """modgen's emitter with torch spellings: ``T.*`` for ``tl.*``/``H.*``, indexing for loads.
    Mods keep the plain ``(score, b, h, q_idx, kv_idx, bufs)`` signature (no scale folding)."""

    FOLD_SCALES = False
    # Python's % on tensors is torch.remainder (floor), not fmod (C's truncation, as Triton's %)
    BINARY = {**_BINARY, aten.fmod: "T.fmod({0}, {1})"}
    KNOWS_SHAPES = False   # torch_buffer_specs: dtypes only; an index is composed, then read

    def __init__(self, gm: torch.fx.GraphModule, kind: str,
                 buffers: Sequence[Optional[BufferSpec]]):
        super().__init__(gm, kind, buffers, "tl")
        self.L = "T"

    def emit(self) -> str:
        source = super().emit()
        return source[source.index("\ndef ") + 1:]  # drop the kernel hints and the jit decorator

    def cast(self, node: torch.fx.Node, src: Any, dtype: torch.dtype) -> None:
        self.assign(node, f"T.cast({self.arg(src)}, torch.{str(dtype).split('.')[-1]})", dtype)

    def gather(self, buf: torch.fx.Node, spec: BufferSpec, indices: Sequence[Any]) -> str:
        if spec.permuted:
            return self.flat_gather(buf, spec, indices)
        # torch's indexing counts negative indices from the end itself
        return f"{self.names[buf]}[{', '.join(self.arg(i) for i in indices) or '()'}]"

    def flat_gather(self, buf: torch.fx.Node, spec: BufferSpec, indices: Sequence[Any]) -> str:
        """A buffer the lowering laid out with its dynamic dimension outermost
        (lowering/common.buffer_order): read through its flat storage with the spec's strides,
        as the kernels' dialects read it."""
        terms = []
        for i, stride in zip(indices, spec.strides):
            if isinstance(i, torch.fx.Node):
                interval = self.known_interval(i)
                low, index = (interval[0] if interval else None), self.arg(i)
            else:
                low, index = i, i
            if low is None or low < 0:
                raise UnsupportedMod("a captured buffer with a dynamic-size inner dimension is indexed "
                                     "with a value that may be negative; index it with non-negative values")
            terms.append(f"({index}) * {stride}")
        return f"{self.names[buf]}.reshape(-1)[{' + '.join(terms) or '0'}]"

    def int_power(self, base: Any, exponent: Any) -> str:
        self.check_int_power(exponent)
        return f"T.pow({self.arg(base)}, {self.arg(exponent)})"

    def float_power(self, base: Any, exponent: Any) -> str:
        return f"T.pow({self.operand(base, True)}, {self.operand(exponent, True)})"


def torch_buffer_specs(dtypes: Sequence[Optional[torch.dtype]]) -> list[Optional[BufferSpec]]:
    """Buffer descriptions for the torch dialect: only the dtype matters (indexing needs no
    strides); None marks a captured scalar, which the mod must not use."""
    return [None if d is None else BufferSpec((), (), d) for d in dtypes]


def generate_torch_mod_source(gm: torch.fx.GraphModule, kind: str,
                              buffers: Sequence[Optional[BufferSpec]]) -> str:
    """Source of ``def score_mod(score, b, h, q_idx, kv_idx, bufs)`` (or ``mask_mod(b, h,
    q_idx, kv_idx, bufs)``) computing ``gm`` on broadcasting torch tensors.

    Raises :class:`UnsupportedMod` for what the generator does not know (the same set as the
    ``tl``/``gl`` dialects).

    Example::

        >>> src = generate_torch_mod_source(gm, "mask", [])    # doctest: +SKIP
        >>> src.startswith("def mask_mod(b, h, q_idx, kv_idx, bufs):")   # doctest: +SKIP
        True
    """
    if kind not in ("score", "mask"):
        raise ValueError(f"kind must be 'score' or 'mask', got {kind!r}")
    return _TorchEmitter(gm, kind, buffers).emit()


_LOADED: dict[str, Callable] = {}
_LOCK = threading.Lock()


def load_torch_mod(source: str) -> Callable:
    """The ``score_mod``/``mask_mod`` function defined by generated torch source (cached).

    Example::

        >>> src = "def mask_mod(b, h, q_idx, kv_idx, bufs):\\n    return q_idx >= kv_idx\\n"
        >>> fn = load_torch_mod(src)
        >>> fn(0, 0, torch.arange(3).view(3, 1), torch.arange(3).view(1, 3), ()).sum().item()
        6
    """
    fn = _LOADED.get(source)
    if fn is not None:
        return fn
    namespace: dict[str, Any] = {"torch": torch}
    code = compile(_HEADER + source, "<fa3_inductor generated torch mod>", "exec")
    exec(code, namespace)  # the source is our generator's output, carried in the op's spec
    fn = namespace.get("score_mod") or namespace["mask_mod"]
    with _LOCK:
        _LOADED[source] = fn
    return fn
