"""train.py, with rank 0 pausing after a checkpoint is fully written and before it is published.

    PAUSE_BEFORE_PUBLISH=STEP:SECONDS python tests/pause_before_publish.py ARGS   # or as torchrun's script

So a test can kill or signal a run in the middle of a save (tests/test_checkpoint.py, tests/test_faults.py)
without the library carrying a hook for it: in the one process it starts, this wraps ``os.rename`` so that
publishing ``step-STEP.tmp`` (checkpoint/manager.py: ``_publish``, the atomic rename onto ``step-STEP``) first
prints a line and sleeps SECONDS; then it runs train.py as ``__main__``.
"""

import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = "PAUSE_BEFORE_PUBLISH"


def pause_before_publishing(step: str, seconds: float) -> None:
    rename = os.rename

    def paused_rename(src, dst, *args, **kwargs):
        if Path(src).name == f"step-{step}.tmp":
            print(f"checkpoint: {src} written, pausing {seconds:g} s before publishing ({ENV})", flush=True)
            time.sleep(seconds)
        return rename(src, dst, *args, **kwargs)

    os.rename = paused_rename


if __name__ == "__main__":
    step, _, seconds = os.environ.get(ENV, "").partition(":")
    if step:
        pause_before_publishing(step, float(seconds))
    sys.path.insert(0, str(ROOT))
    sys.argv[0] = str(ROOT / "train.py")
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
