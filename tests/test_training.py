"""Training through every fused attention: forward + backward against float64 autograd.

CPU (conftest sets TRITON_INTERPRET=1): the forward is our generic kernel under the
interpreter, the backward our op ``fa3_inductor::flex_bwd.families``
(lowering/flex_backward_lowering.py, runtime/ops_bwd.py): the generic backward family
(templates/generic_bwd/) under the interpreter, learnable tables' gradients included, with the
dense recompute ``fa3_inductor::flex_bwd`` as its last resort. Front doors: ``fa3_inductor.flex``
called eagerly, the same call inside ``torch.compile(backend="fa3")``, and
``F.scaled_dot_product_attention`` recognized by the fa3 backend. Gradients of q, k, v and of a
learnable bias table are compared with float64 autograd under the tolerance rule (reference.py).
GPU twins are marked ``gpu`` (forward ours, backward one of our backward families, or torch's
flex kernel for a site none serves).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fa3_inductor
from fa3_inductor import mods
from fa3_inductor import lowered_backward_sites
from fa3_inductor.runtime.backward_cpu import BackwardSpec
from reference import assert_matches_reference, reference_attention, reference_gradients

NUM_BUCKETS = 8


def t5_bucket(q_idx, kv_idx):
    """A T5-style relative-position bucket: sign and distance, the distance clamped."""
    dist = torch.clamp((q_idx - kv_idx).abs(), max=NUM_BUCKETS // 2 - 1)
    return dist + (q_idx < kv_idx).to(dist.dtype) * (NUM_BUCKETS // 2)


@dataclasses.dataclass
class Case:
    score_mod: Optional[Callable] = None
    mask_mod: Optional[Callable] = None
    captured: tuple = ()                       # learnable tensors the score_mod reads
    make_ref_score: Optional[Callable] = None  # float64 copies of `captured` -> score_mod


def _doc_ids(n: int, device) -> torch.Tensor:
    lengths = torch.tensor([n // 3, n // 4, n])  # three documents, the last one cut at n
    return torch.repeat_interleave(torch.arange(3), lengths)[:n].to(device)


def _case(name: str, heads: int, m: int, n: int, device) -> Case:
    if name == "learned_table":
        table = torch.randn(heads, NUM_BUCKETS, device=device, requires_grad=True)

        def make(t):
            return lambda score, b, h, q_idx, kv_idx: score + t[h, t5_bucket(q_idx, kv_idx)]

        return Case(make(table), None, (table,), make)
    simple = {
        "noop": Case(),
        "causal": Case(mask_mod=mods.causal),
        "softcap": Case(mods.softcap(2.0)),            # small cap: it must bite
        "alibi": Case(mods.alibi(heads)),
        "sliding_window": Case(mask_mod=mods.sliding_window(24)),
        "document": Case(mask_mod=mods.document(_doc_ids(max(m, n), device))),
        "relative_bias": Case(mods.relative_bias),
        "softcap+causal": Case(mods.softcap(2.0), mods.causal),
        # Row 0 sees no key: a fully masked row (output 0, gradient 0, as torch's flex).
        "empty_rows": Case(mask_mod=lambda b, h, q_idx, kv_idx: q_idx > kv_idx),
    }
    return simple[name]


FLEX_CASES = ["noop", "causal", "softcap", "alibi", "sliding_window", "document",
              "relative_bias", "learned_table", "softcap+causal", "empty_rows"]


pytestmark = pytest.mark.usefixtures("fresh_compiles")


def _inputs(b, hq, hkv, m, n, dtype, device, d=16):
    torch.manual_seed(0)
    q = torch.randn(b, hq, m, d, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, hkv, n, d, device=device, dtype=dtype, requires_grad=True)
            for _ in range(2))
    return q, k, v


def _check(out, q, k, v, case: Case, dtype, ref_scale=None):
    """Backward with a random dO; output and every gradient against float64 autograd."""
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_out, dq, dk, dv, dcap = reference_gradients(
        q, k, v, grad_out, case.score_mod, case.mask_mod, ref_scale, case.captured,
        case.make_ref_score)
    assert_matches_reference(out, ref_out, dtype, "output")
    for name, t, ref in (("dq", q, dq), ("dk", k, dk), ("dv", v, dv)):
        assert t.grad is not None, f"{name} missing"
        assert_matches_reference(t.grad, ref, dtype, name)
    for t, ref in zip(case.captured, dcap):  # as exact as the q/k/v it is computed from
        assert t.grad is not None, "the learnable table got no gradient"
        assert_matches_reference(t.grad, ref, dtype, "d table")


def _flex(q, k, v, case: Case):
    return fa3_inductor.flex(q, k, v, score_mod=case.score_mod, mask_mod=case.mask_mod,
                             enable_gqa=q.shape[1] != k.shape[1])


def _assert_our_backward_ran():
    kernels = [s["kernel"] for s in lowered_backward_sites()]
    assert kernels and kernels[-1] == "fa3_inductor.flex_bwd", kernels


# ---------------------------------------------------------------- CPU: fa3_inductor.flex

@pytest.mark.parametrize("name", FLEX_CASES)
def test_flex_training(name):
    q, k, v = _inputs(2, 4, 4, 80, 80, torch.float32, "cpu")
    case = _case(name, 4, 80, 80, "cpu")
    out = _flex(q, k, v, case)
    assert fa3_inductor.last_template() == "generic"
    _check(out, q, k, v, case, torch.float32)
    _assert_our_backward_ran()


@pytest.mark.parametrize("name, shape", [
    ("causal", dict(hq=4, hkv=2, m=80, n=80)),                 # GQA
    ("learned_table", dict(hq=4, hkv=1, m=80, n=80)),          # GQA + learnable table
    ("document", dict(hq=2, hkv=2, m=100, n=100)),             # ragged: not a block multiple
    ("causal", dict(hq=2, hkv=2, m=48, n=112)),                # cross-attention M < N
    ("learned_table", dict(hq=2, hkv=2, m=112, n=40)),         # cross-attention M > N
])
def test_flex_training_shapes(name, shape):
    q, k, v = _inputs(1, shape["hq"], shape["hkv"], shape["m"], shape["n"], torch.float32,
                      "cpu")
    case = _case(name, shape["hq"], shape["m"], shape["n"], "cpu")
    _check(_flex(q, k, v, case), q, k, v, case, torch.float32)
    _assert_our_backward_ran()


def test_flex_training_float16_with_scale():
    q, k, v = _inputs(1, 2, 2, 80, 80, torch.float16, "cpu")
    case = _case("learned_table", 2, 80, 80, "cpu")
    case.mask_mod = mods.causal
    out = fa3_inductor.flex(q, k, v, score_mod=case.score_mod, mask_mod=case.mask_mod,
                            scale=0.3)
    _check(out, q, k, v, case, torch.float16, ref_scale=0.3)
    assert q.grad.dtype == torch.float16 and case.captured[0].grad.dtype == torch.float32


def test_flex_training_grad_of_lse():
    """return_lse: a loss reading the LSE sends grad_lse into the backward."""
    q, k, v = _inputs(1, 2, 2, 48, 48, torch.float32, "cpu")
    out, lse = fa3_inductor.flex(q, k, v, mask_mod=mods.causal, return_lse=True)
    (out.sum() + (lse * torch.linspace(0, 1, 48)).sum()).backward()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_attention(*leaves, mask_mod=mods.causal)
    (ref_out.sum() + (ref_lse * torch.linspace(0, 1, 48).double()).sum()).backward()
    for t, ref, name in zip((q, k, v), leaves, ("dq", "dk", "dv")):
        assert_matches_reference(t.grad, ref.grad, torch.float32, name)


def test_only_the_table_needs_grad():
    q, k, v = (t.detach() for t in _inputs(1, 2, 2, 48, 48, torch.float32, "cpu"))
    case = _case("learned_table", 2, 48, 48, "cpu")
    out = torch.compile(lambda q, k, v: _flex(q, k, v, case), backend="fa3")(q, k, v)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    *_, (dtable,) = reference_gradients(q, k, v, grad_out, captured=case.captured,
                                        make_score_mod=case.make_ref_score)
    assert_matches_reference(case.captured[0].grad, dtable, torch.float32, "d table")


# ------------------------------------------------- CPU: torch.compile(backend="fa3")

def test_compiled_training_with_dynamic_sequence_length():
    """A second length recompiles with a symbolic sequence length (Dynamo's automatic
    dynamic shapes); forward and backward stay ours."""
    case = _case("learned_table", 2, 0, 0, "cpu")
    compiled = torch.compile(lambda q, k, v: fa3_inductor.flex(
        q, k, v, score_mod=case.score_mod, mask_mod=mods.causal), backend="fa3")
    for seqlen in (48, 80):
        q, k, v = _inputs(2, 2, 2, seqlen, seqlen, torch.float32, "cpu")
        case.captured[0].grad = None
        out = compiled(q, k, v)
        assert fa3_inductor.lowered_sites()[-1]["template"] == "generic"
        _check(out, q, k, v, dataclasses.replace(case, mask_mod=mods.causal), torch.float32)
        _assert_our_backward_ran()
    assert "s" in lowered_backward_sites()[-1]["shape"].split("kv")[0]  # symbolic length


@pytest.mark.parametrize("name", ["causal", "learned_table", "document", "softcap"])
def test_compiled_flex_training(name):
    q, k, v = _inputs(2, 4, 2, 80, 80, torch.float32, "cpu")
    case = _case(name, 4, 80, 80, "cpu")

    def attention(q, k, v):
        return _flex(q, k, v, case) * 2.0

    out = torch.compile(attention, backend="fa3")(q, k, v)
    assert fa3_inductor.lowered_sites()[-1]["template"] == "generic"
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_out, dq, dk, dv, dcap = reference_gradients(
        q, k, v, 2.0 * grad_out, case.score_mod, case.mask_mod, None, case.captured,
        case.make_ref_score)
    assert_matches_reference(out, 2.0 * ref_out, torch.float32)
    for t, ref, what in zip((q, k, v, *case.captured), (dq, dk, dv, *dcap),
                            ("dq", "dk", "dv", "d table")):
        assert_matches_reference(t.grad, ref, torch.float32, what)
    _assert_our_backward_ran()


@pytest.mark.parametrize("causal, hkv, m, n, dtype", [
    (False, 4, 80, 80, torch.float32),
    (True, 2, 80, 80, torch.float32),      # GQA through enable_gqa
    (False, 4, 40, 100, torch.float32),    # cross-attention, ragged
    (True, 4, 80, 80, torch.float16),
])
def test_compiled_sdpa_training(causal, hkv, m, n, dtype):
    q, k, v = _inputs(2, 4, hkv, m, n, dtype, "cpu")

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != 4)

    out = torch.compile(attention, backend="fa3")(q, k, v)
    assert [s["rewritten"] for s in fa3_inductor.recognized_sites()] == [True]
    assert fa3_inductor.lowered_sites()[-1]["template"] == "generic"
    case = Case(mask_mod=mods.causal if causal else None)
    _check(out, q, k, v, case, dtype)
    _assert_our_backward_ran()


# ---------------------------------------------------------------- CPU: the op itself

def test_backward_op_bfloat16_and_block_tables():
    """bf16 (the interpreter's bf16 dot is wrong, so no bf16 forward here) and a block mask
    whose tables drop blocks the mask_mod would keep: the tables win, as in the forward."""
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, 64, 16, dtype=torch.bfloat16) for _ in range(4))
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 64, 64,
                           device="cpu", BLOCK_SIZE=16)
    num = bm.kv_num_blocks.clone()
    num[..., 3] = 0  # q block 3 loses its one partial (diagonal) block
    spec = BackwardSpec(None, "def mask_mod(b, h, q_idx, kv_idx, bufs):\n"
                              "    return q_idx >= kv_idx\n").to_json()
    dq, dk, dv, dbufs = torch.ops.fa3_inductor.flex_bwd(
        q, k, v, dout, None, num, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
        [], [], 0.25, 16, 16, spec)
    assert dbufs == [] and dq.dtype == torch.bfloat16

    def kept(b, h, q_idx, kv_idx):
        in_diag_block_3 = (q_idx // 16 == 3) & (kv_idx // 16 == 3)
        return (q_idx >= kv_idx) & ~in_diag_block_3

    _, rq, rk, rv, _ = reference_gradients(q, k, v, dout, mask_mod=kept, scale=0.25)
    for t, ref, name in ((dq, rq, "dq"), (dk, rk, "dk"), (dv, rv, "dv")):
        assert_matches_reference(t, ref, torch.bfloat16, name)


def test_fully_masked_rows_get_zero_gradient():
    q, k, v = _inputs(1, 1, 1, 48, 48, torch.float32, "cpu")
    out = _flex(q, k, v, Case(mask_mod=lambda b, h, q_idx, kv_idx: q_idx > kv_idx))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and q.grad[0, 0, 0].abs().max() == 0


# ---------------------------------------------------------------- gating and errors

def test_stock_inductor_backward_lowering_is_untouched(monkeypatch):
    """Outside the fa3 backend our wrapper hands every call to torch's lowering."""
    from fa3_inductor.lowering import flex_backward_lowering as fbl

    fbl.install()
    seen, recorded = [], len(lowered_backward_sites())
    monkeypatch.setattr(fbl, "_original_lowering", lambda *a, **kw: seen.append(a) or "torch")
    assert fbl._fa3_flex_backward_lowering(1, 2, 3) == "torch" and seen == [(1, 2, 3)]
    assert len(lowered_backward_sites()) == recorded


def test_cpu_backward_without_interpreter_says_what_to_do(monkeypatch):
    from fa3_inductor import api

    monkeypatch.setattr(api, "_triton_interpreting", lambda: False)
    q, k, v = _inputs(1, 2, 2, 32, 32, torch.float32, "cpu")
    with pytest.raises(NotImplementedError, match="TRITON_INTERPRET=1"):
        fa3_inductor.flex(q, k, v)
    with torch.no_grad():  # inference keeps torch's own CPU path
        assert fa3_inductor.flex(q, k, v).shape == q.shape


def test_bad_block_mask_still_rejected_on_the_training_path():
    q, k, v = _inputs(1, 2, 2, 48, 48, torch.float32, "cpu")
    bm = create_block_mask(mods.causal, None, None, 96, 96, device="cpu")
    with pytest.raises(ValueError, match="block_mask was built for q_len=96"):
        fa3_inductor.flex(q, k, v, block_mask=bm)


def test_fx_cache_served_backward_in_a_fresh_process(tmp_path):
    """The backward's mods travel as source in the op's spec: a second process served from
    Inductor's FX/AOT caches (no lowering runs) computes the same gradients."""
    script = textwrap.dedent("""
        import hashlib, os, sys, torch
        os.environ["TRITON_INTERPRET"] = "1"
        import fa3_inductor
        from fa3_inductor import lowered_backward_sites
        def fingerprint(*ts):  # which bytes a mismatch starts from, if one ever shows again
            return hashlib.sha1(b"".join(t.detach().contiguous().numpy().tobytes()
                                         for t in ts)).hexdigest()[:16]
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 2, 48, 16, requires_grad=True) for _ in range(3))
        table = torch.randn(2, 8, requires_grad=True)
        print("INPUTS", fingerprint(q, k, v, table), fa3_inductor.__file__)
        def score_mod(s, b, h, q_idx, kv_idx):
            return s + table[h, torch.clamp((q_idx - kv_idx).abs(), max=7)]
        out = torch.compile(lambda q, k, v: fa3_inductor.flex(
            q, k, v, score_mod=score_mod, mask_mod=fa3_inductor.mods.causal),
            backend="fa3")(q, k, v)
        print("AFTER_FORWARD", fingerprint(q, k, v, table), "OUT", fingerprint(out))
        out.sum().backward()
        print("AFTER_BACKWARD", fingerprint(q, k, v, table), "GRADS",
              fingerprint(q.grad, k.grad, v.grad, table.grad), "THREADS", torch.get_num_threads())
        from fa3_inductor.lowering.passes import source_hash
        print("LOWERED", len(lowered_backward_sites()), "SOURCES", source_hash())
        torch.save([q.grad, k.grad, v.grad, table.grad], sys.argv[1])
    """)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               TORCHINDUCTOR_FX_GRAPH_CACHE="1", TORCHINDUCTOR_AUTOGRAD_CACHE="1",
               TRITON_INTERPRET="1")
    runs = []
    for i in range(2):
        # cwd: the checkout this test file belongs to, so both processes import the same package
        result = subprocess.run([sys.executable, "-c", script, str(tmp_path / f"g{i}.pt")],
                                env=env, capture_output=True, text=True, timeout=300,
                                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert result.returncode == 0, result.stderr[-3000:]
        runs.append(result.stdout)
    if runs[0].split("SOURCES")[1] != runs[1].split("SOURCES")[1]:
        pytest.skip("the package's sources changed between the two runs (the cache key covers "
                    "them): rerun on a quiet tree")
    assert "LOWERED 1" in runs[0]
    assert "LOWERED 0" in runs[1], "the second process was not served from the cache"
    inputs = [r.split("INPUTS", 1)[1].split("\n", 1)[0] for r in runs]
    assert inputs[0] == inputs[1], f"the processes started from different inputs or packages: {inputs}"
    first, second = (torch.load(tmp_path / f"g{i}.pt") for i in range(2))
    for name, a, b in zip(("q.grad", "k.grad", "v.grad", "table.grad"), first, second):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: (
            f"{name}: {m}\nfirst process:\n{runs[0]}\ncache-served process:\n{runs[1]}"))


