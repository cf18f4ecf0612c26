"""Malformed versions of every JSON file kind meshloom reads, and of a dataset's header.json and documents.bin,
each run through the real entry point in this process: exit 2 (or a ConfigError where the reader is called
directly) with a message naming the file, and never a traceback (runtime/files.py is the one door).

The mutations are generated, not listed by hand: truncation at several points, wrong types, out-of-range
numbers, missing and extra entries, nesting deeper than the limit, bytes that are not UTF-8 and lone surrogate
escapes. Entry points: generate.main (config.json, the safetensors index), train.main --dry-run (config.json
through checkpoint.init_from), data.prepare.main (JSONL, chat JSONL); the readers themselves where no entry
point reads the file without a process group (meshloom.json: checkpoint.resume.inspect and read_meta;
header.json and documents.bin: data.token_file.read_header and open_documents).

Last, a full disk: a 1 MB tmpfs (when this process may mount one; CI runs as root) filled up under the metrics
writer and under an export, which must say "full" and leave nothing half-written.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime.config import ConfigError
from runtime.files import MAX_DEPTH, DiskFullError

DEEP = "[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5)
VERY_DEEP = "[" * 100_000 + "]" * 100_000  # past Python's own recursion limit


def mutations(value: dict, required: str, numbers: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Malformed versions of the JSON object ``value``: name -> the file's bytes. ``required``: a key whose
    absence is an error; ``numbers``: keys whose value is checked as a number."""
    text = json.dumps(value)
    out = {
        "empty": b"",
        "truncated_early": text[:1].encode(),
        "truncated_half": text[: len(text) // 2].encode(),
        "truncated_last_byte": text[:-1].encode(),
        "a_list": b"[1, 2]",
        "a_string": b'"config"',
        "deep": json.dumps({**value, "nested": json.loads(DEEP)}).encode(),
        "very_deep": VERY_DEEP.encode(),
        "not_utf8": text.encode()[:-1] + b' , "x": "\xff\xfe"}',
        "lone_surrogate": text[:-1].encode() + b', "name": "\\ud800"}',
        f"missing_{required}": json.dumps({k: v for k, v in value.items() if k != required}).encode(),
        "extra_after_the_object": (text + ', {"extra": 1}').encode(),
    }
    for key in numbers:
        out[f"{key}_a_string"] = json.dumps({**value, key: "many"}).encode()
        out[f"{key}_negative"] = json.dumps({**value, key: -abs(value.get(key, 1)) - 1}).encode()
    return out


def run(main, args: list[str]) -> tuple[int, str]:
    """``main(args)``: its exit status and stderr; an exception escaping it fails the test (a traceback)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(args)
        except SystemExit as exc:
            code = exc.code
    return code, err.getvalue()


def refused(code: int, err: str, *words: str) -> None:
    assert code == 2, (code, err[-1500:])
    assert "Traceback" not in err, err[-3000:]
    for word in words:
        assert word in err, (word, err[-1500:])


# ---- a transformers folder: config.json and its safetensors index -----------------------------------------------
@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    from checkpoint.hf import export_safetensors
    from models.llama import ModelArgs, Transformer

    args = ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=256, max_seq_len=64)
    out = tmp_path_factory.mktemp("fuzz") / "export"
    export_safetensors(Transformer(args).init_weights(0).state_dict(), args, out)
    return out


def folder_with(export: Path, tmp_path: Path, name: str, data: bytes) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(export, folder)
    (folder / name).write_bytes(data)
    return folder


CONFIG_EXTRA = {  # values a config.json must not have: each is refused by name
    "hidden_size_negative": {"hidden_size": -64},
    "rms_norm_eps_nan": {"rms_norm_eps": float("nan")},
    "rms_norm_eps_a_string": {"rms_norm_eps": "1e-5"},
    "max_position_embeddings_1e11": {"max_position_embeddings": 10**11},
    "max_position_embeddings_float": {"max_position_embeddings": 1e11},
    "num_attention_heads_zero": {"num_attention_heads": 0},
    "quantization_config": {"quantization_config": {"quant_method": "gptq"}},
    "model_type_unknown": {"model_type": "nonsense"},
}


def config_cases(export: Path) -> dict[str, bytes]:
    config = json.loads((export / "config.json").read_text())
    numbers = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")
    cases = mutations(config, "hidden_size", (*numbers, "max_position_embeddings", "rms_norm_eps"))
    cases.update({name: json.dumps({**config, **extra}).encode() for name, extra in CONFIG_EXTRA.items()})
    return cases


def test_every_malformed_config_json_is_refused_by_generate_and_the_dry_run(export, tmp_path):
    import generate
    import train

    for name, data in config_cases(export).items():
        folder = folder_with(export, tmp_path / name, "config.json", data)
        code, err = run(generate.main, ["--checkpoint", str(folder), "--prompt", "hi", "--max-new-tokens", "1"])
        refused(code, err, "config.json", str(folder))
        args = ["--dry-run", "--world-size", "1", "--checkpoint.init_from", str(folder)]
        code, err = run(train.main, args)
        refused(code, err, "config.json")


def test_every_malformed_index_is_refused_by_generate(export, tmp_path):
    from safetensors import safe_open

    import generate

    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, "model.safetensors")}
    cases = mutations(index, "weight_map")
    cases["weight_map_a_list"] = json.dumps({"weight_map": names}).encode()
    cases["a_tensor_left_out"] = json.dumps({"weight_map": dict.fromkeys(names[1:], "model.safetensors")}).encode()
    for name, data in cases.items():
        folder = folder_with(export, tmp_path / name, "model.safetensors.index.json", data)
        code, err = run(generate.main, ["--checkpoint", str(folder), "--prompt", "hi", "--max-new-tokens", "1"])
        refused(code, err, str(folder))


def test_weights_that_are_not_finite_are_refused_naming_the_tensor(export, tmp_path):
    from safetensors.torch import load_file, save_file

    import generate

    folder = tmp_path / "model"
    shutil.copytree(export, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name][0] = float("nan")
    save_file(tensors, str(folder / "model.safetensors"))
    code, err = run(generate.main, ["--checkpoint", str(folder), "--prompt", "hi", "--max-new-tokens", "1"])
    refused(code, err, "model.safetensors", name, "NaN")


@pytest.mark.parametrize(
    "option, words",
    [
        (["--temperature", "1e-38"], ["--temperature", ">="]),
        (["--prompt", "\udcff\udcfe"], ["--prompt", "UTF-8"]),
    ],
)
def test_generate_options_that_cannot_work_are_refused(export, option, words):
    import generate

    args = ["--checkpoint", str(export), "--prompt", "hi", "--max-new-tokens", "1", *option]
    refused(*run(generate.main, args), *words)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_generate_device_cuda_without_cuda_is_refused(export):
    import generate

    args = ["--checkpoint", str(export), "--prompt", "hi", "--device", "cuda"]
    refused(*run(generate.main, args), "--device cuda", "auto")


def test_supervise_with_a_missing_command_is_one_line():
    from launch import supervise

    code, err = run(supervise.main, ["--", "no-such-command-meshloom", "--checkpoint.resume", "auto"])
    refused(code, err, "no-such-command-meshloom")


@pytest.mark.parametrize(
    "args, words",
    [
        (["--gpus", "8", "--seq-len", "0"], ["--seq-len", "'0'"]),  # was a ZeroDivisionError
        (["--gpus", "8", "--global-batch-tokens", "nan"], ["--global-batch-tokens", "'nan'"]),  # a ValueError
        (["--layout", "garbage"], ["--layout", "'garbage'", "key=value"]),
        (["--layout", "tp=²,pp=1,dp=1"], ["--layout", "tp='²'", "ASCII"]),
        (["--layout", "tp=1,pp=1,dp=1,nonsense=2"], ["--layout", "'nonsense'", "tp, cp"]),
        (["--gpus", "8", "--model-shape", "dim=x"], ["--model-shape", "dim='x'"]),
        (["--gpus", "8", "--model-shape", "dim=64,rope_theta=inf"], ["--model-shape", "rope_theta='inf'"]),
    ],
    ids=["seq-len-0", "tokens-nan", "layout-garbage", "layout-superscript", "layout-unknown", "shape-x", "theta-inf"],
)
def test_plan_layout_refuses_malformed_options_in_one_line(args, words):
    from cluster import plan_layout

    refused(*run(plan_layout.main, args), *words)


def shape_cases() -> list[tuple[str, list[str]]]:
    """Every --model-shape key with values no model can have (negative, zero, fractional, not a number), then the
    shapes whose keys each fit but not together (dim over heads, heads over kv heads, odd head width, top_k)."""
    from cluster.plan_layout import MOE_KEYS, SHAPE_KEYS

    cases = []
    for key in SHAPE_KEYS + MOE_KEYS:
        whole = ("1.5", "99999999999") if key != "rope_theta" else ()  # rope_theta is any positive number
        for value in ("-1", "x", "", "²", "nan", "-inf", *whole):
            cases.append((f"{key}={value}", [f"{key}={value!r}"]))
        if key != "moe_shared_experts":  # 0 shared experts is a plain MoE
            cases.append((f"{key}=0", [f"{key}='0'"]))
    return cases + [
        ("dim=64,n_heads=3", ["dim=64", "n_heads=3", "multiple"]),
        ("n_heads=3", ["dim=128 (the default)", "n_heads=3"]),
        ("dim=64,n_heads=8,n_kv_heads=3", ["n_heads=8", "n_kv_heads=3", "divides"]),
        ("dim=64,n_heads=8,n_kv_heads=16", ["n_kv_heads=16", "divides"]),
        ("dim=2,n_heads=2,n_kv_heads=1", ["dim / n_heads", "= 1", "even"]),
        ("dim=24,n_heads=8,n_kv_heads=8", ["= 3", "even", "16"]),
        ("dim=64,n_heads=8,n_experts=4,top_k=8", ["top_k=8", "n_experts=4"]),
    ]


@pytest.mark.parametrize("layout", [None, "tp=1,pp=1,dp=8"], ids=["search", "one-layout"])
def test_plan_layout_refuses_every_shape_no_layout_can_run(layout):
    """A shape no layout can run was searched before and printed no layout with exit 0; refused up front now."""
    from cluster import plan_layout

    where = ["--layout", layout] if layout else ["--gpus", "8"]
    for shape, words in shape_cases():
        refused(*run(plan_layout.main, [*where, "--model-shape", shape]), "--model-shape", *words)


# ---- the measurements and docs.figures: what parses but cannot run -----------------------------------------------
def test_docs_figures_refuses_what_it_cannot_draw_in_one_line(tmp_path):
    """Each was a traceback: a folder or a missing folder as mesh --out, a file as all --out, and microbatch counts
    a schedule of the table cannot run (torch's ValueError from inside the schedule)."""
    from docs.figures import main

    (tmp_path / "a-file").write_text("")
    refused(*run(main, ["mesh", "--out", str(tmp_path)]), "--out", "is a folder")
    refused(*run(main, ["mesh", "--out", str(tmp_path / "no" / "m.svg")]), "--out", "No such file")
    refused(*run(main, ["all", "--out", str(tmp_path / "a-file")]), "--out", "is a file")
    refused(*run(main, ["pipeline", "--pp", "4", "--microbatches", "1"]), "--microbatches 1", "1F1B")
    refused(*run(main, ["pipeline", "--pp", "2", "--microbatches", "5"]), "--microbatches 5", "multiple of pp=2")
    assert list(tmp_path.iterdir()) == [tmp_path / "a-file"]


def test_measurements_refuse_a_layout_the_config_refuses_before_any_rank_starts(tmp_path):
    """pipeline_bubble and replica_check ask train.py's own checks (launch/local_runs.refusal) before spawning;
    a rank's RankFailure traceback before."""
    from measure import pipeline_bubble, replica_check

    refused(*run(pipeline_bubble.main, ["--pp", "4", "--microbatches", "1"]), "--pp 4 --microbatches 1", "1F1B")
    refused(*run(pipeline_bubble.main, ["--out", str(tmp_path / "x"), "--pp", "3", "--microbatches", "3"]), "DualPipeV")
    refused(*run(replica_check.main, ["--dim", "3"]), "--dim 3", "model.dim=3", "model.n_heads")


def test_moe_load_refuses_a_picture_path_it_cannot_write_before_training(tmp_path):
    """The picture was written after the training runs: a folder or a path under a file failed minutes in."""
    from measure import moe_load

    (tmp_path / "a-file").write_text("")
    refused(*run(moe_load.main, ["--out", str(tmp_path)]), "--out", "is a folder")
    refused(*run(moe_load.main, ["--out", str(tmp_path / "a-file" / "x.svg")]), "--out's folder", "a-file")


def test_measurements_refuse_devices_and_folders_they_do_not_have(tmp_path):
    import torch

    from measure import async_save, document_masks, moe_grouped_mm, ring_attention

    world = torch.cuda.device_count() + 1
    refused(*run(async_save.main, ["--gpu", "--world", str(world)]), f"--world {world}", "--gpu")
    refused(*run(document_masks.main, ["--model", str(tmp_path)]), f"--model {tmp_path}", "config.json")
    if not torch.cuda.is_available():
        refused(*run(ring_attention.main, ["--device", "cuda"]), "--device cuda", "--device cpu")
        refused(*run(moe_grouped_mm.main, ["--device", "cuda"]), "--device cuda", "--device cpu")


# ---- meshloom.json (a checkpoint's manifest): the reader, as train's resume and export call it -----------------
def test_every_malformed_meshloom_json_is_reported_by_the_checkpoint_reader(tmp_path):
    from checkpoint.resume import META_FILE, inspect, read_meta

    meta = {"format": 2, "step": 3, "model": {"dim": 32}, "files": {}}
    for name, data in mutations(meta, "format", ("format",)).items():
        step = tmp_path / name / "step-3"
        step.mkdir(parents=True)
        (step / META_FILE).write_bytes(data)
        _, _, problems = inspect(step)
        assert problems, name
        if name.startswith(("truncated", "deep", "very_deep", "not_utf8", "lone_surrogate", "empty", "a_")):
            assert any(META_FILE in problem for problem in problems), (name, problems)
            with pytest.raises(ConfigError, match=META_FILE):
                read_meta(step)


# ---- JSONL: data.prepare (text and chat) ------------------------------------------------------------------------
def jsonl_cases(record: dict, required: str) -> dict[str, bytes]:
    """A good line, then a malformed one (an empty line is skipped, as it should be)."""
    good = json.dumps(record).encode() + b"\n"
    return {name: good + data + b"\n" for name, data in mutations(record, required).items() if name != "empty"}


def test_every_malformed_jsonl_line_is_refused_by_prepare(tmp_path):
    from data import prepare

    for name, data in jsonl_cases({"text": "hello there", "id": 1}, "text").items():
        source = tmp_path / name / "docs.jsonl"
        source.parent.mkdir(parents=True)
        source.write_bytes(data)
        code, err = run(
            prepare.main, ["--source", str(source), "--tokenizer", "bytes", "--out", str(source.parent / "o")]
        )
        refused(code, err, "docs.jsonl")
        assert not (source.parent / "o" / "header.json").exists(), name


def test_every_malformed_chat_line_is_refused_by_prepare(tmp_path):
    from data import prepare
    from tests.bpe import tiny_bpe
    from tests.test_malformed_inputs import chat_folder

    template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    tok = chat_folder(tmp_path, tiny_bpe(tmp_path / "bpe"), template)
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    cases = jsonl_cases(record, "messages")
    cases["messages_a_string"] = json.dumps({"messages": "hi"}).encode() + b"\n"
    cases["content_an_int"] = json.dumps({"messages": [{"role": "user", "content": 3}]}).encode() + b"\n"
    for name, data in cases.items():
        source = tmp_path / name / "chats.jsonl"
        source.parent.mkdir(parents=True)
        source.write_bytes(data)
        args = ["--format", "chat", "--seq-len", "64", "--source", str(source), "--tokenizer", str(tok)]
        code, err = run(prepare.main, [*args, "--out", str(source.parent / "o")])
        refused(code, err, "chats.jsonl")


# ---- a tokenizer folder: tokenizer.json (data.prepare, generate) and the chat folder's JSON files ----------------
@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory) -> Path:
    """A small tokenizer.json built in milliseconds (a word-level model: the readers, not the model, are tested)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from tests.bpe import EOS

    words = ["[UNK]", "hi", "hello", "there", "user", "assistant", ":"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(EOS, special=True)])
    path = tmp_path_factory.mktemp("fuzzbpe") / "tokenizer.json"
    tok.save(str(path))
    return path


def tokenizer_cases(bpe_file: Path) -> dict[str, bytes]:
    cases = mutations(json.loads(bpe_file.read_text()), "model")
    cases.pop("missing_model")  # a valid JSON object that ``tokenizers`` refuses in its own words: checked below
    return cases


def test_every_malformed_tokenizer_json_is_refused_by_prepare_and_generate(bpe_file, export, tmp_path):
    import generate
    from data import prepare

    source = tmp_path / "docs.txt"
    source.write_text("hello there\n")
    cases = tokenizer_cases(bpe_file)
    cases["missing_model"] = json.dumps({k: v for k, v in json.loads(bpe_file.read_text()).items() if k != "model"})
    for name, data in cases.items():
        tok = tmp_path / name / "tokenizer.json"
        tok.parent.mkdir()
        tok.write_bytes(data if isinstance(data, bytes) else data.encode())
        out = tmp_path / name / "o"
        code, err = run(prepare.main, ["--source", str(source), "--tokenizer", str(tok), "--out", str(out)])
        refused(code, err, "tokenizer.json")
        assert not out.exists(), name
        args = ["--checkpoint", str(export), "--prompt", "hi", "--max-new-tokens", "1", "--tokenizer", str(tok)]
        refused(*run(generate.main, args), "tokenizer.json")


def test_a_prompt_that_is_not_utf8_is_refused_with_a_tokenizer_json(bpe_file, export):
    """The issue's case: with a tokenizer.json, a prompt of bytes that are not UTF-8 (argv's surrogate escapes)
    was a TypeError from ``tokenizers``; the option's type refuses it before any tokenizer is loaded."""
    import generate

    args = ["--checkpoint", str(export), "--tokenizer", str(bpe_file), "--max-new-tokens", "1"]
    refused(*run(generate.main, [*args, "--prompt", "hi \udcff"]), "--prompt", "UTF-8")


