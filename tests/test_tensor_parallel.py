"""Tensor + sequence parallelism: parity with one process, and the collectives the docs promise."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from config import ConfigError, load_config
from mesh.materialize import materialize_weights
from mesh.tensor_parallel import apply_tensor_parallel
from models.llama import ModelArgs, Transformer
from tests.harness import run_on_ranks
from tests.training_runs import DEBUG_CONFIG, assert_same_curve, train_on
from train import check_config

# ---- parity ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return train_on(1, {}, tmp_path_factory.mktemp("one"))


@pytest.mark.parametrize(
    "layout",
    [
        {"parallel.tp": 2, "parallel.dp_shard": 1},
        {"parallel.tp": 2, "parallel.dp_shard": 2},
        {"parallel.tp": 2, "parallel.dp_shard": 2, "parallel.sequence_parallel": False},
        {"parallel.tp": 2, "parallel.dp_replicate": 2, "parallel.dp_shard": 1},
    ],
    ids=["tp2", "fsdp2xtp2-sp", "fsdp2xtp2-nosp", "hsdp-replicate2xtp2"],
)
def test_tensor_parallel_matches_one_process(layout, one_process, tmp_path):
    world = layout["parallel.tp"] * layout["parallel.dp_shard"] * layout.get("parallel.dp_replicate", 1)
    assert_same_curve(train_on(world, layout, tmp_path), one_process)


# ---- collectives of one block --------------------------------------------------------------------------

TINY = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32)


def tp_model(sequence_parallel: bool):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = Transformer(TINY)
    apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
    materialize_weights(model, torch.device("cpu"), seed=0)
    return model


def block_collectives(sequence_parallel: bool) -> dict:
    """Count the collectives of one TransformerBlock's forward and backward on 2 tp ranks."""
    model = tp_model(sequence_parallel)
    block = model.layers["0"]
    seq = 16 // 2 if sequence_parallel else 16  # with SP the block's input is this rank's sequence shard
    x = torch.randn(2, seq, TINY.dim, requires_grad=True)
    with CommDebugMode() as forward:
        out = block(x, model.rope_cos, model.rope_sin)
    with CommDebugMode() as backward:
        out.sum().backward()
    names = lambda mode: {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}  # noqa: E731
    return {
        "forward": names(forward),
        "backward": names(backward),
        "local_out_shape": tuple(out.shape),
        "norm_grad_placements": block.attention_norm.weight.grad.placements,
    }


def test_megatron_tp_block_all_reduces_once_per_sublayer_each_way():
    counts = run_on_ranks(block_collectives, 2, False)[0]
    # f/g operators: attention and MLP each end in one all-reduce forward; their inputs' gradients are
    # summed by one all-reduce each in backward.
    assert counts["forward"] == {"all_reduce": 2}
    assert counts["backward"] == {"all_reduce": 2}
    assert counts["local_out_shape"] == (2, 16, TINY.dim)
    assert counts["norm_grad_placements"] == (Replicate(),)  # replicated norm, replicated gradient


def test_sequence_parallel_block_replaces_all_reduce_with_reduce_scatter_and_all_gather():
    counts = run_on_ranks(block_collectives, 2, True)[0]
    assert counts["forward"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
    assert counts["backward"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
    assert counts["local_out_shape"] == (2, 8, TINY.dim)  # the residual stream stays sequence-sharded
    # The norm saw only this rank's tokens: its weight gradient is a partial sum (train.py reduces it once,
    # mesh/tensor_parallel.reduce_partial_gradients; under FSDP the gradient reduce-scatter does).
    assert counts["norm_grad_placements"] == (Partial(),)


def logits_layout() -> tuple:
    model = tp_model(sequence_parallel=True)
    tokens = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    return isinstance(logits, DTensor), logits.placements, tuple(logits.to_local().shape)


def test_output_head_keeps_logits_sharded_on_the_vocabulary():
    for is_dtensor, placements, local_shape in run_on_ranks(logits_layout, 2):
        assert is_dtensor and placements == (Shard(2),)
        assert local_shape == (2, 16, TINY.vocab_size // 2)  # never the full vocabulary on one rank


# ---- validation ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"parallel.tp": 3}, "parallel.tp=3 does not divide model.n_heads=8"),
        ({"parallel.tp": 8, "model.n_kv_heads": 4}, "parallel.tp=8 does not divide model.n_kv_heads=4"),
        ({"parallel.tp": 2, "model.ffn_dim": 333}, "does not divide the FFN hidden size (model.ffn_dim)=333"),
        ({"parallel.tp": 2, "model.vocab_size": 257}, "does not divide model.vocab_size=257"),
        ({"parallel.tp": 2, "training.seq_len": 127}, "training.seq_len=127 is not divisible by parallel.tp=2"),
    ],
)
def test_a_tp_that_does_not_fit_the_model_is_refused(overrides, expected):
    cfg = load_config(path=DEBUG_CONFIG, overrides={"parallel.dp_shard": 1, **overrides})
    with pytest.raises(ConfigError) as err:
        check_config(cfg, cfg.parallel.tp)
    message = str(err.value)
    assert expected in message and ("choose" in message or "change" in message)
