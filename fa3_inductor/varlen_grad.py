"""Gradients of ``fa3_inductor.flex_varlen`` on CUDA: an autograd function around the packed forward whose backward
is the sm90 backward's packed mode (templates/hopper_bwd/varlen.py). varlen.py routes here when its inputs need
gradients on a GPU that backward serves."""

from __future__ import annotations

import math
from typing import Any, Callable, Hashable, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .config import deterministic_gradients
from .mod_keys import Unkeyable, mod_key
from .templates.generic_bwd import SCORE_GRAD_ONE
from .templates.hopper_bwd.varlen import launch_varlen_backward, varlen_bwd_refusal
from .templates.modgen import BufferSpec, load_mod, trace_mod

_LN2 = math.log(2.0)
_MAX_DERIVATIVES = 256
_DERIVATIVES: dict[Hashable, tuple] = {}


def varlen_grad_refusal(q: Tensor, k: Tensor, v: Tensor, score_bufs: tuple, mask_bufs: tuple) -> Optional[str]:
    """None when flex_varlen can give these CUDA inputs gradients, else why not (for the caller's error).

    Example::

        >>> q = torch.empty(10, 4, 128, dtype=torch.bfloat16)
        >>> varlen_grad_refusal(q, q, q, (), ())
        'the Hopper varlen backward needs an sm90 GPU, this is not a GPU'
    """
    capability = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
    why_not = varlen_bwd_refusal(q, k, v, capability)
    if why_not is not None:
        return why_not
    if any(b.requires_grad for b in (*score_bufs, *mask_bufs)):
        return "a mod captures a tensor that requires grad (the varlen backward gives no gradient to mods' tensors)"
    if deterministic_gradients():
        return ("torch.use_deterministic_algorithms(True) asks for reproducible gradients, and the packed backward "
                "adds dQ in arrival order (the document-mask path's backward families honour it)")
    return None


def score_derivative(score_mod: Optional[Callable]) -> Any:
    """The ``gl`` derivative of a score_mod for the sm90 backward: a loaded mod, or SCORE_GRAD_ONE when it is 1
    (ALiBi, biases) or there is no score_mod. Cached by what the mod computes (mod_keys.py).

    Example::

        >>> from fa3_inductor import mods
        >>> score_derivative(mods.alibi(4)) is SCORE_GRAD_ONE
        True
    """
    if score_mod is None:
        return SCORE_GRAD_ONE
    try:
        key: Hashable = mod_key(score_mod)
    except Unkeyable:
        key = score_mod
    hit = _DERIVATIVES.get(key)
    if hit is not None:
        return hit[1]
    from torch._higher_order_ops.flex_attention import create_fw_bw_graph

    from .templates.hopper_bwd import score_grad_gl

    gm, bufs = trace_mod(score_mod, "score")
    with torch.enable_grad():   # autograd's backward runs with grad mode off; the joint graph needs it on
        index_values = (torch.zeros((), requires_grad=True), *(torch.zeros((), dtype=torch.int32) for _ in range(4)))
        joint = create_fw_bw_graph(gm, index_values, tuple(bufs))[1]
    source = score_grad_gl(joint, [BufferSpec.of(b) for b in bufs])
    derivative = SCORE_GRAD_ONE if source is None else load_mod(source, "gl")
    if len(_DERIVATIVES) >= _MAX_DERIVATIVES:
        _DERIVATIVES.clear()
    _DERIVATIVES[key] = (score_mod, derivative)   # the key may hold tensor ids: keep the mod alive
    return derivative


class VarlenAttention(torch.autograd.Function):
    """flex_varlen with gradients: ``forward`` runs ``run_forward`` (the packed forward, writing out and the log2 LSE),
    ``backward`` the sm90 packed backward with the same mods. Returns (out, natural-log LSE)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, scale: float,
                run_forward: Callable, mods: dict) -> tuple[Tensor, Tensor]:
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
        lse2 = torch.empty(q.shape[1], q.shape[0], device=q.device, dtype=torch.float32)
        run_forward(out, lse2)
        ctx.save_for_backward(q, k, v, out, lse2, cu_q, cu_k)
        ctx.scale, ctx.mods = scale, mods
        ctx.mark_non_differentiable(cu_q, cu_k)
        return out, lse2 * _LN2

    @staticmethod
    @once_differentiable   # (no double backward: a second derivative raises torch's own clear error)
    def backward(ctx: Any, dout: Optional[Tensor], dlse: Optional[Tensor]) -> tuple:
        q, k, v, out, lse2, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty(k.shape, dtype=k.dtype, device=k.device), \
            torch.empty(v.shape, dtype=v.dtype, device=v.device)
        dout = torch.zeros_like(out) if dout is None else dout.to(q.dtype).contiguous()
        # d loss / d LSE2 = d loss / d LSE * ln 2 (the kernels' LSE is in log2 units)
        grad_lse = None if dlse is None else (dlse.float() * _LN2).contiguous()
        launch_varlen_backward(q, k, v, out, dout, lse2, dq, dk, dv, cu_q, cu_k, sm_scale=ctx.scale, grad_lse=grad_lse,
                               **ctx.mods)
        return dq, dk, dv, None, None, None, None, None


def through_document_mask(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, score_mod: Optional[Callable],
                          mask_mod: Optional[Callable], scale: float, enable_gqa: bool) -> tuple[Tensor, Tensor]:
    """flex_varlen's (out, natural-log LSE) through ``fa3_inductor.flex`` over the packed tensors as one
    ``[1, H, T, D]`` batch with a document mask, which autograd differentiates with the backward families: where the
    packed backward does not serve (other GPUs, head dims it has no tiles for, mods' tensors that need gradients).
    The mods see what flex_varlen promises: ``b`` the sequence, ``q_idx`` / ``kv_idx`` positions within it.

    Example::

        >>> out, lse = through_document_mask(q, k, v, cu, cu, None, mods.causal, 0.125, False)   # doctest: +SKIP
    """
    from .api import flex

    def rows(cu: Tensor, total: int) -> tuple[Tensor, Tensor]:   # each token's sequence and position in it
        token = torch.arange(total, device=cu.device)
        seq = torch.searchsorted(cu[1:], token, right=True)
        return seq, token - cu[seq.clamp(max=cu.shape[0] - 2)]

    seq_q, pos_q = rows(cu_q, q.shape[0])
    seq_k, pos_k = rows(cu_k, k.shape[0])

    def packed_mask(b, h, q_idx, kv_idx):
        keep = seq_q[q_idx] == seq_k[kv_idx]
        if mask_mod is not None:
            keep = keep & mask_mod(seq_q[q_idx], h, pos_q[q_idx], pos_k[kv_idx])
        return keep

    def packed_score(score, b, h, q_idx, kv_idx):
        return score_mod(score, seq_q[q_idx], h, pos_q[q_idx], pos_k[kv_idx])

    out, lse = flex(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                    score_mod=packed_score if score_mod is not None else None, mask_mod=packed_mask, scale=scale,
                    enable_gqa=enable_gqa, return_lse=True)
    return out[0].transpose(0, 1), lse[0]
