"""Training speed of the sm90 backward (templates/hopper_bwd/): fwd+bwd and bwd alone against cuDNN / FA2 SDPA and
torch's compiled FlexAttention, on an H100 / H200.

    python benchmarks/bwd_speed.py --out benchmarks/results/bwd-speed     # writes .json and .md

Shapes: B * N = 16k tokens (B = 16384 / N), H 16, N in {2k, 4k, 8k}; head dims 64 / 96 / 128 / 256 and q/k 192 with v 128 (160 on request);
noop, causal, softcap 30, ALiBi, and block-sparse masks (sliding window 1024, causal documents of N / 4). Ours is our Hopper forward (templates/hopper) plus this backward, launched directly
through the host functions (no torch.compile); a head dim the backward does not serve is reported as such. TFLOP/s
count fwd+bwd as 3.5 forwards (forward = 4 B H M N D, halved under causal). CUDA events, warm-up, the median of
--reps rounds, each round timing every impl and schedule of the row once in turn (interleaved), each call behind a
--head-start-ms GPU sleep (GPU time: without it a short masked call also timed the host's first launches); L2 is not
flushed between repetitions (all impls alike). Peak memory is the
max_memory_allocated delta of one fwd+bwd. SDPA has no score_mod: its softcap / ALiBi cells are empty and ours
is compared with our noop. Before timing, one case is checked against a float64 reference.

Masks: ``tile_density`` is the fraction of (query block, KV block) pairs of the 128 x 128 block mask that the kernels
visit (partial and full); their TFLOP/s count the visited tiles' FLOPs (dense FLOPs x tile_density), and
``vs_tile_bound`` = our noop time x tile_density / our time: 1.0 would mean each visited tile runs as fast as a dense
one (issue 19 asks >= 0.85; mask_mod work on partial tiles is what keeps it below).

Schedule A/B of the Hopper backward (templates/hopper_bwd/configs.VARIANTS) in one run, e.g. on an H100::

    python benchmarks/bwd_speed.py --seqlens 4096 --head-dims 64 128 --variants noop causal softcap \
        --bwd-variants default atomic_dq --flex-head-dims 0 --out /root/out/bwd-ab

times our fwd+bwd and bwd alone once per named schedule, in the same process and on the same inputs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

from fa3_inductor import mods

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_host import _host_drained_us  # noqa: E402  (host µs of a call, the queue drained first)
from provenance import commit_label  # noqa: E402

LN2 = math.log(2.0)
MASKS = ("causal", "sliding_window", "document")
VARIANTS = ("noop", "causal", "softcap", "alibi", "sliding_window", "document")
HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (256, 256), (192, 128), (160, 160))


# --bwd-variants name of the deterministic backward (option fa3.deterministic_backward), beside configs.VARIANTS
DETERMINISTIC = "deterministic"


def _repeats(backward, grads, times: int = 3) -> bool:
    """Whether ``times`` runs of ``backward`` write the same bits into ``grads`` (dq, dk, dv)."""
    backward()
    first = [g.clone() for g in grads]
    same = True
    for _ in range(times - 1):
        backward()
        same = same and all(torch.equal(a, b) for a, b in zip(first, grads))
    return same


# GPU cycles per ms of the head start (H100 / H200 boost clocks are ~1.98 GHz; torch.cuda._sleep spins cycles)
SLEEP_CYCLES_PER_MS = 2_000_000


def _time_interleaved(fns: dict, rounds: int, warmup: int = 3, head_start_ms: float = 0.0) -> dict:
    """Median ms of each callable in ``fns`` over ``rounds`` rounds, each round calling every callable once
    in turn (CUDA events, a sync after each): clock or thermal drift during a row falls on all of them
    alike, where timing one callable's repetitions after another's let a single row's A/A differ by ~10%
    (bwd-speed-nvidia-h200-2026-11-29-0816, D64 4k causal). ``head_start_ms``: each call is enqueued behind a GPU
    sleep of about that long, so the events time the GPU's work and not the host's launches (a training step's
    host runs ahead of its GPU). Odd rounds run the callables in reverse order: in one fixed order two
    SASS-identical kernels read 0.3-1.8% apart, the first slower (bwd-speed-nvidia-h200-2026-11-30-1420-partition-sizes
    against -1421-partition-sizes-swapped)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict = {name: [] for name in fns}
    for r in range(rounds):
        for name, fn in (reversed(fns.items()) if r % 2 else fns.items()):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if head_start_ms:
                torch.cuda._sleep(int(head_start_ms * SLEEP_CYCLES_PER_MS))
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) for name, t in times.items()}


