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

FP8 (``--fp8``, or ``--preset fp8``; off by default): every forward case also gets three FP8 rows,
timed in the same interleaved rounds as the rows above, all with ``dtype: "fp8"`` (``input_dtype``:
what the prologue read, bfloat16 or float16):

* ``impl: "fa3_inductor", template_requested: "fp8", what: "with prologue"``:
  ``fa3_inductor.flex(q, k, v, ..., fp8=True)`` end to end (prologue + FP8 kernel);
* ``impl: "fa3_inductor", template_requested: "fp8", what: "kernel"``: the FP8 kernel alone on operands
  quantized once, with the case's mods and block mask (its launch built once by the fp8 kernel family);
* ``impl: "prologue", what: "quantize"``: the prologue alone, with ``bytes`` (inputs read + FP8 operands
  and scales written) and ``gbps``; no TFLOP/s.

FP8 is inference-only: fwd+bwd cases get no fp8 rows (nor do CPU runs without TRITON_INTERPRET=1,
float32 inputs, or GPUs below sm89); each skip is listed with its reason in ``fp8_skipped`` and the table.
Every fa3_inductor callable waits for its background sibling compiles
(``fa3_inductor.runtime.variants.wait_for_variants()``) after its first call, before any timing.

The ratio table is printed last.

Examples::

    python3 benchmarks/bench.py --preset quick            # ~7-8 minutes on an H100/H200 (420 s budget)
    python3 benchmarks/bench.py --preset full --budget-s 3000
    python3 benchmarks/bench.py --preset quick --mods softcap --head-dims 128
    python3 benchmarks/bench.py --preset padded            # D=80 / 96 / 160 / 192 (Hopper tiles of 128 / 256)
    python3 benchmarks/bench.py --preset fp8               # quick's fwd noop/causal/softcap cases + FP8 rows
    python3 benchmarks/bench.py --preset quick --fp8 --mods causal --directions fwd
    python3 benchmarks/bench.py --preset smoke --out /tmp/b   # CPU: checks the harness itself
    python3 benchmarks/bench.py --render benchmarks/results/bench-nvidia-h200-....json

