"""``train.py --simulate``: the real build and two training steps of one rank per pipeline stage on a fake world.

Fake and real tensors must give the same accounting, category by category, and the same collectives (the real
run here is the same code with real tensors on a fake world: every collective returns at once, so one process
plays one rank). The defects the simulation found each have a test that fails on the code before the fix.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from launch.spawn import run_on_ranks
from planning.sim_accounting import by_dim
from planning.simulate import in_fresh_process
from runtime.command_line import CommandLine, parse_command_line
from runtime.config import ConfigError, load_config
from train import main
from training.simulated_rank import real_rank, simulate_rank

# Tiny shapes, vocabulary 320 (the meter finds logits by what the head returns, not by their width:
# test_logits_are_what_the_head_returns_not_what_is_as_wide).
MOE_8 = [  # world 8: pp 2 (interleaved, 2 stages per rank) x dp_shard 2 x tp 2, experts over ep 2, full AC, bf16
    "--config", "configs/debug_moe.toml", "--model.vocab_size", "320", "--parallel.pp", "2",
    "--parallel.dp_shard", "2", "--parallel.tp", "2", "--parallel.ep", "2",
    "--parallel.pp_schedule", "Interleaved1F1B", "--parallel.pp_microbatches", "4",
    "--training.activation_checkpoint", "full", "--training.mixed_precision", "bf16",
]  # fmt: skip
DENSE_8 = [  # world 8: pp 2 x dp_shard 2 x tp 2, fp32, selective AC (the row-parallel matmuls recomputed)
    "--config", "configs/debug.toml", "--model.vocab_size", "320", "--parallel.pp", "2",
    "--parallel.dp_shard", "2", "--parallel.tp", "2", "--training.activation_checkpoint", "selective",
]  # fmt: skip
DENSE_64 = [  # world 64: pp 2 x dp_shard 8 x tp 4, fp32, full AC, tied embeddings
    "--config", "configs/debug.toml", "--model.vocab_size", "320", "--parallel.pp", "2",
    "--parallel.dp_shard", "8", "--parallel.tp", "4", "--training.global_batch", "16",
    "--training.activation_checkpoint", "full", "--model.tie_embeddings", "true",
]  # fmt: skip


def fake_and_real(cfg, world: int, pp_rank: int, comm_debug: bool) -> tuple[dict, dict]:
    """One rank simulated with fake tensors, then run with real ones, in one process (a spawned one: see
    planning/simulate.py, in_fresh_process): the same world and rank, so torch's caches stay valid."""
    return simulate_rank(cfg, world, pp_rank, True, comm_debug), simulate_rank(cfg, world, pp_rank, False, comm_debug)


MOE_8_NO_PP = [  # world 8: dp_shard 4 x tp 2, experts over ep 4, bf16 (CommDebugMode's module hooks break on
    # pipeline stages, so torch's own counter is compared without pipelining)
    "--config", "configs/debug_moe.toml", "--model.vocab_size", "320", "--parallel.dp_shard", "4",
    "--parallel.tp", "2", "--parallel.ep", "4", "--training.mixed_precision", "bf16",
]  # fmt: skip


@pytest.mark.parametrize(
    "argv, world, pp_rank",
    [(MOE_8, 8, 0), (MOE_8, 8, 1), (DENSE_8, 8, 1), (DENSE_64, 64, 1)],
    ids=["moe-w8-pp0", "moe-w8-pp1", "selective-w8-pp1", "w64-pp1"],
)
def test_fake_and_real_tensors_give_the_same_accounting_and_collectives(argv, world, pp_rank):
    fake, real = in_fresh_process(fake_and_real, load_config(argv), world, pp_rank, False)
    # exact: the same ops allocate the same shapes; only the bytes behind them differ (none for fake tensors)
    assert fake["categories"] == real["categories"]
    assert fake["simulated_peak_bytes"] == real["simulated_peak_bytes"] > 0
    assert fake["collectives"] == real["collectives"]
    dims = {c["dim"] for c in real["collectives"]}
    assert {"tp", "pp", "dp_shard"} <= dims and "other" not in dims


