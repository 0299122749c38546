"""One attention site on its way to the canonical flex_attention op: mask plan and emission.

Recognition passes (hand-written attention in recognize_manual.py, SDPA calls with attn_mask in
recognize_sdpa.py) describe a site by its q, k, v, scale, the score expression and the mask
layers applied on top of it. This module decides how the masks are served, exactly:

- a mask built from positions only (aranges, tril/triu, constants) is evaluated on the static
  grid now; if every query row keeps a key it becomes a mask_mod with a block mask built now
  (no N×N read at run time; known shapes get their canonical mask function). A masked entry's
  weight exp(fill + s - rowmax) is exactly 0 in float32 once the row keeps a key (fills ≤
  -65504; assumes scores in a row differ by less than ~65000). Rows with no key are refused:
  flex works in log2 units, where even a finfo.min fill overflows to -inf, so flex gives 0
  where eager gives NaN (-inf fill) or uniform weights (finite fill) -- unless the front door
  itself gives 0 there (SDPA with a bool or -inf mask).
- a mask read from module buffers whose values Dynamo handed the backend (a registered tril
  buffer) is evaluated now like a position mask, if it is a known shape keeping a key in every
  row; a guard re-checks the buffers on each call (module_state.py).
- a mask read from a tensor (an input mask, a registered buffer) stays in the score_mod, which
  reads it as a captured buffer (exact), and the block-sparsity tables are computed at run time
  in the graph from it, so tiles it fully masks are skipped. Rows it leaves with no key keep
  every tile and are fixed up after the op as eager has them: the mean of V (finite fill) or
  NaN (every score -inf; SDPA: 0, as flex).

Then :meth:`AttentionSite.emit` builds the score_mod/mask_mod graphs and the op (canonical.py).

Example::

    >>> site = AttentionSite.from_parts(gm, sdpa_node, q, k, v, scale=0.25, gqa=1,  # doctest: +SKIP
    ...     layers=[("fill", mask_node)], served=served, front_door="sdpa", zero_rows=True)
    >>> record = site.rewrite(extra_inputs)                                  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import torch
import torch.fx

from .._log import log
from . import canonical, module_state
from .fx_ops import example, op_name, static_shape
from ..templates.torch_mod_helpers import where
from .lift import Env, Lifted, Lifter, NotLiftable
from ..report import RecognizedSite
from .sinks import attach_sinks

# Fills at or below this count as "masked" (float16's most negative finite value; HF fills with
# finfo(dtype).min, older code with -1e4 .. -1e9).
MASK_FILL_MAX = -65504.0


class Refused(Exception):
    """The site is not rewritten; the message is the reason recorded for it."""


@dataclasses.dataclass
class Operand:
    """A graph node and the view ops (method name, args) that make it a flex q/k/v."""

    node: torch.fx.Node
    views: list[tuple[str, tuple]] = dataclasses.field(default_factory=list)

    def build(self, graph: torch.fx.Graph) -> torch.fx.Node:
        """Insert the view ops at the graph's insertion point; returns the last node."""
        out = self.node
        for method, args in self.views:
            out = graph.call_method(method, (out,) + tuple(args))
        return out


@dataclasses.dataclass
class MaskLayer:
    """One mask applied on top of the scores."""

    kind: str                 # "fill" (keep ? S : fill) or "add" (S + A)
    node: torch.fx.Node       # the keep condition (fill) or the added tensor (add)
    fill: float = 0.0
    negate: bool = False      # the node is the *masked* condition (masked_fill)
    # Indices of the scores -> indices of the tensor the layer applies to, when the layer sits
    # under a view that merges or splits the batch/head dims (BART's [B*H, M, N] scores viewed
    # [B, H, M, N] for the mask and back); None: the same indices.
    remap: Optional[Callable[[list], list]] = None


