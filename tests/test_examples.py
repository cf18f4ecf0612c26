"""Every script in examples/ runs (on gloo ranks, through the harness) and prints what its docstring says.

The from-scratch scripts also check themselves against one process; tests/test_from_scratch.py compares
them with meshloom's API path. One test launches a script through the real ``torchrun`` command line.
"""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from examples import (
    collectives,
    ddp_from_scratch,
    ddp_no_sync,
    device_mesh,
    dtensor_placements,
    hello_ranks,
    loss_bookkeeping,
    mixed_precision_fp16,
    moe_from_scratch,
    pipeline_1f1b_from_scratch,
    ring_allreduce,
    ring_attention_from_scratch,
    tp_from_scratch,
    zero1_from_scratch,
    zero3_from_scratch,
)
from launch.local_runs import ROOT
from launch.spawn import run_on_ranks

# Run on the oldest and the newest supported torch too (.ci/compat).
pytestmark = pytest.mark.compat

EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py") if not p.stem.startswith("_"))


def test_every_example_is_tested_here():
    tested = {
        m.__name__.split(".")[-1]
        for m in (
            collectives,
            ddp_from_scratch,
            ddp_no_sync,
            device_mesh,
            dtensor_placements,
            hello_ranks,
            loss_bookkeeping,
            mixed_precision_fp16,
            moe_from_scratch,
            pipeline_1f1b_from_scratch,
            ring_allreduce,
            ring_attention_from_scratch,
            tp_from_scratch,
            zero1_from_scratch,
            zero3_from_scratch,
        )
    }
    assert tested == set(EXAMPLES), f"examples without a test: {set(EXAMPLES) - tested}"


def test_hello_ranks():
    for rank, r in enumerate(run_on_ranks(hello_ranks.run, 2)):
        assert r["rank"] == rank and r["world_size"] == 2 and r["backend"] == "gloo"
        assert r["env"]["RANK"] == str(rank) and r["sum_of_ranks"] == 0 + 1


def test_collectives_move_the_numbers_where_the_docs_say():
    n = 2
    xs = [collectives.start(r, n) for r in range(n)]
    total = sum(xs)
    for rank, r in enumerate(run_on_ranks(collectives.run, n)):
        assert r["broadcast"] == xs[0].tolist()
        assert r["reduce"] == (total.tolist() if rank == 0 else None)
        assert r["all_reduce"] == total.tolist()
        assert r["reduce_scatter"] == total[2 * rank : 2 * rank + 2].tolist()  # chunk r of the sum
        assert r["all_gather"] == torch.cat([xs[j][2 * j : 2 * j + 2] for j in range(n)]).tolist()
        assert r["all_to_all"] == torch.cat([xs[j][2 * rank : 2 * rank + 2] for j in range(n)]).tolist()
    assert run_on_ranks(collectives.run, n)[1]["send_recv"] == xs[0].tolist()


def test_ring_all_reduce_sends_2_n_minus_1_over_n_of_the_data():
    for r in run_on_ranks(ring_allreduce.run, 4, 1200):
        assert r["max_error"] < 1e-12  # float64 sums of 4 terms in another order
        assert r["elements_sent"] == 2 * 3 * 1200 // 4 == r["2(n-1)/n*N"]


def test_device_mesh_is_a_row_major_grid_with_a_group_per_row_and_column():
    results = run_on_ranks(device_mesh.run, 4)
    for rank, r in enumerate(results):
        row, col = divmod(rank, 2)
        assert r["grid"] == [[0, 1], [2, 3]] and list(r["coordinate (dp, tp)"]) == [row, col]
        assert r["my tp group"] == [2 * row, 2 * row + 1] and r["my dp group"] == [col, col + 2]
        assert r["sum over tp"] == 4 * row + 1 and r["sum over dp"] == 2 * col + 2


