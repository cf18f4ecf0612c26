"""The GPU throughput check's code path on CPU with a stand-in of CUDA events (runtime/process.py: ``HostEvent``,
only ``record``, ``synchronize``, ``elapsed_time``): a step clock whose readings are events, not numbers, as on a
GPU. Before, measure/throughput.py subtracted two readings (a TypeError on CUDA) and the check never got an MFU;
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
