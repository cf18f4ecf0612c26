"""Context parallelism (cp): every sequence is split across the ``cp`` ranks, and attention reaches across them.

Everything in a transformer block acts on each token separately except attention, where a query needs the
keys and values of every earlier position. So cp splits the sequence itself, runs the per-token parts on the
local tokens unchanged, and lets only attention communicate:

1. **The split, balanced for the causal mask.** The sequence is cut into 2·cp chunks of L = s / (2·cp)
   tokens; cp rank r holds chunks r and 2·cp−1−r (``chunk_ids``). Under the causal mask a query's work
   grows with its position, so a plain split into cp pieces would give the last rank cp times the work
   of the first; pairing an early chunk with a late one gives every rank the same amount (2·cp + 1 chunk
   pairs). The loader keeps this rank's positions of every window (``load_balanced_positions``, passed to
   data/loader.py), inputs and targets alike, and the rotary tables are cut to the same positions
   (``apply_context_parallel``), so every token is rotated by its *global* position. The loss is still the
   sum of token losses divided by the global token count: each cp rank sums its own tokens.
2. **Attention across ranks**, behind ``parallel.cp_attention``; each replaces ``Attention.attend`` (the
   seam in models/llama.py), so the model keeps its single-device code:

   - ``allgather``: all-gather K and V over cp (``GatherSequence``: its backward reduce-scatters dK and
     dV back to their owners), put the chunks in global order, and attend each local query chunk c to the
     keys 0 .. (c+1)·L − 1 with the single-device ``causal_attention`` (its queries are the last L of those
     positions). Simple, one collective per layer each way, but every rank holds all s keys and values.
   - ``ring``: K and V travel around the ring of cp ranks, one block per step (``RingAttention``). At step i
     rank r holds the block of rank r − i, attends its queries to it, and merges the partial result into
     the running one with the log-sum-exp rule; meanwhile the next block is already in flight
     (batched isend/irecv). Backward recomputes each block's probabilities from the saved log-sum-exp
     (FlashAttention's backward), and dK/dV travel with their block until they arrive home. A rank holds
     two blocks of s/cp keys at a time (the one in use and the one arriving), never all s.

3. **The log-sum-exp merge.** For a query row, attention over a key set S is o_S = Σ_j∈S e^{s_j} v_j / Z_S
   with Z_S = Σ_j∈S e^{s_j}; keep lse_S = log Z_S. For two disjoint sets A and B:
   lse = log(e^{lse_A} + e^{lse_B}) and o = e^{lse_A − lse} o_A + e^{lse_B − lse} o_B, exactly the attention
   over A ∪ B. ``merge_partial`` applies it; the diagonal block comes first, so every row has a finite lse
   before any fully masked case could arise.
4. **What each ring step computes** (``visible``): with the balanced split only three cases exist. The own
   block is causal over the local 2L tokens (their positions increase); a block from an earlier rank
   (src < r) is seen only through its first chunk, by all local queries, unmasked; a block from a later rank
   (src > r) is seen whole, by the second local chunk only, unmasked. Each off-diagonal step is half a
   block's work on every rank: the balance of step 1.

Parameters are replicated over cp, so FSDP shards them over dp_shard x cp and sums their gradients over it
(mesh/dims.py); the cp group gets the collective timeout like every other mesh dim.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from mesh.private_api import all_gather_functional, reduce_scatter_functional
from models.llama import Attention, causal_attention

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

ALGORITHMS = ("allgather", "ring")


# ---- 1. the split ------------------------------------------------------------------------------------------
def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2·cp) that cp rank ``cp_rank`` holds: an early one and its mirror image."""
    return cp_rank, 2 * cp - 1 - cp_rank


