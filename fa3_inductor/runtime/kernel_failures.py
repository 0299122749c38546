"""When our kernel cannot be built for a site: torch's kernel runs it, and the reason is kept.

The mod generator refuses what it does not know (UnsupportedMod, handled by the planner), but a
compiler can still reject what it accepted, or a kernel can ask for more shared memory than the
GPU has. Such an error must never reach the user (issue 16). The op catches it when it first
builds a launch, records it here under the site's kernel sources, and computes that call densely
with torch ops and the mods' torch dialect, which travels in the spec (torch_forward: torch's own
FlexAttention cannot be re-entered from inside the op). Later plans of the same sources
(``plan_site``, flex()'s direct path) read the record and hand the site to torch's flex kernel up
front, so explain() and the ``fa3_inductor`` log show the reason.

Example::

    >>> kernel_failure(SiteSpec("generic"))      # doctest: +SKIP
    None
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .._log import warn_once
from .spec import SiteSpec

_FAILED: dict[tuple, str] = {}
_MAX_FAILED = 256


def is_build_error(exc: BaseException) -> bool:
    """Whether an exception raised while preparing or compiling a launch means "our kernel cannot be
    built here" (a compiler or interpreter error, too few resources, a mod the kernel cannot call),
    rather than a condition of the device (out of memory, a CUDA error), which must reach the caller."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    return not (isinstance(exc, RuntimeError) and "CUDA error" in str(exc))


def _sources(site: SiteSpec) -> tuple:
    if site.template == "hopper":
        return ("hopper", site.score_mod_gl, site.mask_mod_gl)
    return ("generic", site.score_mod_tl, site.mask_mod_tl)


def kernel_failure(site: SiteSpec) -> Optional[str]:
    """Why our kernel could not be built for this site's mods earlier in this process, or None.

    Example::

        >>> kernel_failure(SiteSpec("generic", score_mod_tl="..."))   # doctest: +SKIP
        'generic kernel failed to build for these mods (CompilationError: ...); torch's kernel runs'
    """
    return _FAILED.get(_sources(site))


def record_kernel_failure(site: SiteSpec, template: str, exc: BaseException) -> str:
    """Remember that ``template``'s kernel failed to build for ``site``'s mods; returns the reason."""
    root = exc
    while root.__cause__ is not None or root.__context__ is not None:   # the interpreter nests errors
        root = root.__cause__ or root.__context__
    first_line = next((line for line in str(root).splitlines() if line.strip()), "")[:300]
    reason = (f"{template} kernel failed to build for these mods ({type(root).__name__}: {first_line}); "
              "torch's kernel runs")
    if len(_FAILED) >= _MAX_FAILED:
        _FAILED.clear()
    _FAILED[_sources(site)] = reason
    if template != site.template:   # the generic kernel stood in for the planned Hopper one
        _FAILED[("generic", site.score_mod_tl, site.mask_mod_tl)] = reason
    warn_once(f"fa3_inductor: {reason} ({site.description})")
    return reason


def clear() -> None:
    """Forget every recorded failure (tests)."""
    _FAILED.clear()


def torch_forward(q: Tensor, k: Tensor, v: Tensor, tables: tuple, score_bufs: list, mask_bufs: list,
                  scale: float, sparse_q_block: int, sparse_kv_block: int, site: SiteSpec
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """(out, lse_log2, max_log2) of one site computed densely with torch ops and the site's
    torch-dialect mods, a batch entry and a slice of heads at a time (scores in float32).

    A correctness path for sites our kernels failed to build, not a fast one: torch's own
    FlexAttention cannot be called from inside the op (it re-enters Dynamo / vmap under the
    compiled graph's dispatch), and the block tables' semantics are ours (runtime/backward_cpu.py).

    Example::

        >>> out, lse, mx = torch_forward(q, k, v, (None,) * 4, [], [], 0.125, 128, 128, site)  # doctest: +SKIP
    """
    from ..templates.modgen_torch import load_torch_mod
    from .backward_cpu import _index_tensors, _keep

    score_fn = site.score_mod_torch and load_torch_mod(site.score_mod_torch)
    mask_fn = site.mask_mod_torch and load_torch_mod(site.mask_mod_torch)
    B, H, M, _ = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    out = q.new_empty((B, H, M, v.shape[-1]))
    lse = q.new_empty((B, H, M), dtype=torch.float32)
    row_max = torch.empty_like(lse)
    heads = max(1, min(H, _SCORES_PER_CHUNK // max(1, M * N)))
    with torch.no_grad():
        for b0 in range(B):
            kb, vb = (t[0 if t.shape[0] == 1 else b0] for t in (k, v))
            b, h_all, q_idx, kv_idx = _index_tensors(b0, H, M, N, q.device)
            for h0 in range(0, H, heads):
                hs = slice(h0, min(H, h0 + heads))
                kv_heads = torch.arange(hs.start, hs.stop, device=q.device) // (H // Hkv)
                h = h_all[:, hs]
                s = (q[b0, hs].float() @ kb[kv_heads].float().transpose(-2, -1) * scale).unsqueeze(0)
                if score_fn:
                    s = torch.broadcast_to(score_fn(s, b, h, q_idx, kv_idx, score_bufs).float(), s.shape)
                keep = _keep(mask_fn or None, mask_bufs, tables, b, h, q_idx, kv_idx, sparse_q_block,
                             sparse_kv_block)
                s = s.masked_fill(~keep.expand_as(s), float("-inf"))
                m = s.amax(-1, keepdim=True)
                live = m > float("-inf")
                p = torch.exp(s - torch.where(live, m, 0.0))
                total = p.sum(-1, keepdim=True)
                o = (p / torch.where(live, total, 1.0))[0] @ vb[kv_heads].float()
                out[b0, hs] = o.to(out.dtype)
                lse[b0, hs] = torch.where(live, m + total.log(), float("-inf"))[0, ..., 0] / math.log(2.0)
                row_max[b0, hs] = m[0, ..., 0] / math.log(2.0)
    return out, lse, row_max


_SCORES_PER_CHUNK = 1 << 26   # 256 MB of float32 scores per step
