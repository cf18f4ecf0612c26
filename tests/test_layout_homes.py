"""One home for each layout field: declared in at most three types, copied field by field in at most two places.

A layout field (a degree, the schedule, AC, SP, CP's attention, FSDP's options, a saver, compile) is *declared*
by a class that annotates an attribute of its name: the config as written (runtime/config.py), the ``Layout``
(planning/layout.py) and mesh/'s typed options (mesh/parallelize.py). It is *copied field by field* where a
function hands it from one object to another by name: a keyword argument ``name=obj.name``, or a pair
``("section.key", value)`` / ``{"section.key": value}`` naming its config key. Every other reader reads the one
``Layout``. The counts below walk the library's source, so a sixth home or a third adapter fails here.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

from planning.layout import CONFIG_KEYS, DEGREES, Layout

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("checkpoint", "cluster", "data", "launch", "measure", "mesh", "models", "observers", "planning", "runtime")
LIBRARY += ("savers",)
LIBRARY += ("training",)

# A field's names besides its own: its config key's name and the name mesh/'s typed options give it.
OTHER_NAMES = {
    "sp_regather": {"regather"},
    "cp_attention": {"attention"},
    "fsdp_reshard_after_forward": {"reshard_after_forward"},
    "fsdp_cpu_offload": {"cpu_offload", "offload"},
    "activation_checkpoint": {"ac"},
}


def names_of(field: str) -> set[str]:
    return {field, CONFIG_KEYS[field].split(".")[1], *OTHER_NAMES.get(field, ())}


def library_files() -> list[Path]:
    files = [ROOT / "train.py", ROOT / "generate.py"]
    for room in LIBRARY:
        files += sorted((ROOT / room).rglob("*.py"))
    return files


@cache
def parsed() -> list[tuple[Path, ast.Module]]:
    return tuple((f, ast.parse(f.read_text(), str(f))) for f in library_files())


def declarations(field: str, trees) -> set[str]:
    """The classes that annotate an attribute named like ``field``."""
    names, found = names_of(field), set()
    for path, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        if item.target.id in names:
                            found.add(f"{path.relative_to(ROOT)}:{node.name}")
    return found


def copies(field: str, trees) -> set[str]:
    """The functions that copy ``field`` by name (module docstring)."""
    names, key = names_of(field), CONFIG_KEYS[field]
    return {
        where
        for where, (keywords, keys) in copy_index(trees).items()
        if key in keys or any(arg in names and attr in names for arg, attr in keywords)
    }


def copy_index(trees) -> dict[str, tuple[set, set]]:
    """Per function: the ``name=obj.attr`` keyword pairs and the config keys paired with a value read elsewhere."""
    if trees is parsed():
        return _library_index()
    return _index(trees)


@cache
def _library_index() -> dict[str, tuple[set, set]]:
    return _index(parsed())


def _index(trees) -> dict[str, tuple[set, set]]:
    index = {}
    for path, tree in trees:
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            keywords, keys = set(), set()
            for node in ast.walk(func):
                if isinstance(node, ast.keyword) and node.arg and isinstance(node.value, ast.Attribute):
                    keywords.add((node.arg, node.value.attr))
                elif isinstance(node, ast.Tuple) and len(node.elts) == 2 and _read(node.elts[1]):
                    keys.add(_text(node.elts[0]))
                elif isinstance(node, ast.Dict):
                    keys |= {_text(k) for k, v in zip(node.keys, node.values, strict=True) if _read(v)}
            where = f"{path.relative_to(ROOT)}:{func.name}"
            old = index.get(where, (set(), set()))
            index[where] = (old[0] | keywords, old[1] | keys)
    return index


def _text(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _read(node) -> bool:
    """A value read from another object (``obj.name``, ``e["name"]``): a copy, not a setting of its own."""
    return isinstance(node, ast.Attribute | ast.Subscript)


def test_each_layout_field_has_at_most_three_types_and_two_copies():
    trees = parsed()
    report = {}
    for field in CONFIG_KEYS:
        if field in DEGREES or field == "seq_len":
            # the degrees live in ParallelDims (mesh/dims.py), which the Layout holds whole; seq_len is the data's
            # shape, a value every loader and workload reads, not a knob of how the step runs
            continue
        declared, copied = declarations(field, trees), copies(field, trees)
        if len(declared) > 3 or len(copied) > 2:
            report[field] = {"declared in": sorted(declared), "copied in": sorted(copied)}
    assert report == {}, f"layout fields with more than one home: {report}"


def test_the_count_sees_a_home_added_beside():
    """The walk finds a fourth declaring type and a third copy when they are written (the check can fail)."""
    extra = ast.parse(
        "class Shadow:\n    sequence_parallel: bool = True\n\n"
        "def adapt(cfg):\n    return Shadow(sequence_parallel=cfg.sequence_parallel)\n\n"
        "def adapt_again(cfg):\n    return [('parallel.sequence_parallel', cfg.x)]\n"
    )
    trees = [*parsed(), (ROOT / "shadow.py", extra)]
    assert len(declarations("sequence_parallel", trees)) == len(declarations("sequence_parallel", parsed())) + 1
    assert len(copies("sequence_parallel", trees)) == len(copies("sequence_parallel", parsed())) + 2


def test_every_layout_field_is_read_from_the_config_in_one_table():
    """``Layout.from_config`` reads every non-derived field through ``CONFIG_KEYS``: a field the table misses
    would keep its default whatever the user wrote."""
    derived = {"dims", "sequences_per_microbatch", "stage_layers", "fsdp"}
    fields = {f for f in Layout.__dataclass_fields__ if not f.startswith("_")} - derived - set(DEGREES)
    assert fields <= set(CONFIG_KEYS), sorted(fields - set(CONFIG_KEYS))
