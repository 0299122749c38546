"""flex_varlen's Hopper path (templates/hopper/varlen_sm90.py, fwd_sm90.py's VARLEN mode) on a CPU machine: which
kernel a pack is routed to, the launch the host builds (grid, descriptors, row offsets, bundles), and the kernel
compiled for sm90 (``pytest -m sm90_compile``: wgmma, setmaxnreg, no spills). Its GPU results against float64 are
tests/test_varlen_gpu.py's.
"""

from __future__ import annotations

import pytest
import torch

from fa3_inductor import mods
from fa3_inductor.templates.hopper.varlen_sm90 import prepare_varlen_sm90, varlen_sm90_refusal
from fa3_inductor.templates.modgen import BufferSpec, generate_mod_source, load_mod, trace_mod
from fa3_inductor.templates.varlen.host import pick_varlen_kernel

H100 = (9, 0)


def _gl_mod(fn, kind):
    gm, bufs = trace_mod(fn, kind)
    return load_mod(generate_mod_source(gm, kind, [BufferSpec.of(b) for b in bufs], "gl"), "gl"), tuple(bufs)


def _packed(total_q, total_k, hq=4, hkv=2, d=128, dtype=torch.bfloat16):
    return (torch.randn(total_q, hq, d, dtype=dtype), torch.randn(total_k, hkv, d, dtype=dtype),
            torch.randn(total_k, hkv, d, dtype=dtype))


def test_routing():
    """sm90 with 16-bit inputs, a tiled head dim and TMA-aligned strides runs the Hopper kernel; anything else the
    Triton one; asking for hopper where it cannot run says why."""
    q, k, v = _packed(10, 12)
    assert pick_varlen_kernel(q, k, v, "auto", H100) == "hopper"
    assert pick_varlen_kernel(q, k, v, "triton", H100) == "triton"
    assert pick_varlen_kernel(q, k, v, "auto", (8, 0)) == "triton"
    assert pick_varlen_kernel(q, k, v, "auto", None) == "triton"      # the interpreter
    assert pick_varlen_kernel(q.float(), k.float(), v.float(), "auto", H100) == "triton"
    q112, k112, v112 = _packed(10, 12, d=112)                        # no Hopper tiles for 112
    assert pick_varlen_kernel(q112, k112, v112, "auto", H100) == "triton"
    qkv = torch.randn(10, 3 * 4 * 128 + 4, dtype=torch.bfloat16)     # token stride not 16-byte aligned
    q_odd = qkv[:, :512].view(10, 4, 128)
    assert "16-byte" in varlen_sm90_refusal(q_odd, k, v, H100)
    assert pick_varlen_kernel(q_odd, k, v, "auto", H100) == "triton"
    with pytest.raises(ValueError, match="needs an sm90 GPU, this is sm80"):
        pick_varlen_kernel(q, k, v, "hopper", (8, 0))
    with pytest.raises(ValueError, match="kernel must be one of"):
        pick_varlen_kernel(q, k, v, "gluon", H100)


def test_flex_varlen_checks_the_kernel_keyword():
    from fa3_inductor.varlen import flex_varlen

    q, k, v = _packed(6, 6, 2, 2, 64, torch.float32)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="kernel='hopper' cannot run here"):
        flex_varlen(q, k, v, cu, cu, 4, 4, kernel="hopper")


