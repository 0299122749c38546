"""Turn a score_mod / mask_mod FX graph into a small jit function the kernels call.

The input is the aten-level graph FlexAttention traces (what Inductor hands the flex_attention
lowering): placeholders ``score, b, h, q_idx, kv_idx`` (mask: no score) followed by the captured
buffers, then pointwise aten ops and ``aten.index.Tensor`` loads from those buffers. The output
is the source of one function in either dialect:

    tl  ``@triton.jit def score_mod(qk, sm_scale, b, h, q_idx, kv_idx, bufs)`` (generic template)
    gl  ``@gluon.jit`` with the same signature, for the Hopper (Gluon) template

A score_mod is handed the raw ``qk`` tile and the scale rather than ``score = qk * sm_scale``,
and returns its result divided by a positive constant, ``out_scale`` (1.0 unless the mod ends in
a multiply by a positive constant). Both are free multiplies folded away: ``score / c`` becomes ``qk * (sm_scale / c)`` (one multiply per score, not two), and
the kernels fold ``out_scale`` into the exp2 FMA that converts to log2 units (softcap's final
``* cap`` costs nothing). A mod that adds a term to the score (``score + x``, ALiBi, biases) is
generated in units of sm_scale, ``qk + x / sm_scale`` (``sm_scaled``: the tile times
``out_scale * sm_scale`` is the score): no ``qk * sm_scale`` per score, and a narrow factor of x
(ALiBi's per-head slope) takes the ``1 / sm_scale`` once, so that the sum is one FFMA. That form
needs sm_scale > 0; the source also holds ``score_mod_unfolded`` for any other scale, and
:func:`kernel_score_mod` picks. ``out_range`` bounds the returned tile where the last op bounds it
(tanh, sigmoid, clamp): the Hopper kernel may then exponentiate against a fixed base instead of
the running row max. ``kv_affine`` marks a ``score + x`` whose x is ``alpha(b, h) * kv + B(b, h, q)``
(ALiBi, relative and head biases): the Hopper kernel then evaluates the same function as a column
vector, a scalar per KV tile and a row vector instead of per score. These facts travel beside the
source as a typed record, :class:`ModInfo` (``generate_mod_source(...).info``); nothing reads them
back from the text. Mask mods take
``(b, h, q_idx, kv_idx, bufs)``, as does ``index_mod`` (:func:`generate_offset_source`: the element
offset of a scatter-add into a captured buffer's gradient).

Buffers arrive as a tuple of pointers; their strides are baked into the code (they are part of
the spec hash).

Cost rules (a score tile is [BLOCK_M, BLOCK_N]; q_idx is a [BLOCK_M, 1] column and kv_idx a
[1, BLOCK_N] row, clamped into [0, M) / [0, N); b and h are scalars). The generator tracks which
of the two index axes every value varies along, so that per-score work stays per score:

* int -> float conversions happen on the 1-D index vectors, before they broadcast: an int
  sum / difference of indices that meets a float is rebuilt in float from its converted leaves
  (``float(kv - q)`` becomes ``float(kv) - float(q)``), exact while every partial sum stays below
  2**24 in magnitude (the generator bounds them: indices < 2**23, b and h < 2**16, and stops
  pushing where the bound could be exceeded). A 32-bit I2F costs like a MUFU op on sm90; the
  index leaves themselves are converted with ``H.index_to_float`` (integer add + float add).
* a float32 result that already covers the tile is returned as is (``x + 0.0`` is not free: it
  cost an FFMA per score).
* multiplies by constants at the score's two ends are folded (above). The result differs from
  the unfolded expression only by float rounding.

Anything the generator does not know raises :class:`UnsupportedMod`, and the
lowering then hands the site to torch's own kernel with that reason: never a silent guess.

Example::

    >>> gm = torch.fx.symbolic_trace(lambda s, b, h, q, kv: s + (q - kv))   # doctest: +SKIP
    >>> print(generate_mod_source(gm, "score", []))                         # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import inspect
import math
import os
import re
import sys
import tempfile
from typing import Any, Optional, Sequence, Union

import torch
import torch.fx

from .. import _compat

_F32_MAX = 3.4028234663852886e+38  # float32's largest finite value
_F32_CLAMP_BOUNDS = f"{-_F32_MAX!r}), {_F32_MAX!r})"   # the end of a clamp to float32's range
aten = torch.ops.aten
prims = torch.ops.prims


class UnsupportedMod(Exception):
    """The mod uses something the generator cannot express; the message says what."""


def _check_from_start(index: int) -> None:
    """A constant index into a captured dimension of dynamic size must count from its start."""
    if index < 0:
        raise UnsupportedMod(f"index {index} counts from the end of a captured dimension of dynamic size; "
                             "index it from the start")


@dataclasses.dataclass(frozen=True)
class RuntimeStride:
    """A stride known only when the kernel runs (a buffer with two dynamic dimensions): the mod
    reads it from the 0-d int64 tensor ``bufs[slot]`` that the lowering appends to the buffers."""

    slot: int


@dataclasses.dataclass(frozen=True)
class BufferSpec:
    """Shape, strides and dtype of one captured buffer, as the generated code sees it. A dynamic
    size is -1; ``permuted``: the buffer reaches the kernels in another dimension order than its
    shape's (lowering/common.buffer_order), so only the strides say where an element is."""

    shape: tuple[int, ...]
    strides: tuple[Union[int, RuntimeStride], ...]
    dtype: torch.dtype
    permuted: bool = False

    @staticmethod
    def of(t: torch.Tensor) -> "BufferSpec":
        return BufferSpec(tuple(t.shape), tuple(t.stride()), t.dtype)


_TL_DTYPES = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.float64: "float64", torch.int32: "int32", torch.int64: "int64",
    torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8", torch.bool: "int1",
}

# Pointwise ops: aten overload -> format string over argument expressions.
# {L} is the language module (tl or gl); H is the dialect's helper module.
_BINARY = {
    aten.add: "({0} + {1})", aten.sub: "({0} - {1})", aten.mul: "({0} * {1})",
    aten.div: "({0} / {1})", aten.rsub: "({1} - {0})",
    aten.lt: "({0} < {1})", aten.le: "({0} <= {1})", aten.gt: "({0} > {1})",
    aten.ge: "({0} >= {1})", aten.eq: "({0} == {1})", aten.ne: "({0} != {1})",
    aten.bitwise_and: "({0} & {1})", aten.bitwise_or: "({0} | {1})",
    aten.bitwise_xor: "({0} ^ {1})",
    aten.logical_and: "(({0} != 0) & ({1} != 0))", aten.logical_or: "(({0} != 0) | ({1} != 0))",
    aten.logical_xor: "(({0} != 0) ^ ({1} != 0))",
    aten.maximum: "{L}.maximum({0}, {1})", aten.minimum: "{L}.minimum({0}, {1})",
    aten.fmod: "({0} % {1})",   # C's fmod, as torch's; // % pow: lower_rounding_division, lower_pow
}
_UNARY = {
    aten.neg: "(-{0})", aten.abs: "{L}.abs({0})", aten.exp: "{L}.exp({0})",
    aten.exp2: "{L}.exp2({0})", aten.log: "{L}.log({0})", aten.log2: "{L}.log2({0})",
    aten.sqrt: "{L}.sqrt({0})", aten.rsqrt: "{L}.rsqrt({0})", aten.sin: "{L}.sin({0})",
    aten.cos: "{L}.cos({0})", aten.floor: "{L}.floor({0})", aten.ceil: "{L}.ceil({0})",
    aten.tanh: "H.tanh({0})", aten.sigmoid: "H.sigmoid({0})",
    aten.reciprocal: "(1.0 / {0})", aten.logical_not: "({0} == 0)",
    aten.bitwise_not: "(~{0})", aten.sign: "H.sign({0})", aten.log1p: "H.log1p({0})",
    aten.expm1: "H.expm1({0})", aten.erf: "{L}.erf({0})", aten.round: "H.round({0})",
    aten.trunc: "H.trunc({0})",
}
# Integer comparisons, and the operator that holds with the operands swapped (a < b <=> b > a).
_SWAPPED = {aten.lt: aten.gt, aten.le: aten.ge, aten.gt: aten.lt, aten.ge: aten.le, aten.eq: aten.eq,
            aten.ne: aten.ne}
_INT32 = (-2 ** 31, 2 ** 31 - 1)
# Unary ops that cost the special-function unit (MUFU) on sm90; counted per score as SFU_OPS.
_SFU_UNARY = {aten.tanh, aten.sigmoid, aten.exp, aten.exp2, aten.log, aten.log2, aten.sqrt, aten.rsqrt,
              aten.sin, aten.cos, aten.reciprocal, aten.log1p, aten.expm1, aten.erf}
_INT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)
_HALF = (torch.float16, torch.bfloat16)
_BITWISE = (aten.bitwise_and, aten.bitwise_or, aten.bitwise_xor)
# Index axes each mod argument varies along; a score tile varies along both.
_TILE = frozenset(("q", "kv"))
_PARAM_AXES = {"score": _TILE, "b": frozenset(), "h": frozenset(),
               "q_idx": frozenset(("q",)), "kv_idx": frozenset(("kv",))}
# Positions a generated mod takes: mod_helpers.index_to_float rebuilds an index as a float exactly for
# 0 <= x < MAX_POSITION, so every template refuses (or splits) sequences, caches and chunks that reach it.
MAX_POSITION = 1 << 23
# Intervals of the index arguments the float rebuild relies on (positions < MAX_POSITION, batch and
# head < 2**16), and the magnitude up to which float32 holds every integer exactly.
_PARAM_BOUND = {"b": (0, 2 ** 16 - 1), "h": (0, 2 ** 16 - 1), "q_idx": (0, MAX_POSITION - 1),
                "kv_idx": (0, MAX_POSITION - 1)}
_EXACT = 2 ** 24
# Shape-only or value-preserving ops on the 0-d tensors a mod sees.
_IDENTITY = {aten.clone, aten.alias, aten.lift_fresh_copy, aten.detach, aten.view,
             aten._unsafe_view, aten.expand, aten.unsqueeze, aten.squeeze, aten.reshape,
             aten.contiguous, aten.positive}
