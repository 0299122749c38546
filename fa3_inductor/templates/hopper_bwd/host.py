"""Launch the sm90 backward (bwd_sm90.py): preprocess (padded LSE and DELTA, zeroed dQ accumulator), main kernel, dQ convert.

The keywords are :func:`templates.generic_bwd.host.prepare_generic_backward`'s, plus ``deterministic``; the mods
are loaded ``gl`` mods (``score_grad_gl`` makes the derivative one from flex's joint graph).
"""
from __future__ import annotations

import functools
import heapq
import math
from dataclasses import replace
from typing import Any, Optional, Sequence

import torch
import triton

from ...runtime.fast_launch import launch_constant
from ..placeholder import placeholder
from ..generic_bwd.host import SCORE_GRAD_ONE, transpose_block_tables
from ..modgen import (MAX_POSITION, BufferSpec, GeneratedSource, generate_mod_source, is_causal_mask_mod,
                      kernel_score_mod, mask_implies_causal, mod_info)
from ..tma import tma_aligned
from ..wide_scores import wide_scores
from .bwd_sm90 import (DQ_SEM_SLOTS, BwdFlags, BwdSchedule, BwdSparsity, BwdTile,
                       bwd_sm90_dq_convert_frag_kernel, bwd_sm90_dq_convert_kernel, bwd_sm90_dq_listed_kernel,
                       bwd_sm90_dq_rank_kernel, bwd_sm90_preprocess_kernel, fa3_bwd_sm90_kernel)
from .bwd_sm90_m128 import M128Tile, fa3_bwd_sm90_m128_kernel
from .bwd_sm90_wide import WideTile, fa3_bwd_sm90_wide_kernel
from .bwd_sm90_k96 import K96Tile, fa3_bwd_sm90_k96_kernel
from .configs import SMEM_LIMIT, SUPPORTED_HEAD_DIM_PAIRS, BwdSm90Config, get_bwd_config, tile_head_dims

_LOG2E = math.log2(math.e)
_PASS_BLOCK = 64          # rows per program of the preprocess and convert passes
_DTYPES = (torch.bfloat16, torch.float16)

Launch = tuple   # (kernel, args, kwargs, grid)


def score_grad_gl(joint_gm: torch.fx.GraphModule,
                  buffers: Sequence[Optional[BufferSpec]]) -> Optional[GeneratedSource]:
    """``gl`` source of a score_mod's derivative from flex's joint graph (generic_bwd/score_grad.py's rewrite),
    None when it is 1 (pass :data:`SCORE_GRAD_ONE` then). Load it with ``modgen.load_mod(src, "gl")``.

    Example::

        >>> src = score_grad_gl(joint_gm, [])                             # doctest: +SKIP
        >>> grad_mod = load_mod(src, "gl") if src is not None else SCORE_GRAD_ONE   # doctest: +SKIP
    """
    from ..generic_bwd.score_grad import score_grad_graph

    gm = score_grad_graph(joint_gm, len(buffers))
    return None if gm is None else generate_mod_source(gm, "score", list(buffers), "gl")


def _refuse(problem: str) -> None:
    raise ValueError(f"sm90 backward: {problem}")


def _check_inputs(q, k, v, out, dout, lse, dq, dk, dv) -> None:
    Z, HQ, M, D = q.shape
    KZ, HKV, N, DV = v.shape
    problems = []
    if q.dtype not in _DTYPES or any(t.dtype != q.dtype for t in (k, v, dq, dk, dv)):
        problems.append(f"q, k, v, dq, dk, dv must share one dtype of {_DTYPES}, got "
                        f"{[str(t.dtype) for t in (q, k, v, dq, dk, dv)]} (use the generic backward otherwise)")
    if (D, DV) not in SUPPORTED_HEAD_DIM_PAIRS:
        problems.append(f"head dims {D} (q, k) / {DV} (v) are not served: it serves "
                        f"{', '.join(f'{d}/{dv}' for d, dv in SUPPORTED_HEAD_DIM_PAIRS)}; use the generic backward")
    if tuple(k.shape) != (KZ, HKV, N, D):
        problems.append(f"k is {tuple(k.shape)}, expected {(KZ, HKV, N, D)}")
    if KZ not in (1, Z) or HKV == 0 or HQ % HKV:
        problems.append(f"K/V batch {KZ} must be 1 or {Z}, and {HQ} query heads a multiple of {HKV}")
    for name, t, shape in (("out", out, (Z, HQ, M, DV)), ("dout", dout, (Z, HQ, M, DV)),
                           ("lse", lse, (Z, HQ, M)), ("dq", dq, q.shape), ("dk", dk, k.shape),
                           ("dv", dv, v.shape)):
        if tuple(t.shape) != tuple(shape):
            problems.append(f"{name} is {tuple(t.shape)}, expected {tuple(shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("dout", dout)):
        if not tma_aligned(t):
            problems.append(f"{name} is not TMA-aligned (last stride 1, 16-byte base and strides); "
                            "pass a contiguous copy")
    for name, t in (("out", out), ("dq", dq)):
        if t.stride(-1) != 1:
            problems.append(f"{name} has last stride {t.stride(-1)} (must be 1)")
    for name, t in (("dk", dk), ("dv", dv)):
        if not t.is_contiguous():
            problems.append(f"{name} must be contiguous (the kernel stores it with computed strides); "
                            f"allocate it with torch.empty_like({name[1]}.contiguous())")
    if M < 1 or N < 1 or max(M, N) >= MAX_POSITION:
        problems.append(f"sequence lengths must be in [1, {MAX_POSITION}) (generated mods turn indices into floats "
                        "exactly only below 2**23)")
    if problems:
        _refuse("; ".join(problems))


@functools.lru_cache(maxsize=64)
def _smem_layout(block_shape: tuple, dtype: torch.dtype):
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(block_shape), {torch.bfloat16: gl.bfloat16,
                                                                    torch.float16: gl.float16}[dtype])


def _desc(t: torch.Tensor, block_shape: list[int]):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), block_shape, _smem_layout(tuple(block_shape),
                                                                                           t.dtype))


def _dq_frag_desc(dq_acc: torch.Tensor):
    """TMA descriptor of DQ_ACC [Z * HQ, M_PAD, D] viewed as [Z * HQ, M_PAD * D / 256, 256] by [1, 16, 256] boxes
    (no swizzle): one 64 x 64 block of dQ in the wgmma fragments' order (bwd_sm90._dq_fragments; BwdSchedule.DQ_FRAG,
    WideTile.DQ_FRAG)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    zh, m_pad, d = dq_acc.shape
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
    # over DQ_ACC itself, not a view of it: the launch cache rebinds a descriptor's base to the call's own scratch
    # (runtime/fast_launch._step), and a view's would not be found among the call's tensors (uncacheable)
    return TensorDescriptor(dq_acc, [zh, m_pad * d // 256, 256], [m_pad * d, 256, 1], [1, 16, 256], layout)


def _dq_acc_desc(dq_acc: torch.Tensor, tile: BwdTile):
    """TMA descriptor of DQ_ACC [Z * HQ, M_PAD, D] (fp32) by [1, BLOCK_M, DQ_N] tiles, 128-byte swizzled (the
    compiler splits a tile into 32-column boxes): what the dQ_TMA schedule reduce-adds into."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    block = [1, tile.BLOCK_M, tile.DQ_N]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=3)
    return TensorDescriptor(dq_acc, list(dq_acc.shape), list(dq_acc.stride()), block, layout)


