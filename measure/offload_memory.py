"""FSDP CPU offload: device memory per rank with and without ``parallel.fsdp_cpu_offload``, against the formula.

    torchrun --standalone --nproc-per-node dp -m measure.offload_memory      # on dp GPUs (dp = 1 works)
    .venv/bin/python -m measure.offload_memory --formula                    # the arithmetic only (any machine)

NOT RUN in this repository's CI or on the machine the docs were written on (no GPU there): on a CPU-only
machine the script prints the formula and says so. On GPUs, for each setting it builds a Llama-style model
exactly as train.py does (``training/build.py: build_step``: FSDP over all ranks, fp32), takes ``--steps`` AdamW steps on
random tokens and reports, on the largest rank:

- ``resident``: ``torch.cuda.memory_allocated`` after a step (what stays on the device between steps);
- ``peak``: ``torch.cuda.max_memory_allocated`` during the steps (adds the gathered units, their unsharded
  gradients and the activations);
- ``host state``: bytes of the sharded parameters, gradients and Adam moments that live in host memory.

The formula (fp32 training with AdamW, Ψ parameters, dp ranks, docs/dp_savers.md section 4):

    without offload   device: (4 + 4 + 8) Ψ / dp     host: 0
    with offload      device: ~0 persistent state   host: (4 + 4 + 8) Ψ / dp   (pinned)

and in both cases the peak adds the activations and, per unit in flight, its gathered parameters and its
unsharded gradient (4 + 4 bytes per parameter of one or two blocks), which offloading does not remove.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from runtime.options import count_option

MODEL = {  # 0.89B parameters: 13.25 GiB of fp32 training state on one rank
    "model.dim": 2048,
    "model.n_layers": 16,
    "model.n_heads": 16,
    "model.n_kv_heads": 8,
    "model.vocab_size": 32768,
    "model.multiple_of": 256,
}


def state_bytes(model, optimizer) -> dict[str, int]:
    """Bytes of this rank's parameter, gradient and Adam shards, by device type."""
    out: dict[str, int] = {}

    def add(t: torch.Tensor) -> None:
        local = t.to_local() if hasattr(t, "to_local") else t
        out[local.device.type] = out.get(local.device.type, 0) + local.numel() * local.element_size()

    for p in model.parameters():
        add(p)
        if p.grad is not None:
            add(p.grad)
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                add(value)
    return out


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def measure(offload: bool, steps: int, seq_len: int, batch: int, device: torch.device, model: dict = MODEL) -> dict:
    """Rank body: train ``steps`` steps of ``model`` as train.py builds it; memory and where the state lives.

    On a CPU ``device`` (the smoke test) there is no device memory to read: ``resident``/``peak`` are 0.
    """
    from planning.plan import LayoutPlan
    from runtime.config import load_config
    from training.build import build_meshes, build_step
    from training.loss import token_loss_sum

    world = dist.get_world_size()
    cfg = load_config(
        overrides={
            **model,
            "parallel.dp_shard": world,
            "parallel.fsdp_cpu_offload": offload,
            "training.seq_len": seq_len,
            "training.global_batch": batch * world,
        }
    )
    plan = LayoutPlan.resolve(cfg, world, dist.get_rank())
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    before = allocated(device)
    built = build_step(cfg, plan, build_meshes(plan, device, timeout_s=600), device)  # host groups under offload
    net, optimizers = built.parts[0], built.optimizers
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        tokens = torch.randint(0, plan.model.vocab_size, (batch, seq_len + 1), generator=gen).to(device)
        loss = token_loss_sum(net(tokens[:, :-1]), tokens[:, 1:]) / (batch * world * seq_len)
        loss.backward()
        held = state_bytes(net, optimizers.optimizers[0])  # with gradients (before zero_grad); Adam from step 2
        optimizers.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {
        "psi": plan.model.num_params(),
        "resident": allocated(device) - before,
        "peak": peak(device) - before,
        "host_state": held.get("cpu", 0),
        "device_state": held.get("cuda", 0),
    }


def print_formula(psi: int, n: int) -> None:
    state = 16 * psi / n
    print(
        f"Ψ = {psi:,}, dp = {n}: fp32 params + grads + Adam m, v = (4 + 4 + 8) Ψ / dp = {state / 2**30:.2f} GiB per rank"
    )
    print(f"  without offload: {state / 2**30:.2f} GiB on the device, 0 on the host")
    print(f"  with offload:    ~0 on the device, {state / 2**30:.2f} GiB of (pinned) host memory")


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py; tests/test_input_walk.py walks them)."""
    parser = argparse.ArgumentParser(prog="python -m measure.offload_memory", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps",
        type=count_option(ge=2),
        default=3,
        help=">= 2: Adam's moments exist from the second step",
    )
    parser.add_argument("--seq-len", type=count_option(), default=1024)
    parser.add_argument("--batch", type=count_option(), default=2, help="sequences per rank")
    parser.add_argument("--formula", action="store_true", help="print the formula only")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    from runtime.config import load_config, model_args

    psi = model_args(load_config(overrides=MODEL)).num_params()
    if args.formula or not torch.cuda.is_available():
        if not torch.cuda.is_available():
            print("no CUDA device: device memory NOT measured; the formula for this model:")
        print_formula(psi, int(os.environ.get("WORLD_SIZE", "1")))
        return
    from runtime.process import destroy_process_group, init_process_group, select_device

    control = init_process_group(select_device("cuda"), 600)
    rows = {}
    for offload in (False, True):
        mine = measure(offload, args.steps, args.seq_len, args.batch, torch.device("cuda", torch.cuda.current_device()))
        rows[offload] = max(control.all_gather_object(mine), key=lambda r: r["peak"])
    if dist.get_rank() == 0:
        n = dist.get_world_size()
        print_formula(psi, n)
        print(f"{'offload':<8} {'resident GiB':>13} {'peak GiB':>9} {'device state GiB':>17} {'host state GiB':>15}")
        for offload, r in rows.items():
            print(
                f"{str(offload):<8} {r['resident'] / 2**30:>13.2f} {r['peak'] / 2**30:>9.2f} "
                f"{r['device_state'] / 2**30:>17.2f} {r['host_state'] / 2**30:>15.2f}"
            )
    destroy_process_group()


if __name__ == "__main__":
    main()