# Ops that make a constant: op -> args -> (value, shape).
_CONSTANT_FILLS = {
    aten.scalar_tensor: lambda a: (a[0], ()),
    aten.full: lambda a: (a[1], a[0]),
    aten.new_full: lambda a: (a[2], a[1]),
    aten.ones: lambda a: (1, a[0]),
    aten.zeros: lambda a: (0, a[0]),
    aten.new_ones: lambda a: (1, a[1]),
    aten.new_zeros: lambda a: (0, a[1]),
    aten.full_like: lambda a: (a[1], ()),
    aten.ones_like: lambda a: (1, ()),
    aten.zeros_like: lambda a: (0, ()),
}


def _packet(target: Any) -> Any:
    return getattr(target, "overloadpacket", target)


def _literal(value: Any) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int):
        return repr(value)
    if isinstance(value, float):
        if value != value:
            return 'float("nan")'
        if value in (float("inf"), float("-inf")):
            return f'float("{value}")'
        return repr(value)
    raise UnsupportedMod(f"constant {value!r} of type {type(value).__name__}")


def _constant_factor(node: torch.fx.Node, x: torch.fx.Node) -> Optional[float]:
    """c if ``node`` is ``x * c``, ``c * x`` or ``x / c`` for a finite non-zero number c."""
    if node.op != "call_function" or node.kwargs or len(node.args) != 2:
        return None
    packet, (a, b) = _packet(node.target), node.args
    if packet is aten.mul and b is x and a is not x:
        a, b = b, a
    if packet not in (aten.mul, aten.div) or a is not x or isinstance(b, bool) or \
            not isinstance(b, (int, float)) or b == 0 or b != b or abs(b) == float("inf"):
        return None
    return float(b) if packet is aten.mul else 1.0 / float(b)


# A float literal this large in a score_mod (a -1e10 / finfo.min mask value) makes its scores "wide".
WIDE_LITERAL = 2.0 ** 20
_FLOAT_LITERAL = re.compile(r"(?<![\w.])(?:\d+\.\d*(?:e[+-]?\d+)?|\d+e[+-]?\d+)")


def _has_wide_literal(text: str) -> bool:
    """Whether generated source ``text`` holds a finite float literal of magnitude >= WIDE_LITERAL
    (integer literals are strides and index constants; inf literals are masks, which stay exact).

    Example::

        >>> _has_wide_literal("v3 = -10000000000.0"), _has_wide_literal("v3 = x * 49152 + 2.5")
        (True, False)
    """
    text = text.replace(_F32_CLAMP_BOUNDS, "")   # a clamp's bounds bound; what it clamps may not
    return any(abs(float(tok)) >= WIDE_LITERAL for tok in _FLOAT_LITERAL.findall(text))


def _value_range(node: Any) -> Optional[tuple[float, float]]:
    """Bounds of a returned tile the kernel may use in place of the running row max (softcap's
    tanh), or None. Masked (-inf) scores are outside it and are handled apart."""
    packet = _packet(node.target) if isinstance(node, torch.fx.Node) and \
        node.op == "call_function" else None
    if packet is aten.tanh:
        return (-1.0, 1.0)
    if packet is aten.sigmoid:
        return (0.0, 1.0)
    if packet is aten.clamp and len(node.args) == 3 and not node.kwargs and \
            all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in node.args[1:]):
        lo, hi = (float(x) for x in node.args[1:])
        return (lo, hi) if lo <= hi else None
    return None


# Ops that return finite values for finite operands (a product may overflow: values of ~1e19 each, which no score
# tile reaches), and the casts, comparisons, selects and index arithmetic of a mod. A division, logarithm,
# exponential, power or root may not (a masked score's f' = 1 / (kv - q) on the diagonal).
_FINITE_OPS = frozenset(
    getattr(aten, name) for name in (
        "add", "sub", "rsub", "mul", "neg", "positive", "abs", "sign", "tanh", "sigmoid", "sin", "cos", "erf",
        "clamp", "clamp_min", "clamp_max", "maximum", "minimum", "where", "round", "trunc", "floor", "ceil",
        "floor_divide", "remainder", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "bitwise_and",
        "bitwise_or", "bitwise_xor", "bitwise_not", "_to_copy", "to", "index", "select", "view", "reshape",
        "unsqueeze", "squeeze", "zeros", "zeros_like", "ones", "ones_like", "scalar_tensor", "detach", "alias",
        "clone"))


def _finite_for_finite_inputs(gm: torch.fx.GraphModule) -> bool:
    """Whether every op of ``gm`` keeps finite operands finite and no literal is infinite or NaN (ModInfo.finite)."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or _packet(node.target) in _FINITE_OPS:
            pass
        elif _packet(node.target) is aten.div and len(node.args) == 2 and isinstance(node.args[1], (int, float)) \
                and not isinstance(node.args[1], bool) and node.args[1] != 0:
            pass   # by a nonzero literal (the literal check below rejects an infinite one)
        else:
            return False
        for a in (*node.args, *node.kwargs.values()):
            if isinstance(a, float) and not math.isfinite(a):
                return False
    return True


def _scaled_result(result: Any, output: torch.fx.Node) -> Optional[tuple[torch.fx.Node, float]]:
    """(x, c) if the mod returns ``x * c`` or ``x / (1/c)`` with c > 0 and nothing else reads it."""
    if not isinstance(result, torch.fx.Node) or list(result.users) != [output]:
        return None
    for x in result.args[:2]:
        c = _constant_factor(result, x) if isinstance(x, torch.fx.Node) else None
        if c is not None and c > 0:
            return x, c
    return None


def _additive_term(node: Any, score: torch.fx.Node) -> Optional[tuple[torch.fx.Node, str]]:
    """(x, sign) if ``node`` is ``score + x``, ``x + score`` or ``score - x`` (sign "+" / "-"),
    with the score read nowhere else (so x, an input of ``node``, cannot read it unless it is it)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.kwargs or \
            len(node.args) != 2 or list(score.users) != [node]:
        return None
    packet, (a, b) = _packet(node.target), node.args
    if packet is aten.add and b is score:
        a, b = b, a
    if packet not in (aten.add, aten.sub) or a is not score or not isinstance(b, torch.fx.Node) \
            or b is score:
        return None
    return b, "+" if packet is aten.add else "-"


@dataclasses.dataclass(frozen=True)
class ModInfo:
    """What the generator knows of a mod it wrote: the planners and the kernels' host code read it
    (typed: a misspelt field is an error, not a silent default). A hand-written mod has the defaults.

    Example::

        >>> generate_mod_source(softcap_graph, "score", [], "gl").info.out_range   # doctest: +SKIP
        (-1.0, 1.0)
    """

    out_scale: float = 1.0   # the returned tile times this (times sm_scale if sm_scaled) is the score
    out_range: Optional[tuple[float, float]] = None   # bounds of every returned value, if the last op bounds them
    sm_scaled: bool = False  # generated as qk + x / sm_scale (needs sm_scale > 0; else the unfolded twin)
    kv_affine: bool = False  # score + alpha(b, h) * kv + B(b, h, q): evaluated per column, tile and row
    sfu_ops: int = 0         # special-function (MUFU) ops per score
    mask_and: bool = False   # a mask_mod returning an AND of conditions (one select per score)
    gathers: bool = False    # reads a captured buffer
    wide: bool = False       # may return finite scores of any size (reads a float buffer, or a float
                             # literal >= WIDE_LITERAL): kernels take exp2's argument from the rounded
                             # product (wide_scores.py), since a contracted FMA overflows at |score| ~ 2^31
    finite: bool = False     # a score kind whose values are finite wherever its inputs are (its ops and
                             # literals, no float buffer): a score_mod's derivative needs no guard where P = 0

    def to_items(self) -> tuple:
        """The record as (field, value) pairs, for a JSON spec."""
        return tuple(dataclasses.asdict(self).items())

    @staticmethod
    def from_items(items: Sequence) -> "ModInfo":
        """The record back from :meth:`to_items` (after a JSON round trip).

        Example::

            >>> ModInfo.from_items(ModInfo(out_range=(-1.0, 1.0)).to_items()).out_range
            (-1.0, 1.0)
        """
        fields = dict(items)
        if fields.get("out_range") is not None:
            fields["out_range"] = tuple(fields["out_range"])
        return ModInfo(**fields)


HAND_WRITTEN = ModInfo()


class GeneratedSource(str):
    """A generated mod's source text, with the generator's record of it (``info``)."""

    info: ModInfo

    def __new__(cls, text: str, info: ModInfo) -> "GeneratedSource":
        obj = super().__new__(cls, text)
        obj.info = info
        return obj

    def __reduce__(self) -> tuple:   # copies and pickles keep the record
        return GeneratedSource, (str(self), self.info)


