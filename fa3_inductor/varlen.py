"""``fa3_inductor.flex_varlen``: attention over packed variable-length sequences, no padding."""

from __future__ import annotations

import math
from typing import Any, Callable, Hashable, Optional, Union

import torch
from torch import Tensor

from ._log import info_once, warn_once
from .mod_keys import Unkeyable, mod_key
from .templates.modgen import (MAX_POSITION, BufferSpec, UnsupportedMod, causal_window_of_source,
                               generate_mod_source, is_causal_mask_source, is_constant_true_mask, is_identity_score,
                               load_mod, trace_mod)
from .templates.hopper.varlen_sm90 import launch_varlen_sm90
from .templates.varlen.dense import dense_varlen
from .templates.varlen.host import launch_varlen, pick_varlen_kernel
from .varlen_grad import VarlenAttention, score_derivative, through_document_mask, varlen_grad_refusal

_LN2 = math.log(2.0)
_MAX_MODS = 256
_MODS: dict[Hashable, tuple] = {}


def _fail(message: str) -> ValueError:
    return ValueError(f"flex_varlen: {message}")


def _check_tensors(q: Any, k: Any, v: Any, enable_gqa: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"flex_varlen: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise _fail(f"{name} must be packed 3-D (total_tokens, heads, head_dim), got shape "
                        f"{tuple(t.shape)}; flatten (batch, seq) into one token dim and pass "
                        "cu_seqlens")
    if not (q.device == k.device == v.device):
        raise _fail(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise _fail(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise _fail(f"dtype {q.dtype} is not supported; use float16, bfloat16 or float32")
    if k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
        raise _fail(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in tokens and heads")
    if k.shape[2] != q.shape[2]:
        raise _fail(f"k head dim {k.shape[2]} differs from q head dim {q.shape[2]}")
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv and not enable_gqa:
        raise _fail(f"q has {hq} heads and k/v {hkv}; pass enable_gqa=True for grouped-query "
                    "attention")
    if hkv == 0 or hq % hkv != 0:
        raise _fail(f"q heads ({hq}) must be a positive multiple of k/v heads ({hkv})")
    for what, d in (("q/k head dim", q.shape[2]), ("v head dim", v.shape[2])):
        if not (16 <= d <= 256 and d % 8 == 0):
            raise _fail(f"{what} {d} is not supported; head dims must be multiples of 8 from 16 "
                        "to 256: zero-pad it (padding q/k, pass scale=<unpadded dim> ** -0.5; "
                        "padding v, slice the output back)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1:
            raise _fail(f"{name} must have a unit last stride, got strides {t.stride()}; pass "
                        f"{name}.contiguous()")


def _check_cu_seqlens(cu_q: Any, cu_k: Any, q: Tensor, k: Tensor, max_q: Any, max_k: Any) -> None:
    """Shapes, dtype and device always; the values only on CPU tensors (reading CUDA ones would
    synchronize the stream)."""
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, Tensor):
            raise TypeError(f"flex_varlen: {name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise _fail(f"{name} must be 1-D with B + 1 >= 2 entries (0, then each sequence's end), "
                        f"got shape {tuple(cu.shape)}")
        if cu.dtype != torch.int32:
            raise _fail(f"{name} must be int32, got {cu.dtype}; pass {name}.to(torch.int32)")
        if cu.device != q.device:
            raise _fail(f"{name} is on {cu.device}, q/k/v on {q.device}; move it to {q.device}")
        if cu.stride(0) != 1:
            raise _fail(f"{name} must be contiguous; pass {name}.contiguous()")
    if cu_q.shape[0] != cu_k.shape[0]:
        raise _fail(f"cu_seqlens_q has {cu_q.shape[0]} entries and cu_seqlens_k {cu_k.shape[0]}; "
                    "both are B + 1 for the same B sequences (a sequence may be empty)")
    for name, m in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m < MAX_POSITION:
            raise _fail(f"{name} must be a Python int in [0, {MAX_POSITION}), got {m!r}; pass the "
                        "longest sequence's length (an int, so that no device value is read)")
    if q.device.type != "cpu":
        return
    for name, cu, total, longest in (("q", cu_q, q.shape[0], max_q), ("k", cu_k, k.shape[0], max_k)):
        lengths = cu.diff()
        if int(cu[0]) != 0 or int(cu[-1]) != total:
            raise _fail(f"cu_seqlens_{name} must run from 0 to {name}.shape[0] = {total}, got "
                        f"{int(cu[0])} .. {int(cu[-1])}; build it as "
                        "torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()")
        if bool((lengths < 0).any()):
            raise _fail(f"cu_seqlens_{name} must be non-decreasing, got {cu.tolist()}")
        if int(lengths.max()) > longest:
            raise _fail(f"a sequence has {int(lengths.max())} {name} tokens but max_seqlen_{name} "
                        f"is {longest}; pass the longest length")


def generated_mod(fn: Optional[Callable], kind: str,
                  dialect: str = "tl") -> tuple[Any, tuple, Optional[str]]:
    """(jit function or None, captured buffers, generated source) of a Python mod (``kind``
    "score" or "mask") in ``dialect`` ("tl": Triton kernels, "gl": the Hopper kernel); None for a
    mod that changes nothing (identity score, all-true mask). Cached by what the mod computes
    (mod_keys.py). Raises UnsupportedMod when it cannot be generated. flex_varlen and flex_decode
    use it.

    Example::

        >>> fn, bufs, source = generated_mod(mods.causal, "mask")   # doctest: +SKIP
    """
    if fn is None:
        return None, (), None
    try:
        key: Hashable = (kind, dialect, mod_key(fn))
    except Unkeyable:
        key = (kind, dialect, fn)
    hit = _MODS.get(key)
    if hit is not None:
        return hit[1:]
    gm, bufs = trace_mod(fn, kind)
    if (is_identity_score(gm) if kind == "score" else is_constant_true_mask(gm)):
        result = (None, (), None)
    else:
        source = generate_mod_source(gm, kind, [BufferSpec.of(b) for b in bufs], dialect)
        result = (load_mod(source, dialect), tuple(bufs), str(source))
    if len(_MODS) >= _MAX_MODS:
        _MODS.clear()
    _MODS[key] = (fn, *result)   # the key holds tensor ids: keep the mod (and them) alive
    return result


def _runs_kernel(q: Tensor) -> bool:
    if q.is_cuda:
        return True
    from triton import knobs

    return q.device.type == "cpu" and bool(knobs.runtime.interpret)


# Under torch.compile the call is one graph break, its kernels launched eagerly between the compiled graphs (as
# ring_flex): traced, Dynamo walked its host logic into triton's launcher and broke the graph there.
@torch.compiler.disable
def flex_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                max_seqlen_q: int, max_seqlen_k: int, score_mod: Optional[Callable] = None,
                mask_mod: Optional[Callable] = None, scale: Optional[float] = None,
                enable_gqa: bool = False, return_lse: bool = False,
                kernel: str = "auto") -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Attention over B packed sequences of different lengths, with FlexAttention's mods.

    ``q`` is (total_q, H, D), ``k`` is (total_k, Hkv, D), ``v`` is (total_k, Hkv, Dv): sequence s
    holds query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and key rows
    ``cu_seqlens_k[s]:cu_seqlens_k[s+1]`` (int32 tensors of B + 1 entries on q's device, from 0 to
    total; a sequence may be empty, and its query and key lengths may differ). ``max_seqlen_q`` /
    ``max_seqlen_k`` are Python ints bounding the lengths (the launch grid is sized from them, so
    no device value is read). Tokens attend within their own sequence only; no tile of work
    straddles two sequences.

    ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)`` mean what they
    mean in FlexAttention with ``b`` the sequence index and ``q_idx`` / ``kv_idx`` positions
    within the sequence (so ``mods.causal`` is causal per sequence, top-left aligned when the
    lengths differ, and a row that sees no key gets output 0). A mask_mod that is exactly
    ``q_idx >= kv_idx`` also stops each query tile's work at the diagonal; on sm90 a causal
    sliding window (``mods.sliding_window(W)``, or any mask spelling ``q_idx - W < kv_idx <= q_idx``)
    is walked from its far edge to the diagonal, forward and backward. Default ``scale``
    D ** -0.5; ``enable_gqa`` allows H a multiple of Hkv. Returns the output (total_q, H, Dv) in
    the input dtype, plus the natural-log LSE (H, total_q) float32 if ``return_lse`` (-inf for
    rows that see no key).

    On sm90 GPUs (float16 / bfloat16, the Hopper tile table's head dims: 64, 80, 96, 128, 160,
    192, 256, TMA-aligned strides) it runs the Hopper kernel's packed mode; on other GPUs, and on
    the CPU under Triton's interpreter (TRITON_INTERPRET=1), fa3's Triton varlen kernel.
    ``kernel`` "hopper" / "triton" asks for one of them ("hopper" raises ValueError where it
    cannot run; "auto", the default, picks as said). On CPU tensors otherwise, and for CPU
    inputs that need gradients, it runs a dense torch path (per sequence: float32 scores, the mods
    on broadcast index tensors, softmax, PV), which autograd differentiates. CUDA inputs that need gradients get
    them from the sm90 backward's packed mode (templates/hopper_bwd/varlen.py: the sm90 backward's head dims, 64 to
    256 and 192 / 128, mods whose captured tensors need no gradient); elsewhere from ``fa3_inductor.flex`` over the
    pack as one sequence with a document mask (the same result, slower: tiles that straddle two sequences are
    computed).

    Checks: shapes, dtypes and devices always; the cu_seqlens values (0 first, non-decreasing,
    totals, lengths <= max_seqlen) on CPU tensors only, since reading CUDA ones would synchronize
    the stream. On CUDA, cu_seqlens that break these give undefined output rows.

    Example::

        >>> import torch
        >>> from fa3_inductor import mods
        >>> from fa3_inductor.varlen import flex_varlen
        >>> lengths = torch.tensor([5, 0, 12, 1])
        >>> cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()
        >>> q = torch.randn(18, 4, 64)
        >>> k = v = torch.randn(18, 2, 64)
        >>> out, lse = flex_varlen(q, k, v, cu, cu, 12, 12, mask_mod=mods.causal,
        ...                        enable_gqa=True, return_lse=True)
        >>> out.shape, lse.shape
        (torch.Size([18, 4, 64]), torch.Size([4, 18]))
    """
    _check_tensors(q, k, v, enable_gqa)
    _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k)
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"flex_varlen: {name} must be callable, got {type(fn).__name__}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"flex_varlen: scale must be a number, got {type(scale).__name__}")
    scale = float(scale) if scale is not None else q.shape[2] ** -0.5
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    which = pick_varlen_kernel(q, k, v, kernel, torch.cuda.get_device_capability(q.device)
                               if q.is_cuda else None)
    if (needs_grad and not q.is_cuda) or not _runs_kernel(q):
        return _dense(q, k, v, cu_seqlens_q, cu_seqlens_k, score_mod, mask_mod, scale, return_lse)
    dialect = "gl" if which == "hopper" else "tl"
    try:
        score_fn, score_bufs, _ = generated_mod(score_mod, "score", dialect)
        mask_fn, mask_bufs, mask_source = generated_mod(mask_mod, "mask", dialect)
    except UnsupportedMod as exc:
        if needs_grad:
            return _through_document_mask(q, k, v, cu_seqlens_q, cu_seqlens_k, score_mod, mask_mod, scale,
                                          return_lse, f"a mod cannot be generated for the kernels ({exc})")
        warn_once(f"flex_varlen: a mod cannot be generated for the kernel ({exc}); running the "
                  "dense torch path per sequence (slow)")
        return _dense(q, k, v, cu_seqlens_q, cu_seqlens_k, score_mod, mask_mod, scale, return_lse)
    for buf in (*score_bufs, *mask_bufs):
        if buf.device != q.device:
            raise _fail(f"a mod captures a tensor on {buf.device}, q/k/v are on {q.device}; "
                        f"create it on {q.device}")
    causal = is_causal_mask_source(mask_source)
    launch = launch_varlen_sm90 if which == "hopper" else launch_varlen
    # the Hopper forward and the sm90 backward walk a causal window from its far edge (the Triton kernel applies it
    # on every tile)
    window = causal_window_of_source(mask_source) or 0
    walk = dict(window=window) if which == "hopper" else {}

    def run_forward(out: Tensor, lse: Tensor) -> None:
        with torch.no_grad():
            launch(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, sm_scale=scale,
                   score_mod=score_fn, mask_mod=mask_fn, causal=causal, score_bufs=score_bufs,
                   mask_bufs=mask_bufs, **walk)

    if needs_grad:   # (the Hopper forward's mods are the backward's dialect already)
        gl_mods = (score_fn, score_bufs, mask_fn, mask_bufs) if dialect == "gl" else None
        return _with_gradients(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, score_mod,
                               mask_mod, causal, run_forward, return_lse, gl_mods, window)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    lse = torch.empty(q.shape[1], q.shape[0], device=q.device, dtype=torch.float32)
    run_forward(out, lse)
    return (out, lse.mul_(_LN2)) if return_lse else out


def _with_gradients(q, k, v, cu_q, cu_k, scale, score_mod, mask_mod, causal, run_forward,
                    return_lse, gl_mods=None, window=0):
    """flex_varlen through varlen_grad.VarlenAttention: the forward as given, the sm90 packed backward; where that
    does not serve, the document-mask path. ``gl_mods``: (score_fn, score_bufs, mask_fn, mask_bufs) already generated
    in the backward's dialect, or None; ``window``: the mask_mod's causal window (keys), 0 when it is none."""
    if gl_mods is None:
        try:
            score_fn, score_bufs, _ = generated_mod(score_mod, "score", "gl")
            mask_fn, mask_bufs, _ = generated_mod(mask_mod, "mask", "gl")
        except UnsupportedMod as exc:
            return _through_document_mask(q, k, v, cu_q, cu_k, score_mod, mask_mod, scale, return_lse,
                                          f"a mod cannot be generated for the packed backward ({exc})")
    else:
        score_fn, score_bufs, mask_fn, mask_bufs = gl_mods
    why_not = varlen_grad_refusal(q, k, v, score_bufs, mask_bufs)
    if why_not is not None:
        return _through_document_mask(q, k, v, cu_q, cu_k, score_mod, mask_mod, scale, return_lse, why_not)
    mods = dict(score_mod=score_fn, score_grad_mod=score_derivative(score_mod) if score_fn is not None else None,
                mask_mod=mask_fn, causal=causal, window=window, score_bufs=score_bufs, mask_bufs=mask_bufs)
    out, lse = VarlenAttention.apply(q, k, v, cu_q, cu_k, scale, run_forward, mods)
    return (out, lse) if return_lse else out


def _through_document_mask(q, k, v, cu_q, cu_k, score_mod, mask_mod, scale, return_lse, why):
    """flex_varlen with gradients on CUDA where the packed backward does not serve (``why``): varlen_grad's
    document-mask path, said once."""
    info_once(f"flex_varlen: {why}; its gradients come from fa3_inductor.flex over the pack with a document mask "
              "(tiles that straddle two sequences are computed and masked)")
    out, lse = through_document_mask(q, k, v, cu_q, cu_k, score_mod, mask_mod, scale, q.shape[1] != k.shape[1])
    return (out, lse) if return_lse else out


def _dense(q, k, v, cu_q, cu_k, score_mod, mask_mod, scale, return_lse):
    """flex_varlen on the dense torch path (its docstring)."""
    out, lse = dense_varlen(q, k, v, cu_q.tolist(), cu_k.tolist(), score_mod, mask_mod, scale)
    return (out, lse) if return_lse else out
