"""The GPU throughput check's code path on CPU with a stand-in of CUDA events (runtime/process.py: ``HostEvent``,
only ``record``, ``synchronize``, ``elapsed_time``): a step clock whose readings are events, not numbers, as on a
GPU. Before, measure/tokens_per_second.py subtracted two readings (a TypeError on CUDA) and the check never got an MFU;
and tokens/s is timed from one step's end to the next's (the whole loop, as torchtitan times it)."""

import math

import pytest

from runtime.process import HostEvent, seconds_between


def test_the_stand_in_has_only_the_cuda_event_api_and_times_in_milliseconds():
    start, end = HostEvent(enable_timing=True), HostEvent(enable_timing=True)
    start.record()
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0 and seconds_between(start, end) == pytest.approx(start.elapsed_time(end) / 1e3)
    with pytest.raises(TypeError):  # a CUDA event has no arithmetic either
        end - start  # noqa: B018


def test_the_throughput_check_measures_a_finite_mfu_with_event_readings():
    from measure.gpu_check import throughput_1b

    # the CPU's made-up peak of 1,000 TFLOP/s only makes an MFU exist: its value means nothing here
    result = throughput_1b(smoke=True, event=HostEvent, peak_tflops=1000.0)
    assert set(result["runs"]) >= {"plain (autocast bf16)", "meshloom bf16, no AC", "meshloom bf16, selective AC"}
    for run in result["runs"].values():
        assert math.isfinite(run["mfu"]) and 0 < run["mfu"] < 1
        assert math.isfinite(run["tokens_per_s"]) and run["tokens_per_s"] > 0
    assert "MFU" in result["summary"]


def test_tokens_per_s_is_timed_between_consecutive_steps_and_the_window_apart(tmp_path):
    # one process, 4 steps, every step logged: a step's tokens_per_s runs from the previous step's end to its own
    # end (the loop's whole iteration, torchtitan's way), so it is at most the window's
    from launch.local_runs import run_training
    from launch.spawn import run_on_ranks

    records = run_on_ranks(run_training, 1, {"training.steps": 4, "model.n_layers": 1}, str(tmp_path))[0]
    for r in records:
        assert 0 < r["tokens_per_s"] <= r["window_tokens_per_s"]
    assert any(r["tokens_per_s"] < r["window_tokens_per_s"] for r in records[1:])  # the loop's own time counts


def test_a_micro_batch_goes_to_the_device_through_the_same_call_on_cpu():
    # training/loaders.py: to_device pins and copies non-blocking on CUDA; on CPU the same call is the tensor
    import torch

    from training.loaders import to_device

    x, y = torch.arange(6).view(2, 3), torch.ones(2, 3, dtype=torch.long)
    a, b = to_device((x, y), torch.device("cpu"))
    assert a is x and b is y


def test_the_compile_table_shows_compile_cost_recompiles_and_a_refused_layouts_reason(capsys):
    """``tokens_per_second --compile``'s table from made-up rounds (no training): a compiled row's ratio is against
    the same layout eagerly, ``1st +s`` is its first step less a steady one, ``recomp`` the frames compiled after
    the first step; a layout meshloom refuses to compile keeps its row, with the reason."""
    from types import SimpleNamespace

    from measure.tokens_per_second import SHAPE, print_table

    def rounds(first: float, steady: float, frames: list | None) -> list[dict]:
        return [
            {
                "full_s": [first] + [steady] * 5,
                "cpu_s": [steady] * 6,
                "window_tokens_per_s": [],
                "loss": [1.0] * 6,
                "peak_mem_bytes": 0,
                "compiled_frames": frames or [None] * 6,
            }
        ]

    results = {
        "one-ac": rounds(1.5, 1.0, None),
        "tp2": rounds(1.5, 1.0, None),
        "one-ac+compile": rounds(31.0, 0.8, [40, 40, 40, 41, 41, 41]),
        "tp2+compile": [],
    }
    runs = [(name, {}) for name in results]
    args = SimpleNamespace(warmup=2, peak_tflops=0.0, compile=True, rounds=1, steps=6)
    print_table(results, runs, SHAPE, args, refused={"tp2+compile": "training.compile=true with parallel.tp=2: why"})
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("layout"))
    assert header.split()[-3:] == ["1st", "+s", "recomp"]
    compiled = next(line for line in lines if line.startswith("one-ac+compile"))
    assert " one-ac  1.250" in compiled and compiled.split()[-2:] == ["30.2", "1"]
    eager = next(line for line in lines if line.startswith("one-ac "))
    assert eager.split()[-2:] == ["0.5", "-"]
    refused = next(line for line in lines if line.startswith("tp2+compile"))
    assert "refused by meshloom: training.compile=true with parallel.tp=2: why" in refused
