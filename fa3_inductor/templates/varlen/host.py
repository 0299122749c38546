"""Launch the varlen (packed sequences) forward kernel: prepare, launch, compile-only."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import triton

from ..modgen import kernel_score_mod
from ..wide_scores import wide_scores
from .configs import VarlenConfig, varlen_config
from .kernel import SiteFlags, Tiling, varlen_fwd_kernel

# Input dtypes the CPU interpreter cannot compute a dot in (Triton 3.6: bf16 tl.dot is wrong
# there; fp16 and fp32 are right): run on float32 copies.
_INTERPRETER_UPCAST = (torch.bfloat16,)


VARLEN_KERNELS = ("auto", "hopper", "triton")


def pick_varlen_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str = "auto",
                       capability: Optional[tuple[int, int]] = None) -> str:
    """Which kernel computes a packed batch on a GPU of ``capability`` (None: Triton's CPU interpreter):
    "hopper" (the Hopper kernel's VARLEN mode, templates/hopper/varlen_sm90.py: sm90, float16 / bfloat16, its
    tile table's head dims, TMA-aligned strides) or "triton" (kernel.py: any CUDA GPU and the interpreter).
    ``kernel`` "auto" takes hopper wherever it serves; "hopper" raises ValueError saying why where it does
    not; "triton" is always served.

    Example::

        >>> q = torch.empty(10, 4, 128, dtype=torch.bfloat16)
        >>> pick_varlen_kernel(q, q, q, "auto", (9, 0)), pick_varlen_kernel(q, q, q, "auto", (8, 0))
        ('hopper', 'triton')
    """
    from ..hopper.varlen_sm90 import varlen_sm90_refusal

    if kernel not in VARLEN_KERNELS:
        raise ValueError(f"flex_varlen: kernel must be one of {VARLEN_KERNELS}, got {kernel!r}")
    if kernel == "triton":
        return "triton"
    why_not = varlen_sm90_refusal(q, k, v, capability)
    if why_not is None:
        return "hopper"
    if kernel == "hopper":
        raise ValueError(f"flex_varlen: kernel='hopper' cannot run here: {why_not}; pass kernel='auto' to "
                         "fall back to the Triton varlen kernel")
    return "triton"


def _capability(t: torch.Tensor, plan_for: Optional[tuple[int, int]]) -> Optional[tuple[int, int]]:
    if t.is_cuda:
        return torch.cuda.get_device_capability(t.device)
    return plan_for


def prepare_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, *,
    sm_scale: float, score_mod: Any = None, mask_mod: Any = None, causal: bool = False,
    score_bufs: Sequence[torch.Tensor] = (), mask_bufs: Sequence[torch.Tensor] = (),
    config: Optional[VarlenConfig] = None, plan_for: Optional[tuple[int, int]] = None,
) -> tuple[Any, tuple, dict, tuple]:
    """``(kernel, args, kwargs, grid)`` of one varlen launch (shapes: kernel.py's notation).

    ``score_mod`` / ``mask_mod`` are generated ``tl`` jit functions with their captured buffers;
    ``causal`` says the mask_mod is ``q_idx >= kv_idx`` (modgen.is_causal_mask_source);
    ``config`` overrides the tile table; ``plan_for`` the GPU capability to plan for when the
    tensors are not on a GPU (compile-only; None: the interpreter's tiles).

    Example::

        >>> kernel, args, kwargs, grid = prepare_varlen(q, k, v, out, lse, cu_q, cu_k, 100,
        ...                                             sm_scale=0.125)  # doctest: +SKIP
        >>> kernel[grid](*args, **kwargs)                                # doctest: +SKIP
    """
    HQ, D = q.shape[1], q.shape[2]
    HKV, DV = k.shape[1], v.shape[2]
    if causal and mask_mod is None:
        raise ValueError("prepare_varlen: causal=True needs the causal mask_mod itself (the kernel "
                         "applies it on the diagonal tiles); pass mask_mod")
    if score_mod is not None:
        score_mod, to_score = kernel_score_mod(score_mod, sm_scale)
    else:
        to_score = sm_scale if sm_scale > 0 else 1.0
    fold = score_mod is None and sm_scale > 0
    capability = _capability(q, plan_for)
    cfg = config or varlen_config(max(D, DV), capability, fp32=q.dtype == torch.float32)
    tile = Tiling(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_DV=max(16, triton.next_power_of_2(DV)),
        HEAD_D=D, HEAD_DV=DV,
        # float32 inputs follow torch's matmul precision setting, as the generic kernel does.
        DOT_PRECISION="tf32" if torch.get_float32_matmul_precision() != "highest" else "ieee",
    )
    flags = SiteFlags(GQA_GROUP=HQ // HKV, CAUSAL=bool(causal), FOLD_SCALE=fold,
                      WIDE_SCORES=wide_scores(score_mod, compiled=capability is not None))
    B = cu_seqlens_q.shape[0] - 1
    args = (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, tuple(score_bufs), tuple(mask_bufs),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), B, q.shape[0], sm_scale,
            to_score * math.log2(math.e))
    kwargs = dict(SCORE_MOD=score_mod, MASK_MOD=mask_mod, TILE=tile, FLAGS=flags,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return varlen_fwd_kernel, args, kwargs, (B * triton.cdiv(max_seqlen_q, cfg.block_m), HQ)


def launch_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                  max_seqlen_q: int, **options: Any) -> None:
    """Run the varlen kernel; ``out`` [TQ, HQ, DV] and ``lse`` [HQ, TQ] (log2 units) are written in
    place. ``options`` are :func:`prepare_varlen`'s keywords (``sm_scale`` required). On CPU
    tensors (Triton's interpreter) bfloat16 runs on float32 copies.

    Example::

        >>> launch_varlen(q, k, v, out, lse, cu_q, cu_k, 100, sm_scale=0.125)  # doctest: +SKIP
    """
    target = out
    if not q.is_cuda and q.dtype in _INTERPRETER_UPCAST:
        q, k, v = q.float(), k.float(), v.float()
        out = torch.empty_like(target, dtype=torch.float32)
    kernel, args, kwargs, grid = prepare_varlen(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                max_seqlen_q, **options)
    if grid[0] > 0:
        kernel[grid](*args, **kwargs)
    if out is not target:
        target.copy_(out)


def compile_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                   max_seqlen_q: int, capability: tuple[int, int] = (9, 0),
                   **options: Any) -> Any:
    """Compile (not run) what :func:`launch_varlen` launches on a GPU of ``capability``. Tensors
    may be on the CPU; needs a process without TRITON_INTERPRET=1.

    Example::

        >>> ck = compile_varlen(q, k, v, out, lse, cu_q, cu_k, 512, sm_scale=0.125)  # doctest: +SKIP
    """
    from triton.backends.compiler import GPUTarget

    from ..aot import compile_launch

    kernel, args, kwargs, _ = prepare_varlen(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                             max_seqlen_q, plan_for=capability, **options)
    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    return compile_launch(kernel, args, kwargs, target)
