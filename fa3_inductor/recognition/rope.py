"""Recognize rotary position embeddings (RoPE) that model code applies to q and k before attention.

An FP8 attention call quantizes q and k in a prologue; when RoPE is applied right before, the
prologue can apply it too (``fp8_recipe.RopeSpec``) and the model's own RoPE pass over q and k
disappears. This module finds that RoPE: given the node that feeds an attention site's q (or k),
:func:`match_rope` says whether it is RoPE applied to an earlier tensor ``x`` and returns the
pieces a rewrite needs (:class:`RopeMatch`); :func:`rope_pair` checks that q and k use the same
tables. Nothing here touches the graph (except :func:`real_table_nodes`, which the rewrite calls).

What is matched (the torch-function graph Dynamo hands a backend, and the aten graph AOT autograd
or make_fx trace; examples are in tests/test_recognize_rope.py):

- rotate_half (transformers' ``apply_rotary_pos_emb``, Llama/Mistral/Qwen/...)::

      x * cos + cat((-x[..., R/2:], x[..., :R/2]), -1) * sin          style "half"

  the halves taken by slicing, ``narrow``, ``chunk`` or ``split`` along the last dim;
- interleaved (GPT-J's ``rotate_every_two``; lucidrains' ``rotary-embedding-torch``)::

      x * cos + stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2) * sin   style "interleaved"

  the even/odd channels taken by strided slices or by selecting from ``x.view(..., R/2, 2)``;
- complex multiply (Meta's Llama)::

      view_as_real(view_as_complex(x.float().reshape(..., R/2, 2)) * freqs_cis).flatten(3)
      style "interleaved", complex_table=True

- partial rotary (Phi, GPT-NeoX, StableLM): ``cat((rope(x[..., :R]), x[..., R:]), -1)``;
- casts (``x.float()`` before, ``.type_as(x)`` / ``.to(dtype)`` after) and layout views that keep
  the channel dim last (``transpose(1, 2)``, ``permute``, ``contiguous``) between RoPE and the
  attention operand, recorded in :attr:`RopeMatch.views`; a KV cache's first update
  (``cat([empty cache, k], -2)``, transformers' prefill) is seen through as the identity it is.

The tables are whatever the model multiplies by (``cos`` for the ``x`` term, ``sin`` for the
rotated term), so applying them exactly reproduces the model, with any scaling the model folded
into them (YaRN's attention scaling). What is refused, so that a match is never wrong:

- a different rotation: ``cat((x2, -x1))`` (the opposite sign), halves swapped, a rotation of a
  different tensor than the one multiplied by cos, ``x * cos - rotate(x) * sin``, ``add`` with
  ``alpha``, a scale applied to one term or to the sum (``(x*cos + rot*sin) * c``: the node is
  then a ``mul``, not RoPE);
- tables that depend on x, differ in shape, have a last dim other than R (R/2 complex), would
  broadcast x to a larger shape, or vary across heads (RopeSpec has no head axis);
- tables whose origin is visible in the graph and says they are swapped: the ``x`` term's table
  computed by ``sin()`` or the rotated term's by ``cos()``, or cos and sin of different angles;
- rotated channels that are not the first R (``cat((x_pass, rope(x_rot)))``, as DeepSeek's MLA
  spells its rope columns): RopeSpec rotates ``x[..., :R]``;
- symbolic shapes.

Example::

    >>> match = match_rope(sdpa_node.args[0])                   # doctest: +SKIP
    >>> match.style, match.rotary_dim, match.x.name             # doctest: +SKIP
    ('half', 16, 'l_q_')
    >>> q_match, k_match = rope_pair(sdpa_node.args[0], sdpa_node.args[1])   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional, Sequence

import torch
import torch.fx

from .._log import log
from .fx_ops import arg, aten_name, meta_value, op_name, same_value

STYLES = ("half", "interleaved")


@dataclasses.dataclass
class RopeMatch:
    """RoPE recognised at an attention operand: ``node == views(rope(x.to(compute_dtype)))``.

    - ``x``: the tensor before RoPE (the operand's layout with :attr:`views` undone); a cast the
      model applied first (``x.float()``) is part of the RoPE, not of ``x``.
    - ``cos`` / ``sin``: the table nodes as the model computed them, broadcastable to
      ``x[..., :rotary_dim]`` (last dim ``rotary_dim``), never varying across heads. With
      ``complex_table`` both are the complex ``freqs_cis`` node (last dim ``rotary_dim // 2``,
      broadcastable to the complex view of x): the real tables are ``freqs.real`` / ``freqs.imag``
      with every entry repeated twice (:func:`real_tables`, :func:`real_table_nodes`).
    - ``style``: "half" (channel i pairs with i + R/2) or "interleaved" (2i with 2i + 1).
    - ``rotary_dim``: R; channels ``x[..., R:]`` pass through unchanged.
    - ``nodes``: the nodes of the RoPE expression, in graph order, from the matched node back to
      (not including) x and the tables: what a rewrite makes dead, unless something else uses
      them (a KV cache stores k after RoPE).
    - ``views``: the ops, as ``(method, args)`` in Operand's convention, taking the RoPE output to
      the matched node: layout views (``transpose``/``permute``) and casts (``("to", (dtype,))``).
    - ``compute_dtype``: the dtype the model's RoPE arithmetic runs in (x's, or promoted by the
      tables, or the ``.float()`` the model applied first).

    Example::

        >>> m = match_rope(q_node); (m.style, m.rotary_dim, m.views)      # doctest: +SKIP
        ('interleaved', 16, [('transpose', (1, 2))])
    """

    x: torch.fx.Node
    cos: torch.fx.Node
    sin: torch.fx.Node
    style: str
    rotary_dim: int
    nodes: list[torch.fx.Node]
    views: list[tuple[str, tuple]] = dataclasses.field(default_factory=list)
    complex_table: bool = False
    compute_dtype: Optional[torch.dtype] = None


class _NoMatch(Exception):
    """Not RoPE; the message says what was wrong."""


def match_rope(node: torch.fx.Node, operand_views: Sequence[tuple[str, tuple]] = ()
               ) -> Optional[RopeMatch]:
    """The RoPE computing ``node`` (an attention operand), or None with the reason logged at DEBUG
    on the ``fa3_inductor`` log. Never raises.

    ``operand_views``: the Operand's view ops taking ``node`` to flex's [B, H, S, D] (or
    [B·H, S, D]) layout, used to find the head axis the tables must not vary along; empty when
    ``node`` is in that layout already (an SDPA query, a matmul operand).

    Example::

        >>> m = match_rope(sdpa_node.args[0])                     # doctest: +SKIP
        >>> (m.style, m.rotary_dim, m.x is q_before_rope)         # doctest: +SKIP
        ('half', 64, True)
    """
    try:
        return _match(node, list(operand_views))
    except _NoMatch as exc:
        log.debug("fa3_inductor: %s is not RoPE: %s", _label(node), exc)
    except Exception as exc:  # an analysis bug must not break the user's compile
        log.debug("fa3_inductor: RoPE analysis of %s failed (%s: %s); treated as no RoPE",
                  _label(node), type(exc).__name__, exc)
    return None


def rope_pair(q_node: torch.fx.Node, k_node: torch.fx.Node,
              q_views: Sequence[tuple[str, tuple]] = (),
              k_views: Sequence[tuple[str, tuple]] = ()
              ) -> Optional[tuple[RopeMatch, RopeMatch]]:
    """RoPE on both q and k with the same tables (the same nodes, or the same computation on the
    same source, e.g. ``cos[:, None]`` spelled once per operand), style and rotary dim; else None
    with the reason logged at DEBUG. ``q_views`` / ``k_views``: as ``operand_views`` of
    :func:`match_rope`.

    Example::

        >>> pair = rope_pair(sdpa_node.args[0], sdpa_node.args[1])    # doctest: +SKIP
        >>> pair[0].cos is pair[1].cos                                 # doctest: +SKIP
        True
    """
    q_match, k_match = match_rope(q_node, q_views), match_rope(k_node, k_views)
    reason = None
    if q_match is None or k_match is None:
        reason = f"{'q' if q_match is None else 'k'} is not RoPE (reason logged above)"
    elif (q_match.style, q_match.complex_table) != (k_match.style, k_match.complex_table):
        reason = (f"q and k use different RoPE styles ({_style(q_match)} vs "
                  f"{_style(k_match)})")
    elif q_match.rotary_dim != k_match.rotary_dim:
        reason = (f"q and k rotate different widths ({q_match.rotary_dim} vs "
                  f"{k_match.rotary_dim} channels)")
    elif not (same_value(q_match.cos, k_match.cos) and same_value(q_match.sin, k_match.sin)):
        reason = (f"q and k are rotated by tables that are not provably the same (q: "
                  f"{q_match.cos.name}/{q_match.sin.name}, k: {k_match.cos.name}/"
                  f"{k_match.sin.name})")
    if reason is not None:
        log.debug("fa3_inductor: no RoPE pair at %s / %s: %s", _label(q_node), _label(k_node),
                  reason)
        return None
    return q_match, k_match


# ---------------------------------------------------------------------------------------------
# Reference RoPE and complex tables
# ---------------------------------------------------------------------------------------------

def real_tables(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) tables of an interleaved RoPE from complex ``freqs_cis`` [..., R/2]: the real
    and imaginary parts, each entry repeated twice ([..., R]).

    Example::

        >>> real_tables(torch.polar(torch.ones(3), torch.zeros(3)))[0]
        tensor([1., 1., 1., 1., 1., 1.])
    """
    return (freqs.real.repeat_interleave(2, dim=-1), freqs.imag.repeat_interleave(2, dim=-1))


