"""The op Inductor's output code calls for every backward site our backward families serve.

``torch.ops.fa3_inductor.flex_bwd.families`` is an overload of the backward op ``flex_bwd``
(runtime/backward_cpu.py, the dense recompute): one op name for "our backward", whichever
computes it. The backward lowering (lowering/flex_backward_lowering.py) emits one extern call to
it; it walks the site's backward families (BackwardSiteSpec.families, from the plan, in the
registry's order) and runs the call on the first that serves it (templates/family.py's
BackwardFamily). A family may refuse a call's tensors (NotServed) or fail to build its kernels
(recorded in kernel_failures.py); when none serves, the dense recompute computes the call, with the
reasons logged (:func:`run_backward_families` is the walk alone, for callers that must not fall
back to a recompute: ring attention's steps). Mods reach it as generated source inside the
``spec`` string (the score_mod, its derivative and the mask_mod per dialect, and the gradients
of captured tensors that need one: templates/generic_bwd/buffer_grad.py), so a graph served from
Inductor's cache rebuilds them. It returns (dq, dk, dv, [the gradient of each captured tensor that
needs one]), as the dense op does.

On CUDA the walk and the family's planning (mods loaded, tiles, TMA descriptors: ~100 us of Python)
happen once per launch signature: the op allocates the family's scratch itself
(``backward_scratch``), so every tensor the launches touch is one of its own, records each launch
(runtime/fast_launch.py) and keeps a :class:`_Plan`; a later call with the same signature allocates
the outputs and the scratch and re-launches the recorded kernels in order. A call whose launches
cannot be recorded (torch steps for captured-tensor gradients, a tensor made while planning, a family
that computes the call itself) is planned on every call, as without the cache.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .._log import warn_once
from ..templates.family import BackwardCall, BackwardFamily
from ..templates.generic_bwd.buffer_grad import BufferGradSource
from ..templates.modgen import GeneratedSource, ModInfo
from ..templates.registry import DENSE_BACKWARD, backward_family
from .backward_cpu import BackwardSpec, flex_bwd
from .fast_launch import aliasing, launch_cached, on_clear, recorded, relaunch, tensor_signature
from .family_walk import first_serving
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
    deterministic: bool = False   # fa3.deterministic_backward or torch.use_deterministic_algorithms
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

    Example (``spec`` from the lowering)::

        >>> dq, dk, dv, dbufs = torch.ops.fa3_inductor.flex_bwd.families(q, k, v, out, lse, dout,
        ...     None, *(None,) * 8, [], [], 0.125, 128, 128, spec)   # doctest: +SKIP
    """
    tables = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    q_tables = (q_num_blocks, q_indices, full_q_num_blocks, full_q_indices)
    served, passed_over = run_backward_families(q, k, v, out, lse, grad_out, grad_lse, tables,
                                                q_tables, score_bufs, mask_bufs, scale,
                                                sparse_q_block, sparse_kv_block, spec)
    if served is not None:
        return served
    site = BackwardSiteSpec.from_json(spec)
    warn_once(f"fa3_inductor: the dense recompute runs the backward of {site.description or 'a site'}: "
              f"{'; '.join(passed_over) or 'no backward family listed'}")
    _state.family = DENSE_BACKWARD
    score, _, mask = site.sources("torch")
    dense_spec = BackwardSpec(score, mask, _buffer_grad_flags(site, score_bufs),
                              site.description).to_json()
    return flex_bwd(q, k, v, grad_out, grad_lse, *tables, score_bufs, mask_bufs, scale,
                    _one_block_size(sparse_q_block, q.shape[2]),
                    _one_block_size(sparse_kv_block, k.shape[2]), dense_spec)


def run_backward_families(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Optional[Tensor],
    grad_lse: Optional[Tensor], tables: tuple, q_tables: tuple, score_bufs: list[Tensor],
    mask_bufs: list[Tensor], scale: float, sparse_q_block: int, sparse_kv_block: int, spec: str,
) -> tuple[Optional[tuple[Tensor, Tensor, Tensor, list[Tensor]]], list[str]]:
    """The op's call on the first of ``spec``'s backward families that serves it: ((dq, dk, dv,
    dbufs), []), or (None, why each family was passed over) when none does. ``out`` and ``lse``
    (log2 units) are used as given: every family computes P = exp2(S - lse) and dO·O from them.

    The op then runs the dense recompute, which recomputes the softmax from q and k instead: the
    same thing for a site's own (out, lse), but not for a caller that passes another normalisation
    (ring attention's global O and L for one K/V shard: fa3_inductor/distributed/), which must
    handle None itself. ``tables`` / ``q_tables``: the op's four block-mask tables and four
    transposed ones.

    Example::

        >>> grads, passed_over = run_backward_families(q, k, v, out, lse2, dout, None, (None,) * 4,
        ...     (None,) * 4, [], [], 0.125, 1 << 30, 1 << 30, spec)   # doctest: +SKIP
    """
    M, N = q.shape[2], k.shape[2]
    # torch's "no mask" uses blocks of 2**30: one block as long as the sequence is the same mask
    sparse_q_block = _one_block_size(sparse_q_block, M)
    sparse_kv_block = _one_block_size(sparse_kv_block, N)
    key = tensors = None
    if _caches(q):
        # The key reads the tensors the caller gives; the op's own (the gradients, a zero dO for a
        # grad_out of None) are fresh contiguous allocations whose signature follows from them.
        given = (q, k, v, out, grad_out, lse, grad_lse, *tables, *q_tables, *score_bufs, *mask_bufs)
        key = (spec, scale, sparse_q_block, sparse_kv_block, len(score_bufs), len(mask_bufs),
               torch.get_float32_matmul_precision(), tensor_signature(given), aliasing(given))
        plan = _PLANS.get(key)
        if plan is not None and plan.launches is not None:   # a hit: the spec was read when planned
            dq, dk, dv, dbufs, dout = _fresh(q, k, v, out, grad_out, score_bufs, plan.grad_bufs)
            plan.run((q, k, v, out, dout, lse, grad_lse, dq, dk, dv, *given[7:], *dbufs), q.device)
            _state.family = plan.family
            return (dq, dk, dv, dbufs), []
    site = BackwardSiteSpec.from_json(spec)
    grad_bufs = tuple(i for i, needs in enumerate(_buffer_grad_flags(site, score_bufs)) if needs)
    dq, dk, dv, dbufs, dout = _fresh(q, k, v, out, grad_out, score_bufs, grad_bufs)
    if key is not None:
        tensors = (q, k, v, out, dout, lse, grad_lse, dq, dk, dv, *tables, *q_tables, *score_bufs,
                   *mask_bufs, *dbufs)
    call = BackwardCall(q, k, v, out, dout, lse, grad_lse, dq, dk, dv, tuple(tables),
                        tuple(q_tables), tuple(score_bufs), tuple(mask_bufs), scale,
                        sparse_q_block, sparse_kv_block, dbufs=tuple(dbufs))
    name, passed_over = first_serving(
        site.families, site.build_key(), f"the backward of {site.description or 'a site'}",
        "backward family", _backward_family_here,
        lambda family: _serve_with(family, backward_call_for(site, call, family.dialect), key, tensors,
                                   grad_bufs))
    if name is None:
        return None, passed_over
    _state.family = name
    return (dq, dk, dv, dbufs), []


