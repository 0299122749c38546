"""The sm90 backward (templates/hopper_bwd/) on an H100 / H200: dq, dk, dv against float64 autograd.

Skipped without a CUDA sm90 device. The forward's out and LSE come from the float64 reference (out rounded to the
input dtype, LSE in log2 units, as our forward writes them); one test takes them from our Hopper forward. The
tolerance is the README's rule (tests/reference.py).
"""
from __future__ import annotations

import math

import pytest
import torch

from fa3_inductor import mods
from reference import assert_matches_reference, reference_attention, reference_gradients

pytestmark = pytest.mark.gpu

LN2 = math.log(2.0)


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(autouse=True)
def _needs_sm90():
    if not _sm90():
        pytest.skip("needs a CUDA device of capability (9, 0) (H100 / H200)")


def _gl_mod(fn, kind):
    """(loaded gl mod, captured buffers, traced graph) of a Python mod."""
    from fa3_inductor.templates.modgen import BufferSpec, generate_mod_source, load_mod, trace_mod

    gm, bufs = trace_mod(fn, kind)
    return (load_mod(generate_mod_source(gm, kind, [BufferSpec.of(b) for b in bufs], "gl"), "gl"),
            tuple(b.cuda() for b in bufs), gm, bufs)


def _score_options(score_mod):
    from torch._higher_order_ops.flex_attention import create_fw_bw_graph

    from fa3_inductor.templates.generic_bwd import SCORE_GRAD_ONE
    from fa3_inductor.templates.hopper_bwd import score_grad_gl
    from fa3_inductor.templates.modgen import BufferSpec, load_mod

    if score_mod is None:
        return {}
    fn, bufs, gm, cpu_bufs = _gl_mod(score_mod, "score")
    index_values = (torch.zeros((), requires_grad=True), *(torch.zeros((), dtype=torch.int32) for _ in range(4)))
    joint = create_fw_bw_graph(gm, index_values, tuple(cpu_bufs))[1]
    src = score_grad_gl(joint, [BufferSpec.of(b) for b in cpu_bufs])
    return dict(score_mod=fn, score_bufs=bufs,
                score_grad_mod=SCORE_GRAD_ONE if src is None else load_mod(src, "gl"))


def _mask_options(mask_mod, M, N, heads=None):
    """Block-mask options of a mask_mod; ``heads``: the query heads of a head-dependent mask (else broadcast)."""
    from torch.nn.attention.flex_attention import create_block_mask

    if mask_mod is None:
        return {}
    bm = create_block_mask(mask_mod, None, heads, M, N, device="cuda")
    fn, bufs, _, _ = _gl_mod(mask_mod, "mask")
    return dict(mask_mod=fn, mask_bufs=bufs, kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices,
                full_kv_num_blocks=bm.full_kv_num_blocks, full_kv_indices=bm.full_kv_indices,
                q_num_blocks=bm.q_num_blocks, q_indices=bm.q_indices, full_q_num_blocks=bm.full_q_num_blocks,
                full_q_indices=bm.full_q_indices, sparse_q_block=bm.BLOCK_SIZE[0], sparse_kv_block=bm.BLOCK_SIZE[1])


def _inputs(Z, HQ, HKV, M, N, D, KZ=None, dtype=torch.bfloat16, DV=None):
    KZ, DV = KZ or Z, DV or D
    return (torch.randn(Z, HQ, M, D, device="cuda", dtype=dtype), torch.randn(KZ, HKV, N, D, device="cuda", dtype=dtype),
            torch.randn(KZ, HKV, N, DV, device="cuda", dtype=dtype), torch.randn(Z, HQ, M, DV, device="cuda", dtype=dtype))


def _run(q, k, v, out, dout, lse2, **options):
    from fa3_inductor.templates.hopper_bwd import launch_hopper_backward

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    launch_hopper_backward(q, k, v, out, dout, lse2, dq, dk, dv, **options)
    return dq, dk, dv


