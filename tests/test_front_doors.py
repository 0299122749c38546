"""Every mod and combination, through both front doors, against the float64 reference.

CPU: the generic kernel runs under Triton's interpreter (conftest sets TRITON_INTERPRET=1
when there is no GPU). GPU (marked ``gpu``): bf16/fp16, head dims 64/128/256, ragged lengths.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fa3_inductor
from fa3_inductor import mods
from reference import assert_matches_reference, reference_attention


def _doc_ids(n: int, device) -> torch.Tensor:
    lengths = torch.randint(8, max(9, n // 3), (n,))
    ids = torch.repeat_interleave(torch.arange(n), lengths)[:n]
    return ids.to(device)


def _cases(heads: int, seqlen: int, device):
    """name -> (score_mod, mask_mod); built fresh per test (document ids are random)."""
    doc = mods.document(_doc_ids(seqlen, device))
    table = torch.randn(heads, 2 * seqlen, device=device)

    def learned_relative(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + seqlen]

    return {
        "noop": (None, None),
        "causal": (None, mods.causal),
        "sliding_window": (None, mods.sliding_window(24)),
        "prefix_lm": (None, mods.prefix_lm(20)),
        "document": (None, doc),
        "alibi": (mods.alibi(heads), None),
        "softcap": (mods.softcap(2.0), None),          # small cap: it must bite
        "relative_bias": (mods.relative_bias, None),
        "learned_table": (learned_relative, None),
        "softcap+causal": (mods.softcap(2.0), mods.causal),
        "alibi+sliding": (mods.alibi(heads), mods.sliding_window(32)),
        "and_masks": (None, mods.and_masks(mods.causal, mods.sliding_window(40))),
        "or_masks": (None, mods.or_masks(mods.prefix_lm(16), mods.causal)),
        "chain+document": (mods.chain(mods.alibi(heads), mods.softcap(3.0)), doc),
    }


CASES = list(_cases(2, 8, "cpu").keys())


def _call(door: str, q, k, v, score_mod, mask_mod, gqa: bool, template: str = "auto"):
    if door == "flex":
        return fa3_inductor.flex(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                 enable_gqa=gqa)
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2],
                                       device=q.device)

    def attention(q, k, v):
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                              enable_gqa=gqa)

    torch._dynamo.reset()
    return torch.compile(attention, backend="fa3", fullgraph=True,
                         options={"fa3.template": template})(q, k, v)


def _check(door, case, device, dtype, B, HQ, HKV, M, D, template="auto", expect=None):
    if device == "cpu":
        from triton import knobs

        if not knobs.runtime.interpret:
            pytest.skip("CPU runs of our kernel need TRITON_INTERPRET=1")
    torch.manual_seed(hash((door, case, M, D)) % 2**31)
    score_mod, mask_mod = _cases(HQ, M, device)[case]
    q = torch.randn(B, HQ, M, D, device=device, dtype=dtype)
    k = torch.randn(B, HKV, M, D, device=device, dtype=dtype)
    v = torch.randn(B, HKV, M, D, device=device, dtype=dtype)
    fa3_inductor.clear_lowered_sites()
    with torch.no_grad():
        out = _call(door, q, k, v, score_mod, mask_mod, HQ != HKV, template)
    ran = fa3_inductor.last_template()
    assert ran in ((expect,) if expect else ("generic", "hopper")), (ran, fa3_inductor.lowered_sites())
    ref, _ = reference_attention(q, k, v, score_mod, mask_mod)
    assert_matches_reference(out, ref, dtype, what=f"{door}/{case}")


@pytest.mark.parametrize("door", ["flex", "compile"])
@pytest.mark.parametrize("case", CASES)
def test_cpu_interpreter(door, case):
    _check(door, case, "cpu", torch.float16, B=1, HQ=4, HKV=2, M=96, D=16)


@pytest.mark.parametrize("case", ["softcap+causal", "document"])
def test_cpu_interpreter_fp32(case):
    _check("flex", case, "cpu", torch.float32, B=2, HQ=2, HKV=2, M=80, D=32)


def _gpu_shape(case: str) -> tuple[int, torch.dtype]:
    """Spread head dims 64/128/256 and both 16-bit dtypes over the cases (a full product
    would not fit the GPU suite's time)."""
    i = CASES.index(case)
    return (64, 128, 256)[i % 3], (torch.bfloat16, torch.float16)[(i // 3) % 2]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_gpu_hopper_template(case):
    D, dtype = _gpu_shape(case)
    _check("flex", case, "cuda", dtype, B=2, HQ=4, HKV=2, M=300, D=D, expect="hopper")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_gpu_generic_template(case):
    D, dtype = _gpu_shape(case)
    _check("compile", case, "cuda", dtype, B=2, HQ=4, HKV=2, M=300, D=D, template="generic",
           expect="generic")


@pytest.mark.gpu
@pytest.mark.parametrize("D, template", [(80, "hopper"), (96, "hopper"), (112, "generic"), (192, "hopper")])
def test_gpu_padded_head_dims(D, template):
    # 80 / 96 / 192 run on the Hopper template (sm90) in power-of-two tiles; 112 (64 + 48) does not split
    # into powers of two and goes to the generic template
    if torch.cuda.get_device_capability() != (9, 0):
        template = "generic"
    _check("flex", "softcap+causal", "cuda", torch.bfloat16, B=1, HQ=2, HKV=2, M=257, D=D,
           expect=template)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["softcap+causal", "learned_table", "document"])
def test_gpu_gradients_match_reference(case):
    torch.manual_seed(0)
    device, dtype, B, H, M, D = "cuda", torch.bfloat16, 2, 4, 256, 64
    score_mod, mask_mod = _cases(H, M, device)[case]
    leaves = [torch.randn(B, H, M, D, device=device, dtype=dtype, requires_grad=True)
              for _ in range(3)]
    out = fa3_inductor.flex(*leaves, score_mod=score_mod, mask_mod=mask_mod)
    assert fa3_inductor.last_template() in ("generic", "hopper")
    grad = torch.randn_like(out)
    out.backward(grad)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref, _ = reference_attention(*ref_leaves, score_mod, mask_mod)
    ref.backward(grad.double())
    for t, r, name in zip(leaves, ref_leaves, "qkv"):
        assert_matches_reference(t.grad, r.grad, dtype, what=f"d{name}")


def test_cpu_dynamic_shapes_keep_our_kernel_with_captured_buffers():
    """Symbolic batch/sequence lengths (and a document-id buffer whose length follows them)
    are served by our kernel, not handed back to torch."""
    from triton import knobs

    if not knobs.runtime.interpret:
        pytest.skip("CPU runs of our kernel need TRITON_INTERPRET=1")
    torch._dynamo.reset()
    for M in (96, 160):
        doc_ids = _doc_ids(M, "cpu")
        mask = mods.document(doc_ids)
        q, k, v = (torch.randn(1, 2, M, 16, dtype=torch.float16) for _ in range(3))
        block_mask = create_block_mask(mask, None, None, M, M, device="cpu")

        def attention(q, k, v, block_mask):
            return flex_attention(q, k, v, block_mask=block_mask)

        fa3_inductor.clear_lowered_sites()
        with torch.no_grad():
            out = torch.compile(attention, backend="fa3", dynamic=True)(q, k, v, block_mask)
        assert fa3_inductor.last_template() == "generic", fa3_inductor.lowered_sites()
        ref, _ = reference_attention(q, k, v, None, mask)
        assert_matches_reference(out, ref, torch.float16)


def test_cpu_return_lse_is_natural_log():
    from triton import knobs

    if not knobs.runtime.interpret:
        pytest.skip("CPU runs of our kernel need TRITON_INTERPRET=1")
    q, k, v = (torch.randn(1, 2, 80, 16, dtype=torch.float16) for _ in range(3))
    with torch.no_grad():
        out, lse = fa3_inductor.flex(q, k, v, mask_mod=mods.prefix_lm(8), return_lse=True)
    assert fa3_inductor.last_template() == "generic"
    ref, ref_lse = reference_attention(q, k, v, None, mods.prefix_lm(8))
    assert_matches_reference(out, ref, torch.float16)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-3, rtol=1e-3)


@pytest.mark.gpu
def test_compiled_flex_max_scores_are_computed_when_read():
    """A graph that reads flex_attention's max_scores gets the true row max, also for a bounded
    score_mod (softcap) whose kernel may otherwise skip the max (hopper's fixed exponent base).
    (torch's flex_attention refuses max_scores on the CPU.)"""
    from torch.nn.attention.flex_attention import AuxRequest

    dtype, D = torch.bfloat16, 128
    q, k, v = (torch.randn(1, 2, 200, D, device="cuda", dtype=dtype) for _ in range(3))
    score_mod = mods.softcap(20.0)

    def attention(q, k, v):
        out, aux = flex_attention(q, k, v, score_mod=score_mod,
                                  return_aux=AuxRequest(lse=True, max_scores=True))
        return out, aux.lse, aux.max_scores

    torch._dynamo.reset()
    with torch.no_grad():
        out, lse, mx = torch.compile(attention, backend="fa3", fullgraph=True)(q, k, v)
    s = score_mod(q.double() @ k.double().transpose(-2, -1) * D ** -0.5, None, None, None, None)
    torch.testing.assert_close(mx.double(), s.amax(-1), atol=5e-2, rtol=1e-2)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), atol=5e-2, rtol=1e-2)
    assert_matches_reference(out, torch.softmax(s, -1) @ v.double(), dtype)


