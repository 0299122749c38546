"""Block masks built once per mask, not once per call.

``flex(q, k, v, mask_mod=causal)`` needs a BlockMask. Building one (``create_block_mask``)
evaluates the mask over every (q, kv) position: 2.6 ms at 4k on an H100, more than the attention
kernel itself, and the README's first example paid it on every call (41 TFLOP/s against 556 with
a prebuilt mask, issue 16). Here a mask is built once per (what the mask computes, the batch and
head counts it reads, lengths, device) and reused:

- what the mask computes is :func:`fa3_inductor.mod_keys.mod_key` with tensor versions: a fresh
  ``mods.causal`` or ``mods.document(ids)`` closure hits, editing ``ids`` in place (its version
  counter moves) or passing another tensor rebuilds;
- the batch / head dimensions enter the key only when the mask reads ``b`` / ``h`` (a mask that
  ignores them is built once for all heads, as torch's own examples do with ``None, None``);
- a mask whose key cannot be read (a callable object, a ``functools.partial``) is rebuilt on
  every call, and the log says so once: its captured state is invisible, so a cached mask could
  go stale silently;
- the cache holds at most ``MAX_MASKS`` masks, least recently used first out. Each entry keeps
  its mask_mod (and so its captured tensors) alive, which keeps the tensor ids in its key unique;
- a build evaluates a mask that modgen generates (elementwise: what the kernels evaluate on tiles)
  in one call on broadcast index tensors; torch's ``create_block_mask`` evaluates it position by
  position under vmap. A flex() call with new document ids went from 14.2 to 5.6 ms at 4k on an
  H200 (`block-mask-build-nvidia-h200-2026-11-30-1445.log`), which a training step with per-batch
  packed documents pays once a step. Other masks go through torch's builder.

Example::

    >>> bm = cached_block_mask(mods.causal, q, k)           # doctest: +SKIP
    >>> cached_block_mask(mods.causal, q, k) is bm          # doctest: +SKIP
    True
"""

from __future__ import annotations

import collections
import dis
import types
from typing import Callable, Hashable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask

from ._log import info_once, warn_once
from .mod_keys import Unkeyable, layout_key, mod_key
from .templates.modgen import BufferSpec, generate_mod_source, trace_mod

MAX_MASKS = 32
BLOCK = 128                    # torch's default sparse block size, as flex() builds masks
# Mask entries evaluated at once. torch's eager create_block_mask evaluates the whole B x H x M x N
# grid and pads a copy (2 bytes an entry: 32 GiB at 128k x 128k); larger masks are built
# MAX_ELEMENTS entries at a time (chunked_block_mask), 256 MiB (twice that with the pad).
MAX_ELEMENTS = 1 << 28
_MASKS: collections.OrderedDict[Hashable, BlockMask] = collections.OrderedDict()
_FACTS: dict[Hashable, tuple[bool, bool, bool]] = {}   # mask layout key -> _mask_facts (reads b, h; elementwise)
_stats = {"built": 0, "reused": 0}


def cached_block_mask(mask_mod: Callable, q: Tensor, k: Tensor) -> BlockMask:
    """The BlockMask of ``mask_mod`` for queries ``q`` (B, H, M, D) and keys ``k`` (.., N, D).

    Example::

        >>> from fa3_inductor import mods
        >>> q = k = torch.randn(1, 4, 256, 64)
        >>> cached_block_mask(mods.causal, q, k).shape
        (1, 1, 256, 256)
    """
    try:
        what = mod_key(mask_mod, versions=True)
    except Unkeyable as exc:
        info_once(f"fa3_inductor.flex: the mask_mod {mask_mod!r} cannot be keyed ({exc}); its "
                  "block mask is rebuilt on every call. Write it as a plain function, or build "
                  "it once with create_block_mask and pass block_mask=")
        return build_block_mask(mask_mod, q, k)
    # whether it reads b / h follows from its code, not from its tensors' identities or contents: keyed by
    # layout, a mask over fresh tensors each call is not traced again (~8-11 ms, flex_decode's prefill chunks)
    try:
        shape_key = layout_key(mask_mod)[0]
    except Unkeyable:
        shape_key = what
    facts = _FACTS.get(shape_key)
    if facts is None:
        facts = _FACTS[shape_key] = _mask_facts(mask_mod)
        if len(_FACTS) > 4 * MAX_MASKS:
            _FACTS.clear()
    key = (what, q.shape[0] if facts[0] else None, q.shape[1] if facts[1] else None,
           q.shape[2], k.shape[2], q.device)
    mask = _MASKS.get(key)
    if mask is not None:
        _MASKS.move_to_end(key)
        _stats["reused"] += 1
        if _capturing() and _captures_tensors(mask_mod):
            warn_once(_CAPTURED_MASK)
        return mask
    mask = _MASKS[key] = _build(mask_mod, facts, q, k)
    if len(_MASKS) > MAX_MASKS:
        _MASKS.popitem(last=False)
    return mask


