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
- ``relauncher(call)`` (optional, with ``launch``): after ``launch(call)`` on CUDA, a function of
  the op's inputs that re-launches the same work for a later call of the same launch key (the
  runtime keeps it by that key, as it keeps ``prepare``'s launches), or ``None``.

The runtime walks a site's candidate families in order and takes the first that serves the call,
so the choice is made in one place, once per launch signature (runtime/fast_launch.py caches it).

The backward (flex_attention_backward) has the same shape, in :class:`BackwardFamily`:
``serves_backward(site)`` (a :class:`BackwardSiteFacts`), ``prepare_backward(call)`` (a
:class:`BackwardCall`; the launches in order, or ``None`` to compute in ``launch_backward(call)``),
with the same NotServed / NOT_MEANT_HERE conventions. The registry lists them separately
(``backward_families()``); runtime/ops_bwd.py walks them. A backward family may also name the
scratch its launches need (``backward_scratch(call)``): the op then allocates it and hands it over
in ``BackwardCall.scratch``, so every tensor a launch touches is the op's and the launches can be
recorded and re-launched per launch signature (runtime/fast_launch.py).
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
    sinks: bool = False   # per-head logits join the softmax denominator (gpt-oss; Call.sinks):
                          # a family that cannot add them says so in serves()
    # The query's length and the head counts when the planner knows them (None: a dynamic length):
    # the decode family serves short queries only.
    query_len: Optional[int] = None
    q_heads: int = 1
    kv_heads: int = 1
    needs_max: bool = True   # the row-max output is read (flex_attention's max_scores)

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
    # [HQ] per-head logits that join each row's softmax denominator (attention sinks), or None;
    # out and lse then include them (docs/design/sinks.md)
    sinks: Optional[Tensor] = None

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
        ``dialect`` with their records, the captured buffers and the block-mask options; plus
        ``sinks`` when the call has them, so a host without that keyword (a family that refuses
        sinks in ``serves``) never sees it."""
        extra = {} if self.sinks is None else {"sinks": self.sinks}
        return dict(sm_scale=self.scale,
                    score_mod=self.score_source and load_mod(self.score_source, dialect, self.score_info),
                    mask_mod=self.mask_source and load_mod(self.mask_source, dialect, self.mask_info),
                    score_bufs=self.score_bufs, mask_bufs=self.mask_bufs, **self.block_options(),
                    **extra)


class KernelFamily(Protocol):
    """The interface of a kernel family (module docstring)."""

    name: str      # what last_template(), explain() and the `template` option call it
    dialect: str   # the mod dialect its kernels call: "gl", "tl" or "torch"

    def serves(self, site: SiteFacts) -> Optional[str]: ...

    def describe(self, site: SiteFacts) -> str: ...

    def prepare(self, call: Call) -> Optional[Variants]: ...

    def launch(self, call: Call) -> None: ...


@dataclasses.dataclass(frozen=True)
class BackwardSiteFacts(SiteFacts):
    """What is known of a backward site when it is planned: the forward's facts plus what only the
    backward asks for.

    Example::

        >>> BackwardSiteFacts(torch.device("cpu"), torch.float32, 64, 64, buffer_grads=True).deterministic
        False
    """

    # a tensor the score_mod captures needs a gradient (a learnable bias): a family that cannot
    # compute it (BackwardCall.buffer_grad_sources) refuses the site
    buffer_grads: bool = False
    deterministic: bool = False   # bitwise-reproducible gradients (config.deterministic_gradients)
    score_grad: bool = False      # a score_mod whose derivative is not 1 (softcap: not an added bias)
    # a score_mod whose values may be huge (ModInfo.wide): torch's backward kernel exponentiates with a
    # contracted FFMA, which overflows there (templates/wide_scores.py); ours round first or clamp
    wide_scores: bool = False
    # torch's backward lowering cannot take the site (a score_mod that ignores the score, or it raised):
    # a family of ours serves it whatever the speed it would give up to torch's kernel
    torch_refuses: bool = False


@dataclasses.dataclass
class BackwardCall:
    """One backward call as a family sees it: the forward's inputs and outputs, the incoming
    gradients, the gradients written in place, and the site's mods as generated source in the
    family's dialect (with the generator's record of each).

    ``lse`` is the forward's (float32, log2 units, -inf on fully masked rows), ``grad_lse`` its
    gradient in the same units or None. ``tables`` are the forward's four block-mask tables
    (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices), ``q_tables`` the four
    transposed ones (torch's BlockMask: q_num_blocks, q_indices, full_q_num_blocks,
    full_q_indices); all None without a mask. ``score_grad_source`` is the score_mod's derivative
    (templates/generic_bwd/score_grad.py); None with a score_mod means the derivative is 1 (the mod
    adds a term). ``buffer_grad_sources`` are the generated gradients of the score_mod's captured
    tensors that need one (generic_bwd/buffer_grad.py's ``BufferGradSource``, in buffer order, in
    the family's dialect) and ``dbufs`` the tensors they are written to, one each, overwritten.
    ``deterministic``: the user asked for bitwise-reproducible gradients.

    Example::

        >>> call = BackwardCall(q, k, v, out, dout, lse, None, dq, dk, dv, (None,) * 4, (None,) * 4,
        ...                     (), (), 0.125, 128, 128)                        # doctest: +SKIP
        >>> family.prepare_backward(call)                                      # doctest: +SKIP
    """

    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    dout: Tensor
    lse: Tensor
    grad_lse: Optional[Tensor]
    dq: Tensor
    dk: Tensor
    dv: Tensor
    tables: tuple
    q_tables: tuple
    score_bufs: tuple
    mask_bufs: tuple
    scale: float
    sparse_q_block: int
    sparse_kv_block: int
    score_source: Optional[str] = None
    score_grad_source: Optional[str] = None
    mask_source: Optional[str] = None
    score_info: Any = None        # templates/modgen.ModInfo of each source (None: none)
    score_grad_info: Any = None
    mask_info: Any = None
    deterministic: bool = False
    buffer_grad_sources: tuple = ()   # generic_bwd.buffer_grad.BufferGradSource, one per dbufs entry
    dbufs: tuple = ()                 # the captured tensors' gradients, written by the family
    # the family's scratch, from its backward_scratch(call), allocated by the caller; None: the
    # family's host allocates its own (then its launches cannot be re-launched from a recording)
    scratch: Optional[tuple] = None

    def kernel_options(self, dialect: str, unit_gradient: Any) -> dict:
        """The keywords a Triton / Gluon family's backward host function takes (those of
        generic_bwd.host.prepare_generic_backward): the scale, the LSE's gradient, the mods loaded
        in ``dialect`` with their records, the buffers, the eight block-mask options and
        ``deterministic``; plus ``buffer_grads`` ((source, gradient) pairs) when the call has
        captured-tensor gradients, so a host without that keyword (a family that refuses such
        sites in ``serves_backward``) never sees it. ``unit_gradient`` is what that host takes
        for a derivative of 1 (generic_bwd's SCORE_GRAD_ONE).

        Example::

            >>> prepare_generic_backward(*call.tensors(), **call.kernel_options("tl", SCORE_GRAD_ONE))  # doctest: +SKIP
        """
        score_grad = None
        if self.score_source is not None:
            score_grad = (unit_gradient if self.score_grad_source is None else
                          load_mod(self.score_grad_source, dialect, self.score_grad_info))
        kv_num, kv_idx, full_kv_num, full_kv_idx = self.tables
        q_num, q_idx, full_q_num, full_q_idx = self.q_tables
        if len(self.buffer_grad_sources) != len(self.dbufs):
            raise ValueError(f"BackwardCall has {len(self.buffer_grad_sources)} buffer-gradient "
                             f"sources for {len(self.dbufs)} gradient tensors; give one tensor "
                             "per source (runtime/ops_bwd.py allocates them)")
        extra = {"buffer_grads": tuple(zip(self.buffer_grad_sources, self.dbufs))} if self.dbufs else {}
        return dict(
            sm_scale=self.scale, grad_lse=self.grad_lse,
            score_mod=self.score_source and load_mod(self.score_source, dialect, self.score_info),
            score_grad_mod=score_grad,
            mask_mod=self.mask_source and load_mod(self.mask_source, dialect, self.mask_info),
            score_bufs=self.score_bufs, mask_bufs=self.mask_bufs,
            kv_num_blocks=kv_num, kv_indices=kv_idx, full_kv_num_blocks=full_kv_num,
            full_kv_indices=full_kv_idx, q_num_blocks=q_num, q_indices=q_idx,
            full_q_num_blocks=full_q_num, full_q_indices=full_q_idx,
            sparse_q_block=self.sparse_q_block, sparse_kv_block=self.sparse_kv_block,
            deterministic=self.deterministic, **extra)

    def tensors(self) -> tuple[Tensor, ...]:
        """(q, k, v, out, dout, lse, dq, dk, dv): the backward host functions' positional arguments."""
        return self.q, self.k, self.v, self.out, self.dout, self.lse, self.dq, self.dk, self.dv


class BackwardFamily(Protocol):
    """The interface of a backward kernel family (module docstring).

    ``serves_backward`` answers from the planned facts (None: it serves; a reason; NOT_MEANT_HERE);
    ``prepare_backward`` returns the launches ``[(kernel, args, kwargs, grid)]`` in the order they
    must run, or None when ``launch_backward`` computes the call itself, and raises NotServed for a
    call whose tensors it cannot take. A family that is not deterministic refuses a site with
    ``deterministic`` set (or honours it).

    ``backward_scratch`` (optional) returns the scratch tensors ``prepare_backward`` would otherwise
    allocate for ``call``, freshly allocated (their contents are never read before the launches
    write them); ``prepare_backward`` then uses ``call.scratch``. A family without it, or whose
    launches read a tensor the op did not give it, has its launches planned anew on every call.
    """

    name: str      # what explain() and the backward records call it ("generic_bwd")
    dialect: str   # the mod dialect its kernels call: "gl" or "tl"

    def serves_backward(self, site: BackwardSiteFacts) -> Optional[str]: ...

    def prepare_backward(self, call: BackwardCall) -> Optional[list[Launch]]: ...

    def launch_backward(self, call: BackwardCall) -> None: ...

    def backward_scratch(self, call: BackwardCall) -> tuple[Tensor, ...]: ...
