"""A loader whose state is a position in the global token stream, so it does not depend on the layout.

The corpus is one stream of tokens. Optimizer step k reads ``global_batch`` consecutive windows of
``seq_len + 1`` tokens starting at the stream position; window j starts ``j * seq_len`` tokens after it.
Data-parallel rank r of D takes windows ``[r * G/D, (r+1) * G/D)`` of that global batch, split into
micro-batches for gradient accumulation. After the step the position advances by ``G * seq_len`` tokens
on every rank, whatever D is.

So two runs with different data-parallel degrees see the same global batches in the same order, and a
checkpoint that stores ``tokens_consumed`` resumes the same stream under any other layout.

Under context parallelism the cp ranks of one data-parallel rank read the same windows, and each keeps
only its ``positions`` of every window (inputs and targets alike; mesh/context_parallel.py chooses them).

The tokens are a torch tensor (a raw corpus tokenized in memory) or a numpy array, usually the read-only
memory map of a prepared token file (data/token_file.py): a step then reads just its windows' pages from
disk, so memory does not grow with the dataset.

Given ``vocab_size``, the ids of every step are checked on the host before the batch exists (so on a GPU
before anything reaches the embedding, where an id out of range is a device-side assert that poisons the
process). The check covers the *global* batch, not only this rank's windows, so that every rank reaches the
same verdict from the same bytes, with no collective: a damaged id stops every rank with the same
ConfigError (exit 2) naming the file and the token offset, instead of one rank dying in the embedding while
the others wait in a collective. Its cost is one max over the step's ``global_batch x seq_len + 1`` ids,
read as a view of the memory map (no copy) or of the in-memory tensor; there is no device involved.

**A loss mask** (chat data: tokens given as a ``MaskedTokens``, data/token_file.py) travels with the
tokens: a target whose mask is 0 becomes ``IGNORE`` (-100, cross-entropy's ``ignore_index``), so it adds
nothing to the token-loss sum, on every layout and inside TP's ``loss_parallel`` alike. The loss divisor
is then the step's *global* number of trained targets, ``trained_tokens``, counted here on the host from
the global batch's mask (``global_batch x seq_len`` bytes of the map, like the id check): every rank computes
the same count from the same bytes with no collective, before any forward, whatever its own share of trained
tokens is (a micro-batch may have none: its sum is 0 and its gradient 0). Without a mask
``trained_tokens`` is ``global_batch x seq_len``, the divisor of every unmasked step.

**Documents** (``document_starts``: where each document of the stream starts, data/token_file.py, when
``data.document_mask`` is on): each step also gives, per micro-batch, every input position's place in its
document (``documents``: 0 where a document starts, and at the window's first token, whose document may have
begun in an earlier window), over the *whole* window even under context parallelism (every cp rank needs the
documents of the keys other ranks hold). The model then rotates each token by that position and lets it
attend only to its own document (models/llama.py: ``Transformer.forward``). Computed on the host with one
``searchsorted`` over the window's positions; nothing is read from the token file.
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.config import ConfigError

IGNORE = -100  # a target that is not trained (F.cross_entropy's default ignore_index)


class GlobalBatchLoader:
    def __init__(
        self,
        tokens: torch.Tensor,
        *,
        seq_len: int,
        global_batch: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        positions: torch.Tensor | None = None,
        vocab_size: int | None = None,
        document_starts: np.ndarray | None = None,
    ):
        self.num_tokens = int(tokens.shape[0])
        if self.num_tokens < global_batch * seq_len + 1:
            raise ConfigError(
                f"the token stream has {self.num_tokens} tokens, fewer than one global batch: training.global_batch x "
                f"training.seq_len + 1 = {global_batch * seq_len + 1}; use a larger data.source or smaller sizes."
            )
        if global_batch % dp_size:
            raise ConfigError(f"training.global_batch={global_batch} is not divisible by the dp degree {dp_size}.")
        self.local_batch = global_batch // dp_size
        if micro_batch <= 0 or self.local_batch % micro_batch:
            raise ConfigError(
                f"training.micro_batch={micro_batch} must divide the local batch {self.local_batch} "
                f"(global_batch {global_batch} / dp {dp_size})."
            )
        self.mask = getattr(tokens, "mask", None)  # a MaskedTokens: one 0/1 per token (module docstring)
        self.tokens = getattr(tokens, "tokens", tokens) if self.mask is not None else tokens
        self.trained_tokens = global_batch * seq_len  # the last batch's global count of trained targets
        self.seq_len, self.global_batch, self.micro_batch = seq_len, global_batch, micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.positions = positions  # the positions of each window this rank trains on; None: all of them
        self.vocab_size = vocab_size  # every id read must be below it (None: not checked)
        # The ids as the check reads them: an in-memory corpus (always on the host) through a numpy view made
        # once here, so that no torch op on the step's path reads a tensor back (measure/host_syncs.py).
        self.host_ids = self.tokens.numpy() if isinstance(self.tokens, torch.Tensor) else self.tokens
        self.tokens_consumed = 0  # position in the global stream, identical on every rank
        # A masked global batch with no trained target is an error (a silent step of loss 0), unless allowed
        # (data.allow_empty_steps; the validation loader allows it: its divisor sums over several batches).
        self.allow_empty_steps = False
        self.document_starts = document_starts  # None: no document masks (module docstring)
        self.documents: list[torch.Tensor] | None = None  # the last batch's, one (micro_batch, seq_len) per micro-batch

    def window_starts(self, position: int) -> torch.Tensor:
        """Start offsets of this rank's windows in the global batch that begins at ``position``."""
        first = self.dp_rank * self.local_batch
        offsets = position + (first + torch.arange(self.local_batch, dtype=torch.int64)) * self.seq_len
        # Wrap around at the end of the corpus so that every window has seq_len + 1 tokens.
        return offsets % (self.num_tokens - self.seq_len)

    def global_spans(self, position: int) -> list[tuple[int, int]]:
        """The global batch at ``position`` as contiguous [first, stop) token ranges (two or more where the stream
        wraps), in plain integers: the step reads no tensor back (measure/host_syncs.py)."""
        wrap = self.num_tokens - self.seq_len
        offsets = [(position + i * self.seq_len) % wrap for i in range(self.global_batch)]
        spans, first = [], 0
        for i in range(1, len(offsets) + 1):
            if i == len(offsets) or offsets[i] - offsets[i - 1] != self.seq_len:
                spans.append((offsets[first], offsets[i - 1] + self.seq_len + 1))
                first = i
        return spans

    def check_ids(self, position: int) -> None:
        """Every id of the global batch at ``position`` below ``vocab_size`` (module docstring), or a ConfigError
        naming the file, the token offset, the id and the fix; the same on every rank."""
        for first, stop in self.global_spans(position):
            bad = first_at_least(self.host_ids, self.vocab_size, first, stop)
            if bad is not None:
                raise ConfigError(out_of_range(self.tokens, bad, self.vocab_size))

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's (inputs, targets) micro-batches for one optimizer step; advances the position."""
        if self.vocab_size is not None:
            self.check_ids(self.tokens_consumed)
        starts = self.window_starts(self.tokens_consumed)
        index = starts[:, None] + torch.arange(self.seq_len + 1)
        if isinstance(self.tokens, torch.Tensor):
            windows = self.tokens[index].long()
        else:  # numpy / memory map: reads only the pages these windows touch
            windows = torch.from_numpy(self.tokens[index.numpy()].astype(np.int64))
        inputs, targets = windows[:, :-1], windows[:, 1:]
        if self.mask is not None:
            targets = targets.masked_fill(self.read(self.mask, index[:, 1:]) == 0, IGNORE)
            self.trained_tokens = self.global_trained_tokens(self.tokens_consumed)
            if self.trained_tokens == 0 and not self.allow_empty_steps:
                raise ConfigError(empty_step(self.tokens, self.tokens_consumed, self.global_batch, self.seq_len))
        if self.document_starts is not None:
            self.documents = list(self.document_positions(starts).split(self.micro_batch))
        self.tokens_consumed += self.global_batch * self.seq_len
        if self.positions is not None:
            inputs, targets = inputs[:, self.positions], targets[:, self.positions]
        return list(zip(inputs.split(self.micro_batch), targets.split(self.micro_batch), strict=True))

    def document_positions(self, window_starts: torch.Tensor) -> torch.Tensor:
        """(windows, seq_len) int64: each input token's position in its document, counted from the window's
        start for a document that began before it (module docstring)."""
        token = window_starts.numpy()[:, None] + np.arange(self.seq_len)
        starts = self.document_starts
        begins = starts[np.searchsorted(starts, token, side="right") - 1]
        return torch.from_numpy(token - np.maximum(begins, token[:, :1]))

    def global_trained_tokens(self, position: int) -> int:
        """The number of trained targets in the whole global batch at ``position`` (every rank, every
        micro-batch, every cp chunk): the divisor of the step's loss (module docstring)."""
        offsets = (position + torch.arange(self.global_batch, dtype=torch.int64) * self.seq_len) % (
            self.num_tokens - self.seq_len
        )
        return int(self.read(self.mask, offsets[:, None] + torch.arange(1, self.seq_len + 1)).count_nonzero())

    @staticmethod
    def read(array, index: torch.Tensor) -> torch.Tensor:
        """``array[index]`` as a torch tensor, for a torch tensor, a numpy array or a TokenMap."""
        if isinstance(array, torch.Tensor):
            return array[index]
        return torch.from_numpy(np.asarray(array[index.numpy()]))

    def state_dict(self) -> dict:
        return {"tokens_consumed": self.tokens_consumed}

    def load_state_dict(self, state: dict) -> None:
        self.tokens_consumed = int(state["tokens_consumed"])


