#!/usr/bin/env bash
# Two source trees in one device command: the GPU tests of both (at once: compiling, not the GPU, is
# what the tests spend their time on), then the quick benchmark of each, one after the other, and a
# table of the pass counts and of each benchmark case's speed new / old.
#
#     bash benchmarks/ab_suite.sh OLD_TREE [NEW_TREE (default: this checkout)]
#
# OLD_TREE is a copy of an earlier commit's files (git archive <commit> | tar -x -C OLD_TREE), carried
# to the device machine inside the working tree. gpu_suite.sh writes each tree's files under $WORK/old and
# $WORK/new (default /tmp/ab); $OUT (the device tool returns at most 8 files) gets ab.md (test counts, failed
# tests and the speed table of both trees), each tree's test log and benchmark JSON. Knobs:
# TEST_TIMEOUT_S (330), BENCH_BUDGET_S (80 per tree), PRESET (quick).
set -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OLD=$(cd "$1" && pwd) || { echo "ab_suite: usage: ab_suite.sh OLD_TREE [NEW_TREE]" >&2; exit 2; }
NEW=$(cd "${2:-.}" && pwd)
OUT=${OUT:-$PWD/.device_out}
WORK=${WORK:-/tmp/ab}
rm -rf "$WORK"
mkdir -p "$OUT" "$WORK/old" "$WORK/new"
export TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-330}

echo "== ab_suite: old $OLD, new $NEW; GPU tests of both trees at once"
(cd "$OLD" && BENCH=0 MODELS=0 OUT="$WORK/old" bash benchmarks/gpu_suite.sh >"$WORK/old/suite.log" 2>&1) &
old_pid=$!
sleep 20   # the first suite installs the shared wheels into /tmp/site
(cd "$NEW" && BENCH=0 MODELS=0 OUT="$WORK/new" bash benchmarks/gpu_suite.sh >"$WORK/new/suite.log" 2>&1)
wait "$old_pid"
for tree in old new; do
    echo "== $tree: $(grep -m1 '^== sources' "$WORK/$tree/gpu-tests.log")"
    grep -A40 '^gpu tests:' "$WORK/$tree/suite.log" | grep -B40 -m1 '^benchmark exit code' | head -40
done

for tree in old new; do
    dir=$OLD; [ "$tree" = new ] && dir=$NEW
    echo "== benchmark, $tree tree (${SECONDS} s in)"
    (cd "$dir" && TESTS=0 MODELS=0 BENCH_BUDGET_S=${BENCH_BUDGET_S:-80} OUT="$WORK/$tree" \
        bash benchmarks/gpu_suite.sh >"$WORK/$tree/bench-suite.log" 2>&1)
done

python3 - "$WORK" "$OUT" <<'PY'
import glob, json, shutil, sys
import xml.etree.ElementTree as ET
work, out = sys.argv[1], sys.argv[2]
lines = ["# A/B: GPU tests and quick benchmark of two source trees, one device command", ""]
for tree in ("old", "new"):
    head = open(f"{work}/{tree}/gpu-tests.log").read().split("== nvidia-smi")[0].strip()
    lines += [f"## {tree}", "", "```", head, "```", ""]
    try:
        root = ET.parse(f"{work}/{tree}/gpu-tests.xml").getroot()
        suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
        n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
        passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
        lines.append(f"gpu tests: {passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped")
        for s in suites:
            for case in s.iter("testcase"):
                for bad in list(case.findall("failure")) + list(case.findall("error")):
                    lines.append(f"- FAILED {case.get('classname')}::{case.get('name')}: "
                                 f"{(bad.get('message') or '').splitlines()[0][:160] if bad.get('message') else ''}")
    except (OSError, ET.ParseError) as exc:
        lines.append(f"gpu tests: no report ({exc})")
    lines.append("")
    shutil.copy(f"{work}/{tree}/gpu-tests.log", f"{out}/{tree}-gpu-tests.log")
    for f in glob.glob(f"{work}/{tree}/bench-*.json"):
        shutil.copy(f, f"{out}/{tree}-" + f.rsplit("/", 1)[1])

def rows(tree):
    files = sorted(glob.glob(f"{work}/{tree}/bench-*.json"))
    if not files:
        return {}
    found = {}
    for r in json.load(open(files[-1]))["rows"]:
        if r.get("tflops"):
            case = (f"{r['mod']}{' causal' if r['causal'] else ''} {r['direction']} B{r['batch']} H{r['heads']}/"
                    f"{r['kv_heads']} S{r['seqlen']} D{r['head_dim']}/{r['value_head_dim']} {r['dtype']}")
            found[(case, r["impl"], r.get("template_requested") or "")] = r["tflops"]
    return found

old, new = rows("old"), rows("new")
lines += ["## quick benchmark, TFLOP/s (old tree first, then new, same machine)", "",
          "| case | impl | old | new | new / old |", "|---|---|---|---|---|"]
for key in sorted(set(old) & set(new), key=str):
    lines.append(f"| {key[0]} | {key[1]} {key[2]} | {old[key]:.0f} | {new[key]:.0f} | {new[key] / old[key]:.3f} |")
open(f"{out}/ab.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