FLOP rule (one rule for every impl): forward FLOPs = 4·B·H·N²·D × density (2·B·H·N²·(D + Dv) where V's
head dim Dv differs from q/k's D: the mla preset), where density is the
exact fraction of (q, kv) pairs the mod's mask keeps (1 for noop/softcap/alibi, (N+1)/2N for
causal, measured by evaluating the mask_mod for sliding_window/document). fwd+bwd counts 3.5× the
forward FLOPs. TFLOP/s = counted FLOPs / median time. FP8 rows count the same FLOPs as the bf16 rows
of their case.
"""

from __future__ import annotations

import argparse
import dataclasses
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
    ("fa3_inductor", "fp8"): ("fa3_inductor fp8 + prologue", "C5", "-"),
    ("fa3_inductor", "fp8 kernel"): ("fa3_inductor fp8 kernel", "C5", ":"),
}
FP8_FAMILIES = ("hopper_fp8", "fp8")   # the kernel families that compute an FP8 site (templates/registry.py)
# FP8 rows (--fp8): (impl, template_requested, what), timed after the bf16 rows of a forward case.
FP8_WITH_PROLOGUE, FP8_KERNEL, FP8_PROLOGUE = "with prologue", "kernel", "quantize"
FP8_ENTRIES = (("fa3_inductor", "fp8", FP8_WITH_PROLOGUE), ("fa3_inductor", "fp8", FP8_KERNEL),
               ("prologue", None, FP8_PROLOGUE))
FP8_INPUT_DTYPES = ("bfloat16", "float16")
FP8_MIN_CAPABILITY = (8, 9)   # e4m3 tensor-core MMA: Ada, Hopper
DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
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


PRESETS = ("smoke", "quick", "fp8", "padded", "mla", "full")


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
    if preset == "fp8":
        # quick's forward noop / causal / softcap cases (D=128 at every seqlen, D=64 / 256 at 4k and 16k);
        # the preset turns --fp8 on
        core = ("noop", "causal", "softcap")
        cases = [P(m, 128, n, "fwd") for m in core for n in SEQLENS]
        return cases + [P(m, d, n, "fwd") for d in (64, 256) for m in core for n in (4096, 16384)]
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
    raise ValueError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")


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


def _triton_interpreting() -> bool:
    try:
        from triton import knobs  # noqa: PLC0415
    except ImportError:
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return bool(knobs.runtime.interpret)


def fp8_skip_reason(case: Case, device, dtype, impls) -> Optional[str]:
    """Why ``case`` gets no FP8 rows under --fp8, or None when it gets them.

    >>> fp8_skip_reason(Case.paper("causal", 128, 4096, "fwd+bwd"), "cpu", torch.bfloat16, ["fa3_inductor"])
    'FP8 is inference-only: flex(fp8=True) has no backward'
    >>> fp8_skip_reason(Case.paper("causal", 128, 4096, "fwd"), "cpu", torch.float32, ["fa3_inductor"])[:45]
    'the FP8 prologue reads bfloat16 or float16 in'
    """
    if case.direction != "fwd":
        return "FP8 is inference-only: flex(fp8=True) has no backward"
    if "fa3_inductor" not in impls:
        return "--impls leaves out fa3_inductor"
    name = str(dtype).replace("torch.", "")
    if name not in FP8_INPUT_DTYPES:
        return f"the FP8 prologue reads bfloat16 or float16 inputs; this run's are {name} (pass --dtype bfloat16)"
    device = torch.device(device)
    if device.type == "cuda":
        cap = tuple(torch.cuda.get_device_capability(device))
        if cap < FP8_MIN_CAPABILITY:
            return f"FP8 needs e4m3 tensor cores (sm89 or newer); this GPU is sm{cap[0]}{cap[1]}"
        return None
    if device.type == "cpu" and not _triton_interpreting():
        return "FP8 on the CPU runs only under Triton's interpreter (TRITON_INTERPRET=1)"
    if device.type not in ("cpu", "cuda"):
        return f"FP8 runs on CUDA GPUs (sm89+) or the CPU under TRITON_INTERPRET=1, not {device.type}"
    return None


def _tensor_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def fp8_kernel_fn(score_mod: Optional[Callable], block_mask: Optional[BlockMask], q, k, v, recipe,
                  scale: Optional[float] = None) -> tuple[Callable[[], torch.Tensor], str]:
    """(the FP8 kernel alone, its family's name), as ``flex(q, k, v, score_mod=..., block_mask=...,
    fp8=recipe)`` runs it, on operands quantized once here: the site is planned as flex(fp8=...) plans
    it (fa3_inductor.direct_fp8), the launch built once by the first FP8 family of the plan that takes
    the call (hopper_fp8, then fp8: templates/registry.py), and the returned callable only launches
    ``kernel[grid](*args, **kwargs)`` (under Triton's interpreter, where the family gives no launch to
    keep, its ``launch(call)``). The callable returns the output tensor (written in place; the LSE is
    left in log2 units, as the kernel writes it)."""
    from fa3_inductor import direct_fp8  # noqa: PLC0415
    from fa3_inductor.runtime.ops import call_for  # noqa: PLC0415
    from fa3_inductor.templates.family import NotServed  # noqa: PLC0415
    from fa3_inductor.templates.registry import family  # noqa: PLC0415

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # the plan and prologue flex(fp8=...) makes (fa3_inductor.direct_fp8), the launch built once here
    site, planned = direct_fp8.fp8_call(q, k, v, score_mod, block_mask, scale, recipe, None)
    refused = []
    for name in (n for n in site.families if n in FP8_FAMILIES):
        fam = family(name)
        call = call_for(site, planned, fam.dialect)
        try:
            variants = fam.prepare(call)
        except NotServed as why:
            refused.append(f"{name}: {why}")
            continue
        out = call.out
        if variants is None:  # Triton's interpreter: the family computes the call itself

            def interpreted(fam=fam, call=call, out=out):
                fam.launch(call)
                return out

            return interpreted, name
        (kernel, args, kwargs, grid), _siblings = variants   # the siblings serve other lengths: not needed

        def launch(kernel=kernel, args=args, kwargs=kwargs, grid=grid, out=out):
            kernel[grid](*args, **kwargs)
            return out

        return launch, name
    raise RuntimeError(f"no FP8 family takes this call (plan {site.families}; {'; '.join(refused)}): "
                       f"{site.note or site.description}")


def make_fp8_fn(what: str, spec: ModSpec, block_mask: Optional[BlockMask], q, k, v,
                recipe) -> tuple[Callable[[], Optional[torch.Tensor]], dict]:
    """(callable, extra row fields) of one FP8 row (FP8_ENTRIES): ``what`` is "with prologue"
    (flex(..., fp8=recipe) end to end), "kernel" (fp8_kernel_fn) or "quantize" (the prologue alone;
    its row gets ``bytes``: q, k, v read once, or K twice when smoothing, plus the FP8 operands and
    scales written)."""
    fa3 = _import_fa3()
    if what == FP8_WITH_PROLOGUE:
        return (lambda: fa3.flex(q, k, v, score_mod=spec.score_mod, block_mask=block_mask, fp8=recipe)), {}
    if what == FP8_KERNEL:
        fn, name = fp8_kernel_fn(spec.score_mod, block_mask, q, k, v, recipe)
        return fn, {"template": name}
    if what == FP8_PROLOGUE:
        from fa3_inductor.templates.fp8_prologue.host import quantize  # noqa: PLC0415

        ops = quantize(q, k, v, recipe)
        written = _tensor_bytes(*(getattr(ops, f) for f in ("q", "k", "vt", "q_scale", "k_scale", "v_scale",
                                                              "v_scale_max", "k_mean")))
        read = _tensor_bytes(q, k, v) + (_tensor_bytes(k) if recipe.smooth_k else 0)
        del ops

        def prologue():
            quantize(q, k, v, recipe)

        return prologue, {"bytes": read + written, "bytes_read": read, "bytes_written": written}
    raise ValueError(f"unknown fp8 row {what!r}; expected one of {[e[2] for e in FP8_ENTRIES]}")


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


def copy_bandwidth(device) -> Optional[float]:
    """Bytes read + written per second by a 1 GiB device-to-device copy (the FP8 prologue's yardstick);
    None where it cannot be measured."""
    def timed() -> float:
        src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        _sync(device)
        return time_ms(lambda: dst.copy_(src), device)[0]

    try:
        ms = timed()
    except Exception:
        return None
    finally:
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return 2 * (1 << 30) / (ms * 1e-3)


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
             rounds: int = TIMING_ROUNDS, window: int = WINDOW, fp8: bool = False,
             fp8_skipped: Optional[list] = None) -> list[dict]:
    """Time every impl (fa3_inductor once per requested template) on one case; returns its rows
    (errors are recorded, never raised). ``fp8``: also the FP8 rows (FP8_ENTRIES) where
    fp8_skip_reason allows; otherwise the reason is appended to ``fp8_skipped``.

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

    # The reference (flex) runs first so every other impl can be compared against it; FP8 rows last.
    entries = [(impl, requested, None) for impl, requested in impl_variants(impls, fa3_templates)]
    recipe = None
    if fp8:
        reason = fp8_skip_reason(case, device, dtype, impls)
        if reason is None:
            try:
                recipe = _import_fa3().FP8Recipe()
            except Exception as exc:   # the package failed to import: the bf16 baselines still run
                reason = f"fa3_inductor.FP8Recipe unavailable: {_describe(exc)}"
        if reason is None:
            entries += list(FP8_ENTRIES)
        else:
            log(f"  fp8 rows skipped: {reason}")
            if fp8_skipped is not None:
                fp8_skipped.append({**vars(case), "reason": reason})
    ref_out = ref_grads = None
    rows, ready = [], []   # ready: (row, step) of the impls that compiled and ran
    for impl, requested, what in entries:
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
        if what is not None:   # an FP8 row: the inputs' dtype is what the prologue read
            row.update(what=what, dtype="fp8", input_dtype=row["dtype"])
            if impl == "prologue":
                row["flops"] = None   # moves bytes: GB/s, no TFLOP/s
        rows.append(row)
        try:
            if what is None:
                fwd = make_impl_fn(impl, spec, block_mask, q, k, v, template=requested)
            else:
                fwd, extra = make_fp8_fn(what, spec, block_mask, q, k, v, recipe)
                row.update(extra)
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
                if impl == "fa3_inductor" or what is not None:
                    _wait_for_variants(row)   # background sibling compiles must not land in a timing
                grads = [t.grad.detach().clone() for t in (q, k, v)] if backward else None
                out = out.detach() if isinstance(out, torch.Tensor) else None   # the prologue row: None
                if impl == "fa3_inductor" and what != FP8_KERNEL:
                    row["template"] = _import_fa3().last_template()
                step()  # a second call: no recompile may hide in the timed region
                _sync(device)
            if impl == REF_IMPL:
                ref_out, ref_grads = out, grads
            row["max_abs_diff_vs_ref"] = _max_abs_diff(out, ref_out)
            if what is not None and out is not None and ref_out is not None:
                row["cosine_vs_ref"] = float(F.cosine_similarity(out.float().flatten(), ref_out.float().flatten(),
                                                                 dim=0).item())
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
            if row["flops"] is not None:
                row["tflops"] = row["flops"] / (row["ms"] * 1e-3) / 1e12
            if row.get("bytes"):
                row["gbps"] = row["bytes"] / (row["ms"] * 1e-3) / 1e9
    for row in rows:
        log(_row_line(row))
    return rows


def _wait_for_variants(row: dict) -> None:
    """Wait for fa3_inductor's background sibling compiles (runtime/variants.py) after a callable's first
    call; a sibling's failure (a launch other lengths would need) is recorded, not this row's error."""
    try:
        from fa3_inductor.runtime.variants import wait_for_variants  # noqa: PLC0415
    except ImportError:   # a package without background compiles: nothing to wait for
        return
    t0 = time.perf_counter()
    try:
        row["variants_waited"] = wait_for_variants()
    except Exception as exc:
        row["variants_error"] = _describe(exc)
    row["variants_wait_s"] = round(time.perf_counter() - t0, 3)


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    text = " ".join(text.split())
    return text if len(text) <= 400 else text[:397] + "..."


def _row_name(row: dict) -> str:
    """'fa3_inductor[generic]', 'fa3_inductor[fp8] kernel', 'prologue quantize'."""
    name = row["impl"] + (f"[{row['template_requested']}]" if row.get("template_requested") else "")
    return name + (f" {row['what']}" if row.get("what") else "")


def _row_line(row: dict) -> str:
    name = _row_name(row)
    if row["ms"] is None:
        return f"  {name:22s} ERROR {row.get('error')}"
    if row.get("tflops") is None:   # the FP8 prologue: bytes, not FLOPs
        rate = f"{row['gbps']:8.0f} GB/s   " if row.get("gbps") is not None else " " * 16
        return f"  {name:22s} {row['ms']:9.3f} ms {rate}  {row.get('bytes', 0) / 1e6:.1f} MB moved"
    diff = row["max_abs_diff_vs_ref"]
    extra = f" template={row['template']}" if row["template"] else ""
    extra += f" cos={row['cosine_vs_ref']:.5f}" if row.get("cosine_vs_ref") is not None else ""
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
    """The case of a row; an FP8 row (dtype "fp8") joins its case's rows by the dtype of its inputs."""
    dims = (row["head_dim"], row.get("value_head_dim") or row["head_dim"])
    dtype = row.get("input_dtype") or row.get("dtype")
    return (row["direction"], row["mod"], dims, row["seqlen"], row["batch"], row["heads"], dtype)


def _case_order(key: tuple) -> tuple:
    return (DIRECTIONS.index(key[0]) if key[0] in DIRECTIONS else 9, MODS.index(key[1]) if key[1] in MODS else 99,
            key[2], key[3])


def _fmt_dims(dims: tuple[int, int]) -> str:
    """(192, 128) -> '192/128' (q/k and v head dims), (128, 128) -> '128'."""
    return str(dims[0]) if dims[0] == dims[1] else f"{dims[0]}/{dims[1]}"


def _fmt_tflops(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def _fmt_ratio(x: float) -> str:
    return f"{x:.2f}" if x >= 0.01 else f"{x:.1e}"


def series_of(row: dict) -> tuple[str, Optional[str]]:
    """(impl, template_requested) of a row; fa3_inductor rows of older files (no such key) were "auto".
    The FP8 kernel-alone row is its own series, ("fa3_inductor", "fp8 kernel").

    >>> series_of({"impl": "fa3_inductor", "template_requested": "fp8", "what": "kernel"})
    ('fa3_inductor', 'fp8 kernel')
    """
    if row["impl"] == "fa3_inductor":
        requested = row.get("template_requested") or "auto"
        if requested == "fp8" and row.get("what") == FP8_KERNEL:
            return row["impl"], "fp8 kernel"
        return row["impl"], requested
    return row["impl"], None


FA3_AUTO, FA3_GENERIC = ("fa3_inductor", "auto"), ("fa3_inductor", "generic")
FP8_FULL, FP8_KERNEL_ONLY, FP8_PROLOGUE_ONLY = ("fa3_inductor", "fp8"), ("fa3_inductor", "fp8 kernel"), ("prologue", None)
BASELINES = (("cudnn", "cuDNN"), ("fa2", "FA2"), ("flex", "flex"))
FP8_RATIOS = ("+prologue ÷cuDNN", "+prologue ÷fa3 auto", "kernel ÷cuDNN")


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
    for key in sorted(groups, key=_case_order):
        g = groups[key]
        if not any(s in g for s in (FA3_AUTO, FA3_GENERIC) + tuple((impl, None) for impl, _ in BASELINES)):
            continue   # FP8 rows only: the FP8 table has them
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

    lines += fp8_table(result, groups, tf, ratio)

    problems = [f"- {_row_name(r)} {r['direction']} {r['mod']} D={r['head_dim']} N={r['seqlen']}: {r['error']}"
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


def fp8_table(result: dict, groups: dict, tf: Callable, ratio: Callable) -> list[str]:
    """The FP8 section of markdown_table (no lines when the run had no --fp8 and no FP8 rows): per
    forward case, the inputs' dtype, cuDNN and fa3 auto TFLOP/s in that dtype, FP8 with its prologue and
    the kernel alone, the prologue's time and GB/s, and the ratios FP8_RATIOS; then their geometric
    means per mod, and why cases got no FP8 rows."""
    fp8_groups = {k: g for k, g in groups.items() if any(s in g for s in (FP8_FULL, FP8_KERNEL_ONLY, FP8_PROLOGUE_ONLY))}
    skipped = result.get("fp8_skipped") or []
    if not fp8_groups and not skipped and not result.get("fp8"):
        return []
    copy_bw = result.get("copy_bytes_per_s")
    lines = [
        "", "#### FP8 forward: `flex(..., fp8=True)`, inference only", "",
        "fp8 + prologue: `fa3_inductor.flex(q, k, v, ..., fp8=True)` end to end (template: what served it); "
        "fp8 kernel: the FP8 kernel alone on operands quantized once, same mods and block mask; prologue: "
        "the quantize pass alone, bytes read + written per second"
        + (" (% of a 1 GiB device-to-device copy's)" if copy_bw else "")
        + ". TFLOP/s count the same FLOPs as the case's other rows. dtype: the inputs' (what cuDNN and fa3 auto "
        "ran in and what the prologue reads). Ratios: TFLOP/s ÷ TFLOP/s (>1 = FP8 faster). cos: cosine "
        "similarity of the fp8 + prologue output to the reference's (flex in the inputs' dtype). FP8 is "
        "inference-only: fwd+bwd cases have no FP8 rows.",
        "",
        "| mod | D | seqlen | B×H | dtype | cuDNN | fa3 auto | fp8 + prologue | template | fp8 kernel | prologue ms "
        "| prologue GB/s | " + " | ".join(FP8_RATIOS) + " | cos vs ref |",
        "|" + "---|" * 16,
    ]
    summary: dict[str, dict[str, list[float]]] = {}
    not_fp8 = 0
    for key in sorted(fp8_groups, key=_case_order):
        g = fp8_groups[key]
        _, mod, d, n, b, h, in_dtype = key
        cud, cud_s = tf(g, ("cudnn", None))
        auto, auto_s = tf(g, FA3_AUTO)
        full, full_s = tf(g, FP8_FULL)
        kern, kern_s = tf(g, FP8_KERNEL_ONLY)
        full_row = g.get(FP8_FULL) or {}
        template = full_row.get("template")
        if template is not None and template not in FP8_FAMILIES:
            not_fp8 += 1
            template = f"**{template}**"   # not the FP8 kernel: never to be read as one
        pro = g.get(FP8_PROLOGUE_ONLY)
        if pro is None:
            pro_ms = pro_bw = "—"
        elif pro.get("ms") is None:
            pro_ms = pro_bw = "err"
        else:
            pro_ms = f"{pro['ms']:.3f}"
            pro_bw = "—" if pro.get("gbps") is None else f"{pro['gbps']:.0f}"
            if copy_bw and pro.get("gbps") is not None:
                pro_bw += f" ({100 * pro['gbps'] * 1e9 / copy_bw:.0f}%)"
        ratios = (ratio(full, cud), ratio(full, auto), ratio(kern, cud))
        per = summary.setdefault(mod, {})
        is_fp8 = template in FP8_FAMILIES
        for name, r, counts in zip(FP8_RATIOS, ratios, (is_fp8, is_fp8, True)):
            if r is not None and counts:
                per.setdefault(name, []).append(r)
        cos = full_row.get("cosine_vs_ref")
        cells = [cud_s, auto_s, full_s, template or "—", kern_s, pro_ms, pro_bw]
        cells += ["—" if r is None else _fmt_ratio(r) for r in ratios]
        cells.append("—" if cos is None else f"{cos:.5f}")
        lines.append(f"| {mod} | {_fmt_dims(d)} | {n} | {b}×{h} | {DTYPE_SHORT.get(in_dtype, in_dtype)} | "
                     + " | ".join(cells) + " |")
    if not fp8_groups:
        lines.append("| (no FP8 rows) |" + " |" * 15)
    if not_fp8:
        lines += ["", f"{not_fp8} case(s) asked for fp8=True but ran the template shown in bold (not the FP8 "
                      "kernel); their fp8 + prologue ratios are left out of the summary."]
    summary = {m: per for m, per in summary.items() if per}
    if summary:
        lines += ["", "FP8 ratios (geometric mean, min) per mod:", "",
                  "| mod | " + " | ".join(FP8_RATIOS) + " |", "|---|" + "---|" * len(FP8_RATIOS)]
        for mod in sorted(summary, key=lambda m: MODS.index(m) if m in MODS else 99):
            cells = []
            for name in FP8_RATIOS:
                vals = summary[mod].get(name)
                cells.append("—" if not vals else f"{_fmt_ratio(math.exp(sum(map(math.log, vals)) / len(vals)))} "
                                                  f"(min {_fmt_ratio(min(vals))})")
            lines.append(f"| {mod} | " + " | ".join(cells) + " |")
    if skipped:
        reasons: dict[str, int] = {}
        for c in skipped:
            reasons[c["reason"]] = reasons.get(c["reason"], 0) + 1
        lines += ["", "No FP8 rows for:"] + [f"- {count} case(s): {reason}" for reason, count in reasons.items()]
    return lines


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
    p.add_argument("--preset", choices=PRESETS, default="quick",
                   help="smoke: tiny CPU harness check; quick: fits a 10-minute GPU command; fp8: quick's forward "
                        "noop/causal/softcap cases (D=128, and D=64/256 at 4k/16k) with --fp8 on; padded: head dims "
                        "80, 96, 160 and 192 (hidden 2000 / 2016 / 1920); mla: q/k head dim 192 with v 128 "
                        "(DeepSeek's latent attention, 16 heads); full: everything")
    p.add_argument("--fp8", action="store_true",
                   help="also time FP8 on every forward case (rows with dtype fp8: flex(..., fp8=True) with its "
                        "prologue, the FP8 kernel alone, the prologue alone); off by default, on with --preset fp8. "
                        "Inference-only: fwd+bwd cases get none")
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

    fp8 = args.fp8 or args.preset == "fp8"
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
        "fp8": fp8,
        "rows": [],
    }
    if fp8:
        result["fp8_skipped"] = []   # {case fields, reason} of the cases that got no FP8 rows
        try:
            result["fp8_recipe"] = dataclasses.asdict(_import_fa3().FP8Recipe())
        except Exception as exc:   # recorded; each case's FP8 rows then carry the error themselves
            result["fp8_recipe"] = None
            print(f"bench: fp8 recipe unavailable: {_describe(exc)}", file=sys.stderr)
        if device.type == "cuda":
            result["copy_bytes_per_s"] = copy_bandwidth(device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench-{device_slug(device_name)}-{now.strftime('%Y-%m-%d-%H%M')}"

    def log(msg):
        print(msg, flush=True)

    log(f"bench: {device_name}, torch {torch.__version__}, triton {triton.__version__}, {dtype}, "
        f"preset {args.preset}: {len(cases)} case(s), budget {args.budget_s:.0f} s" + (", fp8 rows on" if fp8 else ""))
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
                                       args.window, fp8=fp8, fp8_skipped=result.get("fp8_skipped"))
        except Exception as exc:  # the case's own set-up (inputs, block mask) failed
            result["cases_failed"].append({**vars(case), "error": _describe(exc)})
            log(f"  case failed: {_describe(exc)}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    result["elapsed_s"] = round(time.monotonic() - start, 1)
    if result.get("copy_bytes_per_s"):
        for row in result["rows"]:
            if row.get("gbps") is not None:
                row["fraction_of_copy"] = row["gbps"] * 1e9 / result["copy_bytes_per_s"]

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
