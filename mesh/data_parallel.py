"""Data parallelism with FSDP2 (``fully_shard``): ZeRO-3 style sharding, or HSDP on a 2-D mesh.

``apply_fsdp`` does, in order:

1. Wrap each transformer block in its own FSDP unit, the embedding in one, the final norm with the head in
   another (``vocabulary_units``), then the root (what is left: nothing but buffers in models/llama.py). A
   unit's parameters are all-gathered just before its forward (and again before its backward when it
   resharded after forward), and its gradients are reduce-scattered right after its backward: only one or two
   blocks, and never both vocabulary matrices, are unsharded at a time. A vocabulary matrix is V x h: at a
   128k vocabulary and h = 16,384, 4 GB each in bf16; inside the root they stayed gathered from the first
   forward to the last backward.
2. On a 1-D mesh (dp_shard) every rank holds 1/dp_shard of each parameter, gradient and optimizer state.
   On a 2-D mesh (dp_replicate, dp_shard) that is HSDP: shard inside a group (a node), replicate across
   groups; a gradient is reduce-scattered inside the group, then all-reduced across the replicas.
3. Mixed precision: with ``training.mixed_precision = bf16`` the all-gathered parameters and the compute are
   bf16, while gradients are reduced in fp32 and the sharded master weights and Adam states stay fp32.
   (``parallel.grad_compression = bf16`` reduces in bf16 instead, and ``parallel.fsdp_cpu_offload`` keeps the
   shards in host memory: training/build.py: reduce_dtype, offload_policy.)
4. Gradients are *summed*, not averaged, across data-parallel ranks. The loss each rank backpropagates is
   already its share of the global mean (its token-loss sum divided by the global token count), so the sum
   of the ranks' gradients is exactly the gradient of the global mean: the scaling happens once, in the
   loss. (FSDP's default would divide by the dp size a second time.)
5. Prefetch: each unit asks FSDP to start all-gathering the next one during its own forward (the embedding
   the first block, each block the next, the last block the norm and head), so the communication overlaps
   compute on GPUs. Backward prefetching of the previous unit is FSDP2's default (it follows the reverse of
   the forward order: the head, the last block, ..., the first block, the embedding).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from models.moe import MoE

if TYPE_CHECKING:
    from mesh.dims import Meshes


def reshard_after_forward_policy(policy: str, is_last_block: bool, pipelined: bool) -> bool:
    """``default``: free gathered weights after forward except the last block's; under pipelining keep them, since a
    stage runs several forwards before their backwards."""
    if policy == "always":
        return True
    if policy == "never" or pipelined:
        return False
    return not is_last_block


def vocabulary_units(model: nn.Module) -> list[list[nn.Module]]:
    """The vocabulary units: ``[[embedding], [final norm, head]]`` (those this stage holds); tied, one unit
    ``[[embedding, norm, head]]``, since an FSDP unit owns its parameters."""
    embedding, norm, head = (getattr(model, name, None) for name in ("tok_embeddings", "norm", "output"))
    if embedding is not None and head is not None and embedding.weight is head.weight:
        return [[embedding, norm, head]]
    groups = [[embedding]] if embedding is not None else []
    last = [m for m in (norm, head) if m is not None]
    return groups + ([last] if last else [])


def sum_from_mean(mean: torch.Tensor, replicas: int) -> torch.Tensor:
    """Gradients are *summed* over data-parallel replicas, never averaged: each loss is already its share of the global
    mean (training/loss.py). An averaging reduction (DDP's hooks) is multiplied back here, in place."""
    return mean.mul_(replicas)


def sum_gradients_across_replicas(module: FSDPModule) -> None:
    """Make FSDP reduce gradients with a plain SUM (``sum_from_mean``'s rule: no division by the dp size)."""
    module.set_gradient_divide_factor(1.0)
    # A divide factor alone maps to PREMUL_SUM, which gloo lacks; forcing SUM comms keeps it portable.
    module.set_force_sum_reduction_for_comms(True)


def apply_fsdp(
    model: nn.Module,
    meshes: Meshes,
    *,
    mixed_precision: str = "fp32",
    reshard_after_forward: str = "default",
    pipelined: bool = False,
    reduce_dtype: torch.dtype = torch.float32,
    offload: OffloadPolicy | None = None,
) -> nn.Module:
    """Shard ``model`` over ``meshes.fsdp`` (module docstring); reduce dtype and offload come from
    training/build.py."""
    fsdp_mesh = meshes.fsdp
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if mixed_precision == "bf16" else None,
        reduce_dtype=reduce_dtype,
    )
    offload = offload or OffloadPolicy()
    blocks = list(model.layers.values())
    expert_units = []
    if meshes.expert_fsdp is not None:
        # Expert weights are already sharded over ep; FSDP shards them further over the rest of dp_shard x cp
        # x tp (efsdp, mesh/dims.py) in units of their own, inside their block's unit.
        for block in blocks:
            for module in block.modules():
                if isinstance(module, MoE):
                    fully_shard(
                        module.experts,
                        mesh=meshes.expert_fsdp,
                        mp_policy=policy,
                        offload_policy=offload,
                        reshard_after_forward=reshard_after_forward_policy(reshard_after_forward, False, pipelined),
                    )
                    expert_units.append(module.experts)
    if meshes.token_split is not None:
        # Under TP's token split every tp rank runs an MoE block on its own tokens, like a data-parallel rank:
        # its router and shared expert (and, without ep, its experts) are FSDP-sharded over dp_shard x cp x tp
        # in a unit of their own, so no tp rank holds them whole, and FSDP sums their gradients over the tp
        # ranks too (mesh/moe_token_split.sum_token_split_gradients then leaves them out).
        for block in blocks:
            for module in block.modules():
                if isinstance(module, MoE):
                    dense = [m for m in (module.router, module.shared_expert) if m is not None]
                    if module.experts not in expert_units:
                        dense.append(module.experts)
                    fully_shard(
                        dense,
                        mesh=meshes.token_split,
                        mp_policy=policy,
                        offload_policy=offload,
                        reshard_after_forward=reshard_after_forward_policy(reshard_after_forward, False, pipelined),
                    )
                    expert_units.append(dense[0])
    for i, block in enumerate(blocks):
        fully_shard(
            block,
            mesh=fsdp_mesh,
            mp_policy=policy,
            offload_policy=offload,
            reshard_after_forward=reshard_after_forward_policy(reshard_after_forward, i == len(blocks) - 1, pipelined),
        )
    # The vocabulary units. The embedding is used first in forward and last in backward: it reshards after
    # forward (it is all-gathered again for its backward, at the very end) like an ordinary block. The norm and
    # head are used last in forward and first in backward, so by default they stay gathered like the last block
    # (resharding would all-gather them again at once). Tied, the one unit is used at both ends: it reshards
    # like an early block, so the matrix is gathered twice instead of held through the whole step.
    vocab = []
    for modules in vocabulary_units(model):
        used_last = model.output in modules and model.tok_embeddings not in modules
        unit = modules if len(modules) > 1 else modules[0]
        fully_shard(
            unit,
            mesh=fsdp_mesh,
            mp_policy=policy,
            offload_policy=offload,
            reshard_after_forward=reshard_after_forward_policy(reshard_after_forward, used_last, pipelined),
        )
        vocab.append(modules[0])  # fully_shard on a list makes the first module the FSDPModule handle
    # The root: the rest (the rotary buffers here), and the module whose forward starts and ends the step.
    root_reshard = reshard_after_forward_policy(reshard_after_forward, True, pipelined)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=policy, offload_policy=offload, reshard_after_forward=root_reshard)
    for module in [*expert_units, *blocks, *vocab, model]:
        sum_gradients_across_replicas(module)
    order = [*(m for m in vocab if m is getattr(model, "tok_embeddings", None)), *blocks]
    order += [m for m in vocab if m not in order]
    for unit, next_unit in zip(order, order[1:], strict=False):
        unit.set_modules_to_forward_prefetch([next_unit])
    return model