def test_the_peak_split_adds_up_to_the_peak():
    """The categories at the peak are taken when the live bytes first drop: the storage whose death ends the peak
    (or whose resize frees it) belongs to them. (It once left first: the 1T MoE's first rank split 2.19 GiB less
    than its peak, the embedding's whole-vocabulary bf16 gradient.)"""
    from planning.sim_accounting import LiveBytes

    with LiveBytes() as memory, memory.following_resizes():
        a = torch.ones(100)
        b = torch.ones(50)
        del b  # the peak ends with b's death
        c = torch.ones(10)
        c.untyped_storage().resize_(0)  # a resize that frees, as FSDP2's reshard
        assert memory.peak == 600
        assert sum(memory.finish().values()) == memory.peak
        d = torch.ones(200)
        c.untyped_storage().resize_(4 * 500)  # FSDP2's re-allocation: a new peak, ended by a resize
        c.untyped_storage().resize_(0)
        assert memory.peak == 400 + 800 + 2000
        assert sum(memory.finish().values()) == memory.peak
        del a, d


def test_the_meter_reads_no_tensor_while_a_storage_dies():
    """A storage dies inside its tensor's deallocation; reading the owners' tensors there (the peak's split) corrupted
    memory: ``train.py --simulate`` of MoE with ep 2, FSDP and full AC segfaulted in the first backward (real tensors:
    ``THPVariable_clear`` asserted ``use_count() == 1``). The split waits for the next op."""
    from planning.sim_accounting import LiveBytes

    read = []
    with LiveBytes() as memory:
        memory.owners = lambda: read.append(True) or (set(), set(), set())
        a = torch.ones(100)
        del a  # the peak ends in a's deallocation
        assert read == [] and memory.live == 0
        torch.ones(1)  # the next op splits the peak
        assert read == [True] and memory.finish()["activations_and_temporaries"] == 400 == memory.peak


@pytest.mark.slow
def test_moe_with_ep_fsdp_and_full_activation_checkpointing_simulates():
    # the experts are their own FSDP unit inside each checkpointed block (the layout that segfaulted, above)
    argv = ["--config", "configs/debug_moe.toml", "--parallel.dp_shard", "2", "--parallel.ep", "2"]
    fake, real = in_fresh_process(
        fake_and_real, load_config(argv + ["--training.activation_checkpoint", "full"]), 2, 0, False
    )
    assert fake["categories"] == real["categories"]
    assert fake["simulated_peak_bytes"] == real["simulated_peak_bytes"] > 0
    assert {"ep", "dp_shard"} <= {c["dim"] for c in fake["collectives"]}, fake["collectives"]


def test_the_simulated_collectives_are_those_torch_counts():
    fake, real = in_fresh_process(fake_and_real, load_config(MOE_8_NO_PP), 8, 0, True)
    assert fake["collectives"] == real["collectives"]
    # every collective of the real step as torch's CommDebugMode counts them, by op (it leaves out send/recv)
    ours = sum(c["count"] for c in real["collectives"] if c["kind"] not in ("send", "recv"))
    assert ours == sum(real["torch_comm_counts"].values()) > 0
    assert fake["torch_comm_counts"] == real["torch_comm_counts"]
    assert {"tp", "ep", "dp_shard"} <= {c["dim"] for c in real["collectives"]}


def test_the_last_stage_keeps_no_logits_of_other_microbatches():
    """Defect (a): with torch's default ``return_outputs=True`` the last stage kept every micro-batch's logits (and
    a merged copy) until the next step. With 8 micro-batches of one 128-token sequence and 320 fp32 logits each,
    keeping them all is 8 x 164 KB; the peak around one micro-batch's loss is a few copies of one."""
    argv = ["--config", "configs/debug.toml", "--model.vocab_size", "320", "--parallel.pp", "2"]
    argv += ["--parallel.dp_shard", "2", "--training.global_batch", "16"]
    argv += ["--parallel.pp_microbatches", "8", "--parallel.pp_schedule", "1F1B"]  # one micro-batch at a time
    one = 128 * 320 * 4
    row = in_fresh_process(simulate_rank, load_config(argv), 4, 1)
    assert 0 < row["categories"]["logits"] < 8 * one


def test_logits_are_what_the_head_returns_not_what_is_as_wide():
    """dim 128 = vocab 256 / tp 2: every hidden state is as wide as a logits shard, which the meter, finding logits
    by width, counted as logits (+214% against the estimate). Found by what the head returns, the logits are the
    same tensors as with vocab 320 (no width in common), so their bytes scale with the vocabulary, exactly."""
    base = ["--config", "configs/debug.toml", "--parallel.dp_shard", "2", "--parallel.tp", "2"]
    base += ["--training.mixed_precision", "bf16"]
    as_wide = in_fresh_process(simulate_rank, load_config([*base, "--model.vocab_size", "256"]), 4, 0)
    apart = in_fresh_process(simulate_rank, load_config([*base, "--model.vocab_size", "320"]), 4, 0)
    assert apart["categories"]["logits"] > 0
    assert as_wide["categories"]["logits"] * 320 == apart["categories"]["logits"] * 256


