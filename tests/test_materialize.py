"""Every tensor where its layout says: after the model is built, each parameter and buffer is on the compute
device, or in host memory for parameters under FSDP's CPU offload (mesh/materialize.py: check_placement).

On a CPU machine the host *is* the compute device, so a tensor left in host memory cannot be told apart.
Here the meta device stands in for the GPU: every layout is built by train.py's own ``build_step`` (training/build.py)
with ``device = meta``, on a one-process fake group of the layout's world size (measure/schedule_ir.py:
``fake_world``; building communicates nothing), and anything that lands on the CPU instead is named.
"""

import pytest
import torch
from torch import nn

from launch.local_runs import DEBUG_CONFIG, ROOT
from measure.schedule_ir import fake_world
from mesh.dims import build_mesh
from mesh.materialize import check_placement, misplaced_tensors
from planning.plan import LayoutPlan
from runtime.config import load_config

MOE_CONFIG = str(ROOT / "configs" / "debug_moe.toml")
STAND_IN = torch.device("meta")  # plays the GPU: anything made without the compute device lands on the CPU

# name -> (world size, the rank to build, config, overrides)
LAYOUTS = {
    "one": (1, 0, DEBUG_CONFIG, {}),
    "one-bf16": (1, 0, DEBUG_CONFIG, {"training.mixed_precision": "bf16"}),
    "fsdp2": (2, 0, DEBUG_CONFIG, {"parallel.dp_shard": 2}),
    "hsdp2x2": (4, 0, DEBUG_CONFIG, {"parallel.dp_replicate": 2, "parallel.dp_shard": 2}),
    "tp2": (2, 0, DEBUG_CONFIG, {"parallel.tp": 2, "parallel.dp_shard": 1}),
    "fsdp2xtp2-ac": (
        4,
        0,
        DEBUG_CONFIG,
        {"parallel.tp": 2, "parallel.dp_shard": 2, "training.activation_checkpoint": "full"},
    ),
    "pp2-first": (2, 0, DEBUG_CONFIG, {"parallel.pp": 2, "parallel.dp_shard": 1}),
    "pp2-last-interleaved": (
        2,
        1,
        DEBUG_CONFIG,
        {"parallel.pp": 2, "parallel.dp_shard": 1, "parallel.pp_schedule": "Interleaved1F1B"},
    ),
    "cp2-allgather": (2, 0, DEBUG_CONFIG, {"parallel.cp": 2, "parallel.dp_shard": 1}),
    "cp2-ring": (2, 1, DEBUG_CONFIG, {"parallel.cp": 2, "parallel.dp_shard": 1, "parallel.cp_attention": "ring"}),
    "powersgd-dp2": (2, 0, DEBUG_CONFIG, {"parallel.dp_replicate": 2, "parallel.grad_compression": "powersgd"}),
    "compile": (1, 0, DEBUG_CONFIG, {"training.compile": True}),
    "offload": (1, 0, DEBUG_CONFIG, {"parallel.fsdp_cpu_offload": True}),
    "offload-fsdp2-selective": (
        2,
        0,
        DEBUG_CONFIG,
        {"parallel.fsdp_cpu_offload": True, "parallel.dp_shard": 2, "training.activation_checkpoint": "selective"},
    ),
    "moe": (1, 0, MOE_CONFIG, {}),
    "moe-ep2": (2, 0, MOE_CONFIG, {"parallel.dp_shard": 2, "parallel.ep": 2}),
    "moe-tp2": (2, 0, MOE_CONFIG, {"parallel.tp": 2, "parallel.dp_shard": 1}),
    "moe-pp2-last": (2, 1, MOE_CONFIG, {"parallel.pp": 2, "parallel.dp_shard": 1}),
    "moe-offload": (1, 0, MOE_CONFIG, {"parallel.fsdp_cpu_offload": True}),
    "moe-offload-ep2": (
        2,
        0,
        MOE_CONFIG,
        {"parallel.fsdp_cpu_offload": True, "parallel.dp_shard": 2, "parallel.ep": 2},
    ),
}


def build_on_stand_in(world: int, rank: int, config: str, overrides: dict) -> tuple[list[nn.Module], bool]:
    """train.py's model parts for ``rank`` of the layout, materialised on the stand-in device."""
    from training.build import build_step

    cfg = load_config(path=config, overrides=overrides)
    plan = LayoutPlan.resolve(cfg, world, rank)
    with fake_world(world, rank):
        meshes = build_mesh(
            plan.dims,
            torch.device("cpu"),  # the mesh's device type; the model is materialised on the stand-in
            60,
            has_experts=plan.model.moe is not None,
            host_tensors=cfg.parallel.fsdp_cpu_offload,
            fsdp_with_tp=plan.layout.fsdp and plan.dims.tp > 1,
        )
        try:
            parts = build_step(cfg, plan, meshes, STAND_IN).parts  # runs check_placement itself
        except RuntimeError as exc:  # raised by check_placement: report it as the test's failure
            pytest.fail(str(exc))
    return parts, cfg.parallel.fsdp_cpu_offload


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_every_parameter_and_buffer_is_on_the_compute_device_or_offloaded(layout):
    parts, offloaded = build_on_stand_in(*layout)
    for part in parts:
        assert misplaced_tensors(part, STAND_IN, host_params=offloaded) == []
        devices = {(t.to_local() if hasattr(t, "to_local") else t).device.type for t in part.parameters()}
        assert devices == ({"cpu"} if offloaded else {"meta"})  # offloaded: every parameter in host memory
        assert {b.device.type for b in part.buffers()} <= {"meta"}


def test_the_check_names_each_tensor_off_its_device():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    model.to_empty(device="cpu")
    model[1].running_mean = model[1].running_mean.to("meta")  # one buffer where it belongs, the rest not
    wrong = misplaced_tensors(model, STAND_IN)
    assert "parameter 0.weight is on cpu, not meta" in wrong and "buffer 1.running_var is on cpu, not meta" in wrong
    assert not any("running_mean" in line for line in wrong)
    # offloaded: parameters belong on the host, buffers still on the device
    assert misplaced_tensors(model, STAND_IN, host_params=True) == [
        "buffer 1.running_var is on cpu, not meta",
        "buffer 1.num_batches_tracked is on cpu, not meta",
    ]
    with pytest.raises(RuntimeError, match=r"2 tensor\(s\) .*parameter 0\.weight is on cpu"):
        check_placement(nn.Sequential(nn.Linear(2, 2)).to("cpu"), STAND_IN)