def load_balanced_positions(seq_len: int, cp_rank: int, cp: int) -> torch.Tensor:
    """Global positions of this rank's tokens, in local order: chunk r, then chunk 2·cp−1−r (increasing)."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunk_ids(cp_rank, cp)])


def split_sequence(x: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` (a full sequence): its two chunks, concatenated."""
    return x.index_select(dim, load_balanced_positions(x.shape[dim], cp_rank, cp).to(x.device))


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, algorithm: str, seq_len: int) -> nn.Module:
    """Make ``model`` (a whole model or a pipeline stage, already materialised) run on this rank's chunks.

    Every Attention's ``attend`` becomes the cross-rank algorithm, and the rotary tables keep only the rows
    of this rank's global positions, so ``Attention.forward`` (which takes the first seqlen rows) rotates
    each local token by its global position. Call it after ``materialize_weights``, which rebuilds the tables.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown context-parallel attention {algorithm!r}; choose one of {ALGORITHMS}")
    group = cp_mesh.get_group()
    attend = functools.partial(allgather_attention if algorithm == "allgather" else ring_attention, group=group)
    # torch.compile traces the rest of the block and calls this as it is (collectives and p2p inside).
    attend = torch.compiler.disable(attend)
    for module in model.modules():
        if isinstance(module, Attention):
            module.attend = attend
    positions = load_balanced_positions(seq_len, cp_mesh.get_local_rank(), cp_mesh.size())
    positions = positions.to(model.rope_cos.device)
    model.rope_cos, model.rope_sin = model.rope_cos[positions], model.rope_sin[positions]
    return model


# ---- 2a. all-gather ----------------------------------------------------------------------------------------
class GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over ``group`` (rank order); backward: reduce-scatter, each rank keeps its part.

    Every rank's queries used every rank's keys, so the gradient of a rank's keys is the *sum* of what all
    ranks computed for them: exactly a reduce-scatter. Functional collectives (new tensors, not in-place),
    so selective activation checkpointing saves the gathered tensor instead of gathering it again.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return all_gather_functional(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_functional(grad.contiguous(), ctx.group), None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group) -> torch.Tensor:
    """Causal attention of this rank's queries over all ranks' keys. q (b, n, heads, d), k/v (b, n, kv_heads, d)
    hold this rank's n = s/cp tokens (chunks r and 2cp−1−r); returns (b, n, heads, d)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = q.shape[1] // 2
    # One collective for K and V (kv heads only: GQA shrinks the message), sequence first for the gather.
    kv = torch.stack([k, v]).movedim(2, 0)  # (n, 2, b, kv_heads, d)
    gathered = GatherSequence.apply(kv, group)  # (cp·n, 2, b, kv_heads, d): rank 0's chunks, rank 1's, ...
    # Rank j's rows are chunks j and 2cp-1-j; sort all rows by global position.
    held = torch.cat([load_balanced_positions(cp * q.shape[1], j, cp) for j in range(cp)])
    in_order = gathered.index_select(0, torch.argsort(held).to(q.device)).movedim(0, 2)  # (2, b, s, kv_heads, d)
    k_all, v_all = in_order[0], in_order[1]
    outs = []
    for c, q_chunk in zip(chunk_ids(rank, cp), q.split(chunk, dim=1), strict=True):
        # Chunk c's queries are the last L of the positions 0 .. (c+1)·L - 1: causal, aligned at the bottom right.
        end = (c + 1) * chunk
        outs.append(causal_attention(q_chunk, k_all[:, :end], v_all[:, :end]))
    return torch.cat(outs, dim=1)


# ---- 2b. ring ----------------------------------------------------------------------------------------------
def visible(src: int, rank: int, n: int) -> tuple[slice, slice, bool]:
    """Which local query rows see which keys of the block that cp rank ``src`` holds (module docstring, 4).

    Returns (query rows, key rows, causal) over the n = 2L local positions of each side.
    """
    half = n // 2
    if src == rank:
        return slice(None), slice(None), True  # both chunks increase in position: a plain causal mask
    if src < rank:
        return slice(None), slice(0, half), False  # its early chunk precedes all of ours; its late one follows
    return slice(half, None), slice(None), False  # only our late chunk comes after both of its chunks


