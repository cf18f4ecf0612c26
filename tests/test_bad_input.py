"""The bad-input matrix: every case a new user or an operator hit, refused in seconds with the field and the fix.

Each case runs ``train.main`` in this process or the real command (``python train.py ...``, or torchrun
where ranks matter) and asserts: a non-zero exit, in seconds; no traceback, the message last; and the words
that name the field (or file) and the fix. ``CONFIG_ERRORS`` is the one table of configuration and layout rules (each tested once, in this
process); the rules of one feature live beside it (test_pipeline.py, test_context_parallel.py,
test_savers.py), as do bad data files (test_prepare.py) and damaged checkpoints (test_checkpoint.py). Two
cases are repeated under torchrun here, to check that every worker exits with code 2.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch.local_runs import DEBUG_CONFIG, ROOT, run_train_cli

MARK = "meshloom: configuration error"


def messages(stderr: str) -> list[str]:
    """Each configuration-error paragraph: its first line and the indented rule lines that follow it."""
    found, lines = [], stderr.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(MARK):
            rest = lines[i + 1 :]
            rules = []
            for rule in rest:
                if not rule.startswith("  - "):
                    break
                rules.append(rule)
            found.append("\n".join([line, *rules]))
    return found


def refused(tmp_path, *args, nproc: int = 1, config: str | None = DEBUG_CONFIG, prefix=None) -> str:
    """Run train.py with ``args`` (after ``prefix``: setpriv); assert the refusal's shape; return the message."""
    pre = ["--config", config] if config else []
    proc = run_train_cli(nproc, *pre, "--run.dir", str(tmp_path / "run"), *args, timeout=120, prefix=prefix)
    assert proc.returncode != 0, proc.stdout[-2000:]  # a hang meets the timeout; seconds move with the load
    found = messages(proc.stderr)
    assert found, proc.stderr[-3000:]
    if nproc == 1:
        assert proc.returncode == 2
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        # the message is the last thing printed
        assert proc.stderr.rstrip().endswith(found[-1].splitlines()[-1]), proc.stderr[-2000:]
    else:
        # torchrun itself exits 1, but reports each worker's own exit code: 2 from every one of them
        codes = re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)
        assert codes and set(codes) == {"2"}, proc.stderr[-3000:]
        assert len({m.splitlines()[0] for m in found}) == 1  # every worker printed the same message
        assert "Traceback" not in proc.stderr.split(MARK)[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    return found[0]


def toml(tmp_path, text: str) -> str:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    return str(path)


class TransformersFolder:
    """In CONFIG_ERRORS: a folder whose config.json transformers wrote for debug.toml's model shape, with
    ``fields`` changed; made in the test's tmp_path (``resolve``). No weights: the refusal comes first."""

    def __init__(self, **fields):
        self.fields = fields

    def make(self, tmp_path: Path) -> str:
        import json

        import transformers

        shape = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=8)
        config = transformers.LlamaConfig(**shape, num_key_value_heads=4, vocab_size=256, rms_norm_eps=1e-5)
        folder = tmp_path / "hf"
        config.save_pretrained(str(folder))
        written = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**written, **self.fields}))
        return str(folder)


class SymlinkLoop:
    """In CONFIG_ERRORS: a symbolic link that points at itself, made in the test's tmp_path."""

    def make(self, tmp_path: Path) -> str:
        loop = tmp_path / "loop"
        loop.symlink_to(loop.name)
        return str(loop)


class TokenFolder:
    """In CONFIG_ERRORS: a folder prepared with the byte tokenizer whose header's fields are then changed
    (``max_id`` beyond debug.toml's vocabulary of 256, as a damaged or foreign header would say)."""

    def __init__(self, **header):
        self.header = header

    def make(self, tmp_path: Path) -> str:
        import json

        from data.prepare import prepare

        (tmp_path / "text.txt").write_text("def f(x):\n    return x + 1\n" * 200)
        folder = tmp_path / "tokens"
        prepare(str(tmp_path / "text.txt"), "bytes", str(folder), workers=1, quiet=True)
        header = json.loads((folder / "header.json").read_text())
        (folder / "header.json").write_text(json.dumps({**header, **self.header}))
        return str(folder)


