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

Tolerance against float64 (``tol``: 1e-4 float32, 2e-2 bfloat16): each output's relative error at
most max(tol, 4× the uncompiled model's in that dtype); each parameter's gradient by
:func:`judge_grads` (its error on max(‖ref_p‖, GRAD_FLOOR·‖ref_all‖), so a gradient that is 0 in
exact arithmetic, a key projection's bias, is judged at the model's gradient scale rather than
relative to noise; a small gradient eager resolves may still not be wrong outright). A family out
of tolerance is compiled with stock Inductor too: where stock Inductor is out by as much, the row
says so (``stock_too``) and the failure is not counted as ours. docs/coverage.md, "Tolerance".

On CPU our generic kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, set here when
no GPU is visible or ``--device cpu``). ``--device cuda --dtype bfloat16`` is the GPU run. There
the size rule that leaves small sites to stock Inductor (rewrite_pays.py) is off for the checks
(``--size-rule`` keeps it), since every site of a tiny model is small; ``--timing`` times the
forward of each family in :data:`TIMED_FAMILIES` at a realistic size against stock Inductor
(benchmarks/coverage_timing.py), with the size rule as shipped (``--timing-every-size``: also
with it off), each family in a process of its own (a device-side assert costs that family only).

Writes ``coverage-<cpu|gpu name>-<date>.json`` and ``.md`` into ``--out`` (default
benchmarks/results); both are rewritten after every family (the table: coverage_table.py).
Families run most important first (:func:`prioritized`). For a run split over many processes
(benchmarks/coverage_gpu.sh): ``--claim-dir`` hands each family to the first process that claims
it, ``--stop-at`` is a wall-clock deadline (no family starts too close to it, and one cut by it is
marked unfinished), ``--resume-from a.json`` skips the families that file settled (timeouts,
crashes and tolerance failures run again), ``--merge a.json b.json`` combines the files (later
rows win). ``--shard i/n`` runs every n-th family; ``--resume`` continues into the same file.

Examples::

    python3 benchmarks/coverage.py --fast                      # the CI subset (a few families)
    python3 benchmarks/coverage.py --sources transformers --budget-s 3600
    python3 benchmarks/coverage.py --families bert,gpt2,t5 --out /tmp/cov
    python3 benchmarks/coverage.py --device cuda --dtype bfloat16 --timing   # H100/H200
    OUT=/tmp/o bash benchmarks/coverage_gpu.sh 440             # the full set on a 4-GPU machine
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import gc
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

if __name__ == "__main__" and (not torch.cuda.is_available() or "--device=cpu" in sys.argv or
                               "--device cpu" in " ".join(sys.argv)):
    # our kernels on CPU tensors, before triton loads; as a script only: imported (by a test), it must
    # not switch the importing process to the interpreter (the sm90 compile session skips then)
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")         # tiny configs only: never ask the Hub

sys.path.insert(0, str(Path(__file__).resolve().parent))

# (markdown and summarize are used by tests/test_coverage_smoke.py through this module)
from coverage_table import (DIRECTION, GRAD_FLOOR, RESOLVED, STOCK_FACTOR,  # noqa: E402,F401
                            STOCK_FAILS as _STOCK_FAILS, _fmt_err, _ok, markdown, merge, settled,
                            summarize, write)
from coverage_timing import TIMED_FAMILIES, every_size, time_family  # noqa: E402
from provenance import commit_label  # noqa: E402

# Relative error allowed per dtype against float64 (tests/reference.py, README "Tolerance rule").
TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
BASELINE_FACTOR = 4.0    # or at most this many times the uncompiled model's own error

# --fast (CI): one encoder, one decoder, one encoder-decoder with a relative-position bias, and
# one ALiBi decoder (its bias raises 2 to a tensor power: the compile used to raise on it).
FAST_FAMILIES = ("bert", "gpt2", "t5", "mpt")

