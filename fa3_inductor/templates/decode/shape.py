"""Which query shapes the decode family takes: one rule, shared by its ``serves()`` and the
direct path's plan cache (direct.py keys plans by it, so a decode plan is never reused for a
prefill call of the same site, nor the reverse).

A query is decode-shaped when it is at most SHORT_QUERY tokens (a token, or a speculative draft)
and its packed rows, GQA group x tokens, are at most MAX_ROWS = 128. Why 128: one program holds
every row of its KV group in registers (the fp32 accumulator is rows x DV), and 128 rows fill the
prefill kernels' query tile anyway, which then loses only the per-group K/V sharing. Why 16
tokens: longer queries are prefill chunks, whose per-head tiles the prefill kernels fill well
enough (and which a prefill-only test shape of 32-128 tokens with few heads must keep reaching).
"""

from __future__ import annotations

from typing import Optional

MAX_ROWS = 128     # packed rows one decode program holds (host.py refuses more)
SHORT_QUERY = 16   # a query this short is decode-shaped (a token, or a few speculative ones)


def decode_fit(query_len: Optional[int], q_heads: int, kv_heads: int) -> str:
    """"fits" (the decode kernel takes it), "too_many_rows" (a short query whose packed rows exceed
    MAX_ROWS), or "long" (a prefill-shaped query, or a length not known when planned).

    Example::

        >>> decode_fit(1, 32, 8), decode_fit(8, 64, 1), decode_fit(4096, 32, 8)
        ('fits', 'too_many_rows', 'long')
    """
    if query_len is None or query_len < 1 or kv_heads < 1 or q_heads % kv_heads:
        return "long"
    if query_len > SHORT_QUERY:
        return "long"
    return "fits" if q_heads // kv_heads * query_len <= MAX_ROWS else "too_many_rows"

