"""Replica check: the ranks that should hold the same values of a parameter compare checksums of them.

Tests prove that every layout trains the same model as one process, but nothing in a user's run notices
when replicas that should be identical drift apart: a norm weight initialised differently on one tensor-
parallel rank, one HSDP replica loaded from another checkpoint, a bit flipped in one GPU's memory. Such a run
trains on, a little worse, and nobody knows why. ``debug.check_replicas N`` runs this check every N steps,
after the optimizer step (``debug.check_replicas_action``: stop with exit 4, or warn and go on).

Which ranks must agree (``replica_groups``): a parameter is replicated over the mesh dims where its
placement is ``Replicate``:

- a DTensor: each dim of its own mesh with a ``Replicate()`` placement (norm weights under TP/SP on ``tp``;
  every FSDP shard under HSDP on ``dp_replicate``; expert weights under HSDP on the replicate part of their
  mesh). The ranks that differ only in that coordinate hold the same local tensor (the same shard);
- a plain tensor (DDP's replicated model under PowerSGD, a norm that TP left alone): every world mesh dim
  but ``pp`` (pipeline stages hold different layers).

The algorithm, once per check:

1. Checksum every parameter's local values on the device: the bits of each element as an integer, weighted
   by its position (so that swapped elements count), summed in int64. Integer sums are exact and do not
   depend on the order in which a kernel adds them, so two ranks get the same checksum exactly when their
   values are bitwise equal (up to a checksum collision).

2. For each replica group this rank belongs to, in one global order (sorted by the group's ranks, so that no
   two ranks wait on each other's groups in opposite orders), stack the checksums of the parameters that
   are replicated over it and all-reduce ``[c, -c]`` with MAX on that group: one collective gives the
   largest and the smallest checksum of every parameter. They differ exactly where some replica disagrees.
   The collective runs on the device plane, on the group the parameters live on (NCCL on GPUs), with the
   checksums on the device.
3. Only for a group with a mismatch, all-gather its checksums (the failure path) and name, for each
   parameter that differs, the coordinates along that dim whose checksum differs from the majority's.
4. Agree, over the control plane, on whether any rank found a mismatch; if one did, gather the lines, so
   that every rank (also those outside the disagreeing groups, which would otherwise go on and wait in the
   next collective) reports the same first line and stops or warns together.

Exact comparison, not a tolerance: replicas are bitwise equal in every meshloom layout by construction. They
start from the same bits (materialize_weights builds every parameter from (seed, name) on every rank), and
each step applies the same bits to them: a gradient reduced by an all-reduce arrives bitwise identical on
every rank of the group (the reduced chunks are computed once and copied around, in gloo and NCCL alike),
the clipping coefficient is computed from the same all-reduced norm, and AdamW is elementwise and
deterministic for equal inputs on the same kind of device. A difference of one bit therefore already means
that something other than training changed a replica. (Ranks on different kinds of GPU in one job could
round differently; meshloom does not support mixing them.)

Cost: one pass over this rank's parameters (an integer copy of each, one at a time) plus one small
all-reduce per replica group and one control-plane scalar: measure/replica_check.py prints it against the step
time (docs/troubleshooting.md, "Replicas that disagree").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mesh.private_api import all_gather_into
from models.local_tensor import local_tensor
from observers.base import Observer, RunContext
from runtime.failures import phase

# Position weights repeat with this period (a prime, so that a period rarely lines up with a tensor's rows).
_WEIGHT_PERIOD = 8191
# Keep checksums in 62 bits: their negation for the MIN-by-MAX trick of step 2 cannot overflow.
_MASK = (1 << 62) - 1
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicaMismatchError(RuntimeError):
    """Replicated parameters disagree across ranks (train.main exits with code 4)."""


@dataclass(frozen=True)
class ReplicaGroup:
    """The ranks that must hold equal values of some parameters: one mesh dim seen from this rank."""

    ranks: tuple[int, ...]  # global ranks, in the order of their coordinate along the dim
    dim_name: str
    group: object  # the process group of that mesh dim


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """Step 1: an int64 checksum of ``tensor``'s bits (0-d, on its device); equal bits give equal checksums."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=flat.device)
    bits = flat.view(_INT_OF_SIZE[flat.element_size()]).to(torch.int64)
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64).remainder_(_WEIGHT_PERIOD).add_(1)
    return bits.mul_(weights).sum().bitwise_and_(_MASK)  # int64 overflow wraps, the same on every rank


