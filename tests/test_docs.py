"""The chapters check themselves: cross-references, code pointers, bench numbers, the reading order, history.

1. **Cross-references.** Every "section N" (or "§N", "sections N-M", "sections N and M") names a heading of that
   number in the chapter it points into: the chapter named just before it ("docs/tensor_parallel.md, section 7",
   "chapter 0 (section 4)"), else the chapter it is written in. Code and tests that cite a chapter's section are
   checked the same way. The checker is also run on a deliberately broken text, and must fail there.
2. **Code pointers.** Every `` `path/file.py: name` `` names a file that exists and a name defined in it.
3. **Bench numbers.** A block of a bench's printed output carries a marker on the line before its fence:

       <!-- bench: python -m measure.fsdp_memory | exact -->

   naming the command that prints it and how a re-run is compared: ``exact`` (every quoted line, whitespace
   aside, is a line of the new output, in order: counts, bytes and arithmetic do not vary), ``rtol=X`` (the same
   lines, numbers within X relative), ``atol=X`` (numbers within X absolute: counts stay exact while round-off
   errors of about 1e-7 may differ between CPUs), ``shape`` (the same lines with every number blanked: timings on shared CPU
   cores vary by up to 1.6x from one minute to the next, so only the text around them is pinned) or
   ``not rerun: why``. After the mode, clauses separated by ``; `` state what a timed block teaches
   (``shape; tp2[3] >= 1.15; either: yes / NO``):

   - a **bound** ``A OP B`` (OP one of ``>= <= > <``; A and B each a number, ``LABEL[K]`` or ``X * LABEL[K]``):
     ``LABEL[K]`` is the K-th number (from 1) of the one printed line that starts with LABEL and a space;
     the rerun's numbers must satisfy it, and so must the block's own (test_every_bound_holds_on_its_block);
   - ``either: A / B / ...``: words that may stand in each other's place (a verdict that a threshold near the
     measured value flips with the load); each bound says what about them is robust.

   A block introduced as a bench's output without a marker fails. The fast benches are
   re-run in the default suite; the rest under ``pytest -m slow`` (test_every_marked_bench_still_prints_what_
   the_chapter_quotes).
4. **The reading order.** README's "Start here" table lists every chapter, in the order of their numbers, each
   with a time; every chapter links the notation page (docs/glossary.md) where it first uses Ψ.
5. **No code history** in the teaching text (CHANGELOG.md holds it): no commit hashes, no "before, meshloom".
"""

from __future__ import annotations

import ast
import contextlib
import io
import itertools
import os
import re
import runpy
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from launch.local_runs import ROOT

DOCS = ROOT / "docs"
CHAPTERS = sorted(DOCS.glob("*.md"))


def read(path: Path) -> str:
    return path.read_text()


# ---- 1. cross-references -----------------------------------------------------------------------------------

HEADING = re.compile(r"^#{2,4} (?:§)?(\d+(?:\.\d+)?)[.)]?\s", re.M)
CHAPTER_TITLE = re.compile(r"^# (\d+)\. ", re.M)
NUMBER = r"\d+(?:\.\d+)?"
NUMBERS = rf"{NUMBER}(?:\s*(?:-|–|,|and|or|to)\s*{NUMBER}(?![\d,]*\d{{3}}))*"
REFERENCE = re.compile(rf"(?:\b[Ss]ections?\s+|§\s?)({NUMBERS})")
# What may stand right before a reference and name its chapter: a file, or "chapter N", with optional
# punctuation between ("docs/x.md, section 3", "[x](x.md), section 3", "chapter 0 (section 4)", "x.md §3").
QUALIFIER = re.compile(
    r"(?:(?P<file>[\w./-]*?(?P<stem>[\w-]+)\.md)\)?`?|[Cc]hapter\s+(?P<chapter>\d+)(?:'s)?)\s*[,:]?\s*\(?\s*$"
)


def heading_numbers(text: str) -> set[str]:
    return set(HEADING.findall(text))


def expand(numbers: str) -> list[str]:
    """'1-7' -> 1..7, '3 and 5' -> 3, 5, '8.1' -> 8.1."""
    out: list[str] = []
    parts = re.split(r"\s*(?:,|and|or)\s*", numbers)
    for part in parts:
        bounds = re.split(r"\s*(?:-|–|to)\s*", part)
        if len(bounds) == 2 and all(b.isdigit() for b in bounds):
            out += [str(n) for n in range(int(bounds[0]), int(bounds[1]) + 1)]
        else:
            out += [b for b in bounds if b]
    return out