# ---------------------------------------------------------------- GPU twins

GPU_CASES = ["noop", "causal", "softcap", "alibi", "sliding_window", "document",
             "relative_bias", "learned_table"]


@pytest.mark.gpu
@pytest.mark.parametrize("door", ["flex", "compile_flex_attention", "compile_sdpa"])
@pytest.mark.parametrize("name, dtype", [(n, torch.bfloat16) for n in GPU_CASES] + [
    ("causal", torch.float16), ("learned_table", torch.float16)])
def test_gpu_training(door, name, dtype):
    """Forward by our kernel (Hopper template for bf16/fp16 D=64), backward by one of our backward
    families (generic_bwd, hopper_bwd) or, for a site none serves, torch's flex backward kernel
    reading our out/LSE; GQA, ragged length."""
    if door == "compile_sdpa" and name not in ("noop", "causal"):
        pytest.skip("SDPA spells only noop and causal")
    q, k, v = _inputs(2, 4, 2, 200, 200, dtype, "cuda", d=64)  # GQA, ragged (128 + 72)
    case = _case(name, 4, 200, 200, "cuda")
    if door == "flex":
        out = _flex(q, k, v, case)
    elif door == "compile_flex_attention":
        block_mask = None if case.mask_mod is None else create_block_mask(
            case.mask_mod, None, None, 200, 200, device="cuda")
        out = torch.compile(lambda q, k, v: flex_attention(
            q, k, v, score_mod=case.score_mod, block_mask=block_mask, enable_gqa=True),
            backend="fa3")(q, k, v)
    else:
        out = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=name == "causal", enable_gqa=True), backend="fa3")(q, k, v)
    _check(out, q, k, v, case, dtype)
    if door == "compile_sdpa":   # plain SDPA in training stays SDPA on CUDA (recognize_sdpa.py)
        site = fa3_inductor.recognized_sites()[-1]
        assert not site["rewritten"] and "left to SDPA" in site["reason"], site
        return
    from fa3_inductor.templates.registry import BACKWARD_FOLDERS, TORCH_BACKWARD

    sites = lowered_backward_sites()
    assert sites, "no backward site was lowered"
    site = sites[-1]
    ours = site["family"] in BACKWARD_FOLDERS
    assert ours or site["family"] == TORCH_BACKWARD, site
    assert site["kernel"] == ("fa3_inductor.flex_bwd" if ours else "torch"), site
    if ours:   # the op ran one of ours or, refused at run time, the dense recompute
        from fa3_inductor.runtime.ops_bwd import last_backward_family

        assert last_backward_family() in (*BACKWARD_FOLDERS, "dense"), last_backward_family()


