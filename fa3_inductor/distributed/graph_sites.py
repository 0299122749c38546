"""The attention sites of a compiled graph as ring attention: what a graph runs inside the context.

A model compiled with ``backend="fa3"`` has its hand-written attention (and SDPA calls bound before
the context patched them) rewritten by recognition into flex_attention nodes, and flex_attention
calls the user wrote are such nodes already. Lowered as usual, a node attends within this rank's
sequence shard only: inside :func:`~.context_parallel.context_parallel` that would be a silently
wrong result. So the backend (backend.py) gives every graph that holds attention sites a second
form, built on its first call inside the context: recognition again, rewriting every site it can
express whatever its size (rewrite_pays.py's rule weighs one GPU's speed), then :func:`ring_graph`
here replaces each flex_attention node by the opaque op ``fa3_inductor::ring_site`` (its
backward: ``fa3_inductor::ring_site_backward``, registered as its autograd), and Inductor compiles
the graph around them, one graph as before. The ops find the node's mods in a registry by the
site number they carry (:class:`RingSite`) and run ring attention (ring.py: the forward, and the
backward that takes the merged output and LSE) with the active context's group, layout, method and
kernel.

The node's mods are read as functions of GLOBAL positions (ring_flex composes them with the
layout's position map). That is exact for mods built from positions alone: recognition's masks
(causal, sliding window, ... evaluated from aranges and comparisons) and biases of head or
distance. It is not for a mod that reads a tensor of this rank's sequence shard (document ids, a
padding or dense mask, per-position tables: their entries belong to local positions), and the ring
gives no gradient to tensors the mods capture: such a site raises when the variant is built,
naming it and what to do, rather than attend wrongly. Block-mask tables are not read: the mask_mod
defines the mask (as for flex_attention calls inside the context: context_parallel.py).

FP8 (a graph compiled with ``options={"fa3.fp8": recipe}``, or a context entered with ``fp8=``):
:func:`ring_graph` takes the recipe and each site runs ``ring_flex``'s FP8 path (every ring step
through the FP8 prologue and kernels, LSE merge unchanged) where its inputs are bf16/fp16 and our
kernels run; elsewhere (float32, the dense shard kernel) it runs as without FP8, as the compiled
FP8 path leaves such sites to the bf16/fp32 kernels. Inference only: a graph whose attention
inputs need gradients raises when the variant is built. The model's RoPE runs in the graph (the
FP8 path's RoPE fusion is not applied to ring sites).

Example::

    >>> variant = ring_graph(recognized_gm)   # the backend, inside the context  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
from typing import Any, Callable, Iterator, Optional

import torch
import torch.fx
from torch import Tensor

from ..fp8_recipe import FP8Recipe
from ..recognition.recognize_flex import flex_nodes
from ..templates.modgen import is_constant_true_mask, is_identity_score
from .context_parallel import active
from .ring import _default_kernel, attention_backward, attention_forward, ring_call

_LN2 = math.log(2.0)
_HELP = ("call F.scaled_dot_product_attention, flex_attention (torch.nn.attention.flex_attention."
         "flex_attention, looked up inside the context) or fa3_inductor.distributed.ring_flex there "
         "with mods over global positions, or run this graph outside context_parallel")
_SITES: dict[int, "RingSite"] = {}   # site number -> site; kept while the process lives (small)
_NUMBERS = itertools.count()


class RingSite:
    """One flex_attention node of a graph as ring attention: its mods (the node's graphs) and scale,
    registered under the number the ``fa3_inductor::ring_site`` ops carry.

    Example::

        >>> site = RingSite("matmul_3", score_gm, mask_gm, 0.125)   # doctest: +SKIP
        >>> out, lse2 = torch.ops.fa3_inductor.ring_site(q, k, v, [], [], site.number)
        ...                                                             # doctest: +SKIP
    """

    def __init__(self, name: str, score_gm: Optional[torch.fx.GraphModule],
                 mask_gm: Optional[torch.fx.GraphModule], scale: float,
                 fp8: Optional[FP8Recipe] = None):
        self.name = name
        self.fp8 = fp8   # FP8 forward (inference) where the inputs allow: fp8_for
        self.score_gm = None if score_gm is None or is_identity_score(score_gm) else score_gm
        self.mask_gm = None if mask_gm is None or _keeps_everything(mask_gm) else mask_gm
        self.scale = scale
        self.state = None   # the context of the last forward (context_parallel._Active)
        self.number = next(_NUMBERS)
        _SITES[self.number] = self

    def mods(self, score_bufs: list, mask_bufs: list
             ) -> tuple[Optional[Callable], Optional[Callable]]:
        """(score_mod, mask_mod) calling the node's graphs with its buffers; None for none."""
        score_gm, mask_gm = self.score_gm, self.mask_gm
        score_mod = mask_mod = None
        if score_gm is not None:
            def score_mod(score, b, h, q_idx, kv_idx):
                return score_gm(score, b, h, q_idx, kv_idx, *score_bufs)
        if mask_gm is not None:
            def mask_mod(b, h, q_idx, kv_idx):
                return mask_gm(b, h, q_idx, kv_idx, *mask_bufs)
        return score_mod, mask_mod

    def call(self, q: Tensor, k: Tensor, v: Tensor, score_bufs: list, mask_bufs: list,
             backward: bool = False):
        """ring.ring_call for this site with the active context's group, layout, method and
        kernel; a backward run after the context was left (``loss.backward()`` outside it) takes
        those of this site's last forward."""
        state = active()
        if state is None and backward:
            state = self.state
        if state is None:
            raise RuntimeError(f"fa3_inductor: ring attention site {self.name} ran outside "
                               "fa3_inductor.distributed.context_parallel; this is a bug in "
                               "fa3_inductor (the backend runs the ring variant only inside it)")
        self.state = state
        score_mod, mask_mod = self.mods(score_bufs, mask_bufs)
        return ring_call(q, k, v, score_mod, mask_mod, group=state.group, layout=state.layout,
                         scale=self.scale, enable_gqa=q.shape[1] != k.shape[1],
                         method=state.method, kernel=state.kernel,
                         fp8=None if backward else self.fp8_for(q, state.kernel))

    def fp8_for(self, q: Tensor, kernel: str) -> Optional[FP8Recipe]:
        """The site's recipe where FP8 can serve it (bf16/fp16 inputs, our shard kernels), else
        None: as the compiled FP8 path, which leaves other sites to the bf16/fp32 kernels."""
        if self.fp8 is None or q.dtype not in (torch.bfloat16, torch.float16):
            return None
        return self.fp8 if (_default_kernel(q) if kernel == "auto" else kernel) == "fa3" else None


@torch.library.custom_op("fa3_inductor::ring_site", mutates_args=())
def ring_site(q: Tensor, k: Tensor, v: Tensor, score_bufs: list[Tensor], mask_bufs: list[Tensor],
              site: int) -> tuple[Tensor, Tensor]:
    """Ring attention of one graph site: (out, LSE in log2 units, the flex_attention op's).

    Example::

        >>> out, lse2 = torch.ops.fa3_inductor.ring_site(q, k, v, [], [], site.number)
        ...                                                             # doctest: +SKIP
    """
    call = _SITES[site].call(q, k, v, score_bufs, mask_bufs)
    with _eager_dispatch():
        out, lse = attention_forward(call, q, k, v)
    return out.contiguous(), (lse / _LN2).float().contiguous()   # the layouts of the fake


@ring_site.register_fake
def _ring_site_fake(q, k, v, score_bufs, mask_bufs, site):
    return (q.new_empty((*q.shape[:3], v.shape[3])),
            q.new_empty(q.shape[:3], dtype=torch.float32))


@torch.library.custom_op("fa3_inductor::ring_site_backward", mutates_args=())
def ring_site_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse2: Tensor, dout: Tensor,
                       dlse2: Optional[Tensor], score_bufs: list[Tensor], mask_bufs: list[Tensor],
                       site: int) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of :func:`ring_site`, from its output and LSE (log2 units, as its gradient).

    Example::

        >>> dq, dk, dv = torch.ops.fa3_inductor.ring_site_backward(
        ...     q, k, v, out, lse2, dout, None, [], [], site.number)   # doctest: +SKIP
    """
    ring = _SITES[site]
    if ring.fp8_for(q, ring.state.kernel if ring.state is not None else "auto") is not None:
        raise NotImplementedError(f"fa3_inductor: ring attention site {ring.name} ran FP8 "
                                  "(inference only): no backward through an FP8 forward; drop "
                                  "'fa3.fp8' / context_parallel(fp8=...) to train")
    call = ring.call(q, k, v, score_bufs, mask_bufs, backward=True)
    # natural-log units: L = L2 ln 2, so dL = dL2 / ln 2
    dlse = None if dlse2 is None else dlse2 / _LN2
    with _eager_dispatch():
        grads = attention_backward(call, q, k, v, out, lse2 * _LN2, dout, dlse)
    return tuple(g.contiguous() for g in grads)   # the layouts of the fake


@ring_site_backward.register_fake
def _ring_site_backward_fake(q, k, v, out, lse2, dout, dlse2, score_bufs, mask_bufs, site):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@contextlib.contextmanager
def _eager_dispatch() -> Iterator[None]:
    """The dispatcher as an eager call sees it, inside our ops' kernels. A custom op's kernel runs
    below autograd, and one called from compiled code below functorch and the rest too (their keys
    excluded), where nothing records a graph even under enable_grad and vmap fails. The ring's
    steps need both: the dense backward differentiates the score_mod, planning our backward
    families traces the score_mod's joint graph, and block masks are built under vmap. Only the
    autocast keys stay excluded (the ring computes in its inputs' dtypes). The results are plain
    tensors: the op's own autograd (registered below) is what the caller's graph sees."""
    current = torch._C._dispatch_tls_local_exclude_set()
    exclude = torch._C.DispatchKeySet(torch._C.DispatchKey.Undefined)
    for key in _AUTOCAST_KEYS:
        if current.has(key):
            exclude = exclude.add(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        yield


_AUTOCAST_KEYS = tuple(getattr(torch._C.DispatchKey, name) for name in dir(torch._C.DispatchKey)
                       if name.startswith("Autocast"))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, score_bufs, mask_bufs, site = inputs
    out, lse2 = output
    ctx.save_for_backward(q, k, v, out, lse2, *score_bufs, *mask_bufs)
    ctx.n_score, ctx.n_mask, ctx.site = len(score_bufs), len(mask_bufs), site


def _backward(ctx, dout: Optional[Tensor], dlse2: Optional[Tensor]):
    q, k, v, out, lse2, *bufs = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.fa3_inductor.ring_site_backward(
        q, k, v, out, lse2, dout, dlse2, bufs[:ctx.n_score], bufs[ctx.n_score:], ctx.site)
    # captured tensors get none (ring_graph refuses those that need one)
    return dq, dk, dv, [None] * ctx.n_score, [None] * ctx.n_mask, None


ring_site.register_autograd(_backward, setup_context=_setup_context)


def ring_graph(gm: torch.fx.GraphModule, fp8=None) -> torch.fx.GraphModule:
    """``gm`` (edited in place and returned) with every flex_attention node replaced by
    ``fa3_inductor::ring_site`` on the node's q, k, v and captured buffers. Raises
    NotImplementedError, naming the site, where that cannot be exact (module docstring) or the
    graph reads the op's row maxima (ring attention gives the output and the LSE). ``fp8``
    (True or an FP8Recipe): the sites run FP8 for inference (module docstring); a site whose
    q, k or v needs a gradient raises.

    Example::

        >>> gm = ring_graph(recognized_gm)   # doctest: +SKIP
    """
    graph = gm.graph
    recipe = FP8Recipe.of(fp8)
    for node in flex_nodes(gm):
        q, k, v, score_node, block_mask, scale = node.args[:6]
        if recipe is not None:
            _check_inference(node.name, q, k, v)
        score_bufs = list(node.args[7]) if len(node.args) > 7 else []
        mask_bufs = list(node.args[8]) if len(node.args) > 8 else []
        for user in node.users:
            if not (user.target is operator.getitem and user.args[1] in (0, 1)):
                raise NotImplementedError(
                    f"fa3_inductor.distributed.context_parallel: attention site {node.name} reads "
                    f"the flex_attention op's output {user.args[1:]!r} (ring attention gives the "
                    "output and the LSE only); " + _HELP)
        _check_buffers(node.name, _example(q), _example(k), score_bufs, mask_bufs)
        site = RingSite(node.name, _submodule(gm, score_node), _submodule(gm, block_mask[-1]),
                        float(scale), recipe)
        with graph.inserting_before(node):
            ring = graph.call_function(torch.ops.fa3_inductor.ring_site.default,
                                       (q, k, v, score_bufs, mask_bufs, site.number))
        ring.meta.update(node.meta)
        node.replace_all_uses_with(ring)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm


def _check_inference(name: str, *inputs: Any) -> None:
    """Raise when an FP8 ring site's q, k or v needs a gradient (Dynamo's example values record
    it as traced: a graph traced under no_grad has none). Sites FP8 does not take (float32) are
    left alone: they run without FP8 (RingSite.fp8_for)."""
    q = _example(inputs[0])
    if q is not None and q.dtype not in (torch.bfloat16, torch.float16):
        return
    for what, node in zip("qkv", inputs):
        t = _example(node)
        if t is not None and t.requires_grad:
            raise NotImplementedError(
                f"fa3_inductor.distributed.context_parallel: attention site {name} would run FP8 "
                f"('fa3.fp8' or context_parallel(fp8=...)), which is inference-only, and its "
                f"{what} needs a gradient; run the model under torch.no_grad() / torch.inference_mode(), "
                "or drop the FP8 option to train")


def _check_buffers(name: str, q: Any, k: Any, score_bufs: list, mask_bufs: list) -> None:
    """Raise for captured tensors the ring cannot read exactly (module docstring)."""
    lengths = {q.shape[2], k.shape[2]} if q is not None and k is not None else set()
    for kind, bufs in (("score_mod", score_bufs), ("mask_mod", mask_bufs)):
        for buf in bufs:
            t = _example(buf)
            if t is None:
                raise NotImplementedError(
                    f"fa3_inductor.distributed.context_parallel: attention site {name}'s {kind} "
                    f"captures {buf!r}, not a tensor the ring can pass on; " + _HELP)
            if lengths & set(t.shape):
                raise NotImplementedError(
                    f"fa3_inductor.distributed.context_parallel: attention site {name}'s {kind} "
                    f"reads a tensor of shape {list(t.shape)}, which has this rank's "
                    f"sequence-shard length ({q.shape[2]} queries, {k.shape[2]} keys): its entries "
                    "belong to local positions (document ids, a padding or dense mask), so ring "
                    "attention over global positions cannot read it; " + _HELP)
            if t.requires_grad:
                raise NotImplementedError(
                    f"fa3_inductor.distributed.context_parallel: attention site {name}'s {kind} "
                    f"reads a tensor that needs a gradient (shape {list(t.shape)}, a learnable "
                    "bias): ring attention gives captured tensors no gradient; keep the bias "
                    "outside the attention, or " + _HELP)


def _example(node: Any) -> Optional[Tensor]:
    if isinstance(node, torch.fx.Node):
        value = node.meta.get("example_value", node.meta.get("val"))
        return value if isinstance(value, Tensor) else None
    return None


def _submodule(gm: torch.fx.GraphModule, node: Any) -> Optional[torch.fx.GraphModule]:
    if isinstance(node, torch.fx.Node) and node.op == "get_attr":
        mod = gm.get_submodule(node.target)
        return mod if isinstance(mod, torch.fx.GraphModule) else None
    return None


def _keeps_everything(mask_gm: torch.fx.GraphModule) -> bool:
    """A mask_mod graph that keeps every entry: recognition's noop mask, or Dynamo's default
    (``new_ones(())``) for a flex_attention call without a block mask."""
    ops = {getattr(n.target, "__name__", str(n.target)) for n in mask_gm.graph.nodes
           if n.op in ("call_function", "call_method")}
    if ops <= {"new_ones", "ones", "ones_like"}:
        return True
    try:
        return is_constant_true_mask(mask_gm)
    except Exception:   # a graph the generator cannot read: not provably all-true, keep it
        return False
