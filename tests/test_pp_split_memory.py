"""``parallel.pp_split memory``: stage cuts that even out the pipeline ranks' peak memory (mesh/pipeline.py:
memory_split), checked against a hand-worked example, a brute force over every cut, the banner, and parity."""

import itertools

import pytest

from launch.local_runs import DEBUG_CONFIG, train_on
from mesh.pipeline import SCHEDULE_FAMILIES
from models.llama import ModelArgs
from planning.dry_run import dry_run
from planning.layout import Layout
from planning.memory_estimate import layer_activation_bytes
from planning.pipeline_split import memory_split, rank_peaks, split_layers
from planning.plan import LayoutPlan
from runtime.config import load_config
from tests.training_runs import assert_same_curve

HAND = ModelArgs(dim=16, n_layers=8, n_heads=2, n_kv_heads=2, vocab_size=32, ffn_dim=32)


def hand_layout(activation_checkpoint: str) -> Layout:
    # pp 4, 1F1B, 4 micro-batches of 2 sequences x 32 tokens (n = 64 tokens), fp32, no FSDP, no TP.
    return Layout(
        pp=4,
        seq_len=32,
        sequences_per_microbatch=2,
        pp_schedule="1F1B",
        pp_microbatches=4,
        activation_checkpoint=activation_checkpoint,
        mixed_precision="fp32",
        fsdp=False,
    )


def test_memory_split_matches_a_hand_worked_example():
    """dim h = 16, 2 heads of 8 (kv width g = 16), FFN H = 32, vocabulary V = 32, 8 layers, w = 4 bytes (fp32).

    Per block: parameters 2h^2 + 2hg + 3hH + 2h = 512 + 512 + 1,536 + 32 = 2,592, states 16 x 2,592 = 41,472 B.
    Activations per micro-batch of n = 64 tokens (planning/memory_estimate.py, item 3): norms 2(n h w + 4n)
    = 8,704; the two gathered inputs 2 n h w = 8,192; attention (2 n h w + 2 n g w + 4 n a) = 16,896; SwiGLU
    4 n H w = 32,768; in all A = 66,560 B. The embedding 16 x 512 = 8,192 B on stage 0; head + norm
    16 x 528 = 8,448 B and logits 16 x 64 x 32 = 32,768 B on stage 3 (41,216 B): in fp32 on one process backward
    holds the saved log-softmax, nll_loss's gradient and the log-softmax's input gradient, and the pipeline stage its
    output, 4 bytes per logit each (planning/memory_estimate.py: bytes_per_logit).
    1F1B with 4 micro-batches: rank r holds 4 - r micro-batches, so a block costs S + (4 - r) A there:
    307,712 | 241,152 | 174,592 | 108,032.
      params (2,2,2,2): 623,616 | 482,304 | 349,184 | 257,280 (max/min 2.42).
      memory: stage 3 with 4 blocks is 473,344; stage 0 or 1 with 2 blocks is at least 482,304, so they get
      one each, stage 2 the remaining two: (1,1,2,4) -> 315,904 | 241,152 | 349,184 | 473,344 (max/min 1.96);
      any other cut puts 2 blocks on stage 0 or 1, or 5 on stage 3 (581,376), or 3 on stage 2 (523,776).
    With full checkpointing a block keeps only its input, n h w = 4,096 B per micro-batch, and each rank
    rebuilds one block (66,560 - 4,096 = 62,464 B): S + (4 - r) 4,096 = 57,856 | 53,760 | 49,664 | 45,568,
    and (2,2,2,2) gives 186,368 | 169,984 | 161,792 | 194,816, which no move of one layer improves (stage 2
    with 3 blocks: 211,456; stage 1 with 3: 223,744): the split stays even.
    """
    none, full = hand_layout("none"), hand_layout("full")
    assert HAND.layer_params(0) == 2_592 and layer_activation_bytes(HAND, 0, none) == 66_560
    assert rank_peaks(HAND, none, [2, 2, 2, 2], "1F1B") == [623_616, 482_304, 349_184, 257_280]
    assert memory_split(HAND, none, 4, "1F1B") == [1, 1, 2, 4]
    assert rank_peaks(HAND, none, [1, 1, 2, 4], "1F1B") == [315_904, 241_152, 349_184, 473_344]
    assert [len(s) for s in split_layers(HAND, 4, "params", 32)] == [2, 2, 2, 2]
    assert memory_split(HAND, full, 4, "1F1B") == [2, 2, 2, 2]
    assert rank_peaks(HAND, full, [2, 2, 2, 2], "1F1B") == [186_368, 169_984, 161_792, 194_816]


