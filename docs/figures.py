"""Every picture of the chapters, drawn by code so that it stays true to the code it shows.

    python -m docs.figures                                   # regenerate everything in docs/img
    python -m docs.figures mesh --pp 2 --dp-shard 2 --tp 2   # the rank grid of any layout (+ its groups)
    python -m docs.figures pipeline --pp 4 --microbatches 8  # idealized schedules: idle fraction, memory

Each figure takes its facts from the code it illustrates wherever the code can say them: the collectives'
results from a symbolic model that tests/test_figures.py checks against real gloo collectives; ZeRO's bytes
from bench/memory_table.py; the TP and SP layouts from mesh/tensor_parallel.py's plans; the rank grid from
the same row-major rule as ``init_device_mesh`` (the test compares it with meshloom's real meshes); the EP
example from examples/moe_from_scratch.py; the DCP chunks from the placements meshloom gives a weight (the
test reads them off a real 2 x 2 run); the pipeline schedules from torch's own action lists
(docs/schedule_ir.py). Plain SVG strings, no dependencies.

The *measured* pictures in docs/img come from runs, not from this file: the pipeline timelines
``pp<P>_m<M>_<schedule>.svg`` from ``python -m bench.pipeline_bubble --pp P --microbatches M`` and the expert
load ``moe_load.svg`` from ``python -m bench.moe_load``.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMG = ROOT / "docs" / "img"
PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7"]
GREY, DARK, LIGHT = "#9a9a9a", "#333333", "#eeeeee"


def colour(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


class Svg:
    """A minimal SVG writer: rectangles, text, lines and arrows, in document order."""

    def __init__(self, width: float, height: float, font_size: int = 12):
        self.width, self.height, self.parts = width, height, []
        self.font_size = font_size

    def rect(self, x, y, w, h, fill, stroke="white", text=None, text_fill="white", size=None, tooltip=None, dash=False):
        dashed = ' stroke-dasharray="3,2"' if dash else ""
        title = f"<title>{tooltip}</title>" if tooltip else ""
        self.parts.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}" stroke="{stroke}"{dashed}>'
            f"{title}</rect>"
        )
        if text is not None:
            self.text(x + w / 2, y + h / 2 + 4, text, anchor="middle", fill=text_fill, size=size)

    def text(self, x, y, s, anchor="start", fill=DARK, size=None, weight=None):
        bold = f' font-weight="{weight}"' if weight else ""
        size = f' font-size="{size}"' if size else ""
        escaped = str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        self.parts.append(
            f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" fill="{fill}"{size}{bold}>{escaped}</text>'
        )

    def line(self, x1, y1, x2, y2, stroke=GREY, width=1.0, arrow=False):
        head = ' marker-end="url(#arrow)"' if arrow else ""
        self.parts.append(
            f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{stroke}" stroke-width="{width}"{head}/>'
        )

    def render(self) -> str:
        return "\n".join(
            [
                f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width:.0f}" height="{self.height:.0f}" '
                f'font-family="monospace" font-size="{self.font_size}">',
                '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
                f'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="{GREY}"/></marker></defs>',
                '<rect width="100%" height="100%" fill="white"/>',
                *self.parts,
                "</svg>",
                "",
            ]
        )


# ---- 1. collectives ------------------------------------------------------------------------------------------

RANK_LETTERS = "abcdefgh"
COLLECTIVES = {  # name -> (cost per rank in the ring/tree algorithms NCCL and gloo use, one line of meaning)
    "broadcast": ("≈ N", "rank 0's data to everyone"),
    "reduce": ("≈ N", "the sum, on rank 0 only"),
    "all-reduce": ("2(n-1)/n·N", "the sum, on every rank"),
    "reduce-scatter": ("(n-1)/n·N", "rank r: chunk r of the sum"),
    "all-gather": ("(n-1)/n·N", "every rank: every rank's chunk"),
    "all-to-all": ("(n-1)/n·N", "chunk j of rank r goes to rank j"),
}


def collective_cells(name: str, n: int) -> tuple[list[list[str]], list[list[str | None]]]:
    """Before and after of collective ``name`` on n ranks, as chunk labels: "b2" is chunk 2 of rank 1's input,
    "Σ2" the sum over ranks of chunk 2, None a buffer the collective leaves unspecified. Every input is n chunks
    (all-gather: one chunk per rank, chunk r on rank r), as in examples/collectives.py."""
    full = [[f"{RANK_LETTERS[r]}{j}" for j in range(n)] for r in range(n)]
    total = [f"Σ{j}" for j in range(n)]
    if name == "all-gather":
        return [[f"{RANK_LETTERS[r]}{r}"] for r in range(n)], [[f"{RANK_LETTERS[j]}{j}" for j in range(n)]] * n
    after = {
        "broadcast": [full[0]] * n,
        "reduce": [total] + [[None] * n for _ in range(n - 1)],
        "all-reduce": [total] * n,
        "reduce-scatter": [[f"Σ{r}"] for r in range(n)],
        "all-to-all": [[f"{RANK_LETTERS[j]}{r}" for j in range(n)] for r in range(n)],
    }[name]
    return full, after


def evaluate_cells(cells: list[str | None], inputs: list[list[float]], chunk: int) -> list[float] | None:
    """The numbers a row of labels stands for, given each rank's input vector (``chunk`` numbers per chunk)."""
    if any(c is None for c in cells):
        return None
    values = []
    for label in cells:
        j = int(label[1:])
        ranks = range(len(inputs)) if label[0] == "Σ" else [RANK_LETTERS.index(label[0])]
        values += [sum(inputs[r][j * chunk + k] for r in ranks) for k in range(chunk)]
    return values


