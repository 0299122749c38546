"""The generic backward behind the backward-family interface (templates/family.py): plain Triton,
any CUDA GPU and the CPU under Triton's interpreter; mods in the ``tl`` dialect. It computes the
gradients of tensors a score_mod captures too (buffer_grad.py: the call's ``buffer_grad_sources``
into its ``dbufs``). dq, dk, dv are deterministic (every element has one writer, dQ in its own
query-major pass, docs/design/backward.md); captured-tensor gradients are summed with atomics,
unless the call is ``deterministic`` (the host's entry-and-sort mode), so it serves
``deterministic`` sites too."""

from __future__ import annotations

from typing import Optional

import torch

from ..._log import info_once
from ..family import NOT_MEANT_HERE, BackwardCall, BackwardSiteFacts, Launch, NotServed
from .host import SCORE_GRAD_ONE, generic_backward_scratch, launch_generic_backward, prepare_generic_backward

# Input dtypes Triton 3.6's interpreter cannot compute a dot in (run on float32 copies).
_INTERPRETER_UPCAST = (torch.bfloat16,)


def _interpreting() -> bool:
    from triton import knobs

    return bool(knobs.runtime.interpret)


# Measured on an H100 (benchmarks/results/bwd-speed-nvidia-h100-80gb-hbm3-2026-11-25-0315): its
# separate dQ pass costs more than torch's kernel saves elsewhere. It serves CUDA sites that ask for
# bitwise-reproducible gradients, which torch's kernel does not promise.
_SLOWER_THAN_TORCH = ("torch's flex backward kernel is faster on CUDA GPUs (H100, B8 H16 N2048: 1.87 against "
                      "2.75 ms at D128, 1.37 against 1.88 at D64); the generic backward serves CUDA sites "
                      "with fa3.deterministic_backward, score_mods whose values may be huge, and sites "
                      "torch's backward lowering cannot take")


class GenericBackwardFamily:
    """The Triton backward every device runs (kernels: kernel.py, tiles: configs.py).

    Example::

        >>> GENERIC_BWD.serves_backward(BackwardSiteFacts(torch.device("cuda"), torch.bfloat16, 64, 64,
        ...                                               buffer_grads=True, deterministic=True))
        >>> GENERIC_BWD.serves_backward(BackwardSiteFacts(torch.device("cuda"), torch.bfloat16, 128, 128))[:41]
        "torch's flex backward kernel is faster on"
    """

    name = "generic_bwd"
    dialect = "tl"

    def serves_backward(self, site: BackwardSiteFacts) -> Optional[str]:
        if site.fp8:
            return NOT_MEANT_HERE   # FP8 sites are inference-only
        if site.device.type == "cpu" and not _interpreting():
            return ("CPU tensors and Triton's interpreter is off (TRITON_INTERPRET=1 runs the generic "
                    "backward on the CPU)")
        if site.device.type == "cuda" and not (site.deterministic or site.wide_scores or site.torch_refuses):
            return _SLOWER_THAN_TORCH
        return None   # dtype and head dims: the planner's shared check (lowering/site_plan.unserved)

    def prepare_backward(self, call: BackwardCall) -> Optional[list[Launch]]:
        if not call.q.is_cuda:
            if not _interpreting():
                raise NotServed("the generic backward got CPU tensors but Triton's interpreter is off "
                                "(set TRITON_INTERPRET=1 before importing triton to run it on the CPU)")
            return None   # the interpreter runs it now: launch_backward()
        try:
            return prepare_generic_backward(*call.tensors(), scratch=call.scratch,
                                            **call.kernel_options(self.dialect, SCORE_GRAD_ONE))
        except ValueError as exc:   # a layout or block size the kernels do not take: the next family runs
            raise NotServed(str(exc)) from exc

    def backward_scratch(self, call: BackwardCall) -> tuple[torch.Tensor, ...]:
        """(DELTA,) for ``call`` (host.generic_backward_scratch)."""
        return generic_backward_scratch(call.q)

    def launch_backward(self, call: BackwardCall) -> None:
        """Under Triton's interpreter (CPU tensors)."""
        info_once("fa3_inductor: running the generic backward under the Triton interpreter (CPU)")
        q, k, v, out, dout, lse, dq, dk, dv = call.tensors()
        if q.dtype in _INTERPRETER_UPCAST:
            # Triton 3.6's interpreter computes tl.dot on bfloat16 wrongly: float32 copies in, the
            # gradients copied back in the caller's dtype.
            q, k, v, out, dout = (t.float() for t in (q, k, v, out, dout))
            dq, dk, dv = (torch.empty_like(t, dtype=torch.float32) for t in (dq, dk, dv))
        try:
            launch_generic_backward(q, k, v, out, dout, lse, dq, dk, dv,
                                    **call.kernel_options(self.dialect, SCORE_GRAD_ONE))
        except ValueError as exc:
            raise NotServed(str(exc)) from exc
        for mine, theirs in ((dq, call.dq), (dk, call.dk), (dv, call.dv)):
            if mine is not theirs:
                theirs.copy_(mine)


FAMILY = GenericBackwardFamily()
GENERIC_BWD = FAMILY
