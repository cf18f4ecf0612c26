"""What one rank holds in GPU memory at the peak of a training step: an estimate in bytes, arithmetic only.

Nothing here builds a model or a process group, so a layout can be judged before anything is allocated: the
layout planner (cluster/plan_layout.py) adds a search and a time model on top, and the same functions serve a
dry run, a "will it fit" check before allocation, and a memory-balanced pipeline split. Inputs: a
``ModelArgs`` (models/llama.py; MoE layers through ``args.moe``), the degrees, the batch and sequence, the
pipeline schedule, the activation checkpointing mode and the precision, gathered in ``Layout`` (planning/layout.py).

Per rank, for the pipeline rank and stages given (GB below means 1e9 bytes):

1. **States** (``states_bytes``): 16 bytes per parameter the rank owns: fp32 weights 4, fp32 gradients 4,
   Adam's m and v 8. ``mixed_precision = bf16`` keeps the same 16: FSDP2's MixedPrecisionPolicy keeps the
   sharded weights and their gradients in fp32 and computes with bf16 copies (item 2). A block's attention and
   dense FFN are split over tp, its norms are not; an MoE layer's router and shared expert are FSDP-sharded
   over the tp ranks too (mesh/data_parallel.py: the tp ranks route different tokens), counted here with what
   tp splits, and the experts are split over ep. FSDP
   then shards everything over dp_shard x cp (mesh/dims.py); with ep > 1 the experts over efsdp x ep =
   dp_shard x cp x tp (ep borrows tp ranks too, so no expert is copied over tp);
   dp_replicate (HSDP) holds copies. ``fsdp_cpu_offload`` moves the states to the host: 0 here.

2. **Gathered weights** (``gathered_bytes``), only under FSDP, in the compute dtype (2 bytes in bf16, 4 in fp32):
   without pipelining the final norm and head (one unit, mesh/data_parallel.py: vocabulary_units) stay
   gathered from their forward to their backward, and at the start of backward two blocks are gathered (the
   last one, kept, and the next one, prefetched); the head's unsharded gradient lives until its unit reduces,
   and the block being reduced holds its unsharded gradient (in bf16 also the fp32 copy FSDP reduce-scatters:
   2 + 4 bytes). The embedding, a unit of its own, is gathered only around its forward and its backward, where
   its peak (the embedding, its gradient and a block's) is counted when it is the larger one. A tied embedding
   and head are one unit with the norm, gathered with the whole vocabulary table. With pipelining torch keeps a stage's
   units gathered and accumulates unsharded fp32 gradients until the step's last backward
   (torch/distributed/pipelining/stage.py: backward_maybe_with_nosync): (compute dtype + 4) bytes for every
   parameter of the rank's stages. An MoE layer's router and shared expert, split with what tp splits for
   their states, are gathered whole on every tp rank (``token_split_parameters``: TokenSplitMoE).
3. **Activations** (``layer_activation_bytes``): what one block keeps from its forward for its backward,
   for one micro-batch of T = b·s/cp tokens on this rank. For models/llama.py's block
   (h = dim, g = n_kv_heads x head_dim, H = the FFN's hidden size, a = n_heads, w = bytes of the compute
   dtype, t = tp), counted from the ops that save tensors, the same list as measure/activation_memory.py:

   - each RMSNorm: its input in the compute dtype and the fp32 rsqrt per token (models/llama.py's
     ``_RMSNormFunction`` recomputes the normalised activation in backward): T·h·w + 4T, twice;
   - the inputs of wq/wk/wv and of w1/w3 (the norms' outputs): 2·T·h·w;
   - attention: q and the output T·h·w each; **k and v at their own n_kv_heads width**, 2·T·g·w (grouped-query
     attention: SDPA reads each k/v head for its query heads, no repeated copies); the fp32 log-sum-exp
     4·T·a; no s x s scores (a fused, flash-style kernel);
   - the SwiGLU: w1's and w3's outputs, silu of w1's, and their product: 4·T·H·w;
   - an MoE layer instead: the fp32 router scores and the gates' sum, T·(4E + 4); per routed (token, expert)
     pair the dispatched token, the expert's output and its gated copy (3·h·w: the combining ``index_add_``
     saves its source; under EP 4·h·w: the expert-parallel combine's ``index_copy_`` saves the experts' output
     too), the expert's SwiGLU (4·He·w), and three int64 indices and two fp32 gates (32 bytes);
     plus the shared expert's 4·T·H·w.

   Tensor parallelism divides the attention and FFN terms by t. Without sequence parallelism the norms and
   the two gathered inputs are whole on every rank; with it the norms are divided by t, and the gathered
   inputs too only with ``sp_regather`` (DTensor's column-parallel matmul saves the input it gathered). An MoE
   layer under TP works on its rank's tokens only, so its terms divide by t, and its input is not gathered.
   Context parallelism divides T, except that ``cp_attention = allgather`` saves the gathered keys and values of the
   whole sequence. Activation checkpointing (mesh/activation_checkpoint.py): ``full`` keeps only the block's
   input (T·h·w, /t with SP), and backward rebuilds one block at a time (the largest block's ``none`` bytes
   once per rank); ``selective`` keeps the block input and the outputs of the matmuls (every second one of
   each kind, ``mm`` and ``addmm`` counted apart, for ``selective``), of attention and of the reduce-scatters and
   all-to-alls (mesh/ac_policies.py: under TP with SP the reduce-scatters' outputs divide by t; the all-gathers'
   whole-sequence outputs, and without SP the all-reduces', are recomputed; the column-parallel outputs divide by t,
   and the row-parallel matmuls' outputs are not kept), and rebuilds the elementwise rest (and under TP wo and w2,
   and the recomputed collectives) one block at a time.
4. **In flight** (``chunks_in_flight``): how many (stage, micro-batch) chunks a rank holds at once, from the
   order in which each of torch's schedules runs its actions (``_get_warmup_ops`` and the V-schedules'
   warm-up in torch/distributed/pipelining/schedules.py; docs/pipeline_parallel.md section 4 counts them
   from torch's own action lists, and tests/test_memory_estimate.py checks every formula against them). With
   m micro-batches, pp ranks, rank r and v stages per rank:

   - GPipe: m; 1F1B: min(m, pp - r);
   - Interleaved1F1B: min(v·m, (v - 1)·q + 2·(pp - 1 - r) + 1), q = m // max(1, m // pp) micro-batches
     per round (the warm-up forwards, plus the first steady-state forward before the first backward);
     LoopedBFS: v·m (all forwards first);
   - InterleavedZeroBubble: min(v·m, (v - 1)·q + (pp - 1 - r) + 1) (counted until the input-gradient half;
     a chunk keeps its matmul inputs a little longer, until its weight-gradient half);
   - ZBVZeroBubble: min(2m, 2·pp, m + 1 + r); DualPipeV: min(2m, 2·pp + 1). From 2·pp - 1 micro-batches on, both are
     flat across the ranks (2·pp and 2·pp + 1 chunks).

   A chunk is one stage's layers for one micro-batch. The chunks in flight are not spread evenly over a rank's
   stages, nor are the stages the same size (``stage_chunks_in_flight``: the first n forwards in the schedule's
   own order), so a rank's activations are each stage's chunks in flight times that stage's chunk. Without pipelining a rank holds one micro-batch (accumulation runs them one
   after the other).
   A rank running several stages holds each stage's unsharded gradients only from that stage's first backward
   to its last, and under ZBVZeroBubble a chunk past its input-gradient pass keeps the gradients its
   weight-gradient pass reads (``weight_gradient_bytes``): its peak is the largest of the moments
   ``stage_backward_peak`` lists.
5. **Logits** (``logits_bytes``), on the rank holding the last stage: the bytes per logit at the peak around
   the loss (``bytes_per_logit``, from what the cross-entropy keeps: 12 in bf16 on one process, 16 under TP's
   loss-parallel cross-entropy, 2 more with pipelining, which keeps the stage's output; measured by
   measure/logits_memory.py and the simulation), plus the saved log-softmax (and pipelined, the stage's output)
   for every other micro-batch the last stage holds in flight; logits are split over tp by the vocabulary-parallel loss.

Not counted: the CUDA context and kernels' workspaces, NCCL's buffers, the allocator's fragmentation, the
optimizer step's temporaries, the data loader, and anything torch.compile changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mesh.ac_policies import MATMUL_COUNTS, SELECTIVE, keeps_matmul

if TYPE_CHECKING:  # (no planning.plan import, even here: planning/plan.py may import this module)
    from models.llama import ModelArgs
    from planning.layout import Layout

STATE_BYTES = 16  # fp32 weights 4 + fp32 gradients 4 + Adam m, v 8, per owned parameter
ROUTING_BYTES = 32  # per routed (token, expert) pair: three int64 indices, two fp32 gates (models/moe.py: MoE)


# ---- 1. parameters and states ----------------------------------------------------------------------------


def block_parameters(args: ModelArgs, layer_id: int) -> dict[str, int]:
    """A block's parameters by split: ``tp`` (an MoE router and shared expert included), ``whole`` (norms), ``experts``
    (over ep); they add up to ``args.layer_params``."""
    kv = args.n_kv_heads * args.head_dim
    attention = 2 * args.dim * args.dim + 2 * args.dim * kv
    dense_ffn = 3 * args.dim * args.hidden_dim
    if not args.is_moe_layer(layer_id):
        return {"tp": attention + dense_ffn, "whole": 2 * args.dim, "experts": 0}
    m = args.moe
    shared = dense_ffn if m.n_shared_experts else 0
    return {
        "tp": attention + args.dim * m.n_experts + shared,
        "whole": 2 * args.dim,
        "experts": 3 * m.n_experts * args.dim * m.hidden_dim,
    }


def stage_parameters(args: ModelArgs, layers, first: bool, last: bool) -> dict[str, int]:
    """The parameters of a stage holding ``layers`` (the embedding on the first stage, norm and head on the last)."""
    total = {"tp": 0, "whole": 0, "experts": 0}
    for i in layers:
        for key, n in block_parameters(args, i).items():
            total[key] += n
    # Vocabulary-parallel under tp. Tied embeddings: one weight where a stage holds both ends (no pipeline);
    # the first and the last pipeline stage each hold a copy (mesh/tied_embeddings.py).
    vocab_tables = 1 if args.tie_embeddings and first and last else int(first) + int(last)
    total["tp"] += args.vocab_size * args.dim * vocab_tables
    total["whole"] += args.dim if last else 0  # the final norm
    return total


def rank_parameters(args: ModelArgs, layout: Layout, params: dict[str, int]) -> float:
    """How many of ``params`` one rank owns after TP, EP and FSDP (item 1 of the module docstring)."""
    shards = layout.dp_shard * layout.cp if layout.fsdp else 1
    # experts: ep ranks borrowed from dp_shard x cp x tp (mesh/dims.py), FSDP over the rest (efsdp), so under FSDP
    # they are split over all of dp_shard x cp x tp; without ep they stay whole on every tp rank
    expert_shards = layout.dp_shard * layout.cp * (layout.tp if layout.ep > 1 else 1)
    experts = params["experts"] / (expert_shards if layout.fsdp else layout.ep)
    return params["tp"] / (layout.tp * shards) + params["whole"] / shards + experts


def states_bytes(args: ModelArgs, layout: Layout, params: dict[str, int]) -> float:
    """Item 1: 16 bytes per owned parameter; none on the device with CPU offload."""
    return 0.0 if layout.fsdp_cpu_offload else STATE_BYTES * rank_parameters(args, layout, params)


def gathered_parameters(layout: Layout, params: dict[str, int]) -> float:
    """Parameters of ``params`` this rank holds gathered: TP and EP still split them, FSDP does not."""
    return params["tp"] / layout.tp + params["whole"] + params["experts"] / layout.ep


def token_split_parameters(args: ModelArgs, layer_id: int) -> int:
    """An MoE layer's router and shared expert: counted with what tp splits (``block_parameters``, for their
    states: FSDP shards them over dp_shard x cp x tp), but whole on every tp rank once gathered, since under TP
    each tp rank runs them on its own tokens (mesh/moe_token_split.py: TokenSplitMoE)."""
    if not args.is_moe_layer(layer_id):
        return 0
    shared = 3 * args.dim * args.hidden_dim if args.moe.n_shared_experts else 0
    return args.dim * args.moe.n_experts + shared


def gathered_block(args: ModelArgs, layout: Layout, layer_id: int) -> float:
    """Block ``layer_id``'s parameters gathered on this rank: ``gathered_parameters``, the token-split ones whole."""
    whole = token_split_parameters(args, layer_id) * (1 - 1 / layout.tp)
    return gathered_parameters(layout, block_parameters(args, layer_id)) + whole