# Checked first, in this order, after TIMED_FAMILIES: the transformers types of the most used
# models (our reading of the Hub's listings, as for TIMED_FAMILIES), then every diffusers family,
# then these timm modules, then the rest of timm and of transformers in enumeration order.
POPULAR_HF = (
    "distilbert", "clip", "siglip", "whisper", "qwen3", "gemma", "gemma2", "gemma3_text", "phi",
    "phi3", "bart", "albert", "deberta-v2", "electra", "mt5", "wav2vec2", "dinov2", "mixtral",
    "qwen2_moe", "qwen3_moe", "falcon", "opt", "gpt_neox", "bloom", "camembert", "modernbert",
    "marian", "pegasus", "swin", "beit", "deit", "detr", "segformer", "blip", "llava", "qwen2_vl",
    "gpt_oss", "deepseek_v3", "mpt", "gptj", "starcoder2", "olmo2", "cohere", "stablelm",
    "clip_vision_model", "siglip_vision_model", "xlm-roberta-xl", "layoutlmv3", "longformer",
    "big_bird", "funnel", "led", "m2m_100", "nllb-moe", "hubert", "wavlm", "data2vec-text", "vit_mae",
)
POPULAR_TIMM = ("vision_transformer", "swin_transformer", "deit", "eva", "beit",
                "swin_transformer_v2", "vision_transformer_hybrid", "convit", "cait", "maxxvit")

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


def prioritized(fams: list[Family]) -> list[Family]:
    """The families, most important first: TIMED_FAMILIES, POPULAR_HF, every diffusers family,
    POPULAR_TIMM, then the rest of timm and of transformers in enumeration order. A run cut
    short by its deadline has then checked these, and a resumed run does the rest.

    Example::

        >>> [f.name for f in prioritized(families(["transformers"]))][:3]   # doctest: +SKIP
        ['bert', 'roberta', 'xlm-roberta']
    """
    hf_first = [name for name, *_ in TIMED_FAMILIES] + list(POPULAR_HF)

    def key(item: tuple[int, Family]) -> tuple[int, int]:
        i, fam = item
        if fam.source == "transformers" and fam.name in hf_first:
            return 0, hf_first.index(fam.name)
        if fam.source == "diffusers":
            return 1, i
        if fam.source == "timm":
            return (2, POPULAR_TIMM.index(fam.name)) if fam.name in POPULAR_TIMM else (3, i)
        return 4, i

    return [fam for _, fam in sorted(enumerate(fams), key=key)]


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


def _abs_err(x: Optional[torch.Tensor], ref: Optional[torch.Tensor]) -> tuple[float, float]:
    """(‖x − ref‖, ‖ref‖). NaN/inf must sit where the reference has them (then the rest is
    compared), else the error is inf; a missing tensor counts as zeros (a missing gradient)."""
    if x is None or ref is None:
        other = ref if x is None else x
        if other is None:
            return 0.0, 0.0
        n = other.double().norm().item()
        return (n, 0.0) if ref is None else (n, n)
    x, ref = x.double(), ref.double().to(x.device)
    if x.shape != ref.shape:
        return float("inf"), ref.norm().item() if ref.numel() else 0.0
    bad, ref_bad = ~torch.isfinite(x), ~torch.isfinite(ref)
    if not torch.equal(bad, ref_bad) or not torch.equal(x[bad].nan_to_num(), ref[bad].nan_to_num()):
        return float("inf"), ref[~ref_bad].norm().item()
    x, ref = x[~bad], ref[~bad]
    return (x - ref).norm().item(), ref.norm().item()


def _rel(x: Optional[torch.Tensor], ref: Optional[torch.Tensor]) -> float:
    """Relative error ‖x − ref‖/‖ref‖ (:func:`_abs_err`); 0/0 is 0, e/0 is inf."""
    err, d = _abs_err(x, ref)
    return err / d if d > 0 else (0.0 if err == 0 else float("inf"))


def _compare(values: dict[str, Any], ref: dict[str, Any], base: dict[str, Any], tol: float
             ) -> tuple[float, bool, str]:
    """Worst relative error over the entries, whether each is within its tolerance, and the
    worst offender's name (the outputs' rule: each output on its own norm)."""
    worst, ok, who = 0.0, True, ""
    for key, r in ref.items():
        err = _rel(values.get(key), r)
        allowed = max(tol, BASELINE_FACTOR * _rel(base.get(key), r))
        if err > allowed:
            ok = False
        if err > worst or (not ok and not who):
            worst, who = err, key
    return worst, ok, who


