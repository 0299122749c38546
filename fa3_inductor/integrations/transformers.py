"""Hugging Face transformers integration: ``attn_implementation="fa3"``.

``register()`` adds an attention function and a mask function named "fa3" to transformers'
interfaces, and "fa3_fp8": the same with FP8 attention for inference (``flex(..., fp8=...)``: q and k
rotated by a random-sign Hadamard matrix, one-byte operands with block scales; docs/fp8.md). Under
"fa3_fp8" the model's RoPE runs in the model, before the attention function (the prologue fuses it
only on the compiled path: eager attention compiled with options fa3.fp8). Masks are built by transformers' own FlexAttention mask builder (causal, sliding
window per layer type, padding, packed sequences), so they arrive as a BlockMask; softcapping
comes from the model's config through the ``softcap`` argument transformers passes.

Example::

    >>> from fa3_inductor.integrations import transformers as fa3_hf
    >>> fa3_hf.register()
    >>> model = AutoModelForCausalLM.from_config(cfg, attn_implementation="fa3")  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Optional

import torch
from torch.nn.attention.flex_attention import BlockMask

from .. import mods
from ..api import flex
from ..fp8_recipe import FP8Recipe
from .hf_sinks import hf_sinks

NAME = "fa3"
NAME_FP8 = "fa3_fp8"


def fa3_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: Optional[Any],
                          scaling: Optional[float] = None, softcap: Optional[float] = None,
                          dropout: float = 0.0, s_aux: Optional[torch.Tensor] = None,
                          position_bias: Optional[torch.Tensor] = None,
                          fp8: Optional[FP8Recipe] = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function: (B, H, S, D) inputs -> ((B, S, H, D) output, None).
    ``fp8``: run FP8 attention with this recipe (``attn_implementation="fa3_fp8"``).

    Example::

        >>> out, _ = fa3_attention_forward(layer, q, k, v, block_mask, scaling=0.125)  # doctest: +SKIP
    """
    if dropout and module.training:
        raise ValueError("attn_implementation='fa3' has no attention dropout; set the config's "
                         "attention_dropout to 0 or call model.eval()")
    if position_bias is not None:
        raise NotImplementedError(
            "attn_implementation='fa3' does not serve position biases passed as tensors yet; "
            "use attn_implementation='eager' with torch.compile(backend='fa3'), which fuses them")
    sinks = hf_sinks(query, s_aux, fp8)   # gpt-oss: one logit per query head, or None
    if attention_mask is not None and not isinstance(attention_mask, BlockMask):
        raise TypeError("attn_implementation='fa3' expects its mask as a BlockMask (built by the "
                        f"'fa3' mask function); got {type(attention_mask).__name__}")
    if fp8 is not None and (module.training or torch.is_grad_enabled() and query.requires_grad):
        raise NotImplementedError(
            "attn_implementation='fa3_fp8' is inference-only (no backward through FP8 attention): "
            "call model.eval() under torch.no_grad(), or use attn_implementation='fa3' to train")
    score_mod = mods.softcap(softcap) if softcap else None
    packed = None if fp8 is not None else packed_sequences(query, key, kwargs, attention_mask)
    if packed is not None:
        return _packed_attention(query, key, value, packed, score_mod, scaling, sinks,
                                 kwargs.get("sliding_window")), None
    # A decode step (a few new tokens against the static cache, its mask a BlockMask over the
    # cache) reaches the decode family through flex(): the plan picks it for short queries.
    out = flex(query, key, value, score_mod=score_mod, block_mask=attention_mask, scale=scaling,
               enable_gqa=query.shape[1] != key.shape[1], fp8=fp8, sinks=sinks)
    # Our output keeps q's stride order: q from view(B, S, H, D).transpose(1, 2) makes this a
    # free view back to (B, S, H, D).
    return out.transpose(1, 2), None


_POSITIONS_MEMO: dict = {}   # one position_ids tensor serves every layer of a forward: read it once