def test_selective_policy_finds_row_parallel_weights_under_fake_tensors():
    """Defect (b): storages were identified by data_ptr(), which is 0 for every fake tensor, so under fake tensors
    no matmul matched a row-parallel weight and their outputs were saved instead of recomputed."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.checkpoint import CheckpointPolicy

    from mesh.activation_checkpoint import _save_policy

    with FakeTensorMode():
        row, other = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
        x = torch.randn(4, 8)
        policy = _save_policy([row])
        mm = torch.ops.aten.mm.default
        assert policy(None, mm, x, row.weight.t()) == CheckpointPolicy.PREFER_RECOMPUTE
        assert policy(None, mm, x, other.weight.t()) == CheckpointPolicy.MUST_SAVE


def test_expert_split_sizes_can_be_fed_without_a_host_read():
    """Defect (c): the split sizes were read on the host in every layer; a provider now gives them. The host read
    cannot run under fake tensors; the balanced provider needs no read and splits the rows evenly."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mesh.expert_parallel import SPLIT_SIZES, balanced_split_sizes, host_split_sizes

    assert SPLIT_SIZES.provider is host_split_sizes  # real runs read the real routing
    with FakeTensorMode():
        counts = torch.zeros(8, dtype=torch.long)
        received = torch.zeros(4, 2, dtype=torch.long)  # 4 ep ranks, 2 local experts
        matrix, sent, recv = balanced_split_sizes(counts, received, 10)
        assert sent == recv == [3, 3, 2, 2] and tuple(matrix.shape) == (4, 2)
        with pytest.raises(Exception):  # noqa: B017  (fake tensors hold no values to read)
            host_split_sizes(counts, received, 10)


def test_stage_shapes_come_from_the_plan():
    """Defect (d): stages get static metadata (no shape inference at the first step): the plan's shapes."""
    from planning.plan import LayoutPlan

    cfg = load_config(["--config", "configs/debug.toml", "--parallel.pp", "2", "--parallel.tp", "2"])
    cfg.training.mixed_precision = "bf16"
    shapes = LayoutPlan.resolve(cfg, 8, rank=0).stage_shapes(None)
    first = shapes.examples(True, False)
    assert tuple(first["input_args"].shape) == (2, 128) and first["input_args"].dtype == torch.long
    # sequence parallelism: each tp rank passes its half of the sequence; bf16 compute
    assert tuple(first["output_args"].shape) == (2, 64, 128) and first["output_args"].dtype == torch.bfloat16


def test_the_simulation_flags_and_refusals():
    sim = parse_command_line(["--simulate", "--world-size", "16", "--pp-ranks", "0,3", "--parallel.pp", "4"])
    assert sim == CommandLine("simulate", 16, [0, 3], None, config_args=["--parallel.pp", "4"])
    assert parse_command_line(["--dry-run", "--world-size", "4"]) == CommandLine("dry-run", 4)
    for bad in (
        ["--simulate"],
        ["--simulate", "--world-size", "4", "--pp-ranks", "a"],
        ["--pp-ranks", "0"],
        ["--simulate", "--world-size", "4", "--world-size", "8"],  # given twice
        ["--simulate", "--world-size", "4", "--simulate-out"],  # no value
        ["--simulate", "--world-size", "4", "--simulate-out", "/no/such/folder/sim.json"],  # checked before the run
        ["--dry-run", "--world-size", "²"],
        ["--dry-run", "--world-size", str(2**31)],
        ["--dry-run", "--world-size", "8", "--device-kind", "tpu"],  # cuda or cpu
        ["--dry-run", "--world-size", "8", "--device-kind"],  # no value
        ["--device-kind", "cuda"],  # a real run uses the device it finds
    ):
        with pytest.raises(ConfigError):
            parse_command_line(bad)
    # what cannot be simulated is refused, naming the field and why: exit 2 before anything runs
    argv = ["--simulate", "--world-size", "2", "--config", "configs/debug_moe.toml", "--model.moe_capacity_factor", "1"]
    assert main(argv) == 2
    assert (
        main(["--simulate", "--world-size", "1", "--config", "configs/debug.toml"]) == 2
    )  # fp32 on 1 rank: no FSDP, no TP


