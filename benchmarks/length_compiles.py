"""Compiles and first-call times at new sequence lengths (issue 16, item 5).

For each template ("auto": hopper on an H100/H200, and "generic") and site (noop, causal through a
prebuilt block mask, causal through mask_mod=, softcap 30), through ``fa3_inductor.flex`` (the direct
inference path): one warm-up call, then waiting for the site's sibling variants compiled in the
background (runtime/variants.py), then 20 random lengths in 1..32768 with batches 1..4 (seeded), H16
D128 bf16. Counts Triton compiles (JIT cache misses, counted by wrapping
JITFunction._do_compile) and times every first call (torch.cuda.synchronize around it; a prebuilt block
mask is built before the clock starts, one from mask_mod= inside it). Then a second Python process
makes one first call at a fresh length with the on-disk cache warm: its imports and its first call are
timed separately (process start excluded).

    python benchmarks/length_compiles.py --out DIR [--lengths 20] [--seed 0] [--budget-s 240]

Writes length-compiles-<device>-<YYYY-MM-DD-HHMM>.{json,md} into DIR (device, torch, triton, date in
both) and prints the table last. A site stops early once the run has used its share of --budget-s
(recorded in the results), so the whole run stays inside about five minutes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import threading
import time

_T_START = time.perf_counter()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SITES = ("noop", "causal_block_mask", "causal_mask_mod", "softcap")
TEMPLATES = ("auto", "generic")
H, D, WARM_LEN = 16, 128, 1000


class CompileCounter:
    """Triton compiles (in-memory JIT cache misses; a disk-cache hit counts too, but quickly) per
    thread kind, with their wall time. Counted by wrapping ``JITFunction._do_compile`` (what a cache
    miss calls): triton's JIT hooks cannot be used, they serialise the constexprs to JSON and fail
    on the Gluon mod functions our kernels take."""

    def __init__(self) -> None:
        from triton.runtime.jit import JITFunction

        self.events: list[dict] = []
        self._lock = threading.Lock()
        compile_kernel = JITFunction._do_compile
        counter = self

        def counted(jit, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return compile_kernel(jit, *args, **kwargs)
            finally:
                with counter._lock:
                    counter.events.append(dict(
                        kernel=jit.__name__ if hasattr(jit, "__name__") else str(jit),
                        seconds=time.perf_counter() - t0,
                        background=threading.current_thread() is not threading.main_thread()))

        JITFunction._do_compile = counted

    def mark(self) -> int:
        with self._lock:
            return len(self.events)

    def since(self, mark: int) -> list[dict]:
        with self._lock:
            return self.events[mark:]


def _inputs(B: int, L: int):
    import torch

    return [torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]


def _call(template: str, site: str, q, k, v, block_mask=None):
    import fa3_inductor
    from fa3_inductor import mods

    if site == "noop":
        return fa3_inductor.flex(q, k, v, template=template)
    if site == "causal_block_mask":
        return fa3_inductor.flex(q, k, v, block_mask=block_mask, template=template)
    if site == "causal_mask_mod":
        return fa3_inductor.flex(q, k, v, mask_mod=mods.causal, template=template)
    return fa3_inductor.flex(q, k, v, score_mod=mods.softcap(30.0), template=template)


def _block_mask(site: str, L: int):
    from torch.nn.attention.flex_attention import create_block_mask

    from fa3_inductor import mods

    if site != "causal_block_mask":
        return None
    return create_block_mask(mods.causal, None, None, L, L, device="cuda")


def first_call(template: str, site: str, B: int, L: int) -> tuple[float, str]:
    """(seconds of the first call at this length, the template that served it)."""
    import torch

    import fa3_inductor

    q, k, v = _inputs(B, L)
    bm = _block_mask(site, L)
    torch.cuda.synchronize()
    t = time.perf_counter()
    _call(template, site, q, k, v, bm)
    torch.cuda.synchronize()
    return time.perf_counter() - t, fa3_inductor.last_template()


def run_site(counter: CompileCounter, template: str, site: str, n: int, seed: int, deadline: float) -> dict:
    from fa3_inductor.runtime.variants import wait_for_variants

    mark = counter.mark()
    warm_s, served = first_call(template, site, 2, WARM_LEN)
    t = time.perf_counter()
    waited = wait_for_variants()
    wait_s = time.perf_counter() - t
    warm = counter.since(mark)
    rng = random.Random(f"{seed}-{site}")
    calls, mark = [], counter.mark()
    for _ in range(n):
        if time.perf_counter() > deadline:
            break
        L, B = rng.randint(1, 32768), rng.randint(1, 4)
        before = counter.mark()
        seconds, served_by = first_call(template, site, B, L)
        compiles = counter.since(before)
        calls.append(dict(B=B, L=L, seconds=seconds, template=served_by, compiles=len(compiles),
                          compile_s=sum(c["seconds"] for c in compiles)))
    later = counter.since(mark)
    return dict(template=template, site=site, served_by=served, warm_up_s=warm_s,
                warm_up_compiles=sum(not c["background"] for c in warm),
                background_compiles=sum(c["background"] for c in warm), background_waited=waited,
                background_wait_s=wait_s, calls=calls, lengths_run=len(calls), stopped_early=len(calls) < n,
                compiles_at_new_lengths=len(later), compile_s_at_new_lengths=sum(c["seconds"] for c in later),
                max_first_call_s=max((c["seconds"] for c in calls), default=None),
                median_first_call_s=sorted(c["seconds"] for c in calls)[len(calls) // 2] if calls else None)


def child(template: str, site: str, L: int) -> None:
    """The second process: imports, then one first call at a fresh length (the disk cache is warm)."""
    t0 = time.perf_counter()
    import torch
    t1 = time.perf_counter()
    import triton  # noqa: F401

    import fa3_inductor  # noqa: F401
    t2 = time.perf_counter()
    counter = CompileCounter()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    t3 = time.perf_counter()
    seconds, served = first_call(template, site, 2, L)
    events = counter.since(0)
    print(json.dumps(dict(template=template, site=site, L=L, served_by=served, import_torch_s=t1 - t0,
                          import_fa3_triton_s=t2 - t1, cuda_init_s=t3 - t2, first_call_s=seconds,
                          jit_misses=len(events), jit_miss_s=sum(e["seconds"] for e in events),
                          since_process_start_s=time.perf_counter() - _T_START)))


def second_process(template: str, site: str, L: int) -> dict:
    env = dict(os.environ, FA3_INDUCTOR_VARIANTS="off")   # time the call, not sibling compiles
    res = subprocess.run([sys.executable, __file__, "--child", template, site, str(L)], capture_output=True,
                         text=True, env=env, timeout=180)
    if res.returncode != 0:
        return dict(template=template, site=site, L=L, error=res.stderr[-2000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def markdown(meta: dict, sites: list[dict], children: list[dict]) -> str:
    lines = [f"# Compiles at new sequence lengths: {meta['device']}", "",
             f"torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; H{H} D{D} bf16, warm-up B2 "
             f"N{WARM_LEN}, then {meta['lengths']} random lengths in 1..32768, B 1..4 (seed {meta['seed']}).", "",
             "| template | site | served by | warm-up s | background compiles (wait s) | lengths | compiles | "
             "median first call s | max first call s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in sites:
        fmt = lambda x: "-" if x is None else f"{x:.3f}"
        lines.append(f"| {s['template']} | {s['site']} | {s['served_by']} | {s['warm_up_s']:.2f} | "
                     f"{s['background_compiles']} ({s['background_wait_s']:.1f}) | {s['lengths_run']}"
                     f"{' (stopped)' if s['stopped_early'] else ''} | {s['compiles_at_new_lengths']} | "
                     f"{fmt(s['median_first_call_s'])} | {fmt(s['max_first_call_s'])} |")
    lines += ["", "Second process, disk cache warm (process start excluded):", "",
              "| template | site | N | import torch s | import fa3/triton s | CUDA init s | first call s | JIT misses (s) |",
              "|---|---|---|---|---|---|---|---|"]
    for c in children:
        if "error" in c:
            lines.append(f"| {c['template']} | {c['site']} | {c['L']} | error: {c['error'][-200:]!r} |")
            continue
        lines.append(f"| {c['template']} | {c['site']} | {c['L']} | {c['import_torch_s']:.2f} | "
                     f"{c['import_fa3_triton_s']:.2f} | {c['cuda_init_s']:.2f} | {c['first_call_s']:.3f} | "
                     f"{c['jit_misses']} ({c['jit_miss_s']:.3f}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--lengths", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=240.0, help="for the in-process part, all sites")
    ap.add_argument("--sites", default=",".join(SITES))
    ap.add_argument("--templates", default=",".join(TEMPLATES))
    ap.add_argument("--child", nargs=3, metavar=("TEMPLATE", "SITE", "LENGTH"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], a.child[1], int(a.child[2]))
        return
    import torch
    import triton

    now = datetime.datetime.now(datetime.timezone.utc)
    device = torch.cuda.get_device_name()
    meta = dict(device=device, torch=torch.__version__, triton=triton.__version__, date=f"{now:%Y-%m-%dT%H:%MZ}",
                lengths=a.lengths, seed=a.seed, heads=H, head_dim=D, warm_up_length=WARM_LEN)
    print(f"device: {device}, torch {torch.__version__}, triton {triton.__version__}, {meta['date']}", flush=True)
    counter = CompileCounter()
    pairs = [(t, s) for t in a.templates.split(",") for s in a.sites.split(",")]
    start, sites = time.perf_counter(), []
    for i, (template, site) in enumerate(pairs):
        # each site gets an equal share of what is left of the budget
        deadline = time.perf_counter() + (a.budget_s - (time.perf_counter() - start)) / (len(pairs) - i)
        sites.append(run_site(counter, template, site, a.lengths, a.seed, deadline))
        s = sites[-1]
        print(f"{template:8s} {site:18s} served by {s['served_by']}: warm-up {s['warm_up_s']:.2f} s, "
              f"{s['background_compiles']} background compiles, {s['compiles_at_new_lengths']} compiles at "
              f"{s['lengths_run']} new lengths", flush=True)
    fresh = random.Random(a.seed + 1).randint(1, 32768)
    children = [second_process(t, "softcap", fresh) for t in a.templates.split(",")]
    os.makedirs(a.out, exist_ok=True)
    slug = device.lower().replace("nvidia ", "nvidia-").replace(" ", "-")
    base = os.path.join(a.out, f"length-compiles-{slug}-{now:%Y-%m-%d-%H%M}")
    with open(base + ".json", "w") as f:
        json.dump(dict(meta=meta, sites=sites, second_process=children), f, indent=1)
    text = markdown(meta, sites, children)
    with open(base + ".md", "w") as f:
        f.write(text)
    print(f"wrote {base}.json / .md\n")
    print(text)


if __name__ == "__main__":
    main()
