"""The precision a run chooses (runtime/process.py): ``training.mixed_precision=auto`` (the default) is bf16 on
CUDA (bf16 compute, fp32 master weights and reductions, on every layout: FSDP's policy, one rank included) and
fp32 on CPU, where every parity test runs; fp32 on CUDA uses TF32 matmuls. The CUDA decision is a function of
the device type, checked here on a machine without a GPU."""

import pytest
import torch

from runtime.process import choose_precision, device_type_of, enable_tf32, precision_banner


def test_auto_is_bf16_on_cuda_and_fp32_on_cpu_and_an_explicit_choice_stays():
    assert choose_precision("auto", "cuda") == "bf16"
    assert choose_precision("auto", "cpu") == "fp32"
    assert choose_precision("fp32", "cuda") == "fp32" and choose_precision("bf16", "cpu") == "bf16"
    assert choose_precision("auto", "cuda", "powersgd") == "fp32"  # PowerSGD's DDP model has no bf16 path
    assert choose_precision("auto", "cuda", "onebit_adam") == "fp32"  # nor has 1-bit Adam's replicated one
    assert choose_precision("auto", "cuda", "bf16") == "bf16"
    assert device_type_of("auto", cuda_available=True) == "cuda"
    assert device_type_of("cpu", cuda_available=True) == "cpu"
    assert device_type_of("auto", cuda_available=False) == "cpu"


@pytest.mark.parametrize("device_type, precision, fsdp", [("cpu", "fp32", False), ("cuda", "bf16", True)])
def test_the_plan_resolves_auto_for_the_device_on_one_process(monkeypatch, device_type, precision, fsdp):
    # one process, no data parallelism: on CUDA the default is still bf16 compute with fp32 master weights
    # (FSDP's mixed-precision policy over one rank), on CPU fp32 without FSDP; the plan holds it, the config
    # keeps what the user wrote
    import planning.plan
    from planning.plan import LayoutPlan
    from runtime.config import load_config

    monkeypatch.setattr(planning.plan, "device_type_of", lambda requested: device_type)
    cfg = load_config([])
    assert cfg.training.mixed_precision == "auto"
    plan = LayoutPlan.resolve(cfg, 1)
    assert plan.layout.mixed_precision == precision and plan.layout.fsdp is fsdp
    assert cfg.training.mixed_precision == "auto"


def test_tf32_is_turned_on_for_fp32_on_cuda_only_and_the_banner_says_so():
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision if hasattr(matmul, "fp32_precision") else matmul.allow_tf32
    try:
        assert not enable_tf32(torch.device("cpu"), "fp32")
        assert not enable_tf32(torch.device("cuda"), "bf16")
        assert enable_tf32(torch.device("cuda"), "fp32")  # only flags: no CUDA call
        assert (matmul.fp32_precision == "tf32") if hasattr(matmul, "fp32_precision") else matmul.allow_tf32
    finally:
        if hasattr(matmul, "fp32_precision"):
            matmul.fp32_precision = before
        else:
            matmul.allow_tf32 = before
    assert precision_banner("bf16", False) == "bf16 compute, fp32 master weights and reductions"
    assert precision_banner("fp32", True) == "fp32, TF32 matmuls" and precision_banner("fp32", False) == "fp32"


def test_mfu_under_tf32_uses_the_tensor_core_figure():
    from planning.gpus import table_peak_tflops

    name = "NVIDIA H100 80GB HBM3"
    assert table_peak_tflops(name, "tf32") == table_peak_tflops(name, "bf16") / 2 > table_peak_tflops(name, "fp32")