def _repeat_kv(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    return t.repeat_interleave(n_rep, dim=1)  # (b, kv_heads, m, d) -> (b, heads, m, d)


def _acc(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the dtype the softmax bookkeeping runs in: fp32 for bf16/fp16/fp32 inputs, fp64 stays fp64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def block_scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """Scaled scores q kᵀ / sqrt(d) in fp32 (or wider), (b, heads, nq, nk); causal masks key j > query i."""
    scores = _acc(q) @ _acc(_repeat_kv(k, q.shape[1] // k.shape[1])).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores[0, 0], dtype=torch.bool).triu(1), float("-inf"))
    return scores


def block_attention(q, k, v, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of q over one block of keys: (b, heads, nq, d) and (b, heads, nq), both in fp32."""
    scores = block_scores(q, k, causal)
    lse = scores.logsumexp(-1)
    out = torch.exp(scores - lse[..., None]) @ _acc(_repeat_kv(v, q.shape[1] // v.shape[1]))
    return out, lse


def merge_partial(out, lse, rows: slice, block_out, block_lse) -> None:
    """Fold one block's (output, lse) into the running ones, in place, for query ``rows`` (module docstring, 3)."""
    new_lse = torch.logaddexp(lse[:, :, rows], block_lse)
    out[:, :, rows] = (
        out[:, :, rows] * torch.exp(lse[:, :, rows] - new_lse)[..., None]
        + block_out * torch.exp(block_lse - new_lse)[..., None]
    )
    lse[:, :, rows] = new_lse


def block_gradients(q, k, v, d_out, lse, delta, causal: bool):
    """dq, dk, dv of one block, from the *final* lse of each query row (FlashAttention's backward).

    p = exp(scores − lse) is the block's share of the final softmax; dv = pᵀ dO; dp = dO vᵀ;
    ds = p ⊙ (dp − delta) with delta = rowsum(dO ⊙ O); dq = ds k / sqrt(d); dk = dsᵀ q / sqrt(d).
    Query heads that share a kv head add their dk, dv.
    """
    n_rep, scale = q.shape[1] // k.shape[1], 1 / math.sqrt(q.shape[-1])
    p = torch.exp(block_scores(q, k, causal) - lse[..., None])
    dv = p.transpose(-1, -2) @ d_out
    dp = d_out @ _acc(_repeat_kv(v, n_rep)).transpose(-1, -2)
    ds = p * (dp - delta[..., None])
    dq = ds @ _acc(_repeat_kv(k, n_rep)) * scale
    dk = ds.transpose(-1, -2) @ _acc(q) * scale

    def fold(t):  # (b, heads, m, d) -> (b, kv_heads, m, d): sum over the query heads of each kv head
        return t.unflatten(1, (k.shape[1], n_rep)).sum(2)

    return dq, fold(dk), fold(dv)


def ring_exchange(send: torch.Tensor, group) -> tuple[torch.Tensor, list]:
    """Start sending ``send`` to the next cp rank and receiving the previous rank's into a new buffer.

    Returns (buffer, requests): wait on the requests before reading the buffer. Both directions go in one
    ``batch_isend_irecv``, so no rank blocks in a send while its neighbour blocks in one too.
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    recv = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send.contiguous(), group=group, group_peer=(rank + 1) % cp),
        dist.P2POp(dist.irecv, recv, group=group, group_peer=(rank - 1) % cp),
    ]
    return recv, dist.batch_isend_irecv(ops)


def _wait(requests) -> None:
    for request in requests:
        request.wait()


class RingAttention(torch.autograd.Function):
    """Causal attention over the ring of cp ranks; q, k, v and the output in (b, heads, n, d) layout."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group) -> torch.Tensor:
        cp, rank, n = dist.get_world_size(group), dist.get_rank(group), q.shape[2]
        acc = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v])  # the block in hand travels as one message, in the input dtype
        for step in range(cp):
            src = (rank - step) % cp  # the rank whose block we hold
            incoming = ring_exchange(kv, group) if step < cp - 1 else None  # overlaps the compute below
            rows, keys, causal = visible(src, rank, n)
            block_out, block_lse = block_attention(q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], causal)
            merge_partial(out, lse, rows, block_out, block_lse)
            if incoming is not None:
                arrived, requests = incoming
                _wait(requests)
                kv = arrived
        # Stored as (b, n, heads, d) in memory: the model's (b, n, heads, d) view of it is then contiguous, so
        # wo's input is this same storage, not a second copy.
        out = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        ctx.group = group
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        cp, rank, n = dist.get_world_size(group), dist.get_rank(group), q.shape[2]
        d_out = _acc(d_out)
        delta = (d_out * _acc(out)).sum(-1)  # rowsum(dO ⊙ O), (b, heads, n)
        dq = torch.zeros(q.shape, dtype=d_out.dtype, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=d_out.dtype, device=q.device)  # the gradient of the block in hand
        for step in range(cp):
            src = (rank - step) % cp
            incoming = ring_exchange(kv, group) if step < cp - 1 else None
            rows, keys, causal = visible(src, rank, n)
            dq_rows, dk, dv = block_gradients(
                q[:, :, rows],
                kv[0][:, :, keys],
                kv[1][:, :, keys],
                d_out[:, :, rows],
                lse[:, :, rows],
                delta[:, :, rows],
                causal,
            )
            dq[:, :, rows] += dq_rows
            dkv[0][:, :, keys] += dk
            dkv[1][:, :, keys] += dv
            # The block's gradient follows the block; after cp hops it is back with the rank that owns it.
            arrived_grad, requests = ring_exchange(dkv, group)
            _wait(requests)
            dkv = arrived_grad
            if incoming is not None:
                arrived, requests = incoming
                _wait(requests)
                kv = arrived
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group) -> torch.Tensor:
    """Causal attention of this rank's queries over all ranks' keys, passing K/V around the ring.
    Same shapes as ``allgather_attention``: (b, n, heads, d) queries, (b, n, kv_heads, d) keys and values."""
    out = RingAttention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), group)
    return out.transpose(1, 2)
