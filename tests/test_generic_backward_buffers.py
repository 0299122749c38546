"""Gradients of a score_mod's captured tensors in the generic Triton backward
(templates/generic_bwd/buffer_grad.py, kernel.py "Buffer gradients"), under Triton's interpreter
on CPU tensors, against float64 autograd; and one compile-only sm90 build (``-m sm90_compile``).

Each case is a factory ``make(*tables) -> score_mod`` over learnable tensors: the kernel gets the
mod traced over float32 (or bfloat16) tables, the reference the same mod over float64 copies.
Buffer gradients, dq, dk and dv follow the README's tolerance rule for the input dtype.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from fa3_inductor import mods
from reference import assert_matches_reference, reference_attention, reference_gradients

LN2 = math.log(2.0)


def _joint_graph(gm, bufs):
    """The joint graph torch's flex backward receives for a traced score_mod (eager form)."""
    from torch._higher_order_ops.flex_attention import create_fw_bw_graph

    index_values = (torch.zeros((), requires_grad=True),
                    *(torch.zeros((), dtype=torch.int32) for _ in range(4)))
    return create_fw_bw_graph(gm, index_values, tuple(bufs))[1]


def _backward_options(score_mod, joint=None):
    """prepare_generic_backward's score keywords for a score_mod over learnable tables, and the
    buffer-gradient sources: (options, traced buffers, sources)."""
    from fa3_inductor.templates.generic_bwd import SCORE_GRAD_ONE, score_grad_source
    from fa3_inductor.templates.generic_bwd.buffer_grad import buffer_grad_sources
    from fa3_inductor.templates.modgen import BufferSpec, generate_mod_source, load_mod, trace_mod

    gm, bufs = trace_mod(score_mod, "score")
    specs = [BufferSpec.of(b) for b in bufs]
    joint = _joint_graph(gm, bufs) if joint is None else joint
    grad_src = score_grad_source(joint, specs)
    options = dict(score_mod=load_mod(generate_mod_source(gm, "score", specs)),
                   score_bufs=tuple(b.detach() for b in bufs),
                   score_grad_mod=SCORE_GRAD_ONE if grad_src is None else load_mod(grad_src))
    return options, bufs, buffer_grad_sources(joint, specs)


def _mask_options(mask_mod, M, N):
    from fa3_inductor.templates.modgen import generate_mod_source, load_mod, trace_mod

    if mask_mod is None:
        return {}
    bm = create_block_mask(mask_mod, None, None, M, N, device="cpu", BLOCK_SIZE=64)
    return dict(mask_mod=load_mod(generate_mod_source(trace_mod(mask_mod, "mask")[0], "mask", [])),
                kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices,
                full_kv_num_blocks=bm.full_kv_num_blocks, full_kv_indices=bm.full_kv_indices,
                q_num_blocks=bm.q_num_blocks, q_indices=bm.q_indices,
                full_q_num_blocks=bm.full_q_num_blocks, full_q_indices=bm.full_q_indices,
                sparse_q_block=64, sparse_kv_block=64)


