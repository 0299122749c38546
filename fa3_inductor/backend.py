"""The ``fa3`` torch.compile backend: Inductor with our attention lowering switched on.

Registered through the ``torch_dynamo_backends`` entry point, so ``backend="fa3"`` works with
nothing imported first.

Example::

    >>> compiled = torch.compile(model, backend="fa3")                              # doctest: +SKIP
    >>> compiled = torch.compile(model, backend="fa3", mode="max-autotune-no-cudagraphs",
    ...                          options={"fa3.template": "generic"})               # doctest: +SKIP
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from . import _compat
from .config import Settings, split_options
from .lowering import flex_lowering, registration
from .lowering.passes import Fa3PostGradPass
from .lowering.sinks_fusion import SinksJointPass
from .lowering.site_plan import plan_site
from .recognition import module_state
from .recognition.gradless_buffers import detach_gradless_buffers
from .recognition.recognize_flex import flex_call_sites, flex_nodes, tag_rewritten
from .recognition.rope_fusion import fuse_rope
from .recognition.recognize_sdpa import rewrite_sdpa
from .recognition.rewrite_pays import unless_small
from ._log import log
from .recognition.mod_fills import saturate_fills
from .report import RecognizedSite, record_recognized, site_records, site_tag
from .runtime import cp_state


def fa3_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], *,
                mode: Optional[str] = None, options: Optional[dict[str, Any]] = None) -> Any:
    """Compile ``gm`` with Inductor, our flex_attention lowering active.

    ``mode`` is any Inductor mode ("default", "reduce-overhead", "max-autotune", ...);
    ``options`` are Inductor config entries plus ``fa3.*`` settings (see fa3_inductor.config).

    A graph with no flex_attention op left to lower (no attention site, or every site left as
    written: recognition/rewrite_pays.py) is compiled by the very compiler that
    ``backend="inductor"`` uses, with the same mode and options: the same config, so the same
    generated code, the same FX graph / AOT autograd cache entries, and the same callable per call.

    No crash of ours reaches the user: if recognition raises, the graph is compiled as written
    (recognition edits a copy); if compiling with our lowering raises, stock Inductor compiles the
    graph as Dynamo gave it, and only if that raises too does its error (the user's) propagate.
    Either way the failure is warned about once and is the reason on the graph's sites in
    explain() (``_gave_up``). Argument errors (``mode`` with ``options``, FP8 with gradients)
    are raised as before.

    A graph with attention sites (rewritten or left as written) checks on every call whether
    ``fa3_inductor.distributed.context_parallel`` is active; inside it the graph runs a form with
    every site as ring attention over the whole sharded sequence (:func:`_ring_variant`).

    Example::

        >>> torch.compile(fn, backend="fa3", options={"fa3.template": "torch"})  # doctest: +SKIP
    """
    if mode is not None and options:
        raise ValueError("backend 'fa3': give either mode= or options=, not both "
                         "(as for torch.compile's inductor backend)")
    settings, inductor_options = split_options(options)
    if settings.fp8 is not None and torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs):
        raise NotImplementedError(
            "backend 'fa3' with options={'fa3.fp8': ...} is inference-only (no backward through FP8 "
            "attention): run the model under torch.no_grad() / torch.inference_mode(), or drop "
            "'fa3.fp8' to train")
    stock = _stock_inductor(mode, inductor_options)
    if "post_grad_custom_post_pass" in stock.config:
        raise ValueError("backend 'fa3' installs its own post_grad_custom_post_pass; compose "
                         "your pass with backend='inductor' or ask for a hook")
    _note_cudagraphs(stock.config)
    registration.install()
    records_from = len(site_records()[0])
    original = gm
    extra_inputs: list = []
    guards: list = []
    if settings.recognize and settings.template != "torch":
        try:
            gm, extra_inputs, guards = recognize(gm, example_inputs, settings)
        except Exception as exc:  # our bug: the graph stays as written (recognize works on a copy)
            _gave_up("recognition", exc, records_from)
            gm, extra_inputs, guards = original, [], []
    else:
        for site in flex_call_sites(gm):
            record_recognized(site)
    # a graph holding attention sites gets a context-parallel form, made from this copy when first
    # called inside fa3_inductor.distributed.context_parallel (_context_parallel_aware). Only where
    # a process group exists (the context needs one): elsewhere the graph keeps stock Inductor's
    # per-call path exactly (tests/test_backend_parity.py).
    ring_source = (_own_copy(original) if site_records()[0][records_from:]
                   and _distributed_initialized() else None)
    if not extra_inputs and not guards and not has_flex_attention(gm):
        return _context_parallel_aware(stock(gm, example_inputs), ring_source, settings, stock)
    pristine = _own_copy(original)   # Inductor's passes edit the graph they compile
    try:
        compiled = _compile_ours(gm, example_inputs, extra_inputs, guards, settings, stock)
    except Exception as exc:
        # Stock Inductor on the graph as Dynamo gave it: if it raises too, the error is the
        # user's (theirs propagates); if not, the failure was ours and the graph runs as written.
        compiled = stock(pristine, example_inputs)
        _gave_up("compilation", exc, records_from)
    return _context_parallel_aware(compiled, ring_source, settings, stock)


def _distributed_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _context_parallel_aware(compiled: Any, ring_source: Optional[torch.fx.GraphModule],
                            settings: Settings, stock: Any) -> Any:
    """``compiled``, or for a graph with attention sites (``ring_source``: a copy of it as Dynamo
    gave it) a callable that asks on every call whether a context-parallel region is active
    (runtime/cp_state.py) and inside one runs the graph's ring variant (:func:`_ring_variant`,
    built on the first such call): its sites attend over the whole sharded sequence, not this
    rank's shard."""
    if ring_source is None:
        return compiled
    variants: dict = {}   # per input signature: one for a static graph (below)

    def run(*args: Any) -> Any:
        region = cp_state.active()
        if region is None:
            return compiled(*args)
        # The variant is compiled for these inputs (as Dynamo compiles a specialization: real
        # inputs, static shapes), so a graph with dynamic sizes gets one per distinct signature.
        signature = tuple((tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor)
                          else a for a in args)
        variant = variants.get(signature)
        if variant is None:
            variant = variants[signature] = _ring_variant(ring_source, list(args), settings,
                                                          stock, region)
        return variant(*args)

    return run


