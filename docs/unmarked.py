"""Numbers a reader meets that no test regenerates: ``python -m docs.unmarked`` lists them.

The course prints a number only where CI regenerates it. A number is regenerated when it stands

- in a fenced block (code, or a printout whose ``<!-- bench: -->`` / ``<!-- printed: -->`` marker reruns it),
- in a table under a ``<!-- bench: -->`` or ``<!-- one process: -->`` marker,
- in the paragraph before a ``<!-- check QUOTE: expression -->`` marker, as that QUOTE,
- in inline code, an HTML comment or a link's target (names, flags and paths, not claims).

Everything else in a chapter's **core** (from the top to its first ``## Appendix`` heading) and in its
**exercises** (a heading that says "Exercises", up to the next heading of the same level) is a finding, and so is
everything else in README.md, all of which counts as core: it is the page every user reads.

What counts as a number: digits that state a measurement or a result, that is

- a decimal fraction or an exponent (``0.058``, ``1.67x``, ``6e-8``, ``about 1e-7``),
- a number with a thousands separator (``1,706,240``),
- a number with a unit of measure right after it (``%``, ``x``/``×``, bytes, ``B``/``KB``/``MB``/``GB``/``TB``,
  ``KiB``/``MiB``/``GiB``, ``s``/``ms``/``µs``/``min``, ``minutes``/``seconds``/``hours``, ``FLOP(s)``, ``tok/s``,
  ``GB/s``, ``params``),
- a duration in minutes and seconds (``25m20s``).

The width of a number format is a definition too: ``1``, ``2``, ``4`` or ``8 bytes`` (per element) is not counted.
A whole number with a magnitude letter (``8B``, ``70B``, ``135M``) is a model's name, not counted.

Not numbers in this sense: plain integers without a unit (they define an example: "2 ranks", "pp 4", "step
12", "layer 3"), section and chapter numbers ("section 6.1", "§3", "chapter 4", headings), years, and the
versions of torch, Python, CUDA and the like ("torch 2.13", "2.11 to 2.15"). A number derived in the text from
marked numbers is fine only under a ``check`` marker that recomputes it; otherwise it is a finding too.

The default suite (tests/test_docs_numbers.py) fails on any finding not in docs/unmarked_allowed.txt, the
shrinking list of the findings still to be fixed, each with its reason; and on an entry of that list that no
longer matches a finding, so that a fix shrinks the list.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
ALLOWED = DOCS / "unmarked_allowed.txt"

FENCE = re.compile(r"^\s*```")
CHECK = re.compile(r"<!-- check (?P<quote>[^:]+?): (?P<expr>.+?) -->")
TABLE_MARKER = re.compile(r"^<!-- (?:bench: .+|one process: .+) -->$")
HEADING = re.compile(r"^(#{2,4}) (.*)$")
UNIT = (
    r"%|x(?![\w])|×| ?(?:bytes?|[KMGT]i?B(?:/s)?|GB/s|µs|ms|s|min|minutes?|seconds?|hours?|FLOPs?|[GT]?FLOP(?:/s)?"
    r"|tok/s|tokens/s|params|parameters)(?![\w])"
)
NUMBER = re.compile(
    rf"(?<![\w.,/-])(?P<num>\d+m\d+s|\d{{1,3}}(?:,\d{{3}})+(?:\.\d+)?|\d+\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+|\d+)(?P<unit>{UNIT})?"
)
# versions and references: the number right after one of these words is a name, not a measurement. Whole words
# only ("kv 33.6 MB" is a size), and "v" only when the number touches it ("v2.1"; "k and v 33.6 MB" is a size)
NAMED = re.compile(
    r"(?<![\w])(?:(?:torch|PyTorch|Python|CUDA|NCCL|cuDNN|transformers|version|[Ss]ections?|§|[Cc]hapters?|"
    r"[Aa]ppendix|[Ll]lama|Llama-|SmolLM|SmolLM2|Qwen|Qwen2|Qwen3|Mixtral|DeepSeek|DeepSeek-V|GPT-|Phi-|"
    r"[Ee]xercises?|[Ss]tep)\s?-?|v)$"
)
RANGE_AFTER_NAMED = re.compile(r"(?:\d+(?:\.\d+)*)\s*(?:to|-|–|and|or|,)\s*$")


@dataclass(frozen=True)
class Finding:
    chapter: str
    line: int
    number: str
    context: str  # the number with a few words either side, the key of an allowlist entry

    def __str__(self) -> str:
        return f"{self.chapter}:{self.line}: {self.number!r} in {self.context!r}"


def blank(text: str, start: int, end: int) -> str:
    """``text`` with [start, end) replaced by spaces, newlines kept (line numbers stay right)."""
    return text[:start] + re.sub(r"[^\n]", " ", text[start:end]) + text[end:]


def scope(lines: list[str], whole: bool = False) -> list[bool]:
    """Which lines are in the core or an exercise section; every line when the ``whole`` page is core."""
    if whole:
        return [True] * len(lines)
    inside, core, exercises_level = [], True, 0
    for line in lines:
        heading = HEADING.match(line)
        if heading:
            level, title = len(heading[1]), heading[2]
            if level == 2 and title.startswith("Appendix"):
                core = False
            if exercises_level and level <= exercises_level:
                exercises_level = 0
            if re.search(r"\bexercises\b", title, re.I):
                exercises_level = level
        inside.append(core or bool(exercises_level))
    return inside


def quoted_in(quote: str, paragraph: str) -> list[int]:
    """Where a check marker's ``quote`` stands in its paragraph as a whole number: not inside a longer one (a
    check of "4" does not cover the 4 in "1.45", "14" or "4e-3"); a unit after it is the quote's own ("853,120
    parameters" under a check of 853,120)."""
    pattern = rf"(?<![\w.,])(?<!e[-+]){re.escape(quote)}(?!\d|[.,]\d|e[-+]?\d)"
    return [m.start() for m in re.finditer(pattern, paragraph)]


