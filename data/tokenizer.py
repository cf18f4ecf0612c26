"""A byte-level tokenizer: token id = byte value. No vocabulary file, no download, 256 ids."""

from __future__ import annotations

import torch

VOCAB_SIZE = 256


def encode(text: str | bytes) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a uint8 tensor (ids 0..255)."""
    raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def decode(ids: torch.Tensor | list[int]) -> str:
    """The text whose UTF-8 bytes are ``ids``; invalid sequences become U+FFFD."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    return bytes(values).decode("utf-8", errors="replace")
