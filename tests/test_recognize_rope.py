"""RoPE recognition (fa3_inductor/recognition/rope.py) on the graphs a backend sees, on the CPU.

Each spelling is a small function written the way model code writes RoPE before attention (or the
function imported from transformers), traced by torch.compile into the graph Dynamo hands a backend
("torch") and into the forward graph AOT autograd traces ("aten"). Each test finds the SDPA call's q
and k, checks what :func:`rope_pair` matched, and checks that the match *is* the graph's RoPE: the
match's (x, cos, sin, style, rotary_dim) fed to the reference ``apply_rope`` reproduce the value the
graph computed for the attention operand: bit for bit in the model's own arithmetic (same dtype,
same op order), and within the dtype's rounding of a float64 evaluation. Near misses (a different
sign, a scale, swapped or different tables, other channels rotated) must not match.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from fa3_inductor.recognition.operands import unrepeat
from fa3_inductor.recognition.rope import (RopeMatch, apply_rope, match_rope, real_table_nodes,
                                           real_tables, rope_pair)

B, H, S, D, R = 2, 2, 6, 16, 8     # R: the rotated width of the partial-rotary spellings
DTYPES = [torch.float32, torch.bfloat16]
LEVELS = ["torch", "aten"]


# ---------------------------------------------------------------------------------------------
# Tracing: the graph as the backend (or AOT autograd's forward compiler) gets it, with values
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Traced:
    gm: torch.fx.GraphModule
    env: dict                 # node -> the value the graph computed for it on the inputs
    q: torch.fx.Node          # SDPA's query / key arguments
    k: torch.fx.Node


def trace(fn: Callable, inputs: tuple, level: str) -> Traced:
    """Compile ``fn`` with a capturing backend, run it once, and evaluate every node of the
    captured graph on the arguments it was called with."""
    captured: dict = {}

    def capture(gm, example_inputs):
        def run(*args):
            captured.setdefault("call", (gm, args))
            return gm(*args)
        return run

    if level == "torch":
        backend = capture
    else:
        from torch._dynamo.backends.common import aot_autograd
        backend = aot_autograd(fw_compiler=capture)
    torch._dynamo.reset()    # a cached compile of the same function would skip the capture
    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*inputs)
    gm, args = captured["call"]
    interpreter = torch.fx.Interpreter(gm, garbage_collect_values=False)
    interpreter.run(*args)
    (sdpa,) = [n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    return Traced(gm, interpreter.env, sdpa.args[0], sdpa.args[1])


def apply_views(value: torch.Tensor, views: list, casts: bool = True) -> torch.Tensor:
    for method, args in views:
        if method == "to" and not casts:
            continue
        value = getattr(value, method)(*args)
    return value


def assert_exact(m: RopeMatch, node: torch.fx.Node, env: dict) -> None:
    """The match reproduces the graph's value of ``node`` (see the module docstring)."""
    got = env[node]
    x, cos, sin = env[m.x], env[m.cos], env[m.sin]
    # The model's own arithmetic: same dtype, same op order: the same bits.
    same = apply_views(apply_rope(x.to(m.compute_dtype), cos, sin, m.style, m.rotary_dim,
                                  m.complex_table), m.views)
    assert same.dtype == got.dtype and same.shape == got.shape
    # (complex too: torch's CPU complex multiply computes ac - bd, ad + bc without a fused
    # multiply-add, as the real spelling does.)
    assert torch.equal(same, got), (same - got).abs().max()
    # A float64 evaluation of the same RoPE, within the rounding of the graph's dtype.
    if m.complex_table:
        cos, sin = real_tables(cos.to(torch.complex128))
    else:
        cos, sin = cos.double(), sin.double()
    x64 = x.double()
    ref = apply_views(apply_rope(x64, cos, sin, m.style, m.rotary_dim), m.views, casts=False)
    zero = torch.zeros_like(cos)
    scale = (apply_rope(x64.abs(), cos.abs(), zero, m.style, m.rotary_dim).abs() +
             apply_rope(x64.abs(), zero, sin.abs(), m.style, m.rotary_dim).abs())
    scale = apply_views(scale, m.views, casts=False)
    if got.dtype == m.compute_dtype == torch.float64:
        assert torch.equal(got, ref)
    # Each of x*cos, rotate(x)*sin and their sum rounds once (relative error u = eps/2 each),
    # so the error is at most eps * (|x*cos| + |rotate(x)*sin|) in the coarsest dtype involved
    # (a float32 RoPE cast to bfloat16 after: bfloat16's rounding of the result).
    eps = torch.finfo(min(got.dtype, m.compute_dtype, key=lambda t: torch.finfo(t).bits)).eps
    error = (got.double() - ref).abs()
    assert (error <= 1.01 * eps * scale).all(), error.max()


