"""Launch the generic (plain Triton) forward kernel."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .kernel import NO_QUANT, BlockSparsity, Quant, SiteFlags, Tiling, attention_fwd_kernel
from ..placeholder import placeholder
from ..modgen import MAX_POSITION, kernel_score_mod, mod_info
from ..sink_args import sink_bufs as kernel_sink_bufs
from ..wide_scores import wide_scores
from ..tma import tma_aligned
from ..._log import warn_once
from .configs import GenericConfig, generic_config, generic_config_variants

_allocator_set = False


def _ensure_allocator() -> None:
    """Device-side tensor descriptors need a scratch allocator (128 bytes per descriptor)."""
    global _allocator_set
    if not _allocator_set:
        def alloc(size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
            device = "cuda" if stream is not None and torch.cuda.is_available() else "cpu"
            return torch.empty(size, dtype=torch.int8, device=device)

        triton.set_allocator(alloc)
        _allocator_set = True


def _capability(t: torch.Tensor) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(t.device) if t.is_cuda else None


def _planned_capability(t: torch.Tensor, plan_for: tuple[int, int] | None) -> tuple[int, int] | None:
    return plan_for if plan_for is not None and not t.is_cuda else _capability(t)


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if tensor descriptors can read it, else a view of it whose size-1 dims carry
    aligned strides (the stride of a size-1 dim is never used to address it), else a contiguous
    copy (logged). A one-head q of MViTv2 has strides (M·D, 1, D, 1): torch calls it contiguous
    (``.contiguous()`` returns it as is), but its head stride is not 16-byte aligned."""
    if tma_aligned(t):
        return t
    view = _unit_dims_restrided(t)
    if tma_aligned(view):
        return view
    warn_once(f"fa3_inductor: a {tuple(t.shape)} input with strides {t.stride()} is not "
              "16-byte aligned for TMA; copying it to a contiguous layout")
    return _unit_dims_restrided(t.contiguous())


