"""CPU-only: compile the sm90 backward (templates/hopper_bwd/) for GPUTarget("cuda", 90, 32) and read the result.

Run in a session without TRITON_INTERPRET: ``pytest -m "sm90_compile and not gpu" tests/test_hopper_bwd_compile.py``.
Eight compiles (D 64 / 128 x noop, causal mask_mod with partial and full blocks, softcap and ALiBi score_mods), the
wide head dims (256 and 192 / 128 x noop, causal, softcap: bwd_sm90_wide.py), plus the dQ schedules (configs.VARIANTS: dq_tma must issue UTMAREDG and no REDG): wgmma (HGMMA) present, setmaxnreg at
the configured budgets, shared memory within sm90's 227 KB, no spill instruction in a step loop (outside: DEFAULT_SPILLS),
and the noop kernel's step loop no longer than measured (docs/design/hopper_backward.md). Registers, spill
counts and step-loop lengths are printed (``-s``).
"""
from __future__ import annotations

import re

import pytest
import torch

from fa3_inductor import mods

pytestmark = pytest.mark.sm90_compile

SMEM_LIMIT = 227 * 1024
# Spill instructions (LDL / STL) of the whole main kernel and its stack bytes, triton 3.6; none may be in a step loop.
# D = 128 had 2 (noop, softcap), 56 (causal) and 57 (ALiBi) before K, V and P's wgmma views were rebuilt per step
# (bwd_sm90.BwdTile.VIEWS_PER_STEP). Since p_regs became D128's default, causal (the persistent schedule, P carried in
# 16 bits) keeps one 64-bit value on the stack from the entry, reloaded at each tile's dK / dV store; with dQ in the
# fragments' order (dq_frag) also a 32-bit one, stored and reloaded once at the entry.
DEFAULT_SPILLS = {(128, "causal"): (5, 16)}
# SASS instructions of the noop kernel's longer step loop (one per consumer warpgroup), triton 3.6: the register
# work must not lengthen it (before VIEWS_PER_STEP: 480 at D = 64, 514 at D = 128). D = 128's default is the
# cross-step overlap: 537 / 517 (its in-order step: 509), the next step's S issue and P's conversion moved in; 484 / 465
# since P is carried in registers (p_regs).
NOOP_STEP_LOOP = {64: 480, 128: 490}
VARIANTS = ["noop", "causal", "softcap", "alibi"]


def _gl_mod(fn, kind):
    from fa3_inductor.templates.modgen import BufferSpec, generate_mod_source, load_mod, trace_mod

    gm, bufs = trace_mod(fn, kind)
    return load_mod(generate_mod_source(gm, kind, [BufferSpec.of(b) for b in bufs], "gl"), "gl"), tuple(bufs), gm


