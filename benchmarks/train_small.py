#!/usr/bin/env python3
"""Training run of a small Llama-style model: fa3 against eager SDPA and stock Inductor (issue 19).

A decoder written here in plain torch (RMSNorm, RoPE, SwiGLU MLP, causal attention; default 8 layers,
d_model 512, 8 heads of head dim 64, byte vocabulary 256: ~26M parameters) is trained for ``--steps``
steps on the bytes of Python's own standard library sources (on every machine, no network) under
each implementation, in one process, from one initialisation (a deepcopy per impl) on the same
batches (fixed seed):

* ``eager``:    not compiled, attention by ``F.scaled_dot_product_attention(is_causal=True)`` (the
                reference; eager ``flex_attention`` would be torch's unfused math path);
* ``inductor``: ``torch.compile(model, backend="inductor")``;
* ``fa3``:      ``torch.compile(model, backend="fa3")``;
* ``inductor_sdpa`` (only when named in ``--impls``): stock Inductor with SDPA (cuDNN / flash).

``inductor`` and ``fa3`` write attention as ``--attention``: ``flex`` (default: ``flex_attention`` with
a causal block mask, which the fa3 backend always serves; on the CPU ``fa3_inductor.flex``, since
torch's flex has no CPU backward) or ``sdpa`` (in a CUDA training graph the fa3 backend leaves plain
SDPA calls to SDPA: docs/first_use.md). Precision (``--precision``): fp32 weights and AdamW state under
bf16 autocast by default, or ``bf16`` weights without autocast; AdamW (betas 0.9/0.95, weight decay
0.1 on matrices), linear warm-up then cosine, grad clip 1.0. The CPU (and ``--smoke``) runs float32.

Per impl: the loss at every step, step time (CUDA events around forward + backward + optimizer step;
the median over steps after ``--warmup``; the first steps, compiles included, reported apart as wall
seconds), tokens/s, peak memory, and for fa3 which forward templates and backward families served
each attention site (``fa3_inductor.recognized_sites`` / ``lowered_sites`` / ``lowered_backward_sites``,
Inductor's on-disk caches off so every graph is lowered and recorded). Agreement with eager: the
max |Δloss| over all steps, and the mean |Δloss| and mean Δloss over the last 100 steps (criterion in
AGREEMENT below; stock Inductor's own difference from eager is the noise floor next to it).
A failing impl is recorded with its error; the others still run.

Writes ``train-small-<device>-<YYYY-MM-DD-HHMM>.{json,md,png}`` into ``--out`` (default ``$OUT`` or
``benchmarks/results``); the PNG needs matplotlib (skipped with a message without it).

Examples::

    python3 benchmarks/train_small.py                          # H100/H200: 3 impls x 300 steps, < 5 min
    python3 benchmarks/train_small.py --attention sdpa --impls eager,fa3
    python3 benchmarks/train_small.py --impls eager,inductor,fa3,inductor_sdpa --steps 200
    TRITON_INTERPRET=1 python3 benchmarks/train_small.py --smoke --device cpu --out /tmp/t
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime as _dt
import gc
import hashlib
import json
import math
import os
import platform
import re
import statistics
import sys
import sysconfig
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import commit_label  # noqa: E402

IMPLS = ("eager", "inductor", "fa3")
EXTRA_IMPLS = ("inductor_sdpa",)   # stock Inductor with SDPA whatever --attention says
BACKENDS = {"eager": None, "inductor": "inductor", "fa3": "fa3", "inductor_sdpa": "inductor"}


def attention_of(impl: str, attention: str) -> str:
    """How ``impl`` writes attention: eager and inductor_sdpa always SDPA, the others ``attention``."""
    return "sdpa" if impl in ("eager", "inductor_sdpa") else attention
LAST_K = 100   # agreement window: the last LAST_K steps (all of them in a shorter run)


@dataclasses.dataclass(frozen=True)
class Agreement:
    """Criterion for "the loss curves agree": over the last LAST_K steps, the mean |Δloss| and the
    |mean Δloss| (a drift of one curve above the other) against eager stay within these (nats)."""

    mean_abs: float
    mean_signed: float


# bf16: per-step losses of two numerically different runs on the same batches differ by rounding
# noise that grows as the trajectories part; a real error (a wrong gradient) shows as a drift that
# outgrows it. These bounds are set ahead of measurement: stock Inductor's own difference from eager,
# reported beside fa3's, is the noise floor to read them against. float32 (smoke): rounding only.
AGREEMENT = {"autocast_bf16": Agreement(mean_abs=0.05, mean_signed=0.02),
             "bf16": Agreement(mean_abs=0.05, mean_signed=0.02),
             "float32": Agreement(mean_abs=1e-3, mean_signed=1e-3)}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder. ``ffn`` is the SwiGLU hidden width."""

    vocab: int = 256
    d_model: int = 512
    layers: int = 8
    heads: int = 8
    head_dim: int = 64        # where the Hopper backward serves a plain causal site (hopper_bwd/family.py)
    ffn: int = 1408
    rope_base: float = 10000.0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What one run of one impl does; identical for every impl."""

    steps: int = 300
    warmup: int = 10          # steps left out of the step-time median (compiles happen here)
    batch: int = 8
    seq: int = 2048
    lr: float = 1.5e-3
    lr_warmup: int = 30
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    precision: str = "autocast_bf16"   # a key of PRECISIONS
    profile_steps: int = 0    # CUDA: extra steps after the run under torch.profiler (kernel breakdown)


SMOKE_MODEL = ModelConfig(d_model=64, layers=2, heads=2, head_dim=32, ffn=128)
SMOKE_TRAIN = TrainConfig(steps=4, warmup=1, batch=2, seq=64, lr=3e-3, lr_warmup=1, precision="float32")
PRECISIONS = {
    "autocast_bf16": "fp32 weights and AdamW state, forward/backward under torch.autocast(bfloat16)",
    "bf16": "bf16 weights and AdamW state, no autocast (RoPE tables, RMSNorm statistics and the loss in fp32)",
    "float32": "float32 throughout, no autocast",
}


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(seq: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[seq, head_dim // 2]`` (float32) of rotary embeddings, half rotation.

    Example::

        >>> cos, sin = rope_tables(16, 8, 10000.0); cos.shape
        torch.Size([16, 4])
    """
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of ``x [B, H, T, D]``; computed in float32, returned in x's dtype.

    Example::

        >>> cos, sin = rope_tables(8, 4, 10000.0); apply_rope(torch.ones(1, 1, 8, 4), cos, sin).shape
        torch.Size([1, 1, 8, 4])
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.heads * cfg.head_dim, bias=False)
        self.out = nn.Linear(cfg.heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Optional[Callable],
                block_mask: Optional[BlockMask]) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if attend is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = attend(q, k, v, block_mask=block_mask)
        return self.out(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.d_model), Attention(cfg)
        self.mlp_norm, self.mlp = RMSNorm(cfg.d_model), SwiGLU(cfg)

    def forward(self, x, cos, sin, attend, block_mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, attend, block_mask)
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    """A Llama-style decoder; ``forward(ids, targets, block_mask)`` returns the mean next-token
    cross-entropy. ``attend``: None for ``F.scaled_dot_product_attention(is_causal=True)``, else a
    function of flex_attention's signature called with the causal ``block_mask``.

    Example::

        >>> m = TinyLlama(SMOKE_MODEL, seq=64); ids = torch.randint(0, 256, (2, 64))
        >>> float(m(ids, ids).detach()) > 0
        True
    """

    def __init__(self, cfg: ModelConfig, seq: int, attend: Optional[Callable] = None):
        super().__init__()
        self.cfg, self.attend = cfg, attend
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        cos, sin = rope_tables(seq, cfg.head_dim, cfg.rope_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style: residual-branch outputs scaled down by depth so the stream starts near unit size
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * self.cfg.layers) if name.endswith(("out.weight", "down.weight")) \
                    else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor,
                block_mask: Optional[BlockMask] = None) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, self.cos, self.sin, self.attend, block_mask)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def causal(b, h, q_idx, kv_idx):
    """The causal mask_mod of the flex path (torch.nn.attention.flex_attention's convention)."""
    return q_idx >= kv_idx


