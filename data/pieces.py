"""Tokenize a document of any length in pieces, cut where the tokenizer's own offsets say no later text can
change the tokens before the cut, so memory is bounded by the piece, not by the document.

``data.prepare`` sends ordinary documents to its workers whole; a document longer than ``LONG_CHARS``
(a 200 MB text file is one document) comes here as an iterator of text pieces of about ``PIECE_CHARS``
characters (read from disk block by block, or sliced from one long JSONL value), and ``encode_long``:

1. appends the next piece to the carry, the text not yet tokenized;
2. encodes the carry (``encode_head``), and keeps the tokens of every word except the last ``TAIL_WORDS``:
   a pre-tokenizer's word ends where its split rule (whitespace, the GPT-2 regex) says, which may depend on
   the next character, never on the text beyond the next word, so those tokens are the ones the whole
   document would give. An added token (a chat template's ``<|im_end|>``) is matched before any word, so the
   cut also stays the longest added token's length from the end. The cut is the start offset (in
   characters, from the tokenizer's ``offsets``) of the first token not kept;
3. yields the kept ids as a numpy array (no Python list of a whole document), and carries the text from the
   cut on to the next piece;
4. after the last piece, encodes what is left in full.

A carry with fewer than ``TAIL_WORDS + 1`` words (a megabyte without a space) is cut ``TAIL_TOKENS`` tokens
before its end instead, so the carry never grows beyond about one piece; such a cut may differ from whole
tokenization in the tokens at the cut (it is exact for the byte tokenizer, which has no context). A
pre-tokenizer that treats the start of the text specially (a SentencePiece-style ``Metaspace`` that
prepends its marker to the first word) may also differ at a cut; the GPT-2 style byte-level BPE of
``data.train_tokenizer`` and the tests' tokenizer give exactly the whole document's ids
(tests/test_prepare.py).

Memory: one piece of text (``PIECE_CHARS``, up to 4 bytes a character) plus the tokenizer's encoding of it
(measured: measure/prepare_memory.py), whatever the document's length.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

PIECE_CHARS = 1 << 16  # text appended to the carry per encoding (64 Ki characters)
LONG_CHARS = 1 << 18  # documents longer than this (256 Ki characters) are tokenized in pieces
TAIL_WORDS = 2  # words left for the next piece: the last may be incomplete, the one before may depend on it
TAIL_TOKENS = 16  # the fallback cut for a carry without enough words


def encode_head(tokenizer, text: str, starts: bool = False):
    """Step 2: (ids of ``text[:cut]``, cut), where no text appended after ``text`` can change those ids;
    ``starts``: also each kept token's first character in ``text`` (the chat loss mask, data/chat.py)."""
    if not hasattr(tokenizer, "encode_with_offsets"):  # the byte tokenizer: each character's bytes, whatever follows
        assert not starts, "character starts need a tokenizer.json"
        return tokenizer.encode_array(text), len(text)
    encoding = tokenizer.encode_with_offsets(text)
    n = len(encoding)
    keep, words_seen, last_word = n, 0, None
    for i in range(n - 1, -1, -1):  # walk back from the end over TAIL_WORDS whole words
        word = encoding.token_to_word(i)
        if word != last_word:
            words_seen, last_word = words_seen + 1, word
            if words_seen > TAIL_WORDS:
                break
        keep = i
    else:  # too few words in the carry: cut TAIL_TOKENS tokens before its end
        keep = max(0, n - TAIL_TOKENS)
    # An added token (a chat template's <|im_end|>) is matched in the text before any pre-tokenizer word: one
    # that the next piece completes ("<|im_" + "end|>") must not be cut. So the cut keeps back the longest
    # added token's length, moving to the start of an earlier word.
    limit = len(text) - getattr(tokenizer, "added_chars", 0)
    while 0 < keep < n and encoding.token_to_chars(keep)[0] > limit:
        word = encoding.token_to_word(keep - 1)
        keep -= 1
        while keep > 0 and word is not None and encoding.token_to_word(keep - 1) == word:
            keep -= 1
    if keep == 0:
        empty = np.zeros(0, dtype=np.uint32)
        return (empty, 0, np.zeros(0, dtype=np.int64)) if starts else (empty, 0)
    cut = encoding.token_to_chars(keep)[0] if keep < n else len(text)
    ids = np.asarray(encoding.ids[:keep], dtype=np.uint32)
    if not starts:
        return ids, cut
    return ids, cut, np.fromiter((a for a, _ in encoding.offsets[:keep]), dtype=np.int64, count=keep)


def encode_long(tokenizer, pieces: Iterable[str], starts: bool = False) -> Iterator:
    """Steps 1-4: the ids of the document made of ``pieces``, in order (no EOS: the caller packs it);
    ``starts``: (ids, each token's first character in the whole document) instead."""
    carry, consumed = "", 0
    for piece in pieces:
        carry += piece  # step 1
        head = encode_head(tokenizer, carry, starts)  # step 2
        if len(head[0]):
            yield (head[0], head[2] + consumed) if starts else head[0]  # step 3
        carry, consumed = carry[head[1] :], consumed + head[1]
    if carry:  # step 4
        if not starts:
            yield tokenizer.encode_array(carry)
            return
        encoding = tokenizer.encode_with_offsets(carry)
        first = np.fromiter((a for a, _ in encoding.offsets), dtype=np.int64, count=len(encoding))
        yield np.asarray(encoding.ids, dtype=np.uint32), first + consumed
