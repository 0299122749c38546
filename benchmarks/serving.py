"""Serving attention on a GPU (issue 20): decode through the front doors users call, split-count
sweeps, paged KV caches and varlen prefill, against torch, in one run.

Parts (--part, default decode,splits,paged,varlen):

  decode  rows (batch, new tokens, cache length, HQ/HKV, D), bf16, no mask (every new token sees
          the whole cache). Ours three ways, as users reach the registered decode family:
          ``fa3_inductor.flex(q, k, v)`` with a short q ("fa3 flex"; the row records which family
          ran), ``flex_decode(q, k, v, seq_lens=...)`` on the contiguous cache ("fa3 decode") and on
          the same cache in pages of 64 behind a shuffled block table ("fa3 paged"); each call
          timed whole (planning cache, launches), its host time reported apart. Against: SDPA's
          fastest backend of cuDNN / flash / efficient (GQA through enable_gqa, else K/V repeated
          outside the timed region), torch's compiled FlexAttention (a query of new_tokens rows:
          torch picks flex_decoding), and a device copy (torch copy_) of a K+V-sized buffer, timed
          in the same rounds as ours: the bandwidth reference.
  splits  a few decode rows through flex_decode at every split count (num_splits=1, 2, 3, 4, 6, ...),
          the chosen one ("auto") and the copy in the same rounds, plus two probes with every
          length 0 (no key read: the fixed cost of the launches at the chosen count and at 1).
  paged   page sizes (16, 64, 128, 256) against the contiguous cache, same rounds.
  varlen  16k-token packs of documents of uneven (seeded) lengths, H16 D128 bf16, causal within
          documents: ours flex_varlen (on sm90 the Hopper kernel's packed mode, "ours"; its Triton
          varlen kernel beside it, "ours_triton"); cuDNN and flash SDPA called per document (the loop timed);
          our document-mask path (fa3_inductor.flex on [1, H, 16k, D] with and_masks(document,
          causal), block mask built once); torch's compiled FlexAttention on the same block mask;
          and (first pack) our varlen kernel with other tiles (templates/varlen/configs.py).
  fp8kv   flex_decode over an FP8 (e4m3) KV cache against the same cache in bf16, same rounds: per
          kv head scales on the contiguous cache ("fp8"), per page scales on pages of 64 ("fp8
          paged", beside "bf16 paged"), and the FP8 kernel with 128-key tiles ("fp8 bn128", a tile
          A/B through prepare_decode); a copy of the FP8 bytes. TB/s count the bytes each reads
          (FP8: 1 per value); "fp8/bf16" is bf16's time over FP8's. Each row records the FP8
          output's difference to bf16 flex_decode on the dequantized cache (the same values: a
          kernel check) and to the bf16 cache it was quantized from (the quantization's error).
          Only when asked (--part fp8kv).
  prefill prefill chunks reading a paged KV cache (flex_decode past 128 packed rows: on sm90 the Hopper
          kernel reads the cache in place, templates/hopper/cache_sm90.py; elsewhere decode.py's _gathered
          copies the pages and runs fa3_inductor.flex), bf16 GQA
          32/8 D128: B sequences whose last ``new`` of ``cache`` keys are the chunk, causal among
          themselves and seeing the whole prefix (mask_mod causal_abs on the absolute positions
          flex_decode hands its mods). Same rounds: "paged" (pages of 64, shuffled table), "contig"
          (the same call on the contiguous [B, HKV, cache, D] cache), "gathered" (decode._gathered on the
          pages: the fallback path, the product path before the Hopper cache mode) and "gather" (what
          _gathered does before flex(): the pages' copy, the chunk's positions, the mods); then torch's
          compiled FlexAttention on the
          contiguous cache (block mask built once, enable_gqa). A probe in the same rounds, "q_offset":
          paged and contig with q_offset = seq_lens - new passed as one tensor kept across calls (the
          default positions; without it each call's positions are a new tensor, and flex() keys the
          block mask of the mods folding them in anew). Each row records the block masks built per call and the
          template flex() ran. Only when asked (--part prefill).
  window  decode steps under causal sliding windows (flex_decode with mods.sliding_window(W), W = 128, 1024,
          4096: gpt-oss's, Gemma 3's and Mistral's) against the same call without a mask (the whole cache),
          the middle window on pages of 64, and torch's compiled FlexAttention with that window's block mask,
          bf16 GQA 32/8 D128 at 1 x 32k, 8 x 32k, 1 x 128k. Only when asked (--part window).

Units. Decode "TB/s" is K+V bytes read once / time; copy TB/s counts read + write (2 x K+V bytes)
/ time, a copy's usual figure; "% copy" is ours over the copy's. Varlen TFLOP/s count only the
within-document causal work, 4 * H * D * L(L+1)/2 per document, for every impl; prefill TFLOP/s
count 4 * B * HQ * D * P, P the (query, key) pairs a chunk computes per (batch, head): row i of
new (0-based) sees cache - new + i + 1 keys, so P = new * (cache - new) + new * (new + 1) / 2.
Ratios "ours/X" are X's time over ours (> 1: ours faster); "paged/contig" is paged time over
contiguous time.

Timing: CUDA events around each call, warm-up first, the median of --reps; before every timed call
a 256 MB scratch is zeroed (flushes the 50 MB L2: decode is bandwidth-bound and a warm L2 would
flatter it), then the GPU sleeps ~0.2 ms so that the host has queued the call before the start
event fires; neither is inside the events. Impls compared directly (ours, the copy) are timed in
the same interleaved rounds.

Before timing, ours is checked against a float64 reference on one small decode case (contiguous and
paged), one small pack and (prefill) one small prefill chunk (paged and contiguous); each timed row
also records every impl's relative difference to ours.

    python benchmarks/serving.py --quick --out DIR      # ~2 min on an H100 (budget 140 s all told)
    python benchmarks/serving.py                        # default rows (budget 300 s)
    python benchmarks/serving.py --part decode --full   # every decode row (K+V <= 16 GiB)
    python benchmarks/serving.py --part fp8kv           # the FP8 KV cache against bf16
    python benchmarks/serving.py --quick --part prefill # prefill chunks on pages, 4 rows
    TRITON_INTERPRET=1 python benchmarks/serving.py --smoke --out /tmp/s   # CPU: the harness only

Writes serving-<device>-<YYYY-MM-DD-HHMM>.{json,md} into --out (after every row, so a run cut short
keeps what it measured) and prints a short summary table last. --budget-s: once a part's share of
it has passed (counted from the start of the process), that part adds no more rows (each part runs
at least one); the rows left out are listed in the files.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

STARTED = time.time()
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))   # reference.py: the float64 reference

PARTS = ("decode", "splits", "paged", "varlen", "fp8kv", "prefill", "window")
DEFAULT_PARTS = PARTS[:4]    # fp8kv, prefill and window run when asked (prefill: two compiles per row)
# cumulative share of --budget-s after which a part adds no more rows
BUDGET_SHARE = {"decode": 0.58, "splits": 0.64, "paged": 0.70, "varlen": 1.0, "fp8kv": 1.0, "prefill": 1.0,
                "window": 1.0}
QUICK_BUDGET_S = 140.0       # --quick: the whole run, startup included
KV_CAP = 16 * 2 ** 30        # decode rows over this many K+V bytes are left out
PAGED_KV_CAP = 4 * 2 ** 30   # rows whose paged copy is timed too (it holds the cache twice)
DECODE_PAGE = 64             # the decode part's paged cache: pages of 64 keys
FLUSH_BYTES = 256 * 2 ** 20  # > 64 MB: the H100's L2 is 50 MB
COPY_REF_BYTES = 2 * 2 ** 30 # one large copy per run: the device's copy bandwidth, for reference
SLEEP_CYCLES = 400_000       # ~0.2 ms at 2 GHz: the host's head start before each timed call
SDPA_BACKENDS = ("cudnn", "flash", "efficient")
AGREE_TOL = 2e-2             # bf16's tolerance (tests/reference.py): impls must agree with ours
SPLIT_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
PAGE_SIZES = (16, 64, 128, 256)
K = 1024
# our decode front doors: (row key, table name)
FRONT_DOORS = (("fa3_flex", "fa3 flex"), ("fa3_decode", "fa3 decode"), ("fa3_paged", "fa3 paged"))


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    batch: int
    new: int
    cache: int
    hq: int
    hkv: int
    d: int
    page: int = 0   # paged rows only

    def kv_bytes(self, itemsize: int = 2) -> int:
        """K+V bytes of the cache, read once by a decode step.

        Example::

            >>> DecodeCase(8, 1, 8192, 32, 8, 128).kv_bytes()
            268435456
        """
        return 2 * self.batch * self.hkv * self.cache * self.d * itemsize

    def label(self) -> str:
        paged = f" page{self.page}" if self.page else ""
        return f"{self.batch}x{self.new}x{_cache(self.cache)} {self.hq}/{self.hkv} D{self.d}{paged}"


def _d(b: int, n: int, c: int, hkv: int = 8, d: int = 128) -> DecodeCase:
    return DecodeCase(b, n, c * K, 32, hkv, d)


# --quick: batch 1-64 x cache 4k-128k over GQA 32/8 and MHA 32/32 at D128 and D64 (issue 20's grid,
# one row per corner and the weak rows of the first GPU run), plus a speculative 4-token row.
# Ordered so that a run cut short by the budget still covers every kind.
QUICK_DECODE = [_d(8, 1, 8), _d(1, 1, 128), _d(8, 1, 8, d=64), _d(8, 1, 8, hkv=32), _d(64, 1, 4),
                _d(1, 1, 8), _d(64, 1, 32, d=64), _d(1, 1, 128, hkv=32), _d(1, 1, 32), _d(8, 4, 8),
                _d(32, 1, 4), _d(1, 1, 128, d=64), _d(64, 1, 4, hkv=32), _d(8, 1, 32, hkv=32, d=64),
                _d(1, 1, 4), _d(64, 1, 8)]
QUICK_SPLITS = [_d(1, 1, 8), _d(1, 1, 32), _d(8, 1, 8), _d(8, 1, 8, d=64), _d(64, 1, 4)]
QUICK_PAGED = [_d(8, 1, 8), _d(1, 1, 8), _d(1, 1, 32)]   # the last two: few programs, many splits


def decode_cases(full: bool, quick: bool = False) -> list[DecodeCase]:
    """Decode rows: --quick's set, the whole grid with --full, else a default set that fits the
    5-minute run (the two headline rows first, then one of each kind, then the rest of the GQA
    D128 one-token grid).

    Example::

        >>> decode_cases(False)[0]
        DecodeCase(batch=8, new=1, cache=8192, hq=32, hkv=8, d=128, page=0)
    """
    if quick:
        return list(QUICK_DECODE)
    if full:
        grid = [DecodeCase(b, n, c * K, 32, hkv, d) for hkv in (8, 32) for d in (128, 64)
                for n in (1, 4) for b in (1, 8, 32, 64) for c in (4, 8, 32, 128)]
        return [c for c in grid if c.kv_bytes() <= KV_CAP]
    first = [DecodeCase(8, 1, 8 * K, 32, 8, 128), DecodeCase(1, 1, 128 * K, 32, 8, 128),
             DecodeCase(8, 1, 8 * K, 32, 32, 128), DecodeCase(8, 1, 8 * K, 32, 8, 64),
             DecodeCase(8, 4, 8 * K, 32, 8, 128), DecodeCase(1, 4, 128 * K, 32, 8, 128),
             DecodeCase(1, 1, 128 * K, 32, 32, 128), DecodeCase(1, 1, 128 * K, 32, 8, 64),
             DecodeCase(64, 1, 4 * K, 32, 32, 128), DecodeCase(64, 1, 32 * K, 32, 8, 64),
             DecodeCase(8, 4, 32 * K, 32, 32, 64)]
    grid = [DecodeCase(b, 1, c * K, 32, 8, 128) for b in (1, 8, 32, 64) for c in (4, 8, 32, 128)]
    return first + [c for c in grid if c not in first and c.kv_bytes() <= KV_CAP]


def split_cases(full: bool, quick: bool = False) -> list[DecodeCase]:
    """Rows of the split-count sweep (the small caches, where the split count matters most).

    Example::

        >>> split_cases(False, quick=True)[0].label()
        '1x1x8k 32/8 D128'
    """
    if quick or not full:
        return list(QUICK_SPLITS)
    return list(QUICK_SPLITS) + [_d(1, 1, 4), _d(8, 1, 4), _d(32, 1, 4), _d(1, 1, 128), _d(1, 4, 32)]


def paged_cases(full: bool, quick: bool = False) -> list[DecodeCase]:
    """Rows of the page-size comparison (each timed at every size in PAGE_SIZES; K+V at most
    PAGED_KV_CAP).

    Example::

        >>> paged_cases(False)[0].label()
        '8x1x8k 32/8 D128'
    """
    cases = list(QUICK_PAGED)
    if not quick:
        cases.append(_d(8, 1, 32, d=64))
    if full:
        cases += [_d(1, 1, 128), _d(64, 1, 4), _d(8, 4, 8), _d(8, 1, 8, hkv=32)]
    return [c for c in cases if c.kv_bytes() <= PAGED_KV_CAP]


SMOKE_DECODE = [DecodeCase(2, 1, 64, 4, 2, 16), DecodeCase(1, 2, 128, 2, 1, 32)]   # the second splits
SMOKE_SPLITS = [DecodeCase(1, 1, 128, 4, 2, 16)]
SMOKE_SPLIT_COUNTS = (1, 2, 4)
SMOKE_PAGED = [DecodeCase(2, 1, 64, 4, 2, 16)]
SMOKE_PAGE_SIZES = (8, 16, 32)
# FP8 KV cache rows (GQA 32/8 D128 first: the headline shapes), and --full's extra ones
FP8KV_DECODE = [_d(8, 1, 32), _d(1, 1, 128), _d(8, 1, 8), _d(64, 1, 8), _d(1, 1, 32)]
FP8KV_FULL = [_d(8, 1, 32, d=64), _d(1, 1, 128, hkv=32), _d(32, 1, 32), _d(8, 4, 32)]
SMOKE_FP8KV = [DecodeCase(2, 1, 64, 4, 2, 16)]


@dataclasses.dataclass(frozen=True)
class VarlenCase:
    tokens: int
    docs: int
    heads: int
    d: int
    seed: int = 0

    def label(self) -> str:
        return f"varlen {self.tokens}t/{self.docs} docs H{self.heads} D{self.d}"


VARLEN = VarlenCase(16 * K, 6, 16, 128)           # the pack
VARLEN_MANY = VarlenCase(16 * K, 24, 16, 128)     # a serving-like pack of shorter prompts
SMOKE_VARLEN = VarlenCase(96, 6, 2, 16)


def varlen_cases(full: bool, quick: bool = False) -> list[VarlenCase]:
    """The packs: the issue's 16k pack of 6 documents first, then 24 shorter ones.

    Example::

        >>> [c.docs for c in varlen_cases(False)]
        [6, 24]
    """
    return [VARLEN, VARLEN_MANY]


def doc_lengths(case: VarlenCase) -> list[int]:
    """Uneven document lengths summing to ``case.tokens`` (seeded; each at least tokens / 8 docs).

    Example::

        >>> sum(doc_lengths(VarlenCase(16384, 6, 16, 128)))
        16384
    """
    gen = torch.Generator().manual_seed(case.seed)
    floor = case.tokens // (8 * case.docs)
    weights = torch.rand(case.docs, generator=gen) ** 2 + 0.05
    extra = (weights / weights.sum() * (case.tokens - floor * case.docs)).floor().long()
    lengths = [floor + int(x) for x in extra]
    lengths[int(weights.argmax())] += case.tokens - sum(lengths)
    return lengths


def causal_pairs(lengths: list[int]) -> int:
    """(q, kv) pairs causal attention computes within documents of these lengths.

    Example::

        >>> causal_pairs([2, 3])
        9
    """
    return sum(n * (n + 1) // 2 for n in lengths)


def within_budget(now: float, deadline: float, rows_done: int) -> bool:
    """Whether a part may add a row: always its first, later ones only before its deadline.

    Example::

        >>> within_budget(10.0, 5.0, 0), within_budget(10.0, 5.0, 1)
        (True, False)
    """
    return rows_done == 0 or now < deadline


# ------------------------------------------------------------------------------------ timing
class Clock:
    """Median ms of callables; on a CPU (--smoke) one wall-clock call each, not a measurement."""

    def __init__(self, device: torch.device, reps: int, warmup: int, sleep_cycles: int = SLEEP_CYCLES):
        self.sleep_cycles = sleep_cycles   # the host's head start before each timed call (GPU cycles)
        self.cuda = device.type == "cuda"
        self.reps, self.warmup = (reps, warmup) if self.cuda else (1, 0)
        self.scratch = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if self.cuda else None

    def times(self, fns: dict[str, Callable]) -> dict[str, float]:
        """Median ms of each function, timed in turn within each round (same clocks for all).

        Example::

            >>> Clock(torch.device("cpu"), 5, 1).times({"add": lambda: torch.ones(4) + 1})["add"] >= 0
            True
        """
        for fn in fns.values():
            for _ in range(self.warmup):
                fn()
        if not self.cuda:
            out = {}
            for name, fn in fns.items():
                t = time.perf_counter()
                fn()
                out[name] = (time.perf_counter() - t) * 1e3
            return out
        torch.cuda.synchronize()
        events: dict[str, list] = {name: [] for name in fns}
        for _ in range(self.reps):
            for name, fn in fns.items():
                self.scratch.zero_()                 # L2 flush, outside the events
                torch.cuda._sleep(self.sleep_cycles)   # the host queues fn before start fires
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                events[name].append((start, end))
        torch.cuda.synchronize()
        return {name: statistics.median(s.elapsed_time(e) for s, e in ev) for name, ev in events.items()}

    def ms(self, fn: Callable) -> float:
        return self.times({"fn": fn})["fn"]

    def host_us(self, fn: Callable, n: int = 20) -> float:
        """Median host µs of one call, the queue drained before each (launches are asynchronous)."""
        samples = []
        for _ in range(n if self.cuda else 1):
            if self.cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t) * 1e6)
        return statistics.median(samples)


def _error(exc: BaseException) -> str:
    """The exception's type and the start of its first line (enough to tell failures apart)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:120] if text else ''}"


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    from reference import rel_error

    return rel_error(out.float(), ref.float())


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _free_bytes(device: torch.device) -> int:
    """Bytes a new tensor can take: the driver's free memory plus what torch's allocator caches."""
    if device.type != "cuda":
        return 1 << 62
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