def resolve(args: list, tmp_path: Path) -> list[str]:
    return [a.make(tmp_path) if hasattr(a, "make") else a for a in args]


def init_from(**fields) -> list:
    return ["--checkpoint.init_from", TransformersFolder(**fields)]


# The one table of configuration errors: every rule that a config or a layout can break, once each.
# (case id, world size, command-line arguments, words the message must contain: the field, the value, the fix)
CONFIG_ERRORS = [
    # reading the command line and the file (runtime/config.py: parse_overrides, _set)
    ("unknown_key", 1, ["--training.stepz", "3"], ["unknown config key 'training.stepz'", "steps"]),
    ("unknown_section", 1, ["--trainin.steps", "3"], ["unknown config key 'trainin.steps'", "section"]),
    ("key_twice", 1, ["--training.steps", "3", "--training.steps", "4"], ["--training.steps is given twice"]),
    ("missing_value", 1, ["--training.steps"], ["--training.steps needs a value"]),
    ("no_dashes", 1, ["steps=3"], ["unexpected argument 'steps=3'", "--section.key"]),
    ("not_an_int", 1, ["--training.steps", "three"], ["training.steps='three' is not a valid int", "e.g. 8"]),
    (
        "bad_choice",
        1,
        ["--training.mixed_precision", "fp16"],
        ["training.mixed_precision='fp16' is not allowed", "bf16"],
    ),
    ("no_config_file", 1, ["--config", "no/such.toml"], ["--config 'no/such.toml': no such file", "TOML"]),
    # one field against its declared range (runtime/config.py: check_values)
    ("norm_eps", 1, ["--model.norm_eps", "-1"], ["model.norm_eps=-1.0 must be > 0", "default is 1e-05"]),
    ("rope_theta", 1, ["--model.rope_theta", "0"], ["model.rope_theta=0.0 must be > 0"]),
    ("n_heads_0", 1, ["--model.n_heads", "0"], ["model.n_heads=0 must be >= 1"]),
    ("shared_experts", 1, ["--model.moe_shared_experts", "2"], ["model.moe_shared_experts=2 must be >= 0 and <= 1"]),
    ("beta1", 1, ["--training.beta1", "2"], ["training.beta1=2.0 must be >= 0 and < 1", "default is 0.9"]),
    ("weight_decay", 1, ["--training.weight_decay", "-5"], ["training.weight_decay=-5.0 must be >= 0"]),
    ("lr_negative", 1, ["--training.lr", "-1"], ["training.lr=-1.0 must be > 0"]),
    ("lr_inf", 1, ["--training.lr", "inf"], ["training.lr=inf must be a finite number"]),
    ("grad_clip_nan", 1, ["--training.grad_clip", "nan"], ["training.grad_clip=nan must be a finite number"]),
    ("global_batch_0", 1, ["--training.global_batch", "0"], ["training.global_batch=0 must be >= 1"]),
    ("max_bytes_0", 1, ["--data.max_bytes", "0"], ["data.max_bytes=0 must be >= 1"]),
    ("log_every_0", 1, ["--run.log_every", "0"], ["run.log_every=0 must be >= 1"]),
    ("check_replicas", 1, ["--debug.check_replicas", "-1"], ["debug.check_replicas=-1 must be >= 0", "default is 100"]),
    (
        "check_replicas_action",
        1,
        ["--debug.check_replicas_action", "abort"],
        ["debug.check_replicas_action='abort' is not allowed", "stop, warn"],
    ),
    ("timeout_0", 1, ["--parallel.collective_timeout_s", "0"], ["parallel.collective_timeout_s=0 must be >= 1"]),
    # folders and files the config names (runtime/run_dir.py: refuse_symlink_loop; data/token_file.py:
    # check_header_ids); damaged token files, checkpoints and manifests live in test_prepare.py and test_checkpoint.py
    (
        "checkpoint_folder_symlink_loop",
        1,
        ["--checkpoint.interval", "2", "--checkpoint.folder", SymlinkLoop()],
        ["is a symlink loop", "point --checkpoint.folder at a real folder"],
    ),
    (
        "token_ids_beyond_vocab",
        1,
        ["--data.source", TokenFolder(max_id=300)],
        ["holds token ids up to 300 (header.json max_id), but model.vocab_size=256", "--model.vocab_size 301"],
    ),
    # several fields together, no layout involved (runtime/config.py: check_values)
    (
        "rotary_pairs",
        1,
        ["--model.dim", "120", "--model.n_heads", "8", "--model.n_kv_heads", "8"],
        ["model.dim / model.n_heads = 15 must be even (rotary embeddings rotate pairs)"],
    ),
    ("eval_without_split", 1, ["--eval.interval", "5"], ["eval.interval=5 needs a validation split"]),
    # RoPE scaling from scratch (runtime/config.py: _convert, check_values; models/rope.py)
    (
        "rope_longrope",
        1,
        ["--model.rope_scaling", "longrope"],
        ["model.rope_scaling='longrope' is not allowed", "none, linear, llama3, yarn"],
    ),
    (
        "rope_llama3_bands",
        1,
        ["--model.rope_scaling", "llama3", "--model.rope_low_freq_factor", "4"],
        ["model.rope_low_freq_factor=4.0 must be < model.rope_high_freq_factor=4.0"],
    ),
    # a transformers folder as checkpoint.init_from (checkpoint/hf_folder.py: unsupported, folder_model)
    ("hf_attention_bias", 1, init_from(attention_bias=True), ["attention_bias=True", "supports only False"]),
    ("hf_mlp_bias", 1, init_from(mlp_bias=True), ["mlp_bias=True", "supports only False", "Llama-family decoders"]),
    ("hf_sliding_window", 1, init_from(sliding_window=4096), ["sliding_window=4096", "full attention"]),
    (
        "hf_sliding_window_binds",
        1,
        init_from(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=64),
        ["sliding window of 64 tokens", "training.seq_len=128 is longer", "set training.seq_len <= 64"],
    ),
    ("hf_moe", 1, init_from(num_local_experts=8), ["num_local_experts=8 describes MoE layers", "mixtral"]),
    ("hf_qk_norm", 1, init_from(use_qk_norm=True), ["use_qk_norm=True", "supports only False"]),
    ("hf_head_dim", 1, init_from(head_dim=15), ["head_dim=15", "an even number of channels"]),
    ("hf_hidden_act", 1, init_from(hidden_act="gelu"), ["hidden_act='gelu'", "supports only 'silu'"]),
    (
        "hf_model_type",
        1,
        init_from(model_type="gemma", architectures=["GemmaForCausalLM"]),
        ["model_type='gemma'", "architectures=['GemmaForCausalLM']", "Qwen2ForCausalLM (model_type 'qwen2')"],
    ),
    (
        "hf_rope_longrope",
        1,
        init_from(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}),
        ["RoPE type 'longrope' is not supported", "default (none), linear, llama3, yarn"],
    ),
    (
        "hf_flag_disagrees",
        1,
        ["--model.rope_theta", "500000", *init_from()],
        ["model.rope_theta=500000.0 was given, but", "config.json says 10000.0", "drop --model.rope_theta"],
    ),
    # the layout against the world, the model and the batch (planning/layout_rules.py: layout_errors)
    (
        "world_product",
        4,
        ["--parallel.dp_shard", "3"],
        ["pp*dp_replicate*dp_shard*tp = 1*1*3*1 = 3 but WORLD_SIZE=4", "make the product equal"],
    ),
    (
        "dp_shard_rest",
        4,
        ["--parallel.dp_replicate", "3"],
        ["parallel.dp_shard=-1 cannot fill the world", "WORLD_SIZE=4"],
    ),
    (
        "tp_heads",
        3,
        ["--parallel.tp", "3", "--parallel.dp_shard", "1"],
        ["parallel.tp=3 does not divide model.n_heads=8", "parallel.tp=3 does not divide model.n_kv_heads=4"],
    ),
    (
        "every_rule_at_once",
        6,
        ["--parallel.dp_shard", "6", "--training.global_batch", "8", "--training.seq_len", "4096"],
        ["training.global_batch=8 is not divisible", "training.seq_len=4096 exceeds model.max_seq_len"],
    ),
    (
        "micro_batch",
        2,
        ["--parallel.dp_shard", "2", "--training.micro_batch", "3"],
        ["training.micro_batch=3 does not divide the per-rank batch 4"],
    ),
    ("ep_without_experts", 2, ["--parallel.ep", "2", "--parallel.dp_shard", "2"], ["parallel.ep=2 needs an MoE model"]),
    ("sp_regather_without_tp", 1, ["--parallel.sp_regather", "true"], ["parallel.sp_regather=true re-gathers"]),
    # 1-bit Adam where it cannot apply (planning/layout_rules.py: onebit_adam_errors); AdamW is meshloom's only
    # optimizer, so "not an Adam" cannot arise
    ("onebit_warmup_0", 1, ["--parallel.onebit_warmup_steps", "0"], ["parallel.onebit_warmup_steps=0 must be >= 1"]),
    (
        "onebit_one_rank",
        1,
        ["--parallel.grad_compression", "onebit_adam"],
        ["parallel.grad_compression=onebit_adam compresses the data-parallel gradient reduction", "has none"],
    ),
    (
        "onebit_sharded_states",
        2,
        ["--parallel.grad_compression", "onebit_adam", "--parallel.dp_shard", "2"],
        ["parallel.dp_shard=2 shards the parameters and Adam states with FSDP", "parallel.dp_shard=1"],
    ),
    (
        "onebit_tp",
        4,
        ["--parallel.grad_compression", "onebit_adam", "--parallel.dp_replicate", "2", "--parallel.tp", "2"],
        ["onebit_adam", "parallel.tp=2 splits the model across ranks", "set parallel.tp=1"],
    ),
    (
        "onebit_pp",
        4,
        ["--parallel.grad_compression", "onebit_adam", "--parallel.dp_replicate", "2", "--parallel.pp", "2"],
        ["onebit_adam", "parallel.pp=2 splits the model across ranks", "set parallel.pp=1"],
    ),
    (
        "onebit_bf16",
        2,
        ["--parallel.grad_compression", "onebit_adam", "--parallel.dp_replicate", "2"]
        + ["--training.mixed_precision", "bf16"],
        ["onebit_adam with training.mixed_precision=bf16", "set training.mixed_precision=fp32"],
    ),
    # the layout against the machine's memory (planning/layout_rules.py: check_memory; a 64 GiB machine, mocked)
    (
        "model_cannot_fit",
        2,
        ["--model.dim", "1000000", "--model.n_layers", "200", "--parallel.dp_shard", "2"],
        ["does not fit in memory: model.dim=1000000, model.n_layers=200", "Would fit: model.dim=", "memory_check"],
    ),
]

