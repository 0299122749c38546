"""The FP8 prologue: bf16 / fp16 Q, K, V -> e4m3 Q, K, Vᵀ with per-block scales, after RoPE and a
random-sign Hadamard rotation, in one Triton pass (docs/design/fp8_prologue.md).

kernel.py (the Triton kernels), gluon_sm90.py (the hot case on sm90 in Gluon, behind
``PrologueTuning(kernel="gluon")`` until GPU-verified), host.py (``quantize``, the entry),
hadamard.py (the seeded rotation), reference.py (the same math in torch ops: tests, benchmarks, the
CPU path).
"""

from ...fp8_recipe import FP8Operands, FP8Recipe, RopeSpec
from .host import compile_prologue, prepare_prologue, quantize

__all__ = ["FP8Operands", "FP8Recipe", "RopeSpec", "compile_prologue", "prepare_prologue",
           "quantize"]
