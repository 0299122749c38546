"""The walk both ops make over a site's kernel families: the first that serves the call runs it.

A family is passed over when it failed to build for these mods earlier in this process
(kernel_failures.py), is not importable here (``lookup`` gives None: a cache-served graph planned
in a process that had it), refuses the call (NotServed), or fails to build now (recorded, so later plans skip it). Other
errors (device conditions, bugs) reach the caller. The forward op (ops.py) and the backward op
(ops_bwd.py) differ only in how they find a family and what running it means.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from .._log import info_once, warn_once
from ..templates.family import NotServed
from .kernel_failures import family_failure, is_build_error, record_kernel_failure


def first_serving(names: Sequence[str], failure_key: Any, description: str, kind: str,
                  lookup: Callable[[str], Optional[Any]], run: Callable[[Any], None]
                  ) -> tuple[Optional[str], list[str]]:
    """Run the call with the first family of ``names`` that serves it: ``run(lookup(name))``.
    Returns (its name, or None when none served; why each earlier family was passed over).
    ``failure_key`` keys recorded build failures (the site, or its build key); ``kind`` names the
    families in the log ("kernel family", "backward family"); ``description``: the site's shape.

    Example::

        >>> name, passed_over = first_serving(site.families, site, site.description, "kernel family",
        ...                                   family_named, lambda family: ...)   # doctest: +SKIP
    """
    passed_over: list[str] = []
    for name in names:
        failed = family_failure(failure_key, name)
        if failed is not None:
            passed_over.append(failed)
            continue
        family = lookup(name)
        if family is None:   # a cache-served graph planned in a process that had this family
            passed_over.append(f"{kind} {name} is not available in this process")
            continue
        try:
            run(family)
        except NotServed as why:
            info_once(f"fa3_inductor: {why}; the next {kind} runs ({description})")
            passed_over.append(str(why))
            continue
        except Exception as exc:
            if not is_build_error(exc):
                raise
            passed_over.append(record_kernel_failure(failure_key, name, exc))
            continue
        if passed_over:
            warn_once(f"fa3_inductor: {name} runs {description or 'a site'}: {'; '.join(passed_over)}")
        return name, passed_over
    return None, passed_over
