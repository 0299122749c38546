"""``torch.ops.fa3_inductor.flex_bwd``: flex attention's backward by dense recompute.

Inductor's flex_attention_backward lowering has no CPU kernel, and torch's FlexAttention
refuses backward on the CPU. Under the fa3 backend the backward lowering
(lowering/flex_backward_lowering.py) emits one extern call to this op there. It recomputes the
attention of one site in float64 under autograd and differentiates it:

    S = (Q Kᵀ)·scale → score_mod → masked (mask_mod on listed partial blocks, full blocks kept,
    unlisted blocks dropped: the forward kernels' semantics) → P = softmax(S) → O = P V
    loss = Σ O·dO + Σ LSE₂·dLSE₂           (LSE₂ = LSE / ln 2: the op's LSE is in log2 units)

so it returns dQ, dK, dV and the gradients of the score_mod's captured buffers (learnable bias
tables) that need one. GQA and a broadcast KV batch are summed back by autograd; fully masked
rows get gradient 0, as torch's flex backward gives. Memory is one [H, M, N] score tensor per
batch entry (the loop runs over the batch); this is the correctness path for CPUs, not a
fast kernel.

The mods arrive as torch-dialect source in the ``spec`` string (templates/modgen_torch.py),
so a graph served from Inductor's FX cache in a fresh process rebuilds them from text.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Callable, Optional

import torch
from torch import Tensor

from ..templates.modgen_torch import load_torch_mod
from ..templates.torch_dense.dense import index_tensors as _index_tensors
from ..templates.torch_dense.dense import keep_scores as _keep

_LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class BackwardSpec:
    """One backward site: torch-dialect mod sources (None = no mod) and, per captured tensor
    buffer of the score_mod (scalars excluded), whether it gets a gradient.

    Example::

        >>> BackwardSpec.from_json(BackwardSpec(None, None, (True,)).to_json()).buffer_grads
        (True,)
    """

    score_source: Optional[str]
    mask_source: Optional[str]
    buffer_grads: tuple[bool, ...] = ()
    description: str = ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def from_json(text: str) -> "BackwardSpec":
        fields = json.loads(text)
        fields["buffer_grads"] = tuple(fields.get("buffer_grads", ()))
        return BackwardSpec(**fields)


_LIB = torch.library.Library("fa3_inductor", "FRAGMENT")
_LIB.define(
    "flex_bwd(Tensor q, Tensor k, Tensor v, Tensor? grad_out, Tensor? grad_lse, "
    "Tensor? kv_num_blocks, Tensor? kv_indices, Tensor? full_kv_num_blocks, "
    "Tensor? full_kv_indices, Tensor[] score_bufs, Tensor[] mask_bufs, float scale, "
    "int sparse_q_block, int sparse_kv_block, str spec) -> (Tensor, Tensor, Tensor, Tensor[])")


def _loss_of_batch_entry(b0: int, q: Tensor, k: Tensor, v: Tensor, grad_out: Optional[Tensor],
                         grad_lse: Optional[Tensor], score_fn: Optional[Callable],
                         mask_fn: Optional[Callable], bufs: list[Tensor],
                         mask_bufs: list[Tensor], tables: tuple, scale: float,
                         sparse_q_block: int, sparse_kv_block: int) -> Tensor:
    """Σ O·dO + Σ LSE₂·dLSE₂ of batch entry ``b0``, differentiable in q, k, v and bufs."""
    _, Hq, M, _ = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    kb, vb = (t[0 if t.shape[0] == 1 else b0] for t in (k, v))
    if Hq != Hkv:
        kb, vb = (t.repeat_interleave(Hq // Hkv, dim=0) for t in (kb, vb))
    b, h, q_idx, kv_idx = _index_tensors(b0, Hq, M, N, q.device)
    scores = (q[b0] @ kb.transpose(-2, -1) * scale).unsqueeze(0)  # [1, H, M, N]
    if score_fn is not None:  # its result may broadcast (e.g. a bias built from indices only)
        scores = torch.broadcast_to(score_fn(scores, b, h, q_idx, kv_idx, bufs).to(scores.dtype),
                                    scores.shape)
    keep = _keep(mask_fn, mask_bufs, tables, b, h, q_idx, kv_idx, sparse_q_block,
                 sparse_kv_block).expand_as(scores)
    scores = scores.masked_fill(~keep, float("-inf"))
    live = keep.any(dim=-1, keepdim=True)
    scores = torch.where(live, scores, 0.0)  # a fully masked row: no NaN, zeroed below
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse) * live
    loss = scores.new_zeros(())
    if grad_out is not None:
        out = probs[0] @ vb
        loss = loss + (out * grad_out[b0].to(out.dtype)).sum()
    if grad_lse is not None:
        lse2 = torch.where(live, lse, 0.0)[0, ..., 0] / _LN2
        loss = loss + (lse2 * grad_lse[b0].to(lse2.dtype)).sum()
    return loss


def flex_bwd(q: Tensor, k: Tensor, v: Tensor, grad_out: Optional[Tensor],
             grad_lse: Optional[Tensor], kv_num_blocks: Optional[Tensor],
             kv_indices: Optional[Tensor], full_kv_num_blocks: Optional[Tensor],
             full_kv_indices: Optional[Tensor], score_bufs: list[Tensor],
             mask_bufs: list[Tensor], scale: float, sparse_q_block: int, sparse_kv_block: int,
             spec: str) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """Gradients of one flex attention site: (dq, dk, dv, [d buffer for each buffer whose
    ``buffer_grads`` entry in ``spec`` is true]). ``grad_lse`` is in log2 units, as the
    flex_attention op's LSE.

    Example::

        >>> dq, dk, dv, dbufs = torch.ops.fa3_inductor.flex_bwd(
        ...     q, k, v, dout, None, None, None, None, None, [], [], 0.25, 128, 128,
        ...     BackwardSpec(None, None).to_json())   # doctest: +SKIP
    """
    site = BackwardSpec.from_json(spec)
    tensor_bufs = list(score_bufs)
    if len(site.buffer_grads) != len(tensor_bufs):
        raise RuntimeError(
            f"fa3_inductor::flex_bwd: spec lists {len(site.buffer_grads)} score_mod buffers, "
            f"the call passed {len(tensor_bufs)}; the spec and the call come from one "
            "lowering, so this is a bug: report it with the graph")
    score_fn = load_torch_mod(site.score_source) if site.score_source else None
    mask_fn = load_torch_mod(site.mask_source) if site.mask_source else None
    tables = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    # float64 throughout: the gradients come back rounded once to the inputs' dtype, so they do not
    # depend on which CPU BLAS kernel ran (a graph served from Inductor's cache in a fresh process
    # once gave float32 gradients differing by up to 6e-5 from the lowering process's)
    with torch.enable_grad():
        qf, kf, vf = (t.detach().double().requires_grad_() for t in (q, k, v))
        bufs = [t.detach().double().requires_grad_() if needs else t
                for t, needs in zip(tensor_bufs, site.buffer_grads)]
        leaves = [qf, kf, vf] + [t for t, needs in zip(bufs, site.buffer_grads) if needs]
        grads = [torch.zeros_like(t) for t in leaves]
        if grad_out is not None or grad_lse is not None:
            for b0 in range(q.shape[0]):
                loss = _loss_of_batch_entry(b0, qf, kf, vf, grad_out, grad_lse, score_fn,
                                            mask_fn, bufs, list(mask_bufs), tables, scale,
                                            sparse_q_block, sparse_kv_block)
                step = torch.autograd.grad(loss, leaves, allow_unused=True)
                grads = [g if s is None else g + s for g, s in zip(grads, step)]
    dq, dk, dv = (g.to(t.dtype).contiguous() for g, t in zip(grads[:3], (q, k, v)))
    needing = [t for t, needs in zip(tensor_bufs, site.buffer_grads) if needs]
    dbufs = [g.to(t.dtype).contiguous() for g, t in zip(grads[3:], needing)]
    return dq, dk, dv, dbufs


_LIB.impl("flex_bwd", flex_bwd, "CPU")
_LIB.impl("flex_bwd", flex_bwd, "CUDA")  # on CUDA only for sites neither torch's lowering nor a family takes


@torch.library.register_fake("fa3_inductor::flex_bwd", lib=_LIB)
def _flex_bwd_fake(q, k, v, grad_out, grad_lse, kv_num_blocks, kv_indices, full_kv_num_blocks,
                   full_kv_indices, score_bufs, mask_bufs, scale, sparse_q_block,
                   sparse_kv_block, spec):
    site = BackwardSpec.from_json(spec)
    needing = [t for t, needs in zip(score_bufs, site.buffer_grads) if needs]
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            [t.new_empty(t.shape) for t in needing])
