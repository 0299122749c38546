"""Context parallelism on the CPU: 2 and 4 gloo ranks against one float64 single-process run.

Each world size forks its ranks once and runs every case there (forked ranks share the parent's
imports: four spawned interpreters would spend ~25 s importing on CI's two cores; the parent also
imports the compiler, which each rank's first compile would otherwise import); a case's result per
rank is None or the failure, read back from a JSON file per rank. Most cases run the ring on the
dense kernel (torch ops); ``real_kernel`` runs our generic kernel under Triton's interpreter,
forward and backward (small B and H: the interpreter's cost grows with them). ``bench_dist`` runs
``benchmarks/ring_attention.py dist`` on the same gloo group. The FP8 cases (``test_fp8_two_ranks``)
run the FP8 path per ring step (inference, interpreter) against ``flex(fp8=)`` on the whole
sequence and float64. Inputs are fresh random numbers per session (one seed, given to every
rank); tolerances are the README's rule (tests/reference.py), FP8's where stated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import importlib.util
import io
import json
import os
import random
import tempfile
import traceback
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from reference import (FP8_TOLERANCE, TOLERANCE, assert_lse_matches, reference_attention,
                       reference_gradients, rel_error)

B, H, D, T = 2, 4, 16, 32          # T: global length (16 per rank on 2 ranks, 8 on 4)
_SPAWN_TIMEOUT_S = 120
_BENCH = _SDPA = None              # set before forking: the benchmark module, torch's SDPA


def _doc_ids() -> torch.Tensor:
    return torch.tensor([0] * 11 + [1] * 14 + [2] * 7)


@dataclasses.dataclass(frozen=True)
class Case:
    """One ring case: mods, K/V heads, method, layout, shard kernel, shapes, LSE in the loss."""

    mask_mod: Optional[Callable]
    score_mod: Optional[Callable]
    kv_heads: int = H
    method: str = "ring"
    head_tail: bool = True
    kernel: str = "dense"
    batch: int = B
    heads: int = H
    lse_grad: bool = False


def _case(name: str) -> Case:
    from fa3_inductor import mods

    causal = mods.causal
    return {
        "causal": Case(causal, None),
        "document": Case(mods.document(_doc_ids()), None),
        "sliding_window": Case(mods.sliding_window(6), None),
        "softcap": Case(causal, mods.softcap(2.0)),
        "gqa": Case(causal, mods.alibi(H), kv_heads=2),
        "lse_grad": Case(mods.document(_doc_ids()), mods.softcap(2.0), kv_heads=2, lse_grad=True),
        "allgather_gqa": Case(causal, mods.softcap(2.0), kv_heads=2, method="allgather"),
        "allgather_document": Case(mods.document(_doc_ids()), None, method="allgather"),
        "allgather_window": Case(mods.sliding_window(6), None, method="allgather", lse_grad=True),
        "contiguous": Case(causal, None, head_tail=False),
        "no_mask": Case(None, mods.relative_bias),
        # our generic kernel under the interpreter: its cost grows with B x H, so they are small
        "real_kernel": Case(causal, mods.softcap(2.0), kv_heads=1, kernel="fa3", batch=1, heads=2),
    }[name]


def _inputs(seed: int, case: Case):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(case.batch, case.heads, T, D, generator=g)
    k, v = (torch.randn(case.batch, case.kv_heads, T, D, generator=g) for _ in range(2))
    dout = torch.randn(case.batch, case.heads, T, D, generator=g)
    return q, k, v, dout, torch.randn(case.batch, case.heads, T, generator=g)


def _check(what: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    err = (got.double() - ref).norm().item() / max(ref.norm().item(), 1e-30)
    assert err <= TOLERANCE[torch.float32], f"{what}: relative error {err:.2e}"


def _reference(case: Case, q, k, v, dout, dlse):
    """Float64 out, lse, dq, dk, dv of the whole sequence (LSE in the loss when the case asks)."""
    if not case.lse_grad:
        ref, dq, dk, dv, _ = reference_gradients(q, k, v, dout, case.score_mod, case.mask_mod)
        _, ref_lse = reference_attention(q, k, v, case.score_mod, case.mask_mod)
        return ref, ref_lse, dq, dk, dv
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = reference_attention(*leaves, case.score_mod, case.mask_mod)
    loss = (ref * dout.double()).sum() + (torch.where(ref_lse.isinf(), 0.0, ref_lse) * dlse).sum()
    return (ref.detach(), ref_lse.detach(), *torch.autograd.grad(loss, leaves))


def _run_ring_case(name: str, rank: int, world: int, seed: int) -> None:
    from fa3_inductor.distributed import SeqLayout, ring_flex, stats

    case = _case(name)
    q, k, v, dout, dlse = _inputs(seed, case)
    layout = SeqLayout(world, head_tail=case.head_tail)
    shards = [layout.shard(t, 2, rank).requires_grad_() for t in (q, k, v)]
    before = stats()
    out, lse = ring_flex(*shards, case.score_mod, case.mask_mod, layout=layout,
                         enable_gqa=case.kv_heads != case.heads, return_lse=True,
                         method=case.method, kernel=case.kernel)
    loss = (out * layout.shard(dout, 2, rank)).sum()
    if case.lse_grad:
        loss = loss + (torch.where(lse.isinf(), 0.0, lse) * layout.shard(dlse, 2, rank)).sum()
    with _no_forward():
        loss.backward()
    if case.kernel == "fa3":   # our backward family served every step (not a dense fallback)
        from fa3_inductor.runtime.ops_bwd import last_backward_family

        assert last_backward_family() == "generic_bwd", last_backward_family()
    ref, ref_lse, dq, dk, dv = _reference(case, q, k, v, dout, dlse)
    _check("out", out, layout.shard(ref, 2, rank))
    assert_lse_matches(lse, layout.shard(ref_lse, 2, rank), torch.float32)
    for what, got, want in (("dq", shards[0].grad, dq), ("dk", shards[1].grad, dk),
                            ("dv", shards[2].grad, dv)):
        _check(what, got, layout.shard(want, 2, rank))
    if name == "contiguous" and rank == 0:
        # causal, contiguous: rank 0's queries precede every other shard's keys: skipped
        skipped = stats()["skipped"] - before["skipped"]
        want = 2 * (world - 1)
        assert skipped == want, f"rank 0 skipped {skipped} steps, expected {want}"


@contextlib.contextmanager
def _no_forward():
    """Inside: any shard attention forward (dense, or our kernel through flex()) raises: the ring's
    backward takes the merged O and LSE and must not recompute a step's forward."""
    import fa3_inductor.api as api
    from fa3_inductor.distributed import ring, shard_attention

    def refuse(*args, **kwargs):
        raise AssertionError("the ring's backward ran an attention forward")

    saved = ring.shard_attention, shard_attention._dense, api.flex
    ring.shard_attention = shard_attention._dense = api.flex = refuse
    try:
        yield
    finally:
        ring.shard_attention, shard_attention._dense, api.flex = saved


