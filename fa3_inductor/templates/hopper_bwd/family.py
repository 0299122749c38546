"""The Hopper backward behind the backward-family interface (templates/family.py): sm90 GPUs, float16
and bfloat16, the (q/k, v) head dims of configs.SUPPORTED_HEAD_DIM_PAIRS (64 / 128 by bwd_sm90.py, 80 / 96 in its
128 tiles, 192 / 128 and 256 by bwd_sm90_wide.py, 160 / 192 in its 256 tiles, 192 / 128 without a mask on
bwd_sm90_k96.py's 96-key tiles); mods in the ``gl`` dialect. dQ is
summed with fp32 reduce-adds (TMA), by default in arrival order, which is not bitwise reproducible: a site that asks for
deterministic gradients is served with its dQ adds in a fixed order (bwd_sm90.py, "Deterministic dQ"; the wide
head dims on bwd_sm90_wide.py's grid, never the 96-key tiles). One that needs
gradients of captured tensors (not computed here yet) goes to torch's kernel (the generic backward when it is also
deterministic)."""

from __future__ import annotations

from typing import Optional

import torch

from ..family import NOT_MEANT_HERE, BackwardCall, BackwardSiteFacts, Launch, NotServed
from ..generic_bwd.host import SCORE_GRAD_ONE
from .configs import SUPPORTED_HEAD_DIM_PAIRS
from .host import hopper_backward_scratch, mask_shape_of, prepare_hopper_backward


# Measured on an H100, backward alone, B4 H16 N4096, dQ by TMA reduce-add (benchmarks/results/bwd-speed-nvidia-
# h100-80gb-hbm3-2026-11-25-0615): ours is faster than torch's flex backward kernel in every row, D128 noop 3.13
# against 3.42 ms, causal 1.69 / 1.96, ALiBi 3.02 / 3.64, softcap 3.46 / 6.70; D64 noop 2.07 / 2.33. (With dQ by
# atomics, -0315, torch's was faster at D128 without a score_mod derivative, and served those sites.)


class HopperBackwardFamily:
    """FlashAttention-3-structure Gluon backward for sm90 (kernels: bwd_sm90.py).

    Example::

        >>> HOPPER_BWD.serves_backward(BackwardSiteFacts(torch.device("cpu"), torch.bfloat16, 128, 128))
        ''
    """

    name = "hopper_bwd"
    dialect = "gl"

    def serves_backward(self, site: BackwardSiteFacts) -> Optional[str]:
        if site.capability is None or site.capability[0] != 9 or site.fp8:
            return NOT_MEANT_HERE
        if site.dtype not in (torch.float16, torch.bfloat16):
            return f"Hopper backward: {site.dtype} inputs (it serves float16 and bfloat16)"
        if (site.head_dim, site.value_head_dim) not in SUPPORTED_HEAD_DIM_PAIRS:
            return (f"Hopper backward: head dims {site.head_dim}/{site.value_head_dim} (it serves "
                    f"{', '.join(f'{d}/{dv}' for d, dv in SUPPORTED_HEAD_DIM_PAIRS)})")
        if site.buffer_grads:
            return "Hopper backward: gradients of captured tensors not computed here yet"
        return None

    def prepare_backward(self, call: BackwardCall) -> Optional[list[Launch]]:
        if not call.q.is_cuda:
            raise NotServed("the Hopper backward runs on an sm90 GPU only")
        options = call.kernel_options(self.dialect, SCORE_GRAD_ONE)
        if options.pop("buffer_grads", None):
            raise NotServed("the Hopper backward does not compute gradients of captured tensors")
        options["deterministic"] = call.deterministic
        try:
            return prepare_hopper_backward(*call.tensors(), scratch=call.scratch, **options)
        except ValueError as exc:   # a layout, head dim or block size it does not take: the next family runs
            raise NotServed(str(exc)) from exc

    def backward_scratch(self, call: BackwardCall) -> tuple[torch.Tensor, ...]:
        """(STATS, DQ_ACC), and with ``call.deterministic`` (DQ_SEMS, DQ_RANK), for ``call``
        (host.hopper_backward_scratch)."""
        try:
            return hopper_backward_scratch(call.q, has_mask=_masked(call), sparse_q_block=call.sparse_q_block,
                                           deterministic=call.deterministic,
                                           mask_shape=mask_shape_of(*call.tables[:2], *call.q_tables[:2]))
        except ValueError as exc:   # a head dim it does not take: the next family runs
            raise NotServed(str(exc)) from exc

    def launch_backward(self, call: BackwardCall) -> None:
        raise NotServed("the Hopper backward runs on an sm90 GPU only")


def _masked(call: BackwardCall) -> bool:
    """Whether ``call`` passes block-mask tables (forward or transposed)."""
    return call.tables[0] is not None or call.q_tables[0] is not None


FAMILY = HopperBackwardFamily()
HOPPER_BWD = FAMILY