class _Emitter:
    # Kernel dialects take (qk, sm_scale) and fold constant multiplies (module docstring).
    FOLD_SCALES = True
    BINARY = _BINARY
    # Buffer shapes are known (strides are baked in); the torch dialect is given dtypes only.
    KNOWS_SHAPES = True

    def __init__(self, gm: torch.fx.GraphModule, kind: str, buffers: Sequence[BufferSpec],
                 dialect: str, fold_sm_scale: bool = True):
        self.gm, self.kind, self.buffers, self.dialect = gm, kind, list(buffers), dialect
        # `score + x` -> `qk + x / sm_scale` (the tile in units of sm_scale; needs sm_scale > 0)
        self.fold_sm_scale = fold_sm_scale
        self.additive: Optional[tuple[torch.fx.Node, torch.fx.Node, str]] = None  # (sum, x, sign)
        self.prescaled: set[torch.fx.Node] = set()  # x emitted already divided by sm_scale
        self.inv_sm: Optional[str] = None
        self.kv_affine = False  # x of `score + x` is alpha(b, h) * kv + B(b, h, q): see affine_in_kv
        # `q - kv < c` emitted as `kv > q - c` (see isolate_kv): comparison -> (op, kv side, other side)
        self.isolated: dict[torch.fx.Node, tuple[Any, str, str]] = {}
        self.sfu_ops = 0  # special-function (MUFU) ops per score: tanh, exp, ... on a score tile
        self.gathers = False  # reads a captured buffer (gather)
        self.float_gathers = False  # reads a float buffer: its values are unbounded (ModInfo.wide)
        self.info: Optional[ModInfo] = None   # set by emit()
        self.L = "tl" if dialect == "tl" else "gl"
        self.names: dict[torch.fx.Node, str] = {}
        self.lines: list[str] = []
        self.prologue: list[str] = []  # `score = qk * sm_scale` where the score is read unscaled
        self.folded_inputs: dict[torch.fx.Node, float] = {}  # score * c -> c
        self.dtypes: dict[torch.fx.Node, torch.dtype | None] = {}
        # Index axes a value varies along ("q", "kv"), the interval of int values that the
        # float rebuild may use, and float versions of int values already emitted.
        self.axes: dict[torch.fx.Node, frozenset] = {}
        self.bound: dict[torch.fx.Node, tuple[int, int]] = {}
        self.floats: dict[torch.fx.Node, str] = {}
        # Sound int intervals over every op known_interval understands (gather wrap, int pow).
        self.intervals: dict[torch.fx.Node, Optional[tuple[int, int]]] = {}
        # A captured buffer indexed in part (``table[h]`` before ``[q]``): node -> (buffer, indices),
        # and the loaded values of views indexed down to one element.
        self.buffer_of: dict[torch.fx.Node, int] = {}
        self.views: dict[torch.fx.Node, tuple[torch.fx.Node, tuple]] = {}
        self.view_values: dict[torch.fx.Node, str] = {}
        self.float_compares: set[torch.fx.Node] = set()   # bools from comparing floats (see logical)

    def arg(self, a: Any) -> str:
        if isinstance(a, torch.fx.Node):
            view = self.view_of(a)
            if view is not None:
                return self.view_value(a, view)
            if a not in self.names:
                raise UnsupportedMod(f"value {a.name} is used before it is defined")
            return self.names[a]
        return _literal(a)

    def view_of(self, a: Any) -> Optional[tuple[torch.fx.Node, tuple]]:
        """(buffer, indices so far) if ``a`` is a captured buffer or a part of one, else None."""
        if not isinstance(a, torch.fx.Node):
            return None
        if a in self.views:
            return self.views[a]
        return (a, ()) if a in self.buffer_of else None

    def view_value(self, node: torch.fx.Node, view: tuple[torch.fx.Node, tuple]) -> str:
        """A buffer (part) used as a value: loaded once if it holds one element, else refused."""
        if node not in self.view_values:
            buf, indices = view
            spec = self.buffers[self.buffer_of[buf]]
            rest = spec.shape[len(indices):]
            if self.KNOWS_SHAPES and math.prod(rest) != 1:
                raise UnsupportedMod(
                    f"{self.kind}_mod uses a captured tensor of shape {list(rest)} as a whole; "
                    "index it down to one element per score (e.g. bias[h], table[h, q_idx - kv_idx])")
            gathered = self.gather(buf, spec, (*indices, *(0,) * (len(rest) if self.KNOWS_SHAPES else 0)))
            self.view_values[node] = self.line(self.loaded(spec, gathered))
        return self.view_values[node]

    def dtype_of(self, a: Any) -> torch.dtype | None:
        if isinstance(a, torch.fx.Node):
            return self.dtypes.get(a)
        return None

    def emit(self) -> str:
        index_params = ["b", "h", "q_idx", "kv_idx"]
        params = (["score"] if self.kind == "score" else []) + index_params
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(params) + len(self.buffers):
            raise UnsupportedMod(
                f"{self.kind}_mod graph has {len(placeholders)} inputs; expected "
                f"{len(params)} index/score inputs and {len(self.buffers)} captured buffers")
        tensors = 0  # a None spec is a captured scalar (a size symbol): it gets no pointer
        for i, node in enumerate(placeholders):
            if i < len(params):
                self.names[node] = params[i]
                self.dtypes[node] = torch.float32 if params[i] == "score" else torch.int32
                self.axes[node] = _PARAM_AXES[params[i]]
                if params[i] != "score":
                    self.bound[node] = _PARAM_BOUND[params[i]]
                continue
            spec = self.buffers[i - len(params)]
            if spec is None:
                if node.users:
                    raise UnsupportedMod(f"{self.kind}_mod computes with a captured scalar "
                                         f"({node.name}); capture it as a 0-d tensor instead")
                continue
            self.names[node] = f"bufs[{tensors}]"
            self.dtypes[node] = spec.dtype
            self.axes[node] = frozenset()
            self.buffer_of[node] = i - len(params)
            tensors += 1
        output = next((n for n in self.gm.graph.nodes if n.op == "output"), None)
        if output is None:
            raise UnsupportedMod(f"{self.kind}_mod graph has no output")
        result = output.args[0]
        if isinstance(result, (tuple, list)):
            if len(result) != 1:
                raise UnsupportedMod(f"{self.kind}_mod returns {len(result)} values")
            result = result[0]
        out_scale, scaled = 1.0, None
        fold = self.kind == "score" and self.FOLD_SCALES
        if fold:
            score = placeholders[0]
            scaled = _scaled_result(result, output)
            total = scaled[0] if scaled else result
            term = _additive_term(total, score) if self.fold_sm_scale else None
            if term:
                self.additive = (total, *term)
            else:
                # Readers of the score, less a final `* c` that the kernel takes over.
                readers = [u for u in score.users if not (scaled and u is result)]
                self.folded_inputs = {u: f for u in readers if (f := _constant_factor(u, score))}
                if len(self.folded_inputs) < len(readers) or (scaled and scaled[0] is score):
                    self.prologue.append("score = qk * sm_scale")
        for node in self.gm.graph.nodes:
            if node.op in ("placeholder", "output") or (scaled and node is result) or \
                    (self.additive and node is self.additive[0]):
                continue
            if node.op != "call_function":
                raise UnsupportedMod(f"graph node {node.name} is a {node.op} (captured constant "
                                     "or module call); pass tensors as captured buffers")
            self.lower(node)
        if self.additive:
            self.lower_additive()
            # The Hopper kernel's row part sums the term over a column of rows: it must vary
            # along q (a term of b, h or kv alone is added per score instead)
            term = self.additive[1]
            self.kv_affine = "q" in self.axes.get(term, frozenset()) and self.affine_in_kv(term)
        if scaled:
            inner, factor = scaled
            if self.axes.get(inner) == _TILE and self.dtype_of(inner) is torch.float32:
                result, out_scale = inner, factor
            else:  # not a float32 score tile: keep the multiply
                self.lower(result)
        ret = self.arg(result)
        if self.kind == "score":
            if self.dtype_of(result) in _INT_DTYPES:
                ret = self.float_of(result)
            if not (isinstance(result, torch.fx.Node) and self.axes.get(result) == _TILE
                    and self.dtype_of(result) in (torch.float32,) + _INT_DTYPES):
                # The kernel needs a [BLOCK_M, BLOCK_N] fp32 tile even if the mod ignored score.
                tile = "qk" if fold else "score"
                ret = f"({ret} + {self.L}.zeros_like({tile})).to({self.L}.float32)"
        elif self.kind == "mask" and self.dtype_of(result) not in (torch.bool, None):
            ret = f"({ret} != 0)"
        fn = f"{self.kind}_mod"   # score_mod, mask_mod, index_mod (generate_offset_source)
        sig = ", ".join((["qk", "sm_scale"] if fold else params[:1] if self.kind == "score" else [])
                        + index_params + ["bufs"])
        deco = "@triton.jit" if self.dialect == "tl" else "@gluon.jit"
        body = "\n".join(f"    {line}" for line in self.prologue + self.lines + [f"return {ret}"])
        bounds = _value_range(result)
        self.info = ModInfo(
            out_scale=float(out_scale) if fold else 1.0,
            out_range=bounds if fold else None,
            sm_scaled=bool(fold and self.additive), kv_affine=bool(fold and self.kv_affine),
            sfu_ops=self.sfu_ops if fold else 0, gathers=self.gathers,
            wide=(self.kind == "score" and bounds is None
                  and (self.float_gathers or _has_wide_literal(body))),
            finite=(self.kind == "score" and not self.float_gathers and _finite_for_finite_inputs(self.gm)),
            mask_and=(self.kind == "mask" and isinstance(result, torch.fx.Node)
                      and result.op == "call_function"
                      and _packet(result.target) in (aten.bitwise_and, aten.logical_and)))
        return f"{deco}\ndef {fn}({sig}):\n{body}\n"

    def affine_in_kv(self, node: Any) -> bool:
        """True if ``node`` is ``alpha(b, h) * kv_idx + B(b, h, q_idx)``: affine in kv with a slope
        that varies with neither index (B may be anything that does not read kv). Such a term
        splits exactly into a column part, a per-tile constant and a per-row part, which the Hopper
        kernel evaluates apart (KV_AFFINE; see its _affine_columns / _affine_rows): one op per score instead of the
        index arithmetic. Only sums, differences, negations, value-preserving casts, and products or
        true divisions of a float by a value that varies along neither index keep the form."""
        if not isinstance(node, torch.fx.Node) or "kv" not in self.axes.get(node, frozenset()):
            return True
        if node.op == "placeholder":
            return self.names.get(node) == "kv_idx"
        if node.op != "call_function":
            return False
        packet, args = _packet(node.target), node.args
        dtype = self.dtype_of(node)
        if packet in _IDENTITY:
            return self.affine_in_kv(args[0])
        if node.target in (aten._to_copy.default, prims.convert_element_type.default) or packet is aten.to:
            src = self.dtype_of(args[0]) if isinstance(args[0], torch.fx.Node) else None
            widening = dtype in (torch.float32, torch.float64) or (
                dtype in (torch.int32, torch.int64) and src in (torch.int32, torch.int64))
            return widening and self.affine_in_kv(args[0])
        if packet in (aten.add, aten.sub, aten.rsub) and node.kwargs.get("alpha", 1) == 1:
            return all(self.affine_in_kv(a) for a in args[:2])
        if packet is aten.neg:
            return self.affine_in_kv(args[0])
        if packet in (aten.mul, aten.div) and not node.kwargs and dtype is torch.float32:
            a, b = args[:2]
            def uniform(x: Any) -> bool:
                return not isinstance(x, torch.fx.Node) or not self.axes.get(x, frozenset())
            if packet is aten.mul and uniform(a):
                a, b = b, a
            return uniform(b) and self.affine_in_kv(a)
        return False

    def inv_sm_scale(self) -> str:
        if self.inv_sm is None:
            self.inv_sm = self.line("1.0 / sm_scale")
        return self.inv_sm

    def prescaled_product(self, node: torch.fx.Node) -> Optional[str]:
        """``a * b`` with its narrow factor (a scalar, a row or a column) divided by sm_scale,
        for the additive term of a folded score (``qk + a' * b`` is then one FFMA per score)."""
        if _packet(node.target) is not aten.mul or node.kwargs or len(node.args) != 2 or \
                len(node.users) != 1:
            return None
        def width(x: Any) -> int:
            return len(self.axes.get(x, frozenset())) if isinstance(x, torch.fx.Node) else 0
        a, b = sorted(node.args, key=width)
        if width(a) == 2 or (isinstance(a, bool) or not isinstance(a, (int, float, torch.fx.Node))):
            return None
        # Clamped to float32's range: a mask's finfo.min over sm_scale is -inf, and -inf times the
        # other factor's 0 (the visible entries of `(1 - m) * finfo.min`) would be NaN. The clamp
        # acts on the narrow factor only (a scalar, row or column), not per score.
        factor = self.operand(a, True) if isinstance(a, torch.fx.Node) else _literal(float(a))
        L = self.L
        narrow = self.line(f"{L}.minimum({L}.maximum({factor} * {self.inv_sm_scale()}, "
                           f"{_F32_CLAMP_BOUNDS}")
        return f"({narrow} * {self.operand(b, True)})"

    def lower_additive(self) -> None:
        """``score + x`` as ``qk + x / sm_scale``: the tile in units of sm_scale (SM_SCALED)."""
        node, x, sign = self.additive
        term = self.names[x] if x in self.prescaled else f"{self.operand(x, True)} * {self.inv_sm_scale()}"
        self.assign(node, f"(qk {sign} {term})", torch.float32)

    def assign(self, node: torch.fx.Node, expr: str, dtype: torch.dtype | None) -> None:
        name = f"v{len(self.lines)}"
        self.lines.append(f"{name} = {expr}")
        self.names[node] = name
        self.dtypes[node] = dtype
        if node not in self.axes:
            self.axes[node] = frozenset().union(
                *(self.axes.get(a, frozenset()) for a in node.all_input_nodes))

    def line(self, expr: str) -> str:
        """Emit a helper value that belongs to no graph node; returns its name."""
        name = f"v{len(self.lines)}"
        self.lines.append(f"{name} = {expr}")
        return name

    def float_of(self, a: Any) -> str:
        """Expression for float32(a) where a is an int value, converting as early as exactness
        allows: index leaves before they broadcast, sums / differences rebuilt in float."""
        if not isinstance(a, torch.fx.Node):
            return _literal(float(a))
        if a in self.floats:
            return self.floats[a]
        packet = _packet(a.target) if a.op == "call_function" else None
        if a.op == "placeholder" and self.names[a] in ("q_idx", "kv_idx"):
            expr = self.line(f"H.index_to_float({self.names[a]})")
        elif packet in _IDENTITY and a.args and self.dtype_of(a.args[0]) in _INT_DTYPES:
            expr = self.float_of(a.args[0])
        elif self._rebuildable(a, packet):
            xs = [self.float_of(x) for x in a.args[:2]]
            op = {aten.add: "({0} + {1})", aten.sub: "({0} - {1})", aten.rsub: "({1} - {0})",
                  aten.neg: "(-{0})"}[packet]
            expr = self.line(op.format(*xs))
        else:
            expr = self.line(f"{self.arg(a)}.to({self.L}.float32)")
        self.floats[a] = expr
        return expr

    def _rebuildable(self, a: torch.fx.Node, packet: Any) -> bool:
        if packet not in (aten.add, aten.sub, aten.rsub, aten.neg) or a.kwargs.get("alpha", 1) != 1:
            return False
        # Every operand and the result must be integers of magnitude <= 2**24 (exact in float32),
        # so that the float sum equals the converted int sum.
        ivs = [self.bound.get(a)]
        for x in a.args[:1] if packet is aten.neg else a.args[:2]:
            if isinstance(x, torch.fx.Node):
                if self.dtype_of(x) not in _INT_DTYPES:
                    return False
                ivs.append(self.bound.get(x))
            elif isinstance(x, int) and not isinstance(x, bool):
                ivs.append((x, x))
            else:
                return False
        return all(iv is not None and -_EXACT <= iv[0] and iv[1] <= _EXACT for iv in ivs)

    def int_bound(self, node: torch.fx.Node) -> None:
        """Interval of an int sum / difference / negation of values with known intervals."""
        packet = _packet(node.target)
        if packet not in (aten.add, aten.sub, aten.rsub, aten.neg) or \
                self.dtypes.get(node) not in _INT_DTYPES or node.kwargs.get("alpha", 1) != 1:
            return
        iv = []
        for x in node.args[:1] if packet is aten.neg else node.args[:2]:
            if isinstance(x, torch.fx.Node):
                if x not in self.bound:
                    return
                iv.append(self.bound[x])
            elif isinstance(x, int) and not isinstance(x, bool):
                iv.append((x, x))
            else:
                return
        if packet is aten.rsub:
            iv.reverse()
        if packet is aten.neg:
            self.bound[node] = (-iv[0][1], -iv[0][0])
        elif packet is aten.add:
            self.bound[node] = (iv[0][0] + iv[1][0], iv[0][1] + iv[1][1])
        else:
            self.bound[node] = (iv[0][0] - iv[1][1], iv[0][1] - iv[1][0])

    def isolate_kv(self, node: torch.fx.Node) -> bool:
        """Plan ``A - K < C`` as ``K > A - C`` (and the like for K - A, A + K and every comparison), where K
        varies along kv only and A, C along neither kv nor anything unknown: A - C is then computed
        once per row instead of A - K once per score (a sliding window's ``q - kv < w`` costs an
        IMAD per score in the Hopper kernel's masked tiles otherwise). Only integers, only when
        every reader of ``node`` is such a comparison, and only where the intervals of A and C
        show that the moved sum stays inside int32 (then both forms agree exactly). Returns True
        if the readers were planned (``node`` itself is then not emitted)."""
        a, k = node.args[:2] if len(node.args) == 2 else (None, None)
        if self.dtypes.get(a) not in _INT_DTYPES and self.dtypes.get(k) not in _INT_DTYPES:
            return False
        # node = a + k (sign 1), a - k (sign -1) or k - a (sign 0)
        sign = 1 if _packet(node.target) is aten.add else -1
        if self.axes.get(k) != frozenset(("kv",)):
            a, k = k, a
            sign = 1 if sign == 1 else 0
        if not isinstance(k, torch.fx.Node) or self.axes.get(k) != frozenset(("kv",)) or \
                self.dtypes.get(k) not in _INT_DTYPES:
            return False
        a_bound = self._interval(a)
        if a_bound is None or "kv" in self._axes_of(a):
            return False
        plans = {}
        for user in node.users:
            op = _packet(user.target) if user.op == "call_function" else None
            if op not in _SWAPPED or len(user.args) != 2 or user.kwargs:
                return False
            if user.args[0] is node:
                c = user.args[1]
            elif user.args[1] is node:
                c, op = user.args[0], _SWAPPED[op]
            else:
                return False
            c_bound = self._interval(c)
            if c_bound is None or "kv" in self._axes_of(c):
                return False
            if sign < 0:   # a - k op c  <=>  k swapped(op) a - c
                lo, hi = a_bound[0] - c_bound[1], a_bound[1] - c_bound[0]
                plans[user] = (_SWAPPED[op], self.arg(k), f"({self.arg(a)} - {self.arg(c)})")
            elif sign > 0:   # a + k op c  <=>  k op c - a
                lo, hi = c_bound[0] - a_bound[1], c_bound[1] - a_bound[0]
                plans[user] = (op, self.arg(k), f"({self.arg(c)} - {self.arg(a)})")
            else:            # k - a op c  <=>  k op c + a
                lo, hi = c_bound[0] + a_bound[0], c_bound[1] + a_bound[1]
                plans[user] = (op, self.arg(k), f"({self.arg(c)} + {self.arg(a)})")
            if lo < _INT32[0] or hi > _INT32[1]:
                return False
        if not plans:
            return False
        self.isolated.update(plans)
        return True

    def _interval(self, a: Any) -> Optional[tuple[int, int]]:
        """Known interval of an int value (a lowered node or an int literal), else None."""
        if isinstance(a, bool):
            return None
        if isinstance(a, int):
            return (a, a)
        if isinstance(a, torch.fx.Node) and a in self.names and self.dtypes.get(a) in _INT_DTYPES:
            return self.bound.get(a)
        return None

    def _axes_of(self, a: Any) -> frozenset:
        return self.axes.get(a, frozenset()) if isinstance(a, torch.fx.Node) else frozenset()

    def logical(self, a: Any) -> str:
        """A bool operand of & | ^ ~. A float comparison goes through ``H.as_bool``: Triton's
        interpreter keeps such a result's data in float (int1 & it then fails); on a GPU the
        helper is the identity, inlined away."""
        if isinstance(a, torch.fx.Node) and a in self.float_compares:
            return f"H.as_bool({self.arg(a)})"
        return self.arg(a)

    def float32_operand(self, a: Any) -> str:
        """A float operand of exp2 / log2 / floor-based helpers, which need float32 (a 16-bit
        value from a cast in the graph is widened; the rounding the cast asked for is kept)."""
        expr = self.operand(a, True)
        if isinstance(a, torch.fx.Node) and self.dtype_of(a) in _HALF:
            expr = f"{expr}.to({self.L}.float32)"
        return expr

    def operand(self, a: Any, want_float: bool) -> str:
        """Argument expression; an int value that meets a float is converted (early) first."""
        if want_float and isinstance(a, torch.fx.Node) and self.dtype_of(a) in _INT_DTYPES:
            return self.float_of(a)
        if want_float and isinstance(a, torch.fx.Node) and self.dtype_of(a) is torch.bool:
            return f"{self.arg(a)}.to({self.L}.float32)"
        return self.arg(a)

    def lower(self, node: torch.fx.Node) -> None:
        target, args, kwargs = node.target, node.args, node.kwargs
        packet = _packet(target)
        val = node.meta.get("val")
        out_dtype = val.dtype if isinstance(val, torch.Tensor) else None
        if out_dtype in (torch.float16, torch.bfloat16) and any(
                self.dtype_of(a) is torch.float32 for a in args if isinstance(a, torch.fx.Node)):
            # The graph may be traced with a 16-bit score; the generated arithmetic on the fp32
            # tile stays fp32 (Triton promotes), and a cast in the mod is recorded by cast().
            out_dtype = torch.float32
        L = self.L
        if packet in _IDENTITY:
            return self.lower_identity(node, args[0])
        if packet in (aten.index, aten.select):
            return self.index(node, packet, args, out_dtype)
        if node in self.folded_inputs:
            factor = self.line(f"sm_scale * {_literal(self.folded_inputs[node])}")
            return self.assign(node, f"(qk * {factor})", torch.float32)
        if self.additive and node is self.additive[1] and out_dtype is torch.float32:
            product = self.prescaled_product(node)
            if product is not None:
                self.prescaled.add(node)
                return self.assign(node, product, torch.float32)
        floaty = out_dtype is not None and out_dtype.is_floating_point or any(
            (self.dtype_of(x) or torch.int32).is_floating_point or isinstance(x, float) for x in args
            if isinstance(x, (torch.fx.Node, float)))
        if packet in (aten.add, aten.sub) and kwargs.get("alpha", 1) != 1:
            expr = self.BINARY[packet].format(self.operand(args[0], floaty), f"({self.operand(args[1], floaty)} * "
                                          f"{_literal(kwargs['alpha'])})", L=L)
            return self.assign(node, expr, out_dtype)
        if packet is aten.div and kwargs.get("rounding_mode") is not None:
            return self.lower_rounding_division(node, kwargs["rounding_mode"], args, out_dtype)
        if packet in (aten.floor_divide, aten.remainder) and len(args) == 2 and not kwargs:
            mode = "floor" if packet is aten.floor_divide else "remainder"
            return self.lower_rounding_division(node, mode, args, out_dtype)
        if packet is aten.pow and len(args) == 2 and not kwargs:
            return self.lower_pow(node, args[0], args[1], out_dtype)
        if packet in (aten.floor, aten.ceil, aten.round, aten.trunc) and len(args) == 1 and \
                not kwargs and self.dtype_of(args[0]) in _INT_DTYPES:
            return self.lower_identity(node, args[0])   # torch returns integers unchanged
        if out_dtype is torch.bool and packet in (aten.add, aten.mul) and len(args) == 2 and not kwargs:
            # bool + bool is OR and bool * bool is AND in torch (Triton's int1 sum would wrap)
            op = "|" if packet is aten.add else "&"
            return self.assign(node, f"({self.logical(args[0])} {op} {self.logical(args[1])})", out_dtype)
        if node in self.isolated:
            op, kv_side, other = self.isolated[node]
            return self.assign(node, self.BINARY[op].format(kv_side, other, L=L), out_dtype)
        if packet in (aten.add, aten.sub) and not kwargs and self.isolate_kv(node):
            return  # every reader compares it: they compare its kv part instead (isolate_kv)
        if packet in _BINARY and len(args) == 2 and not kwargs:
            if packet is aten.div:
                # Triton's / on two integers truncates toward zero; torch's is true division:
                # the operands are made float first (literals as float literals).
                a, b = (self.operand(x, True) if isinstance(x, torch.fx.Node) else _literal(float(x))
                        for x in args)
                return self.assign(node, f"({a} / {b})", out_dtype)
            if packet in _BITWISE and out_dtype is torch.bool:
                x, y = (self.logical(a) for a in args)
            else:
                x, y = (self.operand(a, floaty) for a in args)
            self.assign(node, self.BINARY[packet].format(x, y, L=L), out_dtype)
            if packet in _SWAPPED and floaty:
                self.float_compares.add(node)
            return self.int_bound(node)
        if packet in _UNARY and len(args) == 1 and not kwargs:
            a = self.logical(args[0]) if packet is aten.bitwise_not else self.arg(args[0])
            if packet in (aten.tanh, aten.sigmoid, aten.exp, aten.exp2, aten.log, aten.log2,
                          aten.sqrt, aten.rsqrt, aten.sin, aten.cos, aten.erf, aten.log1p,
                          aten.expm1, aten.reciprocal) and self.dtype_of(args[0]) not in (torch.float32, None):
                a = self.float_of(args[0]) if self.dtype_of(args[0]) in _INT_DTYPES else f"{a}.to({L}.float32)"
            elif packet in (aten.floor, aten.ceil, aten.round, aten.trunc) and self.dtype_of(args[0]) in _HALF:
                a = f"{a}.to({L}.float32)"   # Triton's floor / ceil take float32 or float64 only
            self.assign(node, _UNARY[packet].format(a, L=L), out_dtype)
            if packet in _SFU_UNARY and self.axes.get(node) == _TILE:
                self.sfu_ops += 1
            return self.int_bound(node)
        if packet is aten.where:
            c = self.arg(args[0])
            a, b = (self.operand(x, floaty) for x in args[1:])
            return self.assign(node, f"{L}.where({c}, {a}, {b})", out_dtype)
        if packet in (aten.clamp, aten.clamp_min, aten.clamp_max):
            def opt(i: int, key: str) -> Any:
                return args[i] if len(args) > i else kwargs.get(key)
            lo = opt(1, "min") if packet in (aten.clamp, aten.clamp_min) else None
            hi = opt(2, "max") if packet is aten.clamp else (
                opt(1, "max") if packet is aten.clamp_max else None)
            x = self.operand(args[0], floaty)
            if lo is not None:
                x = f"{L}.maximum({x}, {self.operand(lo, floaty)})"
            if hi is not None:
                x = f"{L}.minimum({x}, {self.operand(hi, floaty)})"
            return self.assign(node, x, out_dtype)
        if target in (aten._to_copy.default, prims.convert_element_type.default) or \
                packet is aten.to:
            dtype = kwargs.get("dtype") if target is aten._to_copy.default else (
                args[1] if len(args) > 1 else kwargs.get("dtype"))
            if not isinstance(dtype, torch.dtype):
                return self.lower_identity(node, args[0])
            return self.cast(node, args[0], dtype)
        if packet in _CONSTANT_FILLS:
            value, shape = _CONSTANT_FILLS[packet](args)
            if isinstance(shape, (list, tuple)) and any(s != 1 for s in shape):
                raise UnsupportedMod(f"{packet} builds a tensor of shape {list(shape)}")
            if out_dtype is torch.bool:
                value = bool(value)
            elif out_dtype is not None and out_dtype.is_floating_point:
                value = float(value)
            return self.assign(node, _literal(value), out_dtype)
        part = next((a for a in node.all_input_nodes if a in self.views or a in self.buffer_of), None)
        if part is not None:
            raise UnsupportedMod(f"{self.kind}_mod applies {target} to a captured tensor that is "
                                 "not indexed down to one element; index every dimension with a "
                                 "scalar index expression (e.g. table[h, q_idx - kv_idx])")
        raise UnsupportedMod(f"{self.kind}_mod uses {target}, which the mod generator does not "
                             "support; see fa3_inductor/templates/modgen.py")

    def lower_identity(self, node: torch.fx.Node, src: Any) -> None:
        view = self.view_of(src)
        if view is not None:
            return self.alias_view(node, src, view)
        self.names[node] = self.arg(src)
        self.dtypes[node] = self.dtype_of(src)
        if isinstance(src, torch.fx.Node):
            self.axes[node] = self.axes.get(src, frozenset())
            if src in self.bound:
                self.bound[node] = self.bound[src]
        else:
            self.axes[node] = frozenset()

    def cast(self, node: torch.fx.Node, src: Any, dtype: torch.dtype) -> None:
        if dtype not in _TL_DTYPES:
            raise UnsupportedMod(f"cast to {dtype}")
        a = self.arg(src)
        expr = f"({a} != 0)" if dtype is torch.bool else f"{a}.to({self.L}.{_TL_DTYPES[dtype]})"
        if not isinstance(src, torch.fx.Node):
            expr = _literal(float(src) if dtype.is_floating_point else src)
        elif dtype.is_floating_point and self.dtype_of(src) in _INT_DTYPES:
            expr = self.float_of(src)
            if dtype is not torch.float32:
                expr = f"{expr}.to({self.L}.{_TL_DTYPES[dtype]})"
        self.assign(node, expr, dtype)
        if isinstance(src, torch.fx.Node) and dtype in _INT_DTYPES and src in self.bound:
            self.bound[node] = self.bound[src]

    def alias_view(self, node: torch.fx.Node, src: torch.fx.Node, view: tuple) -> None:
        """A value-preserving op (clone, lift_fresh_copy, a no-op view) on a captured buffer."""
        buf, indices = view
        spec = self.buffers[self.buffer_of[buf]]
        val = node.meta.get("val")
        rest = tuple(spec.shape[len(indices):])
        if self.KNOWS_SHAPES and isinstance(val, torch.Tensor) and tuple(val.shape) != rest and \
                val.numel() != 1:
            raise UnsupportedMod(f"{self.kind}_mod reshapes a captured tensor ({list(rest)} -> "
                                 f"{list(val.shape)}); index the tensor as it was captured")
        self.views[node] = view
        self.dtypes[node] = spec.dtype
        self.axes[node] = self.axes.get(src, frozenset())

    def index(self, node: torch.fx.Node, packet: Any, args: Sequence[Any], out_dtype) -> None:
        """``buf[i, j]``, ``buf[i][j]`` (aten.index) or ``buf[0]`` (aten.select): composed into one
        load once every dimension has an index; a part-indexed buffer stays a view until then."""
        view = self.view_of(args[0])
        if view is None:
            raise UnsupportedMod("indexing a tensor that is not a captured buffer")
        buf, done = view
        spec = self.buffers[self.buffer_of[buf]]
        if packet is aten.select:
            dim, i = args[1], args[2]
            rank = len(spec.shape) - len(done)
            if not isinstance(i, int) or (dim != 0 and (not self.KNOWS_SHAPES or dim != -rank)):
                raise UnsupportedMod(f"captured buffer selected along dim {dim}; index its "
                                     "dimensions in order with scalar indices")
            if self.KNOWS_SHAPES:
                size = spec.shape[len(done)]
                if size < 0:   # dynamic: a non-negative index cannot be checked against it
                    _check_from_start(i)
                    size = i + 1
                if not -size <= i < size:
                    raise UnsupportedMod(f"index {i} is out of bounds for a captured dimension of size {size}")
                i %= size
            new = (i,)
        else:
            new = tuple(args[1])
        too_many = self.KNOWS_SHAPES and len(done) + len(new) > len(spec.shape)
        if any(i is None for i in new) or too_many:
            raise UnsupportedMod(
                f"captured buffer of shape {list(spec.shape)} indexed with {len(done) + len(new)} "
                "indices (or a slice); index every dimension with a scalar index expression")
        for i in new:
            if isinstance(i, torch.fx.Node) and self.dtype_of(i) not in _INT_DTYPES:
                raise UnsupportedMod(f"captured buffer indexed with a {self.dtype_of(i)} value; "
                                     "index with integers")
        indices = done + new
        self.axes[node] = frozenset().union(*(self._axes_of(i) for i in indices))
        if len(indices) < len(spec.shape) or not self.KNOWS_SHAPES:   # loaded where it is used
            self.views[node] = (buf, indices)
            self.dtypes[node] = spec.dtype
            return
        self.assign(node, self.loaded(spec, self.gather(buf, spec, indices)), out_dtype or spec.dtype)

    def loaded(self, spec: BufferSpec, expr: str) -> str:
        """A gathered element as the mod computes with it: 16-bit floats in float32, bools as bools."""
        if spec.dtype in (torch.float16, torch.bfloat16):
            return f"{expr}.to({self.L}.float32)"
        if spec.dtype is torch.bool:
            return f"({expr} != 0)"
        return expr

    def gather(self, buf: torch.fx.Node, spec: BufferSpec, indices: Sequence[Any]) -> str:
        """Load of ``buf[indices]`` (one index per dimension); strides are baked in. A negative
        index counts from the end as in torch, unless its interval shows it never is negative."""
        self.gathers = True
        self.float_gathers |= spec.dtype.is_floating_point
        return f"{self.L}.load({self.names[buf]} + {self.element_offset(spec, indices)})"

    def element_offset(self, spec: BufferSpec, indices: Sequence[Any]) -> str:
        """The element offset of ``buf[indices]`` in a buffer of ``spec`` (gather's address)."""
        terms = []
        for i, size, stride in zip(indices, spec.shape, spec.strides):
            if stride == 0:
                continue
            if isinstance(i, torch.fx.Node):
                iv = self.known_interval(i)
                index = self.arg(i)
                if size < 0 and (iv is None or iv[0] < 0):
                    raise UnsupportedMod("a captured buffer's dynamic-size dimension is indexed with a "
                                         "value that may be negative; index it with a non-negative "
                                         "value (q_idx, kv_idx, b, h) or compile with static shapes")
                if iv is None or iv[0] < 0:
                    # + size where negative, as the unsigned min of idx and idx + size (for idx in
                    # [-size, size)); a select measured 50% more spill on the sm90 kernel
                    index = self.line(f"{self.L}.minimum({index}.to({self.L}.uint32), ({index} + {size}).to({self.L}.uint32))")
            else:
                if isinstance(i, int) and size < 0:
                    _check_from_start(i)
                index = _literal(i % size if isinstance(i, int) and size > 0 else i)
            if isinstance(stride, RuntimeStride):
                terms.append(f"({index}) * {self.L}.load(bufs[{stride.slot}])")
            else:
                terms.append(f"({index}) * {stride}" if stride != 1 else f"({index})")
        return " + ".join(terms) if terms else "0"

    def lower_rounding_division(self, node: torch.fx.Node, mode: str, args: Sequence[Any],
                                out_dtype) -> None:
        """``a // b``, ``a % b`` and ``torch.div(a, b, rounding_mode=...)`` with torch's rounding
        (toward -inf for floor and remainder; Triton's ``//`` and ``%`` truncate)."""
        floaty = out_dtype is not None and out_dtype.is_floating_point
        helper = {"floor": "H.floordiv", "trunc": "H.truncdiv", "remainder": "H.remainder"}.get(mode)
        if helper is None:
            raise UnsupportedMod(f"aten.div rounding_mode={mode!r}")
        a, b = args[:2]
        if not floaty and isinstance(b, (int, float)) and b == 0:
            raise UnsupportedMod("integer division by zero (torch raises ZeroDivisionError)")
        if floaty and mode != "remainder":
            helper += "_float"
        x, y = (self.float32_operand(v) if floaty and isinstance(v, torch.fx.Node) else
                _literal(float(v)) if floaty else self.arg(v) for v in (a, b))
        self.assign(node, f"{helper}({x}, {y})", out_dtype)

    def lower_pow(self, node: torch.fx.Node, base: Any, exponent: Any, out_dtype) -> None:
        """``base ** exponent`` in all its forms (tensor ** tensor, tensor ** number, number **
        tensor) with torch's semantics: integer powers by repeated squaring (exact, negative bases
        fine), 0 ** 0 == 1, a negative base to a fractional power is nan, int ** int stays int."""
        for x in (base, exponent):
            if isinstance(x, torch.fx.Node) and self.dtype_of(x) is torch.bool:
                raise UnsupportedMod("pow of a bool value; convert it first (x.float() or x.int())")
            if isinstance(x, float) and not math.isfinite(x):
                raise UnsupportedMod(f"pow with the constant {x}; use a finite number")
        if out_dtype in _INT_DTYPES:
            expr = self.int_power(base, exponent)
        else:
            expr = self.float_power(base, exponent)
        self.assign(node, expr, out_dtype)
        if self.axes.get(node) == _TILE and ("exp2(" in expr or "H.pow(" in expr):
            self.sfu_ops += 1

    def check_int_power(self, exponent: Any) -> tuple[int, int]:
        """The exponent's interval, or UnsupportedMod where it may be negative (torch raises for
        negative integer powers of integers) or is unknown."""
        iv = self.known_interval(exponent)
        if iv is None or iv[0] < 0:
            what = f"the power {exponent}" if not isinstance(exponent, torch.fx.Node) else \
                "an integer-tensor power that may be negative"
            raise UnsupportedMod(f"an integer to {what}: torch refuses negative integer powers "
                                 "of integers; make the base float (e.g. 2.0 ** x, x.float() ** -1)")
        return iv

    def int_power(self, base: Any, exponent: Any) -> str:
        iv = self.check_int_power(exponent)
        if not isinstance(exponent, torch.fx.Node):
            return self.power_chain(self.arg(base), int(exponent), "1")
        e = self.arg(exponent)
        square = self.line(f"({e} * 0 + {self.arg(base)})")   # the base, broadcast and typed like e
        result = self.line(f"({e} * 0 + 1)")
        for bit in range(iv[1].bit_length()):
            result = self.line(f"{self.L}.where((({e} >> {bit}) & 1) != 0, {result} * {square}, {result})")
            if bit + 1 < iv[1].bit_length():
                square = self.line(f"({square} * {square})")
        return result

    def float_power(self, base: Any, exponent: Any) -> str:
        L = self.L
        if not isinstance(exponent, torch.fx.Node):         # x ** c
            x, c = self.float32_operand(base), float(exponent)
            if c.is_integer() and abs(c) <= 2 ** 16:
                power = self.power_chain(x, abs(int(c)), "1.0")
                return f"(1.0 / {power})" if c < 0 else power
            if c in (0.5, -0.5):
                return f"{L}.{'sqrt' if c > 0 else 'rsqrt'}({x})"
            # a fractional power: nan below 0 (log2), 0 or inf at 0 by c's sign, as torch
            return f"{L}.exp2({L}.log2({x}) * {_literal(c)})"
        e = self.float32_operand(exponent)
        if isinstance(base, torch.fx.Node):
            return f"H.pow({self.float32_operand(base)}, {e})"
        c = float(base)                                       # c ** x
        if c > 0:
            return f"{L}.exp2({e})" if c == 2.0 else f"{L}.exp2({e} * {_literal(math.log2(c))})"
        if c == 0:
            return f"{L}.where({e} == 0.0, 1.0, {L}.where({e} > 0.0, 0.0, float(\"inf\")))"
        magnitude = self.line(f"{L}.exp2({e} * {_literal(math.log2(-c))})")
        return f"H.odd_integer_sign({magnitude}, {e})"

    def power_chain(self, x: str, n: int, one: str) -> str:
        """``x ** n`` for an integer n >= 0 by repeated squaring (exact for integers, a few
        roundings for floats); ``x ** 0`` is one, with x's shape."""
        if n == 0:
            return f"{self.L}.where({x} == {x}, {one}, {one})"
        result, square = None, x
        while True:
            if n & 1:
                result = square if result is None else self.line(f"({result} * {square})")
            n >>= 1
            if not n:
                return result
            square = self.line(f"({square} * {square})")

    def known_interval(self, a: Any) -> Optional[tuple[int, int]]:
        """A sound interval of an int (or bool) value, or None. Wider than ``bound`` (which the
        float rebuild and kv isolation use): it follows products, abs, remainders, floor
        divisions, clamps and selects too. Used where soundness is all that matters (whether a
        gather index can be negative, whether an integer exponent can)."""
        if isinstance(a, bool):
            return (int(a), int(a))
        if isinstance(a, int):
            return (a, a)
        if not isinstance(a, torch.fx.Node):
            return None
        if a not in self.intervals:
            iv = self._derive_interval(a) if self.dtype_of(a) in _INT_DTYPES + (torch.bool,) else None
            if iv is not None and (iv[0] < _INT32[0] or iv[1] > _INT32[1]):
                iv = None   # may have wrapped around
            self.intervals[a] = iv
        return self.intervals[a]

    def _derive_interval(self, a: torch.fx.Node) -> Optional[tuple[int, int]]:
        if self.dtype_of(a) is torch.bool:
            return (0, 1)
        if a.op == "placeholder":
            return _PARAM_BOUND.get(self.names.get(a))
        if a.op != "call_function" or a.kwargs.get("alpha", 1) != 1:
            return None
        packet, args = _packet(a.target), a.args
        if packet in _IDENTITY or packet in (aten._to_copy, prims.convert_element_type, aten.to):
            return self.known_interval(args[0])
        if packet in (aten.clamp, aten.clamp_min, aten.clamp_max):
            lo, hi = (args[1:] + (None, None))[:2] if packet is aten.clamp else \
                (args[1], None) if packet is aten.clamp_min else (None, args[1])
            iv = self.known_interval(args[0])
            for bound, pick in ((lo, max), (hi, min)):
                b = None if bound is None else self.known_interval(bound)
                if iv is None or (bound is not None and b is None):
                    return None
                iv = iv if b is None else (pick(iv[0], b[0]), pick(iv[1], b[1]))
            return iv
        ivs = [self.known_interval(x) for x in args[:3] if isinstance(x, (int, torch.fx.Node))]
        if None in ivs or not ivs:
            return None
        if packet is aten.neg:
            return (-ivs[0][1], -ivs[0][0])
        if packet is aten.abs:
            lo, hi = ivs[0]
            return (0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), max(abs(lo), abs(hi)))
        if packet in (aten.add, aten.sub, aten.rsub, aten.mul) and len(ivs) == 2:
            (a0, a1), (b0, b1) = ivs if packet is not aten.rsub else ivs[::-1]
            if packet is aten.add:
                return (a0 + b0, a1 + b1)
            if packet is aten.mul:
                corners = [a0 * b0, a0 * b1, a1 * b0, a1 * b1]
                return (min(corners), max(corners))
            return (a0 - b1, a1 - b0)
        if packet is aten.remainder and len(ivs) == 2:
            (b0, b1) = ivs[1]
            return (0, b1 - 1) if b0 > 0 else (b0 + 1, 0) if b1 < 0 else None
        floor_div = packet is aten.floor_divide or (packet is aten.div and a.kwargs.get("rounding_mode") == "floor")
        if floor_div and len(ivs) == 2 and ivs[1][0] == ivs[1][1] and ivs[1][0] > 0:
            return (ivs[0][0] // ivs[1][0], ivs[0][1] // ivs[1][0])
        if packet in (aten.maximum, aten.minimum) and len(ivs) == 2:
            pick = max if packet is aten.maximum else min
            return (pick(ivs[0][0], ivs[1][0]), pick(ivs[0][1], ivs[1][1]))
        if packet is aten.where and len(ivs) == 3:
            return (min(ivs[1][0], ivs[2][0]), max(ivs[1][1], ivs[2][1]))
        return None


def generate_mod_source(gm: torch.fx.GraphModule, kind: str,
                        buffers: Sequence[Optional[BufferSpec]], dialect: str = "tl") -> GeneratedSource:
    """Source of a jit function computing ``gm`` on a tile (see the module docstring), with the
    generator's record of it as ``.info`` (:class:`ModInfo`).

    ``buffers`` describes the captured inputs after the index arguments, in order; None marks
    a captured scalar (e.g. a size symbol under dynamic shapes), allowed only if unused.

    Example::

        >>> src = generate_mod_source(score_graph, "score", [BufferSpec.of(bias)])  # doctest: +SKIP
        >>> "def score_mod(qk, sm_scale, b, h, q_idx, kv_idx, bufs)" in src                # doctest: +SKIP
        True
    """
    if kind not in ("score", "mask"):
        raise ValueError(f"kind must be 'score' or 'mask', got {kind!r}")
    if dialect not in ("tl", "gl"):
        raise ValueError(f"dialect must be 'tl' or 'gl', got {dialect!r}")
    emitter = _Emitter(gm, kind, buffers, dialect)
    source = emitter.emit()
    if emitter.additive:
        # The folded form needs sm_scale > 0; launchers take this one otherwise (kernel_score_mod).
        plain = _Emitter(gm, kind, buffers, dialect, fold_sm_scale=False).emit()
        source += "\n\n" + plain.replace("def score_mod(", "def score_mod_unfolded(", 1)
    return GeneratedSource(source, emitter.info)


class _OffsetEmitter(_Emitter):
    """The emitter of :func:`generate_offset_source`: its last buffer is the one addressed, whose
    element offset is the result (not a load)."""

    def gather(self, buf: torch.fx.Node, spec: BufferSpec, indices: Sequence[Any]) -> str:
        if self.buffer_of[buf] == len(self.buffers) - 1:
            return self.element_offset(spec, indices)
        return super().gather(buf, spec, indices)


def generate_offset_source(gm: torch.fx.GraphModule, buffers: Sequence[Optional[BufferSpec]],
                           shape: Sequence[int], dialect: str = "tl") -> GeneratedSource:
    """Source of ``index_mod(b, h, q_idx, kv_idx, bufs)``: the element offset of
    ``x[i_0, ..., i_r]`` in a contiguous tensor x of ``shape``, where ``gm`` is a graph
    ``(b, h, q_idx, kv_idx, *buffers) -> [i_0, ..., i_r]`` of the index expressions (integer
    nodes or ints). The offset is a gather's address (a negative index counts from the end unless
    its interval shows it never is negative) and broadcasts like the indices: a scalar when they
    read neither q_idx nor kv_idx. For scatter-adds into a captured buffer's gradient
    (templates/generic_bwd/buffer_grad.py); ``gm`` is not modified.

    Example::

        >>> gm = torch.fx.symbolic_trace(lambda b, h, q, kv: [h, q - kv + 63])   # doctest: +SKIP
        >>> src = generate_offset_source(gm, [], (2, 127))                      # doctest: +SKIP
        >>> "def index_mod(b, h, q_idx, kv_idx, bufs)" in src                   # doctest: +SKIP
        True
    """
    import copy

    if dialect not in ("tl", "gl"):
        raise ValueError(f"dialect must be 'tl' or 'gl', got {dialect!r}")
    gm = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    indices = output.args[0]
    indices = list(indices) if isinstance(indices, (tuple, list)) else [indices]
    if len(indices) != len(shape):
        raise UnsupportedMod(f"{len(indices)} indices into a tensor of shape {list(shape)}; index "
                             "every dimension with a scalar index expression")
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        target = graph.placeholder("addressed")
    with graph.inserting_before(output):
        element = graph.call_function(aten.index.Tensor, (target, indices))
    element.meta["val"] = torch.zeros((), dtype=torch.int32)
    output.args = (element,)
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    spec = BufferSpec(tuple(shape), tuple(strides), torch.int32)
    emitter = _OffsetEmitter(gm, "index", [*buffers, spec], dialect)
    return GeneratedSource(emitter.emit(), emitter.info)


def generate_in_dialect(gm: torch.fx.GraphModule, kind: str, buffers: Sequence[Optional[BufferSpec]],
                        dialect: str) -> str:
    """:func:`generate_mod_source` for the ``tl`` and ``gl`` dialects, templates/modgen_torch.py's
    generator for ``torch``: the source a kernel family of that dialect calls.

    Example::

        >>> generate_in_dialect(gm, "mask", [], "torch").startswith("def mask_mod")   # doctest: +SKIP
        True
    """
    if dialect == "torch":
        from .modgen_torch import generate_torch_mod_source

        return generate_torch_mod_source(gm, kind, buffers)
    return generate_mod_source(gm, kind, buffers, dialect)


def trace_mod(fn: Any, kind: str) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """Trace a Python score_mod/mask_mod into the graph form the generator reads.

    Tensors the mod captures become trailing placeholders (the "captured buffers"), in the order
    they are first used; they are returned alongside the graph. Flex's own tracing (inside
    torch.compile) produces the same form; this is for direct use and for tests.

    Example::

        >>> gm, bufs = trace_mod(lambda s, b, h, q, kv: s + bias[h], "score")   # doctest: +SKIP
        >>> generate_mod_source(gm, "score", [BufferSpec.of(t) for t in bufs])   # doctest: +SKIP
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    if kind not in ("score", "mask"):
        raise ValueError(f"kind must be 'score' or 'mask', got {kind!r}")
    args = [torch.zeros((), dtype=torch.int32) for _ in range(4)]
    if kind == "score":
        args.insert(0, torch.zeros((), dtype=torch.float32))
    with _compat.getitem_as_index():  # tensor[idx] with a 0-d idx traces as aten.index
        gm = make_fx(fn)(*args)
    last_input = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    buffers: list[torch.Tensor] = []
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        with gm.graph.inserting_after(last_input):
            placeholder = gm.graph.placeholder(f"buf{len(buffers)}")
        last_input = placeholder
        buffers.append(getattr(gm, node.target))
        node.replace_all_uses_with(placeholder)
        gm.graph.erase_node(node)
    gm.recompile()
    return gm, buffers


def is_constant_true_mask(gm: torch.fx.GraphModule) -> bool:
    """True if a mask_mod graph returns a constant True (FlexAttention's noop mask)."""
    try:
        src = generate_mod_source(gm, "mask", [], "tl")
    except UnsupportedMod:
        return False
    body = _mod_body(src)
    return body in (["return True"], ["v0 = True", "return v0"], ["v0 = 1", "return (v0 != 0)"])


# Expressions of a generated mask_mod (either dialect) that compute exactly q_idx >= kv_idx.
_CAUSAL_EXPRS = ("(q_idx >= kv_idx)", "(kv_idx <= q_idx)")


def is_causal_mask_source(source: Optional[str]) -> bool:
    """True if a generated ``tl`` or ``gl`` mask_mod source (with or without its decorator line) is exactly
    ``q_idx >= kv_idx``: a kernel may then walk the causal tiles by arithmetic (CAUSAL_WALK: the Hopper forward's and
    backward's packed modes, the wide backward under a causal block mask).

    Example::

        >>> is_causal_mask_source("@triton.jit\\ndef mask_mod(b, h, q_idx, kv_idx, bufs):\\n"
        ...                       "    v0 = (q_idx >= kv_idx)\\n    return v0\\n")
        True
    """
    body = _mod_body(source)
    return len(body) == 2 and body[0] in [f"v0 = {e}" for e in _CAUSAL_EXPRS] and body[1] == "return v0"


_CAUSAL_TERMS = _CAUSAL_EXPRS + ("(kv_idx <= (q_idx - 0))",)
_WINDOW_EDGE = re.compile(r"\(kv_idx (>|>=) \(q_idx - (\d+)\)\)")


def causal_window_of_source(source: Optional[str]) -> Optional[int]:
    """W if a generated ``tl`` or ``gl`` mask_mod source is exactly a causal sliding window of W keys, ``q_idx >= kv_idx
    and q_idx - kv_idx < W`` (``mods.sliding_window(W)``, or any mask that traces to the same two comparisons), else
    None: a kernel may then walk the window's tiles by arithmetic (the Hopper forward's SPARSE.WINDOW).

    Example::

        >>> causal_window_of_source("@gluon.jit\\ndef mask_mod(b, h, q_idx, kv_idx, bufs):\\n"
        ...     "    v0 = (q_idx >= kv_idx)\\n    v1 = (kv_idx > (q_idx - 256))\\n"
        ...     "    v2 = (v0 & v1)\\n    return v2\\n")
        256
    """
    defs, returned = _mod_defs(source)

    def expand(expr: str, depth: int = 0) -> str:   # variables replaced by their expressions
        return re.sub(r"\bv\d+\b", lambda v: expand(defs[v.group(0)], depth + 1)
                      if v.group(0) in defs and depth < 8 else v.group(0), expr)

    conj = re.fullmatch(r"\((\w+) & (\w+)\)", defs.get(returned, ""))
    if conj is None:
        return None
    terms = [expand(defs.get(name, name)) for name in conj.groups()]
    for causal, edge in (terms, terms[::-1]):
        found = _WINDOW_EDGE.fullmatch(edge)
        if causal in _CAUSAL_TERMS and found:
            window = int(found.group(2)) + (found.group(1) == ">=")
            return window if window >= 1 else None
    return None


def mask_implies_causal_source(source: Optional[str]) -> bool:
    """True if a generated mask_mod source returns a conjunction (``&``) one of whose terms is exactly
    ``q_idx >= kv_idx`` (causal alone, causal documents, causal windows): every pair it keeps has q_idx >= kv_idx.

    Example::

        >>> mask_implies_causal_source("@gluon.jit\\ndef mask_mod(b, h, q_idx, kv_idx, bufs):\\n"
        ...     "    v0 = (q_idx >= kv_idx)\\n    v1 = (kv_idx > (q_idx - 256))\\n"
        ...     "    v2 = (v0 & v1)\\n    return v2\\n")
        True
    """
    defs, returned = _mod_defs(source)
    todo, seen = [returned], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in defs:
            continue
        seen.add(name)
        expr = defs[name]
        if expr in _CAUSAL_EXPRS:
            return True
        conj = re.fullmatch(r"\((\w+) & (\w+)\)", expr)
        if conj:
            todo += [conj.group(1), conj.group(2)]
    return False


def mask_implies_causal(fn: Any) -> bool:
    """:func:`mask_implies_causal_source` of a loaded mask_mod (False for anything else).

    Example::

        >>> mask_implies_causal(None)
        False
    """
    return mask_implies_causal_source(_jit_source(fn))


def _mod_defs(source: Optional[str]) -> tuple[dict[str, str], str]:
    """(each ``vN = expr`` of a generated mod's body, the name it returns; "" when it ends in no return)."""
    body = _mod_body(source)
    if not body or not body[-1].startswith("return "):
        return {}, ""
    return dict(line.split(" = ", 1) for line in body[:-1] if " = " in line), body[-1][len("return "):].strip()


def _mod_body(source: Optional[str]) -> list[str]:
    """The stripped, non-empty lines of a generated mod after its ``def`` line (none for None)."""
    lines = [line.strip() for line in (source or "").splitlines() if line.strip()]
    return lines[next((i + 1 for i, line in enumerate(lines) if line.startswith("def ")), len(lines)):]


def _jit_source(fn: Any) -> Optional[str]:
    """The source of a loaded mod: a JIT function's ``src``, or (Triton's interpreter) its Python function's."""
    src = getattr(fn, "src", None)
    if src is None and callable(getattr(fn, "fn", None)):
        try:
            src = inspect.getsource(fn.fn)
        except (OSError, TypeError):
            return None
    return src


def is_causal_mask_mod(fn: Any) -> bool:
    """:func:`is_causal_mask_source` of a loaded mask_mod (a Triton or Gluon JIT function; False for anything else).

    Example::

        >>> is_causal_mask_mod(None)
        False
    """
    return is_causal_mask_source(_jit_source(fn))


def is_identity_score(gm: torch.fx.GraphModule) -> bool:
    """True if a score_mod graph returns its score input unchanged."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if isinstance(out, (tuple, list)):
        out = out[0]
    first = next((n for n in gm.graph.nodes if n.op == "placeholder"), None)
    return out is first and all(_packet(n.target) in _IDENTITY for n in nodes)


_HEADER = {
    "tl": "import triton\nimport triton.language as tl\n"
          "from fa3_inductor.templates.mod_helpers import TL as H\n\n\n",
    "gl": "from triton.experimental import gluon\nfrom triton.experimental.gluon import language as gl\n"
          "from fa3_inductor.templates.mod_helpers import GL as H\n\n\n",
}
_LOADED: dict[tuple[str, str, "ModInfo"], Any] = {}


def _cache_dir() -> str:
    root = os.environ.get("FA3_INDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"fa3_inductor_{os.getuid() if hasattr(os, 'getuid') else 0}")
    path = os.path.join(root, "mods")
    os.makedirs(path, exist_ok=True)
    return path


def mod_info(fn: Any) -> ModInfo:
    """The generator's record of a loaded mod (:func:`load_mod`); a hand-written one has the defaults.

    Example::

        >>> mod_info(load_mod(generate_mod_source(softcap_graph, "score", []))).out_scale  # doctest: +SKIP
        30.0
    """
    return _INFO.get(fn, HAND_WRITTEN)


def out_scale_of(score_mod: Any) -> float:
    """The positive constant a score_mod's returned tile is to be multiplied by (1.0 for a
    hand-written mod, which returns the score itself).

    Example::

        >>> out_scale_of(load_mod(generate_mod_source(softcap_graph, "score", [])))  # doctest: +SKIP
        30.0
    """
    return mod_info(score_mod).out_scale


def kernel_score_mod(score_mod: Any, sm_scale: float, fold: bool = True) -> tuple[Any, float]:
    """(the score_mod to launch, the factor from its returned tile to the score) for a launch
    with ``sm_scale``. A mod folded as ``qk + x / sm_scale`` (sm_scaled) is valid for
    sm_scale > 0 only; otherwise, or with ``fold=False`` (a kernel config that measured the
    unfolded form faster), its unfolded twin is launched.

    Example::

        >>> fn, factor = kernel_score_mod(load_mod(alibi_source, "gl"), 0.125)  # doctest: +SKIP
        >>> factor                                                              # doctest: +SKIP
        0.125
    """
    if mod_info(score_mod).sm_scaled:
        if fold and sm_scale > 0:
            return score_mod, out_scale_of(score_mod) * sm_scale
        score_mod = unfolded_of(score_mod)
    return score_mod, out_scale_of(score_mod)


def unfolded_of(score_mod: Any) -> Any:
    """The unfolded twin of an sm_scaled score_mod (``qk * sm_scale`` first, then the mod).

    Example::

        >>> unfolded_of(load_mod(alibi_source, "gl")).__name__   # doctest: +SKIP
        'score_mod_unfolded'
    """
    return _UNFOLDED[score_mod]


def sfu_ops_of(score_mod: Any) -> int:
    """Special-function-unit (MUFU) ops a generated score_mod spends per score (0 if unknown).

    Example::

        >>> sfu_ops_of(load_mod(generate_mod_source(softcap_graph, "score", []), "gl"))  # doctest: +SKIP
        1
    """
    return mod_info(score_mod).sfu_ops


def kv_affine_of(score_mod: Any) -> bool:
    """True if a generated score_mod is ``score + alpha(b, h) * kv + B(b, h, q)`` (kv_affine):
    the kernel may then evaluate it once per column, per tile and per row instead of per score.

    Example::

        >>> kv_affine_of(load_mod(generate_mod_source(alibi_graph, "score", []), "gl"))  # doctest: +SKIP
        True
    """
    return mod_info(score_mod).kv_affine


def mask_and_of(mask_mod: Any) -> bool:
    """True if a generated mask_mod returns an AND of conditions (mask_and): the Hopper kernel then
    applies it through a select that ptxas can chain into the comparisons (one FSEL per score).

    Example::

        >>> mask_and_of(load_mod(generate_mod_source(window_graph, "mask", []), "gl"))  # doctest: +SKIP
        True
    """
    return mod_info(mask_mod).mask_and


def _record_of(source: str, info: Optional[ModInfo]) -> ModInfo:
    """``info``, else the record a generated source carries, else a hand-written mod's defaults."""
    if info is not None:
        return info
    return source.info if isinstance(source, GeneratedSource) else HAND_WRITTEN


def describe_mod_source(source: Optional[str], info: Optional[ModInfo] = None) -> str:
    """A generated mod's body on one line (for reports), with the factor its kernel applies.

    Example::

        >>> describe_mod_source(generate_mod_source(softcap_graph, "score", []))  # doctest: +SKIP
        'v0 = sm_scale * 0.0333...; v1 = (qk * v0); v2 = H.tanh(v1); return v2 (x 30.0, folded into the kernel)'
    """
    if source is None:
        return "none"
    info = _record_of(source, info)
    lines = source.split("def score_mod_unfolded")[0].splitlines()   # not the unfolded twin
    start = next(i for i, line in enumerate(lines) if line.startswith("def ")) + 1
    summary = "; ".join(line.strip() for line in lines[start:] if line.strip() and line[0] != "@")
    factors = ([] if info.out_scale == 1.0 else [repr(info.out_scale)]) + (["sm_scale"] if info.sm_scaled else [])
    return f"{summary} (x {' x '.join(factors)}, folded into the kernel)" if factors else summary


def out_range_of(score_mod: Any) -> Optional[tuple[float, float]]:
    """Bounds (lo, hi) of every unmasked value a generated score_mod returns, or None.

    Example::

        >>> out_range_of(load_mod(generate_mod_source(softcap_graph, "score", [])))  # doctest: +SKIP
        (-1.0, 1.0)
    """
    return mod_info(score_mod).out_range


def load_mod(source: str, dialect: str = "tl", info: Optional[ModInfo] = None) -> Any:
    """Import generated mod source as a module (jit functions need a real file) and return its
    ``score_mod`` or ``mask_mod`` jit function, registered with the generator's record of it
    (``info``, or the source's own ``.info`` when it came from :func:`generate_mod_source`; see
    :func:`mod_info`). Cached by the source text and its record.

    Example::

        >>> fn = load_mod(generate_mod_source(gm, "score", []))   # doctest: +SKIP
    """
    # One function per (text, record): mods that differ only in a factor folded out of the text (score * 0.5
    # and score * 2.0 both generate "return score", out_scale 0.5 / 2.0) must not share a function, since the
    # record is looked up by the function (mod_info); keyed by text alone, the second got the first's factor.
    info = _record_of(source, info)
    cached = _LOADED.get((dialect, source, info))  # the hot path: no hashing of the text per call
    if cached is not None:
        return cached
    text = _HEADER[dialect] + source
    key = hashlib.sha256(text.encode()).hexdigest()[:20]
    path = os.path.join(_cache_dir(), f"mod_{dialect}_{key}.py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    name = f"fa3_inductor_generated.mod_{dialect}_{key}_{hashlib.sha256(repr(info).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    fn = getattr(module, "score_mod", None) or getattr(module, "mask_mod", None) or \
        getattr(module, "index_mod")
    _INFO[fn] = info
    unfolded = getattr(module, "score_mod_unfolded", None)
    if unfolded is not None:   # the twin computes qk * sm_scale itself: not sm_scaled
        _UNFOLDED[fn] = unfolded
        _INFO[unfolded] = dataclasses.replace(info, sm_scaled=False)
    _LOADED[(dialect, source, info)] = fn
    return fn


# Loaded mods (kept for the process: their identities key the tables below) and their records.
_INFO: dict[Any, ModInfo] = {}
_UNFOLDED: dict[Any, Any] = {}
