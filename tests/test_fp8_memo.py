"""flex(fp8=...)'s call memo (direct_fp8.py): a repeated FP8 call re-binds the prologue and re-launches
its attention launch without checks, planning, a Call or a launch key.

The memo keeps what runtime/ops_fp8.bound_fp8_call makes after a served call: the prologue's layout
(re-bound per call: its launches run here under Triton's interpreter) and the attention launch
(runtime/ops_fp8.bound_fp8_launch), which replays only CUDA launches; here a stand-in binds the
same arguments to runtime.ops.serve, so a replay computes with exactly what the remembered call
bound (its site, block-mask tables, captured tensors) on the new call's prologue operands. A replay
must give the full path's result bit for bit, and every change that matters must miss.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fa3_inductor import FP8Recipe, RopeSpec, direct_fp8, flex, last_template, mods
from fa3_inductor.runtime import ops
from fa3_inductor.runtime.spec import SiteSpec
from fa3_inductor.templates.fp8_prologue.host import quantize
from fa3_inductor.templates.fp8_prologue.reference import dequantize
from reference import FP8_TOLERANCE, op_names, reference_attention, rel_error

S, D = 64, 32


@pytest.fixture(autouse=True)
def _replays_on_cpu(monkeypatch):
    from triton import knobs

    if not knobs.runtime.interpret:
        pytest.skip("runs our kernels on CPU tensors: needs TRITON_INTERPRET=1")
    monkeypatch.setattr("fa3_inductor.runtime.ops_fp8.bound_fp8_launch", _bound_to_serve)
    direct_fp8.clear()
    yield
    direct_fp8.clear()


def _bound_to_serve(spec, call):
    """ops_fp8.bound_fp8_launch's contract on the CPU: serve with everything but the prologue's
    operands and the outputs fixed."""
    site = SiteSpec.from_json(spec)

    def fire(fp8, out, lse, max_scores):
        mine = dataclasses.replace(call, q=fp8.q, k=fp8.k, v=fp8.vt, out=out, lse=lse,
                                   max_scores=max_scores, fp8=fp8)
        return ops.serve(site, mine, spec)
    return fire


def _qkv(seed=0, heads=2, kv_heads=2, dtype=torch.bfloat16, length=S):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, h, length, D, generator=g).to(dtype)
                 for h in (heads, kv_heads, kv_heads))


def _flex(q, k, v, **kwargs):
    with torch.no_grad():
        return flex(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kwargs)


def _full_path(q, k, v, **kwargs):
    """The same call with nothing remembered (then remembered again)."""
    direct_fp8.clear()
    return _flex(q, k, v, **kwargs)


def _reference(q, k, v, recipe, rope=None, score_mod=None, mask_mod=None):
    dq, dk, dv = dequantize(quantize(q, k, v, recipe, rope))
    return reference_attention(dq, dk, dv, score_mod, mask_mod, scale=D ** -0.5)


def _hits():
    return direct_fp8.stats()["hits"]


@pytest.mark.parametrize("recipe", [FP8Recipe(), FP8Recipe(block_m=32, block_n=32, qk="e4m3")])
def test_repeated_calls_replay_bit_for_bit(recipe):
    q, k, v = _qkv()
    first = _flex(q, k, v, fp8=recipe, mask_mod=mods.causal)
    assert direct_fp8.stats() == {"remembered": 1, "hits": 0, "equal_hits": 0}
    again = _flex(q, k, v, fp8=recipe, mask_mod=mods.causal)
    assert _hits() == 1 and last_template() in ("fp8", "hopper_fp8")
    assert torch.equal(again, first)
    # new values, same layout: the prologue re-bound over them
    q2, k2, v2 = _qkv(1)
    replayed = _flex(q2, k2, v2, fp8=recipe, mask_mod=mods.causal)
    assert _hits() == 2
    assert torch.equal(replayed, _full_path(q2, k2, v2, fp8=recipe, mask_mod=mods.causal))
    ref, _ = _reference(q2, k2, v2, recipe, mask_mod=mods.causal)
    assert rel_error(replayed, ref) < FP8_TOLERANCE


def test_fp8_true_and_an_equal_recipe_made_anew_share_the_entry():
    q, k, v = _qkv(2)
    _flex(q, k, v, fp8=True)
    _flex(q, k, v, fp8=FP8Recipe())
    _flex(q, k, v, fp8=True)
    assert direct_fp8.stats() == {"remembered": 1, "hits": 2, "equal_hits": 0}


def test_mods_made_anew_replay_by_what_they_compute():
    q, k, v = _qkv(3)
    outs = [_flex(q, k, v, fp8=True, score_mod=mods.softcap(20.0), mask_mod=mods.sliding_window(24))
            for _ in range(3)]
    assert direct_fp8.stats() == {"remembered": 1, "hits": 2, "equal_hits": 2}
    assert all(torch.equal(o, outs[0]) for o in outs)
    ref, _ = _reference(q, k, v, FP8Recipe(), score_mod=mods.softcap(20.0),
                        mask_mod=mods.sliding_window(24))
    assert rel_error(outs[-1], ref) < FP8_TOLERANCE


@pytest.mark.parametrize("change", ["recipe", "mod", "shape", "dtype", "gqa", "scale", "rope",
                                    "stride"])
def test_a_changed_call_misses(change):
    q, k, v = _qkv(4)
    call = dict(fp8=FP8Recipe(), score_mod=mods.softcap(20.0), scale=None, rope=None)
    _flex(q, k, v, **call)
    _flex(q, k, v, **call)
    assert _hits() == 1
    if change == "recipe":
        call["fp8"] = FP8Recipe(qk="e4m3")
    elif change == "mod":
        call["score_mod"] = mods.softcap(21.0)
    elif change == "shape":
        q, k, v = _qkv(4, length=S + 16)
    elif change == "dtype":
        q, k, v = _qkv(4, dtype=torch.float16)
    elif change == "gqa":
        q, k, v = _qkv(4, heads=4, kv_heads=2)
    elif change == "scale":
        call["scale"] = 0.1
    elif change == "rope":
        call["rope"] = RopeSpec.from_theta(D, S)
    else:   # the same shape, another layout: (B, S, H, D) storage
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    out = _flex(q, k, v, **call)
    assert direct_fp8.stats()["hits"] == 1 and direct_fp8.stats()["remembered"] == 2
    recipe = call["fp8"]
    ref, _ = _reference(q, k, v, recipe, call["rope"], score_mod=call["score_mod"])
    if call["scale"] is not None:
        dq, dk, dv = dequantize(quantize(q, k, v, recipe))
        ref, _ = reference_attention(dq, dk, dv, call["score_mod"], None, scale=call["scale"])
    assert rel_error(out, ref) < FP8_TOLERANCE
    assert torch.equal(out, _full_path(q, k, v, **call))


def test_a_captured_tensor_edited_in_place_under_a_mask_mod_is_noticed():
    q, k, v = _qkv(5)
    ids = (torch.arange(S) // 20).to(torch.int32)
    mask = mods.document(ids)
    _flex(q, k, v, fp8=True, mask_mod=mask)
    _flex(q, k, v, fp8=True, mask_mod=mask)
    assert _hits() == 1
    ids[:] = (torch.arange(S) // 7).to(torch.int32)   # new documents, same tensor: a new block mask
    out = _flex(q, k, v, fp8=True, mask_mod=mask)
    assert _hits() == 1
    ref, _ = _reference(q, k, v, FP8Recipe(), mask_mod=mods.document(ids.clone()))
    assert rel_error(out, ref) < FP8_TOLERANCE
    assert torch.equal(_flex(q, k, v, fp8=True, mask_mod=mask), out) and _hits() == 2


def test_a_score_mods_captured_tensor_is_read_by_the_replay():
    bias = torch.tensor([0.0, 3.0])

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    q, k, v = _qkv(6)
    _flex(q, k, v, fp8=True, score_mod=score_mod)
    bias[1] = -4.0    # the kernel reads it when it runs: still the same launch
    out = _flex(q, k, v, fp8=True, score_mod=score_mod)
    assert _hits() == 1
    ref, _ = _reference(q, k, v, FP8Recipe(), score_mod=score_mod)
    assert rel_error(out, ref) < FP8_TOLERANCE


@pytest.mark.parametrize("smooth", [False, True])
def test_return_lse_of_a_replay(smooth):
    # K with a large mean: uncorrected, smoothing's LSE is off by units (ops_fp8.smooth_lse)
    q, k, v = _qkv(7, heads=4, kv_heads=2)
    k = (k.float() + 2.0 * torch.randn(1, 2, 1, D, generator=torch.Generator().manual_seed(1))
         ).to(k.dtype)
    recipe = FP8Recipe(smooth_k=smooth)
    _flex(q, k, v, fp8=recipe, mask_mod=mods.causal)          # remembered without the LSE
    out, lse = _flex(q, k, v, fp8=recipe, mask_mod=mods.causal, return_lse=True)
    again = _flex(q, k, v, fp8=recipe, mask_mod=mods.causal, return_lse=True)
    assert _hits() == 2
    full = _full_path(q, k, v, fp8=recipe, mask_mod=mods.causal, return_lse=True)
    for got in ((out, lse), again):
        assert torch.equal(got[0], full[0]) and torch.equal(got[1], full[1])
    assert lse is not again[1]
    ref_out, ref_lse = reference_attention(q, k, v, mask_mod=mods.causal)
    assert rel_error(out, ref_out) < 0.07
    assert (lse.double() - ref_lse).abs().max().item() < 0.1


def test_rope_tables_and_positions_are_read_per_call():
    q, k, v = _qkv(8)
    recipe = FP8Recipe()
    rope = RopeSpec.from_theta(D, 2 * S)
    _flex(q, k, v, fp8=recipe, rope=rope)
    # new tables of the same layout and new positions: a replay, computed with them
    other = RopeSpec.from_theta(D, 2 * S, theta=500.0, q_positions=torch.arange(S) + S,
                                k_positions=torch.arange(S) + S)
    first_with_positions = _flex(q, k, v, fp8=recipe, rope=other)
    assert _hits() == 0   # positions given: another signature
    shifted = dataclasses.replace(other, q_positions=torch.arange(S), k_positions=torch.arange(S) + 1)
    out = _flex(q, k, v, fp8=recipe, rope=shifted)
    assert _hits() == 1 and not torch.equal(out, first_with_positions)
    assert torch.equal(out, _full_path(q, k, v, fp8=recipe, rope=shifted))
    ref, _ = _reference(q, k, v, recipe, shifted)
    assert rel_error(out, ref) < FP8_TOLERANCE
    # CPU positions are still checked against the table on a replay
    bad = dataclasses.replace(other, q_positions=torch.arange(S) + 2 * S)
    with pytest.raises(ValueError, match="q_positions must lie in"):
        _flex(q, k, v, fp8=recipe, rope=bad)


def test_the_inference_only_rules_hold_after_a_replay():
    q, k, v = _qkv(9)
    _flex(q, k, v, fp8=True)
    _flex(q, k, v, fp8=True)
    assert _hits() == 1
    with pytest.raises(NotImplementedError, match="inference-only"):
        flex(q.clone().requires_grad_(), k, v, fp8=True)
    with pytest.raises(ValueError, match="template must be 'auto'"):
        flex(q, k, v, fp8=True, template="generic")
    with pytest.raises(ValueError, match="pass fp8=True"):
        flex(q, k, v, rope=RopeSpec.from_theta(D, S))
    with torch.enable_grad():   # grad mode on, nothing needs a gradient: a replay
        flex(q, k, v, fp8=True)
    assert _hits() == 2


def test_nothing_is_remembered_where_the_launch_was_not_kept(monkeypatch):
    """Off CUDA the real bound_fp8_launch keeps nothing: every call takes the full path."""
    from fa3_inductor.runtime import ops_fp8

    monkeypatch.undo()
    monkeypatch.setattr(ops_fp8, "bound_fp8_launch", ops_fp8.bound_fp8_launch)
    q, k, v = _qkv(10)
    for _ in range(2):
        _flex(q, k, v, fp8=True)
    assert direct_fp8.stats() == {"remembered": 0, "hits": 0, "equal_hits": 0}


def test_the_bound_launch_passes_serves_inputs_in_serves_order():
    """On CUDA the replay fires the launch recorded under serve's key: its inputs must come in
    runtime.ops.serve_inputs' order (the recording found them there by position)."""
    from fa3_inductor.runtime import ops_fp8

    q, k, v = _qkv(11)
    tables = (torch.zeros(1, 1, 1, dtype=torch.int32), torch.zeros(1, 1, 1, 1, dtype=torch.int32),
              None, None)
    call = ops_fp8.fp8_call(q, k, v, tables, [torch.ones(2)], [torch.ones(3)], 0.2, 64, 64,
                            FP8Recipe())
    seen = []
    fire = ops_fp8._fire_with(seen.append, "tag", call)
    assert fire(call.fp8, call.out, call.lse, call.max_scores) == "tag"
    expected = ops.serve_inputs(call)
    assert len(seen[0]) == len(expected) == 16
    assert all(a is b for a, b in zip(seen[0], expected))


