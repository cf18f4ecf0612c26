"""Every picture of the chapters, drawn by code so that it stays true to the code it shows.

    python -m docs.figures                                   # regenerate everything in docs/img
    python -m docs.figures mesh --pp 2 --dp-shard 2 --tp 2   # the rank grid of any layout (+ its groups)
    python -m docs.figures pipeline --pp 4 --microbatches 8  # idealized schedules: idle fraction, memory

Each figure takes its facts from the code it illustrates wherever the code can say them: the collectives'
results from a symbolic model that tests/test_figures.py checks against real gloo collectives; ZeRO's bytes
from measure/memory_table.py; the TP and SP layouts from mesh/tensor_parallel.py's plans; the rank grid from
the same row-major rule as ``init_device_mesh`` (the test compares it with meshloom's real meshes); the EP
example from examples/moe_from_scratch.py; where each expert lives from the same row-major rule as mesh/dims.py; the DCP chunks from the placements meshloom gives a weight (the
test reads them off a real 2 x 2 run); the RoPE wavelengths from models/rope.py; the pipeline schedules from torch's own action lists
(measure/schedule_ir.py); the memory per pipeline rank under three layer splits from planning/memory_estimate.py and
mesh/pipeline.py's splits. Plain SVG strings (docs/figures/svg.py), no dependencies; one module per picture family, named for its chapter.

The *measured* pictures in docs/img come from runs, not from this file: the pipeline timelines
``pp<P>_m<M>_<schedule>.svg`` from ``python -m measure.pipeline_bubble --pp P --microbatches M`` and the expert
load ``moe_load.svg`` from ``python -m measure.moe_load``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from docs.figures.collectives import collective_cells, collectives_svg, evaluate_cells
from docs.figures.context_parallel import cp_mask_svg, ring_cells
from docs.figures.dcp import DCP_EXAMPLE, LOAD_MESH, SAVE_MESH, dcp_reads, dcp_svg, placement_boxes
from docs.figures.expert_parallel import (
    PLACEMENT_LAYOUTS,
    PLACEMENT_SIZES,
    ep_example,
    ep_svg,
    expert_holdings,
    expert_placement_svg,
)
from docs.figures.mesh_grid import MESH_ORDER, layout_groups, mesh_svg
from docs.figures.pipeline import PIPELINE_FIGURES, SCHEDULE_STAGES, pipeline_ideal, pipeline_svg, pipeline_table
from docs.figures.pp_split import pp_split_svg
from docs.figures.rope import rope_svg
from docs.figures.svg import CHAR_WIDTH, IMG, ROOT, Svg
from docs.figures.tensor_parallel import sp_svg, sp_transitions, tp_split_svg
from docs.figures.tied_embeddings import tied_embeddings_svg
from docs.figures.zero import zero_svg

__all__ = [
    "CHAR_WIDTH",
    "DCP_EXAMPLE",
    "IMG",
    "LOAD_MESH",
    "MESH_ORDER",
    "ROOT",
    "SAVE_MESH",
    "SCHEDULE_STAGES",
    "Svg",
    "all_figures",
    "collective_cells",
    "dcp_reads",
    "PLACEMENT_LAYOUTS",
    "PLACEMENT_SIZES",
    "ep_example",
    "expert_holdings",
    "evaluate_cells",
    "layout_groups",
    "main",
    "mesh_svg",
    "pipeline_ideal",
    "placement_boxes",
    "ring_cells",
    "sp_transitions",
    "write_all",
]

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
        "tied_embeddings_pp.svg": tied_embeddings_svg,
        "ep_dispatch.svg": ep_svg,
        "ep_placement.svg": expert_placement_svg,
        "dcp_reshard.svg": dcp_svg,
        "cp_causal_mask.svg": cp_mask_svg,
        "rope_scaling.svg": rope_svg,
        "pp_split_memory.svg": pp_split_svg,
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
        if (args.dp_shard * args.cp * args.tp) % args.ep:
            parser.error(f"--ep {args.ep} must divide --dp-shard x --cp x --tp (ep borrows those ranks)")
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
