"""Float64 reference attention and the project's tolerance rule (README, "Tolerance rule")."""

from __future__ import annotations

import copy
import math
from typing import Callable, Optional, Sequence

import torch

# Relative error ||out - ref|| / ||ref|| allowed per input dtype, against float64.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# flex(fp8=...) against float64 on the dequantized operands: P's e4m3 rounding stays in the output.
FP8_TOLERANCE = 1e-1


def reference_attention(q, k, v, score_mod: Optional[Callable] = None,
                        mask_mod: Optional[Callable] = None, scale: Optional[float] = None,
                        precision: torch.dtype = torch.float64):
    """Dense attention in float64 with FlexAttention semantics; returns (out, lse_natural).

    Mods are called once on broadcast index tensors (b: [B,1,1,1], h: [1,H,1,1],
    q_idx: [1,1,M,1], kv_idx: [1,1,1,N]). Fully masked rows give out 0 and lse -inf.
    ``precision``: the same computation in another float dtype (benchmarks/mod_fuzz.py compares
    against float32's own error).
    """
    q, k, v = q.to(precision), k.to(precision), v.to(precision)
    B, H, M, D = q.shape
    if k.shape[1] != H:
        k = k.repeat_interleave(H // k.shape[1], dim=1)
        v = v.repeat_interleave(H // v.shape[1], dim=1)
    N = k.shape[2]
    dev = q.device
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h = torch.arange(H, device=dev).view(1, H, 1, 1)
    qi = torch.arange(M, device=dev).view(1, 1, M, 1)
    ki = torch.arange(N, device=dev).view(1, 1, 1, N)
    s = q @ k.transpose(-2, -1) * (scale if scale is not None else 1.0 / math.sqrt(D))
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki).to(precision)
    if mask_mod is not None:
        keep = mask_mod(b, h, qi, ki).expand(B, H, M, N)
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(lse.isinf(), 0.0, lse).unsqueeze(-1))
    return p @ v, lse


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


def compiled_and_float64(module: torch.nn.Module, inputs: Sequence[torch.Tensor],
                         dout: torch.Tensor, backend: str = "fa3"):
    """``module`` compiled with ``backend`` (fullgraph) and a float64 copy run eagerly on the
    same ``inputs``, each backward with ``dout``; returns (out, ref, inputs64, module64). Float
    inputs get float64 leaf copies (requiring grad where the input does), others pass as given.

    Example::

        >>> out, ref, (x64,), model64 = compiled_and_float64(model, [x], dout)   # doctest: +SKIP
        >>> rel_error(x.grad, x64.grad) <= TOLERANCE[torch.float32]            # doctest: +SKIP
    """
    module64 = copy.deepcopy(module).double()
    inputs64 = [t.detach().double().requires_grad_(t.requires_grad) if t.is_floating_point()
                else t for t in inputs]
    ref = module64(*inputs64)
    ref.backward(dout.double())
    out = torch.compile(module, backend=backend, fullgraph=True)(*inputs)
    out.backward(dout)
    return out, ref, inputs64, module64


def assert_matches_reference(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
                             what: str = "output") -> float:
    """Apply the tolerance rule; returns the relative error."""
    err = rel_error(out, ref)
    tol = TOLERANCE[dtype]
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e} for {dtype}"
    return err


def assert_lse_matches(lse: torch.Tensor, ref_lse: torch.Tensor, dtype: torch.dtype) -> None:
    """LSE (natural log): -inf exactly where the reference is -inf, else close."""
    lse, ref_lse = lse.double(), ref_lse.double()
    assert torch.equal(lse.isneginf(), ref_lse.isneginf()), "fully masked rows differ"
    finite = ~ref_lse.isinf()
    if finite.any():
        err = (lse[finite] - ref_lse[finite]).abs().max().item()
        assert err <= 50 * TOLERANCE[dtype], f"lse max abs error {err:.3e}"


def reference_gradients(q, k, v, grad_out, score_mod: Optional[Callable] = None,
                        mask_mod: Optional[Callable] = None, scale: Optional[float] = None,
                        captured: tuple = (), make_score_mod: Optional[Callable] = None):
    """Float64 autograd through :func:`reference_attention`: (out, dq, dk, dv, d_captured).

    ``captured`` are learnable tensors a score_mod reads (e.g. a bias table); pass
    ``make_score_mod(*captured64)`` returning the score_mod over float64 copies of them, so
    their gradients (the list d_captured, in order) are taken in float64 too.

    Example::

        >>> out, dq, dk, dv, (dtable,) = reference_gradients(
        ...     q, k, v, dout, captured=(table,),
        ...     make_score_mod=lambda t: lambda s, b, h, qi, ki: s + t[h, qi - ki + 64],
        ... )  # doctest: +SKIP
    """
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    extra = [t.detach().double().requires_grad_() for t in captured]
    if make_score_mod is not None:
        score_mod = make_score_mod(*extra)
    out, _ = reference_attention(*leaves, score_mod=score_mod, mask_mod=mask_mod, scale=scale)
    grads = torch.autograd.grad(out, leaves + extra, grad_out.double(), allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves + extra)]
    return out.detach(), grads[0], grads[1], grads[2], grads[3:]


def op_names():
    """A TorchDispatchMode that lists the names of the torch ops dispatched under it (``.names``):
    what a call runs beside its kernels (each a launch on CUDA).

    Example::

        >>> with op_names() as seen:
        ...     torch.zeros(2).abs_()
        >>> seen.names
        ['zeros', 'abs_']
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpNames(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    return OpNames()
