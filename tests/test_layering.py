"""The package's layering, read from the source (ast): nothing is imported or run.

Data flows down: the front doors (api, backend, direct, explain) run recognition (finding
attention in FX graphs, ``recognition/``) and the lowering (``lowering/``), which both build on
the templates and the runtime. Recognition and lowering are peers: what both need lives below
them (``fa3_inductor/report.py``, ``config.py``, ``templates/``), and the backend hands
recognition the lowering's "would our kernels serve this?" as a callable.

Rules (every import counts, also one inside a function, unless said otherwise):

- ``recognition/`` does not import ``lowering/``, nor ``lowering/`` ``recognition/``;
- ``lowering/`` does not import the front doors;
- ``templates/`` and ``runtime/`` import none of recognition, lowering or the front doors;
- the forward and backward lowerings do not import each other (what both need is in
  ``lowering/common.py``; ``lowering/registration.py`` installs both);
- no import cycle among the package's modules (module-level imports only: an import inside a
  function runs after every module is loaded, and a few are there on purpose to break one).

A known exception goes in ``ALLOWED`` below with a one-line reason; today there is none.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Iterator, NamedTuple

PACKAGE = "fa3_inductor"
ROOT = pathlib.Path(__file__).resolve().parent.parent / PACKAGE
FRONT_DOORS = {f"{PACKAGE}.{name}" for name in ("api", "backend", "direct", "direct_bwd", "direct_fp8",
                                                 "explain")}

# (importer, imported) pairs that break a rule today, each with why it is tolerated. Empty: the
# layering holds without exceptions. Add one only with a reason and an issue to remove it.
ALLOWED: dict[tuple[str, str], str] = {}


class Import(NamedTuple):
    importer: str
    imported: str
    line: int
    module_level: bool   # runs when the importer is imported (not inside a function)


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


MODULES = _modules()


def _walk(node: ast.AST, in_function: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    """Every node under ``node``, with whether it sits inside a function body (imports there run
    late) or under ``if TYPE_CHECKING:`` (never run)."""
    for child in ast.iter_child_nodes(node):
        late = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            late = True
        yield child, late
        yield from _walk(child, late)


def _resolve(base: str, name: str) -> str:
    """``from base import name``: the submodule ``base.name`` if there is one, else ``base``."""
    return f"{base}.{name}" if f"{base}.{name}" in MODULES else base


def imports_of(module: str) -> list[Import]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node, late in _walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [_resolve(base, a.name) for a in node.names]
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                out.append(Import(module, target, node.lineno, not late))
    return out


ALL_IMPORTS = [imp for module in MODULES for imp in imports_of(module)]


def _in(module: str, area: str) -> bool:
    return module == f"{PACKAGE}.{area}" or module.startswith(f"{PACKAGE}.{area}.")


def _violations(importer_area, forbidden) -> list[str]:
    bad = []
    for imp in ALL_IMPORTS:
        if importer_area(imp.importer) and forbidden(imp.imported) and \
                (imp.importer, imp.imported) not in ALLOWED:
            bad.append(f"{imp.importer} (line {imp.line}) imports {imp.imported}")
    return bad


def test_the_parser_sees_the_imports():
    """The rules below are not vacuous: known imports are found, nested ones marked as such."""
    assert f"{PACKAGE}.recognition.recognize_sdpa" in MODULES and f"{PACKAGE}.lowering.flex_lowering" in MODULES
    found = {(i.importer, i.imported, i.module_level) for i in ALL_IMPORTS}
    assert (f"{PACKAGE}.backend", f"{PACKAGE}.recognition.recognize_sdpa", True) in found
    assert (f"{PACKAGE}.backend", f"{PACKAGE}.recognition.recognize_manual", False) in found
    assert (f"{PACKAGE}.lowering.flex_lowering", f"{PACKAGE}.lowering.common", True) in found
    assert (f"{PACKAGE}.lowering.registration", f"{PACKAGE}.lowering.flex_backward_lowering", True) in found


def test_recognition_does_not_import_lowering():
    assert _violations(lambda m: _in(m, "recognition"), lambda m: _in(m, "lowering")) == []


def test_lowering_does_not_import_recognition():
    assert _violations(lambda m: _in(m, "lowering"), lambda m: _in(m, "recognition")) == []


def test_lowering_does_not_import_the_front_doors():
    assert _violations(lambda m: _in(m, "lowering"), lambda m: m in FRONT_DOORS) == []


def test_templates_and_runtime_import_nothing_above_them():
    def above(m):
        return _in(m, "recognition") or _in(m, "lowering") or m in FRONT_DOORS

    assert _violations(lambda m: _in(m, "templates") or _in(m, "runtime"), above) == []


def test_forward_and_backward_lowerings_do_not_import_each_other():
    fwd, bwd = f"{PACKAGE}.lowering.flex_lowering", f"{PACKAGE}.lowering.flex_backward_lowering"
    assert _violations(lambda m: m == fwd, lambda m: m == bwd) == []
    assert _violations(lambda m: m == bwd, lambda m: m == fwd) == []


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or with a self-import (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_at_module_level():
    edges: dict[str, set[str]] = {}
    for imp in ALL_IMPORTS:
        # (``from fa3_inductor import x``, x not a submodule, is an edge to the package's __init__)
        if imp.module_level and (imp.importer, imp.imported) not in ALLOWED:
            edges.setdefault(imp.importer, set()).add(imp.imported)
    assert _cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
