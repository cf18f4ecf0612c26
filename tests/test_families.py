"""Qwen2/2.5, Qwen3 and Mistral folders written by transformers' own classes: same logits, every layout at
parity with one process, and back out (transformers loads the export and gives meshloom's logits).

Each folder is ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` / ``MistralForCausalLM`` from a tiny config,
``save_pretrained``. transformers starts biases at zero and norm weights at one, which would hide a bias
or a q/k norm that is not applied (or applied to the wrong heads): every bias and norm weight is redrawn
before saving, and the weights use ``initializer_range`` 0.3 as in tests/test_hf_folders.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from launch.local_runs import train_on
from runtime.config import ConfigError
from tests.test_hf_folders import RUN_TOML, step_one_loss, theirs, tokens
from tests.training_runs import assert_same_curve

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,  # the byte tokenizer's, so the default data trains it
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.3,
)
FAMILIES = {
    # class name, extra config: Qwen3 with a head wider than hidden_size / heads (32, not 16), as Qwen3 models
    # have; Mistral with its default 4096 window (it does not bind at 128 tokens) and a theta of its own.
    "qwen2": ("Qwen2ForCausalLM", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "mistral": ("MistralForCausalLM", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
}


def make_family_folder(path, family: str, **overrides):
    import transformers

    cls_name, extra = FAMILIES[family]
    cls = getattr(transformers, cls_name)
    torch.manual_seed(0)
    config = cls.config_class(**{**SHAPE, **extra, **overrides})
    model = cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.3)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: make_family_folder(root / family, family) for family in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_folder_gives_transformers_logits(family_folders, family):
    from generate import load_export

    folder = family_folders[family]
    ours, _ = load_export(folder)
    args = ours.args
    assert (args.family, args.qkv_bias, args.qk_norm) == (family, family == "qwen2", family == "qwen3")
    assert args.head_dim == (32 if family == "qwen3" else 16)
    assert args.sliding_window == (4096 if family == "mistral" else 0)
    x = tokens()
    with torch.no_grad():
        a, b = ours(x), theirs(folder)(x).logits
    # The same fp32 operations in nearly the same order (measured: see docs/checkpointing.md); a bias or a
    # q/k norm left out moves the logits by far more (test_the_check_sees_a_missing_bias_or_norm).
    assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()


def test_the_check_sees_a_missing_bias_or_norm(family_folders):
    from generate import load_export

    x = tokens()
    for family, module in (("qwen2", "wq"), ("qwen3", "q_norm")):
        ours, _ = load_export(family_folders[family])
        with torch.no_grad():
            b = theirs(family_folders[family])(x).logits
            layer = ours.layers["0"].attention
            if module == "wq":
                layer.wq.bias.zero_()
            else:
                layer.q_norm.weight.fill_(1.0)
            assert (ours(x) - b).abs().max().item() > 1e3 * 1e-5 * b.abs().max().item()


def test_unsupported_architectures_are_refused_naming_the_supported(tmp_path):
    from checkpoint.hf_folder import checked_fields

    cases = {
        "gemma": {"model_type": "gemma", "architectures": ["GemmaForCausalLM"]},
        "mixed": {"model_type": "llama", "architectures": ["Qwen2ForCausalLM"]},
        "qwen3_bias": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "attention_bias": True},
    }
    for name, fields in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}
        (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 128, **fields}))
        with pytest.raises(ConfigError) as err:
            checked_fields(folder, "checkpoint.init_from")
        for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            assert arch in str(err.value), (name, str(err.value))


def test_a_sliding_window_is_accepted_only_where_it_does_not_bind(tmp_path):
    """Mistral's window of 64: training at 128 tokens is refused before any process group; at 64 it is taken;
    generation past 64 positions is refused. Qwen's window counts only with use_sliding_window."""
    from checkpoint.hf_folder import folder_model
    from generate import load_export
    from runtime.config import load_config

    folder = make_family_folder(tmp_path / "mistral64", "mistral", sliding_window=64)
    for seq_len, ok in ((128, False), (64, True)):
        cfg = load_config(overrides={"checkpoint.init_from": str(folder), "training.seq_len": seq_len})
        if ok:
            model = folder_model(cfg)
            assert model.sliding_window == 64 and model.family == "mistral"
            assert cfg.model.family == "llama", "the config stays as written; the plan holds the folder's model"
        else:
            with pytest.raises(ConfigError, match="sliding window of 64"):
                folder_model(cfg)
    ours, _ = load_export(folder)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens(1, 64)), theirs(folder)(tokens(1, 64)).logits, rtol=0, atol=1e-4)
        with pytest.raises(ValueError, match="sliding window"):
            ours(tokens(1, 65))
    qwen = make_family_folder(tmp_path / "qwen2w", "qwen2", sliding_window=64, use_sliding_window=False)
    assert load_export(qwen)[0].args.sliding_window == 0


