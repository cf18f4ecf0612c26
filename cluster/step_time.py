"""How long one training step takes on a cluster, and what it spends the time on: a model you can read.

Arithmetic only; cluster/plan_layout.py searches layouts with it, and cluster/published_runs.py checks it against
published runs. Per step, for the slowest pipeline rank (with no pipeline, any rank), in seconds:

1. **Matmuls**: the model FLOPs of every block on the rank (models/flops.py: attention included, an MoE layer's
   active experts only) for its share of the tokens (tp splits the work of a token, cp the tokens of a
   sequence), forward and backward, plus a second forward of the blocks under full activation checkpointing
   (under selective checkpointing with tp > 1, of the row-parallel matmuls wo and w2 only), and the output head
   on the last stage. They run at ``matmul_efficiency(gpu)`` x the GPU's dense peak:
   one figure per GPU, the GPU's largest measured matmul throughput (MAMF, planning/gpus.py: GPUS) times
   ``MAMF_SHARE``, the share of it a real training step's matmuls reached on the one published run where
   matmuls are nearly everything (cluster/published_runs.py: derive_mamf_share).
2. **Memory-bound kernels**: norms, rotary, activations, residual adds, softmax and dropout where the scores
   are materialised, the loss: bytes each moves, counted kernel by kernel for the code that ran
   (``Workload.elementwise_bytes``), at the GPU's memory bandwidth. Backward moves twice a forward's bytes;
   both checkpointing modes rerun the forward's.
3. **TP**: per block and micro-batch, one all-reduce worth of traffic per sub-layer each way (with SP an
   all-gather plus a reduce-scatter, the same bytes), ring cost 2(t-1)/t x the activation, plus the
   recomputed forward's share (full checkpointing repeats 3 of a TP+SP forward's 4 collectives, selective its 2
   all-gathers). Exposed: the next matmul waits for it. Over NVLink when tp fits in a node.
4. **CP**: all-gather of K and V (at n_kv_heads width) forward and reduce-scatter of their gradients backward,
   exposed; the ring variant sends the same bytes in cp - 1 hops that overlap the attention of the block in
   hand, so only what exceeds that attention is exposed.
5. **EP**: an MoE layer sends every routed token out and back (two all-to-alls forward, two backward, two
   more if full checkpointing reruns the forward), (ep-1)/ep of them leaving the GPU. Exposed.
6. **The pipeline**: per-micro-batch work W of the slowest rank, m micro-batches; the bubble adds
   (pp-1)/(v·m) x m·W (a third of that for the zero-bubble schedules, whose warm-up still waits:
   docs/pipeline_parallel.md section 3). Each hop sends one micro-batch's activation (split over tp); a
   blocking send/recv (Megatron-LM 2021) exposes every transfer, an asynchronous one (torch) only the
   pipeline's fill and drain.
7. **DP**: FSDP all-gathers each weight (twice without a pipeline: forward and backward) and reduce-scatters
   each gradient in fp32 per micro-batch, overlapped with that micro-batch's compute by prefetching, so only
   what exceeds the compute is exposed; with a pipeline the stage gathers once and reduces once per step,
   exposed. DDP all-reduces gradients once per step, overlapped with the last micro-batch's backward
   (PyTorch DDP) or after it (Megatron-LM's own DDP). Ring costs over NVLink inside a node, the network
   otherwise.
8. **Optimizer**: AdamW reads and writes 40 bytes per parameter the rank owns (weights, gradients, m, v in
   fp32; the gradient norm), at the memory bandwidth.

step = m·W + bubble + exposed pipeline transfers + exposed DP + optimizer. From it: tokens per second per GPU,
model TFLOP/s per GPU (models/flops.py, no recomputation counted) and MFU against the dense peak. Not
modelled: kernel launch gaps, stragglers, data loading, logging, NCCL's protocol overheads, link contention
between dimensions that share the same links, and anything torch.compile fuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from mesh.pipeline import stage_ids_of_rank
from models.flops import head_flops_per_token, layer_flops_per_token
from planning.gpus import GPU, GPUS, PLANNER_GPUS
from planning.memory_estimate import block_parameters, even_stage_layers

if TYPE_CHECKING:
    from models.llama import ModelArgs
    from planning.layout import Layout

GPUS_PER_NODE = 8
# The share of a GPU's maximum achievable matmul throughput that a training step's matmuls reached, derived once
# from Megatron-LM's 1T-parameter run by cluster/published_runs.py: derive_mamf_share (tests/test_plan_layout.py
# checks that this is what the derivation gives).
MAMF_SHARE = 0.7930
# AdamW reads the fp32 weight, gradient, m and v and writes weight, m and v (28 bytes); clipping by the global
# norm reads the gradient twice and writes it once (12)
OPTIMIZER_BYTES_PER_PARAM = 40
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# Bytes per element that meshloom's eager RMSNorm and rotary read and write, by compute dtype width
# (LlamaWorkload's docstring counts them op by op): {width: (RMSNorm, rotary)}
NORM_ROTARY_BYTES = {2: (36, 52), 4: (28, 40)}


def planner_gpu(name: str) -> GPU:
    """The table row of ``--gpu NAME`` (a100, h100, h200, h800)."""
    fragment = PLANNER_GPUS[name]
    return next(g for g in GPUS if g.name == fragment)


def matmul_efficiency(gpu: GPU) -> float:
    """Item 1: the fraction of the dense bf16 peak a training step's matmuls run at on ``gpu``."""
    return gpu.mamf_tflops / gpu.bf16_tflops * MAMF_SHARE


