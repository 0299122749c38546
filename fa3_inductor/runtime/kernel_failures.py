"""When a kernel family cannot build its kernel for a site: the next family runs it, and the reason is kept.

The mod generator refuses what it does not know (UnsupportedMod, handled by the planner), but a
compiler can still reject what it accepted, or a kernel can ask for more shared memory than the
GPU has. Such an error must never reach the user (issue 16). The op (runtime/ops.py) catches it
when a family first builds a launch, records it here under the family and the site's mods in that
family's dialect, and moves on to the site's next family; torch's dense kernel, last, always serves.
Later plans of the same mods (``plan_site``, flex()'s direct path) read the record: when every one
of our compiled families has failed, they hand the site to torch's FlexAttention up front, so
explain() and the ``fa3_inductor`` log show the reason.

Example::

    >>> kernel_failure(spec)      # doctest: +SKIP
    None
"""

from __future__ import annotations

from typing import Optional

import torch

from .._log import warn_once
from .spec import SiteSpec

_FAILED: dict[tuple, str] = {}
_MAX_FAILED = 256


def is_build_error(exc: BaseException) -> bool:
    """Whether an exception raised while preparing or compiling a launch means "our kernel cannot be
    built here" (a compiler or interpreter error, too few resources, a mod the kernel cannot call),
    rather than a condition of the device (out of memory, a CUDA error), which must reach the caller."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    return not (isinstance(exc, RuntimeError) and "CUDA error" in str(exc))


def family_failure(site: SiteSpec, family: str) -> Optional[str]:
    """Why ``family``'s kernel could not be built for this site's mods earlier in this process, or None.

    Example::

        >>> family_failure(spec, "generic")   # doctest: +SKIP
        'generic kernel failed to build for these mods (CompilationError: ...)'
    """
    return _FAILED.get((family, site.mods))


def kernel_failure(site: SiteSpec) -> Optional[str]:
    """Why none of our compiled families can serve this site's mods (each has failed to build for
    them earlier in this process), or None while one of them may.

    Example::

        >>> kernel_failure(spec)   # doctest: +SKIP
        "hopper kernel failed to build for these mods (...); generic kernel failed to build ..."
    """
    ours = site.families[:-1]   # the last family serves every site (templates/registry.py): not ours
    reasons = [family_failure(site, f) for f in ours]
    if not ours or any(r is None for r in reasons):
        return None
    return "; ".join(reasons) + "; torch's kernel runs"


def record_kernel_failure(site: SiteSpec, family: str, exc: BaseException) -> str:
    """Remember that ``family``'s kernel failed to build for ``site``'s mods; returns the reason."""
    root = exc
    while root.__cause__ is not None or root.__context__ is not None:   # the interpreter nests errors
        root = root.__cause__ or root.__context__
    first_line = next((line for line in str(root).splitlines() if line.strip()), "")[:300]
    reason = f"{family} kernel failed to build for these mods ({type(root).__name__}: {first_line})"
    if len(_FAILED) >= _MAX_FAILED:
        _FAILED.clear()
    _FAILED[(family, site.mods)] = reason
    warn_once(f"fa3_inductor: {reason} ({site.description})")
    return reason


def clear() -> None:
    """Forget every recorded failure (tests)."""
    _FAILED.clear()
