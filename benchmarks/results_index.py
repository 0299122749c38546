"""Write benchmarks/results/INDEX.md: the runs kept under benchmarks/results/ and the past ones.

A run is the set of files sharing one stem (``bench-nvidia-h200-2026-11-22-1114.{json,md,png,log}``);
a file without a JSON whose stem extends a run's stem (``...-1114-env.log``) belongs to that run. The
index lists each run's kind (the stem's first word), device, date, preset (bench runs: the JSON's
``preset``, plus the dtype when not bf16 and the sliding window when not 256 keys), its files and the
commit that added them. The newest run of each kind and preset is current; the folder keeps only
current runs (``--prune`` deletes the others from the working tree). Runs no longer in the folder are
listed with the commit that added them and the commit that removed them (or "working tree" for a
deletion not committed yet), read from ``git log``, so ``git show <added>:benchmarks/results/<file>``
brings any of them back.

    python benchmarks/results_index.py            # rewrites benchmarks/results/INDEX.md
    python benchmarks/results_index.py --prune    # deletes the non-current runs first
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
from typing import Optional

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
_STEM = re.compile(r"^(?P<kind>[a-z0-9-]+?)-(?P<device>nvidia-[a-z0-9-]+?)-(?P<date>\d{4}-\d{2}-\d{2})"
                   r"(?:-(?P<time>\d{4}))?(?P<tag>[-.][^.]*)?$")


def _stem(name: str) -> str:
    for ext in (".txt.gz", ".json", ".md", ".png", ".log", ".xml", ".patch", ".py", ".txt"):
        if name.endswith(ext):
            return name[: -len(ext)]
    return name


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=RESULTS).stdout


def _history() -> tuple[dict[str, str], dict[str, str], set[str]]:
    """File name -> the newest commit that added it, -> the newest commit that deleted it; and the
    names deleted in the working tree (or the index) but not in a commit yet."""
    prefix = _git("rev-parse", "--show-prefix").strip()          # "benchmarks/results/"
    found: dict[str, dict[str, str]] = {"A": {}, "D": {}}
    for flt, into in found.items():
        commit = ""
        for line in _git("log", "--no-renames", f"--diff-filter={flt}", "--name-only", "--format=@%h",
                         "--", ".").splitlines():
            if line.startswith("@"):
                commit = line[1:]
            elif line.startswith(prefix) and "/" not in line[len(prefix):]:
                into.setdefault(line[len(prefix):], commit)      # git log lists newest first
    pending = {line[len(prefix):] for line in _git("diff", "--no-renames", "--name-only",
                                                   "--diff-filter=D", "HEAD", "--", ".").splitlines()
               if line.startswith(prefix)}
    return found["A"], found["D"], pending


def _group(names: list[str]) -> dict[str, list[str]]:
    """Stem -> its files; a stem without a JSON that extends a stem with one joins that run."""
    runs: dict[str, list[str]] = collections.defaultdict(list)
    for name in sorted(names):
        runs[_stem(name)].append(name)
    with_json = sorted((s for s, files in runs.items() if s + ".json" in files), key=len, reverse=True)
    for stem in sorted(runs):
        if stem + ".json" in runs[stem]:
            continue
        owner = next((t for t in with_json if stem.startswith(t + "-")), None)
        if owner is not None:
            runs[owner] += runs.pop(stem)
    return runs


def _bench_json(stem: str, commit: str = "") -> dict:
    if commit:
        text = _git("show", f"{commit}:./{stem}.json")
    else:
        path = os.path.join(RESULTS, stem + ".json")
        text = open(path).read() if os.path.exists(path) else ""
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return {}


def _preset(data: dict) -> str:
    """A bench run's preset, with what makes it a different measurement: dtype, window size."""
    if not data:
        return ""
    label = str(data.get("preset", ""))
    dtypes = sorted({str(r.get("dtype")) for r in data.get("rows", []) if r.get("dtype")})
    if dtypes and dtypes != ["bfloat16"]:
        short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
        label += " " + "+".join(short.get(d, d) for d in dtypes)
    if data.get("window") not in (None, 256):
        label += f" window {data['window']}"
    return label


