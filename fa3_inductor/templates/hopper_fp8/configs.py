"""Tiles of the hopper_fp8 family: the Gluon Hopper kernel (templates/hopper/fwd_sm90.py) with its Quant
bundle on, one entry per head dim (Q, K and V share it: the prologue serves D = Dv here).

Budget (why these tiles): an e4m3 tile is half the bytes of a bf16 one, so shared memory allows deeper rings,
but registers do not grow. Each consumer warpgroup holds, per thread, S of a KV tile (HALF_M x BLOCK_N fp32:
BLOCK_N / 2 registers), O (Dv / 2), with two-level accumulation (FP8Recipe.two_level, the default) the fresh PV
accumulator of the tile in flight (Dv / 2 more), and P in e4m3 (BLOCK_N / 8). With 240 registers a consumer
(setmaxnreg, as the bf16 table). The intra-warpgroup overlap (fwd_sm90._fp8_overlap_loop: QK^T of tile i+1 issued
with the PV of tile i, both retired before the next softmax) keeps S of the next tile, the PV accumulator and P
live at the issue, not during the softmax: S + O + PV + P, the same peak as without it.
  D=64   BLOCK_N 128: S 64 + O 32 + PV 32 + P 16 = 144. Ring: K and V stages of 8 KB each; 4 stages:
         Q 8 + K/V 64 + O staging 16 = 88 KB. Overlap: every variant spill-free.
  D=128  BLOCK_N 128: S 64 + O 64 + PV 64 + P 16 = 208. Overlap: spill-free in every schedule, mods too
         (fp8_tight_mods: before it, mods spilled up to 40 bytes of kernel-wide scalars; tests/test_hopper_fp8.py,
         docs/design/hopper_fp8.md "Spills under mods"). Ring: 16 KB per K or V stage;
         3 stages: Q 16 + K/V 96 + O 32 = 144 KB. (BLOCK_N 256 would need 128 + 64 + 64 for S, O and PV alone;
         a BLOCK_N that is not a power of two (176) is no Gluon tensor shape.)
  D=256  O alone is 128 registers and a fresh PV accumulator another 128: two-level accumulation does not fit
         a 64-row warpgroup at D=256 (see UNSERVED_TWO_LEVEL). Without it (FP8Recipe(two_level=0)) the bf16
         entry's shape: BLOCK_N 64 (S 32, P 8), 2 stages: Q 32 + K/V 2 x (16 + 16) + O 64 = 160 KB. No overlap:
         with it the ragged-length launches spill (16 bytes), without it none does.
The kernel's tiles must lie inside one K / V scale block (FP8Recipe.block_n, default 128): BLOCK_N <= 128.
Schedule: D=64 and 128 leave it to use_persistent per launch (as the bf16 table); D=256 runs one CTA per tile
(the persistent schedule spills there): short sequences lose what persistence hid in bf16.
Softmax: lean_fp8_softmax in every entry (Sm90Config; the per-tile chain each consumer warpgroup runs between its
GEMMs is what sets the FP8 rate: docs/design/hopper_fp8.md, "Cycle budget", benchmarks/sass_loop_model.py).
Chosen from sm90 compiles on the CPU (triton 3.6; tests/test_hopper_fp8.py checks every entry: s8 or e4m3 wgmma for
QK^T and e4m3 for PV, not serialized, setmaxnreg kept, no spills, mods included); the D=128 overlap
not timed against overlap=False; the lean softmax timed on an H200: 1.16-1.18x the kernel without it at D128 noop, int8 Q/K
(benchmarks/results/fp8-kernel-ab-nvidia-h200-2026-11-28-0529).
"""

from __future__ import annotations

from ..hopper.configs import Sm90Config

