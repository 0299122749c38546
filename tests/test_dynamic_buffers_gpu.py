"""tests/test_dynamic_buffers.py on a GPU: a padding mask read by the mask_mod, recompiled at a new
length (one dynamic dimension: the buffer laid out length-outermost) and at a new batch and length
(two: its row stride read at run time), served by the decode family (one new token) and the Hopper
kernel (a prefill) in bf16, against float64."""

from __future__ import annotations

import pytest
import torch

import fa3_inductor
from reference import assert_matches_reference, reference_attention

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_compiles")]


@pytest.mark.parametrize("query_len,family", [(1, "decode"), (256, "hopper")])
def test_recompiled_padding_masks_run_our_kernels(query_len, family):
    def attention(q, k, v, pad):
        def mask(b, h, q_idx, kv_idx):
            return pad[b, kv_idx]
        return fa3_inductor.flex(q, k, v, mask_mod=mask, enable_gqa=True)

    compiled = torch.compile(attention, backend="inductor")
    lowered = []
    for batch, length in ((2, 1024), (2, 1536), (3, 1280)):   # then length, then batch and length
        q = torch.randn(batch, 8, query_len, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, 2, length, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        pad = torch.rand(batch, length, device="cuda") > 0.3
        pad[:, 0] = True
        fa3_inductor.clear_lowered_sites()
        out = compiled(q, k, v, pad)
        lowered += fa3_inductor.lowered_sites()
        ref, _ = reference_attention(q, k, v, None, lambda b, h, qi, kv: pad[b, kv])
        assert_matches_reference(out, ref, torch.bfloat16)
    symbolic = [s for s in lowered if " s" in s["shape"] or "[s" in s["shape"]]
    assert symbolic and all(s["template"] == family for s in symbolic), lowered
