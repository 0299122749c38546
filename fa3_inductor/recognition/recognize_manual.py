"""Recognition: hand-written attention (``softmax(q @ kᵀ ...) @ v``) becomes the flex_attention op.

Runs on the graph Dynamo hands the fa3 backend, before AOT autograd (as recognize_sdpa does), so
the inserted op is differentiated by AOT like a flex_attention call the user wrote: inference
and training graphs alike; a learnable bias table read by the score_mod is a captured buffer and
gets its gradient.

How a site is found, and why not with fixed patterns. The anchor is ``softmax(S, dim=-1)``
(any spelling, optional ``dtype=``; a softmax written out as ``exp(S - max) / sum`` is first
turned into one by spelled_softmax.py), then casts and eval-mode / p=0 dropout, then a matmul with
V (``@``, ``matmul``, ``bmm``, ``einsum``). Scores by ``baddbmm`` are first spelled out as bmm,
scale and bias (baddbmm.py). ``S`` is an arbitrary elementwise expression of one
``q @ kᵀ`` product and of tensors built from positions, constants, tables and inputs. Written as
``torch._inductor.pattern_matcher`` patterns, every spelling of every stage multiplies (matmul
forms × K transposes × scale forms × softcap arrangements × bias/mask forms × mask fills × softmax
spellings × casts × dropout × GQA forms): thousands of patterns that would still miss the next
arrangement, and a matched pattern still could not express a T5 bucket computation as a mod.
Instead the anchor is matched by hand (a short, readable chain) and S is *lifted* (lift.py):
every elementwise expression is re-expressed per element as a function of (score, b, h, q_idx,
kv_idx) and captured buffers. That is exact by construction: the mod computes the same ops as
the graph, only indexed differently.

Masks. Mask layers at the top of S (``masked_fill(~m, fill)``, ``where(m, S, fill)``, ``S + A``
where A is 0 or at most -65504) are split off and planned by attention_site.py: built from
positions only, they become a mask_mod with a block mask made at rewrite time (when every row
keeps a key); read from a tensor, they stay in the score_mod and the block tables are computed
at run time. Module map: operands.py reads the spellings of q/k/v (transposes, einsum layouts,
GQA repeats, folded scales), lift.py the score expression, attention_site.py plans and emits,
canonical.py builds the op.

Left alone, with the reason recorded: symbolic shapes, softmax over another dim, anything between
softmax and the matmul other than casts, inactive dropout and views that merge or split the
batch/head dims (V is then viewed the same way), probabilities used elsewhere,
score expressions that are not elementwise, sites our kernels do not serve.

Example::

    >>> sites, extra_inputs = rewrite_manual(gm, flex_lowering.unserved_reason)   # doctest: +SKIP
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.fx

from .._log import log
from .attention_site import (AttentionSite, MaskLayer, Operand, Refused, is_mask_fill)
from .fx_ops import arg, example, op_name, static_shape
from .lift import Lifted, Lifter
from .operands import (einsum_out_perm, einsum_qk, einsum_v, peel_constant_scale,
                       transposed_source, unrepeat)
from ..report import RecognizedSite
from .sinks import match_sinks
from .spelled_softmax import canonicalize_spelled_softmax
from .baddbmm import canonicalize_baddbmm

FRONT_DOOR = "matmul-softmax"
_CASTS = {"to", "type_as", "float", "half", "bfloat16", "double", "contiguous", "type"}
_PV_OPS = {"matmul", "bmm", "einsum"}
_VIEWS = {"view", "reshape", "_unsafe_view", "flatten", "unflatten"}


def rewrite_manual(gm: torch.fx.GraphModule,
                   served: Callable[[torch.Tensor, torch.Tensor], Optional[str]]
                   ) -> tuple[list[RecognizedSite], list[torch.Tensor]]:
    """Rewrite every exact, servable hand-written attention of ``gm`` into the flex_attention
    op, in place. Returns one RecognizedSite per ``softmax -> matmul`` site seen and the
    constant tensors (block-mask tables) appended to the graph's inputs.

    ``served(example_query, example_value)`` returns None if our kernels serve that
    device/dtype/head dims (the value's may differ from the query's), else the reason.

    Example::

        >>> sites, extra = rewrite_manual(gm, lambda q, v: None)   # doctest: +SKIP
        >>> [(s.rewritten, s.mask) for s in sites]             # doctest: +SKIP
        [(True, 'causal')]
    """
    sites: list[RecognizedSite] = []
    extra_inputs: list[torch.Tensor] = []
    canonicalize_spelled_softmax(gm)
    canonicalize_baddbmm(gm)   # scores by baddbmm (diffusers, BLOOM): bmm, scale, bias
    for node in list(gm.graph.nodes):
        if op_name(node) not in _PV_OPS or not _follows_softmax(node):
            continue
        try:
            site = ManualSite(gm, node, served)
            plan = site.plan()
        except Refused as exc:
            sites.append(RecognizedSite(FRONT_DOOR, node.name, False, str(exc)))
            continue
        except Exception as exc:  # an analysis bug must not break the user's compile
            log.warning("fa3_inductor: recognition of %s failed (%s: %s); site left alone",
                        node.name, type(exc).__name__, exc)
            sites.append(RecognizedSite(FRONT_DOOR, node.name, False,
                                        f"analysis failed ({type(exc).__name__}: {exc}); "
                                        "please report it"))
            continue
        sites.append(site.emit(plan, extra_inputs))
    if any(s.rewritten for s in sites):
        # (No dead-code elimination here: the old softmax chain is dropped by AOT autograd's
        # trace, and FX's DCE could drop an in-place op Dynamo left unused.)
        gm.graph.lint()
        gm.recompile()
    return sites, extra_inputs


def _merges_leading_dims(view: torch.fx.Node) -> bool:
    """A view (``view``/``reshape``/``flatten``/``unflatten``) that keeps the last two dims (query
    and key rows) and only merges or splits the ones before them: attention per (batch, head) row
    is unchanged, so V can be viewed the same way instead."""
    src = view.args[0] if view.args else None
    before, after = static_shape(src), static_shape(view)
    return (before is not None and after is not None and len(before) >= 2 and len(after) >= 2
            and tuple(before[-2:]) == tuple(after[-2:]) and math.prod(before) == math.prod(after))


def _follows_softmax(pv: torch.fx.Node) -> bool:
    """Cheap pre-filter: the matmul's probability operand comes from a softmax."""
    probs = _pv_operands(pv)
    n = probs[0] if probs else None
    for _ in range(6):
        name = op_name(n)
        if name in ("softmax", "_softmax"):
            return True
        # Walk along the first operand of any op (not only casts/dropout), so near misses
        # get a reason too.
        first = n.args[0] if isinstance(n, torch.fx.Node) and n.args else None
        n = first if isinstance(first, torch.fx.Node) else None
    return False


