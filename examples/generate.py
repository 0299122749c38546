"""Greedy generation with a static KV cache: attn_implementation="fa3" against "sdpa".

A Llama-style causal LM with random (seeded) weights of a realistic per-layer shape (hidden 4096,
32 query / 8 KV heads, head dim 128, MLP 14336; a few layers, vocabulary 32000), built from a
config: nothing is downloaded. Prefill and decode both run through transformers' ``generate`` with
``cache_implementation="static"``; under "fa3" the decode steps (one new token against the cache)
run the decode family (flex() picks it for short queries), the prefill our prefill kernels.

Reports, per (batch, prompt): decode tokens/s (batch x (new tokens - 1) over the decode time,
prefill timed apart), prefill ms, which family served fa3's last decode step, and how far the greedy
tokens agree with sdpa's: sequences identical, the share of equal tokens, the largest logit
difference over the steps before the first divergence, and there the margin between sdpa's top two
logits. Random weights give nearly flat logits, so near-ties (a margin at the level of bf16
rounding) make the two implementations' tokens diverge without either being wrong; a large margin
at a divergence, or a large logit difference before it, would be a bug.

Usage::

    python examples/generate.py --out DIR        # GPU: 1x4k, 32x4k, 1x32k (32x32k does not fit
                                                 # 80 GB: prefill activations), --budget-s 90
    python examples/generate.py --cases 8x32768  # any batch x prompt list
    python examples/generate.py --smoke          # CPU, seconds (tests/test_generate_example.py)

Writes generate-<device>-<YYYY-MM-DD-HHMM>.json into --out after every case (a run cut short keeps
what it measured); cases past --budget-s, or that would not fit in memory, are listed with why.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
import time
from typing import Any, Optional

import torch

import fa3_inductor  # noqa: F401  (registers the backend)
from fa3_inductor.integrations import transformers as fa3_hf

REALISTIC = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0)
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
GPU_CASES = ((1, 4096), (32, 4096), (1, 32768), (32, 32768))
IMPLS = ("sdpa", "fa3")


def build_models(layers: int, max_positions: int, smoke: bool, device: str, dtype: torch.dtype,
                 seed: int = 0) -> dict[str, Any]:
    """{"sdpa": model, "fa3": model}: one random Llama (``seed``), the same weights under both.

    Example::

        >>> models = build_models(2, 64, smoke=True, device="cpu", dtype=torch.float32)  # doctest: +SKIP
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    fa3_hf.register()
    cfg = LlamaConfig(**(TINY if smoke else REALISTIC), num_hidden_layers=layers,
                      max_position_embeddings=max_positions)
    torch.manual_seed(seed)
    models = {}
    state = None
    for impl in IMPLS:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl,
                                                     dtype=dtype)
        if state is None:
            state = model.state_dict()
        else:
            model.load_state_dict(state)
        models[impl] = model.eval()
    return models


def prefill_bytes(batch: int, prompt: int, new_tokens: int, layers: int, cfg: dict,
                  itemsize: int = 2) -> int:
    """Rough peak bytes of one generate call beyond the weights: the static cache, the prefill's
    MLP activations (gate, up and their product at once) and hidden states, the last position's
    logits, and sdpa's boolean mask when it builds one (batch x prompt x cache length).

    Example::

        >>> prefill_bytes(32, 32768, 64, 4, REALISTIC) > 80e9   # 32 x 32k does not fit an H100
        True
    """
    tokens = batch * prompt
    cache = 2 * layers * batch * (prompt + new_tokens) * cfg["num_key_value_heads"] * cfg["head_dim"] * itemsize
    mlp = 3 * tokens * cfg["intermediate_size"] * itemsize
    hidden = 6 * tokens * cfg["hidden_size"] * itemsize
    mask = batch * prompt * (prompt + new_tokens)
    return cache + mlp + hidden + mask + batch * cfg["vocab_size"] * 4


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# "auto": transformers' own choice, as users get it: with a static cache on CUDA, generate() compiles
# the decode step with backend="inductor" (CUDA graphs), and flex() calls inside that graph are
# lowered by stock Inductor (torch's flex kernels, not ours). "off": every step eager (disable_compile).
COMPILE_MODES = ("auto", "off")
_compile = {"mode": "auto"}


def _generate(model: Any, ids: torch.Tensor, new_tokens: int) -> Any:
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                          output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                          disable_compile=_compile["mode"] == "off")


