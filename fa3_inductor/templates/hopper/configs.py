"""Tile / stage table of the sm90 (Hopper) FA3-structure forward kernel.

One entry per (head dim, dtype). Every entry is compiled for sm90 by
tests/test_hopper_compile.py (HGMMA present, setmaxnreg present, no spills), and the
reason / measurement for each choice sits beside it. Figures are TFLOP/s, bf16,
`triton.testing.do_bench` medians, same run as cuDNN; see DESIGN.md in this folder for the
full ablation and the device each figure came from.

Register budget (all entries): 3 warpgroups (2 consumer warpgroups + a 1-warp producer padded
to a warpgroup) launch with maxnreg=168 (3*128*168 = 64512 <= 65536 registers), then
setmaxnreg moves them to 240/240/24 (2*128*240 + 128*24 = 64512). If a config does not fit,
Gluon silently drops setmaxnreg: the compile test catches that.

Shared memory (bytes): Q tile BLOCK_M*D*2, plus NUM_STAGES*(K tile + V tile) = NUM_STAGES*2*BLOCK_N*D*2.
Limit on sm90: 227 KB per CTA.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Sm90Config:
    block_m: int = 128          # rows per CTA tile; 2 consumer warpgroups x 64 rows
    block_n: int = 128          # KV rows per pipeline stage
    num_stages: int = 2         # depth of the K/V shared-memory ring
    pingpong: bool = True       # mbarrier pingpong between the two consumer warpgroups
    overlap: bool = True        # intra-warpgroup overlap: QK^T of tile j+1 before softmax of tile j
    persistent: bool = False    # grid = #SMs, tiles handed out round-robin (longest first)
    consumer_regs: int = 240    # setmaxnreg of the second consumer warpgroup (the default one gets the rest)
    producer_regs: int = 24     # setmaxnreg of the TMA producer warp(group)
    maxnreg: int = 168          # register cap at kernel entry (12 warps)

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        return elem_bytes * head_dim * (self.block_m + 2 * self.num_stages * self.block_n)


# key: (head_dim, dtype) -> config. bf16 and fp16 share tiles (same wgmma shapes, same bytes).
_TABLE: dict[int, Sm90Config] = {
    # D=64: 128x128 tiles, 3 stages (96 KB of K/V ring + 16 KB Q): tiles are cheap to hold and
    # short to compute, so a deeper ring could hide more TMA latency. S=64 regs, O=32 regs/thread.
    # H100, B4 H32 S4096: 3 stages 415, 2 stages 416 TFLOP/s (a tie), cuDNN 454 in the same run.
    64: Sm90Config(block_m=128, block_n=128, num_stages=3),
    # D=128: the FACTS.md prototype structure: 128x128, 2 stages (164 KB), pingpong + overlap.
    # H100 (this kernel, 3 rounds): B4 H32 S4096 583-585 vs cuDNN 573-591; B2 H16 S8192 599 vs 581;
    # 3 stages is slower in every run (565 / 577), as in the H200 prototype (585 / 600 vs 594 / 608).
    # Pingpong on vs off is inside the run-to-run noise on H100 (see DESIGN.md); kept on, as on H200.
    128: Sm90Config(block_m=128, block_n=128, num_stages=2),
    # D=96 / D=192 are not offered: Gluon's host TensorDescriptor requires power-of-two block shapes
    # ("Shape element 3 must be a power of 2"), and the kernel's tiles span the whole head dim.
    # D=256: O alone is 128 fp32 regs/thread, so BLOCK_N 64 (S 32 regs, P 16); 2 stages:
    # 64 KB Q + 128 KB K/V = 192 KB (3 stages would be 256 KB > 227 KB).
    # H100, B4 H16 S4096: 647 TFLOP/s vs cuDNN 637 in the same run.
    256: Sm90Config(block_m=128, block_n=64, num_stages=2),
}

SUPPORTED_HEAD_DIMS = tuple(sorted(_TABLE))
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def get_config(head_dim: int, dtype: torch.dtype = torch.bfloat16, **overrides) -> Sm90Config:
    """The table's config for (head_dim, dtype), with optional field overrides (for ablations)."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"sm90 forward: unsupported dtype {dtype}")
    if head_dim not in _TABLE:
        raise ValueError(f"sm90 forward: unsupported head dim {head_dim}")
    cfg = _TABLE[head_dim]
    return replace(cfg, **overrides) if overrides else cfg


def all_configs():
    """Every shipped (head_dim, dtype, config) triple (the compile test iterates this)."""
    for d, cfg in _TABLE.items():
        for dt in SUPPORTED_DTYPES:
            yield d, dt, cfg
