"""The clipping norm is the norm of the whole model's gradient, whatever the sharding."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from config import load_config, model_args
from mesh.dims import build_mesh
from mesh.grad_clip import global_grad_norm
from mesh.plan import LayoutPlan
from tests.harness import run_on_ranks
from tests.training_runs import DEBUG_CONFIG
from train import build_model


def batch() -> torch.Tensor:
    return torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))


def sharded_norm(overrides: dict) -> float:
    cfg = load_config(path=DEBUG_CONFIG, overrides=overrides)
    plan = LayoutPlan.resolve(cfg, dist.get_world_size(), dist.get_rank())
    dims = plan.dims
    meshes = build_mesh(dims, torch.device("cpu"), timeout_s=60)
    model = build_model(cfg, plan, meshes, torch.device("cpu"))
    tokens = batch()
    rows = tokens.chunk(dims.dp)[meshes.dp.get_local_rank()]  # this rank's share of the batch
    loss = F.cross_entropy(model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten(), reduction="sum")
    (loss / tokens[:, 1:].numel()).backward()
    return global_grad_norm(list(model.parameters())).item()


def test_global_norm_equals_the_one_process_norm():
    cfg = load_config(path=DEBUG_CONFIG)
    with torch.device("meta"):
        from models.llama import Transformer

        model = Transformer(model_args(cfg))
    model.init_weights(cfg.training.seed)
    tokens = batch()
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()

    norms = run_on_ranks(sharded_norm, 4, {"parallel.dp_replicate": 2, "parallel.dp_shard": 2})
    for norm in norms:
        # One backward, fp32, different summation order only: agreement to ~1e-7 relative.
        assert abs(norm - expected) / expected < 1e-5, (norm, expected)
    # A per-shard norm would be visibly smaller: make sure the check could tell.
    assert expected > 0.1
