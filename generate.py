"""Sample text from a trained model, streaming it to the console.

    python -m generate --checkpoint runs/debug/checkpoints --prompt "def main(" --max-new-tokens 200
    python -m generate --checkpoint runs/debug/checkpoints --step 20 --prompt "import " --temperature 0
    python -m generate --checkpoint runs/debug/hf --prompt "class " --top-k 20 --seed 7

1. **Load, on one process.** ``--checkpoint`` is a DCP checkpoint written by any layout (a step-N folder,
   or a checkpoint folder whose newest complete step is taken, or ``--step N`` of it): DCP stitches every
   full tensor from the shards without a process group (checkpoint/export.py). Or it is a folder written by
   ``python -m checkpoint.export`` or by transformers' ``save_pretrained`` (config.json in either RoPE
   dialect, one model.safetensors or shards with their index, tokenizer files when there are some;
   checkpoint/hf_folder.py refuses what meshloom does not compute).
2. **Tokenizer.** The one the run was trained with: bytes, or the tokenizer.json whose path and SHA-256 the
   checkpoint recorded (``--tokenizer`` when it has moved), or the one beside an exported model.
3. **Prefill, then decode with a KV cache** (models/llama.KVCache): the prompt runs once, then each new
   token is one forward of one position that attends to the cached keys and values.
4. **Pick each token:** temperature 0 takes the most likely token (greedy, deterministic); otherwise the
   logits are divided by the temperature, cut to the ``--top-k`` most likely (0: no cut) and sampled with a
   generator seeded by ``--seed``, so a run is reproducible. Generation stops after ``--max-new-tokens``,
   at the tokenizer's EOS, or at ``model.max_seq_len``.
5. **Stream.** The text is decoded as tokens arrive; a character whose bytes are still incomplete waits
   for the next token.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from data.chat import chat_prompt
from models.llama import KVCache, Transformer
from runtime.config import ConfigError
from runtime.options import count_option, float_option, int_option, path_option, text_option


def is_export(path: Path) -> bool:
    from checkpoint.hf_folder import is_model_folder

    return is_model_folder(path)


def load_export(path: Path, tokenizer_override: str = ""):
    """Step 1-2 for an exported or transformers folder: (model, tokenizer)."""
    from checkpoint.hf import import_safetensors, model_args_from_hf_config, safetensors_problems
    from checkpoint.hf_folder import read_config
    from data.tokenizers import load_tokenizer

    args = model_args_from_hf_config(read_config(path), f"--checkpoint {path}")  # range-checked as train does
    problems = safetensors_problems(path, args)
    if problems:
        raise ConfigError(f"--checkpoint {path}: the weights do not fit its config.json: {'; '.join(problems)}.")
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty replaced the Parameters: a tied head is the embedding's again
    model.reset_buffers("cpu")
    import_safetensors([model], path)  # one file or shards; a tied head reads the embedding
    spec = tokenizer_override or (str(path) if (path / "tokenizer.json").is_file() else "bytes")
    return model, load_tokenizer(spec, field="--tokenizer")


def load_checkpoint(path: Path, step: int | None, tokenizer_override: str = ""):
    """Step 1-2 for a DCP checkpoint: (model, tokenizer, the step folder)."""
    from checkpoint.export import checkpoint_tokenizer, choose_checkpoint, load_model_state

    if step is not None:
        path = path / f"step-{step}"
        if not path.is_dir():
            raise ConfigError(f"--step {step}: there is no {path}; list the folder for the saved steps.")
    step_dir = choose_checkpoint(path)
    tokenizer = checkpoint_tokenizer(step_dir, tokenizer_override)
    state, args = load_model_state(step_dir)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty replaced the Parameters: a tied head is the embedding's again
    model.reset_buffers("cpu")
    model.load_state_dict(state)  # the RoPE tables are not state: reset_buffers rebuilt them
    return model, tokenizer, step_dir


# the smallest temperature the logits are divided by: fp32 logits of ~1e4 over 1e-6 stay far below fp32's 3e38
MIN_TEMPERATURE = 1e-6


def next_token(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """Step 4 for one position's logits (vocab,)."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def check_prompt(prompt: list[int], max_seq_len: int) -> None:
    """A prompt must have at least one token and leave room for one more within ``max_seq_len``."""
    if not prompt:
        raise ConfigError("--prompt is empty; give at least one character (it is tokenized to at least one token).")
    if len(prompt) >= max_seq_len:
        raise ConfigError(
            f"the prompt has {len(prompt)} tokens, no fewer than model.max_seq_len={max_seq_len}; shorten it."
        )


