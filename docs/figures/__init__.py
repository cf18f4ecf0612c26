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
from runtime.config import ConfigError
from runtime.options import check_out_folder, int_option, path_option

MAX_RANKS = 64  # a rank grid or a schedule of more is too small to read

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


def build_parser() -> argparse.ArgumentParser:
    """The subcommands and their options, each with a checked type (runtime/options.py; tests/test_input_walk.py
    walks them). The degrees stay small: a picture of more ranks than ``MAX_RANKS`` is unreadable, and the
    pipeline table's rows grow with pp x microbatches."""
    parser = argparse.ArgumentParser(prog="python -m docs.figures", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    everything = sub.add_parser("all", help="regenerate every picture (the default)")
    everything.add_argument("--out", type=path_option(), default=str(IMG))
    mesh = sub.add_parser("mesh", help="draw the rank grid of a layout and list its process groups")
    for dim in ("pp", "dp-replicate", "dp-shard", "cp", "tp", "ep"):
        mesh.add_argument(f"--{dim}", type=int_option(ge=1, le=MAX_RANKS), default=1)
    mesh.add_argument("--out", type=path_option(), default="mesh.svg")
    pipe = sub.add_parser("pipeline", help="idealized idle fraction and memory of every schedule")
    pipe.add_argument("--pp", type=int_option(ge=1, le=MAX_RANKS), default=4)
    pipe.add_argument("--microbatches", type=int_option(ge=1, le=MAX_RANKS), default=8)
    return parser


def main(argv: list[str]) -> None:
    parser = build_parser()
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
        write_picture(parser, Path(args.out), mesh_svg(sizes, args.ep))
        for dim, groups in layout_groups(sizes, args.ep).items():
            if dim != "cp" or args.cp > 1:
                print(f"{dim:<13} {groups}")
        print(f"picture: {args.out}")
    elif args.command == "pipeline":
        problem = pipeline_problem(args.pp, args.microbatches)
        if problem:
            parser.error(problem)
        print(pipeline_table(args.pp, args.microbatches))
    else:
        out = Path(getattr(args, "out", IMG))
        try:
            check_out_folder(out, "--out")
            written = write_all(out)
        except (ConfigError, OSError) as err:
            parser.error(
                str(err)
                if isinstance(err, ConfigError)
                else f"--out {out}: {err.strerror}; pass a folder you can write"
            )
        for path in written:
            print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def write_picture(parser: argparse.ArgumentParser, out: Path, text: str) -> None:
    """``text`` into the file ``out``, or exit 2 naming --out and the fix (a folder, a missing folder, no rights)."""
    if out.is_dir():
        parser.error(f"--out {out} is a folder; pass a file path, e.g. {out / 'mesh.svg'}")
    try:
        out.write_text(text)
    except OSError as err:
        parser.error(f"--out {out}: {err.strerror}; pass a file in a folder that exists and you can write")


def pipeline_problem(pp: int, microbatches: int) -> str | None:
    """Why some schedule of the table cannot run ``pp`` ranks with ``microbatches`` (the rules train.py applies,
    planning/layout_rules.py), worded with this command's options; None when every schedule can."""
    from planning.layout_rules import pipeline_errors

    for schedule, v in SCHEDULE_STAGES.items():
        if schedule == "DualPipeV" and microbatches < 2 * pp:  # the table leaves it out (pipeline_table)
            continue
        for error in pipeline_errors(pp, schedule, v, microbatches, None, "params", pp * v):
            return f"--pp {pp} --microbatches {microbatches}: {error.replace('parallel.pp_microbatches=', '--microbatches ')}"
    return None
