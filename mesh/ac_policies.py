"""What each activation checkpointing policy keeps from a block's forward: one table, read by the policy that runs
(mesh/activation_checkpoint.py) and by the memory estimate (planning/memory_estimate.py), so the two cannot drift.

``training.activation_checkpoint``:

- ``none``: no checkpointing; autograd keeps what each op saves.
- ``full``: a block keeps only its input and recomputes everything in backward (its collectives too).
- ``selective`` (the default selective policy): torchtitan's per-op policy. A block keeps the outputs of
  attention (every SDPA kernel), of the reduce-scatters and all-to-alls it issues, of ``topk`` (the MoE routing)
  and ``max``, of its device-to-host copies, and of every *second* matmul of its forward, counted in order
  (the 1st, 3rd, 5th, ... ``mm``: in a Llama block wq, wv, w1 and w2 are kept; wk, wo and w3 recomputed).
  Recomputing half the matmuls costs about a third of a block's forward matmul FLOPs again in backward; it keeps
  torchtitan's published 8B run (8 x H100, FSDP 8, 2 x 8,192 tokens per GPU, bf16) within 80 GiB per rank in
  meshloom's estimate, which ``selective_keep_mm`` does not (docs/mixed_precision.md).
- ``selective_keep_mm``: the same, but *every* matmul's output is kept (the MoE experts' grouped matmuls are
  kept by both): less recomputation, more memory, for a run whose memory allows it.

Each choice of the selective policies, and why (``SAVED_COLLECTIVES``, ``MATMUL_COUNTS``; mesh/activation_checkpoint.py's
``SAVE_OPS`` lists the ops):

- ``reduce_scatter`` and ``all_to_all`` outputs are kept: a reduce-scatter's output is a shard (1/t of the
  sequence under SP), cheap to hold and a collective to redo; an all-to-all moves tokens by a routing that depends
  on the data (EP's count and token exchanges): kept, the recomputed block gets the forward's tokens without
  exchanging anything again.
- ``all_gather`` and ``all_reduce`` outputs are recomputed (run again in backward, on every rank alike, so no
  rank waits alone): each is a whole-sequence tensor (SP's gathered norm output, an all-reduced partial sum
  without SP), the largest thing a TP block could keep; recomputing it costs the same bytes on the wire again.
- ``max`` is kept: one number per reduction, and a low-precision recipe's scale (its amax) must be the forward's.
- ``mm`` and ``addmm`` are counted apart: the every-second rule numbers each op on its own count, so a bias on
  wq, wk, wv (``model.qkv_bias``: they run as ``addmm``) does not shift which of the other matmuls are kept.
- device-to-host copies (``_to_copy`` from an accelerator to the CPU) are kept: recomputing one would be a second
  blocking host read in backward, and the host must see the forward's numbers.

Under tensor parallelism both selective policies recompute the row-parallel matmuls (wo, a dense block's w2),
whose whole-sequence partial sum the collective after them consumes (mesh/activation_checkpoint.py's docstring
explains why).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    """What a policy keeps. ``matmuls``: "all" (every mm/addmm output), "odd" (the 1st, 3rd, ... of each kind in the
    block's forward), "none"; ``others``: attention, reduce-scatters and all-to-alls, routing, amax and host copies
    (``SAVE_OPS`` besides the matmuls)."""

    checkpointed: bool  # the block is wrapped: what is not kept is recomputed in backward
    matmuls: str
    others: bool
    what: str


POLICIES = {
    "none": Policy(False, "all", True, "no checkpointing: autograd keeps what every op saves"),
    "full": Policy(True, "none", False, "the block's input only; everything recomputed"),
    "selective": Policy(
        True, "odd", True, "every second matmul, attention, reduce-scatters and all-to-alls, routing (torchtitan)"
    ),
    "selective_keep_mm": Policy(True, "all", True, "every matmul, attention, reduce-scatters and all-to-alls, routing"),
}
SELECTIVE = tuple(name for name, p in POLICIES.items() if p.checkpointed and p.others)
# What the selective policies keep besides matmuls and attention (module docstring): the collectives by kind,
# the routing, amax, host copies. All-gather and all-reduce outputs are recomputed.
SAVED_COLLECTIVES = ("reduce_scatter", "all_to_all")
MATMUL_COUNTS = ("mm", "addmm")  # each numbered on its own count by the every-second rule


def keeps_matmul(mode: str, index: int, row_parallel: bool = False) -> bool:
    """Whether ``mode`` keeps the output of the block's ``index``-th matmul of its kind (1-based, in forward order,
    ``mm`` and ``addmm`` counted apart); ``row_parallel``: a row-parallel linear under TP, which no selective policy
    keeps."""
    policy = POLICIES[mode]
    if not policy.checkpointed:
        return True
    if row_parallel or policy.matmuls == "none":
        return False
    return policy.matmuls == "all" or index % 2 == 1
