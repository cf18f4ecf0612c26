"""The cluster planner proposes exactly the layouts a run accepts: its search filters with the run's own rules.

For world sizes 8 to 1,024, a dense and an MoE model, the degrees the planner's search tries
(cluster/search.py: ``candidates``) are compared with the degrees a launch accepts, found independently: a
config with those degrees, resolved as every rank resolves it before any process group
(planning/plan.py: ``LayoutPlan.resolve``), over the same grid (tp within a node, cp up to 8, every pp up to the
layer count, every ep that divides the experts).
"""

from __future__ import annotations

import pytest

from cluster.search import CP_DEGREES, GPUS_PER_NODE, TP_DEGREES, candidates
from planning.plan import LayoutPlan
from runtime.config import ConfigError, load_config, model_args

# seq_len 48: cp 8 and tp 4 leave 6 tokens per cp rank, which sequence parallelism cannot split in 4, so the rules
# refuse some points of the grid; 12 heads and a vocabulary of 1,000 refuse tp 8.
DENSE = {"model.dim": 96, "model.n_layers": 4, "model.n_heads": 12, "model.n_kv_heads": 4, "model.vocab_size": 1000}
MOE = {**DENSE, "model.n_experts": 8, "model.top_k": 2}
SEQ_LEN = 48


def accepted_by_the_run(model: dict, world: int) -> set[tuple[int, int, int, int]]:
    """(tp, cp, pp, ep) whose config a launch on ``world`` ranks accepts."""
    n_layers, experts = model["model.n_layers"], model.get("model.n_experts", 1)
    found = set()
    for tp in [t for t in TP_DEGREES if t <= min(GPUS_PER_NODE, world)]:
        for cp in CP_DEGREES:
            for pp in range(1, n_layers + 1):
                if world % (tp * cp * pp):
                    continue
                for ep in [e for e in range(1, experts + 1) if experts % e == 0]:
                    degrees = {"parallel.tp": tp, "parallel.cp": cp, "parallel.pp": pp, "parallel.ep": ep}
                    batch = {"training.global_batch": world, "training.seq_len": SEQ_LEN}
                    cfg = load_config(overrides={**model, **degrees, **batch, "training.mixed_precision": "bf16"})
                    try:
                        LayoutPlan.resolve(cfg, world)
                    except ConfigError:
                        continue
                    found.add((tp, cp, pp, ep))
    return found


def proposed_by_the_planner(model: dict, world: int) -> set[tuple[int, int, int, int]]:
    cfg = load_config(overrides={**model, "training.seq_len": SEQ_LEN})
    args = model_args(cfg)
    return {(c.tp, c.cp, c.pp, c.ep) for c in candidates(args, world, SEQ_LEN, batch=world)}


@pytest.mark.parametrize("model", [DENSE, MOE], ids=["dense", "moe"])
def test_the_planner_proposes_exactly_what_the_run_accepts(model):
    for world in (8, 16, 64, 256, 1024):
        accepted = accepted_by_the_run(model, world)
        assert accepted, world
        assert proposed_by_the_planner(model, world) == accepted, world
    if "model.n_experts" in model:  # expert parallelism with context parallelism, ep borrowed from cp x tp
        assert any(ep > 1 and cp > 1 for _, cp, _, ep in accepted_by_the_run(model, 64))