def _unit_dims_restrided(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed with each size-1 dim's stride set to what a contiguous layout gives it (the
    next inner dim's stride times its size); ``t`` itself when that changes nothing."""
    shape, stride = t.shape, list(t.stride())
    inner = 1
    for d in range(t.dim() - 1, -1, -1):
        if shape[d] == 1:
            stride[d] = inner
        inner = stride[d] * shape[d]
    if tuple(stride) == t.stride():
        return t
    return t.as_strided(shape, stride, t.storage_offset())


def _fold_scale(sm_scale: float, score_mod: Any) -> bool:
    return score_mod is None and sm_scale > 0


def _prepare(q, k, v, out, lse, max_scores, sm_scale, score_mod, mask_mod, score_bufs,
             mask_bufs, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
             sparse_q_block, sparse_kv_block, capability, iterate_hull=None, config=None,
             host_descriptors=None, even_n=None, fp8=None, sinks=None):
    """(args, kwargs, grid) of one generic-kernel launch; shared by launch and compile-only.
    ``even_n`` overrides EVEN_N (compiling a sibling variant ahead: never launched so). ``fp8``: the
    prologue's FP8Operands, whose q, k, vt are then the q, k, v given here. ``sinks``: [HQ] logits
    joining each row's softmax denominator (kernel.py's SINKS), or None."""
    Z, HQ, M, D = q.shape
    HKV, N, DV = k.shape[1], k.shape[2], (v.shape[2] if fp8 is not None else v.shape[3])
    # The kernel's factor from its score tile to the score (kernel._kv_tile takes it in log2
    # units): the mod's, or the scale itself when the no-mod path folds it.
    if score_mod is not None:
        score_mod, to_score = kernel_score_mod(score_mod, sm_scale)
    else:
        to_score = sm_scale if _fold_scale(sm_scale, score_mod) else 1.0
    if max(M, N) >= MAX_POSITION:
        # Generated mods turn indices into floats exactly only below 2**23 (mod_helpers).
        raise ValueError(f"fa3 generic kernel: sequence lengths must be below {MAX_POSITION} "
                         f"(got M={M}, N={N}); split the sequence into chunks")
    loads, plain = _site_traits(score_mod, mask_mod, kv_num_blocks)
    # Tiles by the wider of the two head dims: the Q/K tiles and the O accumulator both live
    # in registers, so the wider one bounds what fits (the table is per padded head dim).
    cfg = config or generic_config(max(D, DV), capability, mods_load_buffers=loads,
                                   fp32=q.dtype == torch.float32, plain_kv_len=N if plain else 0)
    block_m = min(cfg.block_m, sparse_q_block)
    block_n = min(cfg.block_n, sparse_kv_block)
    if fp8 is not None and fp8.recipe.block_n:
        block_n = min(block_n, fp8.recipe.block_n)   # a KV tile inside one K / V scale block
    has_mask = kv_num_blocks is not None
    if not has_mask and mask_mod is not None:
        raise ValueError("launch_generic: a mask_mod needs block-mask tensors (kv_num_blocks)")
    has_full = has_mask and full_kv_num_blocks is not None
    dummy = placeholder(q.device, torch.int32)
    tables = [t.contiguous() if t is not None else dummy  # indexed as dense row-major
              for t in (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)]
    SZ, SH, num_q_blks = kv_num_blocks.shape if has_mask else (1, 1, 1)
    num_kv_blks = kv_indices.shape[-1] if has_mask else 1
    block_d = max(16, triton.next_power_of_2(D))
    block_dv = max(16, triton.next_power_of_2(DV))
    host_desc = (capability is None or capability[0] >= 9) if host_descriptors is None \
        else host_descriptors
    hull = cfg.warp_specialize if iterate_hull is None else iterate_hull
    if even_n is None:
        # Every visited tile lies inside [0, N): tiles come whole from block-mask blocks, and
        # a block may reach past N (a 128-key block over N = 64 is two 64-key tiles, the
        # second wholly outside), so N must be a multiple of the block, not only the tile.
        even_n = N % (sparse_kv_block if has_mask else block_n) == 0 and N % block_n == 0
    qkvo = (q, k, v, out)
    if host_desc:
        v_tile = (block_dv, block_n) if fp8 is not None else (block_n, block_dv)   # VT: keys last
        tiles = ((block_m, block_d), (block_n, block_d), v_tile, (block_m, block_dv))
        qkvo = tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, cols])
                     for t, (rows, cols) in zip(qkvo, tiles))
    if fp8 is None:
        quant_args, quant = (dummy, dummy, dummy, dummy, 1, 1), NO_QUANT
    else:
        _check_fp8_dtypes(q, k, v, fp8)
        quant_args = (fp8.q_scale, fp8.k_scale, fp8.v_scale, fp8.v_scale_max,
                      fp8.q_scale.shape[-1], fp8.k_scale.shape[-1])
        quant = Quant(ON=True, QK_INT8=fp8.recipe.qk == "int8", Q_BLOCK=fp8.recipe.block_m,
                      KV_BLOCK=fp8.recipe.block_n,
                      TWO_LEVEL=fp8.recipe.two_level > 0, OUT_BF16=out.dtype == torch.bfloat16,
                      ROUND_P_IN_FP32=capability is None)
    sinks_arg = kernel_sink_bufs(sinks, q, fp8, "fa3 generic kernel")
    args = (*qkvo, lse, max_scores, sinks_arg, *tables, tuple(score_bufs),
            tuple(mask_bufs), *quant_args,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            HQ, k.shape[0], M, N, D, DV, SZ, SH, num_q_blks, num_kv_blks, sm_scale,
            to_score * math.log2(math.e))
    tile = Tiling(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        WARP_SPECIALIZE=cfg.warp_specialize,
        HOST_DESC=host_desc,
        # float32 inputs follow torch's matmul precision setting ("highest" = IEEE), as
        # torch's own flex kernel does; 16-bit inputs ignore it.
        DOT_PRECISION="tf32" if torch.get_float32_matmul_precision() != "highest" else "ieee",
    )
    sparse = BlockSparsity(
        HAS_BLOCK_MASK=has_mask, HAS_FULL_BLOCKS=has_full,
        SPARSE_Q=sparse_q_block if has_mask else block_m,
        SPARSE_KV=sparse_kv_block if has_mask else block_n,
        # The warp-specialized loop must not read tile positions from the tables (kernel.py).
        ITERATE_HULL=hull,
        # Read by the hull walk only: fixed otherwise, so that it does not split sites by length.
        MAX_KV_BLKS=max(2, triton.next_power_of_2(num_kv_blks)) if hull else 2,
    )
    flags = SiteFlags(
        GQA_GROUP=HQ // HKV,
        EVEN_N=even_n,
        # Without a score_mod, keep raw q.k scores and fold the scale into the row max and
        # the exp2 argument; valid for a positive scale only.
        FOLD_SCALE=_fold_scale(sm_scale, score_mod),
        HAS_SINKS=sinks is not None,
        WIDE_SCORES=wide_scores(score_mod, compiled=capability is not None),
    )
    kwargs = dict(SCORE_MOD=score_mod, MASK_MOD=mask_mod, TILE=tile, SPARSE=sparse, FLAGS=flags,
                  QUANT=quant, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return args, kwargs, (triton.cdiv(M, block_m), Z * HQ)


def _check_fp8_dtypes(q: torch.Tensor, k: torch.Tensor, vt: torch.Tensor, fp8: Any) -> None:
    """The FP8 operands' dtypes are those ``fp8.recipe`` makes (fp8_recipe.FP8Operands): int8 or
    e4m3 Q and K per ``recipe.qk``, e4m3 Vᵀ. The kernel's QUANT.QK_INT8 follows the recipe, and an
    int8 tensor read as e4m3 (or back) would give wrong scores silently."""
    want = torch.int8 if fp8.recipe.qk == "int8" else torch.float8_e4m3fn
    if q.dtype != want or k.dtype != want or vt.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fa3 generic kernel, FP8: FP8Recipe(qk={fp8.recipe.qk!r}) needs q, k as {want} "
                         f"and vt as torch.float8_e4m3fn, got {q.dtype}, {k.dtype}, {vt.dtype}; pass "
                         "the operands that templates/fp8_prologue.quantize made with this recipe")