# CTAs per group of the longest-first order (_cta_order): a group's Q / dO tiles and DQ_ACC rows stay in L2 while
# its CTAs run (about two waves of 132), and every group ends on its shortest CTAs.
LPT_GROUP_CTAS = 256


def _cta_order(q_num_blocks: torch.Tensor, full_q_num_blocks: Optional[torch.Tensor], Z: int, KZ: int, HQ: int,
               HKV: int, n_kv_tiles: int, block_n: int, sparse_kv: int) -> torch.Tensor:
    return _cta_order_and_cost(q_num_blocks, full_q_num_blocks, Z, KZ, HQ, HKV, n_kv_tiles, block_n, sparse_kv)[0]


def _cta_order_and_cost(q_num_blocks: torch.Tensor, full_q_num_blocks: Optional[torch.Tensor], Z: int, KZ: int,
                        HQ: int, HKV: int, n_kv_tiles: int, block_n: int,
                        sparse_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch order of the main kernel's CTAs under a block mask (BwdSchedule.LPT_ORDER): int32
    [n_kv_tiles * KZ * HKV], entry i = kvh * n_kv_tiles + KV tile of the CTA launched i-th. Heads in groups of about
    LPT_GROUP_CTAS CTAs, in order; inside a group, by decreasing cost (query tiles the CTA walks, a partial one
    counted 9/8: its mask_mod), ties in grid order. Device ops only (no host sync).

    Example::

        >>> qnb = torch.tensor([[[1, 1, 1]]]); fqnb = torch.tensor([[[2, 1, 0]]])   # causal, 3 KV blocks
        >>> _cta_order(qnb, fqnb, 1, 1, 1, 1, 3, 128, 128).tolist()
        [0, 1, 2]
    """
    device = q_num_blocks.device
    SZ, SH, _ = q_num_blocks.shape
    group = HQ // HKV
    # indices made on the device: no host-to-device copy, so the launch order can be planned under graph capture
    kvh = torch.arange(KZ * HKV, device=device)
    hh = torch.arange((Z // KZ) * group, device=device)
    z = (kvh // HKV)[:, None] + (hh // group)[None, :] * KZ            # [KVH, HH]: the query heads of a CTA row
    hq = (kvh % HKV)[:, None] * group + (hh % group)[None, :]
    rows = (z % SZ) * SH + (hq % SH)
    kv_blk = torch.arange(n_kv_tiles, device=device) * block_n // sparse_kv
    partial = q_num_blocks.reshape(SZ * SH, -1).long()[rows][:, :, kv_blk].sum(1)      # [KVH, n_kv_tiles]
    full = (full_q_num_blocks.reshape(SZ * SH, -1).long()[rows][:, :, kv_blk].sum(1)
            if full_q_num_blocks is not None else torch.zeros_like(partial))
    cost = 9 * partial + 8 * full
    heads_per_group = max(1, LPT_GROUP_CTAS // n_kv_tiles)
    grp = (torch.arange(KZ * HKV, device=device) // heads_per_group)[:, None]
    key = grp * (1 << 40) - cost                      # ascending: group by group, longest first inside one
    return torch.argsort(key.flatten(), stable=True).to(torch.int32), cost.flatten()


# Fixed cost of a tile in a persistent CTA, in _cta_order's cost units (8 a query block, i.e. 4 a 64-row step): what
# a tile costs beyond its steps once its K / V load hides under the previous tile's stores (the dK / dV stores and a
# pipeline fill; docs/design/hopper_backward.md, "Masks against the tile bound").
PERSISTENT_TILE_COST = 4


def _persistent_schedule(q_num_blocks: torch.Tensor, full_q_num_blocks: Optional[torch.Tensor], Z: int, KZ: int,
                         HQ: int, HKV: int, n_kv_tiles: int, block_n: int, sparse_kv: int,
                         num_sms: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tiles of each persistent CTA (BwdSchedule.PERSISTENT): (offsets int32 [#CTAs + 1], tiles int32
    [n_kv_tiles * KZ * HKV]); CTA c runs tiles[offsets[c]:offsets[c + 1]] in order, each kvh * n_kv_tiles + KV tile.
    The list scheduling the hardware does with one CTA per tile, done here: _cta_order's tiles in order, each to the
    CTA that frees first by the cost model (its steps plus PERSISTENT_TILE_COST); #CTAs = min(num_sms, #tiles). Reads
    the block tables on the host (one device sync a plan: the op's memo replays the lists, so a training step with
    the same mask tables plans once; under CUDA graph capture the host launches in grid order instead).

    Example::

        >>> offsets, tiles = _persistent_schedule(torch.tensor([[[1, 1, 1]]]), torch.tensor([[[2, 1, 0]]]),
        ...                                       1, 1, 1, 1, 3, 128, 128, num_sms=2)
        >>> offsets.tolist(), tiles.tolist()
        ([0, 1, 3], [0, 1, 2])
    """
    order, cost = _cta_order_and_cost(q_num_blocks, full_q_num_blocks, Z, KZ, HQ, HKV, n_kv_tiles, block_n,
                                      sparse_kv)
    order = order.long()
    order_l, cost_l = torch.stack((order, cost[order])).tolist()   # one device-to-host copy, one sync
    return _list_schedule(order_l, cost_l, num_sms, q_num_blocks.device)


def _shape_schedule(M: int, n_kv_tiles: int, KZ: int, HKV: int, causal: bool, num_sms: int,
                    device: torch.device, block_n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """_persistent_schedule's lists for a launch whose tiles' steps follow from the shapes (the wide kernel without
    block tables: no mask, or BwdSparsity.CAUSAL_WALK, where KV tile j walks the query tiles from its diagonal on; the
    96-key kernel likewise): read nothing from the device. 64-row steps and ``block_n``-key tiles (the wide kernel's
    64, bwd_sm90_k96's 96); heads in groups of about LPT_GROUP_CTAS tiles, longest first inside a group.

    Example::

        >>> offsets, tiles = _shape_schedule(256, 4, 1, 2, True, 3, torch.device("cpu"))   # causal: 4 3 2 1 steps
        >>> offsets.tolist(), tiles.tolist()
        ([0, 3, 6, 8], [0, 2, 3, 4, 6, 7, 1, 5])
    """
    q_tiles = -(-M // 64)
    steps = [max(q_tiles - j * block_n // 64, 0) if causal else q_tiles for j in range(n_kv_tiles)]
    per_group = max(1, LPT_GROUP_CTAS // n_kv_tiles)
    order: list[int] = []
    for g0 in range(0, KZ * HKV, per_group):
        group = [kvh * n_kv_tiles + j for kvh in range(g0, min(g0 + per_group, KZ * HKV)) for j in range(n_kv_tiles)]
        order += sorted(group, key=lambda tile: -steps[tile % n_kv_tiles])   # (stable: ties in grid order)
    return _list_schedule(order, [4 * steps[tile % n_kv_tiles] for tile in order], num_sms, device)


def _list_schedule(order: list[int], cost: list[int], num_sms: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets, tiles) of min(num_sms, #tiles) persistent CTAs: the tiles in ``order``, each to the CTA that frees
    first when a tile costs its ``cost`` plus PERSISTENT_TILE_COST (the list scheduling the hardware does with one
    CTA per tile).

    Example::

        >>> [t.tolist() for t in _list_schedule([2, 0, 1], [8, 4, 4], 2, torch.device("cpu"))]
        [[0, 1, 3], [2, 0, 1]]
    """
    ctas = min(num_sms, len(order))
    free = [(0, c) for c in range(ctas)]
    lists: list[list[int]] = [[] for _ in range(ctas)]
    for tile, c in zip(order, cost):
        at, cta = heapq.heappop(free)
        lists[cta].append(tile)
        heapq.heappush(free, (at + c + PERSISTENT_TILE_COST, cta))
    offsets = [0]
    for tiles in lists:
        offsets.append(offsets[-1] + len(tiles))
    return (torch.tensor(offsets, dtype=torch.int32, device=device),
            torch.tensor([t for tiles in lists for t in tiles], dtype=torch.int32, device=device))


def _num_sms(device: torch.device) -> int:
    """SMs of the device (132, an H100 SXM / H200's, for CPU tensors: compile-only planning)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def hopper_backward_scratch(q: torch.Tensor, *, has_mask: bool, sparse_q_block: int = 128,
                            config: Optional[BwdSm90Config] = None, deterministic: bool = False,
                            mask_shape: Optional[tuple[int, int, int, int]] = None) -> tuple[torch.Tensor, ...]:
    """The scratch of one sm90 backward of ``q``'s shape, freshly allocated: (STATS, DQ_ACC), the padded LSE and
    DELTA [Z * HQ, 2, M_PAD] and the fp32 dQ accumulator [Z * HQ, M_PAD, D]. The preprocess launch writes both
    before anything reads them. ``has_mask``: the call passes block-mask tables (rows are then padded to
    ``sparse_q_block``). ``deterministic``: also DQ_SEMS, the dQ adds' counters [1 + Z * HQ * M_PAD / 64 * 4], and
    DQ_RANK, their order under a block mask [SZ, SH, #query blocks, #KV blocks] (``mask_shape``; one element without a
    mask), int32, written by the launches too. Pass the result as ``prepare_hopper_backward(..., scratch=...)`` to own
    every tensor its launches touch (runtime/ops_bwd.py re-launches them so).

    Example::

        >>> stats, dq_acc = hopper_backward_scratch(torch.empty(1, 2, 100, 64), has_mask=False)
        >>> tuple(stats.shape), tuple(dq_acc.shape)
        ((2, 2, 128), (2, 128, 64))
        >>> [tuple(t.shape) for t in hopper_backward_scratch(torch.empty(1, 2, 100, 64), has_mask=True,
        ...                                                 deterministic=True, mask_shape=(1, 1, 1, 1))[2:]]
        [(17,), (1, 1, 1, 1)]
    """
    Z, HQ, M, D = q.shape
    if D not in {d for d, _ in SUPPORTED_HEAD_DIM_PAIRS}:
        _refuse(f"head dim {D} is not served (q/k head dims {sorted({d for d, _ in SUPPORTED_HEAD_DIM_PAIRS})})")
    del config   # every config's rows fit the same padding (_padded_rows)
    return tuple(torch.empty(shape, dtype=dtype, device=q.device) for shape, dtype in
                 _scratch_shapes(q.shape, has_mask, sparse_q_block, deterministic, mask_shape))


def mask_shape_of(kv_num: Optional[torch.Tensor], kv_idx: Optional[torch.Tensor], q_num: Optional[torch.Tensor],
                  q_idx: Optional[torch.Tensor]) -> Optional[tuple[int, int, int, int]]:
    """(SZ, SH, #query blocks, #KV blocks) of a block mask from its forward or its transposed tables (None without).

    Example::

        >>> mask_shape_of(None, None, torch.zeros(1, 2, 3, dtype=torch.int32), torch.zeros(1, 2, 3, 5))
        (1, 2, 5, 3)
    """
    if q_num is not None:
        return (*q_num.shape[:2], q_idx.shape[-1], q_num.shape[2])
    if kv_num is not None:
        return (*kv_num.shape[:2], kv_num.shape[2], kv_idx.shape[-1])
    return None


def _scratch_shapes(q_shape: Sequence[int], has_mask: bool, sparse_q_block: int, deterministic: bool,
                    mask_shape: Optional[tuple[int, ...]]) -> list[tuple[tuple, torch.dtype]]:
    """(shape, dtype) of each scratch tensor (hopper_backward_scratch)."""
    Z, HQ, M, D = q_shape
    m_pad = _padded_rows(M, has_mask, sparse_q_block)
    shapes = [((Z * HQ, 2, m_pad), torch.float32), ((Z * HQ, m_pad, D), torch.float32)]
    if deterministic:
        if has_mask and mask_shape is None:
            _refuse("deterministic scratch under a block mask needs mask_shape (SZ, SH, #query blocks, #KV blocks)")
        shapes += [((1 + Z * HQ * (m_pad // _PASS_BLOCK) * DQ_SEM_SLOTS,), torch.int32),
                   (tuple(mask_shape) if has_mask else (1,), torch.int32)]
    return shapes


# Rows of the padding without a block mask: the longest query step of any config (M128Tile's 128), so the scratch of
# a call does not depend on which config the host picks for it.
_ROW_PAD = 128


def _padded_rows(M: int, has_mask: bool, sparse_q_block: int) -> int:
    """Every query tile the kernel may visit lies inside the padded rows (a block mask's last block can reach
    past M by up to a block): their LSE reads +inf (P = 0) and their dQ rows land in padding."""
    row_block = sparse_q_block if has_mask else _ROW_PAD
    return triton.cdiv(M, row_block) * row_block


def _check_scratch(scratch: Sequence[torch.Tensor], shapes: list[tuple[tuple, torch.dtype]],
                   device: torch.device) -> None:
    names = ("STATS", "DQ_ACC", "DQ_SEMS", "DQ_RANK")[:len(shapes)]
    problems = []
    if len(scratch) != len(shapes):
        problems.append(f"scratch has {len(scratch)} tensors, expected {len(shapes)} ({', '.join(names)})")
    else:
        for name, got, (shape, dtype) in zip(names, scratch, shapes):
            if tuple(got.shape) != shape or got.dtype != dtype or got.device != device or not got.is_contiguous():
                problems.append(f"scratch {name} is {got.dtype} {tuple(got.shape)} on {got.device} (contiguous: "
                                f"{got.is_contiguous()}), expected a contiguous {dtype} {shape} on {device}")
    if problems:
        _refuse("; ".join(problems) + ": allocate it with hopper_backward_scratch(q, has_mask=..., "
                "sparse_q_block=..., deterministic=..., mask_shape=...) for this call")


def launch_traits(score_mod: Any, score_grad_mod: Any, mask_mod: Any, has_mask: bool,
                  query_len: int = 0) -> dict[str, Any]:
    """What of a launch picks its config (configs.get_bwd_config's keywords): ``grad_mod``, a score_mod whose
    derivative is not 1 without a mask_mod (one compiled in spills at the wider overlap: docs/design/hopper_backward.md,
    "Cross-step overlap"); ``masked``, block-mask tables; ``curved``, a score_mod derivative other than 1, masked or
    not (the wide kernel's overlap loses with it); ``causal``, block-mask tables of an exactly causal mask_mod (the wide
    kernel walks them without the tables); ``plain``, no score_mod, mask_mod or block mask (192 / 128: 96-key tiles);
    ``no_score_mod``, no score_mod (192 / 128 causal: 96-key tiles); ``query_len``, the query rows (long causal launches
    at 192 / 128: the late dQ).

    Example::

        >>> traits = launch_traits(None, None, None, has_mask=True, query_len=4096)
        >>> traits["masked"], traits["causal"], traits["plain"], traits["no_score_mod"], traits["query_len"]
        (True, False, False, True, 4096)
    """
    curved = _curved(score_grad_mod)
    return dict(grad_mod=curved and mask_mod is None, masked=has_mask, curved=curved,
                causal=has_mask and is_causal_mask_mod(mask_mod),
                plain=score_mod is None and mask_mod is None and not has_mask, no_score_mod=score_mod is None,
                query_len=query_len)


def _curved(score_grad_mod: Any) -> bool:
    """A score_mod derivative other than 1 (a generated f', not None or SCORE_GRAD_ONE): the kernels compute f'."""
    return score_grad_mod is not None and score_grad_mod is not SCORE_GRAD_ONE


def _launched_mods(score_mod: Any, score_grad_mod: Any, sm_scale: float) -> tuple[Any, Any, bool, tuple]:
    """The forward's score units: (the launched score_mod, its launched derivative or None, FOLD_SCALE, (sm_scale,
    qk_scale2, ds_scale)). Without a mod and with a positive scale the kernel takes raw q.k (FOLD_SCALE). dS is in
    score units: dQ and dK take the derivative's factor and the scale once, at the end (ds_scale)."""
    fold = score_mod is None and sm_scale > 0
    if score_mod is not None:
        score_mod, to_score = kernel_score_mod(score_mod, sm_scale)
    else:
        to_score = sm_scale if fold else 1.0
    if _curved(score_grad_mod):
        score_grad_mod, grad_factor = kernel_score_mod(score_grad_mod, sm_scale)
    else:
        score_grad_mod, grad_factor = None, 1.0
    ds_scale = float(sm_scale * grad_factor)
    return score_mod, score_grad_mod, fold, (float(sm_scale), float(to_score * _LOG2E), ds_scale)


def _wide_tile(cfg: BwdSm90Config, DT: int, DVT: int, d_in: int, curved: bool, elem_bytes: int,
               dq_frag: bool) -> WideTile:
    """The wide kernel's tiles for ``cfg`` (its (DT, DVT) tiles, the tensors' head dim d_in when less): a second dQ
    staging tile where it fits beside a score_mod's f' (parked in shared memory without p_regs: D256 softcap then has
    no room for it)."""
    f_bytes = 2 * 64 * 32 * elem_bytes if curved and not cfg.p_regs else 0
    dq_bufs = cfg.dq_bufs if cfg.smem_bytes(DT, value_head_dim=DVT) + f_bytes + 1024 <= SMEM_LIMIT else 1
    return WideTile(HEAD_D=DT, HEAD_DV=DVT, NUM_STAGES=cfg.num_stages, HEAD_D_IN=d_in, P_REGS=cfg.p_regs,
                    DQ_BUFS=dq_bufs, OVERLAP=bool(cfg.overlap), DQ_FRAG=dq_frag)


def _flags(cfg: BwdSm90Config, group: int, fold: bool, even_n: bool, score_mod: Any, score_grad_mod: Any) -> BwdFlags:
    """The FLAGS bundle of a launch whose launched mods (_launched_mods) are ``score_mod`` / ``score_grad_mod``."""
    return BwdFlags(GQA_GROUP=group, FOLD_SCALE=fold, EVEN_N=even_n, CONSUMER_REGS=cfg.consumer_regs,
                    PRODUCER_REGS=cfg.producer_regs, WIDE_SCORES=wide_scores(score_mod, compiled=True),
                    GRAD_FINITE=score_grad_mod is not None and mod_info(score_grad_mod).finite)


def _register_rules(cfg: BwdSm90Config, score_mod: Any, masked: bool, DT: int) -> tuple[bool, bool]:
    """(STATS_AHEAD, P_CARRY16) of bwd_sm90.py's schedule; ``masked``: the launch applies a mask_mod (block-mask tables,
    or a packed launch's mask).

    LSE / DELTA a step ahead: not at D = 128 under a mask, where the two rows' four registers pushed head-level values
    to the stack (document, persistent: 36 spill instructions, none in a step loop). dS's P in registers: the in-order
    step always fits (D64's default); the overlap carries P across a step: in fp32 under overlap 2 without a mod or
    mask, else in 16 bits (fp32 spilled: sm90, triton 3.6, causal 43, ALiBi 22, softcap 106; noop under overlap 1,
    dQ's accumulator beside it, 36 with 6 in a step loop)."""
    stats_ahead = cfg.stats_ahead and not (masked and DT > 64)
    p_carry16 = cfg.p_regs and cfg.overlap != 0 and (score_mod is not None or masked or cfg.overlap == 1)
    return stats_ahead, p_carry16


def _pass_launches(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, grad_lse: Optional[torch.Tensor],
                   stats: torch.Tensor, dq_acc: torch.Tensor, dq: torch.Tensor, m_pad: int, ds_scale: float,
                   dq_frag: bool, head_dim: int, dq_sems: Optional[torch.Tensor] = None) -> tuple[Launch, Launch]:
    """(preprocess, dQ convert) launches around the main kernel, over [Z, HQ, M, D] tensors (packed sequences: their
    [1, H, total, D] views): STATS and the zeroed DQ_ACC rows up to ``m_pad`` (and ``dq_sems``' counters, deterministic
    dQ), then dQ from DQ_ACC (in the fragments' order with ``dq_frag``)."""
    Z, HQ, M, DV = out.shape
    D = head_dim
    # the passes' columns: D rounded up to a power of two and masked (80, 96, 160, 192), O's when not Q's (192 / 128)
    pass_dims = {"HEAD_D_POW2": triton.next_power_of_2(D)} if triton.next_power_of_2(D) != D else {}
    pre_dims = {**pass_dims, "HEAD_DV": DV} if DV != D else pass_dims
    preprocess = (
        bwd_sm90_preprocess_kernel,
        (out, dout, lse, grad_lse.float().contiguous() if grad_lse is not None else lse, stats, dq_acc,
         _strides(out), _strides(dout), HQ, M, m_pad),
        dict(HAS_DLSE=grad_lse is not None, BLOCK=_PASS_BLOCK, HEAD_D=D, num_warps=4, **pre_dims,
             **({} if dq_sems is None else {"DQ_SEMS": dq_sems})),
        (triton.cdiv(m_pad, _PASS_BLOCK), Z * HQ))
    if dq_frag:   # DQ_ACC's 64 x 64 blocks in the wgmma fragments' order
        convert = (
            bwd_sm90_dq_convert_frag_kernel,
            (dq_acc, dq, _strides(dq), HQ, M, m_pad, ds_scale),
            dict(HEAD_D=D, num_warps=4),
            (triton.cdiv(M, 64) * (D // 64), Z * HQ))
    else:
        convert = (
            bwd_sm90_dq_convert_kernel,
            (dq_acc, dq, _strides(dq), HQ, M, m_pad, ds_scale),
            dict(BLOCK=_PASS_BLOCK, HEAD_D=D, num_warps=4, **pass_dims),
            (triton.cdiv(M, _PASS_BLOCK), Z * HQ))
    return preprocess, convert


def prepare_hopper_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
    lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, *,
    sm_scale: float, grad_lse: Optional[torch.Tensor] = None,
    score_mod: Any = None, score_grad_mod: Any = None, mask_mod: Any = None,
    score_bufs: Sequence[torch.Tensor] = (), mask_bufs: Sequence[torch.Tensor] = (),
    kv_num_blocks: Optional[torch.Tensor] = None, kv_indices: Optional[torch.Tensor] = None,
    full_kv_num_blocks: Optional[torch.Tensor] = None,
    full_kv_indices: Optional[torch.Tensor] = None,
    q_num_blocks: Optional[torch.Tensor] = None, q_indices: Optional[torch.Tensor] = None,
    full_q_num_blocks: Optional[torch.Tensor] = None, full_q_indices: Optional[torch.Tensor] = None,
    sparse_q_block: int = 128, sparse_kv_block: int = 128, deterministic: bool = False,
    config: Optional[BwdSm90Config] = None, plan_for: Optional[tuple[int, int]] = None,
    scratch: Optional[Sequence[torch.Tensor]] = None,
) -> list[Launch]:
    """The three launches of one sm90 backward, ``[(kernel, args, kwargs, grid)]`` in the order they must run:
    preprocess (padded LSE and DELTA, zeroed dQ accumulator), the main kernel (dK, dV; dQ into the accumulator), dQ convert.

    Conventions are :func:`prepare_generic_backward`'s (LSE in log2 units, -inf on fully masked rows;
    ``grad_lse`` in the same units; a ``score_mod`` needs ``score_grad_mod``, :data:`SCORE_GRAD_ONE` when
    its derivative is 1), with ``gl`` mods. ``scratch``: (STATS, DQ_ACC), deterministic also (DQ_SEMS, DQ_RANK), from
    :func:`hopper_backward_scratch` for this call; None allocates them here. The preprocess launch fills STATS and
    zeroes the accumulator, so the launches may be replayed. ``deterministic=True``: dQ's adds in a fixed order
    (bwd_sm90.py, "Deterministic dQ"), so the gradients are the same bits on every run; served by the 64-row step and
    the wide kernel on the grid (never the 96-key tiles or persistent CTAs). Under a block mask it adds two launches
    before the main kernel (the adds' order from the transposed tables). ``plan_for`` is accepted for the generic
    interface (compile-only planning is always for sm90 here).

    Example::

        >>> for kernel, args, kwargs, grid in prepare_hopper_backward(
        ...         q, k, v, out, dout, lse, dq, dk, dv, sm_scale=0.125):       # doctest: +SKIP
        ...     kernel[grid](*args, **kwargs)
    """
    del plan_for
    _check_inputs(q, k, v, out, dout, lse, dq, dk, dv)
    if score_mod is not None and score_grad_mod is None:
        _refuse("a score_mod needs its derivative, score_grad_mod: generate it with "
                "hopper_bwd.host.score_grad_gl from flex's joint graph (SCORE_GRAD_ONE when that returns None)")
    if score_mod is None and _curved(score_grad_mod):
        _refuse("score_grad_mod given without its score_mod")
    has_mask = kv_num_blocks is not None or q_num_blocks is not None
    if mask_mod is not None and not has_mask:
        _refuse("a mask_mod needs block-mask tensors (kv_num_blocks, kv_indices), as in the forward")
    if has_mask and q_num_blocks is None:
        q_num_blocks, q_indices = transpose_block_tables(kv_num_blocks, kv_indices)
    has_full = has_mask and (full_q_num_blocks is not None or full_kv_num_blocks is not None)
    if has_full and full_q_num_blocks is None:
        full_q_num_blocks, full_q_indices = transpose_block_tables(full_kv_num_blocks, full_kv_indices)

    Z, HQ, M, D = q.shape
    KZ, HKV, N, DV = v.shape
    # the table's row for what the launch has (launch_traits: the mods' derivatives, a block mask)
    cfg = config or get_bwd_config(D, DV, **launch_traits(score_mod, score_grad_mod, mask_mod, has_mask, M),
                                   deterministic=deterministic)
    if deterministic:
        if cfg.kv96 or cfg.block_m != 64 or not cfg.dq_tma:
            _refuse(f"deterministic=True is served by the 64-row step and the wide kernel with dQ by TMA reduce-add, "
                    f"not by config {cfg} (head dims {D}/{DV}); use the generic backward, which is deterministic")
        # the KV-tile-major grid the ordered adds need (bwd_sm90.py, "Deterministic dQ"): no host-made CTA order
        cfg = replace(cfg, persistent=False, lpt_order=False)
    # 80 / 96: the 128 tiles, 160 / 192 (v's the same): the 256 tiles, zero columns past D (configs.PADDED_*)
    DT, DVT = tile_head_dims(D, DV)
    d_in = D if DT != D else 0   # the tiles' HEAD_D_IN: the tensors' columns when fewer than the tiles'
    if cfg.smem_bytes(DT, value_head_dim=DVT) > SMEM_LIMIT:
        _refuse(f"config {cfg} needs {cfg.smem_bytes(DT, value_head_dim=DVT)} bytes of shared memory "
                f"(limit {SMEM_LIMIT})")
    if DT != D and not cfg.dq_tma:
        _refuse(f"head dim {D} runs {DT}-column tiles, whose dQ only the TMA reduce-add clips to {D} columns "
                "(dq_tma=True)")
    if cfg.split_dkv != (DT > 128):
        _refuse(f"config {cfg} does not fit head dims {D}/{DV} (split_dkv is for D > 128)")
    if cfg.kv96 and ((DT, DVT) != (192, 128) or d_in or not cfg.split_dkv or cfg.overlap not in (0, 1)):
        _refuse(f"config {cfg}: 96-key tiles (kv96) are built for q/k 192 with v 128 (overlap 1: each step's dQ in "
                "the next step)")
    if cfg.split_dkv and cfg.overlap and (cfg.overlap != 1 or not cfg.p_regs or cfg.num_stages < 2):
        _refuse(f"config {cfg}: the wide-head-dim kernel's cross-step overlap is overlap=1 with p_regs and two Q / dO "
                "stages (the next step's Q is waited for during this one)")
    if cfg.split_dkv and not cfg.dq_tma:
        _refuse("the wide-head-dim kernel adds dQ by TMA reduce-add only (dq_tma=True)")
    if cfg.block_m not in (64, 128) or (cfg.block_m == 128 and (DT != 64 or cfg.overlap or not cfg.dq_tma)):
        _refuse(f"config {cfg}: 128 query rows a step (block_m) is built for D = 64, in order (overlap 0), dQ by "
                "TMA reduce-add")
    # dQ staged in the wgmma fragments' order (DQ_ACC's 64 x 64 blocks permuted, a convert that reads them so): whole
    # 64-column chunks only (not 80, 96, 160), dQ by TMA, 64-row steps
    dq_frag = cfg.dq_frag and cfg.dq_tma and D % 64 == 0 and cfg.block_m == 64
    if cfg.split_dkv:
        tile = _wide_tile(cfg, DT, DVT, d_in, _curved(score_grad_mod), q.element_size(), dq_frag)
    elif cfg.block_m == 128:
        tile = M128Tile(HEAD_D=D, NUM_STAGES=cfg.num_stages)
    else:
        tile = BwdTile(HEAD_D=DT, NUM_STAGES=cfg.num_stages, HEAD_D_IN=d_in)
    if has_mask and (sparse_q_block % tile.BLOCK_M or sparse_kv_block % tile.BLOCK_N):
        _refuse(f"block-mask blocks {sparse_q_block}x{sparse_kv_block} are not multiples of the tiles "
                f"{tile.BLOCK_M}x{tile.BLOCK_N}; build the BlockMask with BLOCK_SIZE 128 (torch's default)")

    score_mod, score_grad_mod, fold, scalars = _launched_mods(score_mod, score_grad_mod, sm_scale)
    ds_scale = scalars[2]

    dout = dout if dout.dtype == q.dtype and tma_aligned(dout) else dout.to(q.dtype).contiguous()
    out = out.to(q.dtype)
    lse = lse.float().contiguous()
    m_pad = _padded_rows(M, has_mask, sparse_q_block)
    mask_shape = mask_shape_of(None, None, q_num_blocks, q_indices)
    if scratch is None:
        scratch = hopper_backward_scratch(q, has_mask=has_mask, sparse_q_block=sparse_q_block, config=cfg,
                                          deterministic=deterministic, mask_shape=mask_shape)
    else:
        _check_scratch(scratch, _scratch_shapes(q.shape, has_mask, sparse_q_block, deterministic, mask_shape),
                       q.device)
    stats, dq_acc = scratch[:2]
    dummy = placeholder(q.device, torch.int32)

    def table(t: Optional[torch.Tensor]) -> torch.Tensor:   # indexed as dense row-major int32
        return dummy if t is None else t.to(torch.int32).contiguous()

    tables = tuple(table(t) for t in (q_num_blocks, q_indices, full_q_num_blocks, full_q_indices))
    SZ, SH, num_kv_blks = q_num_blocks.shape if has_mask else (1, 1, 1)
    num_q_blks = q_indices.shape[-1] if has_mask else 1
    # The wide kernel under a block mask: an exactly causal mask_mod walks its tiles from each 64-key tile's diagonal
    # without the tables (BwdSparsity.CAUSAL_WALK: backward 1.01-1.04x at 2k-8k, fwd+bwd 1.01-1.02x cuDNN at D256; H200,
    # bwd-speed-nvidia-h200-2026-11-30-0228-wide-causal-walk); another mask that keeps only q >= kv pairs (causal
    # documents, windows) skips a first listed tile wholly above the CTA's keys (bwd_sm90_wide._causal_first: 192 / 128
    # documents 1.01-1.06x, sliding window 1.04x; D256 1.02-1.04x). hopper_backward.md.
    wide_masked = has_mask and cfg.split_dkv
    walk = wide_masked and is_causal_mask_mod(mask_mod)
    tabled = has_mask and not walk
    sparse = BwdSparsity(HAS_BLOCK_MASK=tabled, HAS_FULL_BLOCKS=has_full and tabled,
                         Q_TILES_PER_BLK=sparse_q_block // tile.BLOCK_M if tabled else 1,
                         SPARSE_KV=sparse_kv_block if tabled else tile.BLOCK_N,
                         CAUSAL_SKIP=wide_masked and not walk and mask_implies_causal(mask_mod) and not deterministic,
                         CAUSAL_WALK=walk)
    block_n = K96Tile().BLOCK_N if cfg.kv96 else tile.BLOCK_N   # keys of a CTA's tile
    flags = _flags(cfg, HQ // HKV, fold, N % block_n == 0, score_mod, score_grad_mod)
    # CTA schedules for block masks (bwd_sm90.py): longest first, and persistent CTAs walking tile lists (the 64-row
    # step only; under graph capture the persistent lists, which read the tables on the host, give way to the grid
    # order); the wide kernel's persistent CTAs with any mask or none (tables read as bwd_sm90's, or the shapes')
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    schedulable = has_mask and not cfg.split_dkv and cfg.block_m == 64
    persistent = cfg.persistent and schedulable and not capturing
    wide_persistent = cfg.persistent and cfg.split_dkv and not capturing
    lpt = cfg.lpt_order and schedulable and not persistent
    # persistent: a second K / V buffer where shared memory allows (D = 64: 176 KB, 192 KB with a score_mod's f'
    # slots; D = 128 would need 272 KB), so the next tile's K and V load under this tile's last steps
    smem = cfg.smem_bytes(DT) + (2 * 64 * 64 * q.element_size() if score_grad_mod is not None else 0)
    kv_bufs = 2 if persistent and smem + 2 * tile.BLOCK_N * DT * q.element_size() + 1024 <= SMEM_LIMIT else 1
    stats_ahead, p_carry16 = _register_rules(cfg, score_mod, has_mask, DT)
    # dK / dV by TMA through the dQ staging tiles: they exist (DQ_TMA) and hold a [64, D] bf16 tile (D = 64, 128)
    dkdv_tma = cfg.dkdv_tma and cfg.dq_tma and D == DT and DT in (64, 128)
    sched = BwdSchedule(DQ_TMA=cfg.dq_tma, OVERLAP=cfg.overlap, LPT_ORDER=lpt, PERSISTENT=persistent, KV_BUFS=kv_bufs,
                        STATS_AHEAD=stats_ahead, P_REGS=cfg.p_regs, P_CARRY16=p_carry16, DQ_FRAG=dq_frag,
                        DKDV_TMA=dkdv_tma, DETERMINISTIC=deterministic)
    grid = (triton.cdiv(N, block_n), KZ * HKV)
    schedule_args = (q_num_blocks, full_q_num_blocks if has_full else None, Z, KZ, HQ, HKV, grid[0], tile.BLOCK_N,
                     sparse_kv_block)
    num_sms = cfg.persistent_ctas or _num_sms(q.device)
    if persistent or (wide_persistent and tabled):
        cta_args = _persistent_schedule(*schedule_args, num_sms=num_sms)
    elif wide_persistent:
        cta_args = _shape_schedule(M, grid[0], KZ, HKV, walk, num_sms, q.device, block_n=block_n)
    else:
        cta_args = (_cta_order(*schedule_args),) if lpt else ()
    if persistent or wide_persistent:
        grid = (cta_args[0].numel() - 1,)
    # the plan's own tensors: a recorded launch replays them (a permutation of every tile, right for any mask
    # contents of the launch's key; only the balance follows the mask it was made for)
    cta_args = tuple(launch_constant(t) for t in cta_args)

    preprocess, convert = _pass_launches(out, dout, lse, grad_lse, stats, dq_acc, dq, m_pad, ds_scale, dq_frag, D,
                                         scratch[2] if deterministic else None)
    ordering = []
    if deterministic:   # the counters and, under a block mask, the adds' order: scratch the launches write
        cta_args = (*scratch[2:], cfg.det_heads or _deterministic_group(Z, HQ, KZ, HKV, has_mask))
        if tabled:   # (an exactly causal mask walked by the wide kernel: rank = KV tile, no table)
            ordering = _order_launches(q_num_blocks, q_indices, full_q_num_blocks, full_q_indices, scratch[3], has_full)
    if cfg.kv96:
        if tabled or not dq_frag:
            _refuse("96-key tiles (kv96) walk no block-mask tables (only an exactly causal mask_mod) and add dQ in "
                    "the fragments' order (dq_frag)")
        k96 = K96Tile(NUM_STAGES=cfg.num_stages, CAUSAL=walk, DQ_LAG=cfg.overlap == 1, PERSISTENT=wide_persistent,
                      DKDV_TMA=cfg.dkdv_tma)
        out_descs = (_desc(dk, [1, 1, 32, 128]), _desc(dk, [1, 1, 32, 64]), _desc(dv, [1, 1, 32, 128])) \
            if cfg.dkdv_tma else (None, None, None)
        main = (
            fa3_bwd_sm90_k96_kernel,
            (_desc(q, [1, 1, 64, 128]), _desc(q, [1, 1, 64, 64]), _desc(dout, [1, 1, 64, 128]),
             _desc(k, [1, 1, 32, 128]), _desc(k, [1, 1, 32, 64]), _desc(v, [1, 1, 32, 128]), _dq_frag_desc(dq_acc),
             stats, dk, dv, *out_descs, tuple(score_bufs), tuple(mask_bufs), Z, HQ, KZ, M, N, m_pad, *scalars,
             cta_args),
            dict(SCORE_MOD=score_mod, SCORE_GRAD=score_grad_mod, MASK_MOD=mask_mod if walk else None, TILE=k96,
                 FLAGS=flags, num_warps=4, maxnreg=cfg.maxnreg),
            grid)
    elif cfg.split_dkv:
        lo, hi = tile.LO, tile.HI   # D = 256: one Q / K tile (lo = hi = 256), the second descriptor unused
        # dK / dV by TMA through the dQ staging tiles: unpadded pairs (the boxes are the warpgroups' columns), CTAs of
        # the grid (persistent ones with it were not measured, and spill 8 instructions at 192 / 128 causal)
        wide_dkdv_tma = cfg.dkdv_tma and not d_in and not wide_persistent
        out_descs = (None,) * 3
        if wide_dkdv_tma:
            out_descs = (_desc(dk, [1, 1, tile.BLOCK_N, tile.DK_COLS[0][1]]),
                         _desc(dk, [1, 1, tile.BLOCK_N, tile.DK_COLS[1][1]]),
                         _desc(dv, [1, 1, tile.BLOCK_N, tile.DV_WG]))
        main = (
            fa3_bwd_sm90_wide_kernel,
            (_desc(q, [1, 1, tile.BLOCK_M, lo]), _desc(q, [1, 1, tile.BLOCK_M, hi]),
             _desc(dout, [1, 1, tile.BLOCK_M, DVT]),
             _desc(k, [1, 1, tile.BLOCK_N, lo]), _desc(k, [1, 1, tile.BLOCK_N, hi]),
             _desc(v, [1, 1, tile.BLOCK_N, DVT]),
             _dq_frag_desc(dq_acc) if dq_frag else _dq_acc_desc(dq_acc, tile),
             stats, dq_acc, dk, dv, *out_descs, *tables, tuple(score_bufs), tuple(mask_bufs),
             Z, HQ, KZ, M, N, m_pad, SZ, SH, num_kv_blks, num_q_blks, *scalars, cta_args, ()),
            dict(SCORE_MOD=score_mod, SCORE_GRAD=score_grad_mod, MASK_MOD=mask_mod,
                 TILE=replace(tile, PERSISTENT=wide_persistent, DKDV_TMA=wide_dkdv_tma, DETERMINISTIC=deterministic),
                 SPARSE=sparse, FLAGS=flags,
                 num_warps=4, maxnreg=cfg.maxnreg),
            grid)
    elif cfg.block_m == 128:
        main = (
            fa3_bwd_sm90_m128_kernel,
            (_desc(q, [1, 1, tile.BLOCK_M, D]), _desc(dout, [1, 1, tile.BLOCK_M, D]),
             _desc(k, [1, 1, tile.BLOCK_N, D]), _desc(v, [1, 1, tile.BLOCK_N, D]),
             _dq_acc_desc(dq_acc, BwdTile(HEAD_D=D, NUM_STAGES=1)),   # [1, 64, D]: a warpgroup's half of a step
             stats, dq_acc, dk, dv, *tables, tuple(score_bufs), tuple(mask_bufs),
             Z, HQ, KZ, M, N, m_pad, SZ, SH, num_kv_blks, num_q_blks, *scalars),
            dict(SCORE_MOD=score_mod, SCORE_GRAD=score_grad_mod, MASK_MOD=mask_mod, TILE=tile, SPARSE=sparse,
                 FLAGS=flags, num_warps=4, maxnreg=cfg.maxnreg),
            (triton.cdiv(N, tile.BLOCK_N), KZ * HKV))
    else:
        main = (
            fa3_bwd_sm90_kernel,
            (_desc(q, [1, 1, tile.BLOCK_M, DT]), _desc(dout, [1, 1, tile.BLOCK_M, DT]),
             _desc(k, [1, 1, tile.BLOCK_N, DT]), _desc(v, [1, 1, tile.BLOCK_N, DT]),
             (_dq_frag_desc(dq_acc) if dq_frag else _dq_acc_desc(dq_acc, tile)) if cfg.dq_tma else None,
             stats, dq_acc, dk, dv,
             *((_desc(dk, [1, 1, 64, D]), _desc(dv, [1, 1, 64, D])) if dkdv_tma else (None, None)),
             *tables, tuple(score_bufs), tuple(mask_bufs),
             Z, HQ, KZ, M, N, m_pad, SZ, SH, num_kv_blks, num_q_blks, *scalars, cta_args, ()),
            dict(SCORE_MOD=score_mod, SCORE_GRAD=score_grad_mod, MASK_MOD=mask_mod, TILE=tile, SPARSE=sparse,
                 FLAGS=flags, SCHED=sched, num_warps=4, maxnreg=cfg.maxnreg),
            grid)
    return [preprocess, *ordering, main, convert]


# Query heads a deterministic launch-order group holds without a block mask (bwd_sm90.py, "Deterministic dQ"). H200,
# bwd-speed-nvidia-h200-2026-11-30-2117-deterministic-groups (B*N = 16k, H16; backward over the default): noop D128 at
# 2k / 4k / 8k with every head in one group 0.50 / 0.58 / 0.66, groups of 16 0.74 / 0.70 / 0.70, of 8 0.77 / 0.72 /
# 0.72, of 4 0.76 / 0.73 / 0.73; D64 0.71 / 0.79 / 0.82, 0.86 / 0.85 / 0.84, 0.84 / 0.86 / 0.86, 0.74 / 0.84 / 0.86.
# Causal lost with groups at D64 (0.69 / 0.72 / 0.73 -> 0.59 / 0.67 / 0.71 at 16, less at 8 and 4; D128 0.54 / 0.61 /
# 0.65 -> 0.61 / 0.63 / 0.64 at 16): masked launches keep one group.
_DETERMINISTIC_GROUP_HEADS = 8


def _deterministic_group(Z: int, HQ: int, KZ: int, HKV: int, has_mask: bool) -> int:
    """(kz, hkv) heads of a deterministic launch-order group: all under a block mask, else as many as hold
    _DETERMINISTIC_GROUP_HEADS query heads (a (kz, hkv) head walks HQ / HKV query heads of Z / KZ batches).

    Example::

        >>> _deterministic_group(4, 16, 4, 16, has_mask=False), _deterministic_group(4, 32, 4, 8, has_mask=False)
        (8, 2)
        >>> _deterministic_group(4, 16, 4, 16, has_mask=True)
        64
    """
    if has_mask:
        return KZ * HKV
    return max(1, min(KZ * HKV, _DETERMINISTIC_GROUP_HEADS // ((HQ // HKV) * (Z // KZ))))


def _order_launches(q_num: torch.Tensor, q_idx: torch.Tensor, full_q_num: Optional[torch.Tensor],
                    full_q_idx: Optional[torch.Tensor], dq_rank: torch.Tensor, has_full: bool) -> list[Launch]:
    """The two launches that write DQ_RANK from the transposed tables the main kernel walks (bwd_sm90_dq_listed_kernel
    marks each KV block's listed query blocks, bwd_sm90_dq_rank_kernel counts them along each query block's row): a
    CTA waits only for adds that the CTAs before it make, whatever the caller's forward tables say."""
    tables = [t.to(torch.int32).contiguous() for t in (q_num, q_idx)]
    full = [t.to(torch.int32).contiguous() for t in (full_q_num, full_q_idx)] if has_full else tables
    SZ, SH, num_q_blks, num_kv_blks = dq_rank.shape
    listed = (bwd_sm90_dq_listed_kernel,
              (tables[0], tables[1], full[0], full[1], dq_rank, num_q_blks, num_kv_blks, tables[1].shape[-1]),
              dict(HAS_FULL=has_full, Q_BLKS_POW2=max(16, triton.next_power_of_2(num_q_blks)), num_warps=4),
              (SZ * SH * num_kv_blks,))
    counted = (bwd_sm90_dq_rank_kernel, (dq_rank, num_kv_blks),
               dict(KV_BLKS_POW2=max(16, triton.next_power_of_2(num_kv_blks)), num_warps=4), (SZ * SH * num_q_blks,))
    return [listed, counted]


def launch_hopper_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           dout: torch.Tensor, lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                           dv: torch.Tensor, **options: Any) -> None:
    """Run the sm90 backward; ``dq``, ``dk``, ``dv`` are written in place. ``options`` are
    :func:`prepare_hopper_backward`'s keywords (``sm_scale`` required).

    Example::

        >>> launch_hopper_backward(q, k, v, out, dout, lse, dq, dk, dv, sm_scale=0.125)   # doctest: +SKIP
    """
    for kernel, args, kwargs, grid in prepare_hopper_backward(q, k, v, out, dout, lse, dq, dk, dv, **options):
        kernel[grid](*args, **kwargs)


def compile_hopper_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                            dout: torch.Tensor, lse: torch.Tensor, *, capability: tuple[int, int] = (9, 0),
                            **options: Any) -> list[Any]:
    """Compile (not run) the three kernels :func:`launch_hopper_backward` would launch, for sm90: the compiled
    kernels in launch order. Tensors may be on the CPU; needs a process without TRITON_INTERPRET=1.

    Example::

        >>> pre, main, convert = compile_hopper_backward(q, k, v, out, dout, lse, sm_scale=0.125)  # doctest: +SKIP
        >>> sass_report(main).hgmma > 0                                                          # doctest: +SKIP
        True
    """
    from triton.backends.compiler import GPUTarget

    from ..aot import compile_launch

    if capability != (9, 0):
        _refuse(f"compiles for sm90 only (capability (9, 0)), got {capability}")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    launches = prepare_hopper_backward(q, k, v, out, dout, lse, dq, dk, dv, **options)
    target = GPUTarget("cuda", 90, 32)
    return [compile_launch(kernel, args, kwargs, target) for kernel, args, kwargs, _ in launches]
