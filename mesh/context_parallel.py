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
     dV back to their owners), put the chunks in global order (``in_global_order``: a reshape, a flip and a
     cat on the device, no index tensor), and attend each local query chunk c with two kernel calls: its
     diagonal block (the keys of chunk c, causal) and one full block of every earlier position (keys
     0 .. c·L − 1), merged by their log-sum-exp (``allgather_blocks``). Simple, one collective per layer
     each way, but every rank holds all s keys and values.

   - ``ring``: K and V travel around the ring of cp ranks, one block per step (``RingAttention``). At step i
     rank r holds the block of rank r − i, attends its queries to it, and merges the partial result into
     the running one with the log-sum-exp rule; meanwhile the next block is already in flight
     (batched isend/irecv). Backward runs each block's kernel backward again around the ring, and dK/dV
     travel with their block until they arrive home. A rank holds two blocks of s/cp keys at a time (the
     one in use and the one arriving), never all s.

3. **The log-sum-exp merge.** For a query row, attention over a key set S is o_S = Σ_j∈S e^{s_j} v_j / Z_S
   with Z_S = Σ_j∈S e^{s_j}; keep lse_S = log Z_S. For two disjoint sets A and B:
   lse = log(e^{lse_A} + e^{lse_B}) and o = e^{lse_A − lse} o_A + e^{lse_B − lse} o_B, exactly the attention
   over A ∪ B. ``merge_partial`` applies it in fp32 (fp64 stays fp64); the diagonal block comes first, so
   every row has a finite lse before any other block is folded in.
4. **What each block computes.** With the balanced split only two shapes of block exist: a diagonal block,
   causal (query and key positions increase together), or a full block, unmasked. In the ring
   (``visible``): the own block is causal over the local 2L tokens; a block from an earlier rank (src < r)
   is seen only through its first chunk, by all local queries; a block from a later rank (src > r) is seen
   whole, by the second local chunk only. Each off-diagonal step is half a block's work on every rank: the
   balance of step 1. So no block needs an explicit mask, and every block can go through a fused kernel.
5. **Fused kernels, no (n, n) tensor.** Each block is one call of an attention kernel that also returns the
   log-sum-exp of its rows (mesh/lse_attention.py: ``attention_with_lse``: the CPU flash kernel; on CUDA
   flash, or memory-efficient for fp32): the kernel walks the keys in tiles and keeps only the running
   maximum and sum per row, so the scores of a block never exist as a tensor, in forward or backward, and
   bf16 inputs stay bf16 inside the kernel. Backward calls the kernel's backward per block with the
   *merged* output and log-sum-exp (``attention_with_lse_backward``): it recomputes the block's
   probabilities as exp(scores − lse), which are then the block's share of the whole softmax, so the
   per-block dq add up to the full gradient and each block's dk, dv are exact. The CPU and CUDA flash
   kernels read grouped k/v heads as they are; the memory-efficient kernel needs equal heads, so there a
   block's k/v are repeated, one block at a time.

6. **Document masks** (``documents``: the document index of every position of the *whole* window, which every
   cp rank has from the loader). A query sees a key only when both lie in the same document and the key does
   not come later: neither a plain causal block nor a full one, so the fused kernels above (which take only
   a causal flag) do not apply. ``allgather`` then attends its queries to the gathered keys through SDPA with
   that explicit (n, s) mask; ``ring`` computes each block with its explicit (n, n) mask in plain torch
   (``masked_block``, its backward ``masked_block_backward``), merged by the same log-sum-exp rule. Exact, at
   the cost of the scores as a tensor per block; the own block comes first, so every row (which sees at least
   itself) has a finite log-sum-exp before a fully masked row of another block is folded in.

