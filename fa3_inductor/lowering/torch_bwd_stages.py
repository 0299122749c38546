"""Pipeline stages for torch's flex backward kernel where its default config overflows shared memory.

On CUDA a backward our families do not serve runs torch's flex backward Triton template
(flex_backward_lowering.py), with torch's config for the head dim: on sm90 (torch 2.11 and 2.13)
BLOCK_M1/N1/M2/N2 64/128/128/64, 3 stages, 8 warps for head dims 64-128. For a plain mod that
takes 161 KB of the H100's 227 KB. A mod that reads a captured tensor at every score element (a
[B, H, M, N] bias, a dense mask) streams a tile of it per pipeline stage as well: CPM-Ant's (dense
bool masks and a gathered bias table, read by the score_mod, its gradient and the mask_mod) asked
245760 bytes under torch 2.11, and the kernel failed to load ("No valid triton configs ... out of
resource"), so the backend fell back to stock Inductor. Fewer stages is the cheapest way back
under the limit: each drops a streamed tile of every operand, and torch's tiles stay.

:func:`fitting_stages` bounds the kernel's shared memory (:func:`shared_bytes_bound`) and returns
the most stages, up to torch's, whose bound fits the device; the lowering passes that as the op's
``num_stages`` only when it is below torch's. A site whose mods read no captured tensor per element
keeps torch's choice untouched, so the common sites (and their speed) are as before.

The bound, per loop of the kernel (dK/dV: K and V resident, Q, dO, LSE and Delta streamed; dQ: the
converse), is the resident tiles, S streamed tiles, P and dS, and S - 1 tiles (at least one: a
layout change holds one) of each per-element read. It was checked against torch's template as
Inductor writes it for a fake H100, compiled for sm90 by Triton 3.6 on the CPU (torch 2.11 and
2.13 agree where both were run); bytes measured <= bound, bf16 (tests/test_torch_bwd_stages.py):

- head dim 128, 3 stages: no mod 164864 <= 198144; dense bool mask 180224 <= 214528; a
  [B, H, M, N] bias in bf16 196608 <= 230912, in float32 230400 <= 263680;
- head dim 64 no mod 82944 <= 116224; 256 (2 stages) 197120 <= 214016; 32: 33792 <= 50688;
- CPM-Ant (6 bytes read per element under torch 2.11), 3 / 2 / 1 stages: 245760 / 204800 /
  147456 <= 296448 / 214016 / 180736, so 2 stages; under torch 2.13 (2 bytes) 168960 <= 230912,
  torch's 3 stages kept.

Example::

    >>> cfg = TorchBwdConfig(64, 128, 128, 64, num_stages=3)   # sm90, head dim 128
    >>> fitting_stages(cfg, head_dim=128, itemsize=2, tile_bytes=0, limit=232448)
    3
    >>> fitting_stages(cfg, head_dim=128, itemsize=2, tile_bytes=6, limit=232448)   # CPM-Ant, 2.11
    2
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional

import torch

from .common import torch_kernel_options

# A captured tensor read by index in a mod graph (flex traces ``buf[i, j]`` as aten.index).
_INDEX_OPS = (torch.ops.aten.index.Tensor, torch.ops.aten._unsafe_index.Tensor)


@dataclasses.dataclass(frozen=True)
class TorchBwdConfig:
    """The tiles and stages of one torch flex backward config (its ``FlexBwDConfig``)."""

    block_m1: int
    block_n1: int
    block_m2: int
    block_n2: int
    num_stages: int

    @classmethod
    def of(cls, config: Any) -> "TorchBwdConfig":
        """From torch's ``FlexBwDConfig``.

        Example::

            >>> configs = V.choices.get_flex_attention_bwd_configs(128, dtype, "cuda")  # doctest: +SKIP
            >>> TorchBwdConfig.of(configs[0])                                         # doctest: +SKIP
        """
        return cls(config.block_m1, config.block_n1, config.block_m2, config.block_n2,
                   config.num_stages)


def shared_bytes_bound(cfg: TorchBwdConfig, head_dim: int, itemsize: int, tile_bytes: int,
                       stages: int) -> int:
    """An upper bound on the shared memory of torch's flex backward kernel with ``cfg``'s tiles
    and ``stages`` pipeline stages (module docstring); ``itemsize``: q/k/v's element size;
    ``tile_bytes``: bytes the mods read from captured tensors per score element
    (:func:`tile_read_bytes`).

    Example::

        >>> shared_bytes_bound(TorchBwdConfig(64, 128, 128, 64, 3), 128, 2, 0, 3)
        198144
    """
    def loop(resident: int, streamed: int, row_stats: int) -> int:
        tiles = resident * streamed
        return (2 * resident * head_dim * itemsize
                + stages * (2 * streamed * head_dim * itemsize + row_stats * streamed)
                + 2 * tiles * itemsize + max(stages - 1, 1) * tiles * tile_bytes)

    # dK/dV loop: K, V resident, Q, dO (and 4-byte LSE, Delta) streamed; dQ loop: the converse
    return max(loop(cfg.block_n1, cfg.block_m1, 8), loop(cfg.block_m2, cfg.block_n2, 0))


def fitting_stages(cfg: TorchBwdConfig, head_dim: int, itemsize: int, tile_bytes: int,
                   limit: int) -> int:
    """The most stages, at most ``cfg.num_stages``, whose :func:`shared_bytes_bound` fits in
    ``limit`` bytes; ``cfg.num_stages`` when the mods read no captured tensor per element (torch
    sizes its configs for those), and 1 when none fits.

    Example::

        >>> fitting_stages(TorchBwdConfig(64, 128, 128, 64, 3), 128, 2, 4, 232448)
        2
    """
    if tile_bytes == 0:
        return cfg.num_stages
    for stages in range(cfg.num_stages, 1, -1):
        if shared_bytes_bound(cfg, head_dim, itemsize, tile_bytes, stages) <= limit:
            return stages
    return 1


def tile_read_bytes(mods: Iterable[tuple[Any, int]]) -> int:
    """Bytes read from captured tensors per score element by the mod graphs torch's backward
    kernel evaluates in its loops: every ``aten.index`` of a placeholder whose indices depend on
    both q_idx and kv_idx, its element size counted once per read. ``mods``: (graph module,
    position of its q_idx placeholder): 3 for the score_mod and its joint graph
    (``score, b, h, q_idx, kv_idx, ...``), 2 for the mask_mod.

    Example::

        >>> tile_read_bytes([(a.fw_graph.graph_module, 3), (mask_gm, 2)])   # doctest: +SKIP
        4
    """
    total = 0
    for gm, q_at in mods:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        q, kv = placeholders[q_at:q_at + 2]
        reads: dict[torch.fx.Node, set] = {q: {"q"}, kv: {"kv"}}
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            reads[n] = set().union(*(reads.get(a, set()) for a in n.all_input_nodes))
            source = n.args[0] if n.args else None
            if n.target in _INDEX_OPS and getattr(source, "op", None) == "placeholder":
                indexed = set().union(*(reads.get(i, set()) for i in n.args[1] if i is not None))
                value = source.meta.get("val")
                if indexed >= {"q", "kv"} and isinstance(value, torch.Tensor):
                    total += value.element_size()
    return total


def stages_option(kernel_options: Optional[dict], cfg: TorchBwdConfig, head_dim: int,
                  itemsize: int, tile_bytes: int, limit: int) -> Optional[dict]:
    """``kernel_options`` with ``num_stages`` lowered to :func:`fitting_stages`, or None where
    torch's choice stands (it fits, or the options already name stages or tiles: the caller's).

    Example::

        >>> stages_option({}, TorchBwdConfig(64, 128, 128, 64, 3), 128, 2, 6, 232448)
        {'num_stages': 2}
    """
    options = dict(kernel_options or {})
    chosen = {"num_stages", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"}
    if any(k in chosen or k.removeprefix("bwd_") in chosen for k in options):
        return None
    stages = fitting_stages(cfg, head_dim, itemsize, tile_bytes, limit)
    if stages >= cfg.num_stages:
        return None
    return {**options, "num_stages": stages}


def torch_backward_options(a: Any, bm: Any) -> Optional[dict]:
    """The kernel_options to hand torch's flex backward lowering for a CUDA site, ``num_stages``
    lowered where its default config would overflow the device's shared memory, or None: torch's
    own choice stands (other devices; max-autotune, whose benchmark drops configs that do not
    fit). ``a``: the op's arguments (_compat.FlexBackwardArgs); ``bm``: its block mask, unpacked.

    Example::

        >>> options = torch_backward_options(a, _compat.unpack_block_mask(a.block_mask))  # doctest: +SKIP
    """
    from torch._inductor.virtualized import V

    device = a.query.get_device()
    if device is None or device.type != "cuda":
        return None
    dtype, sizevars = a.query.get_dtype(), V.graph.sizevars
    head_dim = sizevars.guard_int(a.query.get_size()[-1])
    configs = V.choices.get_flex_attention_bwd_configs(head_dim, dtype, "cuda")
    if len(configs) != 1:
        return None
    tile_bytes = tile_read_bytes([(a.fw_graph.graph_module, 3), (a.joint_graph.graph_module, 3),
                                  (bm.mask_graph.graph_module, 2)])
    limit = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    widest = max(head_dim, sizevars.guard_int(a.value.get_size()[-1]))
    return stages_option(torch_kernel_options(a.kernel_options), TorchBwdConfig.of(configs[0]),
                         widest, dtype.itemsize, tile_bytes, limit)