def test_the_lowering_asks_for_the_row_max_only_if_the_graph_reads_it():
    import operator

    from fa3_inductor import _compat
    from fa3_inductor.lowering.flex_lowering import _max_scores_read

    def graph(read_max: bool):
        g = torch.fx.Graph()
        x = g.placeholder("x")
        op = g.call_function(torch.ops.aten.sin.default, (x,))  # stands in for flex_attention
        outs = [g.call_function(operator.getitem, (op, i)) for i in range(3)]
        g.output((outs[0], outs[2]) if read_max else (outs[0],))
        return op

    returns_max = _compat.flex_op_returns_max_scores()
    assert _max_scores_read(graph(True)) == returns_max
    assert not _max_scores_read(graph(False))
    assert _max_scores_read(None) == returns_max   # unsure: ask for it


def test_cpu_without_interpreter_runs_torch_and_says_so(monkeypatch, caplog):
    import logging

    from fa3_inductor import _log

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(_log, "_said", set())
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    with caplog.at_level(logging.INFO, logger="fa3_inductor"):
        with torch.no_grad():
            out = fa3_inductor.flex(q, k, v, score_mod=mods.softcap(3.0))
            fa3_inductor.flex(q, k, v, score_mod=mods.softcap(3.0))
    assert fa3_inductor.last_template() == "torch"
    said = [r.message for r in caplog.records if "run torch's own flex_attention" in r.message]
    assert len(said) == 1, said
    ref, _ = reference_attention(q, k, v, mods.softcap(3.0))
    assert_matches_reference(out, ref, torch.float32)
