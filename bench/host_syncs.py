"""Host syncs, counted: every op that makes the host wait for the device, per training step and layout, and why.

    python -m bench.host_syncs            # about a minute on 2 cores; tests/test_host_syncs.py asserts the same

The measurement, and what it counts and why: measure/host_syncs.py. This file prints it.
"""

from __future__ import annotations

import argparse
import json

from measure.host_syncs import (
    LAYOUTS,
    REASONS,
    device_syncs,
    measure,
)


def main(argv: list[str] | None = None) -> dict:
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m bench.host_syncs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names from LAYOUTS")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args.layouts.split(","), tmp)
    if args.json:
        print(json.dumps(result, indent=1))
        return result
    print("host syncs in one training step, per rank (debug model, 2 layers); * = waits for the device on a GPU")
    for name, ranks in result.items():
        totals = ", ".join(f"rank {r}: {sum(c.values())} ({device_syncs(c)}*)" for r, c in enumerate(ranks))
        print(f"{name}: {totals}")
        for rank, counts in enumerate(ranks):
            for site, n in counts.items():
                star = "*" if REASONS.get(site, (True,))[0] else " "
                print(f"    rank {rank}  {n:3d}{star} {site}")
    print("why each is there:")
    for site, (waits, why) in REASONS.items():
        print(f"  {site}{' *' if waits else ''}: {why}")
    return result


if __name__ == "__main__":
    main()
