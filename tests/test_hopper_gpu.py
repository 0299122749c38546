"""Numerics of the sm90 Gluon FA3-structure forward kernel against a float64 reference (GPU only).

Every check draws fresh random inputs, poisons the outputs (NaN) before the launch, and compares
‖out − ref‖/‖ref‖ (≤ 1e-2 bf16, ≤ 5e-3 fp16) plus LSE / max (log2 units; -inf on fully masked rows).
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu


def _is_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


if not _is_sm90():
    pytest.skip("needs an sm90 (Hopper) CUDA GPU", allow_module_level=True)

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402

from fa3_inductor.templates.hopper import get_config, launch_fwd_sm90, supports_sm90  # noqa: E402

LN2 = math.log(2.0)
SOFTCAP = 5.0
WINDOW = 200


# ---------------------------------------------------------------- hand-written Gluon mods
@gluon.jit
def causal_mask(b, h, q_idx, kv_idx, bufs):
    return q_idx >= kv_idx


@gluon.jit
def sliding_window_mask(b, h, q_idx, kv_idx, bufs):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 200)


@gluon.jit
def holes_causal_mask(b, h, q_idx, kv_idx, bufs):
    # every 7th query row is fully masked
    return (q_idx >= kv_idx) & (q_idx % 7 != 3)


@gluon.jit
def document_mask(b, h, q_idx, kv_idx, bufs):
    # bufs[0]: int32 document id per position (same sequence for q and kv)
    return gl.load(bufs[0] + q_idx) == gl.load(bufs[0] + kv_idx)


@gluon.jit
def _tanh(x):
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def softcap_mod(qk, sm_scale, b, h, q_idx, kv_idx, bufs):
    score = qk * sm_scale
    return 5.0 * _tanh(score * 0.2)


@gluon.jit
def alibi_mod(qk, sm_scale, b, h, q_idx, kv_idx, bufs):
    score = qk * sm_scale
    slope = gl.exp2(-(h + 1).to(gl.float32) * 0.5)
    return score + (kv_idx - q_idx).to(gl.float32) * slope


@gluon.jit
def head_bias_mod(qk, sm_scale, b, h, q_idx, kv_idx, bufs):
    score = qk * sm_scale
    return score + gl.load(bufs[0] + h)


# ---------------------------------------------------------------- float64 reference
def _ref_score_mod(name, s, h_idx, q_idx, kv_idx, bias=None):
    if name is None:
        return s
    if name == "softcap":
        return SOFTCAP * torch.tanh(s / SOFTCAP)
    if name == "alibi":
        slope = torch.exp2(-(h_idx + 1).double() * 0.5)
        return s + (kv_idx - q_idx).double() * slope
    if name == "head_bias":
        return s + bias.double()[h_idx]
    if name in _GENERATED:
        return _GENERATED[name][0](s, 0, h_idx, q_idx, kv_idx)
    raise ValueError(name)


def _affine_rowfn(score, b, h, q_idx, kv_idx):
    # KV_AFFINE with a non-linear row part: sin(q / 10) - kv / (20 (h + 1))
    return score + (torch.sin(q_idx * 0.1) - kv_idx / ((h + 1) * 20))


def _offset_bias(score, b, h, q_idx, kv_idx):
    # scores near 6e4: the fp32 exponent base has a coarse ulp (2^-6 in log2 units)
    return score + ((q_idx - kv_idx) + 60000.0)


def _offset_bias_late(score, b, h, q_idx, kv_idx):
    # the same, written so that it is not a `score + x` (no fold, no KV_AFFINE: per-score code)
    return score + (q_idx - kv_idx) + 60000.0


# score mods generated the product's way (fa3_inductor.mods -> modgen -> @gluon.jit): name -> (python mod)
_GENERATED = {}


def _generated(name):
    from fa3_inductor import mods
    from fa3_inductor.templates.modgen import generate_mod_source, load_mod, trace_mod
    if name not in _GENERATED:
        fn = {"gen_softcap": mods.softcap(SOFTCAP), "gen_alibi": mods.alibi(4),
              "gen_relbias": mods.relative_bias, "gen_affine_rowfn": _affine_rowfn,
              "gen_offset_bias": _offset_bias, "gen_offset_bias_late": _offset_bias_late}[name]
        gm, _ = trace_mod(fn, "score")
        _GENERATED[name] = (fn, load_mod(generate_mod_source(gm, "score", [], "gl"), "gl"))
    return _GENERATED[name][1]


def _ref_mask(name, q_idx, kv_idx, doc=None):
    if name is None:
        return torch.ones(q_idx.shape[-2], kv_idx.shape[-1], dtype=torch.bool, device=q_idx.device)
    if name == "causal":
        return q_idx >= kv_idx
    if name == "sliding":
        return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)
    if name == "holes":
        return (q_idx >= kv_idx) & (q_idx % 7 != 3)
    if name == "document":
        return doc[q_idx] == doc[kv_idx]
    raise ValueError(name)


def reference(q, k, v, sm_scale, score_name=None, mask_name=None, bias=None, doc=None):
    B, Hq, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    g = Hq // Hkv
    qd, kd, vd = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("bhmd,bhnd->bhmn", qd, kd) * sm_scale
    dev = q.device
    q_idx = torch.arange(M, device=dev)[:, None]
    kv_idx = torch.arange(N, device=dev)[None, :]
    h_idx = torch.arange(Hq, device=dev)[None, :, None, None]
    s = _ref_score_mod(score_name, s, h_idx, q_idx, kv_idx, bias)
    keep = _ref_mask(mask_name, q_idx, kv_idx, doc)
    s = s.masked_fill(~keep, float("-inf"))
    mx = s.amax(-1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(mx), 0.0, mx)[..., None])
    p = p / torch.where(p.sum(-1, keepdim=True) == 0, 1.0, p.sum(-1, keepdim=True))
    out = torch.einsum("bhmn,bhnd->bhmd", p, vd)
    return out, lse / LN2, mx / LN2


def block_mask_from_dense(keep, M, N, qb, kvb):
    """torch BlockMask-format tensors (Bm=Hm=1) from a dense [M, N] keep-mask, as the lowering builds them."""
    from fa3_inductor.recognition.canonical import SPARSE_BLOCK, dense_block_mask
    assert qb == kvb == SPARSE_BLOCK, (qb, kvb)
    bm = dense_block_mask(keep, 1, 1, M, N, keep.device)
    return bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def _run_case(B, Hq, Hkv, M, N, D, dtype, score_name=None, mask_name=None, sparse=False, layout="bhsd",
              config=None, seed=0, sm_scale=None, Dv=None):
    torch.manual_seed(seed)
    dev = "cuda"
    Dv = Dv or D
    if layout == "bshd":   # (B, S, H, D) storage viewed as (B, H, S, D): no copies
        q = torch.randn(B, M, Hq, D, device=dev, dtype=dtype).transpose(1, 2)
        k = torch.randn(B, N, Hkv, D, device=dev, dtype=dtype).transpose(1, 2)
        v = torch.randn(B, N, Hkv, Dv, device=dev, dtype=dtype).transpose(1, 2)
        out = torch.full((B, M, Hq, Dv), float("nan"), device=dev, dtype=dtype).transpose(1, 2)
    else:
        q = torch.randn(B, Hq, M, D, device=dev, dtype=dtype)
        k = torch.randn(B, Hkv, N, D, device=dev, dtype=dtype)
        v = torch.randn(B, Hkv, N, Dv, device=dev, dtype=dtype)
        out = torch.full((B, Hq, M, Dv), float("nan"), device=dev, dtype=dtype)
    lse = torch.full((B, Hq, M), float("nan"), device=dev)
    mx = torch.full((B, Hq, M), float("nan"), device=dev)
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    bias = torch.randn(Hq, device=dev) if score_name == "head_bias" else None
    doc = None
    if mask_name == "document":
        assert M == N
        doc = torch.sort(torch.randint(0, 5, (M,), device=dev)).values.to(torch.int32)
    score_mod = (_generated(score_name) if str(score_name).startswith("gen_") else
                 {None: None, "softcap": softcap_mod, "alibi": alibi_mod, "head_bias": head_bias_mod}[score_name])
    mask_mod = {None: None, "causal": causal_mask, "sliding": sliding_window_mask, "holes": holes_causal_mask,
                "document": document_mask}[mask_name]
    kw = dict(sm_scale=sm_scale, score_mod=score_mod, mask_mod=mask_mod,
              score_bufs=(bias,) if bias is not None else (), mask_bufs=(doc,) if doc is not None else (),
              config=config)
    if sparse:
        cfg = config or get_config(D, dtype, value_head_dim=Dv)
        qi = torch.arange(M, device=dev)[:, None]
        ki = torch.arange(N, device=dev)[None, :]
        keep = _ref_mask(mask_name, qi, ki, doc)
        qb, kvb = 128, 128 if cfg.block_n <= 128 else cfg.block_n
        kvn, kvi, fn, fi = block_mask_from_dense(keep, M, N, qb, kvb)
        kw.update(kv_num_blocks=kvn, kv_indices=kvi, full_kv_num_blocks=fn, full_kv_indices=fi,
                  sparse_q_block=qb, sparse_kv_block=kvb)
    assert supports_sm90(q, k, v, out, kv_num_blocks=kw.get("kv_num_blocks"),
                         sparse_q_block=kw.get("sparse_q_block", 128), sparse_kv_block=kw.get("sparse_kv_block", 128),
                         config=config)
    launch_fwd_sm90(q, k, v, out, lse, mx, **kw)
    torch.cuda.synchronize()
    ref, ref_lse, ref_mx = reference(q, k, v, sm_scale, score_name, mask_name, bias, doc)
    assert not torch.isnan(out).any(), "unwritten / NaN output"
    assert not torch.isnan(lse).any() and not torch.isnan(mx).any(), "unwritten / NaN lse or max"
    err = _rel(out, ref)
    tol = 1e-2 if dtype == torch.bfloat16 else 5e-3
    assert err <= tol, f"rel err {err:.3e} > {tol}"
    dead = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), dead), "fully-masked rows must have lse = -inf"
    assert torch.equal(torch.isinf(mx) & (mx < 0), dead), "fully-masked rows must have max = -inf"
    if dead.any():
        assert (out[dead] == 0).all(), "fully-masked rows must be 0"
    live = ~dead
    lse_err = (lse[live].double() - ref_lse[live]).abs().max().item() if live.any() else 0.0
    mx_err = (mx[live].double() - ref_mx[live]).abs().max().item() if live.any() else 0.0
    # log2-unit LSE / max: bf16 inputs perturb the fp32 scores by O(1e-2) (softcap: tanh.approx)
    assert lse_err < 5e-2, f"lse abs err {lse_err:.3e}"
    assert mx_err < 5e-2, f"max abs err {mx_err:.3e}"
    return err, lse_err


CASES = [
    # (B, Hq, Hkv, M, N, D, dtype, score, mask, sparse, layout)
    (2, 4, 4, 512, 512, 128, torch.bfloat16, None, None, False, "bhsd"),
    (2, 4, 4, 512, 512, 128, torch.float16, None, None, False, "bhsd"),
    (1, 8, 2, 333, 517, 128, torch.bfloat16, None, None, False, "bshd"),      # ragged + GQA + strided
    (2, 4, 4, 300, 300, 64, torch.bfloat16, None, None, False, "bhsd"),
    (1, 4, 1, 200, 390, 256, torch.bfloat16, None, None, False, "bhsd"),
    (1, 4, 4, 1, 77, 128, torch.float16, None, None, False, "bhsd"),            # M = 1
    (1, 4, 4, 700, 700, 128, torch.bfloat16, None, "causal", True, "bhsd"),     # block-sparse causal
    (1, 4, 4, 700, 700, 128, torch.bfloat16, None, "causal", False, "bhsd"),    # dense + mask_mod
    (1, 4, 2, 640, 900, 256, torch.bfloat16, None, "causal", True, "bhsd"),     # sparse KV block = 2 tiles
    (1, 4, 4, 700, 700, 64, torch.float16, None, "sliding", True, "bshd"),
    (1, 4, 4, 500, 500, 128, torch.bfloat16, None, "holes", True, "bhsd"),      # fully masked rows
    (1, 4, 4, 600, 600, 128, torch.bfloat16, None, "document", True, "bhsd"),   # mask_mod reading a buffer
    (2, 4, 4, 400, 450, 128, torch.bfloat16, "softcap", None, False, "bhsd"),
    (1, 4, 4, 400, 400, 128, torch.bfloat16, "alibi", "causal", True, "bhsd"),
    (1, 4, 4, 300, 333, 64, torch.float16, "head_bias", None, False, "bhsd"),
    # head dims that are not a power of two, in two shared tiles per operand (80 = 64 + 16, 96 = 64 + 32,
    # 160 = 128 + 32, 192 = 128 + 64); 192: one K stage and two V stages
    (1, 8, 2, 333, 517, 96, torch.bfloat16, None, None, False, "bshd"),
    (1, 4, 4, 700, 700, 96, torch.float16, "softcap", "causal", True, "bhsd"),
    (1, 4, 4, 600, 600, 96, torch.bfloat16, "alibi", "document", True, "bshd"),
    (1, 4, 2, 640, 900, 192, torch.bfloat16, None, "causal", True, "bhsd"),
    (1, 4, 4, 300, 333, 192, torch.float16, "head_bias", None, False, "bshd"),
    (1, 8, 2, 333, 517, 80, torch.bfloat16, None, None, False, "bshd"),
    (1, 4, 4, 600, 600, 160, torch.float16, "softcap", "causal", True, "bhsd"),
    (1, 8, 2, 333, 517, 160, torch.bfloat16, "alibi", None, False, "bshd"),
    (1, 4, 4, 600, 600, 192, torch.bfloat16, None, "document", True, "bshd"),
    (2, 4, 4, 500, 500, 192, torch.float16, "softcap", "holes", True, "bhsd"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}H{c[1]}/{c[2]}M{c[3]}N{c[4]}D{c[5]}"
                         f"{str(c[6])[6:]}-{c[7]}-{c[8]}-{'sparse' if c[9] else 'dense'}-{c[10]}")
def test_numerics(case):
    B, Hq, Hkv, M, N, D, dtype, score, mask, sparse, layout = case
    _run_case(B, Hq, Hkv, M, N, D, dtype, score, mask, sparse, layout)


# V with another head dim than Q and K (PAIR_TABLE: DeepSeek's q/k 192 with v 128)
PAIR_CASES = [
    # (B, Hq, Hkv, M, N, D, Dv, dtype, score, mask, sparse, layout)
    (2, 4, 4, 512, 512, 192, 128, torch.bfloat16, None, None, False, "bhsd"),
    (1, 8, 2, 333, 517, 192, 128, torch.bfloat16, None, "causal", True, "bshd"),     # ragged + GQA + strided
    (1, 4, 4, 700, 700, 192, 128, torch.float16, "softcap", "causal", True, "bhsd"),
    (2, 4, 4, 500, 500, 192, 128, torch.bfloat16, "alibi", "holes", True, "bshd"),
    (1, 4, 4, 600, 600, 192, 128, torch.bfloat16, None, "document", True, "bhsd"),
    (1, 4, 4, 300, 333, 192, 128, torch.float16, "head_bias", None, False, "bshd"),
]


@pytest.mark.parametrize("case", PAIR_CASES, ids=lambda c: f"B{c[0]}H{c[1]}/{c[2]}M{c[3]}N{c[4]}D{c[5]}v{c[6]}"
                         f"{str(c[7])[6:]}-{c[8]}-{c[9]}-{'sparse' if c[10] else 'dense'}-{c[11]}")
def test_value_head_dim_numerics(case):
    B, Hq, Hkv, M, N, D, Dv, dtype, score, mask, sparse, layout = case
    _run_case(B, Hq, Hkv, M, N, D, dtype, score, mask, sparse, layout, Dv=Dv)


@pytest.mark.parametrize("persistent", [True, False])
def test_value_head_dim_schedules(persistent):
    """Both schedules of the pair config: persistent tile pairs and one CTA per tile."""
    cfg = get_config(192, torch.bfloat16, value_head_dim=128, persistent=persistent)
    _run_case(2, 8, 2, 640, 640, 192, torch.bfloat16, None, "causal", True, "bhsd", config=cfg, seed=31, Dv=128)


ABLATIONS = [dict(overlap=False), dict(num_stages=3), dict(persistent=True)]


@pytest.mark.parametrize("over", ABLATIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_variants(over):
    cfg = get_config(128, torch.bfloat16, **over)
    _run_case(2, 4, 2, 555, 700, 128, torch.bfloat16, None, None, False, "bshd", config=cfg, seed=1)
    _run_case(1, 4, 4, 700, 700, 128, torch.bfloat16, None, "causal", True, "bhsd", config=cfg, seed=2)


@pytest.mark.parametrize("D", [64, 96, 128, 192, 256])
def test_persistent_many_tiles_per_cta(D):
    # persistent CTAs walk several tile pairs (> 2 tiles per SM): the ring / Q / turn phases across tiles,
    # the O staging buffer's deferred store wait (dropped at D=256: smem), an odd tile count (945: the
    # last pair is half empty), ragged M / N, GQA + strided layout, block-sparse causal with empty rows
    cfg = get_config(D, torch.bfloat16, persistent=True)
    _run_case(3, 40, 8, 640, 700, D, torch.bfloat16, None, None, False, "bshd", config=cfg, seed=11)   # 600 tiles
    _run_case(5, 21, 21, 1100, 1100, D, torch.bfloat16, None, "holes", True, "bhsd", config=cfg, seed=12)
    _run_case(2, 37, 37, 1000, 1000, D, torch.bfloat16, "softcap", "causal", True, "bhsd", config=cfg, seed=13)


@pytest.mark.parametrize("persistent", [True, False])
def test_three_consumer_warpgroups(persistent):
    # 192-row tiles (configs.LONG_DENSE_TILE: three consumer warpgroups, a ring of GEMM turns): ragged M and N (the
    # last tile a third full), GQA in a strided layout, fp16, several tile pairs a persistent CTA; then the host's pick
    # at 8192 query rows (D64 without mods), checked the same way
    cfg = get_config(64, torch.bfloat16, persistent=persistent, block_m=192, consumer_regs=160, maxnreg=128)
    _run_case(3, 40, 8, 650, 700, 64, torch.bfloat16, None, None, False, "bshd", config=cfg, seed=51)
    _run_case(2, 4, 4, 1000, 777, 64, torch.float16, None, None, False, "bhsd",
              config=replace(cfg, num_stages=2), seed=52)
    _run_case(1, 2, 2, 8192, 8192, 64, torch.bfloat16, None, None, False, "bhsd", seed=53)


@pytest.mark.parametrize("D", [80, 96, 160, 192])
@pytest.mark.parametrize("persistent", [False, True])
def test_padded_head_dim_writes_only_its_columns(D, persistent):
    # D=80 / 96 / 160 / 192 store O as two tiles (LO + HI columns): the output's row stride is D + 32 here,
    # and the 32 columns after each row (another tensor's memory) must keep their sentinel
    torch.manual_seed(41)
    B, H, M, N = 2, 4, 300, 333
    q, k, v = (torch.randn(B, H, n, D, device="cuda", dtype=torch.bfloat16) for n in (M, N, N))
    store = torch.full((B, H, M, D + 32), 7.0, device="cuda", dtype=torch.bfloat16)
    out = store[..., :D]
    lse = torch.empty(B, H, M, device="cuda")
    mx = torch.empty(B, H, M, device="cuda")
    launch_fwd_sm90(q, k, v, out, lse, mx, sm_scale=D ** -0.5,
                    config=get_config(D, torch.bfloat16, persistent=persistent))
    torch.cuda.synchronize()
    assert (store[..., D:] == 7.0).all(), "the kernel wrote past the head dim"
    ref, _, _ = reference(q, k, v, D ** -0.5, None, None, None, None)
    assert _rel(out, ref) <= 1e-2


def test_padded_head_dim_runs_on_the_hopper_template():
    import fa3_inductor
    q, k, v = (torch.randn(1, 4, 256, 96, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = fa3_inductor.flex(q, k, v)
    assert fa3_inductor.last_template() == "hopper"
    ref, _, _ = reference(q, k, v, 96 ** -0.5)
    assert _rel(out, ref) <= 1e-2


@pytest.mark.parametrize("emu", [False, True])
def test_exp2_on_the_fma_pipe(emu):
    # half of the exp2 work on the polynomial (for a generated SFU-bound mod): ragged tail, fully masked rows
    # (2^-inf must be exactly 0)
    cfg = get_config(128, torch.bfloat16, sfu_mod_exp2_emu=emu)
    _run_case(2, 4, 4, 400, 450, 128, torch.bfloat16, "gen_softcap", None, False, "bhsd", config=cfg, seed=3)
    _run_case(1, 4, 4, 500, 500, 128, torch.bfloat16, "gen_softcap", "holes", True, "bhsd", config=cfg, seed=4)
    _run_case(1, 4, 4, 300, 333, 64, torch.float16, "gen_softcap", "holes", False, "bhsd",
              config=get_config(64, torch.float16, sfu_mod_exp2_emu=emu), seed=5)


@pytest.mark.parametrize("name", ["gen_softcap", "gen_alibi", "gen_relbias"])
def test_generated_mods(name):
    # gen_alibi's bias grows along kv by up to ~360 natural units: the exponent base moves often
    _run_case(2, 4, 4, 333, 517, 128, torch.bfloat16, name, None, False, "bhsd", seed=6)
    _run_case(1, 4, 4, 700, 700, 128, torch.bfloat16, name, "causal", True, "bhsd", seed=7)


@pytest.mark.parametrize("D", [64, 96, 128, 256])
@pytest.mark.parametrize("name", ["gen_alibi", "gen_relbias", "gen_affine_rowfn"])
def test_kv_affine_mods(D, name):
    # `score + alpha(h)·kv + B(q)` runs as a column vector, a per-tile shift and a row part added to LSE and
    # MAX at the end: ragged tails (no EVEN_N), GQA + strided layout, rows with no key, both schedules,
    # fp16, a long sequence (ALiBi's bias reaches ~1700 natural units there), the unfolded twin (D=64)
    from fa3_inductor.templates.hopper.fwd_sm90 import _prepare
    mod = _generated(name)
    q = torch.zeros(1, 4, 256, D, device="cuda", dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(1, 4, 256, device="cuda")
    _, kwargs, _ = _prepare(q, q, q, out, lse, lse, 0.1, mod, None, (), (), None, None, None, None, 128, 128,
                            None, 132, True)
    assert kwargs["FLAGS"].KV_AFFINE, "the generated mod must take the column / tile / row path"
    _run_case(1, 8, 2, 333, 517, D, torch.bfloat16, name, None, False, "bshd",
              config=get_config(D, torch.bfloat16, persistent=True), seed=21)
    _run_case(1, 4, 4, 500, 500, D, torch.bfloat16, name, "holes", True, "bhsd",
              config=get_config(D, torch.bfloat16, persistent=False), seed=22)
    _run_case(1, 4, 4, 400, 450, D, torch.float16, name, "causal", False, "bhsd",
              config=get_config(D, torch.float16), seed=23)
    _run_case(1, 2, 2, 2500, 2500, D, torch.bfloat16, name, None, False, "bhsd", seed=24)


@pytest.mark.parametrize("name", ["gen_offset_bias", "gen_offset_bias_late", "gen_relbias"])
def test_lse_does_not_drift_while_the_row_max_holds(name):
    # The row max sits in the first KV tile and holds for the other 31. The base the kernel subtracts
    # must equal the one it rescales by: a contracted m_run - m_new * qk_scale gave alpha = 2^(rounding
    # error) on every such tile, and LSE drifted by ~0.25 log2 units here (O was still right).
    _run_case(1, 2, 2, 4096, 4096, 128, torch.bfloat16, name, None, False, "bhsd", seed=31)


def test_negative_scale():
    # the no-mod fast path folds the scale into exp2 and the row max; a negative scale must still be exact
    _run_case(1, 4, 4, 300, 260, 128, torch.bfloat16, None, None, False, "bhsd", sm_scale=-0.09)


@pytest.mark.parametrize("name", ["gen_alibi", "gen_relbias"])
@pytest.mark.parametrize("sm_scale", [-0.09, 0.0])
def test_additive_mods_off_the_folded_path(name, sm_scale):
    # `score + bias` is generated as qk + bias / sm_scale (valid for sm_scale > 0): any other scale
    # launches the mod's unfolded twin
    _run_case(1, 4, 4, 300, 260, 128, torch.bfloat16, name, "causal", True, "bhsd", sm_scale=sm_scale)


@pytest.mark.parametrize("D, dtype, cap, mask, saturate", [
    (128, torch.bfloat16, 30.0, None, False),
    (64, torch.bfloat16, 50.0, "holes", False),      # Gemma 2's attention cap; rows with no key
    (256, torch.bfloat16, 30.0, "causal", False),
    (128, torch.float16, 4.0, "causal", False),
    (128, torch.bfloat16, 60.0, None, True),         # every score at -cap: the bottom of P's range
    (192, torch.bfloat16, 30.0, "causal", False),    # FIXED_BASE_TABLE's tiles (BLOCK_N 64, overlap)
])
def test_bounded_softcap_with_a_fixed_exponent_base(D, dtype, cap, mask, saturate):
    """max_needed=False: softcap exponentiates against a fixed base (no row max): O and LSE match
    float64, rows with no key give O = 0 and LSE = MAX = -inf, and MAX is NaN (not computed) elsewhere."""
    from fa3_inductor import mods
    from fa3_inductor.templates.hopper.fwd_sm90 import _prepare
    from fa3_inductor.templates.modgen import generate_mod_source, load_mod, trace_mod
    torch.manual_seed(0)
    B, H, M, N = 1, 4, 457, 457
    fn = mods.softcap(cap)
    gm, _ = trace_mod(fn, "score")
    mod = load_mod(generate_mod_source(gm, "score", [], "gl"), "gl")
    q, k, v = (torch.randn(B, H, n, D, device="cuda", dtype=dtype) for n in (M, N, N))
    if saturate:   # every score -600 (±noise): tanh is -1 on whole rows, p = 2^-109 for every key
        u = torch.nn.functional.normalize(torch.randn(D, device="cuda"), dim=0)
        k = (u * D ** 0.5 + 0.01 * torch.randn(B, H, N, D, device="cuda")).to(dtype)
        q = (-600.0 * u).expand(B, H, M, D).to(dtype).contiguous()
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, M), float("nan"), device="cuda")
    mx = torch.full((B, H, M), float("nan"), device="cuda")
    kw = dict(sm_scale=D ** -0.5, score_mod=mod, mask_mod={None: None, "holes": holes_causal_mask,
                                                          "causal": causal_mask}[mask])
    _, kwargs, _ = _prepare(q, k, v, out, lse, mx, kw["sm_scale"], mod, kw["mask_mod"], (), (),
                            None, None, None, None, 128, 128, None, 132, False)
    assert kwargs["FLAGS"].FIXED_BASE, "this case must take the fixed-base path"
    assert kwargs["TILE"].BLOCK_N == get_config(D, dtype, fixed_base=True).block_n
    launch_fwd_sm90(q, k, v, out, lse, mx, max_needed=False, **kw)
    torch.cuda.synchronize()

    qi = torch.arange(M, device="cuda")[:, None]
    ki = torch.arange(N, device="cuda")[None, :]
    s = fn(q.double() @ k.double().transpose(-2, -1) * D ** -0.5, None, None, None, None)
    if mask is not None:
        s = s.masked_fill(~_ref_mask(mask, qi, ki), float("-inf"))
    ref_lse = torch.logsumexp(s, -1)
    dead = torch.isinf(ref_lse)
    ref = torch.softmax(s.masked_fill(dead[..., None], 0.0), -1).masked_fill(dead[..., None], 0.0) @ v.double()
    tol = 1e-2 if dtype == torch.bfloat16 else 5e-3
    assert _rel(out, ref) <= tol, _rel(out, ref)
    assert torch.equal(torch.isinf(lse) & (lse < 0), dead) and (out[dead] == 0).all()
    assert (lse[~dead].double() - ref_lse[~dead] / LN2).abs().max().item() < 5e-2
    assert torch.isnan(mx[~dead]).all() and torch.equal(torch.isinf(mx), dead)
