"""Which experts a token goes to, and with what weight: the routing rules of the MoE families.

``choose_experts(scores, bias, args)`` takes the router's scores (batch, seq, E), fp32: softmax (Mixtral,
Qwen-MoE, OLMoE, the card's default) or sigmoid (DeepSeek-V3) of a linear map, and returns the chosen expert
ids and their gates, (batch, seq, k) each:

1. **Selection** ranks ``scores + bias``: the bias (DeepSeek-V3's ``e_score_correction_bias``, meshloom's
   aux-loss-free balancing) moves only which experts win, never their weights.
2. **Group limit** (DeepSeek-V3, ``n_groups > 1``): the experts form n_groups equal groups; a group's score
   is the sum of its two best biased scores; each token keeps the ``topk_groups`` best groups and picks its
   top-k among their experts only (the others are masked to -inf).
3. **Gates** are the *unbiased* scores of the chosen experts, renormalised to sum to 1 when ``route_norm``
   (Mixtral always; Qwen-MoE and OLMoE: ``norm_topk_prob``; DeepSeek-V3: ``norm_topk_prob``, plus 1e-20),
   then multiplied by ``route_scale`` (DeepSeek-V3's ``routed_scaling_factor``; 1 elsewhere).

| family      | scores  | renormalised       | bias | groups | scale |
|-------------|---------|--------------------|------|--------|-------|
| Mixtral     | softmax | always             | -    | -      | 1     |
| Qwen2/3-MoE | softmax | norm_topk_prob     | -    | -      | 1     |
| OLMoE       | softmax | norm_topk_prob     | -    | -      | 1     |
| DeepSeek-V3 | sigmoid | norm_topk_prob     | yes  | yes    | routed_scaling_factor |
"""

from __future__ import annotations

import torch


def limit_groups(biased: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """``biased`` (..., E) with the experts outside each token's ``topk_groups`` best groups set to -inf."""
    grouped = biased.unflatten(-1, (n_groups, -1))  # (..., G, E/G)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (..., G): the sum of each group's best two
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
        -1, group_scores.topk(topk_groups, dim=-1).indices, True
    )
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)


def choose_experts(scores: torch.Tensor, bias: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-3 of the module docstring: (chosen expert ids, their gates), (batch, seq, top_k) each. ``args``:
    models/moe.py's MoEArgs (not imported: moe.py imports this file)."""
    biased = scores + bias
    if args.n_groups > 1:
        biased = limit_groups(biased, args.n_groups, args.topk_groups)
    _, chosen = torch.topk(biased, args.top_k, dim=-1)
    gates = scores.gather(-1, chosen)
    if args.route_norm:
        gates = gates / (gates.sum(-1, keepdim=True) + (1e-20 if args.score_func == "sigmoid" else 0.0))
    if args.route_scale != 1.0:
        gates = gates * args.route_scale
    return chosen, gates
