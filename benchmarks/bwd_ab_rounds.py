"""A/B of two source trees on bwd_speed.py in interleaved rounds: per row the median over rounds of old / new backward
time, so one noisy run of a row cannot decide a rule (docs/design/hopper_backward.md: one deterministic row read 3.43
and 3.75 ms in two runs of the same order).

    python benchmarks/bwd_ab_rounds.py --old /tmp/main --new . --old-label main --new-label my-branch --rounds 3 \
        --column 'ours[deterministic]_bwd_ms' --out $OUT/ab -- --seqlens 2048 8192 --head-dims 64 128 \
        --variants causal sliding_window document --bwd-variants default deterministic --flex-head-dims 0 --reps 5

Each round runs bwd_speed.py (with the arguments after ``--``) in the old tree, then in the new one (odd rounds new
first), each in its own process with PYTHONPATH set to that tree. Writes OUT.json (every run's rows, the medians) and
OUT.md (a table: per row the old and new medians, the median of the per-round ratios, and their geometric mean).
``--summarize`` makes the table again from an OUT.json, or from bwd_speed JSON files named old-*/new-* (no GPU).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys

KEY = ("N", "D", "Dv", "variant")


def _rows(result: dict) -> dict[tuple, dict]:
    return {tuple(r.get(k) for k in KEY): r for r in result["rows"]}


def summarize(runs: dict[str, list[dict]], column: str) -> tuple[list[dict], list[str]]:
    """Per-row medians of ``column`` over the rounds of runs['old'] and runs['new'] (lists of bwd_speed JSON results,
    round by round), the median of the per-round ratios old / new, and a markdown table.

    Example::

        >>> run = lambda ms: {"rows": [{"N": 2048, "D": 64, "Dv": 64, "variant": "causal", "x": ms}]}
        >>> rows, _ = summarize({"old": [run(1.0), run(1.2)], "new": [run(0.8), run(1.0)]}, "x")
        >>> round(rows[0]["ratio_median"], 3)
        1.225
    """
    old, new = ([_rows(r) for r in runs[side]] for side in ("old", "new"))
    out = []
    for key in old[0]:
        a = [r[key][column] for r in old if r.get(key, {}).get(column) is not None]
        b = [r[key][column] for r in new if r.get(key, {}).get(column) is not None]
        if not a or len(a) != len(b):
            continue
        ratios = [x / y for x, y in zip(a, b)]
        out.append(dict(zip(KEY, key), old_ms=a, new_ms=b, old_median=statistics.median(a),
                        new_median=statistics.median(b), ratio_median=statistics.median(ratios)))
    if not out:
        return out, ["no rows in common"]
    geo = math.exp(sum(math.log(r["ratio_median"]) for r in out) / len(out))
    lowest = min(r["ratio_median"] for r in out)
    lines = [f"`{column}`, {len(old)} rounds: per row the medians (ms) and the median of the rounds' old / new (> 1: "
             f"new faster); geometric mean of the medians {geo:.3f}, lowest {lowest:.3f}", "",
             "| N | D | variant | old ms | new ms | old / new | rounds |", "|---|---|---|---|---|---|---|"]
    for r in out:
        dims = r["D"] if r["Dv"] in (None, r["D"]) else f"{r['D']}/{r['Dv']}"
        rounds = " ".join(f"{x / y:.3f}" for x, y in zip(r["old_ms"], r["new_ms"]))
        lines.append(f"| {r['N']} | {dims} | {r['variant']} | {r['old_median']:.3f} | {r['new_median']:.3f} | "
                     f"{r['ratio_median']:.3f} | {rounds} |")
    return out, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", help="the old source tree (its fa3_inductor is imported)")
    parser.add_argument("--new", default=".", help="the new source tree (default: this checkout)")
    parser.add_argument("--old-label", help="FA3_TREE for the old tree's runs (what its result rows name as 'tree')")
    parser.add_argument("--new-label", help="FA3_TREE for the new tree's runs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--column", default="ours[deterministic]_bwd_ms", help="a bwd_speed row key to compare")
    parser.add_argument("--out", required=True, help="path prefix: OUT.json and OUT.md")
    parser.add_argument("--summarize", nargs="*", help="no runs: the table from these JSON files (an OUT.json, or "
                                                       "bwd_speed results whose names start old- / new-)")
    args, rest = parser.parse_known_args()
    bench_args = rest[1:] if rest[:1] == ["--"] else rest
    if args.summarize is not None:
        runs = {"old": [], "new": []}
        for path in sorted(args.summarize):
            data = json.load(open(path))
            if "runs" in data:
                runs = data["runs"]
            else:
                runs["old" if os.path.basename(path).startswith("old") else "new"].append(data)
    else:
        if not args.old:
            parser.error("--old is required unless --summarize")
        runs = {"old": [], "new": []}
        for r in range(args.rounds):
            for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
                tree = os.path.abspath(getattr(args, side))
                prefix = f"{args.out}-{side}-{r}"
                env = dict(os.environ, PYTHONPATH=tree)
                label = getattr(args, f"{side}_label")
                if label:
                    env["FA3_TREE"] = label
                print(f"== round {r}, {side}: {tree}", flush=True)
                # each tree's own bwd_speed.py, so the timing code is the tree's as well
                subprocess.run([sys.executable, os.path.join(tree, "benchmarks", "bwd_speed.py"), *bench_args,
                                "--out", prefix], env=env, check=True, stdout=subprocess.DEVNULL)
                runs[side].append(json.load(open(prefix + ".json")))
                for ext in (".json", ".md"):
                    os.remove(prefix + ext)
    rows, lines = summarize(runs, args.column)
    first = runs["new"][0] if runs["new"] else {}
    head = [f"# bwd_speed A/B in rounds, {first.get('device', '?')}", "",
            f"Old: {', '.join(sorted({str(r.get('tree')) for r in runs['old']}))}; "
            f"new: {', '.join(sorted({str(r.get('tree')) for r in runs['new']}))}", "",
            f"torch {first.get('torch', '?')}, triton {first.get('triton', '?')}, first new run "
            f"{first.get('date', '?')}; its command: `{first.get('command', '?')}`", ""]
    with open(args.out + ".json", "w") as f:
        json.dump(dict(column=args.column, rows=rows, runs=runs), f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(head + lines) + "\n")
    print("\n".join(head + lines))


if __name__ == "__main__":
    main()
