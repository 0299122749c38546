#!/usr/bin/env python3
"""Coverage harness: what ``backend="fa3"`` does with the attention of every model family we can
build, and whether the compiled model still computes the same outputs and gradients.

Families: every transformers model type in its auto mappings (benchmarks/coverage_hf.py), timm's
vision transformers and diffusers' attention blocks (benchmarks/coverage_vision.py). For each
family the harness builds a tiny model (random weights, eager attention where there is a choice,
eval mode so dropout is inactive), then

* runs it uncompiled in float64 (the reference) and in the run's dtype (the baseline: how far the
  model itself is from float64 in that dtype), forward and backward of a loss that weighs every
  output element differently;
* compiles it through ``fa3_inductor.explain(...)`` (``backend="fa3"``, gradients on, so the
  training graph and its backward are lowered) and runs the same forward and backward;
* records the sites explain() found, how many fused, the templates, the reason for each site left
  alone, whether the compile raised (and whether stock Inductor raises on the same model too), and
  whether outputs and every parameter's gradient are within tolerance.

Tolerance: the README's rule against float64, ``‖x − ref‖ / ‖ref‖ ≤ tol(dtype)`` (1e-4 float32,
2e-2 bfloat16), per output and per parameter gradient, or, where the uncompiled model in that
dtype is itself further from float64, at most 4× its error (a key projection's bias, whose true
gradient is 0, is noise in any dtype).

On CPU our generic kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, set here when
no GPU is visible). ``--device cuda --dtype bfloat16`` is the GPU run; there ``--timing`` also
times the forward of each family in :data:`TIMED_FAMILIES` at a realistic size against stock
Inductor (``backend="inductor"``).

Writes ``coverage-<cpu|gpu name>-<date>.json`` and ``.md`` into ``--out`` (default
benchmarks/results); both are rewritten after every family, and ``--resume`` skips the families
already in the JSON. ``--shard i/n`` runs every n-th family; ``--merge a.json b.json`` combines
shards.

Examples::

    python3 benchmarks/coverage.py --fast                      # the CI subset (a few families)
    python3 benchmarks/coverage.py --sources transformers --budget-s 3600
    python3 benchmarks/coverage.py --families bert,gpt2,t5 --out /tmp/cov
    python3 benchmarks/coverage.py --device cuda --dtype bfloat16 --timing   # H100/H200
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import json
import os
import platform
import signal
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

import torch  # noqa: E402  (does not import triton)

if __name__ == "__main__" and not torch.cuda.is_available():
    # our kernels on CPU tensors, before triton loads; as a script only: imported (by a test), it must
    # not switch the importing process to the interpreter (the sm90 compile session skips then)
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")         # tiny configs only: never ask the Hub

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Relative error allowed per dtype against float64 (tests/reference.py, README "Tolerance rule").
TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
BASELINE_FACTOR = 4.0    # or at most this many times the uncompiled model's own error

# --fast (CI): one encoder, one decoder, one encoder-decoder with a relative-position bias, and
# one ALiBi decoder (its bias raises 2 to a tensor power: the compile used to raise on it).
FAST_FAMILIES = ("bert", "gpt2", "t5", "mpt")

# The 10 families timed at a realistic size on the GPU (--timing): the architectures of the most
# downloaded models on the Hugging Face Hub, as we read its "most downloads" listings (sentence
# encoders, CLIP/ViT image towers, Whisper, the Llama/Qwen/Mistral/Gemma decoders, GPT-2, T5).
# Our reading, not a fetched ranking: this machine cannot reach the Hub. Each: (family, batch,
# sequence length or image side).
TIMED_FAMILIES = (
    ("bert", 8, 512), ("roberta", 8, 512), ("xlm-roberta", 8, 512), ("mpnet", 8, 512),
    ("gpt2", 4, 1024), ("t5", 4, 512), ("llama", 1, 4096), ("qwen2", 1, 4096),
    ("mistral", 1, 4096), ("vit", 32, 224),
)

_STOCK_FAILS = "stock Inductor raises too"
_OUR_BUG = "bug in fa3_inductor"   # in the reason of a site our guard left to stock Inductor


# ------------------------------------------------------------------------------------------
# Families
# ------------------------------------------------------------------------------------------

class Family:
    """One row of the table: a name, where it comes from, and how to build it.

    ``build(realistic)`` returns ``(model, inputs)`` (float32, eval mode) or raises the source's
    ``Excluded`` with the reason.

    Example::

        >>> Family("bert", "transformers", lambda realistic: build_hf("bert"))   # doctest: +SKIP
    """

    def __init__(self, name: str, source: str, build: Callable[..., tuple[torch.nn.Module, dict]]):
        self.name, self.source, self.build = name, source, build


def families(sources: list[str]) -> list[Family]:
    """The families of the given sources ("transformers", "timm", "diffusers"), in that order.

    Example::

        >>> [f.name for f in families(["transformers"])][:2]   # doctest: +SKIP
        ['afmoe', 'aimv2']
    """
    out: list[Family] = []
    for source in sources:
        if source == "transformers":
            from coverage_hf import build_hf, hf_families

            out += [Family(name, "transformers",
                           lambda realistic=False, batch=None, seq=None, name=name: build_hf(
                               name, realistic, **_size_kwargs(batch, seq)))
                    for name in hf_families()]
        elif source in ("timm", "diffusers"):
            import coverage_vision

            listed = (coverage_vision.timm_families() if source == "timm"
                      else coverage_vision.diffusers_families())
            out += [Family(n, source, b) for n, b in listed]
        else:
            raise ValueError(f"unknown source {source!r}: use transformers, timm or diffusers")
    return out


def _size_kwargs(batch: Optional[int], seq: Optional[int]) -> dict:
    return {k: v for k, v in (("batch", batch), ("seq", seq)) if v is not None}


# ------------------------------------------------------------------------------------------
# Checking one family
# ------------------------------------------------------------------------------------------

def _floats(out: Any) -> list[torch.Tensor]:
    """The floating tensors in a model output (ModelOutput, tuple, dict, tensor), in order."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() and out.requires_grad else []
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in _floats(item)]
    return []