AUTO_8B = ["--config", "configs/llama3_8b.toml", "--training.mixed_precision", "auto"]


def test_the_dry_run_plans_for_the_target_device_not_this_machine(capsys):
    """``mixed_precision = auto`` resolves for ``--device-kind`` (default cuda), on this CPU machine too: Llama 3 8B
    on 8 ranks is torchtitan's bf16 run, about 71.7 GiB per rank, not an fp32 one of about 115 GiB."""
    assert main(["--dry-run", "--world-size", "8", *AUTO_8B]) == 0
    out = capsys.readouterr().out
    assert "| bf16 on cuda |" in out and "memory about 71.72 GiB per rank" in out
    assert main(["--dry-run", "--world-size", "8", "--device-kind", "cpu", *AUTO_8B]) == 0
    out = capsys.readouterr().out
    assert "| fp32 on cpu |" in out and "memory about 115.08 GiB per rank" in out
    # a config that names its device is planned for that device; a flag that contradicts it is refused
    assert main(["--dry-run", "--world-size", "8", *AUTO_8B, "--training.device", "cpu"]) == 0
    assert "| fp32 on cpu |" in capsys.readouterr().out
    assert main(["--dry-run", "--world-size", "8", "--device-kind", "cuda", *AUTO_8B, "--training.device", "cpu"]) == 2
    assert "--device-kind cuda contradicts training.device='cpu'" in capsys.readouterr().err


