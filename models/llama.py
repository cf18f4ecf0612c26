"""A Llama-style decoder in single-device PyTorch (no torch.distributed here, ever).

Token embedding -> n_layers x [RMSNorm -> grouped-query attention with rotary embeddings -> residual,
RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> output head.

Three choices make the model easy to parallelize without changing it:

1. Layers live in an ``nn.ModuleDict`` keyed by layer index ("0", "1", ...). A pipeline stage deletes the
   layers it does not own, and every parameter keeps its original name (``layers.5.attention.wq.weight``),
   so checkpoints and initial weights do not depend on the pipeline split.
2. Attention reshapes with ``-1`` heads, so after tensor parallelism has split wq/wk/wv by columns the
   same code runs on the local heads (n_heads/tp and n_kv_heads/tp).
3. The model is built on the meta device, then materialised: ``init_weights()`` on one device, or
   mesh/materialize.materialize_weights once it is sharded. Either way each parameter's initial value
   is a function of (seed, parameter name) only (``initial_value``), never of the layout or of the order
   in which parameters are created, so every parallel layout starts from the same weights.

For generation (generate.py, one device) ``forward`` also takes a ``KVCache``: the tokens given are the
positions after the cached ones, so a prompt is run once and then one new token per call.
"""

from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from models.feed_forward import FeedForward
from models.latent_attention import LatentAttention, latent_attention_params
from models.moe import AddAuxLoss, MoE, MoEArgs, batch_aux_loss
from models.rope import RopeScaling, attention_factor, scaled_frequencies


@dataclass
class ModelArgs:
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 256
    ffn_dim: int = 0  # 0: derived from dim by Llama's 8/3 rule
    multiple_of: int = 64
    ffn_dim_multiplier: float = 1.0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)  # models/rope.py: none, linear, llama3, yarn
    max_seq_len: int = 2048
    moe: MoEArgs | None = None  # None: a dense model
    moe_every: int = 1  # with moe: layers i where (i + 1) % moe_every == 0 are MoE, the others dense
    tie_embeddings: bool = False  # one weight for the embedding and the output head (see ``stored_name``)
    pad_token_id: int = -1  # the padding id a transformers folder declares (-1: none); written back on export
    # True (with a pad id): the embedding lookup gives that row no gradient, as transformers' nn.Embedding(padding_idx)
    # does (model.freeze_pad_embedding); False: every row trains. Only the gradient: the row's value is the checkpoint's.
    freeze_pad_embedding: bool = False
    # The Llama-family variants transformers folders bring (checkpoint/hf_folder.py maps each config field):
    family: str = "llama"  # llama, mistral, qwen2, qwen3: what an export writes as model_type / architectures
    qkv_bias: bool = False  # Qwen2/2.5: wq, wk, wv have biases (wo has none)
    qk_norm: bool = False  # Qwen3: an RMSNorm over each query and key head (head_dim wide), before RoPE
    explicit_head_dim: int = 0  # 0: dim // n_heads (Llama); Qwen3 and some Mistrals give their own
    sliding_window: int = 0  # 0: none. Else a window that must not bind: longer sequences are refused
    # The MoE families (checkpoint/hf_folder.py):
    qk_norm_full: bool = False  # OLMoE: the q/k norm spans the whole projection (all heads), not one head
    dense_layers: tuple[int, ...] = ()  # layers that stay dense in an MoE model (DeepSeek-V3's first k, Qwen's)
    q_lora_rank: int = 0  # latent attention (models/latent_attention.py): the query's low rank; 0: full
    kv_lora_rank: int = 0  # > 0: multi-head latent attention (DeepSeek-V3) instead of grouped-query attention
    qk_rope_head_dim: int = 0  # latent attention: the rotated part of a q/k head (head_dim is the rest)
    v_head_dim: int = 0  # latent attention: a value head's width
    rope_interleave: bool = False  # latent attention: the rotated pairs are (x0, x1), (x2, x3), ... (DeepSeek)

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe is not None and (layer_id + 1) % self.moe_every == 0 and layer_id not in self.dense_layers

    @property
    def latent(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """How many channels of a q/k head RoPE rotates: the whole head, or latent attention's rope part."""
        return self.qk_rope_head_dim if self.latent else self.head_dim

    @property
    def cache_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, width) of the cached keys and of the cached values (latent attention: expanded per head)."""
        if self.latent:
            return (self.n_heads, self.head_dim + self.qk_rope_head_dim), (self.n_heads, self.v_head_dim)
        return (self.n_kv_heads, self.head_dim), (self.n_kv_heads, self.head_dim)

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """The SwiGLU hidden size: Llama's 2/3 * 4 * dim, scaled, rounded up to multiple_of."""
        if self.ffn_dim:
            return self.ffn_dim
        hidden = int(self.ffn_dim_multiplier * int(2 * 4 * self.dim / 3))
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def layer_params(self, layer_id: int) -> int:
        """Parameters of block ``layer_id``: attention, its FFN (dense, or every expert and the router), 2 norms."""
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = self.dim * q_dim * 2 + self.dim * kv_dim * 2
        attn += (q_dim + 2 * kv_dim) if self.qkv_bias else 0
        attn += (q_dim + kv_dim if self.qk_norm_full else 2 * self.head_dim) if self.qk_norm else 0
        if self.latent:
            attn = latent_attention_params(self)
        dense_mlp = 3 * self.dim * self.hidden_dim
        mlp = dense_mlp
        if self.is_moe_layer(layer_id):
            m = self.moe
            mlp = m.n_experts * 3 * self.dim * m.hidden_dim + self.dim * m.n_experts
            mlp += 3 * self.dim * (m.shared_hidden_dim or self.hidden_dim) if m.n_shared_experts else 0
            mlp += self.dim if m.n_shared_experts and m.shared_gate else 0
        return attn + mlp + 2 * self.dim

    def stored_name(self, name: str) -> str:
        """The name under which parameter ``name`` is initialised, saved and imported: a tied head (a last stage's
        ``output.weight`` copy) is ``tok_embeddings.weight``."""
        return EMBEDDING if self.tie_embeddings and name == HEAD else name

    def num_params(self) -> int:
        """Parameter count from the shapes (for planning tables without building the model); a tied head counts once."""
        vocab = (1 if self.tie_embeddings else 2) * self.vocab_size * self.dim
        return vocab + self.dim + sum(self.layer_params(i) for i in range(self.n_layers))


