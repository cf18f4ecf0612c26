"""train.py's command line: one parser for its three modes, a run, a dry run and a simulation.

    [torchrun ...] train.py [--config F] [--section.key value ...]                      a run
    train.py --dry-run --world-size N [--config F] [--section.key value ...]            check a launch
    train.py --simulate --world-size N [--pp-ranks 0,15] [--simulate-out F] [...]        measure one

A dry run and a simulation plan for the machine the run will use, not the one they run on: ``--device-kind
cuda|cpu`` (default: ``training.device`` when the config names one, else cuda) is the device kind
``training.mixed_precision = auto`` resolves for (bf16 on cuda, fp32 on cpu), and their banner says which.

1. ``parse_command_line`` takes the mode's own flags (``MODE_FLAGS``) out of argv. Each may be given once, as
   ``--flag value`` or ``--flag=value``; a repeat is refused as a repeated config key is (which one did you
   mean?), so is a value-taking flag with no value, and a flag that belongs to another mode names the mode.
2. Each value is checked where it is parsed, before anything is read or built: the world size a positive
   integer in ASCII digits within int32 (torch's ranks are int32), the pipeline ranks such integers, the routing
   one the simulation knows, the output path one that can be written (its folder exists).
3. The rest is the run's own ``[--config F] [--section.key value ...]``, which ``load_config``
   (runtime/config.py) reads the same way in every mode.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from runtime.config import ConfigError, parse_int

DRY_RUN, SIMULATE = "--dry-run", "--simulate"
WORLD_SIZE, PP_RANKS, OUT, ROUTING = "--world-size", "--pp-ranks", "--simulate-out", "--simulate-routing"
DEVICE_KIND = "--device-kind"
# flag -> (takes a value, the modes it goes with)
MODE_FLAGS = {
    DRY_RUN: (False, ("dry-run",)),
    SIMULATE: (False, ("simulate",)),
    WORLD_SIZE: (True, ("dry-run", "simulate")),
    PP_RANKS: (True, ("simulate",)),
    OUT: (True, ("simulate",)),
    ROUTING: (True, ("simulate",)),
    DEVICE_KIND: (True, ("dry-run", "simulate")),
}
ROUTINGS = ("balanced",)
DEVICE_KINDS = ("cuda", "cpu")
MAX_WORLD = 2**31 - 1  # ranks are int32 in torch.distributed


@dataclass(frozen=True)
class CommandLine:
    mode: str  # "train" | "dry-run" | "simulate"
    world_size: int = 1  # the ranks a dry run or a simulation plans for (a run takes torchrun's)
    pp_ranks: list[int] | None = None  # the pipeline ranks to simulate (None: every one)
    out: str | None = None  # the simulation's JSON report
    routing: str = "balanced"  # how the simulation routes MoE tokens
    config_args: list[str] = field(default_factory=list)  # [--config F] [--section.key value ...]
    device_kind: str | None = None  # --device-kind as given (None: not given; ``target_device`` decides)

    def target_device(self, configured: str = "auto") -> str:
        return planned_device(self.device_kind, configured)


def planned_device(given: str | None, configured: str = "auto") -> str:
    """The device kind a dry run or a simulation plans for: ``--device-kind`` (``given``), else ``training.device``
    (``configured``) when it names one, else cuda, the machine a planned run is launched on. A flag that contradicts
    the config is refused (which one did you mean?)."""
    if given is not None and configured != "auto" and configured != given:
        raise ConfigError(
            f"{DEVICE_KIND} {given} contradicts training.device={configured!r}; drop one, or make them the same."
        )
    return given or (configured if configured != "auto" else "cuda")


def parse_command_line(argv: list[str]) -> CommandLine:
    """Steps 1-3 of the module docstring; a ConfigError naming the flag, the value and the fix."""
    given, rest, i = {}, [], 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, value = arg.partition("=")
        if flag not in MODE_FLAGS:
            rest.append(arg)
            i += 1
            continue
        takes_value, _ = MODE_FLAGS[flag]
        if flag in given:
            raise ConfigError(f"{flag} is given twice on the command line; give it once.")
        if takes_value and not eq:
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
            i += 1 if value is not None else 0
            if value is None:
                raise ConfigError(f"{flag} needs a value, e.g. {flag} {example(flag)}.")
        elif not takes_value and eq:
            raise ConfigError(f"{flag} takes no value; write {flag} alone.")
        given[flag] = value
        i += 1
    mode = mode_of(given)
    for flag in given:
        if mode not in MODE_FLAGS[flag][1]:
            needed = " or ".join(f"--{m}" for m in MODE_FLAGS[flag][1])
            raise ConfigError(f"{flag} only goes with {needed} (torchrun sets the world size of a real run).")
    if mode == "train":
        return CommandLine("train", config_args=rest)
    return CommandLine(
        mode,
        world_size=world_size(given.get(WORLD_SIZE), mode),
        pp_ranks=pp_ranks(given[PP_RANKS]) if PP_RANKS in given else None,
        out=out_path(given[OUT]) if OUT in given else None,
        routing=routing(given.get(ROUTING, "balanced")),
        config_args=rest,
        device_kind=device_kind(given[DEVICE_KIND]) if DEVICE_KIND in given else None,
    )


def example(flag: str) -> str:
    return {WORLD_SIZE: "16", PP_RANKS: "0,15", OUT: "sim.json", ROUTING: "balanced", DEVICE_KIND: "cuda"}[flag]


def mode_of(given: dict) -> str:
    if DRY_RUN in given and SIMULATE in given:
        raise ConfigError(f"{SIMULATE} and {DRY_RUN}: choose one (the simulation includes the dry run's checks).")
    return "dry-run" if DRY_RUN in given else "simulate" if SIMULATE in given else "train"


def world_size(text: str | None, mode: str) -> int:
    """Step 2: the ranks to plan for (a dry run defaults to 1; a simulation needs it)."""
    if text is None and mode == "dry-run":
        return 1
    value = parse_int(text or "")
    if value is None or text.strip()[:1] in "+-" or not 1 <= value <= MAX_WORLD:
        what = "the number of ranks to simulate" if mode == "simulate" else "the number of ranks to plan for"
        raise ConfigError(
            f"{WORLD_SIZE} {text!r}: give {what}, a whole number from 1 to {MAX_WORLD:,} in ASCII digits, e.g. "
            f"{WORLD_SIZE} 1024."
        )
    return value


def pp_ranks(text: str) -> list[int]:
    parts = [parse_int(p) for p in text.split(",")]
    if not text or any(p is None or p < 0 or p > MAX_WORLD for p in parts):
        raise ConfigError(f"{PP_RANKS} {text!r}: give pipeline ranks separated by commas, e.g. {PP_RANKS} 0,15.")
    return sorted(set(parts))


def out_path(text: str) -> str:
    """Step 2: a path the report can be written to, checked before the simulation runs (it takes minutes)."""
    folder = Path(text).parent
    if not text.strip() or Path(text).is_dir():
        raise ConfigError(f"{OUT} {text!r}: give the path of a JSON file to write, e.g. {OUT} sim.json.")
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ConfigError(
            f"{OUT} {text!r}: the folder {str(folder)!r} does not exist or is not writable; create it or write the "
            "report elsewhere."
        )
    return text


def routing(text: str) -> str:
    if text not in ROUTINGS:
        raise ConfigError(
            f"{ROUTING} {text!r}: the simulation can route MoE tokens {', '.join(ROUTINGS)} only "
            "(real routing needs real numbers: the split sizes are read on the host)."
        )
    return text


def first_run_args(config_args: list[str], steps: int) -> list[str]:
    """``python train.py`` with no --config (the embedded default, README's first command) saves once, after its last
    step, so that the run it ends can be sampled and exported (``next_commands``); a given --checkpoint.interval or
    a --config file decides for itself."""
    given = {arg.split("=", 1)[0] for arg in config_args if arg.startswith("--")}
    if "--config" in given or "--checkpoint.interval" in given:
        return config_args
    return [*config_args, "--checkpoint.interval", str(steps)]


def next_commands(checkpoints: str | Path, run_dir: str | Path) -> str:
    """What to do with the checkpoints a run saved: the command that samples from them and the one that exports them."""
    import shlex

    folder, out = shlex.quote(str(checkpoints)), shlex.quote(str(Path(run_dir) / "hf"))
    return (
        f"sample from it:  python -m generate --checkpoint {folder} --prompt 'def ' --max-new-tokens 100\n"
        f"export it:       python -m checkpoint.export --checkpoint {folder} --out {out}"
    )


def device_kind(text: str) -> str:
    if text not in DEVICE_KINDS:
        raise ConfigError(
            f"{DEVICE_KIND} {text!r}: plan for {' or '.join(DEVICE_KINDS)} (the device kind the run will use; "
            f"training.mixed_precision=auto is bf16 on cuda, fp32 on cpu), e.g. {DEVICE_KIND} cuda."
        )
    return text