def gathered_bytes(args: ModelArgs, layout: Layout, layers, first: bool, last: bool) -> float:
    """Item 2: FSDP's unsharded copies of the weights (and gradients) this rank computes with."""
    if not layout.fsdp:
        return 0.0
    w = layout.dtype_bytes
    if layout.pp > 1:
        root = gathered_parameters(layout, stage_parameters(args, [], first, last))
        # Under TP the vocabulary-parallel embedding's gradient comes out for the whole vocabulary, and FSDP2
        # accumulates it across the micro-batches in fp32 at that size (measured by the simulation, docs/combining.md
        # Appendix F: +3.4 GiB on Llama 3 70B's first pipeline rank). It exists from the first stage's first backward
        # on, which is the rank's activation peak under 1F1B and GPipe. A rank with several stages is counted by
        # stage_backward_peak (each stage's gradients from its first backward); here, for such schedules, only
        # pipeline_split's per-stage shares, which leave the gradient out under the looped schedules (their stage 0
        # runs its first backward after the rank's other stages have freed most chunks).
        looped = layout.pp_schedule in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
        whole_embedding_grad = 4 * args.vocab_size * args.dim * (1 - 1 / layout.tp) if first and not looped else 0.0
        return (w + 4) * (root + sum(gathered_block(args, layout, i) for i in layers)) + whole_embedding_grad
    grad_w = w + (4 if w != 4 else 0)  # the unsharded gradient, and in bf16 its fp32 copy for the reduce-scatter
    blocks = sorted((gathered_block(args, layout, i) for i in layers), reverse=True)
    root = gathered_parameters(layout, stage_parameters(args, [], first, last))
    head = args.vocab_size * args.dim / layout.tp if last else 0.0
    block_grad = grad_w * (blocks[0] if blocks else 0.0)
    if args.tie_embeddings and first and last:  # one unit holds the table (and the norm), used at both ends
        return w * (root + sum(blocks[:2])) + w * head + block_grad
    embedding = args.vocab_size * args.dim / layout.tp if first else 0.0
    head_end = w * (root - embedding + sum(blocks[:2])) + w * head + block_grad  # the head's backward
    embedding_end = 2 * w * embedding + block_grad  # the embedding's backward, last: it, its gradient, a block's
    return max(head_end, embedding_end)


