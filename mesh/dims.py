"""ParallelDims: the parallel degrees, validated, and the one DeviceMesh built from them.

1. ``ParallelDims.resolve`` turns the config's degrees into numbers (dp_shard = -1 takes the rest of the
   world).
2. ``validate_layout`` checks every rule that a layout must satisfy against the world size, the model and
   the batch. It needs no process group, so every rank raises the same ConfigError, listing every broken
   rule with its field, value and fix, before any collective could hang.
3. ``build_mesh`` creates one DeviceMesh with named dims ``(pp, dp_replicate, dp_shard, tp)``. Size-1
   dims are kept so that every rank has the same four coordinates. Every other mesh is a named view of it:

   - ``dp``:   dp_replicate x dp_shard flattened; the loader's data-parallel rank and size, and the group
               over which the MoE expert load is summed.
   - ``fsdp``: the dims FSDP2 shards over: (dp_replicate, dp_shard) for HSDP, else (dp_shard,).
   - ``tp``, ``pp``: their own dims.
   - ``loss``: pp x dp_replicate x dp_shard flattened, where the logged loss sum is reduced (only the last
               pipeline stage holds a non-zero part).
   - ``ep``, ``expert_fsdp``: with expert parallelism, views of a second mesh over the same ranks that
               splits dp_shard into (efsdp, ep) (mesh/expert_parallel.build_expert_mesh).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from config import Config, ConfigError
from mesh.expert_parallel import build_expert_mesh
from mesh.pipeline import default_microbatches, pipeline_errors, stages_per_rank
from models.llama import ModelArgs

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    ep: int
    world_size: int

    @classmethod
    def resolve(cls, cfg: Config, world_size: int) -> ParallelDims:
        """Degrees from ``cfg.parallel``; dp_shard = -1 becomes world / (dp_replicate * tp * pp)."""
        p = cfg.parallel
        errors = [
            f"parallel.{name}={value} must be >= 1 (or -1 for dp_shard)."
            for name, value in (("dp_replicate", p.dp_replicate), ("tp", p.tp), ("pp", p.pp), ("ep", p.ep))
            if value < 1
        ]
        if p.dp_shard == 0 or p.dp_shard < -1:
            errors.append(f"parallel.dp_shard={p.dp_shard} must be >= 1, or -1 for 'the rest of the world'.")
        if errors:
            raise ConfigError("invalid parallel layout:\n  - " + "\n  - ".join(errors))
        dp_shard = p.dp_shard
        if dp_shard == -1:
            others = p.dp_replicate * p.tp * p.pp
            if world_size % others:
                raise ConfigError(
                    f"parallel.dp_shard=-1 cannot fill the world: WORLD_SIZE={world_size} is not divisible by "
                    f"dp_replicate*tp*pp={others}; choose degrees whose product divides {world_size}."
                )
            dp_shard = world_size // others
        return cls(p.dp_replicate, dp_shard, p.tp, p.pp, p.ep, world_size)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ranks see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_dims(self) -> tuple[str, ...]:
        return ("dp_replicate", "dp_shard") if self.dp_replicate > 1 else ("dp_shard",)

    def describe(self) -> str:
        return f"pp={self.pp} dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} tp={self.tp} ep={self.ep}"


def validate_layout(dims: ParallelDims, cfg: Config, model: ModelArgs) -> None:
    """Raise one ConfigError listing every rule the layout breaks (identical on every rank)."""
    errors: list[str] = []
    t = cfg.training
    product = dims.pp * dims.dp_replicate * dims.dp_shard * dims.tp
    if product != dims.world_size:
        errors.append(
            f"pp*dp_replicate*dp_shard*tp = {dims.pp}*{dims.dp_replicate}*{dims.dp_shard}*{dims.tp} = {product} "
            f"but WORLD_SIZE={dims.world_size}; make the product equal the number of processes "
            f"(or set parallel.dp_shard=-1 to take the rest)."
        )

    # The model must split evenly across tensor-parallel ranks.
    if model.dim % model.n_heads:
        errors.append(f"model.dim={model.dim} is not divisible by model.n_heads={model.n_heads}; pick a multiple.")
    if model.n_heads % model.n_kv_heads:
        errors.append(
            f"model.n_heads={model.n_heads} is not divisible by model.n_kv_heads={model.n_kv_heads}; "
            "each key/value head must serve a whole number of query heads."
        )
    for field, value in (
        ("model.n_heads", model.n_heads),
        ("model.n_kv_heads", model.n_kv_heads),
        ("the FFN hidden size (model.ffn_dim)", model.hidden_dim),
        ("model.vocab_size", model.vocab_size),
    ):
        if value % dims.tp:
            errors.append(f"parallel.tp={dims.tp} does not divide {field}={value}; choose a tp that divides it.")
    if dims.tp > 1 and cfg.parallel.sequence_parallel and cfg.training.seq_len % dims.tp:
        errors.append(
            f"training.seq_len={cfg.training.seq_len} is not divisible by parallel.tp={dims.tp}, which sequence "
            "parallelism needs; change seq_len or set parallel.sequence_parallel=false."
        )

    # Pipeline and expert degrees against the model.
    if dims.pp > 1:
        p = cfg.parallel
        n_local = stages_per_rank(p.pp_schedule, p.pp_stages_per_rank)
        # The per-rank batch is unknown while global_batch % dp is broken (reported below); check the rest.
        local_batch = None if t.global_batch % dims.dp else (t.micro_batch or t.global_batch // dims.dp)
        errors += pipeline_errors(
            dims.pp, p.pp_schedule, n_local, pipeline_microbatches(cfg, dims),
            local_batch, p.pp_split, model.n_layers, compiled=t.compile,
        )  # fmt: skip
    m = cfg.model
    if m.n_experts and not 1 <= m.top_k <= m.n_experts:
        errors.append(f"model.top_k={m.top_k} must be between 1 and model.n_experts={m.n_experts}.")
    if m.moe_every < 1:
        errors.append(f"model.moe_every={m.moe_every} must be >= 1 (1: every layer is MoE).")
    if dims.ep > 1:
        if cfg.model.n_experts == 0:
            errors.append(f"parallel.ep={dims.ep} needs an MoE model; set model.n_experts or parallel.ep=1.")
        elif cfg.model.n_experts % dims.ep:
            errors.append(
                f"parallel.ep={dims.ep} does not divide model.n_experts={cfg.model.n_experts}; each ep rank must own "
                "the same number of experts: choose an ep that divides n_experts."
            )
        if dims.dp_shard % dims.ep:
            errors.append(
                f"parallel.ep={dims.ep} must divide parallel.dp_shard={dims.dp_shard}: expert-parallel ranks are "
                "carved from the data-parallel shard ranks."
            )

    # The batch must split evenly: global = micro x dp x accumulation.
    if t.global_batch % dims.dp:
        errors.append(
            f"training.global_batch={t.global_batch} is not divisible by the data-parallel degree "
            f"dp_replicate*dp_shard={dims.dp}; use a multiple of {dims.dp}."
        )
    else:
        local = t.global_batch // dims.dp
        if t.micro_batch < 0 or (t.micro_batch and local % t.micro_batch):
            errors.append(
                f"training.micro_batch={t.micro_batch} does not divide the per-rank batch {local} "
                f"(global_batch {t.global_batch} / dp {dims.dp}); use a divisor of {local} or 0 for all of it."
            )
    if t.seq_len > model.max_seq_len:
        errors.append(f"training.seq_len={t.seq_len} exceeds model.max_seq_len={model.max_seq_len}.")
    if errors:
        raise ConfigError(f"the parallel layout ({dims.describe()}) does not fit:\n  - " + "\n  - ".join(errors))


def pipeline_microbatches(cfg: Config, dims: ParallelDims) -> int:
    """``parallel.pp_microbatches``, or one per pipeline stage when it is 0."""
    p = cfg.parallel
    return p.pp_microbatches or default_microbatches(dims.pp * stages_per_rank(p.pp_schedule, p.pp_stages_per_rank))


def flatten(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """A 1-D view over ``dims`` of ``mesh``, registered on the root mesh under ``name``.

    ``DeviceMesh._flatten`` is still private in torch 2.13; this is the one place that calls it.
    """
    return mesh[dims]._flatten(name)


@dataclass(frozen=True)
class Meshes:
    """The world mesh and the named views of it that the rest of meshloom uses."""

    world: DeviceMesh
    dp: DeviceMesh  # flattened (dp_replicate, dp_shard): loader rank/size, loss reduction
    fsdp: DeviceMesh  # what FSDP2 shards over: (dp_replicate, dp_shard) for HSDP, else (dp_shard,)
    tp: DeviceMesh
    pp: DeviceMesh
    loss: DeviceMesh  # flattened (pp, dp_replicate, dp_shard): where the logged loss sum is reduced
    ep: DeviceMesh | None = None  # MoE with ep > 1: the expert-parallel ranks (carved from dp_shard)
    expert_fsdp: DeviceMesh | None = None  # ... and what FSDP shards expert weights over: (dp_replicate, efsdp)


def build_mesh(dims: ParallelDims, device_type: str, has_experts: bool = False) -> Meshes:
    """The world mesh with named dims (pp, dp_replicate, dp_shard, tp), and its named views.

    With expert parallelism a second mesh over the same ranks splits dp_shard into (efsdp, ep), keeping the
    rank order (mesh/expert_parallel.build_expert_mesh); its ep and efsdp views are added here.
    """
    world = init_device_mesh(
        device_type, (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp), mesh_dim_names=MESH_DIMS
    )
    ep = expert_fsdp = None
    if has_experts and dims.ep > 1:
        ep, expert_fsdp = build_expert_mesh(device_type, dims.pp, dims.dp_replicate, dims.dp_shard, dims.ep, dims.tp)
    return Meshes(
        world=world,
        dp=flatten(world, ("dp_replicate", "dp_shard"), "dp"),
        fsdp=world[dims.fsdp_dims],
        tp=world["tp"],
        pp=world["pp"],
        loss=flatten(world, ("pp", "dp_replicate", "dp_shard"), "pp_dp"),
        ep=ep,
        expert_fsdp=expert_fsdp,
    )


def mesh_banner(mesh: DeviceMesh) -> str:
    """One line per mesh dim: its size and this rank's coordinate."""
    coords = mesh.get_coordinate()
    return "\n".join(
        f"  {name:<13} size {mesh.size(i):>3}   this rank at {coords[i]}" for i, name in enumerate(MESH_DIMS)
    )
