"""The GPU rule "a tensor handed to a collective lives on the device its group serves", checked on CPU.

NCCL serves CUDA tensors only; gloo on CPU forgives a CPU tensor on any group, so a control message sent the
wrong way passes every CPU test and kills the first GPU run at step 0. The stand-in: a default process group
created with the backend string ``cuda:gloo`` serves only CUDA tensors, exactly like NCCL, while the CPU
tensors of the model go through the DeviceMesh's own gloo groups and control messages through meshloom's
control plane (runtime/process.py). Any meshloom code path that still sends a CPU tensor through the default
group fails here with "No backend type associated with device type cpu".
"""

import pytest
import torch
import torch.distributed as dist

from launch.local_runs import DEBUG_CONFIG, PARITY_STEPS, ROOT, run_training
from launch.spawn import RankFailure, run_on_ranks
from tests.training_runs import CHECK_REPLICAS, assert_same_curve

# Run on the oldest and the newest supported torch too (.ci/compat).
pytestmark = pytest.mark.compat

STANDIN = "cuda:gloo"


def legacy_agreement() -> None:
    """The agreement meshloom used before the control plane: a CPU tensor all-reduced on the default group."""
    failed = torch.tensor([0])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)


def test_the_standin_rejects_a_cpu_tensor_on_the_default_group():
    """The stand-in bites: the old agreement (a CPU tensor on the default group) fails on it, as on NCCL."""
    assert dist.Backend.backend_capability["nccl"] == ["cuda"]  # the rule the stand-in plays
    with pytest.raises(RankFailure) as err:
        run_on_ranks(legacy_agreement, 2, backend=STANDIN, timeout=60)
    assert "No backend type associated with device type cpu" in str(err.value)
    run_on_ranks(legacy_agreement, 2, backend="gloo", timeout=60)  # ... which plain gloo forgives


def control_plane_paths(run_dir: str) -> dict:
    """Rank body: every control-plane message meshloom sends, on a cuda:gloo default group."""
    from observers.pipeline_timeline import PipelineTimeline
    from runtime.config import ConfigError
    from runtime.process import init_process_group
    from runtime.signals import StopSignals

    control = init_process_group(torch.device("cpu"), 60)
    rank = dist.get_rank()
    out = {}
    control.barrier()
    out["any_true"] = control.any_true(rank == 1)
    out["gathered"] = control.all_gather_object({"rank": rank})
    out["broadcast"] = control.broadcast_object(f"from {rank}", src=0)
    control.raise_if_any_failed(None, "nothing")  # success: returns on every rank
    try:
        control.raise_if_any_failed(ConfigError("bad value; fix it") if rank == 0 else None, "checking", ConfigError)
    except ConfigError as exc:
        out["failure"] = str(exc)
    out["floats"] = control.gather_floats([float(rank), 0.5 * rank])
    signals = StopSignals()
    signals.received = 15 if rank == 1 else None  # rank 1 got SIGTERM: both stop; the compute times ride along
    out["stop"] = signals.agreed_stop(control, 0.25 + rank)
    timeline = PipelineTimeline(pp_rank=rank, device=torch.device("cpu"))
    timeline.begin_step()
    timeline.end_step()
    events, windows = timeline.gather(control, [0, 1])
    out["windows"] = len(windows)
    return out


