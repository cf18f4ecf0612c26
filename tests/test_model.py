import torch
import torch.nn.functional as F

from models.flops import layer_matmul_params
from models.llama import ModelArgs, Transformer
from models.presets import PRESETS


def matmul_params_per_token(args: ModelArgs) -> int:
    """Weights of the matmuls one token goes through: every block's, and the output head."""
    return args.dim * args.vocab_size + sum(layer_matmul_params(args, i) for i in range(args.n_layers))


def tiny(**kw) -> ModelArgs:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32)
    return ModelArgs(**{**base, **kw})


def build(args: ModelArgs, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    return model.init_weights(seed)


def test_initial_weights_depend_only_on_seed_and_name():
    a, b = build(tiny()), build(tiny())
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    # A pipeline stage holding only layer 1 gets the same layer-1 weights as the full model.
    deeper = build(tiny())
    del deeper.layers["0"]
    assert torch.equal(deeper.layers["1"].attention.wq.weight, a.layers["1"].attention.wq.weight)
    assert not torch.equal(build(tiny(), seed=1).output.weight, a.output.weight)


def test_parameter_names_keep_layer_indices():
    names = [n for n, _ in build(tiny()).named_parameters()]
    assert "layers.1.attention.wq.weight" in names and "layers.0.feed_forward.w2.weight" in names


def test_forward_shape_and_causality():
    model = build(tiny())
    tokens = torch.randint(0, 256, (2, 12))
    logits = model(tokens)
    assert logits.shape == (2, 12, 256)
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 256
    assert torch.allclose(model(changed)[:, :8], logits[:, :8], atol=1e-6)
    assert not torch.allclose(model(changed)[:, 8:], logits[:, 8:])


def test_initial_loss_is_near_uniform():
    model = build(tiny())
    tokens = torch.randint(0, 256, (4, 32))
    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 1.0


def test_grouped_query_attention_shares_kv_heads():
    args = tiny()
    model = build(args)
    assert model.layers["0"].attention.wk.weight.shape == (args.n_kv_heads * args.head_dim, args.dim)


def test_presets_have_llama3_sizes():
    # Published sizes: Llama 3.2 1B ~1.24B, Llama 3 8B ~8.03B, Llama 3 70B ~70.6B, Llama 3.1 405B ~405.9B
    # parameters (untied heads here, so the 1B preset counts its output head separately: +0.26B); Mixtral 8x7B
    # 46.7B in all, 12.9B active per token (two of eight experts, the embedding included).
    counts = {name: args.num_params() / 1e9 for name, args in PRESETS.items()}
    assert abs(counts["llama3-8b"] - 8.03) < 0.01
    assert abs(counts["llama3-70b"] - 70.55) < 0.05
    assert abs(counts["llama3-1b"] - 1.50) < 0.01
    assert abs(counts["llama3-405b"] - 405.85) < 0.01 and PRESETS["llama3-405b"].hidden_dim == 53248
    assert abs(counts["mixtral-8x7b"] - 46.70) < 0.01
    mixtral = PRESETS["mixtral-8x7b"]
    active = matmul_params_per_token(mixtral) + mixtral.vocab_size * mixtral.dim  # + the embedding's lookup
    assert abs(active / 1e9 - 12.88) < 0.01


def test_num_params_matches_the_built_model():
    args = tiny()
    assert args.num_params() == sum(p.numel() for p in build(args).parameters())