# ---- 3. activations ----------------------------------------------------------------------------------------


def layer_activation_terms(args: ModelArgs, layer_id: int, layout: Layout, mode: str) -> dict[str, float]:
    """Bytes one block keeps for backward for one micro-batch on this rank, by term (item 3 of the docstring)."""
    n, h, a, w, t = layout.tokens, args.dim, args.n_heads, layout.dtype_bytes, layout.tp
    g = args.n_kv_heads * args.head_dim
    sp = layout.sp
    moe = args.is_moe_layer(layer_id)
    shard = t if sp else 1  # what divides the sequence-sharded parts (the residual stream, the norms)
    kv_tokens = (
        layout.sequences_per_microbatch * layout.seq_len if layout.cp > 1 and layout.cp_attention == "allgather" else n
    )
    if mode == "full":
        return {"input": n * h * w / shard}
    if mode in SELECTIVE:
        # the block's matmuls in forward order, (output bytes on this rank, row-parallel, op), and which of them
        # the policy keeps (mesh/ac_policies.py: the table the policy itself reads; mm and addmm numbered apart);
        # under TP a row-parallel output is recomputed (a whole partial sum)
        qkv = "addmm" if args.qkv_bias else "mm"
        matmuls = [
            (n * h * w / t, False, qkv),
            (n * g * w / t, False, qkv),  # wk, wv: this rank's tokens (CP's gathered K and V are recomputed)
            (n * g * w / t, False, qkv),
        ]
        matmuls.append((n * h * w, t > 1, "mm"))  # wo
        if not moe:  # w1, w3, w2 (an MoE layer's matmuls: selective_ffn_bytes)
            matmuls += [(n * args.hidden_dim * w / t, False, "mm")] * 2 + [(n * h * w, t > 1, "mm")]
        kept, count = [], dict.fromkeys(MATMUL_COUNTS, 0)
        for nbytes, row, op in matmuls:
            count[op] += 1
            kept += [nbytes] if keeps_matmul(mode, count[op], row) else []
        terms = {
            "input": n * h * w / shard,
            "attention": (n * h * w + 4 * n * a) / t,  # attention's output and its log-sum-exp
            "matmuls": sum(kept),
            "ffn": selective_ffn_bytes(args, layer_id, layout, mode),
        }
        if t > 1 and sp:  # kept collective outputs: the reduce-scatters' after wo and w2 (an MoE layer: after wo)
            terms["collectives"] = n * h * w * (1 if moe else 2) / shard
        return terms
    norm = n * h * w + 4 * n  # the input and the fp32 rsqrt (models/llama.py: _RMSNormFunction)
    terms = {
        "norms": 2 * norm / shard,
        "gathered": (1 if moe else 2) * n * h * w / (t if sp and layout.sp_regather else 1),
        "attention": (2 * n * h * w + 2 * kv_tokens * g * w + 4 * n * a) / t,
    }
    if moe:
        terms["gathered"] += n * h * w / t  # the MoE block's input: this rank's tokens only (TokenSplitMoE)
    terms["ffn"] = ffn_activation_bytes(args, layer_id, layout)
    return terms