EMBEDDING, HEAD = "tok_embeddings.weight", "output.weight"


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm saving only the input (own dtype) and the fp32 rsqrt per token, like Megatron's fused one: 4 bytes per
    element less in bf16 than composed ops (docs/tensor_parallel.md, section 6); the forward is bit for bit theirs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).type_as(x) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd  # recomputed: one multiply, instead of keeping it
        grad_weight = (grad * normed.type_as(x)).sum(dim=tuple(range(grad.dim() - 1))).to(weight.dtype)
        g = (grad * weight).float()
        # d/dx of x * rstd(x): rstd * (g - normed * mean(g * normed)) over the last dimension
        grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        return grad_x.type_as(x), grad_weight, None


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 for stability; saves its input and the fp32
    rsqrt only (``_RMSNormFunction``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)


def rotary_tables(
    head_dim: int, max_seq_len: int, theta: float, device=None, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, ...]:
    """cos and sin tables of shape (max_seq_len, head_dim) for the half-rotation form of RoPE; the
    frequencies are rescaled once here (models/rope.py), so every user of the tables sees the same angles."""
    inv_freq = scaled_frequencies(head_dim, theta, scaling, device)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    gain = attention_factor(scaling)  # YaRN's: cos and sin scaled (1 otherwise, and then not multiplied)
    if gain != 1.0:
        return angles.cos() * gain, angles.sin() * gain
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x_i, x_{i+d/2}) pair by its position's angle. x: (batch, seq, heads, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    # (seq, d): one table row per position, shared by the batch; (batch, seq, d): each token its own (documents)
    cos, sin = (cos[None, :, None, :], sin[None, :, None, :]) if cos.dim() == 2 else (cos[:, :, None], sin[:, :, None])
    return (x.float() * cos + rotated.float() * sin).type_as(x)