def test_dtensor_redistribute_costs():
    for rank, r in enumerate(run_on_ranks(dtensor_placements.run, 2)):
        assert r["redistribute"] == {
            "Shard(0) -> Replicate()": ["all_gather_into_tensor x1"],
            "Partial() -> Replicate()": ["all_reduce x1"],
            "Partial() -> Shard(0)": ["reduce_scatter_tensor x1"],
            "Replicate() -> Shard(0)": ["no communication"],
            "Shard(0) -> Shard(1)": ["all_gather_into_tensor x1"],  # gloo has no all-to-all for DTensor
        }
        assert r["local piece of Shard(0)"] == torch.arange(16.0).view(4, 4)[2 * rank : 2 * rank + 2].tolist()
        # 8 rows in 2 x 2 blocks of 2: rank 0 keeps blocks 0 and 2, rank 1 blocks 1 and 3
        assert r["_StridedShard(0, split_factor=2) rows"] == [[0.0, 1.0, 4.0, 5.0], [2.0, 3.0, 6.0, 7.0]][rank]
        local, reduced, reference = r["norm: local piece, reduced, reference"]
        assert r["norm placement"].startswith("_NormP") and r["norm reduction"] == ["all_reduce x1"]
        assert local < reference and reduced == pytest.approx(reference, rel=1e-6)


def test_loss_bookkeeping_global_count_and_sum_is_exact():
    for r in run_on_ranks(loss_bookkeeping.run, 2):
        assert r["global count, summed: max error"] < 1e-6  # same sums in another order
        assert r["per-rank mean, averaged: max error"] > 1e-3  # 2 and 5 tokens weighted equally: wrong


def test_no_sync_skips_the_reduction_only_when_the_forward_runs_inside_it():
    for r in run_on_ranks(ddp_no_sync.run, 2):
        assert r["no no_sync: all-reduces"] == 2
        assert r["backward inside, forward outside: all-reduces"] == 2  # the misuse: nothing saved
        assert r["forward and backward inside: all-reduces"] == 1
        assert r["same final gradient"]


# One rank of _launch.main whose run() leaves a DDP model in a reference cycle, with automatic collection off:
# it prints whether that model (and so its reducer, which holds the gloo group) was still alive when
# destroy_process_group ran.
LEFT_IN_A_CYCLE = """
import gc, json, weakref
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from examples import _launch

gc.disable()
seen, refs, destroy = {}, [], dist.destroy_process_group

def spying_destroy():
    seen["ddp alive at destroy"] = refs[0]() is not None
    destroy()

def run():
    model = DDP(nn.Linear(2, 1))
    model.__dict__["cycle"] = [model]
    refs.append(weakref.ref(model))
    return {}

dist.destroy_process_group = spying_destroy
_launch.main(run)
print(json.dumps(seen))
"""