def judge_grads(grads: dict[str, Any], ref: dict[str, Any], base: dict[str, Any], tol: float,
                floor: float = None) -> dict[str, Any]:
    """The gradient rule (docs/coverage.md, "Tolerance"), per parameter p:

    1. on its scale ``scale_p = max(‖ref_p‖, floor·‖ref_all‖)`` (``floor``: GRAD_FLOOR), the
       error ``‖g_p − ref_p‖ / scale_p`` is at most ``max(tol, BASELINE_FACTOR × the uncompiled
       model's error on the same scale)``;
    2. where p's true gradient is not 0 and the uncompiled model in this dtype resolves it (its
       own relative error ≤ RESOLVED), our relative error is at most ``max(DIRECTION,
       BASELINE_FACTOR × eager's)``.

    A parameter whose true gradient is a fair share of the model's is judged relatively by (1),
    as before. One whose true gradient is a negligible share (a key projection's bias: softmax is
    shift-invariant, so its gradient is 0 in exact arithmetic; q/k weights of a random-init model
    whose scores are ~0) is judged by (1) in absolute terms at ``floor`` times the model's
    gradient scale, where its relative error would be noise over ~0; (2) still fails such a
    gradient that is wrong outright while eager gets it right (stock Inductor's query gradient
    of sew-d: 100% off, eager 2%).

    Returns ok; ``worst`` (the parameter with the largest error / allowed under (1)) with its
    numbers; ``failing``: every parameter out of tolerance with ``err`` and ``allowed`` (on its
    scale), ``share`` (‖ref_p‖/‖ref_all‖), ``base`` (eager's error on that scale), ``rel`` and
    ``base_rel`` (relative errors) and ``rule`` (1 or 2).

    Example::

        >>> one = {"w": torch.ones(2)}
        >>> judge_grads(one, one, one, 1e-4)["ok"]
        True
    """
    floor = GRAD_FLOOR if floor is None else floor
    total = _flat(ref, ref).norm().item()
    ok, worst, failing = True, None, []
    for name, r in ref.items():
        err, norm = _abs_err(grads.get(name), r)
        berr, _ = _abs_err(base.get(name), r)
        scale = max(norm, floor * total)
        e, b = _ratio(err, scale), _ratio(berr, scale)
        allowed = max(tol, BASELINE_FACTOR * b)
        rel, base_rel = _ratio(err, norm), _ratio(berr, norm)
        item = dict(param=name, err=_sig(e), allowed=_sig(allowed), base=_sig(b),
                    share=_sig(norm / total) if total > 0 else None, rel=_sig(rel),
                    base_rel=_sig(base_rel))
        ratio = e / allowed if allowed > 0 else float("inf")
        if worst is None or ratio > worst[0]:
            worst = (ratio, item)
        rule = None
        if not e <= allowed:   # (NaN fails)
            rule = 1
        elif norm > 0 and base_rel <= RESOLVED and \
                not rel <= max(DIRECTION, BASELINE_FACTOR * base_rel):
            rule = 2
        if rule is not None:
            ok = False
            failing.append(dict(item, rule=rule))
    failing.sort(key=lambda i: -(i["err"] / i["allowed"] if i["allowed"] else float("inf")))
    return dict(ok=ok, worst=worst[1] if worst else None, failing=failing)


def _ratio(err: float, scale: float) -> float:
    return err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))


def _sig(x: float) -> float:
    """``x`` to 3 significant digits (for the JSON)."""
    return float(f"{x:.3g}") if x == x and abs(x) != float("inf") else x


GRAD_DETAIL = os.environ.get("COVERAGE_GRAD_DETAIL") == "1"   # --grad-detail (or this variable)


class _Timeout(BaseException):
    """A family's time limit. Not an Exception: the backend's no-crash guard (and Inductor's
    error wrapping) would catch one raised inside the compile and carry on with stock Inductor."""


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
    _judge_into(row, outs, grads, ref_out, ref_grads, base_out, base_grads, TOLERANCE[dtype])
    row["baseline_out_err"] = max((_rel(b, r) for b, r in zip(base_out, ref_out)), default=0.0)
    row["baseline_grad_err"] = _rel(_flat(base_grads, ref_grads), _flat(ref_grads, ref_grads))
    if not (row["out_ok"] and row["grad_ok"]):
        # Is it ours? Stock Inductor on the same model, judged by the same rule.
        row["stock"] = _stock_errors(model, inputs, device, dtype, weights, ref_out, ref_grads,
                                     base_out, base_grads)
        row["stock_too"] = _stock_too(row)


