"""``fa3_inductor.flex``: the direct front door, a drop-in for FlexAttention's function."""

from __future__ import annotations

import functools
import itertools
import types
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from . import _compat, direct, direct_fp8
from .flex_sinks import flex_with_sinks
from ._log import info_once
from .backend import fa3_backend
from .block_masks import build_block_mask, cached_block_mask
from .config import templates
from .fp8_recipe import FP8Recipe, RopeSpec
from .lowering import registration
from .lowering.common import FRONT_DOOR_OPTION, front_door_tag
from .mod_keys import Unkeyable, layout_key
from .runtime.ops import last_template, record_template
from .runtime.sinks import check_sinks
from .templates.decode.fp8_cache import FP8_DTYPES as _FP8_DTYPES

_MAX_COMPILED = 64


def _check_inputs(q: Any, k: Any, v: Any, score_mod: Any, mask_mod: Any, block_mask: Any,
                  scale: Any, enable_gqa: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"flex: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"flex: {name} must be 4-D (batch, heads, seq, head_dim), "
                             f"got shape {tuple(t.shape)}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"flex: q, k, v must be on one device, got {q.device}, {k.device}, "
                         f"{v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        fp8_cache = k.dtype in _FP8_DTYPES or v.dtype in _FP8_DTYPES
        raise ValueError(f"flex: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
                         + ("; for an FP8 KV cache call fa3_inductor.flex_decode(q, k_cache, v_cache, "
                            "seq_lens=..., k_scale=..., v_scale=...); for FP8 attention on bf16 / fp16 "
                            "inputs pass them unquantized with fp8=True" if fp8_cache else
                            "; cast them to one of float16, bfloat16, float32"))
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"flex: dtype {q.dtype} is not supported; use float16, bfloat16 or "
                         "float32")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"flex: k head dim {k.shape[-1]} differs from q head dim {q.shape[-1]}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"flex: k {tuple(k.shape)} and v {tuple(v.shape)} must agree in batch, "
                         "heads and sequence length")
    if k.shape[0] not in (q.shape[0], 1):
        raise ValueError(f"flex: batch of k/v ({k.shape[0]}) must equal q's ({q.shape[0]}) or 1")
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        if not enable_gqa:
            raise ValueError(f"flex: q has {hq} heads and k/v {hkv}; pass enable_gqa=True for "
                             "grouped-query attention")
        if hq % hkv != 0:
            raise ValueError(f"flex: q heads ({hq}) must be a multiple of k/v heads ({hkv})")
    for what, d in (("q/k head dim", q.shape[-1]), ("v head dim", v.shape[-1])):
        if not (16 <= d <= 256 and d % 8 == 0):
            raise ValueError(
                f"flex: {what} {d} is not supported (q {tuple(q.shape)}, v {tuple(v.shape)}); "
                "fa3 serves head dims that are multiples of 8 from 16 to 256 (64, 80, 96, 128, "
                "192, 256 are the common ones; v's may differ from q's, e.g. q/k 192 with v "
                "128): zero-pad that dim to the next multiple of 8 (at least 16); padding q/k, "
                "pass scale=<unpadded dim> ** -0.5; padding v, slice the output back")
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"flex: {name} must be callable, got {type(fn).__name__}")
    if mask_mod is not None and block_mask is not None:
        raise ValueError("flex: give mask_mod or block_mask, not both (a block_mask already "
                         "carries its mask_mod)")
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise TypeError(f"flex: block_mask must be a BlockMask (from create_block_mask), got "
                        f"{type(block_mask).__name__}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"flex: scale must be a number, got {type(scale).__name__}")


def _check_mask_captures(mask_fn: Optional[Callable]) -> None:
    """A mask_mod that captures a tensor requiring grad: torch's flex autograd refuses it deep inside a compile
    (an AssertionError wrapped in a Dynamo traceback). A mask is boolean, it has no gradient to give: say so here."""
    if mask_fn is None or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return   # (inside a compile Dynamo traces the mod's captures itself; this walk would graph-break)
    try:
        _, captured = layout_key(mask_fn)
    except Unkeyable:   # a capture the walk cannot read: torch's own check still applies
        return
    learnable = [t for t in captured if t.requires_grad]
    if learnable:
        shapes = ", ".join(str(tuple(t.shape)) for t in learnable)
        raise ValueError(f"flex: the mask_mod captures {len(learnable)} tensor(s) that require grad (shapes {shapes}); "
                         "a mask has no gradient, and torch's flex attention refuses such captures in training. "
                         "Read them detached in the mask_mod (x = bias.detach(), then use x), or build the mask "
                         "under torch.no_grad() with create_block_mask and pass block_mask=")


def _block_mask_of(mask_mod: Callable, q: Tensor, k: Tensor) -> BlockMask:
    if torch.compiler.is_compiling():  # an enclosing compile traces the build into its graph
        return build_block_mask(mask_mod, q, k)
    return cached_block_mask(mask_mod, q, k)


def _flex_call(q, k, v, score_mod, block_mask, scale, enable_gqa, return_lse, direct_op=False,
               sinks=None, template="auto"):
    # Our lowering serves the op under any Inductor compile, not only backend="fa3": an enclosing
    # torch.compile(model) (transformers' generate() compiles its decode step with "inductor").
    options = {FRONT_DOOR_OPTION: _front_door_tag(template)}
    if sinks is not None:   # flex_attention's op has no sinks argument: an exact correction follows
        return flex_with_sinks(q, k, v, score_mod, block_mask, scale, enable_gqa, sinks, return_lse,
                               kernel_options=options)
    if direct_op:  # CPU training: torch's front door refuses it, our lowerings serve it
        out, lse = _compat.call_flex_hop(q, k, v, score_mod, block_mask, scale, options)
        return (out, lse) if return_lse else out
    if return_lse:
        return _compat.flex_attention_with_lse(q, k, v, score_mod=score_mod,
                                               block_mask=block_mask, scale=scale,
                                               enable_gqa=enable_gqa, kernel_options=options)
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                          enable_gqa=enable_gqa, kernel_options=options)