def flex_function(device: torch.device) -> Callable:
    """The flex_attention the model calls on ``device``: torch's; on the CPU, where torch's has no
    backward, ``fa3_inductor.flex`` (its drop-in, trainable there under Triton's interpreter).

    Example::

        >>> flex_function(torch.device("cuda")) is flex_attention
        True
    """
    if device.type == "cpu":
        import fa3_inductor

        # One eager call first: traced cold, flex() graph-breaks where its kernel registry imports
        # the families lazily (importlib, which Dynamo will not trace), and the layer loop then
        # falls back to eager with one site compiled instead of every layer's.
        with torch.no_grad():
            fa3_inductor.flex(*(torch.zeros(1, 1, 16, 16) for _ in range(3)))
        return fa3_inductor.flex
    return flex_attention


def parameter_count(model: nn.Module) -> int:
    """Number of parameters. Example: ``parameter_count(nn.Linear(2, 3, bias=False)) == 6``."""
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def stdlib_corpus(max_bytes: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """The bytes of the standard library's ``.py`` files (sorted paths, site-packages left out) up
    to ``max_bytes``, as a uint8 tensor, and where they came from (directory, files, bytes, sha256).

    Example::

        >>> data, info = stdlib_corpus(1 << 16); data.dtype, info["bytes"]
        (torch.uint8, 65536)
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))
    chunks, size, used = [], 0, 0
    for path in files:
        try:
            blob = path.read_bytes()
        except OSError:
            continue
        chunks.append(blob + b"\n")
        size, used = size + len(blob) + 1, used + 1
        if size >= max_bytes:
            break
    raw = b"".join(chunks)[:max_bytes]
    if len(raw) < 1 << 16:
        raise RuntimeError(f"found only {len(raw)} bytes of Python sources under {root}: the training "
                           "corpus needs the standard library's .py files; run with a full Python install")
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()
    info = {"source": "python stdlib .py files", "root": str(root), "files": used, "bytes": len(raw),
            "sha256": hashlib.sha256(raw).hexdigest()[:16]}
    return data, info


def batch_offsets(data_len: int, steps: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """Start offsets ``[steps, batch]`` of every training window: the same for every impl.

    Example::

        >>> batch_offsets(10_000, 3, 2, 64, 0).shape
        torch.Size([3, 2])
    """
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, data_len - seq - 1, (steps, batch), generator=g)


def get_batch(data: torch.Tensor, offsets: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets ``[batch, seq]`` (int64) of the windows starting at ``offsets``.

    Example::

        >>> x, y = get_batch(torch.arange(100, dtype=torch.uint8), torch.tensor([0, 10]), 4); y[1]
        tensor([11, 12, 13, 14])
    """
    idx = offsets.to(data.device)[:, None] + torch.arange(seq + 1, device=data.device)
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


# --------------------------------------------------------------------------------------------
# One impl's run
# --------------------------------------------------------------------------------------------


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``cfg.lr``, then cosine down to a tenth of it at the last step.

    Example::

        >>> lr_at(299, TrainConfig(steps=300, lr=1e-3)) < 1.1e-4
        True
    """
    if step < cfg.lr_warmup:
        return cfg.lr * (step + 1) / cfg.lr_warmup
    span = max(1, cfg.steps - cfg.lr_warmup)
    progress = min(1.0, (step - cfg.lr_warmup) / span)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _fresh_caches():
    """Inductor's and AOT autograd's on-disk caches off: a cached graph is not lowered again, so
    the fa3 site records would stay empty (and compile times would not be comparable)."""
    import contextlib

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    stack = contextlib.ExitStack()
    stack.enter_context(inductor_config.patch(fx_graph_cache=False))
    stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
    return stack


def fa3_sites(recognized: list[dict], lowered: list[dict], backward: list[dict]) -> dict[str, Any]:
    """Which forward templates and backward families served the attention sites of one compile
    (records from fa3_inductor.report), joined per site by ``site_id``; ``ours`` is True when every
    rewritten site ran our forward and our backward (not torch's kernels, not the dense recompute).

    Example::

        >>> fa3_sites([], [], [])["ours"]
        False
    """
    fwd_by_id: dict[int, dict] = {}
    for s in lowered:
        if s.get("site_id") is not None:
            fwd_by_id.setdefault(s["site_id"], s)   # the first record is the forward's
    bwd_by_id = {s["site_id"]: s for s in backward if s.get("site_id") is not None}
    # Records without ids (a torch that drops node meta): paired in order only when the counts agree
    untagged = [r for r in recognized if r["rewritten"] and r.get("site_id") is None]
    fwd_untagged = [s for s in lowered if s.get("site_id") is None]
    bwd_untagged = [s for s in backward if s.get("site_id") is None]
    by_order = {id(r): (fwd_untagged[i] if len(fwd_untagged) == len(untagged) else None,
                        bwd_untagged[i] if len(bwd_untagged) == len(untagged) else None)
                for i, r in enumerate(untagged)}
    rows = []
    for r in recognized:
        row = {"front_door": r["front_door"], "node": r["node"], "rewritten": r["rewritten"],
               "reason": r.get("reason"), "mask": r.get("mask")}
        fwd, bwd = by_order.get(id(r)) or (fwd_by_id.get(r.get("site_id")), bwd_by_id.get(r.get("site_id")))
        if fwd is not None:
            row.update(template=fwd["template"], fallback_reason=fwd.get("fallback_reason"),
                       shape=fwd.get("shape"), note=fwd.get("note", ""))
        if bwd is not None:
            row.update(backward=bwd.get("family") or bwd.get("kernel"), backward_kernel=bwd.get("kernel"),
                       backward_reason=bwd.get("reason"))
        rows.append(row)
    served = [r for r in rows if r["rewritten"]]

    def counts(key: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in served:
            out[str(r.get(key))] = out.get(str(r.get(key)), 0) + 1
        return out

    fwd_ours = bool(served) and all(r.get("template") not in (None, "torch") for r in served)
    bwd_ours = bool(served) and all(r.get("backward") not in (None, "", "dense", "torch") for r in served)
    return {"sites": len(rows), "rewritten": len(served), "left_alone": [
                f"{r['front_door']} {r['node']}: {r['reason']}" for r in rows if not r["rewritten"]],
            "forward": counts("template"), "backward": counts("backward"),
            "forward_ours": fwd_ours, "backward_ours": bwd_ours, "ours": fwd_ours and bwd_ours,
            "rows": rows, "lowered_records": len(lowered), "backward_records": len(backward)}


def run_impl(impl: str, base: TinyLlama, attention: str, data: torch.Tensor, offsets: torch.Tensor,
             cfg: TrainConfig, device: torch.device, log: Callable[[str], None]) -> dict[str, Any]:
    """Train a deepcopy of ``base`` under ``impl`` on the batches ``offsets`` picks; the row of results.

    Example::

        >>> row = run_impl("eager", base, "flex", data, offsets, cfg, device, print)  # doctest: +SKIP
        >>> row["median_step_ms"], row["losses"][-1]                                 # doctest: +SKIP
    """
    import fa3_inductor

    cuda = device.type == "cuda"
    kind = attention_of(impl, attention)
    row: dict[str, Any] = {"impl": impl, "backend": BACKENDS[impl] or "none (eager)", "attention": kind}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    gc.collect()   # the previous impl's model, optimizer and compiled graphs
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = copy.deepcopy(base).to(device)
    if cfg.precision == "bf16":   # parameters only: the RoPE tables stay fp32
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    model.attend = flex_function(device) if kind == "flex" else None
    block_mask = create_block_mask(causal, None, None, cfg.seq, cfg.seq, device=device) \
        if kind == "flex" else None
    decay = [p for p in model.parameters() if p.dim() >= 2]   # no decay on the norms' gains
    keep = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": keep, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    fn = torch.compile(model, backend=BACKENDS[impl], dynamic=False) if BACKENDS[impl] else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "autocast_bf16")
    offsets = offsets.to(device)   # indexing it per step then needs no host-device copy (no sync)
    fa3_inductor.clear_lowered_sites()

    def step(s: int) -> torch.Tensor:
        x, y = get_batch(data, offsets[s], cfg.seq)
        with autocast:
            loss = fn(x, y, block_mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(s, cfg)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    losses, first_s, events, cpu_ms = [], [], [], []
    with _fresh_caches():
        for s in range(cfg.steps):
            if s < cfg.warmup:   # compiles: wall time, synchronized
                t0 = time.perf_counter()
                losses.append(step(s))
                if cuda:
                    torch.cuda.synchronize(device)
                first_s.append(time.perf_counter() - t0)
                if s == cfg.warmup - 1:
                    if impl == "fa3":
                        from fa3_inductor.runtime.variants import wait_for_variants

                        wait_for_variants()   # background sibling compiles must not land in a timing
                        row["fa3_sites"] = fa3_sites(fa3_inductor.recognized_sites(),
                                                     fa3_inductor.lowered_sites(),
                                                     fa3_inductor.lowered_backward_sites())
                    row["dynamo"] = _dynamo_counts()
            elif cuda:   # no sync per step: the events time the GPU's stream
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                losses.append(step(s))
                end.record()
                events.append((start, end))
            else:
                t0 = time.perf_counter()
                losses.append(step(s))
                cpu_ms.append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize(device)
        if cfg.profile_steps:   # after the losses are kept: these steps only time kernels
            row["profile"] = kernel_profile(step, range(cfg.steps - cfg.profile_steps, cfg.steps))
    step_ms = [a.elapsed_time(b) for a, b in events] if cuda else cpu_ms
    row["losses"] = [float(v) for v in torch.stack(losses).float().cpu()]
    row["first_steps_s"] = [round(v, 4) for v in first_s]
    row["step_ms"] = [round(v, 4) for v in step_ms]
    row["step_timer"] = ("CUDA events per step (batch gather, forward, backward, clip, AdamW), no sync "
                         "between steps" if cuda else "perf_counter per step (CPU: not a performance figure)")
    if step_ms:
        row["median_step_ms"] = statistics.median(step_ms)
        row["tokens_per_s"] = cfg.batch * cfg.seq / (row["median_step_ms"] / 1e3)
    if cuda:   # weights, AdamW state, activations and compile-time buffers of this impl
        row["peak_gb"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    row["recompiles_after_warmup"] = _dynamo_counts()["graphs"] - row["dynamo"]["graphs"]
    tail = row["losses"][-10:]
    row["final_loss"] = sum(tail) / len(tail)
    if "fa3_sites" in row:
        f = row["fa3_sites"]
        log(f"    fa3 sites: {f['rewritten']}/{f['sites']} rewritten, forward {f['forward']}, "
            f"backward {f['backward']}, ours: {f['ours']}")
    if row["dynamo"]["graph_breaks"] or row["recompiles_after_warmup"]:
        log(f"    {impl}: {row['dynamo']['graph_breaks']} graph break(s), {row['dynamo']['graphs']} graph(s), "
            f"{row['recompiles_after_warmup']} compiled after the warm-up")
    return row


def kernel_profile(step: Callable[[int], torch.Tensor], steps: range, top: int = 14) -> dict[str, Any]:
    """GPU kernels of ``steps`` training steps (torch.profiler, CUDA activity), per step: the ``top`` kernels
    by device time (name, ms, launches), the total, and the host's wall time per step (the steps run
    back to back, one sync at the end: above the GPU's total when the host cannot keep up); then the same
    steps under cProfile: the functions with the most cumulative host time per step.

    Example::

        >>> kernel_profile(step, range(290, 295))["gpu_ms_per_step"]      # doctest: +SKIP
        14.2
    """
    from torch.profiler import ProfilerActivity, profile

    from fa3_inductor.runtime import fast_launch

    torch.cuda.synchronize()
    launches = fast_launch.stats()
    collections: list[list[float]] = []   # Python's garbage collector: [generation, seconds] per collection

    def gc_timer(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append([info["generation"], time.perf_counter()])
        elif collections:
            collections[-1][1] = time.perf_counter() - collections[-1][1]

    gc.callbacks.append(gc_timer)
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for s in steps:
                step(s)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    finally:
        gc.callbacks.remove(gc_timer)
    n = len(steps)
    gc_per_step = {"collections": len(collections) / n,
                   "ms": sum(c[1] for c in collections) * 1e3 / n,
                   "oldest_generation": max((c[0] for c in collections), default=None)}
    launches = {k: (v - launches[k]) / n for k, v in fast_launch.stats().items()}
    from fp8_host import host_top   # benchmarks/ is the script's directory: sys.path[0]

    batches = iter(steps)
    host, own = host_top(lambda: step(next(batches)), n, top=30, own=25)   # the same steps, under cProfile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")   # one more step: where the host waits for the GPU
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(steps[0])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            where = f"{os.path.basename(w.filename)}:{w.lineno}"
            syncs[where] = syncs.get(where, 0) + 1
    kernels = sorted(((e.key, e.device_time_total / 1e3 / n, e.count / n) for e in prof.key_averages()
                      if e.device_time_total > 0), key=lambda k: -k[1])
    return {"steps": n, "wall_ms_per_step": wall * 1e3 / n, "host_top_us_per_step": host,
            "host_self_us_per_step": own, "syncs_per_step": syncs, "fast_launch_per_step": launches,
            "gc_per_step": gc_per_step,
            "gpu_ms_per_step": sum(k[1] for k in kernels),
            "launches_per_step": sum(k[2] for k in kernels), "distinct_kernels": len(kernels),
            "kernels": [{"name": name[:110], "ms_per_step": round(ms, 4), "launches_per_step": round(c, 2)}
                        for name, ms, c in kernels[:top]]}


def _dynamo_counts() -> dict[str, int]:
    """Graphs Dynamo compiled and graph breaks it met since the last ``counters.clear()``."""
    counters = torch._dynamo.utils.counters
    return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def agreement(losses: list[float], reference: list[float], crit: Agreement) -> dict[str, Any]:
    """Differences of one loss curve from the reference: max |Δ| over all steps; mean |Δ| and mean Δ
    over the last LAST_K; ``agrees`` by ``crit`` (NaN disagrees).

    Example::

        >>> agreement([1.0, 0.9], [1.0, 0.91], Agreement(0.05, 0.02))["agrees"]
        True
    """
    n = min(len(losses), len(reference))
    diff = [a - b for a, b in zip(losses[:n], reference[:n])]
    tail = diff[-LAST_K:]
    mean_abs = sum(abs(d) for d in tail) / len(tail)
    mean_signed = sum(tail) / len(tail)
    max_abs = max(abs(d) for d in diff)
    agrees = mean_abs <= crit.mean_abs and abs(mean_signed) <= crit.mean_signed  # False on NaN
    return {"steps": n, "window": len(tail), "max_abs": max_abs, "mean_abs_last": mean_abs,
            "mean_last": mean_signed, "agrees": bool(agrees),
            "criterion": dataclasses.asdict(crit)}


# --------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    """The results table, fa3's attention sites, and failures, from a result dict.

    Example::

        >>> print(markdown(json.loads(Path("train-small-....json").read_text())))   # doctest: +SKIP
    """
    cfg, rows = result["train"], result["rows"]
    crit = result["agreement_criterion"]
    tokens = cfg["batch"] * cfg["seq"]
    lines = [f"Training, {result['device']}, torch {result['torch']}, triton {result['triton']}, "
             f"{result['date']}; {result['params'] / 1e6:.1f}M params ({result['model_desc']}), "
             f"{cfg['steps']} steps of {cfg['batch']}x{cfg['seq']} bytes of Python stdlib source, "
             f"{PRECISIONS[cfg['precision']]}, AdamW. "
             f"Step ms: median over steps {cfg['warmup']}..{cfg['steps'] - 1} "
             f"({'CUDA events' if result['device_type'] == 'cuda' else 'perf_counter, CPU'}); first steps: "
             f"wall seconds of steps 0..{cfg['warmup'] - 1} (compiles). Final loss: mean of the last 10 "
             f"steps. Δ = loss - eager's loss at the same step; max over all steps, means over the last "
             f"{min(LAST_K, cfg['steps'])}; agrees when mean |Δ| ≤ "
             f"{crit['mean_abs']} and |mean Δ| ≤ {crit['mean_signed']} (nats).", "",
             "| impl | attention | params | tokens/step | step ms | tokens/s | first steps s | peak GB "
             "| final loss | max abs Δ | mean abs Δ (last) | mean Δ (last) | agrees |",
             "|" + "---|" * 13]
    for r in rows:
        if "losses" not in r:
            lines.append(f"| {r['impl']} | {r.get('attention', '-')} | {result['params'] / 1e6:.1f}M | "
                         f"{tokens} | {r.get('status', 'failed')} |" + " - |" * 8)
            continue
        a = r.get("vs_eager")
        ms = r.get("median_step_ms")
        cells = [r["impl"], r["attention"], f"{result['params'] / 1e6:.1f}M", str(tokens),
                 f"{ms:.1f}" if ms else "-", f"{r['tokens_per_s']:,.0f}" if ms else "-",
                 f"{sum(r['first_steps_s']):.1f}",
                 f"{r['peak_gb']:.2f}" if "peak_gb" in r else "-", f"{r['final_loss']:.4f}"]
        cells += ([f"{a['max_abs']:.4f}", f"{a['mean_abs_last']:.4f}", f"{a['mean_last']:+.4f}",
                   "yes" if a["agrees"] else "**no**"] if a else ["-"] * 4)
        lines.append("| " + " | ".join(cells) + " |")
    fa3 = next((r for r in rows if r["impl"] == "fa3" and "fa3_sites" in r), None)
    if fa3:
        f = fa3["fa3_sites"]
        lines += ["", f"fa3 attention sites: {f['rewritten']} of {f['sites']} became flex_attention ops; "
                  f"forward {f['forward']}, backward {f['backward']}; all ours (forward and backward): "
                  f"{'yes' if f['ours'] else 'no'}."]
        alone: dict[str, int] = {}
        for r in f["rows"]:
            if not r["rewritten"]:
                key = f"{r['front_door']}: {r['reason']}"
                alone[key] = alone.get(key, 0) + 1
        lines += [f"- left as written ({n} site(s)): {x}" for x, n in alone.items()]
        notes = sorted({r.get("fallback_reason") or r.get("backward_reason") or "" for r in f["rows"]
                        if r.get("template") == "torch" or r.get("backward") in ("dense", "torch")} - {""})
        lines += [f"- fallback: {x}" for x in notes]
    for r in rows:
        prof = r.get("profile")
        if prof:
            lines += ["", f"{r['impl']}: kernels per step (torch.profiler over {prof['steps']} steps after the "
                      f"run): GPU {prof['gpu_ms_per_step']:.2f} ms, host wall {prof['wall_ms_per_step']:.2f} ms, "
                      f"{prof.get('launches_per_step', 0):g} launches of {prof.get('distinct_kernels', 0)} kernels",
                      "", "| kernel | ms / step | launches / step |", "|---|---|---|"]
            lines += [f"| `{k['name']}` | {k['ms_per_step']:.3f} | {k['launches_per_step']:g} |"
                      for k in prof["kernels"]]
            if prof.get("gc_per_step"):
                g = prof["gc_per_step"]
                lines += ["", f"{r['impl']}: Python garbage collection per step: {g['collections']:g} collections, "
                          f"{g['ms']:.2f} ms (oldest generation {g['oldest_generation']})"]
            if prof.get("fast_launch_per_step"):
                lines += ["", f"{r['impl']}: runtime/fast_launch per step: "
                          + ", ".join(f"{k} {v:g}" for k, v in prof["fast_launch_per_step"].items())]
            lines += ["", f"{r['impl']}: device syncs in one step (torch.cuda.set_sync_debug_mode): "
                      + (", ".join(f"{k} ×{v}" for k, v in prof.get("syncs_per_step", {}).items()) or "none")]
            if prof.get("host_top_us_per_step"):
                lines += ["", f"{r['impl']}: host time per step by function (cProfile, cumulative µs): "
                          + "; ".join(f"{name} {us:,.0f}" for name, us in prof["host_top_us_per_step"])]
            if prof.get("host_self_us_per_step"):
                lines += ["", f"{r['impl']}: host time per step spent in each function itself (cProfile, µs): "
                          + "; ".join(f"{name} {us:,.0f}" for name, us in prof["host_self_us_per_step"])]
    failed = [r for r in rows if "error" in r or r.get("status") == "skipped"]
    if failed:
        lines += ["", "Not run or failed:"] + [f"- {r['impl']}: {r.get('error') or r.get('reason')}"
                                               for r in failed]
    return "\n".join(lines) + "\n"


def write_plot(result: dict, path: Path) -> Optional[Path]:
    """Loss curves of every impl, and below them each compiled impl's difference from eager; the
    path, or None (nothing written) without matplotlib or without a finished impl.

    Example::

        >>> write_plot(result, Path("/tmp/train.png"))   # doctest: +SKIP
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in result["rows"] if "losses" in r]
    if not rows:
        return None
    eager = next((r["losses"] for r in rows if r["impl"] == "eager"), None)
    fig, axes = plt.subplots(2 if eager else 1, 1, figsize=(8, 6.5 if eager else 4), sharex=True,
                             squeeze=False, gridspec_kw={"height_ratios": [2, 1]} if eager else None)
    colors = {"eager": "black", "inductor": "tab:blue", "inductor_sdpa": "tab:green", "fa3": "tab:red"}
    for r in rows:
        axes[0][0].plot(r["losses"], label=f"{r['impl']} ({r['attention']})", linewidth=1,
                        color=colors.get(r["impl"]), alpha=0.8)
    axes[0][0].set_ylabel("training loss (nats/byte)")
    axes[0][0].legend(fontsize=8)
    if eager:
        ax = axes[1][0]
        for r in rows:
            if r["impl"] != "eager":
                n = min(len(eager), len(r["losses"]))
                ax.plot([a - b for a, b in zip(r["losses"][:n], eager[:n])], linewidth=0.8,
                        color=colors.get(r["impl"]), label=f"{r['impl']} - eager",
                        alpha=1.0 if r["impl"] == "fa3" else 0.5)
        ax.axhline(0.0, color="gray", linewidth=0.6)
        ax.set_ylabel("loss - eager's")
        ax.legend(fontsize=8)
    axes[-1][0].set_xlabel("step")
    fig.suptitle(f"{result['model_desc']}, {result['train']['precision']}\n"
                 f"{result['device']}, torch {result['torch']}, {result['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_results(result: dict, out_dir: Path, stem: str) -> str:
    """Write ``<stem>.json`` and ``<stem>.md``; returns the table.

    Example::

        >>> write_results(result, Path("/tmp/t"), "train-small-test")   # doctest: +SKIP
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result)
    (out_dir / f"{stem}.md").write_text(table)
    return table


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def _git_commit() -> Optional[str]:
    return commit_label()


def _skip_reason(impl: str, attention: str, device: torch.device) -> Optional[str]:
    """Why ``impl`` cannot run on this machine, or None."""
    if device.type != "cpu" or impl == "eager":
        return None
    if impl != "fa3" and attention_of(impl, attention) == "flex":
        return ("torch's FlexAttention has no backward on the CPU: train the inductor impl there with "
                "--attention sdpa, or on a GPU")
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as exc:   # noqa: BLE001 (any failure: no usable compiler)
        return (f"Inductor on the CPU needs a C++ compiler ({type(exc).__name__}: {exc}); install g++ "
                "or run on a GPU")
    from triton import knobs

    if impl == "fa3" and not knobs.runtime.interpret:
        return ("fa3 trains on CPU tensors only under Triton's interpreter: set TRITON_INTERPRET=1 "
                "before starting the script")
    return None


def _csv(allowed: tuple) -> Callable[[str], list]:
    def parse(text: str) -> list:
        values = [x.strip() for x in text.split(",") if x.strip()]
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"unknown impl(s) {bad or text!r}; give a comma list of "
                                             f"{allowed}")
        return values
    return parse


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", type=_csv(IMPLS + EXTRA_IMPLS), default=list(IMPLS),
                   help=f"comma list of {IMPLS + EXTRA_IMPLS} (default: {','.join(IMPLS)}; run in that "
                        "order, eager first)")
    p.add_argument("--attention", choices=("flex", "sdpa"), default="flex",
                   help="how the compiled impls write attention (eager always uses SDPA); default flex")
    p.add_argument("--steps", type=int, default=None, help="training steps per impl (default 300; smoke 4)")
    p.add_argument("--warmup", type=int, default=None,
                   help="first steps left out of the step-time median (default 10; smoke 1)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile-steps", type=int, default=0,
                   help="CUDA: after each impl's run, this many more steps under torch.profiler; the results "
                        "list each impl's costliest kernels per step (default 0: none)")
    p.add_argument("--precision", choices=tuple(PRECISIONS), default=None,
                   help="; ".join(f"{k}: {v}" for k, v in PRECISIONS.items())
                   + " (default autocast_bf16; float32 on the CPU and in --smoke)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model, 4 steps, float32: checks the script end to end "
                        "(CPU with TRITON_INTERPRET=1)")
    p.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).resolve().parent / "results"))
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    """Run every impl, write the results; 0 when none failed (skipped ones do not count).

    Example::

        >>> main(["--smoke", "--device", "cpu", "--out", "/tmp/t"])   # doctest: +SKIP
        0
    """
    args = parse_args(argv)
    import triton

    import fa3_inductor

    def log(msg: str) -> None:
        print(msg, flush=True)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    mcfg = SMOKE_MODEL if args.smoke else ModelConfig()
    tcfg = SMOKE_TRAIN if args.smoke else TrainConfig()
    overrides = {k: getattr(args, k) for k in ("steps", "warmup", "batch", "seq", "profile_steps")
                 if getattr(args, k) is not None}
    tcfg = dataclasses.replace(tcfg, seed=args.seed, **overrides)
    if not 1 <= tcfg.warmup < tcfg.steps:
        raise SystemExit(f"--warmup {tcfg.warmup} with --steps {tcfg.steps}: the warm-up (compiles) needs at "
                         "least 1 step and must leave at least 1 timed step; change one of them")
    if not 0 <= tcfg.profile_steps <= tcfg.steps:
        raise SystemExit(f"--profile-steps {tcfg.profile_steps}: give 0 to {tcfg.steps} (it re-runs the last "
                         "steps' batches under the profiler)")
    if min(tcfg.batch, tcfg.seq) < 1:
        raise SystemExit(f"--batch {tcfg.batch} --seq {tcfg.seq}: both must be at least 1")
    if args.precision:
        tcfg = dataclasses.replace(tcfg, precision=args.precision)
    if device.type == "cpu" and tcfg.precision != "float32":   # the interpreter's bf16 dot is wrong
        log(f"train_small: precision {tcfg.precision} -> float32 on the CPU (Triton's interpreter computes "
            "bf16 dots wrongly; the comparison needs exact kernels)")
        tcfg = dataclasses.replace(tcfg, precision="float32")
    impls = [i for i in IMPLS + EXTRA_IMPLS if i in args.impls]
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" \
        else "cpu " + (platform.processor() or platform.machine())
    now = _dt.datetime.now(_dt.timezone.utc)
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "unknown"
    stem = f"train-small-{slug}-{now.strftime('%Y-%m-%d-%H%M')}"
    out_dir = Path(args.out)
    data, corpus = stdlib_corpus(max(1 << 20, min(16 << 20, 2 * tcfg.steps * tcfg.batch * (tcfg.seq + 1))))
    offsets = batch_offsets(len(data), tcfg.steps, tcfg.batch, tcfg.seq, tcfg.seed)
    data = data.to(device)
    torch.manual_seed(tcfg.seed)
    base = TinyLlama(mcfg, tcfg.seq)
    params = parameter_count(base)
    desc = (f"Llama-style, {mcfg.layers} layers, d_model {mcfg.d_model}, {mcfg.heads} heads x "
            f"{mcfg.head_dim}, SwiGLU {mcfg.ffn}, vocab {mcfg.vocab}")
    result: dict[str, Any] = {
        "device": device_name, "device_type": device.type, "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "fa3_inductor": fa3_inductor.__version__, "commit": _git_commit(),
        "date": now.isoformat(timespec="seconds"), "argv": sys.argv[1:] if argv is None else list(argv),
        "smoke": args.smoke, "model": dataclasses.asdict(mcfg), "model_desc": desc, "params": params,
        "train": dataclasses.asdict(tcfg), "attention": args.attention, "corpus": corpus,
        "agreement_criterion": dataclasses.asdict(AGREEMENT[tcfg.precision]), "agreement_window": LAST_K,
        "impl_definitions": {
            "eager": "not compiled, F.scaled_dot_product_attention(is_causal=True)",
            "inductor": f'torch.compile(model, backend="inductor", dynamic=False), attention {args.attention}',
            "inductor_sdpa": 'torch.compile(model, backend="inductor", dynamic=False), attention sdpa',
            "fa3": f'torch.compile(model, backend="fa3", dynamic=False), attention {args.attention}'
                   + (" (fa3_inductor.flex on the CPU: torch's flex_attention has no CPU backward)"
                      if args.attention == "flex" and device.type == "cpu" else "")},
        "rows": []}
    log(f"train_small: {device_name}, torch {torch.__version__}, triton {triton.__version__}; {desc}, "
        f"{params / 1e6:.1f}M params; {tcfg.steps} steps of {tcfg.batch}x{tcfg.seq}, {tcfg.precision}; "
        f"impls {impls}, attention {args.attention}; corpus {corpus['files']} files, {corpus['bytes']} bytes")
    start = time.monotonic()
    for impl in impls:
        reason = _skip_reason(impl, args.attention, device)
        if reason:
            log(f"  {impl}: skipped: {reason}")
            result["rows"].append({"impl": impl, "status": "skipped", "reason": reason})
            continue
        log(f"  {impl} ...")
        t0 = time.monotonic()
        try:
            row = run_impl(impl, base, args.attention, data, offsets, tcfg, device, log)
            row["status"] = "ok"
        except Exception as exc:  # one impl failing must not lose the others
            first_line = (str(exc).strip().splitlines() or [""])[0][:300]
            row = {"impl": impl, "status": "failed", "error": f"{type(exc).__name__}: {first_line}",
                   "traceback_tail": traceback.format_exc()[-3000:]}
            log(f"  {impl}: FAILED {row['error']}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
        row["wall_s"] = round(time.monotonic() - t0, 1)
        result["rows"].append(row)
        if "losses" in row:
            log(f"  {impl}: {row['wall_s']} s, first steps {sum(row['first_steps_s']):.1f} s, median step "
                f"{row.get('median_step_ms', float('nan')):.2f} ms, final loss {row['final_loss']:.4f}")
        _add_agreement(result)
        write_results(result, out_dir, stem)   # after every impl: a kill loses one impl
    result["elapsed_s"] = round(time.monotonic() - start, 1)
    table = write_results(result, out_dir, stem)
    try:
        png = write_plot(result, out_dir / f"{stem}.png")
        why = "matplotlib is not installed, or no impl finished"
    except Exception as exc:  # the plot is the last output: the numbers are written already
        png, why = None, f"plotting failed: {type(exc).__name__}: {exc}"
    log(f"train_small: wrote {out_dir / stem}.json, .md" + (", .png" if png else f" (no plot: {why})")
        + f" in {result['elapsed_s']} s\n")
    print(table, end="", flush=True)
    return 1 if any(r["status"] == "failed" for r in result["rows"]) else 0


def _add_agreement(result: dict) -> None:
    """Every finished impl's difference from eager's curve (``vs_eager``)."""
    eager = next((r for r in result["rows"] if r["impl"] == "eager" and "losses" in r), None)
    if eager is None:
        return
    crit = Agreement(**result["agreement_criterion"])
    for r in result["rows"]:
        if r is not eager and "losses" in r:
            r["vs_eager"] = agreement(r["losses"], eager["losses"], crit)


if __name__ == "__main__":
    # From a clone without `pip install -e .`: make the package importable (appended, so an
    # installed fa3_inductor still wins).
    sys.path.append(str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
