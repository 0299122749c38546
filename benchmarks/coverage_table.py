"""The coverage harness's table (benchmarks/coverage.py): summary, one row per family, exclusions
with their reasons, the timing table, and the merge of shard files into one.

The summary answers issue 21 directly: families enumerated, checked and not checked (grouped by
reason), attention sites and how many fused, the fused share over the sites whose math is
expressible as one fused attention (every site left alone for another reason is listed with it,
see :data:`SITE_EXCLUSIONS`), compile crashes (ours and those where stock Inductor raises too),
outputs and gradients out of tolerance, and the forward speedup against stock Inductor of the
timed families.

Example::

    >>> meta, rows, timing = merge([Path("a.json"), Path("b.json")])   # doctest: +SKIP
    >>> print(markdown(meta, rows, timing))                             # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any, Optional

STOCK_FAILS = "stock Inductor raises too"   # prefix of a crash where stock Inductor raises as well
OUR_BUG = "bug in fa3_inductor"             # in the reason of a site our guard left to stock Inductor
NOT_REACHED = "not reached"                 # prefix of the reason of a family no process finished

# Gradients (coverage.judge_grads): parameter p's error is measured on max(‖ref_p‖, GRAD_FLOOR·
# ‖ref_all‖). A gradient that is a negligible share of the model's is then judged in absolute
# terms at that scale: its relative error is rounding noise over a true value near 0 (a key
# projection's bias has gradient 0 exactly, softmax being shift-invariant; every implementation
# leaves noise there). 3e-3: in the bf16 GPU run (2026-11-27) the largest such noise was 1.4e-5·
# ‖ref_all‖ (CLIP's k_proj.bias, eager 2.8e-6), which tol·3e-3 = 6e-5 covers 4x over; at 1e-4
# CLIP's and PVT's key biases failed on noise alone, at 1e-3 CLIP's passed with 0.014 against
# 0.02, too close for a floor meant to absorb noise. Any larger floor only loosens the
# judgement of real, small gradients (q/k weights of these random-init models have shares of
# 1e-4 to 1e-2 of ‖ref_all‖).
GRAD_FLOOR = 3e-3
# ...and where the uncompiled model in that dtype resolves p's gradient (its own relative error
# at most RESOLVED), ours is at most max(DIRECTION, 4x eager's) relative: a floored gradient that
# is wrong outright still fails (stock Inductor's query_proj gradient of sew-d, share 3e-5: 100%
# off against eager's 2%).
RESOLVED = 0.1
DIRECTION = 0.5
# A family out of tolerance is compiled again with stock Inductor: if stock Inductor is out of
# tolerance by the same rule and ours is within this factor of its error, the failure is stock
# Inductor's on this model (row "stock_too"), listed apart and not counted against us.
STOCK_FACTOR = 2.0

# Sites left alone whose math is not one fused attention as flex_attention computes it, or that
# our kernels do not serve (class, pattern on the reason, what the class means). Every other
# reason is a miss of ours and counts against the fused share.
SITE_EXCLUSIONS: tuple[tuple[str, str, str], ...] = (
    ("weights returned", r"also used elsewhere",
     "the attention probabilities are an output too (or feed another op): a fused kernel never "
     "materializes them, so the softmax would run anyway"),
    ("training dropout", r"dropout p=.* in training mode|^dropout_p=",
     "dropout on the probabilities in training mode: flex_attention has no dropout"),
    ("rows with no key", r"leaves query rows with no key|mixes -inf and finite fills",
     "the mask leaves query rows with no key: eager gives NaN or uniform weights there, a fused "
     "kernel gives 0"),
    ("not attention-shaped", r"softmax over dim|not attention-shaped|is not a q·k product|"
     r"is not a p·v product|scores of rank|query heads are not a multiple|expected exactly one",
     "not softmax(q·kᵀ)·v over the last dim (another softmax dim, rank, head grouping or "
     "several score products)"),
    ("kernel limit", r"head dim \d+ \(fa3 serves|dtype .* \(fa3 serves|device .* is not served|"
     r"Triton's interpreter is off",
     "a head dim, dtype or device our kernels do not serve (flex_attention's own limits are "
     "close: head dims of 16 to 256)"),
    ("size rule", r"^small attention|plain SDPA call",
     "left to stock Inductor / SDPA on purpose at this size (rewrite_pays.py); only when the "
     "size rule is on"),
)


def classify_site(reason: str) -> Optional[str]:
    """The exclusion class of a left-alone site's reason, or None (a miss that counts).

    Example::

        >>> classify_site("matmul-softmax: softmax over dim 1 (attention normalizes over the last dim)")
        'not attention-shaped'
        >>> classify_site("matmul-softmax: view_N (view) between softmax and the matmul") is None
        True
    """
    reason = reason.split(": ", 1)[-1]   # drop the front door
    for name, pattern, _ in SITE_EXCLUSIONS:
        if re.search(pattern, reason):
            return name
    return None


# Families not checked, by the start of their reason (class, pattern).
FAMILY_EXCLUSIONS: tuple[tuple[str, str], ...] = (
    ("no attention", r"^no attention:"),
    ("config needs a download or a package", r"^default config does not build"),
    ("no model class here", r"does not import here|^no model class"),
    ("does not build tiny", r"does not build|no tiny shape builds|processors to set|does not apply"),
    ("inputs the harness does not make", r"^main input"),
    ("uncompiled model fails", r"^uncompiled model fails"),
    ("package not installed", r"is not installed|does not import|torchvision"),
    ("timed out", r"^timed out"),
    (NOT_REACHED, rf"^{NOT_REACHED}"),
    ("harness error", r"^harness error"),
)


def classify_family(reason: str) -> str:
    """The class of a not-checked family's reason ("other" when none matches)."""
    for name, pattern in FAMILY_EXCLUSIONS:
        if re.search(pattern, reason):
            return name
    return "other"