@dataclass
class Reference:
    where: str  # file:line
    text: str
    target: str  # chapter file name
    numbers: list[str]


def references(name: str, text: str, chapter_files: dict[str, str], bare: bool = True) -> list[Reference]:
    """Every section reference in ``text`` (the file ``name``), with the chapter it points into.

    bare: whether an unqualified "section N" means this file's own section (True for chapters; code and
    README cite only qualified references)."""
    found = []
    for m in REFERENCE.finditer(text):
        before = text[max(0, m.start() - 80) : m.start()]
        q = QUALIFIER.search(before)
        if q and q.group("stem"):
            target = q.group("stem") + ".md"
        elif q and q.group("chapter"):
            target = chapter_files.get(q.group("chapter"), f"chapter {q.group('chapter')}")
        elif bare:
            target = name
        else:
            continue
        line = text.count("\n", 0, m.start()) + 1
        found.append(Reference(f"{name}:{line}", m.group(0), target, expand(m.group(1))))
    return found


def cross_reference_errors(chapters: dict[str, str], others: dict[str, str] | None = None) -> list[str]:
    """Every reference of ``chapters`` (name -> text) and of ``others`` (qualified ones only) that names no
    heading of its target chapter."""
    chapter_files = {m.group(1): name for name, text in chapters.items() for m in [CHAPTER_TITLE.search(text)] if m}
    numbers = {name: heading_numbers(text) for name, text in chapters.items()}
    errors = []
    sources = [(n, t, True) for n, t in chapters.items()] + [(n, t, False) for n, t in (others or {}).items()]
    for name, text, bare in sources:
        for ref in references(name, text, chapter_files, bare):
            if ref.target not in numbers:
                errors.append(f"{ref.where}: {ref.text!r} points into {ref.target}, which is not a chapter")
                continue
            missing = [n for n in ref.numbers if n not in numbers[ref.target]]
            if missing:
                errors.append(f"{ref.where}: {ref.text!r}: {ref.target} has no section {', '.join(missing)}")
    return errors


def code_files() -> dict[str, str]:
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    return {name: (ROOT / name).read_text() for name in listed.stdout.split() if name != "tests/test_docs.py"}


def test_every_section_reference_names_a_heading_of_its_chapter():
    chapters = {p.name: read(p) for p in CHAPTERS}
    others = {"README.md": read(ROOT / "README.md"), **code_files()}
    errors = cross_reference_errors(chapters, others)
    assert not errors, "\n".join(errors)


def test_the_cross_reference_check_fails_on_a_broken_reference():
    chapters = {
        "a.md": "# 1. A\n\n## 1. One\n\n## 2. Two\n\n### 2.1 Two and a bit\n",
        "b.md": "# 2. B\n\n## 1. Only\n",
    }
    good = "See section 2, sections 1-2, section 2.1, docs/b.md, section 1, chapter 2 (section 1), b.md §1."
    assert cross_reference_errors({**chapters, "c.md": "# 3. C\n\n## 1. x\n\n## 2. y\n\n### 2.1 z\n" + good}) == []
    broken = {
        "section 3": "c.md has no section 3",
        "sections 1-4": "c.md has no section 3, 4",
        "docs/b.md, section 2": "b.md has no section 2",
        "chapter 1 (section 5)": "a.md has no section 5",
        "docs/nowhere.md section 1": "nowhere.md, which is not a chapter",
        "section 2.2": "c.md has no section 2.2",
    }
    for text, expected in broken.items():
        errors = cross_reference_errors({**chapters, "c.md": "# 3. C\n\n## 1. x\n\n## 2. y\n\n### 2.1 z\n" + text})
        assert len(errors) == 1 and expected in errors[0], (text, errors)
    # code cites only qualified references: a bare "section 3" in a docstring is left alone
    assert cross_reference_errors(chapters, {"x.py": '"""section 3; docs/a.md, section 9"""'}) == [
        "x.py:1: 'section 9': a.md has no section 9"
    ]


# ---- 2. code pointers --------------------------------------------------------------------------------------

