"""The run configuration's schema: every section and key a TOML file or a ``--section.key`` flag can set.

Plain dataclasses, one per section, each field with its default, one line for ``python train.py --help`` and its
range rules (``opt``). Nothing here reads a file or checks a value: runtime/config.py loads a config (TOML, then
dotted overrides) and checks every field against these rules, and a parsed config is never changed afterwards
(what a run derives from it, such as the model a transformers folder gives or the steps ``training.epochs``
makes, lives in the plan: planning/plan.py).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Literal

MAX_TIMEOUT_S = 365 * 86400  # a datetime.timedelta, then int64 milliseconds in c10d: a year is plenty


def opt(default, help: str, **rules):
    """A config field: its default, one line for ``--help``, and its range rules (``ge``/``gt``/``le``/``lt``,
    ``int_ok``, ``path`` "required"/"optional", ``step``), besides its type's limits (``type_problem``)."""
    return field(default=default, metadata={"help": help, **rules})


PipelineSchedule = Literal[
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
]


@dataclass
class ModelConfig:
    preset: str = opt("", "a named shape (models/presets.py, e.g. llama3-8b): its [model] keys, under explicit ones")
    dim: int = opt(128, "model width (hidden size)", ge=1)
    n_layers: int = opt(4, "transformer blocks", ge=1)
    n_heads: int = opt(8, "query heads per attention", ge=1)
    n_kv_heads: int = opt(4, "key/value heads (grouped-query attention); divides n_heads", ge=1)
    vocab_size: int = opt(256, "vocabulary size (>= the tokenizer's: 256 for bytes)", ge=1)
    ffn_dim: int = opt(0, "SwiGLU hidden size; 0: Llama's rule, 8/3 * dim rounded up to multiple_of", ge=0)
    multiple_of: int = opt(64, "round the derived ffn_dim up to a multiple of this", ge=1)
    norm_eps: float = opt(1e-5, "RMSNorm epsilon", gt=0)
    rope_theta: float = opt(10000.0, "rotary embedding base", gt=0)
    rope_scaling: Literal["none", "linear", "llama3", "yarn"] = opt(
        "none", "RoPE frequency scaling for longer contexts (models/rope.py); transformers' rope_type"
    )
    rope_factor: float = opt(8.0, "rope_scaling linear/llama3: frequencies divided by this (context x factor)", gt=0)
    rope_low_freq_factor: float = opt(1.0, "rope_scaling llama3: wavelengths > L0 / this are divided by factor", gt=0)
    rope_high_freq_factor: float = opt(4.0, "rope_scaling llama3: wavelengths < L0 / this are kept", gt=0)
    rope_original_max_seq_len: int = opt(8192, "rope_scaling llama3/yarn: L0, the pre-training context length", ge=1)
    rope_beta_fast: float = opt(
        32.0, "rope_scaling yarn: pairs turning more often within L0 keep their frequency", gt=0
    )
    rope_beta_slow: float = opt(1.0, "rope_scaling yarn: pairs turning less often within L0 are interpolated", gt=0)
    rope_mscale: float = opt(0.0, "rope_scaling yarn: attention factor numerator coefficient (0: unused)", ge=0)
    rope_mscale_all_dim: float = opt(0.0, "rope_scaling yarn: its denominator's (DeepSeek: softmax scale too)", ge=0)
    rope_truncate: bool = opt(True, "rope_scaling yarn: round the ramp's ends to whole dimensions")
    # le: the rotary tables are max_seq_len x head_dim floats, twice (4 Mi positions: 4 GiB at head_dim 128)
    max_seq_len: int = opt(2048, "longest sequence the rotary tables cover", ge=1, le=2**22)
    tie_embeddings: bool = opt(False, "one weight for the embedding and the output head (see docs/checkpointing.md)")
    pad_token_id: int = opt(-1, "the padding id (a transformers folder's config.json pad_token_id); -1: none", ge=-1)
    freeze_pad_embedding: bool = opt(
        False,
        "true: as transformers' nn.Embedding(padding_idx), the input lookup gives the pad_token_id row no gradient "
        "(a tied head still trains it); false: every row trains. Not given: true for a checkpoint.init_from folder "
        "with a pad id at parallel.tp 1, else false (docs/checkpointing.md)",
    )
    n_experts: int = opt(0, "routed experts per MoE layer; 0: a dense model (see models/moe.py)", ge=0)
    top_k: int = opt(2, "experts each token is routed to", ge=1)
    moe_every: int = opt(1, "layer i is MoE when (i + 1) % moe_every == 0", ge=1)
    moe_ffn_dim: int = opt(0, "each expert's hidden size; 0: the dense FFN's hidden size / top_k", ge=0)
    moe_shared_experts: int = opt(0, "0 or 1 shared expert that every token also goes through", ge=0, le=1)
    moe_score_func: Literal["softmax", "sigmoid"] = opt("softmax", "router score function")
    moe_route_norm: bool = opt(True, "renormalise each token's top-k gates to sum to 1")
    moe_aux_loss_coef: float = opt(0.0, "Switch-style load-balancing loss coefficient (0: off)", ge=0)
    moe_aux_loss_form: Literal["sequence", "transformers"] = opt(
        "sequence",
        "the aux loss: per sequence and layer (every layout), or transformers' load_balancing_loss_func over the "
        "whole forward, all layers concatenated (one rank, no accumulation); a folder with output_router_logits: "
        "transformers (models/moe.py)",
    )
    moe_bias_update_rate: float = opt(0.0, "aux-loss-free expert-bias step (0: off)", ge=0)
    moe_capacity_factor: float = opt(0.0, "0: dropless; > 0: per-sequence capacity with token dropping", ge=0)
    # Llama-family variants (checkpoint/hf_folder.py sets them from a transformers folder's config.json)
    family: Literal[
        "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"
    ] = opt("llama", "architecture an export writes")
    qkv_bias: bool = opt(False, "biases on the q, k, v projections (Qwen2)")
    qk_norm: bool = opt(False, "RMSNorm over each query and key head before RoPE (Qwen3)")
    head_dim: int = opt(0, "width of one attention head; 0: dim / n_heads", ge=0)
    sliding_window: int = opt(0, "0: none; else the window, which training.seq_len must not exceed", ge=0)
    # MoE families (checkpoint/hf_folder.py sets them from a Mixtral, Qwen-MoE, OLMoE or DeepSeek-V3 folder)
    qk_norm_full: bool = opt(False, "qk_norm over the whole q and k projection, not per head (OLMoE)")
    moe_dense_layers: str = opt("", "comma-separated layer ids that stay dense in an MoE model, e.g. '0,1'")
    moe_shared_ffn_dim: int = opt(0, "the shared expert's hidden size; 0: the dense FFN's", ge=0)
    moe_shared_gate: bool = opt(False, "scale the shared expert's output by sigmoid(a learned linear) (Qwen2-MoE)")
    moe_groups: int = opt(1, "expert groups for group-limited routing (DeepSeek-V3 n_group)", ge=1)
    moe_topk_groups: int = opt(1, "groups a token may route into (DeepSeek-V3 topk_group)", ge=1)
    moe_route_scale: float = opt(1.0, "multiply the routed experts' gates by this (DeepSeek-V3)", gt=0)
    q_lora_rank: int = opt(0, "latent attention: rank of the query's low-rank projection; 0: a full one", ge=0)
    kv_lora_rank: int = opt(0, "latent attention (DeepSeek MLA, models/latent_attention.py); 0: off", ge=0)
    qk_rope_head_dim: int = opt(0, "latent attention: the rotated part of each q/k head", ge=0)
    v_head_dim: int = opt(0, "latent attention: width of a value head", ge=0)
    rope_interleave: bool = opt(False, "latent attention: rotary pairs stored interleaved (DeepSeek-V3)")