def row_passes(row: dict) -> bool:
    """A checked family passes: no crash of ours, no graph our guard handed to stock Inductor,
    outputs and gradients within tolerance, or out of tolerance only as far as stock Inductor
    compiling the same model is too (``stock_too``: benchmarks/coverage.py, then not ours)."""
    crash = row.get("crash")
    if crash and not crash.startswith(STOCK_FAILS):
        return False
    if crash:
        return True   # not ours: stock Inductor raises on the model too
    guarded = any(OUR_BUG in k for k in row.get("left_alone", {}))
    within = bool(row.get("out_ok")) and bool(row.get("grad_ok"))
    return (within or bool(row.get("stock_too"))) and not guarded


def out_of_tolerance(row: dict) -> bool:
    """A compiled family whose outputs or gradients are out of tolerance (ours or not)."""
    return not row.get("crash") and "excluded" not in row and \
        not (row.get("out_ok") and row.get("grad_ok"))


def settled(row: dict) -> bool:
    """Whether a row needs no re-run on resume: a finished check that passed, or an exclusion
    that will not change by running again (timeouts, harness errors and unfinished rows rerun)."""
    if row.get("unfinished"):
        return False
    reason = row.get("excluded")
    if reason is not None:
        return classify_family(reason) not in ("timed out", "harness error", NOT_REACHED)
    return row_passes(row)


