"""flex_decode's prefill chunks through the Hopper kernel's cache mode (templates/hopper/cache_sm90.py, fwd_sm90.py's
PACK.CACHE) on a CPU machine: what it serves, the launch the host builds (descriptors over the pages in place, the
lengths, positions and table as kernel arguments), and the kernel compiled for sm90 (``pytest -m sm90_compile``:
wgmma, page boxes by TMA, no spills). Its GPU results against float64 are tests/test_decode_gpu.py's.
"""

from __future__ import annotations

import pytest
import torch

from fa3_inductor import mods
from fa3_inductor.templates.hopper.cache_sm90 import cache_sm90_refusal, page_served, prepare_cache_sm90
from fa3_inductor.varlen import generated_mod

H100 = (9, 0)


def _chunk(B=2, HQ=8, HKV=2, M=200, D=128, page=64, pages=40, max_pages=16, dtype=torch.bfloat16):
    q = torch.randn(B, HQ, M, D, dtype=dtype)
    if page:
        k, v = (torch.randn(pages, page, HKV, D, dtype=dtype) for _ in range(2))
        table = torch.randperm(pages)[:B * max_pages].view(B, max_pages).to(torch.int32)
    else:
        k, v = (torch.randn(B, HKV, max_pages * 64, D, dtype=dtype) for _ in range(2))
        table = None
    lens = torch.tensor([900, 130][:B], dtype=torch.int32)
    return q, k, v, table, lens


def test_what_it_serves():
    q, k, v, table, _ = _chunk()
    assert cache_sm90_refusal(q, k, v, table, H100) is None
    assert "sm90" in cache_sm90_refusal(q, k, v, table, (8, 0))
    assert "not a GPU" in cache_sm90_refusal(q, k, v, table, None)
    assert "float16 or bfloat16" in cache_sm90_refusal(q.float(), k.float(), v.float(), table, H100)
    assert "head dims" in cache_sm90_refusal(q[..., :40], k[..., :40], v[..., :40], table, H100)
    q48, k48, v48, t48, _ = _chunk(page=48)
    assert "pages of 48 keys" in cache_sm90_refusal(q48, k48, v48, t48, H100)
    assert "16-byte" in cache_sm90_refusal(q, k[..., 1:121], v[..., 1:121], table, H100) or \
        "head dims" in cache_sm90_refusal(q, k[..., 1:121], v[..., 1:121], table, H100)
    qc, kc, vc, _, _ = _chunk(page=0)
    assert cache_sm90_refusal(qc, kc, vc, None, H100) is None
    assert [p for p in (1, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 512) if page_served(p)] == \
        [16, 32, 64, 128, 256, 512]


@pytest.mark.parametrize("page", [16, 128, 0])
def test_launch_layout(page):
    """The descriptors read the cache in place (pages as [P, HKV, PAGE, D], boxes of min(PAGE, 128) rows); the
    lengths, the positions (seq_lens itself with delta -M by default) and the table travel as pack_args; one CTA a
    tile, no EVEN_N (every sequence has its own N); the causal walk instead of a per-tile mask."""
    q, k, v, table, lens = _chunk(page=page)
    out, lse = torch.empty_like(q), torch.empty(2, 8, 200)
    mask_mod, mask_bufs, _ = generated_mod(mods.causal, "mask", "gl")
    kernel, args, kwargs, grid = prepare_cache_sm90(q, k, v, out, lse, lens, block_table=table, sm_scale=0.1,
                                                    mask_mod=mask_mod, mask_bufs=mask_bufs, causal=True)
    assert grid == (2 * 8 * 2,)   # B x HQ x ceil(200 / 128)
    named = dict(zip(kernel.arg_names, args))
    kd = named["k_desc"]
    assert kd.base.data_ptr() == k.data_ptr()
    if page:
        assert list(kd.shape) == [40, 2, page, 128] and kd.block_shape == [1, 1, min(page, 128), 128]
        assert list(kd.strides) == [k.stride(0), k.stride(2), k.stride(1), 1]
        lens_arg, first, delta, window, table_arg, row_stride, max_pages = named["pack_args"]
        assert table_arg is table and (row_stride, max_pages) == (16, 16)
        assert named["N"] == 16 * page
    else:
        assert list(kd.shape) == list(k.shape) and kd.block_shape == [1, 1, 128, 128]
        lens_arg, first, delta, window = named["pack_args"]
        assert named["N"] == k.shape[2]
    assert lens_arg is lens and first is lens and delta == -200 and window == 0
    assert kwargs["PACK"].CACHE and kwargs["PACK"].PAGE == page and not kwargs["PACK"].VARLEN
    assert kwargs["PACK"].PAGE_BOX == (min(page, 128) if page else 0)
    assert not kwargs["SCHED"].PERSISTENT and not kwargs["FLAGS"].EVEN_N
    assert kwargs["SPARSE"].CAUSAL_WALK and not kwargs["FLAGS"].DENSE_MASK
    # q_offset given: it is FIRST, delta 0
    offs = torch.tensor([5, 0], dtype=torch.int32)
    _, args2, _, _ = prepare_cache_sm90(q, k, v, out, lse, lens, block_table=table, q_offset=offs, sm_scale=0.1)
    assert dict(zip(kernel.arg_names, args2))["pack_args"][1:3] == (offs, 0)


