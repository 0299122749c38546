"""The Hopper family behind the kernel-family interface (templates/family.py): sm90 GPUs, float16 and
bfloat16, the head dims its tile table (configs.py) has tiles for; mods in the ``gl`` dialect."""

from __future__ import annotations

from typing import Optional

import torch

from ..family import NOT_MEANT_HERE, Call, NotServed, SiteFacts, Variants
from .configs import describe as describe_tiles
from .configs import served_head_dims_text, serves_head_dims
from .fwd_sm90 import prepare_fwd_sm90_variants, supports_sm90


class HopperFamily:
    """FlashAttention-3-structure Gluon forward for sm90.

    Example::

        >>> HOPPER.serves(SiteFacts(torch.device("cpu"), torch.bfloat16, 128, 128))
        ''
    """

    name = "hopper"
    dialect = "gl"

    def serves(self, site: SiteFacts) -> Optional[str]:
        if site.capability is None or site.capability[0] != 9:
            return NOT_MEANT_HERE
        if site.fp8:
            return "Hopper template: bf16/fp16 only (FP8 runs in the fp8 family's Triton kernel)"
        if site.dtype == torch.float32:
            return "Hopper template: float32 inputs (it serves float16 and bfloat16)"
        if not serves_head_dims(site.head_dim, site.value_head_dim):
            dims = (f"head dim {site.head_dim}" if site.value_head_dim == site.head_dim else
                    f"q/k head dim {site.head_dim} with v head dim {site.value_head_dim}")
            return f"Hopper template: no tiles for {dims} (it serves {served_head_dims_text()})"
        return None

    def describe(self, site: SiteFacts) -> str:
        tiles = describe_tiles(site.head_dim, site.dtype, value_head_dim=site.value_head_dim)
        return f"Hopper template: {tiles}; schedule per launch"

    def prepare(self, call: Call) -> Optional[Variants]:
        if not supports_sm90(call.q, call.k, call.v, call.out, kv_num_blocks=call.tables[0],
                             sparse_q_block=call.sparse_q_block, sparse_kv_block=call.sparse_kv_block):
            raise NotServed(f"Hopper template cannot serve q{tuple(call.q.shape)} k{tuple(call.k.shape)} "
                            f"strides {call.q.stride()} with block-mask blocks "
                            f"{call.sparse_q_block}x{call.sparse_kv_block}")
        return prepare_fwd_sm90_variants(call.q, call.k, call.v, *call.outputs(), max_needed=call.needs_max,
                                         **call.kernel_options(self.dialect))

    def launch(self, call: Call) -> None:
        raise NotServed("the Hopper template runs on an sm90 GPU only")


FAMILY = HopperFamily()
HOPPER = FAMILY