class AttentionSite:
    """One attention site: mask plan and emission (see the module docstring).

    Subclasses analyse a graph pattern and fill in the same fields; :meth:`from_parts` makes a
    site whose parts are known (an SDPA call).

    Example::

        >>> record = AttentionSite.from_parts(...).rewrite(extra_inputs)   # doctest: +SKIP
    """

    front_door = "sdpa"
    zero_rows = False    # rows with no key: eager gives NaN / uniform (SDPA: 0, as flex)
    layers: Optional[list] = None
    scores: Optional[torch.fx.Node] = None
    sink = None          # attention sinks (recognition/sinks.py's SinkMatch): rows with no key give 0
    _root_remap = None   # scores' indices -> the score root's, when a batch/head view lies between

    @classmethod
    def from_parts(cls, gm: torch.fx.GraphModule, node: torch.fx.Node, q: torch.fx.Node,
                   k: torch.fx.Node, v: torch.fx.Node, *, scale: float, gqa: int,
                   layers: list, served: Callable[[torch.Tensor, torch.Tensor], Optional[str]],
                   front_door: str, zero_rows: bool) -> "AttentionSite":
        """A site whose q, k, v (4-D, k/v un-repeated), scale and mask layers are known.

        ``layers``: ``("fill", keep_node)`` (keep ? score : -inf) or ``("add", float_node)``.

        Example::

            >>> AttentionSite.from_parts(gm, sdpa, q, k, v, scale=0.25, gqa=1,     # doctest: +SKIP
            ...     layers=[("fill", mask)], served=served, front_door="sdpa", zero_rows=True)
        """
        self = cls.__new__(cls)
        self.gm, self.pv, self.front_door, self.zero_rows = gm, node, front_door, zero_rows
        self.q, self.k, self.v = Operand(q), Operand(k), Operand(v)
        self.scale, self.gqa, self.rank, self.scores = scale, gqa, 4, None
        self.score_node = node   # nothing upstream depends on it: a stand-in for the score
        (b, h, m, _), n = static_shape(q), static_shape(k)[2]
        self.score_shape = (b, h, m, n)
        self.layers = [MaskLayer(kind, mask_node, -math.inf) for kind, mask_node in layers]
        self._check_shapes(served)
        return self

    def _check_shapes(self, served) -> None:
        q, k, v = (shape_after(op) for op in (self.q, self.k, self.v))
        if self.rank > 4:
            # [B, n1, .., nk, M, D]: the dims between batch and rows are merged into flex's
            # heads (reshaped in emit); every operand must have them all, unbroadcast.
            lead = tuple(self.score_shape[:-2])
            if any(len(s) != self.rank or tuple(s[:-2]) != lead for s in (q, k, v)):
                raise Refused(f"q{list(q)} k{list(k)} v{list(v)} broadcast over the scores' "
                              f"batch dims {list(lead)} (fa3 merges batch dims into flex's "
                              "heads only where q, k and v all have them)")
        if self.rank != 4:
            q, k, v = (flex_rank(s) for s in (q, k, v))
        (bq, hq, _, d), (bk, hk, n, dk), (bv, hv, nv, dv) = q, k, v
        if (bq, d, n, hk) != (bk, dk, nv, hv) or bv != bk:
            raise Refused(f"q{list(q)} k{list(k)} v{list(v)} are not attention-shaped")
        if hq % hk:
            raise Refused(f"{hq} query heads are not a multiple of {hk} kv heads")
        # dv may differ from d (DeepSeek's MLA: q/k 192, v 128); served() checks both.
        qe, ke, ve = (example(o.node) for o in (self.q, self.k, self.v))
        if not (qe.dtype == ke.dtype == ve.dtype):
            raise Refused(f"q/k/v dtypes differ ({qe.dtype}, {ke.dtype}, {ve.dtype})")
        out = example(self.pv)
        if out.dtype != qe.dtype:
            raise Refused(f"the attention output is {out.dtype} but q is {qe.dtype} (flex "
                          "returns q's dtype)")
        self.shapes = (q, k, v)
        why = served(qe, ve)
        if why is not None:
            raise Refused(why)

    def _root_index(self, idx: list) -> list:
        """flex's indices [b, h, q_idx, kv_idx] -> indices of the scores (any rank >= 3)."""
        return root_index(idx, self.score_shape)

    def _flex_score_shape(self) -> tuple[int, ...]:
        """The scores as flex sees them: [B, H, M, N]."""
        return flex_rank(self.score_shape)

    def _score_grid(self) -> list:
        """The static grid in the scores' indices (flex's grid, rooted)."""
        return self._root_index(self._grid())

    def _lift_layer(self, lifter: Lifter, node: Any, remap=None) -> Lifted:
        """``lifter.lift(node)`` in the scores' indices, ``remap`` (scores' -> node's indices)
        applied when the node sits under a view of the batch/head dims."""
        inner = lifter.lift(node)
        if remap is None:
            return inner
        from .lift import _align
        return Lifted(tuple(self.score_shape),
                      lambda env, idx: inner.fn(env, _align(remap(list(idx)), inner.shape)),
                      inner.uses_score, inner.uses_buffers, inner.dtype)

    def rewrite(self, extra_inputs: list[torch.Tensor]) -> RecognizedSite:
        """Plan and emit (raises Refused, leaving the graph untouched, if there is no plan).

        Example::

            >>> record = site.rewrite(extra_inputs); record.mask   # doctest: +SKIP
            'causal'
        """
        return self.emit(self.plan(), extra_inputs)

    def plan(self) -> dict:
        """Decide how the site becomes flex_attention; raises Refused with the reason. Does not
        touch the graph.

        Example::

            >>> site.plan()["kind"]   # "static", "runtime" or "none" (no mask)   # doctest: +SKIP
            'static'
        """
        try:
            return self._plan()
        except Refused:
            raise
        except Exception as exc:  # an analysis bug must not break the user's compile
            log.warning("fa3_inductor: recognition of %s failed (%s: %s); site left alone",
                        self.pv.name, type(exc).__name__, exc)
            raise Refused(f"analysis failed ({type(exc).__name__}: {exc}); please report "
                          "it") from None

    def _plan(self) -> dict:
        try:
            full = self._lifter()
            full_score, score_root, layers = self._score_layers(full)
            plan = self._plan_masks(score_root, layers, full, full_score)
            # What the report calls score mods: the score part and the added biases, not the
            # mask layers (the mask has its own description).
            described = self._lifter()
            self._lift_layer(described, score_root, self._root_remap)
            for layer in plan.get("biases", []):
                self._lift_layer(described, layer.node, layer.remap)
            plan["described"] = described
        except NotLiftable as exc:
            raise Refused(f"score expression: {exc}") from None
        except (RuntimeError, TypeError, ValueError, IndexError) as exc:
            # Evaluating a mask on the concrete grid failed: not something we can prove.
            raise Refused(f"score expression could not be analysed ({type(exc).__name__}: "
                          f"{exc}); please report it") from None
        return plan

    def _plan_masks(self, score_root, layers, full: Lifter, full_score: Lifted) -> dict:
        """Choose: static mask_mod + block mask, runtime tables, or score_mod only."""
        mask_lifter = self._lifter()
        keeps: list[Lifted] = []
        finite_fill = False            # some entries are masked by a finite fill
        neg_inf: list[Lifted] = []     # entries eager sets to -inf (NaN rows if all are)
        score_adds: list[MaskLayer] = []
        for layer in layers:
            lifted = self._lift_layer(mask_lifter, layer.node, layer.remap)
            if layer.kind == "fill":
                keep = _not(lifted) if layer.negate else lifted
                keeps.append(keep)
                if layer.fill == -math.inf:
                    neg_inf.append(_not(keep))
                else:
                    finite_fill = True
                continue
            kind = _additive_kind(lifted, self._score_grid())
            if kind == "runtime" and not _looks_like_mask(layer.node):
                kind = "bias"   # e.g. ALiBi slopes × distance: no fill value in sight
            if kind == "bias":
                score_adds.append(layer)
            else:  # a 0 / very-negative float mask, known now ("static") or at run time
                keeps.append(_map(lifted, lambda a: a > MASK_FILL_MAX))
                neg_inf.append(_map(lifted, lambda a: a == -math.inf))
                finite_fill = True
        if not keeps:
            return dict(kind="none", score=(full, full_score), biases=score_adds)
        if any(k.uses_buffers for k in keeps):
            constant = self._constant_buffer_plan(keeps, mask_lifter, score_root, score_adds)
            if constant is not None:
                return constant
            if finite_fill and any(la.kind == "fill" and la.fill == -math.inf
                                   for la in layers):
                raise Refused("a mask read at run time mixes -inf and finite fills: rows left "
                              "with no key would need eager's uniform weights over only the "
                              "finitely masked keys; fa3 leaves this site alone")
            return dict(kind="runtime", score=(full, full_score), keeps=keeps,
                        neg_inf=neg_inf, finite_fill=finite_fill, lifter=mask_lifter,
                        biases=score_adds)
        keep = _and_all(keeps)
        dense = _evaluate(keep, self._score_grid())
        if bool(dense.any(-1).all()) or (self.zero_rows and not finite_fill) or self.sink is not None:
            return self._static_plan(score_root, score_adds, keep, dense)
        # flex works in log2 units: a finfo.min fill overflows to -inf there, so no spelling
        # of such rows reproduces eager's NaN (-inf fill) or uniform (finite fill) result.
        raise Refused("the mask leaves query rows with no key: eager gives "
                      + ("NaN" if neg_inf else "uniform weights") + " there, flex_attention "
                      "gives 0; fa3 leaves this site alone")

    def _constant_buffer_plan(self, keeps: list[Lifted], mask_lifter: Lifter, score_root,
                              score_adds: list) -> Optional[dict]:
        """A mask read from module buffers (module_state.py), evaluated now: a static plan
        when it is a known shape keeping a key in every row, with guards on the buffers."""
        values = [module_state.constant_value(b.node) for b in mask_lifter.buffers]
        if self.rank != 4 or any(v is None for v in values):
            return None
        keep, grid = _and_all(keeps), self._grid()
        views = [_kept_view(b, v) for b, v in zip(mask_lifter.buffers, values)]
        dense = _evaluate(keep, grid, views)
        if _known_mask(dense)[1] is None or not bool(dense.any(-1).all()):
            return None
        for i, buf in enumerate(mask_lifter.buffers):
            def same_mask(new: torch.Tensor, i=i) -> bool:
                now = list(views)
                now[i] = _kept_view(mask_lifter.buffers[i], new)
                return torch.equal(_evaluate(keep, grid, now), dense)
            module_state.add_guard(buf.node, same_mask)
        return self._static_plan(score_root, score_adds, keep, dense)

    def _static_plan(self, score_root, score_adds: list, keep: Lifted,
                     dense: torch.Tensor) -> dict:
        """A mask known now: the score_mod is the score part plus the added biases."""
        score_lifter = self._lifter()
        body = self._lift_layer(score_lifter, score_root, self._root_remap)
        adds = [self._lift_layer(score_lifter, layer.node, layer.remap) for layer in score_adds]
        score = _add_all(body, adds) if adds else body
        return dict(kind="static", score=(score_lifter, score), keep=keep, dense=dense,
                    biases=score_adds)

    def _lifter(self) -> Lifter:
        return Lifter(self.score_node, self.score_shape, read_at=self.pv)

    def _grid(self) -> list[torch.Tensor]:
        """Broadcast position tensors [b, h, q, kv] of flex's score matrix (real, CPU)."""
        shape = self._flex_score_shape()
        out = []
        for d, s in enumerate(shape):
            view = [1, 1, 1, 1]
            view[d] = s
            out.append(torch.arange(s).view(view))
        return out

    def emit(self, plan: dict, extra_inputs: list[torch.Tensor]) -> RecognizedSite:
        """Replace the site by the flex_attention op as planned; returns its record.

        Example::

            >>> record = site.emit(site.plan(), extra_inputs)   # doctest: +SKIP
        """
        gm, graph = self.gm, self.gm.graph
        prefix = f"_fa3_{self.pv.name}"
        score_lifter, score = plan["score"]
        qe = example(self.q.node)
        (B, H, M, D), (_, Hk, N, _), _ = self.shapes
        mask_desc = "none"
        with graph.inserting_before(self.pv):
            q, k, v = (op.build(graph) for op in (self.q, self.k, self.v))
            if self.rank != 4:   # [BH, M, D] or [B, n1, .., nk, M, D]: flex's [B, H, M, D]
                q, k, v = (graph.call_method("reshape", (x, *flex_rank(s)))
                           for x, s in zip((q, k, v), (shape_after(o) for o in
                                                       (self.q, self.k, self.v))))
            score_bufs = _buffer_nodes(graph, score_lifter, qe.device)
            score_mod = None
            if not (score.uses_score and score_lifter.buffers == [] and
                    _is_identity(score)):
                fn = _rooted(score, self._root_index)
                score_mod = canonical.ModGraph(
                    canonical.trace_mod(fn, "score", len(score_bufs)), score_bufs)
            mask_mod = None
            if plan["kind"] == "static":
                dense = plan["dense"]
                mask_desc, known = _known_mask(dense)
                fn = known if known is not None and self.rank == 4 else \
                    _rooted(plan["keep"], self._root_index)
                mask_mod = canonical.ModGraph(canonical.trace_mod(fn, "mask", 0), [])
                with torch._subclasses.fake_tensor.unset_fake_temporarily():
                    bm = canonical.dense_block_mask(dense.to(qe.device), B, H, M, N, qe.device)
                entries = lambda attr: canonical.constant_block_mask_entries(  # noqa: E731
                    gm, bm, attr, extra_inputs, prefix)
            elif plan["kind"] == "runtime":
                keep_node, no_key_rows, nan_rows, keep_shape = self._runtime_mask_nodes(plan)
                example_keep = torch.ones(keep_shape, dtype=torch.bool)
                entries = lambda attr: canonical.runtime_block_mask_entries(  # noqa: E731
                    gm, keep_node, example_keep, M, N, attr)
                mask_desc = "dense " + " & ".join(
                    f"{_dtype_name(b.node)} {list(b.shape)}"
                    for b in plan["lifter"].buffers)
            else:
                nan_rows = None
                with torch._subclasses.fake_tensor.unset_fake_temporarily():
                    bm = canonical.dense_block_mask(None, 1, 1, M, N, qe.device)
                entries = lambda attr: canonical.constant_block_mask_entries(  # noqa: E731
                    gm, bm, attr, extra_inputs, prefix)
            out = canonical.insert_flex(
                gm, q, k, v, score=score_mod, mask=mask_mod, block_mask_entries=entries,
                scale=self.scale, example_qkv=[example(o.node) for o in (self.q, self.k,
                                                                         self.v)],
                prefix=prefix)
            if self.sink is not None:   # eager gives rows with no key 0 (the sink's column takes it all)
                out = attach_sinks(graph, out, self.sink)
            elif plan["kind"] == "runtime":
                # Rows with no key: flex gives 0 (a finfo.min fill overflows to -inf in its
                # log2 units). Eager gives uniform weights (finite fill: the mean of V) or
                # NaN (every score -inf).
                if plan["finite_fill"]:
                    mean_v = graph.call_method("mean", (v, -2), {"keepdim": True})
                    if self.gqa > 1:
                        mean_v = graph.call_function(torch.repeat_interleave,
                                                     (mean_v, self.gqa), {"dim": 1})
                    uniform_rows = no_key_rows if nan_rows is None else graph.call_function(
                        torch.logical_and, (no_key_rows, graph.call_function(
                            torch.logical_not, (nan_rows,))))
                    out = graph.call_function(torch.where, (uniform_rows, mean_v, out))
                if nan_rows is not None and not self.zero_rows:
                    out = graph.call_function(torch.where, (nan_rows, math.nan, out))
            if self.rank != 4:   # back to the scores' batch dims: [..., M, Dv]
                out = graph.call_method("reshape", (out, *self.score_shape[:-1],
                                                    self.shapes[2][-1]))
            out = self._output_layout(graph, out)
        out.meta["example_value"] = self.pv.meta.get("example_value")  # for later sites
        self.pv.replace_all_uses_with(out)
        graph.erase_node(self.pv)
        training = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in
            [example(o.node) for o in (self.q, self.k, self.v)] +
            [example(b.node) for b in score_lifter.buffers])
        return RecognizedSite(self.front_door, self.pv.name, True,
                              score_mods=tuple(self._describe_score(plan["described"])) +
                              (("attention sinks",) if self.sink is not None else ()),
                              mask=mask_desc, gqa_groups=self.gqa, training=training)

    def _runtime_mask_nodes(self, plan: dict):
        """Graph nodes: the dense keep mask used for the block tables (rows with no key keep
        every tile) and, if eager would give NaN rows, the [.., M] row flags."""
        graph = self.gm.graph
        tracer = torch.fx.proxy.GraphAppendingTracer(graph)
        lifter: Lifter = plan["lifter"]
        device = example(self.q.node).device
        bufs = [torch.fx.Proxy(n, tracer) for n in _buffer_nodes(graph, lifter, device)]
        shape4 = self._flex_score_shape()
        idx = [torch.fx.Proxy(graph.call_function(torch.arange, (s,), {"device": device}),
                              tracer).view(*[s if d == i else 1 for i in range(4)])
               if s > 1 else 0 for d, s in enumerate(shape4)]
        env = Env(None, bufs)
        keep_all = _and_all(plan["keeps"])
        keep = keep_all.fn(env, self._root_index(idx))
        # Tables per batch/head only where the mask varies with them (a padding mask is
        # [B, 1, M, N]): found by evaluating it once on zeros of the buffers' shapes.
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            zeros = [torch.zeros([b.shape[d] for d in b.kept_dims] or [1],
                                 dtype=example(b.node).dtype) for b in lifter.buffers]
            probe = torch.as_tensor(keep_all.fn(Env(None, zeros),
                                                self._root_index(self._grid())))
        probe_shape = (1,) * (4 - probe.dim()) + tuple(probe.shape)
        shape4 = (probe_shape[0], probe_shape[1]) + tuple(shape4[2:])
        if not isinstance(keep, torch.fx.Proxy):
            keep = torch.fx.Proxy(graph.call_function(torch.ones, tuple(shape4), {
                "dtype": torch.bool, "device": device}), tracer)
        keep = keep.expand(*shape4)
        has_key = keep.any(-1, keepdim=True)
        tile_keep = keep | ~has_key
        nan_rows = None
        if plan["neg_inf"]:
            all_inf = _or_all(plan["neg_inf"]).fn(env, self._root_index(idx))
            if isinstance(all_inf, torch.fx.Proxy):
                # (broadcast along keys: a value constant along the row decides it alone)
                nan_rows = all_inf.all(-1, keepdim=True).node
        return tile_keep.node, (~has_key).node, nan_rows, shape4

    def _describe_score(self, lifter: Lifter) -> list[str]:
        out = []
        if self.scale != 1.0:
            out.append(f"scale {self.scale:g}")
        names = {op_name(n) for n in lifter._memo}   # the score part, not the masks
        if "tanh" in names:
            out.append("softcap")
        if "gather" in lifter.features:
            out.append("bias table " + ", ".join(
                f"{list(b.shape)}" for b in lifter.buffers))
        elif lifter.buffers:
            out.append("captured " + ", ".join(f"{list(b.shape)}" for b in lifter.buffers))
        if "index" in lifter.features:
            out.append("position bias")
        return out

    def _score_layers(self, full: Lifter) -> tuple[Lifted, Any, list]:
        """(the whole score expression lifted, the score part's root, the mask layers)."""
        score_root, layers = self.score_node, self.layers
        full_score = _apply_layers(full.lift(score_root),
                                   [(la, self._lift_layer(full, la.node, la.remap))
                                    for la in layers])
        return full_score, score_root, layers

    out_shape: Optional[tuple] = None   # an SDPA call made 4-D (recognize_sdpa._as_4d)

    def _output_layout(self, graph: torch.fx.Graph, out: torch.fx.Node) -> torch.fx.Node:
        if self.out_shape is not None:
            out = graph.call_method("reshape", (out, *self.out_shape))
        return out


