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
    """A tiny BPE with two turn markers and a template: what any chat model folder has, in miniature."""
    from tokenizers import AddedToken, Tokenizer

    from tests.bpe import EOS, tiny_bpe

    folder = tmp_path_factory.mktemp("tiny_chat")
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