def summarize(rows: list[dict], enumerated: Optional[int] = None) -> dict[str, Any]:
    """Totals over the rows: families, sites, the fused share, crashes, tolerance failures.

    ``enumerated``: how many families the run enumerated (rows missing from it are counted as
    not reached); default, the rows.
    """
    checked = [r for r in rows if "excluded" not in r]
    ran = [r for r in checked if not r.get("crash")]
    sites = sum(r.get("sites", 0) for r in ran)
    fused = sum(r.get("fused", 0) for r in ran)
    served = sum(r.get("served", 0) for r in ran)
    excluded_sites: Counter = Counter()
    missed: Counter = Counter()
    for r in ran:
        for reason, count in r.get("left_alone", {}).items():
            cls = classify_site(reason)
            if cls is None:
                missed[reason] += count
            else:
                excluded_sites[cls] += count
    expressible = sites - sum(excluded_sites.values())
    not_checked = Counter(classify_family(r["excluded"]) for r in rows if "excluded" in r)
    n_enum = max(enumerated or 0, len(rows))
    if n_enum > len(rows):
        not_checked[NOT_REACHED] += n_enum - len(rows)
    return dict(
        families=n_enum, rows=len(rows), checked=len(checked),
        not_checked=sum(not_checked.values()), not_checked_by_reason=dict(not_checked.most_common()),
        excluded=len(rows) - len(checked),
        no_attention=not_checked.get("no attention", 0),
        with_sites=sum(1 for r in ran if r.get("sites")),
        sites=sites, fused=fused, served=served,
        fused_pct=_pct(fused, sites),
        excluded_sites=dict(excluded_sites.most_common()), expressible=expressible,
        fused_pct_expressible=_pct(fused, expressible), missed=dict(missed.most_common()),
        crashes_ours=sum(1 for r in checked if r.get("crash") and
                         not r["crash"].startswith(STOCK_FAILS)),
        crashes_stock=sum(1 for r in checked if r.get("crash", "").startswith(STOCK_FAILS)),
        outputs_ok=sum(1 for r in ran if r.get("out_ok")),
        grads_ok=sum(1 for r in ran if r.get("grad_ok")), ran=len(ran),
        passed=sum(1 for r in checked if row_passes(r)),
        tolerance_failures=sorted(r["family"] for r in ran
                                  if out_of_tolerance(r) and not r.get("stock_too")),
        tolerance_stock=sorted(r["family"] for r in ran
                               if out_of_tolerance(r) and r.get("stock_too")),
        fully_fused=sum(1 for r in ran if r.get("sites") and r.get("fused") == r.get("sites")),
        softmax_no_site=sorted(r["family"] for r in ran if r.get("softmaxes") and not r.get("sites")),
        guarded=sum(1 for r in ran if any(OUR_BUG in k for k in r.get("left_alone", {}))),
    )


def _pct(part: int, whole: int) -> Optional[float]:
    return round(100.0 * part / whole, 1) if whole else None


def timing_summary(timing: list[dict]) -> dict[str, Any]:
    """Geometric mean of the forward speedups against stock Inductor, and the timed count."""
    ok = [t for t in timing if t.get("speedup")]
    gm = math.exp(sum(math.log(t["speedup"]) for t in ok) / len(ok)) if ok else None
    forced = [t for t in ok if t.get("speedup_every_size")]
    gm_forced = (math.exp(sum(math.log(t["speedup_every_size"]) for t in forced) / len(forced))
                 if forced else None)
    return dict(timed=len(ok), geomean=gm, geomean_every_size=gm_forced)


# ------------------------------------------------------------------------------------------
# Markdown
# ------------------------------------------------------------------------------------------

def _fmt_err(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1e}"


def _ok(v: Optional[bool]) -> str:
    return "-" if v is None else ("ok" if v else "**FAIL**")


def _cell(text: str, width: int = 160) -> str:
    return text.replace("|", "/").replace("\n", " ")[:width]


