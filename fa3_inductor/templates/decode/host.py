"""Launch the split-KV decode kernel (kernel.py): checks, split choice, scratch, the launch."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import torch
import triton

from triton.tools.tensor_descriptor import TensorDescriptor

from ..placeholder import outside_graph_pools, placeholder
from ..tma import tma_aligned
from ..modgen import MAX_POSITION, kernel_score_mod
from ..wide_scores import wide_scores
from .fp8_cache import FP8_DTYPES, kv_scale_mode
from .configs import (WHOLE_PAGE_STAGES, DecodeConfig, choose_num_splits, decode_config, few_programs,
                      short_paged_splits, sm_count, tma_tiles)
from .kernel import BlockSparsity, CacheLayout, DecodeSite, DecodeTiling, decode_split_kernel
from .shape import MAX_ROWS as _MAX_ROWS

Launch = tuple   # (kernel, args, kwargs, grid)



def _fail(what: str, fix: str) -> None:
    raise ValueError(f"fa3 decode kernel: {what}; {fix}")


def _interpreting() -> bool:
    from triton import knobs

    return bool(knobs.runtime.interpret)


def _check_unit_last_stride(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        _fail(f"{name} has strides {t.stride()}, its last dim is not contiguous",
              f"pass {name}.contiguous() (or a view whose last stride is 1)")


def _cache_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: Any,
                 page_size: Optional[int]) -> tuple[int, int, int, int]:
    """(HKV, DV, max cache length, page size or 0) after checking the cache against q."""
    B, HQ, _, D = q.shape
    if k.dim() != 4 or v.dim() != 4:
        _fail(f"k and v must be 4-D, got {tuple(k.shape)} and {tuple(v.shape)}",
              "pass [B, HKV, N, D] caches, or [num_pages, page_size, HKV, D] with a block_table")
    if block_table is None:
        if page_size is not None:
            _fail("page_size was given without a block_table", "pass the block_table of the pages")
        _, HKV, N, Dk = k.shape
        if k.shape[0] != B or tuple(v.shape[:3]) != tuple(k.shape[:3]):
            _fail(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not agree on "
                  "[B, HKV, N]", "pass k, v as [B, HKV, N, D] with q's batch")
        max_len, page = N, 0
    else:
        P, page, HKV, Dk = k.shape
        if tuple(v.shape[:3]) != tuple(k.shape[:3]):
            _fail(f"paged k {tuple(k.shape)} and v {tuple(v.shape)} differ in [pages, page_size, HKV]",
                  "pass both caches as [num_pages, page_size, HKV, D]")
        if page_size is not None and page_size != page:
            _fail(f"page_size={page_size} but the cache's pages hold {page} keys",
                  "pass page_size=k.shape[1] or leave it None")
        if page < 1:
            _fail(f"the paged cache {tuple(k.shape)} has pages of {page} keys",
                  "pass [num_pages, page_size >= 1, HKV, D] pages")
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != B \
                or block_table.stride(1) != 1:
            _fail(f"block_table must be a [B={B}, max_pages] int32 tensor with unit last stride, got "
                  f"{block_table.dtype} {tuple(block_table.shape)} strides {block_table.stride()}",
                  "pass block_table.to(torch.int32).contiguous()")
        max_len = block_table.shape[1] * page
    if Dk != D:
        _fail(f"q's head dim {D} differs from k's {Dk}", "pass q and k with the same head dim")
    if HQ % HKV:
        _fail(f"{HQ} query heads are not a multiple of {HKV} kv heads", "check the head layout")
    return HKV, v.shape[-1], max_len, page


def _check_lengths(name: str, t: Optional[torch.Tensor], q: torch.Tensor) -> None:
    if t is not None and (t.dtype != torch.int32 or tuple(t.shape) != (q.shape[0],)
                          or t.device != q.device or t.stride(0) != 1):
        _fail(f"{name} must be a contiguous [B={q.shape[0]}] int32 tensor on {q.device}, got "
              f"{t.dtype} {tuple(t.shape)} on {t.device}",
              f"pass {name}.to(device=q.device, dtype=torch.int32).contiguous()")


def _block_n(cfg: DecodeConfig, sparse_kv_block: int) -> int:
    """cfg.block_n, or the largest power of two below it that divides the mask's KV block (a
    multiple of 16), so that a tile lies in one mask block. Pages do not constrain it: the kernel
    looks up each row's page."""
    block_n = cfg.block_n
    while sparse_kv_block and sparse_kv_block % block_n:
        block_n //= 2
    return block_n


