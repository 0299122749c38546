"""``context_parallel``: torch's context-parallel API with attention served by ``ring_flex``.

torch's ``torch.distributed.tensor.experimental.context_parallel(mesh, buffers=...,
buffer_seq_dims=...)`` does two things (torch 2.13, ``_context_parallel/_attention.py``): it shards
the buffers in place along their sequence dim (head-tail order when ``_cp_options.enable_load_balance``
and the length divides by 2 x world: ``_create_default_load_balancer``), and it monkey-patches
``F.scaled_dot_product_attention`` so the call becomes a DTensor op whose aten kernel
(``_scaled_dot_product_{flash,efficient,cudnn}_attention``) ``_sdpa_handler`` turns into torch's ring
over that aten kernel. flex_attention is not patched there at all: torch's flex path is the
module-wrapper API (``_ContextParallel(attention_type=FLEX)``: an all-gather of K/V plus a block
mask ``_create_cp_block_mask`` rebuilds for the local queries).

Here, inside torch's context, ``F.scaled_dot_product_attention`` and
``torch.nn.attention.flex_attention.flex_attention`` (module attributes) are replaced by calls to
``ring_flex`` on this rank's shards, with the layout torch sharded the buffers in, so both run our
kernels per shard and mods/masks see global positions. A model compiled with ``backend="fa3"``
traces these calls as graph breaks (``ring_flex`` is ``torch.compiler.disable``d): the attention
runs eagerly between compiled graphs. Attention the compiled graph holds itself (hand-written
softmax(q kᵀ) v, SDPA or flex_attention bound before the context, all found by recognition) runs
as ring attention too: the context is pushed to runtime/cp_state.py, which the backend's compiled
graphs read on every call, and a graph called inside runs its ring variant (graph_sites.py), or
raises naming a site it cannot make exact. :func:`active` tells code whether a context is on.

``fp8=True`` (or an ``FP8Recipe``): the attention the context serves runs FP8 per ring step
(``ring_flex(fp8=)``; inference only: inputs that need gradients raise, naming the option), the
SDPA / flex_attention calls and the compiled graphs' ring sites alike (a graph compiled with
``options={"fa3.fp8": recipe}`` keeps its own recipe: the backend passes it to
:meth:`_Active.ring_graph`); a compiled site runs FP8 where its inputs are bf16/fp16 and our
kernels run, as the compiled FP8 path does.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional

import torch.nn.functional as F
from torch import Tensor

from ..fp8_recipe import FP8Recipe
from ..runtime import cp_state
from .layout import SeqLayout
from .ring import check_fp8_inference, ring_flex

_FP8_OPTION = "fa3_inductor.distributed.context_parallel(fp8=...)"


@dataclasses.dataclass(frozen=True)
class _Active:
    group: object
    layout: SeqLayout
    method: str
    kernel: str
    fp8: Optional[FP8Recipe] = None

    def ring_graph(self, gm, fp8=None):
        """``gm`` with its flex_attention nodes run as ring attention (cp_state.py's region API).
        ``fp8``: the compiled graph's own FP8 recipe (its ``fa3.fp8`` option), else this
        context's."""
        from .graph_sites import ring_graph

        recipe = FP8Recipe.of(fp8)
        return ring_graph(gm, fp8=recipe if recipe is not None else self.fp8)


_ORIGINALS: list[tuple] = []   # (sdpa, flex_attention) each patch replaced


def active() -> Optional[_Active]:
    """The innermost active :func:`context_parallel` (group, layout, method), or None.

    Example::

        >>> active() is None
        True
    """
    state = cp_state.active()
    return state if isinstance(state, _Active) else None


@contextlib.contextmanager
def context_parallel(mesh, *, buffers: Optional[list[Tensor]] = None,
                     buffer_seq_dims: Optional[list[int]] = None,
                     no_restore_buffers: Optional[set] = None, method: str = "ring",
                     kernel: str = "auto", fp8=None) -> Iterator[None]:
    """torch's ``context_parallel`` (buffers sharded in place, restored on exit) with SDPA and
    flex_attention calls served by :func:`~.ring.ring_flex` on our kernels.

    ``mesh``: a 1-D DeviceMesh; ``method``, ``kernel``, ``fp8``: ring_flex's (``fp8``: FP8
    attention for inference, the compiled graphs' ring sites included: module docstring). The
    global length of the first buffer must divide by 2 x mesh size (torch then shards head-tail).

    Example::

        >>> mesh = init_device_mesh("cuda", (world,))                            # doctest: +SKIP
        >>> with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):   # doctest: +SKIP
        ...     out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    """
    from torch.distributed.tensor.experimental import context_parallel as torch_cp
    from torch.distributed.tensor.experimental._attention import _cp_options

    buffers = list(buffers or [])
    dims = list(buffer_seq_dims or [])
    world = mesh.size()
    layout = SeqLayout(world)
    if buffers:
        total = buffers[0].shape[dims[0]]
        if total % (2 * world) != 0:
            raise ValueError(
                f"fa3_inductor.distributed.context_parallel: sequence length {total} must be a "
                f"multiple of 2 x mesh size ({2 * world}); pad the batch to the next multiple")
        layout = SeqLayout(world, head_tail=bool(_cp_options.enable_load_balance))
    state = _Active(mesh.get_group(), layout, method, kernel, FP8Recipe.of(fp8))
    torch_context = torch_cp(mesh, buffers=buffers, buffer_seq_dims=dims,
                             no_restore_buffers=no_restore_buffers)
    torch_context.__enter__()
    try:
        with _patched(state):
            yield
    finally:
        # Always a normal exit: some torch versions (2.9-2.10's generator has no try/finally)
        # leave SDPA patched and the buffers sharded when an exception is thrown into it.
        torch_context.__exit__(None, None, None)


@contextlib.contextmanager
def _patched(state: _Active) -> Iterator[None]:
    import torch.nn.attention.flex_attention as flex_module

    saved_sdpa, saved_flex = F.scaled_dot_product_attention, flex_module.flex_attention
    F.scaled_dot_product_attention = _sdpa
    flex_module.flex_attention = _flex
    cp_state.push(state)
    _ORIGINALS.append((saved_sdpa, saved_flex))
    try:
        yield
    finally:
        cp_state.pop()
        _ORIGINALS.pop()
        F.scaled_dot_product_attention = saved_sdpa
        flex_module.flex_attention = saved_flex


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _ring(query: Tensor, key: Tensor, value: Tensor, *args, **kwargs):
    state = active()
    if state.fp8 is not None:
        check_fp8_inference(query, key, value, _FP8_OPTION)
    return ring_flex(query, key, value, *args, group=state.group, layout=state.layout,
                     method=state.method, kernel=state.kernel, fp8=state.fp8, **kwargs)


def _sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
          dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
          enable_gqa: bool = False) -> Tensor:
    """F.scaled_dot_product_attention on this rank's shards, as ring attention."""
    if active() is None:   # the ring's own per-shard calls (cp_state.suspended)
        return _ORIGINALS[-1][0](query, key, value, attn_mask, dropout_p, is_causal, scale,
                                 enable_gqa=enable_gqa)
    if attn_mask is not None or dropout_p != 0.0:
        raise NotImplementedError(
            "fa3_inductor.distributed.context_parallel: scaled_dot_product_attention with an "
            "attn_mask tensor or dropout has no context-parallel form (the mask covers local "
            "positions only); express the mask as a mask_mod of global positions and call "
            "flex_attention / fa3_inductor.distributed.ring_flex, and drop dropout")
    return _ring(query, key, value, mask_mod=_causal if is_causal else None, scale=scale,
                 enable_gqa=enable_gqa)


def _flex(query: Tensor, key: Tensor, value: Tensor, score_mod=None, block_mask=None,
          scale: Optional[float] = None, enable_gqa: bool = False, return_lse: bool = False,
          kernel_options=None, **unused) -> Tensor:
    """flex_attention on this rank's shards, as ring attention; a block mask contributes its
    mask_mod (which sees global positions), its tables are rebuilt per shard."""
    if active() is None:   # the ring's own per-shard calls (cp_state.suspended)
        return _ORIGINALS[-1][1](query, key, value, score_mod=score_mod, block_mask=block_mask,
                                 scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
                                 kernel_options=kernel_options, **unused)
    if unused.get("return_aux") is not None:
        raise NotImplementedError("fa3_inductor.distributed.context_parallel: flex_attention's "
                                  "return_aux is not supported; use return_lse=True")
    mask_mod = block_mask.mask_mod if block_mask is not None else None
    return _ring(query, key, value, score_mod, mask_mod, scale=scale, enable_gqa=enable_gqa,
                 return_lse=return_lse)
