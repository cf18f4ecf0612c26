"""Expert parallelism: each of the ``ep`` ranks owns n_experts/ep experts; tokens travel to them and back.

``ExpertParallel`` is a ParallelStyle for ``models.moe.GroupedExperts``. It shards the expert weights
(Shard(0) over the ep mesh: rank r owns experts [r*E/ep, (r+1)*E/ep)) and wraps the expert computation in
a dispatch and a combine. The MoE block hands the experts its tokens sorted by global expert id and the
count per expert; then:

1. count tokens per expert (the block already did: ``counts``, length n_experts, in expert order);
2. exchange the counts with ``all_to_all_single``: rank r learns how many tokens each peer sends to each of
   r's local experts. The token all-to-all takes its split sizes as host integers, so the host reads the
   per-rank sums here, sent and received in one read: the one host sync of an expert-parallel layer. The
   split sizes come from a provider (``host_split_sizes`` by default); ``use_split_sizes`` swaps in another,
   such as ``balanced_split_sizes`` (balanced routing assumed, no host read: the simulation uses it);
3. permute tokens by destination rank: sorting by global expert id already groups them by owner, so the
   send splits are just the per-rank sums of ``counts``;
4. ``all_to_all_single`` the tokens (autograd-aware: its backward is the reverse all-to-all of the
   gradients); they arrive grouped by (source rank, local expert);
5. regroup them by local expert and run the local experts;
6. undo the regrouping and send each output back with the reverse ``all_to_all_single``;
7. the outputs arrive in the order the tokens left, so the MoE block unpermutes them and weights them by
   their gates (models/moe.py, step 5) exactly as on one device.

A rank that receives no tokens runs its experts on empty inputs and still joins both all-to-alls.

EP ranks are borrowed from the data-parallel shard, context-parallel and tensor-parallel ranks: the world
mesh is unflattened so that ``dp_shard x cp x tp = efsdp x ep`` within the same root (mesh/dims.build_mesh),
ep taking the innermost ranks (tp first). Every rank of an ep group holds different tokens: dp_shard ranks
read different sequences, cp ranks different chunks of them, and under TP each tp rank runs the MoE block on
its own chunk of every sequence (mesh/moe_token_split.TokenSplitMoE) and dispatches that chunk to the
experts' owners, so every (token, expert) pair is computed once. Expert weights are then FSDP-sharded over the
remaining ``efsdp`` (and replicated over ``dp_replicate``), dense weights over dp_shard (x cp) like every dense weight; no
expert weight, gradient or optimizer state is replicated over cp or tp. An expert's gradient sums the tokens
of its ep group (the all-to-all's backward brings their gradients home) and FSDP sums it over efsdp and
dp_replicate: together every rank of the pipeline stage, each once.

Both exchanges are functional collectives (they return new tensors): selective activation checkpointing
saves their outputs, so recomputing a block in backward never repeats them (mesh/activation_checkpoint.py).

**Compiled** (``training.compile``): the dispatch (steps 2-5) and the combine (step 6) are the layer's compile
boundary, run uncompiled (``torch.compiler.disable``) as torchtitan leaves its token dispatch and combine
uncompiled. Their split sizes are host integers read from the device, which dynamo would either break the graph
at or bake into it as constants (a recompile for every new routing); the router, the shared expert and the
experts' grouped matmuls compile around them (mesh/compile.py). The experts' token count changes every step, so
the dispatch marks it dynamic: one compiled graph serves every count.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from mesh.private_api import all_to_all_autograd, all_to_all_functional, mark_rows_dynamic
from mesh.reductions import sum_over
from models.local_tensor import local_tensor
from models.moe import MoE

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def host_split_sizes(counts: torch.Tensor, received: torch.Tensor, rows: int) -> tuple[torch.Tensor, list, list]:
    """Step 2's split sizes read to the host (``all_to_all_single`` takes host integers): the layer's one host sync.
    Returns (received counts, sent per rank, received per rank)."""
    ep = received.shape[0]
    sent_per_rank, recv_per_rank = torch.stack([counts.view(ep, -1).sum(1), received.sum(1)]).tolist()
    return received, sent_per_rank, recv_per_rank


def balanced_split_sizes(counts: torch.Tensor, received: torch.Tensor, rows: int) -> tuple[torch.Tensor, list, list]:
    """Balanced routing assumed instead of read: no host read, so it runs under fake tensors (a simulation). The count
    exchange still runs, so the collectives are those of a real step."""
    ep, n_local = received.shape
    per_rank = [rows // ep + (1 if r < rows % ep else 0) for r in range(ep)]
    cells = [[n // n_local + (1 if e < n % n_local else 0) for e in range(n_local)] for n in per_rank]
    balanced = torch.tensor(cells, dtype=received.dtype, device=received.device)
    return balanced, per_rank, per_rank


class _SplitSizes:
    """The split-size provider every ExpertParallel layer asks (``use_split_sizes`` swaps it)."""

    provider = staticmethod(host_split_sizes)


SPLIT_SIZES = _SplitSizes()


@contextlib.contextmanager
def use_split_sizes(provider):
    """Route with ``provider`` (e.g. ``balanced_split_sizes``) instead of reading the real counts, inside the block."""
    previous = SPLIT_SIZES.provider
    SPLIT_SIZES.provider = provider
    try:
        yield
    finally:
        SPLIT_SIZES.provider = previous


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
        received = all_to_all_functional(counts, group).view(ep, -1)  # (source rank, local expert)
        received, sent_per_rank, recv_per_rank = SPLIT_SIZES.provider(counts, received, x.shape[0])
        # 3-4. tokens are already grouped by destination rank; exchange them
        routed = all_to_all_autograd(x, recv_per_rank, sent_per_rank, group)
        # 5. regroup from (source rank, local expert) order to (local expert, source rank) order
        # block id of each received token = source * n_local + local expert (source-major, as received); the
        # output size is known on the host already, so repeat_interleave need not read it from the device
        n_local = received.shape[1]
        block = torch.repeat_interleave(
            torch.arange(received.numel(), device=x.device), received.flatten(), output_size=routed.shape[0]
        )
        expert_major_key = (block % n_local) * ep + block // n_local
        regroup = torch.argsort(expert_major_key, stable=True)
        module._ep_state = (regroup, sent_per_rank, recv_per_rank, group)
        grouped = routed[regroup]
        mark_rows_dynamic(grouped)  # the experts' compiled graph takes any token count: no recompile per step
        return grouped, received.sum(0)

    def _combine(self, module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        regroup, sent_per_rank, recv_per_rank, group = module._ep_state
        del module._ep_state
        # 6. undo the regrouping, then send each output back where its token came from
        restored = torch.empty_like(out).index_copy_(0, regroup, out)
        return all_to_all_autograd(restored, sent_per_rank, recv_per_rank, group)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh, partition_fn=self._partition)
        # The hooks themselves are the compile boundary (module docstring, "Compiled"): dynamo compiles neither them
        # nor anything they call, so no frame of theirs is compiled for one token count and recompiled for the next.
        module.register_forward_pre_hook(
            torch.compiler.disable(lambda m, inputs: self._dispatch(m, inputs, device_mesh))
        )
        module.register_forward_hook(torch.compiler.disable(lambda m, _inputs, out: self._combine(m, out, device_mesh)))
        return module


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE block's experts over ``ep_mesh`` (a plan entry per MoE layer this model part holds)."""
    plan = {
        f"layers.{layer_id}.feed_forward.experts": ExpertParallel()
        for layer_id, block in model.layers.items()
        if isinstance(block.feed_forward, MoE)
    }
    if plan:
        parallelize_module(model, ep_mesh, plan)