@dataclass
class ParallelConfig:
    dp_replicate: int = opt(1, "HSDP replicas (data-parallel copies of the sharded model)", ge=1)
    dp_shard: int = opt(-1, "FSDP shards; -1: whatever is left of the world after the other degrees", ge=-1)
    tp: int = opt(1, "tensor-parallel degree (inside a node)", ge=1)
    pp: int = opt(1, "pipeline-parallel degree", ge=1)
    ep: int = opt(1, "expert-parallel degree, borrowed from dp_shard x cp x tp (MoE models)", ge=1)
    cp: int = opt(1, "context-parallel degree: each sequence split over cp ranks (between dp_shard and tp)", ge=1)
    cp_attention: Literal["allgather", "ring"] = opt(
        "allgather",
        "context-parallel attention: all-gather K/V, or pass K/V around a ring (see mesh/context_parallel.py)",
    )
    pp_schedule: PipelineSchedule = opt("1F1B", "pipeline schedule")
    pp_microbatches: int = opt(0, "pipeline micro-batches per step; 0: one per pipeline stage", ge=0)
    pp_stages_per_rank: int = opt(0, "stages per pp rank; 0: from the schedule (2 for looped and V)", ge=0)
    pp_split: str = opt("params", "layer split: params | flops | memory | layers per stage, e.g. '3,5'", nonempty=True)
    sequence_parallel: bool = opt(True, "with tp > 1, also shard norms and the residual stream by sequence")
    sp_regather: bool = opt(
        False, "SP: keep only the sequence shard of each gathered matmul input, all-gather it again in backward"
    )
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = opt(
        "default", "free gathered FSDP weights after forward (default: all but the last block)"
    )
    collective_timeout_s: int = opt(
        300, "seconds a collective may wait for a peer before the job fails", ge=1, le=MAX_TIMEOUT_S
    )
    # Communication and memory savers (savers/: reduce_once_per_step, powersgd, onebit_adam; FSDP options in training/build.py: bf16 reduction, cpu offload; docs/dp_savers.md, sections 2-4).
    grad_sync: Literal["microbatch", "step"] = opt(
        "microbatch", "reduce gradients after every micro-batch, or once per step (accumulate locally until the last)"
    )
    grad_compression: Literal["none", "bf16", "powersgd", "onebit_adam"] = opt(
        "none",
        "gradient reduction: exact fp32, in bf16 (half the bytes), PowerSGD, or 1-bit Adam (pure data parallel only)",
    )
    powersgd_rank: int = opt(1, "PowerSGD's low-rank approximation rank (grad_compression=powersgd)", ge=1)
    onebit_warmup_steps: int = opt(
        10, "1-bit Adam: exact Adam steps before the variance freezes and the momentum is sent as signs", ge=1
    )
    fsdp_cpu_offload: bool = opt(
        False, "keep sharded parameters, gradients and Adam state in host memory; the optimizer steps there"
    )


