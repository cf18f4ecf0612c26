"""Tokenizer, corpus and the global-position loader."""