def _judge_into(row: dict, outs: list, grads: dict, ref_out: list, ref_grads: dict,
                base_out: list, base_grads: dict, tol: float) -> None:
    """out_err/out_ok (each output on its own norm), grad_err (all gradients as one vector),
    grad_ok/grad_worst/grad_failing (:func:`judge_grads`) into ``row``."""
    names = [f"out{i}" for i in range(len(ref_out))]
    row["out_err"], row["out_ok"], _ = _compare(
        dict(zip(names, outs)), dict(zip(names, ref_out)), dict(zip(names, base_out)), tol)
    judged = judge_grads(grads, ref_grads, base_grads, tol)
    row["grad_ok"] = judged["ok"]
    worst = judged["worst"] or {}
    row["grad_worst"] = worst.get("param", "")
    row["grad_worst_detail"] = worst   # err and allowed on its scale, its share, eager's error
    row["grad_failing"] = judged["failing"]
    row["grad_err"] = _rel(_flat(grads, ref_grads), _flat(ref_grads, ref_grads))
    if GRAD_DETAIL:   # --grad-detail: each parameter's [name, share, ours, eager] (÷ ‖ref_all‖)
        total = _flat(ref_grads, ref_grads).norm().item() or 1.0
        row["grad_params"] = [
            [name, _sig(_abs_err(r, r)[1] / total), _sig(_abs_err(grads.get(name), r)[0] / total),
             _sig(_abs_err(base_grads.get(name), r)[0] / total)] for name, r in ref_grads.items()]


def _stock_errors(model: torch.nn.Module, inputs: dict, device: torch.device, dtype: torch.dtype,
                  weights: list, ref_out: list, ref_grads: dict, base_out: list,
                  base_grads: dict) -> dict:
    """Stock Inductor's own errors on the same model, inputs and loss, by the same rule."""
    torch._dynamo.reset()
    module = copy.deepcopy(model).to(device, dtype)
    stock = torch.compile(module, backend="inductor")
    try:   # (gradients by the module's own names: the compiled wrapper's carry "_orig_mod.")
        outs, grads, _ = _backward(module, _floats(stock(**_cast(inputs, dtype, device))), weights)
    except _Timeout:   # the family's limit: the row keeps our own check
        return dict(error="timed out (the family's limit)")
    except Exception as exc:
        return dict(error=f"{type(exc).__name__}: {_line(exc)}")
    out: dict[str, Any] = {}
    _judge_into(out, outs, grads, ref_out, ref_grads, base_out, base_grads, TOLERANCE[dtype])
    return out


def _stock_too(row: dict) -> bool:
    """Whether a tolerance failure is stock Inductor's: it is out of tolerance on the same model
    by the same rule where we are (outputs, gradients, each failing parameter), and our error is
    at most STOCK_FACTOR times its own there."""
    stock = row.get("stock") or {}
    if "out_ok" not in stock:
        return False
    if not row["out_ok"] and (stock["out_ok"] or
                              row["out_err"] > STOCK_FACTOR * stock["out_err"]):
        return False
    if not row["grad_ok"]:
        if stock["grad_ok"]:
            return False
        theirs = {i["param"]: i for i in stock.get("grad_failing", [])}
        for item in row.get("grad_failing", []):
            other = theirs.get(item["param"])
            if other is None or item["err"] > STOCK_FACTOR * other["err"]:
                return False
    return True


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
# Files and the command line
# ------------------------------------------------------------------------------------------