def masked(text: str) -> str:
    """The text with everything a test regenerates, or that is not prose, replaced by spaces."""
    lines = text.split("\n")
    out = list(lines)
    i = 0
    while i < len(lines):  # fenced blocks
        if FENCE.match(lines[i]):
            j = i + 1
            while j < len(lines) and not FENCE.match(lines[j]):
                j += 1
            for k in range(i, min(j + 1, len(lines))):
                out[k] = " " * len(lines[k])
            i = j + 1
            continue
        if TABLE_MARKER.match(lines[i].strip()):  # a table under a bench / one-process marker
            k = i + 1
            while k < len(lines) and lines[k].startswith("|"):
                out[k] = " " * len(lines[k])
                k += 1
        if HEADING.match(lines[i]):
            out[i] = " " * len(lines[i])
        i += 1
    text = "\n".join(out)
    for match in reversed(list(CHECK.finditer(text))):  # a check marker's quote, in the paragraph it closes
        start = text.rfind("\n\n", 0, match.start()) + 1
        quote = match["quote"].strip()
        for q in reversed(quoted_in(quote, text[start : match.start()])):
            text = blank(text, start + q, start + q + len(quote))
    for pattern in (r"<!--.*?-->", r"`[^`\n]*`", r"\]\([^)\s]*\)", r"<[^>\n]*>", r"https?://\S+"):
        for match in reversed(list(re.finditer(pattern, text, re.S))):
            text = blank(text, match.start(), match.end())
    return text


def counts(number: str, unit: str | None, before: str) -> bool:
    """Whether a matched number states a measurement (the module docstring's rule)."""
    plain = number.isdigit()
    if NAMED.search(before) or (RANGE_AFTER_NAMED.search(before) and NAMED.search(RANGE_AFTER_NAMED.sub("", before))):
        return False
    if re.fullmatch(r"\d\.\d{1,2}", number) and re.search(r"(?:torch|Python|CUDA)\b(?:[^.;:]|\.\d){0,30}$", before):
        return False  # a version: "every supported torch (2.11 to 2.15)"
    if number in ("1", "2", "4", "8") and unit in ("byte", "bytes"):
        return False  # the width of a format: fp32's 4 bytes
    if plain and len(number) == 4 and number[:2] in ("19", "20") and not unit:
        return False  # a year
    return bool(unit) or not plain