def real_table_nodes(graph: torch.fx.Graph, match: RopeMatch
                     ) -> tuple[torch.fx.Node, torch.fx.Node]:
    """Real (cos, sin) table nodes for ``match``, inserted at the graph's insertion point when the
    match has a complex table (torch-function ops, for the graph Dynamo hands the backend), else
    the match's own nodes.

    Example::

        >>> with gm.graph.inserting_before(sdpa_node):                 # doctest: +SKIP
        ...     cos, sin = real_table_nodes(gm.graph, match)
    """
    if not match.complex_table:
        return match.cos, match.sin
    pairs = graph.call_function(torch.view_as_real, (match.cos,))
    tables = []
    for part in (0, 1):
        half = graph.call_function(operator.getitem, (pairs, (Ellipsis, part)))
        tables.append(graph.call_function(torch.repeat_interleave, (half, 2), {"dim": -1}))
    return tables[0], tables[1]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str,
               rotary_dim: int, complex_table: bool = False) -> torch.Tensor:
    """RoPE as :class:`RopeMatch` describes it, in x's dtype promoted with the tables':
    ``x[..., :R] * cos + rotate(x[..., :R]) * sin``, then ``x[..., R:]`` appended. With
    ``complex_table``, ``cos`` is the complex table (``sin`` is ignored). The arithmetic is the
    models' own, in the same order, so the same dtype gives the same bits.

    Example::

        >>> x = torch.tensor([[1., 2., 3., 4.]])
        >>> apply_rope(x, torch.zeros(4), torch.ones(4), "half", 4)   # rotate_half(x)
        tensor([[-3., -4.,  1.,  2.]])
    """
    if complex_table:
        cos, sin = real_tables(cos)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if style == "half":
        half = rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    elif style == "interleaved":
        rotated = torch.stack((-rot[..., 1::2], rot[..., ::2]), dim=-1).flatten(-2)
    else:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    out = rot * cos + rotated * sin
    return torch.cat((out, rest.to(out.dtype)), dim=-1) if rest.shape[-1] else out


