"""The one table of GPU figures: dense peaks for MFU (training/mfu.py), and what the layout planner
(cluster/plan_layout.py) needs for the GPUs it plans for.

Peaks are dense (no sparsity) tensor-core figures from NVIDIA's data sheets, looked up by the device's name,
for bf16 and for fp32. The planner's rows also carry memory size and bandwidth, NVLink and network bandwidth
per GPU, and the largest matmul throughput anyone measured on the part. Bandwidths are per GPU and per
direction (data sheets quote NVLink both ways added up).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    """One GPU's figures. The planner's fields are None on rows it does not plan for."""

    name: str  # a fragment of torch.cuda.get_device_name(); the first row that matches wins
    bf16_tflops: float  # dense peak, bf16 (and fp16) tensor cores
    fp32_tflops: float  # dense peak, plain FP32
    hbm_gb: float | None = None  # memory, GB (1e9 bytes)
    hbm_tb_s: float | None = None  # memory bandwidth, TB/s
    nvlink_gb_s: float | None = None  # GPU to GPU inside a node, per direction, GB/s
    network_gb_s: float | None = None  # to other nodes, per GPU and direction: the node's NICs over its 8 GPUs
    mamf_tflops: float | None = None  # the largest bf16 matmul throughput measured (see below)


# Dense peaks: NVIDIA's data sheets (A100: nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf; H100 and H800:
# the H100 Tensor Core GPU data sheet and the H800 product brief, where the H800 SXM keeps the H100 SXM's tensor
# cores and loses NVLink bandwidth and FP64; H200: the H200 Tensor Core GPU data sheet). NVLink: A100 600 GB/s,
# H100 and H200 900 GB/s, H800 400 GB/s, both directions added (the same data sheets). Networks: the clusters
# the published runs used or the vendor's reference node: DGX A100 (Selene, where Megatron-LM's runs ran) has
# one 200 Gb/s HDR InfiniBand NIC per GPU (Narayanan et al. 2021, section 5), 25 GB/s; DGX H100 and DGX H200
# one 400 Gb/s NIC per GPU, 50 GB/s; DeepSeek's H800 cluster 50 GB/s of InfiniBand per GPU (DeepSeek-V3
# technical report, arXiv 2412.19437, section 3.2.2, which also measures 160 GB/s over the H800's NVLink).
# MAMF, "maximum achievable matmul FLOPS": the best bf16 torch.mm over a search of shapes, measured by
# stas00/ml-engineering (compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table"):
# A100 SXM 271.2, H100 SXM 794.5 ("H200 is the same"). The H800 is the H100's die and clocks: its figure is
# the H100's (not measured on an H800).
GPUS: tuple[GPU, ...] = (
    GPU("H200 NVL", 835.0, 60.0),
    GPU("H200", 989.4, 66.9, hbm_gb=141, hbm_tb_s=4.8, nvlink_gb_s=450, network_gb_s=50, mamf_tflops=794.5),
    GPU("H100 NVL", 835.0, 60.0),
    GPU("H100 PCIe", 756.0, 51.2),
    GPU("H100", 989.4, 66.9, hbm_gb=80, hbm_tb_s=3.35, nvlink_gb_s=450, network_gb_s=50, mamf_tflops=794.5),  # SXM
    GPU("H800", 989.4, 66.9, hbm_gb=80, hbm_tb_s=3.35, nvlink_gb_s=200, network_gb_s=50, mamf_tflops=794.5),  # SXM
    GPU("A100-SXM4-80GB", 312.0, 19.5, hbm_gb=80, hbm_tb_s=2.039, nvlink_gb_s=300, network_gb_s=25, mamf_tflops=271.2),
    GPU("A100", 312.0, 19.5),
    GPU("L40S", 362.1, 91.6),
)
# The names ``python -m cluster.plan_layout --gpu`` takes, and the row each one means.
PLANNER_GPUS = {"a100": "A100-SXM4-80GB", "h100": "H100", "h200": "H200", "h800": "H800"}


def gpu_row(device_name: str) -> GPU | None:
    """The first row whose name is part of ``device_name`` (case-insensitive), or None."""
    for gpu in GPUS:
        if gpu.name.lower() in device_name.lower():
            return gpu
    return None


def table_peak_tflops(device_name: str, mixed_precision: str) -> float | None:
    """The table's figure for a device name, or None if not listed; ``tf32``: half the dense bf16 figure where TF32
    tensor cores exist (Ampere on), else the plain FP32 one."""
    gpu = gpu_row(device_name)
    if gpu is None:
        return None
    if mixed_precision == "tf32":
        return max(gpu.bf16_tflops / 2, gpu.fp32_tflops)
    return gpu.bf16_tflops if mixed_precision == "bf16" else gpu.fp32_tflops
