"""The package's seams: no import cycles, no module over 500 lines, no imports of another
module's private names. A static walk of vramplan/'s imports (ast, nothing is imported)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "vramplan"
MAX_LINES = 500


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(module: str, is_pkg: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _imports(modules: dict[str, Path]):
    """(importer, imported module, names) for every import of a vramplan module, at any depth
    of the file (lazy imports inside functions count: they are still a dependency)."""
    out = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("vramplan"):
                        out.append((name, alias.name, ()))
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(name, is_pkg, node.level, node.module)
                if not target.startswith("vramplan"):
                    continue
                names = tuple(a.name for a in node.names)
                # `from pkg import submodule` imports the submodule
                subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
                out.append((name, target, tuple(n for n in names if f"{target}.{n}" not in modules)))
                out.extend((name, s, ()) for s in subs)
    return out


def _graph(modules):
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for src, dst, _names in _imports(modules):
        if dst in modules and dst != src and not src.startswith(dst + "."):
            # importing a package runs its __init__; a submodule importing its own package's
            # __init__ is Python's normal order, not a cycle of ours
            graph[src].add(dst)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    cycles = _cycles(_graph(_modules()))
    assert cycles == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_module_over_500_lines():
    big = {
        name: n
        for name, path in _modules().items()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert big == {}, f"modules over {MAX_LINES} lines: {big}"


def test_no_private_cross_module_imports():
    modules = _modules()
    bad = sorted(
        f"{src} imports {dst}.{n}"
        for src, dst, names in _imports(modules)
        for n in names
        if n.startswith("_") and not n.startswith("__") and dst != src
    )
    assert bad == [], "private names imported across modules:\n" + "\n".join(bad)


def test_the_walk_sees_what_it_checks():
    """The checks above cannot pass vacuously: the walk finds the package's real imports."""
    modules = _modules()
    assert len(modules) > 30
    graph = _graph(modules)
    assert "vramplan.specs" in graph["vramplan.estimator.step"]
    # a cycle planted in a copy of the graph is found
    planted = {k: set(v) for k, v in graph.items()}
    planted["vramplan.specs"].add("vramplan.estimator")
    assert _cycles(planted)


@pytest.mark.parametrize("src,expect", [("from ._x import _y", True), ("from .x import y", False)])
def test_private_detector(tmp_path, src, expect):
    tree = ast.parse(src)
    node = tree.body[0]
    assert any(a.name.startswith("_") for a in node.names) is expect


# ----------------------------------------------------------------------------------------------
# the layout: packages by stage of the flow (docs/architecture.md)

MAX_LOOSE = 12

#: What the modules loose in vramplan/ may import (the subpackages say it in their docstrings).
LOOSE_MAY_IMPORT = {
    "vramplan": {"estimator", "model", "search", "specs", "run"},  # the public API; run: trace, lazily
    "vramplan.specs": {"util", "bands", "model", "setup"},  # the types hub: re-exports ModelSpec and Setup
    "vramplan.bands": set(),
    "vramplan.cli": {"commands"},
    "vramplan.__main__": {"cli"},
    "vramplan.pytest_plugin": {"util", "specs", "model", "setup", "estimator", "budget"},
}


def _unit(module: str) -> str:
    """The package (or loose module) a module belongs to: vramplan.cost.model -> cost."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "vramplan"


def _subpackages() -> list[Path]:
    return sorted(p for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists())


def _declared(pkg: Path, units: set[str]) -> set[str]:
    """The units a subpackage's docstring lets it import: its ``May import:`` paragraph, parenthesised
    asides left out; ``every stage`` allows all."""
    doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text(encoding="utf-8"))) or ""
    at = doc.find("May import:")
    assert at >= 0, f"{pkg.name}/__init__.py: its docstring has no 'May import:' line"
    text = doc[at + len("May import:"):].split("\n\n")[0]
    text = re.sub(r"\([^)]*\)", " ", text)
    if "every stage" in text:
        return set(units)
    return {w for w in re.findall(r"[a-z_]+", text) if w in units}


def test_at_most_twelve_modules_loose():
    loose = sorted(p.name for p in PKG.glob("*.py"))
    assert len(loose) <= MAX_LOOSE, f"{len(loose)} modules loose in vramplan/: {loose}"
    assert {"vramplan." + p[:-3] if p != "__init__.py" else "vramplan" for p in loose} == set(LOOSE_MAY_IMPORT)


def test_every_subpackage_says_its_role_and_what_it_may_import():
    for pkg in _subpackages():
        if pkg.name == "profile_data":
            continue
        doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text(encoding="utf-8")))
        assert doc and len(doc.split()) >= 20, f"{pkg.name}/__init__.py opens with no role docstring"
        assert "May import:" in doc, f"{pkg.name}/__init__.py: no 'May import:' line"


def _layer_violations(graph) -> list[str]:
    units = {p.name for p in _subpackages()} | {_unit(m) for m in LOOSE_MAY_IMPORT}
    allowed = {_unit(m): set(v) for m, v in LOOSE_MAY_IMPORT.items()}
    allowed.update({p.name: _declared(p, units) for p in _subpackages() if p.name != "profile_data"})
    bad = []
    for src, dsts in graph.items():
        for dst in dsts:
            a, b = _unit(src), _unit(dst)
            if a != b and b not in allowed.get(a, set()):
                may = ", ".join(sorted(allowed.get(a, ()))) or "nothing"
                bad.append(f"{src} imports {dst} ({a} may import: {may})")
    return sorted(bad)


def test_each_package_imports_only_what_its_docstring_allows():
    bad = _layer_violations(_graph(_modules()))
    assert bad == [], "imports across the layout's seams:\n" + "\n".join(bad)


def test_the_layer_check_sees_a_planted_violation():
    graph = _graph(_modules())
    planted = {k: set(v) for k, v in graph.items()}
    planted["vramplan.util.units"].add("vramplan.estimator.step")  # the bottom layer reaching up
    assert any(v.startswith("vramplan.util.units imports vramplan.estimator.step") for v in _layer_violations(planted))