# ----------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------

def _apply_layers(score: Lifted, layers: list[tuple[MaskLayer, Lifted]]) -> Lifted:
    """The score with mask layers applied, innermost first (for calls such as SDPA)."""
    from .lift import _align

    def fn(env, idx):
        s = score.fn(env, idx)
        for layer, lifted in layers:
            m = lifted.fn(env, _align(idx, lifted.shape))
            s = where(m, s, layer.fill) if layer.kind == "fill" else s + m
        return s
    return Lifted(score.shape, fn, True, any(li.uses_buffers for _, li in layers))


def _looks_like_mask(node: torch.fx.Node) -> bool:
    """A float tensor added to the scores is treated as a mask (its entries ≤ -65504 mark
    masked keys; rows it leaves without a key get eager's treatment) when it is a graph input
    as such, or when a fill constant ≤ -65504 (finfo.min, -inf, -1e9) appears in its
    computation. Anything else (a bias) is only added by the score_mod."""
    if node.op == "placeholder":
        return True
    for n in _cone(node, None):
        if any(is_mask_fill(a) for a in list(n.args) + list(n.kwargs.values())):
            return True
    return False


def _cone(root: torch.fx.Node, stop: torch.fx.Node) -> list[torch.fx.Node]:
    out, stack, seen = [], [root], set()
    while stack:
        n = stack.pop()
        if n in seen or n is stop:
            continue
        seen.add(n)
        out.append(n)
        stack.extend(n.all_input_nodes)
    return out


