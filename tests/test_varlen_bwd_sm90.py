"""flex_varlen's backward on a CPU machine (templates/hopper_bwd/varlen.py, bwd_sm90.py's PACK.VARLEN mode): what it
serves, the launches the host builds (grid over KV tiles x sequences x heads, the walk's bundle, scratch rows past
the pack, packed views), its refusals, and the main kernel compiled for sm90 (``pytest -m sm90_compile``: wgmma, no
spills). Its GPU results against float64 are tests/test_varlen_bwd_gpu.py's.
"""

from __future__ import annotations

import pytest
import torch

from fa3_inductor import mods
from fa3_inductor.templates.hopper_bwd.varlen import prepare_varlen_backward, varlen_bwd_refusal
from fa3_inductor.varlen import generated_mod
from fa3_inductor.varlen_grad import score_derivative

CU = torch.tensor([0, 300, 300, 1000], dtype=torch.int32)   # three sequences, the second empty


def _inputs(d=128, hq=4, hkv=2, total=1000, dv=None):
    dv = dv or d
    q, out, dout = (torch.randn(total, hq, n, dtype=torch.bfloat16) for n in (d, dv, dv))
    k, v = (torch.randn(total, hkv, n, dtype=torch.bfloat16) for n in (d, dv))
    return q, k, v, out, dout, torch.randn(hq, total), torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _mods(variant):
    if variant == "causal":
        fn, bufs, _ = generated_mod(mods.causal, "mask", "gl")
        return dict(mask_mod=fn, mask_bufs=bufs, causal=True)
    if variant in ("window", "other_mask"):   # the window walked, or a mask_mod the host knows nothing of
        fn, bufs, _ = generated_mod(mods.sliding_window(100), "mask", "gl")
        return dict(mask_mod=fn, mask_bufs=bufs, **({"window": 100} if variant == "window" else {}))
    if variant == "softcap":
        fn, bufs, _ = generated_mod(mods.softcap(20.0), "score", "gl")
        return dict(score_mod=fn, score_bufs=bufs, score_grad_mod=score_derivative(mods.softcap(20.0)))
    return {}