POINTER = re.compile(r"`((?:[\w.-]+/)*[\w.-]+\.py): ([A-Za-z_][\w.]*)")
TORCH = Path(__import__("torch").__file__).parent.parent


def defined_names(path: Path) -> set[str]:
    """Every function, class and assigned name in the file, at any depth, and Class.member for class members."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        if isinstance(node, ast.ClassDef):
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}.{item.name}")
                elif isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) and item.value.id == "self":
                    names.add(f"{node.name}.{item.attr}")
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    for target in item.targets if isinstance(item, ast.Assign) else [item.target]:
                        if isinstance(target, ast.Name):
                            names.add(f"{node.name}.{target.id}")
    return names


def test_every_code_pointer_names_a_file_and_a_name_defined_in_it():
    errors = []
    for doc in [*CHAPTERS, ROOT / "README.md"]:
        for m in POINTER.finditer(read(doc)):
            file, name = m.groups()
            path = (TORCH / file) if file.startswith("torch/") else (ROOT / file)
            line = read(doc).count("\n", 0, m.start()) + 1
            if not path.exists():
                errors.append(f"{doc.name}:{line}: {file} does not exist")
            elif name not in defined_names(path):
                errors.append(f"{doc.name}:{line}: {file} defines no {name}")
    assert not errors, "\n".join(errors)


# ---- 3. bench numbers --------------------------------------------------------------------------------------

MODE = r"(?P<mode>(?:exact|shape|[ar]tol=[\d.e-]+)(?:; [^;]+?)*|not rerun: .+)"
MARKER = re.compile(rf"^<!-- bench: (?P<command>[^|]+?) \| {MODE} -->$")
FENCE = re.compile(r"^```")
# numbers as benches print them: 1,706,240  0.5499  -0.7%  2.4e-06  1.0x  0.14s  67.1 MB (a unit may follow)
NUM = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?(?=(?:x|s|ms|%|[KMGT]?B)?(?![\w]))")
FAST = {  # re-run in the default suite: seconds each
    "python -m measure.memory_table",
    "python -m measure.grad_compression --links",
    "python -m measure.pipeline_facts split",
    "python -m docs.figures pipeline --pp 4 --microbatches 8",
    "python -m docs.figures mesh --dp-replicate 2 --dp-shard 2 --tp 2 --out mesh.svg",
    "python -m docs.figures mesh --pp 2 --dp-shard 2 --tp 2 --ep 2 --out mesh.svg",
}


@dataclass
class Quoted:
    where: str
    command: str
    mode: str  # exact, shape, rtol=X, atol=X or 'not rerun: why'; a marker's clauses are split off into
    lines: list[str]
    clauses: tuple[str, ...] = ()  # its bounds and either: lists (module docstring, section 3)

    @classmethod
    def marked(cls, where: str, command: str, mode: str, lines: list[str]) -> Quoted:
        """From a marker's mode text: 'shape; a[1] >= 2; either: x / y' -> mode 'shape' and two clauses."""
        if mode.startswith("not rerun"):
            return cls(where, command, mode, lines)
        first, *clauses = mode.split("; ")
        return cls(where, command, first, lines, tuple(c.strip() for c in clauses))


