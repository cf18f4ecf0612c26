"""What each activation checkpointing policy keeps from a block's forward: one table, read by the policy that runs
(mesh/activation_checkpoint.py) and by the memory estimate (planning/memory_estimate.py), so the two cannot drift.

``training.activation_checkpoint``:

- ``none``: no checkpointing; autograd keeps what each op saves.
- ``full``: a block keeps only its input and recomputes everything in backward (its collectives too).
- ``selective`` (the default selective policy): torchtitan's per-op policy. A block keeps the outputs of
  attention (every SDPA kernel), of every collective and of ``topk`` (the MoE routing), and of every *second*
  matmul of its forward, counted in order (the 1st, 3rd, 5th, ... ``mm``/``addmm``: in a Llama block wq, wv,
  w1 and w2 are kept; wk, wo and w3 recomputed). Recomputing half the matmuls costs about a third of a
  block's forward matmul FLOPs again in backward; it keeps torchtitan's published 8B run (8 x H100, FSDP 8,
  2 x 8,192 tokens per GPU, bf16) within 80 GiB per rank in meshloom's estimate, which ``selective_keep_mm``
  does not (docs/mixed_precision.md).
- ``selective_keep_mm``: the same, but *every* matmul's output is kept (the MoE experts' grouped matmuls are
  kept by both): less recomputation, more memory, for a run whose memory allows it.

Under tensor parallelism both selective policies recompute the row-parallel matmuls (wo, a dense block's w2),
whose whole-sequence partial sum the collective after them consumes, and whose collective output is kept
(mesh/activation_checkpoint.py's docstring explains why).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    """What a policy keeps. ``matmuls``: "all" (every mm/addmm output), "odd" (the 1st, 3rd, ... of the block's
    forward), "none"; ``others``: attention, collectives and routing (``SAVE_OPS`` besides the matmuls)."""

    checkpointed: bool  # the block is wrapped: what is not kept is recomputed in backward
    matmuls: str
    others: bool
    what: str


POLICIES = {
    "none": Policy(False, "all", True, "no checkpointing: autograd keeps what every op saves"),
    "full": Policy(True, "none", False, "the block's input only; everything recomputed"),
    "selective": Policy(True, "odd", True, "every second matmul, attention, collectives, routing (torchtitan)"),
    "selective_keep_mm": Policy(True, "all", True, "every matmul, attention, collectives, routing"),
}
SELECTIVE = tuple(name for name, p in POLICIES.items() if p.checkpointed and p.others)


def keeps_matmul(mode: str, index: int, row_parallel: bool = False) -> bool:
    """Whether ``mode`` keeps the output of the block's ``index``-th matmul (1-based, in forward order);
    ``row_parallel``: a row-parallel linear under TP, which no selective policy keeps."""
    policy = POLICIES[mode]
    if not policy.checkpointed:
        return True
    if row_parallel or policy.matmuls == "none":
        return False
    return policy.matmuls == "all" or index % 2 == 1
