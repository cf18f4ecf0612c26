"""Mixed precision from scratch: fp32, bf16 and fp16 bit by bit, gradient underflow, loss scaling, GradScaler.

    python examples/mixed_precision_fp16.py

One process on CPU (torch 2.13 runs fp16 matmuls and ``torch.autocast("cpu", dtype=torch.float16)`` there).
docs/mixed_precision.md walks through the printout:

1. the three formats' bits (sign | exponent | mantissa) and stored values of 0.1, and a rounding demo: 1,000
   additions of 0.001 to 1.0 in each format;
2. a toy regression (a student network learning a teacher's outputs; the loss is the mean over 4,096 x 64
   outputs, as a language model's loss is a mean over its tokens) whose output gradients, computed in fp16,
   underflow: how many are zero or subnormal, and how wrong the weight gradients are, unscaled and with the loss
   multiplied by 2^16 before backward, at the start and after 60 steps of training (gradients shrink as the
   loss falls);
3. dynamic loss scaling written by hand: scale the loss, unscale the gradients in fp32, skip the step and halve
   the scale when a gradient is not finite, double it after ``GROWTH_INTERVAL`` good steps; the same run with
   ``torch.amp.GradScaler("cpu")`` (started at 2^40, far too large, so the first steps overflow and are
   skipped) gives exactly the same scales, skipped steps and losses;
4. the losses of fp32, fp16 without scaling and fp16 with scaling over the same steps.

The parameters stay fp32 throughout (the master weights); autocast runs the matmuls in fp16.
tests/test_examples.py checks every claim of the printout.
"""

from __future__ import annotations

import torch
from torch import nn

FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EXPONENT_BITS = {"fp32": 8, "bf16": 8, "fp16": 5}
DIM, BATCH, STEPS, LR = 64, 4096, 60, 1e-3
INIT_SCALE, GROWTH_INTERVAL = 2.0**40, 10
SHOWN = 0.1  # the value whose bits and stored value each format prints
ADDEND, ADDITIONS = 1e-3, 1000  # the rounding demo: 1.0 + ADDITIONS x ADDEND, rounded after every addition


def bits(x: float, name: str) -> str:
    """sign | exponent | mantissa of x stored in the format."""
    dtype = FORMATS[name]
    width = torch.finfo(dtype).bits
    as_int = torch.tensor(x, dtype=dtype).view({32: torch.int32, 16: torch.int16}[width]).item() & ((1 << width) - 1)
    s, e = format(as_int, f"0{width}b"), EXPONENT_BITS[name]
    return f"{s[0]} {s[1 : 1 + e]} {s[1 + e :]}"


def formats() -> dict:
    out = {}
    for name, dtype in FORMATS.items():
        info, w = torch.finfo(dtype), torch.tensor(1.0, dtype=dtype)
        for _ in range(ADDITIONS):
            w += torch.tensor(ADDEND, dtype=dtype)  # every partial sum is rounded to the format
        out[name] = {
            f"bits of {SHOWN}": bits(SHOWN, name),
            f"{SHOWN} stored as": torch.tensor(SHOWN, dtype=dtype).item(),
            "eps (gap after 1.0)": info.eps,
            "largest": info.max,
            "smallest normal": info.smallest_normal,
            f"1.0 + {ADDITIONS} x {ADDEND}": w.item(),
        }
    return out


def toy() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A student, 1% away from its teacher, and the teacher's outputs on BATCH inputs."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
    student = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
    student.load_state_dict(teacher.state_dict())
    with torch.no_grad():
        for p in student.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-2)
        x = torch.randn(BATCH, DIM, generator=gen)
        return student, x, teacher(x)


def forward_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, fp16: bool, scale: float):
    """Loss (fp32), and gradients of loss x scale; the output's gradient is kept to inspect."""
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        out = model(x)  # fp16 under autocast: its gradient is fp16 too
    out.retain_grad()
    loss = nn.functional.mse_loss(out.float(), y)  # the mean over BATCH x DIM outputs
    (loss * scale).backward()
    return loss, out.grad


