"""A Mixture-of-Experts feed-forward block in single-device PyTorch (no torch.distributed here).

``MoE.forward`` on x of shape (batch, seq, dim):

1. **Route.** The router scores every token against every expert (softmax or sigmoid of a linear map) and
   each token picks its top-k experts (models/routers.py, with DeepSeek-V3's group limit). Selection uses
   ``scores + expert_bias``; the gates that weight the experts' outputs use the unbiased scores, renormalised
   over the chosen k when ``route_norm``, times ``route_scale``.
2. **Capacity** (optional). With ``capacity_factor > 0`` each expert accepts at most
   ceil(capacity_factor * seq * k / n_experts) tokens *per sequence*, in token order; the rest of its
   assignments are dropped (those tokens keep only their residual for that slot). Counting per sequence,
   not per batch, keeps the result independent of how the batch is split across ranks. Default: dropless.
3. **Dispatch.** Sort the (token, slot) assignments by expert id and count the kept ones per expert, on
   the device (no ``nonzero`` or ``bincount``: their output sizes depend on the data, so the host must wait
   for it). Dropless, nothing waits for the host; with capacity, the number kept is read once.
4. **Experts.** ``GroupedExperts(x_sorted, counts)`` runs expert e on its contiguous run of tokens, all
   experts in one grouped matmul per weight (models/kernels.py). This is the seam that expert parallelism
   wraps (mesh/expert_parallel.py): it moves the runs to the ranks that own the experts and back, and the
   block does not know.
5. **Combine.** Scatter-add each output, weighted by its gate, back to its token; add the shared expert
   (Qwen2-MoE: times sigmoid of its own gate).

Load balancing, both optional:

- **Auxiliary loss** (Switch Transformer style), in one of two forms (``aux_loss_form``):

  - ``sequence`` (meshloom's): per sequence and per layer, aux = coef * E * sum_i f_i * P_i, with f_i the
    fraction of the sequence's assignments that went to expert i and P_i the mean router probability of
    expert i; summed over sequences and divided by ``aux_loss_scale``'s global sequence count. Every layout
    computes it (each term needs one sequence, one layer).
  - ``transformers`` (``load_balancing_loss_func`` in transformers' Mixtral, Qwen-MoE and OLMoE modeling): one
    loss over the whole forward, every layer's tokens concatenated: aux = coef * E * sum_i (c_i / N) * (p_i / N),
    with c_i the top-k assignments (of softmax(logits)) to expert i summed over tokens and layers, p_i the
    routing probabilities summed the same way and N the tokens times the layers. A product of two sums over
    all layers: each block only records its sums (``batch_terms``) and the decoder adds the loss after its
    last layer (``batch_aux_loss``), so it is whole only when one forward sees the global batch (one rank, no
    accumulation: planning/layout_rules.py).

  Either is added to the training objective through ``AddAuxLoss`` (identity forward; backward feeds the aux
  gradient).

- **Aux-loss-free bias** (DeepSeek-V3 style): ``expert_bias`` shifts only the *selection*. After each
  optimizer step the trainer nudges it by ``bias_update_rate * sign(mean_load - load_i)`` from the measured
  global load (mesh/expert_parallel.step_expert_load), outside autograd.

The block accumulates the per-expert token counts, dropped assignments and aux loss of a step in buffers
that the trainer reads and resets for metrics. ``count_stats`` switches that off: activation checkpointing
reruns the forward inside backward, and the rerun must not count the same tokens twice.

**Sequences in chunks.** Capacity and the aux loss are per *sequence*. When the block sees only a chunk of
each sequence (tensor parallelism splits every sequence across the tp ranks, and each rank routes its own
chunk: mesh/moe_token_split.TokenSplitMoE), ``self.sequence`` supplies the two per-sequence sums that need the
other chunks: how many tokens of the same sequence chose each expert in the chunks *before* this one (for
the capacity ranking), and sums over all chunks (for the aux loss's fractions and mean probabilities). The
default, ``WholeSequence``, is one chunk: nothing to add. The statistics buffers then hold this chunk's
share (the aux loss divided by the number of chunks), so summing them over every rank gives the whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.feed_forward import FeedForward  # the dense SwiGLU, reused as the shared expert
from models.kernels import alignment_rows, grouped_mm, grouped_mm_works, padded_groups
from models.local_tensor import eager_local_tensors, local_tensor
from models.routers import choose_experts


@dataclass
class MoEArgs:
    n_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 256  # each routed expert's SwiGLU hidden size
    n_shared_experts: int = 0  # 0 or 1: a dense SwiGLU that every token also goes through
    score_func: str = "softmax"  # softmax | sigmoid
    route_norm: bool = True  # renormalise the k gates of a token to sum to 1
    aux_loss_coef: float = 0.0  # 0: no auxiliary loss
    aux_loss_form: str = "sequence"  # sequence (per sequence and layer) | transformers (the whole forward)
    aux_loss_scale: float = 1.0  # 1 / (sequences per optimizer step, whole world): set by the trainer
    bias_update_rate: float = 0.0  # 0: no aux-loss-free bias updates
    capacity_factor: float = 0.0  # 0: dropless
    shared_hidden_dim: int = 0  # the shared expert's hidden size; 0: the dense FFN's (ModelArgs.hidden_dim)
    shared_gate: bool = False  # Qwen2-MoE: the shared expert's output times sigmoid(a linear map of x)
    n_groups: int = 1  # DeepSeek-V3 group-limited routing: experts in n_groups groups ...
    topk_groups: int = 1  # ... of which each token may use the best topk_groups (models/routers.py)
    route_scale: float = 1.0  # DeepSeek-V3 routed_scaling_factor: the gates times this


class GroupedExperts(nn.Module):
    """n_experts SwiGLU MLPs as batched weights; ``forward(x, counts)`` takes the rows of expert 0, then 1, ...
    ``grouped``: one grouped matmul per weight, no host sync; ``looped``: one matmul per expert (one sync), where the
    grouped kernel does not run (``grouped_mm_works``)."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # The local weights are taken uncompiled (``eager_local_tensors``): dynamo's traced ``to_local`` can come
        # back as a DTensor after a graph break (2.13 before the looped path, 2.15 before the grouped one), which
        # then meets plain tensors. Sizes past dim 0 are the same locally and globally (EP shards dim 0 only).
        shapes = (tuple(self.w1.shape[1:]), tuple(self.w2.shape[1:]))
        if grouped_mm_works(x.device, x.dtype, shapes):
            return self.grouped(x, counts, *eager_local_tensors(self.w1, self.w2, self.w3))
        return self.looped(x, counts, self.w1, self.w2, self.w3)

    @staticmethod
    def grouped(x, counts, w1, w2, w3, align: int | None = None) -> torch.Tensor:
        align = alignment_rows(x.device, x.dtype) if align is None else align
        if align > 1:  # CUDA: each expert's rows start on an aligned row (models/kernels.py, 3)
            dest, offs, capacity = padded_groups(counts, align, x.shape[0])
            padded = x.new_zeros(capacity, x.shape[1]).index_copy(0, dest, x)
            hidden = F.silu(grouped_mm(padded, w1, offs)) * grouped_mm(padded, w3, offs)
            return grouped_mm(hidden, w2, offs).index_select(0, dest)
        offs = counts.cumsum(0, dtype=torch.int32)  # where each expert's rows end
        hidden = F.silu(grouped_mm(x, w1, offs)) * grouped_mm(x, w3, offs)
        return grouped_mm(hidden, w2, offs)

    @staticmethod
    @torch.compiler.disable  # split sizes read to the host: compiled, every new set of counts would recompile
    def looped(x, counts, w1, w2, w3) -> torch.Tensor:
        w1, w2, w3 = local_tensor(w1), local_tensor(w2), local_tensor(w3)
        chunks = torch.split(x, counts.tolist())  # the split sizes must be on the host: the fallback's one sync
        outputs = [(F.silu(chunk @ w1[e]) * (chunk @ w3[e])) @ w2[e] for e, chunk in enumerate(chunks)]
        return torch.cat(outputs) if outputs else x.new_zeros(0, w2.shape[-1])


