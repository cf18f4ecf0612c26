"""Count the gradient reductions a rank issues, and their bytes, by wrapping torch.distributed's collectives.

    with GradientTraffic() as traffic:
        ...                      # train, or run forward/backward
    traffic.calls, traffic.payload_bytes, traffic.wire_bytes

Every gradient reduction in meshloom is one of two kinds, and nothing else in meshloom uses these calls on
these groups:

- ``shard``: a reduce-scatter (FSDP2's ``dist.reduce_scatter_single``, ``reduce_scatter_tensor`` before 2.13), inside the group FSDP
  shards over. meshloom reduce-scatters nothing but gradients.
- ``replicate``: an all-reduce (``dist.all_reduce``) on the ``dp_replicate`` mesh dim's group (DeviceMesh
  describes it ``mesh_dp_replicate``): HSDP's all-reduce across replicas, DDP's PowerSGD hook.

All-reduces on other groups (the loss sum on the flattened loss mesh, the control plane) are not gradient
traffic and are left out; the gradient norm uses functional collectives, which these wrappers do not see.

- ``calls``: (``all_reduce`` or ``reduce_scatter``, kind) -> number of calls;
- ``payload_bytes``: the size of the tensors handed to the collectives (a reduce-scatter's full input);
- ``wire_bytes``: what a ring algorithm sends per rank for them: 2(n-1)/n x payload for an all-reduce,
  (n-1)/n x payload for a reduce-scatter (docs/00_foundations.md, section 2).
"""

from __future__ import annotations

from collections import Counter

import torch.distributed as dist

from mesh.private_api import REDUCE_SCATTER

REPLICATE_GROUP = "mesh_dp_replicate"
# label -> (function, keyword and position of the tensor whose size counts). The reduce-scatter is wrapped
# under the one name the installed torch has (mesh/private_api.py: REDUCE_SCATTER), so that an old name that
# forwards to the new one is not counted twice.
WRAPPED = {"all_reduce": ("all_reduce", "tensor", 0), "reduce_scatter": (REDUCE_SCATTER, "input", 1)}


def gradient_kind(name: str, group) -> str | None:
    """``shard`` or ``replicate`` for a gradient reduction (see the module docstring), else None."""
    if name.startswith("reduce_scatter"):
        return "shard"
    if group is not None and getattr(group, "group_desc", "") == REPLICATE_GROUP:
        return "replicate"
    return None


class GradientTraffic:
    def __init__(self):
        self.calls: Counter = Counter()  # (function, kind) -> calls
        self.payload_bytes = 0
        self.wire_bytes = 0.0
        self._originals: dict = {}

    def _wrap(self, name: str, function: str, keyword: str, position: int):
        original = self._originals[function]

        def counted(*args, **kwargs):
            group = kwargs.get("group")
            kind = gradient_kind(name, group)
            if kind is not None:
                tensor = args[position] if len(args) > position else kwargs[keyword]
                payload = tensor.numel() * tensor.element_size()
                n = dist.get_world_size(group)
                self.calls[(name, kind)] += 1
                self.payload_bytes += payload
                self.wire_bytes += (2 if name == "all_reduce" else 1) * (n - 1) / n * payload
            return original(*args, **kwargs)

        return counted

    def __enter__(self) -> GradientTraffic:
        for name, (function, keyword, position) in WRAPPED.items():
            self._originals[function] = getattr(dist, function)
            setattr(dist, function, self._wrap(name, function, keyword, position))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def count(self, name: str, kind: str) -> int:
        """Calls of ``name`` (``all_reduce`` or ``reduce_scatter``) of ``kind`` (``shard`` or ``replicate``)."""
        return self.calls[(name, kind)]
