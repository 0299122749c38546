"""benchmarks/det_order_model.py: the deterministic backward's launch orders under list scheduling (CPU, no kernel)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from det_order_model import Launch, launch_order, makespan  # noqa: E402


@pytest.mark.parametrize("mask", ["causal", "document"])
def test_descending_adds_never_wait_under_causal_like_masks(mask):
    """A KV tile reaches each query step two steps after the tile above it did, so with the adds in descending tile
    order and free releases no CTA waits: the same makespan as without any order, whatever the group."""
    launch = Launch(heads=6, kv_tiles=8, q_steps=16, mask=mask, doc_steps=4)
    for group in (1, 2, 6):
        order = launch_order(launch, group, descending=True)
        free = makespan(launch, order, 10, 1.0, 0.0, 0.0, ordered=False, descending=True)
        assert makespan(launch, order, 10, 1.0, 0.0, 0.0, ordered=True, descending=True) == free


def test_ascending_adds_chain_co_resident_tiles():
    """Ascending: a head's co-resident tiles each wait on the tile below, which reaches the step two steps later, so
    a head's short tiles hold their SMs until its longest ends (one head a wave here: 64 steps against 36)."""
    launch = Launch(heads=4, kv_tiles=8, q_steps=16, mask="causal")
    order = launch_order(launch, 1, descending=False)
    assert makespan(launch, order, 8, 1.0, 0.0, 0.0, ordered=False, descending=False) == 36
    assert makespan(launch, order, 8, 1.0, 0.0, 0.0, ordered=True, descending=False) == 64


def test_launch_order_puts_every_predecessor_first():
    """Each CTA's previous adder (the tile after it, descending; before it, ascending) of the same head is launched
    earlier, so a CTA waits only on CTAs launched before it."""
    launch = Launch(heads=5, kv_tiles=6, q_steps=12, mask="causal")
    for descending in (False, True):
        for group in (1, 2, 5):
            position = {cta: i for i, cta in enumerate(launch_order(launch, group, descending))}
            assert len(position) == launch.heads * launch.kv_tiles
            for (head, tile), i in position.items():
                before = tile + 1 if descending else tile - 1
                if 0 <= before < launch.kv_tiles:
                    assert position[head, before] < i


@pytest.mark.parametrize("mask", ["causal", "document"])
def test_walking_up_ascending_adds_never_wait(mask):
    """Walked from the bottom up, every tile of a head reaches a query step at the same count of steps from its end,
    the tiles below (which add there first) no later: with the adds ascending and free releases no CTA waits."""
    launch = Launch(heads=6, kv_tiles=8, q_steps=16, mask=mask, doc_steps=4)
    for group in (1, 2, 6):
        order = launch_order(launch, group, descending=False)
        free = makespan(launch, order, 10, 1.0, 0.0, 0.0, ordered=False, descending=False, walk_up=True)
        assert makespan(launch, order, 10, 1.0, 0.0, 0.0, ordered=True, descending=False, walk_up=True) == free
