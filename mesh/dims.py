"""ParallelDims: the parallel degrees, and the one DeviceMesh built from them.

1. ``ParallelDims.resolve`` turns the config's degrees into numbers (dp_shard = -1 takes the rest of the
   world). The rules a layout must satisfy against the world, the model and the batch live in
   planning/layout_rules.py.
2. ``build_mesh`` creates one DeviceMesh with named dims ``(pp, dp_replicate, dp_shard, cp, tp)``. Size-1
   dims are kept so that every rank has the same five coordinates. Every other mesh is a view of that one
   root, so no communicator is created twice:

   - ``dp``:   dp_replicate x dp_shard flattened; the loader's data-parallel rank and size. The cp ranks of
               one dp rank read the same sequences (each keeps its chunks of them), so cp is not in it.
   - ``fsdp``: the dims FSDP2 shards over: (dp_replicate, dp_shard) for HSDP, else (dp_shard,). With cp > 1,
               dp_shard x cp flattened takes dp_shard's place: parameters are replicated over cp like over
               dp, so FSDP shards them over both and reduces their gradients over both.
   - ``tp``, ``pp``, ``cp``: their own dims.
   - ``loss``: pp x dp_replicate x dp_shard x cp flattened, where the logged loss sum and the MoE expert load
               are reduced (only the last pipeline stage holds a non-zero loss; each cp rank holds the sum
               over its own tokens; tp ranks hold copies of the loss, but split the tokens of each MoE
               layer, so mesh/expert_parallel.step_expert_load sums the load over tp as well).
   - ``ep``, ``expert_fsdp``: with expert parallelism the ep ranks are borrowed from dp_shard x cp x tp. The
               world is flattened and *unflattened* again, within the same root, into (pp, dp_replicate, efsdp,
               ep): ep takes the innermost ranks of (dp_shard, cp, tp) (tp first, then cp, then dp_shard), efsdp
               = dp_shard * cp * tp / ep the rest. Expert weights are sharded over ep, FSDP-sharded over
               (dp_replicate, efsdp), and held by no other rank: never replicated over cp or tp.

   For pp 1, dp_shard 2, tp 2 (ranks 0-3; rank = 2 * dp_shard coordinate + tp coordinate):

       dense weights               experts, ep 4                experts, ep 2
                dp_shard -->                  ep -->                      ep -->
       tp  | rank 0  rank 2        rank 0  1  2  3             efsdp | rank 0: E0-1/2  rank 1: E2-3/2
           v rank 1  rank 3        owns  E0 E1 E2 E3                 v rank 2: E0-1/2  rank 3: E2-3/2

   Dense weights: FSDP over dp_shard, TP over tp. ep 4: rank r holds expert r whole. ep 2: the ep groups are
   the tp pairs {0, 1} and {2, 3}; ranks 0 and 2 (an efsdp group) each hold half (FSDP) of experts 0-1.

   cp sits between dp_shard and tp: tp innermost keeps a tp group on consecutive ranks (inside a node),
   and cp next to it keeps the K/V exchange, which runs in every attention layer, as close as tp allows.

Every sub-group gets the configured collective timeout (``mesh_backend_options``); without it DeviceMesh's
groups would wait 30 minutes for a dead peer on gloo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mesh.private_api import backend_options, concatenate_meshes, flatten_mesh, unflatten_mesh
from runtime.process import device_backend

if TYPE_CHECKING:
    import torch

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The degrees, in the mesh's own order (``MESH_DIMS``), then ep (borrowed from dp_shard x cp x tp) and the
    world."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    world_size: int

    @classmethod
    def resolve(
        cls, world_size: int, *, pp: int, dp_replicate: int, dp_shard: int, cp: int, tp: int, ep: int
    ) -> ParallelDims:
        """The degrees as configured (``parallel.*``, each in its range already); dp_shard = -1 becomes
        world / (dp_replicate * cp * tp * pp)."""
        if dp_shard == -1:  # whether it divides evenly is a layout rule (planning/layout_rules.py: world_errors)
            dp_shard = max(1, world_size // (dp_replicate * cp * tp * pp))
        return cls(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep, world_size=world_size)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ranks see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_dims(self) -> tuple[str, ...]:
        """The dims FSDP2 shards over (with cp > 1, dp_shard stands for the flattened dp_shard x cp)."""
        return ("dp_replicate", "dp_shard") if self.dp_replicate > 1 else ("dp_shard",)

    def pp_rank_of(self, rank: int) -> int:
        """The pp coordinate of global ``rank``: pp is the outermost mesh dim (row-major rank order)."""
        return rank // (self.world_size // self.pp)

    def describe(self) -> str:
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        return f"pp={self.pp} dp_replicate={self.dp_replicate} dp_shard={self.dp_shard}{cp} tp={self.tp} ep={self.ep}"


@dataclass(frozen=True)
class Meshes:
    """The world mesh and the named views of it that the rest of meshloom uses (all share one root)."""

    world: DeviceMesh
    dp: DeviceMesh  # flattened (dp_replicate, dp_shard): loader rank/size
    fsdp: DeviceMesh  # what FSDP2 shards over: (dp_replicate, dp_shard[_cp]) for HSDP, else (dp_shard[_cp],)
    tp: DeviceMesh
    pp: DeviceMesh
    cp: DeviceMesh  # the ranks that split this rank's sequences (context parallelism; size 1 without it)
    loss: DeviceMesh  # flattened (pp, dp_replicate, dp_shard, cp): loss sum and MoE load
    ep: DeviceMesh | None = None  # MoE with ep > 1: the expert-parallel ranks (from dp_shard x cp x tp)
    expert_fsdp: DeviceMesh | None = None  # ... and what FSDP shards expert weights over: (dp_replicate, efsdp)
    # Whether every tp rank holds the same experts (each computing their gradient from its own tokens, so the
    # gradients are summed over tp): without ep (and in measure/ep_placement.py's earlier layout, ep from dp_shard).
    experts_replicated_over_tp: bool = True
    # An MoE model under FSDP with tp > 1: what FSDP shards an MoE block's router and shared expert over,
    # (dp_replicate,) dp_shard x cp x tp. Under TP's token split the tp ranks see different tokens, like data
    # ranks, so those weights are sharded over them too instead of held whole by every tp rank.
    token_split: DeviceMesh | None = None

    def all(self) -> dict[str, DeviceMesh]:
        return {name: mesh for name, mesh in vars(self).items() if isinstance(mesh, DeviceMesh)}


def mesh_backend_options(device: torch.device, timeout_s: float, host_tensors: bool = False):
    """``(backend, options)`` for DeviceMesh's ``backend_override``: the device plane's backend and our timeout.
    ``host_tensors`` (FSDP CPU offload) adds gloo for CPU tensors on a GPU: ``cuda:nccl,cpu:gloo``."""
    backend = device_backend(device)
    if backend == "nccl" and host_tensors:
        backend = "cuda:nccl,cpu:gloo"
    return backend_options(backend, timeout_s) if backend in ("gloo", "nccl", "cuda:nccl,cpu:gloo") else backend


def build_mesh(
    dims: ParallelDims,
    device: torch.device,
    timeout_s: float,
    has_experts: bool = False,
    host_tensors: bool = False,
    fsdp_with_tp: bool = False,
) -> Meshes:
    """The world mesh with named dims (pp, dp_replicate, dp_shard, cp, tp) and its named views (one root).
    ``fsdp_with_tp`` adds the flattened (dp_shard, cp, tp) group."""
    options = mesh_backend_options(device, timeout_s, host_tensors)
    world = init_device_mesh(
        device.type,
        (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp),
        mesh_dim_names=MESH_DIMS,
        backend_override=dict.fromkeys(MESH_DIMS, options),
    )
    fsdp = world[dims.fsdp_dims] if dims.cp == 1 else _fsdp_with_cp(world, dims, options)
    token_split = None
    if fsdp_with_tp:
        # A weight sharded by FSDP and by TP has its gradient norm partial over both dims. DTensor reduces
        # that with one all-reduce only if a flattened mesh over exactly those dims exists on the root; without
        # one it issues an all-reduce per dim and warns on every rank (mesh/grad_clip.py).
        shard_tp = flatten_mesh(world, ("dp_shard", "cp", "tp"), "dp_shard_cp_tp", options)
        if has_experts and dims.tp > 1:
            token_split = concatenate_meshes([world["dp_replicate"], shard_tp]) if dims.dp_replicate > 1 else shard_tp
    ep = expert_fsdp = None
    if has_experts and dims.ep > 1:
        ep, expert_fsdp = _expert_meshes(world, dims, options)
    return Meshes(
        world=world,
        dp=flatten_mesh(world, ("dp_replicate", "dp_shard"), "dp", options),
        fsdp=fsdp,
        tp=world["tp"],
        pp=world["pp"],
        cp=world["cp"],
        loss=flatten_mesh(world, MESH_DIMS[:-1], "pp_dp_cp", options),  # every dim but tp (the last)
        ep=ep,
        expert_fsdp=expert_fsdp,
        experts_replicated_over_tp=ep is None,
        token_split=token_split,
    )


def _expert_meshes(world: DeviceMesh, dims: ParallelDims, options) -> tuple[DeviceMesh, DeviceMesh]:
    """The ep mesh and the experts' FSDP mesh: the world regrouped as (pp, dp_replicate, efsdp, ep), views of the one
    root, so each expert's gradient is summed over every rank its tokens came from, and over none twice."""
    efsdp = dims.dp_shard * dims.cp * dims.tp // dims.ep
    flat = flatten_mesh(world, MESH_DIMS, "world_flat", options)
    experts = unflatten_mesh(
        flat,
        "world_flat",
        (dims.pp, dims.dp_replicate, efsdp, dims.ep),
        ("experts_pp", "experts_dp_replicate", "efsdp", "ep"),
        options,
    )
    fsdp = experts[("experts_dp_replicate", "efsdp") if dims.dp_replicate > 1 else ("efsdp",)]
    return experts["ep"], fsdp


def _fsdp_with_cp(world: DeviceMesh, dims: ParallelDims, options) -> DeviceMesh:
    """FSDP's mesh when cp > 1: dp_shard x cp flattened (after dp_replicate), since cp ranks replicate parameters."""
    shard = flatten_mesh(world, ("dp_shard", "cp"), "dp_shard_cp", options)
    return concatenate_meshes([world["dp_replicate"], shard]) if dims.dp_replicate > 1 else shard


def mesh_banner(mesh: DeviceMesh) -> str:
    """One line per mesh dim: its size and this rank's coordinate."""
    coords = mesh.get_coordinate()
    return "\n".join(
        f"  {name:<13} size {mesh.size(i):>3}   this rank at {coords[i]}" for i, name in enumerate(MESH_DIMS)
    )
