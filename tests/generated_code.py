"""Inductor's generated code with what changes from run to run taken out, for tests that compare
two compiles' code (test_stock_inductor.py, test_backend_parity.py)."""

from __future__ import annotations

import re

_VOLATILE = [
    (re.compile(r"/tmp/[^\s'\"]*"), "<path>"),                    # cache dirs, kernel files
    (re.compile(r"\b[a-z0-9]{40,}\b"), "<hash>"),                 # content hashes
    (re.compile(r"0x[0-9a-f]{6,}"), "<address>"),
    (re.compile(r"# AOT ID: \['\d+_"), "# AOT ID: ['<n>_"),        # per-process compile counter
]


def normalize_code(code: str) -> str:
    """``code`` with temporary paths, content hashes, addresses and AOT ids replaced by placeholders.

    Example::

        >>> normalize_code("load('/tmp/abc/k.py')")
        "load('<path>')"
    """
    for pattern, replacement in _VOLATILE:
        code = pattern.sub(replacement, code)
    return code
