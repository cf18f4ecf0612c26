"""Chat data: the model's own template, the assistant-only mask, and the packing (data/chat.py)."""

import json
from pathlib import Path

import numpy as np
import pytest

from data.prepare import main as prepare_main
from data.token_file import MaskedTokens, open_tokens, read_header
from data.tokenizers import load_tokenizer
from launch.local_runs import ROOT

CHATS = ROOT / "examples" / "chat_sample.jsonl"
TINY_TEMPLATE = (
    "{% for m in messages %}{{ '<|start|>' + m['role'] + '\\n' + m['content'] + '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return make_tiny_chat_folder(tmp_path_factory.mktemp("tiny_chat"))


def make_tiny_chat_folder(folder: Path) -> Path:
    """A tiny BPE with two turn markers and a template: what any chat model folder has, in miniature."""
    from tokenizers import AddedToken, Tokenizer

    from tests.bpe import EOS, tiny_bpe

    tok = Tokenizer.from_file(str(tiny_bpe(folder)))
    tok.add_special_tokens([AddedToken("<|start|>", special=True), AddedToken("<|end|>", special=True)])
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "chat_template": TINY_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def smollm2() -> Path:
    """The cached SmolLM2 folder (checkpoint/gguf_import.py), truncated or full; skip when not converted yet."""
    from checkpoint.gguf_import import cache_root

    found = sorted(cache_root().glob("*/chat_template.jinja")) if cache_root().is_dir() else []
    if not found:
        pytest.skip("SmolLM2 is not converted here yet: python -m checkpoint.gguf_import")
    return found[0].parent


def messages() -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in CHATS.read_text().splitlines()]


def check_against_transformers(folder: Path, train_on: str = "assistant") -> None:
    from transformers import AutoTokenizer

    from data.chat import conversation, template_tokenizer

    tok, ours = template_tokenizer(folder), load_tokenizer(str(folder))
    reference = AutoTokenizer.from_pretrained(str(folder))
    for chat in messages():
        ids, mask = conversation(tok, ours, chat, train_on, "test")
        expected = reference.apply_chat_template(chat, tokenize=True)
        expected = expected["input_ids"] if not isinstance(expected, list) else expected
        assert ids.tolist() == list(expected)
        trained = ours.decode(ids[mask == 1].tolist())
        replies = [m["content"] for m in chat if m["role"] == "assistant"]
        if train_on == "all":
            assert mask.all()
            continue
        for reply in replies:
            assert reply in trained
        for m in chat:
            if m["role"] != "assistant":
                assert m["content"] not in trained
        # the reply and the template's end of turn, nothing else: as many characters as the replies + markers
        assert len(trained) < sum(len(r) for r in replies) + 20 * len(replies)


def test_tiny_template_ids_equal_apply_chat_template_and_mask_only_replies(tiny_folder):
    check_against_transformers(tiny_folder)
    check_against_transformers(tiny_folder, train_on="all")


def test_smollm2_template_ids_equal_apply_chat_template_and_mask_only_replies():
    check_against_transformers(smollm2())


def test_a_long_conversation_tokenized_in_pieces_gives_the_whole_renders_ids_and_mask(tiny_folder, monkeypatch):
    """Past ``LONG_CHARS`` a render is tokenized in pieces (data/pieces.py): the ids and the mask must be the
    whole render's. Pieces of 7 to 61 characters put cuts everywhere, inside the turn markers too (an added token
    the next piece completes must not be cut: the pieces keep back the longest one's length)."""
    import data.chat
    import data.pieces
    from data.chat import assistant_spans, conversation, template_tokenizer

    tok, ours = template_tokenizer(tiny_folder), load_tokenizer(str(tiny_folder))
    chat = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: def f(x):\n    return x * {i}  # é∑ "}
        for i in range(12)
    ]
    text, spans = assistant_spans(tok, chat, "test")
    whole = ours.encode_with_offsets(text)
    starts = np.asarray([a for a, _ in whole.offsets])
    expected_mask = np.zeros(len(whole.ids), dtype=bool)
    for a, b in spans:
        expected_mask |= (starts >= a) & (starts < b)
    cuts = []
    encode_head = data.pieces.encode_head
    monkeypatch.setattr(data.pieces, "encode_head", lambda *a: cuts.append(1) or encode_head(*a))
    monkeypatch.setattr(data.chat, "LONG_CHARS", 0)
    for piece in (7, 13, 61):
        monkeypatch.setattr(data.chat, "PIECE_CHARS", piece)
        for train_on in ("assistant", "all"):
            ids, mask = conversation(tok, ours, chat, train_on, "test")
            assert ids.tolist() == whole.ids, (piece, train_on)
            assert mask.tolist() == (expected_mask if train_on == "assistant" else np.ones(len(ids), bool)).tolist()
    assert len(cuts) > 100, "the render went through pieces"