def markdown(meta: dict, rows: list[dict], timing: list[dict]) -> str:
    """The committed table: header, summary, timing, one row per family, exclusions, reasons."""
    s = summarize(rows, meta.get("enumerated_count"))
    lines = [f"# fa3 coverage: {meta['device']}, {meta['dtype']}, {meta['date']}", "",
             f"Command: `{meta['command']}`  ",
             *([f"Each process: `{meta['process_command']}`  "]
               if meta.get("process_command") else []),
             f"torch {meta['torch']}, triton {meta['triton']}, transformers "
             f"{meta.get('transformers')}, timm {meta.get('timm')}, diffusers "
             f"{meta.get('diffusers')}, Python {meta['python']}, commit {meta.get('commit')}", ""]
    if meta.get("note"):
        lines += [meta["note"], ""]
    lines += _summary_lines(s) + [""]
    if timing:
        lines += _timing_lines(timing) + [""]
    lines += ["## Families checked", "",
              "Tolerance, against the float64 uncompiled model: each output's relative error "
              "≤ 1e-4 (float32) / 2e-2 (bf16), or ≤ 4× the uncompiled model's own error in that "
              "dtype. Each parameter's gradient: error ‖g − ref‖ over max(‖ref_p‖, "
              f"{GRAD_FLOOR:g}·‖ref_all‖) within the same bound (eager's error measured on the same "
              "scale): a gradient that is a negligible share of the model's (a key bias's is 0 "
              "exactly) is judged in absolute terms at the model's gradient scale, not relative "
              "to its own ~0 norm; and where eager's own relative error is at most "
              f"{RESOLVED:g}, ours is at most max({DIRECTION:g}, 4× eager's) relative (a small "
              "gradient may not be wrong outright). `grad err`: all parameter gradients as one "
              "vector. A family "
              "out of tolerance is compiled with stock Inductor too: where stock Inductor is out "
              "of tolerance by the same rule and ours is within "
              f"{STOCK_FACTOR:g}× its error, the row passes as "
              "not ours (`stock Inductor's own error`). Failing parameters, with their numbers, "
              "are listed under the table. "
              "`softmaxes`: softmax/SDPA calls of one eager forward (routers included), "
              "for attention recognition never saw. `fused`: sites that became one flex_attention "
              "op (`ours`: on our templates; the rest on torch's flex kernel). `pass`: no crash of "
              "ours, no graph handed to stock Inductor, outputs and gradients within tolerance.", "",
              "| family | source | kind | softmaxes | sites | fused | ours | templates | backward "
              "| crash | out err | out | grad err | grad | pass | left alone (reason × count) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "excluded" in r:
            continue
        left = "; ".join(f"{k} ×{v}" + (f" [{classify_site(k)}]" if classify_site(k) else "")
                         for k, v in r.get("left_alone", {}).items())
        lines.append("| " + " | ".join([
            r["family"], r["source"], r.get("kind", "?"), str(r.get("softmaxes", "-")),
            str(r.get("sites", "-")), str(r.get("fused", "-")), str(r.get("served", "-")),
            ", ".join(f"{k}×{v}" for k, v in r.get("templates", {}).items()) or "-",
            ", ".join(f"{k}×{v}" for k, v in r.get("backward", {}).items()) or "-",
            _cell(r.get("crash") or "no"), _fmt_err(r.get("out_err")),
            _ok(r.get("out_ok")), _fmt_err(r.get("grad_err")), _ok(r.get("grad_ok")),
            _pass_cell(r), _cell(left, 400) or "-"]) + " |")
    lines += _tolerance_lines(rows)
    lines += _excluded_lines(rows, meta)
    return "\n".join(lines) + "\n"


def _pass_cell(r: dict) -> str:
    if not row_passes(r):
        return "**FAIL**"
    if out_of_tolerance(r) and r.get("stock_too"):
        return ("ok: no site of ours, stock Inductor's own error" if not r.get("fused")
                else "ok: stock Inductor's own error")
    return "ok"


def _param_cell(items: list[dict], limit: int = 4) -> str:
    out = [f"`{i['param']}` err {_fmt_err(i['err'])} > allowed {_fmt_err(i['allowed'])} "
           f"(share {_fmt_err(i.get('share'))}, eager {_fmt_err(i.get('base'))})"
           for i in items[:limit]]
    if len(items) > limit:
        out.append(f"and {len(items) - limit} more")
    return "; ".join(out) or "-"


def _tolerance_lines(rows: list[dict]) -> list[str]:
    """Each family out of tolerance: our errors, the failing parameters (error and allowed on
    the parameter's scale, its share ‖ref_p‖/‖ref_all‖, eager's error on that scale), and stock
    Inductor's errors on the same model."""
    bad = [r for r in rows if out_of_tolerance(r)]
    if not bad:
        return []
    lines = ["", "### Out of tolerance", "",
             "| family | verdict | out err (eager) | grad err (eager) | failing parameters: err > "
             "allowed (share, eager) | stock Inductor: out err, grad err, failing |",
             "|---|---|---|---|---|---|"]
    for r in bad:
        stock = r.get("stock") or {}
        if "error" in stock:
            theirs = f"not run: {_cell(stock['error'], 100)}"
        elif stock:
            theirs = (f"{_fmt_err(stock.get('out_err'))} {_ok(stock.get('out_ok'))}, "
                      f"{_fmt_err(stock.get('grad_err'))} {_ok(stock.get('grad_ok'))}, "
                      + _param_cell(stock.get("grad_failing", []), 2))
        else:
            theirs = "-"
        lines.append("| " + " | ".join([
            r["family"], "not ours" if r.get("stock_too") else "**ours**",
            f"{_fmt_err(r.get('out_err'))} ({_fmt_err(r.get('baseline_out_err'))})",
            f"{_fmt_err(r.get('grad_err'))} ({_fmt_err(r.get('baseline_grad_err'))})",
            _cell(("-" if r.get("grad_ok") else _param_cell(r["grad_failing"])
                   if "grad_failing" in r else f"`{r.get('grad_worst')}` (worst; per-parameter "
                   "numbers not recorded by this run)"), 600),
            _cell(theirs, 400)]) + " |")
    return lines


def _summary_lines(s: dict) -> list[str]:
    by = ", ".join(f"{v} {k}" for k, v in s["not_checked_by_reason"].items())
    excl = "; ".join(f"{k} {v}" for k, v in s["excluded_sites"].items()) or "none"
    out = ["## Summary", "",
           f"- Families: {s['families']} enumerated, {s['checked']} built and compiled, "
           f"{s['not_checked']} not checked" + (f" ({by}; each with its reason below)." if by
                                                 else "."),
           f"- Attention sites in the compiled families: {s['sites']}; fused {s['fused']} "
           f"({s['fused_pct']}%), {s['served']} of them on our templates; families with sites "
           f"{s['with_sites']}, every site fused in {s['fully_fused']}.",
           f"- **Fused where the math is expressible: {s['fused']} of {s['expressible']} sites "
           f"({s['fused_pct_expressible']}%).** Sites excluded, by class: {excl} "
           "(classes below).",
           f"- Compile crashes: **{s['crashes_ours']} ours**, {s['crashes_stock']} where stock "
           f"Inductor raises on the same model too; families with a graph our guard handed to "
           f"stock Inductor: {s['guarded']}.",
           f"- Outputs within tolerance: {s['outputs_ok']}/{s['ran']}; gradients: "
           f"{s['grads_ok']}/{s['ran']}; families passing every check: {s['passed']}/{s['checked']}"
           + (f"; **out of tolerance: {', '.join(s['tolerance_failures'])}**"
              if s["tolerance_failures"] else "; none out of tolerance by our doing")
           + (f"; out of tolerance where stock Inductor compiling the same model is out by as "
              f"much (not ours, passed): {', '.join(s['tolerance_stock'])}"
              if s.get("tolerance_stock") else "") + "."]
    if s["missed"]:
        out += ["- Sites left alone that count against the share (reason × sites): "
                + "; ".join(f"`{_cell(k, 200)}` ×{v}" for k, v in s["missed"].items())]
    if s["softmax_no_site"]:
        out += [f"- Compiled families with softmax calls but no attention site (routers, "
                f"pooling, or attention recognition never saw): "
                f"{', '.join(s['softmax_no_site'])}."]
    out += ["", "Site exclusions (not counted in the expressible share):", ""]
    from_rows = set(s["excluded_sites"])
    out += [f"- **{name}**{'' if name in from_rows else ' (none in this run)'}: {what}"
            for name, _, what in SITE_EXCLUSIONS]
    return out


def _timing_lines(timing: list[dict]) -> list[str]:
    ts = timing_summary(timing)
    every = any("fa3_every_size_ms" in t for t in timing)
    head = ("| family | batch | seq | sites | fused | below the size rule | templates | fa3 ms | "
            "inductor ms | inductor ÷ fa3 |"
            + (" fa3 every size ms | inductor ÷ that |" if every else "") + " compile s |")
    ruled = [t["family"] for t in timing if t.get("sites") and not t.get("fused")
             and _size_ruled(t) == t["sites"]]
    measured = [t for t in timing if "sites" in t]
    lines = ["## Forward time at a realistic size (inference, 2 layers), fa3 vs stock Inductor", "",
             f"Geometric mean of inductor ÷ fa3 over {ts['timed']} families: "
             + (f"{ts['geomean']:.2f}" if ts["geomean"] else "-")
             + (f"; with every site rewritten whatever its size: {ts['geomean_every_size']:.2f}"
                if ts["geomean_every_size"] else "") + ". Median of `triton.testing.do_bench`. "
             "`fa3` is the backend as shipped: sites below the size rule (rewrite_pays.py: "
             "fewer than 4e9 multiply-adds of q·k in inference) stay as written, so where every "
             "site is below it fa3 compiles what stock Inductor compiles and the ratio is ~1.0 by "
             "construction"
             + (f" ({len(ruled)} of {len(measured)} families here: {', '.join(ruled)})" if ruled
                else "")
             + ("; `every size` rewrites every site recognition serves, whatever its size: "
                "our kernels against stock Inductor at these sizes." if every else
                "; run with `--timing-every-size` to time our kernels on those sites too."),
             "", head, "|" + "---|" * (head.count("|") - 1)]
    for t in timing:
        if "error" in t and "fa3_ms" not in t:
            lines.append(f"| {t['family']} | {t.get('batch')} | {t.get('seq')} | "
                         f"{_cell(t['error'], 200)} |" + " |" * (head.count("|") - 5))
            continue
        cells = [t["family"], str(t["batch"]), str(t["seq"]), str(t.get("sites", "-")),
                 str(t.get("fused", "-")), str(_size_ruled(t)) if "sites" in t else "-",
                 ", ".join(f"{k}×{v}" for k, v in
                                                     t.get("templates", {}).items()) or "-",
                 _ms(t.get("fa3_ms")), _ms(t.get("inductor_ms")), _x(t.get("speedup"))]
        if every:
            cells += [_ms(t.get("fa3_every_size_ms")), _x(t.get("speedup_every_size"))]
        cells.append(str(t.get("compile_s", "-")))
        if t.get("error"):
            cells[-1] += f" ({_cell(t['error'], 120)})"
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _size_ruled(t: dict) -> int:
    """Sites of a timing row left as written by the size rule (rewrite_pays.py)."""
    return sum(n for reason, n in t.get("left_alone", {}).items()
               if re.match(r"small attention|plain SDPA call", reason))


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3f}"