# ---------------------------------------------------------------------------------------------
# The matcher
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Core:
    """``y * cos + rotate(y) * sin`` (or the complex product) found at one node."""

    y: torch.fx.Node
    cos: torch.fx.Node
    sin: torch.fx.Node
    style: str
    complex_table: bool
    nodes: list


def _match(node: torch.fx.Node, operand_views: list) -> RopeMatch:
    if not isinstance(node, torch.fx.Node):
        raise _NoMatch(f"{node!r} is not a graph node")
    nodes: list[torch.fx.Node] = []
    out, views = _walk_views(node, nodes)
    if _shape(out) is None:
        raise _NoMatch(f"{out.name} has no static shape")
    compute_dtype = _tensor(out).dtype
    partial = _partial_rotary(out)
    if partial is not None:
        rot_out, x_full, rotary_dim = partial
        nodes += [out, _concat(out)[0][1]]
        core = _core(rot_out)
        source = _last_dim_slice(core.y)
        if source is None or source[1] != range(rotary_dim) or \
                not same_value(source[0], x_full):
            raise _NoMatch(f"the rotated part {rot_out.name} is not RoPE of "
                           f"{x_full.name}[..., :{rotary_dim}] (the tensor whose tail is "
                           "passed through)")
        nodes.append(core.y)
        x = x_full
    else:
        core = _core(out)
        x, rotary_dim = core.y, _shape(core.y)[-1]
    if _tensor(core.nodes[0]).dtype != compute_dtype:
        raise _NoMatch(f"the rotated part is {_tensor(core.nodes[0]).dtype} but {out.name} is "
                       f"{compute_dtype}")
    nodes += core.nodes
    x = _peel_cast_to(x, compute_dtype, nodes)
    _check_tables(core, x, rotary_dim, views + operand_views)
    return RopeMatch(x=x, cos=core.cos, sin=core.sin, style=core.style, rotary_dim=rotary_dim,
                     nodes=sorted(set(nodes)),   # fx nodes compare by their place in the graph
                     views=views, complex_table=core.complex_table, compute_dtype=compute_dtype)


def _walk_views(node: torch.fx.Node, nodes: list) -> tuple[torch.fx.Node, list]:
    """Walk back through layout views and casts; returns (RoPE output, views in applying
    order)."""
    steps: list[tuple[str, tuple]] = []
    while True:
        step = _layout_step(node)
        if step is None:
            return node, steps[::-1]
        nodes.append(node)
        node, view = step
        if view is not None:
            steps.append(view)


def _core(out: torch.fx.Node) -> _Core:
    name = _name(out)
    if name in ("add", "aten.add"):
        return _real_core(out)
    pairs = _merged_pairs(out)
    if pairs is not None and _name(pairs) in ("view_as_real", "aten.view_as_real"):
        return _complex_core(out, pairs)
    if _concat(out) is not None:
        raise _NoMatch(f"{out.name} concatenates along the last dim but is not "
                       "cat((rope(x[..., :R]), x[..., R:])): RopeSpec rotates the first R "
                       "channels and passes the rest through")
    raise _NoMatch(f"{out.name} ({name or out.target}) is not x*cos + rotate(x)*sin, a complex "
                   "product, or a rotated part concatenated with a passed-through tail")


def _real_core(add: torch.fx.Node) -> _Core:
    """``y * cos + rotate(y) * sin``, every operand order."""
    terms = _binary(add, ("add", "aten.add"))
    if terms is None:
        raise _NoMatch(f"{add.name} is an add with alpha or out= (RoPE adds the terms as they "
                       "are)")
    reasons = []
    for x_term, rot_term in (terms, terms[::-1]):
        x_factors = _binary(x_term, ("mul", "aten.mul"))
        rot_factors = _binary(rot_term, ("mul", "aten.mul"))
        if x_factors is None or rot_factors is None:
            continue
        for rotated, sin in (rot_factors, rot_factors[::-1]):
            rotation = _rotation(rotated)
            if isinstance(rotation, str):
                reasons.append(rotation)
                continue
            y, style, rot_nodes = rotation
            for y_candidate, cos in (x_factors, x_factors[::-1]):
                if same_value(y_candidate, y) and isinstance(cos, torch.fx.Node) and \
                        isinstance(sin, torch.fx.Node):
                    _check_dtypes(add, x_term, rot_term, cos, sin)
                    return _Core(y_candidate, cos, sin, style, False,
                                 [add, x_term, rot_term] + rot_nodes)
            reasons.append(f"{rotated.name} rotates {y.name} but the other term of {add.name} "
                           f"({x_term.name}) does not multiply {y.name}")
    if not reasons:
        raise _NoMatch(f"{add.name} is not a sum of two products")
    raise _NoMatch("; ".join(dict.fromkeys(reasons)))