def _fresh(q: Tensor, k: Tensor, v: Tensor, out: Tensor, grad_out: Optional[Tensor], score_bufs: list[Tensor],
           grad_bufs: tuple) -> tuple:
    """The op's own tensors of a call: contiguous dq, dk, dv, the gradients of the captured buffers at
    ``grad_bufs`` (their indices), and dO (zeros for a grad_out of None)."""
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    dbufs = [torch.empty_like(score_bufs[i], memory_format=torch.contiguous_format) for i in grad_bufs]
    return dq, dk, dv, dbufs, grad_out if grad_out is not None else torch.zeros_like(out)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a call of one launch signature runs: the family, its scratch as (shape, strides, dtype)
    and its recorded launches in order (fast_launch entries; None: not recordable, plan every call).
    It holds no tensor of any call."""

    family: str
    scratch: tuple
    launches: Optional[tuple]
    grad_bufs: tuple = ()   # which score_bufs get a gradient (their indices): the op allocates those

    def run(self, tensors: tuple, device: torch.device) -> None:
        """Re-launch on the call's ``tensors`` (the op's, in the key's order) and fresh scratch."""
        scratch = tuple(torch.empty_strided(shape, strides, dtype=dtype, device=device)
                        for shape, strides, dtype in self.scratch)
        inputs = (*tensors, *scratch)
        for entry in self.launches:
            relaunch(entry, inputs)


_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 256
on_clear(_PLANS.clear)   # a plan holds fast_launch entries: it goes with them


def _backward_family_here(name: str) -> Optional[BackwardFamily]:
    """The backward family called ``name``, None when this process does not have it."""
    try:
        return backward_family(name)
    except KeyError:
        return None


def _caches(q: Tensor) -> bool:
    """Whether this call's launches go through the launch cache (CUDA only: the interpreter has no
    compiled kernel to re-launch)."""
    return q.is_cuda


def _serve_with(family: BackwardFamily, call: BackwardCall, key: Optional[tuple],
                tensors: Optional[tuple], grad_bufs: tuple = ()) -> None:
    """Compute ``call`` with ``family``. With a ``key`` (CUDA): the op allocates the family's scratch
    and, the first time, records the launches under ``key`` and keeps the plan (a plan kept already
    is one that could not be recorded: launch plainly, no new attempt). ``grad_bufs``: the indices of
    the score_bufs that get a gradient (the plan's, for the op's allocations on a hit)."""
    record = key is not None and key not in _PLANS
    hook = getattr(family, "backward_scratch", None)   # optional (templates/family.py)
    if key is not None and hook is not None:
        call = dataclasses.replace(call, scratch=tuple(hook(call)))
    launches = family.prepare_backward(call)
    entries = None
    if launches is None:       # the family computes the call itself
        family.launch_backward(call)
    elif record:
        entries = _record_launches(family.name, launches, key, tensors, call.scratch or ())
    else:
        for kernel, args, kwargs, grid in launches:
            kernel[grid](*args, **kwargs)
    if record:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        scratch = tuple((tuple(t.shape), t.stride(), t.dtype) for t in call.scratch or ())
        _PLANS[key] = _Plan(family.name, scratch, entries, grad_bufs)


def _record_launches(name: str, launches: list, key: tuple, tensors: tuple, scratch: tuple
                     ) -> Optional[tuple]:
    """Run ``launches`` through the launch cache on the op's ``tensors`` and the family's ``scratch``;
    their recorded entries, or None if any could not be recorded (a torch step, a tensor that is
    neither the op's nor the scratch)."""
    inputs = (*tensors, *scratch)
    scratch_signature = tensor_signature(scratch)
    entries = []
    for i, launch in enumerate(launches):
        launch_key = (key, name, scratch_signature, i)
        launch_cached(launch_key, inputs, lambda launch=launch: (*launch, name))
        # read at once: a full launch cache is cleared when the next launch is recorded
        entries.append(recorded(launch_key))
    return None if any(e is None for e in entries) else tuple(entries)


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