def _inputs(Z, HQ, HKV, M, N, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return rand(Z, HQ, M, D), rand(Z, HKV, N, D), rand(Z, HKV, N, D), rand(Z, HQ, M, D)


def _run(make, tables, Z, HQ, HKV, M, N, D, dtype, mask_mod=None, deterministic=False,
         joint=None, seed=0):
    """(our gradients, float64 reference gradients), each [dq, dk, dv, d table...] in ``tables``'
    order."""
    from fa3_inductor.templates.generic_bwd import generic_backward

    q, k, v, dout = _inputs(Z, HQ, HKV, M, N, D, dtype, seed)
    scale = D ** -0.5
    score_mod = make(*tables)
    out, dq, dk, dv, dtables = reference_gradients(q, k, v, dout, None, mask_mod, scale,
                                                   captured=tables, make_score_mod=make)
    _, lse = reference_attention(q, k, v, score_mod, mask_mod, scale)
    options, bufs, sources = _backward_options(score_mod, joint)
    # a table read twice is traced as two buffers (the lowering's graph has it once): one gradient each, summed
    position = [next(j for j, t in enumerate(tables) if t is b) for b in bufs]
    grads = [(s, torch.empty_like(tables[position[s.buffer]])) for s in sources]
    assert sorted({position[s.buffer] for s in sources}) == list(range(len(tables))), "every table needs a gradient"
    lse2 = (lse / LN2).float().detach()
    got = generic_backward(q, k, v, out.to(dtype), dout, lse2, sm_scale=scale, buffer_grads=grads,
                           deterministic=deterministic, **options,
                           **_mask_options(mask_mod, M, N))
    summed = [sum(g.double() for s, g in grads if position[s.buffer] == i).to(tables[i].dtype)
              for i in range(len(tables))]
    return [*got, *summed], [dq, dk, dv, *dtables]


def _check(got, want, dtype):
    names = ["dq", "dk", "dv"] + [f"d table {i}" for i in range(len(got) - 3)]
    for name, g, w in zip(names, got, want):
        assert torch.isfinite(g).all(), name
        assert_matches_reference(g, w, dtype, name)


def _relative(N):                   # 1-D table indexed by the q - kv offset (score class)
    return lambda t: lambda s, b, h, q, kv: s + t[q - kv + N - 1]


def _relative_per_head(N):          # [H, M + N - 1]
    return lambda t: lambda s, b, h, q, kv: s + t[h, q - kv + N - 1]


def _alibi(t):                      # learnable slopes (program class)
    return lambda s, b, h, q, kv: s + t[h] * (kv - q)


def _alibi_exp2(t):                 # slopes as exp2 of a learnable tensor
    return lambda s, b, h, q, kv: s + torch.exp2(t[h]) * (kv - q)


def _table_2d(t):                   # [M, N]
    return lambda s, b, h, q, kv: s + t[q, kv]


def _softcap_head_bias(t):          # a per-head bias under a tanh softcap (the value reads the
    return lambda s, b, h, q, kv: 5.0 * torch.tanh((s + t[h]) / 5.0)   # score); added after the
                                    # softcap its gradient would be 0 (softmax ignores it)


def _every_class(N):                # program, row, column and score classes at once; the row
    return lambda temp, qs, kb, rel: (   # and program ones scale the score (a bias added per row
        lambda s, b, h, q, kv: s * (temp[h] + qs[q]) + kb[kv] + rel[q - kv + N - 1])   # gets 0)


def _head_scale(t):                 # the table scales the score: its gradient's value (dS · score) is cast to the
    return lambda s, b, h, q, kv: s * torch.exp2(t[h] * 0.5)   # table's bf16 in the joint graph (score_grad.py)


def _temperature(t):                # a learnable 0-d temperature, read as it is: its gradient in the joint
    return lambda s, b, h, q, kv: s * (1.0 + t)   # graph is dS · score, not a scatter (summed into its element)


def _temperature_softcap(t, u):     # two 0-d tensors: a learnable scale under a learnable softcap
    return lambda s, b, h, q, kv: (2.0 + u) * torch.tanh(s * (3.0 + t) / (2.0 + u))   # saturating: d/du is
                                    # not small next to the dS it sums (an unsaturated cap's is ~z^3)


def _param(*shape, dtype=torch.float32, scale=0.5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).requires_grad_()


# (id, make, table shapes, Z, HQ, HKV, M, N, D, dtype, mask_mod): ragged M != N, D 16 / 32,
# GQA 2 -> 1, batch 2, fp32 and bf16.
CASES = [
    ("relative-fp32", _relative(100), [(80 + 100 - 1,)], 1, 2, 2, 80, 100, 16, torch.float32, None),
    ("relative-per-head-gqa-causal", _relative_per_head(64), [(2, 127)], 2, 2, 1, 64, 64, 32,
     torch.float32, mods.causal),
    ("alibi-slopes-fp32", _alibi, [(2,)], 2, 2, 2, 72, 100, 16, torch.float32, None),
    ("alibi-exp2-bf16-causal", _alibi_exp2, [(2,)], 1, 2, 2, 64, 64, 32, torch.bfloat16,
     mods.causal),
    ("table-2d-fp32", _table_2d, [(70, 90)], 1, 2, 2, 70, 90, 16, torch.float32, None),
    ("softcap-head-bias-fp32", _softcap_head_bias, [(2,)], 1, 2, 2, 64, 80, 32, torch.float32,
     None),
    ("relative-bf16-table-bf16", _relative(64), [(64 + 64 - 1,)], 1, 2, 2, 64, 64, 16,
     torch.bfloat16, None),
    ("head-scale-bf16-table-bf16", _head_scale, [(2,)], 1, 2, 2, 64, 64, 16, torch.bfloat16, None),
    ("temperature-0d-fp32-causal", _temperature, [()], 2, 2, 1, 72, 100, 16, torch.float32, mods.causal),
    ("temperature-softcap-0d-bf16", _temperature_softcap, [(), ()], 1, 2, 2, 64, 80, 32, torch.bfloat16, None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_buffer_gradients_match_float64(cpu_kernels, case):
    _, make, shapes, Z, HQ, HKV, M, N, D, dtype, mask_mod = case
    table_dtype = dtype if "table-bf16" in case[0] else torch.float32
    tables = tuple(_param(*shape, dtype=table_dtype, seed=i + 1) for i, shape in enumerate(shapes))
    got, want = _run(make, tables, Z, HQ, HKV, M, N, D, dtype, mask_mod)
    _check(got, want, dtype)


def test_every_reduction_class_deterministic(cpu_kernels):
    """One value per program (a per-head temperature, whose gradient reads the score), per query
    row, per key column and per score, in one site; the deterministic mode gives the same
    gradients bit for bit on a second run, and agrees with the atomic mode and float64."""
    M, N = 72, 100
    tables = (_param(2, seed=1), _param(M, seed=2), _param(N, seed=3), _param(M + N - 1, seed=4))
    make = _every_class(N)
    first, want = _run(make, tables, 2, 2, 2, M, N, 16, torch.float32, mods.causal,
                       deterministic=True)
    second, _ = _run(make, tables, 2, 2, 2, M, N, 16, torch.float32, mods.causal,
                     deterministic=True)
    atomic, _ = _run(make, tables, 2, 2, 2, M, N, 16, torch.float32, mods.causal)
    _check(first, want, torch.float32)
    for a, b, c in zip(first, second, atomic):
        assert torch.equal(a, b)
        assert_matches_reference(c, a.double(), torch.float32)


def test_sources_name_what_the_offset_reads():
    """The reduction class each offset allows, and the factor a value mod carries."""
    N = 64
    tables = (_param(2), _param(N), _param(N), _param(2 * N - 1))
    _, bufs, sources = _backward_options(_every_class(N)(*tables))
    assert [(s.along_q, s.along_kv) for s in sources] == [
        (False, False), (True, False), (False, True), (True, True)]
    assert "def index_mod(b, h, q_idx, kv_idx, bufs)" in sources[3].offset
    assert [s.value is None for s in sources] == [False, False, True, True]   # dS · score, dS
    _, _, (exp2_source,) = _backward_options(_alibi_exp2(_param(2)))
    assert exp2_source.value.info.out_scale == pytest.approx(LN2)   # d exp2(x) = ln2 · exp2(x)


def test_joint_graph_from_the_lowering(cpu_kernels, fresh_compiles, monkeypatch):
    """The joint graph Inductor hands our backward lowering (zeros_and_scatter form) gives the
    same gradients as the eager one."""
    import fa3_inductor
    from fa3_inductor.lowering import flex_backward_lowering

    joints = []
    plan = flex_backward_lowering._plan

    def spy(a, bm, settings, shape):
        joints.append(a.joint_graph.graph_module)
        return plan(a, bm, settings, shape)

    monkeypatch.setattr(flex_backward_lowering, "_plan", spy)
    N = 64
    tables = (_param(2), _param(2 * N - 1))
    make = lambda slopes, rel: lambda s, b, h, q, kv: (   # noqa: E731
        5.0 * torch.tanh(s / 5.0) + torch.exp2(slopes[h]) * (kv - q) + rel[q - kv + N - 1])
    q, k, v = (torch.randn(1, 2, N, 16, requires_grad=True) for _ in range(3))
    compiled = torch.compile(lambda q, k, v: fa3_inductor.flex(q, k, v, score_mod=make(*tables)),
                             backend="fa3")
    compiled(q, k, v).sum().backward()
    assert len(joints) == 1
    assert "zeros_and_scatter" in joints[0].code
    got, want = _run(make, tables, 1, 2, 2, N, N, 16, torch.float32, joint=joints[0])
    _check(got, want, torch.float32)


def test_bad_gradient_tensor_is_refused():
    from fa3_inductor.templates.generic_bwd import prepare_generic_backward

    options, bufs, sources = _backward_options(_alibi(_param(2)))
    q, k, v, dout = _inputs(1, 2, 2, 64, 64, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="shape"):
        prepare_generic_backward(q, k, v, dout, dout, torch.zeros(1, 2, 64), torch.empty_like(q),
                                 torch.empty_like(k), torch.empty_like(v), sm_scale=0.25,
                                 buffer_grads=[(sources[0], torch.empty(3))], **options)


@pytest.mark.sm90_compile
def test_sm90_compile_buffer_grads_no_spills():
    """The dQ kernel with buffer gradients compiles for sm90 with wgmma and no spills (bf16,
    D 64 / 128): learnable ALiBi slopes (one value per program) and a per-head relative bias
    table (one value per score), atomic and deterministic; registers reported."""
    from fa3_inductor.templates.aot import sass_report
    from fa3_inductor.templates.generic_bwd import compile_generic_backward

    M = N = 1024
    reports = []
    for name, make, shape in (("alibi", _alibi, (4,)),
                              ("relative", _relative_per_head(N), (4, M + N - 1))):
        options, _, sources = _backward_options(make(_param(*shape)))
        grads = [(s, torch.empty(s.shape)) for s in sources]
        for D, deterministic in ((64, False), (128, False), (128, True)):
            q = torch.randn(2, 4, M, D, dtype=torch.bfloat16)
            k = v = torch.randn(2, 2, N, D, dtype=torch.bfloat16)
            kernels = compile_generic_backward(q, k, v, torch.empty_like(q), torch.empty_like(q),
                                               torch.empty(2, 4, M), sm_scale=D ** -0.5,
                                               buffer_grads=grads, deterministic=deterministic,
                                               **options)
            assert len(kernels) == 4   # delta, dK/dV, dQ, the gradient's last step
            r = sass_report(kernels[2])
            reports.append(f"{name} D{D} deterministic={deterministic} dq: {r.registers} "
                           f"registers, {r.hgmma} HGMMA, {r.spill_instructions} spills")
            assert r.stack == 0 and r.local == 0 and r.spill_instructions == 0, reports[-1]
            assert r.hgmma > 0, f"{reports[-1]}: no wgmma"
    print("\n".join(reports))


def test_chained_indexing_through_the_front_door(cpu_kernels, fresh_compiles):
    """``table[h][q_idx - kv_idx + N]`` (chained indexing, as model code writes it): the joint graph scatters the
    row's gradient into a scatter of the table's; read as one scatter at [h, offset], the generic backward serves
    it (not the dense recompute) and the table's gradient matches float64."""
    import fa3_inductor

    g = torch.Generator().manual_seed(5)
    M, N = 37, 45
    q, k, v = (torch.randn(1, 2, n, 16, generator=g).requires_grad_() for n in (M, N, N))
    table = (torch.randn(2, M + N, generator=g) * 0.5).requires_grad_()
    out = fa3_inductor.flex(q, k, v, score_mod=lambda s, b, h, qi, ki: s + table[h][qi - ki + N])
    dout = torch.randn(out.shape, generator=g)
    out.backward(dout)
    assert fa3_inductor.lowered_backward_sites()[-1]["family"] == "generic_bwd"
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, table)]
    ref, _ = reference_attention(*leaves[:3], score_mod=lambda s, b, h, qi, ki: s + leaves[3][h, qi - ki + N])
    ref.backward(dout.double())
    for name, got, want in zip(("dq", "dk", "dv", "dtable"), (q.grad, k.grad, v.grad, table.grad), leaves):
        assert_matches_reference(got, want.grad, torch.float32, name)
