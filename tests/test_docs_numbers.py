"""The chapters' arithmetic, recomputed: every marked number and every symbol the chapters define.

1. **Numbers.** A number in the prose that follows from a formula or a bench (a ratio, a byte count, a bubble
   fraction, a traffic multiple, a rounding bound) carries a marker, an HTML comment that the rendered page
   does not show, after it in the same paragraph (or after the table that holds it):

       the ring sends (3cp − 2)/(2(cp − 1)) ≈ 1.67x the all-gather <!-- check 1.67x: ring_bytes(4) / allgather_bytes(4) -->

   The quote (``1.67x``) must stand in the paragraph before the marker, verbatim. The expression is evaluated
   with the helpers of ``NAMESPACE`` (meshloom's own formulas and benches' formula functions) and rounded to
   the quote's decimals: ``%`` reads the value as a fraction (0.1667 -> 16.7%), ``x``/``×`` as a ratio, any
   other unit (GB, MB, s, bytes) as the number in that unit; thousands commas are ignored. A changed number in
   the code fails here until the prose follows, and a changed prose number fails until the code agrees.
2. **Symbols.** docs/glossary.md's tables give each symbol one meaning across the whole course: a symbol has
   one row in all of the glossary's tables together (a second row fails, naming the symbol and both rows), a
   meaning cell may not list a second one (no ';' between two meanings, no "(chapter N)" alternatives), and
   there is no table of excused letters (a table headed '| symbol | uses' fails). Every symbol a chapter
   defines carries the marker ``<!-- symbol X -->`` (or ``<!-- symbols X, Y -->``) at its definition, and is
   a row of the glossary.
3. **No unmarked number.** docs/unmarked.py lists every number of a chapter's core and exercises, and of the
   whole of README.md (whose markers section 1 checks too), that no marker regenerates (its docstring gives the rule); a finding that docs/unmarked_allowed.txt does not list
   fails, and so does a listed one that is gone (the list only shrinks).
4. **Pictures.** The idealized pipeline pictures (docs/img/*_ideal.svg, drawn by docs/figures/pipeline.py) state
   in their titles the idle fraction they show and the chapter's formula for it; the two agree.
"""

from __future__ import annotations

import math
import re
import sys
from functools import cache

import pytest

from launch.local_runs import ROOT

DOCS = ROOT / "docs"
CHAPTERS = sorted(p for p in DOCS.glob("*.md") if p.name != "glossary.md")
CHECK = re.compile(r"<!-- check (?P<quote>[^:]+?): (?P<expr>.+?) -->")
QUOTE = re.compile(r"^(?P<number>-?\d[\d,]*(?:\.\d+)?(?:e-?\d+)?)\s*(?P<unit>%|x|×|[A-Za-z/ ]*)$")

# ---- the helpers a marker's expression may use: meshloom's own formulas ------------------------------------


@cache
def model(name: str):
    """ModelArgs of the debug models ('debug', 'debug_moe': configs/NAME.toml) or of a models/llama.py preset."""
    if name.startswith("debug"):
        from runtime.config import load_config, model_args

        return model_args(load_config(path=f"configs/{name}.toml"))
    return preset(name)


def psi_with(name: str, overrides: dict) -> int:
    """Parameters of configs/NAME.toml with config overrides (a bench's model: measure/pipeline_bubble.py: MODEL)."""
    from runtime.config import load_config, model_args

    return model_args(load_config(path=f"configs/{name}.toml", overrides=overrides)).num_params()


def psi(name: str) -> int:
    """Parameters of a model ('debug', 'llama3-8b', ...)."""
    return model(name).num_params()


def flops(name: str, seq: int) -> int:
    """Model FLOPs per token (`models/flops.py: flops_per_token`)."""
    from models.flops import flops_per_token

    return flops_per_token(model(name), seq)


def capacity(cf: float, seq: int, k: int, experts: int) -> int:
    """Tokens an expert accepts per sequence (`models/moe.py: MoE.capacity`)."""
    from types import SimpleNamespace

    from models.moe import MoE

    args = SimpleNamespace(capacity_factor=cf, top_k=k, n_experts=experts)
    return MoE.capacity(SimpleNamespace(args=args), seq)