@torch.compiler.assume_constant_result
def _front_door_tag(template: str) -> str:
    # Dynamo runs this once while tracing (a constant result), which installs our lowerings in
    # Inductor's table before the graph is lowered, whichever backend compiles it.
    registration.install()
    return front_door_tag(template)


@functools.lru_cache(maxsize=_MAX_COMPILED)
def _compiled_for(score_code: Any, mask_code: Any, template: str, shapes: tuple) -> Callable:
    """One static-shape compiled callable per (mods, template, shapes).

    Static shapes: the kernels specialize on them and guards are cheaper.
    Dynamo keeps compiled variants per code object and stops recompiling after a limit (then
    runs eager), so each key gets its own copy of _flex_call's code; the LRU bounds them.
    """
    code = _flex_call.__code__.replace(co_name=f"_flex_call_{next(_compiled_count)}")
    fn = types.FunctionType(code, _flex_call.__globals__, code.co_name)
    return torch.compile(fn, backend=fa3_backend, fullgraph=True, dynamic=False,
                         options={"fa3.template": template})


_compiled_count = itertools.count()


def _code_of(fn: Optional[Callable]) -> Any:
    return getattr(fn, "__code__", None) if fn is not None else None


def _needs_grad(q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor] = None) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or
                                        (sinks is not None and sinks.requires_grad))


def _cpu_training(q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor] = None) -> bool:
    """Whether this call needs a backward on the CPU (torch's FlexAttention has none)."""
    return q.device.type == "cpu" and _needs_grad(q, k, v, sinks)


def _check_block_mask_fits(block_mask: Optional[BlockMask], q: Tensor, k: Tensor) -> None:
    """The length and device checks torch's flex_attention makes on a BlockMask (the direct-op
    path for CPU training skips torch's front door, not its validation)."""
    if block_mask is None:
        return
    if block_mask.kv_num_blocks.device != q.device:
        raise ValueError(f"flex: block_mask is on {block_mask.kv_num_blocks.device}, q/k/v on "
                         f"{q.device}; build the block mask on the inputs' device")
    large = 1 << 30  # torch's "no mask" block size
    if tuple(block_mask.BLOCK_SIZE) == (large, large):
        return
    mq, mkv = block_mask.shape[-2], block_mask.shape[-1]
    if (q.shape[2], k.shape[2]) != (mq, mkv):
        raise ValueError(f"flex: block_mask was built for q_len={mq}, kv_len={mkv} but got "
                         f"q_len={q.shape[2]}, kv_len={k.shape[2]}; build it for these lengths "
                         "(create_block_mask) or adjust it with block_mask._adjust(q_len, kv_len)")