Parameters are replicated over cp, so FSDP shards them over dp_shard x cp and sums their gradients over it
(mesh/dims.py); the cp group gets the collective timeout like every other mesh dim.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mesh.lse_attention import attention_with_lse, attention_with_lse_backward
from mesh.private_api import all_gather_functional, reduce_scatter_functional
from models.latent_attention import LatentAttention
from models.llama import Attention

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


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, algorithm: str, seq_len: int) -> nn.Module:
    """Make ``model`` (whole or a pipeline stage) run on this rank's chunks: cross-rank ``attend``, rotary rows of this
    rank's global positions. Call it after ``materialize_weights``, which rebuilds the tables."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown context-parallel attention {algorithm!r}; choose one of {ALGORITHMS}")
    group = cp_mesh.get_group()
    attend = functools.partial(allgather_attention if algorithm == "allgather" else ring_attention, group=group)
    # torch.compile traces the rest of the block and calls this as it is (collectives and p2p inside).
    attend = torch.compiler.disable(attend)
    for module in model.modules():
        if isinstance(module, (Attention, LatentAttention)):  # latent attention: the same seam (DeepSeek-V3)
            module.attend = attend
    positions = load_balanced_positions(seq_len, cp_mesh.get_local_rank(), cp_mesh.size())
    positions = positions.to(model.rope_cos.device)
    # the whole tables stay beside, for document masks' per-token positions (models/llama.py: Transformer.forward)
    model.rope_full, model.cp_positions = (model.rope_cos, model.rope_sin), positions
    model.rope_cos, model.rope_sin = model.rope_cos[positions], model.rope_sin[positions]
    return model


# ---- 2a. all-gather ----------------------------------------------------------------------------------------
class GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward: reduce-scatter (a rank's keys' gradient sums every rank's).
    Selective activation checkpointing recomputes the gather (a whole-sequence tensor: mesh/ac_policies.py), as
    the ring's sends are repeated."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return all_gather_functional(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_functional(grad.contiguous(), ctx.group), None


def in_global_order(gathered: torch.Tensor, cp: int) -> torch.Tensor:
    """Rows gathered in rank order (rank j: chunk j, then chunk 2cp−1−j) -> rows in global position order, on device."""
    by_rank = gathered.unflatten(0, (cp, 2, gathered.shape[0] // (2 * cp)))  # (rank, early/late, L, ...)
    return torch.cat([by_rank[:, 0], by_rank[:, 1].flip(0)]).flatten(0, 1)


def allgather_blocks(rank: int, cp: int, chunk: int) -> list[tuple[slice, slice, bool]]:
    """The kernel calls of this rank's queries over the keys in global order (module docstring, 4)."""
    blocks = []
    for i, c in enumerate(chunk_ids(rank, cp)):
        rows = slice(i * chunk, (i + 1) * chunk)
        blocks.append((rows, slice(c * chunk, (c + 1) * chunk), True))
        if c > 0:
            blocks.append((rows, slice(0, c * chunk), False))
    return blocks


def rank_document_mask(documents: torch.Tensor, q_rank: int, k_rank: int | None, cp: int) -> torch.Tensor:
    """(b, 1, n, m) bool: this rank's queries (those of cp rank ``q_rank``) against the keys of cp rank ``k_rank``
    (None: every position, in global order): the key no later, and in the same document (module docstring, 6)."""
    s = documents.shape[1]
    q_pos = load_balanced_positions(s, q_rank, cp).to(documents.device)
    k_pos = torch.arange(s, device=documents.device) if k_rank is None else load_balanced_positions(s, k_rank, cp)
    k_pos = k_pos.to(documents.device)
    same = documents[:, q_pos][:, :, None] == documents[:, k_pos][:, None, :]
    return (same & (k_pos[None, :] <= q_pos[:, None]))[:, None]