def test_control_plane_paths_work_on_an_accelerator_only_default_group(tmp_path):
    results = run_on_ranks(control_plane_paths, 2, str(tmp_path), backend=STANDIN, timeout=90)
    for rank, out in enumerate(results):
        assert out["any_true"] is True
        assert out["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert out["broadcast"] == "from 0"
        assert out["failure"].startswith("bad value; fix it"), f"rank {rank} must show rank 0's message"
        assert out["windows"] == 2
        assert out["floats"] == [[0.0, 0.0], [1.0, 0.5]]
        assert out["stop"] == (15, [0.25, 1.25])


# Whole training runs on the stand-in: every collective meshloom issues outside the model (run.dir checks,
# checkpoint agreement and DCP planning, loss sums, MoE load, pipeline timeline gather) must take a path that
# NCCL would accept. Each run also matches the same layout on plain gloo, so the stand-in changes nothing else.
@pytest.mark.parametrize(
    "overrides, config",
    [
        (  # tied embeddings: the two stages' copies summed on the device plane, the pair replica-checked
            {"parallel.pp": 2, "parallel.dp_shard": 1, "run.pp_timeline": True, "model.tie_embeddings": True},
            DEBUG_CONFIG,
        ),
        ({"parallel.dp_shard": 2, "parallel.ep": 2}, str(ROOT / "configs" / "debug_moe.toml")),
        (
            {
                "parallel.cp": 2,
                "parallel.dp_shard": 1,
                "parallel.cp_attention": "ring",
                "eval.interval": 3,
                "data.val_fraction": 0.05,
            },
            DEBUG_CONFIG,
        ),
        (
            {
                "parallel.dp_shard": 2,
                "training.micro_batch": 2,
                "parallel.grad_sync": "step",
                "parallel.grad_compression": "bf16",
            },
            DEBUG_CONFIG,
        ),
        (  # MoE under TP (tokens split over tp, load summed over it) with the profiler and its ranges on
            {"parallel.tp": 2, "parallel.dp_shard": 1, "profile.enabled": True, "profile.start_step": 2},
            str(ROOT / "configs" / "debug_moe.toml"),
        ),
        (  # FSDP (for bf16) over TP weights: the flattened (dp_shard, cp, tp) group of the gradient norm
            {"parallel.tp": 2, "parallel.dp_shard": 1, "training.mixed_precision": "bf16"},
            DEBUG_CONFIG,
        ),
    ],
    ids=[
        "pp2-tied-timeline",
        "moe-ep2",
        "cp2-ring-eval",
        "fsdp2-step-sync-bf16-reduce",
        "moe-tp2-profiled",
        "tp2-bf16",
    ],
)
def test_training_runs_on_an_accelerator_only_default_group(overrides, config, shared_runs, tmp_path):
    # The replica check runs after every step here too: its comparisons go through the mesh's groups and its
    # agreement through the control plane, never the accelerator-only default group.
    checked = {**overrides, **CHECK_REPLICAS}
    standin = run_on_ranks(run_training, 2, checked, str(tmp_path / "standin"), config, backend=STANDIN, timeout=180)[0]
    plain = shared_runs.records(overrides, config=config, world=2)
    assert_same_curve(standin, plain, rtol=0.0)  # the same groups do the same sums: bit for bit
    if overrides.get("run.pp_timeline"):
        assert (tmp_path / "standin" / "pipeline_timeline.svg").is_file()
    if overrides.get("profile.enabled"):
        assert sorted(p.name for p in (tmp_path / "standin" / "profile").glob("rank*.json")) == [
            "rank0.pt.trace.json",
            "rank1.pt.trace.json",
        ]


def test_checkpoint_save_and_resume_on_an_accelerator_only_default_group(shared_runs, tmp_path):
    """An async save on fsdp2 (DCP planning, publish agreement), then a resume (DCP load) on the stand-in."""
    layout = {"parallel.dp_shard": 2, "checkpoint.interval": 3, "checkpoint.async": True}
    half = PARITY_STEPS // 2
    first = run_on_ranks(
        run_training,
        2,
        {**layout, "training.steps": half},
        str(tmp_path / "run"),
        DEBUG_CONFIG,
        backend=STANDIN,
        timeout=180,
    )[0]
    resumed = run_on_ranks(
        run_training,
        2,
        {**layout, "checkpoint.resume": "auto"},
        str(tmp_path / "run"),
        DEBUG_CONFIG,
        backend=STANDIN,
        timeout=180,
    )[0]
    plain = shared_runs.records({"parallel.dp_shard": 2}, world=2)
    assert_same_curve(first + resumed, plain)
