"""The seeded random-sign Hadamard rotation the FP8 prologue applies to Q and K.

Notation: D the head dim, b = :func:`hadamard_block` (D) the largest power of two dividing D,
H_b the Sylvester Hadamard matrix (H_1 = [1], H_2k = [[H_k, H_k], [H_k, -H_k]]; entries ±1,
H_b[i, j] = (-1)^popcount(i & j)), s the ±1 vector of length D drawn from
``torch.Generator().manual_seed(seed)`` on the CPU (the same on every device). The rotation is

    x -> x · diag(s) · blockdiag(H_b, ..., H_b) / sqrt(b)            (D / b blocks)

an orthogonal matrix, so applying it to both Q and K leaves QKᵀ unchanged. The kernel multiplies by
the exact ±1 matrix :func:`sign_hadamard` and then by 1/sqrt(b) (:func:`rotation_matrix` is the
product, for references).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch


def hadamard_block(d: int) -> int:
    """The Hadamard block size for head dim ``d``: the largest power of two dividing it.

    Example::

        >>> [hadamard_block(d) for d in (64, 96, 128, 80)]
        [64, 32, 128, 16]
    """
    if d <= 0:
        raise ValueError(f"head dim must be positive, got {d}")
    return d & -d


def random_signs(d: int, seed: int) -> torch.Tensor:
    """The ±1 vector s (float64, CPU) of length ``d``: ``torch.randint(0, 2, (d,))`` on a CPU
    generator seeded with ``seed``, mapped 0 -> -1, 1 -> +1 (as benchmarks/fp8_accuracy.py).

    Example::

        >>> s = random_signs(8, 0); s.abs().eq(1).all().item(), s.dtype
        (True, torch.float64)
    """
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2, (d,), generator=gen)
    return 2.0 * bits.double() - 1.0


def sylvester(b: int) -> torch.Tensor:
    """H_b (float64, entries ±1), b a power of two.

    Example::

        >>> sylvester(2).tolist()
        [[1.0, 1.0], [1.0, -1.0]]
    """
    if b < 1 or b & (b - 1):
        raise ValueError(f"Sylvester Hadamard size must be a power of two, got {b}")
    i = torch.arange(b)
    x = i[:, None] & i[None, :]
    parity = torch.zeros_like(x)
    while bool(x.any()):
        parity ^= x & 1
        x = x >> 1
    return 1.0 - 2.0 * parity.double()


def sign_hadamard(d: int, seed: int, dtype: torch.dtype = torch.float64,
                  device: Optional[torch.device | str] = None,
                  pad_to: Optional[int] = None) -> torch.Tensor:
    """diag(s) · blockdiag(H_b): the exact ±1 (and 0 off the blocks) [d, d] matrix, zero-padded to
    [pad_to, pad_to] when asked (the kernel's power-of-two tile). Cached per arguments: do not
    modify the result.

    Example::

        >>> m = sign_hadamard(96, seed=0)
        >>> torch.allclose(m @ m.T, 32.0 * torch.eye(96, dtype=torch.float64))
        True
    """
    return _sign_hadamard(d, seed, pad_to or d, dtype, str(torch.device(device or "cpu")))


@functools.lru_cache(maxsize=64)
def _sign_hadamard(d: int, seed: int, pad_to: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    if dtype != torch.float64 or device != "cpu":
        return _sign_hadamard(d, seed, pad_to, torch.float64, "cpu").to(device=device, dtype=dtype)
    if pad_to < d:
        raise ValueError(f"pad_to ({pad_to}) must be at least d ({d})")
    b = hadamard_block(d)
    m = torch.zeros(pad_to, pad_to, dtype=torch.float64)
    m[:d, :d] = random_signs(d, seed)[:, None] * torch.block_diag(*[sylvester(b)] * (d // b))
    return m


def rotation_matrix(d: int, seed: int) -> torch.Tensor:
    """The orthogonal rotation diag(s) · blockdiag(H_b) / sqrt(b), float64 on the CPU.

    Example::

        >>> r = rotation_matrix(64, seed=3)
        >>> torch.allclose(r @ r.T, torch.eye(64, dtype=torch.float64))
        True
    """
    return sign_hadamard(d, seed) / math.sqrt(hadamard_block(d))