def ffn_activation_bytes(args: ModelArgs, layer_id: int, layout: Layout) -> float:
    """The FFN's share of ``layer_activation_terms`` without checkpointing: a SwiGLU, or an MoE layer."""
    n, w, t = layout.tokens, layout.dtype_bytes, layout.tp
    if not args.is_moe_layer(layer_id):
        return 4 * n * args.hidden_dim * w / t
    m = args.moe
    routed = n / t * m.top_k  # TokenSplitMoE: each tp rank routes its own tokens
    shared = 4 * n / t * args.hidden_dim * w if m.n_shared_experts else 0.0
    per_token = 4 * m.n_experts + 4  # the fp32 router scores, the sum that renormalises the gates
    # per routed pair, dim-wide: the experts' input, the gated output (index_add_ saves its source) and the output
    # before the gate; under EP also the experts' own output before the combine (index_copy_ saves its source)
    kept = 4 if layout.ep > 1 else 3
    return n / t * per_token + routed * (kept * args.dim * w + 4 * m.hidden_dim * w + ROUTING_BYTES) + shared


def selective_ffn_bytes(args: ModelArgs, layer_id: int, layout: Layout, mode: str = "selective_keep_mm") -> float:
    """An MoE layer's activation bytes under a selective ``mode`` (router, topk, expert and shared-expert matmuls, EP
    all-to-alls); a dense layer: 0, its matmuls are in the block's list."""
    n, w, t, h = layout.tokens, layout.dtype_bytes, layout.tp, args.dim
    if not args.is_moe_layer(layer_id):
        return 0.0
    m = args.moe
    routed = n / t * m.top_k
    exchanged = 2 * h * w if layout.ep > 1 else 0.0  # dispatched and combined tokens
    # after attention's mm (wq, wk, wv, wo; wo alone when wq, wk, wv are addmm: qkv_bias) the router's mm, then the
    # shared expert's w1, w3, w2; the experts' grouped matmuls are kept by every selective policy (mesh/ac_policies.py)
    before = 1 if args.qkv_bias else 4
    router = n / t * m.n_experts * w if keeps_matmul(mode, before + 1) else 0.0
    shared = 0.0
    if m.n_shared_experts:
        widths = (args.hidden_dim, args.hidden_dim, h)
        shared = sum(width * n / t * w for i, width in enumerate(widths, start=before + 2) if keeps_matmul(mode, i))
    return router + routed * ((2 * m.hidden_dim + h) * w + 12 + exchanged) + shared


