"""Tied embeddings: one weight for the embedding and the output head (model.tie_embeddings).

One process: the tie survives the meta-device build and materialisation, the weight is counted, initialised,
trained and saved once. Every layout (FSDP, TP, pipelines, a V schedule) then trains the same model as one
process, and a checkpoint of one layout resumes on another (mesh/tied_embeddings.py, docs/checkpointing.md).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from checkpoint.state import expected_entries, stored_names, with_tied_head
from launch.local_runs import DEBUG_CONFIG, PARITY_STEPS, train_on
from mesh.pipeline import build_stage_module
from mesh.tied_embeddings import embedding_group_ranks
from models.llama import ModelArgs, Transformer
from planning.memory_estimate import stage_parameters
from runtime.config import load_config
from tests.reference import reference_losses
from tests.training_runs import CHECK_REPLICAS, LOSS_RTOL, assert_same_curve

TIED = {"model.tie_embeddings": True}
# Multi-rank runs also compare the two pipeline copies every step (observers/replica_check.py: tied_replicas).
TIED_CHECKED = {**TIED, **CHECK_REPLICAS}
# The one-process reference also saves at steps 3 and 6 (saving does not change the curve): one run serves the
# parity tests and the resume from a whole model's checkpoint.
TIED_SAVING = {**TIED, "checkpoint.interval": 3}


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


@pytest.fixture(scope="module")
def tied_reference(shared_runs) -> list[dict]:
    """configs/debug.toml with tied embeddings on one process (train.py's core), saving at steps 3 and 6."""
    return shared_runs.records(TIED_SAVING)


def test_one_process_matches_a_plain_training_loop(tied_reference):
    cfg = load_config(path=DEBUG_CONFIG, overrides={"training.steps": PARITY_STEPS, **TIED})
    run = tied_reference
    # As tests/test_parity_dp.py: the same single-device arithmetic up to the loss's sum-then-divide.
    assert_same_curve(run, reference_losses(cfg))
    assert run[-1]["loss"] < run[0]["loss"] - 0.5


# ---- the layouts' structure, built by train.py on a fake world (nothing is sent) -------------------------------


def placements_and_pieces(world: int, rank: int, overrides: dict) -> list[tuple]:
    """(module, placements, local shape, whether tied) of each tied-weight copy train.py builds on ``rank``."""
    from tests.test_materialize import build_on_stand_in

    parts, _ = build_on_stand_in(world, rank, DEBUG_CONFIG, {**TIED, **overrides})
    found = []
    for part in parts:
        for module in ("tok_embeddings", "output"):
            if getattr(part, module) is not None:
                weight = getattr(part, module).weight
                tied = part.tok_embeddings is not None and part.output is not None
                assert not tied or part.output.weight is part.tok_embeddings.weight, "the tie was lost"
                found.append((module, tuple(weight.placements), tuple(weight.to_local().shape)))
    return found


def test_fsdp_and_tp_hold_one_dtensor_sharded_once():
    # fsdp2 x tp2: one Parameter, sharded over dp_shard and tp (FSDP over TP: _StridedShard on dim 0).
    found = placements_and_pieces(4, 0, {"parallel.tp": 2, "parallel.dp_shard": 2})
    assert [module for module, *_ in found] == ["tok_embeddings", "output"]
    assert found[0][1:] == found[1][1:]
    assert found[0][2] == (256 // 4, 128), "a quarter of the vocab rows on each of the 4 ranks"


def test_pipeline_copies_have_the_same_placements_at_the_same_coordinate():
    # pp2 x dp2 x tp2: global rank 0 holds the first stage, rank 4 the last, at the same (dp, tp) coordinate.
    layout = {"parallel.pp": 2, "parallel.dp_shard": 2, "parallel.tp": 2}
    (first,) = placements_and_pieces(8, 0, layout)
    last = [copy for copy in placements_and_pieces(8, 4, layout) if copy[0] == "output"]
    assert first[0] == "tok_embeddings" and last[0][1:] == first[1:]
    # V schedule: both ends on pp rank 0, in two stage modules, with the same placements.
    v = placements_and_pieces(4, 0, {"parallel.pp": 2, "parallel.dp_shard": 2, "parallel.pp_schedule": "DualPipeV"})
    assert [module for module, *_ in v] == ["tok_embeddings", "output"] and v[0][1:] == v[1][1:]


def test_embedding_groups_pair_the_first_and_last_pp_rank_of_each_coordinate():
    from docs.figures.tied_embeddings import TIED_EXAMPLE, tied_groups
    from measure.schedule_ir import fake_world
    from mesh.dims import ParallelDims, build_mesh

    world = torch.arange(4 * 2 * 2).reshape(4, 1, 2, 1, 2)  # (pp, dp_replicate, dp_shard, cp, tp) = 4 x 2 x 2
    assert embedding_group_ranks(world) == [[0, 12], [1, 13], [2, 14], [3, 15]]
    # The chapter's picture (pp 4 x dp_shard 2) shows the groups of meshloom's real world mesh.
    pp, dp = TIED_EXAMPLE["pp"], TIED_EXAMPLE["dp_shard"]
    dims = ParallelDims(pp=pp, dp_replicate=1, dp_shard=dp, cp=1, tp=1, ep=1, world_size=pp * dp)
    with fake_world(pp * dp):
        meshes = build_mesh(dims, torch.device("cpu"), 60, has_experts=False)
        assert embedding_group_ranks(meshes.world.mesh) == tied_groups(pp, dp) == [[0, 6], [1, 7]]


# ---- training parity and resuming across layouts ------------------------------------------------------------

PP2 = {"parallel.pp": 2, "parallel.dp_shard": 1}
TP2 = {"parallel.tp": 2, "parallel.dp_shard": 1}
ZBV = {**PP2, "parallel.pp_schedule": "ZBVZeroBubble", "parallel.pp_microbatches": 4}


def test_pipeline_matches_one_process_and_its_checkpoint_resumes_on_tensor_parallel(tied_reference, tmp_path):
    """pp2 (1F1B): the copies' gradients summed over the embedding group; saved at step 3 (the last stage's head
    under tok_embeddings.weight), resumed on tp2, where the head *is* the embedding: the same curve."""
    assert_same_curve(train_on(2, {**TIED_CHECKED, **PP2, "checkpoint.interval": 3}, tmp_path / "pp2"), tied_reference)
    saved = tmp_path / "pp2" / "checkpoints"
    resumed = train_on(2, {**TIED, **TP2, "checkpoint.folder": str(saved), "checkpoint.resume": "3"}, tmp_path / "tp2")
    assert_same_curve(resumed, tied_reference[3:])


def test_v_schedule_matches_one_process(tied_reference, tmp_path):
    """ZBVZeroBubble: pp rank 0 holds the embedding (stage 0) and the head (stage 3); the sum is local."""
    assert_same_curve(train_on(2, {**TIED_CHECKED, **ZBV}, tmp_path), tied_reference)


SLOW_LAYOUTS = {
    "fsdp2": (2, {"parallel.dp_shard": 2}),
    "tp2": (2, TP2),
    "pp2xtp2": (4, {"parallel.pp": 2, "parallel.tp": 2, "parallel.dp_shard": 1}),
    "pp4": (4, {"parallel.pp": 4, "parallel.dp_shard": 1}),  # pp > 2: the embedding group is a group of its own
    # looped: stages 0, 2 on pp rank 0 and 1, 3 on pp rank 1 (the head's copy on the last stage, 3)
    "interleaved1f1b": (2, {**PP2, "parallel.pp_schedule": "Interleaved1F1B", "parallel.pp_microbatches": 4}),
    "dualpipev-fsdp2": (4, {"parallel.pp": 2, "parallel.dp_shard": 2, "parallel.pp_schedule": "DualPipeV"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", SLOW_LAYOUTS.values(), ids=SLOW_LAYOUTS.keys())
def test_every_layout_matches_one_process(layout, tied_reference, tmp_path):
    world, overrides = layout
    assert_same_curve(train_on(world, {**TIED_CHECKED, **overrides}, tmp_path), tied_reference)


@pytest.mark.slow
def test_one_process_checkpoint_resumes_on_a_v_schedule(shared_runs, tied_reference, tmp_path):
    """The other direction: a whole model's one weight becomes the two copies of a V-schedule rank."""
    one = shared_runs.run(TIED_SAVING)
    resumed = train_on(
        2, {**TIED, **ZBV, "checkpoint.folder": str(one.checkpoints), "checkpoint.resume": "3"}, tmp_path
    )
    assert_same_curve(resumed, tied_reference[3:])


@pytest.mark.slow
def test_pipeline_fsdp_checkpoint_resumes_on_fsdp(tied_reference, tmp_path):
    """pp2 x fsdp2: both stages offer FSDP shards of tok_embeddings.weight (DCP keeps one copy of each chunk);
    resumed on fsdp2, where the head is the embedding again."""
    layout = {**TIED, "parallel.pp": 2, "parallel.dp_shard": 2, "checkpoint.interval": 3}
    assert_same_curve(train_on(4, layout, tmp_path / "pp2xfsdp2"), tied_reference)
    saved = str(tmp_path / "pp2xfsdp2" / "checkpoints")
    resumed = train_on(
        2, {**TIED, "parallel.dp_shard": 2, "checkpoint.folder": saved, "checkpoint.resume": "3"}, tmp_path / "fsdp2"
    )
    assert_same_curve(resumed, tied_reference[3:])


def test_a_tied_checkpoint_exports_as_a_tied_transformers_model(shared_runs, tied_reference, tmp_path):
    """The export writes the weight once with ``tie_word_embeddings: true``; transformers ties it on load and
    gives generate.py's logits (the same fp32 ops: measured identical); a pipeline imports it back."""
    import transformers

    from checkpoint.export import main as export
    from generate import load_checkpoint

    one = shared_runs.run(TIED_SAVING)
    assert export(["--checkpoint", str(one.checkpoints), "--out", str(tmp_path / "hf")]) == 0
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert theirs.lm_head.weight is theirs.model.embed_tokens.weight
    ours, _, _ = load_checkpoint(one.checkpoints, None)
    assert ours.output.weight is ours.tok_embeddings.weight
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(tokens), theirs(tokens).logits
    assert (a - b).abs().max().item() <= 1e-4 * a.abs().max().item()
    # Imported on pp2 (checkpoint.init_from), the last stage's copy reads model.embed_tokens.weight: the first
    # step's loss is the exported model's loss on that batch.
    from data.corpus import load_corpus

    cfg = load_config(path=DEBUG_CONFIG, overrides=TIED)
    t = cfg.training
    corpus = load_corpus(cfg.data.source, cfg.data.max_bytes).long()
    batch = torch.stack([corpus[j * t.seq_len :][: t.seq_len + 1] for j in range(t.global_batch)])  # step 1's
    with torch.no_grad():
        expected = F.cross_entropy(ours(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).item()
    init = {"checkpoint.init_from": str(tmp_path / "hf" / "model.safetensors"), "training.steps": 1}
    [record] = train_on(2, {**TIED, **PP2, **init}, tmp_path / "pp2")
    assert abs(record["loss"] - expected) <= LOSS_RTOL * expected
    assert expected < tied_reference[0]["loss"] - 1.0, "the trained weights, not the random init, were used"
