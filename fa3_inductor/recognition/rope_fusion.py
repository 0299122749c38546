"""Fuse the RoPE that model code applies to q and k into the FP8 prologue (``options={"fa3.fp8": ...}``).

With FP8 on, every site our kernels serve runs ``fa3_inductor::flex_fwd_fp8``, whose prologue reads
q and k once to quantize them. When the model rotates q and k (RoPE) right before attention, the
prologue can rotate them itself (``fp8_recipe.RopeSpec``): this pass replaces such a
flex_attention node by one call of ``fa3_inductor::flex_fwd_fp8_rope`` (runtime/ops_fp8.py) on q
and k *before* RoPE, and the model's own RoPE over q and k becomes dead code (Inductor drops it),
unless something else reads the rotated tensors (a KV cache stores rotated keys): then it stays.

Why in ``recognition/``: it is a rewrite of Dynamo's graph built on :mod:`.rope`'s matches, run by
``backend.recognize`` after the other rewrites made their flex_attention nodes. It must also decide
as the lowering would (the new op bypasses the flex_attention lowering); recognition and the
lowering are peers (tests/test_layering.py), so the lowering's planner
(``lowering/site_plan.plan_site``) comes in as a callable, as ``unserved_reason`` does for the
other rewrites.

A site is fused only when all of this holds (otherwise it stays as it is, and the reason goes to
explain()):

- q and k are RoPE with the same tables, style and width (:func:`.rope.rope_pair`);
- nothing but casts lies between RoPE and the operands (a ``transpose``/``permute`` would have to be
  replayed on x, and the tables re-laid out with it);
- static shapes; q and k of one batch and one length (row i of the table rotates token i of both:
  the op has no position offsets), the tables broadcast to x without a head axis (RopeSpec's
  ``[S, R]`` / ``[B, S, R]``);
- the graph reads only flex_attention's out and LSE by index (the FP8 op does not compute the row
  max);
- the site plans (``plan_site(..., fp8=True)``, as ``flex_lowering._plan`` plans it) to our FP8
  families. A pre-RoPE operand never reaches a flex_attention node: torch's kernel, the lowering's
  fallback, would compute on unrotated q and k.

The planner reads the mods as the lowering does: Dynamo holds them as torch-level graphs, which are
traced to aten first as torch's flex_attention traces them for Inductor. The op's outputs are
flex_attention's (out, LSE in log2 units, row max), so its users are rewired as they are.

Example::

    >>> from fa3_inductor.lowering.site_plan import plan_site
    >>> fusion = fuse_rope(gm, flex_node, Settings(fp8=True), plan_site)   # doctest: +SKIP
    >>> fusion                                                             # doctest: +SKIP
    RopeFusion(rope='half R=64', fused=True, reason=None)
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
from typing import Any, Callable, Optional

import torch
import torch.fx

from .. import _compat
from .._log import log
from ..config import Settings
from ..report import LoweredSite, record_site, site_tag
from ..runtime.ops_fp8 import recipe_text   # also defines fa3_inductor::flex_fwd_fp8_rope
from ..runtime.spec import SiteSpec
from ..templates.modgen import BufferSpec, ModInfo, UnsupportedMod, describe_mod_source
from .fx_ops import meta_value, static_shape
from .rope import RopeMatch, real_table_nodes, rope_pair

FUSED_OP = torch.ops.fa3_inductor.flex_fwd_fp8_rope.default
_NO_MASK_BLOCK = 1 << 30   # torch's "no mask": one block covering any sequence


@dataclasses.dataclass
class RopeFusion:
    """What became of the RoPE found in front of one flex_attention site.

    - ``rope``: what was found, e.g. "half R=64";
    - ``fused``: the site now runs ``flex_fwd_fp8_rope`` with the RoPE in its prologue;
    - ``reason``: why not, when not fused.

    explain() shows "RoPE (half R=64) fused into the FP8 prologue", or "RoPE (half R=64) in the
    model runs before the FP8 prologue: <reason>" (report.RecognizedSite.rope*).

    Example::

        >>> RopeFusion("half R=64", False, "symbolic shapes").fused
        False
    """

    rope: str
    fused: bool
    reason: Optional[str] = None


PlanSite = Callable[..., tuple[Optional[SiteSpec], Optional[str]]]


@dataclasses.dataclass
class _Planned:
    spec: SiteSpec
    shape: str
    score_bufs: list
    mask_bufs: list
    block_tables: tuple
    sparse: tuple[int, int]
    scale: float


class _Unfit(Exception):
    """The site cannot take the fused op; the message says why (explain() shows it)."""


def fuse_rope(gm: torch.fx.GraphModule, node: torch.fx.Node, settings: Settings,
              plan_site: PlanSite) -> Optional[RopeFusion]:
    """Replace the flex_attention ``node`` of Dynamo's graph ``gm`` by ``flex_fwd_fp8_rope`` on q
    and k before RoPE when it fits (module docstring); None when q and k are not RoPE with the same
    tables. ``settings``: the backend's (``settings.fp8`` set); ``plan_site``: the lowering's
    planner (``lowering/site_plan.plan_site``). A fused site's plan is recorded as the lowering
    records its sites (report.LoweredSite), since no flex_attention lowering runs for it. The
    caller recompiles ``gm``.

    Example::

        >>> fusion = fuse_rope(gm, flex_node, settings, plan_site)   # doctest: +SKIP
        >>> fusion.fused, fusion.rope                                # doctest: +SKIP
        (True, 'half R=64')
    """
    pair = rope_pair(node.args[0], node.args[1])
    if pair is None:
        return None
    found = f"{pair[0].style} R={pair[0].rotary_dim}"
    try:
        _check_operands(node, pair)
        planned = _plan(gm, node, settings, plan_site)
    except _Unfit as exc:
        log.info("fa3_inductor: RoPE before %s left to the model: %s", node.name, exc)
        return RopeFusion(found, False, str(exc))
    _replace(gm, node, pair, planned, settings)
    record_site(LoweredSite(planned.spec.template, *_mod_summaries(planned.spec),
                            planned.shape, site_id=site_tag(node), note=planned.spec.note))
    log.info("fa3_inductor: RoPE (%s) before %s fused into the FP8 prologue", found, node.name)
    return RopeFusion(found, True)


def _check_operands(node: torch.fx.Node, pair: tuple[RopeMatch, RopeMatch]) -> None:
    """Raise _Unfit unless the pre-RoPE q and k can replace the operands (module docstring)."""
    for role, match in zip("qk", pair):
        moved = [f"{method}{args}" for method, args in match.views if method != "to"]
        if moved:
            raise _Unfit(f"{role} goes through {', '.join(moved)} between RoPE and attention "
                         "(the fused op takes q and k in attention's layout: only casts may lie "
                         "between)")
    q_x, k_x = (static_shape(m.x) for m in pair)
    operands = [static_shape(a) for a in node.args[:3]]
    if q_x is None or k_x is None or None in operands:
        raise _Unfit("symbolic shapes (the op's tables are laid out for one sequence length)")
    if q_x != operands[0] or k_x != operands[1]:
        raise _Unfit(f"RoPE's input {list(q_x)} / {list(k_x)} is not shaped like the operands "
                     f"{list(operands[0])} / {list(operands[1])}")
    if q_x[0] != k_x[0] or q_x[2] != k_x[2]:
        raise _Unfit(f"q {list(q_x)} and k {list(k_x)} differ in batch or length: the fused RoPE "
                     "rotates token i of q and of k by the same table row")
    operand_dtype = meta_value(node.args[0]).dtype
    if operand_dtype not in (torch.float16, torch.bfloat16):
        raise _Unfit(f"the site runs in {operand_dtype} (the FP8 prologue reads bfloat16/float16)")
    rows = (q_x[0], 1, q_x[2], pair[0].rotary_dim)   # [batch, heads, length, R]
    for table in _table_shapes(pair[0]):
        padded = (1,) * (4 - len(table)) + table
        if len(padded) != 4 or padded[1] != 1 or padded[3] != rows[3] or \
                padded[0] not in (1, rows[0]) or padded[2] not in (1, rows[2]):
            raise _Unfit(f"a RoPE table {list(table)} does not broadcast to [batch, 1, length, R] "
                         f"= {list(rows)} (RopeSpec's tables have no head axis)")
    for user in node.users:
        index = user.args[1] if user.target is operator.getitem and len(user.args) == 2 else None
        if not isinstance(index, int):
            raise _Unfit(f"{user.name} reads flex_attention's outputs as a whole (the fused op "
                         "is wired to them by index)")
        if index == 2 and user.users:
            raise _Unfit("the graph reads flex_attention's max_scores, which the FP8 op does not "
                         "compute")


def _table_shapes(match: RopeMatch) -> list[tuple[int, ...]]:
    """The real cos/sin tables' shapes (a complex table stands for [..., R] real ones)."""
    shapes = []
    for table in (match.cos, match.sin):
        shape = static_shape(table)
        if shape is None:
            raise _Unfit(f"the RoPE table {table.name} has a symbolic shape")
        shapes.append(shape[:-1] + (shape[-1] * 2,) if match.complex_table else shape)
    return shapes