# ---------------------------------------------------------------------------------------------
# Spellings, as model code writes them
# ---------------------------------------------------------------------------------------------

def rotate_half(x):
    """transformers' rotate_half."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_tables(dtype, width=D, batch=B):
    """cos/sin [B, S, width] as transformers' rotary embedding makes them (float32, then cast)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, width, 2, dtype=torch.float32) / width))
    positions = torch.arange(S, dtype=torch.float32)[None, :].expand(batch, S)
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def qkv(dtype, layout="bhsd"):
    shape = (B, H, S, D) if layout == "bhsd" else (B, S, H, D)
    return tuple(torch.randn(shape).to(dtype) for _ in range(3))


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def llama(q, k, v, cos, sin):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return sdpa(q, k, v)


def llama_bshd(q, k, v, cos, sin):
    """unsqueeze_dim=2: q/k laid out [B, S, H, D] for RoPE, transposed for attention."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    return sdpa(q.transpose(1, 2), k.transpose(1, 2), v)


def neox_partial(q, k, v, cos, sin):
    """GPT-NeoX's apply_rotary_pos_emb: rotary width from the tables, tail passed through."""
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return sdpa(q, k, v)


def phi_partial(q, k, v, cos, sin):
    """Phi's attention: split, rotate the first R channels, concatenate back."""
    from transformers.models.phi.modeling_phi import apply_rotary_pos_emb
    q_rot, q_pass = q[..., :R], q[..., R:]
    k_rot, k_pass = k[..., :R], k[..., R:]
    q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin)
    q = torch.cat((q_rot, q_pass), dim=-1)
    k = torch.cat((k_rot, k_pass), dim=-1)
    return sdpa(q, k, v)


def split_partial(q, k, v, cos, sin):
    """Partial rotary with the parts taken by torch.split (q) and narrow (k)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    q_rot, q_pass = torch.split(q, [R, D - R], dim=-1)
    k_rot, k_pass = k.narrow(-1, 0, R), k.narrow(-1, R, D - R)
    q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin)
    return sdpa(torch.cat((q_rot, q_pass), dim=-1), torch.cat((k_rot, k_pass), dim=-1), v)


def in_graph_chunk(q, k, v):
    """Tables computed in the graph from positions; rotate_half spelled with chunk; float32
    arithmetic for a low-precision model (x.float() ... .to(dtype))."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    freqs = torch.outer(torch.arange(S, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None, None], emb.sin()[None, None]

    def rope(x):
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)
    return sdpa(rope(q), rope(k), v)


def gptj(q, k, v, sin, cos):
    """GPT-J: rotate_every_two, tables [B, S, D/2] repeated with repeat_interleave; q/k laid out
    [B, S, H, D] for RoPE."""
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb
    q = apply_rotary_pos_emb(q, sin, cos).transpose(1, 2)
    k = apply_rotary_pos_emb(k, sin, cos).transpose(1, 2)
    return sdpa(q, k, v)


def pairs_unbind(q, k, v, cos, sin):
    """Interleaved, as rotary-embedding-torch writes it: pairs viewed, unbound, restacked."""
    def rotate_every_two(x):
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(dim=-1)
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    cos = cos.repeat_interleave(2, dim=-1)[:, None]
    sin = sin.repeat_interleave(2, dim=-1)[:, None]
    return sdpa(q * cos + rotate_every_two(q) * sin, k * cos + rotate_every_two(k) * sin, v)


