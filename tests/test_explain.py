"""fa3_inductor.explain(), the fa3_inductor log channel, and the fa3.recognize switch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

import fa3_inductor
from fa3_inductor.explain import ExplainReport, _link
from fa3_inductor.report import LoweredSite, RecognizedSite


@pytest.fixture(autouse=True)
def needs_the_interpreter():
    from triton import knobs

    if not knobs.runtime.interpret and not torch.cuda.is_available():
        pytest.skip("our kernels need CUDA or TRITON_INTERPRET=1")


def _softcap(score, b, h, q_idx, kv_idx):
    return 5.0 * torch.tanh(score / 5.0)


def three_sites(q, k, v, odd):
    """An SDPA call we fuse, a flex_attention call, and an SDPA call we leave alone (head dim
    12: our kernels do not serve it, so recognition keeps SDPA)."""
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    b = flex_attention(a, k, v, score_mod=_softcap, enable_gqa=True)
    return b, F.scaled_dot_product_attention(odd, odd, odd)


def _inputs():
    q = torch.randn(1, 4, 32, 16)
    k, v = torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
    return q, k, v, torch.randn(1, 2, 32, 12)


def test_explain_reports_each_site_with_its_template():
    with torch.no_grad():
        report = fa3_inductor.explain(three_sites, *_inputs())
    assert report.fused_count == 2 and report.served_count == 2 and report.graph_count == 1
    sdpa, flex = report.sites
    assert (sdpa.front_door, sdpa.mask, sdpa.gqa_groups, sdpa.template) == (
        "sdpa", "causal", 2, "generic")
    assert flex.front_door == "flex_attention" and flex.template == "generic"
    assert "tanh" in flex.score_mods[0] and flex.mask == "none"
    [left] = report.unfused
    assert left.front_door == "sdpa" and "head dim 12" in left.reason
    text = str(report)
    assert "2 attention site(s) fused" in text and "left alone:" in text
    assert "generic" in text and "head dim 12" in text
    json.dumps(report.as_dict())  # plain data


def test_each_site_gets_its_own_lowering_not_its_neighbours():
    # The flex call has head dim 12, which our kernels do not serve: torch's kernel runs it.
    # It comes first in the program; the SDPA site after it is ours. A link by position in the
    # records (rather than by the tag on the node) would be easy to get backwards here.
    def two(q, k, v, q12, k12, v12):
        odd = flex_attention(q12, k12, v12, score_mod=_softcap)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True), odd

    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    odd = [torch.randn(1, 2, 32, 12) for _ in range(3)]
    with torch.no_grad():
        report = fa3_inductor.explain(two, q, k, v, *odd)
    by_door = {s.front_door: s for s in report.sites}
    assert by_door["sdpa"].template == "generic" and by_door["sdpa"].fallback_reason is None
    assert by_door["flex_attention"].template == "torch"
    assert "head dim 12" in by_door["flex_attention"].fallback_reason
    assert "12]" in by_door["flex_attention"].shape
    # ...and the link is the tag the lowering read off the node, not the order of records.
    assert all(s["site_id"] is not None for s in fa3_inductor.lowered_sites()[-2:])


def test_explain_leaves_the_users_compiled_functions_alone():
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(gm)
        return fa3_inductor.fa3_backend(gm, example_inputs)

    torch._dynamo.reset()
    args = _inputs()
    users = torch.compile(three_sites, backend=counting)
    with torch.no_grad():
        expected = users(*args)
        # Compiled by the user with the same backend: explain still recognizes and lowers
        # (neither Dynamo's code cache nor the FX graph cache serves it).
        report = fa3_inductor.explain(users, *args)
        again = users(*args)
    assert report.fused_count == 2
    assert len(compiles) == 1, "explain() made the user's compiled function recompile"
    torch.testing.assert_close(again, expected)


def test_recognize_false_leaves_sdpa_and_still_lowers_flex():
    with torch.no_grad():
        report = fa3_inductor.explain(three_sites, *_inputs(),
                                      compile_options={"fa3.recognize": False})
        compiled = torch.compile(three_sites, backend="fa3",
                                 options={"fa3.recognize": False})
        out = compiled(*_inputs())
    assert [s.front_door for s in report.sites] == ["flex_attention"]
    assert report.sites[0].template == "generic"
    assert report.unfused == []  # recognition did not even look
    torch.manual_seed(0)
    args = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(compiled(*args), three_sites(*args), atol=2e-5, rtol=1e-4)
    assert out[0].shape == (1, 4, 32, 16)


def test_untagged_lowerings_pair_up_in_order_or_stay_unknown():
    rec = [RecognizedSite("sdpa", "a", True), RecognizedSite("sdpa", "b", True)]
    low = [LoweredSite("generic", "none", "none", "s1"),
           LoweredSite("torch", "?", "?", "s2", "head dim 12")]
    fused, _ = _link(rec, low)
    assert [(s.template, s.shape) for s in fused] == [("generic", "s1"), ("torch", "s2")]
    fused, _ = _link(rec, low[:1])
    assert [s.template for s in fused] == ["unknown", "unknown"]


def test_explain_refuses_what_is_not_callable():
    with pytest.raises(TypeError, match="function or an nn.Module"):
        fa3_inductor.explain(42)


_LOGGED = textwrap.dedent("""
    import logging, os, torch, torch.nn.functional as F
    import fa3_inductor
    if os.environ.get("FA3_TEST_SET_LOGS"):
        torch._logging.set_logs(modules={"fa3_inductor": logging.INFO})
    def f(q, odd):
        a = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return a, F.scaled_dot_product_attention(odd, odd, odd)
    with torch.no_grad():
        torch.compile(f, backend="fa3")(torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 12))
    print("done")