def _site_traits(score_mod: Any, mask_mod: Any, kv_num_blocks: Any) -> tuple[bool, bool]:
    """(a mod gathers from a captured buffer, the site is plain: no score_mod, no block mask),
    what the tile table asks of a site besides its head dim and dtype. ``score_mod`` is the one
    launched (after kernel_score_mod)."""
    loads = any(m is not None and mod_info(m).gathers for m in (score_mod, mask_mod))
    return loads, score_mod is None and kv_num_blocks is None


def prepare_generic(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, max_scores: torch.Tensor, *,
    sm_scale: float, score_mod: Any = None, mask_mod: Any = None,
    score_bufs: Sequence[torch.Tensor] = (), mask_bufs: Sequence[torch.Tensor] = (),
    kv_num_blocks: Optional[torch.Tensor] = None, kv_indices: Optional[torch.Tensor] = None,
    full_kv_num_blocks: Optional[torch.Tensor] = None,
    full_kv_indices: Optional[torch.Tensor] = None,
    sparse_q_block: int = 128, sparse_kv_block: int = 128, iterate_hull: Optional[bool] = None,
    config: Optional[GenericConfig] = None, host_descriptors: Optional[bool] = None,
    even_n: Optional[bool] = None, plan_for: Optional[tuple[int, int]] = None, fp8: Any = None,
    sinks: Optional[torch.Tensor] = None,
) -> tuple[Any, tuple, dict, tuple]:
    """``(kernel, args, kwargs, grid)`` of one generic-kernel launch.

    ``sm_scale`` multiplies q.k; ``score_mod``/``mask_mod`` are generated jit functions with
    their captured ``score_bufs``/``mask_bufs``; the four block-mask tables (torch's BlockMask
    layout) with ``sparse_q_block``/``sparse_kv_block`` restrict the KV tiles visited;
    ``iterate_hull`` picks how a block mask is walked (None: the config's choice); ``config``
    overrides the tile table (sweeps, tests); ``host_descriptors`` picks the kernel's
    descriptors (None: built on the host on sm90 and in the interpreter, in the kernel on other
    GPUs; see kernel.py); ``even_n`` forces EVEN_N (a sibling compiled ahead, never launched:
    :func:`prepare_generic_variants`); ``plan_for`` the GPU capability to plan for when the tensors
    are on no GPU (CPU or meta tensors: tests, compile-only; None: the tensors' own device);
    ``fp8`` the prologue's FP8Operands (templates/fp8_prologue/): then ``q, k, v`` are its ``q, k,
    vt`` and ``out`` is bfloat16 or float16; ``sinks`` a [HQ] tensor of per-head logits that join each
    row's softmax denominator (gpt-oss; ``lse`` then includes them), or None.

    Example::

        >>> kernel, args, kwargs, grid = prepare_generic(q, k, v, out, lse, mx, sm_scale=0.125)  # doctest: +SKIP
        >>> kernel[grid](*args, **kwargs)                                                          # doctest: +SKIP
    """
    _ensure_allocator()
    q, k, v = _tma_ready(q), _tma_ready(k), _tma_ready(v)
    if not tma_aligned(out):
        raise ValueError("launch_generic: out must have a unit last stride and 16-byte aligned "
                         f"strides; got {out.stride()}")
    args, kwargs, grid = _prepare(q, k, v, out, lse, max_scores, sm_scale, score_mod, mask_mod,
                                  score_bufs, mask_bufs, kv_num_blocks, kv_indices,
                                  full_kv_num_blocks, full_kv_indices, sparse_q_block,
                                  sparse_kv_block, _planned_capability(q, plan_for), iterate_hull,
                                  config, host_descriptors, even_n, fp8, sinks)
    return attention_fwd_kernel, args, kwargs, grid


