"""`fa3_inductor.flex` without torch.compile: the inference fast path on CUDA.

A compiled call pays Dynamo's guards, AOT autograd's wrapper and Inductor's graph call on every
invocation (~100 µs on an H200), which is more than the kernel itself at short sequences. When
no gradient is needed, flex() does not need any of that: it plans the site once (generate the
mods, pick the template, exactly as the lowering does) and then calls the
``fa3_inductor::flex_fwd`` op directly.

Plans are cached by what the mods compute, not by the function objects (mod_keys.py): that is
the part of Dynamo's guarding this path needs: redefining ``softcap(30.0)`` on every call hits
the cache, changing a captured number re-plans, and a captured tensor counts by its layout and
place only (plan_cache.py: the kernel reads its values). A mod whose key cannot be read (a callable
object, a functools.partial, an unusual closure value) is cached by identity.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Hashable, Optional

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import noop_mask

from ._log import info_once
from .config import Settings
from .lowering.site_plan import plan_site
from .mod_keys import ModWatch, Unkeyable, mod_key
from .plan_cache import Plan as _Plan, cached
from .runtime.kernel_failures import kernel_failure
from .runtime.spec import SiteSpec
from .templates.decode.shape import decode_fit
from .templates.modgen import BufferSpec, UnsupportedMod, trace_mod

_NO_MASK_BLOCK = 1 << 30   # torch's "no mask" block size
_LN2 = math.log(2.0)      # the kernels' LSE is in log2 units
_MAX_PLANS = 512
_PLANS: dict[Hashable, Any] = {}


def forward(q: Tensor, k: Tensor, v: Tensor, score_mod: Optional[Callable], block_mask: Any,
            scale: float, template: str, memo: Optional[tuple] = None,
            sinks: Optional[Tensor] = None) -> Optional[tuple[Tensor, Tensor]]:
    """(out, lse in natural-log units) from our kernel, or None when it cannot serve the call
    (the caller then takes the compiled path, which records why).

    Inputs are validated by the caller, and q, k, v need no gradient; a captured tensor that
    needs one sends the call to the compiled path too. ``memo``: flex()'s ``(key, score_mod,
    mask_mod, block_mask)`` to remember this call by for :func:`replay`, or None. ``sinks``: [HQ]
    per-head logits added to each row's denominator in the kernel's epilogue (out and lse include
    them); such calls are not memoized (the memo's launch has no sinks argument).

    Example::

        >>> out, lse = forward(q, k, v, None, None, 0.125, "auto")   # doctest: +SKIP
    """
    mask_mod = block_mask.mask_mod if block_mask is not None else None
    plan = cached_plan(q, k, v, score_mod, mask_mod, block_mask, template, sinks=sinks is not None)
    if plan.spec is None or kernel_failure(SiteSpec.from_json(plan.spec)) is not None:
        return None   # the compiled path plans it again and records why torch's kernel runs
    if torch.is_grad_enabled() and any(b.requires_grad for b in (*plan.score_bufs, *plan.mask_bufs,
                                                                   *([] if sinks is None else [sinks]))):
        return None  # a learnable captured tensor: the compiled path gives it a gradient
    tables, sparse_q, sparse_kv = block_mask_tables(block_mask)
    out, lse, _ = torch.ops.fa3_inductor.flex_fwd.default(
        q, k, v, *tables, plan.score_bufs, plan.mask_bufs, float(scale), int(sparse_q),
        int(sparse_kv), plan.spec, sinks)
    if memo is not None and sinks is None:
        _remember(memo, q, k, v, plan, tables, float(scale), int(sparse_q), int(sparse_kv))
    return out, lse.mul_(_LN2)


def block_mask_tables(block_mask: Any) -> tuple[tuple, int, int]:
    """(the four block-mask tables, query block, KV block) a kernel call takes; all None and torch's
    "no mask" block size without a block mask.

    Example::

        >>> block_mask_tables(None)[1] == 1 << 30
        True
    """
    if block_mask is None:
        return (None, None, None, None), _NO_MASK_BLOCK, _NO_MASK_BLOCK
    tables = (block_mask.kv_num_blocks, block_mask.kv_indices,
              block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    sparse_q, sparse_kv = (int(x) for x in block_mask.BLOCK_SIZE)
    return tables, sparse_q, sparse_kv


# ---------------------------------------------------------------------------------------------------
# The call memo: a repeated flex() call re-launches its kernel without planning.
#
# flex() spends most of its host time before the kernel: checking inputs, keying mods (mod_key walks
# their code and closures), finding the block mask and the plan, the op's dispatch, key and
# allocations (~100-170 us on an H100 host against ~20 us for one plain Triton launch, issue 16).
# A call made with the same mod, mask and block-mask objects on tensors of the same shapes, strides,
# dtypes, device and alignment as an earlier served call launches the same kernel: the memo keeps
# that launch (runtime/ops.bound_launch) under the objects' identities, and proves per call that
# they still compute the same thing (mod_keys.ModWatch: rebound cells or globals, captured tensors
# edited in place under a mask_mod).
#
# The same launch is also kept under what the mods compute (equal_key): a model that writes
# ``score_mod=mods.softcap(30.0)`` in its forward passes a new closure every call, whose identity
# never repeats; without that second key each such call took the full path (~300 us on an H200
# host against ~27 for a reused mod). Anything else takes the full path.
#
# flex(fp8=...) keeps its calls in the same table (direct_fp8.py), under keys whose template slot
# names the recipe, through the same remember / live / ModWatch / signature machinery.
# ---------------------------------------------------------------------------------------------------
_MAX_CALLS = 128   # keys: a remembered call is kept under two (its identities', its mods' equal key)


class _Call:
    __slots__ = ("objects", "watches", "signature", "launch", "grad_bufs")

    def __init__(self, objects, watches, signature, launch, grad_bufs):
        self.objects, self.watches, self.signature, self.launch, self.grad_bufs = (
            objects, watches, signature, launch, grad_bufs)


_CALLS: dict[tuple, _Call] = {}
_stats = {"remembered": 0, "equal_hits": 0}
_EQUAL = "equal"   # an equal key's first item (an identity key's is an int)


def memo_key(score_mod: Optional[Callable], mask_mod: Optional[Callable], block_mask: Any,
             scale: Optional[float], enable_gqa: bool, template: str) -> tuple:
    """The memo's key of a flex() call: the identities of its mod and mask objects and its options.

    Example::

        >>> memo_key(None, mods.causal, None, None, False, "auto")[3:]
        (None, False, 'auto')
    """
    return (id(score_mod), id(mask_mod), id(block_mask), scale, enable_gqa, template)


def equal_key(key: tuple, score_mod: Optional[Callable], mask_mod: Optional[Callable],
              mask_versions: bool = True) -> Optional[tuple]:
    """The memo's second key of the call ``key`` (:func:`memo_key`) names: the mods' identities
    replaced by what they compute (mod_keys.mod_key; a mask's captured tensors with their version
    counters, as its block mask was built from their contents, unless ``mask_versions`` is False:
    a caller whose kernel reads the mask's tensors at run time, flex_decode), so that a mod made
    anew per call finds the launch an equal one left; None when a mod cannot be keyed (it takes
    the full path).

    Example::

        >>> key = lambda s: equal_key(memo_key(s, None, None, None, False, "auto"), s, None)
        >>> key(mods.softcap(30.0)) == key(mods.softcap(30.0)) != key(mods.softcap(31.0))
        True
    """
    try:
        return (_EQUAL, mod_key(score_mod), mod_key(mask_mod, versions=mask_versions), *key[2:])
    except Unkeyable:
        return None


def replay_either(key: tuple, score_mod: Optional[Callable], mask_mod: Optional[Callable],
                  replay_under: Callable[[tuple], Optional[Any]], mask_versions: bool = True) -> Optional[Any]:
    """``replay_under(key)``, and if it found nothing and there are mods, ``replay_under`` of their
    :func:`equal_key` (a mod made anew per call, equal to a remembered one; ``mask_versions`` as there):
    what flex()'s bf16 and FP8 memos and flex_decode's try before the full path. None when neither replayed.

    Example::

        >>> key = memo_key(None, mods.causal, None, None, False, "auto")
        >>> replay_either(key, None, mods.causal, lambda key: replay(key, q, k, v, False))   # doctest: +SKIP
    """
    hit = replay_under(key)
    if hit is None and (score_mod is not None or mask_mod is not None):
        equal = equal_key(key, score_mod, mask_mod, mask_versions)
        hit = replay_under(equal) if equal is not None else None
    return hit


def replay(key: tuple, q: Tensor, k: Tensor, v: Tensor, return_lse: bool
           ) -> Optional[tuple[Tensor, Optional[Tensor]]]:
    """(out, lse in natural-log units or None) if an earlier served call of this key covers this
    one (same tensor signature, mods unchanged, no gradient needed), else None.

    Example::

        >>> replay(memo_key(None, mods.causal, None, None, False, "auto"), q, k, v, False)  # doctest: +SKIP
    """
    call = live(key, _signature(q, k, v))
    if call is None:
        return None
    if torch.is_grad_enabled() and (call.grad_bufs or q.requires_grad or k.requires_grad
                                    or v.requires_grad):
        return None
    if is_equal_key(key):   # counted for this key only: the identity key's hit stays as cheap as it is
        _stats["equal_hits"] += 1
    out, lse = call.launch(q, k, v, return_lse)
    return out, (lse.mul_(_LN2) if return_lse else None)   # the launch's own LSE buffer: scaled in place


def live(key: tuple, signature: tuple) -> Optional[_Call]:
    """The call remembered under ``key`` (:func:`memo_key`, :func:`equal_key`, or a key a caller
    made the same way) if it was remembered with ``signature`` and its mods are unchanged (a changed
    one's entry is dropped), else None. :func:`replay` and the FP8 path's memo (direct_fp8.py) use it.

    Example::

        >>> live(key, _signature(q, k, v)).launch(q, k, v, False)   # doctest: +SKIP
    """
    call = _CALLS.get(key)
    if call is None or call.signature != signature:
        return None
    for watch in call.watches:
        if not watch.unchanged():
            del _CALLS[key]
            return None
    return call


def memo_launch(key: tuple) -> Optional[Any]:
    """What the call remembered under ``key`` re-plays: runtime/ops.BoundLaunch (its fast_launch entry,
    the tensors passed after q, k, v and the outputs, the family's name), or None when nothing is
    remembered under ``key`` or its launch was not made by ``runtime.ops.bound_launch`` (the FP8 path's).
    For benchmarks and tests that time or check the memo's steps one by one (benchmarks/host_overhead.py).

    Example::

        >>> bound = memo_launch(memo_key(None, None, None, None, False, "auto"))   # doctest: +SKIP
        >>> fast_launch.relaunch(bound.entry, (q, k, v, out, lse, row_max, *bound.rest))   # doctest: +SKIP
        'hopper'
    """
    call = _CALLS.get(key)
    return None if call is None else getattr(call.launch, "bound", None)


def is_equal_key(key: tuple) -> bool:
    """Whether ``key`` is an :func:`equal_key` (not an identity key).

    Example::

        >>> is_equal_key(memo_key(None, None, None, None, False, "auto"))
        False
    """
    return key[0] is _EQUAL


def stats() -> dict[str, int]:
    """The call memo's counters: calls remembered (full path, then a launch kept), and replays
    found by :func:`equal_key` (a mod made anew, equal to a remembered one); ``keys`` held.

    Example::

        >>> stats()["equal_hits"]      # doctest: +SKIP
        0
    """
    return dict(_stats, keys=len(_CALLS))


def _remember(memo: tuple, q: Tensor, k: Tensor, v: Tensor, plan: "_Plan", tables: tuple, scale: float,
              sparse_q: int, sparse_kv: int) -> None:
    from .runtime.ops import bound_launch

    if remember(memo, _signature(q, k, v),
                any(b.requires_grad for b in (*plan.score_bufs, *plan.mask_bufs)),
                lambda: bound_launch(q, k, v, tables, plan.score_bufs, plan.mask_bufs, scale, sparse_q,
                                     sparse_kv, plan.spec)):
        _stats["remembered"] += 1


def remember(memo: tuple, signature: tuple, grad_bufs: bool, bind: Callable[[], Optional[Callable]],
             mask_versions: bool = True) -> bool:
    """Keep the launch ``bind()`` makes (None: nothing to keep) under ``memo``'s keys (flex()'s
    ``(key, score_mod, mask_mod, block_mask)``: its identity key and, where the mods can be keyed,
    their :func:`equal_key`) for calls of ``signature``, watching the mods (mod_keys.ModWatch);
    ``grad_bufs``: a captured tensor requires grad. Whether it was kept (a mod that cannot be
    watched keeps nothing). ``mask_versions`` False: a mask's captured tensors edited in place
    keep the entry (its kernel reads them at run time, no block mask was built from them:
    flex_decode's memo, decode_memo.py). The bf16 path's :func:`_remember`, the FP8 path's
    (direct_fp8.py) and flex_decode's use it; :func:`live` finds the entry.

    Example::

        >>> remember(memo, _signature(q, k, v), False, lambda: launch)   # doctest: +SKIP
        True
    """
    key, score_mod, mask_mod, block_mask = memo
    try:
        # a mask_mod's block mask was built from its captured tensors' contents: watch their versions
        # (a block mask flex() built from mask_mod carries that same mask_mod: watched once)
        given_mask = getattr(block_mask, "mask_mod", None)
        watches = [ModWatch(fn, versions=versions) for fn, versions in (
            (score_mod, False), (mask_mod, mask_versions),
            (None if given_mask is mask_mod else given_mask, False))
            if fn is not None]
    except Unkeyable:
        return False
    launch = bind()
    if launch is None:
        return False
    if len(_CALLS) >= _MAX_CALLS - 1:
        _CALLS.clear()
    equal = equal_key(key, score_mod, mask_mod, mask_versions)
    keys = (key,) if equal is None else (key, equal)
    # the objects stay referenced: their ids in the keys (the mods', their captured tensors') cannot
    # be reused while the entry lives. A block mask weakly: transformers builds one per forward, and
    # the entry (with LSE and row-max scratch of the call's size) goes when it does, before its id
    # can be reused
    held: tuple = (score_mod, mask_mod)
    if block_mask is not None:
        try:
            weakref.finalize(block_mask, _forget, keys)
        except TypeError:   # not weakly referable
            held += (block_mask,)
    call = _Call(held, watches, signature, launch, grad_bufs)
    _CALLS.update(dict.fromkeys(keys, call))
    return True


def _forget(keys: tuple) -> None:
    for key in keys:
        _CALLS.pop(key, None)


def call_signature(q: Tensor, k: Tensor, v: Tensor) -> tuple:
    """What of ``q, k, v`` a remembered launch depends on: shapes, strides, dtypes, devices,
    16-byte alignment, which of them are one tensor.

    Example::

        >>> x = torch.zeros(1, 1, 8, 16); call_signature(x, x, x)[-3:]
        (True, True, True)
    """
    # one flat tuple: it is built on every memo hit. Which of q, k, v are one tensor: the memo's
    # launch finds its inputs by identity (runtime/fast_launch.aliasing)
    return (q.shape, q.stride(), q.dtype, q.device, q.data_ptr() & 15,
            k.shape, k.stride(), k.dtype, k.device, k.data_ptr() & 15,
            v.shape, v.stride(), v.dtype, v.device, v.data_ptr() & 15, q is k, k is v, q is v)


_signature = call_signature


def clear() -> None:
    """Forget every plan and remembered call, and zero the memo's counters (tests; after redefining
    mods in place)."""
    _PLANS.clear()
    _CALLS.clear()
    _stats.update(remembered=0, equal_hits=0)


def cached_plan(q: Tensor, k: Tensor, v: Tensor, score_mod: Optional[Callable],
                mask_mod: Optional[Callable], block_mask: Any, template: str, fp8: bool = False,
                sinks: bool = False) -> _Plan:
    """:func:`plan_direct`'s plan, cached by what the mods compute (module docstring) and the
    site's kind (device, dtype, heads, head dims, batch broadcast, block sizes, FP8 or not, sinks
    or not), bound to the tensors these mods capture (plan_cache.py).

    Example::

        >>> cached_plan(q, k, v, None, None, None, "auto") is cached_plan(q, k, v, None, None, None, "auto")  # doctest: +SKIP
        True
    """
    site = (template, fp8, q.device, q.dtype, q.shape[1], q.shape[3], k.shape[1], v.shape[3],
            q.shape[0] == k.shape[0] or k.shape[0] == 1,
            None if block_mask is None else tuple(block_mask.BLOCK_SIZE),
            decode_fit(q.shape[2], q.shape[1], k.shape[1]),   # the decode family's or not
            sinks)
    return cached(_PLANS, _MAX_PLANS, site, score_mod, mask_mod,
                  lambda: plan_direct(q, k, v, score_mod, mask_mod, block_mask, template, fp8, sinks))


def plan_direct(q: Tensor, k: Tensor, v: Tensor, score_mod: Optional[Callable],
                mask_mod: Optional[Callable], block_mask: Any, template: str, fp8: bool = False,
                sinks: bool = False) -> _Plan:
    """Plan a direct call's site as the lowering would (mods traced and generated, families
    chosen; ``fp8``: the inputs reach the kernel from the FP8 prologue; ``sinks``: the call passes
    per-head sinks). ``.spec`` is None when our kernels do not serve it, with ``.reason``.

    Example::

        >>> plan_direct(q, k, v, None, None, None, "auto").spec is not None   # doctest: +SKIP
        True
    """
    try:
        score_gm, score_bufs = trace_mod(score_mod or _identity_score, "score")
        mask_gm, mask_bufs = trace_mod(mask_mod or noop_mask, "mask")
    except Exception as exc:  # the compiled path traces it again and reports properly
        return _Plan(None, [], [], f"could not trace the mods here: {exc}")
    sparse = (_NO_MASK_BLOCK, _NO_MASK_BLOCK) if block_mask is None else \
        tuple(int(x) for x in block_mask.BLOCK_SIZE)
    kv = f"kv{list(k.shape)}" + (f" v{list(v.shape)}" if v.shape[3] != k.shape[3] else "")
    try:
        spec, reason = plan_site(
            score_gm, mask_gm, [BufferSpec.of(b) for b in score_bufs],
            [BufferSpec.of(b) for b in mask_bufs], device=q.device, dtype=q.dtype,
            q_heads=q.shape[1], kv_heads=k.shape[1], head_dim=q.shape[3],
            value_head_dim=v.shape[3], batches_match=q.shape[0] == k.shape[0] or k.shape[0] == 1,
            sparse_blocks=sparse, settings=Settings(template=template), needs_max=False, fp8=fp8,
            query_len=q.shape[2], sinks=sinks,
            description=f"q{list(q.shape)} {kv} "
                        f"{str(q.dtype).replace('torch.', '')} {q.device.type} "
                        f"(flex, {'fp8' if fp8 else 'direct'})")
    except UnsupportedMod as exc:
        return _Plan(None, [], [], f"mod not lowerable: {exc}")
    if spec is None:
        return _Plan(None, [], [], reason)
    if spec.note:
        info_once(f"fa3_inductor: {spec.note} ({spec.description})")
    # Buffers are baked into the generated code with their strides: pass them as traced.
    return _Plan(spec.to_json(), list(score_bufs), list(mask_bufs), None)


def _identity_score(score, b, h, q_idx, kv_idx):
    return score
