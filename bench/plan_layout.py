"""The layout planner's command at its first name, and the one measurement beside it.

    python -m bench.plan_layout ...        # the planner: planning/plan_layout.py (every option it takes)
    python -m bench.plan_layout --ac       # measure what activation checkpointing keeps (CPU)

The planner is arithmetic and lives in the planning room (planning/plan_layout.py, with its time model
planning/step_time.py and the check against published runs planning/published_runs.py). ``--ac`` is a
measurement, so it stays a bench: it runs one block on CPU in fp32 and prints the bytes each
``training.activation_checkpoint`` mode keeps from forward for backward (``kept_bytes``).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from measure.saved_bytes import kept_bytes
from planning.plan_layout import main as plan

if TYPE_CHECKING:
    pass


def main_ac() -> None:
    from measure.activation_memory import BATCH, BENCH_ARGS, SEQ

    a = BENCH_ARGS
    bsh = 4 * BATCH * SEQ * a.dim
    print(
        f"one TransformerBlock, fp32, CPU: b={BATCH} s={SEQ} h={a.dim} H={a.hidden_dim} heads={a.n_heads}; "
        f"4·bsh = {bsh:,} bytes"
    )
    print(f"{'training.activation_checkpoint':<31} {'bytes kept':>11} {'/ 4·bsh':>8} {'/ none':>7}")
    none = None
    for mode in ("none", "selective", "full"):
        kept = kept_bytes(a, BATCH, SEQ, mode)
        none = none or kept
        print(f"{mode:<31} {kept:>11,} {kept / bsh:>8.2f} {kept / none:>7.3f}")


def main() -> None:
    if "--ac" in sys.argv[1:]:
        main_ac()
        return
    plan()


if __name__ == "__main__":
    main()