_CAPTURED_MASK = (
    "fa3_inductor.flex: a CUDA graph is capturing a call whose mask_mod reads captured tensors, and its block mask "
    "comes from the cache, built from their values before the capture: replays will not rebuild it. If the graph's "
    "replays change those tensors, pass block_mask= built inside the captured step "
    "(fa3_inductor.block_masks.build_block_mask), or capture with tensors that stay fixed.")


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _captures_tensors(mask_mod: Callable) -> bool:
    try:
        return bool(layout_key(mask_mod)[1])
    except Unkeyable:
        return True


def stats() -> dict[str, int]:
    """How many block masks were built and how many calls reused one (tests, benchmarks).

    Example::

        >>> stats()["built"]      # doctest: +SKIP
        1
    """
    return dict(_stats, cached=len(_MASKS))


def clear() -> None:
    """Forget every cached block mask and the counters (tests)."""
    _MASKS.clear()
    _FACTS.clear()
    _stats.update(built=0, reused=0)


def build_block_mask(mask_mod: Callable, q: Tensor, k: Tensor) -> BlockMask:
    """The BlockMask of ``mask_mod`` for ``q`` and ``k``, built now (no cache; e.g. while an
    enclosing torch.compile traces the call into its graph).

    Example::

        >>> build_block_mask(mods.causal, q, k)     # doctest: +SKIP
    """
    return _build(mask_mod, _mask_facts(mask_mod), q, k)


def _build(mask_mod: Callable, facts: tuple[bool, bool, bool], q: Tensor, k: Tensor) -> BlockMask:
    _stats["built"] += 1
    reads_b, reads_h, elementwise = facts
    B, H = q.shape[0] if reads_b else None, q.shape[1] if reads_h else None
    entries = (B or 1) * (H or 1) * q.shape[2] * k.shape[2]
    if torch.compiler.is_compiling() or (entries <= MAX_ELEMENTS and not elementwise):
        return create_block_mask(mask_mod, B, H, q.shape[2], k.shape[2], device=q.device)
    # one evaluation on broadcast index tensors (or chunks of rows past MAX_ELEMENTS): torch's vmap evaluation
    # spent ~14 ms of host time a build on an H200 (a document mask at 4k), most of it functorch's dispatch
    return chunked_block_mask(mask_mod, q, k, max_elements=MAX_ELEMENTS, reads=(reads_b, reads_h),
                              elementwise=elementwise)


def _mask_facts(mask_mod: Callable) -> tuple[bool, bool, bool]:
    """(reads b, reads h, elementwise): elementwise when modgen generates the mod, i.e. the kernels evaluate it on
    broadcast index tiles, so one call on broadcast index tensors computes the same mask. A mod it cannot generate
    (a reduction, data-dependent Python) is evaluated by torch's vmap, one position at a time."""
    if torch.compiler.is_compiling():
        return (*_reads_batch_or_head(mask_mod), False)
    try:
        gm, bufs = trace_mod(mask_mod, "mask")
    except Exception:  # cannot tell (data-dependent Python, say): the full (B, H) mask, by vmap
        return True, True, False
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    reads = bool(placeholders[0].users), bool(placeholders[1].users)
    try:
        generate_mod_source(gm, "mask", [BufferSpec.of(b) for b in bufs], "tl")
    except Exception:   # UnsupportedMod: not what the kernels can evaluate on tiles
        return (*reads, False)
    return (*reads, True)


