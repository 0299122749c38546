"""Scalar helpers that generated ``tl`` mods call (as ``H.<name>``).

tanh uses the hardware ``tanh.approx.f32`` (FACTS.md: libdevice tanh halves softcap throughput;
max abs error 8e-6 on [-16, 16]). The CPU interpreter cannot run inline PTX, so there tanh is
computed from exp. torch's floor division and remainder round toward -inf; Triton's ``//`` and
``%`` truncate toward zero, so both are corrected here.
"""

import triton
import triton.language as tl
from triton import knobs

INTERPRETING = bool(knobs.runtime.interpret)

if INTERPRETING:
    @triton.jit
    def tanh(x):
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)
else:
    @triton.jit
    def tanh(x):
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x.to(tl.float32)],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def floordiv(a, b):
    q = a // b
    return q - ((a % b != 0) & ((a < 0) != (b < 0))).to(q.dtype)


@triton.jit
def truncdiv(a, b):
    return a // b


@triton.jit
def remainder(a, b):
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def pow(a, b):
    return tl.exp2(b * tl.log2(a.to(tl.float32)))


@triton.jit
def atan2(a, b):
    return tl.extra.cuda.libdevice.atan2(a, b)


@triton.jit
def sign(x):
    return (x > 0).to(x.dtype) - (x < 0).to(x.dtype)


@triton.jit
def log1p(x):
    return tl.log(1.0 + x)


@triton.jit
def expm1(x):
    return tl.exp(x) - 1.0


@triton.jit
def round(x):
    return tl.extra.cuda.libdevice.rint(x)


@triton.jit
def trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))