def weight_gradient_bytes(args: ModelArgs, layer_id: int, layout: Layout) -> float:
    """Bytes a zero-bubble schedule's input-gradient pass keeps per block for the weight-gradient pass that runs later
    (torch/distributed/pipelining/_backward.py: ``stage_backward_input`` keeps the gradient flowing into every op that
    reads a weight): in the compute dtype, per token of this rank, the outputs of wq, wk and wv (h + 2g over t), of
    wo and w2 (whole partial sums under TP: h each), of w1 and w3 (H over t each) and of the two norms (h, over t
    with SP); an MoE layer's router (E), shared expert (2H + h) and experts (per routed pair 2He + h) on the rank's
    own tokens instead of w1, w3 and w2."""
    n, h, w, t = layout.tokens, args.dim, layout.dtype_bytes, layout.tp
    g = args.n_kv_heads * args.head_dim
    shard = t if layout.sp else 1
    attention = n * (h + 2 * g) / t + n * h + 2 * n * h / shard
    if not args.is_moe_layer(layer_id):
        return w * (attention + 2 * n * args.hidden_dim / t + n * h)
    m = args.moe
    local = n / t
    shared = local * (2 * args.hidden_dim + h) if m.n_shared_experts else 0.0
    return w * (attention + local * m.n_experts + shared + local * m.top_k * (2 * m.hidden_dim + h))


def layer_activation_bytes(args: ModelArgs, layer_id: int, layout: Layout, mode: str | None = None) -> float:
    """Item 3 in one number: bytes block ``layer_id`` keeps for one micro-batch under ``mode`` (default: the
    layout's ``activation_checkpoint``)."""
    return sum(layer_activation_terms(args, layer_id, layout, mode or layout.activation_checkpoint).values())


def rebuild_bytes(args: ModelArgs, layers, layout: Layout) -> float:
    """With checkpointing, backward rebuilds one block at a time: the largest block's unsaved bytes, once."""
    if layout.activation_checkpoint == "none" or not layers:
        return 0.0
    return max(
        layer_activation_bytes(args, i, layout, "none") - layer_activation_bytes(args, i, layout) for i in layers
    )


# ---- 4. in flight ----------------------------------------------------------------------------------------


def chunks_in_flight(schedule: str, pp: int, pp_rank: int, microbatches: int, stages_per_rank: int) -> int:
    """(stage, micro-batch) chunks rank ``pp_rank`` holds at its peak under ``schedule`` (item 4)."""
    m, v, r = microbatches, stages_per_rank, pp_rank
    if pp == 1:
        return 1
    per_round = m // max(1, m // pp)
    counts = {
        "GPipe": m,
        "1F1B": min(m, pp - r),
        "Interleaved1F1B": min(v * m, (v - 1) * per_round + 2 * (pp - 1 - r) + 1),
        "LoopedBFS": v * m,
        "InterleavedZeroBubble": min(v * m, (v - 1) * per_round + (pp - 1 - r) + 1),
        "ZBVZeroBubble": min(2 * m, 2 * pp, m + 1 + r),
        "DualPipeV": min(2 * m, 2 * pp + 1),
    }
    return counts[schedule]


