"""torch's own kernel as the last-resort family (templates/family.py): dense torch ops with the
mods in the ``torch`` dialect (templates/modgen_torch.py). It serves every site; the runtime records
why whenever it runs (a preferred family failed to build, or could not serve the call)."""

from __future__ import annotations

from typing import Optional

from ..family import Call, SiteFacts, Variants
from .dense import dense_forward


class TorchFamily:
    """A correctness path, not a fast one: one float32 score tensor per batch entry and head slice.

    Example::

        >>> TORCH.serves(SiteFacts(torch.device("cpu"), torch.float64, 8, 8)) is None   # doctest: +SKIP
        True
    """

    name = "torch"
    dialect = "torch"

    def serves(self, site: SiteFacts) -> Optional[str]:
        return None

    def describe(self, site: SiteFacts) -> str:
        return "torch ops, dense (the last resort)"

    def prepare(self, call: Call) -> Optional[Variants]:
        return None   # computed in launch(): no kernel to compile

    def launch(self, call: Call) -> None:
        q, k, v = call.q, call.k, call.v
        if call.fp8 is not None:
            # FP8 operands (RoPE and the rotation applied, QK^T unchanged): attention on their
            # dequantized values, so the last resort keeps the quantization's numbers.
            from ..fp8_prologue.reference import dequantize

            q, k, v = (t.to(call.out.dtype) for t in dequantize(call.fp8))
        out, lse, row_max = dense_forward(q, k, v, call.tables, list(call.score_bufs),
                                          list(call.mask_bufs), call.scale, call.sparse_q_block,
                                          call.sparse_kv_block, call.score_source, call.mask_source,
                                          call.sinks)
        call.out.copy_(out)
        call.lse.copy_(lse)
        call.max_scores.copy_(row_max)


FAMILY = TorchFamily()
TORCH = FAMILY
