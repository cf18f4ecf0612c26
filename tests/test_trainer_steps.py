"""The growing trainer (examples/trainer/): every step trains the same model as the step before it.

Each step is the previous file plus one mechanism, so each gets two checks:

1. with its new degree at 1 it computes exactly what the previous step computes (bit for bit): the new code
   path changes nothing it should not;
2. with its new degree at 2 it gives the previous step's losses: exactly where the arithmetic is the same
   (the sharded state updates slices element by element; the pipeline adds the micro-batches' gradients
   in the same order and its sends copy values), and within fp32 round-off where a sum is taken in another
   order (data parallel: each rank sums its own micro-batches, then the ranks' sums are added; tensor
   parallel: w2's sum over the hidden features is split in two and added by the all-reduce).

Steps 10 and 11 change the model (attention, then experts). Each can leave its new sublayer out (step 10's
attention=False, step 11's experts=0): it is then the previous step's model, drawn from the generator in the
same order, so both checks hold against the previous step, bit for bit. With the sublayer in, the attention and
the experts are checked against torch's causal attention and a token-by-token loop, and cp 2 and tp 2 against the
step on one rank. Step 12 resumed on the layout it saved on is step 11 bit for bit, on another layout within
round-off.

Round-off tolerance: each such sum differs by ~1e-7 relative; six AdamW steps on this tiny model keep the loss
within ~1e-6 (measured: at most 1.6e-7, data parallel). 1e-5 fails on any real mistake (a gradient scaled by 1/dp, a wrong data
slice, a missing reduction), which moves the loss by 1e-3 or more.
"""

from __future__ import annotations

import difflib
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from examples.trainer import (
    step1_single_process,
    step2_data_parallel,
    step3_sharded_state,
    step4_tensor_parallel,
    step5_pipeline_1f1b,
    step6_per_block_sharding,
    step7_sequence_parallel,
    step8_activation_checkpointing,
    step9_grad_clipping,
    step10_ring_attention,
    step11_expert_all_to_all,
    step12_resharded_checkpoint,
)
from launch.local_runs import ROOT
from launch.spawn import RankFailure, run_on_ranks

# Run on the oldest and the newest supported torch too (.ci/compat).
pytestmark = pytest.mark.compat

STEPS = sorted((ROOT / "examples" / "trainer").glob("step*.py"), key=lambda p: int(p.stem.split("_")[0][4:]))
RTOL = 1e-5


def every_step(**degrees) -> dict[str, list[float]]:
    """Every step's losses on the ranks that call this (degrees not given stay 1)."""
    return {
        "step1": step1_single_process.run()["losses"],
        "step2": step2_data_parallel.run()["losses"],
        "step3": step3_sharded_state.run()["losses"],
        "step4": step4_tensor_parallel.run(tp=degrees.get("tp", 1))["losses"],
        "step5": step5_pipeline_1f1b.run(tp=degrees.get("tp", 1), pp=degrees.get("pp", 1))["losses"],
        "step6": step6_per_block_sharding.run()["losses"],
        "step7": step7_sequence_parallel.run()["losses"],
        "step8": step8_activation_checkpointing.run()["losses"],
        "step9": step9_grad_clipping.run()["losses"],
        "step10": step10_ring_attention.run(attention=False)["losses"],
        "step10 attention": step10_ring_attention.run()["losses"],
        "step11": step11_expert_all_to_all.run(experts=0)["losses"],
    }


def on_two_ranks() -> dict[str, list[float]]:
    """On 2 ranks: steps 2 and 3 with dp 2; step 4 with tp 2 and with tp 1 (dp 2); step 5 with pp 2, tp 2 and dp 2;
    step 6 with dp 2, pp 2 and tp 2; steps 7 to 11 with dp 2 and tp 2 (step 10 without and with its attention,
    step 11 without its experts); step 10 without attention with cp 2."""
    return {
        "step2 dp2": step2_data_parallel.run()["losses"],
        "step3 dp2": step3_sharded_state.run()["losses"],
        "step4 tp1 dp2": step4_tensor_parallel.run(tp=1)["losses"],
        "step4 tp2": step4_tensor_parallel.run(tp=2)["losses"],
        "step5 pp2": step5_pipeline_1f1b.run(pp=2)["losses"],
        "step5 pp1 tp2": step5_pipeline_1f1b.run(tp=2)["losses"],
        "step5 dp2": step5_pipeline_1f1b.run()["losses"],
        "step6 dp2": step6_per_block_sharding.run()["losses"],
        "step6 pp2": step6_per_block_sharding.run(pp=2)["losses"],
        "step6 tp2": step6_per_block_sharding.run(tp=2)["losses"],
        "step7 dp2": step7_sequence_parallel.run()["losses"],
        "step7 tp2": step7_sequence_parallel.run(tp=2)["losses"],
        "step8 dp2": step8_activation_checkpointing.run()["losses"],
        "step8 tp2": step8_activation_checkpointing.run(tp=2)["losses"],
        "step9 dp2": step9_grad_clipping.run()["losses"],
        "step9 tp2": step9_grad_clipping.run(tp=2)["losses"],
        "step10 dp2": step10_ring_attention.run(attention=False)["losses"],
        "step10 tp2": step10_ring_attention.run(tp=2, attention=False)["losses"],
        "step10 cp2": step10_ring_attention.run(cp=2, attention=False)["losses"],
        "step10 attention dp2": step10_ring_attention.run()["losses"],
        "step10 attention tp2": step10_ring_attention.run(tp=2)["losses"],
        "step11 dp2": step11_expert_all_to_all.run(experts=0)["losses"],
        "step11 tp2": step11_expert_all_to_all.run(tp=2, experts=0)["losses"],
    }


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= RTOL * abs(y) for x, y in zip(a, b, strict=True))


