"""Recognition: hand-written attention (``softmax(q @ kᵀ ...) @ v``) becomes the flex_attention op.

Runs on the graph Dynamo hands the fa3 backend, before AOT autograd (as recognize_sdpa does), so
the inserted op is differentiated by AOT like a flex_attention call the user wrote: inference
and training graphs alike; a learnable bias table read by the score_mod is a captured buffer and
gets its gradient.

How a site is found, and why not with fixed patterns. The anchor is ``softmax(S, dim=-1)``
(any spelling, optional ``dtype=``; a softmax written out as ``exp(S - max) / sum`` is first
turned into one by spelled_softmax.py), then casts and eval-mode / p=0 dropout, then a matmul with
V (``@``, ``matmul``, ``bmm``, ``einsum``). Scores by ``baddbmm`` are first spelled out as bmm,
scale and bias (baddbmm.py); scores written in place (MViTv2's slice assignment, Flaubert's
``masked_fill_``) are turned out of place where that is exact (score_writes.py). ``S`` is an
arbitrary elementwise expression of one ``q @ kᵀ`` product and of tensors built from positions,
constants, tables and inputs. Written as
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

Batch dims. The scores may be [B, H, M, N], [B*H, M, N] (bmm / baddbmm over merged batch and
heads) or [B, H, n1, .., M, N] (windows, blocks); flex sees them as [B, H', M, N] (attention_site.
flex_rank). Views that merge or split the batch/head dims may sit between the product and the
softmax (BLOOM, BART: scores viewed [B, H, M, N] for the mask, then back) and between the softmax
and the matmul with V: q, k and V are viewed like the scores, mask layers under such a view carry
the index map to it. Also read: CPM-Ant's zero fill of the probabilities with the scores' own
-inf mask, GPT-Neo's float32 upcast of q and k (``_drop_upcasts``).

Left alone, with the reason recorded: symbolic shapes, softmax over another dim, anything between
softmax and the matmul other than casts, inactive dropout, views of the batch/head dims and the
zero fill above, probabilities used elsewhere, score expressions that are not elementwise, sites
our kernels do not serve. Structures that are not one softmax(q·kᵀ)·v per head are named in the
reason (``_between_reason``, ``_no_product_reason``): factorized attention (the softmax output
transposed), talking heads (a linear/conv over the probabilities), weights computed by a layer
rather than q·kᵀ, probabilities sliced along the keys.

Example::

    >>> sites, extra_inputs = rewrite_manual(gm, flex_lowering.unserved_reason)   # doctest: +SKIP
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.fx

from .._log import log
from .attention_site import (AttentionSite, MaskLayer, Operand, Refused, is_mask_fill,
                             shape_after)
from .fx_ops import (alias_writes, arg, constant_number, example, graph_positions, op_name, same_value,
                     static_shape)
from .lift import Lifted, Lifter, is_lead_view, lead_remap
from .operands import (einsum_out_perm, einsum_qk, einsum_v, peel_constant_scale,
                       transposed_source, unrepeat)
from ..report import RecognizedSite
from .sinks import match_sinks
from .spelled_softmax import canonicalize_spelled_softmax, drop_row_max_shift
from .baddbmm import canonicalize_baddbmm
from .shape_arguments import canonicalize_shape_arguments
from .score_writes import KEPT, functionalize_score_writes

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
    drop_row_max_shift(gm)     # softmax(s - s.max(-1).values) (MiMo-V2-Flash): softmax(s)
    canonicalize_baddbmm(gm)   # scores by baddbmm (diffusers, BLOOM): bmm, scale, bias
    functionalize_score_writes(gm)   # scores written in place (MViTv2, Flaubert): out of place
    canonicalize_shape_arguments(gm)   # x.reshape_as(scores) (SAM): x.reshape(*shape)
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
    if op_name(view) not in _VIEWS or any(
            isinstance(a, torch.dtype) for a in list(view.args[1:]) + list(view.kwargs.values())):
        return False
    src = view.args[0] if view.args else None
    return is_lead_view(static_shape(src), static_shape(view))


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
        # einsum(eq, a, b) or einsum(eq, [a, b]); a one-operand einsum(eq, x) (a permutation,
        # e.g. DiT's unpatchify "nhwpqc->nchpwq") is no product at all.
        operands = pv.args[1:]
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = operands[0]
        return tuple(operands) if len(operands) == 2 else None
    return arg(pv, 0, "input"), arg(pv, 1, "other") if op_name(pv) != "bmm" else arg(pv, 1,
                                                                                        "mat2")


def _path_between(start: torch.fx.Node, end: torch.fx.Node) -> set[torch.fx.Node]:
    """The nodes on some data path from ``start`` to ``end``, both included."""
    after, stack = set(), [start]
    while stack:
        n = stack.pop()
        if n not in after:
            after.add(n)
            stack.extend(n.users)
    path, stack = set(), [end]
    while stack:
        n = stack.pop()
        if n in after and n not in path:
            path.add(n)
            stack.extend(n.all_input_nodes)
    return path


class ManualSite(AttentionSite):
    """A hand-written ``softmax(S) @ v`` site, analysed from the graph (raises Refused).

    Example::

        >>> site = ManualSite(gm, pv_node, served); site.emit(site.plan(), extra)   # doctest: +SKIP
    """

    front_door = FRONT_DOOR
    post_zero = None   # (node, mask) of a zero fill of the probabilities (CPM-Ant)

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
        if len(shape) < 3:
            raise Refused(f"scores of rank {len(shape)} (expected [B, H, M, N], [BH, M, N] or "
                          "[B, H, n1, .., M, N])")
        self.rank = len(shape)
        self.score_shape = shape
        # The matmul with V may see the probabilities through a view that merges or splits the
        # batch/head dims ([B, H, M, N] as [B*H, M, N], BLOOM; or back): V is viewed the other
        # way, and the output back.
        self.probs_shape = static_shape(probs)
        self.core = self._find_core()
        self._refuse_scores_written_in_place()
        self.q, self.k, self.scale, self.score_node = self._split_core()
        self.v = self._value(v)
        self._drop_upcasts()
        self.gqa = self._undo_repeat()
        self._check_shapes(served)

    def _refuse_scores_written_in_place(self) -> None:
        """A write into the scores that score_writes.py did not turn out of place (MViTv2's
        ``attn[:, :, sp:, sp:] = ..`` and Flaubert's ``scores.masked_fill_(..)`` it does): the
        softmax reads the product's node, and the write is a node that no data edge from it
        passes through, so a rewrite made from the data edges would drop it. A write into a
        node between the q·kᵀ product and the softmax, before the softmax and not itself on that
        path (``x = x.masked_fill_(..)`` is), leaves the site as written."""
        pos = graph_positions(self.gm.graph)
        path = _path_between(self.core, self.scores)
        for node in path:
            for write in alias_writes(node):
                if write not in path and pos[node] < pos[write] < pos[self.softmax]:
                    why = write.meta.get(KEPT)
                    raise Refused(f"the scores ({node.name}) are written in place by {write.name} "
                                  "before the softmax"
                                  + (f", a write fa3 cannot turn out of place ({why})" if why
                                     else "") + "; fa3 rewrites only from the data edges, "
                                  "which skip that write")

    def _drop_upcasts(self) -> None:
        """GPT-Neo: q and k cast up to float32 for the scores (``query.to(torch.float32)``), the
        probabilities cast back to V's bf16/fp16 before the matmul. flex reads the q and k before
        the casts: the upcast is lossless, and the kernel forms q·k in float32 from them as the
        float32 matmul does (the same products, summed in another order), then casts P to V's
        dtype for P·V as the model does."""
        qe, ke, ve = (example(o.node) for o in (self.q, self.k, self.v))
        if qe is None or ke is None or ve is None or qe.dtype == ke.dtype == ve.dtype:
            return
        if ve.dtype not in (torch.bfloat16, torch.float16) or \
                example(self.pv) is None or example(self.pv).dtype != ve.dtype:
            return
        sources = []
        for op in (self.q, self.k):
            n = op.node
            if op_name(n) not in ("to", "float", "type") or not n.args or \
                    example(n).dtype != torch.float32:
                return
            src = n.args[0]
            if not isinstance(src, torch.fx.Node) or example(src) is None or \
                    example(src).dtype != ve.dtype or static_shape(src) != static_shape(n) \
                    or example(src).device != example(n).device:
                return
            sources.append(src)
        self.q.node, self.k.node = sources

    def _score_layers(self, full: Lifter) -> tuple[Lifted, Any, list]:
        full_score = full.lift(self.scores)
        score_root, layers = self._peel_masks()
        return full_score, score_root, layers

    _ELEMENTWISE_PATH = {"add", "sub", "mul", "div", "neg", "tanh", "where", "masked_fill",
                         "to", "type_as", "float", "half", "bfloat16", "contiguous", "clamp",
                         "minimum", "maximum", "exp", "log", "abs", "sigmoid", "type",
                         "nan_to_num", "pow", "sqrt", "rsqrt", "softcap", "slice_assigned"}

    def _peel_probs(self, probs: Any) -> torch.fx.Node:
        n = probs
        viewed = False   # a view of the batch/head dims seen between softmax and the matmul
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
                n, viewed = n.args[0], True
                continue
            if name == "masked_fill" and not viewed and self.post_zero is None and \
                    constant_number(arg(n, 2, "value")) == 0:
                # CPM-Ant: masked_fill(softmax(masked_fill(S, m, -inf)), m, 0). Exact when m is
                # the only -inf mask of S (checked with the mask plan): rows m leaves with no
                # key give 0, as flex does; elsewhere the masked weights are 0 already.
                self.post_zero = (n, arg(n, 1, "mask"))
                n = arg(n, 0, "input")
                continue
            self.sink = match_sinks(n)   # gpt-oss's sinks: softmax(cat([S, sinks]))[..., :-1]
            if self.sink is not None:
                n = self.sink.softmax
                break
            raise Refused(_between_reason(n))
        dim = arg(n, 1, "dim")
        rank = len(example(n).shape)
        if dim is None or dim % rank != rank - 1:
            raise Refused(f"softmax over dim {dim} (attention normalizes over the last dim)")
        return n

    def _find_core(self) -> torch.fx.Node:
        """The one ``q @ kᵀ`` product S is computed from: reached from the softmax's input
        through elementwise ops that keep its shape and views that merge or split the
        batch/head dims (BLOOM and BART compute [B*H, M, N] scores by bmm and view them
        [B, H, M, N] for the mask)."""
        found, stack, seen, stops = [], [(self.scores, static_shape(self.scores))], set(), []
        while stack:
            n, space = stack.pop()
            if not isinstance(n, torch.fx.Node) or n in seen:
                continue
            seen.add(n)
            shape = static_shape(n)
            if shape != space:
                continue   # a broadcast operand (a bias, a mask): not the scores themselves
            name = op_name(n)
            if name in ("matmul", "bmm", "einsum"):
                found.append(n)
                continue
            if name in self._ELEMENTWISE_PATH:
                stack.extend((a, shape) for a in n.all_input_nodes)
            elif name in _VIEWS and _merges_leading_dims(n):
                stack.append((n.args[0], static_shape(n.args[0])))
            elif n.op != "placeholder":
                stops.append(n)
        if len(found) == 1:
            return found[0]
        if found:
            raise Refused(f"found {len(found)} score products q @ kᵀ feeding the softmax "
                          f"({', '.join(f.name for f in found)}; expected exactly one)")
        raise Refused(_no_product_reason(stops))

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
        core_shape = static_shape(core)
        rank = len(core_shape)
        if name == "einsum":
            operands, eq = _pv_operands(core), core.args[0]
            if operands is None:
                raise Refused(f"einsum {eq!r} is not a q·k product of two operands")
            q, k = einsum_qk(eq, *operands, rank)
        else:
            a, b = arg(core, 0, "input"), arg(core, 1, "other" if name == "matmul" else "mat2")
            sa, sb = static_shape(a), static_shape(b)
            if sa is None or sb is None or len(sa) != rank or len(sb) != rank:
                raise Refused(f"q @ kᵀ operands of shapes {sa} and {sb} (expected both of rank "
                              f"{rank}, no broadcasting)")
            # k = (kᵀ)ᵀ: a view of a view, so a transposed K costs nothing.
            src = transposed_source(b)
            q = Operand(a)
            k = Operand(src) if src is not None else Operand(b, [("transpose", (-2, -1))])
        lead = tuple(self.score_shape[:-2])
        if tuple(core_shape[:-2]) != lead:
            # The product is viewed with its batch/head dims merged or split before the
            # softmax: view q and k the same way (q·kᵀ per row is unchanged).
            for op in (q, k):
                shape = shape_after(op)
                if tuple(shape[:-2]) != tuple(core_shape[:-2]):
                    raise Refused(f"q @ kᵀ operands {list(shape_after(q))} and "
                                  f"{list(shape_after(k))} broadcast over the batch dims of "
                                  f"the product {list(core_shape)}")
                op.views.append(("reshape", lead + tuple(shape[-2:])))
        return q, k

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
        """Mask layers on top of the scores, outermost first, and the score root under them.
        Views that merge or split the batch/head dims are peeled too (BART: [B*H, M, N] scores
        viewed [B, H, M, N] to add the mask, then back): the layers under one, and the root,
        carry the index map from the scores to their own indices."""
        lifter = Lifter(self.score_node)
        n, layers, remap = self.scores, [], None
        while isinstance(n, torch.fx.Node) and n is not self.score_node:
            name = op_name(n)
            if name in ("to", "type_as", "float", "contiguous") and \
                    lifter.depends_on_score(n.args[0]):
                n = n.args[0]
                continue
            if name in _VIEWS and _merges_leading_dims(n) and lifter.depends_on_score(n.args[0]):
                step = lead_remap(static_shape(n)[:-2], static_shape(n.args[0])[:-2])
                remap = step if remap is None else _compose(remap, step)
                n = n.args[0]
                continue
            if name == "masked_fill":
                x, m = arg(n, 0, "input"), arg(n, 1, "mask")
                v = constant_number(arg(n, 2, "value"))
                if is_mask_fill(v) and lifter.depends_on_score(x) and \
                        not lifter.depends_on_score(m):
                    layers.append(MaskLayer("fill", m, float(v), negate=True, remap=remap))
                    n = x
                    continue
            if name == "where" and len(n.args) == 3:
                c, a, b = n.args
                ca, cb = constant_number(a), constant_number(b)
                if not lifter.depends_on_score(c):
                    if is_mask_fill(cb) and lifter.depends_on_score(a):
                        layers.append(MaskLayer("fill", c, float(cb), remap=remap))
                        n = a
                        continue
                    if is_mask_fill(ca) and lifter.depends_on_score(b):
                        layers.append(MaskLayer("fill", c, float(ca), negate=True, remap=remap))
                        n = b
                        continue
            if name == "add" and not n.kwargs.get("alpha"):
                a, b = arg(n, 0, "input"), arg(n, 1, "other")
                da, db = lifter.depends_on_score(a), lifter.depends_on_score(b)
                if da != db and isinstance(a if db else b, torch.fx.Node):
                    layers.append(MaskLayer("add", a if db else b, remap=remap))
                    n = a if da else b
                    continue
            break
        self._root_remap = remap
        self._check_post_zero(layers)
        return n, layers

    def _check_post_zero(self, layers: list[MaskLayer]) -> None:
        """A zero fill of the probabilities (CPM-Ant) is exact when its mask is the scores'
        only -inf mask: masked weights are 0 already, and rows that mask leaves with no key
        (eager: NaN, then 0) give 0 as flex does."""
        if self.post_zero is None:
            return
        fill, mask = self.post_zero
        inf_fills = [la for la in layers if la.kind == "fill" and la.fill == -math.inf]
        ok = (len(inf_fills) == 1 and inf_fills[0].negate and inf_fills[0].remap is None
              and static_shape(fill) == tuple(self.score_shape)
              and same_value(inf_fills[0].node, mask))
        if not ok:
            raise Refused(f"{fill.name} (masked_fill) zeroes attention probabilities with a "
                          "mask that is not the scores' only -inf mask: not softmax(S)·V "
                          "(not attention-shaped)")
        self.zero_rows = True

    def _output_layout(self, graph, out):
        # (the output already has the scores' batch dims: attention_site.emit reshaped it)
        if op_name(self.pv) == "einsum":
            perm = einsum_out_perm(self.pv.args[0], self.rank)
            if perm is not None:
                out = graph.call_method("permute", (out, *perm))
        if self._probs_viewed():
            out = graph.call_method("reshape", (out, *static_shape(self.pv)))
        return out


def _compose(outer: Callable[[list], list], inner: Callable[[list], list]
             ) -> Callable[[list], list]:
    return lambda idx: inner(outer(idx))


_MIXING_OPS = {"linear", "conv1d", "conv2d", "conv3d"}


def _between_reason(n: torch.fx.Node) -> str:
    """Why ``n``, between the softmax and the matmul with V, is left alone: named by the
    structure it makes, so that the coverage table can tell spellings we do not read from
    math that is not one softmax(q·kᵀ)·v."""
    name = op_name(n) or getattr(n.target, "__name__", str(n.target))
    chain, m = [], n
    for _ in range(8):   # n and the ops below it, down to the softmax
        if not isinstance(m, torch.fx.Node) or op_name(m) in ("softmax", "_softmax"):
            break
        chain.append(m)
        m = m.args[0] if m.args else None
    reached = op_name(m) in ("softmax", "_softmax")
    mixing = [c for c in chain if (op_name(c) or "") in _MIXING_OPS or
              getattr(c.target, "__name__", "") in _MIXING_OPS]
    if reached and mixing:
        c = mixing[0]
        what = op_name(c) or getattr(c.target, "__name__", str(c.target))
        if _over_heads(c):
            return (f"{c.name} ({what}) mixes the attention probabilities across heads after "
                    "the softmax (talking-heads attention): not one softmax(q·kᵀ)·v per head "
                    "(not attention-shaped)")
        return (f"{c.name} ({what}) applies a learned map to the attention probabilities after "
                "the softmax: not one softmax(q·kᵀ)·v (not attention-shaped)")
    if reached and transposed_source(n) is not None and \
            all(op_name(c) in _CASTS | {"dropout"} for c in chain[1:]):
        return (f"{n.name} ({name}) transposes the softmax output before the matmul with V: "
                "the softmax is over the dim the product contracts away, i.e. linear / "
                "factorized attention softmax(k)ᵀ·v (CoaT), not softmax(q·kᵀ)·v (not "
                "attention-shaped)")
    if reached and name == "getitem" and _slices_last_dim(n):
        return (f"{n.name} (getitem) slices the attention probabilities along the keys before "
                "the matmul with V: each slice is multiplied with a different V (one softmax "
                "over several score products concatenated along the keys, PEGASUS-X's global "
                "+ local blocks); fa3 reads one q·kᵀ product and one V per site, and serving "
                "it would mean building the concatenated K and V (not attention-shaped)")
    if reached and name == "masked_fill":
        return (f"{n.name} (masked_fill) fills the attention probabilities after the softmax "
                "with something other than the zero fill of the scores' -inf mask: not "
                "softmax(S)·V (not attention-shaped)")
    return (f"{n.name} ({name}) between softmax and the matmul with V is not a cast, an "
            "inactive dropout or a view of the batch/head dims")


def _over_heads(op: torch.fx.Node) -> bool:
    """A linear over the heads dim (its input permuted [B, H, M, N] -> [.., H] last, CaiT) or a
    convolution whose channels are the heads ([B, H, M, N] as [N, C, H, W], EfficientFormerV2)."""
    src = op.args[0] if op.args else None
    if op_name(op) == "linear":
        if op_name(src) != "permute":
            return False
        dims = src.args[1:] if len(src.args) > 2 or isinstance(src.args[1], int) \
            else src.args[1]
        return len(dims) == 4 and dims[-1] % 4 == 1
    return True   # convNd: channels are dim 1, the heads of [B, H, M, N]


def _slices_last_dim(n: torch.fx.Node) -> bool:
    index = n.args[1] if len(n.args) > 1 else None
    index = index if isinstance(index, tuple) else (index,)
    shape = static_shape(n.args[0])
    if shape is None or not index or not isinstance(index[-1], slice):
        return False
    return index[-1] != slice(None) and (Ellipsis in index or len(index) == len(shape))


def _no_product_reason(stops: list[torch.fx.Node]) -> str:
    """Why no q @ kᵀ product was found: what the softmax's input is computed from."""
    origins = []
    for n in stops[:3]:
        m = n
        for _ in range(8):   # through layout ops to the op that made the values
            if op_name(m) in ("permute", "transpose", "reshape", "view", "flatten",
                              "unflatten", "contiguous", "getitem", "unsqueeze", "squeeze"):
                m = m.args[0]
            else:
                break
        what = op_name(m) or getattr(m.target, "__name__", str(m.target))
        origins.append(f"{m.name} ({what})" if m is n else f"{m.name} ({what}) via {n.name}")
    made_by = ", ".join(origins) if origins else "no tensor operation fa3 reads"
    if any(op_name(m) in ("linear", "conv2d", "conv1d") for m in stops) or any(
            "linear" in o or "conv" in o for o in origins):
        return (f"found 0 score products q @ kᵀ feeding the softmax: the attention weights are "
                f"computed by {made_by} (a learned layer: VOLO's outlook attention, MGP-STR's "
                "token learner), not from q·kᵀ (not attention-shaped)")
    return (f"found 0 score products q @ kᵀ feeding the softmax (its input comes from "
            f"{made_by}; expected exactly one)")
