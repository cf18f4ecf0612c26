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

from runtime.config import ConfigError, _in_range, _range_rule, load_config, parse_float, parse_int, type_problem


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


def count_option(**bounds):
    """A count (steps, rounds, sizes, ranks): an int within ``bounds`` (``ge``/``gt``, 1 or more unless they say
    otherwise) and at most 2**31 - 1, the largest that torch and the config's int32 fields take."""
    return int_option(**({"ge": 1} if not {"ge", "gt"} & bounds.keys() else {}), le=2**31 - 1, **bounds)


def float_option(**bounds):
    """A finite fp32 number in ASCII (-0 is 0) within ``bounds``."""
    return _checked("a number", parse_float, bounds)


def path_option(required: bool = True):
    """A file or folder path: never blank, no NUL byte; ``required=False`` lets '' mean none."""
    return _checked("a path", lambda text: text, {"path": "required" if required else "optional"})


def text_option(nonempty: bool = False):
    """Free text (a prompt, a token, a field name): no NUL byte; ``nonempty``: not blank either."""
    return _checked("text", lambda text: text, {"nonempty": True} if nonempty else {})


def list_option(choices=None, item=None):
    """Comma-separated items, each one of ``choices`` or each a value the checked type ``item`` accepts (e.g.
    ``int_option(ge=1)``); no empty item. Returns the text as given, which the tool splits at its commas."""
    kind = "a comma-separated list"

    def convert(text: str):
        problem = type_problem(text, {"nonempty": True})
        if problem:
            raise argparse.ArgumentTypeError(f"{text!r} {problem}")
        for part in text.split(","):
            if not part.strip():
                raise argparse.ArgumentTypeError(f"{text!r} has an empty item; write the items between commas")
            if choices is not None and part not in choices:
                raise argparse.ArgumentTypeError(
                    f"{part!r} is unknown; give a comma-separated list of {', '.join(choices)}"
                )
            if item is not None:
                try:
                    item(part)
                except argparse.ArgumentTypeError as err:
                    raise argparse.ArgumentTypeError(f"item {err}") from None
        return text

    convert.__name__ = kind
    convert.rules = {"kind": kind, "nonempty": True}
    return convert


def override_option():
    """One ``key=value`` config override (what train.py takes as ``--key value``), checked by the config's own
    reader (runtime/config.load_config): the key must exist and the value must fit it."""
    kind = "a key=value override"

    def convert(text: str):
        key, sep, value = text.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"{text!r} is not key=value; write e.g. training.seed=1")
        try:
            load_config([f"--{key}", value])
        except ConfigError as err:
            raise argparse.ArgumentTypeError(f"{text!r}: {str(err).strip().splitlines()[-1].strip(' -')}") from None
        return text

    convert.__name__ = kind
    convert.rules = {"kind": kind, "nonempty": True}
    return convert


# Ranks a measurement spawns on this one machine (gloo processes, or one GPU each): more would not fit one host.
MAX_LOCAL_RANKS = 64