def stage_chunks_in_flight(schedule: str, pp: int, pp_rank: int, microbatches: int, stages_per_rank: int) -> list[int]:
    """Of ``chunks_in_flight``, how many belong to each of the rank's stages (in the rank's stage order), at the moment
    the count peaks: the first n forwards in the order the schedule runs them (n = ``chunks_in_flight``).

    Why per stage: the rank's stages need not be the same size (planning/pipeline_split.py balances memory, so the
    last rank's interleaved stages are 3 layers and 1 at Llama 3 70B), and the chunks in flight are not spread
    evenly over them: under Interleaved1F1B the last rank runs every forward of its first stage before the first
    backward of its second, so it holds m chunks of one and 1 of the other. Counting the rank's mean chunk instead
    missed 8 GiB there (+31% in the simulation, docs/combining.md Appendix F). The orders, from torch's
    ``_get_warmup_ops`` and the V-schedules' warm-up (tests/test_memory_estimate.py checks them against torch's
    own action lists):

    - looped schedules run forwards in rounds of q = m // max(1, m // pp) micro-batches per stage (GPipe and
      LoopedBFS: one round of m), stage after stage, then round after round: the first n of that order;
    - ZBVZeroBubble and DualPipeV reach their second (mirrored) stage's first backward after r + 1 of its
      forwards: it holds min(m, r + 1), the first stage the rest.
    """
    m, v, r = microbatches, stages_per_rank, pp_rank
    n = chunks_in_flight(schedule, pp, r, m, v)
    if pp == 1 or v == 1:
        return [n] + [0] * (v - 1)
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        second = min(m, r + 1, n)
        return [n - second, second]
    per_round = m if schedule in ("GPipe", "LoopedBFS") else m // max(1, m // pp)
    held = [0] * v
    left = n
    while left > 0:
        for k in range(v):
            take = min(per_round, m - held[k], left)
            held[k] += take
            left -= take
    return held


# ---- 5. logits, and the whole rank -------------------------------------------------------------------------


def bytes_per_logit(layout: Layout) -> tuple[int, int]:
    """Bytes per logit of this rank's shard (b·s·V/tp logits): at the peak around the loss, and for each other
    micro-batch the last stage holds waiting for its backward; counted from what training/loss.py's
    ``token_loss_sum`` (``.float()``, then a summed cross-entropy) keeps alive, in the compute dtype w.

    - One process (tp = 1), aten's fused ``_log_softmax`` and ``nll_loss``: forward keeps the logits (w), their
      fp32 copy (4, none in fp32) and the log-softmax (4); backward the saved log-softmax (4), ``nll_loss``'s
      gradient (4) and the log-softmax's input gradient (4): 10 and 12 bytes in bf16.
    - Under TP, ``loss_parallel`` (torch/distributed/tensor/parallel/loss.py) computes the log-softmax on the
      vocabulary shard in steps, each an fp32 tensor of the shard's size: forward keeps the logits (w), the fp32
      copy x (4), ``shifted = x - max`` (4) and ``exp(shifted)`` (4), then the result replaces the exponentials;
      its fused backward keeps the saved log-softmax (4) and builds ``zeros_like`` (4), ``exp`` of the
      log-softmax (4) and their sum (4) before scaling it: 14 and 16 bytes in bf16.
    - Under pipelining torch's ``PipelineStage`` keeps the stage's output, the logits (w), in its forward cache
      until that micro-batch's backward, so backward holds them too (+2 in bf16: 14 one process, 18 under TP).

    ``python -m measure.logits_memory`` measures the tp = 1 and tp = 2 cases without pipelining (10 and 12, 14 and
    16); the simulation (docs/combining.md, Appendix F) measures 18 on Llama 3 70B's and the MoE's last rank. A
    micro-batch waiting for its backward keeps the log-softmax (4) and, under pipelining, the stage's output (w).
    """
    w = layout.dtype_bytes
    copy = 4 if w != 4 else 0  # .float() copies only a narrower dtype
    stage_output = w if layout.pp > 1 else 0
    if layout.tp > 1:
        forward, backward = w + copy + 4 + 4, 4 + 4 + 4 + 4 + stage_output
    else:
        forward, backward = w + copy + 4, 4 + 4 + 4 + stage_output
    return max(forward, backward), 4 + stage_output


