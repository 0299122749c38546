"""attn_implementation="fa3" in transformers models built from tiny configs (no download).

CPU: our generic kernel runs under Triton's interpreter (conftest sets TRITON_INTERPRET=1),
forward only (torch's FlexAttention refuses backward on CPU). Outputs are compared with the
same weights under attn_implementation="eager", at every non-padded position.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fa3_inductor  # noqa: E402
from fa3_inductor.integrations import transformers as fa3_hf  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _configs():
    from transformers import (Gemma2Config, LlamaConfig, MistralConfig, Phi3Config,
                              Qwen2Config)

    return {
        "llama": LlamaConfig(**TINY, head_dim=16),
        "mistral": MistralConfig(**TINY, head_dim=16, sliding_window=12),
        "qwen2": Qwen2Config(**TINY),
        # Random init gives attention logits of ~0.03: a cap of 0.02 makes tanh bite (a test
        # with the softcap dropped fails).
        "gemma2": Gemma2Config(**TINY, head_dim=16, attn_logit_softcapping=0.02,
                               final_logit_softcapping=None, sliding_window=12,
                               query_pre_attn_scalar=16),
        "phi3": Phi3Config(**TINY, pad_token_id=0),
    }


def _eager_vs(name, implementation, dtype=torch.float32, device="cpu", head_dim=None):
    """(relative error of ``implementation``'s logits against eager's at every non-padded position,
    the family that served the last call): same weights, two sequences, one left-padded.
    ``head_dim`` overrides the tiny config's (the GPU's FP8 kernels take head dims from 32 up)."""
    from triton import knobs
    from transformers import AutoModelForCausalLM

    if device == "cpu" and not knobs.runtime.interpret:
        pytest.skip("runs our kernels on CPU tensors: needs TRITON_INTERPRET=1 (set by conftest "
                    "on machines without a GPU)")
    fa3_hf.register()
    torch.manual_seed(0)
    cfg = _configs()[name]
    if head_dim is not None:
        cfg.head_dim = head_dim
        if getattr(cfg, "query_pre_attn_scalar", None) is not None:
            cfg.query_pre_attn_scalar = head_dim
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=implementation)
    ours.load_state_dict(eager.state_dict())
    eager, ours = eager.to(device, dtype).eval(), ours.to(device, dtype).eval()
    ids = torch.randint(1, cfg.vocab_size, (2, 40), device=device)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding in the second sequence
    with torch.no_grad():
        ref = eager(ids, attention_mask=mask).logits.float()
        out = ours(ids, attention_mask=mask).logits.float()
    keep = mask.bool()
    return ((out[keep] - ref[keep]).norm() / ref[keep].norm()).item(), fa3_inductor.last_template()


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "gemma2", "phi3"])
def test_fa3_attention_matches_eager(name):
    err, template = _eager_vs(name, "fa3")
    assert template in ("generic", "hopper")
    assert err <= 1e-4, f"{name}: relative error {err:.2e} against eager"


def test_bad_mask_type_is_refused():
    q = torch.randn(1, 2, 16, 16)
    with pytest.raises(TypeError, match="expects its mask as a BlockMask"):
        fa3_hf.fa3_attention_forward(torch.nn.Module(), q, q, q, torch.ones(1, 1, 16, 16))


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_fa3_fp8_attention_is_close_to_eager(name):
    """attn_implementation="fa3_fp8": FP8 attention (inference), bf16 model; within the FP8 rule of
    tests/reference.py of eager bf16 at every non-padded position."""
    from reference import FP8_TOLERANCE

    err, template = _eager_vs(name, "fa3_fp8", torch.bfloat16)
    assert template in ("fp8", "hopper_fp8")
    assert 0 < err <= FP8_TOLERANCE, f"{name}: relative error {err:.2e} against eager bf16"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_fa3_fp8_attention_on_gpu(name):
    """The same check on CUDA tensors: the FP8 family serves every layer on an FP8 GPU (head dim 64:
    the tiny configs' 16 is below e4m3 wgmma's K step of 32, and torch's dense kernel would serve it)."""
    from reference import FP8_TOLERANCE

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with e4m3 tensor cores (sm89+)")
    err, template = _eager_vs(name, "fa3_fp8", torch.bfloat16, device="cuda", head_dim=64)
    assert template in ("fp8", "hopper_fp8")
    assert 0 < err <= FP8_TOLERANCE, f"{name}: relative error {err:.2e} against eager bf16"


def test_fa3_fp8_refuses_training():
    fa3_hf.register()
    layer = torch.nn.Module().train()
    q = torch.randn(1, 2, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="inference-only"):
        fa3_hf.fa3_fp8_attention_forward(layer, q, q, q, None, scaling=0.25)


def test_compiled_decode_step_is_one_graph_and_matches_eager():
    """generate() compiles the static-cache decode step; transformers builds its BlockMask with
    create_block_mask(_compile=True), a graph break inside Dynamo that split the step in two graphs
    and built the mask eagerly every token. Under compile "fa3"'s mask builder traces it."""
    from transformers import AutoModelForCausalLM, StaticCache

    fa3_hf.register()
    torch.manual_seed(0)
    cfg = _configs()["llama"]
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="fa3").eval()
    ours.load_state_dict(eager.state_dict())
    ids = torch.randint(1, cfg.vocab_size, (2, 24))
    mask = torch.ones(2, 25, dtype=torch.long)
    mask[1, :5] = 0  # left padding in the second sequence
    nxt, pos = torch.randint(1, cfg.vocab_size, (2, 1)), torch.tensor([24])

    def decode_step(model):   # a freshly prefilled static cache: a step is not idempotent
        cache = StaticCache(config=cfg, max_cache_len=32)
        model(input_ids=ids, attention_mask=mask[:, :24], past_key_values=cache,
              cache_position=torch.arange(24))
        return lambda tok, pos: model(input_ids=tok, attention_mask=mask, past_key_values=cache,
                                      cache_position=pos).logits.float()

    with torch.no_grad():
        explained = torch._dynamo.explain(decode_step(ours))(nxt, pos)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
            [(b.reason[:300], [(f.name, f.lineno) for f in b.user_stack[-3:]])
             for b in explained.break_reasons]
        torch._dynamo.reset()
        ref = decode_step(eager)(nxt, pos)
        out = torch.compile(decode_step(ours), backend="eager")(nxt, pos)
    err = ((out - ref).norm() / ref.norm()).item()
    assert err <= 1e-4, f"relative error {err:.2e} against eager"
