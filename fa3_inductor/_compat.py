"""Every torch/triton version switch of the package lives here.

The GPU machines run torch 2.11 + triton 3.6, CI runs torch 2.13 (docs/facts.md, "Torch internals
that move between 2.11 and 2.13"). Code elsewhere calls these helpers instead of testing
versions itself.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple, Optional

import torch

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


class FlexBlockMask(NamedTuple):
    """The parts of the flex_attention op's block-mask tuple that the forward kernels read.

    torch 2.11 passes 13 entries, 2.13 passes 17 (backward-only schedules were added); both
    start with (q_len, kv_len, kv_num_blocks, kv_indices, full_kv_num_blocks,
    full_kv_indices) and end with (SPARSE_Q_BLOCK_SIZE, SPARSE_KV_BLOCK_SIZE, mask_graph).
    """

    kv_num_blocks: Any
    kv_indices: Any
    full_kv_num_blocks: Any
    full_kv_indices: Any
    sparse_q_block: Any
    sparse_kv_block: Any
    mask_graph: Any


def unpack_block_mask(block_mask: tuple) -> FlexBlockMask:
    """Read the flex_attention op's block-mask tuple, whatever the torch version.

    Example::

        >>> bm = unpack_block_mask(create_block_mask(causal, 1, 1, 256, 256).as_tuple())  # doctest: +SKIP
    """
    if len(block_mask) not in (13, 17):
        raise RuntimeError(
            f"fa3_inductor: flex_attention block-mask tuple has {len(block_mask)} entries; "
            "this torch version is not supported (expected 13 as in torch 2.11 or 17 as in "
            "2.13). Pin torch 2.11-2.13 or report the version.")
    return FlexBlockMask(*block_mask[2:6], *block_mask[-3:])


@functools.cache
def flex_op_returns_max_scores() -> bool:
    """Whether torch.ops.higher_order.flex_attention returns (out, lse, max_scores)."""
    import importlib

    module = importlib.import_module("torch._higher_order_ops.flex_attention")
    src = inspect.getsource(module.flex_attention_fake_impl)
    return "max_scores" in src


def flex_attention_with_lse(q, k, v, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's flex_attention returning (out, lse) on every supported version."""
    from torch.nn.attention import flex_attention as fa

    if hasattr(fa, "AuxRequest"):
        out, aux = fa.flex_attention(q, k, v, return_aux=fa.AuxRequest(lse=True), **kwargs)
        return out, aux.lse
    return fa.flex_attention(q, k, v, return_lse=True, **kwargs)


def inductor_lowerings() -> dict:
    """Inductor's lowering table, with the flex_attention lowering already registered."""
    import torch._inductor.kernel.flex.flex_attention  # noqa: F401  (registers the lowering)
    from torch._inductor import lowering

    return lowering.lowerings


def wrap_lowering(op, wrapper) -> Optional[Any]:
    """Put ``wrapper`` (marked ``_fa3_wrapper``) in Inductor's lowering table for ``op``.
    Returns the lowering it replaced, or None if ours is already installed (idempotent)."""
    table = inductor_lowerings()
    current = table[op]
    if getattr(current, "_fa3_wrapper", False):
        return None
    table[op] = wrapper
    return current


def fallback_kernel(op) -> Any:
    """A lowering that calls ``op`` as an opaque extern kernel in Inductor's output code."""
    from torch._inductor.lowering import fallback_handler

    return fallback_handler(op, add_to_fallback_set=False)


def current_fx_node():
    """The FX node Inductor is lowering right now (or None)."""
    from torch._inductor.virtualized import V

    try:
        return V.graph.current_node
    except Exception:  # no graph being lowered
        return None


def getitem_as_index():
    """Context in which ``tensor[i]`` with 0-d tensor indices traces as ``aten.index``
    (how FlexAttention traces mods)."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    return TransformGetItemToIndex()


def flex_kernel_options(q, k, v) -> dict:
    """The kernel_options dict torch's flex_attention passes its op (internal keys included)."""
    from torch.nn.attention import flex_attention as fa

    return fa._apply_kernel_options(q, k, v, False, None)