def check_window(args: ModelArgs, seq_len: int) -> None:
    """Refuse a sliding window that would bind (a sequence longer than it): meshloom computes full causal attention."""
    if args.sliding_window and seq_len > args.sliding_window:
        raise ValueError(
            f"a sequence of {seq_len} tokens is longer than the model's sliding window of {args.sliding_window}: "
            "meshloom computes full attention, which equals windowed attention only up to the window; use "
            f"sequences of at most {args.sliding_window} tokens"
        )


class KVCache:
    """Keys and values of the positions seen so far, per layer, for incremental decoding on one device."""

    def __init__(self, args: ModelArgs, batch: int, max_len: int, device=None, dtype=torch.float32):
        check_window(args, max_len)
        key_shape, value_shape = args.cache_shapes
        self.keys = {
            str(i): torch.zeros(batch, max_len, *key_shape, device=device, dtype=dtype) for i in range(args.n_layers)
        }
        self.values = {
            str(i): torch.zeros(batch, max_len, *value_shape, device=device, dtype=dtype) for i in range(args.n_layers)
        }
        self.max_len = max_len
        self.length = 0

    def layer(self, key: str) -> LayerCache:
        return LayerCache(self.keys[key], self.values[key], self.length)


class LayerCache:
    """One layer's view of a KVCache during one forward: its buffers and where the new positions start."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, start: int):
        self.keys, self.values, self.start = keys, values, start

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (batch, seq, kv_heads, head_dim) at start.. and return every cached position's k, v."""
        end = self.start + k.shape[1]
        if end > self.keys.shape[1]:
            raise ValueError(f"KV cache holds {self.keys.shape[1]} positions; position {end - 1} does not fit")
        self.keys[:, self.start : end] = k
        self.values[:, self.start : end] = v
        return self.keys[:, :end], self.values[:, :end]


