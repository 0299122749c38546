"""The op Inductor's output code calls for every attention site we serve.

``torch.ops.fa3_inductor.flex_fwd`` is an opaque custom op: Inductor emits one extern call to
it, and it launches our kernel. One mechanism serves every kernel family (Gluon kernels do
not survive Inductor's ``wrap_triton`` re-emission: docs/facts.md). Mods reach it as generated
source inside the ``spec`` string, so a graph served from Inductor's cache rebuilds them.

The op walks the site's candidate families (SiteSpec.families, from the plan) and runs the call on
the first that serves it (templates/family.py): a family may refuse a call's layout (NotServed), or
fail to build its kernel (recorded in kernel_failures.py); torch's dense kernel, last, always serves.
On CUDA the choice is made once per launch signature: later calls re-launch it (fast_launch.py),
or, for a family that computes a call itself (``prepare`` gives None: the decode family's launch
with per-call scratch), through the re-launcher it gives (``relauncher(call)``, kept in
``_RELAUNCH`` by the same key).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Optional

import torch
from torch import Tensor

from ..templates.family import Call
from ..templates.modgen import ModInfo
from ..templates.registry import family as family_named
from . import backward_cpu  # noqa: F401  (defines fa3_inductor::flex_bwd beside flex_fwd)
from .fast_launch import aliasing, launch_cached, on_clear, recorded, relaunch, tensor_signature
from .family_walk import first_serving
from .sinks import check_sinks
from .spec import SiteSpec
from .variants import start_variants

_state = threading.local()

# launch key -> (re-launch(inputs), family name): families that launch a call themselves
_RELAUNCH: dict[tuple, tuple[Callable[[tuple], None], str]] = {}
_MAX_RELAUNCH = 256
on_clear(_RELAUNCH.clear)


def _relaunched(key: tuple, inputs: tuple) -> Optional[str]:
    """Re-launch a self-launching family's call recorded under ``key``; its name, or None."""
    hit = _RELAUNCH.get(key)
    if hit is None:
        return None
    hit[0](inputs)
    return hit[1]


def last_template() -> Optional[str]:
    """Which kernel family served the most recent attention call in this thread.

    "hopper" or "generic" when our kernels ran, "torch" when the call went to torch's own
    implementation (its FlexAttention, or our dense last resort), None before any call.

    Example::

        >>> fa3_inductor.flex(q, k, v); fa3_inductor.last_template()   # doctest: +SKIP
        'generic'
    """
    return getattr(_state, "template", None)


def record_template(name: Optional[str]) -> None:
    _state.template = name


def _out_like(q: Tensor, v: Tensor) -> Tensor:
    """The output (Z, HQ, M, DV) in q's stride order (e.g. a (B, S, H, D) storage stays so): no
    copy afterwards. DV is v's head dim, which may differ from q's (DeepSeek's MLA). The head dim
    is always innermost and every stride 16-byte aligned (the kernels write it through tensor
    descriptors): a q whose own layout is not so (MViTv2's q after its pooling convolution has
    strides (H·M·D, 1, H·D, H), heads innermost) gets its stride order with the head dim moved
    innermost, as torch's flex_attention fake allocates its output."""
    dv = v.shape[-1]
    if dv == q.shape[-1]:
        out = torch.empty_like(q)
        if _descriptor_ready(out):
            return out
    # torch's flex_attention fake does the same: fill dims innermost first in q's stride order
    # (equal strides: the inner dim first), the head dim innermost whatever q's stride says.
    shape = (*q.shape[:3], dv)
    fill = sorted(range(4), key=lambda d: (q.stride(d), -d))
    fill.remove(3)
    strides, step = [0] * 4, 1
    for d in [3, *fill]:
        strides[d] = step
        step *= shape[d]
    return q.new_empty_strided(shape, strides)