# ------------------------------------------------------------------------------------ checks
def _worst_error(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 lens: torch.Tensor) -> float:
    """The largest relative error of a decode output over its batches, each against float64
    attention over its first lens[z] keys of k, v [B, HKV, N, D]."""
    from reference import reference_attention, rel_error

    worst = 0.0
    for z, L in enumerate(lens.tolist()):
        ref, _ = reference_attention(q[z:z + 1], k[z:z + 1, :, :L], v[z:z + 1, :, :L])
        worst = max(worst, rel_error(out[z:z + 1], ref))
    return worst


def check_decode(device: torch.device, dtype: torch.dtype) -> dict:
    """Ours (contiguous and paged, GQA, 4 new tokens, a partial last tile) against float64."""
    from reference import TOLERANCE

    from fa3_inductor.templates.decode import decode_attention

    small = device.type == "cpu"
    B, HQ, HKV, M, D, page = (2, 4, 2, 2, 16, 16) if small else (3, 32, 8, 4, 128, 64)
    N = 4 * page
    lens = torch.tensor([N, N - page // 2 - 3, page + 1][:B], dtype=torch.int32, device=device)
    q = torch.randn(B, HQ, M, D, device=device, dtype=dtype)
    k, v = (torch.randn(B, HKV, N, D, device=device, dtype=dtype) for _ in range(2))
    k_pages, v_pages, table = _pages(k, v, page, spare=2)
    out_c, _ = decode_attention(q, k, v, seq_lens=lens)
    out_p, _ = decode_attention(q, k_pages, v_pages, seq_lens=lens, block_table=table, page_size=page)
    errors = {name: _worst_error(out, q, k, v, lens) for name, out in (("contiguous", out_c), ("paged", out_p))}
    tol = TOLERANCE[dtype]
    if max(errors.values()) > tol:
        raise SystemExit(f"serving: our decode kernel does not match float64 ({errors}, tolerance "
                         f"{tol}); fix templates/decode before timing it (tests/test_decode_kernel.py)")
    return dict(shape=f"B{B} HQ{HQ}/HKV{HKV} new{M} N{N} D{D} page{page}", rel_error=errors, tol=tol)


def check_varlen(device: torch.device, dtype: torch.dtype) -> dict:
    """flex_varlen (causal) on a small pack of ragged documents against float64, per document."""
    from reference import TOLERANCE, reference_attention, rel_error

    from fa3_inductor import mods
    from fa3_inductor.varlen import flex_varlen

    lengths = [9, 40, 23] if device.type == "cpu" else [300, 37, 700]
    H, D = (2, 16) if device.type == "cpu" else (4, 128)
    q, k, v = (torch.randn(sum(lengths), H, D, device=device, dtype=dtype) for _ in range(3))
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(device=device, dtype=torch.int32)
    out = flex_varlen(q, k, v, cu, cu, max(lengths), max(lengths), mask_mod=mods.causal)
    worst, start = 0.0, 0
    for n in lengths:
        seq = [t[start:start + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v, out)]
        ref, _ = reference_attention(*seq[:3], mask_mod=mods.causal)
        worst = max(worst, rel_error(seq[3], ref))
        start += n
    if worst > TOLERANCE[dtype]:
        raise SystemExit(f"serving: flex_varlen does not match float64 (relative error {worst:.3e} > "
                         f"{TOLERANCE[dtype]}); fix the varlen kernel before timing it (tests/test_varlen.py)")
    return dict(lengths=lengths, heads=H, d=D, rel_error=worst, tol=TOLERANCE[dtype])


# ------------------------------------------------------------------------------------ decode
def _pages(k: torch.Tensor, v: torch.Tensor, page: int, spare: int = 4):
    """The cache's pages scattered over a shuffled pool with spare pages: (k_pages, v_pages, table).
    A page size that does not divide the cache leaves the last page of each batch part empty."""
    B, HKV, N, D = k.shape
    per = -(-N // page)
    pool = B * per + spare
    order = torch.randperm(pool, device=k.device)[:B * per]
    pad = per * page - N

    def scatter(t: torch.Tensor) -> torch.Tensor:
        pages = t.new_zeros(pool, page, HKV, t.shape[-1])
        if pad:
            t = torch.cat([t, t.new_zeros(B, HKV, pad, t.shape[-1])], dim=2)
        pages[order] = t.view(B, HKV, per, page, -1).permute(0, 2, 3, 1, 4).reshape(B * per, page, HKV, -1)
        return pages

    return scatter(k), scatter(v), order.view(B, per).to(torch.int32)


def _sdpa(name: str):
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]


def _sdpa_decode(row: dict, q, k, v, clock: Clock, ours_out: torch.Tensor) -> None:
    """Each SDPA backend, GQA natively if it takes enable_gqa, else on K/V repeated beforehand."""
    from torch.nn.attention import sdpa_kernel

    group = q.shape[1] // k.shape[1]
    for name in SDPA_BACKENDS:
        backend = _sdpa(name)
        tried = []
        for gqa in (("native", "repeat") if group > 1 else ("none",)):
            if gqa == "repeat" and k.numel() * k.element_size() * 2 * group > 0.85 * _free_bytes(q.device):
                tried.append("repeat: K/V repeated would not fit in memory")
                continue
            kk, vv = (k, v) if gqa != "repeat" else (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))

            def call(kk=kk, vv=vv, gqa=gqa):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=gqa == "native")
            try:
                row[f"sdpa_{name}_diff"] = _rel(call(), ours_out)
                row[f"sdpa_{name}_ms"] = clock.ms(call)
                row[f"sdpa_{name}_gqa"] = gqa
                break
            except Exception as exc:   # this backend does not take the case: say why, try the next
                tried.append(f"{gqa}: {_error(exc)}")
            finally:
                kk = vv = call = None
        if f"sdpa_{name}_ms" not in row:
            row.setdefault("errors", {})[f"sdpa_{name}"] = "; ".join(tried)
    timed = [n for n in SDPA_BACKENDS if f"sdpa_{n}_ms" in row]
    if timed:
        best = min(timed, key=lambda n: row[f"sdpa_{n}_ms"])
        row.update(sdpa_best=best, sdpa_ms=row[f"sdpa_{best}_ms"], sdpa_gqa=row[f"sdpa_{best}_gqa"])