def blocks(text: str) -> list[tuple[int, list[str]]]:
    """(line index of the opening fence, the block's lines) for every fenced block."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            j = i + 1
            while j < len(lines) and not FENCE.match(lines[j]):
                j += 1
            out.append((i, lines[i + 1 : j]))
            i = j + 1
        else:
            i += 1
    return out


def quoted_outputs(path: Path) -> tuple[list[Quoted], list[str]]:
    """The marked blocks of a chapter, and the blocks that quote a bench without a marker."""
    text = read(path)
    lines = text.splitlines()
    marked, unmarked = [], []
    for i, line in enumerate(lines):  # a table quoting a bench: the marker names it; tables are not re-run
        marker = MARKER.match(line)
        if marker and i + 1 < len(lines) and lines[i + 1].startswith("|"):
            table = list(itertools.takewhile(lambda row: row.startswith("|"), lines[i + 1 :]))
            marked.append(Quoted.marked(f"{path.name}:{i + 1}", marker["command"].strip(), marker["mode"], table))
            if not marker["mode"].startswith("not rerun"):
                unmarked.append(f"{path.name}:{i + 1}: a table's marker must say 'not rerun: why'")
    for start, body in blocks(text):
        before = [line for line in lines[max(0, start - 3) : start] if line.strip()]
        marker = MARKER.match(before[-1]) if before else None
        where = f"{path.name}:{start + 1}"
        if marker:
            marked.append(Quoted.marked(where, marker["command"].strip(), marker["mode"], body))
            continue
        intro = " ".join(lines[max(0, start - 4) : start])
        commands_only = all(
            not line.strip() or re.match(r"\s*(\$ |#|python|torchrun|\.venv|OMP_|pip|HF_|printf|ls|\S+=)", line)
            for line in body
        )
        says_bench = re.search(
            r"[Oo]utput of `?(?:\.venv/bin/)?python -m measure\.|`python -m measure\.\w+`[^`]*:$", intro
        )
        if (says_bench or (body and body[0].startswith("$ python -m measure"))) and not commands_only:
            unmarked.append(f"{where}: bench output without a <!-- bench: ... --> marker")
    return marked, unmarked


def all_quoted() -> list[Quoted]:
    return [q for p in CHAPTERS for q in quoted_outputs(p)[0]]


def skeleton(line: str) -> str:
    """The line with every number blanked; a number padded to its width inside brackets, '( 5.7%)', reads as
    '(15.0%)' does."""
    return re.sub(r"([(\[])\s+#", r"\1#", " ".join(NUM.sub("#", line).split()))


def normalized(line: str) -> str:
    return " ".join(line.split())


def quoted_lines(lines: list[str]) -> list[str]:
    """The lines a re-run must reproduce: not the `$ command` lines (and their continuations), not '...'."""
    out, continued = [], False
    for line in lines:
        if line.startswith("$ ") or continued:
            continued = line.rstrip().endswith("\\")
            continue
        if line.strip() and line.strip() != "...":
            out.append(line)
    return out


def beyond(mode: str, quoted: str, produced: str) -> list[str]:
    """The numbers of ``produced`` that differ from ``quoted``'s beyond an ``rtol=``/``atol=`` mode."""
    tol, relative = float(mode[5:]), mode.startswith("rtol=")
    out = []
    for a, b in zip(NUM.findall(quoted), NUM.findall(produced), strict=True):
        x, y = float(a.replace(",", "")), float(b.replace(",", ""))
        if abs(x - y) > tol * (max(abs(x), abs(y)) if relative else 1):
            out.append(f"{quoted.strip()!r}: {a} is now {b} (beyond {mode})")
    return out


def same_line(mode: str, quoted: str, produced: str) -> bool:
    """Whether a printed line is the quoted one under the marker's mode."""
    if mode == "exact":
        return normalized(produced) == normalized(quoted)
    same_text = skeleton(produced) == skeleton(quoted)
    return same_text and not (mode.startswith(("rtol=", "atol=")) and beyond(mode, quoted, produced))


BOUND = re.compile(r"^(?P<left>.+?)\s*(?P<op>>=|<=|>|<)\s*(?P<right>.+)$")
TERM = re.compile(r"^(?:(?P<factor>[-+]?[\d.]+(?:e[-+]?\d+)?)\s*\*\s*)?(?P<label>.+?)\[(?P<k>\d+)\]$")
OPS = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, "<": lambda a, b: a < b}


def either_lists(clauses: tuple[str, ...]) -> list[list[str]]:
    return [[w.strip() for w in c[len("either:") :].split(" / ")] for c in clauses if c.startswith("either:")]


def interchangeable(line: str, lists: list[list[str]]) -> str:
    """The line with each word of an either: list (longest first, whole words) replaced by the list's token."""
    for n, words in enumerate(lists):
        for word in sorted(words, key=len, reverse=True):
            line = re.sub(rf"(?<!\w){re.escape(word)}(?!\w)", f"<either{n}>", line)
    return line


def term_value(term: str, lines: list[str]) -> tuple[float | None, str]:
    """A bound's term read off ``lines``: (value, '') or (None, why not)."""
    term = term.strip()
    if re.fullmatch(r"[-+]?[\d.]+(?:e[-+]?\d+)?", term):
        return float(term), ""
    m = TERM.match(term)
    if not m:
        return None, f"{term!r} is neither a number nor LABEL[K]"
    label = normalized(m["label"])
    rows = [line for line in lines if normalized(line) == label or normalized(line).startswith(label + " ")]
    if len(rows) != 1:
        return None, f"{len(rows)} printed lines start with {label!r} (a bound names exactly one)"
    numbers = NUM.findall(rows[0])
    k = int(m["k"])
    if not 1 <= k <= len(numbers):
        return None, f"{rows[0].strip()!r} has no number {k}"
    return float(m["factor"] or 1) * float(numbers[k - 1].replace(",", "")), ""