def test_every_malformed_json_file_of_a_chat_tokenizer_folder_is_refused_by_prepare(bpe_file, tmp_path):
    from data import prepare
    from data.tokenizers import TOKENIZER_JSON_FILES
    from tests.test_malformed_inputs import chat_folder

    template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    source = tmp_path / "chats.jsonl"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    source.write_text(json.dumps({"messages": messages}) + "\n")
    assert (
        run(
            prepare.main,
            [
                "--format",
                "chat",
                "--seq-len",
                "64",
                "--source",
                str(source),
                "--tokenizer",
                str(chat_folder(tmp_path, bpe_file, template)),
                "--out",
                str(tmp_path / "good"),
            ],
        )[0]
        == 0
    )
    kinds = ("very_deep", "not_utf8", "lone_surrogate", "a_list")
    for file in TOKENIZER_JSON_FILES:
        for kind in kinds:
            (tmp_path / file / kind).mkdir(parents=True)
            folder = chat_folder(tmp_path / file / kind, bpe_file, template)
            present = folder / file
            value = json.loads(present.read_text()) if present.is_file() else {"eos_token": "x"}
            (folder / file).write_bytes(mutations(value, "x")[kind])
            args = ["--format", "chat", "--seq-len", "64", "--source", str(source), "--tokenizer", str(folder)]
            code, err = run(prepare.main, [*args, "--out", str(folder.parent / "o")])
            refused(code, err, file, str(folder))


