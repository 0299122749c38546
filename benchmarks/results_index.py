"""Write benchmarks/results/INDEX.md: every run kept under benchmarks/results/, with its commit.

A run is the set of files sharing one stem (``bench-nvidia-h200-2026-11-22-1114.{json,md,png,log}``).
The index lists each run's kind (the stem's first word), device, date, preset (bench runs: the JSON's
``preset``), its files and the commit that added them; the newest run of each kind and preset is
marked current. Git history holds what was removed.

    python benchmarks/results_index.py          # rewrites benchmarks/results/INDEX.md
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
_STEM = re.compile(r"^(?P<kind>[a-z0-9-]+?)-(?P<device>nvidia-[a-z0-9-]+?)-(?P<date>\d{4}-\d{2}-\d{2})"
                   r"(?:-(?P<time>\d{4}))?(?P<tag>[-.][^.]*)?$")


def _stem(name: str) -> str:
    for ext in (".txt.gz", ".json", ".md", ".png", ".log", ".xml", ".patch", ".py", ".txt"):
        if name.endswith(ext):
            return name[: -len(ext)]
    return name


def _added_by(path: str) -> str:
    out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%h", "--", path],
                         capture_output=True, text=True, cwd=RESULTS).stdout.split()
    return out[-1] if out else "(uncommitted)"


def _preset(stem: str) -> str:
    path = os.path.join(RESULTS, stem + ".json")
    if not os.path.exists(path):
        return ""
    try:
        with open(path) as f:
            return str(json.load(f).get("preset", ""))
    except (OSError, ValueError):
        return ""


def main() -> None:
    runs: dict[str, list[str]] = collections.defaultdict(list)
    for name in sorted(os.listdir(RESULTS)):
        if name != "INDEX.md":
            runs[_stem(name)].append(name)
    rows = []
    for stem, files in runs.items():
        m = _STEM.match(stem)
        kind, device, date = (m["kind"], m["device"], f"{m['date']} {m['time'] or ''}".strip()) if m \
            else ("other", "", "")
        rows.append(dict(stem=stem, kind=kind, device=device, date=date,
                         preset=_preset(stem) if kind == "bench" else "",
                         files=", ".join(f[len(stem):] or f for f in files), commit=_added_by(files[0])))
    newest: dict[tuple, str] = {}
    for r in sorted(rows, key=lambda r: (r["date"], r["stem"])):
        newest[(r["kind"], r["preset"])] = r["stem"]
    lines = ["# Benchmark results", "",
             "Every run kept here, oldest first; `current` marks the newest run of each kind and preset.",
             "Regenerate with `python benchmarks/results_index.py`. Each file names its device, versions and",
             "date inside; removed runs stay in git history.", "",
             "| run | kind | preset | device | date (UTC) | files | added by | |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["date"], r["stem"])):
        mark = "current" if newest.get((r["kind"], r["preset"])) == r["stem"] else ""
        lines.append(f"| `{r['stem']}` | {r['kind']} | {r['preset']} | {r['device']} | {r['date']} | "
                     f"{r['files']} | `{r['commit']}` | {mark} |")
    with open(os.path.join(RESULTS, "INDEX.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {len(rows)} runs to {os.path.join(RESULTS, 'INDEX.md')}")


if __name__ == "__main__":
    main()