def _run_context_parallel_case(name: str, rank: int, world: int, seed: int) -> None:
    """torch's context_parallel API: SDPA eager, flex_attention under torch.compile("fa3")."""
    import torch.nn.attention.flex_attention as flex_module
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from fa3_inductor import mods
    from fa3_inductor.distributed import SeqLayout, context_parallel

    mesh = init_device_mesh("cpu", (world,))
    q, k, v, _, _ = _inputs(seed, Case(None, None))
    if name == "cp_sdpa":
        mask_mod, score_mod = mods.causal, None

        def model(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        mask_mod, score_mod = mods.document(_doc_ids()), mods.softcap(2.0)
        block_mask = flex_module.create_block_mask(mask_mod, None, None, T, T, device="cpu")

        def attend(q, k, v):   # the call graph-breaks into ring_flex (no Inductor graph to build)
            return flex_module.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
        model = torch.compile(attend, backend="fa3")
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1))
    ref, dq, dk, dv, _ = reference_gradients(q, k, v, dout, score_mod, mask_mod)
    layout = SeqLayout(world)
    buffers = [q.clone(), k.clone(), v.clone()]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2], kernel="dense"):
        assert buffers[0].shape[2] == T // world, "torch's context_parallel did not shard in place"
        leaves = [b.detach().requires_grad_() for b in buffers]
        out = model(*leaves)
        out.backward(layout.shard(dout, 2, rank))
    for what, got, want in (("out", out, ref), ("dq", leaves[0].grad, dq),
                            ("dk", leaves[1].grad, dk), ("dv", leaves[2].grad, dv)):
        _check(what, got, layout.shard(want, 2, rank))
    assert F.scaled_dot_product_attention is _SDPA and buffers[0].shape[2] == T
    if name == "cp_sdpa":   # an error inside the context still restores torch's SDPA and buffers
        with pytest.raises(NotImplementedError, match="attn_mask"):
            with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
                F.scaled_dot_product_attention(*buffers, attn_mask=torch.ones(T, T).bool())
        assert F.scaled_dot_product_attention is _SDPA and torch.equal(buffers[0], q)


