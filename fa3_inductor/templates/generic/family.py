"""The generic family behind the kernel-family interface (templates/family.py): plain Triton, any CUDA
GPU and the CPU under Triton's interpreter; mods in the ``tl`` dialect."""

from __future__ import annotations

from typing import Optional

import torch

from ..._log import info_once
from ..family import NOT_MEANT_HERE, Call, NotServed, SiteFacts, Variants
from .host import launch_generic, prepare_generic_variants

# Input dtypes the CPU interpreter cannot compute a dot in (computed in float32 instead).
_INTERPRETER_UPCAST = (torch.bfloat16,)


class GenericFamily:
    """The Triton forward every device runs (tile table: configs.py).

    Example::

        >>> GENERIC.serves(SiteFacts(torch.device("cpu"), torch.bfloat16, 128, 128)) is None
        True
    """

    name = "generic"
    dialect = "tl"

    def serves(self, site: SiteFacts) -> Optional[str]:
        if site.fp8:
            return NOT_MEANT_HERE   # FP8 operands go to the fp8 family (same kernel, Quant bundle on)
        return None   # the planner has checked dtype, head dims and the interpreter (lowering/site_plan.py)

    def describe(self, site: SiteFacts) -> str:
        return ""

    def prepare(self, call: Call) -> Optional[Variants]:
        if not call.q.is_cuda:
            from triton import knobs

            if not knobs.runtime.interpret:
                raise NotServed("the generic template got CPU tensors but Triton's interpreter is off "
                                "(set TRITON_INTERPRET=1 before importing triton to run it on the CPU)")
            return None   # the interpreter runs it now: launch()
        return prepare_generic_variants(call.q, call.k, call.v, *call.outputs(), **call.kernel_options(self.dialect))

    def launch(self, call: Call) -> None:
        """Under Triton's interpreter (CPU tensors)."""
        info_once("fa3_inductor: running the generic template under the Triton interpreter (CPU)")
        q, k, v, out = call.q, call.k, call.v, call.out
        if q.dtype in _INTERPRETER_UPCAST:
            # Triton 3.6's interpreter computes tl.dot on bfloat16 wrongly (relative error ~1e9,
            # fp16/fp32 right): run the kernel on float32 copies, hand back the caller's dtype.
            q, k, v = q.float(), k.float(), v.float()
            out = torch.empty_like(call.out, dtype=torch.float32)
        launch_generic(q, k, v, out, call.lse, call.max_scores, **call.kernel_options(self.dialect))
        if out is not call.out:
            call.out.copy_(out)


FAMILY = GenericFamily()
GENERIC = FAMILY
