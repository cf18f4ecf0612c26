"""One meaning per letter in the prose: a glossary letter is not defined, in a chapter, as something else.

docs/glossary.md gives each letter one meaning (tests/test_docs_numbers.py checks the glossary itself). This lint
reads the chapters' prose (fenced code, inline code and HTML comments removed) for the places where a letter is
given a meaning, and compares that meaning with the glossary's:

- ``where X is ...`` / ``with X ...`` (a letter explained in a clause),
- ``X = ...`` in math (a formula or a number with a noun after it: ``K = 3 micro-batches``),
- ``<noun> X`` where a letter is introduced by the noun it names (``scores s_j``, ``position p``),
- ``**X**`` (a letter set in bold as the name of a thing),
- a table header cell that is a letter.

A subscripted letter (``s_j``, ``g_i``) counts as its letter unless the glossary has a row for it (``s_c``).
A meaning is the glossary's if its content words share a stem (the first 5 letters) with the glossary row (its
meaning and meshloom's name) or with the row's entry in ``SAME`` (the other words the chapters use for that very
thing); a plain number, or a formula in glossary letters, is a value of the letter and agrees. A clash fails
naming the chapter, the line, the glossary's meaning and the chapter's.

Second, every letter used in math is a row of the glossary, and a row that says where the letter is *first met*
points at a chapter section that uses it, with no chapter earlier in README's reading order using it first.
"""

from __future__ import annotations

import re
from functools import cache

import pytest

from launch.local_runs import ROOT

DOCS = ROOT / "docs"
CHAPTERS = sorted(p for p in DOCS.glob("*.md") if p.name != "glossary.md")

# The other words the chapters use for the glossary's own meaning of a letter: a definition using one of them is
# the same thing said differently.
SAME = {
    "s": "sequence seq tokens length context",
    "g": "kv n_kv_heads head_dim key value width",
    "p": "pipeline stages pp degree",
    "S": "set keys key partial merged",
    "K": "bytes optimizer state master moments adam",
    "b": "batch sequences micro",
    "h": "hidden dim width model",
    "H": "ffn hidden swiglu expert",
    "a": "heads n_heads attention",
    "d": "head_dim head width",
    "t": "tp tensor degree ranks",
    "m": "micro-batches microbatches micro accumulated",
    "v": "stages per rank looped interleaved",
    "n": "ranks group world",
    "N": "elements bytes vector tensor",
    "r": "rank",
    "c": "chunk",
    "L": "layers",
    "V": "vocabulary vocab",
    "E": "experts",
    "k": "experts top-k top_k picks",
    "w": "bytes dtype",
    "B": "batch global sequences",
    "M": "elements",
    "T": "tokens",
    "q": "micro-batches round",
}

STOP = set(
    "the a an of in on at to by for from with and or is are be as its it this that than then each every one two"
    " all any per over under into onto after before when while which what where who how not no so but if only"
    " same other more less most least both either let say take makes make gives give give grows grow".split()
)
# words that may stand before a letter without naming it (verbs, prepositions, adjectives of size)
NOT_A_NAME = STOP | set(
    "times divided multiplied scales scaled halve halves double doubles equals equal sets set_ large larger"
    " small smaller whole total size sizes degree degrees same fixed given chosen any fall falls rises rise"
    " just also about nearly exactly least most up down out around near past along through like via number"
    " value values factor times whose only becomes holds keeps needs gives sends takes runs has own".split()
)

FENCE = re.compile(r"^\s*```.*?^\s*```[^\n]*$", re.S | re.M)
COMMENT = re.compile(r"<!--.*?-->", re.S)
INLINE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\]\([^)]*\)")


def prose(text: str) -> str:
    """The chapter with code, comments and link targets blanked (line numbers kept)."""

    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))

    for pattern in (FENCE, COMMENT, INLINE, LINK):
        text = pattern.sub(blank, text)
    return text


def glossary_text() -> str:
    return (DOCS / "glossary.md").read_text()


@cache
def glossary() -> dict[str, str]:
    """Symbol -> its row's meaning and meshloom's name (every table headed '| symbol |')."""
    rows: dict[str, str] = {}
    in_table = False
    for line in glossary_text().splitlines():
        if line.startswith("| symbol |"):
            in_table = True
            continue
        if not line.startswith("|"):
            in_table = False
            continue
        if in_table and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            for symbol in re.split(r",\s*", cells[0]):
                rows[symbol] = " ".join(cells[1:3])
    return rows