# ---- the layout, and what the training code does around the math ------------------------------------------


@dataclass(frozen=True)
class Stack:
    """The behaviours of a training stack that change the time (not the model's math)."""

    name: str
    tp_reduce_scatter: bool  # TP: all-gather + reduce-scatter (True, as with SP) or all-reduce (False): same bytes
    data_parallel: str  # "fsdp" | "ddp_overlapped" (PyTorch DDP) | "ddp_after_backward" (Megatron-LM's DDP)
    grad_bytes: int  # bytes per gradient element on the wire
    p2p_blocking: bool  # pipeline sends and receives wait for each other between compute steps
    recompute_tp_share: float  # the share of a forward's TP collectives that full checkpointing repeats
    selective_tp_share: float = 0.0  # the share that selective checkpointing repeats (it recomputes all-gathers)


# meshloom: FSDP2 reduce-scatters fp32 gradients, torch's pipeline schedules post their sends asynchronously,
# and full checkpointing repeats 3 of the 4 TP+SP collectives of a forward; selective repeats the two all-gathers,
# half of the forward's traffic (an all-gather is half an all-reduce's; tests/test_activation_checkpoint.py).
MESHLOOM = Stack("meshloom", True, "fsdp", 4, False, 0.75, 0.5)


# ---- the model, as the time model sees it -------------------------------------------------------------------


class Workload(Protocol):
    """A model at a sequence length, as the time model sees it: FLOPs, parameters and bytes moved per token of
    one rank's share. ``LlamaWorkload`` is meshloom's own model; cluster/published_runs.py: MegatronGPT is the
    GPT Megatron-LM trained in 2021."""

    n_layers: int
    dim: int
    vocab_size: int
    seq_len: int

    def layer_flops(self, layer_id: int) -> float: ...  # model FLOPs of one token, forward + backward

    def head_flops(self) -> float: ...

    def layer_params(self, layer_id: int) -> dict[str, int]: ...  # {"tp": ..., "whole": ..., "experts": ...}

    def root_params(self, first: bool, last: bool) -> dict[str, int]: ...  # embedding, final norm, head

    def elementwise_bytes(self, layer_id: int, tp: int, sp: bool) -> float: ...  # one forward, per token, this rank

    def loss_bytes(self, tp: int) -> float: ...  # the loss, forward and backward, per token

    def tp_collectives(self, layer_id: int) -> float: ...  # all-reduce equivalents of one forward under TP

    def row_parallel_flops(self, layer_id: int) -> float: ...  # forward FLOPs per token of TP's row-parallel matmuls

    def kv_bytes(self) -> float: ...  # K and V of one token (what CP exchanges)

    def routed(self, layer_id: int) -> int: ...  # experts a token goes to in this layer (0: a dense layer)


