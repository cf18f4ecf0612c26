"""Every chapter has a short core, and README's reading times follow from the chapters' sizes.

1. **Core and appendix.** A chapter's *core* is everything from the top of the file up to the first line that
   starts with ``## Appendix``; its *appendix* is everything from there on (it may hold several
   ``## Appendix ...`` sections). The core carries the concept, one picture, the formulas and one worked
   example; test names, code pointers, CPU caveats, evidence tables, long proofs and command transcripts go to
   the appendix. *Words* are the whitespace-separated tokens left after removing fenced code blocks
   (```` ``` ... ``` ````) and HTML comments (``<!-- ... -->``); tables and prose count.
   The core of every chapter in README's table holds at most ``CORE_LIMIT`` words (``pytest -s`` prints the
   counts).
2. **Time budgets.** README's time for a chapter is

       core words / READ_WPM  +  appendix words / SKIM_WPM  +  the chapter's commands  +  its exercises

   rounded to 5 minutes (README may keep the other neighbour while the estimate is within a minute of
   halfway). The commands' minutes stand in ``COMMAND_MIN`` below, each with where its
   duration comes from; the word counts and the exercises (the numbered items of the chapter's exercises
   section, ``EXERCISE_MIN`` each) are read from the chapter, so a chapter that grows or shrinks fails this
   test until README's time follows.
"""

from __future__ import annotations

import re

import pytest

from launch.local_runs import ROOT

README = ROOT / "README.md"
CORE_LIMIT = 3000
READ_WPM = 150  # careful reading of technical prose with formulas
SKIM_WPM = 600  # the appendix is looked up, not read: test names, pointers, transcripts
EXERCISE_MIN = 10  # one exercise: predict (on paper), run its command, compare with the hidden answer
ROUND_MIN = 5  # README's times are multiples of this: an estimate, not a promise to the minute

# chapter file -> minutes of the commands the chapter asks the reader to run (its "Reproduce" block, its inline
# commands), as the chapter or README states their durations on 2 CPU cores, or as timed for this table. The
# 15-minute full bench of chapter 2 is not counted (the chapter offers `--steps 100`), nor are GPU-only commands.
COMMAND_MIN = {
    "00_foundations.md": 5,  # ~10 examples/*.py under torchrun, seconds each; tests/test_examples.py about 40 s
    "data_parallel.md": 5,  # measure.fsdp_memory about 25 s, memory_table seconds, 3 from-scratch scripts, the tests
    "dp_savers.md": 8,  # measure.grad_sync_memory about a minute, grad_compression --steps 100 a few, the tests
    "tensor_parallel.md": 4,  # measure.activation_memory about 15 s, tp_from_scratch, the listed tests
    "pipeline_parallel.md": 8,  # scale-grads ~40 s, pipeline_bubble pp 4 78 s and pp 2, figures, 2 train runs, tests
    "expert_parallel.md": 5,  # ep_layer ~30 s, moe_grouped_mm ~30 s, moe_load ~1 min, moe_capacity ~30 s, the tests
    "context_parallel.md": 5,  # measure.context_parallel 10-45 s, ring_attention ~1 min, the tests, the sketch
    "mixed_precision.md": 4,  # mixed_precision_fp16 about 4 s, plan_layout --ac, two 20-step bf16/fp32 runs
    "combining.md": 3,  # the planner's and the logits bench's commands, seconds each
    "checkpointing.md": 5,  # save and resume runs on 2-4 ranks, tens of seconds each
    "profiling.md": 5,  # a profiled run and its trace, a memory snapshot
    "troubleshooting.md": 5,  # the fault-injection and restart runs, tens of seconds each
    "data.md": 5,  # train_tokenizer and prepare (seconds), two short training runs, generate, export
}

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
COMMENT = re.compile(r"<!--.*?-->", re.S)
ROW = re.compile(
    r"^\| *(?P<number>\w+) *\| *\[[^\]]*\]\(docs/(?P<file>[\w.]+\.md)\).*\| *(?P<minutes>\d+) min *\|$", re.M
)


def split(text: str) -> tuple[str, str]:
    """(core, appendix): the cut is the first line that starts with '## Appendix'."""
    m = re.search(r"^## Appendix", text, re.M)
    return (text, "") if m is None else (text[: m.start()], text[m.start() :])


def words(text: str) -> int:
    return len(COMMENT.sub("", FENCE.sub("", text)).split())


def chapters() -> list[tuple[str, str, int]]:
    """(number, file, README minutes) for every row of README's chapter table."""
    readme = README.read_text()
    return [(m["number"], m["file"], int(m["minutes"])) for m in ROW.finditer(readme[readme.index("## Start here") :])]


def counts(name: str) -> tuple[int, int]:
    core, appendix = split((ROOT / "docs" / name).read_text())
    return words(core), words(appendix)


def exercises(text: str) -> int:
    """The numbered items of the chapter's exercises section (a '## ... Exercises' heading, core or appendix)."""
    m = re.search(r"^## [^\n]*[Ee]xercises[^\n]*\n(.*?)(?=^## |\Z)", FENCE.sub("", text), re.S | re.M)
    return 0 if m is None else len(re.findall(r"^\d+\. ", m.group(1), re.M))


def minutes(name: str) -> float:
    core, appendix = counts(name)
    text = (ROOT / "docs" / name).read_text()
    return core / READ_WPM + appendix / SKIM_WPM + COMMAND_MIN[name] + exercises(text) * EXERCISE_MIN


def budget(name: str) -> int:
    return max(ROUND_MIN, ROUND_MIN * round(minutes(name) / ROUND_MIN))


