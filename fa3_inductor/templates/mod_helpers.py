"""Scalar helpers that generated mods call as ``H.<name>``, written once for both dialects.

Each helper is a plain function over a language module ``L``; :func:`_dialect` binds ``L`` to
``triton.language`` (``@triton.jit``, generic template) or to Gluon's language (``@gluon.jit``,
Hopper template). Generated ``tl`` mods import ``TL as H``, ``gl`` mods ``GL as H``.

tanh uses the hardware ``tanh.approx.f32`` (docs/facts.md: libdevice tanh halves softcap
throughput; max abs error 8e-6 on [-16, 16]); the CPU interpreter cannot run inline PTX, so
there tanh is computed from exp. torch's floor division and remainder round toward -inf;
Triton's ``//`` and ``%`` truncate toward zero, so both are corrected here (ints and floats).
``pow`` covers the float cases that ``exp2(b * log2(a))`` alone gets wrong (negative bases,
0 ** 0); integer and constant exponents never reach it (modgen's lower_pow).
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
    # and refuse M or N >= 2**23 (modgen.MAX_POSITION).
    return (x + 0x4B000000).to(L.float32, bitcast=True) - 8388608.0


def as_bool(x):
    return x


def as_bool_interpreted(x):
    # The interpreter stores a float comparison's result as float data under an int1 type;
    # & | ~ with a real int1 then fail. Comparing with 0 gives int1 data.
    return x != 0


def sigmoid(x):
    return 1.0 / (1.0 + L.exp(-x))


def floordiv(a, b):
    q = a // b
    return q - ((a % b != 0) & ((a < 0) != (b < 0))).to(q.dtype)


def floordiv_float(a, b):
    # torch's floor division of floats: from fmod, then floor, rounded to the nearer integer
    # when the quotient came out just below it (what torch's CPU and CUDA kernels do).
    # (selects, not & of float comparisons: see as_bool_interpreted)
    r = a % b
    d = (a - r) / b
    d = L.where(r != 0, L.where((r < 0) != (b < 0), d - 1.0, d), d)
    f = L.floor(d)
    return L.where(d - f > 0.5, f + 1.0, f)


def truncdiv(a, b):
    return a // b


def truncdiv_float(a, b):
    return trunc(a / b)


def remainder(a, b):
    # ints and floats alike: Triton's % is C's fmod (the sign of a); torch's takes b's sign
    r = a % b
    return L.where(r != 0, L.where((r < 0) != (b < 0), r + b, r), r)


def odd_integer_sign(magnitude, b):
    # (-|a|) ** b from |a| ** b: negated for an odd integer b, nan for a fractional b (as torch)
    odd = (b - 2.0 * L.floor(b * 0.5)) == 1.0
    return L.where(L.floor(b) == b, L.where(odd, -magnitude, magnitude), float("nan"))


def pow(a, b):
    # float a ** b with torch's special cases: b == 0 or a == 1 give 1 (even for nan), a negative
    # a needs an integer b, 0 ** b is 0 or inf by b's sign (exp2 of -inf / +inf)
    magnitude = L.exp2(b * L.log2(L.abs(a)))
    r = L.where(a < 0, odd_integer_sign(magnitude, b), magnitude)
    return L.where(b == 0.0, 1.0, L.where(a == 1.0, 1.0, r))


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


_HELPERS = (index_to_float, sigmoid, floordiv, floordiv_float, truncdiv, truncdiv_float, remainder,
            odd_integer_sign, pow, sign, log1p, expm1, round, trunc)


def _dialect(name: str, jit, lang, interpreting: bool) -> types.ModuleType:
    # A module object, not a namespace: Triton snapshots the plain-object globals a kernel
    # uses (deep copy), but treats modules as namespaces of functions.
    # Helpers that call helpers find the jitted versions: each is put in the shared namespace.
    namespace = {**globals(), "L": lang}
    ns = types.ModuleType(f"{__name__}.{name}")
    tanh = tanh_exp if interpreting else tanh_approx
    as_bool_fn = as_bool_interpreted if interpreting else as_bool
    for public, fn in [(f.__name__, f) for f in _HELPERS] + [("tanh", tanh), ("as_bool", as_bool_fn)]:
        namespace[public] = jit(types.FunctionType(fn.__code__, namespace, fn.__name__))
        setattr(ns, public, namespace[public])
    return ns


TL = _dialect("TL", triton.jit, tl, bool(knobs.runtime.interpret))
GL = _dialect("GL", gluon.jit, gl, False)  # Gluon has no interpreter