def _dtype_name(node: torch.fx.Node) -> str:
    return str(example(node).dtype).replace("torch.", "")


def is_mask_fill(v: Any) -> bool:
    """A constant that masks: at or below MASK_FILL_MAX (finfo.min, -1e9, -inf).

    Example::

        >>> is_mask_fill(float("-inf")), is_mask_fill(-1e4)
        (True, False)
    """
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v <= MASK_FILL_MAX


def _is_identity(score: Lifted) -> bool:
    """The lifted score is the score itself (no modification): evaluated on a sentinel that
    every arithmetic operation rejects."""
    sentinel = object()
    try:
        return score.fn(Env(sentinel, []), [0, 0, 0, 0]) is sentinel
    except Exception:
        return False


def _rooted(lifted: Lifted, root_index) -> Callable:
    return lambda env, idx: lifted.fn(env, root_index(idx))


def _not(x: Lifted) -> Lifted:
    return _map(x, lambda a: ~a if isinstance(a, (torch.Tensor, torch.fx.Proxy)) else not a)


def _map(x: Lifted, op: Callable) -> Lifted:
    return Lifted(x.shape, lambda env, idx: op(x.fn(env, idx)), x.uses_score, x.uses_buffers)


def _combine(items: list[Lifted], op: Callable) -> Lifted:
    def fn(env, idx):
        vals = [_align_call(it, env, idx) for it in items]
        out = vals[0]
        for v in vals[1:]:
            out = op(out, v)
        return out
    return Lifted((), fn, any(i.uses_score for i in items), any(i.uses_buffers for i in items))