def first_at_least(tokens, limit: int, first: int, stop: int) -> int | None:
    """The offset of the first id >= ``limit`` in ``tokens[first:stop]``, or None (one max; argmax only when
    something is out of range)."""
    if hasattr(tokens, "first_at_least"):  # a TokenMap: a view of the map, its pages given back after
        return tokens.first_at_least(limit, first, stop)
    span = tokens[first:stop]
    if len(span) == 0 or int(span.max()) < limit:
        return None
    return first + int((span >= limit).argmax())


def empty_step(tokens, position: int, global_batch: int, seq_len: int) -> str:
    """The message for a global batch whose every target is masked: the file, the position and the fixes."""
    file = getattr(tokens, "file", None)
    where = f"{file}" if file is not None else "the in-memory token stream"
    return (
        f"the global batch at token {position:,} of {where} ({global_batch} windows of {seq_len} tokens) has no "
        "trained token: every target is masked (user turns, padding), so the step would train nothing (loss 0, "
        "gradient 0). Prepare the data with more assistant replies (or --train-on all), raise training.global_batch, "
        "or pass --data.allow_empty_steps true to run such steps anyway."
    )


def out_of_range(tokens, offset: int, vocab_size: int) -> str:
    """The message for an id >= vocab_size at ``offset`` of the stream: the file and the offset in it."""
    value = int(tokens[np.array([offset])][0]) if not isinstance(tokens, torch.Tensor) else int(tokens[offset])
    file = getattr(tokens, "file", None)
    if file is None:
        where = f"the in-memory token stream holds id {value:,} at token {offset:,}"
    else:
        at = getattr(tokens, "start", 0) + offset  # a TokenMap may be a slice of its file (the validation split)
        where = f"{file} holds id {value:,} at token offset {at:,} (byte {at * tokens.dtype.itemsize:,})"
    return (
        f"{where}, but model.vocab_size={vocab_size:,} only has ids 0..{vocab_size - 1:,}: the token file is damaged "
        "(a flipped bit, a bad disk or copy) or was not written for this model. Prepare the dataset again "
        "(python -m data.prepare) or restore tokens.bin from a good copy; --checkpoint.resume auto would read the "
        "same window again."
    )
