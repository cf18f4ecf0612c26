"""Pipeline parallelism: every schedule trains the same model as one process; misfits fail before any send."""

import json

import pytest

from launch.local_runs import DEBUG_CONFIG, train_on
from mesh.pipeline import SCHEDULE_FAMILIES, stage_ids_of_rank
from mesh.private_api import splits_compiled_backward
from models.llama import ModelArgs
from planning.pipeline_split import balanced_split, split_layers
from runtime.config import ConfigError, load_config
from tests.training_runs import CHECK_REPLICAS, assert_same_curve
from train import check_config

# ---- parity ----------------------------------------------------------------------------------------------

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.compat
def test_every_schedule_matches_one_process(schedule, one_process, tmp_path):
    # pp=2 with 4 micro-batches; looped and V-shaped schedules run 2 stages per rank (4 stages, 1 layer each).
    layout = {"parallel.pp": 2, "parallel.pp_schedule": schedule, "parallel.pp_microbatches": 4}
    assert_same_curve(train_on(2, layout, tmp_path), one_process)


@pytest.mark.compat
def test_pipeline_with_fsdp_matches_one_process(one_process, tmp_path):
    layout = {"parallel.pp": 2, "parallel.dp_shard": 2, "parallel.pp_schedule": "1F1B", **CHECK_REPLICAS}
    assert_same_curve(train_on(4, layout, tmp_path), one_process)


def test_pipeline_with_gradient_accumulation_matches_one_process(one_process, tmp_path):
    # per-rank batch 8 = 2 accumulation steps of micro-batch 4, each split into 2 pipeline micro-batches
    layout = {"parallel.pp": 2, "training.micro_batch": 4, "parallel.pp_microbatches": 2}
    assert_same_curve(train_on(2, layout, tmp_path), one_process)


@pytest.mark.compat
def test_3d_pipeline_fsdp_tensor_parallel_matches_one_process(one_process, tmp_path):
    layout = {"parallel.pp": 2, "parallel.dp_shard": 2, "parallel.tp": 2, "parallel.pp_schedule": "Interleaved1F1B"}
    layout.update(CHECK_REPLICAS)
    assert_same_curve(train_on(8, layout, tmp_path, timeout=400), one_process)


@pytest.mark.parametrize(
    "layout, world",
    [
        *(
            pytest.param(
                {"parallel.pp": 2, "parallel.pp_schedule": schedule, "parallel.pp_microbatches": 4},
                2,
                # DualPipeV is the schedule whose compiled backward needs the donation switch
                # (mesh/private_api.keep_compiled_backward_inputs): the compat legs check it where torch differs.
                marks=[pytest.mark.compat, pytest.mark.compiled] if schedule == "DualPipeV" else [],
            )
            for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
        ),
        ({"parallel.pp": 2, "parallel.dp_shard": 2, "parallel.tp": 2, "parallel.pp_schedule": "Interleaved1F1B"}, 8),
    ],
    ids=["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV", "3d-pp2xfsdp2xtp2"],
)
@pytest.mark.slow  # 2-8 ranks compiling the blocks: 1-3 minutes each on 2 cores
def test_compiled_pipelines_match_one_process(layout, world, one_process_10_steps, tmp_path):
    # Zero-bubble schedules run each compiled block's backward twice (input, then weight gradients: the saved
    # activations are kept for it, mesh/private_api.keep_compiled_backward_inputs). Tolerance: LOSS_RTOL, as for
    # the compiled TP layouts (tests/test_tensor_parallel.py).
    overrides = {**layout, **CHECK_REPLICAS, "training.compile": True, "training.steps": 10}
    if SCHEDULE_FAMILIES[layout["parallel.pp_schedule"]].zero_bubble and not splits_compiled_backward():
        with pytest.raises(ConfigError, match="upgrade torch to 2.13"):  # torch 2.11 (mesh/private_api.py)
            check_config(load_config(path=DEBUG_CONFIG, overrides=overrides), world)
        return
    assert_same_curve(train_on(world, overrides, tmp_path, timeout=900), one_process_10_steps)


def test_timeline_and_bubble_are_written(tmp_path):
    layout = {"parallel.pp": 2, "parallel.pp_schedule": "1F1B", "parallel.pp_microbatches": 4}
    train_on(2, {**layout, "run.pp_timeline": True, "training.steps": 2}, tmp_path)
    summary = json.loads((tmp_path / "pipeline_bubble.json").read_text())
    assert summary["predicted_idle_fraction"] == pytest.approx(1 / 5)  # (p-1)/(m+p-1) with p=2, m=4
    assert 0.0 < summary["measured_idle_fraction"] < 1.0
    for row in summary["ranks"]:
        assert row["F"] > 0 and row["B"] > 0
    svg = (tmp_path / "pipeline_timeline.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<title>F") == 2 * 4 and svg.count("<title>B") == 2 * 4


# ---- splits and placement --------------------------------------------------------------------------------


def test_balanced_split_minimises_the_largest_stage():
    assert balanced_split([1.0] * 8, 0.0, 0.0, 4) == [2, 2, 2, 2]
    # A heavy head (last stage) pushes layers towards the first stages.
    assert balanced_split([1.0] * 8, 0.0, 4.0, 2) == [6, 2]
    assert balanced_split([1.0] * 3, 0.0, 0.0, 3) == [1, 1, 1]


