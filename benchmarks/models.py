#!/usr/bin/env python3
"""Model benchmark: transformers models nobody edited, forward time under each compiler.

For Llama, Mistral, Qwen2, Gemma2, Phi3 (medium), Phi3 mini and DeepSeek-V2-Lite (latent attention, dense
MLPs) at realistic layer sizes (the real models' hidden
size, heads, KV heads, head dim, sliding windows and softcaps; 2 layers, random weights, bf16,
batch 1) and seqlen 2k/4k/8k, times the base model's forward (no LM head) as:

* ``fa3``:       ``attn_implementation="eager"`` compiled with ``backend="fa3"`` (recognition
                 turns the hand-written attention into our kernels);
* ``inductor``:  the same model compiled with the stock ``backend="inductor"``;
* ``sdpa``:      ``attn_implementation="sdpa"``, not compiled (transformers' default);

and per model how many attention layers the fa3 backend fused, and on which template, and
each output's relative error against the eager-attention model run without compiling.
``--impls`` adds ``inductor_sdpa`` (the sdpa model compiled by stock Inductor), ``fa3_sdpa``, and the FP8
inference paths (issue 18): ``fa3_fp8`` (the eager-attention model compiled with ``backend="fa3"``,
``options={"fa3.fp8": True}``) and ``hf_fa3_fp8`` (``attn_implementation="fa3_fp8"``, not compiled);
their ``rel_err_vs_eager`` is the FP8 accuracy on the model, their ratio the speed against bf16 fa3.

Writes ``models-<device>-<date>.json`` (one object: device, torch, triton, date, rows, ...) and
``.md`` into ``--out`` (default ``$OUT`` or ``benchmarks/results``); the table is printed last.
``--budget-s`` bounds the run: a case (model × seqlen) starts only if the longest case so far
(at first: 60 s on a GPU) still fits before the budget ends. The JSON and table are rewritten
after every case, so a run stopped from outside (``timeout``) keeps every finished case.

Examples::

    python3 benchmarks/models.py --budget-s 300             # H100/H200: no case starts after ~300 s
    python3 benchmarks/models.py --models llama,gemma2 --seqlens 8192
    python3 benchmarks/models.py --smoke --out /tmp/m       # CPU: tiny sizes, checks the harness
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch

MODELS = ("llama", "mistral", "qwen2", "gemma2", "phi3", "phi3mini", "deepseek")
IMPLS = ("fa3", "inductor", "sdpa")
EXTRA_IMPLS = ("inductor_sdpa", "fa3_sdpa", "fa3_fp8", "hf_fa3_fp8")
SEQLENS = (4096, 2048, 8192)  # most telling first: a budget cut loses the least
LAYERS = 2

# Layer shapes of the real models (hidden, heads, KV heads, head dim, MLP width, window, caps).
REAL = {
    "llama": ("LlamaConfig", "Llama-3-8B", dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=14336, rope_theta=500000.0)),
    "mistral": ("MistralConfig", "Mistral-7B-v0.1", dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=14336, sliding_window=4096)),
    "qwen2": ("Qwen2Config", "Qwen2-7B", dict(
        hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
        intermediate_size=18944)),
    "gemma2": ("Gemma2Config", "Gemma-2-9B", dict(
        hidden_size=3584, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        intermediate_size=14336, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, sliding_window=4096)),
    "phi3": ("Phi3Config", "Phi-3-medium-4k", dict(
        hidden_size=5120, num_attention_heads=40, num_key_value_heads=10,
        intermediate_size=17920, sliding_window=2047, pad_token_id=0)),
    # head dim 96 (3072 / 32): the Hopper template's padded tiles
    "phi3mini": ("Phi3Config", "Phi-3-mini-4k", dict(
        hidden_size=3072, num_attention_heads=32, num_key_value_heads=32,
        intermediate_size=8192, sliding_window=2047, pad_token_id=0)),
    # multi-head latent attention: q/k head dim 192 (128 + 64 rope columns), v head dim 128; dense MLPs
    # (first_k_dense_replace past the last layer: the MoE layers are not what this benchmark measures)
    "deepseek": ("DeepseekV3Config", "DeepSeek-V2-Lite", dict(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        intermediate_size=10944, first_k_dense_replace=1000)),
}
# --smoke: the tests' tiny shapes (CPU, float32, a few seconds per model).
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
SMOKE_SEQLENS = (32,)
FIRST_CASE_ESTIMATE_S = 60.0  # a guess, not yet measured: two compiles of 2 layers + timings
VOCAB = 32000  # only the embedding sees it: the base model has no LM head


def model_config(name: str, smoke: bool, layers: int):
    """The config of model family ``name`` (real layer shapes, or tiny with ``smoke``)."""
    import transformers

    cls_name, _, real = REAL[name]
    kwargs = dict(real, num_hidden_layers=layers, vocab_size=128 if smoke else VOCAB,
                  max_position_embeddings=16384)
    if smoke:
        kwargs.update(TINY)
        if "sliding_window" in kwargs:
            kwargs["sliding_window"] = 12
        if name == "gemma2":
            kwargs.update(query_pre_attn_scalar=16, attn_logit_softcapping=0.02)
        if name == "qwen2":
            kwargs.pop("head_dim")
        if name == "deepseek":   # q/k 24 (16 + 8 rope), v 16
            kwargs.pop("head_dim")
            kwargs.update(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                          num_key_value_heads=TINY["num_attention_heads"])   # MLA has no GQA
    return getattr(transformers, cls_name)(**kwargs)


def time_ms(fn: Callable[[], object], device: torch.device) -> tuple[float, str]:
    """Median milliseconds of ``fn`` (warmed up already)."""
    if device.type == "cuda":
        import triton.testing

        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        return float(ms), "triton.testing.do_bench(warmup=25, rep=100, median)"
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples), "perf_counter median of 3 (CPU: not a performance figure)"


def _fresh_caches():
    """Inductor's on-disk caches off: a cached graph skips recognition and lowering, so the
    fused-site count would read 0."""
    import contextlib

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    stack = contextlib.ExitStack()
    stack.enter_context(inductor_config.patch(fx_graph_cache=False))
    stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
    return stack


def _fused_summary(recognized: list, lowered: list) -> dict[str, Any]:
    fused = [s for s in recognized if s.rewritten]
    templates = {}
    for s in lowered:
        templates[s.template] = templates.get(s.template, 0) + 1
    return {"fused": len(fused), "templates": templates,
            "left_alone": sorted({s.reason for s in recognized if not s.rewritten}),
            "fallback_reasons": sorted({s.fallback_reason for s in lowered
                                        if s.fallback_reason})}


def run_case(name: str, seqlen: int, impls: list[str], device: torch.device, dtype: torch.dtype,
             smoke: bool, layers: int, batch: int, log: Callable[[str], None]) -> list[dict]:
    """Time one model at one seqlen under every impl; one row per impl."""
    from transformers import AutoModel

    from fa3_inductor.report import site_records  # (imports the package: backend "fa3")

    torch._dynamo.reset()  # each case builds new modules: without a reset they pile up guards
    torch.manual_seed(0)
    cfg = model_config(name, smoke, layers)
    models: dict[str, torch.nn.Module] = {}

    def model(attn: str) -> torch.nn.Module:
        if attn not in models:
            with torch.device(device):  # random init on the device: seconds, not minutes
                m = AutoModel.from_config(cfg, attn_implementation=attn).to(dtype)
            if models:
                m.load_state_dict(next(iter(models.values())).state_dict())
            models[attn] = m.to(device).eval()
        return models[attn]

    ids = torch.randint(1, cfg.vocab_size, (batch, seqlen), device=device)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if getattr(cfg, "v_head_dim", None):   # latent attention: "q/k head dim/v head dim"
        head_dim = f"{cfg.qk_head_dim}/{cfg.v_head_dim}"
    base = {"model": name, "like": REAL[name][1], "seqlen": seqlen, "batch": batch,
            "layers": layers, "hidden": cfg.hidden_size, "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "dtype": str(dtype).replace("torch.", ""),
            "sliding_window": getattr(cfg, "sliding_window", None),
            "softcap": getattr(cfg, "attn_logit_softcapping", None)}
    # The reference is the eager-attention model, not compiled: the semantics every impl must
    # keep (the sdpa implementation drops Gemma2's softcap, so it is no reference there).
    with torch.no_grad():
        reference = model("eager")(ids).last_hidden_state.float()
    rows = []
    for impl in impls:
        backend = {"fa3": "fa3", "fa3_sdpa": "fa3", "fa3_fp8": "fa3", "inductor": "inductor",
                   "inductor_sdpa": "inductor"}.get(impl)
        attn = {"sdpa": "sdpa", "inductor_sdpa": "sdpa", "fa3_sdpa": "sdpa",
                "hf_fa3_fp8": "fa3_fp8"}.get(impl, "eager")
        row = dict(base, impl=impl, attn_implementation=attn, backend=backend or "eager")
        try:
            if attn == "fa3_fp8":
                from fa3_inductor.integrations.transformers import register

                register()
            m = model(attn)
            options = {"fa3.fp8": True} if impl == "fa3_fp8" else None
            fn = torch.compile(m, backend=backend, dynamic=False, options=options) if backend else m
            recognized_before, lowered_before = (len(x) for x in site_records())
            t0 = time.perf_counter()
            with torch.no_grad(), _fresh_caches():
                out = fn(ids).last_hidden_state
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            row["first_call_s"] = round(time.perf_counter() - t0, 2)
            # sibling variants compile on a background thread (runtime/variants.py) and hold the GIL
            # part of the time: timed with them running, a host-bound eager model reads slow
            from fa3_inductor.runtime.variants import wait_for_variants

            wait_for_variants()
            if attn == "fa3_fp8":   # flex(fp8=) per layer, no compile: the family that served it
                from fa3_inductor import last_template

                row["templates"] = {last_template(): layers}
            if backend == "fa3":
                recognized, lowered = site_records()
                row.update(_fused_summary(recognized[recognized_before:],
                                          lowered[lowered_before:]))
            with torch.no_grad():
                row["ms"], row["timer"] = time_ms(lambda: fn(ids), device)
            row["rel_err_vs_eager"] = float((out.float() - reference).norm() / reference.norm())
        except Exception as exc:  # one impl failing must not lose the others
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            log(f"    {impl}: FAILED {row['error']}")
            if os.environ.get("FA3_BENCH_TRACEBACK"):
                traceback.print_exc()
        rows.append(row)
    for row in rows:
        if "ms" in row:
            extra = f"  fused {row['fused']}/{layers} {row['templates']}" if "fused" in row else ""
            log(f"    {row['impl']:<14}{row['ms']:9.2f} ms  (first call {row['first_call_s']} s)"
                f"{extra}")
    models.clear()  # free the weights before the next case
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def markdown_table(result: dict) -> str:
    """Per (model, seqlen): ms of each impl, and fa3's speedup over the others."""
    rows = result["rows"]
    impls = [i for i in (*IMPLS, *EXTRA_IMPLS) if any(r["impl"] == i for r in rows)]
    keys = []
    for r in rows:
        if (r["model"], r["seqlen"]) not in keys:
            keys.append((r["model"], r["seqlen"]))
    others = [i for i in impls if i != "fa3"] if "fa3" in impls else []
    fp8 = [i for i in impls if i.endswith("fp8")]
    head = (["model", "seqlen"] + [f"{i} ms" for i in impls]
            + [f"{i}/fa3" for i in others] + ["fa3 fused", "fa3 err"] + [f"{i} err" for i in fp8])
    lines = [f"Forward ms, {result['device']}, torch {result['torch']}, triton "
             f"{result['triton']}, {result['date']}; ratio = other impl's ms / fa3's ms "
             "(> 1: fa3 faster). fa3 fused: attention layers fused / layers, and the templates "
             "that ran them. fa3 err: relative error of fa3's output against the eager-attention "
             "model (FP8 impls: theirs). sdpa ignores Gemma2's attention softcap (transformers' sdpa "
             "has none).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model, seqlen in keys:
        by = {r["impl"]: r for r in rows if (r["model"], r["seqlen"]) == (model, seqlen)}
        ms = {i: by[i].get("ms") for i in impls if i in by}
        fa3 = by.get("fa3", {})
        cells = [model, str(seqlen)]
        cells += [f"{ms[i]:.2f}" if ms.get(i) else ("failed" if i in by else "-") for i in impls]
        cells += [f"{ms[i] / ms['fa3']:.2f}x" if ms.get(i) and ms.get("fa3") else "-"
                  for i in others]
        fused = (f"{fa3['fused']}/{fa3['layers']} "
                 + ",".join(f"{k}:{v}" for k, v in fa3.get("templates", {}).items())
                 if "fused" in fa3 else "-")
        cells += [fused] + [f"{by[i]['rel_err_vs_eager']:.1e}" if "rel_err_vs_eager" in by.get(i, {})
                            else "-" for i in ("fa3", *fp8)]
        lines.append("| " + " | ".join(cells) + " |")
    failed = [r for r in rows if "error" in r]
    if failed:
        lines += ["", "Failures:"] + [f"- {r['model']} {r['seqlen']} {r['impl']}: {r['error']}"
                                      for r in failed]
    if result.get("cases_skipped"):
        lines += ["", f"Budget of {result['budget_s']:.0f} s: not run: "
                  + ", ".join(f"{m} {s}" for m, s in result["cases_skipped"])]
    return "\n".join(lines) + "\n"


def write_results(result: dict, out_dir: Path, stem: str) -> str:
    """Write ``<stem>.json`` and ``<stem>.md`` into ``out_dir``; returns the table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown_table(result)
    (out_dir / f"{stem}.md").write_text(table)
    return table


def _csv(allowed: tuple, cast: Callable = str) -> Callable[[str], list]:
    def parse(text: str) -> list:
        values = [cast(x) for x in text.split(",") if x]
        bad = [v for v in values if allowed and v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {allowed}")
        return values
    return parse


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=_csv(MODELS), default=list(MODELS))
    p.add_argument("--impls", type=_csv(IMPLS + EXTRA_IMPLS), default=list(IMPLS),
                   help=f"comma-separated, of {IMPLS + EXTRA_IMPLS} (default: {','.join(IMPLS)})")
    p.add_argument("--seqlens", type=_csv((), int), default=None,
                   help="comma-separated (default 4096,2048,8192; --smoke: 32)")
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--smoke", action="store_true",
                   help="tiny configs in float32 (CPU): checks the harness, times mean nothing")
    p.add_argument("--budget-s", type=float, default=600.0,
                   help="start no case that the longest case so far says would end past this")
    p.add_argument("--out", default=os.environ.get("OUT") or str(
        Path(__file__).resolve().parent / "results"))
    p.add_argument("--device", default=None)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    import triton

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float32 if args.smoke or device.type == "cpu" else torch.bfloat16
    seqlens = args.seqlens or list(SMOKE_SEQLENS if args.smoke else SEQLENS)
    device_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else "cpu " + (platform.processor() or platform.machine()))
    now = _dt.datetime.now(_dt.timezone.utc)
    result: dict[str, Any] = {
        "device": device_name, "torch": torch.__version__, "triton": triton.__version__,
        "date": now.isoformat(timespec="seconds"), "smoke": args.smoke,
        "argv": sys.argv[1:] if argv is None else list(argv), "budget_s": args.budget_s,
        "impl_definitions": {
            "fa3": 'attn_implementation="eager", torch.compile(backend="fa3", dynamic=False)',
            "inductor": 'attn_implementation="eager", torch.compile(backend="inductor", '
                        'dynamic=False)',
            "sdpa": 'attn_implementation="sdpa", eager (not compiled)',
            "inductor_sdpa": 'attn_implementation="sdpa", torch.compile(backend="inductor")',
            "fa3_sdpa": 'attn_implementation="sdpa", torch.compile(backend="fa3")',
            "fa3_fp8": 'attn_implementation="eager", torch.compile(backend="fa3", '
                       'options={"fa3.fp8": True}) (FP8 attention, inference)',
            "hf_fa3_fp8": 'attn_implementation="fa3_fp8", eager (not compiled; FP8 attention)'},
        "what": "base model forward (no LM head), torch.no_grad(), random weights",
        "cases_skipped": [], "rows": []}

    def log(msg: str) -> None:
        print(msg, flush=True)

    out_dir = Path(args.out)
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "unknown"
    stem = f"models-{slug}-{now.strftime('%Y-%m-%d-%H%M')}"
    cases = [(m, s) for s in seqlens for m in args.models]
    log(f"models: {device_name}, torch {torch.__version__}, triton {triton.__version__}, "
        f"{str(dtype).replace('torch.', '')}, {len(cases)} case(s), impls {args.impls}, "
        f"budget {args.budget_s:.0f} s")
    start, longest = time.monotonic(), (0.0 if args.smoke else FIRST_CASE_ESTIMATE_S)
    for i, (name, seqlen) in enumerate(cases):
        elapsed = time.monotonic() - start
        if elapsed + longest > args.budget_s:
            result["cases_skipped"] = [list(c) for c in cases[i:]]
            log(f"models: budget {args.budget_s:.0f} s: {len(cases) - i} case(s) not started "
                f"(elapsed {elapsed:.0f} s, longest case {longest:.0f} s)")
            break
        log(f"[{i + 1}/{len(cases)} {elapsed:5.0f}s] {name} seqlen {seqlen}")
        t0 = time.monotonic()
        result["rows"] += run_case(name, seqlen, args.impls, device, dtype, args.smoke,
                                   args.layers, args.batch, log)
        longest = max(longest, time.monotonic() - t0)
        result["elapsed_s"] = round(time.monotonic() - start, 1)
        table = write_results(result, out_dir, stem)  # after every case: a kill loses one case
    result["elapsed_s"] = round(time.monotonic() - start, 1)
    table = write_results(result, out_dir, stem)
    log(f"models: wrote {out_dir / stem}.json and .md ({result['elapsed_s']} s)\n")
    print(table, end="", flush=True)  # the table comes last
    failed = any("error" in r for r in result["rows"])
    return 1 if failed or not result["rows"] else 0


if __name__ == "__main__":
    # From a clone without `pip install -e .`: make the package importable (appended, so an
    # installed fa3_inductor still wins).
    sys.path.append(str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