@dataclass
class TrainingConfig:
    steps: int = opt(40, "optimizer steps to train (in total, counting resumed ones)", ge=1)
    epochs: float = opt(
        0.0,
        "instead of steps: passes over the training stream (steps = ceil(epochs x its tokens / (global_batch x "
        "seq_len))); 0: use training.steps",
        ge=0,
    )
    seed: int = opt(1234, "seed of the initial weights", ge=0)
    global_batch: int = opt(8, "sequences per optimizer step, whole world", ge=1)
    micro_batch: int = opt(0, "sequences per rank per forward; 0: the whole local batch (no accumulation)", ge=0)
    seq_len: int = opt(128, "tokens per training sequence", ge=1)
    lr: float = opt(3e-3, "peak learning rate (AdamW)", gt=0)
    min_lr_ratio: float = opt(0.1, "the cosine decays to lr * min_lr_ratio", ge=0, le=1)
    warmup_steps: int = opt(5, "linear warmup steps", ge=0)
    weight_decay: float = opt(0.1, "AdamW weight decay (matrices only)", ge=0)
    beta1: float = opt(0.9, "AdamW beta1", ge=0, lt=1)
    beta2: float = opt(0.95, "AdamW beta2", ge=0, lt=1)
    grad_clip: float = opt(1.0, "clip the global gradient norm to this; 0: no clipping (still logged)", ge=0)
    mixed_precision: Literal["auto", "fp32", "bf16"] = opt(
        "auto",
        "bf16: bf16 compute, fp32 master weights and reductions; auto: bf16 on CUDA, fp32 on CPU (runtime/process.py: "
        "choose_precision); fp32 on CUDA runs its matmuls in TF32",
    )
    activation_checkpoint: Literal["none", "full", "selective", "selective_keep_mm"] = opt(
        "none",
        "recompute activations in backward: all of a block (full); all but every second matmul, attention and "
        "collectives (selective: torchtitan's per-op policy); all but every matmul, attention and collectives "
        "(selective_keep_mm); mesh/ac_policies.py",
    )
    compile: bool = opt(False, "torch.compile each transformer block")
    peak_tflops: float = opt(
        0.0, "peak TFLOP/s of one device for MFU; 0: from the GPU table in training/mfu.py (CPU: no MFU)", ge=0
    )
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "auto: this rank's GPU when CUDA is available")