def allgather_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal attention of this rank's queries (its chunks r and 2cp−1−r) over all ranks' keys; ``documents`` (b, s):
    each position's document index (module docstring, 6)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    # One collective for K and V (kv heads only: GQA shrinks the message), sequence first for the gather.
    kv = torch.stack([k, v]).movedim(2, 0)  # (n, 2, b, kv_heads, d)
    gathered = GatherSequence.apply(kv, group)  # (cp·n, 2, b, kv_heads, d): rank 0's chunks, rank 1's, ...
    k_all, v_all = in_global_order(gathered, cp).permute(1, 2, 3, 0, 4)  # each (b, kv_heads, s, d)
    if documents is not None:  # an explicit mask through SDPA, k/v heads repeated for it (exact on any device)
        n_rep = q.shape[2] // k.shape[2]
        k_all, v_all = k_all.repeat_interleave(n_rep, dim=1), v_all.repeat_interleave(n_rep, dim=1)
        mask = rank_document_mask(documents, rank, None, cp)
        return F.scaled_dot_product_attention(q.transpose(1, 2), k_all, v_all, attn_mask=mask).transpose(1, 2)
    blocks = allgather_blocks(rank, cp, q.shape[1] // 2)
    return BlockwiseAttention.apply(q.transpose(1, 2), k_all, v_all, blocks).transpose(1, 2)


# ---- 2b. ring ----------------------------------------------------------------------------------------------
def visible(src: int, rank: int, n: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal): which local query rows see which keys of cp rank ``src``'s block."""
    half = n // 2
    if src == rank:
        return slice(None), slice(None), True  # both chunks increase in position: a plain causal mask
    if src < rank:
        return slice(None), slice(0, half), False  # its early chunk precedes all of ours; its late one follows
    return slice(half, None), slice(None), False  # only our late chunk comes after both of its chunks


def ring_exchange(send: torch.Tensor, group) -> tuple[torch.Tensor, list]:
    """Send ``send`` to the next cp rank and receive the previous one's; returns (buffer, requests) to wait on. Both
    directions go in one ``batch_isend_irecv``, so no two neighbours block in a send at once."""
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
    def forward(
        ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        cp, rank, n = dist.get_world_size(group), dist.get_rank(group), q.shape[2]
        out, lse = new_accumulators(q)
        kv = torch.stack([k, v])  # the block in hand travels as one message, in the input dtype
        states = []
        for step in range(cp):
            src = (rank - step) % cp  # the rank whose block we hold
            incoming = ring_exchange(kv, group) if step < cp - 1 else None  # overlaps the compute below
            if documents is None:
                rows, keys, causal = visible(src, rank, n)
                block_out, block_lse, state = attention_with_lse(
                    q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], causal
                )
            else:  # every row against every key, through the explicit mask (module docstring, 6)
                rows = keys = slice(None)
                state = rank_document_mask(documents, rank, src, cp)
                block_out, block_lse = masked_block(q, kv[0], kv[1], state)
            merge_partial(out, lse, rows, block_out, block_lse)
            states.append(state)
            if incoming is not None:
                arrived, requests = incoming
                _wait(requests)
                kv = arrived
        out = out.to(q.dtype)  # keeps the (b, n, heads, d) memory layout
        ctx.group, ctx.states, ctx.masked = group, states, documents is not None
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        cp, rank, n = dist.get_world_size(group), dist.get_rank(group), q.shape[2]
        d_out = d_out.contiguous()  # the kernels need real strides (a loss's .sum() hands an expanded gradient)
        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=lse.dtype, device=q.device)  # the gradient of the block in hand
        for step in range(cp):
            src = (rank - step) % cp
            incoming = ring_exchange(kv, group) if step < cp - 1 else None
            if ctx.masked:
                rows = keys = slice(None)
                dq_rows, dk, dv = masked_block_backward(d_out, q, kv[0], kv[1], out, lse, ctx.states[step])
            else:
                rows, keys, causal = visible(src, rank, n)
                dq_rows, dk, dv = attention_with_lse_backward(
                    d_out[:, :, rows],
                    q[:, :, rows],
                    kv[0][:, :, keys],
                    kv[1][:, :, keys],
                    out[:, :, rows],
                    lse[:, :, rows],
                    causal,
                    ctx.states[step],
                )
            dq[:, :, rows] += dq_rows
            dkv[0][:, :, keys] += dk
            dkv[1][:, :, keys] += dv
            # The block's gradient follows the block; after cp hops it is back with the rank that owns it
            # (with cp = 1 it never left).
            if cp > 1:
                arrived_grad, requests = ring_exchange(dkv, group)
                _wait(requests)
                dkv = arrived_grad
            if incoming is not None:
                arrived, requests = incoming
                _wait(requests)
                kv = arrived
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal attention of this rank's queries over all ranks' keys, passing K/V around the ring.
    Same shapes as ``allgather_attention``: (b, n, heads, d) queries, (b, n, kv_heads, d) keys and values."""
    out = RingAttention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), group, documents)
    return out.transpose(1, 2)


def masked_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor):
    """One block under an explicit mask (module docstring, 6) -> (output, lse); a row that sees no key gets output 0 and
    lse -inf, which the merge leaves out."""
    acc = torch.promote_types(q.dtype, torch.float32)
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.to(acc).repeat_interleave(n_rep, dim=1), v.to(acc).repeat_interleave(n_rep, dim=1)
    scores = (q.to(acc) @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # a row with no key: -inf - -inf
    return p @ v, lse


def masked_block_backward(d_out, q, k, v, out, lse, mask):
    """``masked_block``'s gradients (dq, dk, dv) given the *merged* output and lse (module docstring, 5: the
    block's probabilities are then its share of the whole softmax)."""
    acc = lse.dtype
    n_rep = q.shape[1] // k.shape[1]
    qa, ka, va = q.to(acc), k.to(acc).repeat_interleave(n_rep, dim=1), v.to(acc).repeat_interleave(n_rep, dim=1)
    scale = q.shape[-1] ** -0.5
    scores = (qa @ ka.transpose(-1, -2)) * scale
    p = torch.exp(scores - lse[..., None]).masked_fill(~mask, 0.0)
    d_out, out = d_out.to(acc), out.to(acc)
    dv = p.transpose(-1, -2) @ d_out
    dp = d_out @ va.transpose(-1, -2)
    ds = p * (dp - (d_out * out).sum(-1, keepdim=True))
    dq = (ds @ ka) * scale
    dk = (ds.transpose(-1, -2) @ qa) * scale
    b, kv_heads, m, d = k.shape
    return dq, dk.view(b, kv_heads, n_rep, m, d).sum(2), dv.view(b, kv_heads, n_rep, m, d).sum(2)


