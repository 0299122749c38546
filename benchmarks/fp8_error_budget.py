"""FP8 attention on real activations: an error budget per step, and what each remedy buys.

CPU emulation in float64 with explicit e4m3 / int8 / bf16 roundings, on the Q, K, V of every layer of
SmolLM2-135M captured by ``benchmarks/fp8_activations.py --capture`` (``.snap/fp8_activations.pt``: 30
layers, 9 query / 3 key-value heads, 512 tokens, D 64, RoPE "half"; causal, scale D^-0.5, GQA, as
``fp8_activations.py --score`` scores it). Every configuration is scored per layer by the cosine of its
output (all heads, as ``fp8_accuracy.error_metrics``) against float64 attention on the same bf16
tensors; the summary is the mean and the worst cosine over layers, and 1 − cosine.

The arithmetic follows the kernel (``templates/generic/kernel.py``, ``_kv_tile_fp8``; docs/fp8.md):
RoPE (float64 here), the seeded Hadamard rotation of Q and K (``fp8_accuracy.hadamard_rotation``),
optional smoothing, one e4m3 scale amax/448 per ``block`` rows (float32 scales, the values divided in
float32 and cast with ``tensor.to(torch.float8_e4m3fn)``), V with power-of-two block scales folded into
P as ``shift = 8 + log2(v_scale / v_scale_max)``, P = exp2(s − m_running + shift) per 128-key tile (the
running max of the tiles visited so far, as the online softmax has it) cast to e4m3, the row sum from
the unrounded P, and the output written in bf16. Scores and sums are float64 (the kernel's S is an
exact fp32 sum of e4m3 products at D 64; its fp32 exp2 / FMA and the ~22-bit PV accumulator are left
out: with two-level accumulation over 4 tiles of 128 keys they are far below the e4m3 steps; the
``shipped (fp8_accuracy emulation)`` row runs the repo's fp32 emulation with the accumulator model for
comparison).

Parts of the report:

- budget: one step quantized at a time (Q and K; Q alone; K alone; V alone; P alone; the bf16 output
  alone) and all together, with and without the Hadamard rotation and K smoothing;
- where: per (layer, head) which step dominates, the heads' attention-sink mass (mean share of
  attention on key 0) and the cosine of early causal rows (< 128) against the rest;
- remedies: Q smoothing (with the per-key bias q̄·k added back in full precision), 64-row blocks,
  per-token scales, INT8 QKᵀ, per-channel V scales, V smoothing, P normalised by the row sum of the
  rounded P, P scaled to 448, P split into two e4m3 terms, PV in bf16; alone (only their step) and
  in the full pipeline, then combinations.

    python benchmarks/fp8_error_budget.py [--save .snap/fp8_activations.pt] [--layers 0-29] [--out DIR]

Writes ``fp8-error-budget-cpu-emulation-<YYYY-MM-DD-HHMM>.{json,md}`` into ``--out`` (default
``benchmarks/results/``). All 30 layers, all heads and rows (nothing is subsampled): 9 min wall (7 min of
CPU) measured on 2 cores shared with other jobs (load average 5), 10-25 s per layer; ``--layers`` runs
fewer.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (ROOT, HERE):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import fp8_accuracy as fa  # noqa: E402
from fa3_inductor.fp8_recipe import FP8Recipe, RopeSpec  # noqa: E402

Tensor = torch.Tensor
E4M3_MAX = 448.0
INT8_MAX = 127.0
LOG2E = 1.4426950408889634
TILE_N = 128             # the kernel's KV tile: P's running max advances per tile
DEFAULT_SAVE = ROOT / ".snap" / "fp8_activations.pt"


# ------------------------------------------------------------------------------------ configurations
@dataclasses.dataclass(frozen=True)
class Cfg:
    """One emulated pipeline: which steps are rounded and how.

    - ``q`` / ``k``: "exact", "e4m3" or "int8" (symmetric, amax/127); ``q_block`` / ``k_block`` rows per
      scale (1: per token, 0: per head).
    - ``hadamard``: rotate Q and K first. ``smooth_k``: subtract K's mean over tokens (exact under
      softmax). ``smooth_q``: "none", "head" (Q's mean over all tokens) or "block" (per ``q_block``
      rows); the per-key bias q̄·k' is added back to the scores in float64.
    - ``v``: "exact", "e4m3", "bf16"; ``v_scale``: "pow2" (the kernel: per ``v_block`` rows, rounded
      up to a power of two, folded into P), "channel" (one scale per channel over the head, applied to
      the output; P's shift is 8); ``smooth_v``: V's mean over tokens subtracted, added to the output.
    - ``p``: "exact", "e4m3", "split" (e4m3(P) + e4m3((P − e4m3(P))·16)/16: two PV MMAs), "bf16";
      ``p_max``: P's value at the running max (2^8 the kernel; 448 SageAttention2's static scale);
      ``p_norm``: "fp32" (row sum of the unrounded P, the kernel) or "rounded" (of the rounded P).
    - ``out_bf16``: the output rounded to bf16 (the kernel writes bf16).
    """

    q: str = "exact"
    k: str = "exact"
    q_block: int = 128
    k_block: int = 128
    hadamard: bool = True
    smooth_k: bool = False
    smooth_q: str = "none"
    v: str = "exact"
    v_block: int = 128
    v_scale: str = "pow2"
    smooth_v: bool = False
    p: str = "exact"
    p_max: float = 256.0
    p_norm: str = "fp32"
    out_bf16: bool = False


# The recipe as shipped when this budget was taken: FP8Recipe(qk="e4m3"). FP8Recipe() is now
# "full: INT8 QK" (the recommendation below, adopted).
SHIPPED = Cfg(q="e4m3", k="e4m3", v="e4m3", p="e4m3", out_bf16=True)


def R(**kw: Any) -> Cfg:
    """The shipped pipeline with some fields changed."""
    return dataclasses.replace(SHIPPED, **kw)


def only(**kw: Any) -> Cfg:
    """Everything exact but the fields given."""
    return Cfg(**kw)


QK8 = dict(q="e4m3", k="e4m3")
QKI8 = dict(q="int8", k="int8")

# name -> (group, config, what it costs in the kernel)
CONFIGS: dict[str, tuple[str, Cfg, str]] = {
    # ---- the budget: one step at a time
    "reference (float64)": ("budget", Cfg(), "-"),
    "bf16 output only": ("budget", only(out_bf16=True), "-"),
    "Q+K e4m3 (Hadamard)": ("budget", only(**QK8), "shipped"),
    "Q e4m3 only (Hadamard)": ("budget", only(q="e4m3"), "shipped"),
    "K e4m3 only (Hadamard)": ("budget", only(k="e4m3"), "shipped"),
    "Q+K e4m3, no Hadamard": ("budget", only(hadamard=False, **QK8), "-"),
    "Q+K e4m3 (Hadamard, smooth_k)": ("budget", only(smooth_k=True, **QK8), "shipped option"),
    "Q+K e4m3, no Hadamard, smooth_k": ("budget", only(hadamard=False, smooth_k=True, **QK8), "-"),
    "V e4m3 only (pow2 block scales)": ("budget", only(v="e4m3"), "shipped"),
    "P e4m3 only (2^8, fp32 row sum)": ("budget", only(p="e4m3"), "shipped"),
    "V and P e4m3, bf16 out (Q, K exact)": ("budget", R(q="exact", k="exact"), "shipped PV"),
    "all: shipped (Hadamard)": ("budget", SHIPPED, "shipped"),
    "all: no Hadamard": ("budget", R(hadamard=False), "-"),
    "all: Hadamard + smooth_k": ("budget", R(smooth_k=True), "shipped option"),
    "all: no Hadamard, smooth_k": ("budget", R(hadamard=False, smooth_k=True), "-"),
    # ---- remedies for the scores, alone (only Q and K rounded)
    "QK: smooth_k + smooth_q (head)": ("qk", only(smooth_k=True, smooth_q="head", **QK8),
                                        "+1 FADD per score (per-key bias vector b_j = q̄·k'_j, N floats per head "
                                        "from the prologue)"),
    "QK: smooth_k + smooth_q (128-row block)": ("qk", only(smooth_k=True, smooth_q="block", **QK8),
                                                "+1 FADD per score; bias matrix (M/128)×N per head (a GEMM of "
                                                "1/128 of QKᵀ's FLOPs)"),
    "QK: 64-row blocks": ("qk", only(q_block=64, k_block=64, **QK8),
                          "Q: free (per-row scale vector); K: +1 FMUL per score or 64-key tiles"),
    "QK: per-token Q scales": ("qk", only(q_block=1, **QK8), "free (the kernel's dequant is per row)"),
    "QK: per-token Q and K scales": ("qk", only(q_block=1, k_block=1, **QK8), "+1 FMUL per score (K's column scale)"),
    "QK: per-token Q+K, smooth_k": ("qk", only(q_block=1, k_block=1, smooth_k=True, **QK8), "+1 FMUL per score"),
    "QK: INT8 (128-row blocks)": ("qk", only(**QKI8), "INT8 MMA at the FP8 rate on H100 (1979 TOPS dense); +1 int32→fp32 per score"),
    "QK: INT8, smooth_k": ("qk", only(smooth_k=True, **QKI8), "+1 int32→fp32 per score"),
    "QK: INT8 per-token, smooth_k": ("qk", only(q_block=1, k_block=1, smooth_k=True, **QKI8),
                                      "+1 int32→fp32, +1 FMUL per score"),
    "QK: INT8 no Hadamard, smooth_k (SageAttention)": ("qk", only(hadamard=False, smooth_k=True, **QKI8),
                                                        "+1 int32→fp32 per score; no rotation in the prologue"),
    "QK: INT8, smooth_k + smooth_q (head)": ("qk", only(smooth_k=True, smooth_q="head", **QKI8),
                                             "+1 int32→fp32, +1 FADD per score"),
    # ---- remedies for V, alone
    "V: per-channel scales (per head)": ("v", only(v="e4m3", v_scale="channel"), "free (D multiplies per row at the end)"),
    "V: smooth_v (mean over tokens)": ("v", only(v="e4m3", smooth_v=True), "free (D adds per row at the end; the "
                                                                            "prologue subtracts the mean)"),
    "V: smooth_v + per-channel": ("v", only(v="e4m3", smooth_v=True, v_scale="channel"), "free"),
    # ---- remedies for P, alone
    "P: row sum of the rounded P": ("p", only(p="e4m3", p_norm="rounded"),
                                    "sum the rounded P: +1 cvt e4m3→f16/f32 per 2 scores, or a ones column in Vᵀ"),
    "P: scaled to 448 (not 2^8)": ("p", only(p="e4m3", p_max=448.0), "free (shift constant); the max is no longer a "
                                                                       "power of two with pow2 V ratios"),
    "P: split hi + lo (two e4m3 MMAs)": ("p", only(p="split"), "+1 PV MMA (+50% MMA FLOPs), +1 FADD +1 FMUL +1 cvt per "
                                                                "score"),
    "P: split + rounded row sum": ("p", only(p="split", p_norm="rounded"), "as split, + the rounded sum"),
    "P: bf16 (PV in bf16, V bf16)": ("p", only(p="bf16"), "PV at the bf16 rate: MMA time ×1.5 at D=K=V"),
    # ---- remedies in the full pipeline
    "full: smooth_k": ("full", R(smooth_k=True), "shipped option"),
    "full: smooth_k + smooth_v": ("full", R(smooth_k=True, smooth_v=True), "free"),
    "full: smooth_k + rounded row sum": ("full", R(smooth_k=True, p_norm="rounded"), "rounded sum"),
    "full: smooth_k + smooth_v + rounded row sum": ("full", R(smooth_k=True, smooth_v=True, p_norm="rounded"),
                                                    "rounded sum"),
    "full: smooth_k + smooth_q": ("full", R(smooth_k=True, smooth_q="head"), "+1 FADD per score"),
    "full: smooth_k + smooth_q (128-row block)": ("full", R(smooth_k=True, smooth_q="block"),
                                                  "+1 FADD per score, (M/128)×N bias per head"),
    "full: smooth_k + smooth_q + rounded row sum": ("full", R(smooth_k=True, smooth_q="head", p_norm="rounded"),
                                                    "+1 FADD per score, rounded sum"),
    "full: INT8 QK": ("full", R(q="int8", k="int8"), "+1 int32→fp32 per score"),
    "full: INT8 QK, smooth_k": ("full", R(q="int8", k="int8", smooth_k=True), "+1 int32→fp32 per score"),
    "full: INT8 QK, smooth_k + smooth_v": ("full", R(q="int8", k="int8", smooth_k=True, smooth_v=True),
                                           "+1 int32→fp32 per score"),
    "full: INT8 QK, smooth_k + rounded row sum": ("full", R(q="int8", k="int8", smooth_k=True, p_norm="rounded"),
                                                  "+1 int32→fp32 per score, rounded sum"),
    "full: INT8 QK, smooth_k + V per-channel": ("full", R(q="int8", k="int8", smooth_k=True, v_scale="channel"),
                                                "+1 int32→fp32 per score"),
    "full: INT8 QK, smooth_k + smooth_q": ("full", R(q="int8", k="int8", smooth_k=True, smooth_q="head"),
                                           "+1 int32→fp32, +1 FADD per score"),
    "full: INT8 per-token QK, smooth_k": ("full", R(q="int8", k="int8", q_block=1, k_block=1, smooth_k=True),
                                          "+1 int32→fp32, +1 FMUL per score"),
    "full: smooth_k, P split": ("full", R(smooth_k=True, p="split"), "+50% MMA FLOPs"),
    "full: smooth_k + smooth_q, PV bf16": ("full", R(smooth_k=True, smooth_q="head", p="bf16", v="bf16"),
                                           "MMA time ×1.5, +1 FADD per score"),
    "full: smooth_k, PV bf16 (QKᵀ only in FP8)": ("full", R(smooth_k=True, p="bf16", v="bf16"),
                                                 "MMA time ×1.5 (speedup bound over bf16 1.33× instead of 2×)"),
    "full: INT8 QK smooth_k, PV bf16": ("full", R(q="int8", k="int8", smooth_k=True, p="bf16", v="bf16"),
                                        "MMA time ×1.5, +1 int32→fp32 per score"),
}
BUDGET_STEPS = ("Q+K e4m3 (Hadamard)", "V e4m3 only (pow2 block scales)", "P e4m3 only (2^8, fp32 row sum)",
                "bf16 output only")
HIGHLIGHT = ("all: Hadamard + smooth_k", "full: smooth_k + smooth_q", "full: INT8 QK, smooth_k",
             "full: INT8 per-token QK, smooth_k")
DOMINANT_STEPS = {"QK": "Q+K e4m3 (Hadamard)", "V": "V e4m3 only (pow2 block scales)",
                  "P": "P e4m3 only (2^8, fp32 row sum)"}


# ------------------------------------------------------------------------------------------- rounding
def e4m3(x: Tensor) -> Tensor:
    """x rounded to float8_e4m3fn (through float32, saturating at ±448), back in x's dtype."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)


