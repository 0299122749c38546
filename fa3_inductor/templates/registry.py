"""The kernel families, in the order the planner and the runtime prefer them.

Each line names a folder under ``templates/`` whose ``family`` module defines ``FAMILY``
(templates/family.py). Adding a family is one line here. torch's dense kernel is last: it serves
every site, as the last resort, and a reason is recorded whenever it runs.

Backward families (``BACKWARD_FOLDERS``, the same convention) have their own list; their last
resorts are not families of ours: the dense recompute op ``fa3_inductor::flex_bwd`` on the CPU
(runtime/backward_cpu.py; the backward op also falls back to it when no family serves a call) and
torch's flex backward kernel elsewhere (the backward lowering hands it the site).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Iterator, Optional

import torch

from .._log import warn_once
from .family import BackwardFamily, BackwardSiteFacts, KernelFamily, SiteFacts

FAMILY_FOLDERS = (
    "hopper_fp8",    # Gluon, sm90: e4m3 inputs from the FP8 prologue (FP8 sites only)
    "decode",        # Triton, short queries (GQA group x tokens <= 128 rows): split-KV, any GPU
    "hopper",        # Gluon, sm90: FlashAttention-3 structure
    "fp8",           # Triton, e4m3 inputs from the FP8 prologue: sm89+ and the CPU interpreter
    "generic",       # Triton, any CUDA GPU and the CPU interpreter
    "torch_dense",   # torch ops, dense: the last resort
)

BACKWARD_FOLDERS = (
    "hopper_bwd",    # Gluon, sm90: FlashAttention-3 structure (skipped while its family module is absent)
    "generic_bwd",   # Triton, any CUDA GPU and the CPU interpreter; deterministic (dQ in its own pass)
)
# The backward's last resorts (module docstring), as the backward records name them.
TORCH_BACKWARD = "torch"   # GPUs: torch's flex backward Triton kernel
DENSE_BACKWARD = "dense"   # the CPU: the dense recompute op, fa3_inductor::flex_bwd

_loaded: Optional[list[KernelFamily]] = None
_loaded_backward: Optional[list[BackwardFamily]] = None


def families() -> tuple[KernelFamily, ...]:
    """Every family that could be imported, in preference order (one that cannot be imported is
    left out, with a warning: the Hopper family needs triton's Gluon).

    Example::

        >>> [f.name for f in families()]
        ['hopper_fp8', 'decode', 'hopper', 'fp8', 'generic', 'torch']
    """
    global _loaded
    if _loaded is None:
        _loaded = _import_families(FAMILY_FOLDERS, "kernel family", quiet_if_absent=False)
    return tuple(_loaded)


def _import_families(folders: tuple[str, ...], kind: str, quiet_if_absent: bool) -> list:
    """The ``FAMILY`` of each folder's ``family`` module that imports, in order; a failed import is
    warned about once, except (``quiet_if_absent``) a folder that has no family module yet."""
    found = []
    for folder in folders:
        try:
            found.append(importlib.import_module(f"{__package__}.{folder}.family").FAMILY)
        except ImportError as exc:
            if not (quiet_if_absent and _absent(exc, folder)):
                warn_once(f"fa3_inductor: {kind} {folder!r} unavailable ({exc})")
    return found


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


def _absent(exc: ImportError, folder: str) -> bool:
    """Whether ``exc`` says only that the folder or its family module does not exist (yet)."""
    base = f"{__package__}.{folder}"
    return isinstance(exc, ModuleNotFoundError) and exc.name in (base, f"{base}.family")


def backward_families() -> tuple[BackwardFamily, ...]:
    """Every backward family that could be imported, in preference order. A folder without a family
    module is skipped quietly (a family being written); one whose import fails otherwise is left
    out with a warning.

    Example::

        >>> [f.name for f in backward_families()]   # doctest: +SKIP
        ['hopper_bwd', 'generic_bwd']
    """
    global _loaded_backward
    if _loaded_backward is None:
        _loaded_backward = _import_families(BACKWARD_FOLDERS, "backward family", quiet_if_absent=True)
    return tuple(_loaded_backward)


def backward_family(name: str) -> BackwardFamily:
    """The backward family called ``name``.

    Example::

        >>> backward_family("generic_bwd").dialect
        'tl'
    """
    for f in backward_families():
        if f.name == name:
            return f
    raise KeyError(f"no backward family {name!r} (have {[f.name for f in backward_families()]}); "
                   "check templates/registry.py's BACKWARD_FOLDERS")


def backward_candidates(site: BackwardSiteFacts, start: str = "auto"
                        ) -> tuple[list[BackwardFamily], list[str]]:
    """(the backward families that serve ``site``, in preference order; the reasons worth a note of
    those that do not). ``start`` names the family to begin with, "auto" (or a name not loaded) the
    first. Unlike :func:`candidates` the list may be empty: the last resort
    (:func:`backward_last_resort`) then serves the site.

    Example::

        >>> fams, notes = backward_candidates(BackwardSiteFacts(torch.device("cpu"), torch.float32, 64, 64))  # doctest: +SKIP
        >>> [f.name for f in fams]                                                                             # doctest: +SKIP
        ['generic_bwd']
    """
    order = backward_families()
    names_ = [f.name for f in order]
    if start in names_:
        order = order[names_.index(start):]
    serving, notes = [], []
    for f in order:
        reason = f.serves_backward(site)
        if reason is None:
            serving.append(f)
        elif reason and not serving:   # a preferred family's reason, if it has one to give
            notes.append(f"{f.name}: {reason}")
    return serving, notes


def backward_last_resort(device: torch.device) -> str:
    """What serves a backward site no family of ours serves: the dense recompute on the CPU (Inductor
    has no CPU flex backward), torch's kernel elsewhere.

    Example::

        >>> backward_last_resort(torch.device("cpu"))
        'dense'
    """
    return DENSE_BACKWARD if device.type == "cpu" else TORCH_BACKWARD
