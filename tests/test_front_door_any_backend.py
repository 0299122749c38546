"""fa3_inductor.flex() inside a model compiled by stock Inductor (``backend="inductor"``, as
transformers' generate() compiles its decode step) still runs our kernels, forward and backward:
the op it traces carries our key in its kernel_options (lowering/common.py), and torch's own
flex_attention in the same graph keeps torch's lowering."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

import fa3_inductor
from fa3_inductor import mods
from reference import assert_matches_reference, reference_attention

pytestmark = pytest.mark.usefixtures("cpu_kernels", "fresh_compiles")


def _inputs(requires_grad: bool):
    return [torch.randn(1, 2, 64, 16, requires_grad=requires_grad) for _ in range(3)]


def test_flex_under_stock_inductor_runs_our_forward_and_backward():
    q, k, v = _inputs(True)
    softcap = mods.softcap(8.0)

    def attention(q, k, v):
        return fa3_inductor.flex(q, k, v, score_mod=softcap, mask_mod=mods.causal) * 2.0

    out = torch.compile(attention, backend="inductor", fullgraph=True)(q, k, v)
    forward = fa3_inductor.lowered_sites()
    assert [s["template"] for s in forward] == ["generic"], forward
    ref, _ = reference_attention(q, k, v, softcap, mods.causal)
    assert_matches_reference(out, 2.0 * ref, torch.float32)
    grad = torch.randn_like(out)
    out.backward(grad)
    backward = fa3_inductor.lowered_backward_sites()
    assert [s["family"] for s in backward] == ["generic_bwd"], backward
    ref_grads = torch.autograd.grad(2.0 * ref, (q, k, v), grad.double())
    for name, got, want in zip("qkv", (q.grad, k.grad, v.grad), ref_grads):
        assert_matches_reference(got, want, torch.float32, f"d{name}")


def test_torch_flex_attention_beside_it_keeps_torch_lowering():
    q, k, v = _inputs(False)

    def both(q, k, v):
        ours = fa3_inductor.flex(q, k, v, mask_mod=mods.causal)
        theirs = flex_attention(q, k, v)   # no key of ours: torch's lowering serves it
        return ours, theirs

    ours, theirs = torch.compile(both, backend="inductor", fullgraph=True)(q, k, v)
    assert len(fa3_inductor.lowered_sites()) == 1
    assert_matches_reference(ours, reference_attention(q, k, v, None, mods.causal)[0], torch.float32)
    assert_matches_reference(theirs, reference_attention(q, k, v)[0], torch.float32)


def test_mask_mod_reading_the_batch_inside_a_compiled_model():
    """flex(mask_mod=) traced by an enclosing compile builds its block mask in the graph; a mask
    that reads b (a per-sequence document layout) gets a per-batch mask."""
    q, k, v = (torch.randn(2, 2, 64, 16) for _ in range(3))
    docs = torch.stack([torch.arange(64) // 24, torch.arange(64) // 40])

    def attention(q, k, v, docs):
        def same_doc(b, h, q_idx, kv_idx):
            return docs[b, q_idx] == docs[b, kv_idx]
        return fa3_inductor.flex(q, k, v, mask_mod=same_doc)

    out = torch.compile(attention, backend="inductor", fullgraph=True)(q, k, v, docs)
    ref, _ = reference_attention(q, k, v, None, lambda b, h, i, j: docs[b, i] == docs[b, j])
    assert_matches_reference(out, ref, torch.float32)


def test_which_mask_parameters_a_compiled_mask_reads():
    from fa3_inductor.block_masks import _code_reads_batch_or_head

    def by_head(b, h, q_idx, kv_idx):
        return (h > 0) & (q_idx >= kv_idx)

    def nested(b, h, q_idx, kv_idx):
        return (lambda: b == 0)() & (q_idx >= kv_idx)

    assert _code_reads_batch_or_head(mods.causal.__code__) == (False, False)
    assert _code_reads_batch_or_head(by_head.__code__) == (False, True)
    assert _code_reads_batch_or_head(nested.__code__) == (True, False)