def bf16(x: Tensor) -> Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def row_scales(x: Tensor, block: int, top: float) -> Tensor:
    """Scales amax/top (float32 values, as the prologue stores them) per ``block`` rows of x (H, T, D)
    (1: per row, 0: per head), expanded to (H, T, 1); an all-zero block gets 1."""
    H, T, _ = x.shape
    a = x.abs().amax(dim=-1)                                   # (H, T)
    if block == 0 or block >= T:
        amax = a.amax(dim=-1, keepdim=True).expand(H, T)
    elif block > 1:
        nb = -(-T // block)
        amax = torch.nn.functional.pad(a, (0, nb * block - T)).view(H, nb, block).amax(-1)
        amax = amax.repeat_interleave(block, dim=-1)[:, :T]
    else:
        amax = a
    s = (amax / top).float().double()
    return torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(-1)


def fake_quant(x: Tensor, fmt: str, block: int) -> Tensor:
    """x (H, T, D) float64 quantized to ``fmt`` with per-``block`` row scales and dequantized."""
    if fmt == "exact":
        return x
    if fmt == "bf16":
        return bf16(x)
    if fmt == "e4m3":
        s = row_scales(x, block, E4M3_MAX)
        return e4m3((x / s).float()).double() * s           # divided in fp32, as the prologue
    if fmt == "int8":
        s = row_scales(x, block, INT8_MAX)
        return torch.round((x / s).float()).clamp(-INT8_MAX, INT8_MAX).double() * s
    raise ValueError(f"unknown format {fmt!r}")


def pow2_up(s: Tensor) -> Tensor:
    """s rounded up to a power of two (the prologue's V scales, _pow2_scale_of)."""
    m, e = torch.frexp(s)
    return torch.where(m == 0.5, s, torch.ldexp(torch.ones_like(s), e))


# ------------------------------------------------------------------------------------------ the layer
@dataclasses.dataclass
class Layer:
    """One layer's float64 tensors after RoPE (q (Hq, T, D), k / v (Hkv, T, D)), the float64
    reference output (Hq, T, D) and the Hadamard matrix."""

    q: Tensor
    k: Tensor
    v: Tensor
    ref: Tensor
    rot: Tensor
    scale: float
    group: int          # query heads per key/value head
    cache: dict = dataclasses.field(default_factory=dict)   # scores by their Q/K fields


def prepare_layer(snap: dict[str, Any], i: int) -> Layer:
    meta = snap["meta"]
    spec = RopeSpec(snap["cos"], snap["sin"], style="half")
    q, k, v = (snap[n][i:i + 1] for n in ("q", "k", "v"))
    ref = fa.reference_fp64(q, k, v, scale=meta["scale"], causal=True, rope=spec)[0]
    q64 = fa._rope_of(q, spec, "q", torch.float64)[0]
    k64 = fa._rope_of(k, spec, "k", torch.float64)[0]
    rot = fa.hadamard_rotation(q.shape[-1], FP8Recipe().seed).double()
    return Layer(q64, k64, v[0].double(), ref, rot, meta["scale"], q.shape[1] // k.shape[1])


def scores(layer: Layer, cfg: Cfg) -> Tensor:
    """S = q·kᵀ·scale (Hq, T, T) float64 after the configured Q/K steps (causal mask not applied)."""
    q, k = layer.q, layer.k
    if cfg.hadamard:
        q, k = q @ layer.rot, k @ layer.rot
    if cfg.smooth_k:
        k = k - k.mean(dim=-2, keepdim=True)
    qbar = None
    if cfg.smooth_q == "head":
        qbar = q.mean(dim=-2, keepdim=True).expand_as(q)
    elif cfg.smooth_q == "block":
        H, T, D = q.shape
        b = cfg.q_block if cfg.q_block > 1 else 128
        nb = -(-T // b)
        qp = torch.nn.functional.pad(q, (0, 0, 0, nb * b - T))
        qbar = qp.view(H, nb, b, D).mean(dim=2).repeat_interleave(b, dim=1)[:, :T]
        # the padded tail's zeros count in the last block's mean: recompute it on the real rows
        last = (nb - 1) * b
        qbar[:, last:] = q[:, last:].mean(dim=-2, keepdim=True)
    elif cfg.smooth_q != "none":
        raise ValueError(f"smooth_q must be none, head or block, got {cfg.smooth_q!r}")
    qs = q if qbar is None else q - qbar
    qd = fake_quant(qs, cfg.q, cfg.q_block)
    kd = fake_quant(k, cfg.k, cfg.k_block)
    kx = kd.repeat_interleave(layer.group, dim=0)
    s = qd @ kx.transpose(-1, -2)
    if qbar is not None:    # the per-key bias q̄·k', in full precision on the unquantized k'
        s = s + qbar @ k.repeat_interleave(layer.group, dim=0).transpose(-1, -2)
    return s * layer.scale


def attend(layer: Layer, cfg: Cfg) -> Tensor:
    """The configured pipeline's output (Hq, T, D) float64 (bf16 values when ``out_bf16``)."""
    key = (cfg.q, cfg.k, cfg.q_block, cfg.k_block, cfg.hadamard, cfg.smooth_k, cfg.smooth_q)
    if key not in layer.cache:
        layer.cache[key] = scores(layer, cfg)
    s = layer.cache[key]
    Hq, T, _ = s.shape
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    s2 = (s * LOG2E).masked_fill(mask, float("-inf"))
    # V: its quantized values and P's per-tile shift
    v = layer.v
    vbar = v.mean(dim=-2, keepdim=True) if cfg.smooth_v else torch.zeros_like(v[:, :1])
    vs_ = v - vbar
    nt = -(-T // TILE_N)
    if cfg.v == "e4m3" and cfg.v_scale == "channel":
        sc = (vs_.abs().amax(dim=-2, keepdim=True) / E4M3_MAX).float().double()
        sc = torch.where(sc > 0, sc, torch.ones_like(sc))
        vd = e4m3((vs_ / sc).float()).double() * sc
        shift = torch.full((vs_.shape[0], nt), 8.0, dtype=torch.float64)
    else:
        sv = pow2_up(row_scales(vs_, cfg.v_block, E4M3_MAX)[..., 0])          # (Hkv, T)
        vd = e4m3((vs_ / sv.unsqueeze(-1)).float()).double() * sv.unsqueeze(-1) if cfg.v == "e4m3" else \
            bf16(vs_) if cfg.v == "bf16" else vs_
        svt = sv[:, ::TILE_N] if cfg.v_block >= TILE_N else \
            torch.nn.functional.pad(sv, (0, nt * TILE_N - T)).view(sv.shape[0], nt, TILE_N).amax(-1)
        shift = (math.log2(cfg.p_max) + torch.log2(svt / svt.amax(dim=-1, keepdim=True))).clamp(max=math.log2(cfg.p_max))
    vx = vd.repeat_interleave(layer.group, dim=0)
    shift = shift.repeat_interleave(layer.group, dim=0)                         # (Hq, nt)
    # the online softmax: each tile's P relative to the running max after that tile
    pad = nt * TILE_N - T
    s2p = torch.nn.functional.pad(s2, (0, pad), value=float("-inf"))
    tile_max = s2p.view(Hq, T, nt, TILE_N).amax(-1)                              # (Hq, T, nt)
    run = torch.cummax(tile_max, dim=-1).values
    run = torch.where(torch.isinf(run), torch.zeros_like(run), run)
    m_fin = run[..., -1:]
    run_k = run.repeat_interleave(TILE_N, dim=-1)[..., :T]
    shift_k = shift.repeat_interleave(TILE_N, dim=-1)[:, None, :T]
    p = torch.exp2(s2 - run_k + shift_k)                                         # the kernel's P (≤ p_max)
    # back to exp2(s - m_final): the tile's rescale factor (alpha's product) and 2^-shift
    fac = torch.exp2(run - shift[:, None, :] - m_fin).repeat_interleave(TILE_N, dim=-1)[..., :T]
    l = (p * fac).sum(-1, keepdim=True)                                          # row sum, unrounded P
    if cfg.p == "e4m3":
        p8 = e4m3(p)
    elif cfg.p == "split":
        hi = e4m3(p)
        p8 = hi + e4m3((p - hi) * 16.0) / 16.0
    elif cfg.p == "bf16":
        p8 = bf16(p)
    elif cfg.p == "exact":
        p8 = p
    else:
        raise ValueError(f"unknown p {cfg.p!r}")
    w = p8 * fac
    if cfg.p_norm == "rounded":
        l = w.sum(-1, keepdim=True)
    o = (w @ vx) / l + vbar.repeat_interleave(layer.group, dim=0)
    return bf16(o) if cfg.out_bf16 else o


def cosine(a: Tensor, b: Tensor) -> float:
    a, b = a.flatten(), b.flatten()
    return float((a @ b) / (a.norm() * b.norm()))


def head_cosines(o: Tensor, ref: Tensor) -> list[float]:
    return [cosine(o[h], ref[h]) for h in range(o.shape[0])]


def layer_stats(layer: Layer) -> dict[str, float]:
    """Means over heads: |mean over tokens| / RMS of the rotated Q and K rows (how much smoothing can
    remove), and |v_0| / median |v_j| (the sink token's value norm)."""
    qr, kr = layer.q @ layer.rot, layer.k @ layer.rot

    def mean_share(x: Tensor) -> float:
        return float((x.mean(1).norm(dim=-1) / x.square().sum(-1).mean(-1).sqrt()).mean())

    vn = layer.v.norm(dim=-1)
    return dict(q_mean_share=mean_share(qr), k_mean_share=mean_share(kr),
                v0_over_median=float((vn[:, 0] / vn[:, 1:].median(-1).values).mean()))


def sink_mass(layer: Layer) -> list[float]:
    """Per query head: the mean over rows of the attention probability on key 0 (float64)."""
    s = (layer.q @ layer.k.repeat_interleave(layer.group, 0).transpose(-1, -2)) * layer.scale
    T = s.shape[-1]
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1)[..., 0].mean(-1).tolist()


# ------------------------------------------------------------------------------------------ the run
def run(snap: dict[str, Any], layers: Sequence[int], names: Sequence[str]) -> dict[str, Any]:
    per_layer = []
    spec = RopeSpec(snap["cos"], snap["sin"], style="half")
    for i in layers:
        t0 = time.perf_counter()
        layer = prepare_layer(snap, i)
        res: dict[str, Any] = {}
        heads: dict[str, list[float]] = {}
        early: dict[str, float] = {}
        for name in names:
            o = attend(layer, CONFIGS[name][1])
            res[name] = cosine(o, layer.ref)
            if CONFIGS[name][0] == "budget":
                heads[name] = head_cosines(o, layer.ref)
                early[name] = cosine(o[:, :TILE_N], layer.ref[:, :TILE_N])
                early[name + " (rows >= 128)"] = cosine(o[:, TILE_N:], layer.ref[:, TILE_N:])
        # the repo's fp32 emulation (accumulator model, fp32 softmax) of SHIPPED (e4m3 Q, K), as a check
        q, k, v = (snap[n][i:i + 1] for n in ("q", "k", "v"))
        o_fa = fa.emulate_fp8_attention(q, k, v, FP8Recipe(qk="e4m3"), scale=snap["meta"]["scale"], causal=True,
                                        rope=spec)
        res["shipped (fp8_accuracy emulation)"] = cosine(o_fa[0].double(), layer.ref)
        per_layer.append(dict(layer=i, cosine=res, head_cosine=heads, rows_cosine=early, sink=sink_mass(layer),
                              stats=layer_stats(layer),
                              seconds=round(time.perf_counter() - t0, 2)))
        print(f"layer {i:2d} ({time.perf_counter() - t0:.1f} s): shipped {res['all: shipped (Hadamard)']:.5f}, "
              f"QK {res['Q+K e4m3 (Hadamard)']:.5f}, V {res['V e4m3 only (pow2 block scales)']:.5f}, "
              f"P {res['P e4m3 only (2^8, fp32 row sum)']:.5f}", flush=True)
    all_names = list(names) + ["shipped (fp8_accuracy emulation)"]
    summary = {}
    for name in all_names:
        cs = [p["cosine"][name] for p in per_layer]
        worst = min(range(len(cs)), key=lambda j: cs[j])
        summary[name] = dict(group=CONFIGS[name][0] if name in CONFIGS else "check",
                             cost=CONFIGS[name][2] if name in CONFIGS else "-",
                             cosine_mean=statistics.fmean(cs), cosine_min=cs[worst],
                             worst_layer=per_layer[worst]["layer"],
                             one_minus_cos_mean=statistics.fmean(1 - c for c in cs),
                             layers_at_0999=sum(c >= 0.999 for c in cs), layers=len(cs))
    return dict(per_layer=per_layer, summary=summary, heads=heads_table(per_layer))


def heads_table(per_layer: list[dict[str, Any]]) -> dict[str, Any]:
    """Which step dominates per (layer, head), the heads' sink mass, and the worst heads of the
    shipped pipeline."""
    rows = []
    for p in per_layer:
        for h in range(len(p["sink"])):
            loss = {step: 1 - p["head_cosine"][name][h] for step, name in DOMINANT_STEPS.items()}
            rows.append(dict(layer=p["layer"], head=h, sink=p["sink"][h],
                             shipped=p["head_cosine"]["all: shipped (Hadamard)"][h],
                             dominant=max(loss, key=loss.get), **{f"loss_{s}": v for s, v in loss.items()}))
    counts = {s: sum(r["dominant"] == s for r in rows) for s in DOMINANT_STEPS}
    sinky = [r for r in rows if r["sink"] >= 0.5]
    rest = [r for r in rows if r["sink"] < 0.5]

    def mean_loss(rs: list[dict[str, Any]], s: str) -> Optional[float]:
        return statistics.fmean(r[f"loss_{s}"] for r in rs) if rs else None

    return dict(dominant_counts=counts, n_heads=len(rows),
                sink_heads=dict(n=len(sinky), **{f"loss_{s}": mean_loss(sinky, s) for s in DOMINANT_STEPS},
                                shipped=statistics.fmean(r["shipped"] for r in sinky) if sinky else None),
                other_heads=dict(n=len(rest), **{f"loss_{s}": mean_loss(rest, s) for s in DOMINANT_STEPS},
                                 shipped=statistics.fmean(r["shipped"] for r in rest) if rest else None),
                worst=sorted(rows, key=lambda r: r["shipped"])[:10])


# ------------------------------------------------------------------------------------------- report
def speed_bounds() -> dict[str, float]:
    """MMA-time bounds at D = 128 from H100 SXM dense specs (FP8 / INT8 1979, bf16 989 TFLOP/s):
    per score, QKᵀ and PV are D FMAs each; times in units of (D FMAs) / (TFLOP/s).

    Example::

        >>> round(speed_bounds()["speedup_qk_fp8_pv_bf16"], 2)
        1.33
    """
    fp8, b16 = 1979.0, 989.0
    full = 2 / fp8
    return dict(bf16=2 / b16, full_fp8=full, qk_fp8_pv_bf16=1 / fp8 + 1 / b16, p_split=3 / fp8,
                speedup_full_fp8=(2 / b16) / full, speedup_qk_fp8_pv_bf16=(2 / b16) / (1 / fp8 + 1 / b16),
                speedup_p_split=(2 / b16) / (3 / fp8))


def markdown(payload: dict[str, Any]) -> str:
    s = payload["summary"]
    lines = [f"# FP8 attention error budget on real activations (CPU emulation): {payload['device']}", "",
             f"CPU emulation (float64 with e4m3 / int8 / bf16 roundings), torch {payload['torch']}, "
             f"{payload['date']}; command `{payload['command']}`; {payload['seconds']:.0f} s.", "",
             f"Capture: {payload['capture']['model']}; {payload['capture']['tokens']} tokens; causal, GQA "
             f"{payload['capture']['q_heads']}/{payload['capture']['kv_heads']}, D {payload['capture']['head_dim']}, "
             f"scale D^-0.5, RoPE half. Layers {payload['layers_run']} (no subsampling of heads or rows). "
             "Reference: float64 attention on the same bf16 tensors. Cosine per layer over all heads.", ""]
    for group, title in (("budget", "Error budget: one step at a time, and all together"),
                         ("qk", "Remedies for the scores (only Q and K rounded)"),
                         ("v", "Remedies for V (only V rounded)"), ("p", "Remedies for P (only P rounded)"),
                         ("full", "Full pipeline with remedies (shipped: Hadamard, 128-row blocks, pow2 V, "
                                  "P e4m3 at 2^8, bf16 out)"), ("check", "Check")):
        names = [n for n in s if s[n]["group"] == group]
        if not names:
            continue
        lines += [f"## {title}", "", "| configuration | mean cosine | 1 − mean | worst layer (cosine) | layers ≥ 0.999 | "
                  "kernel cost |", "|---|---|---|---|---|---|"]
        for n in names:
            r = s[n]
            lines.append(f"| {n} | {r['cosine_mean']:.6f} | {r['one_minus_cos_mean']:.2e} | {r['worst_layer']} "
                         f"({r['cosine_min']:.5f}) | {r['layers_at_0999']}/{r['layers']} | {r['cost']} |")
        lines.append("")
    h = payload["heads"]
    lines += ["## Where: per (layer, head)", "",
              f"Dominant step (largest 1 − cosine of the head's output with only that step rounded), "
              f"{h['n_heads']} heads: " + ", ".join(f"{k} {v}" for k, v in h["dominant_counts"].items()) + ".", "",
              "| heads | n | mean 1 − cos: QK | V | P | shipped cosine |", "|---|---|---|---|---|---|"]
    for key, label in (("sink_heads", "sink mass on key 0 ≥ 0.5"), ("other_heads", "sink mass < 0.5")):
        r = h[key]
        if r["n"]:
            lines.append(f"| {label} | {r['n']} | {r['loss_QK']:.2e} | {r['loss_V']:.2e} | {r['loss_P']:.2e} | "
                         f"{r['shipped']:.5f} |")
    lines += ["", "Worst heads of the shipped pipeline:", "",
              "| layer | head | sink mass | shipped cosine | 1 − cos QK | V | P | dominant |", "|---|---|---|---|---|---|---|---|"]
    for r in h["worst"]:
        lines.append(f"| {r['layer']} | {r['head']} | {r['sink']:.3f} | {r['shipped']:.5f} | {r['loss_QK']:.2e} | "
                     f"{r['loss_V']:.2e} | {r['loss_P']:.2e} | {r['dominant']} |")
    e = payload["rows"]
    lines += ["", "Causal early rows (query tile 0, rows < 128) against the rest, mean cosine over layers:", "",
              "| step | rows < 128 | rows ≥ 128 |", "|---|---|---|"]
    for n in e:
        lines.append(f"| {n} | {e[n]['early']:.6f} | {e[n]['late']:.6f} |")
    b = payload["speed_bounds"]
    lines += ["", "## MMA-time bounds at D = 128 (H100 SXM dense specs: FP8/INT8 1979, bf16 989 TFLOP/s)", "",
              f"Speedup over bf16 at the MMA bound: full FP8 {b['speedup_full_fp8']:.2f}×, QKᵀ in FP8 with PV in bf16 "
              f"{b['speedup_qk_fp8_pv_bf16']:.2f}×, P split into two e4m3 PV MMAs {b['speedup_p_split']:.2f}×.", "",
              "## Per layer (cosine)", ""]
    show = [n for n in ("all: shipped (Hadamard)", "shipped (fp8_accuracy emulation)", "Q+K e4m3 (Hadamard)",
                        "V e4m3 only (pow2 block scales)", "P e4m3 only (2^8, fp32 row sum)") if n in s]
    show += [n for n in payload.get("highlight", []) if n in s and n not in show]
    lines += ["Statistics: sink = mean over heads of the attention share on key 0; q̄, k̄ = |mean over tokens| / RMS "
              "row norm of the rotated Q, K; v0 = |v_0| / median |v_j|.", "",
              "| layer | sink | q̄ | k̄ | v0 | " + " | ".join(show) + " |", "|---|---|---|---|---|" + "---|" * len(show)]
    for p in payload["per_layer"]:
        st = p["stats"]
        lines.append(f"| {p['layer']} | {statistics.fmean(p['sink']):.2f} | {st['q_mean_share']:.2f} | "
                     f"{st['k_mean_share']:.2f} | {st['v0_over_median']:.2f} | "
                     + " | ".join(f"{p['cosine'][n]:.5f}" for n in show) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save", default=str(DEFAULT_SAVE), help="the capture (benchmarks/fp8_activations.py --capture)")
    p.add_argument("--layers", default=None, help="layers, e.g. 0-3,25 (default: all)")
    p.add_argument("--configs", default=None, help="comma-separated substrings: run only matching configurations "
                                                   "(the budget rows always run)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from fp8_activations import load_capture

    snap = load_capture(args.save)
    layers = fa.parse_ints(args.layers) if args.layers else list(range(snap["meta"]["layers"]))
    names = list(CONFIGS)
    if args.configs:
        keys = [c.strip() for c in args.configs.split(",") if c.strip()]
        names = [n for n in names if CONFIGS[n][0] == "budget" or any(k in n for k in keys)]
    t0 = time.perf_counter()
    res = run(snap, layers, names)
    now = datetime.datetime.now()
    rows = {}
    for n in res["per_layer"][0]["rows_cosine"]:
        if n.endswith(" (rows >= 128)"):
            continue
        rows[n] = dict(early=statistics.fmean(pl["rows_cosine"][n] for pl in res["per_layer"]),
                       late=statistics.fmean(pl["rows_cosine"][n + " (rows >= 128)"] for pl in res["per_layer"]))
    payload = dict(device=fa.device_name("cpu"), torch=torch.__version__, python=platform.python_version(),
                   date=now.strftime("%Y-%m-%d %H:%M"), threads=args.threads,
                   command=fa.command_line("fp8_error_budget.py", argv),
                   impl="CPU emulation (float64 with e4m3/int8/bf16 roundings)",
                   capture={k: v for k, v in snap["meta"].items() if k != "text"}, layers_run=args.layers or "all",
                   configs={n: dict(group=CONFIGS[n][0], cost=CONFIGS[n][2], **dataclasses.asdict(CONFIGS[n][1]))
                            for n in names},
                   speed_bounds=speed_bounds(), rows=rows, highlight=list(HIGHLIGHT), seconds=time.perf_counter() - t0, **res)
    fa.write_result(args.out, f"fp8-error-budget-cpu-emulation-{now.strftime('%Y-%m-%d-%H%M')}", payload,
                    markdown(payload))
    print(f"{'configuration':<66} {'mean cos':>9} {'worst':>9} {'layer':>5}")
    for n, r in res["summary"].items():
        print(f"{n:<66} {r['cosine_mean']:>9.6f} {r['cosine_min']:>9.6f} {r['worst_layer']:>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
