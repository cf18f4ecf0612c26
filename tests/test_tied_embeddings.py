"""Tied embeddings: one weight for the embedding and the output head (model.tie_embeddings).

One process: the tie survives the meta-device build and materialisation, the weight is counted, initialised,
trained and saved once. Every layout (FSDP, TP, pipelines, a V schedule) then trains the same model as one
process, and a checkpoint of one layout resumes on another (mesh/tied_embeddings.py, docs/checkpointing.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from checkpoint.state import expected_entries, stored_names, with_tied_head
from launch.local_runs import DEBUG_CONFIG, PARITY_STEPS
from mesh.memory_estimate import stage_parameters
from mesh.pipeline import build_stage_module
from models.llama import ModelArgs, Transformer
from runtime.config import load_config
from tests.reference import reference_losses
from tests.training_runs import assert_same_curve

TIED = {"model.tie_embeddings": True}


def tiny(tied: bool = True) -> ModelArgs:
    return ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32, tie_embeddings=tied)


def build(args: ModelArgs, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    return model.init_weights(seed)


def test_one_weight_survives_materialisation_and_is_counted_once():
    model = build(tiny())
    # to_empty replaces the Parameter objects (checked here, so that the re-tie is known to be needed)
    with torch.device("meta"):
        bare = Transformer(tiny())
    bare.to_empty(device="cpu")
    assert bare.output.weight is not bare.tok_embeddings.weight, "torch kept the tie: tie_weights is redundant"
    assert model.output.weight is model.tok_embeddings.weight
    names = [name for name, _ in model.named_parameters()]
    assert "tok_embeddings.weight" in names and "output.weight" not in names
    counted = sum(p.numel() for p in model.parameters())
    args, untied = tiny(), tiny(tied=False)
    assert counted == args.num_params() == untied.num_params() - untied.vocab_size * untied.dim
    assert sum(stage_parameters(args, range(2), True, True).values()) == counted
    # Pipeline stages: the first and the last each hold a copy (the V-schedule rank holds both stages).
    first, last = stage_parameters(args, [0], True, False), stage_parameters(args, [1], False, True)
    assert sum(first.values()) + sum(last.values()) == counted + args.vocab_size * args.dim


def test_initial_value_is_the_embeddings_for_every_copy():
    args = tiny()
    model = build(args, seed=7)
    # The head's unit-logit scale, not N(0, 1): the weight is also the head.
    assert abs(model.tok_embeddings.weight.std().item() - args.dim**-0.5) < 0.02
    last = build_stage_module(args, [1], is_first=False, is_last=True).init_weights(7)
    assert torch.equal(last.output.weight, model.tok_embeddings.weight)
    untied = build(tiny(tied=False), seed=7)
    assert not torch.equal(untied.output.weight, untied.tok_embeddings.weight)


def test_the_gradient_is_the_sum_of_the_embeddings_and_the_heads():
    """The tied weight's gradient = the untied model's embedding gradient + head gradient at equal weights:
    what the pipeline's gradient sum over the first and last stage reproduces."""
    tied, untied = build(tiny()), build(tiny(tied=False))
    untied.load_state_dict(tied.state_dict())  # both untied weights take the tied value
    tokens = torch.randint(0, 64, (2, 9))
    for model in (tied, untied):
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    summed = untied.tok_embeddings.weight.grad + untied.output.weight.grad
    torch.testing.assert_close(tied.tok_embeddings.weight.grad, summed, rtol=1e-5, atol=1e-7)


def test_the_checkpoint_names_it_once():
    model = build(tiny())
    saved = stored_names(model.args, model.state_dict())
    assert "tok_embeddings.weight" in saved and "output.weight" not in saved
    with torch.device("meta"):
        entries = expected_entries(Transformer(tiny()))
    assert "model.output.weight" not in entries and "optim.state.output.weight.exp_avg" not in entries
    # A pipeline last stage's copy is saved (and loaded) under the embedding's name, Adam state included.
    stage = {"output.weight": 1, "norm.weight": 2}
    optim = {"state.output.weight.exp_avg": 3, "param_groups.output.weight.lr": 4, "state.norm.weight.step": 5}
    assert stored_names(tiny(), stage) == {"tok_embeddings.weight": 1, "norm.weight": 2}
    renamed = stored_names(tiny(), optim)
    assert set(renamed) == {
        "state.tok_embeddings.weight.exp_avg",
        "param_groups.tok_embeddings.weight.lr",
        "state.norm.weight.step",
    }
    assert with_tied_head(tiny(), renamed)["state.output.weight.exp_avg"] == 3
    assert stored_names(tiny(tied=False), stage) == stage


def test_one_process_matches_a_plain_training_loop(shared_runs):
    cfg = load_config(path=DEBUG_CONFIG, overrides={"training.steps": PARITY_STEPS, **TIED})
    run = shared_runs.records(TIED)
    # As tests/test_parity_dp.py: the same single-device arithmetic up to the loss's sum-then-divide.
    assert_same_curve(run, reference_losses(cfg))
    assert run[-1]["loss"] < run[0]["loss"] - 0.5
