"""A small byte-level BPE tokenizer.json trained on the default corpus with `tokenizers` (no download)."""

from __future__ import annotations

import os
from pathlib import Path

EOS = "<|endoftext|>"


def train_bpe(out_dir: Path, vocab_size: int = 512, n_files: int = 40) -> Path:
    """Train on the first ``n_files`` files of the default corpus; returns the tokenizer.json path."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no thread pool to trip over later forks
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from data.corpus import corpus_files

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train([str(f) for f in corpus_files("default")[:n_files]], trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    return out_dir / "tokenizer.json"
