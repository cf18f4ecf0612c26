"""Generation: the KV cache computes what a full forward computes, sampling is reproducible, and greedy
decoding equals transformers' LlamaForCausalLM.generate on the exported weights (no download).

The model here has random initial weights (models/llama.initial_value): its greedy continuation is varied,
so token equality is a real check. tests/test_real_data.py repeats it on a trained checkpoint.
"""

from __future__ import annotations

import os

import pytest
import torch

from checkpoint.hf import export_safetensors
from generate import generate_tokens, load_export, next_token
from models.llama import KVCache, ModelArgs, Transformer

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=96)
PROMPT = list(b"def main():\n    ")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # from_pretrained reads a local folder here: never the network


def random_model(seed: int = 3) -> Transformer:
    with torch.device("meta"):
        model = Transformer(ARGS)
    return model.init_weights(seed).eval()


def test_kv_cache_gives_the_logits_of_a_full_forward():
    model = random_model()
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(ARGS, batch=2, max_len=40)
        # a prompt, then a few positions at once, then one at a time
        pieces = [model(tokens[:, :17], cache), model(tokens[:, 17:20], cache)]
        pieces += [model(tokens[:, i : i + 1], cache) for i in range(20, 40)]
    cached = torch.cat(pieces, dim=1)
    assert cache.length == 40
    # The same fp32 math in another association order (attention over a longer key buffer): ~1e-6.
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)


def test_the_cache_refuses_positions_beyond_its_size():
    model = random_model()
    cache = KVCache(ARGS, batch=1, max_len=4)
    with pytest.raises(ValueError, match="KV cache holds 4 positions"):
        model(torch.zeros(1, 5, dtype=torch.long), cache)


def greedy_without_cache(model: Transformer, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def test_greedy_decoding_with_the_cache_equals_recomputing_everything():
    model = random_model()
    tokens = list(generate_tokens(model, PROMPT, 40, temperature=0.0))
    assert tokens == greedy_without_cache(model, PROMPT, 40)
    assert len(set(tokens)) >= 5, "a degenerate continuation would make the comparison weak"


def test_sampling_is_reproducible_from_the_seed_and_respects_top_k():
    model = random_model()
    a = list(generate_tokens(model, PROMPT, 30, temperature=1.0, top_k=10, seed=7))
    b = list(generate_tokens(model, PROMPT, 30, temperature=1.0, top_k=10, seed=7))
    c = list(generate_tokens(model, PROMPT, 30, temperature=1.0, top_k=10, seed=8))
    assert a == b and a != c
    logits = torch.arange(256.0)
    picks = {next_token(logits, 5.0, 3, torch.Generator().manual_seed(s)) for s in range(50)}
    assert picks == {253, 254, 255}, "top-k 3 samples only the three most likely tokens"


def test_generation_stops_at_eos_and_at_max_seq_len():
    model = random_model()
    first = next(generate_tokens(model, PROMPT, 5, temperature=0.0))
    assert list(generate_tokens(model, PROMPT, 5, temperature=0.0, eos_id=first)) == [first]
    assert len(list(generate_tokens(model, PROMPT, 500, temperature=0.0))) == ARGS.max_seq_len - len(PROMPT)


def test_greedy_generation_equals_transformers_generate(tmp_path):
    import transformers  # the dev extras install it: a missing one fails here instead of skipping

    model = random_model()
    export_safetensors(model.state_dict(), ARGS, tmp_path)
    ours_loaded, tokenizer = load_export(tmp_path)
    assert tokenizer.name == "bytes"
    ours = list(generate_tokens(ours_loaded.eval(), PROMPT, 48, temperature=0.0))
    theirs_model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    out = theirs_model.generate(torch.tensor([PROMPT]), max_new_tokens=48, do_sample=False)
    assert ours == out[0, len(PROMPT) :].tolist()
    assert len(set(ours)) >= 5


def test_an_over_long_prompt_is_refused_before_anything_is_echoed(tmp_path, capsys):
    import generate

    export_safetensors(random_model().state_dict(), ARGS, tmp_path)
    code = generate.main(["--checkpoint", str(tmp_path), "--prompt", "x" * ARGS.max_seq_len])
    out = capsys.readouterr()
    assert code == 2 and out.out == "", "nothing of the prompt is echoed"
    assert f"the prompt has {ARGS.max_seq_len} tokens, no fewer than model.max_seq_len={ARGS.max_seq_len}" in out.err
    assert "parameters |" not in out.err, "refused before the banner too"
