"""Checkpoints: exact continuation across layouts, atomic publish under SIGKILL, validation, HF export/import.

The continuation tests save after N=3 steps on layout A and resume for 3 more on layout B, against one
process trained 2N=6 steps (every layout matches one process: test_parity_dp, test_pipeline). N=3 lies
inside the debug config's 5 warmup steps, where the LR does not depend on training.steps, so the 3-step
run A follows the same schedule as a 6-step run up to its save.

The transformers test needs the `transformers` package, which the dev extras install; like every dev
dependency, a missing one fails the test rather than skipping it. On its own:
    .venv/bin/python -m pytest tests/test_checkpoint.py -k transformers
"""

import copy
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from checkpoint.folder import published
from checkpoint.hf import expected_hf_shapes, hf_name
from checkpoint.resume import Resume, find_resume
from launch.local_runs import DEBUG_CONFIG, ROOT, read_metrics, run_train_cli, train_on
from planning.plan import LayoutPlan
from runtime.config import ConfigError, load_config, model_args
from tests.training_runs import LOSS_RTOL, assert_same_curve
from train import check_config

N = 3  # steps before the save; the reference runs 2N


def overrides(folder, **extra) -> dict:
    return {"checkpoint.folder": str(folder), **{k.replace("__", "."): v for k, v in extra.items()}}


@pytest.fixture(scope="module")
def reference(one_process_saving):
    """One process, 2N steps, saving at N and 2N: the curve every resumed run must follow, and checkpoints
    (the session's debug-config reference, tests/conftest.py)."""
    assert len(one_process_saving.records) == 2 * N and list(published(one_process_saving.checkpoints)) == [N, 2 * N]
    return one_process_saving


def files_digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


# ---- exact continuation on another layout ------------------------------------------------------------------

FSDP4 = {"parallel.dp_shard": 4}
FSDP2_TP2 = {"parallel.dp_shard": 2, "parallel.tp": 2}
PP2_FSDP2 = {"parallel.pp": 2, "parallel.dp_shard": 2}
PP2_TP2 = {"parallel.pp": 2, "parallel.tp": 2, "parallel.dp_shard": 1}
HSDP2X2 = {"parallel.dp_replicate": 2, "parallel.dp_shard": 2}
CP2 = {"parallel.cp": 2, "parallel.dp_shard": 1, "parallel.cp_attention": "ring"}
TP2 = {"parallel.tp": 2, "parallel.dp_shard": 1}
FIVE_D = {"parallel.pp": 2, "parallel.dp_shard": 2, "parallel.cp": 2, "parallel.tp": 2}


def world(layout: dict) -> int:
    dims = ("parallel.pp", "parallel.dp_replicate", "parallel.dp_shard", "parallel.cp", "parallel.tp")
    size = 1
    for dim in dims:
        size *= layout.get(dim, 1)
    return size


@pytest.mark.parametrize(
    "before, after, saving",
    [
        # async saves every step, keep the last 2: also proves that pruning and async publishing work
        (FSDP4, FSDP2_TP2, {"checkpoint.interval": 1, "checkpoint.async": "true", "checkpoint.keep_last": 2}),
        (FSDP2_TP2, PP2_FSDP2, {"checkpoint.interval": N}),
        (PP2_TP2, {}, {"checkpoint.interval": N}),
        ({}, HSDP2X2, {"checkpoint.interval": N}),
        # context parallelism: parameters replicated over cp and FSDP-sharded over dp_shard x cp
        (CP2, TP2, {"checkpoint.interval": N}),
        pytest.param(FIVE_D, {}, {"checkpoint.interval": N}, marks=pytest.mark.slow),
    ],
    ids=["fsdp4-async-to-fsdp2xtp2", "fsdp2xtp2-to-pp2xfsdp2", "pp2xtp2-to-1", "1-to-hsdp2x2", "cp2-to-tp2", "5d-to-1"],
)
@pytest.mark.compat
def test_resume_on_another_layout_continues_the_same_run(before, after, saving, reference, tmp_path):
    ref, _ = reference
    folder = tmp_path / "ckpt"
    first = train_on(
        world(before), {**before, **saving, **overrides(folder), "training.steps": N}, tmp_path / "a", timeout=600
    )
    assert_same_curve(first, ref[:N])
    if saving["checkpoint.interval"] == 1:  # keep_last 2 removed step-1; nothing temporary is left behind
        assert sorted(p.name for p in folder.iterdir() if p.name != ".meshloom.lock") == ["step-2", "step-3"]
    resumed = train_on(world(after), {**after, **overrides(folder, checkpoint__resume="auto")}, tmp_path / "b")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    # loss and grad norm within the fp32 parity tolerance, and the data position continues (tokens_consumed)
    assert_same_curve(resumed, ref[N:])
    assert resumed[0]["tokens_consumed"] == (N + 1) * 8 * 128
    for r, e in zip(resumed, ref[N:], strict=True):
        assert r["lr"] == pytest.approx(e["lr"], rel=1e-12), "the LR schedule must resume at its position"


# ---- the command line ------------------------------------------------------------------------------------


