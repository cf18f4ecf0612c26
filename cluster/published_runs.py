"""The planner beside training runs that really happened: Megatron-LM's Table 1, torchtitan's H100 runs and
Llama 3's Table 4, each row's error printed by one command.

    python -m cluster.plan_layout --validate [--markdown]

**The runs.** Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (arXiv 2104.04473), Table 1: ten GPT models from 1.7B to 1T parameters on up to 3,072 A100 80GB
GPUs of NVIDIA's Selene (DGX A100 nodes: 8 GPUs on NVLink, one 200 Gb/s HDR InfiniBand NIC per GPU), with the
achieved TFLOP/s per GPU. The same table, as an image, is in Megatron-LM's README from April 2021
(github.com/NVIDIA/Megatron-LM, commit 50a4b5f, images/cases_april2021.png): hidden size, layers,
parameters, model-parallel size (tp x pp), GPUs, batch and TFLOP/s per GPU, every figure below checked
against it. How each run was launched is in the repository's examples/sc21/run_table_1.sh and CONFIG.sh
(commit de7dc40, August 2021, "scripts for sc21"): attention heads, the split of the model-parallel size into
TP and PP, the micro-batch size, the interleaved schedule's layers per virtual stage, the data-parallel
implementation, ``--checkpoint-activations`` (full recomputation) on every row, ``--fp16``, sequence 2,048.

**The model, as it was.** A GPT, not a Llama: learned position embeddings, LayerNorm, multi-head attention
(no GQA) that materialises the s x s scores (fused scale-mask-softmax, then dropout), a GeLU MLP of 4h, biases,
vocabulary 51,200 (padded, the README says), the output head tied to the embedding. Megatron-LM 2021's code
(commit de7dc40) fixes the rest: TP all-reduces (no sequence parallelism), fp16 gradients reduced as they
are (``--accumulate-allreduce-grads-in-fp32`` is off), PyTorch DDP (all-reduce overlapped with backward) for
the rows with ``DDP=torch`` and its own DDP (all-reduce after backward) for ``DDP=local``, blocking
send/recv between stages, each split over tp for the inter-node hop (``scatter_gather_tensors_in_pipeline``,
on by default), the fused kernels on by default (masked softmax, bias-GeLU, bias-dropout-add).

**Like with like.** The paper's TFLOP/s count the recomputed forward (``megatron_flops_per_step``
below): the planner predicts a step time, and the prediction is compared through the same
count, FLOPs per step / (step time x GPUs).

**One number derived, not fitted per row.** Every hardware figure is a data-sheet figure or a published
measurement (planning/gpus.py: GPUS). The one derived number is ``MAMF_SHARE`` (cluster/step_time.py):
the share of the A100's maximum achievable matmul throughput (271.2 of 312 TFLOP/s) that Megatron-LM's
matmuls reached inside a training step. ``derive_mamf_share`` finds it from the 1T row alone: the row whose
step is most nearly all matmul (hidden size 25,600: attention's s x s terms and every other memory-bound
kernel are smallest next to the h² matmuls), so it measures the matmuls and little else. That row's error is
therefore zero by construction; the other nine are predictions.

**A second check, outside the goal: torchtitan on H100s.** torchtitan's benchmarks/llama3_h100_202412_torchtitan.md
(commit 9dec370's configuration, December 2024) trained Llama 3.1 8B in bf16 with FSDP and selective
checkpointing, local batch 2 of 8,192 tokens (train_configs/llama3_8b.toml), on 8 and on 128 H100s: 5,762 and
5,605 tokens/s per GPU. Its H100s are not the data sheet's: 96 GB of HBM2e at 2.4 TB/s, run at a 500 W power
limit whose peak FLOP/s, its authors write, they do not know. The planner (meshloom's model and stack,
the H100 SXM's peak and MAMF, torchtitan's memory bandwidth) predicts more than they measured; ``torchtitan_rows``
prints how much. It is the only check of an H100 figure here, and it is not a tight one.

**A third check, not tuned on either: Llama 3 405B.** Table 4 of "The Llama 3 Herd of Models" (Llama Team,
AI @ Meta, 2024, arXiv 2407.21783) lists three layouts of the 405B pre-training on 8,192 and 16,384 H100s (tp,
cp, pp, dp, sequence length, sequences per dp rank, 16M tokens a step) and the TFLOP/s per GPU each reached.
``llama3_rows`` gives the planner the degrees only: its ``choose`` (cluster/search.py) picks the schedule,
stages per rank, micro-batch size and checkpointing, and the chosen variant's TFLOP/s stand beside Meta's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cluster.search import choose
from cluster.step_time import MESHLOOM, LlamaWorkload, Stack, matmul_efficiency, planner_gpu, step_time
from models.presets import PRESETS
from planning.layout import Layout, degrees

VOCAB, SEQ = 51200, 2048
A100 = planner_gpu("a100")
CALIBRATION_ROW = "1008.0B"


# ---- the GPT FLOP formulas the published runs are counted in ----------------------------------------


def gpt_layer_flops_per_token(dim: int, seq_len: int) -> int:
    """Model FLOPs of one training token in one block of a GPT of width ``dim`` (Megatron-LM's: multi-head
    attention, a 4·dim GeLU MLP): 6 x its 12·dim² matmul weights (QKV 3, output 1, MLP 8), and the attention
    scores and weighted sum over all ``seq_len`` positions, 12·dim·seq_len (the convention of models/flops.py, step 2)."""
    return 72 * dim**2 + 12 * dim * seq_len


def gpt_head_flops_per_token(dim: int, vocab_size: int) -> int:
    """Model FLOPs of one training token in a GPT's output head (tied to the embedding or not, a matmul)."""
    return 6 * dim * vocab_size