def logits_bytes(args: ModelArgs, layout: Layout, held: int = 1) -> float:
    """Item 5: the peak around the loss, plus what ``held - 1`` other micro-batches keep (``bytes_per_logit``)."""
    logits = layout.tokens * args.vocab_size / layout.tp
    peak, kept = bytes_per_logit(layout)
    return logits * (peak + kept * max(0, held - 1))


@dataclass(frozen=True)
class RankMemory:
    states: float
    gathered: float
    activations: float
    logits: float

    @property
    def total(self) -> float:
        return self.states + self.gathered + self.activations + self.logits


def rank_memory(
    args: ModelArgs,
    layout: Layout,
    stage_layers: list[list[int]] | tuple[tuple[int, ...], ...],
    pp_rank: int = 0,
    stage_ids: list[int] | tuple[int, ...] = (0,),
) -> RankMemory:
    """Bytes pipeline rank ``pp_rank`` holds at its peak; ``stage_layers`` lists every stage's layer ids and
    ``stage_ids`` are the stages this rank runs (mesh/pipeline.py: stage_ids_of_rank)."""
    n_stages = len(stage_layers)
    first, last = 0 in stage_ids, n_stages - 1 in stage_ids
    layers = [i for s in stage_ids for i in stage_layers[s]]
    params = stage_parameters(args, layers, first, last)
    states = states_bytes(args, layout, params)
    rebuild = rebuild_bytes(args, layers, layout)
    if layout.pp > 1 and layout.fsdp and len(stage_ids) > 1:
        gathered, activations, logits = stage_backward_peak(args, layout, stage_layers, pp_rank, stage_ids)
        return RankMemory(states=states, gathered=gathered, activations=activations + rebuild, logits=logits)
    activations = in_flight_activations(args, layout, stage_layers, pp_rank, stage_ids)[0]
    return RankMemory(
        states=states,
        gathered=gathered_bytes(args, layout, layers, first, last),
        activations=activations + rebuild,
        logits=logits_bytes(args, layout, last_stage_held(layout)) if last else 0.0,
    )


def stage_gathered_parameters(args: ModelArgs, layout: Layout, stage_layers, stage: int) -> float:
    """Parameters of pipeline stage ``stage`` gathered on this rank (its blocks, and the embedding or the norm and head
    where it holds them): what FSDP keeps unsharded, and what its unsharded gradients cover, for that stage."""
    layers = stage_layers[stage]
    root = gathered_parameters(layout, stage_parameters(args, [], stage == 0, stage == len(stage_layers) - 1))
    return root + sum(gathered_block(args, layout, i) for i in layers)


def finished_before_next_stage(schedule: str, pp: int, pp_rank: int, microbatches: int) -> bool:
    """Whether a rank's stage runs all its backwards before the rank's next stage (in backward order) runs its first,
    read from torch's action lists (tests/test_memory_estimate.py checks it): the looped schedules run q = m // max(1,
    m // pp) backwards of a stage per round (LoopedBFS: all m), the V-schedules pp - r of the second stage before the
    first stage's first backward."""
    m = microbatches
    if schedule == "LoopedBFS":
        return True
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        return pp - pp_rank >= m
    return m // max(1, m // pp) >= m


