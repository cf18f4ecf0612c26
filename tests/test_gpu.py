"""CUDA checks (marked `gpu`, deselected by default; run with `pytest -m gpu` on a machine with GPUs).

Each test compares a GPU run against the CPU run of the same config (the reference every CPU parity test
uses), so a GPU-only mistake shows up as a number, not just as a crash. Tests that need two GPUs skip on a
machine with one. These have not run in CI (CPU only); docs/troubleshooting.md says where their figures are.
"""

import json

import pytest
import torch

from checkpoint.folder import published
from launch.local_runs import DEBUG_CONFIG, PARITY_STEPS, ROOT, read_metrics, run_train_cli

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
MOE_CONFIG = str(ROOT / "configs" / "debug_moe.toml")

# fp32 on GPU vs CPU: TF32 is off by default for matmuls in PyTorch, but the attention kernels (memory-
# efficient SDPA on CUDA, the flash-style CPU kernel) and cuBLAS add in other orders: ~1e-6 per op, grown by
# a few AdamW steps to ~1e-5. 1e-4 leaves headroom and still catches any real bug (>= 1e-3).
FP32_RTOL = 1e-4
# bf16 vs fp32: bf16 keeps 8 significant bits; the CPU bf16 test measured <= 4.2e-4 on the loss over 6
# steps, and the GPU's bf16 kernels round differently again. 3e-3 is the tolerance the CPU bf16 test uses.
BF16_RTOL = 3e-3