def _reads_batch_or_head(mask_mod: Callable) -> tuple[bool, bool]:
    """Whether mask_mod reads b / h (then the block mask needs those dimensions), by tracing it;
    inside an enclosing torch.compile (which cannot trace a trace), by its bytecode."""
    if torch.compiler.is_compiling():
        code = getattr(mask_mod, "__code__", None)
        return (True, True) if code is None else _code_reads_batch_or_head(code)
    try:
        gm, _ = trace_mod(mask_mod, "mask")
    except Exception:  # cannot tell (data-dependent Python, say): build the full (B, H) mask
        return True, True
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return bool(placeholders[0].users), bool(placeholders[1].users)


@torch.compiler.assume_constant_result
def _code_reads_batch_or_head(code: types.CodeType) -> tuple[bool, bool]:
    # Conservative: a parameter named anywhere in the body counts as read (a mask that passes b on
    # to a helper that ignores it gets a full-batch mask: larger, still exact). Dynamo runs this
    # once while tracing and keeps the answer as a constant.
    used = set(code.co_cellvars)   # captured by an inner function
    for ins in dis.get_instructions(code):
        if ins.opname.startswith("LOAD_FAST"):   # LOAD_FAST_LOAD_FAST (3.13) names a pair
            used.update(ins.argval if isinstance(ins.argval, tuple) else (ins.argval,))
    b, h = code.co_varnames[:2]
    return b in used, h in used