# lean_fp8_softmax (every entry): the consumer warpgroup's per-tile chain is its softmax plus both GEMMs
# (docs/design/hopper_fp8.md, "Cycle budget"); the lean softmax shortens it. D=128 int8 noop, sm90 SASS of one KV
# tile per warp: 704 -> 607 instructions, 1298 -> 1240 stall cycles, two-warpgroup issue model 2384 -> 2148 cycles
# per tile pair (e4m3: 576 -> 539, 2150 -> 1929; launches with mods or a ragged N keep O's update after the wait:
# 2244 / 2030 on the noop loop). Measured (H200, fp8-kernel-ab-...-0529, D128): int8 noop 654 -> 772 / 679 -> 790
# TFLOP/s at 4k / 16k, causal +6-9%, softcap and e4m3 causal within 2%.
_TABLE: dict[int, Sm90Config] = {
    64: Sm90Config(block_m=128, block_n=128, num_stages=4, lean_fp8_softmax=True),
    # overlap (the default) since the FP8 loop stopped carrying P across iterations (fwd_sm90._fp8_overlap_loop):
    # before, P was held one byte per register (238 repacking instructions per KV tile) and spilled; the entry ran
    # without the overlap. Not yet timed against overlap=False (docs/design/hopper_fp8.md, "A/B"; the issue model
    # gives overlap=False 3268 cycles per tile pair against 2384).
    # fp8_tight_mods: mods (with two-level accumulation or a gathering mask) spilled 8-40 bytes of kernel-wide scalars
    # here; with it none, the noop loop unchanged (docs/design/hopper_fp8.md, "Spills under mods")
    128: Sm90Config(block_m=128, block_n=128, num_stages=3, lean_fp8_softmax=True, fp8_tight_mods=True),
    # persistent=False: the persistent schedule spills without EVEN_N (17 spill instructions); overlap=False: with
    # it the ragged launches spill too (9 instructions, 16 bytes)
    256: Sm90Config(block_m=128, block_n=64, num_stages=2, persistent=False, overlap=False, lean_fp8_softmax=True),
}

# Head dims whose table entry cannot hold a second O-sized accumulator (two-level PV accumulation).
UNSERVED_TWO_LEVEL = (256,)

SUPPORTED_HEAD_DIMS = tuple(sorted(_TABLE))

# At and below this head dim a 128 x 128 tile's exponentials (MUFU.EX2: 16384 at 16 a cycle per SM, 1024 cycles)
# take as long as its bf16 GEMMs (QK^T and PV, 2 x 128 x 128 x 64 MACs at 2048 bf16 MACs a cycle per SM: 1024
# cycles), so halving the GEMMs with FP8 cannot shorten the loop below the exponentials' 1024 (docs/fp8.md,
# "Head dim 64"). explain() says so.
EXP_BOUND_HEAD_DIM = 64


def serves_fp8_head_dims(head_dim: int, value_head_dim: int, two_level: bool = True) -> bool:
    """Whether the FP8 table has tiles for Q / K of ``head_dim`` and V of ``value_head_dim`` (with two-level
    accumulation where asked).

    Example::

        >>> serves_fp8_head_dims(128, 128), serves_fp8_head_dims(256, 256), serves_fp8_head_dims(96, 96)
        (True, False, False)
    """
    if head_dim != value_head_dim or head_dim not in _TABLE:
        return False
    return not (two_level and head_dim in UNSERVED_TWO_LEVEL)


def get_fp8_config(head_dim: int, value_head_dim: int | None = None) -> Sm90Config:
    """The FP8 table's tiles for a head dim (V's must be the same).

    Example::

        >>> get_fp8_config(128).num_stages
        3
    """
    dv = head_dim if value_head_dim is None else value_head_dim
    if dv != head_dim or head_dim not in _TABLE:
        raise ValueError(f"sm90 FP8 forward: no tiles for q/k head dim {head_dim} with v head dim {dv} (it serves "
                         f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}, the same for q, k and v)")
    return _TABLE[head_dim]


def fp8_smem_bytes(cfg: Sm90Config, head_dim: int, value_head_dim: int) -> int:
    """Shared memory of an FP8 launch, barriers aside: e4m3 Q (both halves), K and VT rings, and the 16-bit O
    staging buffer (an FP8 launch always stages O apart from Q).

    Example::

        >>> fp8_smem_bytes(get_fp8_config(128), 128, 128) // 1024
        144
    """
    return (cfg.block_m * head_dim + cfg.num_stages * cfg.block_n * head_dim
            + cfg.v_ring_stages * cfg.block_n * value_head_dim + 2 * cfg.block_m * value_head_dim)


def describe(head_dim: int) -> str:
    """The tiles in words, for explain().

    Example::

        >>> describe(128)
        'tiles 128x128, 3 K/V stages, pingpong, overlap, e4m3 wgmma'
    """
    cfg = get_fp8_config(head_dim)
    return (f"tiles {cfg.block_m}x{cfg.block_n}, {cfg.num_stages} K/V stages, pingpong, "
            f"{'overlap' if cfg.overlap else 'no overlap'}, e4m3 wgmma")


def all_fp8_configs():
    """Every shipped (head_dim, config) (the compile tests iterate this)."""
    yield from _TABLE.items()
