"""``fa3_inductor.flex_decode``: attention of a few new tokens against a KV cache, contiguous or
paged (the serving layout), with per-sequence lengths that live on the device.

Short queries (GQA group x new tokens <= 128 packed rows) run the split-KV decode kernels
(templates/decode/); longer ones (a prefill chunk reading the cache) gather the pages into a
contiguous cache and run ``fa3_inductor.flex`` with the lengths and positions folded into the mods.
The host never reads a length: a step can be captured in a CUDA graph and replayed while
``seq_lens`` changes in place (tests/test_decode_gpu.py). An FP8 cache (``quantize_kv`` fills one)
is read as FP8 by the kernels, its scales applied to the scores and P (templates/decode/kernel.py).
A repeated kernel call replays its launch without checks or planning (the call memo,
decode_memo.py; :func:`memo_stats` counts it).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from . import decode_memo, direct
from ._log import warn_once
from .block_masks import length_block_mask
from .decode_memo import Launch
from .mod_keys import Unkeyable, layout_key
from .runtime.fast_launch import aliasing, tensor_signature
from .runtime.ops import record_template
from .templates.decode.fp8_cache import dequantize, kv_scale_mode, quantize_kv
from .templates.decode.host import prepare_decode
from .templates.decode.launch_cache import interpreted, launch_decode, recorded_decode
from .templates.decode.shape import MAX_ROWS
from .templates.hopper.cache_sm90 import cache_sm90_refusal, launch_cache_sm90
from .templates.modgen import UnsupportedMod, causal_window_of_source, is_causal_mask_source
from .varlen import generated_mod

_LN2 = math.log(2.0)
_BF16_INTERPRETER = torch.bfloat16   # Triton 3.6's interpreter computes bf16 dots wrongly


def _fail(what: str, fix: str) -> ValueError:
    return ValueError(f"flex_decode: {what}; {fix}")


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(q: Any, k: Any, v: Any, seq_lens: Any, block_table: Any, q_offset: Any,
           num_splits: Any, scratch: Any, mods_: tuple, scales: tuple = (None, None)) -> tuple[int, str]:
    """Check flex_decode's arguments (shapes, dtypes, devices, the table, the lengths, an FP8
    cache's scales) with messages that say what is wrong and what to pass; returns (HKV, the
    scales' granularity: fp8_cache.kv_scale_mode)."""
    for name, t in (("q", q), ("k_cache", k), ("v_cache", v), ("seq_lens", seq_lens)):
        if not isinstance(t, Tensor):
            raise TypeError(f"flex_decode: {name} must be a torch.Tensor, got {type(t).__name__}")
    paged = block_table is not None
    layout = ("[num_pages, page_size, HKV, D] pages (a block_table was given)" if paged
              else "[B, HKV, N, D] (no block_table)")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise _fail(f"q {tuple(q.shape)}, k_cache {tuple(k.shape)}, v_cache {tuple(v.shape)} must "
                    "be 4-D", "pass q as [B, HQ, M_new, D] and the caches as [num_pages, page_size, "
                    "HKV, D] with a block_table, or [B, HKV, N, D] without")
    devices = {t.device for t in (q, k, v, seq_lens)}
    if len(devices) > 1:
        raise _fail(f"q on {q.device}, k_cache on {k.device}, v_cache on {v.device}, seq_lens on "
                    f"{seq_lens.device}", "put q, the caches and seq_lens on one device")
    kv_scale = kv_scale_mode(k, v, *scales, paged)
    if q.dtype not in _DTYPES or (kv_scale == "none" and (k.dtype != q.dtype or v.dtype != q.dtype)):
        raise _fail(f"q, k_cache, v_cache are {q.dtype}, {k.dtype}, {v.dtype}",
                    "pass all three in one of float16, bfloat16 (float32: the slow path), or the "
                    "caches as FP8 with k_scale / v_scale (quantize_kv)")
    B, HQ, _, D = q.shape
    if paged:
        hkv, kv_dims, v_dims = k.shape[2], tuple(k.shape[:3]), tuple(v.shape[:3])
    else:
        hkv, kv_dims, v_dims = k.shape[1], tuple(k.shape[:3]), tuple(v.shape[:3])
        if k.shape[0] != B:
            raise _fail(f"k_cache {tuple(k.shape)} is read as {layout} but its batch is not q's "
                        f"({B})", "pass a block_table for pages, or one cache row per sequence")
    if kv_dims != v_dims:
        raise _fail(f"k_cache {tuple(k.shape)} and v_cache {tuple(v.shape)} differ outside the head "
                    f"dim (both are read as {layout})", "pass caches of one layout and size")
    if k.shape[3] != D:
        raise _fail(f"q's head dim {D} differs from k_cache's {k.shape[3]} ({layout})",
                    "pass q and k_cache with the same head dim")
    if hkv < 1 or HQ % hkv:
        raise _fail(f"q's {HQ} query heads are not a multiple of the {hkv} kv heads of k_cache "
                    f"{tuple(k.shape)} read as {layout}",
                    "pass the caches in that layout (HKV dividing HQ)")
    for name, t in (("q", q), ("k_cache", k), ("v_cache", v)):
        if t.stride(-1) != 1:
            raise _fail(f"{name}'s last dim is not contiguous (strides {t.stride()})",
                        f"pass {name}.contiguous(), or a view whose last stride is 1")
    if paged:
        if not isinstance(block_table, Tensor):
            raise TypeError("flex_decode: block_table must be a torch.Tensor ([B, max_pages] int32) "
                            f"or None, got {type(block_table).__name__}")
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != B \
                or block_table.device != q.device or block_table.stride(-1) != 1:
            raise _fail(f"block_table must be a [B={B}, max_pages] int32 tensor on {q.device} with "
                        f"unit last stride, got {block_table.dtype} {tuple(block_table.shape)} strides "
                        f"{block_table.stride()} on {block_table.device}",
                        "pass block_table.to(device=q.device, dtype=torch.int32).contiguous(); row b "
                        "lists the pages of sequence b in order")
    for name, t in (("seq_lens", seq_lens), ("q_offset", q_offset)):
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"flex_decode: {name} must be a [B] int32 tensor on q's device, got "
                            f"{type(t).__name__}; for one value for every sequence pass "
                            f"torch.full((B,), value, dtype=torch.int32, device=q.device)")
        if t.dtype != torch.int32 or tuple(t.shape) != (B,) or t.device != q.device or t.stride(0) != 1:
            raise _fail(f"{name} must be a contiguous [B={B}] int32 tensor on {q.device}, got "
                        f"{t.dtype} {tuple(t.shape)} on {t.device}",
                        f"pass {name}.to(device=q.device, dtype=torch.int32).contiguous()")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise _fail(f"num_splits={num_splits!r}", "pass a positive int, or None to let the planner choose")
    if scratch is not None and (
            not isinstance(scratch, (tuple, list)) or len(scratch) != 3
            or not all(isinstance(t, Tensor) and t.device == q.device for t in scratch)
            or [t.dtype for t in scratch] != [torch.float32, torch.float32, torch.int32]):
        raise _fail("scratch must be the (O_PART, LSE_PART, ARRIVALS) tensors of "
                    "templates.decode.decode_scratch", "allocate it with decode_scratch(q, HKV, Dv, "
                    "num_splits) and pass the same num_splits")
    for name, fn in zip(("score_mod", "mask_mod"), mods_):
        if fn is not None and not callable(fn):
            raise TypeError(f"flex_decode: {name} must be callable, got {type(fn).__name__}")
    return hkv, kv_scale