class FlexBackwardArgs(NamedTuple):
    """The arguments of torch.ops.higher_order.flex_attention_backward (as its lowering gets
    them). torch 2.11 and 2.13 pass the same 14, in this order; the block-mask tuple inside
    differs (see :func:`unpack_block_mask`). The op returns (dq, dk, dv, captured_grads) with
    one entry per score_mod buffer (None where no gradient) on both versions.
    """

    query: Any
    key: Any
    value: Any
    out: Any
    logsumexp: Any
    grad_out: Any
    grad_logsumexp: Any
    fw_graph: Any
    joint_graph: Any
    block_mask: Any
    scale: Any
    kernel_options: Any
    score_mod_other_buffers: Any
    mask_mod_other_buffers: Any


def unpack_flex_backward_args(args: tuple, kwargs: dict) -> FlexBackwardArgs:
    """Name the flex_attention_backward op's arguments, whatever the torch version.

    Example::

        >>> a = unpack_flex_backward_args(args, kwargs); a.joint_graph   # doctest: +SKIP
    """
    names = FlexBackwardArgs._fields
    values = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
    if len(values) == len(names) - 2:  # trailing buffer tuples left at their defaults
        values += [(), ()]
    if len(values) != len(names):
        raise RuntimeError(
            f"fa3_inductor: flex_attention_backward got {len(values)} arguments; expected "
            f"{len(names)} (torch 2.11-2.13). Pin torch 2.11-2.13 or report the version.")
    return FlexBackwardArgs(*values)


def joint_graph_results(joint_graph_module: Any) -> list:
    """The flex backward joint graph's returned values: (d score, 4 × None for b/h/q_idx/kv_idx, one entry
    per captured buffer), None where an input gets no gradient.

    Example::

        >>> joint_graph_results(joint_gm)[1:5]   # doctest: +SKIP
        [None, None, None, None]
    """
    output = next(n for n in joint_graph_module.graph.nodes if n.op == "output")
    results = output.args[0]
    return list(results) if isinstance(results, (tuple, list)) else [results]


def joint_graph_buffer_grads(joint_graph_module: Any, n_buffers: int) -> list[bool]:
    """Which score_mod buffers the flex backward's joint graph returns a gradient for.

    The joint graph returns (d score, 4 × None for b/h/q_idx/kv_idx, one entry per captured
    buffer), an entry being None where that buffer needs no gradient.

    Example::

        >>> joint_graph_buffer_grads(joint_gm, 1)   # doctest: +SKIP
        [True]
    """
    results = joint_graph_results(joint_graph_module)
    buffer_results = results[len(results) - n_buffers:] if n_buffers else []
    if len(buffer_results) != n_buffers:
        raise RuntimeError(f"fa3_inductor: flex backward joint graph returns {len(results)} "
                           f"values for {n_buffers} captured buffers; unsupported torch version")
    return [r is not None for r in buffer_results]


def flex_hop_kernel_options(q, k, v, extra: Optional[dict] = None) -> dict:
    """kernel_options for calling the flex_attention op directly in a training graph: like
    :func:`flex_kernel_options`, but asking for the LSE, which the backward reads (torch's
    front door turns it off for CPU tensors, where it has no backward); ``extra`` entries added."""
    options = dict(flex_kernel_options(q, k, v))
    options["OUTPUT_LOGSUMEXP"] = True
    options.update(extra or {})
    return options


def call_flex_hop(q, k, v, score_mod, block_mask, scale, extra_options: Optional[dict] = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Call the flex_attention op the way torch's flex_attention does after its validation;
    returns (out, lse in natural log). For training graphs on devices where torch's front door
    refuses backward (the CPU) but our lowerings serve it. The caller validates the inputs.

    Example::

        >>> out, lse = call_flex_hop(q, k, v, None, None, None)   # doctest: +SKIP
    """
    import math

    out, lse = flex_hop_log2(q, k, v, score_mod, block_mask, scale, extra_options)
    return out, lse * math.log(2.0)


def flex_hop_log2(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: Any, block_mask: Any,
                  scale: Optional[float], extra_options: Optional[dict] = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`call_flex_hop` with the op's own LSE (log2 units), nothing computed after the op (the
    attention sinks' correction is matched right after it: lowering/sinks_fusion.py).

    Example::

        >>> out, lse2 = flex_hop_log2(q, k, v, None, None, None)   # doctest: +SKIP
    """
    import math

    from torch.nn.attention import flex_attention as fa

    if score_mod is None:
        score_mod = fa._identity
    if block_mask is None:
        block_mask = fa._create_empty_block_mask(q, k)
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1))
    if torch.compiler.is_dynamo_compiling():
        for x in (q, k, v):  # head count and head dim specialize kernels, as torch marks them
            torch._dynamo.mark_static(x, -3)
            torch._dynamo.mark_static(x, -1)
    results = torch.ops.higher_order.flex_attention(
        q, k, v, score_mod, block_mask.as_tuple(), scale, flex_hop_kernel_options(q, k, v, extra_options))
    return results[0], results[1]