def run_cli(nproc: int, *args: str, env=None) -> subprocess.CompletedProcess:
    proc = run_train_cli(nproc, "--config", DEBUG_CONFIG, "--run.tensorboard", "false", *args, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_cli_saves_on_fsdp2_and_resumes_auto_on_one_process(reference, tmp_path):
    ref, _ = reference
    common = ["--checkpoint.folder", str(tmp_path / "ckpt"), "--run.dir", str(tmp_path / "run")]
    run_cli(2, "--parallel.dp_shard", "2", "--training.steps", str(N), "--checkpoint.interval", str(N), *common)
    proc = run_cli(1, "--training.steps", str(2 * N), "--checkpoint.resume", "auto", *common)
    assert f"resumed {tmp_path / 'ckpt' / f'step-{N}'} at step {N}" in proc.stdout
    # Same run.dir: the resumed run appends to metrics.jsonl, which then holds the whole 2N-step curve.
    records = read_metrics(tmp_path / "run")
    assert_same_curve(records, ref)


# ---- a process killed while saving --------------------------------------------------------------------------


def test_killed_during_a_save_leaves_the_previous_checkpoint_to_resume(reference, tmp_path):
    ref, _ = reference
    run_dir, folder = tmp_path / "run", tmp_path / "run" / "checkpoints"
    cmd = [
        sys.executable,
        "tests/pause_before_publish.py",  # train.py, pausing rank 0 just before it publishes a checkpoint
        "--config",
        DEBUG_CONFIG,
        "--run.tensorboard",
        "false",
        "--run.dir",
        str(run_dir),
        "--training.steps",
        str(2 * N),
        "--checkpoint.interval",
        str(N),
    ]
    # The wrapper pauses rank 0 after step 2N is fully written into step-6.tmp, just before the rename.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PAUSE_BEFORE_PUBLISH": f"{2 * N}:300"}
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while "pausing" not in log.read_text():  # printed once step 6 is fully written, before the rename
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
        finally:
            proc.send_signal(signal.SIGKILL)  # mid-save on success; a hung or failed run on the way out
            proc.wait(timeout=60)
    assert (folder / f"step-{2 * N}.tmp" / "meshloom.json").is_file(), "killed inside the save, after the writes"
    assert list(published(folder)) == [N], "the interrupted save must not be published"
    cfg = load_config(path=DEBUG_CONFIG, overrides={"run.dir": str(run_dir), "checkpoint.resume": "auto"})
    assert find_resume(cfg, LayoutPlan.resolve(cfg, 1)).newest == folder / f"step-{N}"
    # Resume in the same run.dir: the metrics continue, the leftover step-6.tmp is replaced by a real step-6.
    resumed = train_on(1, {"checkpoint.resume": "auto", "checkpoint.interval": N}, run_dir)
    assert_same_curve(resumed, ref[N:])
    assert list(published(folder)) == [N, 2 * N] and not (folder / f"step-{2 * N}.tmp").exists()
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert steps == list(range(1, 2 * N + 1)), "the killed run's steps after the checkpoint are replaced, not doubled"


# ---- validation before any collective ------------------------------------------------------------------------


def check(tmp_path, folder, **extra):
    cfg = load_config(path=DEBUG_CONFIG, overrides={"run.dir": str(tmp_path / "run"), **overrides(folder, **extra)})
    return check_config(cfg, 1)


def test_a_checkpoint_of_another_model_shape_names_the_difference(reference, tmp_path):
    _, folder = reference
    with pytest.raises(ConfigError) as err:
        check(tmp_path, folder, checkpoint__resume="auto", model__dim=256, model__n_layers=2)
    message = str(err.value)
    assert "model.dim: checkpoint 128, config 256" in message and "model.n_layers: checkpoint 4, config 2" in message


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"training__seq_len": 64}, ["saved with training.seq_len=128, this run has training.seq_len=64"]),
        ({"training__steps": 6}, ["training.steps=6 but checkpoint", "already at step 6", "raise --training.steps"]),
    ],
    ids=["other-token-stream", "nothing-left-to-train"],
)
def test_a_resume_that_cannot_continue_the_run_is_refused(extra, words, reference, tmp_path):
    _, folder = reference
    with pytest.raises(ConfigError) as err:
        check(tmp_path, folder, checkpoint__resume="auto", **extra)
    for word in words:
        assert word in str(err.value)


def flip_bits(path: Path, offset: int = 4096, count: int = 4096) -> None:
    """Flip every bit of ``count`` bytes in the middle of a file (same size, different content)."""
    data = bytearray(path.read_bytes())
    start = min(offset, len(data) - count)
    data[start : start + count] = bytes(b ^ 0xFF for b in data[start : start + count])
    path.write_bytes(bytes(data))


def flip_n_layers(step_dir: Path) -> None:
    """One digit of the manifest's [model] section changed (n_layers 4 -> 5): still valid JSON, and it would
    read as a checkpoint of another model, contradicting the config, if the manifest had no checksum."""
    text = (step_dir / "meshloom.json").read_text()
    assert text.count('"n_layers": 4,') == 1
    (step_dir / "meshloom.json").write_text(text.replace('"n_layers": 4,', '"n_layers": 5,'))


