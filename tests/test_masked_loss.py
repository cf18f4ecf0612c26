"""A loss mask (chat data) gives the same loss and gradients on every layout as one process.

The masked loss is the sum over trained targets divided by the step's *global* count of trained targets
(training/loss.py, data/loader.py). The mask below makes that count differ between data-parallel ranks,
micro-batches, pipeline micro-batches and cp chunks, with one micro-batch of no trained target at all, so a
layout that divided by any local count (or by the constant global_batch x seq_len) would drift at once.
"""

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data.loader import IGNORE, GlobalBatchLoader
from data.token_file import MaskedTokens, TokenFileWriter, open_tokens, read_header
from data.tokenizers import load_tokenizer
from launch.local_runs import ROOT, train_on
from tests.training_runs import assert_same_curve

SEQ, BATCH, STEPS = 128, 8, 3  # configs/debug.toml's batch and sequence length; three optimizer steps


def window_mask(n_tokens: int) -> np.ndarray:
    """One 0/1 per token (as a target). Window w of a step (targets w*SEQ+1 .. w*SEQ+SEQ of it):

    - windows 0, 1: dense (every target but every 7th);
    - windows 2, 3: no trained target (a whole micro-batch of 2 windows: accumulation and pp 4 x 2 windows);
    - windows 4-7: sparse, only in the first 40 positions (every 3rd): so fsdp rank 1 has far fewer trained
      targets than rank 0, and under cp 2 (chunks of 32: rank 0 holds 0-31 and 96-127) rank 1 only 8 a window.
    """
    p = np.arange(n_tokens) - 1  # target index p -> its position in the stream of windows
    window, pos = (p // SEQ) % BATCH, p % SEQ
    dense = (window < 2) & (pos % 7 != 0)
    sparse = (window >= 4) & (pos < 40) & (pos % 3 == 0)
    return (dense | sparse).astype(np.uint8)


def fixed_bytes(n: int) -> np.ndarray:
    """``n`` byte tokens that never change: SHA-256 of 0, 1, 2, ... concatenated. Not README.md's text, which
    changes with every edit and would move the figures docs/00_foundations.md quotes from this data."""
    stream = b"".join(hashlib.sha256(i.to_bytes(4, "little")).digest() for i in range(n // 32 + 1))
    return np.frombuffer(stream[:n], dtype=np.uint8).astype(np.uint16)


def write_masked_folder(folder: Path) -> Path:
    n = BATCH * SEQ * (STEPS + 2) + 1  # the steps, and a held-out batch for the validation test
    writer = TokenFileWriter(folder, "uint16", masked=True)
    writer.append(fixed_bytes(n), window_mask(n))
    writer.finish({"num_documents": 1, "tokenizer": load_tokenizer("bytes").describe(), "source": "fixed_bytes"})
    return folder


@pytest.fixture(scope="module")
def masked_folder(tmp_path_factory) -> Path:
    return write_masked_folder(tmp_path_factory.mktemp("masked") / "data")


def test_the_loader_masks_targets_and_counts_the_global_batch(masked_folder):
    tokens = open_tokens(masked_folder, read_header(masked_folder))
    assert isinstance(tokens, MaskedTokens)
    counts = []
    for rank in range(2):
        loader = GlobalBatchLoader(tokens, seq_len=SEQ, global_batch=BATCH, micro_batch=2, dp_rank=rank, dp_size=2)
        batch = loader.next_batch()
        counts.append([int((targets != IGNORE).sum()) for _, targets in batch])
        assert loader.trained_tokens == int(window_mask(BATCH * SEQ + 1)[1:].sum())  # the whole global batch
    assert counts == [[218, 0], [28, 28]]  # per rank and micro-batch: uneven, one micro-batch empty
    assert loader.trained_tokens == sum(map(sum, counts))


def test_an_empty_micro_batch_contributes_zero_not_nan():
    logits = torch.randn(1, 4, 8, requires_grad=True)
    loss = F.cross_entropy(logits.flatten(0, 1), torch.full((4,), IGNORE), reduction="sum") / 1
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits.grad))


@pytest.fixture(scope="module")
def masked_one_process(masked_folder, tmp_path_factory) -> list[dict]:
    return train_on(1, {"data.source": str(masked_folder), "training.steps": STEPS}, tmp_path_factory.mktemp("one"))


LAYOUTS = {
    "fsdp2": (2, {"parallel.dp_shard": 2}),
    "pp2_1f1b_4mb": (2, {"parallel.pp": 2, "parallel.pp_microbatches": 4, "parallel.pp_schedule": "1F1B"}),
    "fsdp2_accumulation2": (2, {"parallel.dp_shard": 2, "training.micro_batch": 2}),
    "cp2": (2, {"parallel.cp": 2}),
    "tp2": (2, {"parallel.tp": 2}),  # the ignored targets inside loss_parallel's vocab-sharded cross-entropy
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_masked_loss_matches_one_process(layout, masked_folder, masked_one_process, tmp_path):
    world, knobs = LAYOUTS[layout]
    run = train_on(world, {"data.source": str(masked_folder), "training.steps": STEPS, **knobs}, tmp_path)
    # fp32 on both sides; only the order of the sums differs (per rank, per micro-batch, then all-reduced):
    # ~1e-7 relative, so assert_same_curve's 1e-5 is generous and far below the wrong ways' error (>1e-2).
    assert_same_curve(run, masked_one_process)


def test_the_masked_loss_is_the_mean_over_trained_targets(masked_folder, masked_one_process, tmp_path):
    # The same tokens without their mask train on every target: another loss from the first step on.
    plain = tmp_path / "plain"
    writer = TokenFileWriter(plain, "uint16")
    writer.append(np.asarray(open_tokens(masked_folder, read_header(masked_folder)).tokens))
    writer.finish({"num_documents": 1, "tokenizer": load_tokenizer("bytes").describe(), "source": "fixed_bytes"})
    unmasked = train_on(1, {"data.source": str(plain), "training.steps": 1}, tmp_path / "run")
    assert abs(unmasked[0]["loss"] - masked_one_process[0]["loss"]) > 1e-3


def masked_batch_losses(masked_folder):
    """The debug model at step 0 (configs/debug.toml, seed 1234) and its per-window token losses on the first
    global batch of the masked folder: (model, per-window losses [BATCH, SEQ], trained [BATCH, SEQ])."""
    from models.llama import ModelArgs, Transformer
    from runtime.config import load_config

    m = load_config(path=str(ROOT / "configs" / "debug.toml")).model
    args = ModelArgs(dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads)
    args.vocab_size, args.multiple_of, args.max_seq_len = m.vocab_size, m.multiple_of, m.max_seq_len
    with torch.device("meta"):
        model = Transformer(args)
    model.init_weights(1234)
    tokens = open_tokens(masked_folder, read_header(masked_folder))
    loader = GlobalBatchLoader(tokens, seq_len=SEQ, global_batch=BATCH, micro_batch=BATCH, dp_rank=0, dp_size=1)
    ((inputs, targets),) = loader.next_batch()
    losses = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten(), reduction="none")
    return model, losses.view(BATCH, SEQ), targets != IGNORE


def wrong_way_errors(masked_folder) -> dict:
    """The step-0 loss and gradient of three recipes on fsdp 2 x accumulation 2 (4 micro-batches of 2 windows,
    2 per rank) against the exact one: the global sum over the global trained count."""
    model, losses, trained = masked_batch_losses(masked_folder)
    groups = {"micro-batch": [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)], "rank": [slice(0, 4), slice(4, 8)]}
    recipes = {"global count (meshloom)": losses.sum() / trained.sum()}
    for name, parts in groups.items():
        # each group's own mean, averaged over the groups (a group with no trained target is skipped: its
        # own mean would be 0/0 = NaN)
        means = [losses[p].sum() / trained[p].sum() for p in parts if trained[p].sum() > 0]
        recipes[f"per-{name} mean, averaged"] = sum(means) / len(means)
    figures = {}
    exact_loss, exact_grad = None, None
    for name, loss in recipes.items():
        model.zero_grad()
        loss.backward(retain_graph=True)
        grad = torch.cat([p.grad.flatten() for p in model.parameters()])
        if exact_grad is None:
            exact_loss, exact_grad = loss.item(), grad
        figures[name] = (
            loss.item(),
            abs(loss.item() - exact_loss) / exact_loss,
            ((grad - exact_grad).norm() / exact_grad.norm()).item(),
        )
    return figures