def chunked_block_mask(mask_mod: Callable, q: Tensor, k: Tensor, block: int = BLOCK,
                       max_elements: int = MAX_ELEMENTS, reads: tuple | None = None,
                       elementwise: bool = False) -> BlockMask:
    """The BlockMask ``create_block_mask(mask_mod, B?, H?, M, N, device)`` makes, evaluated at most
    about ``max_elements`` mask entries at a time. ``reads``: whether the mask reads (b, h)
    (traced when not given); only then does the block mask get those dimensions. ``elementwise``:
    the mod computes elementwise (modgen generates it), so each chunk is one call on broadcast index
    tensors instead of torch's vmap over positions.

    Example::

        >>> import torch; from fa3_inductor import mods
        >>> q = torch.zeros(1, 1, 300, 16)                   # edge blocks padded, as torch does
        >>> chunked_block_mask(mods.causal, q, q, max_elements=1).kv_num_blocks.tolist()
        [[[1, 1, 3]]]
    """
    reads_b, reads_h = reads if reads is not None else _reads_batch_or_head(mask_mod)
    B = q.shape[0] if reads_b else 1
    H = q.shape[1] if reads_h else 1
    M, N, device = q.shape[2], k.shape[2], q.device
    q_blocks, kv_blocks = -(-M // block), -(-N // block)
    per_row = B * H * kv_blocks * block
    rows = max(block, (max_elements // per_row) // block * block)
    counts = torch.empty(B, H, q_blocks, kv_blocks, dtype=torch.int32, device=device)
    for start in range(0, M, rows):
        length = min(rows, M - start)
        keep = _broadcast_mask(mask_mod, B, H, start, length, N, device) if elementwise else None
        if keep is None:
            keep = create_mask(_shifted(mask_mod, start), B if reads_b else None,
                               H if reads_h else None, length, N, device)
        keep = keep.expand(B, H, length, N)
        pad_rows, pad_cols = -length % block, -N % block
        if pad_rows or pad_cols:   # positions past the end are masked, as in torch's padding
            keep = torch.nn.functional.pad(keep, (0, pad_cols, 0, pad_rows))
        first = start // block
        n_rows = keep.shape[2] // block
        counts[:, :, first:first + n_rows] = keep.reshape(B, H, n_rows, block, kv_blocks, block) \
            .sum(dim=(3, 5), dtype=torch.int32)
    full = counts == block * block
    partial = (counts > 0) & ~full
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(block, block),
                                    mask_mod=mask_mod, seq_lengths=(M, N))


def _broadcast_mask(mask_mod: Callable, B: int, H: int, start: int, length: int, N: int,
                    device: torch.device) -> Tensor:
    """``mask_mod`` over (b, h, rows start.., keys) in one call on broadcast index tensors (int64, as torch's
    create_mask evaluates them: index arithmetic past 2**31 stays exact), as a bool broadcastable to (B, H,
    length, N); None if the call fails or gives another shape (the caller then evaluates it by vmap)."""
    def idx(lo: int, n: int, dim: int) -> Tensor:
        shape = [1, 1, 1, 1]
        shape[dim] = n
        return torch.arange(lo, lo + n, device=device, dtype=torch.int64).view(shape)

    try:
        keep = torch.as_tensor(mask_mod(idx(0, B, 0), idx(0, H, 1), idx(start, length, 2), idx(0, N, 3)),
                               device=device)
        if torch.broadcast_shapes(keep.shape, (B, H, length, N)) != (B, H, length, N):
            return None
    except Exception:   # e.g. a captured tensor on another device: vmap raises the error users should see
        return None
    return keep.to(torch.bool)


def _shifted(mask_mod: Callable, start: int) -> Callable:
    """``mask_mod`` for query rows counted from ``start``."""
    def shifted(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx + start, kv_idx)
    return shifted


def _ordered(dense: Tensor) -> tuple[Tensor, Tensor]:
    """(blocks per row, their column indices first) of a (B, H, rows, cols) block boolean."""
    as_int = dense.to(torch.int32)
    order = torch.argsort(as_int, dim=-1, descending=True, stable=True)
    return as_int.sum(-1, dtype=torch.int32).contiguous(), order.to(torch.int32).contiguous()


def length_block_mask(seq_lens: Tensor, first: Tensor, q_len: int, kv_len: int, causal: bool,
                      mask_mod: Callable, block: int = BLOCK, backward: bool = False) -> BlockMask:
    """The BlockMask of queries at absolute positions ``first[b] + i`` (i < ``q_len``) over the keys
    below ``seq_lens[b]`` of a ``kv_len``-key cache, and with ``causal`` only keys at or before the
    query's position: made from the lengths by arithmetic on their device, with no mask evaluated
    and no host read, where ``create_block_mask`` evaluates ``mask_mod`` over every (query, key) pair
    (15-25 ms a prefill chunk on an H200, more than the attention). ``mask_mod`` must compute exactly
    that (flex_decode's gathered path passes its folded mask); it is what the kernel applies to the
    partial blocks. Every head shares the mask (H = 1). Without ``backward`` the query-major tables a
    backward reads are not made (torch's vmap transpose of them cost 1.6 ms of host time a call).

    Example::

        >>> lens, first = torch.tensor([300, 0]), torch.tensor([200, -100])
        >>> keep = lambda b, h, q_idx, kv_idx: (kv_idx < lens[b]) & (q_idx + first[b] >= kv_idx)
        >>> bm = length_block_mask(lens, first, 100, 384, True, keep)
        >>> bm.kv_num_blocks.tolist(), bm.full_kv_num_blocks.tolist()
        ([[[2]], [[0]]], [[[1]], [[0]]])
    """
    device = seq_lens.device
    q_blocks, kv_blocks = -(-q_len // block), -(-kv_len // block)
    row0 = torch.arange(q_blocks, device=device) * block           # a query block's first row
    row1 = torch.clamp(row0 + block, max=q_len) - 1                  # and its last
    lens = seq_lens.to(device=device, dtype=torch.int64)[:, None]
    if causal:
        start = first.to(device=device, dtype=torch.int64)[:, None]
        # keys [0, every) seen by every row of the block, [0, some) by one row at least (a negative position counts as
        # 0: flex_decode's rows past their sequence's start)
        every = torch.minimum(lens, torch.clamp(start + row0, min=0) + 1)
        some = torch.minimum(lens, torch.clamp(start + row1, min=0) + 1)
    else:
        every = some = lens.expand(-1, q_blocks)
    # both kinds are runs of blocks: full [0, n_full), partial [n_full, n_seen) (a block past kv_len is never full)
    n_full = torch.clamp(every // block, min=0, max=kv_len // block)
    n_seen = torch.maximum(torch.clamp((some + block - 1) // block, min=0, max=kv_blocks), n_full)
    cols = torch.arange(kv_blocks, device=device)
    kv_num = (n_seen - n_full).to(torch.int32)[:, None].contiguous()
    kv_idx = ((n_full[..., None] + cols) % max(kv_blocks, 1)).to(torch.int32)[:, None].contiguous()
    full_num = n_full.to(torch.int32)[:, None].contiguous()
    full_idx = cols.to(torch.int32).expand(n_full.shape[0], 1, q_blocks, kv_blocks).contiguous()
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(block, block),
                                    mask_mod=mask_mod, seq_lengths=(q_len, kv_len), compute_q_blocks=backward)