def _cast(inputs: dict, dtype: torch.dtype, device: torch.device) -> dict:
    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(device, dtype) if x.is_floating_point() else x.to(device)
        return x
    return {k: one(v) for k, v in inputs.items()}


def _run(model: torch.nn.Module, inputs: dict, weights: Optional[list] = None
         ) -> tuple[list[torch.Tensor], dict[str, Optional[torch.Tensor]], list]:
    """Forward, then backward of Σ outᵢ·wᵢ; returns outputs, parameter grads, the weights."""
    outs = _floats(model(**inputs))
    return _backward(model, outs, weights)


def _backward(model, outs, weights):
    if not outs:
        raise RuntimeError("the model returned no floating output that depends on its parameters")
    if weights is None:
        gen = torch.Generator().manual_seed(7)
        weights = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs]
    loss = sum((o.double() * w.to(o.device)).sum() for o, w in zip(outs, weights))
    loss.backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else None)
             for n, p in model.named_parameters()}
    return [o.detach() for o in outs], grads, weights


def _rel(x: Optional[torch.Tensor], ref: Optional[torch.Tensor]) -> float:
    """Relative error; NaN/inf must sit where the reference has them (then the rest is compared)."""
    if x is None or ref is None:
        other = ref if x is None else x
        return 0.0 if other is None or not bool(other.abs().max() > 0) else float("inf")
    x, ref = x.double(), ref.double().to(x.device)
    if x.shape != ref.shape:
        return float("inf")
    bad, ref_bad = ~torch.isfinite(x), ~torch.isfinite(ref)
    if not torch.equal(bad, ref_bad) or not torch.equal(x[bad].nan_to_num(), ref[bad].nan_to_num()):
        return float("inf")
    x, ref = x[~bad], ref[~bad]
    d, err = ref.norm().item(), (x - ref).norm().item()
    return err / d if d > 0 else (0.0 if err == 0 else float("inf"))


