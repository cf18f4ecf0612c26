"""The replica check (observers/replica_check.py): a diverged replica is named and stops the run with exit 4.

Clean runs are checked after every step in the multi-rank parity runs (tests/training_runs.py:
``CHECK_REPLICAS``, used by the shared data-parallel and expert-parallel runs and by the TP, PP and CP
parity tests): no layout there reports a false positive, or its parity test fails.
"""

import contextlib
import io

import pytest
import torch

from launch.local_runs import DEBUG_CONFIG, train_on
from launch.spawn import run_on_ranks
from observers.replica_check import checksum
from tests.training_runs import CHECK_REPLICAS

# ---- the checksum ------------------------------------------------------------------------------------------


def test_the_checksum_is_exact_on_bits_and_sees_one_ulp_and_a_swap():
    x = torch.randn(1000)
    assert checksum(x) == checksum(x.clone())
    assert checksum(x) == checksum(x.flip(0).flip(0).contiguous())
    nudged = x.clone()
    nudged[500] = torch.nextafter(nudged[500], torch.tensor(float("inf")))  # one unit in the last place
    assert checksum(nudged) != checksum(x)
    swapped = x.clone()
    swapped[[3, 7]] = swapped[[7, 3]]
    assert checksum(swapped) != checksum(x)
    # the sum of the values in another order would differ in its last bits; the integer checksum cannot
    assert checksum(x.view(10, 100).t().contiguous().t()) == checksum(x.view(10, 100))
    assert checksum(torch.empty(0)) == 0
    assert checksum(x.to(torch.bfloat16)) != checksum(nudged.to(torch.float64))


# ---- an injected divergence --------------------------------------------------------------------------------

NORM = "layers.0.attention_norm.weight"


def run_with_a_perturbed_replica(argv: list[str], odd_rank: int) -> tuple[int, str, str]:
    """Rank body: ``train.main(argv)`` with ``NORM`` on global rank ``odd_rank`` nudged right after the weights
    are initialised (the article's LayerNorm initialised differently on one device); returns (exit code, stderr,
    stdout)."""
    import torch.distributed as dist

    import mesh.parallelize
    import train
    from mesh.materialize import materialize_weights

    def perturbed(model, *args, **kwargs):
        out = materialize_weights(model, *args, **kwargs)
        if dist.get_rank() == odd_rank:
            for name, p in model.named_parameters():
                if name == NORM:
                    with torch.no_grad():
                        local = p.to_local() if hasattr(p, "to_local") else p
                        local[0] += 1e-3
        return out

    mesh.parallelize.materialize_weights = perturbed
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = train.main(argv)
    return code, err.getvalue(), out.getvalue()


def run_perturbed(tmp_path, world: int, layout: list[str], odd_rank: int, action: str = "stop"):
    argv = ["--config", DEBUG_CONFIG, "--run.dir", str(tmp_path / "run"), "--run.tensorboard", "false"]
    argv += ["--training.steps", "2", "--debug.check_replicas", "1", "--debug.check_replicas_action", action]
    return run_on_ranks(run_with_a_perturbed_replica, world, [*argv, *layout], odd_rank, timeout=120)


@pytest.mark.parametrize(
    "world, layout, odd_rank, words",
    [
        # TP + SP: the norm weight is a DTensor replicated over tp; tp rank 1 holds the odd copy.
        (
            2,
            ["--parallel.tp", "2", "--parallel.dp_shard", "1"],
            1,
            ["mesh dim tp", "global ranks 0,1", "tp coordinates 1 disagree with 0"],
        ),
        # HSDP 2x2: rank 2 is replica 1 of dp_shard coordinate 0; its shard differs from rank 0's. Ranks 1 and
        # 3 (the other shard group) agree among themselves, yet they report the line and stop too.
        (
            4,
            ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"],
            2,
            ["mesh dim dp_replicate", "global ranks 0,2", "dp_replicate coordinates 1 disagree with 0"],
        ),
    ],
    ids=["tp2-sp", "hsdp2x2"],
)
def test_a_diverged_replica_is_named_on_every_rank_and_stops_the_run(tmp_path, world, layout, odd_rank, words):
    results = run_perturbed(tmp_path, world, layout, odd_rank)
    for rank, (code, err, _) in enumerate(results):
        assert code == 4, (rank, err[-2000:])
        last = err.strip().splitlines()[-1]
        assert last.startswith("meshloom: replica check at step 1: parameter " + NORM), (rank, last)
        for word in words:
            assert word in last, (rank, last)
    # the run stopped at the check of step 1: step 1 was logged by rank 0 only if the check came after it
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == ""


