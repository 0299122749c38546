#!/usr/bin/env python3
"""Host cost of a repeated ``fa3_inductor.flex_decode`` call on the CPU, by stage, with every kernel
launch stubbed: where the Python of the decode path goes (serving.py's ``*_host_us`` times the same
on a GPU).

The calls take flex_decode's CUDA branch on CPU tensors: ``torch.Tensor.is_cuda`` is shadowed by a
property that says True outside planning (planning itself, the first call of a key, sees the real
device). The launch cache of templates/decode/launch_cache.py is replaced by what its hit costs
before the launch itself: the key looked up, the split scratch allocated (``launch_decode`` /
``recorded_decode`` as decode.py imported them). Nothing is computed: the figures are host work
only, in µs a call (the fastest of ``--rounds`` rounds of ``--calls`` calls), on this machine's CPU
(slower than a GPU server's host: compare figures with each other, not with serving.py's).

A GQA 32/8 D128 fp16 decode of one new token, B4 against a 4096-key cache, contiguous and paged
(pages of 16), without a mask and with ``mods.sliding_window(1024)``; ``memo off`` is the same tree
with the call memo bypassed (its full path, as before the memo).

    python benchmarks/decode_host_cpu.py [--root TREE]

``--root`` imports ``fa3_inductor`` from another tree (before / after a change).
"""

from __future__ import annotations

import contextlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_host_cpu import host_cpu_args, per_call_us, print_profile, print_stages  # noqa: E402

B, HQ, HKV, N, D, PAGE = 4, 32, 8, 4096, 128, 16


def _stub_launches(torch, decode) -> contextlib.AbstractContextManager:
    """Shadow ``Tensor.is_cuda`` and stub decode.py's launch cache (module docstring); returns a
    context manager under which tensors report their real device (planning)."""
    real = {"on": False}
    base = torch._C.TensorBase.is_cuda
    torch.Tensor.is_cuda = property(lambda t: base.__get__(t) or not real["on"])
    recorded: dict = {}

    @contextlib.contextmanager
    def real_device():
        real["on"] = True
        try:
            yield
        finally:
            real["on"] = False

    def launch_hit(key, inputs, plan, tag, scratch=None):
        again = recorded.get(key)
        if again is None:
            with real_device():
                _, args, _, grid = plan()[0]
            shapes = tuple(tuple(t.shape) for t in args[5:7]) if grid[0] > 1 else ()
            again = recorded[key] = lambda inputs, scratch=None, shapes=shapes, programs=grid[1]: (
                *inputs, *(scratch or (*(torch.empty(s) for s in shapes),
                                       torch.zeros(programs, dtype=torch.int32)) if shapes else ()))
        again(inputs, scratch)

    decode.launch_decode = launch_hit
    if hasattr(decode, "recorded_decode"):
        decode.recorded_decode = recorded.get
    return real_device


def main() -> None:
    args = host_cpu_args(__doc__, 300, "the paged call with the mask")
    import torch

    import fa3_inductor
    from fa3_inductor import decode, flex_decode, mods
    from fa3_inductor.runtime.fast_launch import aliasing, tensor_signature
    from fa3_inductor.templates.decode.host import prepare_decode
    from fa3_inductor.varlen import generated_mod

    torch.set_num_threads(1)
    real_device = _stub_launches(torch, decode)
    has_memo = hasattr(decode, "memo_stats")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, HQ, 1, D, generator=g).half()
    k, v = (torch.randn(B, HKV, N, D, generator=g).half() for _ in range(2))
    pages = B * N // PAGE
    kp, vp = (torch.randn(pages, PAGE, HKV, D, generator=g).half() for _ in range(2))
    table = torch.randperm(pages, generator=g).view(B, -1).to(torch.int32)
    lens = torch.full((B,), N - 7, dtype=torch.int32)
    window = mods.sliding_window(1024)
    cases = {
        "contiguous": lambda mask: flex_decode(q, k, v, seq_lens=lens, mask_mod=mask),
        "paged": lambda mask: flex_decode(q, kp, vp, seq_lens=lens, block_table=table, mask_mod=mask),
    }
    print(f"tree {fa3_inductor.__file__}; memo {'present' if has_memo else 'absent'}; GQA {HQ}/{HKV} "
          f"D{D} fp16, B{B}, 1 new token, cache {N} (paged: pages of {PAGE}), CPU, launches stubbed")
    with torch.no_grad():
        memo_modes = (("", None), (" memo off", lambda *a, **kw: None)) if has_memo else (("", None),)
        for suffix, bypass in memo_modes:
            saved = decode._memo if has_memo else None
            if bypass is not None:
                decode._memo = bypass
            for name, call in cases.items():
                for mask_name, mask in (("no mask", None), ("sliding_window", window)):
                    fn = lambda call=call, mask=mask: call(mask)   # noqa: E731
                    for _ in range(3):
                        fn()
                    label = f"{name}, {mask_name}{suffix}"
                    print(f"  flex_decode {label:36s} {per_call_us(fn, args.calls, args.rounds):7.1f} us a call")
            if saved is not None:
                decode._memo = saved
        if has_memo:
            print(f"  memo stats: {decode.memo_stats()}")

        # the full path's stages, paged, with the mask
        out = q.new_empty(B, HQ, 1, D)
        lse = torch.empty(B, HQ, 1, dtype=torch.float32)
        inputs = (q, kp, vp, out, lse, lens, None, table, None, None)
        fn_mask, bufs, _ = generated_mod(window, "mask")
        check = lambda: decode._check(q, kp, vp, lens, table, None, None, None, (None, window))  # noqa: E731

        def plan():
            with real_device():
                prepare_decode(q, kp, vp, out, lse, sm_scale=D ** -0.5, mask_mod=fn_mask, mask_bufs=bufs,
                               seq_lens=lens, block_table=table)

        stages = {
            "_check (inputs, table, lengths)": check,
            "generated_mod x2 (score None, mask)": lambda: (generated_mod(None, "score"),
                                                            generated_mod(window, "mask")),
            "out + lse allocations": lambda: (q.new_empty(B, HQ, 1, D),
                                              torch.empty(B, HQ, 1, dtype=torch.float32)),
            "launch key: tensor_signature (10)": lambda: tensor_signature(inputs),
            "launch key: aliasing (10)": lambda: aliasing(inputs),
            "prepare_decode (first call of a key)": plan,
        }
        if has_memo:
            from fa3_inductor import decode_memo, direct

            tensors = (q, kp, vp, lens, table, None, None, None)
            signature = decode_memo.call_signature(tensors, None)
            key = decode_memo.memo_key(None, window, None, None, signature)
            stages.update({
                "memo: call_signature (8)": lambda: decode_memo.call_signature(tensors, None),
                "memo: memo_key": lambda: decode_memo.memo_key(None, window, None, None, signature),
                "memo: direct.live (+ ModWatch)": lambda: direct.live(key, None),
                "memo: replay (launch stubbed)": lambda: decode_memo.replay(key, tensors, None, False),
            })
        print_stages(stages, args)
        if args.profile:
            print_profile(lambda: cases["paged"](window), args.calls)


if __name__ == "__main__":
    main()