def bound_errors(clauses: tuple[str, ...], output: str) -> list[str]:
    """The bounds among a marker's clauses that ``output`` breaks (or names no number for)."""
    lines = [line for line in output.splitlines() if line.strip()]
    errors = []
    for clause in clauses:
        if clause.startswith("either:"):
            continue
        m = BOUND.match(clause)
        if not m:
            errors.append(f"{clause!r}: not a bound (A >= B) nor an either: list")
            continue
        (left, why_left), (right, why_right) = term_value(m["left"], lines), term_value(m["right"], lines)
        if left is None or right is None:
            errors.append(f"bound {clause!r}: {why_left or why_right}")
        elif not OPS[m["op"]](left, right):
            errors.append(f"bound {clause!r} broken: {left:g} {m['op']} {right:g} is false")
    return errors


def mismatches(quoted: Quoted, output: str) -> list[str]:
    """Quoted lines that do not appear, in order, in the command's output under the marker's rule, and the
    marker's bounds that the output breaks. Under a tolerance a quoted line matches the first line of the same
    text whose numbers are within it, so that '--- rank 2 ---' is not taken for '--- rank 1 ---'."""
    lists = either_lists(quoted.clauses)
    produced = [interchangeable(line, lists) for line in output.splitlines() if line.strip()]
    tolerant = quoted.mode.startswith(("rtol=", "atol="))
    errors, i = bound_errors(quoted.clauses, output), 0
    for line in (interchangeable(line, lists) for line in quoted_lines(quoted.lines)):
        j = i
        while j < len(produced) and not same_line(quoted.mode, line, produced[j]):
            j += 1
        if j == len(produced):
            near = [p for p in produced[i:] if skeleton(p) == skeleton(line)]
            if tolerant and near:
                errors += beyond(quoted.mode, line, near[0])
            else:
                errors.append(f"{line.strip()!r} not printed" + (f"; now: {near[0].strip()!r}" if near else ""))
            continue
        i = j + 1
    return errors