def _torch_flex_decode(row: dict, q, k, v, clock: Clock, flex_fn, ours_out: torch.Tensor) -> None:
    from torch.nn.attention.flex_attention import create_block_mask, noop_mask

    try:
        bm = create_block_mask(noop_mask, None, None, q.shape[2], k.shape[2], device=q.device)
        gqa = q.shape[1] != k.shape[1]
        t = time.perf_counter()
        out = flex_fn(q, k, v, block_mask=bm, enable_gqa=gqa)
        row["torch_flex_first_call_s"] = time.perf_counter() - t   # the compile, on a GPU
        row["torch_flex_diff"] = _rel(out, ours_out)
        row["torch_flex_ms"] = clock.ms(lambda: flex_fn(q, k, v, block_mask=bm, enable_gqa=gqa))
    except Exception as exc:   # a compile failure is a result to report, not a reason to stop
        row.setdefault("errors", {})["torch_flex"] = _error(exc)


def _ratios(row: dict, bytes_read: int) -> None:
    """TB/s and % of the copy of every front door timed, and fa3 flex / fa3 decode against SDPA and
    torch's flex (X's time over ours)."""
    copy_tbps = 2 * bytes_read / row["copy_ms"] / 1e9 if "copy_ms" in row else None
    if copy_tbps is not None:
        row["copy_tbps"] = copy_tbps
    for key, _ in FRONT_DOORS:
        if f"{key}_ms" not in row:
            continue
        row[f"{key}_tbps"] = bytes_read / row[f"{key}_ms"] / 1e9
        if copy_tbps is not None:
            row[f"{key}_pct_copy"] = 100 * row[f"{key}_tbps"] / copy_tbps
        for other in ("sdpa", "torch_flex"):
            if f"{other}_ms" in row and key != "fa3_paged":
                row[f"{key}_vs_{other}"] = row[f"{other}_ms"] / row[f"{key}_ms"]
    for other in ("sdpa", "torch_flex"):
        if f"{other}_ms" in row:
            row[f"{other}_tbps"] = bytes_read / row[f"{other}_ms"] / 1e9
    if "fa3_paged_ms" in row and "fa3_decode_ms" in row:
        row["paged_over_contig"] = row["fa3_paged_ms"] / row["fa3_decode_ms"]


def _case_row(part: str, c: DecodeCase, itemsize: int = 2) -> dict:
    row = dict(part=part, B=c.batch, new=c.new, N=c.cache, HQ=c.hq, HKV=c.hkv, D=c.d,
               kv_gb=c.kv_bytes(itemsize) / 1e9)
    if c.page:
        row["page"] = c.page
    return row


def _decode_inputs(c: DecodeCase, device: torch.device, dtype: torch.dtype):
    q = torch.randn(c.batch, c.hq, c.new, c.d, device=device, dtype=dtype)
    k, v = (torch.randn(c.batch, c.hkv, c.cache, c.d, device=device, dtype=dtype) for _ in range(2))
    lens = torch.full((c.batch,), c.cache, dtype=torch.int32, device=device)
    return q, k, v, lens


def _planned_splits(q, k, v, lens, **options) -> int:
    """The split count flex_decode's plan picks for this call (host-side planning only)."""
    from fa3_inductor.templates.decode import prepare_decode

    run_q, run_k, run_v = (q, k, v) if q.is_cuda or q.dtype != torch.bfloat16 else (q.float(), k.float(), v.float())
    out = run_q.new_empty(q.shape[:3] + (v.shape[-1],))
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    return prepare_decode(run_q, run_k, run_v, out, lse, sm_scale=q.shape[-1] ** -0.5, seq_lens=lens,
                          **options)[0][3][0]