def preset(name: str):
    """A models/llama.py preset's ModelArgs ('llama3-8b')."""
    from models.presets import PRESETS

    return PRESETS[name]


def layer_params(name: str) -> float:
    """Parameters of one block of a preset: Ψ less the embedding, the head and the final norm, per layer."""
    args = preset(name)
    return (psi(name) - 2 * args.vocab_size * args.dim - args.dim) / args.n_layers


def stages(schedule: str) -> int:
    from measure.schedule_ir import SCHEDULE_STAGES

    return SCHEDULE_STAGES[schedule]


def bubble(schedule: str, p: int, m: int) -> float:
    """The chapter 4 formula, `observers/pipeline_timeline.py: predicted_bubble` (from an empty pipeline)."""
    from observers.pipeline_timeline import predicted_bubble

    return predicted_bubble(schedule, p, m, stages(schedule))


@cache
def idle(schedule: str, p: int, m: int) -> float:
    """torch's action list run with unit times: the idealized idle fraction (measure/schedule_ir.py)."""
    from measure.schedule_ir import pipeline_ideal

    return pipeline_ideal(schedule, p, m)["idle"]


def ring_share(n: int) -> float:
    """Bytes one rank sends in a ring all-gather or reduce-scatter, per byte of the whole tensor."""
    from cluster.step_time import ring

    return ring(1.0, n)


def allreduce_share(n: int) -> float:
    """A ring all-reduce: reduce-scatter + all-gather, 2(n-1)/n."""
    return 2 * ring_share(n)


def state_bytes(p: int, n: int = 1) -> dict[str, float]:
    """measure/memory_table.py: bytes per rank of the full state and the ZeRO stages (bf16 + Adam, k = 12)."""
    from measure.memory_table import bytes_per_rank

    return bytes_per_rank(p, n)


def fsdp_bytes(p: int, n: int) -> float:
    from measure.fsdp_memory import formula_bytes

    return formula_bytes(p, n)


def cp_bytes(cp: int, algorithm: str) -> int:
    """Bytes sent per layer and rank by context parallelism at the bench's size (measure/context_parallel.py)."""
    from measure.context_parallel import BATCH, BENCH_ARGS, SEQ, formula_comm

    return formula_comm(BENCH_ARGS, BATCH, SEQ, cp, algorithm)


def cp_pairs(seq: int, cp: int, rank: int) -> int:
    """(query, key) pairs of the causal mask a cp rank computes: its positions from
    `mesh/context_parallel.py: load_balanced_positions`, position p attending p + 1 keys."""
    from mesh.context_parallel import load_balanced_positions

    return int((load_balanced_positions(seq, rank, cp) + 1).sum())


@cache
def layer_terms(preset: str = "llama3-8b", seq: int = 8192, tp: int = 1, precision: str = "bf16") -> dict:
    """Bytes one block keeps for backward, by term (`planning/memory_estimate.py: layer_activation_terms`)."""
    from models.presets import PRESETS
    from planning.layout import Layout
    from planning.memory_estimate import layer_activation_terms

    layout = Layout(seq_len=seq, tp=tp, mixed_precision=precision)
    return layer_activation_terms(PRESETS[preset], 0, layout, "none")


def layer_bytes(preset: str = "llama3-8b", seq: int = 8192, tp: int = 1, precision: str = "bf16") -> float:
    return sum(layer_terms(preset, seq, tp, precision).values())


def korthikanti(s: int, h: int, b: int = 1) -> float:
    """Korthikanti et al.'s 34·s·b·h bytes per GPT layer in 16-bit precision (attention scores aside)."""
    return 34 * s * b * h


def fp32_norm_copies(preset: str = "llama3-8b", seq: int = 8192) -> float:
    """The fp32 copies of its input that meshloom's two RMSNorms per layer keep: 2 · 4 bytes · s · h."""
    from models.presets import PRESETS

    return 2 * 4 * seq * PRESETS[preset].dim


