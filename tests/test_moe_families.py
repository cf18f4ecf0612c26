"""Real MoE families in and out: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V3 folders that transformers
wrote (``save_pretrained`` of a tiny random model, nothing downloaded) give transformers' logits and greedy
text, train on ep and tp layouts like one process, and export back to a folder transformers reads.

transformers 5 keeps an MoE layer's experts as fused 3-D tensors in the module but writes one matrix per expert
to the file (``...experts.E.gate_proj.weight``; Mixtral: ``block_sparse_moe.experts.E.w1.weight``): meshloom
reads and writes the file's names (checkpoint/hf.py). GPT-OSS is refused, naming each missing piece.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,  # the byte tokenizer's, so the default data trains it
    max_position_embeddings=256,
    initializer_range=0.1,
)
# family -> (config class, model class, the family's own fields)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32, norm_topk_prob=True),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=80,
            norm_topk_prob=False,
            mlp_only_layers=[1],  # a dense layer between two MoE ones
        ),
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=2,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=12,
        ),
    ),
}


def make_folder(path: Path, family: str, **extra) -> Path:
    """save_pretrained's folder of a tiny random ``family`` model (DeepSeek-V3: a random correction bias too,
    so that the selection-only bias is exercised); ``extra``: more config fields."""
    import transformers

    config_class, model_class, fields = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**SHAPE, **fields, **extra})
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn(buffer.shape))
    model.save_pretrained(str(path))
    return path


def theirs(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_folders")
    return {family: make_folder(root / family, family) for family in FAMILIES}


def tokens(n: int = 2, length: int = 100) -> torch.Tensor:
    return torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(0))


def max_diff(ours, folder: Path) -> tuple[float, float]:
    x = tokens()
    with torch.no_grad():
        a, b = ours(x), theirs(folder)(x).logits
    return (a - b).abs().max().item(), b.abs().max().item()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_moe_folder_gives_transformers_logits(folders, family):
    from generate import load_export

    ours, _ = load_export(folders[family])
    assert ours.args.family == family and ours.args.moe is not None
    # the planners' count from the shapes (ModelArgs.layer_params) is the model's
    assert ours.args.num_params() == sum(p.numel() for p in ours.parameters())
    diff, scale = max_diff(ours, folders[family])
    # fp32 both; the same routing decisions, summed in another order (grouped experts vs transformers' loop over
    # experts; SDPA vs eager): round-off, a few ulp of the largest logit. A wrong router rule or a swapped
    # expert matrix moves them by 1e-2 or more.
    assert diff <= 1e-5 * scale, (family, diff, scale)


# YaRN over an original context of 32 tokens, 4x: the 100-token input reaches past it, so the ramp, the
# interpolated pairs and the attention factor all matter; DeepSeek-V3's with mscale / mscale_all_dim (its
# softmax scale grows by mscale^2), as its released config.json has them.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
YARN_CASES = {
    "qwen3_moe": YARN,
    "deepseek_v3": {**YARN, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707},
}


@pytest.mark.parametrize("family", list(YARN_CASES))
def test_yarn_rope_gives_transformers_logits_and_exports_back(family, tmp_path):
    from checkpoint.hf import export_safetensors
    from generate import load_export

    folder = make_folder(tmp_path / "in", family, rope_parameters=dict(YARN_CASES[family]))
    ours, _ = load_export(folder)
    assert ours.args.rope_scaling.kind == "yarn"
    diff, scale = max_diff(ours, folder)
    assert diff <= 1e-5 * scale, (diff, scale)  # as for the families' default RoPE above
    unscaled, _ = load_export(make_folder(tmp_path / "plain", family))  # the same weights, plain RoPE
    assert max_diff(unscaled, folder)[0] > 1e3 * 1e-5 * scale  # the check sees YaRN left out
    export_safetensors(ours.state_dict(), ours.args, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"]
    assert {k: v for k, v in written.items() if k in YARN_CASES[family]} == YARN_CASES[family]
    diff, scale = max_diff(ours, tmp_path / "out")
    assert diff <= 1e-5 * scale, (diff, scale)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_equals_transformers(folders, family):
    from generate import generate_tokens, load_export

    prompt = list(b"def main(")
    ours, _ = load_export(folders[family])
    mine = list(generate_tokens(ours, prompt, 30))
    hf = theirs(folders[family]).generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)
    assert mine == hf[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_reloads_in_transformers(folders, family, tmp_path):
    from checkpoint.hf import export_safetensors
    from generate import load_export

    ours, _ = load_export(folders[family])
    export_safetensors(ours.state_dict(), ours.args, tmp_path)
    read = json.loads((folders[family] / "config.json").read_text())
    written = json.loads((tmp_path / "config.json").read_text())
    from checkpoint.hf_folder import model_fields

    assert model_fields(written) == model_fields(read)  # every field the import reads, written back
    with safe_names(folders[family]) as original, safe_names(tmp_path) as exported:
        assert exported == original  # the same tensor names and shapes as save_pretrained's
    diff, scale = max_diff(ours, tmp_path)
    assert diff <= 1e-5 * scale, (family, diff, scale)


class safe_names:
    """name -> shape of a folder's one model.safetensors."""

    def __init__(self, folder: Path):
        self.folder = folder

    def __enter__(self):
        from safetensors import safe_open

        with safe_open(str(self.folder / "model.safetensors"), framework="pt") as f:
            return {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}

    def __exit__(self, *exc):
        return False


