"""Whether rewriting a recognized attention site pays at its size, on CUDA.

Below some size our op's host cost and small grids lose to what the stock Inductor does with the
same code (issue 16: "never slower than stock Inductor"). Measured on an H100 (benchmarks/results/
first-use-nvidia-h100-80gb-hbm3-2026-11-24-1526: an attention layer written by hand, 16 heads,
causal, backend="fa3" against the stock Inductor, forward): B1 T1024 D128 (2.1e9 multiply-adds of
q·k) 0.62x in default mode and 0.77x under CUDA graphs, B4 T512 D64 (1.1e9) 1.09x / 0.80x, B1 T2048
(8.6e9) 1.31x / 1.63x, and 1.6-4.4x from there up. Sites below MIN_WORK stay as written, with the
reason in explain(). Plain SDPA calls have their own rule (PLAIN_SDPA_MIN_WORK, below).
The CPU interpreter path always rewrites: it exists to check our kernel's numerics.

Example::

    >>> small_site_reason(torch.empty(1, 16, 1024, 128, device="meta"), torch.empty(1, 16, 1024, 128, device="meta"))
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

MIN_WORK = 4e9   # q·k multiply-adds (B·H·M·N·D) below which a recognized site is left as written

# In a training graph the rewrite brings our forward plus torch's flex backward against the stock
# Inductor's matmul + softmax forward and backward. Measured on an H100 (benchmarks/results/
# first-use-nvidia-h100-80gb-hbm3-2026-11-24-2017-issue16, run 2004: the hand-written layer, causal,
# 16 heads, D=128, one training step, default mode): B1 T2048 (8.6e9) 0.91x, B2 T2048 (1.7e10) 1.30x.
# Training sites below this stay as written; the boundary lies between those two points.
TRAIN_MIN_WORK = 1.2e10

# A plain SDPA call (no attn_mask) is what torch's own SDPA kernels serve best: on Hopper they are
# cuDNN's, at the speed of our forward kernel (README), with cuDNN's backward and no host cost of
# ours. Measured on an H100 (benchmarks/results/first-use-nvidia-h100-80gb-hbm3-2026-11-24-1443,
# an attention layer of 16 heads, causal, compiled with backend="fa3" against the stock Inductor):
# below ~1.7e10 multiply-adds of attention the rewrite lost 0.56-0.97x in forward (our op's host
# cost, and tiny grids), and training steps lost 0.83-0.96x from 2k tokens on (our forward plus
# torch's flex backward against SDPA's own). Such calls stay SDPA on CUDA: rewritten only in
# inference graphs doing at least this much work (q·k multiply-adds, halved under is_causal).
PLAIN_SDPA_MIN_WORK = 3.2e10


def attention_work(q_shape, kv_len: int, causal: bool = False) -> float:
    """q·k multiply-adds of one attention call: B·H·M·N·D, halved under a causal mask. q may be
    [B, H, M, D] or 3-D [B*H, M, D] (diffusers' classic processor, BART-style bmm).

    Example::

        >>> attention_work((4, 16, 512, 64), 512, causal=True)
        536870912.0
        >>> attention_work((64, 512, 64), 512, causal=True)
        536870912.0
    """
    # Any leading dims ([B, H, M, D], or [B*H, M, D] as bmm writes it) multiply the work alike.
    rows = 1
    for x in q_shape[:-1]:
        rows *= int(x)
    return rows * int(kv_len) * int(q_shape[-1]) * (0.5 if causal else 1.0)


def small_site_reason(example_query: torch.Tensor, example_value: Optional[torch.Tensor]) -> Optional[str]:
    """Why a recognized site on CUDA is too small for the rewrite to pay, or None.

    Example::

        >>> small_site_reason(torch.empty(4, 16, 512, 64, device="cuda"), torch.empty(4, 16, 512, 64, device="cuda"))  # doctest: +SKIP
        'small attention (1.1e+09 multiply-adds of q·k, below 4e+09): the stock Inductor is faster at this size'
    """
    q = example_query
    if q.device.type != "cuda" or example_value is None:
        return None
    work = attention_work(q.shape, example_value.shape[-2])
    if work < MIN_WORK:
        return (f"small attention ({work:.1e} multiply-adds of q·k, below {MIN_WORK:.0e}): the stock "
                "Inductor is faster at this size")
    training = torch.is_grad_enabled() and (q.requires_grad or example_value.requires_grad)
    if training and work < TRAIN_MIN_WORK:
        return (f"small attention in a training graph ({work:.1e} multiply-adds of q·k, below "
                f"{TRAIN_MIN_WORK:.1e}): the stock Inductor's forward and backward are faster at this size")
    return None


def sdpa_keeps_plain_call(device: torch.device, q_shape: list[int], kv_len: int, is_causal: bool,
                          training: bool) -> Optional[str]:
    """Why a plain SDPA call (no attn_mask) stays SDPA (PLAIN_SDPA_MIN_WORK), or None to rewrite it.

    Example::

        >>> sdpa_keeps_plain_call(torch.device("cuda"), [4, 16, 512, 64], 512, True, False)
        'plain SDPA call left to SDPA (cuDNN/flash): 5.4e+08 multiply-adds of attention, below the 3.2e+10 where fa3 pays in inference'
    """
    if device.type != "cuda":
        return None   # the CPU runs our kernel under Triton's interpreter only to check numerics
    if training:
        return ("plain SDPA call in a training graph left to SDPA (cuDNN/flash): its backward beats "
                "fa3's forward + torch's flex backward")
    work = attention_work(q_shape, kv_len, is_causal)
    if work < PLAIN_SDPA_MIN_WORK:
        return (f"plain SDPA call left to SDPA (cuDNN/flash): {work:.1e} multiply-adds of "
                f"attention, below the {PLAIN_SDPA_MIN_WORK:.1e} where fa3 pays in inference")
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