def _hand_written(mask: str, head_dim: int = D):
    """Attention written out (softmax(q kᵀ) v), its mask from positions: what recognition finds.
    ``document`` reads a per-position id tensor (its 4th argument), which a rank holds only for
    its own shard."""
    def attend(q, k, v, ids=None):
        S = q.shape[-2]
        s = (q @ k.transpose(-2, -1)) * head_dim ** -0.5
        i = torch.arange(S, device=q.device)
        d = i[:, None] - i[None, :]
        keep = {"causal": d >= 0, "window": (d >= 0) & (d < 6),
                "document": None if ids is None else ids[:, None] == ids[None, :]}[mask]
        s = s.masked_fill(~keep, float("-inf"))
        return torch.softmax(s, dim=-1) @ v
    return attend


def _run_cp_manual_case(rank: int, world: int, seed: int, kernel: str = "dense") -> None:
    """A compiled model whose attention recognition finds (hand-written causal and sliding-window
    attention, SDPA bound before the context: three sites of one graph, one compile) runs ring
    attention inside context_parallel: each output and the gradients against the unsharded float64
    reference. The graph is compiled and run outside the context first (on one shard: local
    attention, as written), then the same graph runs inside (its backward after the context is
    left). A site the ring cannot make exact (a mask read from per-position ids) raises."""
    from torch.distributed.device_mesh import init_device_mesh

    from fa3_inductor import mods
    from fa3_inductor.distributed import SeqLayout, context_parallel

    mesh = init_device_mesh("cpu", (world,))
    layout = SeqLayout(world)
    case = Case(None, None) if kernel == "dense" else Case(None, None, kv_heads=2, batch=1, heads=2)
    q, k, v, dout, _ = _inputs(seed, case)
    causal, window, sdpa = _hand_written("causal"), _hand_written("window"), _SDPA
    masks = (mods.causal, mods.sliding_window(6), mods.causal)

    def three_sites(q, k, v):   # (SDPA: bound before the context patches F's attribute)
        return causal(q, k, v), window(q, k, v), sdpa(q, k, v, is_causal=True)

    model = torch.compile(three_sites, backend="fa3", dynamic=False)
    local = [layout.shard(t, 2, rank) for t in (q, k, v)]
    for got, mask_mod in zip(model(*local), masks):   # outside: within what it is given
        _check("outside the context", got, reference_attention(*local, None, mask_mod)[0])
    grads = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    refs = []
    for mask_mod in masks:
        ref, *site_grads, _ = reference_gradients(q, k, v, dout, None, mask_mod)
        refs.append(ref)
        grads = [g + s for g, s in zip(grads, site_grads)]
    buffers = [q.clone(), k.clone(), v.clone()]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2], kernel=kernel):
        # (copies: leaving the context restores the buffers in place)
        leaves = [b.detach().clone().requires_grad_() for b in buffers]
        outs = model(*leaves)
    # backward after the context is left: the ring sites keep the context of their forward
    torch.autograd.backward(outs, [layout.shard(dout, 2, rank)] * 3)
    if kernel == "fa3":
        from fa3_inductor.runtime.ops_bwd import last_backward_family

        assert last_backward_family() == "generic_bwd", last_backward_family()
    for name, out, ref in zip(("causal", "window", "sdpa"), outs, refs):
        _check(f"{name} out", out, layout.shard(ref, 2, rank))
    for what, leaf, want in zip(("dq", "dk", "dv"), leaves, grads):
        _check(what, leaf.grad, layout.shard(want, 2, rank))
    if kernel != "dense":
        return
    model = torch.compile(_hand_written("document"), backend="fa3", dynamic=False)
    buffers = [q.clone(), k.clone(), v.clone(), _doc_ids()]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 0], kernel="dense"):
        with pytest.raises(NotImplementedError, match="sequence-shard length"):
            model(*buffers)


# ---------------------------------------------------------------- FP8 (inference, interpreter)
#
# B1 H2 D64 bf16, T = 128 on 2 ranks: 64 per rank in head-tail pieces of 32. Tolerances:
# - against float64 on the unquantized inputs: FP8_TOLERANCE (tests/reference.py; measured 3-4%
#   here, as flex(fp8=) itself on the whole sequence) for the output; the LSE (natural log, from
#   the unrounded P: only Q/K quantization moves it, measured <= 7e-2) to FP8_TOLERANCE absolute,
#   a 10% error in the row's softmax denominator;
# - against flex(fp8=same recipe) on the whole sequence: the output to FP8_TOLERANCE too, not
#   bf16's: both round P to e4m3 (3 mantissa bits) relative to their own running row maxima (a
#   ring step's shard against the whole row) and, unless the recipe's blocks align with the
#   shards' pieces, quantize q/k/v in different blocks: two independent FP8 roundings of one
#   result (measured 0.6-2.7%). With blocks of 32 (``fp8_causal``: the pieces' length) every
#   block of q, k and v is the same set of tokens in both runs, so Q/K quantize identically and
#   the LSE, which the kernel sums from the unrounded P, agrees to float32 rounding (1e-4; measured
#   5e-7): the merge of per-shard FP8 LSEs is exact.
FP8_T, FP8_D, FP8_H = 128, 64, 2