def _align_call(item: Lifted, env, idx):
    from .lift import _align
    return item.fn(env, _align(idx, item.shape))


def _and_all(items: list[Lifted]) -> Lifted:
    return _combine(items, lambda a, b: a & b)


def _or_all(items: list[Lifted]) -> Lifted:
    return _combine(items, lambda a, b: a | b)


def _add_all(body: Lifted, adds: list[Lifted]) -> Lifted:
    return _combine([body] + adds, lambda a, b: a + b)


def _kept_view(buf, value: torch.Tensor) -> torch.Tensor:
    """A buffer's value viewed as the mods index it (its size-1 dims dropped)."""
    return value.reshape([buf.shape[d] for d in buf.kept_dims] or [1]).cpu()


def _evaluate(keep: Lifted, grid: list[torch.Tensor], buffers: list = ()) -> torch.Tensor:
    """The keep mask on the concrete [B', H', M, N] grid (positions, and the real values of
    buffers read as constants)."""
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        val = keep.fn(Env(None, list(buffers)), list(grid))
        val = torch.as_tensor(val)
        while val.dim() < 4:
            val = val.unsqueeze(0)
        return val.to(torch.bool).expand(val.shape[0], val.shape[1], grid[-2].shape[-2],
                                         grid[-1].shape[-1])