def _x(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def _excluded_lines(rows: list[dict], meta: dict) -> list[str]:
    excluded = [r for r in rows if "excluded" in r]
    missing = [f"{src}/{name}" for src, name in meta.get("not_reached", [])]
    if not excluded and not missing:
        return []
    lines = ["", "## Families not checked, with the reason"]
    by_class: dict[str, list[dict]] = {}
    for r in excluded:
        by_class.setdefault(classify_family(r["excluded"]), []).append(r)
    for cls, members in sorted(by_class.items(), key=lambda kv: -len(kv[1])):
        lines += ["", f"### {cls} ({len(members)})", ""]
        lines += [f"- `{r['family']}` ({r['source']}): {_cell(r['excluded'], 300)}"
                  for r in members]
    if missing:
        lines += ["", f"### {NOT_REACHED}: no process got to them before the deadline "
                      f"({len(missing)})", "", ", ".join(f"`{m}`" for m in missing)]
    return lines


# ------------------------------------------------------------------------------------------
# Files and merging
# ------------------------------------------------------------------------------------------

def write(path: Path, meta: dict, rows: list[dict], timing: list[dict]) -> None:
    """``path``.json (meta, summary, rows, timing) and ``path``.md (the table)."""
    data = dict(meta, summary=summarize(rows, meta.get("enumerated_count")), rows=rows,
                timing=timing)
    path.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str))
    path.with_suffix(".md").write_text(markdown(meta, rows, timing))


