"""flex_decode's call memo (decode_memo.py): a repeated decode call replays its launch without
checks or planning. CPU interpreter (the memo replays through launch_cache.interpreted there),
tiny shapes.

A replay must give the full path's result bit for bit (contiguous, paged with a shuffled table, an
FP8 cache with scales, GQA, bf16 on float32 copies), read the lengths at run time, miss on every
change of the key (shapes, dtypes, strides, aliasing, mods, scale, num_splits, the table's shape,
scratch) but not of seq_lens' or the table's values or return_lse, keep one entry a signature, see
a captured tensor edited in place, and leave every error to the full path.
"""

from __future__ import annotations

import pytest
import torch

import fa3_inductor
from fa3_inductor import decode_memo, flex_decode, mods, quantize_kv
from fa3_inductor.decode import memo_stats
from fa3_inductor.templates.decode import decode_scratch
from test_decode_api import _paged_cache, _reference

B, HQ, HKV, N, D = 2, 4, 2, 32, 16
LENS = (32, 13)


@pytest.fixture(autouse=True)
def _fresh_memo():
    from triton import knobs

    if not knobs.runtime.interpret:
        pytest.skip("replays our kernels on CPU tensors: needs TRITON_INTERPRET=1")
    decode_memo.clear()
    with torch.no_grad():
        yield
    decode_memo.clear()


def _call(seed=0, dtype=torch.float32, paged=False, fp8=False, heads=HQ, n=N, page=8):
    """(q, k_cache, v_cache, options) of one call, its values from ``seed``."""
    torch.manual_seed(seed)
    q = torch.randn(B, heads, 1, D, dtype=dtype)
    lens = torch.tensor(LENS, dtype=torch.int32)
    if paged:
        _, _, k, v, table = _paged_cache(B, HKV, n, D, page, dtype=dtype)
        options = dict(seq_lens=lens, block_table=table)
    else:
        k, v = (torch.randn(B, HKV, n, D, dtype=dtype) for _ in range(2))
        options = dict(seq_lens=lens)
    if fp8:
        k, v, ks, vs = quantize_kv(k.float(), v.float(), "head", paged=paged)
        options.update(k_scale=ks, v_scale=vs)
    return q, k, v, options


def _full_path(q, k, v, **kwargs):
    """The same call with nothing remembered (it is remembered again)."""
    decode_memo.clear()
    return flex_decode(q, k, v, **kwargs)


def _same(a, b):
    """Bit for bit (an LSE's -inf rows included), for a tensor or (out, lse)."""
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


@pytest.mark.parametrize("layout", ["contiguous", "paged", "fp8 paged", "fp8 contiguous", "bf16",
                                    "mha split"])
def test_replay_is_the_full_path_bit_for_bit(layout):
    """First call remembered, a call on other tensors of the same signature replayed: the same
    bits as the full path on those tensors, LSE included."""
    setup = dict(paged="paged" in layout, fp8="fp8" in layout,
                 dtype=torch.bfloat16 if layout in ("bf16", "fp8 paged") else torch.float32,
                 heads=HKV if layout == "mha split" else HQ)
    kwargs = dict(mask_mod=mods.causal, score_mod=mods.softcap(5.0), return_lse=True,
                  num_splits=3 if layout == "mha split" else None)
    q, k, v, options = _call(0, **setup)
    flex_decode(q, k, v, **options, **kwargs)
    assert memo_stats() == {"remembered": 1, "hits": 0, "equal_hits": 0}
    q2, k2, v2, options2 = _call(1, **setup)
    out, lse = flex_decode(q2, k2, v2, **options2, **kwargs)
    assert memo_stats()["hits"] == 1 and fa3_inductor.last_template() == "decode"
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert _same((out, lse), _full_path(q2, k2, v2, **options2, **kwargs))


def test_lengths_are_read_at_run_time():
    """seq_lens' values are not keyed: new lengths (a new tensor, or the same one edited in place,
    as a CUDA graph replays) give the full path's result for them."""
    q, k, v, options = _call(2, paged=True)
    lens = options.pop("seq_lens")
    first = flex_decode(q, k, v, seq_lens=lens, **options)
    for new in ([5, 32], [1, 0]):
        lens.copy_(torch.tensor(new))
        out = flex_decode(q, k, v, seq_lens=lens, **options)
        assert memo_stats()["hits"] == 1   # replayed (the full path below clears the counters)
        assert _same(out, _full_path(q, k, v, seq_lens=lens.clone(), **options))
        assert not torch.equal(out, first)
    flex_decode(q, k, v, seq_lens=torch.tensor([20, 7], dtype=torch.int32), **options)
    assert memo_stats() == {"remembered": 1, "hits": 1, "equal_hits": 0}


