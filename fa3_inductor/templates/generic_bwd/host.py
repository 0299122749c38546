"""Launch the generic (plain Triton) backward: delta, dK/dV, dQ (kernel.py).

Shapes and conventions are kernel.py's; the arguments mirror the forward's
``prepare_generic`` / ``launch_generic`` (templates/generic/host.py), plus the forward's ``out`` and
``lse``, the incoming ``dout`` (and optionally ``grad_lse``), the outputs ``dq, dk, dv`` and the
score_mod's derivative ``score_grad_mod`` (score_grad.py), and optionally the captured buffers'
gradients ``buffer_grads`` (buffer_grad.py; their host steps are buffer_grad_host.py's).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import triton

from ..placeholder import placeholder
from ..modgen import MAX_POSITION, kernel_score_mod
from ..wide_scores import wide_scores
from .buffer_grad import BufferGradSource
from .buffer_grad_host import TorchStep, buffer_grad_launches
from .configs import PREPROCESS_BLOCK_M, BackwardConfig, backward_config
from .kernel import (BwdFlags, BwdSparsity, BwdTiling, attention_bwd_dkdv_kernel,
                     attention_bwd_dq_kernel, attention_bwd_preprocess_kernel)

_LOG2E = math.log2(math.e)


class _UnitGradient:
    """The ``score_grad_mod`` of a score_mod whose derivative is 1 (it adds a term: ALiBi, biases)."""

    def __repr__(self) -> str:
        return "SCORE_GRAD_ONE"


# Pass as ``score_grad_mod`` when score_grad.score_grad_source returned None.
SCORE_GRAD_ONE = _UnitGradient()

Launch = tuple   # (kernel, args, kwargs, grid)


def transpose_block_tables(num_blocks: torch.Tensor, indices: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The transposed block lists: (q_num_blocks, q_indices) from (kv_num_blocks, kv_indices), or
    back. ``num_blocks`` [SZ, SH, R] counts the listed entries of ``indices`` [SZ, SH, R, C] per row;
    the result lists, for each of the C columns, the rows that list it ([SZ, SH, C], [SZ, SH, C, R],
    ascending, int32). torch's BlockMask carries these already (``q_num_blocks``, ...); this is for
    callers that only have the forward's tables.

    Example::

        >>> n, idx = transpose_block_tables(torch.tensor([[[1, 2]]]), torch.tensor([[[[0, 0], [0, 1]]]]))
        >>> n.tolist(), idx[..., :2].tolist()
        ([[[2, 1]]], [[[[0, 1], [1, 0]]]])
    """
    SZ, SH, R, C = indices.shape
    listed = torch.arange(C, device=indices.device) < num_blocks[..., None]
    dense = torch.zeros(SZ, SH, R, C, dtype=torch.int32, device=indices.device)
    # Unlisted entries may hold anything: add 0 for them (a plain scatter could clear a listed one).
    dense.scatter_add_(-1, indices.long().clamp(0, C - 1), listed.to(torch.int32))
    dense_t = dense.transpose(-1, -2) > 0                           # [SZ, SH, C, R]
    t_num = dense_t.sum(-1, dtype=torch.int32)
    t_idx = torch.argsort((~dense_t).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return t_num.contiguous(), t_idx.contiguous()


def _check_inputs(q, k, v, out, dout, lse, dq, dk, dv) -> None:
    Z, HQ, M, D = q.shape
    KZ, HKV, N, DV = v.shape
    problems = []
    if k.shape != (KZ, HKV, N, D):
        problems.append(f"k is {tuple(k.shape)}, expected {(KZ, HKV, N, D)}")
    if KZ not in (1, Z) or HQ % HKV:
        problems.append(f"K/V batch {KZ} must be 1 or {Z}, and {HQ} query heads a multiple of {HKV}")
    for name, t, shape in (("out", out, (Z, HQ, M, DV)), ("dout", dout, (Z, HQ, M, DV)),
                           ("lse", lse, (Z, HQ, M)), ("dq", dq, q.shape), ("dk", dk, k.shape),
                           ("dv", dv, v.shape)):
        if tuple(t.shape) != tuple(shape):
            problems.append(f"{name} is {tuple(t.shape)}, expected {tuple(shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("dq", dq),
                    ("dk", dk), ("dv", dv)):
        if t.stride(-1) != 1:
            problems.append(f"{name} has last stride {t.stride(-1)} (must be 1)")
    if max(M, N) >= MAX_POSITION:
        problems.append(f"sequence lengths must be below {MAX_POSITION} (generated mods turn indices "
                        "into floats exactly only below 2**23); split the sequence")
    if problems:
        raise ValueError("generic backward: " + "; ".join(problems))


def _block_sizes(cfg_m: int, cfg_n: int, sparse_q: int, sparse_kv: int, has_mask: bool
                 ) -> tuple[int, int]:
    """A kernel's tiles: the config's, shrunk to fit inside one block-mask block."""
    block_m, block_n = (min(cfg_m, sparse_q), min(cfg_n, sparse_kv)) if has_mask else (cfg_m, cfg_n)
    if has_mask and (sparse_q % block_m or sparse_kv % block_n):
        raise ValueError(f"generic backward: block-mask blocks {sparse_q}x{sparse_kv} are not "
                         f"multiples of the tiles {block_m}x{block_n}; build the BlockMask with "
                         "power-of-two BLOCK_SIZE (torch's default 128 works)")
    return block_m, block_n


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def generic_backward_scratch(q: torch.Tensor) -> tuple[torch.Tensor]:
    """The scratch of one generic backward of ``q``'s shape, freshly allocated: (DELTA,), the rows'
    dO . O, float32 [Z, HQ, M], written by the preprocess launch before anything reads it. Pass it as
    ``prepare_generic_backward(..., scratch=...)`` to own every tensor the three kernels touch
    (runtime/ops_bwd.py re-launches them so).

    Example::

        >>> tuple(generic_backward_scratch(torch.empty(2, 3, 40, 16))[0].shape)
        (2, 3, 40)
    """
    return (torch.empty(q.shape[:3], dtype=torch.float32, device=q.device),)


def _scratch_delta(scratch: Sequence[torch.Tensor], q: torch.Tensor) -> torch.Tensor:
    (delta,) = scratch if len(scratch) == 1 else (None,)
    if delta is None or tuple(delta.shape) != tuple(q.shape[:3]) or delta.dtype != torch.float32 or \
            delta.device != q.device or not delta.is_contiguous():
        got = [f"{t.dtype} {tuple(t.shape)} on {t.device}" for t in scratch]
        raise ValueError(f"generic backward: scratch must be one contiguous torch.float32 tensor of shape "
                         f"{tuple(q.shape[:3])} on {q.device} (DELTA), got {got}; allocate it with "
                         "generic_backward_scratch(q)")
    return delta


def prepare_generic_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
    lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, *,
    sm_scale: float, grad_lse: Optional[torch.Tensor] = None,
    score_mod: Any = None, score_grad_mod: Any = None, mask_mod: Any = None,
    score_bufs: Sequence[torch.Tensor] = (), mask_bufs: Sequence[torch.Tensor] = (),
    kv_num_blocks: Optional[torch.Tensor] = None, kv_indices: Optional[torch.Tensor] = None,
    full_kv_num_blocks: Optional[torch.Tensor] = None,
    full_kv_indices: Optional[torch.Tensor] = None,
    q_num_blocks: Optional[torch.Tensor] = None, q_indices: Optional[torch.Tensor] = None,
    full_q_num_blocks: Optional[torch.Tensor] = None, full_q_indices: Optional[torch.Tensor] = None,
    sparse_q_block: int = 128, sparse_kv_block: int = 128,
    config: Optional[BackwardConfig] = None, plan_for: Optional[tuple[int, int]] = None,
    buffer_grads: Sequence[tuple[BufferGradSource, torch.Tensor]] = (),
    deterministic: bool = False, scratch: Optional[Sequence[torch.Tensor]] = None,
) -> list[Launch]:
    """The three launches of one backward, ``[(kernel, args, kwargs, grid)]`` in the order they
    must run: delta (preprocess), dK/dV, dQ. ``dq``, ``dk``, ``dv`` are written by the last two
    (in their own dtype, each element once).

    ``buffer_grads``: (source, gradient) pairs for the score_mod's captured buffers that need a
    gradient, the sources from ``buffer_grad.buffer_grad_sources`` and each gradient a contiguous
    tensor of the buffer's shape, overwritten. The dQ pass then also sums them (fp32) and more steps
    follow it: a :class:`TorchStep` (zeroing, before the dQ pass) and one conversion kernel per
    buffer with fp32 atomics; with ``deterministic=True`` no atomics, bitwise-reproducible, at the
    cost of entry scratch (one entry per score for a table indexed by q_idx and kv_idx) and a sort
    (kernel.py, "Buffer gradients"). dq, dk, dv are deterministic either way.

    ``lse`` is the forward's, float32 [Z, HQ, M] in log2 units (-inf on fully masked rows);
    ``grad_lse`` its incoming gradient (same units), if the LSE was an output that got one.
    ``score_mod`` / ``mask_mod`` / buffers / block-mask tables are the forward's
    (``prepare_generic``); with a ``score_mod``, ``score_grad_mod`` is required: the loaded mod of
    ``score_grad.score_grad_source`` (its derivative), or :data:`SCORE_GRAD_ONE` when that returned
    None. The transposed tables ``q_num_blocks`` ... ``full_q_indices`` (torch's BlockMask has them)
    are derived from the forward's when not given. ``config`` overrides the tile table;
    ``plan_for`` the GPU capability to plan for when the tensors are on no GPU (compile-only).
    ``scratch``: (DELTA,) from :func:`generic_backward_scratch`; None allocates it here.

    Example::

        >>> launches = prepare_generic_backward(q, k, v, out, dout, lse, dq, dk, dv,
        ...                                     sm_scale=0.125)                  # doctest: +SKIP
        >>> for kernel, args, kwargs, grid in launches:                          # doctest: +SKIP
        ...     kernel[grid](*args, **kwargs)
    """
    _check_inputs(q, k, v, out, dout, lse, dq, dk, dv)
    if score_mod is not None and score_grad_mod is None:
        raise ValueError("generic backward: a score_mod needs its derivative, score_grad_mod: "
                         "generate it with templates/generic_bwd/score_grad.score_grad_source "
                         "from flex's joint graph (pass SCORE_GRAD_ONE when that returns None)")
    if score_mod is None and score_grad_mod is not None and score_grad_mod is not SCORE_GRAD_ONE:
        raise ValueError("generic backward: score_grad_mod given without its score_mod")
    if buffer_grads and score_mod is None:
        raise ValueError("generic backward: buffer_grads given without the score_mod whose "
                         "captured buffers they are; pass score_mod and score_bufs too")
    has_mask = kv_num_blocks is not None
    if mask_mod is not None and not has_mask:
        raise ValueError("generic backward: a mask_mod needs block-mask tensors (kv_num_blocks, "
                         "kv_indices), as in the forward")
    has_full = has_mask and full_kv_num_blocks is not None
    if has_mask and q_num_blocks is None:
        q_num_blocks, q_indices = transpose_block_tables(kv_num_blocks, kv_indices)
    if has_full and full_q_num_blocks is None:
        full_q_num_blocks, full_q_indices = transpose_block_tables(full_kv_num_blocks,
                                                                   full_kv_indices)

    Z, HQ, M, D = q.shape
    KZ, HKV, N, DV = v.shape
    capability = plan_for if plan_for is not None and not q.is_cuda else (
        torch.cuda.get_device_capability(q.device) if q.is_cuda else None)
    cfg = config or backward_config(max(D, DV), capability, fp32=q.dtype == torch.float32)

    # The forward's score units (templates/generic/host.py): the launched mod, and the factor from
    # its tile to the score; without a mod and with a positive scale, raw q.k (FOLD_SCALE).
    fold = score_mod is None and sm_scale > 0
    if score_mod is not None:
        score_mod, to_score = kernel_score_mod(score_mod, sm_scale)
    else:
        to_score = sm_scale if fold else 1.0
    # dS is in score units; dQ, dK take the derivative's factor and the scale once, at the end.
    if score_grad_mod is not None and score_grad_mod is not SCORE_GRAD_ONE:
        score_grad_mod, grad_factor = kernel_score_mod(score_grad_mod, sm_scale)
    else:
        score_grad_mod, grad_factor = None, 1.0
    scalars = (sm_scale, to_score * _LOG2E, sm_scale * grad_factor)

    dout = dout.to(q.dtype)
    out = out.to(q.dtype)
    lse = lse.float().contiguous()
    (delta,) = generic_backward_scratch(q) if scratch is None else (_scratch_delta(scratch, q),)
    dummy = placeholder(q.device, torch.int32)

    def table(t: Optional[torch.Tensor]) -> torch.Tensor:   # indexed as dense row-major
        return dummy if t is None else t.contiguous()

    kv_tables = tuple(table(t) for t in (kv_num_blocks, kv_indices, full_kv_num_blocks,
                                         full_kv_indices))
    q_tables = tuple(table(t) for t in (q_num_blocks, q_indices, full_q_num_blocks,
                                        full_q_indices))
    SZ, SH, num_q_blks = kv_num_blocks.shape if has_mask else (1, 1, 1)
    num_kv_blks = kv_indices.shape[-1] if has_mask else 1
    block_d = max(16, triton.next_power_of_2(D))
    block_dv = max(16, triton.next_power_of_2(DV))
    precision = "tf32" if torch.get_float32_matmul_precision() != "highest" else "ieee"
    flags = BwdFlags(GQA_GROUP=HQ // HKV, FOLD_SCALE=fold,
                     WIDE_SCORES=wide_scores(score_mod, compiled=capability is not None))
    mods = dict(SCORE_MOD=score_mod, SCORE_GRAD=score_grad_mod, MASK_MOD=mask_mod)

    def bundles(cfg_m: int, cfg_n: int) -> tuple[BwdTiling, BwdSparsity]:
        block_m, block_n = _block_sizes(cfg_m, cfg_n, sparse_q_block, sparse_kv_block, has_mask)
        tile = BwdTiling(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
                         DOT_PRECISION=precision)
        sparse = BwdSparsity(HAS_BLOCK_MASK=has_mask, HAS_FULL_BLOCKS=has_full,
                             SPARSE_Q=sparse_q_block if has_mask else block_m,
                             SPARSE_KV=sparse_kv_block if has_mask else block_n)
        return tile, sparse

    preprocess = (
        attention_bwd_preprocess_kernel,
        (out, dout, grad_lse.float().contiguous() if grad_lse is not None else delta, delta,
         _strides(out), _strides(dout), HQ, M, DV),
        dict(HAS_DLSE=grad_lse is not None, BLOCK_M=PREPROCESS_BLOCK_M, BLOCK_DV=block_dv,
             num_warps=4),
        (triton.cdiv(M, PREPROCESS_BLOCK_M), Z * HQ))

    tile, sparse = bundles(cfg.dkdv_block_m, cfg.dkdv_block_n)
    dkdv = (
        attention_bwd_dkdv_kernel,
        (q, k, v, dout, dk, dv, lse, delta, *q_tables, tuple(score_bufs), tuple(mask_bufs),
         _strides(q), _strides(k), _strides(v), _strides(dout), _strides(dk), _strides(dv),
         Z, HQ, KZ, M, N, D, DV, SZ, SH, num_q_blks, num_kv_blks, *scalars),
        dict(**mods, TILE=tile, SPARSE=sparse, FLAGS=flags, num_warps=cfg.dkdv_warps,
             num_stages=cfg.num_stages),
        (triton.cdiv(N, tile.BLOCK_N), KZ * HKV))

    tile, sparse = bundles(cfg.dq_block_m, cfg.dq_block_n)
    bgrads, bg_out, bg_idx, before_dq, after_dq = buffer_grad_launches(
        buffer_grads, deterministic, sm_scale, triton.cdiv(M, tile.BLOCK_M) * Z * HQ,
        triton.cdiv(N, tile.BLOCK_N), tile.BLOCK_M, tile.BLOCK_N, q.device)
    dq_pass = (
        attention_bwd_dq_kernel,
        (q, k, v, dout, dq, lse, delta, *kv_tables, tuple(score_bufs), tuple(mask_bufs),
         _strides(q), _strides(k), _strides(v), _strides(dout), _strides(dq),
         HQ, KZ, M, N, D, DV, SZ, SH, num_q_blks, num_kv_blks, *scalars, bg_out, bg_idx),
        dict(**mods, TILE=tile, SPARSE=sparse, FLAGS=flags, BGRADS=bgrads,
             num_warps=cfg.dq_warps, num_stages=cfg.num_stages),
        (triton.cdiv(M, tile.BLOCK_M), Z * HQ))
    return [preprocess, dkdv, *before_dq, dq_pass, *after_dq]


