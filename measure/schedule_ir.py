"""The order in which torch's pipeline schedules run their work, read from torch itself, without a real job.

torch 2.13's schedule classes compute, at construction, a per-rank list of actions (``pipeline_order``:
forward ``F``, full backward ``B``, input-gradient ``I`` and weight-gradient ``W`` halves, and DualPipeV's
``OVERLAP_F_B`` pairs) for *every* rank. Constructing one needs ``PipelineStage`` objects, which need a
process group; a one-process fake group (torch's testing backend ``fake``: collectives return at once) is
enough, since building a schedule communicates nothing. This module is the one place meshloom touches
these private pieces: ``torch.testing._internal.distributed.fake_pg``, ``pipeline_order`` and the fields of
``_Action``. tests/test_figures.py checks that they still look as read here, and that the order equals the
one a real 2-rank run records.

One repair: ``Schedule1F1B._get_pipeline_order`` numbers the last rank's forwards from 1, not 0 (its steady
state increments the micro-batch index before the first forward when there is no warm-up); the 1F1B runtime
does not use this list (it runs its own loop), so training is unaffected. We renumber that rank's forwards
in order of appearance, which is what the runtime does; the test pins the bug so that the repair is removed
when torch fixes it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from mesh.pipeline import SCHEDULE_FAMILIES
from mesh.private_api import fake_world  # torch's testing backend, wrapped where private APIs live


class Action(NamedTuple):
    kind: str  # F | B | I | W
    stage: int
    microbatch: int


def stage_ids(schedule: str, pp: int, v: int, rank: int) -> list[int]:
    """The stages torch's schedule expects on ``rank`` (looped: r, r+pp, ...; V-shaped: r, 2pp-1-r)."""
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(v)]


def raw_pipeline_order(schedule: str, pp: int, microbatches: int, v: int) -> dict[int, list]:
    """torch's ``pipeline_order`` for every rank (actions and ``None`` idle slots), as torch builds it."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    with fake_world(pp):
        stages = [PipelineStage(nn.Identity(), s, pp * v, torch.device("cpu")) for s in stage_ids(schedule, pp, v, 0)]
        cls = get_schedule_class(schedule)
        built = (
            cls(stages[0], n_microbatches=microbatches)
            if v == 1 and schedule in ("GPipe", "1F1B")
            else cls(stages, n_microbatches=microbatches)
        )
        return dict(built.pipeline_order)


def _flatten(action) -> list[Action]:
    """An ``_Action`` as our Actions: compute steps only; an OVERLAP_F_B pair becomes its two halves in order
    (torch 2.13's runtime runs them one after the other)."""
    kind = action.computation_type.value
    if kind == "OVERLAP_F_B":
        return [a for sub in action.sub_actions for a in _flatten(sub)]
    if kind in ("F", "B", "I", "W"):
        return [Action(kind, action.stage_index, action.microbatch_index)]
    return []  # REDUCE_GRAD, UNSHARD, ...: bookkeeping, not compute


def schedule_actions(schedule: str, pp: int, microbatches: int, v: int) -> dict[int, list[Action]]:
    """Per rank, the compute actions in the order torch's schedule runs them."""
    order = {
        rank: [a for action in actions if action is not None for a in _flatten(action)]
        for rank, actions in raw_pipeline_order(schedule, pp, microbatches, v).items()
    }
    if schedule == "1F1B":  # the repair described in the module docstring
        for rank, actions in order.items():
            forwards = iter(range(microbatches))
            order[rank] = [Action("F", a.stage, next(forwards)) if a.kind == "F" else a for a in actions]
    return order


# ---- an idealized run: every action takes its textbook time, communication is free --------------------------

UNIT_TIME = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # a backward is twice a forward; I and W split it evenly


class Timed(NamedTuple):
    rank: int
    action: Action
    start: float
    end: float


def simulate(actions: dict[int, list[Action]], stages_per_rank: int) -> list[Timed]:
    """Run each rank's actions in order, each as soon as its inputs exist: F(s, i) after F(s-1, i); the backward
    (B or I) of (s, i) after F(s, i) and after the backward of (s+1, i); W(s, i) after I(s, i). A stage is
    1/stages_per_rank of a rank's layers, so its actions take UNIT_TIME / stages_per_rank."""
    n_stages = 1 + max(a.stage for acts in actions.values() for a in acts)
    done: dict[tuple, float] = {}  # (kind, stage, microbatch) -> end time; B also counts as the input gradient
    clock = dict.fromkeys(actions, 0.0)
    position = dict.fromkeys(actions, 0)
    timed: list[Timed] = []
    while any(position[r] < len(acts) for r, acts in actions.items()):
        progressed = False
        for rank, acts in actions.items():
            while position[rank] < len(acts):
                a = acts[position[rank]]
                needs = []
                if a.kind == "F" and a.stage > 0:
                    needs = [("F", a.stage - 1, a.microbatch)]
                elif a.kind in ("B", "I"):
                    needs = [("F", a.stage, a.microbatch)]
                    if a.stage < n_stages - 1:
                        needs.append(("dX", a.stage + 1, a.microbatch))
                elif a.kind == "W":
                    needs = [("dX", a.stage, a.microbatch)]
                if any(n not in done for n in needs):
                    break  # wait for another rank
                start = max([clock[rank], *(done[n] for n in needs)])
                end = start + UNIT_TIME[a.kind] / stages_per_rank
                done[(a.kind, a.stage, a.microbatch)] = end
                if a.kind in ("B", "I"):
                    done[("dX", a.stage, a.microbatch)] = end
                clock[rank] = end
                position[rank] += 1
                timed.append(Timed(rank, a, start, end))
                progressed = True
        if not progressed:
            raise RuntimeError(
                f"the action lists deadlock: {[(r, actions[r][position[r]]) for r in actions if position[r] < len(actions[r])]}"
            )
    return timed


def idle_fraction(timed: list[Timed]) -> float:
    """Mean over ranks of the idle share of the step, the step being the first start to the last end."""
    span = max(t.end for t in timed) - min(t.start for t in timed)
    ranks = {t.rank for t in timed}
    busy = {r: sum(t.end - t.start for t in timed if t.rank == r) for r in ranks}
    return sum(1 - busy[r] / span for r in ranks) / len(ranks)


def activations_in_flight(actions: list[Action]) -> int:
    """Most (stage, micro-batch) chunks whose forward has run and whose backward (B or I) has not started."""
    held, most = set(), 0
    for a in actions:
        if a.kind == "F":
            held.add((a.stage, a.microbatch))
            most = max(most, len(held))
        elif a.kind in ("B", "I"):
            held.discard((a.stage, a.microbatch))
    return most


# stages per rank of every schedule, from mesh/pipeline.py's one table of schedule families
SCHEDULE_STAGES = {name: family.natural_stages_per_rank for name, family in SCHEDULE_FAMILIES.items()}


def pipeline_ideal(schedule: str, pp: int, microbatches: int) -> dict:
    v = SCHEDULE_STAGES[schedule]
    actions = schedule_actions(schedule, pp, microbatches, v)
    timed = simulate(actions, v)
    return {
        "timed": timed,
        "idle": idle_fraction(timed),
        "in_flight": [activations_in_flight(actions[r]) for r in sorted(actions)],
        "v": v,
    }
