"""Every config key and every entry point's option, walked with the boundary values of its type.

Generated from the schema (runtime/config.py's dataclasses) and the entry points' argparse parsers, so a key or
an option added later is walked too. Each value must either be refused naming the key (exit 2, no traceback,
before any process group) or be a value the run can use (``type_problem`` finds nothing, the range holds).
Runs in this process: the parsers and ``train.main --dry-run`` take milliseconds per case.
"""

import argparse
import contextlib
import dataclasses
import functools
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import train
from launch.local_runs import ROOT
from runtime.config import _in_range, load_config, type_problem
from runtime.schema import FIELD_KEYS, Config

# Boundary values of every type: empty, blank, huge, tiny, nan/inf, non-ASCII digits, negative zero, a NUL.
BOUNDARY = [
    "",
    " ",
    "\t",
    "99999999999999999999999",
    "-99999999999999999999999",
    "9223372036854775808",
    "1e400",
    "-1e400",
    "1e-400",
    "1e-50",
    "1e39",
    "nan",
    "inf",
    "-inf",
    "١٢",
    "٣.٥",
    "1_000",
    "²",
    "-0",
    "-0.0",
    "0",
    "-1",
    "a\x00b",
]


def config_keys() -> list[str]:
    keys = []
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(
            section.type if isinstance(section.type, type) else getattr(Config(), section.name)
        ):
            keys.append(FIELD_KEYS.get(f"{section.name}.{f.name}", f"{section.name}.{f.name}"))
    return keys


def field_of(cfg: Config, key: str):
    section, name = key.split(".")
    name = {"async": "async_"}.get(name, name)
    f = {f.name: f for f in dataclasses.fields(getattr(cfg, section))}[name]
    return getattr(getattr(cfg, section), name), f.metadata


def dry_run(*args: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = train.main(["--dry-run", "--world-size", "1", *args])
    return code, err.getvalue()


def test_the_walk_covers_every_key():
    keys = config_keys()
    assert len(keys) > 80 and "training.seed" in keys and "checkpoint.async" in keys and "run.dir" in keys


@pytest.mark.parametrize("key", config_keys())
def test_every_config_key_refuses_what_it_cannot_use_naming_the_key(key):
    for value in BOUNDARY:
        code, err = dry_run(f"--{key}", value)
        assert not dist.is_initialized()
        assert "Traceback" not in err
        if code == 2:
            last = err.strip().splitlines()
            assert any(key in line for line in last), (key, value, err)
            continue
        assert code == 0, (key, value, code, err)
        used, meta = field_of(load_config([f"--{key}", value]), key)
        assert type_problem(used, meta) is None, (key, value, used)
        if isinstance(used, (int, float)) and not isinstance(used, bool):
            assert _in_range(used, meta), (key, value, used)
        if isinstance(used, float):
            assert str(used) != "-0.0", (key, value)


def tools() -> list[str]:
    """Every ``python -m`` command of the project: each module with a ``__main__`` block, and each package with a
    ``__main__.py`` (docs.figures), found from the files, so a tool added later is walked too. train.py's options
    are the config keys, walked above; tests/ and examples/ are no tools."""
    found = []
    for path in sorted(ROOT.glob("[!.]*/**/*.py")) + sorted(ROOT.glob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", "examples") or rel == Path("train.py"):
            continue
        if path.name == "__main__.py":
            found.append(".".join(rel.parent.parts))
        elif 'if __name__ == "__main__"' in path.read_text():
            found.append(".".join(rel.with_suffix("").parts))
    return found


def with_subcommands(name: str, parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``parser`` and each of its subcommands' parsers (``docs.figures mesh``), each walked on its own."""
    found = {name: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                found.update(with_subcommands(f"{name} {sub_name}", sub))
    return found


@functools.cache
def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every tool's parser, through its module's ``build_parser``, and each of its subcommands'."""
    import importlib

    found = {}
    for name in tools():
        found.update(with_subcommands(name, importlib.import_module(name).build_parser()))
    return found


def test_every_tool_is_walked():
    """A tool without ``build_parser`` fails the walk (AttributeError names it) instead of being skipped."""
    names = tools()
    readme = ["data.prepare", "generate", "checkpoint.export", "cluster.plan_layout", "launch.supervise"]
    assert {*readme, "docs.figures", "docs.unmarked", "measure.gpu_check", "measure.tokens_per_second"} <= set(names)
    assert len([n for n in names if n.startswith("measure.")]) > 25
    assert {"docs.figures mesh", "docs.figures pipeline", *names} <= set(parsers())


@pytest.mark.parametrize(
    "entry",
    # launch.supervise is left out: everything after its own options is the command it runs
    [e for e, p in sorted(parsers().items()) if all(a.nargs != argparse.REMAINDER for a in p._actions)],
)
def test_every_entry_point_refuses_an_unknown_option_naming_it(entry):
    """Each tool's parser refuses what it does not know (the measurements took none, and ignored any)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        parser = parsers()[entry]
        parser.parse_args([*required_args(parser, ""), "--no-such-option"])
    assert exc.value.code == 2
    assert "--no-such-option" in err.getvalue().strip().splitlines()[-1]


def options() -> list[tuple[str, str]]:
    found = []
    for name, parser in parsers().items():
        for action in parser._actions:
            if action.option_strings and action.nargs != 0 and action.dest != "help":
                found.append((name, action.option_strings[0]))
    return found


def required_args(parser: argparse.ArgumentParser, skip: str) -> list[str]:
    args = []
    for action in parser._actions:
        if action.required and not action.option_strings:  # a positional (training.comm_share's run_dir)
            args.insert(0, next(iter(action.choices)) if action.choices else "x")
        elif action.required and action.option_strings[0] != skip:
            args += [action.option_strings[0], "x"]
    return args


def test_every_option_has_a_checked_type_or_choices():
    for name, option in options():
        action = next(a for a in parsers()[name]._actions if option in a.option_strings)
        assert action.choices or hasattr(action.type, "rules"), f"{name} {option}: no checked type (runtime/options.py)"


@pytest.mark.parametrize("entry, option", options(), ids=[f"{e} {o}" for e, o in options()])
def test_every_entry_point_option_refuses_what_it_cannot_use_naming_the_option(entry, option):
    parser = parsers()[entry]
    action = next(a for a in parser._actions if option in a.option_strings)
    for value in BOUNDARY:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                opts = parser.parse_args([*required_args(parser, option), option, value])
            except SystemExit as exc:
                assert exc.code == 2, (entry, option, value)
                assert f"argument {option}" in err.getvalue() or option in err.getvalue(), err.getvalue()
                continue
        used = getattr(opts, action.dest)
        rules = getattr(action.type, "rules", {})
        assert type_problem(used, rules) is None, (entry, option, value, used)
        if isinstance(used, (int, float)):
            assert _in_range(used, rules), (entry, option, value, used)


@pytest.mark.parametrize(
    "args, key",
    [(["--training.seed", "99999999999999999999999"], "training.seed"), (["--run.dir", ""], "run.dir")],
    ids=["huge-seed", "empty-run-dir"],
)
def test_the_named_cases_exit_2_on_the_real_command_line(args, key, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/debug.toml"), *args],
        cwd=tmp_path if key == "run.dir" else ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert key in proc.stderr.strip().splitlines()[-1]
    if key == "run.dir":
        assert list(tmp_path.iterdir()) == []  # nothing written into the current folder
