"""No stock Inductor behaviour changes: ``backend="inductor"`` generates the same code whether
fa3_inductor was never imported, or was imported and has compiled with ``backend="fa3"`` in the
same process.

Each variant runs in its own Python process (a fresh torch), with Inductor's caches off, and
prints Inductor's generated output code for a small model (attention through SDPA and written
by hand, MLP, layer norm) and for a flex_attention call with a score_mod and a block mask.
Paths and hashes that legitimately differ between processes are normalized before comparing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from generated_code import normalize_code

_PROGRAM = textwrap.dedent("""
    import json, os, sys
    import torch, torch.nn.functional as F
    import torch._inductor.config as inductor_config
    import torch._functorch.config as functorch_config
    from torch._inductor.utils import run_and_get_code
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False

    class Block(torch.nn.Module):
        def __init__(self, dim=32, heads=2):
            super().__init__()
            self.heads, self.norm = heads, torch.nn.LayerNorm(dim)
            self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 64), torch.nn.GELU(),
                                           torch.nn.Linear(64, dim))

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            w = torch.softmax((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5, dim=-1)
            a = a + w @ v
            x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
            return x + self.mlp(x)

    def softcapped(q, k, v, block_mask):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: 5.0 * torch.tanh(s / 5.0),
                              block_mask=block_mask)

    torch.manual_seed(0)
    model = Block().eval()
    x = torch.randn(2, 16, 32)
    q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
    block_mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, 128, 128, device="cpu")

    if sys.argv[1] == "after-fa3":
        import fa3_inductor  # noqa: F401
        with torch.no_grad():
            torch.compile(model, backend="fa3")(x)
            torch.compile(softcapped, backend="fa3", options={"fa3.template": "torch"})(
                q, k, v, block_mask)
        torch._dynamo.reset()
        codes_fa3 = fa3_inductor.lowered_sites()
    else:
        codes_fa3 = []

    codes = {"fa3_sites": [s["template"] for s in codes_fa3]}
    with torch.no_grad():
        _, codes["model"] = run_and_get_code(torch.compile(model, backend="inductor"), x)
        torch._dynamo.reset()
        _, codes["flex"] = run_and_get_code(torch.compile(softcapped, backend="inductor"),
                                            q, k, v, block_mask)
    codes["fa3_imported"] = "fa3_inductor" in sys.modules
    print("@@CODES@@" + json.dumps(codes))
""")


def _generated_code(variant: str) -> dict:
    # With the interpreter on, the fa3 compile really runs our lowering and kernels on the CPU.
    env = dict(os.environ, TRITON_INTERPRET="1")
    for name in ("TORCH_LOGS", "TORCHINDUCTOR_CACHE_DIR"):  # TORCH_LOGS="" breaks torch 2.13
        env.pop(name, None)
    run = subprocess.run([sys.executable, "-c", _PROGRAM, variant], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0, f"{variant}: exit {run.returncode}\n{run.stderr[-3000:]}"
    payload = run.stdout.split("@@CODES@@", 1)[1]
    return json.loads(payload)


def test_stock_inductor_code_is_unchanged_by_fa3_inductor():
    without = _generated_code("without")
    after = _generated_code("after-fa3")
    assert not without["fa3_imported"], "the baseline process imported fa3_inductor"
    assert after["fa3_imported"]
    # The fa3 compiles really lowered: the model's attention on our kernels (16-token queries: the
    # decode family), the flex call (fa3.template='torch') on torch's.
    ours = after["fa3_sites"][:-1]
    assert ours and set(ours) <= {"generic", "decode"} and after["fa3_sites"][-1] == "torch", after
    for name in ("model", "flex"):
        a = [normalize_code(c) for c in without[name]]
        b = [normalize_code(c) for c in after[name]]
        assert a, f"{name}: Inductor produced no output code"
        if a != b:
            import difflib
            diff = "\n".join(difflib.unified_diff("\n".join(a).splitlines(),
                                                  "\n".join(b).splitlines(), lineterm="", n=1))
            raise AssertionError(f"{name}: backend='inductor' code differs after importing and "
                                 f"using fa3_inductor:\n{diff[:4000]}")