def _compare(values: dict[str, Any], ref: dict[str, Any], base: dict[str, Any], tol: float
             ) -> tuple[float, bool, str]:
    """Worst relative error over the entries, whether each is within its tolerance, and the
    worst offender's name."""
    worst, ok, who = 0.0, True, ""
    for key, r in ref.items():
        err = _rel(values.get(key), r)
        allowed = max(tol, BASELINE_FACTOR * _rel(base.get(key), r))
        if err > allowed:
            ok = False
        if err > worst or (not ok and not who):
            worst, who = err, key
    return worst, ok, who


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise _Timeout in the main thread after ``seconds`` (POSIX; no-op elsewhere)."""
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def fire(*_: Any) -> None:
        raise _Timeout(f"family took longer than {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class _SoftmaxCounter(torch.overrides.TorchFunctionMode):
    """Counts softmax and SDPA calls of an eager forward: attention that recognition never saw
    (sites < softmaxes) shows up in the table."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("softmax", "scaled_dot_product_attention", "flex_attention"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def check_family(fam: Family, device: torch.device, dtype: torch.dtype, limit_s: float = 0
                 ) -> dict[str, Any]:
    """Build, reference, compile through explain(), compare. One table row (a dict).

    Example::

        >>> row = check_family(families(["transformers"])[0], torch.device("cpu"), torch.float32)   # doctest: +SKIP
    """
    import fa3_inductor

    row: dict[str, Any] = dict(family=fam.name, source=fam.source)
    t0 = time.perf_counter()
    torch._dynamo.reset()
    try:
        with _time_limit(limit_s):
            _check(fam, device, dtype, row)
    except _Timeout as exc:
        row.setdefault("excluded", f"timed out: {exc}")
    except Exception as exc:   # the harness itself must get through every family
        row.setdefault("excluded", f"harness error: {type(exc).__name__}: {_line(exc)}")
        row["traceback"] = traceback.format_exc()[-2000:]
    row["seconds"] = round(time.perf_counter() - t0, 1)
    del fa3_inductor
    return row


def _line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else "")[:300]


def _check(fam: Family, device: torch.device, dtype: torch.dtype, row: dict) -> None:
    import fa3_inductor

    excluded = _excluded_types()
    try:
        model, inputs = fam.build()
    except excluded as exc:
        row["excluded"] = str(exc)
        return
    except Exception as exc:
        row["excluded"] = f"does not build: {type(exc).__name__}: {_line(exc)}"
        return
    row["model"] = type(model).__name__
    row["kind"] = _kind(fam, model, inputs)
    # Reference (float64) and baseline (uncompiled, run dtype).
    try:
        ref_model = copy.deepcopy(model).to(device, torch.float64)
        counter = _SoftmaxCounter()
        with counter:
            ref_out, ref_grads, weights = _run(ref_model, _cast(inputs, torch.float64, device))
        row["softmaxes"] = counter.count
        del ref_model
        if not counter.count:   # nothing for us: backend="fa3" hands the graph to stock Inductor
            row["excluded"] = "no attention: no softmax, SDPA or flex_attention call in its forward"
            return
        base_model = copy.deepcopy(model).to(device, dtype)
        base_out, base_grads, _ = _run(base_model, _cast(inputs, dtype, device), weights)
        del base_model
    except Exception as exc:
        row["excluded"] = f"uncompiled model fails: {type(exc).__name__}: {_line(exc)}"
        return
    ours = copy.deepcopy(model).to(device, dtype)
    captured: list = []

    def run(**kw: Any) -> Any:
        out = ours(**kw)
        captured.append(out)
        return out

    try:
        report = fa3_inductor.explain(run, **_cast(inputs, dtype, device))
        outs, grads, _ = _backward(ours, _floats(captured[-1]), weights)
    except Exception as exc:
        row["crash"] = f"{type(exc).__name__}: {_line(exc)}"
        row["traceback"] = traceback.format_exc()[-3000:]
        if _stock_fails(model, inputs, device, dtype):
            row["crash"] = f"{_STOCK_FAILS}: {row['crash']}"
        return
    row["crash"] = ""
    _report_into(row, report)
    tol = TOLERANCE[dtype]
    names = [f"out{i}" for i in range(len(ref_out))]
    row["out_err"], row["out_ok"], _ = _compare(
        dict(zip(names, outs)), dict(zip(names, ref_out)), dict(zip(names, base_out)), tol)
    _, row["grad_ok"], row["grad_worst"] = _compare(grads, ref_grads, base_grads, tol)
    row["grad_err"] = _rel(_flat(grads, ref_grads), _flat(ref_grads, ref_grads))
    row["baseline_out_err"] = max((_rel(b, r) for b, r in zip(base_out, ref_out)), default=0.0)


