"""Host syncs per training step, per layout, counted and pinned: the test fails if one is added anywhere.

measure/host_syncs.py trains each layout for 2 and for 3 steps under measure/host_syncs.HostSyncCounter and
takes the difference: one step's syncs, by the meshloom line they come from. ``PER_STEP`` below is today's
count on every rank; ``measure.host_syncs.REASONS`` says why each one is there (docs/profiling.md prints the
table). A new sync, or one more of an old kind, fails here; so does one fewer (then lower the number here
and in the docs). The counter itself is checked on ops whose syncs are known.
"""

from __future__ import annotations

import pytest
import torch

from measure.host_syncs import (
    CAPACITY,
    EMBEDDING_MASK,
    EP_SPLITS,
    EXPERT_LOAD,
    LAYOUTS,
    LOSS,
    REASONS,
    STOP_AGREEMENT,
    HostSyncCounter,
    device_syncs,
    measure,
)


def test_the_counter_sees_each_kind_of_host_sync_and_nothing_else():
    x = torch.arange(6.0)
    with HostSyncCounter() as syncs:
        x.sum().item(), bool(x[0]), float(x[1])  # three scalar reads
        x.nonzero(), x[x > 2], torch.bincount(x.long()), torch.repeat_interleave(x, x.long())  # data-sized outputs
        x.tolist(), x.numpy(), x.cpu()  # copies to the host
        # none of these waits for the device: sizes known in advance
        torch.repeat_interleave(x, x.long(), output_size=15), x.repeat_interleave(2), x[x.argsort()], x * 2
    assert {op: n for (_, op), n in syncs.counts.items()} == {
        "_local_scalar_dense": 3,
        "nonzero": 1,
        "boolean index": 1,
        "bincount": 1,
        "repeat_interleave": 1,
        "tolist": 1,
        "numpy": 1,
        "cpu": 1,
    }


# One training step (debug model, 2 layers, one micro-batch per rank) on each rank, by site. AdamW is fused: its
# step counters live on the device, and it obeys the divergence flag without a host read (training/step.py).
_DENSE = {LOSS: 1, STOP_AGREEMENT: 1}  # a log step (run.log_every 1): it also agrees on stopping
_MOE = {LOSS: 1, STOP_AGREEMENT: 1, EXPERT_LOAD: 1}
_MOE_ORDINARY: dict = {}  # the load read on log steps only, the bias update obeying the flag on the device
PER_STEP = {
    "one process": [_DENSE],
    "log every 10": [{}],  # an ordinary step: not logged, no agreement (run.agree_every 5), no save: no read
    "log every 10 bf16": [{}],
    "fsdp2 log every 10": [{}, {}],
    "fsdp2": [_DENSE, _DENSE],
    "tp2": [{**_DENSE, EMBEDDING_MASK: 1}] * 2,
    "pp2": [_DENSE, _DENSE],
    "cp2 ring": [_DENSE, _DENSE],  # ring attention: no sync
    "cp2 allgather": [_DENSE, _DENSE],  # all-gather attention: no sync (no host index, no mask)
    "moe one process": [_MOE],  # dropless routing and grouped experts: no sync
    "moe capacity": [{**_MOE, CAPACITY: 2}],  # one per MoE layer
    "moe ep2": [{**_MOE, EP_SPLITS: 2}] * 2,  # one per MoE layer
    "moe log every 10": [_MOE_ORDINARY],
    "moe log every 10 bf16": [_MOE_ORDINARY],
}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return measure(list(PER_STEP), str(tmp_path_factory.mktemp("syncs")))


def test_every_layout_of_the_table_is_measured():
    assert set(PER_STEP) == set(LAYOUTS)


@pytest.mark.parametrize("layout", list(PER_STEP))
def test_host_syncs_per_step_are_as_documented(layout, measured):
    for rank, (counts, expected) in enumerate(zip(measured[layout], PER_STEP[layout], strict=True)):
        unexplained = set(counts) - set(REASONS)
        assert not unexplained, (
            f"{layout}, rank {rank}: a sync with no reason in measure.host_syncs.REASONS: {unexplained}"
        )
        assert counts == expected, (
            f"{layout}, rank {rank}: host syncs per step changed; measured {counts}, documented {expected}. "
            "Remove the new sync, or explain it in measure.host_syncs.REASONS and docs/profiling.md"
        )


def test_an_ordinary_dense_step_reads_nothing_on_the_host_and_a_log_step_once(measured):
    # a log step: the loss, the gradient norm and the divergence flag in one read (the agreement's read is of a
    # host tensor on a GPU); a step that is not logged, agreed on or saved: nothing, fp32 and bf16, 1 or 2 ranks
    for layout in ("one process", "fsdp2", "pp2", "cp2 ring", "cp2 allgather"):
        assert [device_syncs(c) for c in measured[layout]] == [1] * len(measured[layout]), layout
    for layout in ("log every 10", "log every 10 bf16", "fsdp2 log every 10"):
        assert [sum(c.values()) for c in measured[layout]] == [0] * len(measured[layout]), layout
    # MoE, dropless, no EP: nothing either; expert parallelism adds what its all-to-all needs, one read of the
    # split sizes per MoE layer (on every step)
    assert [sum(c.values()) for c in measured["moe log every 10"]] == [0]
    assert [device_syncs(c) for c in measured["moe ep2"]] == [1 + 1 + 2] * 2


def every_and_sparse_records(run_dir: str) -> tuple[list[dict], list[dict]]:
    """Rank body: the same 5 steps logged every step, and with run.log_every 3."""
    from launch.local_runs import run_training

    every = run_training({"model.n_layers": 2, "training.steps": 5}, f"{run_dir}/every")
    sparse = run_training({"model.n_layers": 2, "training.steps": 5, "run.log_every": 3}, f"{run_dir}/sparse")
    return every, sparse


def test_steps_between_log_steps_get_their_loss_norm_and_throughput_on_the_next_log_step(tmp_path):
    # run.log_every 3 over 5 steps: steps 1-2 are read with step 3, step 4 with step 5 (the last step is logged).
    # On a spawned rank: train() in the pytest process would leave its process group behind for other tests.
    from launch.local_runs import read_metrics
    from launch.spawn import run_on_ranks

    every, sparse = run_on_ranks(every_and_sparse_records, 1, str(tmp_path))[0]
    assert [r["loss"] for r in sparse] == [r["loss"] for r in every]  # the same numbers, read later
    assert [r["grad_norm"] for r in sparse] == [r["grad_norm"] for r in every]
    assert all(r["tokens_per_s"] > 0 for r in sparse)
    assert [r["step"] for r in read_metrics(tmp_path / "sparse")] == [3, 5]