@pytest.mark.parametrize("schedule", list(SCHEDULE_FAMILIES))
@pytest.mark.parametrize("ac", ["none", "selective", "full"])
@pytest.mark.parametrize("sharded", [False, True], ids=["fp32", "bf16-fsdp2-tp2"])
def test_memory_split_is_the_best_cut_for_every_schedule(schedule, ac, sharded):
    """Against a brute force over every cut: no cut has a lower largest rank peak (looped and V schedules,
    whose ranks hold two stages, go through the local search of step 3), with whole fp32 states, and with
    bf16 compute, FSDP-sharded states, gathered weights and TP-split activations."""
    args = ModelArgs(dim=16, n_layers=10, n_heads=2, n_kv_heads=2, vocab_size=64, ffn_dim=32)
    v = SCHEDULE_FAMILIES[schedule].natural_stages_per_rank
    pp = 4 // v
    layout = Layout(
        pp=pp,
        seq_len=32,
        sequences_per_microbatch=2,
        pp_schedule=schedule,
        pp_microbatches=8,
        stages_per_rank=v,
        activation_checkpoint=ac,
        mixed_precision="bf16" if sharded else "fp32",
        fsdp=sharded,
        dp_shard=2 if sharded else 1,
        tp=2 if sharded else 1,
    )
    cuts = [c for c in itertools.product(range(1, 8), repeat=4) if sum(c) == 10]
    best = min(max(rank_peaks(args, layout, list(c), schedule)) for c in cuts)
    assert max(rank_peaks(args, layout, memory_split(args, layout, 4, schedule), schedule)) == best


def test_the_plan_and_the_dry_run_print_layers_per_stage():
    overrides = {
        "parallel.pp": 4,
        "parallel.dp_shard": 1,
        "parallel.pp_schedule": "1F1B",
        "parallel.pp_microbatches": 4,
        "model.n_layers": 8,
    }
    for split, expected in (("params", "2,2,2,2"), ("memory", "1,2,2,3"), ("3,2,2,1", "3,2,2,1")):
        cfg = load_config(path=DEBUG_CONFIG, overrides={**overrides, "parallel.pp_split": split})
        assert LayoutPlan.resolve(cfg, 4).split_line() == f"layers per stage {expected}"
        assert f"layers per stage {expected} (pp_split {split})" in dry_run(cfg, 4)


def test_memory_split_matches_one_process(one_process, tmp_path):
    # 1F1B on 3 ranks with 4 micro-batches of 2 sequences: rank 0 holds three in flight, rank 1 two, rank 2 one plus
    # the logits, so the memory split is (1,1,2) where params gives (1,2,1); the model and its curve must not change.
    # (On 2 ranks the two splits agree, (2,2): with the pipelined stage's output counted among the logits,
    # bytes_per_logit, the last rank with three layers would be the fuller one.)
    layout = {"parallel.pp": 3, "parallel.pp_schedule": "1F1B", "parallel.pp_microbatches": 4}
    cfg = load_config(path=DEBUG_CONFIG, overrides={**layout, "parallel.dp_shard": 1, "parallel.pp_split": "memory"})
    assert LayoutPlan.resolve(cfg, 3).split_line() == "layers per stage 1,1,2"
    params = load_config(path=DEBUG_CONFIG, overrides={**layout, "parallel.dp_shard": 1, "parallel.pp_split": "params"})
    assert LayoutPlan.resolve(params, 3).split_line() == "layers per stage 1,2,1"
    assert_same_curve(train_on(3, {**layout, "parallel.pp_split": "memory"}, tmp_path), one_process)