def _plan(gm: torch.fx.GraphModule, node: torch.fx.Node, settings: Settings,
          plan_site: PlanSite) -> _Planned:
    """Plan the site as flex_lowering._plan would (FP8 on, no row max), from Dynamo's meta."""
    q, k, v = (meta_value(a) for a in node.args[:3])
    score_gm, block_mask, scale = node.args[3], node.args[4], node.args[5]
    score_buffers, mask_buffers = node.args[7], node.args[8]
    try:
        bm = _compat.unpack_block_mask(tuple(block_mask))
    except RuntimeError as exc:
        raise _Unfit(str(exc)) from exc
    sparse = (bm.sparse_q_block, bm.sparse_kv_block)
    if not all(isinstance(s, int) for s in sparse):
        raise _Unfit("the block mask's block sizes are symbolic")
    if not isinstance(scale, numbers.Real):
        raise _Unfit(f"the scale is {type(scale).__name__}, not a number fixed at compile time")
    score_nodes, score_specs = _buffers(score_buffers)
    mask_nodes, mask_specs = _buffers(mask_buffers)
    score_module = _aten_mod(gm, score_gm, "score", q, score_buffers)
    mask_module = _aten_mod(gm, bm.mask_graph, "mask", q, mask_buffers)
    kv = f"kv{list(k.shape)}" + (f" v{list(v.shape)}" if v.shape[-1] != k.shape[-1] else "")
    shape = f"q{list(q.shape)} {kv} {str(q.dtype).replace('torch.', '')} {q.device.type}"
    try:
        spec, reason = plan_site(
            score_module, mask_module, score_specs, mask_specs, device=q.device, dtype=q.dtype,
            q_heads=q.shape[1], kv_heads=k.shape[1], head_dim=q.shape[-1],
            value_head_dim=v.shape[-1], batches_match=q.shape[0] == k.shape[0] or k.shape[0] == 1,
            sparse_blocks=sparse, settings=settings, description=shape, needs_max=False, fp8=True)
    except UnsupportedMod as exc:
        raise _Unfit(f"mod not lowerable: {exc}") from exc
    if spec is None:
        raise _Unfit(f"no FP8 kernel serves the site ({reason})")
    tables = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
    if spec.planned_sources()[1] is None and min(sparse) >= _NO_MASK_BLOCK:
        tables = (None, None, None, None)   # torch's "no mask": the kernel's dense path
    return _Planned(spec, shape, score_nodes, mask_nodes, tables, sparse, float(scale))