def _every_site(example_query: torch.Tensor, example_value: Optional[torch.Tensor] = None
                ) -> Optional[str]:
    return None   # ring attention serves any device, dtype and size (its shard kernels choose)


def _ring_variant(graph: torch.fx.GraphModule, args: list, settings: Settings, stock: Any,
                  region: Any) -> Any:
    """The graph with every attention site as ring attention: recognition rewrites each site it
    can express into flex_attention (whatever its size or device: the ring serves them all), the
    region turns those nodes into opaque ring-attention ops with their own backward
    (fa3_inductor/distributed/graph_sites.py), and stock Inductor compiles the graph around them
    for these inputs. Raises NotImplementedError naming a site recognition leaves alone (inside
    the context it would attend within this rank's shard only) or one the ring cannot make exact."""
    from .recognition.recognize_manual import rewrite_manual

    gm = _own_copy(graph)
    with module_state.constants(_module_buffers(gm, args)) as guards:
        sites, extra_inputs = rewrite_sdpa(gm, _every_site, keep_plain=False)
        manual_sites, manual_inputs = rewrite_manual(gm, _every_site)
    left = [site for site in sites + manual_sites if not site.rewritten]
    if left:
        raise NotImplementedError(
            "fa3_inductor.distributed.context_parallel: the compiled graph's attention "
            + "; ".join(f"site {site.node} ({site.front_door}) cannot run as ring attention: "
                        f"{site.reason}" for site in left)
            + ". Inside the context it would attend within this rank's sequence shard only; write "
            "it as F.scaled_dot_product_attention / flex_attention (looked up inside the context) "
            "or call fa3_inductor.distributed.ring_flex, or run the model outside the context")
    gm = region.ring_graph(gm, fp8=settings.fp8)   # FP8 sites (inference): the graph's recipe
    extra = extra_inputs + manual_inputs
    return _with_extra_inputs(stock(gm, args + extra), extra, guards)


def _compile_ours(gm: torch.fx.GraphModule, example_inputs: list, extra_inputs: list, guards: list,
                  settings: Settings, stock: Any) -> Any:
    """compile_fx with our lowering on; recognition's constants appended to the inputs."""
    from torch._inductor.compile_fx import compile_fx

    # Our marker pass turns our lowering on (lowering/common.py) and keys Inductor's caches
    # to this package's sources and settings (lowering/passes.py).
    # (attention sinks: the joint pass lets their backward read the kernel's outputs, sinks_fusion.py)
    patches = {"joint_custom_post_pass": SinksJointPass(), **stock.config,
               "post_grad_custom_post_pass": Fa3PostGradPass(settings)}
    if not extra_inputs and not guards:
        return compile_fx(gm, example_inputs, config_patches=patches)
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    fakes = [fake_mode.from_tensor(t, static_shapes=True) if fake_mode else t
             for t in extra_inputs]
    inner = compile_fx(gm, list(example_inputs) + fakes, config_patches=patches)
    return _with_extra_inputs(inner, extra_inputs, guards)


