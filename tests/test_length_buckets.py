"""Sequence lengths never force a new compile (issue 16, item 5).

For each kernel family and typical sites, the Triton specialization key of a launch at 20 random
lengths in 1..32768 (and batches 1..4) must be among the keys the site's first launch compiles: its
own and its siblings' (runtime/variants.py). Keys are computed with Triton's own binder
(variants.specialization_key), on meta tensors: no GPU, no compile, a few seconds. Runs in both test
sessions (the interpreted kernels are keyed as the JIT would key them).
"""

from __future__ import annotations

import functools
import os
import random
import subprocess
import sys

import pytest
import torch

from fa3_inductor import mods
from fa3_inductor.runtime.variants import specialization_key
from fa3_inductor.templates.generic.host import prepare_generic_variants
from fa3_inductor.templates.modgen import BufferSpec, generate_mod_source, load_mod, trace_mod

FAMILIES = {  # name: (family, dialect of the mods, GPU target (capability))
    "hopper": ("hopper", "gl", (9, 0)),
    "generic_sm90": ("generic", "tl", (9, 0)),
    "generic_sm80": ("generic", "tl", (8, 0)),
}
SITES = ["noop", "causal", "softcap", "document", "gqa_causal"]
H, H_GQA = 16, 4


@functools.lru_cache(maxsize=None)
def _mod(name: str, dialect: str):
    """A generated mod, once per test session. The document mask's source does not depend on the
    length of its id buffers (shown by test_document_mask_source_ignores_the_length)."""
    fn, kind = {"softcap": (mods.softcap(30.0), "score"), "causal": (mods.causal, "mask"),
                "document": (mods.document(_doc_ids(1000)), "mask")}[name]
    return _generated(fn, kind, dialect)


def _generated(fn, kind, dialect):
    gm, bufs = trace_mod(fn, kind)
    return load_mod(generate_mod_source(gm, kind, [BufferSpec.of(b) for b in bufs], dialect), dialect)


