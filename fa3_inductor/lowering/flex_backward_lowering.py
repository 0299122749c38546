"""Our lowering of the flex_attention_backward op (training through every fused attention).

Installed as a wrapper around Inductor's own lowering in ``lowerings[flex_attention_backward]``,
gated like the forward wrapper (flex_lowering.py): it acts while the fa3 backend compiles and on
ops traced from ``fa3_inductor.flex()`` under any Inductor compile; otherwise it calls the original
untouched. When it acts it plans the site against
the registry's backward families (templates/registry.py) and either

- generates the score_mod, the mask_mod, the score_mod's derivative (from the joint graph:
  templates/generic_bwd/score_grad.py) and the gradients of captured tensors that need one (a
  learnable bias table: templates/generic_bwd/buffer_grad.py) in each serving family's dialect,
  records the planned family, and emits one extern call to
  ``torch.ops.fa3_inductor.flex_bwd.families`` (runtime/ops_bwd.py), which runs the first family
  that serves the call and returns the captured tensors' gradients too; the sources travel in its
  spec string, so an FX-cache-served graph rebuilds them in a fresh process; or
- keeps the site on the last resort, recording why (a derivative or captured-tensor gradient the
  generator cannot write, a dtype or head dim no family takes, option fa3.template='torch'): on
  CUDA torch's flex backward Triton kernel (it reads our forward's out and log2 LSE; fewer
  pipeline stages where its config would overflow shared memory: torch_bwd_stages.py), elsewhere
  one extern call to ``torch.ops.fa3_inductor.flex_bwd``, a dense float recompute under autograd
  (runtime/backward_cpu.py; Inductor has no CPU flex backward).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from .. import _compat
from ..config import Settings, deterministic_gradients
from ..report import LoweredBackwardSite, record_backward_site as _record, site_tag
from ..runtime.backward_cpu import BackwardSpec
from ..runtime.kernel_failures import family_failure
from ..runtime.ops_bwd import BackwardSiteSpec, buffer_grad_items  # also defines flex_bwd.families
from ..templates.family import BackwardSiteFacts
from ..templates.generic_bwd.buffer_grad import buffer_grad_sources
from ..templates.generic_bwd.score_grad import score_grad_graph
from ..templates.modgen import (GeneratedSource, RuntimeStride, UnsupportedMod, generate_in_dialect,
                                is_constant_true_mask, is_identity_score)
from ..templates.modgen_torch import generate_torch_mod_source, torch_buffer_specs
from ..templates.registry import DENSE_BACKWARD, backward_candidates, backward_last_resort
from .common import active_pass, buffer_specs, lowering_settings, realize_buffers, site_shape, torch_kernel_options
from .site_plan import unserved
from .torch_bwd_stages import torch_backward_options

_BWD_OP = torch.ops.higher_order.flex_attention_backward
_original_lowering: Optional[Any] = None
_NO_MASK_BLOCK = 1 << 30   # torch's "no mask": one block of 2**30 covers any sequence


def install() -> None:
    """Wrap Inductor's flex_attention_backward lowering (idempotent).

    Example::

        >>> from fa3_inductor.lowering import flex_backward_lowering
        >>> flex_backward_lowering.install()
    """
    global _original_lowering
    replaced = _compat.wrap_lowering(_BWD_OP, _fa3_flex_backward_lowering)
    if replaced is not None:
        _original_lowering = replaced


def _buffer_dtypes(buffers) -> list[Optional[torch.dtype]]:
    from torch._inductor import ir

    return [b.get_dtype() if isinstance(b, ir.IRNode) else None for b in buffers]


def _torch_sources(a: _compat.FlexBackwardArgs, bm: _compat.FlexBlockMask
                   ) -> tuple[Optional[str], Optional[str]]:
    """(score_mod, mask_mod) as torch-dialect source; None for the identity / all-true mod."""
    score_gm = a.fw_graph.graph_module
    mask_gm = bm.mask_graph.graph_module
    score = None if is_identity_score(score_gm) else generate_torch_mod_source(
        score_gm, "score", torch_buffer_specs(_buffer_dtypes(a.score_mod_other_buffers)))
    mask = None if is_constant_true_mask(mask_gm) else generate_torch_mod_source(
        mask_gm, "mask", torch_buffer_specs(_buffer_dtypes(a.mask_mod_other_buffers)))
    return score, mask


def _lower_dense(a: _compat.FlexBackwardArgs, shape: str):
    """The dense recompute op ``fa3_inductor::flex_bwd`` for one site: (dq, dk, dv, captured grads). The
    CPU's backward (Inductor has none there); on CUDA, for sites neither torch's lowering nor ours take."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    bm = _compat.unpack_block_mask(a.block_mask)
    try:
        score_src, mask_src = _torch_sources(a, bm)
    except UnsupportedMod as exc:
        raise NotImplementedError(
            f"fa3_inductor: cannot run flex attention backward for {shape}: {exc}. Rewrite the mod with "
            "supported ops (see fa3_inductor/templates/modgen.py); on a CUDA device torch's flex backward "
            "kernel runs the mods it can take.") from exc
    buffers = list(a.score_mod_other_buffers)
    is_tensor = [isinstance(b, ir.IRNode) for b in buffers]
    needs = _compat.joint_graph_buffer_grads(a.joint_graph.graph_module, len(buffers))
    tensor_grads = tuple(n for n, t in zip(needs, is_tensor) if t)
    spec = BackwardSpec(score_source=score_src, mask_source=mask_src,
                        buffer_grads=tensor_grads, description=shape)

    def realized(x):
        return None if x is None else ir.ExternKernel.realize_input(x)

    score_bufs = [ir.ExternKernel.require_contiguous(b) for b, t in zip(buffers, is_tensor) if t]
    mask_bufs = [ir.ExternKernel.require_contiguous(b) for b in a.mask_mod_other_buffers
                 if isinstance(b, ir.IRNode)]
    sizevars = V.graph.sizevars
    call = _compat.fallback_kernel(torch.ops.fa3_inductor.flex_bwd.default)
    dq, dk, dv, dbufs = call(
        realized(a.query), realized(a.key), realized(a.value), realized(a.grad_out),
        realized(a.grad_logsumexp), bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks,
        bm.full_kv_indices, score_bufs, mask_bufs, float(a.scale),
        sizevars.guard_int(bm.sparse_q_block), sizevars.guard_int(bm.sparse_kv_block),
        spec.to_json())
    grads = iter(dbufs)
    captured = tuple(next(grads) if t and n else None for t, n in zip(is_tensor, needs))
    return dq, dk, dv, captured