def _flat(grads: dict, like: dict) -> torch.Tensor:
    """Every gradient of ``like``'s parameters in one vector (zeros where there is none)."""
    return torch.cat([(grads.get(k) if grads.get(k) is not None else torch.zeros_like(r)).double()
                      .flatten().cpu() for k, r in like.items() if r is not None] or [torch.zeros(1)])


def _excluded_types() -> tuple:
    out = []
    for mod in ("coverage_hf", "coverage_vision"):
        try:
            out.append(__import__(mod).Excluded)
        except ImportError:
            pass
    return tuple(out) or (LookupError,)


def _kind(fam: Family, model: torch.nn.Module, inputs: dict) -> str:
    if fam.source == "transformers":
        from coverage_hf import kind_of

        return kind_of(model, inputs)
    return {"timm": "vision", "diffusers": "diffusion"}.get(fam.source, "?")


def _stock_fails(model: torch.nn.Module, inputs: dict, device: torch.device,
                 dtype: torch.dtype) -> bool:
    """Whether ``backend="inductor"`` raises on the same model (then the crash is not ours)."""
    torch._dynamo.reset()
    stock = torch.compile(copy.deepcopy(model).to(device, dtype), backend="inductor")
    try:
        _run(stock, _cast(inputs, dtype, device))
    except Exception:
        return True
    return False


def _report_into(row: dict, report: Any) -> None:
    row["sites"] = report.fused_count + len(report.unfused)
    row["fused"] = report.fused_count
    row["served"] = report.served_count
    row["graphs"] = report.graph_count
    row["templates"] = dict(Counter(s.template for s in report.sites))
    row["backward"] = dict(Counter(s.backward or "-" for s in report.sites))
    row["fallbacks"] = sorted({s.fallback_reason for s in report.sites if s.fallback_reason})
    row["left_alone"] = dict(Counter(f"{u.front_door}: {_generic_reason(u.reason)}"
                                     for u in report.unfused))
    row["mods"] = sorted({m for s in report.sites for m in s.score_mods} |
                         {f"mask {s.mask}" for s in report.sites if s.mask != "none"})


def _generic_reason(reason: str) -> str:
    """A reason without the node names, so equal reasons of different layers group."""
    import re

    return re.sub(r"\b(view|reshape|matmul|bmm|softmax|add|mul|to|clone|getitem)_\d+\b",
                  r"\1_N", reason)


# ------------------------------------------------------------------------------------------
# GPU timing against stock Inductor
# ------------------------------------------------------------------------------------------