class WholeSequence:
    """The block sees whole sequences: one chunk (see "Sequences in chunks" in the module docstring)."""

    chunks = 1

    def sum(self, per_sequence: torch.Tensor) -> torch.Tensor:
        """Sum of a per-sequence quantity over the chunks of each sequence (differentiable)."""
        return per_sequence

    def before(self, counts: torch.Tensor) -> torch.Tensor:
        """counts (batch, E) of this chunk -> the same counts summed over the chunks before this one."""
        return torch.zeros_like(counts)


class Router(nn.Module):
    def __init__(self, dim: int, n_experts: int):
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)

    def forward(self, x: torch.Tensor, score_func: str) -> torch.Tensor:
        logits = self.gate(x).float()
        return logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()


class AddAuxLoss(torch.autograd.Function):
    """Returns ``x`` unchanged; in backward, also sends gradient 1 into ``aux_loss``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.dtype, ctx.device = aux_loss.dtype, aux_loss.device
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=ctx.dtype, device=ctx.device)


class MoE(nn.Module):
    def __init__(self, dim: int, args: MoEArgs, shared_hidden_dim: int):
        super().__init__()
        self.args = args
        self.router = Router(dim, args.n_experts)
        self.experts = GroupedExperts(dim, args.hidden_dim, args.n_experts)
        shared_hidden_dim = args.shared_hidden_dim or shared_hidden_dim
        self.shared_expert = FeedForward(dim, shared_hidden_dim) if args.n_shared_experts else None
        # Registered only when used, so the card's own MoE keeps its parameter names.
        if args.n_shared_experts and args.shared_gate:
            self.shared_gate = nn.Linear(dim, 1, bias=False)
        self.register_buffer("expert_bias", torch.zeros(args.n_experts), persistent=True)
        # Step statistics for metrics and bias updates (not checkpointed).
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_experts), persistent=False)
        self.register_buffer("dropped_assignments", torch.zeros(()), persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros(()), persistent=False)
        self.count_stats = True  # False while activation checkpointing recomputes the block
        self.sequence = WholeSequence()  # tensor parallelism replaces it (module docstring)
        self.batch_terms: tuple[torch.Tensor, torch.Tensor, int] | None = None  # aux_loss_form transformers

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """Zero the bias and the step statistics; with ``device``, make them anew there (FSDP CPU offload's ``to_empty``
        puts the whole module on the host, but the bias meets the scores on the compute device)."""
        if device is not None:
            for name, buffer in list(self.named_buffers(recurse=False)):
                setattr(self, name, torch.zeros_like(buffer, device=device))
        self.expert_bias.zero_()
        self.reset_stats()

    def reset_stats(self) -> None:
        self.tokens_per_expert.zero_()
        self.dropped_assignments.zero_()
        self.aux_loss_sum.zero_()

    def capacity(self, seqlen: int) -> int:
        a = self.args
        return math.ceil(a.capacity_factor * seqlen * a.top_k / a.n_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.args
        bsz, seqlen, dim = x.shape
        # 1. Route: choose with the biased scores, weight with the unbiased ones.
        scores = self.router(x, a.score_func)  # (b, s, E) fp32
        chosen, gates = choose_experts(scores, self.expert_bias, a)  # (b, s, k) each
        # (b, s, E): 1 where the token chose the expert. (F.one_hot would check its input's range with two
        # host reads on a CPU; a scatter checks nothing and reads nothing.)
        assigned = torch.zeros_like(scores, dtype=torch.long).scatter_(-1, chosen, 1)

        # 2. Capacity: an assignment is kept if fewer than `capacity` earlier tokens of its sequence chose
        #    the same expert (counting those in earlier chunks of the sequence, if it is split).
        keep = torch.ones_like(chosen, dtype=torch.bool)
        if a.capacity_factor > 0:
            earlier = self.sequence.before(assigned.sum(1))  # (b, E)
            rank_in_expert = (assigned.cumsum(1) - 1 + earlier[:, None, :]).gather(-1, chosen)  # (b, s, k)
            keep = rank_in_expert < self.capacity(seqlen * self.sequence.chunks)

        # 3. Dispatch: the (token, slot) assignments sorted by expert, counted per expert on the device.
        flat_expert, flat_keep = chosen.flatten(), keep.flatten()
        counts = torch.zeros(a.n_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat_expert, flat_keep.long()
        )
        if a.capacity_factor > 0:
            # Dropped assignments sort after the last expert and are cut off. How many are kept sizes the
            # tensor the experts get, so the host must read it: the one host sync of a block with capacity.
            order = torch.argsort(torch.where(flat_keep, flat_expert, a.n_experts), stable=True)[: int(counts.sum())]
        else:
            order = torch.argsort(flat_expert, stable=True)  # dropless: nothing here waits for the host
        token_of = order // a.top_k  # assignment i is slot i % k of token i // k
        tokens = x.reshape(-1, dim)

        # 4. Experts (wrapped by expert parallelism when ep > 1).
        expert_out = self.experts(tokens[token_of], counts)

        # 5. Combine: weight by the gate, add back to the token's row.
        weighted = expert_out * gates.flatten()[order].unsqueeze(1).to(expert_out.dtype)
        out = torch.zeros_like(tokens).index_add_(0, token_of, weighted.to(tokens.dtype))
        out = out.view(bsz, seqlen, dim)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if hasattr(self, "shared_gate"):  # Qwen2-MoE's gate: how much of the shared expert each token takes
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared

        # Count each token once, in the forward (not again when activation checkpointing recomputes it).
        if self.count_stats:
            with torch.no_grad():
                self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
                self.dropped_assignments += flat_keep.numel() - order.numel()
        if a.aux_loss_coef > 0 and self.training and a.aux_loss_form == "transformers":
            if self.count_stats:  # not again when activation checkpointing reruns the block
                self.batch_terms = self.aux_terms(scores)
        elif a.aux_loss_coef > 0 and self.training:
            aux = self.aux_loss(scores, assigned)
            if self.count_stats:
                self.aux_loss_sum += aux.detach() / self.sequence.chunks  # this chunk's share
            out = AddAuxLoss.apply(out, aux)
        return out

    def aux_loss(self, scores: torch.Tensor, assigned: torch.Tensor) -> torch.Tensor:
        """Per-sequence Switch loss E * sum_i f_i P_i, summed over sequences, times coef * aux_loss_scale; f_i and P_i
        are whole-sequence means, summed over its chunks (``self.sequence``)."""
        a = self.args
        length = scores.shape[1] * self.sequence.chunks
        probs = scores / scores.sum(-1, keepdim=True)  # sigmoid scores do not sum to 1 on their own
        f = self.sequence.sum(assigned.float().sum(1)) / (length * a.top_k)  # (b, E): share of the assignments
        p = self.sequence.sum(probs.sum(1)) / length  # (b, E): mean routing probability
        return a.aux_loss_coef * a.aux_loss_scale * a.n_experts * (f * p).sum()

    def aux_terms(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """This layer's part of transformers' loss: top-k assignments of softmax(logits) per expert (no gradient),
        the routing probabilities summed per expert, and the token count (``batch_aux_loss`` adds the layers)."""
        a = self.args
        probs = (scores if a.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)).flatten(0, 1)
        with torch.no_grad():
            chosen = torch.topk(probs, a.top_k, dim=-1).indices.flatten()
            counts = torch.zeros(a.n_experts, device=probs.device).scatter_add_(
                0, chosen, torch.ones_like(chosen, dtype=torch.float)
            )
        return counts, probs.sum(0), probs.shape[0]


def batch_aux_loss(moes: list[MoE]) -> torch.Tensor | None:
    """transformers' auxiliary loss over the layers of one forward (module docstring), from each block's
    ``batch_terms`` (then cleared); None when no block recorded any. Each block's ``aux_loss_sum`` gets an equal
    share, so that the metric sums to the loss."""
    recorded = [moe for moe in moes if moe.batch_terms is not None]
    if not recorded:
        return None
    a = recorded[0].args
    counts = sum(moe.batch_terms[0] for moe in recorded)
    probs = sum(moe.batch_terms[1] for moe in recorded)
    rows = sum(moe.batch_terms[2] for moe in recorded)
    aux = a.aux_loss_coef * a.n_experts * ((counts / rows) * (probs / rows)).sum()
    for moe in recorded:
        moe.batch_terms = None
        moe.aux_loss_sum += aux.detach() / len(recorded)
    return aux