def _timed(model: Any, ids: torch.Tensor, new_tokens: int, device: str, repeats: int) -> tuple[Any, float, float]:
    """(generate's output, prefill seconds, decode seconds), best of ``repeats`` after a warm-up
    (compiles, plans, the static cache)."""
    _generate(model, ids, 2)
    prefill = decode = float("inf")
    out = None
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        _generate(model, ids, 1)
        _sync(device)
        t1 = time.perf_counter()
        out = _generate(model, ids, new_tokens)
        _sync(device)
        t2 = time.perf_counter()
        prefill = min(prefill, t1 - t0)
        decode = min(decode, max((t2 - t1) - (t1 - t0), 1e-6))
    return out, prefill, decode


def compare_tokens(ref: Any, ours: Any, prompt_len: int) -> dict:
    """How far ``ours``'s greedy tokens agree with ``ref``'s (generate outputs with raw logits).

    Example::

        >>> compare_tokens(sdpa_out, fa3_out, 4096)["identical_sequences"]   # doctest: +SKIP
        '32/32'
    """
    a, b = ref.sequences[:, prompt_len:], ours.sequences[:, prompt_len:]
    equal = a == b
    report = {"identical_sequences": f"{int(equal.all(1).sum())}/{a.shape[0]}",
              "token_match_rate": round(float(equal.float().mean()), 4)}
    diverged = (~equal).any(1)
    # steps before any sequence diverged: both saw the same tokens, so their logits are comparable
    first = int((~equal).any(0).nonzero()[0]) if diverged.any() else a.shape[1]
    if first > 0:
        diff = max(float((ref.logits[s].float() - ours.logits[s].float()).abs().max()) for s in range(first))
        report["max_logit_diff_before_divergence"] = round(diff, 5)
        report["logit_std"] = round(float(ref.logits[0].float().std()), 5)
    if diverged.any():
        row = int(diverged.nonzero()[0])
        step = int((~equal[row]).nonzero()[0])
        top2 = ref.logits[step][row].float().topk(2).values
        report["first_divergence"] = {"sequence": row, "step": step,
                                      "sdpa_top2_margin": round(float(top2[0] - top2[1]), 5)}
    return report


def run(cases: list[tuple[int, int]], new_tokens: int, layers: int, smoke: bool, device: str,
        repeats: int, budget_s: float = float("inf"), write: Optional[Any] = None) -> list[dict]:
    """One record per (batch, prompt) case: tokens/s under each implementation and the token match.
    A case left out (past ``budget_s``, or too big for the free memory) gets a record saying why.
    ``write(records)`` is called after every case.

    Example::

        >>> run([(1, 12)], 4, 2, smoke=True, device="cpu", repeats=1)[0]["batch"]   # doctest: +SKIP
        1
    """
    started = time.perf_counter()
    dtype = torch.float32 if smoke else torch.bfloat16
    models = build_models(layers, max(p for _, p in cases) + new_tokens, smoke, device, dtype)
    cfg = TINY if smoke else REALISTIC
    vocab = cfg["vocab_size"]
    records = []
    for batch, prompt in cases:
        record: dict = {"batch": batch, "prompt": prompt, "new_tokens": new_tokens,
                        "layers": layers, "weights": "random (seed 0)", "device": device}
        elapsed = time.perf_counter() - started
        need = prefill_bytes(batch, prompt, new_tokens, layers, cfg, dtype.itemsize)
        free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated() \
            if device.startswith("cuda") else None
        if elapsed > budget_s:
            record["skipped"] = f"past --budget-s {budget_s:.0f} ({elapsed:.0f} s elapsed)"
        elif free is not None and need > 0.9 * free:
            record["skipped"] = (f"does not fit: ~{need / 1e9:.0f} GB for the cache, the prefill's "
                                 f"activations and sdpa's mask, {free / 1e9:.0f} GB free")
        else:
            try:
                _case(models, record, batch, prompt, new_tokens, vocab, device, repeats)
            except torch.cuda.OutOfMemoryError as exc:
                record["skipped"] = f"out of memory: {str(exc).splitlines()[0][:160]}"
                torch.cuda.empty_cache()
        record["wall_s"] = round(time.perf_counter() - started, 1)
        records.append(record)
        print(json.dumps(record), flush=True)
        if write is not None:
            write(records)
    return records


def _case(models: dict, record: dict, batch: int, prompt: int, new_tokens: int, vocab: int,
          device: str, repeats: int) -> None:
    torch.manual_seed(1)
    ids = torch.randint(1, vocab, (batch, prompt), device=device)
    outs = {}
    with torch.no_grad():
        for impl, model in models.items():
            out, prefill, decode = _timed(model, ids, new_tokens, device, repeats)
            outs[impl] = out
            record[impl] = {"decode_tokens_per_s": round(batch * (new_tokens - 1) / decode, 1),
                            "decode_ms_per_step": round(decode / (new_tokens - 1) * 1e3, 3),
                            "prefill_ms": round(prefill * 1e3, 2)}
            if impl == "fa3":
                record["fa3_decode_family"] = fa3_inductor.last_template()
    record["fa3_over_sdpa_tokens_per_s"] = round(record["fa3"]["decode_tokens_per_s"]
                                                 / record["sdpa"]["decode_tokens_per_s"], 3)
    record.update(compare_tokens(outs["sdpa"], outs["fa3"], prompt))