def launch(tmp_path, name: str, nproc: int, *args: str, config: str = DEBUG_CONFIG) -> list[dict]:
    run_dir = tmp_path / name
    proc = run_train_cli(
        nproc, "--config", config, "--training.steps", str(PARITY_STEPS), "--run.dir", str(run_dir), *args, gpus=True
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_metrics(run_dir)


def assert_close(run: list[dict], reference: list[dict], rtol: float, keys=("loss",)) -> None:
    assert len(run) == len(reference)
    for a, e in zip(run, reference, strict=True):
        for key in keys:
            assert abs(a[key] - e[key]) / abs(e[key]) <= rtol, (e["step"], key, a[key], e[key])


@pytest.fixture(scope="module")
def cpu_reference(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("cpu"), "cpu", 1, "--training.device", "cpu")


def test_one_gpu_fp32_matches_the_cpu_reference(cpu_reference, tmp_path):
    run = launch(tmp_path, "gpu", 1, "--training.device", "cuda")
    assert_close(run, cpu_reference, FP32_RTOL, keys=("loss", "grad_norm"))
    assert run[-1]["peak_mem_bytes"] > 0  # torch.cuda.max_memory_allocated on GPU


def test_one_gpu_bf16_matches_the_cpu_reference(cpu_reference, tmp_path):
    run = launch(tmp_path, "bf16", 1, "--training.device", "cuda", "--training.mixed_precision", "bf16")
    assert_close(run, cpu_reference, BF16_RTOL)


@two_gpus
@pytest.mark.parametrize(
    "layout",
    [["--parallel.dp_shard", "2"], ["--parallel.tp", "2", "--parallel.dp_shard", "1"]],
    ids=["fsdp2", "tp2"],
)
def test_two_gpus_over_nccl_match_the_cpu_reference(layout, cpu_reference, tmp_path):
    assert_close(launch(tmp_path, "two", 2, "--training.device", "cuda", *layout), cpu_reference, FP32_RTOL)


@two_gpus
def test_pipeline_with_timeline_on_two_gpus(cpu_reference, tmp_path):
    run = launch(
        tmp_path,
        "pp2",
        2,
        "--training.device",
        "cuda",
        "--parallel.pp",
        "2",
        "--parallel.dp_shard",
        "1",
        "--parallel.pp_schedule",
        "Interleaved1F1B",
        "--parallel.pp_microbatches",
        "4",
        "--run.pp_timeline",
        "true",
    )
    assert_close(run, cpu_reference, FP32_RTOL)
    bubble = json.loads((tmp_path / "pp2" / "pipeline_bubble.json").read_text())
    # CUDA-event timing: every rank did real work in the window, and idle is a fraction of it
    assert all(0.0 <= r["idle_fraction"] < 1.0 and r["F"] > 0 for r in bubble["ranks"])


@two_gpus
def test_expert_parallel_on_two_gpus(tmp_path):
    reference = launch(tmp_path, "moe-cpu", 1, "--training.device", "cpu", config=MOE_CONFIG)
    run = launch(
        tmp_path,
        "moe-ep2",
        2,
        "--training.device",
        "cuda",
        "--parallel.dp_shard",
        "2",
        "--parallel.ep",
        "2",
        config=MOE_CONFIG,
    )
    assert_close(run, reference, FP32_RTOL)
    assert [r["expert_load"] for r in run] == [r["expert_load"] for r in reference]


@two_gpus
def test_save_on_fsdp2_and_resume_on_tp2_on_gpus(cpu_reference, tmp_path):
    half = str(PARITY_STEPS // 2)
    common = ["--training.device", "cuda", "--checkpoint.interval", half]
    run_dir = tmp_path / "resume"
    first = run_train_cli(
        2,
        "--config",
        DEBUG_CONFIG,
        "--run.dir",
        str(run_dir),
        *common,
        "--parallel.dp_shard",
        "2",
        "--training.steps",
        half,
        gpus=True,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_train_cli(
        2,
        "--config",
        DEBUG_CONFIG,
        "--run.dir",
        str(run_dir),
        *common,
        "--parallel.tp",
        "2",
        "--parallel.dp_shard",
        "1",
        "--training.steps",
        str(PARITY_STEPS),
        "--checkpoint.resume",
        "auto",
        gpus=True,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert list(published(run_dir / "checkpoints"))[-1] == PARITY_STEPS
    assert_close(read_metrics(run_dir), cpu_reference, FP32_RTOL)


# ---- savers (docs/dp_savers.md sections 2-4); written without a GPU at hand, not run yet --------------------


def test_cpu_offload_on_one_gpu_matches_the_cpu_reference_with_less_device_memory(cpu_reference, tmp_path):
    # Parameters, gradients and Adam state in pinned host memory, the optimizer step on the host: the same
    # fp32 arithmetic, so the GPU tolerance. The debug model's 16 B/param of state (13.6 MB) leaves the device;
    # its activations (a few MB) stay, so the peak must drop.
    offload = launch(tmp_path, "offload", 1, "--training.device", "cuda", "--parallel.fsdp_cpu_offload", "true")
    assert_close(offload, cpu_reference, FP32_RTOL, keys=("loss", "grad_norm"))
    plain = launch(tmp_path, "plain", 1, "--training.device", "cuda")
    assert offload[-1]["peak_mem_bytes"] < plain[-1]["peak_mem_bytes"]


@two_gpus
@pytest.mark.parametrize(
    "knobs",
    [
        [
            "--parallel.dp_shard",
            "2",
            "--parallel.fsdp_cpu_offload",
            "true",
            "--parallel.grad_sync",
            "step",
            "--training.micro_batch",
            "2",
        ],
        ["--parallel.dp_shard", "2", "--parallel.fsdp_cpu_offload", "true", "--training.grad_clip", "0.05"],
    ],
    ids=["fsdp2-offload-step", "fsdp2-offload-clipping"],
)
def test_cpu_offload_on_two_gpus_matches_the_cpu_reference(knobs, cpu_reference, tmp_path):
    # The offloaded gradients' norm is reduced over the cpu:gloo half of the device-plane groups
    # (mesh/dims.py: mesh_backend_options); a clip far below the norm makes every step depend on it.
    run = launch(tmp_path, "offload2", 2, "--training.device", "cuda", *knobs)
    if "0.05" not in knobs:
        assert_close(run, cpu_reference, FP32_RTOL, keys=("loss", "grad_norm"))
    else:
        clipped = launch(tmp_path, "clip-cpu", 1, "--training.device", "cpu", "--training.grad_clip", "0.05")
        assert_close(run, clipped, FP32_RTOL, keys=("loss", "grad_norm"))


@two_gpus
def test_powersgd_over_nccl_reduces_exactly_first_then_compresses(cpu_reference, tmp_path):
    run = launch(
        tmp_path,
        "psgd",
        2,
        "--training.device",
        "cuda",
        "--parallel.dp_replicate",
        "2",
        "--parallel.dp_shard",
        "1",
        "--parallel.grad_compression",
        "powersgd",
    )
    # Steps 1-2 reduce exactly, so losses 1-3 (each computed before its own reduction) match the reference.
    assert_close(run[:3], cpu_reference[:3], FP32_RTOL)
    assert run[3]["loss"] != pytest.approx(cpu_reference[3]["loss"], rel=FP32_RTOL)


def test_profiled_gpu_run_writes_a_memory_snapshot_and_logs_mfu(tmp_path):
    import pickle

    run_dir = tmp_path / "prof"
    proc = run_train_cli(
        1,
        "--config",
        DEBUG_CONFIG,
        "--training.steps",
        "3",
        "--run.dir",
        str(run_dir),
        "--training.device",
        "cuda",
        "--profile.enabled",
        "true",
        "--profile.start_step",
        "2",
        "--profile.memory_snapshot",
        "true",
        "--training.peak_tflops",
        "100",
        gpus=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    snapshot = pickle.loads((run_dir / "profile" / "rank0.memory_snapshot.pickle").read_bytes())
    assert snapshot["segments"] and any(snapshot["device_traces"])  # what pytorch.org/memory_viz draws
    trace = json.loads((run_dir / "profile" / "rank0.pt.trace.json").read_text())
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])  # CUDA kernels were recorded
    assert all(r["mfu"] == r["tflops"] / 100 for r in read_metrics(run_dir))


def test_grouped_kv_attention_runs_on_the_flash_kernel_where_meshloom_says_it_does():
    """Where ``sdpa_reads_grouped_kv`` answers yes, the flash kernel alone serves ``enable_gqa`` (no silent
    fall-back to the math kernel), and its output equals the repeated-heads path to bf16 round-off."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from models.llama import causal_attention, sdpa_reads_grouped_kv

    q = torch.randn(2, 256, 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 256, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    assert sdpa_reads_grouped_kv(q, None) == (torch.cuda.get_device_capability() >= (8, 0))
    assert not sdpa_reads_grouped_kv(q.float(), None)  # fp32: the flash kernel does not serve it
    if not sdpa_reads_grouped_kv(q, None):
        pytest.skip("pre-Ampere GPU: meshloom repeats k/v there, which the parity tests cover")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises if flash cannot take the call
        out = causal_attention(q, k, v)
    rep = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(4, 2).transpose(1, 2),
        v.repeat_interleave(4, 2).transpose(1, 2),
        is_causal=True,
    ).transpose(1, 2)
    assert (out - rep).abs().max().item() <= 2e-2  # bf16: 8 significant bits on values of order 1
