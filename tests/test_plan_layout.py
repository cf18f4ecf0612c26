"""bench/plan_layout.py: properties its arithmetic must have, its command lines pass meshloom's validation,
and the activation-checkpointing measurement agrees with the saved-tensor formula of docs/tensor_parallel.md."""

import pytest

from bench.activation_memory import formula_bytes
from bench.plan_layout import GB, MODELS, candidates, estimate, kept_bytes, overrides, plan, states_bytes
from models.llama import ModelArgs

SEQ, BATCH = 8192, 488  # 4e6 tokens / 8192
COUNTS = (8, 64, 512, 4096)


def test_one_gpu_holds_sixteen_bytes_per_parameter():
    for args in MODELS.values():
        psi = args.num_params()
        assert states_bytes(psi, 1, 1, 1) == 16 * psi
        assert estimate(args, 1, 1, 1, False, SEQ, BATCH)["states"] == 16 * psi


def test_states_depend_only_on_the_number_of_gpus():
    """TP and PP cut the model, FSDP shards the rest: 16Ψ/(tp·pp·dp) is the same for every layout of N GPUs."""
    args = MODELS["dense-100b"]
    psi = args.num_params()
    assert {states_bytes(psi, tp, pp, dp) for tp, pp, dp in candidates(args, 512, SEQ)} == {16 * psi / 512}


def test_activation_terms_follow_korthikanti():
    """One layer, tp=2: 34·s·h/tp bytes without recomputation; 2·s·h/tp kept + one 34·s·h/tp rebuild with AC."""
    tiny = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32)
    logits = 12 * SEQ * 256 / 2
    assert estimate(tiny, 2, 1, 1, False, SEQ, 1)["acts"] == 34 * SEQ * 64 / 2 + logits
    assert estimate(tiny, 2, 1, 1, True, SEQ, 1)["acts"] == (2 + 34) * SEQ * 64 / 2 + logits


def test_more_data_parallel_ranks_never_need_more_memory_for_a_fixed_layout():
    for args in MODELS.values():
        for tp, pp, _ in candidates(args, 64, SEQ):
            for ac in (False, True):
                totals = [estimate(args, tp, pp, dp, ac, SEQ, BATCH)["total"] for dp in (1, 2, 4, 8, 64, 488)]
                assert totals == sorted(totals, reverse=True), (tp, pp, ac, totals)


def test_chosen_layouts_fit_and_respect_the_rules():
    for args in MODELS.values():
        for gpus in COUNTS:
            e = plan(args, gpus, 80, SEQ, BATCH)
            if e is None:
                continue
            assert e["tp"] <= 8 and e["tp"] * e["pp"] * e["dp"] == gpus and args.n_layers % e["pp"] == 0
            assert e["total"] <= 80 * GB and e["dp"] <= BATCH and (e["pp"] == 1 or e["m"] >= e["pp"])


def test_what_does_not_fit():
    assert plan(MODELS["dense-1t"], 8, 80, SEQ, BATCH) is None  # 16Ψ/8 = 2.1 TB of states alone
    assert plan(MODELS["llama3-70b"], 8, 80, SEQ, BATCH) is None  # 141 GB of states alone
    # 4,096 GPUs with tp <= 8 need dp x pp >= 512 sequences; 4e6 tokens are 488 sequences of 8192.
    assert plan(MODELS["llama3-8b"], 4096, 80, SEQ, BATCH) is None
    assert plan(MODELS["llama3-8b"], 4096, 80, SEQ, 512) is not None


@pytest.mark.parametrize("name, gpus", [("dense-10b", 64), ("dense-1t", 512)])
def test_planned_command_line_passes_meshloom_validation(name, gpus, tmp_path):
    """The overrides the planner prints are accepted by train.check_config for that world size (no processes)."""
    from runtime.config import load_config
    from train import check_config

    e = plan(MODELS[name], gpus, 80, SEQ, BATCH)
    pairs = overrides(MODELS[name], e, SEQ) + [("run.dir", str(tmp_path / "run"))]
    layout, _ = check_config(load_config(overrides=pairs), gpus)
    dims, args = layout.dims, layout.model
    assert (dims.tp, dims.pp, dims.dp) == (e["tp"], e["pp"], e["dp"])
    assert args.num_params() == MODELS[name].num_params()
    # A pipelined layout from the --model listing validates too (pp_microbatches = m, one sequence each).
    piped = estimate(MODELS["dense-1t"], 8, 32, 2, True, SEQ, BATCH)
    check_config(load_config(overrides=overrides(MODELS["dense-1t"], piped, SEQ) + pairs[-1:]), 512)


def test_activation_checkpointing_keeps_only_the_block_input():
    """Measured bytes kept from forward for backward: none = the saved-tensor formula, full = the input alone."""
    small = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32)
    batch, seq = 2, 32
    none, selective, full = (kept_bytes(small, batch, seq, mode) for mode in ("none", "selective", "full"))
    assert none == formula_bytes(small, batch, seq)
    assert full == 4 * batch * seq * small.dim
    assert full < selective < none


def test_the_bubble_is_under_20_percent_exactly_when_m_exceeds_4_times_pp_minus_1():
    from bench.plan_layout import bubble_above_20_percent

    for pp in range(2, 65):
        for m in range(1, 300):
            bubble = (pp - 1) / (m + pp - 1)
            assert (bubble >= 0.2) == (m <= 4 * (pp - 1)) == bubble_above_20_percent({"pp": pp, "m": m}), (pp, m)
    # the old rule "m >= 4·pp" was too strict: at pp = 8, m = 29 already gives 7/36 = 19.4%
    assert not bubble_above_20_percent({"pp": 8, "m": 29})


def test_time_model_of_the_1t_layouts():
    # docs/combining.md, section 7 (arithmetic): tp 8 x pp 32 x dp 2 against tp 8 x pp 1 x dp 64
    from bench.plan_layout import time_estimate

    args = MODELS["dense-1t"]
    piped = time_estimate(args, estimate(args, 8, 32, 2, True, SEQ, BATCH), SEQ)
    flat = time_estimate(args, estimate(args, 8, 1, 64, True, SEQ, BATCH), SEQ)
    assert round(flat["compute"]) == 62 and round(flat["fsdp"]) == 147 and round(flat["tp"], 1) == 8.8
    assert round(piped["compute"]) == 67 and round(piped["fsdp"], 2) == 0.25 and round(piped["pp"], 1) == 4.1
    assert round(piped["with_bubble"]) == 76