def _pv_operands(pv: torch.fx.Node) -> Optional[tuple[Any, Any]]:
    if op_name(pv) == "einsum":
        operands = pv.args[1:] if len(pv.args) > 2 else (pv.args[1] if len(pv.args) > 1 else ())
        return tuple(operands) if len(operands) == 2 else None
    return arg(pv, 0, "input"), arg(pv, 1, "other") if op_name(pv) != "bmm" else arg(pv, 1,
                                                                                        "mat2")


class ManualSite(AttentionSite):
    """A hand-written ``softmax(S) @ v`` site, analysed from the graph (raises Refused).

    Example::

        >>> site = ManualSite(gm, pv_node, served); site.emit(site.plan(), extra)   # doctest: +SKIP
    """

    front_door = FRONT_DOOR

    def __init__(self, gm: torch.fx.GraphModule, pv: torch.fx.Node,
                 served: Callable[[torch.Tensor, torch.Tensor], Optional[str]]):
        self.gm, self.pv = gm, pv
        probs, v = _pv_operands(pv)
        self.softmax = self._peel_probs(probs)
        self.scores = self.softmax.args[0] if self.softmax.args else self.softmax.kwargs["input"]
        if self.sink is not None:
            self.scores = self.sink.scores   # the softmax's input is cat([scores, sinks column])
        shape = static_shape(self.scores)
        if shape is None or static_shape(pv) is None:
            raise Refused("symbolic shapes (fa3 recognizes static shapes; compile with "
                          "dynamic=False)")
        if len(shape) not in (3, 4):
            raise Refused(f"scores of rank {len(shape)} (expected [B, H, M, N] or [BH, M, N])")
        self.rank = len(shape)
        self.score_shape = shape
        # The matmul with V may see the probabilities through a view that merges or splits the
        # batch/head dims ([B, H, M, N] as [B*H, M, N], BLOOM; or back): V is viewed the other
        # way, and the output back.
        self.probs_shape = static_shape(probs)
        self.core = self._find_core()
        self.q, self.k, self.scale, self.score_node = self._split_core()
        self.v = self._value(v)
        self.gqa = self._undo_repeat()
        self._check_shapes(served)

    def _score_layers(self, full: Lifter) -> tuple[Lifted, Any, list]:
        full_score = full.lift(self.scores)
        score_root, layers = self._peel_masks()
        return full_score, score_root, layers

    _ELEMENTWISE_PATH = {"add", "sub", "mul", "div", "neg", "tanh", "where", "masked_fill",
                         "to", "type_as", "float", "half", "bfloat16", "contiguous", "clamp",
                         "minimum", "maximum", "exp", "log", "abs", "sigmoid", "type",
                         "nan_to_num", "pow", "sqrt", "rsqrt", "softcap"}

    def _peel_probs(self, probs: Any) -> torch.fx.Node:
        n = probs
        while True:
            name = op_name(n)
            if len(n.users) != 1:
                raise Refused(f"the attention probabilities ({n.name}) are also used elsewhere "
                              "(e.g. returned as attention weights); rewriting would compute "
                              "attention twice")
            if name in ("softmax", "_softmax"):
                break
            if name == "dropout":
                p = arg(n, 1, "p", 0.5)
                training = arg(n, 2, "training", True) if n.op == "call_function" else True
                if not isinstance(p, (int, float)) or (p != 0 and training is not False):
                    raise Refused(f"dropout p={p!r} in training mode between softmax and the "
                                  "matmul (only p=0 or eval mode are exact)")
                n = n.args[0] if n.args else n.kwargs["input"]
                continue
            if name in _CASTS:
                n = n.args[0]
                continue
            if name in _VIEWS and _merges_leading_dims(n):
                n = n.args[0]
                continue
            self.sink = match_sinks(n)   # gpt-oss's sinks: softmax(cat([S, sinks]))[..., :-1]
            if self.sink is not None:
                n = self.sink.softmax
                break
            raise Refused(f"{n.name} ({name or n.target}) between softmax and the matmul with "
                          "V is not a cast, an inactive dropout or a view of the batch/head dims")
        dim = arg(n, 1, "dim")
        rank = len(example(n).shape)
        if dim is None or dim % rank != rank - 1:
            raise Refused(f"softmax over dim {dim} (attention normalizes over the last dim)")
        return n

    def _find_core(self) -> torch.fx.Node:
        """The one ``q @ kᵀ`` product S is computed from (same shape as S)."""
        shape = static_shape(self.scores)
        found, stack, seen = [], [self.scores], set()
        while stack:
            n = stack.pop()
            if not isinstance(n, torch.fx.Node) or n in seen:
                continue
            seen.add(n)
            name = op_name(n)
            if name in ("matmul", "bmm", "einsum") and static_shape(n) == shape:
                found.append(n)
                continue
            if name in self._ELEMENTWISE_PATH:
                stack.extend(n.all_input_nodes)
        if len(found) != 1:
            raise Refused(f"found {len(found)} score products q @ kᵀ feeding the softmax "
                          "(expected exactly one)")
        return found[0]

    def _split_core(self):
        core = self.core
        q_spec, k_spec = self._qk_operands(core)
        scale = 1.0
        for spec in (q_spec, k_spec):
            node, factor = peel_constant_scale(spec.node)
            spec.node, scale = node, scale * factor
        score_node = core
        users = list(core.users)
        if len(users) == 1 and op_name(users[0]) in ("mul", "div"):
            other = [a for a in users[0].args if a is not core]
            if len(other) == 1 and isinstance(other[0], (int, float)) and \
                    not (op_name(users[0]) == "div" and users[0].args[0] is not core):
                c = float(other[0])
                scale *= c if op_name(users[0]) == "mul" else 1.0 / c
                score_node = users[0]
        return q_spec, k_spec, scale, score_node

    def _qk_operands(self, core: torch.fx.Node) -> tuple[Operand, Operand]:
        name = op_name(core)
        if name == "einsum":
            a, b = _pv_operands(core)
            eq = core.args[0]
            return einsum_qk(eq, a, b, self.rank)
        a, b = arg(core, 0, "input"), arg(core, 1, "other" if name == "matmul" else "mat2")
        sa, sb = static_shape(a), static_shape(b)
        if sa is None or sb is None or len(sa) != self.rank or len(sb) != self.rank:
            raise Refused(f"q @ kᵀ operands of shapes {sa} and {sb} (expected both of rank "
                          f"{self.rank}, no broadcasting)")
        # k = (kᵀ)ᵀ: a view of a view, so a transposed K costs nothing.
        src = transposed_source(b)
        k = Operand(src) if src is not None else Operand(b, [("transpose", (-2, -1))])
        return Operand(a), k

    def _value(self, v: Any) -> Operand:
        if op_name(self.pv) == "einsum":
            if self._probs_viewed():
                raise Refused("einsum with V over a view of the probabilities")
            return einsum_v(self.pv.args[0], self.rank, v)
        shape = static_shape(v)
        if self._probs_viewed():
            lead = tuple(self.score_shape[:-2])
            if shape is None or tuple(shape[:-2]) != tuple(self.probs_shape[:-2]):
                raise Refused(f"V of shape {shape} does not match the probabilities' view "
                              f"{list(self.probs_shape)}")
            return Operand(v, [("reshape", lead + tuple(shape[-2:]))])
        if shape is None or len(shape) != self.rank:
            raise Refused(f"V of shape {shape} does not match scores of rank {self.rank}")
        return Operand(v)

    def _probs_viewed(self) -> bool:
        return self.probs_shape is not None and \
            tuple(self.probs_shape[:-2]) != tuple(self.score_shape[:-2])

    def _undo_repeat(self) -> int:
        """GQA: use the un-repeated K/V (flex indexes kv head h // groups), no copy."""
        if self.rank != 4 or self.k.views or self.v.views:
            return 1
        kb, kg = unrepeat(self.k.node)
        vb, vg = unrepeat(self.v.node)
        if kg == vg and kg > 1:
            self.k.node, self.v.node = kb, vb
            return kg
        return 1

    def _peel_masks(self) -> tuple[torch.fx.Node, list[MaskLayer]]:
        lifter = Lifter(self.score_node)
        n, layers = self.scores, []
        while isinstance(n, torch.fx.Node) and n is not self.score_node:
            name = op_name(n)
            if name in ("to", "type_as", "float", "contiguous") and \
                    lifter.depends_on_score(n.args[0]):
                n = n.args[0]
                continue
            if name == "masked_fill":
                x, m, v = arg(n, 0, "input"), arg(n, 1, "mask"), arg(n, 2, "value")
                if is_mask_fill(v) and lifter.depends_on_score(x) and \
                        not lifter.depends_on_score(m):
                    layers.append(MaskLayer("fill", m, float(v), negate=True))
                    n = x
                    continue
            if name == "where" and len(n.args) == 3:
                c, a, b = n.args
                if not lifter.depends_on_score(c):
                    if is_mask_fill(b) and lifter.depends_on_score(a):
                        layers.append(MaskLayer("fill", c, float(b)))
                        n = a
                        continue
                    if is_mask_fill(a) and lifter.depends_on_score(b):
                        layers.append(MaskLayer("fill", c, float(a), negate=True))
                        n = b
                        continue
            if name == "add" and not n.kwargs.get("alpha"):
                a, b = arg(n, 0, "input"), arg(n, 1, "other")
                da, db = lifter.depends_on_score(a), lifter.depends_on_score(b)
                if da != db and isinstance(a if db else b, torch.fx.Node):
                    layers.append(MaskLayer("add", a if db else b))
                    n = a if da else b
                    continue
            break
        return n, layers

    def _output_layout(self, graph, out):
        if op_name(self.pv) == "einsum":
            perm = einsum_out_perm(self.pv.args[0], self.rank)
            if perm is not None:
                out = graph.call_method("permute", (out, *perm))
        if self._probs_viewed():
            out = graph.call_method("reshape", (out, *static_shape(self.pv)))
        return out
