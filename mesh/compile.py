"""torch.compile on a model part's blocks (mesh/parallelize.py, step 4): after activation checkpointing, before FSDP.

- A **dense block compiles whole**, as torchtitan compiles each block after its parallelisms: one graph per block,
  with the block's activation checkpoint traced into it (torch.utils.checkpoint as a higher-order op, torch's own
  selective-checkpoint modes: mesh/activation_checkpoint.py).
- A **block holding an MoE layer compiles by parts**: each child (the norms, the attention, the MoE layer) is
  compiled on its own, and the block's checkpoint around them runs eagerly (with meshloom's eager-mode contexts,
  which switch the MoE statistics off in recomputation). The MoE layer's graph breaks by design: under expert
  parallelism the dispatch and the combine run uncompiled (their split sizes are host integers read from the
  device, for uneven all-to-alls: mesh/expert_parallel.py, "Compiled"), and where ``torch._grouped_mm`` does not
  compile (fp32 in torch 2.13, whose meta function accepts bf16 only) the experts loop eagerly (models/moe.py).
  Dynamo cannot trace a checkpoint whose body breaks the graph: it runs the whole checkpoint eagerly, so a
  checkpointed MoE block compiled whole would not be compiled at all (torchtitan compiles MoE blocks by parts for
  the same reason). By parts, everything but the breaks compiles, with or without checkpointing.

The parts are compiled in place (``nn.Module.compile``), so module names, FSDP units and state-dict keys do not
change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from models.moe import MoE

if TYPE_CHECKING:
    from torch import nn


def compiles_whole(block: nn.Module) -> bool:
    """Whether ``block`` (checkpoint-wrapped or not) compiles as one graph: it holds no MoE layer (module docstring)."""
    return not any(isinstance(m, MoE) for m in block.modules())


def compile_blocks(model: nn.Module) -> None:
    """Compile every block of ``model.layers``: whole, or by parts (module docstring)."""
    for block in model.layers.values():
        if compiles_whole(block):
            block.compile()
            continue
        inner = getattr(block, "_checkpoint_wrapped_module", block)  # the checkpoint runs eagerly around the parts
        for part in inner.children():
            part.compile()
