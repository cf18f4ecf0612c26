"""The clipping norm is the norm of the whole model's gradient, whatever the sharding."""

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.debug import CommDebugMode

from launch.local_runs import DEBUG_CONFIG
from launch.spawn import run_on_ranks
from mesh.dims import build_mesh
from mesh.grad_clip import global_grad_norm
from mesh.tensor_parallel import loss_context
from planning.plan import LayoutPlan
from runtime.config import load_config, model_args
from tests.api_path import comm_counts
from training.build import build_step


def batch() -> torch.Tensor:
    return torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))


def sharded_norm(overrides: dict) -> float:
    return sharded_norm_and_collectives(overrides, fsdp_with_tp=False)[0]


def sharded_norm_and_collectives(overrides: dict, fsdp_with_tp: bool) -> tuple[float, int, list[str]]:
    """Rank body: the global gradient norm of one backward, the all-reduces computing it took, and the
    warnings DTensor logged while redistributing."""
    cfg = load_config(path=DEBUG_CONFIG, overrides=overrides)
    plan = LayoutPlan.resolve(cfg, dist.get_world_size(), dist.get_rank())
    dims = plan.dims
    meshes = build_mesh(dims, torch.device("cpu"), timeout_s=60, fsdp_with_tp=fsdp_with_tp)
    model = build_step(cfg, plan, meshes, torch.device("cpu")).parts[0]
    tokens = batch()
    rows = tokens.chunk(dims.dp)[meshes.dp.get_local_rank()]  # this rank's share of the batch
    with loss_context(dims.tp > 1):  # vocab-sharded logits under TP
        loss = F.cross_entropy(model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten(), reduction="sum")
        (loss / tokens[:, 1:].numel()).backward()
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    logger.addHandler(handler)
    try:
        with CommDebugMode() as comm:
            norm = global_grad_norm(list(model.parameters())).item()
    finally:
        logger.removeHandler(handler)
    return norm, comm_counts(comm).get("all_reduce", 0), warnings


def one_process_norm() -> float:
    """The reference: the plain model's gradient norm on the whole batch, in this process."""
    cfg = load_config(path=DEBUG_CONFIG)
    with torch.device("meta"):
        from models.llama import Transformer

        model = Transformer(model_args(cfg))
    model.init_weights(cfg.training.seed)
    tokens = batch()
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()


def test_global_norm_equals_the_one_process_norm():
    expected = one_process_norm()
    norms = run_on_ranks(sharded_norm, 4, {"parallel.dp_replicate": 2, "parallel.dp_shard": 2})
    for norm in norms:
        # One backward, fp32, different summation order only: agreement to ~1e-7 relative.
        assert abs(norm - expected) / expected < 1e-5, (norm, expected)
    # A per-shard norm would be visibly smaller: make sure the check could tell.
    assert expected > 0.1


def test_fsdp_x_tp_norm_takes_one_all_reduce_per_placement_group_over_a_flattened_mesh():
    """FSDP x TP weights' norms are partial over dp_shard and tp: with the flattened (dp_shard, cp, tp) mesh
    that train.py asks build_mesh for, DTensor reduces each in one all-reduce and logs no warning; without it,
    one all-reduce per mesh dim and a warning on every rank. The norm is the same either way."""
    layout = {"parallel.dp_shard": 2, "parallel.tp": 2}
    flat = run_on_ranks(sharded_norm_and_collectives, 4, layout, True)
    per_dim = run_on_ranks(sharded_norm_and_collectives, 4, layout, False)
    expected = one_process_norm()
    for (norm, reduces, warnings), (norm_2, reduces_2, warnings_2) in zip(flat, per_dim, strict=True):
        assert warnings == [] and any("sequential all_reduce" in w for w in warnings_2), (warnings, warnings_2)
        # Three placement groups: column- and row-sharded weights (partial over dp_shard and tp: 1 all-reduce
        # each instead of 2) and the SP norms' weights, replicated over tp (partial over dp_shard only: 1).
        assert (reduces, reduces_2) == (3, 5)
        assert abs(norm - norm_2) <= 1e-6 * norm_2
        # and both are the whole model's norm (same tolerance as above: summation order only)
        assert abs(norm - expected) / expected < 1e-5, (norm, expected)