def stems(text: str) -> set[str]:
    return {w[:5].lower() for w in re.findall(r"[A-Za-z][A-Za-z_-]{2,}", text) if w.lower() not in STOP}


def letters() -> list[str]:
    """The glossary's one-character symbols (the letters a sentence can reuse without noticing)."""
    return [s for s in glossary() if len(s) == 1]


def base(token: str) -> str | None:
    """The glossary symbol a letter token stands for: itself, or the letter of an unlisted subscript."""
    if token in glossary():
        return token
    letter = token.split("_")[0]
    return letter if letter in glossary() and len(letter) == 1 else None


LETTER = r"(?P<x>[A-Za-zμνρσηθκτωλΨ](?:_(?:\w(?!\w)|c\b|cp\b|u\b))?)"
BOUND_L, BOUND_R = r"(?<![\w·/(−+×'’-])", r"(?![\w(’'-])"
DEFINITIONS = [
    # where X is ..., with X ... (the clause after the letter is its meaning)
    ("where", re.compile(rf"\b(?:where|with) \**{LETTER}\**{BOUND_R} (?:is |are |as )?(?P<m>[^.;:()]{{3,80}})")),
    # X = words, or X = a number and a noun
    ("=", re.compile(rf"{BOUND_L}\**{LETTER}\** = (?P<m>[^.;,:()]{{1,80}})")),
    # **X** <what it does>
    ("bold", re.compile(rf"\*\*{LETTER}\*\* (?P<m>[^.;:]{{3,80}})")),
    # multiplies the loss by X: a letter that is a factor of a named quantity
    # (the quantity a factor multiplies names the factor: 'multiplies the loss by S' makes S a loss scale)
    (
        "scale",
        re.compile(rf"\b(?:multiplies|scales)\s+(?:the\s+)?(?P<m>loss|gradients?|weights?)\s+by\s+{LETTER}{BOUND_R}"),
    ),
    # <noun> X: a letter introduced by the noun it names
    (
        "noun",
        re.compile(
            rf"\b(?:the|a|an|its|each|every|at|with|for|over)\s+(?:[a-z-]+\s+)?(?P<m>[a-z][a-z-]{{3,}})[ \n]{LETTER}{BOUND_R}(?! =)(?=[,:;]| [a-z])"
        ),
    ),
]


def agrees(symbol: str, meaning: str, kind: str) -> bool:
    text = meaning.strip()
    if kind == "=":
        # a value: a number (with a unit that the glossary row names, if any), or a formula in glossary letters
        number = re.match(r"^\d[\d,.·×^⁰¹²³⁴⁵⁶⁷⁸⁹⁻−+ /*e]*(?P<rest>.*)$", text, re.S)
        if number:
            rest = number["rest"].strip()
            if not rest or not re.match(r"[A-Za-z]", rest):
                return True
            # a number and words: a clash when the words name another row of the glossary and not this one
            if rest.split()[0].lower() in NOT_A_NAME or len(rest.split()[0]) == 1:  # a word of no meaning, a formula
                return True
            words = " ".join(re.findall(r"[A-Za-z][\w-]*", rest)[:2])
            own = stems(glossary()[symbol] + " " + SAME.get(symbol, ""))
            other = set().union(*(stems(m + " " + SAME.get(s, "")) for s, m in glossary().items() if s != symbol))
            return bool(stems(words) & own) or not (stems(words) & other)
        elif not re.search(r"[a-z]{3,}", text):
            return True  # a formula: letters, operators and numbers only
    if kind == "scale":
        text = f"{text} scale"
    if kind == "noun":
        if text.lower() in NOT_A_NAME:
            return True
    reference = stems(glossary()[symbol] + " " + SAME.get(symbol, ""))
    return bool(stems(text) & reference) or not stems(text)


