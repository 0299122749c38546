"""Compile the generic kernel for sm90 (no GPU): one report per (head dim, dtype, mod).

Needs a process without TRITON_INTERPRET=1. ``python tests/sm90_generic_report.py`` prints them.
"""

import json
import sys

import torch

DOC_DTYPE = torch.int64  # what document ids usually are
from torch.nn.attention.flex_attention import create_block_mask

from fa3_inductor import mods
from fa3_inductor.templates.generic.host import compile_generic
from fa3_inductor.templates.aot import sass_report
from fa3_inductor.templates.modgen import BufferSpec, generate_mod_source, load_mod, trace_mod


def mod_fn(fn, kind):
    gm, bufs = trace_mod(fn, kind)
    return load_mod(generate_mod_source(gm, kind, [BufferSpec.of(b) for b in bufs])), tuple(bufs)


def report(D, dtype, variant):
    M = N = 4096 if variant == "noop_long" else 512   # long plain sites take their own tiles
    q = torch.randn(2, 4, M, D, dtype=dtype)
    k = v = torch.randn(2, 2, N, D, dtype=dtype)
    out, lse, mx = torch.empty_like(q), torch.empty(2, 4, M), torch.empty(2, 4, M)
    kw = {}
    if variant == "softcap":
        kw["score_mod"], kw["score_bufs"] = mod_fn(mods.softcap(30.0), "score")
    if variant in ("causal", "document"):
        mask = mods.causal if variant == "causal" else mods.document((torch.arange(M) // 100).to(DOC_DTYPE))
        bm = create_block_mask(mask, None, None, M, N, device="cpu")
        kw["mask_mod"], kw["mask_bufs"] = mod_fn(mask, "mask")
        kw.update(kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices,
                  full_kv_num_blocks=bm.full_kv_num_blocks, full_kv_indices=bm.full_kv_indices)
    ck = compile_generic(q, k, v, out, lse, mx, sm_scale=D ** -0.5, **kw)
    r = sass_report(ck)
    return dict(D=D, dtype=str(dtype), variant=variant, registers=r.registers, stack=r.stack,
                local=r.local, spills=r.spill_instructions, hgmma=r.hgmma,
                setmaxnreg=sorted(r.setmaxnreg), warps=ck.metadata.num_warps,
                mufu_tanh=r.sass.count("MUFU.TANH"), shared=r.shared)


def all_reports() -> list[dict]:
    return [report(D, dtype, variant) for D in (64, 128, 256)
            for dtype in (torch.bfloat16, torch.float16)
            for variant in ("noop", "noop_long", "softcap", "causal", "document")]


if __name__ == "__main__":
    json.dump(all_reports(), sys.stdout, indent=1)
