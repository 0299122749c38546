"""Random score_mod / mask_mod fuzzer for ``fa3_inductor.flex``, checked against float64.

    python benchmarks/mod_fuzz.py --cases 360 --seed 0 --out DIR            # CUDA: bf16 + fp16
    python benchmarks/mod_fuzz.py --cases 20 --device cpu --out DIR          # Triton's interpreter
    python benchmarks/mod_fuzz.py --seed 0 --case 17 --device cpu            # rerun one case
    python benchmarks/mod_fuzz.py --grad --cases 360 --seed 1 --out DIR      # gradients too

Each case is a random mod pair written as Python source (expression trees over the index
arguments, the score, captured tensors and captured Python numbers; every op the mod generator
claims: arithmetic with int/float mixing, comparisons, where, abs/exp/exp2/log/log2/tanh/sigmoid,
pow in all its forms, clamps, floor, // and % on indices, gathers from 1-D and 2-D buffers of
several dtypes), crossed with a shape (ragged lengths, M = 1, M != N, GQA, several head dims) and
a dtype. The mods are real closures (``make(...)`` returns them). Outcomes, one per case:

    match                   our kernel ran (last_template() "hopper"/"generic"/"decode"), error within TOLERANCE
    fallback                torch's kernel ran (last_template() "torch"), with the reason recorded
    wrong                   error over tolerance, or non-finite output where the reference is finite
    crash                   any exception
    skipped-illconditioned  the float64 reference itself is not finite (kept rare by construction)
    ill-conditioned         over the tolerance, but within 4x the case's own sensitivity: the larger of
                            how far the float64 result moves when q, k, v and the captured floats move by
                            one rounding of the dtype (relative, random signs), and the error of the same
                            computation done eagerly in float32. The mod amplifies rounding (sqrt or pow
                            near 0, a steep clamp) more than the tolerance rule assumes. Both figures kept.

``--grad``: the same cases with gradients. q, k and v require grad, and so does each float tensor the
score_mod captures with probability 1/2 per pair (``capture_grads``: learnable biases); the output's
backward with a random dO is checked against float64 autograd through the same mods (out, dq, dk, dv and
each capture's gradient, every one within the tolerance). "fallback" then also means the dense recompute
ran the backward (``last_backward_family()`` "dense") where a backward family should have.

Cases are generated from (seed, index) alone; each prints a one-line repro. Consecutive pairs of
cases (2k, 2k + 1) share their mods, dtype, head dims and captured tensors and differ in batch and
lengths, so that on a GPU one kernel compile serves two runs. ``--workers`` shards the cases over
spawned processes (compiles run in parallel). Results: ``mod-fuzz-<device>-<date>.{json,md}``.

Example::

    >>> from mod_fuzz import build_case, run_case                  # doctest: +SKIP
    >>> run_case(build_case(seed=0, index=3, device="cpu"))["outcome"]   # doctest: +SKIP
    'match'
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import random
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "tests"):   # the package and tests/reference.py (the tolerance rule)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

OUTCOMES = ("match", "fallback", "wrong", "crash", "ill-conditioned", "skipped-illconditioned")
# unit roundoff per dtype: the perturbation that measures a case's conditioning (ill-conditioned above)
_ROUNDING = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
_CONDITION_FACTOR = 4.0

# Shapes per device. GPU head dims: 64/128/80 are served by the Hopper template, 16/40 only by
# the generic one. Captured index tables are sized for the longest length of the list.
_SHAPES = {
    "cpu": dict(batch=(1, 2), heads=((1, 1), (2, 1), (2, 2), (4, 2), (4, 1)),
                lengths=(1, 17, 37, 64, 100), dims=((16, 16), (32, 32), (64, 64), (32, 16), (80, 80)),
                dtypes=("float32", "float16")),
    "cuda": dict(batch=(1, 2), heads=((2, 2), (4, 1), (8, 2), (8, 8)),
                 lengths=(1, 33, 200, 517, 1000), dims=((64, 64), (128, 128), (80, 80), (16, 16),
                                                        (40, 40), (128, 64)),
                 dtypes=("bfloat16", "float16")),
}
_MAX_MAGNITUDE = 12.0   # float sub-expressions are rescaled above this (keeps the softmax well conditioned)


@dataclasses.dataclass
class Case:
    """One fuzz case: everything needed to rebuild its tensors and mods."""

    seed: int
    index: int
    device: str
    dtype: str
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    value_head_dim: int
    score_src: Optional[str]
    mask_src: Optional[str]
    captures: dict[str, str]          # name -> description (dtype, shape)
    max_len: int                      # captured index tables cover positions < max_len
    grad: bool = False                # --grad: gradients checked too
    capture_grads: tuple = ()         # with grad: the captured tensors that require grad

    def repro(self) -> str:
        """One line that names the case and its mods (rerun: --seed S --case I, --grad if it says grad)."""
        grad = f" grad (captures: {', '.join(self.capture_grads) or 'none'})" if self.grad else ""
        return (f"seed={self.seed} case={self.index}{grad} {self.dtype} B{self.batch} Hq{self.q_heads} "
                f"Hkv{self.kv_heads} M{self.q_len} N{self.kv_len} D{self.head_dim}/{self.value_head_dim} "
                f"score_mod: {self.score_src or 'none'} | mask_mod: {self.mask_src or 'none'}"
                + (f" | captures: {self.captures}" if self.captures else ""))


class _Expressions:
    """Random typed expression trees as Python source. Int expressions carry a value interval,
    float ones a magnitude bound, so that none overflows or makes the softmax ill-conditioned."""

    def __init__(self, rng: random.Random, q_len: int, kv_len: int, heads: int, batch: int,
                 max_len: int, score: bool):
        self.rng, self.score = rng, score
        self.leaves = {"q_idx": (0, q_len - 1), "kv_idx": (0, kv_len - 1), "h": (0, heads - 1),
                       "b": (0, batch - 1)}
        self.table_len = max_len + 3   # table[h, q_idx - kv_idx] stays in range both ways
        self.used: set[str] = set()

    def pick(self, *options):
        return self.rng.choice(options)

    # ---- integers: (source, (lo, hi)) ----
    def int_expr(self, depth: int) -> tuple[str, tuple[int, int]]:
        r = self.rng
        if depth <= 0 or r.random() < 0.25:   # a tensor: literals only appear as operands below
            name = self.pick("q_idx", "kv_idx", "q_idx", "kv_idx", "h", "b")
            return name, self.leaves[name]
        kind = self.pick("diff", "add", "sub", "scale", "abs", "floordiv", "truncdiv", "mod", "fmod",
                         "clamp", "minmax", "where", "doc", "square", "intpow", "neg")
        if kind == "diff":
            a, b = self.pick(("q_idx", "kv_idx"), ("kv_idx", "q_idx"))
            (a0, a1), (b0, b1) = self.leaves[a], self.leaves[b]
            return f"({a} - {b})", (a0 - b1, a1 - b0)
        x, (lo, hi) = self.int_expr(depth - 1)
        if kind in ("add", "sub"):
            if r.random() < 0.3:
                k = r.randint(-3, 9)
                y, (lo2, hi2) = str(k), (k, k)
            else:
                y, (lo2, hi2) = self.int_expr(depth - 1)
            return (f"({x} + {y})", (lo + lo2, hi + hi2)) if kind == "add" else \
                (f"({x} - {y})", (lo - hi2, hi - lo2))
        if kind == "scale":
            k = self.pick(-3, -1, 2, 3)
            return f"({x} * {k})", (min(lo * k, hi * k), max(lo * k, hi * k))
        if kind == "abs":
            return self.pick(f"torch.abs({x})", f"({x}).abs()", f"abs({x})"), \
                (0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), max(abs(lo), abs(hi)))
        if kind == "neg":
            return f"(-{x})", (-hi, -lo)
        if kind == "floordiv":
            k = self.pick(2, 3, 5, 16, -3)
            src = self.pick(f"({x} // {k})", f"torch.div({x}, {k}, rounding_mode='floor')")
            return src, (min(lo // k, hi // k), max(lo // k, hi // k))
        if kind == "truncdiv":
            k = self.pick(2, 3, -4)
            return f"torch.div({x}, {k}, rounding_mode='trunc')", (-max(abs(lo), abs(hi)), max(abs(lo), abs(hi)))
        if kind == "mod":
            k = self.pick(2, 3, 4, 7, -3)
            return f"({x} % {k})", ((0, k - 1) if k > 0 else (k + 1, 0))
        if kind == "fmod":
            k = self.pick(3, 5)
            return f"torch.fmod({x}, {k})", (-(k - 1), k - 1)
        if kind == "clamp":
            a = self.rng.randint(-2, 4)
            b = a + self.rng.randint(0, 20)
            return self.pick(f"torch.clamp({x}, {a}, {b})", f"({x}).clamp({a}, {b})"), \
                (max(lo, a), max(min(hi, b), a))
        if kind == "minmax":
            y, (lo2, hi2) = self.int_expr(depth - 1)
            fn = self.pick("minimum", "maximum")
            pick = min if fn == "minimum" else max
            return f"torch.{fn}({x}, {y})", (pick(lo, lo2), pick(hi, hi2))
        if kind == "where":
            c = self.bool_expr(depth - 1)
            y, (lo2, hi2) = self.int_expr(depth - 1)
            return f"torch.where({c}, {x}, {y})", (min(lo, lo2), max(hi, hi2))
        if kind == "doc":
            self.used.add("doc")
            return f"doc[{self.pick('q_idx', 'kv_idx')}]", (0, 7)
        if kind == "square":
            if max(abs(lo), abs(hi)) > 1000:
                return x, (lo, hi)
            m = max(lo * lo, hi * hi)
            return f"({x}) ** 2", (0 if lo <= 0 <= hi else min(lo * lo, hi * hi), m)
        # int ** int tensor with a provably small, non-negative exponent
        e = f"({self.pick('h', 'q_idx', 'kv_idx')} % {self.pick(2, 3)})"
        base = self.pick("2", "3", "(kv_idx % 5)", "(q_idx - kv_idx)")
        return f"{base} ** {e}", (-10 ** 6, 10 ** 6)

    # ---- booleans (source) ----
    def bool_expr(self, depth: int) -> str:
        r = self.rng
        kind = self.pick("cmp", "cmp", "cmp", "doc", "keep", "float_cmp", "head", "and", "or", "not")
        if depth <= 0 and kind in ("and", "or", "not"):
            kind = "cmp"
        if kind == "cmp":
            x, _ = self.int_expr(depth - 1)   # a tensor (int_expr never returns a bare literal)
            y, _ = self.int_expr(depth - 1) if r.random() < 0.5 else (str(r.randint(-2, 40)), None)
            return f"({x} {self.pick('<', '<=', '>', '>=', '==', '!=')} {y})"
        if kind == "doc":
            self.used.add("doc")
            return "(doc[q_idx] == doc[kv_idx])"
        if kind == "keep":
            self.used.add("keep")
            return f"keep[{self.pick('kv_idx', 'q_idx')}]"
        if kind == "float_cmp":   # exact in float32 and float64: dyadic scales of small integers
            return f"((q_idx * {self.pick(0.5, 0.25)}) {self.pick('>=', '<')} (kv_idx * {self.pick(0.5, 1.5)}))"
        if kind == "head":
            if r.random() < 0.5:
                self.used.add("bias")
                return f"(bias[h] {self.pick('>', '<')} 0)"
            return f"((h % 2) == {r.randint(0, 1)})"
        if kind == "not":
            return f"(~{self.bool_expr(depth - 1)})"
        op = "&" if kind == "and" else "|"
        return f"({self.bool_expr(depth - 1)} {op} {self.bool_expr(depth - 1)})"

    # ---- floats: (source, magnitude bound) ----
    def float_expr(self, depth: int) -> tuple[str, float]:
        src, m = self._float_expr(depth)
        if m > _MAX_MAGNITUDE:
            factor = float(f"{_MAX_MAGNITUDE / m:.2g}")
            return f"(({src}) * {factor})", m * factor
        return src, m

    def _float_leaf(self) -> tuple[str, float]:
        r = self.rng
        kind = self.pick("score", "score", "score", "index", "index", "bias", "table", "scal",
                         "alibi", "intmix") if self.score else self.pick("index", "bias", "table", "alibi")
        if kind == "score":
            return "score", 6.0
        if kind == "index":
            x, (lo, hi) = self.int_expr(2)
            m = max(abs(lo), abs(hi), 1)
            form = self.pick("scale", "div", "float")
            if form == "div":
                k = self.pick(7, 3.5, 16)
                return f"({x} / {k})", m / k
            if form == "float" and m <= 12:
                return f"({x}).float()", m
            c = self.pick(0.25, -0.125, 0.5, 0.03)
            return f"({x} * {c})", m * abs(c)
        if kind == "intmix":   # an int expression added to the float score as is
            x, (lo, hi) = self.int_expr(2)
            if max(abs(lo), abs(hi)) <= 12:
                return x, max(abs(lo), abs(hi))
            return f"({x} % 5)", 4
        if kind == "bias":
            self.used.add("bias")
            return "bias[h]", 4.0
        if kind == "table":
            self.used.add("table")
            index = self.pick("(q_idx - kv_idx)", "(kv_idx - q_idx)",
                              f"torch.clamp(q_idx - kv_idx + 8, 0, {self.table_len - 1})",
                              f"(q_idx - kv_idx) % {self.table_len}", "kv_idx // 2")
            return self.pick(f"table[h, {index}]", f"table[h][{index}]"), 4.0
        if kind == "scal":
            self.used.add("scal")
            return "scal", 2.0
        if kind == "alibi":
            self.used.add("H")
            return "((kv_idx - q_idx) * (2.0 ** (-(h + 1) * 8.0 / H)))", 0.5 * max(self.leaves["q_idx"][1], self.leaves["kv_idx"][1], 1)
        raise AssertionError(kind)

    def constant(self) -> tuple[str, float]:
        """A Python number operand: a literal or the captured number C (never a whole expression:
        torch.tanh(1.5) is not a tensor op)."""
        if self.rng.random() < 0.3:
            self.used.add("C")
            return "C", 1.75
        c = round(self.rng.uniform(-3, 3), 2)
        return repr(c), abs(c)

    def _float_expr(self, depth: int) -> tuple[str, float]:
        if depth <= 0 or self.rng.random() < 0.2:
            return self._float_leaf()
        kind = self.pick("add", "sub", "mul", "div", "tanh", "sigmoid", "exp", "exp2", "log", "log2",
                         "abs", "sqrt", "clamp", "clamp_min", "clamp_max", "where", "leaky", "minmax",
                         "square", "cube", "rsqrt_pow", "recip_pow", "frac_pow", "tensor_pow", "const_pow",
                         "neg_base_pow", "zero_base_pow", "floor", "softcap", "neg")
        x, m = self.float_expr(depth - 1)
        if kind in ("add", "sub", "minmax"):
            y, m2 = self.constant() if kind != "minmax" and self.rng.random() < 0.25 else \
                self.float_expr(depth - 1)
            if kind == "minmax":
                return f"torch.{self.pick('maximum', 'minimum')}({x}, {y})", max(m, m2)
            return f"({x} {'+' if kind == 'add' else '-'} {y})", m + m2
        if kind == "mul":
            y, m2 = self.pick((f"torch.tanh({x})", 1.0), (f"torch.sigmoid({x})", 1.0), self.constant())
            z, m3 = self.float_expr(depth - 1)
            return f"({z} * {y})", m3 * m2
        if kind == "div":
            if self.rng.random() < 0.5:
                y, _ = self.float_expr(depth - 1)
                return f"({x} / (1.0 + torch.abs({y})))", m
            k = self.pick(2, 3.0, -4, 0.5)
            return f"({x} / {k})", m / abs(k)
        if kind == "neg":
            return f"(-{x})", m
        if kind == "tanh":
            return f"torch.tanh({x})", 1.0
        if kind == "sigmoid":
            return self.pick(f"torch.sigmoid({x})", f"({x}).sigmoid()"), 1.0
        if kind == "softcap":
            c = self.pick(2.0, 5.0, 30.0)
            return f"({c} * torch.tanh({x} / {c}))", min(c, m)
        if kind in ("exp", "exp2"):
            return f"torch.{kind}(torch.clamp({x}, -6.0, 2.0))", 7.4
        if kind == "log":
            return f"torch.log(1.0 + torch.abs({x}))", 3.0
        if kind == "log2":
            return f"torch.log2(2.0 + ({x}).abs())", 4.0
        if kind == "abs":
            return f"torch.abs({x})", m
        if kind == "sqrt":
            return f"torch.sqrt(torch.abs({x}))", m ** 0.5
        if kind == "clamp":
            a = round(self.rng.uniform(-4, 1), 1)
            b = round(a + 3.5, 1)
            return self.pick(f"torch.clamp({x}, {a}, {b})", f"({x}).clamp({a}, {b})"), max(abs(a), abs(b))
        if kind == "clamp_min":
            return f"torch.clamp_min({x}, -1.5)", m
        if kind == "clamp_max":
            return f"({x}).clamp_max(2.5)", m
        if kind == "where":
            y, m2 = self.float_expr(depth - 1)
            return f"torch.where({self.bool_expr(1)}, {x}, {y})", max(m, m2)
        if kind == "leaky":
            return f"torch.where({x} > 0, {x}, {x} * 0.25)", m
        if kind == "square":
            return (f"({x}) ** 2", m * m) if m <= 4 else (x, m)
        if kind == "cube":
            return (f"(({x}) ** 3 * 0.05)", m ** 3 * 0.05) if m <= 4 else (x, m)
        if kind == "rsqrt_pow":
            return f"(1.0 + torch.abs({x})) ** -0.5", 1.0
        if kind == "recip_pow":
            return f"(1.0 + torch.abs({x})) ** {self.pick(-1, -2)}", 1.0
        if kind == "frac_pow":
            return f"torch.abs({x}) ** {self.pick(0.5, 1.5, 0.75)}", max(m, 1.0) ** 1.5
        if kind == "tensor_pow":   # a positive base to a bounded float tensor power
            y, _ = self.float_expr(depth - 1)
            return f"(torch.abs({x}) + 0.5) ** torch.clamp({y}, -2.0, 1.5)", max(m + 0.5, 2.0) ** 1.5 + 4
        if kind == "const_pow":    # a Python number ** a tensor
            c = self.pick(2.0, 0.5, 3, 10.0, 1.0)
            return f"({c} ** torch.clamp({x}, -3.0, 2.0))", 100.0 if c == 10.0 else 9.0
        if kind == "neg_base_pow":  # a negative base to an integer-valued power (int or float tensor)
            e = self.pick("(h % 3)", "(kv_idx % 4)", "torch.floor(torch.clamp((q_idx - kv_idx) * 0.25, -2.0, 3.0))")
            return f"({self.pick(-1.5, -2.0)} ** {e})", 8.0
        if kind == "zero_base_pow":
            return f"(0.0 ** (q_idx % 3))", 1.0
        # floor of an exact (dyadic) index float; floor of the score would amplify rounding
        i, (lo, hi) = self.int_expr(1)
        return f"torch.floor({i} * 0.25)", max(abs(lo), abs(hi)) * 0.25 + 1


def _pick_shape(rng: random.Random, device: str, pair_rng: random.Random) -> dict:
    grid = _SHAPES["cpu" if device == "cpu" else "cuda"]
    q_heads, kv_heads = pair_rng.choice(grid["heads"])
    head_dim, value_head_dim = pair_rng.choice(grid["dims"])
    return dict(dtype=pair_rng.choice(grid["dtypes"]), q_heads=q_heads, kv_heads=kv_heads,
                head_dim=head_dim, value_head_dim=value_head_dim, batch=rng.choice(grid["batch"]),
                q_len=rng.choice(grid["lengths"]), kv_len=rng.choice(grid["lengths"]),
                max_len=max(grid["lengths"]))


def build_case(seed: int, index: int, device: str = "cpu", grad: bool = False) -> Case:
    """The case ``index`` of the run with ``seed`` (pure: the same arguments give the same case; ``grad``
    changes nothing but the gradients asked for, so a --grad run checks the same mods and shapes).

    Example::

        >>> build_case(0, 5).repro()                                   # doctest: +SKIP
        'seed=0 case=5 float32 B2 Hq4 Hkv2 M37 N100 D32/32 score_mod: ... | mask_mod: none'
    """
    pair_rng = random.Random(f"{seed}-pair-{index // 2}")   # mods, dtype, heads and dims of a pair
    shape = _pick_shape(random.Random(f"{seed}-case-{index}"), device, pair_rng)
    # The mods are drawn with the pair's largest lengths, so that both cases share them.
    exprs_score = _Expressions(pair_rng, shape["max_len"], shape["max_len"], shape["q_heads"], 2,
                               shape["max_len"], score=True)
    which = pair_rng.choice(("score", "mask", "both", "both"))
    score_src = mask_src = None
    if which in ("score", "both"):
        body, _ = exprs_score.float_expr(pair_rng.choice((1, 2, 3)))
        if not re.search(r"\bscore\b", body) and pair_rng.random() < 0.7:
            body = f"score + {body}"
        score_src = body
    exprs_mask = _Expressions(pair_rng, shape["max_len"], shape["max_len"], shape["q_heads"], 2,
                              shape["max_len"], score=False)
    if which in ("mask", "both"):
        mask_src = exprs_mask.bool_expr(pair_rng.choice((1, 2, 2, 3)))
    used = exprs_score.used | exprs_mask.used
    captures = {name: desc for name, desc in _capture_descriptions(pair_rng, shape).items() if name in used}
    capture_grads: tuple = ()
    if grad:   # a separate stream: the mods and shapes stay those of the run without --grad
        grad_rng = random.Random(f"{seed}-capture-grads-{index // 2}")
        capture_grads = tuple(name for name in ("bias", "table", "scal")   # (draws as before the mask filter)
                              if name in exprs_score.used and grad_rng.random() < 0.5
                              and name not in exprs_mask.used)   # a mask's captures may not need grad (flex)
    return Case(seed=seed, index=index, device=device, score_src=score_src, mask_src=mask_src,
                captures=captures, grad=grad, capture_grads=capture_grads, **shape)


def _capture_descriptions(rng: random.Random, shape: dict) -> dict[str, str]:
    return {"bias": rng.choice(("float32", "float16", "bfloat16")),
            "table": rng.choice(("float32", "float16")),
            "doc": rng.choice(("int32", "int64")),
            "keep": "bool", "scal": "float32", "C": "python float", "H": "python int"}


_FACTORY = """
def make(bias, table, doc, keep, scal, C, H):
    def score_mod(score, b, h, q_idx, kv_idx):
        return {score}

    def mask_mod(b, h, q_idx, kv_idx):
        return {mask}

    return score_mod, mask_mod
