"""Profiling on demand, MFU and the communication share (observers/profiling.py, models/flops.py, training/mfu.py, training/comm_share.py)."""

import json

import pytest
import torch

import training.comm_share as comm_share
from launch.local_runs import DEBUG_CONFIG, ROOT, train_on
from models.flops import flops_per_token
from observers.profiling import RANGES, summarize_memory_timeline, trace_path
from planning.gpus import table_peak_tflops
from runtime.config import ConfigError, check_values, load_config, model_args
from training.mfu import Throughput, peak_tflops

MOE_CONFIG = str(ROOT / "configs" / "debug_moe.toml")

# ---- FLOPs per token, by hand ------------------------------------------------------------------------------


def test_flops_per_token_of_the_debug_model_by_hand():
    # configs/debug.toml: dim 128, 4 layers, 8 heads of 16, 4 kv heads, vocab 256, SwiGLU hidden
    # 64 * ceil(int(8 * 128 / 3) / 64) = 64 * ceil(341 / 64) = 384; sequences of 128 tokens.
    attention = 128 * 128 + 128 * 64 + 128 * 64 + 128 * 128  # wq, wk, wv, wo: 49,152
    mlp = 3 * 128 * 384  # w1, w3, w2: 147,456
    head = 128 * 256  # the output head; the embedding is a lookup and does not count
    weights = 4 * (attention + mlp) + head  # 819,200
    scores = 12 * 4 * 8 * 16 * 128  # q.k and the sum over v, forward and backward: 786,432
    cfg = load_config(path=DEBUG_CONFIG)
    assert flops_per_token(model_args(cfg), cfg.training.seq_len) == 6 * weights + scores == 5_701_632


def test_moe_flops_count_only_the_experts_a_token_uses():
    # configs/debug_moe.toml: every layer MoE, 8 experts of hidden 128, top-2, one shared expert of hidden 384
    attention = 49_152
    router = 128 * 8
    routed = 2 * 3 * 128 * 128  # top_k experts, not all 8
    shared = 3 * 128 * 384
    weights = 4 * (attention + router + routed + shared) + 128 * 256
    cfg = load_config(path=MOE_CONFIG)
    assert flops_per_token(model_args(cfg), 128) == 6 * weights + 786_432 == 8_085_504
    # all 8 experts would have counted 6 * 4 * 6 * 3 * 128 * 128 more
    assert model_args(cfg).num_params() > weights + 4 * 6 * 3 * 128 * 128


def test_peak_flops_come_from_the_config_or_the_table_and_cpus_have_none():
    assert table_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert table_peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0  # the variant, not the SXM row
    assert table_peak_tflops("NVIDIA A100-SXM4-40GB", "fp32") == 19.5
    assert table_peak_tflops("Some Future GPU", "bf16") is None
    assert peak_tflops(0.0, torch.device("cpu"), "fp32") is None
    assert peak_tflops(2.5, torch.device("cpu"), "fp32") == 2.5
    no_peak = Throughput(model_args(load_config(path=DEBUG_CONFIG)), 128, world_size=2, peak=None)
    assert set(no_peak.fields(1000.0)) == {"tflops"}
    with_peak = Throughput(model_args(load_config(path=DEBUG_CONFIG)), 128, world_size=2, peak=0.5)
    fields = with_peak.fields(1000.0)
    assert fields["tflops"] == pytest.approx(5_701_632 * 1000 / 2 / 1e12)  # per device
    assert fields["mfu"] == pytest.approx(fields["tflops"] / 0.5)


def test_a_profile_window_after_the_last_step_is_refused():
    cfg = load_config(path=DEBUG_CONFIG, overrides={"profile.enabled": True, "profile.start_step": 30})
    with pytest.raises(ConfigError, match=r"profile.start_step=30 comes after the last step \(training.steps=20\)"):
        check_values(cfg)


# ---- a profiled run: traces, ranges, collectives, metrics --------------------------------------------------

PROFILED = {
    "training.steps": 4,
    "profile.enabled": True,
    "profile.start_step": 3,
    "profile.steps": 2,
    "checkpoint.interval": 4,  # step 4 saves: the checkpoint range has real work in it
}


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fsdp2")
    records = train_on(2, {**PROFILED, "parallel.dp_shard": 2, "training.peak_tflops": 0.5}, run_dir, timeout=240)
    return run_dir, records


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tp2")
    return run_dir, train_on(2, {**PROFILED, "parallel.tp": 2, "parallel.dp_shard": 1}, run_dir, timeout=240)


def events_of(path) -> list[dict]:
    return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]


