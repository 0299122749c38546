"""The generic kernel launched directly (no Inductor): CPU interpreter, and CUDA when present."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from fa3_inductor import mods
from fa3_inductor.templates.generic.host import launch_generic
from fa3_inductor.templates.modgen import generate_mod_source, load_mod, trace_mod
from reference import assert_lse_matches, assert_matches_reference, reference_attention

SOFTCAP_TL = """@triton.jit
def score_mod(qk, sm_scale, b, h, q_idx, kv_idx, bufs):
    score = qk * sm_scale
    return 4.0 * H.tanh(score / 4.0) + tl.load(bufs[0] + h)
"""
CAUSAL_TL = """@triton.jit
def mask_mod(b, h, q_idx, kv_idx, bufs):
    return q_idx >= kv_idx
"""


def _devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _run(q, k, v, **kw):
    Z, H, M, _ = q.shape
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    lse = torch.full((Z, H, M), float("nan"), device=q.device)
    mx = torch.full((Z, H, M), float("nan"), device=q.device)
    launch_generic(q, k, v, out, lse, mx, **kw)
    return out, lse * math.log(2), mx * math.log(2)


def _interpreter_or_cuda(device):
    from triton import knobs

    if device == "cpu" and not knobs.runtime.interpret:
        pytest.skip("CPU runs of the kernel need TRITON_INTERPRET=1 (set by conftest without CUDA)")


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [
    # (Z, HQ, HKV, M, N, D)
    (1, 2, 2, 64, 64, 16),
    (2, 4, 2, 100, 77, 80),    # GQA, ragged M and N, padded head dim
    (1, 2, 1, 33, 150, 64),    # cross-attention lengths, MQA
])
@pytest.mark.parametrize("host_descriptors", [True, False], ids=["host_desc", "kernel_desc"])
def test_dense_no_mods(device, dtype, shape, host_descriptors):
    _interpreter_or_cuda(device)
    Z, HQ, HKV, M, N, D = shape
    q = torch.randn(Z, HQ, M, D, device=device, dtype=dtype)
    k = torch.randn(Z, HKV, N, D, device=device, dtype=dtype)
    v = torch.randn(Z, HKV, N, D, device=device, dtype=dtype)
    out, lse, mx = _run(q, k, v, sm_scale=D ** -0.5, host_descriptors=host_descriptors)
    ref, ref_lse = reference_attention(q, k, v)
    assert_matches_reference(out, ref, dtype)
    assert_lse_matches(lse, ref_lse, dtype)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("walk", ["list", "hull", "list_kernel_desc"])
def test_block_mask_full_blocks_score_mod_and_buffer(device, walk):
    _interpreter_or_cuda(device)
    dtype = torch.float16
    Z, HQ, HKV, M, N, D = 2, 4, 2, 200, 200, 32
    q = torch.randn(Z, HQ, M, D, device=device, dtype=dtype)
    k = torch.randn(Z, HKV, N, D, device=device, dtype=dtype)
    v = torch.randn(Z, HKV, N, D, device=device, dtype=dtype)
    bias = torch.randn(HQ, device=device)
    bm = create_block_mask(mods.causal, 1, 1, M, N, device=device, BLOCK_SIZE=64)
    assert bm.full_kv_num_blocks is not None and int(bm.full_kv_num_blocks.sum()) > 0
    out, lse, mx = _run(q, k, v, sm_scale=D ** -0.5, score_mod=load_mod(SOFTCAP_TL),
                        mask_mod=load_mod(CAUSAL_TL), score_bufs=(bias,),
                        kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices,
                        full_kv_num_blocks=bm.full_kv_num_blocks,
                        full_kv_indices=bm.full_kv_indices, sparse_q_block=64,
                        sparse_kv_block=64, iterate_hull=walk == "hull",
                        host_descriptors=walk != "list_kernel_desc")

    def score(s, b, h, qi, ki):
        return 4.0 * torch.tanh(s / 4.0) + bias.double()[h]

    ref, ref_lse = reference_attention(q, k, v, score, mods.causal)
    assert_matches_reference(out, ref, dtype)
    assert_lse_matches(lse, ref_lse, dtype)
    s = q.double() @ k.double().repeat_interleave(2, 1).transpose(-2, -1) * D ** -0.5
    s = score(s, None, torch.arange(HQ, device=device).view(1, HQ, 1, 1), None, None)
    s = s.masked_fill(~(torch.arange(M, device=device)[:, None]
                        >= torch.arange(N, device=device)[None, :]), float("-inf"))
    torch.testing.assert_close(mx.double(), s.amax(-1), atol=1e-2, rtol=1e-3)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("fn", [
    mods.softcap(3.0),                                       # both ends folded: OUT_SCALE 3
    lambda s, b, h, q, kv: (s / 4 + s) / 0.5,                # input half-folded, OUT_SCALE 2
    lambda s, b, h, q, kv: torch.tanh(s / 2) * -2.0,         # negative factor stays in the mod
    # score + x: qk + x / sm_scale (SM_SCALED) for sm_scale > 0, the unfolded twin otherwise
    mods.alibi(2),                                           # qk + (slope / sm_scale) * (kv - q)
    lambda s, b, h, q, kv: (s - 0.25 * (q - kv)) * 2.0,      # minus, and a final multiply
    lambda s, b, h, q, kv: (q - kv) * 0.1 + s,               # the score on the right
], ids=["softcap", "half_folded", "negative", "alibi", "minus_scaled", "score_right"])
@pytest.mark.parametrize("sm_scale", [0.2, 0.0, -0.3])
def test_generated_mods_with_folded_scales(device, fn, sm_scale):
    _interpreter_or_cuda(device)
    dtype = torch.float16
    Z, H, M, N, D = 1, 2, 96, 80, 32
    q, k, v = (torch.randn(Z, H, n, D, device=device, dtype=dtype) for n in (M, N, N))
    gm, _ = trace_mod(fn, "score")
    out, lse, mx = _run(q, k, v, sm_scale=sm_scale,
                        score_mod=load_mod(generate_mod_source(gm, "score", [])))
    ref, ref_lse = reference_attention(q, k, v, fn, scale=sm_scale)
    assert_matches_reference(out, ref, dtype)
    assert_lse_matches(lse, ref_lse, dtype)
    hi = torch.arange(H, device=device).view(1, H, 1, 1)
    qi, ki = torch.arange(M, device=device)[:, None], torch.arange(N, device=device)[None, :]
    s = fn(q.double() @ k.double().transpose(-2, -1) * sm_scale, None, hi, qi, ki)
    torch.testing.assert_close(mx.double(), s.amax(-1), atol=1e-2, rtol=1e-3)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("walk", ["list", "hull"])
def test_fully_masked_rows_give_zero_and_neg_inf(device, walk):
    _interpreter_or_cuda(device)
    dtype = torch.float16
    M = N = 128
    q, k, v = (torch.randn(1, 2, M, 32, device=device, dtype=dtype) for _ in range(3))

    def rows_below_40_see_nothing(b, h, q_idx, kv_idx):
        return (q_idx >= 40) & (kv_idx <= q_idx)

    mask_src = """@triton.jit
