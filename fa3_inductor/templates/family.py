"""What a kernel family is: one folder under ``templates/`` behind one small interface.

A family owns its kernels, their host side, its tile table and the mod dialect its kernels call
(``templates/<family>/``). The planner (lowering/site_plan.py) and the runtime (runtime/ops.py) know
families only through this interface and the registry (templates/registry.py), which lists them in
preference order:

- ``serves(site)``: whether the family can take a site, from what is known when it is planned
  (device, dtype, head dims). ``None``: it can. Otherwise a reason, shown in ``explain()`` and the
  log; ``NOT_MEANT_HERE`` (an empty reason) when the family is simply not for this device, which is
  not worth a note (the Hopper family on an A100).
- ``describe(site)``: what the family will run the site with (its tiles), for ``explain()``.
- ``prepare(call)``: the launch of one call, with its sibling variants (runtime/variants.py compiles
  those ahead), or ``None`` when the family computes the call itself in ``launch(call)``. It raises
  :class:`NotServed` when this call's tensors do not fit (a stride, an alignment, a block size).
- ``launch(call)``: compute the call in place, for families whose ``prepare`` gave ``None``.

The runtime walks a site's candidate families in order and takes the first that serves the call,
so the choice is made in one place, once per launch signature (runtime/fast_launch.py caches it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol

import torch
from torch import Tensor

from .modgen import load_mod

NOT_MEANT_HERE = ""   # serves(): "not for this device", no note

Launch = tuple        # (kernel, args, kwargs, grid)
Variants = tuple      # (launch, [sibling launches that other lengths would need])


class NotServed(Exception):
    """``prepare(call)`` cannot serve this call's tensors; the message says why."""


@dataclasses.dataclass(frozen=True)
class SiteFacts:
    """What is known of an attention site when it is planned: no tensors yet.

    Example::

        >>> SiteFacts(torch.device("cpu"), torch.float16, 64, 64).capability is None
        True
    """

    device: torch.device
    dtype: torch.dtype
    head_dim: int         # q's and k's
    value_head_dim: int   # v's and the output's
    fp8: bool = False     # inputs quantized to e4m3 by the FP8 prologue (fp8_recipe.py)

    @property
    def capability(self) -> Optional[tuple[int, int]]:
        """The CUDA device's compute capability, None off CUDA."""
        if self.device.type != "cuda":
            return None
        return tuple(torch.cuda.get_device_capability(self.device))


@dataclasses.dataclass
class Call:
    """One forward call as a family sees it: inputs, outputs written in place, and the site's mods
    as generated source in the family's own dialect (with the generator's record of each).

    ``tables`` are the four block-mask tables (torch's BlockMask layout: kv_num_blocks, kv_indices,
    full_kv_num_blocks, full_kv_indices), all None without a mask. ``lse`` and ``max_scores`` are in
    log2 units.

    Example::

        >>> call = Call(q, k, v, out, lse, mx, (None,) * 4, (), (), 0.125, 128, 128)   # doctest: +SKIP
        >>> family.prepare(call)                                                        # doctest: +SKIP
    """

    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    lse: Tensor
    max_scores: Tensor
    tables: tuple
    score_bufs: tuple
    mask_bufs: tuple
    scale: float
    sparse_q_block: int
    sparse_kv_block: int
    needs_max: bool = True
    score_source: Optional[str] = None
    mask_source: Optional[str] = None
    score_info: Any = None   # templates/modgen.ModInfo of score_source (None: none or hand-written)
    mask_info: Any = None
    # FP8 sites: the prologue's FP8Operands (fp8_recipe.py); q, k, v are then its q, k, vt, and a
    # family that computes in high precision (torch's, the last resort) dequantizes them
    fp8: Any = None

    def block_options(self) -> dict:
        """The block-mask keywords every family's host function takes."""
        kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices = self.tables
        return dict(kv_num_blocks=kv_num_blocks, kv_indices=kv_indices,
                    full_kv_num_blocks=full_kv_num_blocks, full_kv_indices=full_kv_indices,
                    sparse_q_block=self.sparse_q_block, sparse_kv_block=self.sparse_kv_block)

    def outputs(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.out, self.lse, self.max_scores

    def fp8_operands(self, family: str) -> Any:
        """The prologue's FP8Operands, or NotServed naming ``family`` for a call made without them.

        Example::

            >>> call.fp8_operands("the FP8 family").q.dtype   # doctest: +SKIP
            torch.int8
        """
        if self.fp8 is None:
            raise NotServed(f"{family} needs the prologue's operands (Call.fp8)")
        return self.fp8

    def kernel_options(self, dialect: str) -> dict:
        """The keywords a Triton / Gluon family's host functions take: the scale, the mods loaded in
        ``dialect`` with their records, the captured buffers and the block-mask options."""
        return dict(sm_scale=self.scale,
                    score_mod=self.score_source and load_mod(self.score_source, dialect, self.score_info),
                    mask_mod=self.mask_source and load_mod(self.mask_source, dialect, self.mask_info),
                    score_bufs=self.score_bufs, mask_bufs=self.mask_bufs, **self.block_options())


class KernelFamily(Protocol):
    """The interface of a kernel family (module docstring)."""

    name: str      # what last_template(), explain() and the `template` option call it
    dialect: str   # the mod dialect its kernels call: "gl", "tl" or "torch"

    def serves(self, site: SiteFacts) -> Optional[str]: ...

    def describe(self, site: SiteFacts) -> str: ...

    def prepare(self, call: Call) -> Optional[Variants]: ...

    def launch(self, call: Call) -> None: ...
