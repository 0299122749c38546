"""The FP8 family behind the kernel-family interface (templates/family.py): int8 or e4m3 Q and K,
e4m3 Vᵀ, with block scales from the prologue (templates/fp8_prologue/), computed by the generic Triton kernel with
its Quant bundle on (templates/generic/kernel.py), mods in the ``tl`` dialect.

It serves only sites planned with FP8 on (``SiteFacts.fp8``), on GPUs with FP8 tensor cores (sm89
and newer) and under Triton's interpreter. On sm90 the Gluon kernel's FP8 mode (templates/hopper_fp8/,
first in the registry) is the fast path; this one is the portable one and its fallback.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..family import NOT_MEANT_HERE, Call, NotServed, SiteFacts, Variants
from ..generic.host import launch_generic, prepare_generic_variants
from .configs import fp8_config

FP8_MIN_CAPABILITY = (8, 9)   # Ada and Hopper have e4m3 tensor-core MMA


class FP8Family:
    """FP8 forward attention (module docstring).

    Example::

        >>> FP8.serves(SiteFacts(torch.device("cpu"), torch.bfloat16, 128, 128, fp8=True)) is None
        True
        >>> FP8.serves(SiteFacts(torch.device("cpu"), torch.bfloat16, 128, 128))
        ''
    """

    name = "fp8"
    dialect = "tl"

    def serves(self, site: SiteFacts) -> Optional[str]:
        if not site.fp8:
            return NOT_MEANT_HERE
        if site.sinks:
            return "the FP8 kernels do not add attention sinks"
        cap = site.capability
        if cap is not None and cap < FP8_MIN_CAPABILITY:
            return f"FP8 needs e4m3 tensor cores (sm89 or newer); this GPU is sm{cap[0]}{cap[1]}"
        return None

    def describe(self, site: SiteFacts) -> str:
        return "FP8 (Triton kernel; prologue: Hadamard, block scales, int8 or e4m3 Q/K, e4m3 V)"

    def prepare(self, call: Call) -> Optional[Variants]:
        ops = call.fp8_operands("the FP8 family")
        if not ops.q.is_cuda:
            from triton import knobs

            if not knobs.runtime.interpret:
                raise NotServed("the FP8 family got CPU tensors but Triton's interpreter is off "
                                "(set TRITON_INTERPRET=1 before importing triton to run it on the CPU)")
            return None   # the interpreter runs it now: launch()
        return prepare_generic_variants(ops.q, ops.k, ops.vt, *call.outputs(), fp8=ops,
                                        config=_config(ops), **call.kernel_options(self.dialect))

    def launch(self, call: Call) -> None:
        """Under Triton's interpreter (CPU tensors)."""
        ops = call.fp8_operands("the FP8 family")
        launch_generic(ops.q, ops.k, ops.vt, *call.outputs(), fp8=ops, config=_config(ops),
                       **call.kernel_options(self.dialect))


def _config(ops):
    cap = torch.cuda.get_device_capability(ops.q.device) if ops.q.is_cuda else None
    return fp8_config(max(ops.q.shape[-1], ops.vt.shape[2]), cap)


FAMILY = FP8Family()
FP8 = FAMILY