def test_paged_lengths_against_float64():
    """A replayed paged call at new lengths matches float64 attention (not just the full path)."""
    k, v, kp, vp, table = _paged_cache(B, HKV, N, D, 8)
    q = torch.randn(B, HQ, 1, D)
    flex_decode(q, kp, vp, seq_lens=torch.tensor([32, 32], dtype=torch.int32), block_table=table)
    lens = torch.tensor([27, 9], dtype=torch.int32)
    out = flex_decode(q, kp, vp, seq_lens=lens, block_table=table)
    assert memo_stats()["hits"] == 1
    ref, _ = _reference(q, k, v, lens, lens - 1)
    torch.testing.assert_close(out, ref.float(), atol=2e-5, rtol=2e-5)


def _changed(change, q, k, v, options, kwargs):
    """The call ``change`` names, from the remembered one."""
    options, kwargs = dict(options), dict(kwargs)
    if change == "batch":
        q, k, v = q[:1], k[:1], v[:1]
        options["seq_lens"] = options["seq_lens"][:1]
    elif change == "capacity":
        k, v = torch.cat([k, k], dim=2), torch.cat([v, v], dim=2)
    elif change == "dtype":
        q, k, v = q.half(), k.half(), v.half()
    elif change == "stride":
        k = torch.randn(B, N, HKV, D).transpose(1, 2)
    elif change == "k is v":
        v = k
    elif change == "q_offset":
        options["q_offset"] = options["seq_lens"] - 1
    elif change == "mod":
        kwargs["mask_mod"] = mods.sliding_window(4)
    elif change == "no mod":
        kwargs.pop("mask_mod")
    elif change == "scale":
        kwargs["scale"] = 0.5
    elif change == "num_splits":
        kwargs["num_splits"] = 2
    elif change == "scratch":
        kwargs["num_splits"] = 1
        kwargs["scratch"] = decode_scratch(q, HKV, D, 1)
    return q, k, v, options, kwargs


@pytest.mark.parametrize("change", ["batch", "capacity", "dtype", "stride", "k is v", "q_offset",
                                    "mod", "no mod", "scale", "num_splits", "scratch"])
def test_a_changed_call_misses(change):
    q, k, v, options = _call(3)
    kwargs = dict(mask_mod=mods.causal, num_splits=1)
    flex_decode(q, k, v, **options, **kwargs)
    flex_decode(q, k, v, **options, **kwargs)
    assert memo_stats() == {"remembered": 1, "hits": 1, "equal_hits": 0}
    q2, k2, v2, options2, kwargs2 = _changed(change, q, k, v, options, kwargs)
    out = flex_decode(q2, k2, v2, **options2, **kwargs2)
    assert memo_stats() == {"remembered": 2, "hits": 1, "equal_hits": 0}
    assert _same(out, _full_path(q2, k2, v2, **options2, **kwargs2))


def test_paged_table_shape_and_fp8_scales_miss():
    q, k, v, options = _call(4, paged=True, fp8=True)
    flex_decode(q, k, v, **options)
    table = options["block_table"]
    wider = torch.cat([table, table[:, :1]], dim=1)   # one more page a row: another capacity
    flex_decode(q, k, v, **dict(options, block_table=wider))
    ks, vs = options["k_scale"], options["v_scale"]
    flex_decode(q, k, v, **dict(options, k_scale=ks.amax(), v_scale=vs.amax()))   # per tensor
    assert memo_stats() == {"remembered": 3, "hits": 0, "equal_hits": 0}
    # the table's values are not keyed: another page order replays
    flex_decode(q, k, v, **dict(options, block_table=table.flip(1).contiguous()))
    assert memo_stats()["hits"] == 1


def test_return_lse_and_scratch_replay():
    """return_lse is not keyed (the launch writes the LSE either way); a caller's scratch of the
    remembered signature replays with it."""
    q, k, v, options = _call(5)
    scratch = decode_scratch(q, HKV, D, 3)
    out = flex_decode(q, k, v, **options, num_splits=3, scratch=scratch)
    out2, lse = flex_decode(q, k, v, **options, num_splits=3, scratch=decode_scratch(q, HKV, D, 3),
                            return_lse=True)
    assert memo_stats() == {"remembered": 1, "hits": 1, "equal_hits": 0}
    assert torch.equal(out, out2)
    assert _same(lse, _full_path(q, k, v, **options, num_splits=3, scratch=scratch, return_lse=True)[1])


