"""Stages for torch's flex backward kernel that fit shared memory (issue 21: CPM-Ant on the H100).

The GPU coverage run (torch 2.11, H100) left transformers' cpmant to stock Inductor: torch's flex
backward kernel for its site asked 245760 bytes of shared memory, 232448 being the limit. The
numbers below were measured on the CPU: Inductor wrote torch's template for a fake H100 and Triton
3.6 compiled it for sm90 (fa3_inductor/lowering/torch_bwd_stages.py has the table); CPM-Ant's at
3 stages is the GPU's figure exactly. The tests check that the bound the lowering decides with
covers every measured kernel, and that the stages it picks fit.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fa3_inductor import _compat
from fa3_inductor.lowering.torch_bwd_stages import (TorchBwdConfig, fitting_stages,
                                                    shared_bytes_bound, stages_option,
                                                    tile_read_bytes)

H100 = 232448                                   # shared_memory_per_block_optin
SM90_D128 = TorchBwdConfig(64, 128, 128, 64, 3)  # torch's sm90 config, head dims 64-128
SM90_D256 = TorchBwdConfig(64, 64, 64, 64, 2)
SM90_D32 = TorchBwdConfig(64, 64, 64, 64, 3)
CPMANT_211 = 6      # tile_read_bytes of CPM-Ant's site as torch 2.11 traces it: two dense bool
CPMANT_213 = 2      # masks and a bf16 table (score_mod), the masks again (its gradient); 2.13: the table

# (config, head dim, tile bytes, stages, bytes measured), bf16
MEASURED = [
    (SM90_D128, 128, 0, 3, 164864), (SM90_D128, 128, 0, 2, 131584), (SM90_D128, 128, 0, 1, 98304),
    (SM90_D128, 128, 1, 3, 180224),                                   # dense bool mask
    (SM90_D128, 128, 3, 3, 181248), (SM90_D128, 128, 3, 2, 139776),   # two dense bool reads
    (SM90_D128, 128, 3, 1, 98304),
    (SM90_D128, 128, 2, 3, 196608),                                   # bias [B, H, M, N] bf16
    (SM90_D128, 128, 4, 3, 230400), (SM90_D128, 128, 4, 2, 164352),   # ... float32
    (SM90_D128, 128, 4, 1, 114688),
    (SM90_D128, 64, 0, 3, 82944), (SM90_D128, 64, 4, 3, 148480),
    (SM90_D256, 256, 0, 2, 197120), (SM90_D32, 32, 0, 3, 33792),
    (SM90_D128, 128, CPMANT_211, 3, 245760), (SM90_D128, 128, CPMANT_211, 2, 204800),
    (SM90_D128, 128, CPMANT_211, 1, 147456), (SM90_D128, 128, CPMANT_213, 3, 168960),
]


@pytest.mark.parametrize("cfg, head_dim, tile_bytes, stages, measured", MEASURED)
def test_bound_covers_the_measured_kernel(cfg, head_dim, tile_bytes, stages, measured):
    assert shared_bytes_bound(cfg, head_dim, 2, tile_bytes, stages) >= measured


def test_cpmant_gets_stages_that_fit():
    """torch 2.11's CPM-Ant site: 2 stages (204800 bytes measured); torch 2.13's fits as is."""
    assert stages_option({"WRITE_DQ": True}, SM90_D128, 128, 2, CPMANT_211, H100) == {
        "WRITE_DQ": True, "num_stages": 2}
    measured = {(t, s): m for cfg, d, t, s, m in MEASURED if cfg == SM90_D128 and d == 128}
    assert measured[(CPMANT_211, 2)] <= H100 < measured[(CPMANT_211, 3)]
    assert stages_option({}, SM90_D128, 128, 2, CPMANT_213, H100) is None


@pytest.mark.parametrize("cfg, head_dim", [(SM90_D32, 32), (SM90_D128, 64), (SM90_D128, 128),
                                           (SM90_D256, 256)])
def test_mods_without_per_element_reads_keep_torch_choice(cfg, head_dim):
    assert fitting_stages(cfg, head_dim, 2, 0, H100) == cfg.num_stages
    assert stages_option({}, cfg, head_dim, 2, 0, H100) is None


@pytest.mark.parametrize("chosen", [{"num_stages": 3}, {"bwd_num_stages": 3}, {"BLOCK_M1": 32},
                                    {"bwd_BLOCK_N2": 32}])
def test_stages_or_tiles_the_caller_chose_are_kept(chosen):
    assert stages_option(chosen, SM90_D128, 128, 2, CPMANT_211, H100) is None


def test_nothing_fits_gives_one_stage():
    assert fitting_stages(SM90_D128, 128, 2, 64, H100) == 1


B, M = 2, 48
DENSE_MASK = torch.ones(B, M, M, dtype=torch.bool)
DOCUMENTS = torch.zeros(M, dtype=torch.int32)
TABLE = torch.zeros(512, 4)


def _traced(fn, n_leading: int, *buffers) -> torch.fx.GraphModule:
    """``fn`` traced as flex_attention traces a mod: 0-d int32 indices (and a 0-d bf16 score
    first for a score_mod), ``buf[i, j]`` as ``aten.index``."""
    score = [torch.zeros((), dtype=torch.bfloat16)] if n_leading == 5 else []
    index = [torch.zeros((), dtype=torch.int32) for _ in range(4)]
    with _compat.getitem_as_index():
        return make_fx(fn)(*score, *index, *buffers)


@pytest.mark.parametrize("fn, n_leading, buffers, expected", [
    (lambda b, h, q, kv, m: m[b, q, kv], 4, (DENSE_MASK,), 1),          # per element: bool
    (lambda b, h, q, kv, d: d[q] == d[kv], 4, (DOCUMENTS,), 0),          # a row and a column
    (lambda s, b, h, q, kv, t: s + t[(q - kv).abs(), h], 5, (TABLE,), 4),  # gathered: float32
    (lambda s, b, h, q, kv, m, t: torch.where(m[b, q, kv], s + t[q, h], s), 5,
     (DENSE_MASK, TABLE), 1),                                            # t read per row only
])
def test_tile_read_bytes_counts_reads_indexed_by_q_and_kv(fn, n_leading, buffers, expected):
    gm = _traced(fn, n_leading, *buffers)
    assert tile_read_bytes([(gm, n_leading - 2)]) == expected
