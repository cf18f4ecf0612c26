"""Chat data: conversations rendered with the model's own chat template, tokenized, masked and packed.

``python -m data.prepare --format chat --source X.jsonl --tokenizer FOLDER --seq-len S --out DIR`` reads one
conversation per JSONL line, ``{"messages": [{"role": "user", "content": "..."}, ...]}``, and writes the
token file of data/token_file.py with a loss mask beside it (``mask.bin``). The steps:

1. **Render** each conversation with the tokenizer folder's own chat template (``tokenizer_config.json``'s
   ``chat_template`` or ``chat_template.jinja``), by transformers' ``apply_chat_template(tokenize=False)``
   itself: the template's rules (its globals, ``raise_exception``, whitespace handling) are transformers',
   not a copy of them. The text is then tokenized by meshloom's tokenizer (the same ``tokenizer.json``);
   tests/test_chat.py checks the ids equal ``apply_chat_template(tokenize=True)``.
2. **Find the assistant's tokens** by rendering prefixes: for assistant message i, its span is the text
   between the render of ``messages[:i]`` with the generation prompt (``add_generation_prompt=True``) and
   the render of ``messages[:i + 1]``: the reply and the template's end of turn (``<|im_end|>``: the model
   must learn to stop). Every prefix render must be a prefix of the whole render, else the conversation is
   refused naming its line. A token is trained when its first character lies in an assistant span (the
   tokenizer's character offsets). Chosen over ``return_assistant_tokens_mask``, which needs the template to
   mark ``{% generation %}`` blocks: most published templates (SmolLM2's, Qwen's, Llama's) do not.
   ``--train-on all`` trains every token of the conversation instead.
3. **Pack**: each conversation is followed by the document-end token (``--eos``; default the folder's
   ``eos_token``, the one the model was trained with), never trained in assistant-only mode. The loader reads
   windows of ``seq_len + 1`` tokens at multiples of ``seq_len`` (data/loader.py); a conversation that fits in
   one window but not in what is left of the current one starts the next window, the gap filled with the
   document-end token at mask 0. A conversation longer than a window is split across windows (its start stays
   aligned). The alignment holds from the start of the stream until the loader wraps around at its end, and
   for the training split only (a ``data.val_fraction`` split starts wherever it falls).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from data.pieces import LONG_CHARS, encode_long
from data.tokenizers import check_tokenizer_folder
from runtime.config import ConfigError
from runtime.files import parse_json

TRAIN_ON = ("assistant", "all")
# Characters per piece of a long render: an Encoding with its offsets costs about 300 bytes per character, so a
# quarter of data/pieces.py's text piece keeps that cost (~10 MB) under the render's own few bytes per character
# from about 2 MB on (measure/prepare_memory.py --chat-only).
PIECE_CHARS = 1 << 14


def template_tokenizer(folder: Path):
    """transformers' tokenizer of ``folder``, which must carry a chat template."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ConfigError(
            "--format chat renders with transformers' chat template rules: pip install transformers"
        ) from exc
    check_tokenizer_folder(folder, "--tokenizer")
    try:
        tok = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:  # a malformed tokenizer_config.json, tokenizer.json, ...: the folder's fault
        raise ConfigError(
            f"--tokenizer {folder}: transformers cannot load its tokenizer ({type(exc).__name__}: {exc}); "
            "fix the folder's tokenizer files or pass a model folder that loads."
        ) from None
    if not getattr(tok, "chat_template", None):
        raise ConfigError(
            f"--tokenizer {folder} has no chat template (tokenizer_config.json chat_template or chat_template.jinja); "
            "use a model folder that has one, or prepare the text with --format text."
        )
    return tok


def render(tok, messages: list[dict], generation_prompt: bool = False, where: str = "the conversation") -> str:
    """The template's text for ``messages``; a template that rejects them (its ``raise_exception``, an undefined
    name, a syntax error) is a ConfigError naming ``where`` (file:line), the template's folder and its words."""
    from jinja2 import TemplateError, TemplateSyntaxError  # transformers renders chat templates with jinja2

    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except TemplateError as exc:
        folder = getattr(tok, "name_or_path", "?")
        if isinstance(exc, TemplateSyntaxError):
            raise ConfigError(
                f"{where}: the chat template of --tokenizer {folder} has a syntax error (line {exc.lineno}: {exc}); "
                "fix the template (tokenizer_config.json chat_template or chat_template.jinja)."
            ) from None
        raise ConfigError(
            f"{where}: the chat template of --tokenizer {folder} rejects this conversation: {exc}; fix or leave out "
            "the conversation, or use a model folder whose template accepts it."
        ) from None


