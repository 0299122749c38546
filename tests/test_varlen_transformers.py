"""transformers' packed-sequence path through attn_implementation="fa3": position_ids that restart,
or FlashAttention kwargs (cu_seq_lens_q/k, max_length_q/k), run flex_varlen; a packed batch equals
each sequence run on its own (transformers' eager attention, same weights). Tiny random Llama (no download), CPU interpreter."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fa3_inductor.integrations import transformers as fa3_hf  # noqa: E402

LENGTHS = (7, 1, 12)


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM, LlamaConfig
    from triton import knobs

    if not knobs.runtime.interpret:
        pytest.skip("runs the varlen kernel on CPU tensors: needs TRITON_INTERPRET=1")
    fa3_hf.register()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=64)
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="fa3").eval()
    # the per-sequence runs: same weights, transformers' eager attention (fast on the CPU)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    eager.load_state_dict(ours.state_dict())
    return ours, eager


def _packed_inputs():
    seqs = [torch.randint(1, 96, (n,)) for n in LENGTHS]
    ids = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    cu = torch.nn.functional.pad(torch.tensor(LENGTHS).cumsum(0), (1, 0)).int()
    return seqs, ids, positions, cu


@pytest.mark.parametrize("how", ["position_ids", "flash_kwargs"])
def test_packed_batch_equals_each_sequence_alone(models, how, monkeypatch):
    model, eager = models
    seqs, ids, positions, cu = _packed_inputs()
    calls = []
    real = fa3_hf._packed_attention
    monkeypatch.setattr(fa3_hf, "_packed_attention", lambda *a: calls.append(1) or real(*a))
    extra = {} if how == "position_ids" else dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                                  max_length_q=max(LENGTHS), max_length_k=max(LENGTHS))
    with torch.no_grad():
        packed = model(ids, position_ids=positions, **extra).logits[0]
        alone = torch.cat([eager(s[None]).logits[0] for s in seqs])
    assert len(calls) == model.config.num_hidden_layers   # every layer took the varlen path
    torch.testing.assert_close(packed, alone, atol=2e-4, rtol=2e-4)


def test_packed_training_step_has_gradients(models):
    """With gradients, CPU inputs run flex_varlen's dense path (autograd); CUDA ones flex() with a
    document mask over the same packing (fa3_hf._packed_attention)."""
    model = models[0]
    seqs, ids, positions, _ = _packed_inputs()
    model.train()
    try:
        out = model(ids, position_ids=positions, labels=ids)
        out.loss.backward()
    finally:
        model.eval()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    model.zero_grad(set_to_none=True)


def test_packed_sliding_window_layers_keep_their_window():
    """A model with a sliding window shorter than its packed documents (Mistral) keeps the window in
    the packed path: packed equals each sequence alone under eager attention."""
    from transformers import AutoModelForCausalLM, MistralConfig
    from triton import knobs

    if not knobs.runtime.interpret:
        pytest.skip("runs the varlen kernel on CPU tensors: needs TRITON_INTERPRET=1")
    fa3_hf.register()
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=64, sliding_window=4)
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="fa3").eval()
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    eager.load_state_dict(ours.state_dict())
    seqs, ids, positions, _ = _packed_inputs()
    with torch.no_grad():
        packed = ours(ids, position_ids=positions).logits[0]
        alone = torch.cat([eager(s[None]).logits[0] for s in seqs])
    torch.testing.assert_close(packed, alone, atol=2e-4, rtol=2e-4)