def _contiguous_view(q: Tensor, k: Tensor, v: Tensor, block_table: Optional[Tensor],
                     seq_lens: Tensor) -> tuple[Tensor, Tensor]:
    """The cache as [B, HKV, capacity, D], a copy with the slots at or past each sequence's length zeroed: an
    unwritten slot may hold NaN, which a masked score's zero probability does not cancel (0 x NaN is NaN)."""
    B = q.shape[0]

    def gather(pages: Tensor) -> Tensor:
        P, page, H, D = pages.shape
        rows = pages[block_table.long().clamp(0, P - 1)].reshape(B, -1, H, D)   # [B, capacity, H, D]
        keep = torch.arange(rows.shape[1], device=rows.device) < seq_lens[:, None]
        return rows.masked_fill_(~keep[:, :, None, None], 0).transpose(1, 2)

    def zeroed(cache: Tensor) -> Tensor:
        keep = torch.arange(cache.shape[2], device=cache.device) < seq_lens[:, None]
        return cache.masked_fill(~keep[:, None, :, None], 0)

    if block_table is None:
        return zeroed(k), zeroed(v)
    return gather(k), gather(v)


def _flex_mods(score_mod: Optional[Callable], mask_mod: Optional[Callable], seq_lens: Tensor,
               first: Tensor) -> tuple[Optional[Callable], Callable]:
    """FlexAttention mods over the gathered cache: query rows at their absolute positions
    (``first[b] + q_idx``, a negative one at 0 as in the kernels), keys at or past ``seq_lens[b]`` hidden."""
    def score(s, b, h, q_idx, kv_idx):
        return score_mod(s, b, h, (q_idx + first[b]).clamp_min(0), kv_idx)

    def mask(b, h, q_idx, kv_idx):
        keep = kv_idx < seq_lens[b]
        if mask_mod is not None:
            keep = keep & mask_mod(b, h, (q_idx + first[b]).clamp_min(0), kv_idx)
        return keep

    return (score if score_mod is not None else None), mask