def smoke(write: Optional[Any] = None) -> list[dict]:
    """The script end to end on the CPU in seconds: a tiny model, batch 1 and 2, transformers'
    BlockMask builder run eagerly (it compiles ``create_block_mask`` otherwise, which dominates on
    a CPU). Without TRITON_INTERPRET=1 "fa3" runs torch's flex_attention on the CPU (our kernels'
    CPU checks are tests/test_decode_*.py), so this checks the plumbing and the report more than
    our kernels.

    Example::

        >>> smoke()[0]["identical_sequences"]   # doctest: +SKIP
        '1/1'
    """
    from unittest import mock

    with mock.patch("transformers.masking_utils._is_torch_greater_or_equal_than_2_6", False):
        return run([(1, 12), (2, 12)], 4, 1, smoke=True, device="cpu", repeats=1, write=write)


def table(records: list[dict]) -> str:
    """The records as a markdown table (skipped cases with their reason).

    Example::

        >>> print(table([{"batch": 32, "prompt": 32768, "skipped": "does not fit"}]).splitlines()[-1])
        | 32 | 32768 | skipped: does not fit | | | | | | |
    """
    lines = ["| batch | prompt | sdpa tok/s | fa3 tok/s | fa3/sdpa | prefill ms sdpa / fa3 | identical | "
             "match | family |", "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if "skipped" in r:
            lines.append(f"| {r['batch']} | {r['prompt']} | skipped: {r['skipped']} | | | | | | |")
            continue
        lines.append(f"| {r['batch']} | {r['prompt']} | {r['sdpa']['decode_tokens_per_s']} | "
                     f"{r['fa3']['decode_tokens_per_s']} | {r['fa3_over_sdpa_tokens_per_s']} | "
                     f"{r['sdpa']['prefill_ms']} / {r['fa3']['prefill_ms']} | {r['identical_sequences']} | "
                     f"{r['token_match_rate']} | {r.get('fa3_decode_family')} |")
    return "\n".join(lines)


def _parse_case(text: str) -> tuple[int, int]:
    try:
        batch, prompt = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a case is BATCHxPROMPT, e.g. 32x4096; got {text!r}") from None
    return batch, prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU, seconds")
    parser.add_argument("--cases", type=_parse_case, nargs="+", default=list(GPU_CASES),
                        help="BATCHxPROMPT cases, in order (default 1x4096 32x4096 1x32768 32x32768)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="best of, after a warm-up")
    parser.add_argument("--budget-s", type=float, default=90.0,
                        help="cases starting after this many seconds are skipped (default 90)")
    parser.add_argument("--out", default=None, help="folder for the JSON (default: print only)")
    parser.add_argument("--compile", choices=COMPILE_MODES, default="auto",
                        help="auto: transformers compiles static-cache decode steps itself (the user's "
                             "path); off: generate(disable_compile=True), every step eager")
    args = parser.parse_args()
    _compile["mode"] = args.compile
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("examples/generate.py needs a CUDA GPU (or --smoke for the CPU check)")
    import transformers

    now = datetime.datetime.now(datetime.timezone.utc)
    name = "cpu" if args.smoke else torch.cuda.get_device_name()
    meta = dict(device=name, torch=torch.__version__, transformers=transformers.__version__,
                date=f"{now:%Y-%m-%d %H:%M}Z", smoke=args.smoke,
                model=dict(TINY if args.smoke else REALISTIC, num_hidden_layers=1 if args.smoke else args.layers),
                new_tokens=args.new_tokens, repeats=args.repeats, budget_s=args.budget_s,
                compile=args.compile,
                command="python examples/generate.py " + " ".join(sys.argv[1:]))
    path = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        slug = name.lower().replace("nvidia ", "nvidia-").replace(" ", "-")
        path = os.path.join(args.out, f"generate-{slug}-{now:%Y-%m-%d-%H%M}.json")

    def write(records: list[dict]) -> None:
        if path is not None:
            with open(path, "w") as f:
                json.dump(dict(meta, records=records), f, indent=1)

    if args.smoke:
        records = smoke(write)
    else:
        records = run(args.cases, args.new_tokens, args.layers, smoke=False, device="cuda",
                      repeats=args.repeats, budget_s=args.budget_s, write=write)
    print("\n" + table(records))
    if path:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
