"""The one place that applies the parallelisms to a model part, in one fixed order.

``parallelize(model, meshes, options, device)`` takes a model built on the meta device (no storage yet) and
returns it ready to train on this rank. Each step reads only the typed ``ParallelOptions`` (built from the
TOML config in one adapter, training/build.py) and the named meshes (mesh/dims.py); the reason for its place
in the order is written beside it:

1. **TP** (mesh/tensor_parallel.py) first: it replaces each block's weights by DTensors sharded over the tp
   mesh and installs the hooks that move activations between ranks. Everything after works on those DTensors.
2. **EP** (mesh/expert_parallel.py): the experts of each MoE block are sharded over the ep mesh, again before
   any wrapper hides the block's modules.
3. **Activation checkpointing** (mesh/activation_checkpoint.py) wraps each block as TP and EP left it, so a
   recomputed forward repeats the block's own computation; selective AC never repeats a collective.
4. **compile** each block, after AC (mesh/compile.py): a dense block's compiled region then contains its checkpoint; a
   block with an MoE layer compiles by parts inside its checkpoint (the layer's graph breaks by design). A block's
   inputs and outputs are plain, finished tensors (TP's embedding waits for its reduction: mesh/tensor_parallel.py,
   ``VocabParallelEmbedding``), so every redistribution and its backward is inside or outside a compiled region
   whole. A zero-bubble schedule runs each block's compiled backward twice (``options.split_backward``), so it must
   keep its saved activations (mesh/private_api.py: ``keep_compiled_backward_inputs``). AOTAutograd's on-disk cache
   is off: it could serve a graph naming another run's process groups (``key_compiled_graphs_by_group``).
5. **Data parallelism** last among the wrappers: FSDP2 (mesh/data_parallel.py) makes its units of the blocks as
   they now are, and shards TP's DTensors further over the data-parallel dims (2-D). A saver may supply a
   replicated model in FSDP's place (``options.dp.replicate``: PowerSGD's DDP, savers/powersgd.py), and a
   layout with neither keeps plain tensors (``options.dp.fsdp`` false: one process, or 1-bit Adam's replicas).
6. **Weights** (mesh/materialize.py): storage is allocated only now, under the final sharding, and filled with
   the layout-independent initial weights (a function of seed and name), so every layout starts alike. Under
   CPU offload FSDP wants its sharded parameters created in host memory.
7. **CP** (mesh/context_parallel.py) after the weights: it swaps each attention's kernel and cuts the rotary
   tables (buffers, materialised in step 6) to this rank's sequence positions.
8. Every parameter and buffer is checked to be on ``device`` (or in host memory, for offloaded parameters).

Pipeline parallelism cuts the model into stages *before* all this (``build_model_parts``, mesh/pipeline.py);
each stage is then parallelized like a whole model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from mesh.activation_checkpoint import apply_activation_checkpointing
from mesh.compile import compile_blocks
from mesh.context_parallel import apply_context_parallel
from mesh.data_parallel import apply_fsdp
from mesh.expert_parallel import apply_expert_parallel
from mesh.materialize import check_placement, materialize_weights
from mesh.pipeline import build_stage_module
from mesh.private_api import keep_compiled_backward_inputs, key_compiled_graphs_by_group
from mesh.tensor_parallel import apply_tensor_parallel
from models.llama import Transformer

if TYPE_CHECKING:
    from mesh.dims import Meshes
    from models.llama import ModelArgs


@dataclass(frozen=True)
class TensorParallelOptions:
    sequence_parallel: bool = True  # also shard norms and the residual stream by sequence
    regather: bool = False  # gather the sequence again before each block's matmuls (parallel.sp_regather)


@dataclass(frozen=True)
class DataParallelOptions:
    fsdp: bool = False  # FSDP2 wraps the model (planning/layout.py: uses_fsdp)
    mixed_precision: str = "fp32"  # fp32 | bf16 (FSDP's policy: bf16 compute, fp32 master weights)
    reshard_after_forward: str = "default"  # default | always | never
    reduce_dtype: torch.dtype = torch.float32  # the dtype FSDP reduces gradients in (bf16: a saver's choice)
    offload: OffloadPolicy | None = None  # FSDP2's CPU offload policy, or None
    replicate: Callable[[nn.Module], nn.Module] | None = None  # a saver's replicated model in FSDP's place

    @property
    def host_params(self) -> bool:
        """Whether the sharded parameters live in host memory (FSDP CPU offload)."""
        return isinstance(self.offload, CPUOffloadPolicy)


@dataclass(frozen=True)
class ContextParallelOptions:
    attention: str = "allgather"  # allgather | ring
    seq_len: int = 0  # the rotary tables are cut to this rank's positions of a sequence this long


@dataclass(frozen=True)
class ParallelOptions:
    """What ``parallelize`` needs to know besides the meshes: one typed group of options per parallelism (TP, AC
    and compile, data parallelism, CP), built from the TOML config in one place (training/build.py)."""

    seed: int  # the initial weights are a function of (seed, parameter name)
    tp: TensorParallelOptions = TensorParallelOptions()
    activation_checkpoint: str = "none"  # none | full | selective
    compile: bool = False  # torch.compile each block
    split_backward: bool = False  # a zero-bubble schedule: input- and weight-gradient passes over each block
    dp: DataParallelOptions = DataParallelOptions()
    cp: ContextParallelOptions = ContextParallelOptions()


def parallelize(model: nn.Module, meshes: Meshes, options: ParallelOptions, device: torch.device) -> nn.Module:
    """Steps 1-8 of the module docstring, on a model (or pipeline stage) built on the meta device."""
    tp, dp, cp = options.tp, options.dp, options.cp
    if meshes.tp.size() > 1:  # 1. TP
        apply_tensor_parallel(model, meshes.tp, sequence_parallel=tp.sequence_parallel, regather=tp.regather)
    if meshes.ep is not None:  # 2. EP (a mesh only for an MoE model with ep > 1)
        apply_expert_parallel(model, meshes.ep)
    apply_activation_checkpointing(model, options.activation_checkpoint, compiled=options.compile)  # 3. AC
    if options.compile:  # 4. compile
        key_compiled_graphs_by_group()
        if options.split_backward:
            keep_compiled_backward_inputs()
        compile_blocks(model)
    if dp.replicate is not None:  # 5. a saver's replicated model (pure data parallelism): weights first
        materialize_weights(model, device, options.seed)
        check_placement(model, device)
        return dp.replicate(model)
    if dp.fsdp:  # 5. FSDP2 / HSDP
        apply_fsdp(
            model,
            meshes,
            mixed_precision=dp.mixed_precision,
            reshard_after_forward=dp.reshard_after_forward,
            pipelined=meshes.pp.size() > 1,
            reduce_dtype=dp.reduce_dtype,
            offload=dp.offload,
        )
    host = torch.device("cpu") if dp.host_params else None
    materialize_weights(model, device, options.seed, host)  # 6. weights
    if meshes.cp.size() > 1:  # 7. CP
        apply_context_parallel(model, meshes.cp, cp.attention, cp.seq_len)
    check_placement(model, device, host_params=dp.host_params)  # 8. every tensor where the layout says
    return model


def build_model_parts(
    args: ModelArgs,
    stage_layers: tuple[tuple[int, ...], ...],
    stage_ids: tuple[int, ...],
    meshes: Meshes,
    options: ParallelOptions,
    device: torch.device,
) -> list[nn.Module]:
    """This rank's model parts, parallelized: the whole model, or its pipeline stages (``stage_ids``)."""
    n_stages = len(stage_layers)
    if n_stages == 1:
        with torch.device("meta"):
            model = Transformer(args)
        return [parallelize(model, meshes, options, device)]
    stages = [build_stage_module(args, stage_layers[s], s == 0, s == n_stages - 1) for s in stage_ids]
    return [parallelize(stage, meshes, options, device) for stage in stages]
