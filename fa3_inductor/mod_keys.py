"""What a score_mod / mask_mod computes, as a hashable key.

The front door caches work per mod (a plan, a block mask) without asking users to keep their
mod objects alive or to build them once: ``mods.softcap(30.0)`` written inside a loop must hit
the cache. A mod's key is its code plus the values its closure cells, defaults (keyword-only
ones too) and the globals it names hold: numbers and strings by value, tensors by identity and
layout (and, with ``versions=True``, their in-place version counter), nested functions
recursively. A mod whose key cannot be read (a callable object, a functools.partial, an unusual
closure value) raises :class:`Unkeyable`; the caller decides what an unkeyed mod gets.

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


def layout_key(fn: Optional[Callable]) -> tuple[Hashable, list[Tensor]]:
    """(key, captured tensors): :func:`mod_key` with each captured tensor keyed by its layout
    (shape, strides, dtype, device) and its place among the tensors the walk meets, not by its
    identity; the tensors in that order. Raises :class:`Unkeyable`.

    For caches of work that reads the tensors at run time only (a kernel plan): transformers
    builds a new padding-mask tensor every forward, and the same plan serves it, bound to the
    tensors found at the same places. A tensor captured twice keeps one place, so a mod that
    captures one tensor twice and one that captures two differ.

    Example::

        >>> ids = torch.zeros(8, dtype=torch.int32)
        >>> key, found = layout_key(mods.document(ids))
        >>> layout_key(mods.document(ids.clone()))[0] == key and found[0] is ids
        True
    """
    found: list[Tensor] = []
    return _fn_key(fn, 0, False, found=found), found


def _fn_key(fn: Optional[Callable], depth: int, versions: bool,
            watch: Optional["ModWatch"] = None, found: Optional[list] = None) -> Hashable:
    """The walk behind mod_key; with ``watch``, it also records every place it read (ModWatch);
    with ``found``, tensors are keyed by layout and place (:func:`layout_key`)."""
    if fn is None:
        return None
    if not isinstance(fn, types.FunctionType) or depth > _MAX_DEPTH:
        raise Unkeyable(f"{type(fn).__name__} is not a plain Python function")
    code = fn.__code__
    # keyword-only defaults live in a dict of their own (``def m(b, h, q, kv, *, w=w)``): as a tuple
    kw_defaults = tuple((fn.__kwdefaults__ or {}).items())
    if watch is not None:
        watch._defaults.append((fn, fn.__defaults__, kw_defaults))
        watch._cells.extend((c, c.cell_contents) for c in fn.__closure__ or ())
        watch._globals.extend((fn.__globals__, n, fn.__globals__[n]) for n in code.co_names
                              if n in fn.__globals__)
    cells = tuple(_value_key(c.cell_contents, depth, versions, watch, found)
                  for c in (fn.__closure__ or ()))
    names = tuple((n, _value_key(fn.__globals__[n], depth, versions, watch, found))
                  for n in code.co_names if n in fn.__globals__)
    key = (code, cells, names, _value_key(fn.__defaults__, depth, versions, watch, found))
    return key + (_value_key(kw_defaults, depth, versions, watch, found),) if kw_defaults else key


def _value_key(value: Any, depth: int, versions: bool, watch: Optional["ModWatch"] = None,
               found: Optional[list] = None) -> Hashable:
    if isinstance(value, _SCALARS):
        return (type(value), value)
    if isinstance(value, Tensor) and found is not None:
        place = next((i for i, t in enumerate(found) if t is value), len(found))
        if place == len(found):
            found.append(value)
        return ("tensor at", place, value.shape, value.stride(), value.dtype, value.device)
    if isinstance(value, Tensor):
        key = ("tensor", id(value), value.shape, value.stride(), value.dtype, value.device)
        if not versions:
            return key
        if watch is not None:
            watch._tensors.append((value, value._version))
        return key + (value._version,)
    if isinstance(value, types.FunctionType):
        return _fn_key(value, depth + 1, versions, watch, found)
    if isinstance(value, (types.ModuleType, types.BuiltinFunctionType, type, torch.dtype)):
        return ("object", id(value))
    if isinstance(value, list) and watch is not None:   # its items may change in place, unseen
        raise Unkeyable("it captures a list, which may change in place")
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_value_key(v, depth, versions, watch, found) for v in value))
    if callable(value) and str(getattr(value, "__module__", "")).startswith("torch"):
        return ("object", id(value))  # torch's own functions and op overloads
    raise Unkeyable(f"it captures a {type(value).__name__}")


class ModWatch:
    """Cheap per-call proof that a mod object still computes what it computed when watched.

    A cache keyed by a mod's identity (flex()'s direct call memo) must notice what :func:`mod_key`
    would: a closure cell, a default or a global the code names rebound to another object, and
    (``versions``) a captured tensor edited in place. mod_key's walk records each of those places
    with the object found there; :meth:`unchanged` then compares identities and
    version counters only, a few hundred nanoseconds for a typical mod. Raises :class:`Unkeyable`
    for what :func:`mod_key` cannot key.

    Example::

        >>> ids = torch.tensor([0, 0, 1, 1])
        >>> watch = ModWatch(mods.document(ids), versions=True)
        >>> watch.unchanged()
        True
        >>> ids[0] = 3; watch.unchanged()
        False
    """

    __slots__ = ("_cells", "_globals", "_defaults", "_tensors")

    def __init__(self, fn: Optional[Callable], versions: bool = False):
        self._cells: list = []
        self._globals: list = []
        self._defaults: list = []
        self._tensors: list = []
        if fn is not None:
            _fn_key(fn, 0, versions, self)   # mod_key's walk, recording what it read

    def unchanged(self) -> bool:
        """Whether every watched place still holds its object (and tensor its version)."""
        for cell, value in self._cells:
            if cell.cell_contents is not value:
                return False
        for namespace, name, value in self._globals:
            if namespace.get(name, _GONE) is not value:
                return False
        for fn, defaults, kw_defaults in self._defaults:
            if fn.__defaults__ is not defaults or not _same_items(fn.__kwdefaults__, kw_defaults):
                return False
        for tensor, version in self._tensors:
            if tensor._version != version:
                return False
        return True


_GONE = object()


def _same_items(kw_defaults: Optional[dict], items: tuple) -> bool:
    # a function's keyword-only defaults are a dict, which may be edited in place: compare the items
    if not items:
        return not kw_defaults
    return len(kw_defaults or ()) == len(items) and all(
        kw_defaults.get(name, _GONE) is value for name, value in items)
