"""The fa3 backend: registration, gating of our lowering, options, and stock Inductor untouched."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fa3_inductor
from fa3_inductor import mods


def test_backend_is_listed_with_nothing_imported():
    # The entry point (pip install -e ., as make venv does) or, in a bare checkout, nothing:
    # then the test says so instead of passing vacuously.
    code = "import torch; print('fa3' in torch._dynamo.list_backends())"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd="/")
    if "True" not in out.stdout:
        import importlib.metadata as md
        eps = [e.name for e in md.entry_points(group="torch_dynamo_backends")]
        pytest.fail(f"'fa3' not listed without imports (entry points seen: {eps}; install the "
                    f"package with `pip install -e .`): {out.stdout}{out.stderr[-500:]}")


pytestmark = pytest.mark.usefixtures("fresh_compiles")


def _attention(q, k, v, block_mask):
    return flex_attention(q, k, v, score_mod=mods.softcap(5.0), block_mask=block_mask)


def _inputs():
    q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
    return q, k, v, create_block_mask(mods.causal, None, None, 128, 128, device="cpu")


def test_stock_inductor_does_not_use_our_lowering():
    from torch._inductor.utils import run_and_get_code

    q, k, v, bm = _inputs()
    fa3_inductor.clear_lowered_sites()
    torch._dynamo.reset()
    with torch.no_grad():
        _, code = run_and_get_code(torch.compile(_attention, backend="inductor"), q, k, v, bm)
    assert fa3_inductor.lowered_sites() == []
    assert "fa3_inductor" not in "\n".join(code)


def test_fa3_backend_lowers_and_records_the_site():
    from triton import knobs

    if not knobs.runtime.interpret:
        pytest.skip("needs TRITON_INTERPRET=1 to run our kernel on the CPU")
    from torch._inductor.utils import run_and_get_code

    q, k, v, bm = _inputs()
    fa3_inductor.clear_lowered_sites()
    torch._dynamo.reset()
    with torch.no_grad():
        _, code = run_and_get_code(torch.compile(_attention, backend="fa3"), q, k, v, bm)
    sites = fa3_inductor.lowered_sites()
    assert [s["template"] for s in sites] == ["generic"], sites
    assert "H.tanh" in sites[0]["score_mod"] and "q_idx >= kv_idx" in sites[0]["mask_mod"]
    assert "torch.ops.fa3_inductor.flex_fwd.default" in "\n".join(code)


def test_template_torch_option_hands_the_site_back_with_a_reason():
    q, k, v, bm = _inputs()
    fa3_inductor.clear_lowered_sites()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(_attention, backend="fa3", options={"fa3.template": "torch"})(
            q, k, v, bm)
        ref = _attention(q, k, v, bm)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    sites = fa3_inductor.lowered_sites()
    assert len(sites) == 1 and sites[0]["template"] == "torch"
    assert "fa3.template='torch'" in sites[0]["fallback_reason"]


def test_mode_is_accepted():
    torch._dynamo.reset()
    fn = torch.compile(lambda x: torch.sin(x) * 2, backend="fa3", mode="max-autotune-no-cudagraphs")
    x = torch.randn(8)
    torch.testing.assert_close(fn(x), torch.sin(x) * 2)


def test_cache_key_covers_package_sources_and_settings():
    from fa3_inductor.config import Settings
    from fa3_inductor.lowering.passes import Fa3PostGradPass, source_hash

    a = Fa3PostGradPass(Settings()).uuid()
    b = Fa3PostGradPass(Settings(template="generic")).uuid()
    assert a != b and source_hash() in a