def test_every_family_trains_on_fsdp2_and_tp2_like_one_process_and_exports_back(family_folders, tmp_path):
    """Two steps from each folder on one process, fsdp 2 and tp 2 (TP shards the q/k/v biases with their
    weights, column-parallel, and runs the q/k norms replicated on each rank's heads): the same loss and gradient
    norm (tests/training_runs.py: LOSS_RTOL), the first step's loss transformers'. The sharded runs' checkpoints
    export as the family's class, which gives the one-process model's logits."""
    from checkpoint.export import main as export_main
    from generate import load_checkpoint

    config = tmp_path / "run.toml"
    config.write_text(RUN_TOML)
    layouts = {"fsdp2": (2, {"parallel.dp_shard": 2}), "tp2": (2, {"parallel.dp_shard": 1, "parallel.tp": 2})}
    for family, folder in family_folders.items():
        # lr 1e-4, not RUN_TOML's 3e-3: AdamW's first update is about lr in size whatever the gradient, so the
        # 1e-9 summation noise of a near-zero gradient element becomes a +-lr step (TORCH_CPU_FACTS: traps). At
        # 3e-3 that moved step 2's gradient norm by 1.7e-5 relative on one layout (measured); at 1e-4 it stays
        # well inside LOSS_RTOL, while a real bug (an unsharded bias, a norm gradient not summed over tp) does not.
        base = {"checkpoint.init_from": str(folder), "training.steps": 2, "training.lr": 1e-4}
        reference = train_on(1, base, tmp_path / family / "one", config=str(config))
        expected = step_one_loss(folder)
        assert abs(reference[0]["loss"] - expected) <= 1e-5 * expected, (family, reference[0]["loss"], expected)
        names = ["fsdp2", "tp2"] if family != "mistral" else ["fsdp2"]  # Mistral's attention is Llama's
        for name in names:
            world, layout = layouts[name]
            run = tmp_path / family / name
            records = train_on(world, {**base, **layout, "checkpoint.interval": 2}, run, config=str(config))
            assert_same_curve(records, reference)
        out = tmp_path / family / "export"
        assert export_main(["--checkpoint", str(run / "checkpoints"), "--out", str(out)]) == 0
        written = json.loads((out / "config.json").read_text())
        assert written["architectures"] == [FAMILIES[family][0]] and written["model_type"] == family
        ours, _, _ = load_checkpoint(run / "checkpoints", None)
        hf = theirs(out)
        assert type(hf).__name__ == FAMILIES[family][0]
        x = tokens()
        with torch.no_grad():
            a, b = ours(x), hf(x).logits
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item(), family


def tp_bias_and_norm_gradients() -> dict:
    """Rank body: a block with q/k/v biases and q/k norms on 2 tp ranks (sequence parallel on) against the same
    model on one device: placements, the forward, and every bias and norm gradient."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    from mesh.materialize import materialize_weights
    from mesh.tensor_parallel import apply_tensor_parallel, reduce_partial_gradients
    from models.llama import ModelArgs, Transformer

    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32)
    args.qkv_bias, args.qk_norm, args.explicit_head_dim = True, True, 32
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model, ref = Transformer(args), Transformer(args)
    apply_tensor_parallel(model, mesh, sequence_parallel=True)
    materialize_weights(model, torch.device("cpu"), seed=0)
    ref.init_weights(seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # biases start at 0 and norms at 1: redraw them, the same on both, so each one counts
        for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            if name.endswith(".bias") or "q_norm" in name or "k_norm" in name:
                r.copy_(torch.randn(r.shape, generator=gen) * 0.5 + (1.0 if "norm" in name else 0.0))
                p.copy_(torch.distributed.tensor.distribute_tensor(r, mesh, p.placements))
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(2))
    with loss_parallel():
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
    reduce_partial_gradients(list(model.parameters()))
    F.cross_entropy(ref(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    attn, ref_attn = model.layers["0"].attention, ref.layers["0"].attention
    out = {
        "bias_sharded": all(getattr(attn, w).bias.placements == (Shard(0),) for w in ("wq", "wk", "wv")),
        "norm_replicated": all(getattr(attn, n).weight.placements == (Replicate(),) for n in ("q_norm", "k_norm")),
        "loss": abs(
            loss.full_tensor().item() - F.cross_entropy(ref(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).item()
        ),
    }
    for name in ("wq.bias", "wk.bias", "wv.bias", "q_norm.weight", "k_norm.weight"):
        mine, theirs_ = attn.get_parameter(name).grad.full_tensor(), ref_attn.get_parameter(name).grad
        out[name] = ((mine - theirs_).abs().max() / theirs_.abs().max()).item()
    return out


def test_tp_splits_the_biases_with_their_heads_and_sums_the_norm_gradients():
    """q/k/v biases are column-parallel (Shard(0), with their weights' heads); the q/k norm weights are replicated
    and their gradients, summed over each rank's heads, are the one-device gradients."""
    from launch.spawn import run_on_ranks

    for result in run_on_ranks(tp_bias_and_norm_gradients, 2):
        assert result.pop("bias_sharded") and result.pop("norm_replicated"), result
        # fp32 sums in another order: ~1e-7 relative (tests/training_runs.py); a norm gradient not summed over
        # tp is off by about half of itself, a bias on the wrong heads by its whole size.
        assert all(v <= 1e-5 for v in result.values()), result
