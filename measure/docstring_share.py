"""How much of each room is docstring: docstring lines against code lines, per room, and the longest module
docstrings.

    python -m measure.docstring_share            # from the repository root

Code lines are the non-blank lines that are neither comment-only nor inside a docstring. Library code (the
rooms a run imports) keeps its docstrings at most ``LIMIT`` of its code lines and no module docstring longer
than ``MODULE_LIMIT`` lines (tests/test_structure.py); the long explanations live in the course (docs/).
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = (
    "models",
    "mesh",
    "planning",
    "checkpoint",
    "data",
    "runtime",
    "training",
    "savers",
    "observers",
    "train.py",
    "generate.py",
)
LIMIT = 0.25
MODULE_LIMIT = 32  # "about 30 lines": a module docstring says what the file does and why


def docstring_nodes(tree: ast.Module) -> list[ast.Constant]:
    """The docstrings of a module, its classes and its functions (the string literals that open a body)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                found.append(first.value)
    return found


def count(path: Path) -> tuple[int, int, int]:
    """(docstring lines, code lines, module docstring lines) of one file."""
    text = path.read_text()
    tree = ast.parse(text, str(path))
    in_doc: set[int] = set()
    module_doc = 0
    for doc in docstring_nodes(tree):
        lines = range(doc.lineno, doc.end_lineno + 1)
        in_doc.update(lines)
        if tree.body and isinstance(tree.body[0], ast.Expr) and tree.body[0].value is doc:
            module_doc = len(lines)
    code = sum(
        1
        for number, line in enumerate(text.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#") and number not in in_doc
    )
    return len(in_doc), code, module_doc


def room_of(relative: Path) -> str:
    return relative.parts[0] if len(relative.parts) > 1 else relative.name


def measure() -> dict[str, dict]:
    """Per room: docstring lines, code lines, and the longest module docstring (lines, file)."""
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    rooms: dict[str, dict] = {}
    for name in listed.stdout.split():
        relative = Path(name)
        if not (ROOT / relative).exists():
            continue
        docs, code, module_doc = count(ROOT / relative)
        room = rooms.setdefault(room_of(relative), {"docs": 0, "code": 0, "longest": (0, "")})
        room["docs"] += docs
        room["code"] += code
        room["longest"] = max(room["longest"], (module_doc, name))
    return rooms


def library_share(rooms: dict[str, dict]) -> tuple[int, int]:
    return sum(rooms[r]["docs"] for r in LIBRARY if r in rooms), sum(rooms[r]["code"] for r in LIBRARY if r in rooms)


def main() -> None:
    rooms = measure()
    print(f"{'room':<12} {'docstring':>9} {'code':>7} {'share':>6}   longest module docstring")
    for name in sorted(rooms, key=lambda r: (r not in LIBRARY, r)):
        r = rooms[name]
        share = r["docs"] / max(r["code"], 1)
        lines, where = r["longest"]
        print(f"{name:<12} {r['docs']:>9,} {r['code']:>7,} {share:>6.1%}   {lines:>3} {where}")
    docs, code = library_share(rooms)
    print(f"{'library':<12} {docs:>9,} {code:>7,} {docs / code:>6.1%}   (limit {LIMIT:.0%}; {', '.join(LIBRARY)})")


if __name__ == "__main__":
    main()
