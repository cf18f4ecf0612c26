"""Peak memory of ``data.prepare``: one 200 MB line against 200 MB of ordinary lines, JSONL, and one conversation.

    .venv/bin/python -m measure.prepare_memory                         # 200 MB files
    .venv/bin/python -m measure.prepare_memory --mb 2,8                # two sizes: what grows with the file
    .venv/bin/python -m measure.prepare_memory --mb 10 --chat-only     # one 10 MB conversation (--format chat)

1. Train a 4,096-token byte-level BPE (data/train_tokenizer.py) on 20 files of the default corpus.
2. Write three files of ``--mb`` MB from the default corpus (the standard library's sources, repeated):
   ``lines.txt`` as it is (ordinary lines of code), ``one-line.txt`` with every newline replaced by a space,
   and ``documents.jsonl``, one document per source file. A text file is one document whatever its lines,
   so the first two are one 200 MB document each: before pieces (data/pieces.py) they cost about 27 bytes per
   byte of text; the JSONL file is the ordinary case, many documents tokenized by chunks. A fourth file,
   ``conversation.jsonl``, holds one conversation of ``--mb`` MB (a question, a long reply) for ``--format
   chat`` with ChatML's template and turn markers: rendered whole, tokenized in pieces (data/chat.py). Its
   imports include transformers and the template's tokenizer, loaded before the measurement starts.
3. For each file, a fresh process runs ``data.prepare.prepare`` with ``workers=1``, so that all the work
   happens in that one process and its peak resident memory (VmHWM of /proc/self/status) is the whole
   cost. It reports that peak, its resident memory after the imports, and the seconds taken.
4. One row per file and size (``--mb`` takes several sizes): the peak, what preparing added to the imports'
   memory, and that per byte of text; then the one-line file's added memory over the ordinary lines' one, and
   the seconds each file took (apart from the memory: they vary with the machine's load).

All figures come from one run of this script; compare the rows, not absolute numbers across machines.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runtime.options import float_option, list_option, path_option


def status_kib() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def write_sources(folder: Path, size: int) -> dict[str, Path]:
    """Step 2: the three files, each ``size`` bytes, written a source file at a time."""
    from data.corpus import corpus_files

    sources = [f.read_text() for f in corpus_files("default")]
    files = {name: folder / name for name in ("one-line.txt", "lines.txt", "documents.jsonl")}
    handles = {name: open(path, "w", encoding="utf-8") for name, path in files.items()}  # noqa: SIM115
    written = dict.fromkeys(files, 0)
    try:
        while min(written.values()) < size:
            for text in sources:
                for name, f in handles.items():
                    if written[name] >= size:
                        continue
                    if name == "lines.txt":
                        out = text
                    elif name == "one-line.txt":
                        out = text.replace("\n", " ")
                    else:
                        out = json.dumps({"text": text}) + "\n"
                    f.write(out)
                    written[name] += len(out.encode("utf-8"))
    finally:
        for f in handles.values():
            f.close()
    return files


CHAT_TEMPLATE = (  # ChatML, as SmolLM2's and Qwen's folders have it: special tokens around each turn
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chat_folder(tokenizer: Path) -> Path:
    """Step 1 for chat: the BPE with ChatML's special tokens and template, as a model's tokenizer folder."""
    from tokenizers import AddedToken, Tokenizer

    from data.train_tokenizer import EOS

    tok = Tokenizer.from_file(str(tokenizer))
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    folder = tokenizer.parent.parent / "chat-tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def write_conversation(folder: Path, size: int) -> Path:
    """Step 2 for chat: one conversation of about ``size`` bytes, a short question and a long reply (the
    default corpus's text), on one JSONL line."""
    from data.corpus import corpus_files

    reply, files = [], iter(corpus_files("default") * 1000)
    while sum(map(len, reply)) < size:
        reply.append(next(files).read_text())
    messages = [{"role": "user", "content": "Show me some code."}, {"role": "assistant", "content": "".join(reply)}]
    path = folder / "conversation.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    return path


def child(source: str, tokenizer: str, out: str) -> dict:
    """Step 3, in a fresh process (a ``.jsonl`` source in a folder named chat: ``--format chat``)."""
    from data.prepare import prepare, prepare_chat

    if Path(source).name == "conversation.jsonl":  # what prepare_chat imports, counted with the imports
        import transformers  # noqa: F401

        from data.chat import template_tokenizer

        template_tokenizer(Path(tokenizer))
    after_imports = status_kib()["VmRSS"]
    start = time.perf_counter()
    if Path(source).name == "conversation.jsonl":
        header = prepare_chat(source, tokenizer, out, seq_len=2048)
    else:
        header = prepare(source, tokenizer, out, workers=1, quiet=True)
    return {
        "seconds": time.perf_counter() - start,
        "imports_kib": after_imports,
        "peak_kib": status_kib()["VmHWM"],
        "tokens": header["num_tokens"],
    }


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py; tests/test_input_walk.py walks them)."""
    parser = argparse.ArgumentParser(prog="python -m measure.prepare_memory", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--mb",
        type=list_option(item=float_option(gt=0, le=100_000)),
        default="200",
        help="size of each source file in MB, or comma-separated sizes: one set of files each (default 200)",
    )
    parser.add_argument("--chat-only", action="store_true", help="only the one-conversation chat file")
    parser.add_argument(
        "--child", type=path_option(), nargs=3, metavar=("SOURCE", "TOKENIZER", "OUT"), help=argparse.SUPPRESS
    )
    return parser


def main() -> None:
    parser = build_parser()
    opts = parser.parse_args()
    if opts.child:
        print(json.dumps(child(*opts.child)), flush=True)
        return
    from data.train_tokenizer import train_bpe

    sizes = [float(mb) for mb in opts.mb.split(",")]
    if len(set(sizes)) < len(sizes):
        parser.error(f"--mb {opts.mb} names a size twice; give each size once")
    rows = {}  # (MB, file name) -> the child's figures
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        tokenizer = train_bpe("default", 4096, folder / "tok", max_files=20)  # step 1
        chat_tokenizer = chat_folder(tokenizer)
        for mb in sizes:
            here = folder / f"{mb:g}MB"
            here.mkdir()
            files = {} if opts.chat_only else write_sources(here, int(mb * 1e6))
            files["conversation.jsonl"] = write_conversation(here, int(mb * 1e6))
            for name, path in files.items():
                spec = chat_tokenizer if name == "conversation.jsonl" else tokenizer
                cmd = [
                    sys.executable,
                    "-m",
                    "measure.prepare_memory",
                    "--child",
                    str(path),
                    str(spec),
                    str(here / f"out-{name}"),
                ]
                proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
                rows[mb, name] = json.loads(proc.stdout.strip().splitlines()[-1])
    print_table(rows, sizes, opts.chat_only)


def print_table(rows: dict[tuple[float, str], dict], sizes: list[float], chat_only: bool) -> None:
    """Step 4."""
    mib = 1024
    print(
        "data.prepare, one process (workers=1), the 4,096-token BPE; files of "
        + ", ".join(f"{mb:g}" for mb in sizes)
        + " MB"
    )
    print(f"{'MB':>6} {'file':>18} {'tokens':>12} {'after imports':>14} {'peak':>9} {'added':>9} {'added/byte':>11}")
    names = list(dict.fromkeys(name for _, name in rows))
    for name, mb in ((name, mb) for name in names for mb in sizes):  # one file's sizes side by side
        r = rows[mb, name]
        added = (r["peak_kib"] - r["imports_kib"]) * 1024
        print(
            f"{mb:>6g} {name:>18} {r['tokens']:>12,} {r['imports_kib'] / mib:>10.0f} MiB {r['peak_kib'] / mib:>5.0f} MiB "
            f"{added / 2**20:>5.0f} MiB {added / (mb * 1e6):>9.2f} B"
        )
    if not chat_only:
        ratios = []
        for mb in sizes:
            one, lines = (rows[mb, n]["peak_kib"] - rows[mb, n]["imports_kib"] for n in ("one-line.txt", "lines.txt"))
            ratios.append(f"{one / max(lines, 1):.2f}x at {mb:g} MB")
        print("one line vs ordinary lines, the memory added: " + ", ".join(ratios))
    for mb in sizes:  # timings apart from the memory: they vary with the machine's load
        took = ", ".join(f"{name} {r['seconds']:.1f}" for (size, name), r in rows.items() if size == mb)
        print(f"seconds at {mb:g} MB: {took}")


if __name__ == "__main__":
    main()