def test_the_one_process_run_gives_the_exact_masked_mean(masked_folder, masked_one_process):
    _, losses, trained = masked_batch_losses(masked_folder)
    exact = (losses.sum() / trained.sum()).item()  # masked targets' losses are 0 (ignored)
    # the same fp32 forward; train.py sums in another order: ~1e-7 relative
    assert masked_one_process[0]["loss"] == pytest.approx(exact, rel=1e-5)


def test_the_wrong_ways_differ_from_one_process(masked_folder):
    figures = wrong_way_errors(masked_folder)
    for name, (loss, loss_err, grad_err) in figures.items():
        print(f"{name}: loss {loss:.5f}, loss error {loss_err:.2e}, gradient error {grad_err:.2e}")
    assert figures["global count (meshloom)"][1:] == (0.0, 0.0)
    for name in ("per-micro-batch mean, averaged", "per-rank mean, averaged"):
        assert figures[name][1] > 1e-3 and figures[name][2] > 1e-2, name  # far outside fp32 noise (1e-6)


def test_another_mask_on_the_same_tokens_is_another_stream(masked_folder, tmp_path):
    from data.dataset import stream_digest

    tokens = np.asarray(open_tokens(masked_folder, read_header(masked_folder)).tokens)
    other = tmp_path / "all"
    writer = TokenFileWriter(other, "uint16", masked=True)
    writer.append(tokens, np.ones(len(tokens), dtype=np.uint8))
    writer.finish({"num_documents": 1, "tokenizer": load_tokenizer("bytes").describe(), "source": "fixed_bytes"})
    assert read_header(other)["tokens_sha256"] == read_header(masked_folder)["tokens_sha256"]
    assert stream_digest(str(other)) != stream_digest(str(masked_folder))  # a resume across them is refused


def test_the_masked_validation_loss_matches_one_process(masked_folder, tmp_path):
    # the last quarter held out (1,280 tokens: one global batch); evaluated after the last step
    knobs = {"data.source": str(masked_folder), "training.steps": 2, "data.val_fraction": 0.25, "eval.interval": 2}
    knobs["eval.steps"] = 1
    one = train_on(1, knobs, tmp_path / "one")
    many = train_on(2, {**knobs, "parallel.dp_shard": 2, "training.micro_batch": 2}, tmp_path / "fsdp2")
    assert one[-1]["val_loss"] == pytest.approx(many[-1]["val_loss"], rel=1e-5)  # fp32, other sum order
    assert 0 < one[-1]["val_loss"] < 10
