"""The repository's shape: nothing of meshloom is installed under a generic name, and no import cycles.

meshloom runs from its repository root; `pip install -e .` installs its dependencies only, so another
program's `import config` or `import data` can never find meshloom's. Imports are read from the source
(every `import` and `from ... import`, including those inside functions), and two graphs are checked:

1. the top-level parts (train.py, generate.py, mesh/, models/, runtime/, training/, data/, checkpoint/,
   launch/, measure/, tests/, docs/, examples/): a part may import a part "below" it, never one that imports it
   back, so each part can be read without the ones above it;
2. the modules themselves, so that no two files need each other (for instance models/llama.py and
   models/moe.py).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch.local_runs import ROOT


def source_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / name for name in listed.stdout.split()]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the repository modules it imports (absolute imports; a package import counts as its __init__)."""
    files = source_files()
    modules = {module_name(f) for f in files}
    graph: dict[str, set[str]] = {}
    for file in files:
        name = module_name(file)
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from mesh import dims` imports the module mesh.dims; `from mesh.dims import X` imports mesh.dims
                targets = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
    return graph


def part_of(module: str) -> str:
    return module.split(".")[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_top_level_parts():
    parts: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        parts.setdefault(part_of(module), set()).update(part_of(t) for t in targets if part_of(t) != part_of(module))
    assert cycles(parts) == [], "top-level parts that import each other"


def test_no_import_cycle_between_modules():
    assert cycles(import_graph()) == [], "modules that import each other"


@pytest.mark.parametrize("name", ["config", "data", "models", "mesh", "train", "runtime", "training", "checkpoint"])
def test_nothing_of_meshloom_is_importable_from_another_folder(tmp_path, name):
    """A program outside the repository, on the interpreter meshloom's dependencies were installed in."""
    probe = (
        f"import importlib.util, sys; spec = importlib.util.find_spec({name!r}); "
        "print(spec.origin if spec and spec.origin else (list(spec.submodule_search_locations) if spec else None))"
    )
    found = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert str(ROOT) not in found, f"`import {name}` outside the repository finds meshloom's: {found}"


def test_readme_map_lists_the_rooms_in_an_order_where_each_imports_only_those_above_it():
    """README's map promises a reading order: every room imports only rooms listed before it."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index("## Map of the code") :].split("```")[1]
    order = [line.split()[0].rstrip("/").removesuffix(".py") for line in block.splitlines() if line[:1].strip()]
    order = [name for name in order if "/" not in name]  # docs/figures/ belongs to docs
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        graph.setdefault(part_of(module), set()).update(part_of(t) for t in targets if part_of(t) != part_of(module))
    assert sorted(order) == sorted(graph), "README's map and the repository's top-level parts differ"
    for position, room in enumerate(order):
        later = graph[room] & set(order[position + 1 :])
        assert not later, f"{room} imports {sorted(later)}, listed after it in README's map"


def test_a_missing_dev_dependency_fails_its_tests_instead_of_skipping_them():
    """The dev extras (pyproject.toml) are always installed for the tests, so none may skip without one: no
    ``pytest.importorskip`` and no ``except ImportError`` in tests/. Only the ``gpu`` marker skips (no CUDA)."""
    found = []
    for file in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Attribute) and node.attr == "importorskip":
                found.append(f"{file.name}:{node.lineno} importorskip")
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                names = [n.id for n in ast.walk(node.type) if isinstance(n, ast.Name)]
                if {"ImportError", "ModuleNotFoundError"} & set(names):
                    found.append(f"{file.name}:{node.lineno} except {'/'.join(names)}")
    assert found == [], "tests that skip or work around a missing dependency"


LIBRARY = {
    "models",
    "mesh",
    "planning",
    "checkpoint",
    "data",
    "runtime",
    "training",
    "savers",
    "observers",
    "train",
    "generate",
}


def test_no_library_room_imports_the_measurement_room():
    """measure/ only observes: a run never needs it, so a library room importing it is a room in the wrong place."""
    found = sorted(
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        if part_of(module) in LIBRARY
        for target in targets
        if part_of(target) in {"measure", "bench"}
    )
    assert found == [], "library modules that import the measurement room"


def test_there_is_one_measurement_room():
    """bench/ was merged into measure/ (one module per measurement, each with its CLI ``python -m measure.NAME``)."""
    assert not (ROOT / "bench").exists() or {p.name for p in (ROOT / "bench").iterdir()} <= {"README.md"}
    names = [p.stem for p in ROOT.glob("*/*.py") if p.stem != "__init__" and p.parts[-2] not in {"tests", "docs"}]
    assert "throughput" not in names, "a module named `throughput`: say which throughput (tokens_per_second, mfu)"


def test_the_cluster_planner_imports_the_run_and_never_the_reverse():
    """cluster/ (runs not yet launched) reads planning/ (what a launched run decides); a run never needs the planner."""
    graph = import_graph()
    assert any(part_of(t) == "planning" for m, ts in graph.items() if part_of(m) == "cluster" for t in ts)
    found = sorted(
        f"{m} -> {t}" for m, ts in graph.items() if part_of(m) in LIBRARY for t in ts if part_of(t) == "cluster"
    )
    assert found == [], "library modules that import the cluster planner"


def test_train_py_only_composes():
    """train.py reads in one sitting: at most 300 lines, no function over 60 (the build lives in training/build.py,
    the layout in planning/layout.py, the command line in runtime/command_line.py)."""
    source = (ROOT / "train.py").read_text()
    assert len(source.splitlines()) <= 300
    long = [
        f"{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 60
    ]
    assert long == []


def test_every_measurement_is_indexed_once():
    """measure/__init__.py groups the measurements by the chapter they back, the tools and the shared counters: a
    new module must say where it belongs."""
    index = ast.get_docstring(ast.parse((ROOT / "measure" / "__init__.py").read_text()))
    listed = re.findall(r"``(\w+)``", index)
    modules = sorted(p.stem for p in (ROOT / "measure").glob("*.py") if p.stem != "__init__")
    assert sorted(set(listed)) == modules
    assert len(listed) == len(set(listed)), "a module listed twice"
