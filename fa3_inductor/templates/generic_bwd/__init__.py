"""The generic backward: plain Triton flex-attention gradients for every CUDA GPU and the CPU
interpreter (issue 19). Not wired into the lowering yet (docs/design/backward.md, "Integration").

kernel.py (delta, dK/dV and dQ kernels), host.py (launch preparation), configs.py (tile table),
score_grad.py (a score_mod's derivative in the ``tl`` dialect, from flex's joint graph).
"""

from .host import (SCORE_GRAD_ONE, compile_generic_backward, generic_backward,
                   launch_generic_backward, prepare_generic_backward, transpose_block_tables)
from .score_grad import score_grad_graph, score_grad_source

__all__ = ["SCORE_GRAD_ONE", "compile_generic_backward", "generic_backward",
           "launch_generic_backward", "prepare_generic_backward", "transpose_block_tables",
           "score_grad_graph", "score_grad_source"]
