"""The import graph is the architecture: worker/ (the engine) < tasks/ < scheduler/ < ops/, a
layer importing only from itself and those below it, no import cycle between modules, and no
Celery, Redis or CLI library in the engine but for worker/app.py (the Celery app). Read from
the source (every import, inside functions and TYPE_CHECKING blocks too), not from a run."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("worker", "tasks", "scheduler", "ops")
QUEUE_OR_CLI = ("celery", "kombu", "redis", "click", "rich", "flower")


def modules() -> dict[str, Path]:
    found = {}
    for package in LAYERS:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path) -> set[str]:
    """Every module name an import in the file names (`from a import b`: a.b and a)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports (a name resolved to its longest module)."""
    mods = modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    return {
        m: {o for n in imports(p) if (o := owner(n)) is not None and o != m}
        for m, p in mods.items()
    }


def layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def test_no_layer_imports_from_a_layer_above_it() -> None:
    upward = sorted(
        f"{m} imports {t}" for m, targets in graph().items() for t in targets if layer(t) > layer(m)
    )
    assert upward == []


def test_no_import_cycle_between_modules() -> None:
    edges = graph()
    cycles: list[list[str]] = []
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_engine_imports_no_queue_or_cli_library() -> None:
    found = sorted(
        f"{m} imports {n}"
        for m, path in modules().items()
        if layer(m) == 0 and m != "worker.app"
        for n in imports(path)
        if n.split(".")[0] in QUEUE_OR_CLI
    )
    assert found == []


def test_the_analysis_sees_an_upward_import_when_there_is_one(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from tasks.producer import enqueue\n")
    assert "tasks.producer" in imports(probe)


def test_the_test_doubles_are_neither_installed_nor_imported_by_the_product() -> None:
    import tomllib

    from setuptools import find_packages

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    installed = find_packages(where=str(ROOT), include=include)
    assert "worker" in installed and "ops.cli" in installed
    assert not [p for p in installed if p.startswith(("testkit", "tests", "bench"))]
    users = sorted(
        m for m, path in modules().items() if any(n.startswith("testkit") for n in imports(path))
    )
    assert users == []