def findings(name: str, text: str, whole: bool = False) -> list[Finding]:
    """The findings of one page: its core and exercises, or every line when the ``whole`` page is core."""
    lines = text.split("\n")
    inside = scope(lines, whole)
    clean = masked(text)
    found = []
    for m in NUMBER.finditer(clean):
        line = clean.count("\n", 0, m.start()) + 1
        if not inside[line - 1]:
            continue
        before = " ".join(clean[max(0, m.start() - 40) : m.start()].split()) + (
            " " if clean[m.start() - 1].isspace() else ""
        )
        if counts(m["num"], (m["unit"] or "").strip(), before):
            context = " ".join(text[max(0, m.start() - 30) : m.end() + 30].split())
            found.append(Finding(name, line, m.group(0).strip(), context))
    return found


def all_findings() -> list[Finding]:
    """Every chapter's findings (not the glossary's: it defines, it does not measure), then README's."""
    chapters = [
        f for p in sorted(DOCS.glob("*.md")) if p.name != "glossary.md" for f in findings(p.name, p.read_text())
    ]
    return chapters + findings(README.name, README.read_text(), whole=True)


def allowed() -> list[tuple[str, str, str]]:
    """(chapter, number, reason) per line of the allowlist, ``chapter | number | reason | context``: the context
    is for the reader (the words around the number), not matched; '#' starts a comment."""
    out = []
    for line in ALLOWED.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            chapter, number, reason, _ = (part.strip() for part in line.split("|", 3))
            out.append((chapter, number, reason))
    return out


def unexplained(found: list[Finding], allow: list[tuple[str, str, str]]) -> tuple[list[Finding], list[str]]:
    """The findings no allowlist entry explains, and the entries that explain no finding.

    An entry (chapter, number) explains one finding of that number in that chapter; a number found twice needs
    two entries."""
    left = list(allow)
    new = []
    for f in found:
        entry = next((e for e in left if e[0] == f.chapter and e[1] == f.number), None)
        if entry:
            left.remove(entry)
        else:
            new.append(f)
    return new, [f"{c} | {n} | {r}" for c, n, r in left]


def prune(found: list[Finding]) -> int:
    """Delete the allowlist's entries that match no finding (the fixed ones); the count deleted."""
    _, gone = unexplained(found, allowed())
    kept, removed = [], 0
    for line in ALLOWED.read_text().splitlines():
        key = " | ".join(part.strip() for part in line.split("|", 3)[:3])
        if not line.startswith("#") and key in gone:
            gone.remove(key)
            removed += 1
        else:
            kept.append(line)
    ALLOWED.write_text("\n".join(kept) + "\n")
    return removed


def build_parser() -> argparse.ArgumentParser:
    """The one option (tests/test_input_walk.py walks every tool's parser; an unknown option is refused)."""
    parser = argparse.ArgumentParser(prog="python -m docs.unmarked", description=__doc__.splitlines()[0])
    parser.add_argument("--prune", action="store_true", help="also delete the allowlist's stale entries")
    return parser


def main(argv: list[str]) -> int:
    """``python -m docs.unmarked``: every finding and the count per chapter; ``--prune`` also deletes the
    allowlist's entries that a fix has made stale."""
    args = build_parser().parse_args(argv)
    found = all_findings()
    if args.prune:
        print(f"deleted {prune(found)} fixed entries from {ALLOWED.relative_to(ROOT)}")
    per_chapter: dict[str, int] = {}
    for f in found:
        print(f)
        per_chapter[f.chapter] = per_chapter.get(f.chapter, 0) + 1
    print()
    for chapter, n in per_chapter.items():
        print(f"{chapter:28} {n:4}")
    print(f"{'total':28} {len(found):4}")
    new, stale = unexplained(found, allowed())
    print(f"not in {ALLOWED.relative_to(ROOT)}: {len(new)}; entries that match nothing: {len(stale)}")
    return 1 if new or stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