def _site_facts(a: _compat.FlexBackwardArgs, bm: _compat.FlexBlockMask, settings: Settings,
                buffer_grads: bool, score_grad: bool) -> tuple[Optional[BackwardSiteFacts], Optional[str]]:
    """(the site's facts, None), or (None, why no backward family of ours can take it).
    ``buffer_grads``: a captured tensor needs a gradient; ``score_grad``: the score_mod's derivative
    is not 1 (or could not be written: the plan reports that)."""
    from torch._inductor.virtualized import V

    sizevars = V.graph.sizevars
    q, k, v = a.query, a.key, a.value
    if settings.template == "torch":
        return None, "option fa3.template='torch'"
    hq, hkv, d, dv = (sizevars.guard_int(x) for x in (
        q.get_size()[1], k.get_size()[1], q.get_size()[-1], v.get_size()[-1]))
    reason = unserved(q.get_device(), q.get_dtype(), d, dv)
    if reason is not None:
        return None, reason
    if hq % hkv:
        return None, f"{hq} query heads are not a multiple of {hkv} kv heads"
    bq, bkv = q.get_size()[0], k.get_size()[0]
    if not (sizevars.statically_known_equals(bq, bkv) or sizevars.statically_known_equals(bkv, 1)):
        return None, "key/value batch differs from the query's (and is not 1)"
    sparse = [sizevars.guard_int(x) for x in (bm.sparse_q_block, bm.sparse_kv_block)]
    if not all(s >= 16 and s & (s - 1) == 0 for s in sparse):
        return None, f"block-mask block size {sparse[0]}x{sparse[1]} (fa3 serves powers of two >= 16)"
    return BackwardSiteFacts(q.get_device(), q.get_dtype(), d, dv, buffer_grads=buffer_grads,
                             deterministic=deterministic_gradients(settings), score_grad=score_grad), None


