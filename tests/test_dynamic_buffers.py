"""Captured tensors whose inner size a dynamic recompile made symbolic still run our kernels.

A static KV cache of a new length (a second generate() call with a longer prompt) recompiles the
decode step with the length symbolic, and the padding mask the mask_mod reads, ``pad[b, kv]``,
then has a dynamic inner dimension. The generated mods bake strides in, so the lowering lays such
a buffer out with its dynamic dimension outermost (lowering/common.buffer_order); before, the site
fell back to torch's kernel (56x slower than sdpa at a 32k cache on an H100, examples/generate.py).
"""

from __future__ import annotations

import pytest
import torch

import fa3_inductor
from reference import assert_matches_reference, reference_attention

pytestmark = pytest.mark.usefixtures("cpu_kernels", "fresh_compiles")


def _padding_mask(batch: int, length: int) -> torch.Tensor:
    pad = torch.rand(batch, length) > 0.3
    pad[:, 0] = True   # every row sees a key
    return pad


def _run_two_lengths(query_len: int, lengths: tuple[int, int], batch: int = 3, heads: int = 4,
                     kv_heads: int = 2):
    """Compile once, call at two cache lengths (the second call is the dynamic recompile); per call
    the lowered sites and the output's error against float64."""
    def attention(q, k, v, pad, offset):
        def mask(b, h, q_idx, kv_idx):   # transformers' static-cache mask: an offset tensor
            return pad[b, kv_idx] & (kv_idx <= q_idx + offset)
        return fa3_inductor.flex(q, k, v, mask_mod=mask, enable_gqa=True)

    compiled = torch.compile(attention, backend="inductor")
    results = []
    for length in lengths:
        q = torch.randn(batch, heads, query_len, 16)
        k, v = (torch.randn(batch, kv_heads, length, 16) for _ in range(2))
        pad = _padding_mask(batch, length)
        fa3_inductor.clear_lowered_sites()
        out = compiled(q, k, v, pad, torch.tensor(length - query_len))

        def mask(b, h, q_idx, kv_idx):
            return pad[b, kv_idx] & (kv_idx <= q_idx + length - query_len)
        ref, _ = reference_attention(q, k, v, None, mask)
        results.append((fa3_inductor.lowered_sites(), out, ref))
    return results


# One family per case keeps CI short (each case is three compiles); both families take both cases
# in tests/test_dynamic_buffers_gpu.py.
@pytest.mark.parametrize("query_len,family", [(1, "decode")])
def test_padding_mask_of_a_recompiled_length_runs_our_kernel(query_len, family):
    results = _run_two_lengths(query_len, (40, 72))
    sites = results[1][0]
    assert [s["template"] for s in sites] == [family], sites
    assert "s" in sites[0]["shape"].split("kv[")[1], sites[0]["shape"]   # the length is symbolic
    for _, out, ref in results:
        assert_matches_reference(out, ref, torch.float32)


@pytest.mark.parametrize("query_len,family", [(24, "generic")])
def test_batch_and_length_both_dynamic_read_strides_at_run_time(query_len, family):
    """Batch and length both changed between calls: no order makes the strides static, so the mod
    reads the padding mask's row stride from a 0-d tensor the lowering appends to its buffers."""
    def attention(q, k, v, pad):
        def mask(b, h, q_idx, kv_idx):
            return pad[b, kv_idx]
        return fa3_inductor.flex(q, k, v, mask_mod=mask)

    compiled = torch.compile(attention, backend="inductor")
    lowered = []
    for batch, length in ((2, 40), (3, 72), (4, 56)):
        q = torch.randn(batch, 2, query_len, 16)
        k, v = (torch.randn(batch, 2, length, 16) for _ in range(2))
        pad = _padding_mask(batch, length)
        fa3_inductor.clear_lowered_sites()
        out = compiled(q, k, v, pad)
        lowered += fa3_inductor.lowered_sites()
        ref, _ = reference_attention(q, k, v, None, lambda b, h, qi, kv: pad[b, kv])
        assert_matches_reference(out, ref, torch.float32)
    dynamic = [s for s in lowered if s["shape"].startswith("q[s")]   # batch and length symbolic
    assert dynamic and all(s["template"] == family for s in dynamic), lowered
    assert all("tl.load(bufs[1])" in s["mask_mod"] for s in dynamic), dynamic   # the run-time stride


def test_torch_dialect_reads_a_reordered_buffer_through_its_strides():
    """The last-resort torch family gets the buffer as the kernels do (length outermost): its
    generated mod must read ``pad[b, kv]`` at the same element, through the spec's strides."""
    from fa3_inductor.templates.modgen import BufferSpec, trace_mod
    from fa3_inductor.templates.modgen_torch import generate_torch_mod_source, load_torch_mod

    pad = _padding_mask(3, 40)
    gm, _ = trace_mod(lambda b, h, q_idx, kv_idx: pad[b, kv_idx], "mask")
    spec = BufferSpec((3, -1), (1, 3), torch.bool, permuted=True)   # [N, B] contiguous
    mask = load_torch_mod(generate_torch_mod_source(gm, "mask", [spec]))
    b, kv = torch.arange(3).view(3, 1, 1, 1), torch.arange(40).view(1, 1, 1, 40)
    got = mask(b, torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.zeros(1, 1, 1, 1, dtype=torch.long), kv,
               (pad.t().contiguous(),))
    assert torch.equal(got.expand(3, 1, 1, 40), pad.view(3, 1, 1, 40))
