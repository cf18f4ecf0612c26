"""The pipeline split: which contiguous layers each stage holds, decided before any process group exists.

``split_layers`` implements ``parallel.pp_split`` (mesh/pipeline.py, step 1): ``params`` balances parameter
counts, ``flops`` balances per-token FLOPs (the embedding lookup is free, the head is a big matmul, attention
adds its seq_len term), ``memory`` balances each pipeline rank's estimated peak memory (``memory_split``:
states plus activations times the micro-batches in flight under the schedule, planning/memory_estimate.py),
or an explicit list of layers per stage such as ``"3,5"``. Every policy but the explicit list cuts the layers
by exact dynamic programming over the cut points (``minmax_split``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from mesh.pipeline import stage_ids_of_rank
from models.flops import head_flops_per_token, layer_flops_per_token
from planning.memory_estimate import (
    block_parameters,
    gathered_bytes,
    last_stage_held,
    layer_activation_bytes,
    logits_bytes,
    rank_memory,
    stage_chunks_in_flight,
    stage_parameters,
    states_bytes,
)

if TYPE_CHECKING:
    from models.llama import ModelArgs
    from planning.layout import Layout


def layer_costs(args: ModelArgs, policy: str, seq_len: int) -> tuple[list[float], float, float]:
    """Cost of each layer, plus the first stage's (embedding) and the last's (norm + head): ``params`` counts every
    expert (all in memory), ``flops`` only the active ones."""
    if policy == "params":
        head = args.vocab_size * args.dim
        return [float(args.layer_params(i)) for i in range(args.n_layers)], float(head), float(head + args.dim)
    layers = [float(layer_flops_per_token(args, i, seq_len)) for i in range(args.n_layers)]
    return layers, 0.0, float(head_flops_per_token(args))


def minmax_split(n_layers: int, n_stages: int, stage_cost: Callable[[int, int, int], float]) -> list[int]:
    """Layers per stage, contiguous, >= 1 each, minimising the largest ``stage_cost(s, i, j)`` (stage s holding
    layers i..j-1) by exact dynamic programming over the cut points."""
    n, inf = n_layers, float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for j in range(s, n - (n_stages - s) + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], stage_cost(s - 1, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    sizes, j = [], n
    for s in range(n_stages, 0, -1):
        sizes.append(j - cut[s][j])
        j = cut[s][j]
    return sizes[::-1]


def balanced_split(costs: list[float], first_extra: float, last_extra: float, n_stages: int) -> list[int]:
    """Layers per stage, contiguous, >= 1 each, minimising the most expensive stage (exact DP)."""
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(s: int, i: int, j: int) -> float:
        extra = (first_extra if s == 0 else 0.0) + (last_extra if s == n_stages - 1 else 0.0)
        return prefix[j] - prefix[i] + extra

    return minmax_split(len(costs), n_stages, stage_cost)


def stages_of(sizes: list[int]) -> list[list[int]]:
    """Layer ids of each stage from the layers per stage."""
    bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    return [list(range(bounds[k], bounds[k + 1])) for k in range(len(sizes))]


def rank_peaks(args: ModelArgs, layout: Layout, sizes: list[int], schedule: str) -> list[float]:
    """Each pipeline rank's estimated peak bytes (planning/memory_estimate.py: rank_memory) under the split ``sizes``."""
    stages, pp = stages_of(sizes), layout.pp
    n_local = len(sizes) // pp
    return [rank_memory(args, layout, stages, r, stage_ids_of_rank(r, pp, n_local, schedule)).total for r in range(pp)]


def memory_split(args: ModelArgs, layout: Layout, n_stages: int, schedule: str) -> list[int]:
    """Layers per stage that make the pipeline ranks' peak memory (``rank_memory``) as even as whole layers allow. Split
    each rank's peak into its stages' shares and minimise the largest (``minmax_split``, exact); with several stages per
    rank, then move one cut by one layer while the sorted peaks get lexicographically smaller."""
    pp = layout.pp
    n_local = n_stages // pp
    checkpointed = layout.activation_checkpoint != "none"
    fixed, acts, rebuilt = [], [], []
    for i in range(args.n_layers):
        fixed.append(
            states_bytes(args, layout, block_parameters(args, i)) + gathered_bytes(args, layout, [i], False, False)
        )
        acts.append(layer_activation_bytes(args, i, layout))
        rebuilt.append(layer_activation_bytes(args, i, layout, "none") - acts[-1] if checkpointed else 0.0)
    ends = {  # the embedding on the first stage; final norm, head and logits on the last
        "first": states_bytes(args, layout, stage_parameters(args, [], True, False))
        + gathered_bytes(args, layout, [], True, False),
        "last": states_bytes(args, layout, stage_parameters(args, [], False, True))
        + gathered_bytes(args, layout, [], False, True)
        + logits_bytes(args, layout, last_stage_held(layout)),
    }
    # each stage's own chunks in flight (memory_estimate.py: stage_chunks_in_flight): a rank's stages hold different
    # counts (the interleaved last rank: every micro-batch of its first stage, one of its second)
    held = {
        s: n
        for r in range(pp)
        for s, n in zip(
            stage_ids_of_rank(r, pp, n_local, schedule),
            stage_chunks_in_flight(schedule, pp, r, layout.pp_microbatches, n_local),
            strict=True,
        )
    }

    def share(s: int, i: int, j: int) -> float:  # step 1
        cost = sum(fixed[i:j]) + held[s] * sum(acts[i:j]) + max(rebuilt[i:j])
        return cost + (ends["first"] if s == 0 else 0.0) + (ends["last"] if s == n_stages - 1 else 0.0)

    sizes = minmax_split(args.n_layers, n_stages, share)  # step 2
    if n_local == 1:
        return sizes
    score = sorted(rank_peaks(args, layout, sizes, schedule), reverse=True)
    improved = True
    while improved:  # step 3
        improved = False
        # one layer from any stage j to any stage k: with per-stage counts in flight a rank's peak weighs its stages
        # differently, and moves between neighbours alone stopped short of the best cut
        for k, j in itertools.permutations(range(n_stages), 2):
            trial = list(sizes)
            trial[k], trial[j] = trial[k] + 1, trial[j] - 1
            if min(trial) < 1:
                continue
            trial_score = sorted(rank_peaks(args, layout, trial, schedule), reverse=True)
            if trial_score < score:
                sizes, score, improved = trial, trial_score, True
    return sizes


def split_layers(
    args: ModelArgs, n_stages: int, policy: str, seq_len: int, layout: Layout | None = None
) -> list[list[int]]:
    """Layer indices of each stage under ``policy`` (params | flops | memory | "n0,n1,..."); ``memory`` needs
    the ``layout`` whose peaks it balances."""
    if policy in ("params", "flops"):
        sizes = balanced_split(*layer_costs(args, policy, seq_len), n_stages)
    elif policy == "memory":
        if layout is None:
            raise ValueError("pp_split 'memory' needs the Layout whose ranks it balances")
        sizes = memory_split(args, layout, n_stages, layout.pp_schedule)
    else:
        sizes = [int(x) for x in policy.split(",")]
    return stages_of(sizes)