def test_every_step_is_tested_here():
    assert [p.stem for p in STEPS] == [
        "step1_single_process",
        "step2_data_parallel",
        "step3_sharded_state",
        "step4_tensor_parallel",
        "step5_pipeline_1f1b",
        "step6_per_block_sharding",
        "step7_sequence_parallel",
        "step8_activation_checkpointing",
        "step9_grad_clipping",
        "step10_ring_attention",
        "step11_expert_all_to_all",
        "step12_resharded_checkpoint",
    ]


def test_with_its_new_degree_at_1_each_step_computes_exactly_the_previous_one():
    alone = run_on_ranks(every_step, 1)[0]
    losses = alone["step1"]
    assert losses[-1] < 0.7 * losses[0], "the model learns"
    for step in ("step2", "step3", "step4", "step5", "step6", "step7", "step8", "step9", "step10"):
        assert alone[step] == losses, f"{step} on one rank differs from step 1"
    # no experts: step 10's block, and step 10's weights (no expert drawn from the generator between blocks)
    assert alone["step11"] == alone["step10 attention"] and alone["step10 attention"] != losses


def test_each_step_equals_the_previous_one_on_two_ranks():
    one = run_on_ranks(step1_single_process.run, 1)[0]["losses"]
    step4_alone = run_on_ranks(step4_tensor_parallel.run, 1)[0]["losses"]
    runs = run_on_ranks(on_two_ranks, 2)
    assert runs[0] == runs[1], "every rank logs the same losses"
    r = runs[0]
    assert close(r["step2 dp2"], one) and r["step2 dp2"] != one  # data parallel: round-off, and some
    assert r["step3 dp2"] == r["step2 dp2"]  # sharded AdamW: the same numbers, slice by slice
    assert r["step4 tp1 dp2"] == r["step3 dp2"]  # tp 1: step 3 exactly
    assert close(r["step4 tp2"], r["step3 dp2"])  # tensor parallel: round-off
    assert r["step5 pp2"] == step4_alone  # the pipeline: step 4 on one rank, bit for bit
    assert r["step5 pp1 tp2"] == r["step4 tp2"]  # pp 1: step 4 exactly
    assert r["step5 dp2"] == r["step3 dp2"]  # pp 1, tp 1: step 3 exactly
    assert r["step6 dp2"] == r["step5 dp2"]  # per-block shards: the same sums and slices, bit for bit
    assert r["step6 pp2"] == r["step5 pp2"]  # each stage's units gathered on their own: step 5 with pp 2
    assert r["step6 tp2"] == r["step5 pp1 tp2"]  # and with tp 2
    assert r["step7 dp2"] == r["step6 dp2"]  # tp 1: step 6 exactly
    # sequence parallel: each reduce-scatter element adds the two partial values g's all-reduce adds
    assert r["step7 tp2"] == r["step6 tp2"]
    assert r["step8 dp2"] == r["step7 dp2"]  # recomputation: the same operations on the same inputs
    assert r["step8 tp2"] == r["step7 tp2"]  # and the recomputed sequence all-gathers give the same tensors
    assert r["step9 dp2"] == r["step8 dp2"]  # no limit: the factor is 1.0, the gradients unchanged
    assert r["step9 tp2"] == r["step8 tp2"]
    assert r["step10 dp2"] == r["step9 dp2"]  # no attention: step 9's block, the same weights and data
    assert r["step10 tp2"] == r["step9 tp2"]  # (with cp 1 each rank's positions are the whole sequence)
    # cp 2: each rank takes half the positions of all the sequences, not half the sequences; the tokens'
    # gradients are added in another order: round-off, as for dp (measured 1.6e-7)
    assert close(r["step10 cp2"], r["step9 dp2"])
    assert r["step11 dp2"] == r["step10 attention dp2"]  # no experts: step 10's block and weights
    assert r["step11 tp2"] == r["step10 attention tp2"]