def test_gpt_oss_is_refused_naming_each_missing_piece(tmp_path):
    import transformers

    from checkpoint.hf_folder import GPT_OSS_MISSING, checked_fields
    from runtime.config import ConfigError

    config = transformers.GptOssConfig(
        **{**SHAPE, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": 64}
    )
    transformers.GptOssForCausalLM(config).save_pretrained(str(tmp_path))
    with pytest.raises(ConfigError) as err:
        checked_fields(tmp_path, "checkpoint.init_from")
    message = str(err.value)
    for piece in ("attention sinks", "sliding-window", "biases", "clamped SwiGLU", "MXFP4"):
        assert piece in message
    assert "sliding_window 64" in message and "sliding_window 128" not in message  # the folder's, not GPT-OSS-20B's
    assert len(GPT_OSS_MISSING) == 5  # its YaRN RoPE is supported (test_yarn_rope_...)


@pytest.mark.parametrize(
    "family, change, expected",
    [
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
        ("olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0"),
        ("deepseek_v3", {"n_group": 3}, "n_group=3"),
        ("deepseek_v3", {"num_key_value_heads": 2}, "num_key_value_heads=2"),
        (
            "deepseek_v3",
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}},
            "'longrope'",
        ),
        ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ("deepseek_v3", {"quantization_config": {"quant_method": "fp8"}}, "quant_method 'fp8'"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ],
)
def test_unsupported_values_are_refused_by_name(folders, family, change, expected):
    from checkpoint.hf_folder import unsupported

    config = {**json.loads((folders[family] / "config.json").read_text()), **change}
    problems = unsupported(config)
    assert any(expected in p and "supported" in p for p in problems), problems


# ---- training on ep and tp layouts -------------------------------------------------------------------------

# What a run trains from a folder: no [model] section; the folder's config.json is the model.
RUN_TOML = """
[training]
steps = 3
seed = 1234
global_batch = 4
seq_len = 64
lr = 3e-3
warmup_steps = 0
"""
EP2 = {"parallel.dp_shard": 2, "parallel.ep": 2}
TP2 = {"parallel.dp_shard": 1, "parallel.tp": 2}


def train_family(folder: Path, world: int, layout: dict, run_dir: Path) -> list[dict]:
    from launch.local_runs import train_on

    config = run_dir.parent / f"{run_dir.name}.toml"
    config.write_text(RUN_TOML)
    return train_on(world, {"checkpoint.init_from": str(folder), **layout}, run_dir, config=str(config), timeout=300)


