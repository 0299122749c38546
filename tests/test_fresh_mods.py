"""flex()'s call memo finds a mod made anew per call by what it computes (direct.equal_key).

A model that writes ``score_mod=mods.softcap(30.0)`` in its forward passes a new closure every
call; the memo's identity key never repeats for it, so each call took the full path (~300 us on an
H200 host against ~27 for a reused mod). Here such calls replay the remembered launch, and
every change that matters still gets its own: another constant, another captured tensor, a
document-ids tensor edited in place (its block mask is rebuilt); a mod that cannot be keyed
keeps taking the full path.

flex() takes its direct path (CUDA's: plan once, then our op) on the CPU here (api.DIRECT_ON_CPU).
The memo re-launches through runtime/ops.bound_launch, which replays only CUDA launches; here a
stand-in binds the same arguments to the op itself, so a replay computes with exactly what the
remembered call bound (its block-mask tables, its captured tensors, its plan).
"""

from __future__ import annotations

import functools

import pytest
import torch

import fa3_inductor
from fa3_inductor import api, block_masks, direct, mods
from reference import assert_matches_reference, reference_attention

S, D = 64, 16


@pytest.fixture(autouse=True)
def _direct_on_cpu(monkeypatch):
    from triton import knobs

    if not knobs.runtime.interpret:
        pytest.skip("runs our kernels on CPU tensors: needs TRITON_INTERPRET=1")
    monkeypatch.setattr(api, "DIRECT_ON_CPU", True)
    monkeypatch.setattr("fa3_inductor.runtime.ops.bound_launch", _bound_to_the_op)
    direct.clear()
    block_masks.clear()


def _bound_to_the_op(q, k, v, tables, score_bufs, mask_bufs, scale, sparse_q, sparse_kv, spec):
    """ops.bound_launch's contract on the CPU: the op with everything but q, k, v fixed."""
    def launch(q, k, v, want_lse):
        out, lse, _ = torch.ops.fa3_inductor.flex_fwd(q, k, v, *tables, score_bufs, mask_bufs, scale,
                                                       sparse_q, sparse_kv, spec)
        return out, lse if want_lse else None
    return launch


def _qkv(seed: int = 0, heads: int = 2) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    return tuple(torch.randn(1, heads, S, D) for _ in range(3))


def _check(q, k, v, score_mod=None, mask_mod=None, **kwargs) -> None:
    with torch.no_grad():
        out = fa3_inductor.flex(q, k, v, score_mod=score_mod, mask_mod=mask_mod, **kwargs)
    ref, _ = reference_attention(q, k, v, score_mod, mask_mod)
    assert_matches_reference(out, ref, torch.float32)


def test_mods_made_anew_each_call_replay_the_first_calls_launch():
    q, k, v = _qkv()
    for _ in range(3):
        _check(q, k, v, mods.softcap(30.0), mods.causal)
        _check(q, k, v, mods.alibi(2), mods.sliding_window(24))
        _check(q, k, v, None, mods.document(torch.arange(S) // 20))   # a new, equal tensor: not equal
    assert direct.stats()["remembered"] == 2 + 3
    assert direct.stats()["equal_hits"] == 2 * 2


def test_a_mod_made_anew_with_another_constant_is_another_call():
    q, k, v = _qkv(1)
    for cap in (30.0, 2.0, 30.0, 2.0, 1.0):
        _check(q, k, v, mods.softcap(cap), mods.sliding_window(cap))
    assert direct.stats()["remembered"] == 3
    assert direct.stats()["equal_hits"] == 2


def test_a_score_mod_made_anew_over_another_tensor_reads_that_tensor():
    def biased(bias):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[h]
        return score_mod

    q, k, v = _qkv(2)
    first = torch.tensor([0.0, 3.0])
    for bias in (first, torch.tensor([-2.0, 1.0]), first):
        _check(q, k, v, biased(bias))
    first[1] = -4.0   # the kernel reads a score_mod's tensor when it runs: still the same launch
    _check(q, k, v, biased(first))
    assert direct.stats()["equal_hits"] == 2   # the last two calls: the first one's tensor again


def test_document_ids_edited_in_place_between_calls_rebuild_the_block_mask():
    q, k, v = _qkv(3)
    ids = (torch.arange(S) // 20).to(torch.int32)
    _check(q, k, v, None, mods.document(ids))
    _check(q, k, v, None, mods.document(ids))
    ids[:] = (torch.arange(S) // 7).to(torch.int32)   # new documents, same tensor
    _check(q, k, v, None, mods.document(ids))
    _check(q, k, v, None, mods.document(ids))
    assert block_masks.stats()["built"] == 2
    assert direct.stats()["equal_hits"] == 2


def test_mods_that_cannot_be_keyed_take_the_full_path_every_call():
    class Softcap:
        def __call__(self, score, b, h, q_idx, kv_idx):
            return 5.0 * torch.tanh(score / 5.0)

    def window(b, h, q_idx, kv_idx, size):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < size)

    q, k, v = _qkv(4)
    for size in (16, 16, 40):
        _check(q, k, v, Softcap(), functools.partial(window, size=size))
    assert direct.stats() == {"remembered": 0, "equal_hits": 0, "keys": 0}


def test_scale_and_lse_of_a_replay():
    q, k, v = _qkv(5)
    for _ in range(2):
        with torch.no_grad():
            out, lse = fa3_inductor.flex(q, k, v, score_mod=mods.softcap(3.0), scale=0.5,
                                         return_lse=True)
        ref, ref_lse = reference_attention(q, k, v, mods.softcap(3.0), None, scale=0.5)
        assert_matches_reference(out, ref, torch.float32)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=0)
    assert direct.stats()["equal_hits"] == 1


def test_a_remembered_call_puts_no_finalizer_on_a_cached_block_mask(monkeypatch):
    """Only a block mask the caller passes is held weakly: the one flex() caches for a mask_mod
    outlives the memo's entries, and a finalizer per remembered call on it piled up unfreed."""
    made = []
    real = direct.weakref.finalize
    monkeypatch.setattr(direct.weakref, "finalize", lambda *args: made.append(real(*args)))
    q, k, v = _qkv(6)
    _check(q, k, v, None, mods.causal)
    _check(q, k, v, None, mods.sliding_window(8))
    assert made == [] and direct.stats()["remembered"] == 2
