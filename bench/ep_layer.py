"""One expert-parallel MoE block against the single-device block: rows per rank and the differences.

    python -m bench.ep_layer        # docs/expert_parallel.md, section 12 (about 15 s)

Runs tests/test_expert_parallel.py's layer comparison (8 experts, top-2, a shared expert; each rank routes its
own 12 tokens) on ep = 2 and 4 gloo ranks, with routing spread out and with every token forced onto rank 0's
experts, and prints what the test only bounds: how many rows each rank's experts received, and the largest
absolute differences from one device processing every rank's tokens.
"""

from __future__ import annotations


def main() -> None:
    from tests.harness import run_on_ranks
    from tests.test_expert_parallel import ep_layer_vs_single_device

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
