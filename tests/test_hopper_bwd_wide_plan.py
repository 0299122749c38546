"""CPU-only: the sm90 backward's launch plan for the wide head dims (256, 192 / 128: templates/hopper_bwd/
bwd_sm90_wide.py) — which kernel, tiles, grid and pass parameters prepare_hopper_backward picks (no compile, no
launch), and the config table's shared-memory arithmetic."""
from __future__ import annotations

import math

import pytest
import torch


def _plan(D, DV, M=1000, N=777, **options):
    from fa3_inductor.templates.hopper_bwd import prepare_hopper_backward

    q = torch.randn(2, 4, M, D, dtype=torch.bfloat16)
    k = torch.randn(2, 2, N, D, dtype=torch.bfloat16)
    v = torch.randn(2, 2, N, DV, dtype=torch.bfloat16)
    out = torch.empty(2, 4, M, DV, dtype=torch.bfloat16)
    return prepare_hopper_backward(q, k, v, out, torch.empty_like(out), torch.empty(2, 4, M), torch.empty_like(q),
                                   torch.empty_like(k), torch.empty_like(v), sm_scale=D ** -0.5, **options)


# (D, DV, the tiles' D / DV, ring stages, dQ staging tiles a warpgroup): 192 / 192 runs the 256 tiles
# (configs.PADDED_WIDE_PAIRS)
@pytest.mark.parametrize("D, DV, tile_d, tile_dv, stages, dq_bufs", [(256, 256, 256, 256, 1, 1),
                                                                      (192, 128, 192, 128, 2, 2),
                                                                      (192, 192, 256, 256, 1, 1)])