def launch_generic_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                            dout: torch.Tensor, lse: torch.Tensor, dq: torch.Tensor,
                            dk: torch.Tensor, dv: torch.Tensor, **options: Any) -> None:
    """Run the backward; ``dq``, ``dk``, ``dv`` are written in place.

    ``options`` are :func:`prepare_generic_backward`'s keywords (``sm_scale`` required). On CPU
    tensors under Triton's interpreter, bfloat16 inputs give wrong dots (Triton 3.6): use
    :func:`generic_backward`, which runs those on float32 copies.

    Example::

        >>> launch_generic_backward(q, k, v, out, dout, lse, dq, dk, dv, sm_scale=0.125)  # doctest: +SKIP
    """
    for kernel, args, kwargs, grid in prepare_generic_backward(q, k, v, out, dout, lse, dq, dk, dv,
                                                               **options):
        kernel[grid](*args, **kwargs)


# Input dtypes Triton 3.6's interpreter cannot compute a dot in (as the forward family's).
_INTERPRETER_UPCAST = (torch.bfloat16,)


def generic_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     dout: torch.Tensor, lse: torch.Tensor, **options: Any
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` in the inputs' dtypes: allocates them and runs :func:`launch_generic_backward`.
    On CPU tensors (Triton's interpreter) bfloat16 inputs run on float32 copies.

    Example::

        >>> dq, dk, dv = generic_backward(q, k, v, out, dout, lse, sm_scale=0.125,
        ...                               mask_mod=causal_tl, kv_num_blocks=bm.kv_num_blocks,
        ...                               kv_indices=bm.kv_indices)      # doctest: +SKIP
    """
    upcast = not q.is_cuda and q.dtype in _INTERPRETER_UPCAST
    run = [t.float() if upcast else t for t in (q, k, v, out, dout)]
    dq, dk, dv = (torch.empty_like(t) for t in run[:3])
    launch_generic_backward(*run[:5], lse, dq, dk, dv, **options)
    return tuple(g.to(t.dtype) for g, t in zip((dq, dk, dv), (q, k, v)))


def compile_generic_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, *,
                             capability: tuple[int, int] = (9, 0), **options: Any) -> list[Any]:
    """Compile (not run) the kernels :func:`launch_generic_backward` would launch on a GPU of
    ``capability``: the compiled kernels, in launch order (delta, dK/dV, dQ, then one per buffer
    gradient; :class:`TorchStep` entries are skipped). Tensors may be on the CPU; needs a
    process without TRITON_INTERPRET=1.

    Example::

        >>> pre, dkdv, dq = compile_generic_backward(q, k, v, out, dout, lse, sm_scale=0.125)  # doctest: +SKIP
        >>> sass_report(dkdv).hgmma > 0                                                        # doctest: +SKIP
        True
    """
    from triton.backends.compiler import GPUTarget

    from ..aot import compile_launch

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    launches = prepare_generic_backward(q, k, v, out, dout, lse, dq, dk, dv,
                                        plan_for=capability, **options)
    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    return [compile_launch(kernel, args, kwargs, target) for kernel, args, kwargs, _ in launches
            if not isinstance(kernel, TorchStep)]