def finfo(dtype: str):
    import torch

    return torch.finfo(getattr(torch, dtype))


def half_gap(dtype: str) -> float:
    """The largest relative rounding error of round-to-nearest: half the gap after 1.0."""
    return finfo(dtype).eps / 2


def saved_chunks(shape, saved, loaded) -> dict:
    """Which saved chunk each new rank reads (`docs/figures/dcp.py: dcp_reads`): {rank: [(chunk, box), ...]}."""
    from docs.figures import dcp_reads

    return dcp_reads(shape, saved, loaded)


def rmsnorm_extra_bytes(dtype: str = "bfloat16") -> float:
    """Bytes per element that an RMSNorm composed of plain ops saves for backward beyond
    `models/llama.py: _RMSNormFunction`, measured with saved-tensor hooks (each saved storage counted once)."""
    import torch

    from models.llama import _RMSNormFunction

    def saved_bytes(norm) -> int:
        storages: dict[int, int] = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = torch.randn(8, 64, dtype=getattr(torch, dtype), requires_grad=True)
        weight = torch.ones(64, dtype=getattr(torch, dtype), requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            norm(x, weight)
        # the input and the weight are the caller's anyway when both keep them; count what each adds
        return sum(storages.values()) - (weight.numel() * weight.element_size())

    def composed(x, weight):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * weight

    fused = saved_bytes(lambda x, w: _RMSNormFunction.apply(x, w, 1e-5))
    return (saved_bytes(composed) - fused) / (8 * 64)


def sp_regathers(n_layers: int) -> int:
    """All-gathers `parallel.sp_regather` adds to a step: one per sub-layer whose TP plan regathers its input in
    backward (`mesh/sequence_parallel.py: GatherSavingShard`), in each of ``n_layers`` blocks."""
    from mesh.sequence_parallel import GatherSavingShard
    from mesh.tensor_parallel import block_plan

    return n_layers * sum(isinstance(style, GatherSavingShard) for style in block_plan(True, True).values())


def throughput_layers() -> int:
    """Blocks of the model `python -m measure.tokens_per_second` trains."""
    from measure.tokens_per_second import SHAPE

    return SHAPE["model.n_layers"]


@cache
def pp_split(split: str) -> tuple[list[int], list[float]]:
    """(layers per stage, each rank's peak in GiB) of chapter 4's picture (docs/figures/pp_split.py):
    split is 'equal layers', 'pp_split params' or 'pp_split memory'."""
    from docs.figures.pp_split import pp_split_rows

    sizes, ranks = next((sizes, ranks) for name, sizes, ranks in pp_split_rows() if name == split)
    return sizes, [m.total / 2**30 for m in ranks]


@cache
def planned(model: str, layout: str, tokens: float = 4e6, gpu: str = "h100", seq: int = 8192) -> dict:
    """What `python -m cluster.plan_layout --model MODEL --gpu GPU --layout LAYOUT --global-batch-tokens TOKENS
    --json` prints for one layout (memory_gb, step_s, memory_breakdown_gb, ...)."""
    from cluster.plan_layout import MODELS, choose, parse_layout

    args = MODELS[model]
    parsed, fixed = parse_layout(layout, args, seq)
    return choose(args, parsed, fixed, gpu, seq, tokens)[0]


@cache
def masked_recipe(name: str) -> tuple[float, float, float]:
    """(loss, loss error, gradient error) of a loss recipe at step 0 on the masked data of tests/test_masked_loss.py
    (`wrong_way_errors`, what `test_the_wrong_ways_differ_from_one_process` prints): 'global count (meshloom)',
    'per-micro-batch mean, averaged' or 'per-rank mean, averaged'."""
    import tempfile
    from pathlib import Path

    from tests.test_masked_loss import write_masked_folder, wrong_way_errors

    with tempfile.TemporaryDirectory() as folder:
        return wrong_way_errors(write_masked_folder(Path(folder) / "data"))[name]


def constant(module: str, name: str):
    """A module-level constant of meshloom's code ('tests.training_runs', 'LOSS_RTOL'): a tolerance or a size the
    prose quotes is read from where the code defines it."""
    import importlib

    return getattr(importlib.import_module(module), name)


def default(module: str, function: str, parameter: str):
    """A function's default argument ('examples.ring_allreduce', 'run', 'numel'): the size an example runs at;
    ``function`` may be a method ('PContext.close')."""
    import importlib
    import inspect

    target = importlib.import_module(module)
    for name in function.split("."):
        target = getattr(target, name)
    return inspect.signature(target).parameters[parameter].default


def gpu(name: str):
    """A GPU's figures from the planner's table (`planning/gpus.py`): peaks, memory, NVLink and network bandwidth."""
    from planning.gpus import gpu_row

    return gpu_row(name)


def config_default(field: str):
    """A config field's default ('parallel.collective_timeout_s'), as runtime/schema.py declares it."""
    from runtime.schema import Config

    section, name = field.split(".")
    return getattr(getattr(Config(), section), name)


def checkpoint_bytes(num_params: int) -> int:
    """`checkpoint/folder.py: checkpoint_bytes`, the room a checkpoint folder must have."""
    from checkpoint.folder import checkpoint_bytes as room

    return room(num_params)


def as_dtype(x: float, dtype: str) -> float:
    """``x`` rounded to the nearest number of ``dtype`` ('bfloat16')."""
    import torch

    return torch.tensor(x, dtype=getattr(torch, dtype)).item()


# ---- helpers that rerun a chapter's example (docs/mixed_precision.md) ------------------------------------


@cache
def fp16_toy() -> dict:
    """What `python examples/mixed_precision_fp16.py` prints (its ``run()``: the fp16 underflow and loss-scaling
    toy), computed once per session (a few seconds of one CPU core); a number the script prints as a string
    ('1.8e-02', the losses) is read back as a float, so that a marker can compute with it."""
    from examples.mixed_precision_fp16 import run

    def numbers(x):
        if isinstance(x, dict):
            return {k: numbers(v) for k, v in x.items()}
        if isinstance(x, list):
            return [numbers(v) for v in x]
        if isinstance(x, str):
            try:
                return float(x)
            except ValueError:
                return x
        return x

    return numbers(run())


@cache
def bf16_losses(steps: int = 20) -> dict[int, float]:
    """{step: loss} of `python train.py --config configs/debug.toml --training.steps 20 --training.mixed_precision
    bf16` on one process (about 5 s of one CPU core), as its metrics.jsonl logs them."""
    import json
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        command = ["train.py", "--config", "configs/debug.toml", "--training.steps", str(steps)]
        command += ["--training.mixed_precision", "bf16", "--run.dir", folder, "--run.tensorboard", "false"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, *command], cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
        records = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def fp32_loss(step: int) -> float:
    """The one-process fp32 reference loss of the 20-step debug run (docs/_includes/one_process_losses.md)."""
    return reference_loss("20 steps", step)


def bf16_gap(step: int) -> float:
    """The relative loss difference of the bf16 run from the fp32 reference at a step."""
    return abs(bf16_losses()[step] / fp32_loss(step) - 1)


# ---- helpers for the gradient savers' arithmetic (docs/dp_savers.md) ----------------------------------------


def link_payload(variant: str) -> int:
    """Bytes per rank of one Llama-3 8B gradient exchange (`python -m measure.grad_compression --links`):
    'fp32', 'bf16', 'PowerSGD r4', 'PowerSGD r1' or '1-bit Adam'."""
    from measure.grad_compression import payloads

    return payloads()[variant]


def link_bandwidth(link: str) -> float:
    """Bytes per second of one of that table's links ('NVLink', 'InfiniBand', 'cross-region')."""
    from measure.grad_compression import LINKS

    return next(bw for name, bw in LINKS.items() if name.startswith(link))


@cache
def param_shapes(name: str) -> list[tuple[int, ...]]:
    """The shape of every parameter tensor of a model ('debug', 'llama3-8b'), built on the meta device."""
    import torch

    from models.llama import Transformer

    with torch.device("meta"):
        return [tuple(p.shape) for p in Transformer(model(name)).parameters()]


def powersgd_ratio(name: str, rank: int) -> float:
    """Ψ over the elements PowerSGD of this rank all-reduces for a model's gradients (`measure/grad_compression.py:
    powersgd_elements`, torch's rule: a matrix is compressed only where that saves 2x)."""
    from measure.grad_compression import powersgd_elements

    return psi(name) / powersgd_elements(param_shapes(name), rank)


def fsdp_split_ratio(name: str, n: int) -> float:
    """The largest FSDP rank's share of a model over n ranks against Ψ/n: FSDP2 cuts dim 0 like `torch.chunk`, so
    the first ranks hold ceil(dim0/n) rows (`python -m measure.fsdp_memory`'s ratio column)."""
    return sum(math.ceil(s[0] / n) * math.prod(s[1:]) for s in param_shapes(name)) / (psi(name) / n)


# ---- a helper for docs/tensor_parallel.md's exercises -------------------------------------------------------


def tp_activation_share(tp: int, sequence_parallel: bool, regather: bool = False) -> float:
    """A block's saved bytes on one TP rank over one process's, at `python -m measure.activation_memory`'s size
    (`measure/activation_memory.py: formula_bytes`, which that bench measures to the byte)."""
    from measure.activation_memory import BATCH, BENCH_ARGS, SEQ, formula_bytes

    one = formula_bytes(BENCH_ARGS, BATCH, SEQ)
    return formula_bytes(BENCH_ARGS, BATCH, SEQ, tp, sequence_parallel, regather=regather) / one


# ---- helpers for docs/data.md, context_parallel.md and README ------------------------------------------------


@cache
def default_corpus(vocab_size: int = 4096) -> dict[str, int]:
    """The default corpus as docs/data.md counts it: its files ('documents'), their 'bytes', and the 'tokens'
    `python -m data.prepare` writes with a `python -m data.train_tokenizer --vocab-size VOCAB_SIZE` BPE (each
    document's ids, then EOS). Trains the BPE and tokenizes 4.7 MB: seconds, once per session."""
    import tempfile

    from data.corpus import corpus_files
    from data.prepare import encode_chunk
    from data.tokenizers import load_tokenizer
    from data.train_tokenizer import train_bpe

    files = corpus_files("default")
    texts = [f.read_text(encoding="utf-8") for f in files]
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = load_tokenizer(str(train_bpe("default", vocab_size, folder)))
        tokens = len(encode_chunk(texts, tokenizer))
    return {"documents": len(files), "bytes": sum(f.stat().st_size for f in files), "tokens": tokens}


def reference_loss(run: str, step: int) -> float:
    """A loss of the one-process reference (docs/_includes/one_process_losses.md, regenerated by a slow test):
    run is '20 steps', '10 steps' or 'debug_moe, 10 steps'."""
    from tests.test_docs_printouts import include_losses

    return float(include_losses()[run][step])


def cp_preset_bytes(cp: int, algorithm: str, seq: int, name: str = "llama3-8b", element: int = 2) -> float:
    """Bytes one cp rank sends per layer of a preset at ``seq`` tokens, b = 1, ``element`` bytes per element:
    'allgather' and 'ring' by `measure/context_parallel.py: formula_comm` (which counts fp32), 'ulysses' by
    docs/context_parallel.md's table, 2(2h + 2g)·b·(s/cp)·(cp − 1)/cp elements (h, g: query and kv widths)."""
    from measure.context_parallel import formula_comm

    args = preset(name)
    if algorithm == "ulysses":
        widths = 2 * args.n_heads * args.head_dim + 2 * args.n_kv_heads * args.head_dim
        return 2 * widths * (seq // cp) * (cp - 1) / cp * element
    return formula_comm(args, 1, seq, cp, algorithm) * element / 4


def reading_time(name: str) -> int:
    """README's time for a chapter as `tests/test_docs_structure.py` allows it: the time README's table lists
    when it is within that test's window around the chapter's estimate, else the nearest multiple of 5 (what the
    table should say)."""
    from tests.test_docs_structure import budget, chapters, fits

    listed = {file: time for _, file, time in chapters()}[name]
    return listed if fits(listed, name) else budget(name)


def causal_attention_flops(seq: int, cp: int, name: str = "llama3-8b") -> float:
    """FLOPs of one layer's causal attention per cp rank, forward + backward: section 2 of docs/profiling.md's
    12·heads·head_dim·s per token, halved for the causal mask, over s/cp tokens."""
    args = preset(name)
    return 12 * args.n_heads * args.head_dim * seq * seq / 2 / cp


def logit_peak(tp: int, pp: int, precision: str = "bf16") -> int:
    """The planner's bytes per logit of a rank's vocabulary shard at the peak around the loss
    (`planning/memory_estimate.py: bytes_per_logit`)."""
    from planning.layout import Layout
    from planning.memory_estimate import bytes_per_logit

    return bytes_per_logit(Layout(tp=tp, pp=pp, mixed_precision=precision))[0]


NAMESPACE = {
    name: obj
    for name, obj in list(globals().items())
    if callable(obj) and not name.startswith("_") and obj.__module__ == __name__
} | {"math": math, "ceil": math.ceil, "log": math.log, "sqrt": math.sqrt, "GB": 1e9, "MB": 1e6}
NAMESPACE.pop("cache", None)


# ---- 1. the numbers ----------------------------------------------------------------------------------------


def paragraph_before(text: str, end: int) -> str:
    """The text of the paragraph (or table) that a marker at ``end`` closes, without earlier markers."""
    start = text.rfind("\n\n", 0, end)
    return CHECK.sub("", text[start + 1 : end])


def checks(text: str):
    for match in CHECK.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        yield line, match["quote"].strip(), match["expr"], paragraph_before(text, match.start())


def recompute(quote: str, expr: str) -> str | None:
    """None when ``expr`` rounds to ``quote``; else what the quote should say."""
    parsed = QUOTE.match(quote)
    if not parsed:
        return f"unreadable quote {quote!r} (a number, then %, x, × or a unit)"
    number, unit = parsed["number"].replace(",", ""), parsed["unit"].strip()
    builtins = {"abs": abs, "min": min, "max": max, "sum": sum, "round": round, "range": range}
    value = eval(expr, {"__builtins__": builtins, **NAMESPACE})
    if unit == "%":
        value *= 100
    mantissa, _, exponent = number.partition("e")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    got = f"{value:.{decimals}e}" if exponent else f"{value:.{decimals}f}"
    if got == number or float(got) == float(number):
        return None
    return f"{got}{unit if unit in ('%', 'x', '×') else ' ' + unit}"


def check_text(text: str) -> list[str]:
    problems = []
    for line, quote, expr, paragraph in checks(text):
        if quote not in paragraph:
            problems.append(f"line {line}: the marker quotes {quote!r}, which its paragraph does not say")
            continue
        wrong = recompute(quote, expr)
        if wrong:
            problems.append(f"line {line}: the prose says {quote}, {expr} gives {wrong}")
    return problems


@pytest.mark.parametrize("chapter", [*CHAPTERS, ROOT / "README.md"], ids=lambda p: p.stem)
def test_every_marked_number_is_what_the_code_computes(chapter):
    problems = check_text(chapter.read_text())
    assert not problems, f"{chapter.name}:\n" + "\n".join(problems)


def test_the_checker_fails_on_a_wrong_number_and_a_missing_quote():
    assert check_text("A ring sends 1.67x the bytes. <!-- check 1.67x: 10 / 6 -->") == []
    assert check_text("The bubble is 20.0% here. <!-- check 20.0%: bubble('1F1B', 2, 4) -->") == []
    wrong = check_text("A ring sends 1.5x the bytes. <!-- check 1.5x: 10 / 6 -->")
    assert wrong and "1.7x" in wrong[0]
    assert check_text("Some text.\n\nA ring sends 1.67x. <!-- check 1.5x: 10 / 6 -->")[0].endswith("does not say")


def test_every_chapter_marks_its_numbers():
    counts = {chapter.name: len(list(checks(chapter.read_text()))) for chapter in CHAPTERS}
    print("marked numbers per chapter:", counts, "total", sum(counts.values()))
    assert all(counts.values()), {name: n for name, n in counts.items() if not n}


# ---- 2. one meaning per symbol -----------------------------------------------------------------------------

SYMBOL_MARKER = re.compile(r"<!-- symbols? (?P<symbols>.+?) -->")
# A meaning cell that gives a second meaning: "...; ..." or "(chapter N)" alternatives.
SECOND_MEANING = re.compile(r";|\(chapters? \d")


def glossary_rows() -> list[tuple[str, str, str]]:
    """(symbol, meaning cell, where) for every row of every table of docs/glossary.md headed '| symbol |'.

    ``where`` names the row's line and the section it stands in, so that a symbol defined twice can be
    reported with both places."""
    rows = []
    in_table, section = False, ""
    for number, line in enumerate((DOCS / "glossary.md").read_text().splitlines(), start=1):
        if line.startswith("## "):
            section = line[3:].strip()
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| symbol |"):
            in_table = True
            continue
        if not line.startswith("|"):
            in_table = False
            continue
        if in_table and not set(cells[0]) <= set("-: "):
            for symbol in re.split(r",\s*", cells[0]):
                rows.append((symbol, cells[1], f"glossary.md:{number} ({section})"))
    return rows


def glossary_symbols() -> dict[str, str]:
    """Symbol -> meaning, from every symbol table of the glossary; a symbol with two rows fails, naming both."""
    symbols: dict[str, str] = {}
    where: dict[str, str] = {}
    for symbol, meaning, place in glossary_rows():
        assert symbol not in symbols, f"glossary: {symbol} is defined twice, at {where[symbol]} and at {place}"
        symbols[symbol], where[symbol] = meaning, place
    return symbols


def test_every_glossary_symbol_has_one_meaning():
    glossary = (DOCS / "glossary.md").read_text()
    excused = [line for line in glossary.splitlines() if line.startswith("| symbol | uses")]
    assert not excused, f"glossary: a table of letters with two uses is not allowed: {excused}"
    doubled = {s: m for s, m in glossary_symbols().items() if SECOND_MEANING.search(m)}
    assert not doubled, f"glossary: a meaning cell lists a second meaning: {doubled}"


def test_the_symbol_check_fails_on_a_letter_defined_twice(monkeypatch):
    rows = [("n", "ranks in a group", "glossary.md:3 (Sizes)"), ("n", "local tokens", "glossary.md:9 (Other)")]
    monkeypatch.setattr(sys.modules[__name__], "glossary_rows", lambda: rows)
    with pytest.raises(AssertionError, match=r"n is defined twice, at glossary.md:3 \(Sizes\) and at glossary.md:9"):
        glossary_symbols()


def test_every_symbol_a_chapter_defines_is_in_the_glossary():
    symbols = glossary_symbols()
    missing = {}
    for chapter in CHAPTERS:
        for match in SYMBOL_MARKER.finditer(chapter.read_text()):
            for symbol in re.split(r",\s*", match["symbols"]):
                if symbol not in symbols:
                    missing.setdefault(chapter.name, []).append(symbol)
    assert not missing, missing
    for symbol in ("w", "η", "σ", "MAMF", "M", "Ψ_u", "cf", "S", "q", "t_F", "t_I", "t_W"):
        assert symbol in symbols, f"glossary: no row for {symbol}"


# ---- 3. no unmarked number in a core ---------------------------------------------------------------------


def test_every_number_in_a_core_is_marked_or_listed_as_still_to_fix():
    from docs.unmarked import all_findings, allowed, unexplained

    new, gone = unexplained(all_findings(), allowed())
    assert not new, "numbers no marker regenerates (mark, reword or remove them):\n" + "\n".join(map(str, new))
    assert not gone, "docs/unmarked_allowed.txt lists findings that are fixed; delete these lines:\n" + "\n".join(gone)


def test_the_lint_finds_a_bare_number_and_spares_what_a_test_regenerates():
    from docs.unmarked import findings

    text = (
        "# 1. Title\n\nThe ring sends 1.67x the bytes, 3,200 of them, in 0.4 s on 4 ranks (torch 2.13, section 6.1).\n\n"
        "It sends 1.67x. <!-- check 1.67x: 10 / 6 --> Also `2.5 GB` and [x](a1.2.md).\n\n"
        "<!-- bench: python -m measure.x | not rerun: a table -->\n| a | 7.5 GB |\n\n```\n9.9 GB\n```\n\n"
        "## Appendix: proof\n\nHere 4.4 GB is not core.\n\n## Appendix: exercises\n\nAnswer: 12%.\n"
    )
    assert [(f.line, f.number) for f in findings("x.md", text)] == [
        (3, "1.67x"),
        (3, "3,200"),
        (3, "0.4 s"),
        (20, "12%"),
    ]


def test_a_check_covers_its_quote_as_a_whole_number_only():
    # A check of "0.5" once blanked the "0.5" inside "0.5554", so that number escaped the lint.
    from docs.unmarked import findings

    text = "Keeps 0.5554 not 0.5, 14 GB, 4e-3 and 3.5h. <!-- check 0.5: 1 / 2 --> <!-- check 4: 2 * 2 -->\n"
    assert [f.number for f in findings("x.md", text)] == ["0.5554", "14 GB", "4e-3", "3.5"]
    covered = "Keeps 0.5554 and 3.5h, 853,120 parameters. <!-- check 0.5554: 1 --> <!-- check 3.5: 1 -->"
    assert findings("x.md", covered + " <!-- check 853,120: 1 -->\n") == []


def test_the_lint_reads_versions_after_their_words_durations_and_all_of_readme():
    from docs.unmarked import findings

    text = (
        "k and v 33.6 MB, the kv 2.5 GB, v2.1, torch 2.13: 25m20s, 3 minutes.\n\n## Appendix: detail\n\nAbout 4.4 GB.\n"
    )
    found = ["33.6 MB", "2.5 GB", "25m20s", "3 minutes"]
    assert [f.number for f in findings("x.md", text)] == found
    assert [f.number for f in findings("README.md", text, whole=True)] == [*found, "4.4 GB"]


# ---- the idealized pipeline pictures: their titles state the chapter's formula ------------------------------

TITLE = re.compile(
    r"(?P<schedule>\w+): pp=(?P<pp>\d+), \d stage\(s\)/rank, m=(?P<m>\d+), idealized: idle (?P<idle>[\d.]+)% \(formula (?P<formula>[\d.]+)%"
)


@pytest.mark.parametrize("picture", sorted((DOCS / "img").glob("*_ideal.svg")), ids=lambda p: p.stem)
def test_idealized_picture_titles_agree_with_the_bubble_formula(picture):
    # docs/pipeline_parallel.md, section 3: every step starts from an empty pipeline, so ZB-V and DualPipeV idle
    # (p-1)/(3vm+p-1) like interleaved zero bubble; a title that says "formula 0.0%" beside 5.9% contradicts it.
    title = TITLE.search(picture.read_text())
    assert title, f"{picture.name}: no title of the form 'X: pp=.., m=.., idealized: idle ..% (formula ..%'"
    schedule, pp, m = title["schedule"], int(title["pp"]), int(title["m"])
    assert float(title["idle"]) == pytest.approx(round(100 * idle(schedule, pp, m), 1)), picture.name
    assert float(title["formula"]) == pytest.approx(round(100 * bubble(schedule, pp, m), 1)), picture.name
    assert title["formula"] == title["idle"], (
        f"{picture.name}: the picture idles {title['idle']}%, its formula says {title['formula']}%"
    )
