"""A corpus of malformed inputs for every entry point: each is refused in one message, never a traceback.

Each case builds its input in a temporary folder (files, templates, prompts, environment), calls the entry
point's ``main`` in this process and asserts: exit 2; nothing escaped as an exception (a traceback); the last
line of stderr names the input (the option or the file). Internal errors are not input errors: they keep their
traceback, so the cases here are only what a user can hand in.
"""

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from tests.bpe import EOS, tiny_bpe

RAISING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('Conversation roles must be user or assistant') }}{% endif %}"
    "{{ '<|start|>' + m['role'] + '\\n' + m['content'] + '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant\\n' }}{% endif %}"
)
BROKEN_TEMPLATE = "{% for m in messages %}{{ m['content'] }"  # a jinja2 syntax error
UNDEFINED_TEMPLATE = "{{ messages[0]['content'].nothing.deeper }}"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bpe")
    return tiny_bpe(folder)


def chat_folder(root: Path, bpe: Path, template: str | None, config_text: str | None = None) -> Path:
    from tokenizers import AddedToken, Tokenizer

    folder = root / "tok"
    folder.mkdir(exist_ok=True)
    tok = Tokenizer.from_file(str(bpe))
    tok.add_special_tokens([AddedToken("<|start|>", special=True), AddedToken("<|end|>", special=True)])
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(config_text if config_text is not None else json.dumps(config))
    return folder


def chats(root: Path, *conversations, raw: bytes | None = None) -> Path:
    path = root / "chats.jsonl"
    if raw is not None:
        path.write_bytes(raw)
    else:
        path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


USER = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
SYSTEM = [{"role": "system", "content": "be brief"}, *USER]


def tiny_export(root: Path) -> Path:
    """A small exported folder (config.json + model.safetensors), without training."""
    from checkpoint.hf import export_safetensors
    from models.llama import ModelArgs, Transformer

    args = ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=640, max_seq_len=64)
    torch.manual_seed(0)
    out = root / "export"
    export_safetensors(Transformer(args).init_weights(0).state_dict(), args, out)  # torch.empty may hold NaN
    return out


def run(entry: str, args: list[str]) -> tuple[int, str]:
    """``entry``'s main(args): its exit status and stderr; an exception escaping it fails the test."""
    import generate
    from checkpoint import export
    from data import prepare

    main = {"prepare": prepare.main, "generate": generate.main, "export": export.main}[entry]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(args)
        except SystemExit as exc:
            code = exc.code
    return code, err.getvalue()


def case_prepare_chat_template_rejects(root, bpe):
    tok = chat_folder(root, bpe, RAISING_TEMPLATE)
    src = chats(root, USER, SYSTEM)
    args = ["--format", "chat", "--seq-len", "64", "--source", str(src), "--tokenizer", str(tok)]
    return "prepare", [*args, "--out", str(root / "out")], ["chats.jsonl:2", "Conversation roles must be", "template"]


def case_prepare_chat_template_syntax_error(root, bpe):
    tok = chat_folder(root, bpe, BROKEN_TEMPLATE)
    src = chats(root, USER)
    args = ["--format", "chat", "--seq-len", "64", "--source", str(src), "--tokenizer", str(tok)]
    return "prepare", [*args, "--out", str(root / "out")], ["chat template", str(tok)]


def case_prepare_chat_template_undefined(root, bpe):
    tok = chat_folder(root, bpe, UNDEFINED_TEMPLATE)
    src = chats(root, USER)
    args = ["--format", "chat", "--seq-len", "64", "--source", str(src), "--tokenizer", str(tok)]
    return "prepare", [*args, "--out", str(root / "out")], ["chats.jsonl:1", "template"]


def case_prepare_chat_not_utf8(root, bpe):
    tok = chat_folder(root, bpe, RAISING_TEMPLATE)
    src = chats(root, raw=b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}\n')
    args = ["--format", "chat", "--seq-len", "64", "--source", str(src), "--tokenizer", str(tok)]
    return "prepare", [*args, "--out", str(root / "out")], ["chats.jsonl", "UTF-8"]


def case_prepare_tokenizer_config_not_json(root, bpe):
    tok = chat_folder(root, bpe, None, config_text="{not json")
    src = chats(root, USER)
    args = ["--format", "chat", "--seq-len", "64", "--source", str(src), "--tokenizer", str(tok)]
    return "prepare", [*args, "--out", str(root / "out")], ["--tokenizer", str(tok)]


def case_prepare_tokenizer_json_garbage(root, bpe):
    (root / "tokenizer.json").write_text("{garbage")
    (root / "a.txt").write_text("hello")
    args = ["--source", str(root / "a.txt"), "--tokenizer", str(root / "tokenizer.json")]
    return "prepare", [*args, "--out", str(root / "out")], ["--tokenizer", "tokenizer.json"]


def case_prepare_out_under_a_file(root, bpe):
    (root / "a.txt").write_text("hello")
    (root / "file").write_text("x")
    args = ["--source", str(root / "a.txt"), "--tokenizer", "bytes"]
    return "prepare", [*args, "--out", str(root / "file" / "out")], ["--out", "file"]


def case_prepare_source_missing(root, bpe):
    args = ["--source", str(root / "nowhere.txt"), "--tokenizer", "bytes"]
    return "prepare", [*args, "--out", str(root / "out")], ["--source", "nowhere.txt"]