def mask_mod(b, h, q_idx, kv_idx, bufs):
    return (q_idx >= 40) & (kv_idx <= q_idx)
"""
    bm = create_block_mask(rows_below_40_see_nothing, 1, 1, M, N, device=device, BLOCK_SIZE=32)
    out, lse, _ = _run(q, k, v, sm_scale=0.2, mask_mod=load_mod(mask_src),
                       kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices,
                       full_kv_num_blocks=bm.full_kv_num_blocks,
                       full_kv_indices=bm.full_kv_indices, sparse_q_block=32, sparse_kv_block=32,
                       iterate_hull=walk == "hull")
    assert torch.all(out[:, :, :40] == 0)
    assert torch.all(lse[:, :, :40].isneginf())
    ref, ref_lse = reference_attention(q, k, v, None, rows_below_40_see_nothing, scale=0.2)
    assert_matches_reference(out, ref, dtype)
    assert_lse_matches(lse, ref_lse, dtype)


@pytest.mark.parametrize("device", _devices())
def test_strided_bshd_layout_is_read_and_written_in_place(device):
    _interpreter_or_cuda(device)
    dtype = torch.float16
    B, S, H, D = 2, 96, 4, 64
    qkv = torch.randn(B, S, 3, H, D, device=device, dtype=dtype)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, S, D) views, no copy
    out_storage = torch.full((B, S, H, D), float("nan"), device=device, dtype=dtype)
    out = out_storage.transpose(1, 2)
    lse = torch.empty(B, H, S, device=device)
    mx = torch.empty(B, H, S, device=device)
    launch_generic(q, k, v, out, lse, mx, sm_scale=D ** -0.5)
    ref, _ = reference_attention(q, k, v)
    assert_matches_reference(out, ref, dtype)
    assert not out_storage.isnan().any()


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("n, sparse", [(64, 128), (192, 128)])
def test_block_reaching_past_the_keys(device, n, sparse):
    # A block-mask block longer than what is left of the keys covers whole tiles past N (N=64
    # with 128-key blocks: the second 64-key tile). Those must stay masked even though N is
    # a multiple of the tile: the last query row saw zero-filled keys as visible (seen under
    # causal at S=64, row 63 wrong).
    _interpreter_or_cuda(device)
    q, k, v = (torch.randn(1, 2, n, 16, device=device, dtype=torch.float32) for _ in range(3))
    bm = create_block_mask(mods.causal, 1, 1, n, n, device=device, BLOCK_SIZE=sparse)
    out, lse, _ = _run(q, k, v, sm_scale=0.25, mask_mod=load_mod(CAUSAL_TL),
                       kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices,
                       full_kv_num_blocks=bm.full_kv_num_blocks,
                       full_kv_indices=bm.full_kv_indices, sparse_q_block=sparse,
                       sparse_kv_block=sparse)
    ref, ref_lse = reference_attention(q, k, v, None, mods.causal, scale=0.25)
    assert_matches_reference(out, ref, torch.float32)
    assert_lse_matches(lse, ref_lse, torch.float32)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("host_descriptors", [True, False], ids=["host_desc", "kernel_desc"])
def test_kv_batch_of_one_broadcasts_over_the_query_batch(device, host_descriptors):
    _interpreter_or_cuda(device)
    dtype = torch.float16
    q = torch.randn(3, 2, 70, 32, device=device, dtype=dtype)
    k, v = (torch.randn(1, 2, 90, 32, device=device, dtype=dtype) for _ in range(2))
    out, lse, _ = _run(q, k, v, sm_scale=32 ** -0.5, host_descriptors=host_descriptors)
    ref, ref_lse = reference_attention(q, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1))
    assert_matches_reference(out, ref, dtype)
    assert_lse_matches(lse, ref_lse, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2048, 2048 + 77])   # a ragged tail on the long-plain tiles too
def test_long_plain_sites_take_128x128_tiles_and_match_float64(n):
    """The tile table's long-plain entry (no mod, no mask, >= 2048 keys on sm90: 128x128, 8 warps)
    against float64; GQA and a query length that is not a multiple of 128."""
    from fa3_inductor.templates.generic.host import prepare_generic
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the long-plain tiles are an sm90 entry")
    dtype = torch.bfloat16
    q = torch.randn(2, 4, 300, 128, device="cuda", dtype=dtype)
    k, v = (torch.randn(2, 2, n, 128, device="cuda", dtype=dtype) for _ in range(2))
    kwargs = prepare_generic(q, k, v, torch.empty_like(q), torch.empty(2, 4, 300, device="cuda"),
                             torch.empty(2, 4, 300, device="cuda"), sm_scale=0.09)[2]
    assert (kwargs["TILE"].BLOCK_M, kwargs["TILE"].BLOCK_N, kwargs["num_warps"]) == (128, 128, 8), kwargs
    out, lse, _ = _run(q, k, v, sm_scale=0.09)
    ref, ref_lse = reference_attention(q, k, v, scale=0.09)
    assert_matches_reference(out, ref, dtype)
    assert_lse_matches(lse, ref_lse, dtype)


def test_tile_table_picks_long_plain_tiles_and_reads_a_tuning_override(monkeypatch):
    from fa3_inductor.templates.generic.configs import GenericConfig, generic_config

    assert generic_config(128, (9, 0)) == GenericConfig(64, 64, 4, 3, False)
    assert generic_config(128, (9, 0), plain_kv_len=4096) == GenericConfig(128, 128, 8, 3, False)
    monkeypatch.setenv("FA3_INDUCTOR_GENERIC_TILES", "128:128x64w8s2")
    assert generic_config(128, (9, 0)) == GenericConfig(128, 64, 8, 2, False)
    assert generic_config(64, (9, 0)) == GenericConfig(128, 128, 4, 3, False)  # not overridden
    monkeypatch.setenv("FA3_INDUCTOR_GENERIC_TILES", "128:big")
    with pytest.raises(ValueError, match="FA3_INDUCTOR_GENERIC_TILES"):
        generic_config(128, (9, 0))