MAX_NORM = 0.5  # the unclipped gradient norms of the 6 steps are 0.85-1.1: every step is clipped


def clipped_on_two_ranks() -> dict[str, dict]:
    return {
        layout: step9_grad_clipping.run(max_norm=MAX_NORM, **degrees)
        for layout, degrees in (("dp2", {}), ("tp2", {"tp": 2}), ("pp2", {"pp": 2}))
    }


def test_clipping_by_the_global_norm_is_the_same_on_every_layout():
    one = run_on_ranks(step9_grad_clipping.run, 1, max_norm=MAX_NORM)[0]
    assert not close(one["losses"], run_on_ranks(step9_grad_clipping.run, 1)[0]["losses"]), "the limit clips"
    runs = run_on_ranks(clipped_on_two_ranks, 2)
    assert runs[0] == runs[1], "every rank logs the same losses and norms"
    for layout, run in runs[0].items():
        # the squares are summed in another order (shards, then groups): fp32 round-off, as for the losses
        assert close(run["grad_norms"], one["grad_norms"]), layout
        assert close(run["losses"], one["losses"]), layout


def whole_units_during_forward() -> list[list[int]]:
    """Step 6 on this rank: at each unit's forward, the units whole or on their way (gathered or gathering)."""
    step = step6_per_block_sharding
    torch.manual_seed(0)
    model = step.Model()
    states = step.shard_per_unit(model, *step.rank_grid({"dp": dist.get_world_size()})["dp"])
    seen = []
    for unit in (model.embed, *model.blocks, model.head):  # registered after step 6's hooks: they run after them
        unit.register_forward_pre_hook(
            lambda module, args: seen.append([i for i, s in enumerate(states) if s.gathered or s.gathering])
        )
    micro = step.token_stream()[0][:MICRO]
    step.loss_share(model(micro[:, :-1]), micro[:, 1:], step.GLOBAL_BATCH * step.SEQ).backward()
    assert all(p.numel() == 0 for p in model.parameters()), "every unit freed after its backward"
    return seen


def test_per_block_sharding_keeps_a_unit_and_the_next_ones_all_gather_in_flight():
    units = step1_single_process.LAYERS + 2  # the embedding, the blocks, the head
    expected = [[i, i + 1] if i + 1 < units else [i] for i in range(units)]
    assert run_on_ranks(whole_units_during_forward, 2) == [expected, expected]


def saved_for_backward() -> dict[str, int]:
    """Elements autograd keeps for backward in one micro-batch's forward, steps 7 and 8 (one rank, tp 1)."""
    saved = {}
    for name, step in (("step7", step7_sequence_parallel), ("step8", step8_activation_checkpointing)):
        torch.manual_seed(0)
        model, count = step.Model(), []
        step.shard_for_tensor_parallel(model, *step.rank_grid({"tp": 1})["tp"])
        with torch.autograd.graph.saved_tensors_hooks(lambda t, count=count: count.append(t.numel()) or t, lambda t: t):
            model(step.token_stream()[0][:MICRO, :-1])  # checkpoint's own saves inside a block are not seen here
        saved[name] = sum(count)
    return saved


MICRO = step1_single_process.GLOBAL_BATCH // step1_single_process.MICRO_BATCHES


def test_activation_checkpointing_keeps_no_block_activations():
    saved = run_on_ranks(saved_for_backward, 1)[0]
    # step 7 keeps at least each block's ReLU output (MICRO x SEQ x HIDDEN); step 8 keeps none of it
    hidden = step1_single_process.LAYERS * MICRO * step1_single_process.SEQ * step1_single_process.HIDDEN
    assert saved["step8"] <= saved["step7"] - hidden, saved


def ring_attention_against_sdpa() -> float:
    """Step 10's ring attention on this rank's chunk against torch's causal attention over the whole sequence."""
    group = step10_ring_attention.rank_grid({"cp": dist.get_world_size()})["cp"][0]
    h = torch.randn(3, step1_single_process.SEQ, step1_single_process.DIM, generator=torch.Generator().manual_seed(2))
    whole = F.scaled_dot_product_attention(h, h, h, is_causal=True)
    mine = h.chunk(dist.get_world_size(), dim=1)[dist.get_rank()]
    return (
        (step10_ring_attention.ring_attention(mine, group) - whole.chunk(dist.get_world_size(), dim=1)[dist.get_rank()])
        .abs()
        .max()
        .item()
    )