def case_generate_chat_template_rejects(root, bpe):
    out = tiny_export(root)
    tok = chat_folder(root, bpe, "{{ raise_exception('no chat here') }}")
    args = ["--checkpoint", str(out), "--tokenizer", str(tok), "--prompt", "hi", "--chat", "--max-new-tokens", "1"]
    return "generate", args, ["no chat here", "template"]


def case_generate_config_json_garbage(root, bpe):
    out = tiny_export(root)
    (out / "config.json").write_text("{garbage")
    return "generate", ["--checkpoint", str(out), "--prompt", "hi"], ["config.json", str(out)]


def case_generate_config_json_wrong_types(root, bpe):
    out = tiny_export(root)
    config = json.loads((out / "config.json").read_text())
    config["hidden_size"] = "big"
    (out / "config.json").write_text(json.dumps(config))
    return "generate", ["--checkpoint", str(out), "--prompt", "hi"], ["config.json", "hidden_size"]


def case_generate_weights_garbage(root, bpe):
    out = tiny_export(root)
    (out / "model.safetensors").write_bytes(b"\x00" * 100)
    return "generate", ["--checkpoint", str(out), "--prompt", "hi"], ["model.safetensors"]


def case_generate_index_garbage(root, bpe):
    out = tiny_export(root)
    (out / "model.safetensors.index.json").write_text("{garbage")
    return "generate", ["--checkpoint", str(out), "--prompt", "hi"], ["model.safetensors.index.json"]


def case_generate_tokenizer_garbage(root, bpe):
    out = tiny_export(root)
    (root / "tokenizer.json").write_text("[1, 2")
    args = ["--checkpoint", str(out), "--prompt", "hi", "--tokenizer", str(root / "tokenizer.json")]
    return "generate", args, ["--tokenizer", "tokenizer.json"]


def case_generate_empty_prompt(root, bpe):
    out = tiny_export(root)
    return "generate", ["--checkpoint", str(out), "--prompt", ""], ["--prompt"]


def case_generate_not_a_checkpoint(root, bpe):
    (root / "empty").mkdir()
    return "generate", ["--checkpoint", str(root / "empty"), "--prompt", "hi"], ["--checkpoint", "empty"]


def case_export_checkpoint_missing(root, bpe):
    return "export", ["--checkpoint", str(root / "nowhere"), "--out", str(root / "out")], ["--checkpoint", "nowhere"]


def case_export_meshloom_json_garbage(root, bpe):
    step = root / "ckpt" / "step-3"
    step.mkdir(parents=True)
    (step / "meshloom.json").write_text("{garbage")
    return "export", ["--checkpoint", str(step), "--out", str(root / "out")], ["meshloom.json", "step-3"]


def case_export_out_under_a_file(root, bpe):
    (root / "file").write_text("x")
    step = root / "ckpt" / "step-3"
    step.mkdir(parents=True)
    return "export", ["--checkpoint", str(step), "--out", str(root / "file" / "out")], ["--out", "file"]


CASES = {name[5:]: case for name, case in globals().items() if name.startswith("case_")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_malformed_input_gets_one_message_naming_it(name, tmp_path, bpe):
    entry, args, words = CASES[name](tmp_path, bpe)
    code, err = run(entry, args)
    assert code == 2, (code, err[-2000:])
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    for word in words:
        assert word in last, (word, last)


# The launcher's environment, checked before any store is opened (runtime/process.py: check_launch_env).
BAD_ENVIRONMENTS = {
    "rank-at-world-size": ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2"),
    "rank-past-world-size": ({"RANK": "5", "WORLD_SIZE": "2"}, "RANK=5"),
    "world-size-a-word": ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two'"),
    "world-size-zero": ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
    "world-size-arabic-digits": ({"RANK": "0", "WORLD_SIZE": "٢"}, "WORLD_SIZE="),
    "rank-negative": ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1'"),
    "rank-without-world": ({"RANK": "0"}, "WORLD_SIZE is not"),
    "local-rank-a-word": ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "x"}, "LOCAL_RANK='x'"),
    "local-rank-past-local-world": (
        {
            "RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "1",
        },
        "LOCAL_RANK='2'",
    ),
    "master-port-a-word": (
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "http"},
        "MASTER_PORT",
    ),
    "master-port-too-big": (
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000"},
        "MASTER_PORT",
    ),
    "master-addr-missing": ({"RANK": "1", "WORLD_SIZE": "2"}, "MASTER_ADDR is unset"),
    "master-addr-empty": ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": " ", "MASTER_PORT": "29500"}, "MASTER_ADDR"),
}


@pytest.mark.parametrize("name", sorted(BAD_ENVIRONMENTS))
def test_a_bad_launcher_environment_is_refused_before_any_store(name, tmp_path, monkeypatch):
    import time

    import torch.distributed as dist

    import train
    from launch.local_runs import DEBUG_CONFIG

    variables, words = BAD_ENVIRONMENTS[name]
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    for var, value in variables.items():
        monkeypatch.setenv(var, value)
    err = io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = train.main(["--config", DEBUG_CONFIG, "--run.dir", str(tmp_path / "run"), "--training.steps", "1"])
    assert code == 2, err.getvalue()[-2000:]
    assert time.monotonic() - start < 30
    assert not dist.is_initialized()
    assert words in err.getvalue().strip().splitlines()[-1], err.getvalue()[-1000:]
    assert not (tmp_path / "run").exists()