def rerun(command: str) -> str:
    """Run a marker's command from the repository root, as the chapter does (the benches read configs/ and write
    only into temporary folders; moe_load is told not to redraw its picture)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = shlex.split(command)
    assert args[:2] == ["python", "-m"], command
    out = subprocess.run([sys.executable, *args[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"{command} failed:\n{out.stderr[-3000:]}"
    return out.stdout


def test_every_bench_output_carries_a_marker_naming_a_bench_that_exists():
    errors = []
    for path in CHAPTERS:
        marked, unmarked = quoted_outputs(path)
        errors += unmarked
        for q in marked:
            module = q.command.split()[2]
            if (
                not (ROOT / (module.replace(".", "/") + ".py")).exists()
                and not (ROOT / module.replace(".", "/")).is_dir()
            ):
                errors.append(f"{q.where}: {q.command}: no module {module}")
            if not quoted_lines(q.lines):
                errors.append(f"{q.where}: the marked block quotes nothing")
    assert not errors, "\n".join(errors)
    assert {q.command for q in all_quoted()} >= FAST, "a fast bench lost its marker"


def test_the_bench_comparison_fails_on_a_changed_number():
    q = Quoted(
        "x.md:1", "python -m measure.x", "exact", ["$ python -m measure.x", "model  Ψ  1,706,240  0.5499", "..."]
    )
    assert mismatches(q, "header\nmodel    Ψ   1,706,240   0.5499\n") == []
    assert mismatches(q, "model Ψ 1,706,241 0.5499\n") != []
    shaped = Quoted("x.md:1", "python -m measure.x", "shape", ["tok/s 2,714 ratio 1.851x 0.14s"])
    assert mismatches(shaped, "tok/s 2,093 ratio 1.412x 0.9s\n") == []
    assert mismatches(shaped, "tok/s 2,093 ratio 1.412x\n") != []
    assert mismatches(Quoted("x.md:1", "m", "shape", ["other 25.1 (15.0%)"]), "other 9.1 ( 5.0%)\n") == []
    loose = Quoted("x.md:1", "python -m measure.x", "rtol=0.01", ["size 247,890 bytes"])
    assert mismatches(loose, "size 247,902 bytes\n") == [] and mismatches(loose, "size 250,902 bytes\n") != []
    rounded = Quoted("x.md:1", "python -m measure.x", "atol=1e-6", ["{'rows': 8, 'error': 2.384185791015625e-07}"])
    assert mismatches(rounded, "{'rows': 8, 'error': 1.1920928955078125e-07}\n") == []
    assert mismatches(rounded, "{'rows': 9, 'error': 2.384185791015625e-07}\n") != []
    ranks = Quoted("x.md:1", "python -m measure.x", "atol=1e-6", ["--- rank 2 ---", "{'held': 1}"])
    assert mismatches(ranks, "--- rank 1 ---\n{'held': 2}\n--- rank 2 ---\n{'held': 1}\n") == []


def test_a_bound_fails_on_an_output_that_breaks_it():
    marker = "<!-- bench: python -m measure.x | shape; tp2[3] >= 1.15; tp2[2] <= 0.9 * fsdp2[2]; either: yes / NO -->"
    parsed = MARKER.match(marker)
    q = Quoted.marked(
        "x.md:1", parsed["command"], parsed["mode"], ["fsdp2  2  2,714  1.851  yes", "tp2  2  2,071  1.412  NO"]
    )
    assert (q.mode, q.clauses) == ("shape", ("tp2[3] >= 1.15", "tp2[2] <= 0.9 * fsdp2[2]", "either: yes / NO"))
    assert mismatches(q, "fsdp2 2 2,093 1.6 NO\ntp2 2 1,500 1.2 yes\n") == []  # timings and verdicts move
    slower = mismatches(q, "fsdp2 2 2,093 1.6 yes\ntp2 2 1,500 1.1 NO\n")
    assert slower == ["bound 'tp2[3] >= 1.15' broken: 1.1 >= 1.15 is false"], slower
    assert mismatches(q, "fsdp2 2 1,600 1.6 yes\ntp2 2 1,500 1.2 NO\n")[0].startswith("bound 'tp2[2] <= 0.9")
    assert mismatches(q, "fsdp2 2 2,093 1.6 maybe\ntp2 2 1,500 1.2 NO\n") != []  # not in the either: list
    gone = mismatches(q, "fsdp2 2 2,093 1.6 yes\n")
    assert any("0 printed lines start with 'tp2'" in e for e in gone), gone
    twice = Quoted("x.md:1", "python -m measure.x", "shape", ["tp2 1"], ("tp2[1] > 0",))
    assert "2 printed lines" in mismatches(twice, "tp2 1\ntp2 2\n")[0]
    assert "has no number 3" in mismatches(Quoted("x.md:1", "m", "shape", ["a 1"], ("a[3] > 0",)), "a 1\n")[0]


def own_block_errors(quoted: list[Quoted]) -> list[str]:
    """Where a marker's bounds do not hold on the chapter's own block (or sit under a mode that never reruns)."""
    errors = []
    for q in quoted:
        if q.clauses:
            errors += [f"{q.where}: {e}" for e in bound_errors(q.clauses, "\n".join(quoted_lines(q.lines)))]
            errors += [f"{q.where}: {c!r} needs a mode that reruns" for c in q.clauses if q.mode.startswith("not")]
    return errors


def test_every_bound_holds_on_its_block():
    # A marker's bounds state what its block teaches: the chapter's own figures must satisfy them too (the
    # printouts' blocks: tests/test_docs_printouts.py).
    errors = own_block_errors(all_quoted())
    assert not errors, "\n".join(errors)


def rerun_here(command: str, where: Path, monkeypatch) -> str:
    """A fast marker's command in this process (no interpreter start-up): ``python -m module args``."""
    args = shlex.split(command)
    monkeypatch.chdir(where)
    monkeypatch.setattr(sys, "argv", [args[2], *args[3:]])
    monkeypatch.delitem(sys.modules, args[2], raising=False)  # runpy runs a fresh copy as __main__
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_module(args[2], run_name="__main__", alter_sys=True)
    return out.getvalue()


