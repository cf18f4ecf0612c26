"""meshloom's API path and the pieces the from-scratch and collective-count tests share.

The lead refactors mesh/ from time to time: every call into mesh/ made by those tests goes through the
``api_*`` helpers below, so a changed signature is a one-line fix here.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from models.llama import ModelArgs, Transformer

if TYPE_CHECKING:
    from torch.distributed.tensor.debug import CommDebugMode

TINY = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32)
SEED, SEQ, PER_RANK = 7, 8, 2
RTOL = 1e-6

# ---- meshloom's API path, behind small helpers: when a mesh/ signature changes, the fix is one line here ----


def api_meshes(
    dp_replicate: int, dp_shard: int, tp: int = 1, pp: int = 1, ep: int = 1, has_experts: bool = False, cp: int = 1
):
    """meshloom's meshes for a layout; ``.world[dim]`` per dim, ``.dp``, ``.fsdp``, ``.ep`` (with experts)."""
    from mesh.dims import ParallelDims, build_mesh

    dims = ParallelDims(
        pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep, world_size=dist.get_world_size()
    )
    return build_mesh(dims, torch.device("cpu"), timeout_s=120, has_experts=has_experts)


def api_fsdp(model, meshes, reshard_after_forward: str = "default"):
    from mesh.data_parallel import apply_fsdp

    return apply_fsdp(model, meshes, reshard_after_forward=reshard_after_forward)


def api_tensor_parallel(model, tp_mesh, sequence_parallel: bool = False):
    from mesh.tensor_parallel import apply_tensor_parallel

    return apply_tensor_parallel(model, tp_mesh, sequence_parallel=sequence_parallel)


def api_pipeline(stage_module, stage_id: int, n_stages: int, microbatches: int, loss_fn):
    schedule, _ = api_pipeline_stages([stage_module], [stage_id], n_stages, "1F1B", microbatches, loss_fn)
    return schedule


def api_pipeline_stages(modules, stage_ids, n_stages: int, schedule: str, microbatches: int, loss_fn):
    """(schedule, PipelineStages) over the world as the pp group."""
    from mesh.pipeline import build_pipeline_schedule

    return build_pipeline_schedule(
        modules,
        stage_ids,
        n_stages,
        schedule=schedule,
        microbatches=microbatches,
        pp_group=dist.group.WORLD,
        device=torch.device("cpu"),
        loss_fn=loss_fn,
    )


def api_stage(args, layers: list[int], is_first: bool, is_last: bool):
    """A pipeline stage of ``args`` holding ``layers``, materialised (no DTensors)."""
    from mesh.pipeline import build_stage_module

    return materialize(build_stage_module(args, layers, is_first, is_last))


def api_stage_ids(pp_rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    from mesh.pipeline import stage_ids_of_rank

    return stage_ids_of_rank(pp_rank, pp, stages_per_rank, schedule)


def api_expert_parallel(experts, ep_mesh):
    from mesh.expert_parallel import ExpertParallel

    ExpertParallel()._apply(experts, ep_mesh)


def api_cp_attention(q, k, v, algorithm: str):
    """meshloom's context-parallel attention over the world: q (b, n, heads, d), k/v (b, n, kv_heads, d)."""
    from mesh.context_parallel import allgather_attention, ring_attention

    attend = allgather_attention if algorithm == "allgather" else ring_attention
    return attend(q, k, v, group=dist.group.WORLD)


def materialize(model):
    from mesh.materialize import materialize_weights

    materialize_weights(model, torch.device("cpu"), SEED)
    return model


# ---- shared pieces -----------------------------------------------------------------------------------------


def plain_model() -> Transformer:
    with torch.device("meta"):
        model = Transformer(TINY)
    return model.init_weights(SEED)


def meta_model() -> Transformer:
    with torch.device("meta"):
        return Transformer(TINY)


def global_batch(world: int):
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, TINY.vocab_size, (PER_RANK * world, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def my_slice(tensor: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    return tensor[PER_RANK * rank : PER_RANK * (rank + 1)]


def loss_share(logits: torch.Tensor, targets: torch.Tensor, global_tokens: int) -> torch.Tensor:
    """meshloom's loss: this rank's token-loss sum over the global token count (train.py: forward_backward)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum") / global_tokens


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def comm_counts(mode: CommDebugMode) -> dict:
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


@contextlib.contextmanager
def count_calls(*names: str):
    """Count calls of ``torch.distributed.<name>`` (for code CommDebugMode's module tracker cannot follow)."""
    counts, originals = dict.fromkeys(names, 0), {n: getattr(dist, n) for n in names}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in names:
        setattr(dist, name, counting(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
