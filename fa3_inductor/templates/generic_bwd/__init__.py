"""The generic backward: plain Triton flex-attention gradients for every CUDA GPU and the CPU
interpreter (issue 19). Training sites of both front doors reach it through the backward-family
interface: family.py's ``FAMILY`` ("generic_bwd", listed in templates/registry.py's BACKWARD_FOLDERS),
run by the op ``fa3_inductor::flex_bwd.families`` (runtime/ops_bwd.py) that the backward lowering
emits (docs/design/backward.md, "Integration").

It also computes the gradients of tensors a score_mod captures (a learnable bias table, ALiBi
slopes): the lowering generates them from the joint graph (``buffer_grad_sources``), carries them
in the op's spec, and the op returns them with dq, dk, dv (``buffer_grads=`` of the host functions;
``deterministic=True`` sums them without atomics).

kernel.py (delta, dK/dV and dQ kernels), host.py (launch preparation), configs.py (tile table),
score_grad.py (a score_mod's derivative in the ``tl`` dialect, from flex's joint graph),
buffer_grad.py (the captured tensors' gradients as generated value and offset mods),
buffer_grad_host.py (their scratch, zeroing, sorting and final steps: ``TorchStep`` launch-list
entries), family.py (the family: serves, prepares, launches under the interpreter).

Example::

    >>> from fa3_inductor.templates.generic_bwd import *   # doctest: +SKIP
    >>> launches = prepare_generic_backward(q, k, v, out, dout, lse, dq, dk, dv, sm_scale=0.125,
    ...     score_mod=alibi_tl, score_grad_mod=SCORE_GRAD_ONE, score_bufs=(slopes,),
    ...     buffer_grads=[(buffer_grad_sources(joint, [BufferSpec.of(slopes)])[0], dslopes)])  # doctest: +SKIP
"""

from .buffer_grad import BufferGradSource, buffer_grad_sources
from .buffer_grad_host import TorchStep
from .host import (SCORE_GRAD_ONE, compile_generic_backward, generic_backward,
                   launch_generic_backward, prepare_generic_backward, transpose_block_tables)
from .score_grad import score_grad_graph, score_grad_source

__all__ = ["SCORE_GRAD_ONE", "compile_generic_backward", "generic_backward",
           "launch_generic_backward", "prepare_generic_backward", "transpose_block_tables",
           "score_grad_graph", "score_grad_source", "BufferGradSource", "buffer_grad_sources",
           "TorchStep"]
