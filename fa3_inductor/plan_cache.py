"""Plans of a site, cached by what its mods compute and bound to each call's captured tensors.

direct.py (forward) and direct_bwd.py (backward) plan a site once: trace the mods, generate their
code, pick the kernel family. A plan depends on what the mods compute and on the layouts of the
tensors they capture, not on those tensors' values, which the kernel reads at run time
(FlexAttention's mods cannot branch on them in Python either: torch.compile traces them). So a
mod is keyed by :func:`fa3_inductor.mod_keys.layout_key`, and a cached plan is handed out bound
to the tensors this call's mods capture at the places where the planned mods held theirs.

Why not by the tensors' identities: transformers' ``attn_implementation="fa3"`` mask captures a
padding mask made anew by every forward, so each prefill re-planned on its first layer (a
make_fx trace of the mask, on CUDA with two device-to-host copies, and code generation).

A plan whose buffers are not all tensors the mods capture (a tensor made while tracing) is
cached by the tensors' identities, as everything was before; a mod that cannot be keyed, by the
mod object itself.

Example::

    >>> plan = cached(_PLANS, 512, site, score_mod, mask_mod, lambda: plan_direct(...))  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Callable, Hashable, Optional

from torch import Tensor

from .mod_keys import Unkeyable, layout_key, mod_key

_BY_IDENTITY = object()   # stored under a layout key whose plan cannot be bound to other tensors


class Plan:
    """A planned site: ``spec`` (the site as JSON, None when our kernels do not serve it, then
    ``reason`` says why) and the mods' captured buffers in the order the kernel takes them.
    ``places``: where each buffer sits among the tensors ``layout_key`` finds in the score and
    the mask mod (None: not known)."""

    __slots__ = ("spec", "score_bufs", "mask_bufs", "reason", "places")

    def __init__(self, spec: Optional[str], score_bufs: list, mask_bufs: list,
                 reason: Optional[str], places: Optional[tuple] = None):
        self.spec, self.score_bufs, self.mask_bufs, self.reason, self.places = (
            spec, score_bufs, mask_bufs, reason, places)

    def bound_to(self, score_found: list[Tensor], mask_found: list[Tensor]) -> "Plan":
        """This plan with the buffers found at its places."""
        score_at, mask_at = self.places
        return Plan(self.spec, [score_found[i] for i in score_at], [mask_found[i] for i in mask_at],
                    self.reason, self.places)


def cached(plans: dict, limit: int, site: Hashable, score_mod: Optional[Callable],
           mask_mod: Optional[Callable], make: Callable[[], Plan]) -> Plan:
    """The plan of (``score_mod``, ``mask_mod``) at ``site`` from ``plans``, made by ``make()`` on a
    miss; it carries this call's captured tensors. ``plans`` is cleared when it holds ``limit``.

    Example::

        >>> p = cached({}, 8, ("site",), None, mods.causal, lambda: Plan("{}", [], [], None))
        >>> (p.spec, p.mask_bufs)
        ('{}', [])
    """
    try:
        (score_key, score_found), (mask_key, mask_found) = layout_key(score_mod), layout_key(mask_mod)
    except Unkeyable:
        return _by_key(plans, limit, (score_mod, mask_mod, site), make)
    key = (score_key, mask_key, site)
    plan = plans.get(key)
    if plan is _BY_IDENTITY:
        return _by_key(plans, limit, (mod_key(score_mod), mod_key(mask_mod), site), make)
    if plan is not None:
        return plan.bound_to(score_found, mask_found)
    plan = make()
    places = _places(plan.score_bufs, score_found), _places(plan.mask_bufs, mask_found)
    if None in places:
        _store(plans, limit, key, _BY_IDENTITY)
        _store(plans, limit, (mod_key(score_mod), mod_key(mask_mod), site), plan)
    else:   # kept without its tensors: a cached plan keeps none of them alive
        _store(plans, limit, key, Plan(plan.spec, [], [], plan.reason, places))
    return plan


def _places(bufs: list[Tensor], found: list[Tensor]) -> Optional[tuple[int, ...]]:
    at = tuple(next((i for i, t in enumerate(found) if t is buf), -1) for buf in bufs)
    return None if -1 in at else at


def _by_key(plans: dict, limit: int, key: Hashable, make: Callable[[], Plan]) -> Plan:
    plan = plans.get(key)
    if plan is None:
        plan = make()
        _store(plans, limit, key, plan)
    return plan


def _store(plans: dict, limit: int, key: Hashable, value: object) -> None:
    if len(plans) >= limit:
        plans.clear()
    plans[key] = value