# Mods torch's flex backward lowering cannot take (torch 2.11, found by benchmarks/mod_fuzz.py --grad on an H200):
# a score_mod that replaces the score (no score gradient: "joint_subgraph_buffer is None"), an integer power in
# the score_mod ("Buffers cannot be created while lowering a pointwise subgraph"). At head dims our Hopper backward
# does not take (16, 40), torch's kernel would be the last resort; ours serve them instead of a compiler traceback.
TORCH_LOWERING_FAILS = {
    "replaced-score": lambda s, b, h, q_idx, kv_idx: torch.tanh((q_idx - kv_idx) * 0.05),
    "int-pow": lambda s, b, h, q_idx, kv_idx: s + torch.clamp_min(torch.abs(2 ** (q_idx % 3) % 5), -1.5),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(TORCH_LOWERING_FAILS))
@pytest.mark.parametrize("d", [16, 40])
def test_gpu_mods_torch_cannot_lower_run_ours(name, d):
    score_mod = TORCH_LOWERING_FAILS[name]
    g = torch.Generator(device="cuda").manual_seed(d)
    q, k, v = (torch.randn(1, 4, n, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
               for n in (200, 137, 137))
    out = fa3_inductor.flex(q, k, v, score_mod=score_mod)
    dout = torch.randn(out.shape, device="cuda", generator=g, dtype=torch.bfloat16)
    out.backward(dout)
    site = lowered_backward_sites()[-1]
    assert site["family"] == "generic_bwd", site
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference_attention(*leaves, score_mod=score_mod)
    ref.backward(dout.double())
    assert_matches_reference(out, ref, torch.bfloat16, "output")
    for label, t, want in zip(("dq", "dk", "dv"), (q, k, v), leaves):
        if name == "replaced-score" and label != "dv":
            assert torch.equal(t.grad, torch.zeros_like(t.grad)), label
        else:
            assert_matches_reference(t.grad, want.grad, torch.bfloat16, label)