# What one rank may use in the in-process cases: a machine with 64 GiB (runtime/process.py: memory_per_rank is
# mocked, so that no case depends on the memory of the machine the tests run on).
TEST_MACHINE = (64 * 2**30, "of a 64 GiB test machine")


@pytest.mark.parametrize("world, args, words", [c[1:] for c in CONFIG_ERRORS], ids=[c[0] for c in CONFIG_ERRORS])
def test_a_bad_setting_is_refused_naming_the_field_and_the_fix(world, args, words, tmp_path, capsys, monkeypatch):
    # train.main in this process, as rank 0 of a world of ``world`` (no process group: every rule is checked
    # before one exists); the subprocess cases below cover the real command. Exit 2, the message last.
    from train import main

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr("train.memory_per_rank", lambda device: TEST_MACHINE)
    config = [] if "--config" in args else ["--config", DEBUG_CONFIG]
    code = main([*config, "--run.dir", str(tmp_path / "run"), *resolve(args, tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    (message,) = messages(err)
    assert err.rstrip().endswith(message.splitlines()[-1])
    for word in words:
        assert word in message, message
    assert not (tmp_path / "run").exists()


def test_the_memory_check_refuses_only_a_clear_excess_and_its_suggestions_fit(tmp_path, monkeypatch):
    """planning/layout_rules.py: check_memory against a mocked machine. The margin: an estimate up to 1.5x what a
    rank may use is let through, more is refused. What the refusal proposes fits by the same estimate (the
    model sizes are checked here; a larger FSDP degree also needs a larger global batch). run.memory_check
    false lets anything through."""
    from planning.layout_rules import MEMORY_MARGIN, peak_rank_memory
    from runtime.config import ConfigError, load_config
    from train import check_config

    def config(**overrides):
        base = {"run.dir": str(tmp_path / "run"), "model.n_heads": 16, "model.n_kv_heads": 4}
        return load_config(path=DEBUG_CONFIG, overrides={**base, **overrides})

    def machine(limit: float):
        monkeypatch.setattr("train.memory_per_rank", lambda device: (int(limit), "of a test machine"))

    wide = {"model.dim": 2048, "model.n_layers": 24}
    plan, _ = check_config(config(**wide, **{"run.memory_check": False}), 1)
    need = peak_rank_memory(plan.model, plan.layout, plan.stage_layers, None).total
    assert need > 12 * plan.model.num_params(), "at least the states (16 bytes a parameter, fp32 Adam)"
    machine(need / MEMORY_MARGIN * 1.01)
    check_config(config(**wide), 1)  # within the margin: left to try
    machine(need / MEMORY_MARGIN * 0.99)
    with pytest.raises(ConfigError) as err:
        check_config(config(**wide), 1)
    message = str(err.value)
    assert "does not fit in memory: model.dim=2048, model.n_layers=24, model.vocab_size=256" in message
    layers = int(re.search(r"model.n_layers=(\d+) on this layout", message).group(1))
    assert 1 <= layers < 24
    machine(need / MEMORY_MARGIN * 0.99 / MEMORY_MARGIN)  # the suggestion fits without the margin's help
    check_config(config(**{**wide, "model.n_layers": layers}), 1)
    with pytest.raises(ConfigError):
        check_config(config(**{**wide, "model.n_layers": layers + 1}), 1)  # and it is the most that does
    # The case: no depth of this width fits anywhere; a width is proposed, and it fits.
    machine(64 * 2**30)
    with pytest.raises(ConfigError) as err:
        check_config(config(**{"model.dim": 1_000_000, "model.n_layers": 200}), 1)
    width = int(re.search(r"model.dim=(\d+) with these 200 layers", str(err.value)).group(1))
    machine(64 * 2**30 / MEMORY_MARGIN)
    check_config(config(**{"model.dim": width, "model.n_layers": 200}), 1)
    check_config(config(**{"model.dim": 1_000_000, "model.n_layers": 200, "run.memory_check": False}), 1)


def test_a_bad_setting_on_the_real_command_line(tmp_path):
    assert "model.norm_eps=-1.0 must be > 0" in refused(tmp_path, "--model.norm_eps", "-1")


def test_a_string_in_toml_is_not_coerced(tmp_path):
    message = refused(tmp_path, config=toml(tmp_path, '[training]\nsteps = "3"\n'))
    assert "training.steps='3' is a string in the TOML file but must be a int; write it without quotes" in message


def refused_here(tmp_path, capsys, *args: str, config: str = DEBUG_CONFIG) -> str:
    """train.main in this process (world of one); asserts exit 2 with the message last; returns it."""
    from train import main

    code = main(["--config", config, "--run.dir", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    (message,) = messages(err)
    assert err.rstrip().endswith(message.splitlines()[-1]) and "Traceback" not in err
    return message


@pytest.mark.parametrize(
    "text, words, not_words",
    [
        ('[training]\nlr = "fast"\n', ["training.lr='fast' is not a valid float", "e.g. 0.5"], ["without quotes"]),
        ('[training]\nlr = "0.1"\n', ["training.lr='0.1' is a string", "write it without quotes"], []),
        ('[run]\ntensorboard = "True"\n', ["run.tensorboard='True' is not a valid bool"], ["without quotes"]),
        ("[trainig]\n", ["unknown section [trainig]", "the sections are model, parallel, training"], []),
    ],
    ids=["quoted-word", "quoted-number", "quoted-python-bool", "empty-unknown-section"],
)
def test_toml_mistakes_get_the_advice_that_fits(text, words, not_words, tmp_path, capsys):
    message = refused_here(tmp_path, capsys, config=toml(tmp_path, text))
    for word in words:
        assert word in message
    for word in not_words:
        assert word not in message


def test_a_device_or_a_fifo_as_source_is_not_a_regular_file(tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for source, kind in (("/dev/zero", "a character device"), (str(fifo), "a FIFO (named pipe)")):
        for field in ("data.source", "data.val_source"):
            message = refused_here(tmp_path, capsys, f"--{field}", source)
            assert (
                f"{field}={source!r} is not a regular file: it is {kind}" in message and "does not exist" not in message
            )


def test_a_binary_source_is_refused(tmp_path):
    noise = tmp_path / "noise.bin"
    noise.write_bytes(os.urandom(64 * 1024))
    message = refused(tmp_path, "--data.source", str(noise))
    assert f"data.source={str(noise)!r} is not a text file" in message and "point it at text" in message


def test_a_data_folder_skips_hidden_and_binary_files_and_says_so(tmp_path):
    folder = tmp_path / "data"
    (folder / ".git").mkdir(parents=True)
    (folder / ".git" / "objects").write_bytes(os.urandom(4096))
    (folder / "a.txt").write_text("hello world " * 500)
    (folder / "lib.so").write_bytes(b"\x7fELF\0\0" + os.urandom(4096))
    proc = run_train_cli(
        1,
        "--config",
        DEBUG_CONFIG,
        "--data.source",
        str(folder),
        "--training.steps",
        "1",
        "--run.dir",
        str(tmp_path / "run"),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "reading 1 text files; skipped 1 hidden entries and 1 files that are not text" in proc.stderr
    # and a folder with nothing readable is refused
    (folder / "a.txt").unlink()
    message = refused(tmp_path / "second", "--data.source", str(folder))
    assert "is a folder with no text files (1 hidden and 1 non-text entries skipped)" in message


def test_an_unwritable_checkpoint_folder_is_refused_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    message = refused(tmp_path, "--checkpoint.interval", "2", "--checkpoint.folder", str(blocker / "ckpt"))
    assert f"checkpoint.folder={str(blocker / 'ckpt')!r} cannot be written" in message
    assert "--checkpoint.interval 0" in message


def test_a_symlink_loop_as_a_folder_is_refused_naming_the_loop(tmp_path, capsys):
    """A link that points at itself (or two that point at each other): mkdir says "File exists", which names
    no cause; the refusal says "symlink loop"."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop.name)
    message = refused(tmp_path, "--checkpoint.interval", "2", "--checkpoint.folder", str(loop))
    assert f"checkpoint.folder={str(loop)!r} is a symlink loop" in message and "File exists" not in message
    assert "point --checkpoint.folder at a real folder" in message
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    from train import main

    assert main(["--config", DEBUG_CONFIG, "--run.dir", str(tmp_path / "a" / "run")]) == 2
    (message,) = messages(capsys.readouterr().err)
    assert f"run.dir={str(tmp_path / 'a' / 'run')!r} is a symlink loop" in message and "File exists" not in message


def test_a_read_only_checkpoint_folder_is_refused_naming_the_permission(tmp_path):
    from launch.local_runs import unprivileged

    prefix = unprivileged([])
    if prefix is None:
        pytest.skip("this process runs as root and cannot drop its override of file permissions (no setpriv)")
    folder = tmp_path / "ckpt"
    folder.mkdir(mode=0o555)
    message = refused(tmp_path, "--checkpoint.interval", "2", "--checkpoint.folder", str(folder), prefix=prefix)
    assert f"checkpoint.folder={str(folder)!r} cannot be written (Permission denied)" in message
    assert "free space" not in message.lower() and "--checkpoint.interval 0" in message


def test_a_second_run_on_folders_in_use_is_refused_by_every_rank_before_any_process_group(tmp_path, capsys):
    """Another live run holds the lock (this test process plays it, runtime/run_dir.py: RunLock). Under
    torchrun every worker looks at the lock itself and exits 2 before the process group starts: none of
    them needs rank 0's word on the control plane ("reported by rank 0")."""
    from runtime.run_dir import RunLock

    held = RunLock(tmp_path / "run").acquire()
    try:
        message = refused(tmp_path, nproc=2)
    finally:
        held.release()
    assert f"run.dir={str(tmp_path / 'run')!r} is in use by another live run (pid {os.getpid()}" in message
    assert "reported by rank" not in message and "--run.dir" in message
    # A run whose checkpoint.folder is another live run's: named as the checkpoint folder, with its fix.
    folder = tmp_path / "other-run" / "checkpoints"
    held = RunLock(folder, "checkpoint.folder").acquire()
    try:
        message = refused_here(tmp_path, capsys, "--checkpoint.folder", str(folder), "--checkpoint.interval", "2")
    finally:
        held.release()
    assert f"checkpoint.folder={str(folder)!r} is in use by another live run" in message
    assert "pass another --checkpoint.folder" in message and "run.dir=" not in message


def test_a_checkpoint_folder_without_room_is_refused_before_training(tmp_path, monkeypatch):
    """The free space is mocked, so the test checks meshloom's rule and not the disk it runs on; the rule is
    checked in-process (check_config), and its ConfigError ends the command with exit 2 like every case above."""
    import collections
    import shutil

    from runtime.config import ConfigError, load_config
    from train import check_config

    # configs/debug.toml by hand: 4 blocks x (attention 128*128*2 + 128*64*2, feed-forward 3*128*384, two norms
    # 2*128) + embedding and head 2*256*128 + final norm 128 = 853,120 parameters; one checkpoint holds 12 bytes
    # per parameter (fp32 weights + AdamW's two moments) plus 1 MiB for the rest: 11,286,016 bytes.
    need = 12 * (4 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 384 + 2 * 128) + 2 * 256 * 128 + 128) + 2**20
    assert need == 11_286_016
    folder = tmp_path / "ckpt"
    asked = []

    def disk_with(free: int):
        def disk_usage(path):
            asked.append(Path(path))
            return collections.namedtuple("usage", "total used free")(2**40, 2**40 - free, free)

        monkeypatch.setattr(shutil, "disk_usage", disk_usage)

    cfg = load_config(
        path=DEBUG_CONFIG,
        overrides={"checkpoint.interval": 2, "checkpoint.folder": str(folder), "run.dir": str(tmp_path / "run")},
    )
    disk_with(need - 1)
    with pytest.raises(ConfigError) as err:
        check_config(cfg, 1)
    message = str(err.value)
    assert f"checkpoint.folder={str(folder)!r} has 0.01 GiB free, but one checkpoint" in message
    assert "needs about 0.01 GiB (weights + AdamW state)" in message and "free space there" in message
    assert asked == [folder]
    disk_with(need)  # exactly one checkpoint's room is enough
    check_config(cfg, 1)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--parallel.dp_shard", "3"], ["WORLD_SIZE=2", "make the product equal the number of processes"]),
        (["--training.beta2", "1.5"], ["training.beta2=1.5 must be >= 0 and < 1"]),
        (
            init_from(attention_bias=True, sliding_window=4096, num_local_experts=8),
            ["attention_bias=True", "sliding_window=4096", "num_local_experts=8", "meshloom cannot run"],
        ),
    ],
    ids=["layout-misfit", "bad-value", "transformers-folder"],
)
def test_under_torchrun_every_worker_exits_2_with_the_message(args, words, tmp_path):
    message = refused(tmp_path, *resolve(args, tmp_path), nproc=2)
    for word in words:
        assert word in message


def test_help_lists_every_key_with_its_default_and_meaning():
    import dataclasses

    from runtime.schema import FIELD_KEYS, Config

    proc = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(getattr(Config(), section.name)):
            key = FIELD_KEYS.get(f"{section.name}.{f.name}", f"{section.name}.{f.name}")
            line = next((line for line in lines if line.strip().startswith(f"--{key} ")), None)
            assert line is not None, f"--help does not list {key}"
            assert f"default {f.default!r}" in line and f.metadata.get("help", "MISSING") in line, line


def test_export_never_overwrites_without_being_asked(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("keep me")
    export = [sys.executable, "-m", "checkpoint.export", "--checkpoint", str(tmp_path / "none")]
    proc = subprocess.run([*export, "--out", str(a_file)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "is a file, not a folder" in proc.stderr and "Traceback" not in proc.stderr
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "model.safetensors").write_text("an earlier export")
    proc = subprocess.run([*export, "--out", str(earlier)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "already holds files" in proc.stderr and "--overwrite" in proc.stderr
    assert a_file.read_text() == "keep me" and (earlier / "model.safetensors").read_text() == "an earlier export"