def derivative_graph(score_gm: Any, joint_gm: Any, n_buffers: int
                     ) -> tuple[Optional[Any], Optional[UnsupportedMod]]:
    """The score_mod's derivative as a mod graph (score_grad.py): None for no score_mod or one that
    adds a term (f' = 1); or the UnsupportedMod the rewrite raised. ``n_buffers``: the score_mod's
    captured buffers, scalars included.

    Example::

        >>> grad_gm, error = derivative_graph(score_gm, joint_gm, 0)   # doctest: +SKIP
    """
    if is_identity_score(score_gm):
        return None, None
    try:
        return score_grad_graph(joint_gm, n_buffers), None
    except UnsupportedMod as exc:
        return None, exc


def _sources(score_gm: Any, mask_gm: Any, dialects: list[str], score_specs: list,
             mask_specs: list, grad_gm: Optional[Any]) -> tuple[tuple, dict]:
    """The spec's mods: (dialect, score_mod, derivative, mask_mod) per dialect (the families' and
    ``torch`` for the dense last resort), and the generator's records of each kind. ``grad_gm``:
    the derivative's graph (:func:`derivative_graph`). Raises UnsupportedMod when a mod or the
    derivative cannot be generated."""
    identity, all_true = is_identity_score(score_gm), is_constant_true_mask(mask_gm)
    mods, infos = [], {"score": (), "score_grad": (), "mask": ()}
    for dialect in dict.fromkeys([*dialects, "torch"]):
        score = None if identity else generate_in_dialect(score_gm, "score", score_specs, dialect)
        grad = None if grad_gm is None or dialect == "torch" else generate_in_dialect(
            grad_gm, "score", score_specs, dialect)
        mask = None if all_true else generate_in_dialect(mask_gm, "mask", mask_specs, dialect)
        for kind, source in (("score", score), ("score_grad", grad), ("mask", mask)):
            if isinstance(source, GeneratedSource) and not infos[kind]:
                infos[kind] = source.info.to_items()
        mods.append((dialect, score and str(score), grad and str(grad), mask and str(mask)))
    return tuple(mods), infos


def _wide_scores(graphs: BackwardGraphs) -> bool:
    """Whether the score_mod may return huge finite values (ModInfo.wide, read off its generated
    source; a mod the generator refuses is planned, and refused, as before)."""
    if graphs.score_gm is None or is_identity_score(graphs.score_gm):
        return False
    try:
        source = generate_in_dialect(graphs.score_gm, "score", graphs.score_specs, "tl")
    except UnsupportedMod:
        return False
    return isinstance(source, GeneratedSource) and source.info.wide


def _tensor_buffer_grads(a: _compat.FlexBackwardArgs) -> tuple[bool, ...]:
    """Per tensor the score_mod captures (scalars left out, as the ops' ``score_bufs``), whether
    the joint graph gives it a gradient."""
    from torch._inductor import ir

    buffers = list(a.score_mod_other_buffers)
    needs = _compat.joint_graph_buffer_grads(a.joint_graph.graph_module, len(buffers))
    return tuple(n for n, b in zip(needs, buffers) if isinstance(b, ir.IRNode))


def _buffer_grad_mods(joint_gm: Any, dialects: list[str], score_specs: list) -> tuple:
    """The spec's captured-tensor gradients: (dialect, items per buffer needing one) per family
    dialect (the dense recompute differentiates by autograd: no ``torch`` entry).
    Raises UnsupportedMod when one cannot be generated."""
    return tuple((dialect, tuple(buffer_grad_items(s) for s in
                                 buffer_grad_sources(joint_gm, score_specs, dialect)))
                 for dialect in dict.fromkeys(dialects))