# ---- 3-5. blocks through a fused kernel, merged by their log-sum-exp ---------------------------------------
def new_accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The running (output, lse) for q: zeros and −inf in fp32 (fp64 stays fp64), output laid out (b, n, heads, d) so wo
    reads this same storage after the cast."""
    acc = torch.promote_types(q.dtype, torch.float32)
    b, heads, n, d = q.shape
    out = torch.zeros(b, n, heads, d, dtype=acc, device=q.device).transpose(1, 2)
    return out, torch.full((b, heads, n), float("-inf"), dtype=acc, device=q.device)


def merge_partial(out, lse, rows: slice, block_out, block_lse) -> None:
    """Fold one block's (output, lse) into the running ones in place, in their dtype (bf16 is rounded once, by the
    kernel)."""
    new_lse = torch.logaddexp(lse[:, :, rows], block_lse.to(lse.dtype))
    out[:, :, rows] = (
        out[:, :, rows] * torch.exp(lse[:, :, rows] - new_lse)[..., None]
        + block_out.to(out.dtype) * torch.exp(block_lse - new_lse)[..., None]
    )
    lse[:, :, rows] = new_lse


class BlockwiseAttention(torch.autograd.Function):
    """q's rows attend to several (k, v) blocks through the fused kernel, merged by LSE; no messages. Backward runs each
    block's kernel backward with the merged output and LSE (module docstring, 5)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: list) -> torch.Tensor:
        out, lse = new_accumulators(q)
        states = []
        for rows, keys, causal in blocks:
            block_out, block_lse, state = attention_with_lse(q[:, :, rows], k[:, :, keys], v[:, :, keys], causal)
            merge_partial(out, lse, rows, block_out, block_lse)
            states.append(state)
        out = out.to(q.dtype)  # keeps the (b, n, heads, d) memory layout
        ctx.blocks, ctx.states = blocks, states
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        d_out = d_out.contiguous()  # the kernels need real strides (a loss's .sum() hands an expanded gradient)
        acc = lse.dtype
        dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
        for (rows, keys, causal), state in zip(ctx.blocks, ctx.states, strict=True):
            dq_rows, dk_keys, dv_keys = attention_with_lse_backward(
                d_out[:, :, rows],
                q[:, :, rows],
                k[:, :, keys],
                v[:, :, keys],
                out[:, :, rows],
                lse[:, :, rows],
                causal,
                state,
            )
            dq[:, :, rows] += dq_rows
            dk[:, :, keys] += dk_keys
            dv[:, :, keys] += dv_keys
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