def time_family(fam: Family, batch: int, seq: int, device: torch.device, dtype: torch.dtype
                ) -> dict[str, Any]:
    """Forward milliseconds (inference) of ``fam`` at a realistic size, fa3 vs stock Inductor.

    Example::

        >>> time_family(fam, 8, 512, torch.device("cuda"), torch.bfloat16)   # doctest: +SKIP
    """
    import triton.testing

    import fa3_inductor

    row: dict[str, Any] = dict(family=fam.name, batch=batch, seq=seq)
    model, inputs = fam.build(realistic=True, batch=batch, seq=seq)
    model = model.to(device, dtype).eval()
    inputs = _cast(inputs, dtype, device)
    with torch.no_grad():
        report = fa3_inductor.explain(model, **inputs)
        row["fused"], row["sites"] = report.fused_count, report.fused_count + len(report.unfused)
        row["templates"] = dict(Counter(s.template for s in report.sites))
        for backend in ("fa3", "inductor"):
            torch._dynamo.reset()
            compiled = torch.compile(model, backend=backend)
            compiled(**inputs)
            row[f"{backend}_ms"] = float(triton.testing.do_bench(
                lambda: compiled(**inputs), warmup=25, rep=100, return_mode="median"))
    row["speedup"] = row["inductor_ms"] / row["fa3_ms"]
    return row


# ------------------------------------------------------------------------------------------
# Summary and files
# ------------------------------------------------------------------------------------------

def summarize(rows: list[dict]) -> dict[str, Any]:
    """Totals over the checked rows (sites, fused, crashes, outputs and gradients ok)."""
    checked = [r for r in rows if "excluded" not in r]
    ran = [r for r in checked if not r.get("crash")]
    sites = sum(r.get("sites", 0) for r in ran)
    fused = sum(r.get("fused", 0) for r in ran)
    return dict(
        families=len(rows), checked=len(checked), excluded=len(rows) - len(checked),
        with_sites=sum(1 for r in ran if r.get("sites")),
        sites=sites, fused=fused, fused_pct=round(100.0 * fused / sites, 1) if sites else None,
        crashes_ours=sum(1 for r in checked if r.get("crash") and
                         not r["crash"].startswith(_STOCK_FAILS)),
        crashes_stock=sum(1 for r in checked if r.get("crash", "").startswith(_STOCK_FAILS)),
        outputs_ok=sum(1 for r in ran if r.get("out_ok")),
        grads_ok=sum(1 for r in ran if r.get("grad_ok")), ran=len(ran),
        fully_fused=sum(1 for r in ran if r.get("sites") and r.get("fused") == r.get("sites")),
        no_attention=sum(1 for r in rows if r.get("excluded", "").startswith("no attention")),
        guarded=sum(1 for r in ran if any(_OUR_BUG in k for k in r.get("left_alone", {}))),
    )


def _fmt_err(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1e}"