def first_loss(folder: Path) -> float:
    """transformers' loss on the batch of meshloom's first step (global batch 4 x 64 tokens + 1)."""
    import torch.nn.functional as F

    from data.corpus import load_corpus

    data = load_corpus("default", 16 * 1024 * 1024).long()
    batch = torch.stack([data[j * 64 :][:65] for j in range(4)])
    with torch.no_grad():
        logits = theirs(folder)(batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_trains_with_ep2_and_tp2_like_one_process(folders, family, tmp_path):
    from tests.training_runs import assert_same_curve

    one = train_family(folders[family], 1, {}, tmp_path / "one")
    # the first step's loss is transformers' loss on the same batch (fp32; sums in another order)
    assert abs(one[0]["loss"] - first_loss(folders[family])) <= 1e-5 * one[0]["loss"]
    for name, world, layout in (("ep2", 2, {**EP2, "checkpoint.interval": 3}), ("tp2", 2, TP2)):
        run = train_family(folders[family], world, layout, tmp_path / name)
        # fp32 throughout; the same tokens meet the same experts (the load is equal), only the order of sums
        # differs (the all-to-all regrouping, FSDP's reduce-scatter, tp's all-reduces): the default 1e-5
        assert_same_curve(run, one)
        assert [r["expert_load"] for r in run] == [r["expert_load"] for r in one], name
    # the ep 2 run's checkpoint (experts sharded over ep) exports as the family's folder; transformers reads it
    from checkpoint.export import main as export_main
    from generate import load_checkpoint

    out = tmp_path / "export"
    assert export_main(["--checkpoint", str(tmp_path / "ep2" / "checkpoints"), "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == family
    trained, _, _ = load_checkpoint(tmp_path / "ep2" / "checkpoints", None)
    diff, scale = max_diff(trained, out)
    assert diff <= 1e-5 * scale, (diff, scale)  # as for the folder itself


def test_meshlooms_own_moe_exports_as_mixtral_or_says_why(tmp_path):
    """The card's MoE (configs/debug_moe.toml) is softmax top-2 with a shared expert: no transformers class
    computes an ungated shared expert with softmax routing, so the export says so. Without the shared expert
    it is Mixtral's layout and routing, and exports as Mixtral with equal logits."""
    from checkpoint.hf import export_safetensors
    from launch.local_runs import ROOT
    from models.llama import Transformer
    from runtime.config import load_config, model_args

    cfg = load_config(path=str(ROOT / "configs" / "debug_moe.toml"), overrides={"model.n_layers": 2})
    args = model_args(cfg)
    model = Transformer(args).init_weights(seed=3)
    with pytest.raises(ValueError, match="moe_shared_experts=1: every mixtral layer is MoE without a shared expert"):
        export_safetensors(model.state_dict(), args, tmp_path / "refused")
    cfg.model.moe_shared_experts = 0
    args = model_args(cfg)
    model = Transformer(args).init_weights(seed=3)
    export_safetensors(model.state_dict(), args, tmp_path / "mixtral")
    assert json.loads((tmp_path / "mixtral" / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    diff, scale = max_diff(model, tmp_path / "mixtral")
    assert diff <= 1e-5 * scale, (diff, scale)


@pytest.mark.parametrize("algorithm", ["allgather", "ring"])
def test_latent_attention_trains_with_cp2_like_one_process(folders, algorithm, tmp_path):
    """DeepSeek-V3 with context parallelism: the latent attention's value heads (12 wide) are padded to the
    key's width (24) for the cross-rank kernels, which move k and v as one tensor; the curve is one process's."""
    from tests.training_runs import assert_same_curve

    one = train_family(folders["deepseek_v3"], 1, {}, tmp_path / "one")
    layout = {"parallel.dp_shard": 1, "parallel.cp": 2, "parallel.cp_attention": algorithm}
    # fp32; cp's attention merges the two ranks' partial softmaxes in another order: the default 1e-5
    assert_same_curve(train_family(folders["deepseek_v3"], 2, layout, tmp_path / "cp2"), one)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_trains_with_pp2_and_fsdp_tp_ep_like_one_process(folders, family, tmp_path):
    """pp 2 (Qwen2-MoE's dense middle layer and DeepSeek-V3's dense first layer on a stage of their own kind),
    and dp_shard 2 x tp 2 x ep 4 (the router and shared expert FSDP-sharded over dp_shard x tp)."""
    from tests.training_runs import assert_same_curve

    one = train_family(folders[family], 1, {}, tmp_path / "one")
    layouts = {
        "pp2": (2, {"parallel.dp_shard": 1, "parallel.pp": 2, "parallel.pp_microbatches": 2}),
        "dp2tp2ep4": (4, {"parallel.dp_shard": 2, "parallel.tp": 2, "parallel.ep": 4}),
    }
    for name, (world, layout) in layouts.items():
        # fp32; only the order of sums differs: the default 1e-5
        assert_same_curve(train_family(folders[family], world, layout, tmp_path / name), one)


def test_router_aux_loss_coefficient_comes_from_the_config(folders):
    """transformers adds its auxiliary loss only with output_router_logits: then, and only then, the import
    turns the aux loss on with the folder's coefficient (in transformers' form, tests/test_default_finetune.py)."""
    from checkpoint.hf_folder import model_fields

    config = json.loads((folders["mixtral"] / "config.json").read_text())
    assert model_fields(config)["moe_aux_loss_coef"] == 0.0
    config.update(output_router_logits=True, router_aux_loss_coef=0.02)
    assert model_fields(config)["moe_aux_loss_coef"] == 0.02


def test_deepseek_bias_update_trains_with_ep2_like_one_process(folders, tmp_path):
    """DeepSeek-V3's correction bias is meshloom's expert bias: with model.moe_bias_update_rate it moves from the
    global load after each step, the same on ep 2 as on one process (the load, hence every update, identical)."""
    from tests.training_runs import assert_same_curve

    knob = {"model.moe_bias_update_rate": 0.01}
    one = train_family(folders["deepseek_v3"], 1, knob, tmp_path / "one")
    run = train_family(folders["deepseek_v3"], 2, {**knob, **EP2}, tmp_path / "ep2")
    assert_same_curve(run, one)  # fp32, only sums reordered: the default 1e-5
    assert [r["expert_load"] for r in run] == [r["expert_load"] for r in one]
    plain = train_family(folders["deepseek_v3"], 1, {}, tmp_path / "plain")
    assert [r["expert_load"] for r in plain] != [r["expert_load"] for r in one]  # the bias did move the routing
