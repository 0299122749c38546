"""exp2 of a score tile with part of it on the FMA / ALU pipes instead of the special-function unit (MUFU).

A Hopper SM issues 16 MUFU operations a clock against 128 FP32 FMAs. Where a score_mod spends MUFU per score
(softcap's tanh), tanh and the softmax's exp2 together are what a step waits on; computing half of the exp2s by a
polynomial moves them to the idle FMA pipe (FlashAttention-4's technique). The Hopper forward uses it for such mods at
D64 (hopper/fwd_sm90.py, FLAGS.EXP2_EMU). The backward tried it and was 0-7% slower (its step is not MUFU-bound:
docs/design/hopper_backward.md, "Half of P's exp2 on the FMA pipe").

Notation: x is a [rows, cols] fp32 tile in a wgmma accumulator layout; the column bits >= 3 of that layout live in
one thread's registers, so splitting the columns in two halves and joining them back moves no data.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# 2^f on [-0.5, 0.5] as 1 + f*(C1 + f*(C2 + f*C3)): relative-error fit with p(0) = 1 exactly (so that
# 2^-inf comes out as +0.0, see exp2_fma); max relative error 1.01e-4 (numpy, float32, 1e6 points), 19x
# under bf16's half-ulp 2^-9 that P is rounded to anyway.
EXP2_C1 = gl.constexpr(0.6932829022407532)
EXP2_C2 = gl.constexpr(0.2422107756137848)
EXP2_C3 = gl.constexpr(0.055008821189403534)


@gluon.jit
def exp2_fma(x):
    """2^x for x <= 0 (-inf -> +0.0) on the FMA/ALU pipes instead of MUFU.EX2: x = j + f with j = round(x) by a
    magic-number add (no F2I), 2^f by the polynomial above, and j added into the exponent field. 9 FMA/ALU
    instructions.

    Example (inside a Gluon kernel)::

        p = exp2_fma(s * qk_scale - m[:, None])
    """
    x = gl.maximum(x, -127.0)
    t = x + 12582912.0                   # 1.5 * 2^23: t's low mantissa bits now hold round(x)
    f = x - (t - 12582912.0)             # in [-0.5, 0.5]
    p = (EXP2_C3 * f + EXP2_C2) * f + EXP2_C1
    p = p * f + 1.0
    # (bits of t) << 23 == round(x) << 23 (mod 2^32): shifts the magic's bits out, keeps j's.
    # j = -127 (x = -inf) with p(0) = 1 lands exactly on the bits of +0.0.
    bits = p.to(gl.int32, bitcast=True) + (t.to(gl.int32, bitcast=True) << 23)
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def split_cols(x):
    """[R, C] -> columns [0, C/2) and [C/2, C) (no data moves in a wgmma accumulator layout).

    Example (inside a Gluon kernel)::

        lo, hi = split_cols(s)
    """
    R: gl.constexpr = x.shape[0]
    C: gl.constexpr = x.shape[1]
    return gl.split(gl.permute(gl.reshape(x, [R, 2, C // 2]), (0, 2, 1)))


@gluon.jit
def join_cols(a, b, layout: gl.constexpr):
    """split_cols' inverse: [R, C/2] x 2 -> [R, C] in ``layout``.

    Example (inside a Gluon kernel)::

        s = join_cols(lo, hi, s_layout)
    """
    R: gl.constexpr = a.shape[0]
    C: gl.constexpr = a.shape[1]
    return gl.convert_layout(gl.reshape(gl.permute(gl.join(a, b), (0, 2, 1)), [R, 2 * C]), layout)


@gluon.jit
def exp2_tile(x, EMU: gl.constexpr):
    """exp2 of a score tile; EMU: the upper half of its columns by exp2_fma (the FMA pipe), else all on MUFU.

    Example (inside a Gluon kernel)::

        p = exp2_tile(s * qk_scale2 - lse[:, None], FLAGS.EXP2_EMU)
    """
    layout: gl.constexpr = x.type.layout
    if EMU:
        lo, hi = split_cols(x)
        p = join_cols(gl.exp2(lo), exp2_fma(hi), layout)
    else:
        p = gl.exp2(x)
    return p