def test_a_profiled_fsdp2_run_writes_one_loadable_trace_per_rank(fsdp2_run):
    run_dir, _ = fsdp2_run
    for rank in (0, 1):
        trace = json.loads(trace_path(run_dir, rank).read_text())
        assert trace["distributedInfo"]["rank"] == rank and trace["distributedInfo"]["world_size"] == 2
        names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
        # exactly the configured steps, numbered by training step
        assert {n for n in names if n.startswith("ProfilerStep#")} == {"ProfilerStep#3", "ProfilerStep#4"}
        assert {f"meshloom::{r}" for r in RANGES if r != "pipeline schedule"} <= names
        # collectives: FSDP2's all-gather and reduce-scatter, as issued and as gloo ran them
        assert {"c10d::_allgather_base_", "c10d::_reduce_scatter_base_", "gloo:all_gather"} <= names
        assert any(n.startswith("FSDP::all_gather") for n in names)
        assert aten_ops_inside(trace["traceEvents"], "meshloom::forward") > 50  # the model's ops are in there
        # the op table (the 40 rows of most self time) lists the model's matmuls; how many of its other rows
        # are aten ops rather than ranges, collectives or the optimizer moves with timing, so only a few are
        # required (10 of 40 was seen on a busy host)
        ops = (run_dir / "profile" / f"rank{rank}.ops.txt").read_text()
        assert "aten::mm" in ops and ops.count("aten::") >= 5


def aten_ops_inside(events: list[dict], range_name: str) -> int:
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == range_name]
    return sum(1 for e in events if e.get("cat") == "cpu_op" and any(a <= e["ts"] <= b for a, b in spans))


def test_metrics_carry_tflops_and_mfu_with_a_peak(fsdp2_run, tp2_run):
    _, with_peak = fsdp2_run
    for r in with_peak:
        assert r["tflops"] == pytest.approx(5_701_632 * r["tokens_per_s"] / 2 / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops"] / 0.5)
    _, without_peak = tp2_run
    assert all("tflops" in r and "mfu" not in r for r in without_peak)  # CPU: no table, no peak given


@pytest.mark.parametrize("layout", ["fsdp2_run", "tp2_run"])
def test_comm_share_table_and_json_are_consistent(layout, request, capsys):
    run_dir, _ = request.getfixturevalue(layout)
    assert comm_share.main([str(run_dir)]) == 0
    printed = capsys.readouterr().out
    assert "exposed < 30% of step?" in printed and printed.count("\n") >= 4
    report = json.loads((run_dir / "profile" / "comm_share.json").read_text())
    assert report["rule_of_thumb_exposed_share"] == 0.30
    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["device"] == "cpu" for r in ranks)
    # one row per rank, then the compute spread across them (observers/rank_balance.py's 15% rule)
    assert [line.split()[0] for line in printed.splitlines()[2:4]] == ["0", "1"]
    compute = [r["compute_ms"] for r in ranks]
    assert report["compute_spread"] == pytest.approx(max(compute) / min(compute))
    assert f"compute across ranks: max / min {report['compute_spread']:.2f}" in printed
    for r in ranks:
        assert r["steps"] == [3, 4]
        for s in [r, *r["per_step"]]:
            # compute, exposed communication and the rest partition the step; communication is exposed + hidden
            assert s["compute_ms"] + s["exposed_ms"] + s["other_ms"] == pytest.approx(s["step_ms"], rel=1e-9)
            assert s["exposed_ms"] + s["overlapped_ms"] == pytest.approx(s["communication_ms"], rel=1e-9)
            assert 0 < s["compute_ms"] < s["step_ms"] and 0 < s["communication_ms"] < s["step_ms"]
            assert s["exposed_ms"] >= 0 and s["overlapped_ms"] >= 0 and s["other_ms"] >= 0
        assert r["exposed_share"] == pytest.approx(r["exposed_ms"] / r["step_ms"])
        assert r["under_30_percent_rule"] == (r["exposed_share"] < 0.30)


def test_the_sketch_in_the_chapter_equals_comm_share(fsdp2_run):
    # docs/profiling.md section 5: a sweep over event edges, written independently of comm_share's interval sets
    chapter = (ROOT / "docs" / "profiling.md").read_text()
    section = chapter[chapter.index("## 5. From scratch") :]
    code = section[section.index("```python") + len("```python") : section.index("```", section.index("```python") + 9)]
    namespace: dict = {}
    exec(compile(code, "docs/profiling.md", "exec"), namespace)
    run_dir, _ = fsdp2_run
    for rank in (0, 1):
        path = trace_path(run_dir, rank)
        by_hand = namespace["exposed_by_hand"](str(path))
        shares = comm_share.step_shares(comm_share.load_trace(path))
        assert [step for step, _, _ in by_hand] == [r["step"] for r in shares] == [3, 4]
        for (_, step_ms, exposed_ms), r in zip(by_hand, shares, strict=True):
            assert step_ms == pytest.approx(r["step_ms"], abs=1e-6)
            assert exposed_ms == pytest.approx(r["exposed_ms"], abs=1e-6) and exposed_ms > 0


def test_comm_share_explains_a_run_without_traces(tmp_path, capsys):
    assert comm_share.main([str(tmp_path)]) == 2
    assert "--profile.enabled true" in capsys.readouterr().err