def test_a_causal_window_walks_from_its_edge():
    """A recognized causal window: the walk (SPARSE.WINDOW, no per-tile mask on full tiles), W in pack_args."""
    q, k, v, table, lens = _chunk(page=16)
    mask_mod, mask_bufs, _ = generated_mod(mods.sliding_window(300), "mask", "gl")
    kernel, args, kwargs, _ = prepare_cache_sm90(q, k, v, torch.empty_like(q), torch.empty(2, 8, 200), lens,
                                                 block_table=table, sm_scale=0.1, mask_mod=mask_mod,
                                                 mask_bufs=mask_bufs, window=300)
    assert kwargs["SPARSE"].WINDOW and kwargs["SPARSE"].CAUSAL_WALK and not kwargs["FLAGS"].DENSE_MASK
    assert dict(zip(kernel.arg_names, args))["pack_args"][3] == 300


def test_causal_needs_the_mask():
    q, k, v, table, lens = _chunk()
    for walk in (dict(causal=True), dict(window=64)):
        with pytest.raises(ValueError, match="pass mask_mod"):
            prepare_cache_sm90(q, k, v, torch.empty_like(q), torch.empty(2, 8, 200), lens, block_table=table,
                               sm_scale=0.1, **walk)


@pytest.mark.sm90_compile
@pytest.mark.parametrize("D, page, variant", [(128, 16, "causal"), (64, 128, "softcap_causal"), (128, 0, "causal")])
def test_sm90_compile_no_spills(D, page, variant):
    """The cache mode builds for sm90 with wgmma, its register split and no spills: pages of 16 (eight boxes a
    128-key tile, K's and V's issued together, each page read once), pages holding whole tiles, a contiguous cache."""
    from fa3_inductor.templates.aot import sass_report
    from fa3_inductor.templates.hopper import get_config
    from fa3_inductor.templates.hopper.cache_sm90 import compile_cache_sm90

    q, k, v, table, lens = _chunk(D=D, page=page)
    options = {}
    if "softcap" in variant:
        options["score_mod"], options["score_bufs"], _ = generated_mod(mods.softcap(30.0), "score", "gl")
    options["mask_mod"], options["mask_bufs"], _ = generated_mod(mods.causal, "mask", "gl")
    r = sass_report(compile_cache_sm90(q, k, v, torch.empty_like(q), torch.empty(2, 8, 200), lens, block_table=table,
                                       sm_scale=D ** -0.5, causal=True, **options))
    cfg = get_config(D)
    boxes = 128 // page if page and page < 128 else 1
    summary = (f"D{D} page {page} {variant}: {r.registers} registers, {r.hgmma} HGMMA, {r.sass.count('UTMALDG')} "
               f"UTMALDG, stack {r.stack}, {r.spill_instructions} spill instructions, {r.shared} B shared")
    print(summary)
    assert r.stack == 0 and r.local == 0 and r.spill_instructions == 0, summary
    assert r.hgmma > 0 and f"HGMMA.64x{cfg.block_n}x16.F32.BF16" in r.sass, summary
    assert r.sass.count("UTMALDG") >= 2 * boxes, summary   # K's and V's boxes of a tile (Q's come on top)
    assert {cfg.consumer_regs, cfg.producer_regs} <= r.setmaxnreg, f"setmaxnreg dropped: {r.setmaxnreg}"