def _check(q, k, v, dout, score_mod=None, mask_mod=None, grad_lse=None, config=None, mask_heads=None,
           deterministic=False):
    """Our gradients against float64; ``deterministic``: with dQ's adds ordered, and the same bits on three runs."""
    Z, HQ, M, D = q.shape
    N = k.shape[2]
    scale = D ** -0.5
    kk, vv = (k.expand(Z, *k.shape[1:]), v.expand(Z, *v.shape[1:])) if k.shape[0] != Z else (k, v)
    out, dq, dk, dv, _ = reference_gradients(q, kk, vv, dout, score_mod, mask_mod, scale)
    _, lse = reference_attention(q, kk, vv, score_mod, mask_mod, scale)
    if grad_lse is not None:   # sum LSE2 * dLSE2 added to the loss (backward_cpu's convention)
        leaves = [t.detach().double().requires_grad_() for t in (q, kk, vv)]
        o64, lse64 = reference_attention(*leaves, score_mod, mask_mod, scale)
        loss = (o64 * dout.double()).sum() + (lse64 / LN2 * grad_lse.double()).sum()
        dq, dk, dv = torch.autograd.grad(loss, leaves)
    if k.shape[0] != Z:
        dk, dv = dk.sum(0, keepdim=True), dv.sum(0, keepdim=True)
    options = dict(sm_scale=scale, grad_lse=grad_lse, config=config, **_score_options(score_mod),
                   **_mask_options(mask_mod, M, N, mask_heads), **({"deterministic": True} if deterministic else {}))
    runs = [_run(q, k, v, torch.nan_to_num(out).to(q.dtype), dout, (lse / LN2).float(), **options)
            for _ in range(3 if deterministic else 1)]
    for name, g, want in zip(("dq", "dk", "dv"), runs[0], (dq, dk, dv)):
        assert torch.isfinite(g).all(), f"{name}: not finite"
        assert_matches_reference(g, want, q.dtype, name)
    for other in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], other):
            assert torch.equal(a, b), f"{name} differs between two deterministic runs"


