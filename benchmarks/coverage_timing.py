"""GPU timing for the coverage harness (benchmarks/coverage.py --timing): the forward of each
family in :data:`TIMED_FAMILIES` at a realistic size (the family's default config, 2 layers),
compiled with ``backend="fa3"`` against stock Inductor (``backend="inductor"``), and the switch
that makes the fa3 backend rewrite every site whatever its size (:func:`every_size`).

Example::

    >>> row = time_family(fam, 8, 512, torch.device("cuda"), torch.bfloat16)   # doctest: +SKIP
    >>> row["speedup"]                                                          # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from typing import Any, Iterator, Optional

import torch

# The 10 families timed at a realistic size on the GPU (--timing): the architectures of the most
# downloaded models on the Hugging Face Hub, as we read its "most downloads" listings (sentence
# encoders, CLIP/ViT image towers, Whisper, the Llama/Qwen/Mistral/Gemma decoders, GPT-2, T5).
# Our reading, not a fetched ranking: this machine cannot reach the Hub. Each: (family, batch,
# sequence length or image side). At these sizes the size rule (rewrite_pays.MIN_WORK, 4e9 q·k
# multiply-adds per site) leaves every site of the first six and of vit to stock Inductor (1.6e9
# for the 8 x 512 encoders, 3.2e9 gpt2, 5.4e8 t5's encoder, 9.5e8 vit), so as shipped fa3 equals
# stock Inductor there; only llama, qwen2 and mistral (6.9e10) are rewritten. --timing-every-size
# times our kernels on all ten (docs/coverage.md).
TIMED_FAMILIES = (
    ("bert", 8, 512), ("roberta", 8, 512), ("xlm-roberta", 8, 512), ("mpnet", 8, 512),
    ("gpt2", 4, 1024), ("t5", 4, 512), ("llama", 1, 4096), ("qwen2", 1, 4096),
    ("mistral", 1, 4096), ("vit", 32, 224),
)


@contextlib.contextmanager
def every_size() -> Iterator[None]:
    """Within it, the fa3 backend rewrites every site it recognizes whatever its size: the size
    rule of ``fa3_inductor/recognition/rewrite_pays.py`` (sites too small to pay stay as written,
    plain SDPA calls stay SDPA) is off. The coverage run on the GPU uses it, since its tiny models
    would otherwise leave every site to stock Inductor and check none of our kernels.

    Example::

        >>> with every_size():                                   # doctest: +SKIP
        ...     report = fa3_inductor.explain(model, **inputs)
    """
    from unittest import mock

    from fa3_inductor.recognition import recognize_sdpa, rewrite_pays

    with mock.patch.object(rewrite_pays, "MIN_WORK", 0), \
            mock.patch.object(rewrite_pays, "TRAIN_MIN_WORK", 0), \
            mock.patch.object(recognize_sdpa, "sdpa_keeps_plain_call", lambda *a, **k: None):
        yield


# Timing rounds: the backends are timed in turn, ROUNDS times, and each reports the median of its
# rounds. These 2-layer graphs are mostly host-bound at the timed sizes (0.1-0.2 ms of GPU work in
# 0.7-1.4 ms): one median per backend taken one after the other measured the host's state at that
# moment, and identical code spread 0.51-1.55 (docs/coverage.md).
ROUNDS = 7


def time_family(fam: Any, batch: int, seq: int, device: torch.device, dtype: torch.dtype,
                row: Optional[dict] = None, every_size_too: bool = False) -> dict[str, Any]:
    """Forward milliseconds (inference) of ``fam`` (a coverage.Family) at a realistic size, fa3
    vs stock Inductor, filled into ``row`` as they come (a time limit keeps what was measured).
    ``every_size_too``: also fa3 with :func:`every_size` on. Each backend's figure is the median
    of ROUNDS interleaved rounds (``<key>_ms_rounds`` keeps them).

    Example::

        >>> time_family(fam, 8, 512, torch.device("cuda"), torch.bfloat16)   # doctest: +SKIP
    """
    import triton.testing

    import fa3_inductor

    row = row if row is not None else {}
    row.update(family=fam.name, batch=batch, seq=seq)
    t0 = time.perf_counter()
    model, inputs = fam.build(realistic=True, batch=batch, seq=seq)
    model = model.to(device, dtype).eval()
    inputs = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device))
              if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    row["build_s"] = round(time.perf_counter() - t0, 1)
    fa3 = torch._dynamo.lookup_backend("fa3")

    def fa3_every_size(gm, example_inputs):   # its own backend object: a cache entry of its own
        return fa3(gm, example_inputs)

    runs = [("fa3", "fa3", False), ("inductor", "inductor", False)]
    if every_size_too:
        runs.append(("fa3_every_size", fa3_every_size, True))
    compile_s, compiled = [], {}
    with torch.no_grad():
        report = fa3_inductor.explain(model, **inputs)
        row["fused"], row["sites"] = report.fused_count, report.fused_count + len(report.unfused)
        row["templates"] = dict(Counter(s.template for s in report.sites))
        row["left_alone"] = dict(Counter(u.reason[:160] for u in report.unfused))
        torch._dynamo.reset()
        # Each backend compiles once (Dynamo keeps one cache entry per backend object), then
        # they are timed in turn: no reset between them, or the earlier ones would recompile.
        for key, backend, forced in runs:
            with every_size() if forced else contextlib.nullcontext():
                fn = torch.compile(model, backend=backend)
                t = time.perf_counter()
                fn(**inputs)
                torch.cuda.synchronize()
                compile_s.append(f"{key} {time.perf_counter() - t:.0f}")
            compiled[key] = fn
            row["compile_s"] = ", ".join(compile_s)
        rounds: dict[str, list[float]] = {key: [] for key in compiled}
        for _ in range(ROUNDS):
            for key, fn in compiled.items():
                rounds[key].append(float(triton.testing.do_bench(
                    lambda: fn(**inputs), warmup=10, rep=40, return_mode="median")))
                row[f"{key}_ms_rounds"] = [round(x, 4) for x in rounds[key]]
                row[f"{key}_ms"] = statistics.median(rounds[key])
            row["speedup"] = row["inductor_ms"] / row["fa3_ms"]
            if "fa3_every_size" in rounds:
                row["speedup_every_size"] = row["inductor_ms"] / row["fa3_every_size_ms"]
    return row