def test_the_examples_group_is_destroyed_after_the_ddp_models_that_hold_it():
    """examples/ddp_no_sync.py aborted at exit now and then ("terminate called without an active exception",
    SIGABRT; 3 of 25 torchrun runs on torch 2.15 here, 0 of 20 after the fix): a DDP model in a reference cycle
    kept its reducer, and the reducer the gloo group, alive past destroy_process_group, so the group's threads met
    interpreter shutdown. examples/_launch.py collects the cycles first."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    done = subprocess.run(
        [sys.executable, "-c", LEFT_IN_A_CYCLE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"ddp alive at destroy": False}


def test_mixed_precision_fp16_underflow_loss_scaling_and_grad_scaler():
    # One process, no process group: the script does not communicate.
    r = mixed_precision_fp16.run()
    f = r["formats"]
    assert [f[n]["bits of 0.1"] for n in ("fp32", "bf16", "fp16")] == [
        "0 01111011 10011001100110011001101",
        "0 01111011 1001101",
        "0 01011 1001100110",
    ]
    assert f["bf16"]["eps (gap after 1.0)"] == 2**-7 and f["fp16"]["eps (gap after 1.0)"] == 2**-10
    assert f["fp16"]["largest"] == 65504 and f["bf16"]["smallest normal"] == f["fp32"]["smallest normal"]
    # 1,000 additions of 0.001: bf16 never moves (0.001 is under half its gap at 1.0), fp16 drifts, fp32 is close
    sums = {n: f[n]["1.0 + 1000 x 0.001"] for n in f}
    assert sums["bf16"] == 1.0 and abs(sums["fp32"] - 2.0) < 1e-4 and 1.9 < sums["fp16"] < 1.99
    # fp16 output gradients underflow, more as the loss falls; a 2^16 loss scale keeps them
    start, late = r["gradient damage at the start"], r["gradient damage after 60 fp32 steps"]
    assert 0 < start["unscaled"]["output gradients zero"] < late["unscaled"]["output gradients zero"]
    assert late["unscaled"]["output gradients zero"] > 0.5 and late["scaled 2^16"]["output gradients zero"] == 0
    for d in (start, late):
        assert d["unscaled"]["weight-gradient error"] > 5 * d["scaled 2^16"]["weight-gradient error"]
    # dynamic scaling from 2^40: every early step overflows and is skipped, halving the scale, until it fits
    skipped = r["skipped steps (by hand)"]
    assert skipped == list(range(1, len(skipped) + 1)) and len(skipped) >= 5
    scales = r["loss scale at steps 1-16 (by hand, from 2^40)"].split()
    assert scales[: len(skipped) + 1] == [f"2^{40 - i}" for i in range(len(skipped) + 1)]
    assert r["by hand equals GradScaler"]  # the same scales, the same skipped steps, the same losses
    gap = r["largest relative loss difference from fp32"]
    assert float(gap["fp16, scaled"]) < 2e-3 and float(gap["fp16, unscaled"]) > 5 * float(gap["fp16, scaled"])


def check_ddp(results):
    for r in results:
        assert r["max grad error"] < 1e-6
        assert r["all-reduces launched"] == len(r["buckets"]) > 1  # one all-reduce per bucket


def check_zero1(results):
    for r in results:
        assert r["max parameter difference after 3 steps"] < 1e-6
        held, total = r["Adam moment elements here / for the whole model"]
        assert held == total // 2  # 2 ranks: half the Adam state each


def check_zero3(results):
    for r in results:
        assert r["output error"] < 1e-6 and r["gradient error"] < 1e-6
        held, total = r["parameters held here / in the model"]
        assert total <= 2 * held <= total + 2 * 3  # half the parameters, plus < 1 element of padding per unit


def check_tp(results):
    for r in results:  # the random weights here give outputs and gradients of order 1-10
        assert r["output error"] < 1e-5 and r["input-gradient error"] < 1e-5 and r["weight-gradient error"] < 1e-5
        assert r["local weight shapes (w1, w3, w2)"] == [(32, 16), (32, 16), (16, 32)]


def check_pipeline(results):
    assert [r["micro-batches held at most (p - rank)"] for r in results] == [2, 1]
    assert all(r["gradient error of my stage"] < 1e-6 for r in results)
    loss, reference = results[1]["loss (last rank) / one process"]
    assert loss == pytest.approx(reference, rel=1e-6)


def check_moe(results):
    for r in results:
        assert r["output error"] < 1e-6 and r["expert-gradient error"] < 1e-5
    assert sum(r["rows my experts received"] for r in results) == 2 * 6  # every token once, top-1


def check_context_parallel(results):
    assert [r["my positions"] for r in results] == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    for r in results:  # O(1) values, fp32 sums in another order: ~1e-7
        assert r["gathered output error"] < 1e-5 and r["ring output error"] < 1e-5
        assert max(r["gathered gradient error (q, k, v)"]) < 1e-5


@pytest.mark.parametrize(
    "module, check",
    [
        (ddp_from_scratch, check_ddp),
        (zero1_from_scratch, check_zero1),
        (zero3_from_scratch, check_zero3),
        (tp_from_scratch, check_tp),
        (pipeline_1f1b_from_scratch, check_pipeline),
        (moe_from_scratch, check_moe),
        (ring_attention_from_scratch, check_context_parallel),
    ],
    ids=["ddp", "zero1", "zero3", "tp", "pipeline_1f1b", "moe", "context_parallel"],
)
def test_from_scratch_examples_match_one_process(module, check):
    # Each example compares itself with one process on the whole batch: the same fp32 arithmetic summed in
    # another order, so differences are round-off (1e-9 to 1e-7 on O(1) values; larger values in tp/moe).
    check(run_on_ranks(module.run, 2))


def test_an_example_runs_under_torchrun():
    env_cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "examples/hello_ranks.py",
    ]
    out = subprocess.run(env_cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("'sum_of_ranks': 1.0") == 2 and "--- rank 1 ---" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_every_example_runs_under_torchrun(name):
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", f"examples/{name}.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--- rank 0 ---" in out.stdout and "--- rank 1 ---" in out.stdout