def _document(n):
    return mods.document((torch.arange(n, device="cuda") // 300).to(torch.int32))


# (id, score_mod, mask_mod, Z, HQ, HKV, M, N, KZ): ragged lengths, M != N, GQA 4:1, a K/V batch of 1,
# block-sparse masks with partial and full blocks.
CASES = [
    ("noop-ragged", None, None, 1, 2, 2, 1000, 777, None),
    ("noop-even", None, None, 2, 2, 2, 512, 1024, None),
    ("causal", None, mods.causal, 1, 2, 2, 1000, 1000, None),
    ("softcap", mods.softcap(20.0), None, 1, 2, 2, 640, 700, None),
    ("alibi-causal", mods.alibi(4), mods.causal, 1, 4, 4, 384, 384, None),
    ("document", None, "document", 1, 2, 2, 900, 900, None),
    ("window", None, mods.sliding_window(200), 1, 2, 2, 900, 900, None),   # a causal window (the wide kernel's skip)
    ("gqa4-causal", None, mods.causal, 1, 8, 2, 512, 512, None),
    ("kv-batch-1", None, None, 3, 4, 2, 256, 300, 1),
]


# (q/k, v) head dims: bwd_sm90.py's 64 and 128 (80 and 96 in its 128 tiles, zero-filled past D), bwd_sm90_wide.py's
# 256 and 192 / 128 (dK, dV split by columns; 160 and 192 in the 256 tiles)
HEAD_DIMS = [(64, 64), (128, 128), (80, 80), (96, 96), (256, 256), (192, 128), (192, 192), (160, 160)]
WIDE_HEAD_DIMS = [(256, 256), (192, 128)]


def _dims_id(dims):
    return f"D{dims[0]}" if dims[0] == dims[1] else f"D{dims[0]}-{dims[1]}"


@pytest.mark.parametrize("dims", HEAD_DIMS, ids=_dims_id)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gradients_match_float64(case, dims):
    _, score_mod, mask_mod, Z, HQ, HKV, M, N, KZ = case
    if mask_mod == "document":
        mask_mod = _document(M)
    torch.manual_seed(0)
    q, k, v, dout = _inputs(Z, HQ, HKV, M, N, dims[0], KZ, DV=dims[1])
    _check(q, k, v, dout, score_mod, mask_mod)


# The schedules of configs.VARIANTS but the default (atomic_dq; overlap / overlap_dk, the cross-step overlap): ragged
# noop, causal, softcap, GQA 4:1 with a K/V batch of 1 (the dQ of two query batches and four heads lands in one
# accumulator row set; for the overlap, a CTA walks several query heads, each with its own prologue and last step).
VARIANT_CASES = [
    ("noop-ragged", None, None, 1, 2, 2, 1000, 777, None),
    ("causal", None, mods.causal, 1, 2, 2, 1000, 1000, None),
    ("softcap", mods.softcap(20.0), None, 1, 2, 2, 640, 700, None),
    ("gqa4-kv-batch-1", None, mods.causal, 2, 8, 2, 384, 384, 1),
    ("gqa4-noop", None, None, 2, 8, 2, 384, 320, None),   # several heads a CTA without a mod (D128 p_regs' carry)
]


# Variants that exist at one head dim only: name -> (head dim, why not the other)
ONE_HEAD_DIM = {
    "stages3": (64, "a third Q / dO stage fits D64's shared memory only (240 KB at D128)"),
    "m128": (64, "128 query rows a step is built for D64 only (bwd_sm90_m128.py)"),
}


@pytest.mark.parametrize("variant", ["atomic_dq", "overlap", "overlap_dk", "stages3", "m128", "p_smem", "dq_tiled",
                                     "dkdv_tma"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", VARIANT_CASES, ids=[c[0] for c in VARIANT_CASES])
def test_schedule_variants_match_float64(case, D, variant):
    from fa3_inductor.templates.hopper_bwd import get_bwd_config
    from fa3_inductor.templates.hopper_bwd.configs import VARIANTS

    if variant in ONE_HEAD_DIM and D != ONE_HEAD_DIM[variant][0]:
        pytest.skip(ONE_HEAD_DIM[variant][1])

    _, score_mod, mask_mod, Z, HQ, HKV, M, N, KZ = case
    torch.manual_seed(5)
    q, k, v, dout = _inputs(Z, HQ, HKV, M, N, D, KZ)
    _check(q, k, v, dout, score_mod, mask_mod, config=get_bwd_config(D, **VARIANTS[variant]))


# The wide kernel's variants (configs.VARIANTS): dq_bufs* (one or two dQ staging tiles a warpgroup) at both of its
# pairs and padded ones (160, 192 / 192: warpgroup 1 has one chunk, the other skipped): the staging tiles' reuse
# across steps and heads; overlap (the cross-step overlap: two Q / dO stages, so 192 / 128 only) also under a document
# mask (partial and full tiles, the next step's from the tables); dq_tiled (the tiled dQ staging the defaults had
# before dq_frag, which 160 keeps); persistent (CTAs walking tile lists, K / V reloaded under the last tile's stores: 3
# CTAs, so that each walks many tiles, from the shapes' lists or, under the document mask, the tables'); dkdv_tma (dK /
# dV through the dQ staging tiles by TMA; the padded pairs keep their stores).
WIDE_VARIANT_CASES = VARIANT_CASES + [("document", None, "document", 1, 2, 2, 900, 900, None)]


@pytest.mark.parametrize("variant", ["dq_bufs1", "dq_bufs2", "overlap", "serial", "dq_tiled", "persistent", "dkdv_tma"])
@pytest.mark.parametrize("dims", [(256, 256), (192, 128), (160, 160), (192, 192)], ids=_dims_id)
@pytest.mark.parametrize("case", WIDE_VARIANT_CASES, ids=[c[0] for c in WIDE_VARIANT_CASES])
def test_wide_variants_match_float64(case, dims, variant):
    from fa3_inductor.templates.hopper_bwd import get_bwd_config
    from fa3_inductor.templates.hopper_bwd.configs import VARIANTS

    if variant in ("overlap", "serial") and get_bwd_config(*dims).num_stages < 2:
        pytest.skip("the wide kernel's overlap waits for the next step's Q / dO stage: two stages, 192 / 128 only")
    _, score_mod, mask_mod, Z, HQ, HKV, M, N, KZ = case
    if mask_mod == "document":
        mask_mod = _document(M)
    torch.manual_seed(7)
    q, k, v, dout = _inputs(Z, HQ, HKV, M, N, dims[0], KZ, DV=dims[1])
    overrides = dict(VARIANTS[variant], **({"persistent_ctas": 3} if variant == "persistent" else {}))
    _check(q, k, v, dout, score_mod, mask_mod, config=get_bwd_config(*dims, **overrides))


# 96-key tiles at 192 / 128 (configs.VARIANTS kv96, bwd_sm90_k96.py: three 32-key warpgroups, dK / dV transposed):
# ragged noop (N not a multiple of 96), the causal walk (two partial tiles a CTA), softcap, GQA 4:1 with a K/V batch
# of 1 under causal, GQA without a mod.
# kv96_lag: each step's dQ issued in the next step (the last one's after the loop, the first one's dropped);
# kv96_persistent: 3 CTAs walking lists of tiles (K / V reloaded after each tile, the ring and dS buffers carried on).
# _tma: dK / dV stored through the dQ staging tiles by TMA (rows past N clipped by the descriptors).
@pytest.mark.parametrize("variant", ["kv96", "kv96_lag", "kv96_persistent", "kv96_lag_tma", "kv96_persistent_tma",
                                     "kv96_lag_persistent_tma"])
@pytest.mark.parametrize("case", VARIANT_CASES, ids=[c[0] for c in VARIANT_CASES])
def test_kv96_matches_float64(case, variant):
    from fa3_inductor.templates.hopper_bwd import get_bwd_config
    from fa3_inductor.templates.hopper_bwd.configs import VARIANTS

    _, score_mod, mask_mod, Z, HQ, HKV, M, N, KZ = case
    torch.manual_seed(11)
    q, k, v, dout = _inputs(Z, HQ, HKV, M, N, 192, KZ, DV=128)
    overrides = dict(VARIANTS[variant], **({"persistent_ctas": 3} if VARIANTS[variant]["persistent"] else {}))
    _check(q, k, v, dout, score_mod, mask_mod, config=get_bwd_config(192, 128, **overrides))


def _head_window(b, h, q_idx, kv_idx):
    """A causal window of 128 * (h + 1) keys: every head its own block mask, so the CTA orders differ by head."""
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 128 * (h + 1))


# CTA schedules for irregular block masks (configs.VARIANTS; docs/design/hopper_backward.md, "Masks against the tile
# bound"): (id, mask_mod, Z, HQ, HKV, M, N, KZ, head-dependent, head dims). A sliding window, documents with GQA 4:1
# and a K/V batch of 1 (ragged), and a head-dependent window (D128 only: few compiles on the GPU).
MASK_SCHEDULE_CASES = [
    ("sliding-window", mods.sliding_window(256), 2, 4, 4, 1000, 1000, None, False, (64, 128)),
    ("document-gqa4-kv-batch-1", "document", 2, 8, 2, 900, 900, 1, False, (64, 128)),
    ("head-window", _head_window, 1, 4, 4, 768, 768, None, True, (128,)),
]
# Schedules per head dim: lpt_order / persistent on the head dim's step (D128: the overlap under dK); at D128 also on
# the in-order step (_serial) and on the overlap under dK and dQ ('+overlap': configs.VARIANTS entries merged). At D64
# the _serial names are the same kernels.
MASK_SCHEDULES = {64: ("lpt_order", "persistent", "persistent+p_smem", "persistent+dkdv_tma"),
                  128: ("lpt_order", "persistent", "lpt_order_serial", "persistent_serial", "lpt_order+overlap",
                        "persistent+overlap", "persistent+p_smem", "persistent+dkdv_tma")}
MASK_SCHEDULE_PARAMS = [pytest.param(case, D, schedule, id=f"{case[0]}-{D}-{schedule.replace('+', '-')}")
                        for case in MASK_SCHEDULE_CASES for D in case[-1] for schedule in MASK_SCHEDULES[D]]


@pytest.mark.parametrize("case, D, schedule", MASK_SCHEDULE_PARAMS)
def test_mask_schedules_match_float64(case, D, schedule):
    from fa3_inductor.templates.hopper_bwd import get_bwd_config
    from fa3_inductor.templates.hopper_bwd.configs import VARIANTS

    _, mask_mod, Z, HQ, HKV, M, N, KZ, per_head, _ = case
    if mask_mod == "document":
        mask_mod = _document(M)
    torch.manual_seed(6)
    q, k, v, dout = _inputs(Z, HQ, HKV, M, N, D, KZ)
    overrides = {k_: v_ for name in schedule.split("+") for k_, v_ in VARIANTS[name].items()}
    # persistent: 3 CTAs, so that each walks many tiles (K / V reloaded under the last tile's stores; odd and even
    # tile counts); on an H100 / H200 every small case here would have one tile a CTA
    if overrides.get("persistent"):
        overrides["persistent_ctas"] = 3
    _check(q, k, v, dout, None, mask_mod, config=get_bwd_config(D, **overrides), mask_heads=HQ if per_head else None)


# The 128-row step (configs.VARIANTS m128, bwd_sm90_m128.py, D64 only) on every case of test_gradients_match_float64
# (those of VARIANT_CASES run above), the LSE's gradient with softcap (f' parked in the dS tile) + causal, fp16, and
# fully masked rows; the launches must name its kernel.
@pytest.mark.parametrize("case", [c for c in CASES if c[0] not in {v[0] for v in VARIANT_CASES}] +
                         [("lse-grad", mods.softcap(20.0), mods.causal, 1, 2, 2, 300, 300, None),
                          ("fp16-causal", None, mods.causal, 1, 2, 2, 500, 400, None),
                          ("late-causal", None, "late_causal", 1, 2, 2, 256, 256, None),
                          ("sliding-window", None, mods.sliding_window(256), 1, 2, 2, 1000, 1000, None)],
                         ids=lambda c: c[0])
def test_schedule_variants_m128_more_cases(case):
    from fa3_inductor.templates.hopper_bwd import get_bwd_config, prepare_hopper_backward
    from fa3_inductor.templates.hopper_bwd.bwd_sm90_m128 import fa3_bwd_sm90_m128_kernel
    from fa3_inductor.templates.hopper_bwd.configs import VARIANTS

    name, score_mod, mask_mod, Z, HQ, HKV, M, N, KZ = case
    cfg = get_bwd_config(64, **VARIANTS["m128"])
    if mask_mod == "document":
        mask_mod = _document(M)
    elif mask_mod == "late_causal":
        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx >= 20)
    torch.manual_seed(6)
    dtype = torch.float16 if name.startswith("fp16") else torch.bfloat16
    q, k, v, dout = _inputs(Z, HQ, HKV, M, N, 64, KZ, dtype=dtype)
    launches = prepare_hopper_backward(q, k, v, dout, dout, torch.zeros(Z, HQ, M, device="cuda"),
                                       torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), sm_scale=0.125,
                                       config=cfg)
    assert launches[1][0] is fa3_bwd_sm90_m128_kernel
    if name == "late-causal":   # rows 0-19 see no key: zero gradient, nothing non-finite
        out, lse = reference_attention(q, k, v, None, mask_mod)
        got = _run(q, k, v, torch.nan_to_num(out).to(q.dtype), dout, (lse / LN2).float(), sm_scale=0.125,
                   config=cfg, **_mask_options(mask_mod, M, N))
        assert all(torch.isfinite(g).all() for g in got)
        assert (got[0][:, :, :20] == 0).all()
    else:
        grad_lse = torch.randn(Z, HQ, M, device="cuda") if name == "lse-grad" else None
        _check(q, k, v, dout, score_mod, mask_mod, grad_lse=grad_lse, config=cfg)


@pytest.mark.parametrize("dims", [(128, 128)] + WIDE_HEAD_DIMS, ids=_dims_id)
def test_lse_gradient(dims):
    torch.manual_seed(1)
    q, k, v, dout = _inputs(1, 2, 2, 300, 300, dims[0], DV=dims[1])
    _check(q, k, v, dout, mods.softcap(20.0), mods.causal, grad_lse=torch.randn(1, 2, 300, device="cuda"))


@pytest.mark.parametrize("dims", [(128, 128)] + WIDE_HEAD_DIMS, ids=_dims_id)
def test_fp16(dims):
    torch.manual_seed(2)
    q, k, v, dout = _inputs(1, 2, 2, 500, 400, dims[0], dtype=torch.float16, DV=dims[1])
    _check(q, k, v, dout, None, mods.causal)


@pytest.mark.parametrize("dims", [(64, 64)] + WIDE_HEAD_DIMS, ids=_dims_id)
def test_fully_masked_rows_get_zero_gradient(dims):
    def late_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx >= 20)

    torch.manual_seed(3)
    q, k, v, dout = _inputs(1, 2, 2, 256, 256, dims[0], DV=dims[1])
    out, lse = reference_attention(q, k, v, None, late_causal)
    dq, dk, dv = _run(q, k, v, torch.nan_to_num(out).to(q.dtype), dout, (lse / LN2).float(), sm_scale=0.125,
                      **_mask_options(late_causal, 256, 256))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert (dq[:, :, :20] == 0).all()