def _better(new: dict, old: Optional[dict]) -> bool:
    """Whether a later file's row replaces an earlier one: unless it is unfinished and the
    earlier one is not."""
    return old is None or not new.get("unfinished") or old.get("unfinished", False)


# What a run's environment was: a resumed file's values are not the new rows'
_RUN_FIELDS = ("commit", "torch", "triton", "transformers", "timm", "diffusers", "python")


def merge(files: list[Path], claimed: Optional[list[tuple[str, str]]] = None
          ) -> tuple[dict, list[dict], list[dict]]:
    """Combine shard files (and a resumed run's merged file, given first): a later file's row
    for a family replaces an earlier one (unfinished rows never replace finished ones), the
    enumerations are joined, and every enumerated family without a row is listed as not reached.
    ``claimed``: (source, family) pairs a process started (benchmarks/coverage.py --claim-dir)
    that have no row: their process died or hung on them.

    Returns the meta of the first file (with the union's counts; the commit and package versions
    name every distinct value, the newest first, since a resumed file's are not this run's), the
    rows sorted by source and family, and the timing rows in TIMED_FAMILIES order of appearance.
    """
    rows: dict[tuple[str, str], dict] = {}
    timing: dict[str, dict] = {}
    enumerated: list[tuple[str, str]] = []
    meta: dict = {}
    seen: dict[str, list] = {k: [] for k in _RUN_FIELDS}
    for f in files:
        data = json.loads(Path(f).read_text())
        if not meta:
            meta = {k: v for k, v in data.items() if k not in ("rows", "timing", "summary")}
        for k in _RUN_FIELDS:
            if k in data and data[k] not in seen[k]:
                seen[k].append(data[k])
        for src, name in data.get("enumerated", []):
            if (src, name) not in enumerated:
                enumerated.append((src, name))
        for r in data.get("rows", []):
            key = (r["source"], r["family"])
            if _better(r, rows.get(key)):
                rows[key] = r
        for t in data.get("timing", []):
            old = timing.get(t["family"])
            if old is None or "speedup" in t or "speedup" not in old:
                timing[t["family"]] = t
    for key in claimed or ():
        if key not in rows:
            rows[key] = dict(family=key[1], source=key[0], unfinished=True,
                             excluded=f"{NOT_REACHED}: its process died or hung while checking it")
    for key, r in rows.items():
        if r.get("unfinished") and not r["excluded"].startswith(NOT_REACHED):
            r["excluded"] = f"{NOT_REACHED}: {r['excluded']}"
        if key not in enumerated:
            enumerated.append(key)
    for k, values in seen.items():
        if len(values) > 1:
            meta[k] = f"{values[-1]} (rows run last); earlier: {', '.join(map(str, values[:-1]))}"
    meta["enumerated"] = [list(k) for k in enumerated]
    meta["enumerated_count"] = len(enumerated)
    meta["not_reached"] = [list(k) for k in enumerated if k not in rows]
    meta["merged_from"] = [Path(f).name for f in files]
    return meta, sorted(rows.values(), key=lambda r: (r["source"], r["family"])), list(timing.values())