def _group_of(mesh, dim: int) -> ReplicaGroup:
    group = mesh.get_group(dim)
    names = mesh.mesh_dim_names or ()
    name = names[dim] if dim < len(names) else f"dim{dim}"
    return ReplicaGroup(tuple(dist.get_process_group_ranks(group)), name, group)


def replica_groups(param: torch.Tensor, world_mesh) -> list[ReplicaGroup]:
    """The replica groups of size > 1 over which ``param`` must be equal (module docstring)."""
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        dims = [d for d, placement in enumerate(param.placements) if placement.is_replicate()]
    else:
        mesh = world_mesh
        dims = [d for d, name in enumerate(mesh.mesh_dim_names) if name != "pp"]
    return [_group_of(mesh, d) for d in dims if mesh.size(d) > 1]


def _disagreeing(values: list[int]) -> tuple[list[int], list[int]]:
    """(coordinates that disagree, coordinates of the majority); a tie goes to the value coordinate 0 holds."""
    counts: dict[int, list[int]] = {}
    for coord, value in enumerate(values):
        counts.setdefault(value, []).append(coord)
    majority = max(counts.values(), key=lambda coords: (len(coords), -coords[0]))
    return [c for c in range(len(values)) if c not in majority], majority


def compare_replicas(
    named_params: list[tuple[str, torch.Tensor]],
    world_mesh,
    device: torch.device,
    control,
    step: int,
    extra: list[tuple[str, torch.Tensor, ReplicaGroup]] = (),
) -> list[str]:
    """Steps 1-4: the whole world's mismatch lines, the same on every rank. ``extra``: copies that no mesh dim
    describes, each with its group (``tied_replicas``)."""
    # Step 1, grouped by replica group (the same parameters in the same order on every rank of a group: the
    # ranks of a replica group hold the same parts of the model).
    by_group: dict[tuple[int, ...], tuple[ReplicaGroup, list[str], list[torch.Tensor]]] = {}
    entries = [(name, param, replica_groups(param, world_mesh)) for name, param in named_params]
    entries += [(name, tensor, [group]) for name, tensor, group in extra if group.group is not None]
    for name, param, groups in entries:
        if not groups:
            continue
        value = checksum(local_tensor(param)).to(device)
        for g in groups:
            by_group.setdefault(g.ranks, (g, [], []))
            by_group[g.ranks][1].append(name)
            by_group[g.ranks][2].append(value)
    lines: list[str] = []
    # Copies on this rank alone (a tied weight's two ends on one rank): compared here, no collective.
    local: dict[str, list[tuple[str, int]]] = {}
    for name, tensor, group in extra:
        if group.group is None:
            local.setdefault(name, []).append((group.dim_name, int(checksum(local_tensor(tensor)))))
    for name, copies in local.items():
        if len({value for _, value in copies}) > 1:
            lines.append(
                f"replica check at step {step}: parameter {name} differs between its copies on rank "
                f"{dist.get_rank() if dist.is_initialized() else 0} ({', '.join(f'{where}: {value:#x}' for where, value in copies)})"
            )
    for ranks in sorted(by_group):  # step 2, in one global order
        g, names, values = by_group[ranks]
        sums = torch.stack(values)
        extremes = torch.cat([sums, -sums])
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=g.group)
        high, low = extremes[: len(names)], -extremes[len(names) :]
        differs = (high != low).tolist()
        if not any(differs):
            continue
        # Step 3 (failure path only): every coordinate's checksums, to name the ones that disagree.
        gathered = torch.empty(len(ranks) * len(names), dtype=torch.int64, device=sums.device)
        all_gather_into(gathered, sums, group=g.group)
        table = gathered.view(len(ranks), len(names)).tolist()
        for i, name in enumerate(names):
            if differs[i]:
                odd, majority = _disagreeing([row[i] for row in table])
                lines.append(
                    f"replica check at step {step}: parameter {name} differs across mesh dim {g.dim_name} "
                    f"(global ranks {','.join(map(str, ranks))}): {g.dim_name} coordinates "
                    f"{','.join(map(str, odd))} disagree with {','.join(map(str, majority))} "
                    f"(checksums {', '.join(f'{c}: {row[i]:#x}' for c, row in enumerate(table))})"
                )
    # Step 4: one scalar on the control plane decides for everyone; the lines travel only on a mismatch.
    if not control.any_true(bool(lines)):
        return []
    everyone = control.all_gather_object(lines)
    return sorted({line for rank_lines in everyone for line in rank_lines})


