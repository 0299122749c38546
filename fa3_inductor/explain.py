"""``fa3_inductor.explain``: what the fa3 backend does with the attention in a function or model.

It compiles the callable with the fa3 backend, runs it once, and reports every attention site:
the front door it came through, the score mods, mask and GQA groups recognition found, and
which template runs it (or why torch's kernel does); for a training graph, which backward family
computes its gradients (or why the last resort does); plus the attention it left alone, with
the reason.

Example::

    >>> report = fa3_inductor.explain(model, input_ids)    # doctest: +SKIP
    >>> report.fused_count                                  # doctest: +SKIP
    2
    >>> print(report)                                       # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import itertools
import types
from typing import Any, Callable, Optional

import torch

from .report import LoweredBackwardSite, LoweredSite, RecognizedSite, backward_records, site_records

NOT_OURS = (None, "torch")   # a site left to torch's own kernels
_CALLS = itertools.count()


@dataclasses.dataclass
class FusedSite:
    """One attention site that became a flex_attention op (one fused attention kernel)."""

    front_door: str                  # "sdpa" | "matmul-softmax" | "flex_attention"
    node: str                        # its node in Dynamo's graph
    score_mods: tuple[str, ...]      # e.g. ("softcap 30",); () for none
    mask: str                        # e.g. "causal", "none"
    gqa_groups: int                  # query heads per kv head
    training: bool                   # gradients flow through it
    template: str                    # a kernel family ("hopper", "hopper_fp8", "fp8", "generic", "torch") or "unknown"
    fallback_reason: Optional[str] = None   # why torch's kernel runs it (template "torch")
    shape: str = ""                  # as the lowering saw it: "q[B, H, M, D] kv[...] dtype dev"
    note: str = ""                   # on sm90: the Hopper tiles, or why the generic template runs
    backward: str = ""               # training: the backward family ("generic_bwd", ...), "dense", "torch"
    backward_reason: str = ""        # why that one (for "dense" / "torch": why none of ours serves it)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class UnfusedSite:
    """An attention site recognition looked at and left as written."""

    front_door: str
    node: str
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ExplainReport:
    """What :func:`explain` found. ``fused_count`` counts sites that became one flex_attention
    op (our template or torch's kernel); ``served_count`` those our templates run."""

    sites: list[FusedSite]
    unfused: list[UnfusedSite]
    graph_count: int                 # graphs Dynamo handed the backend (graph breaks add some)

    @property
    def fused_count(self) -> int:
        return len(self.sites)

    @property
    def served_count(self) -> int:
        return sum(s.template not in NOT_OURS for s in self.sites)

    def as_dict(self) -> dict[str, Any]:
        return {"fused_count": self.fused_count, "served_count": self.served_count,
                "graph_count": self.graph_count, "sites": [s.as_dict() for s in self.sites],
                "unfused": [s.as_dict() for s in self.unfused]}

    def __str__(self) -> str:
        head = (f"fa3_inductor.explain: {self.fused_count} attention site(s) fused, "
                f"{self.served_count} on fa3 templates, {len(self.unfused)} left alone "
                f"({self.graph_count} graph(s))")
        lines = [head]
        if self.sites:
            rows = [("#", "front door", "node", "score mods", "mask", "GQA", "template", "backward",
                     "note")]
            for i, s in enumerate(self.sites, 1):
                rows.append((str(i), s.front_door, s.node, ", ".join(s.score_mods) or "-",
                             s.mask, str(s.gqa_groups),
                             s.template + (" (train)" if s.training else ""), s.backward or "-",
                             _note(s)))
            widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
            for r in rows:
                cells = [r[c].ljust(widths[c]) for c in range(len(widths))] + [r[-1]]
                lines.append("  " + "  ".join(cells).rstrip())
        if self.unfused:
            lines.append("left alone:")
            lines += [f"  {u.front_door} {u.node}: {u.reason}" for u in self.unfused]
        return "\n".join(lines)


def _note(site: FusedSite) -> str:
    """The report row's last column: why torch's forward runs, or the forward's note, then the
    backward's reason when a last resort computes the gradients."""
    parts = [site.fallback_reason or site.note]
    if site.backward in ("dense", "torch"):
        parts.append(f"backward: {site.backward_reason}")
    return "; ".join(p for p in parts if p)


def _unwrap(fn: Any) -> Any:
    """The user's callable under a torch.compile wrapper, if any."""
    fn = getattr(fn, "_orig_mod", fn)                        # torch.compile(module)
    return getattr(fn, "_torchdynamo_orig_callable", fn)     # torch.compile(function)


def _fresh_entry(target: Callable) -> Callable:
    """A function calling ``target`` whose code object is new: Dynamo keeps its compiled
    entries per code object, so this compile neither reuses nor evicts any of the user's."""
    def entry(*args: Any, **kwargs: Any) -> Any:
        return target(*args, **kwargs)

    n = next(_CALLS)
    code = entry.__code__.replace(co_name=f"fa3_explain_{n}")
    return types.FunctionType(code, entry.__globals__, code.co_name, entry.__defaults__,
                              entry.__closure__)


def _link(recognized: list[RecognizedSite], lowered: list[LoweredSite],
          backward: Optional[list[LoweredBackwardSite]] = None
          ) -> tuple[list[FusedSite], list[UnfusedSite]]:
    by_id: dict[int, LoweredSite] = {}
    for low in lowered:
        if low.site_id is not None:
            by_id.setdefault(low.site_id, low)   # first record: the forward lowering
    backward_by_id = {b.site_id: b for b in backward or () if b.site_id is not None}
    untagged = [low for low in lowered if low.site_id is None]
    fused, unfused, unmatched = [], [], []
    for rec in recognized:
        if not rec.rewritten:
            unfused.append(UnfusedSite(rec.front_door, rec.node, rec.reason or "?"))
            continue
        site = FusedSite(rec.front_door, rec.node, tuple(rec.score_mods), rec.mask,
                         rec.gqa_groups, rec.training, "unknown")
        low = by_id.get(rec.site_id) if rec.site_id is not None else None
        if low is None:
            unmatched.append(site)
        else:
            _take_lowering(site, low)
        bwd = backward_by_id.get(rec.site_id) if rec.site_id is not None else None
        if bwd is not None:
            site.backward, site.backward_reason = bwd.family, bwd.reason
        if rec.rope:
            site.note = (f"{site.note}; " if site.note else "") + _rope_note(rec)
        fused.append(site)
    # Sites whose tag did not reach the lowering (an older torch that drops node meta): within
    # one explain() call the lowering meets them in program order, so pair them up in order
    # when the counts agree; otherwise say "unknown" rather than guess.
    if unmatched and len(unmatched) == len(untagged):
        for site, low in zip(unmatched, untagged):
            _take_lowering(site, low)
    return fused, unfused


def _rope_note(rec: RecognizedSite) -> str:
    """What became of the RoPE found before an FP8 site (recognition/rope_fusion.py)."""
    if rec.rope_fused:
        return f"RoPE ({rec.rope}) fused into the FP8 prologue"
    return (f"RoPE ({rec.rope}) in the model runs before the FP8 prologue: "
            f"{rec.rope_reason or 'not fused'}")


def _take_lowering(site: FusedSite, low: LoweredSite) -> None:
    """Copy what the lowering decided for a site (template, why, shape, note) onto its report row."""
    site.template, site.fallback_reason, site.shape, site.note = (
        low.template, low.fallback_reason, low.shape, low.note)


def explain(fn_or_module: Callable, *args: Any, compile_options: Optional[dict] = None,
            **kwargs: Any) -> ExplainReport:
    """Compile ``fn_or_module`` with ``backend="fa3"``, run it once on ``args``/``kwargs``,
    and report what happened to each attention site.

    The compile is private to this call: it does not reuse or replace the user's compiled
    code for the same function (only where a graph break splits the callable does the code
    after the break get one more entry in Dynamo's cache, as any compile would add), and
    Inductor's and AOT autograd's on-disk caches are off while it runs (a cached graph would
    skip recognition and lowering, and report nothing).
    ``compile_options`` are the backend's ``options`` (``{"fa3.template": "generic"}``, ...).
    The call runs under the caller's grad mode: with gradients on it compiles a training graph,
    whose backward is lowered right away (not at the first backward call, as usual), so the report
    says which backward family serves each site; only the forward is run.

    Example::

        >>> report = fa3_inductor.explain(model, input_ids)         # doctest: +SKIP
        >>> report.fused_count, [s.template for s in report.sites]  # doctest: +SKIP
        (2, ['generic', 'generic'])
        >>> print(report)                                            # doctest: +SKIP
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    from .backend import fa3_backend

    if not callable(fn_or_module):
        raise TypeError("fa3_inductor.explain: the first argument must be a function or an "
                        f"nn.Module, got {type(fn_or_module).__name__}")
    graphs = [0]

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        graphs[0] += 1
        return fa3_backend(gm, example_inputs, options=compile_options)

    recognized_before, lowered_before = (len(x) for x in site_records())
    backward_before = len(backward_records())
    compiled = torch.compile(_fresh_entry(_unwrap(fn_or_module)), backend=backend)
    with inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False, force_non_lazy_backward_lowering=True):
        compiled(*args, **kwargs)
    recognized, lowered = site_records()
    fused, unfused = _link(recognized[recognized_before:], lowered[lowered_before:],
                           backward_records()[backward_before:])
    return ExplainReport(fused, unfused, graphs[0])
