"""An export replaces its folder whole (checkpoint/export.py, step 6), and a mixed folder is refused on load."""

import shutil

import pytest

from checkpoint import export
from checkpoint.hf_folder import INDEX, SINGLE, weight_files
from runtime.config import ConfigError


def export_to(checkpoints, out, *extra: str) -> int:
    return export.main(["--checkpoint", str(checkpoints), "--out", str(out), *extra])


def test_an_overwrite_of_a_sharded_export_leaves_no_file_of_it(one_process_saving, tmp_path, capsys):
    checkpoints, out = one_process_saving.checkpoints, tmp_path / "hf"
    assert export_to(checkpoints, out, "--max-shard-size", "40KB") == 0
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and (out / INDEX).is_file() and not (out / SINGLE).exists()
    assert export_to(checkpoints, out, "--overwrite") == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", SINGLE]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no partial or old folder left beside it
    assert set(weight_files(out).values()) == {out / SINGLE}


def test_an_overwrite_refuses_a_folder_that_holds_more_than_an_export(tmp_path, capsys):
    out = tmp_path / "mixed"
    (out / "notes").mkdir(parents=True)
    (out / "model.safetensors").write_text("an earlier export")
    assert export_to(tmp_path / "none", out, "--overwrite") == 2
    assert "holds more than an export (notes)" in capsys.readouterr().err
    assert (out / "notes").is_dir() and (out / "model.safetensors").is_file()


def test_a_failed_export_leaves_the_earlier_one_whole(one_process_saving, tmp_path, monkeypatch, capsys):
    checkpoints, out = one_process_saving.checkpoints, tmp_path / "hf"
    assert export_to(checkpoints, out, "--max-shard-size", "40KB") == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "export_safetensors", full_disk)
    assert export_to(checkpoints, out, "--overwrite") == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_folder_whose_index_and_single_file_disagree_is_refused(one_process_saving, tmp_path, capsys):
    checkpoints, sharded, single = one_process_saving.checkpoints, tmp_path / "sharded", tmp_path / "single"
    assert export_to(checkpoints, sharded, "--max-shard-size", "40KB") == 0
    assert export_to(checkpoints, single) == 0
    for shard in [*sharded.glob("model-*.safetensors"), sharded / INDEX]:
        shutil.copy(shard, single / shard.name)  # what an overwrite in place used to leave
    with pytest.raises(ConfigError, match="holds both"):
        weight_files(single)
    import generate

    assert generate.main(["--checkpoint", str(single), "--prompt", "x", "--max-new-tokens", "1"]) == 2
    assert "holds both" in capsys.readouterr().err
