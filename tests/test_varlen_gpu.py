"""flex_varlen on an sm90 GPU: the Hopper kernel's packed mode (kernel="hopper") against a float64 reference run on
each sequence alone, out and LSE (tests/reference.py's tolerance rule), and beside it the Triton varlen kernel on
the same packs. Ragged packs with empty and one-token sequences, lengths on and off the 128-row tiles, M != N both
ways, GQA, causal, softcap, causal windows (the Hopper kernel walks them from their edge, 50 keys: less than a tile,
300: the edge cuts one), a per-sequence captured buffer; rows after the
pack's last sequence stay untouched (tail tiles are stored by masked pointers, not TMA); a CUDA graph replays with
other lengths (no host read of cu_seqlens).

    pytest -m gpu tests/test_varlen_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from fa3_inductor import mods
from fa3_inductor.varlen import flex_varlen
from test_varlen import _check, _cu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the Hopper varlen kernel needs an sm90 GPU")]

# empty, one token, one row past a tile, exactly a tile, several tiles; keys shorter and longer than queries
LENGTHS_Q = [5, 0, 300, 1, 128, 257, 40]
LENGTHS_K = [9, 3, 200, 1, 128, 400, 0]


def _packed(lq, lk, hq, hkv, d, dtype):
    return (torch.randn(sum(lq), hq, d, device="cuda", dtype=dtype),
            torch.randn(sum(lk), hkv, d, device="cuda", dtype=dtype),
            torch.randn(sum(lk), hkv, d, device="cuda", dtype=dtype))


def _run(q, k, v, lq, lk, kernel, **mods_and_scale):
    return flex_varlen(q, k, v, _cu(lq).cuda(), _cu(lk).cuda(), max(lq), max(lk), enable_gqa=True, return_lse=True,
                       kernel=kernel, **mods_and_scale)


@pytest.mark.parametrize("kernel", ["hopper", "triton"])
@pytest.mark.parametrize("variant", ["none", "causal", "softcap_causal", "window", "window300"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_ragged_gqa_against_float64(head_dim, variant, kernel):
    score_mod, mask_mod = {"none": (None, None), "causal": (None, mods.causal),
                           "softcap_causal": (mods.softcap(20.0), mods.causal),
                           "window": (None, mods.sliding_window(50)),
                           "window300": (None, mods.sliding_window(300))}[variant]
    torch.manual_seed(0)
    q, k, v = _packed(LENGTHS_Q, LENGTHS_K, 4, 2, head_dim, torch.bfloat16)
    out, lse = _run(q, k, v, LENGTHS_Q, LENGTHS_K, kernel, score_mod=score_mod, mask_mod=mask_mod)
    _check(out, lse, q, k, v, LENGTHS_Q, LENGTHS_K, score_mod, mask_mod)


def test_fp16_per_sequence_buffer_and_scale():
    """b is the sequence index: a per-sequence, per-head bias from a captured tensor; fp16; a given scale."""
    lq, lk = [3, 200, 17, 129], [20, 130, 2, 129]
    torch.manual_seed(1)
    q, k, v = _packed(lq, lk, 4, 1, 128, torch.float16)
    bias = torch.randn(4, 4, device="cuda")
    score_mod = lambda s, b, h, q_idx, kv_idx: s + bias[b, h] * (kv_idx - q_idx) / 64   # noqa: E731
    out, lse = _run(q, k, v, lq, lk, "hopper", score_mod=score_mod, mask_mod=mods.causal, scale=0.05)
    _check(out, lse, q, k, v, lq, lk, score_mod, mods.causal, scale=0.05)


def test_rows_after_the_last_sequence_stay_untouched():
    """Sequences cover rows [0, 70) of 200: the second one's tail tile reaches past its end, and its O / LSE rows
    there (which TMA would store) must keep what they held."""
    from fa3_inductor.templates.hopper.varlen_sm90 import launch_varlen_sm90
    from fa3_inductor.varlen import generated_mod

    q, k, v = _packed([200], [200], 4, 2, 128, torch.bfloat16)
    out = torch.full_like(q, 7.0)
    lse = torch.full((4, 200), 7.0, device="cuda")
    cu = torch.tensor([0, 5, 70], dtype=torch.int32, device="cuda")
    mask_fn, bufs, _ = generated_mod(mods.causal, "mask", "gl")
    launch_varlen_sm90(q, k, v, out, lse, cu, cu, 65, sm_scale=0.1, mask_mod=mask_fn, mask_bufs=bufs, causal=True)
    torch.cuda.synchronize()
    assert bool((out[70:] == 7.0).all()) and bool((lse[:, 70:] == 7.0).all())
    assert not bool((out[:70] == 7.0).any())


def test_cuda_graph_replays_other_lengths():
    """Captured once, replayed after cu_seqlens changed in place (same max length): the new packing's result."""
    torch.manual_seed(2)
    first, second = [100, 156, 0, 44], [1, 255, 44, 0]
    q, k, v = _packed(first, first, 4, 2, 128, torch.bfloat16)
    cu = _cu(first).cuda()
    flex_varlen(q, k, v, cu, cu, 256, 256, mask_mod=mods.causal, enable_gqa=True, kernel="hopper")   # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flex_varlen(q, k, v, cu, cu, 256, 256, mask_mod=mods.causal, enable_gqa=True, return_lse=True,
                               kernel="hopper")
    cu.copy_(_cu(second).cuda())
    graph.replay()
    torch.cuda.synchronize()
    _check(out, lse, q, k, v, second, second, None, mods.causal)