def _runs_kernel(q: Tensor) -> bool:
    if q.is_cuda:
        return True
    from triton import knobs

    return q.device.type == "cpu" and bool(knobs.runtime.interpret)


def flex_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, *, seq_lens: Tensor,
                block_table: Optional[Tensor] = None, q_offset: Optional[Tensor] = None,
                score_mod: Optional[Callable] = None, mask_mod: Optional[Callable] = None,
                scale: Optional[float] = None, return_lse: bool = False,
                num_splits: Optional[int] = None,
                scratch: Optional[tuple[Tensor, Tensor, Tensor]] = None,
                k_scale: Optional[Tensor] = None,
                v_scale: Optional[Tensor] = None) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Attention of ``q`` [B, HQ, M_new, D] (the new tokens, already appended to the cache) against
    a KV cache whose batch ``b`` holds ``seq_lens[b]`` keys.

    The cache: ``k_cache`` / ``v_cache`` as pages [num_pages, page_size, HKV, D] (any strides with
    the last one 1; any page size) with ``block_table`` [B, max_pages] int32 (entry ``j`` of row
    ``b`` is the page holding keys ``j*page_size ..``; entries past a sequence's length are never
    read), or contiguous [B, HKV, N, D] without one. ``seq_lens`` [B] int32 on the device: the
    kernels read it, nothing on the host does, so a CUDA graph replays with new lengths (a length
    past the capacity, N or max_pages * page_size, counts as the capacity; a negative one as 0).
    HQ a multiple of HKV (GQA, packed: K/V read once per group).

    Mods are FlexAttention's, ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx,
    kv_idx)``, with ``q_idx`` the token's absolute position in its sequence: ``q_offset[b] + i``
    ([B] int32), by default ``seq_lens[b] - M_new + i`` (a negative position, where a length is
    shorter than the query, counts as 0). Without a mask every cached key is
    visible (pass ``mods.causal`` for causal speculative tokens). Default ``scale`` D ** -0.5.
    Returns the output [B, HQ, M_new, Dv] in q's dtype, plus the natural-log LSE [B, HQ, M_new]
    float32 if ``return_lse`` (-inf, output 0, for rows that see no key).

    FP8 cache: ``k_cache`` / ``v_cache`` in ``torch.float8_e4m3fn`` (or ``float8_e5m2``) with float32
    dequantization scales ``k_scale`` / ``v_scale`` on the device (a key's value is its FP8 value x
    its scale), of one shape for both: 0-d (per tensor), [HKV] (per kv head), [num_pages, HKV] (per
    page, paged) or [B, HKV] (per sequence, contiguous). q stays fp16 / bf16 and the output is in
    q's dtype; the kernels read the FP8 bytes and never read a scale on the host (CUDA graphs
    replay). ``quantize_kv`` makes such a cache.

    Where it runs: GQA group x M_new <= 128 on CUDA (or the CPU under TRITON_INTERPRET=1) runs the
    split-KV decode kernels (``num_splits`` None: chosen to fill the GPU; ``scratch`` from
    ``templates.decode.decode_scratch`` to own every buffer a graph touches). Longer queries
    (prefill chunks) run on an sm90 GPU through the Hopper forward reading the cache in place
    (pages of 16, 32, 64 or a multiple of 128 keys, or the contiguous cache; lengths and
    positions read on the device, so a CUDA graph replays new ones); elsewhere they gather the
    cache into a contiguous copy (its unwritten slots zeroed) and run ``fa3_inductor.flex``, as
    the CPU without the interpreter does (torch's flex_attention).

    Example::

        >>> import torch
        >>> from fa3_inductor import flex_decode, mods
        >>> pages = torch.randn(8, 16, 2, 64)             # 8 pages of 16 keys, 2 kv heads
        >>> table = torch.tensor([[3, 0, 5], [1, 7, 2]], dtype=torch.int32)
        >>> lens = torch.tensor([40, 17], dtype=torch.int32)
        >>> q = torch.randn(2, 8, 1, 64)                   # one new token, 8 query heads
        >>> flex_decode(q, pages, pages, seq_lens=lens, block_table=table).shape
        torch.Size([2, 8, 1, 64])
    """
    tensors = (q, k_cache, v_cache, seq_lens, block_table, q_offset, k_scale, v_scale)
    memo = _memo(tensors, score_mod, mask_mod, scale, num_splits, scratch, return_lse)
    if memo is not None and memo[0] is not None:
        return memo[0] if return_lse else memo[0][0]
    hkv, kv_scale = _check(q, k_cache, v_cache, seq_lens, block_table, q_offset, num_splits, scratch,
                           (score_mod, mask_mod), (k_scale, v_scale))
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"flex_decode: scale must be a number, got {type(scale).__name__}")
    scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise NotImplementedError("flex_decode is inference-only: call it under torch.no_grad() / "
                                  "torch.inference_mode(), or train through fa3_inductor.flex")
    rows = q.shape[1] // hkv * q.shape[2]
    if rows <= MAX_ROWS and _runs_kernel(q):
        try:
            score_fn, score_bufs, score_src = generated_mod(score_mod, "score")
            mask_fn, mask_bufs, mask_src = generated_mod(mask_mod, "mask")
        except UnsupportedMod as exc:
            warn_once(f"flex_decode: a mod cannot be generated for the kernel ({exc}); gathering "
                      "the cache for flex (slow)")
        else:
            out, lse, bind = _kernel(q, k_cache, v_cache, seq_lens, block_table, q_offset, scale,
                                     (score_fn, score_bufs, score_src), (mask_fn, mask_bufs, mask_src),
                                     num_splits, scratch, (k_scale, v_scale))
            if memo is not None:
                decode_memo.remember(memo[1], score_mod, mask_mod, bind)
            return (out, lse.mul_(_LN2)) if return_lse else out
    if kv_scale != "none":   # the paths below read a cache in q's dtype: its real values
        paged = block_table is not None
        k_cache = dequantize(k_cache, k_scale, kv_scale, paged, q.dtype)
        v_cache = dequantize(v_cache, v_scale, kv_scale, paged, q.dtype)
    if rows > MAX_ROWS:
        chunk = _hopper_chunk(q, k_cache, v_cache, seq_lens, block_table, q_offset, score_mod, mask_mod, scale)
        if chunk is not None:
            out, lse, bind = chunk
            if memo is not None and kv_scale == "none":
                decode_memo.remember(memo[1], score_mod, mask_mod, bind)
            return (out, lse.mul_(_LN2)) if return_lse else out
    return _gathered(q, k_cache, v_cache, seq_lens, block_table, q_offset, score_mod, mask_mod,
                     scale, return_lse)


def _memo(tensors: tuple, score_mod: Optional[Callable], mask_mod: Optional[Callable], scale: Any,
          num_splits: Any, scratch: Any, return_lse: bool) -> Optional[tuple]:
    """(a replay's (out, lse: natural-log units if ``return_lse``) or None, the memo key) for a
    call the memo may take (decode_memo.py), else None (the full path, not remembered)."""
    q = tensors[0]
    if type(q) is not Tensor or torch.compiler.is_compiling() or (not q.is_cuda and not _runs_kernel(q)):
        return None
    signature = decode_memo.call_signature(tensors, scratch)
    key = signature and decode_memo.memo_key(score_mod, mask_mod, scale, num_splits, signature)
    if key is None:
        return None
    # a mod made anew per call (mods.softcap(30.0) in a forward) is found by what it computes; a mask's
    # captured tensors without their versions (the kernel reads them at run time)
    hit = direct.replay_either(key, score_mod, mask_mod,
                               lambda key: decode_memo.replay(key, tensors, scratch, return_lse),
                               mask_versions=False)
    return hit, key


def memo_stats() -> dict[str, int]:
    """flex_decode's call memo counters (decode_memo.py): calls remembered, replays (``hits``)
    and replays of a mod made anew (``equal_hits``). ``decode_memo.clear()`` zeroes them.

    Example::

        >>> sorted(memo_stats())
        ['equal_hits', 'hits', 'remembered']
    """
    return dict(decode_memo.counts)


def paged_attention_layout(paged: Any, k_cache: Tensor, v_cache: Tensor,
                           batch_idx: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """torch's experimental ``PagedAttention`` state as :func:`flex_decode`'s arguments, no copy
    of the cache: ``(k_pages, v_pages, block_table)`` with the pages [n_pages, page_size, H, D]
    views of its [1, H, n_pages * page_size, D] caches and the table its ``page_table`` rows
    (``batch_idx``, default all) as int32 (unassigned entries, -1, lie past each sequence's
    length, where the kernels read no page).

    Example::

        >>> from torch.nn.attention.experimental._paged_attention import PagedAttention
        >>> paged = PagedAttention(n_pages=8, page_size=16, max_batch_size=2, device="cpu")
        >>> k_cache = v_cache = torch.zeros(1, 2, 8 * 16, 64)
        >>> k_pages, v_pages, table = paged_attention_layout(paged, k_cache, v_cache)
        >>> k_pages.shape, table.dtype
        (torch.Size([8, 16, 2, 64]), torch.int32)
    """
    def pages(cache: Tensor) -> Tensor:
        if cache.dim() != 4 or cache.shape[0] != 1 or cache.shape[2] != paged.n_pages * paged.page_size:
            raise _fail(f"a PagedAttention cache is [1, H, n_pages * page_size = "
                        f"{paged.n_pages * paged.page_size}, D], got {tuple(cache.shape)}",
                        "pass the k_cache / v_cache the PagedAttention assigns into")
        H, _, D = cache.shape[1:]
        return cache[0].view(H, paged.n_pages, paged.page_size, D).permute(1, 2, 0, 3)

    table = paged.page_table if batch_idx is None else paged.page_table[batch_idx]
    return pages(k_cache), pages(v_cache), table.to(torch.int32)


def _kernel(q, k, v, seq_lens, block_table, q_offset, scale, score, mask, num_splits, scratch,
            scales) -> tuple[Tensor, Tensor, Callable[[], Optional[Launch]]]:
    """(out, lse in log2 units, bind) from the decode kernels; ``scales`` (k_scale, v_scale) of an
    FP8 cache, or Nones. ``bind()``: the call memo's launch of this call (decode_memo.Launch), or
    None when it cannot be replayed."""
    B, HQ, M_new, _ = q.shape
    out = q.new_empty(B, HQ, M_new, v.shape[-1])
    lse = torch.empty(B, HQ, M_new, dtype=torch.float32, device=q.device)
    options = dict(sm_scale=scale, score_mod=score[0], mask_mod=mask[0], score_bufs=score[1],
                   mask_bufs=mask[1], seq_lens=seq_lens, q_offset=q_offset, block_table=block_table,
                   num_splits=num_splits, k_scale=scales[0], v_scale=scales[1],
                   window=causal_window_of_source(mask[2]) or 0)   # a causal window: only its keys are read
    bufs = (*score[1], *mask[1])
    record_template("decode")
    if not q.is_cuda:   # the interpreter: bf16 on float32 copies (an FP8 cache converted in the kernel)
        run = _interpreter_operands(q, k, v, out, scales[0] is not None)
        launches = prepare_decode(*run, lse, scratch=scratch, **options)
        for kernel, args, kwargs, grid in launches:
            kernel[grid](*args, **kwargs)
        if run[3] is not out:
            out.copy_(run[3])
        inputs = (*run, lse, seq_lens, q_offset, block_table, *scales, *bufs)
        return out, lse, lambda: _bound(interpreted(launches, inputs), out, bufs)
    # the scales are inputs: a recording would keep a one-element tensor it does not know as a
    # constant; a tensor given at two places (k_cache is v_cache) is recorded at one: aliasing keyed
    inputs = (q, k, v, out, lse, seq_lens, q_offset, block_table, *scales, *bufs)
    key = ("flex_decode", score[2], mask[2], scale, num_splits, torch.get_float32_matmul_precision(),
           tensor_signature(inputs), aliasing(inputs))
    launch_decode(key, inputs, lambda: prepare_decode(q, k, v, out, lse, scratch=scratch, **options),
                  "decode", scratch)
    return out, lse, lambda: _bound(recorded_decode(key), out, bufs)


def _interpreter_operands(q: Tensor, k: Tensor, v: Tensor, out: Tensor, fp8: bool) -> tuple:
    """(q, k, v, out) as the interpreter computes them: bf16 as float32 copies (Triton 3.6's
    interpreter computes bf16 dots wrongly; an FP8 cache is converted in the kernel)."""
    if q.dtype != _BF16_INTERPRETER:
        return q, k, v, out
    return q.float(), k if fp8 else k.float(), v if fp8 else v.float(), out.float()


def _bound(again: Optional[Callable], out: Tensor, bufs: tuple) -> Optional[Launch]:
    """The call memo's launch (decode_memo.Launch) around ``again(inputs, scratch)`` (a recorded
    or interpreted re-launch, None: nothing to keep) for calls shaped as the one that wrote
    ``out``, with its mods' captured tensors ``bufs`` (None from the launch when one of them has
    changed its layout in place since: the full path generates the mod again)."""
    if again is None:
        return None
    shape, lse_shape = out.shape, out.shape[:3]
    layout = tensor_signature(bufs)
    cuda = out.is_cuda

    def launch(q, k, v, seq_lens, block_table, q_offset, k_scale, v_scale, scratch):
        if bufs and tensor_signature(bufs) != layout:
            return None
        out = q.new_empty(shape)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        run = (q, k, v, out) if cuda else _interpreter_operands(q, k, v, out, k_scale is not None)
        again((*run, lse, seq_lens, q_offset, block_table, k_scale, v_scale, *bufs), scratch)
        if run[3] is not out:
            out.copy_(run[3])
        record_template("decode")
        return out, lse
    return launch


def _hopper_chunk(q, k, v, seq_lens, block_table, q_offset, score_mod, mask_mod,
                  scale) -> Optional[tuple[Tensor, Tensor, Callable[[], Optional[Launch]]]]:
    """(out, lse in log2 units, bind) of a prefill chunk by the Hopper kernel reading the cache in place
    (templates/hopper/cache_sm90.py: no gather, no block mask), or None where it does not serve (not an sm90 GPU,
    pages that do not tile its KV tiles, head dims without tiles, misaligned strides, a mod it cannot generate):
    the gathered path runs then. ``bind()``: the call memo's launch (decode_memo.Launch)."""
    if not q.is_cuda:
        return None
    why_not = cache_sm90_refusal(q, k, v, block_table, torch.cuda.get_device_capability(q.device))
    if why_not is not None:
        warn_once(f"flex_decode: a prefill chunk gathers the cache for flex (a copy a call): {why_not}")
        return None
    try:
        score_fn, score_bufs, _ = generated_mod(score_mod, "score", "gl")
        mask_fn, mask_bufs, mask_src = generated_mod(mask_mod, "mask", "gl")
    except UnsupportedMod as exc:
        warn_once(f"flex_decode: a mod cannot be generated for the Hopper kernel ({exc}); a prefill chunk gathers "
                  "the cache for flex (slow)")
        return None
    options = dict(block_table=block_table, q_offset=q_offset, sm_scale=scale, score_mod=score_fn,
                   mask_mod=mask_fn, causal=mask_src is not None and is_causal_mask_source(mask_src),
                   window=causal_window_of_source(mask_src) or 0, score_bufs=score_bufs, mask_bufs=mask_bufs)
    bufs = (*score_bufs, *mask_bufs)
    layout = tensor_signature(bufs)
    shape = (*q.shape[:3], v.shape[-1])

    def launch(q, k, v, seq_lens, block_table, q_offset, k_scale, v_scale, scratch):
        if bufs and tensor_signature(bufs) != layout:
            return None
        out = q.new_empty(shape)
        lse = torch.empty(shape[:3], dtype=torch.float32, device=q.device)
        launch_cache_sm90(q, k, v, out, lse, seq_lens, **dict(options, block_table=block_table, q_offset=q_offset))
        record_template("hopper_cache")
        return out, lse

    out, lse = launch(q, k, v, seq_lens, block_table, q_offset, None, None, None)
    return out, lse, lambda: launch


