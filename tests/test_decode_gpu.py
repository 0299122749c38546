"""The decode family and flex_decode on a GPU (the lead runs these on an H100): the family chosen
for short queries, paged equal to contiguous (any page size), 128 packed rows (8 warps), and
CUDA-graph replays with the cache lengths (flex_decode) or the cache (flex) changed in place, no
recapture; flex_decode's call memo replaying without checks or planning; prefill chunks through the
Hopper cache mode (pages of 16-256, NaN in unwritten slots, mods, an FP8 cache, a CUDA graph). bf16;
float64 references. About 2 minutes on an H200, most of it compiling."""

from __future__ import annotations

import pytest
import torch

import fa3_inductor
from fa3_inductor import flex_decode, mods
from reference import assert_lse_matches, assert_matches_reference, reference_attention

pytestmark = pytest.mark.gpu


def _paged(k, v, page):
    """k, v [B, H, N, D] (N a multiple of page) as shuffled pages among spare ones of noise."""
    B, H, N, D = k.shape
    per = N // page
    order = torch.randperm(B * per + 7, device=k.device)[:B * per]
    pools = []
    for t in (k, v):
        pool = torch.randn(B * per + 7, page, H, D, dtype=t.dtype, device=t.device)
        pool[order] = t.view(B, H, per, page, D).permute(0, 2, 3, 1, 4).reshape(-1, page, H, D)
        pools.append(pool)
    return pools[0], pools[1], order.view(B, per).to(torch.int32)


def _reference(q, k, v, lens):
    """Every new token sees its batch's first lens[b] keys."""
    outs = []
    for b, L in enumerate(lens.tolist()):
        outs.append(reference_attention(q[b:b + 1], k[b:b + 1, :, :L], v[b:b + 1, :, :L])[0])
    return torch.cat(outs)