def local_expert_bytes(parts: list[nn.Module]) -> dict[str, int]:
    """Bytes of expert weights this rank holds, by MoE layer id: the local shards (ep and FSDP) of its
    ``experts`` modules. Their gradients and fp32 Adam moments follow the same shards."""
    held = {}
    for layer_id, moe in moe_modules(parts).items():
        params = moe.experts.parameters()
        held[layer_id] = sum(local_tensor(p).numel() * p.element_size() for p in params)
    return held


def moe_modules(parts: list[nn.Module]) -> dict[str, MoE]:
    """The MoE blocks of this rank's model parts, by layer id."""
    found = {}
    for part in parts:
        for name, module in part.named_modules():
            if isinstance(module, MoE):
                found[name.split("layers.")[1].split(".")[0]] = module
    return found


@torch.no_grad()
def step_expert_load(
    parts: list[nn.Module],
    moe_layer_ids: list[int],
    loss_mesh: DeviceMesh,
    tp_mesh: DeviceMesh | None = None,
    read: bool = True,
    skip: torch.Tensor | None = None,
) -> dict:
    """Global per-layer expert load of the step on every rank (device all-reduces over ``loss`` then ``tp_mesh``; a
    stage without MoE layers still joins), then the aux-loss-free bias update from it; resets the counters. ``skip``
    (``found_inf``) zeroes the update on the device. With ``read`` False: {} and no host read."""
    if not moe_layer_ids:
        return {}
    local = moe_modules(parts)
    row_of = {str(layer_id): row for row, layer_id in enumerate(moe_layer_ids)}
    n_experts = parts[0].args.moe.n_experts
    # On the device the loss mesh reduces (parameters may live in host memory under FSDP CPU offload).
    device = torch.device(loss_mesh.device_type)
    stats = torch.zeros(len(moe_layer_ids), n_experts + 2, dtype=torch.float32, device=device)
    for layer_id, moe in local.items():
        stats[row_of[layer_id]] = torch.cat(
            [moe.tokens_per_expert, moe.dropped_assignments.view(1), moe.aux_loss_sum.view(1)]
        ).float()
    sum_over(stats, loss_mesh)
    if tp_mesh is not None:
        sum_over(stats, tp_mesh)
    for layer_id, moe in local.items():
        load = stats[row_of[layer_id], :-2]
        rate = moe.args.bias_update_rate
        if rate > 0:
            update = rate * torch.sign(load.mean() - load)
            moe.expert_bias += update if skip is None else update * (1 - skip)
        moe.reset_stats()
    if not read:
        return {}
    return {
        str(layer_id): {"tokens": row[:-2], "dropped": int(row[-2]), "aux_loss": float(row[-1])}
        for layer_id, row in zip(moe_layer_ids, stats.tolist(), strict=True)
    }


def load_metrics(load: dict) -> dict:
    """Metrics from step_expert_load: load per expert, worst max/mean, mean CV, dropped assignments, aux loss."""
    if not load:
        return {}
    layers = sorted(load, key=int)
    ratios, cvs = [], []
    for layer in layers:  # plain Python: the numbers are already on the host
        tokens = load[layer]["tokens"]
        mean = sum(tokens) / len(tokens)
        std = math.sqrt(sum((t - mean) ** 2 for t in tokens) / len(tokens))
        ratios.append(max(tokens) / mean if mean else 0.0)
        cvs.append(std / mean if mean else 0.0)
    return {
        "expert_load": {layer: [int(t) for t in load[layer]["tokens"]] for layer in layers},
        "expert_load_max_over_mean": max(ratios),
        "expert_load_cv": sum(cvs) / len(cvs),
        "dropped_assignments": sum(load[layer]["dropped"] for layer in layers),
        "aux_loss": sum(load[layer]["aux_loss"] for layer in layers),
    }
