"""A folder that transformers wrote is a model: same logits, same greedy text, on every layout; and back out.

Every folder is made here by ``LlamaForCausalLM(config).save_pretrained(dir)`` from a tiny random config
(nothing is downloaded), in both config.json dialects, with llama3 and linear RoPE scaling, grouped-query
attention, and shards with an index. The weights are drawn with a large ``initializer_range`` (0.3) so that
attention is sharp and the RoPE angles change the logits visibly (with transformers' 0.02, attention is
almost uniform and a wrong frequency moves the logits by less than the tolerance would notice; the test
``test_the_check_sees_a_wrong_rope`` makes sure it would fail).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from launch.local_runs import ROOT, train_on

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # well inside the 128-token sequences, so the scaling matters
}
LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
PLAIN = {"rope_type": "default", "rope_theta": 500000.0}
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention: 2 query heads per key/value head
    vocab_size=256,  # the byte tokenizer's, so the default data trains it
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.3,
)
# (rope, legacy dialect, max_shard_size for save_pretrained or None: one file, num_key_value_heads, tied)
CASES = {
    "current_plain_gqa": (PLAIN, False, None, 2, False),
    "legacy_llama3_sharded": (LLAMA3, True, "40KB", 2, False),
    "current_linear_mha_tied": (LINEAR, False, None, 4, True),
    "current_llama3_sharded_tied": (LLAMA3, False, "40KB", 1, True),
}
# What a run trains from a folder: no [model] section; the folder's config.json is the model.
RUN_TOML = """
[training]
steps = 1
seed = 1234
global_batch = 8
seq_len = 128
lr = 3e-3
warmup_steps = 0
"""


def to_legacy(config: dict) -> dict:
    """config.json as transformers 4.x wrote it: top-level rope_theta, rope_scaling {"type": ...} or null."""
    config = dict(config)
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    config["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    return config


def make_folder(
    path: Path, rope: dict, legacy: bool = False, shard: str | None = None, kv: int = 2, tied: bool = False
) -> Path:
    """save_pretrained's folder; tied: transformers leaves lm_head.weight out of the file."""
    import transformers

    torch.manual_seed(0)
    shape = {**SHAPE, "num_key_value_heads": kv, "tie_word_embeddings": tied}
    config = transformers.LlamaConfig(**shape, rope_parameters=dict(rope))
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(str(path), **({"max_shard_size": shard} if shard else {}))
    if legacy:
        file = path / "config.json"
        file.write_text(json.dumps(to_legacy(json.loads(file.read_text())), indent=2))
    return path


def theirs(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_folders")
    return {name: make_folder(root / name, *case) for name, case in CASES.items()}


def tokens(n: int = 2, length: int = 200) -> torch.Tensor:
    return torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(0))


# ---- one process -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_a_transformers_folder_gives_transformers_logits(folders, case):
    from generate import load_export

    folder = folders[case]
    if CASES[case][2]:
        assert (folder / "model.safetensors.index.json").is_file() and not (folder / "model.safetensors").exists()
    ours, _ = load_export(folder)
    if CASES[case][4]:
        names = (
            json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"] if CASES[case][2] else {}
        )
        assert "lm_head.weight" not in names  # transformers did leave it out: the head reads the embedding
        assert ours.output.weight is ours.tok_embeddings.weight
    x = tokens()
    with torch.no_grad():
        a, b = ours(x), theirs(folder)(x).logits
    # The same fp32 operations in the same order, but the frequencies come from two codes (ours computes
    # the llama3 blend in another order): ~1 ulp in an angle, times positions up to 200 (measured: 0.0).
    # A missing scaling or a wrong theta moves them by 1e-2 or more (test_the_check_sees_a_wrong_rope).
    assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()