def _meta(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    import importlib.metadata
    import subprocess

    def version(dist: str) -> Optional[str]:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    commit = commit_label()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    note = None
    if device.type == "cuda" and not args.size_rule:
        note = ("Size rule off in the checks: every site recognition can rewrite is rewritten "
                "whatever its size (the tiny models' sites are all below rewrite_pays.py's "
                "thresholds, which leave such sites to stock Inductor in normal use). The timing "
                "table uses the backend as shipped.")
    return dict(command="python3 " + " ".join(sys.argv), device=name,
                dtype=str(dtype).replace("torch.", ""),
                date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                torch=torch.__version__, triton=version("triton"),
                transformers=version("transformers"), timm=version("timm"),
                diffusers=version("diffusers"), python=platform.python_version(), commit=commit,
                note=note)


def _stem(device_name: str) -> str:
    """coverage-<device>-<date>: the GPU's name in lower case with dashes, or cpu."""
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    dev = "cpu" if device_name.startswith("cpu") else device_name.lower().replace(" ", "-")
    return f"coverage-{dev}-{date}"


def _claim(claim_dir: Optional[Path], fam: Family) -> bool:
    """Whether this process may check ``fam``: the first process to create its claim file."""
    if claim_dir is None:
        return True
    name = f"{fam.source}__{fam.name}".replace("/", "__")
    try:
        fd = os.open(claim_dir / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump([fam.source, fam.name, os.getpid()], f)
    return True


def _claimed(claim_dir: Path) -> list[tuple[str, str]]:
    return [tuple(json.loads(p.read_text())[:2]) for p in sorted(claim_dir.iterdir())
            if p.is_file() and p.stat().st_size]


def _cuda_broken(device: torch.device) -> Optional[str]:
    """Why the process's CUDA context is unusable (a sticky error from the last family), or None.
    Hands the allocator's cached blocks back to the GPU on the way."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.ones(1, device=device).add_(1).item()
    except Exception as exc:
        return f"{type(exc).__name__}: {_line(exc)}"
    return None


_CUDA_BROKEN_EXIT = 3   # the process's CUDA context is broken: coverage_gpu.sh starts a new one
_MIN_FAMILY_S = 20.0    # no family starts with less than this left before --stop-at
NOT_TIMED = "not timed"  # the error of a timed family the deadline left out


def _settled_elsewhere(files: list[str]) -> tuple[set, set]:
    """(source, family) pairs the --resume-from files settled, and the families they timed."""
    rows, timed = set(), set()
    for f in files:
        data = json.loads(Path(f).read_text())
        rows |= {(r["source"], r["family"]) for r in data.get("rows", []) if settled(r)}
        timed |= {t["family"] for t in data.get("timing", []) if "speedup" in t}
    return rows, timed


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", default="transformers,timm,diffusers")
    p.add_argument("--families", default="", help="comma-separated names (default: all)")
    p.add_argument("--fast", action="store_true", help=f"only {', '.join(FAST_FAMILIES)}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    p.add_argument("--size-rule", action="store_true",
                   help="GPU checks: keep rewrite_pays.py's size rule (then tiny sites stay as written)")
    p.add_argument("--timing", action="store_true", help="GPU: time TIMED_FAMILIES vs inductor")
    p.add_argument("--timing-shard", default="", help="i/n: every n-th timed family from the i-th")
    p.add_argument("--timing-every-size", action="store_true",
                   help="also time fa3 with the size rule off")
    p.add_argument("--timing-limit-s", type=float, default=300, help="per timed family limit")
    p.add_argument("--no-checks", action="store_true", help="only the timing (with --timing)")
    p.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    p.add_argument("--stem", default=None, help="file name without suffix")
    p.add_argument("--budget-s", type=float, default=0,
                   help="start no family after this many seconds (the last one runs to its limit)")
    p.add_argument("--stop-at", type=float, default=0,
                   help="wall-clock deadline (seconds since the epoch): no family starts within "
                        f"{_MIN_FAMILY_S:.0f} s of it, and each is cut there")
    p.add_argument("--family-limit-s", type=float, default=300, help="per family time limit")
    p.add_argument("--shard", default="", help="i/n: every n-th family from the i-th")
    p.add_argument("--claim-dir", default=None,
                   help="a folder shared by processes: each family goes to the first that claims it")
    p.add_argument("--resume", action="store_true", help="continue into the same JSON")
    p.add_argument("--resume-from", action="append", default=[],
                   help="skip the families (and timed families) this JSON settled")
    p.add_argument("--merge", nargs="*", default=None, help="combine these JSON files and exit")
    p.add_argument("--time-one", default="", help=argparse.SUPPRESS)       # name,batch,seq (child)
    p.add_argument("--time-one-out", default="", help=argparse.SUPPRESS)   # its row's JSON file
    p.add_argument("--grad-detail", action="store_true",
                   help="record every parameter's gradient numbers in the rows (grad_params)")
    args = p.parse_args(argv)
    global GRAD_DETAIL
    GRAD_DETAIL = GRAD_DETAIL or args.grad_detail
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if args.time_one:
        import logging
        import warnings

        logging.getLogger("transformers").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore")
        return _time_one(args, device, dtype)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    claim_dir = Path(args.claim_dir) if args.claim_dir else None
    if args.merge is not None:
        return _merge_files(args, out_dir, claim_dir)
    path = out_dir / (args.stem or _stem(
        torch.cuda.get_device_name() if device.type == "cuda" else "cpu"))
    meta = _meta(args, device, dtype)

    import logging
    import warnings

    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    fams = prioritized(families(args.sources.split(",")) if not args.no_checks else [])
    wanted = set(FAST_FAMILIES) if args.fast else set(filter(None, args.families.split(",")))
    if wanted:
        fams = [f for f in fams if f.name in wanted]
    meta["enumerated"] = [[f.source, f.name] for f in fams]
    meta["enumerated_count"] = len(fams)
    if args.shard:
        i, n = (int(x) for x in args.shard.split("/"))
        fams = fams[i::n]
    rows: list[dict] = []
    timing: list[dict] = []
    if args.resume and path.with_suffix(".json").exists():
        old = json.loads(path.with_suffix(".json").read_text())
        rows = [r for r in old["rows"] if settled(r)]
        timing = [t for t in old.get("timing", []) if "speedup" in t]
    skip, timed = _settled_elsewhere(args.resume_from)
    skip |= {(r["source"], r["family"]) for r in rows}
    timed |= {t["family"] for t in timing}
    start_by = time.time() + args.budget_s if args.budget_s else float("inf")
    deadline = args.stop_at   # (0: none)
    if claim_dir is not None:
        claim_dir.mkdir(parents=True, exist_ok=True)
    with every_size() if device.type == "cuda" and not args.size_rule else contextlib.nullcontext():
        for fam in fams:
            if (fam.source, fam.name) in skip:
                continue
            left = deadline - time.time() if deadline else float("inf")
            if left < _MIN_FAMILY_S or time.time() > start_by:
                print(f"budget spent: stopping before {fam.name}", flush=True)
                break
            if not _claim(claim_dir, fam):
                continue
            limit = min(args.family_limit_s or float("inf"), left)
            print(f"-- {fam.source}/{fam.name} (limit {limit:.0f} s)", flush=True)
            row = check_family(fam, device, dtype, 0 if limit == float("inf") else limit)
            if row.get("excluded", "").startswith("timed out") and limit < args.family_limit_s:
                row["unfinished"] = True
                row["excluded"] = f"timed out: cut by the run's deadline after {limit:.0f} s"
            rows.append(row)
            print(_one_line(row), flush=True)
            write(path, meta, rows, timing)
            gc.collect()
            broken = _cuda_broken(device)   # (and the cached blocks go back: many processes share a GPU)
            if broken:
                print(f"CUDA context broken after {fam.name} ({broken}): exiting for a fresh "
                      "process", flush=True)
                return _CUDA_BROKEN_EXIT
    if args.timing:
        timing += _time_all(args, device, dtype, timed, deadline, path, meta, rows, timing)
    write(path, meta, rows, timing)
    print(markdown(meta, rows, timing))
    print(f"wrote {path.with_suffix('.md')} and .json", flush=True)
    return 0


def _time_all(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, done: set,
              deadline: float, path: Path, meta: dict, rows: list[dict], timing: list[dict]
              ) -> list[dict]:
    """Time this process's share of TIMED_FAMILIES (skipping ``done``); returns the new rows.
    Each family runs in a process of its own (:func:`_time_in_subprocess`): a device-side
    assert, or any error that breaks a CUDA context, costs that family only."""
    if device.type != "cuda":
        print("--timing needs --device cuda: skipped", flush=True)
        return []
    todo = [t for t in TIMED_FAMILIES if t[0] not in done]
    if args.timing_shard:
        i, n = (int(x) for x in args.timing_shard.split("/"))
        todo = todo[i::n]
    new: list[dict] = []
    for name, batch, seq in todo:
        row: dict[str, Any] = dict(family=name, batch=batch, seq=seq)
        new.append(row)
        left = deadline - time.time() if deadline else float("inf")
        if left < _MIN_FAMILY_S:
            row["error"] = f"{NOT_TIMED}: the run's deadline came first"
            continue
        limit = min(args.timing_limit_s or float("inf"), left)
        print(f"-- timing {name} (limit {limit:.0f} s, in a process of its own)", flush=True)
        row.update(_time_in_subprocess(args, name, batch, seq, dtype, limit))
        print({k: v for k, v in row.items() if k != "left_alone"}, flush=True)
        write(path, meta, rows, timing + new)
    return new


def _time_in_subprocess(args: argparse.Namespace, name: str, batch: int, seq: int,
                        dtype: torch.dtype, limit: float) -> dict[str, Any]:
    """One timed family in a fresh process (``--time-one``); its row, or why there is none.
    What it measured before an error or its time limit stays in the row."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--time-one", f"{name},{batch},{seq}",
               "--time-one-out", str(out), "--device", "cuda",
               "--dtype", str(dtype).replace("torch.", ""), "--timing-limit-s",
               str(0 if limit == float("inf") else int(limit))]
        if args.timing_every_size:
            cmd.append("--timing-every-size")
        timeout = None if limit == float("inf") else limit + 60   # (its own limit fires first)
        rc: Any
        try:
            proc = subprocess.run(cmd, timeout=timeout, stderr=subprocess.PIPE, text=True)
            rc, err = proc.returncode, proc.stderr or ""
        except subprocess.TimeoutExpired as exc:
            rc, err = "killed after its time limit", (exc.stderr or b"")
            err = err.decode(errors="replace") if isinstance(err, bytes) else err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        shown = (lines if len(lines) <= 40 else
                 lines[:5] + [f"... {len(lines) - 35} lines"] + lines[-30:])
        if shown:
            print("\n".join(shown), file=sys.stderr, flush=True)
        row: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
        if rc != 0 and not row.get("error"):
            last = next((ln for ln in reversed(lines) if not ln.startswith(" ")), "")
            row["error"] = f"timing process exit {rc}: {last[:300]}"
        return row


def _time_one(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> int:
    """--time-one name,batch,seq: time one family (the child of :func:`_time_in_subprocess`),
    writing its row to --time-one-out whatever happens."""
    name, batch, seq = args.time_one.split(",")
    row: dict[str, Any] = dict(family=name, batch=int(batch), seq=int(seq))
    out = Path(args.time_one_out)
    try:
        by_name = {f.name: f for f in families(["transformers"])}
        with _time_limit(args.timing_limit_s):
            time_family(by_name[name], int(batch), int(seq), device, dtype, row,
                        args.timing_every_size)
    except (_Timeout, Exception) as exc:   # (what was measured before stays)
        row["error"] = f"{type(exc).__name__}: {_line(exc)}"
    finally:
        out.write_text(json.dumps(row, default=str))
    return 0


def _merge_files(args: argparse.Namespace, out_dir: Path, claim_dir: Optional[Path]) -> int:
    """--merge: one table from shard files (and a resumed run's file, given first)."""
    files = [Path(f) for f in args.merge if Path(f).exists()]
    missing = [f for f in args.merge if not Path(f).exists()]
    if missing:
        print(f"merge: skipping missing files {missing}", flush=True)
    if not files:
        print("merge: no input file", file=sys.stderr)
        return 2
    meta, rows, timing = merge(files, _claimed(claim_dir) if claim_dir and claim_dir.is_dir()
                               else None)
    meta["process_command"] = meta.get("command")
    meta["command"] = os.environ.get("COVERAGE_COMMAND") or "python3 " + " ".join(sys.argv)
    meta["date"] = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    path = out_dir / (args.stem or _stem(meta.get("device", "cpu")))
    write(path, meta, rows, timing)
    print(markdown(meta, rows, timing))
    print(f"wrote {path.with_suffix('.md')} and .json", flush=True)
    return 0


def _one_line(row: dict) -> str:
    if "excluded" in row:
        return f"{row['family']:<28} excluded: {row['excluded'][:150]} ({row.get('seconds')} s)"
    if row.get("crash"):
        return f"{row['family']:<28} CRASH: {row['crash'][:150]} ({row.get('seconds')} s)"
    left = "; ".join(row.get("left_alone", {}))
    return (f"{row['family']:<28} sites {row.get('sites')} fused {row.get('fused')} "
            f"out {_fmt_err(row.get('out_err'))} {_ok(row.get('out_ok'))} grad "
            f"{_fmt_err(row.get('grad_err'))} {_ok(row.get('grad_ok'))} "
            f"({row['seconds']} s)"
            f"{' (stock Inductor is out by as much: not ours)' if row.get('stock_too') else ''}"
            f"{' left: ' + left[:200] if left else ''}")


if __name__ == "__main__":
    sys.exit(main())
