"""Context parallelism: the balanced split, attention across ranks (both algorithms) equal to one device,
training on every layout equal to one process, and misfits refused before any process group exists.

Layer tests run the attention functions in float64, where the two sides differ only by rounding (~1e-15), so
a tolerance of 1e-12 fails on any real error (a wrong mask offset, a lost block, a gradient not summed is
>= 1e-3). The whole-model test runs the real fp32 model: there the softmax normalisation is computed in
another order (blockwise merge, reduce-scatter of dK/dV), ~1e-7 relative per value.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from launch.local_runs import DEBUG_CONFIG, ROOT, train_on
from launch.spawn import run_on_ranks
from mesh.context_parallel import chunk_ids, load_balanced_positions
from models.llama import ModelArgs
from runtime.config import ConfigError, load_config
from tests.training_runs import CHECK_REPLICAS, assert_same_curve
from train import check_config

# ---- 1. the split ------------------------------------------------------------------------------------------


def split_sequence(x: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` (a full sequence): its two chunks, concatenated."""
    return x.index_select(dim, load_balanced_positions(x.shape[dim], cp_rank, cp).to(x.device))


def test_each_rank_holds_chunk_r_and_its_mirror():
    assert [chunk_ids(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert load_balanced_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert load_balanced_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    for cp in (2, 4):  # every position exactly once, each rank's in increasing order
        held = [load_balanced_positions(32, r, cp) for r in range(cp)]
        assert sorted(torch.cat(held).tolist()) == list(range(32))
        assert all(bool((p[1:] > p[:-1]).all()) for p in held)


def test_the_split_balances_causal_work():
    # Under the causal mask the query at position p attends p + 1 keys: a rank's work is the sum over its queries.
    seq, cp = 64, 4
    balanced = [int((load_balanced_positions(seq, r, cp) + 1).sum()) for r in range(cp)]
    contiguous = [int((torch.arange(r * seq // cp, (r + 1) * seq // cp) + 1).sum()) for r in range(cp)]
    assert len(set(balanced)) == 1 and sum(balanced) == seq * (seq + 1) // 2
    assert balanced == [520] * 4
    assert contiguous == [136, 392, 648, 904]  # a plain split: the last rank would work 6.6x as much as the first


def test_the_loader_keeps_this_ranks_positions_of_the_same_windows():
    from data.loader import GlobalBatchLoader

    tokens = torch.arange(1000)
    common = {"seq_len": 16, "global_batch": 4, "micro_batch": 2, "dp_rank": 1, "dp_size": 2}
    whole = GlobalBatchLoader(tokens, **common).next_batch()
    for r in range(2):
        positions = load_balanced_positions(16, r, 2)
        part = GlobalBatchLoader(tokens, **common, positions=positions).next_batch()
        for (x, y), (xs, ys) in zip(whole, part, strict=True):
            assert torch.equal(xs, split_sequence(x, r, 2)) and torch.equal(ys, split_sequence(y, r, 2))


# ---- 2. attention across ranks -----------------------------------------------------------------------------

TINY = ModelArgs(dim=48, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32)


def attention_parity(cp: int) -> dict:
    """Rank body: both algorithms against single-device attention (float64, GQA), the whole fp32 model's
    gradients, what each algorithm sends, and the largest tensor the ring creates."""
    from torch.distributed.device_mesh import init_device_mesh

    from mesh.context_parallel import allgather_attention, apply_context_parallel, ring_attention
    from models.llama import Transformer, causal_attention
    from tests.test_activation_checkpoint import CollectiveCounter

    rank, group = dist.get_rank(), dist.group.WORLD
    gen = torch.Generator().manual_seed(0)
    b, s, heads, kv_heads, d = 2, 10 * cp, 4, 2, 6  # s / cp = 10 exceeds every other dim (and b * heads)
    q, k, v, weight = (
        torch.randn(b, s, h, d, generator=gen, dtype=torch.float64) for h in (heads, kv_heads, kv_heads, heads)
    )

    def grads(fn, tensors, w):
        leaves = [t.clone().requires_grad_() for t in tensors]
        out = fn(*leaves)
        (out * w).sum().backward()
        return [out.detach()] + [t.grad for t in leaves]

    reference = [split_sequence(t, rank, cp) for t in grads(causal_attention, (q, k, v), weight)]
    mine = [split_sequence(t, rank, cp) for t in (q, k, v)]
    result: dict = {"errors": {}, "forward": {}, "backward": {}}
    for name, fn in (("allgather", allgather_attention), ("ring", ring_attention)):
        attend = lambda q, k, v, fn=fn: fn(q, k, v, group=group)  # noqa: E731
        result["errors"][name] = [
            (a - e).abs().max().item()
            for a, e in zip(grads(attend, mine, split_sequence(weight, rank, cp)), reference, strict=True)
        ]
        leaves = [t.clone().requires_grad_() for t in mine]
        with CollectiveCounter() as forward:
            out = attend(*leaves)
        with CollectiveCounter() as backward:
            out.sum().backward()
        result["forward"][name], result["backward"][name] = dict(forward.counts), dict(backward.counts)

    # The largest dim of any tensor an algorithm creates, forward and backward.
    class Sizes(CollectiveCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dim():
                    self.counts["largest"] = max(self.counts["largest"], max(t.shape))
            return out

    result["largest"] = {}
    for name, fn in (("allgather", allgather_attention), ("ring", ring_attention)):
        leaves = [t.clone().requires_grad_() for t in mine]
        with Sizes() as sizes:
            fn(*leaves, group=group).sum().backward()
        result["largest"][name] = sizes.counts["largest"]

    # The whole model (rotary positions included), fp32: summed over cp, gradients equal one device's.
    seq = 8 * cp
    tokens = torch.randint(0, TINY.vocab_size, (2, seq + 1), generator=gen)
    with torch.device("meta"):
        plain = Transformer(TINY)
    plain.init_weights(seed=3)
    F.cross_entropy(plain(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum").backward()
    cp_mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    result["model"] = {}
    for name in ("allgather", "ring"):
        with torch.device("meta"):
            model = Transformer(TINY)
        apply_context_parallel(model.init_weights(seed=3), cp_mesh, name, seq)
        x, y = (split_sequence(t, rank, cp) for t in (tokens[:, :-1], tokens[:, 1:]))
        F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").backward()
        worst = 0.0
        for p, ref in zip(model.parameters(), plain.parameters(), strict=True):
            dist.all_reduce(p.grad, group=group)  # what FSDP's reduce-scatter over cp does
            worst = max(worst, ((p.grad - ref.grad).abs().max() / ref.grad.abs().max()).item())
        result["model"][name] = worst

    # measure/context_parallel.py's measurements at a small size: saved bytes of one block, bytes sent per layer
    from measure.context_parallel import measure_block, measure_comm

    result["saved"] = {name: measure_block(TINY, 2, 8 * cp, name)["bytes"] for name in ("allgather", "ring")}
    result["sent"] = {name: measure_comm(TINY, 2, 8 * cp, name)["bytes"] for name in ("allgather", "ring")}
    return result


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def parity(request):
    return request.param, run_on_ranks(attention_parity, request.param, request.param)


@pytest.mark.compat
def test_both_algorithms_match_single_device_attention(parity):
    _, ranks = parity
    for rank, result in enumerate(ranks):
        for name, errors in result["errors"].items():
            # output, dq, dk, dv of this rank's tokens; float64 rounding only
            assert max(errors) < 1e-12, (rank, name, errors)


@pytest.mark.compat
def test_the_whole_model_has_one_devices_gradients(parity):
    _, ranks = parity
    for result in ranks:
        for name, worst in result["model"].items():
            # fp32, every parameter: ~1e-7 measured; 1e-5 fails on any wrong position, mask or missing sum
            assert worst < 1e-5, (name, worst)


def test_each_algorithm_sends_what_the_chapter_says(parity):
    cp, ranks = parity
    for result in ranks:
        # all-gather: one all-gather of K and V forward, one reduce-scatter of dK and dV backward
        assert result["forward"]["allgather"] == {"all_gather_into_tensor": 1}
        assert result["backward"]["allgather"] == {"reduce_scatter_tensor": 1}
        # ring: cp - 1 K/V hops forward; backward cp - 1 K/V hops and cp dK/dV hops (the last one takes them home)
        assert result["forward"]["ring"] == {"send": cp - 1, "recv_": cp - 1}
        assert result["backward"]["ring"] == {"send": 2 * cp - 1, "recv_": 2 * cp - 1}


def test_the_ring_never_holds_more_than_s_over_cp_keys(parity):
    cp, ranks = parity
    for result in ranks:
        # s = 10 cp; every other dim (and batch x heads, which matmul flattens) is below 10: no tensor of the ring spans more than s / cp positions,
        # while the all-gather holds the whole sequence
        assert result["largest"]["ring"] == 10
        assert result["largest"]["allgather"] == 10 * cp


def test_the_bench_formulas_hold_to_the_byte(parity):
    from measure.context_parallel import formula_bytes, formula_comm, measure_block

    cp, ranks = parity
    one = measure_block(TINY, 2, 8 * cp, "none")["bytes"]  # this process: no group, cp = 1
    assert one == formula_bytes(TINY, 2, 8 * cp, 1, 0, "none")
    for rank, result in enumerate(ranks):
        for name in ("allgather", "ring"):
            assert result["saved"][name] == formula_bytes(TINY, 2, 8 * cp, cp, rank, name), (rank, name)
            assert result["sent"][name] == formula_comm(TINY, 2, 8 * cp, cp, name), (rank, name)
        # the ring keeps exactly 1/cp of one process's activations (both keep k, v at kv heads: SDPA reads
        # grouped heads); the all-gather keeps every rank's keys
        assert result["saved"]["ring"] * cp == one < cp * result["saved"]["allgather"]


def checkpointed_block_sends() -> dict:
    """Rank body (cp = 2): collectives and sends of one checkpointed 1-layer model, per algorithm and AC mode."""
    from torch.distributed.device_mesh import init_device_mesh

    from mesh.activation_checkpoint import apply_activation_checkpointing
    from mesh.context_parallel import apply_context_parallel
    from models.llama import Transformer
    from tests.test_activation_checkpoint import CollectiveCounter

    cp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    args = ModelArgs(dim=48, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    mine = split_sequence(tokens, dist.get_rank(), 2)
    counts = {}
    for algorithm in ("allgather", "ring"):
        for mode in ("none", "selective", "full"):
            with torch.device("meta"):
                model = Transformer(args)
            apply_activation_checkpointing(model, mode)
            model.to_empty(device="cpu")
            model.init_weights(seed=1)
            apply_context_parallel(model, cp_mesh, algorithm, 16)
            with CollectiveCounter() as forward:
                loss = model(mine).sum()
            with CollectiveCounter() as backward:
                loss.backward()
            counts[algorithm, mode] = (dict(forward.counts), dict(backward.counts))
    return counts


def test_selective_checkpointing_repeats_the_gather_and_the_ring():
    counts = run_on_ranks(checkpointed_block_sends, 2)[0]
    gather = {mode: counts["allgather", mode] for mode in ("none", "selective", "full")}
    ring = {mode: counts["ring", mode] for mode in ("none", "selective", "full")}
    # all-gather: none keeps the gathered K/V; selective recomputes it (a whole-sequence all-gather output,
    # mesh/ac_policies.py), as full does, so both gather again in backward
    assert gather["none"] == ({"all_gather_into_tensor": 1}, {"reduce_scatter_tensor": 1})
    assert gather["selective"][1] == gather["full"][1] == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}
    # ring: point-to-point sends cannot be saved; any recompute repeats the cp - 1 = 1 forward hop (all ranks alike)
    assert ring["none"] == ({"send": 1, "recv_": 1}, {"send": 3, "recv_": 3})
    assert ring["selective"][1] == ring["full"][1] == {"send": 4, "recv_": 4}


# ---- 3. training parity ------------------------------------------------------------------------------------


EVAL = {"data.val_fraction": 0.05, "eval.interval": 3, "eval.steps": 2}  # every parity run here also evaluates


@pytest.fixture(scope="module")
def evaluating_one_process(shared_runs):
    return shared_runs.records(EVAL)


@pytest.mark.parametrize(
    "layout",
    [
        {"parallel.cp": 2, "parallel.cp_attention": "ring"},
        {"parallel.cp": 2, "parallel.tp": 2, "parallel.dp_shard": 1},
        pytest.param({"parallel.cp": 4, "parallel.dp_shard": 1}, marks=pytest.mark.slow),
        pytest.param(
            {"parallel.cp": 2, "parallel.dp_shard": 2, "parallel.cp_attention": "ring"}, marks=pytest.mark.slow
        ),
        pytest.param({"parallel.cp": 2, "parallel.dp_replicate": 2, "parallel.dp_shard": 1}, marks=pytest.mark.slow),
        {
            "parallel.cp": 2,
            "parallel.pp": 2,
            "parallel.dp_shard": 1,
            "parallel.cp_attention": "ring",
            "run.pp_timeline": True,
        },
        pytest.param(
            {"parallel.cp": 2, "parallel.dp_shard": 1, "training.activation_checkpoint": "selective"},
            marks=pytest.mark.slow,
        ),
        # compiled blocks call the cp attention uncompiled (torch.compiler.disable); inductor may reorder float sums
        pytest.param(
            {"parallel.cp": 2, "parallel.cp_attention": "ring", "training.compile": True}, marks=pytest.mark.slow
        ),
        pytest.param({"parallel.cp": 2, "training.compile": True}, marks=pytest.mark.slow),
    ],
    ids=[
        "cp2-ring",
        "cp2xtp2-sp",
        "cp4",
        "cp2xfsdp2-ring",
        "hsdp2xcp2",
        "pp2xcp2-ring",
        "cp2-selective-ac",
        "cp2-ring-compiled",
        "cp2-allgather-compiled",
    ],
)
@pytest.mark.compat
def test_context_parallel_matches_one_process(layout, evaluating_one_process, tmp_path):
    world = 1
    for key in ("parallel.cp", "parallel.tp", "parallel.pp", "parallel.dp_replicate", "parallel.dp_shard"):
        world *= layout.get(key, 1)
    run = train_on(world, {**layout, **EVAL, **CHECK_REPLICAS}, tmp_path, timeout=600)
    assert_same_curve(run, evaluating_one_process)
    if layout.get("run.pp_timeline"):  # the pipeline timeline still measures every rank's F/B on the last step
        bubble = json.loads((tmp_path / "pipeline_bubble.json").read_text())
        assert all(row["F"] > 0 and row["B"] > 0 for row in bubble["ranks"])
    # validation loss: the same held-out tokens, split the same way, summed over the loss mesh (with cp)
    for r, e in zip(run, evaluating_one_process, strict=True):
        assert ("val_loss" in r) == ("val_loss" in e)
        if "val_loss" in e:
            assert abs(r["val_loss"] - e["val_loss"]) <= 1e-5 * e["val_loss"]


@pytest.mark.slow
def test_five_dimensional_layout_matches_one_process(evaluating_one_process, tmp_path):
    layout = {
        "parallel.pp": 2,
        "parallel.dp_shard": 2,
        "parallel.cp": 2,
        "parallel.tp": 2,
        "parallel.pp_schedule": "Interleaved1F1B",
        "parallel.cp_attention": "ring",
    }
    run = train_on(16, {**layout, **EVAL}, tmp_path, timeout=900)
    assert_same_curve(run, evaluating_one_process)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [{"parallel.cp": 2, "parallel.dp_shard": 2}, {"parallel.cp": 2, "parallel.tp": 2, "parallel.dp_shard": 1}],
    ids=["cp2xfsdp2", "cp2xtp2"],  # cp2xtp2: the tp ranks split each cp rank's tokens for the experts
)
def test_moe_with_context_parallel_matches_one_process(layout, shared_runs, tmp_path):
    # dropless, no aux loss (both per whole sequence, refused with cp), aux-loss-free bias on: its load is global
    moe = str(ROOT / "configs" / "debug_moe.toml")
    knobs = {"model.moe_aux_loss_coef": 0.0, "model.moe_bias_update_rate": 0.01}
    reference = shared_runs.records(knobs, config=moe)
    run = train_on(4, {**knobs, **layout}, tmp_path, config=moe, timeout=400)
    assert_same_curve(run, reference)
    assert [r["expert_load"] for r in run] == [r["expert_load"] for r in reference]


# ---- 4. meshes ---------------------------------------------------------------------------------------------


def cp_meshes() -> dict:
    """Rank body (4 ranks): the meshes of cp 2 x tp 2, and of dp_replicate 2 x cp 2 (HSDP with cp)."""
    from mesh.dims import ParallelDims, build_mesh
    from mesh.private_api import group_timeout, root_mesh

    facts = {}
    for name, (dp_replicate, cp, tp) in {"cp2xtp2": (1, 2, 2), "hsdp2xcp2": (2, 2, 1)}.items():
        dims = ParallelDims(dp_replicate=dp_replicate, cp=cp, tp=tp, world_size=dist.get_world_size())
        meshes = build_mesh(dims, torch.device("cpu"), 43)
        groups = {n: dist.get_process_group_ranks(m.get_group()) for n, m in meshes.all().items() if m.ndim == 1}
        facts[name] = {
            "ranks": groups,
            "fsdp": (meshes.fsdp.mesh_dim_names, tuple(meshes.fsdp.shape)),
            "dp_rank": meshes.dp.get_local_rank(),
            "roots": all(root_mesh(m) is meshes.world for m in meshes.all().values()),
            "timeouts": {
                group_timeout(m.get_group(i)).total_seconds() for m in meshes.all().values() for i in range(m.ndim)
            },
        }
    return facts


def test_cp_sits_between_dp_shard_and_tp_and_fsdp_shards_over_dp_shard_x_cp():
    for rank, facts in enumerate(run_on_ranks(cp_meshes, 4, timeout=300)):
        # cp 2 x tp 2: ranks are (cp, tp) row-major, so cp neighbours are 2 apart and tp groups consecutive ranks
        cp, tp = divmod(rank, 2)
        mine = facts["cp2xtp2"]
        assert mine["ranks"]["cp"] == [tp, 2 + tp] and mine["ranks"]["tp"] == [2 * cp, 2 * cp + 1]
        assert mine["ranks"]["loss"] == [tp, 2 + tp]  # every cp rank of my tp coordinate sums the loss
        assert mine["fsdp"] == (("dp_shard_cp",), (2,))  # parameters are sharded over dp_shard x cp
        assert mine["dp_rank"] == 0  # both cp ranks read the same sequences
        # dp_replicate 2 x cp 2: HSDP over (replicas, dp_shard x cp), a 2-D mesh made of the existing groups
        rep, cp = divmod(rank, 2)
        hsdp = facts["hsdp2xcp2"]
        assert hsdp["fsdp"] == (("dp_replicate", "dp_shard_cp"), (2, 2))
        assert hsdp["ranks"]["cp"] == [2 * rep, 2 * rep + 1] and hsdp["ranks"]["dp"] == [cp, 2 + cp]
        assert hsdp["dp_rank"] == rep and hsdp["ranks"]["loss"] == [0, 1, 2, 3]
        for layout in facts.values():
            assert layout["roots"] and layout["timeouts"] == {43.0}


# ---- 5. misfits are refused before any process group ----------------------------------------------------


@pytest.mark.parametrize(
    "world, overrides, expected",
    [
        (2, {"parallel.cp": 2, "training.seq_len": 126}, "training.seq_len=126 is not divisible by 2*parallel.cp=4"),
        (
            4,
            {"parallel.cp": 2, "parallel.dp_shard": 1},
            "pp*dp_replicate*dp_shard*cp*tp = 1*1*1*2*1 = 2 but WORLD_SIZE=4",
        ),
        (
            8,
            {"parallel.cp": 2, "parallel.tp": 4, "training.seq_len": 132},
            "training.seq_len=132 / parallel.cp=2 = 66 tokens per cp rank, not divisible by parallel.tp=4",
        ),
        (
            4,
            {"parallel.cp": 2, "parallel.ep": 8, "model.n_experts": 8, "parallel.dp_shard": 2},
            "parallel.ep=8 must divide parallel.dp_shard*cp*tp=2*2*1=4",
        ),
        (
            2,
            {"parallel.cp": 2, "model.n_experts": 4, "model.moe_aux_loss_coef": 0.01},
            "model.moe_aux_loss_coef=0.01 with parallel.cp=2",
        ),
        (
            2,
            {"parallel.cp": 2, "model.n_experts": 4, "model.moe_capacity_factor": 1.25},
            "model.moe_capacity_factor=1.25 with parallel.cp=2",
        ),
        (2, {"parallel.cp": 0}, "parallel.cp=0 must be >= 1"),
    ],
    ids=["seq-len", "world", "sp-per-cp-rank", "ep", "aux-loss", "capacity", "zero"],
)
def test_a_misfit_cp_layout_is_refused_before_any_process_group(world, overrides, expected):
    with pytest.raises(ConfigError) as err:
        check_config(load_config(path=DEBUG_CONFIG, overrides=overrides), world)
    assert expected in str(err.value)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "world, overrides, expected",
    [
        (8, {"parallel.cp": 2, "parallel.tp": 4, "parallel.dp_shard": 1, "training.seq_len": 12}, "tokens per cp rank"),
        (4, {"parallel.cp": 2, "parallel.tp": 2, "parallel.dp_shard": 1, "training.seq_len": 6}, "2*parallel.cp=4"),
        (
            8,
            {
                "parallel.cp": 2,
                "parallel.tp": 4,
                "parallel.dp_shard": 1,
                "training.seq_len": 12,
                "parallel.sequence_parallel": False,
            },
            "(per cp rank: 6) is not divisible by parallel.tp=4",
        ),
    ],
    ids=["sp-rule", "2cp-rule", "moe-token-split-rule"],
)
def test_a_moe_sequence_that_tp_and_cp_cannot_split_is_reported_once(world, overrides, expected):
    """MoE under TP splits each cp rank's tokens over tp: one broken seq_len is one message, from the rule it breaks."""
    moe = {"model.n_experts": 4, "model.moe_aux_loss_coef": 0.0, "model.max_seq_len": 64}
    with pytest.raises(ConfigError) as err:
        check_config(load_config(path=DEBUG_CONFIG, overrides={**moe, **overrides}), world)
    rules = [line for line in str(err.value).splitlines() if line.strip().startswith("- ")]
    assert len(rules) == 1 and expected in rules[0], rules


def test_an_unknown_cp_attention_is_refused_while_reading_the_config():
    with pytest.raises(
        ConfigError, match="parallel.cp_attention='ulysses' is not allowed; choose one of allgather, ring"
    ):
        load_config(path=DEBUG_CONFIG, overrides={"parallel.cp_attention": "ulysses"})