def source_name(source) -> str:
    """A Dynamo Source's name: a property in torch 2.13, a method in earlier versions."""
    name = source.name
    return name() if callable(name) else name


class CLauncher(NamedTuple):
    """A compiled kernel's C launcher, host TMA descriptors expanded by the caller (c_launcher)."""

    launch: Any                 # the C launch(grid x/y/z, stream, function, coop, pdl, scratch x2, meta, hooks x3, *args)
    cooperative: bool
    pdl: bool
    descriptor_meta: dict       # kernel argument position -> its tensordesc metadata (empty: no descriptors)
    expand: Any                 # (descriptor, metadata) -> the C arguments it stands for (encodes a CUtensorMap)


def c_launcher(kernel) -> Optional[CLauncher]:
    """The C launcher under triton 3.6's CudaLauncher, so that a caller may launch without its Python wrapper
    and encode each host TMA descriptor once per address instead of on every launch. The layout it reads
    (`CudaLauncher.launch`: the C function itself, or `wrap_handle_tensordesc`'s closure over it;
    `make_tensordesc_arg`) is triton 3.6's NVIDIA backend; anything else (another version or backend, a
    kernel with scratch buffers) gives None, and the caller launches through `kernel.run` as usual.

    Example::

        >>> c_launcher(compiled_kernel).descriptor_meta    # doctest: +SKIP
        {0: {'swizzle': 3, ...}, 1: {...}}
    """
    try:
        from triton.backends.nvidia import driver as nv

        run = kernel.run
        if not isinstance(run, nv.CudaLauncher) or run.global_scratch_size or run.profile_scratch_size:
            return None
        inner = run.launch
        if type(inner).__name__ == "builtin_function_or_method":   # no descriptor arguments
            raw, metas, positions = inner, [], []
        else:
            cells = dict(zip(inner.__code__.co_freevars, (c.cell_contents for c in inner.__closure__ or ())))
            raw, indices, metas = cells["launcher"], cells["tensordesc_indices"], cells["tensordesc_meta"]
            positions = sorted(indices)
            if not metas or len(metas) != len(positions) or any(m is None for m in metas):
                return None
        return CLauncher(raw, bool(run.launch_cooperative_grid), bool(run.launch_pdl),
                         dict(zip(positions, metas)), nv.make_tensordesc_arg)
    except (AttributeError, ImportError, KeyError, TypeError, ValueError):
        return None


def launch_hooks_active() -> bool:
    """Whether triton has launch enter / exit hooks that would do something (a profiler's). triton 3.6 keeps
    them as HookChain objects, empty by default, where earlier versions kept None. Called on every
    re-launch: triton's runtime knobs are looked up once.

    Example::

        >>> launch_hooks_active()
        False
    """
    global _runtime_knobs
    if _runtime_knobs is None:
        from triton import knobs

        _runtime_knobs = knobs.runtime
    enter, exit_ = _runtime_knobs.launch_enter_hook, _runtime_knobs.launch_exit_hook
    return bool((enter is not None and getattr(enter, "calls", True))
                or (exit_ is not None and getattr(exit_, "calls", True)))


_runtime_knobs = None


def stock_inductor_compiler(mode: Optional[str], options: Optional[dict]) -> Any:
    """The compiler ``torch.compile(backend="inductor", mode=mode, options=options)`` hands Dynamo:
    torch's private ``_TorchCompileInductorWrapper``, whose ``(mode, options, dynamic)`` constructor,
    ``.config`` (the Inductor config patches) and ``(gm, example_inputs)`` call are the same in 2.11
    and 2.13 (2.13 adds optional ``name`` and ``config_patches``).

    Example::

        >>> stock_inductor_compiler("max-autotune", None).config["max_autotune"]
        True
    """
    return torch._TorchCompileInductorWrapper(mode, options or None, None)