def _fp8_case(name: str) -> dict:
    from fa3_inductor import FP8Recipe, mods

    return {
        "fp8_causal": dict(recipe=FP8Recipe(block_m=32, block_n=32), kv_heads=2, aligned=True),
        "fp8_softcap_gqa": dict(recipe=True, kv_heads=1, score_mod=mods.softcap(20.0)),
        # K shifted by +-1.5 per head-tail piece so that the two ranks' K means differ: an
        # uncorrected merge of smooth_k shards is off by 24-68% (output) and ~4 (LSE) here
        "fp8_smooth_k": dict(recipe=FP8Recipe(smooth_k=True), kv_heads=2, k_offsets=True),
        "fp8_rope": dict(recipe=True, kv_heads=1, rope=True),
    }[name]


def _fp8_inputs(seed: int, kv_heads: int, k_offsets: bool = False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, FP8_H, FP8_T, FP8_D, generator=g)
    k, v = (torch.randn(1, kv_heads, FP8_T, FP8_D, generator=g) for _ in range(2))
    if k_offsets:   # pieces 0 and 3 (rank 0's) +1.5, pieces 1 and 2 (rank 1's) -1.5
        piece = FP8_T // 4
        k += torch.tensor([1.5, -1.5, -1.5, 1.5]).repeat_interleave(piece).view(1, 1, -1, 1)
    return tuple(t.to(torch.bfloat16) for t in (q, k, v))


def _check_fp8(what: str, out, lse, ref, ref_lse, out_tol: float, lse_tol: float) -> None:
    err = rel_error(out, ref)
    assert err <= out_tol, f"{what}: output relative error {err:.3e} > {out_tol:.0e}"
    lse, ref_lse = lse.double(), ref_lse.double()
    assert torch.equal(lse.isneginf(), ref_lse.isneginf()), f"{what}: fully masked rows differ"
    finite = ~ref_lse.isinf()
    lse_err = (lse[finite] - ref_lse[finite]).abs().max().item()
    assert lse_err <= lse_tol, f"{what}: LSE max abs error {lse_err:.3e} > {lse_tol:.0e}"


def _fp8_rope_specs():
    """(the RopeSpec with positions 5 .. T+4 over the whole sequence, the one with table rows
    0 .. T-1 and no positions)."""
    from fa3_inductor import RopeSpec

    shifted = torch.arange(FP8_T) + 5
    with_positions = RopeSpec.from_theta(FP8_D, FP8_T + 5, q_positions=shifted,
                                         k_positions=shifted)
    return with_positions, RopeSpec.from_theta(FP8_D, FP8_T)


def _run_fp8_case(name: str, rank: int, world: int, seed: int) -> None:
    """ring_flex(fp8=) against flex(fp8=) on the whole sequence and float64 (tolerances above);
    ``fp8_rope`` rotates q and k in each step's prologue at their global positions."""
    from fa3_inductor import FP8Recipe, flex, last_template, mods
    from fa3_inductor.distributed import SeqLayout, ring_flex
    from fa3_inductor.templates.fp8_prologue.reference import rotate

    case = _fp8_case(name)
    q, k, v = _fp8_inputs(seed, case["kv_heads"], case.get("k_offsets", False))
    layout = SeqLayout(world)
    score_mod, recipe, gqa = case.get("score_mod"), case["recipe"], case["kv_heads"] != FP8_H
    runs = [("ring", None)]
    if case.get("rope"):   # the ring with global positions given, all-gather with table rows
        with_positions, plain = _fp8_rope_specs()
        runs = [("ring", with_positions), ("allgather", plain)]
    for method, rope in runs:
        shards = [layout.shard(t, 2, rank) for t in (q, k, v)]
        with torch.no_grad():
            out, lse = ring_flex(*shards, score_mod, mods.causal, layout=layout, enable_gqa=gqa,
                                 return_lse=True, method=method, fp8=recipe, rope=rope)
            assert last_template() in ("fp8", "hopper_fp8"), last_template()
            whole, whole_lse = flex(q, k, v, score_mod=score_mod, mask_mod=mods.causal,
                                    enable_gqa=gqa, return_lse=True, fp8=recipe, rope=rope)
        # RoPE alone in float64 (no rotation: the reference is the exact result)
        qr, kr = (q, k) if rope is None else rotate(q, k, FP8Recipe(hadamard=False), rope)
        ref, ref_lse = reference_attention(qr, kr, v, score_mod, mods.causal)
        what = f"{name} {method}"
        _check_fp8(f"{what} vs float64", out, lse, layout.shard(ref, 2, rank),
                   layout.shard(ref_lse, 2, rank), FP8_TOLERANCE, FP8_TOLERANCE)
        # Unaligned, the ring and the whole sequence quantize different blocks: each is within FP8_TOLERANCE of
        # float64 (the ring's checked above, flex(fp8=)'s in the FP8 tests), so within twice that of each other
        # (fresh inputs once put the smooth_k LSEs 0.107 apart, the ring's inside its float64 check). Aligned
        # blocks quantize alike: the LSEs agree to 1e-4.
        aligned = case.get("aligned", False)
        mutual = FP8_TOLERANCE if aligned else 2 * FP8_TOLERANCE
        _check_fp8(f"{what} vs flex(fp8=) on the whole sequence", out, lse,
                   layout.shard(whole, 2, rank), layout.shard(whole_lse, 2, rank), mutual, 1e-4 if aligned else mutual)