def _out_is_empty_like_q(q: Tensor, v: Tensor, out: Tensor) -> bool:
    """Whether :func:`_out_like` gave ``out`` torch.empty_like(q)'s layout (the head dims agree and q's layout is
    descriptor-ready). Fixed by q's and v's signature, which every replay keys on: a replay then allocates with
    torch.empty_like(q) and skips _out_like's checks."""
    return v.shape[3] == q.shape[3] and out.stride() == torch.empty_like(q).stride()


def _descriptor_ready(t: Tensor) -> bool:
    """Unit last stride and 16-byte aligned outer strides (templates/tma.py's rule, without the
    address: a fresh allocation's is aligned)."""
    stride, size = t.stride(), t.element_size()
    return stride[-1] == 1 and all((s * size) % 16 == 0 for s in stride[:-1])


def _one_block_size(block: int, length: int) -> int:
    """A block-mask block at least as long as the sequence is the only block (index 0): shrink
    it to the sequence (torch's default mask uses 2**30) so kernels do not walk empty tiles."""
    if block < length:
        return block
    return max(128, 1 << (length - 1).bit_length())


# A plain Library definition rather than torch.library.custom_op: the op sits on the hot path of
# every attention call, and custom_op's per-call wrappers (autograd shim, aliasing checks) cost
# more than its convenience is worth here. No autograd: backward is torch's flex backward.
_LIB = torch.library.Library("fa3_inductor", "DEF")
_LIB.define(
    "flex_fwd(Tensor q, Tensor k, Tensor v, Tensor? kv_num_blocks, Tensor? kv_indices, "
    "Tensor? full_kv_num_blocks, Tensor? full_kv_indices, Tensor[] score_bufs, "
    "Tensor[] mask_bufs, float scale, int sparse_q_block, int sparse_kv_block, str spec, "
    "Tensor? sinks=None) -> (Tensor, Tensor, Tensor)")