@pytest.mark.parametrize("causal", [False, True])
def test_launch_layout(causal):
    """Grid: each head's virtual query tiles (434 // 128 + 4 + 1 = 8: every real tile, and at most one a sequence
    that exits), their sequences in the table the tile pass writes; the descriptors read the packed tensors in place
    as [1, H, total, D] (row = token); O and LSE are written in place; the causal walk replaces the per-tile mask on
    every tile."""
    lengths_q, lengths_k = [5, 0, 300, 129], [9, 3, 200, 400]
    cu_q = torch.tensor([0, 5, 5, 305, 434], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 12, 212, 612], dtype=torch.int32)
    q, k, v = _packed(sum(lengths_q), sum(lengths_k), hq=4, hkv=2, d=64)
    out, lse = torch.empty_like(q), torch.empty(4, sum(lengths_q))
    mask_mod, _ = _gl_mod(mods.causal if causal else mods.sliding_window(64), "mask")
    kernel, args, kwargs, grid = prepare_varlen_sm90(q, k, v, out, lse, cu_q, cu_k, 300, sm_scale=0.125,
                                                     mask_mod=mask_mod, causal=causal)
    assert grid == (4 * 8,)                             # 4 heads x 8 virtual tiles
    named = dict(zip(kernel.arg_names, args))
    for name, t in (("q_desc", q), ("k_desc", k), ("v_desc", v), ("o_desc", out)):
        desc = named[name]
        assert desc.base.data_ptr() == t.data_ptr()
        assert list(desc.shape) == [1, t.shape[1], t.shape[0], t.shape[2]]
        assert list(desc.strides)[1:] == [t.stride(1), t.stride(0), 1]
    assert named["q_desc"].block_shape == [1, 1, 64, 64] and named["k_desc"].block_shape == [1, 1, 128, 64]
    assert named["lse_ptr"].data_ptr() == lse.data_ptr() and named["lse_ptr"].shape == (1, 4, 434)
    cu_q_arg, cu_k_arg, out_arg, stride_t, stride_h, window, table = named["pack_args"]
    assert cu_q_arg is cu_q and cu_k_arg is cu_k and out_arg.data_ptr() == out.data_ptr()
    assert (stride_t, stride_h, window) == (4 * 64, 64, 0) and table.shape == (8,) and table.dtype == torch.int32
    assert (named["num_tiles"], named["num_m_tiles"], named["HQ"], named["GQA"]) == (32, 8, 4, 2)
    assert kwargs["PACK"].VARLEN
    assert not kwargs["SCHED"].PERSISTENT and not kwargs["FLAGS"].EVEN_N
    assert kwargs["SPARSE"].CAUSAL_WALK == causal and kwargs["FLAGS"].DENSE_MASK != causal
    assert not kwargs["SPARSE"].HAS_SPARSE


def test_causal_needs_the_mask():
    q, k, v = _packed(8, 8)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="pass mask_mod"):
        prepare_varlen_sm90(q, k, v, torch.empty_like(q), torch.empty(4, 8), cu, cu, 8, sm_scale=0.1, causal=True)


@pytest.mark.sm90_compile
# Three of the six (D64 and D128 x plain, causal, softcap+causal) compiled no-spill when written
# (docs/design/varlen.md): the widest D128 pair and D64 plain keep CI's compile time down.
@pytest.mark.parametrize("head_dim,variant", [(64, "plain"), (128, "causal"), (128, "softcap_causal")])
def test_sm90_compile_no_spills(head_dim, variant):
    """The Hopper varlen kernel builds for sm90 with wgmma, its register split and no spills."""
    from fa3_inductor.templates.aot import sass_report
    from fa3_inductor.templates.hopper import get_config
    from fa3_inductor.templates.hopper.varlen_sm90 import compile_varlen_sm90

    options = {}
    if "softcap" in variant:
        options["score_mod"], options["score_bufs"] = _gl_mod(mods.softcap(30.0), "score")
    if "causal" in variant:
        options["mask_mod"], options["mask_bufs"] = _gl_mod(mods.causal, "mask")
        options["causal"] = True
    q, k, v = _packed(1024, 1024, 4, 2, head_dim)
    cu = torch.tensor([0, 300, 1024], dtype=torch.int32)
    r = sass_report(compile_varlen_sm90(q, k, v, torch.empty_like(q), torch.empty(4, 1024), cu, cu, 724,
                                        sm_scale=head_dim ** -0.5, **options))
    cfg = get_config(head_dim)
    summary = (f"D{head_dim} {variant}: {r.registers} registers, {r.hgmma} HGMMA, stack {r.stack}, "
               f"{r.spill_instructions} spill instructions, {r.shared} B shared")
    print(summary)
    assert r.stack == 0 and r.local == 0 and r.spill_instructions == 0, summary
    assert r.hgmma > 0 and f"HGMMA.64x{cfg.block_n}x16.F32.BF16" in r.sass, summary
    assert {cfg.consumer_regs, cfg.producer_regs} <= r.setmaxnreg, f"setmaxnreg dropped: {r.setmaxnreg}"
    assert r.shared <= 227 * 1024, summary