def markdown(meta: dict, rows: list[dict], timing: list[dict]) -> str:
    """The committed table: header, summary, one row per family, exclusions, reasons."""
    s = summarize(rows)
    lines = [f"# fa3 coverage: {meta['device']}, {meta['dtype']}, {meta['date']}", "",
             f"Command: `{meta['command']}`  ",
             f"torch {meta['torch']}, triton {meta['triton']}, transformers "
             f"{meta.get('transformers')}, timm {meta.get('timm')}, diffusers "
             f"{meta.get('diffusers')}, Python {meta['python']}, commit {meta.get('commit')}", "",
             f"Families: {s['families']} enumerated, {s['checked']} built and checked, "
             f"{s['excluded']} not checked ({s['no_attention']} without attention; the others' "
             f"reasons below). Attention sites in the checked families: "
             f"{s['sites']}, fused {s['fused']} ({s['fused_pct']}%); families with sites: "
             f"{s['with_sites']}, every site fused in {s['fully_fused']}. Compile crashes: "
             f"{s['crashes_ours']} ours, {s['crashes_stock']} where stock Inductor raises too; "
             f"graphs our guard handed to stock Inductor: {s['guarded']} famil(ies). "
             f"Outputs within tolerance: {s['outputs_ok']}/{s['ran']}; gradients: "
             f"{s['grads_ok']}/{s['ran']}.", "",
             "Tolerance: relative error against the float64 uncompiled model ≤ 1e-4 (float32) / "
             "2e-2 (bf16), or ≤ 4× the uncompiled model's own error in that dtype. `grad err`: all parameter "
             "gradients as one vector; `grad` ok: each parameter's gradient within tolerance. "
             "`softmaxes`: softmax/SDPA calls of one eager forward (routers included), for "
             "attention recognition never saw.", ""]
    lines += ["| family | source | kind | softmaxes | sites | fused | templates | backward | crash "
              "| out err | out | grad err | grad | left alone (reason × count) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "excluded" in r:
            continue
        left = "; ".join(f"{k} ×{v}" for k, v in r.get("left_alone", {}).items())
        crash = r.get("crash") or "no"
        lines.append("| " + " | ".join([
            r["family"], r["source"], r.get("kind", "?"), str(r.get("softmaxes", "-")),
            str(r.get("sites", "-")), str(r.get("fused", "-")),
            ", ".join(f"{k}×{v}" for k, v in r.get("templates", {}).items()) or "-",
            ", ".join(f"{k}×{v}" for k, v in r.get("backward", {}).items()) or "-",
            crash.replace("|", "/")[:160], _fmt_err(r.get("out_err")),
            _ok(r.get("out_ok")), _fmt_err(r.get("grad_err")), _ok(r.get("grad_ok")),
            left.replace("|", "/") or "-"]) + " |")
    if timing:
        lines += ["", "## Forward time at a realistic size (inference), fa3 vs stock Inductor", "",
                  "| family | batch | seq | sites | fused | templates | fa3 ms | inductor ms | "
                  "inductor ÷ fa3 |", "|---|---|---|---|---|---|---|---|---|"]
        for t in timing:
            if "error" in t:
                lines.append(f"| {t['family']} | {t.get('batch')} | {t.get('seq')} | "
                             f"{t['error'][:120]} | | | | | |")
                continue
            lines.append(f"| {t['family']} | {t['batch']} | {t['seq']} | {t['sites']} | "
                         f"{t['fused']} | {t['templates']} | {t['fa3_ms']:.3f} | "
                         f"{t['inductor_ms']:.3f} | {t['speedup']:.2f} |")
    excluded = [r for r in rows if "excluded" in r]
    if excluded:
        lines += ["", "## Excluded families (not built or not run), with the reason", ""]
        lines += [f"- `{r['family']}` ({r['source']}): {r['excluded'].replace(chr(10), ' ')[:300]}"
                  for r in excluded]
    return "\n".join(lines) + "\n"


def _ok(v: Optional[bool]) -> str:
    return "-" if v is None else ("ok" if v else "**FAIL**")


def _meta(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    import subprocess

    import triton

    def version(mod: str) -> Optional[str]:
        try:
            return __import__(mod).__version__
        except Exception:
            return None

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        commit = None
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    return dict(command="python3 " + " ".join(sys.argv), device=name,
                dtype=str(dtype).replace("torch.", ""),
                date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                torch=torch.__version__, triton=triton.__version__,
                transformers=version("transformers"), timm=version("timm"),
                diffusers=version("diffusers"), python=platform.python_version(), commit=commit)


def _write(path: Path, meta: dict, rows: list[dict], timing: list[dict]) -> None:
    data = dict(meta, summary=summarize(rows), rows=rows, timing=timing)
    path.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str))
    path.with_suffix(".md").write_text(markdown(meta, rows, timing))


