"""Checked ``argparse`` types for the entry points' options (data.prepare, generate, checkpoint.export, ...).

Each entry point's options meet the same limits as train.py's config keys (runtime/config.py: ``type_problem``):
numbers in ASCII digits, inside int64 / finite fp32 and their option's range; paths that are not blank. A value
that does not fit is refused by argparse itself, before anything is read or opened: exit 2 and
``error: argument --name: <value> <why>; <fix>``. Every type carries its rules in ``.rules`` so that a test can
walk every option of every parser (tests/test_input_walk.py), new options included.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from runtime.config import ConfigError, _in_range, _range_rule, parse_float, parse_int, type_problem


def file_in_the_way(path) -> Path | None:
    """The existing file (not a folder) among ``path`` and the folders above it, which makes ``path`` impossible
    to create as a folder; None when there is none."""
    for part in [Path(path), *Path(path).parents]:
        if part.exists() or part.is_symlink():
            return None if part.is_dir() else part
    return None


def check_out_folder(path, option: str) -> None:
    """An output folder must be creatable: refused naming ``option`` when a file stands where a folder must be."""
    blocker = file_in_the_way(path)
    if blocker is not None:
        what = "is a file" if blocker == Path(path) else f"lies under the file {blocker}"
        raise ConfigError(f"{option} {path} {what}, not a folder; pass a folder path.")


def _checked(kind: str, parse, rules: dict):
    def convert(text: str):
        value = parse(text)
        if value is None:
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind} (write it in ASCII digits, e.g. 8)")
        problem = type_problem(value, rules)
        if problem:
            raise argparse.ArgumentTypeError(f"{text!r} {problem}")
        rule = _range_rule(rules)
        if rule and not isinstance(value, str) and not _in_range(value, rules):
            raise argparse.ArgumentTypeError(f"{text!r} must be {rule}")
        return value

    convert.__name__ = kind  # argparse names the type in its own messages
    convert.rules = {"kind": kind, **rules}
    return convert


def int_option(**bounds):
    """An int in ASCII digits within int64 and ``bounds`` (``ge``/``gt``/``le``/``lt``)."""
    return _checked("an integer", parse_int, bounds)


def float_option(**bounds):
    """A finite fp32 number in ASCII (-0 is 0) within ``bounds``."""
    return _checked("a number", parse_float, bounds)


def path_option(required: bool = True):
    """A file or folder path: never blank, no NUL byte; ``required=False`` lets '' mean none."""
    return _checked("a path", lambda text: text, {"path": "required" if required else "optional"})


def text_option(nonempty: bool = False):
    """Free text (a prompt, a token, a field name): no NUL byte; ``nonempty``: not blank either."""
    return _checked("text", lambda text: text, {"nonempty": True} if nonempty else {})