def _run_fp8_errors(rank: int, world: int, seed: int) -> None:
    """What FP8 ring attention refuses, each with an error naming the option and what to do."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from fa3_inductor import FP8Recipe, RopeSpec, mods
    from fa3_inductor.distributed import SeqLayout, context_parallel, ring_flex

    layout = SeqLayout(world)
    q, k, v = (layout.shard(t, 2, rank) for t in _fp8_inputs(seed, 2))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with pytest.raises(NotImplementedError, match=r"ring_flex\(fp8=\.\.\.\) is inference-only"):
        ring_flex(*leaves, mask_mod=mods.causal, layout=layout, fp8=True)
    with pytest.raises(ValueError, match="kernel='dense' has no FP8 form"):
        ring_flex(q, k, v, layout=layout, fp8=True, kernel="dense")
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        ring_flex(q.float(), k.float(), v.float(), layout=layout, fp8=True)
    with pytest.raises(ValueError, match="smooth_k"):
        ring_flex(q, k, v, mods.softcap(20.0), layout=layout, fp8=FP8Recipe(smooth_k=True))
    local = torch.arange(q.shape[2])   # this shard's positions: not what it takes
    with pytest.raises(ValueError, match="must cover the whole sequence"):
        ring_flex(q, k, v, layout=layout, fp8=True,
                  rope=RopeSpec.from_theta(FP8_D, FP8_T, q_positions=local))
    with pytest.raises(ValueError, match="a row per global position"):
        ring_flex(q, k, v, layout=layout, fp8=True, rope=RopeSpec.from_theta(FP8_D, q.shape[2]))
    with pytest.raises(ValueError, match="rope= is applied by the FP8 prologue"):
        ring_flex(q, k, v, layout=layout, rope=RopeSpec.from_theta(FP8_D, FP8_T))
    mesh = init_device_mesh("cpu", (world,))
    full = list(_fp8_inputs(seed, 2))
    with pytest.raises(NotImplementedError,
                       match=r"context_parallel\(fp8=\.\.\.\) is inference-only"):
        with context_parallel(mesh, buffers=full, buffer_seq_dims=[2, 2, 2], fp8=True):
            F.scaled_dot_product_attention(*(b.detach().requires_grad_() for b in full),
                                           is_causal=True)
    assert F.scaled_dot_product_attention is _SDPA and full[0].shape[2] == FP8_T


def _run_cp_fp8(rank: int, world: int, seed: int) -> None:
    """context_parallel(fp8=) under no_grad: SDPA and a compiled graph's recognized site (hand-
    written causal attention) run FP8 per ring step; a graph compiled with options
    {"fa3.fp8": True} inside a context without fp8= runs its own recipe once the backend passes
    it (backend._ring_variant; until then it raises). A graph that needs gradients raises."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from fa3_inductor import last_template, mods
    from fa3_inductor.distributed import SeqLayout, context_parallel
    from fa3_inductor.runtime.ops import record_template

    mesh = init_device_mesh("cpu", (world,))
    layout = SeqLayout(world)
    q, k, v = _fp8_inputs(seed, 2)
    ref = layout.shard(reference_attention(q, k, v, None, mods.causal)[0], 2, rank)
    model = torch.compile(_hand_written("causal", FP8_D), backend="fa3", dynamic=False)
    buffers = [q.clone(), k.clone(), v.clone()]
    with torch.no_grad(), context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2],
                                           fp8=True):
        sdpa = F.scaled_dot_product_attention(*buffers, is_causal=True)
        record_template(None)
        compiled = model(*buffers)
        template = last_template()
    assert template in ("fp8", "hopper_fp8"), template
    for what, out in (("sdpa", sdpa), ("compiled site", compiled)):
        err = rel_error(out, ref)
        assert err <= FP8_TOLERANCE, f"context_parallel(fp8=True) {what}: {err:.3e}"
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2], fp8=True):
        leaves = [b.detach().requires_grad_() for b in buffers]
        with pytest.raises(NotImplementedError, match="inference-only"):
            model(*leaves)
    option_model = torch.compile(_hand_written("causal", FP8_D), backend="fa3", dynamic=False,
                                 options={"fa3.fp8": True})
    with torch.no_grad(), context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
        record_template(None)
        out = option_model(*buffers)
        template = last_template()
    assert template in ("fp8", "hopper_fp8"), template
    err = rel_error(out, ref)
    assert err <= FP8_TOLERANCE, f"options={{'fa3.fp8': True}} ring site: {err:.3e}"


