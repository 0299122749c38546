"""Scalar helpers that generated mods call as ``H.<name>``, written once for both dialects.

Each helper is a plain function over a language module ``L``; :func:`_dialect` binds ``L`` to
``triton.language`` (``@triton.jit``, generic template) or to Gluon's language (``@gluon.jit``,
Hopper template). Generated ``tl`` mods import ``TL as H``, ``gl`` mods ``GL as H``.

tanh uses the hardware ``tanh.approx.f32`` (FACTS.md: libdevice tanh halves softcap
throughput; max abs error 8e-6 on [-16, 16]); the CPU interpreter cannot run inline PTX, so
there tanh is computed from exp. torch's floor division and remainder round toward -inf;
Triton's ``//`` and ``%`` truncate toward zero, so both are corrected here.
"""

import types

import triton
import triton.language as tl
from triton import knobs
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

L = tl  # rebound per dialect by _dialect(); the module-level value is never used by a kernel


def tanh_exp(x):
    e = L.exp(-2.0 * L.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return L.where(x < 0, -t, t)


def tanh_approx(x):
    return L.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x.to(L.float32)],
                                    dtype=L.float32, is_pure=True, pack=1)


def index_to_float(x):
    # float32(x) for an int32 index 0 <= x < 2**23 without I2F (a quarter-rate conversion on
    # sm90): x added to the bits of the float 2**23 is the float 2**23 + x, and 2**23 is then
    # subtracted. Exact in that range; the templates clamp q_idx / kv_idx into [0, M) / [0, N)
    # and the sm90 template refuses M or N >= 2**23.
    return (x + 0x4B000000).to(L.float32, bitcast=True) - 8388608.0


def sigmoid(x):
    return 1.0 / (1.0 + L.exp(-x))


def floordiv(a, b):
    q = a // b
    return q - ((a % b != 0) & ((a < 0) != (b < 0))).to(q.dtype)


def truncdiv(a, b):
    return a // b


def remainder(a, b):
    r = a % b
    return L.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


def pow(a, b):
    return L.exp2(b * L.log2(a.to(L.float32)))


def sign(x):
    return (x > 0).to(x.dtype) - (x < 0).to(x.dtype)


def log1p(x):
    return L.log(1.0 + x)


def expm1(x):
    return L.exp(x) - 1.0


def round(x):
    # Round half to even, as torch.round does.
    f = L.floor(x)
    d = x - f
    even = (f - 2.0 * L.floor(f * 0.5)) == 0.0
    return L.where(d > 0.5, f + 1.0, L.where(d < 0.5, f, L.where(even, f, f + 1.0)))


def trunc(x):
    return L.where(x < 0, L.ceil(x), L.floor(x))


_HELPERS = (index_to_float, sigmoid, floordiv, truncdiv, remainder, pow, sign, log1p, expm1, round, trunc)


def _dialect(name: str, jit, lang, interpreting: bool) -> types.ModuleType:
    # A module object, not a namespace: Triton snapshots the plain-object globals a kernel
    # uses (deep copy), but treats modules as namespaces of functions.
    namespace = {**globals(), "L": lang}
    ns = types.ModuleType(f"{__name__}.{name}")
    for fn in _HELPERS:
        setattr(ns, fn.__name__, jit(types.FunctionType(fn.__code__, namespace, fn.__name__)))
    tanh = tanh_exp if interpreting else tanh_approx
    ns.tanh = jit(types.FunctionType(tanh.__code__, namespace, tanh.__name__))
    return ns


TL = _dialect("TL", triton.jit, tl, bool(knobs.runtime.interpret))
GL = _dialect("GL", gluon.jit, gl, False)  # Gluon has no interpreter
