"""The hopper_fp8 family behind the kernel-family interface (templates/family.py): int8 or e4m3 Q and K
(FP8Recipe.qk), e4m3 Vᵀ, with block scales from the FP8 prologue (templates/fp8_prologue/), computed by the
Gluon Hopper kernel (templates/hopper/fwd_sm90.py) with its Quant bundle on: warp specialization, pingpong,
K / Vᵀ rings, an s8 or e4m3 wgmma for QKᵀ and an e4m3 one for PV, P converted to e4m3 in registers. Mods in
the ``gl`` dialect.

It serves only sites planned with FP8 on (``SiteFacts.fp8``) on sm90, for the head dims of its tile table
(configs.py); other FP8 sites fall through to the ``fp8`` family (the generic Triton kernel), which it
precedes in the registry.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..family import NOT_MEANT_HERE, Call, NotServed, SiteFacts, Variants
from ..tma import tma_aligned
from .configs import (EXP_BOUND_HEAD_DIM, SUPPORTED_HEAD_DIMS, UNSERVED_TWO_LEVEL, describe as describe_tiles,
                      serves_fp8_head_dims)


class HopperFP8Family:
    """FP8 forward attention in the Hopper kernel (module docstring).

    Example::

        >>> HOPPER_FP8.serves(SiteFacts(torch.device("cpu"), torch.bfloat16, 128, 128, fp8=True))
        ''
        >>> HOPPER_FP8.name, HOPPER_FP8.dialect
        ('hopper_fp8', 'gl')
    """

    name = "hopper_fp8"
    dialect = "gl"

    def serves(self, site: SiteFacts) -> Optional[str]:
        if not site.fp8:
            return NOT_MEANT_HERE
        if site.capability is None or site.capability[0] != 9:
            return NOT_MEANT_HERE
        if site.sinks:   # the lowering applies them after an FP8 kernel (sink_combine), never in it
            return "Hopper FP8 template: the FP8 kernels do not add attention sinks"
        if site.head_dim != site.value_head_dim or site.head_dim not in SUPPORTED_HEAD_DIMS:
            dims = (f"head dim {site.head_dim}" if site.value_head_dim == site.head_dim else
                    f"q/k head dim {site.head_dim} with v head dim {site.value_head_dim}")
            return (f"Hopper FP8 template: no tiles for {dims} (it serves "
                    f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}, the same for q, k and v)")
        return None

    def describe(self, site: SiteFacts) -> str:
        """The explain() note: the tiles, and when FP8 cannot be faster than bf16.

        Example::

            >>> "no speed-up" in HopperFP8Family().describe(SiteFacts(torch.device("cuda"), torch.bfloat16, 64, 64))
            True
        """
        note = ""
        if site.head_dim in UNSERVED_TWO_LEVEL:
            note = " (two-level accumulation off only: FP8Recipe(two_level=0))"
        if site.head_dim <= EXP_BOUND_HEAD_DIM:
            note += (f"; at head dim {site.head_dim} the exponentials, not the GEMMs, bound the loop: expect no "
                     "speed-up over bf16 (docs/fp8.md, 'Head dim 64')")
        return f"Hopper FP8 template: {describe_tiles(site.head_dim)}{note}; schedule per launch"

    def prepare(self, call: Call) -> Optional[Variants]:
        from ..hopper.fwd_sm90 import prepare_fwd_sm90_variants

        ops = call.fp8_operands("the Hopper FP8 family")
        q, k, vt, out = ops.q, ops.k, ops.vt, call.out
        D, Dv = q.shape[-1], vt.shape[2]
        if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
            raise NotServed("the Hopper FP8 template runs on an sm90 GPU only")
        if not serves_fp8_head_dims(D, Dv, ops.recipe.two_level > 0):
            raise NotServed(f"Hopper FP8 template: no tiles for head dims {D} / {Dv} with two_level="
                            f"{ops.recipe.two_level} (D={UNSERVED_TWO_LEVEL} needs FP8Recipe(two_level=0): its "
                            "second O accumulator does not fit the registers)")
        if not all(tma_aligned(t) for t in (q, k, vt, out)):
            raise NotServed(f"Hopper FP8 template: q{tuple(q.shape)}, k{tuple(k.shape)}, vt{tuple(vt.shape)} or out "
                            f"strides {out.stride()} are not 16-byte aligned for TMA")
        try:
            return prepare_fwd_sm90_variants(q, k, vt, *call.outputs(), max_needed=call.needs_max, fp8=ops,
                                             **call.kernel_options(self.dialect))
        except ValueError as exc:   # tiles against scale blocks or block-mask blocks, dtypes: the message says
            raise NotServed(str(exc)) from exc

    def launch(self, call: Call) -> None:
        raise NotServed("the Hopper FP8 template runs on an sm90 GPU only")


FAMILY = HopperFP8Family()
HOPPER_FP8 = FAMILY