def _check_dtypes(add: torch.fx.Node, x_term: torch.fx.Node, rot_term: torch.fx.Node,
                  cos: torch.fx.Node, sin: torch.fx.Node) -> None:
    """Both products and the sum in one dtype, the tables in one dtype: then RoPE on x cast to
    that dtype is the model's arithmetic (with a bfloat16 sin and a float32 cos, the model would
    round rotate(x)*sin to bfloat16 before adding it in float32)."""
    dtypes = [_tensor(n).dtype if _tensor(n) is not None else None
              for n in (add, x_term, rot_term, cos, sin)]
    if len(set(dtypes[:3])) != 1 or dtypes[3] != dtypes[4]:
        raise _NoMatch(f"mixed dtypes: x*cos is {dtypes[1]}, rotate(x)*sin {dtypes[2]}, their "
                       f"sum {dtypes[0]}, cos {dtypes[3]}, sin {dtypes[4]} (RoPE runs in one "
                       "dtype)")


def _rotation(node: Any):
    """(y, style, nodes) if ``node`` is rotate_half(y) or rotate_every_two(y), else a reason."""
    if not isinstance(node, torch.fx.Node):
        return f"{node!r} is not a tensor"
    concat = _concat(node)
    if concat is not None:
        return _rotate_half(node, concat)
    merged = _merged_pairs(node)
    if merged is not None:
        return _rotate_every_two(node, merged)
    return f"{node.name} is neither rotate_half (a cat) nor rotate_every_two (a flattened stack)"


def _rotate_half(node: torch.fx.Node, concat: tuple[list, int]):
    parts, _ = concat
    if len(parts) != 2:
        return f"{node.name} concatenates {len(parts)} parts (rotate_half has 2)"
    negated, second = parts
    first = _neg_source(negated)
    if first is None:
        return (f"{node.name} is cat({_label(negated)}, {_label(second)}) with a first part "
                "that is not negated (rotate_half is cat(-x2, x1))")
    if _neg_source(second) is not None:
        return f"{node.name}: both halves are negated (rotate_half is cat(-x2, x1))"
    upper, lower = _last_dim_slice(first), _last_dim_slice(second)
    if upper is None or lower is None or not same_value(upper[0], lower[0]):
        return f"{node.name}: the halves are not slices of one tensor's last dim"
    y, width = upper[0], _shape(upper[0])[-1]
    half = width // 2
    if width % 2 or upper[1] != range(half, width) or lower[1] != range(half):
        return (f"{node.name} is cat(-x[..., {_fmt(upper[1])}], x[..., {_fmt(lower[1])}]) of "
                f"a last dim of {width} (rotate_half is cat(-x[..., {half}:], "
                f"x[..., :{half}]))")
    return y, "half", [node, negated, first, second]


def _rotate_every_two(node: torch.fx.Node, stacked: torch.fx.Node):
    parts = _stack_last(stacked)
    if parts is None or len(parts[0]) != 2:
        return (f"{node.name} flattens {stacked.name}, which does not stack two tensors on a "
                "new last dim")
    (negated, second), stack_nodes = parts
    first = _neg_source(negated)
    if first is None:
        return (f"{stacked.name} stacks a first part that is not negated (rotate_every_two is "
                "stack(-x[..., 1::2], x[..., ::2]))")
    odd, even = _pair_component(first), _pair_component(second)
    if odd is None or even is None or not same_value(odd[0], even[0]):
        return f"{stacked.name}: the stacked parts are not channels of one tensor"
    if (odd[1], even[1]) != (1, 0):
        return (f"{stacked.name} stacks (-x[..., {odd[1]}::2], x[..., {even[1]}::2]) "
                "(rotate_every_two is stack(-x[..., 1::2], x[..., ::2]))")
    return odd[0], "interleaved", [node, stacked, negated, first, second] + stack_nodes + \
        odd[2] + even[2]


def _complex_core(out: torch.fx.Node, as_real: torch.fx.Node) -> _Core:
    product = as_real.args[0]
    factors = _binary(product, ("mul", "aten.mul"))
    if factors is None:
        raise _NoMatch(f"{as_real.name} is view_as_real of {_label(product)}, not of a product")
    for as_complex, freqs in (factors, factors[::-1]):
        if _name(as_complex) not in ("view_as_complex", "aten.view_as_complex"):
            continue
        pairs = as_complex.args[0]
        y = _split_pairs(pairs)
        if y is None:
            raise _NoMatch(f"{as_complex.name} views {_label(pairs)}, which does not split the "
                           "last dim of a tensor into pairs")
        if not isinstance(freqs, torch.fx.Node) or _tensor(freqs) is None or \
                not _tensor(freqs).is_complex():
            raise _NoMatch(f"{product.name} multiplies the complex view of {y.name} by "
                           f"{_label(freqs)}, which is not a complex tensor")
        return _Core(y, freqs, freqs, "interleaved", True,
                     [out, as_real, product, as_complex, pairs])
    raise _NoMatch(f"{product.name} multiplies no view_as_complex of a tensor")