def _run_bench_fp8(rank: int, world: int, out_dir: str) -> None:
    """The benchmark's FP8 rows (forward only) and its FP8 check, on our kernel (interpreter)."""
    from fa3_inductor import mods
    from fa3_inductor.distributed import SeqLayout

    bench = _BENCH
    argv = ["dist", "--device", "cpu", "--kernel", "fa3", "--per-gpu", "64", "--heads", "2",
            "--kv-heads", "1", "--head-dim", "64", "--reps", "1", "--check-per-gpu", "0",
            "--impls", "single_fp8", "ring_fp8", "allgather_fp8"]
    with contextlib.redirect_stdout(io.StringIO()):
        rows = bench.run_dist(bench.parse_args(argv), comm=bench.Comm("cpu"),
                              out_stem=Path(out_dir) / "fp8")
    # the check's FP8 part (the bf16 part's backward is slow under the interpreter): the same
    # full sequence on every rank
    check = bench._check_fp8(list(_fp8_inputs(0, 1)), mods.causal, True, SeqLayout(world),
                             bench.Comm("cpu"), "fa3")
    assert max(check.values()) <= bench.FP8_TOLERANCE, check
    if rank != 0:
        return
    by = {r["impl"]: r for r in rows}
    for impl in ("single_fp8", "ring_fp8", "allgather_fp8"):
        row = by[impl]
        assert row["status"] == "ok" and row["fwd_tflops"] > 0, row
        assert "fwdbwd_ms" not in row and row["template"] in ("fp8", "hopper_fp8"), row
    assert "| ring_fp8 |" in (Path(out_dir) / "fp8.md").read_text()


