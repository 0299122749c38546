"""Whether rewriting a recognized attention site pays at its size, on CUDA.

Below some size our op's host cost and small grids lose to what the stock Inductor does with the
same code (issue 16: "never slower than stock Inductor"). Measured on an H100 (benchmarks/results/
first-use-nvidia-h100-80gb-hbm3-2026-11-24-1526: an attention layer written by hand, 16 heads,
causal, backend="fa3" against the stock Inductor, forward): B1 T1024 D128 (2.1e9 multiply-adds of
q·k) 0.62x in default mode and 0.77x under CUDA graphs, B4 T512 D64 (1.1e9) 1.09x / 0.80x, B1 T2048
(8.6e9) 1.31x / 1.63x, and 1.6-4.4x from there up. Sites below MIN_WORK stay as written, with the
reason in explain(). Plain SDPA calls have their own rule (recognize_sdpa.PLAIN_SDPA_MIN_WORK).
The CPU interpreter path always rewrites: it exists to check our kernel's numerics.

Example::

    >>> small_site_reason(torch.empty(1, 16, 1024, 128, device="meta"), torch.empty(1, 16, 1024, 128, device="meta"))
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

MIN_WORK = 4e9   # q·k multiply-adds (B·H·M·N·D) below which a recognized site is left as written


def small_site_reason(example_query: torch.Tensor, example_value: Optional[torch.Tensor]) -> Optional[str]:
    """Why a recognized site on CUDA is too small for the rewrite to pay, or None.

    Example::

        >>> small_site_reason(torch.empty(4, 16, 512, 64, device="cuda"), torch.empty(4, 16, 512, 64, device="cuda"))  # doctest: +SKIP
        'small attention (1.1e+09 multiply-adds of q·k, below 4e+09): the stock Inductor is faster at this size'
    """
    q = example_query
    if q.device.type != "cuda" or example_value is None:
        return None
    b, h, m, d = (int(x) for x in q.shape)
    work = b * h * m * int(example_value.shape[-2]) * d
    if work < MIN_WORK:
        return (f"small attention ({work:.1e} multiply-adds of q·k, below {MIN_WORK:.0e}): the stock "
                "Inductor is faster at this size")
    return None


def unless_small(served: Callable[[torch.Tensor, Optional[torch.Tensor]], Optional[str]]
                 ) -> Callable[[torch.Tensor, Optional[torch.Tensor]], Optional[str]]:
    """``served`` (why our kernels cannot serve a site, or None) that also refuses small CUDA sites.

    Example::

        >>> rewrite_manual(gm, unless_small(flex_lowering.unserved_reason))   # doctest: +SKIP
    """
    def served_and_pays(q: torch.Tensor, v: Optional[torch.Tensor] = None) -> Optional[str]:
        return served(q, v) or small_site_reason(q, v)

    return served_and_pays