def test_interval_arithmetic():
    a = comm_share.union([(0, 4), (2, 6), (8, 10)])
    assert a == [(0, 6), (8, 10)]
    b = [(1, 2), (5, 9)]
    assert comm_share.intersect(a, b) == [(1, 2), (5, 6), (8, 9)]
    assert comm_share.subtract(a, b) == [(0, 1), (2, 5), (9, 10)]
    assert comm_share.total(comm_share.subtract(a, b)) + comm_share.total(comm_share.intersect(a, b)) == 8


# ---- memory ---------------------------------------------------------------------------------------------


def test_cpu_memory_timeline_shows_parameters_gradients_and_adam_states(tmp_path):
    overrides = {
        **PROFILED,
        "training.steps": 2,
        "profile.start_step": 2,
        "profile.steps": 1,
        "profile.memory_snapshot": True,
        "checkpoint.interval": 0,
    }
    train_on(1, overrides, tmp_path, timeout=240)
    peaks = summarize_memory_timeline(tmp_path / "profile" / "rank0.memory_timeline.json")
    param_bytes = 4 * model_args(load_config(path=DEBUG_CONFIG)).num_params()
    # fp32, one process. The profiler infers categories from how tensors are used; it files one 4-byte scalar
    # with the parameters (measured: parameter = param_bytes + 4), so allow a few bytes, not a tensor's worth.
    assert 0 <= peaks["parameter"] - param_bytes <= 16 and 0 <= peaks["gradient"] - param_bytes <= 16
    # AdamW: exp_avg and exp_avg_sq per parameter, plus a 4-byte step counter per tensor
    assert 2 * param_bytes <= peaks["optimizer state"] <= 2 * param_bytes + 4 * 64
    assert peaks["activation"] > param_bytes  # at batch 8 x 128 tokens the activations dominate
    assert peaks["total"] >= peaks["activation"] + peaks["parameter"]


# ---- compile ------------------------------------------------------------------------------------------------


@pytest.mark.compat
def test_layouts_that_compile_pass_validation():
    from mesh.private_api import splits_compiled_backward
    from train import check_config

    layouts = [
        ({"parallel.dp_shard": 2}, 2),
        ({"parallel.pp": 2, "parallel.dp_shard": 1}, 2),
        ({"parallel.tp": 2, "parallel.dp_shard": 1}, 2),
        ({"parallel.tp": 2, "parallel.dp_shard": 1, "parallel.sequence_parallel": False}, 2),
        ({"parallel.tp": 2, "parallel.dp_shard": 1, "parallel.sp_regather": True}, 2),  # mesh/sequence_parallel.py
        ({"parallel.dp_replicate": 2, "parallel.dp_shard": 2}, 4),
        ({"parallel.dp_replicate": 2, "parallel.dp_shard": 2, "parallel.tp": 2}, 8),
        ({"parallel.tp": 2, "parallel.dp_shard": 2, "parallel.pp": 2}, 8),
        ({"parallel.cp": 2, "parallel.dp_shard": 1, "parallel.cp_attention": "ring"}, 2),
    ]
    for overrides, world in layouts:
        check_config(load_config(path=DEBUG_CONFIG, overrides={**overrides, "training.compile": True}), world)
    for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        zero_bubble = {"parallel.pp": 2, "parallel.pp_schedule": schedule, "parallel.pp_microbatches": 4}
        cfg = load_config(path=DEBUG_CONFIG, overrides={**zero_bubble, "training.compile": True})
        if splits_compiled_backward():
            check_config(cfg, 2)
        else:  # torch 2.11: refused, naming the release that lifts it
            with pytest.raises(ConfigError, match="upgrade torch to 2.13"):
                check_config(cfg, 2)
    # expert parallelism compiles (mesh/compile.py); tests/test_expert_parallel.py trains it compiled at parity
    ep2 = {"parallel.dp_shard": 2, "parallel.ep": 2, "training.compile": True}
    check_config(load_config(path=MOE_CONFIG, overrides=ep2), 2)


def test_a_torch_that_cannot_split_a_compiled_backward_refuses_compiled_zero_bubble_schedules(monkeypatch):
    """torch 2.11's weight-gradient pass fails on a compiled block's backward node (mesh/private_api.py,
    ``splits_compiled_backward``; measured: "Attribute '_input_metadata' is invalid"): the check names the field,
    the schedule, the release that lifts it and the ways out, on every torch."""
    import planning.layout_rules
    from train import check_config

    monkeypatch.setattr(planning.layout_rules, "splits_compiled_backward", lambda: False)
    overrides = {"parallel.pp": 2, "parallel.pp_schedule": "DualPipeV", "parallel.pp_microbatches": 4}
    with pytest.raises(ConfigError) as err:
        check_config(load_config(path=DEBUG_CONFIG, overrides={**overrides, "training.compile": True}), 2)
    for words in ("parallel.pp_schedule=DualPipeV", "upgrade torch to 2.13", "1F1B", "training.compile=false"):
        assert words in str(err.value)
    overrides["parallel.pp_schedule"] = "Interleaved1F1B"  # a schedule without a split backward still compiles
    check_config(load_config(path=DEBUG_CONFIG, overrides={**overrides, "training.compile": True}), 2)