def test_prepare_chat_writes_a_mask_and_packs_whole_conversations(tiny_folder, tmp_path, capsys):
    seq = 64
    out = tmp_path / "chat"
    args = ["--format", "chat", "--source", str(CHATS), "--tokenizer", str(tiny_folder), "--seq-len", str(seq)]
    assert prepare_main([*args, "--out", str(out)]) == 0
    header = read_header(out)
    data = open_tokens(out, header)
    assert isinstance(data, MaskedTokens)
    tokens, mask = np.asarray(data.tokens).astype(np.int64), np.asarray(data.mask)
    assert header["loss_mask"]["trained_tokens"] == int(mask.sum()) > 0
    eos = header["tokenizer"]["eos_id"]
    assert mask[tokens == eos].sum() == 0  # document ends and padding are never trained
    # whole conversations in one seq_len + 1 window wherever they fit: each starts after an EOS, and one that
    # fits in a window never crosses into the next window's targets
    ends = np.flatnonzero(tokens == eos)
    starts = [0, *(ends[:-1] + 1)]
    split = header["chat"]["split_conversations"]
    for a, b in zip(starts, ends + 1, strict=True):
        if b - a <= seq + 1 and a < ends[-1] and tokens[a] != eos:
            assert b <= (a // seq) * seq + seq + 1, (a, b)
    assert split == sum(1 for a, b in zip(starts, ends + 1, strict=True) if b - a > seq + 1)
    # --train-on all: every conversation token trained, padding and ends not
    everything = tmp_path / "all"
    assert prepare_main([*args, "--train-on", "all", "--out", str(everything)]) == 0
    all_mask = np.asarray(open_tokens(everything, read_header(everything)).mask)
    assert all_mask.sum() == int((tokens != eos).sum()) > mask.sum()


def test_chat_needs_a_template_and_a_seq_len(tmp_path, capsys):
    from tests.bpe import tiny_bpe

    bare = tiny_bpe(tmp_path / "bare").parent
    base = ["--format", "chat", "--source", str(CHATS), "--out", str(tmp_path / "o")]
    assert prepare_main([*base, "--tokenizer", str(bare), "--seq-len", "64"]) == 2
    assert "no chat template" in capsys.readouterr().err
    assert prepare_main([*base, "--tokenizer", str(bare)]) == 2
    assert "--seq-len" in capsys.readouterr().err


def test_generate_chat_prompt_and_the_export_keep_the_template(tiny_folder, tmp_path):
    from checkpoint.hf import export_tokenizer
    from data.chat import chat_prompt

    tokenizer = load_tokenizer(str(tiny_folder))
    assert chat_prompt(tokenizer, "hi") == "<|start|>user\nhi<|end|>\n<|start|>assistant\n"
    out = tmp_path / "export"
    out.mkdir()
    export_tokenizer(tokenizer, out, 128)  # the template is in tokenizer_config.json here: carried along
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == TINY_TEMPLATE
    assert chat_prompt(load_tokenizer(str(out)), "hi") == chat_prompt(tokenizer, "hi")


def test_the_banner_names_the_mask_and_a_packing_for_another_seq_len(tiny_folder, tmp_path):
    from data.dataset import packing_note

    out = tmp_path / "chat"
    args = ["--format", "chat", "--source", str(CHATS), "--tokenizer", str(tiny_folder), "--seq-len", "64"]
    assert prepare_main([*args, "--out", str(out)]) == 0
    assert packing_note(str(out), 64).startswith(", loss mask: ") and "WARNING" not in packing_note(str(out), 64)
    assert "--seq-len 128" in packing_note(str(out), 128)


# ---- no silent emptiness: a file, or a step, with no trained token ----------------------------------------


def test_prepare_refuses_conversations_with_nothing_to_train(tiny_folder, tmp_path, capsys):
    """System-only conversations prepared with ``--train-on assistant`` have no trained token: refused, exit 2,
    naming the source and both fixes; nothing is left in --out."""
    source = tmp_path / "system_only.jsonl"
    source.write_text(
        "\n".join(json.dumps({"messages": [{"role": "system", "content": f"rule {i}"}]}) for i in range(3)) + "\n"
    )
    out = tmp_path / "out"
    code = prepare_main(
        ["--format", "chat", "--source", str(source), "--tokenizer", str(tiny_folder), "--seq-len", "32"]
        + ["--out", str(out)]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert str(source) in err and "0 trained tokens" in err and "--train-on all" in err
    assert not (out / "header.json").exists() and not (out / "tokens.bin").exists()


def masked_folder(tiny_folder, out: Path, mask: np.ndarray) -> Path:
    """A token folder of random ids with the given loss mask (what an old prepare, or a hand-made file, leaves)."""
    from data.token_file import TokenFileWriter, dtype_for

    tokenizer = load_tokenizer(str(tiny_folder))
    writer = TokenFileWriter(out, dtype_for(tokenizer.vocab_size), masked=True)
    ids = np.random.default_rng(0).integers(0, 500, len(mask))
    writer.append(ids, mask)
    writer.finish({"num_documents": 1, "tokenizer": tokenizer.describe(), "source": "hand-made", "files": 1})
    return out


def test_the_run_refuses_a_data_file_with_no_trained_token(tiny_folder, tmp_path):
    from launch.local_runs import DEBUG_CONFIG, run_train_cli

    folder = masked_folder(tiny_folder, tmp_path / "empty", np.zeros(4000, dtype=np.uint8))
    proc = run_train_cli(
        1,
        "--config",
        DEBUG_CONFIG,
        "--run.dir",
        str(tmp_path / "run"),
        "--data.source",
        str(folder),
        "--data.tokenizer",
        str(tiny_folder),
        "--model.vocab_size",
        "600",
        "--training.steps",
        "1",
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert str(folder) in proc.stderr and "0 trained tokens" in proc.stderr and "--train-on all" in proc.stderr


def test_a_global_batch_with_no_trained_token_is_an_error_unless_allowed(tiny_folder, tmp_path):
    from data.loader import GlobalBatchLoader
    from runtime.config import ConfigError

    seq, batch = 16, 2
    mask = np.ones(200, dtype=np.uint8)
    mask[: seq * batch + 1] = 0  # the first global batch's targets are all masked, the rest trained
    data = open_tokens(masked_folder(tiny_folder, tmp_path / "d", mask), read_header(tmp_path / "d"))

    def loader():
        return GlobalBatchLoader(data, seq_len=seq, global_batch=batch, micro_batch=1, dp_rank=0, dp_size=1)

    strict = loader()
    with pytest.raises(ConfigError, match=r"no trained token.*--data.allow_empty_steps true"):
        strict.next_batch()
    allowed = loader()
    allowed.allow_empty_steps = True
    allowed.next_batch()
    assert allowed.trained_tokens == 0
    allowed.next_batch()  # the next batch trains
    assert allowed.trained_tokens == seq * batch


# ---- document boundaries (data/token_file.py: documents.bin) ------------------------------------------------


def test_prepare_records_where_each_document_starts_and_old_folders_still_load(tiny_folder, tmp_path):
    """Text: each document starts right after the previous one's EOS. Chat: each conversation (and each run of
    padding) starts a document, and a conversation's tokens are the ones between its start and the next. A folder
    prepared before documents.bin existed loads, with no documents."""
    from data.prepare import prepare
    from data.token_file import DOCUMENTS, open_documents

    texts = tmp_path / "docs.jsonl"
    texts.write_text("\n".join(json.dumps({"text": f"document {i} " * (1 + i)}) for i in range(7)) + "\n")
    header = prepare(str(texts), str(tiny_folder), str(tmp_path / "text"), workers=1, quiet=True)
    starts = open_documents(tmp_path / "text", read_header(tmp_path / "text"))
    tokens = np.asarray(open_tokens(tmp_path / "text", read_header(tmp_path / "text")))
    ends = np.flatnonzero(tokens == header["tokenizer"]["eos_id"])
    assert starts.tolist() == [0, *(ends[:-1] + 1).tolist()] and len(starts) == 7

    out = tmp_path / "chat"
    args = ["--format", "chat", "--source", str(CHATS), "--tokenizer", str(tiny_folder), "--seq-len", "64"]
    assert prepare_main([*args, "--out", str(out)]) == 0
    chat_header = read_header(out)
    starts = open_documents(out, chat_header)
    data = open_tokens(out, chat_header)
    tokens, eos = np.asarray(data.tokens).astype(np.int64), chat_header["tokenizer"]["eos_id"]
    bounds = [*starts.tolist(), chat_header["num_tokens"]]
    conversations = [tokens[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if tokens[a] != eos]
    assert len(conversations) == chat_header["num_documents"] == len(messages())
    assert all(c[-1] == eos and (c[:-1] != eos).all() for c in conversations)  # one conversation, its end

    (out / DOCUMENTS).unlink()
    old = {k: v for k, v in chat_header.items() if k != "documents"}
    (out / "header.json").write_text(json.dumps(old))
    assert open_documents(out, read_header(out)) is None
