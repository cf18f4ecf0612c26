"""A small byte-level BPE tokenizer.json trained on the default corpus with `tokenizers` (no download)."""

from __future__ import annotations

from pathlib import Path

from data.train_tokenizer import EOS, train_bpe

__all__ = ["EOS", "tiny_bpe"]


def tiny_bpe(out_dir: Path, vocab_size: int = 512, n_files: int = 40) -> Path:
    """A ``vocab_size``-token BPE trained on the first ``n_files`` files of the default corpus."""
    return train_bpe("default", vocab_size, out_dir, max_files=n_files)