def meta_complex(q, k, v, freqs_cis):
    """Meta's Llama: complex multiply in float32, q/k laid out [B, S, H, D]."""
    def reshape_for_broadcast(freqs_cis, x):
        shape = [d if i == 1 or i == x.ndim - 1 else 1 for i, d in enumerate(x.shape)]
        return freqs_cis.view(*shape)

    xq_ = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    q, k = xq_out.type_as(q), xk_out.type_as(k)
    return sdpa(q.transpose(1, 2), k.transpose(1, 2), v)


def meta_freqs():
    freqs = 1.0 / (10000.0 ** (torch.arange(0, D, 2)[: D // 2].float() / D))
    return torch.polar(torch.ones(S, D // 2), torch.outer(torch.arange(S).float(), freqs))


@dataclasses.dataclass
class Spelling:
    fn: Callable
    inputs: Callable        # dtype -> the function's inputs
    style: str
    rotary_dim: int
    complex_table: bool = False


SPELLINGS = {
    "llama": Spelling(llama, lambda dt: qkv(dt) + hf_tables(dt), "half", D),
    "llama_unsqueeze_dim_2": Spelling(
        llama_bshd, lambda dt: qkv(dt, "bshd")[:2] + qkv(dt)[2:] + hf_tables(dt), "half", D),
    "neox_partial": Spelling(neox_partial, lambda dt: qkv(dt) + hf_tables(dt, R), "half", R),
    "phi_partial": Spelling(phi_partial, lambda dt: qkv(dt) + hf_tables(dt, R), "half", R),
    "split_partial": Spelling(split_partial, lambda dt: qkv(dt) + hf_tables(dt, R), "half", R),
    "in_graph_chunk_float32": Spelling(in_graph_chunk, qkv, "half", D),
    "gptj": Spelling(gptj, lambda dt: qkv(dt, "bshd")[:2] + qkv(dt)[2:] + tuple(
        t[..., :D // 2] for t in hf_tables(dt)), "interleaved", D),
    "pairs_unbind": Spelling(pairs_unbind, lambda dt: qkv(dt) + tuple(
        t[..., :D // 2] for t in hf_tables(dt)), "interleaved", D),
    "meta_complex": Spelling(meta_complex, lambda dt: qkv(dt, "bshd")[:2] + qkv(dt)[2:] + (
        meta_freqs(),), "interleaved", D, complex_table=True),
}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(SPELLINGS))
def test_spelling_is_matched_exactly(name, dtype, level):
    spelling = SPELLINGS[name]
    torch.manual_seed(0)
    inputs = spelling.inputs(dtype)
    traced = trace(spelling.fn, inputs, level)
    pair = rope_pair(traced.q, traced.k)
    assert pair is not None
    for m, node, x_input in zip(pair, (traced.q, traced.k), inputs[:2]):
        assert (m.style, m.rotary_dim, m.complex_table) == (
            spelling.style, spelling.rotary_dim, spelling.complex_table)
        # x is the tensor the model rotated: here the function's own q / k argument.
        assert m.x.op == "placeholder" and traced.env[m.x] is x_input
        assert m.nodes and node in m.nodes and m.x not in m.nodes and m.cos not in m.nodes
        assert_exact(m, node, traced.env)


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_float64_graphs_match_bit_for_bit(name):
    """In float64 the graph's value is the float64 reference itself (Meta's spelling excepted:
    it computes in float32 whatever x is)."""
    spelling = SPELLINGS[name]
    torch.manual_seed(0)
    inputs = spelling.inputs(torch.float64)
    if spelling.complex_table:
        inputs = inputs[:-1] + (inputs[-1].to(torch.complex128),)
    traced = trace(spelling.fn, inputs, "torch")
    for node in (traced.q, traced.k):
        assert_exact(match_rope(node), node, traced.env)


def test_operand_views_say_where_the_heads_are():
    """RoPE output in [B, S, H, D] used as an operand through a permute (an einsum layout): the
    tables' size-1 axis is the head axis only once the operand's views are known."""
    torch.manual_seed(0)
    inputs = qkv(torch.float32, "bshd")[:2] + qkv(torch.float32)[2:] + tuple(
        t[..., :D // 2] for t in hf_tables(torch.float32))
    traced = trace(gptj, inputs, "torch")
    rope_out = traced.q.args[0]                 # before gptj's transpose(1, 2)
    assert match_rope(rope_out) is None         # read as [B, H, S, D]: tables vary over "heads"
    m = match_rope(rope_out, operand_views=[("transpose", (1, 2))])
    assert m is not None and m.views == []
    assert rope_pair(rope_out, traced.k.args[0], [("permute", (0, 2, 1, 3))],
                     [("transpose", (1, 2))]) is not None


def test_what_a_match_records():
    """The layout views and casts between RoPE and the operand, and the expression's nodes."""
    torch.manual_seed(0)
    traced = trace(meta_complex, qkv(torch.bfloat16, "bshd")[:2] + qkv(torch.bfloat16)[2:] +
                   (meta_freqs(),), "torch")
    m = match_rope(traced.q)
    assert m.views == [("to", (torch.bfloat16,)), ("transpose", (1, 2))]
    assert m.compute_dtype == torch.float32 and m.cos is m.sin and m.cos.target == "view"
    assert [n.name for n in m.nodes] == ["float_1", "reshape", "xq_", "mul", "view_as_real",
                                         "xq_out", "q", "transpose"]


def test_complex_tables_become_real_table_nodes():
    """real_table_nodes builds the interleaved cos/sin tables from freqs_cis in the graph."""
    torch.manual_seed(0)
    inputs = qkv(torch.float32, "bshd")[:2] + qkv(torch.float32)[2:] + (meta_freqs(),)
    traced = trace(meta_complex, inputs, "torch")
    m = match_rope(traced.q)
    gm = traced.gm
    output = gm.graph.output_node()
    with gm.graph.inserting_before(output):
        cos, sin = real_table_nodes(gm.graph, m)
    output.args = (tuple(output.args[0]) + (cos, sin),)
    gm.recompile()
    args = [traced.env[n] for n in gm.graph.nodes if n.op == "placeholder"]
    *_, cos_value, sin_value = gm(*args)
    assert cos_value.shape == (1, S, 1, D)
    x = traced.env[m.x].float()
    ours = apply_rope(x, cos_value, sin_value, "interleaved", D)
    torch.testing.assert_close(apply_views(ours, m.views), traced.env[traced.q],
                               rtol=2 ** -22, atol=2 ** -22)


def test_a_transformers_llama_model():
    """transformers' own Llama (one layer, sdpa attention, a KV cache as generate's prefill runs
    it): tables computed in the graph from position ids, k stored in the cache (a cat with the
    empty cache) and repeated for GQA. q and k are matched; x is query_states / key_states before
    RoPE."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (B, S))
    traced = trace(lambda ids: model(ids, use_cache=True).logits, (ids,), "torch")
    k_node, groups = unrepeat(traced.k)      # repeat_kv, undone as the site planner does
    pair = rope_pair(traced.q, k_node)
    assert pair is not None and groups == 2
    layer = model.model.layers[0]
    with torch.no_grad():
        hidden = layer.input_layernorm(model.model.embed_tokens(ids))
        for m, proj, heads in zip(pair, (layer.self_attn.q_proj, layer.self_attn.k_proj), (4, 2)):
            assert torch.equal(traced.env[m.x], proj(hidden).view(B, S, heads, 16).transpose(1, 2))
    for m, node in zip(pair, (traced.q, k_node)):
        assert (m.style, m.rotary_dim, m.views) == ("half", 16, [])
        assert_exact(m, node, traced.env)


# ---------------------------------------------------------------------------------------------
# Near misses: each looks like RoPE and is not (or not the RoPE its tables say)
# ---------------------------------------------------------------------------------------------

def _in_graph_tables():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    emb = torch.outer(torch.arange(S, dtype=torch.float32), inv_freq).repeat(1, 2)
    return emb.cos(), emb.sin()


def _opposite_sign(q, k, v, cos, sin):
    def rot(x):
        return torch.cat((x[..., D // 2:], -x[..., :D // 2]), dim=-1)
    return sdpa(q * cos + rot(q) * sin, k * cos + rot(k) * sin, v)


def _halves_swapped(q, k, v, cos, sin):
    def rot(x):
        return torch.cat((-x[..., :D // 2], x[..., D // 2:]), dim=-1)
    return sdpa(q * cos + rot(q) * sin, k * cos + rot(k) * sin, v)


def _subtracted(q, k, v, cos, sin):
    return sdpa(q * cos - rotate_half(q) * sin, k * cos - rotate_half(k) * sin, v)


def _scaled_term(q, k, v, cos, sin):
    return sdpa(q * cos * 2 + rotate_half(q) * sin, k * cos * 2 + rotate_half(k) * sin, v)


def _scaled_sum(q, k, v, cos, sin):
    return sdpa((q * cos + rotate_half(q) * sin) * 0.5, (k * cos + rotate_half(k) * sin) * 0.5, v)


def _other_tensor_rotated(q, k, v, cos, sin):
    return sdpa(q * cos + rotate_half(k) * sin, k * cos + rotate_half(q) * sin, v)


def _swapped_tables(q, k, v):
    cos, sin = _in_graph_tables()
    return sdpa(q * sin + rotate_half(q) * cos, k * sin + rotate_half(k) * cos, v)


def _different_angles(q, k, v):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    emb = torch.outer(torch.arange(S, dtype=torch.float32), inv_freq).repeat(1, 2)
    cos, sin = emb.cos(), (emb * 2).sin()
    return sdpa(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v)


def _wrong_parity(q, k, v, cos, sin):
    def rot(x):
        return torch.stack((-x[..., ::2], x[..., 1::2]), dim=-1).flatten(-2)
    return sdpa(q * cos + rot(q) * sin, k * cos + rot(k) * sin, v)


def _per_head_tables(q, k, v, cos, sin):
    heads = torch.arange(1, H + 1, dtype=cos.dtype)[:, None, None]
    cos, sin = cos[:, None] * heads, sin[:, None] * heads     # [B, H, S, D]
    return sdpa(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v)


def _tail_rotated(q, k, v, cos, sin):
    """cat((x_pass, rope(x_rot))): the rotated channels are the last R (DeepSeek MLA style)."""
    def rope(x):
        rot = x[..., D - R:]
        return torch.cat((x[..., :D - R], rot * cos[..., :R] + rotate_half(rot) * sin[..., :R]),
                         dim=-1)
    return sdpa(rope(q), rope(k), v)


def _tail_from_another_tensor(q, k, v, cos, sin):
    def rope(x, tail_of):
        rot = x[..., :R]
        return torch.cat((rot * cos[..., :R] + rotate_half(rot) * sin[..., :R],
                          tail_of[..., R:]), dim=-1)
    return sdpa(rope(q, k), rope(k, q), v)


def _complex_times_real(q, k, v, freqs_cis):
    scale = freqs_cis.abs()[None, :, None, :]     # a real table: a scaling, not a rotation
    xq = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
    xk = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
    q, k = (torch.view_as_real(x * scale).flatten(3).transpose(1, 2) for x in (xq, xk))
    return sdpa(q, k, v)


def _mixed_table_dtypes(q, k, v, cos, sin):
    """A float32 cos with a bfloat16 sin: the model rounds rotate(x)*sin to bfloat16 first."""
    cos = cos.float()
    q = (q * cos + rotate_half(q) * sin).to(q.dtype)
    k = (k * cos + rotate_half(k) * sin).to(k.dtype)
    return sdpa(q, k, v)


def _tables(dtype=torch.float32):
    cos, sin = hf_tables(dtype)
    return cos[:, None], sin[:, None]


NEAR_MISSES = {
    "opposite_sign": (_opposite_sign, lambda: qkv(torch.float32) + _tables(),
                      "first part that is not negated"),
    "halves_swapped": (_halves_swapped, lambda: qkv(torch.float32) + _tables(),
                       "rotate_half is cat(-x[..., 8:], x[..., :8])"),
    "subtracted": (_subtracted, lambda: qkv(torch.float32) + _tables(), "(sub)"),
    "scaled_term": (_scaled_term, lambda: qkv(torch.float32) + _tables(), "does not multiply"),
    "scaled_sum": (_scaled_sum, lambda: qkv(torch.float32) + _tables(), "(mul)"),
    "other_tensor_rotated": (_other_tensor_rotated, lambda: qkv(torch.float32) + _tables(),
                             "does not multiply"),
    "swapped_tables": (_swapped_tables, lambda: qkv(torch.float32), "cos and sin are swapped"),
    "different_angles": (_different_angles, lambda: qkv(torch.float32),
                         "cos and sin are of different angles"),
    "wrong_parity": (_wrong_parity, lambda: qkv(torch.float32) + _tables(),
                     "rotate_every_two is stack(-x[..., 1::2], x[..., ::2])"),
    "per_head_tables": (_per_head_tables, lambda: qkv(torch.float32) + hf_tables(torch.float32),
                        "varies across heads"),
    "tail_rotated": (_tail_rotated, lambda: qkv(torch.float32) + _tables(),
                     "RopeSpec rotates the first R channels"),
    "tail_from_another_tensor": (_tail_from_another_tensor,
                                 lambda: qkv(torch.float32) + _tables(),
                                 "the tensor whose tail is passed through"),
    "mixed_table_dtypes": (_mixed_table_dtypes, lambda: qkv(torch.bfloat16) + _tables(
        torch.bfloat16), "mixed dtypes"),
    "complex_times_real": (_complex_times_real, lambda: qkv(torch.float32, "bshd")[:2] +
                           qkv(torch.float32)[2:] + (meta_freqs(),), "not a complex tensor"),
}


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_near_misses_do_not_match(name, caplog):
    fn, inputs, reason = NEAR_MISSES[name]
    torch.manual_seed(0)
    traced = trace(fn, inputs(), "torch")
    with caplog.at_level(logging.DEBUG, logger="fa3_inductor"):
        assert match_rope(traced.q) is None
        assert rope_pair(traced.q, traced.k) is None
    messages = [r.getMessage() for r in caplog.records]
    assert any(reason in m for m in messages), messages


@pytest.mark.parametrize("name", ["opposite_sign", "swapped_tables", "tail_rotated"])
def test_near_misses_do_not_match_at_the_aten_level(name):
    fn, inputs, _ = NEAR_MISSES[name]
    torch.manual_seed(0)
    traced = trace(fn, inputs(), "aten")
    assert match_rope(traced.q) is None


def _different_tables_for_k(q, k, v, cos, sin, cos_k, sin_k):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    q, _ = apply_rotary_pos_emb(q, k, cos, sin)
    _, k = apply_rotary_pos_emb(q, k, cos_k, sin_k)
    return sdpa(q, k, v)


def _different_rows_for_k(q, k, v, cos, sin):
    """The same source tables indexed differently (k shifted by one position)."""
    q = q * cos[:, None, :S] + rotate_half(q) * sin[:, None, :S]
    k = k * cos[:, None, 1:] + rotate_half(k) * sin[:, None, 1:]
    return sdpa(q, k, v)


def _same_rows_spelled_twice(q, k, v, cos, sin):
    q = q * cos[:, None, :S] + rotate_half(q) * sin[:, None, :S]
    k = k * cos[:, None, :S] + rotate_half(k) * sin[:, None, :S]
    return sdpa(q, k, v)


def test_q_and_k_must_share_their_tables(caplog):
    torch.manual_seed(0)
    cos, sin = hf_tables(torch.float32)
    other = hf_tables(torch.float32, batch=B)
    traced = trace(_different_tables_for_k,
                   qkv(torch.float32) + (cos, sin, other[0] * 2, other[1] * 2), "torch")
    with caplog.at_level(logging.DEBUG, logger="fa3_inductor"):
        assert match_rope(traced.q) is not None and match_rope(traced.k) is not None
        assert rope_pair(traced.q, traced.k) is None
    assert any("not provably the same" in r.getMessage() for r in caplog.records)

    longer = tuple(torch.randn(B, S + 1, D) for _ in range(2))
    traced = trace(_different_rows_for_k, qkv(torch.float32) + longer, "torch")
    assert rope_pair(traced.q, traced.k) is None
    traced = trace(_same_rows_spelled_twice, qkv(torch.float32) + longer, "torch")
    pair = rope_pair(traced.q, traced.k)
    assert pair is not None and pair[0].cos is not pair[1].cos   # same value, two nodes