def stage_backward_peak(
    args: ModelArgs,
    layout: Layout,
    stage_layers: list[list[int]] | tuple[tuple[int, ...], ...],
    pp_rank: int,
    stage_ids: list[int] | tuple[int, ...],
) -> tuple[float, float, float]:
    """Items 2, 4 and 5 for a rank that runs several pipeline stages: (gathered, activations, logits) at its peak.

    torch keeps each stage's units gathered for the whole step (the compute dtype, every stage at once), but a
    stage's unsharded fp32 gradients exist only from that stage's first backward to its last, when FSDP
    reduce-scatters and frees them (torch/distributed/pipelining/stage.py: backward_maybe_with_nosync). The rank's
    stages run their first backwards from the highest stage id down (the looped schedules' last stage, the
    V-schedules' mirrored one), so the peak is the larger of:

    - the rank's first backward: the most chunks in flight (``stage_chunks_in_flight``), the gradients of that
      stage alone, and the logits when it is the model's last stage;
    - each later stage's first backward, once it has run through the stage (its first chunk freed, its gradients
      all allocated): its gradients, and those of the stages before it in backward order that have not finished
      (``finished_before_next_stage``: a finished stage holds neither gradients nor chunks), with the same chunks
      otherwise. For stage 0 under TP the embedding's backward ends it: its gradient comes out for the whole
      vocabulary in the compute dtype and FSDP casts it to fp32 (item 2), both alive at once.

    Counting every stage's gradients at once missed on the MoE: 5 GiB at the interleaved last rank, whose first
    stage has run no backward at the peak, and 7 GiB at ZBV's first rank (docs/combining.md, Appendix F).
    """
    w = layout.dtype_bytes
    sizes = {s: stage_gathered_parameters(args, layout, stage_layers, s) for s in stage_ids}
    weights = w * sum(sizes.values())
    # item 2: the fp32 accumulator beyond the rank's own shard; at the embedding's backward also the gradient it
    # casts, the whole table in the compute dtype (0 without TP: the gradient is then the shard itself)
    whole_embedding = 4 * args.vocab_size * args.dim * (1 - 1 / layout.tp)
    cast_embedding = w * args.vocab_size * args.dim if layout.tp > 1 else 0.0

    def gradients(s: int) -> float:
        return 4 * sizes[s] + (whole_embedding if s == 0 else 0.0)

    held = dict(
        zip(
            stage_ids,
            stage_chunks_in_flight(layout.pp_schedule, layout.pp, pp_rank, layout.pp_microbatches, len(stage_ids)),
            strict=True,
        )
    )
    chunk = {s: sum(layer_activation_bytes(args, i, layout) for i in stage_layers[s]) for s in stage_ids}
    order = sorted(stage_ids, reverse=True)  # the order of the stages' first backwards
    finished = finished_before_next_stage(layout.pp_schedule, layout.pp, pp_rank, layout.pp_microbatches)
    last = len(stage_layers) - 1
    zero_bubble = layout.pp_schedule == "ZBVZeroBubble"
    kept = {s: sum(weight_gradient_bytes(args, i, layout) for i in stage_layers[s]) for s in stage_ids}
    moments = [
        (
            weights + gradients(order[0]),
            # under ZBV the first backward is an input-gradient pass, which keeps its chunk's weight-gradient inputs
            sum(held[s] * chunk[s] for s in stage_ids) + (kept[order[0]] if zero_bubble else 0.0),
            logits_bytes(args, layout, last_stage_held(layout)) if order[0] == last else 0.0,
        )
    ]
    pp, r, m = layout.pp, pp_rank, layout.pp_microbatches
    if zero_bubble and m >= 2 * pp - 1:
        # ZBV's cool-down (torch's action lists, tests/test_memory_estimate.py): with m >= 2pp - 1 rank r runs 2r + 1
        # input-gradient passes before their weight-gradient passes, holding pp + r chunks, 2r + 1 of them with their
        # weight-gradient inputs; every stage has started and none finished
        mean_chunk = sum(chunk.values()) / len(chunk)
        mean_kept = sum(kept.values()) / len(kept)
        cooldown = min(2 * m, pp + r) * mean_chunk + (2 * r + 1) * mean_kept
        moments.append((weights + sum(gradients(s) for s in stage_ids), cooldown, 0.0))
    for k, stage in enumerate(order[1:], start=1):
        active = [stage] + ([] if finished else order[:k])
        grads = sum(gradients(s) for s in active) + (cast_embedding if stage == 0 else 0.0)
        chunks = sum(held[s] * chunk[s] for s in active + order[k + 1 :]) - chunk[stage] * min(1, held[stage])
        moments.append((weights + grads, chunks, 0.0))
    return max(moments, key=sum)


def in_flight_activations(
    args: ModelArgs,
    layout: Layout,
    stage_layers: list[list[int]] | tuple[tuple[int, ...], ...],
    pp_rank: int = 0,
    stage_ids: list[int] | tuple[int, ...] = (0,),
) -> tuple[float, list[int]]:
    """Item 4: the activations of the chunks rank ``pp_rank`` holds in flight, and how many of each of its stages:
    each stage's count (``stage_chunks_in_flight``) times that stage's own chunk, since stages differ in size."""
    held = stage_chunks_in_flight(layout.pp_schedule, layout.pp, pp_rank, layout.pp_microbatches, len(stage_ids))
    chunks = [sum(layer_activation_bytes(args, i, layout) for i in stage_layers[s]) for s in stage_ids]
    return sum(n * chunk for n, chunk in zip(held, chunks, strict=True)), held


def last_stage_held(layout: Layout) -> int:
    """The last stage's chunks in flight: one for single-stage and looped schedules' last rank per round, all of
    them under GPipe and LoopedBFS (every forward first)."""
    if layout.pp > 1 and layout.pp_schedule in ("GPipe", "LoopedBFS"):
        return layout.pp_microbatches
    return 1


def even_stage_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    """Layers cut into ``n_stages`` contiguous stages whose sizes differ by at most one, the larger ones last
    (the first stage also holds the embedding, the last the head: a simple default when no split is given)."""
    base, extra = divmod(n_layers, n_stages)
    sizes = [base + (1 if s >= n_stages - extra else 0) for s in range(n_stages)]
    bounds = [sum(sizes[:s]) for s in range(n_stages + 1)]
    return [list(range(bounds[s], bounds[s + 1])) for s in range(n_stages)]
