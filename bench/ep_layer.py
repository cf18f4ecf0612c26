"""One expert-parallel MoE block against the single-device block: rows per rank and the differences.

    python -m bench.ep_layer        # docs/expert_parallel.md, Appendix G (about 15 s)

The measurement, and what it counts and why: measure/ep_layer.py. This file prints it.
"""

from __future__ import annotations

from measure.ep_layer import ep_layer_vs_single_device


def main() -> None:
    from launch.spawn import run_on_ranks

    keys = ("out", "input_grad", "router_grad", "expert_grad")
    print(f"{'ep':>2} {'routing':<18} {'rows received per rank':<24} " + " ".join(f"{k:>12}" for k in keys))
    for ep in (2, 4):
        for starve in (False, True):
            results = run_on_ranks(ep_layer_vs_single_device, ep, ep, starve)
            received = " / ".join(str(r["received"]) for r in results)
            worst = [max(r[k] for r in results) for k in keys]
            name = "one rank gets all" if starve else "spread"
            print(f"{ep:>2} {name:<18} {received:<24} " + " ".join(f"{w:>12.1e}" for w in worst))


if __name__ == "__main__":
    main()
