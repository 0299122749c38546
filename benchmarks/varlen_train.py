"""Packed training: forward + backward of attention over 16k-token packs of documents (causal within each), the way
a packed training step runs it, against the other ways to compute the same gradients, in one run.

Impls (each timed as one call that returns dq, dk, dv for a fixed dout: ``torch.autograd.grad``, no accumulation):
  ours         fa3_inductor.flex_varlen (sm90: the Hopper packed forward and the sm90 backward's packed mode)
  docmask      fa3_inductor.flex over [1, H, T, D] with a document-causal BlockMask (what packed training ran before)
  cudnn / fa2  F.scaled_dot_product_attention per document (is_causal, each document its own leaves; the loop timed)
  flex         torch's compiled flex_attention with the same BlockMask

FLOPs are the causal pairs' (4 H D per pair a forward; fwd+bwd 3.5 forwards). Gradients of every impl are compared
with ours (relative error) before timing; the pack's documents are serving.py's (doc_lengths, seeded).

``--window W``: a causal sliding window of W keys within each document (``mods.sliding_window(W)``; FLOPs of the
window's pairs). SDPA has no window, so cudnn / fa2 are not timed; ``--bwd-variants every_tile`` times our backward
with the mask on every query tile of each sequence (what it ran before the window walk).

    python benchmarks/varlen_train.py --out benchmarks/results            # on an sm90 GPU
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from provenance import commit_label  # noqa: E402
from serving import (FLUSH_BYTES, Clock, VarlenCase, _error, _rel, _sdpa, _slug, causal_pairs,  # noqa: E402
                     doc_lengths)

CASES = [VarlenCase(16384, docs, 16, d) for d in (128, 64, 256) for docs in (6, 24)]
IMPLS = ("ours", "docmask", "cudnn", "fa2", "flex")
# --bwd-variants: our packed backward with prepare_varlen_backward's options, timed as the forward (no autograd) and
# launch_varlen_backward, beside each other ("ours[name]")
BWD_VARIANTS: dict[str, dict] = {"default": {}, "every_tile": {"window": 0}}


def window_pairs(lengths: list[int], window: int) -> int:
    """(q, kv) pairs a causal window of ``window`` keys computes within documents of these lengths (0: causal).

    Example::

        >>> window_pairs([2, 3], 2), window_pairs([2, 3], 0)
        (7, 9)
    """
    if not window:
        return causal_pairs(lengths)
    return sum(min(q + 1, window) for n in lengths for q in range(n))


def _grads(outs: list, leaves: list, douts: list) -> Callable:
    return torch.autograd.grad(outs, leaves, douts)


def _kernel_times(fn: Callable, calls: int = 5) -> dict:
    """GPU µs a call of each kernel ``fn`` launches (torch.profiler, ``calls`` calls), longest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {e.key[:60]: round(e.device_time_total / calls, 1) for e in prof.key_averages() if e.device_time_total > 0}
    return dict(sorted(times.items(), key=lambda kv: -kv[1])[:8])


def _mask(window: int) -> Callable:
    from fa3_inductor import mods

    return mods.sliding_window(window) if window else mods.causal


def _direct(q, k, v, dout, cu, longest, window: int, options: dict) -> Callable:
    """Our packed forward (no autograd) and launch_varlen_backward with ``options`` over the walk flex_varlen picks
    (causal, or the causal ``window``): (dq, dk, dv) as [1, H, T, D]."""
    import math

    import fa3_inductor
    from fa3_inductor.templates.hopper_bwd.varlen import launch_varlen_backward
    from fa3_inductor.varlen import generated_mod

    mask = _mask(window)
    mask_fn, mask_bufs, _ = generated_mod(mask, "mask", "gl")
    walk = dict(dict(window=window) if window else dict(causal=True), **options)

    def run():
        with torch.no_grad():
            out, lse = fa3_inductor.flex_varlen(q, k, v, cu, cu, longest, longest, mask_mod=mask, return_lse=True)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        launch_varlen_backward(q, k, v, out, dout, lse / math.log(2.0), *grads, cu, cu,
                               sm_scale=q.shape[-1] ** -0.5, mask_mod=mask_fn, mask_bufs=mask_bufs, **walk)
        return [g.transpose(0, 1).unsqueeze(0) for g in grads]
    return run


