"""How fast L2 takes the backward's dQ reductions, with nothing else running: the ceiling of a backward whose 64 x 64
fp32 dQ chunks all go through L2 reduce-adds (docs/design/hopper_backward.md, "The dQ reductions' rate").

    python benchmarks/reduce_rate.py --out DIR

Each program stands for one KV tile of one head of the backward and walks that head's query tiles in the backward's
order (every KV tile of a head in the same order; ``causal``: KV tile j from query tile j * BLOCK_N // 64 on), adding
CHUNKS 64 x 64 fp32 chunks a query tile into DQ_ACC's fragment-ordered blocks (as the default kernels do) with nothing
computed between them:

  tma    one cp.reduce.async.bulk.tensor of a [16, 256] fp32 box a chunk from a shared tile (the kernels' DQ_FRAG path),
         at most one reduce in flight beyond the newest (tma.store_wait(1), the wide kernel's two staging tiles)
  red    eight red.global.add.v4.f32 a thread and chunk from registers (the dq_red variant, measured slower)
  store  plain TMA stores of the same boxes (write bandwidth, for scale)
  smK    the tma walk from one program an SM (the rest of its shared memory taken), at most K reduces in flight: the
         rate a persistent backward CTA can reach (the wide kernel keeps 2 warpgroups x 2 staging tiles: sm4)

Shapes: B * N = 16k tokens, H 16 (bwd_speed.py's); per head dim pair its kernel's KV tile (64 keys at 192 / 128 and
256, 128 at D <= 128) and dQ chunks (D / 64). TB/s = fp32 bytes added / time (one launch, CUDA events behind a GPU
sleep, the median of --reps).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fa3_inductor.templates.hopper_bwd.bwd_sm90 import _acc_layout, _dq_fragments, _tma_reduce_add  # noqa: E402
from fa3_inductor.templates.hopper_bwd.host import _dq_frag_desc  # noqa: E402
import bwd_speed  # noqa: E402  (the timing)
import result_files  # noqa: E402

MODES = ("tma", "red", "store", "sm2", "sm4", "sm8")
# (D, DV) -> keys of the kernel's KV tile
KV_TILE = {(64, 64): 128, (128, 128): 128, (192, 128): 64, (256, 256): 64}


@gluon.jit
def reduce_rate_kernel(acc_desc, acc_ptr, M_TILES, M_PAD, KV_TILE: gl.constexpr, CHUNKS: gl.constexpr,
                       D: gl.constexpr, CAUSAL: gl.constexpr, MODE: gl.constexpr):
    """Program (KV tile j, head zh): CHUNKS dQ chunks for each of the head's query tiles (from j's diagonal on with
    CAUSAL), added into DQ_ACC [heads, M_PAD, D] fp32 in fragment order."""
    j = gl.program_id(0)
    zh = gl.program_id(1)
    first = j * (KV_TILE // 64) if CAUSAL else 0
    lay: gl.constexpr = _acc_layout(64)
    chunk = gl.full([64, 64], 1.0, gl.float32, layout=lay)
    if MODE == "red":
        frag = _dq_fragments(chunk)
        frag_layout: gl.constexpr = frag.type.layout
        f_rows = gl.arange(0, 16, layout=gl.SliceLayout(1, frag_layout))
        f_cols = gl.arange(0, 256, layout=gl.SliceLayout(0, frag_layout))
        offs = (f_rows * 256)[:, None] + f_cols[None, :]
        for i in range(first, M_TILES):
            for c in gl.static_range(CHUNKS):
                block = acc_ptr + ((zh.to(gl.int64) * M_PAD + i * 64) * D + c * 4096)
                gl.atomic_add(block + offs, frag, sem="relaxed")
    else:
        stage = gl.allocate_shared_memory(gl.float32, [2] + acc_desc.block_type.shape, acc_desc.layout)
        stage.index(0).reshape([16, 256]).store(_dq_fragments(chunk))
        stage.index(1).reshape([16, 256]).store(_dq_fragments(chunk))
        fence_async_shared()
        n = 0
        for i in range(first, M_TILES):
            for c in gl.static_range(CHUNKS):
                tma.store_wait(1)
                blk = i * CHUNKS + c
                if MODE == "tma":
                    _tma_reduce_add(acc_desc, [zh, blk * 16, 0], stage.index(n % 2))
                else:
                    tma.async_copy_shared_to_global(acc_desc, [zh, blk * 16, 0], stage.index(n % 2))
                n += 1
        tma.store_wait(0)


@gluon.jit
def reduce_rate_sm_kernel(acc_desc, M_TILES, N_KV, HEADS, KV_TILE: gl.constexpr, CHUNKS: gl.constexpr,
                          CAUSAL: gl.constexpr, IN_FLIGHT: gl.constexpr, PAD_ROWS: gl.constexpr):
    """One program an SM (a PAD_ROWS x 256 fp32 shared tile keeps a second one out) walking (KV tile, head) items in
    turn, the TMA reduce-adds of reduce_rate_kernel's walk with at most IN_FLIGHT in flight: the reductions a
    persistent backward CTA can keep going (the wide kernel: 2 warpgroups x 2 staging tiles)."""
    stage = gl.allocate_shared_memory(gl.float32, [IN_FLIGHT] + acc_desc.block_type.shape, acc_desc.layout)
    pad = gl.allocate_shared_memory(gl.float32, [PAD_ROWS, 256], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    lay: gl.constexpr = _acc_layout(64)
    frag = _dq_fragments(gl.full([64, 64], 1.0, gl.float32, layout=lay))
    for b in gl.static_range(IN_FLIGHT):
        stage.index(b).reshape([16, 256]).store(frag)
    pad.slice(0, 16, dim=0).store(frag)
    fence_async_shared()
    n = 0
    for item in range(gl.program_id(0), N_KV * HEADS, gl.num_programs(0)):
        j = item % N_KV
        zh = item // N_KV
        first = j * (KV_TILE // 64) if CAUSAL else 0
        for i in range(first, M_TILES):
            for c in gl.static_range(CHUNKS):
                tma.store_wait(IN_FLIGHT - 1)
                _tma_reduce_add(acc_desc, [zh, (i * CHUNKS + c) * 16, 0], stage.index(n % IN_FLIGHT))
                n += 1
    tma.store_wait(0)


def row(D: int, DV: int, N: int, causal: bool, mode: str, reps: int, tokens: int, heads: int) -> dict:
    """Time one launch of reduce_rate_kernel for the (D, DV) backward's dQ at length N."""
    B = max(1, tokens // N)
    kv_tile = KV_TILE[D, DV]
    chunks = D // 64
    acc = torch.zeros(B * heads, N, D, device="cuda", dtype=torch.float32)
    desc = _dq_frag_desc(acc)
    m_tiles, n_kv = N // 64, N // kv_tile
    grid = (n_kv, B * heads)

    def launch():
        if mode.startswith("sm"):   # "sm<IN_FLIGHT>": one program an SM
            in_flight = int(mode[2:])
            reduce_rate_sm_kernel[(torch.cuda.get_device_properties(0).multi_processor_count,)](
                desc, m_tiles, n_kv, B * heads, KV_TILE=kv_tile, CHUNKS=chunks, CAUSAL=causal, IN_FLIGHT=in_flight,
                PAD_ROWS=128 if in_flight <= 4 else 64, num_warps=4)   # > 114 KB: one an SM
        else:
            reduce_rate_kernel[grid](desc, acc, m_tiles, N, KV_TILE=kv_tile, CHUNKS=chunks, D=D, CAUSAL=causal,
                                     MODE=mode, num_warps=4)

    ms = bwd_speed._time_interleaved({mode: launch}, reps, 2, 2.0)[mode]
    tiles = sum(m_tiles - (j * kv_tile // 64 if causal else 0) for j in range(n_kv)) * B * heads
    gb = tiles * chunks * 64 * 64 * 4 / 1e9
    return dict(D=D, Dv=DV, N=N, B=B, H=heads, causal=causal, mode=mode, kv_tile=kv_tile, gb=gb, ms=ms,
                tbps=gb / ms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory: writes reduce-rate-<device>-<date>.{json,md}")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--pairs", nargs="+", default=["192/128", "256/256", "128/128", "64/64"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    args = ap.parse_args()

    pairs = [tuple(int(x) for x in p.split("/")) for p in args.pairs]
    rows = [row(D, DV, N, causal, mode, args.reps, args.tokens, args.heads)
            for D, DV in pairs for N in args.seqlens for causal in (False, True) for mode in args.modes]
    meta, now = result_files.run_meta("benchmarks/reduce_rate.py")
    lines = [f"# dQ reductions alone on {meta['device']}", "",
             f"torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; command: `{meta['command']}`. One "
             f"launch behind a GPU sleep, median of {args.reps}; TB/s = fp32 bytes added / time.", "",
             "| N | D | mask | KV tile | GB | " + " | ".join(f"{m} ms / TB/s" for m in args.modes) + " |",
             "|---|---|---|---|---|" + "---|" * len(args.modes)]
    for i in range(0, len(rows), len(args.modes)):
        group = rows[i:i + len(args.modes)]
        r = group[0]
        lines.append(f"| {r['N']} | {r['D']}/{r['Dv']} | {'causal' if r['causal'] else 'none'} | {r['kv_tile']} | "
                     f"{r['gb']:.1f} | " + " | ".join(f"{g['ms']:.3f} / {g['tbps']:.2f}" for g in group) + " |")
    result_files.write_result(args.out, "reduce-rate", meta, now, rows, lines)


if __name__ == "__main__":
    main()
