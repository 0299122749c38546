"""What a score_mod / mask_mod computes, as a hashable key.

The front door caches work per mod (a plan, a block mask) without asking users to keep their
mod objects alive or to build them once: ``mods.softcap(30.0)`` written inside a loop must hit
the cache. A mod's key is its code plus the values its closure cells, defaults and the globals
it names hold: numbers and strings by value, tensors by identity and layout (and, with
``versions=True``, their in-place version counter), nested functions recursively. A mod whose
key cannot be read (a callable object, a functools.partial, an unusual closure value) raises
:class:`Unkeyable`; the caller decides what an unkeyed mod gets.

A key holds tensor ids, which stay unique only while the tensor lives: whoever caches by a key
must keep the mod (and so its tensors) alive as long as the entry.

Example::

    >>> from fa3_inductor import mods
    >>> mod_key(mods.softcap(30.0)) == mod_key(mods.softcap(30.0))
    True
    >>> mod_key(mods.softcap(30.0)) == mod_key(mods.softcap(31.0))
    False
"""

from __future__ import annotations

import types
from typing import Any, Callable, Hashable, Optional

import torch
from torch import Tensor

_SCALARS = (bool, int, float, complex, str, bytes, type(None))
_MAX_DEPTH = 8


class Unkeyable(Exception):
    """The mod's behaviour cannot be read from its code and closure."""


def mod_key(fn: Optional[Callable], versions: bool = False) -> Hashable:
    """The key of what ``fn`` computes (None for None); raises :class:`Unkeyable`.

    ``versions``: include each captured tensor's version counter, so that editing it in place
    changes the key (for caches of values computed from the tensor's contents, like a block
    mask; a kernel that reads the tensor at run time needs no such key).

    Example::

        >>> ids = torch.zeros(8, dtype=torch.int32)
        >>> before = mod_key(mods.document(ids), versions=True)
        >>> ids[3] = 1
        >>> mod_key(mods.document(ids), versions=True) == before
        False
    """
    return _fn_key(fn, 0, versions)


def _fn_key(fn: Optional[Callable], depth: int, versions: bool) -> Hashable:
    if fn is None:
        return None
    if not isinstance(fn, types.FunctionType) or depth > _MAX_DEPTH:
        raise Unkeyable(f"{type(fn).__name__} is not a plain Python function")
    code = fn.__code__
    cells = tuple(_value_key(c.cell_contents, depth, versions) for c in (fn.__closure__ or ()))
    names = tuple((n, _value_key(fn.__globals__[n], depth, versions)) for n in code.co_names
                  if n in fn.__globals__)
    return (code, cells, names, _value_key(fn.__defaults__, depth, versions))


def _value_key(value: Any, depth: int, versions: bool) -> Hashable:
    if isinstance(value, _SCALARS):
        return (type(value), value)
    if isinstance(value, Tensor):
        key = ("tensor", id(value), value.shape, value.stride(), value.dtype, value.device)
        return key + (value._version,) if versions else key
    if isinstance(value, types.FunctionType):
        return _fn_key(value, depth + 1, versions)
    if isinstance(value, (types.ModuleType, types.BuiltinFunctionType, type, torch.dtype)):
        return ("object", id(value))
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_value_key(v, depth, versions) for v in value))
    if callable(value) and str(getattr(value, "__module__", "")).startswith("torch"):
        return ("object", id(value))  # torch's own functions and op overloads
    raise Unkeyable(f"it captures a {type(value).__name__}")
