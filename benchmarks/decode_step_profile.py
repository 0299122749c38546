"""Where a transformers generate() spends its time, sdpa against fa3 (issue 20's generate gap).

examples/generate.py measured fa3 at 0.53x sdpa's tokens/s on SmolLM2-135M (1 x 4k, static cache)
while our decode kernel is ~20 us of each layer's step. This script builds the same two models
(examples/generate.build_gguf_models or random weights) and, per implementation:

- the prefill (generate() of one new token, eager: transformers compiles decode steps only): its
  wall time (best of ``--repeats``) and, from one profiled prefill, the host work that should not
  be there: Python dispatch mode entries (``PythonDispatchMode``), compiled regions entered,
  frames Dynamo compiled, plans flex() made, aten ops that read a tensor on the host, and the
  CUDA runtime's synchronizations and device-to-host copies;
- with ``--new-tokens`` above 1, one profiled generate() after a warm-up (transformers compiles
  the static-cache decode step with stock Inductor and CUDA graphs): Inductor's CUDA-graph skip
  count (and, with TORCH_LOGS=perf_hints, the reason), the kernels launched per decode step, and
  the top CUDA and CPU ops.

    python3 benchmarks/decode_step_profile.py --prompt 4096 --new-tokens 1 --layers 8   # prefill
    TORCH_LOGS=perf_hints python3 benchmarks/decode_step_profile.py --gguf /tmp/smollm2.gguf
    python3 benchmarks/decode_step_profile.py --prompt 512 --new-tokens 8     # random weights
    TRITON_INTERPRET=1 python3 benchmarks/decode_step_profile.py --device cpu --prompt 64 \
        --new-tokens 1 --layers 2                 # CPU smoke check: the tiny model, float32
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


# aten ops that read a tensor's values on the host: each is a device sync on CUDA (item, bool, int
# and float all end in _local_scalar_dense; counting those too would count one read twice)
HOST_READS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::equal")
CUDA_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _activities(device: str) -> list:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])


@contextlib.contextmanager
def _counting_plans(counts: collections.Counter):
    """Counts flex()'s direct plans (fa3_inductor/direct.py plan_direct) made inside."""
    from fa3_inductor import direct

    planned = direct.plan_direct

    def counted(*args, **kwargs):
        counts["plans"] += 1
        return planned(*args, **kwargs)
    direct.plan_direct = counted
    try:
        yield
    finally:
        direct.plan_direct = planned


def profile_prefill(model, ids: torch.Tensor, device: str, repeats: int) -> dict:
    """A generate() of one new token (the eager prefill), after two warm-ups: best wall ms of
    ``repeats``, then per profiled prefill the host work counted (module docstring)."""
    import generate as gen
    from torch._dynamo.utils import counters
    from torch.profiler import profile

    for _ in range(2):   # plans, the mask builder's compile; a static cache's first offset is 0
        gen._generate(model, ids, 1)
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        gen._generate(model, ids, 1)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    made: collections.Counter = collections.Counter()
    frames = counters["frames"]["total"]
    with _counting_plans(made), profile(activities=_activities(device)) as prof:
        gen._generate(model, ids, 1)
        _sync(device)
    events = collections.Counter(e.name for e in prof.events())
    return {"prefill_ms": round(best * 1e3, 2),
            "python_dispatch_mode": events["PythonDispatchMode"],
            "compiled_regions": sum(n for k, n in events.items() if k.startswith("Torch-Compiled Region")),
            "frames_compiled": counters["frames"]["total"] - frames,
            "plans_made": made["plans"],
            "host_reads": {k: events[k] for k in HOST_READS if events[k]},
            "cuda_syncs": {k: events[k] for k in CUDA_SYNCS if events[k]},
            "memcpy_dtoh": sum(n for k, n in events.items() if k.startswith("Memcpy DtoH")),
            "profiled_cpu_ms": round(sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3, 2)}


def profile_impl(model, ids: torch.Tensor, new_tokens: int, device: str = "cuda") -> dict:
    """Warm-up, then one profiled generate(); a summary dict."""
    import generate as gen
    from torch._dynamo.utils import counters
    from torch.profiler import profile

    gen._generate(model, ids, new_tokens)
    _sync(device)
    skips = dict(counters["inductor"])
    t0 = time.perf_counter()
    gen._generate(model, ids, new_tokens)
    _sync(device)
    wall = time.perf_counter() - t0
    with profile(activities=_activities(device)) as prof:
        gen._generate(model, ids, new_tokens)
        _sync(device)
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
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke check with the tiny random model in float32 "
                             "(TRITON_INTERPRET=1: our kernels, through flex()'s direct path as on CUDA)")
    parser.add_argument("--repeats", type=int, default=5, help="prefills timed, best of")
    args = parser.parse_args()
    import generate as gen

    device = args.device
    if device == "cpu":
        from fa3_inductor import api

        api.DIRECT_ON_CPU = True   # the host path CUDA takes (ignored without the interpreter)
    elif not torch.cuda.is_available():
        raise SystemExit("decode_step_profile.py needs a CUDA GPU, or --device cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.gguf:
        models, tok, _ = gen.build_gguf_models(args.gguf, args.prompt + args.new_tokens + 8, device,
                                               dtype)
        text = gen._shared().shipped_text()
        ids = gen.text_prompt_ids(tok(text, add_special_tokens=False)["input_ids"], 1,
                                  args.prompt).to(device)
    else:
        models = gen.build_models(args.layers, args.prompt + args.new_tokens + 8, device == "cpu",
                                  device, dtype)
        vocab = (gen.TINY if device == "cpu" else gen.REALISTIC)["vocab_size"]
        ids = torch.randint(1, min(vocab, 1000), (1, args.prompt), device=device)
    prefills = {}
    with torch.no_grad():
        for impl, model in models.items():
            prefills[impl] = profile_prefill(model, ids, device, args.repeats)
            print(f"== {impl} prefill (1 x {args.prompt}): {json.dumps(prefills[impl])}", flush=True)
    print(f"== prefill ms fa3 / sdpa: {prefills['fa3']['prefill_ms']} / {prefills['sdpa']['prefill_ms']}")
    if args.new_tokens <= 1:
        return
    for impl, model in models.items():
        from torch._dynamo.utils import counters

        counters.clear()
        summary = profile_impl(model, ids, args.new_tokens, device)
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
