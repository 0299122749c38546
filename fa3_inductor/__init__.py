"""fa3_inductor: FlashAttention-3-style attention for torch.compile and a FlexAttention-style API.

Front doors:
    ``torch.compile(model, backend="fa3")``   compile with our attention lowering
    ``fa3_inductor.flex(q, k, v, ...)``       FlexAttention's signature, our kernels
    ``fa3_inductor.flex_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, ...)``   packed variable-length
                                              batches (inference; no tile spans two sequences)
    ``fa3_inductor.flex_decode(q, k_cache, v_cache, seq_lens=..., block_table=...)``   new tokens
                                              against a (paged) KV cache, lengths on the device;
                                              ``fa3_inductor.quantize_kv`` for an FP8 cache

What the backend did: ``fa3_inductor.explain(model, *inputs)``, or ``TORCH_LOGS=fa3_inductor``.

Example::

    >>> import fa3_inductor
    >>> out = fa3_inductor.flex(q, k, v, mask_mod=fa3_inductor.mods.causal)   # doctest: +SKIP
"""

from . import mods
from .api import flex
from ._log import register_torch_log
from .backend import ensure_registered, fa3_backend
from .explain import ExplainReport, explain
from .fp8_recipe import FP8Recipe, RopeSpec
from .report import clear_lowered_sites, lowered_backward_sites, lowered_sites, recognized_sites
from .runtime.ops import last_template
from .varlen import flex_varlen
from .decode import flex_decode, quantize_kv

__all__ = ["flex", "flex_varlen", "flex_decode", "quantize_kv", "mods", "FP8Recipe", "RopeSpec", "fa3_backend", "lowered_sites", "lowered_backward_sites",
           "recognized_sites", "clear_lowered_sites", "last_template", "explain", "ExplainReport"]
__version__ = "0.1.0"

ensure_registered()
register_torch_log()