def test_warn_reports_the_same_line_and_trains_on(tmp_path):
    results = run_perturbed(tmp_path, 2, ["--parallel.tp", "2", "--parallel.dp_shard", "1"], 1, action="warn")
    assert [code for code, _, _ in results] == [0, 0]
    for _, _, out in results:  # every rank warns at both checks
        warnings = [line for line in out.splitlines() if line.startswith("meshloom: warning: replica check")]
        assert len(warnings) == 2 and NORM in warnings[0] and "tp coordinates 1 disagree with 0" in warnings[0]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2  # both steps trained and logged


def test_the_plain_replicas_of_powersgds_ddp_model_are_checked_without_a_false_positive(tmp_path):
    # PowerSGD's layout keeps plain (non-DTensor) parameters replicated with DDP: they are checked over every
    # mesh dim but pp, here dp_replicate. Steps 3-4 are compressed (PowerSGD's first two are exact); the
    # compressed gradient is still the same all-reduced value on both ranks, so the copies stay bitwise equal.
    layout = {"parallel.grad_compression": "powersgd", "parallel.dp_replicate": 2, "parallel.dp_shard": 1}
    records = train_on(2, {**layout, **CHECK_REPLICAS, "training.steps": 4}, tmp_path)
    assert len(records) == 4


def compare_a_tied_pair(differ: bool) -> list[str]:
    """Rank body (2 ranks, pp 2): the first stage's embedding and the last stage's head, two copies of one tied
    weight, compared through ``tied_replicas`` over the pp group (their embedding group when pp = 2)."""
    import torch.distributed as dist

    from mesh.dims import ParallelDims, build_mesh
    from observers.replica_check import compare_replicas, tied_replicas
    from runtime.process import init_process_group

    control = init_process_group(torch.device("cpu"), 60)
    meshes = build_mesh(ParallelDims(pp=2, world_size=2), torch.device("cpu"), 60)
    copy = torch.arange(12.0).view(3, 4)
    if differ and dist.get_rank() == 1:
        copy[2, 3] += 1e-6
    kind = "embedding" if dist.get_rank() == 0 else "head"
    extra = tied_replicas([(kind, copy)], meshes.pp.get_group())
    # the plain stage parameters of a pipeline have no replicas here: only the pair is compared
    return compare_replicas([("layers.0.w", torch.ones(3))], meshes.world, torch.device("cpu"), control, 7, extra)


def test_tied_embedding_copies_on_two_stages_are_compared_over_their_group():
    assert run_on_ranks(compare_a_tied_pair, 2, False) == [[], []]
    for lines in run_on_ranks(compare_a_tied_pair, 2, True):
        (line,) = lines
        assert "parameter tok_embeddings.weight (tied" in line, line
        assert "differs across mesh dim pp (tied embedding group) (global ranks 0,1)" in line, line


class OneRankControl:
    def any_true(self, flag):
        return flag

    def all_gather_object(self, obj):
        return [obj]


def test_tied_embedding_copies_on_one_rank_are_compared_without_a_collective():
    # A V-shaped schedule puts both ends on one rank: no group, a local comparison.
    from observers.replica_check import compare_replicas, tied_replicas

    weight = torch.randn(8, 4)
    same = tied_replicas([("embedding", weight), ("head", weight.clone())], None)
    assert compare_replicas([], None, torch.device("cpu"), OneRankControl(), 3, same) == []
    nudged = weight.clone()
    nudged[0, 0] += 1e-6
    (line,) = compare_replicas(
        [],
        None,
        torch.device("cpu"),
        OneRankControl(),
        3,
        tied_replicas([("embedding", weight), ("head", nudged)], None),
    )
    assert "differs between its copies on rank 0 (embedding: 0x" in line and "head: 0x" in line, line
