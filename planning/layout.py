"""The layout: the parallel degrees and how one training step runs on them, in one frozen value.

A layout is everything besides the model and the data that decides what a rank holds and does: the degrees
(mesh/dims.py: ``ParallelDims``), the pipeline's schedule and split, the micro-batch, activation checkpointing,
the precision, sequence and context parallelism's options, FSDP's options, the gradient savers and compile.
Every reader takes this one type: the layout rules (planning/layout_rules.py), the memory estimate
(planning/memory_estimate.py), the pipeline split, the dry run, the simulation, the cluster planner
(cluster/search.py) and the typed options mesh/ receives (planning/build.py: ``parallel_options``).

1. ``Layout.from_config`` reads the config once (``CONFIG_KEYS`` names the key behind each field) and never
   writes back to it. Three values are decided, not copied: ``dp_shard = -1`` becomes the rest of the world,
   ``mixed_precision = auto`` becomes bf16 or fp32 for the device kind the run targets, and ``fsdp`` says whether
   FSDP2 wraps the model (``uses_fsdp``).
2. ``config_overrides`` is the reverse: the ``--section.key value`` pairs that make a run take a layout (the
   cluster planner prints them as a command). Both directions walk the same table, so a field added here is
   read and written in the same place.

A layout may also be written degree by degree (``Layout(tp=2, seq_len=8192)``), as the estimate's tests and the
planner do; ``dataclasses.replace(layout, dp_shard=8)`` changes one degree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING

from mesh.dims import ParallelDims

if TYPE_CHECKING:
    from models.llama import ModelArgs
    from runtime.schema import Config

DEGREES = ("tp", "pp", "dp_replicate", "dp_shard", "cp", "ep")
COMPUTE_BYTES = {"bf16": 2, "fp32": 4}


def degrees(
    *, tp: int = 1, pp: int = 1, dp_replicate: int = 1, dp_shard: int = 1, cp: int = 1, ep: int = 1
) -> ParallelDims:
    """The ``ParallelDims`` of a layout given degree by degree: the world is their product (ep is borrowed from
    dp_shard x cp x tp, so it does not multiply)."""
    world = tp * pp * dp_replicate * dp_shard * cp
    return ParallelDims(tp=tp, pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, ep=ep, world_size=world)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The degrees and how a step runs on them (module docstring). Defaults are the planner's: FSDP in bf16."""

    dims: ParallelDims = field(default_factory=degrees)
    seq_len: int = 2048
    sequences_per_microbatch: int = 1  # one pipeline micro-batch (or one forward call without pipelining)
    pp_schedule: str = "1F1B"
    pp_microbatches: int = 1  # micro-batches the schedule cuts each forward call into (1 without pipelining)
    stages_per_rank: int = 1
    pp_split: str = "params"  # params | flops | memory | layer counts per stage
    stage_layers: tuple[tuple[int, ...], ...] = ()  # the layer ids of every stage; () = as even as possible
    activation_checkpoint: str = "none"  # none | full | selective | selective_keep_mm
    mixed_precision: str = "bf16"  # bf16 | fp32, resolved (never auto)
    sequence_parallel: bool = True
    sp_regather: bool = False
    cp_attention: str = "allgather"  # allgather | ring
    fsdp: bool = True  # FSDP2 wraps the model (``uses_fsdp``)
    fsdp_reshard_after_forward: str = "default"
    fsdp_cpu_offload: bool = False
    grad_sync: str = "microbatch"  # microbatch | step
    grad_compression: str = "none"  # none | bf16 | powersgd | onebit_adam
    powersgd_rank: int = 1
    compile: bool = False
    tp: InitVar[int | None] = None  # the shorthand: degrees one by one (module docstring)
    pp: InitVar[int | None] = None
    dp_replicate: InitVar[int | None] = None
    dp_shard: InitVar[int | None] = None
    cp: InitVar[int | None] = None
    ep: InitVar[int | None] = None

    def __post_init__(self, *given: int | None) -> None:
        # dataclasses.replace hands every degree back (read through ``dims``): only a changed one rebuilds ``dims``,
        # whose world is then the product of the degrees
        changes = {k: v for k, v in zip(DEGREES, given, strict=True) if v is not None and v != getattr(self.dims, k)}
        if changes:
            merged = {k: getattr(self.dims, k) for k in DEGREES} | changes
            object.__setattr__(self, "dims", degrees(**merged))

    @classmethod
    def from_config(cls, cfg: Config, world_size: int, model: ModelArgs, device_type: str, micro_batch: int) -> Layout:
        """Step 1 of the module docstring. ``device_type``: the kind of device the run targets (``auto``
        precision follows it); ``micro_batch``: the sequences of one forward call (planning/layout_rules.py:
        ``batch_split``), which the pipeline cuts into ``pp_microbatches``."""
        from mesh.pipeline import default_microbatches, stages_per_rank
        from runtime.process import choose_precision

        written = {name: read_key(cfg, key) for name, key in CONFIG_KEYS.items() if name not in DEGREES}
        dims = cls.resolve_dims(cfg, world_size)
        # decided, not copied: the schedule's stages and micro-batches (one stage, one micro-batch unpipelined),
        # the precision auto becomes on the target device, and whether FSDP wraps the model
        schedule = written["pp_schedule"] if dims.pp > 1 else "1F1B"
        n_local = stages_per_rank(schedule, written["stages_per_rank"]) if dims.pp > 1 else 1
        microbatches = (written["pp_microbatches"] or default_microbatches(dims.pp * n_local)) if dims.pp > 1 else 1
        decided = {
            "pp_schedule": schedule,
            "stages_per_rank": n_local,
            "pp_microbatches": microbatches,
            "sequences_per_microbatch": micro_batch // microbatches,
            "mixed_precision": choose_precision(written["mixed_precision"], device_type, written["grad_compression"]),
        }
        layout = cls(dims=dims, **(written | decided))
        return layout.replace(fsdp=uses_fsdp(layout, has_experts=model.moe is not None))

    @staticmethod
    def resolve_dims(cfg: Config, world_size: int) -> ParallelDims:
        """The degrees as configured, ``dp_shard = -1`` taking the rest of the world (mesh/dims.py)."""
        return ParallelDims.resolve(world_size, **{d: read_key(cfg, CONFIG_KEYS[d]) for d in DEGREES})

    def replace(self, **changes) -> Layout:
        return dataclasses.replace(self, **changes)

    # ---- derived values ----
    @property
    def sp(self) -> bool:
        return self.dims.tp > 1 and self.sequence_parallel

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on this rank (context parallelism splits each sequence)."""
        return self.sequences_per_microbatch * self.seq_len // self.dims.cp

    @property
    def dtype_bytes(self) -> int:
        return COMPUTE_BYTES[self.mixed_precision]

    @property
    def n_stages(self) -> int:
        return self.dims.pp * self.stages_per_rank

    @property
    def gpus(self) -> int:
        return self.dims.world_size

    def record(self) -> dict:
        """The layout as plain values, by config name where it has one (the checkpoint's metadata)."""
        return {CONFIG_KEYS[name]: getattr(self, name) for name in CONFIG_KEYS} | {"fsdp": self.fsdp}

    def describe(self) -> str:
        d = self.dims
        extra = f", dp_replicate={d.dp_replicate}" if d.dp_replicate > 1 else ""
        return f"tp={d.tp}, cp={d.cp}, pp={d.pp}, dp_shard={d.dp_shard}, ep={d.ep}{extra}"


# The degrees are read-only views of ``dims`` (``layout.tp``); ``dp`` is dp_replicate x dp_shard as everywhere.
for _name in (*DEGREES, "dp"):
    setattr(Layout, _name, property(lambda self, _n=_name: getattr(self.dims, _n)))
del _name


def uses_fsdp(layout: Layout, has_experts: bool) -> bool:
    """FSDP with data or context parallelism, bf16 or CPU offload (its policies hold them), and an MoE model under TP
    (it shards the router over the tp ranks); not with PowerSGD (DDP) or 1-bit Adam (exchanges momentum itself)."""
    if layout.grad_compression in ("powersgd", "onebit_adam"):  # a replicated model: DDP's, or a plain one
        return False
    d = layout.dims
    moe_tp = has_experts and d.tp > 1
    return d.dp > 1 or d.cp > 1 or layout.mixed_precision == "bf16" or layout.fsdp_cpu_offload or moe_tp


# Layout field -> the config key it is read from (and written to by ``config_overrides``).
CONFIG_KEYS = {
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "dp_replicate": "parallel.dp_replicate",
    "dp_shard": "parallel.dp_shard",
    "cp": "parallel.cp",
    "ep": "parallel.ep",
    "seq_len": "training.seq_len",
    "pp_schedule": "parallel.pp_schedule",
    "pp_microbatches": "parallel.pp_microbatches",
    "stages_per_rank": "parallel.pp_stages_per_rank",
    "pp_split": "parallel.pp_split",
    "activation_checkpoint": "training.activation_checkpoint",
    "mixed_precision": "training.mixed_precision",
    "sequence_parallel": "parallel.sequence_parallel",
    "sp_regather": "parallel.sp_regather",
    "cp_attention": "parallel.cp_attention",
    "fsdp_reshard_after_forward": "parallel.fsdp_reshard_after_forward",
    "fsdp_cpu_offload": "parallel.fsdp_cpu_offload",
    "grad_sync": "parallel.grad_sync",
    "grad_compression": "parallel.grad_compression",
    "powersgd_rank": "parallel.powersgd_rank",
    "compile": "training.compile",
}


def read_key(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def config_overrides(layout: Layout, names=None) -> list[tuple[str, str]]:
    """Step 2 of the module docstring: ``(key, value)`` pairs for ``names`` (default: every field the config
    has), as a command line spells them."""
    out = []
    for name in names or CONFIG_KEYS:
        value = getattr(layout, name)
        out.append((CONFIG_KEYS[name], str(value).lower() if isinstance(value, bool) else str(value)))
    return out
