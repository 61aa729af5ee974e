"""Scores that look at what an entry contributes to the attention output: value norms through W_O (CriticalKV-style)
and the exact head-output change of removing an entry (CAOTE). Per query head; the policy folds GQA groups."""

from __future__ import annotations

import torch


def _per_query_head(values: torch.Tensor, query_heads: int) -> torch.Tensor:
    """(H_kv, C, Dv) -> (Hq, C, Dv): each query head sees its group's KV head."""
    return values.repeat_interleave(query_heads // values.shape[0], dim=0)


def projected_value_norm(values: torch.Tensor, o_weight: torch.Tensor, query_heads: int) -> torch.Tensor:
    """‖W_O^h v_j‖ for every query head h and entry j, where W_O^h is the o_proj block of head h.
    values: (H_kv, C, Dv); o_weight: (d_model, Hq * Dv) -> (Hq, C). Uses the Dv×Dv Gram matrix W_O^hᵀ W_O^h so the
    (Hq, C, d_model) projection is never materialised."""
    dv = values.shape[-1]
    w = o_weight.float().reshape(o_weight.shape[0], query_heads, dv).transpose(0, 1)  # (Hq, d, Dv)
    gram = w.transpose(1, 2) @ w  # (Hq, Dv, Dv)
    v = _per_query_head(values.float(), query_heads)  # (Hq, C, Dv)
    squared = ((v @ gram) * v).sum(dim=-1)
    return squared.clamp(min=0).sqrt()


def value_weighted_attention(weights: torch.Tensor, values: torch.Tensor, o_weight: torch.Tensor) -> torch.Tensor:
    """Attention summed over the probe rows times ‖W_O^h v_j‖, per query head. weights: (Hq, W, C) -> (Hq, C)."""
    return weights.float().sum(dim=1) * projected_value_norm(values, o_weight, weights.shape[0])


def output_change(weights: torch.Tensor, output: torch.Tensor, values: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """CAOTE: ‖Δo‖ = a/(1−a)·‖o_{t,h} − v_j‖, the exact change of head h's output at probe t when entry j is
    removed from the softmax, summed over the probe rows. weights: (Hq, W, C); output: (Hq, W, Dv) head outputs;
    values: (H_kv, C, Dv) -> (Hq, C). 1−a is clamped at `eps` (an entry holding all the attention)."""
    a = weights.float()
    o = output.float()
    v = _per_query_head(values.float(), a.shape[0])
    dist2 = (o * o).sum(-1)[..., None] - 2 * (o @ v.transpose(1, 2)) + (v * v).sum(-1)[:, None, :]
    dist = dist2.clamp(min=0).sqrt()  # (Hq, W, C)
    return (a / (1 - a).clamp(min=eps) * dist).sum(dim=1)