def _sparsity(tables: Optional[tuple], sparse_q_block: int, sparse_kv_block: int, max_len: int,
              M_new: int, group: int, q_pos: str) -> tuple[str, tuple]:
    """(SPARSE mode, the table arguments: four tensors and eight strides) of a block mask."""
    if tables is None or tables[0] is None:
        return "none", (None,) * 4 + (0,) * 8
    num, idx, full_num, full_idx = tables
    if q_pos != "start" or M_new > sparse_q_block:
        _fail(f"a block mask with {M_new} new tokens at positions {q_pos!r} and query blocks of "
              f"{sparse_q_block}: the kernel reads query block 0 only",
              "pass the mask as mask_mod, or run the call through the prefill kernel")
    if sparse_kv_block % 16:
        _fail(f"a block mask with KV blocks of {sparse_kv_block}", "use blocks of a multiple of 16 keys")

    def strides(t: Optional[torch.Tensor]) -> tuple[int, int]:   # broadcast dims read row 0
        if t is None:
            return 0, 0
        return (t.stride(0) if t.shape[0] > 1 else 0), (t.stride(1) if t.shape[1] > 1 else 0)

    mode = "one_block" if sparse_kv_block >= max_len else "blocks"
    return mode, (num, idx, full_num, full_idx,
                  *strides(num), *strides(idx), *strides(full_num), *strides(full_idx))


