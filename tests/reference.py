"""An independent single-process reference: a plain nanoGPT-style loop with none of meshloom's machinery.

No mesh, no FSDP, no GlobalBatchLoader, no train.py helpers: the model class is the only shared piece
(it is the thing being trained). If train.py on one process matches this loop, and every layout matches
train.py on one process, every layout trains the same model as this loop.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from data.corpus import load_corpus
from models.llama import ModelArgs, Transformer
from models.moe import MoE, MoEArgs


def reference_losses(cfg) -> list[dict]:
    """Train ``cfg`` (a meshloom Config) on one device with a hand-written loop; returns loss/grad_norm
    (and, for MoE, the expert load, with the aux-loss-free bias updated from it after each step)."""
    t, m = cfg.training, cfg.model
    args = ModelArgs(
        dim=m.dim,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads,
        vocab_size=m.vocab_size,
        ffn_dim=m.ffn_dim,
        multiple_of=m.multiple_of,
        norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,
        max_seq_len=m.max_seq_len,
        moe_every=m.moe_every,
        tie_embeddings=m.tie_embeddings,
    )
    if m.n_experts:
        args.moe = MoEArgs(
            n_experts=m.n_experts,
            top_k=m.top_k,
            hidden_dim=m.moe_ffn_dim or args.hidden_dim // m.top_k,
            n_shared_experts=m.moe_shared_experts,
            score_func=m.moe_score_func,
            route_norm=m.moe_route_norm,
            aux_loss_coef=m.moe_aux_loss_coef,
            capacity_factor=m.moe_capacity_factor,
            aux_loss_scale=1.0 / t.global_batch,  # the whole batch is here: sum per sequence / sequences
        )
    with torch.device("meta"):
        model = Transformer(args)
    model.init_weights(t.seed)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
    )
    tokens = load_corpus(cfg.data.source, cfg.data.max_bytes).long()
    span = tokens.numel() - t.seq_len
    records, position = [], 0
    for step in range(t.steps):
        if step < t.warmup_steps:
            factor = (step + 1) / t.warmup_steps
        else:
            progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
            factor = t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        for group in opt.param_groups:
            group["lr"] = t.lr * factor
        batch = torch.stack(
            [tokens[(position + j * t.seq_len) % span :][: t.seq_len + 1] for j in range(t.global_batch)]
        )
        position += t.global_batch * t.seq_len
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip if t.grad_clip > 0 else float("inf"))
        opt.step()
        opt.zero_grad()
        record = {"step": step + 1, "loss": loss.item(), "grad_norm": norm.item(), "tokens_consumed": position}
        moes = {name.split(".")[1]: mod for name, mod in model.named_modules() if isinstance(mod, MoE)}
        if moes:
            record["expert_load"] = {k: [int(c) for c in mod.tokens_per_expert] for k, mod in moes.items()}
            for mod in moes.values():  # aux-loss-free balancing: nudge the bias against this step's load
                load = mod.tokens_per_expert
                mod.expert_bias += m.moe_bias_update_rate * torch.sign(load.mean() - load)
                mod.reset_stats()
        records.append(record)
    return records