def _additive_kind(lifted: Lifted, grid: list[torch.Tensor]) -> str:
    """An added tensor is a mask if its values are 0 or ≤ MASK_FILL_MAX: checked now when it
    depends on positions only ("static"); a float tensor read at run time ("runtime") is
    treated as a mask for tile skipping only (the score_mod still adds it). Else "bias"."""
    if lifted.uses_buffers:
        return "runtime" if lifted.dtype is None or lifted.dtype.is_floating_point else "bias"
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        val = torch.as_tensor(lifted.fn(Env(None, []), list(grid)))
    if not val.is_floating_point():
        return "bias"
    is_mask = ((val == 0) | (val <= MASK_FILL_MAX)).all() and (val != 0).any()
    return "static" if bool(is_mask) else "bias"


def _buffer_nodes(graph: torch.fx.Graph, lifter: Lifter, device: torch.device
                  ) -> list[torch.fx.Node]:
    """The captured-buffer nodes, viewed without their size-1 dims (the mods index the rest),
    on the site's ``device``: a buffer made elsewhere (a 0-dim CPU tensor, which eager mixes
    with CUDA tensors; index math on CPU aranges moved by ``.to(x.device)``, which the lifter
    looks through) is copied there, as eager's own op would read it; our kernels and the block
    tables computed from a mask read only tensors on the site's device."""
    out = []
    for buf in lifter.buffers:
        kept = [buf.shape[d] for d in buf.kept_dims] or [1]
        node = buf.node
        made = example(node)
        if made is not None and made.device != device:
            node = graph.call_method("to", (node, device))
        if list(kept) != list(buf.shape):
            node = graph.call_method("reshape", (node, *kept))
        out.append(node)
    return out


