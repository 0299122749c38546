"""The op Inductor's output code calls for every attention site we serve.

``torch.ops.fa3_inductor.flex_fwd`` is an opaque custom op: Inductor emits one extern call to
it, and it launches our kernel. One mechanism serves both template families (Gluon kernels do
not survive Inductor's ``wrap_triton`` re-emission: docs/facts.md). Mods reach it as generated
source inside the ``spec`` string, so a graph served from Inductor's cache rebuilds them.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import torch
from torch import Tensor

from .._log import info_once, warn_once
from ..templates.modgen import load_mod
from . import backward_cpu  # noqa: F401  (defines fa3_inductor::flex_bwd beside flex_fwd)
from .fast_launch import launch_cached, launcher, recorded, tensor_signature
from .generic import launch_generic
from .kernel_failures import is_build_error, kernel_failure, record_kernel_failure, torch_forward
from .spec import SiteSpec
from .variants import prepare_launch

_state = threading.local()
# Input dtypes the CPU interpreter cannot compute a dot in (computed in float32 instead).
_INTERPRETER_UPCAST = (torch.bfloat16,)


def last_template() -> Optional[str]:
    """Which template served the most recent attention call in this thread.

    "hopper" or "generic" when our kernels ran, "torch" when the call went to torch's own
    implementation, None before any call.

    Example::

        >>> fa3_inductor.flex(q, k, v); fa3_inductor.last_template()   # doctest: +SKIP
        'generic'
    """
    return getattr(_state, "template", None)


def record_template(name: Optional[str]) -> None:
    _state.template = name


def _hopper_serves(q: Tensor, k: Tensor, v: Tensor, out: Tensor, blocks: dict) -> bool:
    """Whether the Hopper kernel can serve these tensors (the reason is logged once if not)."""
    try:
        from ..templates.hopper import supports_sm90
    except ImportError as exc:  # the Hopper family is optional at run time
        warn_once(f"fa3_inductor: Hopper template unavailable ({exc}); using the generic one")
        return False
    if not supports_sm90(q, k, v, out, kv_num_blocks=blocks["kv_num_blocks"],
                         sparse_q_block=blocks["sparse_q_block"],
                         sparse_kv_block=blocks["sparse_kv_block"]):
        info_once(f"fa3_inductor: Hopper template cannot serve q{tuple(q.shape)} "
                  f"k{tuple(k.shape)} strides {q.stride()} with block-mask blocks "
                  f"{blocks['sparse_q_block']}x{blocks['sparse_kv_block']}; generic template runs")
        return False
    return True


def _out_like(q: Tensor, v: Tensor) -> Tensor:
    """The output (Z, HQ, M, DV) in q's stride order (e.g. a (B, S, H, D) storage stays so): no
    copy afterwards. DV is v's head dim, which may differ from q's (DeepSeek's MLA)."""
    dv = v.shape[-1]
    if dv == q.shape[-1]:
        return torch.empty_like(q)
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
    "Tensor[] mask_bufs, float scale, int sparse_q_block, int sparse_kv_block, str spec) "
    "-> (Tensor, Tensor, Tensor)")


