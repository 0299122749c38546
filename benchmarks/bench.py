#!/usr/bin/env python3
"""Attention benchmark: fa3_inductor against cuDNN SDPA, FA2 SDPA and FlexAttention.

One command sweeps the shapes of the FlashAttention-3 paper (batch × seqlen = 16384 tokens,
hidden 2048, so heads = 2048 / head_dim) across attention mods and implementations, forward and
forward+backward, and writes into ``--out``:

* ``bench-<device>-<date>.json``: one object ``{device, torch, triton, date, preset, rows, ...}``,
  one row per (impl, template_requested, mod, shape, direction);
* ``bench-<device>-<date>.md``: TFLOP/s per impl and the ratios of fa3_inductor (template="auto"
  and template="generic", both timed on every case) over cuDNN, FA2 and flex;
* ``bench-<device>-<date>.png``: TFLOP/s against seqlen (skipped when matplotlib is absent).

fa3_inductor is timed twice per case: ``template="auto"`` (hopper where it can serve the site)
and ``template="generic"`` (the portable kernel family). Both rows have ``impl: "fa3_inductor"``;
``template_requested`` says which was asked for, ``template`` what actually ran
(``fa3_inductor.last_template()``: hopper, generic, or torch when the site went to torch's kernel).

The ratio table is printed last.

Examples::

    python3 benchmarks/bench.py --preset quick            # ~7-8 minutes on an H100/H200 (420 s budget)
    python3 benchmarks/bench.py --preset full --budget-s 3000
    python3 benchmarks/bench.py --preset quick --mods softcap --head-dims 128
    python3 benchmarks/bench.py --preset padded            # D=80 / 96 / 160 / 192 (Hopper tiles of 128 / 256)
    python3 benchmarks/bench.py --preset smoke --out /tmp/b   # CPU: checks the harness itself
    python3 benchmarks/bench.py --render benchmarks/results/bench-nvidia-h200-....json

FLOP rule (one rule for every impl): forward FLOPs = 4·B·H·N²·D × density (2·B·H·N²·(D + Dv) where V's
head dim Dv differs from q/k's D: the mla preset), where density is the
exact fraction of (q, kv) pairs the mod's mask keeps (1 for noop/softcap/alibi, (N+1)/2N for
causal, measured by evaluating the mask_mod for sliding_window/document). fwd+bwd counts 3.5× the
forward FLOPs. TFLOP/s = counted FLOPs / median time.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import random
import re
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

IMPLS = ("fa3_inductor", "cudnn", "fa2", "flex")
FA3_TEMPLATES = ("auto", "generic")  # fa3_inductor.flex(template=...) values timed, each its own row
MODS = ("noop", "causal", "softcap", "alibi", "sliding_window", "document")
# Plot style per (impl, template_requested): (label, color, line style).
SERIES_STYLE = {
    ("fa3_inductor", "auto"): ("fa3_inductor auto", "C0", "-"),
    ("fa3_inductor", "generic"): ("fa3_inductor generic", "C4", "--"),
    ("cudnn", None): ("cuDNN", "C1", "-"),
    ("fa2", None): ("FA2", "C2", "-"),
    ("flex", None): ("flex", "C3", ":"),
}
SDPA_MODS = ("noop", "causal")  # cuDNN / FA2 SDPA serve only these
SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}
DIRECTIONS = ("fwd", "fwd+bwd")
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 80, 96, 128, 160, 192, 256)
TOKENS = 16384  # batch × seqlen, as in the FA3 paper
HIDDEN = 2048  # heads × head_dim
SOFTCAP = 30.0
WINDOW = 256
BWD_FLOP_FACTOR = 3.5  # fwd+bwd = forward + 2.5× forward (backward does 5 GEMMs to forward's 2)
DOC_SEED = 1234
REF_IMPL = "flex"


def window_definition(window: int) -> str:
    return f"mask (q_idx >= kv_idx) & (q_idx - kv_idx < {window}) (causal window of {window} keys)"


FLOP_RULE = (
    "forward FLOPs = 4*B*H*N^2*D*density (2*B*H*N^2*(D+Dv)*density where v's head dim Dv differs), density = exact fraction of (q,kv) pairs kept by the "
    "mask (1 for noop/softcap/alibi, (N+1)/(2N) for causal, counted from the mask_mod for "
    "sliding_window/document); fwd+bwd counts 3.5x forward; same rule for every impl"
)
MOD_DEFINITIONS = {
    "noop": "no score_mod, no mask",
    "causal": "mask q_idx >= kv_idx (SDPA: is_causal=True)",
    "softcap": f"score_mod {SOFTCAP:g}*tanh(score/{SOFTCAP:g}), no mask",
    "alibi": "score_mod score + slope[h]*(kv_idx - q_idx), slope[h] = 2^(-8(h+1)/H), no mask",
    "sliding_window": window_definition(WINDOW),
    "document": (
        "mask (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx) (packed sequences, causal inside each "
        "document, as fa3_inductor.mods.document's default); document lengths uniform in [1, N/2] (mean ~N/4), "
        f"random.Random({DOC_SEED} + N), same for every batch element"
    ),
}


# --------------------------------------------------------------------------------------------
# Cases and presets
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One benchmarked configuration; every impl that serves ``mod`` is timed on it."""

    mod: str
    head_dim: int
    seqlen: int
    direction: str
    batch: int
    heads: int
    value_head_dim: Optional[int] = None   # V's (and the output's) head dim where it differs from q/k's

    @property
    def dv(self) -> int:
        return self.value_head_dim or self.head_dim

    @staticmethod
    def paper(mod: str, head_dim: int, seqlen: int, direction: str) -> "Case":
        """A FlashAttention-3 paper shape: 16384 tokens, hidden 2048."""
        return Case(mod, head_dim, seqlen, direction, batch=max(1, TOKENS // seqlen), heads=HIDDEN // head_dim)

    def label(self) -> str:
        dims = f"D={self.head_dim}" + (f" Dv={self.dv}" if self.dv != self.head_dim else "")
        return f"{self.direction} {self.mod} {dims} N={self.seqlen} B={self.batch} H={self.heads}"


def preset_cases(preset: str) -> list[Case]:
    """The ordered list of cases of a preset (most important first, so a budget cut loses the least).

    >>> len(preset_cases("smoke")) > 0
    True
    """
    P = Case.paper
    if preset == "smoke":
        # Tiny CPU check of the harness: fa3_inductor falls back to torch's path there.
        return [Case(m, 64, 256, "fwd", batch=1, heads=2) for m in MODS]
    if preset == "quick":
        core = ("noop", "causal", "softcap")
        cases = [P(m, 128, n, "fwd") for m in core for n in SEQLENS]
        cases += [P(m, d, n, "fwd") for d in (64, 256) for m in core for n in (4096, 16384)]
        cases += [P(m, 128, 4096, "fwd+bwd") for m in core]
        cases += [P(m, 128, n, "fwd") for m in ("alibi", "sliding_window", "document") for n in SEQLENS]
        return cases
    if preset == "padded":
        # head dims that the Hopper template runs in power-of-two tiles (80 / 96 in 128, 160 / 192 in 256):
        # heads = 2048 // D (25, 21, 12, 10), so the hidden size is 2000 / 2016 / 1920 / 1920
        cases = [P(m, d, n, "fwd") for d in (96, 192) for m in ("noop", "causal", "softcap") for n in (2048, 8192)]
        return cases + [P(m, d, n, "fwd") for d in (80, 160) for m in ("noop", "causal") for n in (2048, 8192)]
    if preset == "mla":
        # DeepSeek-V2/V3 multi-head latent attention in its training form: q/k 192 (128 + 64 rope columns),
        # v 128; 16 heads (V2-Lite), 16384 tokens. FA2 SDPA needs equal head dims and is skipped.
        cases = [Case(m, 192, n, "fwd", batch=TOKENS // n, heads=16, value_head_dim=128)
                 for m in ("causal", "noop") for n in (2048, 4096, 8192)]
        return cases + [Case("causal", 192, 4096, "fwd+bwd", batch=TOKENS // 4096, heads=16, value_head_dim=128)]
    if preset == "full":
        return [P(m, d, n, direction) for direction in DIRECTIONS for d in (128, 64, 256) for m in MODS for n in SEQLENS]
    raise ValueError(f"unknown preset {preset!r}; expected one of smoke, quick, padded, mla, full")


# --------------------------------------------------------------------------------------------
# Mods, written the way FlexAttention users write them. The same callables go to every impl.
# --------------------------------------------------------------------------------------------


@dataclass
class ModSpec:
    name: str
    score_mod: Optional[Callable] = None
    mask_mod: Optional[Callable] = None
    sdpa_causal: bool = False  # how SDPA expresses this mod (only noop/causal)

    @property
    def causal(self) -> bool:
        return self.name in ("causal", "sliding_window", "document")


def document_ids(seqlen: int, device) -> torch.Tensor:
    """Document id per position: lengths uniform in [1, seqlen/2] (mean ~seqlen/4), fixed seed."""
    rng = random.Random(DOC_SEED + seqlen)
    ids, doc = [], 0
    while len(ids) < seqlen:
        ids.extend([doc] * rng.randint(1, max(1, seqlen // 2)))
        doc += 1
    return torch.tensor(ids[:seqlen], dtype=torch.int32, device=device)


def make_mod(name: str, heads: int, seqlen: int, device, window: int = WINDOW) -> ModSpec:
    """The mod `name` for a case (`window`: the sliding window's keys, --window)."""
    if name == "noop":
        return ModSpec(name)
    if name == "causal":

        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        return ModSpec(name, mask_mod=causal, sdpa_causal=True)
    if name == "softcap":
        cap = SOFTCAP

        def softcap(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

        return ModSpec(name, score_mod=softcap)
    if name == "alibi":
        slopes = torch.exp2(-8.0 * torch.arange(1, heads + 1, dtype=torch.float32, device=device) / heads)

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        return ModSpec(name, score_mod=alibi)
    if name == "sliding_window":
        def sliding_window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

        return ModSpec(name, mask_mod=sliding_window)
    if name == "document":
        doc = document_ids(seqlen, device)

        def document(b, h, q_idx, kv_idx):  # packed sequences: causal inside each document
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        return ModSpec(name, mask_mod=document)
    raise ValueError(f"unknown mod {name!r}; expected one of {', '.join(MODS)}")


def mask_density(mask_mod: Optional[Callable], seqlen: int, device) -> float:
    """Exact fraction of (q, kv) pairs that ``mask_mod`` keeps (b = h = 0), evaluated in row chunks."""
    if mask_mod is None:
        return 1.0
    kv = torch.arange(seqlen, device=device)[None, :]
    zero = torch.zeros((), dtype=torch.int64, device=device)
    kept, chunk = 0, max(1, (1 << 24) // seqlen)
    for start in range(0, seqlen, chunk):
        q = torch.arange(start, min(seqlen, start + chunk), device=device)[:, None]
        kept += int(torch.broadcast_to(mask_mod(zero, zero, q, kv), (q.shape[0], seqlen)).sum().item())
    return kept / (seqlen * seqlen)


def tile_density_of(block_mask) -> float:
    """Fraction of (q, kv) pairs inside the 128 x 128 tiles `block_mask` visits (1 without a mask): the work a
    tile-based kernel does. density / tile_density bounds a masked case's TFLOP/s (kept pairs) against the
    same kernel's unmasked rate: a 256-key window's query tile keeps 2/3 of its visited tiles' pairs."""
    return 1.0 if block_mask is None else 1.0 - block_mask.sparsity() / 100.0


# --------------------------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------------------------


class Skip(Exception):
    """The impl does not serve this case by design (not an error; no row is written)."""


_compiled_flex = None


def compiled_flex():
    """Stock FlexAttention compiled by stock Inductor (one compiled callable, recompiled per shape/mod)."""
    global _compiled_flex
    if _compiled_flex is None:
        # Every (mod, shape) is a new guard set; keep dynamo from giving up and running eager.
        for name, value in (("recompile_limit", 4096), ("accumulated_recompile_limit", 1 << 16),
                            ("cache_size_limit", 4096), ("accumulated_cache_size_limit", 1 << 16)):
            if hasattr(torch._dynamo.config, name):  # names moved between torch releases
                setattr(torch._dynamo.config, name, value)
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def _import_fa3():
    import fa3_inductor  # noqa: PLC0415 (imported lazily: a broken package must not stop the baselines)

    return fa3_inductor


def make_impl_fn(impl: str, spec: ModSpec, block_mask: Optional[BlockMask], q, k, v,
                 template: Optional[str] = None) -> Callable[[], torch.Tensor]:
    """A zero-argument callable that runs one attention forward for ``impl``.

    ``template`` (fa3_inductor only) is passed as ``fa3_inductor.flex(template=...)``.
    """
    if impl == "fa3_inductor":
        fa3 = _import_fa3()
        template = template or "auto"
        return lambda: fa3.flex(q, k, v, score_mod=spec.score_mod, block_mask=block_mask, template=template)
    if impl == "flex":
        fn = compiled_flex()
        return lambda: fn(q, k, v, score_mod=spec.score_mod, block_mask=block_mask)
    if impl in SDPA_BACKENDS:
        if spec.name not in SDPA_MODS:
            raise Skip(f"{impl} serves only {SDPA_MODS}")
        if impl == "fa2" and v.shape[-1] != q.shape[-1]:
            raise Skip("FA2 SDPA needs equal q/k and v head dims")
        if q.device.type != "cuda":
            raise Skip(f"{impl} needs CUDA")
        backend, is_causal = SDPA_BACKENDS[impl], spec.sdpa_causal

        def sdpa():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

        return sdpa
    raise ValueError(f"unknown impl {impl!r}; expected one of {', '.join(IMPLS)}")


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


# Timing rounds per case (see run_case); --rounds overrides.
TIMING_ROUNDS = 3


def time_ms(fn: Callable[[], object], device, grad_to_none=None) -> tuple[float, str]:
    """Median milliseconds of ``fn`` (already warmed up). Returns (ms, timer description)."""
    if device.type == "cuda":
        import triton.testing  # noqa: PLC0415

        ms = triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")
        return float(ms), "triton.testing.do_bench(warmup=25, rep=100, median)"
    # CPU (smoke preset only): do_bench needs a GPU driver; a wall-clock median is enough to
    # exercise the harness. These numbers mean nothing for performance.
    samples = []
    for _ in range(5):
        if grad_to_none:
            for t in grad_to_none:
                t.grad = None
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples), "time.perf_counter median of 5 (CPU; not a performance figure)"


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_abs_diff(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[float]:
    if a is None or b is None:
        return None
    return float((a.float() - b.float()).abs().max().item())


def impl_variants(impls: list[str], fa3_templates=FA3_TEMPLATES) -> list[tuple[str, Optional[str]]]:
    """(impl, template_requested) pairs to time, reference first, then fa3_inductor's templates.

    >>> impl_variants(["fa3_inductor", "flex"])
    [('flex', None), ('fa3_inductor', 'auto'), ('fa3_inductor', 'generic')]
    """
    order = sorted(impls, key=lambda name: name != REF_IMPL)  # the reference runs first
    out = []
    for impl in order:
        if impl == "fa3_inductor":
            out += [(impl, t) for t in fa3_templates]
        else:
            out.append((impl, None))
    return out


def run_case(case: Case, impls: list[str], device, dtype, log, fa3_templates=FA3_TEMPLATES,
             rounds: int = TIMING_ROUNDS, window: int = WINDOW) -> list[dict]:
    """Time every impl (fa3_inductor once per requested template) on one case; returns its rows
    (errors are recorded, never raised).

    Every impl is compiled, warmed up and checked first; then all are timed in ``rounds``
    interleaved rounds, odd rounds in reverse order, and each row takes the median of its rounds:
    a single timing per impl, taken one after the other, carries the GPU's clock and thermal drift
    into the ratios (identical launches differed by ~5% that way, docs/measuring.md)."""
    spec = make_mod(case.mod, case.heads, case.seqlen, device, window)
    block_mask = None
    if spec.mask_mod is not None:
        block_mask = create_block_mask(spec.mask_mod, None, None, case.seqlen, case.seqlen, device=device)
    density = mask_density(spec.mask_mod, case.seqlen, device)
    tile_density = tile_density_of(block_mask)
    # QK^T over D columns and PV over Dv: 2·B·H·N²·(D + Dv), i.e. 4·B·H·N²·D where they are equal
    fwd_flops = 2.0 * case.batch * case.heads * case.seqlen**2 * (case.head_dim + case.dv) * density
    flops = fwd_flops * (BWD_FLOP_FACTOR if case.direction == "fwd+bwd" else 1.0)
    backward = case.direction == "fwd+bwd"

    seed = case.head_dim * 1_000_003 + case.dv * 7919 + case.seqlen * 31 + MODS.index(case.mod)  # fresh inputs per shape
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = (case.batch, case.heads, case.seqlen, case.head_dim)
    v_shape = shape[:3] + (case.dv,)
    q, k, v = (torch.randn(sh, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
               for sh in (shape, shape, v_shape))
    dout = torch.randn(v_shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype) if backward else None
    if backward:
        for t in (q, k, v):
            t.requires_grad_(True)

    # The reference (flex) runs first so every other impl can be compared against it.
    ref_out = ref_grads = None
    rows, ready = [], []   # ready: (row, step) of the impls that compiled and ran
    for impl, requested in impl_variants(impls, fa3_templates):
        row = {
            "impl": impl,
            "template": None,
            "template_requested": requested,
            "mod": case.mod,
            "causal": spec.causal,
            "batch": case.batch,
            "heads": case.heads,
            "kv_heads": case.heads,
            "seqlen": case.seqlen,
            "head_dim": case.head_dim,
            "value_head_dim": case.dv,
            "dtype": str(dtype).replace("torch.", ""),
            "direction": case.direction,
            "ms": None,
            "tflops": None,
            "density": density,
            "tile_density": tile_density,
            "flops": flops,
            "max_abs_diff_vs_ref": None,
        }
        rows.append(row)
        try:
            fwd = make_impl_fn(impl, spec, block_mask, q, k, v, template=requested)
        except Skip:
            rows.pop()
            continue
        except Exception as exc:  # the package itself failed to import, for example
            row["error"] = _describe(exc)
            continue

        def step(fwd=fwd):
            out = fwd()
            if backward:
                out.backward(dout)
            return out

        try:
            # Warm-up: compiles (never timed) and yields the output checked against the reference.
            t0 = time.perf_counter()
            for t in (q, k, v):
                t.grad = None
            with torch.set_grad_enabled(backward):
                out = step()
                _sync(device)
                row["compile_s"] = round(time.perf_counter() - t0, 3)
                grads = [t.grad.detach().clone() for t in (q, k, v)] if backward else None
                out = out.detach()
                if impl == "fa3_inductor":
                    row["template"] = _import_fa3().last_template()
                step()  # a second call: no recompile may hide in the timed region
                _sync(device)
            if impl == REF_IMPL:
                ref_out, ref_grads = out, grads
            row["max_abs_diff_vs_ref"] = _max_abs_diff(out, ref_out)
            if backward and ref_grads is not None:
                row["max_abs_grad_diff_vs_ref"] = max(_max_abs_diff(a, b) for a, b in zip(grads, ref_grads))
            del out, grads
            ready.append((row, step))
        except Exception as exc:
            row["error"] = _describe(exc)
            if os.environ.get("BENCH_TRACEBACK"):
                traceback.print_exc()
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()

    times: dict[int, list[float]] = {id(row): [] for row, _ in ready}
    for rnd in range(max(1, rounds)):
        for row, step in (ready if rnd % 2 == 0 else ready[::-1]):
            if "error" in row:
                continue
            try:
                with torch.set_grad_enabled(backward):
                    ms, timer = time_ms(step, device, grad_to_none=[q, k, v] if backward else None)
                times[id(row)].append(ms)
                row["timer"] = f"{timer}, median of {max(1, rounds)} interleaved rounds"
            except Exception as exc:
                row["error"] = _describe(exc)
    for row, _ in ready:
        ts = times[id(row)]
        if ts and "error" not in row:
            row["ms"] = statistics.median(ts)
            row["ms_rounds"] = ts
            row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
    for row in rows:
        log(_row_line(row))
    return rows


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    text = " ".join(text.split())
    return text if len(text) <= 400 else text[:397] + "..."


def _row_line(row: dict) -> str:
    name = row["impl"] + (f"[{row['template_requested']}]" if row.get("template_requested") else "")
    if row["ms"] is None:
        return f"  {name:22s} ERROR {row.get('error')}"
    diff = row["max_abs_diff_vs_ref"]
    extra = f" template={row['template']}" if row["template"] else ""
    return (
        f"  {name:22s} {row['ms']:9.3f} ms {row['tflops']:8.1f} TFLOP/s"
        f"  max|out-ref|={'n/a' if diff is None else f'{diff:.2e}'}{extra}"
    )


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def _group_key(row: dict) -> tuple:
    dims = (row["head_dim"], row.get("value_head_dim") or row["head_dim"])
    return (row["direction"], row["mod"], dims, row["seqlen"], row["batch"], row["heads"], row["dtype"])


def _fmt_dims(dims: tuple[int, int]) -> str:
    """(192, 128) -> '192/128' (q/k and v head dims), (128, 128) -> '128'."""
    return str(dims[0]) if dims[0] == dims[1] else f"{dims[0]}/{dims[1]}"


def _fmt_tflops(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def _fmt_ratio(x: float) -> str:
    return f"{x:.2f}" if x >= 0.01 else f"{x:.1e}"


def series_of(row: dict) -> tuple[str, Optional[str]]:
    """(impl, template_requested) of a row; fa3_inductor rows of older files (no such key) were "auto"."""
    if row["impl"] == "fa3_inductor":
        return row["impl"], row.get("template_requested") or "auto"
    return row["impl"], None


FA3_AUTO, FA3_GENERIC = ("fa3_inductor", "auto"), ("fa3_inductor", "generic")
BASELINES = (("cudnn", "cuDNN"), ("fa2", "FA2"), ("flex", "flex"))


def markdown_table(result: dict) -> str:
    """The ratio table of a result object (as written to JSON) in markdown.

    Ratios are fa3_inductor TFLOP/s (template="auto", and template="generic") over the other
    impl's TFLOP/s on the same case (> 1: faster). A generic-requested row that did not run the
    generic template (e.g. it fell back to torch's kernel) shows that template in bold and is left
    out of the generic summary.
    """
    groups: dict[tuple, dict[tuple, dict]] = {}
    for row in result["rows"]:
        groups.setdefault(_group_key(row), {})[series_of(row)] = row

    def tf(g, series):
        r = g.get(series)
        if r is None:
            return None, "—"
        if r.get("tflops") is None:
            return None, "err"
        return r["tflops"], _fmt_tflops(r["tflops"])

    def ratio(a, b):
        return a / b if a is not None and b else None

    lines = [
        f"### {result['device']} · torch {result['torch']} · triton {result['triton']} · {result['date']} · preset {result['preset']}",
        "",
        f"TFLOP/s ({result.get('flop_rule', FLOP_RULE)}). fa3_inductor is timed twice per case: "
        "`template=\"auto\"` (auto) and `template=\"generic\"` (generic); each template column is what "
        "actually ran (`last_template()`). Ratios: fa3_inductor TFLOP/s ÷ the other's (>1 = fa3_inductor faster)."
        + (f" sliding_window: a causal window of {result['window']} keys."
           if any(r["mod"] == "sliding_window" for r in result["rows"]) and "window" in result else ""),
        "",
        "| dir | mod | D | seqlen | B×H | fa3 auto | template | fa3 generic | template | cuDNN | FA2 | flex "
        "| auto ÷cuDNN | auto ÷flex | generic ÷flex | generic ÷cuDNN |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    # summary[(direction, mod)][("auto"|"generic", baseline)] = [ratios]
    summary: dict[tuple, dict[tuple, list[float]]] = {}
    not_generic = 0
    for key in sorted(groups, key=lambda k: (DIRECTIONS.index(k[0]) if k[0] in DIRECTIONS else 9,
                                             MODS.index(k[1]) if k[1] in MODS else 99, k[2], k[3])):
        g = groups[key]
        direction, mod, d, n, b, h, _ = key
        auto, auto_s = tf(g, FA3_AUTO)
        gen, gen_s = tf(g, FA3_GENERIC)
        auto_t = (g.get(FA3_AUTO) or {}).get("template") or "—"
        gen_t = (g.get(FA3_GENERIC) or {}).get("template")
        gen_ok = gen_t == "generic"
        if gen_t is not None and not gen_ok:
            not_generic += 1
            gen_t = f"**{gen_t}**"  # e.g. fell back to torch: never to be read as the generic kernel
        base = {impl: tf(g, (impl, None)) for impl, _ in BASELINES}
        per = summary.setdefault((direction, mod), {})
        for impl, _ in BASELINES:
            r_auto, r_gen = ratio(auto, base[impl][0]), ratio(gen, base[impl][0])
            if r_auto is not None:
                per.setdefault(("auto", impl), []).append(r_auto)
            if r_gen is not None and gen_ok:
                per.setdefault(("generic", impl), []).append(r_gen)
        ratio_cells = [ratio(auto, base["cudnn"][0]), ratio(auto, base["flex"][0]),
                       ratio(gen, base["flex"][0]), ratio(gen, base["cudnn"][0])]
        cells = [auto_s, auto_t, gen_s, gen_t or "—"] + [base[impl][1] for impl, _ in BASELINES]
        cells += ["—" if r is None else _fmt_ratio(r) for r in ratio_cells]
        lines.append(f"| {direction} | {mod} | {_fmt_dims(d)} | {n} | {b}×{h} | " + " | ".join(cells) + " |")
    if not_generic:
        lines += ["", f"{not_generic} case(s) asked for template=\"generic\" but ran the template shown in bold "
                      "(not the generic kernel); they are left out of the generic summary."]

    summary = {k: v for k, v in summary.items() if v}
    if summary:
        head = [f"{t} vs {label}" for t in ("auto", "generic") for _, label in BASELINES]
        lines += ["", "Summary of fa3_inductor ratios (geometric mean, min) per direction and mod:", "",
                  "| dir | mod | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]
        for (direction, mod), per in sorted(summary.items(), key=lambda kv: (
                DIRECTIONS.index(kv[0][0]) if kv[0][0] in DIRECTIONS else 9, MODS.index(kv[0][1]) if kv[0][1] in MODS else 99)):
            cells = []
            for t in ("auto", "generic"):
                for impl, _ in BASELINES:
                    vals = per.get((t, impl))
                    cells.append("—" if not vals else f"{_fmt_ratio(math.exp(sum(map(math.log, vals)) / len(vals)))} (min {_fmt_ratio(min(vals))})")
            lines.append(f"| {direction} | {mod} | " + " | ".join(cells) + " |")

    def who(r):
        return r["impl"] + (f"[{r['template_requested']}]" if r.get("template_requested") else "")

    problems = [f"- {who(r)} {r['direction']} {r['mod']} D={r['head_dim']} N={r['seqlen']}: {r['error']}"
                for r in result["rows"] if r.get("error")]
    problems += [f"- whole case {c['direction']} {c['mod']} D={c['head_dim']} N={c['seqlen']}: {c['error']}"
                 for c in result.get("cases_failed", [])]
    if problems:
        lines += ["", f"{len(problems)} failure(s):", ""] + problems[:40]
        if len(problems) > 40:
            lines.append(f"- ... and {len(problems) - 40} more (see the JSON)")
    if result.get("budget_exhausted"):
        lines += ["", f"Budget of {result['budget_s']} s exhausted: {len(result.get('cases_skipped', []))} case(s) not run."]
    return "\n".join(lines) + "\n"


def write_plot(result: dict, path: Path) -> Optional[Path]:
    """One PNG: TFLOP/s against seqlen, one panel per (direction, head dim) × mod, one line per
    (impl, template_requested). None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in result["rows"] if r.get("tflops") is not None]
    if not rows:
        return None
    panels_y = sorted({(r["direction"], r["head_dim"]) for r in rows},
                      key=lambda p: (DIRECTIONS.index(p[0]) if p[0] in DIRECTIONS else 9, p[1]))
    panels_x = [m for m in MODS if any(r["mod"] == m for r in rows)]
    series = list(SERIES_STYLE) + sorted({series_of(r) for r in rows} - set(SERIES_STYLE), key=str)
    fig, axes = plt.subplots(len(panels_y), len(panels_x), figsize=(3.2 * len(panels_x), 2.6 * len(panels_y)),
                             squeeze=False, sharex=True)
    for i, (direction, d) in enumerate(panels_y):
        for j, mod in enumerate(panels_x):
            ax = axes[i][j]
            for s in series:
                label, color, style = SERIES_STYLE.get(s, (f"{s[0]} {s[1] or ''}".strip(), None, "-."))
                pts = sorted((r["seqlen"], r["tflops"]) for r in rows
                             if series_of(r) == s and r["mod"] == mod and r["direction"] == direction and r["head_dim"] == d)
                if pts:
                    ax.plot(*zip(*pts), marker="o", markersize=3, linewidth=1.2, linestyle=style, label=label, color=color)
            if not ax.lines:  # this (direction, D, mod) was not run: leave the panel blank
                ax.axis("off")
                continue
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.set_title(f"{direction} {mod} D={d}", fontsize=9)
            ax.tick_params(labelsize=7, labelbottom=True)  # also above a blank bottom panel
            if j == 0:
                ax.set_ylabel("TFLOP/s", fontsize=8)
            if i == len(panels_y) - 1:
                ax.set_xlabel("seqlen", fontsize=8)
    handles = {}
    for ax in axes.flat:
        for hnd, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, hnd)
    fig.legend(list(handles.values()), list(handles.keys()), loc="upper right", fontsize=8)
    fig.suptitle(f"{result['device']} · torch {result['torch']} · {result['date']}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.88, 0.96))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def _csv(kind, allowed, cast=str):
    def parse(text):
        values = [cast(x) for x in text.split(",") if x.strip()]
        bad = [x for x in values if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {kind} {bad}; expected a comma list of {list(allowed)}")
        return values

    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="FLOP rule: " + FLOP_RULE)
    p.add_argument("--preset", choices=("smoke", "quick", "padded", "mla", "full"), default="quick",
                   help="smoke: tiny CPU harness check; quick: fits a 10-minute GPU command; padded: head dims 80, "
                        "96, 160 and 192 (hidden 2000 / 2016 / 1920); mla: q/k head dim 192 with v 128 (DeepSeek's "
                        "latent attention, 16 heads); full: everything")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="output directory")
    p.add_argument("--rounds", type=int, default=TIMING_ROUNDS,
                   help="interleaved timing rounds per case (odd rounds in reverse order); the median is reported")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="stop starting new cases after this many seconds of wall clock (default 420)")
    p.add_argument("--impls", type=_csv("impl", IMPLS), default=list(IMPLS))
    p.add_argument("--fa3-templates", type=_csv("fa3 template", FA3_TEMPLATES), default=list(FA3_TEMPLATES),
                   help="fa3_inductor.flex(template=...) values to time, one row each (default auto,generic)")
    p.add_argument("--mods", type=_csv("mod", MODS), default=None, help="keep only these mods of the preset")
    p.add_argument("--head-dims", type=_csv("head dim", HEAD_DIMS, int), default=None)
    p.add_argument("--seqlens", type=_csv("seqlen", SEQLENS + (256,), int), default=None)
    p.add_argument("--directions", type=_csv("direction", DIRECTIONS), default=None)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--window", type=int, default=WINDOW,
                   help=f"keys of the sliding_window mod (default {WINDOW}; Gemma 3 uses 1024, Mistral and Gemma 2 4096)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--render", metavar="JSON", help="print the markdown table of an existing result file and exit")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        print(markdown_table(json.loads(Path(args.render).read_text())), end="")
        return 0

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = "cpu " + (platform.processor() or platform.machine())
    cases = [c for c in preset_cases(args.preset)
             if (args.mods is None or c.mod in args.mods)
             and (args.head_dims is None or c.head_dim in args.head_dims)
             and (args.seqlens is None or c.seqlen in args.seqlens)
             and (args.directions is None or c.direction in args.directions)]
    if not cases:
        print("bench: the filters leave no case to run", file=sys.stderr)
        return 2

    import triton  # noqa: PLC0415

    now = _dt.datetime.now(_dt.timezone.utc)
    result = {
        "device": device_name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": now.isoformat(timespec="seconds"),
        "preset": args.preset,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "argv": sys.argv[1:] if argv is None else list(argv),
        "flop_rule": FLOP_RULE,
        "mod_definitions": {**MOD_DEFINITIONS, "sliding_window": window_definition(args.window)},
        "window": args.window,
        "reference_impl": REF_IMPL,
        "fa3_templates_requested": list(args.fa3_templates),
        "flex_compile": "torch.compile(flex_attention, dynamic=False)",
        "budget_s": args.budget_s,
        "timing_rounds": args.rounds,
        "budget_exhausted": False,
        "cases_skipped": [],
        "cases_failed": [],
        "rows": [],
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench-{device_slug(device_name)}-{now.strftime('%Y-%m-%d-%H%M')}"

    def log(msg):
        print(msg, flush=True)

    log(f"bench: {device_name}, torch {torch.__version__}, triton {triton.__version__}, {dtype}, "
        f"preset {args.preset}: {len(cases)} case(s), budget {args.budget_s:.0f} s")
    start = time.monotonic()
    for i, case in enumerate(cases):
        elapsed = time.monotonic() - start
        if elapsed > args.budget_s:
            result["budget_exhausted"] = True
            result["cases_skipped"] = [vars(c) for c in cases[i:]]
            log(f"bench: budget of {args.budget_s:.0f} s exhausted after {elapsed:.0f} s; "
                f"{len(cases) - i} case(s) not started")
            break
        log(f"[{i + 1}/{len(cases)} {elapsed:5.0f}s] {case.label()}")
        try:
            result["rows"] += run_case(case, args.impls, device, dtype, log, args.fa3_templates, args.rounds,
                                       args.window)
        except Exception as exc:  # the case's own set-up (inputs, block mask) failed
            result["cases_failed"].append({**vars(case), "error": _describe(exc)})
            log(f"  case failed: {_describe(exc)}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    result["elapsed_s"] = round(time.monotonic() - start, 1)

    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    table = markdown_table(result)
    md_path = out_dir / f"{stem}.md"
    md_path.write_text(table)
    png = None if args.no_plot else write_plot(result, out_dir / f"{stem}.png")
    log(f"bench: wrote {json_path}, {md_path}" + (f", {png}" if png else " (no plot: matplotlib absent or no data)"))
    log("")
    print(table, end="", flush=True)  # the ratio table comes last
    return 0


if __name__ == "__main__":
    # Run from a clone without `pip install -e .`: make the repository's package importable
    # (appended, so an installed fa3_inductor still wins).
    sys.path.append(str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
