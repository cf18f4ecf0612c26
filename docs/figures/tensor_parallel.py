"""Section 3: how tensor parallelism splits a block's weights, and the SP layout transitions (from mesh/tensor_parallel.py's plans)."""

from __future__ import annotations

from docs.figures.svg import DARK, LIGHT, Svg, colour

DEBUG_SHAPES = {  # (out, in) of the debug model's weights: dim 128, 8 heads, 4 kv heads, FFN hidden 384
    "attention.wq": (128, 128),
    "attention.wk": (64, 128),
    "attention.wv": (64, 128),
    "attention.wo": (128, 128),
    "feed_forward.w1": (384, 128),
    "feed_forward.w3": (384, 128),
    "feed_forward.w2": (128, 384),
}


def tp_split_svg(tp: int = 2) -> str:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from mesh.tensor_parallel import block_plan

    plan = block_plan(sequence_parallel=False)
    heads = {"attention.wq": 8, "attention.wk": 4, "attention.wv": 4}  # the debug model's (kv) heads
    scale = 0.5
    svg = Svg(1060, 470)
    svg.text(
        10,
        22,
        f"Tensor parallelism, tp = {tp}: each weight of a block (stored out x in) and what each rank holds",
        size=14,
        weight="bold",
    )
    groups = [
        ("attention: split by heads", ["attention.wq", "attention.wk", "attention.wv", "attention.wo"], 20),
        ("MLP (SwiGLU): column- then row-parallel", ["feed_forward.w1", "feed_forward.w3", "feed_forward.w2"], 560),
    ]
    for title, keys, x0 in groups:
        svg.text(x0, 50, title, size=13, weight="bold")
        x = x0 + 34
        svg.text(x0, 130, "f", size=16, weight="bold")
        svg.line(x0 + 10, 125, x0 + 30, 125, arrow=True)
        for key in keys:
            out_f, in_f = DEBUG_SHAPES[key]
            h, w = out_f * scale, in_f * scale
            style = plan[key]
            colwise = isinstance(style, ColwiseParallel)
            assert colwise or isinstance(style, RowwiseParallel), key
            for r in range(tp):
                if colwise:  # rows of the stored weight = output features
                    svg.rect(x, 80 + r * h / tp, w, h / tp, colour(r), text=f"rank {r}", size=10)
                else:  # columns of the stored weight = input features
                    svg.rect(x + r * w / tp, 80, w / tp, h, colour(r), text=f"r{r}", size=10)
            for i in range(1, heads.get(key, 0)):  # head boundaries
                svg.line(x, 80 + i * h / heads[key], x + w, 80 + i * h / heads[key], stroke="white", width=0.6)
            name = key.split(".")[1]
            svg.text(x + w / 2, 74, name, anchor="middle", size=11, weight="bold")
            svg.text(x + w / 2, 80 + h + 14, f"{out_f}x{in_f}", anchor="middle", size=10)
            svg.text(x + w / 2, 80 + h + 28, "Colwise" if colwise else "Rowwise", anchor="middle", size=10)
            x += w + 18
        svg.line(x - 8, 125, x + 12, 125, arrow=True)
        svg.text(x + 16, 130, "g", size=16, weight="bold")
    notes = [
        "f: identity forward, all-reduce of the input's gradient in backward (every rank used all of x);",
        "g: all-reduce of the partial outputs in forward, identity in backward. One all-reduce each way per attention",
        "   and per MLP (tests/test_tensor_parallel.py); examples/tp_from_scratch.py writes f and g by hand.",
        "Colwise (wq, wk, wv, w1, w3): rank r owns whole output features: whole heads (white lines), whole hidden",
        "   columns. Its output slice is complete; no communication until the Rowwise matmul.",
        "Rowwise (wo, w2): rank r owns the input features that match its heads / hidden columns; its product is a",
        "   full-size partial sum. GQA: tp divides n_kv_heads, so rank r's query heads find their key/value heads in",
        "   its own rows of wk and wv. Plan: mesh/tensor_parallel.py: block_plan.",
    ]
    for i, line in enumerate(notes):
        svg.text(20, 330 + i * 16, line, size=11)
    return svg.render()