def relabel(step_dir: Path, step: int) -> None:
    """A copied step folder renamed as ``step``: its manifest says so, with a matching checksum."""
    from checkpoint.verify import seal

    meta = json.loads((step_dir / "meshloom.json").read_text())
    (step_dir / "meshloom.json").write_text(json.dumps(seal({**meta, "step": step})))


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda d: (d / "meshloom.json").unlink(), ["meshloom.json is missing"]),
        (lambda d: (d / "meshloom.json").write_text("{not json"), ["meshloom.json is not valid JSON"]),
        (lambda d: (d / ".metadata").unlink(), [".metadata is missing"]),
        (lambda d: (d / ".metadata").write_bytes(b"garbage"), [".metadata has 7 bytes, the manifest says"]),
        (lambda d: flip_bits(d / ".metadata", 64, 16), [".metadata does not match its checksum"]),
        (lambda d: (d / "__0_0.distcp").unlink(), ["__0_0.distcp is missing"]),
        (lambda d: os.truncate(d / "__0_0.distcp", 1000), ["__0_0.distcp has 1000 bytes, the manifest says"]),
        (flip_n_layers, ["meshloom.json does not match its checksum (damaged: its fields changed after the save)"]),
    ],
    ids=[
        "no-meta",
        "bad-json",
        "no-dcp-metadata",
        "bad-dcp-metadata",
        "flipped-dcp-metadata",
        "no-data",
        "truncated-data",
        "flipped-manifest-field",
    ],
)
def test_a_partial_or_corrupt_checkpoint_fails_clearly(damage, words, reference, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(reference[1], folder)
    damage(folder / f"step-{2 * N}")
    with pytest.raises(ConfigError) as err:
        check(tmp_path, folder, checkpoint__resume=str(2 * N))
    assert f"step-{2 * N} is damaged or incomplete" in str(err.value)
    for word in words:
        assert word in str(err.value)
    # `auto` takes the newest whole checkpoint, and marks the damaged one to be moved aside at start (so
    # that this run's own save of that step cannot collide with it).
    cfg = load_config(
        path=DEBUG_CONFIG, overrides={"run.dir": str(tmp_path), **overrides(folder, checkpoint__resume="auto")}
    )
    resume = find_resume(cfg, LayoutPlan.resolve(cfg, 1))
    assert resume.newest == folder / f"step-{N}" and resume.damaged == [folder / f"step-{2 * N}"]
    check(tmp_path, folder, checkpoint__resume="auto", checkpoint__interval=N)


def test_a_crafted_metadata_pickle_is_never_unpickled(reference, tmp_path):
    """A newer step whose .metadata is a pickle that runs code: its checksum fails first, so it never runs."""
    import pickle

    folder = tmp_path / "ckpt"
    shutil.copytree(reference[1], folder)
    crafted = folder / f"step-{3 * N}"
    shutil.copytree(folder / f"step-{2 * N}", crafted)
    relabel(crafted, 3 * N)
    meta = json.loads((crafted / "meshloom.json").read_text())
    marker = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    payload = pickle.dumps(Payload())
    (crafted / ".metadata").write_bytes(payload + b"\0" * (meta["files"][".metadata"]["bytes"] - len(payload)))
    for resume in ("auto", str(3 * N)):
        cfg = load_config(
            path=DEBUG_CONFIG, overrides={"run.dir": str(tmp_path), **overrides(folder, checkpoint__resume=resume)}
        )
        try:
            found = find_resume(cfg, LayoutPlan.resolve(cfg, 1))
            assert found.newest == folder / f"step-{2 * N}" and found.damaged == [crafted]
        except ConfigError as err:
            assert resume != "auto" and "does not match its checksum" in str(err)
    assert not marker.exists(), "the crafted pickle was unpickled"


def test_a_flipped_shard_is_caught_and_auto_falls_back_to_the_previous_step(reference, tmp_path):
    """4 KiB flipped inside a shard (same size): found by the ranks' hashing after start, before any load."""
    ref, source = reference
    folder = tmp_path / "ckpt"
    shutil.copytree(source, folder)
    shards = sorted((folder / f"step-{2 * N}").glob("*.distcp"))
    flip_bits(shards[0])
    # resume auto on 2 ranks, to step 7: step-6 is damaged, so the run continues from step-3 and replays
    # 4..6 exactly (the LR of steps <= 6 does not depend on training.steps: warmup, then the cosine's start).
    layout = {"parallel.dp_shard": 2, "training.steps": 2 * N + 1}
    resumed = train_on(
        2, {**layout, **overrides(folder, checkpoint__resume="auto", checkpoint__interval=N)}, tmp_path / "run"
    )
    assert [r["step"] for r in resumed] == [4, 5, 6, 7]
    assert_same_curve(resumed[:N], ref[N:])
    assert (folder / f"step-{2 * N}.damaged").is_dir(), "the damaged step is kept aside, not deleted"
    assert list(published(folder)) == [N, 2 * N, 2 * N + 1]  # this run saved a good step-6 of its own
    # An explicit step refuses it, naming the file.
    shutil.rmtree(folder)
    shutil.copytree(source, folder)
    flip_bits(sorted((folder / f"step-{2 * N}").glob("*.distcp"))[0])
    proc = run_train_cli(
        1,
        "--config",
        DEBUG_CONFIG,
        "--run.dir",
        str(tmp_path / "explicit"),
        "--checkpoint.folder",
        str(folder),
        "--checkpoint.resume",
        str(2 * N),
        "--training.steps",
        str(3 * N),
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"step-{2 * N} is damaged: {shards[0].name} does not match its checksum" in proc.stderr


def test_a_run_never_saves_over_existing_checkpoints(reference, tmp_path):
    _, folder = reference
    before = {name: files_digest(folder / name) for name in ("step-3", "step-6")}
    # Starting fresh, or from an older step, would write steps that the folder already holds.
    for resume in ("none", str(N)):
        with pytest.raises(ConfigError, match="already holds step"):
            check(tmp_path, folder, checkpoint__resume=resume, checkpoint__interval=N)
    check(tmp_path, folder, checkpoint__resume=str(N))  # interval 0: never saves, so resuming an old step is fine
    assert {name: files_digest(folder / name) for name in before} == before


def save_the_same_step_twice(folder: str) -> list[str]:
    """Rank body: save step 1, change the weights, save step 1 again; then publish onto a published folder."""
    import torch.distributed as dist  # noqa: F401 - the harness initialised the process group

    from checkpoint.manager import CheckpointManager
    from data.loader import GlobalBatchLoader
    from planning.plan import LayoutPlan
    from runtime.process import init_process_group
    from training.optimizer import Optimizers

    cfg = load_config(path=DEBUG_CONFIG, overrides={"checkpoint.folder": folder, "checkpoint.interval": 1})
    part = torch.nn.Linear(4, 4)
    optimizers = Optimizers([part], cfg)
    loader = GlobalBatchLoader(torch.arange(2000) % 256, seq_len=8, global_batch=2, micro_batch=2, dp_rank=0, dp_size=1)
    control = init_process_group(torch.device("cpu"), 60)
    manager = CheckpointManager(cfg, LayoutPlan.resolve(cfg, 1), Resume("none"), control)
    manager.restore([part], optimizers, loader)
    manager.maybe_save(1, [part], optimizers, loader)
    digest = files_digest(Path(folder) / "step-1")
    with torch.no_grad():
        part.weight.add_(1.0)
    outcomes = []
    manager.maybe_save(1, [part], optimizers, loader)  # the same run saving the same step again: a no-op
    assert files_digest(Path(folder) / "step-1") == digest
    manager.last_saved = None  # as if another run had written step-1
    try:
        manager.maybe_save(1, [part], optimizers, loader)
    except FileExistsError as exc:
        outcomes.append(str(exc))
    # Even a publish that got that far cannot replace it: rename() onto a non-empty folder fails.
    tmp = Path(folder) / "step-1.tmp"
    tmp.mkdir()
    try:
        manager._publish(tmp, Path(folder) / "step-1", {"step": 1})
    except OSError as exc:
        outcomes.append(type(exc).__name__)
    assert files_digest(Path(folder) / "step-1") == digest
    return outcomes


def test_saving_an_existing_step_does_not_clobber_it(tmp_path):
    from launch.spawn import run_on_ranks

    [outcomes] = run_on_ranks(save_the_same_step_twice, 1, str(tmp_path / "ckpt"), timeout=120)
    assert "never overwrites" in outcomes[0] and outcomes[1] == "OSError"


def async_saving_linear(folder: str, width: int):
    """(part, optimizers, loader, manager) on one rank: a Linear saved asynchronously after every step."""
    from checkpoint.manager import CheckpointManager
    from data.loader import GlobalBatchLoader
    from planning.plan import LayoutPlan
    from runtime.process import init_process_group
    from training.optimizer import Optimizers

    overrides = {"checkpoint.folder": folder, "checkpoint.interval": 1, "checkpoint.async": True}
    cfg = load_config(path=DEBUG_CONFIG, overrides=overrides)
    part = torch.nn.Linear(width, width)
    optimizers = Optimizers([part], cfg)
    loader = GlobalBatchLoader(torch.arange(2000) % 256, seq_len=8, global_batch=2, micro_batch=2, dp_rank=0, dp_size=1)
    control = init_process_group(torch.device("cpu"), 60)
    manager = CheckpointManager(cfg, LayoutPlan.resolve(cfg, 1), Resume("none"), control, torch.device("cpu"))
    manager.restore([part], optimizers, loader)
    return part, optimizers, loader, manager


def async_save_then_change_the_weights(folder: str, wait: bool) -> bool:
    """Rank body: an async save of step 1 whose copy starts late, then (after wait_staged, if ``wait``) an
    in-place change of every weight, as the optimizer step makes; returns whether the checkpoint holds step 1."""
    import threading
    import time
    from concurrent.futures import Future

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager

    from checkpoint.manager import staging_options

    class LateStager(DefaultStager):
        """DefaultStager whose copy starts 0.5 s late, so a step that does not wait for it changes the save."""

        def stage(self, state_dict, **kwargs):
            staged: Future = Future()

            def later():
                time.sleep(0.5)
                try:
                    staged.set_result(DefaultStager.stage(self, state_dict, **kwargs).result())
                except Exception as exc:  # noqa: BLE001 - handed to the waiter
                    staged.set_exception(exc)

            threading.Thread(target=later, daemon=True).start()
            return staged

    part, optimizers, loader, manager = async_saving_linear(folder, 64)
    manager.new_stager = lambda: LateStager(staging_options(torch.device("cpu")))
    saved = part.weight.detach().clone()
    manager.maybe_save(1, [part], optimizers, loader)
    if wait:
        manager.wait_staged()
    with torch.no_grad():
        part.weight.add_(1.0)
    manager.finish()
    manager.close()
    on_disk = {"model.weight": torch.empty_like(saved)}
    dcp.load(on_disk, checkpoint_id=str(Path(folder) / "step-1"), process_group=manager.group)
    return torch.equal(on_disk["model.weight"], saved)


@pytest.mark.compat
def test_an_async_save_holds_its_step_when_the_optimizer_waits_for_the_copy(tmp_path):
    from launch.spawn import run_on_ranks

    assert run_on_ranks(async_save_then_change_the_weights, 1, str(tmp_path / "wait"), True, timeout=120) == [True]
    # ... and the wait is what makes it hold: without it the step's change reaches the checkpoint
    assert run_on_ranks(async_save_then_change_the_weights, 1, str(tmp_path / "no"), False, timeout=120) == [False]


def three_async_saves_in_a_row(folder: str) -> list[bool]:
    """Rank body: async saves after steps 1, 2 and 3, the weights changed after each copy; returns, per step,
    whether its checkpoint holds that step's weights. (torch 2.11's stager cannot stage twice: the second
    save failed with ``KeyError: <class 'type'>`` while one stager served the whole run.)"""
    import torch.distributed.checkpoint as dcp

    part, optimizers, loader, manager = async_saving_linear(folder, 16)
    expected = {}
    for step in (1, 2, 3):
        expected[step] = part.weight.detach().clone()
        manager.maybe_save(step, [part], optimizers, loader)
        manager.wait_staged()
        with torch.no_grad():
            part.weight.add_(1.0)  # the next step's update, after the copy
    manager.finish()
    manager.close()
    held = []
    for step, weight in expected.items():
        on_disk = {"model.weight": torch.empty_like(weight)}
        dcp.load(on_disk, checkpoint_id=str(Path(folder) / f"step-{step}"), process_group=manager.group)
        held.append(torch.equal(on_disk["model.weight"], weight))
    return held


@pytest.mark.compat
def test_three_async_saves_in_a_row_each_hold_their_step(tmp_path):
    from launch.spawn import run_on_ranks

    assert run_on_ranks(three_async_saves_in_a_row, 1, str(tmp_path / "ckpt"), timeout=120) == [[True, True, True]]


def test_async_saves_stage_in_a_thread_and_through_pinned_memory_on_a_gpu():
    from checkpoint.manager import staging_options

    cpu, gpu = staging_options(torch.device("cpu")), staging_options(torch.device("cuda", 0))
    assert cpu.use_async_staging and not cpu.use_pinned_memory and not cpu.use_non_blocking_copy
    assert gpu.use_async_staging and gpu.use_pinned_memory and gpu.use_non_blocking_copy
    assert not cpu.use_shared_memory and not gpu.use_shared_memory  # the writer is a thread, not a process


def test_config_accepts_checkpoint_async_and_checks_resume(tmp_path):
    assert load_config(["--checkpoint.async", "true"]).checkpoint.async_ is True
    toml = tmp_path / "c.toml"
    toml.write_text("[checkpoint]\nasync = true\nresume = 12\n")
    cfg = load_config(path=str(toml))
    assert cfg.checkpoint.async_ is True and cfg.checkpoint.resume == "12"
    with pytest.raises(ConfigError, match="auto, none or a step number"):
        check(tmp_path, tmp_path / "ckpt", checkpoint__resume="latest")


# ---- safetensors with Hugging Face names ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(reference, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    cmd = [sys.executable, "-m", "checkpoint.export", "--checkpoint", str(reference[1]), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"step-{2 * N}" in proc.stdout  # the newest checkpoint of the folder
    return out


def our_model(path: Path):
    """meshloom's single-device model holding the exported weights (mapped back from HF names)."""
    from safetensors.torch import load_file

    from models.llama import Transformer

    cfg = load_config(path=DEBUG_CONFIG)
    with torch.device("meta"):
        model = Transformer(model_args(cfg))
    model.init_weights(0)
    tensors = load_file(str(path / "model.safetensors"))
    model.load_state_dict({name: tensors[hf_name(name)] for name in model.state_dict()})
    return model, cfg


def test_export_has_hugging_face_names_shapes_and_config(exported):
    from safetensors.torch import load_file

    cfg = load_config(path=DEBUG_CONFIG)
    tensors = load_file(str(exported / "model.safetensors"))
    assert {k: v.shape for k, v in tensors.items()} == expected_hf_shapes(model_args(cfg))
    for name in (
        "model.embed_tokens.weight",
        "model.layers.3.self_attn.q_proj.weight",
        "model.norm.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "lm_head.weight",
    ):
        assert name in tensors
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is False
    # every file with the mode the umask gives (safetensors alone would make its file 0600)
    umask = os.umask(0)
    os.umask(umask)
    for file in ("model.safetensors", "config.json"):
        assert (exported / file).stat().st_mode & 0o777 == 0o666 & ~umask, file
    assert (config["hidden_size"], config["intermediate_size"], config["num_key_value_heads"]) == (128, 384, 4)


def test_transformers_llama_gives_our_logits(exported):
    import transformers

    theirs = transformers.LlamaForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    ours, _ = our_model(exported)
    tokens = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(tokens), theirs(tokens).logits
    # The same fp32 ops in the same order (measured: identical); a q/k permutation bug would be O(1).
    assert (a - b).abs().max().item() <= 1e-4 * a.abs().max().item()


def test_importing_the_export_under_another_layout_reproduces_its_loss(exported, reference, tmp_path):
    from data.corpus import load_corpus

    model, cfg = our_model(exported)
    t = cfg.training
    tokens = load_corpus(cfg.data.source, cfg.data.max_bytes).long()
    batch = torch.stack([tokens[j * t.seq_len :][: t.seq_len + 1] for j in range(t.global_batch)])  # step 1's batch
    with torch.no_grad():
        expected = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).item()
    init = {"checkpoint.init_from": str(exported / "model.safetensors"), "training.steps": 1}
    [record] = train_on(4, {**FSDP2_TP2, **init}, tmp_path)
    assert abs(record["loss"] - expected) <= LOSS_RTOL * expected
    assert expected < reference[0][0]["loss"] - 0.1, "the trained weights, not the random init, were used"


# ---- MoE: expert weights and the expert bias reshard to another ep -----------------------------------------


def test_moe_resume_on_another_expert_parallel_degree(shared_runs, tmp_path):
    moe = str(ROOT / "configs" / "debug_moe.toml")
    bias = {"model.moe_bias_update_rate": 0.01}  # the expert bias is training state too: it must be saved
    ref = shared_runs.records(bias, config=moe)
    folder = tmp_path / "ckpt"
    before = {**bias, "parallel.dp_shard": 2, "parallel.ep": 2, "checkpoint.interval": N, "training.steps": N}
    first = train_on(2, {**before, **overrides(folder)}, tmp_path / "a", config=moe)
    assert_same_curve(first, ref[:N])
    after = {**bias, "parallel.dp_shard": 4, "parallel.ep": 4, **overrides(folder, checkpoint__resume="auto")}
    resumed = train_on(4, after, tmp_path / "b", config=moe)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert_same_curve(resumed, ref[N:])
    assert [r["expert_load"] for r in resumed] == [r["expert_load"] for r in ref[N:]]


@pytest.mark.compat
def test_moe_resume_from_ep_over_tp_into_ep_over_cp(shared_runs, tmp_path):
    """Saved where ep 4 borrows dp_shard 2 x tp 2 (one expert per rank), resumed where ep 2 borrows the cp
    ranks (dp_shard 2 x cp 2, efsdp 2: half of two experts per rank); the curve goes on as if uninterrupted."""
    moe = str(ROOT / "configs" / "debug_moe.toml")
    # 4 experts (ep 4 on 4 ranks); dropless with no aux loss, which cp needs; the bias is training state too
    knobs = {"model.n_experts": 4, "model.moe_aux_loss_coef": 0.0, "model.moe_bias_update_rate": 0.01}
    ref = shared_runs.records(knobs, config=moe)
    folder = tmp_path / "ckpt"
    before = {**knobs, "parallel.dp_shard": 2, "parallel.tp": 2, "parallel.ep": 4}
    first = train_on(
        4, {**before, "checkpoint.interval": N, "training.steps": N, **overrides(folder)}, tmp_path / "a", config=moe
    )
    assert_same_curve(first, ref[:N])
    after = {**knobs, "parallel.dp_shard": 2, "parallel.cp": 2, "parallel.ep": 2}
    resumed = train_on(4, {**after, **overrides(folder, checkpoint__resume="auto")}, tmp_path / "b", config=moe)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    # fp32, DCP moves exact values between the layouts; the default 1e-5 as for every uninterrupted layout
    assert_same_curve(resumed, ref[N:])
    assert [r["expert_load"] for r in resumed] == [r["expert_load"] for r in ref[N:]]


# ---- the learning rate after a resume -------------------------------------------------------------------------


def test_after_a_restore_every_optimizer_takes_the_schedule_of_the_run_resumed_into():
    """20 steps saved, restored into a 40-step run: every param group of every part's AdamW gets the 40-step
    schedule's LR at step 20, not the 20-step schedule's (its floor) that the optimizer state carries."""
    from checkpoint.state import apply_training_state, training_state
    from data.loader import GlobalBatchLoader
    from training.optimizer import Optimizers, lr_factor

    torch.manual_seed(0)
    parts = [torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))]
    loader = GlobalBatchLoader(torch.arange(2000) % 256, seq_len=8, global_batch=2, micro_batch=2, dp_rank=0, dp_size=1)
    short = Optimizers(parts, load_config(path=DEBUG_CONFIG, overrides={"training.steps": 20}))
    for _ in range(20):
        for part in parts:
            part(torch.ones(2, 4)).sum().backward()
        short.step()
    saved = copy.deepcopy(training_state(parts, short, loader, step=20))  # the live tensors, as a save copies them
    cfg = load_config(path=DEBUG_CONFIG, overrides={"training.steps": 40})
    longer = Optimizers(parts, cfg)
    apply_training_state(saved, parts, longer, loader)
    t = cfg.training
    expected = t.lr * lr_factor(20, t.warmup_steps, 40, t.min_lr_ratio)
    assert short.lr == pytest.approx(t.lr * t.min_lr_ratio), "the 20-step schedule ended at its floor"
    groups = [group for optimizer in longer.optimizers for group in optimizer.param_groups]
    assert len(groups) == 4 and all(group["lr"] == pytest.approx(expected, rel=1e-12) for group in groups)
    assert longer.lr == pytest.approx(expected, rel=1e-12)