@pytest.mark.parametrize("dims", [(128, 128), (96, 96), (192, 192)] + WIDE_HEAD_DIMS, ids=_dims_id)
def test_with_our_hopper_forward(dims):
    """out and LSE from templates/hopper's forward kernel (log2 LSE), causal + softcap."""
    from fa3_inductor.templates.hopper import launch_fwd_sm90

    torch.manual_seed(4)
    M = N = 1024
    D, DV = dims
    q, k, v, dout = _inputs(2, 4, 4, M, N, D, DV=DV)
    score = _score_options(mods.softcap(20.0))
    mask = _mask_options(mods.causal, M, N)
    fwd_mask = {key: mask[key] for key in ("mask_mod", "mask_bufs", "kv_num_blocks", "kv_indices",
                                            "full_kv_num_blocks", "full_kv_indices")}
    out, lse, mx = torch.empty_like(dout), torch.empty(2, 4, M, device="cuda"), torch.empty(2, 4, M, device="cuda")
    launch_fwd_sm90(q, k, v, out, lse, mx, sm_scale=D ** -0.5, score_mod=score["score_mod"],
                    score_bufs=score["score_bufs"], **fwd_mask)
    got = _run(q, k, v, out, dout, lse, sm_scale=D ** -0.5, **score, **mask)
    _, dq, dk, dv, _ = reference_gradients(q, k, v, dout, mods.softcap(20.0), mods.causal, D ** -0.5)
    for name, g, want in zip(("dq", "dk", "dv"), got, (dq, dk, dv)):
        assert_matches_reference(g, want, q.dtype, name)