def decode_row(c: DecodeCase, device: torch.device, dtype: torch.dtype, clock: Clock, flex_fn) -> dict:
    """One decode row: our front doors and the copy in the same rounds, then SDPA's backends and
    torch's flex."""
    import fa3_inductor
    from fa3_inductor import flex_decode

    row = _case_row("decode", c, dtype.itemsize)
    q, k, v, lens = _decode_inputs(c, device, dtype)
    gqa = c.hq != c.hkv
    impls = {"fa3_flex": lambda: fa3_inductor.flex(q, k, v, enable_gqa=gqa),
             "fa3_decode": lambda: flex_decode(q, k, v, seq_lens=lens)}
    if c.kv_bytes(dtype.itemsize) <= PAGED_KV_CAP and c.cache % DECODE_PAGE == 0:
        kp, vp, table = _pages(k, v, DECODE_PAGE)
        impls["fa3_paged"] = lambda: flex_decode(q, kp, vp, seq_lens=lens, block_table=table)
        row["page"] = DECODE_PAGE
    fns, outs = {}, {}
    for name, fn in impls.items():
        try:
            outs[name] = fn()
            if name == "fa3_flex":
                row["fa3_flex_family"] = fa3_inductor.last_template()
            fns[name] = fn
        except Exception as exc:   # reported in the row; the others are still timed
            row.setdefault("errors", {})[name] = _error(exc)
    ref = outs.get("fa3_flex", outs.get("fa3_decode"))
    for name, out in outs.items():
        if out is not ref:
            row[f"{name}_diff"] = _rel(out, ref)
    try:
        row["splits"] = _planned_splits(q, k, v, lens)
    except Exception as exc:
        row.setdefault("errors", {})["splits"] = _error(exc)
    src = torch.empty(c.kv_bytes(dtype.itemsize), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timed = clock.times({**fns, "copy": lambda: dst.copy_(src)})
    row.update({f"{name}_ms": ms for name, ms in timed.items()})
    src = dst = None
    for name, fn in fns.items():
        row[f"{name}_host_us"] = clock.host_us(fn)
    if ref is None:
        ref = torch.zeros_like(q)
    _sdpa_decode(row, q, k, v, clock, ref)
    _torch_flex_decode(row, q, k, v, clock, flex_fn, ref)
    _ratios(row, c.kv_bytes(dtype.itemsize))
    return row


def splits_row(c: DecodeCase, device: torch.device, dtype: torch.dtype, clock: Clock, counts=SPLIT_COUNTS) -> dict:
    """flex_decode at every split count that gives each split a tile or more, the chosen count
    ("auto") and the copy in the same rounds; then the fixed cost: every length 0 at the chosen
    count and at 1 split (the launch, its programs' start and the last split's merge, no key read)."""
    from fa3_inductor import flex_decode
    from fa3_inductor.templates.decode.configs import decode_config

    row = _case_row("splits", c, dtype.itemsize)
    q, k, v, lens = _decode_inputs(c, device, dtype)
    empty = torch.zeros_like(lens)
    row["splits"] = auto = _planned_splits(q, k, v, lens)
    cap = device.type == "cuda" and torch.cuda.get_device_capability(device)
    block_n = decode_config(c.d, cap or None).block_n
    counts = sorted({s for s in counts if s * block_n <= c.cache} | {auto})
    fns = {f"S{s}": (lambda s=s: flex_decode(q, k, v, seq_lens=lens, num_splits=s)) for s in counts}
    fns["empty_auto"] = lambda: flex_decode(q, k, v, seq_lens=empty)
    fns["empty_S1"] = lambda: flex_decode(q, k, v, seq_lens=empty, num_splits=1)
    ref = fns[f"S{auto}"]()
    worst = 0.0
    for s in counts:
        worst = max(worst, _rel(fns[f"S{s}"](), ref))
    row["splits_diff"] = worst
    src = torch.empty(c.kv_bytes(dtype.itemsize), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timed = clock.times({**fns, "copy": lambda: dst.copy_(src)})
    row["by_splits_ms"] = {s: timed[f"S{s}"] for s in counts}
    best = min(counts, key=lambda s: timed[f"S{s}"])
    row.update(auto_ms=timed[f"S{auto}"], best_splits=best, best_ms=timed[f"S{best}"],
               auto_over_best=timed[f"S{auto}"] / timed[f"S{best}"], copy_ms=timed["copy"],
               empty_auto_ms=timed["empty_auto"], empty_S1_ms=timed["empty_S1"])
    row["copy_tbps"] = 2 * c.kv_bytes(dtype.itemsize) / row["copy_ms"] / 1e9
    for key in ("auto", "best"):
        row[f"{key}_pct_copy"] = 100 * (c.kv_bytes(dtype.itemsize) / row[f"{key}_ms"] / 1e9) / row["copy_tbps"]
    return row


def paged_row(c: DecodeCase, device: torch.device, dtype: torch.dtype, clock: Clock,
              page_sizes=PAGE_SIZES) -> dict:
    """flex_decode on the contiguous cache and on pages of each size (shuffled tables), same rounds."""
    from fa3_inductor import flex_decode

    row = _case_row("paged", c, dtype.itemsize)
    q, k, v, lens = _decode_inputs(c, device, dtype)
    fns = {"contig": lambda: flex_decode(q, k, v, seq_lens=lens)}
    for page in page_sizes:
        kp, vp, table = _pages(k, v, page)
        fns[f"page{page}"] = (lambda kp=kp, vp=vp, table=table:
                              flex_decode(q, kp, vp, seq_lens=lens, block_table=table))
    if 64 in page_sizes and device.type == "cuda":
        kp, vp, table = _pages(k, v, 64)
        # pages at the contiguous cache's split count (configs.PAGED_PROGRAMS_PER_SM against
        # PROGRAMS_PER_SM). The contiguous cache's whole plan (its tiles and pipeline depth too) was
        # timed here until 2026-11-29 and dropped: decode-tiles-…-0436 / -0441 settled it (slower)
        row["splits_contig"] = _planned_splits(q, k, v, lens)
        row["splits_paged"] = _planned_splits(q, kp, vp, lens, block_table=table)
        fns["page64_contig_splits"] = (lambda kp=kp, vp=vp, table=table, n=row["splits_contig"]:
                                       flex_decode(q, kp, vp, seq_lens=lens, block_table=table, num_splits=n))
    ref = fns["contig"]()
    row["paged_diff"] = max(_rel(fn(), ref) for name, fn in fns.items() if name != "contig")
    timed = clock.times(fns)
    row["contig_ms"] = timed["contig"]
    row["by_page_ms"] = {p: timed[f"page{p}"] for p in page_sizes}
    row["by_page_over_contig"] = {p: timed[f"page{p}"] / timed["contig"] for p in page_sizes}
    row["paged_over_contig"] = max(row["by_page_over_contig"].values())
    if "page64_contig_splits" in timed:
        row["page64_contig_splits_over_contig"] = timed["page64_contig_splits"] / timed["contig"]
    return row


# ------------------------------------------------------------------------------------ prefill
def _pf(b: int, n: int, c: int) -> DecodeCase:
    return DecodeCase(b, n, c * K, 32, 8, 128, page=DECODE_PAGE)


QUICK_PREFILL = [_pf(1, 512, 8), _pf(1, 2048, 32), _pf(4, 1024, 16), _pf(8, 256, 4)]
PREFILL_MORE = [_pf(1, 4096, 128), _pf(16, 512, 8)]   # the default set adds these (memory allowing)
SMOKE_PREFILL = [DecodeCase(2, 72, 160, 4, 2, 16, page=16)]   # 2 x 72 = 144 packed rows: past the decode kernels


def prefill_cases(full: bool, quick: bool = False) -> list[DecodeCase]:
    """Rows of the prefill part: chunks of ``new`` tokens at the end of a cache of ``cache`` keys.

    Example::

        >>> [c.label() for c in prefill_cases(False, quick=True)][:1]
        ['1x512x8k 32/8 D128 page64']
    """
    return list(QUICK_PREFILL) + ([] if quick else list(PREFILL_MORE))


def causal_abs(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """Causal on absolute positions: flex_decode hands its mods q_idx = q_offset[b] + i (by
    default seq_lens[b] - M_new + i), so the chunk is causal among itself and sees the prefix."""
    return q_idx >= kv_idx


PREFILL_WINDOW = 2048   # the window probe's keys: a sliding window on absolute positions


def window_abs(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """A causal sliding window of PREFILL_WINDOW keys on absolute positions (Mistral's, Gemma's local layers)."""
    return (q_idx >= kv_idx) & (q_idx - kv_idx < PREFILL_WINDOW)


def _prefix_causal(offset: int) -> Callable:
    """The same mask for torch's flex, whose q_idx counts from the chunk's first row."""
    def mask(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx
    return mask


def prefill_pairs(c: DecodeCase) -> int:
    """(q, kv) pairs a chunk of c.new tokens ending a cache of c.cache keys computes, per (batch,
    head): row i (0-based) sees cache - new + i + 1 keys.

    Example::

        >>> prefill_pairs(DecodeCase(1, 2, 5, 1, 1, 16))   # rows see 4 and 5 keys
        9
    """
    return c.new * (c.cache - c.new) + c.new * (c.new + 1) // 2


def check_prefill(device: torch.device, dtype: torch.dtype) -> dict:
    """flex_decode on a prefill chunk (more packed rows than the decode kernels take, so the
    gathered path) with causal_abs, paged and contiguous, per batch against float64 attention over
    the first seq_lens[b] keys with the chunk at positions seq_lens[b] - M .. seq_lens[b] - 1."""
    from reference import TOLERANCE, reference_attention, rel_error

    from fa3_inductor import flex_decode

    small = device.type == "cpu"
    B, HQ, HKV, M, D, page = (2, 4, 2, 72, 16, 16) if small else (2, 32, 8, 160, 128, 64)
    N = 6 * page if small else 4 * page
    lens = torch.tensor([N, N - page // 2 - 3], dtype=torch.int32, device=device)   # a partial last page
    q = torch.randn(B, HQ, M, D, device=device, dtype=dtype)
    k, v = (torch.randn(B, HKV, N, D, device=device, dtype=dtype) for _ in range(2))
    k_pages, v_pages, table = _pages(k, v, page, spare=2)
    outs = dict(contiguous=flex_decode(q, k, v, seq_lens=lens, mask_mod=causal_abs),
                paged=flex_decode(q, k_pages, v_pages, seq_lens=lens, block_table=table, mask_mod=causal_abs))
    errors = {}
    for name, out in outs.items():
        worst = 0.0
        for z, L in enumerate(lens.tolist()):
            ref, _ = reference_attention(q[z:z + 1], k[z:z + 1, :, :L], v[z:z + 1, :, :L],
                                         mask_mod=_prefix_causal(L - M))
            worst = max(worst, rel_error(out[z:z + 1], ref))
        errors[name] = worst
    tol = TOLERANCE[dtype]
    if max(errors.values()) > tol:
        raise SystemExit(f"serving: flex_decode on a prefill chunk does not match float64 ({errors}, tolerance "
                         f"{tol}); fix flex_decode's chunk path before timing it (tests/test_decode_api.py)")
    return dict(shape=f"B{B} HQ{HQ}/HKV{HKV} new{M} N{N} D{D} page{page}", rel_error=errors, tol=tol)


def _torch_flex_prefill(row: dict, q, k, v, clock: Clock, flex_fn, ours_out: torch.Tensor) -> None:
    """torch's flex on the contiguous cache, its block mask built once here (outside the timing)."""
    from torch.nn.attention.flex_attention import create_block_mask

    try:
        bm = create_block_mask(_prefix_causal(k.shape[2] - q.shape[2]), None, None, q.shape[2], k.shape[2],
                               device=q.device)
        t = time.perf_counter()
        out = flex_fn(q, k, v, block_mask=bm, enable_gqa=True)
        row["torch_flex_first_call_s"] = time.perf_counter() - t   # the compile, on a GPU
        row["torch_flex_diff"] = _rel(out, ours_out)
        row["torch_flex_ms"] = clock.ms(lambda: flex_fn(q, k, v, block_mask=bm, enable_gqa=True))
    except Exception as exc:   # a compile failure is a result to report, not a reason to stop
        row.setdefault("errors", {})["torch_flex"] = _error(exc)


def prefill_row(c: DecodeCase, device: torch.device, dtype: torch.dtype, clock: Clock, flex_fn) -> dict:
    """A prefill chunk through flex_decode on pages of c.page (shuffled table) and on the contiguous
    cache, and the paged call's gather alone, in the same rounds; then torch's flex (module
    docstring, part prefill)."""
    import fa3_inductor
    from fa3_inductor import block_masks, flex_decode
    from fa3_inductor.decode import _contiguous_view, _flex_mods, _gathered
    from fa3_inductor.runtime.variants import wait_for_variants

    row = _case_row("prefill", c, dtype.itemsize)
    kv = c.kv_bytes(dtype.itemsize)
    # the cache, its pages, the paged call's gathered copy and the gather's own: 4 x K+V, plus q and outputs
    need = 4 * kv + 6 * c.batch * c.hq * c.new * c.d * dtype.itemsize
    if need > 0.85 * _free_bytes(device):
        row["errors"] = {"row": f"needs ~{need / 2 ** 30:.1f} GiB, {_free_bytes(device) / 2 ** 30:.1f} GiB free"}
        return row
    q, k, v, lens = _decode_inputs(c, device, dtype)
    kp, vp, table = _pages(k, v, c.page)
    kp16, vp16, table16 = _pages(k, v, 16)   # vLLM's default page: eight a 128-key tile
    kp8, vp8, table8 = _pages(k, v, 8)       # sixteen a tile: the smallest page the cache mode reads as TMA boxes

    def gather() -> tuple[torch.Tensor, torch.Tensor]:
        # what _gathered does before it calls flex(): the pages' copy, the chunk's first position, the mods
        kc, vc = _contiguous_view(q, kp, vp, table, lens)
        _flex_mods(None, causal_abs, lens, lens - q.shape[2])
        return kc, vc

    qoff = lens - c.new   # the default positions, in a tensor that outlives the calls
    fns = {"paged": lambda: flex_decode(q, kp, vp, seq_lens=lens, block_table=table, mask_mod=causal_abs),
           "contig": lambda: flex_decode(q, k, v, seq_lens=lens, mask_mod=causal_abs),
           "gather": gather,
           "paged16": lambda: flex_decode(q, kp16, vp16, seq_lens=lens, block_table=table16, mask_mod=causal_abs),
           "paged8": lambda: flex_decode(q, kp8, vp8, seq_lens=lens, block_table=table8, mask_mod=causal_abs),
           # a probe: another mask_mod (no closed-form walk: the cache mode applies it on every tile; the gathered
           # path's block mask, evaluated per call, skips the tiles outside the window)
           "paged_window": lambda: flex_decode(q, kp, vp, seq_lens=lens, block_table=table, mask_mod=window_abs),
           "gathered_window": lambda: _gathered(q, kp, vp, lens, table, None, None, window_abs, c.d ** -0.5,
                                                False),
           "gathered": lambda: _gathered(q, kp, vp, lens, table, None, None, causal_abs, c.d ** -0.5, False),
           # a probe: without q_offset each call's positions are a new tensor, which keys its block mask anew
           "paged_qoff": lambda: flex_decode(q, kp, vp, seq_lens=lens, block_table=table, q_offset=qoff,
                                             mask_mod=causal_abs),
           "contig_qoff": lambda: flex_decode(q, k, v, seq_lens=lens, q_offset=qoff, mask_mod=causal_abs)}
    t = time.perf_counter()
    ref = fns["paged"]()
    row["paged_first_call_s"] = time.perf_counter() - t   # planning and compiles, on a GPU
    row["template"] = fa3_inductor.last_template()
    row["contig_diff"] = _rel(fns["contig"](), ref)
    for name in ("paged_qoff", "contig_qoff"):
        row[f"{name}_diff"] = _rel(fns[name](), ref)
    wait_for_variants()   # background compiles of the first calls would slow the host while timed
    row["gathered_diff"] = _rel(fns["gathered"](), ref)
    row["paged16_diff"] = _rel(fns["paged16"](), ref)
    row["paged8_diff"] = _rel(fns["paged8"](), ref)
    row["window_diff"] = _rel(fns["paged_window"](), fns["gathered_window"]())
    row["gather_diff"] = _rel(torch.cat(gather()), torch.cat([k, v]))   # an exact copy: 0
    timed = clock.times(fns)
    row.update({f"{name}_ms": ms for name, ms in timed.items()})
    # the probe first: the others' masks, one new per call, push its mask out of flex()'s LRU of them
    for name in ("paged_qoff", "contig_qoff", "paged", "contig"):
        calls = [0]

        def counted(fn: Callable = fns[name]) -> torch.Tensor:
            calls[0] += 1
            return fn()
        built = block_masks.stats()["built"]
        row[f"{name}_host_us"] = clock.host_us(counted)
        # a block mask built on every call is inside the timed calls above
        row[f"{name}_mask_builds"] = (block_masks.stats()["built"] - built) / calls[0]
    _torch_flex_prefill(row, q, k, v, clock, flex_fn, ref)
    flops = 4 * c.batch * c.hq * c.d * prefill_pairs(c)
    row["flops"] = flops
    for name in ("paged", "contig", "paged_qoff", "contig_qoff", "torch_flex"):
        if f"{name}_ms" in row:
            row[f"{name}_tflops"] = flops / row[f"{name}_ms"] / 1e9
    row["paged_over_contig"] = timed["paged"] / timed["contig"]
    row["qoff_paged_over_contig"] = timed["paged_qoff"] / timed["contig_qoff"]
    row["gather_pct_paged"] = 100 * timed["gather"] / timed["paged"]
    row["gathered_over_paged"] = timed["gathered"] / timed["paged"]
    row["paged16_over_contig"] = timed["paged16"] / timed["contig"]
    row["paged8_over_contig"] = timed["paged8"] / timed["contig"]
    row["gathered_over_paged8"] = timed["gathered"] / timed["paged8"]
    row["gathered_window_over_paged"] = timed["gathered_window"] / timed["paged_window"]
    if timed["paged_qoff"] > timed["contig_qoff"]:
        # the copy against paged's whole extra time, on the pair whose block mask is not rebuilt (noise)
        row["gather_pct_extra"] = 100 * timed["gather"] / (timed["paged_qoff"] - timed["contig_qoff"])
    if "torch_flex_ms" in row:
        for name in ("paged", "contig", "paged_qoff"):
            row[f"{name}_vs_torch_flex"] = row["torch_flex_ms"] / timed[name]
    return row


def _prefill_table(rows: list[dict]) -> list[str]:
    lines = ["## prefill chunks on a paged cache (flex_decode; causal on absolute positions; same rounds)", "",
             "paged: `flex_decode(q, k_pages, v_pages, seq_lens, block_table, mask_mod=causal_abs)` on pages behind "
             "a shuffled table; contig: the same call on the contiguous cache; gather: the paged call's work before "
             "flex() (the pages' copy); torch flex: compiled FlexAttention on the contiguous cache, block mask built "
             "once. TFLOP/s: 4 B HQ D x the (row, key) pairs the chunk sees; paged/contig: paged's time over "
             "contig's; gathered: decode._gathered on the pages (the copy, then flex()), gathered/paged its time "
             "over paged's; "
             "paged16: the paged call on pages of 16 (vLLM's default), paged16/contig its time over contig's; "
             "paged8: on pages of 8 (the path that serves them: gathered while cache_sm90.page_served refuses 8), "
             "its time over contig's, and gathered's time over paged8's; "
             f"window: a probe, the paged call with a causal sliding window of {PREFILL_WINDOW} keys (window_abs) "
             "and decode._gathered with it, ms each and the gathered one's time over the paged one's; "
             "ours/torch flex: torch flex's time over paged's (contig's). q_offset: a probe, paged and "
             "contig with q_offset=seq_lens - new passed as one tensor kept across calls (the same positions); "
             "gather % extra: gather over (paged - contig), both with q_offset kept. mask builds: block masks "
             "built per flex_decode call, paged / contig / paged q_offset / contig q_offset (0: reused).", "",
             "| B | new | cache | HQ/HKV | D | KV GB | paged ms | contig ms | gather ms | q_offset paged ms | "
             "q_offset contig ms | torch flex ms | paged TFLOP/s | contig TFLOP/s | q_offset paged TFLOP/s | "
             "torch flex TFLOP/s | paged/contig | q_offset paged/contig | gather % paged | gather % extra | "
             "ours/torch flex (contig) | q_offset paged/torch flex | host µs paged / contig / q_offset paged | "
             "mask builds | gathered ms | gathered/paged | paged16 ms | paged16/contig | paged8 ms | paged8/contig | "
             "gathered/paged8 | window ms paged / gathered (ratio) | max diff | template |", "|" + "---|" * 34]
    for r in rows:
        diff = max([r[k] for k in r if k.endswith("_diff")], default=None)
        builds = " / ".join(_f(r, f"{n}_mask_builds", "{:.1f}")
                            for n in ("paged", "contig", "paged_qoff", "contig_qoff"))
        lines.append(f"{_shape(r)} {r['kv_gb']:.2f} | {_f(r, 'paged_ms')} | {_f(r, 'contig_ms')} | "
                     f"{_f(r, 'gather_ms')} | {_f(r, 'paged_qoff_ms')} | {_f(r, 'contig_qoff_ms')} | "
                     f"{_f(r, 'torch_flex_ms')} | {_f(r, 'paged_tflops', '{:.0f}')} | "
                     f"{_f(r, 'contig_tflops', '{:.0f}')} | {_f(r, 'paged_qoff_tflops', '{:.0f}')} | "
                     f"{_f(r, 'torch_flex_tflops', '{:.0f}')} | {_f(r, 'paged_over_contig', '{:.3f}')} | "
                     f"{_f(r, 'qoff_paged_over_contig', '{:.3f}')} | {_f(r, 'gather_pct_paged', '{:.0f}')} | "
                     f"{_f(r, 'gather_pct_extra', '{:.0f}')} | {_f(r, 'paged_vs_torch_flex', '{:.2f}')} "
                     f"({_f(r, 'contig_vs_torch_flex', '{:.2f}')}) | {_f(r, 'paged_qoff_vs_torch_flex', '{:.2f}')} | "
                     f"{_f(r, 'paged_host_us', '{:.0f}')} / {_f(r, 'contig_host_us', '{:.0f}')} / "
                     f"{_f(r, 'paged_qoff_host_us', '{:.0f}')} | {builds} | {_f(r, 'gathered_ms')} | "
                     f"{_f(r, 'gathered_over_paged', '{:.2f}')} | {_f(r, 'paged16_ms')} | "
                     f"{_f(r, 'paged16_over_contig', '{:.3f}')} | {_f(r, 'paged8_ms')} | "
                     f"{_f(r, 'paged8_over_contig', '{:.3f}')} | {_f(r, 'gathered_over_paged8', '{:.2f}')} | "
                     f"{_f(r, 'paged_window_ms')} / "
                     f"{_f(r, 'gathered_window_ms')} ({_f(r, 'gathered_window_over_paged', '{:.2f}')}) | "
                     f"{'-' if diff is None else f'{diff:.1e}'} | {r.get('template', '-')} |")
    return lines + [""]


# ------------------------------------------------------------------------------------ window
DECODE_WINDOWS = (128, 1024, 4096)   # gpt-oss's, Gemma 3's and Mistral's sliding windows
WINDOW_DECODE = [DecodeCase(1, 1, 32 * K, 32, 8, 128, page=DECODE_PAGE), DecodeCase(8, 1, 32 * K, 32, 8, 128,
                 page=DECODE_PAGE), DecodeCase(1, 1, 128 * K, 32, 8, 128, page=DECODE_PAGE)]
SMOKE_WINDOW = [DecodeCase(2, 1, 512, 4, 2, 16, page=16)]


def window_row(c: DecodeCase, device: torch.device, dtype: torch.dtype, clock: Clock, flex_fn) -> dict:
    """Decode under causal sliding windows (module docstring, part window): flex_decode with mods.sliding_window(W)
    for each of DECODE_WINDOWS and without a mask (the whole cache), the middle window on pages too, all in the same
    rounds; then torch's flex with that window's block mask (built once, outside the timing)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from fa3_inductor import flex_decode, mods

    row = _case_row("window", c, dtype.itemsize)
    q, k, v, lens = _decode_inputs(c, device, dtype)
    kp, vp, table = _pages(k, v, c.page)
    mid = DECODE_WINDOWS[len(DECODE_WINDOWS) // 2] if c.cache > 4 * K else 64
    windows = DECODE_WINDOWS if c.cache > 4 * K else (8, 64, 256)
    fns = {"full": lambda: flex_decode(q, k, v, seq_lens=lens)}
    for w in windows:
        fns[f"w{w}"] = (lambda w=w: flex_decode(q, k, v, seq_lens=lens, mask_mod=mods.sliding_window(w)))
    fns["paged_mid"] = lambda: flex_decode(q, kp, vp, seq_lens=lens, block_table=table,
                                           mask_mod=mods.sliding_window(mid))
    ref = fns[f"w{mid}"]()
    row["paged_diff"] = _rel(fns["paged_mid"](), ref)
    from reference import reference_attention

    last = c.cache - c.new
    want, _ = reference_attention(q, k, v, mask_mod=lambda b, h, qi, ki: (qi + last >= ki) & (qi + last - ki < mid))
    row["ref_diff"] = _rel(ref, want.to(ref.dtype))
    row.update({f"{name}_ms": ms for name, ms in clock.times(fns).items()})
    row["mid"] = mid
    row["windows"] = list(windows)
    row["window_gb"] = 2 * c.batch * c.hkv * min(mid + c.new, c.cache) * c.d * dtype.itemsize / 1e9
    row["mid_tbps"] = row["window_gb"] / row[f"w{mid}_ms"]
    row["full_over_mid"] = row["full_ms"] / row[f"w{mid}_ms"]
    row["paged_over_contig"] = row["paged_mid_ms"] / row[f"w{mid}_ms"]
    try:
        bm = create_block_mask(lambda b, h, qi, ki: (qi + last >= ki) & (qi + last - ki < mid), None, None, c.new,
                               c.cache, device=q.device)
        out = flex_fn(q, k, v, block_mask=bm, enable_gqa=c.hq != c.hkv)
        row["torch_flex_diff"] = _rel(out, ref)
        row["torch_flex_ms"] = clock.ms(lambda: flex_fn(q, k, v, block_mask=bm, enable_gqa=c.hq != c.hkv))
        row["vs_torch_flex"] = row["torch_flex_ms"] / row[f"w{mid}_ms"]
    except Exception as exc:   # a compile failure is a result to report, not a reason to stop
        row.setdefault("errors", {})["torch_flex"] = _error(exc)
    return row


def _window_table(rows: list[dict]) -> list[str]:
    lines = ["## decode under causal sliding windows (flex_decode, mods.sliding_window; same rounds)", "",
             "full: flex_decode without a mask (the whole cache); wW: with mods.sliding_window(W); paged: the middle "
             "window on pages of 64 behind a shuffled table, its time over the contiguous one's; torch flex: "
             "compiled FlexAttention with the middle window's block mask (built once). TB/s: the middle window's "
             "K+V bytes (W + new keys a sequence) / its time.", "",
             "| B | cache | HQ/HKV | D | full ms | windows | window ms | paged/contig (mid) | torch flex ms (mid) | "
             "ours/torch flex (mid) | full/mid | mid TB/s | max diff |", "|" + "---|" * 13]
    for r in rows:
        ws = r.get("windows", [])
        diff = max([r[k] for k in r if k.endswith("_diff")], default=None)
        lines.append(f"| {r['B']} | {r['N'] // K}k | {r['HQ']}/{r['HKV']} | {r['D']} | {_f(r, 'full_ms')} | "
                     f"{' / '.join(str(w) for w in ws)} | {' / '.join(_f(r, f'w{w}_ms') for w in ws)} | "
                     f"{_f(r, 'paged_over_contig')} | {_f(r, 'torch_flex_ms')} | {_f(r, 'vs_torch_flex', '{:.2f}')} | "
                     f"{_f(r, 'full_over_mid', '{:.1f}')} | {_f(r, 'mid_tbps', '{:.2f}')} | "
                     f"{'-' if diff is None else f'{diff:.1e}'} |")
    return lines + [""]


# ------------------------------------------------------------------------------------ fp8kv
def _fp8_caches(k: torch.Tensor, v: torch.Tensor, page: int) -> dict:
    """FP8 copies of the cache: contiguous with per kv head scales, and (page > 0) pages of ``page``
    behind a shuffled table with per page scales, beside the same pages in the cache's dtype."""
    from fa3_inductor import quantize_kv

    k8, v8, ks, vs = quantize_kv(k, v, "head")
    caches = dict(fp8=(k8, v8, None, ks, vs))
    if page:
        kp, vp, table = _pages(k, v, page)
        kp8, vp8, ksp, vsp = quantize_kv(kp, vp, "page", paged=True)
        caches.update(bf16_paged=(kp, vp, table, None, None), fp8_paged=(kp8, vp8, table, ksp, vsp))
    return caches


def check_fp8kv(device: torch.device, dtype: torch.dtype) -> dict:
    """flex_decode over FP8 caches (per head contiguous, per page paged) against float64 attention
    on the dequantized cache, at q's dtype's tolerance."""
    from reference import TOLERANCE

    from fa3_inductor import flex_decode
    from fa3_inductor.templates.decode.fp8_cache import dequantize

    small = device.type == "cpu"
    B, HQ, HKV, D, page = (2, 4, 2, 16, 16) if small else (3, 32, 8, 128, 64)
    N = 4 * page
    lens = torch.tensor([N, N - page // 2 - 3, 1][:B], dtype=torch.int32, device=device)
    q = torch.randn(B, HQ, 1, D, device=device, dtype=dtype)
    k, v = (torch.randn(B, HKV, N, D, device=device, dtype=dtype) for _ in range(2))
    errors = {}
    for name, (kc, vc, table, ks, vs) in _fp8_caches(k, v, page).items():
        if ks is None:
            continue
        mode = "page" if table is not None else "head"
        out = flex_decode(q, kc, vc, seq_lens=lens, block_table=table, k_scale=ks, v_scale=vs)
        real = [dequantize(c, s, mode, table is not None, torch.float64) for c, s in ((kc, ks), (vc, vs))]
        if table is not None:   # gathered to [B, HKV, N, D]
            real = [r[table.long()].reshape(B, -1, HKV, D).transpose(1, 2) for r in real]
        errors[name] = _worst_error(out, q, *real, lens)
    tol = TOLERANCE[dtype]
    if max(errors.values()) > tol:
        raise SystemExit(f"serving: flex_decode over an FP8 cache does not match float64 ({errors}, "
                         f"tolerance {tol}); fix it before timing it (tests/test_decode_fp8kv.py)")
    return dict(shape=f"B{B} HQ{HQ}/HKV{HKV} N{N} D{D} page{page}", rel_error=errors, tol=tol)


def _bn128(q: torch.Tensor, caches: tuple, lens: torch.Tensor) -> Callable:
    """The FP8 contiguous call through prepare_decode with tiles of twice the planned keys (the
    FP8 tile then holds as many bytes as the bf16 one)."""
    from fa3_inductor.templates.decode import prepare_decode
    from fa3_inductor.templates.decode.configs import DecodeConfig, decode_config, few_programs, sm_count

    k8, v8, _, ks, vs = caches
    cap = tuple(torch.cuda.get_device_capability(q.device)) if q.is_cuda else None
    sms = sm_count(cap, q.device.index if q.is_cuda else None)
    base = decode_config(q.shape[-1], cap, fp32=q.dtype == torch.float32,
                         few_programs=few_programs(q.shape[0], k8.shape[1], sms))
    cfg = DecodeConfig(2 * base.block_n, base.num_warps, base.num_stages, base.resident)
    out = q.new_empty(q.shape)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    [(kernel, args, kwargs, grid)] = prepare_decode(q, k8, v8, out, lse, sm_scale=q.shape[-1] ** -0.5,
                                                    seq_lens=lens, k_scale=ks, v_scale=vs, config=cfg)

    def run() -> torch.Tensor:
        kernel[grid](*args, **kwargs)
        return out
    return run


def fp8kv_row(c: DecodeCase, device: torch.device, dtype: torch.dtype, clock: Clock) -> dict:
    """flex_decode over FP8 caches and over the bf16 cache they were quantized from, and a copy of
    the FP8 bytes, in the same rounds (module docstring, part fp8kv)."""
    from fa3_inductor import flex_decode
    from fa3_inductor.templates.decode.fp8_cache import dequantize

    row = _case_row("fp8kv", c, 1)
    row["bf16_kv_gb"] = c.kv_bytes(dtype.itemsize) / 1e9
    q, k, v, lens = _decode_inputs(c, device, dtype)
    page = DECODE_PAGE if c.cache % DECODE_PAGE == 0 and c.kv_bytes(dtype.itemsize) <= PAGED_KV_CAP else 0
    caches = dict(bf16=(k, v, None, None, None), **_fp8_caches(k, v, page))
    fns = {name: (lambda kc=kc, vc=vc, table=table, ks=ks, vs=vs:
                  flex_decode(q, kc, vc, seq_lens=lens, block_table=table, k_scale=ks, v_scale=vs))
           for name, (kc, vc, table, ks, vs) in caches.items()}
    if page:
        row["page"] = page
    try:
        fns["fp8_bn128"] = _bn128(q, caches["fp8"], lens)
    except Exception as exc:   # reported in the row; the others are still timed
        row.setdefault("errors", {})["fp8_bn128"] = _error(exc)
    outs = {name: fn().clone() for name, fn in fns.items()}
    k8, v8, _, ks, vs = caches["fp8"]
    real = [dequantize(t, s, "head", False, dtype) for t, s in ((k8, ks), (v8, vs))]
    same_values = flex_decode(q, real[0], real[1], seq_lens=lens)
    for name in ("fp8", "fp8_paged", "fp8_bn128"):
        if name in outs and name != "fp8_paged":
            row[f"{name}_vs_dequant_diff"] = _rel(outs[name], same_values)
    if "fp8_paged" in outs:
        row["fp8_paged_vs_fp8_err"] = _rel(outs["fp8_paged"], outs["fp8"])   # other scales: not a _diff
    row["fp8_quant_err"] = _rel(outs["fp8"], outs["bf16"])   # the quantization's own error
    row["splits"] = _planned_splits(q, k, v, lens)
    src = torch.empty(c.kv_bytes(1), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timed = clock.times({**fns, "copy": lambda: dst.copy_(src)})
    row.update({f"{name}_ms": ms for name, ms in timed.items()})
    src = dst = None
    row["copy_tbps"] = 2 * c.kv_bytes(1) / row["copy_ms"] / 1e9
    for name in fns:
        row[f"{name}_tbps"] = c.kv_bytes(dtype.itemsize if name.startswith("bf16") else 1) / timed[name] / 1e9
    row["fp8_over_bf16"] = timed["bf16"] / timed["fp8"]
    if page:
        row["fp8_paged_over_bf16_paged"] = timed["bf16_paged"] / timed["fp8_paged"]
    if "fp8_bn128" in timed:
        row["bn128_over_fp8"] = timed["fp8"] / timed["fp8_bn128"]
    return row


def _fp8kv_table(rows: list[dict]) -> list[str]:
    lines = ["## FP8 KV cache (flex_decode, e4m3 with per head / per page scales, against the bf16 cache; "
             "same rounds)", "",
             "TB/s: the bytes each call reads (FP8: K+V at 1 byte a value); fp8/bf16: bf16's time over FP8's "
             "(> 1: FP8 faster); bn128: the FP8 kernel with 128-key tiles, fp8's time over its. diff: the FP8 "
             "output against bf16 flex_decode on the dequantized cache; quant err: against the unquantized "
             "cache.", "",
             "| B | new | cache | HQ/HKV | D | FP8 GB | splits | bf16 ms | fp8 ms | fp8 TB/s | copy TB/s | "
             "fp8/bf16 | bf16 paged ms | fp8 paged ms | fp8 paged TB/s | paged fp8/bf16 | bn128 ms | "
             "fp8/bn128 | diff | quant err |", "|" + "---|" * 20]
    for r in rows:
        lines.append(f"{_shape(r)} {r['kv_gb']:.2f} | {r.get('splits', '-')} | {_f(r, 'bf16_ms')} | "
                     f"{_f(r, 'fp8_ms')} | {_f(r, 'fp8_tbps', '{:.2f}')} | {_f(r, 'copy_tbps', '{:.2f}')} | "
                     f"{_f(r, 'fp8_over_bf16', '{:.2f}')} | {_f(r, 'bf16_paged_ms')} | {_f(r, 'fp8_paged_ms')} | "
                     f"{_f(r, 'fp8_paged_tbps', '{:.2f}')} | {_f(r, 'fp8_paged_over_bf16_paged', '{:.2f}')} | "
                     f"{_f(r, 'fp8_bn128_ms')} | {_f(r, 'bn128_over_fp8', '{:.2f}')} | "
                     f"{_f(r, 'fp8_vs_dequant_diff', '{:.1e}')} | {_f(r, 'fp8_quant_err', '{:.1e}')} |")
    return lines + [""]


# ------------------------------------------------------------------------------------ varlen
VARLEN_TILES = ((128, 128, 8, 2), (128, 128, 8, 3))   # block_m, block_n, warps, stages (D128)
SMOKE_VARLEN_TILES = ((16, 16, 4, 1),)


def _varlen_tiles(q, k, v, cu, longest, tiles) -> Callable:
    """Our varlen kernel (causal) with the tiles ``tiles`` instead of configs.py's."""
    from fa3_inductor import mods
    from fa3_inductor.templates.modgen import is_causal_mask_source
    from fa3_inductor.templates.varlen.configs import VarlenConfig
    from fa3_inductor.templates.varlen.host import launch_varlen
    from fa3_inductor.varlen import generated_mod

    mask_fn, mask_bufs, source = generated_mod(mods.causal, "mask")
    out = q.new_empty(q.shape)
    lse = torch.empty(q.shape[1], q.shape[0], device=q.device, dtype=torch.float32)

    def run() -> torch.Tensor:
        launch_varlen(q, k, v, out, lse, cu, cu, longest, sm_scale=q.shape[-1] ** -0.5,
                      mask_mod=mask_fn, causal=is_causal_mask_source(source), mask_bufs=mask_bufs,
                      config=VarlenConfig(*tiles))
        return out
    return run


def varlen_row(c: VarlenCase, device: torch.device, dtype: torch.dtype, clock: Clock, flex_fn,
               tiles: tuple = ()) -> dict:
    """The pack through flex_varlen (and ``tiles`` variants), per-document SDPA, our document-mask
    path and torch flex."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask

    import fa3_inductor
    from fa3_inductor import mods
    from fa3_inductor.runtime.variants import wait_for_variants
    from fa3_inductor.templates.varlen.host import pick_varlen_kernel

    lengths = doc_lengths(c)
    T, H, D = c.tokens, c.heads, c.d
    row = dict(part="varlen", tokens=T, docs=c.docs, lengths=lengths, H=H, D=D, seed=c.seed)
    flops = 4 * H * D * causal_pairs(lengths)
    q, k, v = (torch.randn(T, H, D, device=device, dtype=dtype) for _ in range(3))
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(device=device, dtype=torch.int32)
    longest = max(lengths)
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
    docs = [[t[:, :, s:s + n].contiguous() for t in (q4, k4, v4)]
            for s, n in zip(cu[:-1].tolist(), lengths)]
    ids = torch.repeat_interleave(torch.arange(c.docs, device=device), torch.tensor(lengths, device=device))
    doc_mask = mods.and_masks(mods.document(ids, causal=False), mods.causal)
    bm = create_block_mask(doc_mask, None, None, T, T, device=device)

    def per_doc(name: str) -> Callable:
        def run():   # one output per document (joined for the comparison, outside the timing)
            with sdpa_kernel(_sdpa(name)):
                return [F.scaled_dot_product_attention(*d, is_causal=True) for d in docs]
        return run

    row["ours_kernel"] = pick_varlen_kernel(q, k, v, "auto", torch.cuda.get_device_capability(device)
                                            if device.type == "cuda" else None)
    impls = {
        "ours": lambda: fa3_inductor.flex_varlen(q, k, v, cu, cu, longest, longest, mask_mod=mods.causal),
        "ours_triton": lambda: fa3_inductor.flex_varlen(q, k, v, cu, cu, longest, longest, mask_mod=mods.causal,
                                                        kernel="triton"),
        "sdpa_cudnn_per_doc": per_doc("cudnn"),
        "sdpa_flash_per_doc": per_doc("flash"),
        "docmask": lambda: fa3_inductor.flex(q4, k4, v4, block_mask=bm),
        "flex": lambda: flex_fn(q4, k4, v4, block_mask=bm),
    }
    for t in tiles:
        impls["ours_" + "x".join(map(str, t))] = _varlen_tiles(q, k, v, cu, longest, t)
    ref = impls["ours"]().transpose(0, 1).unsqueeze(0)
    for name, fn in impls.items():
        try:
            out = fn()
            if name.startswith("ours"):   # packed [T, H, D] -> [1, H, T, D], the layout of the others
                out = out.transpose(0, 1).unsqueeze(0)
            elif isinstance(out, list):
                out = torch.cat(out, dim=2)
            if name == "docmask":
                row["docmask_template"] = fa3_inductor.last_template()
                wait_for_variants()   # its background compiles would slow the host while timed
            row[f"{name}_diff"] = _rel(out, ref)
            row[f"{name}_ms"] = clock.ms(fn)
            row[f"{name}_tflops"] = flops / row[f"{name}_ms"] / 1e9
        except Exception as exc:   # an impl that cannot run this pack is reported, not fatal
            row.setdefault("errors", {})[name] = _error(exc)
    for other in impls:
        if other != "ours" and "ours_ms" in row and f"{other}_ms" in row:
            row[f"vs_{other}"] = row[f"{other}_ms"] / row["ours_ms"]
    _varlen_window(row, q, k, v, cu, longest, clock)
    return row


VARLEN_WINDOW = 1024   # the varlen part's window probe: mods.sliding_window of this many keys


def _varlen_window(row: dict, q, k, v, cu, longest: int, clock: Clock) -> None:
    """A probe: the pack under a causal window of VARLEN_WINDOW keys, the Hopper kernel (which walks it from its
    edge) against the Triton varlen kernel (which masks every tile of each sequence)."""
    import fa3_inductor
    from fa3_inductor import mods

    window = mods.sliding_window(VARLEN_WINDOW)
    impls = {kernel: (lambda kernel=kernel: fa3_inductor.flex_varlen(q, k, v, cu, cu, longest, longest,
                                                                   mask_mod=window, kernel=kernel))
             for kernel in ("auto", "triton")}
    try:
        row["window_triton_diff"] = _rel(impls["triton"](), impls["auto"]())
        row["window_ms"] = clock.ms(impls["auto"])
        row["window_triton_ms"] = clock.ms(impls["triton"])
        row["window_vs_triton"] = row["window_triton_ms"] / row["window_ms"]
    except Exception as exc:   # reported, not fatal
        row.setdefault("errors", {})["window"] = _error(exc)


# ------------------------------------------------------------------------------------ report
def targets(rows: list[dict]) -> list[str]:
    """Issue 20's targets, met or not, row by row counted (ours: fa3 flex, the registered family
    as flex() reaches it; fa3 decode, flex_decode's contiguous cache, beside it).

    Example::

        >>> targets([dict(part="paged", paged_over_contig=1.02, paged_diff=0.0)])[1]
        'paged within 5% of contiguous: 1/1 rows'
    """
    def count(sel, ok) -> str:
        sel = list(sel)
        return f"{sum(1 for r in sel if ok(r))}/{len(sel)} rows"

    dec = [r for r in rows if r["part"] == "decode"]
    compared = [r for r in rows if any(key.endswith("_diff") for key in r)]
    lines = [f"every impl within {AGREE_TOL} (relative) of ours: "
             f"{count(compared, lambda r: max(r[k] for k in r if k.endswith('_diff')) <= AGREE_TOL)}"]
    if dec:
        long = [r for r in dec if r["N"] >= 8 * K]
        lines.append("decode runs the decode family through flex(): "
                     f"{count(dec, lambda r: r.get('fa3_flex_family') == 'decode')}")
        for key, name in FRONT_DOORS[:2]:
            lines += [f"{name}: KV bandwidth >= 85% of copy at cache >= 8k: "
                      f"{count(long, lambda r: r.get(f'{key}_pct_copy', 0) >= 85)}",
                      f"{name}: >= 1.0x best SDPA: {count(dec, lambda r: r.get(f'{key}_vs_sdpa', 0) >= 1.0)}",
                      f"{name}: >= 1.0x torch flex: "
                      f"{count(dec, lambda r: r.get(f'{key}_vs_torch_flex', 0) >= 1.0)}"
                      + (f" ({sum(1 for r in dec if 'torch_flex_ms' not in r)} rows without torch flex)"
                         if any('torch_flex_ms' not in r for r in dec) else "")]
    paged = [r for r in rows if r["part"] in ("decode", "paged") and "paged_over_contig" in r]
    if paged:
        lines.append("paged within 5% of contiguous: "
                     f"{count(paged, lambda r: r.get('paged_over_contig', 9) <= 1.05)}")
    prefill = [r for r in rows if r["part"] == "prefill"]
    if prefill:
        lines.append("prefill paged within 5% of contiguous: "
                     f"{count(prefill, lambda r: r.get('paged_over_contig', 9) <= 1.05)} (q_offset kept: "
                     f"{count(prefill, lambda r: r.get('qoff_paged_over_contig', 9) <= 1.05)})")
    for r in (r for r in rows if r["part"] == "varlen"):
        tag = f"varlen {r.get('docs', '?')} docs"
        lines += [f"{tag}: ours >= 1.0x per-document cuDNN: {_yes(r.get('vs_sdpa_cudnn_per_doc'), 1.0)}",
                  f"{tag}: ours >= 1.2x our document-mask path: {_yes(r.get('vs_docmask'), 1.2)}"]
        if "window_ms" in r:
            lines.append(f"{tag} under a causal window of {VARLEN_WINDOW}: {r['window_ms']:.3f} ms, "
                         f"{r['window_vs_triton']:.2f}x the Triton varlen kernel (every tile masked)")
    return lines


def _yes(ratio: Optional[float], need: float) -> str:
    return "not measured" if ratio is None else f"{'yes' if ratio >= need else 'no'} ({ratio:.2f}x)"


def _f(row: dict, key: str, fmt: str = "{:.3f}") -> str:
    val = row.get(key)
    return "-" if val is None else fmt.format(val)


def _cache(n: int) -> str:
    return f"{n // K}k" if n >= K else str(n)


def _shape(r: dict) -> str:
    return f"| {r['B']} | {r['new']} | {_cache(r['N'])} | {r['HQ']}/{r['HKV']} | {r['D']} |"


def _decode_table(dec: list[dict]) -> list[str]:
    lines = ["## decode (no mask; TB/s = K+V bytes once / time; copy TB/s = read + write; "
             "ours/X = X's time over ours)", "",
             "fa3 flex: `fa3_inductor.flex(q, k, v)` (the family that ran in the last column); fa3 decode: "
             "`flex_decode` on the contiguous cache; fa3 paged: `flex_decode` on pages of "
             f"{DECODE_PAGE}. Host µs: one call's host time, the queue drained first.", "",
             "| B | new | cache | HQ/HKV | D | KV GB | splits | fa3 flex ms | fa3 decode ms | fa3 paged ms | "
             "copy ms | flex TB/s | decode TB/s | copy TB/s | flex % copy | decode % copy | SDPA best | "
             "SDPA ms | torch flex ms | flex/SDPA | flex/torch flex | decode/SDPA | paged/contig | "
             "host µs flex / decode / paged | max diff | family |",
             "|" + "---|" * 26]
    for r in dec:
        diff = max([r[k] for k in r if k.endswith("_diff")], default=None)
        best = f"{r['sdpa_best']} ({r['sdpa_gqa']})" if "sdpa_best" in r else "-"
        lines.append(f"{_shape(r)} {r['kv_gb']:.2f} | {r.get('splits', '-')} | {_f(r, 'fa3_flex_ms')} | "
                     f"{_f(r, 'fa3_decode_ms')} | {_f(r, 'fa3_paged_ms')} | {_f(r, 'copy_ms')} | "
                     f"{_f(r, 'fa3_flex_tbps', '{:.2f}')} | {_f(r, 'fa3_decode_tbps', '{:.2f}')} | "
                     f"{_f(r, 'copy_tbps', '{:.2f}')} | {_f(r, 'fa3_flex_pct_copy', '{:.0f}')} | "
                     f"{_f(r, 'fa3_decode_pct_copy', '{:.0f}')} | {best} | {_f(r, 'sdpa_ms')} | "
                     f"{_f(r, 'torch_flex_ms')} | {_f(r, 'fa3_flex_vs_sdpa', '{:.2f}')} | "
                     f"{_f(r, 'fa3_flex_vs_torch_flex', '{:.2f}')} | {_f(r, 'fa3_decode_vs_sdpa', '{:.2f}')} | "
                     f"{_f(r, 'paged_over_contig', '{:.3f}')} | {_f(r, 'fa3_flex_host_us', '{:.0f}')} / "
                     f"{_f(r, 'fa3_decode_host_us', '{:.0f}')} / {_f(r, 'fa3_paged_host_us', '{:.0f}')} | "
                     f"{'-' if diff is None else f'{diff:.1e}'} | {r.get('fa3_flex_family', '-')} |")
    return lines + [""]


def _splits_table(rows: list[dict]) -> list[str]:
    lines = ["## split counts (flex_decode, num_splits forced; same rounds as the copy)", "",
             "empty: every length 0, so no key is read: the launch's fixed cost (the split kernel and "
             "its merge when splits > 1; a separate combine kernel before 2026-11-29).", "",
             "| B | new | cache | HQ/HKV | D | auto splits | auto ms | auto % copy | best splits | best ms | "
             "best % copy | auto/best | empty ms (auto / 1 split) | ms by split count |", "|" + "---|" * 14]
    for r in rows:
        by = ", ".join(f"{s}: {ms:.3f}" for s, ms in r.get("by_splits_ms", {}).items())
        lines.append(f"{_shape(r)} {r.get('splits', '-')} | {_f(r, 'auto_ms')} | {_f(r, 'auto_pct_copy', '{:.0f}')} | "
                     f"{r.get('best_splits', '-')} | {_f(r, 'best_ms')} | {_f(r, 'best_pct_copy', '{:.0f}')} | "
                     f"{_f(r, 'auto_over_best', '{:.2f}')} | {_f(r, 'empty_auto_ms')} / {_f(r, 'empty_S1_ms')} | "
                     f"{by} |")
    return lines + [""]


def _paged_table(rows: list[dict]) -> list[str]:
    sizes = sorted({int(p) for r in rows for p in r.get("by_page_ms", {})})
    lines = ["## page sizes (flex_decode; shuffled block tables; same rounds as contiguous)", "",
             "| B | new | cache | HQ/HKV | D | contig ms | " + " | ".join(f"page {p} ms (/contig)" for p in sizes)
             + " | splits contig / paged | page 64 at contig's splits (/contig) | diff |",
             "|" + "---|" * (9 + len(sizes))]
    for r in rows:
        cells = []
        for p in sizes:
            ms = r.get("by_page_ms", {}).get(p, r.get("by_page_ms", {}).get(str(p)))
            ratio = r.get("by_page_over_contig", {}).get(p, r.get("by_page_over_contig", {}).get(str(p)))
            cells.append("-" if ms is None else f"{ms:.3f} ({ratio:.3f})")
        lines.append(f"{_shape(r)} {_f(r, 'contig_ms')} | " + " | ".join(cells)
                     + f" | {r.get('splits_contig', '-')} / {r.get('splits_paged', '-')}"
                     f" | {_f(r, 'page64_contig_splits_over_contig')} | {_f(r, 'paged_diff', '{:.1e}')} |")
    return lines + [""]


def _varlen_table(r: dict) -> list[str]:
    lines = [f"## varlen ({r['tokens']} tokens, documents {r['lengths']}, H{r['H']} D{r['D']}, causal "
             "within documents; TFLOP/s of that work only)", "",
             "| impl | ms | TFLOP/s | ours speedup | diff to ours |", "|---|---|---|---|---|"]
    names = {"ours": f"ours flex_varlen ({r.get('ours_kernel', '?')} kernel)",
             "ours_triton": "ours flex_varlen, Triton varlen kernel (kernel='triton')",
             "sdpa_cudnn_per_doc": "cuDNN SDPA per document (sum)",
             "sdpa_flash_per_doc": "flash SDPA per document (sum)",
             "docmask": f"ours flex + document mask ({r.get('docmask_template', '?')})",
             "flex": "torch flex (compiled), document block mask"}
    names.update({k[:-3]: f"ours flex_varlen's kernel with tiles {k[5:-3]} (block_m x block_n x warps x stages)"
                  for k in r if k.startswith("ours_") and k.endswith("_ms") and k[5].isdigit()})
    for key, name in names.items():
        lines.append(f"| {name} | {_f(r, key + '_ms')} | {_f(r, key + '_tflops', '{:.0f}')} | "
                     f"{_f(r, 'vs_' + key, '{:.2f}') if key != 'ours' else '1.00'} | "
                     f"{_f(r, key + '_diff', '{:.1e}') if key != 'ours' else '-'} |")
    return lines + ["", "ours speedup: the impl's time over flex_varlen's (the kernel it picks); the tile variants "
                    "are the Triton varlen kernel's (templates/varlen/configs.py), below 1 means faster.", ""]


def markdown(meta: dict, rows: list[dict]) -> str:
    smoke = meta["smoke"]
    lines = [f"# serving on {meta['device']} ({meta['dtype']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; command: `{meta['command']}`.",
             meta["timing"] + (f" A 2 GiB copy: {meta['copy_tbps_2gib']:.2f} TB/s (read + write)."
                               if "copy_tbps_2gib" in meta else ""), "",
             f"Checks against float64: decode {meta['checks'].get('decode')}, "
             f"varlen {meta['checks'].get('varlen')}"
             + (f", FP8 KV cache {meta['checks']['fp8kv']}" if "fp8kv" in meta["checks"] else "")
             + (f", prefill chunk {meta['checks']['prefill']}" if "prefill" in meta["checks"] else "") + ".", ""]
    if smoke:
        lines += ["**--smoke: tiny shapes on the CPU; the times are single calls, not measurements.**", ""]
    dec = [r for r in rows if r["part"] == "decode" and "N" in r]
    if dec:
        lines += _decode_table(dec)
    splits = [r for r in rows if r["part"] == "splits" and "N" in r]
    if splits:
        lines += _splits_table(splits)
    paged = [r for r in rows if r["part"] == "paged" and "N" in r]
    if paged:
        lines += _paged_table(paged)
    for r in (r for r in rows if r["part"] == "varlen" and "lengths" in r):
        lines += _varlen_table(r)
    fp8 = [r for r in rows if r["part"] == "fp8kv" and "N" in r]
    if fp8:
        lines += _fp8kv_table(fp8)
    prefill = [r for r in rows if r["part"] == "prefill" and "paged_ms" in r]
    if prefill:
        lines += _prefill_table(prefill)
    window = [r for r in rows if r["part"] == "window" and "full_ms" in r]
    if window:
        lines += _window_table(window)
    errors = [f"- {r.get('label', r['part'])}: {name}: {msg}" for r in rows
              for name, msg in r.get("errors", {}).items()]
    if errors:
        lines += ["## impls that did not run", "", *errors, ""]
    if meta["budget_stops"]:
        lines += ["## left out by --budget-s", ""]
        lines += [f"- {part}: {len(left)} rows ({', '.join(left)})" for part, left in meta["budget_stops"].items()]
        lines.append("")
    lines += ["## targets (issue 20)" + (" (smoke: not meaningful)" if smoke else ""), "",
              *[f"- {t}" for t in targets(rows)], ""]
    return "\n".join(lines)


def summary(meta: dict, rows: list[dict]) -> str:
    """The short table printed last: one line per decode row (fa3 flex), per sweep, per pack and
    per prefill row, then the targets.

    Example::

        >>> summary(dict(device="cpu", budget_stops={}), []).splitlines()[0]
        'serving summary (cpu)'
    """
    lines = [f"serving summary ({meta['device']})", "",
             "| decode row | splits | flex TB/s | % copy | vs SDPA | vs torch flex | paged/contig | host µs |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["part"] == "decode" and "N" in r:
            lines.append(f"| {r.get('label', '?')} | {r.get('splits', '-')} | {_f(r, 'fa3_flex_tbps', '{:.2f}')} | "
                         f"{_f(r, 'fa3_flex_pct_copy', '{:.0f}')} | {_f(r, 'fa3_flex_vs_sdpa', '{:.2f}')} | "
                         f"{_f(r, 'fa3_flex_vs_torch_flex', '{:.2f}')} | {_f(r, 'paged_over_contig', '{:.3f}')} | "
                         f"{_f(r, 'fa3_flex_host_us', '{:.0f}')} |")
    for r in rows:
        if r["part"] == "splits" and "N" in r:
            lines.append(f"| splits {r.get('label', '?')}: auto {r.get('splits')} {_f(r, 'auto_ms')} ms, best "
                         f"{r.get('best_splits')} {_f(r, 'best_ms')} ms, empty {_f(r, 'empty_auto_ms')} ms | | | | | | | |")
        if r["part"] == "varlen" and "lengths" in r:
            lines.append(f"| varlen {r['docs']} docs: {_f(r, 'ours_tflops', '{:.0f}')} TFLOP/s, "
                         f"x{_f(r, 'vs_sdpa_cudnn_per_doc', '{:.2f}')} cuDNN/doc, x{_f(r, 'vs_docmask', '{:.2f}')} "
                         f"doc mask, x{_f(r, 'vs_ours_triton', '{:.2f}')} our Triton kernel "
                         f"(ours: {r.get('ours_kernel', '?')}) | | | | | | | |")
        if r["part"] == "prefill" and "paged_ms" in r:
            lines.append(f"| prefill {r.get('label', '?')}: paged {_f(r, 'paged_tflops', '{:.0f}')} TFLOP/s, "
                         f"paged/contig {_f(r, 'paged_over_contig', '{:.3f}')} (pages of 16: "
                         f"{_f(r, 'paged16_over_contig', '{:.3f}')}), gathered/paged "
                         f"{_f(r, 'gathered_over_paged', '{:.2f}')}, window gathered/paged "
                         f"{_f(r, 'gathered_window_over_paged', '{:.2f}')}, x{_f(r, 'paged_vs_torch_flex', '{:.2f}')} "
                         f"torch flex; q_offset kept: paged/contig {_f(r, 'qoff_paged_over_contig', '{:.3f}')}, "
                         f"x{_f(r, 'paged_qoff_vs_torch_flex', '{:.2f}')} torch flex | | | | | | | |")
    if rows:
        lines += ["", *[f"- {t}" for t in targets(rows)]]
    if meta["budget_stops"]:
        lines.append(f"- left out by --budget-s: { {p: len(v) for p, v in meta['budget_stops'].items()} }")
    return "\n".join(lines) + "\n"


def _slug(name: str) -> str:
    return name.lower().replace("nvidia ", "nvidia-").replace(" ", "-")


def _flex_function(smoke: bool):
    from torch.nn.attention.flex_attention import flex_attention

    if smoke:   # eager on the CPU: the call's path without a minute of compiling
        return flex_attention
    # a compile per shape: without room for them Dynamo falls back to eager flex (slow, huge memory)
    for knob, value in (("recompile_limit", 512), ("cache_size_limit", 512),
                        ("accumulated_recompile_limit", 8192), ("accumulated_cache_size_limit", 8192)):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, value)
    return torch.compile(flex_attention, dynamic=False)


def _todo(part: str, args: argparse.Namespace) -> list:
    if part == "decode":
        return SMOKE_DECODE if args.smoke else decode_cases(args.full, args.quick)
    if part == "splits":
        return SMOKE_SPLITS if args.smoke else split_cases(args.full, args.quick)
    if part == "paged":
        return SMOKE_PAGED if args.smoke else paged_cases(args.full, args.quick)
    if part == "fp8kv":
        return SMOKE_FP8KV if args.smoke else FP8KV_DECODE + (FP8KV_FULL if args.full else [])
    if part == "prefill":
        return SMOKE_PREFILL if args.smoke else prefill_cases(args.full, args.quick)
    if part == "window":
        return SMOKE_WINDOW if args.smoke else WINDOW_DECODE
    return [SMOKE_VARLEN] if args.smoke else varlen_cases(args.full, args.quick)


def run(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, meta: dict,
        rows: list[dict], write: Callable[[], None]) -> None:
    clock = Clock(device, args.reps, args.warmup)
    flex_fn = _flex_function(args.smoke)
    for part in args.part:
        deadline = STARTED + args.budget_s * BUDGET_SHARE[part]
        todo = _todo(part, args)
        done = 0
        for i, case in enumerate(todo):
            if not within_budget(time.time(), deadline, done):
                meta["budget_stops"][part] = [c.label() for c in todo[i:]]
                break
            torch.manual_seed(0)
            started = time.time()
            try:
                if part == "decode":
                    row = decode_row(case, device, dtype, clock, flex_fn)
                elif part == "splits":
                    row = splits_row(case, device, dtype, clock,
                                     SMOKE_SPLIT_COUNTS if args.smoke else SPLIT_COUNTS)
                elif part == "paged":
                    row = paged_row(case, device, dtype, clock,
                                    SMOKE_PAGE_SIZES if args.smoke else PAGE_SIZES)
                elif part == "fp8kv":
                    row = fp8kv_row(case, device, dtype, clock)
                elif part == "prefill":
                    row = prefill_row(case, device, dtype, clock, flex_fn)
                elif part == "window":
                    row = window_row(case, device, dtype, clock, flex_fn)
                else:
                    tiles = () if done else SMOKE_VARLEN_TILES if args.smoke else (
                        VARLEN_TILES if case.d == 128 else ())
                    row = varlen_row(case, device, dtype, clock, flex_fn, tiles)
            except Exception as exc:   # one row's failure (out of memory, a compile) is a result
                row = (_case_row(part, case, 1 if part == "fp8kv" else dtype.itemsize) if part != "varlen"
                       else dict(part=part))
                row["errors"] = {"row": _error(exc)}
            row.update(label=case.label(), wall_s=time.time() - started)
            rows.append(row)
            done += 1
            print(json.dumps(row), flush=True)
            _release(device)
            write()   # a run cut short keeps the rows it finished


def _gpu_meta(device: torch.device, args: argparse.Namespace) -> dict:
    """SMs, memory, capability, and one large copy's bandwidth (read + write) for reference."""
    props = torch.cuda.get_device_properties(device)
    clock = Clock(device, args.reps, args.warmup)
    src = torch.empty(COPY_REF_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = clock.ms(lambda: dst.copy_(src))
    return dict(sms=props.multi_processor_count, memory_gb=props.total_memory / 1e9,
                capability=list(torch.cuda.get_device_capability(device)),
                copy_tbps_2gib=2 * COPY_REF_BYTES / copy_ms / 1e9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default=",".join(DEFAULT_PARTS),
                    help="comma-separated subset of " + ",".join(PARTS) + " (default: all but fp8kv and prefill)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"), help="folder for the files")
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"seconds from the start after which parts add no more rows (default 300; "
                         f"{QUICK_BUDGET_S:.0f} with --quick; 7200 with --full)")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per impl (median)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help="issue 20's grid in one row per corner, the split sweep, two page-size rows and "
                         "the packs, within --budget-s (140 s)")
    ap.add_argument("--full", action="store_true", help="every row (decode grid, more sweeps and pages)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the CPU under TRITON_INTERPRET=1: the harness, not a measurement")
    args = ap.parse_args()
    args.part = [p.strip() for p in args.part.split(",") if p.strip()]
    bad = [p for p in args.part if p not in PARTS]
    if bad or not args.part:
        raise SystemExit(f"serving: unknown --part {bad or args.part}; choose from {','.join(PARTS)}")
    if args.quick and args.full:
        raise SystemExit("serving: --quick and --full exclude each other")
    if args.budget_s is None:
        args.budget_s = 7200.0 if args.full else QUICK_BUDGET_S if args.quick else 300.0
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from triton import knobs

    if args.smoke and not knobs.runtime.interpret:
        raise SystemExit("serving --smoke runs our kernels under Triton's interpreter: set TRITON_INTERPRET=1")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("serving needs a CUDA GPU; on a CPU run --smoke (TRITON_INTERPRET=1) to check the harness")
    import triton

    device = torch.device("cpu") if args.smoke else torch.device("cuda")
    # the interpreter computes bf16 dots wrongly (Triton 3.6): the smoke run is float32
    dtype = torch.float32 if args.smoke else torch.bfloat16
    name = "cpu" if args.smoke else torch.cuda.get_device_name()
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = dict(device=name, torch=torch.__version__, triton=triton.__version__,
                date=f"{now:%Y-%m-%d %H:%M}Z", command="python benchmarks/serving.py " + " ".join(sys.argv[1:]),
                dtype=str(dtype).replace("torch.", ""), smoke=args.smoke, parts=args.part, reps=args.reps,
                budget_s=args.budget_s, full=args.full, quick=args.quick, budget_stops={},
                timing=("--smoke: one wall-clock call per impl (no timing)" if args.smoke else
                        f"CUDA events, {args.warmup} warm-up calls, median of {args.reps}; before every timed "
                        f"call a {FLUSH_BYTES >> 20} MB scratch write flushes L2 (outside the events)."))
    if device.type == "cuda":
        meta.update(_gpu_meta(device, args))
    torch.manual_seed(0)
    meta["checks"] = {}
    if {"decode", "splits", "paged"} & set(args.part):
        meta["checks"]["decode"] = check_decode(device, dtype)
    if "varlen" in args.part:
        meta["checks"]["varlen"] = check_varlen(device, dtype)
    if "fp8kv" in args.part:
        meta["checks"]["fp8kv"] = check_fp8kv(device, dtype)
    if "prefill" in args.part:
        meta["checks"]["prefill"] = check_prefill(device, dtype)
    print("checks:", json.dumps(meta["checks"]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"serving-{_slug(name)}-{now:%Y-%m-%d-%H%M}")
    rows: list[dict] = []

    def write() -> None:
        meta["wall_s"] = round(time.time() - STARTED, 1)
        with open(stem + ".json", "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(markdown(meta, rows))

    try:
        run(args, device, dtype, meta, rows, write)
    except KeyboardInterrupt:
        print("interrupted: writing the rows measured so far", flush=True)
    write()
    print(f"wrote {stem}.json and {stem}.md ({meta['wall_s']} s)", flush=True)
    print(summary(meta, rows), flush=True)


if __name__ == "__main__":
    main()