def test_a_run_resumed_with_more_steps_logs_its_own_schedule_from_the_first_step(reference, tmp_path):
    """The README's real-data walk, in small: a 6-step run saved at step 6, resumed with training.steps 8."""
    from training.optimizer import lr_factor

    ref, source = reference
    folder = tmp_path / "ckpt"
    shutil.copytree(source, folder)
    longer = 2 * N + 2
    resumed = train_on(1, {**overrides(folder, checkpoint__resume="auto"), "training.steps": longer}, tmp_path / "run")
    t = load_config(path=DEBUG_CONFIG).training
    assert [r["step"] for r in resumed] == [2 * N + 1, 2 * N + 2]
    # the LR logged at step s is the one step s applies: the schedule after s - 1 steps, of the 8-step run
    expected = [t.lr * lr_factor(r["step"] - 1, t.warmup_steps, longer, t.min_lr_ratio) for r in resumed]
    assert [r["lr"] for r in resumed] == pytest.approx(expected, rel=1e-12)
    assert resumed[0]["lr"] > 5 * t.lr * t.min_lr_ratio, "not the 6-step schedule's floor the checkpoint stored"


# ---- the tokenizer, by content ------------------------------------------------------------------------------


def test_a_tokenizer_changed_under_the_same_path_is_refused_by_resume_and_generate(tmp_path, capsys):
    """Another tokenizer.json of the same vocabulary size, copied over the one a run was trained with: the
    path and the size still fit, the token ids do not. Resume and generate compare the SHA-256 the
    checkpoint recorded, and name both."""
    import generate
    from data.tokenizers import load_tokenizer
    from tests.bpe import tiny_bpe

    trained, other = tiny_bpe(tmp_path / "a", n_files=30), tiny_bpe(tmp_path / "b", n_files=10)
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    shutil.copyfile(trained, path)
    folder = tmp_path / "ckpt"
    text = {"data.tokenizer": str(path), "model.vocab_size": 512, "data.max_bytes": 200_000}
    train_on(1, {**text, **overrides(folder, checkpoint__interval=2), "training.steps": 2}, tmp_path / "run")
    shutil.copyfile(other, path)
    before, after = load_tokenizer(str(trained)), load_tokenizer(str(path))
    assert before.vocab_size == after.vocab_size and before.sha256 != after.sha256
    with pytest.raises(ConfigError) as err:
        check(
            tmp_path,
            folder,
            checkpoint__resume="auto",
            training__steps=4,
            **{k.replace(".", "__"): v for k, v in text.items()},
        )
    message = str(err.value)
    assert before.sha256 in message and after.sha256 in message and "other token ids" in message
    assert generate.main(["--checkpoint", str(folder), "--prompt", "def ", "--max-new-tokens", "2"]) == 2
    err_text = capsys.readouterr().err
    assert before.sha256[:12] in err_text and after.sha256[:12] in err_text and "Traceback" not in err_text