def _gave_up(stage: str, exc: Exception, records_from: int) -> None:
    """Our ``stage`` raised on a graph that is now served as written: say so once per distinct
    failure (a warning and the log), and put the reason on the graph's sites for explain()."""
    lines = str(exc).strip().splitlines()
    what = f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"
    outcome = ("its attention runs as written" if stage == "recognition" else
               "stock Inductor compiled it, every attention as written")
    reason = (f"fa3 {stage} failed on this graph ({what}); {outcome}. This is a bug in "
              "fa3_inductor: please report it with TORCH_LOGS=+fa3_inductor")
    recorded = site_records()[0][records_from:]
    for site in recorded:
        if site.rewritten:
            site.rewritten, site.reason = False, reason
    if not recorded:
        record_recognized(RecognizedSite("graph", "(whole graph)", False, reason))
    log.debug("fa3_inductor: %s failed", stage, exc_info=exc)
    key = f"{stage}: {what}"
    if key not in _failures_warned:
        _failures_warned.add(key)
        log.warning("fa3_inductor: %s", reason)
        warnings.warn(f"fa3_inductor: {reason}", RuntimeWarning, stacklevel=2)


_failures_warned: set[str] = set()


def _stock_inductor(mode: Optional[str], inductor_options: dict[str, Any]) -> Any:
    """The compiler ``torch.compile(backend="inductor", mode=mode, options=inductor_options)``
    hands Dynamo: torch's own wrapper, which turns the mode into config patches, checks and
    normalizes the options, and applies what else it applies (the compiler bisector's config,
    the CUPTI settings CUDA graphs need). Its ``config`` is the Inductor config patch dict."""
    return _compat.stock_inductor_compiler(mode, inductor_options)


def has_flex_attention(gm: Any) -> bool:
    """Whether ``gm`` (or any graph nested in it: a checkpointed region, an invoked subgraph)
    calls the flex_attention op, the one op our lowering serves (its backward follows from it).

    Example::

        >>> has_flex_attention(gm)   # doctest: +SKIP
        False
    """
    if not isinstance(gm, torch.fx.GraphModule):
        return True   # not a graph we can read: keep our lowering on
    return any(isinstance(mod, torch.fx.GraphModule) and flex_nodes(mod)
               for mod in gm.modules())


_cudagraphs_used = False


def _note_cudagraphs(patches: dict[str, Any]) -> None:
    global _cudagraphs_used
    from torch._inductor import config

    if patches.get("triton.cudagraphs", config.triton.cudagraphs):
        _cudagraphs_used = True


def _reset() -> None:
    """What ``torch._dynamo.reset()`` calls for ``backend="fa3"`` (torch.compile's wrapper of a
    named backend calls its ``reset``), as it calls the inductor backend's own reset: the CUDA
    graph trees our compiles recorded are dropped with the code that replays them."""
    global _cudagraphs_used
    if _cudagraphs_used:
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        reset_cudagraph_trees()
        _cudagraphs_used = False


fa3_backend.reset = _reset  # type: ignore[attr-defined]


def _with_extra_inputs(inner: Any, extra: list, guards: list) -> Any:
    """The compiled graph takes recognition's constants after the caller's inputs, and first
    checks the module buffers recognition read as constants (recognition/module_state.py)."""
    def run(*args: Any) -> Any:
        for guard in guards:
            guard.check(args[guard.index])
        return inner(*args, *extra)

    return run


def _module_buffers(gm: torch.fx.GraphModule, example_inputs: list) -> dict:
    """Graph inputs that are registered buffers of the compiled module, with their real values:
    what recognition may read as constants (guarded)."""
    out = {}
    placeholders = gm.graph.find_nodes(op="placeholder")
    for index, (node, value) in enumerate(zip(placeholders, example_inputs)):
        source = getattr(node, "_dynamo_source", None)
        if source is None or not isinstance(value, torch.Tensor) or \
                isinstance(value, torch._subclasses.FakeTensor):
            continue
        name = _compat.source_name(source)
        if "._buffers[" in name:
            out[node] = (index, name, value)
    return out


