"""transformers models from tiny configs (random weights, no download), forward and backward.

(a) ``attn_implementation="fa3"`` (our integration) against ``attn_implementation="eager"``.
(b) ``attn_implementation="eager"`` compiled with ``backend="fa3"``: recognition must fuse every
    attention layer (the hand-written matmul -> softmax -> matmul of transformers' eager
    attention), and outputs and gradients must match eager.

CPU: our generic kernel runs under Triton's interpreter (conftest sets TRITON_INTERPRET=1), so
shapes stay tiny (2 layers, seq <= 40) and everything is float32. Gemma2's softcap (0.02) is
small enough to change the outputs, and Mistral/Gemma2 get a sliding window (12) shorter than
the sequence, so a site that dropped either would fail.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fa3_inductor  # noqa: E402
from fa3_inductor.integrations import transformers as fa3_hf  # noqa: E402
from fa3_inductor.report import site_records  # noqa: E402

MODELS = ("llama", "mistral", "qwen2", "gemma2", "phi3", "deepseek")
LAYERS = 2
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
OUT_TOL = 1e-4    # relative (Frobenius) error of logits against eager, float32
GRAD_TOL = 1e-3   # relative error of each parameter's gradient against eager


def tiny_config(name: str):
    """A tiny config of the model family ``name`` (head_dim 16, 4 heads, 2 KV heads; DeepSeek: q/k 24, v 16)."""
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

    if name == "llama":
        return LlamaConfig(**TINY, head_dim=16)
    if name == "mistral":
        return MistralConfig(**TINY, head_dim=16, sliding_window=12)
    if name == "qwen2":
        return Qwen2Config(**TINY)
    if name == "gemma2":
        # Random init gives attention logits of ~0.03: a cap of 0.02 makes tanh bite.
        return Gemma2Config(**TINY, head_dim=16, attn_logit_softcapping=0.02,
                            final_logit_softcapping=None, sliding_window=12,
                            query_pre_attn_scalar=16)
    if name == "phi3":
        return Phi3Config(**TINY, pad_token_id=0)
    if name == "deepseek":   # latent attention: q/k head dim 24 (16 + 8 rope columns), v 16; dense MLPs
        from transformers import DeepseekV3Config
        return DeepseekV3Config(**dict(TINY, num_key_value_heads=4), q_lora_rank=None, kv_lora_rank=32,
                                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                first_k_dense_replace=LAYERS)
    raise KeyError(name)


pytestmark = pytest.mark.usefixtures("our_kernels", "fresh_compiles")


def _models(name: str, implementation: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config(name)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    other = AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                             attn_implementation=implementation)
    other.load_state_dict(eager.state_dict())
    return eager.eval(), other.eval()


def _loss(model, ids, mask, weights):
    """Logits, and a loss that weighs every kept logit differently (so gradients see all)."""
    logits = model(ids, attention_mask=mask).logits
    keep = mask.bool()[..., None] if mask is not None else torch.ones_like(logits, dtype=bool)
    return logits, (logits * weights * keep).sum()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check_matches(name, eager, other, ids, mask):
    torch.manual_seed(1)
    weights = torch.randn(*ids.shape, eager.config.vocab_size)
    ref, ref_loss = _loss(eager, ids, mask, weights)
    out, loss = _loss(other, ids, mask, weights)
    keep = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    err = _rel(out.detach()[keep], ref.detach()[keep])
    assert err <= OUT_TOL, f"{name}: logits relative error {err:.2e} against eager"
    ref_loss.backward()
    loss.backward()
    ours = dict(getattr(other, "_orig_mod", other).named_parameters())
    for pname, p in eager.named_parameters():
        if p.grad is None:
            continue
        g = ours[pname].grad
        assert g is not None, f"{name}: no gradient reached {pname}"
        gerr = _rel(g, p.grad)
        assert gerr <= GRAD_TOL, f"{name}: gradient of {pname}: relative error {gerr:.2e}"


@pytest.mark.parametrize("name", MODELS)
def test_fa3_implementation_matches_eager_forward_and_backward(name):
    fa3_hf.register()
    eager, ours = _models(name, "fa3")
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding in the second sequence
    _check_matches(name, eager, ours, ids, mask)
    assert fa3_inductor.last_template() in ("generic", "hopper")


@pytest.mark.parametrize("name", MODELS)
def test_eager_attention_compiled_with_fa3_fuses_every_layer(name):
    eager, twin = _models(name, "eager")
    compiled = torch.compile(twin, backend="fa3")
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    recognized_before, lowered_before = (len(x) for x in site_records())
    _check_matches(name, eager, compiled, ids, None)
    recognized, lowered = (x[n:] for x, n in zip(site_records(),
                                                 (recognized_before, lowered_before)))
    fused = [s for s in recognized if s.rewritten and s.front_door == "matmul-softmax"]
    left = [f"{s.node}: {s.reason}" for s in recognized if not s.rewritten]
    assert len(fused) == LAYERS, (f"{name}: {len(fused)} of {LAYERS} attention layers fused; "
                                  f"left alone: {left}")
    templates = [s.template for s in lowered if s.site_id in {f.site_id for f in fused}]
    assert templates == ["generic"] * LAYERS or templates == ["hopper"] * LAYERS, (
        f"{name}: templates {templates}; lowered {[s.as_dict() for s in lowered]}")
    if name == "gemma2":
        assert all(any("softcap" in m for m in s.score_mods) for s in fused), \
            [s.score_mods for s in fused]


def test_explain_counts_the_layers_of_a_model():
    eager, _ = _models("gemma2", "eager")
    ids = torch.randint(1, 128, (1, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        report = fa3_inductor.explain(eager, ids)
    assert report.fused_count == LAYERS and report.served_count == LAYERS, str(report)
    assert {s.front_door for s in report.sites} == {"matmul-softmax"}
    assert all(s.gqa_groups == 2 for s in report.sites)
    assert f"{LAYERS} attention site(s) fused" in str(report)