def cp_on_two_ranks() -> dict[str, list[float]]:
    return {
        "cp2": step10_ring_attention.run(cp=2)["losses"],
        "dp2": step10_ring_attention.run()["losses"],
        "cp2 clipped": step10_ring_attention.run(cp=2, max_norm=MAX_NORM)["losses"],
    }


def test_ring_attention_is_causal_attention_and_cp_2_trains_as_cp_1():
    # Outputs of size 1-3 (an ulp: 1.2e-7 to 2.4e-7); the merge's rescaling by exp(lse_b - lse) and another
    # summation order cost a few ulp (measured: 1.2e-6 at most); a missing block or a wrong mask moves them by 0.1.
    assert run_on_ranks(ring_attention_against_sdpa, 1)[0] < 1e-5  # cp 1: the diagonal block alone
    assert max(run_on_ranks(ring_attention_against_sdpa, 2)) < 1e-5  # cp 2: two blocks merged
    one = run_on_ranks(step10_ring_attention.run, 1)[0]["losses"]
    one_clipped = run_on_ranks(step10_ring_attention.run, 1, max_norm=MAX_NORM)[0]["losses"]
    assert not close(one, run_on_ranks(step9_grad_clipping.run, 1)[0]["losses"]), "attention changes the model"
    runs = run_on_ranks(cp_on_two_ranks, 2)
    assert runs[0] == runs[1], "every rank logs the same losses"
    # the merge rescales the blocks' outputs, and the gradients add over cp: fp32 round-off, as for dp
    assert close(runs[0]["cp2"], one) and close(runs[0]["dp2"], one)
    assert close(runs[0]["cp2 clipped"], one_clipped)


def moe_against_one_token_at_a_time() -> float:
    """Step 11's all-to-all mixture on this rank's tokens against each token run through its expert alone."""
    step = step11_expert_all_to_all
    torch.manual_seed(0)
    model = step.Model()
    whole = model.blocks[0]
    experts_in, experts_out = whole.experts_in.detach().clone(), whole.experts_out.detach().clone()
    step.shard_for_tensor_parallel(model, *step.rank_grid({"tp": dist.get_world_size()})["tp"])
    y = torch.randn(2, step.SEQ, step.DIM, generator=torch.Generator().manual_seed(3))
    mine = y.chunk(dist.get_world_size(), dim=1)[dist.get_rank()]
    expected = []
    for token in mine.flatten(0, 1):
        weight, e = torch.softmax(token[: step.EXPERTS], -1).max(-1)
        expected.append(weight * (torch.relu(token @ experts_in[e]) @ experts_out[e]))
    return (step.moe(mine, model.blocks[0]).flatten(0, 1) - torch.stack(expected)).abs().max().item()


def test_the_expert_all_to_all_routes_every_token_to_its_expert_and_tp_2_trains_as_tp_1():
    # one token's expert output, of size ~1, computed alone or in a batch of rows: a few ulp (measured: 3.6e-7)
    assert run_on_ranks(moe_against_one_token_at_a_time, 1)[0] < 1e-5
    assert max(run_on_ranks(moe_against_one_token_at_a_time, 2)) < 1e-5  # half the experts on each rank
    one = run_on_ranks(step11_expert_all_to_all.run, 1)[0]["losses"]
    assert not close(one, run_on_ranks(step10_ring_attention.run, 1)[0]["losses"]), "the experts change the model"
    runs = run_on_ranks(step11_expert_all_to_all.run, 2, tp=2)
    assert runs[0]["losses"] == runs[1]["losses"], "every rank logs the same losses"
    # an expert's weight gradient adds both ranks' tokens in another order: fp32 round-off (measured 1.7e-7)
    assert close(runs[0]["losses"], one)


def test_an_expert_count_the_tp_ranks_cannot_share_is_refused_on_every_rank():
    with pytest.raises(RankFailure) as err:  # before any collective: no rank waits for the other (no timeout)
        run_on_ranks(step11_expert_all_to_all.run, 2, tp=2, experts=3, timeout=60)
    assert str(err.value).count("ValueError: experts=3: give a multiple of tp=2 no larger than DIM=32") == 2


