"""The decode kernels: split-KV (Flash-Decoding) with GQA packing and paged KV, plain Triton.

kernel.py (the split-KV kernel, which merges its splits), host.py (checks, split choice, launches), configs.py (tiles
and the split count), family.py (the registered "decode" family; docs/design/decode.md), fp8_cache.py (an FP8
KV cache's scales and quantize_kv).
"""

from .host import compile_decode, decode_attention, decode_scratch, prepare_decode

__all__ = ["compile_decode", "decode_attention", "decode_scratch", "prepare_decode"]