_CPU_BACKWARD_HELP = (
    "fa3_inductor.flex: backward on CPU tensors needs fa3's kernels, which run on the CPU only "
    "under Triton's interpreter (torch's FlexAttention has no CPU backward). Set "
    "TRITON_INTERPRET=1 before importing triton/torch, move the tensors to a CUDA device, or "
    "run without gradients (torch.no_grad(), or inputs with requires_grad=False).")


@torch.compiler.assume_constant_result  # Dynamo cannot trace triton's getenv: ask, don't trace
def _triton_interpreting() -> bool:
    from triton import knobs

    return bool(knobs.runtime.interpret)


# CPU inference calls take the compiled path (it checks our lowering in CI). Tests that check the
# direct path's host work on the CPU set this (tests/test_prefill_host_path.py).
DIRECT_ON_CPU = False


def _takes_direct_path(q: Tensor) -> bool:
    """Whether an inference call on ``q``'s device is planned once and then served by our op
    directly (direct.py): CUDA, or the CPU under the interpreter while ``DIRECT_ON_CPU`` is set."""
    return q.is_cuda or (DIRECT_ON_CPU and q.device.type == "cpu" and _triton_interpreting())


def _runs_our_kernels(q: Tensor) -> bool:
    if q.is_cuda:
        return True
    if q.device.type == "cpu":
        return _triton_interpreting()
    return False


