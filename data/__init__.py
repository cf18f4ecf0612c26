"""Data: tokenizers, the corpus, data.prepare's memory-mapped token files, and the global-position loader."""
