"""FSDP2 holds 1/N of the fp32 training state per rank: measured bytes vs (4Ψ + 4Ψ + 8Ψ) / N."""

from launch.local_runs import DEBUG_CONFIG
from launch.spawn import run_on_ranks
from measure.fsdp_memory import formula_bytes, measure


def test_fsdp2_per_rank_state_matches_the_zero3_formula():
    n = 2
    results = run_on_ranks(measure, n, DEBUG_CONFIG)
    held = [r["params"] + r["grads"] + r["optim"] for r in results]
    psi = results[0]["psi"]
    for rank, (r, h) in enumerate(zip(results, held, strict=True)):
        # dim-0 padding can put a rank slightly above 1/N for uneven shapes (see measure/fsdp_memory.py);
        # 2% allows for that, while a replicated (unsharded) state would be 100% off.
        assert abs(h - formula_bytes(psi, n)) <= 0.02 * formula_bytes(psi, n), (rank, h)
        assert r["optim"] == 2 * r["params"], "AdamW keeps two fp32 moments per local parameter element"
    # The shards partition the model: together the ranks hold the one-process state exactly once, no more.
    assert sum(held) == formula_bytes(psi, 1)


def bf16_state_dtypes() -> dict:
    """Rank body: the debug model in bf16 mixed precision on dp_shard = world, one AdamW step; the dtypes."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from mesh.dims import build_mesh
    from planning.plan import LayoutPlan
    from runtime.config import load_config
    from training.build import build_step
    from training.optimizer import Optimizers

    world = dist.get_world_size()
    cfg = load_config(path=DEBUG_CONFIG, overrides={"parallel.dp_shard": world, "training.mixed_precision": "bf16"})
    plan = LayoutPlan.resolve(cfg, world, dist.get_rank())
    args = plan.model
    model = build_step(cfg, plan, build_mesh(plan.dims, torch.device("cpu"), timeout_s=60), torch.device("cpu")).parts[
        0
    ]
    optimizer = Optimizers([model], cfg).optimizers[0]
    tokens = torch.randint(0, args.vocab_size, (world, 17), generator=torch.Generator().manual_seed(dist.get_rank()))
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    kinds = lambda ts: sorted({str(t.to_local().dtype if hasattr(t, "to_local") else t.dtype) for t in ts})  # noqa: E731
    return {
        "logits": str(logits.dtype),
        "params": kinds(model.parameters()),
        "grads": kinds(p.grad for p in model.parameters()),
        "adam moments": kinds(s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")),
    }


def test_bf16_computes_in_bf16_but_keeps_fp32_state():
    # docs/data_parallel.md, section 7 and docs/mixed_precision.md, section 5: the sharded parameters are the fp32
    # master weights; gradients arrive reduced in fp32; Adam's moments are fp32; the compute (logits) is bf16.
    for r in run_on_ranks(bf16_state_dtypes, 2):
        assert r == {
            "logits": "torch.bfloat16",
            "params": ["torch.float32"],
            "grads": ["torch.float32"],
            "adam moments": ["torch.float32"],
        }