def packed_sequences(query: torch.Tensor, key: torch.Tensor, kwargs: dict,
                     mask: Optional[BlockMask] = None
                     ) -> Optional[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) when the call is a packed batch of
    sequences, else None: FlashAttention kwargs (``cu_seq_lens_q/k``, ``max_length_q/k``, from
    transformers' ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), or, for one row
    with no cache (query and key equally long), ``position_ids`` that restart at 0. The latter is
    read on the host once per position_ids tensor (the lengths size the launch grid), as
    transformers' FlashAttention path does, unless ``mask`` was built by :func:`fa3_mask` with a
    2D attention mask: transformers' masks then read no packing from position_ids, and neither
    do we (generate() passes one: its prefill reads nothing on the host here).

    Example::

        >>> packed_sequences(q, k, {"position_ids": torch.tensor([[0, 1, 2, 0, 1]])})[0]   # doctest: +SKIP
        tensor([0, 3, 5], dtype=torch.int32)
    """
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        if max_q is None or max_k is None:
            raise ValueError("attn_implementation='fa3' got cu_seq_lens_q/k without max_length_q/k; "
                             "pass both (DataCollatorWithFlattening(return_flash_attn_kwargs=True) does)")
        return cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k)
    positions = kwargs.get("position_ids")
    if (positions is None or positions.dim() != 2 or positions.shape[0] != 1 or query.shape[0] != 1
            or query.shape[2] != key.shape[2] or positions.shape[1] != query.shape[2]
            or query.shape[2] < 2 or _built_with_padding(mask)):
        return None
    memo_key = (id(positions), positions.data_ptr(), positions._version)
    hit = _POSITIONS_MEMO.get(memo_key)
    if hit is None:
        starts = (positions[0] == 0).nonzero().flatten()
        total = positions.shape[1]
        packed = starts.numel() > 1 and int(starts[0]) == 0
        if packed:
            cu = torch.cat([starts, starts.new_tensor([total])]).to(torch.int32)
            longest = int(cu.diff().max())
            hit = (positions, (cu, cu, longest, longest))
        else:
            hit = (positions, None)
        _POSITIONS_MEMO.clear()   # the memo keeps the tensor alive: hold only the latest
        _POSITIONS_MEMO[memo_key] = hit
    return hit[1]


def _built_with_padding(mask: Optional[BlockMask]) -> bool:
    # the weak set is not read inside a compiled region (Dynamo would trace it): there as before
    return mask is not None and not torch.compiler.is_compiling() and mask in _PADDED


def _packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packed: tuple,
                      score_mod: Any, scaling: Optional[float], sinks: Optional[torch.Tensor] = None,
                      window: Optional[int] = None) -> torch.Tensor:
    """Causal attention within each packed sequence (within the layer's sliding ``window`` when it
    has one): (1, T, H, D) output. flex_varlen computes it (no tile spans two sequences), with
    gradients where its sm90 backward serves the layer (causal or windowed: both walk only the tiles
    their mask reaches); flex() with a document mask over the same packing computes what it does not
    (other CUDA inputs that need gradients, and layers with attention sinks)."""
    from ..varlen import flex_varlen
    from ..varlen_grad import varlen_grad_refusal

    cu_q, cu_k, max_q, max_k = packed
    gqa = query.shape[1] != key.shape[1]
    causal = mods.sliding_window(window) if window else mods.causal
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))   # (T, H, D) views
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    varlen_grads = varlen_grad_refusal(q, k, v, (), ()) is None
    if sinks is not None or (needs_grad and query.is_cuda and not varlen_grads):
        if not torch.equal(cu_q, cu_k):   # one sync
            raise NotImplementedError("attn_implementation='fa3' trains packed batches (or runs them "
                                      "with attention sinks) only when the query and key packings "
                                      "agree (no cache)")
        tokens = torch.arange(query.shape[2], device=query.device)
        doc_ids = torch.searchsorted(cu_q[1:], tokens, right=True)
        mask = mods.and_masks(mods.document(doc_ids), causal)
        out = flex(query, key, value, score_mod=score_mod, mask_mod=mask, scale=scaling,
                   enable_gqa=gqa, sinks=sinks)
        return out.transpose(1, 2)
    out = flex_varlen(q, k, v, cu_q, cu_k, max_q, max_k, score_mod=score_mod, mask_mod=causal,
                      scale=scaling, enable_gqa=gqa)
    return out.unsqueeze(0)


def fa3_fp8_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: Optional[Any],
                              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """:func:`fa3_attention_forward` with FP8 attention (the default :class:`FP8Recipe`; a model
    may set ``config.fa3_fp8_recipe`` to another one). Inference only.

    Example::

        >>> out, _ = fa3_fp8_attention_forward(layer, q, k, v, block_mask, scaling=0.125)  # doctest: +SKIP
    """
    config = getattr(module, "config", None)
    recipe = getattr(config, "fa3_fp8_recipe", None) or FP8Recipe()
    return fa3_attention_forward(module, query, key, value, attention_mask, fp8=recipe, **kwargs)


_OFFSETS: dict = {}   # id of a cache's offset tensor -> (that tensor, the snapshot fa3_mask reads)
# masks fa3_mask built with a 2D attention mask: their calls read no packing from position_ids
_PADDED: "weakref.WeakSet[BlockMask]" = weakref.WeakSet()


def _snapshot(offset: Any) -> Any:
    """``offset`` as it is now, when it is a tensor: a copy made into one buffer kept per offset
    tensor, so that masks of later steps capture the same tensor (their key, hence the plan, stays
    the same) and the kernels read the value of mask-building time.

    Why: transformers' StaticCache passes its cumulative length tensor as the mask's query offset,
    and the first layer's cache update advances it in place before attention runs. A BlockMask's
    mask_mod is evaluated by the kernel at run time, so without the copy every decode step's
    partial block would let the query see one key more (the unwritten next slot) than sdpa's
    mask, built eagerly, does.

    Example::

        >>> length = torch.tensor(12)
        >>> seen = _snapshot(length); _ = length.add_(1); int(seen)
        12
    """
    if not isinstance(offset, torch.Tensor):
        return offset
    if torch.compiler.is_compiling():
        return offset.clone()
    hit = _OFFSETS.get(id(offset))
    if hit is None or hit[0] is not offset or hit[1].shape != offset.shape \
            or hit[1].dtype != offset.dtype or hit[1].device != offset.device:
        if len(_OFFSETS) >= 64:
            _OFFSETS.clear()
        hit = _OFFSETS[id(offset)] = (offset, offset.clone())
    else:
        hit[1].copy_(offset)
    return hit[1]


def fa3_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: Any = 0,
             mask_function: Any = None, attention_mask: Optional[torch.Tensor] = None,
             device: Any = "cpu", **kwargs: Any) -> BlockMask:
    """transformers' ``flex_attention_mask`` (its arguments), the mask function registered for "fa3"
    and "fa3_fp8", with four differences that keep generate()'s steps fast:

    - tensor offsets are copied when the mask is built (:func:`_snapshot`);
    - a padding mask is ANDed in whatever its values (exact). transformers skips an all-ones one
      (`fast_all`), a host sync every step in eager (generate() builds the mask outside its
      compiled step) and a graph break in a compiled region;
    - inside a compiled region ``create_block_mask`` is traced; transformers' ``_compile=True``
      there is a graph break (torch 2.13). Eagerly it runs compiled, as transformers does;
    - a mask built eagerly with a padding mask is remembered (``_PADDED``, weakly), so that its
      attention calls read no packing from ``position_ids`` (:func:`packed_sequences`).

    (H100, SmolLM2-135M 1 x 4k, static cache: 8.3 ms a decode step against sdpa's 4.4 before.)

    Example::

        >>> bm = fa3_mask(1, 1, 16, torch.tensor(12), 0, device="cpu")  # doctest: +SKIP
    """
    from torch.nn.attention.flex_attention import create_block_mask
    from transformers.masking_utils import (add_offsets_to_mask_function, and_masks,
                                            causal_mask_function, padding_mask_function,
                                            prepare_padding_mask)

    q_offset, kv_offset = _snapshot(q_offset), _snapshot(kv_offset)
    mask_function = causal_mask_function if mask_function is None else mask_function
    if attention_mask is not None:
        padding_mask = prepare_padding_mask(attention_mask, kv_length, kv_offset)
        mask_function = and_masks(mask_function, padding_mask_function(padding_mask))
    mask_function = add_offsets_to_mask_function(mask_function, q_offset, kv_offset)
    if torch.compiler.is_compiling():
        return create_block_mask(mask_function, batch_size, None, q_length, kv_length, device=device)
    block_mask = _compiled_create_block_mask()(mask_function, batch_size, None, q_length, kv_length,
                                               device=device)
    if attention_mask is not None:
        _PADDED.add(block_mask)
    return block_mask


@functools.cache
def _compiled_create_block_mask() -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def register() -> None:
    """Register "fa3" and "fa3_fp8" as transformers attention implementations (idempotent).

    Example::

        >>> register(); model = AutoModel.from_config(cfg, attn_implementation="fa3")  # doctest: +SKIP
    """
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(NAME, fa3_attention_forward)
    AttentionMaskInterface.register(NAME, fa3_mask)
    AttentionInterface.register(NAME_FP8, fa3_fp8_attention_forward)
    AttentionMaskInterface.register(NAME_FP8, fa3_mask)