# ---- header.json and documents.bin: the dataset reader (train reads them after the process group starts) --------
@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    from data import prepare

    root = tmp_path_factory.mktemp("fuzzdata")
    source = root / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": f"document number {i} " * 3}) + "\n" for i in range(8)))
    assert run(prepare.main, ["--source", str(source), "--tokenizer", "bytes", "--out", str(root / "data")])[0] == 0
    return root / "data"


def header_cases(header: dict) -> dict[str, bytes]:
    cases = mutations(header, "num_tokens", ("num_tokens", "version"))
    for key in ("num_tokens", "max_id", "num_documents", "tokenizer", "documents", "dtype", "tokens_sha256"):
        cases[f"{key}_a_list"] = json.dumps({**header, key: [1]}).encode()
        cases[f"{key}_true"] = json.dumps({**header, key: True}).encode()
    cases["documents_count_a_string"] = json.dumps({**header, "documents": {"file": "x", "count": "8"}}).encode()
    cases["tokenizer_vocab_a_string"] = json.dumps({**header, "tokenizer": {"vocab_size": "256"}}).encode()
    cases["num_tokens_off_by_one"] = json.dumps({**header, "num_tokens": header["num_tokens"] + 1}).encode()
    return cases


def test_every_malformed_header_json_is_refused_by_the_dataset_reader(dataset, tmp_path):
    from data.token_file import read_header

    header = json.loads((dataset / "header.json").read_text())
    for name, data in header_cases(header).items():
        folder = tmp_path / name
        shutil.copytree(dataset, folder)
        (folder / "header.json").write_bytes(data)
        with pytest.raises(ConfigError, match="header.json|tokens.bin|documents.bin") as caught:
            read_header(folder)
        assert str(folder) in str(caught.value), (name, caught.value)


