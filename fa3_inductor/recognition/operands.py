"""How attention code spells its operands: K transposes, einsum layouts, GQA repeats, scales.

Each helper reads one spelling in Dynamo's graph and says what it means for flex_attention's
q/k/v: the node to use and the view ops that bring it to [B, H, S, D] (an :class:`Operand`),
the GQA group count of a repeated K/V (so the un-repeated one is used: no copy), or a constant
scale folded into flex's ``scale``.

Example::

    >>> kv, groups = unrepeat(k_node)   # repeat_kv / repeat_interleave / expand  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx

from .attention_site import Operand, Refused
from .fx_ops import arg, op_name, static_shape

def peel_constant_scale(node: torch.fx.Node) -> tuple[torch.fx.Node, float]:
    """``x * c`` / ``x / c`` / ``c * x`` with a Python number c folded into flex's scale."""
    name = op_name(node)
    if name not in ("mul", "div") or node.kwargs:
        return node, 1.0
    a, b = node.args[:2]
    if name == "mul" and isinstance(a, (int, float)) and isinstance(b, torch.fx.Node):
        a, b = b, a
    if isinstance(a, torch.fx.Node) and isinstance(b, (int, float)) and not isinstance(b, bool):
        if static_shape(a) == static_shape(node) and b != 0:
            return a, float(b) if name == "mul" else 1.0 / float(b)
    return node, 1.0


def transposed_source(node: Any) -> Optional[torch.fx.Node]:
    """``x`` if ``node`` is x with its last two dims swapped (transpose, mT, permute)."""
    name = op_name(node)
    shape = static_shape(node)
    if shape is None:
        return None
    r = len(shape)
    if name == "transpose":
        dims = sorted(d % r for d in node.args[1:3])
        return node.args[0] if dims == [r - 2, r - 1] else None
    if name == "getattr" and node.args[1] == "mT":
        return node.args[0]
    if name == "permute":
        dims = node.args[1:] if len(node.args) > 2 or isinstance(node.args[1], int) \
            else node.args[1]
        dims = [d % r for d in dims]
        return node.args[0] if dims == list(range(r - 2)) + [r - 1, r - 2] else None
    return None


def unrepeat(node: torch.fx.Node) -> tuple[torch.fx.Node, int]:
    """(kv, groups) if ``node`` repeats each kv head ``groups`` times along dim 1
    (HF ``repeat_kv``, ``repeat_interleave(dim=1)``, ``expand`` of one kv head)."""
    name = op_name(node)
    shape = static_shape(node)
    if shape is None or len(shape) != 4:
        return node, 1
    if name == "repeat_interleave":
        reps, dim = arg(node, 1, "repeats"), arg(node, 2, "dim")
        src = node.args[0]
        if isinstance(reps, int) and dim is not None and dim % 4 == 1:
            return src, reps
        return node, 1
    if name in ("reshape", "view"):
        src = node.args[0]
        sshape = static_shape(src)
        if op_name(src) in ("expand",) and sshape is not None and len(sshape) == 5:
            b, hkv, n, s, d = sshape
            if shape != (b, hkv * n, s, d):
                return node, 1
            inner = src.args[0]
            ishape = static_shape(inner)
            if ishape == (b, hkv, 1, s, d):
                base = _unsqueezed_source(inner, 2)
                if base is not None:
                    return base, n
        return node, 1
    if name == "expand":
        src = node.args[0]
        sshape = static_shape(src)
        if sshape is not None and len(sshape) == 4 and sshape[1] == 1 and shape[1] > 1 and \
                sshape[0] == shape[0] and sshape[2:] == shape[2:]:
            return src, shape[1]
    return node, 1


def _unsqueezed_source(node: torch.fx.Node, dim: int) -> Optional[torch.fx.Node]:
    name = op_name(node)
    if name == "unsqueeze" and arg(node, 1, "dim") % 5 == dim:
        return node.args[0]
    if name == "getitem":
        index = node.args[1]
        if isinstance(index, tuple) and len(index) >= 3 and index[2] is None and all(
                i == slice(None) or i is Ellipsis for i in index[:2] + index[3:]):
            return node.args[0]
    return None