# ---- the token stream, by content ---------------------------------------------------------------------------


def test_a_dataset_prepared_again_under_the_same_path_is_refused_naming_both_digests(tmp_path, capsys):
    """Another text prepared into the same folder: the path, the tokenizer and the size may all fit, the
    tokens do not. The header's tokens_sha256 (written while preparing) is recorded by the checkpoint and
    compared on resume; data.allow_stream_change true resumes anyway, saying the position is reinterpreted."""
    from checkpoint.resume import check_stream_content
    from data.prepare import prepare
    from data.token_file import HEADER, read_header

    data = tmp_path / "data"
    prepare(str(ROOT / "train.py"), "bytes", str(data), workers=1, quiet=True)
    first = read_header(data)["tokens_sha256"]
    folder = tmp_path / "ckpt"
    train_on(
        1,
        {"data.source": str(data), **overrides(folder, checkpoint__interval=2), "training.steps": 2},
        tmp_path / "run",
    )
    saved = json.loads((folder / "step-2" / "meshloom.json").read_text())["data"]
    assert saved["tokens_sha256"] == first and saved["val_tokens_sha256"] is None
    shutil.rmtree(data)
    prepare(str(ROOT / "generate.py"), "bytes", str(data), workers=1, quiet=True)
    second = read_header(data)["tokens_sha256"]
    assert second != first
    again = dict(checkpoint__resume="auto", training__steps=4, data__source=str(data))
    with pytest.raises(ConfigError) as err:
        check(tmp_path, folder, **again)
    message = str(err.value)
    assert f"data.source={str(data)!r} with tokens_sha256 {first}" in message and f"tokens_sha256 {second}" in message
    assert "tokens_consumed=2,048" in message and "new --run.dir" in message
    assert "--data.allow_stream_change true" in message
    capsys.readouterr()
    check(tmp_path, folder, data__allow_stream_change=True, **again)
    assert "the position is reinterpreted in the new stream" in capsys.readouterr().err
    # A header without a digest (an older data.prepare) is another stream too; a checkpoint without one (an
    # older meshloom) is compared by path only, with a warning.
    header = json.loads((data / HEADER).read_text())
    (data / HEADER).write_text(json.dumps({k: v for k, v in header.items() if k != "tokens_sha256"}))
    with pytest.raises(ConfigError, match="no tokens_sha256"):
        check(tmp_path, folder, **again)
    (data / HEADER).write_text(json.dumps(header))
    cfg = load_config(path=DEBUG_CONFIG, overrides={"data.source": str(data), "run.dir": str(tmp_path / "run")})
    check_stream_content(folder / "step-2", {}, cfg, 2048)
    assert "recorded no content digest of its token stream" in capsys.readouterr().err