def _randn(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def test_flex_short_query_runs_the_decode_family():
    q, k, v = _randn(4, 32, 1, 128), _randn(4, 8, 4096, 128), _randn(4, 8, 4096, 128)
    out = fa3_inductor.flex(q, k, v, enable_gqa=True)
    assert fa3_inductor.last_template() == "decode"
    assert_matches_reference(out, reference_attention(q, k, v)[0], torch.bfloat16)
    window = mods.sliding_window(1000)   # q_idx 0 (flex's positions): key 0 only
    out = fa3_inductor.flex(q, k, v, enable_gqa=True, mask_mod=window)
    assert fa3_inductor.last_template() == "decode"
    assert_matches_reference(out, reference_attention(q, k, v, mask_mod=window)[0], torch.bfloat16)


@pytest.mark.parametrize("page", [64, 16, 24])
def test_paged_equals_contiguous(page):
    """Same tiles and split count for both layouts, so bit-equal; page 16 and 24: tiles of 64 keys
    span several pages (24 does not divide a tile). The planner's split counts differ (a paged cache
    runs two programs per SM, templates/decode/configs.py), so both are given the same one; the
    planner's own paged choice is checked against float64."""
    B, N = 3, 7680   # a multiple of 64, 16 and 24
    q, k, v = _randn(B, 32, 2, 128), _randn(B, 8, N, 128), _randn(B, 8, N, 128)
    kp, vp, table = _paged(k, v, page)
    lens = torch.tensor([N, 5000, 17], dtype=torch.int32, device="cuda")
    out_c = flex_decode(q, k, v, seq_lens=lens, num_splits=6)
    out_p = flex_decode(q, kp, vp, seq_lens=lens, block_table=table, num_splits=6)
    torch.testing.assert_close(out_p, out_c, atol=0, rtol=0)
    planned = flex_decode(q, kp, vp, seq_lens=lens, block_table=table)
    assert_matches_reference(planned, _reference(q, k, v, lens), torch.bfloat16)


@pytest.mark.parametrize("D, page", [(128, 0), (128, 64), (64, 0), (64, 64)])
def test_tma_tiles_equal_pointer_tiles(D, page):
    """Whole tiles by TMA (DecodeConfig.tma) give the pointer loads' result bit for bit (same tiles,
    same splits); slots past each length hold NaN, which neither reads; a score_mod applies."""
    import dataclasses

    from fa3_inductor.templates.decode import decode_attention
    from fa3_inductor.templates.decode.configs import decode_config
    from fa3_inductor.templates.modgen import generate_mod_source, load_mod, trace_mod

    gm, _ = trace_mod(mods.softcap(20.0), "score")
    softcap = load_mod(generate_mod_source(gm, "score", []))

    B, N = 3, 4096
    q, k, v = _randn(B, 32, 1, D), _randn(B, 8, N, D), _randn(B, 8, N, D)
    lens = torch.tensor([N, 3001, 64], dtype=torch.int32, device="cuda")
    ref = _reference(q, k, v, lens)
    extra = {}
    if page:
        k, v, table = _paged(k, v, page)
        extra = dict(block_table=table)
    else:
        for b, L in enumerate(lens.tolist()):
            k[b, :, L:] = float("nan")
            v[b, :, L:] = float("nan")
    cfg = decode_config(D, (9, 0), paged=page > 0)
    block_n = 64 if page else cfg.block_n   # pages of 64 hold whole tiles
    base = dataclasses.replace(cfg, block_n=block_n)
    outs = [decode_attention(q, k, v, seq_lens=lens, num_splits=5, config=dataclasses.replace(base, tma=t),
                             score_mod=soft, **extra)[0]
            for t in (False, True) for soft in (None, softcap)]
    torch.testing.assert_close(outs[2], outs[0], atol=0, rtol=0)
    torch.testing.assert_close(outs[3], outs[1], atol=0, rtol=0)
    assert_matches_reference(outs[2], ref, torch.bfloat16)


@pytest.mark.parametrize("B, HKV, N", [(64, 8, 1024), (2, 8, 4096)])
def test_planned_tma_tiles_match_float64(B, HKV, N):
    """The plan configs.tma_tiles picks (GQA D64: 256-key tiles by TMA), through flex_decode, with
    ragged lengths whose last tiles are partial; one split and several."""
    D = 64
    from fa3_inductor.templates.decode import prepare_decode

    q, k, v = _randn(B, 4 * HKV, 1, D), _randn(B, HKV, N, D), _randn(B, HKV, N, D)
    lens = torch.randint(N // 2, N + 1, (B,), dtype=torch.int32, device="cuda")
    [(_, _, kwargs, _)] = prepare_decode(q, k, v, torch.empty_like(q), torch.empty(q.shape[:3], device="cuda"),
                                         sm_scale=D ** -0.5, seq_lens=lens)
    assert kwargs["CACHE"].TMA
    out = flex_decode(q, k, v, seq_lens=lens)
    assert_matches_reference(out, _reference(q, k, v, lens), torch.bfloat16)


def test_tma_plan_replays_through_the_memo_and_a_cuda_graph():
    """The GQA D64 TMA plan (host descriptors) on the paths that re-launch a recording: flex_decode's memo
    on new tensors, flex()'s op re-launch, and a captured flex_decode step replayed with new lengths."""
    B, N = 4, 8192
    q, k, v = _randn(B, 32, 1, 64), _randn(B, 8, N, 64), _randn(B, 8, N, 64)
    lens = torch.tensor([N, 3000, 77, 5000], dtype=torch.int32, device="cuda")
    for _ in range(3):   # the first call plans; the others replay on new tensors
        q, k, v = _randn(*q.shape), _randn(*k.shape), _randn(*v.shape)
        assert_matches_reference(flex_decode(q, k, v, seq_lens=lens), _reference(q, k, v, lens), torch.bfloat16)
        out = fa3_inductor.flex(q, k, v, enable_gqa=True)
        assert fa3_inductor.last_template() == "decode"
        assert_matches_reference(out, reference_attention(q, k, v)[0], torch.bfloat16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flex_decode(q, k, v, seq_lens=lens)
    for new in ([100, 200, 8192, 1], [7000, 12, 4096, 4097]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(out, _reference(q, k, v, lens), torch.bfloat16)


def test_128_packed_rows():
    """GQA 32 x 4 speculative tokens = 128 rows in one program (8 warps), split, causal."""
    q, k, v = _randn(2, 32, 4, 128), _randn(2, 1, 3000, 128), _randn(2, 1, 3000, 128)
    lens = torch.tensor([3000, 1234], dtype=torch.int32, device="cuda")
    out = flex_decode(q, k, v, seq_lens=lens, mask_mod=mods.causal)
    for b, L in enumerate(lens.tolist()):
        def causal_at_end(bb, h, q_idx, kv_idx, L=L):   # new tokens are the cache's last 4
            return kv_idx <= q_idx + L - 4
        ref, _ = reference_attention(q[b:b + 1], k[b:b + 1, :, :L], v[b:b + 1, :, :L],
                                     mask_mod=causal_at_end)
        assert_matches_reference(out[b:b + 1], ref, torch.bfloat16)


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_cuda_graph_replays_with_changed_lengths(paged):
    B, N = 2, 16384
    q, k, v = _randn(B, 32, 1, 128), _randn(B, 8, N, 128), _randn(B, 8, N, 128)
    cache = _paged(k, v, 256) if paged else (k, v, None)
    lens = torch.tensor([100, 200], dtype=torch.int32, device="cuda")

    def step():
        return flex_decode(q, cache[0], cache[1], seq_lens=lens, block_table=cache[2])

    for _ in range(2):   # warm-up: compile, plan, record the launches
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for new in ([100, 200], [16384, 1], [7000, 12345]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(out, _reference(q, k, v, lens), torch.bfloat16)


def test_flex_decode_step_in_a_cuda_graph():
    """fa3_inductor.flex with a short query (the decode family) captured, then replayed after the
    cache and the query change in place."""
    q, k, v = _randn(4, 32, 1, 128), _randn(4, 8, 8192, 128), _randn(4, 8, 8192, 128)
    for _ in range(2):
        fa3_inductor.flex(q, k, v, enable_gqa=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fa3_inductor.flex(q, k, v, enable_gqa=True)
    for _ in range(2):
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(out, reference_attention(q, k, v)[0], torch.bfloat16)


@pytest.mark.parametrize("kv_len", [256, 4096])   # one split, and several
def test_flex_in_a_reduce_overhead_compile_of_stock_inductor(kv_len):
    """transformers' generate() compiles a static-cache decode step with backend="inductor",
    mode="reduce-overhead": cudagraph trees refuse a pool tensor kept past a call, which the
    kernels' one-element placeholders were (templates/placeholder.py)."""
    q, k, v = _randn(2, 8, 1, 128), _randn(2, 2, kv_len, 128), _randn(2, 2, kv_len, 128)
    step = torch.compile(lambda q, k, v: fa3_inductor.flex(q, k, v, enable_gqa=True),
                         backend="inductor", mode="reduce-overhead")
    for _ in range(4):   # warm-up runs, the recording, replays
        k.add_(0.01)
        out = step(q, k, v)
        assert_matches_reference(out, reference_attention(q, k, v)[0], torch.bfloat16)
    assert fa3_inductor.lowered_sites()[-1]["template"] == "decode"


def test_flex_decode_calls_after_the_first_skip_the_family_walk(monkeypatch):
    """After the first flex() call of a launch signature, the decode family's recording is
    re-launched: through the call memo (same mod object, new tensors) and through the op (a new
    mod object each call: the memo misses, the op's key hits). Neither plans or walks the
    families again (both are made to fail), and each result matches float64."""
    from fa3_inductor.templates.decode import family as decode_family

    q, k, v = _randn(4, 32, 1, 128), _randn(4, 8, 4096, 128), _randn(4, 8, 4096, 128)
    fa3_inductor.flex(q, k, v, enable_gqa=True, score_mod=mods.softcap(30.0))
    assert fa3_inductor.last_template() == "decode"

    def planned_again(*args, **kwargs):
        raise AssertionError("the decode family was walked or planned again")
    monkeypatch.setattr(decode_family.DecodeFamily, "launch", planned_again)
    monkeypatch.setattr(decode_family.DecodeFamily, "_plan", planned_again)
    memo_mod = mods.softcap(30.0)
    for fresh_mod in (False, True, False, True):
        q, k, v = _randn(*q.shape), _randn(*k.shape), _randn(*v.shape)
        out = fa3_inductor.flex(q, k, v, enable_gqa=True,
                                score_mod=mods.softcap(30.0) if fresh_mod else memo_mod)
        assert fa3_inductor.last_template() == "decode"
        assert_matches_reference(out, reference_attention(q, k, v, mods.softcap(30.0))[0], torch.bfloat16)


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_flex_decode_memo_replays_without_checks_or_planning(paged, monkeypatch):
    """flex_decode's call memo (decode_memo.py) on CUDA: after a first call, calls on new tensors of
    its signature at new lengths replay the recorded launch (the checks, the mods' generation, the
    launch key and the planning are made to fail), each the full path's result bit for bit."""
    from fa3_inductor import decode, decode_memo

    B, N = 3, 4096
    window = mods.sliding_window(3000)

    def inputs(seed):
        torch.manual_seed(seed)
        q, k, v = _randn(B, 32, 1, 128), _randn(B, 8, N, 128), _randn(B, 8, N, 128)
        cache = _paged(k, v, 64) if paged else (k, v, None)
        lens = torch.randint(1, N + 1, (B,), dtype=torch.int32, device="cuda")
        return q, cache, lens

    def call(q, cache, lens):
        return flex_decode(q, cache[0], cache[1], seq_lens=lens, block_table=cache[2], mask_mod=window)

    cases = [inputs(seed) for seed in range(4)]
    full = []
    for case in cases:
        decode_memo.clear()
        full.append(call(*case))
    decode_memo.clear()
    call(*inputs(9))

    def again(*args, **kwargs):
        raise AssertionError("flex_decode checked or planned a remembered call again")
    for name in ("_check", "generated_mod", "prepare_decode", "launch_decode"):
        monkeypatch.setattr(decode, name, again)
    for case, want in zip(cases, full):
        torch.testing.assert_close(call(*case), want, atol=0, rtol=0)
        assert fa3_inductor.last_template() == "decode"
    assert decode.memo_stats() == {"remembered": 1, "hits": 4, "equal_hits": 0}


def _fp8_real(cache8, scale, table):
    """An FP8 cache's real values (FP8 x scale) in float64 as [B, HKV, N, D]: per kv head scales on
    a contiguous cache, per page scales gathered through the table."""
    if table is None:
        return cache8.double() * scale.double().view(1, -1, 1, 1)
    real = cache8.double() * scale.double().view(scale.shape[0], 1, -1, 1)
    B = table.shape[0]
    return real[table.long()].reshape(B, -1, *real.shape[2:]).transpose(1, 2)


@pytest.mark.parametrize("page", [0, 64, 16], ids=["contiguous", "pages64", "pages16"])
def test_fp8_cache_matches_float64(page):
    """flex_decode over an e4m3 cache (per kv head scales contiguous, per page scales paged; pages of
    16 put four pages in a 64-key tile: per-key scale rows) against float64 on the dequantized
    cache, bf16's tolerance; ragged lengths with 0 and 1; then a CUDA graph replays it with the
    lengths and the scales changed in place (both read by the kernel only)."""
    B, N = 4, 7680
    q, k, v = _randn(B, 32, 1, 128), _randn(B, 8, N, 128), _randn(B, 8, N, 128)
    table = None
    if page:
        k, v, table = _paged(k, v, page)
    k8, v8, ks, vs = fa3_inductor.quantize_kv(k, v, "page" if page else "head", paged=page > 0)
    lens = torch.tensor([N, 5000, 1, 0], dtype=torch.int32, device="cuda")

    def step():
        return flex_decode(q, k8, v8, seq_lens=lens, block_table=table, k_scale=ks, v_scale=vs)

    def check(out):
        assert_matches_reference(out[:3], _reference(q[:3], _fp8_real(k8, ks, table), _fp8_real(v8, vs, table),
                                                     lens[:3]), torch.bfloat16)
        assert torch.all(out[3] == 0)

    check(step())
    assert fa3_inductor.last_template() == "decode"
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for new in ([17, N, 4000, 0], [N, 1, 0, 64]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        ks.mul_(1.5)
        vs.mul_(0.5)
        graph.replay()
        torch.cuda.synchronize()
        if new[3]:
            ref = _reference(q, _fp8_real(k8, ks, table), _fp8_real(v8, vs, table), lens)
            assert_matches_reference(out, ref, torch.bfloat16)
        else:
            check(out)


@pytest.mark.parametrize("causal", [False, True])
def test_prefill_chunk_on_pages_from_the_lengths(causal):
    """A prefill chunk (8 query heads x 200 new tokens: past the decode kernels) on pages of 64 behind a shuffled table:
    the gathered path with its block mask made from the lengths, one sequence shorter than the chunk; then the
    lengths rewritten in place with no version bump (as a CUDA graph's write) and the chunk run again. float64."""
    B, HQ, HKV, M, N, D = 3, 8, 2, 200, 1024, 64
    q, k, v = _randn(B, HQ, M, D), _randn(B, HKV, N, D), _randn(B, HKV, N, D)
    kp, vp, table = _paged(k, v, 64)
    mask = mods.causal if causal else None
    for lengths in ([1024, 130, 700], [300, 1000, 64]):
        lens = torch.tensor(lengths, dtype=torch.int32, device="cuda") if lengths[0] == 1024 else lens
        if lengths[0] != 1024:
            lens.data.copy_(torch.tensor(lengths, dtype=torch.int32))
        out = flex_decode(q, kp, vp, seq_lens=lens, block_table=table, mask_mod=mask)
        assert fa3_inductor.last_template() != "decode"
        for b, L in enumerate(lengths):
            first = L - M   # the chunk is each sequence's last M positions (some negative: at 0)
            ref, _ = reference_attention(q[b:b + 1], k[b:b + 1, :, :L], v[b:b + 1, :, :L],
                                         mask_mod=(lambda bb, h, qi, ki: (qi + first).clamp_min(0) >= ki)
                                         if causal else None)
            assert_matches_reference(out[b:b + 1], torch.nan_to_num(ref), torch.bfloat16)


def _nan_past_lengths(k, v, kp, vp, table, lens, page):
    """The slots at or past each sequence's length set to NaN (never written: torch.empty may hold anything), in the
    contiguous cache and, with a table, in its pages; pages no sequence lists are NaN too."""
    listed = torch.zeros(kp.shape[0] if kp is not None else 0, dtype=torch.bool, device="cuda")
    for b, L in enumerate(lens.tolist()):
        k[b, :, L:] = v[b, :, L:] = float("nan")
        if kp is not None:
            for j in range(table.shape[1]):
                kp[table[b, j], max(L - page * j, 0):] = vp[table[b, j], max(L - page * j, 0):] = float("nan")
                listed[table[b, j]] = True
    if kp is not None:
        kp[~listed] = vp[~listed] = float("nan")


_CHUNK_MODS = {"none": (None, None), "causal": (None, mods.causal),
               "softcap_causal": (mods.softcap(20.0), mods.causal), "alibi": (mods.alibi(8), None),
               "window300": (None, mods.sliding_window(300)),
               "softcap_window100": (mods.softcap(20.0), mods.sliding_window(100))}


@pytest.mark.parametrize("D, page, mod", [(128, 16, "causal"), (128, 128, "softcap_causal"), (64, 256, "none"),
                                          (96, 64, "causal"), (128, 0, "alibi"), (64, 32, "causal"),
                                          (128, 16, "window300"), (64, 64, "softcap_window100"), (128, 0, "window300")])
def test_prefill_chunk_reads_the_cache_in_place(D, page, mod):
    """A prefill chunk (8 query heads x 200 new tokens) through the Hopper kernel's cache mode: pages of 16-256 keys
    (several a KV tile, or whole tiles) behind a shuffled table, or the contiguous cache (page 0); causal windows walked
    from their far edge (100 keys: less than a tile; 300: the edge cuts a tile); the rows at explicit
    positions (one sequence's partly negative: at 0 for the mods), GQA 8 / 2, the unwritten slots NaN. float64."""
    B, HQ, HKV, M, N = 3, 8, 2, 200, 1024
    score_mod, mask_mod = _CHUNK_MODS[mod]
    q, k, v = _randn(B, HQ, M, D), _randn(B, HKV, N, D), _randn(B, HKV, N, D)
    lens = torch.tensor([1024, 130, 701], dtype=torch.int32, device="cuda")
    first = lens - M - torch.tensor([0, 0, 37], dtype=torch.int32, device="cuda")
    kp, vp, table = _paged(k, v, page) if page else (None, None, None)
    _nan_past_lengths(k, v, kp, vp, table, lens, page)
    cache = (kp, vp) if page else (k, v)
    out, lse = flex_decode(q, *cache, seq_lens=lens, block_table=table, q_offset=first, score_mod=score_mod,
                           mask_mod=mask_mod, return_lse=True)
    assert fa3_inductor.last_template() == "hopper_cache"
    for b, (L, f) in enumerate(zip(lens.tolist(), first.tolist())):
        sm = score_mod and (lambda s, bb, h, qi, ki, f=f: score_mod(s, bb, h, (qi + f).clamp_min(0), ki))
        mm = mask_mod and (lambda bb, h, qi, ki, f=f: mask_mod(bb, h, (qi + f).clamp_min(0), ki))
        ref, ref_lse = reference_attention(q[b:b + 1], k[b:b + 1, :, :L], v[b:b + 1, :, :L], sm, mm)
        assert_matches_reference(out[b:b + 1], torch.nan_to_num(ref), torch.bfloat16)
        assert_lse_matches(lse[b:b + 1], ref_lse, torch.bfloat16)


def test_prefill_chunk_in_a_cuda_graph_with_changed_lengths():
    """The Hopper cache mode captured in a CUDA graph and replayed after the lengths change in place (default
    positions: the chunk is each sequence's last 256 tokens), pages of 16."""
    B, HQ, HKV, M, N, D = 2, 8, 2, 256, 2048, 128
    q, k, v = _randn(B, HQ, M, D), _randn(B, HKV, N, D), _randn(B, HKV, N, D)
    kp, vp, table = _paged(k, v, 16)
    lens = torch.tensor([2048, 300], dtype=torch.int32, device="cuda")

    def step():
        return flex_decode(q, kp, vp, seq_lens=lens, block_table=table, mask_mod=mods.causal)

    for _ in range(2):
        step()
    assert fa3_inductor.last_template() == "hopper_cache"
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for new in ([2048, 300], [256, 1999], [1000, 100]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        for b, L in enumerate(new):
            f = L - M
            ref, _ = reference_attention(q[b:b + 1], k[b:b + 1, :, :L], v[b:b + 1, :, :L],
                                         mask_mod=lambda bb, h, qi, ki, f=f: (qi + f).clamp_min(0) >= ki)
            assert_matches_reference(out[b:b + 1], torch.nan_to_num(ref), torch.bfloat16)


def test_prefill_chunk_on_an_fp8_cache():
    """A prefill chunk (8 query heads x 200 tokens) on e4m3 pages of 16 with per page scales: dequantized to a copy
    in q's dtype, then the Hopper cache mode; against float64 on the dequantized values."""
    B, HQ, HKV, M, N, D = 2, 8, 2, 200, 1024, 128
    q, k, v = _randn(B, HQ, M, D), _randn(B, HKV, N, D), _randn(B, HKV, N, D)
    kp, vp, table = _paged(k, v, 16)
    k8, v8, ks, vs = fa3_inductor.quantize_kv(kp, vp, "page", paged=True)
    lens = torch.tensor([1024, 333], dtype=torch.int32, device="cuda")
    out = flex_decode(q, k8, v8, seq_lens=lens, block_table=table, k_scale=ks, v_scale=vs, mask_mod=mods.causal)
    assert fa3_inductor.last_template() == "hopper_cache"
    kr, vr = _fp8_real(k8, ks, table), _fp8_real(v8, vs, table)
    for b, L in enumerate(lens.tolist()):
        f = L - M
        ref, _ = reference_attention(q[b:b + 1], kr[b:b + 1, :, :L], vr[b:b + 1, :, :L],
                                     mask_mod=lambda bb, h, qi, ki, f=f: (qi + f).clamp_min(0) >= ki)
        assert_matches_reference(out[b:b + 1], ref, torch.bfloat16)


@pytest.mark.parametrize("D, paged", [(64, False), (128, True), (64, True)])
def test_decode_under_a_causal_window_reads_only_its_keys(D, paged):
    """flex_decode with mods.sliding_window(W): the splits share only the keys from the tile holding row 0's window
    edge (GQA D64 contiguous: the TMA tiles). Keys well before the window are NaN, so reading them would show;
    ragged lengths (one shorter than the window), 2 new tokens, against float64."""
    B, HQ, HKV, M, N, W = 3, 32, 8, 2, 8192, 1024
    q, k, v = _randn(B, HQ, M, D), _randn(B, HKV, N, D), _randn(B, HKV, N, D)
    lens = torch.tensor([8192, 5000, 700], dtype=torch.int32, device="cuda")
    cache = _paged(k, v, 64) if paged else (k, v, None)
    for b, L in enumerate(lens.tolist()):
        stale = max(L - M - W - 256, 0)   # below the tile holding row 0's edge
        k[b, :, :stale] = v[b, :, :stale] = float("nan")
        if paged:
            for j in range(stale // 64):
                cache[0][cache[2][b, j]] = cache[1][cache[2][b, j]] = float("nan")
    out = flex_decode(q, cache[0], cache[1], seq_lens=lens, block_table=cache[2], mask_mod=mods.sliding_window(W))
    assert fa3_inductor.last_template() == "decode" and not out.isnan().any()
    for b, L in enumerate(lens.tolist()):
        f = L - M
        ref, _ = reference_attention(q[b:b + 1], k[b:b + 1, :, :L].nan_to_num(), v[b:b + 1, :, :L].nan_to_num(),
                                     mask_mod=lambda bb, h, qi, ki, f=f: (qi + f >= ki) & (qi + f - ki < W))
        assert_matches_reference(out[b:b + 1], ref, torch.bfloat16)