def _peak_mb(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def _score_mod(variant, H):
    return {"softcap": mods.softcap(30.0), "alibi": mods.alibi(H)}.get(variant)


def _mask_mod(variant, N, device="cuda"):
    """The mask_mod of a mask variant (None for the others): causal, a 1024-key causal window, causal documents of
    N / 4 positions (their ids on ``device``)."""
    if variant == "causal":
        return mods.causal
    if variant == "sliding_window":
        return mods.sliding_window(1024)
    if variant == "document":
        return mods.document((torch.arange(N, device=device) // max(N // 4, 1)).to(torch.int32))
    return None


def tile_density(block_mask) -> float:
    """Fraction of (query block, KV block) pairs a BlockMask visits (partial and full blocks), over its batch and
    heads.

    Example::

        >>> tile_density(create_block_mask(mods.causal, None, None, 1024, 1024))   # doctest: +SKIP
        0.5625
    """
    visited = block_mask.kv_num_blocks.sum()
    if block_mask.full_kv_num_blocks is not None:
        visited = visited + block_mask.full_kv_num_blocks.sum()
    n_q, n_kv = block_mask.kv_indices.shape[-2], block_mask.kv_indices.shape[-1]
    return float(visited) / (block_mask.kv_num_blocks.numel() // n_q * n_q * n_kv)


def _mod(fn, kind, dialect):
    from fa3_inductor.templates.modgen import BufferSpec, generate_mod_source, load_mod, trace_mod

    gm, bufs = trace_mod(fn, kind)
    src = generate_mod_source(gm, kind, [BufferSpec.of(b) for b in bufs], dialect)
    return load_mod(src, dialect), tuple(bufs), gm


def _our_options(variant, H, M, N, dialect="gl", device="cuda"):
    """(forward options, backward options) of our kernels for a variant; the backward's mods in
    ``dialect`` (gl: the Hopper backward, tl: the generic one); the block mask and a mask's buffers on ``device``
    (benchmarks/ncu_bwd_case.py plans on the CPU)."""
    from torch._higher_order_ops.flex_attention import create_fw_bw_graph
    from torch.nn.attention.flex_attention import create_block_mask

    from fa3_inductor.templates.generic_bwd import SCORE_GRAD_ONE
    from fa3_inductor.templates.generic_bwd import score_grad_source
    from fa3_inductor.templates.hopper_bwd import score_grad_gl
    from fa3_inductor.templates.modgen import BufferSpec, load_mod

    fwd, bwd = {}, {}
    score_mod = _score_mod(variant, H)
    if score_mod is not None:
        fn, bufs, gm = _mod(score_mod, "score", "gl")
        bwd_fn = fn if dialect == "gl" else _mod(score_mod, "score", dialect)[0]
        index_values = (torch.zeros((), requires_grad=True), *(torch.zeros((), dtype=torch.int32) for _ in range(4)))
        derive = score_grad_gl if dialect == "gl" else score_grad_source
        src = derive(create_fw_bw_graph(gm, index_values, bufs)[1], [BufferSpec.of(b) for b in bufs])
        fwd.update(score_mod=fn, score_bufs=bufs)
        bwd.update(score_mod=bwd_fn, score_bufs=bufs,
                   score_grad_mod=SCORE_GRAD_ONE if src is None else load_mod(src, dialect))
    mask_mod = _mask_mod(variant, N, device)
    if mask_mod is not None:
        bm = create_block_mask(mask_mod, None, None, M, N, device=device)
        fn, bufs, _ = _mod(mask_mod, "mask", "gl")
        bwd_fn = fn if dialect == "gl" else _mod(mask_mod, "mask", dialect)[0]
        tables = dict(kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices,
                      full_kv_num_blocks=bm.full_kv_num_blocks, full_kv_indices=bm.full_kv_indices)
        fwd.update(mask_mod=fn, mask_bufs=bufs, **tables)
        bwd.update(mask_mod=bwd_fn, mask_bufs=bufs, **tables, q_num_blocks=bm.q_num_blocks, q_indices=bm.q_indices,
                   full_q_num_blocks=bm.full_q_num_blocks, full_q_indices=bm.full_q_indices)
    return fwd, bwd


def ours(q, k, v, dout, variant, scale, backward_family="hopper", schedule="default"):
    """((fwd+bwd callable, bwd callable, (dq, dk, dv), fwd+bwd allocating its buffers afresh), None), or
    (None, why) where the backward does not serve the case. The timed callables replay prepared launches.
    ``backward_family``: "hopper" (templates/hopper_bwd) or "generic" (templates/generic_bwd, the
    plain-Triton backward with dQ in its own pass); the forward is our Hopper kernel either way. ``schedule``:
    a name of hopper_bwd.configs.VARIANTS (the Hopper backward only)."""
    from fa3_inductor.templates.generic_bwd.host import launch_generic_backward, prepare_generic_backward
    from fa3_inductor.templates.hopper import launch_fwd_sm90, prepare_fwd_sm90
    from fa3_inductor.templates.hopper_bwd import launch_hopper_backward, prepare_hopper_backward

    prepare_backward, launch_backward = {
        "hopper": (prepare_hopper_backward, launch_hopper_backward),
        "generic": (prepare_generic_backward, launch_generic_backward)}[backward_family]
    B, H, M, D = q.shape
    N, Dv = k.shape[2], v.shape[-1]
    fwd_opts, bwd_opts = _our_options(variant, H, M, N, "gl" if backward_family == "hopper" else "tl")
    if backward_family == "hopper" and schedule != "default":
        from fa3_inductor.templates.hopper_bwd import get_bwd_config
        from fa3_inductor.templates.hopper_bwd.configs import VARIANTS as SCHEDULES
        from fa3_inductor.templates.hopper_bwd.host import launch_traits

        name, _, heads = schedule.partition("@")
        if name == DETERMINISTIC:   # dQ's adds in a fixed order, on the host's config for the launch; deterministic@G:
            bwd_opts["deterministic"] = True   # launch-order groups of G heads (configs.det_heads)
            fields = {"det_heads": int(heads)} if heads else None
        else:
            fields = SCHEDULES[schedule]
        if fields is not None:   # the schedule's fields over the row the host would pick for this launch
            traits = launch_traits(bwd_opts.get("score_mod"), bwd_opts.get("score_grad_mod"), bwd_opts.get("mask_mod"),
                                   "kv_num_blocks" in bwd_opts, M)
            try:
                bwd_opts["config"] = get_bwd_config(D, Dv, **traits, **fields)
            except ValueError as e:
                return None, str(e)
    out = torch.empty(B, H, M, Dv, device="cuda", dtype=q.dtype)
    lse, mx = torch.empty(B, H, M, device="cuda"), torch.empty(B, H, M, device="cuda")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    # prepared once, as the backward's launches are: the timed call launches, it does not plan (planning
    # inside the events counted ~30 us of host a call, ~6% of a document-mask fwd+bwd)
    fwd_kernel, fwd_args, fwd_kwargs, fwd_grid = prepare_fwd_sm90(q, k, v, out, lse, mx, sm_scale=scale, **fwd_opts)

    def forward():
        fwd_kernel[fwd_grid](*fwd_args, **fwd_kwargs)

    forward()
    try:
        launches = prepare_backward(q, k, v, out, dout, lse, dq, dk, dv, sm_scale=scale, **bwd_opts)
    except ValueError as e:
        return None, str(e)

    def backward():
        for kernel, args, kwargs, grid in launches:
            kernel[grid](*args, **kwargs)

    def both():
        forward()
        backward()

    def fresh():   # what a training step allocates: out, LSE, gradients, the backward's scratch
        o = torch.empty(B, H, M, Dv, device="cuda", dtype=q.dtype)
        lse2, mx2 = torch.empty(B, H, M, device="cuda"), torch.empty(B, H, M, device="cuda")
        launch_fwd_sm90(q, k, v, o, lse2, mx2, sm_scale=scale, **fwd_opts)
        launch_backward(q, k, v, o, dout, lse2, torch.empty_like(q), torch.empty_like(k),
                        torch.empty_like(v), sm_scale=scale, **bwd_opts)

    backward()
    return (both, backward, (dq, dk, dv), fresh), None


def torch_impl(name, q, k, v, dout, variant, scale, flex_compiled):
    """(fwd+bwd callable, fwd callable) of an SDPA backend or compiled flex; None where it has no such variant."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    if name in ("cudnn", "fa2"):
        if variant not in ("noop", "causal") or q.shape[-1] != v.shape[-1] and name == "fa2":
            return None
        backend = SDPBackend.CUDNN_ATTENTION if name == "cudnn" else SDPBackend.FLASH_ATTENTION

        def fwd():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=variant == "causal",
                                                                        scale=scale)
    else:
        block_mask = None
        if _mask_mod(variant, k.shape[2]) is not None:
            block_mask = create_block_mask(_mask_mod(variant, k.shape[2]), None, None, q.shape[2], k.shape[2],
                                           device="cuda")
        score_mod = _score_mod(variant, q.shape[1])

        def fwd():
            return flex_compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)

    def both():
        out = fwd()
        torch.autograd.grad(out, (q, k, v), dout)

    try:
        both()
    except RuntimeError:
        return None
    return both, fwd


def check_once(D: int = 128, Dv: int = 128) -> float:
    """Our fwd+bwd against float64 autograd on one small softcap case at head dims D / Dv; returns the worst
    relative error."""
    sys.path.insert(0, "tests")
    from reference import rel_error, reference_gradients

    torch.manual_seed(0)
    q, k = (torch.randn(1, 2, 1000, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v, dout = (torch.randn(1, 2, 1000, Dv, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    impl, why = ours(q, k, v, dout, "softcap", D ** -0.5)
    assert impl is not None, why
    _, _, got, _ = impl
    _, dq, dk, dv, _ = reference_gradients(q, k, v, dout, mods.softcap(30.0), None, D ** -0.5)
    worst = max(rel_error(g, w) for g, w in zip(got, (dq, dk, dv)))
    assert worst <= 2e-2, f"our backward does not match float64 at D {D} / {Dv}: relative error {worst:.3e}"
    return worst


def run(args) -> list[dict]:
    from torch.nn.attention.flex_attention import flex_attention

    # a compile per shape and mod: without room for them Dynamo falls back to eager flex (slow, huge memory)
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    flex_compiled = torch.compile(flex_attention, dynamic=False)
    rows = []
    deadline = time.time() + args.budget_s
    for N in args.seqlens:
        B = args.tokens // N
        for D, Dv in HEAD_DIMS:
            if D not in args.head_dims:
                continue
            for variant in args.variants:
                torch.manual_seed(0)
                q = torch.randn(B, args.heads, N, D, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(B, args.heads, N, D, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(B, args.heads, N, Dv, device="cuda", dtype=torch.bfloat16)
                dout = torch.randn(B, args.heads, N, Dv, device="cuda", dtype=torch.bfloat16)
                scale = D ** -0.5
                flops = 4 * B * args.heads * N * N * (D + Dv) / 2 * (0.5 if variant == "causal" else 1.0) * 3.5
                row = dict(B=B, H=args.heads, N=N, D=D, Dv=Dv, variant=variant)
                if variant in MASKS:
                    from torch.nn.attention.flex_attention import create_block_mask

                    row["tile_density"] = tile_density(create_block_mask(_mask_mod(variant, N), None, None, N, N,
                                                                         device="cuda"))
                    if variant != "causal":   # causal keeps the usual half-of-dense count
                        flops = flops * row["tile_density"]
                fns = {}   # result key -> callable, timed together in interleaved rounds below
                impl, why = ours(q, k, v, dout, variant, scale)
                if impl is None:
                    row["ours_note"] = why
                else:
                    both, bwd, grads, fresh = impl
                    fns.update(ours_ms=both, ours_bwd_ms=bwd)
                    row["ours_mb"] = _peak_mb(fresh)
                    if any(v.split("@")[0] == DETERMINISTIC for v in args.bwd_variants):   # the default's bits
                        row["ours_repeats"] = _repeats(bwd, grads)
                for schedule in args.bwd_variants:
                    if schedule == "default":
                        continue
                    impl, why = ours(q, k, v, dout, variant, scale, schedule=schedule)
                    if impl is None:
                        row[f"ours[{schedule}]_note"] = why
                    else:
                        both, bwd, grads, _ = impl
                        fns[f"ours[{schedule}]_ms"], fns[f"ours[{schedule}]_bwd_ms"] = both, bwd
                        if schedule.split("@")[0] == DETERMINISTIC:
                            row[f"ours[{schedule}]_repeats"] = _repeats(bwd, grads)
                if args.generic:
                    impl, why = ours(q, k, v, dout, variant, scale, "generic")
                    if impl is None:
                        row["generic_note"] = why
                    else:
                        both, bwd, _, _ = impl
                        fns.update(generic_ms=both, generic_bwd_ms=bwd)
                torch_fwd = []
                for name in ("cudnn", "fa2", "flex"):
                    if name == "flex" and (D not in args.flex_head_dims or time.time() > deadline):
                        row["flex_note"] = "skipped: head dim or time budget (--flex-head-dims, --budget-s)"
                        continue
                    got = torch_impl(name, q, k, v, dout, variant, scale, flex_compiled)
                    if got is None:
                        continue
                    both, fwd = got
                    fns[f"{name}_ms"], fns[f"{name}_fwd_ms"] = both, fwd
                    torch_fwd.append(name)
                    row[f"{name}_mb"] = _peak_mb(both)
                row.update(_time_interleaved(fns, args.reps, head_start_ms=args.head_start_ms))
                if "ours_ms" in fns:   # (what --head-start-ms keeps out of the events)
                    row["ours_host_us"] = _host_drained_us(fns["ours_ms"], 5)
                for name in torch_fwd:   # their backward alone: fwd+bwd minus the forward
                    row[f"{name}_bwd_ms"] = row[f"{name}_ms"] - row.pop(f"{name}_fwd_ms")
                for name in ("ours", "generic", "cudnn", "fa2", "flex"):
                    if f"{name}_ms" in row:
                        row[f"{name}_tflops"] = flops / row[f"{name}_ms"] / 1e9
                if "ours_ms" in row:
                    for ref in ("cudnn", "flex"):
                        if f"{ref}_ms" in row:
                            row[f"vs_{ref}"] = row[f"{ref}_ms"] / row["ours_ms"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    for row in rows:   # mods against our own noop of the same shape; masks against their visited tiles
        noop = next((r for r in rows if r["variant"] == "noop" and (r["N"], r["D"], r["Dv"]) ==
                     (row["N"], row["D"], row["Dv"]) and "ours_ms" in r), None)
        if noop is None or "ours_ms" not in row:
            continue
        if row["variant"] in ("softcap", "alibi"):
            row["vs_our_noop"] = noop["ours_ms"] / row["ours_ms"]
        if "tile_density" in row:
            row["vs_tile_bound"] = noop["ours_ms"] * row["tile_density"] / row["ours_ms"]
    return rows


def _bits(repeats) -> str:
    """A schedule cell's note on three backward runs' bits (measured with --bwd-variants deterministic)."""
    return "" if repeats is None else (", same bits x3" if repeats else ", bits differ")


def markdown(rows: list[dict], meta: dict) -> str:
    def cell(row, key, fmt="{:.0f}"):
        return fmt.format(row[key]) if key in row else "-"

    lines = [f"# bwd_speed on {meta['device']} (bf16, fwd+bwd TFLOP/s = 3.5 forwards; L2 not flushed)", "",
             f"Tree: {meta.get('tree') or 'unknown'}", "",
             f"torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; command: `{meta['command']}`; "
             f"check against float64: worst relative error {meta['check_error']:.2e}. 'ours' is our Hopper forward "
             "plus the Hopper backward (templates/hopper_bwd), 'generic' the same forward plus the generic backward "
             "(templates/generic_bwd), 'flex' torch's compiled FlexAttention (forward and backward). "
             + (f"GPU time: each timed call enqueued behind a ~{meta['head_start_ms']:g} ms GPU sleep (the host's "
                "launches not in the events); host µs: one fwd+bwd of ours launched with the GPU queue drained."
                if meta.get("head_start_ms") else "Each timed call as the host issues it (host launch time included)."),
             "",
             "| N | D | variant | ours | generic | cuDNN | FA2 | flex | ours/cuDNN | ours/flex | ours/our noop |"
             " tile density | ours/tile bound | bwd ms ours / generic / cuDNN / flex | peak MB ours / cuDNN / flex |"
             " host µs ours |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = f"{r['D']}" if r["D"] == r["Dv"] else f"{r['D']}/{r['Dv']}"
        lines.append(f"| {r['N']} | {d} | {r['variant']} | {cell(r, 'ours_tflops')} | {cell(r, 'generic_tflops')} | "
                     f"{cell(r, 'cudnn_tflops')} | {cell(r, 'fa2_tflops')} | {cell(r, 'flex_tflops')} | "
                     f"{cell(r, 'vs_cudnn', '{:.2f}')} | {cell(r, 'vs_flex', '{:.2f}')} | "
                     f"{cell(r, 'vs_our_noop', '{:.2f}')} | {cell(r, 'tile_density', '{:.3f}')} | "
                     f"{cell(r, 'vs_tile_bound', '{:.2f}')} | {cell(r, 'ours_bwd_ms', '{:.2f}')} / "
                     f"{cell(r, 'generic_bwd_ms', '{:.2f}')} / {cell(r, 'cudnn_bwd_ms', '{:.2f}')} / "
                     f"{cell(r, 'flex_bwd_ms', '{:.2f}')} | {cell(r, 'ours_mb')} / {cell(r, 'cudnn_mb')} / "
                     f"{cell(r, 'flex_mb')} | {cell(r, 'ours_host_us')} |")
    schedules = [s for s in meta.get("bwd_variants", ["default"]) if s != "default"]
    if schedules:
        lines += ["", "Hopper backward schedules (templates/hopper_bwd/configs.VARIANTS), same run and inputs: "
                  "fwd+bwd ms / bwd ms, and bwd speed-up over the default schedule.", "",
                  "| N | D | variant | default | " + " | ".join(schedules) + " |",
                  "|---|---|---|---|" + "---|" * len(schedules)]
        for r in rows:
            if "ours_ms" not in r:
                continue
            cells = [f"{r['ours_ms']:.2f} / {r['ours_bwd_ms']:.2f}" + _bits(r.get("ours_repeats"))]
            for sch in schedules:
                key = f"ours[{sch}]"
                cells.append(f"{r[key + '_ms']:.2f} / {r[key + '_bwd_ms']:.2f} "
                             f"({r['ours_bwd_ms'] / r[key + '_bwd_ms']:.2f}x)" + _bits(r.get(key + "_repeats"))
                             if key + "_ms" in r else "-")
            d = f"{r['D']}" if r["D"] == r["Dv"] else f"{r['D']}/{r['Dv']}"
            lines.append(f"| {r['N']} | {d} | {r['variant']} | " + " | ".join(cells) + " |")
    notes = sorted({r["ours_note"] for r in rows if "ours_note" in r})
    return "\n".join(lines + [""] + [f"- not served by ours: {n}" for n in notes]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="path prefix: writes OUT.json and OUT.md")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--head-start-ms", type=float, default=4.0,
                        help="GPU sleep enqueued before each timed call so that the events time GPU work, not the "
                             "host's launches (0: the call as the host issues it, the timing before 2026-11-30)")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="after this many seconds, compiled flex (a compile per shape) is skipped")
    parser.add_argument("--generic", action="store_true",
                        help="also time our forward + the generic (plain Triton) backward")
    parser.add_argument("--flex-head-dims", type=int, nargs="+", default=[64, 128],
                        help="q/k head dims timed with compiled flex (each shape and mod is a compile; 192 is the "
                             "192/128 pair)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[D for D, _ in HEAD_DIMS if D != 160],
                        help="q/k head dims to run (192 is the 192/128 pair; 160, in the wide kernel's 256 tiles, "
                             "on request)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                        help="mods and masks to run")
    parser.add_argument("--bwd-variants", nargs="+", default=["default"],
                        help="Hopper backward schedules to A/B (names of templates/hopper_bwd/configs.VARIANTS, or "
                             "'deterministic': the default config with dQ's adds ordered, 'deterministic@G' with its "
                             "launch order in groups of G heads; both then report whether three backward runs wrote "
                             "the same bits)")
    args = parser.parse_args()
    from fa3_inductor.templates.hopper_bwd.configs import VARIANTS as SCHEDULES

    unknown = sorted(v for v in set(args.bwd_variants) - set(SCHEDULES) if v.split("@")[0] != DETERMINISTIC)
    if unknown:
        raise SystemExit(f"--bwd-variants: unknown {unknown}; choose from {sorted(SCHEDULES)} or {DETERMINISTIC}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("bwd_speed needs an sm90 GPU (H100 / H200)")
    # our backward against float64 at every head-dim pair to be timed (a wrong kernel's speed means nothing)
    err = max(check_once(D, Dv) for D, Dv in HEAD_DIMS if D in args.head_dims)
    print(f"check: worst relative error {err:.3e} against float64", flush=True)
    rows = run(args)
    import datetime

    import triton

    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%MZ}",
                command="python benchmarks/bwd_speed.py " + " ".join(sys.argv[1:]), check_error=err,
                bwd_variants=args.bwd_variants, head_start_ms=args.head_start_ms, tree=commit_label() or "unknown")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