def _doc_ids(L: int) -> torch.Tensor:
    return (torch.arange(L) // 700).to(torch.int32)


def _causal_tables(L: int, block: int = 128):
    """The block tables torch's create_block_mask gives a causal mask (diagonal blocks partial, the
    blocks below full), built directly: create_block_mask at 32k evaluates a 32k x 32k mask."""
    n = -(-L // block)
    rows = torch.arange(n)
    kv_num = torch.ones(1, 1, n, dtype=torch.int32)
    kv_idx = torch.zeros(1, 1, n, n, dtype=torch.int32)
    kv_idx[0, 0, :, 0] = rows.to(torch.int32)
    full_num = rows.to(torch.int32).reshape(1, 1, n)
    full_idx = torch.arange(n, dtype=torch.int32).expand(1, 1, n, n).contiguous()
    return dict(kv_num_blocks=kv_num, kv_indices=kv_idx, full_kv_num_blocks=full_num,
                full_kv_indices=full_idx, sparse_q_block=block, sparse_kv_block=block)


def _launch_options(site: str, dialect: str, L: int, D: int) -> dict:
    options = dict(sm_scale=D ** -0.5)
    if site == "softcap":
        options["score_mod"] = _mod("softcap", dialect)
    if site in ("causal", "gqa_causal"):
        options.update(mask_mod=_mod("causal", dialect), **_causal_tables(L))
    if site == "document":
        doc = _doc_ids(L)
        options.update(mask_mod=_mod("document", dialect), mask_bufs=(doc, doc), **_causal_tables(L))
    return options


def _variants(name: str, site: str, D: int, B: int, L: int):
    family, dialect, capability = FAMILIES[name]
    hkv = H_GQA if site.startswith("gqa") else H
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k, v = torch.empty(B, H, L, D, **meta), torch.empty(B, hkv, L, D, **meta), torch.empty(B, hkv, L, D, **meta)
    out, lse, mx = torch.empty_like(q), torch.empty(B, H, L, device="meta"), torch.empty(B, H, L, device="meta")
    options = _launch_options(site, dialect, L, D)
    if family == "generic":   # what GenericFamily.prepare calls, planned for a GPU the tensors are not on
        return prepare_generic_variants(q, k, v, out, lse, mx, plan_for=capability, **options)
    from fa3_inductor.templates.hopper import prepare_fwd_sm90_variants   # what HopperFamily.prepare calls

    return prepare_fwd_sm90_variants(q, k, v, out, lse, mx, **options)


def _key(name: str, launch) -> str:
    from triton.backends.compiler import GPUTarget

    major, minor = FAMILIES[name][2]
    kernel, args, kwargs, _ = launch
    return specialization_key(kernel, args, kwargs, GPUTarget("cuda", major * 10 + minor, 32))


@pytest.mark.parametrize("D", [64, 96, 128])
@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_random_lengths_reuse_the_warm_up_compiles(name, site, D):
    warm_len = 1000
    launch, siblings = _variants(name, site, D, 2, warm_len)
    compiled = {_key(name, launch)} | {_key(name, s) for s in siblings}
    assert len(compiled) == 1 + len(siblings), "siblings must be distinct kernels"
    rng = random.Random(f"{name}-{site}-{D}")
    for _ in range(20):
        L, B = rng.randint(1, 32768), rng.randint(1, 4)
        assert _key(name, _variants(name, site, D, B, L)[0]) in compiled, \
            f"{name} {site} D={D}: a launch at length {L}, batch {B} would compile"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_warm_up_prepares_each_length_choice(name):
    """The siblings span exactly the choices a length makes: EVEN_N, the Hopper schedule (persistent
    with or without the O staging buffer) and the generic tiles of long plain sites on sm90."""
    launch, siblings = _variants(name, "noop", 128, 2, 1000)
    kinds = {(s[2]["FLAGS"].EVEN_N, s[2]["SCHED"].PERSISTENT, None) if "SCHED" in s[2]   # Hopper
             else (s[2]["FLAGS"].EVEN_N, None, s[2]["TILE"].BLOCK_M) for s in [launch, *siblings]}
    expected = {"hopper": 4, "generic_sm90": 4, "generic_sm80": 2}[name]
    assert len(kinds) == expected, kinds
    causal_launch, causal_siblings = _variants(name, "causal", 128, 2, 1000)
    assert len(causal_siblings) == {"hopper": 3, "generic_sm90": 1, "generic_sm80": 1}[name]


def test_lengths_do_not_enter_the_key():
    """What each launch argument adds to the key: the descriptors give their block shapes and dtype,
    the sizes that follow the lengths give only their type (no hint), whatever the length."""
    launch = _variants("hopper", "causal", 128, 1, 4096)[0]
    key = _key("hopper", launch)
    assert "tensordesc<bf16[1, 1, 64, 128]" in key and "4096" not in key, key
    generic = _key("generic_sm90", _variants("generic_sm90", "noop", 128, 1, 4096)[0])
    assert "4096" not in generic and "'constexpr', 1)" not in generic.split("(")[0], generic


_SUBPROCESS = """
import sys, json
sys.path.insert(0, {tests!r})
import test_length_buckets as t
from fa3_inductor.runtime.variants import disk_cache_key
print(json.dumps([disk_cache_key(*t._variants(n, s, 128, 2, 1000)[0][:3]) for n, s in {cases!r}]))
"""


def test_a_second_process_finds_the_same_disk_cache_keys():
    """Triton's on-disk cache key (source hashes of the kernel and of the generated mods, signature,
    constexprs, options) holds nothing process-specific: two fresh processes (compiling ones: no
    interpreter) compute the same keys, so the second loads the kernels the first one compiled."""
    import json

    cases = [("hopper", "document"), ("hopper", "softcap"), ("generic_sm90", "causal"),
             ("generic_sm90", "noop")]
    code = _SUBPROCESS.format(tests=os.path.dirname(os.path.abspath(__file__)), cases=cases)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    keys = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        keys.append(json.loads(out.strip().splitlines()[-1]))
    assert keys[0] == keys[1] and len(set(keys[0])) == len(cases)


def test_document_mask_source_ignores_the_length():
    """A mask reading 1-D id buffers generates the same source at every length (one compile)."""
    def source(L):
        gm, bufs = trace_mod(mods.document(_doc_ids(L)), "mask")
        return generate_mod_source(gm, "mask", [BufferSpec.of(b) for b in bufs], "gl")
    assert source(1000) == source(31_111)


def test_queued_variant_compiles_are_dropped_at_exit():
    """A daemon thread stopped inside Triton's compiler aborts the process at exit (exit code 134
    on an H100): the exit handler drops queued compiles and waits for the running one."""
    from concurrent.futures import Future

    from fa3_inductor.runtime import variants

    queued, running = Future(), Future()
    running.set_result("compiled")
    with variants._lock:
        variants._inflight[("queued",)] = queued
        variants._inflight[("running",)] = running
    variants._jobs.put((("queued",), None, None, queued))
    variants._drain_at_exit()
    assert queued.done() and queued.result() is None
    assert ("queued",) not in variants._inflight
    variants._inflight.pop(("running",), None)


@pytest.mark.parametrize("site", ["noop", "document"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_queued_sibling_keeps_its_key_and_none_of_the_callers_tensors(name, site):
    """Siblings are compiled on a background thread from stand-ins (variants.stand_in): meta tensors
    with the launch's shapes, strides and dtypes, so that no queued job holds memory of the call (CUDA
    graph trees check that nothing allocated in their pool outlives a warm-up or recording) while Triton
    compiles exactly the kernel the real launch would need."""
    from fa3_inductor.runtime.variants import stand_in

    family, dialect, capability = FAMILIES[name]
    q, k, v = (torch.randn(2, H, 384, 64, dtype=torch.bfloat16) for _ in range(3))
    out, lse, mx = torch.empty_like(q), torch.empty(2, H, 384), torch.empty(2, H, 384)
    options = _launch_options(site, dialect, 384, 64)
    if family == "generic":
        launch, siblings = prepare_generic_variants(q, k, v, out, lse, mx, plan_for=capability, **options)
    else:
        from fa3_inductor.templates.hopper import prepare_fwd_sm90_variants

        launch, siblings = prepare_fwd_sm90_variants(q, k, v, out, lse, mx, **options)
    for real in (launch, *siblings):
        standin = stand_in(real)
        assert _key(name, standin) == _key(name, real)
        held = [a for a in standin[1] if isinstance(a, torch.Tensor)]
        held += [a.base for a in standin[1] if isinstance(getattr(a, "base", None), torch.Tensor)]
        assert held and all(t.device.type == "meta" for t in held)