def _score_gradless(joint_gm: Any) -> bool:
    """Whether the joint graph gives the score no gradient (a score_mod that replaces it by a bias):
    torch 2.11's backward lowering then fails (``joint_subgraph_buffer is None``); ours take dS·0."""
    return _compat.joint_graph_results(joint_gm)[0] is None


def _plan(a: _compat.FlexBackwardArgs, bm: _compat.FlexBlockMask, settings: Settings, shape: str,
          torch_refuses: bool = False) -> tuple[Optional[BackwardSiteSpec], str]:
    """(spec, note) when one of our backward families serves the site, else (None, reason).
    ``torch_refuses``: torch's lowering failed on the site, so a family of ours serves it whatever its
    speed (BackwardSiteFacts.torch_refuses)."""
    flags = _tensor_buffer_grads(a)
    score_gm, joint_gm = a.fw_graph.graph_module, a.joint_graph.graph_module
    torch_refuses = torch_refuses or _score_gradless(joint_gm)
    grad_gm, grad_error = derivative_graph(score_gm, joint_gm, len(a.score_mod_other_buffers))
    facts, reason = _site_facts(a, bm, settings, buffer_grads=any(flags),
                                score_grad=grad_gm is not None or grad_error is not None)
    if facts is None:
        return None, reason
    if torch_refuses:
        facts = dataclasses.replace(facts, torch_refuses=True)
    score_specs, mask_specs = buffer_specs(a.score_mod_other_buffers), buffer_specs(a.mask_mod_other_buffers)
    tensor_specs = [s for s in score_specs if s is not None]
    if any(isinstance(st, RuntimeStride) for spec in tensor_specs + [s for s in mask_specs if s]
           for st in spec.strides):
        # the backward's ops take one buffer per captured tensor, no run-time strides
        return None, "a captured buffer has two dynamic dimensions (the backward kernels need static strides)"
    if any(flag and spec.permuted for flag, spec in zip(flags, tensor_specs)):
        # its gradient would come back in the reordered layout (common.buffer_order)
        return None, "a captured tensor that needs a gradient has a dynamic-size inner dimension"
    return plan_backward_site(BackwardGraphs(score_gm, joint_gm, bm.mask_graph.graph_module,
                                             score_specs, mask_specs, flags, grad_gm, grad_error),
                              facts, settings.template, shape)


@dataclasses.dataclass(frozen=True)
class BackwardGraphs:
    """One backward site's mods as graphs, what the plan generates its sources from.

    ``score_gm`` / ``mask_gm``: the mods, ``(score,) b, h, q_idx, kv_idx, *buffers -> value``;
    ``joint_gm``: torch's joint graph of the score_mod (``create_fw_bw_graph``); ``score_specs`` /
    ``mask_specs``: the captured buffers as the generated mods see them (None for a scalar);
    ``flags``: per captured tensor of the score_mod, whether it needs a gradient; ``grad_gm`` /
    ``grad_error``: :func:`derivative_graph`'s answer for the score_mod.

    Example::

        >>> grad_gm, err = derivative_graph(score_gm, joint_gm, 0)                  # doctest: +SKIP
        >>> BackwardGraphs(score_gm, joint_gm, mask_gm, [], [], (), grad_gm, err)   # doctest: +SKIP
    """

    score_gm: Any
    joint_gm: Any
    mask_gm: Any
    score_specs: list
    mask_specs: list
    flags: tuple[bool, ...]
    grad_gm: Optional[Any]
    grad_error: Optional[UnsupportedMod]