def test_the_simulation_plans_for_the_target_device(capsys):
    """debug_moe.toml leaves mixed_precision at auto: planned for cuda it simulates in bf16 (the experts' grouped
    matmul has a bf16 shape function only); planned for cpu it is fp32, which the simulation refuses for MoE. The
    layout is issue 47's: ep 2 x FSDP with selective checkpointing, whose first backward used to fail."""
    argv = ["--simulate", "--world-size", "2", "--config", "configs/debug_moe.toml", "--parallel.dp_shard", "2"]
    argv += ["--parallel.ep", "2", "--training.activation_checkpoint", "selective"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| bf16 on cuda |" in out and "ep all_to_all" in out
    assert main([*argv, "--device-kind", "cpu"]) == 2
    assert "training.mixed_precision=fp32 with MoE layers" in capsys.readouterr().err


def test_simulate_writes_the_report_as_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    argv = ["--simulate", "--world-size", "4", "--config", "configs/debug.toml", "--parallel.pp", "2"]
    assert main([*argv, "--parallel.tp", "2", "--pp-ranks", "1", "--simulate-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["world_size"] == 4 and [r["pp_rank"] for r in report["ranks"]] == [1]
    row = report["ranks"][0]
    for key in ("simulated_peak_bytes", "estimated_bytes", "categories", "collectives", "why"):
        assert key in row
    assert set(row["categories"]) == {
        "parameters", "gradients", "optimizer_states", "activations_and_temporaries", "logits"
    }  # fmt: skip
    assert {"dim", "kind", "count", "bytes"} <= set(row["collectives"][0])
    assert "pp rank 1" in capsys.readouterr().out


@pytest.mark.parametrize(
    "config, world", [("llama3_8b", 8), ("llama3_70b", 1024), ("llama3_405b", 16384), ("moe_1t", 2048)]
)
def test_shipped_configs_pass_the_dry_run_at_their_world_size(config, world, capsys):
    assert main(["--dry-run", "--world-size", str(world), "--config", f"configs/{config}.toml"]) == 0
    assert f"world {world}" in capsys.readouterr().out


FAMILIES = {  # world 4, bf16: the layout families the tests above do not run
    "hsdp": (["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"], 0, {"dp_replicate", "dp_shard"}),
    "zbv": (["--parallel.pp", "2", "--parallel.pp_schedule", "ZBVZeroBubble", "--parallel.dp_shard", "2"], 0, {"pp"}),
    "dualpipev": (
        ["--parallel.pp", "2", "--parallel.pp_schedule", "DualPipeV", "--parallel.pp_microbatches", "4"],
        1,
        {"pp"},
    ),
    "cp-allgather": (["--parallel.cp", "2", "--parallel.dp_shard", "2"], 0, {"cp", "fsdp"}),
    "cp-ring": (["--parallel.cp", "2", "--parallel.cp_attention", "ring", "--parallel.dp_shard", "2"], 0, {"cp"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_layout_family_simulates(family):
    extra, pp_rank, dims = FAMILIES[family]
    argv = ["--config", "configs/debug.toml", "--model.vocab_size", "320", "--training.mixed_precision", "bf16"]
    row = in_fresh_process(simulate_rank, load_config(argv + extra), 4, pp_rank)
    assert row["simulated_peak_bytes"] > 0 and dims <= {c["dim"] for c in row["collectives"]}


# world 4: pp 2 x tp 2 (SP), bf16 (FSDP over a dp_shard of 1), 8 layers of dim 256, 2,048-token sequences, 4
# micro-batches of one sequence: activations dominate, as at scale (docs/combining.md, Appendix F's schedule table)
SCHEDULE_SHAPE = [
    "--config", "configs/debug.toml", "--model.vocab_size", "320", "--model.n_layers", "8", "--model.dim", "256",
    "--parallel.tp", "2", "--parallel.dp_shard", "1", "--parallel.pp", "2", "--parallel.pp_microbatches", "4",
    "--training.seq_len", "2048", "--training.global_batch", "4", "--training.mixed_precision", "bf16",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"])
def test_the_planner_is_within_ten_percent_of_the_simulation_for_every_schedule(schedule):
    """planning/memory_estimate.py against the simulated peak, per pipeline rank, under each schedule: the chunks in
    flight per stage come from the schedule's order (the planner missed 31% on 70B's interleaved last rank), a stage's
    gradients exist from its first backward, and ZBV's input-gradient passes keep their weight-gradient inputs (19-27%
    missed at this shape, where ZBV's cool-down holds three of them)."""
    from planning.simulate import estimate

    cfg = load_config(SCHEDULE_SHAPE + ["--parallel.pp_schedule", schedule])
    for pp_rank in (0, 1):
        row = in_fresh_process(simulate_rank, cfg, 4, pp_rank)
        estimated, _ = estimate(cfg, 4, pp_rank)
        assert row["simulated_peak_bytes"] == pytest.approx(estimated, rel=0.10), (schedule, pp_rank)


def test_why_names_the_schedules_chunks_in_flight_when_activations_differ_most():
    from planning.simulate import why

    sim = {"parameters": 1, "activations_and_temporaries": 30 * 2**30, "logits": 2**30}
    est = {"parameters": 1, "activations_and_temporaries": 22 * 2**30, "logits": 2**30}
    said = why(31 * 2**30, 23 * 2**30, sim, est, (18 * 2**30, {15: 16, 31: 1}, "Interleaved1F1B"))
    assert "Interleaved1F1B schedule's chunks in flight (16 of stage 15, 1 of stage 31" in said
    assert "chunks in flight" not in why(31 * 2**30, 23 * 2**30, sim, est)


# world 2: tp 2 (SP, loss-parallel cross-entropy), fp32, 2 layers
TP_2 = ["--config", "configs/debug.toml", "--parallel.dp_shard", "1", "--parallel.tp", "2", "--model.n_layers", "2"]


def dtensor_collectives_metered_and_recorded() -> tuple[dict, dict]:
    """On 2 real ranks: a loss-parallel cross-entropy with its backward and the gradient norm of a row-sharded
    weight, under the simulation's meter; its table and the process group's own record (flight recorder)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    from mesh.grad_clip import global_grad_norm
    from mesh.private_api import flight_recorder_dump
    from planning.sim_accounting import Collectives, recorded_collectives

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    names = {mesh.get_group().group_name: "tp"}
    torch.manual_seed(0)
    logits = distribute_tensor(torch.randn(8, 16), mesh, [Shard(1)]).requires_grad_()
    targets = distribute_tensor(torch.randint(16, (8,)), mesh, [Replicate()])
    weight = nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]))
    weight.grad = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    dist.barrier()
    last = max(e["record_id"] for e in flight_recorder_dump()["entries"])
    with Collectives(names) as meter:
        with loss_parallel():
            F.cross_entropy(logits, targets).backward()
        global_grad_norm([weight])
    entries = [e for e in flight_recorder_dump()["entries"] if e["record_id"] > last]
    return by_dim(meter.table()), recorded_collectives(entries, names)


def test_the_meter_sees_the_collectives_dtensor_issues_inside_its_dispatch():
    # cross-entropy: all-reduces of the max, the sum of exponentials and the target logit; the norm's all-reduce.
    # The meter saw none of them: a dispatch mode is off while it handles the DTensor op that issues them.
    for metered, recorded in run_on_ranks(dtensor_collectives_metered_and_recorded, 2):
        assert metered == recorded and metered["tp"]["count"] == 4


@pytest.mark.slow
def test_the_simulation_counts_the_collectives_dtensor_issues_inside_its_dispatch():
    """A real 2-rank gloo run's collectives, as its process group recorded them (flight recorder), against the
    simulation's meter: among them the loss-parallel cross-entropy's 3 all-reduces per micro-batch and the gradient
    norm's, which DTensor issues inside its own dispatch (the meter missed those 5 of the step's 6 all-reduces)."""
    cfg = load_config(TP_2)
    real = run_on_ranks(real_rank, 2, cfg, timeout=300)
    sim = in_fresh_process(simulate_rank, cfg, 2, 0, True, False, None, "cpu")
    assert by_dim(sim["collectives"]) == real[0]["collectives"] == real[1]["collectives"]
    [all_reduces] = [r["count"] for r in sim["collectives"] if r["kind"] == "all_reduce"]
    # 3 cross-entropy (max, sum of exponentials, target logit), 2 gradient-norm groups (column- and row-sharded
    # weights), 1 sum of the norm weights' partial gradients (mesh/tensor_parallel.py)
    assert all_reduces == 6


DENSE_8_REAL = [
    "--config",
    "configs/debug.toml",
    "--parallel.pp",
    "2",
    "--parallel.dp_shard",
    "2",
    "--parallel.tp",
    "2",
]


@pytest.mark.slow
@pytest.mark.parametrize("argv", [DENSE_8_REAL, MOE_8], ids=["dense-pp2-dp2-tp2", "moe-pp2-dp2-tp2-ep2"])
def test_a_real_eight_rank_run_and_the_simulation_issue_the_same_collectives_and_memory(argv, tmp_path):
    """Per pipeline rank and mesh dim, the simulation's count and bytes against each real rank of that stage (gloo's
    own record; send and recv by the meter, which gloo's recorder leaves out): counts equal, bytes within the issue's
    2%. Expert-parallel bytes against the stage's mean: a backward all-to-all sends what the forward one received,
    which the real routing decides per rank (the simulation assumes balanced routing; their sum is the same).

    And memory, per pipeline rank: the simulated peak of live tensor bytes over the two steps against the real ranks'
    peaks over the same steps, by the CPU allocator's own record under torch.profiler (``profile.memory_snapshot``;
    training/simulated_rank.py, ``real_rank``), not the simulation's meter."""
    cfg = load_config(argv + ["--profile.memory_snapshot", "true", "--run.dir", str(tmp_path)])
    real = run_on_ranks(real_rank, 8, cfg, timeout=900)
    memory = {}
    for pp_rank in (0, 1):
        simulated = in_fresh_process(simulate_rank, cfg, 8, pp_rank, True, False, None, "cpu")
        memory[pp_rank] = (
            simulated["simulated_peak_bytes"],
            [r["peak_bytes"] for r in real if r["rank"] // 4 == pp_rank],
        )
        sim = by_dim(simulated["collectives"])
        stage = [r["collectives"] for r in real if r["rank"] // 4 == pp_rank]
        for ranks in stage:
            assert ranks.keys() == sim.keys()
            for dim, row in sim.items():
                got = ranks[dim]["bytes"] if dim != "ep" else sum(r[dim]["bytes"] for r in stage) / len(stage)
                assert ranks[dim]["count"] == row["count"], (pp_rank, dim)
                assert got == pytest.approx(row["bytes"], rel=0.02), (pp_rank, dim)
    # Both count the same storages' bytes (no allocator rounding). Each real rank's peak, every rank of the stage,
    # within the issue's 2% of the simulated one. A collective's buffer freed on one of gloo's worker threads would
    # put single ranks above it (by 1.5% to 10%, measured) had the allocator's total not been told to count every
    # thread (real_rank, mesh/private_api.py). Measured so: dense, every rank of a stage at the same bytes, 32 under
    # the simulation; MoE, 0.75% and 1.08% over it (now and then one rank 16 or 32 KiB more, up to 1.05% and 1.24%;
    # its real routing, we believe, unconfirmed): the stage outputs and input gradients the schedule has
    # sent, which torch's pipeline runtime keeps until the step's end (each send's Work holds its tensor on gloo)
    # while the fake world's Work holds nothing (a Work that holds them brings both stages to 32 bytes).
    assert all(r["counts_every_thread"] for r in real)
    for pp_rank, (sim, peaks) in memory.items():
        assert peaks == [pytest.approx(sim, rel=0.02)] * len(peaks), (pp_rank, sim, peaks)