@dataclass(frozen=True)
class LlamaWorkload:
    """meshloom's model (models/llama.py) trained by meshloom, in bf16 unless ``dtype_bytes`` = 4.

    Memory-bound bytes per element, from the eager ops in models/llama.py (w = bytes of the compute dtype, r/w
    = read/write): RMSNorm 36 (bf16: x.float() 2r+4w, pow 4r+4w, mean 4r, x·rsqrt 4r+4w, back to bf16 4r+2w,
    x weight 2r+2w; fp32 28), twice per block on h; rotary on q and k 52 (fp32 40): float, x cos, the rotated
    half (negate, cat), float, x sin, add, back; attention's output made contiguous 2w; two residual adds 3w
    each on h; the SwiGLU's silu 2w and product 3w on H; an MoE layer per routed pair the dispatch copy 2w·h,
    the gate product 2w·h and the combining add 3w·h, and the SwiGLU on He. The loss reads and writes each
    logit 36 bytes in bf16 (cast, log-softmax, its backward, cast back), 24 in fp32.
    """

    args: ModelArgs
    seq_len: int
    dtype_bytes: int = 2

    @property
    def n_layers(self) -> int:
        return self.args.n_layers

    @property
    def dim(self) -> int:
        return self.args.dim

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    def layer_flops(self, layer_id: int) -> float:
        return float(layer_flops_per_token(self.args, layer_id, self.seq_len))

    def head_flops(self) -> float:
        return float(head_flops_per_token(self.args))

    def layer_params(self, layer_id: int) -> dict[str, int]:
        return block_parameters(self.args, layer_id)

    def root_params(self, first: bool, last: bool) -> dict[str, int]:
        return {
            "tp": self.vocab_size * self.dim * (int(first) + int(last)),
            "whole": self.dim * int(last),
            "experts": 0,
        }

    def elementwise_bytes(self, layer_id: int, tp: int, sp: bool) -> float:
        a, w = self.args, self.dtype_bytes
        norm, rotary = NORM_ROTARY_BYTES[2 if w == 2 else 4]
        g = a.n_kv_heads * a.head_dim
        sequence_sharded = (2 * norm + 2 * 3 * w) * a.dim / (tp if sp else 1)  # norms and residual adds
        attention = (rotary * (a.dim + g) + 2 * w * a.dim) / tp
        if not a.is_moe_layer(layer_id):
            return sequence_sharded + attention + 5 * w * a.hidden_dim / tp
        m = a.moe
        shared = 5 * w * a.hidden_dim if m.n_shared_experts else 0.0
        per_pair = 7 * w * a.dim + 5 * w * m.hidden_dim
        return sequence_sharded + attention + (m.top_k * per_pair + shared + 12 * m.n_experts) / tp

    def loss_bytes(self, tp: int) -> float:
        return (36 if self.dtype_bytes == 2 else 24) * self.vocab_size / tp

    def tp_collectives(self, layer_id: int) -> float:
        # an MoE layer under TP works on its own tokens (TokenSplitMoE): only attention's collectives remain
        return 1.0 if self.args.is_moe_layer(layer_id) else 2.0

    def row_parallel_flops(self, layer_id: int) -> float:
        # attention.wo, and a dense layer's w2 (an MoE layer under TP splits tokens, not weights: TokenSplitMoE)
        a = self.args
        wo = a.n_heads * a.head_dim * a.dim
        return 2.0 * (wo if a.is_moe_layer(layer_id) else wo + a.hidden_dim * a.dim)

    def kv_bytes(self) -> float:
        return 2 * self.args.n_kv_heads * self.args.head_dim * self.dtype_bytes

    def routed(self, layer_id: int) -> int:
        return self.args.moe.top_k if self.args.is_moe_layer(layer_id) else 0


# ---- the time model ------------------------------------------------------------------------------------------


def ring(bytes_: float, n: int) -> float:
    """Bytes one rank sends in a ring all-gather or reduce-scatter of a ``bytes_`` tensor over ``n`` ranks."""
    return (n - 1) / n * bytes_ if n > 1 else 0.0


