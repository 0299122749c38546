"""Context parallelism: attention over a sequence sharded across ranks (torch.distributed).

``ring_flex`` is the direct call (ring or all-gather of K/V, our kernels per shard, LSE merge,
backward included); ``SeqLayout`` says which positions each rank holds (head-tail by default);
``context_parallel`` runs models inside torch's own ``context_parallel`` API with their SDPA and
flex_attention calls served by ``ring_flex``, and the attention sites of graphs compiled with
``backend="fa3"`` (hand-written attention found by recognition) run as ring attention there too
(graph_sites.py). Design: docs/design/context_parallel.md.

Example::

    >>> from fa3_inductor.distributed import SeqLayout, ring_flex     # doctest: +SKIP
    >>> out = ring_flex(q_shard, k_shard, v_shard, mask_mod=mods.causal)   # doctest: +SKIP
"""

from .layout import SeqLayout
from .context_parallel import context_parallel
from .ring import ring_flex, stats

__all__ = ["SeqLayout", "ring_flex", "context_parallel", "stats"]