# Deterministic dQ: ragged, GQA 4:1, a K/V batch of 1, block masks with partial and full blocks, a score_mod
DETERMINISTIC_CASES = [c for c in CASES if c[0] in ("noop-ragged", "causal", "softcap", "document", "window",
                                                     "gqa4-causal", "kv-batch-1")]


@pytest.mark.parametrize("dims", [(64, 64), (96, 96), (128, 128), (256, 256), (192, 128)], ids=_dims_id)
@pytest.mark.parametrize("case", DETERMINISTIC_CASES, ids=[c[0] for c in DETERMINISTIC_CASES])
def test_deterministic_matches_float64_and_repeats_bit_for_bit(case, dims):
    """deterministic=True: dq, dk, dv within the tolerance of float64, and the same bits on three runs (the wide head
    dims on bwd_sm90_wide.py's grid)."""
    _, score_mod, mask_mod, Z, HQ, HKV, M, N, KZ = case
    D, DV = dims
    mask_mod = _document(N) if mask_mod == "document" else mask_mod
    _check(*_inputs(Z, HQ, HKV, M, N, D, KZ=KZ, DV=DV), score_mod, mask_mod, deterministic=True)


@pytest.mark.parametrize("D, mask", [(128, None), (64, "causal"), (128, "document")])
def test_deterministic_dq_repeats_on_many_waves(D, mask):
    """Many CTAs add into each dQ tile (32 KV tiles), over several waves of the grid, and (no mask) a single head whose
    320 KV tiles outnumber the SMs (the KV-tile-major launch order keeps every wait on a CTA launched earlier): dQ
    repeats bit for bit over five runs (the counters come back zeroed by the next launch's preprocess)."""
    for Z, H, L in ((4, 8, 4096), (1, 1, 40960)) if mask is None else ((4, 8, 4096),):
        q, k, v, dout = _inputs(Z, H, H, L, L, D)
        mask_mod = {"causal": mods.causal, "document": mods.document((torch.arange(L, device="cuda") // 1500).to(
            torch.int32)), None: None}[mask]
        lse = torch.randn(Z, H, L, device="cuda").abs() + 8.0   # any finite LSE: a fixed input, not a softmax here
        options = dict(sm_scale=D ** -0.5, deterministic=True, **_mask_options(mask_mod, L, L))
        first = _run(q, k, v, dout, dout, lse, **options)
        assert torch.isfinite(first[0]).all()
        for _ in range(4):
            again = _run(q, k, v, dout, dout, lse, **options)
            for name, a, b in zip(("dq", "dk", "dv"), first, again):
                assert torch.equal(a, b), f"{name} differs between two deterministic runs at Z{Z} H{H} L{L}"