def test_the_check_sees_a_wrong_rope(folders):
    from generate import load_export
    from models.llama import rotary_tables

    ours, _ = load_export(folders["legacy_llama3_sharded"])
    x = tokens()
    with torch.no_grad():
        b = theirs(folders["legacy_llama3_sharded"])(x).logits
        ours.rope_cos, ours.rope_sin = rotary_tables(ours.args.head_dim, ours.args.max_seq_len, 500000.0)
        unscaled = ours(x)
    assert (unscaled - b).abs().max().item() > 1e3 * 1e-5 * b.abs().max().item()


def test_rope_frequencies_equal_transformers(tmp_path):
    """models/rope.py against transformers' own functions, over parameters that put every band in use."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from checkpoint.hf import model_args_from_hf_config

    for rope in (
        LINEAR,
        LLAMA3,
        {**LLAMA3, "original_max_position_embeddings": 8192, "factor": 32.0, "high_freq_factor": 8.0},
    ):
        config = transformers.LlamaConfig(**SHAPE, rope_parameters=dict(rope))
        expected, attention_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
        args = model_args_from_hf_config(config.to_dict())
        from models.rope import scaled_frequencies

        ours = scaled_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
        assert attention_factor == 1.0  # what lets meshloom leave the attention scale alone
        torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
        assert not torch.equal(ours, scaled_frequencies(args.head_dim, args.rope_theta))


def test_greedy_generation_equals_transformers(folders):
    from data.tokenizers import load_tokenizer
    from generate import generate_tokens, load_export

    folder = folders["legacy_llama3_sharded"]
    prompt = list(b"def main(")
    ours, _ = load_export(folder)
    mine = list(generate_tokens(ours, prompt, 60))
    hf = theirs(folder).generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False)
    their_tokens = hf[0, len(prompt) :].tolist()
    # Greedy decoding is exact token equality: argmax of logits that agree to ~1e-6 (above), and positions
    # past the original 32-token context, where the llama3 scaling decides the angles.
    assert mine == their_tokens
    # The command itself (its KV cache, its stream): the same text.
    cmd = [sys.executable, "-m", "generate", "--checkpoint", str(folder), "--prompt", "def main("]
    proc = subprocess.run(
        [*cmd, "--temperature", "0", "--max-new-tokens", "60"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "def main(" + load_tokenizer("bytes").decode(their_tokens) + "\n"


# ---- every layout ------------------------------------------------------------------------------------------


def step_one_loss(folder: Path) -> float:
    """transformers' loss on the batch of meshloom's first step (global batch 8 x 128 tokens + 1)."""
    from data.corpus import load_corpus

    data = load_corpus("default", 16 * 1024 * 1024).long()
    batch = torch.stack([data[j * 128 :][:129] for j in range(8)])
    with torch.no_grad():
        logits = theirs(folder)(batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


def test_every_layout_starts_from_transformers_loss_and_exports_back(folders, tmp_path):
    """fsdp2 x tp2 (4 ranks, a sharded legacy llama3 folder) and pp2 (a tied linear one: the head on the last
    stage, the embedding on the first): the first step's loss (every token's logits through the cross
    entropy) is transformers'. Each run's checkpoint then exports (shards for the first) and loads in
    transformers with meshloom's logits; the tied one is tied there."""
    from checkpoint.export import main as export_main
    from checkpoint.hf_folder import rope_parameters
    from generate import load_checkpoint

    config = tmp_path / "run.toml"
    config.write_text(RUN_TOML)
    runs = {
        "legacy_llama3_sharded": (4, {"parallel.dp_shard": 2, "parallel.tp": 2, "checkpoint.interval": 1}),
        "current_linear_mha_tied": (2, {"parallel.pp": 2, "parallel.pp_microbatches": 2, "checkpoint.interval": 1}),
    }
    for case, (world, layout) in runs.items():
        init = {"checkpoint.init_from": str(folders[case]), "training.steps": 1, **layout}
        [record] = train_on(world, init, tmp_path / case, config=str(config))
        expected = step_one_loss(folders[case])
        # Sharded sums in another order: ~1e-7 relative per sum (tests/training_runs.py: LOSS_RTOL). The RoPE
        # scaling left out (unscaled tables) moves this loss by 2.3e-3 (llama3) and 3.3e-2 (linear), measured.
        assert abs(record["loss"] - expected) <= 1e-5 * expected, (case, record["loss"], expected)

    for case, shard in (("legacy_llama3_sharded", "40KB"), ("current_linear_mha_tied", "5GB")):
        out, checkpoints = tmp_path / f"export_{case}", tmp_path / case / "checkpoints"
        assert export_main(["--checkpoint", str(checkpoints), "--out", str(out), "--max-shard-size", shard]) == 0
        written = json.loads((out / "config.json").read_text())
        assert json.loads((out / "generation_config.json").read_text())["bos_token_id"] is None
        ours, _, _ = load_checkpoint(checkpoints, None)
        hf = theirs(out)
        x = tokens()
        with torch.no_grad():
            a, b = ours(x), hf(x).logits
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()  # as in the one-process test above
        if case == "legacy_llama3_sharded":
            index = json.loads((out / "model.safetensors.index.json").read_text())
            assert len(set(index["weight_map"].values())) > 1 and not (out / "model.safetensors").exists()
            # the source's legacy dialect is kept (checkpoint/export.py, step 6): the same RoPE, as it was written
            assert "rope_parameters" not in written and rope_parameters(written) == LLAMA3
            assert written["tie_word_embeddings"] is False
        else:  # one file under 5GB; written tied, loaded tied, the head saved once (as the embedding)
            assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
            assert written["rope_parameters"] == LINEAR and written["tie_word_embeddings"] is True
            assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, layout",
    [
        ("current_llama3_sharded_tied", {"parallel.dp_shard": 2}),  # fsdp2: the tied weight sharded once
        ("current_linear_mha_tied", {"parallel.dp_shard": 1, "parallel.tp": 2}),  # tp2: one Shard(0) DTensor
        ("current_plain_gqa", {"parallel.dp_shard": 1, "parallel.tp": 2}),  # tp2 splits the kv heads 2 -> 1 + 1
    ],
    ids=["fsdp2-llama3-tied", "tp2-linear-tied", "tp2-plain-gqa"],
)
def test_fsdp_and_tp_alone_start_from_transformers_loss(folders, tmp_path, case, layout):
    """fsdp2 and tp2 each on their own (the default test runs them together as fsdp2 x tp2): the first step's
    loss from each folder is transformers' (tolerance as in the test above)."""
    config = tmp_path / "run.toml"
    config.write_text(RUN_TOML)
    init = {"checkpoint.init_from": str(folders[case]), "training.steps": 1, **layout}
    [record] = train_on(2, init, tmp_path / "run", config=str(config))
    expected = step_one_loss(folders[case])
    assert abs(record["loss"] - expected) <= 1e-5 * expected, (record["loss"], expected)


def test_export_shards_like_save_pretrained(folders, tmp_path):
    """The same tensors and max size give the files save_pretrained gives: same names, same tensors in each."""
    from checkpoint.hf import export_safetensors, parse_size
    from generate import load_export

    assert (parse_size("5GB"), parse_size("500MB"), parse_size("2GiB")) == (5 * 10**9, 5 * 10**8, 2 * 2**30)
    for bad in ("5 parsecs", "-1GB", "0"):
        with pytest.raises(ValueError, match="--max-shard-size"):
            parse_size(bad)
    folder = folders["legacy_llama3_sharded"]  # save_pretrained(max_shard_size="40KB")
    ours, _ = load_export(folder)
    written = export_safetensors(ours.state_dict(), ours.args, tmp_path, max_shard_bytes=parse_size("40KB"))
    assert sorted(p.name for p in written if p.suffix == ".safetensors") == sorted(
        p.name for p in folder.glob("*.safetensors")
    )
    index = "model.safetensors.index.json"
    theirs_map = json.loads((folder / index).read_text())["weight_map"]
    assert json.loads((tmp_path / index).read_text())["weight_map"] == theirs_map
