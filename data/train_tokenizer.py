"""Train a byte-level BPE tokenizer.json on your own text, when you do not bring one (GPT-2, Llama 3, ...).

    python -m data.train_tokenizer --source default --vocab-size 4096 --out runs/tok

Reads ``--source`` exactly as ``python -m data.prepare`` does (a text/JSONL/Parquet file, a folder of them,
or ``default``), trains a byte-level BPE with the ``tokenizers`` library (the ``data`` extra) whose only
special token is ``<|endoftext|>`` (id 0, the EOS that packs documents), and writes ``OUT/tokenizer.json``.
Byte-level means every UTF-8 string has an encoding: no unknown tokens, whatever the text.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from data.prepare import Progress, Utf8, documents, source_files
from data.tokenizers import import_tokenizers
from runtime.config import ConfigError
from runtime.options import count_option, path_option, text_option

EOS = "<|endoftext|>"


def train_bpe(source: str, vocab_size: int, out_dir: str | Path, text_field: str = "text", max_files: int = 0) -> Path:
    """Train on the documents of ``source`` (the first ``max_files`` files when > 0); returns the file."""
    if vocab_size < 257:
        raise ConfigError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least 257 (256 bytes + EOS).")
    out = Path(out_dir) / "tokenizer.json"
    if out.exists():
        raise ConfigError(f"{out} already exists; meshloom never overwrites it: choose another --out.")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no thread pool left behind for later forks
    tk = import_tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = source_files(source)[: max_files or None]
    texts = documents(files, text_field, Progress(files, stream=None), Utf8("replace"))  # as it always read them
    tokenizer.train_from_iterator(texts, trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out))
    return out


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py): a bad value is refused with exit 2."""
    parser = argparse.ArgumentParser(prog="python -m data.train_tokenizer", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--source", required=True, type=path_option(), help="a text/JSONL/Parquet file, a folder of them, or 'default'"
    )
    parser.add_argument("--vocab-size", type=count_option(ge=257), default=4096)
    parser.add_argument("--out", required=True, type=path_option(), help="folder for tokenizer.json")
    parser.add_argument(
        "--text-field",
        default="text",
        type=text_option(nonempty=True),
        help="JSONL field / Parquet column with the text",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    try:
        out = train_bpe(opts.source, opts.vocab_size, opts.out, opts.text_field)
    except ConfigError as exc:
        print(f"meshloom train_tokenizer: error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(f"trained a {opts.vocab_size}-token byte-level BPE on {opts.source} -> {out} (EOS {EOS} = id 0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