""")


@pytest.mark.parametrize("torch_logs", ["fa3_inductor", "set_logs", None])
def test_torch_logs_channel_shows_recognition_and_lowering(torch_logs):
    env = dict(os.environ, TRITON_INTERPRET="1", TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
    env.pop("TORCH_LOGS", None)
    if torch_logs == "set_logs":
        env["FA3_TEST_SET_LOGS"] = "1"
    elif torch_logs:
        env["TORCH_LOGS"] = torch_logs
    run = subprocess.run([sys.executable, "-c", _LOGGED], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0 and "done" in run.stdout, run.stderr[-3000:]
    said = [line for line in run.stderr.splitlines() if "fa3_inductor:" in line]
    if torch_logs is None:
        assert said == [], said
        return
    text = "\n".join(said)
    assert "-> flex_attention (mods: none; mask: causal" in text, run.stderr[-3000:]
    assert "left alone: head dim 12" in text
    assert "-> generic template" in text


def test_rewritten_sites_pair_with_new_flex_nodes_in_program_order():
    from fa3_inductor.recognition.recognize_flex import FLEX_OP, tag_rewritten
    from fa3_inductor.report import site_tag

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    first = graph.call_function(FLEX_OP, (x,))
    second = graph.call_function(FLEX_OP, (first,))
    graph.output(second)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    positions = {"x": 0, "sdpa_early": 1, "matmul_late": 2}
    late = RecognizedSite("matmul-softmax", "matmul_late", True)
    early = RecognizedSite("sdpa", "sdpa_early", True)
    kept = RecognizedSite("sdpa", "sdpa_kept", False, "why")
    assert tag_rewritten(gm, [], positions, [late, kept, early])  # reported out of order
    assert (site_tag(first), site_tag(second)) == (early.site_id, late.site_id)
    assert kept.site_id is None
    # Three rewritten sites, two new nodes: nothing is tagged rather than a wrong pairing.
    three = [RecognizedSite("sdpa", name, True) for name in ("a", "b", "c")]
    assert not tag_rewritten(gm, [], positions, three)
    assert all(site.site_id is None for site in three)
    # A node the user wrote (named in ``before``) is not a rewritten site's.
    assert not tag_rewritten(gm, [first.name], positions, [early, late])


def _plan_on_sm90(monkeypatch, dtype, head_dim):
    """plan_site for a plain site as if on an sm90 GPU (the device query patched: no GPU here)."""
    from torch.nn.attention.flex_attention import noop_mask

    from fa3_inductor.config import Settings
    from fa3_inductor.lowering.site_plan import plan_site
    from fa3_inductor.templates.modgen import trace_mod

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    score_gm, _ = trace_mod(lambda score, b, h, q_idx, kv_idx: score, "score")
    mask_gm, _ = trace_mod(noop_mask, "mask")
    spec, reason = plan_site(score_gm, mask_gm, [], [], device=torch.device("cuda"), dtype=dtype, q_heads=4,
                             kv_heads=4, head_dim=head_dim, value_head_dim=head_dim, batches_match=True,
                             sparse_blocks=(128, 128), settings=Settings(), description="test site")
    assert reason is None
    return spec


@pytest.mark.parametrize("dtype, head_dim, template, says", [
    (torch.bfloat16, 96, "hopper", "tiles 128x128, 2 K/V stages, shared tiles of 64 + 32 columns"),
    (torch.float16, 192, "hopper", "1 K + 2 V stages, shared tiles of 128 + 64 columns, pingpong, no overlap; "
                                   "fixed-base score mods: tiles 128x64"),
    (torch.bfloat16, 112, "generic", "no tiles for head dim 112"),
    (torch.float32, 128, "generic", "float32 inputs"),
])
def test_an_sm90_site_says_which_tiles_or_why_not(monkeypatch, dtype, head_dim, template, says):
    spec = _plan_on_sm90(monkeypatch, dtype, head_dim)
    assert spec.template == template
    assert says in spec.note, spec.note
    assert spec.note.startswith("Hopper template")


def test_explain_shows_the_note_of_a_generic_site():
    note = "Hopper template: no tiles for head dim 112 (it serves 64, 128); generic runs"
    fused, _ = _link([RecognizedSite("sdpa", "y", True)], [LoweredSite("generic", "none", "none", "s1", note=note)])
    assert fused[0].note == note
    assert note in str(ExplainReport(fused, [], 1))
