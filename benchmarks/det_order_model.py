"""A model of the deterministic backward's launch orders (templates/hopper_bwd, "Deterministic dQ"): list scheduling
of the grid's CTAs on the SMs in their launch order, each CTA walking its query steps and waiting, at each dQ add, for
the add before it in the order of that query step's adds.

What it models: step time (one number a launch, from the default's measured backward), the wait for the previous add
(plus a release latency), the consumer's cost of each add (the release's fence), one CTA per SM. What it does not:
L2 hits and misses (the KV-tile-major order's cost, 0.83-0.94 of the default in the H200 probe), the producer's
loads, two warpgroups' halves. So it ranks orders by their waits and tails, not by their locality; docs/design/
hopper_backward.md compares it with the measured runs.

    python benchmarks/det_order_model.py --seqlen 8192 --mask causal
"""
from __future__ import annotations

import argparse
import heapq
from dataclasses import dataclass


@dataclass(frozen=True)
class Launch:
    """One deterministic launch: heads (kz, hkv; MHA here), KV tiles of 128 keys, query steps of 64 rows."""
    heads: int
    kv_tiles: int
    q_steps: int
    mask: str            # "noop", "causal" or "document" (documents of doc_steps query steps)
    doc_steps: int = 0

    def span(self, tile: int) -> tuple[int, int]:
        """[first, end) of the query steps a KV tile's CTA walks, in ascending order (bwd_sm90's walk: the partial
        diagonal block, then the full blocks below it; without a mask every step)."""
        if self.mask == "noop":
            return 0, self.q_steps
        first = 2 * tile
        if self.mask == "causal":
            return first, self.q_steps
        return first, min((first // self.doc_steps + 1) * self.doc_steps, self.q_steps)   # to the document's end

    def steps(self, tile: int) -> range:
        return range(*self.span(tile))

    def covers(self, tile: int, r: int) -> bool:
        first, end = self.span(tile)
        return first <= r < end


def launch_order(launch: Launch, group: int, descending: bool) -> list[tuple[int, int]]:
    """(head, KV tile) in launch order: KV tile major within groups of ``group`` heads (bwd_sm90._ordered_coords)."""
    order = []
    for first in range(0, launch.heads, group):
        heads = range(first, min(first + group, launch.heads))
        tiles = range(launch.kv_tiles - 1, -1, -1) if descending else range(launch.kv_tiles)
        order += [(h, t) for t in tiles for h in heads]
    return order


def makespan(launch: Launch, order: list[tuple[int, int]], slots: int, step: float, add_cost: float,
             release: float, ordered: bool, descending: bool, defer: int = 0, walk_up: bool = False) -> float:
    """Time until the last CTA ends (in step times: step = 1.0 is the default's step). ``ordered``: each add waits
    for the one before it in the query step's order (ascending or ``descending`` KV tiles). An add is visible
    ``release`` after it is released: at once (``defer`` 0), or halfway through the CTA's step ``defer`` steps later
    (the kernels release an add at a later add's _turn_ahead: D64 two steps, D >= 128 paired one or two), or at the
    CTA's end when it has no such step. ``walk_up``: each CTA walks its query steps from the last (the bottom of the
    rows) up, as branch ``bwd-det-rwalk`` did."""
    free = [0.0] * slots
    heapq.heapify(free)
    ready: dict[tuple[int, int, int], float] = {}   # (head, query step, tile) -> its add visible to the next
    end = 0.0
    for head, tile in order:
        t = heapq.heappop(free)
        steps = launch.steps(tile)[::-1] if walk_up else launch.steps(tile)
        starts, adds = [], []
        for r in steps:
            starts.append(t)
            t += step
            if ordered:
                before = _previous_adder(launch, tile, r, descending)
                if before is not None:
                    t = max(t, ready[head, r, before])
                adds.append(t)
                t += add_cost
        if ordered:
            for k, r in enumerate(steps):
                if not defer:   # released by the add's own fence (add_cost)
                    out = adds[k] + add_cost
                elif k + defer < len(starts):
                    out = starts[k + defer] + 0.5 * step
                else:
                    out = t
                ready[head, r, tile] = out + release
        heapq.heappush(free, t)
        end = max(end, t)
    return end


def _previous_adder(launch: Launch, tile: int, r: int, descending: bool):
    """The KV tile whose add into query step r comes just before ``tile``'s (None: ``tile`` adds first)."""
    others = range(tile + 1, launch.kv_tiles) if descending else range(tile - 1, -1, -1)
    return next((other for other in others if launch.covers(other, r)), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=16384, help="B * N (the benchmarks' 16k)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--mask", default="causal", choices=("noop", "causal", "document"))
    parser.add_argument("--slots", type=int, default=132, help="CTAs resident at once (one per SM)")
    parser.add_argument("--add-cost", type=float, default=0.15, help="consumer time of an add, in steps")
    parser.add_argument("--release", type=float, default=0.3, help="release to visible for the next adder, in steps")
    parser.add_argument("--defer", type=int, default=0, help="steps from an add to its release (makespan's defer)")
    parser.add_argument("--walk-up", action="store_true", help="each CTA walks its query steps from the last up")
    args = parser.parse_args()
    n = args.seqlen
    launch = Launch(heads=(args.tokens // n) * args.heads, kv_tiles=n // 128, q_steps=n // 64, mask=args.mask,
                    doc_steps=(n // 4) // 64)
    default = makespan(launch, sorted(launch_order(launch, launch.heads, False), key=lambda c: c[1]), args.slots,
                       1.0, 0.0, 0.0, False, False)
    print(f"{args.mask} N={n}: {launch.heads} heads x {launch.kv_tiles} KV tiles; default (longest first, no waits)"
          f" {default:.0f} steps")
    for descending in (False, True):
        for group in (launch.heads, 16, 8, 4, 2, 1):
            order = launch_order(launch, group, descending)
            span = makespan(launch, order, args.slots, 1.0, args.add_cost, args.release, True, descending,
                            args.defer, args.walk_up)
            print(f"  {'descending' if descending else 'ascending '} groups of {group:4d}: {span:8.0f} steps, "
                  f"default / this {default / span:.2f}")


if __name__ == "__main__":
    main()