def _gathered(q, k, v, seq_lens, block_table, q_offset, score_mod, mask_mod, scale, return_lse):
    """flex over a contiguous copy of the cache, lengths and positions in the mods. Without a mask_mod
    or with an exactly causal one, the block mask is made from the lengths on the device
    (block_masks.length_block_mask); another mask_mod has its block mask built from the mask, anew
    whenever the lengths' tensors change."""
    from .api import flex

    kc, vc = _contiguous_view(q, k, v, block_table, seq_lens)
    first = q_offset if q_offset is not None else seq_lens - q.shape[2]
    score, mask = _flex_mods(score_mod, mask_mod, seq_lens, first)
    gqa = q.shape[1] != kc.shape[1]
    if mask_mod is None or _exactly_causal(mask_mod):
        # made every call from the lengths' device values, never cached by the tensors' identity or version: a
        # CUDA graph or a kernel that rewrites seq_lens in place moves no version, and a kept mask would be stale
        block_mask = length_block_mask(seq_lens, first, q.shape[2], kc.shape[2], mask_mod is not None, mask)
        return flex(q, kc, vc, score_mod=score, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                    return_lse=return_lse)
    return flex(q, kc, vc, score_mod=score, mask_mod=mask, scale=scale, enable_gqa=gqa, return_lse=return_lse)


def _exactly_causal(mask_mod: Callable) -> bool:
    """Whether ``mask_mod`` is exactly ``q_idx >= kv_idx`` (its generated source, cached by what it computes). A
    mask that captures a tensor is not, and is not traced for it (fresh tensors each call would be, every call)."""
    try:
        if layout_key(mask_mod)[1]:
            return False
        return is_causal_mask_source(generated_mod(mask_mod, "mask")[2])
    except (Unkeyable, UnsupportedMod):
        return False
