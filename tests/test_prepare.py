"""Tokenizers, `python -m data.prepare`, the token-file format, the memory-mapped stream and the data checks.

Every bad-data case is refused with the field (or file and line) and the fix, before any process group:
the train-time ones through `python train.py` and `torchrun` (exit status 2 within seconds), the
prepare-time ones through `python -m data.prepare`. `tokenizers` and `pyarrow` come with the dev extras.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from data.dataset import load_data
from data.loader import GlobalBatchLoader
from data.prepare import prepare
from data.token_file import HEADER, TOKENS, TokenMap, dtype_for, read_header
from data.tokenizers import load_tokenizer
from launch.local_runs import DEBUG_CONFIG, ROOT, run_train_cli
from runtime.config import ConfigError, load_config
from tests.bpe import EOS, tiny_bpe

DOCS = ["def f(x):\n    return x + 1\n", "héllo ∑ wörld", "", "class A:\n    pass\n"]  # the empty one is skipped


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return tiny_bpe(tmp_path_factory.mktemp("bpe"))


def config(tmp_path, **overrides):
    base = {"run.dir": str(tmp_path / "run"), "run.tensorboard": False}
    return load_config(path=DEBUG_CONFIG, overrides={**base, **{k.replace("__", "."): v for k, v in overrides.items()}})


def write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def write_parquet(path, docs, field="text"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), path, row_group_size=2)
    return path


# ---- tokenizers ----------------------------------------------------------------------------------------------


def test_bytes_stays_the_default_and_reads_the_corpus_as_before(tmp_path):
    from data.corpus import load_corpus

    cfg = config(tmp_path)
    assert cfg.data.tokenizer == "bytes"
    data = load_data(cfg)
    assert torch.equal(data.train, load_corpus("default", cfg.data.max_bytes)) and data.val is None
    tok = load_tokenizer("bytes")
    assert tok.encode("é") == [0xC3, 0xA9] and tok.decode(tok.encode(DOCS[1])) == DOCS[1] and tok.eos_id is None


def test_a_tokenizer_json_finds_its_eos_and_round_trips(bpe):
    tok = load_tokenizer(str(bpe))
    assert tok.eos_token == EOS and tok.eos_id == 0 and tok.vocab_size == 512
    assert tok.decode(tok.encode(DOCS[1])) == DOCS[1]
    assert load_tokenizer(str(bpe.parent)).sha256 == tok.sha256  # the folder works too


def test_a_tokenizer_without_an_eos_is_refused_with_the_fix(tmp_path, bpe):
    raw = json.loads(bpe.read_text())
    raw["added_tokens"][0]["content"] = "<unk>"
    raw["model"]["vocab"] = {("<unk>" if k == EOS else k): v for k, v in raw["model"]["vocab"].items()}
    (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="no end-of-document token.*--data.eos_token"):
        load_tokenizer(str(tmp_path))
    assert load_tokenizer(str(tmp_path), eos_token="<unk>").eos_id == 0


def test_a_model_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path, bpe):
    from train import check_config

    with pytest.raises(ConfigError) as err:
        check_config(config(tmp_path, data__tokenizer=str(bpe), model__vocab_size=256), 1)
    assert "model.vocab_size=256 is smaller than the tokenizer's vocabulary of 512" in str(err.value)
    assert "--model.vocab_size 512" in str(err.value)


def test_dtype_follows_the_vocabulary():
    assert dtype_for(256) == dtype_for(65536) == "uint16" and dtype_for(65537) == dtype_for(128256) == "uint32"


# ---- prepare -------------------------------------------------------------------------------------------------


def test_text_jsonl_and_parquet_pack_the_same_documents_with_eos(tmp_path, bpe, monkeypatch):
    tok = load_tokenizer(str(bpe))
    folder = tmp_path / "texts"
    folder.mkdir()
    for i, doc in enumerate(DOCS):
        (folder / f"{i:02d}.txt").write_text(doc)
    (folder / ".hidden").write_text("never read")
    expected = [i for doc in DOCS if doc for i in (*tok.encode(doc), tok.eos_id)]
    outs = {
        "text": prepare(str(folder), str(bpe), str(tmp_path / "t"), workers=1, quiet=True),
        "jsonl": prepare(
            str(write_jsonl(tmp_path / "d.jsonl", DOCS)), str(bpe), str(tmp_path / "j"), workers=1, quiet=True
        ),
        "parquet": prepare(
            str(write_parquet(tmp_path / "d.parquet", DOCS)), str(bpe), str(tmp_path / "p"), workers=1, quiet=True
        ),
    }
    for kind, name in (("text", "t"), ("jsonl", "j"), ("parquet", "p")):
        header = read_header(tmp_path / name)
        assert header["num_documents"] == 3 and header["num_tokens"] == len(expected) == outs[kind]["num_tokens"]
        assert header["dtype"] == "uint16" and header["tokenizer"]["sha256"] == tok.sha256
        assert header["tokenizer"]["eos_id"] == 0 and header["text_field"] == "text"
        assert np.fromfile(tmp_path / name / TOKENS, dtype="<u2").tolist() == expected, kind


def test_parallel_workers_write_the_same_file(tmp_path, bpe, monkeypatch):
    import data.prepare

    monkeypatch.setattr(data.prepare, "CHUNK_DOCS", 7)  # many chunks, so that order across workers matters
    docs = [f"def f{i}(x):\n    return {i} * x\n" * (1 + i % 5) for i in range(200)]
    source = write_jsonl(tmp_path / "d.jsonl", docs)
    prepare(str(source), str(bpe), str(tmp_path / "one"), workers=1, quiet=True)
    prepare(str(source), str(bpe), str(tmp_path / "two"), workers=2, quiet=True)
    assert (tmp_path / "one" / TOKENS).read_bytes() == (tmp_path / "two" / TOKENS).read_bytes()


def prepare_cli(*args: str) -> subprocess.CompletedProcess:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "data.prepare", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    proc.seconds = time.monotonic() - start
    return proc


def test_prepare_command_prints_progress_and_a_summary(tmp_path, bpe):
    source = write_jsonl(tmp_path / "d.jsonl", DOCS * 10)
    proc = prepare_cli(
        "--source", str(source), "--tokenizer", str(bpe), "--out", str(tmp_path / "out"), "--workers", "2"
    )
    assert proc.returncode == 0, proc.stderr
    n_tokens = read_header(tmp_path / "out")["num_tokens"]
    assert f"prepared 30 documents, {n_tokens:,} tokens (uint16)" in proc.stdout and "tokens/s" in proc.stdout
    assert "100% | 1/1 files | 30 documents" in proc.stderr
    # a second prepare into the same folder is refused: nothing saved is overwritten
    again = prepare_cli("--source", str(source), "--tokenizer", "bytes", "--out", str(tmp_path / "out"))
    assert again.returncode == 2 and "already holds header.json" in again.stderr and "new --out" in again.stderr
    assert read_header(tmp_path / "out")["num_tokens"] == n_tokens


@pytest.mark.parametrize(
    "make, words",
    [
        (
            lambda p: write_jsonl(p / "d.jsonl", DOCS, field="content"),
            ["d.jsonl:1 has no 'text' field", "'content'", "--text-field"],
        ),
        (
            lambda p: (p / "d.jsonl").write_text('{"text": "ok"}\n{"text": 3}\n') and p / "d.jsonl",
            ["d.jsonl:2: field 'text' is int, not a string", "--text-field"],
        ),
        (
            lambda p: (p / "d.jsonl").write_text('{"text": "ok"}\nnot json\n') and p / "d.jsonl",
            ["d.jsonl:2 is not valid JSON"],
        ),
        (
            lambda p: (p / "d.parquet").write_bytes(b"PAR1 this is not parquet") and p / "d.parquet",
            ["d.parquet is not a readable Parquet file", "move it out of --source"],
        ),
        (
            lambda p: write_parquet(p / "d.parquet", DOCS, field="body"),
            ["d.parquet has no 'text' column", "'body'", "--text-field"],
        ),
        (
            lambda p: (p / "d.txt").write_bytes(b"caf\xe9 latin-1\n" + b"x" * 100) and p / "d.txt",
            ["d.txt: invalid UTF-8 at byte 3 (invalid continuation byte)", "--errors replace", "iconv"],
        ),
        (
            lambda p: (p / "d.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n') and p / "d.jsonl",
            ["d.jsonl:2: invalid UTF-8 at byte 28 (invalid continuation byte)", "--errors replace"],
        ),
    ],
    ids=[
        "jsonl-without-field",
        "jsonl-not-a-string",
        "jsonl-not-json",
        "unreadable-parquet",
        "parquet-without-column",
        "invalid-utf8-text",
        "invalid-utf8-jsonl",
    ],
)
def test_bad_source_data_is_refused_naming_the_place_and_the_fix(make, words, tmp_path, bpe):
    source = make(tmp_path)
    proc = prepare_cli("--source", str(source), "--tokenizer", str(bpe), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr
    assert not (tmp_path / "out" / HEADER).exists() and not list((tmp_path / "out").glob("tokens*"))


def test_invalid_utf8_is_replaced_only_when_asked_and_counted(tmp_path):
    source = tmp_path / "d.txt"
    source.write_bytes(b"caf\xe9 au lait \xff\xfe ok " + "\ufffd".encode() + b" end")  # one real U+FFFD
    proc = prepare_cli(
        "--source", str(source), "--tokenizer", "bytes", "--out", str(tmp_path / "out"), "--errors", "replace"
    )
    assert proc.returncode == 0, proc.stderr
    assert "replaced 3 bytes of invalid UTF-8 with U+FFFD (--errors replace)" in proc.stdout
    assert read_header(tmp_path / "out")["utf8_replaced_bytes"] == 3
    text = np.fromfile(tmp_path / "out" / TOKENS, dtype="<u2").astype(np.uint8).tobytes().decode()
    assert text == "caf\ufffd au lait \ufffd\ufffd ok \ufffd end"


def test_a_long_document_is_tokenized_in_pieces_that_give_the_whole_document_ids(tmp_path, bpe, monkeypatch):
    """Pieces of 64 characters, cut with the tokenizer's offsets (data/pieces.py), give exactly the ids of the
    whole document: across words, runs of spaces and newlines, multi-byte characters, and a long run without
    any space (the fallback cut) for the byte tokenizer, which has no context."""
    import data.pieces
    import data.prepare

    monkeypatch.setattr(data.prepare, "LONG_CHARS", 100)
    monkeypatch.setattr(data.prepare, "PIECE_CHARS", 64)
    cuts = []
    real_head = data.pieces.encode_head
    monkeypatch.setattr(data.pieces, "encode_head", lambda *args: cuts.append(1) or real_head(*args))
    text = "".join(DOCS) * 40 + "   spaces  \n\n\tand\ttabs  " * 20 + " ∑ héllo wörld" * 30 + "x<|endoftext|>y " * 30
    (tmp_path / "long.txt").write_text(text)
    jsonl = write_jsonl(tmp_path / "long.jsonl", [text, "short", text])
    for spec, source in ((str(bpe), tmp_path / "long.txt"), (str(bpe), jsonl), ("bytes", tmp_path / "long.txt")):
        tok = load_tokenizer(spec)
        eos = [] if tok.eos_id is None else [tok.eos_id]
        docs = [text] if source.suffix == ".txt" else [text, "short", text]
        expected = [i for doc in docs for i in (*tok.encode(doc), *eos)]
        out = tmp_path / f"out-{len(cuts)}"
        cuts.clear()
        prepare(str(source), spec, str(out), workers=1, quiet=True)
        assert np.fromfile(out / TOKENS, dtype="<u2").tolist() == expected, (spec, source.name)
        assert len(cuts) > 10, "the document went through pieces"
    no_spaces = "x" * 5000
    tok = load_tokenizer("bytes")
    assert np.concatenate(
        list(data.pieces.encode_long(tok, [no_spaces[:3000], no_spaces[3000:]]))
    ).tolist() == tok.encode(no_spaces)


def test_preparing_one_long_line_holds_a_piece_not_the_document(tmp_path):
    """Python's allocations (tracemalloc; numpy's arrays included) while preparing an 8 MB single-line file with
    the byte tokenizer in this process: before pieces, the whole text, its Python int list and its array
    (tens of bytes per byte); now about one piece (64 Ki characters) and its arrays, whatever the length
    (0.8 MiB measured)."""
    import tracemalloc

    source = tmp_path / "line.txt"
    with open(source, "w") as f:
        for _ in range(8):
            f.write(("word " * 200_000 + "∑")[: 1 << 20])
    tracemalloc.start()
    prepare(str(source), "bytes", str(tmp_path / "out"), workers=1, quiet=True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    size = source.stat().st_size
    assert read_header(tmp_path / "out")["num_tokens"] == size
    assert peak < 2 * 2**20 < size / 3, f"peak {peak / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB line"


# ---- the training stream ---------------------------------------------------------------------------------------


def test_the_memory_map_gives_the_batches_of_the_in_memory_stream(tmp_path):
    tokens = (torch.arange(20_000) * 7919 % 50_000).to(torch.int64)
    tokens.numpy().astype("<u2").tofile(tmp_path / "tokens.bin")
    mapped = TokenMap(tmp_path / "tokens.bin", np.dtype("<u2"))
    kw = dict(seq_len=32, global_batch=8, micro_batch=2, dp_size=2)
    for rank in range(2):
        a = GlobalBatchLoader(tokens, dp_rank=rank, **kw)
        b = GlobalBatchLoader(mapped, dp_rank=rank, **kw)
        for _ in range(100):  # past the end: both wrap the same way
            for (xa, ya), (xb, yb) in zip(a.next_batch(), b.next_batch(), strict=True):
                assert xb.dtype == torch.int64 and torch.equal(xa, xb) and torch.equal(ya, yb)
        assert a.state_dict() == b.state_dict()
    # a slice is a view of the same file (the validation split); reads past its end are refused
    part = mapped[1000:1100]
    assert len(part) == 100 and part[np.array([0, 99])].tolist() == tokens[[1000, 1099]].tolist()
    with pytest.raises(IndexError):
        part[np.array([100])]


def test_raw_text_with_a_tokenizer_json_equals_the_prepared_folder(tmp_path, bpe):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i, doc in enumerate(DOCS * 200):
        (folder / f"{i:04d}.txt").write_text(doc)
    prepare(str(folder), str(bpe), str(tmp_path / "prepared"), workers=1, quiet=True)
    common = {"data__tokenizer": str(bpe), "model__vocab_size": 512, "training__seq_len": 16}
    raw = load_data(config(tmp_path, data__source=str(folder), **common))
    mapped = load_data(config(tmp_path, data__source=str(tmp_path / "prepared"), **common))
    assert isinstance(mapped.train, TokenMap) and np.array_equal(np.asarray(raw.train), np.asarray(mapped.train))
    assert "memory-mapped" in mapped.description and "EOS id 0" in mapped.description


def test_the_validation_split_is_the_last_fraction(tmp_path, bpe):
    source = write_jsonl(tmp_path / "d.jsonl", DOCS * 300)
    prepare(str(source), str(bpe), str(tmp_path / "prepared"), workers=1, quiet=True)
    common = {"data__tokenizer": str(bpe), "model__vocab_size": 512, "data__source": str(tmp_path / "prepared")}
    whole = np.asarray(load_data(config(tmp_path, **common)).train)
    split = load_data(config(tmp_path, data__val_fraction=0.25, **common))
    n_val = int(len(whole) * 0.25)
    assert np.array_equal(np.asarray(split.val), whole[-n_val:]) and np.array_equal(
        np.asarray(split.train), whole[:-n_val]
    )
    other = load_data(config(tmp_path, data__val_source=str(tmp_path / "prepared"), **common))
    assert np.array_equal(np.asarray(other.val), whole) and np.array_equal(np.asarray(other.train), whole)


def test_jsonl_as_data_source_points_at_prepare(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl", DOCS)
    with pytest.raises(ConfigError, match="tokenize them first: python -m data.prepare"):
        load_data(config(tmp_path, data__source=str(source)))


# ---- bad data at train time: every rank, before any collective, exit status 2 -----------------------------------


@pytest.fixture(scope="module")
def small_dataset(bpe, tmp_path_factory):
    """A prepared folder of ~800 tokens: more than one global batch of seq_len 16 (129), fewer than of 128."""
    root = tmp_path_factory.mktemp("small")
    prepare(str(write_jsonl(root / "d.jsonl", DOCS * 20)), str(bpe), str(root / "prepared"), workers=1, quiet=True)
    n = read_header(root / "prepared")["num_tokens"]
    assert 8 * 16 + 1 < 0.9 * n and 0.1 * n < 8 * 16 + 1 and n < 8 * 128 + 1, n
    return root / "prepared"


def train_cli(tmp_path, *args, nproc=1):
    # A refusal that hung would meet run_train_cli's timeout; the seconds are reported, not asserted (they move
    # with the load on shared cores, and a loaded rerun once took over a minute to start torch).
    start = time.monotonic()
    proc = run_train_cli(nproc, "--config", DEBUG_CONFIG, "--run.dir", str(tmp_path / "run"), *args, timeout=120)
    seconds = time.monotonic() - start
    assert not (tmp_path / "run").exists()
    if nproc == 1:
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
    else:  # torchrun returns 1 when a worker fails, and stops the others once the first has exited
        assert proc.returncode != 0 and "Connection closed" not in proc.stderr and "Timeout" not in proc.stderr
    return proc.stderr, seconds


@pytest.mark.parametrize(
    "args, words",
    [
        (
            [],
            [
                "data.source=",
                "was tokenized with",
                "data.tokenizer='bytes' is another tokenizer",
                "set --data.tokenizer to the one the dataset was prepared with",
            ],
        ),
        (
            ["--data.tokenizer", "BPE", "--model.vocab_size", "512"],
            ["training tokens, fewer than one global batch", "8 x 128 + 1 = 1,025", "lower training.global_batch"],
        ),
        (
            [
                "--data.tokenizer",
                "BPE",
                "--model.vocab_size",
                "512",
                "--training.seq_len",
                "16",
                "--data.val_fraction",
                "0.1",
            ],
            [
                "the validation split (data.val_fraction=0.1 of data.source) holds only",
                "at least one global batch",
                "raise data.val_fraction",
            ],
        ),
        (
            [
                "--data.tokenizer",
                "BPE",
                "--model.vocab_size",
                "512",
                "--training.seq_len",
                "16",
                "--eval.interval",
                "5",
            ],
            ["eval.interval=5 needs a validation split", "--data.val_fraction"],
        ),
    ],
    ids=[
        "header-does-not-match-tokenizer",
        "smaller-than-one-global-batch",
        "empty-validation-split",
        "eval-without-split",
    ],
)
def test_bad_data_stops_the_run_with_the_field_and_the_fix(args, words, small_dataset, bpe, tmp_path):
    args = [str(bpe) if a == "BPE" else a for a in args]
    stderr, seconds = train_cli(tmp_path, "--data.source", str(small_dataset), *args)
    for word in words:
        assert word in stderr, stderr


def test_every_rank_reports_a_damaged_token_file(small_dataset, bpe, tmp_path):
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / HEADER).write_text((small_dataset / HEADER).read_text())
    (damaged / TOKENS).write_bytes((small_dataset / TOKENS).read_bytes()[:-2])  # one token short
    stderr, seconds = train_cli(
        tmp_path,
        "--data.source",
        str(damaged),
        "--data.tokenizer",
        str(bpe),
        "--model.vocab_size",
        "512",
        "--parallel.dp_shard",
        "2",
        nproc=2,
    )
    reports = [line for line in stderr.splitlines() if line.startswith("meshloom: configuration error")]
    # Every rank checks the files with no process group and prints the same report (torchrun may stop a
    # slower rank once the first has exited, so at least one).
    assert reports and len(set(reports)) == 1, stderr[-3000:]
    n = read_header(small_dataset)["num_tokens"]
    assert f"tokens.bin has {2 * n - 2:,} bytes but header.json promises {n:,} uint16 tokens" in reports[0]
    assert "the folder is damaged: prepare the dataset again" in reports[0]
    assert "traceback : configuration error: data.source=" in stderr  # torchrun's summary shows the message


def test_train_tokenizer_command_writes_a_loadable_bpe(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "data.train_tokenizer",
        "--source",
        str(write_jsonl(tmp_path / "d.jsonl", DOCS * 50)),
        "--vocab-size",
        "300",
        "--out",
        str(tmp_path / "tok"),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert tok.eos_id == 0 and tok.vocab_size <= 300 and tok.decode(tok.encode(DOCS[1])) == DOCS[1]
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "never overwrites" in again.stderr


# ---- token ids against the model's vocabulary ------------------------------------------------------------------


def test_prepare_records_the_largest_id_and_a_header_beyond_the_vocabulary_is_refused(small_dataset, bpe, tmp_path):
    header = read_header(small_dataset)
    assert header["max_id"] == int(np.fromfile(small_dataset / TOKENS, dtype="<u2").max()) < 512
    edited = tmp_path / "edited"
    edited.mkdir()
    for name in (TOKENS, "documents.bin"):  # the folder's files, its header edited
        (edited / name).write_bytes((small_dataset / name).read_bytes())
    (edited / HEADER).write_text(json.dumps({**header, "max_id": 600}))
    common = dict(data__tokenizer=str(bpe), data__source=str(edited), training__seq_len=16)
    with pytest.raises(ConfigError) as err:
        load_data(config(tmp_path, model__vocab_size=512, **common))
    assert "holds token ids up to 600 (header.json max_id), but model.vocab_size=512" in str(err.value)
    assert "set --model.vocab_size 601 or more" in str(err.value)
    # A header written before max_id existed still loads (its ids are checked window by window).
    old = {k: v for k, v in header.items() if k != "max_id"}
    (edited / HEADER).write_text(json.dumps(old))
    assert len(load_data(config(tmp_path, model__vocab_size=512, **common)).train) == header["num_tokens"]


@pytest.mark.parametrize("kind", ["memory-map", "tensor"])
def test_an_id_out_of_range_stops_every_data_parallel_rank_with_the_offset(kind, tmp_path):
    """The id sits in rank 1's window of the second global batch: both ranks stop there, with the same message,
    before any batch is made (data/loader.py: the check covers the global batch)."""
    tokens = (np.arange(5_000) % 251).astype("<u2")
    tokens[16 * 8 + 5 * 16 + 3] = 300  # step 2 starts at 128; rank 1 (of 2) reads windows 4..7 of it
    tokens.tofile(tmp_path / "tokens.bin")
    stream = (
        TokenMap(tmp_path / "tokens.bin", np.dtype("<u2"))
        if kind == "memory-map"
        else torch.from_numpy(tokens.astype(np.int64))
    )
    messages = []
    for rank in range(2):
        loader = GlobalBatchLoader(
            stream, seq_len=16, global_batch=8, micro_batch=4, dp_rank=rank, dp_size=2, vocab_size=256
        )
        loader.next_batch()  # step 1 is clean
        with pytest.raises(ConfigError) as err:
            loader.next_batch()
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    where = (
        f"{tmp_path / 'tokens.bin'} holds id 300 at token offset 211 (byte 422)"
        if kind == "memory-map"
        else "id 300 at token 211"
    )
    assert where in messages[0] and "model.vocab_size=256 only has ids 0..255" in messages[0]
    assert "Prepare the dataset again" in messages[0]
    # the global batch as ranges: one, or two where the stream wraps
    loader = GlobalBatchLoader(stream, seq_len=16, global_batch=8, micro_batch=4, dp_rank=0, dp_size=2)
    assert loader.global_spans(0) == [(0, 129)] and loader.global_spans(5_000 - 16 - 64) == [(4920, 4985), (0, 65)]


@pytest.fixture(scope="module")
def byte_dataset(tmp_path_factory):
    """A prepared folder of bytes (uint16 ids below 256) with more than one global batch of debug.toml."""
    root = tmp_path_factory.mktemp("bytes")
    prepare(str(write_jsonl(root / "d.jsonl", DOCS * 100)), "bytes", str(root / "prepared"), workers=1, quiet=True)
    return root / "prepared"


def test_a_flipped_byte_in_the_token_file_stops_every_rank_with_the_file_and_offset(byte_dataset, tmp_path):
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / HEADER).write_text((byte_dataset / HEADER).read_text())
    (damaged / "documents.bin").write_bytes((byte_dataset / "documents.bin").read_bytes())  # the folder's, whole
    raw = bytearray((byte_dataset / TOKENS).read_bytes())
    raw[2 * 700 + 1] ^= 0x01  # the high byte of token 700: an id of 256 or more, in rank 1's windows of step 1
    (damaged / TOKENS).write_bytes(bytes(raw))
    start = time.monotonic()
    proc = run_train_cli(
        2, "--config", DEBUG_CONFIG, "--run.dir", str(tmp_path / "run"), "--data.source", str(damaged), timeout=120
    )
    seconds = time.monotonic() - start
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)
    assert proc.returncode != 0 and codes and set(codes) == {"2"}, proc.stderr[-3000:]
    reports = [line for line in proc.stderr.splitlines() if line.startswith("meshloom: configuration error")]
    assert len(reports) == 2 and len(set(reports)) == 1, proc.stderr[-3000:]
    assert f"{damaged / TOKENS} holds id {raw[1400] + 256:,} at token offset 700 (byte 1,400)" in reports[0]
    assert "IndexError" not in proc.stderr and "Traceback" not in proc.stderr.split("meshloom: configuration")[0]
    assert (
        not (tmp_path / "run" / "metrics.jsonl").exists()
        or "loss" not in (tmp_path / "run" / "metrics.jsonl").read_text()
    )
    print(f"torchrun, 2 ranks, damaged token file: every rank exited 2 in {seconds:.1f} s")