@pytest.mark.parametrize("det_heads", [1, 5])
def test_deterministic_launch_groups_cover_every_tile(det_heads):
    """Launch-order groups narrower than the heads (configs.det_heads; 12 (kz, hkv) heads in groups of 5, 5, 2, or
    of one): every (KV tile, head) is computed once, the gradients match float64 and repeat bit for bit."""
    from fa3_inductor.templates.hopper_bwd import get_bwd_config

    _check(*_inputs(3, 8, 4, 700, 640, 64), None, mods.causal, deterministic=True,
           config=get_bwd_config(64, masked=True, det_heads=det_heads))


@pytest.mark.parametrize("dims", WIDE_HEAD_DIMS + [(192, 192), (160, 160), (96, 96), (80, 80)], ids=_dims_id)
def test_head_dims_are_served(dims):
    """family.py serves 256 and 192 / 128 on sm90 (bwd_sm90_wide.py; 160 and 192 in its 256 tiles; 192 / 128 without a
    mod or mask on bwd_sm90_k96.py's 96-key tiles), 80 and 96 with bwd_sm90.py's 128 tiles, and the launches name that
    kernel."""
    from fa3_inductor.templates.family import BackwardSiteFacts
    from fa3_inductor.templates.hopper_bwd import prepare_hopper_backward
    from fa3_inductor.templates.hopper_bwd.bwd_sm90 import fa3_bwd_sm90_kernel
    from fa3_inductor.templates.hopper_bwd.bwd_sm90_k96 import fa3_bwd_sm90_k96_kernel
    from fa3_inductor.templates.hopper_bwd.bwd_sm90_wide import fa3_bwd_sm90_wide_kernel
    from fa3_inductor.templates.hopper_bwd.family import HOPPER_BWD

    D, DV = dims
    site = BackwardSiteFacts(torch.device("cuda"), torch.bfloat16, D, DV)
    assert HOPPER_BWD.serves_backward(site) is None
    q, k, v, dout = _inputs(1, 2, 2, 128, 128, D, DV=DV)
    launches = prepare_hopper_backward(q, k, v, dout, dout, torch.zeros(1, 2, 128, device="cuda"), torch.empty_like(q),
                                       torch.empty_like(k), torch.empty_like(v), sm_scale=D ** -0.5)
    wide = fa3_bwd_sm90_k96_kernel if dims == (192, 128) else fa3_bwd_sm90_wide_kernel
    assert launches[1][0] is (wide if D > 128 else fa3_bwd_sm90_kernel)


