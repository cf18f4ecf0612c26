"""How long the training thread stands still per checkpoint save: a synchronous save against an async one.

    python -m bench.async_save                  # one process, an 18M-parameter model (1-2 minutes on 2 cores)
    python -m bench.async_save --world 2        # fsdp2 on 2 ranks
    python -m bench.async_save --gpu            # on a GPU, a 160M-parameter model (pinned staging, a side stream)

The measurement, and what it counts and why: measure/async_save.py. This file prints it.
"""

from __future__ import annotations

import argparse

from measure.async_save import measure


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.async_save", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=1, help="ranks (fsdp over all of them)")
    parser.add_argument("--steps", type=int, default=7, help="steps per run (the last step always saves)")
    parser.add_argument("--interval", type=int, default=2, help="save every N steps")
    parser.add_argument("--gpu", action="store_true", help="train on cuda (one GPU per rank)")
    args = parser.parse_args(argv)
    r = measure(args.world, args.steps, args.interval, args.gpu)
    print(
        f"{'gpu' if args.gpu else 'cpu'}, world {args.world}: {r['state_bytes'] / 2**20:,.0f} MiB of fp32 weights "
        f"and Adam moments per save (whole model), a save every {args.interval} of {args.steps} steps"
    )
    for mode in ("sync", "async"):
        m = r[mode]
        stalls = ", ".join(f"{s:.3f}" for s in m["stalls_s"])
        print(
            f"  {mode:<5}: stall per save {m['stall_s']:.3f} s (saves before the last: {stalls}); "
            f"waiting for the last save at the end {m['finish_s']:.3f} s; step {m['step_s']:.2f} s"
        )
    print(f"training-thread stall per save, sync / async: {r['ratio']:.1f}x")
    return r


if __name__ == "__main__":
    main()