def _partial_rotary(out: torch.fx.Node) -> Optional[tuple[torch.fx.Node, torch.fx.Node, int]]:
    """(rotated part, x, R) if ``out`` is ``cat((rotated, x[..., R:]), -1)``."""
    concat = _concat(out)
    if concat is None or len(concat[0]) != 2:
        return None
    rotated, passed = concat[0]
    tail = _last_dim_slice(passed)
    if tail is None or _shape(rotated) is None:
        return None
    source, kept = tail
    width, rotary_dim = _shape(source)[-1], _shape(rotated)[-1]
    if _shape(out)[-1] != width or kept != range(rotary_dim, width):
        return None
    return rotated, source, rotary_dim


def _peel_cast_to(x: torch.fx.Node, dtype: torch.dtype, nodes: list) -> torch.fx.Node:
    """x's source if x is a cast to ``dtype`` (``q.float()`` before RoPE): the rewrite casts x
    to compute_dtype first, which is this cast."""
    step = _cast_step(x)
    if step is not None and _tensor(x).dtype == dtype:
        nodes.append(x)
        return step
    return x


def _check_tables(core: _Core, x: torch.fx.Node, rotary_dim: int, views: list) -> None:
    y_shape = list(_shape(core.y))
    width = rotary_dim // 2 if core.complex_table else rotary_dim
    if core.complex_table:
        y_shape[-1] = width
    for role, table in (("cos", core.cos), ("sin", core.sin)):
        value = _tensor(table)
        shape = _shape(table)
        if value is None or shape is None:
            raise _NoMatch(f"the {role} table {_label(table)} has no static shape")
        if not core.complex_table and not value.is_floating_point():
            raise _NoMatch(f"the {role} table {table.name} is {value.dtype}, not floating point")
        if not shape or shape[-1] != width:
            raise _NoMatch(f"the {role} table {table.name} has shape {list(shape)}, not a last "
                           f"dim of {width}")
        try:
            broadcast = list(torch.broadcast_shapes(torch.Size(shape), torch.Size(y_shape)))
        except RuntimeError:
            broadcast = None
        if broadcast != y_shape:
            raise _NoMatch(f"the {role} table {table.name} {list(shape)} does not broadcast to "
                           f"the rotated tensor {y_shape}")
        if _depends_on(table, x):
            raise _NoMatch(f"the {role} table {table.name} depends on {x.name}")
        head = _head_axis(len(y_shape), views)
        offset = head - (len(y_shape) - len(shape)) if head is not None else -1
        if offset >= 0 and shape[offset] != 1:
            raise _NoMatch(f"the {role} table {table.name} {list(shape)} varies across heads "
                           f"(dim {head} of the rotated tensor); RopeSpec tables have no head "
                           "axis")
    if _shape(core.cos) != _shape(core.sin):
        raise _NoMatch(f"the cos and sin tables differ in shape ({list(_shape(core.cos))} vs "
                       f"{list(_shape(core.sin))})")
    if not core.complex_table:
        _check_trig_origins(core.cos, core.sin)


def _check_trig_origins(cos: torch.fx.Node, sin: torch.fx.Node) -> None:
    """Where the graph shows which function made a table, it must be the expected one."""
    cos_origin, sin_origin = _trig_origin(cos), _trig_origin(sin)
    if cos_origin is not None and cos_origin[0] != "cos":
        raise _NoMatch(f"the table multiplying x ({cos.name}) is computed by "
                       f"{cos_origin[0]}(), not cos(): cos and sin are swapped or wrong")
    if sin_origin is not None and sin_origin[0] != "sin":
        raise _NoMatch(f"the table multiplying rotate(x) ({sin.name}) is computed by "
                       f"{sin_origin[0]}(), not sin(): cos and sin are swapped or wrong")
    if cos_origin is not None and sin_origin is not None and \
            not same_value(cos_origin[1], sin_origin[1]):
        raise _NoMatch(f"cos and sin are of different angles ({_label(cos_origin[1])} vs "
                       f"{_label(sin_origin[1])})")


# ---------------------------------------------------------------------------------------------
# Reading one op, in Dynamo's spelling or aten's
# ---------------------------------------------------------------------------------------------

_CAST_NAMES = {"to", "type_as", "float", "half", "bfloat16", "double", "type", "aten._to_copy",
               "aten.to", "prims.convert_element_type", "aten.convert_element_type"}
_IDENTITY_NAMES = {"contiguous", "clone", "aten.clone", "aten.alias", "aten.contiguous"}
_TRANSPOSE_NAMES = {"transpose", "swapaxes", "swapdims", "aten.transpose"}
_RESHAPE_NAMES = {"reshape", "view", "flatten", "unflatten", "aten.view", "aten._unsafe_view",
                  "aten.reshape", "aten.flatten", "aten.unflatten"}
