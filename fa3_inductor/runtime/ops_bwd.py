"""The op Inductor's output code calls for every backward site our backward families serve.

``torch.ops.fa3_inductor.flex_bwd.families`` is an overload of the backward op ``flex_bwd``
(runtime/backward_cpu.py, the dense recompute): one op name for "our backward", whichever
computes it. The backward lowering (lowering/flex_backward_lowering.py) emits one extern call to
it; it walks the site's backward families (BackwardSiteSpec.families, from the plan, in the
registry's order) and runs the call on the first that serves it (templates/family.py's
BackwardFamily). A family may refuse a call's tensors (NotServed) or fail to build its kernels
(recorded in kernel_failures.py); when none serves, the dense recompute computes the call, with the
reasons logged. Mods reach it as generated source inside the ``spec`` string (the score_mod, its
derivative and the mask_mod per dialect, and the gradients of captured tensors that need one:
templates/generic_bwd/buffer_grad.py), so a graph served from Inductor's cache rebuilds them. It
returns (dq, dk, dv, [the gradient of each captured tensor that needs one]), as the dense op does.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .._log import info_once, warn_once
from ..templates.family import BackwardCall, NotServed
from ..templates.generic_bwd.buffer_grad import BufferGradSource
from ..templates.modgen import GeneratedSource, ModInfo
from ..templates.registry import DENSE_BACKWARD, backward_family
from .backward_cpu import BackwardSpec, flex_bwd
from .kernel_failures import family_failure, is_build_error, record_kernel_failure
from .ops import _one_block_size

# Process-wide, not per thread: autograd runs a CUDA backward on its own device thread, not the
# caller's.
_state = types.SimpleNamespace(family=None)


@dataclasses.dataclass(frozen=True)
class BackwardSiteSpec:
    """One backward site: the backward families that may serve it, in preference order, and its
    mods as source per dialect, with the generator's records. The ``torch`` dialect's entry feeds
    the dense recompute, the op's last resort (no derivative: it differentiates by autograd).

    ``buffer_grads`` says, per tensor the score_mod captures (the op's ``score_bufs``), whether it
    gets a gradient: the op returns those, in order. ``buffer_grad_mods`` holds their generated
    sources per family dialect (:meth:`buffer_grad_sources`; build entries with
    :func:`buffer_grad_items`); the dense recompute needs none.

    Example::

        >>> spec = BackwardSiteSpec(("generic_bwd",), (("tl", None, None, None), ("torch", None, None, None)))
        >>> BackwardSiteSpec.from_json(spec.to_json()).sources("tl")
        (None, None, None)
    """

    families: tuple[str, ...]
    # (dialect, score_mod source, its derivative's source, mask_mod source); None: no mod, or for
    # the derivative with a score_mod: a derivative of 1 (the mod adds a term)
    mods: tuple[tuple[str, Optional[str], Optional[str], Optional[str]], ...] = ()
    score_info: tuple = ()        # templates/modgen.ModInfo fields of each mod, () for none
    score_grad_info: tuple = ()
    mask_info: tuple = ()
    deterministic: bool = False   # option fa3.deterministic_backward
    description: str = ""
    buffer_grads: tuple[bool, ...] = ()   # per score_mod tensor buffer: it gets a gradient
    # (dialect, (buffer_grad_items(source), ...)): one entry per family dialect when any gets one
    buffer_grad_mods: tuple = ()

    def sources(self, dialect: str) -> tuple[Optional[str], Optional[str], Optional[str]]:
        """(score_mod, its derivative, mask_mod) source in ``dialect``.

        Example::

            >>> BackwardSiteSpec((), (("torch", "def score_mod(...", None, None),)).sources("torch")[2] is None
            True
        """
        for name, score, score_grad, mask in self.mods:
            if name == dialect:
                return score, score_grad, mask
        raise KeyError(f"backward site has no mods in dialect {dialect!r} (has {[m[0] for m in self.mods]}); "
                       "the lowering writes one entry per family dialect: a bug, report it with the graph")

    def buffer_grad_sources(self, dialect: str) -> tuple[BufferGradSource, ...]:
        """The captured tensors' generated gradients in ``dialect``, one per true entry of
        ``buffer_grads``, in order; () when none gets one.

        Example::

            >>> BackwardSiteSpec(("generic_bwd",)).buffer_grad_sources("tl")
            ()
        """
        if not any(self.buffer_grads):
            return ()
        for name, items in self.buffer_grad_mods:
            if name == dialect:
                return tuple(_source_of(item) for item in items)
        raise KeyError(f"backward site has no captured-tensor gradients in dialect {dialect!r} (has "
                       f"{[m[0] for m in self.buffer_grad_mods]}); the lowering writes one entry per "
                       "family dialect: a bug, report it with the graph")

    def build_key(self) -> "_BuildKey":
        """What runtime/kernel_failures.py records a build failure under (it reads ``.mods`` and
        ``.description``): the mods and the captured tensors' gradients, which both shape the
        kernels a family builds.

        Example::

            >>> family_failure(site.build_key(), "generic_bwd")   # doctest: +SKIP
        """
        return _BuildKey((self.mods, self.buffer_grad_mods), self.description)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @staticmethod
    @functools.lru_cache(maxsize=256)  # parsed once per site, not per call
    def from_json(text: str) -> "BackwardSiteSpec":
        fields = json.loads(text)
        fields["families"] = tuple(fields["families"])
        fields["mods"] = tuple(tuple(m) for m in fields.get("mods", ()))
        for kind in ("score_info", "score_grad_info", "mask_info"):
            fields[kind] = tuple(tuple(item) for item in fields.get(kind, ()))
        fields["buffer_grads"] = tuple(fields.get("buffer_grads", ()))
        fields["buffer_grad_mods"] = _frozen(fields.get("buffer_grad_mods", ()))
        return BackwardSiteSpec(**fields)


def _frozen(value):
    """JSON lists back to tuples, all the way down (the spec is hashed: build_key)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


class _BuildKey(NamedTuple):
    mods: tuple
    description: str


def buffer_grad_items(source: BufferGradSource) -> tuple:
    """``source`` as plain values for a :class:`BackwardSiteSpec` (JSON): buffer, shape, the value
    mod's text and record (None, None when its value is dS), the offset mod's text and record,
    along_q, along_kv.

    Example::

        >>> _source_of(buffer_grad_items(source)) == source   # doctest: +SKIP
        True
    """
    value = source.value
    return (source.buffer, tuple(source.shape), None if value is None else str(value),
            None if value is None else value.info.to_items(), str(source.offset),
            source.offset.info.to_items(), source.along_q, source.along_kv)


def _source_of(item: tuple) -> BufferGradSource:
    """A :class:`BufferGradSource` back from :func:`buffer_grad_items` (after a JSON round trip)."""
    buffer, shape, value, value_info, offset, offset_info, along_q, along_kv = item
    value = None if value is None else GeneratedSource(value, ModInfo.from_items(value_info))
    return BufferGradSource(buffer, tuple(shape), value,
                            GeneratedSource(offset, ModInfo.from_items(offset_info)),
                            bool(along_q), bool(along_kv))


def last_backward_family() -> Optional[str]:
    """Which backward family computed the most recent ``flex_bwd.families`` call in this process
    ("generic_bwd", ..., or "dense" for the recompute), None before any. Process-wide: autograd runs
    a CUDA backward on its own thread.

    Example::

        >>> loss.backward(); last_backward_family()   # doctest: +SKIP
        'generic_bwd'
    """
    return _state.family


def backward_call_for(site: BackwardSiteSpec, call: BackwardCall, dialect: str) -> BackwardCall:
    """``call`` with ``site``'s mods in ``dialect`` (and its captured tensors' generated gradients):
    what a backward family of that dialect prepares.

    Example::

        >>> FAMILY.prepare_backward(backward_call_for(site, call, FAMILY.dialect))   # doctest: +SKIP
    """
    score, score_grad, mask = site.sources(dialect)
    return dataclasses.replace(
        call, score_source=score, score_grad_source=score_grad, mask_source=mask,
        score_info=ModInfo.from_items(site.score_info),
        score_grad_info=ModInfo.from_items(site.score_grad_info),
        mask_info=ModInfo.from_items(site.mask_info), deterministic=site.deterministic,
        buffer_grad_sources=site.buffer_grad_sources(dialect))


_LIB = torch.library.Library("fa3_inductor", "FRAGMENT")
_LIB.define(
    "flex_bwd.families(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? grad_out, "
    "Tensor? grad_lse, Tensor? kv_num_blocks, Tensor? kv_indices, Tensor? full_kv_num_blocks, "
    "Tensor? full_kv_indices, Tensor? q_num_blocks, Tensor? q_indices, Tensor? full_q_num_blocks, "
    "Tensor? full_q_indices, Tensor[] score_bufs, Tensor[] mask_bufs, float scale, "
    "int sparse_q_block, int sparse_kv_block, str spec) -> (Tensor, Tensor, Tensor, Tensor[])")


def flex_bwd_families(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Optional[Tensor],
    grad_lse: Optional[Tensor], kv_num_blocks: Optional[Tensor], kv_indices: Optional[Tensor],
    full_kv_num_blocks: Optional[Tensor], full_kv_indices: Optional[Tensor],
    q_num_blocks: Optional[Tensor], q_indices: Optional[Tensor],
    full_q_num_blocks: Optional[Tensor], full_q_indices: Optional[Tensor],
    score_bufs: list[Tensor], mask_bufs: list[Tensor], scale: float, sparse_q_block: int,
    sparse_kv_block: int, spec: str,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """``torch.ops.fa3_inductor.flex_bwd.families``: (dq, dk, dv, dbufs) of one flex attention site
    from the forward's ``out`` and ``lse`` (log2 units) and the incoming ``grad_out`` / ``grad_lse``
    (log2 units; None: no gradient). ``dbufs``: the gradients of the ``score_bufs`` whose
    ``buffer_grads`` entry in ``spec`` is true, in order (the dense op ``flex_bwd``'s convention).

    Example::

        >>> dq, dk, dv, dbufs = torch.ops.fa3_inductor.flex_bwd.families(q, k, v, out, lse, dout,
        ...     None, *(None,) * 8, [], [], 0.125, 128, 128, spec)   # doctest: +SKIP (spec: the lowering)
    """
    site = BackwardSiteSpec.from_json(spec)
    flags = _buffer_grad_flags(site, score_bufs)
    M, N = q.shape[2], k.shape[2]
    # torch's "no mask" uses blocks of 2**30: one block as long as the sequence is the same mask
    sparse_q_block = _one_block_size(sparse_q_block, M)
    sparse_kv_block = _one_block_size(sparse_kv_block, N)
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    dbufs = [torch.empty(t.shape, dtype=t.dtype, device=t.device)
             for t, needs in zip(score_bufs, flags) if needs]
    dout = grad_out if grad_out is not None else torch.zeros_like(out)
    tables = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    q_tables = (q_num_blocks, q_indices, full_q_num_blocks, full_q_indices)
    call = BackwardCall(q, k, v, out, dout, lse, grad_lse, dq, dk, dv, tables, q_tables,
                        tuple(score_bufs), tuple(mask_bufs), scale, sparse_q_block, sparse_kv_block,
                        dbufs=tuple(dbufs))
    passed_over = []
    for name in site.families:
        failed = family_failure(site.build_key(), name)
        if failed is not None:
            passed_over.append(failed)
            continue
        try:
            family = backward_family(name)
        except KeyError:   # a cache-served graph planned in a process that had this family
            passed_over.append(f"backward family {name} is not available in this process")
            continue
        mine = backward_call_for(site, call, family.dialect)
        try:
            launches = family.prepare_backward(mine)
            if launches is None:       # the family computes the call itself
                family.launch_backward(mine)
            else:
                for kernel, args, kwargs, grid in launches:
                    kernel[grid](*args, **kwargs)
        except NotServed as why:
            info_once(f"fa3_inductor: backward: {why}; the next backward family runs ({site.description})")
            passed_over.append(str(why))
            continue
        except Exception as exc:
            if not is_build_error(exc):
                raise
            passed_over.append(record_kernel_failure(site.build_key(), name, exc))
            continue
        if passed_over:
            warn_once(f"fa3_inductor: {name} runs the backward of {site.description or 'a site'}: "
                      f"{'; '.join(passed_over)}")
        _state.family = name
        return dq, dk, dv, dbufs
    warn_once(f"fa3_inductor: the dense recompute runs the backward of {site.description or 'a site'}: "
              f"{'; '.join(passed_over) or 'no backward family listed'}")
    _state.family = DENSE_BACKWARD
    score, _, mask = site.sources("torch")
    dense_spec = BackwardSpec(score, mask, flags, site.description).to_json()
    return flex_bwd(q, k, v, grad_out, grad_lse, *tables, score_bufs, mask_bufs, scale,
                    sparse_q_block, sparse_kv_block, dense_spec)


def _buffer_grad_flags(site: BackwardSiteSpec, score_bufs: list[Tensor]) -> tuple[bool, ...]:
    """Per score_mod tensor buffer, whether the op returns its gradient (``site.buffer_grads``;
    a spec without any lists none)."""
    if not site.buffer_grads:
        return (False,) * len(score_bufs)
    if len(site.buffer_grads) != len(score_bufs):
        raise RuntimeError(
            f"fa3_inductor::flex_bwd.families: spec lists {len(site.buffer_grads)} score_mod "
            f"buffers, the call passed {len(score_bufs)}; the spec and the call come from one "
            "lowering, so this is a bug: report it with the graph")
    return site.buffer_grads


_LIB.impl("flex_bwd.families", flex_bwd_families, "CUDA")
_LIB.impl("flex_bwd.families", flex_bwd_families, "CPU")


@torch.library.register_fake("fa3_inductor::flex_bwd.families", lib=_LIB)
def _flex_bwd_families_fake(q, k, v, out, lse, grad_out, grad_lse, kv_num_blocks, kv_indices,
                            full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices,
                            full_q_num_blocks, full_q_indices, score_bufs, mask_bufs, scale,
                            sparse_q_block, sparse_kv_block, spec):
    flags = _buffer_grad_flags(BackwardSiteSpec.from_json(spec), score_bufs)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            [t.new_empty(t.shape) for t, needs in zip(score_bufs, flags) if needs])
