"""flex()'s direct inference path (fa3_inductor/direct.py): plan keys and numerics."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

import fa3_inductor
from fa3_inductor import direct, mods
from fa3_inductor.mod_keys import Unkeyable, mod_key
from reference import assert_matches_reference, reference_attention

CAP = 20.0


def _global_softcap(score, b, h, q_idx, kv_idx):
    return CAP * torch.tanh(score / CAP)


def test_same_computation_same_key_different_constant_different_key():
    assert mod_key(mods.softcap(30.0)) == mod_key(mods.softcap(30.0))
    assert mod_key(mods.softcap(30.0)) != mod_key(mods.softcap(31.0))
    nested = mods.and_masks(mods.causal, mods.sliding_window(8))
    assert mod_key(nested) == mod_key(mods.and_masks(mods.causal, mods.sliding_window(8)))
    assert mod_key(nested) != mod_key(mods.and_masks(mods.causal, mods.sliding_window(9)))


def test_a_rebound_global_changes_the_key(monkeypatch):
    before = mod_key(_global_softcap)
    monkeypatch.setattr(__import__(__name__), "CAP", 10.0)
    assert mod_key(_global_softcap) != before


def _band(width: int):
    def band(b, h, q_idx, kv_idx, *, width=width):   # the width lives in __kwdefaults__ only
        return (q_idx - kv_idx).abs() < width
    return band


def test_keyword_only_defaults_enter_the_key_and_the_watch():
    from fa3_inductor.block_masks import cached_block_mask, clear
    from fa3_inductor.mod_keys import ModWatch

    assert mod_key(_band(8)) == mod_key(_band(8)) != mod_key(_band(300))
    clear()
    q = torch.zeros(1, 1, 512, 16)
    cached_block_mask(_band(8), q, q)   # once, band(300) was then served this block mask
    wide = cached_block_mask(_band(300), q, q).to_dense()
    assert torch.equal(wide, create_block_mask(_band(300), None, None, 512, 512, device="cpu").to_dense())
    band = _band(8)
    watch = ModWatch(band)
    assert watch.unchanged()
    band.__kwdefaults__["width"] = 9
    assert not watch.unchanged()


def test_captured_tensors_key_by_identity():
    ids = torch.arange(64) // 16
    same, other = mods.document(ids), mods.document(ids.clone())
    assert mod_key(mods.document(ids)) == mod_key(same)
    assert mod_key(other) != mod_key(same)


def test_callable_objects_are_unkeyable():
    class Mod:
        def __call__(self, score, b, h, q_idx, kv_idx):
            return score

    with pytest.raises(Unkeyable):
        mod_key(Mod())


def _interpreter():
    from triton import knobs

    if not knobs.runtime.interpret:
        pytest.skip("CPU runs of our kernel need TRITON_INTERPRET=1")


@pytest.mark.parametrize("name", ["noop", "softcap+causal", "document", "alibi"])
def test_direct_forward_matches_reference(name):
    _interpreter()
    direct.clear()
    B, H, S, D = 1, 2, 80, 16
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float16) for _ in range(3))
    score, mask = {"noop": (None, None), "softcap+causal": (mods.softcap(2.0), mods.causal),
                   "document": (None, mods.document(torch.arange(S) // 30)),
                   "alibi": (mods.alibi(H), None)}[name]
    bm = create_block_mask(mask, None, None, S, S, device="cpu") if mask else None
    out, lse = direct.forward(q, k, v, score, bm, D ** -0.5, "auto")
    ref, ref_lse = reference_attention(q, k, v, score, mask)
    assert_matches_reference(out, ref, torch.float16)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-3, rtol=0)


def test_a_new_closure_with_the_same_constant_reuses_the_plan():
    _interpreter()
    direct.clear()
    q, k, v = (torch.randn(1, 1, 32, 16, dtype=torch.float16) for _ in range(3))
    direct.forward(q, k, v, mods.softcap(5.0), None, 0.25, "auto")
    direct.forward(q, k, v, mods.softcap(5.0), None, 0.25, "auto")
    assert len(direct._PLANS) == 1
    direct.forward(q, k, v, mods.softcap(6.0), None, 0.25, "auto")
    assert len(direct._PLANS) == 2


@pytest.mark.gpu
def test_inference_calls_take_the_direct_path_and_stay_right():
    direct.clear()
    q, k, v = (torch.randn(2, 4, 512, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    bm = create_block_mask(mods.causal, None, None, 512, 512, device="cuda")
    for cap in (20.0, 20.0, 5.0):
        out = fa3_inductor.flex(q, k, v, score_mod=mods.softcap(cap), block_mask=bm)
        ref, _ = reference_attention(q, k, v, mods.softcap(cap), mods.causal)
        assert_matches_reference(out, ref, torch.bfloat16)
    assert len(direct._PLANS) == 2
    assert fa3_inductor.last_template() == "hopper"


# ------------------------------------------------------------------ the call memo (ModWatch)

def test_a_watch_sees_rebound_cells_and_globals_and_edited_tensors(monkeypatch):
    from fa3_inductor.mod_keys import ModWatch

    watch = ModWatch(_global_softcap)
    assert watch.unchanged()
    monkeypatch.setattr(__import__(__name__), "CAP", 10.0)
    assert not watch.unchanged()

    ids = torch.zeros(16, dtype=torch.int32)
    doc = mods.document(ids)
    by_version, by_identity = ModWatch(doc, versions=True), ModWatch(doc)
    ids[3] = 1
    assert not by_version.unchanged() and by_identity.unchanged()

    nested = mods.and_masks(mods.causal, mods.sliding_window(8))
    assert ModWatch(nested).unchanged()


def test_a_mod_capturing_a_list_is_not_watched():
    from fa3_inductor.mod_keys import ModWatch

    caps = [30.0]

    def softcap(score, b, h, q_idx, kv_idx):
        return caps[0] * torch.tanh(score / caps[0])

    with pytest.raises(Unkeyable):
        ModWatch(softcap)


@pytest.mark.gpu
def test_repeated_calls_replay_and_notice_what_changed():
    direct.clear()
    S = 300
    ids = (torch.arange(S, device="cuda") // 100).to(torch.int32)
    doc = mods.document(ids)
    q, k, v = (torch.randn(1, 4, S, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(3):
        out = fa3_inductor.flex(q, k, v, mask_mod=doc)
    assert direct.stats()["remembered"] == 1   # kept under two keys: identities, equal_key
    assert_matches_reference(out, reference_attention(q, k, v, None, doc)[0], torch.bfloat16)
    ids[:] = (torch.arange(S, device="cuda") // 40).to(torch.int32)   # new documents, same tensor
    out = fa3_inductor.flex(q, k, v, mask_mod=doc)
    assert_matches_reference(out, reference_attention(q, k, v, None, doc)[0], torch.bfloat16)
    q2, k2, v2 = (torch.randn(1, 4, S, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = fa3_inductor.flex(q2, k2, v2, mask_mod=doc, return_lse=True)
    ref, ref_lse = reference_attention(q2, k2, v2, None, doc)
    assert_matches_reference(out, ref, torch.bfloat16)
    torch.testing.assert_close(lse.double(), ref_lse, atol=5e-2, rtol=0)
    t = q2.transpose(1, 2).contiguous().transpose(1, 2)   # other strides: not a replay of the above
    assert_matches_reference(fa3_inductor.flex(t, k2, v2, mask_mod=doc), ref, torch.bfloat16)