_CAT_NAMES = {"cat", "concat", "concatenate", "aten.cat"}
# Ops a table goes through on its way from cos()/sin() to the multiply, first operand the table.
_TABLE_PATH = {"unsqueeze", "squeeze", "view", "reshape", "expand", "expand_as", "contiguous",
               "clone", "to", "type_as", "float", "half", "bfloat16", "double", "getitem",
               "index_select", "repeat_interleave", "repeat", "flatten", "transpose", "permute",
               "detach", "narrow", "select", "aten.unsqueeze", "aten.squeeze", "aten.view",
               "aten._unsafe_view", "aten.reshape", "aten.expand", "aten.clone", "aten._to_copy",
               "aten.slice", "aten.select", "aten.index", "aten.index_select",
               "aten.repeat_interleave", "aten.repeat", "aten.transpose", "aten.permute",
               "aten.alias", "aten.detach", "prims.convert_element_type"}


def _name(node: Any) -> Optional[str]:
    return op_name(node) or aten_name(node)


def _label(node: Any) -> str:
    return node.name if isinstance(node, torch.fx.Node) else repr(node)


def _fmt(r: range) -> str:
    return f"{r.start}:{r.stop}" + (f":{r.step}" if r.step != 1 else "")


def _style(m: RopeMatch) -> str:
    return m.style + (" (complex)" if m.complex_table else "")


def _tensor(node: Any) -> Optional[torch.Tensor]:
    value = meta_value(node)
    return value if isinstance(value, torch.Tensor) else None


def _shape(node: Any) -> Optional[tuple[int, ...]]:
    value = _tensor(node)
    if value is None or not all(isinstance(s, int) for s in value.shape):
        return None
    return tuple(value.shape)


def _binary(node: Any, names: tuple[str, str]) -> Optional[tuple[Any, Any]]:
    """The two operands of an add/mul (torch or aten spelling); None for other ops and for
    ``alpha``/``out`` arguments, which change what the op computes or where it goes."""
    if _name(node) not in names:
        return None
    if node.op == "call_method":
        if len(node.args) != 2 or node.kwargs:
            return None
        return node.args[0], node.args[1]
    first = "self" if _name(node).startswith("aten.") else "input"
    a, b = arg(node, 0, first), arg(node, 1, "other")
    extra = {k: v for k, v in node.kwargs.items() if k not in (first, "other")}
    if extra.pop("alpha", 1) != 1 or extra or len(node.args) > 2 or a is None or b is None:
        return None
    return a, b


def _neg_source(node: Any) -> Optional[torch.fx.Node]:
    """x if ``node`` is ``-x`` (``neg``, or a multiply by the constant -1, which is exact)."""
    name = _name(node)
    if name in ("neg", "negative", "aten.neg") and len(node.args) == 1 and not node.kwargs:
        return node.args[0] if isinstance(node.args[0], torch.fx.Node) else None
    factors = _binary(node, ("mul", "aten.mul"))
    if factors is not None:
        for a, b in (factors, factors[::-1]):
            if isinstance(a, torch.fx.Node) and isinstance(b, (int, float)) and \
                    not isinstance(b, bool) and b == -1 and _shape(a) == _shape(node):
                return a
    return None


def _concat(node: Any) -> Optional[tuple[list, int]]:
    """(parts, dim) if ``node`` concatenates tensors along its last dim."""
    if _name(node) not in _CAT_NAMES or _shape(node) is None:
        return None
    parts = arg(node, 0, "tensors")
    dim = arg(node, 1, "dim", node.kwargs.get("axis", 0))
    rank = len(_shape(node))
    if not isinstance(parts, (list, tuple)) or not isinstance(dim, int) or dim % rank != rank - 1 \
            or not all(isinstance(p, torch.fx.Node) for p in parts):
        return None
    return list(parts), rank - 1


def _stack_last(node: torch.fx.Node) -> Optional[tuple[list, list]]:
    """((parts), extra nodes) if ``node`` stacks tensors on a new last dim: ``stack(.., -1)``,
    or ``cat`` of ``unsqueeze(-1)``s (stack's decomposition)."""
    shape = _shape(node)
    if shape is None:
        return None
    rank = len(shape)
    if _name(node) in ("stack", "aten.stack"):
        parts, dim = arg(node, 0, "tensors"), arg(node, 1, "dim", 0)
        if isinstance(parts, (list, tuple)) and isinstance(dim, int) and \
                dim % rank == rank - 1:
            return list(parts), []
        return None
    concat = _concat(node)
    if concat is None:
        return None
    sources = []
    for part in concat[0]:
        dim = arg(part, 1, "dim")
        if _name(part) not in ("unsqueeze", "aten.unsqueeze") or not isinstance(dim, int) or \
                dim % rank != rank - 1:
            return None
        sources.append(part.args[0])
    return sources, list(concat[0])


