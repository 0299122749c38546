"""Module buffers that recognition may read as constants, and the guards that keep that exact.

A registered mask buffer (GPT-2's ``bias = tril(ones(n, n))`` sliced to the sequence length)
reaches Dynamo's graph as an input, like a padding mask does, so recognition would have to read
it at run time. Its values are known when the backend compiles (Dynamo hands the backend the
real tensors), and they are what they are for the life of the module, unless someone writes
to the buffer. So recognition may evaluate a mask built from such buffers now, turn it into a
mask function with a block mask (no N×N read per call), and leave a guard: on every call the
buffer's version counter and address are compared with the ones seen at compile time (a few
integer reads), and only when they changed is the mask recomputed from the new values and
compared; a different mask raises an error saying what to do instead of computing with a
stale one.

Example::

    >>> with module_state.constants({placeholder: tensor}) as guards:     # doctest: +SKIP
    ...     rewrite_manual(gm, served)
    >>> guards   # BufferGuard per buffer a rewritten site read as a constant   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator

import torch
import torch.fx

_CONSTANTS: contextvars.ContextVar[dict] = contextvars.ContextVar("fa3_constants", default={})
_GUARDS: contextvars.ContextVar[list] = contextvars.ContextVar("fa3_guards", default=[])


@dataclasses.dataclass
class BufferGuard:
    """Re-checks, on each call, that a buffer read as a constant still gives the same mask."""

    index: int                       # position of the buffer among the graph's inputs
    name: str                        # for the error message
    version: int
    address: int
    same_mask: Callable[[torch.Tensor], bool]   # new buffer value -> does the mask still hold

    def check(self, value: torch.Tensor) -> None:
        if value._version == self.version and value.data_ptr() == self.address:
            return
        if not self.same_mask(value):
            raise RuntimeError(
                f"fa3_inductor: the module buffer {self.name} changed since compilation, and "
                "the attention mask recognition built from it (a constant mask with its block "
                "sparsity) no longer matches it. Recompile after changing it "
                "(torch._dynamo.reset()), or compile with options={'fa3.recognize': False} "
                "if the buffer is meant to change between calls.")
        self.version, self.address = value._version, value.data_ptr()


@contextlib.contextmanager
def constants(values: dict[torch.fx.Node, tuple[int, str, torch.Tensor]]) -> Iterator[list]:
    """Within the block, recognition may read ``values`` (placeholder -> (input index, name,
    real tensor)) as constants; the guards it leaves are appended to the yielded list."""
    guards: list[BufferGuard] = []
    token_c, token_g = _CONSTANTS.set(values), _GUARDS.set(guards)
    try:
        yield guards
    finally:
        _CONSTANTS.reset(token_c)
        _GUARDS.reset(token_g)


def constant_value(node: Any) -> torch.Tensor | None:
    """The real value of a graph input recognition may treat as constant, or None."""
    entry = _CONSTANTS.get().get(node)
    return entry[2] if entry is not None else None


def add_guard(node: torch.fx.Node, same_mask: Callable[[torch.Tensor], bool]) -> None:
    """Record that a rewritten site relies on ``node``'s current value (see BufferGuard)."""
    index, name, value = _CONSTANTS.get()[node]
    _GUARDS.get().append(BufferGuard(index, name, value._version, value.data_ptr(), same_mask))
