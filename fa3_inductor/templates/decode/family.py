"""The decode family behind the kernel-family interface (templates/family.py): short queries
against a long cache, split-KV with GQA packing (kernel.py), plain Triton on any CUDA GPU and the
CPU interpreter; mods in the ``tl`` dialect.

It takes a site when the planner knows the query is short (shape.py: GQA group x query length
<= 128 packed rows) and no one reads the row max (flex_attention's max_scores; the kernel does
not write it). FlexAttention's semantics: ``q_idx`` counts from 0, every key of k is visible
unless a mod or the block mask hides it. A BlockMask's tables steer the KV walk (host.py's
sparsity modes); the tables of a call whose rows would need different table rows (a per-head mask
under GQA, several query blocks) are refused per call (NotServed) and the next family runs.

One launch per call (the split kernel; its last split per program row merges the splits), but
with per-call scratch (the partials, the stream's arrival counters) that the op's launch cache
(runtime/fast_launch.py, through ``prepare``) does not allocate: ``prepare`` returns None and
``launch`` records the launch per launch signature itself (launch_cache.py). ``relauncher`` hands
the op that recording, so a later call of the same launch key skips the family walk and the
planning (runtime/ops.py; flex()'s call memo too, direct.py).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import triton

from ..._log import info_once
from ...runtime.fast_launch import aliasing, tensor_signature
from ..family import NOT_MEANT_HERE, Call, NotServed, SiteFacts, Variants
from .configs import decode_config, tma_tiles
from .host import prepare_decode
from .launch_cache import launch_decode, recorded_decode
from .shape import MAX_ROWS, decode_fit

# Input dtypes the CPU interpreter cannot compute a dot in (computed in float32 instead).
_INTERPRETER_UPCAST = (torch.bfloat16,)


class DecodeFamily:
    """Split-KV decode for short queries (docs/design/decode.md).

    Example::

        >>> site = SiteFacts(torch.device("cpu"), torch.float16, 128, 128, query_len=1, q_heads=32,
        ...                  kv_heads=8, needs_max=False)
        >>> DECODE.serves(site) is None
        True
        >>> DECODE.serves(SiteFacts(torch.device("cpu"), torch.float16, 128, 128, query_len=4096))
        ''
    """

    name = "decode"
    dialect = "tl"

    def serves(self, site: SiteFacts) -> Optional[str]:
        if site.fp8:
            return NOT_MEANT_HERE   # FP8 operands: the FP8 families (an FP8 KV cache is left)
        fit = decode_fit(site.query_len, site.q_heads, site.kv_heads)
        if fit == "long":
            return NOT_MEANT_HERE   # prefill-shaped, or a length only known at run time
        if site.sinks:
            return "decode: attention sinks are not added by its split merge"
        group = site.q_heads // site.kv_heads
        if fit == "too_many_rows":
            return (f"decode: {group} query heads per kv head x {site.query_len} tokens = "
                    f"{group * site.query_len} packed rows (> {MAX_ROWS})")
        if site.needs_max:
            return "decode: the row max (flex_attention's max_scores) is read; the decode kernel does not write it"
        return None

    def describe(self, site: SiteFacts) -> str:
        group = site.q_heads // max(site.kv_heads, 1)
        text = (f"decode: {group} query heads x {site.query_len} tokens packed per kv head, "
                "split-KV, the last split merging")
        head_dim, capability = max(site.head_dim, site.value_head_dim), site.capability
        rows = max(16, triton.next_power_of_2(group * (site.query_len or 1)))
        if capability is not None and tma_tiles(decode_config(head_dim, capability, block_m=rows), head_dim, group,
                                                rows, capability, False, site.dtype.itemsize == 2) is not None:
            text += "; K / V by TMA in 256-key tiles (GQA D64 on sm90)"
        return text

    def prepare(self, call: Call) -> Optional[Variants]:
        if not call.q.is_cuda:
            from triton import knobs

            if not knobs.runtime.interpret:
                raise NotServed("the decode family got CPU tensors but Triton's interpreter is off "
                                "(set TRITON_INTERPRET=1 before importing triton to run it on the CPU)")
        if call.fp8 is not None:
            raise NotServed("the decode family has no FP8 variant yet")
        return None   # its scratch is per call: launch() records and re-launches the launch itself

    def launch(self, call: Call) -> None:
        q, out = call.q, call.out
        k, v = _batch_views(q, call.k, call.v)
        if not q.is_cuda:
            self._interpret(call, q, k, v, out)
            return
        inputs = (q, k, v, out, call.lse, *call.tables, *call.score_bufs, *call.mask_bufs)
        launch_decode(self._key(call, inputs), inputs, lambda: self._plan(call, q, k, v, out), self.name)

    def relauncher(self, call: Call) -> Optional[Callable[[tuple], None]]:
        """After ``launch(call)`` on CUDA: ``run(inputs)`` re-launching it for the op's inputs of a
        later call with the same launch key (q, k, v, out, lse, max_scores, tables, buffers: same
        shapes, strides, dtypes, alignment), without planning; None if nothing was recorded."""
        if not call.q.is_cuda:
            return None
        q = call.q
        k, v = _batch_views(q, call.k, call.v)
        again = recorded_decode(self._key(call, (q, k, v, call.out, call.lse, *call.tables,
                                                 *call.score_bufs, *call.mask_bufs)))
        if again is None:
            return None

        def run(inputs: tuple) -> None:
            q, k, v, out, lse, _max_scores, *rest = inputs
            again((q, *_batch_views(q, k, v), out, lse, *rest))
        return run

    @staticmethod
    def _key(call: Call, inputs: tuple) -> tuple:
        # a recording finds its inputs by identity: which are one tensor (flex(q, q, q)) is keyed
        return ("family", call.score_source, call.mask_source, call.scale, call.sparse_q_block,
                call.sparse_kv_block, torch.get_float32_matmul_precision(), tensor_signature(inputs),
                aliasing(inputs))

    def _plan(self, call: Call, q, k, v, out) -> list:
        options = call.kernel_options(self.dialect)
        tables = (options.pop("kv_num_blocks"), options.pop("kv_indices"),
                  options.pop("full_kv_num_blocks"), options.pop("full_kv_indices"))
        try:
            return prepare_decode(q, k, v, out, call.lse, q_start_zero=True,
                                  block_mask_tables=tables, **options)
        except ValueError as exc:
            raise NotServed(str(exc)) from None

    def _interpret(self, call: Call, q, k, v, out) -> None:
        """Under Triton's interpreter (CPU tensors): bf16 computed on float32 copies (Triton 3.6's
        interpreter computes bf16 dots wrongly)."""
        info_once("fa3_inductor: running the decode family under the Triton interpreter (CPU)")
        if q.dtype in _INTERPRETER_UPCAST:
            q, k, v = q.float(), k.float(), v.float()
            out = torch.empty_like(call.out, dtype=torch.float32)
        for kernel, args, kwargs, grid in self._plan(call, q, k, v, out):
            kernel[grid](*args, **kwargs)
        if out is not call.out:
            call.out.copy_(out)


def _batch_views(q, k, v) -> tuple:
    """k, v with q's batch: a batch-1 cache shared by the batch becomes a stride-0 view."""
    if k.shape[0] != q.shape[0]:
        return k.expand(q.shape[0], *k.shape[1:]), v.expand(q.shape[0], *v.shape[1:])
    return k, v


FAMILY = DecodeFamily()
DECODE = FAMILY

__all__ = ["DECODE", "FAMILY", "DecodeFamily"]