def _layout_step(node: torch.fx.Node) -> Optional[tuple[torch.fx.Node, Optional[tuple]]]:
    """(input, view) if ``node`` is a layout view keeping the last dim last, a cast, or an
    identity op (view None); else None."""
    name = _name(node)
    shape = _shape(node)
    if shape is not None and name in _CAT_NAMES:
        return _cat_of_one(node)
    if shape is None or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    src, rank = node.args[0], len(shape)
    if name in _IDENTITY_NAMES:
        return src, None
    if name in _TRANSPOSE_NAMES:
        dims = [arg(node, 1, "dim0"), arg(node, 2, "dim1")]
        if not all(isinstance(d, int) for d in dims):
            return None
        a, b = (d % rank for d in dims)
        if rank - 1 in (a, b) and a != b:
            return None   # moves the channel dim: RoPE runs along the last dim of x
        return src, ("transpose", (a, b))
    if name in ("permute", "aten.permute"):
        dims = node.args[1:] if len(node.args) > 2 or isinstance(arg(node, 1, "dims"), int) \
            else arg(node, 1, "dims")
        if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
            return None
        dims = tuple(d % rank for d in dims)
        return (src, ("permute", dims)) if dims[-1] == rank - 1 else None
    cast = _cast_step(node)
    if cast is not None:
        return cast, ("to", (_tensor(node).dtype,))
    return None


def _cat_of_one(node: torch.fx.Node) -> Optional[tuple[torch.fx.Node, Optional[tuple]]]:
    """(part, view) if ``node`` concatenates one tensor with empty ones: a KV cache's first
    update, ``cat([cache (empty), k], dim=-2)``, which transformers runs on prefill. The value is
    that tensor's (a cast if cat promoted its dtype). With cached keys it is a real concatenation
    (keys rotated in earlier calls): not RoPE of one tensor, and left alone."""
    parts = arg(node, 0, "tensors")
    if not isinstance(parts, (list, tuple)):
        return None
    values = [_tensor(p) for p in parts]
    if any(v is None for v in values):
        return None
    filled = [p for p, v in zip(parts, values) if v.numel() != 0]
    if len(filled) != 1 or _shape(filled[0]) != _shape(node):
        return None
    dtype = _tensor(node).dtype
    return filled[0], (None if _tensor(filled[0]).dtype == dtype else ("to", (dtype,)))


def _cast_step(node: Any) -> Optional[torch.fx.Node]:
    """The input of a dtype cast (same shape and device, floating point), else None."""
    if _name(node) not in _CAST_NAMES or not node.args or \
            not isinstance(node.args[0], torch.fx.Node):
        return None
    before, after = _tensor(node.args[0]), _tensor(node)
    if before is None or after is None or before.shape != after.shape or \
            before.device != after.device or not before.is_floating_point() or \
            not after.is_floating_point():
        return None
    return node.args[0]


def _merged_pairs(node: Any) -> Optional[torch.fx.Node]:
    """src if ``node`` reshapes src [..., a, b] to [..., a*b] (flatten of the last two dims)."""
    if _name(node) not in _RESHAPE_NAMES or not isinstance(node.args[0], torch.fx.Node):
        return None
    before, after = _shape(node.args[0]), _shape(node)
    if before is None or after is None or len(before) < 2 or \
            after != before[:-2] + (before[-2] * before[-1],):
        return None
    return node.args[0]