def check_replicas(
    named_params: list[tuple[str, torch.Tensor]],
    world_mesh,
    device: torch.device,
    control,
    step: int,
    action: str = "stop",
    extra: list[tuple[str, torch.Tensor, ReplicaGroup]] = (),
) -> list[str]:
    """Compare the replicas (``compare_replicas``); on a mismatch print one line on every rank, then raise
    ``ReplicaMismatchError`` (``action="stop"``) or go on (``"warn"``). Returns the mismatch lines."""
    lines = compare_replicas(named_params, world_mesh, device, control, step, extra)
    if not lines:
        return lines
    more = f" ({len(lines) - 1} more mismatches)" if len(lines) > 1 else ""
    fix = (
        "replicas that should be identical diverged (a different init, a rank that loaded other weights, "
        "a corrupted device); the rank(s) named hold the odd copy: find what touched them, then resume from "
        "the last checkpoint saved before this step (docs/troubleshooting.md, Replicas that disagree)."
    )
    if action == "stop":
        raise ReplicaMismatchError(f"{lines[0]}{more}; {fix}")
    print(f"meshloom: warning: {lines[0]}{more}", flush=True)
    return lines


# ---- tied embeddings across pipeline stages -----------------------------------------------------------------


def tied_replicas(copies: list[tuple[str, torch.Tensor]], group) -> list[tuple[str, torch.Tensor, ReplicaGroup]]:
    """``extra`` entries for a tied weight's pipeline copies: ``copies``, this rank's (kind, parameter) pairs, and
    ``group``, the embedding group (None when both ends are on this rank: compared without a collective)."""
    name = "tok_embeddings.weight (tied: embedding and head copies)"
    if not copies:
        return []
    if group is None:  # both ends on this rank
        return [(name, param, ReplicaGroup((), kind, None)) for kind, param in copies]
    ranks = tuple(dist.get_process_group_ranks(group))
    return [(name, param, ReplicaGroup(ranks, "pp (tied embedding group)", group)) for _, param in copies]


def for_run(ctx: RunContext) -> ReplicaCheck | None:
    """On with ``debug.check_replicas`` (every that many steps)."""
    d = ctx.cfg.debug
    if not d.check_replicas:
        return None
    return ReplicaCheck(
        d.check_replicas,
        d.check_replicas_action,
        ctx.step.parts,
        ctx.step.meshes.world,
        ctx.step.tied,
        ctx.step.device,
        ctx.control,
    )


class ReplicaCheck(Observer):
    """``debug.check_replicas = N``: every N steps, after timing and before logging or saving, compare the replicas."""

    def __init__(self, every: int, action: str, parts, world_mesh, tied, device: torch.device, control):
        self.every, self.action, self.world_mesh, self.device, self.control = every, action, world_mesh, device, control
        self.named_params = [(name, p) for part in parts for name, p in part.named_parameters()]
        self.tied = tied

    def after_step(self, step: int) -> None:
        if step % self.every:
            return
        with phase(f"step {step}: replica check", "device plane: each replica group; control plane"):
            extra = tied_replicas(self.tied.copies, self.tied.group)
            check_replicas(
                self.named_params, self.world_mesh, self.device, self.control, step, self.action, extra=extra
            )
