#!/usr/bin/env python3
"""FP8 forward speed: the FP8 kernel alone and with its prologue, against cuDNN SDPA bf16 and our
bf16 kernel, in one run; the prologue's bytes moved per second against the device's copy bandwidth.

Shapes follow the FlashAttention-3 paper (batch × seqlen = 16384 tokens, hidden 2048, heads =
2048 / D). FLOP rule as benchmarks/bench.py: forward FLOPs = 4·B·H·N²·D × density (causal: (N+1)/2N).
Times are triton.testing.do_bench medians (CUDA events; inputs made once per shape).

Rows (JSON ``rows``, each with ``dtype``):
- ``cudnn`` bf16: SDPA with the cuDNN backend;
- ``fa3_inductor`` bf16: ``flex(q, k, v, ...)`` (the Hopper family where it serves);
- ``fa3_inductor`` fp8 ``kernel alone``: the FP8 kernel ``flex(fp8=)`` runs (``hopper_fp8`` on
  Hopper) on operands quantized once, launched as planned (bench.fp8_kernel_fn);
- ``fa3_inductor`` fp8 ``generic kernel``: the generic Triton FP8 kernel (``templates/fp8``, the family
  of sm89 and the interpreter) on the same operands, noop rows only;
- ``fa3_inductor`` fp8 ``with prologue``: ``flex(q, k, v, fp8=True, ...)`` end to end;
- ``prologue``: the prologue's launches prepared once (``prepare_prologue``: kernels only, as
  fp8_prologue_bw.py times them), with bytes read + written and GB/s, and ``host_us``: one
  ``quantize()`` call's host time with the queue drained first (before 2026-11-29 this row timed
  ``quantize()`` back to back, which measured its host work, ~0.2 ms, not the kernels);
- ``copy``: a device-to-device copy of 1 GiB (bytes read + written per second).

    python3 benchmarks/fp8_speed.py --out benchmarks/results [--head-dims 128] [--seqlens 4096,16384]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fa3_inductor  # noqa: E402
from fa3_inductor import FP8Recipe, flex, mods  # noqa: E402
from fa3_inductor.templates.fp8_prologue.host import prepare_prologue, quantize  # noqa: E402
from fa3_inductor.templates.fp8.configs import fp8_config  # noqa: E402
from fa3_inductor.templates.generic.host import prepare_generic  # noqa: E402

TOKENS, HIDDEN = 16384, 2048


def _bench(fn) -> float:
    from triton.testing import do_bench

    from fa3_inductor.runtime.variants import wait_for_variants

    fn()
    wait_for_variants()   # sibling kernels compile in the background: not part of a call's time
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def block_mask_of(mask_mod, q, k):
    """The block mask flex(q, k, v, mask_mod=, fp8=) plans with (None without a mask_mod)."""
    from fa3_inductor.api import _block_mask_of

    return None if mask_mod is None else _block_mask_of(mask_mod, q, k)


def _flops(B: int, H: int, N: int, D: int, causal: bool) -> float:
    density = (N + 1) / (2 * N) if causal else 1.0
    return 4.0 * B * H * N * N * D * density


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def run_case(D: int, N: int, mod: str, rows: list) -> None:
    B, H = TOKENS // N, HIDDEN // D
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    causal = mod == "causal"
    score_mod = mods.softcap(30.0) if mod == "softcap" else None
    mask_mod = mods.causal if causal else None
    flops = _flops(B, H, N, D, causal)
    shape = dict(B=B, H=H, N=N, D=D, mod=mod)

    def add(impl, dtype, what, ms, extra=None):
        row = dict(impl=impl, dtype=dtype, what=what, ms=ms, tflops=flops / (ms * 1e-3) / 1e12, **shape)
        row.update(extra or {})
        rows.append(row)
        print(f"D{D} N{N} {mod:8s} {impl:13s} {dtype:5s} {what:14s} {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s",
              flush=True)

    if mod != "softcap":
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            add("cudnn", "bf16", "sdpa", _bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)))
    with torch.no_grad():
        add("fa3_inductor", "bf16", fa3_inductor.last_template() or "",
            _bench(lambda: flex(q, k, v, score_mod=score_mod, mask_mod=mask_mod)))
        template = fa3_inductor.last_template()
        rows[-1]["what"] = template
        recipe = FP8Recipe()
        out8 = flex(q, k, v, score_mod=score_mod, mask_mod=mask_mod, fp8=recipe)
        add("fa3_inductor", "fp8", "with prologue",
            _bench(lambda: flex(q, k, v, score_mod=score_mod, mask_mod=mask_mod, fp8=recipe)))
        ref = flex(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
        rows[-1]["cosine_vs_bf16"] = torch.nn.functional.cosine_similarity(
            out8.float().flatten(), ref.float().flatten(), dim=0).item()
        from bench import fp8_kernel_fn
        from fp8_host import _host_drained_us

        kernel_alone, family = fp8_kernel_fn(score_mod, block_mask_of(mask_mod, q, k), q, k, v, recipe)
        add("fa3_inductor", "fp8", "kernel alone", _bench(kernel_alone), dict(family=family))
        ops = quantize(q, k, v, recipe)
        launches = [(kern[grid], a, kw) for kern, a, kw, grid in prepare_prologue(q, k, v, recipe).launches]

        def prologue():
            for fn, a, kw in launches:
                fn(*a, **kw)
        ms = _bench(prologue)
        moved = 3 * q.numel() * 2 + 3 * q.numel() * 1   # bf16 in, e4m3 out (scales negligible)
        add("prologue", "fp8", "quantize", ms, dict(bytes=moved, gbps=moved / (ms * 1e-3) / 1e9,
                                                    host_us=_host_drained_us(lambda: quantize(q, k, v, recipe), 20)))
        if mod == "noop":
            out = torch.empty_like(q)
            lse = torch.empty(B, H, N, device="cuda")
            kernel, args, kwargs, grid = prepare_generic(ops.q, ops.k, ops.vt, out, lse, torch.empty_like(lse),
                                                         sm_scale=D ** -0.5, fp8=ops,
                                                         config=fp8_config(D, (9, 0)))
            add("fa3_inductor", "fp8", "generic kernel", _bench(lambda: kernel[grid](*args, **kwargs)))


def main() -> None:
    import triton

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--mods", default="noop,causal,softcap")
    args = ap.parse_args()
    now = _dt.datetime.now(_dt.timezone.utc)
    device = torch.cuda.get_device_name()
    rows: list = []
    bw = copy_bandwidth()
    print(f"{device}, torch {torch.__version__}, triton {triton.__version__}; copy {bw / 1e12:.2f} TB/s", flush=True)
    for D in (int(x) for x in args.head_dims.split(",")):
        for N in (int(x) for x in args.seqlens.split(",")):
            for mod in args.mods.split(","):
                try:
                    run_case(D, N, mod, rows)
                except Exception as exc:   # keep the rest of the sweep
                    print(f"D{D} N{N} {mod}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    rows.append(dict(D=D, N=N, mod=mod, error=f"{type(exc).__name__}: {exc}"[:500]))
    slug = device.lower().replace("nvidia ", "nvidia-").replace(" ", "-")
    stem = os.path.join(args.out, f"fp8-speed-{slug}-{now:%Y-%m-%d-%H%M}")
    os.makedirs(args.out, exist_ok=True)
    result = dict(device=device, torch=torch.__version__, triton=triton.__version__, date=now.isoformat(),
                  argv=sys.argv[1:], copy_bytes_per_s=bw, flop_rule="4*B*H*N^2*D*density", rows=rows)
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# FP8 forward speed: {device}", "",
             f"torch {torch.__version__}, triton {triton.__version__}, {now:%Y-%m-%d %H:%M} UTC; "
             f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", "",
             "TFLOP/s; the prologue's GB/s are its kernels' (launches prepared once), its host µs one "
             "quantize() call's", "",
             "| D | N | mod | cuDNN bf16 | fa3 bf16 | fp8 kernel alone | fp8 generic Triton kernel | fp8 + prologue | "
             "kernel alone / cuDNN | fp8+prologue / cuDNN | fp8+prologue / fa3 bf16 | prologue ms | "
             "prologue GB/s (% copy) | prologue host µs | cosine vs bf16 |", "|" + "---|" * 15]
    cases = sorted({(r["D"], r["N"], r["mod"]) for r in rows})
    for D, N, mod in cases:
        sel = {(r.get("impl"), r.get("dtype"), r.get("what") if r.get("dtype") == "fp8" else ""): r
               for r in rows if (r["D"], r["N"], r["mod"]) == (D, N, mod) and "error" not in r}
        def t(key):
            r = sel.get(key)
            return r["tflops"] if r else None
        cud, ours = t(("cudnn", "bf16", "")), t(("fa3_inductor", "bf16", ""))
        kern, full = t(("fa3_inductor", "fp8", "generic kernel")), t(("fa3_inductor", "fp8", "with prologue"))
        alone = t(("fa3_inductor", "fp8", "kernel alone"))
        pro = sel.get(("prologue", "fp8", "quantize"))
        cos = (sel.get(("fa3_inductor", "fp8", "with prologue")) or {}).get("cosine_vs_bf16")
        f = lambda x: "" if x is None else f"{x:.0f}"   # noqa: E731
        ratio = lambda a, b: "" if a is None or b is None else f"{a / b:.2f}"   # noqa: E731
        pro_txt = "" if pro is None else f"{pro['gbps']:.0f} ({100 * pro['gbps'] * 1e9 / bw:.0f}%)"
        pro_ms = "" if pro is None else f"{pro['ms']:.3f}"
        host = "" if pro is None else f"{pro['host_us']:.0f}"
        lines.append(f"| {D} | {N} | {mod} | {f(cud)} | {f(ours)} | {f(alone)} | {f(kern)} | {f(full)} | "
                     f"{ratio(alone, cud)} | {ratio(full, cud)} | {ratio(full, ours)} | {pro_ms} | {pro_txt} | "
                     f"{host} | {'' if cos is None else f'{cos:.5f}'} |")
    with open(stem + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