def prepare_generic_variants(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, max_scores: torch.Tensor, **options: Any,
) -> tuple[tuple, list[tuple]]:
    """``(launch, siblings)``: :func:`prepare_generic`'s launch, and the same site's launches under
    the choices other lengths make (EVEN_N, and the tiles of long plain sites on sm90), as
    ``(kernel, args, kwargs, grid)``. Compiling the siblings ahead (runtime/variants.py) leaves no
    compile for a later length: every other launch argument is length-independent in Triton's
    specialization key (kernel.py, "Specialization").

    Example::

        >>> launch, siblings = prepare_generic_variants(q, k, v, out, lse, mx, sm_scale=0.1)  # doctest: +SKIP
        >>> sorted(s[2]["FLAGS"].EVEN_N for s in siblings)                                           # doctest: +SKIP
        [True]
    """
    launch = prepare_generic(q, k, v, out, lse, max_scores, **options)
    _, _, kwargs, _ = launch
    if options.get("config") is not None:
        configs = [options["config"]]
    else:
        D, DV = q.shape[-1], (v.shape[2] if options.get("fp8") is not None else v.shape[-1])
        score_mod = options.get("score_mod")
        if score_mod is not None:
            score_mod = kernel_score_mod(score_mod, options["sm_scale"])[0]
        loads, plain = _site_traits(score_mod, options.get("mask_mod"), options.get("kv_num_blocks"))
        configs = generic_config_variants(max(D, DV), _planned_capability(q, options.get("plan_for")),
                                          loads, q.dtype == torch.float32, plain)
    siblings, seen = [], [kwargs]
    for cfg in configs:
        for even_n in (True, False):
            sibling = prepare_generic(q, k, v, out, lse, max_scores,
                                      **{**options, "config": cfg, "even_n": even_n})
            if sibling[2] not in seen:   # the constexprs and options decide the rest of the key
                seen.append(sibling[2])
                siblings.append(sibling)
    return launch, siblings


def launch_generic(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, max_scores: torch.Tensor, **options: Any) -> None:
    """Run the generic kernel; ``out``/``lse``/``max_scores`` are written in place.

    ``options`` are :func:`prepare_generic`'s keywords (``sm_scale`` required; mods, captured
    buffers, block-mask tables and block sizes, ``iterate_hull``, ``config``). Shapes and
    conventions are those of ``templates/generic/kernel.py``; with ``kv_num_blocks=None`` every
    KV tile is visited and ``mask_mod`` must be None.

    Example::

        >>> launch_generic(q, k, v, out, lse, mx, sm_scale=q.shape[-1] ** -0.5)  # doctest: +SKIP
    """
    kernel, args, kwargs, grid = prepare_generic(q, k, v, out, lse, max_scores, **options)
    kernel[grid](*args, **kwargs)


def compile_generic(q, k, v, out, lse, max_scores, *, sm_scale: float, score_mod: Any = None,
                    mask_mod: Any = None, score_bufs: Sequence[torch.Tensor] = (),
                    mask_bufs: Sequence[torch.Tensor] = (), kv_num_blocks=None, kv_indices=None,
                    full_kv_num_blocks=None, full_kv_indices=None, sparse_q_block: int = 128,
                    sparse_kv_block: int = 128, capability: tuple[int, int] = (9, 0),
                    fp8: Any = None, config: Optional[GenericConfig] = None,
                    sinks: Optional[torch.Tensor] = None) -> Any:
    """Compile (not run) what launch_generic would launch on a GPU of ``capability``.

    Tensors may be on the CPU; needs a process without TRITON_INTERPRET=1.

    Example::

        >>> ck = compile_generic(q, k, v, out, lse, mx, sm_scale=0.125)   # doctest: +SKIP
    """
    from triton.backends.compiler import GPUTarget

    from ..aot import compile_launch

    args, kwargs, _ = _prepare(q, k, v, out, lse, max_scores, sm_scale, score_mod, mask_mod,
                               score_bufs, mask_bufs, kv_num_blocks, kv_indices,
                               full_kv_num_blocks, full_kv_indices, sparse_q_block,
                               sparse_kv_block, capability, config=config, fp8=fp8, sinks=sinks)
    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    return compile_launch(attention_fwd_kernel, args, kwargs, target)
