"""The sm90 backward's deterministic dQ (bwd_sm90.py, "Deterministic dQ") on the CPU: the host's plan, the order table
(bwd_sm90_dq_rank_kernel, Triton's interpreter) against a brute-force count, and the preprocess pass zeroing the
counters. The kernel itself runs in tests/test_hopper_bwd_gpu.py (bit-for-bit repeats, float64 gradients); its sm90
build in tests/test_hopper_bwd_compile.py.
"""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from fa3_inductor import mods
from fa3_inductor.templates.family import BackwardSiteFacts


def _random_block_mask(SZ, SH, M, N, seed):
    """A BlockMask with partial and full blocks in a random pattern (each block: empty, partial or full)."""
    g = torch.Generator().manual_seed(seed)
    kinds = torch.randint(0, 3, (SZ, SH, -(-M // 128), -(-N // 128)), generator=g)

    def mask(b, h, q_idx, kv_idx):
        kind = kinds[b, h, q_idx // 128, kv_idx // 128]
        return (kind == 2) | ((kind == 1) & ((q_idx + kv_idx) % 3 == 0))

    return create_block_mask(mask, SZ, SH, M, N, device="cpu")


def _brute_rank(bm):
    """rank[sz, sh, qb, kvb]: how many KV blocks before kvb the forward's tables list for query block qb."""
    SZ, SH, NQB = bm.kv_num_blocks.shape
    NKVB = -(-bm.seq_lengths[1] // bm.BLOCK_SIZE[1])
    listed = torch.zeros(SZ, SH, NQB, NKVB, dtype=torch.int64)
    for nums, idx in ((bm.kv_num_blocks, bm.kv_indices), (bm.full_kv_num_blocks, bm.full_kv_indices)):
        if nums is None:
            continue
        for z in range(SZ):
            for h in range(SH):
                for qb in range(NQB):
                    for j in range(int(nums[z, h, qb])):
                        listed[z, h, qb, int(idx[z, h, qb, j])] += 1
    return listed.cumsum(-1) - listed


@pytest.mark.parametrize("case", ["document", "window", "random", "random-heads"])
def test_rank_table_counts_the_listed_blocks_before(cpu_kernels, case):
    """The two order launches (Triton's interpreter), from the transposed tables the main kernel walks, against a
    count over the forward's tables: for each (query block, KV block), the KV blocks before it that list the query
    block. DQ_RANK starts as garbage (the first launch zeroes its columns)."""
    from fa3_inductor.templates.hopper_bwd.host import _order_launches

    M = N = 1300
    if case == "document":
        bm = create_block_mask(mods.document((torch.arange(N) // 300).to(torch.int32)), None, None, M, N, device="cpu")
    elif case == "window":
        bm = create_block_mask(mods.sliding_window(256), None, None, M, N, device="cpu")
    else:
        bm = _random_block_mask(2 if case == "random-heads" else 1, 3 if case == "random-heads" else 1, M, N, seed=7)
    want = _brute_rank(bm)
    ranks = torch.full(tuple(want.shape), -5, dtype=torch.int32)
    for kernel, args, kwargs, grid in _order_launches(bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks,
                                                      bm.full_q_indices, ranks, bm.full_q_num_blocks is not None):
        kernel[grid](*args, **kwargs)
    assert torch.equal(ranks.long(), want)


def test_preprocess_zeroes_every_counter_but_the_sink(cpu_kernels):
    from fa3_inductor.templates.hopper_bwd.host import _pass_launches, hopper_backward_scratch

    Z, HQ, M, D = 2, 3, 200, 64
    out, dout = torch.randn(Z, HQ, M, D), torch.randn(Z, HQ, M, D)
    lse = torch.randn(Z, HQ, M)
    stats, dq_acc, sems, ranks = hopper_backward_scratch(out, has_mask=False, deterministic=True)
    assert ranks.numel() == 1 and sems.numel() == 1 + Z * HQ * (stats.shape[-1] // 64) * 4
    sems.fill_(99)
    pre, _ = _pass_launches(out, dout, lse, None, stats, dq_acc, torch.empty_like(out), stats.shape[-1], 1.0, True, D,
                            sems)
    kernel, args, kwargs, grid = pre
    kernel[grid](*args, **kwargs)
    assert sems[0] == 99 and (sems[1:] == 0).all()


def _plan(D, deterministic=True, mask=None, **extra):
    from fa3_inductor.templates.hopper_bwd import prepare_hopper_backward

    M = N = 512
    q, k, v = (torch.randn(1, 4, M, D, dtype=torch.bfloat16) for _ in range(3))
    opts = {}
    if mask is not None:
        bm = create_block_mask(mask, None, None, M, N, device="cpu")
        opts = dict(kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices, full_kv_num_blocks=bm.full_kv_num_blocks,
                    full_kv_indices=bm.full_kv_indices, q_num_blocks=bm.q_num_blocks, q_indices=bm.q_indices,
                    full_q_num_blocks=bm.full_q_num_blocks, full_q_indices=bm.full_q_indices)
    return prepare_hopper_backward(q, k, v, q, q, torch.zeros(1, 4, M), torch.empty_like(q), torch.empty_like(k),
                                   torch.empty_like(v), sm_scale=D ** -0.5, deterministic=deterministic, **opts,
                                   **extra)


@pytest.mark.parametrize("D", [64, 80, 96, 128])
def test_plan_orders_the_adds(D):
    """Deterministic launches: the KV-tile-major grid (no host-made CTA order or persistent lists, even under a block
    mask, whose defaults take them), the counters and the order table as the main kernel's CTA arguments, and the
    order table's launch before the main kernel under a block mask."""
    plain = _plan(D)
    masked = _plan(D, mask=mods.causal)
    assert [launch[0].__name__ for launch in plain] == [
        "bwd_sm90_preprocess_kernel", "fa3_bwd_sm90_kernel", "bwd_sm90_dq_convert_frag_kernel"
        if D % 64 == 0 else "bwd_sm90_dq_convert_kernel"]
    assert [launch[0].__name__ for launch in masked][:4] == [
        "bwd_sm90_preprocess_kernel", "bwd_sm90_dq_listed_kernel", "bwd_sm90_dq_rank_kernel", "fa3_bwd_sm90_kernel"]
    for launches in (plain, masked):
        main = next(launch for launch in launches if launch[0].__name__ == "fa3_bwd_sm90_kernel")
        sched = main[2]["SCHED"]
        assert sched.DETERMINISTIC and not sched.PERSISTENT and not sched.LPT_ORDER and sched.DQ_TMA
        assert main[3] == (512 // 128, 4)
        sems, ranks, group = main[1][-2]
        pre = launches[0]
        assert pre[2]["DQ_SEMS"] is sems and sems.dtype == torch.int32
        assert group == 4   # 4 heads: one launch-order group (masked: every head; unmasked: up to 8 query heads)
    assert not _plan(64, deterministic=False, mask=mods.causal)[1][2]["SCHED"].DETERMINISTIC


@pytest.mark.parametrize("dims", [(256, 256), (192, 128)])
def test_wide_plan_orders_the_adds_on_the_grid(dims):
    """The wide head dims: bwd_sm90_wide.py on the grid (no 96-key tiles or persistent CTAs, whose defaults 192 / 128
    takes), its tile DETERMINISTIC, the causal skip off (a CTA must add where the tables list it)."""
    from fa3_inductor.templates.hopper_bwd import prepare_hopper_backward

    D, DV = dims
    M = N = 512
    q, k = (torch.randn(1, 4, M, D, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, 4, N, DV, dtype=torch.bfloat16)
    for mask in (None, mods.sliding_window(200)):
        opts = {}
        if mask is not None:
            bm = create_block_mask(mask, None, None, M, N, device="cpu")
            opts = dict(kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices,
                        full_kv_num_blocks=bm.full_kv_num_blocks, full_kv_indices=bm.full_kv_indices,
                        q_num_blocks=bm.q_num_blocks, q_indices=bm.q_indices, full_q_num_blocks=bm.full_q_num_blocks,
                        full_q_indices=bm.full_q_indices)
        o = torch.empty(1, 4, M, DV, dtype=torch.bfloat16)
        launches = prepare_hopper_backward(q, k, v, o, o, torch.zeros(1, 4, M), torch.empty_like(q),
                                           torch.empty_like(k), torch.empty_like(v), sm_scale=D ** -0.5,
                                           deterministic=True, **opts)
        main = next(launch for launch in launches if launch[0].__name__ == "fa3_bwd_sm90_wide_kernel")
        assert main[2]["TILE"].DETERMINISTIC and not main[2]["TILE"].PERSISTENT
        assert not main[2]["SPARSE"].CAUSAL_SKIP
        assert main[3] == (512 // 64, 4)


def test_family_serves_deterministic_sites_at_every_head_dim(monkeypatch):
    from fa3_inductor.templates.hopper_bwd.family import HOPPER_BWD

    monkeypatch.setattr(BackwardSiteFacts, "capability", property(lambda self: (9, 0)))   # an sm90 site, no GPU here

    def site(d, dv=None):
        return BackwardSiteFacts(torch.device("cuda"), torch.bfloat16, d, dv or d, deterministic=True)

    assert all(HOPPER_BWD.serves_backward(site(d, dv)) is None for d, dv in (
        (64, 64), (80, 80), (96, 96), (128, 128), (160, 160), (192, 192), (256, 256), (192, 128)))


def test_scratch_checks_the_counters():
    from fa3_inductor.templates.hopper_bwd import prepare_hopper_backward
    from fa3_inductor.templates.hopper_bwd.host import hopper_backward_scratch

    q = torch.randn(1, 2, 256, 64, dtype=torch.bfloat16)
    two = hopper_backward_scratch(q, has_mask=False)
    with pytest.raises(ValueError, match="expected 4"):
        prepare_hopper_backward(q, q, q, q, q, torch.zeros(1, 2, 256), torch.empty_like(q), torch.empty_like(q),
                                torch.empty_like(q), sm_scale=0.125, deterministic=True, scratch=two)


@pytest.mark.parametrize("tables", ["forward", "transposed"])
def test_family_scratch_fits_the_plan(tables):
    """The scratch the family allocates for a deterministic call (HopperBackwardFamily.backward_scratch: the mask's
    shape from whichever tables the call has) is what prepare_hopper_backward checks it against, and the order
    launches write it."""
    from fa3_inductor.templates.hopper_bwd import prepare_hopper_backward
    from fa3_inductor.templates.hopper_bwd.host import hopper_backward_scratch, mask_shape_of

    M, N = 700, 900
    q = torch.randn(2, 4, M, 64, dtype=torch.bfloat16)
    k = v = torch.randn(2, 2, N, 64, dtype=torch.bfloat16)
    bm = create_block_mask(mods.sliding_window(300), None, None, M, N, device="cpu")
    fwd = (bm.kv_num_blocks, bm.kv_indices) if tables == "forward" else (None, None)
    shape = mask_shape_of(*fwd, *((None, None) if tables == "forward" else (bm.q_num_blocks, bm.q_indices)))
    assert shape == (1, 1, -(-M // 128), -(-N // 128))
    scratch = hopper_backward_scratch(q, has_mask=True, deterministic=True, mask_shape=shape)
    launches = prepare_hopper_backward(
        q, k, v, q, q, torch.zeros(2, 4, M), torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
        sm_scale=0.125, deterministic=True, scratch=scratch, kv_num_blocks=fwd[0], kv_indices=fwd[1],
        q_num_blocks=bm.q_num_blocks, q_indices=bm.q_indices, full_q_num_blocks=bm.full_q_num_blocks,
        full_q_indices=bm.full_q_indices)
    rank = next(launch for launch in launches if launch[0].__name__ == "bwd_sm90_dq_rank_kernel")
    assert rank[1][0] is scratch[3]