def _row(stem: str, files: list[str], commit: str, data: dict) -> dict:
    m = _STEM.match(stem)
    kind, device, date = (m["kind"], m["device"], f"{m['date']} {m['time'] or ''}".strip()) if m \
        else ("other", "", "")
    return dict(stem=stem, kind=kind, device=device, date=date,
                preset=_preset(data) if kind == "bench" else _part(m, device),
                files=", ".join(f[len(stem):] or f for f in files), commit=commit)


def _part(m: Optional[re.Match], device: str) -> str:
    """Other kinds: the GPU count, and a tag after the time naming a part measured alone
    (``serving-…-0221-varlen`` does not replace a full serving run)."""
    tag = (m["tag"] or "").lstrip("-.") if m else ""
    return " ".join(x for x in (_gpus(device), tag) if x)


def _gpus(device: str) -> str:
    """Multi-GPU runs (a device name ending in -x<N>) are a measurement of their own per GPU count."""
    m = re.search(r"-x(\d+)$", device)
    return f"{m[1]} GPUs" if m else ""


def _newest(rows: list[dict]) -> dict[tuple, str]:
    newest: dict[tuple, str] = {}
    for r in sorted(rows, key=lambda r: (r["date"], r["stem"])):
        newest[(r["kind"], r["preset"])] = r["stem"]
    return newest


def main(argv: list[str] | None = None) -> None:
    prune = "--prune" in (sys.argv[1:] if argv is None else argv)
    added, deleted, pending = _history()
    present = [n for n in os.listdir(RESULTS) if n != "INDEX.md" and os.path.isfile(os.path.join(RESULTS, n))]
    runs = _group(present)
    rows = [_row(stem, files, added.get(files[0], "(uncommitted)"), _bench_json(stem))
            for stem, files in runs.items()]
    newest = _newest(rows)
    if prune:
        for r in [r for r in rows if newest[(r["kind"], r["preset"])] != r["stem"]]:
            for name in runs[r["stem"]]:
                os.remove(os.path.join(RESULTS, name))
                pending.add(name)
            rows.remove(r)
    kept = {n for r in rows for n in runs[r["stem"]]}
    gone = sorted((set(added) | pending) - kept - {"INDEX.md"})
    past = []
    for stem, files in _group(gone).items():
        commit = added.get(files[0], "?")
        removed = "working tree" if any(f in pending for f in files) else deleted.get(files[0], "?")
        row = _row(stem, files, commit, _bench_json(stem, commit) if stem + ".json" in files else {})
        past.append(dict(row, removed=removed))

    lines = ["# Benchmark results", "",
             "This folder keeps the current run of each kind and preset (the newest); every earlier run is",
             "listed under \"Past runs\" with the commit that added it and the commit that removed it, so",
             "`git show <added by>:benchmarks/results/<file>` brings it back. Each file names its device,",
             "versions and date inside. Regenerate with `python benchmarks/results_index.py` (`--prune`",
             "first deletes the runs a newer one has replaced).", "",
             "## Current runs", "",
             "| run | kind | preset | device | date (UTC) | files | added by | |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["date"], r["stem"]), reverse=True):
        mark = "current" if newest.get((r["kind"], r["preset"])) == r["stem"] else "replaced"
        lines.append(f"| `{r['stem']}` | {r['kind']} | {r['preset']} | {r['device']} | {r['date']} | "
                     f"{r['files']} | `{r['commit']}` | {mark} |")
    lines += ["", "## Past runs", "",
              "Newest first. \"working tree\": deleted in the working tree, not committed yet; read it",
              "from the commit that added it.", "",
              "| run | kind | preset | device | date (UTC) | files | added by | removed by |",
              "|---|---|---|---|---|---|---|---|"]
    for r in sorted(past, key=lambda r: (r["date"], r["stem"]), reverse=True):
        removed = r["removed"] if r["removed"] in ("working tree", "?") else f"`{r['removed']}`"
        lines.append(f"| `{r['stem']}` | {r['kind']} | {r['preset']} | {r['device']} | {r['date']} | "
                     f"{r['files']} | `{r['commit']}` | {removed} |")
    with open(os.path.join(RESULTS, "INDEX.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {len(rows)} current and {len(past)} past runs to {os.path.join(RESULTS, 'INDEX.md')}")


if __name__ == "__main__":
    main()