def plan_backward_site(graphs: BackwardGraphs, facts: BackwardSiteFacts, template: str,
                       description: str) -> tuple[Optional[BackwardSiteSpec], str]:
    """(spec, note) when one of our backward families serves a site of these mods and facts, else
    (None, reason): what the lowering plans, from graphs rather than Inductor's IR, so a direct
    caller of ``flex_bwd.families`` (fa3_inductor/direct_bwd.py) plans exactly as it does.
    ``template``: the fa3.template setting ("auto" or a family to start from).

    Example::

        >>> spec, note = plan_backward_site(graphs, facts, "auto", "q[1, 2, 64, 16] ...")  # doctest: +SKIP
    """
    flags = graphs.flags
    if facts.device.type == "cuda" and _wide_scores(graphs):   # torch's kernel would overflow there
        facts = dataclasses.replace(facts, wide_scores=True)
    families, notes = backward_candidates(facts, f"{template}_bwd")
    if not families:
        return None, "; ".join(notes) or "no backward family serves this site"
    dialects = [f.dialect for f in families]
    try:
        if graphs.grad_error is not None:
            raise graphs.grad_error
        mods, infos = _sources(graphs.score_gm, graphs.mask_gm, dialects, graphs.score_specs,
                               graphs.mask_specs, graphs.grad_gm)
    except UnsupportedMod as exc:
        return None, f"mod not lowerable for the backward: {exc}"
    grad_mods = ()
    if facts.buffer_grads:
        try:
            grad_mods = _buffer_grad_mods(graphs.joint_gm, dialects, graphs.score_specs)
        except UnsupportedMod as exc:
            return None, f"captured-tensor gradient not lowerable for the backward: {exc}"
        if any(len(items) != sum(flags) for _, items in grad_mods):   # a generator bug: say so
            return None, (f"captured-tensor gradients: {sum(flags)} tensors need one, "
                          f"{[len(items) for _, items in grad_mods]} were generated (a bug in "
                          "generic_bwd/buffer_grad.py: report it with the score_mod)")
    spec = BackwardSiteSpec(families=tuple(f.name for f in families), mods=mods,
                            score_info=infos["score"], score_grad_info=infos["score_grad"],
                            mask_info=infos["mask"], deterministic=facts.deterministic,
                            description=description, buffer_grads=flags if any(flags) else (),
                            buffer_grad_mods=grad_mods)
    failed = [family_failure(spec.build_key(), f) for f in spec.families]
    if all(failed):   # every family failed to build for these mods earlier in this process
        return None, "; ".join(failed)
    if facts.deterministic:   # every family listed guarantees it or refused the site
        notes.append("deterministic gradients (fa3.deterministic_backward or torch.use_deterministic_algorithms)")
    if any(flags):
        notes.append(f"gradients of {sum(flags)} captured tensor(s)")
    # the op runs each call on the first of these that serves it
    return spec, "; ".join([*notes, f"backward families: {', '.join(spec.families)}"])


