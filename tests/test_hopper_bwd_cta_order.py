"""CPU: the longest-first CTA order of the sm90 backward (templates/hopper_bwd/host._cta_order, configs.VARIANTS
"lpt_order") is a permutation of the grid, keeps heads in groups, and runs each group's CTAs by decreasing work."""
from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import create_block_mask

from fa3_inductor import mods
from fa3_inductor.templates.hopper_bwd.host import LPT_GROUP_CTAS, _cta_order


def _steps(bm, kvh_count):
    per_kv = (bm.q_num_blocks + bm.full_q_num_blocks)[0, 0]
    return per_kv.repeat(kvh_count)


def test_document_order_is_longest_first_by_head_group():
    N = 4096
    bm = create_block_mask(mods.document((torch.arange(N) // 1024).to(torch.int32)), None, None, N, N, device="cpu")
    order = _cta_order(bm.q_num_blocks, bm.full_q_num_blocks, 4, 4, 16, 16, 32, 128, 128)
    assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(2048))
    steps = _steps(bm, 64)[order.long()]
    group = LPT_GROUP_CTAS   # 8 heads of 32 KV tiles
    for g in range(0, 2048, group):
        chunk = order[g:g + group].long()
        assert (chunk // (32 * 8)).unique().numel() == 1, "a group mixes heads of other groups"
        assert (steps[g:g + group].diff() <= 0).all(), "not longest first inside a group"
    assert steps[0] == 8 and steps[group - 1] == 1


def test_gqa_and_kv_batch_sum_the_query_heads():
    # causal over 3 KV blocks, a K/V batch of 1 read by 2 query batches, 2 query heads per K/V head: every CTA of a
    # K/V head walks the same tiles, so the order is the grid's inside a group
    qnb = torch.tensor([[[1, 1, 1]]])
    fqnb = torch.tensor([[[2, 1, 0]]])
    order = _cta_order(qnb, fqnb, Z=2, KZ=1, HQ=4, HKV=2, n_kv_tiles=3, block_n=128, sparse_kv=128)
    assert order.tolist() == [0, 3, 1, 4, 2, 5]
    # a head-dependent mask: head 1's first KV block is empty, so it runs last
    qnb = torch.tensor([[[1, 1], [0, 1]]])
    order = _cta_order(qnb, None, Z=1, KZ=1, HQ=2, HKV=2, n_kv_tiles=2, block_n=128, sparse_kv=128)
    assert order.tolist() == [0, 1, 3, 2]


def test_sparse_kv_block_wider_than_the_tile():
    # a 256-key block-mask block covers two 128-key CTAs, which share its count
    qnb = torch.tensor([[[1, 3]]])
    order = _cta_order(qnb, None, Z=1, KZ=1, HQ=1, HKV=1, n_kv_tiles=4, block_n=128, sparse_kv=256)
    assert order.tolist() == [2, 3, 0, 1]


def _plan(schedule, mask_mod=None, Z=2, HQ=4, HKV=2, M=1000, N=1000, D=128, **overrides):
    """The main launch prepare_hopper_backward plans under a configs.VARIANTS schedule (CPU tensors, no compile)."""
    from fa3_inductor.templates.hopper_bwd import get_bwd_config, prepare_hopper_backward
    from fa3_inductor.templates.hopper_bwd.configs import VARIANTS

    q = torch.randn(Z, HQ, M, D, dtype=torch.bfloat16)
    k = v = torch.randn(Z, HKV, N, D, dtype=torch.bfloat16)
    options = {}
    if mask_mod is not None:
        bm = create_block_mask(mask_mod, None, None, M, N, device="cpu")
        options = dict(kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices,
                       full_kv_num_blocks=bm.full_kv_num_blocks, full_kv_indices=bm.full_kv_indices)
    launches = prepare_hopper_backward(q, k, v, torch.empty_like(q), torch.empty_like(q), torch.empty(Z, HQ, M),
                                       torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                                       sm_scale=D ** -0.5, config=get_bwd_config(D, **VARIANTS[schedule], **overrides),
                                       **options)
    return launches[1]


def test_plans_of_the_mask_schedules():
    from fa3_inductor.templates.hopper_bwd.host import PERSISTENT_TILE_COST

    window = mods.sliding_window(256)
    _, args, kwargs, grid = _plan("default", window)   # (the main kernel's last two arguments: cta_args, pack_args)
    assert grid == (8, 4) and args[-2] == () and args[-1] == ()
    assert not kwargs["SCHED"].LPT_ORDER and not kwargs["SCHED"].PERSISTENT
    # longest first: the grid stays, the order travels as one int32 tensor
    _, args, kwargs, grid = _plan("lpt_order", window)
    assert grid == (8, 4) and kwargs["SCHED"].LPT_ORDER and not kwargs["SCHED"].PERSISTENT
    (order,) = args[-2]
    assert sorted(order.tolist()) == list(range(32))
    # persistent: min(SMs, tiles) CTAs (132 for CPU tensors: 32 tiles here), each tile once
    _, args, kwargs, grid = _plan("persistent", window)
    assert kwargs["SCHED"].PERSISTENT and not kwargs["SCHED"].LPT_ORDER
    offsets, tiles = args[-2]
    assert grid == (32,) and offsets.tolist() == list(range(33)) and sorted(tiles.tolist()) == list(range(32))
    # two K / V buffers where shared memory allows: D64 (176 KB), not D128 (272 KB)
    assert kwargs["SCHED"].KV_BUFS == 1 and _plan("persistent", window, D=64)[2]["SCHED"].KV_BUFS == 2
    assert PERSISTENT_TILE_COST > 0
    # a few CTAs (the GPU tests): each walks several tiles
    _, args, kwargs, grid = _plan("persistent", window, persistent_ctas=3)
    offsets, tiles = args[-2]
    assert grid == (3,) and offsets[0] == 0 and offsets[-1] == 32 and (offsets.diff() >= 10).all()
    # the step under either schedule: the head dim's (D128: the overlap under dK, D64: in order), or as asked
    assert kwargs["SCHED"].OVERLAP == 2 and _plan("lpt_order", window)[2]["SCHED"].OVERLAP == 2
    assert _plan("persistent", window, D=64)[2]["SCHED"].OVERLAP == 0
    for schedule in ("lpt_order_serial", "persistent_serial"):
        sched = _plan(schedule, window)[2]["SCHED"]
        assert sched.OVERLAP == 0 and (sched.LPT_ORDER or sched.PERSISTENT)
    assert _plan("persistent", window, overlap=1)[2]["SCHED"].OVERLAP == 1
    # no block mask: both schedules are the default launch
    for schedule in ("lpt_order", "persistent"):
        _, args, kwargs, grid = _plan(schedule)
        assert grid == (8, 4) and args[-2] == () and kwargs["SCHED"] == _plan("default")[2]["SCHED"]


def test_persistent_schedule_balances_documents():
    from fa3_inductor.templates.hopper_bwd.host import _persistent_schedule

    N = 4096
    bm = create_block_mask(mods.document((torch.arange(N) // 1024).to(torch.int32)), None, None, N, N, device="cpu")
    offsets, tiles = _persistent_schedule(bm.q_num_blocks, bm.full_q_num_blocks, 4, 4, 16, 16, 32, 128, 128, 132)
    assert offsets.numel() == 133 and sorted(tiles.tolist()) == list(range(2048))
    steps = _steps(bm, 64)
    per_cta = [int(steps[tiles[a:b].long()].sum()) + (b - a) for a, b in zip(offsets[:-1].tolist(),
                                                                               offsets[1:].tolist())]
    # 9216 query blocks + 2048 tiles over 132 CTAs: 85.3 each; the list schedule ends within one longest tile
    assert max(per_cta) - min(per_cta) <= 9, (min(per_cta), max(per_cta))



def _host_plan(variant, D):
    """The main launch prepare_hopper_backward plans with no config given (the host's own pick), CPU tensors;
    ``variant``: test_hopper_bwd_compile's mods ("causal+alibi" combines them)."""
    from test_hopper_bwd_compile import _combined_options

    from fa3_inductor.templates.hopper_bwd import prepare_hopper_backward

    Z, HQ, M = 1, 4, 640
    q = torch.randn(Z, HQ, M, D, dtype=torch.bfloat16)
    k = v = torch.randn(Z, HQ, M, D, dtype=torch.bfloat16)
    return prepare_hopper_backward(q, k, v, torch.empty_like(q), torch.empty_like(q), torch.empty(Z, HQ, M),
                                   torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), sm_scale=D ** -0.5,
                                   **_combined_options(variant, M, M))[1]


def test_host_picks_the_schedule_by_what_the_launch_has():
    """configs.get_bwd_config's rows as the host applies them: block masks take the persistent schedule at D64 and
    D128 (and D96, in D128's tiles); the rest keep the table's: 64 query rows a step, ALiBi included (m128 took
    ALiBi until the 64-row step held P in registers)."""
    from fa3_inductor.templates.hopper_bwd.bwd_sm90 import fa3_bwd_sm90_kernel

    for D in (64, 96, 128):
        for variant in ("causal", "document", "causal+alibi", "causal+softcap", "blocks"):
            kernel, args, kwargs, grid = _host_plan(variant, D)
            assert kernel is fa3_bwd_sm90_kernel and kwargs["SCHED"].PERSISTENT, (D, variant)
            offsets, tiles = args[-2]
            assert grid == (offsets.numel() - 1,) and sorted(tiles.tolist()) == list(range(4 * 5)), (D, variant)
        for variant in ("noop", "softcap"):
            kernel, args, kwargs, grid = _host_plan(variant, D)
            assert kernel is fa3_bwd_sm90_kernel and not kwargs["SCHED"].PERSISTENT and grid == (5, 4), (D, variant)
    kernel, _, kwargs, grid = _host_plan("alibi", 64)
    assert kernel is fa3_bwd_sm90_kernel and grid == (5, 4) and kwargs["SCHED"].P_REGS and kwargs["TILE"].BLOCK_M == 64
    kernel, _, kwargs, _ = _host_plan("alibi", 128)
    assert kernel is fa3_bwd_sm90_kernel and kwargs["SCHED"].OVERLAP == 2 and kwargs["SCHED"].P_REGS
    # D128's softcap without a mask_mod keeps the wider overlap; with one, the table's
    assert _host_plan("softcap", 128)[2]["SCHED"].OVERLAP == 1
    assert _host_plan("causal+softcap", 128)[2]["SCHED"].OVERLAP == 2


def test_scratch_fits_every_config_of_a_call():
    """The scratch (made before the host picks a config) is padded for the 128-row step too."""
    from fa3_inductor.templates.hopper_bwd.host import hopper_backward_scratch

    stats, dq_acc = hopper_backward_scratch(torch.empty(1, 2, 200, 64), has_mask=False)
    assert stats.shape == (2, 2, 256) and dq_acc.shape == (2, 256, 64)
    stats, _ = hopper_backward_scratch(torch.empty(1, 2, 200, 64), has_mask=True, sparse_q_block=128)
    assert stats.shape == (2, 2, 256)