@torch.no_grad()
def generate_tokens(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 1234,
    eos_id: int | None = None,
) -> Iterator[int]:
    """The new token ids after ``prompt``, one at a time (steps 3-4 of the module docstring)."""
    check_prompt(prompt, model.args.max_seq_len)
    max_new_tokens = min(max_new_tokens, model.args.max_seq_len - len(prompt))
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    cache = KVCache(model.args, 1, len(prompt) + max_new_tokens, device=device, dtype=next(model.parameters()).dtype)
    logits = model(torch.tensor([prompt], device=device), cache)[0, -1]
    for i in range(max_new_tokens):
        token = next_token(logits, temperature, top_k, generator)
        yield token
        if token == eos_id or i == max_new_tokens - 1:
            return
        logits = model(torch.tensor([[token]], device=device), cache)[0, -1]


def stream_text(tokenizer, tokens: Iterator[int], out=sys.stdout) -> list[int]:
    """Step 5: print the decoded text as it grows; returns the ids."""
    ids, shown = [], 0
    for token in tokens:
        if token == tokenizer.eos_id:
            break
        ids.append(token)
        text = tokenizer.decode(ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its remaining bytes
            continue
        out.write(text[shown:])
        out.flush()
        shown = len(text)
    out.write(tokenizer.decode(ids)[shown:] + "\n")
    out.flush()
    return ids


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py): a bad value is refused with exit 2."""
    parser = argparse.ArgumentParser(prog="python -m generate", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--checkpoint",
        required=True,
        type=path_option(),
        help="a DCP checkpoint (folder or step-N) or an exported folder",
    )
    parser.add_argument(
        "--step", type=int_option(ge=0), default=None, help="which step-N of a checkpoint folder (default: newest)"
    )
    parser.add_argument("--prompt", required=True, type=text_option())
    parser.add_argument("--max-new-tokens", type=count_option(), default=200)
    parser.add_argument("--temperature", type=float_option(ge=0), default=0.8, help="0: greedy")
    parser.add_argument(
        "--top-k", type=int_option(ge=0), default=50, help="sample among the k most likely tokens (0: all)"
    )
    parser.add_argument("--seed", type=int_option(ge=0), default=1234)
    parser.add_argument(
        "--tokenizer",
        default="",
        type=path_option(required=False),
        help="the run's tokenizer.json, if it moved since training",
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument(
        "--chat", action="store_true", help="send --prompt as a user turn through the tokenizer folder's chat template"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    try:
        if opts.max_new_tokens < 1 or opts.temperature < 0 or opts.top_k < 0:
            raise ConfigError("--max-new-tokens must be >= 1, --temperature >= 0 and --top-k >= 0.")
        if 0 < opts.temperature < MIN_TEMPERATURE:
            raise ConfigError(
                f"--temperature {opts.temperature:g} is too small to divide the logits by (they overflow to inf, and "
                f"the probabilities to NaN); give 0 (greedy, which is what it approaches) or a value >= "
                f"{MIN_TEMPERATURE:g}."
            )
        if opts.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                "--device cuda, but no CUDA device is visible (torch.cuda.is_available() is False); use --device "
                "auto or cpu, or install a CUDA build of torch on a machine with a GPU."
            )
        path = Path(opts.checkpoint).expanduser()
        if opts.step is None and is_export(path):
            model, tokenizer = load_export(path, opts.tokenizer)
            source = str(path)
        elif path.is_dir():
            model, tokenizer, step_dir = load_checkpoint(path, opts.step, opts.tokenizer)
            source = str(step_dir)
        else:
            raise ConfigError(f"--checkpoint {opts.checkpoint}: no such folder; give a checkpoint or an export folder.")
        if model.args.vocab_size < tokenizer.vocab_size:
            raise ConfigError(
                f"the model's vocabulary ({model.args.vocab_size}) is smaller than the tokenizer's "
                f"({tokenizer.vocab_size}); pass the --tokenizer the model was trained with."
            )
        device = torch.device(
            "cuda" if opts.device == "cuda" or (opts.device == "auto" and torch.cuda.is_available()) else "cpu"
        )
        model = model.to(device).eval()
        text = chat_prompt(tokenizer, opts.prompt) if opts.chat else opts.prompt
        prompt = tokenizer.encode(text)
        check_prompt(prompt, model.args.max_seq_len)  # refused before anything is echoed
        print(
            f"[{source} | {model.args.num_params():,} parameters | tokenizer {tokenizer.name} | "
            f"temperature {opts.temperature} top-k {opts.top_k} seed {opts.seed}]",
            file=sys.stderr,
            flush=True,
        )
        start = time.perf_counter()
        sys.stdout.write(text)
        ids = stream_text(
            tokenizer,
            generate_tokens(
                model,
                prompt,
                opts.max_new_tokens,
                temperature=opts.temperature,
                top_k=opts.top_k,
                seed=opts.seed,
                eos_id=tokenizer.eos_id,
            ),
        )
    except (ConfigError, ValueError) as exc:
        print(f"meshloom generate: error: {exc}", file=sys.stderr, flush=True)
        return 2
    seconds = time.perf_counter() - start
    print(f"[{len(ids)} tokens in {seconds:.2f} s, {len(ids) / seconds:,.1f} tokens/s]", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
