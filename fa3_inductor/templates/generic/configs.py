"""Tile and pipeline choices for the generic template, in one table.

Each entry says why. Figures are from docs/facts.md and benchmarks/results (H100/H200, triton 3.6).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GenericConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    warp_specialize: bool


# KV length from which a plain site (no score_mod, no block mask) takes the long tiles (see below).
PLAIN_LONG_KV = 2048


def generic_config(head_dim: int, capability: tuple[int, int] | None,
                   mods_load_buffers: bool = False, fp32: bool = False,
                   plain_kv_len: int = 0) -> GenericConfig:
    """Tile choice for the generic kernel. ``capability`` None means the CPU interpreter.

    ``mods_load_buffers``: a mod gathers from a captured buffer: more live registers in the
    loop (and Triton 3.6's warp-specialization pass crashes on such loads, "operation
    destroyed but still has uses").
    ``fp32``: float32 inputs run on FMA units with small tiles.
    ``plain_kv_len``: the KV length of a site with no score_mod and no block mask (0 otherwise).

    Example::

        >>> generic_config(128, (9, 0)).block_m
        64
    """
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    override = _tiles_from_env(block_d)
    if override is not None and capability is not None and not fp32:
        return override
    if capability is None:
        # Interpreter: numpy cost grows with the number of programs, not the tile size.
        return GenericConfig(64, 64, 4, 1, False)
    if fp32:
        # float32 (IEEE by default, like torch) runs on FMA units: small tiles keep the
        # spills small (128x64 spilled 4.4 KB of stack at D=128; 32x32 with 8 warps: none at
        # D<=64, 192 B at D=128, 1.8 KB at D=256: float32 is a correctness path, not a fast one).
        return GenericConfig(32, 32, 8, 1, False)
    if capability[0] == 9:
        # Hopper: TMA descriptor loads in a plain software-pipelined loop. Measured against
        # torch's FlexAttention, kernel time under CUDA graphs, H200, bf16, 16k tokens
        # (benchmarks/generic_sweep.py; results/generic-sweep-nvidia-h200-2026-11-22*):
        #   D<=64   128x128, 4 warps, 3 stages: noop 1.01x flex, causal 0.94x, softcap 2.30x
        #   D<=128   64x64,  4 warps, 3 stages: noop 0.97x (S4096) / 0.92x (S1024), causal
        #            1.00x / 0.90x, softcap 2.03x / 1.84x (128x128 w8 s3: 0.99x / 0.88x noop)
        #   D<=256  128x64,  8 warps, 2 stages: noop 1.41x, causal 1.55x, softcap 2.53x
        # Triton 3.6's warp-specialized loop (`tl.range(warp_specialize=True)`) lost to all of
        # these: it needs num_warps=4, and at BLOCK_M 128 it returned NaN row max / LSE and
        # wrong masked outputs, so it ran at BLOCK_M 64: 0.55x flex (noop, S4096).
        if block_d <= 64:
            # 128x128 on 4 warps uses 229-255 registers; a mod gathering from a buffer (document
            # mask) spills there (48 B stack), so those take 64x64 (noop 0.98x flex).
            if mods_load_buffers:
                return GenericConfig(64, 64, 4, 3, False)
            return GenericConfig(128, 128, 4, 3, False)
        if block_d <= 128:
            # Long plain (no mod, no mask) sites: 128x128, 8 warps, 3 stages. Same run, H200,
            # through fa3_inductor.flex with host-built descriptors, noop S512..16k vs flex:
            # 64x64 1.16 / 1.06 / 1.01 / 0.97 / 0.97 / 0.98, 128x128 w8 1.00 / 1.01 / 1.02 /
            # 1.02 / 1.04 / 1.04 (results/bench-nvidia-h200-2026-11-22-0514-tiles-*); masked and
            # modded sites keep 64x64 (causal 1.06-1.15x, softcap 2.08-2.18x flex in -0507).
            if plain_kv_len >= PLAIN_LONG_KV:
                return GenericConfig(128, 128, 8, 3, False)
            return GenericConfig(64, 64, 4, 3, False)
        return GenericConfig(128, 64, 8, 2, False)
    # Ampere/Ada: classic 8-warp pipelined tile.
    if block_d <= 128:
        return GenericConfig(128, 64, 8, 3, False)
    return GenericConfig(64, 32, 4, 2, False)


def generic_config_variants(head_dim: int, capability: tuple[int, int] | None,
                            mods_load_buffers: bool = False, fp32: bool = False,
                            plain: bool = False) -> list[GenericConfig]:
    """Every config :func:`generic_config` gives a site at some KV length (a plain site may switch
    tiles at PLAIN_LONG_KV): the tiles a site's first launch compiles ahead (runtime/variants.py).

    Example::

        >>> [c.block_m for c in generic_config_variants(128, (9, 0), plain=True)]
        [64, 128]
        >>> len(generic_config_variants(128, (9, 0)))
        1
    """
    lengths = (0, PLAIN_LONG_KV) if plain else (0,)
    configs = [generic_config(head_dim, capability, mods_load_buffers, fp32, n) for n in lengths]
    return list(dict.fromkeys(configs))


def _tiles_from_env(block_d: int) -> GenericConfig | None:
    """FA3_INDUCTOR_GENERIC_TILES="128:128x64w8s3,64:..." (padded head dim: tiles) overrides the
    GPU table for tuning runs (benchmarks compare a candidate through the product path)."""
    import os
    import re

    for entry in filter(None, os.environ.get("FA3_INDUCTOR_GENERIC_TILES", "").split(",")):
        m = re.fullmatch(r"(\d+):(\d+)x(\d+)w(\d+)s(\d+)", entry.strip())
        if m is None:
            raise ValueError(f"FA3_INDUCTOR_GENERIC_TILES: cannot read {entry!r}; write "
                             "HEADDIM:BMxBNwWARPSsSTAGES, e.g. 128:128x64w8s3")
        if int(m.group(1)) == block_d:
            return GenericConfig(*(int(x) for x in m.groups()[1:]), False)
    return None
