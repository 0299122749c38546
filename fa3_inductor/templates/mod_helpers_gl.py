"""Scalar helpers that generated ``gl`` (Gluon) mods call (as ``H.<name>``).

tanh uses the hardware ``tanh.approx.f32`` (FACTS.md: libdevice tanh halves softcap throughput;
max abs error 8e-6 on [-16, 16]). The CPU interpreter cannot run inline PTX, so there tanh is
computed from exp. torch's floor division and remainder round toward -inf; Triton's ``//`` and
``%`` truncate toward zero, so both are corrected here.
"""


from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton import knobs

INTERPRETING = bool(knobs.runtime.interpret)

if INTERPRETING:
    @gluon.jit
    def tanh(x):
        e = gl.exp(-2.0 * gl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return gl.where(x < 0, -t, t)
else:
    @gluon.jit
    def tanh(x):
        return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x.to(gl.float32)],
                                         dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def sigmoid(x):
    return 1.0 / (1.0 + gl.exp(-x))


@gluon.jit
def floordiv(a, b):
    q = a // b
    return q - ((a % b != 0) & ((a < 0) != (b < 0))).to(q.dtype)


@gluon.jit
def truncdiv(a, b):
    return a // b


@gluon.jit
def remainder(a, b):
    r = a % b
    return gl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@gluon.jit
def pow(a, b):
    return gl.exp2(b * gl.log2(a.to(gl.float32)))


@gluon.jit
def atan2(a, b):
    return gl.extra.cuda.libdevice.atan2(a, b)


@gluon.jit
def sign(x):
    return (x > 0).to(x.dtype) - (x < 0).to(x.dtype)


@gluon.jit
def log1p(x):
    return gl.log(1.0 + x)


@gluon.jit
def expm1(x):
    return gl.exp(x) - 1.0


@gluon.jit
def round(x):
    return gl.extra.cuda.libdevice.rint(x)


@gluon.jit
def trunc(x):
    return gl.where(x < 0, gl.ceil(x), gl.floor(x))