def flex(q: Tensor, k: Tensor, v: Tensor, score_mod: Optional[Callable] = None,
         mask_mod: Optional[Callable] = None, block_mask: Optional[BlockMask] = None,
         scale: Optional[float] = None, enable_gqa: bool = False,
         return_lse: bool = False, template: str = "auto", fp8: Union[bool, FP8Recipe, None] = None,
         rope: Optional[RopeSpec] = None, sinks: Optional[Tensor] = None
         ) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Attention with FlexAttention's semantics, served by fa3_inductor's kernels.

    ``q`` is (B, H, M, D), ``k`` is (B, Hkv, N, D), ``v`` is (B, Hkv, N, Dv). Dv may differ
    from D (DeepSeek-V2/V3's multi-head latent attention trains with D 192, Dv 128); both are
    multiples of 8 from 16 to 256. ``score_mod(score, b, h, q_idx, kv_idx)`` edits scores,
    ``mask_mod(b, h, q_idx, kv_idx)`` hides them (its block mask is built on the first call and
    reused while the mask computes the same thing: block_masks.py; or pass ``block_mask`` from
    ``create_block_mask``). The default ``scale``
    is D ** -0.5. Returns the output (B, H, M, Dv), plus the natural-log LSE (B, H, M) if
    ``return_lse``.
    Gradients flow to q, k, v and to tensors the mods capture. ``template`` (fa3 only):
    "auto" picks the best kernel family, "hopper" / "generic" force one (a site it cannot
    serve falls back, see ``last_template()``), "torch" runs torch's own kernel.

    On CUDA the call is compiled with the fa3 backend (first call per mod compiles). On the
    CPU it runs torch's own implementation, unless TRITON_INTERPRET=1 is set, in which case
    our generic kernel runs under Triton's interpreter (how CI checks kernel numerics), and
    backward runs too (our generic backward under the interpreter, or a dense float64 recompute
    for a site it does not serve; torch's FlexAttention has no CPU backward). On CUDA the
    backward is one of our backward families (the generic Triton backward), or torch's flex
    backward kernel for a site none serves (``lowered_backward_sites()`` says which and why).
    CPU inputs that need gradients without the interpreter raise NotImplementedError saying
    what to do.

    ``fp8=True`` (or an :class:`FP8Recipe`) runs FP8 attention for inference: one prologue pass
    applies ``rope`` (a :class:`RopeSpec`, optional: q and k given before RoPE), rotates q and k by
    a random-sign Hadamard matrix and quantizes q and k to int8 (``FP8Recipe(qk="e4m3")``: e4m3) and
    v to e4m3, with one scale per kernel tile; the FP8 kernel then computes on them (docs/fp8.md). Inference only: inputs that need gradients
    raise. ``rope`` needs ``fp8``.

    ``sinks`` (gpt-oss's attention sinks): a float tensor of shape (H,), one logit per query head,
    that joins every row's softmax denominator: out = Σ_j exp(s_j - LSE) v_j with
    LSE = log(Σ_j exp(s_j) + exp(sinks[h])); the returned LSE includes it, and a row that sees no key
    gets out 0 and LSE = sinks[h]. It may require grad (d sinks[h] = -Σ exp(sinks[h] - LSE) ·
    rowsum(dO·O) over batch and rows). Our kernels add it in their epilogue (docs/design/sinks.md).

    Example::

        >>> from fa3_inductor import flex, mods
        >>> q = k = v = torch.randn(1, 4, 256, 64)
        >>> out = flex(q, k, v, score_mod=mods.softcap(30.0), mask_mod=mods.causal)
        >>> out.shape
        torch.Size([1, 4, 256, 64])
        >>> q, k = torch.randn(1, 8, 256, 192), torch.randn(1, 2, 256, 192)  # MLA, GQA
        >>> v = torch.randn(1, 2, 256, 128)
        >>> flex(q, k, v, mask_mod=mods.causal, enable_gqa=True).shape
        torch.Size([1, 8, 256, 128])
        >>> flex(q, k, v, enable_gqa=True, sinks=torch.zeros(8)).shape   # gpt-oss's sinks
        torch.Size([1, 8, 256, 128])
    """
    if fp8 is not None or rope is not None:
        recipe = FP8Recipe.of(fp8)
        if sinks is not None and recipe is not None:
            raise NotImplementedError("flex(fp8=..., sinks=...): the FP8 kernels do not add sinks; "
                                      "drop fp8= for a site with attention sinks")
        if recipe is not None or rope is not None:
            return _flex_fp8(q, k, v, score_mod, mask_mod, block_mask, scale, enable_gqa, return_lse,
                             template, recipe, rope)
    memo = None
    if (type(q) is Tensor and _takes_direct_path(q) and sinks is None
            and not torch.compiler.is_compiling()):
        # A repeat of an earlier served call re-launches its kernel at once (direct.py, "call memo").
        memo = direct.memo_key(score_mod, mask_mod, block_mask, scale, enable_gqa, template)
        # a mod made anew per call (mods.softcap(30.0) in a forward) is found by what it computes
        hit = direct.replay_either(memo, score_mod, mask_mod,
                                   lambda key: direct.replay(key, q, k, v, return_lse))
        if hit is not None:
            return hit if return_lse else hit[0]
    _check_inputs(q, k, v, score_mod, mask_mod, block_mask, scale, enable_gqa)
    _check_mask_captures(mask_mod if block_mask is None else block_mask.mask_mod)
    if sinks is not None:
        check_sinks(sinks, q.shape[1], "flex", q.device)
    if template not in templates():
        raise ValueError(f"flex: template must be one of {templates()}, got {template!r}")
    # the memo keeps the caller's block mask (weakly), never a cached one built from mask_mod: that
    # one outlives the entry, and a finalizer on it per remembered call would pile up (direct.py)
    memo = memo and (memo, score_mod, mask_mod, block_mask)
    if mask_mod is not None:
        block_mask = _block_mask_of(mask_mod, q, k)
    _check_block_mask_fits(block_mask, q, k)
    training_on_cpu = _cpu_training(q, k, v, sinks)
    if training_on_cpu and not _runs_our_kernels(q):
        raise NotImplementedError(_CPU_BACKWARD_HELP)
    if q.device.type == "cpu" and not torch.is_grad_enabled():
        # Nothing is recorded without grad mode; torch's CPU check refuses inputs that merely
        # carry requires_grad, so hand it detached views.
        q, k, v = q.detach(), k.detach(), v.detach()
    args = (q, k, v, score_mod, block_mask, scale, enable_gqa, return_lse, training_on_cpu, sinks,
            template)
    if torch.compiler.is_compiling():
        return _flex_call(*args)  # an enclosing torch.compile captures the op itself
    if not _runs_our_kernels(q):
        info_once(f"fa3_inductor.flex: {q.device.type} tensors run torch's own flex_attention "
                  "(fa3 kernels need CUDA, or TRITON_INTERPRET=1 on the CPU)")
        record_template("torch")
        return _flex_call(*args)
    if _takes_direct_path(q) and template != "torch" and not _needs_grad(q, k, v, sinks):
        # Inference: plan once, then call our op directly (no Dynamo/AOT/Inductor per call).
        served = direct.forward(q, k, v, score_mod, block_mask,
                                scale if scale is not None else q.shape[-1] ** -0.5, template,
                                memo=memo, sinks=sinks)
        if served is not None:
            return served if return_lse else served[0]
    mask_fn = block_mask.mask_mod if block_mask is not None else None
    shapes = (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device,
              q.requires_grad, sinks is not None)
    compiled = _compiled_for(_code_of(score_mod), _code_of(mask_fn), template, shapes)
    record_template(None)
    result = compiled(*args)
    if last_template() is None:  # the lowering handed this site to torch's kernel
        record_template("torch")
    return result


def _flex_fp8(q, k, v, score_mod, mask_mod, block_mask, scale, enable_gqa, return_lse, template,
              recipe: Optional[FP8Recipe], rope: Optional[RopeSpec]):
    """flex() with fp8= (its docstring): checks, then direct_fp8.forward_fp8."""
    if recipe is None:
        raise ValueError("flex: rope= is applied by the FP8 prologue; pass fp8=True with it, or "
                         "apply RoPE to q and k yourself")
    memo = None
    if template == "auto" and not torch.compiler.is_compiling():
        # A repeat of an earlier served call re-binds its prologue and re-launches its kernel at once
        # (direct_fp8.py, as direct.py's call memo; the checks below held for the remembered call)
        memo = direct_fp8.memo_key(score_mod, mask_mod, block_mask, scale, enable_gqa, recipe)
        hit = direct.replay_either(memo, score_mod, mask_mod,
                                   lambda key: direct_fp8.replay(key, q, k, v, rope, return_lse))
        if hit is not None:
            return hit if return_lse else hit[0]
    _check_inputs(q, k, v, score_mod, mask_mod, block_mask, scale, enable_gqa)
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"flex(fp8=...): inputs must be bfloat16 or float16 (got {q.dtype}); the "
                         "prologue quantizes them to e4m3")
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            "flex(fp8=...) inside torch.compile is not supported: compile the model with "
            "backend='fa3', options={'fa3.fp8': True} instead (inference graphs)")
    if _needs_grad(q, k, v):
        raise NotImplementedError(
            "flex(fp8=...) is inference-only: backward through an FP8 forward is not supported. "
            "Call it under torch.no_grad() / torch.inference_mode() with inputs that need no "
            "gradient, or drop fp8= to train (the bf16/fp16 kernels have a backward)")
    if template != "auto":
        raise ValueError(f"flex(fp8=...): template must be 'auto' (got {template!r}); FP8 sites are "
                         "served by the FP8 kernel families in the registry's order")
    recipe.check_score_mod(score_mod, "flex")
    if not (q.is_cuda or (q.device.type == "cpu" and _triton_interpreting())):
        raise NotImplementedError(f"flex(fp8=...): {q.device.type} tensors; FP8 runs on CUDA GPUs "
                                  "with e4m3 tensor cores (sm89+), or on the CPU under "
                                  "TRITON_INTERPRET=1")
    memo = memo and (memo, score_mod, mask_mod, block_mask)   # the caller's block mask (flex())
    if mask_mod is not None:
        block_mask = _block_mask_of(mask_mod, q, k)
    _check_block_mask_fits(block_mask, q, k)
    with torch.no_grad():
        out, lse = direct_fp8.forward_fp8(q, k, v, score_mod, block_mask,
                                          scale if scale is not None else q.shape[-1] ** -0.5,
                                          recipe, rope, want_lse=return_lse, memo=memo)
    return (out, lse) if return_lse else out
