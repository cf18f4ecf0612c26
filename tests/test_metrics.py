from launch.local_runs import read_metrics
from training.metrics import MetricsWriter


def record(step: int) -> dict:
    return {"step": step, "loss": 1.0 / step}


def test_resume_keeps_records_up_to_the_checkpoint_and_tolerates_a_torn_line(tmp_path):
    writer = MetricsWriter(str(tmp_path), enabled=True, tensorboard=False)
    for step in (1, 2, 3, 4):
        writer.log(record(step))
    writer.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # a line cut short by a killed process
    writer = MetricsWriter(str(tmp_path), enabled=True, tensorboard=False, resume_step=2)
    writer.log(record(3))
    writer.close()
    steps = [r["step"] for r in read_metrics(tmp_path)]
    assert steps == [1, 2, 3]


def test_overwrite_replaces_old_tensorboard_events(tmp_path):
    writer = MetricsWriter(str(tmp_path), enabled=True, tensorboard=True)
    writer.log(record(1))
    writer.close()
    old = set((tmp_path / "tb").iterdir())
    assert old
    writer = MetricsWriter(str(tmp_path), enabled=True, tensorboard=True)
    writer.log(record(1))
    writer.close()
    new = set((tmp_path / "tb").iterdir())
    assert new and not (old & new)


def test_resume_drops_lines_that_are_not_records_instead_of_raising(tmp_path):
    """metrics.jsonl goes through runtime/files.py's JSON reader: a hand-edited line nested past Python's own
    recursion limit (a RecursionError before) or with a step that is not a whole number is dropped like a torn one."""
    writer = MetricsWriter(str(tmp_path), enabled=True, tensorboard=False)
    for step in (1, 2):
        writer.log(record(step))
    writer.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write("[" * 100_000 + "]" * 100_000 + "\n")
        f.write('{"step": "1", "loss": 0.5}\n{"step": [1]}\n{"step": true}\n{"step": NaN}\n[1, 2]\n')
    writer = MetricsWriter(str(tmp_path), enabled=True, tensorboard=False, resume_step=2)
    writer.log(record(3))
    writer.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