def test_wide_plan(D, DV, tile_d, tile_dv, stages, dq_bufs):
    from fa3_inductor.templates.hopper_bwd.bwd_sm90_wide import WideTile, fa3_bwd_sm90_wide_kernel
    from fa3_inductor.templates.hopper_bwd.configs import SMEM_LIMIT, get_bwd_config

    pre, main, convert = _plan(D, DV, config=get_bwd_config(D, DV))   # (192 / 128 noop's own pick: test_kv96_plan)
    kernel, args, kwargs, grid = main
    assert kernel is fa3_bwd_sm90_wide_kernel
    assert kwargs["TILE"] == WideTile(HEAD_D=tile_d, HEAD_DV=tile_dv, NUM_STAGES=stages,
                                      HEAD_D_IN=D if tile_d != D else 0, P_REGS=True, DQ_BUFS=dq_bufs,
                                      DQ_FRAG=True, OVERLAP=stages == 2,   # (192 / 128 without a mask: overlap)
                                      DKDV_TMA=tile_d == D)   # (dK / dV by TMA: the unpadded pairs)
    assert grid == (math.ceil(777 / 64), 2 * 2)            # 64-key CTAs, one per (K/V batch, K/V head)
    assert not kwargs["FLAGS"].EVEN_N
    # the passes: O's columns when they are not Q's, columns masked to D when D is no power of two
    assert pre[2].get("HEAD_DV") == (DV if DV != D else None)
    assert pre[2].get("HEAD_D_POW2") == (256 if D != 256 else None)
    assert "HEAD_D_POW2" not in convert[2]      # the fragment-order convert: whole 64-column blocks
    dk0, dk1, dv = args[11:14]   # the warpgroups' dK columns and their dV columns, 64 keys a box
    if tile_d == D:
        assert [list(d.block_shape) for d in (dk0, dk1, dv)] == [[1, 1, 64, 128], [1, 1, 64, D - 128],
                                                                  [1, 1, 64, DV // 2]]
    else:
        assert (dk0, dk1, dv) == (None, None, None)
    dq_acc = args[8]
    assert tuple(dq_acc.shape) == (2 * 4, 1024, D)             # rows padded to BLOCK_M 64
    cfg = get_bwd_config(D, DV)
    assert cfg.split_dkv and cfg.num_stages == stages and cfg.smem_bytes(tile_d, value_head_dim=tile_dv) <= SMEM_LIMIT


def test_narrow_plan_unchanged():
    """D = 64 / 128 keep bwd_sm90.py's kernel and its 128-key CTAs, and the passes get no wide parameters."""
    from fa3_inductor.templates.hopper_bwd.bwd_sm90 import fa3_bwd_sm90_kernel

    for D in (64, 128):
        pre, main, convert = _plan(D, D)
        assert main[0] is fa3_bwd_sm90_kernel and main[3] == (math.ceil(777 / 128), 4)
        assert "HEAD_DV" not in pre[2] and "HEAD_D_POW2" not in convert[2]


def test_unserved_pairs_are_refused():
    from fa3_inductor.templates.hopper_bwd import get_bwd_config

    for D, DV in ((192, 160), (96, 128), (256, 128), (128, 64), (112, 112)):
        with pytest.raises(ValueError, match="not served"):
            get_bwd_config(D, DV)
        with pytest.raises(ValueError, match="not served"):
            _plan(D, DV)


def test_wide_atomic_dq_is_refused():
    """The wide kernel adds dQ by TMA reduce-add only."""
    from fa3_inductor.templates.hopper_bwd import get_bwd_config

    with pytest.raises(ValueError, match="TMA reduce-add only"):
        _plan(256, 256, config=get_bwd_config(256, dq_tma=False))


@pytest.mark.parametrize("D, DV, mod, p_regs, dq_bufs", [(256, 256, None, True, 2), (256, 256, "softcap", True, 2),
                                                         (256, 256, "softcap", False, 1),
                                                         (192, 128, "softcap", False, 2)])
def test_wide_dq_staging_tiles(D, DV, mod, p_regs, dq_bufs):
    """Two dQ staging tiles a warpgroup where they fit beside a score_mod's f', which only the step without p_regs
    parks in shared memory (D256 softcap then needs 238 KB: one tile)."""
    from fa3_inductor.templates.hopper_bwd.configs import get_bwd_config

    options = {}
    if mod == "softcap":
        from test_hopper_bwd_compile import _options
        options = _options("softcap", 1000, 777)
    *_, main = _plan(D, DV, config=get_bwd_config(D, DV, dq_bufs=2, p_regs=p_regs, overlap=0), **options)[:2]
    assert main[2]["TILE"].DQ_BUFS == dq_bufs


def test_wide_dq_chunks():
    """dQ chunks a warpgroup: its 64-column chunks that start before the tensors' D (160: one of warpgroup 1's two
    lies wholly in the zero columns)."""
    from fa3_inductor.templates.hopper_bwd.bwd_sm90_wide import WideTile

    assert WideTile(HEAD_D=256, HEAD_DV=256, NUM_STAGES=1).DQ_CHUNKS == (2, 2)
    assert WideTile(HEAD_D=192, HEAD_DV=128, NUM_STAGES=2).DQ_CHUNKS == (1, 2)   # warpgroup 0: K's columns 128-191
    assert WideTile(HEAD_D=256, HEAD_DV=256, NUM_STAGES=1, HEAD_D_IN=160).DQ_CHUNKS == (2, 1)
    assert WideTile(HEAD_D=256, HEAD_DV=256, NUM_STAGES=1, HEAD_D_IN=192).DQ_CHUNKS == (2, 1)


@pytest.mark.parametrize("D, DV, frag", [(256, 256, True), (192, 128, True), (192, 192, True), (160, 160, False)])
def test_wide_dq_fragment_order_plan(D, DV, frag):
    """DQ_ACC in the fragments' order where D is a multiple of 64 (the [1, 16, 256] TMA box over DQ_ACC viewed as
    rows of 256 floats, and the convert pass that reads it so); 160 keeps the tiled staging and the plain convert."""
    from fa3_inductor.templates.hopper_bwd.bwd_sm90 import bwd_sm90_dq_convert_frag_kernel, bwd_sm90_dq_convert_kernel

    from fa3_inductor.templates.hopper_bwd.configs import get_bwd_config

    M = 1000
    pre, main, convert = _plan(D, DV, M=M, config=get_bwd_config(D, DV))
    assert main[2]["TILE"].DQ_FRAG == frag
    dq_desc = main[1][6]
    if frag:
        assert list(dq_desc.block_shape) == [1, 16, 256] and list(dq_desc.shape) == [2 * 4, 1024 * D // 256, 256]
        assert convert[0] is bwd_sm90_dq_convert_frag_kernel and convert[3] == (math.ceil(M / 64) * D // 64, 2 * 4)
    else:
        assert list(dq_desc.block_shape) == [1, 64, 64] and convert[0] is bwd_sm90_dq_convert_kernel


def _wide_curved():
    """The wide kernel's row for a curved score_mod at 192 / 128 (what it runs under block-mask tables; without them
    such launches take 96-key tiles, test_kv96_plan)."""
    from fa3_inductor.templates.hopper_bwd.configs import get_bwd_config

    return get_bwd_config(192, 128, curved=True, masked=True)


@pytest.mark.parametrize("mask", [None, "causal", "document"])
def test_kv96_plan(mask):
    """192 / 128 without a mask takes 96-key tiles with the late dQ (bwd_sm90_k96.py): softcap in the grid's order
    (configs.WIDE_KV96_LAG), no mod on persistent CTAs storing dK / dV by TMA (WIDE_PLAIN_KV96_PERSISTENT). Exactly
    causal without a score_mod: persistent 96-key CTAs storing dK / dV by TMA (WIDE_CAUSAL_KV96), with the late dQ from
    16k query rows (WIDE_CAUSAL_KV96_LAG_FROM). The wide kernel
    under a mask with a score_mod or under tables, and with ALiBi."""
    from test_hopper_bwd_compile import _combined_options, _options

    from fa3_inductor.templates.hopper_bwd.bwd_sm90_k96 import K96Tile, fa3_bwd_sm90_k96_kernel
    from fa3_inductor.templates.hopper_bwd.bwd_sm90_wide import fa3_bwd_sm90_wide_kernel

    M = N = 1000
    options = _combined_options("softcap" + (f"+{mask}" if mask == "causal" else ""), M, N)
    if mask == "document":
        options.update(_combined_options("blocks", M, N))
    pre, main, convert = _plan(192, 128, M=M, N=N, **options)
    kernel, args, kwargs, grid = main
    if mask is not None:   # (under the causal walk the late dQ spills in the step loop: the wide kernel)
        assert kernel is fa3_bwd_sm90_wide_kernel
        return
    assert kernel is fa3_bwd_sm90_k96_kernel
    assert kwargs["TILE"] == K96Tile(NUM_STAGES=2, CAUSAL=False, DQ_LAG=True) and kwargs["MASK_MOD"] is None
    assert grid == (math.ceil(N / 96), 2 * 2) and kwargs["maxnreg"] == 128
    assert (kwargs["FLAGS"].CONSUMER_REGS, kwargs["FLAGS"].EVEN_N) == (160, False)
    assert list(args[6].block_shape) == [1, 16, 256]   # dQ in the fragments' order
    noop = _plan(192, 128, M=M, N=N)[1]   # persistent CTAs, dK / dV by TMA (configs.WIDE_PLAIN_KV96_PERSISTENT)
    assert noop[2]["TILE"] == K96Tile(NUM_STAGES=2, DQ_LAG=True, PERSISTENT=True, DKDV_TMA=True)
    assert len(noop[3]) == 1 and sorted(noop[1][-1][1].tolist()) == list(range(math.ceil(N / 96) * 2 * 2))
    assert _plan(192, 128, M=M, N=N, **_options("alibi", M, N))[1][0] is fa3_bwd_sm90_wide_kernel
    kernel, args, kwargs, grid = _plan(192, 128, M=M, N=N, **_options("causal", M, N))[1]
    assert kernel is fa3_bwd_sm90_k96_kernel and kwargs["MASK_MOD"] is not None
    assert kwargs["TILE"] == K96Tile(NUM_STAGES=2, CAUSAL=True, PERSISTENT=True, DKDV_TMA=True)
    assert [list(d.block_shape) for d in args[10:13]] == [[1, 1, 32, 128], [1, 1, 32, 64], [1, 1, 32, 128]]
    # from 16k query rows on, the late dQ too (configs.WIDE_CAUSAL_KV96_LAG_FROM)
    long = _plan(192, 128, M=16384, N=16384, **_options("causal", 16384, 16384))[1]
    assert long[2]["TILE"] == K96Tile(NUM_STAGES=2, CAUSAL=True, DQ_LAG=True, PERSISTENT=True, DKDV_TMA=True)


def test_wide_overlap_for_plain_launches():
    """192 / 128 takes the cross-step overlap without a curved score_mod (noop, ALiBi, block masks), the in-order
    step with softcap, with or without a mask; D256 (one Q / dO stage) never."""
    from test_hopper_bwd_compile import _combined_options, _options

    from fa3_inductor.templates.hopper_bwd.configs import get_bwd_config

    assert _plan(192, 128, config=get_bwd_config(192, 128))[1][2]["TILE"].OVERLAP   # (the host's pick: test_kv96_plan)
    wide_causal = get_bwd_config(192, 128, masked=True, causal=True)   # (the host's pick: test_kv96_plan)
    assert _plan(192, 128, M=1000, N=1000, **_options("causal", 1000, 1000), config=wide_causal)[1][2]["TILE"].OVERLAP
    assert not _plan(192, 128, **_options("softcap", 1000, 777), config=_wide_curved())[1][2]["TILE"].OVERLAP
    assert not _plan(192, 128, M=1000, N=1000, **_combined_options("softcap+causal", 1000, 1000),
                     config=_wide_curved())[1][2]["TILE"].OVERLAP
    assert _plan(192, 128, **_options("alibi", 1000, 777))[1][2]["TILE"].OVERLAP
    assert not _plan(256, 256)[1][2]["TILE"].OVERLAP
    assert not _plan(256, 256, M=1000, N=1000, **_options("causal", 1000, 1000))[1][2]["TILE"].OVERLAP


def test_wide_causal_trim_follows_the_mask_mod():
    """The wide kernel walks an exactly causal mask_mod's tiles without the tables (with a score_mod too: the mask alone
    decides which scores count), and skips a first listed tile wholly above the CTA's keys under another mask_mod that
    keeps q >= kv pairs only (causal windows, causal documents); neither in D <= 128's kernel, nor under a mask that
    keeps q < kv pairs."""
    from test_hopper_bwd_compile import _combined_options, _options

    from fa3_inductor.templates.hopper_bwd.configs import get_bwd_config

    def trim(D, DV, options, **extra):
        sparse = _plan(D, DV, M=1000, N=1000, **options, **extra)[1][2]["SPARSE"]
        return sparse.CAUSAL_WALK, sparse.CAUSAL_SKIP, sparse.HAS_BLOCK_MASK

    for D, DV in ((192, 128), (256, 256)):
        causal = {"config": get_bwd_config(D, DV, masked=True, causal=True)}   # (192 / 128's pick: test_kv96_plan)
        assert trim(D, DV, _options("causal", 1000, 1000), **causal) == (True, False, False)
        softcap_causal = _combined_options("softcap+causal", 1000, 1000)
        wide = {"config": _wide_curved()} if D == 192 else {}   # (without: 96-key tiles, test_kv96_plan)
        assert trim(D, DV, softcap_causal, **wide) == (True, False, False)
        for implied in ("sliding_window", "document"):   # causal windows and causal documents (the tests' mods)
            assert trim(D, DV, _options(implied, 1000, 1000)) == (False, True, True), implied
    assert trim(128, 128, _options("causal", 1000, 1000)) == (False, False, True)


@pytest.mark.parametrize("mask", [None, "causal", "document"])
def test_wide_persistent_plan(mask):
    """persistent at the wide pairs: min(#SMs, #tiles) CTAs walking lists that hold every (KV tile, K/V head) tile
    once; without tables (no mask, the causal walk) the lists follow from the shapes, longest tiles first (a causal
    walk's KV tile 0); under a document mask from the tables as bwd_sm90's."""
    from test_hopper_bwd_compile import _options

    from fa3_inductor.templates.hopper_bwd.configs import get_bwd_config

    M = N = 1000
    options = _options(mask, M, N) if mask else {}
    cfg = get_bwd_config(192, 128, masked=mask is not None, persistent=True, persistent_ctas=5)
    kernel, args, kwargs, grid = _plan(192, 128, M=M, N=N, config=cfg, **options)[1]
    offsets, tiles = args[-2]
    n_tiles = math.ceil(N / 64) * 2 * 2
    assert kwargs["TILE"].PERSISTENT and grid == (5,)
    assert offsets.tolist()[0] == 0 and offsets.tolist()[-1] == n_tiles
    assert sorted(tiles.tolist()) == list(range(n_tiles))
    if mask == "causal":
        # each head's KV tile 0 (16 steps) first, then tile 1 (15)
        assert kwargs["SPARSE"].CAUSAL_WALK and tiles[offsets[:-1].long()].remainder(16).tolist() == [0] * 4 + [1]
    plain = _plan(192, 128, M=M, N=N, config=get_bwd_config(192, 128, masked=mask is not None), **options)[1]
    assert not plain[2]["TILE"].PERSISTENT and plain[1][-2] == () and plain[3] == (16, 4)


def test_wide_causal_default_is_persistent():
    """The tables' rules (configs.WIDE_CAUSAL_PERSISTENT, WIDE_CAUSAL_KV96, WIDE_PLAIN_KV96_PERSISTENT): an exactly
    causal launch at 192 / 128 takes persistent CTAs by default (96-key ones without a score_mod), and so does no mask
    (96-key); at 256 the grid; other masks keep the grid at both pairs."""
    from test_hopper_bwd_compile import _options

    M = N = 1000
    for pair, mask, persistent in (((192, 128), "causal", True), ((256, 256), "causal", False),
                                   ((192, 128), "document", False), ((192, 128), None, True),
                                   ((256, 256), None, False)):
        options = _options(mask, M, N) if mask else {}
        main = _plan(*pair, M=M, N=N, **options)[1]
        assert main[2]["TILE"].PERSISTENT == persistent, (pair, mask)
        assert (len(main[3]) == 1) == persistent