# (D, DV, the main kernel's bundle that says PERSISTENT): D64 under a block mask (bwd_sm90's SCHED, lists from the
# tables), 192 / 128 causal (the wide kernel's TILE, lists from the shapes: configs.WIDE_CAUSAL_PERSISTENT)
@pytest.mark.parametrize("D, DV, bundle", [(64, 64, "SCHED"), (192, 128, "TILE")], ids=["d64", "d192-128"])
def test_masked_launch_under_graph_capture_takes_the_grid_order(D, DV, bundle):
    """The persistent schedules' lists are host-made tensors (D64's read the block tables): planned under CUDA graph
    capture, the launch takes the grid order instead, and the replayed graph's gradients match the eager persistent
    launch."""
    from fa3_inductor.templates.hopper_bwd import get_bwd_config, prepare_hopper_backward

    torch.manual_seed(7)
    Z, HQ, M = 1, 2, 640
    q, k, v, dout = _inputs(Z, HQ, HQ, M, M, D, DV=DV)
    out, lse = reference_attention(q, k, v, None, mods.causal, D ** -0.5)
    out, lse2 = out.to(q.dtype), (lse / LN2).float()
    options = dict(sm_scale=D ** -0.5, **_mask_options(mods.causal, M, M))
    eager = _run(q, k, v, out, dout, lse2, **options)
    _run(q, k, v, out, dout, lse2, config=get_bwd_config(D, DV, masked=True, causal=True, persistent=False),
         **options)   # the grid kernel compiled before the capture
    grads = tuple(torch.empty_like(t) for t in (q, k, v))
    assert prepare_hopper_backward(q, k, v, out, dout, lse2, *grads, **options)[1][2][bundle].PERSISTENT
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        launches = prepare_hopper_backward(q, k, v, out, dout, lse2, *grads, **options)
        for kernel, args, kwargs, grid in launches:
            kernel[grid](*args, **kwargs)
    assert not launches[1][2][bundle].PERSISTENT
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(grads, eager):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
