"""Activation memory under TP and SP: what autograd saves per rank matches the formula in docs/tensor_parallel.md."""

from launch.spawn import run_on_ranks
from measure.activation_memory import formula_bytes, measure_block
from models.llama import ModelArgs

SMALL = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32)
BATCH, SEQ = 2, 32


def saved_bytes_without_and_with_sp() -> dict:
    found = {sp: measure_block(SMALL, BATCH, SEQ, tp=2, sequence_parallel=sp)["bytes"] for sp in (False, True)}
    found["regather"] = measure_block(SMALL, BATCH, SEQ, tp=2, sequence_parallel=True, regather=True)["bytes"]
    return found


def test_tp2_activation_bytes_per_rank_follow_the_derived_formula():
    one = measure_block(SMALL, BATCH, SEQ)["bytes"]
    per_rank = run_on_ranks(saved_bytes_without_and_with_sp, 2)
    # Exact equality: every saved tensor is listed in the formula. A mismatch means the model, the TP plan or
    # the SDPA path (CPU fp32 keeps a logsumexp, no s x s scores) changed, and the chapter must be redone.
    assert one == formula_bytes(SMALL, BATCH, SEQ)
    for no_sp, sp, regather in ((r[False], r[True], r["regather"]) for r in per_rank):
        assert no_sp == formula_bytes(SMALL, BATCH, SEQ, tp=2, sequence_parallel=False)
        assert sp == formula_bytes(SMALL, BATCH, SEQ, tp=2, sequence_parallel=True)
        assert one > no_sp > sp  # TP divides the inner activations; SP also the norms and the residual stream
        # What SP does not divide: the all-gathered inputs of wq/wk/wv and w1/w3 (2 bsh fp32), which
        # ColwiseParallel saves in full. Everything else is exactly halved.
        gathered = 2 * BATCH * SEQ * SMALL.dim * 4
        assert sp - one / 2 == gathered / 2
        # parallel.sp_regather saves those inputs as their sequence shards: exactly 1/tp of one process
        assert regather == formula_bytes(SMALL, BATCH, SEQ, tp=2, sequence_parallel=True, regather=True)
        assert regather * 2 == one
