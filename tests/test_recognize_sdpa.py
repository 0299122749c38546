"""Recognition of F.scaled_dot_product_attention calls under backend="fa3" (CPU interpreter)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import fa3_inductor
from reference import assert_matches_reference, reference_attention


pytestmark = pytest.mark.usefixtures("cpu_kernels", "fresh_compiles")


def _qkv(hq=4, hkv=4, m=96, n=96, d=16):
    return (torch.randn(2, hq, m, d, dtype=torch.float16),
            torch.randn(2, hkv, n, d, dtype=torch.float16),
            torch.randn(2, hkv, n, d, dtype=torch.float16))


@pytest.mark.parametrize("is_causal, scale, gqa", [(True, None, False), (False, 0.3, False),
                                                  (True, None, True)])
def test_sdpa_is_served_by_our_kernel(is_causal, scale, gqa):
    q, k, v = _qkv(hkv=2 if gqa else 4)

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
                                              enable_gqa=gqa)

    with torch.no_grad():
        out = torch.compile(attention, backend="fa3")(q, k, v)
    assert [s["template"] for s in fa3_inductor.lowered_sites()] == ["generic"]
    mask = (lambda b, h, qi, ki: qi >= ki) if is_causal else None
    ref, _ = reference_attention(q, k, v, None, mask, scale=scale)
    assert_matches_reference(out, ref, torch.float16)


def test_one_kv_head_broadcasts_without_enable_gqa():
    """SDPA broadcasts a single kv head over the query heads (Gemma 3n's vision attention); two kv
    heads against four query heads without enable_gqa is an error in SDPA and stays as written."""
    q, k, v = _qkv(hkv=1)
    with torch.no_grad():
        out = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                            backend="fa3")(q, k, v)
    assert [s["template"] for s in fa3_inductor.lowered_sites()] == ["generic"]
    ref, _ = reference_attention(q, k, v, None, lambda b, h, qi, ki: qi >= ki)
    assert_matches_reference(out, ref, torch.float16)


def test_cross_attention_lengths():
    q, k, v = _qkv(m=40, n=130)
    with torch.no_grad():
        out = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                            backend="fa3")(q, k, v)
    assert fa3_inductor.lowered_sites()[0]["template"] == "generic"
    assert_matches_reference(out, reference_attention(q, k, v)[0], torch.float16)


@pytest.mark.parametrize("case, reason", [
    ("dropout", "dropout_p=0.1"),
    ("head_dim", "head dim 12"),
])
def test_unserved_calls_are_left_alone_with_the_reason(case, reason, caplog):
    q, k, v = _qkv(d=12 if case == "head_dim" else 16)
    dropout = 0.1 if case == "dropout" else 0.0

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)

    with caplog.at_level(logging.INFO, logger="fa3_inductor"), torch.no_grad():
        torch.manual_seed(0)
        torch.compile(attention, backend="fa3")(q, k, v)
    assert fa3_inductor.lowered_sites() == []
    assert any(reason in r.message for r in caplog.records), [r.message for r in caplog.records]


def test_recognition_can_be_turned_off():
    q, k, v = _qkv()
    with torch.no_grad():
        torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                      backend="fa3", options={"fa3.recognize": False})(q, k, v)
    assert fa3_inductor.lowered_sites() == []


@pytest.mark.parametrize("shape, causal, training, kept", [
    ([4, 16, 512, 64], True, False, "below"),          # small: SDPA's launch path is faster
    ([1, 16, 8192, 128], True, False, None),           # large inference: ours
    ([1, 16, 8192, 128], True, True, "training"),      # training: SDPA's own backward
    ([2, 16, 8192, 128], False, True, "training"),
])
def test_plain_sdpa_calls_stay_sdpa_where_sdpa_is_faster_on_cuda(shape, causal, training, kept):
    from fa3_inductor.recognition.rewrite_pays import sdpa_keeps_plain_call

    reason = sdpa_keeps_plain_call(torch.device("cuda"), shape, shape[2], causal, training)
    assert (reason is None) if kept is None else (kept in reason and "left to SDPA" in reason)
    # the CPU interpreter path always rewrites (it exists to check our kernel's numerics)
    assert sdpa_keeps_plain_call(torch.device("cpu"), shape, shape[2], causal, training) is None


def test_small_recognized_sites_stay_as_written_on_cuda():
    from types import SimpleNamespace

    from fa3_inductor.recognition.rewrite_pays import MIN_WORK, small_site_reason, unless_small

    def example(device, *shape, requires_grad=False):
        return SimpleNamespace(device=torch.device(device), shape=shape, requires_grad=requires_grad)

    small = (example("cuda", 1, 16, 1024, 128), example("cuda", 1, 16, 1024, 128))
    large = (example("cuda", 1, 16, 2048, 128), example("cuda", 1, 16, 2048, 128))
    assert "stock Inductor is faster" in small_site_reason(*small)
    assert small_site_reason(*large) is None and 16 * 2048 * 2048 * 128 >= MIN_WORK
    # in a training graph the bar is higher (TRAIN_MIN_WORK): B1 T2048 stays as written, B2 T2048 not
    trains = [example("cuda", b, 16, 2048, 128, requires_grad=True) for b in (1, 2)]
    assert "training graph" in small_site_reason(trains[0], trains[0])
    assert small_site_reason(trains[1], trains[1]) is None
    with torch.no_grad():
        assert small_site_reason(trains[0], trains[0]) is None
    assert small_site_reason(example("cpu", 1, 16, 1024, 128), example("cpu", 1, 16, 1024, 128)) is None
    served = unless_small(lambda q, v: None)
    assert served(*small) is not None and served(*large) is None
    assert unless_small(lambda q, v: "dtype")(*large) == "dtype"   # our reason first
