"""Scores of any size in the online softmax: exp2's argument from the rounded product.

The kernels compute ``p = exp2(s * c - m)`` with ``m = round(max(s) * c)`` (c: the scale to log2
units). Compiled for a GPU, ``s * c - m`` is one contracted FFMA: the product is exact, m is
rounded, so the argument can exceed 0 by half an ulp of m. For ordinary scores that is ~1e-7 and
harmless, but a score_mod that adds a large finite mask value (LongT5's -1e10, ``-1e30``,
``finfo(bfloat16).min`` in float32 units) puts m there on a row whose first KV tile is all masked:
half an ulp of 1.4e10 is 1024, exp2(1024) = inf, and the next tile's alpha = 0 turns the row into
inf * 0 = NaN (measured on an H100: every row of LongT5's local attention NaN; -1e8 fine, -1e10 not).

A WIDE site (``ModInfo.wide``: the mod reads a float buffer or holds a float literal >= 2^20)
rounds the product first (PTX ``mul.rn``, which is never contracted) and subtracts m from it, as
eager's softmax does: the max element gives exactly 0, every other argument is <= 0. One more
instruction per score, so narrow mods (ALiBi, softcap, index biases) keep the FFMA. The CPU
interpreter never contracts, so it needs neither (and has no inline assembly).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from .modgen import mod_info


def wide_scores(score_mod: Any, compiled: bool) -> bool:
    """Whether a kernel compiled for a GPU (``compiled``) must round score * scale before exp2.

    Example::

        >>> wide_scores(None, True)
        False
    """
    return bool(compiled and score_mod is not None and mod_info(score_mod).wide)


@triton.jit
def log2_units(s, scale, WIDE: tl.constexpr):
    """``s * scale``, rounded to fp32 and kept apart from the subtraction that follows when WIDE
    (module docstring); else a plain multiply the compiler may fuse into the exp2 FMA."""
    if WIDE:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [s, scale],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return s * scale
