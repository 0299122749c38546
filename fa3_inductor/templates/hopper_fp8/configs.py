"""Tiles of the hopper_fp8 family: the Gluon Hopper kernel (templates/hopper/fwd_sm90.py) with its Quant
bundle on, one entry per head dim (Q, K and V share it: the prologue serves D = Dv here).

Budget (why these tiles): an e4m3 tile is half the bytes of a bf16 one, so shared memory allows deeper rings,
but registers do not grow: each consumer warpgroup holds, per thread, S of the next KV tile (HALF_M x BLOCK_N
fp32: BLOCK_N / 2 registers), O (Dv / 2), and with two-level accumulation (FP8Recipe.two_level, the default)
the fresh PV accumulator of the tile in flight (Dv / 2 more), plus P in e4m3 (BLOCK_N / 8). With 240 registers
a consumer (setmaxnreg, as the bf16 table):
  D=64   BLOCK_N 128: S 64 + O 32 + PV 32 + P 16 = 144. Ring: K and V stages of 8 KB each; 4 stages:
         Q 8 + K/V 64 + O staging 16 = 88 KB.
  D=128  BLOCK_N 128: S 64 + O 64 + PV 64 + P 16 = 208, 224 with the intra-warpgroup overlap's second P: that
         spills under masks and the persistent schedule, so this entry runs without the overlap. Ring: 16 KB
         per K or V stage; 3 stages: Q 16 + K/V 96 + O 32 = 144 KB. (BLOCK_N 256 would need 128 + 64 + 64 for S,
         O and PV alone; a BLOCK_N that is not a power of two (176) is no Gluon tensor shape.)
  D=256  O alone is 128 registers and a fresh PV accumulator another 128: two-level accumulation does not fit
         a 64-row warpgroup at D=256 (see UNSERVED_TWO_LEVEL). Without it (FP8Recipe(two_level=0)) the bf16
         entry's shape: BLOCK_N 64 (S 32, P 8), 2 stages: Q 32 + K/V 2 x (16 + 16) + O 64 = 160 KB.
The kernel's tiles must lie inside one K / V scale block (FP8Recipe.block_n, default 128): BLOCK_N <= 128.
Schedule: D=64 and 128 leave it to use_persistent per launch (as the bf16 table); D=256 runs one CTA per tile
(the persistent schedule spills there): short sequences lose what persistence hid in bf16.
Chosen from sm90 compiles on the CPU (triton 3.6; tests/test_hopper_fp8.py checks every entry: e4m3 wgmma for
both GEMMs, setmaxnreg kept, no spills); no GPU timing yet.
"""

from __future__ import annotations

from ..hopper.configs import Sm90Config

_TABLE: dict[int, Sm90Config] = {
    64: Sm90Config(block_m=128, block_n=128, num_stages=4),
    # overlap=False: with the intra-warpgroup overlap, S of the next tile + O + the PV accumulator + two P tiles
    # (224 registers) leave too little for the rest: the plain launch fit, but the persistent schedule (16 / 74
    # spill instructions, EVEN_N or not), a causal block mask with softcap (199) and a gathering mask_mod (279)
    # spilled. Without it all of them compile spill-free, persistent included; the pingpong between the two
    # warpgroups still hides one's softmax under the other's GEMMs. Not yet timed against the overlap.
    128: Sm90Config(block_m=128, block_n=128, num_stages=3, overlap=False),
    # persistent=False: the persistent schedule spills without EVEN_N (17 spill instructions)
    256: Sm90Config(block_m=128, block_n=64, num_stages=2, persistent=False),
}

# Head dims whose table entry cannot hold a second O-sized accumulator (two-level PV accumulation).
UNSERVED_TWO_LEVEL = (256,)

SUPPORTED_HEAD_DIMS = tuple(sorted(_TABLE))


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
        'tiles 128x128, 3 K/V stages, pingpong, no overlap, e4m3 wgmma'
    """
    cfg = get_fp8_config(head_dim)
    return (f"tiles {cfg.block_m}x{cfg.block_n}, {cfg.num_stages} K/V stages, pingpong, "
            f"{'overlap' if cfg.overlap else 'no overlap'}, e4m3 wgmma")


def all_fp8_configs():
    """Every shipped (head_dim, config) (the compile tests iterate this)."""
    yield from _TABLE.items()
