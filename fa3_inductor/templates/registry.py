"""The kernel families, in the order the planner and the runtime prefer them.

Each line names a folder under ``templates/`` whose ``family`` module defines ``FAMILY``
(templates/family.py). Adding a family is one line here. torch's dense kernel is last: it serves
every site, as the last resort, and a reason is recorded whenever it runs.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Iterator, Optional

from .._log import warn_once
from .family import KernelFamily, SiteFacts

FAMILY_FOLDERS = (
    "hopper_fp8",    # Gluon, sm90: e4m3 inputs from the FP8 prologue (FP8 sites only)
    "hopper",        # Gluon, sm90: FlashAttention-3 structure
    "fp8",           # Triton, e4m3 inputs from the FP8 prologue: sm89+ and the CPU interpreter
    "generic",       # Triton, any CUDA GPU and the CPU interpreter
    "torch_dense",   # torch ops, dense: the last resort
)

_loaded: Optional[list[KernelFamily]] = None


def families() -> tuple[KernelFamily, ...]:
    """Every family that could be imported, in preference order (one that cannot be imported is
    left out, with a warning: the Hopper family needs triton's Gluon).

    Example::

        >>> [f.name for f in families()]
        ['hopper_fp8', 'hopper', 'fp8', 'generic', 'torch']
    """
    global _loaded
    if _loaded is None:
        found = []
        for folder in FAMILY_FOLDERS:
            try:
                found.append(importlib.import_module(f"{__package__}.{folder}.family").FAMILY)
            except ImportError as exc:
                warn_once(f"fa3_inductor: kernel family {folder!r} unavailable ({exc})")
        _loaded = found
    return tuple(_loaded)


def family(name: str) -> KernelFamily:
    """The family called ``name``.

    Example::

        >>> family("generic").dialect
        'tl'
    """
    for f in families():
        if f.name == name:
            return f
    raise KeyError(f"no kernel family {name!r} (have {names()})")


def names() -> tuple[str, ...]:
    """The families' names, in preference order.

    Example::

        >>> names()[-1]
        'torch'
    """
    return tuple(f.name for f in families())


def candidates(site: SiteFacts, start: str = "auto") -> tuple[list[KernelFamily], list[str]]:
    """(the families that serve ``site``, in preference order; the reasons worth a note of those
    that do not). ``start`` names the family to begin with (the ``template`` option), "auto" the
    first. The last family serves every site, so the list is never empty.

    Example::

        >>> fams, notes = candidates(SiteFacts(torch.device("cpu"), torch.float32, 64, 64))  # doctest: +SKIP
        >>> [f.name for f in fams]                                                             # doctest: +SKIP
        ['generic', 'torch']
    """
    order = families()
    if start != "auto":
        order = order[[f.name for f in order].index(start):]
    serving, notes = [], []
    for f in order:
        reason = f.serves(site)
        if reason is None:
            serving.append(f)
        elif reason and not serving:   # a preferred family's reason, if it has one to give
            notes.append(reason)
    return serving, notes


@contextlib.contextmanager
def registered(extra: KernelFamily, before: Optional[str] = None) -> Iterator[None]:
    """Register ``extra`` for the duration of a ``with`` block, ahead of ``before`` (default: first).
    For tests and experiments; a shipped family is a line in FAMILY_FOLDERS.

    Example::

        >>> with registered(my_family):   # doctest: +SKIP
        ...     fa3_inductor.flex(q, k, v)
    """
    current = list(families())
    at = 0 if before is None else [f.name for f in current].index(before)
    global _loaded
    saved = _loaded
    _loaded = current[:at] + [extra] + current[at:]
    try:
        yield
    finally:
        _loaded = saved