def _aten_mod(gm: torch.fx.GraphModule, node: Any, kind: str, query: torch.Tensor,
              buffers: Any) -> torch.fx.GraphModule:
    """The aten graph of a mod that Dynamo's graph holds as a torch-level submodule: traced as
    torch's flex_attention traces it for the lowering (trace_flex_attention: a 0-d score in the
    query's dtype, int32 indices, then the captured buffers), so the planner sees what the
    lowering would see. Fake tensors stand for the inputs (a captured buffer may be large)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    module = None
    if isinstance(node, torch.fx.Node) and node.op == "get_attr":
        try:
            module = gm.get_submodule(node.target)
        except AttributeError:
            module = None
    if not isinstance(module, torch.fx.GraphModule):
        raise _Unfit(f"the {kind}_mod is not a graph held by the compiled graph ({node!r})")
    device = query.device
    with FakeTensorMode():
        args = [torch.zeros((), dtype=torch.int, device=device) for _ in range(4)]
        if kind == "score":
            args.insert(0, torch.zeros((), dtype=query.dtype, device=device))
        for buffer in buffers or ():
            value = meta_value(buffer) if isinstance(buffer, torch.fx.Node) else buffer
            if isinstance(value, torch.Tensor):
                args.append(torch.empty(value.shape, dtype=value.dtype, device=value.device))
            elif isinstance(value, (int, float)):
                args.append(value)
            else:
                raise _Unfit(f"a {kind}_mod buffer is {type(value).__name__}, not a tensor or a "
                             "number")
    try:
        with _compat.getitem_as_index():
            return make_fx(module)(*args)
    except Exception as exc:   # the lowering would meet the same mod: it reports it there
        raise _Unfit(f"the {kind}_mod could not be traced here ({type(exc).__name__}: {exc})") \
            from exc


def _buffers(buffers: Any) -> tuple[list, list]:
    """(tensor nodes to pass, BufferSpecs for the planner) of a mod's captured buffers. The op
    makes them contiguous, so the specs have contiguous strides (as the lowering's); a scalar
    gets None, as in the lowering (the generator checks it is unused)."""
    nodes, specs = [], []
    for buffer in buffers or ():
        value = meta_value(buffer)
        if not isinstance(value, torch.Tensor):
            specs.append(None)
            continue
        shape = static_shape(buffer)
        if shape is None:
            raise _Unfit(f"the captured buffer {buffer.name} has a symbolic shape")
        strides, stride = [], 1
        for size in reversed(shape):
            strides.append(stride)
            stride *= max(size, 1)
        nodes.append(buffer)
        specs.append(BufferSpec(shape, tuple(reversed(strides)), value.dtype))
    return nodes, specs


def _mod_summaries(spec: SiteSpec) -> tuple[str, str]:
    score, mask = spec.planned_sources()
    return (describe_mod_source(score, ModInfo.from_items(spec.score_info)),
            describe_mod_source(mask, ModInfo.from_items(spec.mask_info)))


def _replace(gm: torch.fx.GraphModule, node: torch.fx.Node, pair: tuple[RopeMatch, RopeMatch],
             planned: _Planned, settings: Settings) -> None:
    """Put the fused op where ``node`` was, wire its outputs to ``node``'s users, and drop the
    RoPE nodes nothing reads any more."""
    graph = gm.graph
    q_match, k_match = pair
    dtype = meta_value(node.args[0]).dtype
    with graph.inserting_before(node):
        q, k = (_in_dtype(graph, m.x, dtype) for m in pair)
        cos, sin = real_table_nodes(graph, q_match)
        cos, sin = (_rope_spec_table(graph, t, shape, static_shape(q_match.x))
                    for t, shape in zip((cos, sin), _table_shapes(q_match)))
        fused = graph.call_function(FUSED_OP, (
            q, k, node.args[2], cos, sin, q_match.style, *planned.block_tables,
            planned.score_bufs, planned.mask_bufs, planned.scale, *planned.sparse,
            planned.spec.to_json(), recipe_text(settings.fp8)))
    for key in ("custom", "stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in node.meta:
            fused.meta[key] = node.meta[key]
    # flex_attention returns (out, lse[, max_scores]) as the op does; LSE in log2 units in both
    node.replace_all_uses_with(fused)
    graph.erase_node(node)
    for dead in sorted(set(q_match.nodes) | set(k_match.nodes), reverse=True):
        if not dead.users and dead.graph is graph:
            graph.erase_node(dead)
    for attr in [n for n in graph.nodes if n.op == "get_attr" and not n.users]:
        graph.erase_node(attr)   # the flex node's score/mask graphs (the modules stay: harmless)


def _in_dtype(graph: torch.fx.Graph, x: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    """x, cast to the attention operands' dtype when the model rotated it in another one (the
    cast then comes before RoPE instead of after: one rounding moves, within FP8's error)."""
    if meta_value(x).dtype == dtype:
        return x
    return graph.call_method("to", (x, dtype))


def _rope_spec_table(graph: torch.fx.Graph, table: torch.fx.Node, shape: tuple[int, ...],
                     x_shape: tuple[int, ...]) -> torch.fx.Node:
    """``table`` (broadcastable to x [B, H, S, D] restricted to R channels, size 1 on the head
    axis) as RopeSpec's [S, R] (one table for every batch row) or [B, S, R]: broadcast to x's
    shape without the head axis, then the head axis dropped (views, no copy)."""
    batch, _, length, _ = x_shape
    padded = (1,) * (4 - len(shape)) + tuple(shape)
    lead = batch if padded[0] != 1 else 1
    full = graph.call_function(torch.broadcast_to, (table, (lead, 1, length, shape[-1])))
    index = (0, 0) if lead == 1 else (slice(None), 0)
    return graph.call_function(operator.getitem, (full, index))
