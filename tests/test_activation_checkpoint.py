"""Selective activation checkpointing repeats exactly the collectives it chose to; MoE routing and counts survive.

Full checkpointing reruns a block's forward inside backward, collectives included: a TP+SP block all-gathers
its sequence again, an EP block repeats its all-to-alls. Selective checkpointing (torchtitan's choices,
mesh/ac_policies.py) keeps the outputs of reduce-scatters and all-to-alls, so its backward issues none of those
again, and recomputes the all-gathers (whole-sequence outputs): a TP+SP block's two. A dispatch-mode counter
counts them; the full-checkpointing row shows that the count does move when a forward collective is repeated, so
the selective assertions can fail.

(CommDebugMode, the public counter, cannot be used here: its module tracker raises a KeyError when a
checkpointed module's forward reruns inside backward. The counter below sees the same ops: the functional
collectives DTensor and meshloom issue, and c10d's in-place ones.)
"""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from launch.spawn import run_on_ranks

SEQ = 16
COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d")
NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")  # waits, and the autograd wrapper of a result


class CollectiveCounter(TorchDispatchMode):
    """Counts every collective op dispatched while active."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            # A DTensor op: let DTensor run it first, so the collectives it issues inside come back here.
            return NotImplemented
        name = func.__name__.split(".")[0]
        if func.namespace in COLLECTIVE_NAMESPACES and name not in NOT_COLLECTIVES:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def block_collectives(kind: str, mode: str, move_bias: bool = False) -> dict:
    """Rank body: collectives of one forward and one backward of a 1-layer model on 2 ranks.

    ``move_bias``: between forward and backward, shift the MoE expert bias hard towards expert 0, so a
    recomputed routing (one that did not keep topk's output) would choose other experts than the forward did.
    """
    import torch.distributed as dist

    from mesh.activation_checkpoint import apply_activation_checkpointing
    from mesh.expert_parallel import apply_expert_parallel
    from mesh.materialize import canonical_name, materialize_weights
    from mesh.tensor_parallel import apply_tensor_parallel
    from models.llama import ModelArgs, Transformer
    from models.moe import MoE, MoEArgs

    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32)
    if kind == "ep":
        args.moe = MoEArgs(n_experts=4, top_k=2, hidden_dim=32)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(kind,))
    with torch.device("meta"):
        model = Transformer(args)
    if kind == "tp":
        apply_tensor_parallel(model, mesh, sequence_parallel=True)
    else:
        apply_expert_parallel(model, mesh)
    apply_activation_checkpointing(model, mode)
    materialize_weights(model, torch.device("cpu"), seed=0)
    # EP ranks are data-parallel: each has its own tokens. TP ranks share theirs.
    seed = 1 + (dist.get_rank() if kind == "ep" else 0)
    tokens = torch.randint(0, 256, (2, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    from mesh.tensor_parallel import loss_context, loss_value

    with loss_context(kind == "tp"):
        with CollectiveCounter() as forward:
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        if move_bias:
            for module in model.modules():
                if isinstance(module, MoE):
                    module.expert_bias[0] += 100.0
        with CollectiveCounter() as backward:
            loss.backward()
    out = {"forward": dict(forward.counts), "backward": dict(backward.counts), "loss": loss_value(loss.detach()).item()}
    # every weight's gradient (this rank's shard under TP): recomputing, wo and w2 included, changes no bit
    out["grads"] = {
        canonical_name(name): (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    if kind == "ep":
        moe = next(m for m in model.modules() if isinstance(m, MoE))
        out["counted"] = int(moe.tokens_per_expert.sum().item())
        out["grad"] = model.layers["0"].feed_forward.router.gate.weight.grad.clone()
    return out


def collectives_by_mode(kind: str) -> dict:
    modes = ("none", "selective", "selective_keep_mm", "full")
    return {mode: run_on_ranks(block_collectives, 2, kind, mode)[0] for mode in modes}


@pytest.fixture(scope="module")
def tp_counts():
    return collectives_by_mode("tp")


@pytest.fixture(scope="module")
def ep_counts():
    return collectives_by_mode("ep")


@pytest.mark.parametrize("kind", ["tp", "ep"])
def test_selective_checkpointing_repeats_no_collective(kind, request):
    by_mode = request.getfixturevalue(f"{kind}_counts")
    none, selective, full = by_mode["none"], by_mode["selective"], by_mode["full"]
    for name in ("selective", "selective_keep_mm"):  # both selective policies (mesh/ac_policies.py)
        assert by_mode[name]["forward"] == none["forward"]
        back, base = by_mode[name]["backward"], none["backward"]
        for op in ("reduce_scatter_tensor", "all_to_all_single"):  # kept: never issued again
            assert back.get(op, 0) == base.get(op, 0), f"{kind}: {name} AC repeated a forward {op}"
        if kind == "tp":  # recomputed: the block's two all-gathers (attention's and the FFN's inputs), as under full
            gathers = back["all_gather_into_tensor"]
            assert gathers == base["all_gather_into_tensor"] + 2 == full["backward"]["all_gather_into_tensor"]
        else:
            assert back == base
    # Full checkpointing does repeat them: the counter sees it, so the assertion above can fail.
    if kind == "tp":  # SP: the block's sequence all-gathers run again when the block is fully recomputed
        assert full["backward"]["all_gather_into_tensor"] > none["backward"].get("all_gather_into_tensor", 0)
    else:  # EP: count exchange + tokens out + outputs back, all again under full recompute
        assert full["backward"]["all_to_all_single"] == none["backward"]["all_to_all_single"] + 3
    # Recomputation changes nothing numerically: the same loss, every gradient bitwise.
    assert selective["loss"] == none["loss"] == full["loss"] == by_mode["selective_keep_mm"]["loss"]
    for mode in (selective, by_mode["selective_keep_mm"], full):
        assert mode["grads"].keys() == none["grads"].keys()
        for name, grad in none["grads"].items():
            torch.testing.assert_close(mode["grads"][name], grad, rtol=0, atol=0, msg=name)


def test_moe_counts_survive_recompute(ep_counts):
    tokens, top_k = 2 * SEQ, 2
    for mode in ("none", "selective", "selective_keep_mm", "full"):
        # each token counted once (top_k assignments), not again when the block is recomputed
        assert ep_counts[mode]["counted"] == tokens * top_k, mode
        torch.testing.assert_close(ep_counts[mode]["grad"], ep_counts["none"]["grad"], rtol=0, atol=0)


def test_selective_checkpointing_keeps_the_forward_routing():
    """The expert bias moves between forward and backward: selective AC, which keeps topk's output, still
    computes the gradients of the forward's routing; full AC reroutes in its recompute, and torch notices
    that the recomputed tensors (other token counts per expert) differ from the forward's."""
    from launch.spawn import RankFailure

    grads = {mode: run_on_ranks(block_collectives, 2, "ep", mode, True)[0]["grad"] for mode in ("none", "selective")}
    torch.testing.assert_close(grads["selective"], grads["none"], rtol=0, atol=0)
    with pytest.raises(RankFailure, match="Recomputed values for the following tensors have different metadata"):
        run_on_ranks(block_collectives, 2, "ep", "full", True)


@pytest.mark.compat
def test_selective_checkpointing_under_fsdp_and_tp_trains_bitwise_like_none(tmp_path):
    """dp_shard 2 x tp 2 without SP: FSDP gathers wo's and w2's weights again (new storage) before the recompute,
    which is when the selective policy recognises them and recomputes their matmuls (all-reduces cached). If it
    took another matmul, or recomputed a collective, the curves would differ or the run would hang."""
    from launch.local_runs import train_on
    from tests.training_runs import assert_same_curve

    layout = {"parallel.tp": 2, "parallel.dp_shard": 2, "parallel.sequence_parallel": False}
    none = train_on(4, layout, tmp_path / "none")
    selective = train_on(4, {**layout, "training.activation_checkpoint": "selective"}, tmp_path / "selective")
    # the same ops on the same inputs in the same order: equal to the last bit
    assert_same_curve(selective, none, rtol=0)


@pytest.mark.parametrize("contexts", ["meshloom", "torch"])
def test_selective_contexts_pass_over_annotations_and_serve_a_split_backward(contexts):
    """mesh/private_api.selective_checkpoint_contexts, one process: the recomputation opens more profiler ranges
    than the forward did (as a nested FSDP unit's hooks do), and the backward is split in two, input gradients
    then weight gradients (as a zero-bubble schedule's is), so the region is recomputed twice. The gradients equal
    those of the region without checkpointing, bitwise; torch's own contexts fail on both counts."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from mesh.private_api import selective_checkpoint_contexts

    gen = torch.Generator().manual_seed(0)
    w1, w2 = (torch.randn(8, 8, generator=gen, requires_grad=True) for _ in range(2))
    x = torch.randn(4, 8, generator=gen, requires_grad=True)
    calls = []

    def region(x):
        calls.append(1)
        for _ in calls:  # one more annotation on every run of the region
            with torch.autograd.profiler.record_function("annotation"):
                pass
        return (torch.relu(x @ w1) @ w2).square().sum()

    def keep_mm(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    make = selective_checkpoint_contexts if contexts == "meshloom" else create_selective_checkpoint_contexts
    plain = region(x)
    expected = torch.autograd.grad(plain, [x, w1, w2])

    def split_backward():
        loss = checkpoint(region, x, use_reentrant=False, context_fn=lambda: make(keep_mm))
        (dx,) = torch.autograd.grad(loss, [x], retain_graph=True)  # the input-gradient pass
        return (dx, *torch.autograd.grad(loss, [w1, w2]))  # the weight-gradient pass: recomputed again

    if contexts == "torch":
        with pytest.raises(RuntimeError, match="not found in storage|backward an extra time"):
            split_backward()
        return
    for got, want in zip(split_backward(), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(calls) == 4  # the plain run, the forward, two recomputations


def test_the_selective_policy_makes_torchtitans_choices():
    """mesh/ac_policies.py, op by op: reduce-scatter and all-to-all outputs kept, all-gather and all-reduce outputs
    recomputed, ``max`` kept, a device-to-host copy kept (a meta tensor plays the accelerator's here), a host copy
    recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    from mesh.activation_checkpoint import _save_policy

    policy, funcol, aten = _save_policy([]), torch.ops._c10d_functional, torch.ops.aten
    x = torch.ones(4)
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(None, funcol.reduce_scatter_tensor.default, x, "sum", 2, "0") == save
    assert policy(None, funcol.all_to_all_single.default, x, [2, 2], [2, 2], "0") == save
    assert policy(None, funcol.all_gather_into_tensor.default, x, 2, "0") == recompute
    assert policy(None, funcol.all_reduce.default, x, "sum", "0") == recompute
    assert policy(None, funcol.wait_tensor.default, x) == recompute
    assert policy(None, aten.max.default, x) == save
    on_device = torch.empty(4, device="meta")
    assert policy(None, aten._to_copy.default, on_device, device=torch.device("cpu")) == save
    assert policy(None, aten._to_copy.default, x, dtype=torch.bfloat16) == recompute