def test_split_policies_and_explicit_lists():
    big_vocab = ModelArgs(dim=64, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=32768, multiple_of=32)
    by_params = split_layers(big_vocab, 2, "params", seq_len=128)
    assert sum(map(len, by_params)) == 8 and by_params[0][0] == 0 and by_params[-1][-1] == 7
    # By FLOPs the embedding lookup is free, so the first stage takes more layers than by parameters.
    assert len(split_layers(big_vocab, 2, "flops", seq_len=128)[0]) > len(by_params[0])
    assert split_layers(big_vocab, 2, "3,5", seq_len=128) == [[0, 1, 2], [3, 4, 5, 6, 7]]


def test_moe_split_by_params_and_by_flops_matches_a_hand_count():
    """8 blocks, every second one MoE (4 experts of hidden 16, top-1), 3 stages; the costs counted by hand.

    dim 64, 4 heads of 16, 2 kv heads (kv dim 32), dense FFN hidden 128, vocabulary 512, seq_len 16.
    Parameters per block: attention 2*64*64 + 2*64*32 = 12,288; norms 128; dense FFN 3*64*128 = 24,576;
    MoE FFN 4*3*64*16 + router 64*4 = 12,544. Dense block 36,992, MoE block 24,960. First stage + embedding
    512*64 = 32,768; last stage + head 32,768 + final norm 64.
      by params: (2,3,3) -> 94,720 | 98,944 | 119,744 (worst 119,744). An average block (30,976) would give
      (2,4,2), whose true costs 94,720 | 123,904 | 94,784 are worse.
    FLOPs per token and block: 6 x matmul weights + 12*64*16 = 12,288 of attention scores. Dense: 6*36,864
    + 12,288 = 233,472; MoE (router + one expert: 256 + 3*64*16 = 3,328): 6*15,616 + 12,288 = 105,984.
    Head 6*64*512 = 196,608 on the last stage, the embedding lookup free.
      by flops: (3,3,2) -> 572,928 | 445,440 | 536,064 (worst 572,928).
    """
    from models.moe import MoEArgs

    args = ModelArgs(dim=64, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=128, moe_every=2)
    args.moe = MoEArgs(n_experts=4, top_k=1, hidden_dim=16)
    assert [args.layer_params(i) for i in range(2)] == [36_992, 24_960]
    assert split_layers(args, 3, "params", seq_len=16) == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert split_layers(args, 3, "flops", seq_len=16) == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_stage_placement_looped_and_v_shaped():
    assert [stage_ids_of_rank(r, 2, 2, "Interleaved1F1B") for r in range(2)] == [[0, 2], [1, 3]]
    assert [stage_ids_of_rank(r, 2, 2, "ZBVZeroBubble") for r in range(2)] == [[0, 3], [1, 2]]
    assert stage_ids_of_rank(1, 4, 1, "1F1B") == [1]


# ---- misfits fail before any send/recv (check_config needs no process group) ----------------------------


@pytest.mark.parametrize(
    "overrides, world, expected",
    [
        ({"parallel.pp": 8}, 8, "8 stages, more than model.n_layers=4"),
        (
            {"parallel.pp": 2, "parallel.pp_schedule": "Interleaved1F1B", "parallel.pp_stages_per_rank": 3},
            2,
            "6 stages, more than model.n_layers=4",
        ),
        (
            {"parallel.pp": 2, "parallel.pp_microbatches": 3},
            2,
            "parallel.pp_microbatches=3 must divide the per-rank batch 8",
        ),
        (
            {"parallel.pp": 2, "parallel.pp_schedule": "ZBVZeroBubble", "parallel.pp_stages_per_rank": 1},
            2,
            "ZBVZeroBubble is V-shaped and needs exactly 2 stages per rank",
        ),
        (
            {"parallel.pp": 2, "parallel.pp_schedule": "1F1B", "parallel.pp_stages_per_rank": 2},
            2,
            "1F1B runs one stage per rank",
        ),
        (
            {"parallel.pp": 2, "parallel.pp_schedule": "1F1B", "parallel.pp_microbatches": 1},
            2,
            "1F1B needs at least one per stage",
        ),
        (
            {"parallel.pp": 2, "parallel.pp_schedule": "DualPipeV", "parallel.pp_microbatches": 2},
            2,
            "DualPipeV needs at least one per stage",
        ),
        (
            {"parallel.pp": 2, "parallel.pp_schedule": "Zero"},
            2,
            "parallel.pp_schedule='Zero' is not allowed; choose one of GPipe",
        ),
        ({"parallel.pp": 2, "parallel.pp_split": "1,2"}, 2, "parallel.pp_split='1,2' must be"),
    ],
)
def test_a_misfit_pipeline_is_refused_before_any_send(overrides, world, expected):
    with pytest.raises(ConfigError) as err:  # an unknown schedule is refused while the config is read
        check_config(load_config(path=DEBUG_CONFIG, overrides={"parallel.dp_shard": 1, **overrides}), world)
    assert expected in str(err.value)