@pytest.mark.parametrize("command", sorted(FAST))
def test_the_fast_benches_still_print_what_the_chapters_quote(command, tmp_path, monkeypatch):
    output = rerun_here(command, tmp_path, monkeypatch)
    errors = [f"{q.where}: {e}" for q in all_quoted() if q.command == command for e in mismatches(q, output)]
    assert not errors, "\n".join(errors)


SLOW = sorted({q.command for q in all_quoted() if not q.mode.startswith("not rerun")} - FAST)


@pytest.mark.slow
@pytest.mark.parametrize("command", SLOW, ids=str)  # the whole command, so that -k picks one by any part
def test_every_marked_bench_still_prints_what_the_chapter_quotes(command):
    # One command at a time (pytest -m slow tests/test_docs.py -k moe_load): the benches take from seconds to
    # a few minutes each, and several spawn gloo ranks.
    output = rerun(command)
    errors = [f"{q.where}: {e}" for q in all_quoted() if q.command == command for e in mismatches(q, output)]
    assert not errors, "\n".join(errors)


# ---- 4. the reading order ----------------------------------------------------------------------------------


def test_readme_lists_every_chapter_in_order_with_a_time():
    readme = read(ROOT / "README.md")
    table = readme[readme.index("## Start here") :].split("\n\n")
    rows = [line for part in table for line in part.splitlines() if line.startswith("| ") and "](docs/" in line]
    listed = [re.search(r"\]\(docs/([\w.]+\.md)\)", row).group(1) for row in rows]
    numbered = {p.name: CHAPTER_TITLE.search(read(p)) for p in CHAPTERS}
    chapters = sorted((int(m.group(1)), name) for name, m in numbered.items() if m)
    assert listed[: len(chapters)] == [name for _, name in chapters], "README's table is not in chapter order"
    assert set(listed) == {p.name for p in CHAPTERS} - {"glossary.md"}, "a chapter is missing from README's table"
    for row in rows:
        assert re.search(r"\| \d+ min \|$", row.strip()), f"no time: {row}"


def test_every_chapter_links_the_notation_page_where_it_first_uses_psi():
    for path in CHAPTERS:
        if path.name == "glossary.md":
            continue
        paragraphs = read(path).split("\n\n")
        first = next((p for p in paragraphs if "Ψ" in p), None)
        assert first is None or "glossary.md" in first, f"{path.name}: first Ψ without a link to glossary.md"
        assert "glossary.md" in read(path), f"{path.name} never links the notation page"


# ---- 5. no code history in the teaching text ---------------------------------------------------------------

HISTORY = re.compile(  # a commit hash, and the phrases the history used to hide in
    r"(?<![\w.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w.])"
    r"|before, meshloom|as meshloom did before|the issue that started this|this chapter used to",
    re.I,
)
# A source's commit is a citation, not history: "commit 50a4b5f" in a paragraph that names the upstream
# repository the figure comes from (github.com/..., Megatron-LM, torchtitan, pytorch).
UPSTREAM = re.compile(r"github\.com/|Megatron-LM|torchtitan|pytorch/pytorch")


def history_mentions(text: str) -> list[tuple[int, str]]:
    """(line, text) of every commit hash or history phrase, except upstream commits cited as sources."""
    found = []
    for m in HISTORY.finditer(text):
        start = text.rfind("\n\n", 0, m.start()) + 1
        end = text.find("\n\n", m.end())
        paragraph = text[start : end if end >= 0 else len(text)]
        cited = re.search(r"commit\s+$", text[max(0, m.start() - 12) : m.start()], re.I) and UPSTREAM.search(paragraph)
        if not cited:
            found.append((text.count("\n", 0, m.start()) + 1, m.group(0)))
    return found


def test_history_check_tells_a_cited_upstream_commit_from_meshloom_history():
    assert history_mentions("Megatron-LM's README (commit\n  50a4b5f, April 2021) has the table.") == []
    assert history_mentions("meshloom fixed this in b4fdc54, then") == [(1, "b4fdc54")]
    assert history_mentions("see commit b4fdc54 for the fix") == [(1, "b4fdc54")]  # no upstream named


def test_no_commit_hashes_or_code_history_in_the_docs():
    errors = []
    for path in [*CHAPTERS, ROOT / "README.md"]:
        errors += [f"{path.name}:{line}: {found!r}" for line, found in history_mentions(read(path))]
    assert not errors, "history belongs in CHANGELOG.md:\n" + "\n".join(errors)
