"""Where a transformers decode step spends its time, sdpa against fa3 (issue 20's generate gap).

examples/generate.py measured fa3 at 0.53x sdpa's tokens/s on SmolLM2-135M (1 x 4k, static cache)
while our decode kernel is ~20 us of each layer's step. This script builds the same two models
(examples/generate.build_gguf_models or random weights), warms generate() up (transformers compiles
the static-cache decode step with stock Inductor and CUDA graphs), then profiles one generate()
of each and prints: Inductor's CUDA-graph skip count (and, with TORCH_LOGS=perf_hints, the
reason), the kernels launched per decode step, and the top CUDA and CPU ops.

    TORCH_LOGS=perf_hints python3 benchmarks/decode_step_profile.py --gguf /tmp/smollm2.gguf
    python3 benchmarks/decode_step_profile.py --prompt 512 --new-tokens 8     # random weights
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


def profile_impl(model, ids: torch.Tensor, new_tokens: int) -> dict:
    """Warm-up, then one profiled generate(); a summary dict."""
    import generate as gen
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    gen._generate(model, ids, new_tokens)
    torch.cuda.synchronize()
    skips = dict(counters["inductor"])
    t0 = time.perf_counter()
    gen._generate(model, ids, new_tokens)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        gen._generate(model, ids, new_tokens)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    launches = sum(e.count for e in kernels)
    cuda = sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]
    cpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                 key=lambda e: -e.self_cpu_time_total)[:12]
    return {"generate_s": round(wall, 4), "kernel_launches": launches,
            "inductor_counters": {k: v for k, v in skips.items() if "cudagraph" in k or "skip" in k},
            "top_cuda": [(e.key[:90], e.count, round(e.self_device_time_total / 1e3, 3)) for e in cuda],
            "top_cpu": [(e.key[:90], e.count, round(e.self_cpu_time_total / 1e3, 3)) for e in cpu]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=None, help="GGUF file (default: random weights)")
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4, help="random weights only")
    args = parser.parse_args()
    import generate as gen

    if args.gguf:
        models, tok, _ = gen.build_gguf_models(args.gguf, args.prompt + args.new_tokens + 8, "cuda",
                                               torch.bfloat16)
        text = gen._shared().shipped_text()
        ids = gen.text_prompt_ids(tok(text, add_special_tokens=False)["input_ids"], 1,
                                  args.prompt).cuda()
    else:
        models = gen.build_models(args.layers, args.prompt + args.new_tokens + 8, False, "cuda",
                                  torch.bfloat16)
        ids = torch.randint(1, 1000, (1, args.prompt), device="cuda")
    for impl, model in models.items():
        from torch._dynamo.utils import counters

        counters.clear()
        summary = profile_impl(model, ids, args.new_tokens)
        print(f"== {impl}: generate of {args.new_tokens} tokens {summary['generate_s']} s, "
              f"{summary['kernel_launches']} kernel launches "
              f"({summary['kernel_launches'] / args.new_tokens:.0f} per token), "
              f"inductor counters {summary['inductor_counters']}")
        for title in ("top_cuda", "top_cpu"):
            print(f"-- {impl} {title} (name, calls, self ms)")
            for row in summary[title]:
                print("   ", row)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
