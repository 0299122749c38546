#!/usr/bin/env python3
"""fa3_inductor demo: a small transformer written the ordinary way, compiled with ``backend="fa3"``.

Each block is RMSNorm → q/k/v projections → FlexAttention (causal block mask + tanh softcap
score_mod, as FlexAttention users write it) → output projection → RMSNorm → SwiGLU MLP. Nothing
in the model knows about fa3_inductor: ``torch.compile(model, backend="fa3")`` finds the
attention and lowers it to our kernels.

The demo prints which attention sites were fused (and with which template), the largest
difference from eager PyTorch, and on a GPU the forward time against the same model compiled by
the stock Inductor backend.

    python3 examples/demo.py                 # GPU: bf16, batch 4, seq 2048, 16 heads × 128, 4 layers
    python3 examples/demo.py --device cpu    # CPU path: tiny model, float32, inference only
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._functorch.config
import torch._inductor.config
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

try:
    import fa3_inductor
except ModuleNotFoundError:  # running from a clone without `pip install -e .`
    sys.path.append(str(Path(__file__).resolve().parent.parent))
    import fa3_inductor

SOFTCAP = 30.0


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def tanh_softcap(score, b, h, q_idx, kv_idx):
    return SOFTCAP * torch.tanh(score / SOFTCAP)


@dataclass
class Config:
    vocab: int
    dim: int
    heads: int
    layers: int
    batch: int
    seqlen: int
    dtype: torch.dtype

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


GPU_CONFIG = Config(vocab=32000, dim=2048, heads=16, layers=4, batch=4, seqlen=2048, dtype=torch.bfloat16)
CPU_CONFIG = Config(vocab=256, dim=128, heads=2, layers=2, batch=2, seqlen=128, dtype=torch.float32)


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x, block_mask):
        b, s, d = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        y = flex_attention(q, k, v, score_mod=tanh_softcap, block_mask=block_mask)
        return self.wo(y.transpose(1, 2).reshape(b, s, d))


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

    def forward(self, x, block_mask):
        x = x + self.attn(self.attn_norm(x), block_mask)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens, block_mask):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, block_mask)
        return self.lm_head(self.norm(x))


def describe_sites(sites) -> list[str]:
    if not sites:
        return ["  none recorded: fa3_inductor lowered no flex_attention site in this process"]
    lines = []
    for i, site in enumerate(sites):
        fields = [f"template={site.get('template')}"]
        fields += [f"{key}={site[key]}" for key in ("score_mod", "mask_mod") if site.get(key) is not None]
        fields += [f"{key}={value}" for key, value in site.items()
                   if key not in ("template", "score_mod", "mask_mod", "fallback_reason")
                   and isinstance(value, (str, int, float, bool))]
        if site.get("fallback_reason"):
            fields.append(f"fallback: {site['fallback_reason']}")
        lines.append(f"  site {i}: " + ", ".join(fields))
    return lines


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

    print(f"device: {torch.cuda.get_device_name(device) if on_gpu else 'cpu'} "
          f"(torch {torch.__version__}, fa3_inductor from {fa3_inductor.__file__})")
    if not on_gpu:
        print("no CUDA GPU: running the CPU path. FlexAttention compiled by Inductor on CPU is inference-only, "
              "so everything runs under torch.no_grad(); fa3_inductor's GPU kernels are not used here.")
    print(f"model: {cfg.layers} layers, dim {cfg.dim}, {cfg.heads} heads × {cfg.head_dim}, vocab {cfg.vocab}; "
          f"input batch {cfg.batch} × seq {cfg.seqlen}, {str(cfg.dtype).replace('torch.', '')}; "
          f"attention: causal block mask + tanh softcap {SOFTCAP:g}")

    # Inductor's on-disk graph cache would serve a second run's graphs without lowering them again,
    # and then no site would be recorded: compile afresh so the demo always shows what fused.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False

    torch.manual_seed(0)
    model = Transformer(cfg).to(device=device, dtype=cfg.dtype).eval()
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seqlen), device=device)
    block_mask = create_block_mask(causal, None, None, cfg.seqlen, cfg.seqlen, device=device)

    with torch.no_grad(), warnings.catch_warnings():
        # Eager FlexAttention is the (unfused) reference here; its "use torch.compile" advice is expected.
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        expected = model(tokens, block_mask)

    with torch.no_grad():
        fa3_inductor.clear_lowered_sites()
        fa3_model = torch.compile(copy.deepcopy(model), backend="fa3")
        t0 = time.perf_counter()
        got = fa3_model(tokens, block_mask)
        compile_s = time.perf_counter() - t0
        sites = fa3_inductor.lowered_sites()

    print(f"\ncompiled with backend='fa3' in {compile_s:.1f} s; attention sites lowered:")
    print("\n".join(describe_sites(sites)))
    diff = (got.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    print(f"\nmax |fa3 - eager| = {diff:.3e} (max |eager| = {scale:.3e})")

    if on_gpu:
        import triton.testing

        inductor_model = torch.compile(copy.deepcopy(model), backend="inductor")
        with torch.no_grad():
            stock = inductor_model(tokens, block_mask)  # compile outside the timed region
        stock_diff = (stock.float() - expected.float()).abs().max().item()
        print(f"max |inductor - eager| = {stock_diff:.3e} (stock backend, for scale)")

        def timed(m):
            def fwd():
                with torch.no_grad():
                    return m(tokens, block_mask)

            return triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")

        ms_fa3, ms_inductor = timed(fa3_model), timed(inductor_model)
        print(f"\nforward (do_bench median): backend='fa3' {ms_fa3:.3f} ms, backend='inductor' {ms_inductor:.3f} ms "
              f"→ {ms_inductor / ms_fa3:.2f}× the stock Inductor speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
