"""Expert parallelism: each of the ``ep`` ranks owns n_experts/ep experts; tokens travel to them and back.

``ExpertParallel`` is a ParallelStyle for ``models.moe.GroupedExperts``. It shards the expert weights
(Shard(0) over the ep mesh: rank r owns experts [r*E/ep, (r+1)*E/ep)) and wraps the expert computation in
a dispatch and a combine. The MoE block hands the experts its tokens sorted by global expert id and the
count per expert; then:

1. count tokens per expert (the block already did: ``counts``, length n_experts, in expert order);
2. exchange the counts with ``all_to_all_single``: rank r learns how many tokens each peer sends to each of
   r's local experts;
3. permute tokens by destination rank: sorting by global expert id already groups them by owner, so the
   send splits are just the per-rank sums of ``counts``;
4. ``all_to_all_single`` the tokens (autograd-aware: its backward is the reverse all-to-all of the
   gradients); they arrive grouped by (source rank, local expert);
5. regroup them by local expert and run the local experts;
6. undo the regrouping and send each output back with the reverse ``all_to_all_single``;
7. the outputs arrive in the order the tokens left, so the MoE block unpermutes them and weights them by
   their gates (models/moe.py, step 5) exactly as on one device.

A rank that receives no tokens runs its experts on empty inputs and still joins both all-to-alls.

EP ranks are carved from the data-parallel *shard* ranks: ``dp_shard = efsdp x ep``. Expert weights are
then FSDP-sharded over the remaining ``efsdp`` (and replicated over ``dp_replicate``), dense weights over
all of ``dp_shard`` as before. Ranks of one ep group hold different tokens (they are data-parallel), which
is what makes the exchange worthwhile. Under tensor parallelism the MoE block runs replicated on the
gathered sequence on every tp rank (mesh/tensor_parallel.moe_plan), each tp coordinate with its own ep
group: simple, at the cost of tp-fold redundant expert compute.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from models.moe import MoE


def all_to_all_autograd(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Differentiable uneven all-to-all. ``_functional_collectives`` is still private in torch 2.13; this is
    the one place meshloom calls it (``torch.distributed.nn.functional.all_to_all_single`` is deprecated)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x, output_splits, input_splits, group))


class ExpertParallel(ParallelStyle):
    """Shard GroupedExperts over a 1-D ep mesh and route tokens to their experts' ranks (module docstring)."""

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad)
            module.register_parameter(pname, sharded)

    def _dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x, counts = inputs
        group, ep = mesh.get_group(), mesh.size()
        # 2. exchange counts: row r of `received` = tokens peer r sends to each of my local experts
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        sent_per_rank = counts.view(ep, -1).sum(1).tolist()
        received = received.view(ep, -1)  # (source rank, local expert)
        recv_per_rank = received.sum(1).tolist()
        # 3-4. tokens are already grouped by destination rank; exchange them
        routed = all_to_all_autograd(x, recv_per_rank, sent_per_rank, group)
        # 5. regroup from (source rank, local expert) order to (local expert, source rank) order
        # block id of each received token = source * n_local + local expert (source-major, as received)
        n_local = received.shape[1]
        block = torch.repeat_interleave(torch.arange(received.numel(), device=x.device), received.flatten())
        expert_major_key = (block % n_local) * ep + block // n_local
        regroup = torch.argsort(expert_major_key, stable=True)
        module._ep_state = (regroup, sent_per_rank, recv_per_rank, group)
        return routed[regroup], received.sum(0)

    def _combine(self, module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        regroup, sent_per_rank, recv_per_rank, group = module._ep_state
        del module._ep_state
        # 6. undo the regrouping, then send each output back where its token came from
        restored = torch.empty_like(out).index_copy_(0, regroup, out)
        return all_to_all_autograd(restored, sent_per_rank, recv_per_rank, group)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partition_fn=self._partition,
            input_fn=self._dispatch,
            output_fn=self._combine,
        )


def build_expert_mesh(device_type: str, pp: int, dp_replicate: int, dp_shard: int, ep: int, tp: int):
    """A second mesh over the same ranks with dp_shard split into (efsdp, ep); same rank order as the world.

    Returns (ep mesh, the mesh FSDP shards expert weights over).
    """
    root = init_device_mesh(
        device_type,
        (pp, dp_replicate, dp_shard // ep, ep, tp),
        mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep", "tp"),
    )
    fsdp_dims = ("dp_replicate", "efsdp") if dp_replicate > 1 else ("efsdp",)
    return root["ep"], root[fsdp_dims]


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE block's experts over ``ep_mesh``."""
    for module in model.modules():
        if isinstance(module, MoE):
            ExpertParallel()._apply(module.experts, ep_mesh)


def moe_modules(parts: list[nn.Module]) -> dict[str, MoE]:
    """The MoE blocks of this rank's model parts, by layer id."""
    found = {}
    for part in parts:
        for name, module in part.named_modules():
            if isinstance(module, MoE):
                found[name.split("layers.")[1].split(".")[0]] = module
    return found


@torch.no_grad()
def step_expert_load(parts: list[nn.Module], dp_mesh: DeviceMesh, pp_mesh: DeviceMesh) -> dict:
    """Global per-layer expert load of the step (summed over dp ranks), gathered over pp; resets the counters.

    Also applies the aux-loss-free bias update, from the *global* load, so every layout updates identically.
    Returns {layer id: {"tokens": [...], "dropped": n, "aux_loss": x}} (every layer, on every rank).
    """
    local = {}
    for layer_id, moe in moe_modules(parts).items():
        stats = torch.cat([moe.tokens_per_expert, moe.dropped_assignments.view(1), moe.aux_loss_sum.view(1)])
        if dp_mesh.size() > 1:
            dist.all_reduce(stats, group=dp_mesh.get_group())  # tp ranks saw the same tokens: dp only
        load = stats[:-2]
        rate = moe.args.bias_update_rate
        if rate > 0:
            moe.expert_bias += rate * torch.sign(load.mean() - load)
        local[layer_id] = {"tokens": load.tolist(), "dropped": int(stats[-2]), "aux_loss": float(stats[-1])}
        moe.reset_stats()
    if pp_mesh.size() == 1:
        return local
    gathered: list = [None] * pp_mesh.size()
    dist.all_gather_object(gathered, local, group=pp_mesh.get_group())
    return {k: v for stage in gathered for k, v in stage.items()}


def load_metrics(load: dict) -> dict:
    """Metrics from step_expert_load.

    ``expert_load``: tokens per expert, per layer; ``expert_load_max_over_mean``: the worst layer's busiest
    expert over its mean (1 = perfectly even, E/k = everything on k experts); ``expert_load_cv``: the mean over
    layers of the load's coefficient of variation; ``dropped_assignments``: (token, expert) assignments that
    exceeded capacity, summed over layers; ``aux_loss``: the auxiliary loss summed over layers.
    """
    if not load:
        return {}
    layers = sorted(load, key=int)
    ratios, cvs = [], []
    for layer in layers:
        tokens = torch.tensor(load[layer]["tokens"])
        mean = tokens.mean().item()
        ratios.append(tokens.max().item() / mean if mean else 0.0)
        cvs.append((tokens.std(unbiased=False) / tokens.mean()).item() if mean else 0.0)
    return {
        "expert_load": {layer: [int(t) for t in load[layer]["tokens"]] for layer in layers},
        "expert_load_max_over_mean": max(ratios),
        "expert_load_cv": sum(cvs) / len(cvs),
        "dropped_assignments": sum(load[layer]["dropped"] for layer in layers),
        "aux_loss": sum(load[layer]["aux_loss"] for layer in layers),
    }