def _plan(q, k, v, out, lse, sm_scale, score_mod, mask_mod, score_bufs, mask_bufs, seq_lens,
          q_offset, q_start_zero, tables, sparse_q_block, sparse_kv_block, block_table, page_size,
          num_splits, config, scratch, capability, k_scale=None, v_scale=None, window=0):
    """The launches of one decode call on a GPU of ``capability`` (None: the interpreter)."""
    if q.dim() != 4:
        _fail(f"q must be [B, HQ, M_new, D], got {tuple(q.shape)}", "add the new-token dim")
    B, HQ, M_new, D = q.shape
    HKV, DV, max_len, page = _cache_shape(q, k, v, block_table, page_size)
    group = HQ // HKV
    rows = group * M_new
    kv_scale = kv_scale_mode(k, v, k_scale, v_scale, block_table is not None, who="fa3 decode kernel")
    if (kv_scale == "none" and (q.dtype != k.dtype or k.dtype != v.dtype)) \
            or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        _fail(f"q, k, v are {q.dtype}, {k.dtype}, {v.dtype}",
              "pass all three as float16, bfloat16 (or float32, the slow path), or k, v as FP8 "
              "with k_scale / v_scale")
    if rows > _MAX_ROWS:
        _fail(f"{group} query heads per kv head x {M_new} new tokens = {rows} packed rows "
              f"(> {_MAX_ROWS})", "run long query chunks through the prefill (generic) kernel")
    if max_len >= MAX_POSITION:
        _fail(f"cache capacity {max_len} is not below {MAX_POSITION}", "split the cache into chunks")
    if block_table is not None and seq_lens is None:
        _fail("a paged cache needs seq_lens", "pass seq_lens, the [B] int32 cache lengths")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        _check_unit_last_stride(name, t)
    if tuple(out.shape) != (B, HQ, M_new, DV) or out.dtype != q.dtype:
        _fail(f"out must be {q.dtype} [{B}, {HQ}, {M_new}, {DV}], got {out.dtype} {tuple(out.shape)}",
              "allocate it with q.new_empty(B, HQ, M_new, DV)")
    if tuple(lse.shape) != (B, HQ, M_new) or lse.dtype != torch.float32 or not lse.is_contiguous():
        _fail(f"lse must be a contiguous float32 [{B}, {HQ}, {M_new}], got {lse.dtype} "
              f"{tuple(lse.shape)}", "allocate it with torch.empty(B, HQ, M_new, dtype=torch.float32)")
    _check_lengths("seq_lens", seq_lens, q)
    _check_lengths("q_offset", q_offset, q)
    if q_start_zero and q_offset is not None:
        _fail("q_start_zero and q_offset both given", "pass one of them")
    q_pos = "offset" if q_offset is not None else ("start" if q_start_zero else "end")
    mode, table_args = _sparsity(tables, sparse_q_block, sparse_kv_block, max_len, M_new, group, q_pos)
    if window and mask_mod is None:
        _fail(f"window={window} without the mask_mod", "pass the causal window's mask_mod (it applies on every tile)")
    window = int(window) if mode == "none" else 0   # a block mask's tables bound the walk themselves
    # the keys a split launch shares: a window's span (at most window + M_new keys past a tile edge), or the capacity
    work_len = min(max_len, window + M_new + 128) if window else max_len
    # a block mask that differs per head: one program per query head, each walking its own row
    heads = 1 if mode != "none" and table_args[0].shape[1] > 1 else group
    device_index = q.device.index if q.is_cuda else None
    if q.is_cuda and device_index is None:
        device_index = torch.cuda.current_device()
    sms = sm_count(capability, device_index)
    # pairs only where the pair launch takes one split: halving the programs doubles a split launch's count
    # (decode-tiles-nvidia-h200-2026-11-30-1251: 8 x 8k at 8 splits and 1 x 128k at 66 ran 1.06-1.30x slower), and
    # the pair kernel with the merge spilled (sm90: 168 registers, 2 spill instructions at 8 splits)
    one_split = num_splits == 1 if num_splits is not None else \
        choose_num_splits(B, HKV // 2, work_len, 64, sms, paged=True) == 1
    pairs = config is None and scratch is None and mode == "none" and kv_scale == "none" and one_split \
        and _head_pairs(q, k, v, block_table, HKV, group, capability)
    if pairs:   # two adjacent kv heads as one of twice the width (kernel.py, SITE.PAIRS)
        HKV, group, D, DV = HKV // 2, 2 * group, 2 * D, 2 * DV
        heads = group
    rows = heads * M_new

    block_m = max(16, triton.next_power_of_2(rows))
    paged = block_table is not None
    cfg = config or decode_config(max(D, DV), capability, fp32=q.dtype == torch.float32, block_m=block_m,
                                  paged=paged, few_programs=few_programs(B, HQ // heads, sms, paged),
                                  fp8_cache=kv_scale != "none")
    block_n = _block_n(cfg, sparse_kv_block if mode == "blocks" else 0)
    two_byte = q.dtype in (torch.float16, torch.bfloat16) and kv_scale == "none"   # K / V in q's 16-bit dtype
    split_paged = paged   # the paged split rule, unless short splits of whole-page tiles plan as contiguous
    if config is None and paged and not pairs and capability is not None and num_splits is None \
            and mode != "blocks" \
            and short_paged_splits(max(D, DV), page, block_m, two_byte, B, HQ // heads, work_len, block_n, sms,
                                   cfg.resident):
        split_paged = False
        cfg = dataclasses.replace(decode_config(max(D, DV), capability, block_m=block_m,
                                                few_programs=few_programs(B, HQ // heads, sms)),
                                  num_stages=WHOLE_PAGE_STAGES)
        block_n = cfg.block_n
    if num_splits is None:
        num_splits = choose_num_splits(B, HQ // heads, work_len, block_n, sms, cfg.resident, paged=split_paged)
    if num_splits < 1:
        _fail(f"num_splits={num_splits}", "pass a positive split count or None (chosen)")
    split = num_splits > 1
    block_d, block_dv = max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(DV))
    descs = None   # K / V descriptors when whole tiles come by TMA (the planned TMA tiles, or a config's tma)
    if mode != "blocks":
        wide = tma_tiles(cfg, max(D, DV), heads, block_m, capability, paged, two_byte) if config is None else None
        if wide is not None:
            descs = _tma_descriptors(k, v, paged, page, wide.block_n, block_d, block_dv)
            if descs is not None:
                cfg, block_n = wide, wide.block_n
        elif cfg.tma:
            descs = _tma_descriptors(k, v, paged, page, block_n, block_d, block_dv)

    if score_mod is not None:
        score_mod, to_score = kernel_score_mod(score_mod, sm_scale)
    else:
        to_score = sm_scale if sm_scale > 0 else 1.0
    fold = score_mod is None and sm_scale > 0
    programs = B * HQ // heads
    if split:
        if scratch is None:
            o_part, lse_part = _split_partials(q, HKV, DV, num_splits)
            arrivals = arrival_counters(q.device, programs)
        else:
            o_part, lse_part, arrivals = scratch
        if o_part.numel() < programs * num_splits * rows * DV or lse_part.numel() < programs * num_splits * rows \
                or arrivals.numel() < programs:
            _fail(f"the scratch given ({tuple(o_part.shape)}, {tuple(lse_part.shape)}, "
                  f"{tuple(arrivals.shape)}) is smaller than {num_splits} splits need "
                  f"({programs * num_splits * rows * DV} and {programs * num_splits * rows} floats, "
                  f"{programs} counters)",
                  "allocate it with decode_scratch(q, HKV, Dv, num_splits) and pass that num_splits")
    else:   # the kernel reads no partials and no counters
        o_part = lse_part = placeholder(q.device, torch.float32)
        arrivals = placeholder(q.device, torch.int32)
    dummy = placeholder(q.device, torch.int32)
    table_args = tuple(dummy if t is None else t for t in table_args[:4]) + table_args[4:]
    if block_table is None:
        k_strides, v_strides = (k.stride(0), k.stride(1), k.stride(2)), (v.stride(0), v.stride(1), v.stride(2))
        table, table_stride = dummy, 0
    else:   # [page, row in page, head, d]: batch stride = page stride, row stride = dim 1
        pair = 2 if pairs else 1   # a pair's first head: every other head
        k_strides = (k.stride(0), pair * k.stride(2), k.stride(1))
        v_strides = (v.stride(0), pair * v.stride(2), v.stride(1))
        table, table_stride = block_table, block_table.stride(0)
    k_desc, v_desc = descs or (None, None)
    args = (q, k, v, k_desc, v_desc, out, lse, o_part, lse_part, arrivals, dummy if seq_lens is None else seq_lens,
            q_offset if q_offset is not None else dummy, table, k_scale, v_scale, *table_args[:4],
            tuple(score_bufs), tuple(mask_bufs),
            q.stride(0), q.stride(1), q.stride(2), *k_strides, *v_strides,
            out.stride(0), out.stride(1), out.stride(2), *table_args[4:],
            table_stride, max_len, HKV, M_new, D, DV, sm_scale, to_score * math.log2(math.e), window)
    merge_rows = triton.next_power_of_2(rows)
    tile = DecodeTiling(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        # float32 inputs follow torch's matmul precision ("highest" = IEEE), as the forward does
        DOT_PRECISION="tf32" if torch.get_float32_matmul_precision() != "highest" else "ieee",
        MERGE_ROWS=merge_rows,
        MERGE_SPLITS=max(1, min(triton.next_power_of_2(num_splits), cfg.merge_elements // (merge_rows * block_dv))))
    kwargs = dict(SCORE_MOD=score_mod, MASK_MOD=mask_mod, TILE=tile,
                  CACHE=CacheLayout(PAGED=paged, PAGE_SIZE=page or block_n, KV_SCALE=kv_scale, TMA=descs is not None),
                  SITE=DecodeSite(GQA_GROUP=group, HEADS=heads, Q_POS=q_pos, HAS_SEQ_LENS=seq_lens is not None,
                                  FOLD_SCALE=fold, SPLIT=split,
                                  WIDE_SCORES=wide_scores(score_mod, compiled=capability is not None), PAIRS=pairs,
                                  WINDOW=window > 0),
                  SPARSE=BlockSparsity(MODE=mode, KV_BLOCK=sparse_kv_block if mode == "blocks" else 0,
                                       HAS_FULL=table_args[2] is not dummy),
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return [(decode_split_kernel, args, kwargs, (num_splits, programs))]


# Where the split scratch (O_PART, LSE_PART, ARRIVALS) sits among the split kernel's arguments
_SCRATCH_AT = slice(decode_split_kernel.arg_names.index("O_PART"), decode_split_kernel.arg_names.index("ARRIVALS") + 1)


def split_scratch(args: Sequence[Any]) -> tuple:
    """The (O_PART, LSE_PART, ARRIVALS) arguments of a split kernel launch's argument list.

    Example::

        >>> [(_, args, _, _)] = prepare_decode(q, k, v, out, lse, sm_scale=0.125, num_splits=4)  # doctest: +SKIP
        >>> [t.dtype for t in split_scratch(args)]                                                 # doctest: +SKIP
        [torch.float32, torch.float32, torch.int32]
    """
    return tuple(args[_SCRATCH_AT])


def _head_pairs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: Any, kv_heads: int, group: int,
                capability: Optional[tuple[int, int]]) -> bool:
    """Whether a paged D64 cache is read two kv heads at a time (kernel.py, SITE.PAIRS): sm90, two-byte,
    D = Dv = 64, an even number of kv heads whose rows lie side by side in a page (head stride 64), at most
    32 packed rows a pair. A pair's key row is then 256 bytes (a head's alone: 128) and a 64-key tile lies in
    one page of 64 or more, where D64's own 128-key tiles span two (docs/design/decode.md, "Head pairs")."""
    if block_table is None or capability is None or capability[0] != 9 or kv_heads % 2:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    D, page = q.shape[-1], k.shape[1]
    return (D == 64 and v.shape[-1] == 64 and k.stride(2) == D and v.stride(2) == D
            and 2 * group * q.shape[2] <= 32 and page % 64 == 0)


def _tma_descriptors(k: torch.Tensor, v: torch.Tensor, paged: bool, page: int, block_n: int, block_d: int,
                     block_dv: int) -> Optional[tuple[TensorDescriptor, TensorDescriptor]]:
    """K and V descriptors whose boxes are one tile of one kv head: [Z, HKV, N, D] boxes [1, 1,
    block_n, block_d], or pages [P, PAGE, HKV, D] boxes [1, block_n, 1, block_d] (pages holding whole
    tiles); columns past D read as zeros. None where TMA cannot address the cache: strides not
    16-byte multiples, a broadcast (stride 0) dimension, or tiles spanning pages."""
    if paged and page % block_n != 0:
        return None
    descs = []
    for t, cols in ((k, block_d), (v, block_dv)):
        if not tma_aligned(t) or 0 in t.stride():
            return None
        box = [1, block_n, 1, cols] if paged else [1, 1, block_n, cols]
        descs.append(TensorDescriptor(t, list(t.shape), list(t.stride()), box))
    return descs[0], descs[1]


def _split_partials(q: torch.Tensor, kv_heads: int, value_head_dim: int,
                    num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(O_PART, LSE_PART) float32 partials of ``num_splits`` splits (kernel.py's notation)."""
    B, HQ, M_new, _ = q.shape
    rows = HQ // kv_heads * M_new
    return (torch.empty(B * kv_heads, num_splits, rows, value_head_dim, dtype=torch.float32,
                        device=q.device),
            torch.empty(B * kv_heads, num_splits, rows, dtype=torch.float32, device=q.device))


def decode_scratch(q: torch.Tensor, kv_heads: int, value_head_dim: int,
                   num_splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(O_PART, LSE_PART, ARRIVALS) scratch for ``num_splits`` splits (kernel.py's notation), to
    allocate once and pass as ``scratch=`` (a CUDA graph then owns every tensor it touches):
    float32 partials and zeroed int32 counters (one per program, which every launch leaves at 0,
    so the scratch serves any number of launches in turn on one stream; two launches running at
    once need two).

    Example::

        >>> q = torch.zeros(2, 32, 1, 128)
        >>> [tuple(t.shape) for t in decode_scratch(q, 8, 128, 4)]
        [(16, 4, 4, 128), (16, 4, 4), (64,)]
    """
    B, HQ = q.shape[:2]
    # counters for B * HQ programs: a block mask that differs per head runs one per query head
    return (*_split_partials(q, kv_heads, value_head_dim, num_splits),
            torch.zeros(B * HQ, dtype=torch.int32, device=q.device))


# (device, stream) -> zeroed int32 counters; each launch leaves them at 0 (kernel.py)
_ARRIVALS: dict = {}


def arrival_counters(device: torch.device, programs: int) -> torch.Tensor:
    """At least ``programs`` zeroed int32 counters for the split kernel's ARRIVALS, shared by the
    launches of one stream (they run one after another, and each leaves the counters at 0). Under
    CUDA graph capture: a new zeroed tensor (its fill is captured, so every replay starts at 0);
    nothing captured is kept here. Kept counters are allocated outside any cudagraph tree's pool.

    Example::

        >>> arrival_counters(torch.device("cpu"), 8).tolist()
        [0, 0, 0, 0, 0, 0, 0, 0]
    """
    if device.type != "cuda":
        return torch.zeros(programs, dtype=torch.int32, device=device)
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(programs, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch._C._cuda_getCurrentRawStream(index))   # an int: no Stream object per call
    counters = _ARRIVALS.get(key)
    if counters is None or counters.numel() < programs:
        # kept across calls, so never from a cudagraph tree's pool (placeholder.py)
        n = max(programs, 1024)
        counters = outside_graph_pools(lambda: torch.zeros(n, dtype=torch.int32, device=device))
        _ARRIVALS[key] = counters
    return counters


def prepare_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *,
    sm_scale: float, score_mod: Any = None, mask_mod: Any = None,
    score_bufs: Sequence[torch.Tensor] = (), mask_bufs: Sequence[torch.Tensor] = (),
    seq_lens: Optional[torch.Tensor] = None, q_offset: Optional[torch.Tensor] = None,
    q_start_zero: bool = False, block_mask_tables: Optional[tuple] = None,
    sparse_q_block: int = 1 << 30, sparse_kv_block: int = 1 << 30,
    block_table: Optional[torch.Tensor] = None, page_size: Optional[int] = None,
    num_splits: Optional[int] = None, config: Optional[DecodeConfig] = None,
    scratch: Optional[tuple[torch.Tensor, ...]] = None,
    plan_for: Optional[tuple[int, int]] = None,
    k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None, window: int = 0,
) -> list[Launch]:
    """The launches ``[(kernel, args, kwargs, grid)]`` of one decode call (one: the split kernel,
    whose last split per program row merges the splits). ``out`` [B, HQ, M_new, DV] (q's dtype) and
    ``lse`` [B, HQ, M_new] (float32, log2 units) are written.

    ``k``/``v``: a [B, HKV, N, D] cache, or pages [num_pages, page_size, HKV, D] with
    ``block_table`` [B, max_pages] int32 (``page_size`` any; optional, checked);
    ``seq_lens`` [B] int32 the cache lengths (required when paged; default N), read on the device;
    ``q_offset`` [B] int32 the absolute position of each batch's first new token (default
    ``seq_lens - M_new``: the new tokens are the cache's last ones; ``q_start_zero``: 0, i.e.
    FlexAttention's q_idx); ``block_mask_tables`` a BlockMask's four tables (kv_num_blocks,
    kv_indices, full_kv_num_blocks, full_kv_indices; with ``q_start_zero``, query block 0 read for
    every row, heads broadcast under GQA) and its block sizes; mods as the generic forward
    takes them (kernel.py: h is a per-row column); ``num_splits`` None chooses from the batch,
    heads, capacity and SM count (configs.py); ``scratch`` from :func:`decode_scratch` (else
    allocated here); ``plan_for`` the capability to plan for with no GPU tensors (compile-only);
    ``k_scale`` / ``v_scale`` the float32 dequantization scales of an FP8 (e4m3 / e5m2) ``k`` / ``v``
    (fp8_cache.py: per tensor, kv head, sequence or page by their shape; q stays fp16 / bf16);
    ``window`` > 0: ``mask_mod`` is a causal sliding window of that many keys (modgen.causal_window_of_source),
    so the splits share only the keys from the tile holding row 0's window edge to the length, and the split
    count is planned for that span (without block mask tables; the mask still applies on every tile).

    Example::

        >>> for kernel, args, kwargs, grid in prepare_decode(q, k, v, out, lse, sm_scale=0.125,
        ...                                                  seq_lens=lens):  # doctest: +SKIP
        ...     kernel[grid](*args, **kwargs)
    """
    if _interpreting() and not q.is_cuda and q.dtype == torch.bfloat16:
        _fail("bfloat16 on the CPU interpreter (Triton 3.6 computes bf16 dots wrongly there)",
              "call decode_attention, which runs float32 copies, or pass float32 tensors")
    capability = plan_for if plan_for is not None and not q.is_cuda else (
        tuple(torch.cuda.get_device_capability(q.device)) if q.is_cuda else None)
    return _plan(q, k, v, out, lse, sm_scale, score_mod, mask_mod, score_bufs, mask_bufs, seq_lens,
                 q_offset, q_start_zero, block_mask_tables, sparse_q_block, sparse_kv_block,
                 block_table, page_size, num_splits, config, scratch, capability, k_scale, v_scale, window)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                     sm_scale: Optional[float] = None, **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention: ``(out, lse)``, out [B, HQ, M_new, DV] in q's dtype, lse [B, HQ, M_new]
    float32 in log2 units (-inf, with out 0, on rows that see no key). ``options`` are
    :func:`prepare_decode`'s keywords; ``sm_scale`` defaults to D ** -0.5. On the CPU interpreter a
    bfloat16 call runs on float32 copies (Triton 3.6's interpreter computes bf16 dots wrongly).

    Example::

        >>> out, lse = decode_attention(q, k_pages, v_pages, block_table=table, seq_lens=lens)  # doctest: +SKIP
    """
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    B, HQ, M_new, _ = q.shape
    out = q.new_empty(B, HQ, M_new, v.shape[-1])
    lse = torch.empty(B, HQ, M_new, dtype=torch.float32, device=q.device)
    run_q, run_k, run_v, run_out = q, k, v, out
    if _interpreting() and not q.is_cuda and q.dtype == torch.bfloat16:
        run_q, run_out = q.float(), out.float()
        if k.dtype not in FP8_DTYPES:   # an FP8 cache is converted in the kernel
            run_k, run_v = k.float(), v.float()
    for kernel, args, kwargs, grid in prepare_decode(run_q, run_k, run_v, run_out, lse,
                                                     sm_scale=scale, **options):
        kernel[grid](*args, **kwargs)
    if run_out is not out:
        out.copy_(run_out)
    return out, lse


def compile_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, *, capability: tuple[int, int] = (9, 0),
                   **options: Any) -> list[Any]:
    """Compile (not run) the launches :func:`prepare_decode` would make on a GPU of
    ``capability``; tensors may be on the CPU. Needs a process without TRITON_INTERPRET=1.

    Example::

        >>> [split_ck] = compile_decode(q, k, v, out, lse, sm_scale=0.125, num_splits=4)  # doctest: +SKIP
    """
    from triton.backends.compiler import GPUTarget

    from ..aot import compile_launch

    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    launches = prepare_decode(q, k, v, out, lse, plan_for=capability, **options)
    return [compile_launch(kernel, args, kwargs, target) for kernel, args, kwargs, _ in launches]