def _split_pairs(node: Any) -> Optional[torch.fx.Node]:
    """src if ``node`` reshapes src [..., 2n] to [..., n, 2] (channel pairs 2i, 2i+1)."""
    if _name(node) not in _RESHAPE_NAMES or not isinstance(node.args[0], torch.fx.Node):
        return None
    before, after = _shape(node.args[0]), _shape(node)
    if before is None or after is None or not before or \
            after != before[:-1] + (before[-1] // 2, 2) or before[-1] % 2:
        return None
    return node.args[0]


def _last_dim_slice(node: Any) -> Optional[tuple[torch.fx.Node, range]]:
    """(src, the channels of src's last dim that ``node`` keeps) if ``node`` slices src's last
    dim only: ``src[..., a:b:s]``, ``narrow(-1, ...)``, ``aten.slice(src, -1, ...)``, or a piece
    of ``chunk``/``split`` along the last dim."""
    name = _name(node)
    if name is None or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    src = node.args[0]
    if name == "getitem" and isinstance(node.args[1], int) and _name(src) in (
            "chunk", "split", "aten.split", "aten.split_with_sizes"):
        return _split_piece(src, node.args[1])
    shape = _shape(src)
    if shape is None or _shape(node) is None:
        return None
    rank, width = len(shape), shape[-1]
    if name == "getitem":
        index = node.args[1]
        if isinstance(index, slice):
            index = (index,)
        if not isinstance(index, tuple) or not index or not isinstance(index[-1], slice):
            return None
        lead = list(index[:-1])
        if Ellipsis in lead:
            if lead.count(Ellipsis) != 1 or lead.index(Ellipsis) != len(lead) - 1:
                return None
            lead = lead[:-1] + [slice(None)] * (rank - len(lead))
        if len(lead) != rank - 1 or any(i != slice(None) for i in lead):
            return None
        last = index[-1]
        if not all(v is None or isinstance(v, int) for v in (last.start, last.stop, last.step)):
            return None
        return src, range(*last.indices(width))
    if name in ("narrow", "aten.narrow"):
        dim, start, length = (arg(node, i, n) for i, n in ((1, "dim"), (2, "start"),
                                                            (3, "length")))
        if all(isinstance(v, int) for v in (dim, start, length)) and dim % rank == rank - 1:
            start %= width
            return src, range(start, start + length)
        return None
    if name == "aten.slice":
        dim, start, end, step = (arg(node, i, n, d) for i, n, d in (
            (1, "dim", 0), (2, "start", None), (3, "end", None), (4, "step", 1)))
        if isinstance(dim, int) and dim % rank == rank - 1 and all(
                v is None or isinstance(v, int) for v in (start, end, step)):
            return src, range(*slice(start, end, step).indices(width))
    return None


def _split_piece(parent: torch.fx.Node, index: int) -> Optional[tuple[torch.fx.Node, range]]:
    """Piece ``index`` of a chunk/split along the source's last dim, as a channel range."""
    src = parent.args[0] if parent.args else None
    shape = _shape(src)
    pieces = meta_value(parent)
    dim = arg(parent, 2, "dim", 0)
    if shape is None or not isinstance(pieces, (list, tuple)) or not isinstance(dim, int) or \
            dim % len(shape) != len(shape) - 1 or not 0 <= index < len(pieces):
        return None
    widths = [p.shape[-1] for p in pieces]
    if not all(isinstance(w, int) for w in widths):
        return None
    start = sum(widths[:index])
    return src, range(start, start + widths[index])


def _pair_component(node: Any) -> Optional[tuple[torch.fx.Node, int, list]]:
    """(y, parity, nodes) if ``node`` is the channels 2i + parity of y: ``y[..., parity::2]``,
    or component ``parity`` of ``y.view(..., n, 2)`` (``[..., parity]``, ``select``,
    ``unbind(-1)[parity]``)."""
    strided = _last_dim_slice(node)
    if strided is not None:
        y, kept = strided
        width = _shape(y)[-1]
        for parity in (0, 1):
            if kept == range(parity, width, 2) and width % 2 == 0:
                return y, parity, []
        return None
    name = _name(node)
    if name in ("select", "aten.select"):
        pairs, dim, parity = node.args[0], arg(node, 1, "dim"), arg(node, 2, "index")
    elif name == "getitem" and isinstance(node.args[1], int) and \
            _name(node.args[0]) in ("unbind", "aten.unbind"):
        unbind = node.args[0]
        pairs, dim, parity = unbind.args[0], arg(unbind, 1, "dim", 0), node.args[1]
    elif name == "getitem" and isinstance(node.args[1], tuple) and len(node.args[1]) == 2 \
            and node.args[1][0] is Ellipsis and isinstance(node.args[1][1], int):
        pairs, dim, parity = node.args[0], -1, node.args[1][1]
    else:
        return None
    shape = _shape(pairs)
    if shape is None or not isinstance(dim, int) or dim % len(shape) != len(shape) - 1 or \
            parity not in (0, 1):
        return None
    y = _split_pairs(pairs)
    if y is None:
        return None
    through = [node.args[0]] if node.args[0] is not pairs else []   # the unbind node
    return y, parity, [pairs] + through


def _head_axis(rank: int, views: list) -> Optional[int]:
    """The dim of the RoPE output that becomes the head axis of flex's layout after ``views``
    (dim 1 of [B, H, S, D], dim 0 of [B·H, S, D]); None for other ranks."""
    if rank not in (3, 4):
        return None
    perm = list(range(rank))
    for method, args in views:
        if method == "transpose":
            a, b = (d % rank for d in args)
            perm[a], perm[b] = perm[b], perm[a]
        elif method == "permute":
            perm = [perm[d] for d in args]
    return perm[1 if rank == 4 else 0]


def _depends_on(node: torch.fx.Node, source: torch.fx.Node, limit: int = 20000) -> bool:
    """Whether ``source`` is among ``node``'s inputs, transitively (True if too deep to tell)."""
    if node < source:      # graph order is topological: node was computed before source
        return False
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n is source:
            return True
        if n in seen:
            continue
        seen.add(n)
        if len(seen) > limit:
            return True
        stack.extend(m for m in n.all_input_nodes if not m < source)
    return False


def _trig_origin(table: torch.fx.Node) -> Optional[tuple[str, Any]]:
    """("cos" | "sin", angle) if ``table`` is cos(angle) / sin(angle) moved by views, casts,
    gathers by position, repeats, a cat of copies of itself, or a positive constant scale
    (attention scaling); None where the graph does not show it (a graph input)."""
    node = table
    for _ in range(64):
        name = _name(node)
        if name in ("cos", "sin", "aten.cos", "aten.sin"):
            return name.split(".")[-1], node.args[0]
        if name in _TABLE_PATH and isinstance(node.args[0], torch.fx.Node):
            node = node.args[0]
            continue
        if name in ("embedding", "aten.embedding"):   # F.embedding(ids, table); aten: (table, ids)
            node = arg(node, 1, "weight") if name == "embedding" else node.args[0]
            continue
        concat = _concat(node) or (
            (list(arg(node, 0, "tensors")), 0) if _name(node) in _CAT_NAMES else None)
        if concat is not None:
            origins = [_trig_origin(p) for p in concat[0]]
            if origins and all(o is not None for o in origins) and all(
                    o[0] == origins[0][0] and same_value(o[1], origins[0][1]) for o in origins):
                return origins[0]
            return None
        factors = _binary(node, ("mul", "aten.mul")) or _binary(node, ("div", "aten.div"))
        if factors is not None:
            a, b = factors
            if _name(node) in ("mul", "aten.mul") and not isinstance(a, torch.fx.Node):
                a, b = b, a
            if isinstance(a, torch.fx.Node) and isinstance(b, (int, float)) and \
                    not isinstance(b, bool) and b > 0:
                node = a
                continue
        return None
    return None
