"""How one attention site is served: the decision shared by the lowering and flex()'s direct path.

Given the mods' graphs and the site's static facts (device, dtype, head counts and dims, block
sizes), either a SiteSpec (template + generated mod sources) or the reason our kernels do not
serve it. Both front doors thereby make the same choice for the same site.

Which kernel families may serve the site is the registry's answer (templates/registry.py), in
preference order; the spec carries the site's mods in each of their dialects, and the runtime runs
each call on the first family that serves it (runtime/ops.py). The value head dim may differ from
the query/key head dim (DeepSeek-V2/V3's multi-head latent attention trains with q/k 192, v 128):
the generic family serves any such pair within the head-dim range, the Hopper family the pairs its
config table has tiles for.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..config import Settings
from ..runtime.kernel_failures import kernel_failure
from ..runtime.spec import SiteSpec
from ..templates.family import SiteFacts
from ..templates.modgen import (BufferSpec, GeneratedSource, generate_in_dialect, is_constant_true_mask,
                                is_identity_score)
from ..templates.registry import candidates

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def unserved(device: torch.device, dtype: torch.dtype, head_dim: int,
             value_head_dim: Optional[int] = None) -> Optional[str]:
    """Why our kernels cannot serve this device/dtype/head dims, or None. ``value_head_dim``
    (V's, and the output's) defaults to ``head_dim`` (Q's and K's).

    Example::

        >>> unserved(torch.device("cuda"), torch.float64, 128)
        'dtype torch.float64 (fa3 serves float16, bfloat16, float32)'
        >>> unserved(torch.device("cuda"), torch.float16, 192, value_head_dim=100)
        'value head dim 100 (fa3 serves multiples of 8 from 16 to 256)'
    """
    from triton import knobs

    if device.type == "cpu" and not knobs.runtime.interpret:
        return ("CPU tensors and Triton's interpreter is off (TRITON_INTERPRET=1 runs "
                "the generic kernel on the CPU)")
    if device.type not in ("cuda", "cpu"):
        return f"device {device.type} is not served"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} (fa3 serves float16, bfloat16, float32)"
    if not _head_dim_served(head_dim):
        return f"head dim {head_dim} (fa3 serves multiples of 8 from 16 to 256)"
    if value_head_dim is not None and not _head_dim_served(value_head_dim):
        return f"value head dim {value_head_dim} (fa3 serves multiples of 8 from 16 to 256)"
    return None


def _head_dim_served(head_dim: int) -> bool:
    return 16 <= head_dim <= 256 and head_dim % 8 == 0


def plan_site(score_gm: torch.fx.GraphModule, mask_gm: torch.fx.GraphModule,
              score_specs: Sequence[Optional[BufferSpec]],
              mask_specs: Sequence[Optional[BufferSpec]], *, device: torch.device,
              dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int,
              value_head_dim: int, batches_match: bool, sparse_blocks: tuple[int, int],
              settings: Settings, description: str,
              needs_max: bool = True, fp8: bool = False,
              query_len: Optional[int] = None, sinks: bool = False
              ) -> tuple[Optional[SiteSpec], Optional[str]]:
    """(spec, None) when our kernels serve the site, else (None, reason). ``needs_max``: whether
    the row-max output is read (flex_attention's max_scores); ``fp8``: the inputs reach the kernel
    quantized by the FP8 prologue (the fp8 family serves it); ``query_len``: the query's length
    when known (None: dynamic), which the decode family serves short; ``sinks``: the call passes
    per-head sinks (runtime/ops.flex_fwd), so only families that add them are listed.

    Raises UnsupportedMod (templates/modgen.py) when a mod cannot be generated.

    Example::

        >>> spec, why = plan_site(score_gm, mask_gm, [], [], device=q.device, dtype=q.dtype,
        ...     q_heads=8, kv_heads=2, head_dim=128, value_head_dim=128, batches_match=True,
        ...     sparse_blocks=(128, 128), settings=Settings(), description="q[...]")  # doctest: +SKIP
    """
    if settings.template == "torch":
        return None, "option fa3.template='torch'"
    reason = unserved(device, dtype, head_dim, value_head_dim)
    if reason is not None:
        return None, reason
    if not batches_match:
        return None, "key/value batch differs from the query's (and is not 1)"
    if q_heads % kv_heads != 0:
        return None, f"{q_heads} query heads are not a multiple of {kv_heads} kv heads"
    if not all(_is_pow2_at_least_16(s) for s in sparse_blocks):
        return None, (f"block-mask block size {sparse_blocks[0]}x{sparse_blocks[1]} "
                      "(fa3 serves powers of two >= 16)")
    site = SiteFacts(device, dtype, head_dim, value_head_dim, fp8=fp8, query_len=query_len,
                     q_heads=q_heads, kv_heads=kv_heads, needs_max=needs_max, sinks=sinks)
    families, notes = candidates(site, settings.template)
    identity, all_true = is_identity_score(score_gm), is_constant_true_mask(mask_gm)
    mods, infos = [], {"score": (), "mask": ()}
    for dialect in dict.fromkeys(f.dialect for f in families):   # each dialect once
        score = None if identity else generate_in_dialect(score_gm, "score", score_specs, dialect)
        mask = None if all_true else generate_in_dialect(mask_gm, "mask", mask_specs, dialect)
        for kind, source in (("score", score), ("mask", mask)):
            if isinstance(source, GeneratedSource) and not infos[kind]:
                infos[kind] = source.info.to_items()
        mods.append((dialect, score and str(score), mask and str(mask)))   # the spec holds plain text
    first = families[0]
    note = (f"{'; '.join(notes)}; {first.name} runs" if notes else first.describe(site))
    spec = SiteSpec(families=tuple(f.name for f in families), mods=tuple(mods),
                    score_info=infos["score"], mask_info=infos["mask"], description=description,
                    needs_max=needs_max, note=note)
    failed = kernel_failure(spec)
    if failed is not None:   # our families failed to build for these mods earlier in this process
        return None, failed
    return spec, None


def _is_pow2_at_least_16(x: int) -> bool:
    return x >= 16 and x & (x - 1) == 0
