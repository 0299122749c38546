"""Host side of the FP8 prologue: check the inputs, allocate the FP8 operands, launch kernel.py.

``quantize(q, k, v, recipe, rope)`` is the entry: one launch of ``prologue_kernel`` (after a
``k_sums_kernel`` launch when ``recipe.smooth_k``) on CUDA tensors or under Triton's interpreter;
on CPU tensors without the interpreter, the same math in torch ops (reference.py, float64).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import triton

from ...fp8_recipe import FP8Operands, FP8Recipe, RopeSpec
from ...runtime.fast_launch import aliasing, launch_cached, on_clear, recorded, tensor_signature
from .hadamard import hadamard_block, sign_hadamard
from .kernel import Quantization, Rotation, Tiles, k_mean_kernel, k_sums_kernel, prologue_kernel
from .reference import SMOOTH_SAMPLE

MAX_HEAD_DIM = 256
# Rows a program holds at once: 128 (BLOCK_D <= 128), 32 above: a 64-row tile of 256 fp32 columns
# spilled on sm90 (Triton 3.6, 8 warps: 262 spill instructions; 32 rows: none).
MAX_TILE = 128
MAX_TILE_WIDE = 32
SMOOTH_ROWS = 32        # smooth_k's pre-pass: sample rows per program (one partial sum each)
SMOOTH_CHUNKS = SMOOTH_SAMPLE // SMOOTH_ROWS   # partial K sums per head, at most
INTERPRETER_SMS = 2     # the interpreter runs programs one by one: a small grid walks the loops


@dataclasses.dataclass(frozen=True)
class PrologueTuning:
    """Launch parameters of ``prologue_kernel`` (never its math): ``benchmarks/fp8_prologue_bw.py
    --sweep`` times the candidates on a GPU.

    - ``num_warps``: None: :func:`tuned_launch`'s choice for the head dim and RoPE;
    - ``num_stages``: software pipelining depth of the persistent loops: 2 loads the next group
      (cp.async into shared memory) while the current one is rotated and stored; 1: no overlap
      within a program; None: :func:`tuned_launch`'s choice;
    - ``programs_per_sm``: persistent programs per SM; None: as many as fit at once (the compiled
      kernel's registers and shared memory); 0: one program per group (no loop);
    - ``maxnreg``: a register cap per thread (None: the compiler's choice);
    - ``rope_select``: RoPE's select (kernel.Rotation.ROPE_SELECT) on or off at this launch; None:
      :func:`rope_select`'s rule. The operands are the same either way; the sweep times both sides
      where the rule's choice is close (spills against instructions);
    - ``kernel``: "triton" (kernel.py) or "gluon" (gluon_sm90.py, the hot case on sm90 only; other
      calls keep the Triton kernel); None: ``default_kernel(head dim)``. The operands are the same, bit for bit;
    - ``gluon_stages``: the Gluon kernel's ring depth (None: gluon_sm90.default_stages); with
      ``kernel="gluon"``, ``programs_per_sm`` sets its programs an SM (None:
      gluon_sm90.default_programs_per_sm, 2 at D 64 without RoPE, else 1);
    - ``gluon_rope_release``: with RoPE at D 128, the Gluon kernel releases a tile's ring slot
      inside its RoPE, under the previous tile's wgmma (True), or after the previous tile's amax
      barrier (False: one barrier fewer a tile, but on the chain between two wgmmas); None: False
      since the H200 sweep of 2026-11-29 (gluon_sm90.GluonPrologue.ROPE_RELEASE). The same
      operations either way;
    - ``gluon_rope_words``: RoPE "half" on the Gluon kernel reads Q / K from the ring as int32
      pair words, widened by a shift and a mask (True), or as bf16 / fp16 values widened the
      generic way (False: two instructions for every odd channel); None: True
      (gluon_sm90._ring_half). RoPE "interleaved" (Q / K read as words either way): its cos / sin
      tables read as int32 pair words and held as fp32 (True: 16-byte loads, 8 a thread a unit),
      or gathered 2 bytes at a time (False: 64; gluon_sm90._table_parts). The same values
      either way;
    - ``gluon_pdl``: smooth_k on the Gluon kernel: its two pre-passes (k_sums_kernel,
      k_mean_kernel) and the kernel chained by programmatic dependent launch, the Q tiles running
      under the pre-passes (True), or three launches in stream order (False); None: True.

    Example::

        >>> PrologueTuning(num_warps=4, num_stages=1).programs_per_sm is None
        True
    """

    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    programs_per_sm: Optional[int] = None
    maxnreg: Optional[int] = None
    rope_select: Optional[bool] = None
    kernel: Optional[str] = None
    gluon_stages: Optional[int] = None
    gluon_rope_release: Optional[bool] = None
    gluon_rope_words: Optional[bool] = None
    gluon_pdl: Optional[bool] = None


DEFAULT_TUNING = PrologueTuning()

# Which kernel serves the hot case (gluon_sm90.serves: D = Dv in {64, 128}, Hadamard, 128-row blocks,
# no smooth_k, RoPE none or full-width with 2-byte tables) on sm90, by head dim. The H200 sweep
# fp8-prologue-bw-nvidia-h200-2026-11-29-0620 (N 16384, Hkv 16; docs/design/fp8_prologue.md):
# D128 Gluon 0.098 / 0.119 / 0.124 ms (plain / RoPE / interleaved RoPE) against Triton's 0.110 /
# 0.172 / 0.168; D64 Gluon 0.053-0.055 / 0.071 / 0.075 against 0.051 / 0.070 / 0.072, so D64 keeps
# the Triton kernel. Everything else always takes the Triton kernel.
DEFAULT_KERNEL = {64: "triton", 128: "gluon"}

# (widest head dim rounded up to a power of two, <= 64 or 128; RoPE) -> (warps, stages, register cap):
# the --sweep of fp8-prologue-bw-nvidia-h100-80gb-hbm3-2026-11-25-0627 (H100, N 16384 Hkv 16): the
# fastest of 8 candidates per row. D64: 4 warps, 2 stages without RoPE (2.45 TB/s, one stage 2.34),
# 3 stages with (1.60); D128 without RoPE 4 warps, 2 stages (2.45; 8 warps 2.46, equal); D128 with
# RoPE one stage of 8 warps capped at 128 registers (1.56 against 1.29 with two uncapped stages,
# 1.43 with 4 warps): two programs an SM beat one with prefetching.
# Since RoPE is rounded to the input dtype (2026-11-29) the RoPE rows are chosen from sm90 SASS read
# on the CPU (bf16 tables; docs/design/fp8_prologue.md), awaiting a GPU sweep: D64 now 4 warps, 2
# stages capped at 168 registers (182 uncapped): no spills (2 spill instructions with smooth_k
# "half"), three programs an SM with prefetching, for 1% more instructions (3 stages, 175 registers,
# hold 108 KB of shared memory: two programs an SM). D128 keeps the measured choice, whose spills
# fell from 150 to 48 instructions; 4 warps, 2 stages still spill (26), and 8 uncapped warps (186
# registers, no spills) hold one program an SM.
# D128 with RoPE runs RoPE's select there (rope_select: 128 registers for 64 tile values a thread):
# spill instructions 48 -> 4 ("half", +6% Q / K loop instructions) and 44 -> 0 ("interleaved", -3%).
_TUNED = {(64, False): (4, 2, None), (64, True): (4, 2, 168), (128, False): (4, 2, None),
          (128, True): (8, 1, 128)}
# RoPE tables of 4-byte values (float32: RopeSpec.from_theta's; models pass bf16), by head dim, from
# sm90 SASS (2026-11-29), awaiting the sweep's rope-f32 rows: at D128 the launch above spills 288 /
# 258 instructions ("half" / "interleaved") even with the select (444 / 602 without), its float32
# table parts read from shared memory into the dot-operand layout; two uncapped stages of 8 warps
# (the select off) do not spill (186 / 182 registers) and prefetch, with 1158 / 1130 Q / K loop
# instructions against 1453 / 1438, but hold one program an SM (208 KB of shared memory). D64 keeps
# its launch (no spills with float32 tables). Measured (rope-f32 rows of the --sweep in
# fp8-prologue-bw-nvidia-h200-2026-11-29-0417, H200, D128 N16384 Hkv16, no smoothing): 0.254 ms,
# against 0.265 for the bf16 launch above; one stage of 4 warps (the select on) took 0.240 but spills
# 320-416 bytes with smooth_k, so this spill-free launch stays.
_TUNED_F32_TABLES = {128: (8, 2, None)}


def tuned_launch(head_dim: int, rope: bool, table_bytes: int = 2) -> tuple[int, int, Optional[int]]:
    """(num_warps, num_stages, maxnreg) of ``prologue_kernel`` for the widest of the Q/K and V head
    dims, with or without RoPE (``table_bytes``: bytes per RoPE table value): the measured table
    above; 8 warps, 2 stages past 128 columns.

    Example::

        >>> tuned_launch(128, rope=True)
        (8, 1, 128)
        >>> tuned_launch(128, rope=True, table_bytes=4)
        (8, 2, None)
    """
    wide = max(64, triton.next_power_of_2(head_dim))
    if rope and table_bytes > 2 and wide in _TUNED_F32_TABLES:
        return _TUNED_F32_TABLES[wide]
    return _TUNED.get((wide, rope), (8, 2, None))


# RoPE's select (kernel.Rotation.ROPE_SELECT) goes on below this many registers per tile value a
# thread holds. sm90 SASS, Triton 3.6, D128 (8 warps: 64 values a thread, 4 warps: 128) and D64 (4
# warps: 64), bf16 and float32 tables, 1 and 2 stages (docs/design/fp8_prologue.md, 2026-11-29):
# at 2 (128 registers, 8 warps; 255, 4 warps) and below, the select removes all or most spills
# (D128 8 warps, 1 stage: 48 -> 4 / 44 -> 0 with bf16 tables, 444 -> 288 / 602 -> 258 with
# float32 ones; 2 stages: 20-68 -> 0); at 2.6 (168 registers for 64 values) and above neither
# version spills with bf16 tables (2 instructions at most) and the select costs up to 12% more Q / K
# loop instructions.
SELECT_REGS_PER_VALUE = 2.5


def rope_select(rope: bool, tile_rows: int, block_d: int, num_warps: int,
                maxnreg: Optional[int]) -> bool:
    """Whether RoPE's rounded parts pass a select before the Hadamard dots at a launch
    (kernel.Rotation.ROPE_SELECT): where the launch leaves a thread fewer than
    SELECT_REGS_PER_VALUE registers (the cap, else 255) per tile value it holds (tile_rows x
    block_d over the threads). Triton moves the dot-operand layout conversion above elementwise
    ops, so without the select RoPE runs in the wgmma operand layout, its inputs read from shared
    memory straight into it: fewer instructions where registers suffice, spills where they are
    short; the select keeps RoPE in the blocked layout. (Under 64 rows, head dims over 128, the
    kernel applies it at every launch: mma.sync's operand layout holds each row on every warp.)

    Example::

        >>> rope_select(True, 128, 128, num_warps=8, maxnreg=128)    # D128's tuned launch
        True
        >>> rope_select(True, 128, 64, num_warps=4, maxnreg=168)     # D64's
        False
    """
    values = tile_rows * block_d // (32 * num_warps)
    return rope and (maxnreg or 255) < SELECT_REGS_PER_VALUE * values


@dataclasses.dataclass
class PrologueLaunch:
    """The launches of one ``quantize`` call, in order, and the operands they fill.

    ``launches``: ``(kernel, args, kwargs, grid)`` tuples (the reduction pass first when
    smoothing); ``operands``: the FP8Operands written by them (v_scale_max still holds -1 for heads
    whose V is all zero until :func:`finish` maps it to 1)."""

    launches: list[tuple[Any, tuple, dict, tuple]]
    operands: FP8Operands


def _check_inputs(q: Any, k: Any, v: Any, recipe: Any, rope: Any) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"quantize: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"quantize: {name} must be 4-D [batch, heads, tokens, head_dim], got "
                             f"shape {tuple(t.shape)}")
        if t.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"quantize: {name} must be bfloat16 or float16, got {t.dtype}; cast it "
                            "first (e.g. .to(torch.bfloat16))")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"quantize: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"quantize: q, k, v must be on one device, got {q.device}, {k.device}, "
                         f"{v.device}")
    if not isinstance(recipe, FP8Recipe):
        raise TypeError(f"quantize: recipe must be an fa3_inductor FP8Recipe, got "
                        f"{type(recipe).__name__}")
    B, Hq, M, D = q.shape
    _, Hkv, N, Dv = v.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"quantize: q, k, v must share the batch size, got {q.shape[0]}, "
                         f"{k.shape[0]}, {v.shape[0]}")
    if k.shape[1] != Hkv or k.shape[2] != N:
        raise ValueError(f"quantize: k and v must have the same heads and tokens, got k "
                         f"{tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[3] != D:
        raise ValueError(f"quantize: q and k must share the head dim, got {D} and {k.shape[3]}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"quantize: the query heads ({Hq}) must be a multiple of the key/value "
                         f"heads ({Hkv}) (grouped-query attention)")
    for name, d in (("q/k head dim", D), ("v head dim", Dv)):
        if d % 16 or not 16 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"quantize: the {name} must be a multiple of 16 in [16, "
                             f"{MAX_HEAD_DIM}], got {d}; pad the head dim with zeros")
    if B == 0 or Hq == 0 or M == 0 or N == 0:
        raise ValueError(f"quantize: empty inputs (q {tuple(q.shape)}, k {tuple(k.shape)})")
    if rope is not None:
        _check_rope(rope, B, M, N, D, q.device)


def _check_rope(rope: Any, B: int, M: int, N: int, D: int, device: torch.device) -> None:
    if not isinstance(rope, RopeSpec):
        raise TypeError(f"quantize: rope must be an fa3_inductor RopeSpec, got {type(rope).__name__}")
    cos, sin = rope.cos, rope.sin
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"quantize: RopeSpec.{name} must be a floating-point tensor")
        if t.device != device:
            raise ValueError(f"quantize: RopeSpec.{name} is on {t.device}, the inputs on {device}")
    if cos.shape != sin.shape or cos.dim() not in (2, 3):
        raise ValueError(f"quantize: RopeSpec.cos and .sin must both be [P, R] or [B, P, R], got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dim() == 3 and cos.shape[0] not in (1, B):
        raise ValueError(f"quantize: batched RoPE tables must have batch 1 or {B}, got {cos.shape[0]}")
    P, R = cos.shape[-2], cos.shape[-1]
    if R % 2 or not 2 <= R <= D:
        raise ValueError(f"quantize: the RoPE tables' width R = {R} (rotated channels) must be even "
                         f"and at most the head dim {D}")
    for name, pos, length in (("q_positions", rope.q_positions, M),
                              ("k_positions", rope.k_positions, N)):
        if pos is None:
            if length > P:
                raise ValueError(f"quantize: {length} tokens need {name} or a RoPE table of at "
                                 f"least {length} rows (it has {P})")
            continue
        if not isinstance(pos, torch.Tensor) or pos.is_floating_point() or pos.is_complex():
            raise TypeError(f"quantize: RopeSpec.{name} must be an integer tensor")
        if pos.device != device:
            raise ValueError(f"quantize: RopeSpec.{name} is on {pos.device}, the inputs on {device}")
        if pos.dim() not in (1, 2) or pos.shape[-1] != length or (pos.dim() == 2
                                                                  and pos.shape[0] not in (1, B)):
            raise ValueError(f"quantize: RopeSpec.{name} must be [{length}] or [{B}, {length}], "
                             f"got {tuple(pos.shape)}")
        if pos.device.type == "cpu" and (int(pos.min()) < 0 or int(pos.max()) >= P):
            raise ValueError(f"quantize: RopeSpec.{name} must lie in [0, {P}) (the table's rows), "
                             f"got [{int(pos.min())}, {int(pos.max())}]")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _interpreting() -> bool:
    from triton import knobs

    return bool(knobs.runtime.interpret)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


_RESIDENT: dict = {}     # (device, launch key) -> programs per SM that fit at once


def _programs(kernel: Any, args: tuple, kwargs: dict, groups: int, tuning: PrologueTuning,
              device: torch.device) -> int:
    """The persistent grid: programs per SM (tuning, else as many as the compiled kernel's
    registers, shared memory and warps let one SM hold) times the SM count, at most ``groups``."""
    if tuning.programs_per_sm == 0:
        return groups
    if device.type != "cuda":
        return min(groups, (tuning.programs_per_sm or 1) * INTERPRETER_SMS)
    props = torch.cuda.get_device_properties(device)
    per_sm = tuning.programs_per_sm
    if per_sm is None:
        key = (device.index, *sorted(kwargs.items()))     # frozen dataclasses and ints
        per_sm = _RESIDENT.get(key)
        if per_sm is None:
            with torch.cuda.device(device):
                compiled = kernel.warmup(*args, grid=(1,), **kwargs)
                compiled._init_handles()          # loads the cubin: n_regs is known from here
            warps = kwargs["num_warps"]
            regs = -(-max(compiled.n_regs, 1) // 8) * 8 * 32 * warps   # allocated per warp, by 256
            smem = compiled.metadata.shared + 1024                    # 1 KB reserved per CTA
            per_sm = max(1, min(getattr(props, "regs_per_multiprocessor", 65536) // regs,
                                props.shared_memory_per_multiprocessor // smem,
                                props.max_threads_per_multi_processor // (32 * warps)))
            _RESIDENT[key] = per_sm
    return min(groups, per_sm * props.multi_processor_count)


def default_kernel(head_dim: int) -> str:
    """The prologue kernel a call at this head dim takes without ``PrologueTuning(kernel=)``
    (where gluon_sm90 serves it; "triton" everywhere else).

    Example::

        >>> default_kernel(128), default_kernel(64), default_kernel(256)
        ('gluon', 'triton', 'triton')
    """
    return DEFAULT_KERNEL.get(head_dim, "triton")


def _takes_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: FP8Recipe,
                 rope: Optional[RopeSpec], tuning: PrologueTuning,
                 capability: Optional[tuple[int, int]]) -> bool:
    """The Gluon kernel serves this call: chosen (tuning.kernel, else default_kernel), an sm90
    target (the device's, or ``capability`` when compiling without one), not interpreting, and the
    hot case (gluon_sm90.serves)."""
    if (tuning.kernel or default_kernel(q.shape[-1])) != "gluon" or _interpreting():
        return False
    if capability is None:
        if q.device.type != "cuda":
            return False
        capability = torch.cuda.get_device_capability(q.device)
    if tuple(capability) != (9, 0):
        return False
    from . import gluon_sm90

    return gluon_sm90.serves(q, k, v, recipe, rope)


def kernel_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: FP8Recipe,
               rope: Optional[RopeSpec] = None, tuning: PrologueTuning = DEFAULT_TUNING,
               capability: Optional[tuple[int, int]] = None) -> str:
    """"gluon" where :func:`prepare_prologue` would launch gluon_sm90's kernel, else "triton".

    Example::

        >>> q = torch.empty(1, 2, 256, 128, dtype=torch.bfloat16)
        >>> kernel_for(q, q, q, FP8Recipe(), tuning=PrologueTuning(kernel="gluon"),
        ...            capability=(9, 0)) in ("gluon", "triton")    # "triton" when interpreting
        True
    """
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    return "gluon" if _takes_gluon(q, k, v, recipe, rope, tuning, capability) else "triton"


def prepare_prologue(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: FP8Recipe,
                     rope: Optional[RopeSpec] = None, *,
                     round_in_fp32: Optional[bool] = None,
                     tuning: PrologueTuning = DEFAULT_TUNING,
                     capability: Optional[tuple[int, int]] = None) -> PrologueLaunch:
    """The launches of ``quantize`` (checked inputs, allocated outputs), not yet run.
    ``round_in_fp32`` None: on under the interpreter only (kernel.py, Quantization); ``tuning``:
    the main launch's parameters (:class:`PrologueTuning`); ``capability``: the target when
    compiling without a device (compile_prologue), for the Gluon kernel's choice. What does not
    depend on the tensors' contents or addresses is derived once per signature (:class:`PrologueLayout`).

    Example::

        >>> p = prepare_prologue(q, k, v, FP8Recipe())               # doctest: +SKIP
        >>> for kernel, args, kwargs, grid in p.launches:             # doctest: +SKIP
        ...     kernel[grid](*args, **kwargs)
    """
    layout = layout_of(q, k, v, recipe, rope, round_in_fp32=round_in_fp32, tuning=tuning,
                       capability=capability)
    ops, inputs = layout.bind(q, k, v, rope)
    return PrologueLaunch([prepare() for _, prepare in layout.launches(inputs, ops)], ops)


_MAX_LAYOUTS = 256
_LAYOUTS: dict = {}     # _layout_key(...) -> PrologueLayout
on_clear(_LAYOUTS.clear)   # its launch keys name the launch cache's entries: forgotten with them


def _layout_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: Any, rope: Any,
                round_in_fp32: Optional[bool], tuning: Any,
                capability: Optional[tuple[int, int]]) -> Optional[tuple]:
    """Everything a layout depends on, or None for inputs the cache does not take (not plain
    tensors: the checks then run and say what is wrong)."""
    if not (type(q) is type(k) is type(v) is torch.Tensor) or type(recipe) is not FP8Recipe:
        return None
    tensors: tuple = (q, k, v)
    style = None
    if rope is not None:
        if type(rope) is not RopeSpec:
            return None
        tensors += (rope.cos, rope.sin, rope.q_positions, rope.k_positions)
        if not all(t is None or type(t) is torch.Tensor for t in tensors[3:]):
            return None
        style = rope.style
    try:
        signature = tensor_signature(tensors)
    except (NotImplementedError, RuntimeError):   # no address to read (meta tensors): not cached
        return None
    # the interpreter's flag and fp32 rounding are constexprs of the launch
    return (recipe, style, round_in_fp32, tuning, capability, _interpreting(), signature,
            aliasing(tensors))


def layout_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: FP8Recipe,
              rope: Optional[RopeSpec] = None, *, round_in_fp32: Optional[bool] = None,
              tuning: PrologueTuning = DEFAULT_TUNING,
              capability: Optional[tuple[int, int]] = None) -> "PrologueLayout":
    """The :class:`PrologueLayout` of these inputs (checked; raises TypeError / ValueError saying
    what is wrong), cached per (shapes, strides, dtypes, device and 16-byte alignment of q, k, v
    and of RoPE's tensors, which of them are one tensor, recipe, RoPE style, ``round_in_fp32``,
    ``tuning``, ``capability`` (prepare_prologue's), interpreter on or off). RoPE positions on the CPU are checked against the table on every call (their values).

    Example::

        >>> layout_of(q, k, v, FP8Recipe()) is layout_of(q2, k2, v2, FP8Recipe())   # doctest: +SKIP
        True
    """
    key = _layout_key(q, k, v, recipe, rope, round_in_fp32, tuning, capability)
    layout = None if key is None else _LAYOUTS.get(key)
    if layout is None:
        _check_inputs(q, k, v, recipe, rope)
        layout = PrologueLayout(q, k, v, recipe, rope, round_in_fp32, tuning, key, capability)
        if key is not None:
            if len(_LAYOUTS) >= _MAX_LAYOUTS:
                _LAYOUTS.clear()
            _LAYOUTS[key] = layout
    else:
        check_positions(q, k, rope)
    return layout


def check_positions(q: torch.Tensor, k: torch.Tensor, rope: Optional[RopeSpec]) -> None:
    """The check :func:`layout_of` makes on every call that finds its layout cached: RoPE positions
    on the CPU must lie in the table (their values; positions on a GPU are clamped, not read). A
    caller that keeps a layout and re-binds it (flex()'s FP8 call memo) makes it too.

    Example::

        >>> check_positions(q, k, None)   # no RoPE: nothing to check           # doctest: +SKIP
    """
    if rope is not None and (_cpu(rope.q_positions) or _cpu(rope.k_positions)):
        _check_rope(rope, q.shape[0], q.shape[2], k.shape[2], q.shape[3], q.device)


def _cpu(t: Optional[torch.Tensor]) -> bool:
    return t is not None and t.device.type == "cpu"


class PrologueLayout:
    """What ``prepare_prologue`` derives from the inputs' signature alone: the operands' shapes
    and dtypes, the launches' constexpr bundles and launch options, strides and sizes, the
    Hadamard matrix, the grids. Per call only :meth:`bind` runs (allocate the operands, make the
    few views and copies the launch reads) and the launches.

    ``kernels``: ``(kernel, kwargs)`` per launch, in order (smooth_k's reduction pass first).

    Example::

        >>> layout = layout_of(q, k, v, FP8Recipe())                        # doctest: +SKIP
        >>> ops, inputs = layout.bind(q, k, v, None)                        # doctest: +SKIP
        >>> [kernel.fn.__name__ for kernel, _ in layout.kernels]            # doctest: +SKIP
        ['prologue_kernel']
    """

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: FP8Recipe,
                 rope: Optional[RopeSpec], round_in_fp32: Optional[bool], tuning: PrologueTuning,
                 key: Optional[tuple], capability: Optional[tuple[int, int]] = None):
        B, Hq, M, D = q.shape
        _, Hkv, N, Dv = v.shape
        dev = q.device
        n_pad = -(-N // 16) * 16
        block_d, block_dv = _pow2(D), _pow2(Dv)
        cap = MAX_TILE if max(block_d, block_dv) <= 128 else MAX_TILE_WIDE
        tile_m = min(recipe.block_m or cap, cap)
        tile_n = min(recipe.block_n or cap, cap)
        qg = -(-M // recipe.block_m) if recipe.block_m else 1
        kg = -(-N // recipe.block_n) if recipe.block_n else 1
        shape = Tiles(D=D, DV=Dv, BLOCK_D=block_d, BLOCK_DV=block_dv, TILE_M=tile_m, TILE_N=tile_n,
                      Q_ONE_TILE=recipe.block_m == tile_m, KV_ONE_TILE=recipe.block_n == tile_n)

        # In the inputs' dtype: the dots take input values, RoPE's rounded to it (kernel.py, _hadamard).
        self.had = sign_hadamard(D, recipe.seed, q.dtype, dev, pad_to=block_d)
        # RoPE's tables as the kernel reads them: [Z, P, R], cos and sin with the same strides
        # (they share the offsets), else both made contiguous
        self.tables_copied = False
        stride_tz = stride_tp = P = rope_dim = stride_qpz = stride_kpz = 0
        if rope is not None:
            cos, sin = self._tables(rope)
            stride_tz = cos.stride(0) if cos.shape[0] > 1 else 0
            stride_tp, P, rope_dim = cos.stride(1), cos.shape[1], cos.shape[-1]
            stride_qpz, stride_kpz = (self._pos_stride(pos)
                                      for pos in (rope.q_positions, rope.k_positions))
        interpret = _interpreting()
        warps, stages, regs = tuned_launch(max(D, Dv), rope is not None,
                                           rope.cos.element_size() if rope is not None else 2)
        num_warps = tuning.num_warps or warps
        num_stages = tuning.num_stages or stages
        maxnreg = tuning.maxnreg if tuning.num_warps or tuning.num_stages or tuning.maxnreg else regs
        select = rope_select(rope is not None, max(tile_m, tile_n), block_d, num_warps, maxnreg)
        if rope is not None and tuning.rope_select is not None:
            select = tuning.rope_select
        rot = Rotation(HADAMARD=recipe.hadamard, HAD_SCALE=hadamard_block(D) ** -0.5,
                       ROPE=rope.style if rope is not None else "", ROPE_DIM=rope_dim,
                       HALF_BLOCK=_pow2(rope_dim // 2),
                       REST_BLOCK=_pow2(D - rope_dim) if D > rope_dim else 0,
                       Q_POS=rope is not None and rope.q_positions is not None,
                       K_POS=rope is not None and rope.k_positions is not None,
                       INTERPRETED=interpret, ROPE_SELECT=select)
        quant = Quantization(QK_INT8=recipe.qk == "int8", SMOOTH_K=recipe.smooth_k,
                             SMOOTH_CHUNKS=SMOOTH_CHUNKS, SMOOTH_ROWS=SMOOTH_ROWS,
                             ROUND_IN_FP32=interpret if round_in_fp32 is None else round_in_fp32)

        fp8 = torch.float8_e4m3fn
        self.recipe, self.n, self.device = recipe, N, dev
        qk_dtype = torch.int8 if recipe.qk == "int8" else fp8
        # (shape, dtype) of q, k, vt, q_scale, k_scale, v_scale, v_scale_max, k_mean
        self.outputs = (((B, Hq, M, D), qk_dtype), ((B, Hkv, N, D), qk_dtype),
                        ((B, Hkv, Dv, n_pad), fp8), ((B, Hq, qg), torch.float32),
                        ((B, Hkv, kg), torch.float32), ((B, Hkv, kg), torch.float32))
        self.scale_max_shape = (B, Hkv)
        self.k_mean_shape = (B, Hkv, D) if recipe.smooth_k else None
        self.k_part_shape = (B * Hkv, SMOOTH_CHUNKS, block_d) if recipe.smooth_k else None

        # smooth_k's pre-pass reads S = min(N, 256) sampled rows per head (reference.smooth_sample),
        # SMOOTH_ROWS per program: a few percent of K's bytes, where a pass over all of K cost 15-30%
        # of the prologue (H100, fp8-prologue-bw-nvidia-h100-80gb-hbm3-2026-11-25-0026).
        n_sample = min(N, SMOOTH_SAMPLE)
        n_chunks = -(-n_sample // SMOOTH_ROWS)
        nq, nk = B * Hq * qg, B * Hkv * kg
        self.k_strides = tuple(k.stride()[:3]) if k.stride(-1) == 1 else (Hkv * N * D, N * D, D)
        self.q_strides = tuple(q.stride()[:3]) if q.stride(-1) == 1 else (Hq * M * D, M * D, D)
        self.v_strides = tuple(v.stride()[:3]) if v.stride(-1) == 1 else (Hkv * N * Dv, N * Dv, Dv)
        self.ksum_scalars = (stride_tz, stride_tp, stride_kpz, Hkv, N, n_sample, P)
        self.main_scalars = (stride_tz, stride_tp, stride_qpz, stride_kpz,
                             B, Hq, Hkv, M, N, n_pad, P, nq, nk, qg, kg,
                             recipe.block_m or M, recipe.block_n or n_pad, n_chunks, n_sample)
        self.kernels: list[tuple[Any, dict]] = []
        self._grids: list[Optional[tuple]] = []
        if recipe.smooth_k:
            self.kernels.append((k_sums_kernel, dict(SHAPE=shape, ROT=rot, QUANT=quant, num_warps=4,
                                                     num_stages=1)))
            self._grids.append((B * Hkv, n_chunks))
        # Persistent programs loop over the groups (kernel.py): as many as the SMs hold at once.
        kwargs = dict(SHAPE=shape, ROT=rot, QUANT=quant, num_warps=num_warps, num_stages=num_stages)
        if maxnreg:
            kwargs["maxnreg"] = maxnreg
        self.kernels.append((prologue_kernel, kwargs))
        self._grids.append(None)        # _programs' choice, on the first bind (it compiles the kernel)
        # smooth_k on the Gluon kernel: K's mean per head (kernel._k_mean, the Triton K programs'
        # operations) between the pre-pass and it (launches()). With tuning.gluon_pdl (default on)
        # the three launches are chained by programmatic dependent launch: k_sums lets k_mean
        # start, k_mean lets the Gluon kernel start, whose Q tiles run under the pre-passes;
        # k_mean waits for k_sums, the Gluon K tiles for k_mean.
        pdl = tuning.gluon_pdl is None or bool(tuning.gluon_pdl)
        self._k_mean = (k_mean_kernel, dict(D=D, BLOCK_D=block_d, QUANT=quant, num_warps=1,
                                            PDL=pdl, **({"launch_pdl": True} if pdl else {})),
                        (B * Hkv,), (n_chunks, n_sample), pdl) if recipe.smooth_k else None
        self._groups, self._tuning = max(nq, nk), tuning
        self.key = key
        # The hot case on sm90 takes gluon_sm90's kernel instead of the launches above (_takes_gluon)
        self.gluon = _takes_gluon(q, k, v, recipe, rope, tuning, capability)
        # "interleaved" RoPE: the Gluon kernel's HAD rows in pair order, made once (gluon_launch)
        self._gluon_rows = None
        if self.gluon and rope is not None and rope.style == "interleaved":
            from .gluon_sm90 import interleaved_rows

            self._gluon_rows = interleaved_rows(self.had)
        self._gluon_statics = (stride_tz, stride_tp, stride_qpz, stride_kpz, P,
                               rope.style if rope is not None else "",
                               rope is not None and rope.q_positions is not None,
                               rope is not None and rope.k_positions is not None)

    def _tables(self, rope: RopeSpec, batch_axis: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin as the launches read them; ``batch_axis`` False leaves [P, R] tables without
        the batch axis a first launch's arguments show (the same address: :meth:`inputs_of` ``recorded``)."""
        cos, sin = _last_dim_contiguous(rope.cos), _last_dim_contiguous(rope.sin)
        if batch_axis and cos.dim() == 2:
            cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        if sin.stride() != cos.stride():     # cos and sin share the offsets: same strides
            sin, cos = sin.contiguous(), cos.contiguous()
        return cos, sin

    @staticmethod
    def _pos(pos: torch.Tensor) -> torch.Tensor:
        return _last_dim_contiguous(pos if pos.dim() == 2 else pos.unsqueeze(0))

    @classmethod
    def _pos_stride(cls, pos: Optional[torch.Tensor]) -> int:
        """The batch stride of a positions tensor as the kernel reads it (0: shared by the batch)."""
        if pos is None:
            return 0
        pos = cls._pos(pos)
        return pos.stride(0) if pos.shape[0] > 1 else 0

    def bind(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Optional[RopeSpec]
             ) -> tuple[FP8Operands, tuple]:
        """This call's operands (allocated, not yet written) and the launches' tensors, in the
        order :meth:`args` reads them: q, k, v, the operands, K's partial sums (None without
        smoothing), k_mean (None), the Hadamard matrix, cos, sin, q and k positions (None without);
        for the Gluon kernel with "interleaved" RoPE then q and k as int32 words and its HAD rows.
        ``q, k, v, rope`` must have this layout's signature (layout_of's key)."""
        ops, k_part = self.allocate()
        return ops, self.inputs_of(ops, k_part, q, k, v, rope)

    def allocate(self, fill: bool = True) -> tuple[FP8Operands, Optional[torch.Tensor]]:
        """(the operands, K's partial sums or None): fresh tensors of this layout, not yet written;
        ``fill``: v_scale_max filled with -1, as the launches need it (:meth:`bind`). A caller that
        keeps them for later calls fills v_scale_max itself before each (runtime.ops_fp8's memo)."""
        dev = self.device
        (sq, dq), (sk, dk), (svt, dvt), (sqs, f32), (sks, _), (svs, _) = self.outputs
        # v_scale_max starts at -1, below every scale: the kernel's atomic max of the scales of V's
        # nonzero blocks (all positive) is exact, and heads whose V is all zero keep -1 for
        # finish() to map to 1 with one abs_ (torch.where(x > 0, x, 1) took gt, where and a scalar)
        k_mean = None if self.k_mean_shape is None else torch.empty(self.k_mean_shape, dtype=f32,
                                                                    device=dev)
        ops = FP8Operands(q=torch.empty(sq, dtype=dq, device=dev),
                          k=torch.empty(sk, dtype=dk, device=dev),
                          vt=torch.empty(svt, dtype=dvt, device=dev),
                          q_scale=torch.empty(sqs, dtype=f32, device=dev),
                          k_scale=torch.empty(sks, dtype=f32, device=dev),
                          v_scale=torch.empty(svs, dtype=f32, device=dev),
                          v_scale_max=(torch.full(self.scale_max_shape, -1.0, dtype=f32, device=dev)
                                       if fill else
                                       torch.empty(self.scale_max_shape, dtype=f32, device=dev)),
                          k_mean=k_mean, recipe=self.recipe, n=self.n)
        k_part = None if self.k_part_shape is None else torch.empty(self.k_part_shape, dtype=f32,
                                                                    device=dev)
        return ops, k_part

    def inputs_of(self, ops: FP8Operands, k_part: Optional[torch.Tensor], q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, rope: Optional[RopeSpec],
                  recorded: bool = False) -> tuple:
        """The launches' tensors (:meth:`bind`'s second item) over :meth:`allocate`'s operands.
        ``recorded``: for this layout's recorded launches only (:meth:`recorded_launches`), which
        read RoPE's tables as addresses: [P, R] tables are left without the batch axis a first
        launch's arguments show (the same address, the strides are the layout's), two views fewer."""
        if rope is None:
            cos = sin = qpos = kpos = None
        else:
            cos, sin = self._tables(rope, batch_axis=not recorded)
            qpos, kpos = (None if p is None else self._pos(p) for p in (rope.q_positions,
                                                                          rope.k_positions))
        q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
        inputs = (q, k, v, ops.q, ops.k, ops.vt, ops.q_scale, ops.k_scale, ops.v_scale,
                  ops.v_scale_max, k_part, ops.k_mean, self.had, cos, sin, qpos, kpos)
        if self._gluon_rows is not None:   # the Gluon kernel's int32 views and HAD rows, as inputs
            inputs += (q.view(torch.int32), k.view(torch.int32), self._gluon_rows)
        return inputs

    def args(self, i: int, inputs: tuple) -> tuple:
        """The positional arguments of launch ``i`` on :meth:`bind`'s ``inputs``."""
        (q, k, v, oq, ok, ovt, q_scale, k_scale, v_scale, v_scale_max, k_part, k_mean, had, cos, sin,
         qpos, kpos) = inputs[:17]
        cos = had if cos is None else cos
        sin = had if sin is None else sin
        qpos = had if qpos is None else qpos
        kpos = had if kpos is None else kpos
        if k_part is not None and i == 0:
            return (k, k_part, had, cos, sin, kpos, *self.k_strides, *self.ksum_scalars)
        return (q, k, v, oq, ok, ovt, q_scale, k_scale, v_scale, v_scale_max,
                had if k_part is None else k_part, had if k_mean is None else k_mean, had, cos, sin,
                qpos, kpos, *self.q_strides, *self.k_strides, *self.v_strides, *self.main_scalars)

    def gluon_launch(self, inputs: tuple, ops: FP8Operands) -> tuple:
        """(kernel, args, kwargs, grid) of gluon_sm90's kernel on :meth:`bind`'s ``inputs`` (its
        TMA descriptors are made per call: they hold the tensors' addresses)."""
        from . import gluon_sm90

        q, k, v, *_, had, cos, sin, qpos, kpos = inputs[:17]
        (stride_tz, stride_tp, stride_qpz, stride_kpz, P, style, q_pos, k_pos) = self._gluon_statics
        return gluon_sm90.launch(
            q, k, v, ops, had, had if cos is None else cos, had if sin is None else sin,
            had if qpos is None else qpos, had if kpos is None else kpos, stride_tz, stride_tp,
            stride_qpz, stride_kpz, P, style, q_pos, k_pos, self.recipe,
            stages=self._tuning.gluon_stages, per_sm=self._tuning.programs_per_sm,
            words=inputs[17:20] if self._gluon_rows is not None else None,
            rope_release=self._tuning.gluon_rope_release,
            k_mean=inputs[11], rope_words=self._tuning.gluon_rope_words,
            pdl=self._k_mean is not None and self._k_mean[-1])

    def grid(self, i: int, inputs: tuple) -> tuple:
        """Launch ``i``'s grid (the main launch's persistent grid is chosen on the first call)."""
        grid = self._grids[i]
        if grid is None:
            kernel, kwargs = self.kernels[i]
            grid = self._grids[i] = (_programs(kernel, self.args(i, inputs), kwargs, self._groups,
                                               self._tuning, self.device),)
        return grid

    def launch(self, inputs: tuple, ops: FP8Operands) -> None:
        """Run the launches on :meth:`bind`'s ``inputs`` (``ops``: its operands): on CUDA, after the
        first call of this layout, straight through the compiled kernels' launcher
        (runtime/fast_launch.py), which re-encodes the Gluon kernel's TMA descriptors over the new
        tensors. Gluon's own launch path costs ~0.3-0.5 ms of host a call (H200,
        fp8-host-new-nvidia-h200-2026-11-29-0658), several times the kernel at 4k tokens."""
        for tag, prepare in self.launches(inputs, ops):
            if self.key is None:
                kernel, args, kwargs, grid = prepare()
                kernel[grid](*args, **kwargs)
            else:
                launch_cached((_LAUNCH_TAG, self.key, tag), inputs, lambda: (*prepare(), None))

    def recorded_launches(self) -> Optional[tuple]:
        """After a call launched through :meth:`launch` on CUDA: its launches' recorded entries in
        runtime/fast_launch.py, in order (``relaunch(entry, inputs)`` each on a later :meth:`bind`'s
        inputs does what :meth:`launch` does, without the lookups), or None where one is not
        recorded (not CUDA, the interpreter, a launch the cache could not record).

        Example::

            >>> entries = layout.recorded_launches()                       # doctest: +SKIP
            >>> for entry in entries: relaunch(entry, layout.bind(q, k, v, None)[1])   # doctest: +SKIP
        """
        if self.key is None:
            return None
        entries = tuple(recorded((_LAUNCH_TAG, self.key, tag)) for tag in self.launch_tags())
        return None if any(entry is None for entry in entries) else entries

    def launch_tags(self) -> tuple:
        """The launch cache's tag of each launch :meth:`launches` makes, in order: every one of them is
        replayed (smooth_k on the Gluon kernel is three: K's partial sums, K's mean, the kernel).

        Example::

            >>> layout.launch_tags()            # doctest: +SKIP
            ('gluon',)
        """
        if self.gluon:
            return (0, "k_mean", "gluon") if self._k_mean is not None else ("gluon",)
        return tuple(range(len(self.kernels)))

    def launches(self, inputs: tuple, ops: FP8Operands) -> list:
        """(tag, prepare) per launch on :meth:`bind`'s ``inputs``, in order: ``prepare()`` gives its
        (kernel, args, kwargs, grid); ``tag`` names it in the launch cache. The Gluon kernel's one
        launch where it serves the call (with smooth_k after k_sums_kernel and k_mean_kernel), else
        the Triton launches (:attr:`kernels`)."""
        if self.gluon:
            out = [lambda: self.gluon_launch(inputs, ops)]
            if self._k_mean is not None:   # smooth_k: the pre-pass, K's mean, then the Gluon kernel
                kernel, kwargs, grid, scalars, pdl = self._k_mean
                sums = dict(self.kernels[0][1], PDL=pdl)
                out = [lambda: (self.kernels[0][0], self.args(0, inputs), sums, self.grid(0, inputs)),
                       lambda: (kernel, (inputs[10], inputs[11], *scalars), kwargs, grid)] + out
            return list(zip(self.launch_tags(), out))
        return [(i, lambda i=i, kernel=kernel, kwargs=kwargs:
                 (kernel, self.args(i, inputs), kwargs, self.grid(i, inputs)))
                for i, (kernel, kwargs) in enumerate(self.kernels)]


_LAUNCH_TAG = "fp8_prologue"


def finish(ops: FP8Operands) -> FP8Operands:
    """After the launches: heads whose V is all zero get v_scale_max 1 (one tiny op: the launches
    leave -1 there, below every scale, and the scales are positive).

    Example::

        >>> p = prepare_prologue(q, k, v, FP8Recipe())               # doctest: +SKIP
        >>> for kernel, args, kwargs, grid in p.launches:             # doctest: +SKIP
        ...     kernel[grid](*args, **kwargs)
        >>> finish(p.operands).v_scale_max.min() > 0                   # doctest: +SKIP
        tensor(True)
    """
    ops.v_scale_max.abs_()
    return ops


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: FP8Recipe,
             rope: Optional[RopeSpec] = None) -> FP8Operands:
    """Q, K, V (bf16 / fp16) -> FP8 operands for the FP8 forward: RoPE (``rope``), the seeded
    random-sign Hadamard rotation of Q and K (``recipe.hadamard``), K's mean over a 256-token
    sample removed (``recipe.smooth_k``, reference.smooth_sample), one float32 scale per block of ``recipe.block_m`` Q rows /
    ``recipe.block_n`` K and V rows; Q and K in int8 (amax / 127, round half to even) or e4m3
    (amax / 448) per ``recipe.qk``, V in e4m3 (power-of-two scales) written transposed. Layouts:
    ``fp8_recipe.FP8Operands``.

    q [B, Hq, M, D], k [B, Hkv, N, D], v [B, Hkv, N, Dv]: any strides with the last one 1 (else
    copied); Hq a multiple of Hkv; D and Dv multiples of 16 up to 256. ``rope``: any cos / sin
    tables (RopeSpec), applied as the model applies them; positions must lie in the table (checked
    for CPU tensors, clamped on the GPU). Raises TypeError / ValueError saying what is wrong. Runs
    one Triton launch on CUDA (two with smoothing) or under Triton's interpreter, and one tiny op
    (finish); on CPU tensors without it, the same math in torch ops in float64 (reference.py).
    The host work that does not depend on the tensors is done once per signature (layout_of), and
    on CUDA later calls launch through the compiled kernel's launcher (runtime/fast_launch.py).

    Example::

        >>> q = torch.randn(1, 8, 1000, 128, dtype=torch.bfloat16, device="cuda")   # doctest: +SKIP
        >>> k = v = torch.randn(1, 2, 1000, 128, dtype=torch.bfloat16, device="cuda")  # doctest: +SKIP
        >>> rope = RopeSpec.from_theta(128, 1000, device="cuda")                   # doctest: +SKIP
        >>> ops = quantize(q, k, v, FP8Recipe(), rope)                              # doctest: +SKIP
        >>> ops.vt.shape, ops.q_scale.shape                                        # doctest: +SKIP
        (torch.Size([1, 2, 128, 1008]), torch.Size([1, 8, 8]))
        >>> ops.q.dtype, ops.vt.dtype                                               # doctest: +SKIP
        (torch.int8, torch.float8_e4m3fn)
    """
    if not (isinstance(q, torch.Tensor) and q.device.type == "cpu" and not _interpreting()):
        layout = layout_of(q, k, v, recipe, rope)
        ops, inputs = layout.bind(q, k, v, rope)
        layout.launch(inputs, ops)
        return finish(ops)
    from .reference import quantize_reference

    _check_inputs(q, k, v, recipe, rope)
    return quantize_reference(q, k, v, recipe, rope, torch.float64)


def compile_prologue(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: FP8Recipe,
                     rope: Optional[RopeSpec] = None, capability: tuple[int, int] = (9, 0),
                     tuning: PrologueTuning = DEFAULT_TUNING) -> list:
    """Compile (not run) the launches of ``quantize`` for a GPU of ``capability``: the compiled
    kernels in launch order. Tensors may be on the CPU; needs a process without TRITON_INTERPRET=1.

    Example::

        >>> from fa3_inductor.templates.aot import sass_report                 # doctest: +SKIP
        >>> [sass_report(c).stack for c in compile_prologue(q, k, v, FP8Recipe())]  # doctest: +SKIP
        [0]
    """
    from triton.backends.compiler import GPUTarget

    from ..aot import compile_launch

    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    launch = prepare_prologue(q, k, v, recipe, rope, round_in_fp32=False, tuning=tuning,
                              capability=capability)
    return [compile_launch(kernel, args, kwargs, target)
            for kernel, args, kwargs, _ in launch.launches]