def case_row(c: VarlenCase, device: torch.device, clock: Clock, flex_fn: Callable, profile: bool = False,
             variants: tuple = (), window: int = 0) -> dict:
    """One pack: every impl's fwd+bwd ms, TFLOP/s and gradient difference from ours (``window``: a causal window of
    that many keys within each document, 0 causal)."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask

    import fa3_inductor
    from fa3_inductor import mods

    lengths = doc_lengths(c)
    T, H, D = c.tokens, c.heads, c.d
    flops = 3.5 * 4 * H * D * window_pairs(lengths, window)
    row = dict(tokens=T, docs=c.docs, lengths=lengths, H=H, D=D, window=window)
    mask = _mask(window)
    gen = torch.Generator(device=device).manual_seed(c.seed)
    q, k, v, dout = (torch.randn(T, H, D, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(4))
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(device=device, dtype=torch.int32)
    longest = max(lengths)
    packed = [t.detach().requires_grad_() for t in (q, k, v)]
    four = [t.transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for t in (q, k, v)]
    dout4 = dout.transpose(0, 1).unsqueeze(0).contiguous()
    starts = cu[:-1].tolist()
    docs = [[t[:, :, s:s + n].detach().contiguous().requires_grad_() for t in four] for s, n in zip(starts, lengths)]
    ids = torch.repeat_interleave(torch.arange(c.docs, device=device), torch.tensor(lengths, device=device))
    bm = create_block_mask(mods.and_masks(mods.document(ids, causal=False), mask), None, None, T, T, device=device)

    def ours():
        out = fa3_inductor.flex_varlen(*packed, cu, cu, longest, longest, mask_mod=mask)
        return [g.transpose(0, 1).unsqueeze(0) for g in _grads([out], packed, [dout])]

    def four_way(fn):
        return lambda: _grads([fn(*four, block_mask=bm)], four, [dout4])

    def per_doc(name):
        def run():
            with sdpa_kernel(_sdpa(name)):
                outs = [F.scaled_dot_product_attention(*d, is_causal=True) for d in docs]
            grads = _grads(outs, [t for d in docs for t in d], [dout4[:, :, s:s + n] for s, n in zip(starts, lengths)])
            return [torch.cat(grads[i::3], dim=2) for i in range(3)]
        return run

    impls = {"ours": ours, "docmask": four_way(fa3_inductor.flex), "flex": four_way(flex_fn)}
    if not window:   # (SDPA has no sliding window)
        impls.update(cudnn=per_doc("cudnn"), fa2=per_doc("flash"))
    impls.update({f"ours[{name}]": _direct(q, k, v, dout, cu, longest, window, BWD_VARIANTS[name])
                  for name in variants})
    ref = ours()
    for name, fn in impls.items():
        try:
            grads = fn()
            row[f"{name}_diff"] = max(_rel(g, r) for g, r in zip(grads, ref))
            row[f"{name}_ms"] = clock.ms(fn)
            row[f"{name}_tflops"] = flops / row[f"{name}_ms"] / 1e9
            row[f"{name}_host_us"] = clock.host_us(fn)
        except Exception as exc:   # an impl that cannot run this pack is reported, not fatal
            row.setdefault("errors", {})[name] = _error(exc)
    if profile:
        row["kernels"] = {name: _kernel_times(impls[name]) for name in ("ours", "docmask")
                          + tuple(f"ours[{v}]" for v in variants)}
    for name in IMPLS[1:]:
        if "ours_ms" in row and f"{name}_ms" in row:
            row[f"vs_{name}"] = row[f"{name}_ms"] / row["ours_ms"]
    return row


def markdown(meta: dict, rows: list[dict]) -> str:
    """The result file: header, one table (TFLOP/s; ours/X = X's time over ours), targets."""
    pairs = f"causal window of {meta['window']} keys" if meta.get("window") else "causal"
    lines = [f"# varlen_train on {meta['device']} (bf16, fwd+bwd TFLOP/s = 3.5 forwards of the {pairs} pairs)", "",
             f"Tree: {meta['tree']}", "",
             f"torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; command: `{meta['command']}`. "
             f"{meta['timing']}", "",
             "| tokens | docs | H | D | " + " | ".join(IMPLS) + " | ours/docmask | ours/cudnn | ours/fa2 | ours/flex |"
             " ms ours / docmask / cudnn | host µs ours / docmask | max grad diff |",
             "|" + "---|" * (4 + len(IMPLS) + 7)]
    for r in rows:
        cells = [f"{r[f'{n}_tflops']:.0f}" if f"{n}_tflops" in r else "-" for n in IMPLS]
        ratios = [f"{r[f'vs_{n}']:.2f}" if f"vs_{n}" in r else "-" for n in IMPLS[1:]]
        ms = " / ".join(f"{r[f'{n}_ms']:.3f}" if f"{n}_ms" in r else "-" for n in ("ours", "docmask", "cudnn"))
        diff = max((r[k] for k in r if k.endswith("_diff")), default=float("nan"))
        host = " / ".join(f"{r[f'{n}_host_us']:.0f}" if f"{n}_host_us" in r else "-" for n in ("ours", "docmask"))
        lines.append(f"| {r['tokens']} | {r['docs']} | {r['H']} | {r['D']} | " + " | ".join(cells + ratios)
                     + f" | {ms} | {host} | {diff:.1e} |")
    for r in rows:
        if "kernels" in r:
            lines += ["", f"Kernels, GPU µs a call ({r['docs']} docs D{r['D']}): " + json.dumps(r["kernels"])]
    variants = [k[:-3] for k in (rows[0] if rows else {}) if k.startswith("ours[") and k.endswith("_ms")]
    if variants:
        lines += ["", "Backward variants (the forward and launch_varlen_backward, no autograd), fwd+bwd ms: "
                  + "; ".join(f"{r['docs']} docs D{r['D']}: " + ", ".join(f"{v} {r[v + '_ms']:.3f}" for v in variants
                                                                         if v + "_ms" in r) for r in rows)]
    errors = {f"{r['docs']} docs D{r['D']}": r["errors"] for r in rows if "errors" in r}
    if errors:
        lines += ["", "Errors: " + json.dumps(errors)]
    lines += ["", "Document lengths: " + "; ".join(f"{r['docs']} docs {r['lengths']}" for r in rows
                                                    if r["D"] == rows[0]["D"]), ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--label", default="", help="appended to the result files' names")
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU µs of ours and docmask (torch.profiler)")
    ap.add_argument("--head-dims", nargs="*", type=int, default=[128, 64], choices=sorted({c.d for c in CASES}),
                    help="the packs' head dims to time (default 128 64)")
    ap.add_argument("--bwd-variants", nargs="*", default=[], choices=sorted(BWD_VARIANTS),
                    help="our packed backward's variants, timed beside the rest (BWD_VARIANTS)")
    ap.add_argument("--window", type=int, default=0,
                    help="a causal sliding window of this many keys within each document (0: causal)")
    ap.add_argument("--head-start-ms", type=float, default=4.0,
                    help="GPU sleep before each timed call, so that the host's launches are queued before it starts: "
                         "the time is the GPU's (host µs per call are reported beside it)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("varlen_train needs a CUDA GPU (sm90 for our packed backward)")
    import triton
    from torch.nn.attention.flex_attention import flex_attention

    device = torch.device("cuda")
    name = torch.cuda.get_device_name()
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = dict(device=name, torch=torch.__version__, triton=triton.__version__, date=f"{now:%Y-%m-%d %H:%M}Z",
                tree=f"{commit_label()}", window=args.window,
                command="python benchmarks/varlen_train.py " + " ".join(sys.argv[1:]),
                timing=f"CUDA events, {args.warmup} warm-up calls, median of {args.reps}; before every timed call a "
                       f"{FLUSH_BYTES >> 20} MB scratch write flushes L2 (outside the events) and the GPU sleeps "
                       f"~{args.head_start_ms} ms while the host queues the call: GPU time. Host µs: one call's host "
                       "time, the queue drained first.")
    clock = Clock(device, args.reps, args.warmup, sleep_cycles=int(args.head_start_ms * 2e6))
    flex_fn = torch.compile(flex_attention, dynamic=False)
    rows = []
    started = time.time()
    for c in [c for c in CASES if c.d in args.head_dims]:
        rows.append(case_row(c, device, clock, flex_fn, args.profile, tuple(args.bwd_variants), args.window))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "lengths"}), flush=True)
    meta["wall_s"] = round(time.time() - started, 1)
    label = f"-{args.label}" if args.label else ""
    stem = os.path.join(args.out, f"varlen-train-{_slug(name)}-{now:%Y-%m-%d-%H%M}{label}")
    os.makedirs(args.out, exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)
    text = markdown(meta, rows)
    with open(stem + ".md", "w") as f:
        f.write(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