def sdpa_reads_grouped_kv(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether SDPA with ``enable_gqa=True`` runs a fused kernel on grouped k/v: CPU flash always; CUDA only flash
    (``cuda_flash_eligible``, no mask). Otherwise SDPA silently falls back to the math kernel, so repeat k/v."""
    if q.device.type == "cpu":
        return True
    return mask is None and cuda_flash_eligible(q)


@functools.cache
def _capability_at_least_ampere(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


def cuda_flash_eligible(q: torch.Tensor) -> bool:
    """Whether CUDA's flash kernel takes queries like ``q``: bf16/fp16, head_dim % 8 == 0 up to 256, sm80+. The one
    statement of the rule (SDPA's grouped k/v, context parallelism's LSE kernels)."""
    head_dim = q.shape[-1]
    return (
        q.device.type == "cuda"
        and q.dtype in (torch.bfloat16, torch.float16)
        and head_dim % 8 == 0
        and head_dim <= 256
        and _capability_at_least_ampere(q.device.index or 0)
    )


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """(batch, 1, s, s) bool: query i sees key j when j <= i and both lie in the same document. ``documents``:
    (batch, s) document index of each position (non-decreasing along the sequence)."""
    s = documents.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=documents.device).tril()
    return (causal & (documents[:, :, None] == documents[:, None, :]))[:, None]


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """The document index of each token from its position in its document (a new document where it is 0)."""
    return (positions == 0).cumsum(dim=1)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q kᵀ / sqrt(d), causal) v on one device; the queries are the *last* seq of the kv_seq positions.
    ``Attention.attend`` points here (context parallelism swaps in a cross-rank version). ``documents``: a query also
    sees only its document's keys, through a block-diagonal causal mask (not the flash kernel)."""
    n_rep = q.shape[2] // k.shape[2]
    # Fewer queries than keys: the causal mask aligned at the bottom right, built explicitly. (torch's
    # causal_lower_right would spare building it on CUDA, but it is a tensor subclass that cannot be created
    # under a TorchDispatchMode, which selective activation checkpointing is.)
    mask = None
    if documents is not None:
        mask = document_mask(documents)
    elif q.shape[1] != k.shape[1]:
        mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril(k.shape[1] - q.shape[1])
    # SDPA reads each k/v head for its n_rep query heads when its fused kernel can (no n_rep copies of k and v
    # made, or saved for backward); otherwise repeat them here, since the kernel SDPA would fall back to is
    # slower than the copies.
    gqa = n_rep > 1 and sdpa_reads_grouped_kv(q, mask)
    if n_rep > 1 and not gqa:
        k, v = k.repeat_interleave(n_rep, dim=2), v.repeat_interleave(n_rep, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None,
        enable_gqa=gqa,
    )
    return out.transpose(1, 2)


class Attention(nn.Module):
    """Causal grouped-query attention; ``qkv_bias`` (Qwen2) and ``qk_norm`` (Qwen3, per head before RoPE) are opt-in."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        # Registered only when used, so a Llama's parameter names (and checkpoints) are unchanged.
        if args.qk_norm:  # OLMoE (qk_norm_full): one norm over the whole projection, all heads together
            q_width, k_width = (args.n_heads * self.head_dim, args.n_kv_heads * self.head_dim)
            self.q_norm = RMSNorm(q_width if args.qk_norm_full else self.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(k_width if args.qk_norm_full else self.head_dim, args.norm_eps)
        self.qk_norm, self.qk_norm_full = args.qk_norm, args.qk_norm_full
        self.attend = causal_attention  # the seam context parallelism replaces (not a module: no parameters)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        start = 0 if cache is None else cache.start
        # seqlen of the full sequence, even if the caller holds a shard; offset by the cached positions. (Under
        # context parallelism the tables hold this rank's positions, in order: mesh/context_parallel.py.) With
        # documents the tables are already per token (batch, seq, d): Transformer.forward.
        if cos.dim() == 2:
            cos, sin = cos[start : start + seqlen], sin[start : start + seqlen]
        # -1 heads: under tensor parallelism these are the local heads of this rank.
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.qk_norm_full:  # OLMoE: over the whole projection, before it is cut into heads
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(bsz, seqlen, -1, self.head_dim)
        k = k.view(bsz, seqlen, -1, self.head_dim)
        v = v.view(bsz, seqlen, -1, self.head_dim)
        if self.qk_norm and not self.qk_norm_full:  # per head: under TP each rank normalises its own heads
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is None:
            out = self.attend(q, k, v) if documents is None else self.attend(q, k, v, documents=documents)
        else:
            k, v = cache.update(k, v)
            out = causal_attention(q, k, v)  # the new queries are the last positions of the cached keys
        return self.wo(out.reshape(bsz, seqlen, -1))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        if args.latent:  # DeepSeek-V3: its own projections, this file's norm, RoPE and attention kernel
            self.attention = LatentAttention(args, RMSNorm, apply_rotary, causal_attention)
        else:
            self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if args.is_moe_layer(layer_id):
            self.feed_forward = MoE(args.dim, args.moe, shared_hidden_dim=args.hidden_dim)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        # The cache is passed only when there is one: parallel styles (PrepareModuleInput) count the inputs;
        # documents always (None without document masks), as the fourth.
        extra = () if cache is None else (cache,)
        h = x + self.attention(self.attention_norm(x), cos, sin, documents, *extra)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The decoder. Pipeline stages set tok_embeddings / norm / output to None where they do not own them."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        if (
            args.freeze_pad_embedding and args.pad_token_id >= 0
        ):  # set after construction: nn.Embedding(padding_idx=) would zero the row's value
            self.tok_embeddings.padding_idx = args.pad_token_id
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        # Rotary tables are derived state: not saved in checkpoints, rebuilt by reset_buffers().
        cos, sin = rotary_tables(args.rope_dim, args.max_seq_len, args.rope_theta, scaling=args.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # Context parallelism (mesh/context_parallel.py) keeps only this rank's rows of the tables above and
        # records which positions those are, and the whole tables here, for the per-token rows of documents.
        self.cp_positions: torch.Tensor | None = None
        self.rope_full: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(
        self, tokens: torch.Tensor, cache: KVCache | None = None, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens (batch, seq) int64 -> logits (batch, seq, vocab); a later pipeline stage takes hidden states.
        ``cache``: continue the cached positions. ``documents`` (batch, whole window): each token's position in its
        document, for RoPE and for attending within the document only."""
        check_window(self.args, tokens.shape[1] if cache is None else cache.length + tokens.shape[1])
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin, doc_ids = self.rope_cos, self.rope_sin, None
        if documents is not None:
            full_cos, full_sin = self.rope_full or (self.rope_cos, self.rope_sin)
            local = documents if self.cp_positions is None else documents[:, self.cp_positions.to(documents.device)]
            cos, sin, doc_ids = full_cos[local], full_sin[local], document_ids(documents)
        for key, layer in self.layers.items():
            if cache is None:
                # documents only when there are some, so that a wrapper around a block that knows only
                # (h, cos, sin) (tests/test_from_scratch.py's ZeRO-3 sketch) still runs without document masks
                h = layer(h, cos, sin) if doc_ids is None else layer(h, cos, sin, doc_ids)
            else:
                h = layer(h, cos, sin, None, cache.layer(key))
        if cache is not None:
            cache.length += tokens.shape[1]
        aux = batch_aux_loss(self.moes) if self.moes else None  # model.moe_aux_loss_form transformers
        if aux is not None:
            h = AddAuxLoss.apply(h, aux)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    @property
    def moes(self) -> list[MoE]:
        """The MoE blocks whose loss the decoder adds after its last layer (aux_loss_form transformers), else []."""
        moe = self.args.moe
        if moe is None or moe.aux_loss_form != "transformers" or moe.aux_loss_coef <= 0 or not self.training:
            return []
        return [m for m in self.modules() if isinstance(m, MoE)]

    def tie_weights(self) -> None:
        """With ``tie_embeddings``, make the head's weight the embedding's Parameter: at construction and again after
        anything that replaces Parameters (``to_empty``, TP's ``distribute_module``)."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    # ---- initialisation -------------------------------------------------------------------------------
    def initial_value(self, name: str, shape: torch.Size, seed: int) -> torch.Tensor:
        """The full initial value of parameter ``name``: a function of (seed, name) alone, so every layout starts equal.
        A tied weight takes the head's N(0, dim^-0.5) from the name ``tok_embeddings.weight`` (``stored_name``)."""
        name = self.args.stored_name(name)
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        if name.endswith(".bias"):  # qkv_bias: start at zero, as transformers' _init_weights does
            return torch.zeros(shape)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if name == EMBEDDING:
            std = self.args.dim**-0.5 if self.args.tie_embeddings else 1.0
        elif name == HEAD:
            std = self.args.dim**-0.5
        elif name.endswith(("wo.weight", "w2.weight", "experts.w2")):
            std = 0.02 / math.sqrt(2 * self.args.n_layers)
        else:
            std = 0.02
        return torch.randn(shape, generator=gen) * std

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        cos, sin = rotary_tables(
            self.args.rope_dim, self.args.max_seq_len, self.args.rope_theta, device, self.args.rope_scaling
        )
        self.rope_cos, self.rope_sin = cos, sin
        for module in self.modules():
            if isinstance(module, MoE):
                module.reset_buffers(device)

    @torch.no_grad()
    def init_weights(self, seed: int, device: torch.device | str = "cpu") -> Transformer:
        """Materialise a meta-device model on ``device`` (single device) and set the initial values."""
        self.to_empty(device=device)
        self.tie_weights()
        for name, param in self.named_parameters():
            param.copy_(self.initial_value(name, param.shape, seed))
        self.reset_buffers(device)
        return self