@pytest.mark.parametrize("variant", ["none", "causal", "window", "other_mask"])
def test_launch_layout(variant):
    """Grid (virtual KV tiles, kv heads) over the tile table the first launch writes; the walk follows the mask: the
    diagonal walk for causal, the window's walk (its W the pack's fourth entry), the mask on every tile for another
    mask_mod; scratch rows cover the pack plus a tile; no block tables or CTA order."""
    tiles, pre, main, convert = prepare_varlen_backward(*_inputs(), CU, CU, sm_scale=0.1, **_mods(variant))
    kernel, args, kwargs, grid = main
    assert grid == (1000 // 128 + 3 + 1, 2)                    # virtual KV tiles, kv heads
    assert kwargs["PACK"].VARLEN and args[-1][:2] == (CU, CU) and args[-2] == ()
    assert args[-1][2] is tiles[1][1] and tiles[1][2:] == (3, 11, 3) and tiles[3] == (1,)   # B, T, halvings
    assert kwargs["SPARSE"].CAUSAL_WALK == (variant == "causal")
    assert kwargs["SPARSE"].WINDOW_WALK == (variant == "window") and args[-1][3:] == ((100,) if variant == "window"
                                                                                      else ())
    assert kwargs["SPARSE"].DENSE_MASK == (variant == "other_mask") and not kwargs["SPARSE"].HAS_BLOCK_MASK
    assert not kwargs["FLAGS"].EVEN_N and not kwargs["SCHED"].PERSISTENT and not kwargs["SCHED"].DQ_FRAG
    stats, dq_acc = args[5], args[6]
    assert tuple(stats.shape) == (4, 2, 1088) and tuple(dq_acc.shape) == (4, 1088, 128)   # 1024 + 64 rows
    assert pre[3] == (1088 // 64, 4) and convert[3] == (1000 // 64 + 1, 4)
    assert tuple(pre[1][0].shape) == (1, 4, 1000, 128)        # out as the packed [1, H, T, D] view


def test_refusals_say_what_to_do():
    q, k, v, out, dout, lse, dq, dk, dv = _inputs()
    with pytest.raises(ValueError, match="causal=True or a window without the mask_mod itself"):
        prepare_varlen_backward(q, k, v, out, dout, lse, dq, dk, dv, CU, CU, sm_scale=0.1, causal=True)
    for window in (-1, 2.5):
        with pytest.raises(ValueError, match=r"window .* \(keys a row sees, itself included: an int >= 1"):
            prepare_varlen_backward(q, k, v, out, dout, lse, dq, dk, dv, CU, CU, sm_scale=0.1, window=window,
                                    **_mods("other_mask"))
    with pytest.raises(ValueError, match="dk is not contiguous"):
        prepare_varlen_backward(q, k, v, out, dout, lse, dq, dk.transpose(0, 1).contiguous().transpose(0, 1), dv,
                                CU, CU, sm_scale=0.1)
    q112, k112, v112 = (torch.empty(10, 2, 112, dtype=torch.bfloat16) for _ in range(3))
    assert "64/64, 80/80, 96/96, 128/128, 160/160, 192/128" in varlen_bwd_refusal(q112, k112, v112, (9, 0))
    q256 = torch.empty(10, 2, 256, dtype=torch.bfloat16)
    assert varlen_bwd_refusal(q256, q256, q256, (9, 0)) is None
    assert "sm90" in varlen_bwd_refusal(q, k, v, (8, 0))
    assert "float16 or bfloat16" in varlen_bwd_refusal(q.float(), k.float(), v.float(), (9, 0))


def test_cpu_inputs_that_need_gradients_take_the_dense_path():
    """On the CPU flex_varlen's gradients still come from autograd through its dense path (no kernel runs)."""
    from fa3_inductor.varlen import flex_varlen

    q, k, v = (torch.randn(9, 2, 16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    flex_varlen(q, k, v, cu, cu, 5, 5, mask_mod=mods.causal).sum().backward()
    assert q.grad is not None and k.grad.shape == k.shape


def test_wide_head_dims_run_the_wide_kernel():
    """192 / 128 and 256 (and 160 in the 256 tiles): bwd_sm90_wide.py's packed mode over 64-key virtual tiles, dQ in
    tiled order (sequence starts are no multiple of 64)."""
    from fa3_inductor.templates.hopper_bwd.bwd_sm90_wide import fa3_bwd_sm90_wide_kernel

    for d, dv in ((192, 128), (256, 256), (160, 160)):
        tiles, pre, main, convert = prepare_varlen_backward(*_inputs(d, dv=dv), CU, CU, sm_scale=0.1, **_mods("causal"))
        assert main[0] is fa3_bwd_sm90_wide_kernel and main[3] == (1000 // 64 + 3 + 1, 2), (d, main[3])
        assert main[2]["PACK"].VARLEN and not main[2]["TILE"].DQ_FRAG and tiles[2]["BLOCK_N"] == 64
        assert main[2]["SPARSE"].CAUSAL_WALK and main[2]["SPARSE"].SPARSE_KV == 64


@pytest.mark.sm90_compile
@pytest.mark.parametrize("variant", ["none", "causal", "softcap", "window"])
@pytest.mark.parametrize("head_dims", [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)])
def test_sm90_compile_no_spills(head_dims, variant):
    from fa3_inductor.templates.aot import sass_report
    from fa3_inductor.templates.hopper_bwd.varlen import compile_varlen_backward

    head_dim, value_dim = head_dims
    q, k, v, out, dout, lse, *_ = _inputs(head_dim, dv=value_dim)
    main = sass_report(compile_varlen_backward(q, k, v, out, dout, lse, CU, CU, sm_scale=head_dim ** -0.5,
                                               **_mods(variant))[2])
    assert main.hgmma > 0 and main.spill_instructions == 0, (main.hgmma, main.spill_instructions)
    assert main.shared <= 227 * 1024


@pytest.mark.parametrize("variant", ["causal", "softcap_per_sequence"])
def test_document_mask_path_gives_flex_varlen_gradients(our_kernels, variant):
    """Where the packed backward does not serve, flex_varlen's gradients come from flex() over the pack with a
    document mask (varlen_grad.through_document_mask): the same output, LSE and gradients as its dense path, mods
    seeing the sequence index and positions within it (empty and one-token sequences, M != N)."""
    from fa3_inductor.varlen import _dense
    from fa3_inductor.varlen_grad import through_document_mask
    from reference import TOLERANCE, rel_error

    lq, lk = [5, 0, 21, 1, 9], [7, 3, 21, 1, 0]
    cu_q, cu_k = (torch.nn.functional.pad(torch.tensor(n).cumsum(0), (1, 0)).int() for n in (lq, lk))
    torch.manual_seed(0)
    leaves = [torch.randn(sum(n), h, 16, requires_grad=True) for n, h in ((lq, 4), (lk, 2), (lk, 2))]
    bias = torch.randn(len(lq))
    score_mod = (lambda s, b, h, q_idx, kv_idx: s + bias[b] * (kv_idx - q_idx)) if variant != "causal" else None
    mask_mod = mods.causal
    out, lse = through_document_mask(*leaves, cu_q, cu_k, score_mod, mask_mod, 0.25, True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad((out, lse), leaves, (dout, torch.ones_like(lse)))
    ref_out, ref_lse = _dense(*leaves, cu_q, cu_k, score_mod, mask_mod, 0.25, True)
    ref_grads = torch.autograd.grad((ref_out, ref_lse), leaves, (dout, torch.ones_like(ref_lse)))
    assert rel_error(out, ref_out) <= TOLERANCE[torch.float32]
    assert torch.equal(lse.isneginf(), ref_lse.isneginf())
    finite = ~ref_lse.isinf()
    assert (lse[finite] - ref_lse[finite]).abs().max() <= 1e-4
    for got, want in zip(grads, ref_grads):
        assert rel_error(got, want) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("lengths", [[5, 0, 300, 1, 128, 257, 0, 40], [1000], [0, 0, 129]])
def test_tile_table_gives_each_virtual_tile_its_sequence(cpu_kernels, lengths):
    """packed_tile_table_kernel (Triton's interpreter): virtual tile t belongs to the last sequence b whose tiles start
    at or before it (o_b = CU_K[b] // 128 + b); every real KV tile (b, j) sits at o_b + j, and no two collide."""
    from fa3_inductor.templates.hopper.tile_table import packed_tile_table_kernel

    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).int()
    B = len(lengths)
    table = torch.full((int(cu[-1]) // 128 + B + 1,), -1, dtype=torch.int32)
    packed_tile_table_kernel[(1,)](cu, table, B, table.shape[0], max(1, (B - 1).bit_length()) + 1, BLOCK_N=128,
                                   BLOCK=64 if table.shape[0] <= 64 else 1024)
    starts = [int(cu[b]) // 128 + b for b in range(B)]
    assert table.tolist() == [max(b for b in range(B) if starts[b] <= t) for t in range(table.shape[0])]
    real = [starts[b] + j for b in range(B) for j in range(-(-lengths[b] // 128))]
    assert len(set(real)) == len(real) and max(real, default=0) < table.shape[0]


def test_deterministic_algorithms_send_varlen_gradients_to_the_document_mask(monkeypatch):
    """Under torch.use_deterministic_algorithms(True) flex_varlen's gradients leave the packed backward (dQ in arrival
    order) for the document-mask path, whose backward families honour the switch; otherwise the packed one serves."""
    from fa3_inductor import varlen_grad

    monkeypatch.setattr(varlen_grad, "varlen_bwd_refusal", lambda *args: None)   # as if on an sm90 GPU
    q = torch.empty(10, 4, 128, dtype=torch.bfloat16)
    assert varlen_grad.varlen_grad_refusal(q, q, q, (), ()) is None
    torch.use_deterministic_algorithms(True)
    try:
        why = varlen_grad.varlen_grad_refusal(q, q, q, (), ())
    finally:
        torch.use_deterministic_algorithms(False)
    assert "use_deterministic_algorithms" in why