def sp_transitions(sequence_parallel: bool = True) -> list[tuple[str, str]]:
    """One block's forward as (step, what moves): the activation layouts read from mesh/tensor_parallel.py."""
    from torch.distributed.tensor import Replicate, Shard

    from mesh.tensor_parallel import block_plan

    plan = block_plan(sequence_parallel)

    def layout(placement) -> str:
        if isinstance(placement, Shard) and placement.dim == 1:
            return "Shard(1): [b, s/t, h]"
        assert isinstance(placement, Replicate), placement
        return "Replicate: [b, s, h]"

    def move(src, dst) -> str:
        if src == dst:
            return "no communication"
        return "all-gather over the sequence" if isinstance(src, Shard) else "reduce-scatter over the sequence"

    between = plan["attention"].input_layouts[0]
    steps = []
    for sub, cols, row in (("attention", "wq, wk, wv", "wo"), ("feed_forward", "w1, w3", "w2")):
        norm = "attention_norm" if sub == "attention" else "ffn_norm"
        steps.append((f"{norm} ({type(plan[norm]).__name__})", layout(between)))
        wanted = plan[sub].desired_input_layouts[0]
        steps.append((f"{sub} input: {move(between, wanted)}", layout(wanted)))
        local = "attention on the local heads" if sub == "attention" else "SwiGLU on the local hidden columns"
        steps.append((f"{cols} (Colwise), {local}", "Shard(-1): own heads / hidden columns"))
        out = plan[f"{sub}.{row}"].output_layouts[0]
        reduction = "all-reduce" if isinstance(out, Replicate) else "reduce-scatter over the sequence"
        steps.append((f"{row} (Rowwise): partial sums -> {reduction}", layout(out)))
        steps.append(("+ residual", layout(out)))
    return steps


def sp_svg(tp: int = 2) -> str:
    with_sp, without = sp_transitions(True), sp_transitions(False)
    svg = Svg(1120, 100 + 2 * (len(with_sp) * 24 + 36) + 20)
    svg.text(
        10,
        22,
        f"One block's forward, tp = {tp}: where the activations change layout (bars: what each rank "
        "holds of [b, s, h])",
        size=13,
        weight="bold",
    )
    y = 40
    for title, steps, tint in (
        ("with sequence parallelism (parallel.sequence_parallel = true)", with_sp, colour(3)),
        ("without (plain Megatron TP)", without, colour(3)),
    ):
        svg.text(10, y + 14, title, size=13, weight="bold")
        y += 24
        for step, result in steps:
            communicates = any(w in step for w in ("all-gather", "reduce-scatter", "all-reduce"))
            svg.rect(20, y, 500, 20, tint if communicates else LIGHT, stroke="#cccccc")
            svg.text(26, y + 14, step, size=11, fill="white" if communicates else DARK)
            for r in range(tp):  # a bar per rank: the part of the tensor it holds
                bx, bw = 540 + r * 110, 100
                svg.rect(bx, y + 3, bw, 14, LIGHT, stroke="#cccccc")
                if result.startswith("Shard(1)"):
                    svg.rect(bx + r * bw / tp, y + 3, bw / tp, 14, colour(r))
                elif result.startswith("Replicate"):
                    svg.rect(bx, y + 3, bw, 14, colour(r))
                else:  # Shard(-1): all tokens, this rank's heads / hidden columns
                    svg.rect(bx, y + 3, bw, 7, colour(r))
            svg.text(770, y + 14, result, size=11)
            y += 24
        y += 12
    svg.text(
        10,
        y + 6,
        "Backward mirrors it: the gradient of an all-gather is a reduce-scatter and vice versa "
        "(2 + 2 per block each way with SP, 2 all-reduces without).",
        size=11,
    )
    svg.text(
        10,
        y + 22,
        "Bars: sequence along x, one bar per tp rank; a half-height bar holds only its heads "
        "or hidden columns. Layouts read from mesh/tensor_parallel.py: block_plan.",
        size=11,
    )
    return svg.render()
