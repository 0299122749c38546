"""The kernel-family interface (templates/family.py, templates/registry.py).

A throwaway family registered for one test shows that adding a family needs nothing outside its own
code and the registry: the planner lists it, the op runs calls on it, a call it refuses moves to the
next family with the reason, and torch's dense family serves what nothing else does.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

import fa3_inductor
from fa3_inductor import direct, mods
from fa3_inductor.runtime import kernel_failures
from fa3_inductor.templates import registry
from fa3_inductor.templates.family import NotServed, SiteFacts
from fa3_inductor.templates.modgen_torch import load_torch_mod
from fa3_inductor.templates.torch_dense.family import TORCH
from reference import assert_matches_reference, reference_attention


class ThrowawayFamily:
    """Serves head dim 32 only, and computes with torch ops in the torch dialect; counts its calls."""

    name = "throwaway"
    dialect = "torch"

    def __init__(self, refuse_calls: bool = False):
        self.refuse_calls = refuse_calls
        self.launched = 0

    def serves(self, site: SiteFacts) -> Optional[str]:
        return None if site.head_dim == 32 else "throwaway: head dim 32 only"

    def describe(self, site: SiteFacts) -> str:
        return "throwaway tiles"

    def prepare(self, call):
        if self.refuse_calls:
            raise NotServed("throwaway: refuses this call")
        assert call.score_source is None or load_torch_mod(call.score_source)   # its own dialect's source
        return None

    def launch(self, call) -> None:
        self.launched += 1
        TORCH.launch(call)   # same dialect: torch's dense ops compute it


@pytest.fixture
def fresh():
    direct.clear()
    kernel_failures.clear()
    yield
    direct.clear()


def _qkv(d: int, dtype=torch.float32):
    return (torch.randn(1, 2, 96, d, dtype=dtype) for _ in range(3))


def test_the_registry_lists_the_shipped_families_with_torch_last():
    assert registry.names()[-2:] == ("generic", "torch")
    assert all(registry.family(n).name == n for n in registry.names())
    with pytest.raises(KeyError, match="no kernel family 'nope'"):
        registry.family("nope")


@pytest.mark.usefixtures("fresh_compiles", "cpu_kernels", "fresh")
def test_a_registered_family_serves_the_sites_it_accepts():
    family = ThrowawayFamily()
    score = mods.softcap(5.0)
    with registry.registered(family):
        assert fa3_inductor.config.templates()[1] == "throwaway"
        q, k, v = _qkv(32)
        with torch.no_grad():
            out = fa3_inductor.flex(q, k, v, score_mod=score, mask_mod=mods.causal)
        assert fa3_inductor.last_template() == "throwaway" and family.launched == 1
        assert_matches_reference(out, reference_attention(q, k, v, score, mods.causal)[0], q.dtype)
        # a head dim it does not serve goes to the next family
        q, k, v = _qkv(64)
        with torch.no_grad():
            out = fa3_inductor.flex(q, k, v, score_mod=score)
        assert fa3_inductor.last_template() == "generic" and family.launched == 1
        assert_matches_reference(out, reference_attention(q, k, v, score)[0], q.dtype)
    assert "throwaway" not in registry.names()


@pytest.mark.usefixtures("fresh_compiles", "cpu_kernels", "fresh")
def test_a_call_the_family_refuses_runs_on_the_next_one():
    family = ThrowawayFamily(refuse_calls=True)
    with registry.registered(family):
        q, k, v = _qkv(32)
        with torch.no_grad():
            out = fa3_inductor.flex(q, k, v, mask_mod=mods.causal)
        assert fa3_inductor.last_template() == "generic" and family.launched == 0
        assert_matches_reference(out, reference_attention(q, k, v, None, mods.causal)[0], q.dtype)


def test_the_plan_lists_the_candidates_and_says_why_a_preferred_family_is_passed_over():
    from torch.nn.attention.flex_attention import noop_mask

    from fa3_inductor.config import Settings
    from fa3_inductor.lowering.site_plan import plan_site
    from fa3_inductor.templates.modgen import trace_mod

    score_gm, _ = trace_mod(lambda s, b, h, q, kv: s * 2.0, "score")
    mask_gm, _ = trace_mod(noop_mask, "mask")
    with registry.registered(ThrowawayFamily()):
        plan = dict(device=torch.device("cpu"), dtype=torch.float32, q_heads=2, kv_heads=2,
                    value_head_dim=64, batches_match=True, sparse_blocks=(128, 128), description="t")
        spec, _ = plan_site(score_gm, mask_gm, [], [], head_dim=64, settings=Settings(), **plan)
        assert spec.families == ("generic", "torch")
        assert spec.note == "throwaway: head dim 32 only; generic runs"
        assert [m[0] for m in spec.mods] == ["tl", "torch"]
        spec, _ = plan_site(score_gm, mask_gm, [], [], head_dim=64, settings=Settings(template="torch"), **plan)
        assert spec is None
        plan["value_head_dim"] = 32
        spec, _ = plan_site(score_gm, mask_gm, [], [], head_dim=32, settings=Settings(), **plan)
        assert spec.families == ("throwaway", "generic", "torch") and spec.note == "throwaway tiles"
        assert [m[0] for m in spec.mods] == ["torch", "tl"]   # each dialect once
        assert dict(spec.score_info)["out_scale"] == 2.0       # the generator's record travels with it