@pytest.mark.parametrize("smooth", [False, True])
def test_replays_reuse_one_operand_set_and_match_the_full_path(monkeypatch, smooth):
    """A replay re-writes the kept prologue operands (runtime/ops_fp8._Workspace: no allocation,
    no fill, no abs) and takes the next zeroed v_scale_max slot; with two slots, calls that wrote
    them are followed by one reset. Bit for bit the full path's output and LSE, a KV head of V all
    zero included (its v_scale_max stays 0 in the replay, 1 on the full path)."""
    from fa3_inductor.runtime import ops_fp8
    from fa3_inductor.templates.fp8_prologue.host import PrologueLayout

    monkeypatch.setattr(ops_fp8, "_RING", 2)
    ops_fp8._WORKSPACES.clear()   # (direct_fp8.clear leaves them: they go with the launch cache)
    recipe = FP8Recipe(smooth_k=smooth)
    calls = []
    for i in range(5):
        q, k, v = _qkv(20 + i, heads=4, kv_heads=2)
        if i in (1, 4):
            v[:, 0] = 0
        if i == 3:
            v = v * 1e-3   # smaller scales than the calls before: a slot not reset would keep theirs
        calls.append((q, k, v))
    _flex(*calls[0], fp8=recipe, mask_mod=mods.causal)
    replayed = [_flex(*c, fp8=recipe, mask_mod=mods.causal, return_lse=True) for c in calls]
    assert _hits() == len(calls)
    workspace, = ops_fp8._WORKSPACES.values()
    assert workspace.next == 1   # 5 calls over 2 slots: reset twice, slot 0 taken last
    assert (workspace.sets[0].v_scale_max[:, 0] == 0).all()   # call 4's all-zero head

    allocated = []
    allocate = PrologueLayout.allocate
    monkeypatch.setattr(PrologueLayout, "allocate", lambda *a, **kw: allocated.append(1) or allocate(*a, **kw))
    with op_names() as seen:   # (the interpreter's own ops are seen too)
        _flex(*calls[1], fp8=recipe, mask_mod=mods.causal)
    assert not {"fill_", "full", "abs_"} & set(seen.names), seen.names
    assert not allocated
    for c, (out, lse) in zip(calls, replayed):
        full_out, full_lse = _full_path(*c, fp8=recipe, mask_mod=mods.causal, return_lse=True)
        assert torch.equal(out, full_out) and torch.equal(lse, full_lse)
        assert torch.isfinite(out).all()