def megatron_flops_per_step(batch: int, seq_len: int, n_layers: int, dim: int, vocab_size: int) -> float:
    """FLOPs of one training step of a GPT as Narayanan et al. (2021, "Efficient Large-Scale Language Model
    Training on GPU Clusters Using Megatron-LM", section 5.1) count them for the TFLOP/s of their Table 1:

        96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))

    B sequences of s tokens, l layers of width h, vocabulary V. Per token and layer: 24h² matmul FLOPs in
    forward (the 12h² weights of attention and a 4h MLP, 2 FLOPs each) and 4·s·h for the full s x s attention,
    run four times (forward, the recomputed forward of full activation checkpointing, and a backward worth
    two forwards); plus 6·h·V for the output head (not recomputed). It counts the recomputation, so it is
    what the GPUs executed (hardware FLOPs), not the model FLOPs of ``flops_per_token`` (three passes).
    """
    return 96 * batch * seq_len * n_layers * dim**2 * (1 + seq_len / (6 * dim) + vocab_size / (16 * n_layers * dim))


@dataclass(frozen=True)
class MegatronGPT:
    """Megatron-LM's GPT of 2021 at one size, as cluster/step_time.py: Workload sees it.

    Per token and layer: 72h² + 12·s·h model FLOPs (models/flops.py: gpt_layer_flops_per_token; forward 24h²
    + 4·s·h, the full scores; backward twice), 12h² + 13h parameters (the 7h biases of the column-parallel QKV and first MLP matmul split over tp).
    Memory-bound bytes of one forward per token on a tp rank (fp16, w = 2): two LayerNorms 4h each and two
    fused bias-dropout-adds 7h each (read the matmul output and the residual, write the sum and a 1-byte
    mask), all on every tp rank: 22h; the fused bias-GeLU on 4h/t (read, write: 16h/t); attention's output
    made contiguous (4h/t); per head and key position (a·s/t), the fused scale-mask-softmax reads and writes
    the fp16 scores (4 bytes) and dropout reads them and writes them and a mask (5 bytes). The loss: the
    vocabulary-parallel cross entropy in fp32 reads and writes each logit about 60 bytes (cast, max,
    subtract, exp, sum, normalise; backward: subtract, scale, cast back).
    """

    n_layers: int
    dim: int
    heads: int
    vocab_size: int = VOCAB
    seq_len: int = SEQ

    def layer_flops(self, layer_id: int) -> float:
        return float(gpt_layer_flops_per_token(self.dim, self.seq_len))

    def head_flops(self) -> float:
        return float(gpt_head_flops_per_token(self.dim, self.vocab_size))

    def layer_params(self, layer_id: int) -> dict[str, int]:
        return {"tp": 12 * self.dim**2 + 7 * self.dim, "whole": 6 * self.dim, "experts": 0}

    def root_params(self, first: bool, last: bool) -> dict[str, int]:
        # the word embedding (split over tp), and on the last stage its copy that the tied head uses
        words = self.vocab_size * self.dim * (int(first) + int(last and not first))
        return {"tp": words, "whole": self.seq_len * self.dim * int(first) + 2 * self.dim * int(last), "experts": 0}

    def elementwise_bytes(self, layer_id: int, tp: int, sp: bool) -> float:
        h, a, s = self.dim, self.heads, self.seq_len
        return 22 * h + (16 * h + 4 * h) / tp + 9 * a * s / tp

    def loss_bytes(self, tp: int) -> float:
        return 60 * self.vocab_size / tp

    def tp_collectives(self, layer_id: int) -> float:
        return 2.0

    def row_parallel_flops(self, layer_id: int) -> float:
        return 10.0 * self.dim**2  # the attention projection (h x h) and the second MLP matmul (4h x h), forward

    def kv_bytes(self) -> float:
        return 0.0

    def routed(self, layer_id: int) -> int:
        return 0

    def parameters(self) -> int:
        """P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h)), the paper's count (embeddings once)."""
        return self.n_layers * (12 * self.dim**2 + 13 * self.dim) + (self.vocab_size + self.seq_len) * self.dim