def flex_fwd(
    q: Tensor, k: Tensor, v: Tensor,
    kv_num_blocks: Optional[Tensor], kv_indices: Optional[Tensor],
    full_kv_num_blocks: Optional[Tensor], full_kv_indices: Optional[Tensor],
    score_bufs: list[Tensor], mask_bufs: list[Tensor],
    scale: float, sparse_q_block: int, sparse_kv_block: int, spec: str,
    sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.ops.fa3_inductor.flex_fwd``: attention forward with generated mods; returns
    (out, lse_log2, max_log2). ``sinks``: [HQ] per-head logits (natural-log units) that join each
    row's softmax denominator (gpt-oss's attention sinks): out and lse then include them, max does
    not (docs/design/sinks.md); the site must have been planned with sinks (``SiteFacts.sinks``).

    Example (``spec`` from lowering/site_plan.plan_site)::

        >>> out, lse, mx = torch.ops.fa3_inductor.flex_fwd(q, k, v, None, None, None, None,
        ...     [], [], 0.125, 128, 128, spec)   # doctest: +SKIP
    """
    Z, H, M, _ = q.shape
    sparse_q_block = _one_block_size(sparse_q_block, M)
    sparse_kv_block = _one_block_size(sparse_kv_block, k.shape[2])
    tables = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    if sinks is not None:
        check_sinks(sinks, H, "fa3_inductor.flex_fwd", q.device)
        sinks = sinks.to(torch.float32).contiguous()   # the kernels read float32 (itself if it is)
    key = inputs = None
    if q.is_cuda:
        # Everything but the tensors' addresses is fixed by this key, so after the first call the
        # chosen family's kernel is re-launched without walking the families again. A hit skips
        # the spec (parsed once per site anyway) and _out_like's layout check (_HITS).
        given = (q, k, v, *tables, *score_bufs, *mask_bufs, *(() if sinks is None else (sinks,)))
        key = _launch_key(spec, scale, sparse_q_block, sparse_kv_block, len(score_bufs), given)
        hit = _HITS.get(key)
        if hit is not None:
            entry, plain = hit
            out = torch.empty_like(q) if plain else _out_like(q, v)
            device, rows, row_strides = q.device, (Z, H, M), (H * M, M, 1)   # new_empty's, cheaper
            lse = torch.empty_strided(rows, row_strides, dtype=torch.float32, device=device)
            max_scores = torch.empty_strided(rows, row_strides, dtype=torch.float32, device=device)
            _state.template = relaunch(entry, (q, k, v, out, lse, max_scores, *given[3:]))
            return out, lse, max_scores
    out = _out_like(q, v)
    lse = q.new_empty((Z, H, M), dtype=torch.float32)
    max_scores = q.new_empty((Z, H, M), dtype=torch.float32)
    site = SiteSpec.from_json(spec)
    if key is not None:
        inputs = (q, k, v, out, lse, max_scores, *given[3:])
        entry = recorded(key)
        if entry is not None:
            _remember_hit(key, entry, q, v, out)
            record_template(relaunch(entry, inputs))
            return out, lse, max_scores
        name = _relaunched(key, inputs)
        if name is not None:
            record_template(name)
            return out, lse, max_scores
    call = Call(q, k, v, out, lse, max_scores, tables, tuple(score_bufs), tuple(mask_bufs), scale,
                sparse_q_block, sparse_kv_block, site.needs_max, sinks=sinks)
    record_template(_serve(site, call, key, inputs))
    if key is not None:
        entry = recorded(key)
        if entry is not None:
            _remember_hit(key, entry, q, v, out)
    return out, lse, max_scores


# flex_fwd's launch key -> (its fast_launch entry, whether the output is torch.empty_like(q)): what a
# repeated call needs to allocate its outputs and re-launch, found with one lookup. Cleared with the
# launch cache (its entries are the cache's).
_HITS: dict[tuple, tuple] = {}
on_clear(_HITS.clear)


def _remember_hit(key: tuple, entry, q: Tensor, v: Tensor, out: Tensor) -> None:
    if len(_HITS) >= _MAX_RELAUNCH:
        _HITS.clear()
    _HITS[key] = (entry, _out_is_empty_like_q(q, v, out))



def call_for(site: SiteSpec, call: Call, dialect: str) -> Call:
    """``call`` with ``site``'s mods in ``dialect`` (the generated source and its records): what a
    family of that dialect prepares.

    Example::

        >>> FAMILY.prepare(call_for(site, call, FAMILY.dialect))   # doctest: +SKIP
    """
    score_source, mask_source = site.sources(dialect)
    return dataclasses.replace(call, score_source=score_source, mask_source=mask_source,
                               score_info=ModInfo.from_items(site.score_info),
                               mask_info=ModInfo.from_items(site.mask_info))


def _serve(site: SiteSpec, call: Call, key: Optional[tuple], inputs: Optional[tuple]) -> str:
    """Run ``call`` on the first of the site's families that serves it; returns that family's name."""
    def run(family) -> None:
        mine = call_for(site, call, family.dialect)
        variants = family.prepare(mine)
        if variants is None:       # the family computes the call itself
            family.launch(mine)
            bind = getattr(family, "relauncher", None)
            again = bind(mine) if key is not None and bind is not None else None
            if again is not None:
                if len(_RELAUNCH) >= _MAX_RELAUNCH:
                    _RELAUNCH.clear()
                _RELAUNCH[key] = (again, family.name)
        elif key is None:          # no launch cache off CUDA
            kernel, args, kwargs, grid = start_variants(variants, call.q.device)
            kernel[grid](*args, **kwargs)
        else:
            launch_cached(key, inputs, lambda: (*start_variants(variants, call.q.device), family.name))

    name, passed_over = first_serving(site.families, site, site.description, "kernel family",
                                      family_named, run)
    if name is not None:
        return name
    raise RuntimeError(f"fa3_inductor: no kernel family served {site.description or 'a site'} "
                       f"({'; '.join(passed_over)}); the last family must serve every site: "
                       "check templates/registry.py")


def serve(site: SiteSpec, call: Call, spec: str) -> str:
    """Compute ``call`` with the first of ``site``'s families that serves it; returns that family's
    name. The FP8 paths use it (their operands come fresh from the prologue, and their families
    differ from the op's); on CUDA, as in ``flex_fwd``, the family's launch is chosen and prepared once
    per launch signature and re-launched after that (fast_launch.py). ``spec``: ``site`` as JSON (the
    plan's own text: it keys the launch).

    Example::

        >>> serve(SiteSpec.from_json(spec), call, spec)   # doctest: +SKIP
        'fp8'
    """
    if not call.q.is_cuda:
        return _serve(site, call, None, None)
    key, inputs = serve_key(spec, call)
    entry = recorded(key)
    if entry is not None:
        return relaunch(entry, inputs)
    return _relaunched(key, inputs) or _serve(site, call, key, inputs)


def serve_inputs(call: Call) -> tuple:
    """The tensors :func:`serve` launches ``call`` on, in the order its launch key reads them: q, k,
    v, out, lse, max_scores, the four block-mask tables, the captured buffers, and for an FP8 call
    the prologue's four scale tensors.

    Example (an FP8 call without mask or buffers)::

        >>> len(serve_inputs(call))   # doctest: +SKIP
        14
    """
    fp8 = call.fp8
    return (call.q, call.k, call.v, call.out, call.lse, call.max_scores, *call.tables,
            *call.score_bufs, *call.mask_bufs,
            *(() if fp8 is None else (fp8.q_scale, fp8.k_scale, fp8.v_scale, fp8.v_scale_max)))


def serve_key(spec: str, call: Call) -> tuple[tuple, tuple]:
    """(the launch key :func:`serve` keeps ``call``'s launch under on CUDA, :func:`serve_inputs`).

    Example::

        >>> key, inputs = serve_key(spec, call)   # doctest: +SKIP
    """
    inputs = serve_inputs(call)
    # flex_fwd's key, plus what a Call may vary beyond it: the recipe (the kernel's quantization
    # constexprs) and whether the row max is wanted
    key = (_launch_key(spec, call.scale, call.sparse_q_block, call.sparse_kv_block,
                       len(call.score_bufs), inputs),
           None if call.fp8 is None else call.fp8.recipe, call.needs_max)
    return key, inputs


def replayer(key: tuple) -> Optional[tuple[Callable[[tuple], object], object]]:
    """(fire(inputs), tag) re-launching what was launched under ``key`` (a recorded launch, or a
    self-launching family's re-launcher) on new inputs of the key's signature; None if neither was
    kept (nothing served yet, or a launch that cannot be recorded).

    Example::

        >>> fire, tag = replayer(serve_key(spec, call)[0]); fire(serve_inputs(call2))   # doctest: +SKIP
    """
    entry = recorded(key)
    if entry is not None:
        return (lambda inputs: relaunch(entry, inputs)), entry.tag
    return _RELAUNCH.get(key)


def _launch_key(spec: str, scale: float, sparse_q_block: int, sparse_kv_block: int, n_score_bufs: int,
                inputs: tuple) -> tuple:
    """Everything a CUDA launch depends on but the tensors' addresses (runtime/fast_launch.py), a
    tensor given at two places (``flex(q, q, q)``) included. flex_fwd and bound_launch key over the tensors the
    caller gives (not the op's fresh outputs, whose layout follows from q's and v's: ~1.5 µs a call less), serve
    over every tensor it launches on."""
    return (spec, scale, sparse_q_block, sparse_kv_block, n_score_bufs,
            torch.get_float32_matmul_precision(), tensor_signature(inputs), aliasing(inputs))


def bound_launch(q: Tensor, k: Tensor, v: Tensor, tables: tuple, score_bufs: list, mask_bufs: list,
                 scale: float, sparse_q_block: int, sparse_kv_block: int, spec: str
                 ) -> Optional[Callable[[Tensor, Tensor, Tensor, bool], tuple[Tensor, Optional[Tensor]]]]:
    """After ``flex_fwd`` served these arguments on CUDA: a function that launches the same kernel
    for new ``q, k, v`` of the same shapes, strides, dtypes and alignment, with everything else
    fixed, returning ``(out, lse_log2 or None)``; None if the launch cannot be re-played so.

    It skips the op's dispatch, key and allocations: the row max (never read by flex()'s direct path)
    and, unless asked for, the LSE go to scratch buffers kept by the function. flex()'s direct path
    calls it once it knows that nothing else changed (direct.py).

    Example::

        >>> launch = bound_launch(q, k, v, (None,) * 4, [], [], 0.125, 1 << 30, 1 << 30, spec)  # doctest: +SKIP
        >>> out, _ = launch(q2, k2, v2, False)                                                    # doctest: +SKIP
    """
    Z, H, M, _ = q.shape
    sparse_q_block = _one_block_size(sparse_q_block, M)
    sparse_kv_block = _one_block_size(sparse_kv_block, k.shape[2])
    lse = q.new_empty((Z, H, M), dtype=torch.float32)
    row_max = torch.empty_like(lse)
    probe_out = _out_like(q, v)
    key = _launch_key(spec, scale, sparse_q_block, sparse_kv_block, len(score_bufs),
                  (q, k, v, *tables, *score_bufs, *mask_bufs))
    found = replayer(key)   # a recorded launch, or a family that launches itself (the decode family)
    if found is None:
        return None
    fire, tag = found
    rest = (*tables, *score_bufs, *mask_bufs)
    plain = _out_is_empty_like_q(q, v, probe_out)

    def launch(q: Tensor, k: Tensor, v: Tensor, want_lse: bool) -> tuple[Tensor, Optional[Tensor]]:
        out = torch.empty_like(q) if plain else _out_like(q, v)
        lse_out = torch.empty_like(lse) if want_lse else lse
        fire((q, k, v, out, lse_out, row_max, *rest))
        _state.template = tag
        return out, lse_out if want_lse else None

    # what the launch holds, for benchmarks and tests (read through direct.memo_launch, not closures)
    launch.bound = BoundLaunch(recorded(key), rest, tag)
    return launch


@dataclasses.dataclass(frozen=True)
class BoundLaunch:
    """What a launch made by :func:`bound_launch` re-plays, as its ``.bound`` attribute: ``entry``, the
    runtime/fast_launch.py entry it relaunches (None for a family that launches a call itself: the decode
    family), ``rest``, the tensors it passes after ``(q, k, v, out, lse, row_max)`` (the block-mask
    tables, the captured buffers), and ``tag``, the family's name.

    Example::

        >>> b = bound_launch(q, k, v, (None,) * 4, [], [], 0.125, 1 << 30, 1 << 30, spec).bound  # doctest: +SKIP
        >>> relaunch(b.entry, (q, k, v, out, lse, row_max, *b.rest))                             # doctest: +SKIP
        'hopper'
    """

    entry: object
    rest: tuple
    tag: object


_LIB.impl("flex_fwd", flex_fwd, "CUDA")
_LIB.impl("flex_fwd", flex_fwd, "CPU")


@torch.library.register_fake("fa3_inductor::flex_fwd", lib=_LIB)
def _flex_fwd_fake(q, k, v, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                   score_bufs, mask_bufs, scale, sparse_q_block, sparse_kv_block, spec, sinks=None):
    Z, H, M, _ = q.shape
    return (_out_like(q, v), q.new_empty((Z, H, M), dtype=torch.float32),
            q.new_empty((Z, H, M), dtype=torch.float32))