def collectives_svg(n: int = 4) -> str:
    cell, panel_w = 26, 420
    panel_h = 54 + n * (cell + 4) + 26
    svg = Svg(2 * panel_w + 20, 3 * panel_h + 60)
    svg.text(10, 22, f"The collectives on n = {n} ranks. N: bytes of the whole n-chunk vector", size=14, weight="bold")
    for i, name in enumerate(COLLECTIVES):
        x0, y0 = 10 + (i % 2) * (panel_w + 10), 40 + (i // 2) * panel_h
        cost, meaning = COLLECTIVES[name]
        svg.text(x0, y0 + 14, name, size=13, weight="bold")
        svg.text(x0 + 150, y0 + 14, f"cost per rank {cost}", size=11)
        svg.text(x0, y0 + 30, meaning, size=11)
        before, after = collective_cells(name, n)
        for r in range(n):
            y = y0 + 40 + r * (cell + 4)
            svg.text(x0, y + cell / 2 + 4, f"r{r}", size=11)
            for col, (row, left) in enumerate(((before[r], x0 + 28), (after[r], x0 + 28 + n * cell + 60))):
                for j, label in enumerate(row):
                    fill = LIGHT if label is None else DARK if label[0] == "Σ" else colour(RANK_LETTERS.index(label[0]))
                    shown = "?" if label is None else label
                    svg.rect(left + j * cell, y, cell - 2, cell, fill, text=shown, size=10,
                             text_fill=DARK if label is None else "white")  # fmt: skip
                if col == 0 and r == n // 2 - 1:
                    svg.line(left + n * cell + 8, y + cell + 2, left + n * cell + 48, y + cell + 2, arrow=True)
    svg.text(10, 3 * panel_h + 50, "letters: whose input a chunk came from; Σj: chunk j summed over all ranks; "
             "?: unspecified; cost: ring (tree) algorithms", size=10)  # fmt: skip
    return svg.render()


# ---- 2. ZeRO stages ------------------------------------------------------------------------------------------


def zero_svg(n: int = 4) -> str:
    """What each of n data-parallel ranks holds, per parameter: bf16 weights 2, grads 2, fp32 optimizer 12."""
    from bench.memory_table import bytes_per_rank

    per_param = bytes_per_rank(1, n)
    rows = [("DDP", "full state", (1, 1, 1)), ("ZeRO-1", "ZeRO-1", (1, 1, n)),
            ("ZeRO-2", "ZeRO-2", (1, n, n)), ("ZeRO-3 / FSDP", "ZeRO-3/FSDP", (n, n, n))]  # fmt: skip
    parts = [("params 2", 2, colour(0)), ("grads 2", 2, colour(1)), ("Adam m, v + fp32 weights 12", 12, colour(2))]
    unit, left, top = 26, 130, 50
    svg = Svg(left + 16 * unit + 90, top + len(rows) * (n * 18 + 34) + 50)
    svg.text(10, 22, f"What each of N = {n} data-parallel ranks holds, in bytes per parameter", size=14, weight="bold")
    y = top
    for label, key, divisors in rows:
        svg.text(10, y + 14, label, size=13, weight="bold")
        svg.text(left + 16 * unit + 10, y + 14, f"{per_param[key]:g} B", size=12, weight="bold")
        for r in range(n):
            x = left
            for (name, size, fill), div in zip(parts, divisors, strict=True):
                width = size * unit
                svg.rect(x, y + 22 + r * 18, width, 14, LIGHT, stroke="#cccccc")
                held = width / div
                svg.rect(x + (r * held if div > 1 else 0), y + 22 + r * 18, held, 14, fill,
                         tooltip=f"rank {r}: {name} / {div}")  # fmt: skip
                x += width
            svg.text(left - 8, y + 33 + r * 18, f"rank {r}", anchor="end", size=10)
        y += n * 18 + 34
    for i, (name, _, fill) in enumerate(parts):
        svg.rect(10 + i * 120, y, 12, 12, fill)
        svg.text(10 + i * 120 + 16, y + 10, name.split(" ")[0] if i < 2 else "optimizer", size=10)
    svg.text(370, y + 10, "grey: held by another rank", size=10)
    svg.text(10, y + 30, "bf16 params 2 + bf16 grads 2 + fp32 master weights, Adam m and v 4 + 4 + 4 = 16 "
             "(bench/memory_table.py)", size=10)  # fmt: skip
    return svg.render()


# ---- 3. tensor parallelism: how the block's weights are split ------------------------------------------------

DEBUG_SHAPES = {  # (out, in) of the debug model's weights: dim 128, 8 heads, 4 kv heads, FFN hidden 384
    "attention.wq": (128, 128), "attention.wk": (64, 128), "attention.wv": (64, 128), "attention.wo": (128, 128),
    "feed_forward.w1": (384, 128), "feed_forward.w3": (384, 128), "feed_forward.w2": (128, 384),
}  # fmt: skip


def tp_split_svg(tp: int = 2) -> str:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from mesh.tensor_parallel import block_plan

    plan = block_plan(sequence_parallel=False)
    heads = {"attention.wq": 8, "attention.wk": 4, "attention.wv": 4}  # the debug model's (kv) heads
    scale = 0.5
    svg = Svg(1060, 470)
    svg.text(10, 22, f"Tensor parallelism, tp = {tp}: each weight of a block (stored out x in) and what each rank "
             "holds", size=14, weight="bold")  # fmt: skip
    groups = [("attention: split by heads", ["attention.wq", "attention.wk", "attention.wv", "attention.wo"], 20),
              ("MLP (SwiGLU): column- then row-parallel", ["feed_forward.w1", "feed_forward.w3", "feed_forward.w2"],
               560)]  # fmt: skip
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
    svg.text(10, 22, f"One block's forward, tp = {tp}: where the activations change layout (bars: what each rank "
             "holds of [b, s, h])", size=13, weight="bold")  # fmt: skip
    y = 40
    for title, steps, tint in (("with sequence parallelism (parallel.sequence_parallel = true)", with_sp, colour(3)),
                               ("without (plain Megatron TP)", without, colour(3))):  # fmt: skip
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
    svg.text(10, y + 6, "Backward mirrors it: the gradient of an all-gather is a reduce-scatter and vice versa "
             "(2 + 2 per block each way with SP, 2 all-reduces without).", size=11)  # fmt: skip
    svg.text(10, y + 22, "Bars: sequence along x, one bar per tp rank; a half-height bar holds only its heads "
             "or hidden columns. Layouts read from mesh/tensor_parallel.py: block_plan.", size=11)  # fmt: skip
    return svg.render()


# ---- 4. the rank grid of a layout --------------------------------------------------------------------------

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def layout_groups(sizes: dict[str, int], ep: int = 1) -> dict[str, list[list[int]]]:
    """The process groups of each mesh dim: ranks are laid out row-major over MESH_ORDER (init_device_mesh's rule),
    and a dim's group is the ranks that differ only in that dim. With ep > 1, dp_shard = efsdp x ep (ep inner).
    A missing dim (``cp`` in older layouts) has size 1."""
    import torch

    sizes = {d: sizes.get(d, 1) for d in MESH_ORDER}
    shape = [sizes[d] for d in MESH_ORDER]
    grid = torch.arange(math.prod(shape)).view(shape)
    groups = {}
    for i, dim in enumerate(MESH_ORDER):
        groups[dim] = grid.movedim(i, -1).reshape(-1, shape[i]).tolist()
    groups["dp"] = grid.permute(0, 3, 4, 1, 2).reshape(-1, sizes["dp_replicate"] * sizes["dp_shard"]).tolist()
    if ep > 1:
        split = grid.view(shape[0], shape[1], shape[2] // ep, ep, shape[3], shape[4])
        groups["ep"] = split.movedim(3, -1).reshape(-1, ep).tolist()
        groups["efsdp"] = split.movedim(2, -1).reshape(-1, shape[2] // ep).tolist()
    return groups


def mesh_svg(sizes: dict[str, int], ep: int = 1) -> str:
    sizes = {d: sizes.get(d, 1) for d in MESH_ORDER}
    pp, rep, shard, cp, tp = (sizes[d] for d in MESH_ORDER)
    box, gap = 58, 8
    cols = cp * tp
    panel_w = 120 + cols * (box + gap)
    rows = rep * shard
    groups = layout_groups(sizes, ep)
    listed = [d for d in (*MESH_ORDER, "dp", "ep", "efsdp") if d in groups and len(groups[d][0]) > 1]
    svg = Svg(max(20 + pp * (panel_w + 20), 720), 90 + rows * (box + gap) + 40 + 16 * len(listed) + 20)
    shown_dims = [d for d in MESH_ORDER if d != "cp" or cp > 1]
    layout = " x ".join(f"{d} {sizes[d]}" for d in shown_dims) + (f" (ep {ep} inside dp_shard)" if ep > 1 else "")
    svg.text(10, 22, f"DeviceMesh {layout}: {math.prod(sizes.values())} ranks, row-major", size=14, weight="bold")
    for p in range(pp):
        x0 = 20 + p * (panel_w + 20)
        svg.text(x0, 50, f"pp = {p}" + (" (pipeline stage)" if pp > 1 else ""), size=12, weight="bold")
        for col in range(cols):
            c, t = divmod(col, tp)
            label = f"cp {c} tp {t}" if cp > 1 else f"tp {t}"
            svg.text(x0 + 110 + col * (box + gap) + box / 2, 70, label, anchor="middle", size=11 if cp == 1 else 9)
        for row in range(rows):
            r_i, s_i = divmod(row, shard)
            y = 78 + row * (box + gap)
            name = f"rep {r_i} shard {s_i}" if rep > 1 else f"dp_shard {s_i}"
            svg.text(x0 + 104, y + box / 2 + 4, name, anchor="end", size=10)
            for col in range(cols):
                c, t = divmod(col, tp)
                rank = (((p * rep + r_i) * shard + s_i) * cp + c) * tp + t
                fill = colour(s_i % ep) if ep > 1 else colour(row)
                where = f"dp_shard {s_i}, cp {c}, tp {t}" if cp > 1 else f"dp_shard {s_i}, tp {t}"
                svg.rect(x0 + 110 + col * (box + gap), y, box, box, fill, text=str(rank), size=16,
                         tooltip=f"rank {rank}: pp {p}, dp_replicate {r_i}, {where}")  # fmt: skip
    y = 90 + rows * (box + gap) + 20
    meaning = {"pp": "pipeline neighbours (send/recv)", "dp_replicate": "HSDP replicas (gradient all-reduce)",
               "dp_shard": "FSDP shard group (all-gather, reduce-scatter)", "tp": "tensor parallel (consecutive ranks)",
               "cp": "context parallel (K/V all-gather or ring)",
               "dp": "all data-parallel ranks (loader, loss)", "ep": "expert parallel (all-to-all)",
               "efsdp": "FSDP of expert weights"}  # fmt: skip
    if cp > 1:  # the loss mesh adds cp: cp ranks of one dp rank share its sequences
        meaning["dp"] = "data-parallel ranks (loader; loss adds cp)"
    for d in listed:
        shown = " ".join(str(g) for g in groups[d][:8]) + (" ..." if len(groups[d]) > 8 else "")
        svg.text(20, y, f"{d:<13} {meaning[d]:<46} {shown}".replace(" ", "\u00a0"), size=11)
        y += 16
    note = "colour: ep coordinate" if ep > 1 else "colour: data-parallel row"
    svg.text(20, y + 4, note, size=10)
    return svg.render()


# ---- 5. expert parallelism: dispatch and combine ------------------------------------------------------------


def ep_example(ep: int = 2, n_experts: int = 4) -> dict:
    """The routing of examples/moe_from_scratch.py: per source rank, its tokens' experts and the rows per expert."""
    import torch

    from examples.moe_from_scratch import example_routing

    _, _, choice = example_routing(ep, n_experts)
    return {
        "choice": [c.tolist() for c in choice],
        "counts": [torch.bincount(c, minlength=n_experts).tolist() for c in choice],  # [source][expert]
    }


def ep_svg(ep: int = 2, n_experts: int = 4) -> str:
    data = ep_example(ep, n_experts)
    n_local = n_experts // ep
    cell = 24
    svg = Svg(1120, 110 + ep * 120)
    svg.text(10, 22, f"Expert parallelism: {n_experts} experts on {ep} ranks (rank r owns experts "
             f"{n_local}r..{n_local}r+{n_local - 1}), top-1 routing of examples/moe_from_scratch.py",
             size=13, weight="bold")  # fmt: skip
    columns = [(20, "tokens, sorted by expert"), (300, "1. counts exchanged"),
               (520, "2. dispatch: rows arrive by (source, expert)"), (820, "3. local experts; 4. combine: back")]  # fmt: skip
    for x, title in columns:
        svg.text(x, 50, title, size=11, weight="bold")
    for r in range(ep):
        y0 = 70 + r * 120
        svg.text(10, y0 - 4, f"rank {r}", size=12, weight="bold")
        sorted_experts = sorted(data["choice"][r])
        for i, e in enumerate(sorted_experts):
            svg.rect(20 + i * cell, y0 + 10, cell - 2, cell, colour(e), text=f"e{e}", size=9)
        splits = [sum(data["counts"][r][d * n_local : (d + 1) * n_local]) for d in range(ep)]
        svg.text(20, y0 + 50, "to ranks " + ", ".join(f"{d}: {n}" for d, n in enumerate(splits)) + " rows", size=10)
        svg.text(300, y0 + 26, f"sends {data['counts'][r]}", size=11)
        recv = [[data["counts"][s][e] for e in range(r * n_local, (r + 1) * n_local)] for s in range(ep)]
        svg.text(300, y0 + 44, f"receives {recv}", size=11)
        svg.text(300, y0 + 60, "(per source, per local expert)", size=9)
        x = 520
        for s in range(ep):
            for e_local in range(n_local):
                e = r * n_local + e_local
                for _ in range(data["counts"][s][e]):
                    svg.rect(x, y0 + 10, cell - 4, cell, colour(e), text=f"{s}", size=9, tooltip=f"from rank {s}")
                    x += cell - 2
            x += 8
        x = 820
        for e_local in range(n_local):
            e = r * n_local + e_local
            n_rows = sum(data["counts"][s][e] for s in range(ep))
            svg.rect(x, y0 + 10, 80, cell, colour(e), text=f"expert {e}: {n_rows}", size=9)
            x += 90
        svg.text(820, y0 + 56, "outputs return in arrival order,", size=10)
        svg.text(820, y0 + 70, "then to their source (splits swapped)", size=10)
    y = 90 + ep * 120
    svg.text(20, y - 20, "The numbers in the dispatched rows are their source rank. Forward: 1 count exchange + 2 "
             "all-to-alls (dispatch, combine); backward: 2 all-to-alls (their reverses).", size=11)  # fmt: skip
    svg.text(20, y - 4, "Counted in tests/test_collective_counts.py; the same example runs in examples/moe_from_scratch.py.",
             size=11)  # fmt: skip
    return svg.render()


# ---- 6. DCP: which saved chunks a rank reads when the layout changes ---------------------------------------


def placement_boxes(shape: tuple[int, int], mesh: tuple[int, ...], coord: tuple[int, ...], placements: list[str]):
    """The (row range, column range) boxes of a 2-D tensor that the rank at ``coord`` holds.

    ``placements`` per mesh dim: "R", "S0", "S1", or "SS0/k" (a _StridedShard of dim 0 with split_factor k:
    what FSDP holds of a weight TP already split on dim 0 over k ranks). Shards apply in mesh-dim order to the
    piece the previous dims left; a strided shard cuts each of its k blocks, and the Shard(0) of k that follows it
    (TP's, on a later mesh dim) picks one block. tests/test_figures.py checks this against real DTensors."""
    boxes, strided = [((0, shape[0]), (0, shape[1]))], 0
    for size, c, pl in zip(mesh, coord, placements, strict=True):
        if pl == "R":
            continue
        if pl == "S0" and strided == size:  # the later Shard(0) picks one of the strided shard's blocks
            boxes, strided = [boxes[c]], 0
            continue
        strided = int(pl.split("/")[1]) if pl.startswith("SS0/") else 0
        new = []
        for rows, cols in boxes:
            if pl.startswith("SS0/"):  # k blocks along dim 0, each cut in `size` parts; keep part c of each
                k = int(pl.split("/")[1])
                block = (rows[1] - rows[0]) // k
                step = block // size
                new += [
                    ((rows[0] + b * block + c * step, rows[0] + b * block + (c + 1) * step), cols) for b in range(k)
                ]
            elif pl == "S0":
                step = (rows[1] - rows[0]) // size
                new.append(((rows[0] + c * step, rows[0] + (c + 1) * step), cols))
            else:
                step = (cols[1] - cols[0]) // size
                new.append((rows, (cols[0] + c * step, cols[0] + (c + 1) * step)))
        boxes = new
    return _merge_rows(boxes)


def _merge_rows(boxes):
    boxes = sorted(boxes)
    merged = [boxes[0]]
    for rows, cols in boxes[1:]:
        (r0, r1), c = merged[-1]
        if c == cols and r1 == rows[0]:
            merged[-1] = ((r0, rows[1]), cols)
        else:
            merged.append((rows, cols))
    return merged


# The checkpoint chapter's example: the debug model saved on dp_shard 4, loaded on dp_shard 2 x tp 2.
# tests/test_figures.py reads these placements off meshloom's real TP + FSDP model on a 2 x 2 mesh.
DCP_EXAMPLE = {
    "layers.0.feed_forward.w2.weight": {"shape": (128, 384), "load": ["S0", "S1"]},  # row-parallel
    "layers.0.attention.wq.weight": {"shape": (128, 128), "load": ["SS0/2", "S0"]},  # column-parallel
}
SAVE_MESH, LOAD_MESH = (4,), (2, 2)


def dcp_reads(shape, save_placements, load_placements, save_mesh=SAVE_MESH, load_mesh=LOAD_MESH) -> dict:
    """For each rank of the loading layout: [(saved chunk index, overlap box)] it must read."""
    import itertools

    saved = [
        placement_boxes(shape, save_mesh, c, save_placements)[0] for c in itertools.product(*map(range, save_mesh))
    ]
    reads = {}
    for rank, coord in enumerate(itertools.product(*map(range, load_mesh))):
        mine = placement_boxes(shape, load_mesh, coord, load_placements)
        reads[rank] = [
            (i, ((max(r[0], sr[0]), min(r[1], sr[1])), (max(c[0], sc[0]), min(c[1], sc[1]))))
            for rows_cols in mine
            for i, (sr, sc) in enumerate(saved)
            for r, c in [rows_cols]
            if max(r[0], sr[0]) < min(r[1], sr[1]) and max(c[0], sc[0]) < min(c[1], sc[1])
        ]
    return reads


def dcp_svg() -> str:
    import itertools

    svg = Svg(1100, 480)
    svg.text(10, 22, "Resharding on load: saved on dp_shard 4, loaded on dp_shard 2 x tp 2 (rank = 2 dp + tp)",
             size=14, weight="bold")  # fmt: skip
    y0 = 50
    for name, spec in DCP_EXAMPLE.items():
        rows, cols = spec["shape"]
        s, cs = 0.9, 220 / cols  # row scale, column scale
        svg.text(10, y0 + 12, f"{name}  {rows}x{cols}  saved Shard(0) on 4 ranks -> loaded {spec['load']}", size=11,
                 weight="bold")  # fmt: skip
        # saved chunks
        for i in range(SAVE_MESH[0]):
            (r0, r1), (c0, c1) = placement_boxes((rows, cols), SAVE_MESH, (i,), ["S0"])[0]
            svg.rect(20 + c0 * cs, y0 + 24 + r0 * s, (c1 - c0) * cs, (r1 - r0) * s, colour(i),
                     text=f"__{i}_0.distcp", size=9)  # fmt: skip
        svg.text(20, y0 + 24 + rows * s + 14, "saved chunks (one file per saving rank)", size=10)
        # loading ranks: each new piece, coloured by the saved chunks it reads
        x_load = 270
        reads = dcp_reads((rows, cols), ["S0"], spec["load"])
        for rank, coord in enumerate(itertools.product(*map(range, LOAD_MESH))):
            for i, ((r0, r1), (c0, c1)) in reads[rank]:
                svg.rect(x_load + c0 * cs, y0 + 24 + r0 * s, (c1 - c0) * cs, (r1 - r0) * s, colour(i), stroke=colour(i))
            for (r0, r1), (c0, c1) in placement_boxes((rows, cols), LOAD_MESH, coord, spec["load"]):
                svg.rect(x_load + c0 * cs, y0 + 24 + r0 * s, (c1 - c0) * cs, (r1 - r0) * s, "none", stroke=DARK,
                         text=f"rank {rank}", text_fill="white", size=10)  # fmt: skip
        svg.text(x_load, y0 + 24 + rows * s + 14, "each new rank's piece, coloured by the chunk it reads", size=10)
        ty = y0 + 40
        for rank, items in reads.items():
            described = ", ".join(
                f"chunk {i} rows {b[0][0]}-{b[0][1] - 1} cols {b[1][0]}-{b[1][1] - 1}" for i, b in items
            )
            svg.text(x_load + 240, ty, f"rank {rank} reads {described}", size=10)
            ty += 16
        y0 += rows * s + 70
    svg.text(10, 465, "Each rank reads only the saved chunks its new piece overlaps, and only the overlap; no rank "
             "assembles a full tensor (docs/checkpointing.md).", size=11)  # fmt: skip
    return svg.render()


# ---- 7. pipeline schedules, idealized --------------------------------------------------------------------------

SCHEDULE_STAGES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "LoopedBFS": 2, "InterleavedZeroBubble": 2,
                   "ZBVZeroBubble": 2, "DualPipeV": 2}  # fmt: skip
PIPELINE_FIGURES = ((2, 4), (4, 8))


def pipeline_ideal(schedule: str, pp: int, microbatches: int) -> dict:
    from docs.schedule_ir import activations_in_flight, idle_fraction, schedule_actions, simulate

    v = SCHEDULE_STAGES[schedule]
    actions = schedule_actions(schedule, pp, microbatches, v)
    timed = simulate(actions, v)
    return {
        "timed": timed,
        "idle": idle_fraction(timed),
        "in_flight": [activations_in_flight(actions[r]) for r in sorted(actions)],
        "v": v,
    }


def pipeline_svg(schedule: str, pp: int, microbatches: int) -> str:
    from mesh.pipeline_timeline import COLOURS, predicted_bubble

    ideal = pipeline_ideal(schedule, pp, microbatches)
    timed, v = ideal["timed"], ideal["v"]
    span = max(t.end for t in timed)
    width, row_h, left, top = 1000, 34, 70, 40
    svg = Svg(left + width + 20, top + pp * row_h + 66, font_size=11)
    predicted = predicted_bubble(schedule, pp, microbatches, v)
    svg.text(left, 20, f"{schedule}: pp={pp}, {v} stage(s)/rank, m={microbatches}, idealized: idle {ideal['idle']:.1%} "
             f"(formula {predicted:.1%})", size=12)  # fmt: skip
    for rank in range(pp):
        y = top + rank * row_h
        svg.text(5, y + row_h / 2 + 4, f"rank {rank}")
        svg.rect(left, y, width, row_h - 6, LIGHT, stroke=LIGHT)
    for t in timed:
        a = t.action
        x, w = left + t.start / span * width, (t.end - t.start) / span * width
        label = f"{a.kind}{a.microbatch}" + (f"s{a.stage}" if v > 1 else "")
        later = v > 1 and a.stage >= pp  # the rank's second stage
        short = f"{a.microbatch}" + ("'" if later else "")
        shown = label if w > 7 * len(label) else short if w > 7 * len(short) else None
        svg.rect(x, top + t.rank * row_h, w, row_h - 6, COLOURS[a.kind], tooltip=f"{label}: {t.start:g}-{t.end:g}",
                 text=shown, size=10)  # fmt: skip
    legend_y = top + pp * row_h + 25
    for i, (kind, fill) in enumerate(COLOURS.items()):
        svg.rect(left + i * 110, legend_y - 10, 12, 12, fill)
        svg.text(left + i * 110 + 16, legend_y, f"{kind} " + {"F": "forward", "B": "backward", "I": "input grad",
                                                             "W": "weight grad"}[kind])  # fmt: skip
    second = "; n' = micro-batch n on the rank's second stage" if v > 1 else ""
    svg.text(left, legend_y + 18, f"grey: idle, {span:g} time units shown: a forward of one rank's layers takes 1, a "
             f"backward 2 (I = W = 1); sends are free{second}")  # fmt: skip
    return svg.render()


def pipeline_table(pp: int, microbatches: int) -> str:
    from mesh.pipeline_timeline import predicted_bubble

    lines = [f"pp={pp}, m={microbatches}: torch's action lists run with F = I = W = 1, B = 2 (per rank's worth of "
             "layers), sends free", f"{'schedule':<22} {'v':>2} {'formula':>8} {'idealized':>10}  activations in "
             "flight per rank (chunks)"]  # fmt: skip
    for schedule, v in SCHEDULE_STAGES.items():
        if schedule == "DualPipeV" and microbatches < 2 * pp:
            continue
        ideal = pipeline_ideal(schedule, pp, microbatches)
        lines.append(f"{schedule:<22} {v:>2} {predicted_bubble(schedule, pp, microbatches, v):>8.1%} "
                     f"{ideal['idle']:>10.1%}  {ideal['in_flight']}")  # fmt: skip
    return "\n".join(lines)


# ---- 7. context parallelism: who computes which part of the causal mask -----------------------------------------


def ring_cells(seq: int, cp: int) -> dict[tuple[int, int], set[tuple[int, int]]]:
    """(rank, ring step) -> the (query position, key position) pairs that rank computes at that step, read from
    mesh/context_parallel.py: each rank's positions, and ``visible`` (which local query rows meet which keys
    of the block it holds; a causal block keeps only key <= query)."""
    from mesh.context_parallel import load_balanced_positions, visible

    n = seq // cp
    cells = {}
    for rank in range(cp):
        mine = load_balanced_positions(seq, rank, cp).tolist()
        for step in range(cp):
            src = (rank - step) % cp
            theirs = load_balanced_positions(seq, src, cp).tolist()
            rows, keys, causal = visible(src, rank, n)
            cells[rank, step] = {(q, k) for q in mine[rows] for k in theirs[keys] if not causal or k <= q}
    return cells


def cp_mask_svg(cp: int = 4, seq: int = 32) -> str:
    """The causal mask of one sequence, coloured by the rank that computes each (query, key) pair: a plain split
    into cp pieces next to meshloom's balanced one, whose blocks carry the ring step that computes them."""
    from mesh.context_parallel import load_balanced_positions

    cell, chunk = 12, seq // (2 * cp)
    side = seq * cell
    svg = Svg(2 * side + 200, side + 215)
    svg.text(10, 22, f"Context parallelism, cp = {cp}: who computes which part of the causal mask "
             f"(s = {seq}, {2 * cp} chunks of {chunk})", size=14, weight="bold")  # fmt: skip
    ring = ring_cells(seq, cp)
    plain_owner = {q: q // (seq // cp) for q in range(seq)}
    balanced_owner = {q: r for r in range(cp) for q in load_balanced_positions(seq, r, cp).tolist()}
    step_of = {pair: step for (_, step), pairs in ring.items() for pair in pairs}
    panels = (("plain split: rank r holds tokens r·s/cp ..", plain_owner, 20),
              ("balanced: rank r holds chunks r and 2cp-1-r", balanced_owner, side + 160))  # fmt: skip
    for title, owner, x0 in panels:
        y0 = 70
        svg.text(x0, y0 - 22, title, size=12, weight="bold")
        svg.text(x0 + side / 2, y0 - 6, "key position →", anchor="middle", size=10)
        svg.text(x0 - 4, y0 + side + 14, "query ↓", size=10)
        svg.rect(x0, y0, side, side, LIGHT, stroke=LIGHT)  # masked: key after query
        for q in range(seq):  # query q sees keys 0 .. q: one run of its rank's colour
            svg.rect(x0, y0 + q * cell, (q + 1) * cell, cell, colour(owner[q]), stroke=colour(owner[q]),
                     tooltip=f"query {q} (rank {owner[q]}) sees keys 0-{q}")  # fmt: skip
        for i in range(1, seq):  # the cell grid
            svg.line(x0 + i * cell, y0, x0 + i * cell, y0 + side, stroke="white", width=0.6)
            svg.line(x0, y0 + i * cell, x0 + side, y0 + i * cell, stroke="white", width=0.6)
        for c in range(1, 2 * cp):  # chunk boundaries
            svg.line(x0 + c * chunk * cell, y0, x0 + c * chunk * cell, y0 + side, stroke=DARK, width=0.5)
            svg.line(x0, y0 + c * chunk * cell, x0 + side, y0 + c * chunk * cell, stroke=DARK, width=0.5)
        if owner is balanced_owner:  # the ring step of each chunk block
            for qc in range(2 * cp):
                for kc in range(qc + 1):
                    q, k = qc * chunk + chunk - 1, kc * chunk
                    x = x0 + (kc + (0.35 if kc == qc else 0.5)) * chunk * cell  # diagonal blocks: left of the edge
                    svg.text(x, y0 + (qc + 0.7) * chunk * cell, f"t{step_of[q, k]}",
                             anchor="middle", fill="white", size=11, weight="bold")  # fmt: skip
        work = [sum(q + 1 for q in range(seq) if owner[q] == r) for r in range(cp)]
        svg.text(x0, y0 + side + 32, "pairs per rank: " + ", ".join(f"rank {r} {w}" for r, w in enumerate(work)),
                 size=11)  # fmt: skip
    notes = [
        "Colour: the rank that owns the query row and computes the pair. Grey: masked (key after query).",
        "t0, t1, ...: the ring step at which that rank computes the block (it then holds the K/V of rank r - t);",
        "the all-gather algorithm computes them all at once after gathering. Steps and cells: mesh/context_parallel.py.",
    ]
    for i, line in enumerate(notes):
        svg.text(20, side + 130 + i * 16, line, size=11)
    for r in range(cp):  # legend
        svg.rect(20 + r * 62, side + 184, 56, 16, colour(r), text=f"rank {r}", size=10)
    return svg.render()


# ---- all of them -------------------------------------------------------------------------------------------

MESH_FIGURES = {
    "mesh_dp2x2_tp2.svg": ({"pp": 1, "dp_replicate": 2, "dp_shard": 2, "tp": 2}, 1),
    "mesh_pp2_dp2_tp2_ep2.svg": ({"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 2}, 2),
    "mesh_dp2_cp2_tp2.svg": ({"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 2}, 1),
}


def all_figures() -> dict[str, Callable[[], str]]:
    figures: dict[str, Callable[[], str]] = {
        "collectives.svg": collectives_svg,
        "zero_stages.svg": zero_svg,
        "tp_split.svg": tp_split_svg,
        "sp_transitions.svg": sp_svg,
        "ep_dispatch.svg": ep_svg,
        "dcp_reshard.svg": dcp_svg,
        "cp_causal_mask.svg": cp_mask_svg,
    }
    for name, (sizes, ep) in MESH_FIGURES.items():
        figures[name] = lambda sizes=sizes, ep=ep: mesh_svg(sizes, ep)
    for pp, m in PIPELINE_FIGURES:
        for schedule in SCHEDULE_STAGES:
            figures[f"pp{pp}_m{m}_{schedule}_ideal.svg"] = lambda s=schedule, pp=pp, m=m: pipeline_svg(s, pp, m)
    return figures


def write_all(out: Path = IMG) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in all_figures().items():
        (out / name).write_text(draw())
        written.append(out / name)
    return written


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m docs.figures", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    everything = sub.add_parser("all", help="regenerate every picture (the default)")
    everything.add_argument("--out", default=str(IMG))
    mesh = sub.add_parser("mesh", help="draw the rank grid of a layout and list its process groups")
    for dim in ("pp", "dp-replicate", "dp-shard", "cp", "tp", "ep"):
        mesh.add_argument(f"--{dim}", type=int, default=1)
    mesh.add_argument("--out", default="mesh.svg")
    pipe = sub.add_parser("pipeline", help="idealized idle fraction and memory of every schedule")
    pipe.add_argument("--pp", type=int, default=4)
    pipe.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args(argv)
    if args.command == "mesh":
        sizes = {
            "pp": args.pp,
            "dp_replicate": args.dp_replicate,
            "dp_shard": args.dp_shard,
            "cp": args.cp,
            "tp": args.tp,
        }
        if args.dp_shard % args.ep:
            parser.error(f"--ep {args.ep} must divide --dp-shard {args.dp_shard} (ep is carved from dp_shard)")
        Path(args.out).write_text(mesh_svg(sizes, args.ep))
        for dim, groups in layout_groups(sizes, args.ep).items():
            if dim != "cp" or args.cp > 1:
                print(f"{dim:<13} {groups}")
        print(f"picture: {args.out}")
    elif args.command == "pipeline":
        print(pipeline_table(args.pp, args.microbatches))
    else:
        for path in write_all(Path(getattr(args, "out", IMG))):
            print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


if __name__ == "__main__":
    main(sys.argv[1:])