def assistant_spans(tok, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The whole render and the character spans of the assistant's turns (step 2 of the docstring)."""
    text = render(tok, messages, where=where)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = render(tok, messages[:i], generation_prompt=True, where=where)
        stop = render(tok, messages[: i + 1], where=where)
        if not (text.startswith(stop) and stop.startswith(start)):
            raise ConfigError(
                f"{where}: the chat template renders message {i} differently once later messages follow, so its "
                "assistant tokens cannot be found by prefix; use --train-on all for this template."
            )
        spans.append((len(start), len(stop)))
    return text, spans


def conversation(tok, tokenizer, messages: list[dict], train_on: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of one conversation, without the document end. A render longer than ``LONG_CHARS`` is
    tokenized in pieces (data/pieces.py), as a long text document is: it then costs its text and its arrays, not
    the tokenizer's Encoding and Python lists of every token (about 300 bytes per character)."""
    text, spans = assistant_spans(tok, messages, where)
    if len(text) > LONG_CHARS:
        pieces = (text[at : at + PIECE_CHARS] for at in range(0, len(text), PIECE_CHARS))
        parts = encode_long(tokenizer, pieces, starts=True)
    else:
        encoding = tokenizer.encode_with_offsets(text)
        starts = np.fromiter((a for a, _ in encoding.offsets), dtype=np.int64, count=len(encoding))
        parts = [(np.asarray(encoding.ids, dtype=np.uint32), starts)]
    ids, masks = [], []
    for piece_ids, starts in parts:
        mask = np.full(len(piece_ids), train_on == "all")
        if train_on != "all":
            for a, b in spans:
                mask |= (starts >= a) & (starts < b)
        ids.append(piece_ids)
        masks.append(mask.astype(np.uint8))
    if not ids:
        return np.zeros(0, dtype=np.uint32), np.zeros(0, dtype=np.uint8)
    return np.concatenate(ids), np.concatenate(masks)


def conversations(path: Path) -> Iterator[tuple[list[dict], str]]:
    """Each line's messages and ``file:line``, read a line at a time (a file of many conversations costs one)."""
    try:
        with open(path, "rb") as f:
            yield from _conversations(path, f)
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read ({exc.strerror or exc}); fix its permissions or --source.") from None


def _conversations(path: Path, f) -> Iterator[tuple[list[dict], str]]:
    at = 0  # bytes before this line
    for n, raw in enumerate(f, start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{path}: byte {at + exc.start} is not UTF-8 ({exc.reason}); chat JSONL is UTF-8 text: convert the "
                "file (e.g. iconv -f latin1 -t utf-8) or move it out of --source."
            ) from None
        at += len(raw)
        del raw
        if not line.strip():
            continue
        where = f"{path}:{n}"
        record = parse_json(line, where, "each line must be a JSON object with a 'messages' list.")
        if not isinstance(record, dict) or "messages" not in record:
            raise ConfigError(f"{where}: not a JSON object with a 'messages' list")
        messages = record["messages"]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ConfigError(f"{where}: 'messages' must be a list of {{'role': str, 'content': str}}")
        del line, record  # while the caller renders, only the messages are held
        yield messages, where


class Packer:
    """Appends conversations to a masked TokenFileWriter, aligned to the loader's windows (step 3)."""

    def __init__(self, writer, seq_len: int, eos_id: int):
        self.writer, self.seq_len, self.eos_id = writer, seq_len, eos_id
        self.split = 0  # conversations longer than one window

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        ids, mask = np.append(ids, self.eos_id), np.append(mask, 0).astype(np.uint8)
        window = self.seq_len + 1
        at = self.writer.num_tokens
        room = (at // self.seq_len) * self.seq_len + window - at
        if len(ids) > room and at % self.seq_len:  # start at the next window (a long one too: aligned)
            gap = self.seq_len - at % self.seq_len
            # the padding is a document of its own: under a document mask nothing attends to it
            self.writer.append(np.full(gap, self.eos_id, dtype=np.int64), np.zeros(gap, dtype=np.uint8), starts=[0])
        self.split += len(ids) > window
        self.writer.append(ids, mask, starts=[0])


def chat_prompt(tokenizer, user: str) -> str:
    """``user`` as the one user turn of a conversation, rendered with the generation prompt by the chat template
    of the folder that holds ``tokenizer``'s tokenizer.json (``python -m generate --chat``)."""
    file = getattr(tokenizer, "file", None)
    if file is None:
        raise ConfigError("--chat needs a tokenizer folder with a chat template, not the byte tokenizer")
    tok = template_tokenizer(Path(file).parent)
    return render(tok, [{"role": "user", "content": user}], generation_prompt=True, where=f"--prompt {user!r}")