@dataclass
class DataConfig:
    source: str = opt(
        "default", "'default' (the stdlib's sources), a text file or folder, or a data.prepare folder", path="required"
    )
    max_bytes: int = opt(16 * 1024 * 1024, "raw text sources: read at most this many bytes (prepared: no limit)", ge=1)
    tokenizer: str = opt("bytes", "bytes | path to a Hugging Face tokenizer.json (or its folder)", path="required")
    eos_token: str = opt("", "end-of-document token; '': the tokenizer's own")
    val_source: str = opt(
        "", "held-out data (same kinds as source); '': none, or the last val_fraction of source", path="optional"
    )
    val_fraction: float = opt(0.0, "with no val_source: hold out this last fraction of the source's tokens", ge=0, lt=1)
    allow_stream_change: bool = opt(
        False,
        "resume into a prepared stream whose content digest differs from the checkpoint's: its tokens_consumed "
        "is then reinterpreted as a position in the new stream",
    )
    document_mask: Literal["auto", "on", "off"] = opt(
        "auto",
        "attention within each document of a packed window, positions restarting per document (needs a "
        "data.prepare folder); auto: on for chat data, off for text",
    )
    allow_empty_steps: bool = opt(
        False,
        "masked (chat) data: run a step whose global batch has no trained token (loss 0, no gradient) instead of "
        "stopping with exit 2",
    )


@dataclass
class EvalConfig:
    interval: int = opt(0, "validation loss every N steps and at the last step; 0: never", ge=0)
    steps: int = opt(4, "global batches of the validation split per evaluation (always the same ones)", ge=1)


@dataclass
class RunConfig:
    dir: str = opt("runs/default", "output folder: metrics.jsonl, tb/, checkpoints/", path="required")
    log_every: int = opt(1, "log every N steps (and the last)", ge=1)
    # 5: the agreement is an all-gather over the whole world on the CPU control plane (its latency grows with
    # the world size) and the step that holds it also reads the divergence flag from the device; every 5th
    # step makes both a fifth of a per-step cost, while a SIGTERM still stops within 5 steps: ~15 s at the 8B
    # anchor's ~3 s steps, inside SLURM's default 30 s between SIGTERM and SIGKILL. Log steps agree as well.
    agree_every: int = opt(
        5,
        "agree whether to stop (a SIGTERM) and read the divergence flag every N steps and on log steps; a SIGTERM "
        "stops within N steps",
        ge=1,
    )
    tensorboard: bool = opt(True, "write TensorBoard events to <run.dir>/tb")
    overwrite: bool = opt(False, "allow replacing the metrics of an earlier run in the same run.dir")
    pp_timeline: bool = opt(False, "pipeline runs: time F/B/W per rank on the last step, write bubble + SVG")
    memory_check: bool = opt(
        True, "refuse a layout whose memory estimate per rank exceeds the GPU's (CPU: the host's free) memory by 1.5x"
    )


@dataclass
class ProfileConfig:
    enabled: bool = opt(False, "trace steps start_step.. with torch.profiler: <run.dir>/profile/rank<R>.pt.trace.json")
    start_step: int = opt(3, "first profiled step (the steps before it warm up caches and allocators)", ge=1)
    steps: int = opt(2, "how many steps to profile", ge=1)
    memory_snapshot: bool = opt(False, "also record memory: CUDA allocator snapshot, or the CPU memory timeline")


@dataclass
class DebugConfig:
    check_replicas: int = opt(
        100, "every N steps compare checksums of replicated parameters across their replicas (0: never)", ge=0
    )
    check_replicas_action: Literal["stop", "warn"] = opt(
        "stop", "on a replica mismatch: stop the run (exit 4) or print the warning line and go on"
    )


@dataclass
class CheckpointConfig:
    folder: str = opt("", "checkpoint folder; '': <run.dir>/checkpoints (holds step-N/ folders)", path="optional")
    interval: int = opt(0, "save every N steps and at the last step; 0: never save", ge=0)
    resume: str = opt("none", "auto (the newest complete checkpoint) | none | a step number", int_ok=True, step=True)
    async_: bool = opt(False, "save in a background thread while training goes on (key: checkpoint.async)")
    keep_last: int = opt(3, "published checkpoints to keep, newest first; 0: keep all", ge=0)
    init_from: str = opt(
        "",
        "initial weights: a transformers Llama folder (its config.json sets [model]) or a .safetensors file",
        path="optional",
    )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    # The keys the TOML file or the command line set (load_config), as opposed to defaults: a model folder's
    # config.json may fill in the others (checkpoint/hf_folder.py), but never overrule these silently.
    explicit_keys: typing.ClassVar[frozenset[str]] = frozenset()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Keys whose field name differs from the user-facing name (a Python keyword cannot be a field name).
KEY_ALIASES = {"checkpoint.async": "checkpoint.async_"}
FIELD_KEYS = {field_name: key for key, field_name in KEY_ALIASES.items()}