def _emit(a: _compat.FlexBackwardArgs, bm: _compat.FlexBlockMask, spec: BackwardSiteSpec):
    """One extern call to fa3_inductor::flex_bwd.families: (dq, dk, dv, a gradient or None per
    captured buffer of the score_mod)."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    def stride1(x):
        return ir.ExternKernel.require_stride1(ir.ExternKernel.realize_input(x))

    def realized(x):
        return None if x is None else ir.ExternKernel.realize_input(x)

    buffers = list(a.score_mod_other_buffers)
    score_bufs = realize_buffers(buffers)
    mask_bufs = realize_buffers(a.mask_mod_other_buffers)
    sizevars = V.graph.sizevars
    sparse_q, sparse_kv = (sizevars.guard_int(bm.sparse_q_block), sizevars.guard_int(bm.sparse_kv_block))
    tables = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
    # The transposed tables (q_num_blocks, q_indices, full_q_*) are entries 6-9 of the block-mask
    # tuple on torch 2.11 and 2.13 alike (_compat.FlexBlockMask); they may be None (derived then).
    q_tables = tuple(a.block_mask[6:10])
    no_mask = spec.mods[0][3] is None and sparse_q >= _NO_MASK_BLOCK and sparse_kv >= _NO_MASK_BLOCK
    if no_mask:   # as the forward: the dense path, and the tables' construction becomes dead code
        tables = q_tables = (None,) * 4
    call = _compat.fallback_kernel(torch.ops.fa3_inductor.flex_bwd.families)
    dq, dk, dv, dbufs = call(
        stride1(a.query), stride1(a.key), stride1(a.value), stride1(a.out),
        realized(a.logsumexp), None if a.grad_out is None else stride1(a.grad_out),
        realized(a.grad_logsumexp), *tables, *q_tables, score_bufs, mask_bufs, float(a.scale),
        sparse_q, sparse_kv, spec.to_json())
    # the op returns the gradients of the tensor buffers flagged in the spec, in order
    flags, grads = iter(spec.buffer_grads or (False,) * len(score_bufs)), iter(dbufs)
    captured = tuple(next(grads) if isinstance(b, ir.IRNode) and next(flags) else None
                     for b in buffers)
    return dq, dk, dv, captured


def _fa3_flex_backward_lowering(*args, **kwargs):
    try:
        a = _compat.unpack_flex_backward_args(args, kwargs)
    except RuntimeError:
        if active_pass() is None:   # not ours to read: torch's lowering as it was called
            return _original_lowering(*args, **kwargs)
        raise
    settings = lowering_settings(a.kernel_options)
    stripped = torch_kernel_options(a.kernel_options)
    if stripped is not a.kernel_options:
        # torch's templates make every kernel option a constexpr: hand them ours removed
        args, kwargs = tuple(a._replace(kernel_options=stripped)), {}
    if settings is None:
        return _original_lowering(*args, **kwargs)
    from torch._inductor.virtualized import V

    bm = _compat.unpack_block_mask(a.block_mask)
    shape = site_shape(a.query, a.key, a.value)
    tag = site_tag(getattr(V.graph, "current_node", None))
    deterministic = deterministic_gradients(settings)

    def ours(spec: BackwardSiteSpec, note: str):
        result = _emit(a, bm, spec)
        _record(LoweredBackwardSite("fa3_inductor.flex_bwd", shape, sum(spec.buffer_grads), note,
                                    family=spec.families[0], site_id=tag, deterministic=deterministic))
        return result

    def dense(note: str):
        dq, dk, dv, captured = _lower_dense(a, shape)
        _record(LoweredBackwardSite("fa3_inductor.flex_bwd", shape, sum(g is not None for g in captured), note,
                                    family="dense", site_id=tag, deterministic=deterministic))
        return dq, dk, dv, captured

    spec, why = _plan(a, bm, settings, shape)
    if spec is not None:
        return ours(spec, why)
    if backward_last_resort(a.query.get_device()) == DENSE_BACKWARD:
        return dense(f"{why} (the dense recompute runs it: Inductor has no CPU flex backward)")
    fitting = torch_backward_options(a, bm)   # fewer stages where its default overflows shared memory
    if fitting is not None:
        args, kwargs = tuple(a._replace(kernel_options=fitting)), {}
    try:
        result = _original_lowering(*args, **kwargs)
    except Exception as exc:   # torch's lowering cannot take the site (fuzzed mods: an int pow, a 0-d capture)
        said = (str(exc).strip().splitlines() or ["no message"])[0][:200]
        failure = f"torch's flex backward lowering failed ({type(exc).__name__}: {said})"
        spec, why_ours = _plan(a, bm, settings, shape, torch_refuses=True)
        if spec is not None:
            return ours(spec, f"{failure}; {why_ours}")
        return dense(f"{failure}; {why_ours} (the dense recompute runs it)")
    _record(LoweredBackwardSite("torch", shape, None, f"{why} (torch's flex backward kernel runs it, "
                                "reading our forward's out and log2 LSE)", family="torch",
                                site_id=tag, deterministic=deterministic))
    return result


_fa3_flex_backward_lowering._fa3_wrapper = True  # type: ignore[attr-defined]