def _known_mask(dense: torch.Tensor) -> tuple[str, Optional[Callable]]:
    """Name a position-built keep mask [B', H', M, N], and give its canonical mask function
    ``fn(env, idx)`` when it is a known shape. Equality is checked on the whole static grid,
    so the canonical function is exactly the user's mask wherever flex evaluates it."""
    M, N = dense.shape[-2:]
    shape = f"positions [{', '.join(str(s) for s in dense.shape)}]"
    if dense.shape[0] != 1 or dense.shape[1] != 1:
        return shape, None
    d = dense[0, 0]
    q = torch.arange(M).view(M, 1)
    kv = torch.arange(N).view(1, N)
    if torch.equal(d, q >= kv):
        return "causal", lambda env, idx: idx[2] >= idx[3]
    off = N - M
    if off and torch.equal(d, q + off >= kv):
        return "causal (bottom-right)", lambda env, idx: idx[2] + off >= idx[3]
    w = int(d.sum(-1).max())
    if 0 < w < N and torch.equal(d, (q >= kv) & (q - kv < w)):
        return f"sliding_window {w}", lambda env, idx: (idx[2] >= idx[3]) & (
            idx[2] - idx[3] < w)
    return shape, None


# -- scores of rank 3 or above 4 ---------------------------------------------------------------