def _stem(device: torch.device) -> str:
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    if device.type == "cuda":
        dev = torch.cuda.get_device_name().lower().replace(" ", "-")
        return f"coverage-{dev}-{date}"
    return f"coverage-cpu-{date}"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", default="transformers,timm,diffusers")
    p.add_argument("--families", default="", help="comma-separated names (default: all)")
    p.add_argument("--fast", action="store_true", help=f"only {', '.join(FAST_FAMILIES)}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    p.add_argument("--timing", action="store_true", help="GPU: time TIMED_FAMILIES vs inductor")
    p.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    p.add_argument("--stem", default=None, help="file name without suffix")
    p.add_argument("--budget-s", type=float, default=0, help="start no family after this")
    p.add_argument("--family-limit-s", type=float, default=300, help="per family time limit")
    p.add_argument("--shard", default="", help="i/n: every n-th family from the i-th")
    p.add_argument("--resume", action="store_true", help="skip families already in the JSON")
    p.add_argument("--merge", nargs="*", default=None, help="combine these JSON files and exit")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / (args.stem or _stem(device))
    meta = _meta(args, device, dtype)
    if args.merge is not None:
        rows, timing = [], []
        for f in args.merge:
            data = json.loads(Path(f).read_text())
            rows += data["rows"]
            timing += data.get("timing", [])
        rows.sort(key=lambda r: (r["source"], r["family"]))
        _write(path, meta, rows, timing)
        print(markdown(meta, rows, timing))
        return 0

    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore")
    sources = args.sources.split(",")
    fams = families(sources)
    wanted = set(FAST_FAMILIES) if args.fast else set(filter(None, args.families.split(",")))
    if wanted:
        fams = [f for f in fams if f.name in wanted]
    if args.shard:
        i, n = (int(x) for x in args.shard.split("/"))
        fams = fams[i::n]
    rows: list[dict] = []
    if args.resume and path.with_suffix(".json").exists():
        rows = [r for r in json.loads(path.with_suffix(".json").read_text())["rows"]
                if "excluded" not in r or r["excluded"].startswith("no attention")]   # retry the rest
    done = {(r["source"], r["family"]) for r in rows}
    start = time.perf_counter()
    for fam in fams:
        if (fam.source, fam.name) in done:
            continue
        if args.budget_s and time.perf_counter() - start > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent: stopping before {fam.name}", flush=True)
            break
        row = check_family(fam, device, dtype, args.family_limit_s)
        rows.append(row)
        print(_one_line(row), flush=True)
        _write(path, meta, rows, [])
    timing: list[dict] = []
    if args.timing:
        if device.type != "cuda":
            print("--timing needs --device cuda: skipped", flush=True)
        else:
            by_name = {f.name: f for f in families(["transformers"])}
            for name, batch, seq in TIMED_FAMILIES:
                try:
                    timing.append(time_family(by_name[name], batch, seq, device, dtype))
                except Exception as exc:
                    timing.append(dict(family=name, batch=batch, seq=seq,
                                       error=f"{type(exc).__name__}: {_line(exc)}"))
                print(timing[-1], flush=True)
    _write(path, meta, rows, timing)
    print(markdown(meta, rows, timing))
    print(f"wrote {path.with_suffix('.md')} and .json", flush=True)
    return 0


def _one_line(row: dict) -> str:
    if "excluded" in row:
        return f"{row['family']:<28} excluded: {row['excluded'][:150]}"
    if row.get("crash"):
        return f"{row['family']:<28} CRASH: {row['crash'][:150]}"
    left = "; ".join(row.get("left_alone", {}))
    return (f"{row['family']:<28} sites {row.get('sites')} fused {row.get('fused')} "
            f"out {_fmt_err(row.get('out_err'))} {_ok(row.get('out_ok'))} grad "
            f"{_fmt_err(row.get('grad_err'))} {_ok(row.get('grad_ok'))} "
            f"({row['seconds']} s){' left: ' + left[:200] if left else ''}")


if __name__ == "__main__":
    sys.exit(main())