# ---- a raw text source, by content and by data.max_bytes ----------------------------------------------------


def test_raw_text_resumes_only_on_the_same_bytes_and_the_same_validation_split(tmp_path):
    """A raw text source is read up to data.max_bytes and its last data.val_fraction is held out: another
    max_bytes, or other text under the same path, moves both the data position and the validation split
    (held-out tokens would become training data). The checkpoint records max_bytes, the SHA-256 of the bytes
    read and the size of each split; a real resume (python train.py) refuses either change with exit 2, naming
    the field, both values and the fix. The same bytes under a larger max_bytes are the same stream."""
    text = tmp_path / "corpus.txt"
    text.write_bytes((ROOT / "train.py").read_bytes()[:12_000])
    folder, run_dir = tmp_path / "ckpt", tmp_path / "run"
    common = ["--data.source", str(text), "--data.val_fraction", "0.1", "--training.seq_len", "64"]
    common += ["--training.global_batch", "4", "--checkpoint.folder", str(folder), "--run.dir", str(run_dir)]
    run_cli(1, *common, "--data.max_bytes", "10000", "--training.steps", "2", "--checkpoint.interval", "2")
    saved = json.loads((folder / "step-2" / "meshloom.json").read_text())["data"]
    assert saved["max_bytes"] == 10_000 and saved["val_tokens"] == 1_000 and saved["train_tokens"] == 9_000
    assert saved["raw_sha256"] and saved["val_raw_sha256"] is None

    resume = [*common, "--training.steps", "4", "--checkpoint.resume", "auto"]
    moved = run_train_cli(1, "--config", DEBUG_CONFIG, *resume, "--data.max_bytes", "8000", timeout=300)
    assert moved.returncode == 2, moved.stdout[-2000:] + moved.stderr[-2000:]
    message = moved.stderr.strip().splitlines()[-1]
    assert "data.max_bytes=10000, this run has data.max_bytes=8000" in message
    assert "validation split" in message and "become training data" in message
    assert "--data.max_bytes 10000" in message and "Traceback" not in moved.stderr

    text.write_bytes((ROOT / "generate.py").read_bytes()[:12_000])  # other text under the same path
    other = run_train_cli(1, "--config", DEBUG_CONFIG, *resume, "--data.max_bytes", "10000", timeout=300)
    assert other.returncode == 2, other.stdout[-2000:] + other.stderr[-2000:]
    message = other.stderr.strip().splitlines()[-1]
    assert saved["raw_sha256"] in message and "the text under that path changed" in message
    assert "--data.allow_stream_change true" in message and "Traceback" not in other.stderr

    # The very bytes that were read, as the whole file: any data.max_bytes >= 10,000 reads the same stream.
    text.write_bytes((ROOT / "train.py").read_bytes()[:10_000])
    extra = dict(data__source=str(text), data__val_fraction=0.1, training__seq_len=64, training__global_batch=4)
    check(tmp_path, folder, checkpoint__resume="auto", training__steps=4, data__max_bytes=50_000, **extra)


