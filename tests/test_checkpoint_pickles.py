"""A checkpoint folder is data, not code (checkpoint/safe_pickle.py): crafted pickles, re-sealed so that the
manifest's checksums pass, must not run on resume, export or generate."""

import contextlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from checkpoint.safe_pickle import SafeReader
from checkpoint.verify import seal, sha256_of
from launch.local_runs import DEBUG_CONFIG


@pytest.fixture(autouse=True)
def launch_env_restored(monkeypatch):
    """An in-process run sets RANK, MASTER_PORT, ... for its world of one (runtime/process.py); put them back,
    so that a later command does not inherit this run's port."""
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


class Payload:
    """Unpickled, it makes a folder: proof that the pickle ran code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def reseal(step: Path, *changed: str) -> None:
    """What anyone who can write the folder can do: record the changed files' sizes and digests, seal again."""
    meta = json.loads((step / "meshloom.json").read_text())
    meta.pop("manifest_sha256", None)
    for name in changed:
        meta["files"][name] = {"bytes": (step / name).stat().st_size, "sha256": sha256_of(step / name)}
    (step / "meshloom.json").write_text(json.dumps(seal(meta)))


@pytest.fixture
def crafted(one_process_saving, tmp_path) -> tuple[Path, Path]:
    """A copy of the shared run's checkpoints whose step-6 .metadata runs a payload (re-sealed)."""
    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.copytree(one_process_saving.checkpoints, checkpoints)
    marker = tmp_path / "payload-ran"
    step = checkpoints / "step-6"
    (step / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    reseal(step, ".metadata")
    return checkpoints, marker


def quiet(main, args) -> tuple[int, str]:
    err = io.StringIO()  # stdout too: the resume is said there
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
        try:
            code = main(args)
        except SystemExit as exc:
            code = exc.code
    return code, err.getvalue()


@pytest.mark.compat  # DCP's metadata classes and its planner are torch's: checked on 2.11 and 2.15 too
def test_the_metadata_unpickler_admits_a_real_checkpoint_and_refuses_a_payload(one_process_saving, crafted):
    real = SafeReader(str(one_process_saving.checkpoints / "step-6")).read_metadata()
    assert len(real.state_dict_metadata) > 10
    checkpoints, marker = crafted
    with pytest.raises(pickle.UnpicklingError, match="posix.mkdir is not one of DCP's metadata types"):
        SafeReader(str(checkpoints / "step-6")).read_metadata()
    assert not marker.exists()


def test_a_crafted_metadata_does_not_run_on_export_or_generate(crafted):
    import generate
    from checkpoint import export

    checkpoints, marker = crafted
    code, err = quiet(
        export.main, ["--checkpoint", str(checkpoints / "step-6"), "--out", str(checkpoints.parent / "hf")]
    )
    assert code == 2 and "not one of DCP's metadata types" in err, err[-2000:]
    code, err = quiet(generate.main, ["--checkpoint", str(checkpoints), "--step", "6", "--prompt", "x"])
    assert code == 2 and "not one of DCP's metadata types" in err, err[-2000:]
    assert not marker.exists()


def test_a_crafted_metadata_does_not_run_on_resume_and_the_earlier_step_resumes(crafted):
    import train

    checkpoints, marker = crafted
    args = ["--config", DEBUG_CONFIG, "--run.dir", str(checkpoints.parent), "--checkpoint.resume", "auto"]
    code, err = quiet(train.main, [*args, "--training.steps", "7", "--checkpoint.interval", "0"])
    assert not marker.exists()
    assert code == 0, err[-3000:]
    assert "not one of DCP's metadata types" in err and "step-3" in err  # step-6 skipped as damaged, step-3 resumed


@pytest.mark.compat  # DCP's metadata classes and its planner are torch's: checked on 2.11 and 2.15 too
def test_a_crafted_small_value_does_not_run_on_resume(one_process_saving, tmp_path):
    """An optimizer value (a DCP bytes item) pointed at a payload in a new shard, the manifest re-sealed."""
    import train

    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.copytree(one_process_saving.checkpoints, checkpoints)
    shutil.rmtree(checkpoints / "step-3")
    step, marker = checkpoints / "step-6", tmp_path / "payload-ran"
    with open(step / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the real one, written by this test's own run
    fqn = next(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    (step / "__9_0.distcp").write_bytes(payload.getvalue())
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    info = metadata.storage_data[index]
    metadata.storage_data[index] = type(info)(relative_path="__9_0.distcp", offset=0, length=len(payload.getvalue()))
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(step, ".metadata", "__9_0.distcp")
    args = ["--config", DEBUG_CONFIG, "--run.dir", str(checkpoints.parent), "--checkpoint.resume", "6"]
    code, err = quiet(train.main, [*args, "--training.steps", "7", "--checkpoint.interval", "0"])
    assert not marker.exists()
    assert code == 2, err[-3000:]
    assert fqn in err.strip().splitlines()[-1] and "not plain data" in err, err[-3000:]