def _bench_module():
    """benchmarks/ring_attention.py as a module (it is a script, not part of the package)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "ring_attention.py"
    spec = importlib.util.spec_from_file_location("ring_attention_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_bench_case(rank: int, world: int, out_dir: str) -> None:
    """The benchmark's dist mode on this gloo group, tiny sizes, dense kernel: every row is
    recorded (torch's CP SDPA has no CPU sharding rule: an error row, not a crash), the
    correctness check passes, files are written; --budget-s 0 skips every size."""
    bench = _BENCH
    stem = Path(out_dir) / "bench"
    argv = ["dist", "--device", "cpu", "--kernel", "dense", "--per-gpu", "16", "32",
            "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--reps", "1",
            "--check-per-gpu", "8"]
    with contextlib.redirect_stdout(io.StringIO()):
        rows = bench.run_dist(bench.parse_args(argv), comm=bench.Comm("cpu"), out_stem=stem)
        skipped = bench.run_dist(bench.parse_args(argv + ["--budget-s", "0"]),
                                 comm=bench.Comm("cpu"), out_stem=Path(out_dir) / "skipped")
    if rank != 0:
        assert rows == [] and skipped == []
        return
    by = {(r["impl"], r["per_gpu"]): r for r in rows}
    assert by[("check", 8)]["status"] == "ok", by[("check", 8)]
    for per_gpu in (16, 32):
        for impl in ("single", "ring", "allgather"):
            row = by[(impl, per_gpu)]
            assert row["status"] == "ok" and row["fwd_tflops"] > 0 and row["fwdbwd_tflops"] > 0, row
        for impl in ("torch_cp_flash", "torch_cp_cudnn"):
            assert by[(impl, per_gpu)]["status"].startswith("error"), by[(impl, per_gpu)]
    assert {r["status"].split(":")[0] for r in skipped if r["impl"] != "check"} == {"skipped"}
    saved = json.loads(stem.with_suffix(".json").read_text())
    assert saved["finished"] and len(saved["rows"]) == len(rows) and saved["torch"]
    assert saved["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert "| 2 | 32 | 64 | ring |" in stem.with_suffix(".md").read_text()


def _worker(rank: int, world: int, store: str, out_dir: str, names: list, seed: int) -> None:
    torch.set_num_threads(1)   # forked from a process that may have used OpenMP
    # Forked from a pytest process whose earlier tests may have started Inductor's compile pool:
    # its threads do not exist here, and a compile handed to it would wait forever. Compile in
    # this thread instead.
    import torch._inductor.config as inductor_config
    inductor_config.compile_threads = 1
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    for name in names:
        try:
            if name.startswith("cp_manual"):
                _run_cp_manual_case(rank, world, seed, "fa3" if name.endswith("fa3") else "dense")
            elif name.startswith("cp_"):
                _run_context_parallel_case(name, rank, world, seed)
            elif name == "bench_dist":
                _run_bench_case(rank, world, out_dir)
            elif name == "bench_fp8":
                _run_bench_fp8(rank, world, out_dir)
            elif name == "fp8_errors":
                _run_fp8_errors(rank, world, seed)
            elif name == "cp_fp8":
                _run_cp_fp8(rank, world, seed)
            elif name.startswith("fp8_"):
                _run_fp8_case(name, rank, world, seed)
            else:
                _run_ring_case(name, rank, world, seed)
            results[name] = None
        except Exception as exc:  # reported per case by the test
            results[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _run_world(world: int, names: list) -> dict:
    """{case: [None or failure text per rank]} from one fork of ``world`` gloo ranks."""
    import time

    global _BENCH, _SDPA
    # imported once, before forking: the ranks' first compile would import these in each rank
    for module in ("fa3_inductor.distributed", "fa3_inductor.backend",
                   "torch._inductor.compile_fx"):
        importlib.import_module(module)
    import torch.nn.functional as F

    _BENCH, _SDPA = _bench_module(), F.scaled_dot_product_attention

    seed = random.randrange(1 << 30)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), tmp, names,
                                                seed), nprocs=world, join=False,
                                 start_method="fork")
        deadline = time.monotonic() + _SPAWN_TIMEOUT_S
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"{world} gloo ranks did not finish in {_SPAWN_TIMEOUT_S} s (seed {seed})")
        per_rank = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                per_rank.append(json.load(f))
    return {name: [res[name] for res in per_rank] for name in names}


TWO_RANKS = ["causal", "document", "sliding_window", "softcap", "gqa", "lse_grad",
             "allgather_gqa", "allgather_window", "contiguous", "no_mask", "cp_sdpa",
             "cp_flex_compiled", "cp_manual", "bench_dist"]
FOUR_RANKS = ["causal", "document", "sliding_window", "softcap", "gqa", "lse_grad",
              "allgather_document", "contiguous"]


@pytest.fixture(scope="module")
def two_ranks():
    return _run_world(2, TWO_RANKS)


@pytest.fixture(scope="module")
def four_ranks():
    return _run_world(4, FOUR_RANKS)


def _assert_ok(results: dict, name: str) -> None:
    failures = [f"rank {r}: {text}" for r, text in enumerate(results[name]) if text is not None]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", TWO_RANKS)
def test_two_ranks(two_ranks, name):
    _assert_ok(two_ranks, name)


@pytest.mark.parametrize("name", FOUR_RANKS)
def test_four_ranks(four_ranks, name):
    _assert_ok(four_ranks, name)


def test_real_kernel_two_ranks(cpu_kernels):
    """Our generic kernel (Triton interpreter) per shard, forward and backward, 2 ranks: ring_flex
    and a compiled model's recognized sites inside context_parallel."""
    results = _run_world(2, ["real_kernel", "cp_manual_fa3"])
    _assert_ok(results, "real_kernel")
    _assert_ok(results, "cp_manual_fa3")


FP8_CASES = ["fp8_causal", "fp8_softcap_gqa", "fp8_smooth_k", "fp8_rope", "fp8_errors", "cp_fp8",
             "bench_fp8"]


def test_fp8_two_ranks(cpu_kernels):
    """FP8 attention per ring step (inference; the FP8 kernel under the interpreter), 2 ranks:
    ring_flex(fp8=) causal, softcap + GQA, smooth_k, RoPE fused at global positions (ring and
    all-gather), against flex(fp8=) on the whole sequence and float64; the errors; context_parallel
    (fp8=) with SDPA and a compiled graph's site; the benchmark's FP8 rows."""
    results = _run_world(2, FP8_CASES)
    failures = [f"{name}: rank {r}: {text}" for name in FP8_CASES
                for r, text in enumerate(results[name]) if text is not None]
    assert not failures, "\n".join(failures)


def test_bench_emulate_cpu():
    """benchmarks/ring_attention.py emulate on the CPU (dense kernel, tiny, GQA): every rank's
    steps timed, forward and the backward from the merged output and LSE."""
    bench = _bench_module()
    argv = ["emulate", "--device", "cpu", "--kernel", "dense", "--world", "2", "--per-gpu", "32",
            "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--reps", "1"]
    with contextlib.redirect_stdout(io.StringIO()):
        (row,) = bench.run_emulate(bench.parse_args(argv))
    assert len(row["rank_ms"]) == len(row["rank_bwd_ms"]) == 2, row
    assert all(t > 0 for t in row["rank_ms"] + row["rank_bwd_ms"]), row
    assert row["slowest_rank_fwdbwd_tflops"] > 0 and row["template"] == "dense", row


def test_layout_matches_torch_head_tail():
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

    from fa3_inductor.distributed import SeqLayout

    for world in (2, 4):
        ours = SeqLayout(world).order(32)
        torch_order = _HeadTailLoadBalancer(32, world, "cpu")._generate_indices()[0]
        assert torch.equal(ours, torch_order.long())
        x = torch.randn(3, 32)
        lay = SeqLayout(world)
        assert torch.equal(lay.unshard([lay.shard(x, 1, r) for r in range(world)], 1), x)


def test_merge_matches_one_softmax():
    from fa3_inductor.distributed.merge import Merger

    s = torch.randn(3, 10, dtype=torch.float64)
    s[1, :6] = float("-inf")
    s[2] = float("-inf")                        # a row nothing reaches
    v = torch.randn(10, 4, dtype=torch.float64)
    m = Merger()
    for cols in (slice(0, 6), slice(6, 10)):
        lse = torch.logsumexp(s[:, cols], -1)
        m.add(torch.softmax(s[:, cols], -1).nan_to_num(0.0) @ v[cols], lse)
    out, lse = m.result(torch.float64, torch.empty(3, 4), (3,))
    ref = torch.softmax(s, -1).nan_to_num(0.0) @ v
    assert torch.allclose(out, ref) and torch.equal(lse.isneginf(), torch.tensor([False, False, True]))


@pytest.mark.parametrize("max_elements", [1 << 20])   # chunks of several block rows + a rest
def test_chunked_block_mask_matches_torch(max_elements):
    """The ring's bounded-memory block masks equal create_block_mask's, chunked or not."""
    import itertools

    from torch.nn.attention.flex_attention import create_block_mask

    from fa3_inductor import mods
    from fa3_inductor.block_masks import chunked_block_mask
    from fa3_inductor.distributed.shard_attention import ShardMods

    def per_head(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((h % 2 == 0) | (q_idx - kv_idx < 100))

    shard = ShardMods(None, mods.causal, torch.tensor([0, 384, 128, 256], dtype=torch.int32),
                      128, 128).global_mask_mod()
    doc = torch.tensor([0] * 300 + [1] * 200 + [2] * 268)
    for mask_mod, heads, m, n in ((mods.causal, 1, 300, 500), (mods.document(doc), 1, 768, 768),
                                  (mods.sliding_window(200), 1, 768, 768), (per_head, 3, 384, 640),
                                  (shard, 1, 256, 256)):
        want = create_block_mask(mask_mod, 2, heads, m, n, device="cpu")
        got = chunked_block_mask(mask_mod, torch.zeros(2, heads, m, 8), torch.zeros(2, heads, n, 8),
                                 max_elements=max_elements, reads=(True, True))
        assert got.seq_lengths == want.seq_lengths and got.BLOCK_SIZE == want.BLOCK_SIZE
        for name in ("kv", "full_kv", "q", "full_q"):
            num, idx = getattr(got, f"{name}_num_blocks"), getattr(got, f"{name}_indices")
            assert torch.equal(num, getattr(want, f"{name}_num_blocks")), (mask_mod, name)
            ref_idx = getattr(want, f"{name}_indices")
            for pos in itertools.product(*map(range, num.shape)):   # the listed blocks, in order
                n_listed = int(num[pos])
                assert torch.equal(idx[pos][:n_listed], ref_idx[pos][:n_listed]), (name, pos)
