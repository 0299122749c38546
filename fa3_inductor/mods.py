"""Ready-made score_mod / mask_mod functions with FlexAttention's signatures.

    score_mod(score, b, h, q_idx, kv_idx) -> score
    mask_mod(b, h, q_idx, kv_idx) -> bool

They work with ``fa3_inductor.flex`` and with torch's ``flex_attention`` alike.

Example::

    >>> from fa3_inductor import flex, mods
    >>> out = flex(q, k, v, score_mod=mods.softcap(50.0),
    ...            mask_mod=mods.and_masks(mods.causal, mods.sliding_window(1024)))  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Causal mask: a query sees keys at or before its position.

    Example::

        >>> bool(causal(0, 0, torch.tensor(3), torch.tensor(2)))
        True
    """
    return q_idx >= kv_idx


def sliding_window(window: int) -> MaskMod:
    """Causal sliding window: a query sees the ``window`` most recent keys, itself included.

    Example::

        >>> m = sliding_window(4)
        >>> bool(m(0, 0, torch.tensor(9), torch.tensor(5))), bool(m(0, 0, torch.tensor(9), torch.tensor(6)))
        (False, True)
    """
    if int(window) < 1:
        raise ValueError(f"sliding_window: window must be >= 1, got {window}")
    window = int(window)

    def sliding_window_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return sliding_window_mask


def prefix_lm(prefix_len: int) -> MaskMod:
    """Prefix-LM: the first ``prefix_len`` positions are seen by everyone; causal after.

    Example::

        >>> bool(prefix_lm(8)(0, 0, torch.tensor(2), torch.tensor(6)))
        True
    """
    if int(prefix_len) < 0:
        raise ValueError(f"prefix_lm: prefix_len must be >= 0, got {prefix_len}")
    prefix_len = int(prefix_len)

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_len) | (q_idx >= kv_idx)

    return prefix_lm_mask


def document(doc_ids: Tensor, causal: bool = True) -> MaskMod:
    """Document (packed-sequence) mask: attend within one's own document only.

    ``doc_ids`` is a 1-D integer tensor giving each position's document; it must live on the
    device of q/k/v and cover the whole (query = key) sequence. Causal inside documents unless
    ``causal=False``.

    Example::

        >>> ids = torch.tensor([0, 0, 1, 1])
        >>> bool(document(ids)(0, 0, torch.tensor(3), torch.tensor(1)))
        False
    """
    if not isinstance(doc_ids, Tensor) or doc_ids.dim() != 1 or doc_ids.is_floating_point():
        raise ValueError("document: doc_ids must be a 1-D integer tensor (one id per position)")
    is_causal = bool(causal)

    def document_mask(b, h, q_idx, kv_idx):
        same = doc_ids[q_idx] == doc_ids[kv_idx]
        return same & (q_idx >= kv_idx) if is_causal else same

    return document_mask


def alibi(num_heads: int) -> ScoreMod:
    """ALiBi bias ``score + (kv_idx - q_idx) * slope(h)``, slopes ``2^(-8(h+1)/num_heads)``.

    Example::

        >>> s = alibi(8)(torch.tensor(0.0), 0, torch.tensor(0), torch.tensor(3), torch.tensor(5))
        >>> round(float(s), 4)
        1.0
    """
    if int(num_heads) < 1:
        raise ValueError(f"alibi: num_heads must be >= 1, got {num_heads}")
    step = -8.0 / int(num_heads)

    def alibi_bias(score, b, h, q_idx, kv_idx):
        slope = torch.exp2((h + 1) * step)
        return score + (kv_idx - q_idx) * slope

    return alibi_bias


def softcap(cap: float) -> ScoreMod:
    """Tanh soft-capping ``cap * tanh(score / cap)`` (Gemma 2, Grok).

    Example::

        >>> float(softcap(30.0)(torch.tensor(1000.0), 0, 0, 0, 0)) <= 30.0
        True
    """
    if not float(cap) > 0:
        raise ValueError(f"softcap: cap must be > 0, got {cap}")
    cap = float(cap)

    def softcap_score(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return softcap_score


def relative_bias(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Relative-position bias ``score + (q_idx - kv_idx)``.

    Example::

        >>> float(relative_bias(torch.tensor(1.0), 0, 0, torch.tensor(5), torch.tensor(2)))
        4.0
    """
    return score + (q_idx - kv_idx)


def and_masks(*masks: MaskMod) -> MaskMod:
    """A mask that keeps a score only where every mask keeps it.

    Example::

        >>> m = and_masks(causal, sliding_window(4))
    """
    if not masks or not all(callable(m) for m in masks):
        raise ValueError("and_masks: give one or more mask_mod callables")

    def all_of(b, h, q_idx, kv_idx):
        keep = masks[0](b, h, q_idx, kv_idx)
        for m in masks[1:]:
            keep = keep & m(b, h, q_idx, kv_idx)
        return keep

    return all_of


def or_masks(*masks: MaskMod) -> MaskMod:
    """A mask that keeps a score where any mask keeps it.

    Example::

        >>> m = or_masks(prefix_lm(16), causal)
    """
    if not masks or not all(callable(m) for m in masks):
        raise ValueError("or_masks: give one or more mask_mod callables")

    def any_of(b, h, q_idx, kv_idx):
        keep = masks[0](b, h, q_idx, kv_idx)
        for m in masks[1:]:
            keep = keep | m(b, h, q_idx, kv_idx)
        return keep

    return any_of


def chain(*score_mods: ScoreMod) -> ScoreMod:
    """Apply score mods left to right: ``chain(f, g)(s, ...) == g(f(s, ...), ...)``.

    Example::

        >>> m = chain(alibi(8), softcap(30.0))
    """
    if not score_mods or not all(callable(m) for m in score_mods):
        raise ValueError("chain: give one or more score_mod callables")

    def chained(score, b, h, q_idx, kv_idx):
        for m in score_mods:
            score = m(score, b, h, q_idx, kv_idx)
        return score

    return chained
