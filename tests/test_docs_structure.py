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

   rounded to the nearest 5 minutes. The commands' minutes and the exercises' count stand in ``WORK`` below,
   each with where its duration comes from; the word counts are measured here, so a chapter that grows or
   shrinks fails this test until README's time follows.
"""

from __future__ import annotations

import re

import pytest

from launch.local_runs import ROOT

README = ROOT / "README.md"
CORE_LIMIT = 3000
READ_WPM = 150  # careful reading of technical prose with formulas
SKIM_WPM = 600  # the appendix is looked up, not read: test names, pointers, transcripts
EXERCISE_MIN = 10  # one exercise: predict (on paper), run a command, compare with the hidden answer, read it

# chapter file -> (minutes of the chapter's commands, number of exercises). The minutes are the commands the
# chapter asks the reader to run (its "Reproduce" block or its inline commands), timed on 2 CPU cores or as
# the chapter states them; the 15-minute full bench of chapter 2 is not counted (the chapter offers
# `--steps 100`).
WORK = {
    "00_foundations.md": (5, 5),  # examples/*.py on 2 ranks, seconds each; tests/test_examples.py about 40 s
    "data_parallel.md": (4, 3),  # bench.fsdp_memory about 25 s; memory_table instant; the listed tests ~2 min
    "dp_savers.md": (4, 3),  # bench.grad_sync_memory about a minute; --links instant; --steps 100 ~1 min
    "tensor_parallel.md": (3, 3),  # bench.activation_memory about 15 s; the listed tests ~2 min
    "pipeline_parallel.md": (5, 4),  # pipeline_facts scale-grads about 40 s; two pipeline_bubble runs; figures
    "expert_parallel.md": (4, 3),  # ep_layer ~30 s, moe_grouped_mm ~30 s, moe_load ~1 min, the tests
    "context_parallel.md": (4, 3),  # bench.context_parallel 10-45 s, ring_attention ~1 min, the tests
    "mixed_precision.md": (3, 5),  # examples/loss_scaling and the format benches, seconds each; the tests
    "combining.md": (3, 3),  # the planner's commands, seconds each
    "checkpointing.md": (4, 3),  # save/resume runs on 2 ranks, tens of seconds each
    "profiling.md": (5, 3),  # a profiled run and its trace, a memory snapshot, minutes in all
    "troubleshooting.md": (5, 5),  # the fault-injection runs, tens of seconds each
    "data.md": (3, 4),  # data/prepare.py on a small corpus, the tokenizer and chat scripts, seconds each
}

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
COMMENT = re.compile(r"<!--.*?-->", re.S)
ROW = re.compile(r"^\| *(?P<number>\w+) *\| *\[[^\]]*\]\(docs/(?P<file>[\w.]+\.md)\).*\| *(?P<minutes>\d+) min *\|$", re.M)


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


def budget(name: str) -> int:
    core, appendix = counts(name)
    commands, exercises = WORK[name]
    minutes = core / READ_WPM + appendix / SKIM_WPM + commands + exercises * EXERCISE_MIN
    return max(5, 5 * round(minutes / 5))


def test_the_word_count_skips_code_and_comments_and_cuts_at_the_first_appendix():
    text = "one two\n```\nthree four\n```\nfive <!-- six\nseven --> eight\n## Appendix A\nnine\n## Appendix B\nten\n"
    core, appendix = split(text)
    assert words(core) == 4 and words(appendix) == 8  # "## Appendix A nine ## Appendix B ten"
    assert split("a line that mentions ## Appendix in passing\n")[1] == ""  # the cut needs it at a line start


def test_every_chapter_core_is_short():
    rows = chapters()
    assert len(rows) == 13, f"README's chapter table lists {len(rows)} chapters, expected 0-11 and A"
    print(f"\n{'#':>2} {'chapter':24} {'core':>6} {'appendix':>8} {'budget':>6}")
    offenders = []
    for number, name, _ in rows:
        core, appendix = counts(name)
        print(f"{number:>2} {name:24} {core:6d} {appendix:8d} {budget(name):4d} min")
        if core > CORE_LIMIT:
            offenders.append(f"{name}: core {core} words > {CORE_LIMIT} (move detail into an '## Appendix' section)")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("name", sorted(WORK))
def test_readme_time_follows_from_the_word_counts(name):
    listed = {file: minutes for _, file, minutes in chapters()}
    core, appendix = counts(name)
    assert listed[name] == budget(name), (
        f"README gives {name} {listed[name]} min; {core} core words / {READ_WPM} + {appendix} appendix words / "
        f"{SKIM_WPM} + commands and exercises {WORK[name]} give {budget(name)} min: update README's table"
    )


def test_every_chapter_has_its_work_listed():
    assert {file for _, file, _ in chapters()} == set(WORK)
