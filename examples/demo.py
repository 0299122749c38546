#!/usr/bin/env python3
"""fa3_inductor demo: a small transformer written the ordinary way, compiled with ``backend="fa3"``.

Each block is RMSNorm → q/k/v projections → attention written by hand the way model code
writes it (GQA through ``repeat_kv``, ``q @ kᵀ * scale``, a tanh softcap, a causal mask from
``tril`` filled with ``-inf``, a float32 softmax cast back, ``@ v``) → output projection →
RMSNorm → SwiGLU MLP. Nothing in the model knows about fa3_inductor:
``torch.compile(model, backend="fa3")`` recognizes the attention, rewrites it into one
flex_attention op and lowers it to our kernels.

The demo prints ``fa3_inductor.explain``'s report (what fused, with which template, and why
anything did not), the largest difference from eager PyTorch, and on a GPU the forward time
against the same model compiled by the stock Inductor backend.

    python3 examples/demo.py                 # GPU: bf16, batch 4, seq 2048, 16 heads × 128, 4 layers
    python3 examples/demo.py --device cpu    # CPU path: tiny model, float32, our generic kernel
                                             # under Triton's interpreter
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F



def import_fa3_inductor(cpu: bool):
    """Import fa3_inductor; on the CPU path first switch Triton's interpreter on (it must be on
    before any kernel is defined) so our generic kernel runs on CPU tensors."""
    if cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import fa3_inductor
    except ModuleNotFoundError:  # running from a clone without `pip install -e .`
        sys.path.append(str(Path(__file__).resolve().parent.parent))
        import fa3_inductor
    return fa3_inductor

SOFTCAP = 30.0


@dataclass
class Config:
    vocab: int
    dim: int
    heads: int
    kv_heads: int
    layers: int
    batch: int
    seqlen: int
    dtype: torch.dtype

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


GPU_CONFIG = Config(vocab=32000, dim=2048, heads=16, kv_heads=4, layers=4, batch=4, seqlen=2048,
                    dtype=torch.bfloat16)
CPU_CONFIG = Config(vocab=256, dim=64, heads=4, kv_heads=2, layers=2, batch=2, seqlen=64,
                    dtype=torch.float32)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, S, D) -> (B, Hkv * groups, S, D), as Llama-style code writes GQA."""
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        k = repeat_kv(k, self.heads // self.kv_heads)
        v = repeat_kv(v, self.heads // self.kv_heads)
        scores = (q @ k.transpose(-2, -1)) * self.head_dim ** -0.5
        scores = SOFTCAP * torch.tanh(scores / SOFTCAP)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        y = probs @ v
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        hidden = 4 * cfg.dim
        self.gate = nn.Linear(cfg.dim, hidden, bias=False)
        self.up = nn.Linear(cfg.dim, hidden, bias=False)
        self.down = nn.Linear(hidden, cfg.dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seqlen", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    overrides = {f: getattr(args, f) for f in ("layers", "seqlen", "batch") if getattr(args, f) is not None}
    cfg = dataclasses.replace(GPU_CONFIG if on_gpu else CPU_CONFIG, **overrides)

    fa3_inductor = import_fa3_inductor(cpu=not on_gpu)
    print(f"device: {torch.cuda.get_device_name(device) if on_gpu else 'cpu'} "
          f"(torch {torch.__version__}, fa3_inductor from {fa3_inductor.__file__})")
    if not on_gpu:
        print("no CUDA GPU: running the CPU path: a tiny model in float32, our generic kernel under "
              "Triton's interpreter (numerics only; timings mean nothing there)")
    print(f"model: {cfg.layers} layers, dim {cfg.dim}, {cfg.heads} heads ({cfg.kv_heads} kv heads) × "
          f"{cfg.head_dim}, vocab {cfg.vocab}; input batch {cfg.batch} × seq {cfg.seqlen}, "
          f"{str(cfg.dtype).replace('torch.', '')}; attention written by hand: repeat_kv, "
          f"softcap {SOFTCAP:g}, causal tril mask, float32 softmax")

    torch.manual_seed(0)
    model = Transformer(cfg).to(device=device, dtype=cfg.dtype).eval()
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seqlen), device=device)

    with torch.no_grad():
        expected = model(tokens)
        t0 = time.perf_counter()
        report = fa3_inductor.explain(model, tokens)
        compile_s = time.perf_counter() - t0
    print(f"\nfa3_inductor.explain (compiled with backend='fa3' in {compile_s:.1f} s):")
    print(report)

    with torch.no_grad():
        fa3_model = torch.compile(copy.deepcopy(model), backend="fa3")
        got = fa3_model(tokens)
    diff = (got.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    print(f"\nmax |fa3 - eager| = {diff:.3e} (max |eager| = {scale:.3e})")

    if on_gpu:
        import triton.testing

        inductor_model = torch.compile(copy.deepcopy(model), backend="inductor")
        with torch.no_grad():
            stock = inductor_model(tokens)  # compile outside the timed region
        stock_diff = (stock.float() - expected.float()).abs().max().item()
        print(f"max |inductor - eager| = {stock_diff:.3e} (stock backend, for scale)")

        def timed(m):
            def fwd():
                with torch.no_grad():
                    return m(tokens)

            return triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")

        ms_fa3, ms_inductor = timed(fa3_model), timed(inductor_model)
        print(f"\nforward (do_bench median): backend='fa3' {ms_fa3:.3f} ms, backend='inductor' "
              f"{ms_inductor:.3f} ms → {ms_inductor / ms_fa3:.2f}× the stock Inductor speed")
    return 0 if report.fused_count == cfg.layers else 1


if __name__ == "__main__":
    sys.exit(main())
