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

from typing import Any, Optional

import torch
from torch.nn.attention.flex_attention import BlockMask

from .. import mods
from ..api import flex
from ..fp8_recipe import FP8Recipe

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
    if s_aux is not None or position_bias is not None:
        raise NotImplementedError(
            "attn_implementation='fa3' does not serve attention sinks or position biases yet; "
            "use attn_implementation='flex_attention' for this model")
    if attention_mask is not None and not isinstance(attention_mask, BlockMask):
        raise TypeError("attn_implementation='fa3' expects its mask as a BlockMask (built by the "
                        f"'fa3' mask function); got {type(attention_mask).__name__}")
    if fp8 is not None and (module.training or torch.is_grad_enabled() and query.requires_grad):
        raise NotImplementedError(
            "attn_implementation='fa3_fp8' is inference-only (no backward through FP8 attention): "
            "call model.eval() under torch.no_grad(), or use attn_implementation='fa3' to train")
    out = flex(query, key, value, score_mod=mods.softcap(softcap) if softcap else None,
               block_mask=attention_mask, scale=scaling,
               enable_gqa=query.shape[1] != key.shape[1], fp8=fp8)
    # Our output keeps q's stride order: q from view(B, S, H, D).transpose(1, 2) makes this a
    # free view back to (B, S, H, D).
    return out.transpose(1, 2), None


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


def register() -> None:
    """Register "fa3" and "fa3_fp8" as transformers attention implementations (idempotent).

    Example::

        >>> register(); model = AutoModel.from_config(cfg, attn_implementation="fa3")  # doctest: +SKIP
    """
    from transformers.masking_utils import AttentionMaskInterface, flex_attention_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(NAME, fa3_attention_forward)
    AttentionMaskInterface.register(NAME, flex_attention_mask)
    AttentionInterface.register(NAME_FP8, fa3_fp8_attention_forward)
    AttentionMaskInterface.register(NAME_FP8, flex_attention_mask)
