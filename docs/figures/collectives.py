"""Section 1: what each collective computes, cell by cell (a symbolic model the tests check against gloo)."""

from __future__ import annotations

from docs.figures.svg import DARK, LIGHT, Svg, colour

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
                    svg.rect(
                        left + j * cell,
                        y,
                        cell - 2,
                        cell,
                        fill,
                        text=shown,
                        size=10,
                        text_fill=DARK if label is None else "white",
                    )
                if col == 0 and r == n // 2 - 1:
                    svg.line(left + n * cell + 8, y + cell + 2, left + n * cell + 48, y + cell + 2, arrow=True)
    svg.text(
        10,
        3 * panel_h + 50,
        "letters: whose input a chunk came from; Σj: chunk j summed over all ranks; "
        "?: unspecified; cost: ring (tree) algorithms",
        size=10,
    )
    return svg.render()
