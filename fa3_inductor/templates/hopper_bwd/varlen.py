"""Packed variable-length sequences through the sm90 backward: the packed mode (PACK.VARLEN) of bwd_sm90.py (head dims
up to 128) and bwd_sm90_wide.py (192 / 128, 256; 160 and 192 in the 256 tiles), the backward of
``fa3_inductor.flex_varlen`` on sm90 GPUs (templates/hopper/varlen_sm90.py is its forward).

One CTA per (KV tile, sequence, K/V head) over virtual KV tiles (128 keys, 64 in the wide kernel) that a one-launch
pass maps to their sequences (no host read of the lengths); a virtual tile past its sequence's last (at most one a
sequence) runs nothing. Its query steps are the sequence's own 64-row tiles (sequence-relative rows, so no tile
straddles two sequences' starts): all of them, with a causal mask_mod from the KV tile's diagonal on
(BwdSparsity.CAUSAL_WALK: the diagonal tiles take the mask, the rest run without it), or with a causal window of W
keys from the diagonal to the last row whose window reaches the tile (BwdSparsity.WINDOW_WALK: the diagonal's and the
window edge's tiles take the mask). Rows and keys past a
sequence's end are the next sequence's: the kernel gives them P = 0 (rows: an LSE of +inf) or zero keys
(_kv_landed), and stores dK / dV rows of its own sequence only. dQ is summed by TMA reduce-adds into an fp32 buffer
over the packed rows (rows of the padding and of the next sequence receive zeros), then converted.

Example::

    >>> for kernel, args, kwargs, grid in prepare_varlen_backward(
    ...         q, k, v, out, dout, lse, dq, dk, dv, cu_q, cu_k, sm_scale=0.088):   # doctest: +SKIP
    ...     kernel[grid](*args, **kwargs)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence

import torch
import triton

from ...runtime.fast_launch import aliasing, launch_cached, on_clear, recorded, relaunch, tensor_signature
from ..hopper.varlen_sm90 import packed_tma_refusal, packed_view
from ..placeholder import placeholder
from ..hopper.tile_table import tile_table_launch, tile_table_size
from .bwd_sm90 import BwdPacking, BwdSchedule, BwdSparsity, BwdTile, fa3_bwd_sm90_kernel
from .bwd_sm90_wide import fa3_bwd_sm90_wide_kernel
from .configs import SMEM_LIMIT, SUPPORTED_HEAD_DIM_PAIRS, BwdSm90Config, get_bwd_config, tile_head_dims
from .host import (Launch, _curved, _desc, _dq_acc_desc, _flags, _launched_mods, _pass_launches, _register_rules,
                   _wide_tile)

_DTYPES = (torch.bfloat16, torch.float16)
_MAX_RECORDED = 256
_RECORDED: dict = {}   # launch key -> the recorded launches (runtime/fast_launch.py)
on_clear(_RECORDED.clear)
_ROW_PAD = 64   # DQ_ACC / STATS rows past the pack: the last sequence's last query tile reaches up to 63 past it
_PAIRS_TEXT = ", ".join(f"{d}/{dv}" for d, dv in SUPPORTED_HEAD_DIM_PAIRS)


def varlen_bwd_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       capability: Optional[tuple[int, int]]) -> Optional[str]:
    """None when the sm90 varlen backward serves these packed ``(total, heads, dim)`` tensors on a GPU of
    ``capability`` (None: not a GPU), else why not, in words.

    Example::

        >>> q = torch.empty(10, 4, 128, dtype=torch.bfloat16)
        >>> varlen_bwd_refusal(q, q, q, (9, 0)) is None
        True
        >>> varlen_bwd_refusal(q[..., :64], q[..., :64], torch.empty(10, 4, 32, dtype=torch.bfloat16), (9, 0))[-30:]
        ' 192/192, 256/256, got 64 / 32'
    """
    if capability != (9, 0):
        where = "not a GPU" if capability is None else f"sm{capability[0]}{capability[1]}"
        return f"the Hopper varlen backward needs an sm90 GPU, this is {where}"
    if q.dtype not in _DTYPES:
        return f"the Hopper varlen backward takes float16 or bfloat16, got {q.dtype}"
    if (q.shape[2], v.shape[2]) not in SUPPORTED_HEAD_DIM_PAIRS:
        return (f"the Hopper varlen backward serves head dims (q, k / v) {_PAIRS_TEXT}, got {q.shape[2]} / "
                f"{v.shape[2]}")
    return packed_tma_refusal(q, k, v)


def _refuse(problem: str) -> None:
    raise ValueError(f"sm90 varlen backward: {problem}")


def prepare_varlen_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    *, sm_scale: float, grad_lse: Optional[torch.Tensor] = None, score_mod: Any = None,
    score_grad_mod: Any = None, mask_mod: Any = None, causal: bool = False, window: int = 0,
    score_bufs: Sequence[torch.Tensor] = (), mask_bufs: Sequence[torch.Tensor] = (),
    config: Optional[BwdSm90Config] = None, scratch: Optional[Sequence[torch.Tensor]] = None,
    tensors: Optional[list] = None,
) -> list[Launch]:
    """The four launches (tile table, preprocess, main kernel, dQ convert) of the backward of one flex_varlen call over
    packed ``q [TQ, HQ, D]``, ``k [TK, HKV, D]``, ``v [TK, HKV, DV]``, ``out`` / ``dout [TQ, HQ, DV]``, ``lse [HQ, TQ]``
    (float32, log2 units, -inf on rows that saw no key), writing ``dq``, ``dk``, ``dv`` (their inputs' shapes; dk
    and dv contiguous) in place. ``grad_lse``: the LSE's incoming gradient [HQ, TQ] in log2 units, or None. The mods
    are loaded ``gl`` mods as prepare_hopper_backward takes them (a score_mod with its ``score_grad_mod``);
    ``causal`` says the mask_mod is exactly ``q_idx >= kv_idx``, ``window`` > 0 that it is a causal window of that many
    keys (``q_idx - window < kv_idx <= q_idx``: modgen.causal_window_of_source), walked from each KV tile's diagonal to
    the window's far edge. ``scratch``: (STATS, DQ_ACC) from
    :func:`varlen_backward_scratch` (allocated here when None). Needs TQ, TK > 0. Every tensor the launches take is
    one of :func:`launch_tensors`' (``tensors``: that list for this call and ``scratch``, made here when None), so that
    a recording re-launches them on another call's tensors.

    Example::

        >>> launches = prepare_varlen_backward(q, k, v, out, dout, lse, dq, dk, dv, cu_q, cu_k,
        ...                                    sm_scale=0.088)   # doctest: +SKIP
    """
    TQ, HQ, D = q.shape
    TK, HKV, DV = v.shape
    B = cu_seqlens_q.shape[0] - 1
    problems = []
    if (D, DV) not in SUPPORTED_HEAD_DIM_PAIRS:
        problems.append(f"head dims {D} / {DV} (it serves {_PAIRS_TEXT})")
    if q.dtype not in _DTYPES or not (q.dtype == k.dtype == v.dtype == dout.dtype):
        problems.append(f"dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}, dout {dout.dtype} (one of float16, bfloat16)")
    for name, t, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v), ("out", out, q), ("dout", dout, q)):
        if t.shape != like.shape[:2] + (DV if name in ("out", "dout") else like.shape[2],):
            problems.append(f"{name} has shape {tuple(t.shape)}")
    for name, t in (("dk", dk), ("dv", dv)):
        if not t.is_contiguous():
            problems.append(f"{name} is not contiguous (the kernel stores packed rows of HKV x D)")
    if tuple(lse.shape) != (HQ, TQ) or lse.dtype != torch.float32:
        problems.append(f"lse is {lse.dtype} {tuple(lse.shape)}, expected float32 ({HQ}, {TQ})")
    if HQ % HKV:
        problems.append(f"{HQ} query heads are not a multiple of {HKV} kv heads")
    if (causal or window) and mask_mod is None:
        problems.append("causal=True or a window without the mask_mod itself (the tiles it cuts apply it)")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        problems.append(f"window {window!r} (keys a row sees, itself included: an int >= 1, or 0 for none)")
    if score_mod is not None and score_grad_mod is None:
        problems.append("a score_mod without its derivative score_grad_mod (SCORE_GRAD_ONE when it is 1)")
    if TQ == 0 or TK == 0:
        problems.append("no query or key rows (the caller returns zeros)")
    if problems:
        _refuse("; ".join(problems))

    curved = _curved(score_grad_mod)
    cfg = config or get_bwd_config(D, DV, grad_mod=curved and mask_mod is None, curved=curved, packed=True)
    cfg = replace(cfg, persistent=False, lpt_order=False)   # the grid walks (KV tile, sequence, head)
    DT, DVT = tile_head_dims(D, DV)
    if cfg.block_m != 64 or not cfg.dq_tma or cfg.split_dkv != (DT > 128) or cfg.kv96 or \
            cfg.smem_bytes(DT, value_head_dim=DVT) > SMEM_LIMIT:
        _refuse(f"config {cfg}: packed sequences run 64-row steps with dQ by TMA reduce-add (split_dkv for D > 128, "
                "not 96-key tiles)")
    d_in = D if DT != D else 0
    if cfg.split_dkv:   # (dQ in the tiled order: sequence starts are no multiple of 64)
        tile = _wide_tile(cfg, DT, DVT, d_in, curved, q.element_size(), dq_frag=False)
    else:
        tile = BwdTile(HEAD_D=DT, NUM_STAGES=cfg.num_stages, HEAD_D_IN=d_in)
    score_mod, score_grad_mod, fold, scalars = _launched_mods(score_mod, score_grad_mod, sm_scale)
    masked = mask_mod is not None
    walk_window = bool(window) and not causal
    sparse = BwdSparsity(HAS_BLOCK_MASK=False, HAS_FULL_BLOCKS=False, Q_TILES_PER_BLK=1, SPARSE_KV=tile.BLOCK_N,
                         CAUSAL_WALK=causal, WINDOW_WALK=walk_window, DENSE_MASK=masked and not causal and not window)
    # EVEN_N off: a sequence's last KV tile holds zeroed keys past its end (bwd_sm90._kv_landed), whose exponent
    # the clamp keeps finite
    flags = _flags(cfg, HQ // HKV, fold, False, score_mod, score_grad_mod)
    # the dense launch's register rules with a mask_mod standing for block-mask tables
    stats_ahead, p_carry16 = _register_rules(cfg, score_mod, masked, DT)
    sched = BwdSchedule(DQ_TMA=True, OVERLAP=cfg.overlap, STATS_AHEAD=stats_ahead, P_REGS=cfg.p_regs,
                        P_CARRY16=p_carry16)

    scratch = scratch if scratch is not None else varlen_backward_scratch(q, k, B, v.shape[2])
    stats, dq_acc, table = scratch
    m_pad = stats.shape[2]
    # a window at least as long as every sequence is causal; the bound keeps the walk's int32 sums in range
    pack = (cu_seqlens_q, cu_seqlens_k, table) + ((min(window, TQ + TK),) if walk_window else ())
    tensors = tensors or launch_tensors(q, k, v, out, dout, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, grad_lse,
                                        scratch, score_bufs, mask_bufs)
    q4, k4, v4, out4, dout4, lse3, dq4, _, _, _, _, grad_lse3 = tensors[:12]
    dummy = placeholder(q.device, torch.int32)
    common = (stats, dq_acc, dk, dv, dummy, dummy, dummy, dummy, tuple(score_bufs), tuple(mask_bufs),
              1, HQ, 1, TQ, TK, m_pad, 1, 1, 1, 1, *scalars)
    kwargs = dict(SCORE_MOD=score_mod, SCORE_GRAD=score_grad_mod, MASK_MOD=mask_mod, TILE=tile, SPARSE=sparse,
                  FLAGS=flags, PACK=BwdPacking(VARLEN=True), num_warps=4, maxnreg=cfg.maxnreg)
    if cfg.split_dkv:   # (192 / 128, 256; 160 and 192 in the 256 tiles): bwd_sm90_wide.py
        lo, hi = tile.LO, tile.HI
        main = (fa3_bwd_sm90_wide_kernel,
                (_desc(q4, [1, 1, tile.BLOCK_M, lo]), _desc(q4, [1, 1, tile.BLOCK_M, hi]),
                 _desc(dout4, [1, 1, tile.BLOCK_M, DVT]), _desc(k4, [1, 1, tile.BLOCK_N, lo]),
                 _desc(k4, [1, 1, tile.BLOCK_N, hi]), _desc(v4, [1, 1, tile.BLOCK_N, DVT]),
                 _dq_acc_desc(dq_acc, tile), *common[:4], None, None, None, *common[4:], (), pack),   # (no DKDV_TMA)
                kwargs, (table.shape[0], HKV))
    else:
        main = (fa3_bwd_sm90_kernel,
                (_desc(q4, [1, 1, tile.BLOCK_M, DT]), _desc(dout4, [1, 1, tile.BLOCK_M, DT]),
                 _desc(k4, [1, 1, tile.BLOCK_N, DT]), _desc(v4, [1, 1, tile.BLOCK_N, DT]), _dq_acc_desc(dq_acc, tile),
                 *common[:4], None, None, *common[4:], (), pack),   # (no DKDV_TMA)
                dict(kwargs, SCHED=sched), (table.shape[0], HKV))
    # the table of virtual KV tiles' sequences (hopper/tile_table.py): a CTA per real KV tile (and at most one empty a
    # sequence), not the longest sequence's count for every sequence: the main kernel 1.06-1.07x faster on
    # 24-document packs, 1.02x on 6 (H200, varlen-train-nvidia-h200-2026-11-30-0201)
    tiles = tile_table_launch(cu_seqlens_k, table, tile.BLOCK_N)
    preprocess, convert = _pass_launches(out4, dout4, lse3, grad_lse3, stats, dq_acc, dq4, m_pad, scalars[2], False, D)
    return [tiles, preprocess, main, convert]


def varlen_backward_scratch(q: torch.Tensor, k: torch.Tensor, batch: int, value_head_dim: Optional[int] = None
                            ) -> tuple[torch.Tensor, ...]:
    """(STATS [HQ, 2, M_PAD], DQ_ACC [HQ, M_PAD, D] float32, the tile table [TK // BLOCK_N + batch + 1] int32) for the
    backward of packed ``q [TQ, HQ, D]``, ``k [TK, HKV, D]`` in ``batch`` sequences: rows up to a tile past the pack
    (the last sequence's last query tile reaches up to 63 rows past it), a virtual KV tile's sequence (BLOCK_N 128
    keys, 64 for the wide head dims' tiles). The table and preprocess launches write them before anything reads them.

    Example::

        >>> [tuple(t.shape) for t in varlen_backward_scratch(torch.empty(1000, 4, 64), torch.empty(1000, 2, 64), 3)]
        [(4, 2, 1088), (4, 1088, 64), (11,)]
    """
    TQ, HQ, D = q.shape
    m_pad = triton.cdiv(TQ, _ROW_PAD) * _ROW_PAD + _ROW_PAD
    block_n = 64 if tile_head_dims(D, value_head_dim or D)[0] > 128 else 128
    return (torch.empty((HQ, 2, m_pad), dtype=torch.float32, device=q.device),
            torch.empty((HQ, m_pad, D), dtype=torch.float32, device=q.device),
            torch.empty((tile_table_size(k.shape[0], batch, block_n),), dtype=torch.int32, device=q.device))


def launch_tensors(q, k, v, out, dout, lse, dq, dk, dv, cu_q, cu_k, grad_lse, scratch, score_bufs, mask_bufs
                   ) -> list[Optional[torch.Tensor]]:
    """Every tensor the launches take, in a fixed order: the packed [1, H, T, D] views of q, k, v, out, dout and
    dq, LSE as [1, HQ, TQ], dk, dv, the offsets, the LSE's gradient (or None), the scratch and the mods' buffers.

    Example::

        >>> t, cu = torch.empty(10, 2, 64), torch.tensor([0, 10], dtype=torch.int32)
        >>> listed = launch_tensors(t, t, t, t, t, torch.empty(2, 10), t, t, t, cu, cu, None, (), (), ())
        >>> tuple(listed[0].shape), tuple(listed[5].shape), listed[11]
        ((1, 2, 10, 64), (1, 2, 10), None)
    """
    dtype = q.dtype
    return [packed_view(q), packed_view(k), packed_view(v), packed_view(out.to(dtype)), packed_view(dout.to(dtype)),
            lse.unsqueeze(0), packed_view(dq), dk, dv, cu_q, cu_k,
            None if grad_lse is None else grad_lse.float().contiguous().unsqueeze(0), *scratch, *score_bufs,
            *mask_bufs]


def launch_varlen_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                           lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, **options: Any) -> None:
    """Run :func:`prepare_varlen_backward`'s launches (``options``: its keywords, ``sm_scale`` required) on an sm90
    GPU; ``dq``, ``dk``, ``dv`` are written in place. No query or key rows at all: zero gradients. The first call of a
    kind (tensor shapes and strides, the grid's tiles, the options) records its launches (runtime/fast_launch.py);
    later ones re-launch them without planning (a training step's host time).

    Example::

        >>> launch_varlen_backward(q, k, v, out, dout, lse, dq, dk, dv, cu_q, cu_k,
        ...                        sm_scale=0.088)   # doctest: +SKIP
    """
    if q.shape[0] == 0 or k.shape[0] == 0:
        for t in (dq, dk, dv):
            t.zero_()
        return
    scratch = varlen_backward_scratch(q, k, cu_seqlens_q.shape[0] - 1, v.shape[2])
    tensors = launch_tensors(q, k, v, out, dout, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                             options.get("grad_lse"), scratch, options.get("score_bufs", ()),
                             options.get("mask_bufs", ()))
    # what a recording depends on besides the tensors (their shapes give the grid): the scale, the mods, the config
    key = ("varlen_bwd", tensor_signature(tensors), aliasing(tensors),
           *((name, value) for name, value in sorted(options.items())
             if name not in ("grad_lse", "score_bufs", "mask_bufs")))
    entries = _RECORDED.get(key)
    if entries is not None:
        for entry in entries:
            relaunch(entry, tensors)
        return
    launches = prepare_varlen_backward(q, k, v, out, dout, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                       scratch=scratch, tensors=tensors, **options)
    recorded_entries = []
    for i, launch in enumerate(launches):
        launch_cached((key, i), tensors, lambda launch=launch: (*launch, "varlen_bwd"))
        recorded_entries.append(recorded((key, i)))   # read at once: a full cache is cleared by the next record
    if all(e is not None for e in recorded_entries):
        if len(_RECORDED) >= _MAX_RECORDED:
            _RECORDED.clear()
        _RECORDED[key] = tuple(recorded_entries)


def compile_varlen_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                            dout: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            cu_seqlens_k: torch.Tensor, **options: Any) -> list[Any]:
    """Compile (not run) the kernels :func:`launch_varlen_backward` launches, for sm90; tensors may be on the
    CPU (needs a process without TRITON_INTERPRET=1). Returns the CompiledKernels in launch order.

    Example::

        >>> table, pre, main, convert = compile_varlen_backward(q, k, v, out, dout, lse, cu_q, cu_k,
        ...                                              sm_scale=0.088)   # doctest: +SKIP
    """
    from triton.backends.compiler import GPUTarget

    from ..aot import compile_launch

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    launches = prepare_varlen_backward(q, k, v, out, dout, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, **options)
    target = GPUTarget("cuda", 90, 32)
    return [compile_launch(kernel, args, kwargs, target) for kernel, args, kwargs, _ in launches]
