"""Recognition: finding attention in Dynamo's FX graphs and rewriting it into flex_attention.

Runs on the graph the backend receives, before Inductor; the lowering (``fa3_inductor.lowering``)
then serves the flex_attention ops it made. Recognition never imports the lowering: what both
need lives below them (``fa3_inductor.report``, ``config``, ``templates``); the backend hands
recognition the lowering's "would our kernels serve this?" as a callable.
"""