def test_every_malformed_documents_bin_is_refused_by_the_dataset_reader(dataset, tmp_path):
    from data.token_file import DOCUMENTS, open_documents, read_header

    starts = np.fromfile(dataset / DOCUMENTS, dtype="<u8")
    header = read_header(dataset)
    assert len(starts) > 2 and open_documents(dataset, header) is not None
    bad = {
        "first_not_zero": np.concatenate([[5], starts[1:]]),
        "out_of_order": np.concatenate([starts[:1], starts[2:3], starts[1:2], starts[3:]]),
        "past_the_tokens": np.concatenate([starts[:-1], [header["num_tokens"] + 10]]),
    }
    for name, values in bad.items():
        folder = tmp_path / name
        shutil.copytree(dataset, folder)
        values.astype("<u8").tofile(folder / DOCUMENTS)
        with pytest.raises(ConfigError, match=DOCUMENTS):
            open_documents(folder, read_header(folder))
    folder = tmp_path / "wrong_size"
    shutil.copytree(dataset, folder)
    starts[:-1].astype("<u8").tofile(folder / DOCUMENTS)
    with pytest.raises(ConfigError, match=DOCUMENTS):
        read_header(folder)


# ---- a full disk --------------------------------------------------------------------------------------------------
def fill(path: Path) -> None:
    """Write ``path`` until the disk is full (unbuffered: nothing is left to flush at close)."""
    with open(path, "ab", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MB tmpfs, filled to the last byte; skipped only when mounting is refused for lack of permission."""
    mount = tmp_path / "small"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        why = proc.stderr.lower()
        assert any(word in why for word in ("permission", "only root", "not permitted", "must be superuser")), why
        pytest.skip(f"mounting a tmpfs is refused here: {proc.stderr.strip()}")
    try:
        fill(mount / "filler")
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_under_the_metrics_writer_is_one_line_and_no_torn_record(full_disk):
    from training.metrics import MetricsWriter

    (full_disk / "filler").write_bytes(b"")  # room for the file and one record
    writer = MetricsWriter(str(full_disk), enabled=True, tensorboard=False)
    writer.log({"step": 1, "loss": 1.0})
    fill(full_disk / "filler")
    with pytest.raises(DiskFullError, match=f"the disk at {full_disk} is full"):
        for step in range(2, 10_000):
            writer.log({"step": step, "loss": 1.0, "padding": "x" * 200})
    writer.close()
    lines = (full_disk / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(line)["step"] >= 1 for line in lines)  # every line whole


def test_a_full_disk_under_an_export_is_one_line_and_leaves_nothing(full_disk, monkeypatch):
    from checkpoint import export
    from data.tokenizers import load_tokenizer
    from models.llama import ModelArgs, Transformer

    args = ModelArgs(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=512, max_seq_len=64)
    state = Transformer(args).init_weights(0).state_dict()  # about 1.3 MB in fp32: more than the disk has
    monkeypatch.setattr(export, "choose_checkpoint", lambda path: Path(path))
    monkeypatch.setattr(export, "checkpoint_tokenizer", lambda step_dir, override: load_tokenizer("bytes"))
    monkeypatch.setattr(export, "source_folder", lambda step_dir, override: None)
    monkeypatch.setattr(export, "load_model_state", lambda step_dir: (state, args))
    monkeypatch.setattr(export, "read_meta", lambda step_dir: {"model": {}})
    code, err = run(export.main, ["--checkpoint", str(full_disk), "--out", str(full_disk / "hf")])
    refused(code, err, f"the disk at {full_disk} is full", "needed about")
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler"]  # no partial folder left


def test_a_full_disk_under_a_checkpoint_save_names_the_disk_not_torchs_enforce_text(full_disk):
    from checkpoint.manager import _describe

    enforce = RuntimeError(
        "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file data/0: file write failed"
    )
    _, text, code = _describe(enforce, full_disk)
    assert code == errno.ENOSPC and f"the disk at {full_disk} is full" in text and "enforce" not in text
