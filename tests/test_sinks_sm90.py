"""CPU-only (session ``-m sm90_compile``): attention sinks compiled for sm90 in both forward kernels.

The sinks are a constexpr path of the epilogue (FLAGS.HAS_SINKS) with their pointer in a tuple that is
empty without them (no kernel parameter): a site without sinks compiles to the same kernel as before,
and one with sinks differs only after its KV loop. Checked on the SASS (cuobjdump): no spills either
way (the persistent schedule included, where a log-domain combine of the LSE and the sink spilled 31 LDL / STL
at D=128), at most a few more registers, KV loops of the same length and floating-point work, and the epilogue's
sink term (one more exp2 per row) only with sinks.
"""
from __future__ import annotations

import collections
import re

import pytest
import torch
from triton.experimental import gluon

from fa3_inductor.templates.aot import sass_report
from fa3_inductor.templates.generic.host import compile_generic
from fa3_inductor.templates.hopper import compile_sm90, get_config

pytestmark = pytest.mark.sm90_compile


@gluon.jit
def _causal(b, h, q_idx, kv_idx, bufs):
    return q_idx >= kv_idx


def _inputs(D, dtype, B=2, Hq=4, Hkv=2, M=300, N=500):
    q = torch.randn(B, Hq, M, D, dtype=dtype)
    k = torch.randn(B, Hkv, N, D, dtype=dtype)
    v = torch.randn(B, Hkv, N, D, dtype=dtype)
    return q, k, v, torch.empty_like(q), torch.empty(B, Hq, M), torch.empty(B, Hq, M)


def _loops(report) -> list[tuple[int, collections.Counter]]:
    """Each KV loop (an inner loop with exp2): its length and its floating-point, MUFU and wgmma
    opcodes, counted (register names and the integer address arithmetic's choice of opcodes may move
    with an extra kernel parameter)."""
    out = []
    for body in report.inner_loops():
        ops = [re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0] for ins in body]
        if "MUFU.EX2" in ops:
            out.append((len(ops), collections.Counter(
                op for op in ops if op.startswith(("F", "MUFU", "HGMMA", "SHFL")))))
    return out


def _compare(plain, sunk, maxnreg):
    a, b = sass_report(plain), sass_report(sunk)
    for r in (a, b):
        assert r.stack == 0 and r.local == 0 and r.spill_instructions == 0, "spills"
        assert r.registers <= maxnreg
    assert _loops(a) and _loops(a) == _loops(b), "the sinks changed the KV loop"
    assert b.registers <= a.registers + 8, (a.registers, b.registers)
    return a, b


@pytest.mark.parametrize("persistent", [False, True], ids=["one_cta_per_tile", "persistent"])
@pytest.mark.parametrize("D,dtype", [(64, torch.float16), (128, torch.bfloat16)])
def test_hopper_sinks_only_touch_the_epilogue(D, dtype, persistent):
    cfg = get_config(D, dtype)
    q, k, v, o, lse, mx = _inputs(D, dtype)
    kw = dict(sm_scale=D ** -0.5, mask_mod=_causal, config=cfg, persistent=persistent)
    plain = compile_sm90(q, k, v, o, lse, mx, **kw)
    sunk = compile_sm90(q, k, v, o, lse, mx, sinks=torch.zeros(4), **kw)
    a, b = _compare(plain, sunk, cfg.maxnreg)
    assert b.sass.count("MUFU.EX2") > a.sass.count("MUFU.EX2")   # the epilogue's log-domain combine


@pytest.mark.parametrize("D", [64, 128])
def test_generic_sinks_only_touch_the_epilogue(D):
    q, k, v, o, lse, mx = _inputs(D, torch.bfloat16)
    plain = compile_generic(q, k, v, o, lse, mx, sm_scale=D ** -0.5)
    sunk = compile_generic(q, k, v, o, lse, mx, sm_scale=D ** -0.5, sinks=torch.zeros(4))
    _compare(plain, sunk, 255)