def link(gpu: GPU, span: int) -> float:
    """Bytes per second between the ranks of a group spanning ``span`` consecutive ranks."""
    return gpu.nvlink_gb_s * 1e9 if span <= GPUS_PER_NODE else gpu.network_gb_s * 1e9


def stage_layers_of(workload: Workload, layout: Layout) -> list[list[int]]:
    if layout.stage_layers:
        return [list(s) for s in layout.stage_layers]
    return even_stage_layers(workload.n_layers, layout.n_stages)


def stage_ids(layout: Layout, pp_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` runs (looped schedules r, r + pp, ...; V-shaped r and 2·pp - 1 - r)."""
    if layout.pp == 1:
        return [0]
    return stage_ids_of_rank(pp_rank, layout.pp, layout.stages_per_rank, layout.pp_schedule)


@dataclass
class StepTime:
    """Seconds per step by item of the module docstring, and what follows from them."""

    matmul: float = 0.0  # forward + backward matmuls (item 1), without the recomputed forward
    recompute: float = 0.0  # the recomputed forward: matmuls (full, or TP's row-parallel ones) and memory-bound
    memory_bound: float = 0.0  # item 2, forward and backward
    tp: float = 0.0
    cp: float = 0.0
    ep: float = 0.0
    bubble: float = 0.0
    pp: float = 0.0
    dp: float = 0.0
    optimizer: float = 0.0

    @property
    def step(self) -> float:
        return sum(vars(self).values())


def microbatch_seconds(
    workload: Workload, layout: Layout, stack: Stack, gpu: GPU, layers: list[int], last: bool, efficiency: float
) -> StepTime:
    """Items 1-5 for one micro-batch through ``layers`` on one rank (and the head if ``last``)."""
    tp, cp, ep = layout.tp, layout.cp, layout.ep
    sp = stack.tp_reduce_scatter and tp > 1
    seqs = layout.sequences_per_microbatch
    n = seqs * workload.seq_len / cp  # tokens of the micro-batch on this rank's cp slice
    flops_rate = efficiency * gpu.bf16_tflops * 1e12
    hbm = gpu.hbm_tb_s * 1e12
    full, selective = layout.activation_checkpoint == "full", layout.activation_checkpoint == "selective"
    w = 2  # bytes of an activation element on the wire (bf16/fp16)
    t = StepTime()
    for i in layers:
        matmul = workload.layer_flops(i) * n / tp / flops_rate
        elementwise = workload.elementwise_bytes(i, tp, sp) * n / hbm
        t.matmul += matmul
        t.memory_bound += 3 * elementwise
        t.recompute += (matmul / 3 if full else 0.0) + (elementwise if full or selective else 0.0)
        if selective and tp > 1:  # the row-parallel matmuls run again (mesh/activation_checkpoint.py)
            t.recompute += workload.row_parallel_flops(i) * n / tp / flops_rate
        if tp > 1:
            repeated = stack.recompute_tp_share if full else stack.selective_tp_share if selective else 0.0
            collectives = workload.tp_collectives(i) * (2 + repeated)
            t.tp += collectives * 2 * ring(n * workload.dim * w, tp) / link(gpu, tp)
        if cp > 1:
            # both checkpointing modes gather K and V again in backward (selective recomputes all-gathers; the ring's
            # sends cannot be kept)
            kv = ring(seqs * workload.seq_len * workload.kv_bytes() / tp, cp) * (3 if full or selective else 2)
            comm = kv / link(gpu, tp * cp)
            if layout.cp_attention == "ring":
                attention_share = 12 * workload.dim * workload.seq_len / workload.layer_flops(i)
                comm = max(0.0, comm - attention_share * matmul)
            t.cp += comm
        if ep > 1 and workload.routed(i):
            exchanged = (n / tp) * workload.routed(i) * workload.dim * w * (ep - 1) / ep
            t.ep += exchanged * (6 if full else 4) / link(gpu, tp * cp * ep)
    if last:
        t.matmul += workload.head_flops() * n / tp / flops_rate
        t.memory_bound += workload.loss_bytes(tp) * n / hbm
    return t


def owned_params(
    workload: Workload, layout: Layout, stack: Stack, layers: list[int], first: bool, last: bool
) -> dict[str, float]:
    """Parameters of the rank: ``gathered`` (split by TP and EP only) and ``owned`` (what its optimizer steps:
    FSDP-sharded too; all of them under DDP)."""
    total = dict(workload.root_params(first, last))
    for i in layers:
        for key, value in workload.layer_params(i).items():
            total[key] += value
    gathered = total["tp"] / layout.tp + total["whole"] + total["experts"] / layout.ep
    shards = layout.dp_shard * layout.cp if stack.data_parallel == "fsdp" else 1
    return {"gathered": gathered, "owned": gathered / shards}


def step_time(
    workload: Workload, layout: Layout, stack: Stack, gpu: GPU, global_batch: int, efficiency: float | None = None
) -> StepTime:
    """Items 1-8 of the module docstring for one step of ``global_batch`` sequences (``efficiency``: the matmul
    efficiency, ``matmul_efficiency(gpu)`` unless given)."""
    efficiency = matmul_efficiency(gpu) if efficiency is None else efficiency
    m = global_batch // (layout.dp * layout.sequences_per_microbatch)  # micro-batches per replica and step
    stages = stage_layers_of(workload, layout)
    v, p = layout.stages_per_rank, layout.pp
    hbm = gpu.hbm_tb_s * 1e12
    slowest = None
    for r in range(p):
        ids = stage_ids(layout, r)
        parts = [
            microbatch_seconds(workload, layout, stack, gpu, stages[s], s == len(stages) - 1, efficiency) for s in ids
        ]
        mb = StepTime(**{k: sum(getattr(x, k) for x in parts) for k in vars(parts[0])})
        layers = [i for s in ids for i in stages[s]]
        params = owned_params(workload, layout, stack, layers, 0 in ids, len(stages) - 1 in ids)
        if slowest is None or mb.step > slowest[0].step:
            slowest = (mb, params)
    mb, params = slowest
    t = StepTime(**{k: m * value for k, value in vars(mb).items()})
    work = mb.step * m
    if p > 1:
        t.bubble = (p - 1) / (v * m) * work / (3 if layout.pp_schedule in ZERO_BUBBLE else 1)
        hop = layout.sequences_per_microbatch * workload.seq_len / layout.cp * workload.dim * 2 / layout.tp
        hops = 2 * (v * m + p - 1) if stack.p2p_blocking else 2 * (v * p - 1)
        t.pp = hops * hop / link(gpu, layout.gpus // p + 1)  # ranks r and r + gpus/pp
    t.dp = dp_seconds(layout, stack, gpu, params, mb, m)
    t.optimizer = OPTIMIZER_BYTES_PER_PARAM * params["owned"] / hbm
    return t


def dp_seconds(layout: Layout, stack: Stack, gpu: GPU, params: dict[str, float], mb: StepTime, m: int) -> float:
    """Item 7: exposed data-parallel traffic per step for the slowest rank."""
    shards = layout.dp_shard * layout.cp  # FSDP shards over dp_shard x cp (mesh/dims.py)
    within = link(gpu, layout.tp * layout.cp * layout.dp_shard)
    gathered = params["gathered"]
    replicas = layout.dp_replicate
    across = (2 * ring(stack.grad_bytes * params["owned"], replicas) / link(gpu, layout.gpus)) if replicas > 1 else 0.0
    if stack.data_parallel == "fsdp":
        if shards == 1:
            return across
        w = 2
        if layout.pp > 1:  # gather once, reduce once, per step: exposed
            return ring((w + stack.grad_bytes) * gathered, shards) / within + across
        per_microbatch = ring((2 * w + stack.grad_bytes) * gathered, shards) / within
        compute = mb.matmul + mb.recompute + mb.memory_bound
        return m * max(0.0, per_microbatch - compute) + across
    allreduce = 2 * ring(stack.grad_bytes * gathered, layout.dp) / link(gpu, layout.tp * layout.dp)
    if stack.data_parallel == "ddp_overlapped":  # during the last micro-batch's backward (and its recompute)
        backward = (2 * mb.matmul + 2 * mb.memory_bound) / 3 + mb.recompute + mb.tp
        return max(0.0, allreduce - backward)
    return allreduce