"""


def materialize(case: Case, device: Any, exact_captures: bool = False) -> tuple:
    """(q, k, v, score_mod, mask_mod) on ``device``; mods are closures over the case's captures.
    ``exact_captures``: captured float tensors in float64 (same values), for the reference: the
    kernels compute mods in float32 whatever the buffer's dtype (as Inductor's fused code does),
    so ``2.0 + half_table[i]`` must not round to float16 in the reference either. With
    ``case.grad`` q, k, v and the ``capture_grads`` tensors are leaves that require grad."""
    return _materialize(case, device, exact_captures)[:5]


def _materialize(case: Case, device: Any, exact_captures: bool = False, perturb: float = 0.0,
                 precision: Any = None) -> tuple:
    """materialize's five, then the captures by name (to read their gradients). ``precision`` (with
    ``exact_captures``): the captured floats' dtype, float64 by default. ``perturb``: q, k, v and the
    captured floats times (1 ± perturb), random signs, in float64."""
    import torch

    dtype = getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(hash_int(f"{case.seed}-data-{case.index}"))
    pair = torch.Generator().manual_seed(hash_int(f"{case.seed}-captures-{case.index // 2}"))

    def randn(*shape, generator=gen, dt=dtype):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dt)

    q = randn(case.batch, case.q_heads, case.q_len, case.head_dim)
    k = randn(case.batch, case.kv_heads, case.kv_len, case.head_dim)
    v = randn(case.batch, case.kv_heads, case.kv_len, case.value_head_dim)
    length = case.max_len
    caps = dict(
        bias=randn(case.q_heads, generator=pair, dt=getattr(torch, case.captures.get("bias", "float32"))),
        table=randn(case.q_heads, length + 3, generator=pair,
                    dt=getattr(torch, case.captures.get("table", "float32"))),
        doc=torch.sort(torch.randint(0, 8, (length,), generator=pair)).values.to(
            device=device, dtype=getattr(torch, case.captures.get("doc", "int32"))),
        keep=(torch.rand(length, generator=pair) < 0.7).to(device),
        scal=torch.randn((), generator=pair).to(device), C=1.75, H=case.q_heads)
    if exact_captures:
        caps = {name: t.to(precision or torch.float64) if isinstance(t, torch.Tensor) and t.is_floating_point()
                else t for name, t in caps.items()}
    if perturb:
        signs = torch.Generator().manual_seed(hash_int(f"{case.seed}-perturb-{case.index}"))

        def moved(t):
            t = t.to(precision or torch.float64)
            sign = torch.randint(0, 2, t.shape, generator=signs).to(t.device, torch.float64) * 2 - 1
            return t * (1 + perturb * sign)

        q, k, v = moved(q), moved(k), moved(v)
        caps = {name: moved(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                for name, t in caps.items()}
    if case.grad:
        for t in (q, k, v, *(caps[name] for name in case.capture_grads)):
            t.requires_grad_()
    namespace: dict[str, Any] = {"torch": torch}
    exec(_FACTORY.format(score=case.score_src or "score", mask=case.mask_src or "True"), namespace)
    score_mod, mask_mod = namespace["make"](**caps)
    return q, k, v, (score_mod if case.score_src else None), (mask_mod if case.mask_src else None), caps


def elementwise(mod: Optional[Any], kind: str) -> Optional[Any]:
    """``mod`` applied per (b, h, q_idx, kv_idx) element through nested vmaps, as FlexAttention
    defines it, taking the broadcast index tensors reference_attention passes (b [B,1,1,1], ...).
    Chained indexing (``table[h][i]``) needs this: on broadcast index tensors it would index the
    wrong dimension."""
    if mod is None:
        return None
    from torch.func import vmap

    fn, lead = mod, (0,) if kind == "score" else ()
    for axis in (3, 2, 1, 0):   # kv, q, h, b: innermost first
        dims = [None] * 4
        dims[axis] = 0
        fn = vmap(fn, in_dims=(*lead, *dims))

    def apply(*args):
        *score, b, h, q, kv = args
        return fn(*score, b.flatten(), h.flatten(), q.flatten(), kv.flatten())

    return apply


def hash_int(text: str) -> int:
    """A stable 63-bit seed from a string (Python's hash() is salted per process)."""
    import hashlib

    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


class _LogLines(logging.Handler):
    """The fa3_inductor log's lines while one case runs (where a run-time fallback says why)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _fallback_reason(sites_before: int, log_lines: list[str]) -> str:
    """Why torch's kernel ran: the lowering's recorded reason (lowered_sites()), else what the
    fa3_inductor log said (a kernel that failed to build falls back at run time)."""
    import fa3_inductor

    sites = fa3_inductor.lowered_sites()[sites_before:]
    reasons = [s["fallback_reason"] for s in sites if s.get("fallback_reason")]
    reasons += [line for line in log_lines if "torch's kernel" in line or "falls back" in line]
    return "; ".join(reasons) or "no reason recorded (lowered_sites() and the log say nothing)"


@contextlib.contextmanager
def _captured_log():
    """The fa3_inductor log's lines (INFO and up) while the block runs."""
    log, lines = logging.getLogger("fa3_inductor"), _LogLines()
    level = log.level
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    try:
        yield lines.lines
    finally:
        log.removeHandler(lines)
        log.setLevel(level)


def _abs_grad():
    """An identity whose backward passes |grad|, vmappable (torch.func rules from the forward)."""
    import torch

    class AbsGrad(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return x.view_as(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, grad):
            return grad.abs()

    return AbsGrad.apply


def _reference(case: Case, device: Any, dout: Any = None, perturb: float = 0.0,
               precision: Any = None) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The float64 output and, given ``dout``, its gradients by name (dq, dk, dv, d<capture>) and each capture's
    gradient scale: its gradient with every score's gradient dS replaced by |dS|. A capture's gradient sums dS over
    many scores, and a softmax row's dS sum to zero, so it can cancel to nothing (``score + bias[h]`` shifts whole rows:
    its exact gradient is 0); its error is measured against that scale, the size of what was summed.
    ``perturb``: on inputs moved by that relative amount (_materialize); ``precision``: computed in that
    dtype instead (float32: an honest implementation's own error); both for the conditioning."""
    import torch

    from reference import reference_attention

    precision = precision or torch.float64

    def run(mod_wrap=None):
        q, k, v, score_mod, mask_mod, caps = _materialize(case, device, exact_captures=True, perturb=perturb,
                                                          precision=precision)
        leaves = {"q": q.detach().to(precision).requires_grad_(), "k": k.detach().to(precision).requires_grad_(),
                  "v": v.detach().to(precision).requires_grad_(),
                  **{name: caps[name] for name in case.capture_grads}}
        if mod_wrap is not None and score_mod is not None:   # (+ 0 * score: one value a score, never broadcast)
            score_mod = (lambda mod: lambda score, *idx: mod_wrap(mod(score, *idx) + 0.0 * score))(score_mod)
        out, _ = reference_attention(leaves["q"], leaves["k"], leaves["v"], score_mod=elementwise(score_mod, "score"),
                                     mask_mod=elementwise(mask_mod, "mask"), precision=precision)
        if dout is not None:
            out.backward(dout.to(precision))
        # no path from a leaf to the output (a score_mod that ignores the score): its gradient is zero
        return out.detach(), {f"d{name}": torch.zeros_like(t) if t.grad is None else t.grad
                              for name, t in leaves.items()}

    if dout is None:
        with torch.no_grad():
            return run()[0], {}, {}
    out, grads = run()
    if not case.capture_grads:
        return out, grads, {}
    abs_grads = run(_abs_grad())[1]
    return out, grads, {f"d{name}": abs_grads[f"d{name}"] for name in case.capture_grads}


def _relative_error(got: Any, exact: Any, size_of: Any = None) -> float:
    """||got - exact|| over the larger of ||exact|| and ||size_of|| (a result's natural size where the
    exact one may cancel to nothing: a capture gradient's summands, dv for a dq that is zero by
    structure); infinite where ``got`` is not finite (reference.rel_error without ``size_of``)."""
    from reference import rel_error

    if size_of is None:
        return rel_error(got, exact)
    if not bool(got.isfinite().all()):
        return float("inf")
    size = max(exact.norm().item(), size_of.norm().item())
    return (got.double() - exact).norm().item() / (size if size > 0 else 1.0)


def _classify(result: dict[str, Any], errors: dict[str, float], tolerances: dict[str, float], template: str,
              family: Optional[str], fallback: Optional[str]) -> dict[str, Any]:
    """The outcome from each tensor's error against its tolerance (and, over it, against the case's own
    conditioning: result["condition"]), then the families that ran."""
    result.update(template=template, error=errors["out"], errors=errors, tolerance=tolerances["out"])
    if family is not None:
        result["backward_family"] = family
    over = {name: err for name, err in errors.items() if err > tolerances[name]}
    condition = result.get("condition", {})
    amplified = {name: err for name, err in over.items() if err > _CONDITION_FACTOR * condition.get(name, 0.0)}
    where = f"({template}{', ' + family if family else ''})"
    if amplified:
        name = max(amplified, key=lambda n: amplified[n] / tolerances[n])
        result.update(outcome="wrong", detail=f"relative error of {name} {errors[name]:.3e} > {tolerances[name]:.1e} "
                                              f"and > {_CONDITION_FACTOR:g}x its rounding response "
                                              f"{condition.get(name, 0.0):.1e} {where}")
    elif over:
        result.update(outcome="ill-conditioned", detail="; ".join(
            f"{name} {err:.3e} > {tolerances[name]:.1e}, its own sensitivity {condition[name]:.1e}"
            for name, err in over.items()) + f" {where}")
    elif fallback is not None:
        result.update(outcome="fallback", detail=fallback)
    elif template in ("hopper", "generic", "decode"):   # decode: queries of <= 16 tokens
        result["outcome"] = "match"
    else:
        result.update(outcome="crash", detail=f"last_template() is {template!r}")
    return result


def run_case(case: Case, device: Optional[str] = None) -> dict[str, Any]:
    """Run one case through ``fa3_inductor.flex`` (and, with ``case.grad``, its backward) and classify
    it (see the module docstring).

    Example::

        >>> run_case(build_case(0, 0))["outcome"] in OUTCOMES            # doctest: +SKIP
        True
    """
    import torch

    import fa3_inductor
    from fa3_inductor.runtime.ops_bwd import last_backward_family
    from reference import TOLERANCE, rel_error

    started = time.time()
    device = device or case.device
    result: dict[str, Any] = {"index": case.index, "repro": case.repro(), "case": dataclasses.asdict(case)}
    try:
        q, k, v, score_mod, mask_mod, caps = _materialize(case, device)
        dout = None
        if case.grad:
            gen = torch.Generator().manual_seed(hash_int(f"{case.seed}-dout-{case.index}"))
            dout = torch.randn(case.batch, case.q_heads, case.q_len, case.value_head_dim,
                               generator=gen).to(device=device, dtype=q.dtype)
        ref, ref_grads, scales = _reference(case, device, dout)
        if not torch.isfinite(ref).all() or not all(torch.isfinite(g).all() for g in ref_grads.values()):
            return {**result, "outcome": "skipped-illconditioned", "seconds": time.time() - started,
                    "detail": "the float64 reference is not finite"}
        sites_before = len(fa3_inductor.lowered_sites())
        backward_before = len(fa3_inductor.lowered_backward_sites())
        with _captured_log() as lines, torch.set_grad_enabled(case.grad):
            out = fa3_inductor.flex(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                    enable_gqa=case.q_heads != case.kv_heads)
            template = fa3_inductor.last_template()
            if case.grad:
                out.backward(dout)
        tol = TOLERANCE[getattr(torch, case.dtype)]
        errors, tolerances = {"out": rel_error(out.detach(), ref)}, {"out": tol}
        grads = {"dq": q.grad, "dk": k.grad, "dv": v.grad,
                 **{f"d{name}": caps[name].grad for name in case.capture_grads}}
        for name, ref_grad in ref_grads.items():   # an input the backward left untouched: zero, as in float64
            got = torch.zeros_like(ref_grad) if grads[name] is None else grads[name]
            size_of = scales.get(name)   # a capture's: the size of its summands (_reference)
            if name in ("dq", "dk") and 0 < ref_grads["dv"].norm() and \
                    ref_grad.norm() <= 1e-12 * ref_grads["dv"].norm():
                size_of = ref_grads["dv"]   # zero by structure (one key: dS = P (dP - Δ) = 0): the size dO gives dv
            errors[name] = _relative_error(got, ref_grad, size_of)
            tolerances[name] = max(tol, TOLERANCE.get(got.dtype, tol))   # a gradient is kept in its tensor's dtype
        family, fallback = (_backward_family(backward_before, last_backward_family()) if case.grad
                            else (None, None))
        if template == "torch":
            fallback = _fallback_reason(sites_before, lines)
        if any(errors[name] > tolerances[name] for name in errors):
            # the case's own sensitivity: how far rounding the inputs moves the float64 result, and float32's error
            exact = {"out": ref, **ref_grads}
            moved, moved_grads, _ = _reference(case, device, dout, perturb=_ROUNDING[case.dtype])
            single, single_grads, _ = _reference(case, device, dout, precision=torch.float32)
            result["condition"] = {
                name: max(_relative_error(got, exact[name], scales.get(name)),
                          _relative_error(single_grads.get(name, single), exact[name], scales.get(name)))
                for name, got in {"out": moved, **moved_grads}.items()}
        _classify(result, errors, tolerances, template, family, fallback)
    except Exception as exc:  # every failure is a result, not an abort of the run
        result.update(outcome="crash", detail=f"{type(exc).__name__}: {str(exc)[:2000]}",
                      traceback=traceback.format_exc()[-4000:])
    result["seconds"] = round(time.time() - started, 2)
    return result


def _backward_family(sites_before: int, last_called: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(the family that ran this case's backward, why it was a fallback or None). The site lowered for
    it says which family it planned ("dense" or "torch" when none of ours serves, with the reason); a
    planned family ran through flex_bwd.families, which names what it ran (last_called: "dense" if the
    family refused at run time). A case whose compile was reused (the pair's second) lowers nothing:
    its site is the latest."""
    import fa3_inductor

    sites = fa3_inductor.lowered_backward_sites()
    if not sites:
        return last_called, None
    site = (sites[sites_before:] or sites)[-1]
    if site["family"] in ("dense", "torch"):
        return site["family"], f"the backward ran on {site['family']}: {site['reason']}"
    if last_called == "dense":
        return last_called, "the dense recompute ran the backward: the planned family refused at run time"
    return last_called, None


def _fresh_compiles():
    """Every compile really lowers, so a fallback's reason is recorded (a cache hit records none)."""
    import contextlib

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    stack = contextlib.ExitStack()
    stack.enter_context(inductor_config.patch(fx_graph_cache=False))
    stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
    return stack


def _worker_init(device: str) -> None:
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported in this process
    import torch

    _fresh_compiles().__enter__()   # for the worker's lifetime
    torch.set_num_threads(int(os.environ.get("MOD_FUZZ_THREADS", "1")))
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)


def _run_indices(args: tuple[int, list[int], str, bool]) -> list[dict[str, Any]]:
    seed, indices, device, grad = args
    return [run_case(build_case(seed, i, device, grad)) for i in indices]


def run_cases(seed: int, indices: list[int], device: str, workers: int = 1,
              progress: bool = True, grad: bool = False) -> list[dict[str, Any]]:
    """Results of the given cases, in index order; ``workers`` > 1 shards them over spawned
    processes (pairs of cases stay together: they share a kernel compile). ``grad``: gradients too.

    Example::

        >>> [r["outcome"] for r in run_cases(0, [0, 1], "cpu")]        # doctest: +SKIP
        ['match', 'match']
    """
    pairs: dict[int, list[int]] = {}
    for i in indices:
        pairs.setdefault(i // 2, []).append(i)
    tasks = [(seed, group, device, grad) for group in pairs.values()]
    results: list[dict[str, Any]] = []
    started = time.time()

    def report(batch: list[dict[str, Any]]) -> None:
        for r in batch:
            results.append(r)
            if progress:
                line = f"[{len(results)}/{len(indices)} {time.time() - started:.0f}s] {r['outcome']:<8}"
                if r["outcome"] != "match":
                    line += f" {r.get('detail', '')[:300]}\n    repro: {r['repro']}"
                else:
                    line += f" {r.get('template')} err={r.get('error', 0):.1e} case={r['index']}"
                print(line, flush=True)

    if workers <= 1:
        with _fresh_compiles():
            for task in tasks:
                report(_run_indices(task))
    else:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(workers, initializer=_worker_init, initargs=(device,)) as pool:
            for batch in pool.imap_unordered(_run_indices, tasks):
                report(batch)
    return sorted(results, key=lambda r: r["index"])


def summarize(results: list[dict[str, Any]]) -> dict[str, int]:
    """Counts per outcome (every outcome listed, zeros included)."""
    counts = {o: 0 for o in OUTCOMES}
    for r in results:
        counts[r["outcome"]] += 1
    return counts


def _environment(device: str) -> dict[str, str]:
    import torch
    import triton

    name = torch.cuda.get_device_name() if device != "cpu" and torch.cuda.is_available() else \
        "cpu (Triton interpreter)"
    return {"device": name, "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M")}


def write_results(results: list[dict[str, Any]], out_dir: str, env: dict[str, str], seed: int,
                  seconds: float, grad: bool = False) -> tuple[Path, Path]:
    """Write mod-fuzz-<device>-<date>[-grad].json and .md into ``out_dir``; returns their paths."""
    slug = re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-") or "unknown"
    stem = f"mod-fuzz-{slug}-{datetime.datetime.now().strftime('%Y-%m-%d-%H%M')}" + ("-grad" if grad else "")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    counts = summarize(results)
    templates: dict[str, int] = {}
    for r in results:
        if r.get("template"):
            templates[r["template"]] = templates.get(r["template"], 0) + 1
    payload = {**env, "seed": seed, "grad": grad, "cases": len(results), "seconds": round(seconds, 1),
               "counts": counts, "templates": templates, "results": results}
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(payload, indent=1, default=str))
    lines = [f"# mod fuzz{' with gradients' if grad else ''}: {env['device']}", "",
             f"torch {env['torch']}, triton {env['triton']}, {env['date']}; seed {seed}, "
             f"{len(results)} cases in {seconds:.0f} s" + (" (out, dq, dk, dv and the captures' gradients against "
                                                          "float64 autograd)" if grad else ""), "",
             "| outcome | cases |", "|---|---|"] + [f"| {o} | {n} |" for o, n in counts.items()] + \
        ["", "Templates that ran: " + ", ".join(f"{t} {n}" for t, n in sorted(templates.items())), ""]
    families = collections.Counter(r["backward_family"] for r in results if r.get("backward_family"))
    if families:
        lines += ["Backward families that ran: " + ", ".join(f"{f} {n}" for f, n in sorted(families.items())), ""]
    for outcome in ("wrong", "crash", "ill-conditioned", "fallback", "skipped-illconditioned"):
        listed = [r for r in results if r["outcome"] == outcome]
        if listed:
            lines += [f"## {outcome} ({len(listed)})", ""]
            lines += [f"- {r.get('detail', '')[:400]}  \n  `{r['repro']}`" for r in listed] + [""]
    md_path.write_text("\n".join(lines))
    return json_path, md_path


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=360)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--case", type=int, action="append", help="run only these case indices")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--out", default=None, help="folder for the JSON and markdown results")
    parser.add_argument("--grad", action="store_true", help="check the backward too (module docstring)")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    indices = args.case if args.case else list(range(args.cases))
    started = time.time()
    results = run_cases(args.seed, indices, args.device, workers=min(args.workers, len(indices)), grad=args.grad)
    seconds = time.time() - started
    counts = summarize(results)
    print(f"{len(results)} cases in {seconds:.0f} s: " + ", ".join(f"{o} {n}" for o, n in counts.items()))
    if args.out:
        paths = write_results(results, args.out, _environment(args.device), args.seed, seconds, args.grad)
        print("wrote " + ", ".join(str(p) for p in paths))
    for r in results:
        if r["outcome"] in ("wrong", "crash") and args.case:
            print(r.get("traceback", ""))
    return 1 if counts["wrong"] or counts["crash"] else 0


if __name__ == "__main__":
    sys.exit(main())