def gradient_damage(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """How many fp16 output gradients underflow, and how far the weight gradients are from fp32's."""
    forward_backward(model, x, y, fp16=False, scale=1.0)
    exact = torch.cat([p.grad.flatten() for p in model.parameters()])
    out = {}
    for label, scale in (("unscaled", 1.0), ("scaled 2^16", 2.0**16)):
        _, out_grad = forward_backward(model, x, y, fp16=True, scale=scale)
        grad = torch.cat([p.grad.flatten() / scale for p in model.parameters()])  # unscaled in fp32
        tiny = torch.finfo(torch.float16).smallest_normal
        out[label] = {
            "output gradients zero": round(float((out_grad == 0).float().mean()), 3),
            "output gradients subnormal": round(float(((out_grad != 0) & (out_grad.abs() < tiny)).float().mean()), 3),
            "weight-gradient error": round(float((grad - exact).norm() / exact.norm()), 4),
        }
    return out


def train(mode: str, init_scale: float = 1.0) -> dict:
    """STEPS of Adam on the toy. mode: fp32, fp16 (unscaled), by hand (dynamic loss scaling), GradScaler."""
    model, x, y = toy()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=GROWTH_INTERVAL)
    scale, good_steps, losses, scales, skipped = init_scale, 0, [], [], []
    for step in range(1, STEPS + 1):
        if mode == "GradScaler":
            scales.append(scaler.get_scale())
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = nn.functional.mse_loss(out.float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)  # unscales; skips opt.step() if any gradient is inf or NaN
            scaler.update()  # halves the scale after an overflow, doubles it after GROWTH_INTERVAL good steps
            if scaler.get_scale() < scales[-1]:
                skipped.append(step)
        elif mode == "by hand":
            scales.append(scale)
            loss, _ = forward_backward(model, x, y, fp16=True, scale=scale)
            grads = [p.grad for p in model.parameters()]
            for g in grads:
                g.mul_(1.0 / scale)  # unscale in fp32 (the parameters, so their gradients, are fp32)
            if all(torch.isfinite(g).all() for g in grads):  # with several ranks: agree on this first
                opt.step()
                good_steps += 1
                if good_steps == GROWTH_INTERVAL:
                    scale, good_steps = scale * 2.0, 0
            else:
                skipped.append(step)  # the step is not applied: the weights never see inf or NaN
                scale, good_steps = scale * 0.5, 0
        else:
            loss, _ = forward_backward(model, x, y, fp16=mode == "fp16", scale=1.0)
            opt.step()
        losses.append(loss.item())
    return {"losses": losses, "scales": scales, "skipped": skipped, "model": model}


def run() -> dict:
    torch.set_num_threads(1)
    student, x, y = toy()
    runs = {"fp32": train("fp32"), "fp16, unscaled": train("fp16"), "fp16, scaled": train("by hand", 2.0**16)}
    trained = runs["fp32"]["model"]  # gradients are smaller once the loss has fallen
    hand, scaler = train("by hand", INIT_SCALE), train("GradScaler", INIT_SCALE)
    return {
        "formats": formats(),
        "gradient damage at the start": gradient_damage(student, x, y),
        f"gradient damage after {STEPS} fp32 steps": gradient_damage(trained, x, y),
        "loss scale at steps 1-16 (by hand, from 2^40)": " ".join(
            f"2^{int(s).bit_length() - 1}" for s in hand["scales"][:16]
        ),
        "skipped steps (by hand)": hand["skipped"],
        "loss scale at the last step": f"2^{int(hand['scales'][-1]).bit_length() - 1}",
        "by hand equals GradScaler": hand["losses"] == scaler["losses"]
        and hand["scales"] == scaler["scales"]
        and hand["skipped"] == scaler["skipped"],
        "loss at steps 1, 20, 40, 60": {
            mode: [f"{r['losses'][i]:.4e}" for i in (0, 19, 39, 59)] for mode, r in runs.items()
        },
        "largest relative loss difference from fp32": {
            mode: f"{max(abs(a - b) / b for a, b in zip(r['losses'], runs['fp32']['losses'], strict=True)):.1e}"
            for mode, r in runs.items()
            if mode != "fp32"
        },
    }


if __name__ == "__main__":
    from _launch import main

    main(run)