def flex_fwd(
    q: Tensor, k: Tensor, v: Tensor,
    kv_num_blocks: Optional[Tensor], kv_indices: Optional[Tensor],
    full_kv_num_blocks: Optional[Tensor], full_kv_indices: Optional[Tensor],
    score_bufs: list[Tensor], mask_bufs: list[Tensor],
    scale: float, sparse_q_block: int, sparse_kv_block: int, spec: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.ops.fa3_inductor.flex_fwd``: attention forward with generated mods; returns
    (out, lse_log2, max_log2).

    Example::

        >>> out, lse, mx = torch.ops.fa3_inductor.flex_fwd(q, k, v, None, None, None, None,
        ...     [], [], 0.125, 128, 128, SiteSpec("generic").to_json())   # doctest: +SKIP
    """
    Z, H, M, _ = q.shape
    out = _out_like(q, v)
    lse = q.new_empty((Z, H, M), dtype=torch.float32)
    max_scores = q.new_empty((Z, H, M), dtype=torch.float32)
    sparse_q_block = _one_block_size(sparse_q_block, M)
    sparse_kv_block = _one_block_size(sparse_kv_block, k.shape[2])

    def blocks() -> dict:  # only when planning a launch: not on the re-launch path
        return dict(kv_num_blocks=kv_num_blocks, kv_indices=kv_indices,
                    full_kv_num_blocks=full_kv_num_blocks, full_kv_indices=full_kv_indices,
                    sparse_q_block=sparse_q_block, sparse_kv_block=sparse_kv_block)

    site = SiteSpec.from_json(spec)
    tables = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)

    def torch_kernel() -> tuple[Tensor, Tensor, Tensor]:
        """Our kernel could not be built for these mods: torch ops compute the call densely."""
        out_t, lse_t, max_t = torch_forward(q, k, v, tables, score_bufs, mask_bufs, scale,
                                            sparse_q_block, sparse_kv_block, site)
        record_template("torch")
        return out.copy_(out_t), lse.copy_(lse_t), max_scores.copy_(max_t)

    if kernel_failure(site) is not None:
        return torch_kernel()
    if not q.is_cuda:
        _check_interpreter()
        try:
            _launch_interpreted(q, k, v, out, lse, max_scores, scale, site, score_bufs, mask_bufs,
                                blocks())
        except Exception as exc:
            if not is_build_error(exc):
                raise
            record_kernel_failure(site, "generic", exc)
            return torch_kernel()
        record_template("generic")
        return out, lse, max_scores
    # CUDA: everything but the tensors' addresses is fixed by this key, so after the first
    # call the compiled kernel is re-launched without re-planning (runtime/fast_launch.py).
    inputs = (q, k, v, out, lse, max_scores, *tables, *score_bufs, *mask_bufs)
    key = _launch_key(spec, scale, sparse_q_block, sparse_kv_block, len(score_bufs), inputs)

    chosen = [site.template]

    def prepare():
        template = chosen[0] = _choose_template(site, q, k, v, out, blocks())
        dialect = "gl" if template == "hopper" else "tl"
        score_src = site.score_mod_gl if template == "hopper" else site.score_mod_tl
        mask_src = site.mask_mod_gl if template == "hopper" else site.mask_mod_tl
        mods = dict(sm_scale=scale, score_mod=score_src and load_mod(score_src, dialect),
                    mask_mod=mask_src and load_mod(mask_src, dialect),
                    score_bufs=tuple(score_bufs), mask_bufs=tuple(mask_bufs), **blocks())
        # The launch, with its other length variants compiled ahead (runtime/variants.py).
        return (*prepare_launch(template, q, k, v, out, lse, max_scores,
                                max_needed=site.needs_max, **mods), template)

    try:
        record_template(launch_cached(key, inputs, prepare))
    except Exception as exc:
        if not is_build_error(exc):
            raise
        record_kernel_failure(site, chosen[0], exc)
        return torch_kernel()
    return out, lse, max_scores


def _launch_interpreted(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, max_scores: Tensor,
                        scale: float, site: SiteSpec, score_bufs: list, mask_bufs: list,
                        blocks: dict) -> None:
    """The generic kernel under Triton's interpreter (CPU tensors)."""
    out32 = out
    if q.dtype in _INTERPRETER_UPCAST:
        # Triton 3.6's interpreter computes tl.dot on bfloat16 wrongly (relative error ~1e9,
        # fp16/fp32 right): run the kernel on float32 copies, hand back the caller's dtype.
        q, k, v = q.float(), k.float(), v.float()
        out32 = _out_like(q, v)
    launch_generic(q, k, v, out32, lse, max_scores, sm_scale=scale,
                   score_mod=site.score_mod_tl and load_mod(site.score_mod_tl, "tl"),
                   mask_mod=site.mask_mod_tl and load_mod(site.mask_mod_tl, "tl"),
                   score_bufs=score_bufs, mask_bufs=mask_bufs, **blocks)
    if out32 is not out:
        out.copy_(out32)


def _launch_key(spec: str, scale: float, sparse_q_block: int, sparse_kv_block: int, n_score_bufs: int,
                inputs: tuple) -> tuple:
    """Everything a CUDA launch depends on but the tensors' addresses (runtime/fast_launch.py)."""
    return (spec, scale, sparse_q_block, sparse_kv_block, n_score_bufs,
            torch.get_float32_matmul_precision(), tensor_signature(inputs))


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
    probe = (q, k, v, _out_like(q, v), lse, row_max, *tables, *score_bufs, *mask_bufs)
    entry = recorded(_launch_key(spec, scale, sparse_q_block, sparse_kv_block, len(score_bufs), probe))
    if entry is None:
        return None
    rest = (*tables, *score_bufs, *mask_bufs)
    tag, go = entry.tag, launcher(entry)
    out_shape, out_strides = probe[3].shape, probe[3].stride()
    dtype, device = q.dtype, q.device

    def launch(q: Tensor, k: Tensor, v: Tensor, want_lse: bool) -> tuple[Tensor, Optional[Tensor]]:
        out = torch.empty_strided(out_shape, out_strides, dtype=dtype, device=device)
        lse_out = torch.empty_like(lse) if want_lse else lse
        go((q, k, v, out, lse_out, row_max, *rest))
        _state.template = tag
        return out, lse_out if want_lse else None

    return launch


def _choose_template(site: SiteSpec, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                     blocks: dict) -> str:
    if site.template == "hopper" and _hopper_serves(q, k, v, out, blocks):
        return "hopper"
    return "generic"


def _check_interpreter() -> None:
    from triton import knobs

    if not knobs.runtime.interpret:
        raise RuntimeError(
            "fa3_inductor::flex_fwd got CPU tensors but Triton's interpreter is off. "
            "Set TRITON_INTERPRET=1 before importing triton to run the generic kernel on "
            "the CPU, or move the tensors to a CUDA device.")
    info_once("fa3_inductor: running the generic template under the Triton interpreter (CPU)")


_LIB.impl("flex_fwd", flex_fwd, "CUDA")
_LIB.impl("flex_fwd", flex_fwd, "CPU")


@torch.library.register_fake("fa3_inductor::flex_fwd", lib=_LIB)
def _flex_fwd_fake(q, k, v, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                   score_bufs, mask_bufs, scale, sparse_q_block, sparse_kv_block, spec):
    Z, H, M, _ = q.shape
    return (_out_like(q, v), q.new_empty((Z, H, M), dtype=torch.float32),
            q.new_empty((Z, H, M), dtype=torch.float32))
