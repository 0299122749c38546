"""How one attention site is served: the decision shared by the lowering and flex()'s direct path.

Given the mods' graphs and the site's static facts (device, dtype, head counts and dims, block
sizes), either a SiteSpec (template + generated mod sources) or the reason our kernels do not
serve it. Both front doors thereby make the same choice for the same site.

The value head dim may differ from the query/key head dim (DeepSeek-V2/V3's multi-head latent
attention trains with q/k 192, v 128): the generic template serves any such pair within the
head-dim range, the Hopper template the pairs its config table has tiles for.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..config import Settings
from ..runtime.kernel_failures import kernel_failure
from ..runtime.spec import SiteSpec
from ..templates.modgen import (BufferSpec, generate_mod_source, is_constant_true_mask,
                                is_identity_score)
from ..templates.modgen_torch import generate_torch_mod_source

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
              needs_max: bool = True) -> tuple[Optional[SiteSpec], Optional[str]]:
    """(spec, None) when our kernels serve the site, else (None, reason). ``needs_max``: whether
    the row-max output is read (flex_attention's max_scores).

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
    sources: dict[str, Optional[str]] = {}
    identity, all_true = is_identity_score(score_gm), is_constant_true_mask(mask_gm)
    for dialect in ("tl", "gl"):
        sources[f"score_mod_{dialect}"] = None if identity else \
            generate_mod_source(score_gm, "score", score_specs, dialect)
        sources[f"mask_mod_{dialect}"] = None if all_true else \
            generate_mod_source(mask_gm, "mask", mask_specs, dialect)
    sources["score_mod_torch"] = None if identity else \
        generate_torch_mod_source(score_gm, "score", score_specs)
    sources["mask_mod_torch"] = None if all_true else \
        generate_torch_mod_source(mask_gm, "mask", mask_specs)
    template, note = "generic", ""
    on_hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    if on_hopper and settings.template in ("auto", "hopper"):
        why_not = _why_not_hopper(dtype, head_dim, value_head_dim)
        template, note = (("generic", why_not) if why_not else
                          ("hopper", _hopper_tiles(dtype, head_dim, value_head_dim)))
    spec = SiteSpec(template=template, description=description, needs_max=needs_max, note=note,
                    **sources)
    failed = kernel_failure(spec)
    if failed is not None:   # ours failed to build for these mods earlier in this process
        return None, failed
    return spec, None


def _why_not_hopper(dtype: torch.dtype, head_dim: int, value_head_dim: Optional[int] = None) -> str:
    """Why the Hopper template cannot take a site on an sm90 GPU ("" when it can).

    Example::

        >>> _why_not_hopper(torch.bfloat16, 112)   # doctest: +SKIP
        'Hopper template: no tiles for head dim 112 (it serves 64, 80, 96, 128, 160, 192, 256, and q/k 192 with v 128); generic runs'
    """
    try:
        from ..templates.hopper.configs import served_head_dims_text, serves_head_dims
    except ImportError:
        return "Hopper template unavailable (triton's Gluon could not be imported); generic runs"
    if dtype == torch.float32:
        return "Hopper template: float32 inputs (it serves float16 and bfloat16); generic runs"
    if not serves_head_dims(head_dim, value_head_dim):
        dims = (f"head dim {head_dim}" if value_head_dim in (None, head_dim) else
                f"q/k head dim {head_dim} with v head dim {value_head_dim}")
        return (f"Hopper template: no tiles for {dims} (it serves {served_head_dims_text()}); "
                "generic runs")
    return ""


def _hopper_tiles(dtype: torch.dtype, head_dim: int, value_head_dim: Optional[int] = None) -> str:
    """What the Hopper template will run a site with, for the log and explain() (its config table's words).

    Example::

        >>> _hopper_tiles(torch.bfloat16, 128)   # doctest: +SKIP
        'Hopper template: tiles 128x128, 2 K/V stages, pingpong, overlap; schedule per launch'
    """
    from ..templates.hopper.configs import describe

    tiles = describe(head_dim, dtype, value_head_dim=value_head_dim)
    return f"Hopper template: {tiles}; schedule per launch"


def _is_pow2_at_least_16(x: int) -> bool:
    return x >= 16 and x & (x - 1) == 0