def test_mods_made_anew_replay_by_what_they_compute():
    q, k, v, options = _call(6)
    outs = [flex_decode(q, k, v, **options, score_mod=mods.softcap(4.0),
                        mask_mod=mods.sliding_window(8)) for _ in range(3)]
    assert memo_stats() == {"remembered": 1, "hits": 2, "equal_hits": 2}
    assert all(torch.equal(o, outs[0]) for o in outs)
    flex_decode(q, k, v, **options, score_mod=mods.softcap(3.0), mask_mod=mods.sliding_window(8))
    assert memo_stats()["remembered"] == 2


def test_captured_tensors_edited_in_place_or_rebound():
    """A mask's captured tensor is a kernel buffer, read at run time: edited in place, the replay
    (still a hit) computes with its new values. A rebound closure cell misses; so does a buffer
    whose layout changed in place."""
    q, k, v, options = _call(7)
    limit = torch.tensor([20, 5], dtype=torch.int32)

    def below(b, h, q_idx, kv_idx):
        return kv_idx < limit[b]

    first = flex_decode(q, k, v, **options, mask_mod=below)
    limit[0] = 3
    edited = flex_decode(q, k, v, **options, mask_mod=below)
    assert memo_stats()["hits"] == 1 and not torch.equal(edited, first)
    assert _same(edited, _full_path(q, k, v, **options, mask_mod=below))

    window = 6
    captured = torch.tensor([1.0, 2.0, 3.0, 4.0])

    def score(s, b, h, q_idx, kv_idx):
        return torch.where(kv_idx < window, s * captured[h], s)

    decode_memo.clear()
    flex_decode(q, k, v, **options, score_mod=score)
    window = 9   # a rebound cell
    rebound = flex_decode(q, k, v, **options, score_mod=score)
    assert memo_stats() == {"remembered": 2, "hits": 0, "equal_hits": 0}
    assert _same(rebound, _full_path(q, k, v, **options, score_mod=score))
    # the same values at stride 2: the generated code reads it otherwise
    captured.set_(torch.zeros(8).untyped_storage(), 0, (4,), (2,))
    captured.copy_(torch.tensor([4.0, 3.0, 2.0, 1.0]))
    relaid = flex_decode(q, k, v, **options, score_mod=score)
    assert memo_stats() == {"remembered": 2, "hits": 0, "equal_hits": 0}
    assert _same(relaid, _full_path(q, k, v, **options, score_mod=score))


def test_grad_still_raises_and_the_gather_is_not_remembered():
    q, k, v, options = _call(8)
    flex_decode(q, k, v, **options)
    with torch.enable_grad(), pytest.raises(NotImplementedError, match="inference-only"):
        flex_decode(q.clone().requires_grad_(), k, v, **options)
    flex_decode(q.clone().requires_grad_(), k, v, **options)   # no_grad: served, replayed
    assert memo_stats()["hits"] == 1
    # 8 heads per kv head x 20 tokens = 160 rows: the gather and flex(), never remembered here
    long_q = torch.randn(B, 16, 20, D)
    flex_decode(long_q, k, v, **options)
    flex_decode(long_q, k, v, **options)
    assert memo_stats()["remembered"] == 1 and fa3_inductor.last_template() != "decode"


def test_invalid_options_keep_their_errors():
    """Options the key cannot tell from valid ones (True == 1) take the full path, which raises."""
    q, k, v, options = _call(9)
    flex_decode(q, k, v, **options, scale=1, num_splits=1)
    with pytest.raises(TypeError, match="scale must be a number"):
        flex_decode(q, k, v, **options, scale=True, num_splits=1)
    with pytest.raises(ValueError, match="num_splits=True"):
        flex_decode(q, k, v, **options, scale=1, num_splits=True)
    with pytest.raises(TypeError, match="mask_mod must be callable"):
        flex_decode(q, k, v, **options, scale=1, num_splits=1, mask_mod=1)
    assert memo_stats()["hits"] == 0


def test_signatures_taking_turns_keep_their_entries():
    """Layers of two layouts (or one cache tensor for K and V, then two) with the same mods: one
    entry each, so alternating calls all replay after the first of each."""
    q, k, v, options = _call(10)
    qp, kp, vp, paged = _call(10, paged=True)
    calls = [lambda: flex_decode(q, k, k, **options), lambda: flex_decode(q, k, v, **options),
             lambda: flex_decode(qp, kp, vp, **paged)]
    first = [call() for call in calls]
    assert memo_stats() == {"remembered": 3, "hits": 0, "equal_hits": 0}
    for _ in range(2):
        assert all(torch.equal(call(), want) for call, want in zip(calls, first))
    assert memo_stats() == {"remembered": 3, "hits": 6, "equal_hits": 0}
    assert not torch.equal(first[0], first[1])   # k as V is not v
