"""Document masks, measured: how far packing without them moves each conversation's loss.

    .venv/bin/python -m measure.document_masks                 # SmolLM2-135M-Instruct, if converted (about 1 min)
    .venv/bin/python -m measure.document_masks --model DIR --seq-len 512

1. Prepare the sample conversations (examples/chat_sample.jsonl) with the model folder's chat template, packed
   for ``--seq-len`` windows (data/chat.py), assistant tokens trained.
2. Read the windows as the loader does (starts at multiples of seq_len) and compute every target's loss three
   ways with the same weights: each conversation run **alone** (its own forward, positions from 0); the window
   **masked** (``documents``: what meshloom trains with data.document_mask on); the window **old** (plain causal
   attention over the whole window, data.document_mask off: a conversation sees those packed before it).
3. Print, per conversation with trained tokens, the mean loss of its trained tokens alone, and the masked and
   the old loss minus it; then the largest difference of each. The masked one is rounding; the old one is
   what the conversations packed before a conversation did to its loss.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from runtime.options import count_option, path_option

ROOT = Path(__file__).resolve().parents[1]


def default_model() -> Path:
    from checkpoint.gguf_import import smollm2_folder

    return smollm2_folder()


def losses_by_conversation(model, data: Path, seq_len: int) -> list[tuple[int, float, float, float]]:
    """(conversation index, mean trained loss alone, masked, old) per conversation with trained targets."""
    from data.token_file import open_documents, open_tokens, read_header

    header = read_header(data)
    stream = open_tokens(data, header)
    tokens = torch.from_numpy(np.asarray(stream.tokens).astype(np.int64))
    mask = torch.from_numpy(np.asarray(stream.mask).astype(bool))
    starts = open_documents(data, header)
    eos = header["tokenizer"]["eos_id"]
    sums: dict[int, list[float]] = {}
    with torch.no_grad():
        for a in range(0, len(tokens) - seq_len, seq_len):
            window = tokens[a : a + seq_len + 1]
            token = np.arange(a, a + seq_len)
            doc = np.searchsorted(starts, token, side="right") - 1
            positions = torch.from_numpy(token - np.maximum(starts[doc], a))
            targets = window[1:]
            masked = F.cross_entropy(model(window[None, :-1], documents=positions[None])[0], targets, reduction="none")
            old = F.cross_entropy(model(window[None, :-1])[0], targets, reduction="none")
            alone = torch.empty_like(old)
            cuts = [*torch.nonzero(positions == 0).flatten().tolist(), seq_len]
            for x, y in zip(cuts, cuts[1:], strict=False):
                alone[x:y] = F.cross_entropy(model(window[None, x:y])[0], window[x + 1 : y + 1], reduction="none")
            trained = mask[a + 1 : a + seq_len + 1]
            for i in torch.nonzero(trained).flatten().tolist():
                if tokens[starts[doc[i]]] == eos:  # padding: never trained, listed for completeness
                    continue
                row = sums.setdefault(int(doc[i]), [0.0, 0.0, 0.0, 0])
                row[0] += alone[i].item()
                row[1] += masked[i].item()
                row[2] += old[i].item()
                row[3] += 1
    rows = []
    for k, (doc_index, (s_alone, s_masked, s_old, n)) in enumerate(sorted(sums.items())):
        del doc_index
        rows.append((k, s_alone / n, s_masked / n, s_old / n))
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py; tests/test_input_walk.py walks them)."""
    parser = argparse.ArgumentParser(prog="python -m measure.document_masks", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        type=path_option(required=False),
        default="",
        help="a transformers chat model folder (default: SmolLM2, converted)",
    )
    parser.add_argument(
        "--seq-len", type=count_option(ge=2), default=256, help="the windows conversations are packed for"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    opts = parser.parse_args(argv)
    torch.manual_seed(0)
    from data.prepare import prepare_chat
    from generate import load_export
    from runtime.config import ConfigError

    folder = Path(opts.model) if opts.model else default_model()
    try:
        model, _ = load_export(folder)
    except ConfigError as err:
        parser.error(f"--model {folder}: {err}")
    model.eval()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "chat"
        prepare_chat(str(ROOT / "examples" / "chat_sample.jsonl"), str(folder), str(data), seq_len=opts.seq_len)
        rows = losses_by_conversation(model, data, opts.seq_len)
    print(f"{folder}: conversations packed for seq_len {opts.seq_len}; mean loss of each one's trained tokens")
    print(f"{'conv':>4} | {'alone':>8} | {'masked - alone':>14} | {'old - alone':>12}")
    for k, alone, masked, old in rows:
        print(f"{k:>4} | {alone:8.4f} | {masked - alone:+14.2e} | {old - alone:+12.2e}")
    worst_masked = max(abs(m - a) for _, a, m, _ in rows)
    worst_old = max(abs(o - a) for _, a, _, o in rows)
    print(f"largest |masked - alone| {worst_masked:.2e}; largest |old - alone| {worst_old:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