def flex_rank(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A [.., M, X] shape of attention as flex_attention's 4-D [B, H, M, X]: [BH, M, X] (bmm over
    merged batch and heads) is [1, BH, M, X]; [B, n1, .., nk, M, X] (heads and windows, blocks,
    ...) merges n1..nk into flex's heads. Attention is independent per batch index, so merging
    batch-like dims is exact (a reshape in C order, undone after the op).

    Example::

        >>> flex_rank((6, 32, 16)), flex_rank((2, 3, 4, 32, 16)), flex_rank((2, 3, 32, 16))
        ((1, 6, 32, 16), (2, 12, 32, 16), (2, 3, 32, 16))
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) == 4:
        return shape
    if len(shape) == 3:
        return (1,) + shape
    if len(shape) > 4:
        return (shape[0], math.prod(shape[1:-2])) + shape[-2:]
    raise ValueError(f"attention of rank {len(shape)}")


def root_index(idx: list, score_shape: tuple[int, ...]) -> list:
    """flex's indices [b, h, q_idx, kv_idx] as indices of scores of ``score_shape`` (the inverse
    of :func:`flex_rank`): [h, q, kv] for [BH, M, N]; for [B, n1, .., nk, M, N] the head index
    is split back, h = ((i1 * n2) + i2) * .. + ik. Indices may be ints, tensors or fx proxies.

    Example::

        >>> root_index([0, 7, 1, 2], (2, 3, 4, 32, 32))
        [0, 1, 3, 1, 2]
    """
    rank = len(score_shape)
    if rank == 4:
        return list(idx)
    if rank == 3:
        return list(idx[1:])
    mid = [int(s) for s in score_shape[1:-2]]
    h, parts = idx[1], []
    for d, size in reversed(list(enumerate(mid))):
        if size == 1:
            parts.append(0)
        elif d == 0:
            parts.append(h)
        else:
            parts.append(h % size)
            h = h // size
    return [idx[0]] + parts[::-1] + list(idx[2:])


# -- einsum --------------------------------------------------------------------------------


def shape_after(op: Operand) -> tuple[int, ...]:
    """The static shape of ``op.build()``.

    Example::

        >>> shape_after(Operand(k_node, [("transpose", (-2, -1))]))   # doctest: +SKIP
        (2, 4, 16, 64)
    """
    shape = list(static_shape(op.node))
    for method, args in op.views:
        if method == "transpose":
            a, b = (d % len(shape) for d in args)
            shape[a], shape[b] = shape[b], shape[a]
        elif method == "permute":
            shape = [shape[d] for d in args]
        elif method == "reshape":
            shape = list(args)
    return tuple(shape)