def clashes(name: str, text: str) -> list[str]:
    found = []
    clean = prose(text)
    single = set(letters())
    for kind, pattern in DEFINITIONS:
        for m in pattern.finditer(clean):
            token = m["x"]
            symbol = base(token)
            if symbol is None or symbol not in single or token == "a":  # "a" is the article too
                continue
            if kind == "where" and m["m"].lstrip().startswith("="):
                continue  # 'where X = ...' is read by the '=' pattern
            if kind == "noun" and token not in glossary() and "_" not in token and len(token) > 1:
                continue
            if not agrees(symbol, m["m"], kind):
                line = clean.count("\n", 0, m.start()) + 1
                found.append(
                    f"{name}:{line}: {token} is {m['m'].strip()!r} here ({kind}); the glossary's {symbol} is "
                    f"{glossary()[symbol]!r}"
                )
    # table headers: a header cell that is a letter names a column by that letter
    for i, line in enumerate(clean.splitlines(), 1):
        if line.startswith("|") and i < len(clean.splitlines()) and clean.splitlines()[i].startswith("|---"):
            for cell in (c.strip() for c in line.strip("|").split("|")):
                parts = re.match(r"^(\S+) (?:=|\()(.*)$", cell)
                symbol = base(parts[1]) if parts else None
                if symbol in single and not agrees(symbol, parts[2], "where"):
                    found.append(
                        f"{name}:{i}: table header {cell!r}; the glossary's {symbol} is {glossary()[symbol]!r}"
                    )
    return found


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_no_chapter_gives_a_glossary_letter_another_meaning(chapter):
    found = clashes(chapter.name, chapter.read_text())
    assert not found, "a letter with two meanings (rename the chapter's use, or fix the glossary):\n" + "\n".join(found)


def test_the_lint_fails_on_a_letter_used_with_another_meaning():
    text = "The kernel recomputes the probabilities as p = exp(x − m), for scores s_j over the keys.\n"
    found = clashes("x.md", text)
    assert any(" p is " in f for f in found) and any(" s_j is " in f for f in found), found
    assert clashes("x.md", "Llama at s = 8,192 tokens and p = 4, where s is the sequence length.\n") == []
    assert any("K" in f for f in clashes("x.md", "Counts with K = 3 micro-batches.\n"))


def reading_order() -> list[str]:
    from tests.test_docs_structure import chapters

    return [name for _, name, _ in chapters()]


def first_met() -> dict[str, tuple[str, int, str]]:
    """Symbol -> (chapter file, section number, the cell) for every glossary row with a 'first met' link."""
    found = {}
    for line in glossary_text().splitlines():
        m = re.match(
            r"^\| (?P<symbols>[^|]+?) \|.*\[chapter \w+, (?:section (?P<section>\d+)|opening)\]\((?P<file>[\w.]+\.md)\) \|$",
            line,
        )
        if m:
            for symbol in re.split(r",\s*", m["symbols"]):
                found[symbol] = (m["file"], int(m["section"] or 0), line)
    return found


def section(text: str, number: int) -> str:
    """Section ``number`` of a chapter ('## N. ...'); 0 is its opening, before section 1."""
    if number == 0:
        return re.split(r"^## 1\. ", text, maxsplit=1, flags=re.M)[0]
    m = re.search(rf"^## {number}\. .*?(?=^## |\Z)", text, re.S | re.M)
    return "" if m is None else m.group(0)


def uses(text: str, symbol: str) -> bool:
    """The symbol stands in the prose as a letter of its own (not a word, not code)."""
    return re.search(rf"(?<![\w'’/-]){re.escape(symbol)}(?![\w'’/-])", prose(text)) is not None


def test_every_first_met_link_points_at_the_first_section_that_uses_the_letter():
    order = reading_order()
    wrong = []
    for symbol, (name, number, _) in first_met().items():
        text = (DOCS / name).read_text()
        if not uses(section(text, number), symbol):
            wrong.append(f"glossary: {symbol} is first met in {name} section {number}, which does not use it")
        defined_before = [
            earlier
            for earlier in order[: order.index(name)]
            if re.search(
                rf"<!-- symbols? [^>]*(?<![\w_]){re.escape(symbol)}(?![\w_])[^>]*-->", (DOCS / earlier).read_text()
            )
        ]
        if defined_before:
            wrong.append(f"glossary: {symbol} is first met in {name}, but {defined_before[0]} defines it earlier")
    assert not wrong, "\n".join(wrong)


def test_every_symbol_table_row_says_where_it_is_first_met():
    """The glossary's model-size table names the section each letter is first met in; a row without it fails."""
    table = glossary_text().split("## Sizes of the model and the batch")[1].split("\n## ")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| symbol")]
    missing = [row.split("|")[1].strip() for row in rows if not re.search(r"section|opening", row.split("|")[-2])]
    assert not missing, f"glossary rows without the section they are first met in: {missing}"
