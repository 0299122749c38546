"""backend="fa3" on a graph it leaves alone is backend="inductor": the same generated code, the
same Inductor cache entries (so the same autotuned choices), the same Python path per call, and
the same reset.

The attention layer of benchmarks/first_use.py (qkv projection, SDPA causal, out projection) is
left as written on CUDA at the benchmark's sizes (recognition/rewrite_pays.py). On the CPU the
SDPA rewrite always pays (our kernel runs there to check its numerics), so these tests make the
CUDA rule answer "keep the call" for every site, as it does on an H100 at those sizes.
"""

from __future__ import annotations

import cProfile
import importlib.util
import os
import pathlib
import pstats
import re

import pytest
import torch

import fa3_inductor
from fa3_inductor.recognition import recognize_sdpa
from generated_code import normalize_code

pytestmark = pytest.mark.usefixtures("fresh_compiles")


def _first_use_module():
    """benchmarks/first_use.py, loaded as a module (its layers are what these tests pin)."""
    spec = importlib.util.spec_from_file_location(
        "fa3_first_use", pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "first_use.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


AttentionLayer = _first_use_module().AttentionLayer


@pytest.fixture
def sites_left_alone(monkeypatch):
    """Every plain SDPA call stays SDPA, as rewrite_pays decides on CUDA at these sizes."""
    monkeypatch.setattr(recognize_sdpa, "sdpa_keeps_plain_call",
                        lambda *a, **k: "left alone by the test (as on CUDA at this size)")


def _layer_and_input():
    torch.manual_seed(0)
    return AttentionLayer(32, 2).eval(), torch.randn(2, 16, 32)


def _code(backend: str, layer, x, **compile_kwargs) -> list[str]:
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with torch.no_grad():
        _, code = run_and_get_code(torch.compile(layer, backend=backend, **compile_kwargs), x)
    return [normalize_code(c) for c in code]


@pytest.mark.parametrize("mode", [None, "max-autotune-no-cudagraphs"])
def test_site_left_alone_gives_stock_inductor_code(sites_left_alone, mode):
    layer, x = _layer_and_input()
    fa3_inductor.clear_lowered_sites()
    fa3 = _code("fa3", layer, x, mode=mode)
    assert fa3_inductor.lowered_sites() == []
    sites = fa3_inductor.recognized_sites()
    assert [(s["front_door"], s["rewritten"]) for s in sites] == [("sdpa", False)], sites
    stock = _code("inductor", layer, x, mode=mode)
    assert fa3 and fa3 == stock, "backend='fa3' generated other code than backend='inductor'"


@pytest.mark.parametrize("mode", [None, "reduce-overhead", "max-autotune-no-cudagraphs"])
def test_site_left_alone_reuses_stock_inductors_cache_entry(sites_left_alone, tmp_path,
                                                            monkeypatch, mode):
    # Same config => same FX graph cache and AOT autograd cache keys as the stock Inductor:
    # the fa3 compile loads the very artifact backend="inductor" made (its code, its autotuned
    # choices), instead of compiling its own under a key of this package's sources.
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    layer, x = _layer_and_input()
    hits = {}
    with inductor_config.patch(fx_graph_cache=True), \
            functorch_config.patch(enable_autograd_cache=True), torch.no_grad():
        for backend in ("inductor", "fa3"):
            torch._dynamo.reset()
            counters.clear()
            torch.compile(layer, backend=backend, mode=mode)(x)
            hits[backend] = (counters["inductor"]["fxgraph_cache_hit"],
                             counters["aot_autograd"]["autograd_cache_hit"])
    assert hits["inductor"] == (0, 0), hits     # a fresh cache: the stock compile made the entry
    assert hits["fa3"] != (0, 0), (f"backend='fa3' compiled its own artifact for a graph it leaves "
                                   f"alone (cache hits fx/aot: {hits})")


def test_graph_with_a_flex_site_keeps_our_lowering():
    # The other side of the rule: a flex_attention call (here the user's, template "torch")
    # is still compiled with our marker pass, so our lowering sees and records it.
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from fa3_inductor import mods

    def attention(q, k, v, block_mask):
        return flex_attention(q, k, v, block_mask=block_mask)

    q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
    bm = create_block_mask(mods.causal, None, None, 128, 128, device="cpu")
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(attention, backend="fa3", options={"fa3.template": "torch"})(q, k, v, bm)
    assert [s["template"] for s in fa3_inductor.lowered_sites()] == ["torch"]


def test_has_flex_attention_looks_into_nested_graphs():
    from fa3_inductor.backend import has_flex_attention
    from fa3_inductor.recognition.recognize_flex import FLEX_OP

    inner = torch.fx.Graph()
    q = inner.placeholder("q")
    inner.output(inner.call_function(FLEX_OP, (q, q, q, None, (), 1.0, {})))
    outer = torch.fx.Graph()
    x = outer.placeholder("x")
    outer.output(outer.call_function(torch.sin, (x,)))
    root = torch.nn.Module()
    root.sub = torch.fx.GraphModule(torch.nn.Module(), inner)
    gm = torch.fx.GraphModule(root, outer)
    gm.sub = root.sub
    assert has_flex_attention(gm)
    assert not has_flex_attention(torch.fx.GraphModule(torch.nn.Module(), outer))


def _per_call_path(fn, x, calls: int = 20) -> dict[str, int]:
    """Every Python function one call runs, with its count (a profile of ``calls`` calls, the
    generated module's file name normalized): what differs between two wrappers is a frame."""
    with torch.no_grad():
        fn(x)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(calls):
            fn(x)
        profile.disable()
    path = {}
    for (filename, line, name), (_, ncalls, *_rest) in pstats.Stats(profile).stats.items():
        if "torchinductor" in filename or re.search(r"/[a-z0-9]{2}/c[a-z0-9]{40,}\.py$", filename):
            filename = "<inductor output code>"
        key = f"{os.path.basename(filename)}:{name}"
        path[key] = path.get(key, 0) + ncalls
    return path


def test_site_left_alone_runs_the_stock_per_call_path(sites_left_alone):
    layer, x = _layer_and_input()
    paths = {}
    for backend in ("fa3", "inductor"):
        torch._dynamo.reset()
        paths[backend] = _per_call_path(torch.compile(layer, backend=backend), x)
    extra = {k: v for k, v in paths["fa3"].items() if paths["inductor"].get(k) != v}
    missing = {k: v for k, v in paths["inductor"].items() if paths["fa3"].get(k) != v}
    assert "<inductor output code>:call" in paths["inductor"]
    assert not extra and not missing, (f"per-call path differs: fa3 only / other counts {extra}; "
                                       f"inductor only / other counts {missing}")


def test_dynamo_reset_drops_cuda_graph_trees_as_for_inductor(monkeypatch):
    # torch._dynamo.reset() calls the backend's reset: the inductor backend's resets CUDA graph
    # trees when it compiled with cudagraphs; ours must too (reduce-overhead, max-autotune).
    import torch._inductor.cudagraph_trees as trees

    calls = []
    monkeypatch.setattr(trees, "reset_cudagraph_trees", lambda: calls.append(1))
    for backend in ("inductor", "fa3"):
        calls.clear()
        torch._dynamo.reset()
        calls.clear()
        torch.compile(lambda t: t.sin() + 1, backend=backend, mode="reduce-overhead")(
            torch.randn(8))
        torch._dynamo.reset()
        assert calls, f"torch._dynamo.reset() left backend={backend!r}'s CUDA graph trees"
