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
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.config import ConfigError


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
        self.tokens = tokens
        self.seq_len, self.global_batch, self.micro_batch = seq_len, global_batch, micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.positions = positions  # the positions of each window this rank trains on; None: all of them
        self.tokens_consumed = 0  # position in the global stream, identical on every rank

    def window_starts(self, position: int) -> torch.Tensor:
        """Start offsets of this rank's windows in the global batch that begins at ``position``."""
        first = self.dp_rank * self.local_batch
        offsets = position + (first + torch.arange(self.local_batch, dtype=torch.int64)) * self.seq_len
        # Wrap around at the end of the corpus so that every window has seq_len + 1 tokens.
        return offsets % (self.num_tokens - self.seq_len)

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's (inputs, targets) micro-batches for one optimizer step; advances the position."""
        starts = self.window_starts(self.tokens_consumed)
        index = starts[:, None] + torch.arange(self.seq_len + 1)
        if isinstance(self.tokens, torch.Tensor):
            windows = self.tokens[index].long()
        else:  # numpy / memory map: reads only the pages these windows touch
            windows = torch.from_numpy(self.tokens[index.numpy()].astype(np.int64))
        self.tokens_consumed += self.global_batch * self.seq_len
        inputs, targets = windows[:, :-1], windows[:, 1:]
        if self.positions is not None:
            inputs, targets = inputs[:, self.positions], targets[:, self.positions]
        return list(zip(inputs.split(self.micro_batch), targets.split(self.micro_batch), strict=True))

    def state_dict(self) -> dict:
        return {"tokens_consumed": self.tokens_consumed}

    def load_state_dict(self, state: dict) -> None:
        self.tokens_consumed = int(state["tokens_consumed"])