def _own_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule with its own graph: Dynamo keeps using the graph it handed us (it reads
    its placeholders after the backend returns), so recognition must not edit it in place."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # graph_copy leaves the output node to us
    copy = torch.fx.GraphModule(gm, graph)
    copy.meta = dict(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copy._param_name_to_source = gm._param_name_to_source
    for old, new in zip(gm.graph.find_nodes(op="placeholder"),
                        copy.graph.find_nodes(op="placeholder")):
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    return copy


def recognize(gm: torch.fx.GraphModule, example_inputs: Optional[list] = None,
              settings: Optional[Settings] = None) -> tuple[torch.fx.GraphModule, list, list]:
    """Run the recognition passes on a copy of a Dynamo graph; log what they saw. Returns the
    graph to compile, the constant tensors appended to its inputs (empty: ``gm`` itself), and
    the guards on module buffers read as constants (checked before every call).
    ``settings``: the backend's. With FP8 on (options fa3.fp8) the user asked for FP8 attention, so
    every site our kernels serve is rewritten whatever its size (rewrite_pays.py's rules weigh bf16
    speed), and the RoPE applied to each site's q and k is fused into the FP8 prologue where it fits
    (recognition/rope_fusion.py; the site then runs ``fa3_inductor::flex_fwd_fp8_rope``, planned
    with these settings' recipe and template), else noted with the reason.

    Example::

        >>> gm, extra_inputs, guards = recognize(gm, example_inputs)   # doctest: +SKIP
    """
    fp8 = settings is not None and settings.fp8 is not None
    original = gm
    user_calls = flex_call_sites(original)  # flex_attention the user wrote: tagged, kept as is
    before = [site.node for site in user_calls]
    positions = {node.name: i for i, node in enumerate(original.graph.nodes)}
    gm = _own_copy(gm)
    with module_state.constants(_module_buffers(gm, example_inputs or [])) as guards:
        # small CUDA sites stay as written, unless FP8 was asked for
        served = flex_lowering.unserved_reason if fp8 else unless_small(flex_lowering.unserved_reason)
        sites, extra_inputs = rewrite_sdpa(gm, served, keep_plain=not fp8)
        from .recognition.recognize_manual import rewrite_manual
        manual_sites, manual_inputs = rewrite_manual(gm, served)
    sites, extra_inputs = sites + manual_sites, extra_inputs + manual_inputs
    # (every rewriting pass runs above this line: the next one tags the nodes they made)
    tag_rewritten(gm, before, positions, sites)
    # the new mods' mask fills, inside the range of the dtype flex_attention traces them in
    saturate_fills(gm, [node for node in flex_nodes(gm) if node.name not in before])
    # captured tensors the score_mods compare but do not differentiate: no gradient, as in eager
    detached = detach_gradless_buffers(gm)
    fused_rope = False
    if fp8:
        fused_rope = _fuse_rope(gm, user_calls + sites, settings)
    for site in sorted(user_calls + sites, key=lambda s: positions.get(s.node, len(positions))):
        record_recognized(site)
    if not fused_rope and not detached and not any(site.rewritten for site in sites):
        return original, [], []
    return gm, extra_inputs, guards


def _fuse_rope(gm: torch.fx.GraphModule, sites: list, settings: Settings) -> bool:
    """Fuse the RoPE before each flex_attention site into the FP8 prologue where it fits, and
    record on the site what became of it (explain() shows it). Returns whether any was fused."""
    by_id = {site.site_id: site for site in sites if site.site_id is not None}
    fused_any = False
    for node in flex_nodes(gm):
        site = by_id.get(site_tag(node))
        fusion = fuse_rope(gm, node, settings, plan_site)
        if fusion is None:
            continue
        fused_any |= fusion.fused
        if site is not None:
            site.rope, site.rope_fused, site.rope_reason = fusion.rope, fusion.fused, fusion.reason
    if fused_any:
        gm.recompile()
    return fused_any


def ensure_registered() -> None:
    """Make ``backend="fa3"`` resolve even where the package's entry point is not installed
    (a source checkout on PYTHONPATH). Harmless when the entry point already registered it.

    Example::

        >>> ensure_registered(); torch.compile(fn, backend="fa3")   # doctest: +SKIP
    """
    from torch._dynamo.backends.registry import register_backend

    try:
        register_backend(fa3_backend, name="fa3")
    except AssertionError:  # "duplicate name": already registered
        pass