def _parse_einsum(eq: Any, rank: int) -> Optional[tuple[str, str, str]]:
    if not isinstance(eq, str) or "->" not in eq:
        return None
    lhs, out = eq.replace(" ", "").split("->")
    ops = lhs.split(",")
    if "." in eq:
        # "...qhd,...khd->...hqk" (LongT5): the ellipsis stands for the same leading dims in
        # every term; spell them out with letters the equation does not use.
        if any(t.count("...") != 1 or t.replace("...", "").count(".") for t in ops + [out]):
            return None
        n_dots = rank - len(out.replace("...", ""))
        free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in eq]
        if n_dots < 0 or n_dots > len(free):
            return None
        dots = "".join(free[:n_dots])
        ops, out = [t.replace("...", dots) for t in ops], out.replace("...", dots)
    if len(ops) != 2 or any(len(o) != rank for o in ops + [out]):
        return None
    return ops[0], ops[1], out


def einsum_qk(eq: Any, a: Any, b: Any, rank: int) -> tuple[Operand, Operand]:
    """q and k operands of ``einsum(eq, a, b)`` computing q·kᵀ [..., m, n].

    Example::

        >>> q, k = einsum_qk("bqhd,bkhd->bhqk", a, b, 4)   # doctest: +SKIP
    """
    parsed = _parse_einsum(eq, rank)
    if parsed is None:
        raise Refused(f"einsum {eq!r} is not a q·k product of rank-{rank} operands")
    la, lb, lo = parsed
    batch, m, n = lo[:-2], lo[-2], lo[-1]
    shared = set(la) & set(lb)
    contracted = shared - set(lo)
    if len(contracted) != 1 or m not in la or n not in lb or set(batch) != shared - contracted \
            or m in lb or n in la:
        raise Refused(f"einsum {eq!r} is not a q·k product")
    d = contracted.pop()
    qa = [la.index(c) for c in batch + m + d]
    kb = [lb.index(c) for c in batch + n + d]
    return _permuted(a, qa), _permuted(b, kb)


def einsum_v(eq: Any, rank: int, v: Any) -> Operand:
    """The v operand of ``einsum(eq, p, v)`` with p laid out [..., m, n].

    Example::

        >>> v = einsum_v("bhqk,bkhd->bqhd", 4, v_node)   # doctest: +SKIP
    """
    parsed = _parse_einsum(eq, rank)
    if parsed is None:
        raise Refused(f"einsum {eq!r} is not a p·v product of rank-{rank} operands")
    lp, lv, lo = parsed
    batch, m, n = lp[:-2], lp[-2], lp[-1]
    dv = [c for c in lv if c not in lp]
    if len(dv) != 1 or n not in lv or set(lo) != set(batch + m + dv[0]) or m in lv:
        raise Refused(f"einsum {eq!r} is not a p·v product with p laid out [..., m, n]")
    return _permuted(v, [lv.index(c) for c in batch + n + dv[0]])


def einsum_out_perm(eq: str, rank: int) -> Optional[list[int]]:
    """The permutation from flex's [..., m, dv] output to the einsum's output layout.

    Example::

        >>> einsum_out_perm("bhqk,bkhd->bqhd", 4)   # doctest: +SKIP
        [0, 2, 1, 3]
    """
    lp, lv, lo = _parse_einsum(eq, rank)
    dv = [c for c in lv if c not in lp][0]
    flex_layout = lp[:-1] + dv          # [batch..., m, dv]
    perm = [flex_layout.index(c) for c in lo]
    return None if perm == list(range(rank)) else perm


def _permuted(node: Any, perm: list[int]) -> Operand:
    if not isinstance(node, torch.fx.Node):
        raise Refused("einsum operand is not a tensor")
    return Operand(node, [] if perm == list(range(len(perm))) else [("permute", tuple(perm))])