def resumed_on_two_ranks(directory: str) -> dict[str, list[float]]:
    """Step 11 and step 12 on dp 2, and step 12 saved after 3 steps on one layout, resumed on another."""
    runs = {"step11": step11_expert_all_to_all.run()["losses"], "step12": step12_resharded_checkpoint.run()["losses"]}
    for i, (saved_on, loaded_on) in enumerate((({}, {}), ({}, {"pp": 2}), ({"tp": 2}, {"cp": 2}))):
        where = f"{directory}/{i}"
        first = step12_resharded_checkpoint.run(steps=3, save=where, **saved_on)["losses"]
        runs[f"{saved_on} -> {loaded_on}"] = first + step12_resharded_checkpoint.run(load=where, **loaded_on)["losses"]
    return runs


def test_a_checkpoint_saved_on_one_layout_resumes_on_another(tmp_path):
    runs = run_on_ranks(resumed_on_two_ranks, 2, directory=str(tmp_path))
    assert runs[0] == runs[1], "every rank logs the same losses"
    r = runs[0]
    assert r["step12"] == r["step11"]  # no checkpoint: step 11 exactly
    assert r["{} -> {}"] == r["step11"]  # the same layout: the same state and the same arithmetic, bit for bit
    # another layout: step 11's dp 2 run within fp32 round-off (the layouts' arithmetic differs from step 4 on)
    assert close(r["{} -> {'pp': 2}"], r["step11"]) and close(r["{'tp': 2} -> {'cp': 2}"], r["step11"])


def test_the_steps_compose_pipeline_and_tensor_parallel_on_four_ranks():
    step4_tp2 = run_on_ranks(step4_tensor_parallel.run, 2, tp=2)[0]["losses"]
    runs = run_on_ranks(step5_pipeline_1f1b.run, 4, tp=2, pp=2)
    assert all(r["losses"] == step4_tp2 for r in runs)  # pp 2 x tp 2: step 4's tp 2, bit for bit
    runs = run_on_ranks(step7_sequence_parallel.run, 4, tp=2, pp=2)  # the stages send sequence slices
    assert all(r["losses"] == step4_tp2 for r in runs)
    cp2 = run_on_ranks(step10_ring_attention.run, 2, cp=2)[0]["losses"]
    runs = run_on_ranks(step10_ring_attention.run, 4, cp=2, tp=2)  # sequence parallel inside each cp chunk
    assert all(close(r["losses"], cp2) for r in runs)


def code_lines(path) -> list[str]:
    """The file without its module docstring: the code a reader diffs."""
    text = path.read_text()
    return text[text.index('"""', 3) + 3 :].splitlines()


def changed_lines(before, after) -> int:
    diff = difflib.unified_diff(code_lines(before), code_lines(after), lineterm="", n=0)
    return sum(1 for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---")))


def test_chapter_0_quotes_each_steps_diff_length():
    # docs/00_foundations.md, section 8: | `stepN_....py` | adds | new degree | code lines changed | taught in |
    rows = re.findall(
        r"^\| `(step\d+_\w+\.py)` \|[^|]*\|[^|]*\|\s*(\d*)\s*\|",
        (ROOT / "docs" / "00_foundations.md").read_text(),
        re.M,
    )
    quoted = dict(rows)
    assert list(quoted) == [p.name for p in STEPS]
    for before, after in zip(STEPS, STEPS[1:], strict=False):
        assert quoted[after.name] == str(changed_lines(before, after)), after.name


def test_each_step_is_a_small_diff_from_the_previous_one():
    # A reader runs `diff stepN stepN+1`: the code outside the docstring must be mostly shared. The largest
    # steps (per-block sharding, the 1F1B schedule, the checkpoint) change 77-90 lines of 250-500.
    for before, after in zip(STEPS, STEPS[1:], strict=False):
        changed = changed_lines(before, after)
        assert changed <= 90, f"{after.name}: {changed} changed lines against {before.name}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "step, args",
    [
        (STEPS[0], []),
        *[(s, []) for s in STEPS[1:3]],
        (STEPS[3], ["--tp", "2"]),
        (STEPS[4], ["--pp", "2"]),
        (STEPS[5], []),
        (STEPS[6], ["--tp", "2"]),
        (STEPS[7], []),
        (STEPS[8], ["--max-norm", "0.5"]),
        (STEPS[9], ["--cp", "2"]),
        (STEPS[10], ["--tp", "2"]),
        (STEPS[10], ["--tp", "2", "--experts", "0"]),  # step 10's model
        (STEPS[11], []),
        (STEPS[11], ["--attention", "off", "--experts", "0"]),  # step 9's model
    ],
    ids=lambda x: getattr(x, "stem", None),
)
def test_every_step_runs_under_torchrun(step, args):
    cmd = (
        [sys.executable, str(step)]
        if step == STEPS[0]
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(step), *args]
    )
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("step ") == step1_single_process.STEPS