def _options(variant, M, N):
    from torch._higher_order_ops.flex_attention import create_fw_bw_graph
    from torch.nn.attention.flex_attention import create_block_mask

    from fa3_inductor.templates.generic_bwd import SCORE_GRAD_ONE
    from fa3_inductor.templates.hopper_bwd import score_grad_gl
    from fa3_inductor.templates.modgen import BufferSpec, load_mod

    if variant in ("softcap", "alibi"):
        # ALiBi over the 4 query heads of the test shapes: its derivative is 1 (SCORE_GRAD_ONE)
        fn, bufs, gm = _gl_mod(mods.softcap(30.0) if variant == "softcap" else mods.alibi(4), "score")
        index_values = (torch.zeros((), requires_grad=True), *(torch.zeros((), dtype=torch.int32) for _ in range(4)))
        src = score_grad_gl(create_fw_bw_graph(gm, index_values, bufs)[1], [BufferSpec.of(b) for b in bufs])
        return dict(score_mod=fn, score_bufs=bufs,
                    score_grad_mod=SCORE_GRAD_ONE if src is None else load_mod(src, "gl"))
    if variant in ("causal", "sliding_window", "document"):
        mask_mod = {"causal": mods.causal, "sliding_window": mods.sliding_window(256),
                    "document": mods.document((torch.arange(N) // 300).to(torch.int32))}[variant]
        bm = create_block_mask(mask_mod, None, None, M, N, device="cpu")
        fn, bufs, _ = _gl_mod(mask_mod, "mask")
        return dict(mask_mod=fn, mask_bufs=bufs, kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices,
                    full_kv_num_blocks=bm.full_kv_num_blocks, full_kv_indices=bm.full_kv_indices)
    return {}


def _top_register(body):
    """Highest general register a loop body names, + 1 (the registers it keeps in use)."""
    return 1 + max((int(r) for t in body for r in re.findall(r"\bR(\d+)\b", t)), default=-1)


def _combined_options(variant, M, N):
    """_options of "a+b" variants; "blocks": a document block mask's tables (partial and full blocks), no mask_mod."""
    from torch.nn.attention.flex_attention import create_block_mask

    opts = {}
    for part in variant.split("+"):
        if part == "blocks":
            bm = create_block_mask(mods.document((torch.arange(M) // 300).to(torch.int32)), None, None, M, N,
                                   device="cpu")
            opts.update(kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices,
                        full_kv_num_blocks=bm.full_kv_num_blocks, full_kv_indices=bm.full_kv_indices)
        else:
            opts.update(_options(part, M, N))
    return opts


def _step_loops(report):
    """Instruction lists of the step loops (the innermost loops that issue wgmma), one per consumer warpgroup."""
    return [body for body in report.inner_loops() if any("HGMMA" in t for t in body)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("D", [64, 128])
def test_compiles_with_wgmma_within_budgets(D, variant):
    from fa3_inductor.templates.aot import sass_report
    from fa3_inductor.templates.hopper_bwd import compile_hopper_backward, get_bwd_config

    M, N = 1000, 1000   # ragged: the key-bound mask of the last KV tile is compiled in
    q = torch.randn(2, 4, M, D, dtype=torch.bfloat16)
    k = v = torch.randn(2, 2, N, D, dtype=torch.bfloat16)
    kernels = compile_hopper_backward(q, k, v, torch.empty_like(q), torch.empty_like(q), torch.empty(2, 4, M),
                                      sm_scale=D ** -0.5, **_options(variant, M, N))
    pre, main, convert = (sass_report(ck) for ck in kernels)
    cfg = get_bwd_config(D)
    loops = _step_loops(main)
    print(f"\nD{D} {variant}: main {main.registers} registers at entry, {main.hgmma} HGMMA, "
          f"{main.spill_instructions} spill instructions, stack {main.stack}, shared {main.shared}, "
          f"step loops {[len(b) for b in loops]}")
    assert main.hgmma > 0, "no wgmma in the main kernel"
    assert "HGMMA.64x64x16.F32.BF16" in main.sass, "no 64x64 score wgmma"
    assert {cfg.consumer_regs, cfg.producer_regs} <= main.setmaxnreg, f"setmaxnreg dropped: {main.setmaxnreg}"
    spills, stack = DEFAULT_SPILLS.get((D, variant), (0, 0))
    assert main.spill_instructions <= spills, f"{main.spill_instructions} spill instructions"
    assert main.stack <= stack, f"stack {main.stack} bytes"
    assert len(loops) == 2, f"expected one step loop per consumer warpgroup, got {[len(b) for b in loops]}"
    assert not any("LDL" in t or "STL" in t for body in loops for t in body), "a spill in a step loop"
    if variant == "noop":
        assert max(map(len, loops)) <= NOOP_STEP_LOOP[D], f"noop step loops {[len(b) for b in loops]}"
    assert main.shared <= SMEM_LIMIT
    assert cfg.smem_bytes(D) <= main.shared
    # dK / dV: D64 through the dQ staging tiles by TMA (configs.DKDV_TMA_HEAD_DIMS), D128 by gl.store
    epilogue = ("UTMASTG" in main.sass, bool(re.search(r"STG\.E\b", main.sass)))
    assert epilogue == ((True, False) if D == 64 else (False, True)), epilogue
    for r in (pre, convert):
        assert r.spill_instructions == 0 and r.stack == 0


# Schedule variants (configs.VARIANTS), measured with triton 3.6 at M = N = 1000: spill instructions of the whole
# kernel / in the busier step loop. dq_tma moves dQ to one TMA reduce-add a warpgroup and step (UTMAREDG, no REDG)
# and freed the atomics' 64-bit addresses (D128 noop 17 -> 2 spills); the per-step K, V, P views
# (VIEWS_PER_STEP) took the rest (docs/design/hopper_backward.md, "Choices forced by registers"). The atomic
# schedule at D128, before / after them: noop 17 / 0, causal 55 / 0, softcap 18 / 0, ALiBi 111 / 5 (outside the loop).
VARIANT_SPILLS = {
    (128, "noop", "default"): (0, 0), (128, "alibi", "default"): (0, 0), (64, "causal", "default"): (0, 0),
    (128, "noop", "atomic_dq"): (0, 0), (128, "causal", "atomic_dq"): (0, 0), (128, "softcap", "atomic_dq"): (3, 0),
    (128, "alibi", "atomic_dq"): (5, 0),
    (128, "noop", "serial"): (0, 0), (128, "causal", "serial"): (0, 0),   # D128's in-order step, default before
    (64, "noop", "stages3"): (0, 0), (64, "causal", "stages3"): (0, 0), (64, "softcap", "stages3"): (0, 0),
}
# atomic_dq at D128 runs on the default's overlap since it became the default: softcap 3 spills, outside the loops.
# The cross-step overlap (configs.VARIANTS overlap / overlap_dk, docs/design/hopper_backward.md, "Cross-step overlap"),
# triton 3.6: no spill in a step loop at any mod. overlap at D128 holds dQ's accumulator in flight beside S while P is
# made: ptxas kept head-level values on the stack across the step loops (causal 33, softcap 78, ALiBi 20) until
# _consumer_overlap made them where they are used (the prologue's P slot and the dS buffer by an opaque zero, the
# dK / dV store's rows and columns from %laneid): softcap 0, causal 4 (Z // KZ, computed before the role dispatch),
# ALiBi 2 (one value in the prologue). At D64 both names are the same kernel (dQ alternates between the warpgroups,
# so it is issued after P either way).
for _D in (64, 128):
    for _v in VARIANTS:
        for _s in ("overlap", "overlap_dk"):
            VARIANT_SPILLS[_D, _v, _s] = (0, 0)
VARIANT_SPILLS.update({(128, "causal", "overlap"): (4, 0), (128, "alibi", "overlap"): (2, 0)})
# CTA schedules for block masks (docs/design/hopper_backward.md, "Masks against the tile bound"): causal, a 256-key
# causal window and documents of 300 positions, under the head dim's step (lpt_order, persistent: D128's overlap under
# dK), the in-order step (_serial) and the overlap under dK and dQ ("+overlap": configs.VARIANTS merged), triton 3.6.
# Spill instructions (whole kernel, in the busier step loop) where not (0, 0): head- or tile-level values (the doc-id
# gathers' addresses, the tile loop's state), stored before the step loop and reloaded once per query head or tile.
# None spills in a step loop since main's overlap without head-level spills was merged (_consumer_overlap_tile's
# DQ_UNDER store indices, P slot and dS buffer): "+overlap" (OVERLAP 1) went causal 29 / 41 -> 4 / 33, sliding window
# 54 (2 in a loop) / 41 -> 4 / 36, documents 121 (10 in a loop) / 57 -> 8 / 33 (lpt_order / persistent).
MASK_SCHEDULES = {64: ("default", "lpt_order", "persistent"),
                  128: ("default", "lpt_order", "persistent", "lpt_order_serial", "persistent_serial",
                        "lpt_order+overlap", "persistent+overlap")}
MASK_SCHEDULE_SPILLS = {
    (128, "causal", "lpt_order+overlap"): (4, 0), (128, "causal", "persistent+overlap"): (33, 0),
    (128, "sliding_window", "lpt_order+overlap"): (4, 0), (128, "sliding_window", "persistent+overlap"): (36, 0),
    (128, "document", "default"): (28, 0), (128, "document", "lpt_order"): (24, 0),
    (128, "document", "persistent"): (34, 0), (128, "document", "lpt_order_serial"): (6, 0),
    (128, "document", "persistent_serial"): (33, 0), (128, "document", "lpt_order+overlap"): (8, 0),
    (128, "document", "persistent+overlap"): (33, 0),
}
for _D, _schedules in MASK_SCHEDULES.items():
    for _mask in ("causal", "sliding_window", "document"):
        for _s in _schedules:
            VARIANT_SPILLS.setdefault((_D, _mask, _s), MASK_SCHEDULE_SPILLS.get((_D, _mask, _s), (0, 0)))


# D128's variants on p_regs (its default since 2026-11-29): P carried in 16 bits under the overlap (masks, mods,
# overlap 1), in fp32 through the in-order step. Head- and tile-level values on the stack, none in a step loop.
VARIANT_SPILLS.update({
    (128, "alibi", "overlap"): (8, 0), (128, "noop", "atomic_dq"): (6, 0), (128, "causal", "atomic_dq"): (2, 0),
    (128, "causal", "overlap"): (10, 0), (128, "causal", "serial"): (19, 0),
    (128, "causal", "lpt_order"): (2, 0), (128, "causal", "persistent"): (3, 0),
    (128, "causal", "lpt_order_serial"): (19, 0), (128, "causal", "persistent_serial"): (46, 0),
    (128, "causal", "persistent+overlap"): (36, 0),
    (128, "sliding_window", "lpt_order"): (2, 0), (128, "sliding_window", "persistent"): (5, 0),
    (128, "sliding_window", "lpt_order_serial"): (19, 0), (128, "sliding_window", "persistent_serial"): (46, 0),
    (128, "document", "lpt_order_serial"): (26, 0), (128, "document", "persistent_serial"): (58, 0),
})


def _overrides(schedule):
    """The config overrides of a configs.VARIANTS name, or of several joined by '+' (merged)."""
    from fa3_inductor.templates.hopper_bwd.configs import VARIANTS

    return {k: v for name in schedule.split("+") for k, v in VARIANTS[name].items()}


# 128 query rows a step at D64 (bwd_sm90_m128.py, docs/design/hopper_backward.md, "128 query rows a step"): none
for _v in VARIANTS:
    VARIANT_SPILLS[64, _v, "m128"] = (0, 0)


# dQ staged in the wgmma fragments' order (configs dq_frag, every head dim's default since 2026-11-29 19:48): the
# D128 kernels under block masks keep 2-9 more spill instructions outside the step loops (the dQ block index's terms,
# stored at the entry and reloaded once per tile or head), none in a loop.
VARIANT_SPILLS.update({
    (128, "causal", "lpt_order_serial"): (22, 0), (128, "causal", "overlap"): (14, 0),
    (128, "causal", "persistent"): (5, 0), (128, "causal", "persistent+overlap"): (39, 0),
    (128, "document", "lpt_order"): (31, 0), (128, "document", "lpt_order+overlap"): (17, 0),
    (128, "document", "lpt_order_serial"): (28, 0), (128, "document", "persistent"): (36, 0),
    (128, "document", "persistent+overlap"): (36, 0), (128, "sliding_window", "default"): (2, 0),
    (128, "sliding_window", "lpt_order_serial"): (22, 0), (128, "sliding_window", "persistent"): (9, 0),
    (128, "sliding_window", "persistent+overlap"): (39, 0),
})


@pytest.mark.parametrize("D, variant, schedule", sorted(VARIANT_SPILLS))
def test_schedule_variants_compile(D, variant, schedule):
    from fa3_inductor.templates.hopper_bwd import get_bwd_config

    overrides = _overrides(schedule)
    cfg = get_bwd_config(D, **overrides)
    main = _main_kernel(D, variant, **overrides)
    loops = _step_loops(main)
    loop_spills = max(sum(("LDL" in t or "STL" in t) for t in body) for body in loops)
    print(f"\nD{D} {variant} {schedule}: {main.spill_instructions} spills ({loop_spills} in a step loop), "
          f"loops {[len(b) for b in loops]}, registers {[_top_register(b) for b in loops]}, shared {main.shared}")
    assert main.hgmma > 0 and main.shared <= SMEM_LIMIT and cfg.smem_bytes(D) <= main.shared
    if cfg.dq_tma:
        assert "UTMAREDG" in main.sass and "REDG" not in main.sass.replace("UTMAREDG", ""), "dQ not by TMA reduce"
    if cfg.overlap:
        # wgmma groups of a step loop in issue order, Z a fresh accumulator (S, dP, dQ: RZ, !UPT) and A an
        # accumulating one (dV, dK): the in-order step is S dP dV dK dQ (ZZAAZ); the overlap issues the next step's
        # S between dV and dK (ZAZA, then dQ)
        for body in loops:
            order, start = "", False
            for t in body:
                if "WARPGROUP.ARRIVE" in t:
                    start = True
                elif "HGMMA" in t and start:
                    order += "Z" if ", RZ" in t else "A"
                    start = False
            assert "ZAZA" in order and "ZZAA" not in order, order
    max_total, max_loop = VARIANT_SPILLS[D, variant, schedule]
    assert main.spill_instructions <= max_total and loop_spills <= max_loop, (main.spill_instructions, loop_spills)


def _wide_kernels(D, DV, options, config=None):
    """SassReports of the (preprocess, main, convert) launches of a wide-head-dim backward (B 2, HQ 4, HKV 2,
    M = N = 1000, bf16) with ``options`` (the mods and block mask) and ``config`` (None: the host's pick)."""
    from fa3_inductor.templates.aot import sass_report
    from fa3_inductor.templates.hopper_bwd import compile_hopper_backward

    M = 1000
    q = torch.randn(2, 4, M, D, dtype=torch.bfloat16)
    k = torch.randn(2, 2, M, D, dtype=torch.bfloat16)
    v = torch.randn(2, 2, M, DV, dtype=torch.bfloat16)
    out = torch.empty(2, 4, M, DV, dtype=torch.bfloat16)
    kernels = compile_hopper_backward(q, k, v, out, torch.empty_like(out), torch.empty(2, 4, M), sm_scale=D ** -0.5,
                                      **({"config": config} if config else {}), **options)
    return tuple(sass_report(ck) for ck in kernels)


# Wide head dims (bwd_sm90_wide.py: dK, dV and dQ columns split between the warpgroups, 64-key CTAs), triton 3.6,
# M = N = 1000: (q/k, v) head dims -> HGMMA instructions. No spill and no stack, except ALiBi at D = 256: one
# 64-bit kernel-argument product stored before the warp-specialized dispatch and reloaded once per query head
# (2 instructions, 8 bytes of stack, none in a step loop). Step-loop lengths are printed
# (docs/design/hopper_backward.md, "Wide head dims").
WIDE = {(256, 256): 96, (192, 128): 68}
WIDE_VARIANTS = ["noop", "causal", "softcap", "alibi"]
# (spill instructions, stack bytes); (0, 0) elsewhere. D256 with dK / dV by TMA (configs.DKDV_TMA_TILES): noop and
# softcap 0 -> 2 (outside the step loops)
WIDE_SPILLS = {(256, 256, "alibi"): (2, 8), (256, 256, "noop"): (2, 8), (256, 256, "softcap"): (2, 8)}


@pytest.mark.parametrize("variant", WIDE_VARIANTS)
@pytest.mark.parametrize("D, DV", sorted(WIDE))
def test_wide_head_dims_compile(D, DV, variant):
    from fa3_inductor.templates.hopper_bwd import get_bwd_config
    from fa3_inductor.templates.hopper_bwd.configs import WIDE_PLAIN_OVERLAP

    # (192 / 128 without a mask, noop and softcap, and causal without a score_mod run 96-key tiles, test_kv96_compile:
    # here the wide kernel's rows, which noop takes with ALiBi, softcap under block-mask tables, causal with a
    # score_mod)
    pick = {"softcap": get_bwd_config(D, DV, curved=True, masked=True), "noop": get_bwd_config(D, DV),
            "causal": get_bwd_config(D, DV, masked=True, causal=True)}.get(variant)
    pre, main, convert = _wide_kernels(D, DV, _options(variant, 1000, 1000), config=pick)
    cfg = get_bwd_config(D, DV)
    loops = _step_loops(main)
    print(f"\nD{D}/{DV} {variant}: main {main.registers} registers at entry, {main.hgmma} HGMMA, "
          f"{main.spill_instructions} spill instructions, stack {main.stack}, shared {main.shared}, "
          f"step loops {[len(b) for b in loops]}")
    assert cfg.split_dkv
    # (192 / 128 without a curved score_mod: the cross-step overlap, configs.WIDE_PLAIN_OVERLAP, whose prologue adds
    # each warpgroup's 12 HGMMA of a head's first S)
    plain_overlap = (D, DV) in WIDE_PLAIN_OVERLAP and variant != "softcap"
    assert main.hgmma == WIDE[D, DV] + (24 if plain_overlap else 0), f"{main.hgmma} HGMMA"
    assert "HGMMA.64x32x16.F32.BF16" in main.sass, "no 64x32 score wgmma (32 keys a warpgroup)"
    assert {cfg.consumer_regs, cfg.producer_regs} <= main.setmaxnreg, f"setmaxnreg dropped: {main.setmaxnreg}"
    max_spills, max_stack = WIDE_SPILLS.get((D, DV, variant), (0, 0))
    assert main.spill_instructions <= max_spills, f"{main.spill_instructions} spill instructions"
    assert main.stack <= max_stack, f"stack {main.stack} bytes"
    assert len(loops) == 2, f"expected one step loop per consumer warpgroup, got {[len(b) for b in loops]}"
    assert not any("LDL" in t or "STL" in t for body in loops for t in body), "spill in a step loop"
    assert "UTMAREDG" in main.sass and "REDG" not in main.sass.replace("UTMAREDG", ""), "dQ not by TMA reduce"
    # dQ staged in the fragments' order (dq_frag): 16-byte stores, no 8-byte ones (the swizzled tile's, 2-way
    # bank conflicts in each half-warp)
    stores = [t for body in loops for t in body if re.search(r"\bSTS\b|\bSTS\.", t)]
    assert stores and all("STS.128" in t for t in stores), sorted({t.split()[0] for t in stores})
    assert cfg.smem_bytes(D, value_head_dim=DV) <= main.shared <= SMEM_LIMIT
    for r in (pre, convert):
        assert r.spill_instructions == 0 and r.stack == 0


# 96-key tiles at 192 / 128 (bwd_sm90_k96.py, configs.VARIANTS kv96), triton 3.6, M = N = 1000: three consumer
# warpgroups at setmaxnreg 160 (warpgroup 0, the default partition, 168), each step loop S 12 + dP 8 + dV^T 8 + dK^T
# 12 + dQ 6 HGMMA (64x32x16 and 64x64x16), none spilling; outside the loops causal keeps 22 spill instructions
# (head-level values of the walk, stored before the role dispatch and reloaded once per head), softcap 2. kv96_lag
# (the default of noop and softcap without a mask, configs.WIDE_KV96_LAG: each step's dQ in the next step, the last
# one's after the loop, 18 HGMMA more) keeps head-level values on the stack: noop 44, softcap 65, none in a loop
# (under a mask_mod or ALiBi it spills in the loop, so those launches keep the wide kernel). kv96_persistent_tma (the
# default of exactly causal launches without a score_mod, configs.WIDE_CAUSAL_KV96) stores dK / dV through the dQ
# staging tiles: stmatrix with transpose (STSM.16.MT88.4, 10 a warp) and TMA stores (UTMASTG), 53 spill instructions
# outside the loops (the persistent walk's head-level values), none in them. kv96_lag_persistent_tma (the default
# without a score_mod or a mask, configs.WIDE_PLAIN_KV96_PERSISTENT) 125 outside the loops, none in them; under
# causal (the default from 16k query rows, configs.WIDE_CAUSAL_KV96_LAG_FROM) 212, with 10 / 10 / 4 reloads in the
# loops of loop-invariant values (a 64-bit pointer pair of the loop's exit test, values moved to uniform registers):
# measured, its causal step at 16k runs at noop's late-dQ rate (docs/design/hopper_backward.md).
K96_SPILLS = {("kv96", "causal"): (22, 40), ("kv96", "softcap"): (2, 8), ("kv96_lag", "noop"): (44, 56),
              ("kv96_lag", "softcap"): (65, 56), ("kv96_persistent_tma", "causal"): (53, 56),
              ("kv96_lag_persistent_tma", "noop"): (125, 104), ("kv96_lag_persistent_tma", "causal"): (212, 200)}
K96_LOOP_SPILLS = {("kv96_lag_persistent_tma", "causal"): 10}   # the busiest loop's LDL / STL, where not 0
K96_CASES = [("kv96", v) for v in WIDE_VARIANTS] + [("kv96_lag", "noop"), ("kv96_lag", "softcap"),
                                                     ("kv96_persistent_tma", "causal"),
                                                     ("kv96_lag_persistent_tma", "noop"),
                                                     ("kv96_lag_persistent_tma", "causal")]


@pytest.mark.parametrize("schedule, variant", K96_CASES)
def test_kv96_compile(schedule, variant):
    from fa3_inductor.templates.hopper_bwd import get_bwd_config
    from fa3_inductor.templates.hopper_bwd.configs import VARIANTS

    cfg = get_bwd_config(192, 128, **VARIANTS[schedule])
    default = get_bwd_config(192, 128, curved=True, grad_mod=True)
    assert default.kv96 and default.overlap == 1, "softcap without a mask takes 96-key tiles, dQ a step late"
    pre, main, convert = _wide_kernels(192, 128, _options(variant, 1000, 1000), config=cfg)
    loops = _step_loops(main)
    print(f"\n{schedule} {variant}: {main.hgmma} HGMMA, {main.spill_instructions} spill instructions, stack "
          f"{main.stack}, shared {main.shared}, step loops {[len(b) for b in loops]}, registers "
          f"{[_top_register(b) for b in loops]}")
    assert main.hgmma == (156 if cfg.overlap == 1 else 138), f"{main.hgmma} HGMMA"
    assert "HGMMA.64x32x16.F32.BF16" in main.sass
    assert {160, 24} <= main.setmaxnreg, f"setmaxnreg: {main.setmaxnreg}"
    assert len(loops) == 3, f"expected one step loop per consumer warpgroup, got {[len(b) for b in loops]}"
    loop_spills = max(sum("LDL" in t or "STL" in t for t in body) for body in loops)
    assert loop_spills <= K96_LOOP_SPILLS.get((schedule, variant), 0), f"{loop_spills} spills in a step loop"
    assert max(_top_register(b) for b in loops) <= 168   # (the default partition, warpgroup 0, gets the rest: 168)
    max_spills, max_stack = K96_SPILLS.get((schedule, variant), (0, 0))
    assert main.spill_instructions <= max_spills and main.stack <= max_stack, (main.spill_instructions, main.stack)
    assert "UTMAREDG" in main.sass and cfg.smem_bytes(192, value_head_dim=128) <= main.shared <= SMEM_LIMIT
    epilogue_tma = ("STSM.16.MT88.4" in main.sass, "UTMASTG" in main.sass, "STG.E.U16" in main.sass)
    assert epilogue_tma == ((True, True, False) if cfg.dkdv_tma else (False, False, True)), epilogue_tma
    causal = dict(masked=True, causal=True, no_score_mod=True)
    picks = {("kv96_persistent_tma", "causal"): dict(causal, query_len=8192),
             ("kv96_lag_persistent_tma", "causal"): dict(causal, query_len=16384),
             ("kv96_lag_persistent_tma", "noop"): dict(plain=True, no_score_mod=True)}
    if (schedule, variant) in picks:
        traits = picks[schedule, variant]
        assert get_bwd_config(192, 128, **traits) == get_bwd_config(192, 128, **VARIANTS[schedule]), "the host's pick"
    for r in (pre, convert):
        assert r.spill_instructions == 0 and r.stack == 0


# The wide kernel's cross-step overlap (configs.VARIANTS overlap at 192 / 128: the next step's S behind this step's
# dS, its P under dK and dQ), triton 3.6, M = N = 1000: no spill anywhere; 92 HGMMA (the 68 of the in-order kernel
# plus each warpgroup's 12 of a head's first S in the prologue); per step, S issued before dS's ds_ready wait and
# the exponentials of the next P between the wgmma wait that leaves dK and the dQ chunks in flight and dQ's staging.
# Under a block mask (the masked launches' default) the next step's first row is loaded a step ahead.
@pytest.mark.parametrize("variant", WIDE_VARIANTS + ["document", "sliding_window", "alibi+causal", "blocks"])
def test_wide_overlap_compile(variant):
    from fa3_inductor.templates.hopper_bwd import get_bwd_config
    from fa3_inductor.templates.hopper_bwd.configs import VARIANTS

    D, DV = 192, 128
    main = _wide_kernels(D, DV, _combined_options(variant, 1000, 1000),
                         get_bwd_config(D, DV, **VARIANTS["overlap"]))[1]
    loops = _step_loops(main)
    print(f"\nD{D}/{DV} {variant} overlap: {main.hgmma} HGMMA, {main.spill_instructions} spill instructions, "
          f"step loops {[len(b) for b in loops]}, registers {[_top_register(b) for b in loops]}")
    assert main.spill_instructions == 0 and main.stack == 0
    assert main.hgmma == 92, f"{main.hgmma} HGMMA"
    assert len(loops) == 2
    for body in loops:
        ops = [t for t in body if re.search(r"HGMMA|DEPBAR|MUFU\.EX2|UTMAREDG", t)]
        first_ex2 = next(i for i, t in enumerate(ops) if "MUFU.EX2" in t)
        # the next step's P: after a wgmma wait that leaves two or three groups (dK, the dQ chunks) in flight
        assert re.search(r"DEPBAR\.LE gsb0, 0x[23]", ops[first_ex2 - 1]), ops[first_ex2 - 3:first_ex2 + 1]
        assert all(not re.search(r"DEPBAR\.LE gsb0, 0x0", t) for t in ops[:first_ex2]), "a full drain before P"


# Persistent CTAs in the wide kernel (WideTile.PERSISTENT: 192 / 128 causal's default, configs.WIDE_CAUSAL_PERSISTENT;
# the others an A/B variant), triton 3.6, M = N = 1000: at 192 / 128 no spill and no stack under any mask, and each step
# loop within 4 instructions of the grid launch's (the tile loop around it holds what the grid gave once a CTA).
@pytest.mark.parametrize("variant", ["noop", "causal", "document", "alibi+causal"])
def test_wide_persistent_compile(variant):
    from fa3_inductor.templates.hopper_bwd import get_bwd_config

    D, DV = 192, 128
    opts = _combined_options(variant, 1000, 1000)
    masked = "kv_num_blocks" in opts
    loops = {}
    for persistent in (False, True):
        # (both with the stores from registers: the grid's default stores by TMA, persistent CTAs do not)
        main = _wide_kernels(D, DV, opts, get_bwd_config(D, DV, masked=masked, persistent=persistent,
                                                         dkdv_tma=False))[1]
        loops[persistent] = [len(b) for b in _step_loops(main)]
        if persistent:
            assert main.spill_instructions == 0 and main.stack == 0, (main.spill_instructions, main.stack)
    print(f"\n192/128 {variant}: step loops grid {loops[False]}, persistent {loops[True]}")
    assert len(loops[True]) == 2 and all(abs(a - b) <= 4 for a, b in zip(loops[False], loops[True])), loops


# The 128-row step (configs.VARIANTS m128, bwd_sm90_m128.py) on the GPU tests' other specializations, triton 3.6:
# no spill and no stack anywhere, 40 HGMMA a warpgroup's step loop (S 8, dP 8, dV 8, dK 8, dQ 8 of 64x64x16), five
# wgmma waits a step, dQ by TMA reduce-add, 224 KB of shared memory with or without a score_mod (f' in the dS tile).
M128_CASES = {   # id: (variant, Z, HQ, HKV, M, N, KZ, dtype, grad_lse)
    "noop-ragged": ("noop", 1, 2, 2, 1000, 777, None, torch.bfloat16, False),
    "causal": ("causal", 2, 4, 2, 1000, 1000, None, torch.bfloat16, False),
    "softcap": ("softcap", 2, 4, 2, 1000, 1000, None, torch.bfloat16, False),
    "alibi": ("alibi", 2, 4, 2, 1000, 1000, None, torch.bfloat16, False),
    "alibi-causal": ("alibi-causal", 1, 4, 4, 384, 384, None, torch.bfloat16, False),
    "document": ("document", 1, 2, 2, 900, 900, None, torch.bfloat16, False),
    "gqa4-kv-batch-1-causal": ("causal", 2, 8, 2, 384, 384, 1, torch.bfloat16, False),
    "fp16-causal": ("causal", 1, 2, 2, 500, 400, None, torch.float16, False),
    "lse-grad-softcap-causal": ("softcap-causal", 1, 2, 2, 300, 300, None, torch.bfloat16, True),
}


@pytest.mark.parametrize("case", sorted(M128_CASES))
def test_m128_compiles_without_spills(case):
    from torch.nn.attention.flex_attention import create_block_mask

    from fa3_inductor.templates.aot import sass_report
    from fa3_inductor.templates.hopper_bwd import compile_hopper_backward, get_bwd_config
    from fa3_inductor.templates.hopper_bwd.configs import VARIANTS

    variant, Z, HQ, HKV, M, N, KZ, dtype, grad_lse = M128_CASES[case]
    D = 64
    cfg = get_bwd_config(D, **VARIANTS["m128"])
    if variant == "document":
        doc = mods.document((torch.arange(M) // 300).to(torch.int32))
        bm = create_block_mask(doc, None, None, M, N, device="cpu")
        fn, bufs, _ = _gl_mod(doc, "mask")
        opts = dict(mask_mod=fn, mask_bufs=bufs, kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices,
                    full_kv_num_blocks=bm.full_kv_num_blocks, full_kv_indices=bm.full_kv_indices)
    else:
        opts = {}
        for part in variant.split("-"):
            opts.update(_options(part, M, N))
    q = torch.randn(Z, HQ, M, D, dtype=dtype)
    k = v = torch.randn(KZ or Z, HKV, N, D, dtype=dtype)
    if grad_lse:
        opts["grad_lse"] = torch.randn(Z, HQ, M)
    _, ck, _ = compile_hopper_backward(q, k, v, torch.empty_like(q), torch.empty_like(q), torch.empty(Z, HQ, M),
                                       sm_scale=D ** -0.5, config=cfg, **opts)
    main = sass_report(ck)
    loops = _step_loops(main)
    print(f"\nm128 {case}: {main.spill_instructions} spills, stack {main.stack}, loops {[len(b) for b in loops]}, "
          f"shared {main.shared}")
    assert main.spill_instructions == 0 and main.stack == 0, (main.spill_instructions, main.stack)
    assert len(loops) == 2, [len(b) for b in loops]
    for body in loops:
        assert sum("HGMMA" in t for t in body) == 40, sum("HGMMA" in t for t in body)
        assert sum("WARPGROUP.DEPBAR" in t for t in body) == 5
    assert "UTMAREDG" in main.sass and "REDG" not in main.sass.replace("UTMAREDG", ""), "dQ not by TMA reduce"
    assert {cfg.consumer_regs, cfg.producer_regs} <= main.setmaxnreg
    assert cfg.smem_bytes(D) <= main.shared <= SMEM_LIMIT


# The host's schedule at D128 (configs._GRAD_MOD_TABLE): a score_mod whose derivative is not 1 (softcap) takes
# overlap 1 when no mask_mod is compiled in (block-sparse tables or not), and compiles with no spill; with a mask_mod
# (softcap + causal: 40 spill instructions with overlap 1, 10 in a step loop) and for ALiBi (derivative 1) it keeps
# the table's overlap 2 (softcap + causal also the persistent schedule of masked launches: 48 spill instructions,
# none in a step loop; 37 in grid order). The launch's main kernel is compared, SASS for SASS, with the one of the
# explicit config.
GRAD_MOD_DEFAULTS = {"softcap": 1, "softcap+blocks": 1, "softcap+causal": 2, "alibi": 2}


@pytest.mark.parametrize("variant", sorted(GRAD_MOD_DEFAULTS))
def test_grad_mod_default_schedule(variant):
    from fa3_inductor.templates.aot import sass_report
    from fa3_inductor.templates.hopper_bwd import compile_hopper_backward, get_bwd_config

    D, M, N = 128, 1000, 1000
    overlap = GRAD_MOD_DEFAULTS[variant]
    assert get_bwd_config(D, grad_mod=True).overlap == 1 and get_bwd_config(D).overlap == 2
    q = torch.randn(2, 4, M, D, dtype=torch.bfloat16)
    k = v = torch.randn(2, 2, N, D, dtype=torch.bfloat16)
    args = (q, k, v, torch.empty_like(q), torch.empty_like(q), torch.empty(2, 4, M))
    opts = _combined_options(variant, M, N)
    main = sass_report(compile_hopper_backward(*args, sm_scale=D ** -0.5, **opts)[1])
    # a mask_mod's launch (overlap 2) also takes the persistent schedule (configs.PERSISTENT_HEAD_DIMS)
    ref = sass_report(compile_hopper_backward(*args, sm_scale=D ** -0.5, config=get_bwd_config(
        D, overlap=overlap, persistent="causal" in variant), **opts)[1])
    loops = _step_loops(main)
    print(f"\nD{D} {variant} default (overlap {overlap}): {main.spill_instructions} spills, stack {main.stack}, "
          f"loops {[len(b) for b in loops]}")
    assert main.sass == ref.sass, f"the default is not overlap {overlap}"
    assert not any("LDL" in t or "STL" in t for body in loops for t in body), "spill in a step loop"
    if overlap == 1:
        assert main.spill_instructions == 0 and main.stack == 0, (main.spill_instructions, main.stack)


def _main_kernel(D, variant, **config):
    """SassReport of the main kernel of a small ragged launch (B 2, HQ 4, HKV 2, M = N = 1000, bf16) with _options'
    mods for ``variant`` and get_bwd_config(D, **config)."""
    from fa3_inductor.templates.aot import sass_report
    from fa3_inductor.templates.hopper_bwd import compile_hopper_backward, get_bwd_config

    M, N = 1000, 1000
    q = torch.randn(2, 4, M, D, dtype=torch.bfloat16)
    k = v = torch.randn(2, 2, N, D, dtype=torch.bfloat16)
    return sass_report(compile_hopper_backward(q, k, v, torch.empty_like(q), torch.empty_like(q), torch.empty(2, 4, M),
                                               sm_scale=D ** -0.5, **_options(variant, M, N),
                                               config=get_bwd_config(D, **config))[1])


# modgen.ModInfo.finite: softcap's derivative is finite wherever S is, so the kernels drop the select that keeps a
# non-finite f' out of masked scores (P = 0): the default step loop (D128: overlap 1), triton 3.6, M = N = 1000, from
# 647 (D64) and 835 (D128) with the select.
FINITE_GRAD_STEP_LOOP = {64: 583, 128: 761}


@pytest.mark.parametrize("D", sorted(FINITE_GRAD_STEP_LOOP))
def test_finite_score_grad_drops_the_select(D):
    loops = _step_loops(_main_kernel(D, "softcap", grad_mod=True))
    print(f"\nD{D} softcap: step loops {[len(b) for b in loops]}")
    assert max(map(len, loops)) <= FINITE_GRAD_STEP_LOOP[D], [len(b) for b in loops]


def _wgmmas_before_read(body):
    """Each unpredicated global load (LDG: the LSE / DELTA rows) of a step loop and the number of wgmma
    instructions (HGMMA) issued between it and the first read of its register, going round the loop (ptxas may
    rotate it, so the body's first line is not the step's)."""
    out = []
    for i, text in enumerate(body):
        m = re.match(r"LDG\S*\s+(R\d+),", text)
        if not m:
            continue
        reg = re.compile(rf"\b{m.group(1)}\b")
        n = len(body)
        first = next((k for k in range(1, n) if "," in body[(i + k) % n]
                      and reg.search(body[(i + k) % n].split(",", 1)[1])), n)
        out.append(sum("HGMMA" in body[(i + k) % n] for k in range(1, first)))
    return out


# configs.BwdSm90Config.stats_ahead: LSE and DELTA (2 rows a thread each: 4 loads a step) are loaded a step ahead,
# with the step's dK and dQ wgmmas (and the next S) between the load and its read; where they are used, 0-8 wgmmas
# at D = 64, 3-12 at D = 128 (triton 3.6). (loads, wgmmas): at least that many stats loads have that many wgmmas
# before their read. At D = 128 (the overlap under dK) only DELTA moved: LSE was already loaded before the next S.
STATS_AHEAD = {(64, "noop"): (4, 12), (64, "causal"): (4, 12), (64, "softcap"): (4, 12), (128, "noop"): (2, 24)}


@pytest.mark.parametrize("D, variant", sorted(STATS_AHEAD))
def test_stats_loaded_a_step_ahead(D, variant):
    loads, wgmmas = STATS_AHEAD[D, variant]
    for ahead_on in (True, False):
        main = _main_kernel(D, variant, stats_ahead=ahead_on)
        for body in _step_loops(main):
            between = _wgmmas_before_read(body)
            print(f"\nD{D} {variant} stats_ahead={ahead_on}: wgmmas between a stats load and its read {between}")
            covered = sum(n >= wgmmas for n in between)
            assert (covered >= loads) if ahead_on else (covered < loads), between


# configs.BwdSm90Config.p_regs (the in-order step): dS from P (times f') held in fp32 registers across the dP wgmma.
# The step loop then reads nothing back from shared memory (LDS: P, f'), spills nothing, and is shorter (no 16-bit
# unpacking): triton 3.6, M = N = 1000, p_regs off -> on: noop 467 -> 418, causal 595 -> 542, softcap 772 -> 647,
# document 716 -> 668 instructions (the longer of the two loops). D128's overlap carries P from the step that made
# it, in fp32 without a mod or mask (noop 536 -> 484), else P (times f') in 16 bits (softcap, overlap 1: 835 -> 770;
# causal 648 -> 644; ALiBi 672 -> 668).
P_REGS_CASES = {(64, "noop"): {}, (64, "causal"): {}, (64, "softcap"): {}, (64, "document"): {},
                (64, "causal+persistent"): {"persistent": True}, (128, "noop+serial"): {"overlap": 0},
                (128, "noop"): {}, (128, "causal"): {}, (128, "alibi"): {}, (128, "softcap"): {"overlap": 1}}


@pytest.mark.parametrize("D, case", sorted(P_REGS_CASES))
def test_p_regs_step_reads_no_shared_memory(D, case):
    loops = {}
    for p_regs in (False, True):
        main = _main_kernel(D, case.split("+")[0], p_regs=p_regs, **P_REGS_CASES[D, case])
        loops[p_regs] = _step_loops(main)
        shared_loads = [sum(t.startswith("LDS") for t in body) for body in loops[p_regs]]
        print(f"\nD{D} {case} p_regs={p_regs}: loops {[len(b) for b in loops[p_regs]]}, LDS {shared_loads}, "
              f"{main.spill_instructions} spills")
        assert main.spill_instructions == 0 and main.stack == 0
        assert (sum(shared_loads) == 0) == p_regs, shared_loads
    # no longer than the step that reads P back (D128 causal, P carried in 16 bits: as long, 639, since dQ's staging
    # in fragment order; elsewhere shorter)
    assert max(map(len, loops[True])) <= max(map(len, loops[False]))


# Head dims 80 and 96 (configs.PADDED_HEAD_DIMS) run D128's tiles, TMA filling the columns past D with zeros: the
# same step loops as D128 with dQ's tiled staging (triton 3.6, M = N = 1000: D96 noop 484 / 465, D80 causal 644 / 633;
# D128's default stages dQ in fragment order, which needs whole 64-column chunks), wgmmas of 128 columns, dK / dV
# stored at D's stride.
# The persistent schedule sizes its K / V buffers by the tiles' 128 columns (a second pair would need 279 KB).
@pytest.mark.parametrize("D, variant", [(96, "noop"), (80, "causal"), (96, "causal+persistent")])
def test_padded_head_dims_run_the_128_tiles(D, variant):
    config = {"persistent": True} if variant.endswith("+persistent") else {}
    padded, d128 = (_main_kernel(d, variant.split("+")[0], dq_frag=False, **config) for d in (D, 128))
    assert _main_kernel(D, variant.split("+")[0], **config).sass == padded.sass   # the host keeps it tiled at 80 / 96
    loops = [len(b) for b in _step_loops(padded)]
    print(f"\nD{D} {variant}: loops {loops}, {padded.spill_instructions} spills, shared {padded.shared}")
    assert loops == [len(b) for b in _step_loops(d128)]
    assert padded.spill_instructions == d128.spill_instructions and padded.shared == d128.shared <= SMEM_LIMIT
    assert "HGMMA.64x64x16.F32.BF16" in padded.sass


def test_padded_head_dims_refuse_atomic_dq():
    """dQ's 128-column tiles are clipped to D by the TMA reduce-add; the atomics would write past D."""
    from fa3_inductor.templates.hopper_bwd import compile_hopper_backward, get_bwd_config

    q = torch.randn(1, 2, 128, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dq_tma=True"):
        compile_hopper_backward(q, q, q, q, q, torch.empty(1, 2, 128), sm_scale=0.1,
                                config=get_bwd_config(96, dq_tma=False))


# 160 and 192 for q, k and v (configs.PADDED_WIDE_PAIRS) run the wide kernel's 256 tiles the same way: D256's step
# loops, less a dQ chunk wholly past D (triton 3.6, M = N = 1000: 192 noop 423 / 472 instructions against 476 / 472,
# HGMMA 92 against 96), D256's shared memory, no spill.
@pytest.mark.parametrize("D, variant", [(192, "noop"), (160, "causal")])
def test_padded_wide_head_dims_run_the_256_tiles(D, variant):
    padded, d256 = _main_kernel(D, variant), _main_kernel(256, variant)
    print(f"\nD{D} {variant}: loops {[len(b) for b in _step_loops(padded)]}, HGMMA {padded.hgmma}, "
          f"{padded.spill_instructions} spills, shared {padded.shared}")
    assert padded.spill_instructions == 0 and padded.stack == 0 and padded.shared == d256.shared <= SMEM_LIMIT
    assert 0 < padded.hgmma < d256.hgmma


# Deterministic dQ (bwd_sm90.py, "Deterministic dQ"), sm90, triton 3.6, M = N = 1000: spill instructions of the whole
# main kernel (none in a step loop; the default launches' own are in DEFAULT_SPILLS). The counters' release reads
# %laneid: %tid.x read in an asm there made ptxas spill 67 (noop D128), 18 of them in the step loops.
DETERMINISTIC_SPILLS = {(64, "causal"): 22, (64, "sliding_window"): 22, (128, "causal"): 4, (128, "softcap"): 4,
                        (128, "sliding_window"): 4}


@pytest.mark.parametrize("variant", ["noop", "causal", "softcap", "sliding_window"])
@pytest.mark.parametrize("D", [64, 128])
def test_deterministic_compiles_the_ordered_adds(D, variant):
    """The spin on the counter (LDG.STRONG.GPU) and its release (REDG.ADD.STRONG.GPU after MEMBAR.GPU) inside the
    step loops, the reduce-add still by TMA, and no spill in a step loop."""
    from fa3_inductor.templates.aot import sass_report
    from fa3_inductor.templates.hopper_bwd import compile_hopper_backward

    M, N = 1000, 1000
    q = torch.randn(2, 4, M, D, dtype=torch.bfloat16)
    k = v = torch.randn(2, 2, N, D, dtype=torch.bfloat16)
    kernels = compile_hopper_backward(q, k, v, torch.empty_like(q), torch.empty_like(q), torch.empty(2, 4, M),
                                      sm_scale=D ** -0.5, deterministic=True, **_options(variant, M, N))
    assert len(kernels) == (3 if variant in ("noop", "softcap") else 5)   # the order table's two launches under a mask
    main = sass_report(kernels[-2])
    loops = main.loops_with("HGMMA")
    print(f"\nD{D} {variant} deterministic: {main.spill_instructions} spill instructions, step loops "
          f"{[len(b) for b in loops]}")
    assert main.spill_instructions <= DETERMINISTIC_SPILLS.get((D, variant), 0), main.spill_instructions
    steps = [body for body in loops if any("UTMAREDG" in t for t in body)]   # (ptxas lays D64's out twice)
    assert len(steps) in (2, 4), [len(b) for b in loops]
    for body in steps:
        text = "\n".join(body)
        assert not any("LDL" in t or "STL" in t for t in body), "a spill in a step loop"
        assert "LDG.E.STRONG.GPU" in text and "REDG.E.ADD.S32.STRONG.GPU" in text and "MEMBAR.ALL.GPU" in text


@pytest.mark.parametrize("variant", ["noop", "causal", "softcap", "document"])
@pytest.mark.parametrize("dims", [(256, 256), (192, 128)], ids=["d256", "d192-128"])
def test_deterministic_wide_compiles_the_ordered_adds(dims, variant):
    """bwd_sm90_wide.py with deterministic dQ: the counters' spin and release in the step loops, no spill in a step
    loop but the documents' (3 reloads at D256, as its kernel's tables row a step)."""
    from fa3_inductor.templates.aot import sass_report
    from fa3_inductor.templates.hopper_bwd import compile_hopper_backward

    D, DV = dims
    M, N = 1000, 1000
    q = torch.randn(2, 4, M, D, dtype=torch.bfloat16)
    k = torch.randn(2, 2, N, D, dtype=torch.bfloat16)
    v = torch.randn(2, 2, N, DV, dtype=torch.bfloat16)
    o = torch.empty(2, 4, M, DV, dtype=torch.bfloat16)
    kernels = compile_hopper_backward(q, k, v, o, o, torch.empty(2, 4, M), sm_scale=D ** -0.5, deterministic=True,
                                      **_options(variant, M, N))
    main = sass_report(kernels[-2])
    loops = main.loops_with("HGMMA")
    in_loops = sum("LDL" in t or "STL" in t for body in loops for t in body)
    assert in_loops <= (3 if (D, variant) == (256, "document") else 0), in_loops
    steps = [body for body in loops if any("UTMAREDG" in t for t in body)]
    assert steps and all("LDG.E.STRONG.GPU" in "\n".join(b) and "REDG.E.ADD.S32.STRONG.GPU" in "\n".join(b)
                         for b in steps)