def fits(listed: int, name: str) -> bool:
    """Whether README may list ``listed`` minutes for chapter ``name``: a multiple of 5 within 3.5 minutes of the
    estimate (the nearest multiple, or the other neighbour while the estimate is within a minute of halfway)."""
    return listed % ROUND_MIN == 0 and abs(listed - minutes(name)) <= 3.5


def test_the_word_count_skips_code_and_comments_and_cuts_at_the_first_appendix():
    text = "one two\n```\nthree four\n```\nfive <!-- six\nseven --> eight\n## Appendix A\nnine\n## Appendix B\nten\n"
    core, appendix = split(text)
    assert words(core) == 4 and words(appendix) == 8  # "## Appendix A nine ## Appendix B ten"
    assert split("a line that mentions ## Appendix in passing\n")[1] == ""  # the cut needs it at a line start


def test_every_chapter_core_is_short():
    rows = chapters()
    assert len(rows) == 13, f"README's chapter table lists {len(rows)} chapters, expected 0-11 and A"
    print(f"\n{'#':>2} {'chapter':24} {'core':>6} {'appendix':>8} {'exercises':>9} {'minutes':>7} {'budget':>6}")
    offenders = []
    for number, name, _ in rows:
        core, appendix = counts(name)
        n = exercises((ROOT / "docs" / name).read_text())
        print(f"{number:>2} {name:24} {core:6d} {appendix:8d} {n:9d} {minutes(name):7.1f} {budget(name):4d} min")
        if core > CORE_LIMIT:
            offenders.append(f"{name}: core {core} words > {CORE_LIMIT} (move detail into an '## Appendix' section)")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("name", sorted(COMMAND_MIN))
def test_readme_time_follows_from_the_word_counts(name):
    """README's time is a multiple of 5 within 3.5 minutes of the estimate: the nearest multiple, or the other
    neighbour when the estimate lies within a minute of halfway, so that a sentence more or less does not flip
    the table back and forth."""
    listed = {file: minutes for _, file, minutes in chapters()}
    core, appendix = counts(name)
    assert fits(listed[name], name), (
        f"README gives {name} {listed[name]} min; {core} core words / {READ_WPM} + {appendix} appendix words / "
        f"{SKIM_WPM} + {COMMAND_MIN[name]} min of commands + {EXERCISE_MIN} min per exercise give {minutes(name):.1f}, "
        f"{budget(name)} min rounded: update README's table"
    )


def test_every_chapter_has_its_commands_timed_and_its_exercises_counted():
    assert {file for _, file, _ in chapters()} == set(COMMAND_MIN)
    assert exercises("## 5. Exercises\n\n1. a\n   ```\n   2. not an item\n   ```\n2. b\n## Appendix\n3. c\n") == 2


TEST_NAME = re.compile(r"(?<![/\w])test_\w+(?![\w.])")


def cited_tests(core: str) -> list[str]:
    """The test names a chapter core cites (code blocks and comments aside): they belong in the appendix."""
    return TEST_NAME.findall(COMMENT.sub("", FENCE.sub("", core)))


def test_no_chapter_core_cites_a_test_by_name():
    offenders = {}
    for _, name, _ in chapters():
        core, _ = split((ROOT / "docs" / name).read_text())
        if found := cited_tests(core):
            offenders[name] = found
    assert not offenders, f"test names in chapter cores (move them to an appendix): {offenders}"
    assert cited_tests("see `tests/test_x.py::test_y` (and `tests/test_x.py`)\n") == ["test_y"]


# A parenthetical: '(' after a space or a line start, holding words (not a formula's brackets).
PAREN = re.compile(r"(?:(?<=\s)|^)\(([^()]*(?:\([^()]*\)[^()]*)*)\)", re.M)
# Chapters whose cores still hold sentences with three parentheticals or more: the count may only fall. A chapter
# not listed allows none.
PAREN_ALLOWANCE = {
    "00_foundations.md": 1,
    "data_parallel.md": 3,
    "dp_savers.md": 5,
    "tensor_parallel.md": 5,
    "pipeline_parallel.md": 3,
    "expert_parallel.md": 3,
    "mixed_precision.md": 12,
    "combining.md": 8,
    "checkpointing.md": 3,
    "profiling.md": 3,
    "troubleshooting.md": 1,
    "data.md": 6,
}


def crowded_sentences(core: str) -> list[str]:
    """Sentences of a core (code, comments, tables and inline code aside) with more than two parentheticals."""
    text = re.sub(r"`[^`\n]*`", "C", COMMENT.sub("", FENCE.sub("", core)))
    out = []
    for para in re.split(r"\n\s*\n", text):
        if para.lstrip().startswith(("|", "#", ">", "!")):
            continue
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z*(C])", " ".join(para.split())):
            words = [m for m in PAREN.findall(sentence) if re.search(r"[A-Za-z]{4,}", m)]
            if len(words) > 2:
                out.append(sentence)
    return out


def test_no_core_sentence_carries_more_than_two_parentheticals():
    over = {}
    for _, name, _ in chapters():
        core, _ = split((ROOT / "docs" / name).read_text())
        found = crowded_sentences(core)
        if len(found) > PAREN_ALLOWANCE.get(name, 0):
            over[name] = f"{len(found)} > {PAREN_ALLOWANCE.get(name, 0)}: " + " || ".join(s[:120] for s in found[:3])
    assert not over, "sentences to split (one parenthetical or two at most):\n" + "\n".join(
        f"{k}: {v}" for k, v in over.items()
    )
    assert len(crowded_sentences("A (one word) b (two words) c (three words) d.\n")) == 1
    assert crowded_sentences("A (one word) b (two words) and f(x) + (a + b).\n") == []