def megatron_2021(ddp: str) -> Stack:
    """Megatron-LM as examples/sc21 ran it: no SP, fp16 gradients, blocking p2p, full recomputation repeats
    both all-reduces of a forward."""
    data_parallel = {"torch": "ddp_overlapped", "local": "ddp_after_backward"}[ddp]
    return Stack("Megatron-LM 2021", False, data_parallel, 2, True, 1.0)


@dataclass(frozen=True)
class MegatronRun:
    """One row of Table 1 (params, heads, hidden, layers, GPUs, batch, TFLOP/s: the paper and the April 2021
    README) with how it was launched (tp, pp, micro-batch, layers per virtual stage, DDP: run_table_1.sh)."""

    name: str  # parameters, as the table prints them
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int  # sequences per step
    micro_batch: int
    layers_per_virtual_stage: int  # 0: no interleaving
    ddp: str
    published_tflops: float  # achieved TFLOP/s per GPU
    published_pflops: float  # achieved aggregate petaFLOP/s (the README's last column)

    @property
    def model(self) -> MegatronGPT:
        return MegatronGPT(self.layers, self.hidden, self.heads)

    @property
    def layout(self) -> Layout:
        v = self.layers // self.pp // self.layers_per_virtual_stage if self.layers_per_virtual_stage else 1
        return Layout(
            dims=degrees(tp=self.tp, pp=self.pp, dp_shard=self.gpus // (self.tp * self.pp)),
            pp_schedule="Interleaved1F1B" if v > 1 else "1F1B",
            stages_per_rank=v,
            sequences_per_microbatch=self.micro_batch,
            activation_checkpoint="full",
        )

    def flops_per_step(self) -> float:
        return megatron_flops_per_step(self.batch, SEQ, self.layers, self.hidden, VOCAB)


MEGATRON_TABLE_1: tuple[MegatronRun, ...] = (
    MegatronRun("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 0, "torch", 137, 4.4),
    MegatronRun("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, 0, "torch", 138, 8.8),
    MegatronRun("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, 0, "torch", 142, 18.2),
    MegatronRun("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 8, 0, "torch", 135, 34.6),
    MegatronRun("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 4, 0, "local", 138, 70.8),
    MegatronRun("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 5, "local", 140, 143.8),
    MegatronRun("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 5, "local", 148, 227.1),
    MegatronRun("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 3, "local", 155, 297.4),
    MegatronRun("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 1, "local", 163, 410.2),
    MegatronRun("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 1, 0, "local", 163, 502.0),
)


def predicted_tflops(run: MegatronRun, efficiency: float | None = None) -> tuple[float, dict]:
    """(TFLOP/s per GPU as the paper counts them, the step's breakdown in seconds) for one row."""
    t = step_time(run.model, run.layout, megatron_2021(run.ddp), A100, run.batch, efficiency)
    return run.flops_per_step() / (t.step * run.gpus) / 1e12, {**vars(t), "step": t.step}


def derive_mamf_share(run_name: str = CALIBRATION_ROW) -> float:
    """The matmul efficiency at which the model reproduces ``run_name``'s published TFLOP/s, as a share of the
    A100's MAMF/peak (bisection: the prediction rises with the efficiency)."""
    run = next(r for r in MEGATRON_TABLE_1 if r.name == run_name)
    low, high = 0.1, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if predicted_tflops(run, mid)[0] < run.published_tflops else (low, mid)
    return (low + high) / 2 / (A100.mamf_tflops / A100.bf16_tflops)


def validation_rows() -> list[dict]:
    """Every row of Table 1: the run, the published and predicted TFLOP/s per GPU, the error, and the shares of
    the predicted step (the test and docs/combining.md both read these)."""
    rows = []
    for run in MEGATRON_TABLE_1:
        predicted, parts = predicted_tflops(run)
        step = parts["step"]
        m = run.batch // (run.layout.dp * run.micro_batch)
        rows.append(
            {
                "run": run,
                "microbatches": m,
                "predicted": predicted,
                "error": predicted / run.published_tflops - 1,
                "step_s": step,
                "shares": {k: v / step for k, v in parts.items() if k != "step"},
            }
        )
    return rows


def markdown_table(rows: list[dict] | None = None) -> str:
    """The validation table of docs/combining.md, exactly as the chapter prints it."""
    rows = rows if rows is not None else validation_rows()
    head = (
        "| params | h | layers | tp | pp | v | GPUs | batch | mb | m | published TFLOP/s | predicted | error "
        "| matmul | mem-bound | recompute | TP | bubble | PP | DP |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        run, s = r["run"], r["shares"]
        note = " (derives the efficiency)" if run.name == CALIBRATION_ROW else ""
        lines.append(
            f"| {run.name}{note} | {run.hidden} | {run.layers} | {run.tp} | {run.pp} | {run.layout.stages_per_rank} "
            f"| {run.gpus:,} | {run.batch:,} | {run.micro_batch} | {r['microbatches']} | {run.published_tflops:.0f} "
            f"| {r['predicted']:.1f} | {r['error']:+.1%} | {s['matmul']:.0%} | {s['memory_bound']:.0%} | {s['recompute']:.0%} "
            f"| {s['tp']:.0%} | {s['bubble']:.0%} | {s['pp']:.0%} | {s['dp']:.0%} |"
        )
    efficiency = matmul_efficiency(A100)
    return head + "\n".join(lines) + f"\n\nA100 matmul efficiency {efficiency:.3f} ({efficiency * 312:.0f} TFLOP/s).\n"


# ---- torchtitan on power-limited H100s -----------------------------------------------------------------------

# benchmarks/llama3_h100_202412_torchtitan.md, "Hardware": 96 GB HBM2e at 2.4 TB/s, 400 Gb/s per GPU, 500 W.
TORCHTITAN_H100 = replace(planner_gpu("h100"), name="H100 96GB HBM2e, 500 W", hbm_gb=96, hbm_tb_s=2.4)


@dataclass(frozen=True)
class TorchtitanRun:
    """Tables 1 and 3 of torchtitan's H100 benchmark, the bf16 "FSDP" rows (no compile, no Float8)."""

    name: str
    gpus: int
    local_batch: int
    published_tokens_per_s: float  # per GPU


TORCHTITAN_RUNS: tuple[TorchtitanRun, ...] = (
    TorchtitanRun("Llama 3.1 8B, FSDP, 8 GPUs", 8, 2, 5762),
    TorchtitanRun("Llama 3.1 8B, FSDP, 128 GPUs", 128, 2, 5605),
)


def torchtitan_rows() -> list[dict]:
    """Each torchtitan row: published and predicted tokens/s per GPU, and the error."""
    rows = []
    for run in TORCHTITAN_RUNS:
        layout = Layout(
            dims=degrees(dp_shard=run.gpus), sequences_per_microbatch=run.local_batch, activation_checkpoint="selective"
        )
        t = step_time(LlamaWorkload(PRESETS["llama3-8b"], 8192), layout, MESHLOOM, TORCHTITAN_H100, run.gpus * 2)
        predicted = run.local_batch * 8192 / t.step
        rows.append({"run": run, "predicted": predicted, "error": predicted / run.published_tokens_per_s - 1})
    return rows


def torchtitan_markdown(rows: list[dict] | None = None) -> str:
    rows = rows if rows is not None else torchtitan_rows()
    lines = [
        "| run | published tokens/s per GPU | predicted | error |",
        "|---|---|---|---|",
        *(
            f"| {r['run'].name} | {r['run'].published_tokens_per_s:,} | {r['predicted']:,.0f} | {r['error']:+.1%} |"
            for r in rows
        ),
    ]
    return "\n".join(lines) + "\n"


# ---- Llama 3 405B on up to 16,384 H100s ---------------------------------------------------------------------


@dataclass(frozen=True)
class Llama3Run:
    """One row of Table 4 of "The Llama 3 Herd of Models" (Llama Team, AI @ Meta, 2024, arXiv 2407.21783,
    section 3.3.2, "Scaling configurations and MFU for each stage of Llama 3 405B pre-training"): Llama 3 405B
    in bf16 on H100 SXM 80GB GPUs (700 W), tokens per batch and TFLOP/s per GPU as published. Transcribed from
    the table as quoted at stevengong.co/notes/Model-FLOPs-Utilization, and the same figures (GPUs, TP, CP, PP,
    tokens per batch, TFLOP/s) from the SC'24 slide quoted at glennklockwood.com/garden/llama-3.1."""

    gpus: int
    tp: int
    cp: int
    pp: int
    dp: int
    seq_len: int
    batch_per_dp: int  # sequences per data-parallel rank and step
    published_tflops: float  # per GPU
    published_mfu: float


LLAMA3_TABLE_4: tuple[Llama3Run, ...] = (
    Llama3Run(8192, 8, 1, 16, 64, 8192, 32, 430, 0.43),
    Llama3Run(16384, 8, 1, 16, 128, 8192, 16, 400, 0.41),
    Llama3Run(16384, 8, 16, 16, 8, 131072, 16, 380, 0.38),
)


# ---- the planner beside Llama 3's published layouts (LLAMA3_TABLE_4) ---------------------------------------------


def llama3_rows() -> list[dict]:
    """Each Llama 3 row: the published degrees, the schedule, micro-batches and checkpointing the planner chooses
    for them (cluster/search.py: choose), its TFLOP/s per GPU beside the published, and the error. Nothing
    here was tuned on these runs: the H100's figures are its data sheet's and MAMF, sigma comes from Table 1."""
    args = PRESETS["llama3-405b"]
    rows = []
    for run in LLAMA3_TABLE_4:
        assert run.gpus == run.tp * run.cp * run.pp * run.dp
        layout = Layout(dims=degrees(tp=run.tp, cp=run.cp, pp=run.pp, dp_shard=run.dp), activation_checkpoint="full")
        tokens = run.dp * run.batch_per_dp * run.seq_len
        e, _ = choose(args, layout, frozenset(), "h100", run.seq_len, tokens)
        rows.append(
            {
                "run": run,
                "planned": e,
                "predicted": e["tflops_per_gpu"],
                "error": e["tflops_per_gpu"] / run.published_tflops - 1,
            }
        )
    return rows


def llama3_markdown(rows: list[dict] | None = None) -> str:
    rows = rows if rows is not None else llama3_rows()
    lines = [
        "| GPUs | tp | cp | pp | dp | seq | batch/dp | published TFLOP/s | planner's choice | memory GB | predicted | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        run, e = r["run"], r["planned"]
        choice = f"{e['schedule']} v={e['stages_per_rank']}, mb={e['sequences_per_microbatch']}, {e['activation_checkpoint']} AC"
        lines.append(
            f"| {run.gpus:,} | {run.tp} | {run.cp} | {run.pp} | {run.dp} | {run.seq_len:,} | {run.batch_per_dp} "
            f"| {run.published_tflops:.0f} | {choice} | {e['memory_gb']:.1f} | {r['predicted']:.0f} | {r['error']:+.1%} |"
        )
    return "\n".join(lines) + "\n"