# ---- unreadable checkpoints (run as a user without root's override of file permissions) ---------------------


def unreadable_checkpoints(source: Path, folder: Path) -> None:
    """A copy of the reference folder (step-3, step-6) where step-6 has a shard nobody may read, plus a
    step-9 (a copy of step-6 relabelled) whose folder nobody may read."""
    shutil.copytree(source, folder)
    newest = folder / f"step-{3 * N}"
    shutil.copytree(folder / f"step-{2 * N}", newest)
    relabel(newest, 3 * N)
    (folder / f"step-{2 * N}" / "__0_0.distcp").chmod(0)
    newest.chmod(0)


def without_override() -> list[str]:
    from launch.local_runs import unprivileged

    prefix = unprivileged([])
    if prefix is None:
        pytest.skip("this process runs as root and cannot drop its override of file permissions (no setpriv)")
    return prefix


def test_unreadable_checkpoints_are_damaged_and_every_rank_falls_back(reference, tmp_path):
    """An unreadable step folder (found before any process group) and an unreadable shard (found while the
    ranks hash their shares) are damaged checkpoints: named with their reason, skipped on every rank under
    resume auto, moved aside; the run resumes from step-3 on the reference curve. An explicit step that
    cannot be read is refused with exit 2."""
    ref, source = reference
    prefix = without_override()
    folder = tmp_path / "ckpt"
    unreadable_checkpoints(source, folder)
    common = ["--config", DEBUG_CONFIG, "--run.tensorboard", "false", "--checkpoint.folder", str(folder)]
    explicit = run_train_cli(
        1, *common, "--checkpoint.resume", str(3 * N), "--run.dir", str(tmp_path / "x"), prefix=prefix, timeout=120
    )
    assert explicit.returncode == 2, explicit.stderr[-3000:]
    assert f"checkpoint {folder / f'step-{3 * N}'} is damaged or incomplete" in explicit.stderr
    assert "cannot be read (permission denied)" in explicit.stderr and "Traceback" not in explicit.stderr
    run_dir = tmp_path / "run"
    proc = run_train_cli(
        2,
        *common,
        "--parallel.dp_shard",
        "2",
        "--checkpoint.resume",
        "auto",
        "--checkpoint.interval",
        str(N),
        "--training.steps",
        str(2 * N + 1),
        "--run.dir",
        str(run_dir),
        prefix=prefix,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    assert f"skips {folder / f'step-{3 * N}'}, which is damaged or incomplete" in proc.stderr
    assert f"step-{2 * N} is damaged: __0_0.distcp cannot be read (permission denied)" in proc.stderr
    assert f"resumed {folder / f'step-{N}'} at step {N}" in proc.stdout
    assert (folder / f"step-{3 * N}.damaged").is_dir() and (folder / f"step-{2 * N}.damaged").is_dir()
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [4, 5, 6, 7]
    assert_same_curve(records[:N], ref[N:])


@pytest.mark.slow
def test_an_unreadable_shard_of_an_explicit_step_stops_every_rank_with_exit_2(reference, tmp_path):
    prefix = without_override()
    folder = tmp_path / "ckpt"
    unreadable_checkpoints(reference[1], folder)
    proc = run_train_cli(
        2,
        "--config",
        DEBUG_CONFIG,
        "--parallel.dp_shard",
        "2",
        "--checkpoint.folder",
        str(folder),
        "--checkpoint.resume",
        str(2 * N),
        "--training.steps",
        str(2 * N + 1),
        "--run.dir",
        str(tmp_path / "run"),
        prefix=prefix,
        timeout=240,
    )
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)
    assert codes and set(codes) == {"2"}, proc.stderr[-4000:]
    assert proc.stderr.count("__0_0.distcp cannot be read (permission denied)") >= 2  # each rank says it


def test_a_damaged_step_that_cannot_be_moved_aside_is_said_and_left(tmp_path, monkeypatch):
    from checkpoint.folder import move_aside

    step = tmp_path / "step-6"
    step.mkdir()

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", str(src))

    monkeypatch.setattr(os, "rename", refuse)
    said = move_aside(step)
    assert f"could not move the damaged checkpoint {step} aside (permission denied)" in said
    assert step.is_dir()
    monkeypatch.undo()
    assert "aside to step-6.damaged" in move_aside(step) and (tmp_path / "step-6.damaged").is_dir()
